"""Cross-device FedAvg, side by side (issue 83): jfed vs DrJAX vs Flower's simulation engine.

    python -m experiments.bench.cross_device --out=runs/bench_cross_device \
        [--clients=1000,10000] [--cohort=100] [--rounds=5] [--systems=jfed,drjax,flower]

One FedAvg setting for every system: Fashion-MNIST (the Debian package's IDX files; synthetic
28 x 28 x 1 data of as many samples where absent, or with `--synthetic`), N clients of equal
sizes (IID), a cohort of `--cohort` clients drawn uniformly without replacement each round,
DENSE's CNNMnist (jfed's `cnn_mnist`, 29,034 parameters), one local epoch of SGD (jfed's
default optimizer: lr 0.01, momentum 0.9, fresh each round) in batches of 32 (the last one
partial), plain cross entropy, a size-weighted average of the parameters and the BatchNorm
statistics, and each round ending with the global model's accuracy on the first `--eval_size`
test images (jfed's rounds end with an evaluation; the others do the same so that a round is the
same work everywhere).

- **jfed**: `jfed.run('fedavg', config, arrays)`, partitioned by jfed (`unbalanced_iid`,
  equal sizes: the same sizes as the others, not the same index lists); a round's time is its
  record's `seconds`.
- **DrJAX** (`drjax.map_fn` / `reduce_weighted_mean` in one jitted `drjax.program` per round):
  the same flax module from jfed; a client's training is a `lax.scan` of SGD steps over its
  batches, mapped over the cohort's stacked data [cohort, steps, batch, 28, 28, 1] (gathered on
  the host each round, inside the round's time).
- **Flower**: `experiments/bench/flower_sim_side.py` in its own virtual environment
  (`--flower_python`; flwr[simulation] with Ray, PyTorch clients of the same layers), which this
  harness runs and whose JSON line it reads.

Each system runs in its own process. Reported per system and N: the first round (compilation,
Ray's actors starting), the median of the later rounds, the peak memory of the process tree
(the sum of its processes' proportional set sizes, PSS, sampled every second: Ray's raylet,
GCS and actors are children of the Flower process; PSS shares the memory-mapped data and shared
libraries among them instead of counting them once per process; its shared-memory part, Ray's
object store in /dev/shm, is reported too) and the process's own peak resident memory, the
backend, and the 1-minute load average when it started. Writes OUT/cross_device.json and
OUT/cross_device.md with the ratios jfed / DrJAX and Flower / jfed of the median round.
"""

import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import app, flags
import numpy as np

FLOWER_PYTHON = '/work/scratch/flsimvenv/bin/python'  # the venv with flwr[simulation], torch


def _define_flags() -> None:
  """The command's flags, defined only when it runs (tests import this module, and absl
  refuses a flag defined twice in one process)."""
  flags.DEFINE_string('out', 'runs/bench_cross_device', 'Output directory.')
  flags.DEFINE_list('clients', ['1000', '10000'], 'Federation sizes N.')
  flags.DEFINE_integer('cohort', 100, 'Clients per round.')
  flags.DEFINE_integer('rounds', 5, 'Rounds per run (the first compiles or warms up).')
  flags.DEFINE_list('systems', ['jfed', 'drjax', 'flower'], 'Systems to run, in this order.')
  flags.DEFINE_integer('eval_size', 1000, 'Test images the global model is scored on each round.')
  flags.DEFINE_integer('seed', 0, 'Seed of the partition and the cohorts.')
  flags.DEFINE_bool('synthetic', False, 'Synthetic data even where Fashion-MNIST is installed.')
  flags.DEFINE_integer('samples', 60000, 'Training samples of the synthetic data.')
  flags.DEFINE_string(
    'flower_python',
    FLOWER_PYTHON,
    "Python of the virtual environment with flwr[simulation] and torch (Flower's side).",
  )
  flags.DEFINE_integer('flower_cpus', os.cpu_count() or 1, 'CPUs given to Ray (one actor each).')
  flags.DEFINE_integer('timeout', 3600, 'Seconds one system may run at one N.')
  flags.DEFINE_string('child', '', 'Internal: run one system (JSON spec) and print its result.')


FLAGS = flags.FLAGS

BATCH = 32
LOCAL_EPOCHS = 1
FLOWER_SIDE = pathlib.Path(__file__).with_name('flower_sim_side.py')
REPO = pathlib.Path(__file__).resolve().parents[2]


def optimizer_settings() -> Tuple[float, float]:
  """(lr, momentum) of jfed's default `optimizer` section, used by every system."""
  from jfed.configs.base import base_config  # pylint: disable=g-import-not-at-top

  opt = base_config().optimizer
  assert opt.name == 'sgd' and opt.schedule == 'constant' and not opt.weight_decay, opt
  return float(opt.lr), float(opt.momentum)


# ------------------------------------------------------------------------------------------
# Data: written once per N as .npy files that every system's process reads
# ------------------------------------------------------------------------------------------
def prepare_data(
  directory: str,
  clients: int,
  seed: int = 0,
  eval_size: int = 1000,
  synthetic: bool = False,
  samples: int = 60000,
) -> Dict[str, Any]:
  """Writes train/eval arrays and N equal-size IID index lists into `directory`.

  Args:
    directory: where train_x, train_y, eval_x, eval_y, parts_flat and parts_offsets (.npy) go.
    clients: N.
    seed: seed of the permutation the index lists are cut from.
    eval_size: test images kept for the per-round evaluation.
    synthetic: uniform random images and labels instead of Fashion-MNIST.
    samples: training samples of synthetic data (Fashion-MNIST has 60,000).

  Returns:
    {'dataset': name, 'train': samples, 'eval': eval samples}.
  """
  name = 'synthetic'
  if not synthetic:
    try:
      from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top

      d = load_dataset('fashion_mnist')
      train_x, train_y, test_x, test_y = d.train_x, d.train_y, d.test_x, d.test_y
      name = 'fashion_mnist'
    except Exception:  # pylint: disable=broad-except  # the Debian package is absent
      synthetic = True
  if synthetic:
    rng = np.random.default_rng(seed + 1)
    train_x = rng.random((samples, 28, 28, 1), dtype=np.float32)
    train_y = rng.integers(0, 10, samples).astype(np.int32)
    test_x = rng.random((eval_size, 28, 28, 1), dtype=np.float32)
    test_y = rng.integers(0, 10, eval_size).astype(np.int32)
  parts = np.array_split(np.random.default_rng(seed).permutation(len(train_x)), clients)
  arrays = {
    'train_x': np.asarray(train_x, np.float32),
    'train_y': np.asarray(train_y, np.int32),
    'eval_x': np.asarray(test_x[:eval_size], np.float32),
    'eval_y': np.asarray(test_y[:eval_size], np.int32),
    'parts_flat': np.concatenate(parts).astype(np.int64),
    'parts_offsets': np.cumsum([0] + [len(p) for p in parts]).astype(np.int64),
  }
  os.makedirs(directory, exist_ok=True)
  for key, value in arrays.items():
    np.save(os.path.join(directory, f'{key}.npy'), value)
  return {'dataset': name, 'train': len(train_x), 'eval': len(arrays['eval_x'])}


def load_data(directory: str) -> Dict[str, np.ndarray]:
  names = ('train_x', 'train_y', 'eval_x', 'eval_y', 'parts_flat', 'parts_offsets')
  return {n: np.load(os.path.join(directory, f'{n}.npy')) for n in names}


def client_parts(data: Dict[str, np.ndarray]) -> List[np.ndarray]:
  return np.split(data['parts_flat'], data['parts_offsets'][1:-1])


def _summary(seconds: Sequence[float]) -> Dict[str, float]:
  seconds = [float(s) for s in seconds]
  later = seconds[1:] or seconds
  return {
    'round_seconds': seconds,
    'first_round_s': seconds[0],
    'median_round_s': float(statistics.median(later)),
  }


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ------------------------------------------------------------------------------------------
# jfed
# ------------------------------------------------------------------------------------------
def run_jfed(spec: Dict[str, Any]) -> Dict[str, Any]:
  """FedAvg with `jfed.run` on spec['data']'s arrays; jfed partitions and samples itself."""
  import jax  # pylint: disable=g-import-not-at-top

  import jfed  # pylint: disable=g-import-not-at-top

  data = load_data(spec['data'])
  lr, momentum = optimizer_settings()
  config = jfed.config('digits')
  config.model = 'cnn_mnist'
  config.seed = spec['seed']
  config.batch_size = BATCH
  config.optimizer.lr, config.optimizer.momentum = lr, momentum
  config.dataset.holdout_size = 0
  config.partition.scheme = 'unbalanced_iid'
  config.partition.size_distribution = 'equal'
  config.partition.num_clients = spec['clients']
  config.fedavg.rounds = spec['rounds']
  config.fedavg.local_epochs = LOCAL_EPOCHS
  config.fedavg.participation = spec['cohort'] / spec['clients']
  config.fedavg.sampler = 'uniform'
  arrays = (data['train_x'], data['train_y'], data['eval_x'], data['eval_y'])
  start = time.perf_counter()
  result = jfed.run('fedavg', config, arrays)
  wall = time.perf_counter() - start
  rounds = [r for r in result.history if 'round' in r]
  seconds = [r['seconds'] for r in rounds]
  return {
    **_summary(seconds),
    'setup_s': wall - sum(seconds),
    'wall_s': wall,
    'cohort_sizes': sorted({int(r['clients']) for r in rounds}),
    'accuracy': float(rounds[-1]['test_accuracy']),
    'backend': jax.default_backend(),
    'device': jax.devices()[0].device_kind,
    'versions': {'jax': jax.__version__, 'jfed': getattr(jfed, '__version__', '?')},
    'own_maxrss_mb': _rss_mb(),
  }


# ------------------------------------------------------------------------------------------
# DrJAX
# ------------------------------------------------------------------------------------------
def cohort_batches(
  parts: Sequence[np.ndarray], selected: Sequence[int], batch: int, rng: np.random.Generator
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A cohort's epoch: [C, steps, b] sample indices, [C, steps, b] mask, [C] sizes.

  b = min(batch, the largest client): clients smaller than a batch train on one batch of their
  own size, as a PyTorch DataLoader gives them, not on a batch padded to `batch`. Each client's
  samples are shuffled; the last batch is partial (masked), a shorter client's extra steps are
  wholly masked (and skipped by the step).
  """
  sizes = np.array([len(parts[k]) for k in selected])
  b = int(min(batch, sizes.max()))
  steps = math.ceil(sizes.max() / b)
  idx = np.zeros((len(selected), steps * b), np.int64)
  mask = np.zeros((len(selected), steps * b), bool)
  for j, k in enumerate(selected):
    idx[j, : sizes[j]] = rng.permutation(parts[k])
    mask[j, : sizes[j]] = True
  shape = (len(selected), steps, b)
  return idx.reshape(shape), mask.reshape(shape), sizes.astype(np.float32)


def make_drjax_round(module, cohort: int, lr: float, momentum: float):
  """One jitted DrJAX program: FedAvg's round for a cohort of `cohort` clients.

  Args:
    module: the flax classifier (called with `train` and `mask`, BatchNorm statistics in
      'batch_stats').
    cohort: the placement's size.
    lr: SGD learning rate.
    momentum: SGD momentum (a fresh optimizer state per client and round).

  Returns:
    round(params, batch_stats, xs, ys, masks, weights) -> (params, batch_stats): the
    weighted mean over the cohort of each client's model after its scan of steps, where xs is
    [cohort, steps, b, ...], ys and masks [cohort, steps, b] and weights [cohort].
  """
  import drjax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  tx = optax.sgd(lr, momentum=momentum)

  def loss_fn(params, stats, x, y, m):
    logits, new = module.apply(
      {'params': params, 'batch_stats': stats}, x, train=True, mask=m, mutable=['batch_stats']
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(jnp.where(m, ce, 0.0)) / jnp.maximum(m.sum(), 1), new['batch_stats']

  def local_train(params, stats, xs, ys, ms):
    def step(carry, batch):
      x, y, m = batch
      p, s, o = carry
      (_, s2), g = jax.value_and_grad(loss_fn, has_aux=True)(p, s, x, y, m)
      updates, o2 = tx.update(g, o, p)
      new = (optax.apply_updates(p, updates), s2, o2)
      # A step with no real sample (a shorter client's padding) changes nothing, momentum
      # included, so every client trains as it would alone.
      return jax.tree.map(lambda a, b: jnp.where(m.any(), a, b), new, carry), None

    (p, s, _), _ = lax.scan(step, (params, stats, tx.init(params)), (xs, ys, ms))
    return p, s

  @drjax.program(placements={'clients': cohort})
  def fedavg_round(params, stats, xs, ys, ms, weights):
    trained_params, trained_stats = drjax.map_fn(
      local_train, (drjax.broadcast(params), drjax.broadcast(stats), xs, ys, ms)
    )
    # reduce_weighted_mean multiplies leaf by leaf: the weights as a tree like the values.
    mean = lambda tree: drjax.reduce_weighted_mean(tree, jax.tree.map(lambda _: weights, tree))
    return mean(trained_params), mean(trained_stats)

  return jax.jit(fedavg_round)


def run_drjax(spec: Dict[str, Any]) -> Dict[str, Any]:
  """FedAvg as a DrJAX program on spec['data']'s index lists, cohorts from a seeded rng."""
  import drjax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jfed.models import get_model  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  data = load_data(spec['data'])
  parts = client_parts(data)
  lr, momentum = optimizer_settings()
  module = get_model('cnn_mnist', 10, (28, 28, 1))
  variables = module.init(jax.random.key(spec['seed']), jnp.zeros((1, 28, 28, 1)), train=False)
  params, stats = variables['params'], variables['batch_stats']
  fedavg_round = make_drjax_round(module, spec['cohort'], lr, momentum)
  predict = jax.jit(
    lambda p, s, x: module.apply({'params': p, 'batch_stats': s}, x, train=False).argmax(-1)
  )
  rng = np.random.default_rng(spec['seed'])
  eval_x, eval_y = data['eval_x'], data['eval_y']
  seconds, accuracy = [], 0.0
  setup = time.perf_counter() - start
  for _ in range(spec['rounds']):
    t = time.perf_counter()
    selected = rng.choice(len(parts), spec['cohort'], replace=False)
    idx, mask, sizes = cohort_batches(parts, selected, BATCH, rng)
    params, stats = fedavg_round(
      params, stats, data['train_x'][idx], data['train_y'][idx], mask, sizes
    )
    correct = sum(
      int((np.asarray(predict(params, stats, eval_x[s : s + 1000])) == eval_y[s : s + 1000]).sum())
      for s in range(0, len(eval_x), 1000)
    )
    accuracy = correct / len(eval_x)
    seconds.append(time.perf_counter() - t)
  return {
    **_summary(seconds),
    'setup_s': setup,
    'wall_s': time.perf_counter() - start,
    'accuracy': accuracy,
    'backend': jax.default_backend(),
    'device': jax.devices()[0].device_kind,
    'versions': {'jax': jax.__version__, 'drjax': drjax.__version__},
    'own_maxrss_mb': _rss_mb(),
  }


# ------------------------------------------------------------------------------------------
# Flower (its own virtual environment)
# ------------------------------------------------------------------------------------------
def flower_command(spec: Dict[str, Any]) -> List[str]:
  lr, momentum = spec['lr'], spec['momentum']
  return [
    spec['flower_python'],
    str(FLOWER_SIDE),
    f'--data={spec["data"]}',
    f'--clients={spec["clients"]}',
    f'--cohort={spec["cohort"]}',
    f'--rounds={spec["rounds"]}',
    f'--batch={BATCH}',
    f'--lr={lr}',
    f'--momentum={momentum}',
    f'--cpus={spec["flower_cpus"]}',
    f'--seed={spec["seed"]}',
  ]


def flower_result(stdout: str) -> Dict[str, Any]:
  lines = [l for l in stdout.splitlines() if l.startswith('{')]
  raw = json.loads(lines[-1])
  return {
    **_summary(raw['round_seconds']),
    'setup_s': raw['setup_s'],
    'wall_s': raw['wall_s'],
    'accuracy': raw['accuracy'],
    'num_params': raw['num_params'],
    'pickled_client_app_bytes': raw['pickled_client_app_bytes'],
    'backend': 'cpu',
    'device': f'PyTorch CPU, Ray: {raw["actors"]} actors of 1 CPU, 1 thread each',
    'versions': raw['versions'],
    'own_maxrss_mb': raw['own_maxrss_mb'],
  }


# ------------------------------------------------------------------------------------------
# Processes and their memory
# ------------------------------------------------------------------------------------------
def _children_map() -> Dict[int, List[int]]:
  children: Dict[int, List[int]] = {}
  for entry in os.listdir('/proc'):
    if not entry.isdigit():
      continue
    try:
      with open(f'/proc/{entry}/stat') as f:
        # the command name may hold spaces and parentheses: the fields follow the last ')'
        ppid = int(f.read().rsplit(')', 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  return children


def _pss_mb(pid: int) -> Tuple[float, float]:
  """(PSS, its shared-memory part Pss_Shmem) of a process in MB; zeros once it has gone."""
  pss = shmem = 0.0
  try:
    with open(f'/proc/{pid}/smaps_rollup') as f:
      for line in f:
        if line.startswith('Pss:'):
          pss = int(line.split()[1]) / 1024
        elif line.startswith('Pss_Shmem:'):
          shmem = int(line.split()[1]) / 1024
  except OSError:
    pass
  return pss, shmem


class TreeMemory:
  """Samples the summed PSS of a process and its descendants in a thread; keeps the peak.

  A process once seen in the tree stays counted while it lives, even if reparented (Ray's
  workers outlive their raylet at shutdown). Once a second: reading the PSS of Ray's processes,
  which map gigabytes, took a quarter of a core at five samples a second on the 2-core machine.
  """

  def __init__(self, pid: int, interval: float = 1.0):
    self.pid, self.interval = pid, interval
    self.peak_mb, self.peak_processes = 0.0, 0
    self.peak_shmem_mb = 0.0  # the shared-memory part of the peak (Ray's object store)
    self._seen = {pid}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      children = _children_map()
      todo = list(self._seen)
      while todo:
        for c in children.get(todo.pop(), []):
          if c not in self._seen:
            self._seen.add(c)
            todo.append(c)
      alive = [p for p in self._seen if os.path.exists(f'/proc/{p}')]
      sizes = [_pss_mb(p) for p in alive]
      total = sum(pss for pss, _ in sizes)
      if total > self.peak_mb:
        self.peak_mb, self.peak_processes = total, len(alive)
        self.peak_shmem_mb = sum(shmem for _, shmem in sizes)
      self._stop.wait(self.interval)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()


def run_system(system: str, spec: Dict[str, Any], timeout: int) -> Dict[str, Any]:
  """One system at one N in its own process; its result with the tree's peak memory."""
  if system == 'flower':
    if not os.path.exists(spec['flower_python']):
      return {'system': system, 'error': f'no {spec["flower_python"]} (see the docstring)'}
    command = flower_command(spec)
  else:
    child = json.dumps({**spec, 'system': system})
    command = [sys.executable, '-m', 'experiments.bench.cross_device', f'--child={child}']
  load = os.getloadavg()[0]
  start = time.perf_counter()
  proc = subprocess.Popen(
    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
  )
  memory = TreeMemory(proc.pid)
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    stdout, stderr = proc.communicate()
    stderr += f'\ntimed out after {timeout} s'
  memory.stop()
  row = {
    'system': system,
    'clients': spec['clients'],
    'cohort': spec['cohort'],
    'rounds': spec['rounds'],
    'load_start': load,
    'load_end': os.getloadavg()[0],
    'process_s': time.perf_counter() - start,
    'peak_tree_mb': memory.peak_mb,
    'peak_tree_processes': memory.peak_processes,
    'peak_tree_shmem_mb': memory.peak_shmem_mb,
  }
  try:
    if proc.returncode:
      raise RuntimeError(f'exit status {proc.returncode}')
    result = flower_result(stdout) if system == 'flower' else json.loads(stdout.splitlines()[-1])
  except Exception as e:  # pylint: disable=broad-except  # reported in the table
    tail = [l for l in stderr.strip().splitlines() if l.strip()][-3:]
    return {**row, 'error': f'{e}: ' + ' / '.join(tail)}
  return {**row, **result}


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------
NAMES = {'jfed': 'jfed', 'drjax': 'DrJAX', 'flower': 'Flower (Ray, PyTorch)'}


def _median(rows, system, clients) -> Optional[float]:
  for r in rows:
    if r['system'] == system and r['clients'] == clients and 'error' not in r:
      return r['median_round_s']
  return None


def report(results: Dict[str, Any]) -> str:
  """The Markdown report of `results` (what `main` writes as cross_device.json)."""
  meta, rows = results['meta'], results['rows']
  lines = [
    f'# Cross-device FedAvg: jfed vs DrJAX vs Flower ({meta["date"]})',
    '',
    f'Command: `{meta["command"]}`. Data: {meta["dataset"]}, IID, equal client sizes; cohort '
    f'{meta["cohort"]}, {meta["rounds"]} rounds, CNNMnist, 1 local epoch, batch {BATCH}, SGD lr '
    f'{meta["lr"]} momentum {meta["momentum"]}; each round ends with the global model evaluated '
    f'on {meta["eval_size"]} test images. Machine: {meta["cpus"]} CPUs, load average '
    f'{meta["load_start"]:.2f} at the start. Round = median of rounds 2..{meta["rounds"]}; '
    'memory = peak summed PSS of the process tree (own peak RSS in parentheses), and the '
    "shared memory in it (Ray's object store). jfed at "
    f'commit {meta.get("commit", "?")}'
    + (
      f' with uncommitted changes to {", ".join(meta["jfed_uncommitted"])}'
      if meta.get('jfed_uncommitted')
      else ''
    )
    + '.',
    '',
    '| clients | system | backend | first round (s) | round (s) | peak memory (MB) '
    '| of which shared (MB) | accuracy | load avg at start |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    head = f'| {r["clients"]:,} | {NAMES[r["system"]]} |'
    if 'error' in r:
      lines.append(f'{head} error: {r["error"]} | | | | | | {r.get("load_start", 0):.2f} |')
      continue
    lines.append(
      f'{head} {r["backend"]} | {r["first_round_s"]:.2f} | {r["median_round_s"]:.3f} | '
      f'{r["peak_tree_mb"]:.0f} ({r["own_maxrss_mb"]:.0f}) | '
      f'{r.get("peak_tree_shmem_mb", float("nan")):.0f} | {r["accuracy"]:.3f} | '
      f'{r["load_start"]:.2f} |'
    )
  lines += [
    '',
    '| clients | jfed / DrJAX (round) | Flower / jfed (round) |',
    '|---|---|---|',
  ]
  for n in sorted({r['clients'] for r in rows}):
    jf, dj, fl = (_median(rows, s, n) for s in ('jfed', 'drjax', 'flower'))
    ratio = lambda a, b: f'{a / b:.2f}' if a and b else 'n/a'
    lines.append(f'| {n:,} | {ratio(jf, dj)} | {ratio(fl, jf)} |')
  devices = sorted({f'{NAMES[r["system"]]}: {r["device"]}' for r in rows if 'device' in r})
  versions = {}
  for r in rows:
    versions.update(r.get('versions', {}))
  lines += [
    '',
    'Devices: ' + '; '.join(devices) + '.',
    'Versions: ' + ', '.join(f'{k} {v}' for k, v in sorted(versions.items())) + '.',
    '',
  ]
  return '\n'.join(lines)


def _git_state() -> Dict[str, Any]:
  """The commit measured, and jfed's files that differed from it (others' edits in progress)."""

  def git(*args):
    proc = subprocess.run(['git', *args], capture_output=True, text=True, check=False)
    return proc.stdout.rstrip() if proc.returncode == 0 else ''

  changed = [l[3:] for l in git('status', '--porcelain', '--', 'jfed').splitlines()]
  return {'commit': git('rev-parse', '--short', 'HEAD') or '?', 'jfed_uncommitted': changed}


def main(argv):
  del argv
  if FLAGS.child:
    spec = json.loads(FLAGS.child)
    run = {'jfed': run_jfed, 'drjax': run_drjax}[spec['system']]
    print(json.dumps(run(spec)), flush=True)
    return
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  lr, momentum = optimizer_settings()
  meta = {
    'date': time.strftime('%Y-%m-%d'),
    'command': ' '.join(['python -m experiments.bench.cross_device', *sys.argv[1:]]),
    'cohort': FLAGS.cohort,
    'rounds': FLAGS.rounds,
    'eval_size': FLAGS.eval_size,
    'lr': lr,
    'momentum': momentum,
    'cpus': os.cpu_count(),
    'load_start': os.getloadavg()[0],
    **_git_state(),
  }
  results = {'meta': meta, 'rows': []}
  for clients in map(int, FLAGS.clients):
    with tempfile.TemporaryDirectory() as directory:
      data = prepare_data(
        directory, clients, FLAGS.seed, FLAGS.eval_size, FLAGS.synthetic, FLAGS.samples
      )
      meta['dataset'] = data['dataset']
      spec = {
        'data': directory,
        'clients': clients,
        'cohort': FLAGS.cohort,
        'rounds': FLAGS.rounds,
        'seed': FLAGS.seed,
        'lr': lr,
        'momentum': momentum,
        'flower_python': FLAGS.flower_python,
        'flower_cpus': FLAGS.flower_cpus,
      }
      for system in FLAGS.systems:
        results['rows'].append(run_system(system, spec, FLAGS.timeout))
        print(json.dumps(results['rows'][-1]), flush=True)
        (out / 'cross_device.json').write_text(json.dumps(results, indent=1) + '\n')
        (out / 'cross_device.md').write_text(report(results))
  print(f'wrote {out / "cross_device.md"}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
