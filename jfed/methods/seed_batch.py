"""The local models of several seeds of one cell, trained in one program per architecture.

A table command runs each cell (a partition at a budget) over seeds, and per (seed, cell) the
one-shot methods share one set of locally trained client models (`common.local_models`, cached
in `config.local_models_dir`). Trained one seed at a time, a cell of S seeds runs S programs of
K clients each. `pretrain_local_models` trains them as one client group of S·K clients per
architecture instead: the clients of different seeds are just more clients of the group, each
with the data, initial model and per-step keys of its own seed's run (`GroupTrainer.train` takes
one key per client), so every client ends exactly where its own seed's run would have left it.
The trained models are then split per seed and written to each seed's `local_models_dir` through
the run's own stage (`RunContext.stage`, the checkpoint format `common.local_models` restores),
so the methods, run one seed at a time as before, find them there and do not train.

Where it pays: under `scan` (the `auto` strategy off CPU) the group's clients are one vmapped
program, so S seeds take about the time of one; under `loop` (CPU) the clients run one after
another either way and the saving is the compilations and dispatch set-up of S - 1 trainers.
"""

import pathlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jfed import api, engine
from jfed.api import RunContext
from jfed.data import Dataset, FederatedArrays
from jfed.engine import ModelState
from jfed.errors import ConfigError, NonFiniteError
from jfed.io import saved_steps
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import get_method
from jfed.reporting import Progress

STAGE = 'local_models'  # the stage `common.local_models` caches (RunContext.stage's name)

# The methods whose round-1 uploads are `common.local_models(ctx, <section>.local_epochs)` over
# every client (the one-shot FedAvg of `fedavg.reuse_local_models` too: `local_epochs_of`).
SHARED_LOCAL_MODELS = (
  'ot',
  'feddf',
  'feddf_vote',
  'dense',
  'coboosting',
  'fedhydra',
  'fedavg_vote',
)


class SeedLocalModels(NamedTuple):
  """What `pretrain_local_models` did for one seed."""

  seed: int
  directory: str  # its local_models_dir
  trained: bool  # False: the directory held the epochs' models already (not retrained)


def local_epochs_of(method: str, config: ml_collections.ConfigDict) -> Optional[int]:
  """The local epochs of the shared local models `method` reads with `config`, or None when it
  trains no models that `local_models_dir` caches."""
  if method == 'fedavg':
    section = config.get('fedavg')
    reuse = section is not None and bool(section.get('reuse_local_models', False))
    return int(section.local_epochs) if reuse else None
  if method == 'local':
    return int(config.local.epochs)
  if method not in SHARED_LOCAL_MODELS:
    return None
  return int(config[get_method(method).section].local_epochs)


def _flat(config: ml_collections.ConfigDict) -> Dict[str, object]:
  out: Dict[str, object] = {}

  def walk(node, prefix):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, f'{prefix}{k}.')
      else:
        out[f'{prefix}{k}'] = v

  walk(config.to_dict(), '')
  return out


def _per_seed_key(name: str) -> bool:
  """Config keys that may differ between the seeds of a cell: the seed, where runs write
  (top-level *_dir keys) and where their curves go (`logging`)."""
  top = name.split('.')[0]
  return name == 'seed' or top == 'logging' or ('.' not in name and name.endswith('_dir'))


def check_one_cell(configs: Sequence[ml_collections.ConfigDict]) -> None:
  """Refuses configs that are not the seeds of one cell: they may differ only in `seed` and in
  their top-level directories (`local_models_dir`, ...); seeds and local_models_dir distinct."""
  if not configs:
    raise ConfigError('pretrain_local_models needs the config of at least one seed')
  seeds = [int(c.seed) for c in configs]
  if len(set(seeds)) != len(seeds):
    raise ConfigError(f'the seeds of a cell must differ; got seeds {seeds}')
  dirs = [str(c.get('local_models_dir') or '') for c in configs]
  if not all(dirs):
    missing = [s for s, d in zip(seeds, dirs) if not d]
    raise ConfigError(f'local_models_dir is not set for seed(s) {missing}: nowhere to write them')
  if len(set(dirs)) != len(dirs):
    raise ConfigError(f'the seeds of a cell need distinct local_models_dir; got {dirs}')
  first = _flat(configs[0])
  for c in configs[1:]:
    other = _flat(c)
    for k in sorted(set(first) | set(other)):
      mine, theirs = first.get(k, '<unset>'), other.get(k, '<unset>')
      if not _per_seed_key(k) and mine != theirs:
        raise ConfigError(
          f'seed {c.seed} is not of the cell of seed {configs[0].seed}: {k} = {theirs!r}, not '
          f'{mine!r} (the seeds of a cell may differ only in seed and their *_dir keys)'
        )


def _padded(fed: FederatedArrays, n_max: int) -> FederatedArrays:
  extra = n_max - fed.y.shape[1]
  if extra == 0:
    return fed

  def pad(a):
    return np.pad(np.asarray(a), [(0, 0), (0, extra)] + [(0, 0)] * (np.ndim(a) - 2))

  return FederatedArrays(pad(fed.x), pad(fed.y), fed.sizes)


def merge_groups(groups: Sequence[common.ClientGroup]) -> common.ClientGroup:
  """The clients of one architecture of several seeds as one group, in seed order (each seed's
  data padded to the longest client: padding is never visited)."""
  n_max = max(g.fed.y.shape[1] for g in groups)
  feds = [_padded(g.fed, n_max) for g in groups]
  return common.ClientGroup(
    groups[0].spec,
    groups[0].module,
    np.concatenate([g.client_ids for g in groups]),
    FederatedArrays(
      np.concatenate([f.x for f in feds]),
      np.concatenate([f.y for f in feds]),
      np.concatenate([np.asarray(f.sizes) for f in feds]).astype(np.int32),
    ),
  )


def _concat(trees: Sequence[ModelState]) -> ModelState:
  return jax.tree.map(lambda *a: jnp.concatenate(a), *trees)


def train_seeds(
  contexts: Sequence[RunContext], epochs: int, client_ids: Optional[Sequence[int]] = None
) -> List[List[ModelState]]:
  """Every seed's clients (or those of `client_ids`) trained `epochs` local epochs, one client
  group per architecture across the seeds.

  Args:
    contexts: one run context per seed, of one cell (`check_one_cell`); the first one's config
      gives the trainer (optimiser, batch size, client-map strategy, mesh).
    epochs: local epochs.
    client_ids: the clients to train, as `common.local_models` takes them (default: all).

  Returns:
    Per seed, what `common.local_models` would have trained in that seed's run: per group (in
    `common.client_groups` order) its clients' models, stacked.

  Raises:
    NonFiniteError: a client's training loss became non-finite (naming its seed).
  """
  groups = [common.client_groups(ctx, client_ids) for ctx in contexts]
  inits = [common.init_group_models(ctx, g) for ctx, g in zip(contexts, groups)]
  specs = [g.spec for g in groups[0]]
  if any([g.spec for g in gs] != specs for gs in groups):
    raise ConfigError('the seeds of a cell must have the same client architectures')
  seeds = [int(ctx.run.seed) for ctx in contexts]
  out: List[List[ModelState]] = [[] for _ in contexts]
  for j, spec in enumerate(specs):
    members = [gs[j] for gs in groups]
    merged = merge_groups(members)
    counts = [len(g.client_ids) for g in members]
    keys = jnp.concatenate(
      [
        jnp.broadcast_to(key, (n,) + key.shape)
        for key, n in zip((ctx.derive_key(Purpose.LOCAL_TRAINING) for ctx in contexts), counts)
      ]
    )
    (trainer,) = common.make_trainers(contexts[0], [merged])
    state = engine.init_train_state(trainer.tx, _concat([init[j] for init in inits]))
    progress = Progress(
      f'local training of seeds {seeds} [{spec} x{len(merged.client_ids)}]', epochs, 'epoch'
    )
    state, metrics = trainer.train(
      state, merged.fed, epochs, keys, progress=progress, client_ids=merged.client_ids
    )
    final_loss = np.asarray(metrics.loss)[:, -1]
    bounds = np.cumsum([0] + counts)
    for s, (seed, group) in enumerate(zip(seeds, members)):
      rows = slice(int(bounds[s]), int(bounds[s + 1]))
      bad = [
        int(c)
        for c, loss, n in zip(group.client_ids, final_loss[rows], group.fed.sizes)
        if n > 0 and not np.isfinite(loss)
      ]
      if bad:
        raise NonFiniteError(
          f'local training of seed {seed}: the training loss of client(s) {bad} ({spec}) '
          'became non-finite; lower the learning rate or check the data'
        )
      logging.info(
        'local training of seed %d [%s]: final train accuracy %s',
        seed,
        spec,
        np.round(np.asarray(metrics.accuracy)[rows, -1], 4).tolist(),
      )
      out[s].append(jax.tree.map(lambda a, r=rows: a[r], state.model))
  return out


def cached(ctx: RunContext, epochs: int, client_ids: Optional[Sequence[int]] = None) -> bool:
  """Whether the run's `local_models_dir` holds its local models of `epochs` local epochs (the
  subfolder and tag `common.local_models` restores).

  Args:
    ctx: the run's context (its producer names the subfolder).
    epochs: the local epochs (the tag).
    client_ids: the clients, as the methods pass them to `common.local_models`.

  Returns:
    Whether they are cached.
  """
  settings = common.local_models_settings(client_ids)
  return int(epochs) in saved_steps(ctx.shared_cache_dir(ctx.run.local_models_dir, STAGE, settings))


def pretrain_local_models(
  configs: Sequence[ml_collections.ConfigDict],
  epochs: int,
  client_ids: Optional[Sequence[int]] = None,
  dataset: Optional[Dataset] = None,
) -> List[SeedLocalModels]:
  """Trains the local models of the seeds of one cell in one program per architecture and
  writes each seed's `local_models_dir` cache, which its runs' `common.local_models` then read.

  Args:
    configs: one config per seed (`check_one_cell`: they differ only in `seed` and their
      top-level *_dir keys), each with its own `local_models_dir`.
    epochs: the local epochs (the cache's tag: `<method>.local_epochs` of the methods that will
      read it, see `local_epochs_of`).
    client_ids: the clients, as the methods pass them to `common.local_models` (default: all).
    dataset: the loaded dataset before any hold-out (default: loaded once from configs[0]).

  Returns:
    Per config, in order: its seed, its directory and whether it was trained now (a seed whose
    directory holds the epochs' models already is not retrained).
  """
  check_one_cell(configs)
  if int(epochs) < 1:
    raise ConfigError(f'local epochs must be positive, got {epochs}')
  dataset = dataset or api.load_run_dataset(configs[0])
  all_contexts = [api.context_of_config(c, dataset) for c in configs]
  pending = [i for i, ctx in enumerate(all_contexts) if not cached(ctx, epochs, client_ids)]
  if pending:
    contexts = [all_contexts[i] for i in pending]
    for ctx, models in zip(contexts, train_seeds(contexts, epochs, client_ids)):
      template = common.init_group_models(ctx, common.client_groups(ctx, client_ids))
      ctx.stage(
        STAGE,
        epochs,
        list(template),
        lambda m=models: m,
        directory=ctx.run.local_models_dir,
        settings=common.local_models_settings(client_ids),
      )
  return [
    SeedLocalModels(int(c.seed), str(c.local_models_dir), i in pending)
    for i, c in enumerate(configs)
  ]


class PlannedRun(NamedTuple):
  """A run a table command is about to make, as `pretrain_cell` sees it."""

  method: str  # the registered method
  config: ml_collections.ConfigDict  # its whole config (seed, local_models_dir)
  workdir: pathlib.Path  # a run whose summary.json exists is finished and reads nothing


def pretrain_cell(
  seeds: Sequence[Sequence[PlannedRun]], dataset: Optional[Dataset] = None
) -> List[SeedLocalModels]:
  """Before a table command runs a cell's seeds one at a time: for each local-epoch count that
  their unfinished runs read from `local_models_dir` (`local_epochs_of`), the seeds whose cache
  lacks it are trained together (`pretrain_local_models`), when there are at least two of them
  (one alone gains nothing: its first run trains it as usual).

  Args:
    seeds: per seed of the cell, its runs (those that share a `local_models_dir` share it within
      the seed; runs whose configs differ in more than the seed's keys are other cells).
    dataset: the loaded dataset before any hold-out (default: loaded from the first config).

  Returns:
    What was trained, per (epoch count, seed); empty when nothing was pending.
  """
  # (epochs, the config less its per-seed keys) -> one config per seed: each group is a cell
  wanted: Dict[Tuple[int, str], List[ml_collections.ConfigDict]] = {}
  for runs in seeds:
    chosen: Dict[Tuple[int, str], ml_collections.ConfigDict] = {}
    for run in runs:
      epochs = local_epochs_of(run.method, run.config)
      directory = run.config.get('local_models_dir') or ''
      if epochs is None or not directory or (run.workdir / 'summary.json').exists():
        continue
      chosen.setdefault((epochs, directory), run.config)
    for (epochs, _), config in chosen.items():
      wanted.setdefault((epochs, _cell_signature(config)), []).append(config)
  done: List[SeedLocalModels] = []
  for (epochs, _), configs in wanted.items():
    dataset = dataset or api.load_run_dataset(configs[0])
    pending = [c for c in configs if not cached(api.context_of_config(c, dataset), epochs)]
    if len(pending) >= 2:
      done += pretrain_local_models(pending, epochs, dataset=dataset)
  return done


def _cell_signature(config: ml_collections.ConfigDict) -> str:
  return repr(sorted((k, repr(v)) for k, v in _flat(config).items() if not _per_seed_key(k)))
