"""HFLDD against its baselines on one config over seeds: accuracy-vs-round figure, a summary
table and the seed's Tables III-V (rounds and traffic to reach a target accuracy).

  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_fashion_mnist.py:c1 \
      --out=runs/hfldd_compare_c1 [--methods=hfldd,fedavg,fedprox,fedseq,dynafed,centralized] \
      [--targets=0.6,0.7,0.8] [--seeds=0,1,2] [--merge=OTHER_OUT,...]

Each (seed, method) runs through `jfed.driver.run_experiment` with `config.seed` = the seed
(which draws the partition, the public set and every initialisation) into OUT/seed<s>/<method>/,
so each one resumes from its checkpoints, or is skipped when finished, when the command is
repeated, and can be inspected on its own; the seeds run one after the other. OUTs written
before the seeds (OUT/<method>/) are not read: their runs are not reused. Then OUT gets, over
the seeds whose run finished (n in each cell):
- accuracy.png: test accuracy per round, every method (centralized: per epoch), the mean over
  the seeds with a ± std band;
- traffic.png: the mean test accuracy per round against the mean cumulative measured traffic
  (MiB, setup stages included) at that round, with a ± std band of the accuracy;
- results.md: the budget, a summary table (mean ± std of the final and of the best accuracy,
  traffic, time) and, per target accuracy, the Tables III-V layout (rounds/accuracy, traffic,
  ratio vs HFLDD): each seed's table built with `jfed.io.comm.target_table_rows` from its
  methods' measured cumulative bytes, then every cell as the mean ± std over the seeds that
  reached the target, with how many did;
- results.json: every seed's numbers and per-seed target tables.
`--merge` adds the seeds of other OUTs of the same config (their results.json, e.g. seeds run in
another session; `--seeds=` with nothing runs none and only re-renders the merged ones).
Which accuracy the paper shows: HFLDD (Shi et al., arXiv 2409.17517) Fig. 3 plots the test
accuracy per round, and §VI-B quotes the last round's ("74.0% after 300 communication
rounds", "final test accuracies"):
the final column and accuracy.png's curves; the paper reports no best-round accuracy (ours is
the best round on the test images). Its Tables III-V give the first round whose accuracy
reaches the target.
Traffic is reported twice, in MiB (2^20 bytes, the unit that reproduces the seed's tables):
measured = the serialised bytes of every transfer (the primary account); paper formula =
`jfed.io.comm.*_cost_bits` with the run's N, |H|, clusters and |w|, the count that reproduces
Tables III-V (it adds one model copy per client or head, counts no labels or msgpack framing,
and counts FedSeq as 110 + 120 T copies at 10 x 10; see jfed/io/comm.py).
Centralized training has no communication and is left out of the target tables.
"""

import json
import pathlib
import traceback
from typing import Any, Callable, Dict, List, Sequence

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import sweep
from experiments.seed_tables import curve_stats, mean_std, plot_bands
from experiments.sweep import error_record, is_error

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a command, so that importing the module (tests) does not clash
  with the flags of the other comparison commands."""
  # --out (each run in OUT/seed<s>/<method>), --seeds, --merge (OUTs of the same config with
  # other seeds), --config
  sweep.define_flags(None, config='Experiment config file (get_config(arg)).')
  flags.DEFINE_list(
    'methods',
    ['hfldd', 'fedavg', 'fedprox', 'fedseq', 'dynafed', 'centralized'],
    'Methods to run, in this order.',
  )
  flags.DEFINE_list('targets', ['0.6', '0.7', '0.8'], 'Target test accuracies for the tables.')
  flags.DEFINE_string('reference', 'hfldd', 'Method whose traffic is 1X in the tables.')
  flags.mark_flags_as_required(['out'])


def method_curve(records: List[Dict[str, Any]]):
  """(steps, accuracies, cumulative bytes or None) from a run's metrics records."""
  rows = [r for r in records if 'test_accuracy' in r and r.get('step', 0) >= 1]
  steps = [int(r['step']) for r in rows]
  accs = [float(r['test_accuracy']) for r in rows]
  # the driver adds the running `cumulative_bytes` (setup records included) to every record
  # that carries bytes
  cum = (
    [int(r['cumulative_bytes']) for r in rows]
    if rows and all('cumulative_bytes' in r for r in rows)
    else None
  )
  return steps, accs, cum


def round_transfers(cumulative: List[int]):
  """One Transfer per round carrying that round's bytes (round 1 includes the setup)."""
  from jfed.io.comm import Transfer

  prev, out = 0, []
  for r, c in enumerate(cumulative, start=1):
    out.append(Transfer(r, 'round', 'all', 'all', int(c) - prev))
    prev = int(c)
  return out


def model_and_data_sizes(config):
  """(|w|, C, values per image) of the config's model and dataset, for the paper's formulas."""
  from jfed.data import load_dataset
  from jfed.methods.common import build_module
  from jfed.models.registry import param_count

  ds = load_dataset(config.dataset.name, config.dataset.get('data_dir') or None)
  module = build_module(config.model, ds)
  shapes = jax.eval_shape(
    lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, *ds.input_shape)), train=False)
  )
  return param_count(shapes['params']), ds.num_classes, int(np.prod(ds.input_shape))


def paper_setting(method: str, extras: Dict[str, Any]) -> Dict[str, Any]:
  """What the paper's formula needs from a run beyond its config: |H| and the clusters."""
  if method == 'hfldd' and 'heads' in extras:
    return {
      'heads': len(extras['heads']),
      'cluster_clients': sum(len(c) for c in extras['clusters']),
    }
  if method == 'fedseq' and 'superclients' in extras:
    return {'superclient_sizes': [len(c) for c in extras['superclients']]}
  return {}


def paper_formulas(
  config, results: Dict[str, Dict[str, Any]], num_params: int, num_classes: int, values: int
) -> Dict[str, Callable[[int], int]]:
  """Per method, rounds -> bits of HFLDD's traffic formula (Shi et al., arXiv 2409.17517) with
  this run's settings."""
  from jfed.io import comm

  def bind(fn, **kw):
    return lambda rounds: fn(rounds=rounds, **kw)

  n = config.partition.num_clients
  out = {}
  for m, r in results.items():
    setting = r.get('paper_setting') or {}
    if m in ('fedavg', 'fedprox', 'dynafed'):
      # the methods' own rule for the clients of a round (common.select_clients)
      per_round = max(1, int(round(config[m].participation * n)))
      out[m] = bind(comm.fedavg_cost_bits, num_clients=per_round, num_params=num_params)
    elif m == 'hfldd' and setting:
      members = setting['cluster_clients'] - setting['heads']
      out[m] = bind(
        comm.hfldd_cost_bits,
        num_clients=n,
        n_public=config.hfldd.public_size,
        num_classes=num_classes,
        distilled_sizes=[config.hfldd.kip.support_size] * members,
        sample_bits=comm.VALUE_BITS * values,
        num_heads=setting['heads'],
        num_params=num_params,
      )
    elif m == 'fedseq' and setting and config.fedseq.participation == 1.0:
      out[m] = bind(
        comm.fedseq_cost_bits,
        cluster_sizes=setting['superclient_sizes'],
        num_params=num_params,
      )
  return out


def budget_lines(config) -> List[str]:
  c = config
  h, s, d = c.hfldd, c.fedseq, c.dynafed
  return [
    f'- data: {c.dataset.name}, {c.partition.num_clients} clients, partition '
    f'{c.partition.scheme}'
    + (f' (#C={c.partition.k})' if c.partition.scheme == 'shards' else '')
    + f', model {c.model}, optimiser {c.optimizer.name} '
    f'lr {c.optimizer.lr}, batch {c.batch_size}',
    f'- HFLDD: {h.rounds} rounds x {h.local_epochs} local epochs over the heads, pre-training '
    f'{h.pretrain_epochs} epochs, public {h.public} ({h.public_size}), K={h.K}, KIP '
    f'{h.kip.support_size} images/member x {h.kip.iterations} iterations (lr {h.kip.lr}, '
    f'target batch {h.kip.target_batch}, {h.kip.kernel}), images sent as {h.image_dtype}',
    f'- FedAvg: {c.fedavg.rounds} x {c.fedavg.local_epochs}; FedProx: {c.fedprox.rounds} x '
    f'{c.fedprox.local_epochs} (mu {c.fedprox.mu}); FedSeq: {s.rounds} x {s.local_epochs} '
    f'(pre-training {s.pretrain_epochs} epochs, min_examples {s.min_examples}, max_clients '
    f'{s.max_clients})',
    f'- DynaFed: {d.rounds} x {d.local_epochs}, participation {d.participation}, clients '
    + (f'{d.client_optimizer} lr {d.client_lr}' if d.client_optimizer else 'as above')
    + f', trajectory {d.trajectory_rounds} rounds, ipc {d.ipc}, syn_steps {d.syn_steps}, '
    f'expert_epochs {d.expert_epochs}, {d.iterations} matching iterations, '
    f'{d.finetune_epochs} fine-tuning epochs, DSA {d.dsa or "none"}',
    f'- centralized: {c.centralized.epochs} epochs',
  ]


def finished(results: Dict[str, Dict[str, Any]], method: str) -> List[Dict[str, Any]]:
  """`method`'s records of the seeds where it finished."""
  return [r[method] for r in results.values() if method in r and not is_error(r[method])]


def cell(accuracies: Sequence[float]) -> str:
  """'mean ± std' in % with the number of seeds; '—' for none."""
  return f'{mean_std(accuracies)} (n={len(accuracies)})' if accuracies else '—'


def seed_target_table(per_seed: Dict[str, list], methods: List[str], target: float) -> str:
  """Tables III-V over seeds: per method, how many seeds reached the target and, over those,
  the mean ± std of each of the seed's cells (the ratio: over the seeds where both it and the
  reference reached the target)."""
  from jfed.io.comm import MIB  # pylint: disable=g-import-not-at-top

  rows = {m: [row for rs in per_seed.values() for row in rs if row.method == m] for m in methods}
  reached = {m: [row for row in rows[m] if row.rounds is not None] for m in methods}

  def line(name: str, get: Callable, scale: float, digits: int, unit: str = '') -> str:
    cells = []
    for m in methods:
      values = [v for v in (get(row) for row in reached[m]) if v is not None]
      cells.append('—' if not values else f'{mean_std(values, scale, digits)}{unit}')
    return f'| {name} | ' + ' | '.join(cells) + ' |'

  lines = [
    f'Accuracy={100 * target:g}%',
    '| Metrics | ' + ' | '.join(methods) + ' |',
    '|---|' + '---|' * len(methods),
    '| seeds reaching it | '
    + ' | '.join(f'{len(reached[m])}/{len(rows[m])}' for m in methods)
    + ' |',
    line('rounds', lambda r: r.rounds, 1.0, 1),
    line('accuracy at that round', lambda r: r.accuracy, 100.0, 2, '%'),
    line('Traffic, measured (MiB)', lambda r: r.traffic_bytes, 1 / MIB, 1),
  ]
  with_paper = any(row.paper_bits is not None for rs in reached.values() for row in rs)
  if with_paper:
    lines.append(line('Traffic, paper formula (MiB)', lambda r: r.paper_mib, 1.0, 1))
  lines.append(line('Ratio, measured', lambda r: r.ratio, 1.0, 1, 'X'))
  if with_paper:
    lines.append(line('Ratio, paper formula', lambda r: r.paper_ratio, 1.0, 1, 'X'))
  return '\n'.join(lines)


def label(method: str, record: Dict[str, Any]) -> str:
  return method if record['step_name'] == 'round' else f'{method} (per {record["step_name"]})'


def write_figures(out: pathlib.Path, results, methods: List[str], title: str) -> None:
  from jfed.io.comm import MIB  # pylint: disable=g-import-not-at-top

  accuracy, traffic = {}, {}
  for m in methods:
    runs = finished(results, m)
    if not runs:
      continue
    curves = [(r['steps'], r['accuracy']) for r in runs]
    accuracy[f'{label(m, runs[0])} (n={len(runs)})'] = curve_stats(curves)
    with_bytes = [r for r in runs if r['cumulative_bytes']]
    if with_bytes:
      _, mib, _ = curve_stats(
        [(r['steps'], r['cumulative_bytes']) for r in with_bytes], scale=1 / MIB
      )
      _, mean, std = curve_stats([(r['steps'], r['accuracy']) for r in with_bytes])
      traffic[f'{m} (n={len(with_bytes)})'] = (mib, mean, std)
  subtitle = f'{title}: mean ± std over seeds'
  if accuracy:
    plot_bands(out / 'accuracy.png', accuracy, 'round', 'test accuracy (%)', subtitle)
  if traffic:
    plot_bands(
      out / 'traffic.png',
      traffic,
      'cumulative measured traffic (MiB, mean over seeds)',
      'test accuracy (%)',
      subtitle,
      integer_x=False,
    )


def run_compare(
  config,
  out: pathlib.Path,
  methods: Sequence[str],
  targets: Sequence[float],
  reference: str = 'hfldd',
  seeds: Sequence[int] = (0, 1, 2),
  merge: Sequence[str] = (),
) -> str:
  """Runs every (seed, method) not finished yet and writes the figures, results.md and
  results.json over the seeds (after each seed, so that a long sweep shows its progress);
  returns results.md's text. `merge`: OUTs of the same config holding other seeds (their
  results.json; e.g. seeds run in another session or on another machine), whose seeds join the
  tables; a seed run here replaces a merged one."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.io.comm import MIB, target_table_rows  # pylint: disable=g-import-not-at-top
  from jfed.workdir import atomic_write_text, write_json  # pylint: disable=g-import-not-at-top

  methods, seeds = list(methods), [int(s) for s in seeds]
  out.mkdir(parents=True, exist_ok=True)
  results: Dict[str, Dict[str, Dict[str, Any]]] = {}
  formulas: Dict[str, Dict[str, Callable[[int], int]]] = {}
  sizes = []
  title = (
    f'{config.dataset.name}, {config.partition.num_clients} clients, '
    f'{config.partition.scheme}'
    + (f' #C={config.partition.k}' if config.partition.scheme == 'shards' else '')
  )

  def merge_seeds() -> None:
    from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

    mine = json.loads(config.to_json_best_effort())
    mine.pop('seed', None)
    for d in merge:
      path = pathlib.Path(d) / 'results.json'
      if not path.exists():
        raise ConfigError(f'--merge: {path} does not exist')
      other = json.loads(path.read_text())
      theirs = dict(other.get('config') or {})
      theirs.pop('seed', None)
      if theirs != mine:
        raise ConfigError(f'--merge: {path} was run with another config; merge only the same one')
      for seed, runs in other['runs'].items():
        if int(seed) in seeds:
          continue
        if seed in results:
          raise ConfigError(f'--merge: seed {seed} is in two of the merged OUTs')
        results[seed] = runs
        ok = {m: r for m, r in runs.items() if not is_error(r)}
        if ok and not sizes:
          sizes.extend(model_and_data_sizes(config))
        formulas[seed] = paper_formulas(config, ok, *sizes) if ok else {}

  def run_seed(seed: int) -> None:
    c = config.copy_and_resolve_references()
    c.seed = seed
    mine = results[str(seed)] = {}
    for method in methods:
      workdir = out / f'seed{seed}' / method
      print(f'=== seed {seed} / {method} -> {workdir}', flush=True)
      try:
        summary = run_experiment(method, c, workdir)
      except Exception as e:  # pylint: disable=broad-except  # one failure must not lose the rest
        traceback.print_exc()
        mine[method] = error_record(e)
        continue
      records = [
        json.loads(line)
        for line in (workdir / 'metrics.jsonl').read_text().splitlines()
        if line.strip()
      ]
      steps, accs, cum = method_curve(records)
      mine[method] = {
        'steps': steps,
        'accuracy': accs,
        'cumulative_bytes': cum,
        'final_test_accuracy': summary.final_test_accuracy,
        'best_test_accuracy': summary.best_test_accuracy,
        'best_step': summary.best_step,
        'step_name': summary.step_name,
        'total_bytes': summary.total_bytes,
        'eval_samples': summary.extras.get('eval_samples'),
        'paper_setting': paper_setting(method, summary.extras),
        'seconds': summary.seconds,
      }
    ok = {m: r for m, r in mine.items() if not is_error(r)}
    formulas[str(seed)] = {}
    try:  # the paper-formula column must not lose the hours of measured results above
      if ok and not sizes:
        sizes.extend(model_and_data_sizes(c))
      formulas[str(seed)] = paper_formulas(c, ok, *sizes) if ok else {}
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
    for m, fn in formulas[str(seed)].items():
      if ok[m]['step_name'] == 'round':
        ok[m]['paper_formula_bits'] = fn(len(ok[m]['steps']))

  def write() -> str:
    write_figures(out, results, methods, title)
    n = len(results)
    lines = [
      f'# HFLDD comparison: {title}',
      '',
      f'Backend {jax.default_backend()} ({jax.devices()[0].device_kind}), '
      f'jax {jax.__version__}; seeds {sorted(int(s) for s in results)} (each draws the '
      'partition, the public set and every initialisation). Budget:',
      *budget_lines(config),
      '',
      'Accuracy: mean ± sample std over the seeds where the run finished (n). Which one the '
      'paper shows: HFLDD (Shi et al., arXiv 2409.17517) Fig. 3 plots the test accuracy per '
      'round and §VI-B quotes the '
      'last round\'s ("74.0% after 300 communication rounds", "final test accuracies"), i.e. '
      '**the final column** and the curves of accuracy.png; the paper reports no best-round '
      'accuracy (ours: the best round on the test images). Its Tables III-V give the first '
      'round whose accuracy reaches a target (the tables below).',
      '',
      "| method | final accuracy (%, the paper's) | best accuracy (%) | steps | traffic, "
      'measured (MiB) | traffic, paper formula (MiB) | eval samples | seconds |',
      '|---|---|---|---|---|---|---|---|',
    ]
    for m in methods:
      runs = finished(results, m)
      errors = [r[m]['error'] for r in results.values() if is_error(r.get(m))]
      failed = f'failed in {len(errors)} of {n} seeds: {errors[0]}' if errors else ''
      if not runs:
        lines.append(f'| {m} | {failed or "—"} | | | | | | |')
        continue
      measured = [r['total_bytes'] for r in runs if r['total_bytes'] is not None]
      paper = [r['paper_formula_bits'] / 8 for r in runs if r.get('paper_formula_bits')]
      seconds = [r['seconds'] for r in runs if r['seconds'] is not None]
      lines.append(
        f'| {m} | {cell([r["final_test_accuracy"] for r in runs])}'
        + (f'; {failed}' if failed else '')
        + f' | {cell([r["best_test_accuracy"] for r in runs])} | {len(runs[0]["steps"])} '
        f'{runs[0]["step_name"]}s | {mean_std(measured, 1 / MIB, 1) or "—"} | '
        f'{mean_std(paper, 1 / MIB, 1) or "—"} | {runs[0]["eval_samples"] or "?"} | '
        f'{np.mean(seconds):.0f} |'
      )
    tables = {}
    per_target = {}
    for target in targets:
      per_seed = {}
      for seed, mine in results.items():
        table_methods = [
          (m, r['accuracy'], round_transfers(r['cumulative_bytes']))
          for m, r in mine.items()
          if not is_error(r) and r['cumulative_bytes']
        ]
        ref = reference if any(m == reference for m, _, _ in table_methods) else None
        per_seed[seed] = target_table_rows(
          table_methods, target, reference=ref, paper_bits=formulas.get(seed, {})
        )
      tables[str(target)] = {s: [row._asdict() for row in rs] for s, rs in per_seed.items()}
      per_target[target] = per_seed
    table_methods = [m for m in methods if any(r['cumulative_bytes'] for r in finished(results, m))]
    if table_methods:
      lines += [
        '',
        '## Rounds and traffic to reach a target accuracy '
        '(HFLDD, Shi et al., arXiv 2409.17517, Tables III-V layout)',
        '',
        'Per seed, the first round whose test accuracy reaches the target and the traffic up to '
        'it; each cell the mean ± std over the seeds that reached it ("seeds reaching it"); the '
        'ratio over the seeds where the method and the reference '
        f'({reference if reference in table_methods else table_methods[0]}) both reached it. '
        'Traffic in MiB: measured = serialised bytes, setup stages included; paper formula = '
        "jfed.io.comm.*_cost_bits with each seed's settings. Per-seed tables: results.json.",
        '',
      ]
      for target, per_seed in per_target.items():
        lines += [seed_target_table(per_seed, table_methods, target), '']
    text = '\n'.join(lines) + '\n'
    atomic_write_text(out / 'results.md', text)
    write_json(
      out / 'results.json',
      {
        'config': json.loads(config.to_json_best_effort()),
        'seeds': sorted(int(s) for s in results),
        'runs': results,
        'target_tables': tables,
      },
    )
    return text

  merge_seeds()
  text = write() if results else ''
  for seed in seeds:
    run_seed(seed)
    text = write()
  return text


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  out = pathlib.Path(FLAGS.out)
  print(
    run_compare(
      FLAGS.config,
      out,
      FLAGS.methods,
      [float(t) for t in FLAGS.targets],
      FLAGS.reference,
      [int(s) for s in FLAGS.seeds],
      FLAGS.merge,
    )
  )
  print(f'\noutputs in {out}')


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
