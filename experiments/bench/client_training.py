"""Local-training throughput: jfed client-map strategies vs a PyTorch per-client loop.

    python -m experiments.bench.client_training [--clients=5,20,100] [--steps=N]
        [--out=FILE.json] [--noskip_slow]

For each number of clients m, every client trains DENSE's CNNMnist (jfed `cnn_mnist`, 28x28x1,
10 classes) for one epoch of `steps` batches of 64 random images with SGD(lr 0.01, momentum 0.9):

- jfed `GroupTrainer.train` with each strategy (`loop`, `vmap`, `scan`) on a `FederatedArrays`
  in which every client holds exactly steps*64 samples. A warm-up call on the same array shapes
  compiles everything first; the timed call is the second one, ended by
  `jax.block_until_ready`. (For `loop` and `vmap` the warm-up call gives every client only
  min(steps, 2)*64 real samples, so it runs at most two steps per client but compiles exactly
  the programs the timed call uses; `scan` compiles per number of steps, so its warm-up is the
  full call.)
- PyTorch (if importable): the same network in torch.nn, one client after another, each client
  copying the global model and building a fresh SGD optimiser, then forward, cross entropy,
  backward, step for every batch; `torch.set_num_threads(<CPU count>)`. It is timed on the
  second of two identical calls, like jfed. On a GPU backend torch runs on CUDA when it can.

It prints a Markdown table (ms per client-step, client-steps/s, torch_ms / jfed_ms: > 1 means
jfed is faster), marks the fastest jfed strategy per m and says whether `auto` resolves to it.
`--out` also writes the table and the raw numbers as JSON.

Runtime: on XLA:CPU, `vmap` and `scan` are very slow (design.md: ~300 and ~1700 ms per
client-step), so by default (`--skip_slow`, on CPU backends only) they are skipped for
m >= 100; the default run then takes about 5 minutes on 2 cores. `--noskip_slow` measures them
as well (about 10-15 more minutes on 2 cores).
"""

import json
import math
import os
import platform
import time

from absl import app, flags
import jax
import numpy as np

from experiments.bench.machine import cpu_count, cpu_model, load_average, log

FLAGS = flags.FLAGS
flags.DEFINE_list('clients', ['5', '20', '100'], 'Numbers of clients m to benchmark.')
flags.DEFINE_integer(
  'steps',
  None,
  'Local steps (batches of 64) per client; default depends on m: 4 for m <= 5, else 2.',
)
flags.DEFINE_integer(
  'torch_threads',
  0,
  'PyTorch intra-op threads (0: one per CPU). With other '
  'jobs on the machine, 1 avoids OpenMP contention that inflates its time.',
)
flags.DEFINE_string('out', None, 'Optional JSON file for the table and the raw numbers.')
flags.DEFINE_bool(
  'skip_slow',
  True,
  'On a CPU backend, skip vmap/scan for m >= 100 '
  '(minutes each on XLA:CPU). Use --noskip_slow to measure them.',
)

BATCH = 64
LR = 0.01
MOMENTUM = 0.9
NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
JFED_STRATEGIES = ('loop', 'vmap', 'scan')
SLOW_STRATEGIES = ('vmap', 'scan')
SLOW_MIN_CLIENTS = 100


def default_steps(m: int) -> int:
  return 4 if m <= 5 else 2


def make_data(m: int, steps: int, seed: int = 0):
  """Random 28x28x1 images and labels, steps*64 per client, as a jfed FederatedArrays."""
  from jfed.data.federated import federate

  n = steps * BATCH
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m * n, *INPUT_SHAPE), dtype=np.float32)
  y = rng.integers(0, NUM_CLASSES, m * n).astype(np.int32)
  parts = [np.arange(k * n, (k + 1) * n) for k in range(m)]
  return federate(x, y, parts)


# ---------------------------------------------------------------------------------------------
# jfed
# ---------------------------------------------------------------------------------------------
def time_jfed(trainer, state0, fed, steps: int) -> float:
  """Seconds of the second (compiled) GroupTrainer.train call on `fed` (1 epoch)."""
  from jfed.data.federated import FederatedArrays

  m = fed.num_clients
  key = jax.random.key(0)
  if trainer.strategy in ('loop', 'vmap'):
    # Same shapes (hence the same compiled programs) but at most two real batches per client:
    # two so that the accumulation of step statistics is compiled too.
    warm = FederatedArrays(fed.x, fed.y, np.full(m, min(steps, 2) * BATCH, np.int32))
  else:
    warm = fed  # `scan` compiles per number of steps.
  t0 = time.perf_counter()
  out, _ = trainer.train(state0, warm, 1, key)
  jax.block_until_ready(out)
  log(f'    warm-up (compile) {time.perf_counter() - t0:.1f} s')
  t0 = time.perf_counter()
  out, metrics = trainer.train(state0, fed, 1, key)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t0
  if not np.all(np.isfinite(metrics.loss)):
    raise RuntimeError(f'non-finite training loss with strategy {trainer.strategy}')
  return seconds


# ---------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------
def torch_model(torch):
  nn = torch.nn
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
    nn.Linear(1568, NUM_CLASSES),
  )


def torch_train_clients(torch, global_model, xs, ys, steps: int, device):
  """Trains every client in turn from the global model (PyTorch FL code's local-update loop)."""
  import copy

  loss_fn = torch.nn.CrossEntropyLoss()
  total = torch.zeros((), device=device)
  models = []
  for k in range(xs.shape[0]):
    model = copy.deepcopy(global_model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    order = torch.randperm(xs.shape[1], device=device)
    for s in range(steps):
      idx = order[s * BATCH : (s + 1) * BATCH]
      xb, yb = xs[k][idx], ys[k][idx]
      opt.zero_grad(set_to_none=True)
      loss = loss_fn(model(xb), yb)
      loss.backward()
      opt.step()
      total = total + loss.detach()
    models.append(model)
  return models, total


def time_torch(torch, fed, steps: int, device) -> float:
  """Seconds of the second of two identical per-client loops (the first warms up oneDNN/cuDNN)."""
  torch.manual_seed(0)
  xs = torch.from_numpy(np.ascontiguousarray(fed.x.transpose(0, 1, 4, 2, 3))).to(device)
  ys = torch.from_numpy(fed.y.astype(np.int64)).to(device)
  global_model = torch_model(torch).to(device)
  sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
  torch_train_clients(torch, global_model, xs, ys, steps, device)  # warm-up, same work
  sync()
  t0 = time.perf_counter()
  _, total = torch_train_clients(torch, global_model, xs, ys, steps, device)
  sync()
  seconds = time.perf_counter() - t0
  if not math.isfinite(float(total)):
    raise RuntimeError('non-finite PyTorch training loss')
  return seconds


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _fmt(v, spec):
  return 'n/a' if v is None else format(v, spec)


def build_report(meta, results, auto_strategy):
  lines = [
    '# jfed local-training throughput (CNNMnist, batch 64, SGD lr 0.01 momentum 0.9)',
    '',
    f'- backend: **{meta["backend"]}** (device kind: {meta["device_kind"]}, '
    f'{meta["num_devices"]} device(s)); `auto` resolves to **{auto_strategy}**',
    f'- jax {meta["jax_version"]}, jaxlib {meta["jaxlib_version"]}, flax {meta["flax_version"]}, '
    f'torch {meta["torch_version"] or "not importable"}'
    + (
      f' on {meta["torch_device"]} ({meta["torch_threads"]} threads)'
      if meta['torch_version']
      else ''
    ),
    f'- CPUs: {meta["cpu_count"]} ({meta["cpu_model"]}); load average at start '
    f'{meta["load_average"]}; python {meta["python_version"]}',
    '- steps per client: '
    + ', '.join(f'm={m}: {s}' for m, s in meta['steps'].items())
    + ' (1 epoch, random 28x28x1 inputs)',
    '',
    '| clients | strategy | ms/client-step | client-steps/s | ratio vs PyTorch |',
    '|---:|---|---:|---:|---:|',
  ]
  summary = {}
  for m in meta['clients']:
    rows = [r for r in results if r['clients'] == m]
    timed = [r for r in rows if r['framework'] == 'jfed' and r['ms_per_client_step'] is not None]
    fastest = min(timed, key=lambda r: r['ms_per_client_step'])['strategy'] if timed else None
    skipped = [r['strategy'] for r in rows if r['framework'] == 'jfed' and r['skipped']]
    for r in rows:
      name = r['strategy'] if r['framework'] == 'jfed' else 'PyTorch loop'
      if r['framework'] == 'jfed':
        name = f'jfed {name}'
        if r['strategy'] == auto_strategy:
          name += ' (= auto)'
        if r['strategy'] == fastest:
          name += ' **fastest**'
      if r['skipped']:
        lines.append(f'| {m} | {name} | skipped: {r["skipped"]} | | |')
        continue
      lines.append(
        f'| {m} | {name} | {_fmt(r["ms_per_client_step"], ".1f")} | '
        f'{_fmt(r["client_steps_per_s"], ".1f")} | '
        f'{_fmt(r["ratio_vs_torch"], ".2f")} |'
      )
    ms = {r['strategy']: r['ms_per_client_step'] for r in timed}
    summary[m] = {
      'fastest_jfed': fastest,
      'auto': auto_strategy,
      'auto_is_fastest': fastest == auto_strategy if fastest else None,
      'auto_slowdown_vs_fastest': (
        ms[auto_strategy] / ms[fastest] if fastest and auto_strategy in ms else None
      ),
      'skipped': skipped,
    }
  lines.append('')
  for m, s in summary.items():
    among = f' (among measured; skipped: {", ".join(s["skipped"])})' if s['skipped'] else ''
    verdict = ('yes' if s['auto_is_fastest'] else 'no') if s['fastest_jfed'] else 'n/a'
    if s['fastest_jfed'] and not s['auto_is_fastest']:
      slow = s['auto_slowdown_vs_fastest']
      verdict += (
        f' (auto is {100 * (slow - 1):.0f}% slower)' if slow is not None else ' (auto not measured)'
      )
    lines.append(
      f'- m={m}: fastest jfed strategy = {s["fastest_jfed"]}{among}; '
      f'auto -> {auto_strategy}: picked the fastest: **{verdict}**'
    )
  lines.append('')
  lines.append('ratio vs PyTorch = torch_ms / jfed_ms: > 1 means jfed is faster.')
  return '\n'.join(lines), summary


def row(m, steps, framework, strategy, seconds=None, skipped=None):
  client_steps = m * steps
  r = {
    'clients': m,
    'steps_per_client': steps,
    'framework': framework,
    'strategy': strategy,
    'client_steps': client_steps,
    'seconds': seconds,
    'skipped': skipped,
    'ms_per_client_step': None,
    'client_steps_per_s': None,
    'ratio_vs_torch': None,
  }
  if seconds is not None:
    r['ms_per_client_step'] = 1e3 * seconds / client_steps
    r['client_steps_per_s'] = client_steps / seconds
  return r


def main(argv):
  del argv
  import flax
  import jaxlib
  import optax

  from jfed.engine.state import init_models, init_train_state
  from jfed.engine.training import GroupTrainer, resolve_strategy
  from jfed.models import get_model

  try:
    import torch
  except ImportError as e:
    torch = None
    log(f'PyTorch not importable ({e}): skipping the PyTorch baseline.')

  clients = [int(c) for c in FLAGS.clients]
  if not clients or min(clients) < 1:
    raise app.UsageError('--clients needs positive integers')
  if FLAGS.steps is not None and FLAGS.steps < 1:
    raise app.UsageError('--steps must be >= 1')
  steps_for = {m: FLAGS.steps or default_steps(m) for m in clients}
  backend = jax.default_backend()
  auto_strategy = resolve_strategy('auto')
  ncpu = cpu_count()

  torch_device = None
  if torch is not None:
    torch.set_num_threads(FLAGS.torch_threads or ncpu)
    use_cuda = backend == 'gpu' and torch.cuda.is_available()
    torch_device = torch.device('cuda' if use_cuda else 'cpu')

  meta = {
    'backend': backend,
    'device_kind': jax.devices()[0].device_kind,
    'num_devices': jax.device_count(),
    'jax_version': jax.__version__,
    'jaxlib_version': jaxlib.__version__,
    'flax_version': flax.__version__,
    'torch_version': torch.__version__ if torch is not None else None,
    'torch_device': str(torch_device) if torch is not None else None,
    'torch_threads': torch.get_num_threads() if torch is not None else None,
    'cpu_count': ncpu,
    'cpu_model': cpu_model(),
    'load_average': load_average(),
    'python_version': platform.python_version(),
    'clients': clients,
    'steps': steps_for,
    'batch_size': BATCH,
    'optimizer': f'sgd(lr={LR}, momentum={MOMENTUM})',
    'model': 'cnn_mnist 28x28x1, 10 classes',
    'auto_strategy': auto_strategy,
    'skip_slow': FLAGS.skip_slow,
  }
  log(
    f'backend {backend} ({meta["device_kind"]}), auto -> {auto_strategy}, CPUs {ncpu}, '
    f'steps per client {steps_for}'
  )

  module = get_model('cnn_mnist', NUM_CLASSES, INPUT_SHAPE)
  tx = optax.sgd(LR, momentum=MOMENTUM)
  trainers = {s: GroupTrainer(module, tx, BATCH, strategy=s) for s in JFED_STRATEGIES}

  results = []
  t_start = time.perf_counter()
  for m in clients:
    steps = steps_for[m]
    fed = make_data(m, steps)
    state0 = init_train_state(tx, init_models(module, INPUT_SHAPE, jax.random.key(0), m))
    m_rows = []
    if torch is not None:
      log(f'm={m}, {steps} steps/client: PyTorch loop')
      m_rows.append(row(m, steps, 'torch', 'loop', time_torch(torch, fed, steps, torch_device)))
      log(f'    {m_rows[-1]["ms_per_client_step"]:.1f} ms/client-step')
    for strategy in JFED_STRATEGIES:
      if (
        FLAGS.skip_slow
        and backend == 'cpu'
        and strategy in SLOW_STRATEGIES
        and m >= SLOW_MIN_CLIENTS
      ):
        log(f'm={m}: jfed {strategy} skipped (--skip_slow)')
        m_rows.append(row(m, steps, 'jfed', strategy, skipped='--skip_slow'))
        continue
      log(f'm={m}, {steps} steps/client: jfed {strategy}')
      m_rows.append(
        row(m, steps, 'jfed', strategy, time_jfed(trainers[strategy], state0, fed, steps))
      )
      log(f'    {m_rows[-1]["ms_per_client_step"]:.1f} ms/client-step')
    torch_ms = m_rows[0]['ms_per_client_step'] if torch is not None else None
    for r in m_rows:
      if torch_ms is not None and r['ms_per_client_step'] is not None:
        r['ratio_vs_torch'] = torch_ms / r['ms_per_client_step']
    results.extend(m_rows)
    del fed, state0
  meta['total_seconds'] = time.perf_counter() - t_start

  table, summary = build_report(meta, results, auto_strategy)
  if torch is None:
    table += '\n\nPyTorch was not importable: no baseline, ratios are n/a.'
  print(table)
  if FLAGS.out:
    out_dir = os.path.dirname(FLAGS.out)
    if out_dir:
      os.makedirs(out_dir, exist_ok=True)
    payload = {
      'meta': {**meta, 'steps': {str(k): v for k, v in steps_for.items()}},
      'results': results,
      'summary': {str(k): v for k, v in summary.items()},
      'table_markdown': table,
    }
    with open(FLAGS.out, 'w') as f:
      json.dump(payload, f, indent=2)
    log(f'wrote {FLAGS.out}')


if __name__ == '__main__':
  app.run(main)
