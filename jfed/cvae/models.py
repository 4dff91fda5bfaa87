"""Conditional VAEs of the resource-constrained clients of FedMHO (Yao et al., WWW 2026, Table 1).

Every CVAE maps (images x [B, H, W, C] in [0, 1], integer labels [B], a PRNG key) to a
`CVAEOutput` (reconstruction *logits* x̂, the posterior mean μ and log-variance log σ²), and
`decode(z, labels)` maps latents to image logits; a sample is sigmoid(logits). The references
end their decoders with a Sigmoid and take the BCE of its output; here the decoder returns the
logits and `jfed.cvae.losses` takes the BCE with logits: the same function, without PyTorch's
clamp of log(p) at -100 for saturated pixels.

- `CVAE(size='small')` (`YXShi2000/FedMHO:pcode/models/cvae.py:CVAE_MNIST`, the MNIST family's
  CVAE-small): encoder [x_flat ⊕ onehot(y)] → Linear 256 → ReLU → (Linear → μ, Linear →
  log σ²); decoder [z ⊕ onehot(y)] → Linear 256 → ReLU → Linear H·W·C.
- `CVAE(size='v0')` (FedCVAE's own CVAE, `ceh-2000/fed_cvae:models/encoder.py:ConditionalEncoder`,
  `models/decoder.py:ConditionalDecoder`). It works at 32×32, as the
  reference resizes MNIST/Fashion-MNIST to 32: inputs are resized (bilinear) to 32×32 and
  `decode` returns 32×32 logits (`native_shape`); `to_image_shape` maps decoded images back to the
  dataset's shape. Encoder (no label input): [Conv4×4 s2 p1, BatchNorm, ReLU] × 4 with 32, 32, 64,
  64 channels → Linear 500 → Linear 2·latent (no activation between) → (μ, log σ²); decoder
  [z ⊕ onehot(y)] → Linear 256 → (2, 2, 64) → ReLU → [ConvT4×4 s2 p1, BatchNorm(eps 1e-3), ReLU]
  × 3 with 64, 32, 32 channels → ConvT4×4 s2 p1 → C. BatchNorm uses batch statistics in training
  and running statistics (PyTorch momentum 0.1) in eval mode, as the reference's user decoders
  generate in eval mode.
- `CVAE(size='large')` (`pcode/models/cvae_large.py`, latent 20, hidden 256, s = H // 4): encoder
  Conv3×3 p1 C→64 ReLU → 64→128 ReLU → MaxPool2 → 128→256 ReLU → MaxPool2 → Linear 256 ReLU,
  (μ, log σ²) = Linear([h ⊕ onehot(y)]); decoder [z ⊕ onehot(y)] → Linear 256 ReLU → Linear
  256·s² ReLU → (s, s, 256) → ConvT3×3 p1 256→128 ReLU → bilinear ×2 → ConvT 128→64 ReLU →
  bilinear ×2 → ConvT 64→C. `width_mult` scales its conv channels (64, 128, 256), for CPU
  budgets only (1 = the reference).

Reference: `github.com/YXShi2000/FedMHO` (`pcode/models/cvae.py`, `pcode/models/cvae_large.py`).
Inits are PyTorch's defaults (jfed.models.layers); flattening is
NHWC rather than PyTorch's NCHW, which permutes the input features of one Linear layer and
changes nothing learnable.
"""

import math
from typing import NamedTuple, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jfed.models.layers import BatchNorm, conv, dense, flatten, max_pool


class CVAEOutput(NamedTuple):
  recon_logits: jnp.ndarray  # [B, H, W, C]
  mu: jnp.ndarray  # [B, latent]
  logvar: jnp.ndarray  # [B, latent]


def reparameterize(key: jax.Array, mu: jnp.ndarray, logvar: jnp.ndarray) -> jnp.ndarray:
  """z = μ + exp(log σ² / 2) · ε, ε ~ N(0, I).

  Args:
    key: PRNG key of ε.
    mu: Posterior mean [B, latent].
    logvar: Posterior log-variance [B, latent].

  Returns:
    z [B, latent].
  """
  return mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape, mu.dtype)


def _conv_transpose(x, features: int, kernel: int = 3, stride: int = 1, padding: int = 1):
  """PyTorch ConvTranspose2d(kernel, stride, padding) with its default init; output size
  (in − 1)·stride − 2·padding + kernel. PyTorch takes the fan-in of a transposed conv from its
  *output* channels. lax's transposed conv pads the stride-dilated input by kernel − 1 − padding
  on each side, which gives PyTorch's output size."""
  fan_in = features * kernel * kernel
  bound = 1.0 / math.sqrt(fan_in)
  edge = kernel - 1 - padding
  return nn.ConvTranspose(
    features,
    (kernel, kernel),
    strides=(stride, stride),
    padding=((edge, edge), (edge, edge)),
    kernel_init=_uniform(bound),
    bias_init=_uniform(bound),
  )(x)


def _conv_transpose3(x, features: int):
  """ConvTranspose2d(k=3, stride=1, padding=1): the output keeps the input's size."""
  return _conv_transpose(x, features, 3, 1, 1)


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


V0_SIDE = 32  # FedCVAE resizes MNIST-family images to 32×32
V0_DECODER_BN_EPSILON = 1e-3  # nn.BatchNorm2d(64, 1.0e-3): the second argument is eps


def resize_images(x: jnp.ndarray, hw: Tuple[int, int]) -> jnp.ndarray:
  """Bilinear resize of [..., H, W, C] images to `hw` (antialiased when shrinking); the identity
  when the size already matches."""
  if tuple(x.shape[-3:-1]) == tuple(hw):
    return x
  return jax.image.resize(x, (*x.shape[:-3], *hw, x.shape[-1]), method='bilinear')


class _V0Encoder(nn.Module):
  latent: int

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    h = resize_images(x, (V0_SIDE, V0_SIDE))
    for features in (32, 32, 64, 64):
      h = nn.relu(BatchNorm()(conv(h, features, 4, stride=2, padding=1), train, mask))
    h = dense(dense(flatten(h), 500), 2 * self.latent)
    return h[:, : self.latent], h[:, self.latent :]


class _V0Decoder(nn.Module):
  num_classes: int
  channels: int

  @nn.compact
  def __call__(self, z, labels, train: bool, mask=None):
    h = jnp.concatenate([z, jax.nn.one_hot(labels, self.num_classes)], -1)
    h = nn.relu(dense(h, 256).reshape((z.shape[0], 2, 2, 64)))
    for features in (64, 32, 32):
      h = _conv_transpose(h, features, 4, 2, 1)
      h = nn.relu(BatchNorm(epsilon=V0_DECODER_BN_EPSILON)(h, train, mask))
    return _conv_transpose(h, self.channels, 4, 2, 1)


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
  size: str = 'small'  # 'small' | 'large' | 'v0'
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
    elif self.size == 'v0':
      self.encoder = _V0Encoder(self.latent)
      self.decoder = _V0Decoder(self.num_classes, self.image_shape[-1])
    else:
      raise ValueError(f"CVAE size must be 'small', 'large' or 'v0', got {self.size!r}")

  @property
  def has_batch_norm(self) -> bool:
    return self.size == 'v0'

  @property
  def native_shape(self) -> Tuple[int, int, int]:
    """The shape of the images the decoder produces (and the encoder reconstructs)."""
    if self.size == 'v0':
      return (V0_SIDE, V0_SIDE, self.image_shape[-1])
    return tuple(self.image_shape)

  def __call__(self, x, labels, key, train: bool = False, mask=None) -> CVAEOutput:
    """Reconstruction logits at `native_shape`; `mask` ([B] bool) keeps padded samples out of
    the BatchNorm statistics (v0)."""
    if self.has_batch_norm:
      mu, logvar = self.encoder(x, train, mask)
      z = reparameterize(key, mu, logvar)
      return CVAEOutput(self.decoder(z, labels, train, mask), mu, logvar)
    mu, logvar = self.encoder(x, labels)
    return CVAEOutput(self.decoder(reparameterize(key, mu, logvar), labels), mu, logvar)

  def decode(self, z, labels, train: bool = False, mask=None) -> jnp.ndarray:
    """Image logits [B, *native_shape] for latents z [B, latent] and integer labels [B].

    Args:
      z: Latents [B, latent].
      labels: Integer labels [B].
      train: Train mode (BatchNorm on batch statistics; only decoders with BN).
      mask: [B], the real samples whose statistics BatchNorm uses in train mode; None uses all.

    Returns:
      Image logits [B, *native_shape].
    """
    if self.has_batch_norm:
      return self.decoder(z, labels, train, mask)
    return self.decoder(z, labels)


def to_image_shape(module: CVAE, images: jnp.ndarray) -> jnp.ndarray:
  """Decoded images [..., *native_shape] resized to the dataset's image shape."""
  return resize_images(images, tuple(module.image_shape[:2]))
