"""Knowledge distillation into a server (student) model: the compiled KD step and its settings.

`kd_step` is one student step on a batch gathered from a pool (`gather_batch`: synthetic images
with their generator targets, or a fixed unlabelled set): the KD view of the images
(augmentation, Co-Boosting ODS), the teachers' combined logits, the student loss (`KDConfig`)
and one optimiser step (`jfed.engine.optim`, with the learning rate set by the caller for this
step). It is jitted at module level, so one process compiles it once per (settings,
architectures, batch shape): it takes the gathered batch rather than the pool, whose capacity
(epochs × synthesis batch) would otherwise make every budget compile its own step.

Where a stored image's target cannot change within a round (`targets_depend_only_on_the_image`
and teacher weights fixed for the round: FedHydra's defaults), the loop computes the targets
once per image (`pool_teacher_logits`) and steps with `kd_step_on_targets`, the same student
update without the teachers.
"""

import dataclasses
import functools
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfed.distill.ensemble import TeacherGroup, teacher_outputs
from jfed.distill.losses import cross_entropy, kl_divergence
from jfed.distill.pool import ImagePool, augment, pool_gather
from jfed.distill.synthesis import aggregate_teachers
from jfed.engine.optim import OptimizerSpec, build_optimizer, set_learning_rate
from jfed.engine.state import ModelState, TrainState

KD_LOSSES = ('kl', 'fedhydra')
KD_AUGMENT = ('auto', 'none', 'flip', 'crop_flip')


class KDConfig(NamedTuple):
  """How one KD step turns a batch into a student loss (static: part of the compiled step).

  loss 'kl':       Σ_c KL_elem(softmax(t/T) ‖ softmax(s/T)) per sample (× T² if t_squared),
                   averaged over the real samples = F.kl_div(..., 'batchmean') (DENSE, FedDF,
                   Co-Boosting `KLDiv`).
  loss 'fedhydra': Eq. 19 per sample: the same KL (Eq. 17) + β · CE(s, argmax t) (Eq. 18).
  aggregation:     teacher logits t from the per-client logits (synthesis.aggregate_teachers):
                   'mean' (DENSE, FedDF avg_logits), 'weighted' (Co-Boosting, weights from the
                   method), 'sa' / 'sa_inter' (FedHydra SA with the pool's target labels).
  augment:         KD view of a stored image: 'none', 'flip' (HFlip), 'crop_flip'
                   (RandomCrop(pad) + HFlip).
  teacher_bn:      'running' (teachers in eval mode: BN running statistics; DENSE,
                   Co-Boosting) or 'batch' (BN on each KD batch's statistics: FedDF's reference
                   never calls eval() on its teachers).
  ods_eta:         Co-Boosting ODS: x ← x + eta · sign(∇_x Σ r ⊙ softmax(t(x)/ods_T)), r ~ U(−1, 1).
  """

  loss: str = 'kl'
  T: float = 1.0
  t_squared: bool = False
  beta: float = 1.0
  aggregation: str = 'mean'
  augment: str = 'none'
  crop_padding: int = 4
  ods_eta: float = 0.0
  ods_T: float = 4.0
  strategy: str = 'auto'
  teacher_bn: str = 'running'


def resolve_augment(kind: str, dataset_name: str) -> str:
  """'auto' = DENSE's KD transform: RandomCrop + HFlip for CIFAR, HFlip for the others."""
  if kind not in KD_AUGMENT:
    raise ValueError(f'Unknown KD augmentation {kind!r}; valid: {", ".join(KD_AUGMENT)}')
  if kind != 'auto':
    return kind
  return 'crop_flip' if 'cifar' in dataset_name.lower() else 'flip'


def crop_padding(input_shape: Sequence[int]) -> int:
  """RandomCrop padding 4 (DENSE, 28/32 px); H // 8 for small images (1 px on 8×8 digits)."""
  return 4 if min(input_shape[:2]) >= 28 else max(1, int(input_shape[0]) // 8)


def committed(tree: Any) -> Any:
  """The tree on the default device, committed. jit's cache key includes whether an argument
  is committed, and the outputs of a jitted step are: committing the inputs up front keeps the
  first and later epochs on one compiled program instead of two."""
  return jax.device_put(tree, jax.devices()[0])


def teacher_groups(modules: Sequence[Any], states: Sequence[ModelState]) -> List[TeacherGroup]:
  """TeacherGroups from the parallel tuples a jitted function takes (modules are static)."""
  return [TeacherGroup(m, s) for m, s in zip(modules, states)]


def student_optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
  """The student's optimiser; `kd_step` sets the learning rate of every step (see optim)."""
  return build_optimizer(spec._replace(schedule='constant'))


def student_state(spec: OptimizerSpec, model: ModelState) -> TrainState:
  return TrainState(model, student_optimizer(spec).init(model.params))


def teacher_logits(kcfg: KDConfig, modules, states, x, y, agg):
  """The aggregated teacher logits of the batch (x, y), as the KD step uses them.

  Args:
    kcfg: How teachers are run (strategy, teacher_bn) and aggregated (aggregation).
    modules: Per teacher group, the flax module (static).
    states: Per teacher group, its stacked ModelState.
    x: Images [B, H, W, C].
    y: Their target labels [B] (used by FedHydra's stratified aggregation).
    agg: What the aggregation needs: None ('mean'), per-client weights ('weighted') or
      (U_r, U_c) ('sa', 'sa_inter').

  Returns:
    Teacher logits [B, num_classes].
  """
  per_client, _ = teacher_outputs(
    teacher_groups(modules, states), x, False, kcfg.strategy, kcfg.teacher_bn == 'batch'
  )
  return aggregate_teachers(kcfg, per_client, y, agg)


def per_sample_loss(kcfg: KDConfig, s: jnp.ndarray, t: jnp.ndarray) -> jnp.ndarray:
  """The KD loss of each sample (`kcfg.loss`; see KDConfig), teachers detached.

  Args:
    kcfg: The KD configuration (loss, T, t_squared, beta).
    s: Student logits [B, C].
    t: Teacher logits [B, C].

  Returns:
    The loss per sample, shape [B].
  """
  t = jax.lax.stop_gradient(t)
  kl = jnp.sum(kl_divergence(s, t, kcfg.T, 'none', kcfg.t_squared), axis=-1)
  if kcfg.loss == 'kl':
    return kl
  if kcfg.loss == 'fedhydra':
    return kl + kcfg.beta * cross_entropy(s, jnp.argmax(t, -1), 'none')
  raise ValueError(f'KD loss must be one of {KD_LOSSES}, got {kcfg.loss!r}')


def _kd_view(kcfg: KDConfig, key, x):
  if kcfg.augment == 'none':
    return x
  return augment(key, x, kcfg.crop_padding if kcfg.augment == 'crop_flip' else 0, True)


@jax.jit
def gather_batch(pool: ImagePool, idx: jnp.ndarray):
  """The KD batch pool[idx] as (float32 images, labels), for `kd_step`."""
  return pool_gather(pool, idx)


@dataclasses.dataclass(frozen=True)
class KDPrograms:
  """What a KD program is compiled for, one static (hashable) argument: the KD settings, the
  student's optimiser, the teachers' flax modules (one per teacher group) and the student's."""

  kcfg: KDConfig
  spec: OptimizerSpec
  teacher_modules: Tuple[Any, ...]
  student_module: Any


class Teachers(NamedTuple):
  """The teachers' arrays a KD step reads: per teacher group its stacked ModelState, and what
  the aggregation needs (see `teacher_logits`)."""

  states: Tuple[ModelState, ...]
  agg: Any = None


class KDEpoch(NamedTuple):
  """An epoch's KD batches, on the host: pool indices [steps, B], their mask [steps, B] (1 for
  real samples, 0 for padding) and each step's learning rate [steps]."""

  idx: np.ndarray
  mask: np.ndarray
  lrs: np.ndarray


def _teacher_logits(programs: KDPrograms, teachers: Teachers, x, y):
  return teacher_logits(
    programs.kcfg, programs.teacher_modules, teachers.states, x, y, teachers.agg
  )


def kd_step(programs: KDPrograms, ts: TrainState, teachers: Teachers, x, y, mask, key, lr):
  """One student step on a batch gathered from the pool (`gather_batch`).

  Args:
    programs: What the step is compiled for (static).
    ts: The student's TrainState.
    teachers: The teachers' states and aggregation inputs.
    x: Images [B, H, W, C].
    y: Their target labels [B].
    mask: [B], 1 for real samples and 0 for padding.
    key: PRNG key of the step (augmentation, ODS noise).
    lr: Learning rate of this step.

  Returns:
    (new TrainState, mean loss over the real samples).
  """
  kcfg = programs.kcfg
  k_aug, k_ods = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
  x = _kd_view(kcfg, k_aug, x)
  if kcfg.ods_eta > 0:
    r = jax.random.uniform(
      k_ods, (x.shape[0], programs.student_module.num_classes), minval=-1.0, maxval=1.0
    )
    score = lambda xx: jnp.sum(
      r * jax.nn.softmax(_teacher_logits(programs, teachers, xx, y) / kcfg.ods_T)
    )
    x = jax.lax.stop_gradient(x + kcfg.ods_eta * jnp.sign(jax.grad(score)(x)))
  t = _teacher_logits(programs, teachers, x, y)
  return _student_step(programs, ts, x, t, mask, lr)


# The step's body is also the body of `kd_block`'s loop; jitted, it keeps its name (the compile
# counts of tests/test_driver.py name programs by it).
_kd_update = kd_step
kd_step = jax.jit(kd_step, static_argnums=0)

# The steps of one compiled KD block (`kd_block`, `kd_block_on_targets`): an epoch's steps run
# as ceil(steps / KD_BLOCK) calls of one program, the last block's unused steps skipped.
KD_BLOCK = 16


def kd_block_size(backend: Optional[str] = None) -> int:
  """Steps per compiled KD call on `backend` (default: JAX's): KD_BLOCK on an accelerator,
  where a small step costs little more than its dispatch; 1 on the CPU, where XLA runs the
  same step about 10x slower inside a loop than called from Python (FedHydra's KD pass over
  8,192 images, 5 CNNMnist teachers, 2 cores: 20.2 s a call per step, 203 s in blocks;
  `experiments.bench.model_stratification --stages=hydra_kd --pool=8192`, 2026-11-27)."""
  return 1 if (backend or jax.default_backend()) == 'cpu' else KD_BLOCK


def run_kd_steps(
  programs: KDPrograms,
  ts: TrainState,
  teachers: Teachers,
  pool: ImagePool,
  epoch: KDEpoch,
  key,
  targets=None,
  block: Optional[int] = None,
) -> Tuple[TrainState, np.ndarray]:
  """An epoch's KD steps: step j on pool[epoch.idx[j]] with key fold_in(key, j) and learning
  rate epoch.lrs[j]. One call per step (`kd_step`), or `block` steps per call (`kd_block`).

  Args:
    programs: What the steps are compiled for (static).
    ts: The student's TrainState.
    teachers: The teachers' states and aggregation inputs.
    pool: The image pool the batches are gathered from.
    epoch: The epoch's batches and learning rates.
    key: The epoch's KD key.
    targets: The stored teacher logits of every pool slot [capacity, C]
      (`pool_teacher_logits`), used instead of the teachers; or None.
    block: Steps per compiled call; None for `kd_block_size()`.

  Returns:
    (the trained TrainState, the loss of each step [steps], on the host).
  """
  block = kd_block_size() if block is None else block
  steps, losses = epoch.idx.shape[0], []
  if block > 1:
    for first in range(0, steps, block):
      if targets is not None:
        ts, loss, n = kd_block_on_targets(programs, ts, pool, targets, epoch, first, block)
      else:
        ts, loss, n = kd_block(programs, ts, teachers, pool, epoch, key, first, block)
      losses.append((loss, n))
  else:
    for b in range(steps):
      batch_idx, batch_mask = jnp.asarray(epoch.idx[b]), jnp.asarray(epoch.mask[b])
      lr = epoch.lrs[b]
      if targets is not None:
        x, t = gather_batch_with_targets(pool, targets, batch_idx)
        ts, loss = kd_step_on_targets(programs, ts, x, t, batch_mask, lr)
      else:
        x, y = gather_batch(pool, batch_idx)
        ts, loss = kd_step(programs, ts, teachers, x, y, batch_mask, jax.random.fold_in(key, b), lr)
      losses.append((loss, 1))
  out = [np.asarray(loss).reshape(-1)[:n] for loss, n in losses]  # one wait, at the end
  return ts, np.concatenate(out) if out else np.zeros(0, np.float32)


def _block_rows(epoch: KDEpoch, first: int, size: int):
  """Rows `first` .. `first + size - 1` of an epoch's batches, padded to `size` steps: (idx,
  mask, step numbers, learning rates, active)."""
  n = epoch.idx.shape[0]
  rows = min(size, n - first)
  pad = size - rows

  def take(a, fill):
    a = np.asarray(a[first : first + rows])
    return np.concatenate([a, np.full((pad, *a.shape[1:]), fill, a.dtype)]) if pad else a

  steps = np.arange(first, first + size, dtype=np.int32)
  active = np.arange(size) < rows
  lrs = take(np.asarray(epoch.lrs, np.float32), 0.0)
  return take(epoch.idx, 0), take(epoch.mask, False), steps, lrs, active


def _scan_steps(update, ts, xs, active):
  """`update(ts, x) -> (ts, loss)` over the block's rows, inactive rows leaving ts as it is."""

  def body(ts, row):
    x, on = row
    return jax.lax.cond(on, update, lambda t, _: (t, jnp.float32(0.0)), ts, x)

  return jax.lax.scan(body, ts, (xs, active))


# The block's batches are gathered before the block (one cheap gather program per pool
# capacity), so the block itself compiles once per (settings, architectures, batch shape), as
# `kd_step` does, whatever the budget.
@functools.partial(jax.jit, static_argnums=0)
def _kd_block(programs: KDPrograms, ts, teachers: Teachers, rows, key, active):
  """`_kd_update` over rows = (images, labels, masks, step numbers, learning rates)."""

  def update(ts, row):
    x, y, m, step, lr = row
    return _kd_update(programs, ts, teachers, x, y, m, jax.random.fold_in(key, step), lr)

  return _scan_steps(update, ts, rows, active)


def kd_block(
  programs: KDPrograms,
  ts: TrainState,
  teachers: Teachers,
  pool: ImagePool,
  epoch: KDEpoch,
  key,
  first: int,
  size: int = KD_BLOCK,
) -> Tuple[TrainState, jnp.ndarray, int]:
  """Steps `first` .. `first + size - 1` of an epoch's KD (`kd_step` on pool[epoch.idx[j]] with
  key fold_in(key, j) and learning rate epoch.lrs[j]) as one compiled program: an epoch of many
  small steps pays one dispatch per block instead of one per step.

  Args:
    programs: What the block is compiled for (static).
    ts: The student's TrainState.
    teachers: The teachers' states and aggregation inputs.
    pool: The image pool the batches are gathered from.
    epoch: The epoch's batches and learning rates.
    key: The epoch's KD key (step j's key is fold_in(key, j)).
    first: The block's first step.
    size: The block's steps (one compiled program per size).

  Returns:
    (new TrainState, the loss of each of the block's `size` slots, the number of steps run:
    min(size, steps - first), the first slots; the losses stay on the device, so that blocks
    are dispatched without waiting).
  """
  idx, mask, steps, lr, active = _block_rows(epoch, first, size)
  xs, ys = gather_batch(pool, idx)
  ts, losses = _kd_block(programs, ts, teachers, (xs, ys, mask, steps, lr), key, active)
  return ts, losses, int(active.sum())


@functools.partial(jax.jit, static_argnums=0)
def _kd_block_on_targets(programs: KDPrograms, ts, rows, active):
  """`_student_step` over rows = (images, teacher logits, masks, learning rates)."""

  def update(ts, row):
    x, t, m, lr = row
    return _student_step(programs, ts, x, t, m, lr)

  return _scan_steps(update, ts, rows, active)


def kd_block_on_targets(
  programs: KDPrograms,
  ts: TrainState,
  pool: ImagePool,
  targets,
  epoch: KDEpoch,
  first: int,
  size: int = KD_BLOCK,
) -> Tuple[TrainState, jnp.ndarray, int]:
  """`kd_block` with the stored teacher logits (`kd_step_on_targets` per step).

  Args:
    programs: What the block is compiled for (static).
    ts: The student's TrainState.
    pool: The image pool the batches are gathered from.
    targets: The stored teacher logits of every pool slot, [capacity, C].
    epoch: The epoch's batches and learning rates.
    first: The block's first step.
    size: The block's steps.

  Returns:
    As `kd_block`'s.
  """
  idx, mask, _, lr, active = _block_rows(epoch, first, size)
  xs, t = gather_batch_with_targets(pool, targets, idx)
  ts, losses = _kd_block_on_targets(programs, ts, (xs, t, mask, lr), active)
  return ts, losses, int(active.sum())


def targets_depend_only_on_the_image(kcfg: KDConfig) -> bool:
  """Whether a stored image's teacher logits are the same at every KD step of a round (given
  teacher aggregation weights that are fixed in the round): no random KD view, no ODS step,
  eval-mode teachers (a sample's logits do not depend on the rest of its batch)."""
  return kcfg.augment == 'none' and kcfg.ods_eta == 0 and kcfg.teacher_bn == 'running'


@functools.partial(jax.jit, static_argnums=0)
def pool_teacher_logits(programs: KDPrograms, teachers: Teachers, pool: ImagePool, idx):
  """The aggregated teacher logits of the stored images pool[idx], as `kd_step` computes them
  (for `kd_step_on_targets`; valid when `targets_depend_only_on_the_image`).

  Args:
    programs: What the teachers are compiled for (static).
    teachers: The teachers' states and aggregation inputs.
    pool: The image pool.
    idx: Indices into the pool, shape [B].

  Returns:
    Teacher logits [B, num_classes].
  """
  x, y = pool_gather(pool, idx)
  return _teacher_logits(programs, teachers, x, y)


@jax.jit
def gather_batch_with_targets(pool: ImagePool, targets: jnp.ndarray, idx: jnp.ndarray):
  """The KD batch pool[idx] with its stored teacher logits targets[idx].

  Args:
    pool: The image pool.
    targets: The stored teacher logits of every pool slot, shape [capacity, C].
    idx: Indices into the pool, shape [B].

  Returns:
    (images [B, H, W, C], teacher logits [B, C]).
  """
  x, _ = pool_gather(pool, idx)
  return x, targets[idx]


@functools.partial(jax.jit, static_argnums=0)
def kd_step_on_targets(programs: KDPrograms, ts: TrainState, x, t, mask, lr):
  """`kd_step` with the teacher logits given (`pool_teacher_logits`): the same student step
  without the teachers' forward pass, about 40 % of a FedHydra KD step with five CNNMnist
  teachers on CPU (`experiments.bench.model_stratification --stages=hydra_kd`).

  Args:
    programs: What the step is compiled for (static).
    ts: The student's TrainState.
    x: Images [B, H, W, C].
    t: Their teacher logits [B, C].
    mask: [B], 1 for real samples and 0 for padding.
    lr: Learning rate of this step.

  Returns:
    (new TrainState, mean loss over the real samples).
  """
  return _student_step(programs, ts, x, t, mask, lr)


def _student_step(programs: KDPrograms, ts: TrainState, x, t, mask, lr):
  kcfg, student_module = programs.kcfg, programs.student_module
  t = jax.lax.stop_gradient(t)
  w = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(w), 1.0)

  def objective(params):
    s, upd = student_module.apply(
      {'params': params, 'batch_stats': ts.model.batch_stats},
      x,
      train=True,
      mask=mask,
      mutable=['batch_stats'],
    )
    loss = jnp.sum(per_sample_loss(kcfg, s, t) * w) / count
    return loss, upd.get('batch_stats', ts.model.batch_stats)

  (loss, new_bs), grads = jax.value_and_grad(objective, has_aux=True)(ts.model.params)
  opt_state = set_learning_rate(ts.opt_state, lr)
  updates, opt_state = student_optimizer(programs.spec).update(grads, opt_state, ts.model.params)
  return TrainState(
    ModelState(optax.apply_updates(ts.model.params, updates), new_bs), opt_state
  ), loss
