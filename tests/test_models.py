"""Tests of the model zoo (jfed.models): registry, shapes, masks, BN sowing, PyTorch parity."""

import math

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed.models import available_models, get_model, layers, param_count, register_model

SHAPES = [(8, 8, 1), (28, 28, 1), (32, 32, 3)]
NUM_CLASSES = 7
# On XLA:CPU un-jitted flax code compiles every primitive once per distinct shape, which
# dominates this file's run time. So every test uses the same batch size (cache hits across
# tests), an 'rbg' PRNG key (its kernels compile faster than threefry's) and tiny widths.
BATCH = 8

# Cheap settings for the big models; every other model is built with its defaults.
TINY_KW = {
  'resnet18': dict(width_mult=1e-3),  # every conv 1 channel (shortcut convs still exist)
  'googlenet': dict(width_mult=1e-3),  # every conv 1 channel: modules share shapes
  'vgg9': dict(width_mult=1 / 8, fc_width=32),
  'hfldd_cnn_cifar': dict(channels=(8, 8, 16, 16)),
  'cnn_cifar': dict(channels=(16, 16, 16)),
  'hfldd_cnn_cinic': dict(width=16),
}
BN_MODELS = ['cnn_mnist', 'fedhydra_cnn2', 'hfldd_cnn_cifar', 'resnet18', 'googlenet']
EXPECTED = {
  'cnn_mnist',
  'cnn_cifar',
  'fedhydra_cnn2',
  'fedhydra_cnn3',
  'lenet',
  'resnet18',
  'googlenet',
  'vgg9',
  'hfldd_cnn_mnist',
  'hfldd_cnn_cifar',
  'mlp',
}


def _build(name, shape, num_classes=NUM_CLASSES):
  return get_model(name, num_classes, shape, **TINY_KW.get(name, {}))


def _init(model, shape, batch=BATCH, seed=0):
  key = jax.random.key(seed, impl='rbg')
  return model.init(key, np.zeros((batch, *shape), np.float32), train=False)


def _images(shape, batch, seed=1):
  # NumPy, not jax.random: un-jitted jax ops would compile once per new shape.
  return np.random.default_rng(seed).random((batch, *shape), dtype=np.float32)


def _count_params(name, shape, num_classes=10, **kw):
  model = get_model(name, num_classes, shape, **kw)
  variables = jax.eval_shape(lambda: _init(model, shape))
  return param_count(variables['params'])


# ------------------------------------------------------------------------------- registry
def test_registry_lists_the_required_models():
  assert EXPECTED <= set(available_models())
  assert available_models() == sorted(available_models())


def test_unknown_model_name_lists_valid_names():
  with pytest.raises(ValueError) as err:
    get_model('no_such_net', 10, (28, 28, 1))
  msg = str(err.value)
  assert 'no_such_net' in msg
  for name in EXPECTED:
    assert name in msg


def test_bad_input_shape_and_duplicate_registration():
  with pytest.raises(ValueError):
    get_model('mlp', 10, (28, 28))
  with pytest.raises(ValueError):
    register_model('mlp')(lambda num_classes, input_shape: None)


def test_name_lookup_is_case_insensitive():
  assert type(get_model('LeNet', 10, (28, 28, 1))).__name__ == 'LeNet'


# ------------------------------------------------------------------------- every model/shape
# The image shape each model was written for; the third shape of SHAPES runs in the slow set
# (the suite keeps each model at the tests' 8x8x1 digits and at its own shape).
COLOUR_MODELS = {'cnn_cifar', 'hfldd_cnn_cifar', 'hfldd_cnn_cinic', 'resnet18', 'googlenet', 'vgg9'}


def _forward_cases():
  for name in sorted(available_models()):
    native = (32, 32, 3) if name in COLOUR_MODELS else (28, 28, 1)
    for shape in SHAPES:
      marks = () if shape in ((8, 8, 1), native) else (pytest.mark.slow,)
      yield pytest.param(name, shape, marks=marks, id=f'{name}-' + 'x'.join(map(str, shape)))


@pytest.mark.parametrize('name,shape', list(_forward_cases()))
def test_forward_train_and_eval(name, shape):
  model = _build(name, shape)
  variables = _init(model, shape)
  x = _images(shape, BATCH)
  logits, updates = model.apply(variables, x, train=True, mutable=['batch_stats'])
  assert logits.shape == (BATCH, NUM_CLASSES)
  assert np.all(np.isfinite(logits))
  has_bn = 'batch_stats' in variables
  assert has_bn == (name in BN_MODELS)
  if has_bn:
    before = jax.tree.leaves(variables['batch_stats'])
    after = jax.tree.leaves(updates['batch_stats'])
    assert any(not np.allclose(a, b) for a, b in zip(after, before))
    variables = {**variables, 'batch_stats': updates['batch_stats']}
  eval_logits = model.apply(variables, x, train=False)
  assert eval_logits.shape == (BATCH, NUM_CLASSES)
  assert np.all(np.isfinite(eval_logits))
  # eval mode is per-sample: a sample's logits do not depend on the rest of the batch
  x_other = np.concatenate([x[:1], _images(shape, BATCH - 1, seed=9)])
  np.testing.assert_allclose(
    model.apply(variables, x_other, train=False)[0], eval_logits[0], rtol=1e-4, atol=1e-5
  )


# ------------------------------------------------------------------------------- BN mask
@pytest.mark.parametrize('name', ['cnn_mnist', 'resnet18'])
def test_mask_excludes_padded_rows(name):
  """Train mode on [real rows, garbage rows] with a mask == train mode on the real rows alone.

  "Alone" is the real rows tiled twice: a batch with exactly the same BN statistics (mean and
  biased variance) and per-sample outputs as the real rows by themselves, and of the same batch
  size as everything else in this file (see BATCH)."""
  shape = (28, 28, 1) if name == 'cnn_mnist' else (8, 8, 1)
  model = _build(name, shape)
  variables = _init(model, shape)
  n_real = BATCH // 2
  real = _images(shape, n_real, seed=3)
  garbage = 50.0 * _images(shape, BATCH - n_real, seed=4) - 7.0
  padded = np.concatenate([real, garbage])
  mask = np.arange(BATCH) < n_real
  out_alone, upd_alone = model.apply(
    variables, np.concatenate([real, real]), train=True, mutable=['batch_stats']
  )
  out_masked, upd_masked = model.apply(
    variables, padded, train=True, mask=mask, mutable=['batch_stats']
  )
  np.testing.assert_allclose(out_masked[:n_real], out_alone[:n_real], rtol=1e-4, atol=1e-4)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
    upd_masked['batch_stats'],
    upd_alone['batch_stats'],
  )
  # without the mask the garbage rows do change the statistics
  _, upd_unmasked = model.apply(variables, padded, train=True, mutable=['batch_stats'])
  diffs = jax.tree.leaves(
    jax.tree.map(
      lambda a, b: float(np.max(np.abs(np.asarray(a) - b))),
      upd_unmasked['batch_stats'],
      upd_alone['batch_stats'],
    )
  )
  assert max(diffs) > 1e-3


def test_mask_on_really_smaller_batch():
  """The same property against a genuinely smaller batch (cheap model only)."""
  shape = (8, 8, 1)
  model = _build('cnn_mnist', shape)
  variables = _init(model, shape)
  real = _images(shape, 5, seed=3)
  padded = np.concatenate([real, 9.0 * _images(shape, BATCH - 5, seed=4)])
  out_alone, upd_alone = model.apply(variables, real, train=True, mutable=['batch_stats'])
  out_masked, upd_masked = model.apply(
    variables, padded, train=True, mask=np.arange(BATCH) < 5, mutable=['batch_stats']
  )
  np.testing.assert_allclose(out_masked[:5], out_alone, rtol=1e-4, atol=1e-4)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
    upd_masked['batch_stats'],
    upd_alone['batch_stats'],
  )


@pytest.mark.parametrize(
  'shape,x_dtype,bn_dtype',
  [
    ((BATCH, 5, 5, 3), jnp.float32, None),
    ((BATCH, 4), jnp.float32, None),
    ((BATCH, 3, 3, 2), jnp.bfloat16, None),
    ((BATCH, 3, 3, 2), jnp.bfloat16, jnp.bfloat16),
  ],
)
def test_masked_batchnorm_equals_flax_with_an_elementwise_mask(shape, x_dtype, bn_dtype):
  """The masked train path (per-row weights) against flax's nn.BatchNorm given the mask
  broadcast to every element: output and its dtype, running statistics, both gradients."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(2.0, 3.0, shape), x_dtype)
  mask = jnp.asarray(np.arange(BATCH) % 3 != 1)
  variables = layers.BatchNorm(dtype=bn_dtype).init(jax.random.key(0), x, True)
  params = jax.tree.map(lambda a: a + 0.1 * rng.normal(size=a.shape), variables['params'])
  stats = jax.tree.map(lambda a: a + 0.3, variables['batch_stats'])

  def jfed_bn(p, x):
    y, upd = layers.BatchNorm(dtype=bn_dtype).apply(
      {'params': p, 'batch_stats': stats}, x, True, mask, mutable=['batch_stats']
    )
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, upd['batch_stats']['bn'])

  def flax_bn(p, x):
    bn = flax_nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, dtype=bn_dtype)
    full_mask = jnp.broadcast_to(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)
    y, upd = bn.apply(
      {'params': p['bn'], 'batch_stats': stats['bn']}, x, mask=full_mask, mutable=['batch_stats']
    )
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, upd['batch_stats'])

  (_, (y, new_stats)), grads = jax.value_and_grad(jfed_bn, (0, 1), has_aux=True)(params, x)
  (_, (y_ref, ref_stats)), ref_grads = jax.value_and_grad(flax_bn, (0, 1), has_aux=True)(params, x)
  assert y.dtype == y_ref.dtype
  tol = 1e-5 if y.dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.float32(y), np.float32(y_ref), rtol=tol, atol=tol)
  for name in ('mean', 'var'):
    np.testing.assert_allclose(new_stats[name], ref_stats[name], rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- bn_inputs sow
@pytest.mark.parametrize('name,shape', [('cnn_mnist', (28, 28, 1)), ('googlenet', (8, 8, 1))])
def test_bn_inputs_sows_one_pair_per_bn_layer(name, shape):
  model = _build(name, shape)
  variables = _init(model, shape)
  x = _images(shape, BATCH)
  logits, state = model.apply(variables, x, train=False, mutable=['bn_inputs'])
  assert logits.shape == (BATCH, NUM_CLASSES)
  bn_layers = jax.tree.leaves(variables['batch_stats'])  # mean and var per layer
  num_bn = len(bn_layers) // 2
  sown = jax.tree.leaves(state['bn_inputs'])
  assert len(sown) == 2 * num_bn
  # each layer sowed exactly one (mean, var) pair whose size is the layer's channel count
  means = [
    l
    for l in jax.tree_util.tree_leaves_with_path(variables['batch_stats'])
    if 'mean' in jax.tree_util.keystr(l[0])
  ]
  assert sorted(m.shape for _, m in means) == sorted(s.shape for s in sown[::2])
  assert all(np.all(np.asarray(v) >= 0) for v in sown[1::2])


def test_cnn_mnist_first_bn_input_stats():
  shape = (28, 28, 1)
  model = _build('cnn_mnist', shape)
  variables = _init(model, shape)
  x = _images(shape, BATCH)
  _, state = model.apply(variables, x, train=False, mutable=['bn_inputs'])
  conv_out = (
    jax.lax.conv_general_dilated(
      x,
      variables['params']['Conv_0']['kernel'],
      (1, 1),
      ((2, 2), (2, 2)),
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
    )
    + variables['params']['Conv_0']['bias']
  )
  mean, var = state['bn_inputs']['BatchNorm_0']['stats'][0]
  np.testing.assert_allclose(mean, conv_out.mean((0, 1, 2)), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(var, conv_out.var((0, 1, 2)), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- param counts
def test_cnn_mnist_param_count_matches_pytorch():
  conv1 = 16 * 1 * 25 + 16
  bn1 = 2 * 16
  conv2 = 32 * 16 * 25 + 32
  bn2 = 2 * 32
  fc = 7 * 7 * 32 * 10 + 10
  assert _count_params('cnn_mnist', (28, 28, 1)) == conv1 + bn1 + conv2 + bn2 + fc == 29034


@pytest.mark.parametrize(
  'name,shape,kw,expected',
  [
    ('resnet18', (32, 32, 3), {}, 11_173_962),  # kuangliu CIFAR ResNet18
    ('googlenet', (32, 32, 3), {}, 6_166_250),  # kuangliu CIFAR GoogLeNet
    ('cnn_cifar', (32, 32, 3), {}, 319_242),  # DENSE CNNCifar
    ('fedhydra_cnn3', (32, 32, 3), {}, 122_570),  # DENSE CNNCifar2
    ('lenet', (32, 32, 3), {}, 62_006),  # kuangliu LeNet
    ('hfldd_cnn_mnist', (28, 28, 1), {}, 44_426),  # HFLDD Sec. VI-A2
    ('hfldd_cnn_cinic', (32, 32, 3), {}, 320_010),  # HFLDD Sec. VI-A2
    ('mlp', (28, 28, 1), {}, 199_210),  # FedAvg 2NN
    ('vgg9', (32, 32, 3), {}, 69_167_498),  # FedMHO VGG9 (PyTorch count)
  ],
)
def test_reference_param_counts(name, shape, kw, expected):
  assert _count_params(name, shape, **kw) == expected


def test_resnet18_width_mult_is_heterofl_ceil():
  model = get_model('resnet18', 10, (32, 32, 3), width_mult=0.3)
  assert model.widths == (20, 39, 77, 154)
  full = _count_params('resnet18', (32, 32, 3))
  assert _count_params('resnet18', (32, 32, 3), width_mult=0.5) < full / 3


# ----------------------------------------------------------------------------- misc layers
def test_pytorch_default_init_ranges():
  shape = (28, 28, 1)
  params = _init(get_model('cnn_mnist', 10, shape), shape)['params']
  kernel, bias = np.asarray(params['Conv_1']['kernel']), np.asarray(params['Conv_1']['bias'])
  fan_in = 16 * 25
  bound = 1 / math.sqrt(fan_in)
  assert np.max(np.abs(kernel)) <= bound and np.max(np.abs(bias)) <= bound
  assert abs(np.std(kernel) - bound / math.sqrt(3)) < 0.1 * bound


def test_vgg9_dropout_needs_a_dropout_rng():
  shape = (32, 32, 3)
  model = _build('vgg9', shape)
  variables = _init(model, shape)
  x = _images(shape, BATCH)
  eval_out = model.apply(variables, x, train=False)
  np.testing.assert_allclose(model.apply(variables, x, train=True), eval_out, rtol=1e-5)
  dropped = model.apply(variables, x, train=True, rngs={'dropout': jax.random.PRNGKey(5)})
  assert not np.allclose(dropped, eval_out)


def test_pool_skip_on_tiny_maps():
  x = jnp.ones((2, 1, 1, 4))
  assert layers.pool2_or_skip(x).shape == (2, 1, 1, 4)
  assert layers.pool2_or_skip(jnp.ones((2, 5, 5, 4))).shape == (2, 2, 2, 4)


def _max_pool_oracle(x, window):
  """NumPy MaxPool2d (floor mode) and its gradient of sum(pool * weights): each window's
  gradient goes to its first maximum in row-major order, as PyTorch routes it."""
  *lead, h, w, c = x.shape
  rows, cols = h // window, w // window
  flat = x.reshape(-1, h, w, c)
  out = np.zeros((flat.shape[0], rows, cols, c), x.dtype)
  first = np.zeros(flat.shape, bool)
  for n in range(flat.shape[0]):
    for r in range(rows):
      for q in range(cols):
        for ch in range(c):
          block = flat[n, r * window : (r + 1) * window, q * window : (q + 1) * window, ch]
          i, j = np.unravel_index(np.argmax(block), block.shape)  # argmax: the first maximum
          out[n, r, q, ch] = block[i, j]
          first[n, r * window + i, q * window + j, ch] = True
  return out.reshape(*lead, rows, cols, c), first.reshape(x.shape)


# odd sizes (floor mode) at window 2; leading axes and window 3
@pytest.mark.parametrize('shape, window', [((2, 7, 9, 2), 2), ((3, 2, 7, 6, 2), 3)])
def test_max_pool_matches_an_oracle_with_tied_maxima(shape, window):
  # Small integers tie often: the gradient must go to the first maximum of a window only.
  rng = np.random.default_rng(0)
  x = rng.integers(0, 3, shape).astype(np.float32)
  expected, first = _max_pool_oracle(x, window)
  weights = rng.standard_normal(expected.shape).astype(np.float32)
  pooled = layers.max_pool(jnp.asarray(x), window)
  np.testing.assert_array_equal(pooled, expected)
  grad = jax.grad(lambda v: jnp.sum(layers.max_pool(v, window) * weights))(jnp.asarray(x))
  up = np.zeros(x.shape, np.float32)  # each window's weight, broadcast over the window
  rows, cols = expected.shape[-3], expected.shape[-2]
  up[..., : rows * window, : cols * window, :] = np.repeat(
    np.repeat(weights, window, axis=-3), window, axis=-2
  )
  np.testing.assert_allclose(grad, np.where(first, up, 0.0), rtol=0, atol=0)
  tangent = rng.standard_normal(shape).astype(np.float32)
  _, jvp = jax.jvp(lambda v: layers.max_pool(v, window), (jnp.asarray(x),), (jnp.asarray(tangent),))
  np.testing.assert_allclose(jvp, _max_pool_oracle_tangent(first, tangent, window), rtol=1e-6)


def _max_pool_oracle_tangent(first, tangent, window):
  *lead, h, w, c = first.shape
  rows, cols = h // window, w // window
  picked = np.where(first, tangent, 0.0)[..., : rows * window, : cols * window, :]
  return picked.reshape(*lead, rows, window, cols, window, c).sum(axis=(-4, -2))


def test_max_pool_gradient_matches_pytorch_with_ties():
  torch = pytest.importorskip('torch')
  rng = np.random.default_rng(3)
  x = rng.integers(0, 2, (2, 9, 8, 3)).astype(np.float32)
  weights = rng.standard_normal((2, 4, 4, 3)).astype(np.float32)
  grad = jax.grad(lambda v: jnp.sum(layers.max_pool(v, 2) * weights))(jnp.asarray(x))
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).requires_grad_()
  pooled = torch.nn.functional.max_pool2d(xt, 2)
  (pooled * torch.from_numpy(weights).permute(0, 3, 1, 2)).sum().backward()
  np.testing.assert_array_equal(grad, xt.grad.permute(0, 2, 3, 1).numpy())


# ------------------------------------------------------------------- PyTorch parity (optional)
def test_adaptive_avg_pool_matches_pytorch():
  torch = pytest.importorskip('torch')
  rng = np.random.default_rng(0)
  for h, w, out in [(4, 4, (7, 7)), (3, 3, (7, 7)), (1, 1, (7, 7)), (10, 7, (3, 4))]:
    x = rng.standard_normal((2, h, w, 5)).astype(np.float32)
    ours = np.asarray(layers.adaptive_avg_pool2d(jnp.asarray(x), out))
    ref = torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(x).permute(0, 3, 1, 2), out)
    np.testing.assert_allclose(ours, ref.permute(0, 2, 3, 1).numpy(), rtol=1e-5, atol=1e-6)


def test_strided_conv_and_padded_max_pool_match_pytorch():
  torch = pytest.importorskip('torch')
  import flax.linen as nn

  class Probe(nn.Module):
    @nn.compact
    def __call__(self, x):
      return layers.conv(x, 4, 3, stride=2, padding=1), layers.max_pool(x, 3, stride=2, padding=1)

  rng = np.random.default_rng(1)
  for size in (8, 7):
    x = rng.standard_normal((2, size, size, 3)).astype(np.float32)
    variables = Probe().init(jax.random.PRNGKey(0), jnp.asarray(x))
    (y_conv, y_pool) = Probe().apply(variables, jnp.asarray(x))
    k = np.array(variables['params']['Conv_0']['kernel'])  # HWIO (writable copy for torch)
    b = np.array(variables['params']['Conv_0']['bias'])
    xt = torch.from_numpy(x).permute(0, 3, 1, 2)
    ref_conv = torch.nn.functional.conv2d(
      xt, torch.from_numpy(k).permute(3, 2, 0, 1), torch.from_numpy(b), stride=2, padding=1
    )
    ref_pool = torch.nn.functional.max_pool2d(xt, 3, stride=2, padding=1)
    np.testing.assert_allclose(y_conv, ref_conv.permute(0, 2, 3, 1).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y_pool, ref_pool.permute(0, 2, 3, 1).numpy(), rtol=1e-6)


def test_cnn_mnist_matches_pytorch_dense_cnnmnist():
  torch = pytest.importorskip('torch')
  tnn = torch.nn
  ref = tnn.Sequential(
    tnn.Conv2d(1, 16, 5, padding=2),
    tnn.BatchNorm2d(16),
    tnn.ReLU(),
    tnn.MaxPool2d(2),
    tnn.Conv2d(16, 32, 5, padding=2),
    tnn.BatchNorm2d(32),
    tnn.ReLU(),
    tnn.MaxPool2d(2),
    tnn.Flatten(),
    tnn.Linear(7 * 7 * 32, 10),
  )
  shape = (28, 28, 1)
  model = get_model('cnn_mnist', 10, shape)
  variables = _init(model, shape)
  p = variables['params']
  with torch.no_grad():
    for i, conv_name in ((0, 'Conv_0'), (4, 'Conv_1')):
      ref[i].weight.copy_(torch.from_numpy(np.array(p[conv_name]['kernel'])).permute(3, 2, 0, 1))
      ref[i].bias.copy_(torch.from_numpy(np.array(p[conv_name]['bias'])))
    for i, bn_name in ((1, 'BatchNorm_0'), (5, 'BatchNorm_1')):
      ref[i].weight.normal_()
      ref[i].bias.normal_()
      p[bn_name]['bn']['scale'] = jnp.asarray(ref[i].weight.numpy())
      p[bn_name]['bn']['bias'] = jnp.asarray(ref[i].bias.numpy())
    # flax flattens HWC, PyTorch CHW: permute the FC input rows accordingly.
    w = np.asarray(p['Dense_0']['kernel'])  # [7*7*32 (h,w,c), 10]
    w_chw = w.reshape(7, 7, 32, 10).transpose(2, 0, 1, 3).reshape(-1, 10)
    ref[9].weight.copy_(torch.from_numpy(w_chw.T.copy()))
    ref[9].bias.copy_(torch.from_numpy(np.array(p['Dense_0']['bias'])))
  variables = {'params': p, 'batch_stats': variables['batch_stats']}
  x = np.asarray(_images(shape, BATCH))
  xt = torch.from_numpy(x).permute(0, 3, 1, 2)
  ref.train()
  with torch.no_grad():
    ref_train = ref(xt).numpy()
  ours_train, upd = model.apply(variables, jnp.asarray(x), train=True, mutable=['batch_stats'])
  np.testing.assert_allclose(ours_train, ref_train, rtol=1e-4, atol=1e-4)
  # PyTorch updates running_var with the unbiased batch variance (x n/(n-1)), flax with the
  # biased one: with n = 6*28*28 samples per channel the two differ by ~2e-5 (relative).
  np.testing.assert_allclose(
    upd['batch_stats']['BatchNorm_0']['bn']['var'], ref[1].running_var.numpy(), rtol=1e-3
  )
  np.testing.assert_allclose(
    upd['batch_stats']['BatchNorm_1']['bn']['mean'],
    ref[5].running_mean.numpy(),
    rtol=1e-5,
    atol=1e-6,
  )
  ref.eval()
  with torch.no_grad():
    ref_eval = ref(xt).numpy()
  ours_eval = model.apply({'params': p, 'batch_stats': upd['batch_stats']}, jnp.asarray(x))
  np.testing.assert_allclose(ours_eval, ref_eval, rtol=1e-4, atol=1e-4)


# The generators' convolutions: flax's layers computed as shifted-slice matmuls on CPU.
@pytest.mark.parametrize(
  'hw, cin, cout, k, stride',
  [(7, 40, 36, 4, 2), (14, 33, 64, 4, 2), (5, 32, 32, 3, 2), (6, 32, 32, 5, 3), (9, 32, 8, 3, 1)],
)
@pytest.mark.parametrize('impl', ['matmul', 'lax'])
def test_conv_transpose_is_flax_conv_transpose(hw, cin, cout, k, stride, impl):
  """layers.ConvTranspose has nn.ConvTranspose(padding='SAME')'s parameters (same names,
  shapes and initial values from the same key) and outputs and input gradients, in both forms
  (the matmul form computes each output phase from its own taps)."""
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, hw, hw + 1, cin))
  ref = flax_nn.ConvTranspose(cout, (k, k), strides=(stride, stride), padding='SAME')
  mine = layers.ConvTranspose(cout, (k, k), strides=(stride, stride), impl=impl)
  p_ref, p_mine = ref.init(key, x), mine.init(key, x)
  jax.tree.map(np.testing.assert_array_equal, p_ref, p_mine)
  want, got = ref.apply(p_ref, x), mine.apply(p_ref, x)
  assert got.shape == want.shape == (2, hw * stride, (hw + 1) * stride, cout)
  np.testing.assert_allclose(got, want, atol=1e-5)
  grad = lambda m: jax.grad(lambda xx: jnp.sum(jnp.sin(m.apply(p_ref, xx))))(x)
  np.testing.assert_allclose(grad(mine), grad(ref), atol=1e-4)


@pytest.mark.parametrize('hw, cin, cout, k, pad', [(28, 32, 33, 3, 1), (10, 40, 32, 5, 2)])
@pytest.mark.parametrize('impl', ['matmul', 'lax'])
def test_conv_is_flax_conv(hw, cin, cout, k, pad, impl):
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, hw, hw, cin))
  ref = flax_nn.Conv(cout, (k, k), padding=pad, use_bias=False)
  mine = layers.Conv(cout, (k, k), padding=pad, use_bias=False, impl=impl)
  p_ref = ref.init(key, x)
  jax.tree.map(np.testing.assert_array_equal, p_ref, mine.init(key, x))
  np.testing.assert_allclose(mine.apply(p_ref, x), ref.apply(p_ref, x), atol=1e-5)


def test_the_matmul_form_is_taken_for_wide_generator_layers_on_cpu_only():
  on_cpu = jax.default_backend() == 'cpu'
  assert layers.use_matmul_conv('auto', 128, 64, 28 * 28) == on_cpu  # DENSE conv2 at 28 px
  assert layers.use_matmul_conv('auto', 128, 128) == on_cpu  # FedHydra's transposed layers
  assert not layers.use_matmul_conv('auto', 128, 128, 14 * 14)  # as fast as XLA's there
  assert not layers.use_matmul_conv('auto', 64, 1, 28 * 28)  # an image output layer
  assert not layers.use_matmul_conv('auto', 16, 32, 14 * 14)  # CNNMnist
  assert layers.use_matmul_conv('matmul', 1, 1) and not layers.use_matmul_conv('lax', 128, 128)
  with pytest.raises(ValueError, match='conv impl'):
    layers.use_matmul_conv('fast', 128, 128)
