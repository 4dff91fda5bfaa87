"""Typed method configs, parsed once from the ml_collections config, and the shared checks.

A method's config is a NamedTuple without defaults: every value comes from the config file
(defaults live only in `experiments/configs/common.py`). `parse(Type, section, 'name')` reads
each field, converts it to the annotated type and names the key when it cannot; nested
NamedTuples are parsed recursively. The parsing primitives and `require*` checks live here, on
the ground floor, so the engine's own sections (attack, aggregation, dp) can use them;
`jfed.run_config.validate_run_config` checks the keys every method shares.
"""

import math
import typing
from typing import Any, Iterable, Type, TypeVar

from jfed.errors import ConfigError

T = TypeVar('T')


def convert(value: Any, kind: Any, where: str) -> Any:
  """`value` as `kind` (bool, int, float, str or a NamedTuple), or a ConfigError naming `where`.

  Args:
    value: the config value.
    kind: the annotated type.
    where: the key, for the message.

  Returns:
    The converted value.
  """
  if kind is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f'{where} must be true or false, got {value!r}')
  if kind is int:
    if (
      isinstance(value, bool)
      or not isinstance(value, (int, float))
      or (isinstance(value, float) and not value.is_integer())
    ):
      raise ConfigError(f'{where} must be an integer, got {value!r}')
    return int(value)
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f'{where} must be a number, got {value!r}')
    if not math.isfinite(value):
      raise ConfigError(f'{where} must be finite, got {value!r}')
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise ConfigError(f'{where} must be a string, got {value!r}')
    return value
  if isinstance(kind, type) and hasattr(kind, '_fields'):
    return parse(kind, value, where)
  return value


def parse(kind: Type[T], section: Any, where: str) -> T:
  """Builds the NamedTuple `kind` from the mapping `section` (a ConfigDict)."""
  if section is None or not hasattr(section, 'keys'):
    raise ConfigError(f'config has no section {where!r}')
  hints = typing.get_type_hints(kind)
  values = {}
  for name in kind._fields:
    if name not in section:
      raise ConfigError(f'{where}.{name} is missing from the config')
    values[name] = convert(section[name], hints.get(name, Any), f'{where}.{name}')
  return kind(**values)


def require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def require_positive(cfg: Any, where: str, names: Iterable[str]) -> None:
  for name in names:
    value = getattr(cfg, name)
    require(value > 0, f'{where}.{name} must be positive, got {value}')


def require_non_negative(cfg: Any, where: str, names: Iterable[str]) -> None:
  for name in names:
    value = getattr(cfg, name)
    require(value >= 0, f'{where}.{name} must be >= 0, got {value}')


def require_fraction(value: float, where: str) -> None:
  require(0.0 < value <= 1.0, f'{where} must be in (0, 1], got {value}')


def require_choice(value: str, choices: Iterable[str], where: str) -> None:
  choices = tuple(choices)
  require(value in choices, f'{where} is {value!r}; valid: {", ".join(choices)}')
