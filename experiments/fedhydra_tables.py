"""FedHydra Tables 1 and 2 (Bai et al., KDD 2025): every method on every partition over seeds,
ours beside the paper's.

    python -m experiments.fedhydra_tables --config=experiments/configs/fedhydra_fashion_mnist.py \
        --out=runs/fedhydra_tables [--methods=fedavg,ot,feddf,dense,coboosting,fedhydra] \
        [--partitions=dir0.5,dir0.3,dir0.1,dir0.01,2c/c] [--seeds=0,1,2] \
        [--config.fedhydra.epochs=...] [--nobatch_seeds]

Each (seed, partition, method) runs through `jfed.driver.run_experiment` with `config.seed` = the
seed (which draws the partition and every initialisation) into OUT/seed<s>/<partition>/<method>/
(all its usual outputs: metrics, summary, plots, checkpoints). The one-shot distillation methods
and OT share one set of client models per (seed, partition) (`local_models_dir` =
OUT/seed<s>/<partition>/local_models), so the clients train once per seed and partition; one-shot
FedAvg (method 'fedavg' with rounds = 1) averages those same local models
(`fedavg.reuse_local_models`), as in the paper, where every method starts from one set of local
models. Multi-round FedAvg (rounds=N) trains its own clients. The seeds run one after the other,
each one whole before the next; but first (`--batch_seeds`, on by default), per partition, the
shared local models of every seed that has none yet train as one client group of all those
seeds' clients (`jfed.methods.seed_batch`: each client with its own seed's data, init and keys,
so the models are those its own run would train), written to each seed's local_models, where
the runs find them.

Writes OUT/tables.md — Table 1 (methods × Dirichlet α) and Table 2 (2c/c) in the paper's layout,
twice: the final epoch and the best epoch, each cell the mean ± sample std over the finished
seeds in %, beside the paper's Fashion-MNIST number (FedHydra (Bai et al., KDD 2025) Tables 1
and 2). The paper does not say which epoch it reports; its Fig. 3 shows accuracy collapsing
late in distillation and the DENSE code it builds on keeps the best checkpoint, so the tables
mark its columns as plausibly the best epoch (not stated). Also OUT/results.json (every run's
numbers and, for the distillation methods, its accuracy-vs-epoch curve) and per partition
OUT/<partition>_accuracy_vs_epoch.png (Fig. 3 / Fig. 6: test accuracy vs distillation epoch of
every distillation method, mean over every seed in results.json with a ± std band; FedAvg, OT
and the teacher ensemble as horizontal lines at their mean). A run that fails is counted as
'error' (its message in results.json) and the sweep goes on.

The header shows issue 36's preconditions: the config file's measured evidence for the budget's
words (its `EVIDENCE`, e.g. fedhydra_digits.py's `plateau`: the local client curve of
`experiments.client_curve`) and this sweep's client models' test accuracy (mean and lowest
client). "Is the budget enough?" gives each distillation student's rise over the last fifth of
its epochs and its gain over one-shot FedAvg, the teacher-free baseline. The tables end with a
verdict for every ordering of the paper's Fashion-MNIST columns (on another dataset, the same
orderings): holds / fails / within noise, a two-sided t-test over the seeds paired by seed.

Rerunning the command skips the runs results.json records as finished (`experiments.sweep`),
retries the failed ones and resumes an interrupted one; results.json keeps the seeds it holds,
so a later `--seeds=3,4` adds to them. Seeds in parallel: run one sweep per seed into its own
OUT (`--seeds=1 --out=runs/t_s1`, ...), then `--merge=runs/t_s1,runs/t_s2 --out=runs/t_s0` (same
--config, --methods and --partitions) adds their records to OUT's results.json and rewrites its
tables and figures, running nothing; the run directories stay where they ran.

OUTs written before the seeds (OUT/<partition>/<method>/, one seed) are not read: their
results.json is refused, so give such a sweep a new --out.
"""

import json
import pathlib
from typing import Dict, List, Sequence

from absl import app, flags

from experiments import sweep
from experiments.seed_tables import (
  RISE_EXPLAINED,
  backend_line,
  curve_stats,
  evidence_lines,
  last_fifth_rise,
  load_config_module,
  mean_std,
  ordering_lines,
  paper_orderings,
  plot_bands,
  pretrain_seeds,
  seed_cell,
  seed_values,
  value_stats,
)

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a command, so that importing the module (tests) does not clash
  with the flags of the other comparison commands."""
  sweep.define_flags('runs/fedhydra_tables', config='Experiment config (get_config(arg)).')
  flags.DEFINE_list(
    'methods', ['fedavg', 'ot', 'feddf', 'dense', 'coboosting', 'fedhydra'], 'Methods (rows).'
  )
  flags.DEFINE_list(
    'partitions',
    ['dir0.5', 'dir0.3', 'dir0.1', 'dir0.01', '2c/c'],
    'Partitions (columns): dir<alpha> or 2c/c.',
  )
  flags.DEFINE_bool(
    'batch_seeds',
    True,
    "Before a partition's runs: train the shared local models of its seeds that have none yet "
    'in one program (jfed.methods.seed_batch), which the runs then read.',
  )


# FedHydra (Bai et al., KDD 2025), Fashion-MNIST columns: Table 1 (Dir(α), top-1 test
# accuracy %) and Table 2 (2c/c).
PAPER = {
  'fedavg': {'dir0.5': 75.76, 'dir0.3': 74.81, 'dir0.1': 35.35, 'dir0.01': 33.71, '2c/c': 32.73},
  'ot': {'dir0.5': 74.88, 'dir0.3': 66.91, 'dir0.1': 41.10, 'dir0.01': 39.56, '2c/c': 16.98},
  'feddf': {'dir0.5': 73.44, 'dir0.3': 65.61, 'dir0.1': 46.68, 'dir0.01': 40.36, '2c/c': 15.33},
  'dense': {'dir0.5': 74.20, 'dir0.3': 72.79, 'dir0.1': 43.26, 'dir0.01': 41.65, '2c/c': 22.31},
  'coboosting': {
    'dir0.5': 75.89,
    'dir0.3': 72.91,
    'dir0.1': 47.20,
    'dir0.01': 42.38,
    '2c/c': 18.22,
  },
  'fedhydra': {'dir0.5': 77.20, 'dir0.3': 76.39, 'dir0.1': 50.48, 'dir0.01': 46.02, '2c/c': 39.06},
}
NAMES = {
  'fedavg': 'FedAvg',
  'ot': 'OT',
  'feddf': 'FedDF',
  'dense': 'DENSE',
  'coboosting': 'Co-Boosting',
  'fedhydra': 'FedHydra',
}
DISTILL = ('feddf', 'dense', 'coboosting', 'fedhydra')
SUMMARY_KEYS = (
  'final_test_accuracy',
  'best_test_accuracy',
  'best_step',
  'client_test_accuracy',
  'teacher_ensemble_test_accuracy',
  'seconds',
)
PAPER_COLUMN = 'plausibly the best epoch (not stated)'
ENSEMBLE = 'Teacher ensemble (mean logits)'
BEST_CLIENT = 'Best single client'


def partition_config(config, partition: str):
  c = config.copy_and_resolve_references()
  if partition == '2c/c':
    c.partition.scheme = 'disjoint'
  elif partition.startswith('dir'):
    c.partition.scheme, c.partition.alpha = 'dirichlet', float(partition[3:])
  else:
    raise app.UsageError(f'unknown partition {partition!r}: use dir<alpha> or 2c/c')
  return c


def dirname(partition: str) -> str:
  return partition.replace('/', '')


def budget_lines(c) -> list:
  d, f, cb, h, o, df = c.dense, c.fedhydra, c.coboosting, c.ot, c.fedavg, c.feddf
  server = lambda m: c[m].server_model or c.model
  return [
    f'- data: {c.dataset.name}, {c.partition.num_clients} clients; clients '
    f'{c.client_models or c.model}; local SGD lr {c.optimizer.lr} momentum '
    f'{c.optimizer.momentum}, batch {c.batch_size}',
    f'- local epochs E: FedAvg {o.local_epochs} (rounds {o.rounds}'
    f'{": the shared local models averaged" if o.rounds == 1 else ""}), OT {h.local_epochs}, '
    f'FedDF {df.local_epochs}, DENSE {d.local_epochs}, Co-Boosting {cb.local_epochs}, '
    f'FedHydra {f.local_epochs} (paper: E = 200)',
    f'- DENSE: server {server("dense")} ({d.init} init), {d.epochs} epochs x {d.g_steps} '
    f'generator steps on {d.synthesis_batch} images (nz {d.nz}, ngf {d.ngf}), BN loss '
    f"'{d.bn_loss_mode}', KD over the pool: T={d.kd_T} x T², SGD {d.kd_lr}, batch {d.kd_batch}",
    f'- Co-Boosting: server {server("coboosting")}, {cb.epochs} epochs x {cb.g_steps} steps '
    f'on {cb.synthesis_batch} images, adv T={cb.adv_T}, hs={cb.hs}, mu={cb.mu}, ODS '
    f'{cb.odseta:.4f}, KD T={cb.kd_T}, SGD {cb.kd_lr} cosine, batch {cb.kd_batch}',
    f'- FedHydra: server {server("fedhydra")}, MS T_G={f.ms_T_G} x {f.ms_batch} images per '
    f'(client, class), T_g={f.epochs} epochs x T_G={f.T_G} generator steps on '
    f'{f.synthesis_batch} images, λ1={f.lambda1}, λ2={f.lambda2}, β={f.beta}, aggregation '
    f"'{f.aggregation}', KD ('{f.kd_data}') SGD {f.kd_lr}, batch {f.kd_batch} "
    f'(paper: T_g = 200, T_G = 30)',
    f'- FedDF: server {server("feddf")} ({df.init} init), {df.total_steps} Adam({df.kd_lr}) '
    f'steps of {df.kd_batch} on {df.source_size} unlabelled images from {df.source!r}, '
    f'validation {df.val_size}, early stop {df.patience}',
    f'- OT: {h.method} transport, weights {h.weights}, anchor client {h.anchor}',
  ]


def seed_clients(results: dict, partition: str) -> List[List[float]]:
  """Per seed that has them, its local client models' test accuracies: the runs of one seed
  share its local models, so any run that evaluated them gives the seed's."""
  out = []
  for runs in results.get(partition, {}).values():
    clients = [r['client_test_accuracy'] for r in runs.values() if r.get('client_test_accuracy')]
    if clients:
      out.append(clients[0])
  return out


def reference_values(results: dict, partition: str) -> Dict[str, List[float]]:
  """Not methods: per seed, what the clients' models reach on their own (from the distillation
  runs, which evaluate the teachers they received): the mean-logit ensemble (DENSE's teacher;
  Co-Boosting and FedHydra weight their teachers and can beat it) and the best single client."""
  out = {ENSEMBLE: [], BEST_CLIENT: []}
  for runs in results.get(partition, {}).values():
    # the runs of one seed share its local models: any of them gives the seed's value
    ensemble = [r.get('teacher_ensemble_test_accuracy') for r in runs.values()]
    ensemble = [a for a in ensemble if a is not None]
    if ensemble:
      out[ENSEMBLE].append(ensemble[0])
  out[BEST_CLIENT] = [max(clients) for clients in seed_clients(results, partition)]
  return out


def reference_cell(values: List[float]) -> str:
  return f'{mean_std(values)} (n={len(values)})' if values else '—'


def client_lines(results: dict, partitions: List[str]) -> List[str]:
  """The local client models of this sweep: their mean test accuracy per seed (`seed_clients`),
  mean ± std over seeds, and the lowest client of any seed."""
  cells = []
  for p in partitions:
    seeds = seed_clients(results, p)
    if seeds:
      means = [sum(clients) / len(clients) for clients in seeds]
      lowest = min(min(clients) for clients in seeds)
      cells.append(f'{p}: {mean_std(means)} (lowest client {100 * lowest:.2f})')
  if not cells:
    return []
  return [
    '',
    'The local client models of these runs, mean client test accuracy (%), mean ± std over '
    'seeds: ' + '; '.join(cells) + '.',
  ]


def gain_over(results: dict, partition: str, method: str, key: str, baseline: str) -> List[float]:
  """Per seed that has both: `method`'s `key` minus `baseline`'s final test accuracy."""
  out = []
  for runs in results.get(partition, {}).values():
    a, b = runs.get(method) or {}, runs.get(baseline) or {}
    if a.get(key) is not None and b.get('final_test_accuracy') is not None:
      out.append(a[key] - b['final_test_accuracy'])
  return out


def budget_enough_lines(results: dict, methods: List[str], partitions: List[str]) -> List[str]:
  """Issue 36's evidence that the distillation mechanisms operate at this budget: each
  distillation student's rise over the last fifth of its epochs (on its plateau or still
  climbing) and its gain over one-shot FedAvg, the teacher-free baseline (the same client models
  averaged, no generator and no distillation)."""
  shown = [m for m in methods if m in DISTILL]
  if not shown:
    return []
  rise_rows, gain_rows, below = [], [], []
  for m in shown:
    rises, gains = [], []
    for p in partitions:
      curves = [r[m]['curve'] for r in results.get(p, {}).values() if (r.get(m) or {}).get('curve')]
      values = [v for v in (last_fifth_rise(c[1]) for c in curves) if v is not None]
      rises.append(mean_std(values) or '—')
      final_gains = gain_over(results, p, m, 'final_test_accuracy', 'fedavg')
      if final_gains and sum(final_gains) <= 0:
        below.append(f'{NAMES[m]} ({p})')
      final = mean_std(final_gains) or '—'
      best = mean_std(gain_over(results, p, m, 'best_test_accuracy', 'fedavg')) or '—'
      gains.append(f'{final} / {best}')
    rise_rows.append([NAMES[m], *rises])
    gain_rows.append([NAMES[m], *gains])
  lines = ['', '## Is the budget enough?', '', RISE_EXPLAINED, '']
  lines += sweep.table_lines(['Method', *partitions], rise_rows)
  if 'fedavg' in methods:
    lines += [
      '',
      'Gain over one-shot FedAvg, the teacher-free baseline (the same client models averaged; no '
      'generator, no distillation), in points, of the final / best epoch, mean ± std over the '
      'seeds paired by seed: a student that learns from its teachers rises above it.',
      '',
    ]
    lines += sweep.table_lines(['Method', *partitions], gain_rows)
    if below:
      lines += [
        '',
        f'Not met: {", ".join(below)} end at or below the teacher-free baseline, so for them this '
        "budget is not yet a mechanism budget; the paper's own budget of Tables 1-2 "
        '(Fashion-MNIST) is on the GPU queue (`python -m experiments.dev.gpu_queue --list`).',
      ]
  return lines


def render(config, results: dict, methods, partitions, meta: dict) -> str:
  dir_parts = [p for p in partitions if p.startswith('dir')]
  paper = PAPER if config.dataset.name == 'fashion_mnist' else {}  # the paper's FMNIST columns

  def table(title: str, columns: List[str], labels: List[str], key: str, refs: bool) -> List[str]:
    head = '| Method | ' + ' | '.join(
      f'{label} ours' + (f' | {label} paper' if paper else '') for label in labels
    )
    lines = [
      '',
      f'## {title}',
      '',
      head + ' |',
      '|---|' + '---:|' * (len(labels) * (1 + bool(paper))),
    ]
    for m in methods:
      cells = []
      for p in columns:
        cells.append(seed_cell(results, p, m, key))
        if paper:
          number = paper.get(m, {}).get(p)
          cells.append('—' if number is None else f'{number:.2f}')
      lines.append(f'| {NAMES.get(m, m)} | ' + ' | '.join(cells) + ' |')
    if refs:
      values = [reference_values(results, p) for p in columns]
      for name in (ENSEMBLE, BEST_CLIENT):
        cells = [reference_cell(v[name]) + (' | —' if paper else '') for v in values]
        lines.append(f'| *{name}* | ' + ' | '.join(cells) + ' |')
    return lines

  source = (
    'Paper: FedHydra (Bai et al., KDD 2025) Table 1 (Dir(α)) and Table 2 (2c/c), '
    'Fashion-MNIST columns, beside ours.'
    if paper
    else 'In the layout of FedHydra (Bai et al., KDD 2025) Tables 1 and 2 (the paper reports '
    'no numbers for this dataset).'
  )
  lines = [
    f'# FedHydra Tables 1 and 2 on {config.dataset.name}: jfed vs the paper',
    '',
    'Top-1 test accuracy (%), mean ± sample std over seeds (n = the seeds finished; each seed '
    'draws its own partition and initialisations), of the final epoch and, in the second table '
    f'of each pair, of the best epoch. {source}',
    '',
    "Which one the paper's columns are: FedHydra (Bai et al., KDD 2025) does not say. "
    'Its Fig. 3 shows accuracy '
    'collapsing late in distillation, and the DENSE code it builds on keeps the best '
    f'checkpoint, so its columns are **{PAPER_COLUMN}**: compare them with the best-epoch '
    'tables. The final-epoch tables are what a method delivers without choosing an epoch on '
    'the test images. FedDF: its final model is the student best on its validation images '
    '(training images held out of the clients); every method is scored on the whole test split.',
    '',
    f'{backend_line(results, meta)}; {meta["date"]}, seeds {meta["seeds"]}. Budget:',
  ]
  lines += budget_lines(config)
  lines += meta.get('evidence', [])
  lines += client_lines(results, partitions)
  groups = []
  if dir_parts:
    groups.append(('Table 1 (Dirichlet)', dir_parts, [f'α={p[3:]}' for p in dir_parts]))
  if '2c/c' in partitions:
    groups.append(('Table 2 (2c/c)', ['2c/c'], [config.dataset.name]))
  for name, columns, labels in groups:
    final = f'{name}, final epoch' + (" (the paper's column: see the best epoch)" if paper else '')
    lines += table(final, columns, labels, 'final_test_accuracy', True)
    best = f'{name}, best epoch' + (f" (the paper's column: {PAPER_COLUMN})" if paper else '')
    lines += table(best, columns, labels, 'best_test_accuracy', False)
  lines += budget_enough_lines(results, methods, partitions)
  elsewhere = (
    ''
    if paper
    else f' On {config.dataset.name}, which the paper does not report, the orderings tested are '
    'those of its Fashion-MNIST columns.'
  )
  for partition in partitions:
    column = {m: PAPER[m][partition] for m in methods if partition in PAPER.get(m, {})}
    for label, key in (('final', 'final_test_accuracy'), ('best', 'best_test_accuracy')):
      lines += [
        '',
        f'## Orderings the paper gives, {partition}, our {label} epoch',
        '',
        'Every pair of methods that the paper ranks apart; a two-sided t-test over our seeds, '
        'paired by seed (one partition and one set of client models per seed), at 5 %: holds / '
        f'fails when our seeds tell them apart, within noise when they do not.{elsewhere}',
        '',
      ]
      lines += ordering_lines(paper_orderings(results, partition, column, key), NAMES)
  lines += [
    '',
    'Rows in italics (final-epoch tables) are references, not methods: the test accuracy of the '
    'mean-logit ensemble of the uploaded client models (the teacher DENSE distils; Co-Boosting '
    'and FedHydra weight their teachers per model or per class and can beat it) and of the best '
    'client model alone.',
    '',
    'Per run: OUT/seed<s>/<partition>/<method>/ (metrics.jsonl, summary.json, plots); FedHydra '
    'MS weights: OUT/seed<s>/<partition>/fedhydra/ms_heatmap.png. Accuracy vs distillation '
    'epoch, mean ± std over the seeds: OUT/<partition>_accuracy_vs_epoch.png.',
  ]
  return '\n'.join(lines) + '\n'


def epoch_curve(workdir: pathlib.Path) -> List[List[float]]:
  """[epochs, test accuracies] of a distillation run's first round, from its metrics."""
  text = (workdir / 'metrics.jsonl').read_text()
  recs = [json.loads(line) for line in text.splitlines() if line.strip()]
  recs = [
    x
    for x in recs
    if x.get('round', 1) == 1 and 'epoch' in x and x.get('test_accuracy') is not None
  ]
  return [[x['epoch'] for x in recs], [x['test_accuracy'] for x in recs]]


def plot_partition(out: pathlib.Path, partition: str, results: dict, methods) -> None:
  """Fig. 3 / 6 over seeds: every distillation method's mean test accuracy per epoch with a
  ± std band, the others and the teacher ensemble as lines at their mean final accuracy."""
  bands, hlines = {}, {}
  seeds = results.get(partition, {}).values()
  for m in methods:
    if m in DISTILL:
      curves = [r[m]['curve'] for r in seeds if (r.get(m) or {}).get('curve')]
      if curves:
        bands[f'{NAMES[m]} (n={len(curves)})'] = curve_stats(curves)
    else:
      values = seed_values(results, partition, m, 'final_test_accuracy')
      if values:
        hlines[f'{NAMES.get(m, m)} (n={len(values)})'] = value_stats(values, 100.0)[0]
  ensemble = reference_values(results, partition)[ENSEMBLE]
  if ensemble:
    hlines[f'teacher ensemble (n={len(ensemble)})'] = value_stats(ensemble, 100.0)[0]
  if bands or hlines:
    plot_bands(
      out / f'{dirname(partition)}_accuracy_vs_epoch.png',
      bands,
      xlabel='distillation epoch',
      ylabel='test accuracy (%)',
      title=f'test accuracy vs distillation epoch ({partition}), mean ± std over seeds',
      hlines=hlines,
    )


def run_sweep(
  config,
  out: pathlib.Path,
  methods: Sequence[str],
  partitions: Sequence[str],
  seeds: Sequence[int] = (0, 1, 2),
  merge: Sequence[str] = (),
  batch_seeds: bool = True,
  evidence: Sequence[str] = (),
) -> str:
  """Runs every (seed, partition, method) not finished yet (or, with `merge`, only merges those
  directories' results); rewrites results.json and tables.md after each run and the figures
  after each partition; returns the tables' text. With `batch_seeds`, first, per partition, the
  shared local models of the seeds that will read them and have none yet train in one program
  (`pretrain_seeds`). `evidence`: Markdown lines of the budget's measured preconditions (the
  config file's `EVIDENCE`), printed in the header."""

  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from jfed.methods.seed_batch import PlannedRun  # pylint: disable=g-import-not-at-top

  methods, partitions, seeds = list(methods), list(partitions), [int(s) for s in seeds]
  bases = {p: partition_config(config, p) for p in partitions}  # a bad partition fails first

  def load(path: pathlib.Path) -> dict:
    saved = json.loads(path.read_text())
    if 'seeds' not in saved.get('meta', {}):
      raise ConfigError(
        f'{path} is of the one-seed layout (OUT/<partition>/<method>), which this command no '
        'longer reads: use a new --out'
      )
    return saved

  s = sweep.Sweep.open(out, [] if merge else seeds, merge, load)
  if evidence:
    s.meta['evidence'] = list(evidence)
  s.render = lambda s: {'tables.md': render(config, s.results, methods, partitions, s.meta)}

  def seed_config(seed: int, partition: str):
    base = bases[partition].copy_and_resolve_references()
    base.seed = seed
    base.local_models_dir = str(
      (out / f'seed{seed}' / dirname(partition) / 'local_models').absolute()
    )
    base.fedavg.reuse_local_models = base.fedavg.rounds == 1
    return base

  def planned_runs(seed: int, partition: str) -> List[PlannedRun]:
    cell = out / f'seed{seed}' / dirname(partition)
    return [PlannedRun(m, seed_config(seed, partition), cell / m) for m in methods]

  def execute(method: str, seed: int, partition: str, workdir: pathlib.Path) -> sweep.Record:
    summary = run_experiment(method, seed_config(seed, partition), workdir)
    record = sweep.summary_record(summary, SUMMARY_KEYS)
    if method in DISTILL:
      record['curve'] = epoch_curve(workdir)
    return record

  for seed in [] if merge else seeds:
    for partition in partitions:
      if batch_seeds and seed == seeds[0]:  # before the partition's first run
        pretrain_seeds(lambda: [planned_runs(s, partition) for s in seeds], partition)
      for method in methods:
        workdir = out / f'seed{seed}' / dirname(partition) / method
        s.run_one(
          partition,
          seed,
          method,
          lambda: execute(method, seed, partition, workdir),  # pylint: disable=cell-var-from-loop
          f'seed {seed} / {partition} / {method} -> {workdir}',
        )
      plot_partition(out, partition, s.results, methods)
  s.save()
  for partition in partitions:
    plot_partition(out, partition, s.results, methods)
  return s.text('tables.md')


def main(argv):
  del argv
  path, _, words = FLAGS['config'].config_filename.partition(':')
  module = load_config_module(path, 'fedhydra_tables_config')
  print(
    run_sweep(
      FLAGS.config,
      pathlib.Path(FLAGS.out),
      FLAGS.methods,
      FLAGS.partitions,
      [int(s) for s in FLAGS.seeds],
      FLAGS.merge,
      FLAGS.batch_seeds,
      evidence_lines(module, words),
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
