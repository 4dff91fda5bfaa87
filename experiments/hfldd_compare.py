"""HFLDD against its baselines on one config: accuracy-vs-round figure and the seed's
Tables III-V (rounds and traffic to reach a target accuracy).

  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_fashion_mnist.py:c1 \
      --out=runs/hfldd_compare_c1 [--methods=hfldd,fedavg,fedprox,fedseq,dynafed,centralized] \
      [--targets=0.6,0.7,0.8]

Each method runs through `jfed.driver.run_experiment` into OUT/<method> (so each one resumes
from its checkpoints when the command is repeated, and can be inspected on its own). Then OUT
gets:
- accuracy.png: test accuracy per round, every method (centralized: per epoch);
- traffic.png: test accuracy against cumulative measured traffic (MiB, setup stages included);
- results.md: the budget, a summary table (final/best accuracy, traffic, time) and, per target
  accuracy, the Tables III-V layout (rounds/accuracy, traffic, ratio vs HFLDD) built with
  `jfed.io.comm.target_table_rows` from each method's measured cumulative bytes;
- results.json: the same numbers.
Traffic is reported twice, in MiB (2^20 bytes, the unit that reproduces the seed's tables):
measured = the serialised bytes of every transfer (the primary account); paper formula =
`jfed.io.comm.*_cost_bits` with this run's N, |H|, clusters and |w|, the count that reproduces
Tables III-V (it adds one model copy per client or head, counts no labels or msgpack framing,
and counts FedSeq as 110 + 120 T copies at 10 x 10; see jfed/io/comm.py).
Centralized training has no communication and is left out of the target tables.
"""

import json
import pathlib
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file (get_config(arg)).', lock_config=True
)
flags.DEFINE_string('out', None, 'Output directory; each method runs in OUT/<method>.')
flags.DEFINE_list(
  'methods',
  ['hfldd', 'fedavg', 'fedprox', 'fedseq', 'dynafed', 'centralized'],
  'Methods to run, in this order.',
)
flags.DEFINE_list('targets', ['0.6', '0.7', '0.8'], 'Target test accuracies for the tables.')
flags.DEFINE_string('reference', 'hfldd', 'Method whose traffic is 1X in the tables.')
flags.mark_flags_as_required(['config', 'out'])


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
  """Per method, rounds -> bits of seed 003's traffic formula with this run's settings."""
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
    f'lr {c.optimizer.lr}, batch {c.batch_size}, seed {c.seed}',
    f'- HFLDD: {h.rounds} rounds x {h.local_epochs} local epochs over the heads, pre-training '
    f'{h.pretrain_epochs} epochs, public {h.public} ({h.public_size}), K={h.K}, KIP '
    f'{h.kip.support_size} images/member x {h.kip.iterations} iterations (lr {h.kip.lr}, '
    f'target batch {h.kip.target_batch}, {h.kip.kernel}), images sent as {h.image_dtype}',
    f'- FedAvg: {c.fedavg.rounds} x {c.fedavg.local_epochs}; FedProx: {c.fedprox.rounds} x '
    f'{c.fedprox.local_epochs} (mu {c.fedprox.mu}); FedSeq: {s.rounds} x {s.local_epochs} '
    f'(pre-training {s.pretrain_epochs} epochs, min_examples {s.min_examples}, max_clients '
    f'{s.max_clients})',
    f'- DynaFed: {d.rounds} x {d.local_epochs}, trajectory {d.trajectory_rounds} rounds, '
    f'ipc {d.ipc}, syn_steps {d.syn_steps}, expert_epochs {d.expert_epochs}, '
    f'{d.iterations} matching iterations, {d.finetune_epochs} fine-tuning epochs',
    f'- centralized: {c.centralized.epochs} epochs',
  ]


def _fmt_acc(a: Optional[float]) -> str:
  return '—' if a is None else f'{100 * a:.2f}%'


def main(argv):
  del argv
  from jfed.driver import run_experiment
  from jfed.io.comm import MIB, bits_to_mib, format_target_table, target_table_rows
  from jfed.reporting import plot_curves
  from jfed.workdir import write_json

  logging.set_verbosity(logging.WARNING)
  config = FLAGS.config
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  results: Dict[str, Dict[str, Any]] = {}
  for method in FLAGS.methods:
    print(f'=== {method} ===', flush=True)
    t0 = time.perf_counter()
    try:
      summary = run_experiment(method, config, out / method)
    except Exception as e:  # one failing method must not lose the others' results
      traceback.print_exc()
      results[method] = {'error': f'{type(e).__name__}: {e}'}
      continue
    records = [
      json.loads(l) for l in (out / method / 'metrics.jsonl').read_text().splitlines() if l.strip()
    ]
    steps, accs, cum = method_curve(records)
    results[method] = {
      'steps': steps,
      'accuracy': accs,
      'cumulative_bytes': cum,
      'final_test_accuracy': summary.final_test_accuracy,
      'best_test_accuracy': summary.best_test_accuracy,
      'step_name': summary.step_name,
      'total_bytes': summary.total_bytes,
      'eval_samples': summary.extras.get('eval_samples'),
      'paper_setting': paper_setting(method, summary.extras),
      'seconds': time.perf_counter() - t0,
    }

  ok = {m: r for m, r in results.items() if 'error' not in r}
  formulas = {}
  try:  # the paper-formula column must not lose the hours of measured results above
    formulas = paper_formulas(config, ok, *model_and_data_sizes(config)) if ok else {}
  except Exception:
    traceback.print_exc()
  for m, fn in formulas.items():
    if ok[m]['step_name'] == 'round':
      ok[m]['paper_formula_bits'] = fn(len(ok[m]['steps']))
  title = (
    f'{config.dataset.name}, {config.partition.num_clients} clients, '
    f'{config.partition.scheme}'
    + (f' #C={config.partition.k}' if config.partition.scheme == 'shards' else '')
  )
  if ok:
    plot_curves(
      out / 'accuracy.png',
      {
        (m if r['step_name'] == 'round' else f'{m} (per {r["step_name"]})'): r['accuracy']
        for m, r in ok.items()
      },
      xlabel='round',
      ylabel='test accuracy',
      title=title,
      x={
        (m if r['step_name'] == 'round' else f'{m} (per {r["step_name"]})'): r['steps']
        for m, r in ok.items()
      },
    )
    comm_ok = {m: r for m, r in ok.items() if r['cumulative_bytes']}
    if comm_ok:
      plot_curves(
        out / 'traffic.png',
        {m: r['accuracy'] for m, r in comm_ok.items()},
        xlabel='cumulative measured traffic (MiB)',
        ylabel='test accuracy',
        title=title,
        x={m: [b / MIB for b in r['cumulative_bytes']] for m, r in comm_ok.items()},
      )

  lines = [
    f'# HFLDD comparison: {title}',
    '',
    f'Backend {jax.default_backend()} ({jax.devices()[0].device_kind}), '
    f'jax {jax.__version__}. Budget:',
    *budget_lines(config),
    '',
    '| method | final accuracy | best accuracy | steps | traffic, measured (MiB) | '
    'traffic, paper formula (MiB) | eval samples | seconds |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for m, r in results.items():
    if 'error' in r:
      lines.append(f'| {m} | failed: {r["error"]} | | | | | | |')
      continue
    mib = '—' if r['total_bytes'] is None else f'{r["total_bytes"] / MIB:.1f}'
    paper = r.get('paper_formula_bits')
    paper = '—' if paper is None else f'{bits_to_mib(paper):.1f}'
    lines.append(
      f'| {m} | {_fmt_acc(r["final_test_accuracy"])} | '
      f'{_fmt_acc(r["best_test_accuracy"])} | {len(r["steps"])} {r["step_name"]}s '
      f'| {mib} | {paper} | {r["eval_samples"] or "all"} | {r["seconds"]:.0f} |'
    )
  table_methods = [
    (m, r['accuracy'], round_transfers(r['cumulative_bytes']))
    for m, r in ok.items()
    if r['cumulative_bytes']
  ]
  tables = {}
  if table_methods:
    reference = FLAGS.reference if any(m == FLAGS.reference for m, _, _ in table_methods) else None
    lines += [
      '',
      '## Rounds and traffic to reach a target accuracy (seed 003, Tables III-V '
      'layout; traffic in MiB: measured = serialised bytes, setup stages included; paper '
      "formula = jfed.io.comm.*_cost_bits with this run's settings; ratio vs "
      f'{reference or table_methods[0][0]})',
      '',
    ]
    for target in (float(t) for t in FLAGS.targets):
      rows = target_table_rows(table_methods, target, reference=reference, paper_bits=formulas)
      tables[str(target)] = [row._asdict() for row in rows]
      lines += [format_target_table(rows), '']
  (out / 'results.md').write_text('\n'.join(lines) + '\n')
  write_json(
    out / 'results.json',
    {
      'config': json.loads(config.to_json_best_effort()),
      'methods': results,
      'target_tables': tables,
    },
  )
  print('\n'.join(lines))
  print(f'\noutputs in {out}')


if __name__ == '__main__':
  app.run(main)
