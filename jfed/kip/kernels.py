"""Closed-form infinite-width kernels in pure JAX (no neural-tangents).

neural-tangents 0.6.5 (`github.com/google/neural-tangents`) cannot be imported with JAX 0.10, so
the kernel
KIP needs is written out here.

Fully-connected ReLU network (what `neural_tangents.stax` computes with `get='ntk'` /
`get='nngp'` for the KIP notebook's `ARCHITECTURE='FC'`):

    Flatten -> [Dense(W_std, b_std, parameterization='ntk') -> Relu] x depth -> Dense(W_std, b_std)

with the NTK parameterisation `z = W_std / sqrt(n_in) * W x + b_std * b`, `W, b ~ N(0, 1)`.

Recursion (all quantities are n1 x n2 matrices; the diagonals `Σ(x, x)` are carried along
separately for the normalisation):

    input:    Σ⁰(x, x') = <x, x'> / d          (d = number of flattened features)
              Θ⁰(x, x') = 0
    Dense:    Σ  <- W_std² · Σ + b_std²
              Θ  <- Σ(new) + W_std² · Θ
    ReLU:     c  = Σ(x, x') / sqrt(Σ(x, x) Σ(x', x')),   θ = arccos(c)
              Σ  <- sqrt(Σ(x, x) Σ(x', x')) · J1(c)
              Θ  <- Θ · J0(c)
              J1(c) = (sqrt(1 - c²) + (π - θ) c) / (2π)     (= E[relu(u) relu(v)], unit variances)
              J0(c) = (π - θ) / (2π)                        (= E[relu'(u) relu'(v)])
              on the diagonal (c = 1): Σ(x, x) <- Σ(x, x) / 2
    output:   one more Dense; NNGP = Σ, NTK = Θ of the readout.

So `depth` counts the hidden Dense+ReLU blocks (KIP notebook DEPTH=1 ⇒ two Dense layers).

Numerics: `c` is clipped to [-1, 1] for the value; `J0` and `J1` have custom JVPs
(`J1' = J0` holds exactly, and `J0'(c) = 1 / (2π sqrt(1 - c²))` is evaluated with
`1 - c²` floored at the dtype's machine epsilon), so gradients stay finite on the diagonal
(c ≡ 1) and for duplicated points, where plain autodiff of `arccos`/`sqrt` would give
`inf · 0 = NaN`. All matmuls use `Precision.HIGHEST` (TF32 would otherwise be used on
NVIDIA GPUs in float32).

`rbf_kernel`: `k(x, x') = exp(-gamma · ||x - x'||²)` on flattened inputs (KIP paper's RBF
option; not in the KIP notebook).
"""

import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array
KernelFn = Callable[[Array, Array], Array]

_HIGHEST = jax.lax.Precision.HIGHEST
_TWO_PI = 2.0 * math.pi
KERNELS = ('fc_ntk', 'fc_nngp', 'rbf')


def _flatten(x: Array) -> Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    # integer pixels (uint8 images) would overflow x·x and truncate W_std, b_std to integers
    x = x.astype(jnp.result_type(float))
  return x.reshape(x.shape[0], -1)


@jax.custom_jvp
def _j0(c: Array) -> Array:
  """(π - arccos c) / (2π): E[relu'(u) relu'(v)] for unit-variance u, v with correlation c."""
  c = jnp.clip(c, -1.0, 1.0)
  return (jnp.pi - jnp.arccos(c)) / _TWO_PI


@_j0.defjvp
def _j0_jvp(primals, tangents):
  (c,), (dc,) = primals, tangents
  one_minus = jnp.maximum(1.0 - jnp.clip(c, -1.0, 1.0) ** 2, jnp.finfo(jnp.result_type(c)).eps)
  return _j0(c), dc / (_TWO_PI * jnp.sqrt(one_minus))


@jax.custom_jvp
def _j1(c: Array) -> Array:
  """(sqrt(1 - c²) + (π - arccos c) c) / (2π): E[relu(u) relu(v)] for unit-variance u, v."""
  c = jnp.clip(c, -1.0, 1.0)
  return (jnp.sqrt(jnp.maximum(1.0 - c * c, 0.0)) + (jnp.pi - jnp.arccos(c)) * c) / _TWO_PI


@_j1.defjvp
def _j1_jvp(primals, tangents):
  (c,), (dc,) = primals, tangents
  return _j1(c), _j0(c) * dc


def _safe_sqrt(x: Array) -> Array:
  # value sqrt(max(x, 0)); derivative with a floored denominator (the products of diagonals
  # are >= b_std² > 0 for b_std > 0, the floor only matters for b_std = 0 and zero inputs).
  return jnp.sqrt(jnp.maximum(x, jnp.finfo(jnp.result_type(x)).tiny))


def fc_kernels(
  x1: Array, x2: Optional[Array] = None, depth: int = 1, W_std: float = 2**0.5, b_std: float = 0.1
) -> Tuple[Array, Array]:
  """NNGP and NTK of `Flatten -> [Dense -> ReLU] x depth -> Dense` (NTK parameterisation).

  See the module docstring for the recursion.

  Args:
    x1: [n1, ...] inputs (flattened).
    x2: [n2, ...] inputs; None means `x1`.
    depth: hidden Dense + ReLU blocks.
    W_std: weight standard deviation of every Dense layer.
    b_std: bias standard deviation of every Dense layer.

  Returns:
    (NNGP, NTK), each [n1, n2].
  """
  x1 = _flatten(x1)
  x2 = x1 if x2 is None else _flatten(x2)
  d = x1.shape[-1]
  w2 = jnp.asarray(W_std, x1.dtype) ** 2
  b2 = jnp.asarray(b_std, x1.dtype) ** 2

  nngp = jnp.matmul(x1, x2.T, precision=_HIGHEST) / d
  diag1 = jnp.sum(x1 * x1, axis=-1) / d
  diag2 = jnp.sum(x2 * x2, axis=-1) / d
  ntk = jnp.zeros_like(nngp)

  for _ in range(int(depth)):
    # Dense
    nngp = w2 * nngp + b2
    diag1 = w2 * diag1 + b2
    diag2 = w2 * diag2 + b2
    ntk = nngp + w2 * ntk
    # ReLU
    norm = _safe_sqrt(diag1[:, None] * diag2[None, :])
    c = nngp / norm
    ntk = ntk * _j0(c)
    nngp = norm * _j1(c)
    diag1 = diag1 / 2.0
    diag2 = diag2 / 2.0

  # readout Dense
  nngp = w2 * nngp + b2
  ntk = nngp + w2 * ntk
  return nngp, ntk


def fc_ntk_kernel(
  x1: Array, x2: Optional[Array] = None, depth: int = 1, W_std: float = 2**0.5, b_std: float = 0.1
) -> Array:
  """The infinite-width NTK Θ(x1, x2) [n1, n2] of the FC ReLU network (`fc_kernels`).

  Args:
    x1: [n1, ...] inputs (flattened).
    x2: [n2, ...] inputs; None means `x1`.
    depth: Hidden Dense + ReLU blocks.
    W_std: Weight standard deviation of every Dense layer.
    b_std: Bias standard deviation of every Dense layer.

  Returns:
    Θ [n1, n2].
  """
  return fc_kernels(x1, x2, depth=depth, W_std=W_std, b_std=b_std)[1]


def fc_nngp_kernel(
  x1: Array, x2: Optional[Array] = None, depth: int = 1, W_std: float = 2**0.5, b_std: float = 0.1
) -> Array:
  """The infinite-width NNGP kernel Σ(x1, x2) [n1, n2] of the FC ReLU network (`fc_kernels`).

  Args:
    x1: [n1, ...] inputs (flattened).
    x2: [n2, ...] inputs; None means `x1`.
    depth: Hidden Dense + ReLU blocks.
    W_std: Weight standard deviation of every Dense layer.
    b_std: Bias standard deviation of every Dense layer.

  Returns:
    Σ [n1, n2].
  """
  return fc_kernels(x1, x2, depth=depth, W_std=W_std, b_std=b_std)[0]


def rbf_kernel(x1: Array, x2: Optional[Array] = None, gamma: Optional[float] = None) -> Array:
  """The RBF kernel `exp(-gamma ||x1_i - x2_j||²)` [n1, n2] on flattened inputs.

  Args:
    x1: [n1, ...] inputs.
    x2: [n2, ...] inputs; None means `x1`.
    gamma: the width; None means 1 / d (d = flattened features).

  Returns:
    K [n1, n2].
  """
  x1 = _flatten(x1)
  x2 = x1 if x2 is None else _flatten(x2)
  if gamma is None:
    gamma = 1.0 / x1.shape[-1]
  sq = (
    jnp.sum(x1 * x1, -1)[:, None]
    + jnp.sum(x2 * x2, -1)[None, :]
    - 2.0 * jnp.matmul(x1, x2.T, precision=_HIGHEST)
  )
  return jnp.exp(-gamma * jnp.maximum(sq, 0.0))


def make_kernel_fn(
  name: str = 'fc_ntk',
  *,
  depth: int = 1,
  W_std: float = 2**0.5,
  b_std: float = 0.1,
  gamma: Optional[float] = None,
) -> KernelFn:
  """A kernel by name.

  Args:
    name: 'fc_ntk', 'fc_nngp' or 'rbf' (`KERNELS`).
    depth: hidden blocks of the FC kernels.
    W_std: weight standard deviation of the FC kernels.
    b_std: bias standard deviation of the FC kernels.
    gamma: width of the RBF kernel (None: 1 / d).

  Returns:
    `k(x1, x2) -> [n1, n2]`.
  """
  if name == 'fc_ntk':
    return lambda a, b: fc_ntk_kernel(a, b, depth=depth, W_std=W_std, b_std=b_std)
  if name == 'fc_nngp':
    return lambda a, b: fc_nngp_kernel(a, b, depth=depth, W_std=W_std, b_std=b_std)
  if name == 'rbf':
    return lambda a, b: rbf_kernel(a, b, gamma=gamma)
  raise ValueError(f'unknown KIP kernel {name!r}; expected one of {KERNELS}')
