"""HeteroFL (Diao, Ding, Tarokh, ICLR 2021; its authors' repository at `github.com/diaoenmao`):
clients train width-reduced sub-models of one global model, the server averages every parameter
entry over the clients that hold it. A baseline of FedTSA (Fan et al., ECCV 2024, §5.1, Tables
3–4).

Clients and rates: the global model is `config.model` (a ResNet-18, whose `width_mult` scales
every hidden layer, the reference's ceil(rate · [64, 128, 256, 512]), or the MLP, whose
`width_mult` scales its hidden layers like the reference's MLP); client k's model is its
spec in `config.client_models`, the same model at a smaller or equal `width_mult`, and its rate
is its width over the global one (the reference's fixed `model_split_mode`: e.g. FedTSA's rates
1.0/0.8/0.6 for 20/40/40 % of the clients are the specs 'a;b;b;c;c' cycled over the clients).
Each rate is one compiled client group.

Each round (`heterofl.participation` of the clients, seeded):
1. every selected client gets the sub-model made of the first ceil(rate · n) channels of every
   hidden layer of the global model (`jfed.engine.submodels.slice_tree`; the output layer keeps
   all classes) and trains it for `local_epochs` epochs on its data with a fresh optimiser
   (`config.optimizer`, gradient norm clipped to `grad_clip` as the reference's
   clip_grad_norm_(1));
2. with `masked_ce` (the reference's `cfg['mask']`, on by default) the logits of the classes
   outside the client's label set are set to 0 before the cross entropy (without it the
   plain cross entropy; the aggregation below masks the output rows either way, as the
   reference's `combine` does);
3. the client uploads its sub-model (`ModelUpload`, validated against its rate's shapes);
4. the server averages each entry over the clients that hold it, output-layer rows only over the
   clients whose label set has the class (`jfed.engine.submodels.scatter_average`; label sets
   from the partition, as the reference's server knows `label_split`).

Static BatchNorm (`static_bn`, the reference's `track_running_stats=False` + `stats()`): the
clients train on batch statistics and upload no running statistics; for evaluation the server
gives the global model the cumulative statistics of a train-mode pass over the clients'
training data (`jfed.engine.BatchNormStatistics`; the reference passes the whole centralised
training set, which is the same data when the partition assigns every sample). Without it the
running statistics are averaged like the parameters.

Evaluation: the global (full-width) model on the test set (`test_accuracy`, the reference's
'Global-Accuracy') and, with `eval_submodels`, each rate's sub-model of the new global model
with its own static statistics (`submodel_test_accuracy`, keyed by rate).

The Scaler (`scaler`, on by default as the reference's `cfg['scale']`): in training, a client
of rate r divides the output of every hidden linear map (each Dense but the output layer, each
Conv) by r, the reference's `Scaler` module (`x / rate` when training, identity in evaluation),
which sits after every convolution of its Conv and ResNet models. It is applied by dividing
those layers' kernels and biases by r inside the local objective, so gradients flow through it
as through the reference's module. Where a BatchNorm follows (ResNet-18) it changes only the
norm's eps term; on the MLP (FedAvg's 2NN, no norm layers) it rescales every hidden activation.

Differences from the reference: the global learning-rate schedule across rounds (MultiStepLR)
is not applied (constant `optimizer.lr`).
The reference's 'Local-Accuracy' on per-client test splits is not computed (no per-client test
splits here). Our ResNet-18 is kuangliu's (post-activation), not the reference's pre-activation
variant.

Config (`config.heterofl`): the fields of `HeteroFLConfig`.
"""

import functools
from typing import Any, Dict, List, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data import class_count_table
from jfed.engine import GroupTrainer, ModelState, submodels
from jfed.engine.training import supervised_loss
from jfed.errors import ConfigError
from jfed.io import ModelUpload, serialized_nbytes, validate_model_upload
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method

# Models whose sub-models are leading corners of every parameter: every hidden width scales
# with `width_mult` and the classifier follows a global pooling (a flatten of a feature map
# would interleave channels and positions).
SLICEABLE_MODELS = ('resnet18', 'mlp')


class HeteroFLConfig(NamedTuple):
  rounds: int = 300
  local_epochs: int = 5
  participation: float = 0.1
  masked_ce: bool = True
  static_bn: bool = True
  grad_clip: float = 1.0
  eval_submodels: bool = True
  scaler: bool = True  # the reference's Scaler: hidden pre-activations / rate in training


def client_rates(model: str, client_specs) -> Dict[str, float]:
  """{client spec: its width rate relative to the global `model`}; ConfigError unless every
  client model is the global one at a width_mult no larger than the global's."""
  name, kwargs = common.parse_model_spec(model)
  if name.lower() not in SLICEABLE_MODELS:
    raise ConfigError(
      f'heterofl needs a width-scalable global model ({", ".join(SLICEABLE_MODELS)}); '
      f'config.model is {model!r}'
    )
  width = float(kwargs.pop('width_mult', 1.0))
  rates = {}
  for spec in dict.fromkeys(client_specs):
    n, k = common.parse_model_spec(spec)
    w = float(k.pop('width_mult', 1.0))
    tc.require(
      n.lower() == name.lower() and k == kwargs,
      f'heterofl: client model {spec!r} must be config.model {model!r} at another width_mult',
    )
    tc.require(
      0.0 < w <= width,
      f'heterofl: client model {spec!r} is wider than the global model {model!r}',
    )
    rates[spec] = w / width
  return rates


def mask_logits(logits: jax.Array, label_mask: jax.Array) -> jax.Array:
  """The reference's `out.masked_fill(label_mask == 0, 0)`: logits of classes outside the
  client's label set become 0 (not -inf: those classes keep a share of the softmax)."""
  return jnp.where(label_mask > 0, logits, 0.0)


def masked_classification_objective(module, params, batch_stats, x, y, weights, key, context):
  """The engine's `LocalObjective` of a HeteroFL client: cross entropy of the masked logits;
  `context` is the client's [C] label mask.

  Args:
    module: The client's flax module.
    params: Its parameters.
    batch_stats: Its BatchNorm statistics.
    x: A batch of inputs, [B, H, W, C].
    y: Their labels, [B].
    weights: [B] sample weights (0 for padded rows).
    key: The PRNG key of the step (dropout).
    context: The client's [C] label mask.

  Returns:
    (loss to differentiate, (reported loss, correct predictions, real-sample count, new
      batch_stats)), as `jfed.engine.training.LocalObjective`.
  """
  logits, updates = module.apply(
    {'params': params, 'batch_stats': batch_stats},
    x,
    train=True,
    mask=weights > 0,
    mutable=['batch_stats'],
    rngs={'dropout': key},
  )
  loss, correct, count = supervised_loss(mask_logits(logits, context), y, weights)
  return loss, (loss, correct, count, updates.get('batch_stats', batch_stats))


def scale_hidden_layers(params: Any, factor: float, output_layer: str) -> Any:
  """`params` with every kernel and bias of a Dense or Conv layer other than the top-level
  `output_layer` multiplied by `factor`: the reference's Scaler (1 / rate) after each hidden
  linear map, folded into its weights.

  Args:
    params: A model's parameters.
    factor: The multiplier (1 / model rate).
    output_layer: The name of the top-level output layer, left unscaled.

  Returns:
    The scaled parameters.
  """

  def scale(path, leaf):
    names = [str(getattr(k, 'key', k)) for k in path]
    hidden = names[0] != output_layer and len(names) >= 2
    linear = (
      hidden and names[-2].startswith(('Dense_', 'Conv_')) and names[-1] in ('kernel', 'bias')
    )
    return leaf * factor if linear else leaf

  return jax.tree_util.tree_map_with_path(scale, params)


@functools.lru_cache(maxsize=None)  # one objective per width: runs share its trainer's programs
def scaled_objective(rate: float, output_layer: str):
  """The local objective of a client of width `rate`: `masked_classification_objective` with
  the Scaler (every hidden linear map's output divided by `rate`)."""

  def objective(module, params, batch_stats, x, y, weights, key, context):
    scaled = scale_hidden_layers(params, 1.0 / rate, output_layer)
    return masked_classification_objective(module, scaled, batch_stats, x, y, weights, key, context)

  return objective


def model_shapes(module, input_shape) -> ModelState:
  """The shapes and dtypes of `module`'s variables (nothing is computed)."""

  def init(key):
    v = module.init(key, jnp.zeros((2, *input_shape), jnp.float32), train=False)
    return ModelState(v['params'], v.get('batch_stats', {}))

  return jax.eval_shape(init, jax.random.PRNGKey(0))


class HeteroFLAux(NamedTuple):
  groups: List[common.ClientGroup]
  rates: List[float]  # per group
  trainers: List[GroupTrainer]
  slicers: List[Any]  # per group: jitted global ModelState -> its sub-model
  templates: List[ModelState]  # per group: what an upload must look like
  label_masks: List[jax.Array]  # per group: [m, C] float32, the clients' label sets
  ce_masks: List[jax.Array]  # per group: [m, C] the objective's masks (all ones: plain CE)
  output_layer: str
  init: ModelState
  evaluator: engine.Evaluator
  group_evaluators: List[engine.Evaluator]
  bn_stats: engine.BatchNormStatistics
  group_bn_stats: List[engine.BatchNormStatistics]
  bn_x: np.ndarray  # the clients' training inputs (static BN statistics)
  aggregate: Any  # jitted submodels.scatter_average


@register_method('heterofl')
class HeteroFL(Algorithm):
  """Width-sliced sub-models of one global model, averaged entry by entry."""

  section = 'heterofl'
  Config = HeteroFLConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c = self.config
    tc.require_positive(c, self.section, ('rounds', 'local_epochs'))
    tc.require_fraction(c.participation, f'{self.section}.participation')
    tc.require_non_negative(c, self.section, ('grad_clip',))
    specs = [s for s in config.get('client_models', '').split(';') if s.strip()]
    client_rates(config.model, [s.strip() for s in specs] or [config.model])

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def setup(self, ctx: RunContext) -> HeteroFLAux:
    c, cfg, ds = self.config, ctx.run, ctx.dataset
    rates = client_rates(cfg.model, list(ctx.federation.specs))
    groups = common.client_groups(ctx)
    module = common.build_module(cfg.model, ds)
    init = engine.commit(
      engine.init_model(module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
    )
    output_layer = submodels.output_layer_name(init.params, ds.num_classes)
    spec = cfg.optimizer._replace(schedule='constant', grad_clip=c.grad_clip)
    held = class_count_table(ds.train_y, ctx.parts, ds.num_classes) > 0
    ce_masks = held if c.masked_ce else np.ones_like(held)
    slicers, templates = [], []
    for g in groups:
      shapes = model_shapes(g.module, ds.input_shape)
      submodels.check_sliceable(init, shapes, f'client model {g.spec!r}')
      slicers.append(jax.jit(functools.partial(submodels.slice_tree, template=shapes)))
      sub = submodels.slice_tree(init, shapes)
      templates.append(sub._replace(batch_stats={}) if c.static_bn else sub)
    bn_x = common.clients_training_images(ctx, range(ctx.num_clients))
    eval_batch = cfg.eval_batch_size
    return HeteroFLAux(
      groups=groups,
      rates=[rates[g.spec] for g in groups],
      trainers=[
        common.group_trainer(
          ctx,
          g.module,
          spec,
          cfg.batch_size,
          objective=(
            scaled_objective(rates[g.spec], output_layer)
            if c.scaler
            else masked_classification_objective
          ),
        )
        for g in groups
      ],
      slicers=slicers,
      templates=templates,
      label_masks=[jnp.asarray(held[g.client_ids], jnp.float32) for g in groups],
      ce_masks=[jnp.asarray(ce_masks[g.client_ids], jnp.float32) for g in groups],
      output_layer=output_layer,
      init=init,
      evaluator=engine.Evaluator(module, eval_batch, cfg.strategy),
      group_evaluators=[engine.Evaluator(g.module, eval_batch, cfg.strategy) for g in groups],
      bn_stats=engine.BatchNormStatistics(module, cfg.batch_size),
      group_bn_stats=[engine.BatchNormStatistics(g.module, cfg.batch_size) for g in groups],
      bn_x=bn_x,
      aggregate=jax.jit(submodels.scatter_average, static_argnames=('output_layer',)),
    )

  def init(self, ctx: RunContext, aux: HeteroFLAux) -> ModelState:
    return aux.init

  def _receive(self, aux: HeteroFLAux, models, weights) -> int:
    """Validates the participants' uploads; returns their serialised bytes."""
    total = 0
    for g, stacked, template, w in zip(aux.groups, models, aux.templates, weights):
      for j in np.flatnonzero(w):
        model = engine.take(stacked, int(j))
        if self.config.static_bn:
          model = model._replace(batch_stats={})
        upload = ModelUpload(int(g.client_ids[j]), int(g.fed.sizes[j]), model)
        validate_model_upload(upload, template)
      total += serialized_nbytes(template) * int(np.sum(w))
    return total

  def step(
    self, ctx: RunContext, aux: HeteroFLAux, state: ModelState, i: int
  ) -> Tuple[ModelState, List[Dict[str, Any]]]:
    """One HeteroFL round: each selected client trains its width's slice of the global model, then
    the slices are averaged where they overlap.
    """
    c = self.config
    selected = common.select_clients(
      ctx.derive_key(Purpose.SAMPLING, i), ctx.num_clients, c.participation
    )
    # Every group keeps its clients (fixed shapes: one program per group for the whole run); a
    # client that sits the round out has size 0, so it takes no step and its upload is not read.
    weights = [np.isin(g.client_ids, selected).astype(np.float32) for g in aux.groups]
    groups = [common.sitting_out_as_size_zero(g, w > 0) for g, w in zip(aux.groups, weights)]
    starts = [engine.replicate(s(state), len(g.client_ids)) for s, g in zip(aux.slicers, groups)]
    models, metrics = common.train_groups(
      aux.trainers,
      groups,
      starts,
      c.local_epochs,
      ctx.derive_key(Purpose.ROUNDS, i),
      label=f'round {i + 1}/{c.rounds}',
      contexts=aux.ce_masks,
    )
    upload_bytes = self._receive(aux, models, weights)
    params = aux.aggregate(
      state.params,
      [m.params for m in models],
      weights,
      aux.label_masks,
      output_layer=aux.output_layer,
    )
    model = ModelState(params, state.batch_stats)
    if c.static_bn:
      model = model._replace(batch_stats=aux.bn_stats(model, aux.bn_x))
    else:
      model = model._replace(
        batch_stats=aux.aggregate(state.batch_stats, [m.batch_stats for m in models], weights)
      )
    test_x, test_y = ctx.dataset.test_x, ctx.dataset.test_y
    record = {
      'round': i + 1,
      'test_accuracy': aux.evaluator.accuracy(model, test_x, test_y),
      'train_loss': float(
        np.mean(
          np.concatenate(
            [np.asarray(m.loss)[w > 0, -1] for m, w in zip(metrics, weights) if np.any(w)]
          )
        )
      ),
      'clients': int(len(selected)),
      'upload_bytes': upload_bytes,
      'download_bytes': upload_bytes,
    }
    if c.eval_submodels:
      record['submodel_test_accuracy'] = self._submodel_accuracies(aux, model, test_x, test_y)
    return model, [record]

  def _submodel_accuracies(self, aux: HeteroFLAux, model: ModelState, x, y) -> Dict[str, float]:
    out = {}
    for k, rate in enumerate(aux.rates):
      if f'{rate:g}' in out:
        continue
      sub = aux.slicers[k](model)
      if self.config.static_bn:
        sub = sub._replace(batch_stats=aux.group_bn_stats[k](sub, aux.bn_x))
      out[f'{rate:g}'] = aux.group_evaluators[k].accuracy(sub, x, y)
    return out

  def summarize(self, ctx, aux: HeteroFLAux, state, history) -> Dict[str, Any]:
    """The run summary: client model rates and accuracies."""
    rates = client_rates(ctx.run.model, list(ctx.federation.specs))
    last = history[-1] if history else {}
    return {
      'rounds': self.config.rounds,
      'client_models': list(ctx.federation.specs),
      'client_rates': [rates[s] for s in ctx.federation.specs],
      'submodel_test_accuracy': last.get('submodel_test_accuracy'),
      'output_layer': aux.output_layer,
    }
