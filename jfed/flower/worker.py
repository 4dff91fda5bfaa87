"""A SuperNode's long-lived jfed process: rounds keep their process, data and compiled programs.

flwr 1.42 starts a fresh `flwr-clientapp` process for every message (its Runtime API token is
single-use), which would import JAX, rebuild the node's data and trainer and compile again each
round. So the ClientApp imports no JAX: it forwards the message's records over a Unix socket to
one worker process per SuperNode and run config (started by the first message, detached from
the ClientApp process), which holds the `NodeTrainer` for the node's lifetime. The worker ends
when the SuperNode's process does, or after `IDLE_S` without a message.

Wire format: a 4-byte big-endian length, then the bytes of Flower's own RecordDict protobuf;
the reply is one status byte (0 records, 1 an error line) and the same.
"""

import argparse
import fcntl
import hashlib
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from jfed.errors import ConfigError

IDLE_S = 3600.0
START_TIMEOUT_S = 600.0


def _send(conn: socket.socket, payload: bytes) -> None:
  conn.sendall(struct.pack('>I', len(payload)) + payload)


def _receive(conn: socket.socket) -> bytes:
  def exactly(n: int) -> bytes:
    chunks, left = [], n
    while left:
      chunk = conn.recv(min(left, 1 << 20))
      if not chunk:
        raise ConnectionError('the other side closed the connection')
      chunks.append(chunk)
      left -= len(chunk)
    return b''.join(chunks)

  (n,) = struct.unpack('>I', exactly(4))
  return exactly(n)


def _to_bytes(records) -> bytes:
  from flwr.common.serde import recorddict_to_proto  # pylint: disable=g-import-not-at-top

  return recorddict_to_proto(records).SerializeToString()


def _from_bytes(payload: bytes):
  from flwr.common.serde import recorddict_from_proto  # pylint: disable=g-import-not-at-top
  from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=g-import-not-at-top

  proto = ProtoRecordDict()
  proto.ParseFromString(payload)
  return recorddict_from_proto(proto)


def socket_path(spec: str, overrides, partition_id: int, num_partitions: int, owner: int) -> str:
  """One worker per SuperNode process (`owner`), config and share of the clients.

  Args:
    spec: The node's run config file.
    overrides: The config overrides (`key=value` strings) of the run.
    partition_id: This SuperNode's partition, from 0.
    num_partitions: The number of SuperNodes sharing the clients.
    owner: The process id of the SuperNode process that owns the worker.

  Returns:
    The Unix socket path of that worker (in the temporary directory).
  """
  key = json.dumps([spec, list(overrides), partition_id, num_partitions, owner])
  digest = hashlib.sha256(key.encode()).hexdigest()[:20]
  # Unix socket paths are limited to ~100 bytes: a short name in the temporary directory.
  return str(pathlib.Path(tempfile.gettempdir()) / f'jfed-node-{digest}.sock')


def _connect(path: str) -> Optional[socket.socket]:
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    conn.connect(path)
    return conn
  except OSError:
    conn.close()
    return None


def forward(content, spec: str, overrides, partition_id: int, num_partitions: int, owner: int):
  """The reply records of the node's worker to `content`, starting the worker if none runs.

  Args:
    content: The message's RecordDict.
    spec: The node's run config file.
    overrides: The config overrides (`key=value` strings) of the run.
    partition_id: This SuperNode's partition, from 0.
    num_partitions: The number of SuperNodes sharing the clients.
    owner: The process id of the SuperNode process that owns the worker.

  Returns:
    The worker's reply RecordDict.
  """
  path = socket_path(spec, overrides, partition_id, num_partitions, owner)
  conn = _connect(path)
  if conn is None:
    with open(path + '.lock', 'w') as lock:  # one start however many messages arrive at once
      fcntl.flock(lock, fcntl.LOCK_EX)
      conn = _connect(path) or _start(path, spec, overrides, partition_id, num_partitions, owner)
  with conn:
    _send(conn, _to_bytes(content))
    reply = _receive(conn)
  if reply[:1] != b'\x00':
    raise ConfigError(reply[1:].decode(errors='replace'))
  return _from_bytes(reply[1:])


def _start(
  path: str, spec: str, overrides, partition_id: int, num_partitions: int, owner: int
) -> socket.socket:
  log = open(path + '.log', 'ab')  # pylint: disable=consider-using-with
  command = [
    sys.executable, '-m', 'jfed.flower.worker', '--socket', path, '--spec', spec,
    '--overrides', json.dumps(list(overrides)), '--partition-id', str(partition_id),
    '--num-partitions', str(num_partitions), '--owner', str(owner),
  ]  # fmt: skip
  process = subprocess.Popen(
    command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
  )
  deadline = time.monotonic() + START_TIMEOUT_S
  while time.monotonic() < deadline:
    conn = _connect(path)
    if conn is not None:
      return conn
    if process.poll() is not None:
      tail = pathlib.Path(path + '.log').read_text(errors='replace').strip().splitlines()[-1:]
      raise ConfigError(f'the jfed node worker exited with status {process.returncode}: {tail}')
    time.sleep(0.1)
  raise ConfigError(f'the jfed node worker did not listen on {path} in {START_TIMEOUT_S:.0f} s')


def _alive(pid: int) -> bool:
  """Whether process `pid` runs: an exited one that nobody reaped (a zombie, as a container
  without an init leaves them) counts as ended."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  except OSError:
    return True  # no /proc (not Linux): signal 0 is all there is
  return stat.rsplit(')', 1)[-1].split()[0] not in ('Z', 'X')


def serve(
  path: str, spec: str, overrides, partition_id: int, num_partitions: int, owner: int
) -> None:
  """Builds the node's trainer once, then answers each connection's request until the owner
  process ends or nothing comes for IDLE_S.

  Args:
    path: The Unix socket path to listen on.
    spec: The node's run config file.
    overrides: The config overrides (`key=value` strings) of the run.
    partition_id: This SuperNode's partition, from 0.
    num_partitions: The number of SuperNodes sharing the clients.
    owner: The process id of the SuperNode process that owns the worker.
  """
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top
  from jfed.flower.apps import load_config  # pylint: disable=g-import-not-at-top
  from jfed.flower.transport import NodeTrainer  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  ctx = context_of_config(load_config(spec, overrides))
  node = NodeTrainer(ctx, partition_id, num_partitions)
  setup_seconds = time.perf_counter() - start
  partial = f'{path}.{os.getpid()}'
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(partial)
  os.replace(partial, path)  # clients see the socket only once it listens
  server.listen(4)
  server.settimeout(1.0)
  last = time.monotonic()

  def watch() -> None:
    while _alive(owner) and time.monotonic() - last < IDLE_S:
      time.sleep(1.0)
    try:
      os.unlink(path)
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
        content = _from_bytes(_receive(conn))
        reply = b'\x00' + _to_bytes(node.handle(content, setup_seconds))
        setup_seconds = 0.0
      except ConnectionError:
        continue
      except Exception as e:  # pylint: disable=broad-except
        # the ClientApp raises it, so Flower reports it to the server as this node's error
        reply = b'\x01' + f'{type(e).__name__}: {e}'.encode()
      try:
        _send(conn, reply)
      except OSError:
        pass
      last = time.monotonic()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--socket', required=True)
  parser.add_argument('--spec', required=True)
  parser.add_argument('--overrides', default='[]')
  parser.add_argument('--partition-id', type=int, required=True)
  parser.add_argument('--num-partitions', type=int, required=True)
  parser.add_argument('--owner', type=int, required=True)
  a = parser.parse_args()
  serve(a.socket, a.spec, json.loads(a.overrides), a.partition_id, a.num_partitions, a.owner)


if __name__ == '__main__':
  main()
