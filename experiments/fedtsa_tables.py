"""FedTSA Tables 3 and 4 and its ablations (Fan et al., ECCV 2024, §5): every method per data
partition and per degree of model heterogeneity, over seeds.

    python -m experiments.fedtsa_tables --config=experiments/configs/fedtsa_fashion_mnist.py \
        --out=runs/fedtsa_tables [--budget=paper] [--partitions=iid,dir=0.6,dir=0.3] \
        [--degrees=1.0,0.5/1.0,0.6/0.8/1.0,0.1/0.4/0.7/1.0] [--seeds=0,1,2] \
        [--runs=fedavg_pruned,...,fedtsa,fedtsa_stage1_only,...]

`--config` is a FedTSA config file (fedtsa_fashion_mnist.py, fedtsa_digits.py); the command calls
its `get_config` with the `--budget` words plus, per run, the run's words (full / pruned) and the
cell's words (`iid` or `dir=α` for Table 3; `iid,rates=…` for a Table 4 degree). Each (cell,
seed, run) goes through `jfed.driver.run_experiment` into OUT/<cell>/seed<s>/<run>/ (metrics,
summary, plots, checkpoints): rerunning the command resumes an interrupted run and skips
finished ones. FedTSA's DDPM is trained once per seed and shared by every FedTSA run of that
seed (`fedtsa.ddpm_cache` = OUT/ddpm/seed<s>.msgpack; its training images, drawn from the
training images held out of every client by `dataset.holdout_size`, depend on the seed, not on
the partition). Every run of a table holds out the same `dataset.holdout_size` training images
and trains its clients with the same optimiser (`config.optimizer`), and every run is scored on
the whole test split (`check_comparable` refuses a config that breaks this). With
`--reference_epochs=N` (and `--reference_model`), a classifier trained on the real training images
labels each FedTSA run's Stage-2 images (`experiments.generator_check`), and the header gives the
share labelled as their prompt's class per partition: the precondition that Stage 2 learns from
usable images. "Is the budget enough?" gives each Table 3 run's rise over the last fifth of its
steps (about 0 on a plateau; a method still climbing is not yet compared at its best).

Table 3 has the paper's columns IID, Dir(0.6), Dir(0.3) (`--partitions`); FedAvg and FedProx
appear twice, every client pruned to 0.6 (lower bound) and every client at 1.0 (upper bound).
Table 4 is IID with the model-heterogeneity degrees of `--degrees` ('0.6/0.8/1.0' is Table 3's
IID cell: shares 20/40/40 %; other degrees use equal shares). The ablations (Figs. 3-5, Table 6)
are FedTSA runs on the first partition: Stage 1 only, 3 global epochs, 50 images per prompt,
T = 1 and T = 10, KL + CE (Eq. 9, weight 0.5).

Writes OUT/tables.md (mean ± std over seeds of the final and the best test accuracy in %, with
the paper's CIFAR-10 numbers as a separate reference table, since the paper has no result on
these datasets), OUT/table3.png (bars with std error bars), OUT/table4.png (accuracy against
the degree, one line per method) and OUT/results.json. A run that fails is counted as 'error'
(its message in results.json) and the sweep goes on.

Seeds in parallel: run one sweep per seed into its own OUT (`--seeds=1 --out=runs/t_s1`, ...),
then `--merge=runs/t_s1,runs/t_s2 --out=runs/t_s0` (with the same --config/--budget/--runs/
--partitions/--degrees) adds their records to OUT's results and rewrites its tables; the run
directories stay where they ran.
"""

import pathlib
from typing import Dict, List, NamedTuple, Optional, Sequence

from absl import flags
import numpy as np

from experiments import generator_check, sweep
from experiments.seed_tables import (
  RISE_EXPLAINED,
  evidence_lines,
  last_fifth_rise,
  load_config_module,
  mean_std,
  ordering_lines,
  paper_orderings,
  percent_stats_each,
  seed_cell,
  seed_values,
  step_accuracies,
)
from jfed.figures import save_png

FLAGS = flags.FLAGS
DEFAULT_DEGREE = '0.6/0.8/1.0'


def define_flags() -> None:
  """Defined only when run as a command (importing the module in tests defines no flags)."""
  sweep.define_flags('runs/fedtsa_tables', config='A FedTSA config file, FILE[:budget words].')
  flags.DEFINE_string('budget', '', "More budget words for the config (e.g. 'paper', 'smoke').")
  flags.DEFINE_list('partitions', ['iid', 'dir=0.6', 'dir=0.3'], 'Table 3 columns.')
  flags.DEFINE_list('degrees', [], 'Table 4 rows, e.g. 1.0,0.5/1.0,0.6/0.8/1.0 (none: no Table 4).')
  flags.DEFINE_list('runs', None, 'Runs (rows); default: every Table 3 run.')
  flags.DEFINE_integer(
    'reference_epochs',
    0,
    'Epochs of a reference classifier trained on the real training images that labels the '
    "FedTSA runs' Stage-2 images (the table's precondition line); 0: none.",
  )
  flags.DEFINE_string('reference_model', 'cnn_mnist', 'The reference classifier (a model spec).')


class Run(NamedTuple):
  method: str
  name: str  # the table's row
  words: str = ''  # config words of this run ('full', 'pruned')
  fedtsa: Optional[Dict[str, object]] = None  # FedTSA overrides (ablations)
  heterogeneous: bool = True  # a Table 4 method


RUNS: Dict[str, Run] = {
  'fedavg_pruned': Run('fedavg', 'FedAvg (all at 0.6)', 'pruned', heterogeneous=False),
  'fedavg_full': Run('fedavg', 'FedAvg (all at 1.0)', 'full', heterogeneous=False),
  'fedprox_pruned': Run('fedprox', 'FedProx (all at 0.6)', 'pruned', heterogeneous=False),
  'fedprox_full': Run('fedprox', 'FedProx (all at 1.0)', 'full', heterogeneous=False),
  'fedproto': Run('fedproto', 'FedProto'),
  'fedmd': Run('fedmd', 'FedMD'),
  'feddf': Run('feddf', 'FedDF'),
  'heterofl': Run('heterofl', 'HeteroFL'),
  'fedtsa': Run('fedtsa', 'FedTSA'),
}
ABLATIONS: Dict[str, Run] = {
  'fedtsa_stage1_only': Run('fedtsa', 'FedTSA, Stage 1 only', fedtsa={'stage2': False}),
  'fedtsa_global3': Run('fedtsa', 'FedTSA, 3 global epochs', fedtsa={'global_epochs': 3}),
  'fedtsa_images50': Run(
    'fedtsa', 'FedTSA, 50 images per prompt', fedtsa={'images_per_prompt': 50}
  ),
  'fedtsa_t1': Run('fedtsa', 'FedTSA, T = 1', fedtsa={'temperature': 1.0}),
  'fedtsa_t10': Run('fedtsa', 'FedTSA, T = 10', fedtsa={'temperature': 10.0}),
  'fedtsa_kl_ce': Run('fedtsa', 'FedTSA, 0.5 KL + 0.5 CE', fedtsa={'kl_weight': 0.5}),
}
ALL_RUNS = {**RUNS, **ABLATIONS}

# FedTSA (Fan et al., ECCV 2024; arXiv 2407.05098) on CIFAR-10, ResNet-18, 20 clients:
# Table 3 (FedAvg / FedProx as 'pruned-full') and Table 4 (IID, degrees of heterogeneity).
PAPER_TABLE3 = {
  'iid': {
    'FedAvg': '84.23-90.86',
    'FedProx': '83.85-86.47',
    'FedProto': '59.6',
    'FedMD': '74.26',
    'FedDF': '79.01',
    'HeteroFL': '87.61',
    'FedTSA': '89.28',
  },
  'dir=0.6': {
    'FedAvg': '81.54-83.55',
    'FedProx': '82.31-84.26',
    'FedProto': '49.51',
    'FedMD': '71.33',
    'FedDF': '76.98',
    'HeteroFL': '85.09',
    'FedTSA': '86.72',
  },
  'dir=0.3': {
    'FedAvg': '77.25-80.91',
    'FedProx': '80.71-82.39',
    'FedProto': '41.33',
    'FedMD': '70.03',
    'FedDF': '75.12',
    'HeteroFL': '82.77',
    'FedTSA': '84.61',
  },
}
PAPER_TABLE4 = {
  '1.0': (74.31, 85.23, 87.62, 91.13, 91.56),
  '0.5/1.0': (62.13, 78.11, 82.43, 83.30, 89.61),
  '0.6/0.8/1.0': (59.60, 74.26, 79.01, 82.61, 89.28),
  '0.1/0.4/0.7/1.0': (50.03, 64.31, 70.55, 68.21, 82.37),
  '0.1/0.3/0.5/0.7/1.0': (48.87, 63.16, 68.83, 67.79, 80.09),
}
TABLE4_RUNS = ('fedproto', 'fedmd', 'feddf', 'heterofl', 'fedtsa')
# client_weighted_test_accuracy: FedTSA's mean over clients of their cluster model's accuracy,
# recorded beside the reported unpruned model's (None for the other methods).
SUMMARY_KEYS = (
  'final_test_accuracy',
  'best_test_accuracy',
  'seconds',
  'client_weighted_test_accuracy',
)


def normalise_degree(degree: str) -> str:
  """'1.0/0.6/0.8' -> '0.6/0.8/1.0' (the paper's notation, ascending)."""
  return '/'.join(
    f'{r:g}' if r != 1 else '1.0' for r in sorted(float(x) for x in degree.split('/'))
  )


def degree_cell(degree: str) -> str:
  """The cell of a Table 4 degree; the paper's default degree is Table 3's IID cell."""
  return 'iid' if degree == DEFAULT_DEGREE else f'iid,rates={degree}'


def cell_dirname(cell: str) -> str:
  return cell.replace(',', '_').replace('=', '').replace('/', '-')


def run_config(module, budget: str, run: Run, cell: str, seed: int, out: pathlib.Path):
  words = [w for w in (budget, run.words, cell) if w]
  c = module.get_config(','.join(words))
  c.seed = seed
  if run.method == 'fedtsa':
    c.fedtsa.ddpm_cache = str((out / 'ddpm' / f'seed{seed}.msgpack').absolute())
    c.fedtsa.update(run.fedtsa or {})
  return c


def check_comparable(configs: Dict[str, object]) -> None:
  """ConfigError unless every run's config holds out the same training images
  (`dataset.holdout_size`), trains its clients with the same optimiser (name, learning rate,
  momentum, batch) and, for FedMD, uses that optimiser rather than its reference's Adam."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  seen = {
    name: (
      int(c.dataset.get('holdout_size', 0)),
      str(c.optimizer.name),
      float(c.optimizer.lr),
      float(c.optimizer.get('momentum', 0.0)),
      int(c.batch_size),
    )
    for name, c in configs.items()
  }
  if len(set(seen.values())) > 1:
    raise ConfigError(
      f'the runs of a table differ in (holdout_size, client optimiser, lr, momentum, batch): {seen}'
    )
  for name, c in configs.items():
    if ALL_RUNS[name].method == 'fedmd' and c.fedmd.optimizer != 'client':
      raise ConfigError(f'{name}: fedmd.optimizer={c.fedmd.optimizer!r}; a table needs client')


def gather(results: dict, cell: str, run: str, key: str) -> List[float]:
  return seed_values(results, cell, run, key)


def ours(results: dict, cell: str, run: str, key: str) -> str:
  return seed_cell(results, cell, run, key)


def paper_column(partition: str) -> Dict[str, float]:
  """Table 3's numbers of one partition by run (FedAvg and FedProx: 'pruned-full')."""
  column = {}
  for run, spec in RUNS.items():
    base = spec.name.split(' (')[0]
    value = PAPER_TABLE3[partition].get(base)
    if value is None:
      continue
    low, _, high = value.partition('-')
    column[run] = float(high if spec.words == 'full' and high else low)
  return column


def ordering_sections(results: dict, partitions, degrees, runs) -> List[str]:
  """For each Table 3 partition and Table 4 degree run, every pair of methods the paper ranks
  apart, with what our seeds say (`seed_tables.paper_orderings`, final round)."""
  names = {r: ALL_RUNS[r].name for r in ALL_RUNS}
  columns = [
    (f'Table 3, {p}', p, {r: v for r, v in paper_column(p).items() if r in runs})
    for p in partitions
    if p in PAPER_TABLE3
  ]
  columns += [
    (
      f'Table 4, rates [{d.replace("/", ", ")}]',
      degree_cell(d),
      {r: v for r, v in zip(TABLE4_RUNS, PAPER_TABLE4[d]) if r in runs},
    )
    for d in degrees
    if d in PAPER_TABLE4 and d != DEFAULT_DEGREE
  ]
  lines = []
  for title, cell, column in columns:
    lines += [
      '',
      f'## Orderings the paper gives, {title}, our final round',
      '',
      'Every pair of rows the paper (CIFAR-10, ResNet-18) ranks apart; a two-sided t-test over '
      'our seeds, paired by seed (one partition per seed), at 5 %: holds / fails when our seeds '
      'tell them apart, within noise when they do not.',
      '',
    ]
    lines += ordering_lines(paper_orderings(results, cell, column), names)
  return lines


def precondition_lines(results: dict, partitions: List[str], runs: List[str], meta: dict):
  """Issue 36's precondition that Stage 2 learns from usable images: the share of FedTSA's
  Stage-2 images that a classifier trained on real training images labels as their prompt's
  class, per Table 3 partition."""
  reference = meta.get('reference')
  if not reference or 'fedtsa' not in runs:
    return []
  cells = [
    f'{p}: {mean_std(gather(results, p, "fedtsa", "stage2_labelled_right")) or "—"}'
    for p in partitions
  ]
  return [
    '',
    f"FedTSA's Stage-2 images labelled as their prompt's class by a reference "
    f'{reference["model"]} ({reference["epochs"]} epochs on the training split, test accuracy '
    f'{100 * reference["test_accuracy"]:.2f} %; `experiments.generator_check`), mean ± std over '
    'seeds (usable at ≥ 80 %): ' + '; '.join(cells) + '.',
  ]


def budget_lines(results: dict, partitions: List[str], runs: List[str]) -> List[str]:
  """Whether the budget lets the methods reach their plateau: each Table 3 run's rise of the
  last fifth of its steps, per partition."""
  shown = [r for r in runs if r in RUNS]
  if not partitions or not shown:
    return []
  rows = [
    [RUNS[r].name] + [mean_std(gather(results, p, r, 'last_fifth_rise')) or '—' for p in partitions]
    for r in shown
  ]
  lines = ['', '## Is the budget enough?', '', RISE_EXPLAINED, '']
  return lines + sweep.table_lines(['Method', *partitions], rows)


def optimizer_words(config) -> str:
  """The clients' optimiser as the header names it, e.g. 'SGD lr 0.03, momentum 0, batch 100'."""
  o = config.optimizer
  name = {'sgd': 'SGD', 'adam': 'Adam'}.get(o.name, o.name)
  momentum = f', momentum {o.momentum:g}' if o.name == 'sgd' else ''
  return f'{name} lr {o.lr:g}{momentum}, batch {config.batch_size}'


def render(config, results: dict, plan: dict, meta: dict) -> str:
  partitions, degrees, runs = plan['partitions'], plan['degrees'], plan['runs']
  lines = [
    f'# FedTSA Tables 3 and 4 on {config.dataset.name} (Fan et al., ECCV 2024, §5)',
    '',
    "Top-1 test accuracy (%), mean ± std over seeds (n = seeds finished), of each method's "
    "reported model (FedTSA: the rate-1.0 cluster's model; FedProto and FedMD: "
    'the mean client accuracy; HeteroFL, FedDF, FedAvg, FedProx: the global model).',
    '',
    f'Backend {meta["backend"]}, jax {meta["jax_version"]}, {meta["date"]}, seeds '
    f'{meta["seeds"]}, budget: {meta["budget"] or "the config default"}; '
    f'{config.partition.num_clients} clients, model {config.model}, clients '
    f'{config.client_models or config.model}; FedTSA {config.fedtsa.rounds} rounds x '
    f'{config.fedtsa.local_epochs} local epochs, Stage-2 source {config.fedtsa.source}; '
    f'every client {optimizer_words(config)}.',
  ]
  if meta.get('evidence'):
    lines += ['', 'Precondition evidence for this budget (measured before the sweep):']
    lines += meta['evidence']
  table3 = [r for r in runs if r in RUNS]
  for title, key in (('final round', 'final_test_accuracy'), ('best round', 'best_test_accuracy')):
    lines += ['', f'## Table 3: {title}', '']
    lines += ['| Method | ' + ' | '.join(partitions) + ' |', '|---|' + '---:|' * len(partitions)]
    lines += [
      f'| {ALL_RUNS[r].name} | ' + ' | '.join(ours(results, p, r, key) for p in partitions) + ' |'
      for r in table3
    ]
  ablations = [r for r in runs if r in ABLATIONS]
  if ablations and partitions:
    p = partitions[0]
    lines += ['', f'## Ablations ({p}; Figs. 3-5, Table 6)', '', '| Run | final | best |']
    lines += ['|---|---:|---:|']
    for r in ['fedtsa', *ablations] if 'fedtsa' in runs else ablations:
      finals = ours(results, p, r, 'final_test_accuracy')
      lines.append(
        f'| {ALL_RUNS[r].name} | {finals} | {ours(results, p, r, "best_test_accuracy")} |'
      )
  t4 = [r for r in TABLE4_RUNS if r in runs]
  for title, key in (('final round', 'final_test_accuracy'), ('best round', 'best_test_accuracy')):
    if not (degrees and t4):
      break
    lines += ['', f'## Table 4: degrees of model heterogeneity (IID), {title}', '']
    lines += ['| Rates | ' + ' | '.join(RUNS[r].name for r in t4) + ' |']
    lines += ['|---|' + '---:|' * len(t4)]
    for d in degrees:
      cells = [ours(results, degree_cell(d), r, key) for r in t4]
      lines.append(f'| [{d.replace("/", ", ")}] | ' + ' | '.join(cells) + ' |')
  lines += precondition_lines(results, partitions, runs, meta)
  lines += budget_lines(results, partitions, runs)
  lines += ordering_sections(results, partitions, degrees, runs)
  lines += [
    '',
    '## The paper (CIFAR-10, ResNet-18, 20 clients, 100 rounds; for the ordering only)',
    '',
    'FedTSA (Fan et al., ECCV 2024) does not say whether it reports the last or the best round; '
    'compare either.',
    '',
    '| Method | ' + ' | '.join(PAPER_TABLE3) + ' |',
    '|---|' + '---:|' * len(PAPER_TABLE3),
  ]
  for name in PAPER_TABLE3['iid']:
    lines.append(f'| {name} | ' + ' | '.join(PAPER_TABLE3[p][name] for p in PAPER_TABLE3) + ' |')
  lines += ['', '| Rates | FedProto | FedMD | FedDF | HeteroFL | FedTSA |', '|---|' + '---:|' * 5]
  for d, values in PAPER_TABLE4.items():
    lines.append(f'| [{d.replace("/", ", ")}] | ' + ' | '.join(f'{v:.2f}' for v in values) + ' |')
  lines += ['', 'Per run: OUT/<cell>/seed<s>/<run>/ (metrics.jsonl, summary.json, plots).']
  return '\n'.join(lines) + '\n'


def plot_table4(path: pathlib.Path, results: dict, runs: List[str], degrees: List[str]):
  """Table 4 as lines: per method, the mean final accuracy ± std against the degree."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(7, 4), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  x = np.arange(len(degrees))
  for r in (r for r in TABLE4_RUNS if r in runs):
    mean, std = percent_stats_each(
      [gather(results, degree_cell(d), r, 'final_test_accuracy') for d in degrees]
    )
    ax.errorbar(x, mean, yerr=std, marker='o', capsize=2, label=RUNS[r].name)
  ax.set_xticks(x)
  ax.set_xticklabels(['[' + d.replace('/', ', ') + ']' for d in degrees], fontsize=7)
  ax.set_xlabel('pruning rates of the device classes (IID)')
  ax.set_ylabel('final test accuracy (%)')
  ax.set_title('FedTSA Table 4: mean ± std over seeds')
  ax.legend(fontsize=8)
  fig.tight_layout()
  save_png(fig, path)


def plot_table(path: pathlib.Path, results: dict, runs: List[str], partitions: List[str]):
  """Table 3 as grouped bars: per partition, each method's mean final accuracy ± std."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  rows = [r for r in runs if r in RUNS]
  fig = Figure(figsize=(4 + 1.2 * len(rows), 4), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  width = 0.8 / max(1, len(partitions))
  for j, p in enumerate(partitions):
    x = np.arange(len(rows)) + (j - (len(partitions) - 1) / 2) * width
    mean, std = percent_stats_each([gather(results, p, r, 'final_test_accuracy') for r in rows])
    ax.bar(x, mean, width * 0.9, yerr=std, capsize=2, label=p)
  ax.set_xticks(np.arange(len(rows)))
  ax.set_xticklabels([ALL_RUNS[r].name for r in rows], rotation=25, ha='right', fontsize=8)
  ax.set_ylabel('test accuracy (%)')
  ax.set_title('FedTSA Table 3: final accuracy, mean ± std over seeds')
  ax.legend(fontsize=8)
  fig.tight_layout()
  save_png(fig, path)


def run_sweep(
  config_path: str,
  budget: str,
  out: pathlib.Path,
  runs: List[str],
  partitions: List[str],
  degrees: List[str],
  seeds: List[int],
  merge: Sequence[str] = (),
  reference_epochs: int = 0,
  reference_model: str = 'cnn_mnist',
) -> str:
  """Runs every (cell, seed, run) not finished yet (or, with `merge`, only merges those
  directories' results); rewrites results.json, tables.md and the plots after each run;
  returns the tables' text. With `reference_epochs`, a classifier trained on the real training
  images (once, when the first FedTSA run has finished) labels each FedTSA run's Stage-2
  images."""

  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  sweep.check_known('runs', runs, ALL_RUNS)
  try:
    degrees = [normalise_degree(d) for d in degrees]
  except ValueError:
    raise ConfigError(f'--degrees: expected rates like 0.6/0.8/1.0, got {degrees}') from None
  module = load_config_module(config_path, 'fedtsa_tables_config')
  base = module.get_config(budget)
  for cell in partitions + [degree_cell(d) for d in degrees]:
    module.get_config(','.join(w for w in (budget, cell) if w))  # bad words fail before any run
    check_comparable({r: run_config(module, budget, ALL_RUNS[r], cell, 0, out) for r in runs})
  out.mkdir(parents=True, exist_ok=True)
  (out / 'ddpm').mkdir(exist_ok=True)
  plan = {'partitions': partitions, 'degrees': degrees, 'runs': runs}
  s = generator_check.open_sweep(out, seeds, merge, budget=budget)
  s.meta['evidence'] = evidence_lines(module, budget)
  s.render = lambda s: {'tables.md': render(base, s.results, plan, s.meta)}
  labeller = generator_check.Labeller(base, reference_model, reference_epochs)

  def plots(s: sweep.Sweep) -> None:
    if partitions:
      plot_table(out / 'table3.png', s.results, runs, partitions)
    if degrees:
      plot_table4(out / 'table4.png', s.results, runs, degrees)

  s.after_save = plots

  # (cell, run) pairs: Table 3 runs on every partition; ablations on the first; Table 4's
  # heterogeneous methods on every degree (the default degree is the IID cell, run once).
  jobs = [(p, r) for p in partitions for r in runs if r in RUNS]
  jobs += [(partitions[0], r) for r in runs if r in ABLATIONS and partitions]
  for d in degrees:
    jobs += [(degree_cell(d), r) for r in TABLE4_RUNS if r in runs]
  jobs = list(dict.fromkeys(jobs))

  def execute(cell: str, name: str, seed: int, workdir: pathlib.Path) -> sweep.Record:
    c = run_config(module, budget, ALL_RUNS[name], cell, seed, out)
    record = sweep.summary_record(run_experiment(ALL_RUNS[name].method, c, workdir), SUMMARY_KEYS)
    record['last_fifth_rise'] = last_fifth_rise(step_accuracies(workdir))
    score = labeller.score(workdir) if ALL_RUNS[name].method == 'fedtsa' else None
    if score is not None:
      s.meta['reference'] = labeller.reference
      record['stage2_labelled_right'] = score.kept_accuracy
    return record

  for seed in [] if merge else seeds:
    for cell, name in jobs:
      workdir = out / cell_dirname(cell) / f'seed{seed}' / name
      s.run_one(
        cell,
        seed,
        name,
        lambda: execute(cell, name, seed, workdir),  # pylint: disable=cell-var-from-loop
        f'{cell} seed={seed} {name} -> {workdir}',
      )
  s.save()
  return s.text('tables.md')


def main(argv):
  del argv
  path, words = sweep.config_flag()
  print(
    run_sweep(
      path,
      ','.join(w for w in (words, FLAGS.budget) if w),
      pathlib.Path(FLAGS.out),
      FLAGS.runs or list(RUNS),
      FLAGS.partitions,
      FLAGS.degrees,
      [int(s) for s in FLAGS.seeds],
      FLAGS.merge,
      FLAGS.reference_epochs,
      FLAGS.reference_model,
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
