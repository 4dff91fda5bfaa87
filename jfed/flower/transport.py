"""Client training on Flower SuperNodes, behind the interface of jfed's `GroupTrainer`.

On the server a `RemoteGroupTrainer` stands where a method's `GroupTrainer` stands
(`common.make_trainers` builds one when the run has a transport), so every method whose client
training goes through `common.train_groups` runs unchanged: its server stage receives the
trained group, validates each upload and counts its bytes exactly as in one process. A train
call becomes one message per SuperNode with the start model, the round's key and the clients'
ids and sizes. Each node trains the clients it holds (a contiguous block of the client ids, by
its `partition-id` of `num-partitions`) as one jfed group, with the same trainer and the same
per-client keys as in one process, so every client ends exactly as it would there (the engine
trains a client the same whatever group it is in; tests/test_engine.py).

The node rebuilds its clients' data from the seed, like every process of a multi-process run.
Each side digests every client's real samples, and a node refuses a request whose digests
differ from its own: a method that trains clients on data other than their partition (HFLDD's
distilled sets, DynaFed's synthetic data) cannot silently train the wrong data through Flower.
"""

import hashlib
import json
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed.engine.state import TrainState
from jfed.engine.training import TrainMetrics
from jfed.errors import ConfigError

TRAIN_MESSAGE = 'train'


def owned_block(num_clients: int, partition_id: int, num_partitions: int) -> range:
  """The client ids SuperNode `partition_id` of `num_partitions` holds."""
  per_node = -(-num_clients // num_partitions)
  start = min(partition_id * per_node, num_clients)
  return range(start, min(start + per_node, num_clients))


def client_digests(fed, rows: Sequence[int]) -> List[str]:
  """A digest of each listed client's real samples (images and labels)."""
  out = []
  for i in rows:
    n = int(fed.sizes[i])
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.asarray(fed.x[i, :n])).tobytes())
    h.update(np.ascontiguousarray(np.asarray(fed.y[i, :n])).tobytes())
    out.append(h.hexdigest()[:16])
  return out


def _all_equal(tree: Any) -> bool:
  return all(bool(np.all(np.asarray(a) == np.asarray(a)[:1])) for a in jax.tree.leaves(tree))


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
  ):
    # recipe: how the clients train, as JSON ({'kind': 'classifier' | 'cvae', ...}; see
    # common.make_trainers and generative.cvae_trainers), so a node builds the same trainer.
    self.spec, self.recipe = spec, recipe
    self.client_ids, self.sizes, self.digests = client_ids, sizes, digests
    self.epochs, self.key = epochs, key
    self.start, self.start_shared, self.anchor = start, start_shared, anchor

  def to_records(self):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict  # pylint: disable=g-import-not-at-top

    records = {
      'task': ConfigRecord(
        {
          'spec': self.spec,
          'recipe': self.recipe,
          'client_ids': [int(c) for c in self.client_ids],
          'sizes': [int(s) for s in self.sizes],
          'digests': list(self.digests),
          'epochs': int(self.epochs),
          'key': [int(k) for k in np.asarray(self.key).reshape(-1)],
          'start_shared': bool(self.start_shared),
        }
      ),
      'start': ArrayRecord(numpy_ndarrays=[np.asarray(a) for a in self.start]),
    }
    if self.anchor is not None:
      records['anchor'] = ArrayRecord(numpy_ndarrays=[np.asarray(a) for a in self.anchor])
    return RecordDict(records)

  @classmethod
  def from_records(cls, content) -> 'TrainRequest':
    task = content['task']
    return cls(
      spec=str(task['spec']),
      recipe=str(task['recipe']),
      client_ids=np.asarray(task['client_ids'], np.int64),
      sizes=np.asarray(task['sizes'], np.int32),
      digests=list(task['digests']),
      epochs=int(task['epochs']),
      key=np.asarray(task['key'], np.uint32),
      start=content['start'].to_numpy_ndarrays(),
      start_shared=bool(task['start_shared']),
      anchor=content['anchor'].to_numpy_ndarrays() if 'anchor' in content else None,
    )


class FlowerTransport:
  """The server's side: sends train requests to every SuperNode and reassembles the group."""

  def __init__(self, grid, num_nodes: int, timeout_s: float = 3600.0):
    self.grid, self.timeout_s = grid, timeout_s
    self.nodes = wait_for_nodes(grid, num_nodes)
    self.bytes_sent = self.bytes_received = 0
    # Per train call: the wall time of the exchange and the slowest node's own time (its setup
    # and training, inside its ClientApp process); the difference is what Flower costs.
    self.exchange_seconds: List[float] = []
    self.node_seconds: List[float] = []

  def trainer(self, spec: str, tx, recipe: Dict[str, Any]) -> 'RemoteGroupTrainer':
    """The trainer of a group of `spec` clients that train as `recipe` says, on the nodes."""
    return RemoteGroupTrainer(self, spec, tx, recipe)

  def train(self, request: TrainRequest) -> Tuple[Dict[int, List[np.ndarray]], Dict[int, Any]]:
    """{client id: trained leaves}, {client id: (losses, accuracies) per epoch}."""
    content = request.to_records()
    self.bytes_sent += _record_bytes(content) * len(self.nodes)
    start = time.perf_counter()
    replies = self._exchange(content)
    self.exchange_seconds.append(time.perf_counter() - start)
    if len(replies) < len(self.nodes):
      raise ConfigError(
        f'{len(self.nodes) - len(replies)} of {len(self.nodes)} SuperNodes did not reply '
        f'within {self.timeout_s:.0f} s'
      )
    requested = {int(c) for c in request.client_ids}
    leaves, metrics, node_seconds = {}, {}, [0.0]
    for reply in replies:
      if reply.has_error():
        raise ConfigError(f'a SuperNode failed to train: {reply.error.reason}')
      self.bytes_received += _record_bytes(reply.content)
      node_seconds.append(float(reply.content['result']['seconds']))
      ids = [int(c) for c in reply.content['result']['client_ids']]
      if not ids:
        continue
      stacked = reply.content['models'].to_numpy_ndarrays()
      epochs = request.epochs
      loss = np.asarray(reply.content['result']['loss'], np.float64).reshape(len(ids), epochs)
      acc = np.asarray(reply.content['result']['accuracy'], np.float64).reshape(len(ids), epochs)
      for row, cid in enumerate(ids):
        if cid in leaves or cid not in requested:
          raise ConfigError(f'client {cid} came back from a SuperNode not asked to train it')
        leaves[cid] = [a[row] for a in stacked]
        metrics[cid] = (loss[row], acc[row])
    self.node_seconds.append(max(node_seconds))
    missing = sorted(requested - set(leaves))
    if missing:
      raise ConfigError(
        f'no SuperNode holds client(s) {missing}: start as many SuperNodes as their '
        'num-partitions says'
      )
    return leaves, metrics

  def _exchange(self, content) -> list:
    """Sends `content` to every node; their replies."""
    from flwr.app import Message  # pylint: disable=g-import-not-at-top

    messages = [Message(content, dst_node_id=n, message_type=TRAIN_MESSAGE) for n in self.nodes]
    return list(self.grid.send_and_receive(messages, timeout=self.timeout_s))


def _record_bytes(content) -> int:
  return int(sum(r.count_bytes() for r in content.values() if hasattr(r, 'count_bytes')))


def wait_for_nodes(grid, num_nodes: int, timeout_s: float = 300.0) -> List[int]:
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

  def __init__(self, transport: FlowerTransport, spec: str, tx, recipe: Dict[str, Any]):
    self.transport, self.spec, self.tx = transport, spec, tx
    self.recipe = json.dumps(recipe, sort_keys=True)

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
    if context is not None:
      raise ConfigError(
        'this method gives its clients per-client training context, which the Flower bridge '
        'does not carry'
      )
    m = fed.y.shape[0]
    ids = np.arange(m) if client_ids is None else np.asarray(client_ids)
    model = state.model
    shared = _all_equal(model)
    start = jax.tree.leaves(jax.tree.map(lambda a: np.asarray(a)[0], model) if shared else model)
    request = TrainRequest(
      self.spec,
      self.recipe,
      ids,
      np.asarray(fed.sizes),
      client_digests(fed, range(m)),
      epochs,
      np.asarray(jax.random.key_data(key) if _is_typed_key(key) else key),
      [np.asarray(a) for a in start],
      shared,
      None if anchor is None else [np.asarray(a) for a in jax.tree.leaves(anchor)],
    )
    leaves, metrics = self.transport.train(request)
    treedef = jax.tree.structure(model)
    per_client = [jax.tree.unflatten(treedef, leaves[int(c)]) for c in ids]
    trained = jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *per_client)
    loss = np.stack([metrics[int(c)][0] for c in ids])
    accuracy = np.stack([metrics[int(c)][1] for c in ids])
    if progress is not None:
      progress(epochs, epochs)
    # A fresh optimiser per call (train_groups): the caller keeps only the model.
    return TrainState(trained, state.opt_state), TrainMetrics(loss, accuracy)


def _is_typed_key(key) -> bool:
  return jnp.issubdtype(getattr(key, 'dtype', np.float32), jax.dtypes.prng_key)


# ------------------------------------------------------------------------------------------------
# the node's side
# ------------------------------------------------------------------------------------------------
class NodeTrainer:
  """A SuperNode's clients: trains the share of each request that the node holds."""

  def __init__(self, ctx, partition_id: int, num_partitions: int):
    if not 0 <= partition_id < num_partitions:
      raise ConfigError(f'partition-id {partition_id} is not in [0, {num_partitions})')
    self.ctx = ctx
    self.owned = owned_block(ctx.num_clients, partition_id, num_partitions)
    self._trainers: Dict[Tuple, Any] = {}
    self._templates: Dict[str, Any] = {}

  def train(self, request: TrainRequest, setup_seconds: float = 0.0):
    """The reply's records: the trained models of this node's clients, with their metrics and
    the node's time (`setup_seconds`, the caller's, plus this call's)."""
    start = time.perf_counter()
    from flwr.app import ArrayRecord, MetricRecord, RecordDict  # pylint: disable=g-import-not-at-top

    from jfed import engine  # pylint: disable=g-import-not-at-top
    from jfed.cvae import clients as cvae_clients  # pylint: disable=g-import-not-at-top
    from jfed.methods import common, generative  # pylint: disable=g-import-not-at-top

    rows = [i for i, c in enumerate(request.client_ids) if int(c) in self.owned]
    if not rows:
      result = {'client_ids': [], 'loss': [], 'accuracy': [], 'seconds': setup_seconds}
      return RecordDict({'models': ArrayRecord(numpy_ndarrays=[]), 'result': MetricRecord(result)})
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
    if np.any(sizes > group.fed.sizes):
      raise ConfigError(f'the server asks clients {ids.tolist()} for more samples than they hold')
    group = group._replace(fed=group.fed._replace(sizes=sizes.astype(np.int32)))
    if client_digests(group.fed, range(len(ids))) != [request.digests[i] for i in rows]:
      raise ConfigError(
        f'the server trains clients {ids.tolist()} on data other than their partition here '
        '(this method trains clients on data the SuperNodes do not hold)'
      )
    cache_key = (request.spec, request.recipe)
    if cache_key not in self._trainers:
      self._trainers[cache_key] = _local_trainer(self.ctx, group, recipe)
    trainer = self._trainers[cache_key]
    if request.spec not in self._templates:
      init = cvae_clients.init_cvae if kind == 'cvae' else engine.init_model
      shape = self.ctx.dataset.input_shape
      self._templates[request.spec] = init(group.module, shape, jax.random.PRNGKey(0))
    treedef = jax.tree.structure(self._templates[request.spec])
    if request.start_shared:
      one = jax.tree.unflatten(treedef, [jnp.asarray(a) for a in request.start])
      models = engine.replicate(one, len(ids))
    else:
      models = jax.tree.unflatten(
        treedef, [jnp.asarray(np.asarray(a)[rows]) for a in request.start]
      )
    anchor = None
    if request.anchor is not None:
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
    stacked = [np.asarray(a) for a in jax.tree.leaves(state.model)]
    result = {
      'client_ids': [int(c) for c in ids],
      'loss': [float(v) for v in np.asarray(metrics.loss).reshape(-1)],
      'accuracy': [float(v) for v in np.asarray(metrics.accuracy).reshape(-1)],
      'seconds': setup_seconds + time.perf_counter() - start,
    }
    return RecordDict(
      {'models': ArrayRecord(numpy_ndarrays=stacked), 'result': MetricRecord(result)}
    )


def _local_trainer(ctx, group, recipe: Dict[str, Any]):
  """The engine's trainer that `recipe` describes, built as the server's method would."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  from jfed.methods import common, generative  # pylint: disable=g-import-not-at-top

  if recipe['kind'] == 'cvae':
    settings = generative.CVAESettings(**{k: v for k, v in recipe.items() if k != 'kind'})
    return generative.cvae_trainers(ctx, [group], settings)[0]
  optimizer = ml_collections.ConfigDict(recipe['optimizer'])
  return common.make_trainers(
    ctx, [group], recipe['prox_mu'], optimizer, recipe['optimizer_steps']
  )[0]
