"""FedDF (Lin et al., NeurIPS'20; epfml/federated-learning-public-code FedDF-code,
reference-code.md §9.1) on the shared one-shot distillation loop (`jfed.methods.oneshot`, whose
docstring defines a round and a step).

Server: the student starts from the FedAvg (size-weighted) of the uploaded models of its
architecture (random when no client has it) and is distilled on UNLABELLED data against the
`avg_logits` teacher (mean of the client logits): KL(softmax(t/T) ‖ softmax(s/T)) 'batchmean',
T = 1, no T²; Adam(1e-3), cosine decay over `total_steps` (10,000) batches of 128 ('cosine'),
gradient norm clipped to 5. Every `eval_every` (100) batches — one epoch, i.e. one driver step —
the student is validated on a labelled server validation set; after `patience` (1,000) batches
without improvement the round stops early (its remaining steps record nothing), and the round's
model is the best-on-validation student (including the FedAvg start).

`feddf.source`: where the unlabelled distillation data comes from —
- 'test_split': `source_size` images of the dataset's test split, held out of evaluation;
- a dataset name (`jfed.data.load_dataset`, e.g. 'mnist', 'kmnist'): `source_size` images of its
  training split, resized (bilinear) and channel-matched to the main input shape.
The validation set is `val_size` labelled images (`val_size=0`: no validation, no early stop,
the final student is returned) of the test split, held out of evaluation (`val_split='test'`),
or of the training split (`val_split='train'`: the whole test split is evaluated, so FedDF is
scored on the same images as the methods it is compared with; the clients' partitions are
drawn from the training split, so the server then holds a few labelled images like those the
clients own, used only to pick the best student). Test accuracy is measured on the test
images not held out (`eval_samples` in the summary).

`feddf.teacher_bn`: 'batch' (default, the reference: it never calls eval() on the teachers, so
their BatchNorm normalises with each distillation batch's statistics) or 'running' (eval mode,
as jfed did before issue 9: a client whose BN running variance collapsed on its few classes
then gives logits of ~1e12 on other images, and multi-round FedDF diverged on fedtsa_digits).
Dropout stays off in the teachers either way (the reference's VGG teachers would drop).

Config (`config.feddf`): the fields of `FedDFConfig`.
"""

import math
from typing import Any, Dict, NamedTuple, Tuple

import jax.numpy as jnp
import numpy as np

from jfed import typed_config as tc
from jfed.data import load_dataset
from jfed.data.transforms import match_input_shape
from jfed.distill import ImagePool, committed
from jfed.driver import Algorithm
from jfed.engine import ModelState
from jfed.errors import ConfigError
from jfed.methods import common, oneshot
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method

TEACHER_BN = ('batch', 'running')


VAL_SPLITS = ('test', 'train')


class FedDFConfig(NamedTuple):
  rounds: int
  local_epochs: int
  server_model: str
  init: str
  source: str
  source_size: int
  val_size: int
  val_split: str  # 'test' | 'train': where the validation images come from
  kd_T: float
  kd_optimizer: str
  kd_lr: float
  kd_batch: int
  total_steps: int
  eval_every: int
  patience: int
  kd_grad_clip: float
  kd_schedule: str
  kd_augment: str
  teacher_bn: str


class DistillationData(NamedTuple):
  pool: ImagePool  # the unlabelled images (float32, labels −1)
  val_x: np.ndarray
  val_y: np.ndarray
  eval_x: np.ndarray
  eval_y: np.ndarray
  source: str


class FedDFExtra(NamedTuple):
  best: ModelState  # best-on-validation student of this round
  best_val: Any  # its validation accuracy (float32 scalar)
  best_test: Any  # its test accuracy
  bad_epochs: Any  # evaluations since the last improvement (int32 scalar)


def distillation_data(ctx: RunContext, cfg: FedDFConfig) -> DistillationData:
  """The unlabelled distillation set, the validation set and the evaluation set (seeded)."""
  ds = ctx.dataset
  rng = np.random.default_rng(ctx.config.seed)
  n = len(ds.test_y)
  val_in_test = cfg.val_split == 'test'
  held = (cfg.source_size if cfg.source == 'test_split' else 0) + cfg.val_size * val_in_test
  if held > n // 2:
    raise ConfigError(
      f'feddf: source_size={cfg.source_size}, val_size={cfg.val_size}: the '
      f'sets held out of the test split must total at most half of its {n} '
      'samples'
    )
  perm = rng.permutation(n)
  if val_in_test:
    val, rest = perm[: cfg.val_size], perm[cfg.val_size :]
    val_x, val_y = ds.test_x[val], ds.test_y[val]
  else:
    rest = perm
    if cfg.val_size > len(ds.train_y):
      raise ConfigError(
        f'feddf.val_size={cfg.val_size} but the training split has {len(ds.train_y)} samples'
      )
    val = np.sort(rng.choice(len(ds.train_y), cfg.val_size, replace=False))
    val_x, val_y = ds.train_x[val], ds.train_y[val]
  if cfg.source == 'test_split':
    x, rest = ds.test_x[rest[: cfg.source_size]], rest[cfg.source_size :]
  else:
    other = load_dataset(cfg.source)
    if cfg.source_size > len(other.train_y):
      raise ConfigError(
        f'feddf.source_size={cfg.source_size} but {cfg.source} has '
        f'{len(other.train_y)} training samples'
      )
    pick = np.sort(rng.choice(len(other.train_y), cfg.source_size, replace=False))
    x = match_input_shape(other.train_x[pick], ds.input_shape)
  keep = np.sort(rest)
  pool = committed(
    ImagePool(
      jnp.asarray(x, jnp.float32),
      jnp.full((len(x),), -1, jnp.int32),
      jnp.asarray(len(x), jnp.int32),
    )
  )
  return DistillationData(pool, val_x, val_y, ds.test_x[keep], ds.test_y[keep], cfg.source)


@register_method('feddf')
class FedDF(oneshot.DistillationAlgorithm):
  """FedAvg start, mean-logit teacher on unlabelled data, best-on-validation student."""

  kd_agg_fixed_in_round = True
  section = 'feddf'
  Config = FedDFConfig

  def validate(self, config) -> None:
    super().validate(config)
    tc.require_positive(self.config, self.section, ('source_size', 'total_steps', 'eval_every'))
    tc.require_non_negative(self.config, self.section, ('val_size', 'patience'))
    tc.require_choice(self.config.teacher_bn, TEACHER_BN, f'{self.section}.teacher_bn')
    tc.require_choice(self.config.val_split, VAL_SPLITS, f'{self.section}.val_split')

  def epochs_per_round(self) -> int:
    return math.ceil(self.config.total_steps / self.config.eval_every)

  def settings(self, ctx: RunContext) -> oneshot.Settings:
    kd = self.kd_config(
      ctx, loss='kl', t_squared=False, aggregation='mean', teacher_bn=self.config.teacher_bn
    )
    return self.base_settings(
      ctx,
      None,
      kd,
      self.student_optimizer('adam'),
      epochs=self.epochs_per_round(),
      steps_per_epoch=self.config.eval_every,
      kd_data='fixed',
    )

  def method_data(self, ctx, settings) -> DistillationData:
    return distillation_data(ctx, self.config)

  def eval_data(self, ctx, data: DistillationData):
    return data.eval_x, data.eval_y

  def fixed_pool(self, aux):
    return aux.data.pool

  def _val(self, aux, model) -> float:
    if len(aux.data.val_y) == 0:
      return -1.0
    return aux.evaluator.accuracy(model, aux.data.val_x, aux.data.val_y)

  def init_extra(self, ctx, aux, student) -> FedDFExtra:
    test = aux.evaluator.accuracy(student, aux.eval_x, aux.eval_y)
    return FedDFExtra(
      student, jnp.float32(self._val(aux, student)), jnp.float32(test), jnp.int32(0)
    )

  def after_epoch(self, ctx, aux, state, test_accuracy, r, e):
    if len(aux.data.val_y) == 0:
      ex = state.extra._replace(best=state.student.model, best_test=jnp.float32(test_accuracy))
      return state._replace(extra=ex), {}
    val = self._val(aux, state.student.model)
    ex = state.extra
    if val > float(ex.best_val):
      ex = FedDFExtra(
        state.student.model, jnp.float32(val), jnp.float32(test_accuracy), jnp.int32(0)
      )
    else:
      ex = ex._replace(bad_epochs=jnp.int32(int(ex.bad_epochs) + 1))  # host-side: no program
    stop = int(ex.bad_epochs) * self.config.eval_every >= self.config.patience
    return (
      state._replace(extra=ex, stopped=jnp.asarray(stop)),
      {'val_accuracy': val, 'best_val_accuracy': float(ex.best_val), 'early_stop': bool(stop)},
    )

  def round_model(self, state):
    return state.extra.best

  def round_accuracy(self, state, last_test_accuracy):
    return float(state.extra.best_test)

  def method_summary(self, ctx, aux, rd, state, history):
    d = aux.data
    return {
      'source': d.source,
      'source_size': int(d.pool.count),
      'val_size': int(len(d.val_y)),
      'eval_samples': int(len(d.eval_y)),
      'best_val_accuracy': float(state.extra.best_val),
      'early_stopped': bool(state.stopped),
    }


class FedDFVoteAux(NamedTuple):
  prototypes: Tuple[str, ...]  # the architectures, in client order
  algorithms: Tuple[FedDF, ...]  # one FedDF per architecture, its student of that architecture
  auxes: Tuple[oneshot.DistillAux, ...]


@register_method('feddf_vote')
class FedDFVote(Algorithm):
  """FedDF for heterogeneous clients as FedMHO (seed 004 §5.1.2) runs it: one student per
  architecture ("model prototype"), each the FedDF of this module — started from the FedAvg of
  its architecture's clients and distilled against the mean logits of *all* clients — and the
  result is the prototypes' vote, the argmax of the mean of their best-on-validation students'
  logits (as `fedavg_vote` votes). Steps: the epochs of prototype 1, then of prototype 2, ...;
  each prototype's records carry 'prototype' and its student's 'prototype_test_accuracy'; the
  last step adds the vote's 'test_accuracy' on FedDF's evaluation images (the test split minus
  the held-out unlabelled and validation images). Config: `config.feddf` (rounds must be 1;
  `server_model` is ignored: every architecture gets a student).
  """

  section = 'feddf'
  Config = FedDFConfig
  step_name = 'epoch'

  def _prototype(self, spec: str) -> FedDF:
    return FedDF(self.config._replace(server_model=spec))

  def validate(self, config) -> None:
    self._prototype('').validate(config)
    tc.require(
      self.config.rounds == 1,
      f'feddf_vote is one-shot: feddf.rounds must be 1, got {self.config.rounds}',
    )

  def _epochs(self) -> int:
    return self._prototype('').epochs_per_round()

  def num_steps(self, ctx: RunContext) -> int:
    return len(dict.fromkeys(common.client_model_specs(ctx))) * self._epochs()

  def step_label(self, i: int, n: int) -> str:
    p, e = divmod(i, self._epochs())
    return f'prototype {p + 1}/{n // self._epochs()} epoch {e + 1}/{self._epochs()}'

  def setup(self, ctx: RunContext) -> FedDFVoteAux:
    specs = tuple(dict.fromkeys(common.client_model_specs(ctx)))
    algorithms = tuple(self._prototype(s) for s in specs)
    return FedDFVoteAux(specs, algorithms, tuple(a.setup(ctx) for a in algorithms))

  def setup_records(self, ctx: RunContext, aux: FedDFVoteAux):
    return aux.algorithms[0].setup_records(ctx, aux.auxes[0])

  def init(self, ctx: RunContext, aux: FedDFVoteAux) -> Tuple[oneshot.ServerState, ...]:
    return tuple(a.init(ctx, x) for a, x in zip(aux.algorithms, aux.auxes))

  def step(self, ctx: RunContext, aux: FedDFVoteAux, state, i: int):
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
      x.evaluator.logits(a.round_model(s), eval_x)
      for a, x, s in zip(aux.algorithms, aux.auxes, state)
    ]
    per_prototype = [float(common.accuracy_of_logits(lg, eval_y)) for lg in logits]
    return {
      'test_accuracy': float(common.accuracy_of_logits(np.mean(logits, axis=0), eval_y)),
      'prototype_test_accuracy': dict(zip(aux.prototypes, per_prototype)),
      'mean_prototype_test_accuracy': float(np.mean(per_prototype)),
    }

  def summarize(self, ctx: RunContext, aux: FedDFVoteAux, state, history) -> Dict[str, Any]:
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
      'client_models': common.client_model_specs(ctx),
      'client_test_accuracy': common.accuracy_of_logits(client_logits, test_y).tolist(),
      'teacher_ensemble_test_accuracy': float(
        common.accuracy_of_logits(np.mean(client_logits, axis=0), test_y)
      ),
    }
