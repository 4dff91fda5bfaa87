"""jfed's configs: `base.base_config()` (every default, generated from the typed configs) and one
file per experiment family (digits.py: the README's main job; the papers' tables in the
fedhydra_*, fedtsa_*, hfldd_* and fedmho_* files). Each file's docstring is its documentation:
its command, budget, variants and the numbers measured with it."""

import importlib
import pathlib

import ml_collections

from jfed.errors import ConfigError

CONFIGS_DIR = pathlib.Path(__file__).resolve().parent


def config_names() -> list:
  """The names of jfed's config files ('digits', 'fashion_mnist', ...)."""
  return sorted(p.stem for p in CONFIGS_DIR.glob('*.py') if p.stem not in ('__init__', 'base'))


def named_config(name: str, arg: str = '') -> ml_collections.ConfigDict:
  """`get_config(arg)` of jfed/configs/<name>.py; ConfigError naming the configs otherwise."""
  if name not in config_names():
    raise ConfigError(f'no config {name!r} in jfed; configs: {", ".join(config_names())}')
  return importlib.import_module(f'jfed.configs.{name}').get_config(arg)
