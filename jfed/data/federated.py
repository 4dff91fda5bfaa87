"""Client datasets stacked into fixed-shape, zero-padded arrays.

Clients hold different numbers of samples, but `jax.vmap` / sharding over clients needs one
array with a leading client axis. `federate` pads every client to the same length n_max and
records the true sizes; `mask` then tells training code (and the masked BatchNorm) which
entries are real, so a padded client trains exactly as on its own samples.

Memory: the padded images take m * n_max / N times the memory of the training set, more than
the data itself when the partition is unbalanced. So `federate` keeps only the clients' index
lists into the (shared, uncopied) training arrays and pads on first use of `x` / `y`; a round
that trains a cohort takes just its rows (`take`), padded to the cohort's own largest client
(`cohort_length`), and never builds the whole federation's padded arrays.
"""

from typing import Optional, Sequence

import numpy as np


class FederatedArrays:
  """Per-client data with a leading client axis.

  Built eagerly from padded arrays (`FederatedArrays(x, y, sizes)`) or lazily by `federate`
  (index lists into the training arrays, padded on first use of `x` or `y`).

  Attributes:
    x: [m, n_max, ...] inputs (dtype of the source), zero beyond each client's size.
    y: [m, n_max] int32 labels, zero beyond each client's size.
    sizes: [m] int32 true sizes: sample i of client k is real iff i < sizes[k].
  """

  def __init__(self, x, y, sizes, *, source=None):
    self._x, self._y, self.sizes = x, y, sizes
    # (train_x, train_y, index [total], offsets [m + 1], n_max): the lazy form's recipe
    self._source = source

  @classmethod
  def gathered(
    cls, x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], n_max: int
  ) -> 'FederatedArrays':
    """The lazy form: client k holds x[parts[k]], y[parts[k]], padded to n_max on first use.

    Args:
      x: [N, ...] inputs, kept by reference (not copied).
      y: [N] labels, kept by reference.
      parts: one index array per client.
      n_max: the padded length of every client (>= the largest part).

    Returns:
      The federation, holding only the concatenated index lists and their offsets.
    """
    sizes = np.array([len(p) for p in parts], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    index = np.concatenate(parts) if len(parts) else np.zeros(0, np.int64)
    labels = np.asarray(y, np.int32)  # as the padded form holds them (a copy only if not int32)
    return cls(None, None, sizes, source=(x, labels, index, offsets, int(n_max)))

  @property
  def x(self):
    if self._x is None and self._source is not None:
      self._x = self._padded(self._source[0], range(self.num_clients), self.n_max)
    return self._x

  @property
  def y(self):
    if self._y is None and self._source is not None:
      self._y = self._padded(self._source[1], range(self.num_clients), self.n_max)
    return self._y

  @property
  def n_max(self) -> int:
    """The padded length of every client (the second axis of `x` and `y`)."""
    return self._source[4] if self._y is None and self._source is not None else self.y.shape[1]

  def _padded(self, source: np.ndarray, rows, length: int) -> np.ndarray:
    _, _, index, offsets, _ = self._source
    source = np.asarray(source)
    out = np.zeros((len(rows), length) + source.shape[1:], source.dtype)
    for j, k in enumerate(rows):
      picked = index[offsets[k] : offsets[k + 1]]
      out[j, : len(picked)] = source[picked]
    return out

  @property
  def num_clients(self) -> int:
    return int(self.sizes.shape[0])

  @property
  def mask(self) -> np.ndarray:
    """[m, n_max] bool, True on real samples."""
    return np.arange(self.n_max)[None, :] < np.asarray(self.sizes)[:, None]

  def client(self, k: int):
    """The real (unpadded) (x, y) of client k."""
    n = int(self.sizes[k])
    if self._x is None and self._source is not None:
      x, y, index, offsets, _ = self._source
      picked = index[offsets[k] : offsets[k] + n]
      return np.asarray(x)[picked], y[picked]
    return self.x[k, :n], self.y[k, :n]

  def take(self, rows: Sequence[int], length: Optional[int] = None) -> 'FederatedArrays':
    """The clients `rows` alone, padded to `length` (default: this federation's n_max); the
    lazy form gathers only their samples."""
    rows = np.asarray(rows, np.int64)
    length = self.n_max if length is None else int(length)
    sizes = np.asarray(self.sizes)[rows]
    if self._x is None and self._source is not None:
      x = self._padded(self._source[0], rows, length)
      y = self._padded(self._source[1], rows, length)
      return FederatedArrays(x, y, sizes)
    pad = [(0, 0), (0, length - self.n_max)]
    x, y = self.x[rows], self.y[rows]
    if length != self.n_max:
      x = np.pad(x, pad + [(0, 0)] * (x.ndim - 2)) if length > self.n_max else x[:, :length]
      y = np.pad(y, pad + [(0, 0)] * (y.ndim - 2)) if length > self.n_max else y[:, :length]
    return FederatedArrays(x, y, sizes)

  def _replace(self, **fields) -> 'FederatedArrays':
    """A copy with `x`, `y` or `sizes` replaced (the NamedTuple method it stood in for)."""
    unknown = set(fields) - {'x', 'y', 'sizes'}
    if unknown:
      raise ValueError(f'FederatedArrays has no fields {sorted(unknown)}')
    if set(fields) <= {'sizes'} and self._x is None and self._source is not None:
      return FederatedArrays(None, None, fields['sizes'], source=self._source)
    return FederatedArrays(
      fields.get('x', self.x), fields.get('y', self.y), fields.get('sizes', self.sizes)
    )

  def __repr__(self) -> str:
    form = 'lazy' if self._x is None and self._source is not None else 'padded'
    return f'FederatedArrays({self.num_clients} clients, n_max {self.n_max}, {form})'


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
    FederatedArrays with x of x's dtype, y int32 and sizes int32 (index lists into `x` and `y`
    until its padded arrays are first used).
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
  n_max = -(-max(len(p) for p in parts) // pad_to_multiple) * pad_to_multiple
  return FederatedArrays.gathered(x, y, parts, n_max)


def cohort_length(sizes: np.ndarray, batch_size: int, full_length: int) -> int:
  """The padded length of a cohort whose clients hold `sizes` samples, of a federation padded
  to `full_length`: whole batches of its largest client rounded up to a power of two (so a run
  compiles a few shapes), or `full_length` unless that is at least twice as long (so a small
  federation keeps one shape for every round). Padding never changes what a client computes.

  Args:
    sizes: the cohort's client sizes.
    batch_size: the local batch size.
    full_length: the whole federation's padded length, in whole batches.

  Returns:
    The cohort's padded length.
  """
  batches = -(-max(int(np.max(sizes, initial=0)), 1) // batch_size)
  bucket = (1 << (batches - 1).bit_length()) * batch_size
  return bucket if 2 * bucket <= full_length else full_length
