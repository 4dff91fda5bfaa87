"""Hostile IDX files (issue 38, item 6): each is refused with one message naming the file, read
no further than its header promises, or (float images already in [0, 1]) taken as they are."""

import gzip
import os
import struct
import tracemalloc

import numpy as np
import pytest

from jfed import data
from jfed.errors import DataError
from tests.test_data import write_fake_mnist, write_idx


def _idx_header(type_byte: int, shape: tuple) -> bytes:
  return bytes([0, 0, type_byte, len(shape)]) + struct.pack(f'>{len(shape)}I', *shape)


def _gzip_bomb(path, images: np.ndarray, inflated_mib: int) -> None:
  """A valid IDX header and payload for `images`, followed by `inflated_mib` MiB of zeros.

  Built from gzip members (the format allows several, read back to back): the zeros are one
  1 MiB member repeated, so a 1 GiB bomb takes ~1 MB on disk and no time to build.
  """
  head = gzip.compress(_idx_header(0x08, images.shape) + images.tobytes())
  zeros = gzip.compress(bytes(1 << 20), compresslevel=9)
  path.write_bytes(head + zeros * inflated_mib)


def test_gzip_bomb_is_refused_without_inflating_it(tmp_path):
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  images = np.zeros((10, 28, 28), np.uint8)
  _gzip_bomb(path, images, inflated_mib=64)
  tracemalloc.start()
  try:
    with pytest.raises(DataError, match='more data than its header') as info:
      data.read_idx(path)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert str(path) in str(info.value)
  # Inflating it all holds 64 MiB at once; reading what the header promises (7,840 bytes),
  # plus one byte to see that more follows, holds a few decompression buffers.
  assert peak < 4 << 20, f'peak {peak} bytes: the stream was inflated past its header'


def test_gzip_bomb_in_a_dataset_directory_names_the_file(tmp_path):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  path = tmp_path / 't10k-images-idx3-ubyte.gz'
  _gzip_bomb(path, np.zeros((4, 28, 28), np.uint8), inflated_mib=8)
  with pytest.raises(DataError, match='more data than its header') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_gzip_stream_shorter_than_its_header_names_the_file(tmp_path):
  # Refused before this change too (as 'header says shape ...'); kept as the other side of the
  # bomb: the payload is compared with the header both ways.
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  path.write_bytes(gzip.compress(_idx_header(0x08, (10, 28, 28)) + bytes(5 * 28 * 28)))
  with pytest.raises(DataError, match='holds only 3920 data bytes') as info:
    data.read_idx(path)
  assert str(path) in str(info.value)


@pytest.mark.parametrize('split', ['train', 't10k'])
def test_zero_sample_files_are_refused(tmp_path, split):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  path = tmp_path / f'{split}-images-idx3-ubyte.gz'
  write_idx(path, np.zeros((0, 28, 28)))
  write_idx(tmp_path / f'{split}-labels-idx1-ubyte.gz', np.zeros((0,)))
  with pytest.raises(DataError, match='holds no samples') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert str(path) in str(info.value)


def test_train_and_test_image_shapes_must_match(tmp_path):
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  test_images = tmp_path / 't10k-images-idx3-ubyte.gz'
  write_idx(test_images, np.zeros((4, 32, 32)))
  with pytest.raises(DataError, match='differ in shape') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  message = str(info.value)
  assert str(test_images) in message and str(tmp_path / 'train-images-idx3-ubyte.gz') in message
  assert '28x28' in message and '32x32' in message


@pytest.mark.parametrize(
  'magic,expected',
  [
    # One dimension too many: the first data bytes would be read as a 4th and 5th dimension.
    (b'\x00\x00\x08\x05', '0x00000803'),
    (b'\x00\x00\x07\x03', '0x00000803'),  # No such type byte.
    (b'\x1f\x00\x08\x03', '0x00000803'),
    (b'\x00\x00\x0d\x01', '0x00000d03'),  # A float32 labels file where images belong.
  ],
)
def test_wrong_magic_number_says_not_an_idx_file(tmp_path, magic, expected):
  write_fake_mnist(tmp_path, n_train=300, n_test=4, compress=False)
  path = tmp_path / 'train-images-idx3-ubyte'
  raw = path.read_bytes()
  path.write_bytes(magic + raw[4:])
  with pytest.raises(DataError, match='not an IDX images file') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  message = str(info.value)
  assert str(path) in message
  assert f'bad magic number 0x{magic.hex()}' in message and f'expected {expected}' in message
  assert '4294967295' not in message


def test_wrong_magic_number_of_a_lone_file(tmp_path):
  path = tmp_path / 'bad'
  path.write_bytes(b'\x00\x00\x0a\x01junk')
  with pytest.raises(DataError, match='not an IDX file') as info:
    data.read_idx(path)
  assert str(path) in str(info.value) and 'bad magic number 0x00000a01' in str(info.value)


@pytest.mark.parametrize('compress', [True, False])
@pytest.mark.parametrize(
  'shape,payload_bytes',
  [
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), 1000),  # 2**96 bytes.
    ((1 << 16, 1 << 16, 1 << 16, 1 << 16), 0),  # 2**64 elements: wraps around int64 to 0.
    ((60000, 28, 28, 0xFFFFFFFF), 1000),  # Fits int64, but no file of this size holds it.
  ],
)
def test_overflowing_dimensions_name_the_file(tmp_path, compress, shape, payload_bytes):
  path = tmp_path / 'train-images-idx3-ubyte'
  payload = _idx_header(0x08, shape) + bytes(payload_bytes)
  path.write_bytes(gzip.compress(payload) if compress else payload)
  with pytest.raises(DataError, match=r'promises shape \(') as info:
    data.read_idx(path)
  message = str(info.value)
  assert str(path) in message and str(shape) in message


@pytest.mark.parametrize('compress', [True, False])
def test_one_dimension_too_many_is_blamed_on_the_magic_number(tmp_path, compress):
  # 0x00000804 on a 3-dimensional file: the first 4 pixel bytes are read as a 4th dimension.
  write_fake_mnist(tmp_path, n_train=300, n_test=4, compress=compress)
  path = tmp_path / ('train-images-idx3-ubyte' + ('.gz' if compress else ''))
  raw = gzip.decompress(path.read_bytes()) if compress else path.read_bytes()
  raw = b'\x00\x00\x08\x04' + raw[4:]
  path.write_bytes(gzip.compress(raw) if compress else raw)
  with pytest.raises(DataError, match='magic number 0x00000804: uint8, 4 dimensions') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  assert str(path) in str(info.value) and 'corrupt' in str(info.value)


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_float_images_already_in_unit_range_are_not_scaled_again(tmp_path, dtype):
  raw = write_fake_mnist(tmp_path, n_train=4, n_test=4)
  scaled = raw['train-images-idx3-ubyte'].astype(dtype) / 255
  write_idx(tmp_path / 'train-images-idx3-ubyte.gz', scaled, dtype=dtype)
  write_idx(
    tmp_path / 't10k-images-idx3-ubyte.gz', raw['t10k-images-idx3-ubyte'] / 255, dtype=dtype
  )
  ds = data.load_dataset('mnist', data_dir=str(tmp_path))
  np.testing.assert_array_equal(ds.train_x[..., 0], scaled.astype(np.float32))
  expected_test = (raw['t10k-images-idx3-ubyte'].astype(dtype) / 255).astype(np.float32)
  np.testing.assert_array_equal(ds.test_x[..., 0], expected_test)


@pytest.mark.parametrize(
  'test_images, test_kind',
  [
    ('floats_1.01', 'float32 pixel values in [0, 255] (max 1.01)'),
    ('uint8', 'uint8 pixel values in [0, 255]'),
  ],
)
def test_splits_of_two_scales_are_refused_naming_both_files(tmp_path, test_images, test_kind):
  """Training floats in [0, 1] beside a test file that is not: scaling each file on its own
  would divide the test split by 255 (accuracy at chance, no error)."""
  raw = write_fake_mnist(tmp_path, n_train=4, n_test=4)
  write_idx(
    tmp_path / 'train-images-idx3-ubyte.gz',
    raw['train-images-idx3-ubyte'] / 255,
    dtype=np.float32,
  )
  if test_images == 'floats_1.01':
    test = (raw['t10k-images-idx3-ubyte'] / 255).astype(np.float32)
    test[0, 0, 0] = 1.01
    write_idx(tmp_path / 't10k-images-idx3-ubyte.gz', test, dtype=np.float32)
  with pytest.raises(DataError, match='must share one scale') as info:
    data.load_dataset('mnist', data_dir=str(tmp_path))
  message = str(info.value)
  assert 'train-images-idx3-ubyte.gz holds floats already scaled to [0, 1]' in message
  assert f't10k-images-idx3-ubyte.gz holds {test_kind}' in message


def test_uint8_images_that_are_all_dark_are_still_scaled(tmp_path):
  # Integer pixel values are always 0-255, even when none exceeds 1.
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  dark = np.ones((4, 28, 28), np.uint8)
  write_idx(tmp_path / 'train-images-idx3-ubyte.gz', dark)
  ds = data.load_dataset('mnist', data_dir=str(tmp_path))
  np.testing.assert_array_equal(ds.train_x, np.full((4, 28, 28, 1), np.float32(1) / 255))


@pytest.mark.parametrize('kind', ['fifo', 'device'])
def test_a_data_path_that_is_not_a_regular_file_is_named_as_such(tmp_path, kind):
  """A FIFO (a read would block) or /dev/zero (endless) in place of an IDX file is named for
  what it is, not reported as a missing dataset."""
  write_fake_mnist(tmp_path, n_train=4, n_test=4)
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  path.unlink()
  if kind == 'fifo':
    os.mkfifo(path)
  else:
    path.symlink_to('/dev/zero')
  expected = 'a FIFO' if kind == 'fifo' else 'a character device'
  with pytest.raises(DataError, match=f'train-images-idx3-ubyte.gz is {expected}, not a regular'):
    data.load_dataset('mnist', data_dir=str(tmp_path))
