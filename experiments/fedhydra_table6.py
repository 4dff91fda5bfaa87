"""FedHydra Table 6 (Bai et al., "FedHydra: Boosting Federated Learning with Model-level
Stratification", KDD 2025): FedHydra's accuracy against the weights λ1 (L_BN) and λ2 (L_AD) of
its generator loss (Eq. 16), over seeds, as one compiled program per sweep.

    python -m experiments.fedhydra_table6 --config=experiments/configs/fedhydra_digits.py \
        --out=runs/fedhydra_table6 [--partition=dir0.5] [--seeds=0,1,2] \
        [--pairs=1/1,0.5/1,0/1,1/0.5,1/0,0/0] [--config.fedhydra.epochs=...]

Per seed, every (λ1, λ2) pair of `--pairs` (the paper's six by default) is a FedHydra run through
`jfed.driver.run_experiment` into OUT/seed<s>/l1_<λ1>_l2_<λ2>/, all of them in this one process
and from one set of client models per seed (`local_models_dir` = OUT/seed<s>/local_models,
trained once, for all seeds in one program first: `jfed.methods.seed_batch`). The runs set
`fedhydra.synthesis_every_term`, so the generator step computes L_BN and L_AD at every pair,
zeros included, and the weights are values of that step: the sweep compiles it once, and its
later runs find their programs compiled (each run's seconds are in the table; results equal the
runs made alone: tests/test_compile_once.py). Rerunning resumes; `--merge` adds other OUTs' seeds
as `experiments.fedhydra_tables` does.

Writes OUT/results.json and OUT/table6.md: per pair the final and best test accuracy (mean ±
sample std over seeds, %), the run's seconds, the paper's MNIST and Fashion-MNIST numbers beside
them (the paper reports no std), and a verdict for every pair of rows the paper's Fashion-MNIST
column ranks apart (holds / fails / within noise: a paired t-test over seeds at 5 %).
"""

import pathlib
import sys
from typing import Dict, List, Sequence, Tuple

from absl import flags

from experiments import sweep
from experiments.fedhydra_tables import dirname, partition_config
from experiments.seed_tables import (
  backend_line,
  mean_std,
  ordering_lines,
  paper_orderings,
  pretrain_seeds,
  seed_cell,
  seed_values,
)

FLAGS = flags.FLAGS

# FedHydra Table 6: (λ1, λ2) -> top-1 test accuracy (%).
PAPER_FASHION = {
  (1.0, 1.0): 77.20,
  (0.5, 1.0): 76.72,
  (0.0, 1.0): 76.07,
  (1.0, 0.5): 73.72,
  (1.0, 0.0): 70.64,
  (0.0, 0.0): 69.38,
}
PAPER_MNIST = {
  (1.0, 1.0): 88.75,
  (0.5, 1.0): 84.61,
  (0.0, 1.0): 83.29,
  (1.0, 0.5): 81.54,
  (1.0, 0.0): 76.19,
  (0.0, 0.0): 74.14,
}
DEFAULT_PAIRS = ['1/1', '0.5/1', '0/1', '1/0.5', '1/0', '0/0']
SUMMARY_KEYS = ('final_test_accuracy', 'best_test_accuracy', 'best_step', 'seconds')


def define_flags() -> None:
  sweep.define_flags('runs/fedhydra_table6', config='A FedHydra config file (get_config(arg)).')
  flags.DEFINE_string('partition', 'dir0.5', 'The partition: dir<alpha> or 2c/c.')
  flags.DEFINE_list('pairs', DEFAULT_PAIRS, 'The (λ1, λ2) pairs, each λ1/λ2.')


def parse_pairs(pairs: Sequence[str]) -> List[Tuple[float, float]]:
  """'λ1/λ2' words as float pairs; a ConfigError names a malformed or negative one."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  out = []
  for word in pairs:
    try:
      l1, l2 = (float(v) for v in word.split('/'))
    except ValueError:
      raise ConfigError(f'--pairs: {word!r} is not λ1/λ2 (e.g. 0.5/1)') from None
    if l1 < 0 or l2 < 0:
      raise ConfigError(f'--pairs: {word!r} has a negative weight; the weights are >= 0')
    out.append((l1, l2))
  if len(set(out)) != len(out):
    raise ConfigError(f'--pairs: {", ".join(pairs)} names a pair twice')
  return out


def run_name(pair: Tuple[float, float]) -> str:
  return f'l1_{pair[0]:g}_l2_{pair[1]:g}'


def render(config, results: Dict, cell: str, pairs, meta: Dict) -> str:
  f = config.fedhydra
  names = {run_name(p): f'λ1={p[0]:g}, λ2={p[1]:g}' for p in pairs}
  lines = [
    f'# FedHydra Table 6 on {config.dataset.name}, {cell}: λ1 (L_BN) and λ2 (L_AD)',
    '',
    f'Command: `{meta.get("command") or "python -m experiments.fedhydra_table6"}`',
    '',
    backend_line(results, meta),
    f'- {config.partition.num_clients} clients {config.client_models or config.model}, '
    f'{f.local_epochs} local epochs; server {f.server_model or config.model}, T_g={f.epochs} '
    f'epochs x T_G={f.T_G} generator steps on {f.synthesis_batch} images, MS T_G={f.ms_T_G}, '
    f'β={f.beta} (paper: E = 200, T_g = 200, T_G = 30)',
    '- one process, one set of client models per seed; the generator step compiled once for '
    'every pair (`fedhydra.synthesis_every_term`): the first pair of a seed also pays the '
    'compilation the others reuse (seconds column: one run of that pair, mean ± std over the '
    'seeds)',
    '',
    '| λ1 | λ2 | final % | best % | seconds | paper MNIST | paper Fashion-MNIST |',
    '|---:|---:|---|---|---:|---:|---:|',
  ]
  for p in pairs:
    r = run_name(p)
    secs = seed_values(results, cell, r, 'seconds')
    lines.append(
      f'| {p[0]:g} | {p[1]:g} | {seed_cell(results, cell, r, "final_test_accuracy")} | '
      f'{seed_cell(results, cell, r, "best_test_accuracy")} | '
      f'{mean_std(secs, scale=1.0, digits=0) or "—"} | '
      f'{PAPER_MNIST.get(p, float("nan")):.2f} | {PAPER_FASHION.get(p, float("nan")):.2f} |'
    )
  paper = {run_name(p): PAPER_FASHION[p] for p in pairs if p in PAPER_FASHION}
  lines += [
    '',
    "## Orderings of the paper's Fashion-MNIST column, our final accuracy",
    '',
    *ordering_lines(paper_orderings(results, cell, paper), names),
  ]
  return '\n'.join(lines) + '\n'


def run_sweep(
  config,
  out: pathlib.Path,
  partition: str,
  pairs: Sequence[Tuple[float, float]],
  seeds: Sequence[int] = (0, 1, 2),
  merge: Sequence[str] = (),
  command: str = '',
) -> str:
  """Runs every (seed, pair) not finished yet, or with `merge` only merges; returns table6.md
  (`command`: the command line it states)."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.methods.seed_batch import PlannedRun  # pylint: disable=g-import-not-at-top

  pairs, seeds = list(pairs), [int(s) for s in seeds]
  base = partition_config(config, partition)
  cell = dirname(partition)
  s = sweep.Sweep.open(out, [] if merge else seeds, merge, command=command)
  s.render = lambda s: {'table6.md': render(base, s.results, cell, pairs, s.meta)}

  def run_config(seed: int, pair: Tuple[float, float]):
    c = base.copy_and_resolve_references()
    c.seed = seed
    c.local_models_dir = str((out / f'seed{seed}' / 'local_models').absolute())
    c.fedhydra.lambda1, c.fedhydra.lambda2 = pair
    c.fedhydra.synthesis_every_term = True
    return c

  if not merge:
    pretrain_seeds(
      lambda: [
        [
          PlannedRun(
            'fedhydra', run_config(seed, pairs[0]), out / f'seed{seed}' / run_name(pairs[0])
          )
        ]
        for seed in seeds
      ],
      cell,
    )
  for seed in [] if merge else seeds:
    for pair in pairs:
      workdir = out / f'seed{seed}' / run_name(pair)
      s.run_one(
        cell,
        seed,
        run_name(pair),
        lambda: sweep.summary_record(  # pylint: disable=cell-var-from-loop
          run_experiment('fedhydra', run_config(seed, pair), workdir), SUMMARY_KEYS
        ),
        f'seed {seed} / {cell} / λ1={pair[0]:g} λ2={pair[1]:g} -> {workdir}',
      )
  s.save()
  return s.text('table6.md')


def main(argv):
  del argv
  print(
    run_sweep(
      FLAGS.config,
      pathlib.Path(FLAGS.out),
      FLAGS.partition,
      parse_pairs(FLAGS.pairs),
      FLAGS.seeds,
      FLAGS.merge,
      'python -m experiments.fedhydra_table6 ' + ' '.join(sys.argv[1:]),
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
