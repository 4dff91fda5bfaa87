"""The checks of the keys every method shares, run once before anything is written or loaded.

`validate_run_config` checks data, partition, model(s), optimizer, batching and the server side
of uploads (aggregation, attack, server); `validate_server_config` the last three. A run's
methods read these keys typed, from `ctx.run` (`jfed.api.RunConfig`); the checks here run on the
raw config, before a context exists. This module sits below the methods and above the families,
whose model names (the CVAE of FedMHO and FedCVAE) a client may train.
"""

from typing import Any, Optional, Tuple

from jfed import typed_config as tc
from jfed.api import ServerConfig
from jfed.cvae.clients import GENERATIVE_MODEL
from jfed.data.partitions import available_schemes
from jfed.engine import aggregation, attacks
from jfed.engine.aggregation import RULES, AggregationConfig
from jfed.engine.optim import OPTIMIZERS
from jfed.engine.training import STRATEGIES
from jfed.errors import ConfigError
from jfed.models import available_models

ON_INVALID = ('drop', 'fail')


def aggregation_config(config) -> AggregationConfig:
  return tc.parse(AggregationConfig, config.get('aggregation'), 'aggregation')


def server_config(config) -> ServerConfig:
  return tc.parse(ServerConfig, config.get('server'), 'server')


def attack_config(config) -> attacks.AttackConfig:
  """The run's `attack` section."""
  return tc.parse(attacks.AttackConfig, config.get('attack'), 'attack')


def clients_per_round(num_clients: int, participation: float) -> int:
  """How many clients `select_clients` draws: round(participation * n), at least one."""
  return max(1, int(round(participation * num_clients)))


def uploads_per_aggregation(config, method_section: Optional[str] = None) -> Tuple[int, str]:
  """The most uploads one aggregation of the method of `method_section` receives, and how that
  number comes about (for messages): its clients per round when the section has a
  `participation` below 1, else every client. Methods that aggregate parts of a round
  (FedTSA's clusters, HFLDD's heads) receive at most this many."""
  n = int(config.partition.num_clients)
  section = config.get(method_section) if method_section else None
  p = section.get('participation') if hasattr(section, 'get') else None
  if isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 < p < 1.0:
    per_round = clients_per_round(n, p)
    if per_round < n:
      return (
        per_round,
        f'{per_round} clients per round ({method_section}.participation={p:g} of {n})',
      )
  return n, f'{n} clients'


def validate_server_config(config, method_section: Optional[str] = None) -> None:
  """Checks the `aggregation`, `attack` and `server` sections (before anything is written):
  settings that would make the rule or the attack another than the one recorded are refused,
  with the number of uploads per aggregation of the method of `method_section`."""
  a = aggregation_config(config)
  tc.require_choice(a.rule, RULES, 'aggregation.rule')
  tc.require(
    0.0 <= a.trim_fraction < 0.5,
    f'aggregation.trim_fraction must be in [0, 0.5), got {a.trim_fraction}',
  )
  tc.require_non_negative(a, 'aggregation', ('krum_byzantine', 'clip_norm'))
  tc.require_positive(a, 'aggregation', ('krum_selected', 'geomed_iterations', 'geomed_smoothing'))
  problem = aggregation.size_problem(a, *uploads_per_aggregation(config, method_section))
  tc.require(problem is None, problem)
  t = attack_config(config)
  tc.require_choice(t.kind, attacks.ATTACKS, 'attack.kind')
  problem = attacks.strength_problem(t.kind, t.strength)
  tc.require(problem is None, problem)
  tc.require(0.0 <= t.fraction <= 1.0, f'attack.fraction must be in [0, 1], got {t.fraction}')
  try:
    attacks.parse_client_ids(t.clients, config.partition.num_clients)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  s = server_config(config)
  tc.require_choice(s.on_invalid_upload, ON_INVALID, 'server.on_invalid_upload')
  tc.require_non_negative(s, 'server', ('max_update_norm_ratio',))


# Seeds are PRNGKey(seed) with 32-bit keys: 2**32 would be the key of seed 0.
SEED_LIMIT = 2**32


def validate_run_config(config: Any, method_section: Optional[str] = None) -> None:
  """Checks the keys every method shares (data, partition, model, optimiser, batching, the
  server side of uploads); `method_section` names the method's section (its `participation`
  sizes the aggregations the server checks)."""
  seed = tc.convert(config.seed, int, 'seed')
  tc.require(
    0 <= seed < SEED_LIMIT,
    f'seed={seed} is not in [0, 2**32): use an integer seed from 0 to {SEED_LIMIT - 1}',
  )
  tc.convert(config.dataset.name, str, 'dataset.name')
  tc.require(
    'test_holdout' not in config.dataset,
    'dataset.test_holdout is gone: the test split is for scoring only; hold training samples '
    'out of the clients with dataset.holdout_size instead',
  )
  holdout = tc.convert(config.dataset.get('holdout_size', 0), int, 'dataset.holdout_size')
  tc.require(holdout >= 0, f'dataset.holdout_size must be >= 0, got {holdout}')
  p = config.partition
  tc.require_choice(p.scheme, available_schemes(), 'partition.scheme')
  tc.require(
    tc.convert(p.num_clients, int, 'partition.num_clients') >= 1,
    f'partition.num_clients must be positive, got {p.num_clients}',
  )
  if 'dirichlet' in p.scheme:
    tc.require(
      tc.convert(p.alpha, float, 'partition.alpha') > 0,
      f'partition.alpha must be positive, got {p.alpha}',
    )
  if p.scheme == 'shards':
    tc.require(tc.convert(p.k, int, 'partition.k') >= 1, f'partition.k must be positive, got {p.k}')
  for name in ('batch_size', 'eval_batch_size'):
    value = tc.convert(config[name], int, name)
    tc.require(value > 0, f'{name} must be positive, got {value}')
  tc.require_choice(config.strategy, STRATEGIES, 'strategy')
  o = config.optimizer
  tc.require_choice(o.name, OPTIMIZERS, 'optimizer.name')
  # Client optimisers restart every round; only centralized training keeps a schedule going.
  tc.require_choice(o.get('schedule', 'constant'), ('constant', 'cosine'), 'optimizer.schedule')
  tc.require(
    tc.convert(o.lr, float, 'optimizer.lr') > 0, f'optimizer.lr must be positive, got {o.lr}'
  )
  momentum = tc.convert(o.get('momentum', 0.0), float, 'optimizer.momentum')
  tc.require(0.0 <= momentum < 1.0, f'optimizer.momentum must be in [0, 1), got {momentum}')
  wd = tc.convert(o.get('weight_decay', 0.0), float, 'optimizer.weight_decay')
  tc.require(wd >= 0.0, f'optimizer.weight_decay must be >= 0, got {wd}')
  validate_server_config(config, method_section)
  classifiers = set(available_models())
  client_specs = [s for s in config.get('client_models', '').split(';') if s.strip()]
  # A client may train a CVAE (FedMHO, FedCVAE); the server model is always a classifier.
  for spec, known in [(config.model, classifiers)] + [
    (s, classifiers | {GENERATIVE_MODEL}) for s in client_specs
  ]:
    name = spec.strip().partition(':')[0]
    tc.require(
      name.lower() in known,
      f'Unknown model {name!r} in {spec!r}; valid: {", ".join(sorted(known))}',
    )
