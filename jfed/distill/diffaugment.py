"""Differentiable Siamese Augmentation (DSA, Zhao & Bilen, ICML'21) in JAX, NHWC.

The transforms and constants of the DSA code that MTT and DynaFed copy
(`github.com/pipilurj/DynaFed`, `utils.py`: `DiffAugment`, `ParamDiffAug`), each differentiable in
the images:

  color   brightness x + (r − 0.5)·1.0, then saturation (x − mean_channels)·2r + mean_channels,
          then contrast (x − mean_image)·(r + 0.5) + mean_image (a fresh r ~ U[0, 1) for each);
  crop    translation by integer (dy, dx) ~ U{−s..s}, s = int(0.125·size + 0.5), zero fill;
  cutout  a zero rectangle of int(0.5·size + 0.5) pixels per side around a random centre;
  flip    horizontal flip with probability 0.5;
  scale   affine zoom, sx, sy ~ U[1/1.2, 1.2] (width, height), bilinear, zero padding;
  rotate  affine rotation by ~ U[−15°, 15°], bilinear, zero padding.

The affine transforms are torch's `affine_grid` + `grid_sample` with `align_corners=True`.
A strategy is words joined by '_' (the reference: 'color_crop_cutout_flip_scale_rotate');
'' or 'none' is the identity. In the reference's mode 'S' (`single=True`) one word is drawn
uniformly per call and only its transforms run; 'M' (`single=False`) runs every word in order.

Random parameters come from one uniform draw per call (`sample_params`): per sample by default
(the reference's `seed=-1`), or one set for the whole batch (`batchwise`, the reference's batch
mode). Siamese augmentation is `apply_params` with the same parameters on two batches (the
same key gives the same parameters). DynaFed draws fresh per-sample parameters for every batch.

The reference augments images in its normalised space; `mean` and `std` let a caller that holds
pixel images augment them as the reference would: pixel = mean + std · augment((pixel − mean) /
std), so brightness shifts by std·(r − 0.5) and every fill value is `mean`.
"""

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

DEFAULT_STRATEGY = 'color_crop_cutout_flip_scale_rotate'
WORDS = ('color', 'crop', 'cutout', 'flip', 'scale', 'rotate')
# Rows of the one uniform draw of `sample_params`.
_ROWS = (
  'choice',
  'brightness',
  'saturation',
  'contrast',
  'crop_y',
  'crop_x',
  'cutout_y',
  'cutout_x',
  'flip',
  'scale_x',
  'scale_y',
  'rotate',
)


class DSAConstants(NamedTuple):
  """The reference's `ParamDiffAug` (its defaults)."""

  prob_flip: float = 0.5
  ratio_scale: float = 1.2
  ratio_rotate: float = 15.0  # degrees
  ratio_crop_pad: float = 0.125
  ratio_cutout: float = 0.5
  brightness: float = 1.0
  saturation: float = 2.0
  contrast: float = 0.5


def strategy_words(strategy: str) -> Tuple[str, ...]:
  """The words of a strategy ('' / 'none': none); ValueError on an unknown word."""
  if strategy in ('', 'none', 'None'):
    return ()
  words = tuple(strategy.split('_'))
  bad = [w for w in words if w not in WORDS]
  if bad:
    raise ValueError(
      f'unknown DSA transform(s) {", ".join(map(repr, bad))} in {strategy!r}; valid words '
      f'(joined by _): {", ".join(WORDS)}; or none'
    )
  return words


# ------------------------------------------------------------------------------------------------
# the transforms, with explicit per-sample parameters ([B] arrays)
# ------------------------------------------------------------------------------------------------
def _per_sample(v):
  return v[:, None, None, None]


def brightness(x, r, ratio: float = 1.0):
  """Brightness: x + (r − 0.5) · ratio, per sample.

  Args:
    x: Images [B, H, W, C].
    r: Uniform draws in [0, 1), shape [B].
    ratio: Strength (the reference's 1.0).

  Returns:
    The transformed images, shape of x.
  """
  return x + _per_sample((r - 0.5) * ratio)


def saturation(x, r, ratio: float = 2.0):
  """Saturation: (x − channel mean) · r · ratio + channel mean, per sample.

  Args:
    x: Images [B, H, W, C].
    r: Uniform draws in [0, 1), shape [B].
    ratio: Strength (the reference's 2.0).

  Returns:
    The transformed images, shape of x.
  """
  mean = jnp.mean(x, axis=3, keepdims=True)
  return (x - mean) * _per_sample(r * ratio) + mean


def contrast(x, r, ratio: float = 0.5):
  """Contrast: (x − image mean) · (r + ratio) + image mean, per sample.

  Args:
    x: Images [B, H, W, C].
    r: Uniform draws in [0, 1), shape [B].
    ratio: Offset of the factor (the reference's 0.5).

  Returns:
    The transformed images, shape of x.
  """
  mean = jnp.mean(x, axis=(1, 2, 3), keepdims=True)
  return (x - mean) * _per_sample(r + ratio) + mean


def translate(x, dy, dx, max_shift: int):
  """out[b, i, j] = x[b, i + dy[b], j + dx[b]] where that lies inside the image, else 0
  (the reference's `rand_crop`); |dy|, |dx| <= max_shift.

  Args:
    x: Images [B, H, W, C].
    dy: Integer row shifts [B].
    dx: Integer column shifts [B].
    max_shift: Bound on |dy| and |dx| in pixels; 0 returns x unchanged.
  """
  if max_shift <= 0:
    return x
  _, h, w, c = x.shape
  s = int(max_shift)
  padded = jnp.pad(x, ((0, 0), (s, s), (s, s), (0, 0)))
  crop = lambda img, i, j: jax.lax.dynamic_slice(img, (i, j, 0), (h, w, c))
  return jax.vmap(crop)(padded, s + dy, s + dx)


def cutout(x, cy, cx, size_y: int, size_x: int):
  """Zero rows cy − size_y//2 .. + size_y − 1 and the same for columns (clipped to the image):
  the reference's `rand_cutout` with centre offsets (cy, cx).

  Args:
    x: Images [B, H, W, C].
    cy: Integer centre rows [B].
    cx: Integer centre columns [B].
    size_y: Height of the zeroed square in pixels.
    size_x: Its width in pixels.
  """
  _, h, w, _ = x.shape
  rows, cols = jnp.arange(h), jnp.arange(w)
  y0 = (cy - size_y // 2)[:, None]
  x0 = (cx - size_x // 2)[:, None]
  in_rows = (rows[None] >= y0) & (rows[None] < y0 + size_y)  # [B, H]
  in_cols = (cols[None] >= x0) & (cols[None] < x0 + size_x)  # [B, W]
  mask = 1.0 - (in_rows[:, :, None] & in_cols[:, None, :]).astype(x.dtype)
  return x * mask[..., None]


def flip(x, do_flip):
  """Horizontal flip of the samples where do_flip [B] is true."""
  return jnp.where(_per_sample(do_flip), x[:, :, ::-1, :], x)


def affine(x, theta):
  """torch `grid_sample(x, affine_grid(theta, align_corners=True), align_corners=True)`:
  bilinear, zero padding. theta [B, 2, 3] maps output coordinates (x: width, y: height, both
  in [−1, 1]) to input coordinates."""
  x = jnp.asarray(x)
  b, h, w, _ = x.shape
  gy, gx = jnp.meshgrid(jnp.linspace(-1.0, 1.0, h), jnp.linspace(-1.0, 1.0, w), indexing='ij')
  base = jnp.stack([gx, gy, jnp.ones_like(gx)], -1)  # [H, W, 3]
  src = jnp.einsum('hwk,bik->bhwi', base, theta.astype(x.dtype))  # [B, H, W, 2]
  ix = (src[..., 0] + 1.0) * 0.5 * (w - 1)
  iy = (src[..., 1] + 1.0) * 0.5 * (h - 1)
  x0, y0 = jnp.floor(ix), jnp.floor(iy)
  wx1, wy1 = ix - x0, iy - y0
  batch = jnp.arange(b)[:, None, None]
  out = 0.0
  for yy, wy in ((y0, 1.0 - wy1), (y0 + 1.0, wy1)):
    for xx, wx in ((x0, 1.0 - wx1), (x0 + 1.0, wx1)):
      inside = (xx >= 0) & (xx <= w - 1) & (yy >= 0) & (yy <= h - 1)
      xi = jnp.clip(xx, 0, w - 1).astype(jnp.int32)
      yi = jnp.clip(yy, 0, h - 1).astype(jnp.int32)
      weight = jnp.where(inside, wx * wy, 0.0)
      out = out + x[batch, yi, xi] * weight[..., None]
  return out


def scale(x, sx, sy):
  """Affine zoom by (sx, sy) per sample, bilinear with zero padding.

  Args:
    x: Images [B, H, W, C].
    sx: Width factors [B].
    sy: Height factors [B].

  Returns:
    The transformed images, shape of x.
  """
  zero = jnp.zeros_like(sx)
  theta = jnp.stack([jnp.stack([sx, zero, zero], -1), jnp.stack([zero, sy, zero], -1)], 1)
  return affine(x, theta)


def rotate(x, angle):
  """Rotation by `angle` radians [B] (the reference's θ = [[cos, −sin, 0], [sin, cos, 0]])."""
  cos, sin, zero = jnp.cos(angle), jnp.sin(angle), jnp.zeros_like(angle)
  theta = jnp.stack([jnp.stack([cos, -sin, zero], -1), jnp.stack([sin, cos, zero], -1)], 1)
  return affine(x, theta)


# ------------------------------------------------------------------------------------------------
# random parameters and the whole augmentation
# ------------------------------------------------------------------------------------------------
def _sizes(shape, c: DSAConstants):
  h, w = shape[1], shape[2]
  shift = (int(h * c.ratio_crop_pad + 0.5), int(w * c.ratio_crop_pad + 0.5))
  cut = (int(h * c.ratio_cutout + 0.5), int(w * c.ratio_cutout + 0.5))
  return shift, cut


def _randint(u, low: int, high: int):
  """torch.randint(low, high) (high exclusive) from uniforms u."""
  n = high - low
  return low + jnp.minimum(jnp.floor(u * n), n - 1).astype(jnp.int32)


def sample_params(key, shape, constants: DSAConstants = DSAConstants(), batchwise: bool = False):
  """Every transform's parameters for a batch of `shape` (NHWC), from one uniform draw.

  Returns a dict of [B] arrays (the same value for all samples when `batchwise`); 'choice' is
  the uniform that picks the word in single mode.

  Args:
    key: PRNG key of the draw.
    shape: (B, H, W, C) of the batch.
    constants: The transforms' ranges (the reference's by default).
    batchwise: One draw for the whole batch instead of one per sample.
  """
  c = constants
  b = shape[0]
  u = jax.random.uniform(key, (len(_ROWS), 1 if batchwise else b))
  u = jnp.broadcast_to(u, (len(_ROWS), b))
  r = dict(zip(_ROWS, u))
  (shift_y, shift_x), (cut_y, cut_x) = _sizes(shape, c)
  low = 1.0 / c.ratio_scale
  return {
    'choice': r['choice'],
    'brightness': r['brightness'],
    'saturation': r['saturation'],
    'contrast': r['contrast'],
    'crop_y': _randint(r['crop_y'], -shift_y, shift_y + 1),
    'crop_x': _randint(r['crop_x'], -shift_x, shift_x + 1),
    'cutout_y': _randint(r['cutout_y'], 0, shape[1] + (1 - cut_y % 2)),
    'cutout_x': _randint(r['cutout_x'], 0, shape[2] + (1 - cut_x % 2)),
    'flip': r['flip'] < c.prob_flip,
    'scale_x': r['scale_x'] * (c.ratio_scale - low) + low,
    'scale_y': r['scale_y'] * (c.ratio_scale - low) + low,
    'rotate': (r['rotate'] - 0.5) * 2.0 * c.ratio_rotate / 180.0 * jnp.pi,
  }


def apply_word(word: str, x, p, constants: DSAConstants = DSAConstants()):
  """One strategy word's transforms with parameters `p` (`sample_params`).

  Args:
    word: One of WORDS ('color', 'crop', ...).
    x: Images [B, H, W, C].
    p: The parameters from `sample_params`.
    constants: The transforms' ranges.
  """
  c = constants
  (shift_y, shift_x), (cut_y, cut_x) = _sizes(x.shape, c)
  if word == 'color':
    x = brightness(x, p['brightness'], c.brightness)
    x = saturation(x, p['saturation'], c.saturation)
    return contrast(x, p['contrast'], c.contrast)
  if word == 'crop':
    return translate(x, p['crop_y'], p['crop_x'], max(shift_y, shift_x))
  if word == 'cutout':
    return cutout(x, p['cutout_y'], p['cutout_x'], cut_y, cut_x)
  if word == 'flip':
    return flip(x, p['flip'])
  if word == 'scale':
    return scale(x, p['scale_x'], p['scale_y'])
  if word == 'rotate':
    return rotate(x, p['rotate'])
  raise ValueError(f'unknown DSA transform {word!r}')


def apply_params(
  x,
  p,
  strategy: str,
  constants: DSAConstants,
  single: bool,
):
  """The augmentation with given parameters (Siamese: the same `p` on several batches).

  Args:
    x: Images [B, H, W, C].
    p: The parameters from `sample_params`.
    strategy: Words joined by '_', e.g. 'color_crop_cutout'; '' or 'none' returns x unchanged.
    constants: The transforms' ranges.
    single: Apply one word chosen by p['choice'] (the reference's single mode) instead of all
      words in order.
  """
  words = strategy_words(strategy)
  if not words:
    return x
  if not single:
    for word in words:
      x = apply_word(word, x, p, constants)
    return x
  if len(words) == 1:
    return apply_word(words[0], x, p, constants)
  index = _randint(p['choice'][0], 0, len(words))
  branches = [lambda y, word=word: apply_word(word, y, p, constants) for word in words]
  return jax.lax.switch(index, branches, x)


class DiffAugment(NamedTuple):
  """`DiffAugment(x, strategy, param=ParamDiffAug())` as a hashable callable (key, x) -> x.

  Hashable by value, so it can be a static argument of a jitted function.
  """

  strategy: str = DEFAULT_STRATEGY
  mean: float = 0.0
  std: float = 1.0
  single: bool = True
  batchwise: bool = False
  constants: DSAConstants = DSAConstants()

  def __call__(self, key, x):
    if not strategy_words(self.strategy):
      return x
    p = sample_params(key, x.shape, self.constants, self.batchwise)
    z = (x - self.mean) / self.std
    z = apply_params(z, p, self.strategy, self.constants, self.single)
    return self.mean + self.std * z
