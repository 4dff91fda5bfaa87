"""HFLDD against its baselines on one config over seeds: accuracy-vs-round figure, a summary
table and the seed's Tables III-V (rounds and traffic to reach a target accuracy).

  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_fashion_mnist.py:c1 \
      --out=runs/hfldd_compare_c1 [--methods=hfldd,fedavg,fedprox,fedseq,dynafed,centralized] \
      [--targets=0.6,0.7,0.8] [--seeds=0,1,2] [--merge=OTHER_OUT,...]

A comparison is one cell of a sweep (experiments/sweep.py): each (seed, method) runs through
`jfed.driver.run_experiment` with `config.seed` = the seed (which draws the partition, the public
set and every initialisation) into OUT/seed<s>/<method>/, where it can be inspected on its own;
when the command is repeated a finished run is skipped, a failed one runs again and an
interrupted one resumes from its checkpoints. After each run OUT gets, over the seeds whose run
finished (n in each cell):
- accuracy.png: test accuracy per round, every method (centralized: per epoch), the mean over
  the seeds with a ± std band;
- traffic.png: the mean test accuracy per round against the mean cumulative measured traffic
  (MiB, setup stages included) at that round, with a ± std band of the accuracy;
- results.md: the budget, a summary table (mean ± std of the final and of the best accuracy,
  traffic, time) and, per target accuracy, the Tables III-V layout (rounds/accuracy, traffic,
  ratio vs HFLDD): each seed's table built with `jfed.io.comm.target_table_rows` from its
  methods' measured cumulative bytes, then every cell as the mean ± std over the seeds that
  reached the target, with how many did;
- results.json: the sweep's layout, {meta: the config, the seeds, the machine; results:
  {'compare': {seed: {method: record}}}} (each record stamped with the backend it ran on), and
  target_tables: the per-seed target tables.
`--merge` adds the runs of other OUTs of the same config (their results.json, e.g. seeds or
methods run in another session or on another machine). `--seeds=` with nothing runs none and only
re-renders; without --config it renders with the config the results were run with (the config
files may have changed since), so `--out=NEW --seeds= --merge=docs/results/hfldd_compare_...`
re-renders a committed comparison. An OUT written before the sweep layout (results.json of
{config, seeds, runs, target_tables}) is read as before, its runs stamped with the backend its
results.md names, and rewritten in the sweep layout at its next save.
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
import re
import traceback
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import sweep
from experiments.seed_tables import (
  backend_line,
  curve_stats,
  last_fifth_rise,
  mean_std,
  ordering_verdict,
  plot_bands,
)
from experiments.sweep import is_error

FLAGS = flags.FLAGS

CELL = 'compare'  # the sweep's one cell: every seed x method runs on the same config
# The machine sentence the layout before the sweep's wrote in results.md (it kept none in JSON).
OLD_BACKEND = re.compile(r'^Backend (\S+) \(([^)]*)\), jax ([^;\s]+);', re.MULTILINE)


def define_flags() -> None:
  """Defined only when run as a command, so that importing the module (tests) does not clash
  with the flags of the other comparison commands."""
  # --out (each run in OUT/seed<s>/<method>), --seeds, --merge (OUTs of the same config with
  # other runs), --config
  sweep.define_flags(
    None,
    config='Experiment config file (FILE or FILE:arg for get_config(arg)); not needed with '
    '--seeds= (render only), which uses the config the results were run with.',
    config_required=False,
  )
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
  from jfed.api import load_run_dataset
  from jfed.methods.common import build_module
  from jfed.models.registry import param_count

  ds = load_run_dataset(config)
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


class Claim(NamedTuple):
  """One statement of HFLDD's §VI-B/§VI-C about two methods on MNIST."""

  better: str
  worse: str
  # 'accuracy': `better`'s final accuracy is above `worse`'s; 'similar': their final accuracies
  # are alike; 'traffic': `better` reaches each target accuracy with less traffic
  kind: str
  source: str


# What the paper says of MNIST (HFLDD, Shi et al., arXiv 2409.17517), by #C (classes per client;
# 10 is its IID setting). #C=1: "HFLDD outperforms FedAvg, FedSeq, and DynaFed on all datasets",
# but "on MNIST ... the final accuracy of HFLDD is similar to that of FedSeq ... DynaFed also
# achieves a similar final accuracy"; FedProx is below HFLDD by 47.7 and 30.4 points on CIFAR10
# and CINIC10. #C=2: "HFLDD, FedSeq, and DynaFed achieve nearly identical training results, and
# all outperform FedAvg and FedProx"; Fig. 6: "HFLDD consistently maintains the lowest
# communication cost". IID: "all methods achieve nearly identical test accuracies"; Table III
# (80 %): HFLDD's traffic below FedAvg's, FedProx's and DynaFed's, FedSeq's below HFLDD's.
_SEC_B1, _FIG6, _TAB3 = '§VI-B1, Fig. 3', '§VI-C, Fig. 6', '§VI-C, Table III'
MNIST_CLAIMS: Dict[int, Tuple[Claim, ...]] = {
  1: (
    Claim('hfldd', 'fedavg', 'accuracy', _SEC_B1 + 'a'),
    Claim('hfldd', 'fedprox', 'accuracy', _SEC_B1 + 'a, d, g'),
    Claim('hfldd', 'fedseq', 'similar', _SEC_B1 + 'a'),
    Claim('hfldd', 'dynafed', 'similar', _SEC_B1 + 'a'),
  ),
  2: (
    *(Claim('hfldd', m, 'similar', _SEC_B1 + 'b') for m in ('fedseq', 'dynafed')),
    *(
      Claim(a, b, 'accuracy', _SEC_B1 + 'b')
      for a in ('hfldd', 'fedseq', 'dynafed')
      for b in ('fedavg', 'fedprox')
    ),
    *(Claim('hfldd', m, 'traffic', _FIG6) for m in ('fedavg', 'fedprox', 'fedseq', 'dynafed')),
  ),
  10: (
    *(
      Claim('hfldd', m, 'similar', _SEC_B1 + 'c')
      for m in ('fedavg', 'fedprox', 'fedseq', 'dynafed')
    ),
    *(Claim('hfldd', m, 'traffic', _TAB3) for m in ('fedavg', 'fedprox', 'dynafed')),
    Claim('fedseq', 'hfldd', 'traffic', _TAB3),
  ),
}


def classes_per_client(config) -> Optional[int]:
  """#C of a NIID-Bench shards partition (10: IID); None for another partition."""
  return int(config.partition.k) if config.partition.scheme == 'shards' else None


def claim_verdict(claim: Claim, results, target: Optional[float] = None) -> Tuple[str, str, int]:
  """(what our seeds show, verdict, seeds) for one claim, over the seeds where both ran.

  Accuracy claims take `seed_tables.ordering_verdict` (a paired two-sided t-test at 5 %);
  a 'similar' claim holds when that test cannot tell the two apart. A traffic claim compares,
  per seed, the measured traffic up to the first round at `target` (never reaching it counts as
  more traffic than any): it holds when `better` needs less in every seed where either reaches
  the target, fails when it needs more in every such seed, and is mixed otherwise.
  """
  pairs = [
    (r[claim.better], r[claim.worse])
    for _, r in sorted(results.items())
    if not is_error(r.get(claim.better, {'error': ''}))
    and not is_error(r.get(claim.worse, {'error': ''}))
  ]
  if not pairs:
    return '—', 'not run', 0
  if claim.kind == 'traffic':
    from jfed.io.comm import MIB, rounds_to_target  # pylint: disable=g-import-not-at-top

    def traffic(r) -> float:
      k = rounds_to_target(r['accuracy'], target)
      return float('inf') if k is None else r['cumulative_bytes'][k - 1] / MIB

    values = [(traffic(a), traffic(b)) for a, b in pairs]
    informative = [(a, b) for a, b in values if a != b]
    shown = '; '.join(
      ' vs '.join('never' if v == float('inf') else f'{v:.1f}' for v in ab) for ab in values
    )
    wins = sum(a < b for a, b in informative)
    if not informative:
      verdict = 'neither reaches it' if all(a == float('inf') for a, _ in values) else 'tied'
    elif wins == len(informative):
      verdict = 'holds'
    elif wins == 0:
      verdict = 'fails'
    else:
      verdict = f'mixed ({wins} of {len(informative)} seeds)'
    return f'MiB per seed: {shown}', verdict, len(pairs)
  a = [x['final_test_accuracy'] for x, _ in pairs]
  b = [y['final_test_accuracy'] for _, y in pairs]
  verdict, p = ordering_verdict(a, b)
  shown = f'{100 * np.mean(a):.2f} vs {100 * np.mean(b):.2f}' + ('' if p != p else f' (p {p:.3f})')
  if claim.kind == 'similar' and verdict != 'too few seeds':
    higher = claim.better if np.mean(a) > np.mean(b) else claim.worse
    verdict = 'holds (within noise)' if verdict == 'within noise' else f'fails ({higher} higher)'
  return shown, verdict, len(pairs)


def budget_evidence_lines(results, methods: Sequence[str]) -> List[str]:
  """Whether the budget lets the mechanisms work: each method's accuracy gain over the last
  fifth of its rounds (a curve still rising has not reached its plateau) and HFLDD's cluster
  coverage (every heterogeneous cluster should hold every class)."""
  lines = [
    '',
    '## Is the budget enough?',
    '',
    'Rise of the last fifth: the mean accuracy over the last fifth of the rounds (epochs for '
    'centralized) minus the mean over the fifth before it, mean ± std over the seeds, in points. '
    'A curve on its plateau rises by about 0; one still climbing by several points has not '
    'reached it, and its method is not yet compared at its best.',
    '',
    '| method | rise of the last fifth (points) | final (%) |',
    '|---|---|---|',
  ]
  for m in methods:
    runs = [r for r in finished(results, m) if len(r['accuracy']) >= 5]
    if not runs:
      continue
    gains = [last_fifth_rise(r['accuracy']) for r in runs]
    lines.append(
      f'| {m} | {mean_std(gains, 100.0, 2)} | {cell([r["final_test_accuracy"] for r in runs])} |'
    )
  coverage = [
    min(r['cluster_label_coverage'])
    for r in finished(results, 'hfldd')
    if r.get('cluster_label_coverage')
  ]
  if coverage:
    lines += [
      '',
      "HFLDD's clusters: the least-covered heterogeneous cluster holds "
      f'{", ".join(str(c) for c in coverage)} classes (per seed).',
    ]
  return lines


def claim_lines(config, results, targets: Sequence[float]) -> List[str]:
  """The section that checks each of the paper's MNIST statements for this #C."""
  k = classes_per_client(config)
  claims = MNIST_CLAIMS.get(k, ())
  if not claims:
    return []
  lines = [
    '',
    f"## The paper's MNIST statements at #C={k}, checked",
    '',
    'HFLDD (Shi et al., arXiv 2409.17517) states these for MNIST; ours are on this config. '
    "Accuracy: the final round's, a paired two-sided t-test over the seeds at 5 % (holds / "
    'fails / within noise; "similar" holds when the test cannot tell the two apart). Traffic: '
    'measured MiB up to the first round at the target, per seed (never reaching it counts as '
    'more than any).',
    '',
    '| paper says | where | ours | seeds | verdict |',
    '|---|---|---|---:|---|',
  ]
  sign = {'accuracy': '>', 'similar': '≈', 'traffic': 'less traffic than'}
  for claim in claims:
    for target in targets if claim.kind == 'traffic' else (None,):
      shown, verdict, n = claim_verdict(claim, results, target)
      at = f' to {100 * target:g} %' if target is not None else ''
      lines.append(
        f'| {claim.better} {sign[claim.kind]} {claim.worse}{at} | {claim.source} | {shown} | '
        f'{n} | {verdict} |'
      )
  return lines


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


def title_of(config) -> str:
  p = config.partition
  return f'{config.dataset.name}, {p.num_clients} clients, {p.scheme}' + (
    f' #C={p.k}' if p.scheme == 'shards' else ''
  )


def config_json(config) -> Dict[str, Any]:
  return json.loads(config.to_json_best_effort())


def upgrade_layout(saved: Dict[str, Any], path: pathlib.Path) -> Dict[str, Any]:
  """`saved` (a results.json at `path`) in the sweep layout. The layout before the sweep's,
  {config, seeds, runs, target_tables}, kept no machine in JSON: its runs are stamped with the
  one its results.md's backend sentence names ('?' without one)."""
  if 'results' in saved or 'runs' not in saved:
    return saved
  meta = {'config': saved.get('config'), 'seeds': saved.get('seeds', [])}
  md = path.parent / 'results.md'
  found = OLD_BACKEND.search(md.read_text()) if md.exists() else None
  if found:
    meta.update(backend=found[1], device_kind=found[2], jax_version=found[3])
  return {'meta': meta, 'results': {CELL: saved['runs']}}


def without_seed(config: Dict[str, Any]) -> Dict[str, Any]:
  return {k: v for k, v in (config or {}).items() if k != 'seed'}


def results_reader(
  config, out: pathlib.Path, read_configs: List[Dict[str, Any]]
) -> Callable[[pathlib.Path], Dict[str, Any]]:
  """`sweep.Sweep.open`'s `read`: a results.json in the sweep layout (`upgrade_layout`).

  Args:
    config: the comparison's config; a file run with another (its seed aside) is refused. None:
      the first file read sets it.
    out: the comparison's OUT (its own results.json is refused with another message).
    read_configs: each file's config is appended to it.

  Returns:
    read(path) -> the file's {meta, results}.
  """
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  def read(path: pathlib.Path) -> Dict[str, Any]:
    saved = upgrade_layout(json.loads(path.read_text()), path)
    theirs = saved['meta'].get('config') or {}
    mine = config_json(config) if config is not None else (read_configs or [theirs])[0]
    if without_seed(theirs) != without_seed(mine):
      if path == out / 'results.json':
        raise ConfigError(f'{path} was run with another config; use a new --out')
      raise ConfigError(f'--merge: {path} was run with another config; merge only the same one')
    read_configs.append(theirs)
    return saved

  return read


def run_record(method: str, summary, workdir: pathlib.Path) -> sweep.Record:
  """A finished run's record.

  Args:
    method: the run's method.
    summary: its `jfed.api.RunSummary`.
    workdir: its workdir (metrics.jsonl).

  Returns:
    Its test accuracy per step, the cumulative bytes and the summary numbers the tables read.
  """
  records = [
    json.loads(line)
    for line in (workdir / 'metrics.jsonl').read_text().splitlines()
    if line.strip()
  ]
  steps, accs, cum = method_curve(records)
  return {
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
    # HFLDD's precondition: per heterogeneous cluster, how many classes its members hold
    # (Algorithm 1 means every cluster to cover every class)
    'cluster_label_coverage': summary.extras.get('cluster_label_coverage'),
  }


Formulas = Callable[[Dict[str, Any]], Dict[str, Callable[[int], int]]]


def formulas_of(config) -> Formulas:
  """A seed's runs -> `paper_formulas` of its finished ones, the model and data sizes computed
  once; a failure is printed once and leaves the paper-formula cells empty (it must not lose
  the measured results)."""
  sizes: List[Any] = []

  def formulas(runs: Dict[str, Any]) -> Dict[str, Callable[[int], int]]:
    ok = {m: r for m, r in runs.items() if not is_error(r)}
    if not ok or sizes == [None]:
      return {}
    try:
      if not sizes:
        sizes.append(model_and_data_sizes(config))
      return paper_formulas(config, ok, *sizes[0])
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      sizes[:] = [None]
      return {}

  return formulas


def target_rows(
  results, targets: Sequence[float], reference: str, formulas: Formulas
) -> Dict[float, Dict[str, list]]:
  """The per-seed Tables III-V rows.

  Args:
    results: {seed: {method: record}}.
    targets: the target accuracies.
    reference: the method whose traffic is 1X (where the seed has it).
    formulas: the paper formula of each seed's runs.

  Returns:
    {target: {seed: `jfed.io.comm.target_table_rows` of the seed's finished runs with bytes}}.
  """
  from jfed.io.comm import target_table_rows  # pylint: disable=g-import-not-at-top

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
        table_methods, target, reference=ref, paper_bits=formulas(mine)
      )
    per_target[target] = per_seed
  return per_target


def render(
  config,
  results,
  methods: Sequence[str],
  targets: Sequence[float],
  reference: str,
  formulas: Formulas,
  meta: Dict[str, Any],
) -> str:
  """results.md: the budget, the summary table and the Tables III-V layout per target.

  Args:
    config: the comparison's config.
    results: {seed: {method: record}}, the sweep's one cell.
    methods: the table's methods, in its order.
    targets: the target accuracies.
    reference: the method whose traffic is 1X.
    formulas: the paper formula of each seed's runs.
    meta: the sweep's meta (the backend of runs that carry none).

  Returns:
    The Markdown text.
  """
  from jfed.io.comm import MIB  # pylint: disable=g-import-not-at-top

  n = len(results)
  lines = [
    f'# HFLDD comparison: {title_of(config)}',
    '',
    f'{backend_line({CELL: results}, meta)}; seeds {sorted(int(s) for s in results)} (each '
    'draws the partition, the public set and every initialisation). Budget:',
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
    for target, per_seed in target_rows(results, targets, reference, formulas).items():
      lines += [seed_target_table(per_seed, table_methods, target), '']
  lines += budget_evidence_lines(results, methods)
  lines += claim_lines(config, results, targets)
  return '\n'.join(lines) + '\n'


def run_compare(
  config,
  out: pathlib.Path,
  methods: Sequence[str],
  targets: Sequence[float],
  reference: str = 'hfldd',
  seeds: Sequence[int] = (0, 1, 2),
  merge: Sequence[str] = (),
) -> str:
  """Runs every (seed, method) not finished yet as a sweep (experiments/sweep.py) and, after
  each run, writes results.json, results.md and the figures.

  Args:
    config: the comparison's config. None: nothing runs, and the results of OUT and `merge`
      render with the config they were run with (the config files may have changed since).
    out: OUT.
    methods: the methods, in the tables' order.
    targets: the target accuracies of the Tables III-V layout.
    reference: the method whose traffic is 1X.
    seeds: the seeds to run.
    merge: OUTs of the same config holding other runs (their results.json; e.g. seeds run in
      another session or on another machine), which join the tables; a run finished there is
      not run again here.

  Returns:
    results.md's text ('' when there is nothing to show).
  """
  import ml_collections  # pylint: disable=g-import-not-at-top

  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  methods, seeds = list(methods), [int(s) for s in seeds]
  if config is None and seeds:
    raise ConfigError(
      '--config: required to run seeds; --seeds= (none) renders the results of --out and '
      '--merge with the config they were run with'
    )
  stored: List[Dict[str, Any]] = []
  s = sweep.Sweep.open(out, seeds, merge, results_reader(config, out, stored))
  if config is None:
    if not stored:
      raise ConfigError(f'--config: not given, and neither {out} nor --merge holds results')
    config = ml_collections.ConfigDict(stored[0])
  s.meta['config'] = config_json(config)
  formulas = formulas_of(config)
  s.render = lambda s: {
    'results.md': render(config, s.results[CELL], methods, targets, reference, formulas, s.meta)
  }
  s.derived = lambda s: {
    'target_tables': {
      str(t): {seed: [row._asdict() for row in rows] for seed, rows in per_seed.items()}
      for t, per_seed in target_rows(s.results[CELL], targets, reference, formulas).items()
    }
  }
  s.after_save = lambda s: write_figures(out, s.results[CELL], methods, title_of(config))

  def execute(method: str, c, workdir: pathlib.Path) -> sweep.Record:
    record = run_record(method, run_experiment(method, c, workdir), workdir)
    formula = formulas({method: record}).get(method)
    if formula is not None and record['step_name'] == 'round':
      record['paper_formula_bits'] = formula(len(record['steps']))
    return record

  last = None
  for seed in seeds:
    c = config.copy_and_resolve_references()
    c.seed = seed
    for method in methods:
      workdir = out / f'seed{seed}' / method
      last = s.run_one(
        CELL,
        seed,
        method,
        lambda: execute(method, c, workdir),  # pylint: disable=cell-var-from-loop
        f'seed {seed} / {method} -> {workdir}',
      )
  if not s.results.get(CELL):
    return ''
  if last is None:  # nothing ran last: the merged or read-back results are not written yet
    s.save()
  return s.text('results.md')


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
