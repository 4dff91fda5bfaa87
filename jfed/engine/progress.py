"""INFO progress lines for the long phases inside one stage (DDPM training, a KIP solve, model
stratification): a line when the phase starts, then one at most every `every_s` seconds as its
steps complete, and one when it ends, so a console never stays silent for long (issue 37).

A phase that runs in Python loops updates after each step. A phase that is one compiled
program (a `lax.scan`) reports from inside it through `jax.debug.callback`, only where INFO
logging is on when the program is traced (`info_enabled()`): a program with a host callback is
not written to JAX's persistent compilation cache, so programs traced without INFO keep it.
Only process 0 of a multi-process run logs.
"""

import logging as std_logging
import threading
import time
from typing import Any, Callable, Optional

from absl import logging
import jax

from jfed.reporting import progress_wanted


def info_enabled() -> bool:
  """Whether absl's INFO lines are shown (experiments.main's default, or --verbosity=0)."""
  return std_logging.getLogger('absl').isEnabledFor(std_logging.INFO)


class PhaseProgress:
  """`label: done/total units (elapsed)` at most every `every_s` seconds, and at the end."""

  def __init__(self, label: str, total: int, unit: str = 'step', every_s: float = 5.0):
    self.label, self.total, self.unit, self.every_s = label, int(total), unit, every_s
    self.start = self.last = time.monotonic()
    self.silent = jax.process_index() != 0 or not progress_wanted()
    self._lock = threading.Lock()
    self._done = 0
    if not self.silent:
      logging.info('%s: %d %ss', label, self.total, unit)

  def due(self) -> bool:
    """Whether the next `update` would log (for a caller that must wait for a value first)."""
    return not self.silent and time.monotonic() - self.last >= self.every_s

  def update(self, done: int, detail: Optional[Callable[[], str]] = None) -> None:
    """Records `done` steps; logs when due or at the end. `detail()` (e.g. a loss, which may
    wait for the device) is called only for a line that is logged."""
    with self._lock:
      if done <= self._done:
        return
      self._done = done
      if self.silent or not (done >= self.total or self.due()):
        return
      self.last = time.monotonic()
      extra = f', {detail()}' if detail is not None else ''
      logging.info(
        '%s: %d/%d %ss (%.0f s%s)',
        self.label,
        done,
        self.total,
        self.unit,
        self.last - self.start,
        extra,
      )


# The phase that compiled programs report to: set around their execution by `reporting_to`.
_ACTIVE: Optional[PhaseProgress] = None


def _tick(done: Any) -> None:
  phase = _ACTIVE
  if phase is not None:
    phase.update(int(done))


def tick_in_program(done: Any) -> None:
  """Inside a traced program: reports `done` (a traced step count) to the active phase."""
  jax.debug.callback(_tick, done)


class reporting_to:  # pylint: disable=invalid-name  # a context manager, used like a function
  """`with reporting_to(phase):` routes `tick_in_program` calls of the programs run inside to
  `phase` (None: nowhere)."""

  def __init__(self, phase: Optional[PhaseProgress]):
    self.phase = phase

  def __enter__(self) -> Optional[PhaseProgress]:
    global _ACTIVE
    self._previous, _ACTIVE = _ACTIVE, self.phase
    return self.phase

  def __exit__(self, *exc) -> None:
    global _ACTIVE
    _ACTIVE = self._previous
