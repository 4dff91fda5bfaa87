"""Image classification datasets as in-memory NumPy arrays.

Every loader returns the same `Dataset`: NHWC float32 images in [0, 1] and int32 labels, so
that partitioning, federating and training code never has to care where the data came from.
No mean/std normalisation is applied (DENSE and the methods built on it feed [0, 1] images
to the networks and generators).

Sources:
  * 'digits': scikit-learn's 8x8 digits (bundled with scikit-learn, always available); the
    fast smoke-test dataset.
  * 'mnist', 'fashion_mnist', 'kmnist', 'emnist': the original IDX files, read with a small
    NumPy parser (no TensorFlow, no torchvision). Headers are checked before any data is
    decompressed, and no more data is read than they promise. Float IDX images whose values
    all lie in [0, 1] are taken as already scaled; all other images are scaled by 1/255; the
    train and test files must share one scale.
  * 'cifar10', 'cifar100' (fine labels), 'cifar100_coarse' (the 20 superclasses): the binary
    version of CIFAR, fixed-size records read with NumPy. The Python version is never read:
    loading it means unpickling, which can run arbitrary code.
  * 'svhn': SVHN's cropped digits (format 2), the MATLAB v5 .mat files read with
    `scipy.io.loadmat`, which unpickles nothing.
  * 'tfds:<name>': any TFDS dataset already prepared in the array_record format, read through
    `tfds.data_source`, which needs no TensorFlow.

Loaded datasets are cached per process (FMNIST takes ~1 s to decompress and parse); their
arrays are marked read-only so that no caller can silently corrupt the cached copy.
"""

import contextlib
import functools
import gzip
import os
import pathlib
import stat
import struct
from typing import BinaryIO, Dict, Iterator, NamedTuple, Optional, Sequence, Tuple
import zlib

import numpy as np

from jfed.errors import DataError

DATA_DIR_ENV = 'JFED_DATA_DIR'
SYSTEM_DATA_DIR = pathlib.Path('/usr/share/datasets')
IDX_DATASETS = ('mnist', 'fashion_mnist', 'kmnist', 'emnist')
CIFAR_DATASETS = ('cifar10', 'cifar100', 'cifar100_coarse')
MAT_DATASETS = ('svhn',)
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
  'cifar10': 'download the binary version, cifar-10-binary.tar.gz (not the Python version, '
  'which is pickled), from https://www.cs.toronto.edu/~kriz/cifar.html and extract it '
  '(`tar xzf cifar-10-binary.tar.gz`), which makes cifar-10-batches-bin/',
  'cifar100': 'download the binary version, cifar-100-binary.tar.gz (not the Python version, '
  'which is pickled), from https://www.cs.toronto.edu/~kriz/cifar.html and extract it '
  '(`tar xzf cifar-100-binary.tar.gz`), which makes cifar-100-binary/',
  'svhn': 'download train_32x32.mat and test_32x32.mat ("Format 2: Cropped Digits"; '
  'extra_32x32.mat is not used) from http://ufldl.stanford.edu/housenumbers/',
}
_WHERE_TO_GET['cifar100_coarse'] = _WHERE_TO_GET['cifar100']

# TFDS's names where they differ from ours; None: no TFDS dataset jfed can read instead (TFDS's
# cifar100 'label' is the fine one, and the TFDS loader reads only 'label').
_TFDS_ALTERNATIVES = {'svhn': 'svhn_cropped', 'cifar100_coarse': None}


class _FileLayout(NamedTuple):
  """Where the files of a non-IDX dataset live and what they are called.

  Attributes:
    source: the directory name searched under $JFED_DATA_DIR and /usr/share/datasets (the two
      CIFAR-100 label sets share one copy of the files).
    subdir: the directory the distributed archive extracts to ('' when there is no archive);
      accepted inside each searched directory.
    train: file names of the training split, concatenated in this order.
    test: file names of the test split.
  """

  source: str
  subdir: str
  train: tuple
  test: tuple


_CIFAR100_LAYOUT = _FileLayout('cifar100', 'cifar-100-binary', ('train.bin',), ('test.bin',))
_FILE_LAYOUTS = {
  'cifar10': _FileLayout(
    'cifar10',
    'cifar-10-batches-bin',
    tuple(f'data_batch_{i}.bin' for i in range(1, 6)),
    ('test_batch.bin',),
  ),
  'cifar100': _CIFAR100_LAYOUT,
  'cifar100_coarse': _CIFAR100_LAYOUT,
  'svhn': _FileLayout('svhn', '', ('train_32x32.mat',), ('test_32x32.mat',)),
}

# Directory names of the pickled Python versions, recognised only to say why they are refused.
_PICKLED_CIFAR_DIRS = {'cifar10': 'cifar-10-batches-py', 'cifar100': 'cifar-100-python'}
_CIFAR_ARCHIVES = {'cifar10': 'cifar-10-binary.tar.gz', 'cifar100': 'cifar-100-binary.tar.gz'}

# The label bytes that open each CIFAR record, as (what, class count) in file order, and the
# index of the one the dataset uses.
_CIFAR_LABELS = {
  'cifar10': ((('labels', 10),), 0),
  'cifar100': ((('coarse labels', 20), ('fine labels', 100)), 1),
  'cifar100_coarse': ((('coarse labels', 20), ('fine labels', 100)), 0),
}
_CIFAR_SIDE = 32
_CIFAR_PIXEL_BYTES = 3 * _CIFAR_SIDE * _CIFAR_SIDE
_SVHN_IMAGE_SHAPE = (32, 32, 3)

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

# The dimension counts an IDX file may declare, by what the loader expects it to hold.
_IDX_NDIMS = {'images': (3, 4), 'labels': (1,)}

# Deflate never inflates one compressed byte to more than 1032 (zlib's documented maximum
# ratio): a gzipped file whose header promises more data than that cannot hold it.
_MAX_DEFLATE_RATIO = 1032

# Bytes decompressed per read: bounds what a stream longer than its header holds in memory.
_IDX_READ_CHUNK = 1 << 20


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
    holdout_x: training samples held out of every client (`dataset.holdout_size`,
      `jfed.data.public.hold_out_train`): the server's public or distillation data; None when
      nothing is held out.
    holdout_y: their labels.
    normalization: what every classifier built for it applies to its input first
      (`jfed.data.transforms.NORMALIZATIONS`; `dataset.normalization`): the arrays stay in
      [0, 1], so generated images are normalised exactly as the real ones.
  """

  name: str
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  holdout_x: Optional[np.ndarray] = None
  holdout_y: Optional[np.ndarray] = None
  normalization: str = 'none'

  @property
  def input_shape(self) -> tuple:
    """(H, W, C) of one image: what model constructors need."""
    return tuple(int(d) for d in self.train_x.shape[1:])


def available_datasets() -> list:
  """Names `load_dataset` accepts besides the open-ended 'tfds:<name>' family."""
  return ['digits', *IDX_DATASETS, *CIFAR_DATASETS, *MAT_DATASETS]


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
  # The label order of batches.meta.txt / fine_label_names.txt (alphabetical), with spaces for
  # underscores so that prompts read naturally.
  'cifar100': tuple(
    n.replace('_', ' ')
    for n in (
      'apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus '
      'butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach '
      'couch crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster '
      'house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree '
      'motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree pear '
      'pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray road rocket '
      'rose sea seal shark shrew skunk skyscraper snail snake spider squirrel streetcar '
      'sunflower sweet_pepper table tank telephone television tiger tractor train trout tulip '
      'turtle wardrobe whale willow_tree wolf woman worm'
    ).split()
  ),
  'cifar100_coarse': tuple(
    n.replace('_', ' ')
    for n in (
      'aquatic_mammals fish flowers food_containers fruit_and_vegetables '
      'household_electrical_devices household_furniture insects large_carnivores '
      'large_man-made_outdoor_things large_natural_outdoor_scenes '
      'large_omnivores_and_herbivores medium_mammals non-insect_invertebrates people reptiles '
      'small_mammals trees vehicles_1 vehicles_2'
    ).split()
  ),
  'svhn': tuple(
    f'house number digit {w}' for w in 'zero one two three four five six seven eight nine'.split()
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
    name: 'digits', 'mnist', 'fashion_mnist', 'kmnist', 'emnist', 'cifar10', 'cifar100',
      'cifar100_coarse', 'svhn' or 'tfds:<tfds name>'.
    data_dir: for the file-based datasets, the directory holding the files (or its parent,
      holding a `<name>` subdirectory; for CIFAR also the directory the archive extracts to,
      e.g. `cifar-10-batches-bin/`, or its parent); by default `$JFED_DATA_DIR/<name>` and
      then `/usr/share/datasets/<name with - for _>` are searched ('cifar100_coarse' searches
      'cifar100'). For 'tfds:' names, the TFDS data directory (default: TFDS's own,
      `$TFDS_DATA_DIR` or ~/tensorflow_datasets).

  Returns:
    The `Dataset`; cached, so repeated loads are free. Its arrays are read-only: copy
    before modifying in place.

  Raises:
    ValueError: unknown name.
    DatasetNotFoundError: a known dataset that is not available locally.
    DataError: a data file that is truncated, corrupt, longer than its header says, or holds
      no samples, labels outside [0, num_classes) (negative labels for EMNIST, [1, 10] for
      SVHN), images that are not 0-255 pixel values (or, in float IDX files, values already
      scaled to [0, 1]), or (SVHN) variables missing or of the wrong shape or type; IDX train
      and test images of different shapes; the message names the file(s).
  """
  if name == 'digits':
    return _load_digits()
  if name in IDX_DATASETS:
    return _load_idx_dataset(name, str(_find_idx_dir(name, data_dir)))
  if name in CIFAR_DATASETS:
    return _load_cifar(name, str(_find_layout_dir(name, data_dir)))
  if name in MAT_DATASETS:
    return _load_svhn(str(_find_layout_dir(name, data_dir)))
  if name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX):
    return _load_tfds(name[len(TFDS_PREFIX) :], None if data_dir is None else str(data_dir))
  raise ValueError(
    f'Unknown dataset {name!r}. Valid names: {", ".join(available_datasets())}, '
    f'or {TFDS_PREFIX}<name> for a prepared TFDS dataset (e.g. tfds:cifar10).'
  )


class _IdxHeader(NamedTuple):
  """What an IDX header promises: the data's big-endian type and its dimensions."""

  dtype: np.dtype
  shape: tuple

  @property
  def described(self) -> str:
    """The header in words, magic number included: a wrong one shows up in what it implies."""
    type_byte = next(b for b, dtype in _IDX_DTYPES.items() if dtype == self.dtype)
    return (
      f'header (magic number 0x0000{type_byte:02x}{len(self.shape):02x}: '
      f'{self.dtype.name}, {len(self.shape)} dimensions)'
    )

  @property
  def data_bytes(self) -> int:
    """Exact, in Python integers: dimensions near 2**32 overflow NumPy's int64 product."""
    count = 1
    for d in self.shape:
      count *= d
    return count * self.dtype.itemsize


def read_idx(path, kind: Optional[str] = None) -> np.ndarray:
  """Reads one IDX file (gzipped or not) into a native-endian NumPy array.

  The format (http://yann.lecun.com/exdb/mnist/): two zero bytes, a type byte, the number
  of dimensions, the dimensions as big-endian uint32, then the big-endian data. The header is
  read and checked first; then exactly the data bytes it promises are read (and decompressed),
  plus one to see whether more follow, so a small gzip that inflates to gigabytes is refused
  after inflating no more than the header promised.

  Args:
    path: the file.
    kind: 'images' (3 or 4 dimensions) or 'labels' (1): the dimension counts its magic number
      may declare; None accepts any.

  Raises:
    DataError: the file cannot be read, is a truncated or corrupt gzip file, is not an IDX
      file (of `kind`), has a header promising more data than the file can hold, or holds fewer
      or more data bytes than its header says; the message names it.
  """
  path = pathlib.Path(path)
  with _open_idx(path) as (f, stored_bytes, gzipped):
    header = _read_idx_header(f, path, kind, stored_bytes, gzipped)
    return _read_idx_data(f, path, header)


def _idx_header(path, kind: Optional[str] = None) -> _IdxHeader:
  """The checked header of an IDX file, read without reading (or decompressing) its data."""
  path = pathlib.Path(path)
  with _open_idx(path) as (f, stored_bytes, gzipped):
    return _read_idx_header(f, path, kind, stored_bytes, gzipped)


@contextlib.contextmanager
def _open_idx(path: pathlib.Path) -> Iterator[tuple]:
  """(stream, size on disk, whether gzipped) for an IDX file; errors reading or decompressing
  it, raised by the caller's reads too, become a DataError naming it."""
  try:
    with open(path, 'rb') as raw:
      stored_bytes = os.fstat(raw.fileno()).st_size
      gzipped = raw.read(2) == b'\x1f\x8b'
      raw.seek(0)
      if gzipped:
        with gzip.GzipFile(fileobj=raw, mode='rb') as f:
          yield f, stored_bytes, True
      else:
        yield raw, stored_bytes, False
  except (EOFError, zlib.error, OSError) as e:  # gzip.BadGzipFile is an OSError.
    detail = getattr(e, 'strerror', None) or str(e) or type(e).__name__
    if _is_decompression_error(e):
      raise DataError(
        f'{path}: truncated or corrupt gzip file ({detail}); download it again.'
      ) from e
    raise DataError(f'{path}: cannot be read ({detail}).') from e


def _read_idx_header(
  f: BinaryIO, path: pathlib.Path, kind: Optional[str], stored_bytes: int, gzipped: bool
) -> _IdxHeader:
  """Reads and checks the header at the start of `f`; DataError (naming `path`) unless its
  magic number fits `kind` and the file can hold the data it promises."""
  magic = f.read(4)
  if not magic:
    raise DataError(f'{path}: empty (no IDX header); download it again.')
  ndims = _IDX_NDIMS[kind] if kind else range(256)
  if len(magic) < 4 or magic[:2] != b'\0\0' or magic[2] not in _IDX_DTYPES or magic[3] not in ndims:
    raise DataError(_bad_magic_message(path, magic, kind))
  dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
  dims = f.read(4 * ndim)
  if len(dims) < 4 * ndim:
    raise DataError(
      f'{path}: IDX header cut short ({4 + len(dims)} bytes for {ndim} dimensions); the file '
      f'is truncated. Download it again.'
    )
  header = _IdxHeader(dtype, struct.unpack(f'>{ndim}I', dims))
  header_bytes = 4 + 4 * ndim
  if gzipped and header.data_bytes > stored_bytes * _MAX_DEFLATE_RATIO:
    raise DataError(
      f'{path}: {header.described} promises shape {header.shape} ({header.data_bytes} data '
      f'bytes), more than a {stored_bytes}-byte gzip file can inflate to; its magic number or '
      f'dimensions are corrupt. Download the file again.'
    )
  if not gzipped and header.data_bytes != stored_bytes - header_bytes:
    raise DataError(_size_mismatch_message(path, header, stored_bytes - header_bytes))
  return header


def _read_idx_data(f: BinaryIO, path: pathlib.Path, header: _IdxHeader) -> np.ndarray:
  """Reads the data `header` promises from `f` (positioned after the header), and one byte
  more to refuse a file that holds more; never holds more than that in memory."""
  expected = header.data_bytes
  try:
    data = np.empty(header.shape, header.dtype)
  except (MemoryError, ValueError) as e:
    raise DataError(
      f'{path}: {header.described} promises shape {header.shape} ({expected} data bytes), '
      f'more than this machine can hold ({type(e).__name__}: {e}).'
    ) from e
  out = data.reshape(-1).view(np.uint8)
  filled = 0
  while filled < expected:
    chunk = f.read(min(_IDX_READ_CHUNK, expected - filled))
    if not chunk:
      break
    out[filled : filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
    filled += len(chunk)
  if filled < expected:
    raise DataError(_size_mismatch_message(path, header, filled))
  if f.read(1):
    raise DataError(_size_mismatch_message(path, header, None))
  return data.astype(header.dtype.newbyteorder('='), copy=False)


def _size_mismatch_message(path: pathlib.Path, header: _IdxHeader, held: Optional[int]) -> str:
  """Why a file's data disagrees with its header; `held`: the data bytes it holds, None when
  it holds more than the header promises and was not read to its end."""
  if held is None or held > header.data_bytes:
    count = '' if held is None else f' ({held} bytes)'
    return (
      f'{path}: holds more data{count} than its {header.described} promises (shape '
      f'{header.shape}: {header.data_bytes} data bytes); the file is corrupt. Download it again.'
    )
  return (
    f'{path}: {header.described} promises shape {header.shape} ({header.data_bytes} data '
    f'bytes), but the file holds only {held} data bytes; it is truncated or its magic number '
    f'or dimensions are corrupt. Download it again.'
  )


def _bad_magic_message(path: pathlib.Path, magic: bytes, kind: Optional[str]) -> str:
  """Why `magic` (the first bytes of `path`, at most 4) is not that of an IDX file of `kind`."""
  types = ', '.join(f'0x{byte:02x} {dtype.name}' for byte, dtype in _IDX_DTYPES.items())
  got = f'0x{magic.hex()}' + ('' if len(magic) == 4 else f' (the file is only {len(magic)} bytes)')
  what = f'an IDX {kind} file' if kind else 'an IDX file'
  if kind:
    type_byte = magic[2] if len(magic) > 2 and magic[2] in _IDX_DTYPES else 0x08
    expected = ' or '.join(f'0x0000{type_byte:02x}{n:02x}' for n in _IDX_NDIMS[kind])
  else:
    expected = '0x0000TTNN'
  return (
    f'{path} is not {what} (bad magic number {got}; expected {expected}: two zero bytes, '
    f'the type byte ({types}) and the number of dimensions).'
  )


def _is_decompression_error(error: BaseException) -> bool:
  """Whether `error` comes from decompressing (rather than opening or reading) a file."""
  return isinstance(error, (EOFError, zlib.error, gzip.BadGzipFile))


def _check_idx_images(images: np.ndarray, path) -> bool:
  """Raises DataError (naming `path`) unless `images` are [N, H, W(, C)] pixel values; returns
  whether they are already scaled to [0, 1].

  Integer files (uint8 always passes) must hold values in [0, 255]: they are pixel values,
  never already scaled, even when none exceeds 1. Float files must hold finite values: in
  [0, 1] they are taken as already scaled, otherwise they must lie in [0, 255].
  """
  if images.ndim not in (3, 4):
    raise DataError(f'{path}: images must be [N, H, W] or [N, H, W, C], got shape {images.shape}.')
  if images.dtype == np.uint8 or not images.size:
    return False
  is_float = np.issubdtype(images.dtype, np.floating)
  if is_float and not np.all(np.isfinite(images)):
    bad = int(np.size(images) - np.count_nonzero(np.isfinite(images)))
    raise DataError(
      f'{path}: {bad} image values are NaN or infinite; expected pixel values in [0, 255] '
      f'(or, for float images, already scaled to [0, 1]).'
    )
  low, high = images.min(), images.max()
  if low < 0 or high > 255:
    expected = (
      'pixel values in [0, 255] or float images already scaled to [0, 1]'
      if is_float
      else 'pixel values in [0, 255]'
    )
    raise DataError(f'{path}: image values span [{low}, {high}]; expected {expected}.')
  return bool(is_float and high <= 1)


def _check_idx_labels(
  labels: np.ndarray, path, num_classes: Optional[int], what: str = 'labels'
) -> None:
  """Raises DataError (naming `path`) unless `labels` are 1-D integers in [0, num_classes).

  With `num_classes=None` (a dataset whose class count is not fixed) only negative labels
  are rejected. `what` names the labels in the message (e.g. 'fine labels').
  """
  if labels.ndim != 1:
    raise DataError(f'{path}: {what} must be 1-D, got shape {labels.shape}.')
  if not np.issubdtype(labels.dtype, np.integer):
    raise DataError(f'{path}: {what} must be integers, got type {labels.dtype}.')
  if not labels.size:
    return
  low, high = int(labels.min()), int(labels.max())
  if low < 0 or (num_classes is not None and high >= num_classes):
    bad = labels < 0 if num_classes is None else (labels < 0) | (labels >= num_classes)
    valid = '>= 0' if num_classes is None else f'in [0, {num_classes})'
    raise DataError(f'{path}: {int(bad.sum())} {what} are not {valid} (they span [{low}, {high}]).')


def _search_dirs(name: str, data_dir: Optional[str]) -> list:
  """Directories that may hold the files of `name`, in priority order, without repeats."""
  dashed = name.replace('_', '-')
  if data_dir is not None:
    root = pathlib.Path(data_dir).expanduser()
    return list(dict.fromkeys([root, root / name, root / dashed]))
  dirs = []
  env = os.environ.get(DATA_DIR_ENV)
  if env:
    root = pathlib.Path(env).expanduser()
    dirs += [root / name, root / dashed]
  dirs.append(SYSTEM_DATA_DIR / dashed)
  return list(dict.fromkeys(dirs))


def _file_kind(path: pathlib.Path) -> str:
  """What `path` is when it is not a regular file, in words (after symlinks)."""
  mode = path.stat().st_mode
  for test, kind in (
    (stat.S_ISDIR, 'a directory'),
    (stat.S_ISFIFO, 'a FIFO'),
    (stat.S_ISCHR, 'a character device'),
    (stat.S_ISBLK, 'a block device'),
    (stat.S_ISSOCK, 'a socket'),
  ):
    if test(mode):
      return kind
  return 'not a regular file'


def _find_idx_file(directory: pathlib.Path, split: str, kind: str) -> Optional[pathlib.Path]:
  """The IDX file for (split, kind) in `directory`, by MNIST name or a `*-<MNIST name>` one."""
  stems = _IDX_STEMS[(split, kind)]
  for stem in stems:
    for candidate in (directory / f'{stem}.gz', directory / stem):
      if candidate.is_file():
        return candidate
      if candidate.exists():
        raise DataError(
          f'{candidate} is {_file_kind(candidate)}, not a regular file: give the {split} '
          f'{kind} as an IDX file (or its .gz).'
        )
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


def idx_files(name: str, data_dir: Optional[str] = None) -> Dict[Tuple[str, str], pathlib.Path]:
  """The four IDX files `load_dataset(name, data_dir)` reads, by (split, kind), e.g.
  ('train', 'images'); for tools that hand the same files to other code."""
  directory = _find_idx_dir(name, data_dir)
  return {key: _find_idx_file(directory, *key) for key in _IDX_STEMS}


def _find_idx_dir(name: str, data_dir: Optional[str]) -> pathlib.Path:
  """The first search directory holding all four IDX files, else a helpful error."""
  dirs = _search_dirs(name, data_dir)
  for directory in dirs:
    if directory.is_dir() and all(_find_idx_file(directory, s, k) for s, k in _IDX_STEMS):
      return directory.resolve()
  files = ', '.join(s[0] + '.gz' for s in _IDX_STEMS.values())
  raise _not_found(
    name, dirs, f'the four IDX files ({files}; un-gzipped files are accepted too)', name
  )


def _not_found(name: str, dirs: Sequence, needs: str, source: str, hint: str = ''):
  """The DatasetNotFoundError for `name`: where it looked, how to get the files, where to put
  them (`source`: the directory name searched for them) and any TFDS alternative."""
  tfds_name = _TFDS_ALTERNATIVES.get(name, name)
  alternative = (
    f' Alternatively use {TFDS_PREFIX}{tfds_name} with a TFDS dataset prepared in the '
    f'array_record format.'
    if tfds_name
    else ''
  )
  return DatasetNotFoundError(
    f'Dataset {name!r} not found; searched {[str(d) for d in dirs]}.{hint} To get it, '
    f'{_WHERE_TO_GET[name]}. The loader needs {needs} in a directory passed as data_dir=..., '
    f'or in ${DATA_DIR_ENV}/{source}, or in {SYSTEM_DATA_DIR / source.replace("_", "-")}.'
    f'{alternative}'
  )


def _find_layout_dir(name: str, data_dir: Optional[str]) -> pathlib.Path:
  """The first search directory (or archive subdirectory) holding every file of `name`."""
  layout = _FILE_LAYOUTS[name]
  dirs = []
  for directory in _search_dirs(layout.source, data_dir):
    dirs += [directory, directory / layout.subdir] if layout.subdir else [directory]
  files = layout.train + layout.test
  for directory in dirs:
    if all((directory / f).is_file() for f in files):
      return directory.resolve()
  needs = f'the files {", ".join(files)}'
  if layout.subdir:
    needs += f' (or the {layout.subdir}/ directory holding them)'
  hint = _layout_hint(layout.source, dirs)
  raise _not_found(name, dirs, needs, layout.source, hint)


def _layout_hint(source: str, dirs: Sequence[pathlib.Path]) -> str:
  """Why the files were not found, where a searched directory shows it: an archive not yet
  extracted, or CIFAR's pickled Python version (which jfed refuses to unpickle)."""
  archive, pickled = _CIFAR_ARCHIVES.get(source), _PICKLED_CIFAR_DIRS.get(source)
  for directory in dirs:
    if archive and (directory / archive).is_file():
      return f' Found {directory / archive}: extract it (`tar xzf {archive}`).'
    if pickled and (directory.name == pickled or (directory / pickled).is_dir()):
      found = directory if directory.name == pickled else directory / pickled
      return (
        f' Found {found}, the Python version, which jfed does not read because loading it '
        f'means unpickling (which can run arbitrary code); get the binary version instead.'
      )
  return ''


def _to_images(raw: np.ndarray, transpose: bool, already_scaled: bool = False) -> np.ndarray:
  """[N, H, W] or [N, H, W, C] pixel values in [0, 255] (or, `already_scaled`, in [0, 1]) ->
  float32 NHWC in [0, 1]."""
  x = np.asarray(raw)
  if x.ndim == 3:
    x = x[..., None]
  if transpose:
    x = np.swapaxes(x, 1, 2)
  if already_scaled:
    return np.ascontiguousarray(x, dtype=np.float32)
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
  """Reads the four IDX files of `name` in `directory`.

  Every header is read and checked against the others before any file's data is read: each
  file must hold samples, images and labels of a split must agree in number, and train and
  test images in shape. Images of an integer type are 0-255 pixel values, scaled by 1/255.
  Float images whose values all lie in [0, 1] are taken as already scaled and kept as they
  are; other float images must lie in [0, 255] and are scaled by 1/255. The two image files
  must agree: both already scaled, or both pixel values (`_check_one_scale`).
  """
  directory = pathlib.Path(directory)
  transpose = name.startswith(_TRANSPOSED_PREFIXES)
  known_classes = _IDX_NUM_CLASSES.get(name)
  paths = {(split, kind): _find_idx_file(directory, split, kind) for split, kind in _IDX_STEMS}
  headers = {key: _idx_header(path, key[1]) for key, path in paths.items()}
  _check_idx_headers(directory, paths, headers)
  arrays, already_scaled = {}, {}
  for (split, kind), path in paths.items():
    arrays[split, kind] = read_idx(path, kind)
    if kind == 'images':
      already_scaled[split] = _check_idx_images(arrays[split, kind], path)
    else:
      _check_idx_labels(arrays[split, kind], path, known_classes)
  _check_one_scale(paths, arrays, already_scaled)
  train_y = arrays['train', 'labels'].astype(np.int32)
  test_y = arrays['test', 'labels'].astype(np.int32)
  # EMNIST 'letters' labels run 1..26, so class 0 stays empty; num_classes covers max label.
  num_classes = known_classes or int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1
  train_x, test_x = (
    _to_images(arrays[split, 'images'], transpose, already_scaled[split])
    for split in ('train', 'test')
  )
  return _freeze(Dataset(name, train_x, train_y, test_x, test_y, num_classes))


def _check_one_scale(paths: dict, arrays: dict, already_scaled: dict) -> None:
  """Raises DataError naming both image files unless they share one scale: a split of floats
  already in [0, 1] beside one of pixel values would be scaled apart (a test file with one
  value of 1.01 divided by 255 while the training floats are kept)."""
  if already_scaled['train'] == already_scaled['test']:
    return

  def described(split: str) -> str:
    images = arrays[split, 'images']
    kind = (
      'floats already scaled to [0, 1]'
      if already_scaled[split]
      else f'{images.dtype.name} pixel values in [0, 255]'
    )
    high = images.max() if images.size else 0
    return f'{paths[split, "images"]} holds {kind} (max {high:g})'

  raise DataError(
    f'{described("train")} but {described("test")}; the splits of a dataset must share one '
    'scale: write both as 0-255 pixel values or both as floats in [0, 1].'
  )


def _check_idx_headers(directory: pathlib.Path, paths: dict, headers: dict) -> None:
  """Raises DataError naming the file(s) unless the four headers fit together: every file
  holds samples, images have pixels, and the splits agree in length and image shape."""
  for (split, kind), header in headers.items():
    if header.shape[0] == 0:
      raise DataError(
        f'{paths[split, kind]}: holds no samples (its header says shape {header.shape}); the '
        f'file is empty or not the {split} {kind} of this dataset. Download it again.'
      )
    if kind == 'images' and 0 in header.shape[1:]:
      raise DataError(
        f'{paths[split, kind]}: images of shape {_image_size(header.shape[1:])} hold no pixels.'
      )
  for split in ('train', 'test'):
    images, labels = headers[split, 'images'].shape[0], headers[split, 'labels'].shape[0]
    if images != labels:
      raise DataError(
        f'{directory}: {split} images and labels differ in length ({images} in '
        f'{paths[split, "images"]}, {labels} in {paths[split, "labels"]}).'
      )
  train, test = (headers[split, 'images'].shape[1:] for split in ('train', 'test'))
  # [N, H, W] is read as [N, H, W, 1]: the two spellings of one channel agree.
  if train + (1,) * (3 - len(train)) != test + (1,) * (3 - len(test)):
    raise DataError(
      f'Train and test images differ in shape: {_image_size(train)} in '
      f'{paths["train", "images"]}, {_image_size(test)} in {paths["test", "images"]}; both '
      f'splits must come from the same dataset.'
    )


def _image_size(shape: Sequence[int]) -> str:
  """'28x28', '32x32x3': the size of one image, from its shape without the sample count."""
  return 'x'.join(str(d) for d in shape)


def _read_cifar_file(path: pathlib.Path, labels: Sequence[tuple]) -> tuple:
  """Reads one file of CIFAR's binary version: fixed-size records of `len(labels)` label
  bytes, then 1024 red, 1024 green and 1024 blue bytes, each plane a row-major 32x32 image.

  Returns:
    (labels [N, len(labels)] uint8, images [N, 32, 32, 3] uint8).

  Raises:
    DataError: the file cannot be read, is empty, is not a whole number of records
      (truncated, or not the binary version) or holds labels outside their class range; the
      message names it.
  """
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f'{path}: cannot be read ({e.strerror or e}).') from e
  record = len(labels) + _CIFAR_PIXEL_BYTES
  if not raw:
    raise DataError(f'{path}: empty file; download and extract the archive again.')
  if len(raw) % record:
    raise DataError(
      f'{path}: {len(raw)} bytes is not a whole number of {record}-byte records '
      f'({len(labels)} label byte(s) + {_CIFAR_PIXEL_BYTES} pixel bytes each); the file is '
      f'truncated or not from the binary version. Download and extract the archive again.'
    )
  records = np.frombuffer(raw, np.uint8).reshape(-1, record)
  for i, (what, num_classes) in enumerate(labels):
    _check_idx_labels(records[:, i], path, num_classes, what=what)
  planes = records[:, len(labels) :].reshape(-1, 3, _CIFAR_SIDE, _CIFAR_SIDE)
  return records[:, : len(labels)], planes.transpose(0, 2, 3, 1)


@functools.lru_cache(maxsize=None)
def _load_cifar(name: str, directory: str) -> Dataset:
  directory = pathlib.Path(directory)
  layout = _FILE_LAYOUTS[name]
  labels, label_index = _CIFAR_LABELS[name]
  splits = []
  for files in (layout.train, layout.test):
    read = [_read_cifar_file(directory / f, labels) for f in files]
    images = np.concatenate([images for _, images in read])
    y = np.concatenate([y[:, label_index] for y, _ in read]).astype(np.int32)
    splits += [_to_images(images, transpose=False), y]
  return _freeze(Dataset(name, *splits, labels[label_index][1]))


def _read_svhn_mat(path: pathlib.Path) -> tuple:
  """Reads one SVHN format-2 file: X [32, 32, 3, N] uint8 and y [N, 1] with 10 for digit 0.

  Returns:
    (images [N, 32, 32, 3] uint8, labels [N] int32 in [0, 10)).

  Raises:
    DataError: the file is not a readable MATLAB v5 .mat file, lacks X or y, or holds them
      with the wrong shape, type or label range; the message names it.
  """
  from scipy import io as sio  # pylint: disable=g-import-not-at-top

  try:
    mat = sio.loadmat(path, variable_names=('X', 'y'))
  except NotImplementedError as e:
    raise DataError(
      f'{path}: a MATLAB v7.3 (HDF5) file ({e}); jfed reads the MATLAB v5 files that SVHN '
      f'distributes. Download it again.'
    ) from e
  except (sio.matlab.MatReadError, OSError, EOFError, ValueError, TypeError, LookupError) as e:
    # A cut-off file surfaces as any of these, depending on where the cut falls.
    raise DataError(
      f'{path}: not a readable MATLAB .mat file ({type(e).__name__}: {e}); the file is '
      f'truncated or corrupt. Download it again.'
    ) from e
  missing = [k for k in ('X', 'y') if k not in mat]
  if missing:
    # `mat` holds only the variables asked for; list them all to show what the file is.
    held = sorted(v for v, _, _ in sio.whosmat(path))
    raise DataError(
      f'{path}: no variable {" or ".join(missing)} (it holds {held}); expected SVHN format 2, '
      f'X [32, 32, 3, N] uint8 and y [N, 1].'
    )
  x, y = mat['X'], mat['y']
  if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != _SVHN_IMAGE_SHAPE:
    raise DataError(
      f'{path}: X must be uint8 of shape [32, 32, 3, N], got {x.dtype} {list(x.shape)}.'
    )
  if y.ndim != 2 or 1 not in y.shape:
    raise DataError(f'{path}: y must be [N, 1], got shape {list(y.shape)}.')
  y = y.reshape(-1)
  if not np.issubdtype(y.dtype, np.integer):
    raise DataError(f'{path}: y must hold integers, got type {y.dtype}.')
  if len(y) != x.shape[3]:
    raise DataError(f'{path}: X holds {x.shape[3]} images but y {len(y)} labels.')
  bad = (y < 1) | (y > 10)
  if bad.any():
    raise DataError(
      f'{path}: {int(bad.sum())} labels are not in [1, 10] (SVHN writes digit 0 as 10; they '
      f'span [{int(y.min())}, {int(y.max())}]).'
    )
  return x.transpose(3, 0, 1, 2), np.where(y == 10, 0, y).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _load_svhn(directory: str) -> Dataset:
  directory = pathlib.Path(directory)
  layout = _FILE_LAYOUTS['svhn']
  splits = []
  for (file,) in (layout.train, layout.test):
    images, labels = _read_svhn_mat(directory / file)
    splits += [_to_images(images, transpose=False), labels]
  return _freeze(Dataset('svhn', *splits, 10))


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
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DatasetNotFoundError(
      f'tfds:{tfds_name} needs TensorFlow Datasets: pip install "jfed[tfds]"'
    ) from None
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
