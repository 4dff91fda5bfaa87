"""FedAvg under attack: aggregator x attack x attacker fraction, over seeds (issue 10).

    python -m experiments.robustness --config=experiments/configs/robustness.py:dataset=digits \
        --out=runs/robustness_digits [--seeds=0,1,2] [--rules=mean,median,...] \
        [--attacks=sign_flip,scaling,noise,label_flip] [--fractions=0.1,0.2,0.4]

Every (rule, attack, fraction, seed) is one FedAvg run through `jfed.driver.run_experiment` into
OUT/<rule>/<attack>_<fraction>/seed<s>/ (rerunning resumes and skips finished runs); the clean
run (no attacker) is the cell 'none_0'. The attackers are drawn from the seed (a fraction of
the clients, rounded) and keep their role for the whole run. Attack strengths are fixed
(`STRENGTHS`); the robust rules' settings come from the config (trimmed mean β, Krum f) and
the config module's `CLIP_NORM` (the clipped mean's).

Writes OUT/tables.md (per attack, a table of rules x fractions: mean ± std over seeds of the
final test accuracy in %, and the same for the best round), OUT/robustness.png (accuracy
against the attacker fraction, one panel per attack, one line per rule) and OUT/results.json.
A failed run is recorded as 'error' and the sweep goes on. Seeds in parallel: one sweep per
seed into its own OUT, then `--merge=OUT1,OUT2 --out=OUT0` writes the tables of all of them.
"""

import pathlib
from typing import Dict, Optional, Sequence, Union

from absl import flags, logging

from experiments import sweep
from experiments.seed_tables import load_config_module, mean_std, percent_stats_each, seed_values

FLAGS = flags.FLAGS

# The aggregation rows: `aggregation` overrides of the config's section (clipped_mean clips at
# the config module's CLIP_NORM for the dataset).
RULES: Dict[str, Dict[str, object]] = {
  'mean': {'rule': 'mean', 'clip_norm': 0.0},
  'clipped_mean': {'rule': 'mean'},
  'median': {'rule': 'median', 'clip_norm': 0.0},
  'trimmed_mean': {'rule': 'trimmed_mean', 'clip_norm': 0.0},
  'krum': {'rule': 'krum', 'clip_norm': 0.0},
  'geometric_median': {'rule': 'geometric_median', 'clip_norm': 0.0},
}
# Per attack, its strength s (jfed/engine/attacks.py): sign flip sends θ_g − 10 Δ, scaling
# θ_g + 100 Δ, noise θ_g + N(0, 1) per coordinate; label flipping trains on C − 1 − y.
STRENGTHS = {'sign_flip': 10.0, 'scaling': 100.0, 'noise': 1.0, 'same_value': 10.0, 'label_flip': 0}
ATTACKS = ('sign_flip', 'scaling', 'noise', 'label_flip')
FRACTIONS = ('0.1', '0.2', '0.4')
SUMMARY_KEYS = ('final_test_accuracy', 'best_test_accuracy', 'seconds')
CLEAN = 'none_0'


def define_flags() -> None:
  """Defined only when run as a command (importing the module in tests defines no flags)."""
  sweep.define_flags(
    'runs/robustness', config='experiments/configs/robustness.py:<dataset>[,smoke].'
  )
  flags.DEFINE_list('rules', list(RULES), f'Aggregation rows: {", ".join(RULES)}.')
  flags.DEFINE_list('attacks', list(ATTACKS), f'Attacks: {", ".join(STRENGTHS)}.')
  flags.DEFINE_list('fractions', list(FRACTIONS), 'Attacker fractions (besides 0).')


def cell_name(attack: str, fraction: str) -> str:
  return f'{attack}_{fraction}'


def run_config(base, clip_norm: float, rule: str, attack: str, fraction: str, seed: int):
  """`base` with one row's aggregation, one cell's attack and `seed`."""
  c = base.copy_and_resolve_references()
  c.seed = seed
  c.aggregation.update(RULES[rule])
  if rule == 'clipped_mean':
    c.aggregation.clip_norm = clip_norm
  if attack == 'none':
    c.attack.kind, c.attack.fraction = 'none', 0.0
  else:
    c.attack.kind, c.attack.fraction = attack, float(fraction)
    c.attack.strength = STRENGTHS[attack]
  return c


def text(results: dict, rule: str, cell: str, key: str) -> str:
  """'mean ± std' over seeds, with the failed seeds counted."""
  errors = sweep.cell_stats(results, cell, rule, key).errors
  out = mean_std(seed_values(results, cell, rule, key)) or '—'
  return out + (f' ({errors} error)' if errors else '')


def render(config, clip_norm: float, results: dict, plan: dict, meta: dict) -> str:
  rules, attacks, fractions = plan['rules'], plan['attacks'], plan['fractions']
  c = config
  lines = [
    f'# FedAvg under attack on {c.dataset.name}',
    '',
    'Top-1 test accuracy (%) of the global model, mean ± std over seeds. '
    f'Backend {meta["backend"]}, jax {meta["jax_version"]}, {meta["date"]}, seeds '
    f'{meta["seeds"]}; {c.partition.num_clients} clients, {c.partition.scheme}'
    f'({c.partition.alpha}), model {c.model}, {c.fedavg.rounds} rounds x '
    f'{c.fedavg.local_epochs} local epoch(s), batch {c.batch_size}, SGD lr {c.optimizer.lr}.',
    f'Trimmed mean β = {c.aggregation.trim_fraction}, Krum f = {c.aggregation.krum_byzantine}, '
    f'clipped mean at update norm {clip_norm}; attack strengths {STRENGTHS}. '
    'The attackers are drawn per seed and fraction (rounded share of the clients).',
  ]
  for title, key in (('final round', 'final_test_accuracy'), ('best round', 'best_test_accuracy')):
    for attack in attacks:
      lines += ['', f'## {attack}, {title}', '']
      head = ['Rule', 'no attack'] + [f'{float(f):.0%}' for f in fractions]
      rows = [
        [rule, text(results, rule, CLEAN, key)]
        + [text(results, rule, cell_name(attack, f), key) for f in fractions]
        for rule in rules
      ]
      lines += sweep.table_lines(head, rows)
  lines += ['', 'Per run: OUT/<rule>/<attack>_<fraction>/seed<s>/ (metrics, summary, plots).']
  return '\n'.join(lines) + '\n'


def plot(path: pathlib.Path, results: dict, plan: dict, title: str) -> None:
  """One panel per attack: final accuracy against the attacker fraction, a line per rule."""
  fractions = plan['fractions']
  x = [0.0] + [float(f) for f in fractions]
  panels = {}
  for attack in plan['attacks']:
    cells = [CLEAN] + [cell_name(attack, f) for f in fractions]
    panels[attack] = {
      rule: (
        x,
        *percent_stats_each([seed_values(results, c, rule, 'final_test_accuracy') for c in cells]),
      )
      for rule in plan['rules']
    }
  sweep.plot_errorbar_panels(
    path, panels, 'attacker fraction', 'final test accuracy (%)', title, ylim=(0, 100)
  )


def run_sweep(
  config: Union[str, object],
  out: pathlib.Path,
  seeds: Sequence[int],
  rules: Sequence[str],
  attacks: Sequence[str],
  fractions: Sequence[str],
  merge: Sequence[str] = (),
  clip_norm: Optional[Dict[str, float]] = None,
  label: str = '',
) -> str:
  """Runs every (rule, cell, seed) not finished yet (or only merges `merge`'s results);
  rewrites results.json, tables.md and robustness.png after each run; returns the tables.
  `config`: the base config, or its 'FILE:words'; `clip_norm`: the clipped mean's norm per
  dataset (default: the config file's CLIP_NORM); `label`: the config's FILE:words for
  results.json (default: `config` when it is that string)."""
  from jfed.configs import robustness as default  # pylint: disable=g-import-not-at-top
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.engine.compiles import use_persistent_cache  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  sweep.check_known('rules', rules, RULES)
  sweep.check_known('attacks', attacks, STRENGTHS)
  try:
    fractions = [f'{float(f):g}' for f in fractions]
  except ValueError:
    raise ConfigError(f'--fractions: expected numbers in (0, 1), got {fractions}') from None
  if not all(0 < float(f) < 1 for f in fractions):
    raise ConfigError(f'--fractions: expected numbers in (0, 1), got {fractions}')
  label = label or (config if isinstance(config, str) else '')
  if isinstance(config, str):
    path, _, arg = config.partition(':')
    module = load_config_module(path, 'robustness_config')
    clip_norm = clip_norm or module.CLIP_NORM
    config = module.get_config(arg)  # a bad word fails before any run
  clip = (clip_norm or default.CLIP_NORM)[config.dataset.name]
  out.mkdir(parents=True, exist_ok=True)
  # Every run compiles the same few programs (one shape per dataset): read them back from disk.
  use_persistent_cache(str(out / 'compilation_cache'), min_compile_seconds=0.2)
  plan = {'rules': list(rules), 'attacks': list(attacks), 'fractions': fractions}
  s = sweep.Sweep.open(out, sorted(seeds), merge, config=label)
  s.meta['seeds'] = sorted(s.meta['seeds'])
  s.render = lambda s: {'tables.md': render(config, clip, s.results, plan, s.meta)}
  title = f'FedAvg under attack on {config.dataset.name}'
  s.after_save = lambda s: plot(out / 'robustness.png', s.results, plan, title)

  def execute(rule: str, attack: str, fraction: str, seed: int, workdir: pathlib.Path):
    c = run_config(config, clip, rule, attack, fraction, seed)
    summary = run_experiment('fedavg', c, workdir, progress=False)
    record = sweep.summary_record(summary, SUMMARY_KEYS)
    record['rejected_uploads'] = summary.extras.get('rejected_uploads')
    return record

  if not merge:
    cells = [('none', '0')] + [(a, f) for a in attacks for f in fractions]
    for seed in seeds:
      for attack, fraction in cells:
        for rule in rules:
          cell = cell_name(attack, fraction)
          workdir = out / rule / cell / f'seed{seed}'
          s.run_one(
            cell,
            seed,
            rule,
            lambda: execute(rule, attack, fraction, seed, workdir),  # pylint: disable=cell-var-from-loop
            f'{rule} {cell} seed={seed} -> {workdir}',
          )
  s.save()
  return s.text('tables.md')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  print(
    run_sweep(
      FLAGS.config,
      pathlib.Path(FLAGS.out),
      [int(s) for s in FLAGS.seeds],
      FLAGS.rules,
      FLAGS.attacks,
      FLAGS.fractions,
      FLAGS.merge,
      label=flags.FLAGS['config'].config_filename,
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
