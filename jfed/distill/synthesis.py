"""One generator-synthesis epoch (DENSE's `AdvSynthesizer.synthesize`,
`github.com/zj-jayzhang/DENSE`, `helpers/synthesizers.py`), parametrised so that DENSE, Co-Boosting
(`github.com/rong-dai/Co-Boosting`, `datafree/synthesis/coboost.py`) and FedHydra HASA (Bai et al.,
KDD 2025, Eq. 16) share it.

Per epoch: fresh generator (DENSE `reset_model`; or continue a given generator state) and fresh
z ~ N(0, I); targets y ~ U{0..C−1} (sorted for DENSE); Adam([G, z] or [G]) with betas (0.5, 0.999);
`g_steps` iterations of

    x = G(z) (train-mode BN);  x_a = aug(x) (RandomCrop(pad) + HFlip, optional);  x_n = norm(x_a)
    P_k = F_k(x_n) (teachers in eval mode; BN input statistics collected when bn > 0)
    t   = aggregate(P_1..P_K; y): mean (DENSE) | Σ w_k P_k / Σ w_k (Co-Boosting) | SA (FedHydra)
    L   = bn · L_bn + oh · L_oh(t, y) + adv · L_adv(s = F_student(x_n), t)
          L_bn : Σ_layers ||rv − var|| + ||rm − mean||, reduced over models ('sum' DENSE,
                 'mean' Eq. 14)
          L_oh : CE(t, y) | (1 − p_y)^hs · CE  (Co-Boosting hard-sample)
          L_adv: −mean_b(mask_b · Σ_c KL_elem(t ‖ s)) at temperature T (× T² optional)
    keep the batch x with the lowest L, evaluated before the step (DENSE `best_inputs`),
    or every x of the epoch (`keep='all'`: FedHydra "leverages all generated intermediates",
    FedHydra, Bai et al., KDD 2025, §2);
    step (optionally clipping the generator's gradient norm, PyTorch `clip_grad_norm_`).

Two drivers with identical numbers: `loop='scan'` (one jitted program, `lax.scan` over steps; the
fast form on accelerators) and `loop='python'` (a jitted step in a Python loop; XLA:CPU runs
convolutions inside scan slowly, docs/design.md). 'auto' picks 'python' on CPU.
"""

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jfed.distill.ensemble import TeacherGroup, _as_groups, combine_logits, teacher_outputs
from jfed.distill.generator import DenseGenerator, dense_generator_init
from jfed.distill.losses import adversarial_loss, cross_entropy, hard_sample_cross_entropy
from jfed.distill.pool import augment as augment_images
from jfed.distill.stratification import stratified_aggregation
from jfed.engine.state import ModelState, commit


class SynthesisConfig(NamedTuple):
  g_steps: int = 20
  lr_g: float = 1e-3
  b1: float = 0.5
  b2: float = 0.999
  batch_size: int = 256
  bn: float = 1.0  # weight of L_bn (FedHydra λ1)
  oh: float = 1.0  # weight of L_oh
  adv: float = 1.0  # weight of L_adv (FedHydra λ2)
  oh_loss: str = 'ce'  # 'ce' | 'hard_sample'
  hs: float = 1.0  # hard-sample exponent
  adv_T: float = 1.0
  adv_mask: bool = True
  adv_t_squared: bool = False
  bn_model_reduction: str = 'sum'  # 'sum' | 'mean'
  aggregation: str = 'mean'  # 'mean' | 'weighted' | 'sa' | 'sa_inter' (SA without Eq. 8)
  optimize_z: bool = True
  grad_clip: Optional[float] = None  # max generator-gradient norm (z's gradient not clipped)
  augment: bool = True
  crop_padding: int = 4
  flip: bool = True
  sort_targets: bool = True
  strategy: str = 'auto'  # teacher client mapping (ensemble.resolve_strategy)
  loop: str = 'auto'  # 'scan' | 'python' | 'auto'
  keep: str = 'best'  # 'best': the lowest-loss batch (DENSE) | 'all': every step's G(z)
  # The loss weights bn / oh / adv reach the compiled step as values, so runs that differ only in
  # nonzero weights share one program. A zero weight skips its term (a smaller program) unless
  # every_term, which keeps the program the same for every weight: a λ sweep compiles once.
  every_term: bool = False


KEEP = ('best', 'all')


def images_per_epoch(cfg: SynthesisConfig) -> int:
  """How many images one synthesis epoch adds to the pool."""
  return cfg.batch_size * (cfg.g_steps if cfg.keep == 'all' else 1)


def dense_config(**kw) -> SynthesisConfig:
  """DENSE README: g_steps 30, bn=oh=adv=1, adv T=1 with disagreement mask, sorted targets,
  Adam([G, z]), RandomCrop(4)+HFlip, unweighted teacher mean, BN loss summed over models
  (set bn=0 to reproduce the official code, whose BN hooks never attach: `helpers/synthesizers.py`
  of `github.com/zj-jayzhang/DENSE` registers them on `Ensemble_A`, which keeps its models in a
  plain list, so no BatchNorm layer is found)."""
  base = dict(g_steps=30)
  base.update(kw)
  return SynthesisConfig(**base)


def coboosting_config(**kw) -> SynthesisConfig:
  """Co-Boosting: hard-sample CE (hs=1), adv T=3 ×T² without mask, bn=0 (default `--bn 0`; BN loss
  averaged over models when on), generator grad clip 10, g_steps 30, batch 128, random
  (unsorted) targets, per-model weighted teacher, un-augmented G(z) (`coboost.py:synthesize`
  feeds normalizer(G(z)) to the teachers; jfed's teachers take the [0, 1] images themselves,
  jfed.methods.coboosting's docstring)."""
  base = dict(
    g_steps=30,
    batch_size=128,
    bn=0.0,
    oh_loss='hard_sample',
    hs=1.0,
    adv_T=3.0,
    adv_mask=False,
    adv_t_squared=True,
    bn_model_reduction='mean',
    aggregation='weighted',
    grad_clip=10.0,
    sort_targets=False,
    augment=False,
  )
  base.update(kw)
  return SynthesisConfig(**base)


def fedhydra_config(lambda1: float = 1.0, lambda2: float = 1.0, **kw) -> SynthesisConfig:
  """FedHydra HASA data generation (Eq. 16): L = CE(SA, y) + λ1·L_BN (1/m Σ_k, Eq. 14) + λ2·L_AD
  (−KL(P, F_g), T=1, no mask: Eq. 15 states none); T_G = 30 iterations, Adam lr 1e-3 on θ_G only
  (Algorithm 1, line 19), un-augmented G(z) (the paper mentions no augmentation)."""
  base = dict(
    g_steps=30,
    bn=lambda1,
    oh=1.0,
    adv=lambda2,
    adv_mask=False,
    bn_model_reduction='mean',
    aggregation='sa',
    optimize_z=False,
    augment=False,
    sort_targets=False,
  )
  base.update(kw)
  return SynthesisConfig(**base)


class SAWeights(NamedTuple):
  U_r: Any  # [c, m]
  U_c: Any  # [c, m]


class SynthesisResult(NamedTuple):
  # [B, H, W, C] best (lowest-loss) un-augmented G output; keep='all': [g_steps·B, ...], every
  # step's G output before the step, step-major
  images: jnp.ndarray
  labels: jnp.ndarray  # [B] generator targets ([g_steps·B] for keep='all')
  best_loss: jnp.ndarray  # scalar
  losses: jnp.ndarray  # [g_steps] total loss before each step
  components: jnp.ndarray  # [g_steps, 3] (L_bn, L_oh, L_adv) before each step
  generator: ModelState  # generator after the last step


class _Carry(NamedTuple):
  opt_vars: Any
  gen_bs: Any
  opt_state: Any
  best_x: jnp.ndarray
  best_loss: jnp.ndarray


def aggregate_teachers(
  cfg: SynthesisConfig, per_client: jnp.ndarray, labels: jnp.ndarray, agg: Any
) -> jnp.ndarray:
  """The ensemble's logits under `cfg.aggregation`.

  Args:
    cfg: Its `aggregation` picks 'mean', 'weighted', 'sa' or 'sa_inter'.
    per_client: Per-client logits [K, B, C].
    labels: The samples' target labels [B] (used by 'sa' and 'sa_inter').
    agg: None for 'mean', weights [K] for 'weighted', (U_r, U_c) for 'sa' / 'sa_inter'.

  Returns:
    Teacher logits [B, C].
  """
  if cfg.aggregation == 'mean':
    return combine_logits(per_client)
  if cfg.aggregation == 'weighted':
    return combine_logits(per_client, agg, normalize=True)
  if cfg.aggregation in ('sa', 'sa_inter'):
    U_r, U_c = agg
    return stratified_aggregation(per_client, U_r, U_c, labels, cfg.aggregation == 'sa')
  raise ValueError(f'unknown aggregation {cfg.aggregation!r}')


def _program_config(cfg: SynthesisConfig) -> SynthesisConfig:
  """The static part of `cfg`: its loss weights reduced to whether each term is computed."""

  def computed(weight: float) -> float:
    return 1.0 if cfg.every_term or weight > 0 else 0.0

  return cfg._replace(bn=computed(cfg.bn), oh=1.0, adv=computed(cfg.adv))


def _tx(cfg):
  return optax.adam(cfg.lr_g, b1=cfg.b1, b2=cfg.b2)


def _init(generator, cfg, key, gen_state):
  # fold_in instead of split and one draw for (G, z): every threefry call costs XLA:CPU compile time
  k_init, k_y, k_aug = key, jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)
  if gen_state is None:
    g, z = dense_generator_init(k_init, generator, noise_batch=cfg.batch_size)
  else:
    g = gen_state
    z = jax.random.normal(k_init, (cfg.batch_size, generator.nz), jnp.float32)
  opt_vars = (g.params, z) if cfg.optimize_z else g.params
  best_x = jnp.zeros((cfg.batch_size, *generator.img_shape), jnp.float32)
  carry = _Carry(
    opt_vars, g.batch_stats, _tx(cfg).init(opt_vars), best_x, jnp.asarray(jnp.inf, jnp.float32)
  )
  step_keys = (
    jax.random.split(k_aug, cfg.g_steps) if cfg.augment else jnp.zeros((cfg.g_steps,), jnp.uint32)
  )
  return carry, z, k_y, step_keys


def _targets(cfg, k_y, num_classes):
  y = jax.random.randint(k_y, (cfg.batch_size,), 0, num_classes, jnp.int32)
  return jnp.sort(y) if cfg.sort_targets else y


class _Programs(NamedTuple):
  """What a synthesis program is compiled for (static): the generator, the teachers' modules
  (one per group), the student's (None: no adversarial term) and `_program_config`'s settings."""

  generator: Any
  teacher_modules: Any
  student_module: Any
  cfg: Any


class _Models(NamedTuple):
  """The arrays a generator step reads: the teachers' stacked states, the student's state, the
  aggregation's inputs and the (bn, oh, adv) loss weights [3]."""

  teacher_states: Any
  student_state: Any
  agg: Any
  weights: Any


def _synthesis_step(programs: _Programs, carry: _Carry, k_aug, z_fixed, targets, models: _Models):
  """One generator step on the noise z_fixed (unless z is optimised) towards `targets`."""
  generator, teacher_modules, student_module, cfg = programs
  teacher_states, student_state, agg, weights = models
  strategy = cfg.strategy

  def loss_fn(ov, gen_bs):
    gp, z = ov if cfg.optimize_z else (ov, z_fixed)
    x, upd = generator.apply(
      {'params': gp, 'batch_stats': gen_bs}, z, train=True, mutable=['batch_stats']
    )
    xa = augment_images(k_aug, x, cfg.crop_padding, cfg.flip) if cfg.augment else x
    groups = [TeacherGroup(mod, st) for mod, st in zip(teacher_modules, teacher_states)]
    per_client, bn_losses = teacher_outputs(groups, xa, cfg.bn > 0, strategy)
    t = aggregate_teachers(cfg, per_client, targets, agg)
    zero = jnp.zeros((), jnp.float32)
    if cfg.bn > 0:
      l_bn = jnp.sum(bn_losses) if cfg.bn_model_reduction == 'sum' else jnp.mean(bn_losses)
    else:
      l_bn = zero
    if cfg.oh_loss == 'hard_sample':
      l_oh = hard_sample_cross_entropy(t, targets, cfg.hs)
    else:
      l_oh = cross_entropy(t, targets)
    if cfg.adv > 0 and student_module is not None:
      s = student_module.apply(
        {'params': student_state.params, 'batch_stats': student_state.batch_stats}, xa, train=False
      )
      l_adv = adversarial_loss(s, t, cfg.adv_T, cfg.adv_mask, cfg.adv_t_squared)
    else:
      l_adv = zero
    total = weights[0] * l_bn + weights[1] * l_oh + weights[2] * l_adv
    return total, (x, upd['batch_stats'], jnp.stack([l_bn, l_oh, l_adv]))

  (loss, (x, gen_bs, comps)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    carry.opt_vars, carry.gen_bs
  )
  better = loss < carry.best_loss
  best_x = jnp.where(better, x, carry.best_x)
  best_loss = jnp.where(better, loss, carry.best_loss)
  if cfg.grad_clip is not None:
    g_grads = grads[0] if cfg.optimize_z else grads
    norm = optax.tree_utils.tree_norm(g_grads)
    coef = jnp.minimum(cfg.grad_clip / (norm + 1e-6), 1.0)  # torch clip_grad_norm_
    g_grads = jax.tree.map(lambda g: g * coef, g_grads)
    grads = (g_grads, grads[1]) if cfg.optimize_z else g_grads
  updates, opt_state = _tx(cfg).update(grads, carry.opt_state, carry.opt_vars)
  opt_vars = optax.apply_updates(carry.opt_vars, updates)
  return _Carry(opt_vars, gen_bs, opt_state, best_x, best_loss), (
    loss,
    comps,
    x if cfg.keep == 'all' else None,
  )


def _finish(cfg, carry, z_fixed, targets, losses, comps, xs=None):
  gp = carry.opt_vars[0] if cfg.optimize_z else carry.opt_vars
  images, labels = carry.best_x, targets
  if cfg.keep == 'all':
    images = xs.reshape(-1, *xs.shape[2:])
    labels = jnp.tile(targets, cfg.g_steps)
  return SynthesisResult(
    images, labels, carry.best_loss, losses, comps, ModelState(gp, carry.gen_bs)
  )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _synthesize_scan(programs: _Programs, num_classes: int, key, models: _Models, gen_state):
  cfg = programs.cfg
  carry, z, k_y, step_keys = _init(programs.generator, cfg, key, gen_state)
  targets = _targets(cfg, k_y, num_classes)

  def body(c, k):
    return _synthesis_step(programs, c, k, z, targets, models)

  carry, (losses, comps, xs) = jax.lax.scan(body, carry, step_keys)
  return _finish(cfg, carry, z, targets, losses, comps, xs)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _py_init(generator, cfg, num_classes, key, gen_state):
  carry, z, k_y, step_keys = _init(generator, cfg, key, gen_state)
  return carry, z, _targets(cfg, k_y, num_classes), step_keys


_py_step = jax.jit(_synthesis_step, static_argnums=0)


def synthesize(
  generator: DenseGenerator,
  teacher_groups,
  student_module,
  student_state,
  num_classes: int,
  key: jax.Array,
  cfg: SynthesisConfig = SynthesisConfig(),
  agg: Any = None,
  generator_state: Optional[ModelState] = None,
) -> SynthesisResult:
  """One synthesis epoch. teacher_groups: TeacherGroup / (module, stacked ModelState) or a list;
  student_module/state: the model being distilled (None → no adversarial term). `agg`: per-model
  weights [K] for aggregation='weighted', SAWeights(U_r, U_c) for 'sa' / 'sa_inter'.
  `generator_state`: continue this generator instead of a fresh DENSE re-init.

  Args:
    generator: The generator module.
    teacher_groups: As above.
    student_module: As above; None drops the adversarial term.
    student_state: The student's ModelState (None with no student).
    num_classes: Number of classes the target labels are drawn from.
    key: PRNG key of the epoch (generator init, labels, augmentation).
    cfg: The synthesis settings.
    agg: As above.
    generator_state: As above; None re-initialises the generator.

  Returns:
    SynthesisResult (images, their target labels, losses and the trained generator).
  """
  groups = _as_groups(teacher_groups)
  modules = tuple(g.module for g in groups)
  states = tuple(g.states for g in groups)
  if cfg.aggregation in ('sa', 'sa_inter') and agg is not None:
    agg = (jnp.asarray(agg[0]), jnp.asarray(agg[1]))
  weights = jnp.asarray([cfg.bn, cfg.oh, cfg.adv], jnp.float32)
  cfg = _program_config(cfg)
  loop = cfg.loop
  if loop == 'auto':
    loop = 'python' if jax.default_backend() == 'cpu' else 'scan'
  programs = _Programs(generator, modules, student_module, cfg)
  models = _Models(states, student_state, agg, weights)
  if loop == 'scan':
    return _synthesize_scan(programs, num_classes, key, models, generator_state)
  carry, z, targets, step_keys = commit(_py_init(generator, cfg, num_classes, key, generator_state))
  losses, comps, xs = [], [], []
  for i in range(cfg.g_steps):
    carry, (l, c, x) = _py_step(programs, carry, step_keys[i], z, targets, models)
    losses.append(l)
    comps.append(c)
    xs.append(x)
  stacked = jnp.stack(xs) if cfg.keep == 'all' else None
  return _finish(cfg, carry, z, targets, jnp.stack(losses), jnp.stack(comps), stacked)
