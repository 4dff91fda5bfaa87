"""The Flower ServerApp and ClientApp of a jfed run (components of experiments/flower_app).

Both read the run config that `jfed.flower.deploy` (or `flwr run --run-config`) gives:
  method     the jfed method (`--method`)
  config     the config file and its argument, `PATH[:ARG]` (a path on the SuperLink's machine;
             the ServerApp sends the file's source to the nodes, which need no copy of it)
  overrides  a JSON list of `--config.KEY=VALUE` overrides, as experiments.main takes them
  workdir    where the server writes the run (metrics, checkpoints, summary), absolute
  supernodes how many SuperNodes the server waits for
The server runs jfed's driver, whose client training goes to the SuperNodes; each SuperNode
rebuilds the data and partition from the config the server sends and trains the clients it
holds (`partition-id` of `num-partitions` in its node config). With node config
`keep-process` (default true) the ClientApp process Flower starts per message forwards it to
the node's long-lived worker (jfed/flower/worker.py), so rounds keep their process.
"""

import hashlib
import json
import os
import pathlib
import tempfile
import time
from typing import Any, Dict, Tuple

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from jfed.errors import ConfigError

# No JAX at import: a SuperNode imports this module in a fresh process for every message, which
# forwards it to the node's long-lived worker (jfed/flower/worker.py).

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
  from jfed.flower import transport as flower_transport  # pylint: disable=g-import-not-at-top
  from jfed.workdir import write_json  # pylint: disable=g-import-not-at-top

  method, spec, overrides, workdir, supernodes = run_settings(context)
  config = load_config(spec, overrides)
  transport = flower_transport.FlowerTransport(
    grid, supernodes, run_record=config_record(spec, overrides)
  )
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
      # What Flower costs per exchange (a round of FedAvg): its wall time less the slowest
      # node's own work (setup included).
      'overhead_seconds_per_exchange': [
        round(e - n, 2) for e, n in zip(transport.exchange_seconds, transport.node_seconds)
      ],
      'final_test_accuracy': summary['final_test_accuracy'],
    },
  )


def config_record(spec: str, overrides) -> Dict[str, str]:
  """The config as every message carries it: the file's source (so that a SuperNode on another
  machine needs no copy at the same path), its name, its argument and the overrides."""
  path, _, arg = spec.partition(':')
  try:
    source = pathlib.Path(path).read_text()
  except OSError as e:
    raise ConfigError(f'config {path}: cannot be read on the server ({e.strerror})') from None
  return {
    'config_source': source,
    'config_name': pathlib.Path(path).name,
    'config_arg': arg,
    'overrides': json.dumps(list(overrides)),
  }


def spec_of_record(record) -> Tuple[str, list]:
  """The `PATH[:ARG]` and overrides of a message's config record, its source written once per
  content to this machine's temporary directory. The node runs that source, as it runs the
  app's own code, which also comes from whoever submits the run."""
  source = str(record['config_source'])
  digest = hashlib.sha256(source.encode()).hexdigest()[:16]
  folder = pathlib.Path(tempfile.gettempdir()) / 'jfed-flower-configs' / digest
  path = folder / pathlib.Path(str(record['config_name'])).name
  if not path.exists():
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f'.{path.name}.{time.time_ns()}'
    partial.write_text(source)
    partial.replace(path)  # atomic: two ClientApp processes may write it at once
  arg = str(record['config_arg'])
  return str(path) + (f':{arg}' if arg else ''), json.loads(str(record['overrides']))


_NODES: Dict[Any, Any] = {}  # NodeTrainers of this process, with keep-process=false


def keeps_process(node_config) -> bool:
  """Node config `keep-process` (default true): a long-lived worker serves every message."""
  value = node_config.get('keep-process', True)
  if isinstance(value, str):
    if value.lower() not in ('true', 'false'):
      raise ConfigError(f'node config keep-process={value!r}: expected true or false')
    return value.lower() == 'true'
  return bool(value)


@client_app.train()
def client_train(message: Message, context: Context) -> Message:
  start = time.perf_counter()
  if 'config_source' in message.content['config']:
    spec, overrides = spec_of_record(message.content['config'])
  else:  # a request without it (a ServerApp of an earlier jfed): the run config's path
    _, spec, overrides, _, _ = run_settings(context)
  partition_id = int(context.node_config['partition-id'])
  num_partitions = int(context.node_config['num-partitions'])
  if keeps_process(context.node_config):
    from jfed.flower import worker  # pylint: disable=g-import-not-at-top

    # The SuperNode's process (this one's parent) owns the worker: it ends with it.
    reply = worker.forward(
      message.content, spec, overrides, partition_id, num_partitions, os.getppid()
    )
    return Message(reply, reply_to=message)
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top
  from jfed.flower import transport as flower_transport  # pylint: disable=g-import-not-at-top

  key = (spec, tuple(overrides), partition_id, num_partitions)
  if key not in _NODES:
    ctx = context_of_config(load_config(spec, overrides))
    _NODES[key] = flower_transport.NodeTrainer(ctx, partition_id, num_partitions)
  setup_seconds = time.perf_counter() - start
  return Message(_NODES[key].handle(message.content, setup_seconds), reply_to=message)
