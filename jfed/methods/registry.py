"""Methods registered by name: `python -m experiments.main --method=NAME` looks them up here."""
import importlib
from typing import Callable, Dict, List

_METHODS: Dict[str, Callable] = {}
# Modules that register methods when imported. A module whose optional dependency is missing
# is skipped, so one broken method never hides the others.
_METHOD_MODULES = ('fedavg', 'centralized', 'local', 'dense', 'feddf', 'coboosting', 'ot',
                   'fedhydra', 'hfldd', 'fedseq', 'dynafed')


def register_method(name: str):
  def wrap(fn):
    if name in _METHODS and _METHODS[name] is not fn:
      raise ValueError(f'method {name!r} registered twice')
    _METHODS[name] = fn
    return fn
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


def get_method(name: str) -> Callable:
  _load_all()
  if name not in _METHODS:
    raise ValueError(f'Unknown method {name!r}; valid methods: {", ".join(sorted(_METHODS))}')
  return _METHODS[name]
