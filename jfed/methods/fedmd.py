"""FedMD (Li & Wang, NeurIPS'19 workshop; diogenes0319/FedMD_clean FedMD.py and
conf/CIFAR_balance_conf.json; `github.com/diogenes0319/FedMD_clean`, unofficial): heterogeneous
clients distil from the consensus of their logits on a public dataset. A baseline of FedTSA (Fan
et al., ECCV 2024, §5.1, Tables 3–4).

Setup (a stage of the driver, checkpointed under workdir/fedmd_transfer): transfer learning.
Every architecture's model is trained on the labelled public data (`public_epochs`, batch
`public_batch`), copied to its clients, and each client trains on its private data
(`private_epochs`, batch `private_batch`). The public data (`jfed.data.public`): 'holdout'
draws `public_size` labelled images from the training samples held out of every client
(`dataset.holdout_size`), or a dataset name takes its training split (resized; labels must be
classes of the main dataset), as the reference's public sets are other datasets (MNIST for
FEMNIST clients, CIFAR-10 for CIFAR-100 clients). The test split is for scoring only.

Each round (every client takes part, as in the reference):
1. a new alignment subset of `alignment_size` public images (seeded per round);
2. every client uploads its logits on it (`LogitsUpload`, validated); the consensus is their
   mean (pre-softmax logits);
3. digest: each client fits the consensus with the L1 loss (Keras 'mean_absolute_error': the
   mean over classes and samples) for `digest_epochs` epochs of batch `digest_batch`;
4. revisit: each client trains on its private data for `revisit_epochs` epochs of batch
   `revisit_batch`.
Every stage uses `optimizer`: 'client' (default) is config.optimizer, the client optimiser of
every other method of a comparison (so that a lead is FedMD's and not its optimiser's); 'adam'
is the reference's Adam at `lr`. Every group of clients of one architecture is one compiled
program per stage. Reported: `test_accuracy` = the mean over clients of each client model's
accuracy on the whole test split (the reference reports each party's accuracy),
`client_test_accuracy`; the setup record (step 0) holds the same after transfer learning.

Differences from the reference: the public pre-training runs once per architecture (the
reference's parties each have their own architecture, so it trains once per architecture too;
clients sharing an architecture here share that pre-trained start); no early stopping in the
transfer-learning stages; each stage starts a fresh optimiser (Keras keeps a model's optimiser
state across `fit` calls).

Config (`config.fedmd`): the fields of `FedMDConfig`.
"""

from typing import Any, Dict, List, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data import FederatedArrays, federate
from jfed.data.public import PublicData, check_holdout_fits, public_data
from jfed.engine import GroupTrainer, ModelState
from jfed.errors import ConfigError
from jfed.io import LogitsUpload, serialized_nbytes, validate_logits_upload
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method

OPTIMIZERS = ('client', 'adam')


class FedMDConfig(NamedTuple):
  rounds: int = 20
  public: str = 'holdout'
  public_size: int = 5000
  public_epochs: int = 20
  public_batch: int = 128
  private_epochs: int = 25
  private_batch: int = 32
  alignment_size: int = 5000
  digest_epochs: int = 1
  digest_batch: int = 256
  revisit_epochs: int = 4
  revisit_batch: int = 5
  # 'client': config.optimizer in every stage (the client optimiser of every other method
  # of a comparison); 'adam': the reference's Adam at `lr`
  optimizer: str = 'client'
  lr: float = 1e-3


def consensus_logits(logits: Any) -> Any:
  """The server's consensus: the mean over clients of their logits [K, N, C] -> [N, C]."""
  return jnp.mean(jnp.asarray(logits, jnp.float32), axis=0)


def l1_loss(logits, targets, weights):
  """Keras 'mean_absolute_error' over the real samples: mean over classes, then samples.

  Args:
    logits: The client's logits, [B, C].
    targets: The consensus logits, [B, C].
    weights: [B] sample weights (0 for padded rows).

  Returns:
    The loss (a scalar).
  """
  per_example = jnp.mean(jnp.abs(logits - targets), axis=-1)
  return jnp.sum(per_example * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def digest_objective(module, params, batch_stats, x, y, weights, key):
  """The engine's `LocalObjective` of FedMD's digest: L1 between the client's logits and the
  consensus logits `y` [B, C]; 'correct' counts agreements of their argmax.

  Args:
    module: The client's flax module.
    params: Its parameters.
    batch_stats: Its BatchNorm statistics.
    x: A batch of inputs, [B, H, W, C].
    y: The consensus logits, [B, C].
    weights: [B] sample weights (0 for padded rows).
    key: The PRNG key of the step (dropout).

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
  loss = l1_loss(logits, y, weights)
  count = jnp.sum(weights)
  correct = jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(y, -1)) * weights)
  return loss, (loss, correct, count, updates.get('batch_stats', batch_stats))


class FedMDAux(NamedTuple):
  public: PublicData
  groups: List[common.ClientGroup]
  digest: List[GroupTrainer]
  revisit: List[GroupTrainer]
  evaluators: List[engine.Evaluator]
  init: Tuple[ModelState, ...]  # after transfer learning, per group stacked
  transfer_accuracy: np.ndarray  # [clients] test accuracy after transfer learning


@register_method('fedmd')
class FedMD(Algorithm):
  """Transfer learning, then rounds of consensus-logit digest and private revisit."""

  section = 'fedmd'
  Config = FedMDConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(
      c,
      where,
      (
        'rounds',
        'public_size',
        'public_batch',
        'private_batch',
        'alignment_size',
        'digest_epochs',
        'digest_batch',
        'revisit_batch',
        'lr',
      ),
    )
    tc.require_non_negative(c, where, ('public_epochs', 'private_epochs', 'revisit_epochs'))
    tc.require(
      c.alignment_size <= c.public_size,
      f'fedmd.alignment_size={c.alignment_size} exceeds fedmd.public_size={c.public_size}',
    )
    tc.require_choice(c.optimizer, OPTIMIZERS, f'{where}.optimizer')
    check_holdout_fits(config, c.public, c.public_size, f'{where}.public')

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def _optimizer(self, ctx: RunContext) -> engine.OptimizerSpec:
    if self.config.optimizer == 'adam':
      return engine.OptimizerSpec('adam', self.config.lr)
    return ctx.run.optimizer

  def setup(self, ctx: RunContext) -> FedMDAux:
    c, cfg, ds = self.config, ctx.run, ctx.dataset
    public = public_data(ds, c.public, c.public_size, cfg.seed)
    if np.max(public.y) >= ds.num_classes:
      raise ConfigError(
        f'fedmd.public={c.public!r} has labels up to {int(np.max(public.y))}, beyond the '
        f'{ds.num_classes} classes of {ds.name}'
      )
    groups = common.client_groups(ctx)
    spec = self._optimizer(ctx)
    trainers: Dict[Tuple[str, int, str], GroupTrainer] = {}

    def trainer(g: common.ClientGroup, batch: int, kind: str) -> GroupTrainer:
      # Stages with the same batch size and loss share one trainer, hence one program.
      key = (g.spec, batch, kind)
      if key not in trainers:
        objective = digest_objective if kind == 'digest' else engine.classification_objective
        trainers[key] = common.group_trainer(ctx, g.module, spec, batch, objective=objective)
      return trainers[key]

    revisit = [trainer(g, c.revisit_batch, 'ce') for g in groups]
    digest = [trainer(g, c.digest_batch, 'digest') for g in groups]
    evaluators = [engine.Evaluator(g.module, cfg.eval_batch_size, cfg.strategy) for g in groups]
    all_specs = list(ctx.federation.architectures)
    inits = [
      engine.commit(
        engine.init_model(
          g.module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, all_specs.index(g.spec))
        )
      )
      for g in groups
    ]

    def transfer() -> List[ModelState]:
      pub = federate(public.x, public.y, [np.arange(len(public.y))])
      out = []
      for k, (g, init) in enumerate(zip(groups, inits)):
        model = init
        if c.public_epochs:
          pub_group = common.ClientGroup(g.spec, g.module, np.array([all_specs.index(g.spec)]), pub)
          (trained,), _ = common.train_groups(
            [trainer(g, c.public_batch, 'ce')],
            [pub_group],
            [engine.replicate(init, 1)],
            c.public_epochs,
            ctx.derive_key(Purpose.PUBLIC_TRAINING),
            label='transfer learning: public data',
          )
          model = engine.take(trained, 0)
        models = engine.replicate(model, len(g.client_ids))
        if c.private_epochs:
          (models,), _ = common.train_groups(
            [trainer(g, c.private_batch, 'ce')],
            [g],
            [models],
            c.private_epochs,
            ctx.derive_key(Purpose.LOCAL_TRAINING),
            label='transfer learning: private data',
          )
        out.append(models)
      return out

    template = [engine.replicate(m, len(g.client_ids)) for m, g in zip(inits, groups)]
    tag = c.public_epochs * 100_000 + c.private_epochs
    models = tuple(ctx.stage('fedmd_transfer', tag, template, transfer))
    aux = FedMDAux(public, groups, digest, revisit, evaluators, models, np.zeros(0))
    return aux._replace(transfer_accuracy=self._client_accuracies(ctx, aux, models))

  def setup_records(self, ctx: RunContext, aux: FedMDAux) -> List[Dict[str, Any]]:
    return [
      {
        'stage': 'transfer learning',
        'transfer_test_accuracy': float(np.mean(aux.transfer_accuracy)),
        'transfer_client_test_accuracy': aux.transfer_accuracy.tolist(),
      }
    ]

  def init(self, ctx: RunContext, aux: FedMDAux) -> Tuple[ModelState, ...]:
    return aux.init

  def alignment_indices(self, ctx: RunContext, i: int) -> np.ndarray:
    """Round i's alignment subset of the public data (a function of the seed and i)."""
    key = ctx.derive_key(Purpose.ALIGNMENT, i)
    c = self.config
    return np.sort(
      np.asarray(jax.random.choice(key, c.public_size, (c.alignment_size,), replace=False))
    )

  def step(
    self, ctx: RunContext, aux: FedMDAux, state: Tuple[ModelState, ...], i: int
  ) -> Tuple[Tuple[ModelState, ...], List[Dict[str, Any]]]:
    """One FedMD round: consensus logits on an alignment subset, digest, then revisit of the private
    data.
    """
    c = self.config
    idx = self.alignment_indices(ctx, i)
    align_x = aux.public.x[idx]
    num_classes = ctx.dataset.num_classes
    logits, upload_bytes = [], 0
    for g, ev, models in zip(aux.groups, aux.evaluators, state):
      group_logits = ev.group_logits(models, align_x).astype(np.float32)
      for j, cid in enumerate(g.client_ids):
        upload = LogitsUpload(int(cid), group_logits[j])
        validate_logits_upload(upload, len(idx), num_classes)
        upload_bytes += serialized_nbytes(upload._asdict())
      logits.append(group_logits)
    consensus = np.asarray(consensus_logits(np.concatenate(logits)))
    new_models, digest_loss, train_loss = [], [], []
    for k, (g, models) in enumerate(zip(aux.groups, state)):
      m = len(g.client_ids)
      aligned = FederatedArrays(
        np.broadcast_to(align_x, (m, *align_x.shape)),
        np.broadcast_to(consensus, (m, *consensus.shape)),
        np.full((m,), len(idx), np.int32),
      )
      (models,), (dm,) = common.train_groups(
        [aux.digest[k]],
        [g._replace(fed=aligned)],
        [models],
        c.digest_epochs,
        ctx.derive_key(Purpose.DIGEST, i),
        label=f'round {i + 1}/{c.rounds} digest',
      )
      digest_loss.append(np.asarray(dm.loss)[:, -1])
      if c.revisit_epochs:
        (models,), (rm,) = common.train_groups(
          [aux.revisit[k]],
          [g],
          [models],
          c.revisit_epochs,
          ctx.derive_key(Purpose.ROUNDS, i),
          label=f'round {i + 1}/{c.rounds} revisit',
        )
        train_loss.append(np.asarray(rm.loss)[:, -1])
      new_models.append(models)
    state = tuple(new_models)
    accuracy = self._client_accuracies(ctx, aux, state)
    consensus_bytes = serialized_nbytes(consensus)
    record = {
      'round': i + 1,
      'test_accuracy': float(np.mean(accuracy)),
      'client_test_accuracy': accuracy.tolist(),
      'digest_loss': float(np.mean(np.concatenate(digest_loss))),
      'clients': ctx.num_clients,
      'upload_bytes': upload_bytes,
      'download_bytes': consensus_bytes * ctx.num_clients,
    }
    if train_loss:
      record['train_loss'] = float(np.mean(np.concatenate(train_loss)))
    return state, [record]

  def _client_accuracies(self, ctx: RunContext, aux: FedMDAux, state) -> np.ndarray:
    acc = np.zeros(ctx.num_clients)
    for g, ev, models in zip(aux.groups, aux.evaluators, state):
      acc[g.client_ids] = ev.group_accuracy(models, aux.public.eval_x, aux.public.eval_y)
    return acc

  def summarize(self, ctx, aux: FedMDAux, state, history) -> Dict[str, Any]:
    """The run summary: client models and final accuracies."""
    last = history[-1] if history else {}
    return {
      'rounds': self.config.rounds,
      'client_models': list(ctx.federation.specs),
      'public': aux.public.source,
      'client_test_accuracy': last.get('client_test_accuracy'),
      'transfer_test_accuracy': float(np.mean(aux.transfer_accuracy)),
    }
