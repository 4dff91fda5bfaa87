"""Cross-device scale (issue 83): memory and a round's time against the number of clients.

    python -m experiments.bench.scale --out=runs/bench_scale [--rounds=4] [--cohort=100]

Two tables, each cell a FedAvg run in a fresh process (so its peak memory is its own), with a
workdir (partition.txt, partition.png, checkpoints and metrics are part of the cost):

- **memory**: Fashion-MNIST (the Debian package's IDX files; digits where absent), CNNMnist,
  1 local epoch, batch 32, a cohort of `--cohort` clients a round, at 100, 1,000 and 10,000
  clients, IID (`unbalanced_iid`, equal sizes) and per-client Dirichlet(0.5) / (0.1)
  (`client_dirichlet`). Reported: the raw data (train + test images and labels as the dataset
  holds them, float32), the process's peak resident memory above its baseline after importing
  JAX and jfed (`ru_maxrss`), that less a run's fixed cost (a run of the same cohort on 100
  synthetic clients, less their data) over the raw data, the set-up time (wall time before the
  first round) and the median round time after the first (which compiles).
- **cohort cost**: synthetic 28 × 28 clients of 6 samples each, the same cohort, at 1,000,
  10,000 and 100,000 clients: a round's time should not depend on the federation's size.

Writes OUT/scale.json and OUT/scale.md.
"""

import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_string('out', 'runs/bench_scale', 'Output directory.')
flags.DEFINE_integer('rounds', 4, 'Rounds per run (the first compiles).')
flags.DEFINE_integer('cohort', 100, 'Clients per round.')
flags.DEFINE_list('clients', ['100', '1000', '10000'], 'Federation sizes of the memory table.')
flags.DEFINE_list('synthetic', ['1000', '10000', '100000'], 'Sizes of the cohort-cost table.')
flags.DEFINE_list(
  'partitions', ['iid', 'dir0.5', 'dir0.1'], 'Partitions of the memory table (iid, dirALPHA).'
)
flags.DEFINE_string('child', '', 'Internal: run one cell (JSON) and print its result.')
FLAGS = flags.FLAGS

SAMPLES_PER_SYNTHETIC_CLIENT = 6


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_cell(cell: dict) -> dict:
  """One FedAvg run in this process; its memory and times."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import jfed  # pylint: disable=g-import-not-at-top
  from jfed.data import available_datasets, load_dataset  # pylint: disable=g-import-not-at-top
  from jfed.methods import fedavg  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import

  jax.numpy.zeros(1).block_until_ready()
  baseline = _rss_mb()
  config = jfed.config('digits')
  config.model = 'cnn_mnist'
  config.batch_size = 32
  config.dataset.holdout_size = 0
  config.partition.num_clients = cell['clients']
  config.fedavg.rounds = cell['rounds']
  config.fedavg.local_epochs = 1
  config.fedavg.participation = min(1.0, cell['cohort'] / cell['clients'])
  dataset = None
  if cell['data'] == 'synthetic':
    n = cell['clients'] * SAMPLES_PER_SYNTHETIC_CLIENT
    rng = np.random.default_rng(0)
    x, y = rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n)
    dataset = (x, y, x[:1000], y[:1000])
    config.partition.scheme = 'iid'
  else:
    name = 'fashion_mnist' if 'fashion_mnist' in available_datasets() else 'digits'
    try:
      load_dataset(name)
    except Exception:  # pylint: disable=broad-except  # the Debian package is absent
      name = 'digits'
    config.dataset.name = name
    if cell['partition'] == 'iid':
      config.partition.scheme = 'unbalanced_iid'
      config.partition.size_distribution = 'equal'
    else:
      config.partition.scheme = 'client_dirichlet'
      config.partition.alpha = float(cell['partition'][3:])
      config.partition.size_distribution = 'equal'
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    if dataset is None:
      result = jfed.run('fedavg', config, workdir=workdir + '/run')
    else:
      result = jfed.run('fedavg', config, dataset)
  wall = time.perf_counter() - start
  rounds = [r['seconds'] for r in result.history]
  if dataset is None:
    d = load_dataset(config.dataset.name)
    raw = d.train_x.nbytes + d.train_y.nbytes + d.test_x.nbytes + d.test_y.nbytes
  else:
    raw = sum(a.nbytes for a in dataset)
  peak = _rss_mb()
  return {
    **cell,
    'dataset': config.dataset.name if dataset is None else 'synthetic',
    'backend': jax.default_backend(),
    'raw_mb': raw / 2**20,
    'baseline_mb': baseline,
    'peak_mb': peak,
    'above_baseline_mb': peak - baseline,
    'ratio': (peak - baseline) / (raw / 2**20),
    'setup_s': wall - sum(rounds),
    'first_round_s': rounds[0],
    'round_s': float(np.median(rounds[1:])) if len(rounds) > 1 else rounds[0],
    'accuracy': result.summary['final_test_accuracy'],
  }


def _child(cell: dict) -> dict:
  proc = subprocess.run(
    [sys.executable, '-m', 'experiments.bench.scale', f'--child={json.dumps(cell)}'],
    capture_output=True,
    text=True,
    check=False,
  )
  lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
  if proc.returncode or not lines:
    return {**cell, 'error': (proc.stderr.strip().splitlines() or ['?'])[-1]}
  return json.loads(lines[-1])


def _with_data_ratio(row: dict, fixed_mb: float) -> dict:
  """`data_ratio`: the peak above the baseline less the fixed cost, over the raw data."""
  if 'error' in row:
    return row
  return {**row, 'data_ratio': (row['above_baseline_mb'] - fixed_mb) / row['raw_mb']}


def _table(rows, columns) -> str:
  head = '| ' + ' | '.join(c for c, _ in columns) + ' |'
  rule = '|' + '---|' * len(columns)
  body = []
  for r in rows:
    if 'error' in r:
      body.append(f'| {r["clients"]} | {r.get("partition", "")} | error: {r["error"]} |')
      continue
    body.append('| ' + ' | '.join(fmt(r) for _, fmt in columns) + ' |')
  return '\n'.join([head, rule, *body])


def main(argv):
  del argv
  if FLAGS.child:
    print(json.dumps(run_cell(json.loads(FLAGS.child))), flush=True)
    return
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  base = {'rounds': FLAGS.rounds, 'cohort': FLAGS.cohort}
  # What a run costs whatever its data (compiled programs, XLA's compiler, matplotlib): a run
  # of the same cohort on 100 synthetic clients (3.6 MB), its data subtracted.
  reference = _child({**base, 'data': 'synthetic', 'clients': 100, 'partition': 'iid'})
  fixed_mb = reference['above_baseline_mb'] - reference['raw_mb']
  results = {'fixed_cost': reference, 'memory': [], 'cohort_cost': []}
  for clients in map(int, FLAGS.clients):
    for partition in FLAGS.partitions:
      cell = {**base, 'data': 'real', 'clients': clients, 'partition': partition}
      results['memory'].append(_with_data_ratio(_child(cell), fixed_mb))
      print(json.dumps(results['memory'][-1]), flush=True)
  for clients in map(int, FLAGS.synthetic):
    cell = {**base, 'data': 'synthetic', 'clients': clients, 'partition': 'iid'}
    results['cohort_cost'].append(_child(cell))
    print(json.dumps(results['cohort_cost'][-1]), flush=True)
  (out / 'scale.json').write_text(json.dumps(results, indent=1) + '\n')
  done = [r for r in results['memory'] + results['cohort_cost'] if 'error' not in r]
  backend = done[0]['backend'] if done else '?'
  memory = _table(
    results['memory'],
    [
      ('clients', lambda r: f'{r["clients"]:,}'),
      ('partition', lambda r: r['partition']),
      ('raw data (MB)', lambda r: f'{r["raw_mb"]:.0f}'),
      ('peak above baseline (MB)', lambda r: f'{r["above_baseline_mb"]:.0f}'),
      ('less the fixed cost, over the data', lambda r: f'{r["data_ratio"]:.2f}'),
      ('set-up (s)', lambda r: f'{r["setup_s"]:.1f}'),
      ('round (s)', lambda r: f'{r["round_s"]:.2f}'),
    ],
  )
  cohort = _table(
    results['cohort_cost'],
    [
      ('clients', lambda r: f'{r["clients"]:,}'),
      ('samples', lambda r: f'{r["clients"] * SAMPLES_PER_SYNTHETIC_CLIENT:,}'),
      ('set-up (s)', lambda r: f'{r["setup_s"]:.1f}'),
      ('first round (s)', lambda r: f'{r["first_round_s"]:.2f}'),
      ('round (s)', lambda r: f'{r["round_s"]:.2f}'),
      ('peak above baseline (MB)', lambda r: f'{r["above_baseline_mb"]:.0f}'),
    ],
  )
  (out / 'scale.md').write_text(
    f'# Scale: FedAvg, a cohort of {FLAGS.cohort}, {FLAGS.rounds} rounds (backend {backend})\n\n'
    f'Command: `python -m experiments.bench.scale --out={FLAGS.out}`; one process per row; '
    'round = median after the first. Peak = the resident memory (`ru_maxrss`) above the '
    "process's own after importing JAX and jfed. Fixed cost of a run whatever its data "
    f'(compiled programs, the compiler, plotting): {fixed_mb:.0f} MB, measured as a run of the '
    'same cohort on 100 synthetic clients less their data.\n\n## Memory\n\n'
    + memory
    + '\n\n## A round against the federation size (synthetic, '
    f'{SAMPLES_PER_SYNTHETIC_CLIENT} samples per client)\n\n' + cohort + '\n'
  )
  print(f'wrote {out / "scale.md"}')


if __name__ == '__main__':
  app.run(main)
