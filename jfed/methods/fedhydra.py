"""FedHydra (Bai et al., KDD 2025, §3, Algorithms 1–3) on the shared one-shot
distillation loop (`jfed.methods.oneshot`, whose docstring defines a round and a step).

1. Clients upload their local models once (Algorithm 1, lines 4–7).
2. MS (Algorithm 2): `jfed.distill.model_stratification` — m·c fresh-generator trainings of
   `ms_T_G` Adam steps on CE(F_k(G(z)), j), one batched program per architecture group — gives
   U, U_r, U_c (Eqs. 1–7). A driver stage per round ('model_stratification', tag r), also saved
   as workdir/model_stratification.npz (teacher order and global client order) with the
   Fig. 5b heatmap workdir/ms_heatmap.png (clients 0..m−1 × classes, U_r).
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
   `synthesis_keep='all'` (default): every one of the T_G batches G(z; θ_G^t) of the epoch
   enters the pool, as FedHydra "leverages all generated intermediates" where other methods
   select the optimal images (§2); 'best' keeps only the lowest-loss batch (DENSE's
   `best_inputs`), as jfed did before issue 12.
   `kd_data='pool'` (default) distils on every image synthesised so far, one shuffled pass per
   epoch, as the DENSE-derived FL-SA code does; 'batch' takes the steps on this epoch's images
   only (Algorithm 1, lines 22–24, read literally).
   `pool_limit=0` (default) keeps that pool unbounded, the paper's: at §4.1.5's budget it grows
   by T_G · 256 = 7,680 images an epoch to 1.5 M images (1.2 GB as uint8), and epoch e's KD
   pass takes 30·e steps. `pool_limit=N` bounds it to a uniform reservoir of N images (Vitter's
   algorithm R over the stream of synthesised images, `jfed.distill.pool_reservoir_add`; its
   draws from the epoch's key derive_key(SERVER, r, e), the reservoir and its count of images
   seen are the checkpointed pool, so a resumed run makes the same draws). What that changes
   from the paper: once more than N images have been synthesised, each KD epoch distils on a
   uniform sample of N of them (each kept with probability N / seen) instead of all of them, so
   an epoch takes ⌈N / kd_batch⌉ steps instead of a number growing with e: the same mixture of
   early and late generator intermediates in expectation, far fewer student steps in all, and
   the pool's memory and checkpoint bounded by N images. Needs kd_data='pool'.
   `generator='paper'` (default): §4.1.3's generator (`jfed.distill.FedHydraGenerator`,
   FC then 3 × [BN, LeakyReLU, ConvTranspose2d], Sigmoid), for MS and HASA; 'dense': DENSE's.
   `aggregation`: 'sa' (Eqs. 8–11), 'sa_inter' (without Eq. 8) or 'ae' (DENSE's average
   ensemble, the Fig. 7 ablation; MS is skipped).

Defaults are the paper's §4.1.5: T_G = 30, Adam 1e-3 for G, T_g = 200, SGD 0.01 for F_g,
λ1 = λ2 = 1. Not stated by the paper, chosen here: β = 1, KL with T = 1 'batchmean', SGD
momentum 0.9 (DENSE / FL-SA), synthesis and MS batch 256 (DENSE), generator Adam betas
(0.5, 0.999) (DENSE / FL-SA), server model = client model (ResNet18 in the heterogeneous
setting, Table 3: set `fedhydra.server_model`).

Config (`config.fedhydra`): the fields of `FedHydraConfig`.
"""

import functools
import time
from typing import Any, Dict, NamedTuple

from absl import logging
import numpy as np

from jfed import typed_config as tc
from jfed.api import RunContext
from jfed.distill import (
  KEEP,
  MS_COMPUTE_DTYPES,
  MS_FUNCTIONS,
  MS_IMPLS,
  MSConfig,
  SAWeights,
  fedhydra_config,
  make_generator,
  plots,
  resolve_ms_impl,
)
from jfed.keys import ServerRoundPurpose
from jfed.methods import oneshot
from jfed.methods.registry import register_method

AGGREGATIONS = {'sa': 'sa', 'sa_inter': 'sa_inter', 'ae': 'mean'}
GENERATOR_KINDS = {'paper': 'fedhydra', 'dense': 'dense'}
SA_SCALES = ('paper', 'classes')


def sa_weights(U_r: Any, U_c: Any, scale: str) -> SAWeights:
  """SA's weights from MS: Ū_c as Eq. 6 ('paper'; a client's class weights sum to 1, so they
  average 1/c) or × c ('classes'; they average 1, keeping SA logits at the clients' scale).

  Args:
    U_r: MS's reliability weights, [C classes, m clients].
    U_c: MS's class weights, [C classes, m clients].
    scale: 'paper' (Eq. 6: a client's class weights sum to 1) or 'classes' (× C: they average 1).

  Returns:
    The SA weights.
  """
  if scale not in SA_SCALES:
    raise ValueError(f'sa_in_model_scale {scale!r}; valid: {SA_SCALES}')
  return SAWeights(U_r, U_c * (np.shape(U_c)[0] if scale == 'classes' else 1))


class FedHydraOwnConfig(NamedTuple):
  T_G: int = 30
  synthesis_batch: int = 256
  lambda1: float = 1.0
  lambda2: float = 1.0
  adv_T: float = 1.0
  generator_reset: bool = False
  # 'paper': FedHydra §4.1.3 (FC, 3 × [BN, LeakyReLU, ConvTranspose2d], Sigmoid); 'dense': DENSE's
  generator: str = 'paper'
  # 'all': every generator step's batch enters the pool (FedHydra §2, "leverages all generated
  # intermediates"); 'best': only the lowest-loss batch of each epoch (DENSE's best_inputs)
  synthesis_keep: str = 'all'
  # Compute L_BN and L_AD at λ = 0 too, so that a sweep over λ1 / λ2 (Table 6) runs one compiled
  # generator step for every value; the results equal the default's.
  synthesis_every_term: bool = False
  ms_T_G: int = 30
  ms_lr: float = 1e-3
  ms_batch: int = 256
  ms_impl: str = 'auto'
  ms_chunk: int = 0
  # 'bfloat16': MS's generators and teachers compute in bf16 (float32 parameters, Adam state and
  # losses); the paper's float32 is the default. For accelerators' bf16 matrix units.
  ms_compute_dtype: str = 'float32'
  aggregation: str = 'sa'
  # 'paper': Ū_c as Eq. 6 (each client's class weights sum to 1, so SA logits are about 1/c of
  # a client's); 'classes': Ū_c × c (mean weight 1: the same relative weighting at the
  # clients' logit scale). docs/fedhydra.md, "SA logit scale".
  sa_in_model_scale: str = 'paper'
  beta: float = 1.0
  kd_T: float = 1.0
  kd_lr: float = 0.01
  kd_weight_decay: float = 0.0
  kd_batch: int = 256
  kd_data: str = 'pool'
  kd_augment: str = 'none'
  # 0: the KD pool keeps every synthesised image (the paper's unbounded pool); N > 0: a uniform
  # reservoir of at most N images (Vitter's algorithm R over the stream of synthesised images;
  # its draws from the run's keys), bounding the pool's memory and each KD epoch. Not the
  # paper's: see the module docstring and docs/fedhydra.md, "A bounded KD pool".
  pool_limit: int = 0


# `config.fedhydra`: the shared blocks of jfed/methods/oneshot.py, then its own keys.
FedHydraConfig = tc.concat(
  'FedHydraConfig',
  __name__,
  oneshot.OneShotRound,
  oneshot.GeneratorDistillation,
  FedHydraOwnConfig,
)


class Stratification(NamedTuple):
  """The result of MS for one round's uploads, in the teachers' order (a driver stage)."""

  losses: Any  # [m, c, T_G]
  u: Any  # [m, c]
  U: Any  # [c, m]
  U_r: Any  # [c, m]
  U_c: Any  # [c, m]
  seconds: Any  # scalar: how long MS took when it ran


class HydraRound(NamedTuple):
  sa: SAWeights
  ms: Stratification
  client_ids: Any  # global client id of each teacher


def _by_client(a: np.ndarray, ids: np.ndarray, client_major: bool) -> np.ndarray:
  """The matrix with its client axis (rows if client_major, else columns) in global order."""
  out = np.zeros_like(a)
  if client_major:
    out[ids] = a
  else:
    out[:, ids] = a
  return out


def _file_name(stem: str, r: int, ext: str) -> str:
  return f'{stem}.{ext}' if r == 1 else f'{stem}_round{r}.{ext}'


def settings(c: FedHydraConfig, ctx: RunContext) -> oneshot.Settings:
  """HASA: SA-guided synthesis with a kept generator, Eq. 19 distillation (module docstring)."""
  agg = AGGREGATIONS[c.aggregation]
  synthesis = fedhydra_config(
    c.lambda1,
    c.lambda2,
    g_steps=c.T_G,
    lr_g=c.lr_g,
    batch_size=c.synthesis_batch,
    adv_T=c.adv_T,
    aggregation=agg,
    strategy=oneshot.teacher_strategy(ctx),
    keep=c.synthesis_keep,
    every_term=c.synthesis_every_term,
  )
  kd = oneshot.kd_config(c, ctx, loss='fedhydra', t_squared=False, beta=c.beta, aggregation=agg)
  return oneshot.base_settings(
    c,
    ctx,
    synthesis,
    kd,
    oneshot.student_optimizer(c),
    keep_generator=not c.generator_reset,
    generator=GENERATOR_KINDS[c.generator],
  )


def stratify(c: FedHydraConfig, ctx: RunContext, aux, r: int, local, teachers) -> Any:
  """MS for round r's uploads (Algorithm 2): a stage, so a resumed run does not redo it.

  Args:
    c: FedHydra's config.
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    r: The round, from 1.
    local: The round's uploaded client models.
    teachers: The uploads grouped by architecture.

  Returns:
    MS and the SA weights with the teachers' client ids; None for plain averaging ('ae').
  """
  if c.aggregation == 'ae':
    return None
  ids = oneshot.teacher_client_ids(local)
  m, k, t_g = len(ids), ctx.dataset.num_classes, c.ms_T_G
  zeros = lambda *shape: np.zeros(shape, np.float32)
  template = Stratification(
    zeros(m, k, t_g), zeros(m, k), zeros(k, m), zeros(k, m), zeros(k, m), zeros()
  )

  def compute() -> Stratification:
    impl = resolve_ms_impl(c.ms_impl)
    gen = make_generator(ctx.dataset.input_shape, c.nz, c.ngf, GENERATOR_KINDS[c.generator])
    ms_cfg = MSConfig(T_G=t_g, lr=c.ms_lr, batch_size=c.ms_batch, compute_dtype=c.ms_compute_dtype)
    kw = {'chunk_size': c.ms_chunk or None} if impl == 'batched' else {}
    t0 = time.perf_counter()
    res = MS_FUNCTIONS[impl](
      teachers,
      gen,
      k,
      oneshot.round_key(ctx, r, ServerRoundPurpose.MODEL_STRATIFICATION),
      ms_cfg,
      **kw,
    )
    seconds = time.perf_counter() - t0
    logging.info(
      'fedhydra round %d: model stratification (%s, %d clients x %d classes x T_G=%d) in %.1fs',
      r,
      impl,
      m,
      k,
      t_g,
      seconds,
    )
    out = Stratification(*(np.asarray(a, np.float32) for a in res), np.asarray(seconds, np.float32))
    _write_ms(ctx, r, out, ids, impl)
    return out

  ms = ctx.stage('model_stratification', r, template, compute)
  return HydraRound(sa_weights(ms.U_r, ms.U_c, c.sa_in_model_scale), ms, ids)


def _write_ms(ctx: RunContext, r: int, ms: Stratification, ids: np.ndarray, impl: str) -> None:
  """workdir/model_stratification.npz and the Fig. 5b heatmap (runs with a workdir only)."""
  path = ctx.output_path(_file_name('model_stratification', r, 'npz'))
  if path is None:
    return
  arrays = {name: getattr(ms, name) for name in ('losses', 'u', 'U', 'U_r', 'U_c')}
  by_client = {
    f'{name}_by_client': _by_client(a, ids, name in ('losses', 'u')) for name, a in arrays.items()
  }
  np.savez(path, teacher_client_ids=ids, seconds=ms.seconds, impl=impl, **arrays, **by_client)
  specs = [s.split(':')[0] for s in ctx.federation.specs]
  plots.plot_ms_heatmap(
    ctx.output_path(_file_name('ms_heatmap', r, 'png')),
    by_client['U_r_by_client'],
    title=f'FedHydra MS weights U_r (round {r}, {ctx.dataset.name}, {ctx.run.partition.scheme})',
    client_names=[f'client {k} ({s})' for k, s in enumerate(specs)],
  )


def synthesis_weights(state: oneshot.ServerState, rd: oneshot.RoundData) -> Any:
  """SA's weights for synthesis (None: 'ae', the plain mean)."""
  return None if rd.data is None else rd.data.sa


def kd_weights(state: oneshot.ServerState, rd: oneshot.RoundData) -> Any:
  """SA's (U_r, U_c) for the KD targets (None: 'ae', the plain mean)."""
  return None if rd.data is None else (rd.data.sa.U_r, rd.data.sa.U_c)


def summary(c: FedHydraConfig, ctx: RunContext, aux, rd, state, history) -> Dict[str, Any]:
  """FedHydra's summary fields: the aggregation and MS.

  Args:
    c: FedHydra's config.
    ctx: The run context (dataset, clients, run config, stage cache).
    aux: The run-level state built in `setup`.
    rd: The last round's data (MS).
    state: The final server state.
    history: The records of every step of the run.

  Returns:
    The aggregation, the pool's limit and size, MS timing and per-client reliability.
  """
  pool = state.pool
  out = {
    'aggregation': c.aggregation,
    'generator_reset': c.generator_reset,
    'pool_limit': c.pool_limit,
    'pool_capacity': int(pool.capacity),
    # the pool's arrays, allocated whole when a round starts: its peak
    'pool_bytes': int(pool.images.nbytes + pool.labels.nbytes),
  }
  if rd.data is not None:
    ms, ids = rd.data.ms, np.asarray(rd.data.client_ids)
    out.update(
      {
        'ms_impl': resolve_ms_impl(c.ms_impl),
        'ms_seconds': float(ms.seconds),
        'U_r_by_client': _by_client(np.asarray(ms.U_r), ids, False).tolist(),
      }
    )
    if ctx.output_path('') is not None:
      out['ms_file'] = _file_name('model_stratification', aux.settings.rounds, 'npz')
  return out


def recipe(c: FedHydraConfig) -> oneshot.Recipe:
  """FedHydra on the shared loop: MS every round, SA teachers fixed through the round."""
  return oneshot.Recipe(
    settings=functools.partial(settings, c),
    round_data=functools.partial(stratify, c),
    synthesis_agg=synthesis_weights,
    kd_agg=kd_weights,
    kd_agg_fixed_in_round=True,
    summary=functools.partial(summary, c),
  )


@register_method('fedhydra')
class FedHydra(oneshot.DistillationAlgorithm):
  """Model stratification, then HASA: SA-guided synthesis and Eq. 19 distillation."""

  section = 'fedhydra'
  Config = FedHydraConfig

  def validate(self, config) -> None:
    super().validate(config)
    c, where = self.config, self.section
    tc.require_positive(c, where, ('adv_T', 'ms_T_G', 'ms_lr', 'ms_batch'))
    tc.require_non_negative(c, where, ('lambda1', 'lambda2', 'beta', 'ms_chunk', 'pool_limit'))
    tc.require(
      not (c.pool_limit and c.kd_data == 'batch'),
      f"{where}.pool_limit: a reservoir needs kd_data='pool' (kd_data='batch' keeps one epoch)",
    )
    tc.require_choice(c.aggregation, AGGREGATIONS, f'{where}.aggregation')
    tc.require_choice(c.generator, GENERATOR_KINDS, f'{where}.generator')
    tc.require_choice(c.synthesis_keep, KEEP, f'{where}.synthesis_keep')
    tc.require_choice(c.ms_impl, MS_IMPLS, f'{where}.ms_impl')
    tc.require_choice(c.ms_compute_dtype, MS_COMPUTE_DTYPES, f'{where}.ms_compute_dtype')
    tc.require_choice(c.sa_in_model_scale, SA_SCALES, f'{where}.sa_in_model_scale')

  def make_recipe(self) -> oneshot.Recipe:
    return recipe(self.config)
