"""FedAvg (McMahan et al.) and FedProx (Li et al.): one-shot (rounds=1) or multi-round.

Each round (`common.fedavg_round`): the selected clients start from the global model, train
`local_epochs` epochs on their own data (FedProx adds mu/2 ||w - w_global||^2), upload their
models, and the server (`common.Server`) validates them and aggregates them by the run's
`aggregation.rule` (default: the mean weighted by client size). The server optimiser
(`server_optimizer`, `jfed.engine.server_optim`; default 'fedavg': the aggregate itself) then
steps on the pseudo-gradient θ_global − aggregate; the driver checkpoints the global model and
the server optimiser's state after every round.

`sampler` draws each round's clients (from the round's key, `Purpose.SAMPLING`, so a resumed run
draws the same ones): 'uniform' (default) round(participation · N) clients uniformly without
replacement; 'poisson' every client independently with probability q = participation (the cohort
varies, a round may have none: the global model then stays as it is, server optimiser included);
'size_weighted' round(participation · N) clients without replacement, each draw proportional to
client size (`common.size_weighted_clients`), aggregated with equal weights as FedProx's
Algorithm 2 does (Li et al., MLSys 2020): the sizes already weigh in through the sampling, and
weighting by size again would count them twice. That mean is unbiased for sampling with
replacement (Li et al., "On the Convergence of FedAvg on Non-IID Data", ICLR 2020, Scheme I) and
close to it while the cohort size times the largest client's share of the data is small; at
participation 1 it is the unweighted mean of every client. With `dp.enabled` the DP mechanism
draws the clients (below).

`bn_stats` (models with BatchNorm): 'averaged' (default) gives the global model the clients'
running statistics averaged like its weights, as FedAvg code that averages a model's whole state
does; 'recomputed' replaces them after every round by the statistics of the averaged weights on
every client's training images (the mean over batches of each batch's statistics, HeteroFL's
static-BN query; `common.BN_STATS`), and the round also records `averaged_bn_test_accuracy`,
the accuracy the averaged statistics would have given. Not with DP (the query reads raw images).

`reuse_local_models` (one-shot FedAvg only): average the shared one-shot client models
(`common.local_models`, read from `local_models_dir` when set) instead of training the clients
again. FedHydra's tables compare every method on the same local models; this also saves one
round of local training per partition in `experiments.fedhydra_tables`.

`dp.enabled` makes them DP-FedAvg / DP-FedProx (`jfed.engine.privacy`): the server clips every
upload's update to `dp.clip_norm` (fixed, or adaptive toward `dp.target_quantile` of the norms),
adds Gaussian noise of std z·C to their sum and divides by the expected clients per round m,
its rounds Poisson-sampling their clients at q = m/N as its accountant assumes (a round may have
none); or, with `dp.local`, every client clips and noises its own update before it uploads. Each
round records the ε spent so far at `dp.delta` (`dp_epsilon` from dp-accounting's RDP
accountant, `dp_epsilon_pld` from its PLD one) and the clip norm it used; the summary's `dp`
gives the final ε with δ, z, C, the sampling and its rate q.

`fedavg_vote` is one-shot FedAvg for heterogeneous clients as FedMHO (Yao et al., WWW 2026, §5.1.2)
runs it:
the shared one-shot local models (`common.local_models`) are averaged *uniformly* within each
architecture ("model prototype"; the reference's `_avg_over_archs`), and the result is "the
voting outcome of model prototypes": the argmax of the mean of the prototype models' logits
(the reference's `federated_average_ensemble` aggregation). Each prototype's own accuracy and
their mean (the reference's `avg_perfs_lst`) are recorded beside it.
"""

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext, parse_run_config
from jfed.engine import GroupTrainer, ModelState, privacy, server_optim
from jfed.engine.aggregation import Aggregator
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method


class FedAvgConfig(NamedTuple):
  rounds: int = 1
  local_epochs: int = 1
  participation: float = 1.0
  reuse_local_models: bool = False
  bn_stats: str = 'averaged'  # or 'recomputed' (common.BN_STATS)
  sampler: str = 'uniform'  # or 'poisson', 'size_weighted' (common.CLIENT_SAMPLERS)


class FedProxConfig(NamedTuple):
  rounds: int = 1
  local_epochs: int = 1
  participation: float = 1.0
  mu: float = 0.01
  bn_stats: str = 'averaged'  # or 'recomputed' (common.BN_STATS)
  sampler: str = 'uniform'  # or 'poisson', 'size_weighted' (common.CLIENT_SAMPLERS)


class FedAvgVoteConfig(NamedTuple):
  local_epochs: int = 1


class FedAvgAux(NamedTuple):
  full_group: common.ClientGroup
  trainer: Optional[GroupTrainer]
  evaluator: engine.Evaluator
  init: ModelState
  local: Optional[common.LocalModels]  # reuse_local_models: the shared one-shot models
  server: common.Server
  server_tx: Any  # optax.GradientTransformation on the pseudo-gradient
  server_update: Callable  # jitted (opt_state, global, aggregate) -> (global, opt_state)
  dp: Optional['DpSetup'] = None  # None: no differential privacy
  bn: Optional[common.BatchNormRecompute] = None  # bn_stats='recomputed' (else None)


class FedAvgState(NamedTuple):
  model: ModelState  # the global model
  server_opt_state: Any  # the server optimiser's state
  dp_clip_norm: Any = None  # adaptive clipping's C for the next round (else None)


class DpSetup(NamedTuple):
  """A DP run's mechanism: its `dp` section and the numbers its accounting depends on."""

  config: privacy.DpConfig
  clients_per_round: int  # m: the fixed denominator of the server-side mean
  sampling_rate: float  # q = m / N
  count_std: Optional[float]  # σ_b of adaptive clipping's count (None: fixed clipping)

  @property
  def update_noise_multiplier(self) -> float:
    return privacy.update_noise_multiplier(self.config.noise_multiplier, self.count_std)

  @property
  def poisson(self) -> bool:
    """Whether rounds Poisson-sample their clients (server-side DP below full participation):
    the sampling its accountant assumes."""
    return not self.config.local and self.sampling_rate < 1.0

  @property
  def sampling(self) -> str:
    """How the rounds draw their clients, in words (the summary's `dp.sampling`)."""
    if self.poisson:
      return f'poisson (each client with probability {self.sampling_rate:g})'
    if self.sampling_rate >= 1.0:
      return 'every client every round'
    return 'fixed-size uniform (local DP: no amplification by sampling is claimed)'

  def epsilon(self, rounds: int, accountant: str = 'rdp') -> float:
    """ε after `rounds` rounds at `dp.delta` (per client under local DP)."""
    c = self.config
    if c.local:
      return privacy.local_epsilon(c.noise_multiplier, rounds, c.delta, accountant)
    return privacy.central_epsilon(
      self.sampling_rate, c.noise_multiplier, rounds, c.delta, self.count_std, accountant
    )


# The key under which the DP server's record carries the noised unclipped fraction b̃ to the
# round (the Aggregator API returns only the model); the round takes it out of its record.
_RELEASED_FRACTION = 'released_unclipped_fraction'


class _DpServer(NamedTuple):
  """The run's server for one DP round: with local DP the clients' uploads are clipped and
  noised before the server receives them; otherwise the server's rule is the DP mean (attack
  simulation and upload validation stay as they are), and its record carries the noised
  unclipped fraction b̃ (`_RELEASED_FRACTION`)."""

  server: common.Server
  dp: DpSetup
  noise: privacy.RoundNoise
  # local DP under the Flower bridge: each SuperNode clipped and noised its clients' uploads
  # before replying (`transport.NodeTrainer`), so the server never holds a clean update
  privatized_on_nodes: bool = False

  @property
  def attack(self):
    return self.server.attack

  def receive(self, group, stacked, reference, template, step, weights=None, **kwargs):
    if self.dp.config.local and self.privatized_on_nodes:
      return self.server.receive(group, stacked, reference, template, step, weights, **kwargs)
    if self.dp.config.local:
      stacked = privacy.privatize_locally(
        stacked,
        reference,
        self.noise.key,
        jnp.asarray(group.client_ids),
        self.noise.clip_norm,
        jnp.float32(self.dp.config.noise_multiplier),
      )
      return self.server.receive(group, stacked, reference, template, step, weights, **kwargs)

    released = []

    def dp_mean(rows, unused_weights, ref):  # every clipped update counts 1, not its size
      model, fraction = privacy.central_aggregate(rows, ref, self.noise)
      released.append(fraction)
      return model

    server = self.server._replace(aggregator=Aggregator('dp_mean', dp_mean))
    model, record = server.receive(group, stacked, reference, template, step, weights, **kwargs)
    if not released:  # every upload rejected: noise all the same
      model, fraction = privacy.central_noise_only(reference, self.noise)
      released.append(fraction)
    return model, {**record, _RELEASED_FRACTION: released[0]}


@register_method('fedavg')
class FedAvg(Algorithm):
  """Size-weighted parameter averaging of the clients' models, every round."""

  section = 'fedavg'
  server_round = True
  differential_privacy = True
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
    tc.require_choice(c.bn_stats, common.BN_STATS, f'{self.section}.bn_stats')
    tc.require_choice(c.sampler, common.CLIENT_SAMPLERS, f'{self.section}.sampler')
    run = parse_run_config(config)
    tc.require(
      not (run.dp.enabled and c.sampler == 'size_weighted'),
      f"{self.section}.sampler='size_weighted' is not the uniform Poisson sampling the DP "
      "accountant assumes: use 'uniform' or 'poisson' with dp.enabled",
    )
    tc.require(
      not (run.dp.enabled and run.dp.local and c.sampler == 'poisson'),
      f"{self.section}.sampler='poisson': dp.local draws fixed-size uniform cohorts (it claims "
      "no amplification by sampling): use 'uniform'",
    )
    poisson = c.sampler == 'poisson' or (run.dp.enabled and not run.dp.local)
    tc.require(
      not (poisson and run.aggregation.rule in ('trimmed_mean', 'krum')),
      f'aggregation.rule={run.aggregation.rule} needs a known number of uploads, but a Poisson '
      f"cohort's size varies (it can be below what the rule needs): use {self.section}.sampler="
      "'uniform' without dp.enabled, or aggregation.rule=median",
    )
    tc.require(
      not (run.dp.enabled and c.bn_stats == 'recomputed'),
      f"{self.section}.bn_stats='recomputed' reads the clients' raw images outside the DP "
      "mechanism: use 'averaged' with dp.enabled",
    )
    n = run.partition.num_clients
    problem = privacy.config_problem(
      run.dp, common.clients_per_round(n, c.participation), run.aggregation, n
    )
    tc.require(problem is None, problem)
    so = run.server_optimizer
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

  def trained_model(
    self, ctx: RunContext, aux: FedAvgAux, state: FedAvgState
  ) -> engine.TrainedModel:
    """The global model."""
    return engine.TrainedModel(aux.full_group.module, state.model)

  def num_steps(self, ctx: RunContext) -> int:
    """The configured rounds, or under `dp.max_epsilon` the rounds whose ε stays within it."""
    dp = self._dp_setup(ctx)
    if dp is None or not dp.config.max_epsilon:
      return self.config.rounds
    rounds = privacy.rounds_within_budget(dp.epsilon, self.config.rounds, dp.config.max_epsilon)
    if rounds == 0:
      raise ConfigError(
        f'dp.max_epsilon={dp.config.max_epsilon:g} is exceeded by one round (ε = '
        f'{dp.epsilon(1):.3g} at δ = {dp.config.delta:g}): raise the budget or '
        'dp.noise_multiplier'
      )
    if rounds < self.config.rounds:
      logging.warning(
        'dp.max_epsilon=%g: the run stops after %d of %d rounds (ε = %.3g)',
        dp.config.max_epsilon,
        rounds,
        self.config.rounds,
        dp.epsilon(rounds),
      )
    return rounds

  def setup(self, ctx: RunContext) -> FedAvgAux:
    spec = common.single_architecture(ctx)
    full_group = common.client_groups(ctx)[0]
    init = engine.init_model(
      full_group.module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0)
    )
    evaluator = engine.Evaluator(full_group.module, ctx.run.eval_batch_size, ctx.run.strategy)
    server = common.make_server(ctx)
    tx = server_optim.make_server_optimizer(ctx.run.server_optimizer)
    update = jax.jit(functools.partial(server_optim.server_update, tx))
    dp = self._dp_setup(ctx)
    bn = common.bn_recompute(ctx, full_group.module, range(ctx.num_clients), self.config.bn_stats)
    if self.reuse_local_models:
      local = common.local_models(ctx, self.config.local_epochs)
      assert local.groups[0].spec == spec
      return FedAvgAux(full_group, None, evaluator, init, local, server, tx, update, dp, bn)
    trainer = common.make_trainers(ctx, [full_group], self.prox_mu)[0]
    return FedAvgAux(full_group, trainer, evaluator, init, None, server, tx, update, dp, bn)

  def _dp_setup(self, ctx: RunContext) -> Optional[DpSetup]:
    dp = ctx.run.dp
    if not dp.enabled:
      return None
    if dp.reproducible_noise and ctx.client_transport is not None:
      raise ConfigError(
        'dp.reproducible_noise derives the noise from the config, which every Flower node '
        'receives: a node could subtract it; it is for simulations only'
      )
    m = common.clients_per_round(ctx.num_clients, self.config.participation)
    count_std = privacy.count_noise_std(dp, m) if dp.adaptive else None
    return DpSetup(dp, m, m / ctx.num_clients, count_std)

  def step_label(self, i: int, n: int, aux: Optional[FedAvgAux] = None) -> str:
    label = super().step_label(i, n)
    if aux is None or aux.dp is None:
      return label
    dp = aux.dp
    return f'{label} (ε = {dp.epsilon(i + 1):.3g} at δ = {dp.config.delta:g})'

  def init(self, ctx: RunContext, aux: FedAvgAux) -> FedAvgState:
    clip = None
    if aux.dp is not None and aux.dp.config.adaptive:
      clip = jnp.float32(aux.dp.config.clip_norm)
    return FedAvgState(aux.init, aux.server_tx.init(aux.init.params), clip)

  def _round_server(self, ctx: RunContext, aux: FedAvgAux, state: FedAvgState, i: int):
    """The server of round i: the run's, or under DP the run's behind round i's mechanism."""
    if aux.dp is None:
      return aux.server
    dp = aux.dp
    clip = dp.config.clip_norm if state.dp_clip_norm is None else state.dp_clip_norm
    clip = jnp.asarray(clip, jnp.float32)
    key = (
      ctx.derive_key(Purpose.PRIVACY, i)
      if dp.config.reproducible_noise
      else privacy.fresh_noise_key()
    )
    noise = privacy.RoundNoise(
      key,
      clip,
      jnp.float32(dp.update_noise_multiplier) * clip,
      jnp.float32(dp.count_std or 0.0),
      jnp.float32(dp.clients_per_round),
    )
    return _DpServer(aux.server, dp, noise, ctx.client_transport is not None)

  def _dp_round(
    self, aux: FedAvgAux, state: FedAvgState, server: Any, i: int, fraction: Any
  ) -> Tuple[Any, Dict[str, Any]]:
    """The next adaptive clip norm and round i's privacy record fields; `fraction`: the round's
    noised unclipped fraction (central DP)."""
    if aux.dp is None:
      return state.dp_clip_norm, {}
    dp, clip = aux.dp, server.noise.clip_norm
    # the driver's progress line prints it too (`step_label`)
    record = {
      'dp_epsilon': dp.epsilon(i + 1),
      'dp_epsilon_pld': dp.epsilon(i + 1, 'pld'),
      'dp_clip_norm': float(clip),
    }
    if not dp.config.adaptive:
      return None, record
    record['dp_unclipped_fraction'] = float(fraction)
    c = dp.config
    return privacy.next_clip_norm(clip, fraction, c.target_quantile, c.clip_lr), record

  def cohort(
    self, ctx: RunContext, aux: FedAvgAux, i: int
  ) -> Tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
    """Round i's clients as `sampler` (or, with `dp.enabled`, the DP mechanism) draws them.

    Args:
      ctx: The run context (its key for `Purpose.SAMPLING`, its clients' sizes).
      aux: The run-level state built in `setup` (its DP setup).
      i: The round, from 0.

    Returns:
      The selected client ids, sorted (possibly none for Poisson sampling); for an in-process
      Poisson cohort the ids padded to a bucket of rows and [rows] bool marking the padding
      (`common.padded_cohort`), else None; the aggregation weights per selected client, or
      None for their sizes.
    """
    c = self.config
    key = ctx.derive_key(Purpose.SAMPLING, i)
    if aux.dp is not None:
      rate = aux.dp.sampling_rate if aux.dp.poisson else None
    else:
      rate = c.participation if c.sampler == 'poisson' else None
    if rate is not None:
      selected = common.poisson_clients(key, ctx.num_clients, rate)
      if len(selected) and ctx.client_transport is None:  # in process: one shape per bucket
        return (*common.padded_cohort(selected, ctx.num_clients, rate), None)
      return selected, None, None
    if c.sampler == 'size_weighted' and aux.dp is None:
      count = common.clients_per_round(ctx.num_clients, c.participation)
      selected = common.size_weighted_clients(key, ctx.client_sizes, count)
      return selected, None, np.ones(len(selected))
    return common.select_clients(key, ctx.num_clients, c.participation), None, None

  def step(
    self, ctx: RunContext, aux: FedAvgAux, state: FedAvgState, i: int
  ) -> Tuple[FedAvgState, List[Dict[str, Any]]]:
    """One FedAvg round: the selected clients train from the global model, the server aggregates."""
    c = self.config
    server = self._round_server(ctx, aux, state, i)
    if aux.local is not None:  # one-shot aggregate of the shared local models
      (group,), (models,) = aux.local.groups, aux.local.models
      aggregate, received = server.receive(group, models, state.model, aux.init, i)
      record = {
        'clients': ctx.num_clients,
        **received,
        'upload_bytes': aux.local.upload_bytes,
        'download_bytes': 0,
        'reused_local_models': True,
      }
    else:
      selected, padding, weights = self.cohort(ctx, aux, i)
      if len(selected):
        aggregate, record = common.fedavg_round(
          common.RoundParts(aux.trainer, c.local_epochs, aux.init, server),
          common.participating_group(ctx, aux.full_group, selected),
          state.model,
          ctx.derive_key(Purpose.ROUNDS, i),
          i,
          common.RoundOptions(
            weights=weights,
            prox_mu=self.prox_mu,
            label=f'round {i + 1}/{c.rounds}',
            sitting_out=padding,
          ),
        )
      elif aux.dp is not None:  # a Poisson cohort of none: the round releases the noise alone
        aggregate, fraction = privacy.central_noise_only(state.model, server.noise)
        record = {'clients': 0, 'upload_bytes': 0, 'download_bytes': 0}
        record[_RELEASED_FRACTION] = fraction
      else:  # a Poisson cohort of none: nothing to aggregate
        aggregate = None
        record = {'clients': 0, 'upload_bytes': 0, 'download_bytes': 0}
    fraction = record.pop(_RELEASED_FRACTION, None)
    clip, dp_record = self._dp_round(aux, state, server, i, fraction)
    if aggregate is None:
      # A zero pseudo-gradient would still move a server optimiser with momentum.
      model, opt_state = state.model, state.server_opt_state
    else:
      model, opt_state = aux.server_update(state.server_opt_state, state.model, aggregate)
    test_x, test_y = ctx.dataset.test_x, ctx.dataset.test_y
    if aux.bn is not None and model.batch_stats:
      record['averaged_bn_test_accuracy'] = aux.evaluator.accuracy(model, test_x, test_y)
      model = aux.bn(model)
    accuracy = aux.evaluator.accuracy(model, test_x, test_y)
    record = {'round': i + 1, 'test_accuracy': accuracy, **record, **dp_record}
    return FedAvgState(model, opt_state, clip), [record]

  def summarize(self, ctx, aux, state, history) -> Dict[str, Any]:
    """The run summary: communication and final accuracy."""
    return {
      'rounds': self.config.rounds,
      'reused_local_models': self.reuse_local_models,
      'aggregation': aux.server.aggregator.name,
      'server_optimizer': ctx.run.server_optimizer.name,
      'attack': aux.server.attack.kind,
      'attackers': aux.server.attackers.tolist(),
      **({} if aux.dp is None else {'dp': self._dp_summary(aux.dp, state, history)}),
    }

  def _dp_summary(self, dp: DpSetup, state: FedAvgState, history) -> Dict[str, Any]:
    c = dp.config
    epsilons = [r['dp_epsilon'] for r in history if 'dp_epsilon' in r]
    if epsilons[-1] > privacy.WEAK_EPSILON:
      logging.warning(
        'dp: ε = %.3g at δ = %g after %d rounds is above %g: this run has little privacy',
        epsilons[-1],
        c.delta,
        len(epsilons),
        privacy.WEAK_EPSILON,
      )
    out = {
      'mechanism': 'local' if c.local else 'central',
      'epsilon': epsilons[-1],
      'epsilon_pld': dp.epsilon(len(epsilons), 'pld'),
      'epsilon_above_10': epsilons[-1] > privacy.WEAK_EPSILON,
      # how the rounds drew their clients: what the accountant assumes
      'sampling': dp.sampling,
      'delta': c.delta,
      'noise_multiplier': c.noise_multiplier,
      'clip_norm': c.clip_norm,
      'sampling_rate': dp.sampling_rate,
      'clients_per_round': dp.clients_per_round,
      'rounds': len(epsilons),
      'max_epsilon': c.max_epsilon,
      'stopped_by_max_epsilon': len(epsilons) < self.config.rounds,
      'accountant': privacy.accountant_name(),
    }
    if c.adaptive:
      out.update(
        final_clip_norm=float(state.dp_clip_norm),
        target_quantile=c.target_quantile,
        update_noise_multiplier=dp.update_noise_multiplier,
        count_noise_std=dp.count_std,
      )
    return out


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
    """The one step: FedAvg of each architecture's clients, then the vote of those prototypes.

    Args:
      ctx: The run context (dataset, clients, run config, stage cache).
      local: The clients' one-shot uploads (this method's `aux`).
      state: Unused (the prototypes are built from `local`).
      i: The step, from 0.

    Returns:
      The new state and the step's records.
    """
    prototypes = [
      engine.weighted_average(m, np.ones(len(g.client_ids)))
      for g, m in zip(local.groups, local.models)
    ]
    logits = [
      engine.Evaluator(g.module, ctx.run.eval_batch_size, ctx.run.strategy).logits(
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
    """The run summary: each prototype's accuracy and the client architectures.

    Args:
      ctx: The run context (dataset, clients, run config, stage cache).
      local: The clients' one-shot uploads (this method's `aux`).
      state: Unused.
      history: The records of every step of the run.

    Returns:
      The summary fields.
    """
    last = history[-1]
    return {
      'prototype_test_accuracy': last['prototype_test_accuracy'],
      'mean_prototype_test_accuracy': last['mean_prototype_test_accuracy'],
      'client_models': list(ctx.federation.specs),
    }
