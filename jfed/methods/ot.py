"""OT model fusion (Singh & Jaggi, NeurIPS'20; `github.com/sidak/otfusion` weight mode)
as a one-shot FL baseline (FedHydra's "OT"); a step is a round.

Each round: the clients' uploaded models (`oneshot.round_uploads`: round 1 trains every client
`local_epochs` from the shared init; round r > 1 starts every client from the previous fused
model) are fused by `jfed.distill.ot_fuse_states`: every model is aligned layer by layer to the
anchor client's neurons with an optimal-transport plan ('exact': assignment / transport LP,
'sinkhorn': ott-jax entropic OT with `epsilon`) and the aligned models are averaged (uniform
weights as otfusion, or `weights='size'`). No server training. The fused model is evaluated
and, for multi-round runs, sent back to the clients. For reference the records and summary also
report the plain (unaligned) average of the same uploads (`plain_average_test_accuracy`, same
weights). Note: in the one-shot protocol every client starts from ONE shared initial model
(DENSE, FedHydra); after local training the neurons usually still correspond, the exact OT
plans are then permutation-free (measured on digits, 20 local epochs: identity at every layer)
and OT equals the plain average. otfusion's own setting fuses independently initialised models.

Single architecture, sequential models only (cnn_mnist / fedhydra_cnn2, lenet, mlp, cnn_cifar,
fedhydra_cnn3): the fused layers are the model's Conv/Dense layers in creation order, each
followed BatchNorm transported with it; residual / inception models are refused with a message.

Config (`config.ot`): the fields of `OTConfig`.
"""

from typing import Dict, List, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.distill import FusionLayer, ot_fuse_states
from jfed.engine import GroupTrainer, ModelState
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common, oneshot
from jfed.methods.registry import register_method

OT_METHODS = ('exact', 'sinkhorn')
WEIGHTS = ('uniform', 'size')


class OTOwnConfig(NamedTuple):
  method: str = 'exact'
  epsilon: float = 0.01
  anchor: int = 0
  skip_last_layer: bool = True
  weights: str = 'uniform'
  squared: bool = False
  bias_in_cost: bool = True


# `config.ot`: the shared blocks of jfed/methods/oneshot.py, then its own keys.
OTConfig = tc.concat('OTConfig', __name__, oneshot.OneShotRound, OTOwnConfig)


class OTAux(NamedTuple):
  spec: str
  layers: List[FusionLayer]
  evaluator: engine.Evaluator
  init: ModelState
  trainers: Dict[str, GroupTrainer]  # the clients' local trainer (one architecture)


def fusion_layers(module, input_shape, key) -> list:
  """The Conv/Dense layers of a sequential model in forward (creation) order, each with the
  BatchNorm that follows it.

  Args:
    module: A sequential flax classifier.
    input_shape: The (H, W, C) shape of one input.
    key: A PRNG key for the (shape-only) initialization.

  Returns:
    The FusionLayers, in forward order.
  """
  # Creation order is the order of Flax's own init dict; a jitted init returns its keys sorted,
  # so read the order while tracing (eval_shape: nothing compiled or computed).
  submodules = []

  def record(k):
    variables = module.init(k, jnp.zeros((1, *input_shape), jnp.float32), train=False)
    submodules.extend((name, frozenset(sub)) for name, sub in variables['params'].items())
    return variables

  jax.eval_shape(record, key)
  layers = []
  for name, keys in submodules:
    if 'kernel' in keys and keys <= {'kernel', 'bias'}:
      layers.append(FusionLayer(name))
    elif name.startswith('BatchNorm') and layers and layers[-1].bn is None:
      layers[-1] = FusionLayer(layers[-1].name, name)
    else:
      raise ConfigError(
        f'OT fusion handles sequential Conv/Dense(+BatchNorm) models only; '
        f'{type(module).__name__} has the submodule {name!r}'
      )
  return layers


@register_method('ot')
class OT(Algorithm):
  """Layer-wise optimal-transport alignment of the uploads to an anchor, then averaging."""

  section = 'ot'
  Config = OTConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(c, where, ('rounds', 'local_epochs', 'epsilon'))
    tc.require_choice(c.method, OT_METHODS, f'{where}.method')
    tc.require_choice(c.weights, WEIGHTS, f'{where}.weights')
    num_clients = int(config.partition.num_clients)
    tc.require(
      0 <= c.anchor < num_clients,
      f'{where}.anchor must be a client id in [0, {num_clients}), got {c.anchor}',
    )

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def setup(self, ctx: RunContext) -> OTAux:
    spec = common.single_architecture(ctx)
    module = common.build_module(spec, ctx.dataset)
    init = engine.init_model(module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
    layers = fusion_layers(module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
    evaluator = engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy)
    trainers = common.client_trainers(ctx)
    oneshot.round_uploads(ctx, 1, self.config.local_epochs, spec, trainers=trainers)
    return OTAux(spec, layers, evaluator, init, trainers)

  def init(self, ctx: RunContext, aux: OTAux) -> ModelState:
    return aux.init

  def step(self, ctx: RunContext, aux: OTAux, state: ModelState, i: int):
    """One round: the clients train from the previous fused model (round 1: the shared initial
    model), then their models are aligned by optimal transport and averaged.
    """
    c, r = self.config, i + 1
    local = oneshot.round_uploads(
      ctx, r, c.local_epochs, aux.spec, state if r > 1 else None, aux.trainers
    )
    models, sizes = local.models[0], local.groups[0].fed.sizes
    weights = None if c.weights == 'uniform' else np.asarray(sizes, np.float64)
    fused = ot_fuse_states(
      models,
      aux.layers,
      method=c.method,
      epsilon=c.epsilon,
      anchor=c.anchor,
      weights=weights,
      skip_last_layer=c.skip_last_layer,
      squared=c.squared,
      bias_in_cost=c.bias_in_cost,
    )
    plain = engine.weighted_average(models, np.ones(len(sizes)) if weights is None else sizes)
    test_x, test_y = ctx.dataset.test_x, ctx.dataset.test_y
    record = {
      'round': r,
      'test_accuracy': aux.evaluator.accuracy(fused, test_x, test_y),
      'plain_average_test_accuracy': aux.evaluator.accuracy(plain, test_x, test_y),
      'upload_bytes': local.upload_bytes,
    }
    if r > 1:
      record['download_bytes'] = oneshot.download_bytes(local, aux.spec, state)
    return fused, [record]

  def summarize(self, ctx: RunContext, aux: OTAux, state: ModelState, history):
    """The run summary."""
    c = self.config
    local = oneshot.round_uploads(ctx, c.rounds, c.local_epochs, aux.spec)
    rounds = [h for h in history if h.get('test_accuracy') is not None]
    return {
      'plain_average_test_accuracy': rounds[-1]['plain_average_test_accuracy'],
      'round_test_accuracy': [h['test_accuracy'] for h in rounds],
      'rounds': c.rounds,
      'local_epochs': c.local_epochs,
      'ot_method': c.method,
      'fused_layers': [l.name for l in aux.layers],
      'client_test_accuracy': common.client_accuracies(ctx, local).tolist(),
      'upload_bytes': int(sum(h.get('upload_bytes', 0) for h in history)),
    }
