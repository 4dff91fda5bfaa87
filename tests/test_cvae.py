"""CVAE clients (FedMHO, FedCVAE): models, Eq. 3, the generation counts and the K-means filter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits

from jfed.cvae import CVAE, CVAEOutput, cvae_loss, generation_counts, kmeans_filter, kmeans_keep
from jfed.cvae import clients as cvae_clients
from jfed.cvae.models import to_image_shape
from jfed.io import UploadError
from jfed.models import param_count


def _init(model, shape, batch=2):
  x, y = jnp.zeros((batch, *shape)), jnp.zeros((batch,), jnp.int32)
  return model.init(jax.random.PRNGKey(0), x, y, jax.random.PRNGKey(1))


def _shapes(model, shape, batch=2):
  """The variables' shapes without running anything (eager conv layers compile op by op)."""
  return jax.eval_shape(lambda: _init(model, shape, batch))


@pytest.mark.parametrize(
  'size,expected',
  [
    # enc Linear(784+10, 256), 2 x Linear(256, 20); dec Linear(20+10, 256), Linear(256, 784)
    ('small', 794 * 256 + 256 + 2 * (256 * 20 + 20) + 30 * 256 + 256 + 256 * 784 + 784),
    # enc convs 1-64-128-256, Linear(256*7*7, 256), 2 x Linear(256+10, 20); dec Linear(30, 256),
    # Linear(256, 256*7*7), ConvT 256-128-64-1
    (
      'large',
      (9 * 64 + 64)
      + (9 * 64 * 128 + 128)
      + (9 * 128 * 256 + 256)
      + (12544 * 256 + 256)
      + 2 * (266 * 20 + 20)
      + (30 * 256 + 256)
      + (256 * 12544 + 12544)
      + (9 * 256 * 128 + 128)
      + (9 * 128 * 64 + 64)
      + (9 * 64 + 1),
    ),
    # FedCVAE v0 (latent 20): enc Conv4x4 1-32-32-64-64 (bias) with BN (2 per channel),
    # Linear(256, 500), Linear(500, 40); dec Linear(30, 256), ConvT4x4 64-64-32-32-1 (bias), BN
    (
      'v0',
      (16 * 32 + 32 + 64)
      + (16 * 32 * 32 + 32 + 64)
      + (16 * 32 * 64 + 64 + 128)
      + (16 * 64 * 64 + 64 + 128)
      + (256 * 500 + 500)
      + (500 * 40 + 40)
      + (30 * 256 + 256)
      + (16 * 64 * 64 + 64 + 128)
      + (16 * 64 * 32 + 32 + 64)
      + (16 * 32 * 32 + 32 + 64)
      + (16 * 32 + 1),
    ),
  ],
)
def test_cvae_parameter_counts_match_the_reference_architectures(size, expected):
  variables = _shapes(CVAE(10, (28, 28, 1), size), (28, 28, 1))
  assert param_count(variables['params']) == expected
  assert set(variables['params']) == {'encoder', 'decoder'}


def test_cvae_small_spec_has_the_reference_latent_and_table_2_flops():
  """A 'cvae:size=small' spec has the FedMHO reference's default latent size, 2: its
  multiply-accumulates per sample on 28x28 images (every layer a Linear: the sum of the kernel
  sizes) are then 408,064, FedMHO Table 2's 408.06K for CVAE-small (latent 20 would give
  421,888). CVAE-large keeps the reference's hard-coded latent 20."""
  small = cvae_clients.build_cvae({'size': 'small'}, 10, (28, 28, 1))
  assert small.latent == 2
  kernels = jax.tree_util.tree_leaves_with_path(_shapes(small, (28, 28, 1))['params'])
  macs = sum(int(np.prod(v.shape)) for path, v in kernels if 'kernel' in jax.tree_util.keystr(path))
  assert macs == 794 * 256 + 2 * 256 * 2 + 12 * 256 + 256 * 784 == 408_064
  assert cvae_clients.build_cvae({'size': 'large'}, 10, (28, 28, 1)).latent == 20
  assert cvae_clients.build_cvae({'size': 'small', 'latent': 20}, 10, (28, 28, 1)).latent == 20


def test_a_cvae_spec_reads_each_option_and_defaults_to_the_references_cvae_small():
  """A bare 'cvae' is generative and is CVAE-small with the FedMHO reference's latent 2, hidden
  256, full width; v0 defaults to latent 20; width_mult scales CVAE-large's conv channels (64,
  128, 256) in its encoder and decoder, never below one channel."""
  assert cvae_clients.is_generative('cvae') and cvae_clients.is_generative(' CVAE : size=large')
  assert not cvae_clients.is_generative('mlp')
  bare = cvae_clients.build_cvae({}, 10, (8, 8, 1))
  assert (bare.size, bare.latent, bare.hidden, bare.width_mult) == ('small', 2, 256, 1.0)
  assert cvae_clients.build_cvae({'size': 'v0'}, 10, (8, 8, 1)).latent == 20
  assert cvae_clients.build_cvae({'size': 'large'}, 10, (8, 8, 1)).width_mult == 1.0

  def channels(model):
    params = _shapes(model, (8, 8, 1))['params']
    encoder = [params['encoder'][f'Conv_{i}']['kernel'].shape[-1] for i in range(3)]
    decoder = [params['decoder'][f'ConvTranspose_{i}']['kernel'].shape[-2] for i in range(3)]
    return encoder, decoder

  quarter = cvae_clients.build_cvae({'size': 'large', 'width_mult': 0.25}, 10, (8, 8, 1))
  assert channels(quarter) == ([16, 32, 64], [64, 32, 16])
  assert channels(CVAE(10, (8, 8, 1), 'large', width_mult=1 / 64)) == ([1, 2, 4], [4, 2, 1])


@pytest.mark.parametrize('size', ['large', 'v0'])
def test_cvae_transposed_convolutions_have_pytorchs_default_init(size):
  """PyTorch's ConvTranspose2d draws its weight and bias from U(-b, b), b = 1/sqrt(fan_in), the
  fan-in taken from the weight's dimension 1 (out_channels) times the kernel's area."""
  model = CVAE(10, (8, 8, 1), size, width_mult=0.25 if size == 'large' else 1.0)
  decoder = cvae_clients.init_cvae(model, (8, 8, 1), jax.random.PRNGKey(0)).params['decoder']
  layers = sorted(k for k in decoder if k.startswith('ConvTranspose'))
  assert len(layers) == (3 if size == 'large' else 4)
  for name in layers:
    kernel, bias = np.asarray(decoder[name]['kernel']), np.asarray(decoder[name]['bias'])
    side, out = kernel.shape[0], kernel.shape[-1]
    bound = 1 / np.sqrt(out * side * side)
    for w in (kernel, bias):
      assert np.abs(w).max() <= bound, name
      if w.size >= 32:  # enough draws to span the interval
        assert w.max() > 0.8 * bound and w.min() < -0.8 * bound, name


@pytest.mark.parametrize('size', ['small', 'large'])
@pytest.mark.parametrize('shape', [(8, 8, 1), (28, 28, 1), (32, 32, 3)])
def test_cvae_shapes_and_decoder_alone(size, shape):
  """Every output shape, and the decoder run from its own parameters (what a client uploads);
  on the 8x8 digits also the numbers: the decoder alone equals the decoder inside the CVAE."""
  model = CVAE(10, shape, size)
  labels = jnp.array([0, 4, 9])
  x = jnp.ones((3, *shape)) * 0.5
  numeric = shape == (8, 8, 1)
  variables = _init(model, shape, 3) if numeric else _shapes(model, shape, 3)

  def apply(*args, method=None):
    run = lambda *a: model.apply(*a, method=method)
    return run(*args) if numeric else jax.eval_shape(run, *args)

  out = apply(variables, x, labels, jax.random.PRNGKey(3))
  assert out.recon_logits.shape == (3, *shape) and out.mu.shape == out.logvar.shape == (3, 20)
  decoder_only = {'params': {'decoder': variables['params']['decoder']}}
  decoded = apply(decoder_only, jnp.zeros((3, 20)), labels, method=CVAE.decode)
  assert decoded.shape == (3, *shape)
  if numeric:  # z = mu + exp(logvar / 2) * eps with the same key
    eps = jax.random.normal(jax.random.PRNGKey(3), out.mu.shape)
    z = out.mu + jnp.exp(0.5 * out.logvar) * eps
    again = model.apply(decoder_only, z, labels, method=CVAE.decode)
    np.testing.assert_allclose(again, out.recon_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('shape', [(8, 8, 1), (28, 28, 1), (32, 32, 3)])
def test_fedcvae_v0_works_at_32_pixels_and_maps_back_to_the_dataset_shape(shape):
  """v0 reconstructs at 32x32 (the reference resizes MNIST-family data to 32), its loss compares
  with the images resized to 32, and decoded images come back at the dataset's size."""
  model = CVAE(10, shape, 'v0', latent=10)
  labels = jnp.array([0, 4, 9])
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(3, *shape)), jnp.float32)
  variables = _shapes(model, shape, 3)
  assert set(variables['batch_stats']) == {'encoder', 'decoder'}
  out = jax.eval_shape(lambda v: model.apply(v, x, labels, jax.random.PRNGKey(3)), variables)
  assert out.recon_logits.shape == (3, 32, 32, shape[-1]) and out.mu.shape == (3, 10)
  assert model.native_shape == (32, 32, shape[-1])
  logits = jnp.zeros((3, 32, 32, shape[-1]))
  zeros = jnp.zeros((3, 10))
  loss, _ = cvae_loss(CVAEOutput(logits, zeros, zeros), x, jnp.ones(3))
  # BCE(sigmoid(0) = 1/2, t) = ln 2 per pixel whatever t: 32·32·C pixels, not H·W·C.
  np.testing.assert_allclose(float(loss), 32 * 32 * shape[-1] * np.log(2), rtol=1e-4)  # float32 sum
  back = to_image_shape(model, jax.nn.sigmoid(logits))
  assert back.shape == (3, *shape)
  np.testing.assert_allclose(np.asarray(back), 0.5, atol=1e-6)


def test_fedcvae_v0_batchnorm_ignores_padding_and_uploads_its_statistics():
  """The v0 objective updates the BatchNorm running statistics from the real samples only (a
  padded client trains as alone); the decoder's statistics travel with the upload, are
  validated, and the server decodes with them (eval mode)."""
  d = load_digits()
  x = jnp.asarray((d.images[:12] / 16.0).astype(np.float32)[..., None])
  y = jnp.asarray(d.target[:12])
  model = CVAE(10, (8, 8, 1), 'v0', latent=10)
  state = cvae_clients.init_cvae(model, (8, 8, 1), jax.random.PRNGKey(0))
  objective = cvae_clients.cvae_objective()
  key = jax.random.PRNGKey(5)
  padded_x = jnp.concatenate([x, jnp.ones_like(x[:4])])
  padded_y = jnp.concatenate([y, y[:4]])
  weights = jnp.concatenate([jnp.ones(12), jnp.zeros(4)])
  # jitted: run op by op, the objective compiled about 280 one-primitive programs (cold time)
  step = jax.jit(lambda p, s, x, y, w, k: objective(model, p, s, x, y, w, k))
  alone = step(state.params, state.batch_stats, x, y, jnp.ones(12), key)
  padded = step(state.params, state.batch_stats, padded_x, padded_y, weights, key)
  np.testing.assert_allclose(float(alone[0]), float(padded[0]), rtol=1e-5)
  for a, b, old in zip(
    jax.tree.leaves(alone[1][3]), jax.tree.leaves(padded[1][3]), jax.tree.leaves(state.batch_stats)
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  moved = [
    not np.allclose(a, o)
    for a, o in zip(jax.tree.leaves(alone[1][3]), jax.tree.leaves(state.batch_stats))
  ]
  assert all(moved)  # every running mean and variance took a step towards the batch's

  # Two clients: the second's decoder statistics are doubled variances, so decoding differs.
  trained = state._replace(batch_stats=alone[1][3])
  models = jax.tree.map(lambda a: jnp.stack([a, a]), trained)
  models = models._replace(
    batch_stats=jax.tree_util.tree_map_with_path(
      lambda p, a: a.at[1].multiply(2.0) if 'decoder' in jax.tree_util.keystr(p) else a,
      models.batch_stats,
    )
  )
  counts = np.array([[12] + [0] * 9, [0, 12] + [0] * 8], np.int32)
  uploads = cvae_clients.receive_decoder_uploads(np.arange(2), models, counts, trained)
  params_only = cvae_clients.receive_decoder_uploads(
    np.arange(2), models._replace(batch_stats={}), counts, trained._replace(batch_stats={})
  )
  assert uploads.upload_bytes > params_only.upload_bytes
  z = jnp.zeros((2, 3, 10))
  labels = np.zeros((2, 3), np.int32)
  # generation as the methods draw it: every decoder with its own uploaded statistics
  images, got_labels, owners = cvae_clients.generate(model, uploads, labels, labels == 0, z)
  assert images.shape == (6, 8, 8, 1)
  np.testing.assert_array_equal(owners, [0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(got_labels, 0)
  images = images.reshape(2, 3, 8, 8, 1)
  want = jax.jit(
    lambda v, z, labels: jax.nn.sigmoid(model.apply(v, z, labels, method=CVAE.decode))
  )(
    {
      'params': {'decoder': trained.params['decoder']},
      'batch_stats': {'decoder': trained.batch_stats['decoder']},
    },
    z[0],
    jnp.asarray(labels[0]),
  )
  np.testing.assert_allclose(
    np.asarray(images[0]), np.asarray(to_image_shape(model, want)), rtol=1e-5, atol=1e-6
  )
  assert not np.allclose(images[0], images[1])
  nan_stats = jax.tree.map(lambda a: a.at[1].set(np.nan), models)
  with pytest.raises(UploadError, match='BatchNorm statistics'):
    cvae_clients.receive_decoder_uploads(
      np.arange(2), nan_stats._replace(params=models.params), counts, trained
    )


def test_cvae_loss_equals_eq3_computed_by_hand():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 3, 3, 1)).astype(np.float32)
  x = rng.uniform(size=(4, 3, 3, 1)).astype(np.float32)
  mu, logvar = (
    rng.normal(size=(4, 5)).astype(np.float32),
    rng.normal(size=(4, 5)).astype(np.float32),
  )
  weights = np.array([1, 1, 1, 0], np.float32)  # the last sample is padding
  p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  bce = -(x * np.log(p) + (1 - x) * np.log(1 - p)).reshape(4, -1).sum(1)
  kl = -0.5 * (1 + logvar - mu**2 - np.exp(logvar)).sum(1)
  for beta in (1.0, 0.5):
    loss, (recon, kl_mean, count) = cvae_loss(
      CVAEOutput(jnp.asarray(logits), jnp.asarray(mu), jnp.asarray(logvar)),
      jnp.asarray(x),
      jnp.asarray(weights),
      beta,
    )
    assert float(count) == 3
    np.testing.assert_allclose(float(loss), np.mean(bce[:3] + beta * kl[:3]), rtol=1e-5)
    np.testing.assert_allclose(float(recon), bce[:3].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(kl_mean), kl[:3].mean(), rtol=1e-5)
  mse, _ = cvae_loss(
    CVAEOutput(jnp.asarray(logits), jnp.asarray(mu), jnp.asarray(logvar)),
    jnp.asarray(x),
    jnp.asarray(weights),
    recon='mse',
  )
  want = (((p - x) ** 2).reshape(4, -1).sum(1) + kl)[:3].mean()
  np.testing.assert_allclose(float(mse), want, rtol=1e-5)
  # a batch with one real sample is that sample's loss
  one, _ = cvae_loss(
    CVAEOutput(jnp.asarray(logits), jnp.asarray(mu), jnp.asarray(logvar)),
    jnp.asarray(x),
    jnp.asarray([0, 0, 1, 0], jnp.float32),
  )
  np.testing.assert_allclose(float(one), bce[2] + kl[2], rtol=1e-5)


def test_an_unknown_reconstruction_loss_is_refused_naming_the_choices():
  out = CVAEOutput(jnp.zeros((2, 3, 3, 1)), jnp.zeros((2, 5)), jnp.zeros((2, 5)))
  with pytest.raises(ValueError, match=r"^recon must be one of \('bce', 'mse'\), got 'l1'$"):
    cvae_loss(out, jnp.zeros((2, 3, 3, 1)), jnp.ones(2), recon='l1')
  with pytest.raises(ValueError, match=r"^recon must be one of \('bce', 'mse'\), got 'l1'$"):
    cvae_clients.cvae_objective(recon='l1')  # a client's objective, before any training


def test_cvae_large_refuses_sides_that_four_does_not_divide():
  for shape in [(6, 8, 1), (8, 10, 1)]:
    model = CVAE(num_classes=3, image_shape=shape, size='large', latent=2)
    x = jnp.zeros((1, *shape))
    with pytest.raises(
      ValueError, match=rf'^CVAE-large needs H and W divisible by 4, got \({shape[0]}, '
    ):
      model.init(jax.random.PRNGKey(0), x, jnp.zeros(1, jnp.int32), jax.random.PRNGKey(1))


def test_cvae_small_learns_digits():
  """Adam on Eq. 3 (the paper's MNIST-family CVAE-small): the loss falls by a third."""
  d = load_digits()
  x = jnp.asarray((d.images[:256] / 16.0).astype(np.float32)[..., None])
  y = jnp.asarray(d.target[:256])
  model = CVAE(10, (8, 8, 1), 'small')
  params = _init(model, (8, 8, 1))['params']
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, key):
    def objective(p):
      out = model.apply({'params': p}, x, y, key)
      return cvae_loss(out, x, jnp.ones(len(y)))[0]

    loss, grads = jax.value_and_grad(objective)(params)
    updates, opt = tx.update(grads, opt)
    return optax.apply_updates(params, updates), opt, loss

  losses = []
  for t in range(60):
    params, opt, loss = step(params, opt, jax.random.PRNGKey(t))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.67 * np.mean(losses[:5]), (losses[:5], losses[-5:])


def _reference_counts(class_counts, total):
  """get_synthesis_data_list's loop, transcribed: int(total / C) a class, n² weights."""
  k, c = len(class_counts), len(class_counts[0])
  per_class = int(total / c)
  out = np.zeros((k, c), np.int64)
  for p in range(c):
    weights = [row[p] ** 2 for row in class_counts]
    norm = sum(weights)
    normalized = [1 / len(weights)] * k if norm == 0 else [w / norm for w in weights]
    for idx in range(k):
      out[idx, p] = int(normalized[idx] * per_class)
  return out


def test_generation_counts_follow_the_reference_weighting():
  counts = [[10, 0, 3, 0], [10, 5, 0, 0], [0, 0, 0, 0]]
  want = [[5, 0, 10, 3], [5, 10, 0, 3], [0, 0, 0, 3]]  # a class held by no decoder: uniform
  got = generation_counts(np.array(counts), 40)
  np.testing.assert_array_equal(got, want)
  assert got.dtype.kind == 'i'  # sample counts
  # a class of which one client holds a single sample: that client's weight is 1² / 1 = 1
  np.testing.assert_array_equal(
    generation_counts(np.array([[1, 4], [0, 2]]), 20), [[10, 8], [0, 2]]
  )
  rng = np.random.default_rng(1)
  for _ in range(20):
    c = rng.integers(0, 400, size=(5, 10))
    c[rng.random((5, 10)) < 0.3] = 0
    np.testing.assert_array_equal(generation_counts(c, 6000), _reference_counts(c.tolist(), 6000))
  with pytest.raises(ValueError, match='^class counts must be non-negative$'):
    generation_counts(np.array([[-1, 2]]), 10)
  for bad in (np.ones(4), np.ones((0, 4)), np.ones((1, 2, 2))):
    message = f'class_counts must be [decoders, classes], got shape {bad.shape}'
    with pytest.raises(ValueError, match=f'^{re.escape(message)}$'):
      generation_counts(bad, 10)


def test_kmeans_filter_keeps_exactly_the_rth_nearest_to_the_kmeans_centre():
  rng = np.random.default_rng(2)
  images = rng.random((50, 4, 4, 1))
  labels = np.repeat([0, 1], 25)
  images[labels == 1] += 0.5
  kept = kmeans_filter(images, labels, 0.8)
  assert len(kept) == 2 * int(0.8 * 25)
  for c in (0, 1):
    members = np.flatnonzero(labels == c)
    flat = images[members].reshape(25, -1)
    centre = KMeans(n_clusters=1, n_init=1, random_state=0).fit(flat).cluster_centers_[0]
    distance = np.linalg.norm(flat - centre, axis=1)
    want = members[np.argsort(distance)[: int(0.8 * 25)]]
    np.testing.assert_array_equal(np.sort(want), kept[np.isin(kept, members)])
  np.testing.assert_array_equal(kmeans_keep(images, 1.0), np.arange(50))  # R_th = 1: no filter
  for ratio in (0.0, 1.5):
    with pytest.raises(ValueError, match=re.escape(f'R_th must be in (0, 1], got {ratio}')):
      kmeans_keep(images, ratio)
  # nothing generated: nothing kept, as indices
  empty = kmeans_filter(np.zeros((0, 4, 4, 1)), np.zeros(0, int), 0.8)
  assert empty.shape == (0,) and empty.dtype.kind == 'i'


def test_kmeans_keep_breaks_equal_distances_by_the_lower_index():
  """Samples at the same distance from the centre are kept lowest index first (a stable order):
  the same samples on every platform, whatever NumPy's default sort does with ties."""
  rng = np.random.default_rng(3)
  half = rng.integers(1, 3, 50).astype(np.float64)  # distances 1 and 2 from the mean 0
  x = rng.permutation(np.concatenate([half, -half]))
  order = sorted(range(100), key=lambda i: (abs(x[i]), i))  # by distance, then index
  np.testing.assert_array_equal(kmeans_keep(x[:, None], 0.5), sorted(order[:50]))
