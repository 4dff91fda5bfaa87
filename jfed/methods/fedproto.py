"""FedProto (Tan et al., AAAI'22; yuetan031/FedProto lib/update.py, lib/utils.py,
`github.com/yuetan031/FedProto`): clients of any architectures exchange class prototypes instead of
models. A baseline of FedTSA (Fan et al., ECCV 2024, §5.1, Tables 3–4).

A prototype is a client model's penultimate embedding, the input of its classifier layer
(`jfed.models.layers.apply_with_features`; the reference's CNNMnist: the 50-d ReLU output of
fc1). Every client keeps its own model (personalised, never averaged); each client model starts
from its own random init. Each round (`participation` of the clients, seeded):
1. each selected client trains `local_epochs` epochs on its data with
   CE + ld · MSE(embedding, global_proto[y]): the MSE is the mean over all B·D elements of the
   batch, with the rows of classes that have no global prototype yet counting as zero (the
   reference's `loss_mse(proto_new, protos)`), ld = 1;
2. it uploads its local prototypes, the per-class means of the embeddings its training computed
   in the last local epoch's batches (train mode, each batch's features before that batch's
   step: the reference's `agg_protos_label`, reset every epoch), and its class counts
   (`PrototypeUpload`, validated);
3. the server's global prototype of a class is the unweighted mean over the clients that hold
   the class (the reference's `proto_aggregation`).
One compiled program per architecture group; the global prototypes reach every client as the
objective's `context`, so new prototypes compile nothing.

Embedding widths must match across clients: the reference's heterogeneous clients differ before
a prototype layer of one width (CNNMnist's 50-wide fc1 after convolutions of 18, 20 or 22
channels). With `widest_features` (default) every client model's layer feeding the classifier
(the MLP's last hidden layer, ResNet-18's last stage) is built at the widest client's width and
every other layer keeps its own width. `embed_dim` > 0 instead adds a ReLU embedding layer of
that width to every model (the `embed_dim` option of ResNet-18, MLP and CNNMnist), a layer the
reference does not have.

Evaluation (every round, on the test split; the reference evaluates each client on its own
test split of its own classes, which we do not have, so we report both readings):
  test_accuracy              mean over clients of the client model's accuracy on the whole test
                             set (argmax of its logits);
  proto_test_accuracy        mean over clients of the nearest-global-prototype accuracy on the
                             whole test set (the class whose global prototype has the smallest
                             MSE to the client's embedding);
  local_test_accuracy        as test_accuracy, on the test samples of the client's own classes
                             (the reference's accuracy "w/o protos" on a per-client split);
  local_proto_test_accuracy  nearest global prototype among the client's own classes, on those
                             samples (the reference's accuracy "with protos").

`prototypes='after_training'` computes the local prototypes instead from the trained model's
train-mode embeddings of the client's data after local training (batches of `batch_size`, in
order, no dropout). Differences from the reference: the last batch is padded, not dropped
(`drop_last=True` in the reference); local optimiser and batch size come from
`config.optimizer` / `config.batch_size` (the reference: SGD lr 0.01, momentum 0.5, batch 4).

Config (`config.fedproto`): the fields of `FedProtoConfig`.
"""

import functools
from typing import Any, Dict, List, NamedTuple, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data import class_count_table
from jfed.engine import GroupTrainer, ModelState
from jfed.engine.training import supervised_loss
from jfed.errors import ConfigError, NonFiniteError
from jfed.io import PrototypeUpload, serialized_nbytes, validate_prototype_upload
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method
from jfed.models import get_model
from jfed.models.layers import apply_with_features

PROTOTYPES = ('last_epoch', 'after_training')
# The key under which a model's batch_stats carry the running class sums of its embeddings
# while the last local epoch trains (stripped before the model is used anywhere else).
CLASS_SUMS = 'fedproto_class_sums'


class FedProtoConfig(NamedTuple):
  rounds: int = 100
  local_epochs: int = 1
  participation: float = 1.0
  ld: float = 1.0
  prototypes: str = 'last_epoch'
  widest_features: bool = True
  embed_dim: int = 0


class GlobalPrototypes(NamedTuple):
  prototypes: Any  # [C, D] float32; zero for a class without a global prototype
  support: Any  # [C] int32: the clients whose upload held the class (0: no prototype)


class FedProtoState(NamedTuple):
  models: Tuple[ModelState, ...]  # per architecture group, stacked over its clients
  protos: GlobalPrototypes


def prototype_mse(features, labels, weights, protos: GlobalPrototypes):
  """Σ over the real samples whose class has a global prototype of ||f_i − p_{y_i}||², over
  (real samples · D): the reference's MSE with every other row counting as zero.

  Args:
    features: The embeddings, [B, D].
    labels: Their classes, [B].
    weights: [B] sample weights (0 for padded rows).
    protos: The global prototypes and which classes have one.

  Returns:
    The loss (a scalar).
  """
  has = (protos.support[labels] > 0) & (weights > 0)
  sq = jnp.sum(jnp.square(features - protos.prototypes[labels]), axis=-1)
  count = jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.sum(jnp.where(has, sq, 0.0)) / (count * features.shape[-1])


@functools.lru_cache(maxsize=None)  # one objective per ld: runs share its trainer's programs
def fedproto_objective(ld: float):
  """The engine's `LocalObjective` of a FedProto client: CE + ld · `prototype_mse`; `context`
  is the client's copy of the `GlobalPrototypes`. When the model's batch_stats carry
  `CLASS_SUMS` ({'sums': [C, D], 'counts': [C]}), the batch's embeddings (as computed for the
  loss, before the step) are added to them per class: the reference's prototype collection."""

  def objective(module, params, batch_stats, x, y, weights, key, context):
    own_stats = {k: v for k, v in batch_stats.items() if k != CLASS_SUMS}
    logits, features, new_stats = apply_with_features(
      module,
      {'params': params, 'batch_stats': own_stats},
      x,
      train=True,
      mask=weights > 0,
      rngs={'dropout': key},
    )
    ce, correct, count = supervised_loss(logits, y, weights)
    loss = ce + ld * prototype_mse(features, y, weights, context)
    if CLASS_SUMS in batch_stats:
      sums = batch_stats[CLASS_SUMS]
      onehot = jax.nn.one_hot(y, sums['counts'].shape[-1]) * weights[:, None]
      seen = jnp.where(weights[:, None] > 0, lax.stop_gradient(features), 0.0)
      new_stats = {
        **new_stats,
        CLASS_SUMS: {
          'sums': sums['sums'] + onehot.T @ seen,
          'counts': sums['counts'] + onehot.sum(0),
        },
      }
    return loss, (loss, correct, count, new_stats)

  return objective


def with_class_sums(models: ModelState, num_classes: int, dim: int) -> ModelState:
  """A stacked group's models with zeroed `CLASS_SUMS` in their batch_stats.

  Args:
    models: A group's models, stacked along a leading client axis.
    num_classes: C, the number of classes.
    dim: D, the embedding width.

  Returns:
    The models with zeroed [C, D] class sums (and counts) to accumulate local prototypes in.
  """
  m = jax.tree.leaves(models.params)[0].shape[0]
  stats = {k: v for k, v in models.batch_stats.items() if k != CLASS_SUMS}
  stats[CLASS_SUMS] = {
    'sums': jnp.zeros((m, num_classes, dim), jnp.float32),
    'counts': jnp.zeros((m, num_classes), jnp.float32),
  }
  return models._replace(batch_stats=stats)


def without_class_sums(models: ModelState) -> Tuple[ModelState, np.ndarray]:
  """(the models without `CLASS_SUMS`, [m, C, D] class means of what was collected; zero rows
  for classes not seen)."""
  stats = dict(models.batch_stats)
  sums = stats.pop(CLASS_SUMS)
  counts = np.asarray(sums['counts'])
  means = np.asarray(sums['sums']) / np.maximum(counts, 1.0)[..., None]
  return models._replace(batch_stats=stats), means.astype(np.float32)


def aggregate_prototypes(prototypes: np.ndarray, counts: np.ndarray) -> GlobalPrototypes:
  """Global prototypes from the uploads: [K, C, D] class means and [K, C] counts of K clients;
  a class's prototype is the unweighted mean over the clients with a positive count."""
  holds = np.asarray(counts) > 0
  support = holds.sum(0)
  total = np.einsum('kc,kcd->cd', holds.astype(np.float32), np.asarray(prototypes, np.float32))
  protos = total / np.maximum(support, 1)[:, None]
  return GlobalPrototypes(protos.astype(np.float32), support.astype(np.int32))


def nearest_prototype(features: np.ndarray, protos: GlobalPrototypes, allowed=None) -> np.ndarray:
  """[..., N] the class whose global prototype is nearest (smallest MSE) to each embedding
  [..., N, D], among the classes with a prototype (and in `allowed` [C] when given).

  Args:
    features: Embeddings, [..., N, D].
    protos: The global prototypes and which classes have one.
    allowed: A [C] bool mask of the classes that may be predicted; None for all.

  Returns:
    The predicted classes, [..., N].
  """
  p = np.asarray(protos.prototypes, np.float32)
  f = np.asarray(features, np.float32)
  # MSE(f, p) = (|f|² - 2 f·p + |p|²) / D, of which |f|² and 1/D are the same for every class:
  # the argmin needs -2 f·p + |p|² alone (the broadcast difference [..., N, C, D] took 1.6 GB and
  # most of a round for 20 clients on Fashion-MNIST's test split).
  score = np.sum(np.square(p), -1) - 2.0 * (f @ p.T)  # [..., N, C]
  ok = np.asarray(protos.support) > 0
  if allowed is not None:
    ok = ok & np.asarray(allowed, bool)
  return np.argmin(np.where(ok, score, np.inf), axis=-1)


class ClassMeans:
  """Per-client class means of the embeddings of a group's own training data, in train mode
  (BatchNorm on each batch's statistics, as the reference's prototypes, which it collects while
  training): one batch of every client per call, compiled once per architecture."""

  def __init__(self, module, num_classes: int, chunk: int, strategy: str):
    self.module, self.num_classes, self.chunk = module, num_classes, int(chunk)
    mapped = (
      (lambda f, args: lax.map(lambda a: f(*a), args))
      if engine.resolve_strategy(strategy) == 'loop'
      else (lambda f, args: jax.vmap(f)(*args))
    )
    self._sums = jax.jit(
      lambda total, models, x, y, w: total + mapped(self._one, (models, x, y, w))
    )

  def _one(self, model: ModelState, x, y, w):
    _, features, _ = apply_with_features(self.module, model.variables(), x, train=True, mask=w > 0)
    # A batch of padding only has no statistics (0/0): keep its rows out of the sums.
    features = jnp.where(w[:, None] > 0, features, 0.0)
    onehot = jax.nn.one_hot(y, self.num_classes) * w[:, None]
    return onehot.T @ features  # [C, D]

  def __call__(self, models: ModelState, fed, dim: int) -> np.ndarray:
    """[m, C, D] class means (zero rows for classes a client lacks)."""
    m, n_max = fed.y.shape[:2]
    total = jnp.zeros((m, self.num_classes, dim), jnp.float32)
    positions = np.arange(n_max)
    real = (positions[None] < np.asarray(fed.sizes)[:, None]).astype(np.float32)
    for s in range(0, n_max, self.chunk):
      sl = slice(s, s + self.chunk)
      x, y, w = fed.x[:, sl], fed.y[:, sl], real[:, sl]
      pad = self.chunk - x.shape[1]
      if pad:  # every call has the same shapes
        x = np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        y, w = np.pad(y, [(0, 0), (0, pad)]), np.pad(w, [(0, 0), (0, pad)])
      total = self._sums(total, models, jnp.asarray(x), jnp.asarray(y), jnp.asarray(w))
    counts = np.stack(
      [np.bincount(fed.y[k, : fed.sizes[k]], minlength=self.num_classes) for k in range(m)]
    )
    return np.asarray(total) / np.maximum(counts, 1)[..., None]


def feature_dim(module, input_shape) -> int:
  """The width of `module`'s penultimate features (nothing is computed)."""
  x = jnp.zeros((2, *input_shape), jnp.float32)
  shapes = jax.eval_shape(
    lambda k: apply_with_features(module, module.init(k, x, train=False), x)[1],
    jax.random.PRNGKey(0),
  )
  return int(shapes.shape[-1])


class FedProtoAux(NamedTuple):
  groups: List[common.ClientGroup]
  trainers: List[GroupTrainer]
  evaluators: List[engine.Evaluator]
  class_means: List[ClassMeans]
  counts: np.ndarray  # [clients, C] the partition's class counts
  dim: int
  init: FedProtoState


@register_method('fedproto')
class FedProto(Algorithm):
  """Personalised models of any architectures regularised towards global class prototypes."""

  section = 'fedproto'
  label_flip_unsupported = (
    "a flipped client's prototypes would fail the server's check against the label counts it "
    'declares (those of its unflipped labels)'
  )
  Config = FedProtoConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c = self.config
    tc.require_positive(c, self.section, ('rounds', 'local_epochs'))
    tc.require_fraction(c.participation, f'{self.section}.participation')
    tc.require_non_negative(c, self.section, ('ld', 'embed_dim'))
    tc.require_choice(c.prototypes, PROTOTYPES, f'{self.section}.prototypes')

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def _build(self, spec: str, dataset):
    name, kwargs = common.parse_model_spec(spec)
    if self.config.embed_dim:
      kwargs['embed_dim'] = self.config.embed_dim
    try:
      return common.with_input_normalization(
        get_model(name, dataset.num_classes, dataset.input_shape, **kwargs), dataset
      )
    except TypeError as e:
      raise ConfigError(
        f'fedproto.embed_dim={self.config.embed_dim}: model {spec!r} has no embed_dim option ({e})'
      ) from None

  def _widest_features_build(self, ctx: RunContext):
    """A `build` whose models feed their classifier from a layer of the widest client model's
    feature width (the MLP's last hidden layer, ResNet-18's last stage); the other layers keep
    each model's own widths."""
    ds = ctx.dataset
    plain = {s: self._build(s, ds) for s in ctx.federation.architectures}
    dims = {s: feature_dim(m, ds.input_shape) for s, m in plain.items()}
    width = max(dims.values())

    def build(spec: str, dataset):
      module = plain[spec]
      if dims[spec] == width:
        return module
      inner = getattr(module, 'inner', module)  # under `dataset.normalization`'s wrapper
      if hasattr(inner, 'widths'):  # ResNet: the pooled last stage is the feature
        widened = inner.clone(widths=tuple(inner.widths[:-1]) + (width,))
        return common.with_input_normalization(widened, dataset)
      if getattr(inner, 'hidden', ()):  # MLP / CNN with FC layers: the last hidden layer
        widened = inner.clone(hidden=tuple(inner.hidden[:-1]) + (width,))
        return common.with_input_normalization(widened, dataset)
      raise ConfigError(
        f'fedproto.widest_features: model {spec!r} has no layer to widen to the feature width '
        f'{width} of the other clients; set fedproto.embed_dim > 0'
      )

    return build

  def setup(self, ctx: RunContext) -> FedProtoAux:
    cfg, ds = ctx.run, ctx.dataset
    widen = self.config.widest_features and not self.config.embed_dim
    build = self._widest_features_build(ctx) if widen else self._build
    groups = common.client_groups(ctx, build=build)
    dims = {g.spec: feature_dim(g.module, ds.input_shape) for g in groups}
    if len(set(dims.values())) != 1:
      raise ConfigError(
        f'fedproto needs one embedding width across client models, got {dims}; set '
        'fedproto.widest_features=True or fedproto.embed_dim > 0'
      )
    dim = dims[groups[0].spec]
    all_specs = list(ctx.federation.architectures)
    models = tuple(
      engine.commit(
        engine.init_models(
          g.module,
          ds.input_shape,
          ctx.derive_key(Purpose.MODEL_INIT, all_specs.index(g.spec)),
          len(g.client_ids),
          same_init=False,
        )
      )
      for g in groups
    )
    protos = GlobalPrototypes(
      jnp.zeros((ds.num_classes, dim), jnp.float32), jnp.zeros((ds.num_classes,), jnp.int32)
    )
    objective = fedproto_objective(self.config.ld)
    return FedProtoAux(
      groups=groups,
      trainers=[
        common.group_trainer(ctx, g.module, cfg.optimizer, cfg.batch_size, objective=objective)
        for g in groups
      ],
      evaluators=[engine.Evaluator(g.module, cfg.eval_batch_size, cfg.strategy) for g in groups],
      class_means=[
        ClassMeans(g.module, ds.num_classes, cfg.batch_size, cfg.strategy) for g in groups
      ],
      counts=class_count_table(ds.train_y, ctx.parts, ds.num_classes).astype(np.int32),
      dim=dim,
      init=FedProtoState(models, protos),
    )

  def init(self, ctx: RunContext, aux: FedProtoAux) -> FedProtoState:
    return aux.init

  def step(
    self, ctx: RunContext, aux: FedProtoAux, state: FedProtoState, i: int
  ) -> Tuple[FedProtoState, List[Dict[str, Any]]]:
    """One FedProto round: local training with the prototype regulariser, then new global
    prototypes.
    """
    c = self.config
    selected = common.select_clients(
      ctx.derive_key(Purpose.SAMPLING, i), ctx.num_clients, c.participation
    )
    # Groups keep their clients (one program per group for the run); a client that sits the
    # round out has size 0: it takes no step, keeps its model and uploads nothing.
    weights = [np.isin(g.client_ids, selected) for g in aux.groups]
    groups = [common.sitting_out_as_size_zero(g, w) for g, w in zip(aux.groups, weights)]
    protos = jax.device_put(state.protos)  # host arrays after round 1: no program, unlike jnp
    contexts = [engine.replicate(protos, len(g.client_ids)) for g in groups]
    key = ctx.derive_key(Purpose.ROUNDS, i)
    if c.prototypes == 'last_epoch':
      models, metrics, collected = self._train_collecting(aux, groups, state.models, key, contexts)
    else:
      models, metrics = common.train_groups(
        aux.trainers,
        groups,
        list(state.models),
        c.local_epochs,
        key,
        label=f'round {i + 1}/{c.rounds}',
        contexts=contexts,
      )
      collected = [
        means_of(m, g.fed, aux.dim) for g, m, means_of in zip(aux.groups, models, aux.class_means)
      ]
    uploaded, counts, upload_bytes = [], [], 0
    num_classes = ctx.dataset.num_classes
    for g, w, means in zip(aux.groups, weights, collected):
      means = np.asarray(means, np.float32)
      for j in np.flatnonzero(w):
        cid = int(g.client_ids[j])
        upload = PrototypeUpload(cid, int(g.fed.sizes[j]), means[j], aux.counts[cid])
        validate_prototype_upload(upload, num_classes, aux.dim)
        upload_bytes += serialized_nbytes(upload._asdict())
        uploaded.append(upload.prototypes)
        counts.append(upload.label_counts)
    new_protos = aggregate_prototypes(np.stack(uploaded), np.stack(counts))
    state = FedProtoState(tuple(models), new_protos)
    record = {
      'round': i + 1,
      **self._evaluate(ctx, aux, state),
      'train_loss': float(
        np.mean(np.concatenate([np.asarray(m.loss)[w, -1] for m, w in zip(metrics, weights)]))
      ),
      'classes_with_prototype': int(np.sum(new_protos.support > 0)),
      'clients': int(len(selected)),
      'upload_bytes': upload_bytes,
      'download_bytes': serialized_nbytes(new_protos) * int(len(selected)),
    }
    return state, [record]

  def _train_collecting(self, aux: FedProtoAux, groups, models, key, contexts):
    """Local training of every group with one optimiser for all local epochs, collecting the
    class sums of the embeddings during the last epoch; returns (models, metrics, [m, C, D]
    local prototypes per group)."""
    c = self.config
    num_classes = int(aux.counts.shape[1])
    out_models, out_metrics, out_means = [], [], []
    for trainer, g, model, context in zip(aux.trainers, groups, models, contexts):
      ts = engine.init_train_state(trainer.tx, with_class_sums(model, num_classes, aux.dim))
      losses = []
      if c.local_epochs > 1:
        ts, first = trainer.train(
          ts, g.fed, c.local_epochs - 1, key, client_ids=g.client_ids, context=context
        )
        losses.append(np.asarray(first.loss))
        ts = ts._replace(model=with_class_sums(ts.model, num_classes, aux.dim))
      last_key = jax.random.fold_in(key, c.local_epochs - 1)
      ts, last = trainer.train(ts, g.fed, 1, last_key, client_ids=g.client_ids, context=context)
      losses.append(np.asarray(last.loss))
      trained, means = without_class_sums(ts.model)
      final = np.asarray(last.loss)[:, -1]
      bad = [
        int(k) for k, l, n in zip(g.client_ids, final, g.fed.sizes) if n > 0 and not np.isfinite(l)
      ]
      if bad:
        raise NonFiniteError(
          f'fedproto: the training loss of client(s) {bad} ({g.spec}) became non-finite; lower '
          'the learning rate or check the data'
        )
      out_models.append(trained)
      out_metrics.append(engine.TrainMetrics(loss=np.concatenate(losses, axis=1), accuracy=None))
      out_means.append(means)
    return out_models, out_metrics, out_means

  def _evaluate(self, ctx: RunContext, aux: FedProtoAux, state: FedProtoState) -> Dict[str, Any]:
    x, y = ctx.dataset.test_x, np.asarray(ctx.dataset.test_y)
    held = aux.counts > 0  # [clients, C]
    acc = np.zeros(ctx.num_clients)
    proto_acc = np.zeros(ctx.num_clients)
    local_acc = np.zeros(ctx.num_clients)
    local_proto_acc = np.zeros(ctx.num_clients)
    for g, ev, models in zip(aux.groups, aux.evaluators, state.models):
      logits, features = ev.group_outputs(models, x)
      pred = np.argmax(logits, -1)
      proto_pred = nearest_prototype(features, state.protos)
      for j, cid in enumerate(g.client_ids):
        own = held[cid][y]  # the test samples of the client's classes
        local = nearest_prototype(features[j][own], state.protos, held[cid])
        acc[cid] = np.mean(pred[j] == y)
        proto_acc[cid] = np.mean(proto_pred[j] == y)
        local_acc[cid] = np.mean(pred[j][own] == y[own]) if own.any() else 0.0
        local_proto_acc[cid] = np.mean(local == y[own]) if own.any() else 0.0
    return {
      'test_accuracy': float(acc.mean()),
      'proto_test_accuracy': float(proto_acc.mean()),
      'local_test_accuracy': float(local_acc.mean()),
      'local_proto_test_accuracy': float(local_proto_acc.mean()),
      'client_test_accuracy': acc.tolist(),
    }

  def summarize(self, ctx, aux: FedProtoAux, state: FedProtoState, history) -> Dict[str, Any]:
    """The run summary: client models and final accuracies."""
    last = history[-1] if history else {}
    return {
      'rounds': self.config.rounds,
      'client_models': list(ctx.federation.specs),
      'embedding_dim': aux.dim,
      'client_test_accuracy': last.get('client_test_accuracy'),
      **{
        k: last.get(k)
        for k in ('proto_test_accuracy', 'local_test_accuracy', 'local_proto_test_accuracy')
      },
    }
