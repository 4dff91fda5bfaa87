"""The Flower ServerApp of a jfed run: jfed's driver, its client training sent to SuperNodes.

It reads the run config that `jfed.flower.deploy` (or `flwr run --run-config`) gives:
  method     the jfed method (`--method`)
  config     the config file and its argument, `PATH[:ARG]` (a path on the SuperLink's machine;
             the ServerApp sends the file's source to the nodes, which need no copy of it)
  overrides  a JSON list of `--config.KEY=VALUE` overrides, as experiments.main takes them
  workdir    where the server writes the run (metrics, checkpoints, summary), absolute
  supernodes how many SuperNodes the server waits for
  min-supernodes  an exchange goes on with this many SuperNodes' replies, the clients of the
             others dropped from that round (0, the default: every SuperNode must reply;
             FedAvg and FedProx only)
  round-timeout   how long the server waits for an exchange's replies, in seconds
  own-data   true: every SuperNode serves its own clients' files (node config data-dir); the
             server learns their sizes from the nodes (`FlowerTransport.describe`) and still
             scores on the config's test split (FedAvg and FedProx only). false (default):
             each SuperNode rebuilds the data and partition from the config the server sends
             and trains the clients it holds (jfed/flower/client_app.py).
"""

import pathlib

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from jfed.api import load_run_dataset
from jfed.driver import run_experiment
from jfed.flower.settings import config_record, load_config, require_own_data, run_settings
from jfed.flower.transport import FlowerTransport
from jfed.workdir import write_json

server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
  settings = run_settings(context)
  method, spec, overrides, workdir = settings[:4]
  config = load_config(spec, overrides)
  if settings.own_data:  # refused before the server waits for any SuperNode
    require_own_data(method, config)
  transport = FlowerTransport(
    grid,
    settings.supernodes,
    timeout_s=settings.round_timeout_s,
    run_record=config_record(config),
    min_nodes=settings.min_supernodes or None,
  )
  counts = None
  if settings.own_data:
    # The nodes' files must have the dataset's image shape and classes: the server's dataset,
    # whose test split it scores on, says which.
    dataset = load_run_dataset(config)
    counts = transport.describe(
      config.partition.num_clients, dataset.input_shape, dataset.num_classes
    )
  summary = run_experiment(
    method, config, workdir, client_transport=transport, client_label_counts=counts
  )
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
      # per exchange, the clients whose SuperNodes did not reply in time (min-supernodes)
      'dropped_clients': transport.dropped,
      **({} if counts is None else {'own_data_client_sizes': counts.sum(1).tolist()}),
      'final_test_accuracy': summary['final_test_accuracy'],
    },
  )
