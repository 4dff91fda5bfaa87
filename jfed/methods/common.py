"""Blocks shared by methods: client groups, local training, the FedAvg round, the server side of
model uploads (attack simulation, validation, aggregation), evaluation."""

import math
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed.api import RunContext
from jfed.data import FederatedArrays, federate
from jfed.data.federated import cohort_length
from jfed.data.transforms import NORMALIZATIONS
from jfed.engine import GroupTrainer, ModelState, attacks
from jfed.engine.aggregation import Aggregator, make_aggregator
from jfed.engine.training import LOCAL_BN_MODES
from jfed.errors import ConfigError, JfedError, NonFiniteError
from jfed.io import ModelUpload, UploadError, serialized_nbytes, validate_model_upload
from jfed.keys import Purpose
from jfed.models import get_model
from jfed.models.normalized import InputNormalized
from jfed.reporting import Progress
from jfed.run_config import (  # the shared sections' readers, where methods have found them
  clients_per_round,
)


class ClientGroup(NamedTuple):
  """Clients that share an architecture: trained as one stacked, compiled program."""

  spec: str  # model spec, e.g. 'cnn_mnist' or 'resnet18:width_mult=0.5'
  module: nn.Module
  client_ids: np.ndarray  # global client ids, in the order of `fed`'s client axis
  fed: FederatedArrays


def parse_model_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
  """'resnet18:width_mult=0.5,depth=2' -> ('resnet18', {'width_mult': 0.5, 'depth': 2})."""
  name, _, args = spec.strip().partition(':')
  kwargs = {}
  for item in filter(None, args.split(',')):
    key, sep, value = item.partition('=')
    if not sep:
      raise ValueError(f'Malformed model spec {spec!r}: expected name:key=value,...')
    try:
      kwargs[key.strip()] = int(value)
    except ValueError:
      try:
        kwargs[key.strip()] = float(value)
      except ValueError:
        kwargs[key.strip()] = value.strip()
  return name, kwargs


def with_input_normalization(module: nn.Module, dataset) -> nn.Module:
  """`module` normalising its input as `dataset.normalization` says (itself for 'none')."""
  stats = NORMALIZATIONS[getattr(dataset, 'normalization', 'none')]
  return module if stats is None else InputNormalized(module, *stats)


def build_module(spec: str, dataset) -> nn.Module:
  """The classifier of model spec `spec` ('name:key=value,...') for `dataset`'s shape, classes
  and input normalisation."""
  name, kwargs = parse_model_spec(spec)
  return with_input_normalization(
    get_model(name, dataset.num_classes, dataset.input_shape, **kwargs), dataset
  )


def single_architecture(ctx: RunContext) -> str:
  """The one model spec of all clients; parameter averaging needs exactly one."""
  specs = set(ctx.federation.specs)
  if len(specs) != 1:
    raise ConfigError(f'Parameter averaging needs one architecture; clients use {sorted(specs)}')
  return specs.pop()


# How FedAvg and FedProx draw a round's clients (`fedavg.sampler`, `fedprox.sampler`): a fixed
# number uniformly (`select_clients`), each client independently (`poisson_clients`), or a fixed
# number with probability proportional to size (`size_weighted_clients`).
CLIENT_SAMPLERS = ('uniform', 'poisson', 'size_weighted')


def select_clients(key: jax.Array, num_clients: int, participation: float) -> np.ndarray:
  """Seeded client sampling: round(participation * n) clients (at least one), sorted.

  Args:
    key: The PRNG key of the draw (one per round).
    num_clients: n, the number of clients to sample from.
    participation: The fraction of clients taking part, in (0, 1].

  Returns:
    The sampled client ids, sorted.
  """
  if not 0.0 < participation <= 1.0:
    raise ConfigError(f'participation must be in (0, 1], got {participation}')
  count = clients_per_round(num_clients, participation)
  if count == num_clients:
    return np.arange(num_clients)
  return np.sort(np.asarray(jax.random.choice(key, num_clients, (count,), replace=False)))


def poisson_clients(key: jax.Array, num_clients: int, rate: float) -> np.ndarray:
  """Poisson sampling: each client independently with probability `rate` (the cohort
  DP-FedAvg's accountant assumes); the sorted ids, as many as come, none included.

  Args:
    key: The PRNG key of the draw (one per round).
    num_clients: N.
    rate: q, in (0, 1].

  Returns:
    The sampled client ids, sorted int64.
  """
  drawn = np.asarray(jax.random.uniform(key, (num_clients,)))
  return np.flatnonzero(drawn < rate).astype(np.int64)


def size_weighted_clients(key: jax.Array, sizes, count: int) -> np.ndarray:
  """`count` distinct clients, drawn one after another, each draw picking among the clients not
  yet drawn with probability proportional to size (successive sampling, the
  `np.random.choice(..., replace=False, p=sizes / sizes.sum())` of FedProx-style code), sorted.

  Drawn in one pass by the Gumbel-top-k trick (the `count` largest log(size) + Gumbel noise),
  which has the law of successive sampling ("Stochastic Beams and Where to Find Them: The
  Gumbel-Top-k Trick for Sampling Sequences Without Replacement", Kool, van Hoof and Welling,
  ICML 2019). A client's inclusion probability is not count * size / total: for count = 2
  it is p_i + sum_{j != i} p_j p_i / (1 - p_j), with p = sizes / total.

  Args:
    key: The PRNG key of the draw (one per round).
    sizes: [N] client sizes; a client of size 0 is never drawn.
    count: How many clients, at most the number of non-empty ones.

  Returns:
    The sampled client ids, sorted int64.
  """
  sizes = np.asarray(sizes, np.float64)
  nonempty = int(np.count_nonzero(sizes > 0))
  if not 1 <= count <= nonempty:
    raise ConfigError(
      f'size-weighted sampling of {count} clients needs as many non-empty clients; '
      f'{nonempty} of {len(sizes)} hold samples'
    )
  with np.errstate(divide='ignore'):
    scores = np.log(sizes) + np.asarray(jax.random.gumbel(key, (len(sizes),)), np.float64)
  return np.sort(np.argsort(-scores, kind='stable')[:count]).astype(np.int64)


def padded_cohort(
  selected: np.ndarray, num_clients: int, rate: float
) -> Tuple[np.ndarray, np.ndarray]:
  """A Poisson cohort padded to a bucket of rows, so a round's programs compile once per bucket
  instead of once per cohort size: the cohort's size rounded up to a multiple of
  max(8, ⌈2·sd⌉) (sd of Binomial(N, q)), filled with clients outside it, who sit out (size 0,
  no upload: `fedavg_round`'s `sitting_out`).

  Args:
    selected: The sampled client ids (`poisson_clients`), at least one.
    num_clients: N.
    rate: q.

  Returns:
    (the ids of the padded cohort, sorted; [rows] bool, True for the padding).
  """
  step = max(8, math.ceil(2 * math.sqrt(num_clients * rate * (1 - rate))))
  rows = min(num_clients, -(-len(selected) // step) * step)
  others = np.setdiff1d(np.arange(num_clients), selected)[: rows - len(selected)]
  ids = np.union1d(selected, others).astype(np.int64)
  return ids, np.isin(ids, others)


def client_groups(
  ctx: RunContext, client_ids: Optional[Sequence[int]] = None, build=None
) -> List[ClientGroup]:
  """Groups the (selected) clients by architecture, in order of first appearance.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    client_ids: The clients to group (global ids); None for all.
    build: `build(spec, dataset)` makes a group's module; None for the classifier of
      `build_module`.

  Returns:
    One ClientGroup per architecture: its spec, module, client ids and their data.
  """
  build = build or build_module
  specs = list(ctx.federation.specs)
  ids = list(range(ctx.num_clients)) if client_ids is None else list(client_ids)
  flipping = ctx.federation.attackers if ctx.run.attack.kind == 'label_flip' else []
  groups = []
  for spec in dict.fromkeys(specs[k] for k in ids):
    members = np.array([k for k in ids if specs[k] == spec])
    fed = federate(ctx.dataset.train_x, ctx.dataset.train_y, [ctx.parts[k] for k in members])
    flipped = np.isin(members, flipping)
    if flipped.any():  # label-flipping attackers train on y -> C - 1 - y
      y = np.where(flipped[:, None], attacks.flip_labels(fed.y, ctx.dataset.num_classes), fed.y)
      fed = fed._replace(y=y)
    groups.append(ClientGroup(spec, build(spec, ctx.dataset), members, fed))
  return groups


def init_group_models(ctx: RunContext, groups: Sequence[ClientGroup]) -> List[ModelState]:
  """Every client of a group starts from one initial model (DENSE/FedAvg copy the global model).

  The initial model is committed (`engine.commit`) before it is copied, like the global models
  of later rounds (outputs of jitted steps): jit's cache key includes whether arguments are
  committed, so uncommitted first-round models would compile local training (and the ops
  around it) once more in round 2 of the multi-round one-shot methods.
  """
  all_specs = list(ctx.federation.architectures)
  models = []
  for g in groups:
    key = ctx.derive_key(Purpose.MODEL_INIT, all_specs.index(g.spec))
    init = engine.commit(engine.init_model(g.module, ctx.dataset.input_shape, key))
    models.append(engine.replicate(init, len(g.client_ids)))
  return models


def local_train_mode_epochs(local_bn: str, objective) -> int:
  """`GroupTrainer`'s `train_mode_epochs` for the run's `local_bn`: 1 for DENSE's
  'eval_after_first_epoch' with the classification objective, else 0 (train mode throughout;
  other objectives, such as the CVAEs', keep it)."""
  if local_bn not in LOCAL_BN_MODES:
    raise ConfigError(f'local_bn must be one of {LOCAL_BN_MODES}, got {local_bn!r}')
  if local_bn == 'eval_after_first_epoch' and objective is engine.classification_objective:
    return 1
  return 0


def group_trainer(
  ctx: RunContext,
  module: nn.Module,
  spec: engine.OptimizerSpec,
  batch_size: int,
  *,
  objective: engine.LocalObjective = engine.classification_objective,
  prox_mu: float = 0.0,
  total_steps: int = 0,
) -> GroupTrainer:
  """A local trainer of `module` with the optimiser of `spec`.

  Its optimiser is a `jfed.engine.optim.SpecOptimizer`, so its compiled programs are those of
  every trainer, of this run or another in the process, that differs from it in nothing but a
  constant learning rate (another seed, another method with the same clients, a learning-rate
  sweep): jit's own cache shares them (`jfed.engine.training.ClientProgram`), as long as the
  objective is the same object from run to run (a module-level function, or one its factory
  caches by its arguments).

  Args:
    ctx: The run (its strategy and device mesh).
    module: The clients' flax module.
    spec: The optimiser.
    batch_size: The local batch size.
    objective: The local loss (`jfed.engine.training.LocalObjective`).
    prox_mu: FedProx's proximal weight (0: plain local training).
    total_steps: The optimiser steps a schedule spans.

  Returns:
    The trainer.
  """
  return GroupTrainer(
    module,
    engine.SpecOptimizer(spec, total_steps),
    batch_size,
    prox_mu=prox_mu,
    strategy=ctx.run.strategy,
    mesh=ctx.mesh,
    objective=objective,
    train_mode_epochs=local_train_mode_epochs(ctx.run.local_bn, objective),
  )


def make_trainers(
  ctx: RunContext,
  groups: Sequence[ClientGroup],
  prox_mu: float = 0.0,
  optimizer=None,
  total_steps: int = 0,
) -> List[GroupTrainer]:
  """One local trainer per architecture of `groups`, every one with the same optimiser.

  A method builds its trainers once, in `setup`, and keeps them in its aux: a GroupTrainer's
  jitted programs belong to the instance, so a trainer built anew every round would compile
  them again every round. Groups of one architecture share one trainer.

  Args:
    ctx: the run.
    groups: the client groups.
    prox_mu: FedProx's proximal weight (0: plain local training).
    optimizer: the clients' optimiser: an `OptimizerSpec`, a config section of one (the Flower
      bridge's recipe), or None for the run's `optimizer`.
    total_steps: the optimiser steps a schedule spans (centralized training).

  Returns:
    The trainers, in the order of `groups` (the Flower bridge's when the clients train there).
  """
  cfg = ctx.run
  spec = cfg.optimizer if optimizer is None else optimizer
  if not isinstance(spec, engine.OptimizerSpec):
    spec = engine.optimizer_spec(spec)
  recipe = {  # how a Flower SuperNode builds the same trainer
    'kind': 'classifier',
    'prox_mu': float(prox_mu),
    'optimizer': spec._asdict(),
    'optimizer_steps': int(total_steps),
  }
  if cfg.dp.enabled and cfg.dp.local:  # a SuperNode privatises its clients' uploads itself
    recipe['local_dp'] = {
      'clip_norm': float(cfg.dp.clip_norm),
      'noise_multiplier': float(cfg.dp.noise_multiplier),
    }
  by_spec: Dict[str, GroupTrainer] = {}
  for g in groups:
    if g.spec in by_spec:
      continue
    if ctx.client_transport is not None:  # the clients train on Flower SuperNodes
      tx = engine.build_optimizer(spec, total_steps)
      by_spec[g.spec] = ctx.client_transport.trainer(g.spec, tx, recipe, ctx.client_sizes)
    else:
      by_spec[g.spec] = group_trainer(
        ctx, g.module, spec, cfg.batch_size, prox_mu=prox_mu, total_steps=total_steps
      )
  return [by_spec[g.spec] for g in groups]


def client_trainers(ctx: RunContext) -> Dict[str, GroupTrainer]:
  """The run's local trainers (its optimiser), one per client architecture, by model spec.

  What `local_models` and `jfed.methods.oneshot.round_uploads` train with: a method that trains
  its clients in several rounds builds these in `setup`, keeps them in its aux and passes them
  to every round, so each architecture's programs compile once per run.
  """
  specs = ctx.federation.architectures
  stubs = [ClientGroup(s, build_module(s, ctx.dataset), np.zeros(0, np.int64), None) for s in specs]
  return dict(zip(specs, make_trainers(ctx, stubs)))


def train_groups(
  trainers: Sequence[GroupTrainer],
  groups: Sequence[ClientGroup],
  models: Sequence[ModelState],
  epochs: int,
  key: jax.Array,
  anchors: Optional[Sequence[Any]] = None,
  label: str = 'local training',
  diverged: str = 'raise',
  contexts: Optional[Sequence[Any]] = None,
) -> Tuple[List[ModelState], List[engine.TrainMetrics]]:
  """Local training of every group; a fresh optimiser per call, as PyTorch FL code does.

  A client whose training loss becomes non-finite raises NonFiniteError (`diverged='raise'`),
  or is logged and left to the server to exclude (`'warn'`: its upload fails validation).
  Args:
    trainers: One trainer per group (its loss, optimizer and batch size).
    groups: The client groups to train.
    models: Per group, the clients' starting models (stacked along a leading client axis).
    epochs: Local epochs.
    key: The PRNG key of this training (shuffling, dropout).
    anchors: Per group, the parameters of FedProx's proximal term; None for none.
    label: What the training is called in logs and errors.
    diverged: 'raise' (NonFiniteError) or 'warn' for a client whose loss becomes non-finite.
    contexts: Per group, the per-client values its trainer's objective takes
      (`GroupTrainer.train`'s `context`), or None.

  Returns:
    Per group, the trained models and the training metrics.
  """
  out_models, out_metrics = [], []
  for i, (trainer, group, model) in enumerate(zip(trainers, groups, models)):
    progress = Progress(f'{label} [{group.spec} x{len(group.client_ids)}]', epochs, 'epoch')
    state = engine.init_train_state(trainer.tx, model)
    state, metrics = trainer.train(
      state,
      group.fed,
      epochs,
      key,
      anchor=None if anchors is None else anchors[i],
      progress=progress,
      client_ids=group.client_ids,
      context=None if contexts is None else contexts[i],
    )
    final_loss = np.asarray(metrics.loss)[:, -1]
    # a client whose training did not come back (its Flower SuperNode did not reply) has no loss
    replied = np.ones(len(final_loss), bool) if metrics.replied is None else metrics.replied
    bad = [
      int(c)
      for c, l, n, r in zip(group.client_ids, final_loss, group.fed.sizes, replied)
      if r and n > 0 and not np.isfinite(l)
    ]
    if bad and diverged == 'warn':
      logging.warning('%s: client(s) %s (%s) diverged (non-finite loss)', label, bad, group.spec)
    elif bad:
      raise NonFiniteError(
        f'{label}: the training loss of client(s) {bad} ({group.spec}) became '
        'non-finite; lower the learning rate or check the data'
      )
    out_models.append(state.model)
    out_metrics.append(metrics)
  return out_models, out_metrics


class EmptyRoundError(JfedError):
  """Every upload of a round was rejected, so nothing was aggregated (and the run would go on
  with an unchanged global model), and `server.allow_empty_rounds` does not allow it."""


class Server(NamedTuple):
  """The server side of a run's model uploads (`Server.receive`): the attackers' uploads are
  rewritten as the attack says, every upload is validated (a rejected one is dropped or fails
  the run), and the rest are aggregated by the run's rule."""

  aggregator: Aggregator
  attack: attacks.AttackConfig
  attackers: np.ndarray  # global client ids
  attack_key: jax.Array  # round r's draws: fold_in(attack_key, r)
  on_invalid: str  # 'drop' | 'fail'
  max_update_norm_ratio: float  # > 0: reject ||θ_k − θ_global|| > ratio · ||θ_global||
  partition_sizes: np.ndarray  # [num_clients]: a client's num_samples may not exceed its own
  allow_empty_rounds: bool = False  # False: a receive whose uploads were all rejected fails

  def receive(
    self,
    group: ClientGroup,
    stacked: ModelState,
    reference: ModelState,
    template: ModelState,
    step: int,
    weights: Optional[np.ndarray] = None,
    taking_part: Optional[np.ndarray] = None,
    declared_sizes: Optional[np.ndarray] = None,
    part: int = 0,
  ) -> Tuple[ModelState, Dict[str, Any]]:
    """Aggregate of the uploads of `group`'s clients that take part (all by default).

    Args:
      group: the clients; `group.fed.sizes` is what each uploads as num_samples.
      stacked: their trained models, stacked.
      reference: the model they started from (norm bound, update-based attacks and clipping).
      template: the structure, shapes and dtypes an upload must have.
      step: the round (the attack's draws).
      part: which of the round's aggregations this is (e.g. FedTSA's cluster): its own draws.
      weights: per client, the aggregation weights (default: the sizes).
      taking_part: [K] bool, the clients that upload this round (default: all).
      declared_sizes: [K] the most samples each may claim (default: its partition's size).

    Returns:
      The aggregate and the record fields 'upload_bytes', 'rejected_uploads' (a count) and,
      when some were rejected, 'rejected_clients'.

    Raises:
      UploadError: an upload is malformed and `on_invalid` is 'fail'.
      EmptyRoundError: every upload was rejected and `allow_empty_rounds` is False.
    """
    k = len(group.client_ids)
    taking_part = np.ones(k, bool) if taking_part is None else np.asarray(taking_part, bool)
    bounds = self.partition_sizes[group.client_ids] if declared_sizes is None else declared_sizes
    attacking = np.isin(group.client_ids, self.attackers) & taking_part
    stacked = attacks.poison_uploads(
      self.attack.kind,
      self.attack.strength,
      stacked,
      reference,
      attacking,
      jax.random.fold_in(jax.random.fold_in(self.attack_key, step), part),
    )
    ratio = self.max_update_norm_ratio if self.max_update_norm_ratio > 0 else None
    accepted, rejected, last_reason = np.zeros(k, bool), [], ''
    for i in np.flatnonzero(taking_part):
      cid = int(group.client_ids[i])
      upload = ModelUpload(cid, int(group.fed.sizes[i]), engine.take(stacked, int(i)))
      try:
        validate_model_upload(
          upload,
          template,
          max_samples=int(bounds[i]),
          reference=reference if ratio else None,
          max_update_norm_ratio=ratio,
        )
      except UploadError as e:
        if self.on_invalid == 'fail':
          raise
        logging.warning('rejected and excluded: %s', e)
        rejected.append(cid)
        last_reason = str(e)
        continue
      accepted[i] = True
    record = {
      'upload_bytes': serialized_nbytes(template) * int(taking_part.sum()),
      'rejected_uploads': len(rejected),
    }
    if rejected:
      record['rejected_clients'] = rejected
    if not accepted.any():
      if rejected and not self.allow_empty_rounds:
        uploads = (
          f'all {len(rejected)} uploads (clients {rejected}) were'
          if len(rejected) > 1
          else f'the only upload (client {rejected[0]}) was'
        )
        raise EmptyRoundError(
          f'round {step + 1}: {uploads} rejected, so nothing was aggregated (the last: '
          f'{last_reason}); set server.allow_empty_rounds=True to keep the global model in such '
          'a round'
        )
      logging.warning('every upload was rejected: the global model stays as it was')
      return reference, record
    w = np.asarray(group.fed.sizes if weights is None else weights, np.float64)
    rows = np.flatnonzero(accepted)
    if len(rows) < k:
      stacked = jax.tree.map(lambda a: a[rows], stacked)
    return self.aggregator.aggregate(stacked, w[rows], reference), record


def make_server(ctx: RunContext) -> Server:
  """The run's server, as its config says. Built once, in a method's `setup`, and kept in its
  aux: the aggregator's programs belong to the instance and compile once per shape."""
  s = ctx.run.server
  return Server(
    make_aggregator(ctx.run.aggregation),
    ctx.run.attack,
    ctx.federation.attackers,
    ctx.derive_key(Purpose.ATTACK, 1),
    s.on_invalid_upload,
    s.max_update_norm_ratio,
    ctx.client_sizes,
    s.allow_empty_rounds,
  )


def receive_uploads(
  groups: Sequence[ClientGroup], models: Sequence[ModelState], templates: Sequence[ModelState]
) -> int:
  """Server side of a model upload: validates every client's model, returns the bytes received.

  Bytes are measured by serialising one upload per group: msgpack's size depends only on the
  shapes and dtypes, which validation has just checked are the template's.

  Args:
    groups: The client groups that upload.
    models: Per group, the uploaded models (stacked along a leading client axis).
    templates: Per group, a model of the expected structure, shapes and dtypes.

  Returns:
    The bytes received from all clients.
  """
  total = 0
  for group, stacked, template in zip(groups, models, templates):
    for i, cid in enumerate(group.client_ids):
      upload = ModelUpload(int(cid), int(group.fed.sizes[i]), engine.take(stacked, i))
      validate_model_upload(upload, template)
    total += serialized_nbytes(engine.take(stacked, 0)) * len(group.client_ids)
  return total


class LocalModels(NamedTuple):
  """The uploads of one-shot methods: every client's locally trained model, per group."""

  groups: List[ClientGroup]
  models: List[ModelState]  # stacked per group
  upload_bytes: int


def local_models_settings(client_ids: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """The settings of the 'local_models' stage beyond the run's shared keys (what keys its
  subfolder of a shared `local_models_dir`, `RunContext.shared_cache_dir`)."""
  return {'client_ids': None if client_ids is None else sorted(int(k) for k in client_ids)}


def local_models(
  ctx: RunContext,
  epochs: int,
  client_ids: Optional[Sequence[int]] = None,
  trainers: Optional[Mapping[str, GroupTrainer]] = None,
) -> LocalModels:
  """Every client (or those of `client_ids`) trained for `epochs` local epochs from a shared
  init, once per run.

  A stage of the driver (`ctx.stage('local_models', epochs, ...)`): checkpointed under
  workdir/local_models, or read from `local_models_dir` when set, so an interrupted one-shot run
  and a sweep of server-side methods train the clients only once.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    epochs: Local epochs.
    client_ids: The clients to train (global ids); None for all.
    trainers: The run's trainers by model spec (`client_trainers`), for a method that trains its
      clients again in later rounds; None builds them for this training.

  Returns:
    The client groups, their trained models and the upload size in bytes.
  """
  groups = client_groups(ctx, client_ids)
  init = init_group_models(ctx, groups)

  def train():
    if trainers is None:
      group_trainers = make_trainers(ctx, groups)
    else:
      group_trainers = [trainers[g.spec] for g in groups]
    models, metrics = train_groups(
      group_trainers,
      groups,
      init,
      epochs,
      ctx.derive_key(Purpose.LOCAL_TRAINING),
    )
    for g, m in zip(groups, metrics):
      logging.info(
        'local training [%s]: final train accuracy %s',
        g.spec,
        np.round(m.accuracy[:, -1], 4).tolist(),
      )
    return list(models)

  models = ctx.stage(
    'local_models',
    epochs,
    list(init),
    train,
    directory=ctx.run.local_models_dir or None,
    settings=local_models_settings(client_ids),
  )
  upload_bytes = receive_uploads(groups, models, [engine.take(m, 0) for m in init])
  return LocalModels(groups, list(models), upload_bytes)


def sitting_out_as_size_zero(group: ClientGroup, taking_part: np.ndarray) -> ClientGroup:
  """The group with every client not `taking_part` ([K] bool) at size 0: it keeps all its
  clients (fixed shapes: one program per group for the whole run), and a size-0 client takes
  no step and has no weight in an average."""
  sizes = np.where(taking_part, group.fed.sizes, 0).astype(np.int32)
  return group._replace(fed=group.fed._replace(sizes=sizes))


def participating_group(
  ctx: RunContext, full_group: ClientGroup, selected: np.ndarray
) -> ClientGroup:
  """The group of the selected clients (the full group when every client takes part).

  Only the cohort's samples are gathered (`FederatedArrays.take`), padded to whole batches of
  the full group's largest client, so every round has the same shapes and its programs compile
  once; a cohort far smaller than that client (a cross-device federation) is padded to its own
  power-of-two bucket instead (`cohort_length`). Padded samples never change what a client
  computes.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    full_group: The group of all the clients of one architecture.
    selected: The selected client ids of this round (global ids).

  Returns:
    The group restricted to the selected clients, padded as the full group.
  """
  if len(selected) == len(full_group.client_ids):
    return full_group
  rows = np.flatnonzero(np.isin(full_group.client_ids, selected))
  fed, b = full_group.fed, int(ctx.run.batch_size)
  length = cohort_length(fed.sizes[rows], b, -(-fed.n_max // b) * b)
  return full_group._replace(client_ids=full_group.client_ids[rows], fed=fed.take(rows, length))


def _finite_mean(values: np.ndarray) -> Optional[float]:
  """The mean of the finite values (a diverged client has none), None if there are none."""
  finite = values[np.isfinite(values)]
  return float(np.mean(finite)) if finite.size else None


class RoundParts(NamedTuple):
  """What a FedAvg round trains and aggregates with: the group's local trainer, the local
  epochs, a model of the expected upload structure (for validation) and the server that receives
  and aggregates the uploads (the run's, or its DP server for the round)."""

  trainer: GroupTrainer
  epochs: int
  template: ModelState
  server: 'Server'


class RoundOptions(NamedTuple):
  """A FedAvg round's options.

  Attributes:
    weights: per-client aggregation weights; None for client sizes.
    prox_mu: FedProx's proximal coefficient; 0 for plain FedAvg.
    label: what the training is called in logs and errors.
    declared_sizes: the client sizes the clients report (an attack may lie); None for the true
      sizes.
    sitting_out: [K] bool, rows that only pad the group to a compiled shape (`padded_cohort`):
      they train nothing (size 0, `sitting_out_as_size_zero`), upload nothing and are not
      counted; None for none.
  """

  weights: Optional[np.ndarray] = None
  prox_mu: float = 0.0
  label: str = 'local training'
  declared_sizes: Optional[np.ndarray] = None
  sitting_out: Optional[np.ndarray] = None


def fedavg_round(
  parts: RoundParts,
  group: ClientGroup,
  global_model: ModelState,
  key: jax.Array,
  step: int,
  options: RoundOptions = RoundOptions(),
) -> Tuple[ModelState, Dict[str, Any]]:
  """One FedAvg round: replicate the global model, train the group, and let the server receive
  the uploads (attack, validation) and aggregate them (weighted by client size unless
  `options.weights` are given) by the run's rule.

  Args:
    parts: The trainer, local epochs, upload template and server of the round.
    group: The clients taking part in the round.
    global_model: The global model sent to them.
    key: The PRNG key of the round's local training.
    step: The round, as the server's step (attack schedule, server optimizer).
    options: The round's aggregation weights, proximal term, label, declared sizes and padding.

  Returns:
    The round's aggregate and its record fields (train_loss, clients, upload_bytes,
    download_bytes: the new global model goes back to the same clients, rejected_uploads).
  """
  trainer, epochs, template, server = parts
  weights, prox_mu, label, declared_sizes, sitting_out = options
  n = len(group.client_ids)
  padding = np.zeros(n, bool) if sitting_out is None else np.asarray(sitting_out, bool)
  if padding.any():
    group = sitting_out_as_size_zero(group, ~padding)
  starts = engine.replicate(global_model, n)
  anchors = [global_model.params] if prox_mu else None
  # Under a simulated attack, a poisoned global model can make honest training diverge: that is
  # the attack's effect to measure, so those uploads are rejected like the attackers' (with
  # drop, counted), where a clean run stops with NonFiniteError.
  diverged = 'raise' if server.attack.kind == 'none' else 'warn'
  (models,), (metrics,) = train_groups(
    [trainer], [group], [starts], epochs, key, anchors, label=label, diverged=diverged
  )
  # Clients whose training did not come back (Flower's min-supernodes) take no part, as in a
  # Flower strategy's round: the others' uploads are aggregated.
  replied = np.ones(n, bool) if metrics.replied is None else np.asarray(metrics.replied)
  new_model, received = server.receive(
    group,
    models,
    global_model,
    template,
    step,
    weights,
    taking_part=replied & ~padding,
    declared_sizes=declared_sizes,
  )
  dropped = [int(c) for c in np.asarray(group.client_ids)[~replied & ~padding]]
  return new_model, {
    'train_loss': _finite_mean(np.asarray(metrics.loss)[replied & ~padding, -1]),
    'clients': int((replied & ~padding).sum()),
    'download_bytes': serialized_nbytes(template) * int((~padding).sum()),
    **received,
    **({'dropped_clients': dropped} if dropped else {}),
  }


def client_test_logits(ctx: RunContext, local: LocalModels) -> np.ndarray:
  """Test-set logits of every client's own model, [clients, N, C] by global client id."""
  logits = None
  for g, m in zip(local.groups, local.models):
    ev = engine.Evaluator(g.module, ctx.run.eval_batch_size, ctx.run.strategy)
    group = ev.group_logits(m, ctx.dataset.test_x)
    if logits is None:
      logits = np.zeros((ctx.num_clients,) + group.shape[1:], group.dtype)
    logits[g.client_ids] = group
  return logits


def accuracy_of_logits(logits: np.ndarray, labels) -> np.ndarray:
  """Accuracy of logits [..., N, C] against labels [N], over the N axis."""
  return np.mean(np.argmax(logits, -1) == np.asarray(labels), axis=-1)


def client_accuracies(ctx: RunContext, local: LocalModels) -> np.ndarray:
  """Test accuracy of every client's own model, indexed by global client id."""
  return accuracy_of_logits(client_test_logits(ctx, local), ctx.dataset.test_y)


def test_accuracy(ctx: RunContext, module, model: ModelState, evaluator=None) -> float:
  """A model's accuracy on the run's test set.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    module: The model's flax module.
    model: Its parameters and batch statistics.
    evaluator: An Evaluator to reuse (its compiled programs); None builds one.

  Returns:
    The accuracy, in [0, 1].
  """
  ev = evaluator or engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy)
  return ev.accuracy(model, ctx.dataset.test_x, ctx.dataset.test_y)


def client_probabilities(ctx: RunContext, local: LocalModels, x: np.ndarray) -> np.ndarray:
  """Softmax outputs of every client's own model on x, indexed by global client id.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    local: The clients' models.
    x: Inputs, [n, H, W, C].

  Returns:
    Probabilities, [m clients, n, C classes].
  """
  out = np.zeros((ctx.num_clients, len(x), ctx.dataset.num_classes), np.float32)
  for g, models in zip(local.groups, local.models):
    ev = engine.Evaluator(g.module, ctx.run.eval_batch_size, ctx.run.strategy)
    out[g.client_ids] = np.asarray(jax.nn.softmax(jnp.asarray(ev.group_logits(models, x)), -1))
  return out


# How a server model aggregated from clients gets its BatchNorm running statistics. 'averaged':
# the clients' running statistics averaged with the weights (what FedAvg code that averages a
# model's whole state does; the default). 'recomputed': statistics of the aggregated weights
# themselves, the mean over batches of each batch's statistics on the clients' training images
# (HeteroFL's static BN query, diaoenmao/HeteroFL `stats`): the average of clients' running
# statistics is not the statistics of the averaged weights, and on non-IID clients it can cost
# tens of points from one round to the next (experiments.bn_check).
BN_STATS = ('averaged', 'recomputed')


class BatchNormRecompute(NamedTuple):
  """The 'recomputed' BN statistics of one architecture on a fixed set of clients' images."""

  statistics: engine.BatchNormStatistics
  images: np.ndarray

  def __call__(self, model: ModelState) -> ModelState:
    return model._replace(batch_stats=self.statistics(model, self.images))


def clients_training_images(ctx: RunContext, client_ids: Sequence[int]) -> np.ndarray:
  """The training images of `client_ids`, client after client."""
  rows = [np.asarray(ctx.parts[int(k)], np.int64) for k in client_ids]
  return ctx.dataset.train_x[np.concatenate(rows)]


def bn_recompute(
  ctx: RunContext, module, client_ids: Sequence[int], bn_stats: str
) -> Optional[BatchNormRecompute]:
  """The recomputation a method's `bn_stats` asks for, in batches of the clients' batch size.

  Args:
    ctx: The run context (dataset, clients, run config).
    module: The aggregated model's flax module.
    client_ids: The clients whose training images give the statistics (those the model serves).
    bn_stats: The method's setting, one of BN_STATS.

  Returns:
    The recomputation, or None for 'averaged'.
  """
  if bn_stats == 'averaged':
    return None
  statistics = engine.BatchNormStatistics(module, ctx.run.batch_size)
  return BatchNormRecompute(statistics, clients_training_images(ctx, client_ids))
