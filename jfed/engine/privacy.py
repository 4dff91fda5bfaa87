"""Differential privacy for model averaging: DP-FedAvg / DP-FedProx and a local-DP option.

User-level DP (a neighbouring run adds or removes one client's whole data), as in DP-FedAvg
(McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018). Each round t the server

1. clips every upload's update Δ_k = θ_k − θ_global to L2 norm C_t (`clip_updates`), so one
   client moves the sum of the updates by at most C_t;
2. adds Gaussian noise of std z_Δ·C_t to that sum and divides by the *expected* number of clients
   per round m, whichever number of uploads arrived (`noised_mean_update`: DP-FedAvg's fixed
   denominator; the uploads count equally, not by their sizes, which would leak); the noise on
   the averaged update therefore has std z_Δ·C_t/m per coordinate;
3. with adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private
   Learning with Adaptive Clipping", NeurIPS 2021), moves C toward the `target_quantile` γ of
   the update norms: b̃ = (Σ_k (1[‖Δ_k‖ ≤ C_t] − ½) + N(0, σ_b²))/m + ½ is the noised fraction
   of unclipped updates and C_{t+1} = C_t · exp(−η_C (b̃ − γ)) (`next_clip_norm`; their
   geometric update). The centred indicator has sensitivity ½, so the round releases two
   Gaussian mechanisms, of noise multipliers z_Δ and 2σ_b, which compose into one of noise
   multiplier z = (z_Δ^-2 + (2σ_b)^-2)^-1/2 (their Theorem 1): given the configured z, the sum
   gets z_Δ = (z^-2 − (2σ_b)^-2)^-1/2 (`update_noise_multiplier`), which needs z < 2σ_b.

Under the server-side mechanism with participation below 1, the clients of a round are
Poisson-sampled, as DP-FedAvg's analysis assumes: each client independently with probability
q = m/N (`common.poisson_clients`), so a cohort has m clients on average, the mean keeps the
fixed denominator m, and a round may have no client at all (it then releases the noise alone,
`central_noise_only`). The accountant (`central_epsilon`) is of exactly that sampling:
dp-accounting's Rényi-DP accountant of the Poisson-subsampled Gaussian (Mironov, Talwar and
Zhang 2019), composed over the rounds run, read at δ (`dp_epsilon`); its privacy-loss-
distribution accountant (tighter) gives `dp_epsilon_pld` beside it. (Before 2026-12-07 the
clients were a fixed-size uniform sample while ε was Poisson's: the reported ε was too small.)

Local DP (`local=True`): every client clips its own update to C and adds N(0, (z·C)² I) before it
uploads (`privatize_locally`), so the server (and anyone who sees an upload) never sees a clean
update; the server may then aggregate by any rule (post-processing). ε is per client, for any
two datasets it could hold (its clipped update can move by 2C: noise multiplier z/2), without
amplification by sampling (the server knows who uploaded), composed over every round so far
(exact when every client takes part each round) (`local_epsilon`). jfed simulates the clients:
the clipping and noise run on the uploads as the server process receives them (before the attack
simulation and validation), so the trust model is modelled, not enforced (under the Flower
bridge too: the noise is added where the server receives the uploads, not on the node).

The noise keys come from the operating system (`fresh_noise_key`) unless `reproducible_noise`
derives them from the seed and the round (simulations only: the config reaches every Flower node).

Everything here is a pure function of arrays (the method threads the keys and the clip norm);
the model is one flat vector, BatchNorm statistics included, as `jfed.engine.aggregation` sees it.
"""

import functools
import logging
import math
import os
from typing import Any, NamedTuple, Optional, Tuple

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np

from jfed.engine import multihost
from jfed.errors import ConfigError


class DpConfig(NamedTuple):
  """The `dp` config section."""

  enabled: bool
  noise_multiplier: float  # z: the noise std over the sensitivity of a round's release
  clip_norm: float  # C: the L2 bound of one client's update (adaptive: its first value)
  adaptive: bool  # C follows the target quantile of the update norms (Andrew et al.)
  target_quantile: float  # γ: the fraction of updates left unclipped that C aims at
  clip_lr: float  # η_C of the geometric update of C
  count_noise_fraction: float  # σ_b / m: the unclipped count's noise std per expected client
  delta: float  # the δ at which ε is reported
  local: bool  # each client clips and noises its own update before uploading
  # False: the noise key comes from the operating system's randomness (nobody can regenerate
  # the noise from the config, which travels to every Flower node); True: derived from the seed
  # and the round, so a simulation repeats exactly (refused under the Flower bridge)
  reproducible_noise: bool = False
  # > 0: the run stops after the last round whose ε (RDP, at δ) stays within it; 0: no budget
  max_epsilon: float = 0.0


def config_problem(
  dp: DpConfig, clients_per_round: int, aggregation: Any, num_clients: int = 0
) -> Optional[str]:
  """Why `dp` cannot run with m = `clients_per_round` and the run's `aggregation` section (one
  line naming the key), or None when it can (or DP is off).

  Args:
    dp: The DP settings.
    clients_per_round: m.
    num_clients: N (δ must be below 1/N); 0 skips that check.
    aggregation: The run's aggregation settings (server-side DP needs rule 'mean' and no
      clip_norm).

  Returns:
    The problem, or None.
  """
  if not dp.enabled:
    return None
  z = dp.noise_multiplier
  if not z > 0:
    return (
      f'dp.noise_multiplier must be positive when dp.enabled, got {z} (0 gives no privacy, ε = ∞; '
      'to clip without noise use aggregation.clip_norm)'
    )
  if not dp.clip_norm > 0:
    return f'dp.clip_norm must be positive, got {dp.clip_norm}'
  if not 0.0 < dp.delta < 1.0:
    return f'dp.delta must be in (0, 1), got {dp.delta}'
  if dp.max_epsilon < 0:
    return f'dp.max_epsilon must be >= 0 (0: no budget), got {dp.max_epsilon}'
  if num_clients and dp.delta >= 1.0 / num_clients:
    return (
      f'dp.delta={dp.delta:g} is at least 1/N = 1/{num_clients}: a mechanism that publishes one '
      f"client's data outright meets it; use dp.delta < {1.0 / num_clients:g} (1e-5 or less)"
    )
  if dp.adaptive:
    if dp.local:
      return 'dp.adaptive needs the server-side mechanism: set dp.local=False or dp.adaptive=False'
    if not 0.0 < dp.target_quantile < 1.0:
      return f'dp.target_quantile must be in (0, 1), got {dp.target_quantile}'
    if not dp.clip_lr > 0:
      return f'dp.clip_lr must be positive, got {dp.clip_lr}'
    if not dp.count_noise_fraction > 0:
      return f'dp.count_noise_fraction must be positive, got {dp.count_noise_fraction}'
    sigma_b = count_noise_std(dp, clients_per_round)
    if not z < 2 * sigma_b:
      return (
        f'dp.noise_multiplier={z:g} leaves no noise for the update sum under adaptive clipping: '
        f'it must be below 2σ_b = 2 × dp.count_noise_fraction × {clients_per_round} clients per '
        f'round = {2 * sigma_b:g}; raise dp.count_noise_fraction or lower dp.noise_multiplier'
      )
  if not dp.local:
    if aggregation.rule != 'mean':
      return (
        f'dp.enabled (server-side) averages the clipped updates itself; aggregation.rule must be '
        f"'mean', got {aggregation.rule!r} (dp.local=True composes with any rule)"
      )
    if aggregation.clip_norm > 0:
      return (
        f'dp.enabled clips the updates to dp.clip_norm itself; aggregation.clip_norm must be 0, '
        f'got {aggregation.clip_norm}'
      )
  return None


def rounds_within_budget(epsilon_after, rounds: int, max_epsilon: float) -> int:
  """The most rounds r <= `rounds` with `epsilon_after(r)` <= `max_epsilon` (ε grows with r:
  a bisection); 0 when even one round exceeds it.

  Args:
    epsilon_after: r -> ε after r rounds.
    rounds: The rounds configured.
    max_epsilon: The budget.

  Returns:
    The rounds the budget allows.
  """
  lo, hi = 0, int(rounds)  # epsilon_after(lo) <= budget (vacuously at 0) < epsilon_after(hi + 1)
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if epsilon_after(mid) <= max_epsilon:
      lo = mid
    else:
      hi = mid - 1
  return lo


def fresh_noise_key() -> jax.Array:
  """A PRNG key of 64 bits from the operating system (`os.urandom`), the same on every process
  of a run (the primary's, broadcast): noise no participant can regenerate from the config."""
  data = np.frombuffer(os.urandom(8), np.uint32).copy()
  return jnp.asarray(multihost.broadcast_from_primary(data), jnp.uint32)  # a raw PRNGKey


def count_noise_std(dp: DpConfig, clients_per_round: int) -> float:
  """σ_b, the noise std of adaptive clipping's unclipped count (Andrew et al. use m/20)."""
  return dp.count_noise_fraction * clients_per_round


def update_noise_multiplier(noise_multiplier: float, count_std: Optional[float]) -> float:
  """z_Δ, the noise multiplier of the update sum that leaves the round at `noise_multiplier`
  once the count (noise std σ_b = `count_std`, sensitivity ½) is released too; without adaptive
  clipping (`count_std` None) the sum gets all of it."""
  if count_std is None:
    return noise_multiplier
  return (noise_multiplier**-2 - (2 * count_std) ** -2) ** -0.5


# ---- the mechanisms, on [K, D] rows -------------------------------------------------------------


def clip_updates(x: jax.Array, reference: jax.Array, clip_norm: jax.Array) -> Tuple[jax.Array, ...]:
  """The updates x_k − reference scaled to L2 norm at most `clip_norm`, and their norms before.

  Args:
    x: Flattened uploads [K, P].
    reference: The global model [P].
    clip_norm: C.

  Returns:
    (clipped updates [K, P], norms before clipping [K]).
  """
  delta = x - reference
  norms = jnp.linalg.norm(delta, axis=1)
  scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, 1e-12))
  return delta * scale[:, None], norms


def noised_mean_update(
  clipped: jax.Array, key: jax.Array, noise_std: jax.Array, denominator: jax.Array
) -> jax.Array:
  """(Σ_k clipped_k + N(0, noise_std² I)) / denominator: DP-FedAvg's fixed-denominator mean.

  Args:
    clipped: Clipped updates [K, P].
    key: PRNG key of the noise.
    noise_std: Standard deviation of the noise on the sum (z_Δ · C).
    denominator: m, the expected number of clients per round.

  Returns:
    The noised mean update [P].
  """
  noise = noise_std * jax.random.normal(key, clipped.shape[1:], jnp.float32)
  return (jnp.sum(clipped, axis=0) + noise) / denominator


def noised_unclipped_fraction(
  norms: jax.Array, clip_norm: jax.Array, key: jax.Array, count_std: jax.Array, denominator
) -> jax.Array:
  """b̃ = (Σ_k (1[‖Δ_k‖ ≤ C] − ½) + N(0, σ_b²)) / m + ½, Andrew et al.'s private estimate of the
  fraction of updates that clipping leaves as they are.

  Args:
    norms: The updates' norms before clipping [K].
    clip_norm: C.
    key: PRNG key of the noise.
    count_std: σ_b.
    denominator: m.

  Returns:
    b̃ (scalar).
  """
  centred = jnp.sum((norms <= clip_norm).astype(jnp.float32) - 0.5)
  return (centred + count_std * jax.random.normal(key, (), jnp.float32)) / denominator + 0.5


def next_clip_norm(
  clip_norm: jax.Array, unclipped_fraction: jax.Array, target_quantile: float, clip_lr: float
) -> jax.Array:
  """C · exp(−η_C (b̃ − γ)): shrinks C while more than γ of the updates fit under it.

  Args:
    clip_norm: C_t.
    unclipped_fraction: b̃.
    target_quantile: γ.
    clip_lr: η_C.

  Returns:
    C_{t+1}.
  """
  return clip_norm * jnp.exp(-clip_lr * (unclipped_fraction - target_quantile))


class RoundNoise(NamedTuple):
  """What a round's server-side mechanism needs besides the uploads."""

  key: jax.Array  # the round's privacy key
  clip_norm: jax.Array  # C_t
  noise_std: jax.Array  # z_Δ·C_t, on the sum
  count_std: jax.Array  # σ_b (0 without adaptive clipping)
  denominator: jax.Array  # m, the expected number of clients per round


UPDATE_NOISE, COUNT_NOISE, LOCAL_NOISE = 0, 1, 2  # fold_in of the round's key


@jax.jit
def central_aggregate(stacked: Any, reference: Any, noise: RoundNoise) -> Tuple[Any, jax.Array]:
  """The server-side DP mean of the uploads `stacked` (leading client axis) around `reference`:
  reference + (Σ clip(Δ_k, C) + N(0, (z_Δ C)² I)) / m, and the noised unclipped fraction b̃.

  Args:
    stacked: The round's uploads (model pytrees with a leading client axis).
    reference: The global model they start from.
    noise: The round's key, C, noise stds and m.

  Returns:
    (the new global model, pytree of `reference`; b̃).
  """
  flat_reference, unravel = ravel_pytree(reference)
  ref = flat_reference.astype(jnp.float32)
  x = jax.vmap(lambda m: ravel_pytree(m)[0])(stacked).astype(jnp.float32)
  clipped, norms = clip_updates(x, ref, noise.clip_norm)
  mean = noised_mean_update(
    clipped, jax.random.fold_in(noise.key, UPDATE_NOISE), noise.noise_std, noise.denominator
  )
  fraction = noised_unclipped_fraction(
    norms,
    noise.clip_norm,
    jax.random.fold_in(noise.key, COUNT_NOISE),
    noise.count_std,
    noise.denominator,
  )
  return unravel((ref + mean).astype(flat_reference.dtype)), fraction


@jax.jit
def central_noise_only(reference: Any, noise: RoundNoise) -> Tuple[Any, jax.Array]:
  """`central_aggregate` of a round without any accepted upload: the noise still goes out, or
  the unchanged model would tell that every upload was rejected."""
  flat_reference, unravel = ravel_pytree(reference)
  ref = flat_reference.astype(jnp.float32)
  zero = jnp.zeros((0, ref.shape[0]), jnp.float32)
  mean = noised_mean_update(
    zero, jax.random.fold_in(noise.key, UPDATE_NOISE), noise.noise_std, noise.denominator
  )
  fraction = noised_unclipped_fraction(
    jnp.zeros((0,)),
    noise.clip_norm,
    jax.random.fold_in(noise.key, COUNT_NOISE),
    noise.count_std,
    noise.denominator,
  )
  return unravel((ref + mean).astype(flat_reference.dtype)), fraction


@jax.jit
def privatize_locally(
  stacked: Any,
  reference: Any,
  key: jax.Array,
  client_ids: jax.Array,
  clip_norm: jax.Array,
  noise_multiplier: jax.Array,
) -> Any:
  """Local DP: each client's upload becomes reference + clip(Δ_k, C) + N(0, (z C)² I), its noise
  drawn from fold_in(key, its global client id).

  Args:
    stacked: The round's uploads (model pytrees with a leading client axis).
    reference: The global model they start from.
    key: The round's privacy key.
    client_ids: Global id of each row [K].
    clip_norm: C.
    noise_multiplier: z.

  Returns:
    The privatised uploads, stacked like `stacked`.
  """
  flat_reference, unravel = ravel_pytree(reference)
  ref = flat_reference.astype(jnp.float32)
  x = jax.vmap(lambda m: ravel_pytree(m)[0])(stacked).astype(jnp.float32)
  clipped, _ = clip_updates(x, ref, clip_norm)
  local_key = jax.random.fold_in(key, LOCAL_NOISE)
  noise = jax.vmap(
    lambda cid: jax.random.normal(jax.random.fold_in(local_key, cid), ref.shape, jnp.float32)
  )(client_ids)
  rows = ref + clipped + noise_multiplier * clip_norm * noise
  return jax.vmap(unravel)(rows.astype(flat_reference.dtype))


# ---- accounting ---------------------------------------------------------------------------------


def _dp_accounting() -> Any:
  """dp-accounting, imported on first use: it pulls in scipy.signal and scipy.stats (about half
  of `import jfed.api`'s CPU time), which only the runs that use differential privacy need."""
  import dp_accounting  # pylint: disable=g-import-not-at-top

  return dp_accounting


ACCOUNTANTS = ('rdp', 'pld')
# ε above this is flagged on the console and in the summary: it bounds little in practice
WEAK_EPSILON = 10.0


@functools.lru_cache(maxsize=4096)  # a run asks for each round's ε more than once
def central_epsilon(
  sampling_rate: float,
  noise_multiplier: float,
  rounds: int,
  delta: float,
  count_std: Optional[float] = None,
  accountant: str = 'rdp',
) -> float:
  """ε after `rounds` rounds of the server-side mechanism at δ: RDP of the Poisson-subsampled
  Gaussian (rate q = m/N) composed `rounds` times, by dp-accounting. With adaptive clipping
  (`count_std` = σ_b) each round is the composition of the update sum's Gaussian (z_Δ) and the
  count's (noise multiplier 2σ_b), which dp-accounting composes into z itself.

  Args:
    sampling_rate: q = m / N.
    noise_multiplier: z (z_Δ when `count_std` is given).
    rounds: Number of rounds.
    delta: δ.
    count_std: σ_b of adaptive clipping; None without it.
    accountant: 'rdp' (Rényi DP) or 'pld' (privacy loss distributions, tighter).

  Returns:
    ε.
  """
  dp_accounting = _dp_accounting()
  gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
  # The PLD accountant takes one mechanism under sampling: the two Gaussians compose into the
  # one of multiplier z exactly (Andrew et al.'s Theorem 1), which it is given instead.
  if count_std is not None and accountant == 'rdp':
    gaussian = dp_accounting.ComposedDpEvent(
      [
        dp_accounting.GaussianDpEvent(update_noise_multiplier(noise_multiplier, count_std)),
        dp_accounting.GaussianDpEvent(2 * count_std),
      ]
    )
  event = dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)
  return _epsilon(dp_accounting.SelfComposedDpEvent(event, rounds), delta, accountant)


@functools.lru_cache(maxsize=4096)
def local_epsilon(
  noise_multiplier: float, rounds: int, delta: float, accountant: str = 'rdp'
) -> float:
  """One client's ε after uploading in `rounds` rounds with local DP at δ: the Gaussian
  mechanism of noise std z·C on an update that can move by 2C (noise multiplier z/2), composed
  `rounds` times without amplification by sampling.

  Args:
    noise_multiplier: z.
    rounds: Rounds the client uploads in.
    delta: δ.
    accountant: 'rdp' or 'pld'.

  Returns:
    ε.
  """
  dp_accounting = _dp_accounting()
  event = dp_accounting.GaussianDpEvent(noise_multiplier / 2)
  return _epsilon(dp_accounting.SelfComposedDpEvent(event, rounds), delta, accountant)


class _SkippedOrders(logging.Filter):
  """dp-accounting warns, for each fractional Rényi order whose series does not converge (large
  sampling rates), that it leaves the order out: ε is still a valid bound over the other orders,
  and a warning every round would read as a failure."""

  def filter(self, record: logging.LogRecord) -> bool:
    return 'failed to converge' not in record.getMessage()


def _epsilon(event: Any, delta: float, accountant: str) -> float:
  """ε of `event` at δ by dp-accounting's RDP or PLD accountant; ConfigError (one line) when the
  accountant cannot give a finite number for the settings (e.g. a noise multiplier of 1e300)."""
  if accountant not in ACCOUNTANTS:
    raise ValueError(f'accountant must be one of {ACCOUNTANTS}, got {accountant!r}')
  dp_accounting = _dp_accounting()
  quiet = _SkippedOrders()
  absl_logger = logging.getLogger('absl')
  absl_logger.addFilter(quiet)
  try:
    if accountant == 'rdp':
      engine = dp_accounting.rdp.RdpAccountant()
    else:
      engine = dp_accounting.pld.PLDAccountant()
    engine.compose(event)
    epsilon = float(engine.get_epsilon(delta))
  except (OverflowError, ZeroDivisionError, ValueError, FloatingPointError) as e:
    raise ConfigError(
      f'the {accountant.upper()} accountant cannot compute ε for these dp settings '
      f'({type(e).__name__}: {e}); use a noise multiplier between 0.1 and 1000'
    ) from None
  finally:
    absl_logger.removeFilter(quiet)
  if not math.isfinite(epsilon):  # never for z > 0; a record must stay a finite number
    raise ConfigError(
      f'the {accountant.upper()} accountant gives ε = {epsilon} for these dp settings; raise '
      'dp.noise_multiplier'
    )
  return epsilon


def accountant_name() -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top

  version = metadata.version('dp-accounting')
  return f'RDP (dp_epsilon) and PLD (dp_epsilon_pld), dp-accounting {version}'
