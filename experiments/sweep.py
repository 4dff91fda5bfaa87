"""The sweep runner the table commands stand on: a sweep is cells x seeds x runs (a run = a
method and its config), written to OUT/results.json as results[cell][seed][run] = the run's
record, a dict of its summary numbers, or `error_record`'s {'status': 'error', 'error': message}
for a run that failed.

- Resumable: a run whose record is finished is skipped; a failed run is recorded and retried on
  the next invocation (and the sweep goes on).
- Atomic: results.json and every table are written through `jfed.workdir.atomic_write_text`,
  after each run, so a killed sweep keeps what it finished.
- Mergeable: `--merge=OUT1,OUT2` adds other machines' results (each record keeps the backend
  its file names: `seed_tables.stamp_backend`).
- Statistics: mean ± sample std over seeds of the final and best accuracy (`cell_stats`,
  `seed_tables.seed_cell`), Markdown tables (`table_lines`) and plots (`plot_errorbar_panels`,
  `seed_tables.plot_bands`).

A table command declares its cells, runs, headers and paper numbers and calls `Sweep.run_one`
per (cell, seed, run); `seed_tables` keeps the statistics, the paper-ordering verdicts and seed
batching (`seed_tables.pretrain_seeds`).
"""

import dataclasses
import pathlib
import traceback
from typing import (
  Any,
  Callable,
  Dict,
  Iterable,
  List,
  Mapping,
  NamedTuple,
  Optional,
  Sequence,
  Tuple,
)

from experiments.seed_tables import (
  is_error,
  machine_meta,
  read_seed_results,
  report_date,
  seed_errors,
  seed_values,
  value_stats,
  write_seed_results,
)
from jfed.figures import save_png

Record = Dict[str, Any]
Results = Dict[str, Dict[str, Dict[str, Record]]]

# The summary numbers every table reads.
ACCURACY_KEYS = ('final_test_accuracy', 'best_test_accuracy')


def error_record(e: BaseException) -> Record:
  """The one shape of a failed run's record."""
  return {'status': 'error', 'error': f'{type(e).__name__}: {e}'}


def is_finished(record: Optional[Mapping]) -> bool:
  return isinstance(record, Mapping) and bool(record) and not is_error(record)


def summary_record(summary: Any, keys: Sequence[str]) -> Record:
  """The `keys` of a `jfed` run summary (None where it has none)."""
  return {k: summary.get(k) for k in keys}


class Stats(NamedTuple):
  """A (cell, run)'s `key` over the seeds: mean and sample std of `scale` x the values of the
  finished seeds (NaN mean for none), their count and the failed seeds' count."""

  mean: float
  std: float
  n: int
  errors: int


def cell_stats(results: Mapping, cell: str, run: str, key: str, scale: float = 100.0) -> Stats:
  values = seed_values(results, cell, run, key)
  return Stats(*value_stats(values, scale), len(values), seed_errors(results, cell, run))


def table_lines(head: Sequence[str], rows: Iterable[Sequence[str]]) -> List[str]:
  """A Markdown table: the first column left-aligned (names), the others right-aligned."""
  lines = ['| ' + ' | '.join(head) + ' |', '|---|' + '---:|' * (len(head) - 1)]
  return lines + ['| ' + ' | '.join(row) + ' |' for row in rows]


@dataclasses.dataclass
class Sweep:
  """One sweep's OUT: its results (read back, merged) and their meta; `run_one` runs a run not
  finished yet and saves. `render(sweep)` returns the files to write beside results.json after
  each save ({name: text}); `after_save(sweep)` draws what is not text (plots); `derived(sweep)`
  returns what results.json carries beside meta and results, recomputed from them at each save
  and never read back (e.g. per-seed tables for other tools). Its runs share their client
  trainers' compiled programs through jit's cache (`jfed.engine.training.ClientProgram`)."""

  out: pathlib.Path
  meta: Dict[str, Any]
  results: Results
  render: Optional[Callable[['Sweep'], Mapping[str, str]]] = None
  after_save: Optional[Callable[['Sweep'], None]] = None
  derived: Optional[Callable[['Sweep'], Mapping[str, Any]]] = None

  @classmethod
  def open(
    cls,
    out: pathlib.Path,
    seeds: Sequence[int],
    merge: Sequence[str] = (),
    read: Optional[Callable[[pathlib.Path], Dict]] = None,
    **meta: Any,
  ) -> 'Sweep':
    """OUT's sweep: meta = where it runs (`seed_tables.machine_meta`), the report date, `meta`
    and the seeds; results = those OUT/results.json holds with `merge`'s merged in (their seeds
    join meta['seeds']). `read(path)` loads one results.json and may refuse it."""
    meta = {**machine_meta(), 'date': report_date(), **meta, 'seeds': list(seeds)}
    results = read_seed_results(out / 'results.json', merge, meta, read)
    return cls(out, meta, results)

  def record(self, cell: str, seed: int, run: str) -> Optional[Record]:
    return self.results.get(cell, {}).get(str(seed), {}).get(run)

  def finished(self, cell: str, seed: int, run: str) -> bool:
    return is_finished(self.record(cell, seed, run))

  def save(self) -> None:
    """results.json, then the rendered files and the plots, each written atomically."""
    from jfed.workdir import atomic_write_text  # pylint: disable=g-import-not-at-top

    self.out.mkdir(parents=True, exist_ok=True)
    extra = self.derived(self) if self.derived else {}
    write_seed_results(self.out / 'results.json', self.meta, self.results, extra)
    for name, text in (self.render(self) if self.render else {}).items():
      atomic_write_text(self.out / name, text)
    if self.after_save:
      self.after_save(self)

  def run_one(
    self,
    cell: str,
    seed: int,
    run: str,
    execute: Callable[[], Record],
    label: str = '',
    save: bool = True,
  ) -> Optional[Record]:
    """Runs `execute()` (which returns the run's record) unless (cell, seed, run) is finished;
    a failure is printed and recorded as `error_record`, and the sweep goes on. Saves after a
    run (with `save`). Returns the record (None when skipped)."""
    if self.finished(cell, seed, run):
      return None
    print(f'=== {label or f"{cell} seed={seed} {run}"}', flush=True)
    mine = self.results.setdefault(cell, {}).setdefault(str(seed), {})
    try:
      mine[run] = execute()
    except Exception as e:  # pylint: disable=broad-except  # one failure must not lose the sweep
      traceback.print_exc()
      mine[run] = error_record(e)
    if save:
      self.save()
    return mine[run]

  def text(self, name: str) -> str:
    return (self.out / name).read_text()


def check_known(flag: str, given: Sequence[str], valid: Iterable[str]) -> None:
  """ConfigError naming `--flag` and the valid names when `given` has an unknown one."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  valid = list(valid)
  unknown = [g for g in given if g not in valid]
  if unknown:
    raise ConfigError(f'--{flag}: unknown {unknown}; valid: {", ".join(valid)}')


def define_flags(
  out: Optional[str],
  seeds: Sequence[str] = ('0', '1', '2'),
  merge: bool = True,
  config: Optional[str] = None,
  smoke: Optional[str] = None,
  config_required: bool = True,
) -> None:
  """The flags every sweep command shares: --out, --seeds, --merge, with `config` (its help)
  --config as a config file (`ml_collections.config_flags`: FILE or FILE:words) and with `smoke`
  (its help) --smoke.

  Args:
    out: --out's default (None: the command requires it or derives it).
    seeds: --seeds' default.
    merge: whether the command merges other OUTs' results (--merge).
    config: --config's help; None: the command takes no config file.
    smoke: --smoke's help; None: no --smoke.
    config_required: whether --config must be given (False: a command that can render stored
      results with the config they were run with).
  """
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_string('out', out, 'Output directory.')
  flags.DEFINE_list('seeds', list(seeds), 'Seeds (partition, initialisations; >= 3 for a table).')
  if smoke is not None:
    flags.DEFINE_bool('smoke', False, smoke)
  if merge:
    flags.DEFINE_list(
      'merge',
      [],
      'Instead of running: merge the results.json of these output directories (sweeps of other '
      'seeds, e.g. run on other machines) into OUT and write its tables.',
    )
  if config is not None:
    from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

    config_flags.DEFINE_config_file('config', None, config, lock_config=False)
    if config_required:
      flags.mark_flags_as_required(['config'])


def config_flag(name: str = 'config') -> Tuple[str, str]:
  """(FILE, words) of a config-file flag given as FILE[:words], for a command that calls the
  file's get_config with other words per run. Such a command cannot apply `--config.key=value`
  overrides to its runs: a ConfigError says so."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  flag = flags.FLAGS[name]
  if flag.override_values:
    raise ConfigError(
      f'--{name}.{next(iter(flag.override_values))}: this command builds each run from the '
      "config file's words; give them after the file (FILE:words) instead of overrides"
    )
  path, _, words = flag.config_filename.partition(':')
  return path, words


def parse_flags(argv: List[str]) -> List[str]:
  """absl's parser, with a bad flag or config file (a missing file, an unknown config word: an
  error inside get_config) as one `error:` line and exit status 2, as experiments.main does."""
  import sys  # pylint: disable=g-import-not-at-top

  from absl import flags  # pylint: disable=g-import-not-at-top

  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  # absl/ml_collections raise many types
    cause = e
    while cause.__cause__ is not None or (
      cause.__context__ is not None and not isinstance(cause, flags.Error)
    ):
      cause = cause.__cause__ or cause.__context__
    message = str(cause)
    if 'Traceback (most recent call last)' in message:  # an error inside get_config(arg)
      last = [line for line in message.splitlines() if line.strip()][-1]
      message = last.split(': ', 1)[1] if ': ' in last else last
    print(f'error: {" ".join(message.split()) or type(cause).__name__}', file=sys.stderr)
    sys.exit(2)


def run_command(main: Callable[[List[str]], None], define: Callable[[], None]) -> None:
  """`absl.app.run(main)` after `define()`, with a user's error as one `error:` line instead of
  a traceback: a bad flag or config file (`parse_flags`, exit status 2) or a
  `jfed.errors.JfedError` of the run (an unknown run, a missing --merge directory; exit 1)."""
  import sys  # pylint: disable=g-import-not-at-top

  from absl import app  # pylint: disable=g-import-not-at-top

  from jfed import console  # pylint: disable=g-import-not-at-top
  from jfed.errors import JfedError  # pylint: disable=g-import-not-at-top

  def guarded(argv: List[str]) -> None:
    console.console_logging()  # orbax's INFO lines would bury the progress lines
    try:
      main(argv)
    except JfedError as e:
      print(f'error: {" ".join(str(e).split()) or type(e).__name__}', file=sys.stderr)
      sys.exit(1)

  define()
  app.run(guarded, flags_parser=parse_flags)


def plot_errorbar_panels(
  path: pathlib.Path,
  panels: Mapping[str, Mapping[str, Any]],
  xlabel: str,
  ylabel: str,
  title: str,
  ylim: Optional[Sequence[float]] = None,
) -> None:
  """One panel per name of `panels` (its title), a mean ± std errorbar line per label:
  panels[name][label] = (x, means, stds); the legend on the last panel."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  n = max(1, len(panels))
  fig = Figure(figsize=(3.2 * n + 1, 3.4), dpi=120)
  FigureCanvasAgg(fig)
  for j, (name, lines) in enumerate(panels.items()):
    ax = fig.add_subplot(1, n, j + 1)
    for label, (x, mean, std) in lines.items():
      ax.errorbar(x, mean, yerr=std, marker='o', ms=3, capsize=2, label=label)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(xlabel)
    if ylim is not None:
      ax.set_ylim(*ylim)
    if j == 0:
      ax.set_ylabel(ylabel)
  if fig.axes and fig.axes[-1].get_legend_handles_labels()[0]:
    fig.axes[-1].legend(fontsize=7, loc='lower left')
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  save_png(fig, path)
