"""The run's config as a SuperNode takes it from a message: data, checked against the node's jfed.

The server sends the resolved config as JSON (`settings.config_record`), never a config file's
source: a node runs no code that comes in a message. Here the node rebuilds it on its own
installed jfed's base config: every key must be one of that jfed's (a method's field without a
default included), every value of the type the node's default has; anything else is one
ConfigError naming the key, which the node's reply carries back to the server.
"""

import json
from typing import Any, Dict, Set

import ml_collections

from jfed.configs.base import base_config
from jfed.errors import ConfigError
from jfed.methods import registry


def _fields_without_defaults() -> Dict[str, Set[str]]:
  """Per section, the fields a method declares without a default (the base config has no key
  for them: a run sets them)."""
  out: Dict[str, Set[str]] = {}
  for name in registry.available_methods():
    cls = registry.get_method(name)
    required = set(cls.Config._fields) - set(cls.Config._field_defaults)
    out.setdefault(cls.section, set()).update(required)
  return out


_KINDS = {bool: 'true or false', int: 'an integer', float: 'a number', str: 'a string'}
_KINDS.update({tuple: 'a list', list: 'a list'})


def _value(default: Any, value: Any, key: str) -> Any:
  """`value` in the type of the node's `default` (JSON has lists for tuples, ints for floats)."""
  if default is None or value is None:
    return value
  if isinstance(default, bool):
    ok = isinstance(value, bool)
  elif isinstance(default, int):
    ok = isinstance(value, int) and not isinstance(value, bool)
  elif isinstance(default, float):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    value = float(value) if ok else value
  elif isinstance(default, str):
    ok = isinstance(value, str)
  elif isinstance(default, (tuple, list)):
    ok = isinstance(value, list)
    value = type(default)(value) if ok else value
  else:
    ok = False
  if not ok:
    raise ConfigError(
      f"the config the server sent gives {key}={value!r}; this node's jfed expects "
      f'{_KINDS.get(type(default), type(default).__name__)}'
    )
  return value


def _merge(
  node: ml_collections.ConfigDict, sent: Any, where: str, required: Dict[str, Set[str]]
) -> None:
  if not isinstance(sent, dict):
    raise ConfigError(f'the config the server sent gives {where or "the config"} as a value')
  for key, value in sent.items():
    path = f'{where}.{key}' if where else key
    if key not in node:
      section = where.split('.')[0]
      if isinstance(value, dict) or key not in required.get(section, set()):
        raise ConfigError(
          f"the config the server sent has the key {path}, which this node's jfed does not "
          'know (different jfed versions on the server and the node?)'
        )
      node[key] = value
    elif isinstance(node[key], ml_collections.ConfigDict):
      _merge(node[key], value, path, required)
    else:
      node[key] = _value(node[key], value, path)


def config_from_json(text: str) -> ml_collections.ConfigDict:
  """The run's config from the JSON of a message, rebuilt on this node's base config.

  Args:
    text: `settings.config_record(config)['config_json']`.

  Returns:
    The locked config; ConfigError for text that is not a JSON object, an unknown key or a value
    of another type than the node's default.
  """
  try:
    sent = json.loads(text)
  except ValueError as e:
    raise ConfigError(f'the config the server sent is not JSON ({e})') from None
  node = base_config()
  _merge(node, sent, '', _fields_without_defaults())
  node.lock()
  return node
