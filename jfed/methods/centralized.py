"""Centralized training: the upper bound, all training data, same model, optimiser and epochs."""

from typing import NamedTuple

import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data import federate
from jfed.engine import GroupTrainer, TrainState
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method


class CentralizedConfig(NamedTuple):
  epochs: int = 1


class CentralizedAux(NamedTuple):
  group: common.ClientGroup
  trainer: GroupTrainer
  evaluator: engine.Evaluator


@register_method('centralized')
class Centralized(Algorithm):
  """One model on the union of the clients' data; a step is an epoch."""

  section = 'centralized'
  label_flip_unsupported = (
    'it trains one model on the union of the data, no client on its own labels'
  )
  Config = CentralizedConfig
  step_name = 'epoch'
  lr_schedule = True

  def validate(self, config) -> None:
    tc.require_positive(self.config, self.section, ('epochs',))

  def trained_model(
    self, ctx: RunContext, aux: CentralizedAux, state: TrainState
  ) -> engine.TrainedModel:
    """The model trained on all the data."""
    return engine.TrainedModel(aux.evaluator.module, engine.take(state.model, 0))

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.epochs

  def setup(self, ctx: RunContext) -> CentralizedAux:
    spec = common.single_architecture(ctx)
    module = common.build_module(spec, ctx.dataset)
    ds = ctx.dataset
    fed = federate(ds.train_x, ds.train_y, [np.arange(len(ds.train_y))])
    group = common.ClientGroup(spec, module, np.array([0]), fed)
    steps_per_epoch = -(-len(ds.train_y) // ctx.run.batch_size)
    trainer = common.make_trainers(ctx, [group], total_steps=self.config.epochs * steps_per_epoch)[
      0
    ]
    evaluator = engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy)
    return CentralizedAux(group, trainer, evaluator)

  def init(self, ctx: RunContext, aux: CentralizedAux) -> TrainState:
    # The optimiser state carries across epochs here, so it is part of the state.
    init = engine.init_models(
      aux.group.module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0), 1
    )
    return engine.init_train_state(aux.trainer.tx, init)

  def step(self, ctx: RunContext, aux: CentralizedAux, state: TrainState, i: int):
    """One epoch of training on the pooled data of all clients."""
    ds = ctx.dataset
    state, metrics = aux.trainer.train(
      state, aux.group.fed, 1, ctx.derive_key(Purpose.LOCAL_TRAINING, i), progress=None
    )
    loss = float(metrics.loss[0, -1])
    accuracy = aux.evaluator.accuracy(engine.take(state.model, 0), ds.test_x, ds.test_y)
    return state, [
      {
        'epoch': i + 1,
        'test_accuracy': accuracy,
        'train_loss': loss,
        'train_accuracy': float(metrics.accuracy[0, -1]),
      }
    ]

  def summarize(self, ctx, aux, state, history):
    """The run summary."""
    return {'epochs': self.config.epochs}
