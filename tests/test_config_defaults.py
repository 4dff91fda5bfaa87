"""Each typed config carries its defaults and `base_config()` is generated from them: every
registered method's section holds its `Config()`'s values, with the same Python types, and the
shared keys parse back to `RunConfig()`."""

import typing
from typing import Any, List, NamedTuple

from jfed import api, typed_config
from jfed.configs import base as common
from jfed.methods import fedcvae, oneshot, registry


def _without_default(kind: Any) -> List[str]:
  """The fields of the NamedTuple `kind` that have no default (a nested section's default is
  an instance of its type, so its own fields need none)."""
  return [f for f in kind._fields if f not in kind._field_defaults]


def _typed_values(defaults: Any) -> dict:
  """{field: (type, value)} of a NamedTuple, nested NamedTuples recursively."""
  return {
    k: _typed_values(v) if hasattr(v, '_fields') else (type(v), v)
    for k, v in defaults._asdict().items()
  }


def _section_values(section: Any, kind: Any) -> dict:
  hints = typing.get_type_hints(kind)
  return {
    k: _section_values(section[k], hints[k])
    if hasattr(hints[k], '_fields')
    else (type(section[k]), section[k])
    for k in kind._fields
  }


def test_a_config_without_defaults_is_found():
  class NoDefaults(NamedTuple):
    rounds: int
    lr: float = 0.1

  class Outer(NamedTuple):
    inner: NoDefaults
    seed: int = 0

  assert _without_default(NoDefaults) == ['rounds']
  assert _without_default(Outer) == ['inner']


def test_every_method_config_has_defaults():
  missing = {
    name: _without_default(registry.get_method(name).Config)
    for name in registry.available_methods()
  }
  assert {k: v for k, v in missing.items() if v} == {}


def test_base_config_holds_every_methods_defaults_with_their_types():
  base = common.base_config()
  for name in registry.available_methods():
    cls = registry.get_method(name)
    assert cls.section in base, name
    section = base[cls.section]
    assert typed_config.parse(cls.Config, section, cls.section) == cls.Config(), name
    assert _section_values(section, cls.Config) == _typed_values(cls.Config()), name


def test_base_config_shared_keys_are_the_run_config_defaults():
  assert _without_default(api.RunConfig) == []
  assert api.parse_run_config(common.base_config()) == api.RunConfig()


def test_base_config_has_no_key_that_no_typed_config_or_explicit_list_declares():
  base = common.base_config()
  sections = {registry.get_method(m).section for m in registry.available_methods()}
  assert set(base.keys()) == set(api.RunConfig._fields) | sections
  assert set(base.partition.keys()) == set(api.PartitionSpec._fields) | set(
    common.PARTITION_ARGUMENTS
  )


def test_concat_flattens_blocks_with_their_types_and_defaults():
  class Shared(NamedTuple):
    rounds: int = 1
    lr: float = 0.1

  class Own(NamedTuple):
    decoder: str = 'cvae'

  kind = typed_config.concat('Joined', __name__, Shared, Own)
  assert kind._fields == ('rounds', 'lr', 'decoder')
  assert kind() == (1, 0.1, 'cvae')
  assert typing.get_type_hints(kind) == {'rounds': int, 'lr': float, 'decoder': str}
  section = {'rounds': 2.0, 'lr': 1, 'decoder': 'x'}
  parsed = typed_config.parse(kind, section, 'joined')
  assert parsed == kind(2, 1.0, 'x') and type(parsed.rounds) is int


def test_concat_refuses_a_field_in_two_blocks():
  class A(NamedTuple):
    lr: float = 0.1

  try:
    typed_config.concat('Twice', __name__, A, A)
  except ValueError as e:
    assert "'lr'" in str(e)
  else:
    raise AssertionError('no ValueError')


def test_fedcvae_kd_config_is_ens_config_and_decoder_block():
  kd = fedcvae.FedCVAEKDConfig()
  assert kd[: len(fedcvae.FedCVAEConfig._fields)] == fedcvae.FedCVAEConfig()
  assert kd[len(fedcvae.FedCVAEConfig._fields) :] == fedcvae.DecoderDistillation()


def test_one_shot_methods_share_the_round_and_generator_blocks():
  for name in ('dense', 'coboosting', 'feddf', 'ot', 'fedhydra'):
    defaults = registry.get_method(name).Config()._asdict()
    for block in (oneshot.OneShotRound, oneshot.GeneratorDistillation):
      if name in ('feddf', 'ot') and block is oneshot.GeneratorDistillation:
        continue
      assert {k: defaults[k] for k in block._fields} == block()._asdict(), (name, block)


def test_base_config_refuses_methods_of_one_section_that_disagree(monkeypatch):
  class A(NamedTuple):
    lr: float = 0.1

  class B(NamedTuple):
    lr: float = 0.2

  methods = {
    'a': type('MA', (), {'section': 's', 'Config': A}),
    'b': type('MB', (), {'section': 's', 'Config': B}),
  }
  monkeypatch.setattr(registry, 'available_methods', lambda: sorted(methods))
  monkeypatch.setattr(registry, 'get_method', methods.__getitem__)
  try:
    common.base_config()
  except ValueError as e:
    assert 's.lr' in str(e)
  else:
    raise AssertionError('no ValueError')
