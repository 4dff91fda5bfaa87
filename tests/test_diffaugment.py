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
  flip = jax.jit(da.flip)
  got = np.asarray(flip(x, which))
  np.testing.assert_array_equal(got[which], x[which][:, :, ::-1])
  np.testing.assert_array_equal(got[~which], x[~which])
  np.testing.assert_array_equal(np.asarray(flip(got, which)), x)


def test_translate_matches_numpy_roll_with_zero_fill():
  x = _images(b=5, h=8, w=7, c=2)
  dy, dx = np.array([-2, -1, 0, 1, 2]), np.array([1, 2, 0, -2, -1])
  got = np.asarray(jax.jit(da.translate, static_argnames='max_shift')(x, dy, dx, max_shift=2))
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
  got = np.asarray(jax.jit(da.cutout, static_argnums=(3, 4))(x, cy, cx, size, size))
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
  gray = _images(b=3, c=1)
  # jitted: run op by op, each transform compiled its primitives one by one (cold time)
  bright, sat, con, sat_gray = jax.jit(
    lambda x, gray, r: (
      da.brightness(x, r),
      da.saturation(x, r),
      da.contrast(x, r),
      da.saturation(gray, r),
    )
  )(x, gray, r)
  np.testing.assert_allclose(bright, x + (per - 0.5) * 1.0, rtol=1e-6)
  m = x.mean(axis=3, keepdims=True)
  np.testing.assert_allclose(sat, (x - m) * per * 2.0 + m, rtol=1e-5, atol=1e-6)
  m = x.mean(axis=(1, 2, 3), keepdims=True)
  np.testing.assert_allclose(con, (x - m) * (per + 0.5) + m, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sat_gray, gray, atol=1e-6)  # one channel: no-op


def test_affine_identity_and_quarter_turn():
  x = _images(b=2, h=6, w=6, c=2)
  one = np.ones(2, np.float32)
  scale, rotate = jax.jit(da.scale), jax.jit(da.rotate)  # eager: ~45 one-primitive programs
  np.testing.assert_allclose(scale(x, one, one), x, atol=1e-6)
  np.testing.assert_allclose(rotate(x, np.zeros(2, np.float32)), x, atol=1e-6)
  # +90°: out[i, j] = x[j, W-1-i], numpy's counter-clockwise rot90 on (H, W)
  quarter = np.asarray(rotate(x, np.full(2, np.pi / 2, np.float32)))
  np.testing.assert_allclose(quarter, np.rot90(x, k=1, axes=(1, 2)), atol=1e-5)


def test_scale_and_rotate_match_bilinear_sampling_with_zero_padding():
  """Against scipy's order-1 interpolation at the coordinates of affine_grid (align_corners)."""
  ndimage = pytest.importorskip('scipy.ndimage')
  x = _images(b=3, h=9, w=7, c=1)
  sx, sy = np.array([0.85, 1.2, 1.1], np.float32), np.array([1.15, 0.9, 1.0], np.float32)
  angle = np.array([0.2, -0.26, 0.1], np.float32)
  h, w = 9, 7
  gy, gx = np.meshgrid(np.linspace(-1, 1, h), np.linspace(-1, 1, w), indexing='ij')
  scaled, rotated = jax.jit(lambda x: (da.scale(x, sx, sy), da.rotate(x, angle)))(x)
  for kind, got in (('scale', scaled), ('rotate', rotated)):
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
  got = jax.jit(da.affine)(x, theta.astype(np.float32))
  np.testing.assert_allclose(np.asarray(got), expected.numpy(), atol=1e-5)


def test_sampled_parameters_cover_the_reference_ranges():
  shape = (4000, 28, 28, 1)
  sample = jax.jit(da.sample_params, static_argnums=1)
  p = {k: np.asarray(v) for k, v in sample(jax.random.key(0), shape).items()}
  # rand_crop: randint(-s, s + 1) with s = int(28 · 0.125 + 0.5) = 4
  assert set(p['crop_y']) == set(p['crop_x']) == set(range(-4, 5))
  # rand_cutout: size int(28 · 0.5 + 0.5) = 14 (even) -> randint(0, 28 + 1)
  assert set(p['cutout_y']) == set(range(0, 29))
  assert 0.45 < p['flip'].mean() < 0.55
  assert 1 / 1.2 <= p['scale_x'].min() < 0.85 and 1.18 < p['scale_x'].max() <= 1.2
  limit = 15 / 180 * np.pi
  assert -limit <= p['rotate'].min() < -0.95 * limit and 0.95 * limit < p['rotate'].max() <= limit
  odd = sample(jax.random.key(0), (4000, 7, 7, 1))  # size int(4.0) = 4, even
  assert set(np.asarray(odd['cutout_y'])) == set(range(0, 8))
  odd = sample(jax.random.key(0), (4000, 5, 5, 1))  # size int(3.0) = 3, odd
  assert set(np.asarray(odd['cutout_y'])) == set(range(0, 5))


def test_single_mode_applies_one_uniformly_chosen_word():
  x = _images(b=3)
  words = da.strategy_words(da.DEFAULT_STRATEGY)
  keys = jax.random.split(jax.random.key(0), 240)

  @jax.jit  # run op by op, the vmaps and words compiled ~150 one-primitive programs
  def by_hand(keys, key):
    params = jax.vmap(lambda k: da.sample_params(k, x.shape))(keys)
    per_word = [jax.vmap(lambda p, w=w: da.apply_word(w, x, p))(params) for w in words]
    # mode 'M' runs every word in order
    p = da.sample_params(key, x.shape)
    expected = x
    for word in words:
      expected = da.apply_word(word, expected, p)
    return params['choice'], jnp.stack(per_word), expected, p

  choice, per_word, expected_m, p = by_hand(keys, jax.random.key(0))
  chosen = np.minimum(np.floor(np.asarray(choice[:, 0]) * 6), 5).astype(int)
  got = jax.jit(jax.vmap(lambda k: da.DiffAugment()(k, x)))(keys)
  expected = np.asarray(per_word)[chosen, np.arange(len(keys))]
  np.testing.assert_allclose(got, expected, atol=1e-6)
  counts = np.bincount(chosen, minlength=6)
  assert counts.min() >= 20, counts  # 40 expected per word
  got = jax.jit(
    lambda x, p: da.apply_params(x, p, da.DEFAULT_STRATEGY, da.DSAConstants(), single=False)
  )(x, p)
  np.testing.assert_allclose(got, expected_m, atol=1e-6)


def test_siamese_and_batchwise_parameters():
  a, b = _images(seed=1), _images(seed=2)
  p = jax.jit(da.sample_params, static_argnums=1)(jax.random.key(3), a.shape)
  strategy = 'crop_cutout_flip_scale_rotate'  # linear in the images for fixed parameters
  # jitted: run op by op, the words compiled ~100 one-primitive programs (cold time)
  word = jax.jit(da.apply_word, static_argnums=0)
  for w in da.strategy_words(strategy):
    fa, fb = word(w, a, p), word(w, b, p)
    np.testing.assert_allclose(word(w, a + 2 * b, p), fa + 2 * fb, atol=1e-5)
  aug = jax.jit(da.DiffAugment(strategy).__call__)
  np.testing.assert_array_equal(aug(jax.random.key(5), a), aug(jax.random.key(5), a))
  same = np.repeat(a[:1], 6, axis=0)
  batchwise = jax.jit(da.DiffAugment(da.DEFAULT_STRATEGY, batchwise=True).__call__)
  out = np.asarray(batchwise(jax.random.key(7), same))
  np.testing.assert_array_equal(out, np.repeat(out[:1], 6, axis=0))


def test_normalised_space_fill_and_brightness():
  """Augmenting pixel images in the reference's normalised space: shifted-in pixels are the
  mean pixel (0 in that space) and brightness moves a pixel by std · (r − 0.5)."""
  mean, std = 0.1307, 0.3081
  x = _images(b=16)
  key = jax.random.key(0)
  p = jax.jit(da.sample_params, static_argnums=1)(key, x.shape)
  got = np.asarray(jax.jit(da.DiffAugment('crop', mean, std).__call__)(key, x))
  dy, dx = np.asarray(p['crop_y']), np.asarray(p['crop_x'])
  shifted = jax.jit(da.translate, static_argnums=3)(x - mean, dy, dx, 1)
  np.testing.assert_allclose(got, np.asarray(shifted) + mean, atol=1e-6)
  down = np.flatnonzero(dy == 1)
  assert len(down), dy
  np.testing.assert_allclose(got[down, -1], mean, atol=1e-6)  # the row shifted in
  flat = np.full((16, 8, 8, 1), 0.7, np.float32)  # saturation and contrast leave it alone
  r = np.asarray(p['brightness'])[:, None, None, None]
  got = jax.jit(da.DiffAugment('color', mean, std).__call__)(key, flat)
  np.testing.assert_allclose(got, flat + std * (r - 0.5), atol=1e-6)
  assert da.DiffAugment('none')(key, x) is x


def test_gradients_flow_through_every_word():
  x = jnp.asarray(_images(b=3, c=3))
  w = jnp.asarray(np.random.default_rng(1).normal(size=x.shape).astype(np.float32))
  d = jnp.asarray(np.random.default_rng(2).normal(size=x.shape).astype(np.float32))
  key = jax.random.key(11)

  @jax.jit  # run op by op, the gradients and JVPs compiled ~80 one-primitive programs
  def by_word(x, w, d):
    out = {}
    for word in da.WORDS:
      f = lambda y, aug=da.DiffAugment(word): aug(key, y)
      _, tangent = jax.jvp(f, (x,), (d,))
      out[word] = jax.grad(lambda y: jnp.sum(f(y) * w))(x), tangent, f(x + d) - f(x)
    return out

  for word, (g, tangent, difference) in by_word(x, w, d).items():
    assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), word
    # affine in the images for fixed parameters: the JVP is the exact finite difference
    np.testing.assert_allclose(tangent, difference, atol=1e-4, err_msg=word)
  # flip's gradient is the flipped cotangent where it flipped
  which = np.array([True, False, True])
  g = jax.jit(jax.grad(lambda y: jnp.sum(da.flip(y, which) * w)))(x)
  np.testing.assert_allclose(np.asarray(g)[which], np.asarray(w)[which][:, :, ::-1])
  np.testing.assert_allclose(np.asarray(g)[~which], np.asarray(w)[~which])


def test_unknown_word_is_refused():
  message = (
    r"^unknown DSA transform\(s\) 'blur', 'warp' in 'color_blur_warp'; valid words \(joined by "
    r'_\): color, crop, cutout, flip, scale, rotate; or none$'
  )
  with pytest.raises(ValueError, match=message):
    da.strategy_words('color_blur_warp')
  assert da.strategy_words('') == da.strategy_words('none') == da.strategy_words('None') == ()
  with pytest.raises(ValueError, match=r"^unknown DSA transform 'blur'$"):
    da.apply_word('blur', jnp.zeros((1, 4, 4, 1)), {}, da.DSAConstants())


def _np_color(x, p, c):
  """The reference's color word with constants c, in NumPy."""
  per = lambda v: np.asarray(v, np.float64)[:, None, None, None]
  x = np.asarray(x, np.float64) + (per(p['brightness']) - 0.5) * c.brightness
  m = x.mean(axis=3, keepdims=True)
  x = (x - m) * per(p['saturation']) * c.saturation + m
  m = x.mean(axis=(1, 2, 3), keepdims=True)
  return (x - m) * (per(p['contrast']) + c.contrast) + m


def test_constants_reach_every_mode_and_the_single_mode_picks_by_choice():
  """Non-default DSA constants reach the colour transforms alone, in the all-words mode and in
  the single-word mode, whose word is words[floor(choice · len(words))]."""
  c = da.DSAConstants(brightness=0.3, saturation=1.5, contrast=0.2)
  x = _images(b=3, c=3)
  colored = {}
  for seed in range(8):
    key = jax.random.key(seed)
    p = da.sample_params(key, x.shape, c)
    color = _np_color(x, p, c)
    got = da.DiffAugment('color', constants=c)(key, x)
    np.testing.assert_allclose(got, color, rtol=1e-5, atol=1e-5)
    flipped = np.where(np.asarray(p['flip'])[:, None, None, None], color[:, :, ::-1], color)
    got = da.DiffAugment('color_flip', constants=c, single=False)(key, x)
    np.testing.assert_allclose(got, flipped, rtol=1e-5, atol=1e-5)
    word = ('color', 'flip')[int(float(p['choice'][0]) * 2)]
    want = (
      color
      if word == 'color'
      else np.where(np.asarray(p['flip'])[:, None, None, None], x[:, :, ::-1], x)
    )
    got = jax.jit(da.DiffAugment('color_flip', constants=c, single=True).__call__)(key, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=word)
    colored[word] = True
  assert colored == {'color': True, 'flip': True}  # both branches were checked


def test_crop_and_cutout_sizes_follow_height_and_width_apart():
  """Crop shift int(0.125 · size + 0.5) and cutout side int(0.5 · size + 0.5), per axis; cutout
  centres ~ U{0 .. size − (cut mod 2)} per axis (the reference's randint(0, size + 1 − cut % 2)),
  for even and odd cutout sides; scale factors in [1/1.2, 1.2] on both axes."""
  for shape, crop_y, crop_x, cuts in [
    ((1024, 8, 24, 1), 1, 3, (4, 12)),  # even cutout sides
    ((1024, 10, 22, 1), 1, 3, (5, 11)),  # odd ones (11 mod 3 differs from 11 mod 2)
  ]:
    p = jax.tree.map(np.asarray, da.sample_params(jax.random.key(0), shape))
    assert set(np.unique(p['crop_y'])) == set(range(-crop_y, crop_y + 1))
    assert set(np.unique(p['crop_x'])) == set(range(-crop_x, crop_x + 1))
    for axis, size, cut in (('cutout_y', shape[1], cuts[0]), ('cutout_x', shape[2], cuts[1])):
      assert set(np.unique(p[axis])) == set(range(size + 1 - cut % 2)), (shape, axis)
    for axis in ('scale_x', 'scale_y'):
      assert 1 / 1.2 <= p[axis].min() < 0.85 and 1.15 < p[axis].max() <= 1.2, (shape, axis)
  ones = np.ones((1, 8, 24, 1), np.float32)
  cut = np.asarray(
    da.apply_word('cutout', ones, {'cutout_y': jnp.array([4]), 'cutout_x': jnp.array([12])},
                  da.DSAConstants())
  )  # fmt: skip
  rows, cols = np.nonzero(cut[0, :, :, 0] == 0)
  assert (rows.min(), rows.max(), cols.min(), cols.max()) == (2, 5, 6, 17)  # 4 x 12 around (4, 12)


def test_scale_and_rotation_are_the_references_affine_maps_of_the_draw():
  """scale = u · (1.2 − 1/1.2) + 1/1.2 and rotation = (u − 0.5) · 2 · 15° in radians, u the rows
  of the one uniform draw (`sample_params`'s documented rows)."""
  key, shape = jax.random.key(3), (64, 8, 8, 1)
  u = np.asarray(jax.random.uniform(key, (len(da._ROWS), shape[0])), np.float64)
  row = {name: u[i] for i, name in enumerate(da._ROWS)}
  p = da.sample_params(key, shape)
  for axis in ('scale_x', 'scale_y'):
    want = row[axis] * (1.2 - 1 / 1.2) + 1 / 1.2
    np.testing.assert_allclose(np.asarray(p[axis]), want, rtol=1e-6)
  want = (row['rotate'] - 0.5) * 2.0 * 15.0 / 180.0 * np.pi
  np.testing.assert_allclose(np.asarray(p['rotate']), want, rtol=1e-6, atol=1e-7)
