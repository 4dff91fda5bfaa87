"""HFLDD's sensitivity studies (Shi et al., arXiv 2409.17517): test accuracy against the K of
the K-Means homogeneous clustering (§VI-F, Table VII) and against the distilled data size per
member (§VI-D, Fig. 7),
at #C=1, #C=2 and #C=10 (IID), over seeds.

  python -m experiments.hfldd_sweeps --config=experiments/configs/hfldd_digits.py \
      --sweep=k --values=5,6,7,8,9,10,11 --partitions=c1,c2,iid --seeds=0,1,2 --out=runs/hfldd_k
  python -m experiments.hfldd_sweeps --config=experiments/configs/hfldd_digits.py \
      --sweep=distilled_size --values=10,20,40,70 --out=runs/hfldd_size
      [--budget=smoke] [--override=hfldd.rounds=30,...] [--merge=OUT2,...]

`--config` is an HFLDD config file (hfldd_digits.py, hfldd_fashion_mnist.py), optionally with its
argument (`FILE:words`); each run's config is `get_config` of those words, the `--budget` words
and the partition's word (`c1`, `c2`, `iid`: #C=1, 2, 10; a config whose default is #C=1 needs no
`c1` word), then the `--override` keys (dotted `key=value`, values as Python literals), then the
swept key set to the value: `--sweep=k` sets `hfldd.K`, `--sweep=distilled_size` sets
`hfldd.kip.support_size` (KIP images per member; the paper's default is 400 per client of 600).
The swept key's config value is therefore ignored.

Only HFLDD runs. Each (seed, partition, value) goes through `jfed.driver.run_experiment` into
OUT/seed<s>/<partition>_<value>/ (metrics, summary, topology, checkpoints): repeating the command
resumes an interrupted run and skips a finished one. The runs of one (seed, partition) share the
clients' pre-training (`local_models_dir` = OUT/seed<s>/<partition>_local_models/), which no swept
value changes. After every run OUT gets (accuracy.png: after every seed's partition):
- results.md: the budget and, in the Table VII layout (rows: partitions, columns: values), the
  mean ± sample std over the finished seeds (n) of the final-round test accuracy (what HFLDD
  (Shi et al., arXiv 2409.17517) reports) and of the best round's; the K sweep adds the number
  of heterogeneous clusters and the
  paper's Table VII MNIST rows as a reference, the size sweep the measured traffic;
- results.json: meta (sweep, config words, overrides, seeds) and results[partition][seed][value]
  (final and best accuracy, curve, traffic, heads, seconds; or status 'error' with its message:
  a failed run does not stop the sweep);
- accuracy.png: test accuracy per round, one panel per partition and one line per value, the mean
  over the seeds with a ± std band (Fig. 7's layout for the size sweep).

Seeds in parallel: one sweep per seed into its own OUT (`--seeds=1 --out=runs/k_s1`), then
`--merge=runs/k_s1,runs/k_s2 --out=runs/k_s0` with the same --config/--budget/--override/--sweep
adds their records to OUT's results and rewrites its outputs without running anything; the run
directories stay where they ran. An OUT or merge directory of another sweep, config, budget or
override is refused.
"""

import ast
import json
import pathlib
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from absl import app, flags, logging
import numpy as np

from experiments import sweep as runner
from experiments.seed_tables import (
  curve_stats,
  load_config_module,
  mean_std,
  plot_band_panels,
  seed_cell,
  seed_values,
)

FLAGS = flags.FLAGS


class Sweep(NamedTuple):
  key: str  # the dotted config key the values set
  name: str  # the columns' heading
  symbol: str  # a value's label in a figure legend
  reference: str  # where the paper shows it


SWEEPS = {
  'k': Sweep(
    'hfldd.K',
    'K-Means K (homogeneous clusters)',
    'K',
    'HFLDD (Shi et al., arXiv 2409.17517) §VI-F, Table VII',
  ),
  'distilled_size': Sweep(
    'hfldd.kip.support_size',
    'distilled images per member (KIP support size)',
    'size',
    'HFLDD (Shi et al., arXiv 2409.17517) §VI-D, Fig. 7',
  ),
}
# Table VII's rows: the config word and the number of classes per client (#C) it gives.
PARTITIONS = {'c1': 1, 'c2': 2, 'iid': 10}
PARTITION_LABELS = {'c1': '#C=1', 'c2': '#C=2', 'iid': '#C=10 (IID)'}
# HFLDD (Shi et al., arXiv 2409.17517) Table VII, MNIST rows (K = 5..11). The paper's text lost
# the #C of each row; they are read in Table VI's order (#C=1, 2, 10), which §VI-F's text
# confirms (the first rows move most).
PAPER_TABLE7_MNIST = {
  'c1': (95.2, 97.1, 97.3, 98.0, 98.0, 98.1, 98.1),
  'c2': (98.3, 98.0, 98.3, 98.3, 98.1, 98.3, 98.1),
  'iid': (98.5, 98.3, 98.5, 98.4, 98.3, 98.4, 98.4),
}
PAPER_K = (5, 6, 7, 8, 9, 10, 11)
META_KEYS = ('sweep', 'config', 'budget', 'overrides')  # what OUT and merged sweeps must share


def define_flags() -> None:
  """Defined only when run as a command (importing the module in tests defines no flags)."""
  flags.DEFINE_string('sweep', None, f'What to sweep: {" | ".join(SWEEPS)}.')
  flags.DEFINE_list('values', None, 'The swept values (positive integers): the columns.')
  flags.DEFINE_list('partitions', list(PARTITIONS), f'Rows, of {", ".join(PARTITIONS)}.')
  flags.DEFINE_string('budget', '', "More config words for every run (e.g. 'smoke').")
  flags.DEFINE_list(
    'override',
    [],
    'Dotted config keys for every run, e.g. hfldd.rounds=30,hfldd.pretrain_epochs=2.',
  )
  runner.define_flags(
    None, config='An HFLDD config file, optionally FILE:words.'
  )  # --out (each run in OUT/seed<s>/<partition>_<value>), --seeds, --merge
  flags.DEFINE_bool('traceback', False, 'Show the full stack of an error instead of one line.')
  flags.mark_flags_as_required(['sweep', 'values', 'out'])


def parse_overrides(items: Sequence[str]) -> Dict[str, Any]:
  """['a.b=3', 'c=sgd'] -> {'a.b': 3, 'c': 'sgd'} (values as Python literals, else strings)."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  out = {}
  for item in items:
    key, sep, text = item.partition('=')
    if not sep or not key.strip():
      raise ConfigError(f'--override: expected key=value, got {item!r}')
    try:
      value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
      value = text.strip()
    out[key.strip()] = value
  return out


def set_key(config, key: str, value: Any) -> None:
  """config[key] = value for a dotted key; ConfigError for a key the config does not have."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  node = config
  *path, last = key.split('.')
  try:
    for p in path:
      node = node[p]
    if last not in node:
      raise KeyError(key)
    node[last] = value
  except (KeyError, TypeError, AttributeError) as e:
    raise ConfigError(f'config key {key}={value!r}: {type(e).__name__}: {e}') from None


def run_dirname(partition: str, value: int) -> str:
  return f'{partition}_{value}'


class Plan(NamedTuple):
  module: Any  # the config file
  arg: str  # its words and the budget's
  overrides: Dict[str, Any]
  sweep: str
  values: List[int]
  partitions: List[str]

  def config(self, partition: str, value: int, seed: int):
    """The config of one run (before its local_models_dir)."""
    from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

    known = getattr(self.module, 'VARIANTS', None)
    # a config whose default is #C=1 has no 'c1' word
    word = '' if known is not None and partition not in known else partition
    c = self.module.get_config(c_words(self.arg, word))
    for key, v in self.overrides.items():
      set_key(c, key, v)
    set_key(c, SWEEPS[self.sweep].key, int(value))
    c.seed = int(seed)
    k = c.partition.get('k') if c.partition.scheme == 'shards' else None
    if k != PARTITIONS[partition]:
      got = f'#C={k}' if k is not None else f'partition {c.partition.scheme}'
      raise ConfigError(
        f'--partitions={partition} needs #C={PARTITIONS[partition]} shards, but the config '
        f'words {c_words(self.arg, word)!r} give {got}'
      )
    return c


def c_words(arg: str, word: str) -> str:
  return ','.join(w for w in (arg, word) if w)


def make_plan(
  config_arg: str,
  budget: str,
  sweep: str,
  values: Sequence[str],
  partitions: Sequence[str],
  overrides: Sequence[str],
) -> Plan:
  """Checks every argument and builds (and validates) every run's config: a bad one fails here,
  before anything is written."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  if sweep not in SWEEPS:
    raise ConfigError(f'--sweep={sweep}: unknown; valid: {", ".join(SWEEPS)}')
  try:
    ints = [int(v) for v in values]
  except ValueError:
    raise ConfigError(f'--values: expected positive integers, got {list(values)}') from None
  if not ints or min(ints) < 1:
    raise ConfigError(f'--values: expected positive integers, got {list(values)}')
  ints = list(dict.fromkeys(ints))
  unknown = [p for p in partitions if p not in PARTITIONS]
  if unknown or not partitions:
    raise ConfigError(f'--partitions: unknown {unknown}; valid: {", ".join(PARTITIONS)}')
  path, _, arg = config_arg.partition(':')
  if not pathlib.Path(path).is_file():
    raise ConfigError(f'--config: file {path} not found')
  from jfed.driver import build_algorithm  # pylint: disable=g-import-not-at-top  # imports jax

  module = load_config_module(path, 'hfldd_sweeps_config')
  plan = Plan(
    module,
    c_words(arg, budget),
    parse_overrides(overrides),
    sweep,
    ints,
    list(dict.fromkeys(partitions)),
  )
  for p in plan.partitions:
    for v in plan.values:
      c = plan.config(p, v, 0)
      if sweep == 'k' and v > c.partition.num_clients:
        raise ConfigError(f'--values: K={v} exceeds the {c.partition.num_clients} clients')
      if sweep == 'distilled_size' and not c.hfldd.distill:
        raise ConfigError('--sweep=distilled_size: the config sends raw data (hfldd.distill off)')
      build_algorithm('hfldd', c)  # the driver's own checks of the whole config
  return plan


def run_record(workdir: pathlib.Path, summary) -> Dict[str, Any]:
  """What results.json keeps of a finished run."""
  from experiments.hfldd_compare import method_curve  # pylint: disable=g-import-not-at-top

  lines = (workdir / 'metrics.jsonl').read_text().splitlines()
  steps, accs, _ = method_curve([json.loads(line) for line in lines if line.strip()])
  return {
    'final_test_accuracy': summary.final_test_accuracy,
    'best_test_accuracy': summary.best_test_accuracy,
    'best_step': summary.best_step,
    'total_bytes': summary.total_bytes,
    'heads': len(summary.extras['heads']) if 'heads' in summary.extras else None,
    'seconds': summary.seconds,
    'curve': [steps, accs],
  }


def budget_line(c, sweep: str) -> str:
  """The run settings, with the swept key shown as swept."""
  h = c.hfldd
  k = 'swept' if sweep == 'k' else h.K
  size = 'swept' if sweep == 'distilled_size' else h.kip.support_size
  shards = ' (NIID-Bench #C=k shards, k per row)' if c.partition.scheme == 'shards' else ''
  return (
    f'{c.dataset.name}, {c.partition.num_clients} clients, partition {c.partition.scheme}'
    f'{shards}, model {c.model}, {c.optimizer.name} lr {c.optimizer.lr}, batch {c.batch_size}; '
    f'HFLDD {h.rounds} rounds x {h.local_epochs} local epochs over the heads, pre-training '
    f'{h.pretrain_epochs} epochs, public {h.public} ({h.public_size}), K={k} (leftover clients: '
    f'{h.leftover}), KIP {size} images/member x {h.kip.iterations} iterations (lr {h.kip.lr}, '
    f'target batch {h.kip.target_batch}, {h.kip.kernel}), images sent as {h.image_dtype}'
  )


def table(
  results: dict, plan: Plan, key: str, fmt: Optional[Callable[[List[float]], str]] = None
) -> List[str]:
  """Rows = partitions, columns = values; each cell `seed_cell` (or `fmt` of the seeds' values)."""
  lines = [
    f'| {SWEEPS[plan.sweep].symbol} | ' + ' | '.join(str(v) for v in plan.values) + ' |',
    '|---|' + '---:|' * len(plan.values),
  ]
  for p in plan.partitions:
    if fmt is None:
      cells = [seed_cell(results, p, str(v), key) for v in plan.values]
    else:
      cells = [fmt(seed_values(results, p, str(v), key)) for v in plan.values]
    lines.append(f'| {PARTITION_LABELS[p]} | ' + ' | '.join(cells) + ' |')
  return lines


def render(results: dict, plan: Plan, meta: dict) -> str:
  from jfed.io.comm import MIB  # pylint: disable=g-import-not-at-top

  s = SWEEPS[plan.sweep]
  base = plan.config(plan.partitions[0], plan.values[0], 0)
  seconds = [
    r[str(v)]['seconds']
    for p in plan.partitions
    for r in results.get(p, {}).values()
    for v in plan.values
    if (r.get(str(v)) or {}).get('seconds') is not None
  ]
  lines = [
    f'# HFLDD sensitivity to the {s.name} on {base.dataset.name} ({s.reference})',
    '',
    f'Backend {meta["backend"]}, jax {meta["jax_version"]}, {meta["date"]}; seeds '
    f'{meta["seeds"]} (each draws the partition, the public set and every initialisation); '
    f'config `{meta["config"]}`'
    + (f', budget words `{meta["budget"]}`' if meta['budget'] else '')
    + (f', overrides `{meta["overrides"]}`' if meta['overrides'] else '')
    + '.',
    '',
    f'Budget (the rows change only #C, the columns only `{s.key}`): '
    f'{budget_line(base, plan.sweep)}.',
    '',
    'Test accuracy (%) of the global model, mean ± sample std over the seeds whose run finished '
    '(n). Final = the last round, what HFLDD (Shi et al., arXiv 2409.17517) reports '
    "(its Table VII quotes HFLDD's test "
    'accuracy, its Figs. plot it per round); best = the best round on the test images (not '
    'reported by the paper). Curves per round: accuracy.png.',
    '',
    f'## Final accuracy (%), rows #C, columns {s.name}',
    '',
    *table(results, plan, 'final_test_accuracy'),
    '',
    '## Best-round accuracy (%)',
    '',
    *table(results, plan, 'best_test_accuracy'),
  ]
  if plan.sweep == 'k':
    lines += [
      '',
      '## Heterogeneous clusters (heads), mean over the seeds',
      '',
      *table(results, plan, 'heads', lambda v: f'{np.mean(v):.1f}' if v else '—'),
    ]
  else:
    lines += [
      '',
      '## Measured traffic (MiB, setup and every round), mean ± std over the seeds',
      '',
      *table(results, plan, 'total_bytes', lambda v: mean_std(v, 1 / MIB, 2) or '—'),
    ]
  if seconds:
    lines += ['', f'Compute per run: {np.mean(seconds):.0f} s on average ({len(seconds)} runs).']
  if plan.sweep == 'k':
    lines += [
      '',
      "## The paper's Table VII, MNIST rows (reference only)",
      '',
      "MNIST at the paper's budget (100 clients of 600 images, KIP 400 images x 3000 "
      'iterations per member, a V100), not this dataset or budget: compare how accuracy moves '
      'with K, not its level. The seed text lost the #C of each row; they are read in Table '
      "VI's order (#C=1, 2, 10), which §VI-F's text confirms.",
      '',
      '| K | ' + ' | '.join(str(k) for k in PAPER_K) + ' |',
      '|---|' + '---:|' * len(PAPER_K),
    ]
    for p, row in PAPER_TABLE7_MNIST.items():
      lines.append(f'| {PARTITION_LABELS[p]} | ' + ' | '.join(f'{a:.1f}' for a in row) + ' |')
  else:
    lines += [
      '',
      'The paper shows this study only as curves (Fig. 7: CIFAR10, #C=1, 2, 10; its default '
      'is 400 distilled images per client of 600, more images converging faster and higher); '
      'it gives no numbers to compare with.',
    ]
  lines += ['', 'Per run: OUT/seed<s>/<partition>_<value>/ (metrics.jsonl, summary.json, plots).']
  return '\n'.join(lines) + '\n'


def plot(path: pathlib.Path, results: dict, plan: Plan, dataset: str) -> None:
  """Accuracy per round: a panel per partition, a mean ± std band per value."""
  s = SWEEPS[plan.sweep]
  panels = {}
  for p in plan.partitions:
    bands = {}
    for v in plan.values:
      curves = [
        tuple(r[str(v)]['curve'])
        for r in results.get(p, {}).values()
        if (r.get(str(v)) or {}).get('curve')
      ]
      if curves:
        bands[f'{s.symbol}={v} (n={len(curves)})'] = curve_stats(curves)
    panels[PARTITION_LABELS[p]] = bands
  plot_band_panels(
    path,
    panels,
    'round',
    'test accuracy (%)',
    f'HFLDD on {dataset}: test accuracy per round by {s.name}\nmean ± std over seeds',
  )


def run_sweep(
  config_arg: str,
  sweep: str,
  values: Sequence[str],
  out: pathlib.Path,
  partitions: Sequence[str] = tuple(PARTITIONS),
  seeds: Sequence[int] = (0, 1, 2),
  budget: str = '',
  overrides: Sequence[str] = (),
  merge: Sequence[str] = (),
) -> str:
  """Runs every (seed, partition, value) not finished yet (or, with `merge`, only merges those
  directories' results); rewrites results.json and results.md after each run and accuracy.png
  after each (seed, partition); returns results.md's text. Every argument is checked before
  anything is written."""

  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  plan = make_plan(config_arg, budget, sweep, values, partitions, overrides)
  seeds = [int(s) for s in seeds]
  mine = {'sweep': sweep, 'config': config_arg, 'budget': budget, 'overrides': list(overrides)}

  def load(path: pathlib.Path) -> dict:
    saved = json.loads(path.read_text())
    theirs = {k: saved.get('meta', {}).get(k) for k in META_KEYS}
    if theirs != mine:
      diff = {k: theirs[k] for k in META_KEYS if theirs[k] != mine[k]}
      raise ConfigError(f'{path} holds another sweep ({diff}, here {mine}): use a new --out')
    return saved

  s = runner.Sweep.open(out, [] if merge else seeds, merge, load, **mine)
  s.render = lambda s: {'results.md': render(s.results, plan, s.meta)}
  dataset = plan.config(plan.partitions[0], plan.values[0], 0).dataset.name
  out.mkdir(parents=True, exist_ok=True)

  def execute(p: str, v: int, seed: int, workdir: pathlib.Path) -> runner.Record:
    c = plan.config(p, v, seed)
    c.local_models_dir = str((out / f'seed{seed}' / f'{p}_local_models').absolute())
    return run_record(workdir, run_experiment('hfldd', c, workdir))

  for seed in [] if merge else seeds:
    for p in plan.partitions:
      for v in plan.values:
        workdir = out / f'seed{seed}' / run_dirname(p, v)
        s.run_one(
          p,
          seed,
          str(v),
          lambda: execute(p, v, seed, workdir),  # pylint: disable=cell-var-from-loop
          f'seed {seed} / {p} / {SWEEPS[sweep].symbol}={v} -> {workdir}',
        )
      plot(out / 'accuracy.png', s.results, plan, dataset)  # about a second: once per partition
  s.save()
  plot(out / 'accuracy.png', s.results, plan, dataset)
  return s.text('results.md')


def main(argv):
  del argv
  from jfed.errors import JfedError  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  out = pathlib.Path(FLAGS.out)
  try:
    config_arg = ':'.join(w for w in runner.config_flag() if w)
    plan_args = (config_arg, FLAGS.budget, FLAGS.sweep, FLAGS.values, FLAGS.partitions)
    make_plan(*plan_args, FLAGS.override)  # fails before the compilation cache dir is made
    if not FLAGS.merge:
      from jfed.engine.compiles import use_persistent_cache  # pylint: disable=g-import-not-at-top

      # every run compiles the same few programs: read them back from disk
      use_persistent_cache(str(out / 'compilation_cache'), min_compile_seconds=0.2)
    text = run_sweep(
      config_arg,
      FLAGS.sweep,
      FLAGS.values,
      out,
      FLAGS.partitions,
      [int(s) for s in FLAGS.seeds],
      FLAGS.budget,
      FLAGS.override,
      FLAGS.merge,
    )
  except (JfedError, ValueError, OSError) as e:
    if FLAGS.traceback:
      raise
    print(f'error: {" ".join(str(e).split()) or type(e).__name__}', file=sys.stderr)
    sys.exit(1)
  print(text)
  print(f'outputs in {out}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
