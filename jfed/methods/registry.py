"""Methods registered by name: `python -m experiments.main --method=NAME` looks them up here."""

import importlib
from typing import Dict, List, Type

from jfed.errors import ConfigError

_METHODS: Dict[str, type] = {}
# Modules that register methods when imported. A module whose optional dependency is missing
# is skipped, so one broken method never hides the others.
_METHOD_MODULES = (
  'fedavg',
  'centralized',
  'local',
  'dense',
  'feddf',
  'coboosting',
  'ot',
  'fedhydra',
  'hfldd',
  'fedseq',
  'dynafed',
  'fedmho',
  'fedcvae',
  'heterofl',
  'fedproto',
  'fedmd',
  'fedtsa',
)


def register_method(name: str):
  """Class decorator: registers an `Algorithm` subclass as `--method=name` (sets its name)."""

  def wrap(cls: Type):
    if name in _METHODS and _METHODS[name] is not cls:
      raise ValueError(f'method {name!r} registered twice')
    cls.name = name
    _METHODS[name] = cls
    return cls

  return wrap


def _load_all() -> None:
  for module in _METHOD_MODULES:
    try:
      importlib.import_module(f'jfed.methods.{module}')
    except ModuleNotFoundError as e:
      if e.name != f'jfed.methods.{module}':
        raise


def available_methods() -> List[str]:
  _load_all()
  return sorted(_METHODS)


def registered_methods() -> Dict[str, Type]:
  """Every registered Algorithm class by its `--method` name."""
  _load_all()
  return dict(sorted(_METHODS.items()))


def get_method(name: str) -> Type:
  """The Algorithm class registered as `name`."""
  _load_all()
  if name not in _METHODS:
    raise ConfigError(f'Unknown method {name!r}; valid methods: {", ".join(sorted(_METHODS))}')
  return _METHODS[name]
