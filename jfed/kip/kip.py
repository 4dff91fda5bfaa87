"""Kernel Inducing Points (KIP; Nguyen, Chen, Lee, ICLR'21) as pure, jitted JAX programs.

Follows the authors' notebook, `github.com/google-research/google-research` (`kip/KIP.ipynb`):

* labels are centred one-hot, `onehot - 1/C`;
* `K_ss_reg = K_ss + reg · tr(K_ss)/n_s · I` (reg = 1e-6), `pred = K_ts · solve(K_ss_reg,
  y_s)` (Cholesky, i.e. `assume_a='pos'`), `loss = 0.5 · mean((pred - y_t)²)` over n_t·C
  entries;
* support labels are wrapped in `stop_gradient` unless `learn_labels`;
* Adam on the support set (optax.adam ≡ `jax.example_libraries.optimizers.adam`), a fresh target
  minibatch from the client's real data every step, the support set initialised class-balanced from
  real images.

HFLDD settings (Shi et al., arXiv 2409.17517, §VI-A4) are the defaults of `KIPConfig`: 400 distilled
images per client, 3000 iterations, lr 0.004 (the notebook uses 0.04), target minibatch 10, reg
1e-6.

Three entry points with the same numbers (per-client randomness is `fold_in(key, client_index)`):

* `kip_distill` – one client, one jitted program (`lax.scan` over the iterations);
* `kip_distill_batched` – all clients in ONE jitted program: `vmap` over the padded client
  axis, sharded over a `Mesh(devices, ('clients',))` when more than one device is visible;
* `kip_distill_loop` – the single-client program in a Python loop (reference / benchmark).

Padded data (`FederatedArrays` layout): sample `i` of a client is real iff `i < size`. Only
real samples are ever used for the support initialisation, the target batches and the
standardisation statistics.

Small clients. The support size is the same for every client (so that the heads of HFLDD receive
equally shaped uploads). When `support_size > size` every real sample is used once and the
remaining slots cycle through the (class-balanced) order again, i.e. the init samples *with
replacement*; the repeated copies get Gaussian jitter of std `dup_jitter` (in the standardised
space) because identical support points receive identical gradients and would never separate,
leaving `K_ss` singular up to the regulariser. When `target_batch > size` the target batch
likewise repeats real samples (harmless for the loss). Single-class clients work unchanged (their
support set is single-class). A client with `size == 0` (e.g. client-axis padding) runs on a zero
image and returns garbage that callers must drop; it never produces NaN in the other clients.
Note that with `support_size >= size` every target sample is (up to jitter) a support point, so
the KRR loss is ≈ 0 from the start and KIP barely changes the images (HFLDD's MNIST setting has
~400 samples per client and 400 distilled images).

Sweeps. `lr`, `reg` and `dup_jitter` change no shape: the jitted programs take them as values
(`KIPScalars`) and are keyed on the rest of the config (`split_scalars`), so a sweep over any
of them (a regulariser study, a learning-rate search) compiles one program for all its values.

Precision: float32 by default (fast on GPU; all kernel matmuls use `Precision.HIGHEST`); the
notebook runs in float64 — `KIPConfig(x64=True)` does the same inside a `jax.enable_x64`
scope. `reg` keeps the Cholesky factorisation well defined; in float32 a very ill-conditioned
`K_ss` (e.g. hundreds of near-identical support images) may still need a larger `reg`.
"""

import contextlib
import functools
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from jfed.engine import multihost, sharding
from jfed.engine.progress import PhaseProgress, info_enabled, reporting_to, tick_in_program
from jfed.kip.kernels import KernelFn, make_kernel_fn

Array = jax.Array


class KIPConfig(NamedTuple):
  """KIP hyper-parameters (hashable: used as a static jit argument).

  Attributes:
    support_size: distilled images per client (HFLDD: 400; KIP notebook: 100).
    iterations: Adam steps (HFLDD: 3000).
    lr: Adam learning rate (HFLDD paper 0.004; KIP notebook 0.04).
    target_batch: real samples per step in the KRR target (HFLDD: 10; notebook: 5000).
    learn_labels: optimise the support labels too (notebook LEARN_LABELS, default False).
    kernel: 'fc_ntk' (notebook default), 'fc_nngp' or 'rbf'.
    depth: hidden Dense + ReLU blocks of the FC kernel (notebook DEPTH=1).
    W_std: FC kernel weight standard deviation (√2 as in the notebook).
    b_std: FC kernel bias standard deviation (0.1 as in the notebook).
    rbf_gamma: RBF width; None means 1 / d.
    reg: relative ridge, `reg · tr(K_ss) / n_s` (1e-6).
    standardize: distil in the per-channel standardised space of the client's own real data
      (the notebook standardises with train statistics); outputs are mapped back to the input
      space ([0, 1] images in jfed).
    dup_jitter: std of the jitter added to repeated support copies (see the module docstring).
    x64: run the distillation in float64 (a `jax.enable_x64` scope; the notebook sets
      `jax_enable_x64=True`). Results are returned as float32.
  """

  support_size: int = 400
  iterations: int = 3000
  lr: float = 0.004
  target_batch: int = 10
  learn_labels: bool = False
  kernel: str = 'fc_ntk'
  depth: int = 1
  W_std: float = 2**0.5
  b_std: float = 0.1
  rbf_gamma: Optional[float] = None
  reg: float = 1e-6
  standardize: bool = True
  dup_jitter: float = 1e-2
  x64: bool = False


class KIPScalars(NamedTuple):
  """The settings of `KIPConfig` that a jitted program takes as values (float32, or float64
  under `x64`), not as part of its static key."""

  lr: Any
  reg: Any
  dup_jitter: Any


def split_scalars(config: KIPConfig) -> Tuple[KIPConfig, KIPScalars]:
  """(the static key of `config`'s programs: its scalar settings zeroed, those settings)."""
  dtype = np.float64 if config.x64 else np.float32
  scalars = KIPScalars(*(np.asarray(getattr(config, f), dtype) for f in KIPScalars._fields))
  return config._replace(**dict.fromkeys(KIPScalars._fields, 0.0)), scalars


class KIPResult(NamedTuple):
  """Distilled set(s). Batched results carry a leading client axis on every field."""

  x: Any  # [S, *image_shape] float32, in the input space (de-standardised)
  y: Any  # [S] int32 hard labels = argmax of y_matrix
  y_matrix: Any  # [S, C] float32 label matrix (centred one-hot, learned if learn_labels)
  loss: Any  # [iterations] float32 KRR loss on each step's target batch (before the step)
  acc: Any  # [iterations] float32 KRR accuracy on each step's target batch


# ------------------------------------------------------------------------------------------------
# kernel ridge regression loss
# ------------------------------------------------------------------------------------------------


def centered_one_hot(labels: Array, num_classes: int, dtype=jnp.float32) -> Array:
  """KIP's label encoding `onehot - 1/C`.

  Args:
    labels: Integer labels [n].
    num_classes: C.
    dtype: dtype of the result.

  Returns:
    [n, C] targets: 1 − 1/C at the label, −1/C elsewhere.
  """
  return jax.nn.one_hot(labels, num_classes, dtype=dtype) - 1.0 / num_classes


def kernel_fn_from_config(config: KIPConfig) -> KernelFn:
  """The kernel `k(x1, x2)` named by `config.kernel`, with the config's kernel settings."""
  return make_kernel_fn(
    config.kernel,
    depth=config.depth,
    W_std=config.W_std,
    b_std=config.b_std,
    gamma=config.rbf_gamma,
  )


def krr_predict(
  x_support: Array, y_support: Array, x_target: Array, kernel_fn: KernelFn, reg: float = 1e-6
) -> Array:
  """The KRR prediction `K_ts (K_ss + reg · tr(K_ss) / n_s · I)⁻¹ y_s` (Cholesky).

  Args:
    x_support: [n_s, ...] support inputs.
    y_support: [n_s, C] support label matrix.
    x_target: [n_t, ...] inputs to predict.
    kernel_fn: `k(x1, x2) -> [n1, n2]`.
    reg: the relative ridge.

  Returns:
    [n_t, C] predictions.
  """
  k_ss = kernel_fn(x_support, x_support)
  k_ts = kernel_fn(x_target, x_support)
  n_s = k_ss.shape[0]
  k_ss_reg = k_ss + jnp.abs(reg) * jnp.trace(k_ss) / n_s * jnp.eye(n_s, dtype=k_ss.dtype)
  chol = jax.scipy.linalg.cho_factor(k_ss_reg, lower=True)
  alpha = jax.scipy.linalg.cho_solve(chol, y_support)
  return jnp.matmul(k_ts, alpha, precision=jax.lax.Precision.HIGHEST)


def krr_loss(
  x_support: Array,
  y_support: Array,
  x_target: Array,
  y_target: Array,
  kernel_fn: KernelFn,
  reg: float = 1e-6,
  learn_labels: bool = False,
) -> Tuple[Array, Array]:
  """The KIP loss and the KRR accuracy on a target batch.

  Args:
    x_support: [n_s, ...] support inputs.
    y_support: [n_s, C] support label matrix (centred one-hot for KIP).
    x_target: [n_t, ...] target inputs.
    y_target: [n_t, C] target label matrix.
    kernel_fn: `k(x1, x2) -> [n1, n2]`.
    reg: the relative ridge.
    learn_labels: let gradients reach `y_support`; otherwise it is wrapped in `stop_gradient`
      (notebook behaviour; the value is the same either way).

  Returns:
    (`0.5 · mean((pred - y_t)²)`, `mean(argmax pred == argmax y_t)`).
  """
  if not learn_labels:
    y_support = jax.lax.stop_gradient(y_support)
  pred = krr_predict(x_support, y_support, x_target, kernel_fn, reg)
  loss = 0.5 * jnp.mean((pred - y_target) ** 2)
  acc = jnp.mean(jnp.argmax(pred, -1) == jnp.argmax(y_target, -1))
  return loss, acc


# ------------------------------------------------------------------------------------------------
# sampling that only touches a client's real samples
# ------------------------------------------------------------------------------------------------


def _cycle(order: Array, count: int, n_real: Array) -> Array:
  """`order[i mod n_real]` for i < count (`order` lists the real samples first)."""
  return order[jnp.arange(count) % jnp.maximum(n_real, 1)]


def init_support(key: Array, y: Array, size: Array, support_size: int, num_classes: int) -> Array:
  """A class-balanced selection of real samples for the initial support set.

  Round robin over the classes present: first one random sample of every present class (in
  random class order), then a second one of every class that has two, and so on, so that
  classes with few samples are exhausted and the others fill the remaining slots. With
  `support_size > size` the same order is cycled (sampling with replacement).

  Args:
    key: randomness of the selection.
    y: [n_max] int labels, zero padded.
    size: number of real samples (sample i is real iff i < size).
    support_size: number of indices.
    num_classes: C.

  Returns:
    int [support_size] indices of real samples.
  """
  n = y.shape[0]
  k_rank, k_round = jax.random.split(key)
  real = jnp.arange(n) < size
  yc = jnp.where(real, y, num_classes).astype(jnp.int32)  # pads -> extra class C
  u = jax.random.uniform(k_rank, (n,))
  # sort by (class, random) -> rank of each sample inside its class
  order = jnp.lexsort((u, yc))
  counts = jnp.zeros(num_classes + 1, jnp.int32).at[yc].add(1)
  starts = jnp.cumsum(counts) - counts
  rank_sorted = jnp.arange(n) - starts[yc[order]]
  rank = jnp.zeros(n, jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
  # round robin: sort by rank, random class order inside a round; pads last
  class_perm = jax.random.uniform(k_round, (num_classes + 1,))
  score = rank.astype(jnp.float32) + class_perm[yc]
  score = jnp.where(real, score, jnp.inf)
  balanced = jnp.argsort(score)
  return _cycle(balanced, support_size, size)


def sample_target_indices(key: Array, size: Array, n_max: int, batch: int) -> Array:
  """A uniform sample of real samples: the target batch of one KIP step.

  Args:
    key: randomness of the sample.
    size: number of real samples (sample i is real iff i < size).
    n_max: padded number of samples.
    batch: number of indices.

  Returns:
    int [batch] indices, without replacement when `batch <= size` (otherwise every real
    sample, cycled).
  """
  u = jax.random.uniform(key, (n_max,))
  u = jnp.where(jnp.arange(n_max) < size, u, -1.0)
  if batch <= n_max:
    _, top = jax.lax.top_k(u, batch)
  else:
    top = jnp.argsort(-u)
  return _cycle(top, batch, size)


# ------------------------------------------------------------------------------------------------
# one client
# ------------------------------------------------------------------------------------------------


def _channel_stats(x: Array, size: Array) -> Tuple[Array, Array]:
  """Per-channel mean/std over the real samples (last axis = channels)."""
  n = x.shape[0]
  w = (jnp.arange(n) < size).astype(x.dtype)
  w = w.reshape((n,) + (1,) * (x.ndim - 1))
  axes = tuple(range(x.ndim - 1))
  cnt = jnp.maximum(jnp.sum(w) * np.prod(x.shape[1:-1]), 1.0)
  mean = jnp.sum(x * w, axis=axes) / cnt
  var = jnp.sum(((x - mean) ** 2) * w, axis=axes) / cnt
  return mean, jnp.sqrt(var) + 1e-6


def _distill_one(
  x: Array,
  y: Array,
  size: Array,
  key: Array,
  scalars: KIPScalars,
  *,
  config: KIPConfig,
  num_classes: int,
  progress: bool,
) -> KIPResult:
  """Traceable single-client KIP (x: [n_max, ...] padded, y: [n_max] int, size: scalar).
  `config` is the static part (`split_scalars`): lr, reg and dup_jitter come from `scalars`.
  `progress`: each iteration reports to the active `jfed.engine.progress` phase."""
  dtype = jnp.float64 if config.x64 else jnp.float32
  x = x.astype(dtype)
  size = jnp.asarray(size, jnp.int32)
  n_max = x.shape[0]
  kernel_fn = kernel_fn_from_config(config)

  if config.standardize:
    mean, std = _channel_stats(x, size)
  else:
    mean = jnp.zeros(x.shape[-1], dtype)
    std = jnp.ones(x.shape[-1], dtype)
  xs = (x - mean) / std
  y_all = centered_one_hot(y, num_classes, dtype)

  k_init, k_jit, k_steps = jax.random.split(key, 3)
  S = config.support_size
  idx = init_support(k_init, y, size, S, num_classes)
  x_sup = xs[idx]
  repeated = (jnp.arange(S) >= size).reshape((S,) + (1,) * (x.ndim - 1))
  noise = scalars.dup_jitter * jax.random.normal(k_jit, x_sup.shape, dtype)
  x_sup = jnp.where(repeated, x_sup + noise, x_sup)
  params = (x_sup, y_all[idx])

  tx = optax.adam(scalars.lr)
  opt_state = tx.init(params)

  def loss_fn(p, xt, yt):
    return krr_loss(p[0], p[1], xt, yt, kernel_fn, scalars.reg, config.learn_labels)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(carry, k):
    p, s = carry
    if progress:
      k, iteration = k
    t_idx = sample_target_indices(k, size, n_max, config.target_batch)
    (loss, acc), g = grad_fn(p, xs[t_idx], y_all[t_idx])
    if not config.learn_labels:
      g = (g[0], jnp.zeros_like(g[1]))
    upd, s = tx.update(g, s, p)
    p = optax.apply_updates(p, upd)
    if progress:
      tick_in_program(iteration + 1)
    return (p, s), (loss, acc)

  keys = jax.random.split(k_steps, config.iterations)
  xs_steps = (keys, jnp.arange(config.iterations)) if progress else keys
  (params, _), (losses, accs) = jax.lax.scan(step, (params, opt_state), xs_steps)
  x_out = params[0] * std + mean
  y_mat = params[1]
  return KIPResult(
    x=x_out.astype(jnp.float32),
    y=jnp.argmax(y_mat, -1).astype(jnp.int32),
    y_matrix=y_mat.astype(jnp.float32),
    loss=losses.astype(jnp.float32),
    acc=accs.astype(jnp.float32),
  )


@functools.partial(jax.jit, static_argnames=('config', 'num_classes'))
def _distill_one_jit(x, y, size, key, scalars, config, num_classes):
  # one client's solve reports nothing: its program then has no host callback, which JAX's
  # persistent compilation cache would not store
  return _distill_one(
    x, y, size, key, scalars, config=config, num_classes=num_classes, progress=False
  )


def _x64_scope(config: KIPConfig):
  return jax.enable_x64(True) if config.x64 else contextlib.nullcontext()


def kip_distill(
  x_client,
  y_client,
  size,
  config: KIPConfig,
  key: Array,
  num_classes: int,
  client_index: Optional[int] = None,
) -> KIPResult:
  """KIP for ONE client: one jitted program, `lax.scan` over `config.iterations`.

  Args:
    x_client: [n, *image_shape] images, possibly zero padded.
    y_client: [n] int labels.
    size: number of real samples (None: n), or a boolean [n] mask of the `FederatedArrays`
      form (real samples first).
    config: the hyper-parameters.
    key: the randomness (support init, jitter, target batches).
    num_classes: C.
    client_index: if given, the key is `fold_in(key, client_index)` (what
      `kip_distill_batched` uses for client `client_index`).

  Returns:
    The distilled set.
  """
  x_client = np.asarray(x_client) if not isinstance(x_client, jax.Array) else x_client
  n = x_client.shape[0]
  if size is None:
    size = n
  elif np.ndim(size) == 1:
    mask = np.asarray(size, bool)
    size = int(mask.sum())
    if not mask[:size].all():
      raise ValueError('mask must mark a prefix of the samples as real (FederatedArrays layout)')
  else:
    size = int(size)
  if client_index is not None:
    key = jax.random.fold_in(key, client_index)
  static, scalars = split_scalars(config)
  with _x64_scope(config):
    res = _distill_one_jit(
      jnp.asarray(x_client),
      jnp.asarray(y_client, jnp.int32),
      jnp.asarray(size, jnp.int32),
      key,
      scalars,
      static,
      int(num_classes),
    )
  return res


def kip_distill_loop(
  fed_x, fed_y, sizes, config: KIPConfig, key: Array, num_classes: int
) -> List[KIPResult]:
  """The single-client program in a Python loop over clients (reference, benchmark).

  Same arguments as `kip_distill_batched` (without `mesh`); returns one result per client.

  Args:
    fed_x: [m, n_max, *image_shape] images, zero padded.
    fed_y: [m, n_max] int labels.
    sizes: [m] numbers of real samples.
    config: The hyper-parameters.
    key: The randomness of all clients (client i uses `fold_in(key, i)`).
    num_classes: C.

  Returns:
    One KIPResult per client.
  """
  return [
    kip_distill(fed_x[i], fed_y[i], int(sizes[i]), config, key, num_classes, client_index=i)
    for i in range(len(sizes))
  ]


def _batched_body(fx, fy, sizes, idx, key, scalars, config, num_classes, progress=False):
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)
  fn = functools.partial(_distill_one, config=config, num_classes=num_classes, progress=progress)
  return jax.vmap(fn, in_axes=(0, 0, 0, 0, None))(fx, fy, sizes, keys, scalars)


@functools.lru_cache(maxsize=None)
def _batched_program(
  config: KIPConfig, num_classes: int, mesh: Optional[Mesh], progress: bool = False
):
  """The all-clients program of a static config (`split_scalars`), called with
  (fed_x, fed_y, sizes, indices, key, scalars)."""
  body = functools.partial(_batched_body, config=config, num_classes=num_classes, progress=progress)
  if mesh is None:
    return jax.jit(body)
  shard = NamedSharding(mesh, P('clients'))
  rep = NamedSharding(mesh, P())
  return jax.jit(
    body,
    in_shardings=(shard, shard, shard, shard, rep, rep),
    out_shardings=shard,
  )


def client_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Optional[Mesh]:
  """`Mesh(devices, ('clients',))` over all visible devices, or None for a single device."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) <= 1:
    return None
  return Mesh(np.array(devices), ('clients',))


def kip_distill_batched(
  fed_x,
  fed_y,
  sizes,
  config: KIPConfig,
  key: Array,
  num_classes: int,
  mesh: Union[Mesh, None, str] = 'auto',
  indices: Optional[Sequence[int]] = None,
) -> KIPResult:
  """KIP for ALL clients in one jitted program (vmap over the client axis).

  Client i uses `fold_in(key, i)`, so the result equals `kip_distill_loop`'s up to
  floating-point reassociation.

  Args:
    fed_x: [m, n_max, *image_shape] images, zero padded (the `FederatedArrays` layout).
    fed_y: [m, n_max] int labels.
    sizes: [m] numbers of real samples.
    config: the hyper-parameters.
    key: the randomness of all clients.
    num_classes: C.
    mesh: 'auto': `client_mesh()` (sharding only with more than one device); None: no
      sharding; or a Mesh with a 'clients' axis. With a mesh the client axis is padded to a
      multiple of the device count with empty clients (dropped from the result) and placed
      with `NamedSharding(mesh, P('clients'))`.
    indices: the index i of each client in `fold_in(key, i)` (default 0..m-1): a subset of a
      larger batch (a Flower SuperNode's share) then distils exactly as within it.

  Returns:
    The distilled sets, every field with a leading client axis m.
  """
  fed_x = np.asarray(fed_x)
  fed_y = np.asarray(fed_y)
  sizes = np.asarray(sizes, np.int32)
  m = fed_x.shape[0]
  if mesh == 'auto':
    mesh = client_mesh()
  idx = np.arange(m, dtype=np.int32) if indices is None else np.asarray(indices, np.int32)
  if mesh is not None:
    n_dev = mesh.devices.size
    pad = (-m) % n_dev
    if pad:
      fed_x = np.concatenate([fed_x, np.zeros((pad,) + fed_x.shape[1:], fed_x.dtype)])
      fed_y = np.concatenate([fed_y, np.zeros((pad,) + fed_y.shape[1:], fed_y.dtype)])
      sizes = np.concatenate([sizes, np.zeros(pad, np.int32)])
      idx = np.concatenate([idx, np.zeros(pad, np.int32)])  # padded clients are dropped
  # Iteration progress only where INFO lines show (a program with a host callback is not
  # written to JAX's persistent compilation cache).
  report = info_enabled()
  static, scalars = split_scalars(config)
  prog = _batched_program(static, int(num_classes), mesh, report)
  phase = (
    PhaseProgress(f'KIP solve of {m} clients', config.iterations, unit='iteration')
    if report
    else None
  )
  with _x64_scope(config), reporting_to(phase):
    args = (jnp.asarray(fed_x), jnp.asarray(fed_y, jnp.int32), jnp.asarray(sizes), jnp.asarray(idx))
    if mesh is not None:
      args = sharding.place(mesh, args, P('clients'))
      key, scalars = sharding.place(mesh, (key, scalars), P())
    res = prog(*args, key, scalars)
    if phase is not None:
      jax.block_until_ready(res)  # the phase's callbacks arrive while it runs
  if multihost.spans_processes(mesh):  # every process continues with all clients' sets
    res = jax.tree_util.tree_map(jnp.asarray, multihost.to_host(res))
  if res.x.shape[0] != m:
    res = jax.tree_util.tree_map(lambda a: a[:m], res)
  return res
