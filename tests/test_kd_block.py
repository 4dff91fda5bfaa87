"""An epoch's KD steps in compiled blocks (`kd_block`, `kd_block_on_targets`) give the student
that the one-step-per-call loop gives (`kd_step`, `kd_step_on_targets`): the same batches, keys
and learning rates, the last block's unused steps skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import engine
from jfed.distill import kd
from jfed.distill.pool import epoch_batches, pool_add, pool_init
from jfed.engine import compiles, init_model
from jfed.engine.optim import OptimizerSpec
from jfed.models import get_model

SHAPE = (8, 8, 1)
CLASSES = 4
SPEC = OptimizerSpec('sgd', lr=0.05, momentum=0.9)


def _setup(pool_images: int):
  module = get_model('mlp', CLASSES, SHAPE)
  teachers = [init_model(module, SHAPE, jax.random.PRNGKey(k)) for k in (1, 2, 3)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *teachers)
  student = kd.student_state(SPEC, init_model(module, SHAPE, jax.random.PRNGKey(7)))
  rng = np.random.default_rng(0)
  pool = pool_init(pool_images + 8, SHAPE)
  images = jnp.asarray(rng.random((pool_images, *SHAPE), np.float32))
  pool = pool_add(pool, images, jnp.asarray(rng.integers(0, CLASSES, pool_images), jnp.int32))
  idx, mask = epoch_batches(pool, np.random.default_rng(1), 6)
  return module, (module,), (stacked,), student, pool, idx, mask


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def _aggregation_inputs(aggregation):
  """What `teacher_logits` needs per aggregation; away from uniform, so that a lost input shows."""
  rng = np.random.default_rng(11)
  if aggregation == 'weighted':
    return jnp.asarray([0.7, 0.2, 0.1], jnp.float32)
  if aggregation == 'sa':
    return tuple(jnp.asarray(rng.dirichlet(np.ones(3), CLASSES), jnp.float32) for _ in range(2))
  return None


@pytest.mark.parametrize(
  'kcfg',
  [
    kd.KDConfig(loss='kl', T=4.0, t_squared=True),
    kd.KDConfig(loss='fedhydra', augment='crop_flip', crop_padding=2, ods_eta=0.05),
    # the aggregation's inputs (client weights; FedHydra's U_r, U_c and the pool's labels) must
    # reach every step of a block
    kd.KDConfig(loss='kl', T=2.0, aggregation='weighted'),
    kd.KDConfig(loss='fedhydra', T=2.0, aggregation='sa'),
  ],
  ids=['kl', 'augmented_ods', 'weighted', 'sa'],
)
def test_kd_blocks_train_the_student_the_loop_trains(kcfg):
  module, modules, states, student, pool, idx, mask = _setup(111)  # 19 steps: 16 + 3
  assert idx.shape[0] > kd.KD_BLOCK
  key = jax.random.PRNGKey(5)
  agg = _aggregation_inputs(kcfg.aggregation)
  lrs = np.linspace(0.05, 0.01, idx.shape[0]).astype(np.float32)
  programs, teachers = kd.KDPrograms(kcfg, SPEC, modules, module), kd.Teachers(states, agg)
  looped, loop_losses = student, []
  for b in range(idx.shape[0]):
    looped, loss = kd.kd_step(
      programs, looped, teachers, *kd.gather_batch(pool, jnp.asarray(idx[b])),
      jnp.asarray(mask[b]), jax.random.fold_in(key, b), lrs[b],
    )  # fmt: skip
    loop_losses.append(float(loss))
  blocked, block_losses = student, []
  for first in range(0, idx.shape[0], kd.KD_BLOCK):
    blocked, losses, steps = kd.kd_block(
      programs, blocked, teachers, pool, kd.KDEpoch(idx, mask, lrs), key, first
    )
    block_losses.extend(np.asarray(losses)[:steps].tolist())
  np.testing.assert_allclose(block_losses, loop_losses, rtol=2e-5)
  _close(blocked, looped)
  assert not np.allclose(np.asarray(jax.tree.leaves(blocked.model.params)[0]),
                         np.asarray(jax.tree.leaves(student.model.params)[0]))  # fmt: skip


def test_kd_blocks_on_stored_targets_train_the_student_the_loop_trains():
  module, modules, states, student, pool, idx, mask = _setup(40)  # 7 steps: one partial block
  programs = kd.KDPrograms(kd.KDConfig(loss='fedhydra', T=2.0), SPEC, modules, module)
  targets = kd.pool_teacher_logits(programs, kd.Teachers(states), pool, jnp.arange(pool.capacity))
  lrs = np.full(idx.shape[0], 0.05, np.float32)
  looped, loop_losses = student, []
  for b in range(idx.shape[0]):
    x, t = kd.gather_batch_with_targets(pool, targets, jnp.asarray(idx[b]))
    looped, loss = kd.kd_step_on_targets(programs, looped, x, t, jnp.asarray(mask[b]), lrs[b])
    loop_losses.append(float(loss))
  blocked, losses, steps = kd.kd_block_on_targets(
    programs, student, pool, targets, kd.KDEpoch(idx, mask, lrs), 0
  )
  assert steps == idx.shape[0] < kd.KD_BLOCK == len(losses)
  np.testing.assert_allclose(np.asarray(losses)[:steps], loop_losses, rtol=2e-5)
  _close(blocked, looped)


@pytest.mark.parametrize(
  'stored, aggregation',
  [(False, 'mean'), (True, 'mean'), (False, 'sa')],
  ids=['teachers', 'stored_targets', 'sa_teachers'],
)
def test_an_epoch_of_kd_steps_is_the_same_per_call_and_in_blocks(stored, aggregation):
  """`run_kd_steps`, what the one-shot methods call per epoch: one call a step on the CPU, blocks
  on an accelerator (`kd_block_size`), the same student and losses either way (with FedHydra's SA
  inputs too)."""
  module, modules, states, student, pool, idx, mask = _setup(111)
  kcfg = kd.KDConfig(
    loss='fedhydra', T=2.0, augment='none' if stored else 'flip', aggregation=aggregation
  )
  programs = kd.KDPrograms(kcfg, SPEC, modules, module)
  teachers = kd.Teachers(states, _aggregation_inputs(aggregation))
  targets = None
  if stored:
    targets = kd.pool_teacher_logits(programs, teachers, pool, jnp.arange(pool.capacity))
  epoch = kd.KDEpoch(idx, mask, np.linspace(0.05, 0.01, idx.shape[0]).astype(np.float32))
  args = (programs, student, teachers, pool, epoch, jax.random.PRNGKey(3), targets)
  per_call, per_call_losses = kd.run_kd_steps(*args, block=1)
  # the MLP student has no BatchNorm: its (empty) statistics keep their structure for a resume
  assert jax.tree.structure(per_call) == jax.tree.structure(student)
  for block in (kd.KD_BLOCK, 5):  # 19 steps: 16 + 3, and 5 + 5 + 5 + 4
    blocked, blocked_losses = kd.run_kd_steps(*args, block=block)
    assert per_call_losses.shape == blocked_losses.shape == (idx.shape[0],)
    np.testing.assert_allclose(blocked_losses, per_call_losses, rtol=2e-5)
    _close(blocked, per_call)
  assert (kd.kd_block_size('cpu'), kd.kd_block_size('gpu')) == (1, kd.KD_BLOCK)


def test_an_unknown_kd_loss_is_refused_naming_the_choices():
  s = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match=r"KD loss must be one of \('kl', 'fedhydra'\), got 'ce'"):
    kd.per_sample_loss(kd.KDConfig(loss='ce'), s, s)


@pytest.mark.parametrize('real', [1, 5])
def test_a_padded_kd_step_is_the_step_on_its_real_samples(real):
  """Padding (mask 0) is left out of the loss, its mean and the BatchNorm statistics; the loss
  is the mean over the real samples of T^2 KL(softmax(t/T) || softmax(s/T)) (DENSE's KD), also
  for one real sample."""
  module = get_model('cnn_mnist', CLASSES, SHAPE)
  student = kd.student_state(SPEC, init_model(module, SHAPE, jax.random.PRNGKey(7)))
  rng = np.random.default_rng(3)
  x = rng.random((8, *SHAPE), np.float32)
  x[real:] = 50.0  # padding far from the real images: a leak moves the BN statistics
  t = rng.normal(size=(8, CLASSES)).astype(np.float32)
  kcfg, T = kd.KDConfig(loss='kl', T=4.0, t_squared=True), 4.0
  programs = kd.KDPrograms(kcfg, SPEC, (), module)
  padded, padded_loss = kd.kd_step_on_targets(
    programs, student, jnp.asarray(x), jnp.asarray(t), jnp.arange(8) < real, 0.05
  )
  alone, alone_loss = kd.kd_step_on_targets(
    programs, student, jnp.asarray(x[:real]), jnp.asarray(t[:real]), jnp.ones(real, bool), 0.05
  )
  _close(padded, alone)
  s, _ = module.apply(
    {'params': student.model.params, 'batch_stats': student.model.batch_stats},
    jnp.asarray(x[:real]),
    train=True,
    mutable=['batch_stats'],
  )
  s = np.asarray(s, np.float64) / T
  log_q = (
    s - np.log(np.exp(s - s.max(1, keepdims=True)).sum(1, keepdims=True)) - s.max(1, keepdims=True)
  )
  p = np.exp(t[:real] / T) / np.exp(t[:real] / T).sum(1, keepdims=True)
  want = T**2 * np.mean(np.sum(p * (np.log(p) - log_q), axis=1))
  np.testing.assert_allclose(float(padded_loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(alone_loss), want, rtol=1e-5)


def test_auto_kd_augmentation_is_crop_flip_on_cifar_and_flip_elsewhere():
  """DENSE's and Co-Boosting's KD augment CIFAR with crop + flip and the greyscale sets with a
  flip only; a named kind is kept, an unknown one refused naming the choices."""
  assert kd.resolve_augment('auto', 'cifar10') == 'crop_flip'
  assert kd.resolve_augment('auto', 'CIFAR100') == 'crop_flip'
  assert kd.resolve_augment('auto', 'fashion_mnist') == 'flip'
  assert kd.resolve_augment('none', 'cifar10') == 'none'
  assert kd.resolve_augment('flip', 'cifar10') == 'flip'
  valid = ', '.join(kd.KD_AUGMENT)
  with pytest.raises(ValueError, match=rf"^Unknown KD augmentation 'rotate'; valid: {valid}$"):
    kd.resolve_augment('rotate', 'cifar10')


@pytest.mark.parametrize(
  'shape, padding', [((28, 28, 1), 4), ((32, 32, 3), 4), ((8, 8, 1), 1), ((27, 27, 1), 3),
                     ((16, 24, 1), 2), ((4, 4, 1), 1)],
)  # fmt: skip
def test_kd_crop_padding_is_denses_4_from_28_pixels_and_an_eighth_of_the_height_below(
  shape, padding
):
  assert kd.crop_padding(shape) == padding


def test_kd_views_crop_only_under_crop_flip_and_flip_otherwise():
  """'flip' mirrors some images and leaves the rest; 'crop_flip' also shifts them (padding 2), so
  some view is neither the image nor its mirror; 'none' is the batch itself."""
  x = jnp.asarray(np.random.default_rng(0).random((16, *SHAPE), np.float32))
  key = jax.random.PRNGKey(4)

  def kinds(view):
    same = [np.allclose(view[i], x[i]) for i in range(16)]
    mirrored = [np.allclose(view[i], x[i, :, ::-1]) for i in range(16)]
    return same, mirrored

  none = kd._kd_view(kd.KDConfig(augment='none'), key, x)
  np.testing.assert_array_equal(np.asarray(none), np.asarray(x))
  same, mirrored = kinds(kd._kd_view(kd.KDConfig(augment='flip'), key, x))
  assert all(s or m for s, m in zip(same, mirrored)) and any(mirrored) and any(same)
  same, mirrored = kinds(kd._kd_view(kd.KDConfig(augment='crop_flip', crop_padding=2), key, x))
  assert not all(s or m for s, m in zip(same, mirrored))


@pytest.mark.parametrize('block', [1, kd.KD_BLOCK])
def test_an_epoch_without_steps_leaves_the_student_and_has_no_losses(block):
  module, modules, states, student, pool, idx, mask = _setup(40)
  ts, losses = kd.run_kd_steps(
    kd.KDPrograms(kd.KDConfig(), SPEC, modules, module), student, kd.Teachers(states), pool,
    kd.KDEpoch(idx[:0], mask[:0], np.zeros(0, np.float32)), jax.random.PRNGKey(0), block=block,
  )  # fmt: skip
  assert losses.shape == (0,) and losses.dtype == np.float32
  _close(ts, student)


def test_ods_leaves_a_pixel_no_teacher_sees_where_it_is():
  """Co-Boosting's ODS moves x by eta · sign(∇x score): a pixel no teacher reads has a zero
  gradient and stays (a division by the sign would send it to infinity)."""
  module, modules, (stacked,), student, pool, idx, mask = _setup(40)
  first_kernel = stacked.params['Dense_0']['kernel']  # [teachers, pixels, hidden]
  params = {**stacked.params, 'Dense_0': {**stacked.params['Dense_0']}}
  params['Dense_0']['kernel'] = first_kernel.at[:, 0, :].set(0.0)
  states = (stacked._replace(params=params),)
  kcfg = kd.KDConfig(loss='kl', T=2.0, augment='none', ods_eta=0.1)
  ts, loss = kd.kd_step(
    kd.KDPrograms(kcfg, SPEC, modules, module), student, kd.Teachers(states),
    *kd.gather_batch(pool, jnp.asarray(idx[0])), jnp.asarray(mask[0]), jax.random.PRNGKey(2), 0.05,
  )  # fmt: skip
  assert np.isfinite(float(loss))
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(ts.model.params))


def test_a_committed_start_shares_one_program_with_the_steps_after_it():
  """A loop's first call on fresh arrays and its later calls on outputs of steps on committed
  teachers compile one program only if the start is committed (`kd.committed`)."""
  step = jax.jit(lambda w, teacher: w * 0.5 + teacher)
  teacher = engine.commit(jnp.ones(3))
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    w = kd.committed(jnp.zeros(3))
    for _ in range(3):
      w = step(w, teacher)
  assert compiled.counts()['jit(<lambda>)'] == 1, compiled.summary()
  assert w.committed
