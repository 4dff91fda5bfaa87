"""A SuperNode's own data (node config `data-dir=PATH`): its clients' files, read and checked.

The directory holds one file per client, `client_<id>.npz` (`<id>` the client's id, in
[0, partition.num_clients) of the run config), with two arrays, written e.g. by
`np.savez(path, x=x, y=y)`:
  x  the client's images in the dataset's layout, [n, H, W, C] (n >= 1): uint8 in [0, 255]
     (scaled by 1/255, as jfed's loaders do) or floating point in [0, 1], finite;
  y  their integer labels, [n], in [0, num_classes).
Other files in the directory are ignored. Files are read with `allow_pickle=False`: an object
array (which only a pickle could hold) is refused, never unpickled.

The format checks need only the node's own config (`load_clients`, when the node starts); the
dataset's image shape and number of classes come from the server, which scores on the config's
test split, and are checked against every file (`check_spec`, at the first message). Every
problem is one ConfigError line naming the file.

No JAX here: `jfed.flower.deploy` checks the directories with it before any Flower process starts.
"""

import pathlib
import re
from typing import Dict, List, Mapping, NamedTuple, Sequence, Tuple
import zipfile

import numpy as np

from jfed.errors import ConfigError

CLIENT_FILE = re.compile(r'client_(\d+)\.npz')


class ClientData(NamedTuple):
  """One client's samples as a node holds them."""

  path: str  # the file, for error messages
  x: np.ndarray  # [n, H, W, C] float32 in [0, 1]
  y: np.ndarray  # [n] int32


def load_clients(data_dir: str, num_clients: int) -> Dict[int, ClientData]:
  """The clients of a SuperNode's data directory, by client id, their format checked.

  Args:
    data_dir: The directory of `client_<id>.npz` files (the node config's `data-dir`).
    num_clients: The run's number of clients (`partition.num_clients`).

  Returns:
    {client id: its ClientData}, sorted by id; ConfigError (one line naming the file) for a
    missing directory, no client file, an unreadable, pickled or malformed file or an id out of
    range.
  """
  folder = pathlib.Path(data_dir)
  if not folder.is_dir():
    raise ConfigError(f'node config data-dir={data_dir}: no such directory')
  files = {}
  for path in sorted(folder.iterdir()):
    match = CLIENT_FILE.fullmatch(path.name)
    if match is None:
      continue
    cid = int(match.group(1))
    if cid in files:  # client_3.npz and client_03.npz
      raise ConfigError(f'{path}: client {cid} has another file too ({files[cid]})')
    if not 0 <= cid < num_clients:
      raise ConfigError(
        f'{path}: client {cid} is not in [0, {num_clients}) (the run config partition.num_clients)'
      )
    files[cid] = path
  if not files:
    raise ConfigError(f'node config data-dir={data_dir}: holds no client_<id>.npz file')
  return {cid: _read(str(files[cid])) for cid in sorted(files)}


def write_clients(
  data_dir: str, clients: Mapping[int, Tuple[np.ndarray, np.ndarray]]
) -> List[pathlib.Path]:
  """Writes each client's samples as the `client_<id>.npz` that `load_clients` reads.

  Args:
    data_dir: The node's directory (created if missing). One that already holds client files is
      refused: files of two exports would mix two partitions.
    clients: {client id: (x [n, H, W, C] in [0, 1] or uint8, y [n] integer labels)}.

  Returns:
    The files written, by client id.
  """
  folder = pathlib.Path(data_dir)
  if folder.is_dir() and any(CLIENT_FILE.fullmatch(f.name) for f in folder.iterdir()):
    raise ConfigError(f'{data_dir} already holds client_<id>.npz files; choose an empty directory')
  folder.mkdir(parents=True, exist_ok=True)
  written = []
  for cid in sorted(clients):
    x, y = clients[cid]
    path = folder / f'client_{int(cid)}.npz'
    np.savez(path, x=np.asarray(x), y=np.asarray(y))
    written.append(path)
  return written


def _read(path: str) -> ClientData:
  if not zipfile.is_zipfile(path):  # np.load would take anything else for a .npy or a pickle
    raise ConfigError(f'{path}: not a readable .npz file (not a zip archive)')
  try:
    with np.load(path, allow_pickle=False) as archive:
      missing = [k for k in ('x', 'y') if k not in archive.files]
      if missing:
        raise ConfigError(f'{path}: no {" and no ".join(missing)} array (it holds {archive.files})')
      x, y = archive['x'], archive['y']
  except ConfigError:
    raise
  except ValueError as e:  # numpy: "Object arrays cannot be loaded when allow_pickle=False"
    if 'allow_pickle' in str(e):
      raise ConfigError(f'{path}: holds an object array (a pickle), which is not loaded') from None
    raise ConfigError(f'{path}: not a readable .npz file ({e})') from None
  except (OSError, zipfile.BadZipFile, EOFError) as e:
    raise ConfigError(f'{path}: not a readable .npz file ({type(e).__name__}: {e})') from None
  if x.ndim != 4:
    raise ConfigError(f'{path}: x has shape {list(x.shape)}, expected [n, height, width, channels]')
  if y.ndim != 1 or len(y) != len(x):
    raise ConfigError(f'{path}: y has shape {list(y.shape)}, expected [{len(x)}] (one label per x)')
  if len(x) == 0:
    raise ConfigError(f'{path}: holds no samples')
  if not np.issubdtype(y.dtype, np.integer):
    raise ConfigError(f'{path}: y is {y.dtype}, expected integer labels')
  if x.dtype == np.uint8:
    x = x.astype(np.float32) / np.float32(255.0)
  elif np.issubdtype(x.dtype, np.floating):
    if not np.all(np.isfinite(x)):
      raise ConfigError(f'{path}: x holds non-finite values')
    if x.min() < 0.0 or x.max() > 1.0:
      raise ConfigError(
        f'{path}: x spans [{x.min():g}, {x.max():g}], expected floating point images in [0, 1] '
        '(or uint8 in [0, 255])'
      )
    x = x.astype(np.float32)
  else:
    raise ConfigError(f'{path}: x is {x.dtype}, expected uint8 or floating point images')
  if y.min() < 0:
    raise ConfigError(f'{path}: y holds the negative label {y.min()}')
  return ClientData(path, np.ascontiguousarray(x), y.astype(np.int32))


def check_spec(
  clients: Dict[int, ClientData], input_shape: Sequence[int], num_classes: int
) -> None:
  """ConfigError (one line naming the file) for a client whose images are not `input_shape` or
  whose labels are not in [0, num_classes): the run's dataset, as the server says.

  Args:
    clients: The node's clients, from `load_clients`.
    input_shape: The dataset's image shape [H, W, C].
    num_classes: The dataset's number of classes.
  """
  shape = tuple(int(d) for d in input_shape)
  for data in clients.values():
    if tuple(data.x.shape[1:]) != shape:
      raise ConfigError(
        f"{data.path}: x has images of shape {list(data.x.shape[1:])}, the run's dataset "
        f'{list(shape)}'
      )
    if data.y.max() >= num_classes:
      raise ConfigError(
        f"{data.path}: y holds the label {data.y.max()}, outside the dataset's [0, {num_classes})"
      )


def duplicate_clients(per_node: Sequence[Sequence[int]]) -> Dict[int, list]:
  """{client id: the nodes (indices into `per_node`) that declare it} for every client more
  than one node declares."""
  holders: Dict[int, list] = {}
  for node, ids in enumerate(per_node):
    for cid in ids:
      holders.setdefault(int(cid), []).append(node)
  return {cid: nodes for cid, nodes in sorted(holders.items()) if len(nodes) > 1}
