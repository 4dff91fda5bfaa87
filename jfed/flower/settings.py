"""What the Flower ServerApp and ClientApp read from Flower's run config and messages: the
method, the jfed config (its resolved values travel in every message, as JSON) and the node's
options.

No JAX and no Flower here: a SuperNode imports this in a fresh ClientApp process for every
message, and `jfed.flower.deploy` checks a run with it before any Flower process starts.
"""

import json
from typing import Any, Dict, NamedTuple, Optional

from absl import flags
from ml_collections import config_flags

from jfed.errors import ConfigError

# The methods whose client work all goes through common.make_trainers (classifiers),
# generative.cvae_trainers (CVAEs) or the transport's HFLDD operations: the bridge carries all
# of it.
SUPPORTED_METHODS = (
  'fedavg',
  'fedprox',
  'dense',
  'feddf',
  'coboosting',
  'fedhydra',
  'ot',
  'fedavg_vote',
  'fedmho',
  'fedmho_md',
  'fedmho_sd',
  'fedcvae_ens',
  'fedcvae_kd',
  'hfldd',
  'hfldd_nodd',
)


def load_config(spec: str, overrides: Any) -> Any:
  """The config of `--config=spec` with `--config.KEY=VALUE` overrides, parsed as
  experiments.main parses them."""
  argv = ['jfed', f'--config={spec}', *overrides]
  values = flags.FlagValues()
  # The override flags are defined from `sys_argv` (default: this process's own sys.argv).
  config_flags.DEFINE_config_file(
    'config', None, '', flag_values=values, lock_config=True, sys_argv=argv
  )
  values(argv)
  return values.config


def require_supported(method: str) -> None:
  if method not in SUPPORTED_METHODS:
    raise ConfigError(
      f'{method} does not run through Flower yet; supported: {", ".join(SUPPORTED_METHODS)}'
    )


# The methods that go on when some SuperNodes do not reply (`min-supernodes`): their server
# aggregates the clients whose training came back, as Flower's FedAvg strategy does
# (`min_fit_clients`); every other method needs every client's upload.
DROPOUT_TOLERANT_METHODS = ('fedavg', 'fedprox')


class RunSettings(NamedTuple):
  """What the ServerApp and ClientApp read from Flower's run config (`flwr run --run-config`)."""

  method: str
  config: str  # PATH[:ARG]
  overrides: list
  workdir: str
  supernodes: int
  # an exchange goes on with at least this many SuperNodes' replies (0: every SuperNode must)
  min_supernodes: int = 0
  round_timeout_s: float = 3600.0  # how long the server waits for an exchange's replies
  # the SuperNodes serve their own data (node config data-dir; run config own-data=true)
  own_data: bool = False


def run_settings(context: Any) -> RunSettings:
  """The run config of the Flower App (jfed/flower/app/pyproject.toml), checked.

  Args:
    context: The Flower Context of the ServerApp or ClientApp.

  Returns:
    Its settings; ConfigError for a method the bridge does not carry or a bad value.
  """
  rc = context.run_config
  settings = RunSettings(
    str(rc['method']),
    str(rc['config']),
    json.loads(str(rc['overrides'])),
    str(rc['workdir']),
    int(rc['supernodes']),
    int(rc.get('min-supernodes', 0)),
    float(rc.get('round-timeout', 3600.0)),
    _flag(rc.get('own-data', False), 'run config own-data'),
  )
  check_settings(settings)
  return settings


def check_settings(settings: RunSettings) -> None:
  """ConfigError (one line) for settings the bridge cannot run."""
  require_supported(settings.method)
  n, at_least = settings.supernodes, settings.min_supernodes
  if not 0 <= at_least <= n:
    raise ConfigError(f'min-supernodes must be in [0, supernodes = {n}], got {at_least}')
  if 0 < at_least < n and settings.method not in DROPOUT_TOLERANT_METHODS:
    raise ConfigError(
      f'min-supernodes={at_least} < supernodes={n}: {settings.method} needs every client; '
      f'going on without some SuperNodes is for {", ".join(DROPOUT_TOLERANT_METHODS)} only'
    )
  if not settings.round_timeout_s > 0:
    raise ConfigError(f'round-timeout must be positive, got {settings.round_timeout_s}')
  if settings.own_data:
    require_own_data(settings.method)


# The methods that run when the SuperNodes serve their own data: their server needs nothing of
# the clients' data but each client's size, which the nodes declare.
OWN_DATA_METHODS = ('fedavg', 'fedprox')


def require_own_data(method: str, config: Any = None) -> None:
  """ConfigError (one line) for a run that cannot train on the SuperNodes' own data.

  Args:
    method: The jfed method.
    config: The run config, or None to check the method only.
  """
  if method not in OWN_DATA_METHODS:
    raise ConfigError(
      f'own-data=true: {method} cannot run on SuperNodes that serve their own data: its server '
      "builds or reads its clients' data (only each client's size and label counts come from "
      f'the nodes); own data is for {", ".join(OWN_DATA_METHODS)} only'
    )
  attack = config.get('attack') if config is not None else None
  if attack is not None and attack.get('kind') == 'label_flip':
    raise ConfigError(
      'own-data=true with attack.kind=label_flip: the server cannot flip the labels of data '
      'it does not hold; simulate it with the whole dataset (own-data=false)'
    )


def node_data_dir(node_config) -> Optional[str]:
  """Node config `data-dir` (the SuperNode serves its own clients' files), or None: the node
  serves its block (`partition-id` of `num-partitions`) of the seeded partition."""
  value = node_config.get('data-dir')
  if value is None:
    return None
  if not isinstance(value, str) or not value:
    raise ConfigError(f'node config data-dir={value!r}: expected a directory path (quoted)')
  if 'partition-id' in node_config or 'num-partitions' in node_config:
    raise ConfigError(
      'node config gives data-dir and partition-id/num-partitions: a SuperNode serves either '
      'its own data (data-dir) or its block of the seeded partition, not both'
    )
  return value


def _flag(value: Any, what: str) -> bool:
  if isinstance(value, str):
    if value.lower() not in ('true', 'false'):
      raise ConfigError(f'{what}={value!r}: expected true or false')
    return value.lower() == 'true'
  return bool(value)


def config_record(config: Any) -> Dict[str, str]:
  """The config as every message carries it: the resolved values as JSON, data that the node
  checks against its own jfed (`jfed.flower.node_config`), never a file's source to run.

  Args:
    config: The run's resolved ConfigDict.

  Returns:
    The message's config entries.
  """
  try:
    text = config.to_json(sort_keys=True)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'the config cannot travel to the SuperNodes as data: {e}') from None
  return {'config_json': text}


def config_json_of_record(record) -> str:
  """The config JSON of a message's config record; ConfigError (one line, on the node) for a
  message that carries code instead (a config file's source, as jfed before 2026-12-07 sent)
  or no config."""
  if 'config_source' in record:
    raise ConfigError(
      "the server sent a config file's source to run; this node runs no code from messages "
      '(the server runs an earlier jfed: install the same jfed on the server and the nodes)'
    )
  if 'config_json' not in record:
    raise ConfigError('the message carries no config (a ServerApp of another jfed version?)')
  return str(record['config_json'])


def keeps_process(node_config) -> bool:
  """Node config `keep-process` (default true): a long-lived worker serves every message."""
  return _flag(node_config.get('keep-process', True), 'node config keep-process')
