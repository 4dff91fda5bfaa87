"""The server side of the one-shot methods that distil client models into a server model.

DENSE, Co-Boosting, FedHydra and FedDF's students (one per distilled architecture,
`jfed.methods.feddf`) are `DistillationAlgorithm`s (this module; not a method itself) that
run their family's `Recipe`: plain functions, declared by each family module, that say how it
synthesises data, how the teachers are combined, which student loss it uses and what (if
anything) it does between synthesis and distillation; one shared step composes them. OT shares
only the uploads of every round (`round_uploads`).

Protocol of one global round r (r = 1..rounds), `epochs` driver steps per round: step i is
epoch e = i mod epochs (0-based) of round r = i div epochs + 1.

1. Clients upload their locally trained models (`round_uploads`). Round 1, during setup:
   `common.local_models` (every client trains `local_epochs` epochs from the shared init; a
   driver stage, read from `config.local_models_dir` when set). Round r > 1, in the step that
   starts it: every client whose architecture equals the server model's starts from the previous
   round's global model (`round_model` of the state the step receives), every other client from
   its own round r − 1 model; all train `local_epochs` epochs (the stage 'round_models', tag r).
2. Teachers: one `TeacherGroup` per architecture group of the uploaded models (eval mode), and
   the recipe's per-round data (`round_data`: FedHydra's model stratification, ...). Both are
   kept in a cache in the run's aux; a resumed run rebuilds them from the stages.
3. Server model (`<method>.server_model`, default `config.model`): with `init='fedavg'`
   (FedDF) every round starts from the FedAvg of that round's uploads that share its
   architecture (the previous round's global model, or round 1's random init, when none
   does); otherwise round 1 starts random (DENSE / Co-Boosting / FedHydra Algorithm 1 line 10)
   and round r > 1 from the previous round's global model. A fresh optimiser, pool and
   generator every round.
4. Epoch e (one driver step):
     a. synthesis (not FedDF): one `jfed.distill.synthesize` call (g_steps generator steps on
        `synthesis_batch` images), its best batch and target labels are appended to the pool
        (with `pool_limit` N > 0, FedHydra's: offered to a uniform reservoir of N images,
        `jfed.distill.pool_reservoir_add`, its draws from the epoch's key);
     b. the recipe's `before_kd` hook (Co-Boosting: ensemble-weight update, by default over the
        pool without the batch just added, `coboosting.weight_update_order`);
     c. distillation (`jfed.distill.kd_step`; on an accelerator `KD_BLOCK` steps per compiled
        call, `kd.run_kd_steps`): the student takes optimiser steps on KD batches
        — the whole pool in shuffled batches (`kd_data='pool'`, DENSE), only the batch
        synthesised this epoch (`'batch'`, FedHydra Algorithm 1 read literally) or
        `steps_per_epoch` batches of a fixed unlabelled set (`'fixed'`, FedDF). Where a stored
        image's teacher target cannot change within the round (the method's teacher weights
        are fixed for the round, no random KD view or ODS, eval-mode teachers: FedHydra's and
        DENSE-without-augmentation's case) the targets are computed once per image when it
        enters the pool (`KDTargets`, not checkpointed: rebuilt on resume) and the steps run
        `kd_step_on_targets`: the same numbers without a teacher
        forward pass per step, which with FedHydra's every-intermediate pool is most of its KD
        time;
     d. test accuracy of the student; the recipe's `after_epoch` hook (FedDF: validation,
        best-on-val model, early stop: the remaining steps of a stopped round change nothing
        and record nothing);
     e. one record {'round', 'epoch', 'test_accuracy', losses, ...}; the last epoch of a round
        adds 'round_accuracy', the accuracy of the round's global model `round_model(state)`
        (the final student; FedDF: the best-on-val student).
The driver checkpoints the `ServerState` (student + optimiser, pool, generator, method extras)
after every step. Every key is `ctx.derive_key(Purpose.SERVER, r, e, ...)` or a round-level
`derive_key(Purpose.SERVER, 0, r, ServerRoundPurpose.X)`, and the KD batch order is
`np.random.default_rng((seed, r, e))`, so a resumed run ends with the numbers of an
uninterrupted one.
"""

from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.distill import (
  KDConfig,
  TeacherGroup,
  combine_logits,
  committed,
  crop_padding,
  dense_generator_init,
  epoch_batches,
  images_per_epoch,
  make_generator,
  pool_add,
  pool_init,
  pool_reservoir_add,
  pool_size,
  resolve_augment,
  student_state,
  synthesize,
)
from jfed.distill import plots as distill_plots
from jfed.distill.kd import (
  KD_AUGMENT,
  KDEpoch,
  KDPrograms,
  Teachers,
  pool_teacher_logits,
  run_kd_steps,
  targets_depend_only_on_the_image,
)
from jfed.distill.synthesis import SynthesisConfig
from jfed.engine import GroupTrainer, ModelState
from jfed.engine.optim import OPTIMIZERS, SCHEDULES, OptimizerSpec, scheduled_lr
from jfed.io import serialized_nbytes
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import common
from jfed.models import available_models

# a config's choices; FedDF's recipe sets 'fixed' itself (its unlabelled set, `fixed_pool`)
KD_DATA = ('pool', 'batch')
INITS = ('random', 'fedavg')


def round_key(ctx: RunContext, r: int, purpose: ServerRoundPurpose) -> jax.Array:
  """A round-level draw: derive_key(SERVER, 0, r, purpose); epochs use (SERVER, r, e).

  Args:
    ctx: The run context whose key derivation is used.
    r: The round, from 1.
    purpose: What the key is drawn for (generator init, student init, ...).

  Returns:
    A PRNG key, the same for the same (run seed, r, purpose).
  """
  return ctx.derive_key(Purpose.SERVER, 0, r, purpose)


def teacher_strategy(ctx: RunContext) -> str:
  """How the teachers map over their clients: config.strategy, with 'scan' read as 'vmap'."""
  s = ctx.run.strategy
  return {'scan': 'vmap'}.get(s, s)


# ---------------------------------------------------------------------------------------------
# uploads of every round
# ---------------------------------------------------------------------------------------------
def round_uploads(
  ctx: RunContext,
  r: int,
  local_epochs: int,
  server_spec: str,
  global_model: Union[None, ModelState, Dict[str, ModelState]] = None,
  trainers: Optional[Mapping[str, GroupTrainer]] = None,
) -> common.LocalModels:
  """The client models uploaded in round r (see the module docstring).

  Round r > 1 is the stage 'round_models' (tag r): trained once, from `global_model` (the global
  model of round r − 1, for the clients of `server_spec`; or {spec: global model} when several
  architectures have one, as FedDF's students) and the other clients' round r − 1 models;
  `global_model` may be None when the stage is already cached (a resumed run, the summary).

  Args:
    ctx: The run context (dataset, clients, key derivation, stage cache).
    r: The round, from 1.
    local_epochs: Epochs of local training per round.
    server_spec: The model spec of the server's (global) architecture.
    global_model: The global model of round r - 1, or {spec: global model}; None for r = 1 or
      when the round's models are cached.
    trainers: The run's local trainers by model spec (`common.client_trainers`, built in the
      method's `setup`: every round trains with the same compiled programs); None builds them
      for this round's training, if it has any.

  Returns:
    The round's client groups, their trained models and the upload size in bytes.
  """
  first = common.local_models(ctx, local_epochs, trainers=trainers)
  if r == 1:
    return first

  def train():
    if global_model is None:
      raise ValueError(f'round {r} of local training needs the global model of round {r - 1}')
    prev = round_uploads(ctx, r - 1, local_epochs, server_spec, trainers=trainers).models
    global_models = global_model if isinstance(global_model, dict) else {server_spec: global_model}
    starts = [
      engine.replicate(global_models[g.spec], len(g.client_ids)) if g.spec in global_models else p
      for g, p in zip(first.groups, prev)
    ]
    if trainers is None:
      group_trainers = common.make_trainers(ctx, first.groups)
    else:
      group_trainers = [trainers[g.spec] for g in first.groups]
    models, _ = common.train_groups(
      group_trainers,
      first.groups,
      starts,
      local_epochs,
      ctx.derive_key(Purpose.LOCAL_TRAINING, r),
      label=f'round {r} local training',
    )
    return list(models)

  models = ctx.stage('round_models', r, list(first.models), train, max_to_keep=3)
  upload = common.receive_uploads(first.groups, models, [engine.take(m, 0) for m in first.models])
  return common.LocalModels(first.groups, list(models), upload)


def download_bytes(local: common.LocalModels, server_spec: str, global_model: ModelState) -> int:
  """Bytes of sending the global model to every client of the server's architecture.

  Args:
    local: The round's uploads (their groups say which clients share which architecture).
    server_spec: The model spec of the global model.
    global_model: The global model sent to those clients.

  Returns:
    The serialized size of `global_model` times the number of receiving clients.
  """
  receivers = sum(len(g.client_ids) for g in local.groups if g.spec == server_spec)
  return serialized_nbytes(global_model) * receivers


def teacher_groups(local: common.LocalModels) -> List[TeacherGroup]:
  return [TeacherGroup(g.module, committed(m)) for g, m in zip(local.groups, local.models)]


def teacher_client_ids(local: common.LocalModels) -> np.ndarray:
  """Global client id of each teacher, in the teachers' (group-concatenated) order."""
  return np.concatenate([g.client_ids for g in local.groups])


def fedavg_of_matching(local: common.LocalModels, spec: str) -> Optional[ModelState]:
  """FedAvg (size-weighted) of the uploaded models whose architecture is `spec`, if any."""
  for g, m in zip(local.groups, local.models):
    if g.spec == spec:
      return engine.weighted_average(m, g.fed.sizes)
  return None


# ---------------------------------------------------------------------------------------------
# config blocks the methods share: each method's config (`config.<section>`, flat in the config
# file) is `typed_config.concat` of these and its own keys. Defaults: the reference code and
# FedHydra (Bai et al., KDD 2025) §4.1.5 (E = T_g = 200); experiment configs shrink them for CPU.
# ---------------------------------------------------------------------------------------------
class OneShotRound(NamedTuple):
  """DENSE, Co-Boosting, FedDF, OT fusion and FedHydra: the clients' one-shot local training."""

  rounds: int = 1
  local_epochs: int = 200


class GeneratorDistillation(NamedTuple):
  """DENSE, Co-Boosting and FedHydra: the data-free server's generator and student."""

  epochs: int = 200  # server epochs per round (the driver's steps)
  server_model: str = ''  # the student's model spec ('': `model`)
  init: str = 'random'  # the student's start: 'random' | 'fedavg' (of the matching clients)
  lr_g: float = 1e-3  # the generator's Adam lr
  nz: int = 256  # the generator's noise dimension
  ngf: int = 64  # the generator's feature width
  kd_momentum: float = 0.9
  pool_quantize: bool = True  # store the synthetic pool as uint8 images


# ---------------------------------------------------------------------------------------------
# settings, state and aux of a distillation run
# ---------------------------------------------------------------------------------------------
class Settings(NamedTuple):
  """What one distillation method is, in the terms of the shared loop (built once per run)."""

  rounds: int
  local_epochs: int
  epochs: int  # driver steps per round
  server_model: str  # resolved spec
  init: str  # 'random' | 'fedavg'
  kd: KDConfig
  opt: OptimizerSpec  # the student's; its schedule is set per KD step
  kd_batch: int
  kd_data: str  # 'pool' | 'batch' | 'fixed'
  synthesis: Optional[SynthesisConfig]  # None: no generator (FedDF)
  keep_generator: bool  # continue one generator across epochs (FedHydra)
  nz: int
  ngf: int
  generator: str  # jfed.distill.GENERATORS: 'dense' | 'fedhydra'
  pool_quantize: bool
  steps_per_epoch: int  # kd_data='fixed': KD steps per epoch
  pool_limit: int  # 0: the pool keeps every synthesised image; N > 0: a reservoir of N


class ServerState(NamedTuple):
  """Everything the server carries from one distillation epoch to the next (checkpointed)."""

  student: engine.TrainState
  pool: Any  # ImagePool of synthetic images + target labels (placeholder for FedDF)
  generator: Any  # ModelState of a generator kept across epochs, else ModelState({}, {})
  extra: Any  # method-specific pytree (Co-Boosting weights, FedDF best model, ...)
  stopped: Any  # bool scalar: the round ended early (FedDF early stopping)


class RoundData(NamedTuple):
  """What a round's uploads give the server: derived deterministically, cached in the aux
  (by round: `DistillAux.round_cache`)."""

  local: common.LocalModels
  teachers: List[TeacherGroup]
  data: Any  # the method's `round_data` (FedHydra MS, Co-Boosting client ids, ...)


class KDTargets(NamedTuple):
  """The aggregated teacher logits of every pool slot for round `round`, valid for the images
  the pool held when its counter read `count` (see `DistillationAlgorithm._pool_targets`)."""

  round: int
  count: int
  logits: Any  # [capacity, classes]


class DistillAux:
  """The run's constants and a cache of the current round's `RoundData` (not checkpointed)."""

  def __init__(
    self,
    settings: Settings,
    student_module,
    generator,
    random_student: ModelState,
    evaluator: engine.Evaluator,
    eval_x: np.ndarray,
    eval_y: np.ndarray,
    data: Any = None,
    trainers: Optional[Mapping[str, GroupTrainer]] = None,
  ):
    self.settings, self.student_module, self.generator = settings, student_module, generator
    self.random_student, self.evaluator = random_student, evaluator
    self.eval_x, self.eval_y, self.data = eval_x, eval_y, data
    # the clients' local trainers by model spec, for every round's uploads
    self.trainers = trainers
    self.round_cache: Dict[int, RoundData] = {}
    self.kd_targets: Optional[KDTargets] = None


# ---------------------------------------------------------------------------------------------
# a method's recipe: the plain functions the shared step composes
# ---------------------------------------------------------------------------------------------
# An epoch hook: (ctx, aux, rd, state, r, e) -> (state, record fields). Hooks run between
# synthesis and distillation (`Recipe.before_kd`) and after the epoch's evaluation
# (`Recipe.after_epoch`).
EpochHook = Callable[
  [RunContext, DistillAux, RoundData, ServerState, int, int], Tuple[ServerState, Dict[str, Any]]
]


def _no_epoch_hook(
  ctx: RunContext, aux: DistillAux, rd: RoundData, state: ServerState, r: int, e: int
) -> Tuple[ServerState, Dict[str, Any]]:
  return state, {}


def _no_method_data(ctx: RunContext, settings: Settings) -> Any:
  return None


def _test_split(ctx: RunContext, data: Any) -> Tuple[np.ndarray, np.ndarray]:
  return ctx.dataset.test_x, ctx.dataset.test_y


def _no_round_data(
  ctx: RunContext,
  aux: DistillAux,
  r: int,
  local: common.LocalModels,
  teachers: List[TeacherGroup],
) -> Any:
  return None


def _zero_extra(ctx: RunContext, aux: DistillAux, student: ModelState) -> Any:
  return jnp.zeros((), jnp.float32)


def _no_weights(state: ServerState, rd: RoundData) -> Any:
  return None


def _no_fixed_pool(aux: DistillAux) -> Any:
  raise ValueError("kd_data='fixed' needs a recipe with a fixed_pool")


def _student_model(state: ServerState) -> ModelState:
  return state.student.model


def _last_accuracy(aux: DistillAux, state: ServerState, last_test_accuracy: float) -> float:
  return last_test_accuracy


def _no_summary(
  ctx: RunContext,
  aux: DistillAux,
  rd: RoundData,
  state: ServerState,
  history: Sequence[Dict[str, Any]],
) -> Dict[str, Any]:
  return {}


class Recipe(NamedTuple):
  """What one distillation method is, as plain functions of the shared step
  (`DistillationAlgorithm`); each family module declares its recipe (`recipe(config)`), and
  every field but `settings` defaults to DENSE's behaviour (synthesis and KD, nothing between).

  Attributes:
    settings: ctx -> Settings, the method in the shared loop's terms (built once per run).
    method_data: (ctx, settings) -> run-level constants (FedDF: its unlabelled and validation
      sets), as `aux.data`.
    eval_data: (ctx, data) -> (x, y), what the student is scored on (the test split).
    round_data: (ctx, aux, r, local, teachers) -> per-round constants (FedHydra: MS;
      Co-Boosting: the teachers' client ids), as `rd.data`.
    init_extra: (ctx, aux, student) -> the method's part of a fresh round state
      (`ServerState.extra`).
    synthesis_agg: (state, rd) -> the teacher weights of synthesis (None: the mean).
    kd_agg: (state, rd) -> the teacher weights of distillation (None: the mean).
    kd_agg_fixed_in_round: whether `kd_agg` stays the same through a round (not Co-Boosting's
      per-epoch weights), so that a stored image's teacher target can be computed once.
    fixed_pool: aux -> the pool of `kd_data='fixed'` (FedDF's unlabelled set).
    before_kd: the epoch hook between synthesis and distillation (Co-Boosting: the
      ensemble-weight update).
    after_epoch: the epoch hook after the epoch's evaluation (FedDF: validation, best model,
      early stop).
    round_model: state -> the round's global model (FedDF: the best-on-validation student).
    round_accuracy: (aux, state, last test accuracy) -> the accuracy the round reports.
    summary: (ctx, aux, rd, state, history) -> the method's fields of the run summary.
  """

  settings: Callable[[RunContext], Settings]
  method_data: Callable[[RunContext, Settings], Any] = _no_method_data
  eval_data: Callable[[RunContext, Any], Tuple[np.ndarray, np.ndarray]] = _test_split
  round_data: Callable[..., Any] = _no_round_data
  init_extra: Callable[[RunContext, DistillAux, ModelState], Any] = _zero_extra
  synthesis_agg: Callable[[ServerState, RoundData], Any] = _no_weights
  kd_agg: Callable[[ServerState, RoundData], Any] = _no_weights
  kd_agg_fixed_in_round: bool = False
  fixed_pool: Callable[[DistillAux], Any] = _no_fixed_pool
  before_kd: EpochHook = _no_epoch_hook
  after_epoch: EpochHook = _no_epoch_hook
  round_model: Callable[[ServerState], ModelState] = _student_model
  round_accuracy: Callable[[DistillAux, ServerState, float], float] = _last_accuracy
  summary: Callable[..., Dict[str, Any]] = _no_summary


# -- what the recipes share: the Settings fields every method reads the same way -------------
def base_settings(
  config: Any,
  ctx: RunContext,
  synthesis: Optional[SynthesisConfig],
  kd: KDConfig,
  opt: OptimizerSpec,
  **overrides,
) -> Settings:
  """The Settings fields every method reads the same way from its typed config.

  Args:
    config: The method's typed config (the shared blocks of this module and its own keys).
    ctx: The run context (dataset, models, run config).
    synthesis: The data-synthesis settings, or None for a method that distils on real data.
    kd: How a KD step turns a batch into a student loss (loss, temperature, teacher
      aggregation, augmentation).
    opt: The student's optimizer.
    **overrides: Settings fields that the method sets itself.

  Returns:
    The method's complete Settings.
  """
  get = lambda name, default: getattr(config, name, default)
  values = dict(
    rounds=config.rounds,
    local_epochs=config.local_epochs,
    epochs=get('epochs', 1),
    server_model=config.server_model or ctx.run.model,
    init=config.init,
    kd=kd,
    opt=opt,
    kd_batch=config.kd_batch,
    kd_data=get('kd_data', 'pool'),
    synthesis=synthesis,
    keep_generator=False,
    nz=get('nz', 0),
    ngf=get('ngf', 0),
    generator='dense',
    pool_quantize=get('pool_quantize', False),
    steps_per_epoch=0,
    pool_limit=get('pool_limit', 0),
  )
  values.update(overrides)
  return Settings(**values)


def kd_config(config: Any, ctx: RunContext, **kw) -> KDConfig:
  """The KD step's config from the method's kd_T and kd_augment and the dataset; `kw` the rest."""
  return KDConfig(
    T=config.kd_T,
    augment=resolve_augment(config.kd_augment, ctx.dataset.name),
    crop_padding=crop_padding(ctx.dataset.input_shape),
    strategy=teacher_strategy(ctx),
    **kw,
  )


def student_optimizer(config: Any, default_name: str = 'sgd') -> OptimizerSpec:
  """The student's optimiser from the kd_* keys the method's config has."""
  get = lambda name, default: getattr(config, 'kd_' + name, default)
  return OptimizerSpec(
    name=get('optimizer', default_name),
    lr=config.kd_lr,
    momentum=get('momentum', 0.0),
    weight_decay=get('weight_decay', 0.0),
    grad_clip=get('grad_clip', 0.0),
    schedule=get('schedule', 'constant'),
  )


def synthesis_common(config: Any, ctx: RunContext) -> dict:
  """The synthesis keys DENSE's and Co-Boosting's configs share, as `dense_config` takes them."""
  return dict(
    g_steps=config.g_steps,
    batch_size=config.synthesis_batch,
    lr_g=config.lr_g,
    crop_padding=crop_padding(ctx.dataset.input_shape),
    strategy=teacher_strategy(ctx),
  )


def _scattered_blocks(slots: np.ndarray, block: int, capacity: int) -> np.ndarray:
  """Index blocks [k, block] that hold every one of `slots` at row slot % block, its row in its
  aligned block, with as few blocks as the most frequent row needs; other rows hold `capacity`
  (no slot: computed on the last slot's image, never written back)."""
  rows = slots % block
  order = np.argsort(rows, kind='stable')
  rows, slots = rows[order], slots[order]
  nth = np.arange(len(rows)) - np.searchsorted(rows, rows)  # the n-th slot at its row
  out = np.full((int(nth.max()) + 1 if len(rows) else 0, block), capacity, np.int32)
  out[nth, rows] = slots
  return out


# ---------------------------------------------------------------------------------------------
# the shared Algorithm
# ---------------------------------------------------------------------------------------------
class DistillationAlgorithm(Algorithm):
  """One-shot data-free (or unlabelled-data) distillation; a step is a distillation epoch.

  A subclass sets `section` and `Config` and returns its family's `Recipe` from `make_recipe`;
  this class runs it (setup, rounds, the epoch's synthesis, hooks and KD, summary).
  """

  step_name = 'epoch'

  def __init__(self, config: Any):
    super().__init__(config)
    self.recipe = self.make_recipe()

  def make_recipe(self) -> Recipe:
    """The method's recipe, from its typed config (`self.config`)."""
    raise NotImplementedError

  # -- Algorithm -----------------------------------------------------------------------------
  def validate(self, config) -> None:
    c, where = self.config, self.section
    fields = set(c._fields)
    tc.require_positive(
      c,
      where,
      [
        n
        for n in (
          'rounds',
          'local_epochs',
          'epochs',
          'kd_batch',
          'g_steps',
          'T_G',
          'synthesis_batch',
          'nz',
          'ngf',
          'kd_lr',
          'kd_T',
          'lr_g',
        )
        if n in fields
      ],
    )
    tc.require_non_negative(
      c, where, [n for n in ('kd_weight_decay', 'kd_grad_clip') if n in fields]
    )
    if 'kd_momentum' in fields:
      tc.require(
        0.0 <= c.kd_momentum < 1.0, f'{where}.kd_momentum must be in [0, 1), got {c.kd_momentum}'
      )
    tc.require_choice(c.init, INITS, f'{where}.init')
    tc.require_choice(c.kd_augment, KD_AUGMENT, f'{where}.kd_augment')
    if 'kd_data' in fields:
      tc.require_choice(c.kd_data, KD_DATA, f'{where}.kd_data')
    if 'kd_schedule' in fields:
      tc.require_choice(c.kd_schedule, SCHEDULES, f'{where}.kd_schedule')
    if 'kd_optimizer' in fields:
      tc.require_choice(c.kd_optimizer, OPTIMIZERS, f'{where}.kd_optimizer')
    if c.server_model:
      name = c.server_model.strip().partition(':')[0]
      known = sorted(available_models())
      tc.require(
        name.lower() in known,
        f'{where}.server_model: unknown model {name!r} in '
        f'{c.server_model!r}; valid: {", ".join(known)}',
      )

  def epochs_per_round(self) -> int:
    return self.config.epochs

  def trained_model(
    self, ctx: RunContext, aux: DistillAux, state: ServerState
  ) -> engine.TrainedModel:
    """The distilled student."""
    return engine.TrainedModel(aux.student_module, state.student.model)

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds * self.epochs_per_round()

  def step_label(self, i: int, n: int, aux=None) -> str:
    epochs = self.epochs_per_round()
    return (
      f'round {i // epochs + 1}/{self.config.rounds} epoch {i % epochs + 1}/{epochs}'
      if self.config.rounds > 1
      else f'epoch {i + 1}/{n}'
    )

  def setup(
    self, ctx: RunContext, trainers: Optional[Mapping[str, GroupTrainer]] = None
  ) -> DistillAux:
    """The run's constants and round 1's uploads.

    Args:
      ctx: The run context (dataset, clients, key derivation, stage cache).
      trainers: The clients' local trainers by model spec, when several students share them
        (FedDF); None builds them (`common.client_trainers`).

    Returns:
      The DistillAux of the run.
    """
    s = self.recipe.settings(ctx)
    shape = ctx.dataset.input_shape
    student_module = common.build_module(s.server_model, ctx.dataset)
    generator = make_generator(shape, s.nz, s.ngf, s.generator) if s.synthesis is not None else None
    random_student = engine.init_model(
      student_module, shape, round_key(ctx, 0, ServerRoundPurpose.STUDENT)
    )
    data = self.recipe.method_data(ctx, s)
    eval_x, eval_y = self.recipe.eval_data(ctx, data)
    evaluator = engine.Evaluator(student_module, ctx.run.eval_batch_size, ctx.run.strategy)
    if trainers is None:
      trainers = common.client_trainers(ctx)
    aux = DistillAux(
      s, student_module, generator, random_student, evaluator, eval_x, eval_y, data, trainers
    )
    self.round(ctx, aux, 1)  # the one-shot uploads: every client trains once
    return aux

  def setup_records(self, ctx: RunContext, aux: DistillAux) -> List[Dict[str, Any]]:
    local = self.round(ctx, aux, 1).local
    return [{'round': 1, 'clients': ctx.num_clients, 'upload_bytes': local.upload_bytes}]

  def round(
    self, ctx: RunContext, aux: DistillAux, r: int, global_model: Optional[ModelState] = None
  ) -> RoundData:
    """Round r's uploads, teachers and method data, from the cache or built (and cached).

    Args:
      ctx: The run context (dataset, clients, key derivation, stage cache).
      aux: The run-level state built in `setup` (settings, student module, evaluator, caches).
      r: The round, from 1.
      global_model: The global model of round r - 1 (clients of its architecture start from
        it); None for round 1 or when the round is cached.

    Returns:
      The round's RoundData.
    """
    if r not in aux.round_cache:
      s = aux.settings
      local = round_uploads(ctx, r, s.local_epochs, s.server_model, global_model, aux.trainers)
      teachers = teacher_groups(local)
      data = committed(self.recipe.round_data(ctx, aux, r, local, teachers))
      aux.round_cache = {r: RoundData(local, teachers, data)}  # only the current round is kept
    return aux.round_cache[r]

  def fresh_state(
    self, ctx: RunContext, aux: DistillAux, student: ModelState, r: int
  ) -> ServerState:
    """A round's initial server state: the student, an empty image pool, a new generator.

    Args:
      ctx: The run context (dataset, clients, key derivation, stage cache).
      aux: The run-level state built in `setup` (settings, student module, evaluator, caches).
      student: The model the round's student starts from.
      r: The round, from 1 (it keys the generator's initialization).

    Returns:
      The committed initial ServerState of round r.
    """
    s = aux.settings
    shape = ctx.dataset.input_shape
    if s.synthesis is not None:
      # kd_data='batch' reads only the latest epoch's images: the ring buffer needs no more
      per_epoch = images_per_epoch(s.synthesis)
      capacity = per_epoch * (1 if s.kd_data == 'batch' else s.epochs)
      if s.pool_limit:  # a reservoir: never more than pool_limit images
        capacity = min(capacity, s.pool_limit)
      pool = pool_init(capacity, shape, quantize=s.pool_quantize)  # >= 1: validated sizes
    else:  # no synthesis (FedDF): a placeholder the state's structure needs, never filled
      pool = pool_init(1, shape)
    if s.keep_generator:
      gen = dense_generator_init(round_key(ctx, r, ServerRoundPurpose.GENERATOR), aux.generator)
    else:
      gen = ModelState({}, {})
    return committed(
      ServerState(
        student_state(s.opt, student),
        pool,
        gen,
        self.recipe.init_extra(ctx, aux, student),
        jnp.zeros((), jnp.bool_),
      )
    )

  def init(self, ctx: RunContext, aux: DistillAux) -> ServerState:
    return self.fresh_state(ctx, aux, aux.random_student, 1)

  def step(
    self, ctx: RunContext, aux: DistillAux, state: ServerState, i: int
  ) -> Tuple[ServerState, List[Dict[str, Any]]]:
    """One distillation epoch; the first epoch of a round also builds the round's uploads."""
    s = aux.settings
    r, e = i // s.epochs + 1, i % s.epochs
    record: Dict[str, Any] = {'round': r, 'epoch': e + 1}
    if e == 0:  # a new round: uploads, then a fresh server state
      global_model = self.recipe.round_model(state) if r > 1 else None
      rd = self.round(ctx, aux, r, global_model)
      if global_model is not None:
        record.update(
          upload_bytes=rd.local.upload_bytes,
          download_bytes=download_bytes(rd.local, s.server_model, global_model),
        )
      # FedDF (init='fedavg') starts every round's student from the FedAvg of that round's
      # uploads (Lin et al. Alg. 1); the others from the previous round's global model.
      start = fedavg_of_matching(rd.local, s.server_model) if s.init == 'fedavg' else None
      if start is None:
        start = global_model
      if start is None:
        if s.init == 'fedavg':
          logging.warning(
            '%s: no client has the server architecture %s; random init', self.name, s.server_model
          )
        start = aux.random_student
      state = self.fresh_state(ctx, aux, start, r)
    elif bool(state.stopped):  # the round stopped early: nothing left to do in it
      return state, []
    else:
      rd = self.round(ctx, aux, r)
      state = committed(state)
    state, epoch_record, images = self._distill_epoch(ctx, aux, rd, state, r, e)
    accuracy = aux.evaluator.accuracy(state.student.model, aux.eval_x, aux.eval_y)
    state, extra = self.recipe.after_epoch(ctx, aux, rd, state, r, e)
    record.update({'test_accuracy': accuracy, **epoch_record, **extra})
    if e + 1 == s.epochs or bool(state.stopped):
      record['round_accuracy'] = self.recipe.round_accuracy(aux, state, accuracy)
      if images is not None:
        self._save_samples(ctx, images, r)
    return state, [record]

  def final_accuracy(self, history) -> Optional[float]:
    rounds = [h['round_accuracy'] for h in history if h.get('round_accuracy') is not None]
    return rounds[-1] if rounds else super().final_accuracy(history)

  def summarize(
    self, ctx: RunContext, aux: DistillAux, state: ServerState, history
  ) -> Dict[str, Any]:
    """The run summary: accuracies of the student and of the ensemble, plots, sample images."""
    s = aux.settings
    rd = self.round(ctx, aux, s.rounds)
    epochs = [h for h in history if h.get('test_accuracy') is not None]
    self._plot_accuracy(ctx, epochs)
    client_logits, test_y = common.client_test_logits(ctx, rd.local), ctx.dataset.test_y
    out = {
      'last_epoch_test_accuracy': epochs[-1]['test_accuracy'],
      'round_test_accuracy': [h['round_accuracy'] for h in history if 'round_accuracy' in h],
      'rounds': s.rounds,
      'epochs': s.epochs,
      'local_epochs': s.local_epochs,
      'server_model': s.server_model,
      'client_models': list(ctx.federation.specs),
      'client_test_accuracy': common.accuracy_of_logits(client_logits, test_y).tolist(),
      # the mean-logit ensemble (DENSE's teacher), a reference for the students
      'teacher_ensemble_test_accuracy': float(
        common.accuracy_of_logits(np.asarray(combine_logits(client_logits)), test_y)
      ),
      'upload_bytes_last_round': rd.local.upload_bytes,
    }
    out.update(self.recipe.summary(ctx, aux, rd, state, history))
    return out

  # -- one epoch -----------------------------------------------------------------------------
  def _kd_batches(self, aux: DistillAux, state: ServerState, rng: np.random.Generator):
    s = aux.settings
    if s.kd_data in ('pool', 'batch'):
      # kd_data='batch': the pool holds one epoch's images (`fresh_state`), the latest ones
      idx, mask = epoch_batches(state.pool, rng, s.kd_batch)
      return state.pool, idx, mask
    pool = self.recipe.fixed_pool(aux)  # 'fixed'
    n = int(pool_size(pool))
    idx = np.stack(
      [rng.choice(n, s.kd_batch, replace=n < s.kd_batch) for _ in range(s.steps_per_epoch)]
    ).astype(np.int32)
    return pool, idx, np.ones_like(idx, bool)

  def _distill_epoch(
    self, ctx: RunContext, aux: DistillAux, rd: RoundData, state: ServerState, r: int, e: int
  ):
    s = aux.settings
    key = ctx.derive_key(Purpose.SERVER, r, e)
    record: Dict[str, Any] = {}
    images = None
    written = None  # a reservoir's (images seen before this epoch, slots written in it)
    if s.synthesis is not None:
      res = synthesize(
        aux.generator,
        rd.teachers,
        aux.student_module,
        state.student.model,
        ctx.dataset.num_classes,
        jax.random.fold_in(key, 0),
        s.synthesis,
        agg=self.recipe.synthesis_agg(state, rd),
        generator_state=state.generator if s.keep_generator else None,
      )
      if s.pool_limit:
        pool, slots = pool_reservoir_add(
          state.pool, res.images, res.labels, jax.random.fold_in(key, 2)
        )
        slots = np.asarray(slots)
        written = (int(state.pool.count), np.unique(slots[slots < pool.capacity]))
      else:
        pool = pool_add(state.pool, res.images, res.labels)
      state = state._replace(
        pool=pool,
        generator=res.generator if s.keep_generator else state.generator,
      )
      comps = np.asarray(res.components)[-1]
      record.update(
        {
          'gen_best_loss': float(res.best_loss),
          'gen_loss': float(np.asarray(res.losses)[-1]),
          'gen_bn': float(comps[0]),
          'gen_oh': float(comps[1]),
          'gen_adv': float(comps[2]),
        }
      )
      last = slice(-s.synthesis.batch_size, None)  # keep='all': the epoch's last G(z)
      images = np.asarray(res.images[last]), np.asarray(res.labels[last])
    state, extra_record = self.recipe.before_kd(ctx, aux, rd, state, r, e)
    record.update(extra_record)
    pool, idx, mask = self._kd_batches(aux, state, np.random.default_rng((int(ctx.run.seed), r, e)))
    programs = KDPrograms(s.kd, s.opt, tuple(t.module for t in rd.teachers), aux.student_module)
    teachers = Teachers(tuple(t.states for t in rd.teachers), self.recipe.kd_agg(state, rd))
    targets = None
    if self.recipe.kd_agg_fixed_in_round and targets_depend_only_on_the_image(s.kd):
      targets = self._pool_targets(aux, r, pool, programs, teachers, written)
    spe = max(1, s.steps_per_epoch)
    kd_key = jax.random.fold_in(key, 1)
    steps = idx.shape[0]
    lr = scheduled_lr(s.opt.schedule, s.opt.lr, e * spe, s.epochs * spe, e, s.epochs)
    lrs = [lr] * steps
    if s.opt.schedule == 'cosine':  # per step
      lrs = [scheduled_lr('cosine', s.opt.lr, e * spe + b, s.epochs * spe) for b in range(steps)]
      lr = lrs[-1] if steps else lr
    epoch = KDEpoch(idx, mask, np.asarray(lrs, np.float32))
    ts, losses = run_kd_steps(programs, state.student, teachers, pool, epoch, kd_key, targets)
    record.update(
      {
        'kd_loss': float(np.mean(losses)) if len(losses) else float('nan'),
        'kd_steps': int(idx.shape[0]),
        'lr': float(lr),
        'pool_size': int(pool_size(state.pool)),
      }
    )
    return state._replace(student=ts), record, images

  def _pool_targets(self, aux: DistillAux, r: int, pool, programs, teachers, written=None):
    """The teacher logits of every filled slot of `pool`, computing only the slots written
    since the last call of round r (all of them on a new round or after a resume).

    Slots are computed in aligned blocks of `kd_batch` (one compiled shape), so a slot's logits
    do not depend on when it was computed: a resumed run keeps the numbers of an uninterrupted
    one. `written`: a reservoir's (count before this epoch's images, the slots they went to);
    None for the ring buffer, whose new images fill the slots after the cached count in order.
    A reservoir's written slots lie scattered over the pool, so they are computed in blocks of
    their own, each slot at its row of its aligned block (`_scattered_blocks`): the same
    numbers for a few blocks instead of nearly every block of the pool.
    """
    count, capacity, block = int(pool.count), pool.capacity, aux.settings.kd_batch
    cached = aux.kd_targets
    valid = cached is not None and cached.round == r and cached.count <= count
    if valid and written is not None:  # a reservoir on the pool the cache holds: its new slots
      if cached.count == written[0]:
        logits = cached.logits
        for rows in _scattered_blocks(written[1], block, capacity):
          idx = jnp.asarray(np.minimum(rows, capacity - 1), jnp.int32)
          t = pool_teacher_logits(programs, teachers, pool, idx)
          logits = logits.at[jnp.asarray(rows)].set(t, mode='drop')
        aux.kd_targets = KDTargets(r, count, logits)
        return logits
      valid = False
    if valid:
      new = min(count - cached.count, capacity)
      slots = (cached.count + np.arange(new)) % capacity
      logits = cached.logits
    else:
      slots = np.arange(min(count, capacity))
      logits = None
    for start in np.unique(slots // block) * block:
      idx = jnp.asarray(np.minimum(start + np.arange(block), capacity - 1), jnp.int32)
      t = pool_teacher_logits(programs, teachers, pool, idx)
      if logits is None:
        logits = jnp.zeros((capacity, t.shape[-1]), t.dtype)
      logits = logits.at[idx].set(t)
    aux.kd_targets = KDTargets(r, count, logits)
    return logits

  # -- figures -------------------------------------------------------------------------------
  def _save_samples(self, ctx: RunContext, images, r: int) -> None:
    path = ctx.output_path('synthetic_samples.png' if r == 1 else f'synthetic_samples_round{r}.png')
    if path is None:
      return
    x, y = images
    distill_plots.plot_image_grid(path, x[:64], y[:64], title=f'last synthetic batch (round {r})')

  def _plot_accuracy(self, ctx: RunContext, epochs: Sequence[Dict[str, Any]]) -> None:
    path = ctx.output_path('distillation_accuracy.png')
    if path is None:
      return
    distill_plots.plot_accuracy_vs_epoch(
      path,
      {
        f'{self.name} round {r}': (
          [h['epoch'] for h in epochs if h['round'] == r],
          [h['test_accuracy'] for h in epochs if h['round'] == r],
        )
        for r in sorted({h['round'] for h in epochs})
      },
      title=f'{self.name} on {ctx.dataset.name}: test accuracy vs distillation epoch',
    )
