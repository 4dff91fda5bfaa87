"""Image classification datasets as in-memory NumPy arrays.

Every loader returns the same `Dataset`: NHWC float32 images in [0, 1] and int32 labels, so
that partitioning, federating and training code never has to care where the data came from.
No mean/std normalisation is applied (DENSE and the methods built on it feed [0, 1] images
to the networks and generators).

Sources:
  * 'digits': scikit-learn's 8x8 digits (bundled with scikit-learn, always available); the
    fast smoke-test dataset.
  * 'mnist', 'fashion_mnist', 'kmnist', 'emnist': the original IDX files, read with a small
    NumPy parser (no TensorFlow, no torchvision).
  * 'tfds:<name>': any TFDS dataset already prepared in the array_record format, read through
    `tfds.data_source`, which needs no TensorFlow.

Loaded datasets are cached per process (FMNIST takes ~1 s to decompress and parse); their
arrays are marked read-only so that no caller can silently corrupt the cached copy.
"""

import functools
import gzip
import os
import pathlib
from typing import NamedTuple, Optional, Sequence
import zlib

import numpy as np

from jfed.errors import DataError

DATA_DIR_ENV = 'JFED_DATA_DIR'
SYSTEM_DATA_DIR = pathlib.Path('/usr/share/datasets')
IDX_DATASETS = ('mnist', 'fashion_mnist', 'kmnist', 'emnist')
TFDS_PREFIX = 'tfds:'

# EMNIST (in IDX and in TFDS, which copies the IDX files) stores every image transposed
# with respect to MNIST; we transpose back so that all *MNIST images share one orientation.
_TRANSPOSED_PREFIXES = ('emnist',)

# (split, kind) -> file stems tried in order. The dotted spellings are those of some
# un-gzipped mirrors of MNIST.
_IDX_STEMS = {
  ('train', 'images'): ('train-images-idx3-ubyte', 'train-images.idx3-ubyte'),
  ('train', 'labels'): ('train-labels-idx1-ubyte', 'train-labels.idx1-ubyte'),
  ('test', 'images'): (
    't10k-images-idx3-ubyte',
    't10k-images.idx3-ubyte',
    'test-images-idx3-ubyte',
  ),
  ('test', 'labels'): (
    't10k-labels-idx1-ubyte',
    't10k-labels.idx1-ubyte',
    'test-labels-idx1-ubyte',
  ),
}

_WHERE_TO_GET = {
  'mnist': 'download the four files from https://yann.lecun.com/exdb/mnist/ (or any MNIST mirror)',
  'fashion_mnist': 'install the Debian package: `sudo apt-get install dataset-fashion-mnist` '
  '(as root: without sudo; it puts the IDX files in '
  '/usr/share/datasets/fashion-mnist), or download them from '
  'https://github.com/zalandoresearch/fashion-mnist',
  'kmnist': 'download the MNIST-format files from https://github.com/rois-codh/kmnist',
  'emnist': 'download gzip.zip from https://www.nist.gov/itl/products-and-services/'
  "emnist-dataset and keep ONE split's four files (e.g. "
  'emnist-balanced-train-images-idx3-ubyte.gz, ...) in the directory',
}

# Datasets whose class count is fixed: a label outside [0, count) means a wrong or corrupt file.
# Others (EMNIST, whose splits have 10 to 62 classes) take max label + 1.
_IDX_NUM_CLASSES = {'mnist': 10, 'fashion_mnist': 10, 'kmnist': 10}

# IDX type byte -> big-endian NumPy dtype.
_IDX_DTYPES = {
  0x08: np.dtype('>u1'),
  0x09: np.dtype('>i1'),
  0x0B: np.dtype('>i2'),
  0x0C: np.dtype('>i4'),
  0x0D: np.dtype('>f4'),
  0x0E: np.dtype('>f8'),
}


class DatasetNotFoundError(DataError, FileNotFoundError):
  """A known dataset whose files are not on this machine; the message says how to get them."""


class Dataset(NamedTuple):
  """A train/test image classification dataset held in memory.

  Attributes:
    name: the name it was loaded under.
    train_x: [N, H, W, C] float32 in [0, 1].
    train_y: [N] int32 in [0, num_classes).
    test_x: [M, H, W, C] float32 in [0, 1].
    test_y: [M] int32.
    num_classes: number of classes (labels may leave some unused, e.g. EMNIST letters).
  """

  name: str
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int

  @property
  def input_shape(self) -> tuple:
    """(H, W, C) of one image: what model constructors need."""
    return tuple(int(d) for d in self.train_x.shape[1:])


def available_datasets() -> list:
  """Names `load_dataset` accepts besides the open-ended 'tfds:<name>' family."""
  return ['digits', *IDX_DATASETS]


CLASS_NAMES = {
  'digits': tuple(
    f'digit {w}' for w in 'zero one two three four five six seven eight nine'.split()
  ),
  'mnist': tuple(
    f'handwritten digit {w}' for w in 'zero one two three four five six seven eight nine'.split()
  ),
  'fashion_mnist': (
    'T-shirt/top',
    'trouser',
    'pullover',
    'dress',
    'coat',
    'sandal',
    'shirt',
    'sneaker',
    'bag',
    'ankle boot',
  ),
  'cifar10': (
    'airplane',
    'automobile',
    'bird',
    'cat',
    'deer',
    'dog',
    'frog',
    'horse',
    'ship',
    'truck',
  ),
}


def class_names(name: str, num_classes: int) -> tuple:
  """The classes' names, for prompts (FedTSA); 'class 0', 'class 1', ... when unknown."""
  names = CLASS_NAMES.get(name.removeprefix('tfds:'))
  if names is None or len(names) != num_classes:
    return tuple(f'class {c}' for c in range(num_classes))
  return names


def load_dataset(name: str, data_dir: Optional[str] = None) -> Dataset:
  """Loads a dataset by name (see the module docstring for the sources).

  Args:
    name: 'digits', 'mnist', 'fashion_mnist', 'kmnist', 'emnist' or 'tfds:<tfds name>'.
    data_dir: for the IDX datasets, the directory holding the IDX files (or its parent,
      holding a `<name>` subdirectory); by default `$JFED_DATA_DIR/<name>` and then
      `/usr/share/datasets/<name with - for _>` are searched. For 'tfds:' names, the TFDS
      data directory (default: TFDS's own, `$TFDS_DATA_DIR` or ~/tensorflow_datasets).

  Returns:
    The `Dataset`; cached, so repeated loads are free. Its arrays are read-only: copy
    before modifying in place.

  Raises:
    ValueError: unknown name.
    DatasetNotFoundError: a known dataset that is not available locally.
    DataError: an IDX file that is truncated, corrupt, or holds labels outside
      [0, num_classes) (negative labels for EMNIST) or images that are not 0-255 pixel values;
      the message names the file.
  """
  if name == 'digits':
    return _load_digits()
  if name in IDX_DATASETS:
    return _load_idx_dataset(name, str(_find_idx_dir(name, data_dir)))
  if name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX):
    return _load_tfds(name[len(TFDS_PREFIX) :], None if data_dir is None else str(data_dir))
  raise ValueError(
    f'Unknown dataset {name!r}. Valid names: {", ".join(available_datasets())}, '
    f'or {TFDS_PREFIX}<name> for a prepared TFDS dataset (e.g. tfds:cifar10).'
  )


def read_idx(path) -> np.ndarray:
  """Reads one IDX file (gzipped or not) into a native-endian NumPy array.

  The format (http://yann.lecun.com/exdb/mnist/): two zero bytes, a type byte, the number
  of dimensions, the dimensions as big-endian uint32, then the big-endian data.

  Raises:
    DataError: the file cannot be read, is a truncated or corrupt gzip file, is not an IDX
      file, or holds fewer or more data bytes than its header says; the message names it.
  """
  path = pathlib.Path(path)
  try:
    with open(path, 'rb') as f:
      gzipped = f.read(2) == b'\x1f\x8b'
    opener = gzip.open if gzipped else open
    with opener(path, 'rb') as f:
      raw = f.read()
  except (EOFError, zlib.error, OSError) as e:  # gzip.BadGzipFile is an OSError.
    detail = getattr(e, 'strerror', None) or str(e) or type(e).__name__
    if _is_decompression_error(e):
      raise DataError(
        f'{path}: truncated or corrupt gzip file ({detail}); download it again.'
      ) from e
    raise DataError(f'{path}: cannot be read ({detail}).') from e
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
    raise DataError(f'{path} is not an IDX file (bad magic number {raw[:4]!r}).')
  dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
  if len(raw) < 4 + 4 * ndim:
    raise DataError(f'{path}: IDX header cut short ({len(raw)} bytes for {ndim} dimensions).')
  shape = tuple(int(d) for d in np.frombuffer(raw, dtype='>u4', count=ndim, offset=4))
  offset = 4 + 4 * ndim
  count = int(np.prod(shape, dtype=np.int64))
  if len(raw) - offset != count * dtype.itemsize:
    raise DataError(
      f'{path}: header says shape {shape} but the file holds {len(raw) - offset} data bytes.'
    )
  data = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(shape)
  return data.astype(dtype.newbyteorder('='))


def _is_decompression_error(error: BaseException) -> bool:
  """Whether `error` comes from decompressing (rather than opening or reading) a file."""
  return isinstance(error, (EOFError, zlib.error, gzip.BadGzipFile))


def _check_idx_images(images: np.ndarray, path) -> None:
  """Raises DataError (naming `path`) unless `images` are [N, H, W(, C)] 0-255 pixel values.

  uint8 files always pass; other types (float IDX files, signed integers) must hold finite
  values in [0, 255], since the loader scales by 1/255 (float files already scaled to [0, 1]
  pass but come out 255 times too dark).
  """
  if images.ndim not in (3, 4):
    raise DataError(f'{path}: images must be [N, H, W] or [N, H, W, C], got shape {images.shape}.')
  if images.dtype == np.uint8 or not images.size:
    return
  if np.issubdtype(images.dtype, np.floating) and not np.all(np.isfinite(images)):
    bad = int(np.size(images) - np.count_nonzero(np.isfinite(images)))
    raise DataError(
      f'{path}: {bad} image values are NaN or infinite; expected pixel values in [0, 255].'
    )
  low, high = images.min(), images.max()
  if low < 0 or high > 255:
    raise DataError(
      f'{path}: image values span [{low}, {high}]; expected pixel values in [0, 255].'
    )


def _check_idx_labels(labels: np.ndarray, path, num_classes: Optional[int]) -> None:
  """Raises DataError (naming `path`) unless `labels` are 1-D integers in [0, num_classes).

  With `num_classes=None` (a dataset whose class count is not fixed) only negative labels
  are rejected.
  """
  if labels.ndim != 1:
    raise DataError(f'{path}: labels must be 1-D, got shape {labels.shape}.')
  if not np.issubdtype(labels.dtype, np.integer):
    raise DataError(f'{path}: labels must be integers, got IDX type {labels.dtype}.')
  if not labels.size:
    return
  low, high = int(labels.min()), int(labels.max())
  if low < 0 or (num_classes is not None and high >= num_classes):
    bad = labels < 0 if num_classes is None else (labels < 0) | (labels >= num_classes)
    valid = '>= 0' if num_classes is None else f'in [0, {num_classes})'
    raise DataError(f'{path}: {int(bad.sum())} labels are not {valid} (they span [{low}, {high}]).')


def _search_dirs(name: str, data_dir: Optional[str]) -> list:
  """Directories that may hold the IDX files of `name`, in priority order."""
  dashed = name.replace('_', '-')
  if data_dir is not None:
    root = pathlib.Path(data_dir).expanduser()
    return [root, root / name, root / dashed]
  dirs = []
  env = os.environ.get(DATA_DIR_ENV)
  if env:
    root = pathlib.Path(env).expanduser()
    dirs += [root / name, root / dashed]
  dirs.append(SYSTEM_DATA_DIR / dashed)
  return dirs


def _find_idx_file(directory: pathlib.Path, split: str, kind: str) -> Optional[pathlib.Path]:
  """The IDX file for (split, kind) in `directory`, by MNIST name or a `*-<MNIST name>` one."""
  stems = _IDX_STEMS[(split, kind)]
  for stem in stems:
    for candidate in (directory / f'{stem}.gz', directory / stem):
      if candidate.is_file():
        return candidate
  # Prefixed names such as EMNIST's 'emnist-balanced-train-images-idx3-ubyte.gz'.
  matches = sorted(
    {
      p
      for stem in stems
      for pattern in (f'*-{stem}', f'*-{stem}.gz')
      for p in directory.glob(pattern)
      if p.is_file()
    }
  )
  if len(matches) > 1:
    raise DatasetNotFoundError(
      f'Several candidate {split} {kind} files in {directory}: '
      f'{[m.name for m in matches]}. Keep only one split per directory.'
    )
  return matches[0] if matches else None


def _find_idx_dir(name: str, data_dir: Optional[str]) -> pathlib.Path:
  """The first search directory holding all four IDX files, else a helpful error."""
  dirs = _search_dirs(name, data_dir)
  for directory in dirs:
    if directory.is_dir() and all(_find_idx_file(directory, s, k) for s, k in _IDX_STEMS):
      return directory.resolve()
  files = ', '.join(s[0] + '.gz' for s in _IDX_STEMS.values())
  raise DatasetNotFoundError(
    f'Dataset {name!r} not found; searched {[str(d) for d in dirs]}. To get it, '
    f'{_WHERE_TO_GET[name]}. The loader needs the four IDX files ({files}; un-gzipped '
    f'files are accepted too) in a directory passed as data_dir=..., or in '
    f'${DATA_DIR_ENV}/{name}, or in {SYSTEM_DATA_DIR / name.replace("_", "-")}. '
    f'Alternatively use {TFDS_PREFIX}{name} with a TFDS dataset prepared in the '
    f'array_record format.'
  )


def _to_images(raw: np.ndarray, transpose: bool) -> np.ndarray:
  """uint8 [N, H, W] or [N, H, W, C] -> float32 NHWC in [0, 1]."""
  x = np.asarray(raw)
  if x.ndim == 3:
    x = x[..., None]
  if transpose:
    x = np.swapaxes(x, 1, 2)
  return np.ascontiguousarray(x, dtype=np.float32) / np.float32(255.0)


def _freeze(ds: Dataset) -> Dataset:
  """Marks the arrays read-only: the cached copy is shared by every caller."""
  for array in (ds.train_x, ds.train_y, ds.test_x, ds.test_y):
    array.flags.writeable = False
  return ds


@functools.lru_cache(maxsize=None)
def _load_digits() -> Dataset:
  """scikit-learn's 1797 8x8 digits, split 80/20 stratified with a fixed seed (0)."""
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top

  digits = sk_datasets.load_digits()
  x = (digits.images.astype(np.float32) / np.float32(16.0))[..., None]
  y = digits.target.astype(np.int32)
  train_x, test_x, train_y, test_y = model_selection.train_test_split(
    x, y, test_size=0.2, stratify=y, random_state=0
  )
  return _freeze(
    Dataset(
      'digits', np.ascontiguousarray(train_x), train_y, np.ascontiguousarray(test_x), test_y, 10
    )
  )


@functools.lru_cache(maxsize=None)
def _load_idx_dataset(name: str, directory: str) -> Dataset:
  directory = pathlib.Path(directory)
  transpose = name.startswith(_TRANSPOSED_PREFIXES)
  known_classes = _IDX_NUM_CLASSES.get(name)
  arrays = {}
  for split, kind in _IDX_STEMS:
    path = _find_idx_file(directory, split, kind)
    arrays[split, kind] = read_idx(path)
    if kind == 'images':
      _check_idx_images(arrays[split, kind], path)
    else:
      _check_idx_labels(arrays[split, kind], path, known_classes)
  for split in ('train', 'test'):
    if len(arrays[split, 'images']) != len(arrays[split, 'labels']):
      raise DataError(
        f'{directory}: {split} images and labels differ in length '
        f'({len(arrays[split, "images"])} in {_find_idx_file(directory, split, "images")}, '
        f'{len(arrays[split, "labels"])} in {_find_idx_file(directory, split, "labels")}).'
      )
  train_y = arrays['train', 'labels'].astype(np.int32)
  test_y = arrays['test', 'labels'].astype(np.int32)
  # EMNIST 'letters' labels run 1..26, so class 0 stays empty; num_classes covers max label.
  num_classes = known_classes or int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1
  return _freeze(
    Dataset(
      name,
      _to_images(arrays['train', 'images'], transpose),
      train_y,
      _to_images(arrays['test', 'images'], transpose),
      test_y,
      num_classes,
    )
  )


def _read_all_records(source, chunk: int = 4096) -> list:
  """All records of a TFDS data source, read in batches (much faster than one by one)."""
  n = len(source)
  records = []
  for start in range(0, n, chunk):
    keys = list(range(start, min(n, start + chunk)))
    try:
      records.extend(source.__getitems__(keys))
    except TypeError:
      # The mocked source of `tfds.testing.mock_data` does not implement batched reads.
      records.extend(source[i] for i in keys)
  return records


def _records_to_arrays(records: Sequence[dict], transpose: bool, what: str):
  if records and not {'image', 'label'} <= set(records[0]):
    raise ValueError(f'{what} has features {sorted(records[0])}; jfed needs "image" and "label".')
  x = _to_images(np.stack([np.asarray(r['image']) for r in records]), transpose)
  y = np.asarray([r['label'] for r in records], dtype=np.int32)
  return x, y


@functools.lru_cache(maxsize=None)
def _load_tfds(tfds_name: str, data_dir: Optional[str]) -> Dataset:
  """Reads a TFDS dataset prepared as array_record, through `tfds.data_source` (no TF)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  try:
    sources = tfds.data_source(
      tfds_name, split=['train', 'test'], data_dir=data_dir, download=False
    )
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
      f'Unknown TFDS dataset {tfds_name!r} (see https://www.tensorflow.org/datasets/catalog).'
    ) from e
  except (KeyError, NotImplementedError, FileNotFoundError, OSError, AssertionError) as e:
    # KeyError: nothing prepared ("splits is empty"); NotImplementedError: prepared as
    # TFRecord, which random access (and hence reading without TensorFlow) cannot use.
    where = data_dir or os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')
    raise DatasetNotFoundError(
      f'TFDS dataset {tfds_name!r} is not prepared in the array_record format under '
      f'{where} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}). '
      f'Prepare it once, on a machine with TensorFlow and internet access: '
      f'`tfds build {tfds_name} --file_format=array_record --data_dir=DIR` (or '
      f'`tfds.builder({tfds_name!r}, data_dir=DIR).download_and_prepare('
      f'file_format="array_record")`), copy DIR here and pass data_dir=DIR or set '
      f'TFDS_DATA_DIR.'
    ) from e
  transpose = tfds_name.startswith(_TRANSPOSED_PREFIXES)
  train_x, train_y = _records_to_arrays(_read_all_records(sources[0]), transpose, tfds_name)
  test_x, test_y = _records_to_arrays(_read_all_records(sources[1]), transpose, tfds_name)
  try:
    num_classes = int(sources[0].dataset_info.features['label'].num_classes)
  except (AttributeError, KeyError, TypeError):
    num_classes = int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1
  return _freeze(
    Dataset(f'{TFDS_PREFIX}{tfds_name}', train_x, train_y, test_x, test_y, num_classes)
  )
