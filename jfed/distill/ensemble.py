"""Teacher ensembles evaluated as one call per architecture group.

A *group* is `TeacherGroup(module, states)`: one flax module and a ModelState stacked over the
group's clients (leading axis K_g). A heterogeneous federation is a list of groups; the client
order of every per-client output is the concatenation of the groups in list order.

Teachers run in eval mode (BN running statistics). Everything here is a pure function of arrays
with the modules static, differentiable w.r.t. the input `x` (generator training backpropagates
through the teachers); call it inside your own `jax.jit` (modules are hashable, so they can also be
static arguments).

Per-group client mapping (`strategy`): 'vmap' maps the stacked parameters with `jax.vmap` (one
batched program; the fast form on GPU/TPU); 'loop' unrolls the K_g applies inside the trace (XLA:CPU
runs client-batched convolutions slowly, docs/design.md); 'auto' = 'loop' on CPU, else 'vmap'.
"""

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from jfed.distill.losses import bn_statistics_loss
from jfed.engine.state import ModelState


class TeacherGroup(NamedTuple):
  module: Any  # flax.linen.Module, __call__(x, train=False) -> logits
  states: ModelState  # stacked over the group's clients


def _as_groups(groups) -> Sequence[TeacherGroup]:
  if isinstance(groups, TeacherGroup) or (
    isinstance(groups, tuple) and len(groups) == 2 and isinstance(groups[1], ModelState)
  ):
    groups = [groups]
  return [TeacherGroup(*g) for g in groups]


def num_teachers(groups) -> int:
  return sum(jax.tree.leaves(g.states.params)[0].shape[0] for g in _as_groups(groups))


def resolve_strategy(strategy: str) -> str:
  if strategy == 'auto':
    return 'loop' if jax.default_backend() == 'cpu' else 'vmap'
  if strategy not in ('vmap', 'loop'):
    raise ValueError(f"strategy must be 'auto', 'vmap' or 'loop', got {strategy!r}")
  return strategy


def _one(module, params, batch_stats, x, with_bn_loss: bool, batch_bn: bool):
  variables = {'params': params, 'batch_stats': batch_stats}
  if batch_bn:
    # BN on the batch's own statistics (a torch module left in train mode); the updated
    # running statistics are dropped, so the teachers do not change.
    logits, _ = module.apply(variables, x, train=True, mutable=['batch_stats'])
    return logits, jnp.zeros((), jnp.float32)
  if not with_bn_loss:
    return module.apply(variables, x, train=False), jnp.zeros((), jnp.float32)
  logits, col = module.apply(variables, x, train=False, mutable=['bn_inputs'])
  return logits, bn_statistics_loss(col.get('bn_inputs', {}), batch_stats)


def group_outputs(
  group: TeacherGroup,
  x: jnp.ndarray,
  with_bn_loss: bool,
  strategy: str,
  batch_bn: bool,
) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """Per-client logits [K_g, B, C] and per-client BN-statistics losses [K_g] (zeros unless
  `with_bn_loss`) of one group on the same input x [B, ...]. `batch_bn`: BatchNorm normalises
  with the batch's statistics instead of the running ones (no BN loss then).

  Args:
    group: TeacherGroup(module, stacked ModelState) of K_g clients of one architecture.
    x: The input batch [B, H, W, C].
    with_bn_loss: Also compute each client's BN-statistics loss.
    strategy: 'vmap', 'loop' or 'auto' (loop on CPU, vmap elsewhere).
    batch_bn: Normalise with the batch's statistics.

  Returns:
    (logits [K_g, B, C], BN losses [K_g]).
  """
  if batch_bn and with_bn_loss:
    raise ValueError('batch_bn teachers have no BN-statistics loss')
  module, states = group
  strategy = resolve_strategy(strategy)
  if strategy == 'vmap':
    fn = lambda p, bs: _one(module, p, bs, x, with_bn_loss, batch_bn)
    return jax.vmap(fn)(states.params, states.batch_stats)
  k = jax.tree.leaves(states.params)[0].shape[0]
  outs = [
    _one(
      module,
      jax.tree.map(lambda a, i=i: a[i], states.params),
      jax.tree.map(lambda a, i=i: a[i], states.batch_stats),
      x,
      with_bn_loss,
      batch_bn,
    )
    for i in range(k)
  ]
  return jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs])


def teacher_outputs(
  groups,
  x: jnp.ndarray,
  with_bn_loss: bool = False,
  strategy: str = 'auto',
  batch_bn: bool = False,
) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """All clients' logits [K, B, C] and BN losses [K] (groups concatenated in order).

  Args:
    groups: A TeacherGroup or a list of them.
    x: The input batch [B, H, W, C].
    with_bn_loss: Also compute each client's BN-statistics loss.
    strategy: 'vmap', 'loop' or 'auto' (loop on CPU, vmap elsewhere).
    batch_bn: Normalise with the batch's statistics.

  Returns:
    (logits [K, B, C], BN losses [K]).
  """
  outs = [group_outputs(g, x, with_bn_loss, strategy, batch_bn) for g in _as_groups(groups)]
  if len(outs) == 1:
    return outs[0]
  return (jnp.concatenate([o[0] for o in outs], 0), jnp.concatenate([o[1] for o in outs], 0))


def combine_logits(
  per_client: jnp.ndarray, weights: Optional[jnp.ndarray] = None, normalize: bool = True
) -> jnp.ndarray:
  """Combine per-client logits [K, B, C] into ensemble logits [B, C].

  weights None      → (1/K) Σ_k f_k                      (DENSE `Ensemble`, FedDF avg_logits)
  weights [K]       → Σ_k w_k f_k / Σ_k w_k              (Co-Boosting WEnsemble; no division if
                                                          normalize=False)
  weights [B, K]    → Σ_k w_bk f_k[b] (/ Σ_k w_bk)       (per-(sample, client), e.g. SA's V, Eq. 10)
  weights [B, K, C] → Σ_k w_bkc f_k[b,c] (/ Σ_k w_bkc)   (per-(sample, client, class): full SA,
                                                          see stratification.stratified_weights)

  Args:
    per_client: Logits [K, B, C].
    weights: None, or weights of one of the shapes above.
    normalize: Divide by the sum of the weights over k.

  Returns:
    The ensemble logits [B, C].
  """
  if weights is None:
    return jnp.mean(per_client, axis=0)
  w = jnp.asarray(weights, per_client.dtype)
  if w.ndim == 1:
    wk = w[:, None, None]
  elif w.ndim == 2:
    wk = jnp.transpose(w)[:, :, None]
  elif w.ndim == 3:
    wk = jnp.transpose(w, (1, 0, 2))
  else:
    raise ValueError(f'weights must have 1-3 dims, got shape {w.shape}')
  out = jnp.sum(wk * per_client, axis=0)
  if normalize:
    out = out / jnp.sum(jnp.broadcast_to(wk, (wk.shape[0],) + out.shape[-2:]), axis=0)
  return out


def ensemble_logits(
  groups,
  x: jnp.ndarray,
  weights: Optional[jnp.ndarray] = None,
  normalize: bool = True,
  return_per_client: bool = False,
  strategy: str = 'auto',
):
  """Teacher-ensemble logits on x: one eval-mode call per architecture group.

  `groups`: a TeacherGroup / (module, stacked ModelState) or a list of them (heterogeneous).
  `weights`: see `combine_logits` (None = unweighted mean, [K] per model, [B, K] or [B, K, C]).
  Returns [B, C], or ([B, C], per-client [K, B, C]) when `return_per_client`.

  Args:
    groups: As above.
    x: The input batch [B, H, W, C].
    weights: As above.
    normalize: Divide by the sum of the weights (see `combine_logits`).
    return_per_client: Also return the per-client logits.
    strategy: 'vmap', 'loop' or 'auto' (loop on CPU, vmap elsewhere).
  """
  per_client, _ = teacher_outputs(groups, x, False, strategy)
  out = combine_logits(per_client, weights, normalize)
  return (out, per_client) if return_per_client else out


def coboosting_weight_update(
  w: jnp.ndarray,
  w_orig: jnp.ndarray,
  grad: jnp.ndarray,
  mu: float,
  wdc: float,
  epoch: int,
) -> jnp.ndarray:
  """Co-Boosting ensemble-weight step (`github.com/rong-dai/Co-Boosting`, `datafree_kd.py`), with
  grad = ∇_w CE(Σ w_k f_k / Σ w_k, y):

      w ← w − mu · wdc^epoch · sign(grad);   w ← clip(w_orig + clip(w − w_orig, −1, 1), 0, 1)

  Args:
    w: Current ensemble weights [K].
    w_orig: The initial weights [K] (the clients' data shares).
    grad: ∇_w of the ensemble CE, shape [K].
    mu: Step size.
    wdc: Per-epoch decay of the step size.
    epoch: Current epoch (exponent of wdc).

  Returns:
    The updated weights [K], in [0, 1].
  """
  w = w - mu * (wdc**epoch) * jnp.sign(grad)
  return jnp.clip(w_orig + jnp.clip(w - w_orig, -1.0, 1.0), 0.0, 1.0)
