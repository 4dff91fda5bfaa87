"""Data held out of every client, and public sets: the test split is for scoring only.

`dataset.holdout_size` moves that many samples of the TRAINING split (a seeded draw) out of the
clients' reach before the partition is drawn (`hold_out_train`); methods find them in
`dataset.holdout_x/holdout_y`. Whatever a server needs besides the clients' uploads (FedDF's
distillation and validation images, HFLDD's and FedSeq's public set, FedMD's public set,
FedTSA's diffusion-model training images) comes from there (`source='holdout'`) or from another
dataset's training split (`source=<dataset name>`, resized and channel-matched to the main
input shape). Every method is scored on the whole test split, which no method reads for
anything else; every method of a comparison sets the same `holdout_size`, so all their clients
hold the same samples.
"""

from typing import NamedTuple

import numpy as np

from jfed.data.datasets import Dataset, available_datasets, load_dataset
from jfed.data.transforms import match_input_shape
from jfed.errors import ConfigError

HOLDOUT = 'holdout'


def check_source(source: str, where: str) -> None:
  """Raises ConfigError unless `source` is 'holdout' or a dataset name `load_dataset` knows."""
  if source == HOLDOUT or source in available_datasets() or source.startswith('tfds:'):
    return
  raise ConfigError(
    f'{where} is {source!r}; valid: {HOLDOUT} (training samples held out of every client: '
    f'dataset.holdout_size), {", ".join(available_datasets())} or tfds:<name>'
  )


def holdout_size(config) -> int:
  """The run config's `dataset.holdout_size` (0 when unset)."""
  return int(config.dataset.get('holdout_size', 0) or 0)


def check_holdout_fits(config, source: str, size: int, where: str) -> None:
  """For a method's `validate`: raises ConfigError (before anything is written) when `source` is
  'holdout' and `dataset.holdout_size` holds fewer than `size` samples out; checks the source.

  Args:
    config: The run config (its `dataset.holdout_size` is read).
    source: The method's public-data source, e.g. 'holdout'.
    size: Number of samples the method will draw from the source.
    where: The config key being checked, named in the error.
  """
  check_source(source, where)
  held = holdout_size(config)
  if source == HOLDOUT and int(size) > held:
    raise ConfigError(
      f'{where}={source!r} needs {int(size)} training samples held out of the clients but '
      f'dataset.holdout_size is {held}; set --config.dataset.holdout_size={int(size)} (the same '
      'for every method of a comparison)'
    )


class PublicData(NamedTuple):
  """The public set and the test samples used for scoring (always the whole test split)."""

  x: np.ndarray  # [n_public, H, W, C] in the main dataset's input shape
  y: np.ndarray  # [n_public] labels of the public samples (in their own dataset)
  eval_x: np.ndarray
  eval_y: np.ndarray
  source: str


def hold_out_train(dataset: Dataset, size: int, seed: int) -> Dataset:
  """`dataset` with `size` seeded training samples moved into `holdout_x/holdout_y`.

  The clients are then partitioned from the remaining training samples; the test split is
  untouched.

  Args:
    dataset: The loaded dataset.
    size: Number of training samples to hold out.
    seed: Seed of the draw.

  Returns:
    A copy of `dataset` with `size` fewer training samples and those in `holdout_x/holdout_y`.

  Raises:
    ConfigError: `size` is not between 1 and half of the training split.
  """
  n, size = len(dataset.train_y), int(size)
  if not 0 < size <= n // 2:
    raise ConfigError(
      f'dataset.holdout_size={size}: the training samples held out of the clients must number '
      f'between 1 and half of the {n} training samples of {dataset.name}'
    )
  idx = np.sort(np.random.default_rng(seed).choice(n, size, replace=False))
  keep = np.setdiff1d(np.arange(n), idx)
  return dataset._replace(
    train_x=dataset.train_x[keep],
    train_y=dataset.train_y[keep],
    holdout_x=dataset.train_x[idx],
    holdout_y=dataset.train_y[idx],
  )


def holdout_sample(dataset: Dataset, size: int, seed: int, where: str):
  """(x, y): `size` of the held-out training samples (all of them when `size` is their number;
  otherwise a seeded draw).

  Args:
    dataset: A dataset with held-out samples (from `hold_out_train`).
    size: Number of held-out samples wanted.
    seed: Seed of the draw when `size` is smaller than the held-out set.
    where: The config key asking for them, named in the error.

  Returns:
    (x, y): `size` held-out images and their labels.

  Raises:
    ConfigError: fewer than `size` samples are held out (names `where` and the key to set).
  """
  n, size = (0 if dataset.holdout_y is None else len(dataset.holdout_y)), int(size)
  if not 0 < size <= n:
    raise ConfigError(
      f'{where}={size} but dataset.holdout_size holds {n} training samples out of the clients; '
      f'set dataset.holdout_size to at least {max(size, 1)}'
    )
  if size == n:
    return dataset.holdout_x, dataset.holdout_y
  idx = np.sort(np.random.default_rng(seed).choice(n, size, replace=False))
  return dataset.holdout_x[idx], dataset.holdout_y[idx]


def public_data(dataset: Dataset, source: str, size: int, seed: int) -> PublicData:
  """Samples the public set.

  Args:
    dataset: the main (client) dataset, after `hold_out_train`.
    source: 'holdout' or the name of another dataset (see the module docstring).
    size: number of public samples.
    seed: seed of the sample (`np.random.default_rng(seed)`).

  Returns:
    The public samples and the test split to score on.

  Raises:
    ConfigError: `size` does not fit the source.
  """
  check_source(source, 'the public source')
  size = int(size)
  if source == HOLDOUT:
    x, y = holdout_sample(dataset, size, seed, 'public_size')
    return PublicData(x, y, dataset.test_x, dataset.test_y, source)
  other = load_dataset(source)
  if not 0 < size <= len(other.train_y):
    raise ConfigError(f'public_size={size} but {source} has {len(other.train_y)} training samples')
  idx = np.sort(np.random.default_rng(seed).choice(len(other.train_y), size, replace=False))
  return PublicData(
    match_input_shape(other.train_x[idx], dataset.input_shape),
    other.train_y[idx],
    dataset.test_x,
    dataset.test_y,
    source,
  )
