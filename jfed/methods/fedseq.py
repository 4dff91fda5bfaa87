"""FedSeq (Zaccone et al., ICPR 2022; `github.com/RickZack/FedSeq`): superclients trained
sequentially, then FedAvg over superclients.

Setup:
1. Client representers: every client trains locally (`common.local_models`,
   `fedseq.pretrain_epochs`; the reference trains LeNet for 10 epochs, we use the run's model),
   predicts the public exemplars (`jfed.data.public`, default 'holdout': training samples held
   out of every client, `dataset.holdout_size`; the reference takes them from the test split,
   which jfed only scores, whole) and uploads its confidence
   vector `conf[c] = Σ_{x of class c} p(x, c)`, normalised (`jfed.clustering.fedseq_confidence`).
2. The server groups clients greedily into superclients (`jfed.clustering.fedseq_clusters`:
   maximise `1 − KL(mean(cluster, client) ‖ uniform)` until a superclient holds
   `min_examples` examples or `max_clients` clients).

Steps: each round, every (sampled, `participation`) superclient visits its clients in a fresh
seeded random order; each client starts from the previous client's model (the first from the
global model), trains `local_epochs` epochs on its own data with a fresh optimiser, and hands
the model on; the last client uploads it. The server averages the superclient models weighted
by their data size and evaluates the global model on the whole test split.

Superclients run in parallel: step j of the sequences trains the j-th client of every
superclient that has one as one client group (`common.train_groups`), so a round costs
max(superclient length) group calls, not one call per client.

Communication (`jfed.io.comm.fedseq_transfers`, Eq. 19): per round and superclient the server
sends the model to the first client (`download_bytes`), it is handed on n_c − 1 times
(`peer_bytes`) and uploaded by the last client (`upload_bytes`); the one-off confidence-vector
uploads are the setup record (step 0).
"""

from typing import Any, Dict, List, NamedTuple

import jax
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.clustering import MEASURES, fedseq_clusters, fedseq_confidence
from jfed.data import federate
from jfed.data.public import PublicData, check_holdout_fits, public_data
from jfed.engine import GroupTrainer, ModelState
from jfed.io import ModelUpload, comm, validate_model_upload, validate_tree
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method


class FedSeqConfig(NamedTuple):
  pretrain_epochs: int = 10
  public: str = 'holdout'
  public_size: int = 1000
  min_examples: int = 800
  max_clients: int = 11
  measure: str = 'kullback'
  code_compat: bool = False
  rounds: int = 1
  local_epochs: int = 1
  participation: float = 1.0


class FedSeqAux(NamedTuple):
  public: PublicData
  superclients: List[np.ndarray]
  superclient_sizes: np.ndarray  # examples per superclient
  full_group: common.ClientGroup
  trainer: GroupTrainer
  evaluator: engine.Evaluator
  init: ModelState
  model_bytes: int
  setup_transfers: List[comm.Transfer]  # the confidence-vector uploads


def superclient_orders(key: jax.Array, clusters, selected) -> List[np.ndarray]:
  """Seeded random client order of every selected superclient for one round.

  Args:
    key: The round's PRNG key (folded with each superclient id).
    clusters: Per superclient, its client ids.
    selected: The ids of the superclients selected this round.

  Returns:
    Per selected superclient, its client ids in this round's training order.
  """
  return [
    np.asarray(clusters[c])[
      np.asarray(jax.random.permutation(jax.random.fold_in(key, int(c)), len(clusters[c])))
    ]
    for c in selected
  ]


def _step_group(ctx: RunContext, full_group: common.ClientGroup, ids) -> common.ClientGroup:
  """The clients at one step of the sequences, padded to the largest client of the run, so
  that every step has the same array shapes and the step function compiles once."""
  fed = federate(
    ctx.dataset.train_x,
    ctx.dataset.train_y,
    [ctx.parts[k] for k in ids],
    pad_to_multiple=int(full_group.fed.x.shape[1]),
  )
  return full_group._replace(client_ids=np.asarray(ids), fed=fed)


@register_method('fedseq')
class FedSeq(Algorithm):
  """Superclients of complementary clients, trained sequentially; FedAvg over superclients."""

  section = 'fedseq'
  Config = FedSeqConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(
      c,
      where,
      ('pretrain_epochs', 'public_size', 'min_examples', 'max_clients', 'rounds', 'local_epochs'),
    )
    tc.require_fraction(c.participation, f'{where}.participation')
    tc.require_choice(c.measure, MEASURES, f'{where}.measure')
    check_holdout_fits(config, c.public, c.public_size, f'{where}.public')

  def trained_model(
    self, ctx: RunContext, aux: FedSeqAux, state: ModelState
  ) -> engine.TrainedModel:
    """The global model."""
    return engine.TrainedModel(aux.evaluator.module, state)

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def setup(self, ctx: RunContext) -> FedSeqAux:
    cfg, ds = self.config, ctx.dataset
    common.single_architecture(ctx)
    local = common.local_models(ctx, cfg.pretrain_epochs)
    public = public_data(ds, cfg.public, cfg.public_size, ctx.run.seed)
    probs = common.client_probabilities(ctx, local, public.x)
    conf = fedseq_confidence(probs, public.y).astype(np.float32)
    for k in range(ctx.num_clients):
      validate_tree(conf[k], np.zeros(ds.num_classes, np.float32), f'confidence of client {k}')
    clusters = fedseq_clusters(
      conf, ctx.client_sizes, cfg.min_examples, cfg.max_clients, cfg.measure, cfg.code_compat
    )
    setup = [
      comm.Transfer(
        comm.SETUP_ROUND, 'confidence', f'client{k}', 'server', comm.serialized_nbytes(conf[k])
      )
      for k in range(ctx.num_clients)
    ]
    full_group = common.client_groups(ctx)[0]
    module = full_group.module
    init = engine.init_model(module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
    return FedSeqAux(
      public,
      clusters,
      np.array([ctx.client_sizes[c].sum() for c in clusters]),
      full_group,
      common.make_trainers(ctx, [full_group])[0],
      engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy),
      init,
      comm.serialized_nbytes(init),
      setup,
    )

  def setup_records(self, ctx: RunContext, aux: FedSeqAux) -> List[Dict[str, Any]]:
    return [
      {
        'stage': 'setup',
        **comm.record_bytes(aux.setup_transfers),
        'superclients': len(aux.superclients),
      }
    ]

  def init(self, ctx: RunContext, aux: FedSeqAux) -> ModelState:
    return aux.init

  def _round_plan(self, ctx: RunContext, aux: FedSeqAux, i: int):
    """(selected superclients, their client orders) of round i: a function of the seed."""
    selected = common.select_clients(
      ctx.derive_key(Purpose.SAMPLING, i), len(aux.superclients), self.config.participation
    )
    orders = superclient_orders(
      ctx.derive_key(Purpose.SUPERCLIENT_ORDER, i), aux.superclients, selected
    )
    return selected, orders

  def step(self, ctx: RunContext, aux: FedSeqAux, state: ModelState, i: int):
    """One FedSeq round: each selected superclient trains its clients in sequence, then the server
    averages the superclients.
    """
    cfg = self.config
    selected, orders = self._round_plan(ctx, aux, i)
    models = engine.replicate(state, len(selected))
    key = ctx.derive_key(Purpose.ROUNDS, i)
    losses = []
    for j in range(max(len(o) for o in orders)):
      active = np.array([s for s, o in enumerate(orders) if len(o) > j])
      group = _step_group(ctx, aux.full_group, [int(orders[s][j]) for s in active])
      (trained,), (metrics,) = common.train_groups(
        [aux.trainer],
        [group],
        [engine.take(models, active)],
        cfg.local_epochs,
        jax.random.fold_in(key, j),
        label=f'round {i + 1}/{cfg.rounds} step {j + 1}',
      )
      models = jax.tree.map(lambda a, b: a.at[active].set(b), models, trained)
      losses.append(metrics.loss[:, -1])
    sizes = aux.superclient_sizes[selected]
    for s, order in enumerate(orders):  # the last client of each superclient uploads
      validate_model_upload(
        ModelUpload(int(order[-1]), int(sizes[s]), engine.take(models, s)), aux.init
      )
    model = engine.weighted_average(models, sizes)
    accuracy = aux.evaluator.accuracy(model, aux.public.eval_x, aux.public.eval_y)
    transfers = comm.fedseq_transfers(orders, aux.model_bytes, 1, first_round=i + 1)
    return model, [
      {
        'round': i + 1,
        'test_accuracy': accuracy,
        'train_loss': float(np.mean(np.concatenate(losses))),
        'superclients': len(selected),
        **comm.record_bytes(transfers),
      }
    ]

  def summarize(self, ctx, aux: FedSeqAux, state, history) -> Dict[str, Any]:
    """The run summary: the superclients and the communication of every round."""
    transfers = list(aux.setup_transfers)
    for i in range(self.config.rounds):
      transfers += comm.fedseq_transfers(
        self._round_plan(ctx, aux, i)[1], aux.model_bytes, 1, first_round=i + 1
      )
    return {
      'rounds': self.config.rounds,
      'public': aux.public.source,
      'superclients': [c.tolist() for c in aux.superclients],
      'superclient_sizes': aux.superclient_sizes.tolist(),
      'bytes_by_stage': dict(comm.bytes_by_stage(transfers)),
      'model_bytes': aux.model_bytes,
    }
