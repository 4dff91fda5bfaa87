"""Aggregation, attack and norm-bound settings are refused for a method that would ignore them
(issue 38): only the methods whose Algorithm class declares `server_round` send their uploads
through `common.Server.receive`, where attacks rewrite uploads, the norm bound rejects them and
the rule aggregates them; label flipping happens in `common.client_groups`, which every method
without a `label_flip_unsupported` reason trains its clients on."""

import pytest

from jfed import driver
from jfed.engine import attacks
from jfed.errors import ConfigError
from jfed.io import UploadError
from jfed.methods import common
from jfed.methods.registry import available_methods, get_method, registered_methods
from jfed.run_config import check_capabilities, validate_run_config
from tests.support import override, smoke_config

METHODS = available_methods()
SERVER_ROUND_METHODS = [m for m, cls in registered_methods().items() if cls.server_round]
LABEL_FLIP_METHODS = [
  m for m, cls in registered_methods().items() if not cls.label_flip_unsupported
]


def _problem(method, config):
  """`check_capabilities`' message for `method` under `config`, or None."""
  cls = get_method(method)
  try:
    check_capabilities(method, cls, validate_run_config(config, cls.section), registered_methods())
  except ConfigError as e:
    return str(e)
  return None


@pytest.mark.parametrize(
  'method, overrides, message',
  [
    ('dense', {'aggregation.rule': 'median'}, r'^aggregation.rule=median: dense would ignore it'),
    (
      'feddf',
      {'attack.kind': 'sign_flip', 'attack.clients': '1'},
      r'^attack.kind=sign_flip: feddf would ignore it',
    ),
    (
      'ot',
      {'aggregation.rule': 'geometric_median', 'aggregation.clip_norm': 2.0},
      r'^aggregation.rule=geometric_median, aggregation.clip_norm=2: ot would ignore them',
    ),
    (
      'fedhydra',
      {'server.max_update_norm_ratio': 1.5},
      r'^server.max_update_norm_ratio=1.5: fedhydra would ignore it.*apply to dynafed, fedavg, '
      r'fedprox, fedtsa, hfldd, hfldd_nodd only$',
    ),
    (
      'centralized',
      {'attack.kind': 'label_flip', 'attack.clients': '0'},
      r'^attack.kind=label_flip is not supported by centralized: it trains one model on the union',
    ),
    (
      'fedtsa',
      {'attack.kind': 'label_flip', 'attack.clients': '0'},
      r'^attack.kind=label_flip is not supported by fedtsa: it builds its cluster groups',
    ),
    (
      'fedproto',
      {'attack.kind': 'label_flip', 'attack.clients': '0'},
      r'^attack.kind=label_flip is not supported by fedproto: .*label counts',
    ),
    (
      'fedtsa',  # failed in setup, in make_trainers, before it was refused here
      {'optimizer.schedule': 'cosine'},
      r'^optimizer.schedule=cosine: fedtsa restarts its client optimisers every round, so a '
      r'schedule has no training run to span; use optimizer.schedule=constant \(schedules apply '
      r'to centralized only\)$',
    ),
    (
      'heterofl',  # ran with a constant rate, ignoring the setting
      {'optimizer.schedule': 'cosine'},
      r'^optimizer.schedule=cosine: heterofl restarts',
    ),
  ],
  ids=[
    'rule',
    'model_attack',
    'two_keys',
    'norm_bound',
    'label_flip',
    'fedtsa',
    'fedproto',
    'schedule',
    'schedule_heterofl',
  ],
)
def test_a_setting_the_method_would_ignore_is_refused_when_the_algorithm_is_built(
  method, overrides, message
):
  config = override(smoke_config(method), **overrides)
  assert _problem(method, config) is not None
  with pytest.raises(ConfigError, match=message):
    driver.build_algorithm(method, config)


@pytest.mark.parametrize(
  'method, overrides',
  [
    ('fedavg', {'aggregation.rule': 'median', 'attack.kind': 'sign_flip', 'attack.clients': '1'}),
    ('fedprox', {'server.max_update_norm_ratio': 2.0, 'aggregation.clip_norm': 1.0}),
    ('dense', {'attack.kind': 'label_flip', 'attack.clients': '1'}),
    ('dense', {'aggregation.trim_fraction': 0.3, 'attack.strength': 3.0}),  # rule, kind default
    ('centralized', {'optimizer.schedule': 'cosine'}),
  ],
  ids=['fedavg', 'fedprox', 'label_flip', 'defaults', 'schedule'],
)
def test_settings_the_method_honours_are_accepted(method, overrides):
  config = override(smoke_config(method), **overrides)
  assert _problem(method, config) is None
  driver.build_algorithm(method, config)


def test_the_declared_capabilities_are_those_of_the_papers_methods():
  """What each Algorithm class declares (the slow test below checks them against what the
  methods do): a server round for FedAvg/FedProx, DynaFed, FedTSA and HFLDD; no label flipping
  for centralized, FedTSA and FedProto; differential privacy for FedAvg and FedProx."""
  classes = registered_methods()
  assert SERVER_ROUND_METHODS == ['dynafed', 'fedavg', 'fedprox', 'fedtsa', 'hfldd', 'hfldd_nodd']
  assert sorted(set(METHODS) - set(LABEL_FLIP_METHODS)) == ['centralized', 'fedproto', 'fedtsa']
  assert [m for m, cls in classes.items() if cls.differential_privacy] == ['fedavg', 'fedprox']
  assert [m for m, cls in classes.items() if cls.lr_schedule] == ['centralized']


@pytest.mark.slow
@pytest.mark.parametrize('method', METHODS)
def test_the_methods_listed_as_honouring_the_settings_are_those_that_do(method, monkeypatch):
  """A tiny run of every registered method under a label-flipping attacker (built without the
  refusal): `Server.receive` (attacks, norm bound, rule) is reached exactly by the methods of
  SERVER_ROUND_METHODS, and labels are flipped, with the run ending normally, exactly for those of
  LABEL_FLIP_METHODS (FedProto flips them, then its server refuses the flipped client's upload)."""
  received, flipped = [], []
  receive, flip = common.Server.receive, attacks.flip_labels

  def spy_receive(self, *args, **kwargs):
    received.append(method)
    return receive(self, *args, **kwargs)

  def spy_flip(*args, **kwargs):
    flipped.append(method)
    return flip(*args, **kwargs)

  monkeypatch.setattr(common.Server, 'receive', spy_receive)
  monkeypatch.setattr(attacks, 'flip_labels', spy_flip)
  config = override(smoke_config(method), **{'attack.kind': 'label_flip', 'attack.clients': '0'})
  cls = get_method(method)
  validate_run_config(config, cls.section)
  try:
    driver.run(cls.from_config(config), driver.context_of_config(config), progress=False)
    failed = None
  except UploadError as e:
    failed = e
  assert bool(received) == (method in SERVER_ROUND_METHODS), received
  assert (bool(flipped) and failed is None) == (method in LABEL_FLIP_METHODS), (
    flipped,
    failed,
  )
  assert failed is None or method == 'fedproto', failed
