"""FedHydra model stratification (MS) and one DENSE distillation epoch: jfed vs PyTorch.

    python -m experiments.bench.model_stratification [--clients=5] [--classes=10] [--T_G=30]
        [--ms_batch=8] [--g_steps=30] [--synthesis_batch=64] [--pool=1024] [--kd_batch=128]
        [--nz=256] [--ngf=64] [--stages=ms,dense] [--forms=python,loop,batched,torch]
        [--scan_runs=1]
        [--out=FILE.json]

Stage 1, MS (seed 000 Algorithm 2): m clients × c classes independent generator trainings, each
a fresh DENSE generator (nz, ngf; 28×28×1 output) and fixed z ~ N(0, I) of `ms_batch` images,
`T_G` Adam(lr 1e-3, betas (0.5, 0.999)) steps on CE(F_k(G(z)), j) with F_k a fixed CNNMnist
(the clients' models; random weights, the work does not depend on them). Forms:
  - jfed batched: `jfed.distill.model_stratification` — ONE jitted program (vmap over the m·c
    runs of a lax.scan over the T_G steps);
  - jfed loop:    `jfed.distill.model_stratification_loop` — the same jitted single-run program
    (lax.scan over T_G) called once per (k, j);
  - jfed python:  `jfed.distill.model_stratification_python` — the same run as T_G
    calls of one jitted step (same numbers; FedHydra's `ms_impl='auto'` on CPU);
  - PyTorch:      the reference structure (FL-SA `interview`): a Python loop over (k, j), each
    building a generator, DENSE `reset_model`, Adam, T_G steps; torch.set_num_threads(CPUs).
On a CPU backend the two lax.scan forms take ~1 s per generator step (XLA:CPU runs convolutions
inside scan very slowly), so by default they are timed on `--scan_runs` (1) run of client 0 and
the full stage is extrapolated per step; `--scan_runs=0` times all m·c runs (~25 min each).
Stage 2, one DENSE distillation epoch (reference-code §1.5–1.6): synthesis (fresh generator and
z, `g_steps` Adam steps on BN (hooks, 'paper' mode) + CE(mean of m teachers) + masked adversarial
KL against the student, RandomCrop(4) + HFlip view, best batch kept) then one KD pass over a pool
of `pool` images (KL T = 20 × T², SGD 0.005 m0.9, HFlip) — jfed (`synthesize` + `distill.kd_step`)
vs the same in PyTorch.

Timed calls follow a warm-up call that compiles (jfed) / warms up (torch); both are reported.
The default runtime is about 5–10 minutes on 2 CPU cores; shrink with --ms_batch, --T_G,
--clients, --g_steps, --synthesis_batch, --pool or --stages/--forms/--scan_runs.
The paper does not give the MS batch size b; the default 8 keeps the CPU run short (DENSE's
synthesis batch is 256: `--ms_batch=256` on an accelerator).

Output: a Markdown table (backend, versions, CPUs, load average in the header) with seconds per
call, ms per generator step and the ratio to PyTorch (> 1: jfed faster); it names the fastest
jfed MS form and whether FedHydra's `ms_impl='auto'` (jfed.distill.resolve_ms_impl)
picks it on this backend. `--out` also writes the table and raw numbers as JSON.
"""

import json
import math
import os
import platform
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.machine import cpu_count, cpu_model, load_average, log

FLAGS = flags.FLAGS
flags.DEFINE_integer('clients', 5, 'm: client models.')
flags.DEFINE_integer('classes', 10, 'c: classes.')
flags.DEFINE_integer('T_G', 30, 'Generator steps per MS run (paper: 30).')
flags.DEFINE_integer('ms_batch', 8, 'Images per MS generator batch (b; not given in the paper).')
flags.DEFINE_integer('g_steps', 30, 'DENSE synthesis steps per epoch (DENSE README: 30).')
flags.DEFINE_integer('synthesis_batch', 64, 'DENSE synthesis batch (DENSE: 256).')
flags.DEFINE_integer('pool', 1024, 'Images in the pool of the KD pass.')
flags.DEFINE_integer('kd_batch', 128, 'KD batch size (DENSE: 256).')
flags.DEFINE_integer('nz', 256, 'Generator noise size (DENSE: 256).')
flags.DEFINE_integer('ngf', 64, 'Generator width (DENSE: 64).')
flags.DEFINE_list('stages', ['ms', 'dense'], 'Stages to run: ms, dense.')
flags.DEFINE_list(
  'forms',
  ['python', 'loop', 'batched', 'torch'],
  'MS forms: python, loop, batched, torch (torch also gates the DENSE-epoch reference).',
)
flags.DEFINE_integer(
  'scan_runs',
  1,
  'On a CPU backend, time the lax.scan forms (batched, loop) '
  'on this many (client, class) runs of client 0 only and extrapolate per '
  'generator step (~1 s per step on XLA:CPU: all m*c runs would take ~25 min '
  'each); 0 = all runs. Ignored off CPU.',
)
flags.DEFINE_string('out', None, 'Optional JSON file for the table and the raw numbers.')

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


def jfed_ms(form: str, teachers, generator, m: int, c: int):
  """MS over the first m clients and c classes with the given form."""
  from jfed.distill import MS_FUNCTIONS, MSConfig
  from jfed.engine import take

  cfg = MSConfig(T_G=FLAGS.T_G, lr=LR_G, b1=BETAS[0], b2=BETAS[1], batch_size=FLAGS.ms_batch)
  group = teachers._replace(states=take(teachers.states, np.arange(m)))
  return lambda: MS_FUNCTIONS[form](group, generator, c, jax.random.PRNGKey(1), cfg).U


def jfed_dense_epoch(teachers, generator, c: int):
  from jfed.distill import (
    KDConfig,
    committed,
    dense_config,
    epoch_batches,
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
  syn = dense_config(g_steps=FLAGS.g_steps, batch_size=FLAGS.synthesis_batch, lr_g=LR_G)
  kcfg = KDConfig(loss='kl', T=20.0, t_squared=True, aggregation='mean', augment='flip')
  ocfg = OptimizerSpec('sgd', lr=0.005, momentum=0.9)
  rng = np.random.default_rng(0)
  pool = pool_init(FLAGS.pool + FLAGS.synthesis_batch, SHAPE, quantize=True)
  pool = pool_add(pool, jnp.asarray(rng.random((FLAGS.pool, *SHAPE), np.float32)))
  pool = committed(pool)
  teachers = teachers._replace(states=committed(teachers.states))
  ts = committed(student_state(ocfg, student))
  modules, states = (teachers.module,), (teachers.states,)

  def epoch():
    res = synthesize(generator, teachers, student_module, ts.model, c, jax.random.PRNGKey(3), syn)
    p = pool_add(pool, res.images, res.labels)
    idx, mask = epoch_batches(p, np.random.default_rng(1), FLAGS.kd_batch)
    t = ts
    for b in range(idx.shape[0]):
      t, _ = kd_step(
        kcfg,
        ocfg,
        modules,
        student_module,
        t,
        states,
        None,
        p,
        jnp.asarray(idx[b]),
        jnp.asarray(mask[b]),
        jax.random.PRNGKey(b),
        0.005,
      )
    return t.model.params

  return epoch


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
    return nn.Sequential(
      nn.Conv2d(1, 16, 5, padding=2),
      nn.BatchNorm2d(16),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Conv2d(16, 32, 5, padding=2),
      nn.BatchNorm2d(32),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Flatten(),
      nn.Linear(1568, c),
    )

  return Generator, reset, cnn_mnist


def torch_ms(torch, m: int, c: int, num_classes: int):
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
        g = Generator(FLAGS.nz, FLAGS.ngf, SHAPE[0], 1)
        reset(g)
        g.train()
        z = torch.randn(FLAGS.ms_batch, FLAGS.nz)
        y = torch.full((FLAGS.ms_batch,), j, dtype=torch.long)
        opt = torch.optim.Adam(g.parameters(), LR_G, betas=BETAS)
        losses = []
        for _ in range(FLAGS.T_G):
          loss = ce(teachers[k](g(z)), y)
          opt.zero_grad()
          loss.backward()
          opt.step()
          losses.append(loss.item())
        U[k, j] = (max(losses) - min(losses)) / min(losses)
    return U

  return run


def torch_dense_epoch(torch, m: int, c: int):
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
  pool = torch.from_numpy(rng.random((FLAGS.pool, 1, *SHAPE[:2]), np.float32))

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
    g = Generator(FLAGS.nz, FLAGS.ngf, SHAPE[0], 1)
    reset(g)
    g.train()
    z = torch.randn(FLAGS.synthesis_batch, FLAGS.nz, requires_grad=True)
    y = torch.randint(0, c, (FLAGS.synthesis_batch,)).sort()[0]
    opt = torch.optim.Adam([{'params': g.parameters()}, {'params': [z]}], LR_G, betas=BETAS)
    student.eval()
    best, best_x = math.inf, None
    for _ in range(FLAGS.g_steps):
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
    for idx in torch.randperm(len(data)).split(FLAGS.kd_batch):
      xb = data[idx]
      xb = torch.where((torch.rand(len(idx)) < 0.5)[:, None, None, None], xb.flip(3), xb)
      with torch.no_grad():
        tb = torch.stack([tm(xb) for tm in teachers]).mean(0)
      sb = student(xb)
      loss = F.kl_div(F.log_softmax(sb / 20, 1), F.softmax(tb / 20, 1), reduction='batchmean') * 400
      sopt.zero_grad()
      loss.backward()
      sopt.step()
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
def main(argv):
  del argv
  import flax
  import jaxlib

  from jfed.distill import make_generator, resolve_ms_impl

  try:
    import torch

    torch.set_num_threads(cpu_count())
  except ImportError as e:
    torch = None
    log(f'PyTorch not importable ({e}): no reference timings.')
  m, c = FLAGS.clients, FLAGS.classes
  backend = jax.default_backend()
  meta = {
    'backend': backend,
    'device_kind': jax.devices()[0].device_kind,
    'num_devices': jax.device_count(),
    'jax_version': jax.__version__,
    'jaxlib_version': jaxlib.__version__,
    'flax_version': flax.__version__,
    'torch_version': torch.__version__ if torch is not None else None,
    'torch_threads': torch.get_num_threads() if torch is not None else None,
    'cpu_count': cpu_count(),
    'cpu_model': cpu_model(),
    'load_average': load_average(),
    'python_version': platform.python_version(),
    'clients': m,
    'classes': c,
    'T_G': FLAGS.T_G,
    'ms_batch': FLAGS.ms_batch,
    'g_steps': FLAGS.g_steps,
    'synthesis_batch': FLAGS.synthesis_batch,
    'pool': FLAGS.pool,
    'kd_batch': FLAGS.kd_batch,
    'nz': FLAGS.nz,
    'ngf': FLAGS.ngf,
    'ms_impl_auto': resolve_ms_impl('auto'),
  }
  log(
    f'backend {backend}, {meta["cpu_count"]} CPUs, load {meta["load_average"]}, '
    f'fedhydra ms_impl=auto -> {meta["ms_impl_auto"]}'
  )
  generator = make_generator(SHAPE, FLAGS.nz, FLAGS.ngf)
  teachers = jfed_teachers(m, c)
  rows = []
  t_start = time.perf_counter()
  if 'ms' in FLAGS.stages:
    for form in FLAGS.forms:
      if form == 'torch' and torch is None:
        continue
      if form not in ('python', 'loop', 'batched', 'torch'):
        raise app.UsageError(f'unknown form {form!r}')
      mf, cf = m, c
      if form in ('loop', 'batched') and backend == 'cpu' and FLAGS.scan_runs:
        mf, cf = 1, min(c, FLAGS.scan_runs)
      steps = mf * cf * FLAGS.T_G
      log(f'MS: {form} ({mf}x{cf} runs x {FLAGS.T_G} steps, batch {FLAGS.ms_batch})')
      # warm-up: one (k, j) run compiles the per-run programs of python / loop (and warms
      # torch); the batched program depends on the number of runs, so it warms up in full.
      wm, wc = (mf, cf) if form == 'batched' else (1, 1)
      t0 = time.perf_counter()
      if form == 'torch':
        torch_ms(torch, wm, wc, c)()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch_ms(torch, mf, cf, c)()
      else:
        jax.block_until_ready(jfed_ms(form, teachers, generator, wm, wc)())
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(jfed_ms(form, teachers, generator, mf, cf)())
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
        }
      )
      log(f'    warm-up {first:.1f} s, timed {second:.1f} s ({1e3 * second / steps:.1f} ms/step)')
  if 'dense' in FLAGS.stages:
    steps = FLAGS.g_steps
    log(
      f'DENSE epoch: jfed ({FLAGS.g_steps} synthesis steps x {FLAGS.synthesis_batch}, '
      f'KD over {FLAGS.pool + FLAGS.synthesis_batch} images)'
    )
    first, second, _ = twice(jfed_dense_epoch(teachers, generator, c))
    rows.append(
      {
        'stage': 'DENSE epoch',
        'form': 'jfed',
        'first_s': first,
        'seconds': second,
        'ms_per_step': None,
        'steps': steps,
      }
    )
    log(f'    first {first:.1f} s, second {second:.1f} s')
    if torch is not None and 'torch' in FLAGS.forms:
      log('DENSE epoch: PyTorch')
      first, second = torch_twice(torch, torch_dense_epoch(torch, m, c))
      rows.append(
        {
          'stage': 'DENSE epoch',
          'form': 'torch',
          'first_s': first,
          'seconds': second,
          'ms_per_step': None,
          'steps': steps,
        }
      )
      log(f'    first {first:.1f} s, second {second:.1f} s')
  meta['total_seconds'] = time.perf_counter() - t_start
  table = report(meta, rows)
  print(table)
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or '.', exist_ok=True)
    with open(FLAGS.out, 'w') as f:
      json.dump({'meta': meta, 'results': rows, 'table_markdown': table}, f, indent=2)
    log(f'wrote {FLAGS.out}')


def report(meta, rows) -> str:
  lines = [
    '# FedHydra model stratification and one DENSE epoch: jfed vs PyTorch',
    '',
    f'- backend: **{meta["backend"]}** ({meta["device_kind"]}, {meta["num_devices"]} '
    f'device(s)); jax {meta["jax_version"]}, jaxlib {meta["jaxlib_version"]}, flax '
    f'{meta["flax_version"]}, torch {meta["torch_version"] or "not importable"}'
    + (f' ({meta["torch_threads"]} threads)' if meta['torch_version'] else ''),
    f'- CPUs: {meta["cpu_count"]} ({meta["cpu_model"]}); load average at start '
    f'{meta["load_average"]}; python {meta["python_version"]}',
    f'- MS: m={meta["clients"]} CNNMnist clients x c={meta["classes"]} classes, T_G='
    f'{meta["T_G"]}, batch {meta["ms_batch"]}, DENSE generator nz={meta["nz"]} ngf='
    f'{meta["ngf"]}, 28x28x1; DENSE epoch: {meta["g_steps"]} synthesis steps x '
    f'{meta["synthesis_batch"]} images, KD over {meta["pool"] + meta["synthesis_batch"]} '
    f'images in batches of {meta["kd_batch"]}',
    '',
    '| stage | implementation | runs timed | warm-up call (s) | timed call (s) | '
    'ms / generator step | full stage (s) | ratio vs PyTorch |',
    '|---|---|---:|---:|---:|---:|---:|---:|',
  ]
  torch_s = {r['stage']: r.get('ms_per_step') or r['seconds'] for r in rows if r['form'] == 'torch'}
  ms_jfed = {
    r['form']: r['ms_per_step'] for r in rows if r['stage'] == 'MS' and r['form'] != 'torch'
  }
  fastest = min(ms_jfed, key=ms_jfed.get) if ms_jfed else None
  names = {
    'batched': 'jfed batched (model_stratification: ONE program, vmap + lax.scan)',
    'loop': 'jfed loop (model_stratification_loop: per-run lax.scan)',
    'python': 'jfed python (distill.model_stratification_python: per-run jitted steps)',
    'torch': 'PyTorch (reference structure, one run at a time)',
    'jfed': 'jfed (synthesize + distill.kd_step)',
  }
  for r in rows:
    name = names[r['form']]
    if r['stage'] == 'MS' and r['form'] == fastest:
      name += ' **fastest jfed**'
    per = r.get('ms_per_step') or r['seconds']
    ratio = (torch_s[r['stage']] / per) if r['stage'] in torch_s else None
    ms = f'{r["ms_per_step"]:.1f}' if r.get('ms_per_step') is not None else ''
    full = f'{r["full_ms_s"]:.0f}' if r.get('full_ms_s') is not None else f'{r["seconds"]:.1f}'
    if r.get('runs') is not None and r['runs'] < meta['clients'] * meta['classes']:
      full += ' (extrapolated)'
    lines.append(
      f'| {r["stage"]} | {name} | {r.get("runs", "")} | {r["first_s"]:.1f} | '
      f'{r["seconds"]:.1f} | {ms} | {full} | '
      + (f'{ratio:.2f}' if ratio is not None else 'n/a')
      + ' |'
    )
  lines.append('')
  if fastest:
    auto = meta['ms_impl_auto']
    verdict = 'yes' if auto == fastest else 'NO'
    lines.append(
      f'- fastest jfed MS form on {meta["backend"]}: **{fastest}**; FedHydra '
      f"`ms_impl='auto'` resolves to **{auto}** here: picks the fastest: "
      f'**{verdict}**.'
    )
  lines.append(
    '- ratio vs PyTorch = torch / jfed time per generator step (MS) or per epoch: '
    '> 1 means jfed is faster. The warm-up call includes XLA compilation (jfed): '
    'one (client, class) run for python / loop / torch, the full batched program '
    'for batched. "full stage" = m*c runs (extrapolated per step where fewer runs '
    'were timed: --scan_runs).'
  )
  lines.append(f'- total {meta["total_seconds"]:.0f} s')
  return '\n'.join(lines)


if __name__ == '__main__':
  app.run(main)
