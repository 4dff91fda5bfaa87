"""A run's metric records as scalar curves: TensorBoard event files and, optionally, W&B.

The driver hands every record it appends to the history (the records of one step, or the setup
records of step 0) to `ScalarLoggers.write`, right after rewriting metrics.jsonl and before the
step's checkpoint. So the curves hold exactly what metrics.jsonl holds:

- TensorBoard (`logging.tensorboard`, default on): `<workdir>/tensorboard/` event files written
  with tensorboardX, one per invocation (numbered), flushed and fsynced after every step. A resumed
  invocation opens its file with `purge_step = start + 1` (as tensorboardX's SummaryWriter does
  it): readers (TensorBoard, `EventAccumulator`) then discard the events of steps after the
  restored checkpoint that the interrupted invocation had written, and the curves equal an
  uninterrupted run's. A fresh start purges from step 0: the events of an invocation that died
  before its first checkpoint.
- Weights & Biases (`logging.wandb`, default off; project `logging.wandb_project`): one W&B run
  per workdir, its id kept in `<workdir>/wandb_id`, resumed with `resume='allow'`. W&B ignores
  steps that do not increase, so steps after the last checkpoint that an interrupted invocation
  had logged keep their first values there (TensorBoard's curves are the exact ones).

Runs without a workdir log nothing.
"""

import math
import pathlib
import re
import socket
import sys
import time
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence
import uuid

from jfed.errors import ConfigError
from jfed.workdir import atomic_write_text, jsonable

TENSORBOARD_DIR = 'tensorboard'
WANDB_ID_FILE = 'wandb_id'


def record_scalars(record: Mapping[str, Any]) -> Dict[str, float]:
  """A record's numbers as {tag: value}: every finite int or float (not bool) except 'step';
  lists and tuples of numbers as 'key/0', 'key/1', ...; dicts as 'key/subkey' (recursively).
  Strings, None and other values are skipped. Values are read as metrics.jsonl writes them
  (`jsonable`: NumPy and JAX scalars and arrays become numbers and lists)."""
  out: Dict[str, float] = {}

  def add(tag: str, value: Any) -> None:
    if isinstance(value, bool):
      return
    if isinstance(value, (int, float)):
      if math.isfinite(value):
        out[tag] = float(value)
    elif isinstance(value, dict):
      for k, v in value.items():
        add(f'{tag}/{k}', v)
    elif isinstance(value, list):
      for i, v in enumerate(value):
        add(f'{tag}/{i}', v)

  for key, value in jsonable(dict(record)).items():
    if key != 'step':
      add(key, value)
  return out


class LoggingConfig(NamedTuple):
  """The `logging` config section (every key optional: the defaults below)."""

  tensorboard: bool  # default True
  wandb: bool  # default False
  wandb_project: str  # default 'jfed'


def logging_config(config: Any) -> LoggingConfig:
  """The run's `logging` section; ConfigError when a key has the wrong type, or when W&B is on
  and `wandb` cannot be imported (call it before anything is written)."""
  section = config.get('logging', None) if config is not None else None
  section = section if section is not None else {}
  get = section.get
  options = LoggingConfig(
    get('tensorboard', True), get('wandb', False), get('wandb_project', 'jfed')
  )
  for name in ('tensorboard', 'wandb'):
    if not isinstance(getattr(options, name), bool):
      raise ConfigError(f'logging.{name} must be True or False, got {getattr(options, name)!r}')
  if not isinstance(options.wandb_project, str) or not options.wandb_project:
    raise ConfigError(
      f'logging.wandb_project must be a non-empty string, got {options.wandb_project!r}'
    )
  if options.wandb:
    _import_wandb()
  return options


def _import_wandb():
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(
      'logging.wandb is set but wandb is not installed; pip install wandb'
    ) from None
  return wandb


def _wandb_id(workdir: pathlib.Path) -> str:
  """The workdir's W&B run id: made once (random, so that a deleted and recreated workdir starts
  a new W&B run) and kept in the workdir, so every invocation resumes the same W&B run."""
  path = workdir / WANDB_ID_FILE
  if path.exists():
    run_id = path.read_text().strip()
    if run_id:
      return run_id
  run_id = uuid.uuid4().hex[:16]
  atomic_write_text(path, run_id + '\n')
  return run_id


def _tensorboardx():
  """tensorboardX's event protos, record writer and scalar summary.

  Imported without PyTorch: where torch is installed, `import tensorboardX` imports it (for its
  PyTorch-only writers), which costs 2 s and loads CUDA libraries next to JAX's. A None entry in
  sys.modules makes that `import torch` fail, which tensorboardX handles; it is removed at once.
  """
  hide_torch = 'torch' not in sys.modules and 'tensorboardX' not in sys.modules
  if hide_torch:
    sys.modules['torch'] = None
  try:
    from tensorboardX import record_writer, summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  finally:
    if hide_torch and 'torch' in sys.modules and sys.modules['torch'] is None:
      del sys.modules['torch']
  return event_pb2, record_writer.RecordWriter, summary.scalar


# An invocation's event file: numbered, not named by the clock like tensorboardX's, because
# readers go through the files by name and must meet the invocations in their order (two in one
# second, or on hosts whose clocks differ, would otherwise tie or swap).
_EVENT_FILE = re.compile(r'events\.out\.tfevents\.(\d{10})\..*')


class _EventFile:
  """One invocation's TensorBoard event file, written synchronously with tensorboardX's records.

  tensorboardX's `SummaryWriter` hands events to a background thread, and its `flush()` does not
  wait for that thread's queue (2.6.x): a kill right after a step could lose the step's events.
  This writes the events `SummaryWriter(purge_step=...)` would, straight to the file.
  """

  def __init__(self, logdir: pathlib.Path, purge_step: int):
    """Opens the next event file in `logdir`; readers drop the events of steps >= `purge_step`
    that the earlier files hold."""
    event_pb2, record_writer, self._scalar = _tensorboardx()
    self._event = event_pb2.Event
    logdir.mkdir(parents=True, exist_ok=True)
    numbers = [int(m.group(1)) for p in logdir.iterdir() if (m := _EVENT_FILE.fullmatch(p.name))]
    name = f'events.out.tfevents.{max(numbers, default=0) + 1:010d}.{socket.gethostname()}'
    self._file = record_writer(str(logdir / name))
    now = time.time()
    self._write(self._event(wall_time=now, step=purge_step, file_version='brain.Event:2'))
    start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    self._write(self._event(wall_time=now, step=purge_step, session_log=start))

  def _write(self, event: Any) -> None:
    self._file.write(event.SerializeToString())

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._write(self._event(wall_time=time.time(), step=step, summary=self._scalar(tag, value)))

  def flush(self) -> None:
    self._file.flush()  # and fsync

  def close(self) -> None:
    self._file.flush()
    self._file.close()


class ScalarLoggers:
  """The run's scalar writers (none without a workdir). `write` records, then `close`."""

  def __init__(
    self, options: LoggingConfig, workdir: Optional[pathlib.Path], config: Any, start: int
  ):
    """Opens the writers.

    Args:
      options: the `logging` section (`logging_config`).
      workdir: where the run writes; None: nothing is logged.
      config: the run's whole config (W&B's run config).
      start: the step the run resumes from (0: a fresh start).
    """
    self._tensorboard = self._wandb = None
    if workdir is None:
      return
    if options.tensorboard:
      self._tensorboard = _EventFile(workdir / TENSORBOARD_DIR, start + 1 if start else 0)
    if options.wandb:
      wandb = _import_wandb()
      try:
        wandb.init(
          project=options.wandb_project,
          dir=str(workdir),
          config=config.to_dict() if hasattr(config, 'to_dict') else dict(config),
          name=workdir.name,
          resume='allow',
          id=_wandb_id(workdir),
        )
      except BaseException:
        self.close(completed=False)  # the driver gets no object to close
        raise
      self._wandb = wandb

  def write(self, records: Sequence[Mapping[str, Any]]) -> None:
    """Logs the records' scalars (`record_scalars`) at their 'step', then flushes."""
    for record in records:
      scalars = record_scalars(record)
      if not scalars:
        continue
      step = int(record['step'])
      if self._tensorboard is not None:
        for tag, value in scalars.items():
          self._tensorboard.add_scalar(tag, value, step)
      if self._wandb is not None:
        self._wandb.log(scalars, step=step)
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self, completed: bool = True) -> None:
    """Closes the writers; a run that did not complete ends its W&B run as failed (exit code 1),
    which a later invocation resumes."""
    if self._tensorboard is not None:
      self._tensorboard.close()
      self._tensorboard = None
    if self._wandb is not None:
      if completed:
        self._wandb.finish()
      else:
        self._wandb.finish(exit_code=1)
      self._wandb = None
