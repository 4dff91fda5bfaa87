"""DENSE (Zhang et al., NeurIPS 2022; `github.com/zj-jayzhang/DENSE`) on the shared
one-shot distillation loop (`jfed.methods.oneshot`, whose docstring defines a round and a step).

Per distillation epoch: a FRESH generator and z (DENSE `reset_model`) are trained for `g_steps`
Adam(betas 0.5, 0.999) steps on  bn·L_bn + oh·CE(mean teacher, y) + adv·L_adv  (adv: KL with the
student's disagreement mask, T = 1; RandomCrop + HFlip view; `jfed.distill.dense_config`); the
lowest-loss batch joins the pool (uint8 like DENSE's PNGs); then the student (random init)
takes one pass over the WHOLE pool: KL(softmax(t/T) ‖ softmax(s/T)) 'batchmean' × T² against
the unweighted teacher mean (T = 20 in DENSE's README), SGD(momentum 0.9).

`dense.bn_loss_mode`: 'paper' (default) keeps the DeepInversion BN loss summed over all client
models, as the DENSE paper describes it; 'code' sets it to 0, as the official code effectively
runs (its BN hooks never attach, as in `github.com/zj-jayzhang/DENSE`).

Config (`config.dense`): the fields of `DenseConfig`.
"""

import functools
from typing import Any, Dict, NamedTuple

from jfed import typed_config as tc
from jfed.api import RunContext
from jfed.distill import dense_config, pool_size
from jfed.methods import oneshot
from jfed.methods.registry import register_method

BN_LOSS_MODES = ('paper', 'code')


class DenseOwnConfig(NamedTuple):
  g_steps: int = 30
  synthesis_batch: int = 256
  bn: float = 1.0
  oh: float = 1.0
  adv: float = 1.0
  bn_loss_mode: str = 'paper'
  kd_T: float = 20.0
  kd_optimizer: str = 'sgd'
  kd_lr: float = 0.005
  kd_weight_decay: float = 0.0
  kd_batch: int = 256
  kd_augment: str = 'auto'


# `config.dense`: the shared blocks of jfed/methods/oneshot.py, then its own keys.
DenseConfig = tc.concat(
  'DenseConfig',
  __name__,
  oneshot.OneShotRound,
  oneshot.GeneratorDistillation,
  DenseOwnConfig,
)


def settings(c: DenseConfig, ctx: RunContext) -> oneshot.Settings:
  """A fresh generator per epoch, the mean-logit teacher, KD over the whole synthetic pool."""
  synthesis = dense_config(
    **oneshot.synthesis_common(c, ctx),
    bn=0.0 if c.bn_loss_mode == 'code' else c.bn,
    oh=c.oh,
    adv=c.adv,
  )
  kd = oneshot.kd_config(c, ctx, loss='kl', t_squared=True, aggregation='mean')
  return oneshot.base_settings(c, ctx, synthesis, kd, oneshot.student_optimizer(c))


def summary(c: DenseConfig, ctx: RunContext, aux, rd, state, history) -> Dict[str, Any]:
  """DENSE's summary fields.

  Args:
    c: DENSE's config.
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    rd: The last round's data.
    state: The final server state.
    history: The records of every step of the run.

  Returns:
    The BN-loss mode and the final image-pool size.
  """
  return {'bn_loss_mode': c.bn_loss_mode, 'pool_size': int(pool_size(state.pool))}


def recipe(c: DenseConfig) -> oneshot.Recipe:
  """DENSE on the shared loop: its teacher (the mean) is fixed through a round."""
  return oneshot.Recipe(
    settings=functools.partial(settings, c),
    kd_agg_fixed_in_round=True,
    summary=functools.partial(summary, c),
  )


@register_method('dense')
class Dense(oneshot.DistillationAlgorithm):
  """Fresh generator per epoch, mean-logit teacher, KD over the whole synthetic pool."""

  section = 'dense'
  Config = DenseConfig

  def validate(self, config) -> None:
    super().validate(config)
    tc.require_non_negative(self.config, self.section, ('bn', 'oh', 'adv'))
    tc.require_choice(self.config.bn_loss_mode, BN_LOSS_MODES, f'{self.section}.bn_loss_mode')

  def make_recipe(self) -> oneshot.Recipe:
    return recipe(self.config)
