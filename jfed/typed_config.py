"""Typed method configs, parsed once from the ml_collections config, and the shared checks.

A method's config is a NamedTuple whose defaults are the base config's: `experiments/configs/
common.py`'s `base_config()` is generated from them (and from `jfed.api.RunConfig`'s). At run
time every value still comes from the config: `parse(Type, section, 'name')` requires each
field, converts it to the annotated type and names the key when it cannot; nested NamedTuples
are parsed recursively. `concat` joins blocks of settings several methods share. The parsing
primitives and `require*` checks live here, on the ground floor, so the engine's own sections
(attack, aggregation, dp) can use them; `jfed.run_config.validate_run_config` checks the keys
every method shares.
"""

import collections
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
  """Builds the NamedTuple `kind` from the mapping `section` (a ConfigDict).

  Args:
    kind: The NamedTuple type to build.
    section: The config section holding its fields.
    where: The section's dotted name, for error messages.

  Returns:
    The typed section.
  """
  if section is None or not hasattr(section, 'keys'):
    raise ConfigError(f'config has no section {where!r}')
  hints = typing.get_type_hints(kind)
  values = {}
  for name in kind._fields:
    if name not in section:
      # A field left without a default by a type that gives others theirs (a user's method) has
      # no key in the base config (`base_config`): the run must set it.
      no_default = kind._field_defaults and name not in kind._field_defaults
      required = f' (no default: set config.{where}.{name})' if no_default else ''
      raise ConfigError(f'{where}.{name} is missing from the config{required}')
    values[name] = convert(section[name], hints.get(name, Any), f'{where}.{name}')
  return kind(**values)


def concat(name: str, module: str, *blocks: type) -> type:
  """One flat NamedTuple of the fields of `blocks`, in order, with their types and defaults.

  A block of settings several methods share is declared once, as its own NamedTuple, and each
  method's config section (flat in the config file) is the concatenation of its blocks.

  Args:
    name: the new type's name.
    module: the module it is defined in (`__name__`), for pickling and messages.
    *blocks: NamedTuple types; their field names must be distinct.

  Returns:
    The NamedTuple type.

  Raises:
    ValueError: a field in two blocks, or a field without default after one with a default.
  """
  types: dict = {}
  defaults: dict = {}
  for block in blocks:
    for field, kind in typing.get_type_hints(block).items():
      if field in types:
        raise ValueError(f'{name}: field {field!r} is in two blocks')
      types[field] = kind
      if field in block._field_defaults:
        defaults[field] = block._field_defaults[field]
      elif defaults:
        raise ValueError(f'{name}: field {field!r} has no default but follows one with a default')
  # collections.namedtuple takes the defaults of the last fields and the module to pickle by.
  kind = collections.namedtuple(name, list(types), defaults=list(defaults.values()), module=module)
  kind.__annotations__ = types
  return kind


def require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def require_positive(cfg: Any, where: str, names: Iterable[str]) -> None:
  """Raises ConfigError naming the first of `names` that is not positive.

  Args:
    cfg: A typed config section.
    where: The section's name, for the error message.
    names: The fields that must be > 0.
  """
  for name in names:
    value = getattr(cfg, name)
    require(value > 0, f'{where}.{name} must be positive, got {value}')


def require_non_negative(cfg: Any, where: str, names: Iterable[str]) -> None:
  """Raises ConfigError naming the first of `names` that is negative.

  Args:
    cfg: A typed config section.
    where: The section's name, for the error message.
    names: The fields that must be >= 0.
  """
  for name in names:
    value = getattr(cfg, name)
    require(value >= 0, f'{where}.{name} must be >= 0, got {value}')


def require_fraction(value: float, where: str) -> None:
  require(0.0 < value <= 1.0, f'{where} must be in (0, 1], got {value}')


def require_choice(value: str, choices: Iterable[str], where: str) -> None:
  """Raises ConfigError when `value` is not one of `choices`.

  Args:
    value: The configured value.
    choices: The valid values.
    where: The config key, for the error message.
  """
  choices = tuple(choices)
  require(value in choices, f'{where} is {value!r}; valid: {", ".join(choices)}')
