"""The ClientApp's side of a SuperNode's long-lived jfed process (jfed/flower/worker.py).

flwr 1.42 starts a fresh `flwr-clientapp` process for every message (its Runtime API token is
single-use), which would import JAX, rebuild the node's data and trainer and compile again each
round. So the ClientApp imports no JAX: it forwards the message's records over a Unix socket to
one worker process per SuperNode and run config (started by the first message, detached from
the ClientApp process), which holds the `NodeTrainer` for the node's lifetime. The worker ends
when the SuperNode's process does, or after `IDLE_S` without a message.

Wire format: a 4-byte big-endian length, then the bytes of Flower's own RecordDict protobuf;
the reply is one status byte (0 records, 1 an error line) and the same.
"""

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
import time
from typing import NamedTuple, Optional

from jfed.errors import ConfigError

START_TIMEOUT_S = 600.0


class NodeShare(NamedTuple):
  """What a SuperNode's worker trains: its block of the seeded partition of the run config's
  data, or the clients of its own data directory."""

  config_json: str  # the run's resolved config, as the server sent it (data, not code)
  partition_id: int = 0  # this SuperNode's partition, from 0
  num_partitions: int = 1  # the number of SuperNodes sharing the clients
  data_dir: Optional[str] = None  # the node's own data (node config `data-dir`), or None


def send(conn: socket.socket, payload: bytes) -> None:
  conn.sendall(struct.pack('>I', len(payload)) + payload)


def receive(conn: socket.socket) -> bytes:
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


def to_bytes(records) -> bytes:
  from flwr.common.serde import recorddict_to_proto  # pylint: disable=g-import-not-at-top

  return recorddict_to_proto(records).SerializeToString()


def from_bytes(payload: bytes):
  from flwr.common.serde import recorddict_from_proto  # pylint: disable=g-import-not-at-top
  from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=g-import-not-at-top

  proto = ProtoRecordDict()
  proto.ParseFromString(payload)
  return recorddict_from_proto(proto)


def socket_path(share: NodeShare, owner: int) -> str:
  """One worker per SuperNode process (`owner`), config and share of the clients.

  Args:
    share: What the node trains.
    owner: The process id of the SuperNode process that owns the worker.

  Returns:
    The Unix socket path of that worker (in the temporary directory).
  """
  key = [share.config_json, share.partition_id, share.num_partitions, owner]
  key = json.dumps(key if share.data_dir is None else key + [share.data_dir])
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


def forward(content, share: NodeShare, owner: int):
  """The reply records of the node's worker to `content`, starting the worker if none runs.

  Args:
    content: The message's RecordDict.
    share: What the node trains.
    owner: The process id of the SuperNode process that owns the worker.

  Returns:
    The worker's reply RecordDict.
  """
  path = socket_path(share, owner)
  conn = _connect(path)
  if conn is None:
    with open(path + '.lock', 'w') as lock:  # one start however many messages arrive at once
      fcntl.flock(lock, fcntl.LOCK_EX)
      conn = _connect(path) or _start(path, share, owner)
  with conn:
    send(conn, to_bytes(content))
    reply = receive(conn)
  if reply[:1] != b'\x00':
    raise ConfigError(reply[1:].decode(errors='replace'))
  return from_bytes(reply[1:])


def _start(path: str, share: NodeShare, owner: int) -> socket.socket:
  log = open(path + '.log', 'ab')  # pylint: disable=consider-using-with
  command = [
    sys.executable, '-m', 'jfed.flower.worker', '--socket', path,
    '--config-json', share.config_json, '--partition-id', str(share.partition_id),
    '--num-partitions', str(share.num_partitions), '--owner', str(owner),
  ]  # fmt: skip
  if share.data_dir is not None:
    command += ['--data-dir', share.data_dir]
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


def alive(pid: int) -> bool:
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
