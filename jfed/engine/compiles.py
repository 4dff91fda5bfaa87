"""Counting XLA compilations, to show that a multi-round run compiles its programs once.

JAX reports every backend compilation through `jax.monitoring` as the duration event
`BACKEND_COMPILE_EVENT`, with the compiled function's name as `fun_name`. The event fires around
`compile_or_get_cached`, so a program read back from the persistent compilation cache counts too:
it was still missing from memory, which is what a per-round recompilation looks like. A call
that hits JAX's in-memory caches (a jitted function or an eager op on shapes seen before)
reports nothing.

Listeners cannot be removed in every JAX version, so this module registers one listener, once,
and it forwards each event to the counters that are open at the time:

  with count_compilations() as compiled:
    run_round()
  assert not compiled.names, compiled.summary()
"""

import collections
import contextlib
import threading
from typing import Iterable, Iterator, List

from jax import monitoring

# The event name has been stable since JAX 0.4 (jax/_src/dispatch.py BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


class Compilations:
  """The compilations seen while a `count_compilations` block is open, in order."""

  def __init__(self, names: Iterable[str] = ()):
    self.names: List[str] = list(names)

  def __len__(self) -> int:
    return len(self.names)

  def counts(self) -> collections.Counter:
    """How often each function was compiled."""
    return collections.Counter(self.names)

  def summary(self) -> str:
    """One line for assertion messages: `n compilations: name x k, ...`."""
    items = ', '.join(f'{name} x{k}' for name, k in sorted(self.counts().items()))
    return f'{len(self.names)} compilations' + (f': {items}' if items else '')


_lock = threading.Lock()
_open: List[Compilations] = []
_registered = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs
  if event != BACKEND_COMPILE_EVENT or not _open:
    return
  # Older JAX versions send no kwargs; the name is then unknown but the count still holds.
  name = str(kwargs.get('fun_name', '<unknown>'))
  with _lock:
    for counter in _open:
      counter.names.append(name)


def _register_once() -> None:
  global _registered
  with _lock:
    if not _registered:
      monitoring.register_event_duration_secs_listener(_listener)
      _registered = True


@contextlib.contextmanager
def count_compilations() -> Iterator[Compilations]:
  """Collects the XLA compilations of the block (of every thread; blocks may nest)."""
  _register_once()
  counter = Compilations()
  with _lock:
    _open.append(counter)
  try:
    yield counter
  finally:
    with _lock:
      _open.remove(counter)


def use_persistent_cache(directory: str, min_compile_seconds: float = 0.0) -> None:
  """Turns on JAX's persistent compilation cache in `directory` for this process.

  A later run, or the resume of an interrupted one, reads programs it compiled before back from
  disk. The cache key covers the program, the JAX version, the backend and the XLA flags, so one
  directory serves every method and machine kind. Compilations under `min_compile_seconds` are
  not written.
  """
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_compilation_cache_dir', str(directory))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', float(min_compile_seconds))
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
