"""Client work on Flower SuperNodes, behind the interfaces the methods already call.

On the server a `RemoteGroupTrainer` stands where a method's `GroupTrainer` stands
(`common.make_trainers` and `generative.cvae_trainers` build one when the run has a transport),
so every method whose client training goes through them runs unchanged: its server stage
receives the trained group, validates each upload and counts its bytes exactly as in one
process. A train call becomes one message per SuperNode with the start model, the round's key
and the clients' ids and sizes. Each node trains the clients it holds (a contiguous block of
the client ids, by its `partition-id` of `num-partitions`) as one jfed group, with the same
trainer and the same per-client keys as in one process, so every client ends exactly as it
would there (the engine trains a client the same whatever group it is in; tests/test_engine.py).

HFLDD's client phases are operations of their own, so that only what the protocol uploads
leaves a node: `soft_labels` (pre-train, then upload the softmax outputs on the public set)
and `distill` (KIP on the members' own data; the distilled sets come back). The heads then
train on hybrid data: their partition plus the sets their members sent, which the server sends
along as each head's *extra* samples (Flower is a star: a member's set reaches its head through
the server).

A node's reply is untrusted like any upload: its arrays are checked (count, rows, and per client
the dtype and shape of every leaf against the model the client started from) before anything is
stacked or cast, so a float64 leaf is refused, never cast to float32 on the way.

The node rebuilds its clients' data from the seed, like every process of a multi-process run.
Each side digests every client's partition samples, and a node refuses a request whose digests
differ from its own: a method that trains clients on data other than their partition (DynaFed's
synthetic data, soft-label targets) cannot silently train the wrong data through Flower.

Or a node serves its own data (node config `data-dir`, jfed/flower/own_data.py; run config
`own-data=true`): the server first asks every node to `describe` its clients (ids and label
counts, from which their sizes), refuses a client that no node or two nodes declare, and runs
on placeholder clients of the declared sizes (`jfed.driver.declared_parts`). Its train requests
then carry the dataset's image shape and classes (checked against every file on the node) and
no digests, and a reply says how many samples each client trained on, which must be the size the
server asked for (its declared size, 0 for a client sitting out). Only FedAvg and FedProx, whose
server needs nothing of the clients' data but their sizes, run that way
(`settings.require_own_data`).
"""

import hashlib
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jfed import engine
from jfed.api import make_context
from jfed.cvae import clients as cvae_clients
from jfed.data import Dataset
from jfed.data.federated import federate
from jfed.engine import privacy, sharding
from jfed.engine.state import TrainState
from jfed.engine.training import TrainMetrics
from jfed.errors import ConfigError
from jfed.flower import own_data
from jfed.io.uploads import UploadError, validate_tree
from jfed.kip import KIPConfig, kip_distill_batched
from jfed.methods import common, generative

TRAIN_MESSAGE = 'train'
# A node's distilled sets (KIPResult's x, y, y_matrix, loss), as the batched program makes them.
DISTILLED_DTYPES = (np.float32, np.int32, np.float32, np.float32)
OPERATIONS = ('train', 'soft_labels', 'distill', 'describe')
POLL_S = 0.1  # how often the server asks the SuperLink for replies


def client_digests(fed, rows: Sequence[int], lengths: Optional[Sequence[int]] = None) -> List[str]:
  """A digest of the first `lengths[i]` samples (default: its size) of each listed client.

  Images are digested as float32 and integer labels as int64, so that the same samples held in
  other dtypes (a hybrid set's int32 labels) digest the same.

  Args:
    fed: The FederatedArrays holding the clients (x [m, n_max, ...], y, sizes [m]).
    rows: The rows (clients) of `fed` to digest.
    lengths: Per listed client, how many of its first samples to digest; None for its size.

  Returns:
    One hex digest per listed client.
  """
  out = []
  for j, i in enumerate(rows):
    n = int(fed.sizes[i] if lengths is None else lengths[j])
    y = np.asarray(fed.y[i, :n])
    y = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.asarray(fed.x[i, :n], np.float32)).tobytes())
    h.update(np.ascontiguousarray(y).tobytes())
    out.append(h.hexdigest()[:16])
  return out


def uploaded_leaves(model: Any, recipe: Dict[str, Any]) -> List[bool]:
  """Per leaf of a model, whether a node sends it back: all, or only those under the recipe's
  `upload` key (a CVAE client sends its decoder; its encoder never leaves the node)."""
  part = recipe.get('upload')
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
  return [part is None or f"['{part}']" in path for path in paths]


def _all_equal(tree: Any) -> bool:
  return all(bool(np.all(np.asarray(a) == np.asarray(a)[:1])) for a in jax.tree.leaves(tree))


def _reply_rows(
  content, field: str, clients: Sequence[int], dtypes: Optional[Sequence[Any]] = None
) -> List[np.ndarray]:
  """The arrays of a node's reply under `field`, each with one row per client of the reply
  (`clients`); with `dtypes`, one array of each dtype, in order. Anything else is an
  UploadError naming the clients."""
  what = f'SuperNode reply for client(s) {list(clients)}'
  try:
    arrays = content[field].to_numpy_ndarrays()
  except Exception as e:  # untrusted input: a missing or unreadable record is a refusal
    raise UploadError(f'{what}: no readable {field!r} arrays ({type(e).__name__}: {e})') from None
  if dtypes is not None and len(arrays) != len(dtypes):
    raise UploadError(f'{what}: carries {len(arrays)} {field} arrays, expected {len(dtypes)}')
  for j, a in enumerate(arrays):
    if not isinstance(a, np.ndarray) or a.ndim == 0:
      raise UploadError(f'{what}: {field} array {j} has 0 dimensions, expected a row per client')
    if a.shape[0] != len(clients):
      raise UploadError(
        f'{what}: {field} array {j} has {a.shape[0]} rows, expected one per client ({len(clients)})'
      )
    if dtypes is not None and a.dtype != np.dtype(dtypes[j]):
      raise UploadError(
        f'{what}: {field} array {j} is {a.dtype}, expected {np.dtype(dtypes[j]).name}'
      )
  return arrays


def _reply_values(result, name: str, count: int, clients: Sequence[int]) -> np.ndarray:
  """A node's per-client metric `name` as `count` floats; anything else is an UploadError."""
  try:
    values = np.asarray(result[name], np.float64).reshape(-1)
  except Exception as e:  # untrusted input
    raise UploadError(
      f'SuperNode reply for client(s) {list(clients)}: {name} is not a list of numbers '
      f'({type(e).__name__})'
    ) from None
  if values.size != count:
    raise UploadError(
      f'SuperNode reply for client(s) {list(clients)}: {name} has {values.size} values, '
      f'expected {count}'
    )
  return values


def _same_trailing_shapes(field: str, per_reply: Sequence[Sequence[np.ndarray]]) -> None:
  """np.stack over replies needs the same shape after the client axis in every reply."""
  for j in range(len(per_reply[0]) if per_reply else 0):
    shapes = {a[j].shape[1:] for a in per_reply}
    if len(shapes) > 1:
      raise UploadError(f'SuperNode replies disagree on the shape of {field} array {j}: {shapes}')


def _arrays(arrays: Sequence[np.ndarray]):
  from flwr.app import ArrayRecord  # pylint: disable=g-import-not-at-top

  return ArrayRecord(numpy_ndarrays=[np.asarray(a) for a in arrays])


def _records(op: str, task: Dict[str, Any], **arrays: Sequence[np.ndarray]):
  from flwr.app import ConfigRecord, RecordDict  # pylint: disable=g-import-not-at-top

  return RecordDict(
    {'config': ConfigRecord({'op': op, **task}), **{k: _arrays(v) for k, v in arrays.items()}}
  )


class TrainRequest:
  """What the server asks of the nodes in one train call (encoded as Flower records)."""

  def __init__(
    self,
    spec: str,
    recipe: str,
    client_ids: np.ndarray,
    sizes: np.ndarray,
    digests: List[str],
    epochs: int,
    key: np.ndarray,
    start: List[np.ndarray],
    start_shared: bool,
    anchor: Optional[List[np.ndarray]],
    extra_counts: Optional[Sequence[int]] = None,
    extra: Optional[Tuple[np.ndarray, np.ndarray]] = None,
    anchor_is_start: bool = False,
    data_spec: Optional[Tuple[Sequence[int], int]] = None,
  ):
    # recipe: how the clients train, as JSON ({'kind': 'classifier' | 'cvae', ...}; see
    # common.make_trainers and generative.cvae_trainers), so a node builds the same trainer.
    self.spec, self.recipe = spec, recipe
    self.client_ids, self.sizes, self.digests = client_ids, sizes, digests
    self.epochs, self.key = epochs, key
    self.start, self.start_shared, self.anchor = start, start_shared, anchor
    # Samples a client trains on beyond its partition (an HFLDD head's received sets), all
    # clients' concatenated in client order; extra_counts[i] of them are client i's.
    self.extra_counts = [0] * len(client_ids) if extra_counts is None else list(extra_counts)
    self.extra = extra
    # FedProx's anchor is the round's start model: said by a flag, not sent twice, so that a
    # FedAvg or FedProx request is one ArrayRecord and one ConfigRecord, the layout Flower's
    # mods (e.g. fixedclipping_mod) require.
    self.anchor_is_start = anchor_is_start
    # The SuperNodes serve their own data: the dataset's (image shape, classes) their files must
    # match; None for the seeded partition (the digests say which samples).
    self.data_spec = data_spec

  def to_records(self):
    arrays = {'arrays': self.start}
    if self.anchor is not None:
      arrays['anchor'] = self.anchor
    if self.extra is not None:
      arrays['extra'] = list(self.extra)
    task = {
      'spec': self.spec,
      'recipe': self.recipe,
      'client_ids': [int(c) for c in self.client_ids],
      'sizes': [int(s) for s in self.sizes],
      'digests': list(self.digests),
      'epochs': int(self.epochs),
      'key': [int(k) for k in np.asarray(self.key).reshape(-1)],
      'start_shared': bool(self.start_shared),
      'extra_counts': [int(c) for c in self.extra_counts],
      'anchor_is_start': bool(self.anchor_is_start),
    }
    if self.data_spec is not None:  # no digests (and Flower cannot count an empty list's bytes)
      del task['digests']
      task.update(_spec_fields(*self.data_spec))
    return _records('train', task, **arrays)

  @classmethod
  def from_records(cls, content) -> 'TrainRequest':
    task = content['config']
    extra = content['extra'].to_numpy_ndarrays() if 'extra' in content else None
    return cls(
      spec=str(task['spec']),
      recipe=str(task['recipe']),
      client_ids=np.asarray(task['client_ids'], np.int64),
      sizes=np.asarray(task['sizes'], np.int32),
      digests=list(task['digests']) if 'digests' in task else [],
      epochs=int(task['epochs']),
      key=np.asarray(task['key'], np.uint32),
      start=content['arrays'].to_numpy_ndarrays(),
      start_shared=bool(task['start_shared']),
      anchor=content['anchor'].to_numpy_ndarrays() if 'anchor' in content else None,
      extra_counts=[int(c) for c in task['extra_counts']],
      extra=None if extra is None else (extra[0], extra[1]),
      anchor_is_start=bool(task.get('anchor_is_start', False)),
      data_spec=_spec_of(task) if task.get('data') == 'node' else None,
    )


def _spec_fields(input_shape: Sequence[int], num_classes: int) -> Dict[str, Any]:
  return {
    'data': 'node',
    'input_shape': [int(d) for d in input_shape],
    'num_classes': int(num_classes),
  }


def _spec_of(task) -> Tuple[Tuple[int, ...], int]:
  return tuple(int(d) for d in task['input_shape']), int(task['num_classes'])


class FlowerTransport:
  """The server's side: sends each operation to every SuperNode and reassembles the clients'
  results by client id."""

  def __init__(
    self,
    grid,
    num_nodes: int,
    timeout_s: float = 3600.0,
    run_record: Optional[Dict[str, str]] = None,
    min_nodes: Optional[int] = None,
  ):
    self.grid, self.timeout_s = grid, timeout_s
    # An exchange goes on when at least `min_nodes` SuperNodes replied within `timeout_s` (the
    # clients of the others are recorded as dropped: `dropped`); by default every node must.
    self.min_nodes = num_nodes if min_nodes is None else min_nodes
    if not 1 <= self.min_nodes <= num_nodes:
      raise ConfigError(f'min-supernodes must be in [1, {num_nodes}], got {self.min_nodes}')
    self.dropped: List[List[int]] = []  # per exchange: the requested clients that did not reply
    # The SuperNodes serve their own data (`describe`): the dataset's (image shape, classes).
    self.own_data: Optional[Tuple[Tuple[int, ...], int]] = None
    # What every message carries so that a node needs nothing from the run config but the
    # method: the config file's source, its argument and the overrides (apps.config_record).
    self.run_record = run_record
    self.nodes = wait_for_nodes(grid, num_nodes)
    self.bytes_sent = self.bytes_received = 0
    # Per exchange: its wall time and the slowest node's own time (its setup and work, inside
    # its ClientApp process); the difference is what Flower costs.
    self.exchange_seconds: List[float] = []
    self.node_seconds: List[float] = []

  def trainer(self, spec: str, tx, recipe: Dict[str, Any], partition_sizes) -> 'RemoteGroupTrainer':
    """The trainer of a group of `spec` clients that train as `recipe` says, on the nodes.

    Args:
      spec: The model spec of the group's clients.
      tx: The clients' optimizer (exposed as `.tx`, to build the group's TrainState).
      recipe: How the nodes build the trainer (objective, optimizer, batch size), as JSON-able
        values.
      partition_sizes: Each client's partition size, by client id.

    Returns:
      A RemoteGroupTrainer with `GroupTrainer.train`'s interface.
    """
    return RemoteGroupTrainer(self, spec, tx, recipe, partition_sizes)

  def _replies(self, content, at_least: int) -> list:
    """The replies to `content` that came within `timeout_s`: ConfigError for fewer than
    `at_least` or a node's error; counts the bytes each way and times the exchange."""
    if self.run_record is not None:  # in the one ConfigRecord Flower's mods expect
      for k, v in self.run_record.items():
        content['config'][k] = v
    self.bytes_sent += _record_bytes(content) * len(self.nodes)
    start = time.perf_counter()
    replies = self._exchange(content)
    self.exchange_seconds.append(time.perf_counter() - start)
    if len(replies) < at_least:
      raise ConfigError(
        f'{len(self.nodes) - len(replies)} of {len(self.nodes)} SuperNodes did not reply '
        f'within {self.timeout_s:.0f} s (at least {at_least} must)'
      )
    node_seconds = [0.0]
    for reply in replies:
      if reply.has_error():
        raise ConfigError(f'a SuperNode failed: {reply.error.reason}')
      self.bytes_received += _record_bytes(reply.content)
      node_seconds.append(float(reply.content['metrics']['seconds']))
    self.node_seconds.append(max(node_seconds))
    # The server's progress as it happens: `flwr run --stream` shows the ServerApp's output live.
    print(
      f'flower: exchange {len(self.exchange_seconds)}: {len(replies)}/{len(self.nodes)} '
      f"SuperNodes replied in {self.exchange_seconds[-1]:.1f} s (slowest node's own work "
      f'{self.node_seconds[-1]:.1f} s)',
      file=sys.stderr,
      flush=True,
    )
    return replies

  def _ask(
    self, content, requested: Sequence[int], require_all: bool = True
  ) -> Dict[int, Tuple[Any, int]]:
    """{client id: (its node's reply content, its row there)} for the `requested` clients;
    with `require_all=False`, those whose node replied in time (see `min_nodes`)."""
    replies = self._replies(content, self.min_nodes)
    wanted = {int(c) for c in requested}
    found = {}
    for reply in replies:
      for row, cid in enumerate(int(c) for c in reply.content['metrics']['client_ids']):
        if cid in found or cid not in wanted:
          raise ConfigError(f'client {cid} came back from a SuperNode not asked for it')
        found[cid] = (reply.content, row)
    missing = sorted(wanted - set(found))
    if missing and len(replies) == len(self.nodes):
      raise ConfigError(
        f'no SuperNode holds client(s) {missing}: start as many SuperNodes as their '
        'num-partitions says'
      )
    if missing and require_all:
      raise ConfigError(
        f'client(s) {missing} did not reply within {self.timeout_s:.0f} s: this exchange needs '
        'every client'
      )
    self.dropped.append(missing)  # the clients of the nodes that did not reply in time
    if missing:
      print(
        f'flower: exchange {len(self.exchange_seconds)}: client(s) {missing} dropped (their '
        f'SuperNodes did not reply within {self.timeout_s:.0f} s)',
        file=sys.stderr,
        flush=True,
      )
    return found

  def describe(self, num_clients: int, input_shape: Sequence[int], num_classes: int) -> np.ndarray:
    """Asks every SuperNode which clients its own data holds (node config `data-dir`), and
    from then on trains them as their nodes declared (`own_data`).

    Args:
      num_clients: The run's number of clients (`partition.num_clients`).
      input_shape: The dataset's image shape, which every node's files must have.
      num_classes: The dataset's number of classes, which every label must be below.

    Returns:
      [num_clients, num_classes] int64: each client's label counts, by client id (a row's sum
      is the client's size). ConfigError for a client no node or two nodes declare, or an id out
      of range; UploadError for a malformed reply.
    """
    content = _records('describe', _spec_fields(input_shape, num_classes))
    replies = self._replies(content, len(self.nodes))  # every client must be there
    per_node, tables = [], {}
    for reply in replies:
      clients = [int(c) for c in reply.content['metrics']['client_ids']]
      (table,) = _reply_rows(reply.content, 'label_counts', clients, [np.int64])
      if table.ndim != 2 or table.shape[1] != num_classes:
        raise UploadError(
          f'SuperNode reply for client(s) {clients}: label_counts is {list(table.shape)}, '
          f'expected [{len(clients)}, {num_classes}]'
        )
      if np.any(table < 0) or np.any(table.sum(1) < 1):
        raise UploadError(
          f'SuperNode reply for client(s) {clients}: label counts must be non-negative, with '
          'at least one sample per client'
        )
      for cid in clients:
        if not 0 <= cid < num_clients:
          raise ConfigError(
            f'a SuperNode declares client {cid}, not in [0, {num_clients}) (partition.num_clients)'
          )
      per_node.append(clients)
      tables.update(zip(clients, table))
    twice = own_data.duplicate_clients(per_node)
    if twice:
      cid, nodes = next(iter(twice.items()))
      names = [_source(replies[k]) for k in nodes]
      raise ConfigError(
        f'client {cid} is declared by {len(nodes)} SuperNodes ({", ".join(names)}): each '
        "client's file must be in one SuperNode's data-dir only"
      )
    missing = sorted(set(range(num_clients)) - set(tables))
    if missing:
      raise ConfigError(
        f'no SuperNode declares client(s) {missing}: the run config has partition.num_clients '
        f"= {num_clients}, each client's file in one SuperNode's data-dir"
      )
    self.own_data = (tuple(int(d) for d in input_shape), int(num_classes))
    return np.stack([tables[c] for c in range(num_clients)]).astype(np.int64)

  def train(self, request: TrainRequest) -> Tuple[Dict[int, List[np.ndarray]], Dict[int, Any]]:
    """{client id: trained leaves}, {client id: (losses, accuracies) per epoch}, for the
    clients whose node replied (all of them unless `min_nodes` lets the exchange go on
    without some)."""
    found = self._ask(request.to_records(), request.client_ids, require_all=False)
    asked = dict(zip((int(c) for c in request.client_ids), (int(n) for n in request.sizes)))
    leaves, metrics, unpacked = {}, {}, {}
    for cid, (content, row) in found.items():
      if id(content) not in unpacked:
        result = content['metrics']
        clients = [int(c) for c in result['client_ids']]
        k = len(clients)
        counts = None
        if 'label_counts' in content:
          (counts,) = _reply_rows(content, 'label_counts', clients)
          if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer):
            raise UploadError(
              f'SuperNode reply for client(s) {clients}: label_counts is '
              f'{counts.dtype}{list(counts.shape)}, expected int[{k}, classes]'
            )
        if request.data_spec is not None:  # the node's data: its sizes are checked here
          trained = _reply_values(result, 'sizes', k, clients)
          for client, n in zip(clients, trained):
            if n != asked.get(client):
              raise UploadError(
                f'SuperNode reply for client {client}: trained on {n:g} samples, but the server '
                f'asked for {asked.get(client)} (the size its SuperNode declared, 0 sitting out)'
              )
        unpacked[id(content)] = (
          _reply_rows(content, 'arrays', clients),
          _reply_values(result, 'loss', k * request.epochs, clients).reshape(k, request.epochs),
          _reply_values(result, 'accuracy', k * request.epochs, clients).reshape(k, request.epochs),
          counts,
        )
      stacked, loss, acc, counts = unpacked[id(content)]
      leaves[cid] = [a[row] for a in stacked]
      metrics[cid] = (loss[row], acc[row], None if counts is None else counts[row])
    return leaves, metrics

  def soft_labels(self, num_clients: int, epochs: int, x: np.ndarray) -> np.ndarray:
    """HFLDD's label knowledge: every client pre-trains `epochs` epochs on its node and uploads
    its softmax outputs on `x`; [clients, len(x), C] by client id.

    Args:
      num_clients: The number of clients.
      epochs: Pre-training epochs on each node.
      x: The inputs to label, [N, H, W, C].

    Returns:
      Softmax outputs, [clients, N, C] by client id.
    """
    content = _records('soft_labels', {'epochs': int(epochs)}, public=[x])
    found = self._ask(content, range(num_clients))
    probabilities = {}
    for reply, _ in found.values():
      if id(reply) not in probabilities:
        clients = [int(c) for c in reply['metrics']['client_ids']]
        (p,) = _reply_rows(reply, 'probabilities', clients, [np.float32])
        if p.ndim != 3 or p.shape[1] != len(x):
          raise UploadError(
            f'SuperNode reply for client(s) {clients}: probabilities are '
            f'float32{list(p.shape)}, expected [{len(clients)}, {len(x)}, classes]'
          )
        probabilities[id(reply)] = [p]
    _same_trailing_shapes('probabilities', list(probabilities.values()))
    return np.stack(
      [probabilities[id(reply)][0][row] for reply, row in map(found.get, range(num_clients))]
    )

  def distill(self, members: np.ndarray, config, key: jax.Array) -> List[np.ndarray]:
    """KIP on the members' nodes (member j with fold_in(key, j), as in one batched program);
    the stacked (x, y, y_matrix, loss) of every member, in `members` order.

    Args:
      members: The ids of the clients that distil.
      config: The KIP settings.
      key: The PRNG key (member j uses fold_in(key, j)).

    Returns:
      The stacked (x, y, y_matrix, loss) of every member, in `members` order.
    """
    task = {
      'members': [int(c) for c in members],
      'kip': json.dumps(config._asdict()),
      'key': [int(k) for k in np.asarray(key).reshape(-1)],
    }
    found = self._ask(_records('distill', task), members)
    per_member = [found[int(c)] for c in members]
    sets = {}
    for reply, _ in per_member:
      if id(reply) not in sets:
        clients = [int(c) for c in reply['metrics']['client_ids']]
        sets[id(reply)] = _reply_rows(reply, 'sets', clients, DISTILLED_DTYPES)
    _same_trailing_shapes('sets', list(sets.values()))
    return [
      np.stack([sets[id(reply)][field][row] for reply, row in per_member]) for field in range(4)
    ]

  def _exchange(self, content) -> list:
    """Sends `content` to every node; the replies that come within the timeout."""
    from flwr.app import Message  # pylint: disable=g-import-not-at-top

    messages = [Message(content, dst_node_id=n, message_type=TRAIN_MESSAGE) for n in self.nodes]
    # Grid.send_and_receive polls every 3 s, which would add up to 3 s to every round.
    waiting = set(self.grid.push_messages(messages))
    deadline = time.monotonic() + self.timeout_s
    replies: list = []
    while waiting and time.monotonic() < deadline:
      got = list(self.grid.pull_messages(waiting))
      replies.extend(got)
      waiting.difference_update(m.metadata.reply_to_message_id for m in got)
      if waiting:
        time.sleep(POLL_S)
    return replies


def _source(reply) -> str:
  """A reply's SuperNode, as Flower names it (its node id)."""
  node = getattr(getattr(reply, 'metadata', None), 'src_node_id', None)
  return 'an unnamed node' if node is None else f'node {node}'


def _record_bytes(content) -> int:
  return int(sum(r.count_bytes() for r in content.values() if hasattr(r, 'count_bytes')))


def wait_for_nodes(grid, num_nodes: int, timeout_s: float = 300.0) -> List[int]:
  """Waits until `num_nodes` SuperNodes are connected; ConfigError after `timeout_s`.

  Args:
    grid: The Flower Grid of the ServerApp.
    num_nodes: How many SuperNodes must be connected.
    timeout_s: How long to wait, in seconds.

  Returns:
    The ids of the connected nodes, sorted.
  """
  deadline = time.monotonic() + timeout_s
  while True:
    nodes = sorted(grid.get_node_ids())
    if len(nodes) >= num_nodes:
      return nodes
    if time.monotonic() > deadline:
      raise ConfigError(f'{len(nodes)} of {num_nodes} SuperNodes connected in {timeout_s:.0f} s')
    time.sleep(0.5)


class RemoteGroupTrainer:
  """`GroupTrainer.train`'s interface, run on the SuperNodes (see the module docstring)."""

  def __init__(
    self, transport: FlowerTransport, spec: str, tx, recipe: Dict[str, Any], partition_sizes
  ):
    self.transport, self.spec, self.tx = transport, spec, tx
    self.recipe = json.dumps(recipe, sort_keys=True)
    self.partition_sizes = np.asarray(partition_sizes)

  def train(
    self,
    state: TrainState,
    fed,
    epochs: int,
    key: jax.Array,
    anchor: Any = None,
    progress=None,
    client_ids=None,
    context: Any = None,
  ) -> Tuple[TrainState, TrainMetrics]:
    """`GroupTrainer.train` on the SuperNodes: each node trains its clients and sends them back.

    Args:
      state: Stacked TrainState of the group (leading axis = clients of `fed`).
      fed: FederatedArrays (x [m, n_max, ...], y, sizes [m]); samples beyond a client's partition (a
        hybrid set's) are sent along.
      epochs: Local epochs.
      key: The data-order key, as in `GroupTrainer.train`.
      anchor: FedProx reference parameters, or None.
      progress: Called as progress(epochs_done, epochs); the nodes report once, at the end.
      client_ids: Global ids of the group's clients (default 0..m-1).
      context: Must be None: per-client context is not carried to the nodes.

    Returns:
      (new stacked TrainState, TrainMetrics).
    """
    if context is not None:
      raise ConfigError(
        'this method gives its clients per-client training context, which the Flower bridge '
        'does not carry'
      )
    m = fed.y.shape[0]
    ids = np.arange(m) if client_ids is None else np.asarray(client_ids)
    sizes = np.asarray(fed.sizes)
    own = np.minimum(sizes, self.partition_sizes[ids])  # samples from the client's partition
    counts = sizes - own
    extra = None
    own_data_spec = self.transport.own_data
    if own_data_spec is not None and (
      counts.any() or json.loads(self.recipe)['kind'] != 'classifier'
    ):
      raise ConfigError(
        'this method trains clients on samples beyond their own data or checks their labels on '
        'the server, which SuperNodes serving their own data do not allow'
      )
    if counts.any():
      extra = tuple(
        np.concatenate([np.asarray(a[i, own[i] : sizes[i]]) for i in range(m)])
        for a in (fed.x, fed.y)
      )
    model = state.model
    shared = _all_equal(model)
    start = jax.tree.leaves(jax.tree.map(lambda a: np.asarray(a)[0], model) if shared else model)
    anchor_leaves = None if anchor is None else [np.asarray(a) for a in jax.tree.leaves(anchor)]
    anchor_is_start = (
      anchor_leaves is not None
      and shared
      and _same_arrays(anchor_leaves, jax.tree.leaves(jax.tree.map(lambda a: a[0], model.params)))
    )
    request = TrainRequest(
      self.spec,
      self.recipe,
      ids,
      sizes,
      # own data: the nodes' samples, which the server never sees, are not checked here
      [] if own_data_spec is not None else client_digests(fed, range(m), own),
      epochs,
      np.asarray(jax.random.key_data(key) if _is_typed_key(key) else key),
      [np.asarray(a) for a in start],
      shared,
      None if anchor_is_start else anchor_leaves,
      counts,
      extra,
      anchor_is_start,
      own_data_spec,
    )
    leaves, metrics = self.transport.train(request)
    treedef = jax.tree.structure(model)
    recipe = json.loads(self.recipe)
    sent = uploaded_leaves(model, recipe)
    replied = np.array([int(c) in leaves for c in ids])
    if not replied.all():  # a dropped client keeps the model it started from, flagged
      if recipe.get('kind') == 'cvae':
        raise ConfigError('a CVAE client did not come back: FedMHO and FedCVAE need every client')
      starts = jax.tree.leaves(model)
      nan = np.full(epochs, np.nan, np.float32)
      for i in np.flatnonzero(~replied):
        leaves[int(ids[i])] = [np.asarray(a)[i] for a, keep in zip(starts, sent) if keep]
        metrics[int(ids[i])] = (nan, nan, None)
    for c in ids:
      if len(leaves[int(c)]) != sum(sent):
        raise UploadError(
          f'SuperNode reply for client {int(c)}: carries {len(leaves[int(c)])} arrays, '
          f'expected {sum(sent)}'
        )
    if not all(sent):  # what stays on the node keeps, here, the value the client started from
      starts = jax.tree.leaves(model)
      for i, c in enumerate(ids):
        returned = iter(leaves[int(c)])
        leaves[int(c)] = [
          next(returned) if keep else np.asarray(starts[j])[i] for j, keep in enumerate(sent)
        ]
    per_client = [jax.tree.unflatten(treedef, leaves[int(c)]) for c in ids]
    # Each client's leaves are the dtype and shape it started from before they are stacked
    # (np.stack would promote one float64 leaf, jnp.asarray cast it back to float32). Non-finite
    # values pass: a diverged client is the server's to handle, as in one process.
    one_client = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model)
    for c, tree in zip(ids, per_client):
      validate_tree(tree, one_client, f'SuperNode reply for client {int(c)}', require_finite=False)
    trained = jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *per_client)
    if recipe.get('kind') == 'cvae':  # the label histograms, checked
      for i, c in enumerate(ids):
        counts = metrics[int(c)][2]
        labels = np.asarray(fed.y[i, : own[i]])
        expected = np.bincount(labels, minlength=0 if counts is None else len(counts))
        if counts is None or not np.array_equal(counts, expected):
          raise ConfigError(f"the label histogram of CVAE client {int(c)} is not its data's")
    loss = np.stack([metrics[int(c)][0] for c in ids])
    accuracy = np.stack([metrics[int(c)][1] for c in ids])
    if progress is not None:
      progress(epochs, epochs)
    # A fresh optimiser per call (train_groups): the caller keeps only the model.
    return TrainState(trained, state.opt_state), TrainMetrics(
      loss, accuracy, None if replied.all() else replied
    )


def _same_arrays(a: Sequence[Any], b: Sequence[Any]) -> bool:
  return len(a) == len(b) and all(
    np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y) for x, y in zip(a, b)
  )


def _is_typed_key(key) -> bool:
  return jnp.issubdtype(getattr(key, 'dtype', np.float32), jax.dtypes.prng_key)


# ------------------------------------------------------------------------------------------------
# the node's side
# ------------------------------------------------------------------------------------------------
class NodeTrainer:
  """A SuperNode's clients: does the share of each request that concerns the clients it holds."""

  def __init__(self, ctx, partition_id: int, num_partitions: int):
    if not 0 <= partition_id < num_partitions:
      raise ConfigError(f'partition-id {partition_id} is not in [0, {num_partitions})')
    self.ctx = ctx
    self.owned = sharding.client_block(ctx.num_clients, partition_id, num_partitions)
    # Own data (`serving`): {client id: its samples} and the run config; None: the seeded
    # partition of `ctx`.
    self.clients: Optional[Dict[int, own_data.ClientData]] = None
    self._config = None
    self._data_spec: Optional[Tuple[Tuple[int, ...], int]] = None
    self._trainers: Dict[Tuple, Any] = {}
    self._templates: Dict[str, Any] = {}

  @classmethod
  def serving(cls, config: ml_collections.ConfigDict, data_dir: str) -> 'NodeTrainer':
    """A node whose clients are the files of its own `data_dir` (jfed/flower/own_data.py).

    Their format is checked now; their image shape and labels against the run's dataset at the
    first message, which carries them (the node loads no dataset of its own).

    Args:
      config: The run config (the clients' model, optimiser and batch size, their number).
      data_dir: The node's directory of `client_<id>.npz` files.

    Returns:
      The node, its context built at its first message.
    """
    clients = own_data.load_clients(data_dir, int(config.partition.num_clients))
    node = cls.__new__(cls)
    node.ctx, node.owned, node.clients, node._config = None, list(clients), clients, config
    node._data_spec, node._trainers, node._templates = None, {}, {}
    return node

  def _serve_own_data(self, data_spec: Optional[Tuple[Sequence[int], int]]) -> None:
    """Checks that the server and this node agree on whose data the clients train (`data_spec`
    None: the seeded partition), and at the first own-data message builds the node's context over
    its files, checked against the dataset's (image shape, classes) that the server sent."""
    if data_spec is None and self.clients is not None:
      raise ConfigError(
        'this SuperNode serves its own data (node config data-dir), but the run trains the '
        'seeded partition: start the run with run config own-data=true'
      )
    if data_spec is not None and self.clients is None:
      raise ConfigError(
        "the run trains the SuperNodes' own data (run config own-data=true), but this "
        'SuperNode has no node config data-dir'
      )
    if data_spec is None:
      return
    shape, classes = tuple(int(d) for d in data_spec[0]), int(data_spec[1])
    if self._data_spec is not None:
      if (shape, classes) != self._data_spec:
        raise ConfigError(
          f'the server changed the dataset from {self._data_spec} to {(shape, classes)}'
        )
      return
    own_data.check_spec(self.clients, shape, classes)
    ids = list(self.clients)
    bounds = np.cumsum([0] + [len(self.clients[c].y) for c in ids])
    rows = {c: np.arange(bounds[j], bounds[j + 1]) for j, c in enumerate(ids)}
    config = self._config
    parts = [rows.get(c, np.zeros(0, np.int64)) for c in range(int(config.partition.num_clients))]
    empty_x, empty_y = np.zeros((0, *shape), np.float32), np.zeros(0, np.int32)
    dataset = Dataset(
      str(config.dataset.name),
      np.concatenate([self.clients[c].x for c in ids]),
      np.concatenate([self.clients[c].y for c in ids]),
      empty_x,  # the test split is the server's
      empty_y,
      classes,
      empty_x,  # nothing to hold out: the server holds any public data
      empty_y,
      str(config.dataset.get('normalization', 'none') or 'none'),
    )
    self.ctx = make_context(config, dataset, parts)
    self._data_spec = (shape, classes)

  def handle(self, content, setup_seconds: float = 0.0):
    """The reply's records to a request of any operation; `result` carries the ids of the
    clients it concerns and the node's time (`setup_seconds`, the caller's, plus this call's)."""
    start = time.perf_counter()
    op = str(content['config']['op'])
    if op not in OPERATIONS:
      raise ConfigError(f'unknown operation {op!r}; known: {", ".join(OPERATIONS)}')
    if op in ('soft_labels', 'distill') and self.clients is not None:
      raise ConfigError(
        f'this SuperNode serves its own data (node config data-dir): {op!r} (HFLDD) runs on the '
        'seeded partition only'
      )
    if op == 'train':
      ids, arrays, metrics = self._train(TrainRequest.from_records(content))
    elif op == 'describe':
      ids, arrays, metrics = self._describe(content)
    elif op == 'soft_labels':
      ids, arrays, metrics = self._soft_labels(content)
    else:
      ids, arrays, metrics = self._distill(content)
    from flwr.app import MetricRecord, RecordDict  # pylint: disable=g-import-not-at-top

    result = {
      'client_ids': [int(c) for c in ids],
      **metrics,
      'seconds': setup_seconds + time.perf_counter() - start,
    }
    return RecordDict(
      {'metrics': MetricRecord(result), **{k: _arrays(v) for k, v in arrays.items()}}
    )

  def train(self, request: TrainRequest, setup_seconds: float = 0.0):
    return self.handle(request.to_records(), setup_seconds)

  def _describe(self, content):
    """The clients of this node's own data: their ids and label counts (hence sizes)."""
    task = content['config']
    self._serve_own_data(_spec_of(task) if task.get('data') == 'node' else None)
    if self.clients is None:  # a describe request always carries the spec
      raise ConfigError('a describe request without the dataset spec')
    classes = self._data_spec[1]
    ids = list(self.clients)
    table = np.stack([np.bincount(self.clients[c].y, minlength=classes) for c in ids])
    return ids, {'label_counts': [table.astype(np.int64)]}, {}

  def _train(self, request: TrainRequest):
    self._serve_own_data(request.data_spec)
    rows = [i for i, c in enumerate(request.client_ids) if int(c) in self.owned]
    if not rows:
      empty = {'loss': [], 'accuracy': [], 'num-examples': 0}
      return [], {'arrays': []}, empty if self.clients is None else {**empty, 'sizes': []}
    ids = request.client_ids[rows]
    recipe = json.loads(request.recipe)
    kind = recipe.get('kind')
    if kind not in ('classifier', 'cvae'):
      raise ConfigError(f'unknown kind of client training {kind!r}')
    build = generative.build_cvae_spec if kind == 'cvae' else None
    (group,) = common.client_groups(self.ctx, ids, build=build)
    if group.spec != request.spec:
      raise ConfigError(f'clients {ids.tolist()} are {group.spec} here, {request.spec} there')
    sizes = request.sizes[rows]
    counts = np.asarray(request.extra_counts)[rows]
    own = sizes - counts
    if np.any(own < 0) or np.any(own > group.fed.sizes):
      raise ConfigError(f'the server asks clients {ids.tolist()} for more samples than they hold')
    if self.clients is not None and counts.any():
      raise ConfigError(f'the server sends clients {ids.tolist()} samples beyond their own data')
    if self.clients is None and client_digests(group.fed, range(len(ids)), own) != [
      request.digests[i] for i in rows
    ]:
      raise ConfigError(
        f'the server trains clients {ids.tolist()} on data other than their partition here '
        '(this method trains clients on data the SuperNodes do not hold)'
      )
    if counts.any():  # the partition's samples, then the extra ones the server sent
      offsets = np.concatenate([[0], np.cumsum(request.extra_counts)])
      xs, ys = [], []
      for j, i in enumerate(rows):
        ex, ey = (a[offsets[i] : offsets[i + 1]] for a in request.extra)
        xs.append(np.concatenate([group.fed.x[j, : own[j]], ex.astype(group.fed.x.dtype)]))
        ys.append(np.concatenate([group.fed.y[j, : own[j]], ey.astype(group.fed.y.dtype)]))
      bounds = np.cumsum([0] + [len(x) for x in xs])
      fed = federate(
        np.concatenate(xs),
        np.concatenate(ys),
        [np.arange(bounds[j], bounds[j + 1]) for j in range(len(xs))],
      )
      group = group._replace(fed=fed)
    group = group._replace(fed=group.fed._replace(sizes=sizes.astype(np.int32)))
    cache_key = (request.spec, request.recipe)
    if cache_key not in self._trainers:
      self._trainers[cache_key] = _local_trainer(self.ctx, group, recipe)
    trainer = self._trainers[cache_key]
    if request.spec not in self._templates:
      init = cvae_clients.init_cvae if kind == 'cvae' else engine.init_model
      shape = self.ctx.dataset.input_shape
      self._templates[request.spec] = init(group.module, shape, jax.random.PRNGKey(0))
    treedef = jax.tree.structure(self._templates[request.spec])
    if 'local_dp' in recipe and not request.start_shared:
      raise ConfigError('local DP clips each update against the round model: none was sent')
    if request.start_shared:
      one = jax.tree.unflatten(treedef, [jnp.asarray(a) for a in request.start])
      models = engine.replicate(one, len(ids))
    else:
      models = jax.tree.unflatten(
        treedef, [jnp.asarray(np.asarray(a)[rows]) for a in request.start]
      )
    anchor = None
    if request.anchor_is_start:
      if not request.start_shared:
        raise ConfigError('the server says the anchor is the start model, but sends one per client')
      anchor = jax.tree.map(lambda a: a[0], models.params)
    elif request.anchor is not None:
      params_def = jax.tree.structure(self._templates[request.spec].params)
      anchor = jax.tree.unflatten(params_def, [jnp.asarray(a) for a in request.anchor])
    state, metrics = trainer.train(
      engine.init_train_state(trainer.tx, models),
      group.fed,
      request.epochs,
      jnp.asarray(request.key, jnp.uint32),
      anchor=anchor,
      client_ids=ids,
    )
    model = state.model
    if 'local_dp' in recipe:  # clipped and noised here: the server never sees a clean update
      model = privacy.privatize_locally(
        model,
        one,
        privacy.fresh_noise_key(),  # the node's own randomness: nobody else can regenerate it
        jnp.asarray(ids),
        jnp.float32(recipe['local_dp']['clip_norm']),
        jnp.float32(recipe['local_dp']['noise_multiplier']),
      )
    sent = uploaded_leaves(model, recipe)
    arrays = {'arrays': [np.asarray(a) for a, keep in zip(jax.tree.leaves(model), sent) if keep]}
    if kind == 'cvae':  # FedMHO's label histogram of the client's own samples
      classes = self.ctx.dataset.num_classes
      arrays['label_counts'] = [
        np.stack(
          [
            np.bincount(np.asarray(group.fed.y[j, : own[j]]), minlength=classes)
            for j in range(len(ids))
          ]
        ).astype(np.int32)
      ]
    return (
      ids,
      arrays,
      {
        'loss': [float(v) for v in np.asarray(metrics.loss).reshape(-1)],
        'accuracy': [float(v) for v in np.asarray(metrics.accuracy).reshape(-1)],
        # Flower's name for the weight of a reply (its strategies and mods read it)
        'num-examples': int(np.sum(sizes)),
        # own data: what each client trained on, which the server checks against its request
        **({} if self.clients is None else {'sizes': [int(n) for n in sizes]}),
      },
    )

  def _soft_labels(self, content):
    """HFLDD step 1 for this node's clients: pre-train as `common.local_models` does (the same
    init and keys), then the softmax outputs on the public images the server sent."""
    ids = list(self.owned)
    if not ids:
      return [], {'probabilities': []}, {}
    x = content['public'].to_numpy_ndarrays()[0]
    local = common.local_models(self.ctx, int(content['config']['epochs']), ids)
    probabilities = common.client_probabilities(self.ctx, local, x)[ids]
    return ids, {'probabilities': [probabilities]}, {}

  def _distill(self, content):
    """HFLDD step 3 for this node's members: KIP on their own data, member j of the server's
    list with fold_in(key, j), as in the one batched program of a single process."""
    task = content['config']
    members = [int(c) for c in task['members']]
    positions = [j for j, c in enumerate(members) if c in self.owned]
    if not positions:
      return [], {'sets': []}, {}
    ids = [members[j] for j in positions]
    ds = self.ctx.dataset
    fed = federate(ds.train_x, ds.train_y, [self.ctx.parts[c] for c in ids])
    res = kip_distill_batched(
      fed.x,
      fed.y,
      fed.sizes,
      KIPConfig(**json.loads(str(task['kip']))),
      jnp.asarray(np.asarray(task['key'], np.uint32)),
      ds.num_classes,
      mesh=self.ctx.mesh,
      indices=positions,
    )
    sets = [np.asarray(a) for a in (res.x, res.y, res.y_matrix, res.loss)]
    return ids, {'sets': sets}, {}


def _local_trainer(ctx, group, recipe: Dict[str, Any]):
  """The engine's trainer that `recipe` describes, built as the server's method would."""
  if recipe['kind'] == 'cvae':
    fields = generative.CVAESettings._fields
    settings = generative.CVAESettings(**{k: v for k, v in recipe.items() if k in fields})
    return generative.cvae_trainers(ctx, [group], settings)[0]
  optimizer = ml_collections.ConfigDict(recipe['optimizer'])
  return common.make_trainers(
    ctx, [group], recipe['prox_mu'], optimizer, recipe['optimizer_steps']
  )[0]
