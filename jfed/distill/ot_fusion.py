"""Optimal-transport model fusion (Singh & Jaggi, NeurIPS'20), weight mode —
`github.com/sidak/otfusion` (`wasserstein_ensemble.py:get_wassersteinized_layers_modularized`),
extended from 2 models to m (each aligned to an anchor, then averaged).

For every model i ≠ anchor r, layer by layer in forward order (rows = output neurons;
Dense kernel [in, out] → rows [out, in]; Conv kernel [kh, kw, in, out] → rows [out, in, kh·kw]):

  1. input side: W̃_i = W_i · T_{l−1}  (applied to the `in` axis at every kernel position; for a
     Dense layer after a flattened NHWC conv map, `in` = S·C_prev with the channel fastest, so the
     kernel is viewed as [out, S, C_prev] and aligned over C_prev)
  2. ground metric M[a, b] = ||row_a(W̃_i) − row_b(W_r)||₂ (plain Euclidean, otfusion's
     `--not-squared`; `squared=True` for ||·||²); with `bias_in_cost` the bias is an extra column
  3. uniform marginals μ = 1/n_i, ν = 1/n_r; T = OT plan:
       'exact'    equal widths → `scipy.optimize.linear_sum_assignment` (the exact OT plan of two
                  uniform measures of equal size is a permutation / n, Birkhoff); unequal widths →
                  the transport LP solved exactly with `scipy.optimize.linprog` (HiGHS) — otfusion
                  uses POT's `ot.emd`, which solves the same LP;
       'sinkhorn' entropic OT with ott-jax (`Geometry(cost, epsilon)` + `Sinkhorn`), absolute ε
                  (POT's `reg`, otfusion default 1e-2); a very small ε approaches the exact plan.
  4. correction: T_c = T · diag(1/ν) (every column sums to 1; otfusion's `--correction`, which for
     equal widths is T × n), W_i^aligned = T_cᵀ W̃_i, b_i^aligned = T_cᵀ b_i;
     T_c is carried to the next layer's input side.
  5. fused = Σ_i w_i W_i^aligned / Σ_i w_i (uniform w by default; 2 models: otfusion's
     ensemble_step 0.5), for every parameter and BN statistic.

Limits (documented, not hidden):
  * sequential CNN/MLP only: `layers` lists, in order, the layers whose outputs feed the next
    listed layer; residual connections, concatenations, grouped/depthwise convs are not handled.
  * pooling / activations between layers are fine (they act per channel); a Dense layer must see
    either C_prev features (global pooling) or an NHWC flatten of a C_prev-channel map.
  * BatchNorm: the BN that follows a layer (`FusionLayer(name, bn=...)`) has its scale, bias,
    running mean and running var transported with the layer's outputs (T_cᵀ v: an exact
    permutation for 'exact' with equal widths; a convex combination otherwise — for running
    variances this ignores the between-neuron spread). BN parameters are not part of the
    ground metric.
  * last layer: its outputs are the classes, so by default (`skip_last_layer=True`, otfusion's
    `--skip-last-layer`) only its input side is aligned and the output side is not transported;
    `skip_last_layer=False` computes T for it like any other layer (otfusion's default).
  * parameters outside the listed layers / BNs are averaged without alignment.
"""

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jfed.engine.state import ModelState


class FusionLayer(NamedTuple):
  name: str  # '/'-separated path of the layer (holds 'kernel', optional 'bias')
  bn: Optional[str] = None  # '/'-separated path of the BatchNorm normalising its outputs


# ---------------------------------------------------------------------------------------------
# transport plans
# ---------------------------------------------------------------------------------------------


def ground_metric(x: np.ndarray, y: np.ndarray, squared: bool) -> np.ndarray:
  """M[a, b] = ||x_a − y_b||₂ (or its square).

  Args:
    x: Points [n, d] (rows of one model's layer).
    y: Points [m, d] (rows of the anchor's layer).
    squared: Return squared distances.

  Returns:
    M [n, m], float64.
  """
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  d2 = np.sum(x * x, 1)[:, None] + np.sum(y * y, 1)[None, :] - 2.0 * x @ y.T
  d2 = np.maximum(d2, 0.0)
  return d2 if squared else np.sqrt(d2)


def transport_plan(
  cost: np.ndarray,
  method: str,
  epsilon: float,
  threshold: float = 1e-6,
  max_iterations: int = 10000,
) -> np.ndarray:
  """OT plan T [n, m] between the uniform marginals a = 1/n and b = 1/m for `cost` (otfusion's
  uniform neuron weights).

  Args:
    cost: Ground metric [n, m].
    method: 'exact' or 'sinkhorn' (see the module docstring).
    epsilon: Entropic regularisation of 'sinkhorn' (absolute).
    threshold: Convergence tolerance of 'sinkhorn'.
    max_iterations: Iteration cap of 'sinkhorn'.

  Returns:
    T [n, m], float64.
  """
  cost = np.asarray(cost, np.float64)
  n, m = cost.shape
  a, b = np.full(n, 1.0 / n), np.full(m, 1.0 / m)
  if method == 'exact':
    # Imported here: SciPy's optimiser costs 0.9 s of start-up to every command that never fuses.
    import scipy.optimize  # pylint: disable=g-import-not-at-top

    if n == m:
      rows, cols = scipy.optimize.linear_sum_assignment(cost)
      T = np.zeros((n, m))
      T[rows, cols] = 1.0 / n
      return T
    # transport LP: min <C, T> s.t. T 1 = a, Tᵀ 1 = b, T ≥ 0
    a_eq = np.zeros((n + m, n * m))
    for i in range(n):
      a_eq[i, i * m : (i + 1) * m] = 1.0
    for j in range(m):
      a_eq[n + j, j::m] = 1.0
    res = scipy.optimize.linprog(
      cost.reshape(-1), A_eq=a_eq, b_eq=np.concatenate([a, b]), bounds=(0, None), method='highs'
    )
    if not res.success:
      raise RuntimeError(f'exact OT failed: {res.message}')
    return res.x.reshape(n, m)
  if method == 'sinkhorn':
    from ott.geometry import geometry
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn

    geom = geometry.Geometry(cost_matrix=jnp.asarray(cost, jnp.float32), epsilon=epsilon)
    prob = linear_problem.LinearProblem(
      geom, a=jnp.asarray(a, jnp.float32), b=jnp.asarray(b, jnp.float32)
    )
    out = sinkhorn.Sinkhorn(threshold=threshold, max_iterations=max_iterations)(prob)
    return np.asarray(out.matrix, np.float64)
  raise ValueError(f"method must be 'exact' or 'sinkhorn', got {method!r}")


# ---------------------------------------------------------------------------------------------
# fusion
# ---------------------------------------------------------------------------------------------


def _flat(tree) -> dict:
  return {
    '/'.join(k): np.asarray(v)
    for k, v in flax.traverse_util.flatten_dict(flax.core.unfreeze(tree)).items()
  }


def _unflat(flat: dict) -> Any:
  return flax.traverse_util.unflatten_dict(
    {tuple(k.split('/')): jnp.asarray(v) for k, v in flat.items()}
  )


def _to_rows(kernel: np.ndarray) -> np.ndarray:
  if kernel.ndim == 2:  # Dense [in, out]
    return kernel.T[:, :, None]
  if kernel.ndim == 4:  # Conv [kh, kw, in, out]
    kh, kw, cin, cout = kernel.shape
    return kernel.transpose(3, 2, 0, 1).reshape(cout, cin, kh * kw)
  raise ValueError(f'unsupported kernel rank {kernel.ndim}')


def _from_rows(rows: np.ndarray, like: np.ndarray) -> np.ndarray:
  if like.ndim == 2:
    return rows[:, :, 0].T
  kh, kw = like.shape[:2]
  return rows.reshape(rows.shape[0], rows.shape[1], kh, kw).transpose(2, 3, 1, 0)


def _align_inputs(rows: np.ndarray, T_prev: np.ndarray) -> np.ndarray:
  """rows [out, in, S] · T_prev [n_prev_i, n_prev_r] over the `in` axis."""
  out, cin, s = rows.shape
  n_i, n_r = T_prev.shape
  if cin == n_i:
    return np.einsum('oas,ab->obs', rows, T_prev)
  if s == 1 and cin % n_i == 0:  # Dense after an NHWC flatten (channel fastest)
    q = cin // n_i
    r = np.einsum('oqa,ab->oqb', rows[:, :, 0].reshape(out, q, n_i), T_prev)
    return r.reshape(out, q * n_r, 1)
  raise ValueError(f'cannot align {cin} inputs with a {T_prev.shape} transport map')


def _normalise_layers(layers) -> Sequence[FusionLayer]:
  return [
    l if isinstance(l, FusionLayer) else FusionLayer(*l) if isinstance(l, tuple) else FusionLayer(l)
    for l in layers
  ]


def _bn_keys(flat: dict, bn_path: Optional[str]):
  if bn_path is None:
    return []
  return [k for k in flat if k == bn_path or k.startswith(bn_path + '/')]


def align_to_anchor(
  params: Any,
  anchor_params: Any,
  layers,
  batch_stats: Any = None,
  method: str = 'exact',
  epsilon: float = 1e-2,
  skip_last_layer: bool = True,
  squared: bool = False,
  bias_in_cost: bool = True,
  return_plans: bool = False,
):
  """Align one model to the anchor (steps 1–4). Returns (params, batch_stats[, plans]).

  Args:
    params: The model's parameters.
    anchor_params: The anchor model's parameters (same architecture, possibly other widths).
    layers: The aligned layers in forward order: path strings or FusionLayer(name, bn).
    batch_stats: The model's BN statistics, transported with their layers; None if none.
    method: 'exact' or 'sinkhorn'.
    epsilon: Entropic regularisation of 'sinkhorn'.
    skip_last_layer: Leave the last layer's output side (the classes) unaligned.
    squared: Squared Euclidean ground metric.
    bias_in_cost: Append the bias to each row in the ground metric.
    return_plans: Also return the corrected plan T_c of every layer.
  """
  layers = _normalise_layers(layers)
  p_i, p_r = _flat(params), _flat(anchor_params)
  bs_i = _flat(batch_stats) if batch_stats is not None else {}
  T_prev, plans = None, []
  for li, layer in enumerate(layers):
    kname, bname = layer.name + '/kernel', layer.name + '/bias'
    kern_i, kern_r = p_i[kname].astype(np.float64), p_r[kname].astype(np.float64)
    rows_i, rows_r = _to_rows(kern_i), _to_rows(kern_r)
    aligned = rows_i if T_prev is None else _align_inputs(rows_i, T_prev)
    has_bias = bname in p_i
    n_i, n_r = aligned.shape[0], rows_r.shape[0]
    if li == len(layers) - 1 and skip_last_layer:
      if n_i != n_r:
        raise ValueError(f'last layer {layer.name}: output widths differ ({n_i} vs {n_r})')
      Tc = np.eye(n_i)
    else:
      fi, fr = aligned.reshape(n_i, -1), rows_r.reshape(n_r, -1)
      if has_bias and bias_in_cost:
        fi = np.concatenate([fi, p_i[bname].astype(np.float64)[:, None]], 1)
        fr = np.concatenate([fr, p_r[bname].astype(np.float64)[:, None]], 1)
      T = transport_plan(ground_metric(fi, fr, squared), method, epsilon)
      Tc = T / np.maximum(T.sum(0, keepdims=True), 1e-300)  # columns sum to 1
    plans.append(Tc)
    new_rows = np.einsum('ab,a...->b...', Tc, aligned)
    p_i[kname] = _from_rows(new_rows, kern_r).astype(p_i[kname].dtype)
    if has_bias:
      p_i[bname] = (Tc.T @ p_i[bname].astype(np.float64)).astype(p_i[bname].dtype)
    for flat in (p_i, bs_i):
      for k in _bn_keys(flat, layer.bn):
        v = flat[k]
        if v.shape[0] != n_i:
          raise ValueError(f'BN leaf {k} has {v.shape[0]} channels, layer has {n_i}')
        flat[k] = np.tensordot(Tc.T, v.astype(np.float64), axes=1).astype(v.dtype)
    T_prev = Tc
  out = (_unflat(p_i), _unflat(bs_i) if batch_stats is not None else None)
  return out + (plans,) if return_plans else out


def ot_fuse(
  params_list: Sequence[Any],
  layers,
  *,
  batch_stats_list: Optional[Sequence[Any]] = None,
  anchor: int = 0,
  weights: Optional[Sequence[float]] = None,
  method: str = 'exact',
  epsilon: float = 1e-2,
  skip_last_layer: bool = True,
  squared: bool = False,
  bias_in_cost: bool = True,
) -> Tuple[Any, Any]:
  """Fuse m models of one architecture: align every model to `params_list[anchor]` and take the
  (weighted) average. `layers`: the fused layers in forward order, each a path string or a
  FusionLayer(name, bn). Returns (fused params, fused batch_stats or None); the fused model has the
  anchor's widths.

  Args:
    params_list: The m models' parameters.
    layers: As above.
    batch_stats_list: The m models' BN statistics; None when the models have none.
    anchor: Index of the model the others are aligned to.
    weights: Per-model averaging weights (normalised here); None is uniform.
    method: 'exact' or 'sinkhorn'.
    epsilon: Entropic regularisation of 'sinkhorn'.
    skip_last_layer: Leave the last layer's output side (the classes) unaligned.
    squared: Squared Euclidean ground metric.
    bias_in_cost: Append the bias to each row in the ground metric.

  Returns:
    (fused params, fused batch_stats or None).
  """
  m = len(params_list)
  w = np.full(m, 1.0 / m) if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
  aligned_p, aligned_bs = [], []
  for i in range(m):
    bs = batch_stats_list[i] if batch_stats_list is not None else None
    if i == anchor:
      aligned_p.append(params_list[i])
      aligned_bs.append(bs)
      continue
    p, b = align_to_anchor(
      params_list[i],
      params_list[anchor],
      layers,
      bs,
      method,
      epsilon,
      skip_last_layer,
      squared,
      bias_in_cost,
    )
    aligned_p.append(p)
    aligned_bs.append(b)

  def avg(trees):
    return jax.tree.map(
      lambda *xs: sum(float(wi) * jnp.asarray(x, jnp.float32) for wi, x in zip(w, xs)).astype(
        jnp.asarray(xs[0]).dtype
      ),
      *trees,
    )

  fused_p = avg(aligned_p)
  fused_bs = avg(aligned_bs) if batch_stats_list is not None else None
  return fused_p, fused_bs


def ot_fuse_states(states: ModelState, layers, **kw) -> ModelState:
  """`ot_fuse` on a stacked ModelState (leading client axis); returns one ModelState."""
  m = jax.tree.leaves(states.params)[0].shape[0]
  take = lambda t, i: jax.tree.map(lambda a: a[i], t)
  params = [take(states.params, i) for i in range(m)]
  has_bs = bool(jax.tree.leaves(states.batch_stats))
  bss = [take(states.batch_stats, i) for i in range(m)] if has_bs else None
  p, bs = ot_fuse(params, layers, batch_stats_list=bss, **kw)
  return ModelState(p, bs if has_bs else {})
