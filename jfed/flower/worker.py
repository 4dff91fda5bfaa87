"""A SuperNode's long-lived jfed process: rounds keep their process, data and compiled programs.

Started by the node's first message (`jfed.flower.relay.forward`), it builds the node's
`NodeTrainer` once and answers every message of the run over a Unix socket (wire format: see
jfed/flower/relay.py), until the SuperNode's process ends or `IDLE_S` pass without a message.
"""

import argparse
import os
import socket
import threading
import time

from jfed.driver import context_of_config
from jfed.flower.node_config import config_from_json
from jfed.flower.relay import NodeShare, alive, from_bytes, receive, send, to_bytes
from jfed.flower.transport import NodeTrainer

IDLE_S = 3600.0


def node_trainer(share: NodeShare) -> NodeTrainer:
  """The trainer of this node's share of the clients: its block of the seeded partition of
  the data the config names, or the clients of its own data directory (jfed/flower/own_data.py
  says its format).

  Args:
    share: What the node trains.

  Returns:
    The node's trainer.
  """
  config = config_from_json(share.config_json)
  if share.data_dir is not None:  # no dataset to load: the server sends its shape and classes
    return NodeTrainer.serving(config, share.data_dir)
  return NodeTrainer(context_of_config(config), share.partition_id, share.num_partitions)


def serve(path: str, share: NodeShare, owner: int) -> None:
  """Builds the node's trainer once, then answers each connection's request until the owner
  process ends or nothing comes for IDLE_S.

  Args:
    path: The Unix socket path to listen on.
    share: What the node trains.
    owner: The process id of the SuperNode process that owns the worker.
  """
  start = time.perf_counter()
  node = node_trainer(share)
  setup_seconds = time.perf_counter() - start
  partial = f'{path}.{os.getpid()}'
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(partial)
  os.replace(partial, path)  # clients see the socket only once it listens
  server.listen(4)
  server.settimeout(1.0)
  last = time.monotonic()

  def watch() -> None:
    while alive(owner) and time.monotonic() - last < IDLE_S:
      time.sleep(1.0)
    for leftover in (path, path + '.log'):  # the log only explains a failed start
      try:
        os.unlink(leftover)
      except OSError:
        pass
    os._exit(0)  # pylint: disable=protected-access

  threading.Thread(target=watch, daemon=True).start()
  while True:
    try:
      conn, _ = server.accept()
    except socket.timeout:
      continue
    with conn:
      conn.settimeout(None)
      try:
        content = from_bytes(receive(conn))
        reply = b'\x00' + to_bytes(node.handle(content, setup_seconds))
        setup_seconds = 0.0
      except ConnectionError:
        continue
      except Exception as e:  # pylint: disable=broad-except
        # the ClientApp raises it, so Flower reports it to the server as this node's error
        reply = b'\x01' + f'{type(e).__name__}: {e}'.encode()
      try:
        send(conn, reply)
      except OSError:
        pass
      last = time.monotonic()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--socket', required=True)
  parser.add_argument('--config-json', required=True)
  parser.add_argument('--partition-id', type=int, required=True)
  parser.add_argument('--num-partitions', type=int, required=True)
  parser.add_argument('--owner', type=int, required=True)
  parser.add_argument('--data-dir', default=None)
  a = parser.parse_args()
  serve(a.socket, NodeShare(a.config_json, a.partition_id, a.num_partitions, a.data_dir), a.owner)


if __name__ == '__main__':
  main()
