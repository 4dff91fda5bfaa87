"""A public dataset that the server and every client can see (HFLDD, FedSeq).

`source='test_split'` holds `size` samples out of the main dataset's test split (seeded); they
are then excluded from evaluation, so methods evaluate on the rest. Any other source is a
dataset name (e.g. 'fashion_mnist', HFLDD's public set for MNIST clients): `size` samples of
its training split, resized (bilinear) and channel-matched to the main dataset's input shape;
evaluation then uses the full test split.
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
  if source == TEST_SPLIT:
    n = len(dataset.test_y)
    if not 0 < size <= n // 2:
      raise ConfigError(
        f'public_size={size}: a public set held out of the test split must hold '
        f'between 1 and half of its {n} samples; set public_size accordingly.'
      )
    idx = np.sort(rng.choice(n, size, replace=False))
    keep = np.setdiff1d(np.arange(n), idx)
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
