"""Client training per model: jfed's client step against PyTorch's for the configs' CPU models.

    python -m experiments.bench.client_training --models=cnn_mnist,vgg9,resnet18,mlp

(`experiments.bench.all --profile=cpu` runs it inside the client-training section.)

For each model of `MODELS` (the configs' CPU client models at the configs' batch sizes), two
clients train one epoch of `steps` batches of random 28x28x1 images with SGD(lr 0.01, momentum
0.9), forward + backward + optimiser step:

- jfed: `GroupTrainer.train` with strategy `auto` (the form the configs run) on a
  `FederatedArrays` of 2 clients, for a model with convolutions once per `conv_impl` form
  (`lax`: XLA's convolution, the default; `matmul`: shifted-slice matmuls), and where the loop
  trains clients on several threads (`default_loop_threads`) once more in the plain loop, one
  client at a time (`lax 1 thread`); the fastest is reported;
- PyTorch: the same network in torch.nn, one client after another (copy the global model, a
  fresh SGD optimiser, then forward, cross entropy, backward, step per batch), with the thread
  count the caller set (`torch.set_num_threads`).

Each side warms up (compiles / warms oneDNN) once, then the two are timed in turn, A/B/A/B,
`repeats` times, so a load change on a shared machine hits both alike; medians are reported with
the load average before and after each model's timings.
"""

import statistics
import time
from typing import Dict, NamedTuple, Optional, Tuple

import jax
import numpy as np

from experiments.bench.machine import load_average, log

LR = 0.01
MOMENTUM = 0.9
NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
CLIENTS = 2


class ModelCase(NamedTuple):
  """A jfed model spec and the batch size a config trains it with."""

  spec: str  # name[:k=v,...] as in a config's `model`
  batch: int
  source: str  # the config that uses it


# The configs' CPU client models (experiments/configs/*.py).
MODELS: Dict[str, ModelCase] = {
  'cnn_mnist': ModelCase('cnn_mnist', 64, 'fashion_mnist.py'),
  'vgg9': ModelCase('vgg9:width_mult=0.25,fc_width=512', 64, 'fedmho_fashion_mnist.py (CPU_VGG)'),
  'resnet18': ModelCase(
    'resnet18:width_mult=0.25', 128, 'fedhydra_fashion_mnist.py (HETERO_SERVER_NARROW)'
  ),
  'mlp': ModelCase('mlp', 64, 'fashion_mnist.py with model=mlp'),
}


# ---------------------------------------------------------------------------------------------
# PyTorch twins of the jfed models (same layers, PyTorch's own init)
# ---------------------------------------------------------------------------------------------
def torch_model(torch, name: str):
  nn = torch.nn
  if name == 'cnn_mnist':
    from experiments.bench.client_training import torch_model as cnn

    return cnn(torch)
  if name == 'mlp':
    return nn.Sequential(
      nn.Flatten(),
      nn.Linear(784, 200),
      nn.ReLU(),
      nn.Linear(200, 200),
      nn.ReLU(),
      nn.Linear(200, NUM_CLASSES),
    )
  if name == 'vgg9':  # width 1/4, fc_width 512 (FedMHO's VGG9 layout)
    c1, c2, c3, c4 = 16, 32, 64, 64
    return nn.Sequential(
      nn.Conv2d(1, c1, 3, padding=1),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Conv2d(c1, c2, 3, padding=1),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Conv2d(c2, c3, 3, padding=1),
      nn.ReLU(),
      nn.Conv2d(c3, c4, 3, padding=1),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.AdaptiveAvgPool2d((7, 7)),
      nn.Flatten(),
      nn.Linear(c4 * 49, 512),
      nn.ReLU(),
      nn.Dropout(0.5),
      nn.Linear(512, 512),
      nn.ReLU(),
      nn.Dropout(0.5),
      nn.Linear(512, NUM_CLASSES),
    )
  if name == 'resnet18':  # width 1/4 (kuangliu/pytorch-cifar's ResNet-18 layout)

    class Block(nn.Module):
      def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
          self.short = nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
          )

      def forward(self, x):
        out = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(out)) + self.short(x))

    widths = (16, 32, 64, 128)
    layers = [nn.Conv2d(1, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, w in enumerate(widths):
      for j in range(2):
        layers.append(Block(cin, w, 2 if (i > 0 and j == 0) else 1))
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, NUM_CLASSES)]
    return nn.Sequential(*layers)
  raise ValueError(f'no PyTorch twin for model {name!r}; valid: {", ".join(MODELS)}')


def _torch_train(torch, global_model, xs, ys, steps: int, batch: int):
  import copy

  loss_fn = torch.nn.CrossEntropyLoss()
  total = 0.0
  for k in range(xs.shape[0]):
    model = copy.deepcopy(global_model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    order = torch.randperm(xs.shape[1])
    for s in range(steps):
      idx = order[s * batch : (s + 1) * batch]
      opt.zero_grad(set_to_none=True)
      loss = loss_fn(model(xs[k][idx]), ys[k][idx])
      loss.backward()
      opt.step()
      total += float(loss.detach())
  if not np.isfinite(total):
    raise RuntimeError('non-finite PyTorch training loss')


def jfed_module(name: str, conv_impl: Optional[str] = None):
  """The jfed module of `MODELS[name]`; `conv_impl` sets the convolutions' form of a model
  that has them (None: the model's default)."""
  from jfed.methods.common import parse_model_spec
  from jfed.models import get_model

  model_name, kw = parse_model_spec(MODELS[name].spec)
  if conv_impl is not None and name in CONV_MODELS:
    kw['conv_impl'] = conv_impl
  return get_model(model_name, NUM_CLASSES, INPUT_SHAPE, **kw)


def client_optimizer():
  """The clients' optimiser in every form: SGD(LR, momentum MOMENTUM), as PyTorch's side."""
  import optax

  return optax.sgd(LR, momentum=MOMENTUM)


def _jfed_form(name: str, case: ModelCase, fed, conv_impl: str = 'lax', loop_threads=None):
  from jfed.engine.state import init_models, init_train_state
  from jfed.engine.training import GroupTrainer

  module = jfed_module(name, conv_impl)
  tx = client_optimizer()
  trainer = GroupTrainer(module, tx, case.batch, strategy='auto', loop_threads=loop_threads)
  state0 = init_train_state(tx, init_models(module, INPUT_SHAPE, jax.random.key(0), CLIENTS))
  key = jax.random.key(0)

  def call():
    out, metrics = trainer.train(state0, fed, 1, key)
    jax.block_until_ready(out)
    if not np.all(np.isfinite(metrics.loss)):
      raise RuntimeError(f'non-finite jfed training loss for {name}')

  strategy = trainer.strategy
  if strategy == 'loop':
    strategy += f' ({trainer.loop_threads} thread{"s" if trainer.loop_threads > 1 else ""})'
  return call, strategy


# Models with convolutions: their `conv_impl` forms are timed side by side.
CONV_MODELS = ('cnn_mnist', 'vgg9', 'resnet18')
CONV_FORMS = ('lax', 'matmul')
# The default convolution form in the plain loop (one client at a time), beside the threaded one.
ONE_THREAD = 'lax 1 thread'


def timed(fn) -> float:
  """Seconds `fn()` takes."""
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def model_rows(
  torch, models: Tuple[str, ...], steps: int, repeats: int
) -> list:  # one row per model
  """Times jfed and PyTorch per model, interleaved A/B; see the module docstring."""
  from jfed.data.federated import federate
  from jfed.engine.training import default_loop_threads

  unknown = set(models) - set(MODELS)
  if unknown:
    raise ValueError(f'unknown models {sorted(unknown)}; valid: {", ".join(MODELS)}')
  rows = []
  for name in models:
    case = MODELS[name]
    n = steps * case.batch
    rng = np.random.default_rng(0)
    x = rng.standard_normal((CLIENTS * n, *INPUT_SHAPE), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, CLIENTS * n).astype(np.int32)
    fed = federate(x, y, [np.arange(k * n, (k + 1) * n) for k in range(CLIENTS)])
    conv_forms = CONV_FORMS if name in CONV_MODELS else ('lax',)
    forms, strategies = {}, {}
    for impl in conv_forms:
      forms[f'jfed:{impl}'], strategies[impl] = _jfed_form(name, case, fed, impl)
    if default_loop_threads() > 1:  # the plain loop beside the threaded default
      forms[f'jfed:{ONE_THREAD}'], strategies[ONE_THREAD] = _jfed_form(
        name, case, fed, 'lax', loop_threads=1
      )
    if torch is not None:
      torch.manual_seed(0)
      xs = torch.from_numpy(np.ascontiguousarray(fed.x.transpose(0, 1, 4, 2, 3)))
      ys = torch.from_numpy(fed.y.astype(np.int64))
      tmodel = torch_model(torch, name)
      forms['torch'] = lambda: _torch_train(torch, tmodel, xs, ys, steps, case.batch)
    warm = {k: timed(f) for k, f in forms.items()}
    load_start = load_average()
    log(f'  {name} (batch {case.batch}): timing {", ".join(forms)} x {repeats} (load {load_start})')
    times = {k: [] for k in forms}
    for _ in range(repeats):
      for k, f in forms.items():
        times[k].append(timed(f))
    client_steps = CLIENTS * steps
    ms = {k: 1e3 * statistics.median(t) / client_steps for k, t in times.items()}
    jfed_ms = {k.split(':')[1]: v for k, v in ms.items() if k.startswith('jfed:')}
    best = min(jfed_ms, key=jfed_ms.get)
    ms['jfed'] = jfed_ms[best]
    row = {
      'model': name,
      'spec': case.spec,
      'batch': case.batch,
      'config': case.source,
      'clients': CLIENTS,
      'steps_per_client': steps,
      'jfed_form': (
        f'{strategies[best]}, conv {best.split()[0]}' if name in CONV_MODELS else strategies[best]
      ),
      'jfed_ms_per_form': jfed_ms,
      'default_form_ms': jfed_ms['lax'],
      'warmup_s': warm,
      'seconds': times,
      'jfed_ms_per_client_step': ms['jfed'],
      'torch_ms_per_client_step': ms.get('torch'),
      'ratio_vs_torch': ms['torch'] / ms['jfed'] if 'torch' in ms else None,
      'load_average_start': load_start,
      'load_average_end': load_average(),
    }
    log(
      f'    jfed {ms["jfed"]:.2f} ms/client-step'
      + (f', PyTorch {ms["torch"]:.2f}, ratio {row["ratio_vs_torch"]:.2f}' if 'torch' in ms else '')
    )
    rows.append(row)
  return rows


def report(rows: list, torch_threads) -> str:
  """The per-model table (ratio = PyTorch ms / jfed ms: > 1 means jfed is faster)."""
  if not rows:
    return ''
  r0 = rows[0]
  lines = [
    '#### Client training per model (forward + backward + SGD momentum step)',
    '',
    f'{r0["clients"]} clients x {r0["steps_per_client"]} steps each, random 28x28x1 images; '
    f'PyTorch with {torch_threads} thread(s); jfed and PyTorch timed in turn (A/B), median of '
    f'{len(r0["seconds"]["jfed:lax"])}; jfed: the faster `conv_impl` form (both timed, each '
    'ms/client-step in the last column but one). Ratio = PyTorch ms / jfed ms (> 1: jfed faster).',
    '',
    '| model | batch | config | jfed form | jfed ms/client-step | PyTorch ms/client-step '
    '| ratio | every jfed form | load average (start, end) |',
    '|---|---:|---|---|---:|---:|---:|---|---|',
  ]
  for r in rows:
    torch_ms = r['torch_ms_per_client_step']
    ratio = r['ratio_vs_torch']
    lines.append(
      f'| `{r["spec"]}` | {r["batch"]} | {r["config"]} | {r["jfed_form"]} '
      f'| {r["jfed_ms_per_client_step"]:.2f} '
      f'| {"n/a" if torch_ms is None else format(torch_ms, ".2f")} '
      f'| {"n/a" if ratio is None else format(ratio, ".2f")} '
      f'| {", ".join(f"{k} {v:.2f}" for k, v in r["jfed_ms_per_form"].items())} '
      f'| {r["load_average_start"]}, {r["load_average_end"]} |'
    )
  return '\n'.join(lines)
