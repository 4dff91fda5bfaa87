"""DSA (jfed/distill/diffaugment.py): every transform against an independent NumPy (or torch)
computation or its defining property, the parameter draws against the reference's ranges, the
single-word mode, Siamese parameters, the normalised space, and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed.distill import diffaugment as da


def _images(b=4, h=8, w=8, c=1, seed=0):
  return np.random.default_rng(seed).uniform(size=(b, h, w, c)).astype(np.float32)


def _params(x, seed=0, **fixed):
  p = da.sample_params(jax.random.key(seed), x.shape)
  return {**p, **{k: jnp.asarray(v) for k, v in fixed.items()}}


def test_flip_matches_numpy_and_twice_is_identity():
  x = _images()
  which = np.array([True, False, True, False])
  got = np.asarray(da.flip(x, which))
  np.testing.assert_array_equal(got[which], x[which][:, :, ::-1])
  np.testing.assert_array_equal(got[~which], x[~which])
  np.testing.assert_array_equal(np.asarray(da.flip(got, which)), x)


def test_translate_matches_numpy_roll_with_zero_fill():
  x = _images(b=5, h=8, w=7, c=2)
  dy, dx = np.array([-2, -1, 0, 1, 2]), np.array([1, 2, 0, -2, -1])
  got = np.asarray(da.translate(x, dy, dx, max_shift=2))
  for b in range(len(x)):
    expected = np.roll(x[b], (-dy[b], -dx[b]), axis=(0, 1))
    rows, cols = np.arange(8) + dy[b], np.arange(7) + dx[b]
    expected[(rows < 0) | (rows >= 8)] = 0  # rolled in from the other side: zero fill
    expected[:, (cols < 0) | (cols >= 7)] = 0
    np.testing.assert_array_equal(got[b], expected)


def test_cutout_matches_the_reference_index_formula():
  x = _images(b=6, h=8, w=8, c=3)
  size = 4  # int(8 · 0.5 + 0.5)
  cy, cx = np.array([0, 8, 3, 5, 1, 7]), np.array([8, 0, 4, 2, 6, 7])
  got = np.asarray(da.cutout(x, cy, cx, size, size))
  for b in range(len(x)):
    # the reference: mask[clamp(arange(size) + offset - size // 2, 0, H - 1)] = 0
    rows = np.clip(np.arange(size) + cy[b] - size // 2, 0, 7)
    cols = np.clip(np.arange(size) + cx[b] - size // 2, 0, 7)
    mask = np.ones((8, 8), np.float32)
    mask[rows[:, None], cols[None, :]] = 0
    np.testing.assert_array_equal(got[b], x[b] * mask[:, :, None])


def test_color_transforms_match_their_formulas():
  x = _images(b=3, c=3)
  r = np.array([0.0, 0.3, 0.9], np.float32)
  per = r[:, None, None, None]
  np.testing.assert_allclose(da.brightness(x, r), x + (per - 0.5) * 1.0, rtol=1e-6)
  m = x.mean(axis=3, keepdims=True)
  np.testing.assert_allclose(da.saturation(x, r), (x - m) * per * 2.0 + m, rtol=1e-5, atol=1e-6)
  m = x.mean(axis=(1, 2, 3), keepdims=True)
  np.testing.assert_allclose(da.contrast(x, r), (x - m) * (per + 0.5) + m, rtol=1e-5, atol=1e-6)
  gray = _images(b=3, c=1)
  np.testing.assert_allclose(da.saturation(gray, r), gray, atol=1e-6)  # one channel: no-op


def test_affine_identity_and_quarter_turn():
  x = _images(b=2, h=6, w=6, c=2)
  one = np.ones(2, np.float32)
  np.testing.assert_allclose(da.scale(x, one, one), x, atol=1e-6)
  np.testing.assert_allclose(da.rotate(x, np.zeros(2, np.float32)), x, atol=1e-6)
  # +90°: out[i, j] = x[j, W-1-i], numpy's counter-clockwise rot90 on (H, W)
  quarter = np.asarray(da.rotate(x, np.full(2, np.pi / 2, np.float32)))
  np.testing.assert_allclose(quarter, np.rot90(x, k=1, axes=(1, 2)), atol=1e-5)


def test_scale_and_rotate_match_bilinear_sampling_with_zero_padding():
  """Against scipy's order-1 interpolation at the coordinates of affine_grid (align_corners)."""
  ndimage = pytest.importorskip('scipy.ndimage')
  x = _images(b=3, h=9, w=7, c=1)
  sx, sy = np.array([0.85, 1.2, 1.1], np.float32), np.array([1.15, 0.9, 1.0], np.float32)
  angle = np.array([0.2, -0.26, 0.1], np.float32)
  h, w = 9, 7
  gy, gx = np.meshgrid(np.linspace(-1, 1, h), np.linspace(-1, 1, w), indexing='ij')
  for kind, got in (('scale', da.scale(x, sx, sy)), ('rotate', da.rotate(x, angle))):
    for b in range(len(x)):
      if kind == 'scale':
        u, v = sx[b] * gx, sy[b] * gy
      else:
        c, s = np.cos(angle[b]), np.sin(angle[b])
        u, v = c * gx - s * gy, s * gx + c * gy
      coords = [(v + 1) / 2 * (h - 1), (u + 1) / 2 * (w - 1)]
      expected = ndimage.map_coordinates(x[b, ..., 0], coords, order=1, mode='grid-constant')
      np.testing.assert_allclose(np.asarray(got)[b, ..., 0], expected, atol=1e-5, err_msg=kind)


def test_affine_matches_torch_grid_sample():
  """The reference's own ops: F.grid_sample(x, F.affine_grid(θ, align_corners=True), ...)."""
  torch = pytest.importorskip('torch')
  x = _images(b=2, h=8, w=8, c=3)
  theta = np.array([[[0.9, -0.2, 0.0], [0.2, 0.9, 0.0]], [[1.1, 0.0, 0.0], [0.0, 0.85, 0.0]]])
  xt = torch.tensor(x).permute(0, 3, 1, 2)
  grid = torch.nn.functional.affine_grid(
    torch.tensor(theta, dtype=torch.float32), xt.shape, align_corners=True
  )
  expected = torch.nn.functional.grid_sample(xt, grid, align_corners=True).permute(0, 2, 3, 1)
  got = da.affine(x, theta.astype(np.float32))
  np.testing.assert_allclose(np.asarray(got), expected.numpy(), atol=1e-5)


def test_sampled_parameters_cover_the_reference_ranges():
  shape = (4000, 28, 28, 1)
  p = {k: np.asarray(v) for k, v in da.sample_params(jax.random.key(0), shape).items()}
  # rand_crop: randint(-s, s + 1) with s = int(28 · 0.125 + 0.5) = 4
  assert set(p['crop_y']) == set(p['crop_x']) == set(range(-4, 5))
  # rand_cutout: size int(28 · 0.5 + 0.5) = 14 (even) -> randint(0, 28 + 1)
  assert set(p['cutout_y']) == set(range(0, 29))
  assert 0.45 < p['flip'].mean() < 0.55
  assert 1 / 1.2 <= p['scale_x'].min() < 0.85 and 1.18 < p['scale_x'].max() <= 1.2
  limit = 15 / 180 * np.pi
  assert -limit <= p['rotate'].min() < -0.95 * limit and 0.95 * limit < p['rotate'].max() <= limit
  odd = da.sample_params(jax.random.key(0), (4000, 7, 7, 1))  # size int(4.0) = 4, even
  assert set(np.asarray(odd['cutout_y'])) == set(range(0, 8))
  odd = da.sample_params(jax.random.key(0), (4000, 5, 5, 1))  # size int(3.0) = 3, odd
  assert set(np.asarray(odd['cutout_y'])) == set(range(0, 5))


def test_single_mode_applies_one_uniformly_chosen_word():
  x = _images(b=3)
  words = da.strategy_words(da.DEFAULT_STRATEGY)
  keys = jax.random.split(jax.random.key(0), 240)
  params = jax.vmap(lambda k: da.sample_params(k, x.shape))(keys)
  chosen = np.minimum(np.floor(np.asarray(params['choice'][:, 0]) * 6), 5).astype(int)
  got = jax.jit(jax.vmap(lambda k: da.DiffAugment()(k, x)))(keys)
  per_word = [jax.vmap(lambda p, w=w: da.apply_word(w, x, p))(params) for w in words]
  expected = np.stack(per_word)[chosen, np.arange(len(keys))]
  np.testing.assert_allclose(got, expected, atol=1e-6)
  counts = np.bincount(chosen, minlength=6)
  assert counts.min() >= 20, counts  # 40 expected per word
  # mode 'M' runs every word in order
  p = da.sample_params(jax.random.key(0), x.shape)
  expected = x
  for word in words:
    expected = da.apply_word(word, expected, p)
  got = da.apply_params(x, p, da.DEFAULT_STRATEGY, single=False)
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_siamese_and_batchwise_parameters():
  a, b = _images(seed=1), _images(seed=2)
  p = da.sample_params(jax.random.key(3), a.shape)
  strategy = 'crop_cutout_flip_scale_rotate'  # linear in the images for fixed parameters
  for word in da.strategy_words(strategy):
    fa, fb = da.apply_word(word, a, p), da.apply_word(word, b, p)
    np.testing.assert_allclose(da.apply_word(word, a + 2 * b, p), fa + 2 * fb, atol=1e-5)
  aug = da.DiffAugment(strategy)
  np.testing.assert_array_equal(aug(jax.random.key(5), a), aug(jax.random.key(5), a))
  same = np.repeat(a[:1], 6, axis=0)
  out = np.asarray(da.DiffAugment(da.DEFAULT_STRATEGY, batchwise=True)(jax.random.key(7), same))
  np.testing.assert_array_equal(out, np.repeat(out[:1], 6, axis=0))


def test_normalised_space_fill_and_brightness():
  """Augmenting pixel images in the reference's normalised space: shifted-in pixels are the
  mean pixel (0 in that space) and brightness moves a pixel by std · (r − 0.5)."""
  mean, std = 0.1307, 0.3081
  x = _images(b=16)
  key = jax.random.key(0)
  p = da.sample_params(key, x.shape)
  got = np.asarray(da.DiffAugment('crop', mean, std)(key, x))
  dy, dx = np.asarray(p['crop_y']), np.asarray(p['crop_x'])
  np.testing.assert_allclose(got, np.asarray(da.translate(x - mean, dy, dx, 1)) + mean, atol=1e-6)
  down = np.flatnonzero(dy == 1)
  assert len(down), dy
  np.testing.assert_allclose(got[down, -1], mean, atol=1e-6)  # the row shifted in
  flat = np.full((16, 8, 8, 1), 0.7, np.float32)  # saturation and contrast leave it alone
  r = np.asarray(p['brightness'])[:, None, None, None]
  got = da.DiffAugment('color', mean, std)(key, flat)
  np.testing.assert_allclose(got, flat + std * (r - 0.5), atol=1e-6)
  assert da.DiffAugment('none')(key, x) is x


def test_gradients_flow_through_every_word():
  x = jnp.asarray(_images(b=3, c=3))
  w = jnp.asarray(np.random.default_rng(1).normal(size=x.shape).astype(np.float32))
  d = jnp.asarray(np.random.default_rng(2).normal(size=x.shape).astype(np.float32))
  for word in da.WORDS:
    aug = da.DiffAugment(word)
    key = jax.random.key(11)
    f = lambda y, aug=aug: aug(key, y)
    g = jax.grad(lambda y: jnp.sum(f(y) * w))(x)
    assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), word
    # affine in the images for fixed parameters: the JVP is the exact finite difference
    _, tangent = jax.jvp(f, (x,), (d,))
    np.testing.assert_allclose(tangent, f(x + d) - f(x), atol=1e-4, err_msg=word)
  # flip's gradient is the flipped cotangent where it flipped
  which = np.array([True, False, True])
  g = jax.grad(lambda y: jnp.sum(da.flip(y, which) * w))(x)
  np.testing.assert_allclose(np.asarray(g)[which], np.asarray(w)[which][:, :, ::-1])
  np.testing.assert_allclose(np.asarray(g)[~which], np.asarray(w)[~which])


def test_unknown_word_is_refused():
  with pytest.raises(ValueError, match='blur'):
    da.strategy_words('color_blur')
  assert da.strategy_words('') == da.strategy_words('none') == ()
