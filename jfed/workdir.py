"""A run's directory: atomic files, one run at a time, and an identity that results cannot mix.

- Every file a run rewrites goes through `atomic_write_text` (temporary file + rename), so a kill
  leaves either the old or the new content, never a torn one.
- `Workdir.lock()` holds an exclusive `flock` on `<workdir>/.lock` for the whole run: a second
  run on the same workdir is refused at once. The kernel drops the lock when its process dies,
  so a lock file left by a killed run is simply taken over.
- `identity.json` records what the workdir holds (method, resolved config, dataset and a
  fingerprint of its arrays, jfed version). A run whose identity differs is refused, naming the
  differing keys, as soon as the workdir holds progress (a checkpoint of any stage) or a
  summary; before that, the identity of a failed start is simply replaced, so a config that
  failed late does not block the corrected run.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import pathlib
import tempfile
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from jfed.errors import WorkdirBusy, WorkdirError

IDENTITY_FILE = 'identity.json'
LOCK_FILE = '.lock'
# Subdirectories whose checkpoints count as progress (the driver's and the stage caches').
PROGRESS_DIRS = ('checkpoints', 'stages', 'local_models')


def jsonable(value: Any) -> Any:
  """Plain JSON types; non-finite floats become None, so no file holds a bare NaN token."""
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    value = float(value)
    return value if math.isfinite(value) else None
  if isinstance(value, np.ndarray) or hasattr(value, '__array__'):
    return jsonable(np.asarray(value).tolist())
  return value


def dumps(obj: Any, **kwargs) -> str:
  return json.dumps(jsonable(obj), allow_nan=False, **kwargs)


def atomic_write_bytes(path, data: bytes) -> None:
  """Writes `data` to `path` via a temporary file in the same directory and a rename, so that
  an interrupted write never leaves a truncated file behind. An OSError names `path` (a full
  disk's write error names no file)."""
  path = pathlib.Path(path)
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(prefix=f'.{path.name}.', suffix='.tmp', dir=path.parent)
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
    if isinstance(e, OSError) and e.errno is not None:
      raise OSError(e.errno, e.strerror, str(path)) from e
    raise


def atomic_write_text(path, text: str) -> None:
  """Writes `text` to `path` atomically (see `atomic_write_bytes`)."""
  atomic_write_bytes(path, text.encode())


def write_json(path, obj: Any) -> None:
  atomic_write_text(path, dumps(obj, indent=2, sort_keys=True) + '\n')


def array_fingerprint(*arrays: np.ndarray) -> str:
  """sha256 over the dtypes, shapes and bytes of `arrays` (16 hex digits)."""
  h = hashlib.sha256()
  for a in arrays:
    a = np.ascontiguousarray(a)
    h.update(f'{a.dtype.str}{a.shape}'.encode())
    h.update(memoryview(a).cast('B'))
  return h.hexdigest()[:16]


def _flatten(tree: Any, prefix: str = '') -> Dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f'{prefix}.{k}' if prefix else str(k)))
    return out
  return {prefix: tree}


def identity_differences(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
  """Dotted keys whose values differ between two identities (missing keys count)."""
  a, b = _flatten(old), _flatten(new)
  return sorted(k for k in set(a) | set(b) if a.get(k, '<absent>') != b.get(k, '<absent>'))


class Workdir:
  """The directory of one run (see the module docstring)."""

  def __init__(self, path):
    self.path = pathlib.Path(path)

  def prepare(self) -> None:
    """Creates the directory; a clear WorkdirError if it is a file or cannot be written."""
    if self.path.exists() and not self.path.is_dir():
      raise WorkdirError(f'workdir {self.path} exists and is not a directory')
    try:
      self.path.mkdir(parents=True, exist_ok=True)
      probe = tempfile.NamedTemporaryFile(dir=self.path, prefix='.probe')
      probe.close()
    except OSError as e:
      raise WorkdirError(f'workdir {self.path} cannot be written: {e.strerror or e}') from None

  @contextlib.contextmanager
  def lock(self) -> Iterator[None]:
    """Exclusive for the duration of the run; refused at once if another process holds it."""
    path = self.path / LOCK_FILE
    try:
      f = open(path, 'a+')
    except OSError as e:
      raise WorkdirError(f'workdir {self.path} cannot be written: {e.strerror or e}') from None
    try:
      try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
          raise
        f.seek(0)
        holder = f.read().strip() or 'another process'
        raise WorkdirBusy(
          f'workdir {self.path} is busy: a run ({holder}) is using it; wait for '
          'it to finish or choose another --workdir'
        ) from None
      f.seek(0)
      f.truncate()
      f.write(f'pid {os.getpid()} on {os.uname().nodename}\n')
      f.flush()
      yield
    finally:
      f.close()  # closing the descriptor releases the flock

  def read_identity(self) -> Optional[Dict[str, Any]]:
    path = self.path / IDENTITY_FILE
    if not path.exists():
      return None
    try:
      return json.loads(path.read_text())
    except (OSError, ValueError):
      return {'unreadable': str(path)}

  def has_progress(self) -> bool:
    """Whether the workdir holds a summary or a checkpoint of any stage."""
    if (self.path / 'summary.json').exists():
      return True
    for name in PROGRESS_DIRS:
      d = self.path / name
      if d.is_dir() and any(p.name[:1].isdigit() for p in d.rglob('*') if p.is_dir()):
        return True
    return False

  def check_identity(self, identity: Dict[str, Any]) -> None:
    """Refuses a workdir that holds progress of a run with another identity.

    `identity` may be partial (before the data are loaded): only its keys are compared.
    """
    old = self.read_identity()
    if old is None:
      if self.has_progress():
        raise WorkdirError(
          f'workdir {self.path} holds results of an unknown run (no '
          f'{IDENTITY_FILE}); use a new --workdir or delete it'
        )
      return
    if not self.has_progress():
      return
    old = {k: v for k, v in old.items() if k in identity}
    diff = identity_differences(old, jsonable(identity))
    if diff:
      shown = ', '.join(diff[:8]) + (f' and {len(diff) - 8} more' if len(diff) > 8 else '')
      raise WorkdirError(
        f'workdir {self.path} holds a run of {old.get("method")!r} that '
        f'differs in {shown}; use a new --workdir (or delete {self.path}) '
        'to start this one'
      )

  def write_identity(self, identity: Dict[str, Any], config_json: str) -> None:
    write_json(self.path / IDENTITY_FILE, identity)
    atomic_write_text(self.path / 'config.json', config_json + '\n')
