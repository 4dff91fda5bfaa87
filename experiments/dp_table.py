"""The privacy–accuracy table of DP-FedAvg (issue 37): test accuracy against ε, over seeds.

    nice python -m experiments.dp_table --dataset=digits --out=runs/dp_digits \
        [--seeds=0,1,2] [--rows=no_dp,z0.5,z1,z2,z4,z8,adaptive_z2] \
        [--doc=docs/results/dp_digits.md]

Every (row, seed) is one FedAvg run through `jfed.driver.run_experiment` into
OUT/<row>/seed<s>/ (rerunning resumes and skips finished runs). A row is a `dp` setting
(`ROWS`): no DP, server-side DP-FedAvg at a fixed clip norm C and noise multiplier z, and adaptive
clipping (Andrew et al. 2021) at the same z. Writes OUT/results.json, OUT/dp_<dataset>.md (per
row: z, C, q, the final ε at δ = 1e-5 from dp-accounting's RDP and PLD accountants, final and
best test accuracy mean ± std over the seeds, seconds per run) and OUT/dp_<dataset>.png (final
accuracy against ε); `--doc` copies the table there and the plot beside it.

The setups (`setup`): DP-FedAvg needs many clients per round (the noise on the mean update has
std z·C/m per coordinate against updates of norm <= C), so both datasets are split IID over many
clients and half of them take part in each round (q = 0.5), with a narrow MLP (hidden width 50:
6,310 parameters on digits, 42,310 on Fashion-MNIST):
  digits         100 clients (~13 images each), 30 rounds x 5 local epochs, SGD lr 0.1
                 momentum 0.9, batch 32, C = 0.5 (about the median update norm of the first
                 rounds, measured: 0.25-0.65).
  fashion_mnist  600 clients (100 images each; the Debian package's files), 20 rounds x 2 local
                 epochs, SGD lr 0.05 momentum 0.9, batch 32, C = 0.5 (median update norm 0.5-0.9
                 in rounds 1-4).
  smoke          2 rounds and 10 clients of digits (tests).
"""

import pathlib
import shutil
import time
from typing import Dict, Sequence

from absl import flags, logging

from experiments import sweep
from experiments.seed_tables import (
  backend_line,
  mean_std,
  percent_stats_each,
  seed_errors,
  seed_values,
)
from jfed.figures import save_png

FLAGS = flags.FLAGS

DATASETS = ('digits', 'fashion_mnist')
DELTA = 1e-5
# Each row's `dp` section overrides (the rest: the setup's clip norm, δ = 1e-5).
ROWS: Dict[str, Dict[str, object]] = {
  'no_dp': {'enabled': False},
  'z0.5': {'enabled': True, 'noise_multiplier': 0.5},
  'z1': {'enabled': True, 'noise_multiplier': 1.0},
  'z2': {'enabled': True, 'noise_multiplier': 2.0},
  'z4': {'enabled': True, 'noise_multiplier': 4.0},
  'z8': {'enabled': True, 'noise_multiplier': 8.0},
  'adaptive_z2': {'enabled': True, 'noise_multiplier': 2.0, 'adaptive': True},
}
CELL = 'dp'  # results.json's one cell: results['dp'][seed][row]
SUMMARY_KEYS = ('final_test_accuracy', 'best_test_accuracy', 'seconds')


def define_flags() -> None:
  """Defined only when run as a command (importing the module in tests defines no flags)."""
  flags.DEFINE_enum('dataset', 'digits', DATASETS, 'The setup (see the module docstring).')
  # --out (default runs/dp_<dataset>), --seeds, --smoke
  sweep.define_flags(None, merge=False, smoke='2 rounds of 10 digits clients (tests).')
  flags.DEFINE_list('rows', list(ROWS), f'Rows: {", ".join(ROWS)}.')
  flags.DEFINE_string('doc', '', 'Also write the table here (and its plot beside it).')


def setup(dataset: str, smoke: bool = False):
  """The base config of a dataset's table (DP off; each row sets `dp`)."""
  from jfed.configs.base import base_config  # pylint: disable=g-import-not-at-top

  c = base_config()
  c.dataset.name = dataset
  c.model = 'mlp:width_mult=0.25'
  c.partition.scheme = 'iid'
  c.batch_size = 32
  c.fedavg.participation = 0.5
  c.dp.clip_norm = 0.5
  c.dp.delta = DELTA
  if dataset == 'digits':
    c.partition.num_clients = 100
    c.optimizer.lr = 0.1
    c.fedavg.rounds, c.fedavg.local_epochs = 30, 5
  else:
    c.partition.num_clients = 600
    c.optimizer.lr = 0.05
    c.fedavg.rounds, c.fedavg.local_epochs = 20, 2
  if smoke:
    c.partition.num_clients = 10
    c.fedavg.rounds, c.fedavg.local_epochs = 2, 1
    c.dp.count_noise_fraction = 1.0  # adaptive clipping at z = 2 needs σ_b > 1 of 5 clients
  return c


def row_config(dataset: str, row: str, seed: int, smoke: bool = False):
  c = setup(dataset, smoke)
  c.seed = seed
  c.dp.update(ROWS[row])
  # a simulated table: the noise from the seed, so a rerun gives the same table
  c.dp.reproducible_noise = True
  return c


def _epsilon_text(results: dict, row: str, key: str = 'epsilon') -> str:
  values = seed_values(results, CELL, row, key)
  if not ROWS[row].get('enabled'):
    return '∞ (no DP)'
  if not values:
    return '—'
  # ε depends on (q, z, rounds, δ) only: the same for every seed
  return f'{values[0]:.3g}'


def render(config, results: dict, rows: Sequence[str], meta: dict, png: str) -> str:
  c = config
  m = max(1, int(round(c.fedavg.participation * c.partition.num_clients)))
  q = m / c.partition.num_clients
  lines = [
    f'# DP-FedAvg on {c.dataset.name}: privacy against accuracy',
    '',
    f'Command: `nice python -m experiments.dp_table --dataset={c.dataset.name}` '
    f'({meta["date"]}; {backend_line(results, meta)}; seeds {meta["seeds"]}).',
    '',
    f'FedAvg, {c.partition.num_clients} clients ({c.partition.scheme}), {m} per round '
    f'(q = {q:g}), model {c.model}, {c.fedavg.rounds} rounds x {c.fedavg.local_epochs} local '
    f'epochs, batch {c.batch_size}, SGD lr {c.optimizer.lr} momentum {c.optimizer.momentum}. '
    f'DP rows: server-side DP-FedAvg (McMahan et al. 2018), every update clipped to L2 norm '
    f'C = {c.dp.clip_norm} (adaptive: C starts there and follows the median update norm, '
    f'Andrew et al. 2021, σ_b = {c.dp.count_noise_fraction:g} m), Gaussian noise of std z·C on '
    f'the sum, divided by m. ε at δ = {c.dp.delta:g} after the last round, user-level (one '
    "client's whole data), of the Poisson-subsampled Gaussian: the rounds Poisson-sample their "
    'clients (each with probability q; the cohort varies, the mean divides by m), so the '
    "accountant's sampling is the code's; dp-accounting's RDP accountant (ε) and its privacy "
    'loss distribution accountant (ε PLD, tighter).',
    '',
    'Test accuracy (%), mean ± std over seeds; seconds per run.',
    '',
    '| Row | z | C | ε (δ = 1e-5) | ε PLD | final accuracy | best accuracy | seconds |',
    '|---|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for row in rows:
    dp = ROWS[row]
    z = f'{dp["noise_multiplier"]:g}' if dp.get('enabled') else '—'
    clip = f'{c.dp.clip_norm:g}' if dp.get('enabled') else '—'
    finals = seed_values(results, CELL, row, 'final_clip_norm')
    if dp.get('adaptive') and finals:
      clip += f' → {sum(finals) / len(finals):.3g} (adaptive, mean final)'
    errors = seed_errors(results, CELL, row)
    cells = [
      mean_std(seed_values(results, CELL, row, key)) or '—'
      for key in ('final_test_accuracy', 'best_test_accuracy')
    ]
    seconds = mean_std(seed_values(results, CELL, row, 'seconds'), scale=1.0, digits=1) or '—'
    note = f' ({errors} error)' if errors else ''
    lines.append(
      f'| {row}{note} | {z} | {clip} | {_epsilon_text(results, row)} '
      f'| {_epsilon_text(results, row, "epsilon_pld")} | {cells[0]} | {cells[1]} | {seconds} |'
    )
  lines += [
    '',
    f'![final test accuracy against ε]({png})',
    '',
    'Per run: OUT/<row>/seed<s>/ (metrics.jsonl with ε per round, summary.json).',
  ]
  return '\n'.join(lines) + '\n'


def plot(path: pathlib.Path, results: dict, rows: Sequence[str], title: str) -> None:
  """Final accuracy against ε (log scale), one point per DP row; no DP as a band."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(5.2, 3.6), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for adaptive, marker, label in ((False, 'o', 'fixed C'), (True, 's', 'adaptive C')):
    points = [
      r for r in rows if ROWS[r].get('enabled') and bool(ROWS[r].get('adaptive')) == adaptive
    ]
    points = [r for r in points if seed_values(results, CELL, r, 'epsilon')]
    if not points:
      continue
    eps = [seed_values(results, CELL, r, 'epsilon')[0] for r in points]
    mean, std = percent_stats_each(
      [seed_values(results, CELL, r, 'final_test_accuracy') for r in points]
    )
    ax.errorbar(eps, mean, yerr=std, marker=marker, ms=4, capsize=2, ls='-', label=label)
    for e, a, r in zip(eps, mean, points):
      ax.annotate(
        f'z={ROWS[r]["noise_multiplier"]:g}',
        (e, a),
        fontsize=7,
        xytext=(3, -9),
        textcoords='offset points',
      )
  if 'no_dp' in rows and seed_values(results, CELL, 'no_dp', 'final_test_accuracy'):
    (mean,), (std,) = percent_stats_each(
      [seed_values(results, CELL, 'no_dp', 'final_test_accuracy')]
    )
    ax.axhspan(mean - std, mean + std, color='grey', alpha=0.25)
    ax.axhline(mean, color='grey', ls='--', label='no DP')
  ax.set_xscale('log')
  ax.xaxis.set_major_locator(FixedLocator([0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]))
  ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f'{v:g}'))
  ax.xaxis.set_minor_formatter(NullFormatter())
  ax.set_xlabel(f'ε at δ = {DELTA:g} (after the last round)')
  ax.set_ylabel('final test accuracy (%)')
  ax.legend(fontsize=8, loc='lower right')
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  save_png(fig, path)


def run_table(
  dataset: str,
  out: pathlib.Path,
  seeds: Sequence[int],
  rows: Sequence[str],
  doc: str = '',
  smoke: bool = False,
) -> str:
  """Runs every (row, seed) not finished yet; rewrites results.json, the table and the plot
  after each run; returns the table."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.engine.compiles import use_persistent_cache  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from jfed.workdir import atomic_write_text  # pylint: disable=g-import-not-at-top

  sweep.check_known('rows', rows, ROWS)
  if dataset not in DATASETS:
    raise ConfigError(f'--dataset: {dataset!r}; valid: {", ".join(DATASETS)}')
  out.mkdir(parents=True, exist_ok=True)
  use_persistent_cache(str(out / 'compilation_cache'), min_compile_seconds=0.2)
  s = sweep.Sweep.open(out, sorted(seeds), dataset=dataset)
  name = f'dp_{dataset}' + ('_smoke' if smoke else '')
  png = pathlib.Path(doc).with_suffix('.png').name if doc else f'{name}.png'
  base = setup(dataset, smoke)
  s.render = lambda s: {f'{name}.md': render(base, s.results, rows, s.meta, png)}
  s.after_save = lambda s: plot(out / f'{name}.png', s.results, rows, f'DP-FedAvg on {dataset}')

  def execute(row: str, seed: int, workdir: pathlib.Path) -> sweep.Record:
    t0 = time.perf_counter()
    summary = run_experiment(
      'fedavg', row_config(dataset, row, seed, smoke), workdir, progress=False
    )
    record = sweep.summary_record(summary, SUMMARY_KEYS)
    record['wall_seconds'] = time.perf_counter() - t0
    dp = summary.extras.get('dp')
    if dp:
      record['epsilon'] = dp['epsilon']
      record['epsilon_pld'] = dp['epsilon_pld']
      record['final_clip_norm'] = dp.get('final_clip_norm', dp['clip_norm'])
    return record

  for seed in seeds:
    for row in rows:
      workdir = out / row / f'seed{seed}'
      s.run_one(
        CELL,
        seed,
        row,
        lambda: execute(row, seed, workdir),  # pylint: disable=cell-var-from-loop
        f'{dataset} {row} seed={seed} -> {workdir}',
      )
  s.save()
  table = s.text(f'{name}.md')
  if doc:
    target = pathlib.Path(doc)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, table)
    shutil.copyfile(out / f'{name}.png', target.with_suffix('.png'))
  return table


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  out = pathlib.Path(FLAGS.out or f'runs/dp_{FLAGS.dataset}')
  print(
    run_table(FLAGS.dataset, out, [int(s) for s in FLAGS.seeds], FLAGS.rows, FLAGS.doc, FLAGS.smoke)
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
