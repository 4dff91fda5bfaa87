"""FedDF (Lin et al., NeurIPS'20; epfml/federated-learning-public-code FedDF-code,
reference-code.md §9.1) on the shared one-shot distillation loop (`jfed.methods.oneshot`, whose
docstring defines a round).

Server: the student starts from the FedAvg (size-weighted) of the uploaded models of its
architecture (random when no client has it) and is distilled on UNLABELLED data against the
`avg_logits` teacher (mean of the client logits): KL(softmax(t/T) ‖ softmax(s/T)) 'batchmean',
T = 1, no T²; Adam(1e-3), cosine decay over `total_steps` (10,000) batches of 128, gradient norm
clipped to 5. Every `eval_every` (100) batches — one "epoch" of the shared loop — the student is
validated on a labelled server validation set; after `patience` (1,000) batches without
improvement the round stops early, and the round's model is the best-on-validation student
(including the FedAvg start).

`feddf.source`: where the unlabelled distillation data comes from —
- 'test_split': `source_size` images of the dataset's test split, held out of evaluation;
- a dataset name (`jfed.data.load_dataset`, e.g. 'mnist', 'kmnist'): `source_size` images of its
  training split, resized (bilinear) and channel-matched to the main input shape.
The validation set is `val_size` labelled images of the test split, also held out of
evaluation (`val_size=0`: no validation, no early stop, the final student is returned).
Test accuracy is measured on the rest of the test split (`eval_samples` in the summary).

Difference from the reference: the teachers run in eval mode (BN running statistics); the
reference never calls eval() on them, so its teacher logits use batch statistics.

Config (`config.feddf`): rounds, local_epochs, server_model, init, source, source_size,
val_size, kd_T, kd_optimizer, kd_lr, kd_batch, total_steps, eval_every, patience,
kd_grad_clip, kd_schedule, kd_augment.
"""
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed.data import load_dataset
from jfed.data.transforms import match_input_shape
from jfed.distill import ImagePool
from jfed.engine import ModelState
from jfed.methods import common, oneshot
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method


class DistillationData(NamedTuple):
  pool: ImagePool        # the unlabelled images (float32, labels −1)
  val_x: np.ndarray
  val_y: np.ndarray
  eval_x: np.ndarray
  eval_y: np.ndarray
  source: str


class FedDFExtra(NamedTuple):
  best: ModelState       # best-on-validation student of this round
  best_val: Any          # its validation accuracy (float32 scalar)
  best_test: Any         # its test accuracy
  bad_epochs: Any        # evaluations since the last improvement (int32 scalar)


def distillation_data(ctx: RunContext, cfg) -> DistillationData:
  """The unlabelled distillation set, the validation set and the evaluation set (seeded)."""
  ds = ctx.dataset
  rng = np.random.default_rng(ctx.config.seed)
  n = len(ds.test_y)
  source_size, val_size = int(cfg.source_size), int(cfg.val_size)
  held = (source_size if cfg.source == 'test_split' else 0) + val_size
  if source_size < 1 or val_size < 0 or held > n // 2:
    raise ValueError(f'feddf: source_size={source_size}, val_size={val_size}: the sets held out '
                     f'of the test split must total at most half of its {n} samples.')
  perm = rng.permutation(n)
  val, rest = perm[:val_size], perm[val_size:]
  if cfg.source == 'test_split':
    x, rest = ds.test_x[rest[:source_size]], rest[source_size:]
  else:
    other = load_dataset(cfg.source)
    if source_size > len(other.train_y):
      raise ValueError(f'feddf.source_size={source_size} but {cfg.source} has '
                       f'{len(other.train_y)} training samples')
    pick = np.sort(rng.choice(len(other.train_y), source_size, replace=False))
    x = match_input_shape(other.train_x[pick], ds.input_shape)
  keep = np.sort(rest)
  pool = oneshot.committed(ImagePool(jnp.asarray(x, jnp.float32),
                                     jnp.full((len(x),), -1, jnp.int32),
                                     jnp.asarray(len(x), jnp.int32)))
  return DistillationData(pool, ds.test_x[val], ds.test_y[val], ds.test_x[keep],
                          ds.test_y[keep], cfg.source)


def feddf_settings(ctx: RunContext, cfg) -> oneshot.Settings:
  eval_every = int(cfg.eval_every)
  kd = oneshot.KDConfig(loss='kl', T=float(cfg.kd_T), t_squared=False, aggregation='mean',
                        augment=oneshot.resolve_augment(cfg.kd_augment, ctx.dataset.name),
                        crop_padding=oneshot.crop_padding(ctx.dataset.input_shape),
                        strategy=oneshot.teacher_strategy(ctx))
  return oneshot.base_settings(ctx, cfg, None, kd, oneshot.opt_config(cfg, name='adam'),
                       epochs=math.ceil(int(cfg.total_steps) / eval_every),
                       steps_per_epoch=eval_every, kd_data='fixed',
                       kd_batch=int(cfg.kd_batch), init=cfg.get('init', 'fedavg'))


class FedDF(oneshot.DistillMethod):
  name = 'feddf'

  def __init__(self, ctx, settings):
    super().__init__(ctx, settings)
    self.data = distillation_data(ctx, ctx.config.feddf)
    self._evaluator = None

  def evaluator(self):
    if self._evaluator is None:
      module = common.build_module(self.s.server_model or self.ctx.config.model, self.ctx.dataset)
      self._evaluator = engine.Evaluator(module, self.ctx.config.eval_batch_size,
                                         self.ctx.config.strategy)
    return self._evaluator

  def eval_data(self):
    return self.data.eval_x, self.data.eval_y

  def fixed_pool(self, aux):
    return self.data.pool

  def _val(self, model):
    if len(self.data.val_y) == 0:
      return -1.0
    return self.evaluator().accuracy(model, self.data.val_x, self.data.val_y)

  def init_extra(self, student, num_teachers):
    test = self.evaluator().accuracy(student, self.data.eval_x, self.data.eval_y)
    return FedDFExtra(student, jnp.float32(self._val(student)), jnp.float32(test),
                      jnp.int32(0))

  def after_epoch(self, state, aux, evaluator, test_accuracy, r, e):
    if len(self.data.val_y) == 0:
      ex = state.extra._replace(best=state.student.model, best_test=jnp.float32(test_accuracy))
      return state._replace(extra=ex), {}
    cfg = self.ctx.config.feddf
    val = self._val(state.student.model)
    ex = state.extra
    if val > float(ex.best_val):
      ex = FedDFExtra(state.student.model, jnp.float32(val), jnp.float32(test_accuracy),
                      jnp.int32(0))
    else:
      ex = ex._replace(bad_epochs=ex.bad_epochs + 1)
    stop = int(ex.bad_epochs) * int(cfg.eval_every) >= int(cfg.patience)
    return (state._replace(extra=ex, stopped=jnp.asarray(stop)),
            {'val_accuracy': val, 'best_val_accuracy': float(ex.best_val),
             'early_stop': bool(stop)})

  def round_model(self, state):
    return state.extra.best

  def round_accuracy(self, state, last_test_accuracy):
    return float(state.extra.best_test)

  def summary(self, state, aux):
    return {'source': self.data.source, 'source_size': int(self.data.pool.count),
            'val_size': int(len(self.data.val_y)), 'eval_samples': int(len(self.data.eval_y)),
            'best_val_accuracy': float(state.extra.best_val),
            'early_stopped': bool(state.stopped)}


@register_method('feddf')
def feddf(ctx: RunContext) -> dict:
  return oneshot.run_distillation(FedDF(ctx, feddf_settings(ctx, ctx.config.feddf)))
