"""A public dataset that the server and every client can see (HFLDD, FedSeq).

`source='test_split'` holds `size` samples out of the main dataset's test split (seeded); they
are then excluded from evaluation, so methods evaluate on the rest. A comparison that scores
every method on the same test samples sets `dataset.test_holdout` instead: the driver holds
that many test samples out for every method (`hold_out_test`, the same seeded draw), and a
'test_split' public set is then taken from them. Any other source is a dataset name (e.g.
'fashion_mnist', HFLDD's public set for MNIST clients): `size` samples of its training split,
resized (bilinear) and channel-matched to the main dataset's input shape; evaluation then uses
the test split (less any `dataset.test_holdout`).
"""

from typing import NamedTuple

import numpy as np

from jfed.data.datasets import Dataset, available_datasets, load_dataset
from jfed.data.transforms import match_input_shape
from jfed.errors import ConfigError

TEST_SPLIT = 'test_split'


def check_source(source: str, where: str) -> None:
  """Raises ConfigError unless `source` is 'test_split' or a dataset name `load_dataset` knows."""
  if source == TEST_SPLIT or source in available_datasets() or source.startswith('tfds:'):
    return
  raise ConfigError(
    f'{where} is {source!r}; valid: {TEST_SPLIT}, {", ".join(available_datasets())} or tfds:<name>'
  )


class PublicData(NamedTuple):
  """The public set and the test samples left for evaluation."""

  x: np.ndarray  # [n_public, H, W, C] in the main dataset's input shape
  y: np.ndarray  # [n_public] labels of the public samples (in their own dataset)
  eval_x: np.ndarray  # the test samples used for evaluation
  eval_y: np.ndarray
  source: str


def _held_out_indices(n: int, size: int, seed: int, where: str):
  if not 0 < size <= n // 2:
    raise ConfigError(
      f'{where}={size}: samples held out of the test split must number between 1 and half '
      f'of its {n} samples; set {where} accordingly.'
    )
  idx = np.sort(np.random.default_rng(seed).choice(n, size, replace=False))
  return idx, np.setdiff1d(np.arange(n), idx)


def hold_out_test(dataset: Dataset, size: int, seed: int) -> Dataset:
  """`dataset` with `size` seeded test samples moved out of evaluation into `holdout_x/y`.

  The draw is the one `public_data(..., 'test_split', size, seed)` makes, so a public set of
  the same size is the same samples, and every method of a comparison evaluates on the rest.

  Raises:
    ConfigError: `size` is not between 1 and half of the test split.
  """
  idx, keep = _held_out_indices(len(dataset.test_y), int(size), seed, 'dataset.test_holdout')
  return dataset._replace(
    test_x=dataset.test_x[keep],
    test_y=dataset.test_y[keep],
    holdout_x=dataset.test_x[idx],
    holdout_y=dataset.test_y[idx],
  )


def public_data(dataset: Dataset, source: str, size: int, seed: int) -> PublicData:
  """Samples the public set.

  Args:
    dataset: the main (client) dataset.
    source: 'test_split' or the name of another dataset (see the module docstring).
    size: number of public samples.
    seed: seed of the sample (`np.random.default_rng(seed)`).

  Returns:
    The public samples and the test samples to evaluate on.

  Raises:
    ConfigError: `size` does not fit the source.
  """
  rng = np.random.default_rng(seed)
  size = int(size)
  if source == TEST_SPLIT and dataset.holdout_x is not None:  # the driver held them out
    n = len(dataset.holdout_y)
    if not 0 < size <= n:
      raise ConfigError(
        f'public_size={size} but dataset.test_holdout holds {n} test samples out; set '
        'public_size to at most dataset.test_holdout.'
      )
    idx = np.arange(n) if size == n else np.sort(rng.choice(n, size, replace=False))
    return PublicData(
      dataset.holdout_x[idx], dataset.holdout_y[idx], dataset.test_x, dataset.test_y, source
    )
  if source == TEST_SPLIT:
    idx, keep = _held_out_indices(len(dataset.test_y), size, seed, 'public_size')
    return PublicData(
      dataset.test_x[idx], dataset.test_y[idx], dataset.test_x[keep], dataset.test_y[keep], source
    )
  other = load_dataset(source)
  if not 0 < size <= len(other.train_y):
    raise ConfigError(f'public_size={size} but {source} has {len(other.train_y)} training samples')
  idx = np.sort(rng.choice(len(other.train_y), size, replace=False))
  return PublicData(
    match_input_shape(other.train_x[idx], dataset.input_shape),
    other.train_y[idx],
    dataset.test_x,
    dataset.test_y,
    source,
  )
