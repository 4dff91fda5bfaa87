"""Denoising diffusion (Ho et al., 2020) with classifier-free guidance (Ho & Salimans, 2022):
the noise schedule, the forward process, the training loss and the ancestral sampler.

Pure functions over an `apply(params, x_t, t, y) -> eps` network, so that the sampler is one
jitted `lax.scan` over the timesteps (compiled once per batch shape) and the loss is a plain
function for `jax.value_and_grad`.

- Schedule: DDPM's linear betas (1e-4 to 0.02 at T = 1000) scaled by 1000 / T, the scaling of
  Nichol & Dhariwal (2021) that keeps the total noise the same when T is smaller (T = 200 is
  our CPU default).
- Loss: E ||eps - eps_theta(sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, t, y)||^2 with t uniform,
  and y replaced by the "no class" label with probability `p_uncond`.
- Sampler: x_{t-1} from the posterior q(x_{t-1} | x_t, x0_hat) with x0_hat clipped to [-1, 1]
  (the clipping of the DDPM reference sampler), variance beta_tilde_t; guided noise
  eps = (1 + w) eps(x, t, y) - w eps(x, t, none); w = 0 is plain conditional sampling.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

EpsFn = Callable[[object, jnp.ndarray, jnp.ndarray, jnp.ndarray], jnp.ndarray]


class Schedule(NamedTuple):
  betas: jnp.ndarray  # [T]
  alphas: jnp.ndarray  # [T] 1 - beta
  alpha_bars: jnp.ndarray  # [T] prod_{s <= t} alpha_s


def linear_schedule(timesteps: int) -> Schedule:
  if timesteps < 2:
    raise ValueError(f'a diffusion needs at least 2 timesteps, got {timesteps}')
  scale = 1000.0 / timesteps
  betas = np.linspace(scale * 1e-4, min(scale * 0.02, 0.999), timesteps, dtype=np.float64)
  alphas = 1.0 - betas
  alpha_bars = np.cumprod(alphas)
  as32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  return Schedule(as32(betas), as32(alphas), as32(alpha_bars))


def q_sample(schedule: Schedule, x0: jnp.ndarray, t: jnp.ndarray, noise: jnp.ndarray):
  """x_t ~ q(x_t | x0) = N(sqrt(abar_t) x0, (1 - abar_t) I), with the given noise.

  Args:
    schedule: The noise schedule.
    x0: Clean images [B, H, W, C] in [-1, 1].
    t: Integer timesteps [B].
    noise: ε ~ N(0, I), shape of x0.

  Returns:
    x_t, shape of x0.
  """
  abar = schedule.alpha_bars[t].reshape((-1,) + (1,) * (x0.ndim - 1))
  return jnp.sqrt(abar) * x0 + jnp.sqrt(1.0 - abar) * noise


def diffusion_loss(
  eps_fn: EpsFn,
  params,
  schedule: Schedule,
  x0: jnp.ndarray,
  labels: jnp.ndarray,
  key: jax.Array,
  num_classes: int,
  p_uncond: float,
) -> jnp.ndarray:
  """The simplified DDPM objective with label dropout for classifier-free guidance.

  Args:
    eps_fn: The noise-prediction network, (params, x_t, t, y) -> ε̂.
    params: Its weights.
    schedule: The noise schedule.
    x0: Clean images [B, H, W, C] in [-1, 1].
    labels: Their labels [B].
    key: PRNG key of the timesteps, noise and label dropout.
    num_classes: C; the label C stands for "no label".
    p_uncond: Probability that a sample's label is dropped.

  Returns:
    The scalar mean squared error of the predicted noise.
  """
  t_key, noise_key, drop_key = jax.random.split(key, 3)
  batch = x0.shape[0]
  t = jax.random.randint(t_key, (batch,), 0, schedule.betas.shape[0])
  noise = jax.random.normal(noise_key, x0.shape)
  dropped = jax.random.bernoulli(drop_key, p_uncond, (batch,))
  y = jnp.where(dropped, num_classes, labels)
  eps = eps_fn(params, q_sample(schedule, x0, t, noise), t, y)
  return jnp.mean(jnp.square(eps - noise))


def guided_eps(eps_fn: EpsFn, params, x, t, labels, num_classes: int, guidance: float):
  """(1 + w) eps(x, t, y) - w eps(x, t, none), both halves in one network call.

  Args:
    eps_fn: The noise-prediction network.
    params: Its weights.
    x: Noisy images [B, H, W, C].
    t: Integer timesteps [B].
    labels: Labels [B].
    num_classes: C; the label C stands for "no label".
    guidance: The guidance weight w; 0 is the conditional prediction alone.

  Returns:
    ε̂ [B, H, W, C].
  """
  if guidance == 0:
    return eps_fn(params, x, t, labels)
  both = eps_fn(
    params,
    jnp.concatenate([x, x]),
    jnp.concatenate([t, t]),
    jnp.concatenate([labels, jnp.full_like(labels, num_classes)]),
  )
  cond, uncond = jnp.split(both, 2)
  return (1.0 + guidance) * cond - guidance * uncond


def initial_noise(key: jax.Array, batch: int, image_shape) -> jnp.ndarray:
  """x_T ~ N(0, I) of `batch` images.

  Args:
    key: The sampling key (its fold 0 is used).
    batch: Number of images.
    image_shape: (H, W, C).

  Returns:
    [batch, H, W, C].
  """
  return jax.random.normal(jax.random.fold_in(key, 0), (batch, *image_shape))


def denoising_step(
  eps_fn: EpsFn,
  params,
  schedule: Schedule,
  x: jnp.ndarray,
  t: jnp.ndarray,
  labels: jnp.ndarray,
  key: jax.Array,
  num_classes: int,
  guidance: float,
) -> jnp.ndarray:
  """x_{t-1} ~ q(x_{t-1} | x_t, x0_hat) for a scalar timestep t; noise-free at t = 0.

  Args:
    eps_fn: The noise-prediction network.
    params: Its weights.
    schedule: The noise schedule.
    x: x_t [B, H, W, C].
    t: The timestep (scalar int).
    labels: Labels [B].
    key: The sampling key (folded with t for the step's noise).
    num_classes: C; the label C stands for "no label".
    guidance: The guidance weight w.

  Returns:
    x_{t-1}, shape of x.
  """
  beta, alpha = schedule.betas[t], schedule.alphas[t]
  abar = schedule.alpha_bars[t]
  abar_prev = jnp.where(t > 0, schedule.alpha_bars[jnp.maximum(t - 1, 0)], 1.0)
  eps = guided_eps(eps_fn, params, x, jnp.full((x.shape[0],), t), labels, num_classes, guidance)
  x0 = jnp.clip((x - jnp.sqrt(1.0 - abar) * eps) / jnp.sqrt(abar), -1.0, 1.0)
  mean = (beta * jnp.sqrt(abar_prev) / (1.0 - abar)) * x0 + (
    (1.0 - abar_prev) * jnp.sqrt(alpha) / (1.0 - abar)
  ) * x
  variance = beta * (1.0 - abar_prev) / (1.0 - abar)
  # Key 0 made the initial noise; step t uses t + 1.
  noise = jax.random.normal(jax.random.fold_in(key, t + 1), x.shape)
  return mean + jnp.where(t > 0, jnp.sqrt(variance), 0.0) * noise


def sample(
  eps_fn: EpsFn,
  params,
  schedule: Schedule,
  labels: jnp.ndarray,
  image_shape,
  key: jax.Array,
  num_classes: int,
  guidance: float,
) -> jnp.ndarray:
  """Ancestral sampling of one image per label as one `lax.scan` over the timesteps (the fast
  form on accelerators; XLA:CPU runs convolutions in loops slowly, so CPU callers loop over
  jitted `denoising_step`s, which gives the same images); returns [B, *image_shape] in [-1, 1].

  Args:
    eps_fn: The noise-prediction network.
    params: Its weights.
    schedule: The noise schedule.
    labels: One label per image [B].
    image_shape: (H, W, C).
    key: PRNG key of the initial noise and of every step.
    num_classes: C; the label C stands for "no label".
    guidance: The guidance weight w.

  Returns:
    Images [B, *image_shape] in [-1, 1].
  """
  x = initial_noise(key, labels.shape[0], image_shape)

  def step(x, t):
    return denoising_step(eps_fn, params, schedule, x, t, labels, key, num_classes, guidance), None

  x, _ = jax.lax.scan(step, x, jnp.arange(schedule.betas.shape[0] - 1, -1, -1))
  return jnp.clip(x, -1.0, 1.0)
