"""What the table commands over seeds share (fedmho_tables, fedtsa_tables, fedhydra_tables,
hfldd_compare, hfldd_sweeps): loading the config file they sweep, the mean ± sample std over
seeds of an accuracy (or any number), as text and for plots (one panel or several), and
results.json records keyed by seed, and the date a report is stamped with."""

import datetime
import importlib.util
import json
import os
import pathlib
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple
import warnings

from absl import app
import numpy as np

from jfed.figures import save_png


def load_config_module(path: str, name: str):
  """The config file at `path` as a module named `name`; ConfigError if there is no such file,
  UsageError if it has no get_config."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  if not pathlib.Path(path).is_file():
    raise ConfigError(f'--config: file {path} not found')
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise app.UsageError(f'--config={path!r}: not a Python file')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_config'):
    raise app.UsageError(f'--config={path!r} has no get_config')
  return module


def evidence_lines(module, budget: str) -> List[str]:
  """The config file's measured precondition evidence for the budget's words (its `EVIDENCE`:
  word -> Markdown lines, e.g. the local client curve behind a `plateau` budget)."""
  evidence = getattr(module, 'EVIDENCE', {})
  return [line for w in budget.split(',') if w in evidence for line in evidence[w]]


def report_date() -> str:
  """The ISO date a rendered report carries: today, or the reproducible-builds convention's
  SOURCE_DATE_EPOCH (seconds, UTC) where it is set, so that a re-render after midnight (a resumed
  sweep, the tests) gives the same bytes."""
  epoch = os.environ.get('SOURCE_DATE_EPOCH')
  if epoch:
    try:
      return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc).date().isoformat()
    except (ValueError, OverflowError, OSError) as e:
      raise app.UsageError(f'SOURCE_DATE_EPOCH={epoch!r} is not a count of seconds') from e
  return datetime.date.today().isoformat()


def value_stats(values: Sequence[float], scale: float = 1.0) -> Tuple[float, float]:
  """Mean and sample std (ddof 1; 0 for one value) of `scale` x values; NaN mean for none."""
  v = scale * np.asarray(values, np.float64)
  if not len(v):
    return float('nan'), 0.0
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def percent_stats(values: Sequence[float]) -> Tuple[float, float]:
  """Mean and sample std (ddof 1; 0 for one seed) of accuracies in [0, 1], in %; NaN mean for
  none."""
  return value_stats(values, 100.0)


def percent_stats_each(samples: Sequence[Sequence[float]]) -> Tuple[np.ndarray, np.ndarray]:
  """`percent_stats` of every sample (a bar or a point of a plot): means and stds, [n] each."""
  stats = np.array([percent_stats(v) for v in samples], np.float64).reshape(-1, 2)
  return stats[:, 0], stats[:, 1]


def mean_std(values: Sequence[float], scale: float = 100.0, digits: int = 2) -> Optional[str]:
  """'mean ± std' of `scale` x values (default: accuracies in %, 2 decimals), or None for no
  values."""
  if not len(values):
    return None
  mean, std = value_stats(values, scale)
  return f'{mean:.{digits}f} ± {std:.{digits}f}'


def step_accuracies(workdir: pathlib.Path) -> List[float]:
  """A run's test accuracy per driver step (the last record of each step that has one), from
  its metrics.jsonl."""
  text = (workdir / 'metrics.jsonl').read_text()
  by_step = {}
  for line in text.splitlines():
    record = json.loads(line) if line.strip() else {}
    if record.get('step', 0) >= 1 and record.get('test_accuracy') is not None:
      by_step[int(record['step'])] = float(record['test_accuracy'])
  return [by_step[k] for k in sorted(by_step)]


def last_fifth_rise(accuracy: Sequence[float]) -> Optional[float]:
  """The mean of a curve's last fifth minus the mean of the fifth before it: about 0 on a
  plateau, clearly positive for a curve still climbing (issue 36's evidence that a budget lets a
  method reach its plateau); None for a curve of fewer than 5 points."""
  if len(accuracy) < 5:
    return None
  acc, fifth = np.asarray(accuracy, np.float64), len(accuracy) // 5
  return float(acc[-fifth:].mean() - acc[-2 * fifth : -fifth].mean())


RISE_EXPLAINED = (
  'Rise of the last fifth: the mean test accuracy over the last fifth of the steps minus the mean '
  'over the fifth before it, mean ± std over the seeds, in points. A curve on its plateau rises by '
  'about 0; one still climbing by several points has not reached it, and its method is not yet '
  'compared at its best.'
)


# results.json of a sweep over seeds: results[cell][seed][run] = the run's record, a dict of
# its summary numbers, or {'status': 'error', 'error': message} for a run that failed.


def seed_values(results: Mapping, cell: str, run: str, key: str) -> List[float]:
  """`key` of `run` in `cell` over the seeds whose record has it (the finished ones)."""
  return [
    r[run][key]
    for r in results.get(cell, {}).values()
    if isinstance(r.get(run), dict) and r[run].get(key) is not None
  ]


def is_error(record: Optional[Mapping]) -> bool:
  """Whether `record` is a failed run's (this shape, or hfldd_compare's older {'error': ...})."""
  return isinstance(record, Mapping) and (
    record.get('status') == 'error' or ('error' in record and len(record) == 1)
  )


def seed_errors(results: Mapping, cell: str, run: str) -> int:
  return sum(1 for r in results.get(cell, {}).values() if is_error(r.get(run)))


def seed_cell(results: Mapping, cell: str, run: str, key: str) -> str:
  """A table cell: 'mean ± std (n=seeds)' in %, with the failed seeds counted; '—' for none."""
  values = seed_values(results, cell, run, key)
  n_err = seed_errors(results, cell, run)
  text = f'{mean_std(values)} (n={len(values)})' if values else '—'
  return text + (f', {n_err} error' if n_err else '')


class Ordering(NamedTuple):
  """One pair of methods in the order a paper's table gives them (`better` scored above `worse`
  there), and what our seeds say of it."""

  better: str
  worse: str
  paper: Tuple[float, float]  # the paper's numbers of `better` and `worse`
  ours: Tuple[float, float]  # our means over the seeds both finished (in [0, 1])
  seeds: int  # the seeds with both methods finished
  p_value: float  # paired two-sided t-test over those seeds; NaN with fewer than 2
  verdict: str  # 'holds', 'fails', 'within noise' or 'too few seeds'


def ordering_verdict(better: Sequence[float], worse: Sequence[float], level: float = 0.05):
  """(verdict, p) for a paper's claim that `better` beats `worse`, from values paired by seed
  (the methods of a seed share its partition and, in the one-shot tables, its client models, so
  the seed-to-seed swing cancels): the two-sided paired t-test decides whether the seeds tell
  the two apart at `level`; if they do, the claim holds or fails by the sign of the mean
  difference."""
  from scipy import stats  # pylint: disable=g-import-not-at-top

  a, b = np.asarray(better, np.float64), np.asarray(worse, np.float64)
  if len(a) < 2:
    return 'too few seeds', float('nan')
  d = a - b
  if np.all(d == d[0]):  # no spread: the t statistic is undefined
    p = 1.0 if d[0] == 0 else 0.0
  else:
    with warnings.catch_warnings():  # nearly equal differences: scipy warns, the p is still right
      warnings.simplefilter('ignore', RuntimeWarning)
      p = float(stats.ttest_rel(a, b).pvalue)
  if p >= level:
    return 'within noise', p
  return ('holds' if d.mean() > 0 else 'fails'), p


def paper_orderings(
  results: Mapping, cell: str, paper: Mapping[str, float], key: str = 'final_test_accuracy'
) -> List[Ordering]:
  """Every pair of methods the paper's column `paper` (method -> number) ranks apart, with its
  verdict from our seeds' `key` in `cell` (the seeds where both finished); in the paper's order,
  best first."""
  ranked = sorted(paper, key=lambda m: -paper[m])
  seeds = results.get(cell, {})

  def value(seed: str, run: str) -> Optional[float]:
    record = seeds[seed].get(run)
    return record.get(key) if isinstance(record, dict) else None

  out = []
  for i, hi in enumerate(ranked):
    for lo in ranked[i + 1 :]:
      pairs = [
        (value(s, hi), value(s, lo))
        for s in sorted(seeds)
        if value(s, hi) is not None and value(s, lo) is not None
      ]
      if paper[hi] == paper[lo] or not pairs:
        continue
      a, b = (list(v) for v in zip(*pairs))
      verdict, p = ordering_verdict(a, b)
      out.append(
        Ordering(
          hi,
          lo,
          (paper[hi], paper[lo]),
          (float(np.mean(a)), float(np.mean(b))),
          len(pairs),
          p,
          verdict,
        )
      )
  return out


def ordering_lines(
  orderings: Sequence[Ordering], names: Mapping[str, str], paper_column: bool = True
) -> List[str]:
  """A Markdown table of the orderings and a count of each verdict. `paper_column=False` leaves
  the paper's numbers out: on a dataset the paper does not report, its numbers for another one
  beside ours would read as this dataset's."""
  if not orderings:
    return ['No pair of methods has our numbers on both sides yet.']
  paper_head, paper_rule = ('paper | ', '---|') if paper_column else ('', '')
  lines = [
    f'| paper says | {paper_head}ours (mean %) | seeds | p (paired t) | verdict |',
    f'|---|{paper_rule}---|---|---:|---|',
  ]
  for o in orderings:
    p = '—' if o.p_value != o.p_value else f'{o.p_value:.3f}'
    paper = f'{o.paper[0]:.2f} > {o.paper[1]:.2f} | ' if paper_column else ''
    lines.append(
      f'| {names.get(o.better, o.better)} > {names.get(o.worse, o.worse)} | '
      f'{paper}{100 * o.ours[0]:.2f} vs {100 * o.ours[1]:.2f} | '
      f'{o.seeds} | {p} | {o.verdict} |'
    )
  counts = {
    v: sum(o.verdict == v for o in orderings) for v in dict.fromkeys(o.verdict for o in orderings)
  }
  lines += ['', 'Verdicts: ' + ', '.join(f'{k} {v}' for k, v in counts.items()) + '.']
  return lines


def pretrain_seeds(plan: Callable[[], Sequence[Sequence]], label: str) -> None:
  """`jfed.methods.seed_batch.pretrain_cell` of one cell's seeds (`plan()`: per seed, its
  `seed_batch.PlannedRun`s), printing what it trained. A failure, planning included, is printed
  and the sweep goes on: each run then trains its own clients, as without batching."""
  import traceback  # pylint: disable=g-import-not-at-top

  from jfed.methods import seed_batch  # pylint: disable=g-import-not-at-top

  try:
    done = seed_batch.pretrain_cell(plan())
  except Exception:  # pylint: disable=broad-except  # the runs train their clients themselves
    traceback.print_exc()
    print(f'=== {label}: batched local training failed; each seed trains its own', flush=True)
    return
  trained = sorted({d.seed for d in done if d.trained})
  if trained:
    print(f'=== {label}: local models of seeds {trained} trained in one program', flush=True)


def merge_seed_results(results: Dict, other: Mapping) -> None:
  """Adds `other`'s (cell, seed, run) records to `results`; a finished record wins over an
  error, and two finished records of one run must agree (the same run twice): ConfigError."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  for cell, seeds in other.items():
    for seed, runs in seeds.items():
      mine = results.setdefault(cell, {}).setdefault(seed, {})
      for run, record in runs.items():
        old = mine.get(run)
        if old is None or is_error(old):
          mine[run] = record
        elif not is_error(record) and old != record:
          raise ConfigError(f'--merge: {cell} seed {seed} {run} differs between the sweeps')


def machine_meta() -> Dict[str, str]:
  """The results.json meta keys naming where a sweep runs (read back by `backend_of`)."""
  import jax  # pylint: disable=g-import-not-at-top

  return {
    'backend': jax.default_backend(),
    'device_kind': jax.devices()[0].device_kind,
    'jax_version': jax.__version__,
  }


def backend_of(meta: Mapping) -> str:
  """Where a sweep's runs ran, from its results.json meta: 'gpu (NVIDIA H100 ...), jax 0.11.2'."""
  kind = meta.get('device_kind') or ''
  kind = f' ({kind})' if kind and kind.lower() != meta.get('backend') else ''
  return f'{meta.get("backend", "?")}{kind}, jax {meta.get("jax_version", "?")}'


def stamp_backend(results: Dict, meta: Mapping) -> None:
  """Marks every finished record without a 'backend' as run where `meta` says: records keep
  their backend when sweeps from several machines are merged into one table."""
  here = backend_of(meta)
  for seeds in results.values():
    for runs in seeds.values():
      for record in runs.values():
        if isinstance(record, dict) and not is_error(record):
          record.setdefault('backend', here)


def write_seed_results(
  path: pathlib.Path, meta: Mapping, results: Dict, extra: Optional[Mapping] = None
) -> None:
  """Writes a sweep's results.json atomically, its unmarked records marked as run here;
  `extra`'s keys (derived data, never read back) follow meta and results."""
  from jfed.workdir import atomic_write_text  # pylint: disable=g-import-not-at-top

  stamp_backend(results, meta)
  saved = {'meta': meta, 'results': results}
  saved.update((k, v) for k, v in (extra or {}).items() if k not in saved)
  atomic_write_text(path, json.dumps(saved, indent=2))


def backend_line(results: Mapping, fallback: Mapping) -> str:
  """'Backend X' when every finished run ran on X (`fallback`'s meta when none has run);
  otherwise the most used backend and, per other backend, the (cell, seed) runs on it."""
  where: Dict[str, List[Tuple[str, str, str]]] = {}
  for cell, seeds in results.items():
    for seed, runs in seeds.items():
      for run, record in runs.items():
        if isinstance(record, dict) and record.get('backend'):
          where.setdefault(record['backend'], []).append((cell, seed, run))
  if len(where) <= 1:
    return f'Backend {next(iter(where), backend_of(fallback))}'
  main, *others = sorted(where, key=lambda b: -len(where[b]))
  parts = []
  for backend in others:
    by_cell: Dict[Tuple[str, str], List[str]] = {}
    for cell, seed, run in where[backend]:
      by_cell.setdefault((cell, seed), []).append(run)
    cells = []
    for (cell, seed), runs in sorted(by_cell.items()):
      every = set(runs) == set(results[cell][seed])
      cells.append(f'{cell} seed {seed} ({"every run" if every else ", ".join(sorted(runs))})')
    parts.append(f'{backend}: {"; ".join(cells)}')
  return f'Backend {main}, except on ' + '; on '.join(parts)


def read_seed_results(
  results_path: pathlib.Path,
  merge: Sequence[str],
  meta: Dict,
  read: Optional[Callable[[pathlib.Path], Dict]] = None,
) -> Dict:
  """The results a sweep starts from: those OUT/results.json already holds (a resumed or
  re-merged OUT keeps its seeds) with every `merge` directory's results.json merged in
  (`merge_seed_results`); their seeds join `meta['seeds']`. Each record read keeps the backend
  its file's meta names (`stamp_backend`). `read(path)` loads one file
  (default: its JSON) and may refuse it; a missing merge file is a ConfigError."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  read = read or (lambda path: json.loads(path.read_text()))
  results = {}
  if results_path.exists():
    saved = read(results_path)
    results = saved['results']
    stamp_backend(results, saved['meta'])
    meta['seeds'] = sorted(set(meta['seeds']) | set(saved['meta'].get('seeds', [])))
  for d in merge:
    path = pathlib.Path(d) / 'results.json'
    if not path.exists():
      raise ConfigError(f'--merge: {path} does not exist')
    other = read(path)
    stamp_backend(other['results'], other['meta'])
    merge_seed_results(results, other['results'])
    meta['seeds'] = sorted(set(meta['seeds']) | set(other['meta']['seeds']))
  return results


def curve_stats(
  curves: Sequence[Tuple[Sequence[float], Sequence[float]]], scale: float = 100.0
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-seed curves (xs, ys) as one: every x any seed has, and the mean and sample std of
  `scale` x the ys of the seeds that have that x (an x of one seed has std 0)."""
  at: Dict[float, List[float]] = {}
  for xs, ys in curves:
    for x, y in zip(xs, ys):
      at.setdefault(x, []).append(y)
  x = np.array(sorted(at), np.float64)
  stats = np.array([value_stats(at[k], scale) for k in sorted(at)], np.float64).reshape(-1, 2)
  return x, stats[:, 0], stats[:, 1]


def draw_bands(
  ax,
  bands: Mapping[str, Tuple[Sequence[float], Sequence[float], Sequence[float]]],
  hlines: Optional[Mapping[str, float]] = None,
  integer_x: bool = True,
) -> None:
  """On matplotlib axes `ax`: one line per name at its mean with a shaded ± std band
  (bands[name] = (x, mean, std), e.g. from `curve_stats`), dashed horizontal lines for `hlines`
  and, when there is anything to name, a legend; `integer_x`: x counts epochs or rounds."""
  for i, (name, (x, mean, std)) in enumerate(bands.items()):
    x, mean, std = (np.asarray(a, np.float64) for a in (x, mean, std))
    color = f'C{i % 10}'
    ax.plot(x, mean, marker='o' if len(x) < 30 else None, markersize=3, color=color, label=name)
    ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
  for i, (name, value) in enumerate((hlines or {}).items()):
    color = f'C{(len(bands) + i) % 10}'
    ax.axhline(value, linestyle='--', linewidth=1, color=color, label=name)
  if integer_x:
    from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.grid(alpha=0.3)
  if bands or hlines:
    ax.legend(fontsize=7)


def plot_bands(
  path: pathlib.Path,
  bands: Mapping[str, Tuple[Sequence[float], Sequence[float], Sequence[float]]],
  xlabel: str,
  ylabel: str,
  title: str,
  hlines: Optional[Mapping[str, float]] = None,
  integer_x: bool = True,
) -> None:
  """One line per name at its mean with a shaded ± std band (bands[name] = (x, mean, std),
  e.g. from `curve_stats`), and dashed horizontal lines for `hlines`; `integer_x`: x counts
  epochs or rounds."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(6.5, 4), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  draw_bands(ax, bands, hlines, integer_x)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  save_png(fig, path)


def plot_band_panels(
  path: pathlib.Path,
  panels: Mapping[str, Mapping[str, Tuple[Sequence[float], Sequence[float], Sequence[float]]]],
  xlabel: str,
  ylabel: str,
  title: str,
  integer_x: bool = True,
) -> None:
  """`plot_bands` side by side, one panel per name of `panels` (its title) sharing the y axis;
  `title` above them all."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  n = max(1, len(panels))
  fig = Figure(figsize=(max(6.5, 4.2 * n), 4.3), dpi=120)
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
  for ax, (name, bands) in zip(axes, panels.items()):
    draw_bands(ax, bands, integer_x=integer_x)
    if not bands:
      ax.text(0.5, 0.5, 'no finished run', transform=ax.transAxes, ha='center', va='center')
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(xlabel)
  axes[0].set_ylabel(ylabel)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  save_png(fig, path)
