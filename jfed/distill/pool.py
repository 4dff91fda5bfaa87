"""Synthetic-image pool and the image augmentations of DENSE / Co-Boosting (pure JAX).

DENSE and Co-Boosting write every synthesised batch as PNG files and reload the whole growing pool
each epoch (`helpers/utils.py:ImagePool` in `github.com/zj-jayzhang/DENSE`; Co-Boosting's
`github.com/rong-dai/Co-Boosting` likewise). Here the pool is a preallocated fixed-capacity array
plus a counter, so adding a batch is a jittable scatter and the pool can live on device:

    pool = pool_init(capacity, image_shape, quantize=True)   # uint8 storage like DENSE's PNGs
    pool = pool_add(pool, images, labels)                     # ring buffer once full
    x = pool_gather(pool, idx)                                # float32 in [0, 1]

or, for a pool of bounded size, a uniform reservoir over the stream of added images:

    pool, slots = pool_reservoir_add(pool, images, labels, key)  # Vitter's algorithm R

`quantize=True` stores `floor(clip(x, 0, 1) · 255)` as uint8 (DENSE's `(imgs.clamp(0,1)*255)
.astype('uint8')` before `Image.save`), and reads back /255.
"""

from typing import NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np


class ImagePool(NamedTuple):
  images: jnp.ndarray  # [capacity, H, W, C] float32, or uint8 when quantised
  labels: jnp.ndarray  # [capacity] int32 (generator target labels; -1 where never written)
  count: jnp.ndarray  # int32 scalar: images ever added (size = min(count, capacity))

  @property
  def capacity(self) -> int:
    return self.images.shape[0]

  @property
  def quantized(self) -> bool:
    return self.images.dtype == jnp.uint8


def pool_init(capacity: int, image_shape: Sequence[int], quantize: bool = False) -> ImagePool:
  """An empty pool of `capacity` images.

  Args:
    capacity: Number of image slots.
    image_shape: (H, W, C) of one image.
    quantize: Store images as uint8 (a quarter of the memory) instead of float32.

  Returns:
    The empty ImagePool (count 0, labels -1).
  """
  dtype = jnp.uint8 if quantize else jnp.float32
  return ImagePool(
    images=jnp.zeros((capacity, *image_shape), dtype),
    labels=jnp.full((capacity,), -1, jnp.int32),
    count=jnp.zeros((), jnp.int32),
  )


def quantize_uint8(x: jnp.ndarray) -> jnp.ndarray:
  """DENSE PNG quantisation: uint8(floor(clip(x, 0, 1)·255))."""
  return jnp.floor(jnp.clip(x, 0.0, 1.0) * 255.0).astype(jnp.uint8)


def pool_add(pool: ImagePool, images: jnp.ndarray, labels=None) -> ImagePool:
  """Append a batch (jittable). When the pool is full the oldest images are overwritten
  (ring buffer); size the capacity as epochs × synthesis batch to keep DENSE's unbounded pool.

  Args:
    pool: The pool.
    images: The batch [n, H, W, C], values in [0, 1]; n at most the capacity.
    labels: Their generator target labels [n]; None stores -1.

  Returns:
    The pool with the batch written and `count` increased by n.
  """
  n = images.shape[0]
  if n > pool.capacity:
    raise ValueError(f'batch of {n} exceeds pool capacity {pool.capacity}')
  idx = (pool.count + jnp.arange(n, dtype=jnp.int32)) % pool.capacity
  imgs = quantize_uint8(images) if pool.quantized else images.astype(pool.images.dtype)
  if labels is None:
    labels = jnp.full((n,), -1, jnp.int32)
  return ImagePool(
    images=pool.images.at[idx].set(imgs),
    labels=pool.labels.at[idx].set(jnp.asarray(labels, jnp.int32)),
    count=pool.count + n,
  )


def pool_reservoir_add(pool: ImagePool, images: jnp.ndarray, labels, key: jax.Array):
  """Add a batch to a uniform reservoir (jittable): Vitter's algorithm R over the stream of
  every image ever added, `count` the images seen so far.

  Image t of the stream (0-based) goes to slot t while t < capacity; after that it draws j
  uniformly from [0, t] and replaces slot j if j < capacity, else is dropped. So after s images
  the pool holds min(s, capacity) of them, every one kept with probability capacity / s, and
  while the stream fits the pool does exactly what `pool_add` does. The batch is processed as
  if its images came one after the other: where several draw the same slot, the last wins. The
  draws depend only on `key` and `count`, so the same key on the same pool makes the same pool.

  Args:
    pool: The pool (its `count`: the images seen so far).
    images: The batch [n, H, W, C], values in [0, 1]; n may exceed the capacity.
    labels: Their generator target labels [n]; None stores -1.
    key: PRNG key of the batch's draws.

  Returns:
    (pool, slots): the pool with the batch's kept images written and `count` increased by n;
    the slot each image was written to, [n] int32 (the capacity where it was not kept).
  """
  n, capacity = images.shape[0], pool.capacity
  t = pool.count + jnp.arange(n, dtype=jnp.int32)  # each image's index in the stream
  draw = jax.random.randint(key, (n,), 0, t + 1, dtype=jnp.int32)  # uniform in [0, t]
  slot = jnp.where(t < capacity, t, draw)
  order = jnp.arange(n, dtype=jnp.int32)
  # the last image of the batch that lands in each slot (-1: none); slot == capacity is dropped
  last = jnp.full((capacity,), -1, jnp.int32).at[slot].max(order, mode='drop')
  kept = (slot < capacity) & (last[jnp.minimum(slot, capacity - 1)] == order)
  slots = jnp.where(kept, slot, capacity)
  imgs = quantize_uint8(images) if pool.quantized else images.astype(pool.images.dtype)
  if labels is None:
    labels = jnp.full((n,), -1, jnp.int32)
  pool = ImagePool(
    images=pool.images.at[slots].set(imgs, mode='drop'),
    labels=pool.labels.at[slots].set(jnp.asarray(labels, jnp.int32), mode='drop'),
    count=pool.count + n,
  )
  return pool, slots


def pool_size(pool: ImagePool) -> jnp.ndarray:
  return jnp.minimum(pool.count, pool.capacity)


def pool_gather(pool: ImagePool, idx: jnp.ndarray) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """Images (float32 in [0, 1]) and labels at `idx` (jittable)."""
  x = pool.images[idx]
  if pool.quantized:
    x = x.astype(jnp.float32) / 255.0
  return x, pool.labels[idx]


def pool_sample(pool: ImagePool, key: jax.Array, batch_size: int):
  """A uniform random batch (with replacement) from the filled part (jittable).

  Args:
    pool: The pool (at least one image added).
    key: PRNG key of the draw.
    batch_size: Number of images drawn.

  Returns:
    (images [batch_size, H, W, C] float32, labels [batch_size]).
  """
  idx = jax.random.randint(key, (batch_size,), 0, jnp.maximum(pool_size(pool), 1))
  return pool_gather(pool, idx)


def epoch_batches(pool: ImagePool, seed_or_rng, batch_size: int, drop_last: bool = False):
  """Host-side shuffled pass over the whole pool (DENSE's KD epoch): returns index array
  [num_batches, batch_size] and mask [num_batches, batch_size] (False = padding in the last batch),
  so a jitted scan / loop over batches keeps one shape.

  Args:
    pool: The pool.
    seed_or_rng: A seed, or a numpy Generator to draw the permutation from.
    batch_size: Images per batch.
    drop_last: Drop a last incomplete batch instead of padding it.

  Returns:
    (idx [num_batches, batch_size] int32, mask [num_batches, batch_size] bool).
  """
  n = int(pool_size(pool))
  rng = (
    seed_or_rng
    if isinstance(seed_or_rng, np.random.Generator)
    else np.random.default_rng(seed_or_rng)
  )
  perm = rng.permutation(n)
  nb = n // batch_size if drop_last else -(-n // batch_size)
  idx = np.zeros((nb * batch_size,), np.int32)
  mask = np.zeros((nb * batch_size,), bool)
  take = perm[: nb * batch_size]
  idx[: len(take)] = take
  mask[: len(take)] = True
  return idx.reshape(nb, batch_size), mask.reshape(nb, batch_size)


# ---------------------------------------------------------------------------------------------
# Augmentation (kornia RandomCrop(size, padding) + RandomHorizontalFlip, torchvision equivalents)
# ---------------------------------------------------------------------------------------------


def _crop(x: jnp.ndarray, oy: jnp.ndarray, ox: jnp.ndarray, padding: int) -> jnp.ndarray:
  b, h, w, c = x.shape
  xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  crop = lambda img, i, j: jax.lax.dynamic_slice(img, (i, j, 0), (h, w, c))
  return jax.vmap(crop)(xp, oy, ox)


def augment(
  key: jax.Array, x: jnp.ndarray, crop_padding: int = 4, flip: bool = True
) -> jnp.ndarray:
  """DENSE's synthesis view: RandomCrop(pad, zero fill) then RandomHorizontalFlip(0.5), per
  sample. One uniform draw supplies both crop offsets and the flip (each threefry call costs
  ~0.4 s of XLA:CPU compile time).

  Args:
    key: PRNG key of the view.
    x: Images [B, H, W, C].
    crop_padding: Zero padding of the random crop; 0 skips the crop.
    flip: Apply the random horizontal flip.

  Returns:
    The augmented images, shape of x.
  """
  u = jax.random.uniform(key, (3, x.shape[0]))
  if crop_padding > 0:
    n = 2 * crop_padding + 1
    off = jnp.minimum(jnp.floor(u[:2] * n), n - 1).astype(jnp.int32)
    x = _crop(x, off[0], off[1], crop_padding)
  if flip:
    x = jnp.where((u[2] < 0.5)[:, None, None, None], x[:, :, ::-1, :], x)
  return x
