"""Co-Boosting (Dai et al., ICLR'24; rong-dai/Co-Boosting, reference-code.md §2) on the shared
one-shot distillation loop (`jfed.methods.oneshot`, whose docstring defines a round).

Per distillation epoch e:
1. synthesis (`jfed.distill.coboosting_config`): fresh generator, g_steps Adam steps on the
   hard-sample loss  mean((1 − p_y)^hs · CE(t, y)) + adv · (−KL_T=3(t ‖ s) × T², no mask)
   (+ bn · BN loss averaged over models, off by default as `--bn 0`), generator gradient norm
   clipped to 10; t = Σ_k w_k f_k / Σ_k w_k, the per-model weighted ensemble.
2. ensemble-weight update (skipped at e = 0; `wa_steps` passes over the labelled pool): per pool
   batch g = ∇_w CE(t_w(x), y), w ← w − mu·wdc^e·sign(g), w ← clip(w₀ + clip(w − w₀, −1, 1), 0, 1)
   with w₀ the weights at the start of the epoch (`coboosting_weight_update`).
3. KD over the whole pool with ODS: per batch x ← x + η·sign(∇_x Σ r ⊙ softmax(t_w(x)/4)),
   r ~ U(−1, 1)^{B×C}; loss KL_{T=4} 'batchmean' × T² against t_w; SGD(0.01, momentum 0.9,
   wd 1e-4), CosineAnnealingLR over the epochs, student gradient norm clipped to 10.

Difference from the reference, by construction: Co-Boosting normalises inputs with
mean = std = 0.5, but jfed clients train on raw [0, 1] inputs (DENSE convention, no Normalize),
so teachers, student and generator all work in [0, 1]. The ODS step `odseta` is given in the
reference's normalised units (8/255) and applied as odseta · 0.5 in [0, 1] units (the same
perturbation of the same image).

Config (`config.coboosting`): rounds, local_epochs, epochs, server_model, init, g_steps,
synthesis_batch, lr_g, bn, oh, adv, hs, adv_T, g_grad_clip, nz, ngf, mu, wdc, wa_steps, odseta,
ods_T, kd_T, kd_lr, kd_momentum, kd_weight_decay, kd_schedule, kd_grad_clip, kd_batch,
kd_augment, pool_quantize.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jfed.distill import (coboosting_config, coboosting_weight_update, combine_logits,
                          cross_entropy, epoch_batches, pool_gather, teacher_outputs)
from jfed.methods import oneshot
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method

NORMALISED_STD = 0.5   # Co-Boosting's Normalize(0.5, 0.5): 1 unit in [0, 1] = 2 normalised units


@functools.partial(jax.jit, static_argnums=(0, 1))
def weight_step(strategy, teacher_modules, teacher_states, w, w_orig, pool, idx, mask, mu, wdc,
                epoch):
  """One Co-Boosting ensemble-weight step on pool[idx] (reference-code §2.1)."""
  x, y = pool_gather(pool, idx)
  per_client, _ = teacher_outputs(oneshot._groups(teacher_modules, teacher_states), x, False,
                                  strategy)
  per_client = jax.lax.stop_gradient(per_client)
  real = mask.astype(jnp.float32)

  def ce(weights):
    t = combine_logits(per_client, weights, normalize=True)
    return jnp.sum(cross_entropy(t, y, 'none') * real) / jnp.maximum(jnp.sum(real), 1.0)

  return coboosting_weight_update(w, w_orig, jax.grad(ce)(w), mu, wdc, epoch)


def coboosting_settings(ctx: RunContext, cfg) -> oneshot.Settings:
  synthesis = coboosting_config(**oneshot.synthesis_common(ctx, cfg), bn=float(cfg.bn),
                                oh=float(cfg.oh), adv=float(cfg.adv), hs=float(cfg.hs), adv_T=float(cfg.adv_T),
                                grad_clip=float(cfg.g_grad_clip) or None, input_mean=None,
                                input_std=None)
  kd = oneshot.KDConfig(loss='kl', T=float(cfg.kd_T), t_squared=True, aggregation='weighted',
                        augment=oneshot.resolve_augment(cfg.kd_augment, ctx.dataset.name),
                        crop_padding=oneshot.crop_padding(ctx.dataset.input_shape),
                        ods_eta=float(cfg.odseta) * NORMALISED_STD, ods_T=float(cfg.ods_T),
                        strategy=oneshot.teacher_strategy(ctx))
  return oneshot.base_settings(ctx, cfg, synthesis, kd, oneshot.opt_config(cfg))


class CoBoosting(oneshot.DistillMethod):
  name = 'coboosting'

  def init_extra(self, student, num_teachers):
    return jnp.full((num_teachers,), 1.0 / num_teachers, jnp.float32)

  def synthesis_agg(self, state, aux):
    return state.extra

  kd_agg = synthesis_agg

  def setup_round(self, r, local, teachers):
    return oneshot.teacher_client_ids(local)

  def before_kd(self, state, aux, teachers, r, e):
    if e == 0:
      return state, {}
    cfg = self.ctx.config.coboosting
    modules = tuple(t.module for t in teachers)
    t_states = tuple(t.states for t in teachers)
    w = w_orig = state.extra
    rng = np.random.default_rng((int(self.ctx.config.seed), r, e, 7))
    for _ in range(int(cfg.wa_steps)):
      idx, mask = epoch_batches(state.pool, rng, self.s.kd_batch)
      for b in range(idx.shape[0]):
        w = weight_step(self.s.kd.strategy, modules, t_states, w, w_orig, state.pool,
                        jnp.asarray(idx[b]), jnp.asarray(mask[b]), float(cfg.mu),
                        float(cfg.wdc), jnp.float32(e))
    return state._replace(extra=w), {'ensemble_weights': self._by_client(w, aux)}

  def _by_client(self, w, client_ids):
    out = np.zeros(len(client_ids))
    out[client_ids] = np.asarray(w)
    return out.tolist()

  def summary(self, state, aux):
    return {'ensemble_weights': self._by_client(state.extra, aux)}


@register_method('coboosting')
def coboosting(ctx: RunContext) -> dict:
  return oneshot.run_distillation(CoBoosting(ctx, coboosting_settings(ctx, ctx.config.coboosting)))
