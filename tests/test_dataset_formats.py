"""Tests for the CIFAR (binary version) and SVHN (.mat) loaders, on tiny files written here.

Each test writes into its own tmp_path, and the loaders cache by (name, resolved directory), so
no test sees another's cached dataset.
"""

import pathlib

import numpy as np
import pytest
from scipy import io as sio

from jfed import data
from jfed.data import datasets
from jfed.errors import DataError

CIFAR10_TRAIN = tuple(f'data_batch_{i}.bin' for i in range(1, 6))


def write_cifar_bin(path, labels, planes):
  """Writes CIFAR binary records: the label bytes (a row of `labels`), then the CHW pixels."""
  labels = np.asarray(labels, np.uint8).reshape(len(planes), -1)
  records = np.concatenate([labels, np.asarray(planes, np.uint8).reshape(len(planes), -1)], 1)
  pathlib.Path(path).write_bytes(records.tobytes())


def write_fake_cifar10(directory, per_batch=2, n_test=3):
  """A tiny cifar-10-batches-bin/ layout; returns {file: (labels [N], planes [N, 3, 32, 32])}."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  written = {}
  for i, file in enumerate((*CIFAR10_TRAIN, 'test_batch.bin')):
    n = n_test if file == 'test_batch.bin' else per_batch
    labels = (np.arange(n) + 3 * i) % 10
    planes = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    write_cifar_bin(directory / file, labels, planes)
    written[file] = (labels, planes)
  return written


def write_fake_cifar100(directory, n_train=4, n_test=2):
  """A tiny cifar-100-binary/ layout; returns {file: (coarse [N], fine [N], planes)}."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(1)
  written = {}
  for file, n in (('train.bin', n_train), ('test.bin', n_test)):
    fine = rng.integers(0, 100, n)
    coarse = rng.integers(0, 20, n)
    planes = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    write_cifar_bin(directory / file, np.stack([coarse, fine], 1), planes)
    written[file] = (coarse, fine, planes)
  return written


def write_fake_svhn(directory, n_train=5, n_test=3):
  """Tiny SVHN format-2 files; returns {file: (X [32, 32, 3, N], y [N, 1] in 1..10)}."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(2)
  written = {}
  for file, n in (('train_32x32.mat', n_train), ('test_32x32.mat', n_test)):
    x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
    y = (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)  # 1..10, as distributed.
    sio.savemat(directory / file, {'X': x, 'y': y})
    written[file] = (x, y)
  return written


# ------------------------------------------------------------------------------- CIFAR-10


def test_cifar10_pixels_land_at_hwc_positions(tmp_path):
  write_fake_cifar10(tmp_path)
  # Record 0 of batch 1, built byte by byte: one red pixel at row 1, column 2 and one green
  # pixel at row 5, column 7, so that a wrong plane order or a swapped H/W shows.
  record = bytearray(1 + 3072)
  record[0] = 7
  record[1 + 0 * 1024 + 1 * 32 + 2] = 255
  record[1 + 1 * 1024 + 5 * 32 + 7] = 128
  path = tmp_path / 'data_batch_1.bin'
  path.write_bytes(bytes(record) + path.read_bytes()[3073:])
  ds = data.load_dataset('cifar10', data_dir=str(tmp_path))
  image = ds.train_x[0]
  assert ds.train_y[0] == 7
  assert image[1, 2, 0] == 1.0 and image[5, 7, 1] == np.float32(128) / np.float32(255)
  assert np.count_nonzero(image) == 2


def test_cifar10_binary_loads_in_file_order(tmp_path):
  written = write_fake_cifar10(tmp_path / 'cifar-10-batches-bin')
  ds = data.load_dataset('cifar10', data_dir=str(tmp_path))
  assert ds.name == 'cifar10' and ds.num_classes == 10 and ds.input_shape == (32, 32, 3)
  assert ds.train_x.shape == (10, 32, 32, 3) and ds.test_x.shape == (3, 32, 32, 3)
  assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int32
  train_planes = np.concatenate([written[f][1] for f in CIFAR10_TRAIN])
  np.testing.assert_allclose(ds.train_x * 255, train_planes.transpose(0, 2, 3, 1), atol=1e-4)
  np.testing.assert_array_equal(ds.train_y, np.concatenate([written[f][0] for f in CIFAR10_TRAIN]))
  np.testing.assert_array_equal(ds.test_y, written['test_batch.bin'][0])
  assert not ds.train_x.flags.writeable
  assert data.class_names('cifar10', 10)[0] == 'airplane'


def test_cifar10_search_accepts_archive_dir_and_env_var(tmp_path, monkeypatch):
  write_fake_cifar10(tmp_path / 'cifar10' / 'cifar-10-batches-bin')
  bin_dir = tmp_path / 'cifar10' / 'cifar-10-batches-bin'
  for data_dir in (bin_dir, bin_dir.parent, tmp_path):
    assert data.load_dataset('cifar10', data_dir=str(data_dir)).train_x.shape[0] == 10
  monkeypatch.setenv(datasets.DATA_DIR_ENV, str(tmp_path))
  assert data.load_dataset('cifar10').test_x.shape[0] == 3


def test_cifar10_truncated_file_names_it(tmp_path):
  write_fake_cifar10(tmp_path)
  path = tmp_path / 'data_batch_3.bin'
  path.write_bytes(path.read_bytes()[:-100])
  with pytest.raises(DataError, match='not a whole number of 3073-byte records') as info:
    data.load_dataset('cifar10', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_cifar10_empty_file_names_it(tmp_path):
  write_fake_cifar10(tmp_path)
  path = tmp_path / 'test_batch.bin'
  path.write_bytes(b'')
  with pytest.raises(DataError, match='empty') as info:
    data.load_dataset('cifar10', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_cifar10_label_out_of_range_names_the_file(tmp_path):
  write_fake_cifar10(tmp_path)
  path = tmp_path / 'data_batch_5.bin'
  write_cifar_bin(path, [3, 10], np.zeros((2, 3, 32, 32)))
  with pytest.raises(DataError, match=r'1 labels are not in \[0, 10\)') as info:
    data.load_dataset('cifar10', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


# ------------------------------------------------------------------------------ CIFAR-100


def test_cifar100_fine_and_coarse_labels(tmp_path):
  written = write_fake_cifar100(tmp_path / 'cifar-100-binary')
  fine = data.load_dataset('cifar100', data_dir=str(tmp_path))
  coarse = data.load_dataset('cifar100_coarse', data_dir=str(tmp_path))
  assert fine.num_classes == 100 and coarse.num_classes == 20
  assert fine.name == 'cifar100' and coarse.name == 'cifar100_coarse'
  np.testing.assert_array_equal(fine.train_y, written['train.bin'][1])
  np.testing.assert_array_equal(fine.test_y, written['test.bin'][1])
  np.testing.assert_array_equal(coarse.train_y, written['train.bin'][0])
  np.testing.assert_array_equal(coarse.test_y, written['test.bin'][0])
  expected = written['train.bin'][2].transpose(0, 2, 3, 1)
  np.testing.assert_allclose(fine.train_x * 255, expected, atol=1e-4)
  np.testing.assert_array_equal(coarse.train_x, fine.train_x)


def test_cifar100_class_names_follow_label_order():
  fine = data.class_names('cifar100', 100)
  coarse = data.class_names('cifar100_coarse', 20)
  assert len(set(fine)) == 100 and len(set(coarse)) == 20
  # The distributed label files list the classes alphabetically (by their underscored names).
  assert list(fine) == sorted(fine) and list(coarse) == sorted(coarse)
  assert fine[0] == 'apple' and fine[-1] == 'worm' and coarse[-1] == 'vehicles 2'


@pytest.mark.parametrize(
  'labels,match',
  [
    ([[20, 5], [1, 5]], r'1 coarse labels are not in \[0, 20\)'),
    ([[1, 5], [1, 100]], r'1 fine labels are not in \[0, 100\)'),
  ],
)
def test_cifar100_label_out_of_range_names_the_file(tmp_path, labels, match):
  write_fake_cifar100(tmp_path)
  path = tmp_path / 'test.bin'
  write_cifar_bin(path, labels, np.zeros((2, 3, 32, 32)))
  for name in ('cifar100', 'cifar100_coarse'):  # Either view rejects a corrupt file.
    with pytest.raises(DataError, match=match) as info:
      data.load_dataset(name, data_dir=str(tmp_path))
    assert str(path) in str(info.value)


def test_cifar100_truncated_file_names_it(tmp_path):
  write_fake_cifar100(tmp_path)
  path = tmp_path / 'train.bin'
  path.write_bytes(path.read_bytes() + b'\x00')
  with pytest.raises(DataError, match='3074-byte records') as info:
    data.load_dataset('cifar100', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_cifar10_file_in_cifar100_dir_is_refused(tmp_path):
  """CIFAR-10 records (3073 bytes) are never a whole number of CIFAR-100 ones (3074) here."""
  write_fake_cifar10(tmp_path / 'c10', per_batch=3)
  write_fake_cifar100(tmp_path)
  (tmp_path / 'train.bin').write_bytes((tmp_path / 'c10' / 'data_batch_1.bin').read_bytes())
  with pytest.raises(DataError, match='records'):
    data.load_dataset('cifar100', data_dir=str(tmp_path))


# ----------------------------------------------------------------------------------- SVHN


def test_svhn_mat_loads_with_10_as_zero(tmp_path):
  written = write_fake_svhn(tmp_path)
  ds = data.load_dataset('svhn', data_dir=str(tmp_path))
  assert ds.name == 'svhn' and ds.num_classes == 10 and ds.input_shape == (32, 32, 3)
  assert ds.train_x.shape == (5, 32, 32, 3) and ds.test_x.shape == (3, 32, 32, 3)
  assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int32
  np.testing.assert_array_equal(ds.train_y, [1, 2, 3, 4, 5])
  np.testing.assert_array_equal(ds.test_y, [1, 2, 3])
  x = written['train_32x32.mat'][0]
  np.testing.assert_allclose(ds.train_x * 255, x.transpose(3, 0, 1, 2), atol=1e-4)
  assert ds.train_x[4, 6, 9, 2] == np.float32(x[6, 9, 2, 4]) / np.float32(255)
  assert data.class_names('svhn', 10)[0] == 'house number digit zero'


def test_svhn_label_ten_is_digit_zero(tmp_path):
  write_fake_svhn(tmp_path)
  x = np.zeros((32, 32, 3, 3), np.uint8)
  sio.savemat(tmp_path / 'test_32x32.mat', {'X': x, 'y': np.array([[10], [1], [10]], np.uint8)})
  np.testing.assert_array_equal(data.load_dataset('svhn', data_dir=str(tmp_path)).test_y, [0, 1, 0])


def test_svhn_from_env_var(tmp_path, monkeypatch):
  write_fake_svhn(tmp_path / 'svhn')
  monkeypatch.setenv(datasets.DATA_DIR_ENV, str(tmp_path))
  assert data.load_dataset('svhn').train_x.shape == (5, 32, 32, 3)


X_OK = np.zeros((32, 32, 3, 2), np.uint8)
Y_OK = np.array([[1], [2]], np.uint8)


@pytest.mark.parametrize(
  'variables,match',
  [
    ({'y': Y_OK}, 'no variable X'),
    ({'X': X_OK, 'labels': Y_OK}, r"no variable y \(it holds \['X', 'labels'\]\)"),
    ({'X': np.zeros((28, 28, 1, 2), np.uint8), 'y': Y_OK}, r'\[32, 32, 3, N\], got uint8'),
    ({'X': np.zeros((2, 32, 32, 3), np.uint8), 'y': Y_OK}, r'\[32, 32, 3, N\]'),
    ({'X': X_OK.astype(np.float64), 'y': Y_OK}, 'X must be uint8'),
    ({'X': X_OK, 'y': np.ones((2, 2), np.uint8)}, r'y must be \[N, 1\]'),
    ({'X': X_OK, 'y': Y_OK.astype(np.float64)}, 'y must hold integers'),
    ({'X': X_OK, 'y': np.array([[1], [2], [3]], np.uint8)}, '2 images but y 3 labels'),
    ({'X': X_OK, 'y': np.array([[0], [2]], np.uint8)}, r'1 labels are not in \[1, 10\]'),
    ({'X': X_OK, 'y': np.array([[11], [12]], np.uint8)}, r'2 labels are not in \[1, 10\]'),
  ],
)
def test_svhn_bad_mat_names_the_file(tmp_path, variables, match):
  write_fake_svhn(tmp_path)
  path = tmp_path / 'train_32x32.mat'
  sio.savemat(path, variables)
  with pytest.raises(DataError, match=match) as info:
    data.load_dataset('svhn', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


@pytest.mark.parametrize('keep', [0, 10, 100, 200, -5])
def test_svhn_truncated_mat_names_the_file(tmp_path, keep):
  write_fake_svhn(tmp_path)
  path = tmp_path / 'test_32x32.mat'
  raw = path.read_bytes()
  path.write_bytes(raw[: keep if keep >= 0 else len(raw) + keep])
  with pytest.raises(DataError, match='not a readable MATLAB .mat file') as info:
    data.load_dataset('svhn', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_svhn_garbage_file_names_it(tmp_path):
  write_fake_svhn(tmp_path)
  path = tmp_path / 'train_32x32.mat'
  path.write_bytes(b'not a mat file ' * 20)
  with pytest.raises(DataError, match='not a readable MATLAB') as info:
    data.load_dataset('svhn', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


# ---------------------------------------------------------------------------- missing files


@pytest.mark.parametrize(
  'name,url,files,alternative',
  [
    (
      'cifar10',
      'https://www.cs.toronto.edu/~kriz/cifar.html',
      ['cifar-10-binary.tar.gz', 'data_batch_5.bin', 'test_batch.bin', 'cifar-10-batches-bin/'],
      'tfds:cifar10',
    ),
    (
      'cifar100',
      'https://www.cs.toronto.edu/~kriz/cifar.html',
      ['cifar-100-binary.tar.gz', 'train.bin', 'test.bin', 'cifar-100-binary/'],
      'tfds:cifar100',
    ),
    (
      'cifar100_coarse',
      'https://www.cs.toronto.edu/~kriz/cifar.html',
      ['cifar-100-binary.tar.gz', f'${datasets.DATA_DIR_ENV}/cifar100,'],
      None,
    ),
    (
      'svhn',
      'http://ufldl.stanford.edu/housenumbers/',
      ['train_32x32.mat', 'test_32x32.mat', 'Format 2'],
      'tfds:svhn_cropped',
    ),
  ],
)
def test_missing_files_say_how_to_get_them(tmp_path, name, url, files, alternative):
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load_dataset(name, data_dir=str(tmp_path))
  message = str(info.value)
  assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, DataError)
  assert url in message and str(tmp_path) in message
  for file in files:
    assert file in message
  if alternative:
    assert alternative in message
  else:
    assert 'tfds:' not in message


def test_one_missing_cifar_file_is_not_found(tmp_path):
  write_fake_cifar10(tmp_path)
  (tmp_path / 'data_batch_4.bin').unlink()
  with pytest.raises(data.DatasetNotFoundError, match='data_batch_4.bin'):
    data.load_dataset('cifar10', data_dir=str(tmp_path))


def test_pickled_python_version_is_refused_with_a_reason(tmp_path):
  pickled = tmp_path / 'cifar-10-batches-py'
  pickled.mkdir()
  (pickled / 'data_batch_1').write_bytes(b'\x80\x04')  # Never opened.
  for data_dir in (tmp_path, pickled):
    with pytest.raises(data.DatasetNotFoundError, match='Python version') as info:
      data.load_dataset('cifar10', data_dir=str(data_dir))
    assert 'unpickling' in str(info.value) and 'cifar-10-binary.tar.gz' in str(info.value)


def test_unextracted_archive_says_extract_it(tmp_path):
  (tmp_path / 'cifar-100-binary.tar.gz').write_bytes(b'\x1f\x8b')
  with pytest.raises(data.DatasetNotFoundError, match='extract it') as info:
    data.load_dataset('cifar100_coarse', data_dir=str(tmp_path))
  assert str(tmp_path / 'cifar-100-binary.tar.gz') in str(info.value)


def test_new_names_are_listed():
  for name in ('cifar10', 'cifar100', 'cifar100_coarse', 'svhn'):
    assert name in data.available_datasets()
