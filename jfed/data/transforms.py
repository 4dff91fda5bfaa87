"""Array transforms that let one dataset stand in for another (public / distillation data)."""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def match_input_shape(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
  """Resizes NHWC images to (H, W) bilinearly and matches the channel count (mean / repeat)."""
  h, w, c = shape
  x = np.asarray(x, np.float32)
  if x.shape[1:3] != (h, w):
    x = np.asarray(
      jax.image.resize(jnp.asarray(x), (x.shape[0], h, w, x.shape[3]), 'linear', antialias=True)
    )
  if x.shape[3] != c:
    x = x.mean(-1, keepdims=True)
    x = np.repeat(x, c, axis=-1) if c > 1 else x
  return np.clip(x, 0.0, 1.0).astype(np.float32)
