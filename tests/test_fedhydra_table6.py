"""experiments.fedhydra_table6: FedHydra's λ1 / λ2 sweep (Table 6) over seeds, one compiled
generator step for the whole sweep."""

import json

import jax
import numpy as np
import pytest

from experiments import fedhydra_table6
from jfed.configs import fedhydra_digits
from jfed.engine import compiles
from jfed.errors import ConfigError

PAIRS = [(1.0, 1.0), (0.0, 0.0)]
SEEDS = [0, 1]


def test_pairs_are_parsed_and_bad_ones_named():
  assert fedhydra_table6.parse_pairs(['1/0.5', '0/0']) == [(1.0, 0.5), (0.0, 0.0)]
  for bad in (['1'], ['a/1'], ['1/-1'], ['1/1', '1.0/1']):
    with pytest.raises(ConfigError, match='--pairs'):
      fedhydra_table6.parse_pairs(bad)


@pytest.mark.slow  # four FedHydra runs at the smoke budget
def test_the_sweep_runs_every_pair_from_shared_clients_compiles_once_and_resumes(tmp_path):
  config = fedhydra_digits.get_config('smoke')
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    table = fedhydra_table6.run_sweep(config, tmp_path, 'dir0.5', PAIRS, SEEDS)
  assert compiled.counts()['jit(_synthesis_step)'] == 1, compiled.summary()
  results = json.loads((tmp_path / 'results.json').read_text())['results']['dir0.5']
  for seed in SEEDS:
    assert (tmp_path / f'seed{seed}' / 'local_models').is_dir()
    for pair in PAIRS:
      run = fedhydra_table6.run_name(pair)
      d = tmp_path / f'seed{seed}' / run
      saved = json.loads((d / 'config.json').read_text())
      assert saved['seed'] == seed and saved['fedhydra']['synthesis_every_term']
      assert (saved['fedhydra']['lambda1'], saved['fedhydra']['lambda2']) == pair
      assert not (d / 'local_models').exists()  # the seed's shared clients
      summary = json.loads((d / 'summary.json').read_text())
      assert results[str(seed)][run]['final_test_accuracy'] == summary['final_test_accuracy']
  for pair in PAIRS:
    finals = [
      100 * results[str(s)][fedhydra_table6.run_name(pair)]['final_test_accuracy'] for s in SEEDS
    ]
    row = f'| {pair[0]:g} | {pair[1]:g} | {np.mean(finals):.2f} ± {np.std(finals, ddof=1):.2f}'
    assert row in table, table
  assert '## Orderings' in table and 'λ1=1, λ2=1 > λ1=0, λ2=0' in table
  stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob('seed*/*/summary.json')}
  fedhydra_table6.run_sweep(config, tmp_path, 'dir0.5', PAIRS, SEEDS)  # all finished: no run
  assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.glob('seed*/*/summary.json')}
