"""FedHydra Model Stratification (MS, Algorithm 2) and Stratified Aggregation (SA, Algorithm 3).

FedHydra (Bai et al., KDD 2025) §3.2 / §3.3.1. Orientation: like the paper, U, U_r and U_c are c × m
matrices (row j = class j, column k = client k); the raw capabilities u_{k,j} are also returned
client-major
as `u` [m, c] (so `U = u.T`, Eq. 3).

    (1)  ℓ^t_{k,j} = CE(F_k(G(z; θ_G^t)), y^j),  t = 1..T_G
                                                (fresh G per (k, j); loss before step t)
    (2)  u_{k,j}   = (max L_{k,j} − min L_{k,j}) / min L_{k,j}
    (3)  U         = ([u_{k,j}]_{m×c})ᵀ                          (c × m)
    (4,5) U_r[j,k] = u_{k,j} / Σ_{k'} u_{k',j}      (each row of U sums to 1 over clients)
    (6,7) U_c[j,k] = u_{k,j} / Σ_{j'} u_{k,j'}      (each column of U sums to 1 over classes)
    (8)  P̂_k = P_k ⊙ (1_{b×1} · U_c(:,k)ᵀ)           i.e. P̂_k[i,j] = P_k[i,j] · U_c[j,k]
    (9)  Pⁱ = [P̂_1(i,:); …; P̂_m(i,:)]              (m × c)
    (10) V(i,:) = U_r(y(i), :)                       (b × m)
    (11) P(i,:) = V(i,:) · Pⁱ  ⇒  P[i,j] = Σ_k U_r[y_i, k] · U_c[j, k] · P_k[i, j]

MS runs the m·c generator trainings as ONE jitted program per architecture group: the (k, j)
runs are flattened into an N = m_g·c axis, `jax.vmap` maps over it (each run has its own generator
parameters, noise and label; client parameters are gathered by k), and `lax.scan` runs the T_G
steps. With more than one device the N axis is sharded over a `Mesh(devices, ('clients',))` with
`NamedSharding(mesh, P('clients'))` (padded to a multiple of the device count).
`layout='clients'` nests the vmap instead (clients, then classes sharing their client's
weights), for accelerators where grouped convolutions over m·c kernels are slow.
`model_stratification_loop` runs the same jitted single-run function one (k, j) at a time.
"""

import functools
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from jfed.distill.ensemble import _as_groups
from jfed.distill.generator import DenseGenerator, dense_generator_init
from jfed.distill.losses import cross_entropy
from jfed.engine.progress import PhaseProgress
from jfed.engine.state import commit

# ---------------------------------------------------------------------------------------------
# U, U_r, U_c
# ---------------------------------------------------------------------------------------------


def variation_degree(losses: jnp.ndarray, min_clip: float = 1e-12) -> jnp.ndarray:
  """Eq. 2 over the last axis (the T_G recorded losses): u = (max L − min L) / min L.
  min L is clipped to `min_clip` so that a loss that reaches exactly 0 gives a large finite u."""
  losses = jnp.asarray(losses)
  lo, hi = jnp.min(losses, -1), jnp.max(losses, -1)
  return (hi - lo) / jnp.maximum(lo, min_clip)


def _safe_normalise(a: jnp.ndarray, axis: int) -> jnp.ndarray:
  s = jnp.sum(a, axis=axis, keepdims=True)
  return jnp.where(s > 0, a / jnp.where(s > 0, s, 1.0), 1.0 / a.shape[axis])


def normalise_U(U: jnp.ndarray) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """Eqs. 4–7 on the paper's U (c × m, U[j, k] = u_{k,j}):

      U_r[j, k] = u_{k,j} / Σ_{k'=1..m} u_{k',j}     (Eqs. 4, 5: rows sum to 1 over clients)
      U_c[j, k] = u_{k,j} / Σ_{j'=1..c} u_{k,j'}     (Eqs. 6, 7: columns sum to 1 over classes)

  A row (column) that sums to 0 — no client (class) gave any guidance — becomes uniform.
  Returns (U_r, U_c), both c × m.
  """
  U = jnp.asarray(U, jnp.float32)
  return _safe_normalise(U, axis=1), _safe_normalise(U, axis=0)


class StratificationResult(NamedTuple):
  losses: Any  # [m, c, T_G] ℓ^t_{k,j}
  u: Any  # [m, c] u_{k,j} (Eq. 2), client-major
  U: Any  # [c, m] Eq. 3
  U_r: Any  # [c, m] Eq. 5
  U_c: Any  # [c, m] Eq. 7


def stratification_from_losses(losses) -> StratificationResult:
  losses = jnp.asarray(losses)
  u = variation_degree(losses)
  U = u.T
  U_r, U_c = normalise_U(U)
  return StratificationResult(losses, u, U, U_r, U_c)


# ---------------------------------------------------------------------------------------------
# SA
# ---------------------------------------------------------------------------------------------


def stratified_weights(
  U_r: jnp.ndarray, U_c: jnp.ndarray, labels: jnp.ndarray, in_model: bool = True
) -> jnp.ndarray:
  """Per-(sample, client, class) weights W[i, k, j] = U_r[y_i, k] · U_c[j, k]  ([B, K, C]);
  `in_model=False` drops the U_c factor (W[i, k, j] = U_r[y_i, k], inter-model weighting only).
  `ensemble.combine_logits(per_client, W, normalize=False)` then equals `stratified_aggregation`.

  Args:
    U_r: Inter-model weights [c, K] (Eq. 5).
    U_c: In-model weights [c, K] (Eq. 7).
    labels: Each sample's (target) label y_i, shape [B].
    in_model: Include the U_c factor.

  Returns:
    W [B, K, C].
  """
  V = U_r[labels]  # [B, K]      Eq. 10
  if not in_model:
    return jnp.broadcast_to(V[:, :, None], V.shape + (U_c.shape[0],))
  return V[:, :, None] * jnp.transpose(U_c)[None]  # [B, K, C]


def stratified_aggregation(
  per_client_logits: jnp.ndarray,
  U_r: jnp.ndarray,
  U_c: jnp.ndarray,
  labels: jnp.ndarray,
  in_model: bool = True,
) -> jnp.ndarray:
  """SA logits (Algorithm 3, Eqs. 8–11), vectorised over samples and clients:

      P[i, j] = Σ_k U_r[y_i, k] · U_c[j, k] · P_k[i, j]

  per_client_logits: [K, B, C] (P_k = F_k(x)); U_r, U_c: [c, K]; labels y [B]: the generator's
  target labels during synthesis, or stored / predicted labels (e.g. argmax of the average
  ensemble) when no target label exists. `in_model=False` skips Eq. 8 (U_c) for ablations.

  Args:
    per_client_logits: P_k = F_k(x), shape [K, B, C].
    U_r: Inter-model weights [c, K] (Eq. 5).
    U_c: In-model weights [c, K] (Eq. 7).
    labels: y [B], as above.
    in_model: Apply Eq. 8 (U_c).

  Returns:
    The aggregated logits P [B, C].
  """
  V = U_r[labels]  # [B, K]   Eq. 10
  if in_model:
    hat = per_client_logits * jnp.transpose(U_c)[:, None, :]  # [K, B, C] Eq. 8
  else:
    hat = per_client_logits
  return jnp.einsum('bk,kbc->bc', V, hat)  # Eq. 11


def average_ensemble(per_client_logits: jnp.ndarray) -> jnp.ndarray:
  """AE (DENSE's ensemble, the Fig. 7 ablation baseline): (1/K) Σ_k P_k."""
  return jnp.mean(per_client_logits, axis=0)


# ---------------------------------------------------------------------------------------------
# MS
# ---------------------------------------------------------------------------------------------


class MSConfig(NamedTuple):
  """Static settings of one MS generator run (Algorithm 2, lines 6–14)."""

  T_G: int = 30  # generator iterations (paper: T_G = 30)
  lr: float = 1e-3  # η_G (paper: Adam, 0.001)
  b1: float = 0.5  # Adam betas of DENSE / FL-SA generators
  b2: float = 0.999
  batch_size: int = 256  # b (not stated in the paper; DENSE synthesis batch 256)
  # 'bfloat16': G and F_k compute in bf16 (mixed precision), G's parameters, BatchNorm
  # statistics, Adam state and the losses stay float32 (MS_COMPUTE_DTYPES).
  compute_dtype: str = 'float32'


# The compute dtypes MS offers: the paper's float32, and bfloat16 for accelerators whose matrix
# units run bf16 at several times their float32 rate
# (experiments/bench/model_stratification.py compares each with the device's dense peak).
MS_COMPUTE_DTYPES = ('float32', 'bfloat16')


def _cast_floats(tree, dtype):
  """`tree` with its floating-point leaves cast to `dtype` (integer leaves kept)."""
  return jax.tree.map(
    lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
  )


def _ms_config(cfg: Optional[MSConfig]) -> MSConfig:
  """`cfg`, or MSConfig's defaults for None; a compute dtype MS does not offer is refused."""
  cfg = cfg or MSConfig()
  if cfg.compute_dtype not in MS_COMPUTE_DTYPES:
    raise ValueError(f'MS compute_dtype {cfg.compute_dtype!r}; valid: {MS_COMPUTE_DTYPES}')
  return cfg


def _ms_run_init(generator: DenseGenerator, cfg: MSConfig, key: jax.Array):
  """A (k, j) run's fresh G, z and Adam state. Algorithm 2 updates θ_G only (z fixed, as in
  FL-SA's code) and feeds G(z) to F_k unaugmented (FL-SA's `interview` feeds aug(G(z)))."""
  # one random draw for G and z (compile time, see dense_generator_init)
  g, z = dense_generator_init(key, generator, noise_batch=cfg.batch_size)
  tx = optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2)
  return (g.params, g.batch_stats, tx.init(g.params)), z


def _ms_step(
  teacher_module, generator: DenseGenerator, cfg: MSConfig, carry, z, teacher_vars, label
):
  """One Adam step of G on CE(F_k(G(z)), label); returns (carry, the loss before the step)."""
  gen_params, gen_bs, opt_state = carry
  y = jnp.full((cfg.batch_size,), label, jnp.int32)
  tx = optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2)
  compute = jnp.dtype(cfg.compute_dtype)

  def loss_fn(gen_params, gen_bs):
    # The casts are differentiable: G's float32 parameters get float32 gradients.
    x, upd = generator.apply(
      {'params': _cast_floats(gen_params, compute), 'batch_stats': gen_bs},
      z.astype(compute),
      train=True,
      mutable=['batch_stats'],
    )
    logits = teacher_module.apply(_cast_floats(teacher_vars, compute), x, train=False)
    return cross_entropy(logits.astype(jnp.float32), y), _cast_floats(
      upd['batch_stats'], jnp.float32
    )

  (loss, gen_bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(gen_params, gen_bs)
  updates, opt_state = tx.update(grads, opt_state, gen_params)
  return (optax.apply_updates(gen_params, updates), gen_bs, opt_state), loss


def _ms_single_run(
  teacher_module,
  generator: DenseGenerator,
  cfg: MSConfig,
  t_params,
  t_batch_stats,
  key: jax.Array,
  label: jnp.ndarray,
) -> jnp.ndarray:
  """One (k, j) run: fresh G, z; T_G Adam steps on CE(F_k(G(z)), j); returns the T_G losses
  (each evaluated before its step, Eq. 1)."""
  carry, z = _ms_run_init(generator, cfg, key)
  teacher_vars = {'params': t_params, 'batch_stats': t_batch_stats}
  step = lambda c, _: _ms_step(teacher_module, generator, cfg, c, z, teacher_vars, label)
  _, losses = jax.lax.scan(step, carry, None, length=cfg.T_G)
  return losses


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _ms_single_run_jit(teacher_module, generator, cfg, t_params, t_bs, key, label):
  return _ms_single_run(teacher_module, generator, cfg, t_params, t_bs, key, label)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _ms_batched(teacher_module, generator, cfg, chunk_size, t_states, keys, labels, clients):
  def run(args):
    key, label, k = args
    p = jax.tree.map(lambda a: a[k], t_states.params)
    bs = jax.tree.map(lambda a: a[k], t_states.batch_stats)
    return _ms_single_run(teacher_module, generator, cfg, p, bs, key, label)

  if chunk_size:
    return jax.lax.map(run, (keys, labels, clients), batch_size=chunk_size)
  return jax.vmap(run)((keys, labels, clients))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _ms_batched_by_client(teacher_module, generator, cfg, clients_per_chunk, t_states, keys):
  """keys [m, c]: a vmap over clients of a vmap over classes. Within a client the teacher's
  weights are shared, so its convolutions see the c runs' images as one batch; only across
  clients do they differ (grouped convolutions of m groups, not m·c)."""
  labels = jnp.arange(keys.shape[1], dtype=jnp.int32)

  def client(args):
    key_row, params, batch_stats = args
    single = lambda key, label: _ms_single_run(
      teacher_module, generator, cfg, params, batch_stats, key, label
    )
    return jax.vmap(single)(key_row, labels)

  xs = (keys, t_states.params, t_states.batch_stats)
  if clients_per_chunk:
    return jax.lax.map(client, xs, batch_size=clients_per_chunk)
  return jax.vmap(client)(xs)


def ms_step_flops(teacher_module, teacher_vars, generator: DenseGenerator, cfg: MSConfig) -> float:
  """Floating-point operations of one MS generator step of one (client, class) run, as XLA's
  cost analysis counts the compiled step (G and F_k forward, their backward to G's parameters,
  Adam): benchmarks divide it by a step's time for the throughput a form achieves.

  Args:
    teacher_module: The client model's flax module.
    teacher_vars: One client's variables ({'params': ..., 'batch_stats': ...}).
    generator: The generator MS trains.
    cfg: The MS settings (batch size, T_G, ...).

  Returns:
    The step's FLOPs.
  """
  carry, z = _ms_run_init(generator, cfg, jax.random.PRNGKey(0))
  step = jax.jit(lambda carry: _ms_step(teacher_module, generator, cfg, carry, z, teacher_vars, 0))
  cost = step.lower(carry).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, (list, tuple)) else cost)['flops'])


MS_LAYOUTS = ('runs', 'clients')


def _groups_with_offsets(teacher_groups) -> List[Tuple[Any, Any, int, int]]:
  """(module, stacked states, m, offset) per architecture group, offset the index of the group's
  first client over all groups: the batched and the run-by-run forms draw a run's key from it."""
  out, offset = [], 0
  for module, states in _as_groups(teacher_groups):
    m = jax.tree.leaves(states.params)[0].shape[0]
    out.append((module, states, m, offset))
    offset += m
  return out


def _run_keys(key: jax.Array, client_offset: int, m: int, c: int) -> jnp.ndarray:
  """Per-(k, j) keys fold_in(key, (offset + k)·c + j): identical in the batched and loop forms."""
  ids = (client_offset + np.arange(m))[:, None] * c + np.arange(c)[None, :]
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(ids.reshape(-1), jnp.uint32))


def model_stratification(
  teacher_groups,
  generator: DenseGenerator,
  num_classes: int,
  key: jax.Array,
  cfg: Optional[MSConfig] = None,
  *,
  chunk_size: Optional[int] = None,
  devices: Optional[Sequence[Any]] = None,
  layout: str = 'runs',
) -> StratificationResult:
  """Algorithm 2 for all clients: m·c fresh-generator runs of T_G steps, batched.

  teacher_groups: TeacherGroup(module, stacked ModelState) or a list of them (heterogeneous; one
  batched program per group, clients ordered by concatenation). generator: the DenseGenerator to
  train, each run from a fresh `dense_generator_init`. Settings come from `cfg` (MSConfig).
  `chunk_size` bounds memory: `lax.map` over chunks of that many vmapped runs. `devices`
  (default all devices of the default backend) shards the run axis when more than one.
  `layout`: 'runs' vmaps over the flat m·c axis (each run gathers its client's weights);
  'clients' vmaps over clients, then over classes with the client's weights shared
  (`_ms_batched_by_client`; chunks and shards are whole clients, chunk_size // c of them). Both
  give the same numbers; which is faster is what experiments/bench/model_stratification.py's
  `batched_clients` form measures.
  Returns StratificationResult(losses [m,c,T_G], u [m,c], U, U_r, U_c [c,m]).

  Args:
    teacher_groups: TeacherGroup(s), as above.
    generator: The generator each run trains from a fresh init.
    num_classes: c.
    key: PRNG key of all m·c runs.
    cfg: MS settings; None takes MSConfig's defaults.
    chunk_size: Runs vmapped at once; None runs all at once.
    devices: Devices to shard the run axis over; None takes the default backend's.
    layout: 'runs' or 'clients', as above.

  Returns:
    StratificationResult(losses [m, c, T_G], u [m, c], U, U_r, U_c [c, m]).
  """
  if layout not in MS_LAYOUTS:
    raise ValueError(f'layout {layout!r}; valid: {MS_LAYOUTS}')
  cfg = _ms_config(cfg)
  devices = list(devices) if devices is not None else jax.devices()
  groups = _groups_with_offsets(teacher_groups)
  # One program per group (accelerators): progress between groups.
  phase = PhaseProgress(
    f'model stratification: {len(groups)} batched program(s) of T_G={cfg.T_G}',
    len(groups),
    'program',
    every_s=0.0,
  )
  all_losses = []
  for module, states, m, offset in groups:
    keys = _run_keys(key, offset, m, num_classes)
    layout_losses = _by_client_losses if layout == 'clients' else _flat_losses
    all_losses.append(
      layout_losses(module, generator, cfg, chunk_size, devices, states, keys, m, num_classes)
    )
    phase.update(len(all_losses))
  return stratification_from_losses(np.concatenate(all_losses, 0))


def _padded_index(n: int, num_devices: int) -> jnp.ndarray:
  """0..n-1, then n-1 repeated up to a multiple of num_devices (rows to shard evenly)."""
  return jnp.concatenate([jnp.arange(n), jnp.full(((-n) % num_devices,), n - 1)])


def _first_axis_sharding(devices) -> NamedSharding:
  return NamedSharding(Mesh(np.asarray(devices), ('clients',)), P('clients'))


def _flat_losses(module, generator, cfg, chunk_size, devices, states, keys, m, c):
  """The 'runs' layout of one group of m clients: the m·c runs on one axis; losses [m, c, T_G]."""
  n = m * c
  labels = jnp.tile(jnp.arange(c, dtype=jnp.int32), m)
  clients = jnp.repeat(jnp.arange(m, dtype=jnp.int32), c)
  if len(devices) > 1:
    sel = _padded_index(n, len(devices))
    shard = _first_axis_sharding(devices)
    keys, labels, clients = jax.device_put((keys[sel], labels[sel], clients[sel]), shard)
    states = jax.device_put(states, NamedSharding(shard.mesh, P()))
  losses = _ms_batched(module, generator, cfg, chunk_size, states, keys, labels, clients)
  return np.asarray(losses)[:n].reshape(m, c, cfg.T_G)


def _by_client_losses(module, generator, cfg, chunk_size, devices, states, keys, m, c):
  """The 'clients' layout of one group of m clients: whole clients per chunk and shard; losses
  [m, c, T_G]."""
  keys = keys.reshape((m, c) + keys.shape[1:])
  per_chunk = max(1, chunk_size // c) if chunk_size else None
  if len(devices) > 1:
    sel = _padded_index(m, len(devices))
    keys, states = keys[sel], jax.tree.map(lambda a: a[sel], states)
    keys, states = jax.device_put((keys, states), _first_axis_sharding(devices))
  losses = _ms_batched_by_client(module, generator, cfg, per_chunk, states, keys)
  return np.asarray(losses)[:m]


def _run_by_run(
  teacher_groups, num_classes: int, key: jax.Array, T_G: int, run: Callable
) -> StratificationResult:
  """Algorithm 2 one (k, j) run at a time: `run(module, teacher_vars, run_key, j, tick)` returns
  the run's T_G losses (`tick(t, loss)` after its step t, for progress); keys as in the batched
  form."""
  groups = _groups_with_offsets(teacher_groups)
  runs = sum(m for _, _, m, _ in groups) * num_classes
  phase = PhaseProgress(
    f'model stratification: {runs} generator runs of T_G={T_G}', runs * T_G, 'generator step'
  )
  all_losses, done = [], 0
  for module, states, m, offset in groups:
    keys = _run_keys(key, offset, m, num_classes).reshape(m, num_classes, -1)
    out = np.zeros((m, num_classes, T_G), np.float32)
    for k in range(m):
      teacher_vars = {
        'params': jax.tree.map(lambda a: a[k], states.params),
        'batch_stats': jax.tree.map(lambda a: a[k], states.batch_stats),
      }
      for j in range(num_classes):

        def tick(t: int, loss: jax.Array, base: int = done) -> None:
          if phase.due():  # the count of steps computed, not only dispatched
            jax.block_until_ready(loss)
            phase.update(base + t)

        out[k, j] = np.asarray(run(module, teacher_vars, keys[k, j], jnp.int32(j), tick))
        done += T_G
        phase.update(done)
    all_losses.append(out)
  return stratification_from_losses(np.concatenate(all_losses, 0))


def model_stratification_loop(
  teacher_groups,
  generator: DenseGenerator,
  num_classes: int,
  key: jax.Array,
  cfg: Optional[MSConfig] = None,
) -> StratificationResult:
  """Same as `model_stratification`, one (k, j) run at a time: a Python loop over the same
  jitted single-run program (the reference code's structure; for equivalence tests and
  benchmarks).

  Args:
    teacher_groups: As `model_stratification`.
    generator: As `model_stratification`.
    num_classes: c.
    key: PRNG key of all m·c runs.
    cfg: MS settings; None takes MSConfig's defaults.

  Returns:
    The same StratificationResult as `model_stratification`.
  """
  cfg = _ms_config(cfg)

  def run(module, teacher_vars, run_key, label, tick):
    del tick  # one program per run: progress between runs
    return _ms_single_run_jit(
      module,
      generator,
      cfg,
      teacher_vars['params'],
      teacher_vars['batch_stats'],
      run_key,
      label,
    )

  return _run_by_run(teacher_groups, num_classes, key, cfg.T_G, run)


# XLA:CPU runs convolutions inside `lax.scan` pathologically slowly (~1 s per step of the 28x28
# DENSE generator vs ~25 ms as separate jitted steps, docs/design.md), so on CPU the T_G steps
# of each run are a Python loop of one jitted step: the same run (keys, init, z, Adam, loss
# recorded before each step) as the scan forms; tests assert equality.
_ms_run_init_jit = jax.jit(_ms_run_init, static_argnums=(0, 1))
_ms_step_jit = jax.jit(_ms_step, static_argnums=(0, 1, 2))


def model_stratification_python(
  teacher_groups,
  generator: DenseGenerator,
  num_classes: int,
  key: jax.Array,
  cfg: Optional[MSConfig] = None,
) -> StratificationResult:
  """Same as `model_stratification`, run by run, each run a Python loop of T_G jitted steps
  (the fastest form on CPU: experiments/bench/model_stratification.py).

  Args:
    teacher_groups: As `model_stratification`.
    generator: As `model_stratification`.
    num_classes: c.
    key: PRNG key of all m·c runs.
    cfg: MS settings; None takes MSConfig's defaults.

  Returns:
    The same StratificationResult as `model_stratification`.
  """
  cfg = _ms_config(cfg)

  def run(module, teacher_vars, run_key, label, tick):
    carry, z = commit(_ms_run_init_jit(generator, cfg, run_key))
    losses = []
    for t in range(cfg.T_G):
      carry, loss = _ms_step_jit(module, generator, cfg, carry, z, teacher_vars, label)
      losses.append(loss)
      tick(t + 1, loss)
    return jnp.stack(losses)

  return _run_by_run(teacher_groups, num_classes, key, cfg.T_G, run)


# ---------------------------------------------------------------------------------------------
# which form
# ---------------------------------------------------------------------------------------------
MS_IMPLS = ('auto', 'batched', 'loop', 'python')
MS_FUNCTIONS = {
  'batched': model_stratification,
  'loop': model_stratification_loop,
  'python': model_stratification_python,
}


def resolve_ms_impl(impl: str, backend: Optional[str] = None) -> str:
  """'auto': 'python' on CPU (measured ~35x faster there than the lax.scan-based forms:
  experiments/bench/model_stratification.py), 'batched' (one program) elsewhere."""
  if impl not in MS_IMPLS:
    raise ValueError(f'ms_impl must be one of {MS_IMPLS}, got {impl!r}')
  if impl != 'auto':
    return impl
  return 'python' if (backend or jax.default_backend()) == 'cpu' else 'batched'
