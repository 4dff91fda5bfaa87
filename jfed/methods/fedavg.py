"""FedAvg (McMahan et al.) and FedProx (Li et al.): one-shot (rounds=1) or multi-round.

Each round (`common.fedavg_round`): the selected clients start from the global model, train
`local_epochs` epochs on their own data (FedProx adds mu/2 ||w - w_global||^2), upload their
models, and the server (`common.Server`) validates them and aggregates them by the run's
`aggregation.rule` (default: the mean weighted by client size). The server optimiser
(`server_optimizer`, `jfed.engine.server_optim`; default 'fedavg': the aggregate itself) then
steps on the pseudo-gradient θ_global − aggregate; the driver checkpoints the global model and
the server optimiser's state after every round.

`reuse_local_models` (one-shot FedAvg only): average the shared one-shot client models
(`common.local_models`, read from `local_models_dir` when set) instead of training the clients
again. FedHydra's tables compare every method on the same local models; this also saves one
round of local training per partition in `experiments.fedhydra_tables`.

`fedavg_vote` is one-shot FedAvg for heterogeneous clients as FedMHO (seed 004 §5.1.2) runs it:
the shared one-shot local models (`common.local_models`) are averaged *uniformly* within each
architecture ("model prototype"; the reference's `_avg_over_archs`), and the result is "the
voting outcome of model prototypes": the argmax of the mean of the prototype models' logits
(the reference's `federated_average_ensemble` aggregation). Each prototype's own accuracy and
their mean (the reference's `avg_perfs_lst`) are recorded beside it.
"""

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.driver import Algorithm
from jfed.engine import GroupTrainer, ModelState, server_optim
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method


class FedAvgConfig(NamedTuple):
  rounds: int
  local_epochs: int
  participation: float
  reuse_local_models: bool


class FedProxConfig(NamedTuple):
  rounds: int
  local_epochs: int
  participation: float
  mu: float


class FedAvgVoteConfig(NamedTuple):
  local_epochs: int


class FedAvgAux(NamedTuple):
  full_group: common.ClientGroup
  trainer: Optional[GroupTrainer]
  evaluator: engine.Evaluator
  init: ModelState
  local: Optional[common.LocalModels]  # reuse_local_models: the shared one-shot models
  server: common.Server
  server_tx: Any  # optax.GradientTransformation on the pseudo-gradient
  server_update: Callable  # jitted (opt_state, global, aggregate) -> (global, opt_state)


class FedAvgState(NamedTuple):
  model: ModelState  # the global model
  server_opt_state: Any  # the server optimiser's state


def server_optimizer_config(config) -> server_optim.ServerOptimizerConfig:
  return tc.parse(
    server_optim.ServerOptimizerConfig, config.get('server_optimizer'), 'server_optimizer'
  )


@register_method('fedavg')
class FedAvg(Algorithm):
  """Size-weighted parameter averaging of the clients' models, every round."""

  section = 'fedavg'
  Config = FedAvgConfig
  step_name = 'round'

  @property
  def prox_mu(self) -> float:
    return 0.0

  @property
  def reuse_local_models(self) -> bool:
    return bool(getattr(self.config, 'reuse_local_models', False))

  def validate(self, config) -> None:
    c = self.config
    tc.require_positive(c, self.section, ('rounds', 'local_epochs'))
    tc.require_fraction(c.participation, f'{self.section}.participation')
    so = server_optimizer_config(config)
    tc.require_choice(so.name, server_optim.SERVER_OPTIMIZERS, 'server_optimizer.name')
    tc.require_positive(so, 'server_optimizer', ('lr', 'eps'))
    for name in ('momentum', 'b1', 'b2'):
      value = getattr(so, name)
      tc.require(0.0 <= value < 1.0, f'server_optimizer.{name} must be in [0, 1), got {value}')
    if self.reuse_local_models:
      tc.require(
        c.rounds == 1 and c.participation == 1.0,
        'reuse_local_models needs rounds = 1 and participation = 1 (one-shot FedAvg '
        f'over every client); got rounds = {c.rounds}, participation = '
        f'{c.participation}',
      )

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def setup(self, ctx: RunContext) -> FedAvgAux:
    spec = common.single_architecture(ctx)
    full_group = common.client_groups(ctx)[0]
    init = engine.init_model(
      full_group.module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0)
    )
    evaluator = engine.Evaluator(full_group.module, ctx.config.eval_batch_size, ctx.config.strategy)
    server = common.run_server(ctx)
    tx = server_optim.make_server_optimizer(server_optimizer_config(ctx.config))
    update = jax.jit(functools.partial(server_optim.server_update, tx))
    if self.reuse_local_models:
      local = common.local_models(ctx, self.config.local_epochs)
      assert local.groups[0].spec == spec
      return FedAvgAux(full_group, None, evaluator, init, local, server, tx, update)
    trainer = common.make_trainers(ctx, [full_group], self.prox_mu)[0]
    return FedAvgAux(full_group, trainer, evaluator, init, None, server, tx, update)

  def init(self, ctx: RunContext, aux: FedAvgAux) -> FedAvgState:
    return FedAvgState(aux.init, aux.server_tx.init(aux.init.params))

  def step(
    self, ctx: RunContext, aux: FedAvgAux, state: FedAvgState, i: int
  ) -> Tuple[FedAvgState, List[Dict[str, Any]]]:
    c = self.config
    if aux.local is not None:  # one-shot aggregate of the shared local models
      (group,), (models,) = aux.local.groups, aux.local.models
      aggregate, received = aux.server.receive(group, models, state.model, aux.init, i)
      record = {
        'clients': ctx.num_clients,
        **received,
        'upload_bytes': aux.local.upload_bytes,
        'download_bytes': 0,
        'reused_local_models': True,
      }
    else:
      selected = common.select_clients(
        ctx.derive_key(Purpose.SAMPLING, i), ctx.num_clients, c.participation
      )
      group = common.participating_group(ctx, aux.full_group, selected)
      aggregate, record = common.fedavg_round(
        aux.trainer,
        group,
        state.model,
        c.local_epochs,
        ctx.derive_key(Purpose.ROUNDS, i),
        aux.init,
        aux.server,
        i,
        prox_mu=self.prox_mu,
        label=f'round {i + 1}/{c.rounds}',
      )
    model, opt_state = aux.server_update(state.server_opt_state, state.model, aggregate)
    accuracy = aux.evaluator.accuracy(model, ctx.dataset.test_x, ctx.dataset.test_y)
    return FedAvgState(model, opt_state), [{'round': i + 1, 'test_accuracy': accuracy, **record}]

  def summarize(self, ctx, aux, state, history) -> Dict[str, Any]:
    return {
      'rounds': self.config.rounds,
      'reused_local_models': self.reuse_local_models,
      'aggregation': aux.server.aggregator.name,
      'server_optimizer': server_optimizer_config(ctx.config).name,
      'attack': aux.server.attack.kind,
      'attackers': aux.server.attackers.tolist(),
    }


@register_method('fedprox')
class FedProx(FedAvg):
  """FedAvg with the proximal term mu/2 ||w - w_global||^2 in every client's loss."""

  section = 'fedprox'
  Config = FedProxConfig

  @property
  def prox_mu(self) -> float:
    return self.config.mu

  def validate(self, config) -> None:
    super().validate(config)
    tc.require_non_negative(self.config, self.section, ('mu',))


@register_method('fedavg_vote')
class FedAvgVote(Algorithm):
  """One-shot FedAvg within each architecture, then a logit-mean vote of the prototypes."""

  section = 'fedavg_vote'
  Config = FedAvgVoteConfig
  step_name = 'round'

  def validate(self, config) -> None:
    tc.require_positive(self.config, self.section, ('local_epochs',))

  def num_steps(self, ctx: RunContext) -> int:
    return 1

  def setup(self, ctx: RunContext) -> common.LocalModels:
    return common.local_models(ctx, self.config.local_epochs)

  def init(self, ctx: RunContext, local: common.LocalModels) -> List[ModelState]:
    return [engine.take(m, 0) for m in local.models]

  def step(self, ctx: RunContext, local: common.LocalModels, state, i: int):
    prototypes = [
      engine.weighted_average(m, np.ones(len(g.client_ids)))
      for g, m in zip(local.groups, local.models)
    ]
    logits = [
      engine.Evaluator(g.module, ctx.config.eval_batch_size, ctx.config.strategy).logits(
        p, ctx.dataset.test_x
      )
      for g, p in zip(local.groups, prototypes)
    ]
    test_y = ctx.dataset.test_y
    per_prototype = [float(common.accuracy_of_logits(lg, test_y)) for lg in logits]
    record = {
      'round': 1,
      'test_accuracy': float(common.accuracy_of_logits(np.mean(logits, axis=0), test_y)),
      'prototype_test_accuracy': dict(zip([g.spec for g in local.groups], per_prototype)),
      'mean_prototype_test_accuracy': float(np.mean(per_prototype)),
      'clients': ctx.num_clients,
      'upload_bytes': local.upload_bytes,
    }
    return prototypes, [record]

  def summarize(self, ctx, local, state, history) -> Dict[str, Any]:
    last = history[-1]
    return {
      'prototype_test_accuracy': last['prototype_test_accuracy'],
      'mean_prototype_test_accuracy': last['mean_prototype_test_accuracy'],
      'client_models': common.client_model_specs(ctx),
    }
