"""Training, caching and sampling FedTSA's class-conditional DDPM (the default Stage-2 source).

The server trains the DDPM once on images the clients never see (FedTSA's `holdout`), caches
the EMA weights in the workdir and maps each prompt of the prompt pool to its class, generating
`per_prompt` images per prompt. The paper uses Stable Diffusion; no weights can be downloaded
here, so a small DDPM trained on a held-out split stands in for it (docs/fedtsa.md).

- Training: Adam with gradient clipping at 1, `steps` steps of `batch` images drawn uniformly
  with replacement, run as jitted chunks of `CHUNK` steps (`lax.scan`) so a chunk is one
  dispatch and progress is logged between chunks; the EMA of the weights (decay
  min(0.999, (1 + i) / (10 + i)) at step i) is what samples and what is cached.
- Cache: one msgpack file holding the weights and a fingerprint of everything that decides
  them (training images and labels, number of classes, the config, the key). A file whose
  fingerprint differs, or that cannot be read, is retrained and replaced; writes are atomic.
- Sampling: fixed-size batches (the last one padded), so the sampler compiles once per run.
"""

import functools
import hashlib
import json
import os
from typing import NamedTuple, Optional, Sequence, Tuple

from absl import logging
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfed.diffusion import ddpm
from jfed.diffusion.source import PromptPool, SyntheticImages
from jfed.diffusion.unet import UNet
from jfed.engine.progress import PhaseProgress
from jfed.engine.training import resolve_strategy
from jfed.workdir import array_fingerprint, atomic_write_bytes

CHUNK = 100  # training steps per jitted call
SAMPLE_BATCH = 500  # images per sampler call
CACHE_FORMAT = 1


class DDPMConfig(NamedTuple):
  """Defaults: what learns digits on 2 CPU cores in about 1.5 minutes (docs/fedtsa.md)."""

  timesteps: int = 100
  base_channels: int = 16
  steps: int = 1000
  batch: int = 64
  lr: float = 2e-3
  guidance: float = 1.0  # classifier-free guidance weight w
  p_uncond: float = 0.1  # label dropout while training
  ema_decay: float = 0.999
  channel_mults: Tuple[int, ...] = (1, 2)


def validate_config(cfg: DDPMConfig) -> None:
  """ValueError (one line) for a config that cannot train."""
  if cfg.timesteps < 2:
    raise ValueError(f'ddpm timesteps must be >= 2, got {cfg.timesteps}')
  if cfg.base_channels < 1 or cfg.steps < 1 or cfg.batch < 1:
    raise ValueError(
      f'ddpm channels, steps and batch must be >= 1, got {cfg.base_channels}, {cfg.steps}, '
      f'{cfg.batch}'
    )
  if not (cfg.lr > 0 and np.isfinite(cfg.lr)):
    raise ValueError(f'ddpm lr must be a positive number, got {cfg.lr}')
  if not (cfg.guidance >= 0 and np.isfinite(cfg.guidance)):
    raise ValueError(f'ddpm guidance must be >= 0, got {cfg.guidance}')
  if not 0 <= cfg.p_uncond < 1:
    raise ValueError(f'ddpm p_uncond must lie in [0, 1), got {cfg.p_uncond}')


def make_network(num_classes: int, cfg: DDPMConfig) -> UNet:
  return UNet(num_classes, cfg.base_channels, tuple(cfg.channel_mults))


@functools.lru_cache(maxsize=8)
def _initializer(num_classes: int, cfg: DDPMConfig, image_shape: Tuple[int, ...]):
  # Jitted: flax's eager init compiles every primitive on its own (seconds on XLA:CPU).
  net = make_network(num_classes, cfg)
  x = np.zeros((1, *image_shape), np.float32)  # NumPy: this cache may be filled under a trace
  zeros = np.zeros((1,), np.int32)
  return jax.jit(lambda key: net.init(key, x, zeros, zeros)['params'])


def init_params(num_classes: int, cfg: DDPMConfig, image_shape: Sequence[int], key: jax.Array):
  """Fresh weights of the DDPM's noise-prediction network.

  Args:
    num_classes: C (the network embeds C + 1 labels, the last one "no label").
    cfg: The DDPM settings (only those that decide the network matter).
    image_shape: (H, W, C).
    key: PRNG key of the init.

  Returns:
    The network's weights.
  """
  return _initializer(num_classes, _architecture(cfg), tuple(image_shape))(key)


def _architecture(cfg: DDPMConfig) -> DDPMConfig:
  """The settings that decide the network (the cache key of its compiled programs)."""
  return cfg._replace(steps=1)


def params_template(num_classes: int, cfg: DDPMConfig, image_shape: Sequence[int]):
  """The weights' shapes and dtypes, without computing them.

  Args:
    num_classes: C.
    cfg: The DDPM settings.
    image_shape: (H, W, C).

  Returns:
    A pytree of jax.ShapeDtypeStruct, the structure of `init_params`'s result.
  """
  return jax.eval_shape(lambda: init_params(num_classes, cfg, image_shape, jax.random.key(0)))


def _eps_fn(net: UNet):
  return lambda params, x, t, y: net.apply({'params': params}, x, t, y)


def _check_data(images: np.ndarray, labels: np.ndarray, num_classes: int) -> None:
  if images.ndim != 4 or len(images) != len(labels) or not len(labels):
    raise ValueError(
      f'DDPM training needs [N, H, W, C] images with N labels, got {images.shape} and '
      f'{labels.shape}'
    )
  if labels.min() < 0 or labels.max() >= num_classes:
    raise ValueError(f'DDPM training labels must lie in [0, {num_classes}), got {labels.max()}')


@functools.lru_cache(maxsize=8)
def _training_program(num_classes: int, cfg: DDPMConfig, strategy: str):
  """(optimizer, run(carry, first_step, n, data_x, data_y) -> (carry, mean loss)) running n
  training steps: one jitted `lax.scan` ('scan', accelerators) or a Python loop of one jitted
  step ('loop', XLA:CPU, where convolutions inside loops are slow; design.md). Cached so that
  runs with the same settings (a sweep's seeds, a retrain after a stale cache) compile once.
  Step i's randomness is fold_in(key, i) in both forms."""
  eps_fn = _eps_fn(make_network(num_classes, cfg))
  schedule = ddpm.linear_schedule(cfg.timesteps)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.lr))

  def one_step(carry, step, key, data_x, data_y):
    params, ema, opt_state = carry
    pick_key, loss_key = jax.random.split(jax.random.fold_in(key, step))
    idx = jax.random.randint(pick_key, (cfg.batch,), 0, data_x.shape[0])
    loss, grads = jax.value_and_grad(ddpm.diffusion_loss, argnums=1)(
      eps_fn, params, schedule, data_x[idx], data_y[idx], loss_key, num_classes, cfg.p_uncond
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # EMA warm-up (TensorFlow's ExponentialMovingAverage with num_updates): a fixed 0.999
    # would still give the initial weights 0.37 of the average after 1,000 steps.
    decay = jnp.minimum(cfg.ema_decay, (1.0 + step) / (10.0 + step))
    ema = jax.tree_util.tree_map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)
    return (params, ema, opt_state), loss

  if strategy == 'scan':

    @functools.partial(jax.jit, static_argnums=2)
    def scanned(carry, first, n, key, data_x, data_y):
      steps = first + jnp.arange(n)
      carry, losses = jax.lax.scan(lambda c, i: one_step(c, i, key, data_x, data_y), carry, steps)
      return carry, jnp.mean(losses)

    # `on_step` is for the loop form: a chunk of the scan form is one dispatch
    return optimizer, lambda carry, first, n, key, x, y, on_step=None: scanned(
      carry, first, n, key, x, y
    )

  jitted_step = jax.jit(one_step)

  def looped(carry, first, n, key, data_x, data_y, on_step=None):
    losses = []
    for i in range(first, first + n):
      carry, loss = jitted_step(carry, i, key, data_x, data_y)
      losses.append(loss)
      if on_step is not None:  # a chunk takes a minute on XLA:CPU: progress within it
        on_step(i + 1, loss)
    return carry, jnp.mean(jnp.stack(losses))

  return optimizer, looped


class _Sampler:
  """images = sampler(params, labels, key): the whole ancestral chain, compiled once per batch
  shape, as one scan or as a loop of one jitted denoising step (see `_training_program`)."""

  def __init__(self, num_classes: int, cfg: DDPMConfig, image_shape, strategy: str):
    eps_fn = _eps_fn(make_network(num_classes, cfg))
    schedule = ddpm.linear_schedule(cfg.timesteps)
    self.timesteps = cfg.timesteps
    self.image_shape = tuple(image_shape)
    self.strategy = strategy
    args = (num_classes, cfg.guidance)
    self._scanned = jax.jit(
      lambda params, labels, key: ddpm.sample(
        eps_fn, params, schedule, labels, self.image_shape, key, *args
      )
    )
    self._init = jax.jit(ddpm.initial_noise, static_argnums=(1, 2))
    self._step = jax.jit(
      lambda params, x, t, labels, key: ddpm.denoising_step(
        eps_fn, params, schedule, x, t, labels, key, *args
      )
    )

  def __call__(self, params, labels, key):
    if self.strategy == 'scan':
      return self._scanned(params, labels, key)
    x = self._init(key, labels.shape[0], self.image_shape)
    for t in range(self.timesteps - 1, -1, -1):
      x = self._step(params, x, t, labels, key)
    return jnp.clip(x, -1.0, 1.0)

  def compilations(self) -> int:
    """How many programs were compiled for the denoising chain (1 per batch shape)."""
    return self._scanned._cache_size() + self._step._cache_size()  # pylint: disable=protected-access


@functools.lru_cache(maxsize=8)
def _sampler(num_classes: int, cfg: DDPMConfig, image_shape: Tuple[int, ...], strategy: str):
  return _Sampler(num_classes, cfg, image_shape, strategy)


def train_ddpm(
  images: np.ndarray,
  labels: np.ndarray,
  num_classes: int,
  cfg: DDPMConfig,
  key: jax.Array,
  loss_log: Optional[list] = None,
  strategy: str = 'auto',
):
  """Trains the DDPM on `images` ([N, H, W, C] in [0, 1]) and returns its EMA weights.

  `loss_log`, if given, receives the mean training loss of every chunk of CHUNK steps;
  `strategy` is 'auto' (the backend's fast form), 'loop' or 'scan' (same weights).

  Args:
    images: Training images [N, H, W, C] in [0, 1].
    labels: Their labels [N].
    num_classes: C.
    cfg: The DDPM settings (steps, batch size, learning rate, ...).
    key: PRNG key of the init and of training.
    loss_log: A list the chunk losses are appended to; None records none.
    strategy: 'auto', 'loop' or 'scan', as above.

  Returns:
    The EMA weights.
  """
  validate_config(cfg)
  images = np.asarray(images, np.float32)
  labels = np.asarray(labels, np.int32)
  _check_data(images, labels, num_classes)
  progress = PhaseProgress(f'DDPM training on {len(images)} images', cfg.steps)
  init_key, train_key = jax.random.split(key)
  params = init_params(num_classes, cfg, images.shape[1:], init_key)
  optimizer, run_steps = _training_program(
    num_classes, _architecture(cfg), resolve_strategy(strategy)
  )
  data_x = jnp.asarray(images * 2.0 - 1.0)
  data_y = jnp.asarray(labels)
  carry = (params, params, optimizer.init(params))

  def on_step(step: int, loss: jax.Array) -> None:
    if progress.due():  # the loss waits for the device: only for a line that is logged
      progress.update(step, lambda: f'loss {float(loss):.4f}')

  done = 0
  while done < cfg.steps:
    # A last, shorter chunk (steps not a multiple of CHUNK) compiles once more.
    n = min(CHUNK, cfg.steps - done)
    carry, loss = run_steps(carry, done, n, train_key, data_x, data_y, on_step=on_step)
    done += n
    loss = float(loss)
    if loss_log is not None:
      loss_log.append(loss)
    if not np.isfinite(loss):
      raise FloatingPointError(f'DDPM training loss became {loss} at step {done}; lower ddpm_lr')
    progress.update(done, lambda: f'loss {loss:.4f}')
  return carry[1]


def training_fingerprint(
  images: np.ndarray, labels: np.ndarray, num_classes: int, cfg: DDPMConfig, key: jax.Array
) -> str:
  """What decides the trained weights: data, classes, config and key.

  Args:
    images: Training images [N, H, W, C].
    labels: Their labels [N].
    num_classes: C.
    cfg: The DDPM settings.
    key: The training key.

  Returns:
    The first 16 hex digits of the SHA-256 of their description.
  """
  described = json.dumps(
    {
      'format': CACHE_FORMAT,
      'data': array_fingerprint(np.asarray(images, np.float32), np.asarray(labels, np.int32)),
      'num_classes': int(num_classes),
      'config': {k: list(v) if isinstance(v, tuple) else v for k, v in cfg._asdict().items()},
      'key': np.asarray(jax.random.key_data(key)).tolist(),
    },
    sort_keys=True,
  )
  return hashlib.sha256(described.encode()).hexdigest()[:16]


def save_cache(path, params, fingerprint: str) -> None:
  """Writes trained weights and their fingerprint to `path` (atomically, msgpack).

  Args:
    path: The cache file.
    params: The trained weights.
    fingerprint: `training_fingerprint` of the training that produced them.
  """
  payload = {'fingerprint': fingerprint, 'params': flax.serialization.to_state_dict(params)}
  atomic_write_bytes(path, flax.serialization.msgpack_serialize(payload))


def read_cache(path, template) -> Tuple[Optional[object], str, str]:
  """(params, fingerprint, '') when `path` holds weights shaped like `template`, else
  (None, '', why)."""
  if not os.path.exists(path):
    return None, '', 'no cache yet'
  try:
    with open(path, 'rb') as f:
      payload = flax.serialization.msgpack_restore(f.read())
    params = flax.serialization.from_state_dict(template, payload['params'])
    fingerprint = payload['fingerprint']
    shapes_match = jax.tree_util.tree_all(
      jax.tree_util.tree_map(lambda a, b: np.shape(a) == np.shape(b), params, template)
    )
    if not shapes_match:
      return None, '', 'its weights have other shapes'
  except Exception as e:  # pylint: disable=broad-except
    return None, '', f'it cannot be read ({type(e).__name__})'
  return params, str(fingerprint), ''


def load_or_train(
  path,
  images: np.ndarray,
  labels: np.ndarray,
  num_classes: int,
  cfg: DDPMConfig,
  key: jax.Array,
):
  """(params, loaded): the cached weights when the cache at `path` was trained on the same
  data, config and key; otherwise trains, writes the cache and returns (params, False).

  Args:
    path: The cache file.
    images: Training images [N, H, W, C] in [0, 1].
    labels: Their labels [N].
    num_classes: C.
    cfg: The DDPM settings.
    key: PRNG key of the init and of training.

  Returns:
    (params, loaded): the weights and whether they came from the cache.
  """
  validate_config(cfg)
  images = np.asarray(images, np.float32)
  labels = np.asarray(labels, np.int32)
  fingerprint = training_fingerprint(images, labels, num_classes, cfg, key)
  template = params_template(num_classes, cfg, images.shape[1:])
  params, cached_fingerprint, why = read_cache(path, template)
  if params is not None:
    if cached_fingerprint == fingerprint:
      logging.info('DDPM loaded from %s', path)
      return params, True
    why = 'it was trained on other data, settings or key'
  logging.info('Training the DDPM (cache %s: %s)', path, why)
  params = train_ddpm(images, labels, num_classes, cfg, key)
  save_cache(path, jax.device_get(params), fingerprint)
  return params, False


class DDPMImageSource:
  """The prompt pool's images from a trained DDPM: each prompt's class, `per_prompt` times."""

  def __init__(
    self,
    params,
    cfg: DDPMConfig,
    num_classes: int,
    image_shape: Sequence[int],
    strategy: str = 'auto',
  ):
    self.params = params
    self.cfg = cfg
    self.num_classes = num_classes
    self.image_shape = tuple(image_shape)
    self.sampler = _sampler(
      num_classes, _architecture(cfg), self.image_shape, resolve_strategy(strategy)
    )

  def sample_labels(self, labels: np.ndarray, key: jax.Array) -> np.ndarray:
    """One image per label, [N, *image_shape] in [0, 1]."""
    labels = np.asarray(labels, np.int32)
    batch = max(1, min(SAMPLE_BATCH, len(labels)))
    out = []
    for i, start in enumerate(range(0, len(labels), batch)):
      part = labels[start : start + batch]
      padded = np.pad(part, (0, batch - len(part)))
      x = self.sampler(self.params, jnp.asarray(padded), jax.random.fold_in(key, i))
      out.append(np.asarray(x)[: len(part)])
    images = np.concatenate(out) if out else np.zeros((0, *self.image_shape), np.float32)
    return ((images + 1.0) / 2.0).astype(np.float32)

  def generate(self, pool: PromptPool, per_prompt: int, key: jax.Array) -> SyntheticImages:
    """`per_prompt` sampled images of each prompt's class.

    Args:
      pool: The server's prompt pool.
      per_prompt: Images per prompt.
      key: PRNG key of the sampling.

    Returns:
      The images in [0, 1], prompt-major, with their classes.
    """
    labels = np.repeat(np.asarray(pool.class_ids, np.int32), per_prompt)
    return SyntheticImages(self.sample_labels(labels, key), labels)
