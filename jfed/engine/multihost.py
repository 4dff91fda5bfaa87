"""Runs that span several JAX processes (hosts) with one global device mesh.

Every process runs the same program on the same inputs: each derives the dataset, the client
partition and every key from the config's seed, so each holds an identical copy of everything
host-side. A client group is the one thing split across processes: `global_array` builds it
from each process's own copy (`jax.make_array_from_callback` reads only the shards that live
on the process's devices), and `to_host` gathers what training produced back to every process,
where aggregation, evaluation and the server stages run unchanged (and identically) on NumPy
or process-local arrays. Only the primary process writes metrics, summaries and figures; every
process takes part in checkpoints, which orbax coordinates (they hold host NumPy arrays, the
form orbax accepts from several processes, in a directory all processes share).

Start-up is bounded: `initialize` checks the launch flags before JAX sees them, reports while the
processes gather, and ends the process with one `error:` line when they have not all joined in
time (JAX's own timeout aborts the process with a C++ stack instead).
"""

import inspect
import os
import re
import sys
import threading
import time
from typing import Any, Optional

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jfed.errors import ConfigError, WorkdirError

DEFAULT_INIT_TIMEOUT_S = 300
# JAX aborts the whole process (a C++ fatal error and stack, no Python exception) when its own
# initialization timeout passes, so it gets this much longer than ours and ours always fires first.
_JAX_TIMEOUT_MARGIN_S = 30


def parse_coordinator(address: str) -> tuple[str, int]:
  """(host, port) of a --coordinator address: HOST:PORT, with an IPv6 host in brackets."""

  def refused(problem: str) -> ConfigError:
    return ConfigError(
      f'--coordinator={address} is not HOST:PORT: {problem} (e.g. localhost:1234, or [::1]:1234 '
      'for an IPv6 host)'
    )

  if re.search(r'\s', address):
    raise refused('it contains whitespace')
  if address.startswith('['):
    close = address.find(']')
    if close < 0:
      raise refused('no closing "]" (an IPv6 host goes in brackets)')
    host, rest = address[1:close], address[close + 1 :]
    if rest and not rest.startswith(':'):
      raise refused(f'"{rest}" follows the bracketed host where ":PORT" belongs')
    port = rest[1:]
  else:
    host, colon, port = address.rpartition(':')
    if not colon:
      raise refused('no port')
    if ':' in host:
      raise refused('an IPv6 host goes in brackets')
    if '[' in host or ']' in host:
      raise refused('a stray bracket (an IPv6 host goes in brackets)')
  if not host:
    raise refused('no host')
  if not port:
    raise refused('no port')
  if not re.fullmatch(r'[0-9]+|-[0-9]+', port):
    raise refused(f'port {port} is not an integer')
  if not 1 <= int(port) <= 65535:
    raise refused(f'port {port} is not in 1-65535')
  return host, int(port)


def _address(host: str, port: int) -> str:
  return f'[{host}]:{port}' if ':' in host else f'{host}:{port}'


def initialize(
  coordinator: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
  timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
  progress_every_s: Optional[float] = None,
) -> None:
  """Joins the JAX distributed runtime; call before anything touches a device.

  With no addresses JAX reads the cluster's own environment (SLURM, Open MPI, Kubernetes, TPU
  pods); otherwise all three name the coordinator's host:port, the number of processes and
  this process's rank. Every flag is checked before JAX sees it. While the processes gather, a
  `waiting ...` line goes to stderr every `progress_every_s` (default: a tenth of the timeout,
  1 to 30 s); if they have not all joined within `timeout_s` seconds, the process ends with one
  `error:` line and exit status 1 (JAX itself would abort it with a C++ stack, uncatchable).

  Args:
    coordinator: host:port of process 0; None reads the cluster environment.
    num_processes: Number of processes.
    process_id: This process's rank.
    timeout_s: Seconds to wait for every process to join.
    progress_every_s: Seconds between `waiting ...` lines; None picks one from the timeout.
  """
  given = [v is not None for v in (coordinator, num_processes, process_id)]
  if any(given) and not all(given):
    raise ConfigError(
      '--coordinator, --num_processes and --process_id go together '
      '(or give none of them to read the cluster environment)'
    )
  if num_processes is not None:
    if num_processes < 1:
      raise ConfigError(f'--num_processes={num_processes} must be at least 1')
    if not 0 <= process_id < num_processes:
      raise ConfigError(
        f'--process_id={process_id} is not in [0, {num_processes}) '
        f'(--num_processes={num_processes})'
      )
  address = None if coordinator is None else _address(*parse_coordinator(coordinator))
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
    raise ConfigError(f'--init_timeout_s={timeout_s} must be at least 1 (seconds)')
  try:
    # CPU devices of different processes only meet through a collectives library; GPUs and
    # TPUs bring their own and ignore this option.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  except (AttributeError, ValueError):  # a JAX without the option: nothing to choose
    pass
  options = {}
  if 'initialization_timeout' in inspect.signature(jax.distributed.initialize).parameters:
    options['initialization_timeout'] = timeout_s + _JAX_TIMEOUT_MARGIN_S
  if progress_every_s is None:
    progress_every_s = min(30.0, max(1.0, timeout_s / 10))
  watch = _StartupWatch(coordinator, num_processes, process_id, timeout_s, progress_every_s)
  watch.start()
  try:
    jax.distributed.initialize(
      coordinator_address=address, num_processes=num_processes, process_id=process_id, **options
    )
  except RuntimeError as e:  # a rank taken twice, ...
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    where = coordinator or 'the cluster environment'
    raise ConfigError(f'cannot join the multi-process run at {where}: {first}') from e
  finally:
    watch.stop()


class _StartupWatch:
  """Reports, from a thread of its own, how long `jax.distributed.initialize` has waited (it
  blocks in C++ without a word, the GIL released), and ends the process on the timeout."""

  def __init__(
    self,
    coordinator: Optional[str],
    num_processes: Optional[int],
    process_id: Optional[int],
    timeout_s: int,
    every_s: float,
  ):
    self._timeout_s = timeout_s
    self._every_s = every_s
    self._done = threading.Event()
    self._lock = threading.Lock()
    self._start = time.monotonic()
    self._reported = False
    if coordinator is None:
      self._waiting = 'waiting for the processes named by the cluster environment to join'
      self._joined = 'all processes joined'
      self._failed = (
        f'the multi-process run described by the cluster environment did not form within '
        f'--init_timeout_s={timeout_s} s'
      )
      return
    # JAX reports nothing about the other processes until all of them have joined.
    unknown = 'JAX counts none until all have joined'
    if process_id == 0:
      self._waiting = (
        f'waiting at {coordinator} for the other {num_processes - 1} of {num_processes} '
        f'processes (process 0 serves the coordinator; {unknown})'
      )
      hint = (
        f'were the others started with --coordinator={coordinator} --num_processes={num_processes}?'
      )
    else:
      self._waiting = (
        f'waiting for the coordinator at {coordinator} (process {process_id} of '
        f'{num_processes}; {unknown})'
      )
      hint = 'is process 0 running and reachable there, with the same --num_processes?'
    self._joined = f'all {num_processes} processes joined at {coordinator}'
    self._failed = (
      f'--coordinator={coordinator}: not all {num_processes} processes joined within '
      f'--init_timeout_s={timeout_s} s (this is process {process_id} of {num_processes}); {hint}'
    )

  def start(self) -> None:
    self._start = time.monotonic()
    threading.Thread(target=self._watch, name='jfed-startup-watch', daemon=True).start()

  def stop(self) -> None:
    with self._lock:
      self._done.set()
    if self._reported:
      print(f'{self._joined} after {time.monotonic() - self._start:.0f} s', file=sys.stderr)

  def _watch(self) -> None:
    deadline = self._start + self._timeout_s
    next_report = self._start + self._every_s
    while not self._done.wait(max(0.0, min(next_report, deadline) - time.monotonic())):
      now = time.monotonic()
      if now >= deadline:
        with self._lock:  # a join that completes now wins; one that completes later is too late
          if not self._done.is_set():
            _give_up(self._failed)
        return
      elapsed = now - self._start
      print(f'{self._waiting}: {elapsed:.0f} s of {self._timeout_s} s', file=sys.stderr, flush=True)
      self._reported = True
      next_report += self._every_s


def _give_up(message: str) -> None:
  """Ends the process with one `error:` line: the thread blocked in JAX cannot be interrupted,
  and nothing has been written yet (this runs before the workdir is touched)."""
  sys.stdout.flush()
  print(f'error: {message}', file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0; always true in one process)."""
  return jax.process_index() == 0


def spans_processes(mesh: Optional[Mesh]) -> bool:
  return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def global_array(mesh: Mesh, value: Any, spec: P) -> jax.Array:
  """A global array laid out by `spec` from this process's full copy of `value`.

  Args:
    mesh: The device mesh.
    value: The whole array (every process holds the same).
    spec: How it is sharded over the mesh's axes.

  Returns:
    The global jax.Array.
  """
  value = np.asarray(value)
  return jax.make_array_from_callback(
    value.shape, NamedSharding(mesh, spec), lambda index: value[index]
  )


def to_host(tree: Any) -> Any:
  """Every array of `tree` as a NumPy array holding its full value, on every process.

  Arrays split across processes are all-gathered (every process must call this with the same
  tree); the rest are copied from their device.
  """

  def one(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)

  return jax.tree.map(one, tree)


def broadcast_from_primary(value: np.ndarray) -> np.ndarray:
  """The primary process's `value` on every process (same shape and dtype everywhere)."""
  if jax.process_count() == 1:
    return np.asarray(value)
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def agree(ok: bool, what: str) -> None:
  """Ends every process with one error when the primary could not do `what` (no process waits
  forever on a collective the primary will never join)."""
  if jax.process_count() > 1 and not bool(broadcast_from_primary(np.int32(ok))):
    if is_primary():
      return  # the primary raises its own, more precise error
    raise WorkdirError(f'process 0 could not {what}; its error says why')
