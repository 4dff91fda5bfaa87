"""Tests for jfed.data: loaders, partitions, padded federated arrays and the bubble plot."""

import errno
import gzip
import os
import pathlib
import re
import struct

import numpy as np
import pytest

from jfed import data
from jfed.data import datasets, partitions
from jfed.errors import DataError, WorkdirError
from tests.support import needs_fashion_mnist

# NumPy dtype -> IDX type byte (the inverse of datasets._IDX_DTYPES).
IDX_TYPE_BYTES = {
  'uint8': 0x08,
  'int8': 0x09,
  'int16': 0x0B,
  'int32': 0x0C,
  'float32': 0x0D,
  'float64': 0x0E,
}


def write_idx(path, array, compress=True, dtype=np.uint8):
  """Writes `array` as an IDX file of `dtype`: the format the MNIST-family loaders read."""
  array = np.asarray(array, dtype=dtype)
  header = bytes([0, 0, IDX_TYPE_BYTES[array.dtype.name], array.ndim]) + struct.pack(
    f'>{array.ndim}I', *array.shape
  )
  opener = gzip.open if compress else open
  with opener(path, 'wb') as f:
    f.write(header + array.astype(array.dtype.newbyteorder('>')).tobytes())


def write_fake_mnist(directory, n_train=12, n_test=6, compress=True, prefix=''):
  """A tiny MNIST-layout directory; returns the raw (uint8) arrays written."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  arrays = {
    'train-images-idx3-ubyte': rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
    'train-labels-idx1-ubyte': (np.arange(n_train) % 10).astype(np.uint8),
    't10k-images-idx3-ubyte': rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
    't10k-labels-idx1-ubyte': (np.arange(n_test) % 10).astype(np.uint8),
  }
  for stem, array in arrays.items():
    write_idx(directory / (prefix + stem + ('.gz' if compress else '')), array, compress)
  return arrays


@pytest.fixture(scope='module')
def digits():
  return data.load_dataset('digits')


@pytest.fixture(scope='module')
def labels():
  """Label vector with 10 balanced classes, 3000 samples: big enough for every scheme."""
  return np.random.default_rng(1).permutation(np.repeat(np.arange(10), 300))


# ----------------------------------------------------------------------------- datasets


def test_digits_shapes_and_range(digits):
  assert digits.name == 'digits'
  assert digits.train_x.shape == (1437, 8, 8, 1) and digits.test_x.shape == (360, 8, 8, 1)
  assert digits.input_shape == (8, 8, 1)
  assert digits.train_x.dtype == np.float32 and digits.train_y.dtype == np.int32
  assert digits.train_x.min() >= 0.0 and digits.train_x.max() == 1.0
  assert digits.num_classes == 10
  assert set(np.unique(digits.test_y)) == set(range(10))
  # Deterministic split and cached (the same object comes back).
  assert data.load_dataset('digits') is digits


def test_cached_arrays_are_read_only(digits):
  with pytest.raises(ValueError):
    digits.train_x[0, 0, 0, 0] = 5.0


@pytest.mark.parametrize('compress', [True, False])
def test_idx_round_trip(tmp_path, compress):
  array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  path = tmp_path / ('a.idx.gz' if compress else 'a.idx')
  write_idx(path, array, compress=compress)
  np.testing.assert_array_equal(data.read_idx(path), array)


def test_idx_rejects_garbage(tmp_path):
  path = tmp_path / 'bad'
  path.write_bytes(b'\x01\x02\x03\x04junk')
  with pytest.raises(DataError, match='not an IDX') as info:
    data.read_idx(path)
  assert str(path) in str(info.value) and isinstance(info.value, ValueError)


def test_idx_typed_round_trip(tmp_path):
  array = np.array([[-1.5, 0.0], [2.0, 255.0]], dtype=np.float32)
  write_idx(tmp_path / 'f.gz', array, dtype=np.float32)
  np.testing.assert_array_equal(data.read_idx(tmp_path / 'f.gz'), array)


def test_idx_truncated_gzip_names_the_file(tmp_path):
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  write_idx(path, np.zeros((20, 28, 28)))
  path.write_bytes(path.read_bytes()[:-30])
  with pytest.raises(DataError, match='truncated or corrupt gzip') as info:
    data.read_idx(path)
  assert str(path) in str(info.value)


def test_idx_corrupt_gzip_names_the_file(tmp_path):
  path = tmp_path / 'labels.gz'
  write_idx(path, np.arange(100) % 10)
  raw = bytearray(path.read_bytes())
  raw[12:40] = b'\xff' * 28  # Garbage in the deflate stream.
  path.write_bytes(bytes(raw))
  with pytest.raises(DataError, match='gzip') as info:
    data.read_idx(path)
  assert str(path) in str(info.value)


def test_idx_short_file_names_the_file(tmp_path):
  path = tmp_path / 'short'
  write_idx(path, np.zeros((4, 3, 3)), compress=False)
  path.write_bytes(path.read_bytes()[:-5])
  with pytest.raises(DataError, match='data bytes') as info:
    data.read_idx(path)
  assert str(path) in str(info.value)


def test_truncated_dataset_file_is_a_data_error(tmp_path):
  write_fake_mnist(tmp_path)
  path = tmp_path / 't10k-images-idx3-ubyte.gz'
  path.write_bytes(path.read_bytes()[:100])
  with pytest.raises(DataError) as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert str(path) in str(info.value)
  assert not isinstance(info.value, EOFError)


@pytest.mark.parametrize(
  'name,bad_labels,match',
  [
    ('mnist', np.array([0, 1, 10, 3], np.uint8), r'1 labels are not in \[0, 10\)'),
    ('fashion_mnist', np.array([0, 255, 254, 3], np.uint8), r'2 labels are not in \[0, 10\)'),
    ('kmnist', np.array([0, -1, 2, 3], np.int8), r'in \[0, 10\)'),
    ('emnist', np.array([0, -3, 2, 3], np.int8), '>= 0'),
  ],
)
def test_labels_outside_class_range_name_the_file(tmp_path, name, bad_labels, match):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  path = tmp_path / 'train-labels-idx1-ubyte.gz'
  write_idx(path, bad_labels, dtype=bad_labels.dtype)
  with pytest.raises(DataError, match=match) as info:
    data.load_dataset(name, data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_emnist_class_count_is_max_label_plus_one(tmp_path):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  write_idx(tmp_path / 't10k-labels-idx1-ubyte.gz', [1, 26, 3, 4])
  assert data.load_dataset('emnist', data_dir=str(tmp_path)).num_classes == 27


def test_float_labels_are_rejected(tmp_path):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  path = tmp_path / 'train-labels-idx1-ubyte.gz'
  write_idx(path, [0.0, 1.0, 2.0, 3.0], dtype=np.float32)
  with pytest.raises(DataError, match='integers') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


@pytest.mark.parametrize(
  'value,match',
  [
    (300.0, r'span \[0.0, 300.0\]'),
    (-0.5, r'span \[-0.5'),
    (np.nan, 'NaN or infinite'),
    (np.inf, 'NaN or infinite'),
  ],
)
def test_float_images_must_be_pixel_values(tmp_path, value, match):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  images = np.zeros((4, 28, 28), np.float32)
  images[2, 5, 5] = value
  path = tmp_path / 't10k-images-idx3-ubyte.gz'
  write_idx(path, images, dtype=np.float32)
  with pytest.raises(DataError, match=match) as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_float_images_in_pixel_range_load(tmp_path):
  raw = write_fake_mnist(tmp_path, n_train=4, n_test=4)
  write_idx(
    tmp_path / 'train-images-idx3-ubyte.gz', raw['train-images-idx3-ubyte'], dtype=np.float64
  )
  ds = data.load_dataset('mnist', data_dir=str(tmp_path))
  np.testing.assert_allclose(ds.train_x[..., 0] * 255, raw['train-images-idx3-ubyte'], atol=1e-3)


def test_images_labels_length_mismatch(tmp_path):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  write_idx(tmp_path / 'train-labels-idx1-ubyte.gz', [0, 1, 2])
  with pytest.raises(DataError, match='differ in length') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert 'train-labels-idx1-ubyte.gz' in str(info.value)


def test_idx_dataset_from_data_dir(tmp_path):
  raw = write_fake_mnist(tmp_path / 'mnist', compress=False)
  for data_dir in (tmp_path / 'mnist', tmp_path):  # The directory itself or its parent.
    ds = data.load_dataset('mnist', data_dir=str(data_dir))
    assert ds.train_x.shape == (12, 28, 28, 1) and ds.test_x.shape == (6, 28, 28, 1)
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int32
    np.testing.assert_allclose(ds.train_x[..., 0] * 255, raw['train-images-idx3-ubyte'], atol=1e-3)
    np.testing.assert_array_equal(ds.test_y, raw['t10k-labels-idx1-ubyte'])
    assert ds.num_classes == 10


def test_idx_dataset_from_env_var(tmp_path, monkeypatch):
  write_fake_mnist(tmp_path / 'kmnist')
  monkeypatch.setenv(datasets.DATA_DIR_ENV, str(tmp_path))
  assert data.load_dataset('kmnist').train_x.shape == (12, 28, 28, 1)


def test_emnist_is_transposed_back(tmp_path):
  raw = write_fake_mnist(tmp_path, prefix='emnist-balanced-')
  ds = data.load_dataset('emnist', data_dir=str(tmp_path))
  expected = np.swapaxes(raw['train-images-idx3-ubyte'], 1, 2)
  np.testing.assert_allclose(ds.train_x[..., 0] * 255, expected, atol=1e-3)


@needs_fashion_mnist
def test_fashion_mnist_loads():
  ds = data.load_dataset('fashion_mnist')
  assert ds.train_x.shape == (60000, 28, 28, 1) and ds.test_x.shape == (10000, 28, 28, 1)
  assert ds.train_y.shape == (60000,) and ds.test_y.shape == (10000,)
  assert ds.num_classes == 10 and ds.input_shape == (28, 28, 1)
  assert 0.0 <= ds.train_x.min() and ds.train_x.max() <= 1.0
  np.testing.assert_array_equal(np.bincount(ds.train_y), np.full(10, 6000))


def test_missing_dataset_says_how_to_get_it(tmp_path):
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load_dataset('fashion_mnist', data_dir=str(tmp_path))
  message = str(info.value)
  assert 'apt-get install dataset-fashion-mnist' in message
  assert 'train-images-idx3-ubyte.gz' in message and 'tfds:fashion_mnist' in message
  assert isinstance(info.value, FileNotFoundError)
  with pytest.raises(data.DatasetNotFoundError, match='yann.lecun.com'):
    data.load_dataset('mnist', data_dir=str(tmp_path))


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError) as info:
    data.load_dataset('cifar11')
  for name in data.available_datasets():
    assert name in str(info.value)
  assert 'tfds:' in str(info.value)


def test_tfds_not_prepared(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  with pytest.raises(data.DatasetNotFoundError, match='array_record'):
    data.load_dataset('tfds:mnist', data_dir=str(tmp_path))


def test_tfds_mock_data_source():
  """`tfds.testing.mock_data` also mocks `tfds.data_source`: the whole path runs offline."""
  tfds = pytest.importorskip('tensorflow_datasets')
  datasets._load_tfds.cache_clear()
  try:
    with tfds.testing.mock_data(num_examples=7):
      ds = data.load_dataset('tfds:cifar10')
    assert ds.name == 'tfds:cifar10'
    assert ds.train_x.shape == (7, 32, 32, 3) and ds.test_x.shape == (7, 32, 32, 3)
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int32
    assert 0.0 <= ds.train_x.min() and ds.train_x.max() <= 1.0
    assert ds.num_classes == 10 and ds.input_shape == (32, 32, 3)
  finally:
    datasets._load_tfds.cache_clear()  # Keep mocked data out of the process-wide cache.


# --------------------------------------------------------------------------- partitions


def assert_disjoint(parts, n):
  flat = np.concatenate(parts)
  assert flat.dtype == np.int64
  assert len(np.unique(flat)) == len(flat), 'a sample is given to two clients'
  assert flat.min() >= 0 and flat.max() < n


def mean_entropy(labels, parts, num_classes=10):
  table = partitions.class_count_table(labels, parts, num_classes).astype(np.float64)
  p = table / table.sum(axis=1, keepdims=True)
  plogp = p * np.log(np.where(p > 0, p, 1.0))  # 0 log 0 = 0.
  return float(np.mean(-plogp.sum(axis=1)))


SCHEME_KWARGS = [
  ('iid', {}, 7),
  ('dirichlet', {'alpha': 0.5}, 7),
  ('shards', {'k': 2}, 7),
  ('disjoint', {}, 5),
  ('feddf_dirichlet', {'alpha': 0.5}, 12),
  ('fedcvae_dirichlet', {'alpha': 0.5}, 7),
]


@pytest.mark.parametrize('scheme,kw,m', SCHEME_KWARGS)
def test_every_scheme_disjoint_and_seeded(labels, scheme, kw, m):
  parts = data.make_partition(labels, m, scheme, seed=3, **kw)
  assert len(parts) == m
  assert_disjoint(parts, len(labels))
  again = data.make_partition(labels, m, scheme, seed=3, **kw)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))


# FedDF drops the N mod n tail; shards drop classes nobody owns (tested separately).
@pytest.mark.parametrize(
  'scheme,kw,m', [s for s in SCHEME_KWARGS if s[0] not in ('feddf_dirichlet', 'shards')]
)
def test_schemes_cover_all_samples(labels, scheme, kw, m):
  parts = data.make_partition(labels, m, scheme, seed=0, **kw)
  assert sum(len(p) for p in parts) == len(labels)


def test_iid_balanced(labels):
  parts = data.partition_iid(labels, 7, seed=0)
  sizes = [len(p) for p in parts]
  assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(labels)


def test_dirichlet_min_size_and_seed(labels):
  parts = data.partition_dirichlet(labels, 10, alpha=0.1, seed=0)
  assert min(len(p) for p in parts) >= 10
  same = data.partition_dirichlet(labels, 10, alpha=0.1, seed=0)
  other = data.partition_dirichlet(labels, 10, alpha=0.1, seed=1)
  assert all(np.array_equal(a, b) for a, b in zip(parts, same))
  assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
  assert min(len(p) for p in data.partition_dirichlet(labels, 5, 0.1, 0, min_size=100)) >= 100


def test_dirichlet_small_alpha_more_skewed(labels):
  skewed = np.mean(
    [mean_entropy(labels, data.partition_dirichlet(labels, 10, 0.05, s)) for s in range(3)]
  )
  mild = np.mean(
    [mean_entropy(labels, data.partition_dirichlet(labels, 10, 100.0, s)) for s in range(3)]
  )
  assert skewed < mild - 1.0
  assert mild > 0.95 * np.log(10)  # Large alpha approaches IID.


@pytest.mark.parametrize('k', [1, 2])
def test_shards_k_classes_per_client(labels, k):
  parts = data.partition_shards_k(labels, 10, k=k, seed=0)
  table = data.class_count_table(labels, parts, 10)
  np.testing.assert_array_equal((table > 0).sum(axis=1), np.full(10, k))
  # Client i always owns class i mod C.
  assert all(table[i, i % 10] > 0 for i in range(10))


def test_shards_unowned_classes_are_dropped(labels):
  parts = data.partition_shards_k(labels, 3, k=1, seed=0)  # Classes 3..9 have no owner.
  table = data.class_count_table(labels, parts, 10)
  np.testing.assert_array_equal(table.sum(axis=0), [300] * 3 + [0] * 7)


def test_unassigned_count(labels):
  n = len(labels)
  assert partitions.unassigned_count(data.partition_iid(labels, 7, seed=0), n) == 0
  # Three clients of one class each: classes 3..9 (7 x 300 samples) have no owner.
  assert partitions.unassigned_count(data.partition_shards_k(labels, 3, k=1, seed=0), n) == 2100
  # The brief's case: k=2 on 5 clients of 10 classes leaves whole classes out.
  parts = data.partition_shards_k(labels, 5, k=2, seed=0)
  dropped = partitions.unassigned_count(parts, n)
  assert dropped == n - sum(len(p) for p in parts) and dropped % 300 == 0 and dropped > 0
  assert partitions.unassigned_count(data.partition_feddf_dirichlet(labels, 13, 0.5, 0), n) == (
    n % 13
  )
  assert partitions.unassigned_count([np.array([0, 1]), np.array([1, 2])], 5) == 2
  assert partitions.unassigned_count([], 4) == 4
  with pytest.raises(data.PartitionError, match=r'parts\[1\]'):
    partitions.unassigned_count([np.array([0]), np.array([5])], 5)


def test_disjoint_classes(labels):
  parts = data.partition_disjoint(labels, 5, seed=0)
  class_sets = [set(np.unique(labels[p])) for p in parts]
  assert all(len(s) == 2 for s in class_sets)
  assert set().union(*class_sets) == set(range(10))
  assert sum(len(s) for s in class_sets) == 10  # Pairwise disjoint.
  assert sum(len(p) for p in parts) == len(labels)
  uneven = data.partition_disjoint(labels, 3, seed=0)
  assert sorted(len(np.unique(labels[p])) for p in uneven) == [3, 3, 4]


def test_feddf_equal_sizes(labels):
  parts = data.partition_feddf_dirichlet(labels, 13, alpha=0.1, seed=0)
  assert [len(p) for p in parts] == [len(labels) // 13] * 13
  assert_disjoint(parts, len(labels))


def test_fedcvae_small_alpha_more_skewed(labels):
  skewed = mean_entropy(labels, data.partition_fedcvae_dirichlet(labels, 10, 0.01, 0))
  mild = mean_entropy(labels, data.partition_fedcvae_dirichlet(labels, 10, 100.0, 0))
  assert skewed < mild - 1.0
  half = data.partition_fedcvae_dirichlet(labels, 10, 0.5, 0, sample_ratio=0.5)
  assert sum(len(p) for p in half) == len(labels) // 2


@pytest.mark.parametrize(
  'call,match',
  [
    (lambda y: data.partition_dirichlet(y, 5, alpha=0.0, seed=0), 'alpha'),
    (lambda y: data.partition_dirichlet(y, 5, alpha=-1.0, seed=0), 'alpha'),
    (lambda y: data.partition_feddf_dirichlet(y, 10, alpha=0.0, seed=0), 'alpha'),
    (lambda y: data.partition_fedcvae_dirichlet(y, 5, alpha=0.0, seed=0), 'alpha'),
    (lambda y: data.partition_shards_k(y, 5, k=11, seed=0), 'k'),
    (lambda y: data.partition_shards_k(y, 5, k=0, seed=0), 'k'),
    (lambda y: data.partition_iid(y, 0, seed=0), 'num_clients'),
    (lambda y: data.partition_iid(y[:4], 5, seed=0), 'exceeds'),
    (lambda y: data.partition_dirichlet(y[:40], 5, 0.5, 0), 'min_size'),
    # One class, five clients, alpha 0.01: a single draw that almost surely starves four.
    (lambda y: data.partition_dirichlet(np.zeros(100, int), 5, 0.01, 0, max_tries=5), 'tries'),
    (lambda y: data.partition_disjoint(y, 11, seed=0), 'num_classes'),
    (lambda y: data.partition_feddf_dirichlet(y, 9, alpha=0.5, seed=0), '>= 10'),
    (lambda y: data.partition_fedcvae_dirichlet(y, 5, 0.5, 0, sample_ratio=0.0), 'ratio'),
    (lambda y: data.make_partition(y, 5, 'pathological', seed=0), 'iid'),
  ],
)
def test_partition_errors(labels, call, match):
  with pytest.raises(data.PartitionError, match=match):
    call(labels)


def test_partition_error_is_value_error():
  assert issubclass(data.PartitionError, ValueError)


def test_unknown_scheme_lists_all(labels):
  with pytest.raises(data.PartitionError) as info:
    data.make_partition(labels, 5, 'nope', seed=0)
  for scheme in data.available_schemes():
    assert scheme in str(info.value)


def test_count_table(labels):
  parts = data.partition_dirichlet(labels, 6, alpha=0.3, seed=0)
  table = data.class_count_table(labels, parts, 10)
  assert table.shape == (6, 10)
  np.testing.assert_array_equal(table.sum(axis=1), [len(p) for p in parts])
  np.testing.assert_array_equal(table.sum(axis=0), np.bincount(labels, minlength=10))
  text = data.format_count_table(table)
  lines = text.splitlines()
  assert lines[0].split()[0] == 'client' and lines[0].split()[-1] == 'total'
  assert lines[-1].split() == ['total'] + [str(v) for v in table.sum(axis=0)] + [str(len(labels))]
  assert len(lines) == 6 + 4  # Header, rule, 6 clients, rule, totals.


# ---------------------------------------------------------------------------- federated


def test_federate_padding(digits):
  x, y = digits.train_x, digits.train_y
  parts = data.partition_dirichlet(y, 4, alpha=0.5, seed=0)
  fed = data.federate(x, y, parts, pad_to_multiple=32)
  sizes = np.array([len(p) for p in parts])
  assert fed.num_clients == 4
  assert fed.x.shape[:2] == fed.y.shape and fed.x.shape[2:] == x.shape[1:]
  assert fed.y.shape[1] % 32 == 0 and fed.y.shape[1] >= sizes.max()
  assert fed.x.dtype == np.float32 and fed.y.dtype == np.int32 and fed.sizes.dtype == np.int32
  np.testing.assert_array_equal(fed.sizes, sizes)
  np.testing.assert_array_equal(fed.mask.sum(axis=1), sizes)
  assert not fed.x[~fed.mask].any() and not fed.y[~fed.mask].any()
  for k, p in enumerate(parts):
    cx, cy = fed.client(k)
    np.testing.assert_array_equal(cx, x[p])
    np.testing.assert_array_equal(cy, y[p])


def test_federate_rejects_bad_indices(digits):
  with pytest.raises(ValueError):
    data.federate(digits.train_x, digits.train_y, [np.array([0, len(digits.train_y)])])
  with pytest.raises(ValueError):
    data.federate(digits.train_x, digits.train_y, [np.array([0])], pad_to_multiple=0)


# -------------------------------------------------------------------------------- plots


def test_bubble_plot_writes_png(tmp_path, labels):
  from jfed.data import plots  # pylint: disable=g-import-not-at-top

  table = data.class_count_table(labels, data.partition_dirichlet(labels, 5, 0.5, 0), 10)
  path = plots.plot_partition_bubbles(table, tmp_path / 'sub' / 'bubbles.png', title='t')
  assert os.path.getsize(path) > 1000
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_match_input_shape_resizes_and_matches_channels():
  from jfed.data.transforms import match_input_shape

  gray = np.full((2, 28, 28, 1), 0.25, np.float32)
  rgb = match_input_shape(gray, (8, 8, 3))
  assert rgb.shape == (2, 8, 8, 3) and rgb.dtype == np.float32
  np.testing.assert_allclose(rgb, 0.25, atol=1e-6)  # a constant image stays constant
  color = np.stack([np.zeros((1, 4, 4)), np.ones((1, 4, 4)), np.ones((1, 4, 4))], -1)
  np.testing.assert_allclose(match_input_shape(color, (4, 4, 1)), 2 / 3, atol=1e-6)


def test_a_partition_figure_that_cannot_be_written_is_one_error_naming_it(tmp_path, monkeypatch):
  """A failed write (a full disk, `ulimit -f`) names the figure and leaves no temporary file."""
  from jfed import workdir  # pylint: disable=g-import-not-at-top
  from jfed.data import plots  # pylint: disable=g-import-not-at-top

  real_fdopen = os.fdopen

  class _FullDisk:  # writes a few bytes of the PNG, then the disk is full
    def __init__(self, fd, mode):
      self.file = real_fdopen(fd, mode)

    def __enter__(self):
      return self

    def __exit__(self, *unused):
      self.file.close()

    def write(self, data):
      self.file.write(data[:12])
      raise OSError(errno.EFBIG, 'File too large')

  monkeypatch.setattr(workdir.os, 'fdopen', _FullDisk)
  target = tmp_path / 'partition.png'
  with pytest.raises(
    WorkdirError, match=f'^cannot write {re.escape(str(target))}: File too large$'
  ):
    plots.plot_partition_bubbles(np.eye(3, dtype=int), target)
  assert sorted(p.name for p in tmp_path.iterdir()) == []
