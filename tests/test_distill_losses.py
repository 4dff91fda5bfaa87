"""jfed.distill losses, generator, ensemble, pool, synthesis and the KD step against naive NumPy
formulas."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed.distill import ensemble, generator, kd, losses, plots, pool, synthesis
from jfed.engine import compiles, optim
from jfed.engine.state import ModelState
from jfed.models.layers import BatchNorm
from tests.support import shared_fixture_scope

# Jitted (a flax module hashes by its fields): run op by op, `init` compiled one program per op.
_init = jax.jit(lambda module, key, x: module.init(key, x), static_argnums=0)

# ----------------------------------------------------------------------------- naive references


def np_log_softmax(a):
  a = np.asarray(a, np.float64)
  m = a.max(-1, keepdims=True)
  return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))


def np_kl_elem(s, t, T):
  logp, logq = np_log_softmax(np.asarray(t) / T), np_log_softmax(np.asarray(s) / T)
  return np.exp(logp) * (logp - logq)


def np_ce(logits, y):
  lp = np_log_softmax(logits)
  return np.array([-lp[i, y[i]] for i in range(len(y))])


@pytest.fixture(scope='module')
def logits():
  rng = np.random.default_rng(0)
  s = rng.normal(size=(6, 5)).astype(np.float32) * 2
  t = rng.normal(size=(6, 5)).astype(np.float32) * 2
  t[0] = s[0] + 0.1  # make some argmax agree, some not
  t[1] = s[1]
  y = rng.integers(0, 5, 6).astype(np.int32)
  return s, t, y


# ----------------------------------------------------------------------------- losses


@pytest.mark.parametrize('T', [1.0, 4.0])
@pytest.mark.parametrize('t_squared', [False, True])
def test_kl_divergence_reductions(logits, T, t_squared):
  s, t, _ = logits
  elem = np_kl_elem(s, t, T) * (T * T if t_squared else 1.0)
  B, C = s.shape
  want = {
    'none': elem,
    'sum': elem.sum(),
    'batchmean': elem.sum() / B,
    'mean': elem.sum() / (B * C),
  }
  for red, w in want.items():
    got = losses.kl_divergence(jnp.asarray(s), jnp.asarray(t), T, red, t_squared)
    np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"^reduction must be one of .*'batchmean'.*, got 'avg'$"):
    losses.kl_divergence(s, t, T, 'avg')


def test_cross_entropy_and_hard_sample(logits):
  s, _, y = logits
  ce = np_ce(s, y)

  @jax.jit  # run op by op, the losses compiled ~20 one-primitive programs (cold time)
  def run(s, y):
    hard = [losses.hard_sample_cross_entropy(s, y, hs) for hs in (1.0, 2.5)]
    # p_y is detached: gradient = (1 - p_y)^hs * dCE only
    g = jax.grad(lambda a: losses.hard_sample_cross_entropy(a, y, 1.0))(s)
    return losses.cross_entropy(s, y), losses.cross_entropy(s, y, 'none'), hard, g

  mean_ce, ce_none, hard, g = run(jnp.asarray(s), jnp.asarray(y))
  with pytest.raises(ValueError, match="reduction must be mean or none, got 'sum'"):
    losses.cross_entropy(jnp.asarray(s), jnp.asarray(y), 'sum')
  np.testing.assert_allclose(mean_ce, ce.mean(), rtol=1e-5)
  np.testing.assert_allclose(ce_none, ce, rtol=1e-5)
  p_y = np.exp(-ce)
  for hs, got in zip((1.0, 2.5), hard):
    want = np.mean((1 - p_y) ** hs * ce)
    np.testing.assert_allclose(got, want, rtol=1e-5)
  sm = np.exp(np_log_softmax(s))
  onehot = np.eye(5)[y]
  want_g = ((1 - p_y)[:, None] * (sm - onehot)) / len(y)
  np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-4, atol=1e-6)


def test_adversarial_loss(logits):
  s, t, _ = logits
  B = s.shape[0]
  mask = np.array([float(np.argmax(s[b]) != np.argmax(t[b])) for b in range(B)])
  assert 0 < mask.sum() < B
  per = np_kl_elem(s, t, 1.0).sum(1)
  np.testing.assert_allclose(
    losses.adversarial_loss(s, t, 1.0, True, False), -np.mean(mask * per), rtol=1e-5
  )
  per3 = np_kl_elem(s, t, 3.0).sum(1) * 9.0  # Co-Boosting: T=3, x T^2, no mask
  np.testing.assert_allclose(
    losses.adversarial_loss(s, t, T=3.0, use_mask=False, t_squared=True), -np.mean(per3), rtol=1e-5
  )


# ----------------------------------------------------------------------------- BN loss


class BNNet(nn.Module):
  """x → BN → flatten → Dense(6) → BN → Dense(3): BN inputs computable in NumPy."""

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = BatchNorm(name='bn_a')(x, train, mask)
    x = x.reshape(x.shape[0], -1)
    x = nn.Dense(6, name='fc1')(x)
    x = BatchNorm(name='bn_b')(x, train, mask)
    return nn.Dense(3, name='fc2')(nn.relu(x))


def _bnnet_state(key, seed=1, shape=(4, 4, 2)):
  net = BNNet()
  v = _init(net, key, jnp.zeros((2, *shape)))
  rng = np.random.default_rng(seed)
  bs = jax.tree.map(
    lambda a: jnp.asarray(rng.normal(size=a.shape).astype(np.float32)), v['batch_stats']
  )
  return net, _bnnet_perturbed(v['params'], bs)


@jax.jit  # one program for every call (run op by op: one per op and leaf shape)
def _bnnet_perturbed(params, bs):
  bs = jax.tree_util.tree_map_with_path(
    lambda p, a: jnp.abs(a) + 0.5 if p[-1].key == 'var' else a, bs
  )
  return ModelState(jax.tree.map(lambda a: a + 0.1, params), bs)


def test_bn_statistics_loss_formula():
  rng = np.random.default_rng(2)
  # hand-built collections in jfed.models.layers.BatchNorm's format
  stats = {
    n: (rng.normal(size=c).astype(np.float32), rng.random(c).astype(np.float32))
    for n, c in [('l0', 3), ('l1', 5)]
  }
  run = {
    n: (rng.normal(size=c).astype(np.float32), rng.random(c).astype(np.float32) + 0.1)
    for n, c in [('l0', 3), ('l1', 5)]
  }
  bn_inputs = {n: {'stats': ((jnp.asarray(m), jnp.asarray(v)),)} for n, (m, v) in stats.items()}
  batch_stats = {
    n: {'bn': {'mean': jnp.asarray(m), 'var': jnp.asarray(v)}} for n, (m, v) in run.items()
  }
  want = sum(
    np.linalg.norm(run[n][1] - stats[n][1]) + np.linalg.norm(run[n][0] - stats[n][0]) for n in stats
  )
  got = losses.bn_statistics_loss(bn_inputs, batch_stats)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), batch_stats)  # two models at once
  message = r'^bn_statistics_loss takes one model: per-channel statistics, got shapes {} and {}$'
  with pytest.raises(ValueError, match=message.format(r'\(2, 3\)', r'\(2, 3\)')):
    losses.bn_statistics_loss(jax.tree.map(lambda a: jnp.stack([a, a]), bn_inputs), stacked)
  # either side stacked alone is refused too (it would broadcast into a wrong norm)
  with pytest.raises(ValueError, match=message.format(r'\(3,\)', r'\(2, 3\)')):
    losses.bn_statistics_loss(bn_inputs, stacked)
  with pytest.raises(KeyError, match='no running statistics for BN input statistics at l1/stats'):
    losses.bn_statistics_loss(bn_inputs, {'l0': batch_stats['l0']})


def _np_bnnet(st, x):
  """BNNet in eval mode in NumPy: (logits, DeepInversion BN loss). The BN inputs are x (statistics
  over N, H, W) and fc1(bn_a(x)) (over N)."""
  x = np.asarray(x, np.float64)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), st.params)
  bs = jax.tree.map(lambda a: np.asarray(a, np.float64), st.batch_stats)

  def bn(h, name):
    run, aff = bs[name]['bn'], p[name]['bn']
    return (h - run['mean']) / np.sqrt(run['var'] + 1e-5) * aff['scale'] + aff['bias']

  def stat_loss(h, name, axes):
    run = bs[name]['bn']
    return np.linalg.norm(run['var'] - h.var(axes)) + np.linalg.norm(run['mean'] - h.mean(axes))

  h = bn(x, 'bn_a').reshape(len(x), -1) @ p['fc1']['kernel'] + p['fc1']['bias']
  logits = np.maximum(bn(h, 'bn_b'), 0) @ p['fc2']['kernel'] + p['fc2']['bias']
  return logits, stat_loss(x, 'bn_a', (0, 1, 2)) + stat_loss(h, 'bn_b', 0)


def test_bn_loss_of_a_teacher_in_eval_mode():
  """A teacher's eval-mode logits and DeepInversion BN loss, as DENSE's synthesis reads them
  (`teacher_outputs(..., with_bn_loss=True)`), against NumPy."""
  net, st = _bnnet_state(jax.random.PRNGKey(0))
  x = np.random.default_rng(3).random((5, 4, 4, 2)).astype(np.float32)
  one = jax.tree.map(lambda a: a[None], st)  # a group of one client
  logits, l_bn = jax.jit(lambda s, x: ensemble.teacher_outputs((net, s), x, True, 'loop'))(
    one, jnp.asarray(x)
  )
  want_logits, want_bn = _np_bnnet(st, x)
  np.testing.assert_allclose(l_bn, [want_bn], rtol=1e-4)
  np.testing.assert_allclose(logits, want_logits[None], rtol=1e-4, atol=1e-5)


class NestedBN(nn.Module):
  """A BatchNorm inside a block, as in ResNet and VGG: its statistics sit two levels deep."""

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    block = nn.Sequential([lambda h: BatchNorm(name='bn')(h, train, mask)], name='block')
    return block(x).reshape(x.shape[0], -1)


def test_bn_loss_reads_a_nested_batchnorm_s_running_statistics():
  net = NestedBN()
  x = np.random.default_rng(4).random((5, 4, 4, 2)).astype(np.float32)
  v = _init(net, jax.random.PRNGKey(0), jnp.zeros((2, 4, 4, 2)))
  rng = np.random.default_rng(5)
  stats = jax.tree.map(lambda a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape), jnp.float32), v)
  _, col = net.apply(
    {'params': v['params'], 'batch_stats': stats['batch_stats']},
    jnp.asarray(x),
    mutable=['bn_inputs'],
  )
  got = losses.bn_statistics_loss(col['bn_inputs'], stats['batch_stats'])
  run = jax.tree.leaves(stats['batch_stats'])  # mean, var (sorted keys)
  h = np.asarray(x, np.float64)
  want = np.linalg.norm(run[1] - h.var((0, 1, 2))) + np.linalg.norm(run[0] - h.mean((0, 1, 2)))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


# ----------------------------------------------------------------------------- ensemble


class ConvNet(nn.Module):
  nc: int = 4
  width: int = 3

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = nn.Conv(self.width, (3, 3))(x)
    x = nn.relu(BatchNorm()(x, train, mask))
    return nn.Dense(self.nc)(x.reshape(x.shape[0], -1))


class MLP(nn.Module):
  nc: int = 4

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    return nn.Dense(self.nc)(nn.tanh(nn.Dense(7)(x.reshape(x.shape[0], -1))))


def _stack_states(module, key, n, shape=(4, 4, 1)):
  sts = []
  for k in jax.random.split(key, n):
    v = _init(module, k, jnp.zeros((2, *shape)))
    sts.append(ModelState(v['params'], v.get('batch_stats', {})))
  return jax.tree.map(lambda *a: jnp.stack(a), *sts), sts


def _call(module, st, x):
  return module.apply({'params': st.params, 'batch_stats': st.batch_stats}, x, train=False)


def test_ensemble_one_group_and_weights():
  net = ConvNet()
  stacked, singles = _stack_states(net, jax.random.PRNGKey(0), 3)
  x = jax.random.uniform(jax.random.PRNGKey(1), (5, 4, 4, 1))
  w = np.array([0.2, 0.5, 1.3], np.float32)
  wb = np.random.default_rng(0).random((5, 3)).astype(np.float32)

  @jax.jit  # one compiled program for all checks (XLA:CPU compiles are the test's cost)
  def run(stacked, singles, x, w, wb):
    indiv = jnp.stack([_call(net, s, x) for s in singles])
    outs = {
      s: ensemble.ensemble_logits((net, stacked), x, return_per_client=True, strategy=s)
      for s in ('vmap', 'loop')
    }
    f = lambda s: lambda xx: jnp.sum(ensemble.ensemble_logits((net, stacked), xx, strategy=s) ** 2)
    return (
      indiv,
      outs,
      ensemble.ensemble_logits((net, stacked), x, w),
      ensemble.ensemble_logits((net, stacked), x, wb, normalize=False),
      jax.grad(f('vmap'))(x),
      jax.grad(f('loop'))(x),
    )

  indiv, outs, out_w, out_wb, g_vmap, g_loop = jax.tree.map(
    np.asarray, run(stacked, singles, x, w, wb)
  )
  for out, per in outs.values():
    np.testing.assert_allclose(per, indiv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, indiv.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    out_w, np.einsum('k,kbc->bc', w, indiv) / w.sum(), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(out_wb, np.einsum('bk,kbc->bc', wb, indiv), rtol=1e-5, atol=1e-6)
  # differentiable w.r.t. x, identically for both strategies
  assert np.abs(g_vmap).max() > 0
  np.testing.assert_allclose(g_vmap, g_loop, rtol=1e-4, atol=1e-6)


def test_ensemble_heterogeneous_groups():
  conv, mlp = ConvNet(), MLP()
  s1, singles1 = _stack_states(conv, jax.random.PRNGKey(2), 2)
  s2, singles2 = _stack_states(mlp, jax.random.PRNGKey(3), 3)
  x = jax.random.uniform(jax.random.PRNGKey(4), (6, 4, 4, 1))
  groups = [ensemble.TeacherGroup(conv, s1), ensemble.TeacherGroup(mlp, s2)]
  assert ensemble.num_teachers(groups) == 5

  @jax.jit
  def run(s1, s2, singles1, singles2, x):
    indiv = jnp.stack([_call(conv, s, x) for s in singles1] + [_call(mlp, s, x) for s in singles2])
    groups = [ensemble.TeacherGroup(conv, s1), ensemble.TeacherGroup(mlp, s2)]
    out, per = ensemble.ensemble_logits(groups, x, return_per_client=True)
    as_tuple = ensemble.teacher_outputs(tuple(groups), x)[0]  # two groups, not one (module, state)
    return indiv, out, per, ensemble.teacher_outputs(groups, x, with_bn_loss=True)[1], as_tuple

  indiv, out, per, bn, as_tuple = jax.tree.map(np.asarray, run(s1, s2, singles1, singles2, x))
  np.testing.assert_allclose(per, indiv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(as_tuple, indiv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, indiv.mean(0), rtol=1e-5, atol=1e-6)
  assert bn.shape == (5,) and np.all(bn[:2] > 0) and np.all(bn[2:] == 0)
  with pytest.raises(ValueError, match='^batch_bn teachers have no BN-statistics loss$'):
    ensemble.teacher_outputs(groups, x, True, 'loop', True)


def test_coboosting_weight_update():
  w_orig = np.array([0.2, 0.5, 0.99], np.float32)
  w = np.array([0.25, 0.5, 1.0], np.float32)
  g = np.array([0.3, -0.1, -2.0, 0.0], np.float32)  # a zero gradient leaves its weight
  w_orig, w = np.append(w_orig, 0.4), np.append(w, 0.45)
  got = ensemble.coboosting_weight_update(w, w_orig, g, mu=0.1, wdc=0.5, epoch=2)
  step = w - 0.1 * 0.25 * np.sign(g)
  want = np.clip(w_orig + np.clip(step - w_orig, -1, 1), 0, 1)
  np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------- generator / pool


def test_dense_generator_conv_forms_agree_and_a_bad_form_is_refused():
  """The forced matmul form computes DENSE's generator with the same parameters and numbers as
  XLA's convolutions (32 channels: 'auto' would pick either by backend)."""
  lax_gen, matmul_gen = (
    generator.make_generator((28, 28, 1), nz=16, ngf=16, conv_impl=impl)
    for impl in ('lax', 'matmul')
  )

  @jax.jit  # run op by op, the init and both generators compiled ~100 one-primitive programs
  def run(key):
    st, z = generator.dense_generator_init(key, lax_gen, noise_batch=4)
    variables = {'params': st.params, 'batch_stats': st.batch_stats}
    return [
      g.apply(variables, z, train=True, mutable=['batch_stats'])[0] for g in (lax_gen, matmul_gen)
    ]

  want, got = run(jax.random.PRNGKey(0))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  assert (lax_gen.conv_impl, matmul_gen.conv_impl) == ('lax', 'matmul')
  # the defaults are DENSE's and Co-Boosting's generator: nz 256, ngf 64
  for kind in ('dense', 'fedhydra'):
    default = generator.make_generator((32, 32, 3), kind=kind)
    assert (default.nz, default.ngf, default.conv_impl) == (256, 64, 'auto')
  with pytest.raises(ValueError, match="conv_impl 'cudnn'; valid"):
    generator.make_generator((28, 28, 1), conv_impl='cudnn')


@pytest.mark.parametrize('shape', [(8, 8, 1), (28, 28, 1), (32, 32, 3)])
def test_generator_shape_and_range(shape):
  g = generator.make_generator(shape, nz=16, ngf=8)

  @jax.jit
  def run(key):
    st, z = generator.dense_generator_init(key, g, noise_batch=6)
    variables = {'params': st.params, 'batch_stats': st.batch_stats}
    return g.apply(variables, z, train=True, mutable=['batch_stats'])[0], st

  x, st = run(jax.random.PRNGKey(0))
  assert x.shape == (6, *shape)
  assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
  # DENSE reset_model distribution: kernels N(0, .02), BN scale N(1, .02), biases 0
  assert float(jnp.abs(st.params['bn1']['scale'] - 1).max()) < 0.2
  assert float(jnp.abs(st.params['conv3']['bias']).max()) == 0.0
  assert abs(float(jnp.std(st.params['conv1']['kernel'])) - 0.02) < 0.005
  assert st.params['l1']['kernel'].shape == (16, 2 * 8 * (shape[0] // 4) * (shape[1] // 4))


def test_fedhydra_generator_upsamples_twice_from_a_quarter_size_map_then_keeps_the_size():
  """FedHydraGenerator (FedHydra §4.1.3): Dense(nz → 2ngf·(H/4)·(W/4)), then ConvT k4 s2 2ngf→2ngf,
  ConvT k4 s2 2ngf→ngf, ConvT k3 s1 ngf→C: 28 px from a 7×7 map."""
  g = generator.make_generator((28, 28, 1), nz=8, ngf=4, kind='fedhydra')
  z = jnp.zeros((2, 8))
  variables = jax.eval_shape(lambda: g.init(jax.random.PRNGKey(0), z))
  kernels = {k: v['kernel'].shape for k, v in variables['params'].items() if 'kernel' in v}
  assert kernels == {
    'fc': (8, 8 * 7 * 7),
    'convt0': (4, 4, 8, 8),
    'convt1': (4, 4, 8, 4),
    'convt2': (3, 3, 4, 1),
  }
  out = jax.eval_shape(lambda v: g.apply(v, z, train=True, mutable=['batch_stats'])[0], variables)
  assert out.shape == (2, 28, 28, 1)


@pytest.mark.parametrize('kind', ['dense', 'fedhydra'])
def test_a_generator_refuses_images_whose_sides_four_does_not_divide_and_an_unknown_kind(kind):
  """Both generators start from an (H/4, W/4) map (DENSE's, FedHydra's), so 6 or 10 px cannot be
  made; the refusal names the generator and the shape, before any parameter exists."""
  name = {'dense': 'DenseGenerator', 'fedhydra': 'FedHydraGenerator'}[kind]
  z = jnp.zeros((1, 4))
  for shape in [(6, 8, 1), (8, 10, 1)]:
    g = generator.make_generator(shape, nz=4, ngf=2, kind=kind)
    with pytest.raises(ValueError, match=rf'^{name} needs H, W divisible by 4, got \({shape[0]}, '):
      g.init(jax.random.PRNGKey(0), z)
  with pytest.raises(ValueError, match=r"^generator 'dcgan'; valid: \['dense', 'fedhydra'\]$"):
    generator.make_generator((8, 8, 1), kind='dcgan')


def test_pool_ring_and_quantise():
  p = pool.pool_init(5, (2, 2, 1), quantize=True)
  add = jax.jit(pool.pool_add)
  x1 = jnp.linspace(0, 1, 3 * 4).reshape(3, 2, 2, 1)
  p = add(p, x1, jnp.array([0, 1, 2]))
  assert int(pool.pool_size(p)) == 3
  got, lab = pool.pool_gather(p, jnp.arange(3))
  np.testing.assert_allclose(got, np.floor(np.clip(np.asarray(x1), 0, 1) * 255) / 255, atol=1e-7)
  p = add(p, x1 + 0.0, jnp.array([3, 4, 5]))  # wraps: slots 3,4,0
  assert int(pool.pool_size(p)) == 5 and int(p.count) == 6
  np.testing.assert_array_equal(np.asarray(p.labels), [5, 1, 2, 3, 4])
  idx, mask = pool.epoch_batches(p, 0, 2)
  assert idx.shape == (3, 2) and mask.sum() == 5 and sorted(idx[mask].tolist()) == list(range(5))


def test_a_float_pool_stores_exactly_and_unlabelled_images_get_minus_one():
  p = pool.pool_init(4, (1, 2, 1))
  assert p.images.dtype == jnp.float32 and not p.quantized and p.capacity == 4
  np.testing.assert_array_equal(np.asarray(p.labels), [-1] * 4)
  assert int(p.count) == 0 and int(pool.pool_size(p)) == 0
  x = jnp.asarray([[[[0.1234567], [1.5]]], [[[-0.25], [0.5]]]], jnp.float32)  # kept as is
  p = pool.pool_add(p, x)
  got, labels = pool.pool_gather(p, jnp.arange(2))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(labels), [-1, -1])
  assert int(p.count) == 2 and int(pool.pool_size(p)) == 2
  with pytest.raises(ValueError, match=r'^batch of 5 exceeds pool capacity 4$'):
    pool.pool_add(p, jnp.zeros((5, 1, 2, 1)))
  assert int(pool.pool_add(p, jnp.zeros((4, 1, 2, 1))).count) == 6  # a whole capacity at once
  q = pool.pool_add(pool.pool_init(2, (1, 1, 1), quantize=True), jnp.asarray([[[[0.999]]]]))
  assert int(q.images[0, 0, 0, 0]) == 254  # floor(0.999 * 255), not rounded
  np.testing.assert_array_equal(np.asarray(q.labels), [-1, -1])
  # PNG quantisation clips to [0, 1] first: no wrap-around of out-of-range pixels
  quantized = pool.quantize_uint8(jnp.asarray([-0.5, 0.0, 0.5, 1.0, 1.5]))
  assert quantized.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(quantized), [0, 0, 127, 255, 255])


def test_pool_sample_draws_only_from_the_filled_part_with_the_images_labels():
  p = pool.pool_init(10, (1, 1, 1))
  p = pool.pool_add(p, jnp.asarray([0.25, 0.5, 0.75]).reshape(3, 1, 1, 1), jnp.asarray([7, 8, 9]))
  x, labels = jax.jit(pool.pool_sample, static_argnums=2)(p, jax.random.PRNGKey(0), 300)
  x, labels = np.asarray(x).ravel(), np.asarray(labels)
  assert x.shape == (300,) and set(x.tolist()) == {0.25, 0.5, 0.75}
  np.testing.assert_array_equal(labels, (x * 4).astype(int) + 6)  # each image with its label
  one = pool.pool_add(pool.pool_init(10, (1, 1, 1)), jnp.full((1, 1, 1, 1), 0.5), jnp.asarray([3]))
  x, labels = jax.jit(pool.pool_sample, static_argnums=2)(one, jax.random.PRNGKey(1), 50)
  assert set(np.asarray(x).ravel().tolist()) == {0.5} and set(np.asarray(labels).tolist()) == {3}


def test_epoch_batches_are_a_permutation_of_the_pool_from_the_seed_padded_or_dropped():
  p = pool.pool_add(pool.pool_init(8, (1, 1, 1)), jnp.zeros((5, 1, 1, 1)))
  perm = np.random.default_rng(3).permutation(5)
  idx, mask = pool.epoch_batches(p, 3, 2)
  np.testing.assert_array_equal(idx.ravel()[:5], perm)
  np.testing.assert_array_equal(mask.ravel(), [True] * 5 + [False])
  assert idx.dtype == np.int32 and idx.ravel()[5] == 0
  same, _ = pool.epoch_batches(p, np.random.default_rng(3), 2)  # a generator draws the same
  np.testing.assert_array_equal(same, idx)
  idx, mask = pool.epoch_batches(p, 3, 2, drop_last=True)
  assert idx.shape == (2, 2) and mask.all()
  np.testing.assert_array_equal(idx.ravel(), perm[:4])


def test_augment_flips_without_cropping_and_crops_with_every_offset_of_its_padding():
  x = jnp.arange(64 * 3 * 3).reshape(64, 3, 3, 1).astype(jnp.float32)
  y = np.asarray(pool.augment(jax.random.PRNGKey(2), x, crop_padding=0, flip=True))
  mirrored = np.asarray(x)[:, :, ::-1]
  flipped = [bool(np.array_equal(a, m)) for a, m in zip(y, mirrored)]
  assert all(f or np.array_equal(a, b) for f, a, b in zip(flipped, y, np.asarray(x)))
  assert 10 < sum(flipped) < 54  # p = 0.5
  shifted = x + 1  # no pixel equal to the zero padding
  for padding in (1, 2):  # offsets 0..2·padding on each axis, every one of them drawn
    y = np.asarray(pool.augment(jax.random.PRNGKey(3), shifted, crop_padding=padding, flip=False))
    pads = ((0, 0), (padding, padding), (padding, padding), (0, 0))
    padded = np.pad(np.asarray(shifted), pads)
    n = 2 * padding + 1
    offsets = set()
    for img, pad in zip(y, padded):
      found = [
        (i, j) for i in range(n) for j in range(n) if np.array_equal(pad[i : i + 3, j : j + 3], img)
      ]
      assert len(found) == 1
      offsets.add(found[0])
    assert {i for i, _ in offsets} == {j for _, j in offsets} == set(range(n))


def test_augment_crop_flip():
  x = jnp.arange(2 * 4 * 4).reshape(2, 4, 4, 1).astype(jnp.float32)
  y = pool.augment(jax.random.PRNGKey(0), x, crop_padding=0, flip=False)
  np.testing.assert_array_equal(y, x)
  aug = jax.jit(lambda k, a: pool.augment(k, a, 2))
  seen = set()
  for i in range(12):
    y = np.asarray(aug(jax.random.PRNGKey(i), x))[0, :, :, 0]
    img = np.pad(np.asarray(x)[0, :, :, 0], 2)
    # every output is a 4x4 window of the zero-padded image, possibly mirrored
    found = [
      (oy, ox, f)
      for oy in range(5)
      for ox in range(5)
      for f in (0, 1)
      if np.array_equal(
        img[oy : oy + 4, ox : ox + 4][:, ::-1] if f else img[oy : oy + 4, ox : ox + 4], y
      )
    ]
    assert found
    seen.add(found[0][2])
  assert seen == {0, 1}
  g = jax.jit(jax.grad(lambda a: jnp.sum(pool.augment(jax.random.PRNGKey(1), a, 2) ** 2)))(x)
  assert g.shape == x.shape


# ----------------------------------------------------------------------------- synthesis


def test_each_synthesis_recipe_alone_has_its_papers_and_reference_codes_settings():
  """A recipe called without arguments (as `jfed.distill` offers it) is its method's published
  setting. DENSE (Zhang et al., NeurIPS 2022; README of github.com/zj-jayzhang/DENSE): 30
  generator steps of Adam(lr 1e-3, betas (0.5, 0.999)) on [G, z], batch 256, bn = oh = adv = 1,
  the adversarial KL at T = 1 with the disagreement mask, sorted targets, RandomCrop + HFlip,
  the plain teacher mean, the BN loss summed over models. Co-Boosting (Dai et al., ICLR 2024;
  github.com/rong-dai/Co-Boosting, `coboost.py`): 30 steps, batch 128, `--bn 0` (averaged over
  models when on), the hard-sample CE with hs = 1, T = 3 × T² without a mask, the weighted
  ensemble, the generator's gradient norm clipped to 10, random targets, un-augmented G(z).
  FedHydra (Bai et al., KDD 2025, §4.1.5, Algorithm 1, Eqs. 14-16): λ1 = λ2 = 1, T_G = 30, Adam
  lr 1e-3 on θ_G only, L_BN over 1/m, SA, T = 1 without a mask, un-augmented, random targets."""
  adam = dict(lr_g=1e-3, b1=0.5, b2=0.999)
  want = {
    'dense': dict(
      adam, g_steps=30, batch_size=256, bn=1.0, oh=1.0, adv=1.0, oh_loss='ce', adv_T=1.0,
      adv_mask=True, adv_t_squared=False, bn_model_reduction='sum', aggregation='mean',
      optimize_z=True, grad_clip=None, augment=True, crop_padding=4, flip=True,
      sort_targets=True, keep='best',
    ),
    'coboosting': dict(
      adam, g_steps=30, batch_size=128, bn=0.0, oh=1.0, adv=1.0, oh_loss='hard_sample', hs=1.0,
      adv_T=3.0, adv_mask=False, adv_t_squared=True, bn_model_reduction='mean',
      aggregation='weighted', optimize_z=True, grad_clip=10.0, augment=False,
      sort_targets=False, keep='best',
    ),
    'fedhydra': dict(
      adam, g_steps=30, bn=1.0, oh=1.0, adv=1.0, oh_loss='ce', adv_T=1.0, adv_mask=False,
      adv_t_squared=False, bn_model_reduction='mean', aggregation='sa', optimize_z=False,
      grad_clip=None, augment=False, sort_targets=False,
    ),
  }  # fmt: skip
  recipes = {
    'dense': synthesis.dense_config(),
    'coboosting': synthesis.coboosting_config(),
    'fedhydra': synthesis.fedhydra_config(),
  }
  for name, cfg in recipes.items():
    assert {k: getattr(cfg, k) for k in want[name]} == want[name], name
  # FedHydra's λ1, λ2 are its first two arguments; keywords override any setting of a recipe
  hydra = synthesis.fedhydra_config(0.3, 0.7, g_steps=5, augment=True)
  assert (hydra.bn, hydra.adv, hydra.g_steps, hydra.augment) == (0.3, 0.7, 5, True)


def test_synthesis_scan_equals_python_and_keeps_best():
  net = ConvNet(nc=3, width=2)
  stacked, singles = _stack_states(net, jax.random.PRNGKey(5), 2, shape=(8, 8, 1))
  gen = generator.make_generator((8, 8, 1), nz=8, ngf=4)
  cfg = synthesis.dense_config(g_steps=3, batch_size=6, crop_padding=2, strategy='vmap')
  outs = [
    synthesis.synthesize(
      gen, (net, stacked), net, singles[0], 3, jax.random.PRNGKey(6), cfg._replace(loop=loop)
    )
    for loop in ('scan', 'python')
  ]
  a, b = outs
  np.testing.assert_allclose(a.losses, b.losses, rtol=1e-4)
  np.testing.assert_allclose(a.images, b.images, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(a.labels, b.labels)
  assert np.all(np.diff(np.asarray(a.labels)) >= 0)  # DENSE sorts the targets
  np.testing.assert_allclose(a.best_loss, np.min(np.asarray(a.losses)), rtol=1e-6)
  comps = np.asarray(a.components)
  np.testing.assert_allclose(a.losses, comps.sum(1), rtol=1e-5)  # bn=oh=adv=1
  assert np.all(comps[:, 0] > 0)  # BN loss active (ConvNet has BN)
  assert a.images.shape == (6, 8, 8, 1) and float(a.images.min()) >= 0
  # the trained generator comes back as a generator state (DENSE also trains z, kept apart)
  fresh = jax.eval_shape(lambda: generator.dense_generator_init(jax.random.PRNGKey(0), gen))
  for out in outs:
    assert jax.tree.structure(out.generator.params) == jax.tree.structure(fresh.params)


def test_synthesis_runs_the_loop_its_backend_wants_and_both_loops_weight_the_teachers():
  """'auto' runs a Python loop of jitted steps on CPU (XLA:CPU runs convolutions inside a scan
  slowly, docs/design.md) and one scanned program elsewhere; 'scan' and 'python' force either.
  Both apply Co-Boosting's per-client teacher weights (here far from uniform) and continue a
  given generator (FedHydra's kept generator) instead of a fresh one."""
  net = ConvNet(nc=3, width=2)
  stacked, singles = _stack_states(net, jax.random.PRNGKey(5), 2, shape=(8, 8, 1))
  gen = generator.make_generator((8, 8, 1), nz=8, ngf=4)
  cfg = synthesis.coboosting_config(g_steps=2, batch_size=6, strategy='vmap')
  auto_loop = 'python' if jax.default_backend() == 'cpu' else 'scan'
  kept = jax.jit(lambda k: generator.dense_generator_init(k, gen))(jax.random.PRNGKey(9))
  drivers = {'jit(_synthesize_scan)': 'scan', 'jit(_synthesis_step)': 'python'}
  runs, programs = {}, {}
  for loop, w in [('auto', 0.9), ('scan', 0.9), ('python', 0.9), ('python', 0.5)]:
    with compiles.count_compilations() as compiled:
      runs[loop, w] = synthesis.synthesize(
        gen, (net, stacked), net, singles[0], 3, jax.random.PRNGKey(6), cfg._replace(loop=loop),
        agg=jnp.asarray([w, 1 - w]), generator_state=kept,
      )  # fmt: skip
    counts = compiled.counts()
    ran = {kind for program, kind in drivers.items() if counts.get(program)}
    programs[loop] = programs.get(loop, set()) | ran
  assert programs == {'auto': {auto_loop}, 'scan': {'scan'}, 'python': {'python'}}
  for loop in ('auto', 'scan'):
    np.testing.assert_allclose(runs[loop, 0.9].losses, runs['python', 0.9].losses, rtol=1e-4)
  assert not np.allclose(runs['python', 0.9].losses, runs['python', 0.5].losses, rtol=1e-3)


def test_synthetic_sample_grid_tiles_every_image_in_place(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(11, 3, 2, 1)).astype(np.float32)
  mosaic = plots.image_mosaic(images, columns=4, pad=1)
  assert mosaic.shape == (3 * 4 - 1, 4 * 3 - 1, 1)
  for i in range(11):
    r, c = divmod(i, 4)
    np.testing.assert_array_equal(mosaic[4 * r : 4 * r + 3, 3 * c : 3 * c + 2], images[i])
  assert np.all(mosaic[3] == 1.0) and np.all(mosaic[:, 2] == 1.0)  # white between tiles
  assert np.all(mosaic[8:, 9:] == 1.0)  # and where the last row has no image
  plots.plot_image_grid(tmp_path / 'grid.png', images, labels=np.arange(11), title='t')
  assert (tmp_path / 'grid.png').stat().st_size > 0


def test_knowledge_fusion_loss_equals_eqs_5_to_7_by_hand():
  """FedMHO Eq. 7 with Eq. 5 (MD: the mean of the classifier clients' logits), Eq. 6 (SD: the
  initial global model's logits) and plain FedMHO (CE only), against NumPy; a padded row is
  left out."""
  rng = np.random.default_rng(0)
  s = rng.normal(size=(4, 5))
  clients = rng.normal(size=(3, 4, 5))
  initial = rng.normal(size=(4, 5))
  y = np.array([0, 3, 4, 1])
  w = np.array([1.0, 1.0, 1.0, 0.0])

  def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))

  ce = -log_softmax(s)[np.arange(4), y]

  def kl(t):  # KL(softmax(t) || softmax(s)) per sample, summed over classes
    log_p = log_softmax(t)
    return (np.exp(log_p) * (log_p - log_softmax(s))).sum(-1)

  real = lambda v: v[:3].mean()
  # jitted: run op by op, the loss compiled ~5 one-primitive programs a call
  loss = jax.jit(losses.knowledge_fusion_loss, static_argnames=('lam', 'kl_reduction'))
  f = lambda t=None, lam=0.5, kl_reduction='batchmean': float(
    loss(
      jnp.asarray(s, jnp.float32),
      jnp.asarray(y),
      None if t is None else jnp.asarray(t, jnp.float32),
      lam=lam,
      weights=jnp.asarray(w),
      kl_reduction=kl_reduction,
    )
  )
  md_teacher = clients.mean(0)  # Eq. 5 averages the logits, then takes the softmax
  np.testing.assert_allclose(f(md_teacher), real(0.5 * ce + 0.5 * kl(md_teacher)), rtol=1e-5)
  np.testing.assert_allclose(f(initial), real(0.5 * ce + 0.5 * kl(initial)), rtol=1e-5)
  np.testing.assert_allclose(f(), real(ce), rtol=1e-5)
  np.testing.assert_allclose(
    f(initial, lam=0.3, kl_reduction='mean'), real(0.3 * ce + 0.7 * kl(initial) / 5), rtol=1e-5
  )
  # one real sample: its loss, not half of it; no weights: every row counts
  one = jnp.asarray([0.0, 1.0, 0.0, 0.0])
  got = loss(jnp.asarray(s, jnp.float32), jnp.asarray(y), None, 0.5, one, 'batchmean')
  np.testing.assert_allclose(float(got), ce[1], rtol=1e-5)
  got = loss(jnp.asarray(s, jnp.float32), jnp.asarray(y), None, 0.5, None, 'batchmean')
  np.testing.assert_allclose(float(got), ce.mean(), rtol=1e-5)
  with pytest.raises(ValueError, match="kl_reduction must be 'batchmean' or 'mean', got 'sum'"):
    losses.knowledge_fusion_loss(jnp.asarray(s), jnp.asarray(y), None, 0.5, None, 'sum')


def test_batch_bn_teachers_normalise_with_the_batch_statistics():
  """FedDF's teachers (teacher_bn='batch'): BN uses the KD batch's own mean and biased variance,
  so a collapsed running variance cannot blow the logits up, and the teachers stay unchanged."""

  net = ConvNet()
  stacked, singles = _stack_states(net, jax.random.PRNGKey(5), 2)
  collapsed = stacked._replace(
    batch_stats=jax.tree.map(lambda a: jnp.full_like(a, 1e-12), stacked.batch_stats)
  )
  x = jax.random.uniform(jax.random.PRNGKey(6), (6, 4, 4, 1))
  y = jnp.zeros((6,), jnp.int32)
  expected = []
  conv = jax.jit(lambda params, x: nn.Conv(3, (3, 3)).apply({'params': params}, x))
  for st in singles:
    h = conv(st.params['Conv_0'], x)
    h = np.asarray(h, np.float64)
    mean, var = h.mean((0, 1, 2)), h.var((0, 1, 2))
    bn = st.params['BatchNorm_0']['bn']
    h = np.maximum((h - mean) / np.sqrt(var + 1e-5) * bn['scale'] + bn['bias'], 0)
    d = st.params['Dense_0']
    expected.append(h.reshape(6, -1) @ np.asarray(d['kernel']) + np.asarray(d['bias']))
  expected = np.mean(expected, 0)
  # jitted as the KD step runs it: op by op, each call compiled ~15 one-primitive programs
  teachers = jax.jit(
    lambda cfg, states, x, y: kd.teacher_logits(cfg, (net,), (states,), x, y, None),
    static_argnums=0,
  )
  for strategy in ('vmap', 'loop'):
    cfg = kd.KDConfig(teacher_bn='batch', strategy=strategy)
    got = teachers(cfg, collapsed, x, y)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
  running = teachers(kd.KDConfig(), collapsed, x, y)
  # eval mode: 1/sqrt(eps) amplification, what made multi-round FedDF diverge on digits
  assert np.abs(np.asarray(running)).max() > 20 * np.abs(expected).max()
  with pytest.raises(ValueError, match='no BN-statistics loss'):
    ensemble.teacher_outputs((net, stacked), x, with_bn_loss=True, batch_bn=True)


# --------------------------------------------------------------- FedHydra (Bai et al., KDD 2025)
# What the method runs: `synthesize` with `fedhydra_config` (Eq. 16) and `kd_step` with
# KDConfig(loss='fedhydra', aggregation='sa') (Eq. 19), against NumPy on two teacher architectures
# (BNNet with BN loss, MLP without) and a linear global model, all computable by hand.

_HYDRA_SHAPE = (8, 8, 2)
_HYDRA_CLASSES = 3


class _Linear(nn.Module):
  nc: int = _HYDRA_CLASSES

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    return nn.Dense(self.nc, name='fc')(x.reshape(x.shape[0], -1))


def _np_softmax(a):
  return np.exp(np_log_softmax(a))


def _np_linear(params, x):
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  return x @ np.asarray(params['fc']['kernel'], np.float64) + np.asarray(params['fc']['bias'])


def _np_mlp(st, x):
  # flax names the layers in construction order: Dense_0 is the output layer, built first
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), st.params)
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  h = np.tanh(x @ p['Dense_1']['kernel'] + p['Dense_1']['bias'])
  return h @ p['Dense_0']['kernel'] + p['Dense_0']['bias']


def _np_sa(per_client, U_r, U_c, y):
  """Stratified aggregation written out as FedHydra Eqs. 8–11, one sample at a time."""
  m, b, c = per_client.shape
  out = np.zeros((b, c))
  for i in range(b):
    # Eqs. 8–9: row k of P^i is P_k(i, :) ⊙ Ū_c(:, k)ᵀ (client k's class weights)
    P_i = np.stack([per_client[k, i] * U_c[:, k] for k in range(m)])
    V_i = U_r[y[i], :]  # Eq. 10: the row of Ū_r for the sample's target class
    out[i] = V_i @ P_i  # Eq. 11
  return out


@pytest.fixture(scope=shared_fixture_scope)
def hydra_setup():
  """Three clients (two BNNets, one MLP), SA weights from a random guidance matrix U normalised
  by Eqs. 4–7, and a linear global model."""
  bn_states = [
    _bnnet_state(jax.random.PRNGKey(10 + k), seed=20 + k, shape=_HYDRA_SHAPE)[1] for k in range(2)
  ]
  mlp = MLP(nc=_HYDRA_CLASSES)
  mlp_stacked, mlp_singles = _stack_states(mlp, jax.random.PRNGKey(12), 1, shape=_HYDRA_SHAPE)
  groups = [
    ensemble.TeacherGroup(BNNet(), jax.tree.map(lambda *a: jnp.stack(a), *bn_states)),
    ensemble.TeacherGroup(mlp, mlp_stacked),
  ]
  m = 3
  u = np.random.default_rng(4).uniform(0.1, 2.0, (m, _HYDRA_CLASSES))  # u_{k,j}
  U = u.T  # Eq. 3: c × m
  U_r = (U / U.sum(1, keepdims=True)).astype(np.float32)  # Eqs. 4–5: Σ_k ū_{k,j} = 1
  U_c = (U / U.sum(0, keepdims=True)).astype(np.float32)  # Eqs. 6–7: Σ_j û_{k,j} = 1
  student = _Linear()
  s_params = _init(student, jax.random.PRNGKey(14), jnp.zeros((2, *_HYDRA_SHAPE)))['params']

  def np_teachers(x):  # [m, B, C], clients in group order
    return np.stack([_np_bnnet(st, x)[0] for st in bn_states] + [_np_mlp(mlp_singles[0], x)])

  bn_losses = lambda x: np.array([_np_bnnet(st, x)[1] for st in bn_states] + [0.0])
  return groups, synthesis.SAWeights(U_r, U_c), student, s_params, np_teachers, bn_losses


def _hydra_generator():
  """A generator and the state FedHydra continues (`generator_state`). A fresh DENSE init draws
  nearly constant images, so its kernels are scaled for images that differ between samples."""
  gen = generator.make_generator(_HYDRA_SHAPE, nz=8, ngf=4)

  @jax.jit  # run op by op, the init compiled ~40 one-primitive programs
  def g0_init(key):
    g0, _ = generator.dense_generator_init(key, gen, noise_batch=8)
    return g0._replace(
      params=jax.tree_util.tree_map_with_path(
        lambda p, a: a * 10 if p[-1].key == 'kernel' else a, g0.params
      )
    )

  return gen, g0_init(jax.random.PRNGKey(3))


def _np_crop_flip(x, u, padding):
  """kornia RandomCrop(padding, zero fill) + RandomHorizontalFlip(0.5) on NHWC from a uniform
  draw u [3, B]: offsets floor(u[:2] · (2·padding + 1)), a flip where u[2] < 0.5."""
  h, w = x.shape[1:3]
  n = 2 * padding + 1
  off = np.minimum(np.floor(u[:2] * n), n - 1).astype(int)
  xp = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  out = np.stack(
    [xp[b, off[0, b] : off[0, b] + h, off[1, b] : off[1, b] + w] for b in range(len(x))]
  )
  return np.where((u[2] < 0.5)[:, None, None, None], out[:, :, ::-1], out), off


def test_the_synthesis_teacher_is_each_aggregation_written_out():
  """`aggregate_teachers` under each setting, against NumPy: DENSE's plain mean, Co-Boosting's
  Σ_k w_k P_k / Σ_k w_k, FedHydra's SA (Eqs. 8-11) and SA without Eq. 8 ('sa_inter', the
  ablation); an unknown name is refused naming it."""
  rng = np.random.default_rng(6)
  per_client = rng.normal(size=(3, 5, 4)).astype(np.float32)
  y = np.array([0, 3, 1, 1, 2])
  w = np.array([0.2, 0.5, 1.3], np.float32)
  U = rng.uniform(0.1, 2.0, (4, 3))
  U_r, U_c = (U / U.sum(1, keepdims=True)), (U / U.sum(0, keepdims=True))
  want = {
    'mean': per_client.mean(0),
    'weighted': (w[:, None, None] * per_client).sum(0) / w.sum(),
    'sa': _np_sa(per_client, U_r, U_c, y),
    'sa_inter': _np_sa(per_client, U_r, np.ones_like(U_c), y),
  }
  agg = {'mean': None, 'weighted': w, 'sa': (U_r, U_c), 'sa_inter': (U_r, U_c)}
  for name, expected in want.items():
    cfg = synthesis.SynthesisConfig(aggregation=name)
    got = synthesis.aggregate_teachers(cfg, jnp.asarray(per_client), jnp.asarray(y), agg[name])
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6, err_msg=name)
  assert not np.allclose(want['sa'], want['sa_inter'])
  with pytest.raises(ValueError, match=r"^unknown aggregation 'median'$"):
    synthesis.aggregate_teachers(
      synthesis.SynthesisConfig(aggregation='median'), jnp.asarray(per_client), y, None
    )


@pytest.mark.parametrize('variant', ['no_adversary', 'masked', 'augmented', 'clipped'])
def test_synthesis_terms_follow_the_adversary_its_mask_and_the_view(hydra_setup, variant):
  """Eq. 16's NumPy terms under the settings the ablations and DENSE change. λ2 = 0 with a
  student present: no adversarial term (0). The disagreement mask (DENSE's): the KL averaged
  with zeros where the student agrees with the teacher. DENSE's RandomCrop(2) + HFlip view, from
  the step's key (jfed's draw: the epoch key folded with 2, split per step): what the teachers
  and the student see. A gradient clip (Co-Boosting's) on a generator trained without z
  (FedHydra's): the terms before the step are unchanged and the step runs."""
  groups, sa, student, s_params, np_teachers, np_bn_losses = hydra_setup
  lam1, lam2 = 0.7, 0.0 if variant == 'no_adversary' else 0.4
  gen, g0 = _hydra_generator()
  extra = {
    'masked': dict(adv_mask=True),
    'augmented': dict(augment=True, crop_padding=2),
    'clipped': dict(grad_clip=1e-3),
  }
  cfg = synthesis.fedhydra_config(
    lam1, lam2, g_steps=1, batch_size=8, loop='python', **extra.get(variant, {})
  )
  key = jax.random.PRNGKey(7)
  res = synthesis.synthesize(
    gen, groups, student, ModelState(s_params, {}), _HYDRA_CLASSES, key, cfg, agg=sa,
    generator_state=g0,
  )  # fmt: skip
  x, y = np.asarray(res.images, np.float64), np.asarray(res.labels)
  view = x
  if variant == 'augmented':
    step_key = jax.random.split(jax.random.fold_in(key, 2), 1)[0]
    u = np.asarray(jax.random.uniform(step_key, (3, 8)))
    view, offsets = _np_crop_flip(x, u, 2)
    assert {0, 4} & set(offsets.ravel().tolist())  # an offset padding 1 cannot draw
    assert 0 < (u[2] < 0.5).sum() < 8
  P = _np_sa(np_teachers(view), np.asarray(sa.U_r), np.asarray(sa.U_c), y)
  ce = np_ce(P, y).mean()
  bn = np_bn_losses(view).mean()
  s = _np_linear(s_params, view)
  kl = np_kl_elem(s, P, 1.0).sum(1)
  disagree = np.argmax(P, 1) != np.argmax(s, 1)
  adv = {'no_adversary': 0.0, 'masked': -(kl * disagree).mean()}.get(variant, -kl.mean())
  np.testing.assert_allclose(res.components[0], [bn, ce, adv], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(res.losses[0], ce + lam1 * bn + lam2 * adv, rtol=1e-4)
  # each setting changes the numbers by more than the tolerance
  assert 0 < disagree.sum() < len(y) and abs(kl.mean() - (kl * disagree).mean()) > 1e-3
  if variant == 'augmented':
    assert abs(np_ce(_np_sa(np_teachers(x), sa.U_r, sa.U_c, y), y).mean() - ce) > 1e-3


def test_fedhydra_synthesis_loss_is_eq16_on_the_generated_batch(hydra_setup):
  """One `synthesize` step with FedHydra's settings: the loss before the step, and each term, equal
  Eq. 16 computed in NumPy on the generator's images: CE(SA, y) (Eqs. 12–13) + λ1 · (1/m) Σ_k L_BN,k
  (Eq. 14, the MLP contributing 0) + λ2 · (−KL(SA ‖ F_g)) (Eq. 15, unmasked)."""
  groups, sa, student, s_params, np_teachers, np_bn_losses = hydra_setup
  lam1, lam2 = 0.7, 0.4
  gen, g0 = _hydra_generator()
  cfg = synthesis.fedhydra_config(lam1, lam2, g_steps=1, batch_size=8, loop='python')
  res = synthesis.synthesize(
    gen,
    groups,
    student,
    ModelState(s_params, {}),
    _HYDRA_CLASSES,
    jax.random.PRNGKey(7),
    cfg,
    agg=sa,
    generator_state=g0,
  )
  # one step: the kept images are G(z) before it, the batch the reported loss was computed on
  x, y = np.asarray(res.images), np.asarray(res.labels)
  per_client = np_teachers(x)
  P = _np_sa(per_client, np.asarray(sa.U_r), np.asarray(sa.U_c), y)
  ce = np_ce(P, y).mean()
  bn = np_bn_losses(x).mean()
  kl = np_kl_elem(_np_linear(s_params, x), P, 1.0).sum(1)
  adv = -kl.mean()
  np.testing.assert_allclose(res.components[0], [bn, ce, adv], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(res.losses[0], ce + lam1 * bn + lam2 * adv, rtol=1e-4)
  # the test tells FedHydra's choices apart from DENSE's: SA ≠ the plain mean of the teachers,
  # the BN loss's 1/m ≠ DENSE's sum, no disagreement mask on the adversarial term
  assert abs(np_ce(per_client.mean(0), y).mean() - ce) > 1e-2
  assert bn > 1e-2
  disagree = np.argmax(P, 1) != np.argmax(_np_linear(s_params, x), 1)
  assert 0 < disagree.sum() < len(y) and abs(-(kl * disagree).mean() - adv) > 1e-3


@pytest.mark.parametrize(
  'kcfg',
  [
    # FedHydra (fedhydra.py: loss='fedhydra', t_squared=False, T = kd_T = 1, aggregation 'sa')
    kd.KDConfig(loss='fedhydra', T=1.0, t_squared=False, beta=0.6, aggregation='sa'),
    # DENSE: KL at T with T², teachers averaged
    kd.KDConfig(loss='kl', T=4.0, t_squared=True, aggregation='mean'),
  ],
  ids=['fedhydra', 'dense'],
)
@pytest.mark.parametrize('stored_targets', [False, True], ids=['kd_step', 'stored_targets'])
def test_kd_step_minimises_eq19_and_dense_kl(hydra_setup, kcfg, stored_targets):
  """One `kd_step` (the step every one-shot method's distillation runs) on a batch with one padded
  row: the loss it reports is, over the real rows, FedHydra's Eq. 19, KL(SA ‖ F_g) + β ·
  CE(F_g, argmax SA) (Eqs. 17–18), or DENSE's T² · KL(mean teacher ‖ student) at T, and the new
  linear model is one SGD step down that loss's NumPy gradient. The same for the path FedHydra's
  KD runs (`pool_teacher_logits` once per stored image, then `kd_step_on_targets`)."""
  groups, sa, student, s_params, np_teachers, _ = hydra_setup
  rng = np.random.default_rng(5)
  x = rng.random((6, *_HYDRA_SHAPE)).astype(np.float32)
  y = rng.integers(0, _HYDRA_CLASSES, 6).astype(np.int32)
  mask = np.array([1, 1, 1, 1, 1, 0], bool)
  spec = optim.OptimizerSpec('sgd', 0.1)
  lr = 0.5
  ts = kd.student_state(spec, ModelState(s_params, {}))
  agg = (jnp.asarray(sa.U_r), jnp.asarray(sa.U_c)) if kcfg.aggregation == 'sa' else None
  programs = kd.KDPrograms(kcfg, spec, tuple(g.module for g in groups), student)
  teachers = kd.Teachers(tuple(g.states for g in groups), agg)
  if stored_targets:  # the targets computed once per pool image, then the step without teachers
    add = jax.jit(pool.pool_add)  # run op by op: ~10 one-primitive programs
    stored = add(pool.pool_init(8, _HYDRA_SHAPE), jnp.asarray(x), jnp.asarray(y))
    assert kd.targets_depend_only_on_the_image(kcfg)
    t = kd.pool_teacher_logits(programs, teachers, stored, jnp.arange(6))
    new, loss = kd.kd_step_on_targets(programs, ts, jnp.asarray(x), t, jnp.asarray(mask), lr)
  else:
    new, loss = kd.kd_step(
      programs,
      ts,
      teachers,
      jnp.asarray(x),
      jnp.asarray(y),
      jnp.asarray(mask),
      jax.random.PRNGKey(0),
      lr,
    )
  per_client = np_teachers(x)
  if kcfg.loss == 'fedhydra':
    t = _np_sa(per_client, np.asarray(sa.U_r), np.asarray(sa.U_c), y)
  else:
    t = per_client.mean(0)
  s, T = _np_linear(s_params, x), kcfg.T
  scale = T * T if kcfg.t_squared else 1.0
  per_sample = np_kl_elem(s, t, T).sum(1) * scale
  # d/ds of T²·KL at T is T·(q − p); of CE(s, h) it is softmax(s) − onehot(h)
  grad_s = (_np_softmax(s / T) - _np_softmax(t / T)) * scale / T
  if kcfg.loss == 'fedhydra':
    hard = np.argmax(t, 1)
    per_sample = per_sample + kcfg.beta * np_ce(s, hard)
    grad_s = grad_s + kcfg.beta * (_np_softmax(s) - np.eye(_HYDRA_CLASSES)[hard])
  np.testing.assert_allclose(loss, per_sample[mask].mean(), rtol=1e-4)
  grad_s = grad_s * mask[:, None] / mask.sum()
  x_flat = x.reshape(len(x), -1).astype(np.float64)
  want_kernel = np.asarray(s_params['fc']['kernel']) - lr * x_flat.T @ grad_s
  want_bias = np.asarray(s_params['fc']['bias']) - lr * grad_s.sum(0)
  np.testing.assert_allclose(new.model.params['fc']['kernel'], want_kernel, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(new.model.params['fc']['bias'], want_bias, rtol=1e-4, atol=1e-6)


def test_combine_logits_every_weight_form_against_numpy():
  """[K], [B, K] and [B, K, C] weights, normalised (the default) or not, against einsum; weights of
  another rank are refused with their shape."""
  rng = np.random.default_rng(5)
  per = rng.normal(size=(3, 4, 5)).astype(np.float32)
  forms = {
    'k,kbc->bc': rng.random(3) + 0.1,
    'bk,kbc->bc': rng.random((4, 3)) + 0.1,
    'bkc,kbc->bc': rng.random((4, 3, 5)) + 0.1,
  }
  sums = {'k,kbc->bc': 'k->', 'bk,kbc->bc': 'bk->b', 'bkc,kbc->bc': 'bkc->bc'}
  for spec, w in forms.items():  # float64 weights: cast to the logits' dtype
    raw = np.einsum(spec, w, per.astype(np.float64))
    total = np.einsum(sums[spec], w)
    total = total[:, None] if total.ndim == 1 else total
    got = ensemble.combine_logits(jnp.asarray(per), w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, raw / total, rtol=1e-5, atol=1e-6, err_msg=spec)
    np.testing.assert_allclose(
      ensemble.combine_logits(jnp.asarray(per), w, normalize=False), raw, rtol=1e-5, atol=1e-6
    )
  np.testing.assert_allclose(ensemble.combine_logits(jnp.asarray(per)), per.mean(0), rtol=1e-6)
  with pytest.raises(ValueError, match=r'^weights must have 1-3 dims, got shape \(1, 4, 3, 5\)$'):
    ensemble.combine_logits(jnp.asarray(per), np.ones((1, 4, 3, 5)))


def test_auto_strategy_is_a_loop_on_the_cpu_and_vmap_on_accelerators(monkeypatch):
  assert ensemble.resolve_strategy('auto') == 'loop'  # the suite runs on the CPU
  assert ensemble.resolve_strategy('vmap') == 'vmap'
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert ensemble.resolve_strategy('auto') == 'vmap'
  assert ensemble.resolve_strategy('loop') == 'loop'
  with pytest.raises(ValueError, match=r"^strategy must be 'auto', 'vmap' or 'loop', got 'scan'$"):
    ensemble.resolve_strategy('scan')
