"""FedHydra (Bai et al., KDD'25; seed 000 §3, Algorithms 1–3) on the shared one-shot
distillation loop (`jfed.methods.oneshot`, whose docstring defines a round).

1. Clients upload their local models once (Algorithm 1, lines 4–7).
2. MS (Algorithm 2): `jfed.distill.model_stratification` — m·c fresh-generator trainings of
   `ms_T_G` Adam steps on CE(F_k(G(z)), j), one batched program per architecture group — gives
   U, U_r, U_c (Eqs. 1–7). Saved to workdir/model_stratification.npz (teacher order and global
   client order) with the Fig. 5b heatmap workdir/ms_heatmap.png (clients × classes U_r).
   `ms_impl`: 'batched' (that one program), 'loop' (`model_stratification_loop`, one (k, j)
   run at a time), 'python' (`model_stratification_python`: one (k, j) run at a time,
   each a Python loop of T_G jitted steps; same numbers) or 'auto' = the fastest form on the
   backend, measured by experiments/bench/model_stratification.py: 'python' on CPU (XLA:CPU
   runs convolutions inside lax.scan very slowly), 'batched' elsewhere.
3. HASA (Algorithm 1, lines 10–25) for T_g = `epochs` epochs. One generator θ_G is initialised
   once (line 10) and kept across epochs (`generator_reset=True`: a fresh one every epoch, as
   DENSE); each epoch samples new z and labels y (line 12) and trains θ_G for T_G Adam steps on
   Eq. 16  L_Gen = CE(SA(x̂, y), y) + λ1·L_BN (1/m Σ_k, Eq. 14) + λ2·(−KL(SA, F_g)) (Eq. 15)
   (`jfed.distill.fedhydra_config`: θ_G only, un-augmented G(z), T = 1, no mask); then the
   global model F_g is trained with Eq. 19  KL(SA ‖ F_g) + β·CE(F_g, argmax SA)  using SGD.
   SA = `stratified_aggregation` with the generator's target labels (pool labels during KD).
   `kd_data='pool'` (default) distils on every batch synthesised so far, one shuffled pass per
   epoch, as the DENSE-derived FL-SA code does; 'batch' takes the steps on this epoch's batch
   only (Algorithm 1, lines 22–24, read literally).
   `aggregation`: 'sa' (Eqs. 8–11), 'sa_inter' (without Eq. 8) or 'ae' (DENSE's average
   ensemble, the Fig. 7 ablation; MS is skipped).

Defaults are seed 000 §4.1.5: T_G = 30, Adam 1e-3 for G, T_g = 200, SGD 0.01 for F_g,
λ1 = λ2 = 1. Not stated by the paper, chosen here: β = 1, KL with T = 1 'batchmean', SGD
momentum 0.9 (DENSE / FL-SA), synthesis and MS batch 256 (DENSE), generator Adam betas
(0.5, 0.999) (DENSE / FL-SA), server model = client model (ResNet18 in the heterogeneous
setting, Table 3: set `fedhydra.server_model`).

Config (`config.fedhydra`): rounds, local_epochs, epochs, server_model, init, T_G, lr_g,
synthesis_batch, lambda1, lambda2, adv_T, generator_reset, nz, ngf, ms_T_G, ms_lr, ms_batch,
ms_impl, ms_chunk, aggregation, beta, kd_T, kd_lr, kd_momentum, kd_weight_decay, kd_batch,
kd_data, kd_augment, pool_quantize.
"""
import time

import jax
import numpy as np

from jfed.distill import (MSConfig, SAWeights, fedhydra_config, make_generator,
                          model_stratification, model_stratification_loop,
                          model_stratification_python, plots)
from jfed.methods import common, oneshot
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method

AGGREGATIONS = {'sa': 'sa', 'sa_inter': 'sa_inter', 'ae': 'mean'}
MS_IMPLS = ('auto', 'batched', 'loop', 'python')


def resolve_ms_impl(impl: str, backend: str = None) -> str:
  """'auto': 'python' on CPU (measured ~35x faster there than the lax.scan-based forms:
  experiments/bench/model_stratification.py), 'batched' (one program) elsewhere."""
  if impl not in MS_IMPLS:
    raise ValueError(f'fedhydra.ms_impl must be one of {MS_IMPLS}, got {impl!r}')
  if impl != 'auto':
    return impl
  return 'python' if (backend or jax.default_backend()) == 'cpu' else 'batched'


MS_FUNCTIONS = {'batched': model_stratification, 'loop': model_stratification_loop,
                'python': model_stratification_python}


def fedhydra_settings(ctx: RunContext, cfg) -> oneshot.Settings:
  if cfg.aggregation not in AGGREGATIONS:
    raise ValueError(f'fedhydra.aggregation must be one of {sorted(AGGREGATIONS)}, '
                     f'got {cfg.aggregation!r}')
  agg = AGGREGATIONS[cfg.aggregation]
  synthesis = fedhydra_config(float(cfg.lambda1), float(cfg.lambda2), g_steps=int(cfg.T_G),
                              lr_g=float(cfg.lr_g), batch_size=int(cfg.synthesis_batch),
                              adv_T=float(cfg.adv_T), aggregation=agg,
                              strategy=oneshot.teacher_strategy(ctx))
  kd = oneshot.KDConfig(loss='fedhydra', T=float(cfg.kd_T), t_squared=False,
                        beta=float(cfg.beta), aggregation=agg,
                        augment=oneshot.resolve_augment(cfg.kd_augment, ctx.dataset.name),
                        crop_padding=oneshot.crop_padding(ctx.dataset.input_shape),
                        strategy=oneshot.teacher_strategy(ctx))
  return oneshot.base_settings(ctx, cfg, synthesis, kd, oneshot.opt_config(cfg),
                       keep_generator=not bool(cfg.generator_reset))


class FedHydra(oneshot.DistillMethod):
  name = 'fedhydra'

  def _ms_path(self, r):
    return self.ctx.workdir / ('model_stratification.npz' if r == 1 else
                               f'model_stratification_round{r}.npz')

  def setup_round(self, r, local, teachers):
    """MS for round r's uploads (Algorithm 2); reloaded from its npz on resume."""
    cfg, ctx = self.ctx.config.fedhydra, self.ctx
    if cfg.aggregation == 'ae':
      return None
    ids = oneshot.teacher_client_ids(local)
    path = self._ms_path(r)
    if path.exists():
      with np.load(path) as f:
        return SAWeights(f['U_r'], f['U_c'])
    impl = resolve_ms_impl(cfg.ms_impl)
    gen = make_generator(ctx.dataset.input_shape, int(cfg.nz), int(cfg.ngf))
    ms_cfg = MSConfig(T_G=int(cfg.ms_T_G), lr=float(cfg.ms_lr), batch_size=int(cfg.ms_batch))
    key = oneshot.round_key(ctx, r, oneshot.ROUND_KEY_MS)
    t0 = time.perf_counter()
    kw = {'chunk_size': int(cfg.get('ms_chunk', 0)) or None} if impl == 'batched' else {}
    res = MS_FUNCTIONS[impl](teachers, gen, ctx.dataset.num_classes, key, ms_cfg, **kw)
    seconds = time.perf_counter() - t0
    print(f'fedhydra round {r}: model stratification ({impl}, {len(ids)} clients x '
          f'{ctx.dataset.num_classes} classes x T_G={ms_cfg.T_G}) in {seconds:.1f}s', flush=True)
    arrays = {name: np.asarray(getattr(res, name)) for name in ('losses', 'u', 'U', 'U_r', 'U_c')}
    by_client = {}   # the same matrices with columns (or rows of u/losses) in global client order
    for name, a in arrays.items():
      out = np.zeros_like(a)
      if name in ('losses', 'u'):
        out[ids] = a
      else:
        out[:, ids] = a
      by_client[name + '_by_client'] = out
    np.savez(path, teacher_client_ids=ids, seconds=seconds, impl=impl, **arrays, **by_client)
    specs = [s.split(':')[0] for s in common.client_model_specs(ctx)]
    heat = 'ms_heatmap.png' if r == 1 else f'ms_heatmap_round{r}.png'
    plots.plot_ms_heatmap(
        ctx.workdir / heat, by_client['U_r_by_client'],
        title=f'FedHydra MS weights U_r (round {r}, {ctx.dataset.name}, '
              f'{ctx.config.partition.scheme})',
        client_names=[f'client {k + 1} ({s})' for k, s in enumerate(specs)])
    return SAWeights(arrays['U_r'], arrays['U_c'])

  def synthesis_agg(self, state, aux):
    return aux

  def kd_agg(self, state, aux):
    return None if aux is None else (aux.U_r, aux.U_c)

  def summary(self, state, aux):
    out = {'aggregation': self.ctx.config.fedhydra.aggregation,
           'generator_reset': bool(self.ctx.config.fedhydra.generator_reset)}
    path = self._ms_path(self.s.rounds)
    if aux is not None and path.exists():
      with np.load(path) as f:
        out.update({'ms_file': path.name, 'ms_impl': str(f['impl']),
                    'ms_seconds': float(f['seconds']),
                    'U_r_by_client': f['U_r_by_client'].tolist()})
    return out


@register_method('fedhydra')
def fedhydra(ctx: RunContext) -> dict:
  return oneshot.run_distillation(FedHydra(ctx, fedhydra_settings(ctx, ctx.config.fedhydra)))
