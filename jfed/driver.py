"""One driver runs every method: checkpoints, resume, metrics, the run summary, progress, plots.

A method is a `jfed.api.Algorithm` (setup / init / step over a `jfed.api.RunContext`).
The driver owns everything else: after each step it checks the records and the state are finite,
numbers the records (`step` = i + 1), adds `seconds` and the running `cumulative_bytes`, saves
the state together with the whole metric history in one checkpoint, rewrites `metrics.jsonl`
atomically and prints progress. A resumed run restores state and history from the newest
checkpoint that loads; history is never re-read from `metrics.jsonl`. The same records go to
TensorBoard event files (`<workdir>/tensorboard/`) and, with `logging.wandb`, to Weights & Biases
(jfed/io/scalars.py). At the end it builds the typed `RunSummary` (final and best accuracy,
bytes, the method's extras), writes `summary.json` and plots `accuracy.png`.

`run(algorithm, ctx)` needs no workdir: with `ctx.workdir=None` nothing is written and stages
are cached in memory, so a notebook can call a method and get a `RunSummary` back.
`run_experiment(method, config, workdir)` is the command line's path: validation, workdir
identity and lock, data, partition, then `run`.
"""

import contextlib
import dataclasses
import json
import math
import pathlib
import platform
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jfed import __version__
from jfed.api import (  # the names a method stands on, re-exported for the driver's callers
  BYTE_FIELDS,
  Algorithm,
  Record,
  RunContext,
  RunSummary,
  context_of_config,
  hold_out,
  load_run_dataset,
  make_context,
  partition_clients,
)
from jfed.data import (
  Dataset,
  class_count_table,
  format_count_table,
  unassigned_count,
)
from jfed.data.plots import plot_partition_bubbles
from jfed.data.public import holdout_size
from jfed.engine import multihost
from jfed.engine.evaluation import TrainedModel
from jfed.errors import ConfigError, NonFiniteError, WorkdirError
from jfed.io import Checkpointer
from jfed.io.checkpoint import first_non_finite
from jfed.io.scalars import ScalarLoggers, logging_config
from jfed.methods.registry import get_method, registered_methods
from jfed.reporting import plot_curves
from jfed.run_config import check_capabilities, validate_run_config
from jfed.workdir import Workdir, array_fingerprint, atomic_write_text, dumps, jsonable, write_json

__all__ = [
  'BYTE_FIELDS',
  'Algorithm',
  'Record',
  'RunCheckpointer',
  'RunContext',
  'RunSummary',
  'Finished',
  'build_algorithm',
  'context_of_config',
  'experiment_to_end',
  'hold_out',
  'make_context',
  'partition_clients',
  'run',
  'run_experiment',
  'run_in_memory',
  'run_to_end',
]


# ------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------
def _environment() -> Dict[str, Any]:
  return {
    'devices': [str(d) for d in jax.devices()],
    'jax_version': jax.__version__,
    'jfed_version': __version__,
    'host': platform.node(),
  }


class RunCheckpointer(Checkpointer):
  """The driver's per-step checkpoints (state + history); tests patch its `save`."""


def _same_leaves(state: Any, previous: Any) -> bool:
  """Whether `state` is `previous` leaf for leaf (the same array objects: nothing recomputed),
  whatever tuples a method wrapped them in again."""
  leaves, tree = jax.tree_util.tree_flatten(state)
  old_leaves, old_tree = jax.tree_util.tree_flatten(previous)
  return tree == old_tree and all(a is b for a, b in zip(leaves, old_leaves))


def _check_finite_records(records: Sequence[Record], where: str) -> None:
  for record in records:
    for k, v in record.items():
      if (
        isinstance(v, (float, np.floating))
        and not math.isfinite(v)
        and ('loss' in k or 'accuracy' in k)
      ):
        hint = '; lower the learning rate or check the data' if 'loss' in k else ''
        raise NonFiniteError(f'{k} became {v} at {where}{hint}')


@jax.jit
def _all_finite(leaves: List[jax.Array]) -> jax.Array:
  # One program per state structure: op by op, every leaf shape compiled its own isfinite.
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def _check_finite_state(state: Any, where: str) -> None:
  if jax.default_backend() == 'cpu':
    # Host arrays share the buffers of CPU device arrays: checking them costs no transfer and
    # no compilation (one program per state structure, otherwise).
    bad = first_non_finite(state)
  else:
    leaves = [
      (path, leaf)
      for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
      if hasattr(leaf, 'dtype') and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    if not leaves:
      return
    try:
      finite = np.asarray(jax.device_get(_all_finite([leaf for _, leaf in leaves])))
    except ValueError:  # leaves committed to different devices cannot meet in one program
      finite = np.array(jax.device_get([jnp.all(jnp.isfinite(leaf)) for _, leaf in leaves]))
    # one host transfer per step; name the first bad leaf
    first = leaves[int(np.argmin(finite))][0]
    bad = None if finite.all() else f'state{jax.tree_util.keystr(first)}'
  if bad is not None:
    raise NonFiniteError(f'{bad} became non-finite at {where}')


def _add_cumulative_bytes(history: List[Record]) -> None:
  total = 0
  for r in history:
    if any(k in r for k in BYTE_FIELDS):
      total += sum(int(r.get(k) or 0) for k in BYTE_FIELDS)
      r['cumulative_bytes'] = total


def _total_bytes(history: Sequence[Record]) -> Optional[int]:
  if not any(k in r for r in history for k in BYTE_FIELDS):
    return None
  return int(sum(int(r.get(k) or 0) for r in history for k in BYTE_FIELDS))


class _Metrics:
  """metrics.jsonl, rewritten atomically from the in-memory history after every step."""

  def __init__(self, workdir: Optional[pathlib.Path]):
    self.path = None if workdir is None else workdir / 'metrics.jsonl'

  def write(self, history: Sequence[Record]) -> None:
    if self.path is not None:
      atomic_write_text(self.path, ''.join(dumps(r) + '\n' for r in history))


class Finished(NamedTuple):
  """What `run_to_end` leaves: the summary, the method's final state, every record, and the
  server model where the method has one (`Algorithm.trained_model`)."""

  summary: RunSummary
  state: Any
  history: List[Record]
  model: Optional[TrainedModel]


def run(algorithm: Algorithm, ctx: RunContext, progress: bool = True) -> RunSummary:
  """Runs `algorithm` to completion, resuming from `ctx.workdir`'s checkpoints if any.

  Args:
    algorithm: The method, its config already validated.
    ctx: The run context (data, partition, typed run config, workdir or None).
    progress: Whether to print a line per step.

  Returns:
    The run's typed summary (also written to workdir/summary.json).
  """
  return _run(algorithm, ctx, progress, keep_state=False).summary


def run_to_end(algorithm: Algorithm, ctx: RunContext, progress: bool = True) -> Finished:
  """`run`, keeping the final state, the history and the server model (the Python API's path).
  A workdir whose run is complete is not run again: its last checkpoint is read back.

  Args:
    algorithm: The method, its config already validated.
    ctx: The run context.
    progress: Whether to print a line per step.

  Returns:
    The summary, final state, history and server model.
  """
  return _run(algorithm, ctx, progress, keep_state=True)


def _run(algorithm: Algorithm, ctx: RunContext, progress: bool, keep_state: bool) -> Finished:
  invocation_start = time.perf_counter()
  talk = progress and ctx.is_primary
  say = (lambda msg: print(msg, flush=True)) if talk else (lambda msg: None)
  workdir = ctx.workdir
  writes = workdir is not None and ctx.is_primary  # metrics, scalars, summary and plots
  log_options = logging_config(ctx.config) if workdir is not None else None
  n = algorithm.num_steps(ctx)
  if n < 1:
    raise ConfigError(f'{algorithm.name} has no {algorithm.step_name}s to run (num_steps = {n})')
  summary_path = None if workdir is None else workdir / 'summary.json'
  complete = summary_path is not None and summary_path.exists()
  if complete:
    try:
      summary = RunSummary.from_dict(json.loads(summary_path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
      raise WorkdirError(
        f'{summary_path} is damaged ({type(e).__name__}: {e}); delete it and run again: the '
        'run resumes from its last checkpoint and writes it anew'
      ) from None
    complete = summary.steps == n
  # Every process must agree on whether to run (it will meet the others in collectives).
  if bool(multihost.broadcast_from_primary(np.int32(complete))):
    if not complete:
      raise WorkdirError(
        f'process 0 finds the run in {workdir} complete but this process cannot read its '
        'summary.json: the processes of a run need a workdir they all share'
      )
    say(
      f'{algorithm.name} in {workdir} is already complete ({n} {algorithm.step_name}s); '
      'summary.json kept'
    )
    state = history = model = None
    if keep_state:
      aux = algorithm.setup(ctx)
      ckpt = RunCheckpointer(workdir / 'checkpoints')
      try:
        _, state, history = ckpt.restore_latest(algorithm.init(ctx, aux), with_history=True)
      finally:
        ckpt.close()
      model = algorithm.trained_model(ctx, aux, state)
    # this invocation's time, not the one that finished the run (summary.json keeps that)
    summary = dataclasses.replace(
      summary, seconds_this_invocation=time.perf_counter() - invocation_start
    )
    return Finished(summary, state, history, model)

  t0 = time.perf_counter()
  aux = algorithm.setup(ctx)
  template = algorithm.init(ctx, aux)
  setup_seconds = time.perf_counter() - t0
  ckpt = None if workdir is None else RunCheckpointer(workdir / 'checkpoints')
  metrics = _Metrics(workdir if writes else None)
  loggers, completed = None, False
  try:
    start, state, history = (
      ckpt.restore_latest(template, with_history=True) if ckpt else (None, template, [])
    )
    if start:
      if start > n:
        raise ConfigError(
          f'{workdir / "checkpoints"} holds {algorithm.step_name} {start} but the run has only {n}'
        )
      say(f'{algorithm.name}: resuming from {algorithm.step_name} {start}')
    else:
      start, history = 0, []
      for r in algorithm.setup_records(ctx, aux):
        history.append({'step': 0, **r, 'seconds': setup_seconds})
      _check_finite_records(history, 'setup')
      _add_cumulative_bytes(history)
    metrics.write(history)
    loggers = ScalarLoggers(log_options, workdir if writes else None, ctx.config, start)
    if not start:  # a resumed run's earlier records are in the event files already
      loggers.write(history)
    # an unverified checkpoint (no checksums) may hold a flipped byte that only training shows
    unverified = start if start and not ckpt.verified(start) else None
    for i in range(start, n):
      t_step = time.perf_counter()
      previous = state
      where = f'{algorithm.step_label(i, n, aux)} of {algorithm.name}'
      try:
        state, records = algorithm.step(ctx, aux, state, i)
        # A step that returns its input state's leaves and no records changed nothing: the last
        # checkpoint already holds it, and a resume re-runs such steps in no time. FedDF's
        # teachers made each of these checkpoints 1 GiB after its early stop at the paper's
        # budget.
        unchanged = not records and _same_leaves(state, previous)
        _check_finite_records(records, where)
        if not (unchanged and i > start):  # an unchanged state was checked after step i - 1
          _check_finite_state(state, where)
      except NonFiniteError as e:
        if unverified is None or i != start:
          raise
        aside = ckpt.set_aside(unverified)
        raise NonFiniteError(
          f'{where} turned non-finite right after resuming from the unverified checkpoint '
          f'{unverified} (it has no checksums, so a damaged byte cannot be ruled out): it was set '
          f'aside as {aside}; run the same command again to resume from the one before it ({e})'
        ) from e
      seconds = time.perf_counter() - t_step
      for r in records:
        history.append({'step': i + 1, **r, 'seconds': seconds})
      _add_cumulative_bytes(history)
      metrics.write(history)
      # Before the checkpoint: a kill in between resumes from step i, whose writer purges these.
      loggers.write(history[len(history) - len(records) :])
      if ckpt is not None and not unchanged:
        ckpt.save(i + 1, state, jsonable(history))
      accuracy = next(
        (r['test_accuracy'] for r in reversed(records) if r.get('test_accuracy') is not None), None
      )
      if not records:  # a step with nothing to report (e.g. after FedDF's early stop)
        continue
      say(
        f'{algorithm.name} {algorithm.step_label(i, n, aux)}: '
        + (f'test accuracy {accuracy:.4f} ' if accuracy is not None else '')
        + f'({seconds:.1f}s)'
      )
    completed = True
  finally:
    if loggers is not None:
      loggers.close(completed)
    if ckpt is not None:
      ckpt.close()

  extras = dict(algorithm.summarize(ctx, aux, state, history))
  # what the accuracies were measured on, unless the method holds more out (a public set)
  extras.setdefault('eval_samples', int(len(ctx.dataset.test_y)))
  if any('rejected_uploads' in r for r in history):  # uploads the server refused and excluded
    extras['rejected_uploads'] = int(sum(r.get('rejected_uploads') or 0 for r in history))
  accs = [(r['test_accuracy'], r['step']) for r in history if r.get('test_accuracy') is not None]
  final = extras.pop('final_test_accuracy', None)
  final = algorithm.final_accuracy(history) if final is None else final
  best, best_step = max(accs, key=lambda a: a[0]) if accs else (None, None)
  if final is not None and (best is None or final > best):
    best, best_step = final, n
  summary = RunSummary(
    method=algorithm.name,
    dataset=ctx.dataset.name,
    step_name=algorithm.step_name,
    steps=n,
    final_test_accuracy=final,
    best_test_accuracy=best,
    best_step=best_step,
    total_bytes=_total_bytes(history),
    seconds=float(sum({r['step']: r.get('seconds') or 0.0 for r in history}.values())),
    seconds_this_invocation=time.perf_counter() - invocation_start,
    num_clients=ctx.num_clients,
    partition=str(ctx.config.partition.scheme),
    backend=jax.default_backend(),
    extras=extras,
    environment=_environment(),
  )
  if writes:
    write_json(workdir / 'summary.json', summary.as_dict())
    _plot_accuracy(workdir / 'accuracy.png', summary, history)
  model = algorithm.trained_model(ctx, aux, state) if keep_state else None
  return Finished(summary, state if keep_state else None, history, model)


def _plot_accuracy(path: pathlib.Path, summary: RunSummary, history: Sequence[Record]) -> None:
  records = [r for r in history if r.get('test_accuracy') is not None]
  if not records:
    return
  plot_curves(
    path,
    {summary.method: [r['test_accuracy'] for r in records]},
    xlabel=summary.step_name,
    ylabel='test accuracy',
    x={summary.method: [r['step'] for r in records]},
    title=f'{summary.method} on {summary.dataset} '
    f'({summary.num_clients} clients, {summary.partition})',
  )


# ------------------------------------------------------------------------------------------------
# the command line's path
# ------------------------------------------------------------------------------------------------
def build_algorithm(method: str, config: ml_collections.ConfigDict) -> Algorithm:
  """The registered algorithm `method` with its typed config; validates the whole config."""
  cls = get_method(method)
  run = validate_run_config(config, cls.section)
  check_capabilities(method, cls, run, registered_methods())
  return cls.from_config(config)


def run_experiment(
  method: str,
  config: ml_collections.ConfigDict,
  workdir,
  progress: bool = True,
  client_transport=None,
  client_label_counts: Optional[np.ndarray] = None,
) -> RunSummary:
  """Validates, claims the workdir, loads and partitions the data, and runs `method`.

  Outputs in `workdir`: identity.json and config.json (what the workdir holds), partition.txt
  and partition.png, metrics.jsonl, summary.json, accuracy.png, checkpoints/ and the method's
  own stages and figures. Running the same command again resumes.

  Args:
    method: The registered method name.
    config: The whole run config (the method's section and the shared ones).
    workdir: The directory of the run's outputs and checkpoints.
    progress: Whether to print a line per step.
    client_transport: Runs local training elsewhere (a Flower transport); None for in process.
    client_label_counts: [clients, classes] label counts of clients whose data the server does
      not hold (Flower SuperNodes serving their own data declared them): the clients are then
      placeholders of those sizes (`declared_parts`) instead of the seeded partition.

  Returns:
    The run's typed summary.
  """
  return _experiment(
    method, config, workdir, progress, client_transport, client_label_counts, keep_state=False
  ).summary


def experiment_to_end(
  method: str, config: ml_collections.ConfigDict, workdir, progress: bool = True
) -> Finished:
  """`run_experiment` keeping the final state, history and model (`run_to_end`).

  Args:
    method: The registered method name.
    config: The whole run config.
    workdir: The directory of the run's outputs and checkpoints.
    progress: Whether to print a line per step.

  Returns:
    The summary, final state, history and server model.
  """
  return _experiment(method, config, workdir, progress, None, None, keep_state=True)


def _experiment(
  method, config, workdir, progress, client_transport, client_label_counts, keep_state
) -> Finished:
  algorithm = build_algorithm(method, config)
  logging_config(config)  # e.g. W&B on but not installed: refused before anything is written
  if not multihost.is_primary():
    return Finished(_run_secondary(algorithm, config, workdir), None, [], None)
  wd = Workdir(workdir)
  with contextlib.ExitStack() as stack:
    try:
      wd.prepare()
      stack.enter_context(wd.lock())
      dataset, parts = _claim_workdir(wd, method, config, progress, client_label_counts)
    except BaseException:
      stack.close()  # the lock file goes first, so a workdir this run created may be left empty
      wd.remove_if_unused()
      multihost.agree(False, _SETUP)
      raise
    multihost.agree(True, _SETUP)
    ctx = make_context(config, dataset, parts, wd.path, client_transport)
    return _run(algorithm, ctx, progress, keep_state)


def declared_parts(sizes: Sequence[int]) -> List[np.ndarray]:
  """Placeholder clients of the given sizes, for a server that does not hold their data (Flower
  SuperNodes serving their own): every index is training sample 0. Only a method whose server
  reads nothing of its clients' data but their sizes may run on them (the Flower bridge's
  `settings.require_own_data`)."""
  return [np.zeros(int(n), np.int64) for n in sizes]


def _claim_workdir(wd: Workdir, method: str, config, progress: bool, client_label_counts=None):
  """Checks and writes what the workdir holds (identity, config, partition); (dataset, parts)."""
  config_json = config.to_json_best_effort(sort_keys=True, indent=2)
  identity = {
    'method': method,
    # Where the curves go changes no result: a resumed run may turn W&B on or TensorBoard off.
    'config': {
      k: v for k, v in ml_collections.ConfigDict(config).to_dict().items() if k != 'logging'
    },
    'jfed_version': __version__,
  }
  if client_label_counts is not None:  # the clients' data is elsewhere: a resume needs the same
    identity['client_label_counts'] = np.asarray(client_label_counts).tolist()
  identity = jsonable(identity)
  wd.check_identity(identity)
  dataset = load_run_dataset(config)
  identity['dataset'] = {
    'name': dataset.name,
    'fingerprint': array_fingerprint(
      dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y
    ),
  }
  wd.check_identity(identity)
  dataset = hold_out(config, dataset)
  if client_label_counts is None:
    parts = partition_clients(config, dataset.train_y)
  else:
    parts = declared_parts(np.asarray(client_label_counts).sum(1))
  wd.write_identity(identity, config_json)
  if client_label_counts is None:
    table = class_count_table(dataset.train_y, parts, dataset.num_classes)
    unassigned = unassigned_count(parts, len(dataset.train_y))
  else:
    table, unassigned = np.asarray(client_label_counts, np.int64), 0
  note = (
    f'\n{unassigned} of {len(dataset.train_y)} training samples are assigned to no client.'
    if unassigned
    else ''
  )
  if holdout_size(config):
    note += f'\n{holdout_size(config)} training samples are held out of every client.'
  atomic_write_text(wd.path / 'partition.txt', format_count_table(table) + note + '\n')
  if not (wd.path / 'partition.png').exists():  # a resumed run's partition is the same one
    plot_partition_bubbles(
      table,
      wd.path / 'partition.png',
      title=f'{dataset.name}: {config.partition.scheme} partition',
    )
  if progress:
    print(
      f'{method} on {dataset.name} ({jax.default_backend()}): {len(parts)} clients, '
      f'sizes {_described_sizes([len(p) for p in parts])}'
      + (f'; {unassigned} training samples assigned to no client' if unassigned else ''),
      flush=True,
    )
  return dataset, parts


def _described_sizes(sizes: Sequence[int]) -> str:
  """Every client's size up to 20 clients; beyond, their range and median (a line that stays
  readable at 10,000 clients; partition.txt has the details)."""
  if len(sizes) <= 20:
    return str(list(sizes))
  return f'{min(sizes)}..{max(sizes)} (median {int(np.median(sizes))})'


# What the primary process does before the others may start (multihost.agree).
_SETUP = 'claim the workdir and load the data'


def _run_secondary(algorithm: Algorithm, config, workdir) -> RunSummary:
  """A process other than the primary: the same data, partition and steps, no files of its own
  (it shares the primary's workdir, where it takes part in the checkpoints)."""
  ctx = context_of_config(config, workdir=Workdir(workdir).path)
  multihost.agree(True, _SETUP)
  return run(algorithm, ctx, progress=False)


def run_in_memory(
  method: str,
  config: ml_collections.ConfigDict,
  dataset: Optional[Dataset] = None,
  progress: bool = False,
) -> RunSummary:
  """Runs `method` without a workdir (nothing written): for notebooks and quick studies.

  Args:
    method: The registered method name.
    config: The whole run config.
    dataset: A loaded dataset to use instead of the config's; None loads it.
    progress: Whether to print a line per step.

  Returns:
    The run's typed summary.
  """
  algorithm = build_algorithm(method, config)
  return run(algorithm, context_of_config(config, dataset), progress)
