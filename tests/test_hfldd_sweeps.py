"""experiments/hfldd_sweeps.py: HFLDD's K and distilled-size sweeps over seeds (HFLDD Table VII,
Fig. 7) on the digits smoke config, shrunk further by --override."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import hfldd_sweeps
from jfed.errors import ConfigError

CONFIG = 'experiments/configs/hfldd_digits.py'
# smoke (10 clients, 3 rounds) with an MLP, 2 rounds and a 10-iteration KIP: seconds per run
TINY = [
  'model=mlp',
  'hfldd.rounds=2',
  'hfldd.pretrain_epochs=1',
  'hfldd.public_size=60',
  'hfldd.kip.iterations=10',
  'logging.tensorboard=False',
]
PARTITIONS = ['c1']  # one row: each run costs seconds; the other rows' words: test_partition_words
VALUES = ['5', '10']


def sweep(out, seeds, merge=(), values=VALUES):
  return hfldd_sweeps.run_sweep(
    CONFIG,
    'distilled_size',
    values,
    out,
    PARTITIONS,
    seeds,
    budget='smoke',
    overrides=TINY,
    merge=merge,
  )


@pytest.fixture(scope='module')
def swept(tmp_path_factory):
  """Seed 0 of both values into OUT and seed 1 of the first into another OUT, merged into OUT:
  a cell over two seeds and one over one, in three runs."""
  root = tmp_path_factory.mktemp('hfldd_sweeps')
  out, other = root / 'out', root / 'seed1'
  sweep(out, [0])
  sweep(other, [1], values=VALUES[:1])
  text = sweep(out, [], merge=[str(other)])
  return out, other, text


def table_rows(text: str, heading: str) -> dict:
  """{row label: [cells]} of the markdown table under `heading`."""
  lines = text.split(heading, 1)[1].strip().splitlines()
  rows = {}
  for line in lines[2:]:
    if not line.startswith('|'):
      break
    cells = [c.strip() for c in line.strip('|').split('|')]
    rows[cells[0]] = cells[1:]
  return rows


def test_cells_are_the_mean_and_std_of_the_runs_summaries(swept):
  out, other, text = swept
  for heading, key in (
    ('## Final accuracy', 'final_test_accuracy'),
    ('## Best-round accuracy', 'best_test_accuracy'),
  ):
    rows = table_rows(text, heading)
    for p in PARTITIONS:
      for j, v in enumerate(VALUES):
        runs = [out / 'seed0' / f'{p}_{v}', other / 'seed1' / f'{p}_{v}']
        acc = [100 * json.loads((r / 'summary.json').read_text())[key] for r in runs if r.exists()]
        std = np.std(acc, ddof=1) if len(acc) > 1 else 0.0
        expected = f'{np.mean(acc):.2f} ± {std:.2f} (n={len(acc)})'
        assert len(acc) == (2 if v == VALUES[0] else 1)
        assert rows[hfldd_sweeps.PARTITION_LABELS[p]][j] == expected, (heading, p, v)
  saved = json.loads((out / 'results.json').read_text())
  assert saved['meta']['seeds'] == [0, 1] and saved['meta']['sweep'] == 'distilled_size'
  assert (out / 'accuracy.png').stat().st_size > 0
  config = json.loads((out / 'seed0' / 'c1_5' / 'config.json').read_text())
  assert config['hfldd']['kip']['support_size'] == 5 and config['partition']['k'] == 1
  assert config['model'] == 'mlp' and config['partition']['num_clients'] == 10  # overrides, smoke


def test_partition_words_and_the_swept_key():
  plan = hfldd_sweeps.make_plan(CONFIG, 'smoke', 'k', ['5', '7'], ['c1', 'c2', 'iid'], TINY)
  for p, k in (('c1', 1), ('c2', 2), ('iid', 10)):
    c = plan.config(p, 7, seed=3)
    assert (c.partition.scheme, c.partition.k, c.hfldd.K, c.seed) == ('shards', k, 7, 3)
    assert c.hfldd.kip.support_size == 20 and c.hfldd.kip.iterations == 10  # smoke, override
  fm = hfldd_sweeps.make_plan(
    'experiments/configs/hfldd_fashion_mnist.py', '', 'distilled_size', ['50'], ['c1'], []
  )
  assert fm.config('c1', 50, 0).hfldd.kip.support_size == 50  # a config with a 'c1' word


def test_finished_runs_are_not_rerun(swept):
  out, _, _ = swept
  files = sorted((out / 'seed0').glob('*/summary.json')) + sorted(
    (out / 'seed0').glob('*/metrics.jsonl')
  )
  assert len(files) == 2 * len(PARTITIONS) * len(VALUES)
  before = {f: f.stat().st_mtime_ns for f in files}
  text = sweep(out, [0])
  assert {f: f.stat().st_mtime_ns for f in files} == before
  assert '(n=2)' in text  # the merged seed is kept


def test_bad_sweep_name_fails_before_anything_is_written(tmp_path):
  out = tmp_path / 'out'
  with pytest.raises(ConfigError, match=r'--sweep=kk: unknown; valid: k, distilled_size'):
    hfldd_sweeps.run_sweep(CONFIG, 'kk', VALUES, out)
  assert not out.exists()
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.hfldd_sweeps',
      f'--config={CONFIG}',
      '--sweep=kk',
      '--values=5',
      f'--out={out}',
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=pathlib.Path(__file__).parents[1],
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
    'error: --sweep=kk: unknown; valid: k, distilled_size'
  ]
  assert not out.exists()


@pytest.mark.parametrize(
  'args, message',
  [
    ((f'{CONFIG}:c2', 'k', ['5'], ['c1']), 'needs #C=1 shards, but the config words'),
    ((CONFIG, 'k', ['5', 'x'], ['c1']), '--values: expected positive integers'),
    ((CONFIG, 'k', ['21'], ['c1']), 'K=21 exceeds the 20 clients'),
    ((CONFIG, 'k', ['5'], ['c3']), r"--partitions: unknown \['c3'\]"),
    ((f'{CONFIG}:nodd', 'distilled_size', ['5'], ['c1']), 'sends raw data'),
  ],
)
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, args, message):
  config, name, values, partitions = args
  with pytest.raises(ConfigError, match=message):
    hfldd_sweeps.run_sweep(config, name, values, tmp_path / 'out', partitions)
  assert not (tmp_path / 'out').exists()


def test_an_out_of_another_sweep_is_refused(swept):
  out, _, _ = swept
  with pytest.raises(ConfigError, match='holds another sweep'):
    hfldd_sweeps.run_sweep(CONFIG, 'k', ['5'], out, PARTITIONS, [0], budget='smoke', overrides=TINY)
