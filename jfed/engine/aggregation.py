"""Server-side aggregation of stacked client models: the weighted mean and robust aggregators.

Every aggregator is a pure function of (stacked models, client weights, reference model) where
the models are a pytree with a leading client axis (`ModelState`, BatchNorm statistics
included, as averaging a PyTorch state_dict does) and the reference is the model the clients
started from (the global model; a one-shot run's initial model). Inside, each client's model is
one flat vector, so a rule sees the clients as the rows of a [K, D] matrix:

- `mean`: Σ_k w_k θ_k / Σ_k w_k (FedAvg; McMahan et al. 2017).
- `median`: coordinate-wise median (Yin et al., ICML'18; Flower's FedMedian). Unweighted.
- `trimmed_mean`: per coordinate, drop the floor(β K) largest and smallest values and average
  the rest (Yin et al.; Flower's FedTrimmedAvg). Unweighted.
- `krum`: score each client by the summed squared distance to its K − f − 2 nearest others and
  keep the m best (Blanchard et al., NeurIPS'17; m > 1 is multi-Krum), averaged with weights.
- `geometric_median`: smoothed Weiszfeld iterations on Σ_k w_k ||v − θ_k|| (Pillutla et al.,
  "Robust Aggregation for Federated Learning", RFA).
- `clip_norm` > 0 wraps any of them: each client's update θ_k − reference is scaled to norm
  at most `clip_norm` first (Sun et al. 2019, "Can you really backdoor FL?").

`make_aggregator(config)` builds the one a run uses; its `aggregate` is jitted once per shape.
A method whose uploads never reach this server round refuses these settings
(`jfed.run_config.check_capabilities`, from its Algorithm class's `server_round`).
"""

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

from absl import logging
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp

RULES = ('mean', 'median', 'trimmed_mean', 'krum', 'geometric_median')


def weighted_average(stacked: Any, weights) -> Any:
  """FedAvg: Σ_k w_k θ_k / Σ_k w_k over the leading client axis (BatchNorm statistics too,
  as averaging a PyTorch state_dict does)."""
  w = jnp.asarray(weights, jnp.float32)
  w = w / jnp.sum(w)
  return jax.tree.map(
    lambda a: jnp.tensordot(w, a.astype(jnp.float32), axes=1).astype(a.dtype), stacked
  )


# ---- rules over the rows of a [K, D] matrix --------------------------------------------------


def mean_rows(x: jax.Array, weights: jax.Array) -> jax.Array:
  w = weights / jnp.sum(weights)
  return w @ x


def median_rows(x: jax.Array) -> jax.Array:
  return jnp.median(x, axis=0)


def trimmed_per_side(beta: float, k: int) -> int:
  """How many of k values the trimmed mean drops at each end: floor(beta k)."""
  return int(beta * k)


def trimmed_mean_rows(x: jax.Array, beta: float) -> jax.Array:
  """Mean of each column without its floor(beta K) smallest and largest entries."""
  k = x.shape[0]
  cut = trimmed_per_side(beta, k)
  if 2 * cut >= k:
    raise ValueError(f'trimmed mean with beta={beta} drops every one of {k} clients')
  if cut == 0:
    # The config check rules this out for a full round; fewer uploads than that (rejected ones,
    # a small FedTSA cluster) can still get here. Logged once per compiled shape.
    logging.warning(
      'trimmed mean with trim_fraction=%g trims none of %d uploads: this aggregate is the '
      'plain mean',
      beta,
      k,
    )
  return jnp.mean(jnp.sort(x, axis=0)[cut : k - cut], axis=0)


def squared_distances(x: jax.Array) -> jax.Array:
  """[K, K] squared Euclidean distances between rows, from differences (no cancellation)."""
  return jax.vmap(lambda a: jnp.sum(jnp.square(x - a), axis=-1))(x)


def krum_scores(x: jax.Array, byzantine: int) -> jax.Array:
  """Each row's summed squared distance to its K − f − 2 nearest other rows."""
  k = x.shape[0]
  neighbours = k - byzantine - 2
  if neighbours < 1:
    raise ValueError(f'Krum needs K > f + 2; got K={k} clients and f={byzantine}')
  d = squared_distances(x)
  # Sorted ascending, the row's own zero distance comes first (or ties with an identical row,
  # which changes nothing): its nearest others are the next `neighbours` entries.
  return jnp.sum(jnp.sort(d, axis=1)[:, 1 : 1 + neighbours], axis=1)


def krum_rows(x: jax.Array, weights: jax.Array, byzantine: int, selected: int) -> jax.Array:
  """The weighted mean of the `selected` rows of lowest Krum score (Krum when selected = 1).

  Args:
    x: Flattened uploads [K, P], one row per client.
    weights: Per-client weights [K] (e.g. sample counts).
    byzantine: f, the number of attackers Krum tolerates.
    selected: Rows averaged (1 is Krum, more is multi-Krum).

  Returns:
    The aggregate [P].
  """
  if not 1 <= selected <= x.shape[0]:
    raise ValueError(f'multi-Krum keeps 1..{x.shape[0]} clients, got {selected}')
  keep = jnp.argsort(krum_scores(x, byzantine))[:selected]
  return mean_rows(x[keep], weights[keep])


def geometric_median_rows(
  x: jax.Array, weights: jax.Array, iterations: int, smoothing: float
) -> jax.Array:
  """argmin_v Σ_k w_k ||v − x_k|| by smoothed Weiszfeld: v ← Σ β_k x_k / Σ β_k with
  β_k = w_k / max(smoothing, ||v − x_k||), from the weighted mean.

  Args:
    x: Flattened uploads [K, P], one row per client.
    weights: Per-client weights [K].
    iterations: Weiszfeld iterations.
    smoothing: Lower bound on the distances, which keeps β finite.

  Returns:
    The aggregate [P].
  """
  w = weights / jnp.sum(weights)

  def body(_, v):
    beta = w / jnp.maximum(smoothing, jnp.linalg.norm(x - v, axis=1))
    return (beta / jnp.sum(beta)) @ x

  return jax.lax.fori_loop(0, iterations, body, w @ x)


def clip_rows(x: jax.Array, reference: jax.Array, max_norm: float) -> jax.Array:
  """reference + the update x_k − reference scaled to norm at most max_norm.

  Args:
    x: Flattened uploads [K, P].
    reference: The global model the updates start from [P].
    max_norm: Largest L2 norm of an update.

  Returns:
    The clipped uploads [K, P].
  """
  delta = x - reference
  norms = jnp.linalg.norm(delta, axis=1, keepdims=True)
  return reference + delta * jnp.minimum(1.0, max_norm / jnp.maximum(norms, 1e-12))


# ---- on pytrees ------------------------------------------------------------------------------


class AggregationConfig(NamedTuple):
  """The `aggregation` config section."""

  rule: str  # one of RULES
  trim_fraction: float  # trimmed_mean's β per side
  krum_byzantine: int  # Krum's f
  krum_selected: int  # multi-Krum's m (1: Krum)
  geomed_iterations: int
  geomed_smoothing: float  # Weiszfeld's ν: distances below it count as ν
  clip_norm: float  # > 0: clip every client's update to this L2 norm before the rule


def _smallest_trim_fraction(n: int) -> float:
  """The smallest trim_fraction of three decimals that trims one of n values at each end."""
  beta = math.ceil(1000 / n) / 1000
  while trimmed_per_side(beta, n) < 1:
    beta = round(beta + 0.001, 3)
  return beta


def size_problem(config: AggregationConfig, n: int, clients: str) -> Optional[str]:
  """Why `config`'s rule would do nothing or void its guarantee with n uploads per aggregation
  (described by `clients`, e.g. '5 clients'), or None when it is fine.

  The trimmed mean must trim at least one upload at each end (otherwise it is the mean, under
  the trimmed mean's name); Krum's guarantee needs n >= 2f + 3 (Blanchard et al., NeurIPS'17),
  and multi-Krum cannot keep more than n.

  Args:
    config: The aggregation settings.
    n: Uploads per aggregation.
    clients: How the message names them.

  Returns:
    A one-line problem naming the key, or None.
  """
  c = config
  if c.rule == 'trimmed_mean':
    cut = trimmed_per_side(c.trim_fraction, n)
    if cut == 0:
      head = (
        f'aggregation.trim_fraction={c.trim_fraction:g} trims floor({c.trim_fraction:g}*{n})=0 '
        f'of {clients}: the trimmed mean would be the plain mean'
      )
      if n < 3:
        return (
          f'{head}; a trimmed mean needs at least 3 clients per aggregation: use '
          'aggregation.rule=median or mean'
        )
      return f'{head}; use aggregation.trim_fraction >= {_smallest_trim_fraction(n):g}'
  if c.rule == 'krum':
    f = c.krum_byzantine
    if n < 2 * f + 3:
      head = (
        f'aggregation.krum_byzantine={f}: Krum needs n >= 2f + 3 = {2 * f + 3} clients per '
        f'aggregation, the config has {clients}'
      )
      if n < 3:
        return f'{head}; Krum needs at least 3 clients per aggregation: use aggregation.rule=median'
      return f'{head}; use aggregation.krum_byzantine <= {(n - 3) // 2}'
    if c.krum_selected > n:
      return (
        f'aggregation.krum_selected={c.krum_selected} keeps more clients than an aggregation '
        f'has ({clients}); use aggregation.krum_selected <= {n}'
      )
  return None


class Aggregator(NamedTuple):
  """`aggregate(stacked, weights, reference)` -> one model with the reference's structure."""

  name: str
  aggregate: Callable[[Any, Any, Any], Any]


def _rows_rule(config: AggregationConfig) -> Callable[[jax.Array, jax.Array], jax.Array]:
  c = config
  if c.rule == 'mean':
    return mean_rows
  if c.rule == 'median':
    return lambda x, w: median_rows(x)
  if c.rule == 'trimmed_mean':
    return lambda x, w: trimmed_mean_rows(x, c.trim_fraction)
  if c.rule == 'krum':
    return lambda x, w: krum_rows(x, w, c.krum_byzantine, c.krum_selected)
  if c.rule == 'geometric_median':
    return lambda x, w: geometric_median_rows(x, w, c.geomed_iterations, c.geomed_smoothing)
  raise ValueError(f'unknown aggregation rule {c.rule!r}; valid: {", ".join(RULES)}')


def _aggregate(rule, clip_norm: float, stacked: Any, weights: Any, reference: Any) -> Any:
  flat_reference, unravel = ravel_pytree(reference)
  dtype = flat_reference.dtype
  x = jax.vmap(lambda m: ravel_pytree(m)[0])(stacked).astype(jnp.float32)
  ref = flat_reference.astype(jnp.float32)
  if clip_norm > 0:
    x = clip_rows(x, ref, clip_norm)
  return unravel(rule(x, jnp.asarray(weights, jnp.float32)).astype(dtype))


# Below this, a clipped update changes no float32 parameter of magnitude about 1 by more than
# a few ulps (float32's eps is 1.2e-7): clipping would freeze training, not bound it.
MIN_CLIP_NORM = 1e-6


def config_problem(
  config: AggregationConfig, n: Optional[int] = None, clients: str = ''
) -> Optional[str]:
  """Why `config` is not a working aggregation rule, or None: the one place of its rules, read by
  the run-config checks and by `make_aggregator`.

  Args:
    config: The aggregation settings.
    n: Uploads per aggregation, when known (`size_problem`'s checks run then).
    clients: How the message names those uploads (default: 'n uploads').

  Returns:
    A one-line problem naming the key, or None.
  """
  c = config
  if c.rule not in RULES:
    return f'aggregation.rule is {c.rule!r}; valid: {", ".join(RULES)}'
  if not 0.0 <= c.trim_fraction < 0.5:
    return f'aggregation.trim_fraction must be in [0, 0.5), got {c.trim_fraction}'
  for key in ('krum_byzantine', 'clip_norm'):
    if getattr(c, key) < 0:
      return f'aggregation.{key} must be >= 0, got {getattr(c, key)}'
  for key in ('krum_selected', 'geomed_iterations', 'geomed_smoothing'):
    if getattr(c, key) <= 0:
      return f'aggregation.{key} must be positive, got {getattr(c, key)}'
  if 0 < c.clip_norm < MIN_CLIP_NORM:
    return (
      f'aggregation.clip_norm={c.clip_norm:g} is below {MIN_CLIP_NORM:g}: every clipped update '
      'would vanish in float32 and training would stop; use 0 (no clipping) or a norm of at '
      f'least {MIN_CLIP_NORM:g}'
    )
  if n is not None:
    return size_problem(c, n, clients or f'{n} uploads')
  return None


def make_aggregator(config: AggregationConfig, num_uploads: Optional[int] = None) -> Aggregator:
  """The run's aggregator; the plain mean without clipping is `weighted_average` itself.

  Args:
    config: The aggregation settings.
    num_uploads: Uploads per aggregation, when known: a rule that would do nothing or void its
      guarantee with that many is refused too.

  Returns:
    The aggregator.

  Raises:
    ValueError: `config_problem`'s, the command line's refusals.
  """
  problem = config_problem(config, num_uploads)
  if problem is not None:
    raise ValueError(problem)
  name = config.rule + (f'+clip({config.clip_norm:g})' if config.clip_norm > 0 else '')
  if config.rule == 'mean' and config.clip_norm <= 0:
    return mean_aggregator()
  rule = _rows_rule(config)
  return Aggregator(name, jax.jit(functools.partial(_aggregate, rule, config.clip_norm)))


def mean_aggregator() -> Aggregator:
  return Aggregator('mean', lambda stacked, weights, reference: weighted_average(stacked, weights))
