"""One `error:` line, exit status 1, when a process of a multi-process run loses its peers.

JAX ends a process whose peer died from C++: when process 0 (which hosts JAX's coordination
service) goes, every other process aborts at once from the runtime's error-polling thread (a
fatal log line, a C++ stack, Python's thread dump, status 134), and no Python code runs in
between (`missed_heartbeat_callback` cannot take a Python function: jaxlib fails to pass it the
status). So the command line runs a multi-process run in a child process and supervises it: the
child's stdout goes straight through, its stderr through this filter, which holds the runtime's
log lines (`E1207 12:00:00.000 ...` and what follows them) until it knows whether a fatal one
follows. When it does, or the child dies of a signal, the held lines and the rest are dropped
and one line names the process that stopped and the checkpoint the run resumes from.

A Python-side failure of a collective (gloo's "Connection closed by peer" when another process
died) is turned into the same line by the child itself (`peer_failure`), which then exits at
once: a normal exit would wait JAX's shutdown barrier out (about 80 s) and abort all the same.
"""

import ctypes
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, List, Optional, Sequence

# Seconds the runtime's log lines are held, waiting for a fatal line to follow.
HOLD_S = 2.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Set in the child's environment to the parent's pid: a supervised process runs the job itself.
SUPERVISED_ENV = 'JFED_SUPERVISED'

# absl / glog's prefix: severity, MMDD, time, thread id, file:line]
_RUNTIME_LOG = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ ]+:\d+\]')
_FATAL = (
  re.compile(r'^F\d{4} \d\d:\d\d:\d\d'),
  re.compile(r'^\*\*\* Check failure stack trace'),
  re.compile(r'^Fatal Python error'),
  re.compile(r'^terminate called after throwing'),
)
# What the runtime's messages say of the process that stopped.
_TASK_DIED = (
  re.compile(r'Task (\d+) heartbeat timeout'),
  re.compile(r'tasks are unhealthy \(stopped sending heartbeats\):\s*(\d+)'),
)
_COORDINATOR_GONE = re.compile(
  r'Socket closed|Connection refused|failed to connect to all addresses'
)
_PEER_CLOSED = re.compile(r'Connection closed by peer|Connection reset by peer|Gloo .* failed')


def is_supervised() -> bool:
  return bool(os.environ.get(SUPERVISED_ENV))


def last_checkpoint(workdir: Optional[str]) -> Optional[int]:
  """The newest committed step in `<workdir>/checkpoints` (orbax names a step's directory by its
  number once it is complete; one still being written has a temporary name)."""
  if not workdir:
    return None
  directory = pathlib.Path(workdir) / 'checkpoints'
  try:
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
  except OSError:
    return None
  return max(steps, default=None)


def resume_hint(workdir: Optional[str], num_processes: Optional[int]) -> str:
  processes = f'all {num_processes} processes' if num_processes else 'every process'
  step = last_checkpoint(workdir)
  if step is None:
    return f'no checkpoint yet: start {processes} again with the same commands'
  return (
    f'start {processes} again with the same commands to resume from checkpoint {step} in '
    f'{pathlib.Path(workdir) / "checkpoints"}'
  )


def error_line(what: str, workdir: Optional[str], num_processes: Optional[int]) -> str:
  """The one `error:` line of a stopped multi-process run.

  Args:
    what: Which process stopped (`describe_stop`'s clause, or why this one ended).
    workdir: The run's workdir, whose newest checkpoint the line names.
    num_processes: Processes of the run.

  Returns:
    The line, `error: ` first.
  """
  return f'error: {what}; {resume_hint(workdir, num_processes)}'


def describe_stop(
  runtime_lines: Sequence[str],
  process_id: Optional[int],
  num_processes: Optional[int],
  coordinator: Optional[str],
) -> str:
  """Which process stopped, read from the runtime's log lines of the failure.

  Args:
    runtime_lines: The runtime's lines (or an exception's text) that report the failure.
    process_id: This process's rank, None when the cluster's environment gave it.
    num_processes: Processes of the run.
    coordinator: --coordinator's host:port, None when the cluster's environment gave it.

  Returns:
    The clause of the `error:` line that names the process that stopped and this one.
  """
  text = '\n'.join(runtime_lines)
  me = f'this is process {process_id} of {num_processes}' if process_id is not None else ''

  def stopped(rank: Optional[int]) -> str:
    # process 0 hosts the coordinator: however the runtime reported its death, say so
    if rank is None:
      return f'another process of the multi-process run stopped ({me})'
    if rank == 0 and process_id != 0:
      at = f' at {coordinator}' if coordinator else ''
      return f'process 0 of the multi-process run (its coordinator{at}) stopped ({me})'
    return f'process {rank} of the multi-process run stopped ({me})'

  for pattern in _TASK_DIED:
    found = pattern.search(text)
    if found:
      return stopped(int(found.group(1)))
  if _COORDINATOR_GONE.search(text) and process_id != 0:
    return stopped(0)
  if _PEER_CLOSED.search(text):
    two = num_processes == 2 and process_id is not None
    return stopped(1 - process_id if two else None)
  fatal = next((l for l in runtime_lines if _FATAL[0].match(l)), '')
  reason = fatal.split('] ', 1)[-1][:200] if fatal else 'no message'
  return f"JAX's distributed runtime stopped this process ({reason}; {me})"


def peer_failure(error: BaseException) -> bool:
  """Whether an exception raised in a multi-process run is a collective that lost its peer."""
  return bool(_PEER_CLOSED.search(str(error)))


class _StderrFilter:
  """Passes the child's stderr through. From a runtime log line on, everything is held for
  `hold_s` seconds: dropped when a fatal line comes (the runtime's error records come
  milliseconds before it, with continuation lines of any shape), released otherwise."""

  def __init__(self, out: IO[str], hold_s: float = HOLD_S):
    self._out = out
    self._hold_s = hold_s
    self.held: List[str] = []
    self.fatal = False
    self._release_at: Optional[float] = None

  def feed(self, line: str) -> None:
    if self.fatal or any(p.match(line) for p in _FATAL):
      self.fatal = True
      self.held.append(line)
      return
    if self.held or _RUNTIME_LOG.match(line):
      if not self.held:
        self._release_at = time.monotonic() + self._hold_s
      self.held.append(line)
      return
    self._out.write(line)
    self._out.flush()

  def tick(self) -> None:
    """Releases what is held once its time is up without a fatal line."""
    if self.held and not self.fatal and time.monotonic() >= self._release_at:
      self._release()

  def _release(self) -> None:
    for held in self.held:
      self._out.write(held)
    self.held = []
    self._out.flush()

  def finish(self) -> None:
    if not self.fatal:
      self._release()


def _lines(stream: IO[bytes], out: 'queue.Queue[Optional[str]]') -> None:
  for raw in stream:
    out.put(raw.decode('utf-8', errors='replace'))
  out.put(None)


def end_with_parent() -> None:
  """Called first thing in the supervised child: on Linux it is killed when the supervising
  parent dies, as one process would be (elsewhere it outlives the parent). Set here rather than
  in `preexec_fn`, which is unsafe in a parent that runs threads."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    return
  if str(os.getppid()) != os.environ.get(SUPERVISED_ENV):  # the parent died before prctl
    os._exit(1)  # pylint: disable=protected-access


def run_supervised(
  argv: Sequence[str],
  workdir: Optional[str],
  process_id: Optional[int],
  num_processes: Optional[int],
  coordinator: Optional[str],
) -> int:
  """Runs `argv` (this command again) as a supervised child; returns the exit status to use.

  Ctrl-C reaches the child from the terminal (the same process group): the parent ignores it
  and reports what the child reports. SIGTERM to the parent is passed on.

  Args:
    argv: The child's command line.
    workdir: The run's workdir, whose newest checkpoint the `error:` line names.
    process_id: This process's rank (None: from the cluster's environment).
    num_processes: Processes of the run.
    coordinator: --coordinator's host:port.

  Returns:
    The child's exit status, or 1 after the one `error:` line when JAX aborted it.
  """
  env = dict(os.environ, **{SUPERVISED_ENV: str(os.getpid())})
  child = subprocess.Popen(list(argv), env=env, stderr=subprocess.PIPE)
  previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
  previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
  stderr = _StderrFilter(sys.stderr)
  lines: 'queue.Queue[Optional[str]]' = queue.Queue()
  threading.Thread(target=_lines, args=(child.stderr, lines), daemon=True).start()
  try:
    while True:
      try:
        line = lines.get(timeout=0.2)
      except queue.Empty:
        stderr.tick()
        continue
      if line is None:
        break
      stderr.feed(line)
      stderr.tick()
    status = child.wait()
  finally:
    signal.signal(signal.SIGINT, previous_int)
    signal.signal(signal.SIGTERM, previous_term)
  stderr.finish()
  if not stderr.fatal and status >= 0:
    return status
  if status == -signal.SIGTERM and not stderr.fatal:
    return 128 + signal.SIGTERM
  if stderr.fatal:
    what = describe_stop(stderr.held, process_id, num_processes, coordinator)
  else:  # killed by a signal with nothing logged
    what = f'this process (process {process_id}) was ended by signal {-status}'
  print(error_line(what, workdir, num_processes), file=sys.stderr, flush=True)
  return 1
