"""The checks of the keys every method shares, run once before anything is written or loaded.

`validate_run_config` parses the shared keys once (`jfed.api.parse_run_config`, the one reader of
them) and checks the typed values: data, partition, model(s), optimizer, batching and the server
side of uploads (aggregation, attack, server). `check_capabilities` refuses the settings a method
would silently ignore, from the capabilities its `Algorithm` class declares. This module sits
below the methods and above the families, whose model names (the CVAE of FedMHO and FedCVAE) a
client may train.
"""

from typing import Any, Mapping, Optional, Tuple

from jfed import typed_config as tc
from jfed.api import Algorithm, RunConfig, parse_run_config
from jfed.cvae.clients import GENERATIVE_MODEL
from jfed.data.partitions import available_schemes
from jfed.data.transforms import NORMALIZATIONS
from jfed.engine import aggregation, attacks
from jfed.engine.optim import OPTIMIZERS
from jfed.engine.training import LOCAL_BN_MODES, STRATEGIES
from jfed.errors import ConfigError
from jfed.models import available_models

ON_INVALID = ('drop', 'fail')


def clients_per_round(num_clients: int, participation: float) -> int:
  """How many clients `select_clients` draws: round(participation * n), at least one."""
  return max(1, int(round(participation * num_clients)))


def uploads_per_aggregation(config: Any, method_section: Optional[str] = None) -> Tuple[int, str]:
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


def _check_server(run: RunConfig, config: Any, method_section: Optional[str]) -> None:
  """The `aggregation`, `attack` and `server` sections: settings that would make the rule or the
  attack another than the one recorded are refused, with the number of uploads per aggregation
  of the method of `method_section`."""
  problem = aggregation.config_problem(
    run.aggregation, *uploads_per_aggregation(config, method_section)
  )
  tc.require(problem is None, problem)
  problem = attacks.config_problem(run.attack, run.partition.num_clients)
  tc.require(problem is None, problem)
  s = run.server
  tc.require_choice(s.on_invalid_upload, ON_INVALID, 'server.on_invalid_upload')
  tc.require_non_negative(s, 'server', ('max_update_norm_ratio',))


# Seeds are PRNGKey(seed) with 32-bit keys: 2**32 would be the key of seed 0.
SEED_LIMIT = 2**32


def validate_run_config(config: Any, method_section: Optional[str] = None) -> RunConfig:
  """The typed shared keys of `config` (data, partition, model, optimiser, batching, the server
  side of uploads), checked; ConfigError naming the first key that is missing, mistyped or out
  of range.

  Args:
    config: the whole resolved config.
    method_section: the method's section, whose `participation` sizes the aggregations the
      server checks; None for none.

  Returns:
    The `RunConfig` the run's context will carry (`ctx.run`).
  """
  tc.require(
    'test_holdout' not in (config.get('dataset') or {}),
    'dataset.test_holdout is gone: the test split is for scoring only; hold training samples '
    'out of the clients with dataset.holdout_size instead',
  )
  run = parse_run_config(config)
  tc.require(
    0 <= run.seed < SEED_LIMIT,
    f'seed={run.seed} is not in [0, 2**32): use an integer seed from 0 to {SEED_LIMIT - 1}',
  )
  holdout = run.dataset.holdout_size
  tc.require(holdout >= 0, f'dataset.holdout_size must be >= 0, got {holdout}')
  size = run.dataset.image_size
  tc.require(size >= 0, f"dataset.image_size must be >= 0 (0: the files' size), got {size}")
  tc.require_choice(run.dataset.normalization, NORMALIZATIONS, 'dataset.normalization')
  p = run.partition
  tc.require_choice(p.scheme, available_schemes(), 'partition.scheme')
  tc.require(p.num_clients >= 1, f'partition.num_clients must be positive, got {p.num_clients}')
  # A scheme's own keys are read by `partition_clients`; these two are checked here.
  if 'dirichlet' in p.scheme:
    alpha = tc.convert(config.partition.get('alpha'), float, 'partition.alpha')
    tc.require(alpha > 0, f'partition.alpha must be positive, got {alpha}')
  if p.scheme == 'shards':
    k = tc.convert(config.partition.get('k'), int, 'partition.k')
    tc.require(k >= 1, f'partition.k must be positive, got {k}')
  for name in ('batch_size', 'eval_batch_size'):
    value = getattr(run, name)
    tc.require(value > 0, f'{name} must be positive, got {value}')
  tc.require_choice(run.strategy, STRATEGIES, 'strategy')
  tc.require_choice(run.local_bn, LOCAL_BN_MODES, 'local_bn')
  o = run.optimizer
  tc.require_choice(o.name, OPTIMIZERS, 'optimizer.name')
  # Client optimisers restart every round; `check_capabilities` refuses a schedule elsewhere.
  tc.require_choice(o.schedule, ('constant', 'cosine'), 'optimizer.schedule')
  tc.require(o.lr > 0, f'optimizer.lr must be positive, got {o.lr}')
  tc.require(0.0 <= o.momentum < 1.0, f'optimizer.momentum must be in [0, 1), got {o.momentum}')
  tc.require(o.weight_decay >= 0.0, f'optimizer.weight_decay must be >= 0, got {o.weight_decay}')
  _check_server(run, config, method_section)
  classifiers = set(available_models())
  client_specs = [s for s in run.client_models.split(';') if s.strip()]
  # A client may train a CVAE (FedMHO, FedCVAE); the server model is always a classifier.
  for spec, known in [(run.model, classifiers)] + [
    (s, classifiers | {GENERATIVE_MODEL}) for s in client_specs
  ]:
    name = spec.strip().partition(':')[0]
    tc.require(
      name.lower() in known,
      f'Unknown model {name!r} in {spec!r}; valid: {", ".join(sorted(known))}',
    )
  return run


def _names(methods: Mapping[str, type], has) -> str:
  return ', '.join(sorted(name for name, cls in methods.items() if has(cls)))


def check_capabilities(
  method: str, algorithm: type, run: RunConfig, methods: Mapping[str, type]
) -> None:
  """Refuses the settings `algorithm` would silently ignore (one line naming the keys and the
  methods that honour them): an aggregation rule, update clipping, a model-poisoning attack or an
  update-norm bound without a server round, a label-flipping attack its clients would not train
  under, `dp.enabled` for a method without differential privacy, an `optimizer.schedule` for a
  method whose optimisers restart every round.

  Args:
    method: its `--method` name (for messages).
    algorithm: its `Algorithm` class, whose class attributes declare what it honours.
    run: the run's typed shared keys (`validate_run_config`).
    methods: every registered method by name (the messages name those that honour a setting).

  Raises:
    ConfigError: a setting the method would ignore is set.
  """
  assert issubclass(algorithm, Algorithm), algorithm
  ignored = []
  if not algorithm.server_round:
    if run.aggregation.rule != 'mean':
      ignored.append(f'aggregation.rule={run.aggregation.rule}')
    if run.aggregation.clip_norm > 0:
      ignored.append(f'aggregation.clip_norm={run.aggregation.clip_norm:g}')
    if run.server.max_update_norm_ratio > 0:
      ignored.append(f'server.max_update_norm_ratio={run.server.max_update_norm_ratio:g}')
    if run.attack.kind in attacks.MODEL_ATTACKS:
      ignored.append(f'attack.kind={run.attack.kind}')
  if ignored:
    raise ConfigError(
      f'{", ".join(ignored)}: {method} would ignore '
      f'{"it" if len(ignored) == 1 else "them"} (its client models do not go through a server '
      'aggregation round); aggregation rules, model attacks and update-norm bounds apply to '
      f'{_names(methods, lambda cls: cls.server_round)} only'
    )
  if run.attack.kind == 'label_flip' and algorithm.label_flip_unsupported:
    raise ConfigError(
      f'attack.kind=label_flip is not supported by {method}: '
      f'{algorithm.label_flip_unsupported}; label flipping applies to '
      f'{_names(methods, lambda cls: not cls.label_flip_unsupported)}'
    )
  if run.optimizer.schedule != 'constant' and not algorithm.lr_schedule:
    raise ConfigError(
      f'optimizer.schedule={run.optimizer.schedule}: {method} restarts its client optimisers '
      'every round, so a schedule has no training run to span; use optimizer.schedule=constant '
      f'(schedules apply to {_names(methods, lambda cls: cls.lr_schedule)} only)'
    )
  if run.dp.enabled and not algorithm.differential_privacy:
    raise ConfigError(
      'dp.enabled: differential privacy is implemented for '
      f'{_names(methods, lambda cls: cls.differential_privacy).replace(", ", " and ")} only, '
      f'not {method}'
    )
