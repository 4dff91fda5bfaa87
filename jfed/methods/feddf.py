"""FedDF (Lin, Kong, Stich, Jaggi: Ensemble Distillation for Robust Model Fusion in Federated
Learning, NeurIPS'20, arXiv 2006.07242; github.com/epfml/federated-learning-public-code,
codes/FedDF-code) on the shared one-shot distillation loop (`jfed.methods.oneshot`, whose
docstring defines a round and a step).

Server, every round: one student per distilled architecture (`feddf.architectures`). Each starts
from the FedAvg (size-weighted) of the uploaded models of its architecture (random when no
client has it) and is distilled on UNLABELLED data against the `avg_logits` teacher, the mean of
the logits of ALL clients, whatever their architecture: KL(softmax(t/T) ‖ softmax(s/T))
'batchmean', T = 1, no T²; Adam(1e-3), cosine decay over `total_steps` (10,000) batches of 128
('cosine'), gradient norm clipped to 5. Every `eval_every` (100) batches — one epoch, i.e. one
driver step — the student is validated on a labelled server validation set; after `patience`
(1,000) batches without improvement its round stops early (its remaining steps record nothing),
and its round's model is its best-on-validation student (including the FedAvg start). In round
r > 1 the clients of each distilled architecture start from that architecture's student, the
others from their own round r − 1 model.

`feddf.architectures`:
- 'all' (default): every client architecture gets a student (Lin et al.'s FedDF for
  heterogeneous systems, the paper's algorithm for model prototypes: each prototype's FedAvg is
  distilled against the ensemble of all received models, and each client receives the fused
  model of its prototype), plus `server_model`'s when no client has it;
- 'server': only `server_model`'s architecture is distilled; the clients of the other
  architectures never receive a server model (jfed before issue 33).
The method's result, `test_accuracy` and `round_accuracy`, is `server_model`'s student (default
`config.model`); with several students every record adds `student_test_accuracy`
{architecture: accuracy} and the summary each student's round accuracy.

Data: the test split is for scoring only and scored whole. `feddf.source`: where the unlabelled
distillation images come from —
- 'holdout': `source_size` of the training samples held out of every client
  (`dataset.holdout_size`, `jfed.data.public`);
- a dataset name (`jfed.data.load_dataset`, e.g. 'mnist', 'kmnist'): `source_size` images of its
  training split, resized (bilinear) and channel-matched to the main input shape.
`feddf.val_split`: where the `val_size` labelled validation images come from (`val_size=0`: no
validation, no early stop, the final student is returned) — 'holdout' (default: held-out
training samples, disjoint from a 'holdout' source; the reference validates on training samples
it keeps from the clients, `val_data_ratio`) or 'train' (training samples the clients also
hold).

`feddf.teacher_bn`: 'batch' (default, the reference: it never calls eval() on the teachers, so
their BatchNorm normalises with each distillation batch's statistics) or 'running' (eval mode,
as jfed did before issue 9: a client whose BN running variance collapsed on its few classes
then gives logits of ~1e12 on other images, and multi-round FedDF diverged on fedtsa_digits).
Dropout stays off in the teachers either way (the reference's VGG teachers would drop).

Config (`config.feddf`): the fields of `FedDFConfig`.
"""

import functools
import math
from typing import Any, Dict, List, NamedTuple, Tuple

import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data.public import HOLDOUT, check_holdout_fits, check_source, public_data
from jfed.distill import ImagePool, committed
from jfed.engine import ModelState
from jfed.errors import ConfigError
from jfed.methods import common, oneshot
from jfed.methods.registry import register_method

TEACHER_BN = ('batch', 'running')
VAL_SPLITS = (HOLDOUT, 'train')
ARCHITECTURES = ('all', 'server')


class FedDFOwnConfig(NamedTuple):
  server_model: str = ''
  init: str = 'fedavg'
  source: str = 'holdout'
  source_size: int = 4000
  val_size: int = 1000
  val_split: str = 'holdout'  # VAL_SPLITS: where the validation images come from
  kd_T: float = 1.0
  kd_optimizer: str = 'adam'
  kd_lr: float = 1e-3
  kd_batch: int = 128
  total_steps: int = 10000
  eval_every: int = 100
  patience: int = 1000
  kd_grad_clip: float = 5.0
  kd_schedule: str = 'cosine'
  kd_augment: str = 'none'
  teacher_bn: str = 'batch'
  architectures: str = 'all'  # ARCHITECTURES: which architectures get a student


# `config.feddf`: the shared blocks of jfed/methods/oneshot.py, then its own keys.
FedDFConfig = tc.concat('FedDFConfig', __name__, oneshot.OneShotRound, FedDFOwnConfig)


class DistillationData(NamedTuple):
  pool: ImagePool  # the unlabelled images (float32, labels −1)
  val_x: np.ndarray
  val_y: np.ndarray
  source: str


class FedDFExtra(NamedTuple):
  best: ModelState  # best-on-validation student of this round
  best_val: Any  # its validation accuracy (float32 scalar)
  bad_epochs: Any  # evaluations since the last improvement (int32 scalar)


def held_out_count(cfg: FedDFConfig) -> int:
  """How many of the held-out training samples FedDF reads (distillation + validation)."""
  return cfg.source_size * (cfg.source == HOLDOUT) + cfg.val_size * (cfg.val_split == HOLDOUT)


def distillation_data(ctx: RunContext, cfg: FedDFConfig) -> DistillationData:
  """The unlabelled distillation set and the validation set (seeded; no test sample)."""
  ds, seed = ctx.dataset, int(ctx.run.seed)
  val_held = cfg.val_split == HOLDOUT
  # `validate` refused a too small dataset.holdout_size; `public_data` refuses one again
  held = held_out_count(cfg)
  x_held = y_held = None
  if held:
    public = public_data(ds, HOLDOUT, held, seed)
    x_held, y_held = public.x, public.y
  if val_held:  # the first val_size held-out samples validate, the others are distilled on
    val_x, val_y = x_held[: cfg.val_size], y_held[: cfg.val_size]
    x_held = x_held[cfg.val_size :]
  else:
    if cfg.val_size > len(ds.train_y):
      raise ConfigError(
        f'feddf.val_size={cfg.val_size} but the training split has {len(ds.train_y)} samples'
      )
    val = np.sort(np.random.default_rng(seed).choice(len(ds.train_y), cfg.val_size, replace=False))
    val_x, val_y = ds.train_x[val], ds.train_y[val]
  x = x_held if cfg.source == HOLDOUT else public_data(ds, cfg.source, cfg.source_size, seed).x
  pool = committed(
    ImagePool(
      jnp.asarray(x, jnp.float32),
      jnp.full((len(x),), -1, jnp.int32),
      jnp.asarray(len(x), jnp.int32),
    )
  )
  return DistillationData(pool, val_x, val_y, cfg.source)


def epochs_per_round(c: FedDFConfig) -> int:
  """Distillation epochs (driver steps) per round: one per `eval_every` KD steps."""
  return math.ceil(c.total_steps / c.eval_every)


def settings(c: FedDFConfig, ctx: RunContext) -> oneshot.Settings:
  """No synthesis: `eval_every` KD steps per epoch on the fixed unlabelled set, Adam."""
  kd = oneshot.kd_config(
    c, ctx, loss='kl', t_squared=False, aggregation='mean', teacher_bn=c.teacher_bn
  )
  return oneshot.base_settings(
    c,
    ctx,
    None,
    kd,
    oneshot.student_optimizer(c, 'adam'),
    epochs=epochs_per_round(c),
    steps_per_epoch=c.eval_every,
    kd_data='fixed',
  )


def _val(aux: oneshot.DistillAux, model: ModelState) -> float:
  if len(aux.data.val_y) == 0:
    return -1.0
  return aux.evaluator.accuracy(model, aux.data.val_x, aux.data.val_y)


def start_as_best(ctx: RunContext, aux: oneshot.DistillAux, student: ModelState) -> FedDFExtra:
  """Early-stopping state: the best model by validation accuracy, from the start.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    student: The model the round's student starts from.

  Returns:
    The best model so far (the start), its validation accuracy and a zero count of bad epochs.
  """
  return FedDFExtra(student, jnp.float32(_val(aux, student)), jnp.int32(0))


def keep_best_on_validation(c: FedDFConfig, ctx: RunContext, aux, rd, state, r: int, e: int):
  """Keeps the best student by validation accuracy; stops after `patience` epochs without gain.

  Args:
    c: FedDF's config.
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    rd: The round's uploads and teachers (unused).
    state: The server state after the epoch.
    r: The round, from 1.
    e: The epoch within the round, from 0.

  Returns:
    The state with the updated best model and stop flag, and validation fields for the record.
  """
  if len(aux.data.val_y) == 0:
    return state._replace(extra=state.extra._replace(best=state.student.model)), {}
  val = _val(aux, state.student.model)
  ex = state.extra
  # both in float32, as best_val is kept: a tie is no gain (the reference's `>`), whichever way
  # float32 rounds the accuracy
  if np.float32(val) > np.float32(ex.best_val):
    ex = FedDFExtra(state.student.model, jnp.float32(val), jnp.int32(0))
  else:
    ex = ex._replace(bad_epochs=jnp.int32(int(ex.bad_epochs) + 1))  # host-side: no program
  stop = int(ex.bad_epochs) * c.eval_every >= c.patience
  return (
    state._replace(extra=ex, stopped=jnp.asarray(stop)),
    {'val_accuracy': val, 'best_val_accuracy': float(ex.best_val), 'early_stop': bool(stop)},
  )


def best_model(state: oneshot.ServerState) -> ModelState:
  """The round's global model: the best-on-validation student."""
  return state.extra.best


def best_accuracy(aux: oneshot.DistillAux, state, last_test_accuracy: float) -> float:
  """The round's accuracy: that of the model it hands on.

  Args:
    aux: The run-level state built in `setup`.
    state: The server state at the end of the round.
    last_test_accuracy: The student's test accuracy after the last epoch, in [0, 1].

  Returns:
    The accuracy of the best-on-validation student (the last one's without validation).
  """
  if len(aux.data.val_y) == 0:
    return last_test_accuracy
  return aux.evaluator.accuracy(state.extra.best, aux.eval_x, aux.eval_y)


def summary(c: FedDFConfig, ctx: RunContext, aux, rd, state, history) -> Dict[str, Any]:
  """Summary fields of FedDF's distillation data.

  Args:
    c: FedDF's config.
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    rd: The last round's uploads, teachers and data.
    state: The final server state.
    history: The records of every step of the run.

  Returns:
    The source and validation sizes, the best validation accuracy and whether it stopped early.
  """
  d = aux.data
  return {
    'source': d.source,
    'source_size': int(d.pool.count),
    'val_size': int(len(d.val_y)),
    'val_split': c.val_split,
    'eval_samples': int(len(aux.eval_y)),
    'best_val_accuracy': float(state.extra.best_val),
    'early_stopped': bool(state.stopped),
  }


def recipe(c: FedDFConfig) -> oneshot.Recipe:
  """FedDF's student on the shared loop: no synthesis, a fixed unlabelled set, the mean-logit
  teacher (fixed through a round), best-on-validation selection and early stopping."""
  return oneshot.Recipe(
    settings=functools.partial(settings, c),
    method_data=lambda ctx, unused_settings: distillation_data(ctx, c),
    init_extra=start_as_best,
    kd_agg_fixed_in_round=True,
    fixed_pool=lambda aux: aux.data.pool,
    after_epoch=functools.partial(keep_best_on_validation, c),
    round_model=best_model,
    round_accuracy=best_accuracy,
    summary=functools.partial(summary, c),
  )


class FedDFStudent(oneshot.DistillationAlgorithm):
  """The FedDF student of one architecture (`server_model`): FedAvg start, mean-logit teacher
  of all clients on unlabelled data, best-on-validation student. Not a method by itself: `FedDF`
  runs one per distilled architecture, `FedDFVote` one per prototype."""

  name = 'feddf'
  section = 'feddf'
  Config = FedDFConfig

  def validate(self, config) -> None:
    super().validate(config)
    c = self.config
    tc.require_positive(c, self.section, ('source_size', 'total_steps', 'eval_every'))
    tc.require_non_negative(c, self.section, ('val_size', 'patience'))
    tc.require_choice(c.teacher_bn, TEACHER_BN, f'{self.section}.teacher_bn')
    tc.require_choice(c.val_split, VAL_SPLITS, f'{self.section}.val_split')
    tc.require_choice(c.architectures, ARCHITECTURES, f'{self.section}.architectures')
    check_source(c.source, f'{self.section}.source')
    if held_out_count(c):
      check_holdout_fits(
        config, HOLDOUT, held_out_count(c), f'{self.section}.source_size + val_size from'
      )

  def trained_model(self, ctx: RunContext, aux, state) -> engine.TrainedModel:
    """The model the round hands on: the best-on-validation student (`best_model`), or the
    last one's without a validation set.
    """
    model = best_model(state) if len(aux.data.val_y) else state.student.model
    return engine.TrainedModel(aux.student_module, model)

  def epochs_per_round(self) -> int:
    return epochs_per_round(self.config)

  def make_recipe(self) -> oneshot.Recipe:
    return recipe(self.config)


class FedDFAux(NamedTuple):
  architectures: Tuple[str, ...]  # the distilled architectures; the first is `server_model`
  students: Tuple[FedDFStudent, ...]
  auxes: Tuple[oneshot.DistillAux, ...]


@register_method('feddf')
class FedDF(Algorithm):
  """FedDF with a student per distilled architecture (see the module docstring). A step is one
  distillation epoch of every student that has not stopped; its record is `server_model`'s
  student's, with every student's test accuracy added when there are several."""

  section = 'feddf'
  Config = FedDFConfig
  step_name = 'epoch'

  def _student(self, spec: str) -> FedDFStudent:
    return FedDFStudent(self.config._replace(server_model=spec))

  def validate(self, config) -> None:
    self._student(self.config.server_model).validate(config)

  def architectures(self, ctx: RunContext) -> Tuple[str, ...]:
    """The distilled architectures, `server_model`'s first."""
    server = self.config.server_model or ctx.run.model
    if self.config.architectures == 'server':
      return (server,)
    return tuple(dict.fromkeys([server, *ctx.federation.specs]))

  def epochs_per_round(self) -> int:
    return self._student('').epochs_per_round()

  def trained_model(self, ctx: RunContext, aux: FedDFAux, state) -> engine.TrainedModel:
    """The student of `server_model` (the first architecture), whose accuracy the run reports."""
    return aux.students[0].trained_model(ctx, aux.auxes[0], state[0])

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds * self.epochs_per_round()

  def step_label(self, i: int, n: int, aux=None) -> str:
    return self._student('').step_label(i, n)

  def setup(self, ctx: RunContext) -> FedDFAux:
    specs = self.architectures(ctx)
    students = tuple(self._student(s) for s in specs)
    trainers = common.client_trainers(ctx)  # every student's rounds train the same clients
    return FedDFAux(specs, students, tuple(s.setup(ctx, trainers) for s in students))

  def setup_records(self, ctx: RunContext, aux: FedDFAux):
    return aux.students[0].setup_records(ctx, aux.auxes[0])

  def init(self, ctx: RunContext, aux: FedDFAux) -> Tuple[oneshot.ServerState, ...]:
    return tuple(s.init(ctx, a) for s, a in zip(aux.students, aux.auxes))

  def step(self, ctx: RunContext, aux: FedDFAux, state, i: int):
    """One distillation epoch of every student; a new round first trains the round's uploads."""
    r, e = divmod(i, self.epochs_per_round())
    r += 1
    if e == 0 and r > 1:
      # The round's uploads, trained once (a stage) with every architecture's clients starting
      # from their architecture's student; each student's step then reads them.
      global_models = {
        spec: student.recipe.round_model(s)
        for spec, student, s in zip(aux.architectures, aux.students, state)
      }
      oneshot.round_uploads(
        ctx,
        r,
        self.config.local_epochs,
        aux.architectures[0],
        global_models,
        aux.auxes[0].trainers,
      )
    new, records = [], []
    for student, student_aux, s in zip(aux.students, aux.auxes, state):
      s, recs = student.step(ctx, student_aux, s, i)
      new.append(s)
      records.append(recs[0] if recs else None)
    return tuple(new), self._records(aux, r, e, records)

  def _records(self, aux: FedDFAux, r: int, e: int, records: List[Any]) -> List[Dict[str, Any]]:
    if all(rec is None for rec in records):
      return []
    out = dict(records[0]) if records[0] is not None else {'round': r, 'epoch': e + 1}
    if len(records) == 1:
      return [out]
    ran = [(spec, rec) for spec, rec in zip(aux.architectures, records) if rec is not None]
    out['student_test_accuracy'] = {spec: rec['test_accuracy'] for spec, rec in ran}
    rounds = {spec: rec['round_accuracy'] for spec, rec in ran if 'round_accuracy' in rec}
    if rounds:
      out['student_round_accuracy'] = rounds
    download = sum(rec.get('download_bytes', 0) for _, rec in ran)
    if download:  # every architecture's clients download their student
      out['download_bytes'] = download
    return [out]

  def final_accuracy(self, history) -> Any:
    return self._student('').final_accuracy(history)

  def summarize(self, ctx: RunContext, aux: FedDFAux, state, history) -> Dict[str, Any]:
    """The run summary of the first student, with every student's accuracy."""
    out = aux.students[0].summarize(ctx, aux.auxes[0], state[0], history)
    out['architectures'] = self.config.architectures
    out['students'] = list(aux.architectures)
    out['student_test_accuracy'] = {
      spec: a.evaluator.accuracy(student.recipe.round_model(s), a.eval_x, a.eval_y)
      for spec, student, a, s in zip(aux.architectures, aux.students, aux.auxes, state)
    }
    return out


class FedDFVoteAux(NamedTuple):
  prototypes: Tuple[str, ...]  # the architectures, in client order
  algorithms: Tuple[FedDFStudent, ...]  # one student per architecture
  auxes: Tuple[oneshot.DistillAux, ...]


@register_method('feddf_vote')
class FedDFVote(Algorithm):
  """FedDF for heterogeneous clients as FedMHO (Yao et al., WWW'26; github.com/YXShi2000/FedMHO,
  §5.1.2) runs it: one student per architecture ("model prototype"), each FedDF's
  (`FedDFStudent`) — started from the FedAvg of its architecture's clients and distilled against
  the mean logits of *all* clients — and the result is the prototypes' vote, the argmax of the
  mean of their best-on-validation students' logits (as `fedavg_vote` votes). Steps: the epochs
  of prototype 1, then of prototype 2, ...; each prototype's records carry 'prototype' and its
  student's 'prototype_test_accuracy'; the last step adds the vote's 'test_accuracy' on the whole
  test split. Config: `config.feddf` (rounds must be 1; `server_model` and `architectures` are
  ignored: every architecture gets a student).
  """

  section = 'feddf'
  Config = FedDFConfig
  step_name = 'epoch'

  def _prototype(self, spec: str) -> FedDFStudent:
    return FedDFStudent(self.config._replace(server_model=spec))

  def validate(self, config) -> None:
    self._prototype('').validate(config)
    tc.require(
      self.config.rounds == 1,
      f'feddf_vote is one-shot: feddf.rounds must be 1, got {self.config.rounds}',
    )

  def _epochs(self) -> int:
    return self._prototype('').epochs_per_round()

  def num_steps(self, ctx: RunContext) -> int:
    return len(ctx.federation.architectures) * self._epochs()

  def step_label(self, i: int, n: int, aux=None) -> str:
    p, e = divmod(i, self._epochs())
    return f'prototype {p + 1}/{n // self._epochs()} epoch {e + 1}/{self._epochs()}'

  def setup(self, ctx: RunContext) -> FedDFVoteAux:
    specs = ctx.federation.architectures
    algorithms = tuple(self._prototype(s) for s in specs)
    trainers = common.client_trainers(ctx)  # every prototype's run reads the same uploads
    return FedDFVoteAux(specs, algorithms, tuple(a.setup(ctx, trainers) for a in algorithms))

  def setup_records(self, ctx: RunContext, aux: FedDFVoteAux):
    return aux.algorithms[0].setup_records(ctx, aux.auxes[0])

  def init(self, ctx: RunContext, aux: FedDFVoteAux) -> Tuple[oneshot.ServerState, ...]:
    return tuple(a.init(ctx, x) for a, x in zip(aux.algorithms, aux.auxes))

  def step(self, ctx: RunContext, aux: FedDFVoteAux, state, i: int):
    """One epoch of the current prototype's FedDF run, its records renamed per prototype."""
    p, e = divmod(i, self._epochs())
    new, records = aux.algorithms[p].step(ctx, aux.auxes[p], state[p], e)
    state = state[:p] + (new,) + state[p + 1 :]
    renamed = {'test_accuracy': 'prototype_test_accuracy', 'round_accuracy': 'prototype_accuracy'}
    records = [
      {'prototype': aux.prototypes[p], **{renamed.get(k, k): v for k, v in r.items()}}
      for r in records
    ]
    if i + 1 == self.num_steps(ctx):
      records.append({'round': 1, **self._vote(aux, state)})
    return state, records

  def _vote(self, aux: FedDFVoteAux, state) -> Dict[str, Any]:
    eval_x, eval_y = aux.auxes[0].eval_x, aux.auxes[0].eval_y
    logits = [
      x.evaluator.logits(a.recipe.round_model(s), eval_x)
      for a, x, s in zip(aux.algorithms, aux.auxes, state)
    ]
    per_prototype = [float(common.accuracy_of_logits(lg, eval_y)) for lg in logits]
    return {
      'test_accuracy': float(common.accuracy_of_logits(np.mean(logits, axis=0), eval_y)),
      'prototype_test_accuracy': dict(zip(aux.prototypes, per_prototype)),
      'mean_prototype_test_accuracy': float(np.mean(per_prototype)),
    }

  def summarize(self, ctx: RunContext, aux: FedDFVoteAux, state, history) -> Dict[str, Any]:
    """The run summary: the accuracy of the prototypes' vote and of each prototype."""
    vote = self._vote(aux, state)
    local = aux.algorithms[0].round(ctx, aux.auxes[0], 1).local
    client_logits = common.client_test_logits(ctx, local)
    test_y = ctx.dataset.test_y
    return {
      'prototypes': list(aux.prototypes),
      'prototype_test_accuracy': vote['prototype_test_accuracy'],
      'mean_prototype_test_accuracy': vote['mean_prototype_test_accuracy'],
      'prototype_best_val_accuracy': dict(
        zip(aux.prototypes, [float(s.extra.best_val) for s in state])
      ),
      'eval_samples': int(len(aux.auxes[0].eval_y)),
      'client_models': list(ctx.federation.specs),
      'client_test_accuracy': common.accuracy_of_logits(client_logits, test_y).tolist(),
      'teacher_ensemble_test_accuracy': float(
        common.accuracy_of_logits(np.mean(client_logits, axis=0), test_y)
      ),
    }
