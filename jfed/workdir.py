"""A run's directory: atomic files, one run at a time, and an identity that results cannot mix.

- Every file a run rewrites goes through `atomic_write_text` (temporary file + rename), so a kill
  leaves either the old or the new content, never a torn one; its mode is the umask's, as for
  any file open() creates.
- A run refused before it wrote anything removes the directories `Workdir.prepare` created
  (`remove_if_unused`), never one that existed before or holds anything.
- `Workdir.lock()` holds an exclusive `flock` on `<workdir>/.lock` for the whole run: a second
  run on the same workdir is refused at once, naming the holder. The kernel drops the lock when
  its process dies, so the lock file of a killed run is taken over, with a one-line warning
  naming the dead pid; a run that ends removes its lock file. A child forked while the lock is
  held closes its copy, so it cannot keep the lock after the run ends. Where the file system has
  no `flock` (some network file systems), the pid in the file is the lock: a dead pid on this
  host is replaced, a live one refuses.
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
import re
import secrets
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from absl import logging
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


def _create_temporary(path: pathlib.Path) -> Tuple[int, str]:
  """A new file beside `path`, open for writing, with the mode open() gives a new file: 0666
  less the umask (mkstemp's 0600 kept collaborators on a shared file system from reading the
  results; the kernel applies the umask, which a process cannot read without changing it)."""
  for _ in range(100):
    tmp = str(path.parent / f'.{path.name}.{secrets.token_hex(4)}.tmp')
    try:
      return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
    except FileExistsError:
      continue
  raise FileExistsError(errno.EEXIST, 'no unused temporary file name', str(path.parent))


def atomic_write_bytes(path, data: bytes) -> None:
  """Writes `data` to `path` via a temporary file in the same directory and a rename, so that
  an interrupted write never leaves a truncated file behind. The file gets the mode open() gives
  a new file (0644 under umask 022). An OSError names `path` (a full disk's write error names no
  file)."""
  path = pathlib.Path(path)
  tmp = None
  try:
    fd, tmp = _create_temporary(path)
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
    self._created: List[pathlib.Path] = []  # by `prepare`, the workdir first, then its parents

  def prepare(self) -> None:
    """Creates the directory; a clear WorkdirError if it is a file or cannot be written."""
    if self.path.exists() and not self.path.is_dir():
      raise WorkdirError(f'workdir {self.path} exists and is not a directory')
    missing = self.path
    while not missing.exists() and missing != missing.parent:
      self._created.append(missing)
      missing = missing.parent
    try:
      self.path.mkdir(parents=True, exist_ok=True)
      probe = tempfile.NamedTemporaryFile(dir=self.path, prefix='.probe')
      probe.close()
    except OSError as e:
      raise WorkdirError(f'workdir {self.path} cannot be written: {e.strerror or e}') from None

  def remove_if_unused(self) -> None:
    """Removes the directories `prepare` created while they are empty: a run refused before it
    wrote anything leaves no empty workdir behind. A directory that existed before, or that
    holds anything (rmdir refuses), is kept."""
    for d in self._created:
      try:
        d.rmdir()
      except OSError:
        return
    self._created = []

  @contextlib.contextmanager
  def lock(self) -> Iterator[None]:
    """Exclusive for the duration of the run; refused at once if another process holds it."""
    path = self.path / LOCK_FILE
    f = self._open_locked(path)
    if f is None:  # no flock on this file system
      with _pid_lock(path, self.path):
        yield
      return
    try:
      f.seek(0)
      previous = f.read().strip()
      if previous:
        print(f'warning: workdir {self.path}: {_stale_note(previous)}', file=sys.stderr, flush=True)
      f.seek(0)
      f.truncate()
      f.write(_holder_line())
      f.flush()
      _HELD_FDS.add(f.fileno())
      yield
    finally:
      _HELD_FDS.discard(f.fileno())
      with contextlib.suppress(OSError):  # still ours: nobody replaces it while it is locked
        path.unlink()
      f.close()  # closing the descriptor releases the flock

  def _open_locked(self, path: pathlib.Path):
    """The lock file, open and flocked; None when the file system does not support flock."""
    for _ in range(_LOCK_TRIES):
      try:
        f = open(path, 'a+')
      except OSError as e:
        raise WorkdirError(f'workdir {self.path} cannot be written: {e.strerror or e}') from None
      try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        if e.errno in _NO_FLOCK:
          return None
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
          raise WorkdirError(
            f'workdir {self.path}: cannot lock {path}: {e.strerror or e}'
          ) from None
        raise WorkdirBusy(_busy_message(self.path, holder, path)) from None
      # A run that ended removes the file it locked: the one opened here may be that removed
      # one, and another run may hold a new one. Ours only if it is still the path's file.
      try:
        if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
          return f
      except OSError:
        pass
      f.close()
    raise WorkdirError(f'workdir {self.path}: {path} kept being replaced while it was locked')

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
    if not self.has_progress():
      return
    if old is None or 'unreadable' in old:
      old = self._identity_from_config(identity, old)
      if old is None:
        return
    old = {k: v for k, v in old.items() if k in identity}
    diff = identity_differences(old, jsonable(identity))
    if diff:
      shown = ', '.join(diff[:8]) + (f' and {len(diff) - 8} more' if len(diff) > 8 else '')
      held = f'of {old["method"]!r}' if 'method' in old else '(by its config.json)'
      raise WorkdirError(
        f'workdir {self.path} holds a run {held} that differs in {shown}; use a new --workdir=DIR '
        f'(or delete {self.path}) to start this one'
      )

  def _identity_from_config(
    self, identity: Dict[str, Any], old: Optional[Dict[str, Any]]
  ) -> Optional[Dict[str, Any]]:
    """For a workdir with progress whose identity.json is missing or damaged: the identity its
    config.json still records, to compare with `identity`; None when config.json holds this
    run's config, so the run resumes and `write_identity` rebuilds the file (the checkpoints'
    own shapes and manifests still guard the restore)."""
    damaged = f'{self.path / IDENTITY_FILE} is damaged' if old else f'{IDENTITY_FILE} is missing'
    try:
      config = json.loads((self.path / 'config.json').read_text())
    except (OSError, ValueError):
      raise WorkdirError(
        f'workdir {self.path} holds results of an unknown run ({damaged} and config.json '
        'cannot be read); use a new --workdir=DIR or delete it to start over'
      ) from None
    config = {k: v for k, v in config.items() if k != 'logging'} if isinstance(config, dict) else {}
    if 'config' in identity and config == jsonable(identity['config']):
      logging.warning(
        '%s; workdir %s resumes by its config.json (the same config): %s is written again',
        damaged,
        self.path,
        IDENTITY_FILE,
      )
      return None
    return {'config': config}

  def write_identity(self, identity: Dict[str, Any], config_json: str) -> None:
    write_json(self.path / IDENTITY_FILE, identity)
    atomic_write_text(self.path / 'config.json', config_json + '\n')


# ---- the lock file -------------------------------------------------------------------------

_LOCK_TRIES = 20
# flock's errors where the file system has none (NFS without lockd, some FUSE file systems).
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HOLDER = re.compile(r'^pid (\d+) on (\S+)')
# Descriptors of the locks this process holds: a forked child closes its copies (a copy would
# hold the flock after this process ends, and a dead pid would then block the next run).
_HELD_FDS: Set[int] = set()


def _close_held_locks_in_child() -> None:
  for fd in list(_HELD_FDS):
    with contextlib.suppress(OSError):
      os.close(fd)
  _HELD_FDS.clear()


os.register_at_fork(after_in_child=_close_held_locks_in_child)


def _holder_line() -> str:
  return f'pid {os.getpid()} on {os.uname().nodename}\n'


def _holder(text: str) -> Optional[Tuple[int, str]]:
  """(pid, host) of a lock file's 'pid N on HOST' line, or None."""
  match = _HOLDER.match(text.strip())
  return (int(match.group(1)), match.group(2)) if match else None


def pid_alive(pid: int) -> bool:
  """Whether a process `pid` exists on this host (one of another user's counts)."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _here(host: str) -> bool:
  return host == os.uname().nodename


def _stale_note(text: str) -> str:
  """One line on the lock file of a run that no longer holds it."""
  holder = _holder(text)
  if holder is None:
    return f'replaced a stale lock file ({text[:80]!r})'
  pid, host = holder
  if not _here(host):
    why = f'on {host}, which no longer holds it'
  elif pid_alive(pid):
    why = 'which no longer holds it (that pid now belongs to another process)'
  else:
    why = 'which is no longer running'
  return f'replaced the stale lock of pid {pid} {why}'


def _busy_message(workdir: pathlib.Path, text: str, path: pathlib.Path) -> str:
  holder = _holder(text)
  if holder is not None and _here(holder[1]) and not pid_alive(holder[0]):
    return (
      f'workdir {workdir} is locked, though its run (pid {holder[0]}) is no longer running: a '
      f'process it started still holds {path}; stop that process (`fuser -v {path}` names it) '
      'or choose another --workdir'
    )
  return (
    f'workdir {workdir} is busy: a run ({text or "another process"}) is using it; wait for it '
    'to finish or choose another --workdir'
  )


@contextlib.contextmanager
def _pid_lock(path: pathlib.Path, workdir: pathlib.Path) -> Iterator[None]:
  """The lock where flock is missing: the file, created exclusively, names its holder; a file
  naming a dead pid of this host is stale and replaced, one naming a live pid refuses."""
  for _ in range(_LOCK_TRIES):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      break
    except FileExistsError:
      try:
        text = path.read_text().strip()
      except OSError:
        continue  # removed in between: try again
      holder = _holder(text)
      if holder is None or not _here(holder[1]) or pid_alive(holder[0]):
        raise WorkdirBusy(_busy_message(workdir, text, path)) from None
      print(f'warning: workdir {workdir}: {_stale_note(text)}', file=sys.stderr, flush=True)
      with contextlib.suppress(FileNotFoundError):
        path.unlink()
    except OSError as e:
      raise WorkdirError(f'workdir {workdir} cannot be written: {e.strerror or e}') from None
  else:
    raise WorkdirError(f'workdir {workdir}: {path} kept being replaced while it was locked')
  try:
    os.write(fd, _holder_line().encode())
  finally:
    os.close(fd)
  try:
    yield
  finally:
    with contextlib.suppress(OSError):
      if _holder(path.read_text()) == (os.getpid(), os.uname().nodename):
        path.unlink()
