"""Local client accuracy vs local epochs: are a budget's classifier clients on their plateau?

    python -m experiments.client_curve \
        --config=experiments/configs/fedmho_digits.py:baselines \
        --epochs=10,30,60,100,150,200 --seeds=0 --out=runs/fedmho_client_curve [--tolerance=3]

For each seed and each number of local epochs E, the `local` method (every client trained alone
from the config's shared init for E epochs with the config's optimiser and batch, then scored on
the whole test split) runs into OUT/seed<s>/e<E>/; rerunning the command skips finished runs and
resumes an interrupted one. OUT/curve.md gives, per client model spec, the mean client test
accuracy at each E (mean over the seeds' clients of that spec, with the lowest and highest
client), the plateau (the highest mean of the curve) and the first E whose mean is within
`--tolerance` points of it: issue 36's precondition that a table's local classifiers are within
3 points of their plateau. The curve ends where `--epochs` ends, so a plateau is only the best
mean measured; a curve still rising at its last E says so.
"""

import json
import pathlib
from typing import Dict, List, Mapping, NamedTuple, Sequence

from absl import flags
import numpy as np

from experiments import sweep
from experiments.seed_tables import load_config_module

FLAGS = flags.FLAGS


def define_flags() -> None:
  sweep.define_flags(
    'runs/client_curve', ('0',), merge=False, config='A config file, FILE[:variant words].'
  )
  flags.DEFINE_list('epochs', ['10', '30', '60', '100'], 'Local epochs (the curve points).')
  flags.DEFINE_float('tolerance', 3.0, 'Points below the plateau that still count as on it.')


class SpecCurve(NamedTuple):
  """One client model spec's curve (accuracies in %)."""

  spec: str
  epochs: List[int]
  mean: List[float]  # per E: the mean over every seed's clients of this spec
  low: List[float]
  high: List[float]
  plateau: float  # the highest mean measured
  within: int  # the first E whose mean is within the tolerance of the plateau
  rising: bool  # the last E's mean is the plateau and it rose by more than the tolerance


def spec_curves(
  accuracies: Mapping[int, Sequence[Mapping[str, Sequence[float]]]], tolerance: float
) -> List[SpecCurve]:
  """The curves of `accuracies` (E -> per seed, {spec: client test accuracies in [0, 1]})."""
  epochs = sorted(accuracies)
  specs = list(dict.fromkeys(s for e in epochs for seed in accuracies[e] for s in seed))
  out = []
  for spec in specs:
    values = [
      100 * np.asarray([a for seed in accuracies[e] for a in seed.get(spec, ())]) for e in epochs
    ]
    mean = [float(v.mean()) for v in values]
    plateau = max(mean)
    within = next(e for e, m in zip(epochs, mean) if m >= plateau - tolerance)
    rising = len(mean) > 1 and mean[-1] == plateau and mean[-1] - mean[-2] > tolerance
    out.append(
      SpecCurve(
        spec,
        epochs,
        mean,
        [float(v.min()) for v in values],
        [float(v.max()) for v in values],
        plateau,
        within,
        rising,
      )
    )
  return out


def render(curves: Sequence[SpecCurve], label: str, seeds: Sequence[int], tolerance: float):
  epochs = curves[0].epochs if curves else []
  lines = [
    f'# Local client test accuracy vs local epochs: {label}',
    '',
    f'`local` method (each client alone, scored on the whole test split), seeds {list(seeds)}; '
    f'% mean over the clients of each model (lowest–highest client). On the plateau: within '
    f'{tolerance:g} points of the highest mean measured.',
    '',
    '| clients | ' + ' | '.join(f'{e} epochs' for e in epochs) + ' | plateau | on it from |',
    '|---|' + '---:|' * (len(epochs) + 2),
  ]
  for c in curves:
    cells = [f'{m:.1f} ({lo:.1f}–{hi:.1f})' for m, lo, hi in zip(c.mean, c.low, c.high)]
    on_it = f'{c.within} epochs' + (' (still rising)' if c.rising else '')
    lines.append(f'| {c.spec} | ' + ' | '.join(cells) + f' | {c.plateau:.1f} | {on_it} |')
  return '\n'.join(lines) + '\n'


def client_accuracies(summary: Mapping, specs: Sequence[str]) -> Dict[str, List[float]]:
  """{spec: its clients' test accuracies} of a `local` run's summary and client specs."""
  out: Dict[str, List[float]] = {}
  for spec, a in zip(specs, summary['client_test_accuracy']):
    out.setdefault(spec, []).append(float(a))
  return out


def client_specs(metrics: pathlib.Path) -> List[str]:
  """Each client's model spec, by client id, from a `local` run's per-client records."""
  records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
  by_client = {r['client']: r['model'] for r in records if 'client' in r and 'model' in r}
  return [by_client[k] for k in sorted(by_client)]


def run_curve(
  config_path: str,
  words: str,
  out: pathlib.Path,
  epochs: Sequence[int],
  seeds: Sequence[int],
  tolerance: float = 3.0,
) -> str:
  """Runs (or resumes, or skips) the `local` run of every (seed, E); writes and returns
  OUT/curve.md (and OUT/curve.json: the accuracies by E, seed and spec)."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.workdir import atomic_write_text  # pylint: disable=g-import-not-at-top

  module = load_config_module(config_path, 'client_curve_config')
  accuracies: Dict[int, List[Dict[str, List[float]]]] = {}
  for e in epochs:
    for seed in seeds:
      c = module.get_config(words)
      c.seed, c.local.epochs = seed, e
      workdir = out / f'seed{seed}' / f'e{e}'
      print(f'=== seed={seed} epochs={e} -> {workdir}', flush=True)
      summary = run_experiment('local', c, workdir, progress=False)
      specs = client_specs(workdir / 'metrics.jsonl')
      accuracies.setdefault(e, []).append(client_accuracies(summary, specs))
  label = f'{pathlib.Path(config_path).name}' + (f':{words}' if words else '')
  text = render(spec_curves(accuracies, tolerance), label, seeds, tolerance)
  atomic_write_text(out / 'curve.json', json.dumps({str(e): a for e, a in accuracies.items()}))
  atomic_write_text(out / 'curve.md', text)
  return text


def main(argv):
  del argv
  path, words = sweep.config_flag()
  print(
    run_curve(
      path,
      words,
      pathlib.Path(FLAGS.out),
      [int(e) for e in FLAGS.epochs],
      [int(s) for s in FLAGS.seeds],
      FLAGS.tolerance,
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
