"""Array transforms: one dataset standing in for another (public / distillation data), and the
run's own resizing and input normalisation (`dataset.image_size`, `dataset.normalization`)."""

import functools
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed.data.datasets import Dataset, load_dataset

# The input normalisation a classifier applies first, as (mean, std) over every channel: the
# data and every generated image stay in [0, 1]. 'half' is torchvision's
# `Normalize((0.5,), (0.5,))` of Co-Boosting's and FedCVAE's loaders: inputs in [-1, 1].
NORMALIZATIONS: Dict[str, Optional[Tuple[float, float]]] = {'none': None, 'half': (0.5, 0.5)}

# Images resized per call: bounds the memory of a split's float copy on the way through.
_RESIZE_CHUNK = 8192


def _resize(x: np.ndarray, h: int, w: int) -> np.ndarray:
  """NHWC images resized bilinearly with half-pixel centres and antialiasing (torchvision's
  `Resize` on tensors, `antialias=True`), chunked over the batch."""
  if x.shape[1:3] == (h, w):
    return np.asarray(x, np.float32)
  parts = [
    np.asarray(
      jax.image.resize(
        jnp.asarray(x[i : i + _RESIZE_CHUNK], jnp.float32),
        (min(_RESIZE_CHUNK, len(x) - i), h, w, x.shape[3]),
        'linear',
        antialias=True,
      )
    )
    for i in range(0, len(x), _RESIZE_CHUNK)
  ]
  return np.concatenate(parts) if parts else np.zeros((0, h, w, x.shape[3]), np.float32)


def match_input_shape(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
  """Resizes NHWC images to (H, W) bilinearly and matches the channel count (mean / repeat)."""
  h, w, c = shape
  x = _resize(np.asarray(x, np.float32), h, w)
  if x.shape[3] != c:
    x = x.mean(-1, keepdims=True)
    x = np.repeat(x, c, axis=-1) if c > 1 else x
  return np.clip(x, 0.0, 1.0).astype(np.float32)


def configure(dataset: Dataset, image_size: int = 0, normalization: str = 'none') -> Dataset:
  """`dataset` with every split resized and the input normalisation its classifiers apply
  recorded; the values stay in [0, 1].

  Args:
    dataset: the loaded dataset (its held-out split, if any, is resized too).
    image_size: the side of the square images; 0 keeps the dataset's size.
    normalization: a key of `NORMALIZATIONS`.

  Returns:
    The dataset with read-only resized arrays (the same arrays when no resize is needed).

  Raises:
    ValueError: a negative size or an unknown normalisation.
  """
  if image_size < 0:
    raise ValueError(f'dataset.image_size must be >= 0 (0: the native size), got {image_size}')
  if normalization not in NORMALIZATIONS:
    raise ValueError(
      f'dataset.normalization must be one of {", ".join(NORMALIZATIONS)}, got {normalization!r}'
    )
  if image_size and dataset.input_shape[:2] != (image_size, image_size):

    def resized(x):
      if x is None:
        return None
      out = np.clip(_resize(x, image_size, image_size), 0.0, 1.0)
      out.flags.writeable = False  # shared through the cache, as `load_dataset`'s arrays
      return out

    dataset = dataset._replace(
      train_x=resized(dataset.train_x),
      test_x=resized(dataset.test_x),
      holdout_x=resized(dataset.holdout_x),
    )
  return dataset._replace(normalization=normalization)


@functools.lru_cache(maxsize=4)
def load_configured(
  name: str, data_dir: Optional[str] = None, image_size: int = 0, normalization: str = 'none'
) -> Dataset:
  """`load_dataset(name, data_dir)` through `configure`; cached, as `load_dataset` is.

  Args:
    name: the dataset's name (`jfed.data.load_dataset`).
    data_dir: where its files are; None searches the defaults.
    image_size: `configure`'s.
    normalization: `configure`'s.

  Returns:
    The configured dataset.
  """
  return configure(load_dataset(name, data_dir), image_size, normalization)
