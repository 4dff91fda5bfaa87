"""experiments.ms_precision: FedHydra with float32 and bfloat16 MS, compared seed by seed."""

import json

import pytest

from experiments import ms_precision
from jfed.configs import fedhydra_digits
from tests.support import override


@pytest.mark.slow  # four whole FedHydra runs (README: the slow set)
def test_the_table_pairs_each_seeds_runs_and_a_rerun_skips_them(tmp_path, capsys):
  config = override(fedhydra_digits.get_config('smoke'), model='mlp')
  table = ms_precision.run_table(config, tmp_path / 'out', [0, 1], doc=str(tmp_path / 'doc.md'))
  results = json.loads((tmp_path / 'out' / 'results.json').read_text())['results']['ms_precision']
  assert sorted(results) == ['0', '1'] and all(
    sorted(r) == ['bfloat16', 'float32'] for r in results.values()
  )
  for seed in ('0', '1'):
    f32, bf16 = results[seed]['float32'], results[seed]['bfloat16']
    assert f32['U_r'] != bf16['U_r']  # the dtype reached MS
    assert (tmp_path / 'out' / 'bfloat16' / f'seed{seed}' / 'model_stratification.npz').is_file()
  diffs = [
    results[s]['bfloat16']['final_test_accuracy'] - results[s]['float32']['final_test_accuracy']
    for s in ('0', '1')
  ]
  assert f'paired by seed: {ms_precision.mean_std(diffs)} points (n = 2)' in table
  assert '| float32 |' in table and '| bfloat16 |' in table
  assert (tmp_path / 'doc.md').read_text() == table
  capsys.readouterr()
  again = ms_precision.run_table(config, tmp_path / 'out', [0, 1])
  assert again == table and 'seed=0' not in capsys.readouterr().out


@pytest.mark.parametrize(
  'diffs,verdict',
  [
    ([0.001, -0.001, 0.002], '**within** the 0.5 point bar'),
    ([0.03, 0.031, 0.029], '**not within** the 0.5 point bar'),
    ([-0.0125, 0.05], '**not decided**: |mean| ± 2 standard errors (1.88 ± 6.25) spans'),
    ([0.0], '**not decided**: |mean| ± 2 standard errors (0.00 ± inf) spans'),
  ],
)
def test_the_bar_is_decided_at_two_standard_errors_of_the_paired_differences(diffs, verdict):
  assert ms_precision._verdict(diffs).startswith(verdict)
