"""Client datasets stacked into fixed-shape, zero-padded arrays.

Clients hold different numbers of samples, but `jax.vmap` / sharding over clients needs one
array with a leading client axis. `federate` pads every client to the same length n_max and
records the true sizes; `mask` then tells training code (and the masked BatchNorm) which
entries are real, so a padded client trains exactly as on its own samples.

Memory: the stacked images take m * n_max / N times the memory of the training set, i.e.
more than the data itself when the partition is very unbalanced.
"""

from typing import NamedTuple, Sequence

import numpy as np


class FederatedArrays(NamedTuple):
  """Per-client data with a leading client axis.

  Attributes:
    x: [m, n_max, ...] inputs (dtype of the source), zero beyond each client's size.
    y: [m, n_max] int32 labels, zero beyond each client's size.
    sizes: [m] int32 true sizes: sample i of client k is real iff i < sizes[k].
  """

  x: np.ndarray
  y: np.ndarray
  sizes: np.ndarray

  @property
  def num_clients(self) -> int:
    return int(self.sizes.shape[0])

  @property
  def mask(self) -> np.ndarray:
    """[m, n_max] bool, True on real samples."""
    return np.arange(self.y.shape[1])[None, :] < np.asarray(self.sizes)[:, None]

  def client(self, k: int):
    """The real (unpadded) (x, y) of client k."""
    n = int(self.sizes[k])
    return self.x[k, :n], self.y[k, :n]


def federate(
  x: np.ndarray, y: np.ndarray, parts: Sequence, pad_to_multiple: int = 1
) -> FederatedArrays:
  """Gathers each client's samples (x[parts[k]], y[parts[k]]) into zero-padded arrays.

  Args:
    x: [N, ...] inputs of the whole training set.
    y: [N] labels.
    parts: one index array per client (e.g. from `jfed.data.partitions`).
    pad_to_multiple: n_max is rounded up to a multiple of this, e.g. the batch size, so
      that every client splits into whole batches.

  Returns:
    FederatedArrays with x of x's dtype, y int32 and sizes int32.
  """
  if pad_to_multiple < 1:
    raise ValueError(f'pad_to_multiple must be >= 1, got {pad_to_multiple}.')
  x, y = np.asarray(x), np.asarray(y)
  if len(x) != len(y):
    raise ValueError(f'x and y differ in length: {len(x)} vs {len(y)}.')
  parts = [np.asarray(p, dtype=np.int64) for p in parts]
  if not parts:
    raise ValueError('parts is empty: need at least one client.')
  for k, p in enumerate(parts):
    if p.ndim != 1 or (p.size and (p.min() < 0 or p.max() >= len(x))):
      raise ValueError(f'parts[{k}] must be a 1-D array of indices in [0, {len(x)}).')
  sizes = np.array([len(p) for p in parts], dtype=np.int32)
  n_max = -(-int(sizes.max()) // pad_to_multiple) * pad_to_multiple
  fx = np.zeros((len(parts), n_max) + x.shape[1:], dtype=x.dtype)
  fy = np.zeros((len(parts), n_max), dtype=np.int32)
  for k, p in enumerate(parts):
    fx[k, : len(p)] = x[p]
    fy[k, : len(p)] = y[p]
  return FederatedArrays(fx, fy, sizes)
