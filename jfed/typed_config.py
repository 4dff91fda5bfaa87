"""Typed method configs, parsed once from the ml_collections config, and the shared checks.

A method's config is a NamedTuple without defaults: every value comes from the config file
(defaults live only in `experiments/configs/common.py`). `parse(Type, section, 'name')` reads
each field, converts it to the annotated type and names the key when it cannot; nested
NamedTuples are parsed recursively. `validate_run_config` checks the keys every method shares.
All checks run before anything is written or loaded.
"""

import math
import typing
from typing import Any, Iterable, Optional, Type, TypeVar

from jfed.errors import ConfigError

T = TypeVar('T')

STRATEGIES = ('auto', 'loop', 'vmap', 'scan')


def _convert(value: Any, kind: Any, where: str) -> Any:
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
    values[name] = _convert(section[name], hints.get(name, Any), f'{where}.{name}')
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


# Seeds are PRNGKey(seed) with 32-bit keys: 2**32 would be the key of seed 0.
SEED_LIMIT = 2**32


def validate_run_config(config: Any, method_section: Optional[str] = None) -> None:
  """Checks the keys every method shares (data, partition, model, optimiser, batching, the
  server side of uploads); `method_section` names the method's section (its `participation`
  sizes the aggregations the server checks)."""
  from jfed.data.partitions import available_schemes  # pylint: disable=g-import-not-at-top
  from jfed.engine.optim import OPTIMIZERS  # pylint: disable=g-import-not-at-top
  from jfed.models import available_models  # pylint: disable=g-import-not-at-top

  seed = _convert(config.seed, int, 'seed')
  require(
    0 <= seed < SEED_LIMIT,
    f'seed={seed} is not in [0, 2**32): use an integer seed from 0 to {SEED_LIMIT - 1}',
  )
  _convert(config.dataset.name, str, 'dataset.name')
  require(
    'test_holdout' not in config.dataset,
    'dataset.test_holdout is gone: the test split is for scoring only; hold training samples '
    'out of the clients with dataset.holdout_size instead',
  )
  holdout = _convert(config.dataset.get('holdout_size', 0), int, 'dataset.holdout_size')
  require(holdout >= 0, f'dataset.holdout_size must be >= 0, got {holdout}')
  p = config.partition
  require_choice(p.scheme, available_schemes(), 'partition.scheme')
  require(
    _convert(p.num_clients, int, 'partition.num_clients') >= 1,
    f'partition.num_clients must be positive, got {p.num_clients}',
  )
  if 'dirichlet' in p.scheme:
    require(
      _convert(p.alpha, float, 'partition.alpha') > 0,
      f'partition.alpha must be positive, got {p.alpha}',
    )
  if p.scheme == 'shards':
    require(_convert(p.k, int, 'partition.k') >= 1, f'partition.k must be positive, got {p.k}')
  for name in ('batch_size', 'eval_batch_size'):
    value = _convert(config[name], int, name)
    require(value > 0, f'{name} must be positive, got {value}')
  require_choice(config.strategy, STRATEGIES, 'strategy')
  o = config.optimizer
  require_choice(o.name, OPTIMIZERS, 'optimizer.name')
  # Client optimisers restart every round; only centralized training keeps a schedule going.
  require_choice(o.get('schedule', 'constant'), ('constant', 'cosine'), 'optimizer.schedule')
  require(_convert(o.lr, float, 'optimizer.lr') > 0, f'optimizer.lr must be positive, got {o.lr}')
  momentum = _convert(o.get('momentum', 0.0), float, 'optimizer.momentum')
  require(0.0 <= momentum < 1.0, f'optimizer.momentum must be in [0, 1), got {momentum}')
  wd = _convert(o.get('weight_decay', 0.0), float, 'optimizer.weight_decay')
  require(wd >= 0.0, f'optimizer.weight_decay must be >= 0, got {wd}')
  from jfed.methods.common import validate_server_config  # pylint: disable=g-import-not-at-top

  validate_server_config(config, method_section)
  from jfed.cvae.clients import GENERATIVE_MODEL  # pylint: disable=g-import-not-at-top

  classifiers = set(available_models())
  client_specs = [s for s in config.get('client_models', '').split(';') if s.strip()]
  # A client may train a CVAE (FedMHO, FedCVAE); the server model is always a classifier.
  for spec, known in [(config.model, classifiers)] + [
    (s, classifiers | {GENERATIVE_MODEL}) for s in client_specs
  ]:
    name = spec.strip().partition(':')[0]
    require(
      name.lower() in known,
      f'Unknown model {name!r} in {spec!r}; valid: {", ".join(sorted(known))}',
    )
