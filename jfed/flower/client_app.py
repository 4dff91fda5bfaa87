"""The Flower ClientApp of a jfed run: a SuperNode's share of the clients, trained by jfed.

The SuperNode's `partition-id` of `num-partitions` (node config) picks its clients from the
seeded partition; with node config `data-dir=PATH` instead, its clients are the files there
(jfed/flower/own_data.py) and the run config must say `own-data=true`. With node
config `keep-process` (default true) the ClientApp process Flower starts for every message
imports no JAX: it forwards the message to the node's long-lived worker (jfed/flower/relay.py,
jfed/flower/worker.py), so rounds keep their process, data and compiled programs.
"""

import os
import time
from typing import Any, Dict

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from jfed.flower import relay
from jfed.flower.settings import config_json_of_record, keeps_process, node_data_dir

client_app = ClientApp()
_NODES: Dict[Any, Any] = {}  # NodeTrainers of this process, with keep-process=false


@client_app.train()
def client_train(message: Message, context: Context) -> Message:
  start = time.perf_counter()
  config_json = config_json_of_record(message.content['config'])
  data_dir = node_data_dir(context.node_config)
  if data_dir is None:
    partition_id = int(context.node_config['partition-id'])
    num_partitions = int(context.node_config['num-partitions'])
  else:  # the node's clients are its files (jfed/flower/own_data.py)
    data_dir = os.path.abspath(data_dir)
    partition_id, num_partitions = 0, 1
  share = relay.NodeShare(config_json, partition_id, num_partitions, data_dir)
  if keeps_process(context.node_config):
    # The SuperNode's process (this one's parent) owns the worker: it ends with it.
    return Message(relay.forward(message.content, share, os.getppid()), reply_to=message)
  # keep-process=false: this process trains, so only now does it load JAX and jfed's engine.
  from jfed.flower import worker  # pylint: disable=g-import-not-at-top

  if share not in _NODES:
    _NODES[share] = worker.node_trainer(share)
  setup_seconds = time.perf_counter() - start
  return Message(_NODES[share].handle(message.content, setup_seconds), reply_to=message)
