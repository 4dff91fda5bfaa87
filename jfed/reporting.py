"""What a run shows a researcher: progress lines, curves and tables.

(Metrics and summaries are written by jfed.driver through jfed.workdir's atomic JSON.)
"""

import contextlib
import contextvars
import math
import sys
import time
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence

import jax

from jfed.figures import save_png

# Whether progress lines are wanted: `jfed.run(progress=False)` turns them off for its run.
_SHOW_PROGRESS = contextvars.ContextVar('jfed_show_progress', default=True)


def progress_wanted() -> bool:
  """False inside `progress_lines(False)`."""
  return _SHOW_PROGRESS.get()


@contextlib.contextmanager
def progress_lines(show: bool) -> Iterator[None]:
  """Within the block, every `Progress` prints (show=True) or stays silent."""
  token = _SHOW_PROGRESS.set(show)
  try:
    yield
  finally:
    _SHOW_PROGRESS.reset(token)


class Progress:
  """A progress line on stderr for long work: `label  done/total  rate  eta`.

  Rewrites one line on a terminal; elsewhere (CI logs, files) prints at most every `every_s`.
  Silent in the processes of a multi-process run other than process 0, which speaks for all,
  and inside `progress_lines(False)`.
  """

  def __init__(
    self, label: str, total: int, unit: str = 'step', every_s: float = 10.0, stream=None
  ):
    self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
    self.stream = stream or sys.stderr
    self.start = self.last = time.monotonic()
    self.tty = hasattr(self.stream, 'isatty') and self.stream.isatty()
    self.silent = jax.process_index() != 0 or not progress_wanted()

  def update(self, done: int, extra: str = '') -> None:
    now = time.monotonic()
    final = done >= self.total
    if self.silent or not (self.tty or final or now - self.last >= self.every_s):
      return
    self.last = now
    elapsed = now - self.start
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (self.total - done) / rate if rate > 0 else math.inf
    eta_s = f'eta {eta:5.0f}s' if math.isfinite(eta) else ''
    line = (
      f'{self.label} {done}/{self.total} {self.unit}s  {rate:6.2f} {self.unit}/s  '
      f'{elapsed:5.0f}s {eta_s} {extra}'
    )
    self.stream.write(('\r' + line) if self.tty else line + '\n')
    if self.tty and final:
      self.stream.write('\n')
    self.stream.flush()

  def __call__(self, done: int, total: int) -> None:
    self.update(done)


def plot_curves(
  path,
  series: Dict[str, Sequence[float]],
  xlabel: str,
  ylabel: str,
  title: Optional[str] = None,
  x: Optional[Dict[str, Sequence[float]]] = None,
  hlines: Optional[Dict[str, float]] = None,
) -> None:
  """Line plot of named series (e.g. test accuracy per round, one line per method).

  Args:
    path: Where the figure is saved.
    series: name -> y values, one line each.
    xlabel: x-axis label.
    ylabel: y-axis label.
    title: Axes title; None for none.
    x: name -> x values of that series; None (or a missing name) plots against 1..n.
    hlines: name -> y value of a horizontal reference line; None for none.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(6, 4), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for name, ys in series.items():
    xs = (x or {}).get(name, range(1, len(ys) + 1))
    ax.plot(list(xs), list(ys), marker='o' if len(ys) < 30 else None, label=name)
  for name, value in (hlines or {}).items():
    ax.axhline(value, linestyle='--', linewidth=1, color='gray')
    ax.annotate(name, (0, value), xycoords=('axes fraction', 'data'), fontsize=8, va='bottom')
  from matplotlib.ticker import MaxNLocator

  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  if series:
    ax.legend(fontsize=8)
  fig.tight_layout()
  save_png(fig, path)


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  """A plain fixed-width text table (also valid Markdown)."""
  rows = [[_fmt(c) for c in r] for r in rows]
  widths = [
    max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
    for i, h in enumerate(header)
  ]
  line = lambda cells: '| ' + ' | '.join(str(c).ljust(w) for c, w in zip(cells, widths)) + ' |'
  sep = '|' + '|'.join('-' * (w + 2) for w in widths) + '|'
  return '\n'.join([line(header), sep] + [line(r) for r in rows])


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f'{value:.4g}' if abs(value) < 1e4 else f'{value:.3e}'
  return str(value)
