"""FedHydra Tables 1 and 2 (seed 000): every method on every partition, ours beside the paper's.

    python -m experiments.fedhydra_tables --config=experiments/configs/fedhydra_fashion_mnist.py \
        --out=runs/fedhydra_tables [--methods=fedavg,ot,feddf,dense,coboosting,fedhydra] \
        [--partitions=dir0.5,dir0.3,dir0.1,dir0.01,2c/c] [--config.fedhydra.epochs=...]

Each (partition, method) runs through `jfed.driver.run_experiment` into
OUT/<partition>/<method>/ (all its usual outputs: metrics, summary, plots, checkpoints; rerunning
the command resumes or skips finished runs). The one-shot distillation methods and OT share one
set of client models per partition (`local_models_dir` = OUT/<partition>/local_models), so the
clients train once per partition; one-shot FedAvg (method 'fedavg' with rounds = 1) averages
those same local models (`fedavg.reuse_local_models`), as in the paper, where every method
starts from one set of local models. Multi-round FedAvg (rounds=N) trains its own clients.

Writes OUT/tables.md — Table 1 (methods × Dirichlet α) and Table 2 (2c/c) in the paper's layout,
each cell "ours (paper)" in %, the paper's Fashion-MNIST numbers copied from seed 000 Tables 1
and 2 — with the budget of the run in its header, OUT/results.json, and per partition
OUT/<partition>/accuracy_vs_epoch.png (Fig. 3 / Fig. 6: test accuracy vs distillation epoch of
every distillation method, FedAvg and OT as horizontal lines). A run that fails is reported in
the table as 'error' (with the message in results.json) and the sweep goes on.
"""

import datetime
import json
import pathlib
import traceback

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  'config', None, 'Experiment config (get_config(arg)).', lock_config=False
)
flags.DEFINE_string('out', 'runs/fedhydra_tables', 'Output directory.')
flags.DEFINE_list(
  'methods', ['fedavg', 'ot', 'feddf', 'dense', 'coboosting', 'fedhydra'], 'Methods (rows).'
)
flags.DEFINE_list(
  'partitions',
  ['dir0.5', 'dir0.3', 'dir0.1', 'dir0.01', '2c/c'],
  'Partitions (columns): dir<alpha> or 2c/c.',
)
flags.mark_flags_as_required(['config'])

# Seed 000 (FedHydra, Bai et al. KDD'25), Fashion-MNIST columns: Table 1 (Dir(α), top-1 test
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
    f'- data: {c.dataset.name}, {c.partition.num_clients} clients, seed {c.seed}; clients '
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


def cell(ours, paper):
  if ours is None:
    return f'— ({paper:.2f})' if paper is not None else '—'
  if isinstance(ours, str):
    return f'{ours} ({paper:.2f})' if paper is not None else ours
  return f'{100 * ours:.2f} ({paper:.2f})' if paper is not None else f'{100 * ours:.2f}'


def references(results: dict, partition: str) -> dict:
  """Not methods: what the clients' models reach on their own (from the distillation runs,
  which evaluate the teachers they received): the mean-logit ensemble (DENSE's teacher;
  Co-Boosting and FedHydra weight their teachers and can beat it) and the best single client."""
  runs = list(results.get(partition, {}).values())
  ens = next(
    (
      r['teacher_ensemble_test_accuracy']
      for r in runs
      if r.get('teacher_ensemble_test_accuracy') is not None
    ),
    None,
  )
  best = next((max(r['client_test_accuracy']) for r in runs if r.get('client_test_accuracy')), None)
  return {'Teacher ensemble (mean logits)': ens, 'Best single client': best}


def render(config, results, methods, partitions, meta) -> str:
  dir_parts = [p for p in partitions if p.startswith('dir')]
  paper = PAPER if config.dataset.name == 'fashion_mnist' else {}  # the paper's FMNIST columns
  cells = (
    'each cell **ours (paper)**; paper numbers: seed 000 Table 1 (Dir(α)) and Table 2 '
    '(2c/c), Fashion-MNIST columns'
    if paper
    else 'in the layout of seed 000 Tables 1 and 2 (the paper reports no numbers for this dataset)'
  )
  lines = [
    f'# FedHydra Tables 1 and 2 on {config.dataset.name}: jfed vs the paper',
    '',
    f'Top-1 test accuracy (%) of the final model, {cells}. FedDF: '
    'best-on-validation student, evaluated on the test images not held out.',
    '',
    f'Backend {meta["backend"]}, jax {meta["jax_version"]}, {meta["date"]}. Budget:',
  ]
  lines += budget_lines(config)
  lines.append('')
  if dir_parts:
    lines += [
      '## Table 1 (Dirichlet)',
      '',
      '| Method | ' + ' | '.join(f'α={p[3:]}' for p in dir_parts) + ' |',
      '|---|' + '---:|' * len(dir_parts),
    ]
    for m in methods:
      lines.append(
        f'| {NAMES.get(m, m)} | '
        + ' | '.join(
          cell(
            results.get(p, {})
            .get(m, {})
            .get('final_test_accuracy', results.get(p, {}).get(m, {}).get('status')),
            paper.get(m, {}).get(p),
          )
          for p in dir_parts
        )
        + ' |'
      )
    refs = [references(results, p) for p in dir_parts]
    for name in refs[0]:
      lines.append(f'| *{name}* | ' + ' | '.join(cell(r[name], None) for r in refs) + ' |')
    lines.append('')
  if '2c/c' in partitions:
    lines += ['## Table 2 (2c/c)', '', f'| Method | {config.dataset.name} |', '|---|---:|']
    for m in methods:
      r = results.get('2c/c', {}).get(m, {})
      ours = r.get('final_test_accuracy', r.get('status'))
      lines.append(f'| {NAMES.get(m, m)} | {cell(ours, paper.get(m, {}).get("2c/c"))} |')
    for name, value in references(results, '2c/c').items():
      lines.append(f'| *{name}* | {cell(value, None)} |')
    lines.append('')
  lines.append(
    'Rows in italics are references, not methods: the test accuracy of the mean-logit '
    'ensemble of the uploaded client models (the teacher DENSE distils; Co-Boosting '
    'and FedHydra weight their teachers per model or per class and can beat it) and '
    'of the best client model alone.'
  )
  lines.append('')
  lines.append(
    'Per run: OUT/<partition>/<method>/ (metrics.jsonl, summary.json, plots); FedHydra '
    'MS weights: OUT/<partition>/fedhydra/ms_heatmap.png.'
  )
  return '\n'.join(lines) + '\n'


def plot_partition(out: pathlib.Path, partition: str, results: dict) -> None:
  from jfed.distill import plots

  series, hlines = {}, {}
  for m, r in results.get(partition, {}).items():
    if 'final_test_accuracy' not in r:
      continue
    if m in DISTILL:
      path = out / dirname(partition) / m / 'metrics.jsonl'
      recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
      recs = [x for x in recs if x.get('round', 1) == 1 and x.get('test_accuracy') is not None]
      series[NAMES[m]] = ([x['epoch'] for x in recs], [x['test_accuracy'] for x in recs])
    else:
      hlines[NAMES.get(m, m)] = r['final_test_accuracy']
  ensemble = references(results, partition)['Teacher ensemble (mean logits)']
  if ensemble is not None:
    hlines['teacher ensemble'] = ensemble
  if series or hlines:
    plots.plot_accuracy_vs_epoch(
      out / dirname(partition) / 'accuracy_vs_epoch.png',
      series,
      title=f'test accuracy vs distillation epoch ({partition})',
      hlines=hlines,
    )


def run_sweep(config, out: pathlib.Path, methods, partitions) -> str:
  """Runs every (partition, method) not finished yet; writes results.json, tables.md and the
  per-partition plots; returns the tables' text."""
  import jax

  from jfed.driver import run_experiment

  out.mkdir(parents=True, exist_ok=True)
  meta = {
    'backend': jax.default_backend(),
    'jax_version': jax.__version__,
    'date': datetime.date.today().isoformat(),
  }
  results = {}
  for partition in partitions:
    base = partition_config(config, partition)
    base.local_models_dir = str((out / dirname(partition) / 'local_models').absolute())
    base.fedavg.reuse_local_models = base.fedavg.rounds == 1
    results[partition] = {}
    for method in methods:
      workdir = out / dirname(partition) / method
      print(f'=== {partition} / {method} -> {workdir}', flush=True)
      try:
        summary = run_experiment(method, base, workdir)
        results[partition][method] = {
          k: summary.get(k)
          for k in (
            'final_test_accuracy',
            'best_test_accuracy',
            'client_test_accuracy',
            'teacher_ensemble_test_accuracy',
            'seconds_this_invocation',
          )
        }
      except Exception as e:  # one failed run must not lose the sweep
        traceback.print_exc()
        results[partition][method] = {'status': 'error', 'error': f'{type(e).__name__}: {e}'}
      (out / 'results.json').write_text(
        json.dumps({'meta': meta, 'results': results}, indent=2) + '\n'
      )
      (out / 'tables.md').write_text(render(config, results, methods, partitions, meta))
    plot_partition(out, partition, results)
  table = render(config, results, methods, partitions, meta)
  (out / 'tables.md').write_text(table)
  return table


def main(argv):
  del argv
  print(run_sweep(FLAGS.config, pathlib.Path(FLAGS.out), FLAGS.methods, FLAGS.partitions))


if __name__ == '__main__':
  app.run(main)
