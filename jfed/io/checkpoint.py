"""Step checkpoints of a run's typed state through orbax-checkpoint.

Each checkpoint holds the state and, for the driver's run checkpoints, the run's metric history
as JSON in the same orbax step: the two are committed together, so a resumed run never pairs a
state with a history of another step.

Every step is verified before it is restored: once orbax has committed a step, the SHA-256
digest of each of its files goes into `<step>/jfed_sha256.json`. Orbax (0.12) checks that a
step's files exist and parse, not what they hold: a flipped byte in a data file restored as
other numbers. A checkpoint that fails verification or to restore (a flipped byte, a deleted or
truncated file) is skipped for the older one that `max_to_keep` keeps, with a warning naming the
step and the file, and removed so the resumed run can write that step again. A step without
checksums (written by an earlier jfed, or by a run killed between orbax's commit and the
checksums) restores with a warning that it is unverified. A damaged stage cache
(`restore_stage`, a driver stage's one result) is removed with a warning and computed again.

A write that fails (a full disk, a read-only directory) is one WorkdirError naming the step,
the directory and the system's reason. Orbax logs the failure with a traceback from each of
its writer threads as well (~300 lines for one full disk); those records are dropped, since
the error reports the failure, unless experiments.main runs with --traceback.
"""

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
from typing import Any, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jfed.errors import WorkdirError
from jfed.workdir import atomic_write_text

# Written into each step's directory after orbax commits the step: {relative path: SHA-256}.
CHECKSUMS = 'jfed_sha256.json'
_ORBAX_DIR = os.path.dirname(ocp.__file__)


class Checkpointer:
  """Saves a state per completed step (round, epoch, stage) and restores the latest that loads.

  A run killed at any point resumes from the last completed step; since every random key is
  derived from (seed, purpose, step), the resumed run ends with the result of an uninterrupted
  one.
  """

  def __init__(self, directory, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self.max_to_keep = max_to_keep
    self._manager = ocp.CheckpointManager(
      self.directory,
      item_names=('state', 'history'),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )
    self._write_failed = False

  def save(self, step: int, state: Any, history: Optional[List[Any]] = None) -> None:
    """Writes `step` and, once orbax has committed it, its checksums. Raises WorkdirError when
    the checkpoint cannot be written.

    Args:
      step: The step (round or epoch) the checkpoint is named by.
      state: Pytree of arrays to save; device arrays are copied to the host first.
      history: Per-step metric records to save with it (JSON); None saves none.
    """
    items = {'state': ocp.args.StandardSave(_host_arrays(state))}
    if history is not None:
      items['history'] = ocp.args.JsonSave({'records': history})
    self._check_writable(step)
    try:
      with _orbax_error_logs_held():
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  # re-raised unless an I/O failure
      reason = _io_failure(e)
      if reason is None:
        raise
      self._write_failed = True
      _hold_orbax_task_errors()
      raise WorkdirError(f'cannot write checkpoint {step} in {self.directory}: {reason}') from e
    if jax.process_index() == 0:  # the directory is shared; orbax's commit waits for all
      self._write_checksums(step)

  def steps(self) -> List[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore(self, step: int, template: Any, with_history: bool = False):
    """The state (and history) of `step`. Raises WorkdirError, naming the file, when a file of
    the step does not match the checksum written with it.

    Args:
      step: Which saved step to restore.
      template: A pytree of the saved state's structure (shapes and dtypes), e.g. a fresh state.
      with_history: Also return the history saved with the step.

    Returns:
      The state, or (state, history) when `with_history` is True.
    """
    self._verify(step)
    return self._restore_unverified(step, template, with_history)

  def _restore_unverified(self, step: int, template: Any, with_history: bool = False):
    items = {'state': ocp.args.StandardRestore(_host_arrays(template))}
    if with_history:
      items['history'] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state = _like_template(restored['state'], template)
    if with_history:
      return state, list(restored['history']['records'])
    return state

  def restore_stage(self, step: int, template: Any) -> Optional[Any]:
    """The cached result of `step`, or None when it is damaged, so the caller computes it again.

    A step that fails verification (a flipped byte, a missing or truncated file), or that has no
    checksums and does not restore, is removed with a one-line warning naming the file. A step
    that verifies but does not restore holds something else than `template` (another run's
    cache): that is raised as before, and the cache is left alone.
    """
    try:
      self._verify(step)
      verified = self.verified(step)
    except WorkdirError as e:
      reason, verified = str(e), None
    if verified is not None:
      try:
        return self._restore_unverified(step, template)
      except Exception as e:  # pylint: disable=broad-except  # orbax raises many types
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if verified:
          raise WorkdirError(
            f'the cached stage {step} in {self.directory} is intact but holds something else '
            f"than this run's (another model or shapes: {reason}); point the cache option at "
            'another directory, or delete that one to compute the stage again'
          ) from e
    print(
      f'warning: the cached stage {step} in {self.directory} is damaged ({reason}); computing '
      'it again',
      file=sys.stderr,
      flush=True,
    )
    self._manager.delete(step)
    return None

  def restore_latest(
    self, template: Any, with_history: bool = False
  ) -> Tuple[Optional[int], Any, List[Any]]:
    """(step, state, history) of the newest checkpoint that verifies and restores;
    (None, template, []) when there is none. Raises WorkdirError when checkpoints exist but
    none restores."""
    steps = self.steps()
    errors = []
    for step in reversed(steps):
      try:
        out = self.restore(step, template, with_history)
        if not self.verified(step):
          bad = first_non_finite(out[0] if with_history else out)
          if bad is not None:
            aside = self.set_aside(step)
            raise WorkdirError(f'it holds non-finite values at {bad}; set aside as {aside}')
      except Exception as e:  # pylint: disable=broad-except  # orbax raises many types
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        errors.append(f'step {step}: {type(e).__name__}: {first_line}')
        print(
          f'warning: checkpoint {step} in {self.directory} does not restore '
          f'({errors[-1]}); trying an older one',
          file=sys.stderr,
          flush=True,
        )
        continue
      state, history = out if with_history else (out, [])
      if errors:
        # The newer steps cannot be restored; remove them so that the resumed run can save
        # those steps again.
        for newer in [s for s in self.steps() if s > step]:
          self._manager.delete(newer)
        print(
          f'warning: restored the older checkpoint {step} in {self.directory} and removed '
          'the newer ones that do not restore',
          file=sys.stderr,
          flush=True,
        )
      self._keep_newest(step)
      return step, state, history
    if steps:
      raise WorkdirError(
        f'no checkpoint in {self.directory} restores ({"; ".join(errors)}); '
        'delete that directory to start the stage again'
      )
    return None, template, []

  def verified(self, step: int) -> bool:
    """Whether `step` has the checksums jfed writes once orbax has committed it."""
    return (self._step_dir(step) / CHECKSUMS).exists()

  def set_aside(self, step: int) -> pathlib.Path:
    """Moves `step` out of the manager's sight (kept for inspection, never restored again) and
    returns where it went; process 0 moves it in a run of several processes."""
    aside = self.directory / f'{step}.set-aside'
    n = 1
    while aside.exists():
      n += 1
      aside = self.directory / f'{step}.set-aside-{n}'
    if jax.process_index() == 0:
      os.replace(self._step_dir(step), aside)
    self._manager.reload()
    return aside

  def _keep_newest(self, restored: int) -> None:
    """Removes the steps beyond `max_to_keep` (a run killed between orbax's commit of a step
    and its removal of the oldest one leaves one more), never the one just restored."""
    older = [s for s in self.steps() if s < restored]
    keep = max(self.max_to_keep - 1, 0)
    for step in older[: max(len(older) - keep, 0)]:
      self._manager.delete(step)

  def close(self) -> None:
    """Waits for orbax's writers to stop. After a failed save, the save's error is the one
    reported: the same failure, raised again here, is not."""
    try:
      with _orbax_error_logs_held():
        self._manager.close()
    except Exception as e:  # pylint: disable=broad-except  # orbax re-raises a writer's error
      if not (self._write_failed and _io_failure(e) is not None):
        raise

  def _step_dir(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def _check_writable(self, step: int) -> None:
    """Orbax creates a step's directory in one writer thread while the others wait for it; when
    it cannot (a read-only or full file system) they wait out orbax's 300 s coordination
    timeout, and the process cannot exit before. A directory that cannot be created here
    starts none of them."""
    probe = self.directory / f'.{step}.jfed-probe-{jax.process_index()}-{os.getpid()}'
    try:
      probe.mkdir(parents=True, exist_ok=True)
      probe.rmdir()
    except OSError as e:
      self._write_failed = True
      raise WorkdirError(
        f'cannot write checkpoint {step} in {self.directory}: {e.strerror or e}'
      ) from e

  def _write_checksums(self, step: int) -> None:
    step_dir = self._step_dir(step)
    digests = {
      path.relative_to(step_dir).as_posix(): _sha256(path) for path in _files_of_step(step_dir)
    }
    try:
      atomic_write_text(step_dir / CHECKSUMS, json.dumps(digests, indent=0, sort_keys=True))
    except OSError as e:
      self._write_failed = True
      raise WorkdirError(
        f'cannot write checkpoint {step} in {self.directory}: {e.strerror or e}'
      ) from e

  def _verify(self, step: int) -> None:
    step_dir = self._step_dir(step)
    manifest = step_dir / CHECKSUMS
    if not manifest.exists():
      print(
        f'warning: checkpoint {step} in {self.directory} has no {CHECKSUMS} (written by an '
        'earlier jfed, or by a run stopped while it saved); restoring it unverified',
        file=sys.stderr,
        flush=True,
      )
      return
    try:
      digests = json.loads(manifest.read_text())
      if not isinstance(digests, dict):
        raise ValueError('not a JSON object')
    except (OSError, UnicodeDecodeError, ValueError) as e:
      raise WorkdirError(f'{manifest} is unreadable ({e}): the checkpoint is damaged') from e
    for name, digest in sorted(digests.items()):
      path = step_dir / name
      if not path.is_file():
        raise WorkdirError(f'{path} is missing: the checkpoint is damaged')
      if _sha256(path) != digest:
        raise WorkdirError(
          f'{path} does not match the SHA-256 digest written with it: the checkpoint is damaged'
        )


def first_non_finite(tree: Any) -> Optional[str]:
  """The path (`state[...]`) of the first floating leaf of `tree` that holds a NaN or an
  infinity, or None; checked on the host (a CPU device array shares its buffer)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, 'dtype') and jnp.issubdtype(leaf.dtype, jnp.inexact):
      if not np.isfinite(np.asarray(leaf)).all():
        return f'state{jax.tree_util.keystr(path)}'
  return None


def _files_of_step(step_dir: pathlib.Path) -> Iterator[pathlib.Path]:
  for root, _, names in os.walk(step_dir):
    for name in sorted(names):
      path = pathlib.Path(root) / name
      if path != step_dir / CHECKSUMS:
        yield path


def _sha256(path: pathlib.Path) -> str:
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


# A tensorstore error reports the system's errno this way, e.g. "... [os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# The tensorstore status codes of a failed file operation (it raises them as ValueError).
_IO_STATUS = ('RESOURCE_EXHAUSTED', 'PERMISSION_DENIED', 'UNAVAILABLE', 'DATA_LOSS')


def _io_failure(error: BaseException) -> Optional[str]:
  """The system's reason when `error` (or its cause) is a failed file operation, else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError):
      reason = error.strerror or str(error)
      return f'{reason}: {error.filename}' if error.filename else reason
    message = str(error)
    code = _OS_ERROR_CODE.search(message)
    if code:
      return os.strerror(int(code.group(1)))
    if message.startswith(_IO_STATUS):
      return (message.splitlines() or [message])[0][:300]
    error = error.__cause__ or error.__context__
  return None


def _tracebacks_requested() -> bool:
  """experiments.main's --traceback; False where jfed runs without that flag."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  try:
    return bool(flags.FLAGS['traceback'].value)
  except KeyError:
    return False


class _HeldOrbaxErrors(logging.Filter):
  """Keeps orbax's ERROR records (its writer threads log each failure with a traceback)."""

  def __init__(self):
    super().__init__()
    self.held: List[logging.LogRecord] = []

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and record.pathname.startswith(_ORBAX_DIR):
      self.held.append(record)
      return False
    return True


@contextlib.contextmanager
def _orbax_error_logs_held() -> Iterator[None]:
  """Holds orbax's error logs while it writes: dropped when the write raises (the exception
  reports the failure, and its traceback holds the writer thread's frames), logged after all
  when it does not (then nothing else reports them). Off with --traceback."""
  if _tracebacks_requested():
    yield
    return
  logger = logging.getLogger('absl')  # orbax logs through absl.logging
  held = _HeldOrbaxErrors()
  logger.addFilter(held)
  previous_hook, unraisable = sys.unraisablehook, []

  def hold(u: Any) -> None:
    if _closed_loop(u):
      unraisable.append(u)
    else:
      previous_hook(u)

  sys.unraisablehook = hold
  try:
    yield
  finally:
    logger.removeFilter(held)
    sys.unraisablehook = previous_hook
  for record in held.held:
    logger.handle(record)
  for u in unraisable:
    previous_hook(u)


class _OrbaxTaskErrors(logging.Filter):
  """Drops asyncio's 'Task exception was never retrieved' records of orbax's writer tasks: a
  failed write's other tasks are logged so when they are collected, after the failure was
  reported (a traceback each, after the `error:` line)."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ('Task exception was never retrieved' in message and 'orbax' in message)


_ORBAX_TASK_ERRORS = _OrbaxTaskErrors()
_DROPPING_CLOSED_LOOP = []  # [True] once the hook below is installed


def _closed_loop(unraisable: Any) -> bool:
  """Whether an unraisable exception is a writer's late completion reaching orbax's closed event
  loop (tensorstore calls `loop.call_soon_threadsafe` after a failed write ended the save)."""
  if unraisable.exc_type is not RuntimeError or 'Event loop is closed' not in str(
    unraisable.exc_value
  ):
    return False
  tb = unraisable.exc_traceback
  while tb is not None:
    if tb.tb_frame.f_code.co_name == 'call_soon_threadsafe':
      return True
    tb = tb.tb_next
  return False


def _hold_orbax_task_errors() -> None:
  """After a failed write, unless --traceback: the failure is reported once, by WorkdirError,
  not again by each of orbax's writer tasks as they are collected or complete."""
  if _tracebacks_requested():
    return
  logging.getLogger('asyncio').addFilter(_ORBAX_TASK_ERRORS)  # once: addFilter dedupes
  if not _DROPPING_CLOSED_LOOP:
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: None if _closed_loop(u) else previous(u)
    _DROPPING_CLOSED_LOOP.append(True)


def _host_arrays(tree: Any) -> Any:
  """In a run of several processes, device arrays as NumPy: orbax takes a process's own device
  arrays from one process only (each holds the same value; see jfed.engine.multihost)."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


def _like_template(restored: Any, template: Any) -> Any:
  if jax.process_count() == 1:
    return restored
  return jax.tree.map(
    lambda r, t: jnp.asarray(r) if isinstance(t, jax.Array) else r, restored, template
  )


def saved_steps(directory) -> List[int]:
  """The steps (or stage tags) a checkpoint directory holds; empty when it does not exist."""
  path = pathlib.Path(directory)
  if not path.exists():
    return []
  ckpt = Checkpointer(path)
  try:
    return ckpt.steps()
  finally:
    ckpt.close()
