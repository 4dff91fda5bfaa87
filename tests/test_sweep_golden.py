"""The table scripts render the same Markdown from the same results as before they stood on
experiments/sweep.py: each script's tables from a fixed results.json (a real one under
docs/results/ where there is one, else a small synthetic one built here) against the bytes the
scripts wrote before the refactor (tests/data/sweep_golden/). Besides a date, the one difference
allowed is `CITATIONS` (papers named by their short form). Regenerate the files (only when a
table is meant to change) with `python -m tests.test_sweep_golden`."""

import json
import pathlib
import re
from typing import Callable, Dict, List, Mapping, Sequence

import pytest

from tests.support import needs_fashion_mnist

GOLDEN = pathlib.Path(__file__).parent / 'data' / 'sweep_golden'
REPO = pathlib.Path(__file__).parent.parent
META = {'backend': 'cpu', 'device_kind': 'cpu', 'jax_version': '0.0.0', 'date': '2000-01-01'}
# Scripts that stamp today's date (hfldd_compare prints none; the others take meta['date']).
DATE = re.compile(r'\b\d{4}-\d{2}-\d{2}\b')


# The one deliberate change to the rendered text since the golden files were written (issue 35,
# item 5): papers are cited by their docs/references.md short form instead of the authors'
# private file names. Applied, in this order, to the golden (old) text before comparing.
CITATIONS = [
  ('Tables 1 and 2 (seed 000)', 'Tables 1 and 2 (Bai et al., KDD 2025)'),
  ('and Fig. 9 (seed 004)', 'and Fig. 9 (Yao et al., WWW 2026)'),
  ('(seed 001 §5)', '(Fan et al., ECCV 2024, §5)'),
  ('sensitivity studies (seed 003)', 'sensitivity studies (Shi et al., arXiv 2409.17517)'),
  ('(seed 003, Tables III-V layout)', '(HFLDD, Shi et al., arXiv 2409.17517, Tables III-V layout)'),
  ("seed 003's traffic formula", "HFLDD's traffic formula (Shi et al., arXiv 2409.17517)"),
  ('seed 000', 'FedHydra (Bai et al., KDD 2025)'),
  ('Seed 004', 'FedMHO (Yao et al., WWW 2026)'),
  ('seed 004', 'FedMHO (Yao et al., WWW 2026)'),
  ('Seed 001', 'FedTSA (Fan et al., ECCV 2024)'),
  ('seed 003', 'HFLDD (Shi et al., arXiv 2409.17517)'),
  ('Seed 003', 'HFLDD (Shi et al., arXiv 2409.17517)'),
]


def cited(text: str) -> str:
  for old, new in CITATIONS:
    text = text.replace(old, new)
  return text


def normalise(text: str) -> str:
  """The rendered text with every ISO date replaced: the only part that may differ by day."""
  return DATE.sub('YYYY-MM-DD', text)


def synthetic(
  cells: Sequence[str], seeds: Sequence[str], runs: Sequence[str], extra: Mapping = ()
) -> Dict:
  """results[cell][seed][run]: deterministic accuracies, one failed run (the last run of the
  first cell's last seed) and one run stamped with another backend (the first run of the first
  cell's first seed), so that error counts and backend lines are rendered too."""
  out: Dict = {}
  for i, cell in enumerate(cells):
    for j, seed in enumerate(seeds):
      for k, run in enumerate(runs):
        acc = 0.5 + 0.01 * ((7 * i + 3 * j + 5 * k) % 37)
        record = {
          'final_test_accuracy': round(acc, 4),
          'best_test_accuracy': round(acc + 0.013 * (j + 1), 4),
          'seconds': 1.5 + k,
          'backend': 'cpu, jax 0.0.0',
          **{key: fn(i, j, k) for key, fn in dict(extra).items()},
        }
        out.setdefault(cell, {}).setdefault(seed, {})[run] = record
  first, last = cells[0], runs[-1]
  out[first][seeds[-1]][last] = {'status': 'error', 'error': 'RuntimeError: boom'}
  out[first][seeds[0]][runs[0]]['backend'] = 'gpu (NVIDIA H100), jax 0.0.0'
  return out


def robustness_tables() -> str:
  from experiments import robustness  # pylint: disable=g-import-not-at-top
  from jfed.configs import robustness as config  # pylint: disable=g-import-not-at-top

  plan = {
    'rules': list(robustness.RULES),
    'attacks': ['sign_flip', 'noise'],
    'fractions': ['0.1', '0.4'],
  }
  cells = ['none_0'] + [f'{a}_{f}' for a in plan['attacks'] for f in plan['fractions']]
  results = synthetic(cells, ['0', '1', '2'], plan['rules'])
  meta = {**META, 'seeds': [0, 1, 2]}
  base = config.get_config('dataset=digits')
  return robustness.render(base, config.CLIP_NORM['digits'], results, plan, meta)


def fedmho_tables() -> str:
  from experiments import fedmho_tables as t  # pylint: disable=g-import-not-at-top
  from jfed.configs import fedmho_fashion_mnist  # pylint: disable=g-import-not-at-top

  alphas = [0.5, 0.1]
  runs = list(t.RUNS)
  results = synthetic(
    [str(a) for a in alphas],
    ['0', '1', '2'],
    runs,
    {
      'initial_test_accuracy': lambda i, j, k: 0.3 + 0.01 * j,
      'teacher_ensemble_test_accuracy': lambda i, j, k: 0.6 + 0.02 * i,
      'kept_labelled_right': lambda i, j, k: 0.8 + 0.01 * j,
      'removed_labelled_right': lambda i, j, k: 0.2 + 0.01 * k,
    },
  )
  meta = {
    **META,
    'seeds': [0, 1, 2],
    'budget': 'smoke',
    'reference': {'model': 'cnn_mnist', 'epochs': 2, 'test_accuracy': 0.91},
  }
  return t.render(fedmho_fashion_mnist.get_config('smoke'), results, runs, alphas, meta)


def fedtsa_tables() -> str:
  from experiments import fedtsa_tables as t  # pylint: disable=g-import-not-at-top
  from jfed.configs import fedtsa_digits  # pylint: disable=g-import-not-at-top

  degrees = ['1.0/0.5', '0.6/0.8/1.0']
  plan = {
    'partitions': ['iid', 'dir=0.3'],
    'degrees': [t.normalise_degree(d) for d in degrees],
    'runs': list(t.ALL_RUNS),
  }
  cells = plan['partitions'] + [t.degree_cell(d) for d in plan['degrees']]
  results = synthetic(cells, ['0', '1', '2'], plan['runs'])
  meta = {**META, 'seeds': [0, 1, 2], 'budget': 'smoke'}
  return t.render(fedtsa_digits.get_config('smoke'), results, plan, meta)


def fedhydra_tables() -> Dict[str, str]:
  from experiments import fedhydra_tables as t  # pylint: disable=g-import-not-at-top
  from jfed.configs import (  # pylint: disable=g-import-not-at-top
    fedhydra_digits,
    fedhydra_fashion_mnist,
  )

  partitions = ['dir0.5', 'dir0.1', '2c/c']
  methods = list(t.NAMES)
  extra = {
    'teacher_ensemble_test_accuracy': lambda i, j, k: 0.6 + 0.01 * (i + j),
    'client_test_accuracy': lambda i, j, k: [0.4 + 0.01 * j, 0.5 + 0.01 * i],
    'best_step': lambda i, j, k: k,
    'curve': lambda i, j, k: [
      list(range(1, 11)),
      [0.3 + 0.01 * ((i + j + k) % 4) * e for e in range(10)],
    ],
  }
  results = synthetic(partitions, ['0', '1', '2'], methods, extra)
  meta = {**META, 'seeds': [0, 1, 2], 'evidence': ['- evidence line of the budget']}
  return {
    'fedhydra_tables_fashion_mnist.md': t.render(
      fedhydra_fashion_mnist.get_config('smoke'), results, methods, partitions, meta
    ),
    'fedhydra_tables_digits.md': t.render(
      fedhydra_digits.get_config('smoke'), results, methods, partitions, meta
    ),
  }


def hfldd_sweeps_tables() -> Dict[str, str]:
  from experiments import hfldd_sweeps as t  # pylint: disable=g-import-not-at-top
  from jfed.configs import hfldd_digits  # pylint: disable=g-import-not-at-top

  out = {}
  for sweep, values in (('k', [2, 5]), ('distilled_size', [10, 50])):
    plan = t.Plan(hfldd_digits, 'smoke', {}, sweep, values, list(t.PARTITIONS))
    cells = list(t.PARTITIONS)
    results = synthetic(
      cells,
      ['0', '1', '2'],
      [str(v) for v in values],
      {'total_bytes': lambda i, j, k: 1000 * (k + 1), 'heads': lambda i, j, k: 2 + k},
    )
    meta = {
      **META,
      'seeds': [0, 1, 2],
      'config': 'hfldd_digits.py',
      'budget': 'smoke',
      'overrides': 'hfldd.rounds=2',
    }
    out[f'hfldd_sweeps_{sweep}.md'] = t.render(results, plan, meta)
  return out


def dp_tables() -> str:
  from experiments import dp_table  # pylint: disable=g-import-not-at-top

  rows = list(dp_table.ROWS)
  results = synthetic([dp_table.CELL], ['0', '1', '2'], rows, {'epsilon': lambda i, j, k: 1.0 + k})
  meta = {**META, 'seeds': [0, 1, 2]}
  return dp_table.render(dp_table.setup('digits', True), results, rows, meta, 'dp_digits.png')


def hfldd_compare_tables(tmp: pathlib.Path) -> Dict[str, str]:
  """results.md of hfldd_compare from the real docs/results OUTs (merged, nothing run)."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  from experiments import hfldd_compare  # pylint: disable=g-import-not-at-top

  out = {}
  for name in ('hfldd_compare_digits_iid', 'hfldd_compare_fashion_c1'):
    src = REPO / 'docs' / 'results' / name
    saved = json.loads((src / 'results.json').read_text())
    config = ml_collections.ConfigDict(saved['config'])
    methods = list(next(iter(saved['runs'].values())))
    text = hfldd_compare.run_compare(
      config, tmp / name, methods, [0.6, 0.7, 0.8], seeds=(), merge=[str(src)]
    )
    out[f'{name}.md'] = text.replace(text.split('\n')[2].split(';')[0], 'Backend <normalised>')
  return out


CASES: Dict[str, Callable[[], object]] = {
  'robustness.md': robustness_tables,
  'fedmho_tables.md': fedmho_tables,
  'fedtsa_tables.md': fedtsa_tables,
  'fedhydra': fedhydra_tables,
  'hfldd_sweeps': hfldd_sweeps_tables,
  'dp_table.md': dp_tables,
}


def render_all(tmp: pathlib.Path, names: Sequence[str] = ()) -> Dict[str, str]:
  out: Dict[str, str] = {}
  for name, fn in CASES.items():
    if names and name not in names:
      continue
    got = fn()
    out.update(got if isinstance(got, dict) else {name: got})
  if not names or 'hfldd_compare' in names:
    out.update(hfldd_compare_tables(tmp))
  return {k: normalise(v) for k, v in out.items()}


@pytest.mark.parametrize('name', [*CASES, pytest.param('hfldd_compare', marks=needs_fashion_mnist)])
def test_tables_match_the_golden_files(name, tmp_path):
  for filename, text in render_all(tmp_path, [name]).items():
    want = cited((GOLDEN / filename).read_text())
    assert text == want, filename


def test_golden_files_cover_every_table_script():
  names: List[str] = sorted(p.name for p in GOLDEN.glob('*.md'))
  assert len(names) == 10, names


if __name__ == '__main__':
  import tempfile  # pylint: disable=g-import-not-at-top

  GOLDEN.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as d:
    for filename, text in render_all(pathlib.Path(d)).items():
      (GOLDEN / filename).write_text(text)
      print(filename, len(text))
