"""Settings that would quietly do nothing are refused before anything is written (issue 38):
a trimmed mean that trims no client, Krum without its n >= 2f + 3, negative attack strengths, a
seed outside [0, 2**32); and a round in which every upload was rejected fails the run unless
`server.allow_empty_rounds` allows it."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver
from jfed.configs import digits
from jfed.data import FederatedArrays
from jfed.engine import ModelState, aggregation, attacks
from jfed.errors import ConfigError, JfedError
from jfed.methods import common
from tests.support import override

ROOT = __import__('pathlib').Path(__file__).resolve().parents[1]


def _config(**overrides):
  """digits smoke, MLP, 5 clients (participation 1)."""
  c = digits.get_config('smoke')
  c.model = 'mlp'
  c.fedavg.rounds = 1
  return override(c, **overrides)


def _refused(tmp_path, overrides, message, method='fedavg'):
  with pytest.raises(ConfigError, match=message):
    driver.run_experiment(method, _config(**overrides), tmp_path / 'w', progress=False)
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize(
  'method, overrides, message',
  [
    (
      'fedavg',
      {'aggregation.rule': 'trimmed_mean', 'aggregation.trim_fraction': 0.1},
      r'^aggregation.trim_fraction=0.1 trims floor\(0.1\*5\)=0 of 5 clients\b.*'
      r'use aggregation.trim_fraction >= 0.2$',
    ),
    (
      'fedavg',
      {'aggregation.rule': 'trimmed_mean', 'aggregation.trim_fraction': 0.0},
      r'^aggregation.trim_fraction=0 trims floor\(0\*5\)=0 of 5 clients',
    ),
    (  # 3 of 5 clients per round: 0.2 trims floor(0.6) = 0
      'fedprox',
      {
        'aggregation.rule': 'trimmed_mean',
        'aggregation.trim_fraction': 0.2,
        'fedprox.participation': 0.6,
      },
      r'^aggregation.trim_fraction=0.2 trims floor\(0.2\*3\)=0 of 3 clients per round '
      r'\(fedprox.participation=0.6 of 5\).*use aggregation.trim_fraction >= 0.334',
    ),
    (
      'fedprox',
      {'aggregation.rule': 'trimmed_mean', 'fedprox.participation': 0.4},
      r'trims floor\(0.1\*2\)=0 of 2 clients per round.*at least 3 clients per aggregation: use '
      r'aggregation.rule=median or mean$',
    ),
  ],
  ids=['default_fraction', 'zero', 'participation', 'too_few_clients'],
)
def test_a_trimmed_mean_that_trims_nothing_is_refused(tmp_path, method, overrides, message):
  _refused(tmp_path, overrides, message, method)


@pytest.mark.parametrize(
  'overrides, message',
  [
    (
      {'aggregation.rule': 'krum', 'aggregation.krum_byzantine': 2},
      r'^aggregation.krum_byzantine=2: Krum needs n >= 2f \+ 3 = 7 clients per aggregation, '
      r'the config has 5 clients; use aggregation.krum_byzantine <= 1$',
    ),
    (  # 3 clients are enough for Krum at f = 0 only
      {
        'aggregation.rule': 'krum',
        'aggregation.krum_byzantine': 1,
        'partition.num_clients': 3,
      },
      r'^aggregation.krum_byzantine=1: Krum needs n >= 2f \+ 3 = 5 clients per aggregation, '
      r'the config has 3 clients; use aggregation.krum_byzantine <= 0$',
    ),
    (
      {
        'aggregation.rule': 'krum',
        'aggregation.krum_byzantine': 0,
        'partition.num_clients': 2,
      },
      r'^aggregation.krum_byzantine=0: Krum needs n >= 2f \+ 3 = 3 .* the config has 2 clients; '
      r'Krum needs at least 3',
    ),
    (
      {'aggregation.rule': 'krum', 'aggregation.krum_selected': 6},
      r'^aggregation.krum_selected=6 keeps more clients than an aggregation has \(5 clients\); '
      r'use aggregation.krum_selected <= 5',
    ),
  ],
  ids=['f_too_large', 'three_clients', 'too_few_clients', 'selected_too_many'],
)
def test_krum_sizes_are_checked_before_anything_is_written(tmp_path, overrides, message):
  _refused(tmp_path, overrides, message)


@pytest.mark.parametrize(
  'kind, message',
  [
    ('sign_flip', r'^attack.strength=-10 is negative: .*x10 scaling attack.*attack.strength=10'),
    ('scaling', r'^attack.strength=-10 is negative: .*sign flip.*attack.kind=sign_flip'),
    ('noise', r'^attack.strength=-10 is negative: .*standard deviation.*attack.strength=10'),
  ],
)
def test_a_negative_attack_strength_is_refused(tmp_path, kind, message):
  _refused(
    tmp_path,
    {'attack.kind': kind, 'attack.clients': '1', 'attack.strength': -10.0},
    message,
  )


@pytest.mark.parametrize('seed', [-1, 2**32])
def test_a_seed_out_of_range_names_the_key(tmp_path, seed):
  _refused(tmp_path, {'seed': seed}, rf'^seed={seed} is not in \[0, 2\*\*32\)')


@pytest.mark.parametrize(
  'overrides',
  [
    {'aggregation.rule': 'trimmed_mean', 'aggregation.trim_fraction': 0.2},
    {'aggregation.rule': 'trimmed_mean', 'partition.num_clients': 10},  # trims floor(1.0) = 1
    {'aggregation.rule': 'krum', 'aggregation.krum_byzantine': 1, 'aggregation.krum_selected': 5},
    {'attack.kind': 'same_value', 'attack.clients': '1', 'attack.strength': -10.0},
    {'seed': 2**32 - 1},
  ],
)
def test_settings_that_work_still_validate(overrides):
  driver.build_algorithm('fedavg', _config(**overrides))


def test_the_size_checks_name_the_number_they_use():
  a = aggregation.AggregationConfig('trimmed_mean', 0.25, 1, 1, 100, 1e-6, 0.0)
  assert aggregation.size_problem(a, 4, '4 clients') is None  # floor(1.0) = 1
  assert 'floor(0.25*3)=0 of 3 clients' in aggregation.size_problem(a, 3, '3 clients')
  assert attacks.strength_problem('same_value', -1.0) is None
  assert attacks.strength_problem('label_flip', -1.0) is None
  assert attacks.strength_problem('sign_flip', 0.0) is None


# ------------------------------------------------------------------------------------------------
# a round in which nothing was aggregated
# ------------------------------------------------------------------------------------------------
def _server(allow_empty: bool):
  config = aggregation.AggregationConfig('mean', 0.2, 1, 1, 100, 1e-6, 0.0)
  return common.Server(
    aggregation.make_aggregator(config),
    attacks.AttackConfig('none', 0.0, '', 10.0),
    np.zeros(0, np.int64),
    jax.random.PRNGKey(0),
    'drop',
    0.0,
    np.full(10, 50),
    allow_empty,
  )


def test_a_round_whose_uploads_were_all_rejected_fails_unless_allowed():
  ids = np.array([3, 5])
  group = common.ClientGroup('mlp', None, ids, FederatedArrays(None, None, np.full(2, 20)))
  stacked = ModelState({'w': jnp.asarray([[np.nan, 0.0], [1.0, np.inf]], jnp.float32)}, {})
  reference = ModelState({'w': jnp.asarray([7.0, 8.0], jnp.float32)}, {})
  message = (
    r'^round 4: all 2 uploads \(clients \[3, 5\]\) were rejected, so nothing was aggregated '
    r"\(the last: upload of client 5: params\['w'\] has non-finite values\); "
    r'set server.allow_empty_rounds=True to keep the global model in such a round$'
  )
  with pytest.raises(JfedError, match=message):
    _server(False).receive(group, stacked, reference, reference, 3)
  model, record = _server(True).receive(group, stacked, reference, reference, 3)
  np.testing.assert_array_equal(model.params['w'], reference.params['w'])
  assert record['rejected_uploads'] == 2


def test_a_run_whose_every_upload_is_rejected_fails(tmp_path):
  bound = {'server.max_update_norm_ratio': 1e-9}  # every update exceeds it
  with pytest.raises(JfedError, match='^round 1: all 5 uploads .* were rejected'):
    driver.run_in_memory('fedavg', _config(**bound))
  allowed = driver.run_in_memory('fedavg', _config(**bound, **{'server.allow_empty_rounds': True}))
  assert allowed.extras['rejected_uploads'] == 5


@pytest.mark.slow
def test_the_command_ends_in_one_error_line_when_every_upload_is_rejected(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.main',
      '--method=fedavg',
      f'--config={ROOT}/experiments/configs/digits.py:smoke',
      '--config.model=mlp',
      '--config.fedavg.rounds=1',
      '--config.server.max_update_norm_ratio=1e-9',
      f'--workdir={tmp_path / "w"}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 1, result.stderr[-2000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'were rejected' in errors[0], result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
