"""The parity harness (experiments/parity): its statistics, its reading of DENSE's recorded
tests, the table, the shim on a stand-in of DENSE's code, and jfed's side on digits."""

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.parity import jfed_side, ref_dense, references
from experiments.parity import stats as parity_stats
from experiments.parity.references import parse_budget
from experiments.parity.tables import render
from tests.support import override

# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------


def _tost_by_hand(d, margin):
  """TOST p from the t distribution directly (not through ttest_1samp)."""
  d = np.asarray(d, np.float64)
  n = len(d)
  se = d.std(ddof=1) / math.sqrt(n)
  t_low = (d.mean() + margin) / se  # H0: mean <= -margin
  t_high = (d.mean() - margin) / se  # H0: mean >= +margin
  return max(scipy_stats.t.sf(t_low, n - 1), scipy_stats.t.cdf(t_high, n - 1))


def test_equivalence_p_is_the_larger_one_sided_p():
  a = [60.1, 58.7, 61.4, 59.9]
  b = [60.4, 58.2, 61.0, 60.5]
  v = parity_stats.paired_verdict(a, b, margin=2.0)
  d = np.subtract(a, b)
  assert v.equivalence_p == pytest.approx(_tost_by_hand(d, 2.0), rel=1e-9)
  two_sided = 2 * scipy_stats.t.sf(abs(d.mean()) / (d.std(ddof=1) / 2.0), 3)
  assert v.difference_p == pytest.approx(two_sided, rel=1e-9)
  assert v.mean_difference == pytest.approx(d.mean())
  assert v.verdict == 'equivalent'


def test_a_consistent_shift_is_different_and_not_equivalent():
  b = [50.0, 55.0, 60.0, 52.0, 58.0]
  a = [x - 6.0 + e for x, e in zip(b, (0.1, -0.2, 0.15, 0.0, -0.1))]
  v = parity_stats.paired_verdict(a, b)
  assert v.verdict == 'different'
  assert v.difference_p < 0.05 and v.equivalence_p > 0.05


def test_noisy_small_samples_are_inconclusive_not_similar():
  v = parity_stats.paired_verdict([50.0, 60.0, 40.0], [55.0, 52.0, 47.0])
  assert v.verdict == 'inconclusive'


def test_one_seed_gives_no_verdict_and_lengths_must_match():
  assert parity_stats.paired_verdict([1.0], [2.0]).verdict == 'too few seeds'
  with pytest.raises(ValueError, match='differ in length'):
    parity_stats.paired_verdict([1.0, 2.0], [1.0])


def test_constant_differences_decide_by_the_margin():
  assert parity_stats.paired_verdict([3.0, 4.0], [2.0, 3.0]).verdict == 'equivalent'
  assert parity_stats.paired_verdict([9.0, 10.0], [2.0, 3.0]).verdict == 'different'


def test_mean_std_uses_the_sample_std():
  assert parity_stats.mean_std([1.0, 3.0]) == f'2.00 ± {math.sqrt(2):.2f}'
  assert parity_stats.mean_std([]) == '—'


# ------------------------------------------------------------------------------------------------
# flags, DENSE's reading, the registry
# ------------------------------------------------------------------------------------------------


def test_budget_overrides_keep_their_defaults_types():
  b = parse_budget(ref_dense.DEFAULT_BUDGET, ['local_epochs=3', 'kd_lr=0.1'])
  assert b['local_epochs'] == 3 and isinstance(b['local_epochs'], int)
  assert b['kd_lr'] == 0.1 and b['g_steps'] == ref_dense.DEFAULT_BUDGET['g_steps']
  with pytest.raises(ValueError, match='KEY=VALUE'):
    parse_budget(ref_dense.DEFAULT_BUDGET, ['no_such=1'])
  with pytest.raises(ValueError, match='takes a int'):
    parse_budget(ref_dense.DEFAULT_BUDGET, ['local_epochs=two'])


def _tests(values):
  return {'tests': [{'accuracy': v} for v in values]}


def test_dense_pretrain_tests_are_read_in_the_codes_order():
  budget = {**ref_dense.DEFAULT_BUDGET, 'local_epochs': 2}
  # client 0's two epochs, client 1's two, then FedAvg (uniform average) and the ensemble
  out = ref_dense.read('pretrain', _tests([10, 20, 30, 40, 55, 66]), 2, budget)
  assert out['client_curves'] == [[10, 20], [30, 40]]
  assert out['rows'] == {
    'client 0': 20.0,
    'client 1': 40.0,
    'mean of the clients': 30.0,
    'teacher ensemble (mean logits)': 66.0,
    'FedAvg, uniform average': 55.0,
  }
  with pytest.raises(ValueError, match='expected 6'):
    ref_dense.read('pretrain', _tests([1, 2, 3]), 2, budget)


def test_dense_kd_tests_skip_the_average_and_ensemble():
  budget = {**ref_dense.DEFAULT_BUDGET, 'kd_epochs': 3}
  out = ref_dense.read('kd_train', _tests([50, 60, 11, 33, 22]), 5, budget)
  assert out['rows'] == {'DENSE final': 22.0, 'DENSE best': 33.0}


def test_dense_flags_carry_the_budget():
  budget = {**ref_dense.DEFAULT_BUDGET, 'local_epochs': 7, 'kd_epochs': 4}
  names = ref_dense.REFERENCE.datasets['fashion_mnist']
  pre = ref_dense.stage_args('pretrain', names, budget, 3, 5)
  assert {'--local_ep=7', '--seed=3', '--num_users=5', '--dataset=fmnist'} <= set(pre)
  kd = ref_dense.stage_args('kd_train', names, budget, 3, 5)
  assert {'--epochs=4', '--type=kd_train', '--T=20.0'} <= set(kd)
  # jfed runs DENSE's code's BN loss (none: its hooks never attach) at the same budget
  over = ref_dense.REFERENCE.methods['dense'].jfed_overrides(budget)
  assert over['dense.bn_loss_mode'] == 'code' and over['dense.epochs'] == 4
  assert over['local.epochs'] == over['fedavg.local_epochs'] == over['dense.local_epochs'] == 7


def test_coboosting_overrides_take_the_codes_set_up_and_name_keys_the_config_has():
  """Both Co-Boosting parity methods read the code's loaders: 32×32 (`registry.py`
  `T.Resize((32, 32))`) in [−1, 1] (`NORMALIZE_DICT` mean = std = 0.5); Co-Boosting updates its
  ensemble weights before the epoch's batch joins the pool (`coboost.py`). The keys are applied
  as the harness applies them (`section.field`), those three to keys the config already has,
  and the run config and the method accept the result."""
  from experiments.parity import ref_coboosting
  from jfed import api, driver
  from jfed.configs.base import base_config

  config = base_config()
  assert {'image_size', 'normalization'} <= set(config.dataset)
  assert 'weight_update_order' in config.coboosting
  for name in ('fedavg', 'coboosting'):
    over = ref_coboosting.REFERENCE.methods[name].jfed_overrides(ref_coboosting.DEFAULT_BUDGET)
    assert over['dataset.image_size'] == 32 and over['dataset.normalization'] == 'half', name
    for key, value in over.items():
      section, _, field = key.rpartition('.')
      (config[section] if section else config)[field] = value
  assert config.coboosting.weight_update_order == 'before_batch'
  run = api.parse_run_config(config).dataset
  assert (run.image_size, run.normalization) == (32, 'half')
  driver.build_algorithm('coboosting', config)


def test_methods_are_named_reference_colon_method():
  ref, method = references.find_method('dense:fedavg')
  assert ref.name == 'dense' and method.jfed_methods == ('fedavg',)
  assert references.find_method('dense')[1].stages == ('pretrain', 'kd_train')
  with pytest.raises(ValueError, match='dense:fedavg'):
    references.find_method('dense:nothing')


def test_prepare_copies_a_checkout_and_refuses_other_folders(tmp_path):
  checkout = tmp_path / 'DENSE'
  (checkout / 'helpers').mkdir(parents=True)
  (checkout / 'loop_df_fl.py').write_text('print(1)\n')
  (checkout / 'helpers' / 'utils.py').write_text('x = 1\n')
  copy = ref_dense.REFERENCE.prepare(checkout, tmp_path / 'scratch')
  assert (copy / 'helpers' / 'utils.py').read_text() == 'x = 1\n'
  assert copy.parent == tmp_path / 'scratch'
  with pytest.raises(ValueError, match='not a checkout of zj-jayzhang/DENSE'):
    ref_dense.REFERENCE.prepare(tmp_path / 'scratch', tmp_path / 'other')


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------


def _write_seed(out, seed, jfed_clients, ref_clients, shift=0.0):
  d = out / f'seed{seed}'
  d.mkdir(parents=True)
  jfed = {
    'client_accuracy': jfed_clients,
    'ensemble_accuracy': 60.0 + shift,
    'uniform_average_accuracy': 40.0,
    'weighted_average_accuracy': 41.0,
    'methods': {'fedavg': {'final_accuracy': 41.0, 'best_accuracy': 41.0}},
  }
  (d / 'jfed.json').write_text(json.dumps(jfed))
  rows = references.local_rows(ref_clients, 60.0, 40.0 + seed)
  (d / 'reference_dense_pretrain.json').write_text(
    json.dumps({'rows': rows, 'client_curves': [[c - 1, c] for c in ref_clients]})
  )


def test_the_table_pairs_rows_by_seed_and_tests_them(tmp_path):
  _write_seed(tmp_path, 0, [70.0, 50.0], [70.5, 50.2], shift=0.1)
  _write_seed(tmp_path, 1, [71.0, 52.0], [70.8, 52.3], shift=-0.2)
  _write_seed(tmp_path, 2, [69.0, 49.0], [69.1, 49.4], shift=0.05)
  (tmp_path / 'seed3').mkdir()  # a seed with one side only is left out
  ref, method = references.find_method('dense:fedavg')
  params = {'flags': {'method': 'dense:fedavg', 'dataset': 'fashion_mnist'}, 'budget': {'x': 1}}
  text = render(tmp_path, ref, method, [0, 1, 2, 3], params)
  assert '## Over 3 seeds (0, 1, 2)' in text
  assert '| 1 | client 0 | 71.00 | 70.80 | +0.20 |' in text
  assert '| FedAvg (jfed fedavg) | 41.00 ± 0.00 | — | | | | one side only |' in text
  line = next(x for x in text.splitlines() if x.startswith('| teacher ensemble'))
  assert line.endswith('| equivalent |')
  line = next(x for x in text.splitlines() if x.startswith('| FedAvg, uniform average |'))
  # jfed 40 against 40, 41, 42: a mean difference of -1 with a spread of 1
  assert '| -1.00 |' in line
  assert '- seed 2, client 1: epoch 1 48.4, last five epochs 48.4, 49.4' in text


def test_no_finished_seed_says_so(tmp_path):
  ref, method = references.find_method('dense:fedavg')
  assert 'No seed has both sides yet.' in render(tmp_path, ref, method, [0], {})


# ------------------------------------------------------------------------------------------------
# the shim, on a stand-in of DENSE's code (its module names and call order)
# ------------------------------------------------------------------------------------------------

FAKE_DATASETS = """
import numpy as np

def load_data(dataset):
  y = np.arange(20) % 4
  return None, y, None, None, 'train', 'test'

def record_net_data_stats(y_train, net_dataidx_map):
  return {k: len(v) for k, v in net_dataidx_map.items()}

def partition_data(dataset, partition, beta=0.4, num_users=5):
  raise AssertionError('the shim must replace this')
"""

FAKE_UTILS = """
def test(model, loader):
  return float(model), 0.5
"""

FAKE_MAIN = """
import argparse, json
import torch
import wandb
from helpers.datasets import partition_data
from helpers.utils import test

p = argparse.ArgumentParser()
p.add_argument('--num_users', type=int)
p.add_argument('--local_ep', type=int)
args = p.parse_args()
wandb.init(config=args)
x = torch.ones(2).cuda()  # no GPU here: the shim makes this a no-op
train, _, groups, counts = partition_data('fmnist', 'dirichlet', beta=0.5, num_users=args.num_users)
assert train == 'train'
for k in range(args.num_users):
  for e in range(args.local_ep):
    test(10 * k + e, None)
with open('groups.json', 'w') as f:
  json.dump({str(k): sorted(int(i) for i in v) for k, v in groups.items()}, f)
"""


def test_the_shim_feeds_the_partition_and_records_every_test(tmp_path):
  pytest.importorskip('torch')
  code = tmp_path / 'code'
  (code / 'helpers').mkdir(parents=True)
  (code / 'helpers' / '__init__.py').write_text('')
  (code / 'helpers' / 'datasets.py').write_text(FAKE_DATASETS)
  (code / 'helpers' / 'utils.py').write_text(FAKE_UTILS)
  (code / 'loop_df_fl.py').write_text(FAKE_MAIN)
  parts = [[3, 1, 2], [7, 9], [0, 4, 5]]
  (tmp_path / 'partition.json').write_text(json.dumps(parts))
  result = tmp_path / 'result.json'
  shim = pathlib.Path(ref_dense.REFERENCE.shim)
  cmd = [
    sys.executable,
    str(shim),
    f'--ref_dir={code}',
    f'--partition={tmp_path / "partition.json"}',
  ]
  cmd += [f'--data_root={tmp_path}', f'--result={result}', '--', '--num_users=3', '--local_ep=2']
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  recorded = json.loads(result.read_text())
  assert [t['accuracy'] for t in recorded['tests']] == [0, 1, 10, 11, 20, 21]
  groups = json.loads((tmp_path / 'groups.json').read_text())
  assert groups == {'0': [1, 2, 3], '1': [7, 9], '2': [0, 4, 5]}
  # a partition file with another number of clients is refused
  cmd[-2] = '--num_users=4'
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and 'has 3 clients' in done.stderr


# ------------------------------------------------------------------------------------------------
# jfed's side
# ------------------------------------------------------------------------------------------------


def test_jfed_side_reports_clients_ensemble_and_both_averages(tmp_path):
  from jfed.configs import digits
  from jfed.data import load_dataset, make_partition

  config = override(
    digits.get_config('smoke'),
    **{'logging.tensorboard': False, 'partition.num_clients': 3, 'dataset.holdout_size': 0},
  )
  for key, value in (
    ref_dense.REFERENCE.methods['fedavg']
    .jfed_overrides({**ref_dense.DEFAULT_BUDGET, 'local_epochs': 1, 'local_batch': 64})
    .items()
  ):
    section, _, field = key.rpartition('.')
    (config[section] if section else config)[field] = value
  config.model = 'mlp'
  data = load_dataset('digits')
  parts = make_partition(data.train_y, 3, 'dirichlet', 0, alpha=1.0)
  out = jfed_side.run_methods(config, data, parts, ('fedavg',), 1, tmp_path / 'local')
  assert len(out['client_accuracy']) == 3
  assert all(0 < a <= 100 for a in out['client_accuracy'])
  # the driver's one-shot FedAvg (reuse_local_models) is the size-weighted average the harness
  # computes from the same local models by another path
  assert out['methods']['fedavg']['final_accuracy'] == pytest.approx(
    out['weighted_average_accuracy'], abs=1e-6
  )
  rows = jfed_side.rows(out, {'fedavg': 'FedAvg (jfed fedavg)'})
  assert rows['mean of the clients'] == pytest.approx(np.mean(out['client_accuracy']))
  assert set(rows) >= {'client 2', 'teacher ensemble (mean logits)', 'FedAvg, uniform average'}
  # the local models were cached: a second run reads them back and reports the same
  again = jfed_side.run_methods(config, data, parts, ('fedavg',), 1, tmp_path / 'local')
  assert again['client_accuracy'] == out['client_accuracy']
