"""Co-Boosting (Dai et al., ICLR 2024; `github.com/rong-dai/Co-Boosting`) on the shared
one-shot distillation loop (`jfed.methods.oneshot`, whose docstring defines a round and a step).

Per distillation epoch e:
1. synthesis (`jfed.distill.coboosting_config`): fresh generator, g_steps Adam steps on the
   hard-sample loss  mean((1 − p_y)^hs · CE(t, y)) + adv · (−KL_T=3(t ‖ s) × T², no mask)
   (+ bn · BN loss averaged over models, off by default as `--bn 0`), generator gradient norm
   clipped to 10; t = Σ_k w_k f_k / Σ_k w_k, the per-model weighted ensemble.
2. ensemble-weight update (skipped at e = 0; `wa_steps` passes over the labelled pool): per pool
   batch g = ∇_w CE(t_w(x), y), w ← w − mu·wdc^e·sign(g), w ← clip(w₀ + clip(w − w₀, −1, 1), 0, 1)
   with w₀ the weights at the start of the epoch (`coboosting_weight_update`). The pool it passes
   over is `weight_update_order`'s: 'before_batch' (the default, the reference's
   `coboost.py:synthesize`, which updates the weights before `data_pool.add` of the epoch's best
   batch) the pool of epochs 0..e−1, 'after_batch' (jfed's former order) the pool with epoch e's
   batch; synthesis of epoch e uses the weights of epoch e − 1 either way.
3. KD over the whole pool with ODS: per batch x ← x + η·sign(∇_x Σ r ⊙ softmax(t_w(x)/4)),
   r ~ U(−1, 1)^{B×C}; loss KL_{T=4} 'batchmean' × T² against t_w; SGD(0.01, momentum 0.9,
   wd 1e-4), CosineAnnealingLR over the epochs ('cosine_epochs'), student gradient norm clipped
   to 10.

Input scale: Co-Boosting normalises inputs with mean = std = 0.5 (`registry.py`
`NORMALIZE_DICT`); the generator makes [0, 1] images (Sigmoid) that it normalises before the
teachers and un-normalises before the (PNG, uint8) pool, whose images the KD loader normalises
again, and ODS perturbs those normalised pool images by `odseta` = 8/255 (`datafree_kd.py`,
`cb_kd_train`). jfed's images (data, G(z), pool) stay in [0, 1] under either
`dataset.normalization`: with 'none' (the default) the models read them as they are, with 'half'
every classifier applies (x − 0.5) / 0.5 first, as the reference's transform does. ODS moves the
[0, 1] image by odseta · 0.5 (`NORMALISED_STD`): with 'half' this is exactly the reference's step
of odseta on the normalised image (x_n = 2x − 1: ∇_x = 2 ∇_{x_n} has the same sign, and a step
of odseta/2 in x is a step of odseta in x_n); with 'none' it is the same perturbation of the same
image in pixel terms. So the factor does not depend on the normalisation. The rest holds no scale:
the pool quantises [0, 1] images either way (the reference un-normalises first), hard-sample
mining and the adversarial KL read logits, and the BN-statistics loss compares each teacher's BN
inputs, which come after the model's normalisation on both sides.

Config (`config.coboosting`): the fields of `CoBoostingConfig`.
"""

import functools
from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed import typed_config as tc
from jfed.api import RunContext
from jfed.distill import (
  coboosting_config,
  coboosting_weight_update,
  combine_logits,
  cross_entropy,
  epoch_batches,
  gather_batch,
  images_per_epoch,
  teacher_groups,
  teacher_outputs,
)
from jfed.methods import oneshot
from jfed.methods.registry import register_method

NORMALISED_STD = 0.5  # Co-Boosting's Normalize(0.5, 0.5): 1 unit in [0, 1] = 2 normalised units
WEIGHT_UPDATE_ORDERS = ('before_batch', 'after_batch')


class CoBoostingOwnConfig(NamedTuple):
  g_steps: int = 30
  synthesis_batch: int = 128
  bn: float = 0.0
  oh: float = 1.0
  adv: float = 1.0
  hs: float = 1.0
  adv_T: float = 3.0
  g_grad_clip: float = 10.0
  mu: float = 0.01
  wdc: float = 0.99
  wa_steps: int = 1
  odseta: float = 8 / 255
  ods_T: float = 4.0
  kd_T: float = 4.0
  kd_optimizer: str = 'sgd'
  kd_lr: float = 0.01
  kd_weight_decay: float = 1e-4
  kd_schedule: str = 'cosine_epochs'
  kd_grad_clip: float = 10.0
  kd_batch: int = 128
  kd_augment: str = 'auto'
  # Crop/flip G(z) before the teachers in synthesis. The reference (`coboost.py:synthesize`)
  # feeds normalizer(G(z)) unaugmented: False, the default, is the reference.
  synthesis_augment: bool = False
  # The pool the epoch's ensemble-weight update passes over (`update_weights`): 'before_batch',
  # the default, is the reference (`coboost.py:synthesize` updates before `data_pool.add`);
  # 'after_batch' also passes over the batch synthesised this epoch (jfed's former order).
  weight_update_order: str = 'before_batch'


# `config.coboosting`: the shared blocks of jfed/methods/oneshot.py, then its own keys.
CoBoostingConfig = tc.concat(
  'CoBoostingConfig',
  __name__,
  oneshot.OneShotRound,
  oneshot.GeneratorDistillation,
  CoBoostingOwnConfig,
)


@functools.partial(jax.jit, static_argnums=(0, 1))
def weight_step(strategy, teacher_modules, teacher_states, weights, x, y, mask, step_size):
  """One Co-Boosting ensemble-weight step on a pool batch (x, y) (`gather_batch`, like the KD
  step: the pool's capacity stays out of the program) (as `github.com/rong-dai/Co-Boosting`
  does).

  Args:
    strategy: How the teachers map over their clients (a `jfed.engine.training.STRATEGIES` value).
    teacher_modules: Per architecture, the teachers' flax module.
    teacher_states: Per architecture, the teachers' stacked models.
    weights: (the current ensemble weights, the weights at the start of the epoch), each
      [clients].
    x: A pool batch of images.
    y: Their labels (the generator's classes).
    mask: [B] bool, the real rows of the batch.
    step_size: (mu, wdc, epoch): the step size mu decayed as mu · wdc^epoch (epoch a float
      scalar).

  Returns:
    The updated ensemble weights, [clients].
  """
  per_client, _ = teacher_outputs(
    teacher_groups(teacher_modules, teacher_states), x, False, strategy
  )
  per_client = jax.lax.stop_gradient(per_client)
  real = mask.astype(jnp.float32)

  def ce(w):
    t = combine_logits(per_client, w, normalize=True)
    return jnp.sum(cross_entropy(t, y, 'none') * real) / jnp.maximum(jnp.sum(real), 1.0)

  w, w_orig = weights
  return coboosting_weight_update(w, w_orig, jax.grad(ce)(w), *step_size)


def _by_client(w, client_ids) -> list:
  out = np.zeros(len(client_ids))
  out[np.asarray(client_ids)] = np.asarray(w)
  return out.tolist()


def settings(c: CoBoostingConfig, ctx: RunContext) -> oneshot.Settings:
  """Hard-sample synthesis and ODS KD against the weighted ensemble (the module docstring)."""
  synthesis = coboosting_config(
    **oneshot.synthesis_common(c, ctx),
    bn=c.bn,
    oh=c.oh,
    adv=c.adv,
    hs=c.hs,
    adv_T=c.adv_T,
    grad_clip=c.g_grad_clip or None,
    augment=c.synthesis_augment,
  )
  kd = oneshot.kd_config(
    c,
    ctx,
    loss='kl',
    t_squared=True,
    aggregation='weighted',
    ods_eta=c.odseta * NORMALISED_STD,
    ods_T=c.ods_T,
  )
  return oneshot.base_settings(c, ctx, synthesis, kd, oneshot.student_optimizer(c))


def uniform_weights(ctx: RunContext, aux: oneshot.DistillAux, student) -> jax.Array:
  """The initial ensemble weights: uniform over the clients.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    student: The round's starting student (unused).

  Returns:
    Uniform ensemble weights, [clients].
  """
  return jnp.full((ctx.num_clients,), 1.0 / ctx.num_clients, jnp.float32)


def ensemble_weights(state: oneshot.ServerState, rd: oneshot.RoundData) -> jax.Array:
  """The teachers' weights of synthesis and of KD: the ensemble weights of the epoch."""
  return state.extra


def teacher_ids(ctx: RunContext, aux, r: int, local, teachers) -> np.ndarray:
  """The client ids of the teachers, to report the weights by client.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    r: The round, from 1.
    local: The round's uploaded client models.
    teachers: The uploads grouped by architecture.

  Returns:
    The teachers' client ids, in teacher order.
  """
  return oneshot.teacher_client_ids(local)


def pool_before_epoch(pool, added: int):
  """The pool as it was before the epoch's `added` images were appended: a Co-Boosting pool
  holds every epoch's batch (capacity epochs × batch, `DistillationAlgorithm.fresh_state`), so
  `pool_add` wrote them to the slots [count − added, count) and the older ones fill the slots
  below.

  Args:
    pool: The pool after the epoch's `pool_add`.
    added: The images the epoch added.

  Returns:
    The same arrays with `count` less `added`.
  """
  count = int(pool.count)
  if count > pool.capacity or added > count:
    raise ValueError(f'a pool of {count} images in {pool.capacity} slots has no epoch of {added}')
  return pool._replace(count=jnp.asarray(count - added, pool.count.dtype))


def update_weights(c: CoBoostingConfig, ctx: RunContext, aux, rd, state, r: int, e: int):
  """From the second epoch on, `wa_steps` passes of ensemble-weight updates over the pool
  (without the epoch's batch under `weight_update_order='before_batch'`, the reference's).

  Args:
    c: Co-Boosting's config.
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    rd: The round's uploads, teachers and client ids.
    state: The server state after synthesis (its pool holds the epoch's batch).
    r: The round, from 1.
    e: The epoch within the round, from 0.

  Returns:
    The state with the updated ensemble weights and the weights for the record.
  """
  if e == 0:
    return state, {}
  modules = tuple(t.module for t in rd.teachers)
  t_states = tuple(t.states for t in rd.teachers)
  w = w_orig = state.extra
  pool = state.pool
  if c.weight_update_order == 'before_batch':
    pool = pool_before_epoch(pool, images_per_epoch(aux.settings.synthesis))
  rng = np.random.default_rng((int(ctx.run.seed), r, e, 7))
  for _ in range(c.wa_steps):
    idx, mask = epoch_batches(pool, rng, aux.settings.kd_batch)
    for b in range(idx.shape[0]):
      w = weight_step(
        aux.settings.kd.strategy,
        modules,
        t_states,
        (w, w_orig),
        *gather_batch(pool, jnp.asarray(idx[b])),
        jnp.asarray(mask[b]),
        (c.mu, c.wdc, jnp.float32(e)),
      )
  return state._replace(extra=w), {'ensemble_weights': _by_client(w, rd.data)}


def summary(ctx: RunContext, aux, rd, state, history) -> Dict[str, Any]:
  """The final ensemble weights.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    rd: The last round's data.
    state: The final server state.
    history: The records of every step of the run.

  Returns:
    The final ensemble weights, by client id.
  """
  return {'ensemble_weights': _by_client(state.extra, rd.data)}


def recipe(c: CoBoostingConfig) -> oneshot.Recipe:
  """Co-Boosting on the shared loop: weighted teachers whose weights change every epoch."""
  return oneshot.Recipe(
    settings=functools.partial(settings, c),
    round_data=teacher_ids,
    init_extra=uniform_weights,
    synthesis_agg=ensemble_weights,
    kd_agg=ensemble_weights,
    before_kd=functools.partial(update_weights, c),
    summary=summary,
  )


@register_method('coboosting')
class CoBoosting(oneshot.DistillationAlgorithm):
  """Hard-sample synthesis against a per-model weighted ensemble, ODS, weight updates."""

  section = 'coboosting'
  Config = CoBoostingConfig

  def validate(self, config) -> None:
    super().validate(config)
    c = self.config
    tc.require_non_negative(
      c, self.section, ('bn', 'oh', 'adv', 'hs', 'g_grad_clip', 'mu', 'wa_steps', 'odseta')
    )
    tc.require_positive(c, self.section, ('adv_T', 'ods_T', 'wdc'))
    tc.require_choice(
      c.weight_update_order, WEIGHT_UPDATE_ORDERS, f'{self.section}.weight_update_order'
    )
    # A per-step cosine needs the run's KD steps in advance; the synthetic pool grows every
    # epoch, so its epochs have ever more steps and the shared loop cannot count them.
    tc.require(
      c.kd_schedule != 'cosine',
      f"{self.section}.kd_schedule 'cosine' counts KD steps, which a growing synthetic pool does "
      "not fix in advance; use 'cosine_epochs' (the reference's CosineAnnealingLR over the "
      "epochs) or 'constant'",
    )

  def make_recipe(self) -> oneshot.Recipe:
    return recipe(self.config)
