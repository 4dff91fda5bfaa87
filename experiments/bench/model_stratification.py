"""FedHydra model stratification (MS) and one DENSE distillation epoch: jfed vs PyTorch.

    python -m experiments.bench.model_stratification [--clients=5] [--classes=10] [--T_G=30]
        [--ms_batch=8] [--g_steps=30] [--synthesis_batch=64] [--pool=1024] [--kd_batch=128]
        [--nz=256] [--ngf=64] [--stages=ms,dense,hydra_kd] [--forms=python,loop,batched,torch]
        [--scan_runs=1] [--seq_runs=0] [--out=FILE.json]

From Python: `run(Sizes(...))` returns the table and raw numbers as a dict
(`experiments.bench.all` calls it).

Stage 1, MS (FedHydra, Bai et al., KDD 2025, Algorithm 2): m clients × c classes independent
generator trainings, each a fresh DENSE generator (nz, ngf; 28×28×1 output) and fixed z ~ N(0, I) of
`ms_batch` images, `T_G` Adam(lr 1e-3, betas (0.5, 0.999)) steps on CE(F_k(G(z)), j) with F_k a
fixed CNNMnist (the clients' models; random weights, the work does not depend on them). Forms:
  - jfed batched: `jfed.distill.model_stratification` — ONE jitted program (vmap over the m·c
    runs of a lax.scan over the T_G steps). Its variants run only when named in --forms:
    `batched_clients` (layout='clients': vmap over clients, then over classes sharing the
    client's weights), `batched_matmul` (the generators' convolutions as matmuls,
    `conv_impl='matmul'`) and `batched_clients_matmul` (both), to find why batched MS misses
    its accelerator goal; `batched_bf16` and `batched_clients_bf16` compute in bf16 with
    float32 parameters and Adam state (FedHydra's `ms_compute_dtype='bfloat16'`), each form's
    TFLOP/s compared with the device's dense peak for its dtype (`DENSE_PEAK_TFLOPS`);
  - jfed loop:    `jfed.distill.model_stratification_loop` — the same jitted single-run program
    (lax.scan over T_G) called once per (k, j);
  - jfed python:  `jfed.distill.model_stratification_python` — the same run as T_G
    calls of one jitted step (same numbers; FedHydra's `ms_impl='auto'` on CPU);
  - PyTorch:      the reference structure (FL-SA `interview`): a Python loop over (k, j), each
    building a generator, DENSE `reset_model`, Adam, T_G steps; torch.set_num_threads(CPUs),
    on CUDA when the JAX backend is a GPU and torch sees one.
On a CPU backend the two lax.scan forms take ~1 s per generator step (XLA:CPU runs convolutions
inside scan very slowly), so by default they are timed on `--scan_runs` (1) run of client 0 and
the full stage is extrapolated per step; `--scan_runs=0` times all m·c runs (~25 min each).
`--seq_runs=N` times the one-run-at-a-time forms (python, loop, torch) on their first N runs and
extrapolates per run (every run does the same work): for m·c = 1000 on an accelerator.
Stage 2, one DENSE distillation epoch (as `github.com/zj-jayzhang/DENSE` `helpers/synthesizers.py`
and `loop_df_fl.py:kd_train`): synthesis (fresh generator and z, `g_steps` Adam steps on BN (hooks,
'paper' mode) + CE(mean of m teachers) + masked adversarial KL against the student, RandomCrop(4) +
HFlip view, best batch kept) then one KD pass over a pool of `pool` images (KL T = 20 × T², SGD
0.005 m0.9, HFlip) — jfed (`synthesize` + `distill.kd_step`) vs the same in PyTorch.
Stage 3, FedHydra's KD pass (`hydra_kd`): one shuffled pass over a pool of `pool` images with
m CNNMnist teachers, SA targets (random MS weights) and Eq. 19, timed as the teachers run at
every step (`kd_step`), as the steps take targets computed beforehand (`kd_step_on_targets`,
what FedHydra runs: jfed.methods.oneshot `KDTargets`) and as computing every pool image's
target once (`pool_teacher_logits`); from these per-image times the report gives FedHydra's KD
minutes over the fedhydra_fashion_mnist.py CPU budget in both forms.

Timed calls follow a warm-up call on the same runs that compiles (jfed) / warms up (torch); both
are reported.
The default runtime is about 5–10 minutes on 2 CPU cores; shrink with --ms_batch, --T_G,
--clients, --g_steps, --synthesis_batch, --pool or --stages/--forms/--scan_runs.
The paper does not give the MS batch size b; the default 8 keeps the CPU run short (DENSE's
synthesis batch is 256: `--ms_batch=256` on an accelerator).

Output: a Markdown table (sizes, torch version, load average in the header) with seconds per
call, ms per generator step and the ratios to PyTorch and to the one-run-at-a-time `loop`
form (> 1: the row is faster); it names the fastest
jfed MS form and whether FedHydra's `ms_impl='auto'` (jfed.distill.resolve_ms_impl)
picks it on this backend. `--out` also writes the table and raw numbers as JSON.
"""

import math
import time
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.client_training import torch_model
from experiments.bench.machine import (
  cpu_count,
  environment,
  import_torch,
  load_average,
  log,
  write_json,
)

MS_FORMS = ('python', 'loop', 'batched', 'torch')
# Variants of the batched form, not run by default: (layout, the generator's conv_impl).
# `_clients` nests the vmap (clients, then classes sharing the client's weights) so that the
# teachers' convolutions are grouped over m kernels, not m·c; `_matmul` computes the
# generators' per-run convolutions as batched matmuls (jfed.models.layers, impl='matmul').
BATCHED_FORMS = {
  'batched': ('runs', 'auto', 'float32'),
  'batched_clients': ('clients', 'auto', 'float32'),
  'batched_matmul': ('runs', 'matmul', 'float32'),
  'batched_clients_matmul': ('clients', 'matmul', 'float32'),
  # mixed precision (FedHydra's `ms_compute_dtype='bfloat16'`): G and F_k compute in bf16
  'batched_bf16': ('runs', 'auto', 'bfloat16'),
  'batched_clients_bf16': ('clients', 'auto', 'bfloat16'),
}
# Dense (no sparsity) peak TFLOP/s by compute dtype, from NVIDIA's H100 / H200 SXM datasheets:
# what a form's TFLOP/s is compared with. float32 is the tensor cores' TF32 peak, the precision
# of XLA's default float32 matmuls on these GPUs (the CUDA cores' float32 peak is 67). Devices
# not listed get no fraction.
DENSE_PEAK_TFLOPS = {
  'H100': {'float32': 494.7, 'bfloat16': 989.4},
  'H200': {'float32': 494.7, 'bfloat16': 989.4},
}


def dense_peak_tflops(device_kind: str, dtype: str) -> Optional[float]:
  """The device's dense peak for `dtype`, or None for a device not in DENSE_PEAK_TFLOPS."""
  for name, peaks in DENSE_PEAK_TFLOPS.items():
    if name in device_kind:
      return peaks[dtype]
  return None


VALID_FORMS = MS_FORMS + tuple(f for f in BATCHED_FORMS if f not in MS_FORMS)


class Sizes(NamedTuple):
  """What to run; the defaults are the command line's."""

  clients: int = 5  # m: client models
  classes: int = 10  # c
  T_G: int = 30  # generator steps per MS run (paper: 30)
  ms_batch: int = 8  # images per MS generator batch (b; not given in the paper)
  g_steps: int = 30  # DENSE synthesis steps per epoch (DENSE README: 30)
  synthesis_batch: int = 64  # DENSE: 256
  pool: int = 1024  # images in the pool of the KD pass
  kd_batch: int = 128  # DENSE: 256
  nz: int = 256  # generator noise size (DENSE: 256)
  ngf: int = 64  # generator width (DENSE: 64)
  stages: Tuple[str, ...] = ('ms', 'dense', 'hydra_kd')
  forms: Tuple[str, ...] = MS_FORMS  # torch also gates the DENSE-epoch reference
  # CPU only: time the lax.scan forms (batched, loop) on this many (client, class) runs of
  # client 0 and extrapolate per generator step (~1 s per step on XLA:CPU); 0: all runs.
  scan_runs: int = 1
  # Time the one-run-at-a-time forms (python, loop, torch) on the first this many runs and
  # extrapolate per run (every run does the same work); 0: all m*c runs.
  seq_runs: int = 0
  chunk_size: Optional[int] = None  # batched form: lax.map over chunks of this many runs
  torch: bool = True
  torch_threads: int = 0  # 0: one per CPU


SHAPE = (28, 28, 1)
LR_G = 1e-3
BETAS = (0.5, 0.999)


def twice(fn):
  """(first-call seconds, second-call seconds, second result)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return first, time.perf_counter() - t0, out


# ---------------------------------------------------------------------------------------------
# jfed
# ---------------------------------------------------------------------------------------------
def jfed_teachers(m: int, c: int):
  from jfed.distill import TeacherGroup
  from jfed.engine import init_models
  from jfed.models import get_model

  module = get_model('cnn_mnist', c, SHAPE)
  return TeacherGroup(module, init_models(module, SHAPE, jax.random.PRNGKey(0), m, same_init=False))


def jfed_ms(sz, form: str, teachers, generator, m: int, c: int):
  """MS over the first m clients and c classes with the given form."""
  from jfed.distill import MS_FUNCTIONS, MSConfig, make_generator
  from jfed.engine import take

  cfg = MSConfig(T_G=sz.T_G, lr=LR_G, b1=BETAS[0], b2=BETAS[1], batch_size=sz.ms_batch)
  group = teachers._replace(states=take(teachers.states, np.arange(m)))
  kw, impl = {}, form
  if form in BATCHED_FORMS:
    layout, conv_impl, compute_dtype = BATCHED_FORMS[form]
    cfg = cfg._replace(compute_dtype=compute_dtype)
    kw = {'layout': layout, 'chunk_size': sz.chunk_size}
    generator = make_generator(SHAPE, sz.nz, sz.ngf, conv_impl=conv_impl)
    impl = 'batched'
  return lambda: MS_FUNCTIONS[impl](group, generator, c, jax.random.PRNGKey(1), cfg, **kw).U


def ms_step_gflop(sz, teachers, generator) -> float:
  """GFLOP of one MS generator step (one run, batch sz.ms_batch) by XLA's cost analysis."""
  from jfed.distill import MSConfig, ms_step_flops
  from jfed.engine import take

  cfg = MSConfig(T_G=sz.T_G, lr=LR_G, b1=BETAS[0], b2=BETAS[1], batch_size=sz.ms_batch)
  state = take(teachers.states, 0)
  variables = {'params': state.params, 'batch_stats': state.batch_stats}
  return ms_step_flops(teachers.module, variables, generator, cfg) / 1e9


def jfed_dense_epoch(sz, teachers, generator, c: int):
  from jfed.distill import (
    KDConfig,
    KDPrograms,
    Teachers,
    committed,
    dense_config,
    epoch_batches,
    gather_batch,
    kd_step,
    pool_add,
    pool_init,
    student_state,
    synthesize,
  )
  from jfed.engine import init_model
  from jfed.engine.optim import OptimizerSpec

  student_module = teachers.module
  student = init_model(student_module, SHAPE, jax.random.PRNGKey(2))
  syn = dense_config(g_steps=sz.g_steps, batch_size=sz.synthesis_batch, lr_g=LR_G)
  kcfg = KDConfig(loss='kl', T=20.0, t_squared=True, aggregation='mean', augment='flip')
  ocfg = OptimizerSpec('sgd', lr=0.005, momentum=0.9)
  rng = np.random.default_rng(0)
  pool = pool_init(sz.pool + sz.synthesis_batch, SHAPE, quantize=True)
  pool = pool_add(pool, jnp.asarray(rng.random((sz.pool, *SHAPE), np.float32)))
  pool = committed(pool)
  teachers = teachers._replace(states=committed(teachers.states))
  ts = committed(student_state(ocfg, student))
  programs = KDPrograms(kcfg, ocfg, (teachers.module,), student_module)
  kd_teachers = Teachers((teachers.states,))

  def epoch():
    res = synthesize(generator, teachers, student_module, ts.model, c, jax.random.PRNGKey(3), syn)
    p = pool_add(pool, res.images, res.labels)
    idx, mask = epoch_batches(p, np.random.default_rng(1), sz.kd_batch)
    t = ts
    for b in range(idx.shape[0]):
      t, _ = kd_step(
        programs,
        t,
        kd_teachers,
        *gather_batch(p, jnp.asarray(idx[b])),
        jnp.asarray(mask[b]),
        jax.random.PRNGKey(b),
        0.005,
      )
    return t.model.params

  return epoch


def jfed_hydra_kd(sz, teachers, c: int):
  """FedHydra's KD pass over the pool (Eq. 19 on SA targets), in its two forms: a function per
  form, each returning the trained params: 'per-step teachers' (`kd_step`, the teachers run at
  every step), 'stored targets' (`kd_step_on_targets` on targets computed beforehand) and
  'targets' (`pool_teacher_logits` over the whole pool, what stored targets cost per image)."""
  from jfed.distill import committed, epoch_batches, gather_batch, kd_step, pool_add, pool_init
  from jfed.distill.kd import (
    KD_BLOCK,
    KDConfig,
    KDEpoch,
    KDPrograms,
    Teachers,
    gather_batch_with_targets,
    kd_block,
    kd_block_on_targets,
    kd_step_on_targets,
    pool_teacher_logits,
    student_state,
  )
  from jfed.engine import init_model
  from jfed.engine.optim import OptimizerSpec

  student_module = teachers.module
  student = init_model(student_module, SHAPE, jax.random.PRNGKey(2))
  kcfg = KDConfig(loss='fedhydra', T=1.0, aggregation='sa')
  ocfg = OptimizerSpec('sgd', lr=0.01, momentum=0.9)
  rng = np.random.default_rng(0)
  pool = pool_init(sz.pool, SHAPE, quantize=True)
  labels = rng.integers(0, c, sz.pool).astype(np.int32)
  pool = committed(pool_add(pool, jnp.asarray(rng.random((sz.pool, *SHAPE), np.float32)), labels))
  u = rng.uniform(0.1, 2.0, (c, sz.clients))
  agg = committed((jnp.asarray(u / u.sum(1, keepdims=True)), jnp.asarray(u / u.sum(0))))
  teachers = teachers._replace(states=committed(teachers.states))
  ts = committed(student_state(ocfg, student))
  programs = KDPrograms(kcfg, ocfg, (teachers.module,), student_module)
  kd_teachers = Teachers((teachers.states,), agg)
  idx, mask = epoch_batches(pool, np.random.default_rng(1), sz.kd_batch)

  def targets():
    out = []
    for b in range(idx.shape[0]):
      out.append(pool_teacher_logits(programs, kd_teachers, pool, jnp.asarray(idx[b])))
    return jnp.zeros((sz.pool, c)).at[jnp.asarray(idx.reshape(-1))].set(jnp.concatenate(out))

  stored = targets()

  def per_step():
    t = ts
    for b in range(idx.shape[0]):
      x, y = gather_batch(pool, jnp.asarray(idx[b]))
      t, _ = kd_step(
        programs, t, kd_teachers, x, y, jnp.asarray(mask[b]), jax.random.PRNGKey(b), 0.01
      )
    return t.model.params

  def on_targets():
    t = ts
    for b in range(idx.shape[0]):
      x, tb = gather_batch_with_targets(pool, stored, jnp.asarray(idx[b]))
      t, _ = kd_step_on_targets(programs, t, x, tb, jnp.asarray(mask[b]), 0.01)
    return t.model.params

  epoch = KDEpoch(idx, mask, np.full(idx.shape[0], 0.01, np.float32))
  key = jax.random.PRNGKey(0)

  def per_step_blocks():
    t = ts
    for first in range(0, idx.shape[0], KD_BLOCK):
      t, _, _ = kd_block(programs, t, kd_teachers, pool, epoch, key, first)
    return t.model.params

  def on_targets_blocks():
    t = ts
    for first in range(0, idx.shape[0], KD_BLOCK):
      t, _, _ = kd_block_on_targets(programs, t, pool, stored, epoch, first)
    return t.model.params

  return {
    'per-step teachers': per_step,
    'stored targets': on_targets,
    # the same steps, KD_BLOCK of them per compiled call (what the methods run)
    'per-step teachers, blocks': per_step_blocks,
    'stored targets, blocks': on_targets_blocks,
    'targets': targets,
  }


# ---------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------
def torch_modules(torch):
  nn = torch.nn

  class Generator(nn.Module):
    """DENSE models/generator.py:Generator."""

    def __init__(self, nz, ngf, img_size, nc):
      super().__init__()
      self.init_size = img_size // 4
      self.l1 = nn.Sequential(nn.Linear(nz, ngf * 2 * self.init_size**2))
      self.conv_blocks = nn.Sequential(
        nn.BatchNorm2d(ngf * 2),
        nn.Upsample(scale_factor=2),
        nn.Conv2d(ngf * 2, ngf * 2, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(ngf * 2),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Upsample(scale_factor=2),
        nn.Conv2d(ngf * 2, ngf, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(ngf),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(ngf, nc, 3, stride=1, padding=1),
        nn.Sigmoid(),
      )

    def forward(self, z):
      out = self.l1(z)
      out = out.view(out.shape[0], -1, self.init_size, self.init_size)
      return self.conv_blocks(out)

  def reset(model):  # DENSE reset_model
    for m in model.modules():
      if isinstance(m, (nn.ConvTranspose2d, nn.Linear, nn.Conv2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if m.bias is not None:
          nn.init.constant_(m.bias, 0)
      if isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.constant_(m.bias, 0)

  def cnn_mnist(c):
    return torch_model(torch, c)

  return Generator, reset, cnn_mnist


def torch_ms(sz, torch, m: int, c: int, num_classes: int):
  Generator, reset, cnn_mnist = torch_modules(torch)
  torch.manual_seed(0)
  teachers = [cnn_mnist(num_classes).eval() for _ in range(m)]
  for t in teachers:
    for p in t.parameters():
      p.requires_grad_(False)
  ce = torch.nn.CrossEntropyLoss()

  def run():
    U = np.zeros((m, c))
    for k in range(m):
      for j in range(c):
        g = Generator(sz.nz, sz.ngf, SHAPE[0], 1)
        reset(g)
        g.train()
        z = torch.randn(sz.ms_batch, sz.nz)
        y = torch.full((sz.ms_batch,), j, dtype=torch.long)
        opt = torch.optim.Adam(g.parameters(), LR_G, betas=BETAS)
        losses = []
        for _ in range(sz.T_G):
          loss = ce(teachers[k](g(z)), y)
          opt.zero_grad()
          loss.backward()
          opt.step()
          losses.append(loss.item())
        U[k, j] = (max(losses) - min(losses)) / min(losses)
    return U

  return run


def torch_dense_epoch(sz, torch, m: int, c: int):
  """DENSE AdvSynthesizer.synthesize (BN hooks attached: 'paper' mode) + kd_train."""
  nn, F = torch.nn, torch.nn.functional
  Generator, reset, cnn_mnist = torch_modules(torch)
  torch.manual_seed(0)
  teachers = [cnn_mnist(c).eval() for _ in range(m)]
  student = cnn_mnist(c)
  stats = []

  def hook(module, inputs, output):
    x = inputs[0]
    mean = x.mean([0, 2, 3])
    var = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1).var(1, unbiased=False)
    stats.append(
      torch.norm(module.running_var - var, 2) + torch.norm(module.running_mean - mean, 2)
    )

  for t in teachers:
    for mod in t.modules():
      if isinstance(mod, nn.BatchNorm2d):
        mod.register_forward_hook(hook)
  rng = np.random.default_rng(0)
  pool = torch.as_tensor(rng.random((sz.pool, 1, *SHAPE[:2]), np.float32))

  def augment(x):  # RandomCrop(28, padding=4) + RandomHorizontalFlip, per sample
    b = x.shape[0]
    xp = F.pad(x, (4, 4, 4, 4))
    oy, ox = torch.randint(0, 9, (b,)), torch.randint(0, 9, (b,))
    ar = torch.arange(SHAPE[0])
    rows = (oy[:, None] + ar[None])[:, :, None].expand(b, SHAPE[0], SHAPE[1])
    cols = (ox[:, None] + ar[None])[:, None, :].expand(b, SHAPE[0], SHAPE[1])
    out = xp[torch.arange(b)[:, None, None], 0, rows, cols][:, None]
    flip = torch.rand(b) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)

  def epoch():
    g = Generator(sz.nz, sz.ngf, SHAPE[0], 1)
    reset(g)
    g.train()
    z = torch.randn(sz.synthesis_batch, sz.nz, requires_grad=True)
    y = torch.randint(0, c, (sz.synthesis_batch,)).sort()[0]
    opt = torch.optim.Adam([{'params': g.parameters()}, {'params': [z]}], LR_G, betas=BETAS)
    student.eval()
    best, best_x = math.inf, None
    for _ in range(sz.g_steps):
      x = g(z)
      xa = augment(x)
      stats.clear()
      t = torch.stack([tm(xa) for tm in teachers]).mean(0)
      l_bn = sum(stats)
      l_oh = F.cross_entropy(t, y)
      s = student(xa)
      mask = (s.max(1)[1] != t.max(1)[1]).float()
      l_adv = -(
        F.kl_div(F.log_softmax(s, 1), F.softmax(t, 1), reduction='none').sum(1) * mask
      ).mean()
      loss = l_bn + l_oh + l_adv
      if loss.item() < best:
        best, best_x = loss.item(), x.detach()
      opt.zero_grad()
      loss.backward()
      opt.step()
    data = torch.cat([pool, (best_x.clamp(0, 1) * 255).floor() / 255])
    student.train()
    sopt = torch.optim.SGD(student.parameters(), 0.005, momentum=0.9)
    for idx in torch.randperm(len(data)).split(sz.kd_batch):
      xb = data[idx]
      xb = torch.where((torch.rand(len(idx)) < 0.5)[:, None, None, None], xb.flip(3), xb)
      with torch.no_grad():
        tb = torch.stack([tm(xb) for tm in teachers]).mean(0)
      sb = student(xb)
      loss = F.kl_div(F.log_softmax(sb / 20, 1), F.softmax(tb / 20, 1), reduction='batchmean') * 400
      sopt.zero_grad()
      loss.backward()
      sopt.step()
    if pool.is_cuda:
      torch.cuda.synchronize()
    return None

  return epoch


def torch_twice(torch, fn):
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  fn()
  return first, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
def _grid(m: int, c: int, runs: int):
  """(clients, classes) of the first `runs` runs in (client, class) order; 0: all."""
  if not runs or runs >= m * c:
    return m, c
  return (1, runs) if runs <= c else (runs // c, c)


def timed_grid(sz: Sizes, form: str, backend: str):
  if (form == 'loop' or form in BATCHED_FORMS) and backend == 'cpu' and sz.scan_runs:
    return 1, min(sz.classes, sz.scan_runs)
  if form in BATCHED_FORMS:
    return sz.clients, sz.classes
  return _grid(sz.clients, sz.classes, sz.seq_runs)


def run(sz: Sizes = Sizes()) -> dict:
  """Runs the benchmark; returns meta (environment, sizes), rows, the table and headline figures."""
  from jfed.distill import make_generator, resolve_ms_impl

  unknown = set(sz.forms) - set(VALID_FORMS)
  if unknown:
    raise ValueError(f'unknown MS forms {sorted(unknown)}; valid: {VALID_FORMS}')
  torch, torch_note = import_torch(sz.torch and 'torch' in sz.forms)
  if torch is not None:
    torch.set_num_threads(sz.torch_threads or cpu_count())
    # Every torch tensor and module below is made under `with torch_device:`.
    use_cuda = jax.default_backend() == 'gpu' and torch.cuda.is_available()
    torch_device = torch.device('cuda' if use_cuda else 'cpu')
  m, c = sz.clients, sz.classes
  meta = environment()
  backend = meta['backend']
  meta.update(
    torch_version=torch.__version__ if torch is not None else None,
    torch_threads=torch.get_num_threads() if torch is not None else None,
    torch_device=str(torch_device) if torch is not None else None,
    torch_note=torch_note,
    sizes=sz._asdict(),
    ms_impl_auto=resolve_ms_impl('auto'),
  )
  log(
    f'model stratification: backend {backend}, {meta["cpu_count"]} CPUs, load '
    f'{meta["load_average"]}, fedhydra ms_impl=auto -> {meta["ms_impl_auto"]}'
  )
  generator = make_generator(SHAPE, sz.nz, sz.ngf)
  teachers = jfed_teachers(m, c)
  if 'ms' in sz.stages:
    meta['ms_step_gflop'] = ms_step_gflop(sz, teachers, generator)
  rows = []
  t_start = time.perf_counter()
  if 'ms' in sz.stages:
    for form in sz.forms:
      if form == 'torch' and torch is None:
        continue
      mf, cf = timed_grid(sz, form, backend)
      steps = mf * cf * sz.T_G
      log(f'  MS: {form} ({mf}x{cf} runs x {sz.T_G} steps, batch {sz.ms_batch})')
      # The warm-up call is the timed call's twin: besides the per-run programs, the host-side
      # ops around them (run keys, teacher slices) compile per number of runs.
      wm, wc = mf, cf
      t0 = time.perf_counter()
      if form == 'torch':
        with torch_device:
          torch_ms(sz, torch, wm, wc, c)()
          first = time.perf_counter() - t0
          t0 = time.perf_counter()
          torch_ms(sz, torch, mf, cf, c)()
      else:
        jax.block_until_ready(jfed_ms(sz, form, teachers, generator, wm, wc)())
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(jfed_ms(sz, form, teachers, generator, mf, cf)())
      second = time.perf_counter() - t0
      rows.append(
        {
          'stage': 'MS',
          'form': form,
          'first_s': first,
          'seconds': second,
          'ms_per_step': 1e3 * second / steps,
          'steps': steps,
          'runs': mf * cf,
          'full_ms_s': second * (m * c) / (mf * cf),
          'tflop_per_s': meta['ms_step_gflop'] * steps / second / 1e3,
          'compute_dtype': BATCHED_FORMS[form][2] if form in BATCHED_FORMS else 'float32',
          'load_average': load_average(),
        }
      )
      log(f'    warm-up {first:.1f} s, timed {second:.1f} s ({1e3 * second / steps:.1f} ms/step)')
  if 'dense' in sz.stages:
    steps = sz.g_steps
    log(
      f'  DENSE epoch: jfed ({sz.g_steps} synthesis steps x {sz.synthesis_batch}, '
      f'KD over {sz.pool + sz.synthesis_batch} images)'
    )
    first, second, _ = twice(jfed_dense_epoch(sz, teachers, generator, c))
    rows.append(
      {
        'stage': 'DENSE epoch',
        'form': 'jfed',
        'first_s': first,
        'seconds': second,
        'ms_per_step': None,
        'steps': steps,
        'load_average': load_average(),
      }
    )
    log(f'    first {first:.1f} s, second {second:.1f} s')
    if torch is not None:
      log('  DENSE epoch: PyTorch')
      with torch_device:
        first, second = torch_twice(torch, torch_dense_epoch(sz, torch, m, c))
      rows.append(
        {
          'stage': 'DENSE epoch',
          'form': 'torch',
          'first_s': first,
          'seconds': second,
          'ms_per_step': None,
          'steps': steps,
          'load_average': load_average(),
        }
      )
      log(f'    first {first:.1f} s, second {second:.1f} s')
  if 'hydra_kd' in sz.stages:
    log(f'  FedHydra KD pass over {sz.pool} images, {sz.clients} teachers, SA targets')
    trained = {}
    for form, fn in jfed_hydra_kd(sz, teachers, c).items():
      first, second, trained[form] = twice(fn)
      rows.append(
        {
          'stage': 'FedHydra KD',
          'form': form,
          'first_s': first,
          'seconds': second,
          'ms_per_step': 1e3 * second / math.ceil(sz.pool / sz.kd_batch),
          'steps': math.ceil(sz.pool / sz.kd_batch),
          'load_average': load_average(),
        }
      )
      log(f'    {form}: first {first:.1f} s, second {second:.2f} s')
    meta['hydra_kd_fashion_minutes'] = hydra_kd_fashion_minutes(rows, sz.pool)
    # the two forms must train the same student (float rounding apart)
    meta['hydra_kd_max_param_difference'] = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(
        jax.tree.leaves(trained['per-step teachers']), jax.tree.leaves(trained['stored targets'])
      )
    )
    # and the steps in compiled blocks the same student as one call per step
    meta['hydra_kd_blocks_max_param_difference'] = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for form in ('per-step teachers', 'stored targets')
      for a, b in zip(jax.tree.leaves(trained[form]), jax.tree.leaves(trained[f'{form}, blocks']))
    )
  meta['total_seconds'] = time.perf_counter() - t_start
  meta['load_average_end'] = load_average()
  _add_ratios(rows)
  return {
    'name': 'model_stratification',
    'meta': meta,
    'results': rows,
    'headline': headline(meta, rows),
    'table_markdown': report(meta, rows),
  }


def hydra_kd_fashion_minutes(rows, pool: int, epochs: int = 30, per_epoch: int = 30 * 64):
  """FedHydra's KD minutes over the fedhydra_fashion_mnist.py CPU budget (T_g = 30 epochs, each
  adding T_G × 64 = 1,920 images; epoch e distils on e × 1,920), from the measured seconds per
  pool image: per-step teachers vs stored targets (each image's target computed once)."""
  per_image = {r['form']: r['seconds'] / pool for r in rows if r['stage'] == 'FedHydra KD'}
  distilled = per_epoch * epochs * (epochs + 1) / 2  # images distilled over the T_g epochs
  return {
    'per-step teachers': distilled * per_image['per-step teachers'] / 60,
    'stored targets': (
      distilled * per_image['stored targets'] + per_epoch * epochs * per_image['targets']
    )
    / 60,
  }


def _add_ratios(rows):
  """ratio_vs_<form> = that form's time per generator step (per epoch for DENSE) / the row's."""
  for stage in ('MS', 'DENSE epoch'):
    group = [r for r in rows if r['stage'] == stage]
    per = {r['form']: r['ms_per_step'] or r['seconds'] for r in group}
    for r in group:
      for ref in ('torch', 'loop', 'python'):
        r[f'ratio_vs_{ref}'] = per[ref] / per[r['form']] if ref in per else None


def headline(meta, rows):
  by = {r['form']: r for r in rows if r['stage'] == 'MS'}
  batched = [by[f] for f in BATCHED_FORMS if f in by]
  if not batched:
    return []
  r = min(batched, key=lambda x: x['ms_per_step'])  # the fastest batched variant timed
  sz = meta['sizes']
  # The goal's reference is the one-run-at-a-time loop; of jfed's two such forms the faster one
  # measured here, so that the ratio is not flattered by the slower.
  singles = [by[f] for f in ('loop', 'python') if f in by]
  ref = min(singles, key=lambda x: x['ms_per_step']) if singles else None
  extrapolated = r['runs'] < sz['clients'] * sz['classes']
  return [
    {
      'benchmark': 'model stratification',
      'figure': f'jfed {r["form"]} MS, m x c = {sz["clients"]} x {sz["classes"]}, T_G={sz["T_G"]}, '
      f'batch {sz["ms_batch"]}: full stage s' + (' (extrapolated)' if extrapolated else ''),
      'value': r['full_ms_s'],
      'unit': 's',
      'reference': f'one-run-at-a-time loop (jfed {ref["form"]} form)' if ref else 'n/a',
      'reference_value': ref['full_ms_s'] if ref else None,
      'ratio': ref['ms_per_step'] / r['ms_per_step'] if ref else None,
      'loop_ratio': ref['ms_per_step'] / r['ms_per_step'] if ref else None,
      'torch_ratio': r['ratio_vs_torch'],
      'torch_value': by['torch']['full_ms_s'] if 'torch' in by else None,
      'goal': '>= 20x the one-run-at-a-time loop (accelerators)',
      'goal_ratio': 20.0,
    }
  ]


def report(meta, rows) -> str:
  sz = meta['sizes']
  lines = [
    "### Model stratification (FedHydra MS), one DENSE epoch and FedHydra's KD pass",
    '',
    f'MS: m={sz["clients"]} CNNMnist clients x c={sz["classes"]} classes, T_G={sz["T_G"]}, '
    f'batch {sz["ms_batch"]}, DENSE generator nz={sz["nz"]} ngf={sz["ngf"]}, 28x28x1. FedHydra '
    f"`ms_impl='auto'` resolves to **{meta['ms_impl_auto']}** here. PyTorch: "
    + (
      f'{meta["torch_version"]} on {meta["torch_device"]} ({meta["torch_threads"]} threads)'
      if meta['torch_version']
      else f'skipped ({meta["torch_note"]})'
    )
    + f'. Load average {meta["load_average"]} at start, {meta["load_average_end"]} at end.',
    '',
    '| stage | implementation | runs timed | warm-up call (s) | timed call (s) | '
    'ms / generator step | full stage (s) | vs PyTorch | vs jfed loop | vs jfed python |',
    '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  ms_jfed = {
    r['form']: r['ms_per_step'] for r in rows if r['stage'] == 'MS' and r['form'] != 'torch'
  }
  fastest = min(ms_jfed, key=ms_jfed.get) if ms_jfed else None
  names = {
    'batched': 'jfed batched (ONE program: vmap + lax.scan)',
    'batched_clients': 'jfed batched, vmap over clients then classes',
    'batched_matmul': 'jfed batched, generator convolutions as matmuls',
    'batched_clients_matmul': 'jfed batched, by client, generator convolutions as matmuls',
    'batched_bf16': 'jfed batched, bf16 compute (float32 parameters and Adam)',
    'batched_clients_bf16': 'jfed batched, by client, bf16 compute (float32 parameters and Adam)',
    'loop': 'jfed loop (per-run lax.scan program, one run at a time)',
    'python': 'jfed python (per-run jitted steps)',
    'torch': 'PyTorch (reference structure, one run at a time)',
    'jfed': 'jfed (synthesize + distill.kd_step)',
    'per-step teachers': 'jfed kd_step (teachers at every step)',
    'stored targets': 'jfed kd_step_on_targets (targets given)',
    'per-step teachers, blocks': 'jfed kd_block (teachers at every step, KD_BLOCK steps a call)',
    'stored targets, blocks': 'jfed kd_block_on_targets (targets given, KD_BLOCK steps a call)',
    'targets': 'jfed pool_teacher_logits (every pool image once)',
  }
  for r in rows:
    name = names[r['form']]
    if r['stage'] == 'MS' and r['form'] == fastest:
      name += ' **fastest jfed**'
    ms = f'{r["ms_per_step"]:.1f}' if r.get('ms_per_step') is not None else ''
    full = f'{r["full_ms_s"]:.1f}' if r.get('full_ms_s') is not None else f'{r["seconds"]:.1f}'
    if r.get('runs') is not None and r['runs'] < sz['clients'] * sz['classes']:
      full += ' (extrapolated)'
    ratios = [r.get('ratio_vs_torch'), r.get('ratio_vs_loop'), r.get('ratio_vs_python')]
    lines.append(
      f'| {r["stage"]} | {name} | {r.get("runs", "")} | {r["first_s"]:.1f} | '
      f'{r["seconds"]:.2f} | {ms} | {full} | '
      + ' | '.join('n/a' if v is None else f'{v:.2f}' for v in ratios)
      + ' |'
    )
  lines.append('')
  if fastest:
    auto = meta['ms_impl_auto']
    verdict = 'yes' if auto == fastest else 'NO'
    lines.append(
      f'- fastest jfed MS form on {meta["backend"]}: **{fastest}**; FedHydra '
      f"`ms_impl='auto'` picks it: **{verdict}**."
    )
  lines.append(
    "- ratios = the reference's time per generator step (MS) or per epoch (DENSE) / the "
    "row's: > 1 means the row is faster. The warm-up call (the same runs as the timed call) "
    'includes XLA compilation (jfed). '
    '"full stage" = m*c runs, extrapolated per run where fewer runs were timed (on CPU the '
    'lax.scan forms run one run of client 0: `scan_runs`; elsewhere the one-run-at-a-time '
    'forms run the first `seq_runs` runs).'
  )
  flops = [r for r in rows if r.get('tflop_per_s') is not None]
  if flops:

    def of_peak(r):
      peak = dense_peak_tflops(meta.get('device_kind', ''), r.get('compute_dtype', 'float32'))
      return (
        f' ({100 * r["tflop_per_s"] / peak:.1f} % of its {peak:.0f} dense peak)' if peak else ''
      )

    lines.append(
      f"- one generator step is {meta['ms_step_gflop']:.2f} GFLOP by XLA's cost analysis (G "
      'and F_k forward, the backward to G, Adam); at that count the forms ran '
      + ', '.join(f'{r["form"]} {r["tflop_per_s"]:.3g} TFLOP/s{of_peak(r)}' for r in flops)
      + " (a bound on what any form can gain: the device's peak over these; float32 forms "
      'against the TF32 peak, `DENSE_PEAK_TFLOPS`).'
    )
  kd = meta.get('hydra_kd_fashion_minutes')
  if kd:
    by = {r['form']: r['seconds'] for r in rows if r['stage'] == 'FedHydra KD'}
    lines.append(
      f'- FedHydra KD pass over {sz["pool"]} images: per-step teachers '
      f'{by["per-step teachers"]:.2f} s, stored targets {by["stored targets"]:.2f} s '
      f'(+ {by["targets"]:.2f} s to compute every target once): '
      f'{by["per-step teachers"] / by["stored targets"]:.2f}x per pass, largest difference '
      f'between the two trained students {meta["hydra_kd_max_param_difference"]:.1e}. Over the '
      'fedhydra_fashion_mnist.py CPU budget (30 epochs of 1,920 new images, 892,800 images '
      f'distilled): **{kd["per-step teachers"]:.1f} min** per-step vs **{kd["stored targets"]:.1f} '
      'min** stored.'
    )
  lines.append(f'- total {meta["total_seconds"]:.0f} s')
  return '\n'.join(lines)


def define_flags():
  from absl import flags

  d = Sizes()
  flags.DEFINE_integer('clients', d.clients, 'm: client models.')
  flags.DEFINE_integer('classes', d.classes, 'c: classes.')
  flags.DEFINE_integer('T_G', d.T_G, 'Generator steps per MS run (paper: 30).')
  flags.DEFINE_integer('ms_batch', d.ms_batch, 'Images per MS generator batch (b).')
  flags.DEFINE_integer('g_steps', d.g_steps, 'DENSE synthesis steps per epoch (DENSE: 30).')
  flags.DEFINE_integer('synthesis_batch', d.synthesis_batch, 'DENSE synthesis batch (DENSE: 256).')
  flags.DEFINE_integer('pool', d.pool, 'Images in the pool of the KD pass.')
  flags.DEFINE_integer('kd_batch', d.kd_batch, 'KD batch size (DENSE: 256).')
  flags.DEFINE_integer('nz', d.nz, 'Generator noise size (DENSE: 256).')
  flags.DEFINE_integer('ngf', d.ngf, 'Generator width (DENSE: 64).')
  flags.DEFINE_list('stages', list(d.stages), 'Stages to run: ms, dense, hydra_kd.')
  flags.DEFINE_list(
    'forms', list(d.forms), f'MS forms: {", ".join(VALID_FORMS)} (default: {", ".join(d.forms)}).'
  )
  flags.DEFINE_integer(
    'scan_runs',
    d.scan_runs,
    'On a CPU backend, time the lax.scan forms (batched, loop) on this many (client, class) '
    'runs of client 0 only and extrapolate per generator step; 0 = all runs.',
  )
  flags.DEFINE_integer(
    'seq_runs',
    d.seq_runs,
    'Time the one-run-at-a-time forms (python, loop, torch) on the first this many runs and '
    'extrapolate; 0 = all runs.',
  )
  flags.DEFINE_integer(
    'chunk_size', 0, 'Batched MS form: lax.map over chunks of this many runs (0: one vmap).'
  )
  flags.DEFINE_integer('torch_threads', 0, 'PyTorch intra-op threads (0: one per CPU).')
  flags.DEFINE_string('out', None, 'Optional JSON file for the table and the raw numbers.')


def main(argv):
  del argv
  from absl import flags

  f = flags.FLAGS
  fields = set(Sizes._fields) - {'torch'}
  sz = Sizes(
    **{k: (tuple(getattr(f, k)) if k in ('stages', 'forms') else getattr(f, k)) for k in fields}
  )
  sz = sz._replace(chunk_size=sz.chunk_size or None)
  result = run(sz)
  print(result['table_markdown'])
  if f.out:
    write_json(f.out, result)


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
