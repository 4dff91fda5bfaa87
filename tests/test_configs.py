"""Tests for experiments/configs: every file builds its default config; variants are checked."""

import importlib
import pathlib

import pytest

from jfed.configs import base as common
from jfed.errors import ConfigError

CONFIG_DIR = pathlib.Path(common.__file__).parent
CONFIG_MODULES = sorted(
  p.stem for p in CONFIG_DIR.glob('*.py') if p.stem not in ('__init__', 'base')
)
# Every config file's get_config(arg) goes through `common.variant_words`.
CHECKED_MODULES = tuple(CONFIG_MODULES)
# A sample value for each variant that takes one.
VALUES = {
  'rounds=': 'rounds=2',
  'dir=': 'dir=0.1',
  'rates=': 'rates=0.5/1.0',
  'source=': 'source=public',
  'dataset=': 'dataset=digits',
}
ONESHOT_SECTIONS = ('dense', 'coboosting', 'feddf', 'ot', 'fedhydra')


def load(name: str):
  return importlib.import_module(f'jfed.configs.{name}')


def test_config_modules_found():
  assert {'digits', 'fashion_mnist'} <= set(CONFIG_MODULES)


@pytest.mark.parametrize('name', CONFIG_MODULES)
def test_default_config_builds(name):
  c = load(name).get_config('')
  assert c.dataset.name and c.partition.num_clients >= 1


@pytest.mark.parametrize('name', CHECKED_MODULES)
def test_every_listed_variant_builds(name):
  module = load(name)
  words = [VALUES.get(w, w) for w in module.VARIANTS]
  for word in words:
    assert module.get_config(word) is not None
  assert module.get_config(','.join(words)) is not None


@pytest.mark.parametrize('name', CHECKED_MODULES)
def test_typo_variant_is_refused_with_the_valid_words(name):
  module = load(name)
  with pytest.raises(ConfigError) as info:
    module.get_config('smoke,smok')
  message = str(info.value)
  assert "'smok'" in message
  for word in module.VARIANTS:
    assert word in message


def test_variant_words_splits_and_keeps_order():
  known = ('iid', 'smoke', 'rounds=')
  assert common.variant_words('', known) == []
  assert common.variant_words(None, known) == []
  assert common.variant_words('smoke, iid,,smoke,', known) == ['smoke', 'iid']
  assert common.variant_words('rounds=3,iid', known) == ['rounds=3', 'iid']


@pytest.mark.parametrize(
  'arg,bad',
  [
    ('smok', 'smok'),
    ('iid,IID', 'IID'),
    ('rounds=', 'rounds='),
    ('round=3', 'round=3'),
    ('iid=1', 'iid=1'),
  ],
)
def test_variant_words_refuses_unknown(arg, bad):
  with pytest.raises(ConfigError) as info:
    common.variant_words(arg, ('iid', 'smoke', 'rounds='))
  message = str(info.value)
  assert repr(bad) in message and 'iid, smoke, rounds=<value>' in message
  assert isinstance(info.value, ValueError)


def test_variant_value():
  assert common.variant_value('rounds=3', int) == 3
  assert common.variant_value('dir=0.1', float) == 0.1
  with pytest.raises(ConfigError, match="'rounds=x'"):
    common.variant_value('rounds=x', int)


def test_digits_serves_every_method_at_a_digits_budget():
  """common.py's defaults (200 local + 200 distillation epochs) are for accelerators."""
  c = load('digits').get_config('')
  base = common.base_config()
  for section in ONESHOT_SECTIONS:
    assert c[section].local_epochs <= 20, section
    assert c[section].get('epochs', 0) <= 40, section
  assert c.feddf.total_steps < base.feddf.total_steps
  digits_test_size = 360
  for section in ('hfldd', 'fedseq'):
    assert c[section].public_size <= digits_test_size // 2, section
  assert c.hfldd.kip.iterations < base.hfldd.kip.iterations
  assert c.dynafed.iterations < base.dynafed.iterations
  smoke = load('digits').get_config('smoke')
  for section in ('fedavg', 'fedprox', 'hfldd', 'fedseq', 'dynafed'):
    assert smoke[section].rounds <= 2, section
  for section in ONESHOT_SECTIONS:
    assert smoke[section].local_epochs <= 2 and smoke[section].get('epochs', 0) <= 2, section


def test_heterogeneity_rates_word():
  assert common.heterogeneity_rates('rates=0.1/0.4/0.7/1.0') == [1.0, 0.7, 0.4, 0.1]
  for bad in ('rates=0.5/0.8', 'rates=0/1.0', 'rates=a/1.0', 'rates=1.5/1.0'):
    with pytest.raises(ConfigError, match='rates'):
      common.heterogeneity_rates(bad)
  models = common.equal_share_models(lambda r: f'm{r:g}', [1.0, 0.5, 0.25], 5)
  assert models.split(';') == ['m1', 'm1', 'm0.5', 'm0.5', 'm0.25']


def test_fedtsa_fashion_mnist_table4_words():
  """The CPU Table 4's words: every method's rounds, and FedTSA's Stage-2 source."""
  module = load('fedtsa_fashion_mnist')
  c = module.get_config('source=public,rounds=10,iid,rates=0.5/1.0')
  assert c.fedtsa.source == 'public' and c.partition.scheme == 'iid'
  for section in ('fedtsa', 'heterofl', 'fedproto', 'fedmd', 'feddf', 'fedavg', 'fedprox'):
    assert c[section].rounds == 10, section
  assert module.get_config('').fedtsa.source == 'ddpm'  # the default source
  with pytest.raises(ConfigError, match='rounds'):
    module.get_config('rounds=ten')


@pytest.mark.parametrize('name', ['fedtsa_fashion_mnist', 'fedtsa_digits'])
def test_fedtsa_configs_give_fedproto_one_embedding_width_at_every_degree(name):
  """Table 4's degrees prune the clients' widths; FedProto needs one prototype width, which
  its layer feeding the classifier gets at the widest client's width (no extra embedding layer,
  which its reference does not have)."""
  for words in ('', 'rates=0.5/1.0', 'rates=0.1/0.3/0.5/0.7/1.0'):
    c = load(name).get_config(words)
    assert c.fedproto.widest_features and c.fedproto.embed_dim == 0, words
