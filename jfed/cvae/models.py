"""Conditional VAEs of the resource-constrained clients of FedMHO (seed 004, Table 1).

Every CVAE maps (images x [B, H, W, C] in [0, 1], integer labels [B], a PRNG key) to a
`CVAEOutput` (reconstruction *logits* x̂, the posterior mean μ and log-variance log σ²), and
`decode(z, labels)` maps latents to image logits; a sample is sigmoid(logits). The references
end their decoders with a Sigmoid and take the BCE of its output; here the decoder returns the
logits and `jfed.cvae.losses` takes the BCE with logits: the same function, without PyTorch's
clamp of log(p) at -100 for saturated pixels.

- `CVAE(size='small')` (`YXShi2000/FedMHO:pcode/models/cvae.py:CVAE_MNIST`, the MNIST family's
  CVAE-small): encoder [x_flat ⊕ onehot(y)] → Linear 256 → ReLU → (Linear → μ, Linear →
  log σ²); decoder [z ⊕ onehot(y)] → Linear 256 → ReLU → Linear H·W·C.
- `CVAE(size='large')` (`pcode/models/cvae_large.py`, latent 20, hidden 256, s = H // 4): encoder
  Conv3×3 p1 C→64 ReLU → 64→128 ReLU → MaxPool2 → 128→256 ReLU → MaxPool2 → Linear 256 ReLU,
  (μ, log σ²) = Linear([h ⊕ onehot(y)]); decoder [z ⊕ onehot(y)] → Linear 256 ReLU → Linear
  256·s² ReLU → (s, s, 256) → ConvT3×3 p1 256→128 ReLU → bilinear ×2 → ConvT 128→64 ReLU →
  bilinear ×2 → ConvT 64→C. `width_mult` scales its conv channels (64, 128, 256), for CPU
  budgets only (1 = the reference).

reference-code.md §4.3-4.4. Inits are PyTorch's defaults (jfed.models.layers); flattening is
NHWC rather than PyTorch's NCHW, which permutes the input features of one Linear layer and
changes nothing learnable.
"""

import math
from typing import NamedTuple, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jfed.models.layers import conv, dense, flatten, max_pool


class CVAEOutput(NamedTuple):
  recon_logits: jnp.ndarray  # [B, H, W, C]
  mu: jnp.ndarray  # [B, latent]
  logvar: jnp.ndarray  # [B, latent]


def reparameterize(key: jax.Array, mu: jnp.ndarray, logvar: jnp.ndarray) -> jnp.ndarray:
  """z = μ + exp(log σ² / 2) · ε, ε ~ N(0, I)."""
  return mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape, mu.dtype)


def _conv_transpose3(x, features: int):
  """PyTorch ConvTranspose2d(k=3, stride=1, padding=1) with its default init: the output keeps
  the input's size; PyTorch takes the fan-in of a transposed conv from its *output* channels."""
  fan_in = features * 9
  bound = 1.0 / math.sqrt(fan_in)
  return nn.ConvTranspose(
    features, (3, 3), padding='SAME', kernel_init=_uniform(bound), bias_init=_uniform(bound)
  )(x)


def _uniform(bound: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _upsample2(x):
  """nn.Upsample(scale_factor=2, mode='bilinear') (align_corners=False: half-pixel centres)."""
  b, h, w, c = x.shape
  return jax.image.resize(x, (b, 2 * h, 2 * w, c), method='bilinear', antialias=False)


class _SmallEncoder(nn.Module):
  num_classes: int
  latent: int
  hidden: int

  @nn.compact
  def __call__(self, x, labels):
    h = jnp.concatenate([flatten(x), jax.nn.one_hot(labels, self.num_classes)], -1)
    h = nn.relu(dense(h, self.hidden))
    return dense(h, self.latent), dense(h, self.latent)


class _SmallDecoder(nn.Module):
  num_classes: int
  image_shape: Tuple[int, int, int]
  hidden: int

  @nn.compact
  def __call__(self, z, labels):
    h = jnp.concatenate([z, jax.nn.one_hot(labels, self.num_classes)], -1)
    h = nn.relu(dense(h, self.hidden))
    return dense(h, math.prod(self.image_shape)).reshape((z.shape[0], *self.image_shape))


def _channels(width_mult: float, *base: int) -> Tuple[int, ...]:
  return tuple(max(1, int(round(c * width_mult))) for c in base)


class _LargeEncoder(nn.Module):
  num_classes: int
  latent: int
  hidden: int
  width_mult: float = 1.0

  @nn.compact
  def __call__(self, x, labels):
    c1, c2, c3 = _channels(self.width_mult, 64, 128, 256)
    h = nn.relu(conv(x, c1, 3, padding=1))
    h = max_pool(nn.relu(conv(h, c2, 3, padding=1)), 2)
    h = max_pool(nn.relu(conv(h, c3, 3, padding=1)), 2)
    h = nn.relu(dense(flatten(h), self.hidden))
    h = jnp.concatenate([h, jax.nn.one_hot(labels, self.num_classes)], -1)
    return dense(h, self.latent), dense(h, self.latent)


class _LargeDecoder(nn.Module):
  num_classes: int
  image_shape: Tuple[int, int, int]
  hidden: int
  width_mult: float = 1.0

  @nn.compact
  def __call__(self, z, labels):
    s = self.image_shape[0] // 4
    c1, c2, c3 = _channels(self.width_mult, 64, 128, 256)
    h = jnp.concatenate([z, jax.nn.one_hot(labels, self.num_classes)], -1)
    h = nn.relu(dense(h, self.hidden))
    h = nn.relu(dense(h, c3 * s * s)).reshape((z.shape[0], s, s, c3))
    h = nn.relu(_conv_transpose3(h, c2))
    h = nn.relu(_conv_transpose3(_upsample2(h), c1))
    return _conv_transpose3(_upsample2(h), self.image_shape[-1])


class CVAE(nn.Module):
  """A CVAE whose encoder and decoder are separate submodules: the decoder's parameters are
  `params['decoder']`, what a CVAE client uploads."""

  num_classes: int
  image_shape: Tuple[int, int, int]
  size: str = 'small'  # 'small' | 'large'
  latent: int = 20
  hidden: int = 256
  width_mult: float = 1.0  # CVAE-large's conv channels (64, 128, 256) scaled (CPU budgets)

  def setup(self):
    if self.size == 'small':
      self.encoder = _SmallEncoder(self.num_classes, self.latent, self.hidden)
      self.decoder = _SmallDecoder(self.num_classes, tuple(self.image_shape), self.hidden)
    elif self.size == 'large':
      if self.image_shape[0] % 4 or self.image_shape[1] % 4:
        raise ValueError(f'CVAE-large needs H and W divisible by 4, got {self.image_shape}')
      self.encoder = _LargeEncoder(self.num_classes, self.latent, self.hidden, self.width_mult)
      self.decoder = _LargeDecoder(
        self.num_classes, tuple(self.image_shape), self.hidden, self.width_mult
      )
    else:
      raise ValueError(f"CVAE size must be 'small' or 'large', got {self.size!r}")

  def __call__(self, x, labels, key, train: bool = False) -> CVAEOutput:
    del train  # no dropout or BatchNorm
    mu, logvar = self.encoder(x, labels)
    return CVAEOutput(self.decoder(reparameterize(key, mu, logvar), labels), mu, logvar)

  def decode(self, z, labels) -> jnp.ndarray:
    """Image logits for latents z [B, latent] and integer labels [B]."""
    return self.decoder(z, labels)
