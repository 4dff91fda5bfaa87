"""Local-training throughput: jfed client-map strategies vs a PyTorch per-client loop.

    python -m experiments.bench.client_training [--clients=5,20,100] [--steps=N] [--repeats=R]
        [--strategies=loop,vmap,scan] [--nolegacy_loop] [--noskip_slow] [--torch_threads=T]
        [--probe_clients=20] [--eval_models=10] [--out=FILE.json]

From Python: `run(Sizes(...))` returns the same table and raw numbers as a dict
(`experiments.bench.all` calls it).

For each number of clients m, every client trains DENSE's CNNMnist (jfed `cnn_mnist`, 28x28x1,
10 classes) for one epoch of `steps` batches of 64 random images with SGD(lr 0.01, momentum 0.9):

- jfed `GroupTrainer.train` with each strategy (`loop`, `vmap`, `scan`) on a `FederatedArrays`
  in which every client holds exactly steps*64 samples;
- `loop (before issue 14)`: the `loop` strategy's host code as it was before issue 14
  (`experiments/bench/reference_loop.py`: per-leaf slicing and stacking, a Python step index,
  one more dispatch per step for the metrics, no donation), same jitted step, same numbers;
- PyTorch (if importable): the same network in torch.nn, one client after another, each client
  copying the global model and building a fresh SGD optimiser, then forward, cross entropy,
  backward, step for every batch; `torch.set_num_threads(<CPU count>)`. On a GPU backend torch
  runs on CUDA when it can.

Every form first runs a warm-up call that compiles (jfed) or warms up oneDNN/cuDNN (torch): for
`loop` and `vmap` a call on the same array shapes with one batch per client (it compiles exactly
the programs of the timed call), for `scan` (compiled per number of steps) and torch the full
call. Then the forms are timed in turn, `repeats` rounds (interleaved, so a change of machine
load hits every form alike); the median is reported, each call ended by
`jax.block_until_ready` (torch: `cuda.synchronize`).

Two more tables isolate what the loop strategy's host code costs:
- dispatch probe: the same loop, before and after issue 14, on a one-layer model (Dense 784->10)
  whose step costs almost nothing, so ms/client-step is mostly per-step host overhead;
- evaluation of `eval_models` stacked CNNMnist models on `eval_examples` images (jfed
  `Evaluator.group_logits`): one model and batch per call as before issue 14, the `loop`
  strategy's one call per batch for all models (`lax.map`), and `vmap` (client-batched).

Output: Markdown tables (ms per client-step, client-steps/s, ratios: > 1 means the row is faster
than the reference), the fastest jfed strategy per m and whether `auto` resolves to it; `--out`
also writes the tables and the raw numbers as JSON.

Runtime: on XLA:CPU, `vmap` and `scan` are very slow (design.md: ~300 and ~1700 ms per
client-step), so by default (`--skip_slow`, on CPU backends only) they are skipped for
m >= 100; the default run then takes about 5 minutes on 2 cores.
"""

import math
import statistics
import time
from typing import NamedTuple, Tuple, Union

import flax.linen as nn
import jax
import numpy as np

from experiments.bench.machine import (
  cpu_count,
  environment,
  import_torch,
  load_average,
  log,
  write_json,
)

BATCH = 64
LR = 0.01
MOMENTUM = 0.9
NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
JFED_STRATEGIES = ('loop', 'vmap', 'scan')
SLOW_STRATEGIES = ('vmap', 'scan')
SLOW_MIN_CLIENTS = 100
LEGACY = 'legacy_loop'
PLAIN_LOOP = 'loop_one_thread'  # the loop training one client at a time (loop_threads=1)
NAMES = {
  'torch': 'PyTorch per-client loop',
  LEGACY: 'jfed loop, before issue 14',
  PLAIN_LOOP: 'jfed loop, one client at a time',
  'loop': 'jfed loop',
  'vmap': 'jfed vmap',
  'scan': 'jfed scan',
}


class Sizes(NamedTuple):
  """What to run; the defaults are the command line's."""

  clients: Tuple[int, ...] = (5, 20, 100)
  # Per client; an int for every m, a tuple per m (aligned with `clients`), None: default_steps.
  steps: Union[None, int, Tuple[int, ...]] = None
  strategies: Tuple[str, ...] = JFED_STRATEGIES
  legacy_loop: bool = True  # also time the loop strategy as before issue 14
  legacy_max_clients: int = 0  # time the loop before issue 14 only up to this m (0: always)
  skip_slow: bool = True  # CPU only: skip vmap/scan for m >= SLOW_MIN_CLIENTS
  repeats: Union[int, Tuple[int, ...]] = 1  # timed rounds per form (median); int or per m
  torch: bool = True
  torch_threads: int = 0  # 0: one per CPU
  probe_clients: int = 20  # dispatch probe (tiny model); 0: off
  probe_steps: int = 8
  probe_repeats: int = 5
  eval_models: int = 10  # evaluation of many models; 0: off
  eval_examples: int = 1000
  eval_batch: int = 500
  eval_repeats: int = 2
  # Per-model table (experiments/bench/model_zoo_training.py): the configs' CPU client models.
  models: Tuple[str, ...] = ()
  model_steps: int = 4
  model_repeats: int = 3


def default_steps(m: int) -> int:
  return 4 if m <= 5 else 2


def _for_m(value, sizes: 'Sizes', m: int):
  return value[sizes.clients.index(m)] if isinstance(value, tuple) else value


def steps_for(sizes: 'Sizes', m: int) -> int:
  return _for_m(sizes.steps, sizes, m) or default_steps(m)


def make_data(m: int, steps: int, seed: int = 0):
  """Random 28x28x1 images and labels, steps*64 per client, as a jfed FederatedArrays."""
  from jfed.data.federated import federate

  n = steps * BATCH
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m * n, *INPUT_SHAPE), dtype=np.float32)
  y = rng.integers(0, NUM_CLASSES, m * n).astype(np.int32)
  parts = [np.arange(k * n, (k + 1) * n) for k in range(m)]
  return federate(x, y, parts)


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def _interleaved(forms, repeats):
  """{name: [seconds] * repeats}, the forms timed in turn so that load changes hit all alike."""
  times = {name: [] for name in forms}
  outs = {}
  for _ in range(repeats):
    for name, fn in forms.items():
      seconds, outs[name] = _timed(fn)
      times[name].append(seconds)
  return times, outs


# ---------------------------------------------------------------------------------------------
# jfed
# ---------------------------------------------------------------------------------------------
def jfed_form(trainer, state0, fed):
  """(warm-up, timed call) for GroupTrainer.train on `fed`, 1 epoch."""
  from jfed.data.federated import FederatedArrays

  key = jax.random.key(0)
  if trainer.strategy == 'scan':
    warm = fed  # `scan` compiles per number of steps.
  else:
    # Same shapes, hence the same compiled programs (client slicing and stacking included), but
    # one real batch in all: the other clients are empty and run no step.
    sizes = np.zeros(fed.num_clients, np.int32)
    sizes[0] = BATCH
    warm = FederatedArrays(fed.x, fed.y, sizes)

  def call(data):
    out, metrics = trainer.train(state0, data, 1, key)
    jax.block_until_ready(out)
    if not np.all(np.isfinite(metrics.loss)):
      raise RuntimeError(f'non-finite training loss with strategy {trainer.strategy}')
    return out

  return (lambda: call(warm)), (lambda: call(fed))


def _max_abs_diff(a, b) -> float:
  return max(
    float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# ---------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------
def torch_model(torch, num_classes: int = NUM_CLASSES):
  """DENSE's CNNMnist (jfed `cnn_mnist`) in torch.nn."""
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
    nn.Linear(1568, num_classes),
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


def torch_form(torch, fed, steps: int, device):
  torch.manual_seed(0)
  xs = torch.from_numpy(np.ascontiguousarray(fed.x.transpose(0, 1, 4, 2, 3))).to(device)
  ys = torch.from_numpy(fed.y.astype(np.int64)).to(device)
  global_model = torch_model(torch).to(device)
  sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)

  def call(clients):
    _, total = torch_train_clients(torch, global_model, xs[:clients], ys[:clients], steps, device)
    sync()
    if not math.isfinite(float(total)):
      raise RuntimeError('non-finite PyTorch training loss')

  # Two clients warm up oneDNN/cuDNN and the allocator as well as all of them would.
  return (lambda: call(2)), (lambda: call(xs.shape[0]))


# ---------------------------------------------------------------------------------------------
# one table per concern
# ---------------------------------------------------------------------------------------------
def _row(m, steps, form, times, compile_s=None, skipped=None):
  client_steps = m * steps
  r = {
    'clients': m,
    'steps_per_client': steps,
    'form': form,
    'framework': 'torch' if form == 'torch' else 'jfed',
    'client_steps': client_steps,
    'warmup_s': compile_s,
    'seconds': times,
    'skipped': skipped,
    'ms_per_client_step': None,
    'client_steps_per_s': None,
  }
  if times:
    med = statistics.median(times)
    r['ms_per_client_step'] = 1e3 * med / client_steps
    r['client_steps_per_s'] = client_steps / med
    r['min_ms_per_client_step'] = 1e3 * min(times) / client_steps
  return r


def _add_ratios(rows, refs):
  """ratio_vs_<ref> = ref's ms / the row's ms (> 1: the row is faster)."""
  ms = {r['form']: r['ms_per_client_step'] for r in rows if r['ms_per_client_step']}
  for r in rows:
    for ref in refs:
      ok = r['ms_per_client_step'] and ref in ms
      r[f'ratio_vs_{ref}'] = ms[ref] / r['ms_per_client_step'] if ok else None


def training_rows(sizes: Sizes, torch, torch_device, backend):
  import optax

  from experiments.bench.reference_loop import LegacyLoopTrainer
  from jfed.engine.state import init_models, init_train_state
  from jfed.engine.training import GroupTrainer
  from jfed.models import get_model

  module = get_model('cnn_mnist', NUM_CLASSES, INPUT_SHAPE)
  tx = optax.sgd(LR, momentum=MOMENTUM)
  trainers = {s: GroupTrainer(module, tx, BATCH, strategy=s) for s in sizes.strategies}
  if 'loop' in trainers and trainers['loop'].loop_threads > 1:
    trainers[PLAIN_LOOP] = GroupTrainer(module, tx, BATCH, strategy='loop', loop_threads=1)
  if sizes.legacy_loop:
    trainers = {LEGACY: LegacyLoopTrainer(module, tx, BATCH), **trainers}
  rows, checks, thread_checks = [], {}, {}
  for m in sizes.clients:
    legacy_off = sizes.legacy_max_clients and m > sizes.legacy_max_clients
    steps, repeats = steps_for(sizes, m), _for_m(sizes.repeats, sizes, m)
    fed = make_data(m, steps)
    state0 = init_train_state(tx, init_models(module, INPUT_SHAPE, jax.random.key(0), m))
    forms, m_rows = {}, []
    if torch is not None:
      forms['torch'] = torch_form(torch, fed, steps, torch_device)
    for name, trainer in trainers.items():
      if name == LEGACY and legacy_off:
        m_rows.append(_row(m, steps, name, None, skipped=f'm > {sizes.legacy_max_clients}'))
        continue
      slow = name in SLOW_STRATEGIES and m >= SLOW_MIN_CLIENTS
      if sizes.skip_slow and backend == 'cpu' and slow:
        log(f'  m={m}: {NAMES[name]} skipped (skip_slow: minutes on XLA:CPU)')
        m_rows.append(_row(m, steps, name, None, skipped='skip_slow on CPU'))
        continue
      forms[name] = jfed_form(trainer, state0, fed)
    warm = {}
    for name, (warm_fn, _) in forms.items():
      log(f'  m={m}, {steps} steps/client: warm-up {NAMES[name]}')
      warm[name], _ = _timed(warm_fn)
    log(f'  m={m}: timing {", ".join(forms)} x {repeats} (load {load_average()})')
    times, outs = _interleaved({n: f[1] for n, f in forms.items()}, repeats)
    for name in forms:
      m_rows.append(_row(m, steps, name, times[name], warm[name]))
      log(f'    {NAMES[name]}: {m_rows[-1]["ms_per_client_step"]:.2f} ms/client-step')
    _add_ratios(m_rows, ('torch', LEGACY, 'loop'))
    if LEGACY in outs and 'loop' in outs:
      checks[m] = _max_abs_diff(outs[LEGACY], outs['loop'])
    if PLAIN_LOOP in outs and 'loop' in outs:
      thread_checks[m] = _max_abs_diff(outs[PLAIN_LOOP], outs['loop'])
    rows.extend(m_rows)
    del fed, state0, outs
  return rows, checks, thread_checks


class ProbeNet(nn.Module):
  """Dense 784->10: a step that costs almost nothing, so the loop's host overhead shows."""

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    return nn.Dense(NUM_CLASSES)(x.reshape(x.shape[0], -1))


def probe_rows(sizes: Sizes):
  import optax

  from experiments.bench.reference_loop import LegacyLoopTrainer
  from jfed.engine.state import init_models, init_train_state
  from jfed.engine.training import GroupTrainer

  m, steps = sizes.probe_clients, sizes.probe_steps
  module = ProbeNet()
  tx = optax.sgd(LR, momentum=MOMENTUM)
  fed = make_data(m, steps, seed=1)
  state0 = init_train_state(tx, init_models(module, INPUT_SHAPE, jax.random.key(0), m))
  forms = {
    LEGACY: jfed_form(LegacyLoopTrainer(module, tx, BATCH), state0, fed),
    'loop': jfed_form(GroupTrainer(module, tx, BATCH, strategy='loop'), state0, fed),
  }
  warm = {name: _timed(f[0])[0] for name, f in forms.items()}
  times, outs = _interleaved({n: f[1] for n, f in forms.items()}, sizes.probe_repeats)
  rows = [_row(m, steps, name, times[name], warm[name]) for name in forms]
  _add_ratios(rows, (LEGACY,))
  return rows, _max_abs_diff(outs[LEGACY], outs['loop'])


def evaluation_rows(sizes: Sizes):
  from experiments.bench.reference_loop import LegacyLoopEvaluator
  from jfed.engine import Evaluator, init_models
  from jfed.models import get_model

  m, n, b = sizes.eval_models, sizes.eval_examples, sizes.eval_batch
  module = get_model('cnn_mnist', NUM_CLASSES, INPUT_SHAPE)
  models = init_models(module, INPUT_SHAPE, jax.random.key(0), m, same_init=False)
  x = np.random.default_rng(2).standard_normal((n, *INPUT_SHAPE), dtype=np.float32)
  evaluators = {
    LEGACY: LegacyLoopEvaluator(module, b),
    'loop': Evaluator(module, b, strategy='loop'),
    'vmap': Evaluator(module, b, strategy='vmap'),
  }
  forms = {name: (lambda ev=ev: ev.group_logits(models, x)) for name, ev in evaluators.items()}
  warm = {name: _timed(f)[0] for name, f in forms.items()}
  times, outs = _interleaved(forms, sizes.eval_repeats)
  rows = []
  for name in forms:
    med = statistics.median(times[name])
    rows.append(
      {
        'form': name,
        'models': m,
        'examples': n,
        'batch': b,
        'warmup_s': warm[name],
        'seconds': times[name],
        'ms_per_model': 1e3 * med / m,
        'max_abs_diff_vs_legacy': float(np.max(np.abs(outs[name] - outs[LEGACY]))),
      }
    )
  base = rows[0]['ms_per_model']
  for r in rows:
    r['ratio_vs_legacy_loop'] = base / r['ms_per_model']
  return rows


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _per_m_text(value, clients):
  if isinstance(value, (tuple, list)):
    return ', '.join(f'{v} at m={m}' for m, v in zip(clients, value))
  return str(value)


def _f(v, spec='.2f', none='n/a'):
  return none if v is None else format(v, spec)


def report(meta, rows, probe, evaluation, summary) -> str:
  auto = meta['auto_strategy']
  lines = [
    '### Client training (CNNMnist, batch 64, SGD lr 0.01 momentum 0.9, one epoch)',
    '',
    f'`auto` resolves to **{auto}** on {meta["backend"]} (the loop trains '
    f'{meta.get("loop_threads", 1)} client(s) at a time); PyTorch: '
    + (
      f'{meta["torch_version"]} on {meta["torch_device"]} ({meta["torch_threads"]} threads)'
      if meta['torch_version']
      else f'skipped ({meta["torch_note"]})'
    )
    + f'; median of {_per_m_text(meta["sizes"]["repeats"], meta["sizes"]["clients"])} '
    'interleaved timed call(s) after a warm-up; '
    f'load average {meta["load_average"]} at start, {meta["load_average_end"]} at end.',
    '',
    '| clients | steps/client | implementation | ms/client-step | client-steps/s '
    '| vs PyTorch | vs loop before issue 14 | vs jfed loop |',
    '|---:|---:|---|---:|---:|---:|---:|---:|',
  ]
  for r in rows:
    name = NAMES[r['form']]
    if r['form'] == auto:
      name += ' (= auto)'
    if summary['fastest'].get(str(r['clients'])) == r['form']:
      name += ' **fastest jfed**'
    if r['skipped']:
      lines.append(
        f'| {r["clients"]} | {r["steps_per_client"]} | {name} | skipped: {r["skipped"]} | | | | |'
      )
      continue
    lines.append(
      f'| {r["clients"]} | {r["steps_per_client"]} | {name} | {_f(r["ms_per_client_step"])} '
      f'| {_f(r["client_steps_per_s"], ".1f")} | {_f(r["ratio_vs_torch"])} '
      f'| {_f(r["ratio_vs_" + LEGACY])} | {_f(r["ratio_vs_loop"])} |'
    )
  lines.append('')
  for m, fastest in summary['fastest'].items():
    verdict = 'yes' if fastest == auto else 'no'
    lines.append(f'- m={m}: fastest jfed strategy {fastest}; auto picks it: **{verdict}**')
  for m, d in summary['loop_vs_legacy_max_abs_diff'].items():
    lines.append(
      f'- m={m}: loop after vs before issue 14, max abs difference of the trained states: {d:.1e}'
    )
  for m, d in summary.get('threaded_vs_plain_loop_max_abs_diff', {}).items():
    lines.append(
      f'- m={m}: loop on its client threads vs one client at a time, max abs difference of the '
      f'trained states: {d:.1e}'
    )
  lines.append("- ratios are the reference's ms / the row's ms: > 1 means the row is faster.")
  if probe:
    lines += [
      '',
      f'Dispatch probe (Dense 784->10, {probe[0]["clients"]} clients x '
      f'{probe[0]["steps_per_client"]} steps, median of {meta["sizes"]["probe_repeats"]}): the '
      "loop's host overhead per client-step.",
      '',
      '| implementation | ms/client-step | vs loop before issue 14 |',
      '|---|---:|---:|',
    ]
    for r in probe:
      lines.append(
        f'| {NAMES[r["form"]]} | {_f(r["ms_per_client_step"], ".3f")} '
        f'| {_f(r["ratio_vs_" + LEGACY])} |'
      )
    lines.append(f'\nmax abs difference of the trained states: {summary["probe_max_abs_diff"]:.1e}')
  if evaluation:
    e0 = evaluation[0]
    lines += [
      '',
      f'Evaluation of {e0["models"]} stacked CNNMnist models on {e0["examples"]} images, '
      f'batch {e0["batch"]} (`Evaluator.group_logits`, median of '
      f'{meta["sizes"]["eval_repeats"]}):',
      '',
      '| implementation | ms/model | vs before issue 14 | max abs diff |',
      '|---|---:|---:|---:|',
    ]
    eval_names = {
      LEGACY: 'one model, one batch per call (loop before issue 14)',
      'loop': 'all models per call, lax.map (loop now)',
      'vmap': 'all models per call, vmap',
    }
    eval_auto = 'loop' if auto == 'loop' else 'vmap'
    for r in evaluation:
      name = eval_names[r['form']] + (' (= auto)' if r['form'] == eval_auto else '')
      lines.append(
        f'| {name} | {r["ms_per_model"]:.1f} | {r["ratio_vs_legacy_loop"]:.2f} '
        f'| {r["max_abs_diff_vs_legacy"]:.1e} |'
      )
  return '\n'.join(lines)


def _goal_clients(clients):
  return 100 if 100 in clients else max(clients)


def headline(meta, rows, probe_rows, summary):
  """The summary rows of experiments.bench.all: the issue-14 goal and before/after."""
  out = []
  m = _goal_clients(meta['sizes']['clients'])
  by = {r['form']: r for r in rows if r['clients'] == m and r['ms_per_client_step']}
  best = summary['fastest'].get(str(m))
  auto = meta['auto_strategy']
  pick = auto if auto in by else best
  if pick:
    r = by[pick]
    out.append(
      {
        'benchmark': 'client training',
        'figure': f'jfed {pick}{" (auto)" if pick == auto else ""}, m={m}, ms/client-step',
        'value': r['ms_per_client_step'],
        'unit': 'ms',
        'reference': 'PyTorch per-client loop',
        'reference_value': by['torch']['ms_per_client_step'] if 'torch' in by else None,
        'ratio': r['ratio_vs_torch'],
        'loop_ratio': r['ratio_vs_loop'],
        'goal': '>= 10x PyTorch per-client loop at m=100 (accelerators)',
        'goal_ratio': 10.0,
      }
    )
  if 'loop' in by and LEGACY in by:
    out.append(
      {
        'benchmark': 'client training',
        'figure': f'jfed loop after vs before issue 14, m={m}, ms/client-step',
        'value': by['loop']['ms_per_client_step'],
        'unit': 'ms',
        'reference': 'loop before issue 14',
        'reference_value': by[LEGACY]['ms_per_client_step'],
        'ratio': by['loop']['ratio_vs_' + LEGACY],
        'loop_ratio': 1.0,
        'goal': 'less dispatch (no number)',
        'goal_ratio': None,
      }
    )
  probe = {r['form']: r for r in probe_rows}
  if 'loop' in probe and LEGACY in probe:
    out.append(
      {
        'benchmark': 'client training',
        'figure': 'dispatch probe (Dense 784->10): jfed loop after vs before issue 14, '
        'ms/client-step',
        'value': probe['loop']['ms_per_client_step'],
        'unit': 'ms',
        'reference': 'loop before issue 14',
        'reference_value': probe[LEGACY]['ms_per_client_step'],
        'ratio': probe['loop']['ratio_vs_' + LEGACY],
        'loop_ratio': 1.0,
        'goal': 'less dispatch (no number)',
        'goal_ratio': None,
      }
    )
  return out


def run(sizes: Sizes = Sizes()) -> dict:
  """Runs the benchmark; returns meta (environment, sizes), rows, tables and headline figures."""
  from jfed.engine.training import default_loop_threads, resolve_strategy

  if not sizes.clients or min(sizes.clients) < 1:
    raise ValueError('clients must be positive integers')
  if min(steps_for(sizes, m) for m in sizes.clients) < 1:
    raise ValueError('steps must be >= 1')
  for name in ('steps', 'repeats'):
    value = getattr(sizes, name)
    if isinstance(value, tuple) and len(value) != len(sizes.clients):
      raise ValueError(f'{name} {value} needs one entry per number of clients {sizes.clients}')
  unknown = set(sizes.strategies) - set(JFED_STRATEGIES)
  if unknown:
    raise ValueError(f'unknown strategies {sorted(unknown)}; valid: {JFED_STRATEGIES}')
  meta = environment()
  backend = meta['backend']
  torch, torch_note = import_torch(sizes.torch)
  torch_device = None
  if torch is not None:
    torch.set_num_threads(sizes.torch_threads or cpu_count())
    use_cuda = backend == 'gpu' and torch.cuda.is_available()
    torch_device = torch.device('cuda' if use_cuda else 'cpu')
  meta.update(
    torch_version=torch.__version__ if torch is not None else None,
    torch_device=str(torch_device) if torch is not None else None,
    torch_threads=torch.get_num_threads() if torch is not None else None,
    torch_note=torch_note,
    auto_strategy=resolve_strategy('auto'),
    loop_threads=default_loop_threads(),
    sizes={
      **sizes._asdict(),
      'steps_per_m': {m: steps_for(sizes, m) for m in sizes.clients},
    },
    model='cnn_mnist 28x28x1, 10 classes',
    batch_size=BATCH,
    optimizer=f'sgd(lr={LR}, momentum={MOMENTUM})',
  )
  log(
    f'client training: backend {backend}, auto -> {meta["auto_strategy"]}, '
    f'load {meta["load_average"]}'
  )
  t0 = time.perf_counter()
  rows, checks, thread_checks = training_rows(sizes, torch, torch_device, backend)
  probe, probe_diff = [], None
  if sizes.probe_clients:
    log(f'  dispatch probe: {sizes.probe_clients} clients x {sizes.probe_steps} steps')
    probe, probe_diff = probe_rows(sizes)
  evaluation = []
  if sizes.eval_models:
    log(f'  evaluation: {sizes.eval_models} models x {sizes.eval_examples} images')
    evaluation = evaluation_rows(sizes)
  per_model = []
  if sizes.models:
    from experiments.bench import model_zoo_training

    log(f'  per model: {", ".join(sizes.models)}')
    per_model = model_zoo_training.model_rows(
      torch, tuple(sizes.models), sizes.model_steps, sizes.model_repeats
    )
  meta['total_seconds'] = time.perf_counter() - t0
  meta['load_average_end'] = load_average()
  fastest = {}
  for m in sizes.clients:
    timed = [
      r
      for r in rows
      if r['clients'] == m and r['form'] in JFED_STRATEGIES and r['ms_per_client_step']
    ]
    if timed:
      fastest[str(m)] = min(timed, key=lambda r: r['ms_per_client_step'])['form']
  summary = {
    'fastest': fastest,
    'loop_vs_legacy_max_abs_diff': {str(m): d for m, d in checks.items()},
    'threaded_vs_plain_loop_max_abs_diff': {str(m): d for m, d in thread_checks.items()},
    'probe_max_abs_diff': probe_diff,
  }
  table = report(meta, rows, probe, evaluation, summary)
  if per_model:
    from experiments.bench import model_zoo_training

    table += '\n\n' + model_zoo_training.report(per_model, meta['torch_threads'])
  return {
    'name': 'client_training',
    'meta': meta,
    'results': rows,
    'probe': probe,
    'evaluation': evaluation,
    'per_model': per_model,
    'summary': summary,
    'headline': headline(meta, rows, probe, summary),
    'table_markdown': table,
  }


def define_flags():
  from absl import flags

  flags.DEFINE_list('clients', ['5', '20', '100'], 'Numbers of clients m to benchmark.')
  flags.DEFINE_integer(
    'steps', None, 'Local steps (batches of 64) per client; default: 4 for m <= 5, else 2.'
  )
  flags.DEFINE_integer('repeats', 1, 'Timed calls per form, interleaved; the median is reported.')
  flags.DEFINE_list('strategies', list(JFED_STRATEGIES), 'jfed strategies to time.')
  flags.DEFINE_bool('legacy_loop', True, 'Also time the loop strategy as before issue 14.')
  flags.DEFINE_integer(
    'torch_threads',
    0,
    'PyTorch intra-op threads (0: one per CPU). With other '
    'jobs on the machine, 1 avoids OpenMP contention that inflates its time.',
  )
  flags.DEFINE_integer('probe_clients', 20, 'Clients of the dispatch probe (0: skip it).')
  flags.DEFINE_integer('eval_models', 10, 'Models of the evaluation table (0: skip it).')
  flags.DEFINE_string('out', None, 'Optional JSON file for the tables and the raw numbers.')
  flags.DEFINE_list(
    'models', [], 'Per-model table: cnn_mnist, vgg9, resnet18, mlp (model_zoo_training.py).'
  )
  flags.DEFINE_integer('model_repeats', 3, 'Interleaved timed calls per side in that table.')
  flags.DEFINE_bool(
    'skip_slow',
    True,
    'On a CPU backend, skip vmap/scan for m >= 100 '
    '(minutes each on XLA:CPU). Use --noskip_slow to measure them.',
  )


def main(argv):
  del argv
  from absl import flags

  f = flags.FLAGS
  sizes = Sizes(
    clients=tuple(int(c) for c in f.clients),
    steps=f.steps,
    strategies=tuple(f.strategies),
    legacy_loop=f.legacy_loop,
    skip_slow=f.skip_slow,
    repeats=f.repeats,
    torch_threads=f.torch_threads,
    probe_clients=f.probe_clients,
    eval_models=f.eval_models,
    models=tuple(f.models),
    model_repeats=f.model_repeats,
  )
  result = run(sizes)
  print(result['table_markdown'])
  if f.out:
    write_json(f.out, result)


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
