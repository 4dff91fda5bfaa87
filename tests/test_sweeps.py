"""The comparison commands end to end on digits: the FedHydra Table 1/2 and FedMHO Table 3/4
sweeps, and the FedTSA Table 3/4 sweep."""

import json
import pathlib

import numpy as np
import pytest

from experiments import fedhydra_tables, fedmho_tables, fedtsa_tables
from experiments.configs import fedhydra_digits, fedmho_digits, fedtsa_digits
from jfed.errors import ConfigError

# FedAvg and OT average the shared local models; FedDF distils them (and reports the teacher
# ensemble): the cheapest methods that cover every kind of row of the tables.
METHODS = ['fedavg', 'ot', 'feddf']
PARTITIONS = ['dir0.5', '2c/c']
CHANCE = 0.1


@pytest.mark.slow  # local training on two partitions at the quick budget, where clients learn
def test_fedhydra_tables_sweep_runs_resumes_and_renders(tmp_path):
  config = fedhydra_digits.get_config('quick')
  table = fedhydra_tables.run_sweep(config, tmp_path, METHODS, PARTITIONS)
  results = json.loads((tmp_path / 'results.json').read_text())['results']
  assert list(results) == PARTITIONS
  for partition in PARTITIONS:
    d = tmp_path / partition.replace('/', '')
    assert (d / 'local_models').is_dir() and (d / 'accuracy_vs_epoch.png').exists()
    for m in METHODS:
      assert 'error' not in results[partition][m], results[partition][m]
    # one set of client models per partition: one-shot FedAvg averaged the shared ones
    assert not (d / 'fedavg' / 'local_models').exists()
    assert json.loads((d / 'fedavg' / 'summary.json').read_text())['reused_local_models']
    # the clients and their ensemble learned, on either partition (a 2c/c client knows 2 of the
    # 10 classes: 0.2 is its best possible test accuracy)
    ensemble = results[partition]['feddf']['teacher_ensemble_test_accuracy']
    assert ensemble > CHANCE + 0.1, (partition, ensemble)
    assert min(results[partition]['feddf']['client_test_accuracy']) > CHANCE + 0.05
  assert results['dir0.5']['feddf']['teacher_ensemble_test_accuracy'] > CHANCE + 0.3
  for m in METHODS:  # Dir(0.5): every method's one model learned
    accuracy = results['dir0.5'][m]['final_test_accuracy']
    assert accuracy > CHANCE + 0.2, (m, accuracy)

  assert '## Table 1 (Dirichlet)' in table and '## Table 2 (2c/c)' in table
  assert '(75.76)' not in table  # the paper's Fashion-MNIST numbers only beside FMNIST runs
  fedavg = results['dir0.5']['fedavg']['final_test_accuracy']
  assert f'| FedAvg | {100 * fedavg:.2f} |' in table
  ensemble = results['dir0.5']['feddf']['teacher_ensemble_test_accuracy']
  assert f'| *Teacher ensemble (mean logits)* | {100 * ensemble:.2f} |' in table

  # rerunning skips the finished runs and reproduces the same numbers
  again = fedhydra_tables.run_sweep(config, tmp_path, METHODS, PARTITIONS)
  assert again == table


FEDMHO_RUNS = ['fedavg_vote', 'fedmho_sd', 'fedmho_sd_nofilter']


def test_fedmho_tables_sweep_shares_clients_averages_seeds_and_resumes(tmp_path):
  config = str(pathlib.Path(fedmho_digits.__file__))
  args = (config, 'smoke', tmp_path, FEDMHO_RUNS, [0.5], [0, 1])
  table = fedmho_tables.run_sweep(*args)
  results = json.loads((tmp_path / 'results.json').read_text())['results']['0.5']
  assert sorted(results) == ['0', '1']
  for seed in ('0', '1'):
    cell = tmp_path / 'dir0.5' / f'seed{seed}'
    for run in FEDMHO_RUNS:
      assert 'error' not in results[seed][run], results[seed][run]
      assert not (cell / run / 'local_models').exists()  # the client set's, shared
    assert (cell / 'fedmho' / 'local_cvaes').is_dir() and (cell / 'baselines').is_dir()
    sd, ablation = (
      json.loads((cell / r / 'config.json').read_text())['fedmho']
      for r in ('fedmho_sd', 'fedmho_sd_nofilter')
    )
    assert ablation['clean_rate'] == 1.0 and sd['clean_rate'] == 0.8
    assert ablation['num_synthetic'] == round(0.8 * sd['num_synthetic'])
    # the ablation generated as many samples as the filtered run kept
    kept = [results[seed][r]['synthetic_kept'] for r in ('fedmho_sd', 'fedmho_sd_nofilter')]
    assert abs(kept[0] - kept[1]) <= 10, kept
  # the seeds differ (partition, inits), and the cell is their mean ± sample std
  finals = [results[s]['fedmho_sd']['final_test_accuracy'] for s in ('0', '1')]
  assert finals[0] != finals[1]
  mean, std = 100 * np.mean(finals), 100 * np.std(finals, ddof=1)
  assert f'| FedMHO-SD | {mean:.2f} ± {std:.2f} (n=2) |' in table
  assert '## Table 4' in table and '77.73' not in table  # paper numbers only beside FMNIST
  assert (tmp_path / 'table3.png').exists()
  # rerunning skips the finished runs and reproduces the same numbers
  assert fedmho_tables.run_sweep(*args) == table


FEDTSA_RUNS = ['heterofl', 'fedtsa', 'fedtsa_stage1_only']


@pytest.mark.slow  # ten smoke-sized multi-round runs
def test_fedtsa_tables_cells_degrees_ablations_and_resume(tmp_path):
  config = str(pathlib.Path(fedtsa_digits.__file__))
  args = (config, 'smoke', tmp_path, FEDTSA_RUNS, ['iid'], ['1.0/0.5'], [0, 1])
  table = fedtsa_tables.run_sweep(*args)
  results = json.loads((tmp_path / 'results.json').read_text())['results']
  assert sorted(results) == ['iid', 'iid,rates=0.5/1.0']
  for seed in ('0', '1'):
    for run in FEDTSA_RUNS:
      assert 'error' not in results['iid'][seed][run], results['iid'][seed][run]
    # Table 4's degree: heterogeneous methods only, on the degree's clients and device classes
    assert sorted(results['iid,rates=0.5/1.0'][seed]) == ['fedtsa', 'heterofl']
    degree = tmp_path / 'iid_rates0.5-1.0' / f'seed{seed}'
    fedtsa = json.loads((degree / 'fedtsa' / 'config.json').read_text())
    assert fedtsa['fedtsa']['device_rates'] == '1,0.5'
    heterofl = json.loads((degree / 'heterofl' / 'config.json').read_text())
    assert (
      heterofl['client_models'].split(';') == ['mlp:width_mult=1'] * 3 + ['mlp:width_mult=0.5'] * 2
    )
    ablation = json.loads(
      (tmp_path / 'iid' / f'seed{seed}' / 'fedtsa_stage1_only' / 'config.json').read_text()
    )
    assert ablation['fedtsa']['stage2'] is False
    for run in FEDTSA_RUNS:  # every run learned (chance 10 %)
      assert results['iid'][seed][run]['final_test_accuracy'] > CHANCE + 0.2, (seed, run)
  finals = [results['iid'][s]['fedtsa']['final_test_accuracy'] for s in ('0', '1')]
  assert finals[0] != finals[1]
  mean, std = 100 * np.mean(finals), 100 * np.std(finals, ddof=1)
  assert f'| FedTSA | {mean:.2f} ± {std:.2f} (n=2) |' in table
  assert '## Table 4' in table and '| [0.5, 1.0] |' in table and '## Ablations' in table
  assert (tmp_path / 'table3.png').exists() and (tmp_path / 'table4.png').exists()
  # rerunning skips the finished runs and reproduces the same tables
  assert fedtsa_tables.run_sweep(*args) == table


def test_fedtsa_tables_merges_sweeps_of_other_seeds(tmp_path):
  """Seeds run in parallel sweeps are merged into one table; a conflicting record fails."""
  config = str(pathlib.Path(fedtsa_digits.__file__))
  cell = 'iid,rates=0.5/1.0'

  def sweep(name, seed, acc, status=None):
    out = tmp_path / name
    out.mkdir()
    record = {'status': 'error', 'error': 'x'} if status else {'final_test_accuracy': acc}
    results = {cell: {str(seed): {'fedtsa': record, 'heterofl': {'final_test_accuracy': 0.5}}}}
    meta = {'seeds': [seed]}
    (out / 'results.json').write_text(json.dumps({'meta': meta, 'results': results}))
    return str(out)

  sweep('a', 0, 0.8)
  b = sweep('b', 1, 0.9)
  err = sweep('c', 1, 0.0, status='error')
  args = (config, 'smoke', tmp_path / 'a', ['heterofl', 'fedtsa'], [], ['0.5/1.0'], [0])
  table = fedtsa_tables.run_sweep(*args, merge=[err, b])
  assert '| [0.5, 1.0] | 50.00 ± 0.00 (n=2) | 85.00 ± 7.07 (n=2) |' in table
  assert 'seeds [0, 1]' in table and (tmp_path / 'a' / 'table4.png').exists()
  assert not (tmp_path / 'a' / cell.replace(',', '_')).exists()  # merging runs nothing
  # merging into an OUT that already holds merged seeds keeps them in the header
  table = fedtsa_tables.run_sweep(*args, merge=[sweep('e', 2, 0.85)])
  assert 'seeds [0, 1, 2]' in table and '85.00 ± 5.00 (n=3)' in table
  other = sweep('d', 1, 0.7)
  with pytest.raises(ValueError, match='differs'):
    fedtsa_tables.run_sweep(*args, merge=[other])
  with pytest.raises(ConfigError, match='does not exist'):
    fedtsa_tables.run_sweep(*args, merge=[str(tmp_path / 'missing')])


def test_fedtsa_tables_rejects_bad_runs_and_degrees(tmp_path):
  config = str(pathlib.Path(fedtsa_digits.__file__))
  with pytest.raises(ConfigError, match='unknown'):
    fedtsa_tables.run_sweep(config, 'smoke', tmp_path, ['fedtsa', 'nope'], ['iid'], [], [0])
  with pytest.raises(ConfigError, match='rates'):
    fedtsa_tables.run_sweep(config, 'smoke', tmp_path, ['fedtsa'], ['iid'], ['0.5/0.8'], [0])
  assert not (tmp_path / 'results.json').exists()


def test_seed_statistics_match_the_statistics_module():
  """The tables' mean ± sample std over seeds (in %), against Python's statistics module."""
  import statistics  # pylint: disable=g-import-not-at-top

  from experiments import seed_tables  # pylint: disable=g-import-not-at-top

  values = [0.812, 0.7905, 0.8433]
  pct = [100 * v for v in values]
  want = f'{statistics.mean(pct):.2f} ± {statistics.stdev(pct):.2f}'
  assert seed_tables.mean_std(values) == want
  assert seed_tables.mean_std([0.5]) == '50.00 ± 0.00' and seed_tables.mean_std([]) is None
  means, stds = seed_tables.percent_stats_each([values, [0.5], []])
  np.testing.assert_allclose(means[:2], [statistics.mean(pct), 50.0])
  np.testing.assert_allclose(stds, [statistics.stdev(pct), 0.0, 0.0])
  assert np.isnan(means[2])
  assert seed_tables.percent_stats_each([])[0].shape == (0,)
