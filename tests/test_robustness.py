"""Attacks, robust aggregation, rejected uploads and server optimisers in whole FedAvg runs, and
the robustness command (issue 10)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import robustness
from jfed import driver
from jfed.configs import robustness as robustness_config
from jfed.data import FederatedArrays, load_dataset
from jfed.engine import ModelState, aggregation, attacks
from jfed.errors import ConfigError
from jfed.io import UploadError
from jfed.methods import common
from tests.support import Interrupted, interrupt_after, override, read_metrics

ROBUSTNESS_CONFIG = robustness_config.__file__


def _five_iid(**overrides):
  """Digits over 5 IID clients, MLP, 6 rounds x 2 epochs: the mean learns to about 0.9."""
  c = robustness_config.get_config('dataset=digits')
  c.partition.scheme, c.partition.num_clients = 'iid', 5
  # Krum's guarantee needs n >= 2f + 3: f = 1 of 5 clients; multi-Krum averages the 3 best
  c.aggregation.krum_byzantine, c.aggregation.krum_selected = 1, 3
  c.fedavg.rounds = 6
  return override(c, **overrides)


@pytest.fixture(scope='module')
def digits():
  return load_dataset('digits')


def _accuracy(digits, **overrides):
  return driver.run_in_memory('fedavg', _five_iid(**overrides), digits)


def test_one_sign_flipper_of_five_breaks_the_mean_but_not_the_robust_rules(digits):
  clean = _accuracy(digits).final_test_accuracy
  assert clean > 0.85
  attack = {'attack.kind': 'sign_flip', 'attack.clients': '2', 'attack.strength': 10.0}
  attacked_mean = _accuracy(digits, **attack)
  assert attacked_mean.final_test_accuracy < 0.25  # near chance (0.1)
  assert attacked_mean.extras['attackers'] == [2]
  for rule in ('median', 'trimmed_mean', 'krum'):
    robust = _accuracy(digits, **attack, **{'aggregation.rule': rule}).final_test_accuracy
    assert robust > clean - 0.05, (rule, robust, clean)


def test_a_norm_bound_rejects_the_attackers_uploads_and_counts_them(digits):
  attack = {'attack.kind': 'scaling', 'attack.clients': '1,3', 'attack.strength': 100.0}
  bounded = _accuracy(digits, **attack, **{'server.max_update_norm_ratio': 1.0})
  assert bounded.extras['rejected_uploads'] == 2 * 6  # two attackers, every round
  assert bounded.final_test_accuracy > 0.8
  with pytest.raises(UploadError, match='upload of client 1'):
    _accuracy(
      digits, **attack, **{'server.max_update_norm_ratio': 1.0, 'server.on_invalid_upload': 'fail'}
    )


def test_label_flippers_train_on_flipped_labels(digits):
  config = _five_iid(**{'attack.kind': 'label_flip', 'attack.clients': '0,4'})
  ctx = driver.context_of_config(config, digits)
  (group,) = common.client_groups(ctx)
  for row, cid in enumerate(group.client_ids):
    n = group.fed.sizes[row]
    honest = digits.train_y[ctx.parts[cid]]
    want = 9 - honest if cid in (0, 4) else honest
    np.testing.assert_array_equal(group.fed.y[row, :n], want)


def _server(rule='median', on_invalid='drop', attack=('none', '')):
  config = aggregation.AggregationConfig(rule, 0.2, 1, 1, 100, 1e-6, 0.0)
  return common.Server(
    aggregation.make_aggregator(config),
    attacks.AttackConfig(attack[0], 0.0, attack[1], 10.0),
    attacks.parse_client_ids(attack[1], 10),
    jax.random.PRNGKey(0),
    on_invalid,
    0.0,
    np.full(10, 50),
  )


def test_the_server_aggregates_the_valid_uploads_of_the_clients_taking_part():
  ids = np.array([3, 5, 7, 8, 9])
  group = common.ClientGroup('mlp', None, ids, FederatedArrays(None, None, np.full(5, 20)))
  rows = np.array([[1.0, 2], [3, 4], [5, 6], [np.nan, 0], [100, 100]], np.float32)
  stacked = ModelState({'w': jnp.asarray(rows)}, {})
  template = ModelState({'w': jnp.zeros(2)}, {})
  taking_part = np.array([True, True, True, True, False])  # client 9 sits the round out
  model, record = _server().receive(group, stacked, template, template, 0, taking_part=taking_part)
  # client 8's NaN upload is rejected; the median of clients 3, 5, 7 remains
  np.testing.assert_allclose(model.params['w'], [3.0, 4.0])
  assert record['rejected_uploads'] == 1 and record['rejected_clients'] == [8]
  with pytest.raises(UploadError, match='upload of client 8'):
    _server(on_invalid='fail').receive(
      group, stacked, template, template, 0, taking_part=taking_part
    )
  # a sign-flipping client 5 (reference 0): its row becomes -10 x [3, 4]
  flipped, _ = _server('mean', attack=('sign_flip', '5')).receive(
    group, stacked, template, template, 0, weights=np.ones(5), taking_part=taking_part
  )
  np.testing.assert_allclose(flipped.params['w'], np.mean([[1, 2], [-30, -40], [5, 6]], 0))


@pytest.mark.parametrize(
  'overrides, message',
  [
    ({'aggregation.rule': 'mode'}, 'aggregation.rule is'),
    ({'aggregation.trim_fraction': 0.5}, r'aggregation.trim_fraction must be in \[0, 0.5\)'),
    ({'attack.kind': 'backdoor'}, 'attack.kind is'),
    ({'attack.fraction': 1.5}, r'attack.fraction must be in \[0, 1\]'),
    ({'attack.clients': '1,9'}, "'9' is not a client id"),
    ({'server.on_invalid_upload': 'ignore'}, 'server.on_invalid_upload is'),
    ({'server_optimizer.name': 'fedlamb'}, 'server_optimizer.name is'),
    ({'server_optimizer.b2': 1.0}, r'server_optimizer.b2 must be in \[0, 1\)'),
  ],
)
def test_bad_server_settings_fail_before_anything_is_written(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    driver.run_experiment('fedavg', _five_iid(**overrides), tmp_path / 'w', progress=False)
  assert not (tmp_path / 'w').exists()


def test_fedavgm_and_fedadam_learn_and_resume_with_their_server_state(tmp_path, monkeypatch):
  plain = driver.run_in_memory('fedavg', _five_iid())
  for name, lr in (('fedavgm', 1.0), ('fedadam', 0.01)):
    config = _five_iid(**{'server_optimizer.name': name, 'server_optimizer.lr': lr})
    whole = driver.run_experiment('fedavg', config, tmp_path / name, progress=False)
    assert whole.final_test_accuracy > 0.8 and whole.extras['server_optimizer'] == name
    assert whole.final_test_accuracy != plain.final_test_accuracy
    with monkeypatch.context() as m:
      interrupt_after(m, 3)
      with pytest.raises(Interrupted):
        driver.run_experiment('fedavg', config, tmp_path / f'{name}_killed', progress=False)
    resumed = driver.run_experiment('fedavg', config, tmp_path / f'{name}_killed', progress=False)
    assert read_metrics(tmp_path / f'{name}_killed') == read_metrics(tmp_path / name)
    assert resumed.final_test_accuracy == whole.final_test_accuracy


@pytest.mark.slow
def test_the_robustness_command_writes_its_table_and_plot(tmp_path):
  out = tmp_path / 'rob'
  text = robustness.run_sweep(
    f'{ROBUSTNESS_CONFIG}:dataset=digits,smoke',
    out,
    seeds=[0, 1],
    rules=['mean', 'median'],
    attacks=['sign_flip'],
    fractions=['0.2'],
  )
  results = json.loads((out / 'results.json').read_text())['results']
  for rule in ('mean', 'median'):
    for cell in ('none_0', 'sign_flip_0.2'):
      assert sorted(results[cell]) == ['0', '1']  # results[cell][seed][rule]
      assert all('final_test_accuracy' in r[rule] for r in results[cell].values())
  assert '| mean |' in text and '| median |' in text and (out / 'robustness.png').stat().st_size
  clean = np.mean([r['mean']['final_test_accuracy'] for r in results['none_0'].values()])
  attacked = np.mean([r['mean']['final_test_accuracy'] for r in results['sign_flip_0.2'].values()])
  assert attacked < clean
  with pytest.raises(ConfigError, match='--rules: unknown'):
    robustness.run_sweep(
      f'{ROBUSTNESS_CONFIG}:dataset=digits', out, [0], ['mode'], ['sign_flip'], ['0.2']
    )
