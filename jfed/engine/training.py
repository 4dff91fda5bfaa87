"""Local training of a group of clients that share an architecture.

A group's state is stacked along a leading client axis and its data is a padded
`FederatedArrays`. Every strategy runs the *same* per-client step function, so they give the
same numbers and differ only in how the (client, step) grid is mapped onto the machine:

- `loop`:  Python loop over clients and steps, one jitted single-client step. Fastest on XLA:CPU,
           where client-batched convolutions and convolutions inside `lax.scan` are
           pathologically slow (design.md, measured table). Its host side is kept to one
           dispatch per step (experiments/bench/client_training.py times it against the
           pre-issue-14 form in experiments/bench/reference_loop.py). Up to `loop_threads`
           clients train at once, each on its own host thread: XLA:CPU runs a convolution's
           backward pass on one core, so two clients' programs side by side keep both cores
           busy (`default_loop_threads`; every client's numbers are those of the plain loop).
- `vmap`:  one jitted step vmapped over clients, Python loop over steps.
- `scan`:  one jitted program per epoch: vmap over clients of a `lax.scan` over steps. The fast
           form on GPU/TPU.
- `auto`:  `loop` on CPU, `scan` elsewhere (confirmed by experiments/bench/client_training.py).

What a step minimises is the trainer's `objective` (`LocalObjective`): the cross entropy of a
classifier by default (`classification_objective`), or e.g. a CVAE's Eq. 3 (`jfed.cvae`), so
every client *kind* is one compiled group on the same engine. An objective that needs per-client
values which change between calls (HeteroFL's label mask, FedProto's global prototypes) gets them
as `context`: a pytree stacked over the group's clients, passed to `train`, sliced per client
like its data and handed to the objective as the keyword `context` (traced, so new values every
round compile nothing). Each step gets its own key,
fold_in(fold_in(fold_in(key, epoch), STEP_KEY_TAG), client id) folded with the step index: a
classifier's dropout and a CVAE's reparameterisation noise depend only on (key, epoch, client,
step), like the data order.

Exactness for unequal client sizes: each epoch, client k visits a fresh permutation of its own
`sizes[k]` samples in batches of `batch_size` (the last one partial, like a PyTorch DataLoader
with drop_last=False). Padded positions are masked out of the loss, the accuracy and the
BatchNorm statistics, and a step in which a client has no real sample leaves its parameters and
optimiser state untouched, so a padded client trains exactly as it would alone.
"""

import concurrent.futures
import copy
import functools
import math
import os
from typing import Any, Callable, NamedTuple, Optional, Protocol, Tuple

import jax
from jax import lax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax

from jfed.engine import multihost, sharding
from jfed.engine.state import ModelState, TrainState

STRATEGIES = ('auto', 'loop', 'vmap', 'scan')
# Folded into an epoch's key to derive the per-step keys (orders use the epoch key directly).
STEP_KEY_TAG = 0x5EED


def resolve_strategy(strategy: str, backend: Optional[str] = None) -> str:
  if strategy not in STRATEGIES:
    raise ValueError(f'Unknown client-map strategy {strategy!r}; valid: {", ".join(STRATEGIES)}')
  if strategy != 'auto':
    return strategy
  backend = backend or jax.default_backend()
  return 'loop' if backend == 'cpu' else 'scan'


# Overrides `default_loop_threads` (a positive integer), e.g. 1 for models whose steps are so
# cheap that they are dispatch-bound (an MLP), where two threads contend for the interpreter.
LOOP_THREADS_ENV = 'JFED_LOOP_THREADS'


def default_loop_threads(backend: Optional[str] = None) -> int:
  """How many clients the `loop` strategy trains at once: 2 on a CPU with 2 or more cores.

  Measured on 2 cores (docs/performance.md, experiments/bench/client_training.py): XLA:CPU runs
  the kernel and input gradients of a convolution on one core, so a second client's program
  beside the first fills the other core. Elsewhere (one core, or an accelerator, where `loop`
  is not the default) 1. The environment variable `JFED_LOOP_THREADS` overrides both.
  """
  value = os.environ.get(LOOP_THREADS_ENV, '').strip()
  if value:
    if not value.isdigit() or int(value) < 1:
      raise ValueError(f'{LOOP_THREADS_ENV} must be a positive integer, got {value!r}')
    return int(value)
  backend = backend or jax.default_backend()
  return 2 if backend == 'cpu' and (os.cpu_count() or 1) >= 2 else 1


class TrainMetrics(NamedTuple):
  loss: np.ndarray  # [clients, epochs] mean training loss over the client's samples
  accuracy: np.ndarray  # [clients, epochs] training accuracy
  # [clients] whether each client's training came back (False: its Flower SuperNode did not
  # reply in time, and its model is the one it started from); None: every client's did
  replied: Optional[np.ndarray] = None


def client_orders(
  key: jax.Array, client_ids: jax.Array, sizes: jax.Array, n_max: int, padded_len: int
) -> jax.Array:
  """[clients, padded_len] visiting orders: a permutation of each client's real samples first.

  Sample i of client c gets the sort key uniform(fold_in(fold_in(key, c), i)), so a client's
  order depends only on (key, its id, its size): not on the group's padding or its position in
  the group. That is what makes a padded client train exactly as it would alone.

  Args:
    key: The data-order key of the epoch.
    client_ids: Global ids of the clients, [clients].
    sizes: Their sample counts, [clients].
    n_max: The padded number of samples per client in the arrays.
    padded_len: The length of each order (>= n_max: whole batches).

  Returns:
    Int [clients, padded_len] sample indices; positions past a client's size are padding.
  """
  return jax.vmap(_client_order, in_axes=(None, 0, 0, None, None))(
    key, client_ids, sizes, n_max, padded_len
  )


def client_orders_each(
  keys: jax.Array, client_ids: jax.Array, sizes: jax.Array, n_max: int, padded_len: int
) -> jax.Array:
  """`client_orders` with a key per client ([clients] keys): clients of several runs (seeds) in
  one group each get the orders of their own run.

  Args:
    keys: One data-order key per client, [clients].
    client_ids: Global ids of the clients, [clients].
    sizes: Their sample counts, [clients].
    n_max: The padded number of samples per client in the arrays.
    padded_len: The length of each order (>= n_max: whole batches).

  Returns:
    Int [clients, padded_len] sample indices.
  """
  return jax.vmap(_client_order, in_axes=(0, 0, 0, None, None))(
    keys, client_ids, sizes, n_max, padded_len
  )


def _client_order(key, client_id, size, n_max: int, padded_len: int) -> jax.Array:
  positions = jnp.arange(n_max)
  ckey = jax.random.fold_in(key, client_id)
  u = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(ckey, i)))(positions)
  u = jnp.where(positions < size, u, 2.0)
  return jnp.pad(jnp.argsort(u), (0, padded_len - n_max))


def supervised_loss(logits, labels, weights):
  """Mean cross entropy over real samples; integer labels or soft-label distributions.

  Args:
    logits: Model outputs, [B, C].
    labels: Integer labels [B] or label distributions [B, C].
    weights: [B] sample weights (0 for padded rows).

  Returns:
    The mean loss over the real samples (a scalar).
  """
  if jnp.issubdtype(labels.dtype, jnp.integer):
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    hard = labels
  else:
    per_example = optax.softmax_cross_entropy(logits, labels)
    hard = jnp.argmax(labels, -1)
  count = jnp.sum(weights)
  loss = jnp.sum(per_example * weights) / jnp.maximum(count, 1.0)
  correct = jnp.sum((jnp.argmax(logits, -1) == hard) * weights)
  return loss, correct, count


class LocalObjective(Protocol):
  """What a client minimises in one step.

  Called as objective(module, params, batch_stats, x, y, weights, key) with one client's batch
  (weights [B]: 1 real, 0 padding) and the step's key, plus `context=` (that client's slice of
  the `context` given to `GroupTrainer.train`) when one is given; returns
  (loss to differentiate, (reported loss, correct predictions, real-sample count, new
  batch_stats)).
  """

  def __call__(
    self, module, params, batch_stats, x, y, weights, key
  ) -> Tuple[jax.Array, Tuple[jax.Array, jax.Array, jax.Array, Any]]: ...


def classification_objective(module, params, batch_stats, x, y, weights, key):
  """Cross entropy of a classifier (`supervised_loss`); dropout, if any, draws from `key`.

  Args:
    module: The client's flax module.
    params: Its parameters.
    batch_stats: Its BatchNorm statistics.
    x: A batch of inputs, [B, H, W, C].
    y: Integer labels [B] or label distributions [B, C].
    weights: [B] sample weights (0 for padded rows).
    key: The PRNG key of the step (dropout).

  Returns:
    (loss to differentiate, (reported loss, correct predictions, real-sample count, new
      batch_stats)), as `LocalObjective`.
  """
  logits, updates = module.apply(
    {'params': params, 'batch_stats': batch_stats},
    x,
    train=True,
    mask=weights > 0,
    mutable=['batch_stats'],
    rngs={'dropout': key},
  )
  loss, correct, count = supervised_loss(logits, y, weights)
  return loss, (loss, correct, count, updates.get('batch_stats', batch_stats))


# The clients' mode in local training (the run config's `local_bn`): 'train' every epoch, or
# DENSE's LocalUpdate, eval mode from each local training's second epoch on.
LOCAL_BN_MODES = ('train', 'eval_after_first_epoch')


def eval_mode_objective(module, params, batch_stats, x, y, weights, key):
  """`classification_objective` with the model in eval mode: BatchNorm normalises with its
  running statistics and leaves them unchanged, dropout is off (PyTorch's `model.eval()` during
  training; what DENSE's `LocalUpdate` does after its first epoch: `GroupTrainer`'s
  `train_mode_epochs`).

  Args:
    module: The client's flax module.
    params: Its parameters.
    batch_stats: Its BatchNorm statistics (used, returned unchanged).
    x: A batch of inputs, [B, H, W, C].
    y: Integer labels [B] or label distributions [B, C].
    weights: [B] sample weights (0 for padded rows).
    key: Unused (no dropout in eval mode).

  Returns:
    As `LocalObjective`, with the batch statistics unchanged.
  """
  del key
  logits = module.apply({'params': params, 'batch_stats': batch_stats}, x, train=False)
  loss, correct, count = supervised_loss(logits, y, weights)
  return loss, (loss, correct, count, batch_stats)


def _tree_where(pred, new, old):
  return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def _squared_distance(a, b):
  return sum(jnp.sum(jnp.square(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class ClientProgram:
  """What a group's compiled local-training programs depend on, passed to them as one static
  argument: the clients' module, the local objective, the optimiser (only its `update` is
  traced), the batch size and FedProx's weight. Two trainers, of one run or of two, whose
  programs are equal share jit's compiled programs; an optimiser made by
  `jfed.engine.optim.SpecOptimizer` is equal for every constant learning rate. A program whose
  module cannot be hashed (an array among its fields) is equal only to itself."""

  def __init__(self, module, objective, tx, batch_size: int, prox_mu: float):
    self.module, self.objective, self.tx = module, objective, tx
    self.batch_size, self.prox_mu = int(batch_size), float(prox_mu)
    # Hashed once: jit hashes a static argument at every call, and the `loop` strategy calls
    # once per step (a flax module's hash walks its fields).
    try:
      self._hash: Optional[int] = hash(self._key())
    except TypeError:
      self._hash = None

  def _key(self):
    return (self.module, self.objective, self.tx, self.batch_size, self.prox_mu)

  def __hash__(self) -> int:
    return id(self) if self._hash is None else self._hash

  def __eq__(self, other) -> bool:
    if self is other:
      return True
    if not isinstance(other, ClientProgram) or self._hash is None or other._hash is None:
      return False
    return self._hash == other._hash and self._key() == other._key()

  def replace(self, **changes) -> 'ClientProgram':
    fields = dict(zip(('module', 'objective', 'tx', 'batch_size', 'prox_mu'), self._key()))
    return ClientProgram(**{**fields, **changes})


def _client_step(
  program: ClientProgram, ts: TrainState, client, step, anchor, context, may_be_empty=True
):
  """One step of one client; client = (x, y, order, size, client_key), its data and this
  epoch's order and key."""
  x, y, order, size, client_key = client
  b = program.batch_size
  idx = lax.dynamic_slice(order, (step * b,), (b,))
  real = step * b + jnp.arange(b) < size
  xb, yb = x[idx], y[idx]
  weights = real.astype(jnp.float32)
  key = jax.random.fold_in(client_key, step)
  extra = {} if context is None else {'context': context}

  def objective(params):
    total, aux = program.objective(
      program.module, params, ts.model.batch_stats, xb, yb, weights, key, **extra
    )
    if program.prox_mu:
      total = total + 0.5 * program.prox_mu * _squared_distance(params, anchor)
    return total, aux

  grads, (loss, correct, count, new_stats) = jax.grad(objective, has_aux=True)(ts.model.params)
  updates, new_opt = program.tx.update(grads, ts.opt_state, ts.model.params)
  new_ts = TrainState(ModelState(optax.apply_updates(ts.model.params, updates), new_stats), new_opt)
  if may_be_empty:  # a step past the client's data leaves it untouched
    new_ts = _tree_where(count > 0, new_ts, ts)
  return new_ts, jnp.stack([loss * count, correct, count])


def _loop_client_step(program: ClientProgram, ts, acc, client, step, anchor, context=None):
  # The loop runs only a client's own batches, each with a real sample, so it skips the
  # guard against empty steps (a select over the whole state, about 4 % of VGG-9's step).
  ts, st = _client_step(program, ts, client, step, anchor, context, may_be_empty=False)
  return ts, acc + st, step + 1


def _vmap_client_step(program: ClientProgram, ts, client, step, anchor, context):
  """`_client_step` of every client of the group at once (the `vmap` strategy)."""
  one = functools.partial(_client_step, program)
  return jax.vmap(one, in_axes=(0, 0, None, None, 0))(ts, client, step, anchor, context)


def _client_epoch(program: ClientProgram, ts, client, num_steps: int, anchor, context):
  """An epoch of every client of the group, `num_steps` steps scanned (the `scan` strategy)."""

  def epoch(ts, client, context):
    def body(carry, s):
      return _client_step(program, carry, client, s, anchor, context)

    ts, stats = lax.scan(body, ts, jnp.arange(num_steps))
    return ts, stats.sum(0)

  return jax.vmap(epoch)(ts, client, context)


# The compiled programs, pure functions of a static ClientProgram: jit's cache shares them
# between the trainers (and runs) whose programs are equal. `loop` (the CPU strategy) is
# dispatch-bound around each step, so it makes one call per step: the step index and the metric
# sums ride along on the device, and the client's state and sums are donated so that XLA
# updates them in place. Donation is safe because `_take_client` hands out fresh per-client
# buffers: a caller's arrays are never donated.
_loop_step = jax.jit(_loop_client_step, static_argnums=0, donate_argnums=(1, 2))
_vmap_step = jax.jit(_vmap_client_step, static_argnums=0)
_scan_epoch = jax.jit(_client_epoch, static_argnums=(0, 3))


class GroupTrainer:
  """Runs a group's local training with the chosen client-map strategy; its compiled programs
  are module-level pure functions of its `program` (`ClientProgram`), traced once per input
  shape and shared by every trainer with an equal program.
  """

  def __init__(
    self,
    module,
    tx: optax.GradientTransformation,
    batch_size: int,
    prox_mu: float = 0.0,
    strategy: str = 'auto',
    mesh=None,
    objective: LocalObjective = classification_objective,
    loop_threads: Optional[int] = None,
    train_mode_epochs: int = 0,
  ):
    """Args:
    module: the clients' flax module.
    tx: their optimiser.
    batch_size: the local batch size.
    prox_mu: FedProx's proximal weight (0: plain local training).
    strategy: the client map (`STRATEGIES`, or 'auto').
    mesh: a 'clients' mesh to shard the group over, or None.
    objective: the local loss (`LocalObjective`).
    loop_threads: clients trained at once by the `loop` strategy (None: the backend's default).
    train_mode_epochs: 0 (the default): every epoch in train mode. k > 0: the first k epochs of
      each `train` call in train mode, the later ones in eval mode (`eval_mode_objective`:
      running BatchNorm statistics, frozen; no dropout), as DENSE's `LocalUpdate` trains after
      testing the model (`test` calls `model.eval()`) at the end of each epoch. Only with the
      classification objective.
    """
    if train_mode_epochs < 0:
      raise ValueError(f'train_mode_epochs must be >= 0, got {train_mode_epochs}')
    if train_mode_epochs and objective is not classification_objective:
      raise ValueError('train_mode_epochs > 0 needs the classification objective')
    self.train_mode_epochs = int(train_mode_epochs)
    self.strategy = resolve_strategy(strategy)
    self.mesh = mesh
    self.loop_threads = default_loop_threads() if loop_threads is None else int(loop_threads)
    if self.loop_threads < 1:
      raise ValueError(f'loop_threads must be at least 1, got {loop_threads}')
    self.program = ClientProgram(module, objective, tx, batch_size, prox_mu)

  # What the trainer trains with is its program's: one record, no copy to keep in step.
  module = property(lambda self: self.program.module)
  objective = property(lambda self: self.program.objective)
  tx = property(lambda self: self.program.tx)
  batch_size = property(lambda self: self.program.batch_size)
  prox_mu = property(lambda self: self.program.prox_mu)

  # -- strategies ----------------------------------------------------------------------------
  def train(
    self,
    state: TrainState,
    fed,
    epochs: int,
    key: jax.Array,
    anchor: Any = None,
    progress: Optional[Callable[[int, int], None]] = None,
    client_ids=None,
    context: Any = None,
    first_epoch: int = 0,
  ):
    """Trains every client of the group for `epochs` epochs over its own samples.

    Args:
      state: stacked TrainState of the group (leading axis = clients of `fed`).
      fed: FederatedArrays (x [m, n_max, ...], y [m, n_max] or [m, n_max, C], sizes [m]).
      epochs: local epochs.
      key: data-order key; a client's order in epoch e depends only on (key, e, its id). Or
        one key per client ([m] keys, `is_key_per_client`): client k's orders and step keys
        are then those of a group trained with key keys[k], so the clients of several runs
        (seeds) train in one program exactly as in their own runs.
      anchor: FedProx reference parameters (single model), required when prox_mu > 0.
      progress: called as progress(epochs_done, epochs) after each epoch.
      client_ids: global ids of the group's clients (default 0..m-1).
      context: per-client values for the objective, a pytree stacked over the group's clients
        (leading axis m), or None (the objective is then called without `context`).
      first_epoch: the index of the first epoch (its data order and keys): a call that goes on
        from epoch k of another trains as the rest of one call would.
    Returns:
      (new stacked TrainState, TrainMetrics).
    """
    if self.prox_mu and anchor is None:
      raise ValueError('FedProx training (prox_mu > 0) needs the global parameters as anchor.')
    if self.train_mode_epochs and epochs > self.train_mode_epochs:
      return self._train_then_eval_mode(
        state, fed, epochs, key, anchor, progress, client_ids, context, first_epoch
      )
    m, n_max = fed.y.shape[:2]
    num_steps = max(1, math.ceil(int(np.max(fed.sizes)) / self.batch_size))
    if self.strategy == 'scan':
      # The compiled epoch's static length: from the padded length, fixed across rounds, not
      # from the sizes of this round's clients (steps past a client's data leave it untouched).
      num_steps = max(num_steps, math.ceil(n_max / self.batch_size))
    padded_len = max(num_steps * self.batch_size, n_max)
    sizes = jnp.asarray(fed.sizes, jnp.int32)
    ids = jnp.asarray(np.arange(m) if client_ids is None else client_ids, jnp.int32)
    if self.strategy == 'loop':
      # The loop's programs take one client's padded data: padding it to a power of two lets
      # groups and runs whose largest clients differ a little share one compiled step (padded
      # samples are never visited). Orders over the longer padding keep each client's order.
      # Each client's data goes to the device when its turn comes (`_client_arrays`), so the
      # group is never copied whole, nor padded whole.
      n_max = padded_len = loop_padded_length(padded_len)
      x = y = None
    else:
      x, y = jnp.asarray(fed.x), jnp.asarray(fed.y)
    across_processes = multihost.spans_processes(self.mesh)
    owned = range(m)  # the clients this process trains
    per_client_keys = is_key_per_client(key)
    if per_client_keys and len(key) != m:
      raise ValueError(f'{len(key)} per-client keys for a group of {m} clients')
    if self.strategy == 'loop' and across_processes:
      owned = _process_block(m)
    elif self.strategy != 'loop' and self.mesh is not None:
      state, x, y, sizes, ids, context = sharding.shard_group(
        self.mesh, (state, x, y, sizes, ids, context)
      )
      if per_client_keys:  # the padded clients' keys: size 0, they never step
        key = sharding.shard_group(self.mesh, key)
      if across_processes and anchor is not None:
        anchor = sharding.replicate_on_mesh(self.mesh, anchor)
    stats = []
    for epoch in range(first_epoch, first_epoch + epochs):
      if per_client_keys:
        epoch_keys = _epoch_keys_each(key, epoch)
        orders = _orders_each(epoch_keys, ids, sizes, n_max, padded_len)
        keys = _client_keys_each(epoch_keys, ids)
      else:
        epoch_key = jax.random.fold_in(key, epoch)
        orders = _orders(epoch_key, ids, sizes, n_max, padded_len)
        keys = _client_keys(epoch_key, ids)
      if self.strategy == 'loop':
        state, epoch_stats = self._loop_epoch(
          state, fed, n_max, orders, sizes, keys, anchor, context, owned
        )
      elif self.strategy == 'vmap':
        epoch_stats = 0.0
        clients = (x, y, orders, sizes, keys)
        for s in range(num_steps):
          state, st = _vmap_step(self.program, state, clients, s, anchor, context)
          epoch_stats = epoch_stats + st
      else:
        clients = (x, y, orders, sizes, keys)
        state, epoch_stats = _scan_epoch(self.program, state, clients, num_steps, anchor, context)
      stats.append(multihost.to_host(epoch_stats)[:m])
      if progress is not None:
        progress(epoch - first_epoch + 1, epochs)
    stats = np.stack(stats, axis=1) if stats else np.zeros((m, 0, 3))
    if self.strategy == 'loop' and across_processes:
      state, stats = _gather_process_blocks((state, stats), m)
      state = jax.tree.map(jnp.asarray, state)
    elif self.strategy != 'loop' and across_processes:
      state = jax.tree.map(lambda a: jnp.asarray(a[:m]), multihost.to_host(state))
    elif self.strategy != 'loop' and self.mesh is not None:
      state = jax.tree.map(lambda a: a[:m], state)
    count = np.maximum(stats[..., 2], 1.0)
    return state, TrainMetrics(loss=stats[..., 0] / count, accuracy=stats[..., 1] / count)

  def _train_then_eval_mode(
    self, state, fed, epochs, key, anchor, progress, client_ids, context, first_epoch
  ):
    """`train` with `train_mode_epochs` epochs in train mode, then the rest in eval mode (one
    optimiser state throughout, the epochs' data orders those of one call)."""
    k = self.train_mode_epochs
    head, later = copy.copy(self), copy.copy(self)  # the same trainer, in train / eval mode
    head.train_mode_epochs = later.train_mode_epochs = 0
    later.program = self.program.replace(objective=eval_mode_objective)
    common = dict(anchor=anchor, client_ids=client_ids, context=context)
    first = None if progress is None else lambda done, _: progress(done, epochs)
    rest = None if progress is None else lambda done, _: progress(k + done, epochs)
    state, m1 = head.train(state, fed, k, key, progress=first, first_epoch=first_epoch, **common)
    state, m2 = later.train(
      state, fed, epochs - k, key, progress=rest, first_epoch=first_epoch + k, **common
    )
    return state, TrainMetrics(
      loss=np.concatenate([m1.loss, m2.loss], axis=1),
      accuracy=np.concatenate([m1.accuracy, m2.accuracy], axis=1),
    )

  def _loop_epoch(self, state, fed, length, orders, sizes, keys, anchor, context=None, owned=None):
    sizes_np = np.asarray(fed.sizes)
    owned = range(len(sizes_np)) if owned is None else owned

    def train_client(k):
      ts, order, size, ck, acc, step = _loop_take(state, orders, sizes, keys, k)
      if k not in owned:  # another process trains it (see _process_block)
        return ts, acc
      xk, yk = _client_arrays(fed, k, length)
      client = (xk, yk, order, size, ck)
      ctx_k = None if context is None else _loop_take_context(context, k)
      # A client runs only its own batches: the steps past them would leave it untouched.
      for _ in range(math.ceil(int(sizes_np[k]) / self.batch_size)):
        ts, acc, step = _loop_step(self.program, ts, acc, client, step, anchor, ctx_k)
      return ts, acc

    clients = range(len(sizes_np))
    if self.loop_threads > 1 and len(clients) > 1:
      trained = list(_client_pool(self.loop_threads).map(train_client, clients))
    else:
      trained = [train_client(k) for k in clients]
    return _loop_stack([ts for ts, _ in trained], [acc for _, acc in trained])


@functools.lru_cache(maxsize=None)
def _client_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """The `loop` strategy's client threads, one pool per thread count shared by every trainer."""
  return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix='jfed-client')


def _process_block(m: int) -> range:
  """The block of a group's m clients this process trains under `loop`: the clients whose
  shards its devices would hold on the mesh."""
  return sharding.client_block(m, jax.process_index(), jax.process_count())


def _gather_process_blocks(tree: Any, m: int) -> Any:
  """Every process's trained block of `tree` (leading axis m), all-gathered into one tree."""
  per_process = len(sharding.client_block(m, 0, jax.process_count()))
  block = _process_block(m)

  def own_block(a):
    a = np.asarray(a)[block.start : block.stop]
    return np.concatenate([a, np.zeros((per_process - len(a), *a.shape[1:]), a.dtype)])

  gathered = multihost_utils.process_allgather(jax.tree.map(own_block, tree), tiled=True)
  return jax.tree.map(lambda a: np.asarray(a)[:m], gathered)


def loop_padded_length(n: int) -> int:
  """The sample length the `loop` strategy pads a group's data to: the next power of two."""
  return 1 << max(0, int(n) - 1).bit_length()


def client_step_keys(epoch_key: jax.Array, client_ids: jax.Array) -> jax.Array:
  """[clients] keys of an epoch; a step's key is fold_in(this, step) (see the module docstring)."""
  base = jax.random.fold_in(epoch_key, STEP_KEY_TAG)
  return jax.vmap(lambda c: jax.random.fold_in(base, c))(client_ids)


def client_step_keys_each(epoch_keys: jax.Array, client_ids: jax.Array) -> jax.Array:
  """`client_step_keys` with a key per client ([clients] epoch keys)."""
  return jax.vmap(lambda k, c: jax.random.fold_in(jax.random.fold_in(k, STEP_KEY_TAG), c))(
    epoch_keys, client_ids
  )


def epoch_keys_each(keys: jax.Array, epoch: jax.Array) -> jax.Array:
  """fold_in(key, epoch) of every client's key ([clients] keys)."""
  return jax.vmap(lambda k: jax.random.fold_in(k, epoch))(keys)


def is_key_per_client(key: jax.Array) -> bool:
  """Whether `key` is a stack of keys (one per client) rather than one key: a typed key array
  with a leading axis, or a raw uint32 key array of shape [clients, 2]."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2


def _take_client(state, orders, sizes, keys, k):
  """Client k's slices plus zeroed metric sums and step index, in one dispatch."""
  ts = jax.tree.map(lambda a: a[k], state)
  zeros = jnp.zeros(3), jnp.zeros((), jnp.int32)
  return (ts, orders[k], sizes[k], keys[k]) + zeros


def _client_arrays(fed, k: int, length: int):
  """Client k's (x, y) on the device, padded to `length` samples (`FederatedArrays.take`)."""
  client = fed.take([k], length)
  return jnp.asarray(client.x[0]), jnp.asarray(client.y[0])


def _take_context(context, k):
  return jax.tree.map(lambda a: a[k], context)


def _stack_clients(states, stats):
  return jax.tree.map(lambda *a: jnp.stack(a), *states), jnp.stack(stats)


# The small programs around the steps, shared by every trainer like the steps themselves.
_loop_take = jax.jit(_take_client)
_loop_stack = jax.jit(_stack_clients)
_loop_take_context = jax.jit(_take_context)
_orders = jax.jit(client_orders, static_argnums=(3, 4))
_client_keys = jax.jit(client_step_keys)
_epoch_keys_each = jax.jit(epoch_keys_each)
_orders_each = jax.jit(client_orders_each, static_argnums=(3, 4))
_client_keys_each = jax.jit(client_step_keys_each)
