"""The Flower ServerApp and ClientApp of a jfed run (components of experiments/flower_app).

Both read the run config that `jfed.flower.deploy` (or `flwr run --run-config`) gives:
  method     the jfed method (`--method`)
  config     the config file and its argument, `PATH[:ARG]` (an absolute path)
  overrides  a JSON list of `--config.KEY=VALUE` overrides, as experiments.main takes them
  workdir    where the server writes the run (metrics, checkpoints, summary), absolute
  supernodes how many SuperNodes the server waits for
The server runs jfed's driver, whose client training goes to the SuperNodes; each SuperNode
rebuilds the data and partition from the same config and trains the clients it holds
(`partition-id` of `num-partitions` in its node config).
"""

import json
import pathlib
import time
from typing import Any, Dict, Tuple

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from jfed.errors import ConfigError
from jfed.flower import transport as flower_transport

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

server_app = ServerApp()
client_app = ClientApp()


def load_config(spec: str, overrides):
  """The config of `--config=spec` with `--config.KEY=VALUE` overrides, parsed as
  experiments.main parses them."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

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


def run_settings(context: Context) -> Tuple[str, str, list, str, int]:
  rc = context.run_config
  method = str(rc['method'])
  require_supported(method)
  return (
    method,
    str(rc['config']),
    json.loads(str(rc['overrides'])),
    str(rc['workdir']),
    int(rc['supernodes']),
  )


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.workdir import write_json  # pylint: disable=g-import-not-at-top

  method, spec, overrides, workdir, supernodes = run_settings(context)
  config = load_config(spec, overrides)
  transport = flower_transport.FlowerTransport(grid, supernodes)
  summary = run_experiment(method, config, workdir, client_transport=transport)
  write_json(
    pathlib.Path(workdir) / 'flower.json',
    {
      'supernodes': len(transport.nodes),
      'message_bytes_sent': transport.bytes_sent,
      'message_bytes_received': transport.bytes_received,
      'exchanges': len(transport.exchange_seconds),
      'exchange_seconds': round(sum(transport.exchange_seconds), 2),
      'slowest_node_seconds': round(sum(transport.node_seconds), 2),
      'final_test_accuracy': summary['final_test_accuracy'],
    },
  )


_NODES: Dict[Any, flower_transport.NodeTrainer] = {}


@client_app.train()
def client_train(message: Message, context: Context) -> Message:
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  _, spec, overrides, _, _ = run_settings(context)
  partition_id = int(context.node_config['partition-id'])
  num_partitions = int(context.node_config['num-partitions'])
  key = (spec, tuple(overrides), partition_id, num_partitions)
  if key not in _NODES:  # a ClientApp process that serves several messages builds this once
    ctx = context_of_config(load_config(spec, overrides))
    _NODES[key] = flower_transport.NodeTrainer(ctx, partition_id, num_partitions)
  setup_seconds = time.perf_counter() - start
  return Message(_NODES[key].handle(message.content, setup_seconds), reply_to=message)
