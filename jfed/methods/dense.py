"""DENSE (Zhang et al., NeurIPS'22; zj-jayzhang/DENSE, reference-code.md §1) on the shared
one-shot distillation loop (`jfed.methods.oneshot`, whose docstring defines a round).

Per distillation epoch: a FRESH generator and z (DENSE `reset_model`) are trained for `g_steps`
Adam(betas 0.5, 0.999) steps on  bn·L_bn + oh·CE(mean teacher, y) + adv·L_adv  (adv: KL with the
student's disagreement mask, T = 1; RandomCrop + HFlip view; `jfed.distill.dense_config`); the
lowest-loss batch joins the pool (uint8 like DENSE's PNGs); then the student (random init)
takes one pass over the WHOLE pool: KL(softmax(t/T) ‖ softmax(s/T)) 'batchmean' × T² against
the unweighted teacher mean (T = 20 in DENSE's README), SGD(momentum 0.9).

`dense.bn_loss_mode`: 'paper' (default) keeps the DeepInversion BN loss summed over all client
models, as the DENSE paper describes it; 'code' sets it to 0, as the official code effectively
runs (its BN hooks never attach, reference-code.md §1.3/§11.1).

Config (`config.dense`): rounds, local_epochs, epochs, server_model, init, g_steps,
synthesis_batch, lr_g, bn, oh, adv, bn_loss_mode, nz, ngf, kd_T, kd_lr, kd_momentum,
kd_weight_decay, kd_batch, kd_augment, pool_quantize.
"""
from jfed.distill import dense_config, pool_size
from jfed.methods import oneshot
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method

BN_LOSS_MODES = ('paper', 'code')


def dense_settings(ctx: RunContext, cfg) -> oneshot.Settings:
  mode = cfg.get('bn_loss_mode', 'paper')
  if mode not in BN_LOSS_MODES:
    raise ValueError(f'dense.bn_loss_mode must be one of {BN_LOSS_MODES}, got {mode!r}')
  synthesis = dense_config(**oneshot.synthesis_common(ctx, cfg),
                           bn=0.0 if mode == 'code' else float(cfg.bn), oh=float(cfg.oh),
                           adv=float(cfg.adv))
  kd = oneshot.KDConfig(loss='kl', T=float(cfg.kd_T), t_squared=True, aggregation='mean',
                        augment=oneshot.resolve_augment(cfg.kd_augment, ctx.dataset.name),
                        crop_padding=oneshot.crop_padding(ctx.dataset.input_shape),
                        strategy=oneshot.teacher_strategy(ctx))
  return oneshot.base_settings(ctx, cfg, synthesis, kd, oneshot.opt_config(cfg))


class Dense(oneshot.DistillMethod):
  name = 'dense'

  def summary(self, state, aux):
    return {'bn_loss_mode': self.ctx.config.dense.get('bn_loss_mode', 'paper'),
            'pool_size': int(pool_size(state.pool))}


@register_method('dense')
def dense(ctx: RunContext) -> dict:
  return oneshot.run_distillation(Dense(ctx, dense_settings(ctx, ctx.config.dense)))
