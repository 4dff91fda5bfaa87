"""KIP: closed-form FC kernels, KRR loss, single / batched / looped distillation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import load_digits

from jfed.engine import compiles
from jfed.kip import (
  KIPConfig,
  centered_one_hot,
  client_mesh,
  fc_kernels,
  fc_nngp_kernel,
  fc_ntk_kernel,
  init_support,
  kernel_fn_from_config,
  kip_distill,
  kip_distill_batched,
  kip_distill_loop,
  krr_loss,
  krr_predict,
  make_kernel_fn,
  rbf_kernel,
  sample_target_indices,
  split_scalars,
)

# ---------------------------------------------------------------------------------------------
# independent NumPy reference (float64, explicit per-pair angles)
# ---------------------------------------------------------------------------------------------


def np_fc_kernels(x1, x2, depth, W_std=2**0.5, b_std=0.1):
  x1 = np.asarray(x1, np.float64).reshape(len(x1), -1)
  x2 = np.asarray(x2, np.float64).reshape(len(x2), -1)
  d = x1.shape[1]
  n1, n2 = len(x1), len(x2)
  nngp = np.zeros((n1, n2))
  ntk = np.zeros((n1, n2))
  for i in range(n1):
    for j in range(n2):
      q11 = x1[i] @ x1[i] / d
      q22 = x2[j] @ x2[j] / d
      q12 = x1[i] @ x2[j] / d
      t12 = 0.0
      for _ in range(depth):
        q11 = W_std**2 * q11 + b_std**2
        q22 = W_std**2 * q22 + b_std**2
        q12 = W_std**2 * q12 + b_std**2
        t12 = q12 + W_std**2 * t12
        theta = math.acos(max(-1.0, min(1.0, q12 / math.sqrt(q11 * q22))))
        new12 = (
          math.sqrt(q11 * q22)
          / (2 * math.pi)
          * (math.sin(theta) + (math.pi - theta) * math.cos(theta))
        )
        t12 = t12 * (math.pi - theta) / (2 * math.pi)
        q12, q11, q22 = new12, q11 / 2, q22 / 2
      q12 = W_std**2 * q12 + b_std**2
      nngp[i, j] = q12
      ntk[i, j] = q12 + W_std**2 * t12
  return nngp, ntk


@pytest.mark.parametrize('depth', [1, 2])
def test_fc_kernels_equal_numpy_closed_form(depth):
  rng = np.random.default_rng(depth)
  x1 = rng.normal(size=(5, 3, 3, 2))
  x2 = rng.normal(size=(4, 3, 3, 2))
  x2[0] = x1[1]  # exact duplicate -> c = 1 off the diagonal
  ref_nngp, ref_ntk = np_fc_kernels(x1, x2, depth)
  with jax.enable_x64(True):
    nngp, ntk = fc_kernels(jnp.asarray(x1), jnp.asarray(x2), depth=depth)
    np.testing.assert_allclose(np.asarray(ntk), ref_ntk, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nngp), ref_nngp, rtol=1e-6)
    sym = fc_ntk_kernel(jnp.asarray(x1), None, depth=depth)
    np.testing.assert_allclose(np.asarray(sym), np_fc_kernels(x1, x1, depth)[1], rtol=1e-6)
  # float32 path
  ntk32 = fc_ntk_kernel(jnp.asarray(x1, jnp.float32), jnp.asarray(x2, jnp.float32), depth=depth)
  np.testing.assert_allclose(np.asarray(ntk32), ref_ntk, rtol=2e-3)
  nngp32 = fc_nngp_kernel(jnp.asarray(x1, jnp.float32), jnp.asarray(x2, jnp.float32), depth=depth)
  np.testing.assert_allclose(np.asarray(nngp32), ref_nngp, rtol=2e-3)


def test_fc_kernel_defaults_and_other_widths_reach_the_closed_form():
  # depth 1, W_std √2 and b_std 0.1 by default; other weight and bias scales passed through
  rng = np.random.default_rng(7)
  x1, x2 = rng.normal(size=(4, 6)), rng.normal(size=(3, 6))
  with jax.enable_x64(True):
    a, b = jnp.asarray(x1), jnp.asarray(x2)
    np.testing.assert_allclose(fc_nngp_kernel(a, b), np_fc_kernels(x1, x2, 1)[0], rtol=1e-6)
    np.testing.assert_allclose(fc_ntk_kernel(a, b), np_fc_kernels(x1, x2, 1)[1], rtol=1e-6)
    ref_nngp, ref_ntk = np_fc_kernels(x1, x2, 2, W_std=1.3, b_std=0.4)
    np.testing.assert_allclose(
      fc_nngp_kernel(a, b, depth=2, W_std=1.3, b_std=0.4), ref_nngp, rtol=1e-6
    )
    np.testing.assert_allclose(
      fc_ntk_kernel(a, b, depth=2, W_std=1.3, b_std=0.4), ref_ntk, rtol=1e-6
    )


def test_fc_kernels_without_bias_keep_a_zero_input_at_zero():
  # b_std = 0: a zero input has Σ = Θ = 0 with every input at every layer (W² · 0 + 0, and the
  # ReLU's sqrt(Σ(x, x) Σ(x', x')) · J1 = 0); the others are the closed form (default depth 1).
  # sqrt's floor (the dtype's smallest normal) leaves ~sqrt(tiny): 1e-154 in float64, 1e-19 in
  # float32; without a floor, c = 0 / 0 is NaN. Float32 inputs stay float32 in an x64 scope.
  rng = np.random.default_rng(11)
  x = rng.normal(size=(4, 6))
  x[0] = 0.0
  ref = [np.zeros((4, 4)), np.zeros((4, 4))]
  ref[0][1:, 1:], ref[1][1:, 1:] = np_fc_kernels(x[1:], x[1:], 1, b_std=0.0)
  with jax.enable_x64(True):
    got = fc_kernels(jnp.asarray(x), jnp.asarray(x), b_std=0.0)
    for k, r in zip(got, ref):
      np.testing.assert_allclose(np.asarray(k), r, rtol=1e-6, atol=1e-100)
    got32_x64 = fc_kernels(jnp.asarray(x, jnp.float32), None, b_std=0.0)
  for got32 in (fc_kernels(jnp.asarray(x, jnp.float32), None, b_std=0.0), got32_x64):
    for k, r in zip(got32, ref):
      assert k.dtype == jnp.float32
      np.testing.assert_allclose(np.asarray(k), r, rtol=2e-3, atol=1e-18)


def test_make_kernel_fn_builds_the_named_kernel_with_its_settings():
  rng = np.random.default_rng(12)
  a, b = rng.normal(size=(4, 5)), rng.normal(size=(3, 5))
  with jax.enable_x64(True):
    k1, k2 = jnp.asarray(a), jnp.asarray(b)
    # the default name is the notebook's 'fc_ntk'
    np.testing.assert_allclose(make_kernel_fn()(k1, k2), np_fc_kernels(a, b, 1)[1], rtol=1e-6)
    nngp = make_kernel_fn('fc_nngp', depth=2, W_std=1.3, b_std=0.4)(k1, k2)
    np.testing.assert_allclose(nngp, np_fc_kernels(a, b, 2, W_std=1.3, b_std=0.4)[0], rtol=1e-6)
  with pytest.raises(ValueError, match=r"unknown KIP kernel 'cnn'; expected one of .*fc_ntk"):
    make_kernel_fn('cnn')


def _mlp_init(key, d, width, depth):
  dims = [d] + [width] * depth + [1]
  params = []
  for i in range(depth + 1):
    key, kw, kb = jax.random.split(key, 3)
    params.append(
      (jax.random.normal(kw, (dims[i], dims[i + 1])), jax.random.normal(kb, (dims[i + 1],)))
    )
  return params


def _mlp(params, x, W_std=2**0.5, b_std=0.1, return_hidden=False):
  h = x.reshape(x.shape[0], -1)
  for i, (W, b) in enumerate(params):
    if i == len(params) - 1 and return_hidden:
      return h
    h = W_std / math.sqrt(W.shape[0]) * (h @ W) + b_std * b  # NTK parameterisation
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return h[:, 0]


@pytest.mark.parametrize('depth', [1, 2])
def test_fc_ntk_matches_empirical_wide_network(depth):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(6, 4, 4, 1)), jnp.float32)
  params = _mlp_init(jax.random.PRNGKey(depth), 16, 4096, depth)
  # Empirical NTK <df(x_i)/dθ, df(x_j)/dθ>, row i as the JVP of f(x) along sample i's gradient,
  # so one gradient is held at a time: the full Jacobian at width 4096 (and its copies) took
  # 1.2 GB, the six per-sample gradients held at once 445 MB, one of them 67 MB.
  f = lambda p: _mlp(p, x)
  row = jax.jit(lambda p, i: jax.jvp(f, (p,), (jax.grad(lambda q: f(q)[i])(p),))[1])
  emp = np.stack([np.asarray(row(params, i)) for i in range(len(x))])
  ntk = np.asarray(fc_ntk_kernel(x, x, depth=depth))
  rel = np.linalg.norm(emp - ntk) / np.linalg.norm(ntk)  # ~2-7% over seeds at width 4096
  assert rel < 0.1, rel
  # NNGP: readout covariance given the last hidden layer, W_std² φ·φ'/width + b_std²
  phi = _mlp(params, x, return_hidden=True)
  emp_nngp = np.asarray(2.0 * phi @ phi.T / phi.shape[1] + 0.01)
  nngp = np.asarray(fc_nngp_kernel(x, x, depth=depth))
  assert np.linalg.norm(emp_nngp - nngp) / np.linalg.norm(nngp) < 0.1


def test_rbf_kernel_formula():
  rng = np.random.default_rng(1)
  a, b = rng.normal(size=(4, 2, 3)), rng.normal(size=(3, 2, 3))
  ref = np.exp(-0.3 * ((a.reshape(4, 1, -1) - b.reshape(1, 3, -1)) ** 2).sum(-1))
  np.testing.assert_allclose(
    np.asarray(rbf_kernel(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 0.3)),
    ref,
    rtol=1e-5,
  )


def test_rbf_kernel_of_one_set_and_its_default_width():
  # x2 = None means x1; gamma = None means 1 / d with d the flattened features (here 6)
  rng = np.random.default_rng(4)
  a = rng.normal(size=(5, 2, 3))
  flat = a.reshape(5, -1)
  ref = np.exp(-((flat[:, None] - flat[None]) ** 2).sum(-1) / 6.0)
  np.testing.assert_allclose(np.asarray(rbf_kernel(jnp.asarray(a, jnp.float32))), ref, rtol=1e-5)


def test_kernel_gradients_finite_with_duplicates():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(6, 10)).astype(np.float32)
  x[3] = x[0]
  for name in ('fc_ntk', 'fc_nngp', 'rbf'):
    k = make_kernel_fn(name, depth=2)
    g = jax.grad(lambda z: jnp.sum(k(z, z) ** 2))(jnp.asarray(x))
    assert np.isfinite(np.asarray(g)).all(), name


# ---------------------------------------------------------------------------------------------
# KRR loss
# ---------------------------------------------------------------------------------------------


def test_krr_loss_equals_numpy_formula():
  rng = np.random.default_rng(3)
  C, reg = 4, 1e-3
  xs, xt = rng.normal(size=(7, 5)), rng.normal(size=(9, 5))
  ys = centered_one_hot(jnp.asarray(rng.integers(0, C, 7)), C)
  yt = centered_one_hot(jnp.asarray(rng.integers(0, C, 9)), C)
  np.testing.assert_allclose(np.asarray(ys).sum(-1), 0.0, atol=1e-6)
  with jax.enable_x64(True):
    for name in ('fc_ntk', 'rbf'):
      kfn = make_kernel_fn(name)
      loss, acc = krr_loss(
        jnp.asarray(xs),
        jnp.asarray(ys, jnp.float64),
        jnp.asarray(xt),
        jnp.asarray(yt, jnp.float64),
        kfn,
        reg=reg,
      )
      if name == 'fc_ntk':
        kss, kts = np_fc_kernels(xs, xs, 1)[1], np_fc_kernels(xt, xs, 1)[1]
      else:
        sq = lambda a, b: ((a[:, None] - b[None]) ** 2).sum(-1)
        kss, kts = np.exp(-sq(xs, xs) / 5), np.exp(-sq(xt, xs) / 5)
      kreg = kss + reg * np.trace(kss) / 7 * np.eye(7)
      pred = kts @ np.linalg.solve(kreg, np.asarray(ys, np.float64))
      ref = 0.5 * np.mean((pred - np.asarray(yt)) ** 2)
      np.testing.assert_allclose(float(loss), ref, rtol=1e-8)
      assert float(acc) == pytest.approx(np.mean(pred.argmax(-1) == np.asarray(yt).argmax(-1)))


def test_krr_predict_is_the_closed_form_for_any_kernel_at_the_default_ridge():
  # A kernel of the caller's own (a plain two-argument function) and the default ridge 1e-6;
  # float32 inputs inside an x64 scope (the KIP notebook's global setting) stay float32.
  rng = np.random.default_rng(10)
  xs, xt = rng.normal(size=(6, 8)), rng.normal(size=(5, 8))
  ys = np.eye(3)[rng.integers(0, 3, 6)] - 1.0 / 3
  poly = lambda a, b: (a @ b.T / 8 + 1.0) ** 2
  kss = poly(xs, xs)
  ref = poly(xt, xs) @ np.linalg.solve(kss + 1e-6 * np.trace(kss) / 6 * np.eye(6), ys)
  with jax.enable_x64(True):
    got = krr_predict(jnp.asarray(xs), jnp.asarray(ys), jnp.asarray(xt), poly)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-8)
    got32 = krr_predict(*(jnp.asarray(v, jnp.float32) for v in (xs, ys, xt)), poly)
  assert got32.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got32), ref, rtol=1e-3, atol=1e-4)


def test_centered_one_hot_comes_in_the_dtype_asked():
  labels = np.array([2, 0, 3, 3])
  ref = np.eye(4)[labels] - 0.25  # 0.75 and -0.25: exact in half precision
  for dtype in (jnp.bfloat16, jnp.float16):
    got = centered_one_hot(jnp.asarray(labels), 4, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)


def test_label_gradient_only_when_learned():
  rng = np.random.default_rng(4)
  xs, xt = (
    jnp.asarray(rng.normal(size=(5, 6)), jnp.float32),
    jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
  )
  ys, yt = centered_one_hot(jnp.arange(5) % 3, 3), centered_one_hot(jnp.arange(8) % 3, 3)
  kfn = make_kernel_fn('fc_ntk')
  g_fixed = jax.jit(jax.grad(lambda y: krr_loss(xs, y, xt, yt, kfn)[0]))(ys)
  g_learn = jax.jit(jax.grad(lambda y: krr_loss(xs, y, xt, yt, kfn, learn_labels=True)[0]))(ys)
  assert np.all(np.asarray(g_fixed) == 0)
  assert np.abs(np.asarray(g_learn)).max() > 0


# ---------------------------------------------------------------------------------------------
# sampling only real samples
# ---------------------------------------------------------------------------------------------


def test_init_support_class_balanced_from_real_samples():
  y = np.array([0] * 20 + [1] * 3 + [2] * 10 + [5] * 30, np.int32)
  size, n_max = len(y), 80
  y_pad = np.concatenate([y, np.full(n_max - size, 7, np.int32)])  # pads carry a fake class
  idx = np.asarray(init_support(jax.random.PRNGKey(0), jnp.asarray(y_pad), size, 12, 10))
  assert idx.max() < size and len(set(idx.tolist())) == 12
  counts = np.bincount(y[idx], minlength=10)
  assert counts[1] == 3 and counts[0] == counts[2] == counts[5] == 3
  # support larger than the client: every real sample once, then cycles
  idx = np.asarray(init_support(jax.random.PRNGKey(1), jnp.asarray(y_pad), size, 70, 10))
  assert idx.max() < size and set(idx[:size].tolist()) == set(range(size))


def _np_round_robin(key, y, size, support_size, num_classes):
  """init_support's documented selection, from the same two draws of `key`: a random rank inside
  each class (u), then the ranks in rounds, the classes of a round in a random order (perm),
  cycled past the real samples."""
  k_rank, k_round = jax.random.split(key)
  u = np.asarray(jax.random.uniform(k_rank, (len(y),)))
  perm = np.asarray(jax.random.uniform(k_round, (num_classes + 1,)))
  rank = np.zeros(size, np.float32)
  for c in np.unique(y[:size]):
    members = np.flatnonzero(y[:size] == c)
    rank[members[np.argsort(u[members], kind='stable')]] = np.arange(len(members))
  order = np.argsort(rank + perm[y[:size]], kind='stable')  # float32, like the program's score
  return order[np.arange(support_size) % size]


def test_init_support_is_the_documented_round_robin_of_the_keys_draws():
  # every class present, the last one (C - 1) too; pads past the 13 real samples
  y = np.array([3, 1, 3, 0, 2, 3, 2, 3, 1, 3, 2, 3, 3, 0, 0, 0], np.int32)
  for seed in range(6):
    key = jax.random.PRNGKey(seed)
    for support_size in (6, 20):
      got = np.asarray(init_support(key, jnp.asarray(y), 13, support_size, 4))
      np.testing.assert_array_equal(got, _np_round_robin(key, y, 13, support_size, 4))


def test_target_indices_real_only():
  for size, batch in [(30, 10), (4, 10), (1, 3), (6, 50)]:
    idx = np.asarray(sample_target_indices(jax.random.PRNGKey(size), size, 40, batch))
    assert idx.shape == (batch,) and idx.max() < size
    if batch <= size:
      assert len(set(idx.tolist())) == batch


# ---------------------------------------------------------------------------------------------
# distillation
# ---------------------------------------------------------------------------------------------


def _digits_client_indices(sizes, seed=0, single_class=()):
  """The sklearn digits each client holds: `sizes[i]` drawn without replacement (only 3s for a
  client in `single_class`); clients draw independently, so they may share digits."""
  Y = load_digits().target
  rng = np.random.default_rng(seed)
  pools = [
    np.flatnonzero(Y == 3) if i in single_class else np.arange(len(Y)) for i in range(len(sizes))
  ]
  return [rng.choice(pool, s, replace=False) for pool, s in zip(pools, sizes)]


def _digits_clients(sizes, n_max, seed=0, single_class=()):
  d = load_digits()
  X = (d.images / 16.0).astype(np.float32)[..., None]
  Y = d.target.astype(np.int32)
  fx = np.zeros((len(sizes), n_max, 8, 8, 1), np.float32)
  fy = np.zeros((len(sizes), n_max), np.int32)
  for i, idx in enumerate(_digits_client_indices(sizes, seed, single_class)):
    fx[i, : len(idx)], fy[i, : len(idx)] = X[idx], Y[idx]
  return fx, fy, np.asarray(sizes, np.int32)


def test_batched_equals_loop_unequal_clients():
  # 5 clients (padded to 8 on the 4 fake devices of conftest): unequal sizes, one single-class
  # client, two clients smaller than the support set (incl. a 1-sample client).
  fx, fy, sizes = _digits_clients([40, 17, 9, 5, 1], 40, single_class=(2,))
  cfg = KIPConfig(
    support_size=8, iterations=6, lr=0.01, target_batch=6, x64=True, learn_labels=True
  )
  key = jax.random.PRNGKey(7)
  batched = kip_distill_batched(fx, fy, sizes, cfg, key, 10)
  loop = kip_distill_loop(fx, fy, sizes, cfg, key, 10)
  assert batched.x.shape == (5, 8, 8, 8, 1) and batched.y.shape == (5, 8)
  assert batched.y_matrix.shape == (5, 8, 10) and batched.loss.shape == (5, 6)
  for i in range(5):
    np.testing.assert_allclose(np.asarray(batched.x[i]), np.asarray(loop[i].x), atol=1e-5)
    np.testing.assert_allclose(
      np.asarray(batched.loss[i]), np.asarray(loop[i].loss), rtol=1e-5, atol=1e-12
    )
    np.testing.assert_array_equal(np.asarray(batched.y[i]), np.asarray(loop[i].y))
    np.testing.assert_allclose(
      np.asarray(batched.y_matrix[i]), np.asarray(loop[i].y_matrix), atol=1e-5
    )
    assert np.isfinite(np.asarray(loop[i].x)).all()
  assert batched.x.dtype == jnp.float32
  # learned labels moved away from their centred one-hot init; hard labels (argmax) still come
  # from the client's own real samples after these few steps
  init_y = np.asarray(centered_one_hot(jnp.asarray(batched.y), 10))
  assert np.abs(np.asarray(batched.y_matrix) - init_y).max() > 0
  for i, s in enumerate(sizes):
    assert set(np.asarray(batched.y[i]).tolist()) <= set(fy[i, :s].tolist())
  assert set(np.asarray(batched.y[2]).tolist()) == {3}


@pytest.mark.slow  # 150 KIP iterations: the support must learn
def test_kip_loss_decreases_and_generalises():
  fx, fy, sizes = _digits_clients([300], 300, seed=2)
  cfg = KIPConfig(support_size=10, iterations=150, lr=0.02, target_batch=100)
  res = kip_distill(fx[0], fy[0], 300, cfg, jax.random.PRNGKey(0), 10)
  loss = np.asarray(res.loss)
  assert np.isfinite(loss).all()
  assert loss[-20:].mean() < 0.8 * loss[:20].mean(), (loss[:20].mean(), loss[-20:].mean())
  # the distilled support beats its own initialisation as a KRR predictor on held-out digits:
  # the 1,497 digits the client did not hold
  d = load_digits()
  (train_idx,) = _digits_client_indices([300], seed=2)
  np.testing.assert_array_equal(fy[0], d.target[train_idx])
  held_out = np.setdiff1d(np.arange(len(d.target)), train_idx)
  X = (d.images / 16.0).astype(np.float32)[held_out][..., None]
  mean, std = fx[0].mean(), fx[0].std() + 1e-6
  k_init = jax.random.split(jax.random.PRNGKey(0), 3)[0]  # kip_distill's init key
  idx = np.asarray(init_support(k_init, jnp.asarray(fy[0]), 300, 10, 10))
  kfn = make_kernel_fn('fc_ntk')
  yt = centered_one_hot(jnp.asarray(d.target[held_out]), 10)
  xt = jnp.asarray((X - mean) / std)
  l_init, acc_init = krr_loss(
    jnp.asarray((fx[0][idx] - mean) / std), centered_one_hot(fy[0][idx], 10), xt, yt, kfn
  )
  l_kip, acc_kip = krr_loss(
    jnp.asarray((np.asarray(res.x) - mean) / std), res.y_matrix, xt, yt, kfn
  )
  np.testing.assert_array_equal(np.asarray(res.y), fy[0][idx])
  # measured (CPU): loss 0.0275 → 0.0147, accuracy 0.68 → 0.91 with one support image per class
  assert float(l_kip) < 0.75 * float(l_init), (float(l_init), float(l_kip))
  assert float(acc_kip) > float(acc_init) + 0.1, (float(acc_init), float(acc_kip))


def test_batched_indices_distil_a_subset_exactly_as_within_the_whole_batch():
  # A Flower SuperNode distils its share of the clients: client i draws fold_in(key, i) by its
  # index in the whole batch, not by its position in the share.
  fx, fy, sizes = _digits_clients([20, 12, 16], 20)
  cfg = KIPConfig(support_size=6, iterations=3, lr=0.01, target_batch=5)
  key = jax.random.PRNGKey(3)
  whole = kip_distill_batched(fx, fy, sizes, cfg, key, 10, mesh=None)
  share = kip_distill_batched(
    fx[[2, 0]], fy[[2, 0]], sizes[[2, 0]], cfg, key, 10, mesh=None, indices=[2, 0]
  )
  np.testing.assert_allclose(np.asarray(share.x), np.asarray(whole.x)[[2, 0]], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(share.y), np.asarray(whole.y)[[2, 0]])
  unindexed = kip_distill_batched(fx[[2, 0]], fy[[2, 0]], sizes[[2, 0]], cfg, key, 10, mesh=None)
  assert not np.allclose(np.asarray(unindexed.x), np.asarray(share.x))


def test_client_mesh_spans_the_devices_given():
  devices = jax.devices()
  assert len(devices) > 1  # conftest's four host devices
  assert client_mesh(devices[:1]) is None
  two = client_mesh(devices[:2])
  assert two.devices.size == 2 and two.axis_names == ('clients',)
  assert client_mesh().devices.size == len(devices)


def test_one_client_takes_its_size_as_none_a_count_or_a_prefix_mask():
  fx, fy, sizes = _digits_clients([12, 9], 12)
  cfg = KIPConfig(support_size=4, iterations=2, lr=0.01, target_batch=4)
  key = jax.random.PRNGKey(5)
  whole = kip_distill(fx[0], fy[0], 12, cfg, key, 10)
  np.testing.assert_array_equal(kip_distill(fx[0], fy[0], None, cfg, key, 10).x, whole.x)
  counted = kip_distill(fx[1], fy[1], 9, cfg, key, 10)
  mask = np.arange(12) < 9
  np.testing.assert_array_equal(kip_distill(fx[1], fy[1], mask, cfg, key, 10).x, counted.x)
  assert not np.allclose(kip_distill(fx[1], fy[1], 12, cfg, key, 10).x, counted.x)
  with pytest.raises(ValueError, match='prefix'):
    kip_distill(fx[1], fy[1], ~mask, cfg, key, 10)


def test_kernel_from_config_takes_the_configs_kernel_settings():
  rng = np.random.default_rng(8)
  a, b = rng.normal(size=(4, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
  rbf = kernel_fn_from_config(KIPConfig(kernel='rbf', rbf_gamma=0.7))(a, b)
  np.testing.assert_allclose(rbf, np.exp(-0.7 * ((a[:, None] - b[None]) ** 2).sum(-1)), rtol=1e-5)
  cfg = KIPConfig(kernel='fc_ntk', depth=2, W_std=1.3, b_std=0.4)
  np.testing.assert_allclose(
    kernel_fn_from_config(cfg)(a, b), np_fc_kernels(a, b, 2, W_std=1.3, b_std=0.4)[1], rtol=1e-4
  )


def test_standardisation_statistics_are_per_channel_over_the_real_samples():
  from jfed.kip.kip import _channel_stats

  rng = np.random.default_rng(9)
  x = rng.normal(loc=[0.0, 3.0, -2.0], scale=[1.0, 2.0, 0.5], size=(6, 4, 4, 3))
  x[4:] = 0.0  # padding past the 4 real samples
  mean, std = _channel_stats(jnp.asarray(x, jnp.float32), jnp.asarray(4))
  real = x[:4].reshape(-1, 3)
  np.testing.assert_allclose(mean, real.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(std, real.std(0) + 1e-6, rtol=1e-5)


def test_support_copies_past_a_small_clients_samples_are_jittered():
  # A client with 3 samples and a support set of 6: rows 0-2 are its images, rows 3-5 copies of
  # them with jitter (lr 0: the support is the initial one).
  fx, fy, _ = _digits_clients([3], 6)
  cfg = KIPConfig(support_size=6, iterations=1, lr=0.0, target_batch=3, dup_jitter=0.05)
  res = kip_distill(fx[0], fy[0], 3, cfg, jax.random.PRNGKey(6), 10)
  real = fx[0, :3].reshape(3, -1)
  dist = np.abs(np.asarray(res.x).reshape(6, 1, -1) - real[None]).max(-1).min(-1)
  assert (dist[:3] < 1e-5).all() and (dist[3:] > 1e-3).all(), dist


def test_support_copies_carry_the_jitter_drawn_from_the_keys_second_part():
  # 3 samples, a support set of 6 (lr 0, raw pixels): the init cycles, so row 3 + i is row i
  # plus dup_jitter times the standard normal drawn from split(key, 3)[1] (init [0], steps [2]).
  fx, fy, _ = _digits_clients([3], 6)
  cfg = KIPConfig(
    support_size=6, iterations=1, lr=0.0, target_batch=3, dup_jitter=0.05, standardize=False
  )
  key = jax.random.PRNGKey(6)
  res = kip_distill(fx[0], fy[0], 3, cfg, key, 10)
  x = np.asarray(res.x).reshape(6, -1)
  real = fx[0, :3].reshape(3, -1)
  np.testing.assert_array_equal(x[:3][np.lexsort(x[:3].T)], real[np.lexsort(real.T)])  # the images
  noise = 0.05 * np.asarray(jax.random.normal(jax.random.split(key, 3)[1], (6, 8, 8, 1)))
  np.testing.assert_allclose(x[3:] - x[:3], noise[3:].reshape(3, -1), atol=1e-6)


@pytest.mark.parametrize('standardize', [False, True])
def test_the_first_loss_is_the_krr_loss_in_raw_or_standardised_pixels(standardize):
  # lr 0 keeps the initial support; a target batch of all 10 real samples makes the first loss
  # the KRR loss (NumPy, float64) over every real sample, whatever their order.
  fx, fy, _ = _digits_clients([10], 12)
  cfg = KIPConfig(
    support_size=4, iterations=1, lr=0.0, target_batch=10, standardize=standardize, x64=True
  )
  res = kip_distill(fx[0], fy[0], 10, cfg, jax.random.PRNGKey(8), 10)
  x = fx[0, :10].astype(np.float64)
  sup = np.asarray(res.x, np.float64)
  if standardize:
    mean, std = x.mean((0, 1, 2)), x.std((0, 1, 2)) + 1e-6
    x, sup = (x - mean) / std, (sup - mean) / std
  onehot = lambda y: np.eye(10)[y] - 0.1  # centred one-hot
  kss = np_fc_kernels(sup, sup, 1)[1]
  kts = np_fc_kernels(x, sup, 1)[1]
  kss = kss + 1e-6 * np.trace(kss) / 4 * np.eye(4)
  pred = kts @ np.linalg.solve(kss, onehot(np.asarray(res.y)))
  expected = 0.5 * np.mean((pred - onehot(fy[0, :10])) ** 2)
  np.testing.assert_allclose(float(res.loss[0]), expected, rtol=2e-3)
  # the step's KRR accuracy on the same batch; the fields float32 / int32 after a float64 run
  assert float(res.acc[0]) == pytest.approx(np.mean(pred.argmax(-1) == fy[0, :10]))
  dtypes = [np.float32, np.int32, np.float32, np.float32, np.float32]
  assert [np.asarray(field).dtype for field in res] == dtypes


@pytest.mark.parametrize('dtype', [np.uint8, np.int32])
def test_integer_pixels_give_the_kernels_of_their_float_values(dtype):
  """uint8 images overflowed x·x and int32 ones truncated W_std, b_std to integers: the kernels
  of integer pixels are those of the same values as floats."""
  x = np.random.default_rng(0).integers(0, 256, (4, 3, 3, 1)).astype(dtype)
  xf = x.astype(np.float32)
  for kernel in (fc_nngp_kernel, fc_ntk_kernel, rbf_kernel):
    np.testing.assert_allclose(
      np.asarray(kernel(x, x[:2])), np.asarray(kernel(xf, xf[:2])), rtol=1e-6, err_msg=str(kernel)
    )


def _np_first_loss(fx, fy, res, reg):
  """KIP's first-step KRR loss over every real sample in raw pixels (NumPy, float64)."""
  x, sup = fx.astype(np.float64), np.asarray(res.x, np.float64)
  onehot = lambda y: np.eye(10)[y] - 0.1
  kss, kts = np_fc_kernels(sup, sup, 1)[1], np_fc_kernels(x, sup, 1)[1]
  kss = kss + reg * np.trace(kss) / len(sup) * np.eye(len(sup))
  pred = kts @ np.linalg.solve(kss, onehot(np.asarray(res.y)))
  return 0.5 * np.mean((pred - onehot(fy)) ** 2)


def test_a_sweep_of_the_ridge_compiles_one_program_and_each_value_is_its_own_krr_loss():
  """The regulariser is a value of the one-client program, not part of its key: three ridges
  compile it once, and each run's first loss is the NumPy KRR loss at its own ridge."""
  fx, fy, _ = _digits_clients([10], 12)
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    runs = {}
    for reg in (1e-6, 1e-2, 1.0):
      cfg = KIPConfig(
        support_size=4, iterations=1, lr=0.0, target_batch=10, standardize=False, x64=True, reg=reg
      )
      runs[reg] = kip_distill(fx[0], fy[0], 10, cfg, jax.random.PRNGKey(8), 10)
  assert compiled.counts()['jit(_distill_one_jit)'] == 1, compiled.summary()
  for reg, res in runs.items():
    want = _np_first_loss(fx[0, :10], fy[0, :10], res, reg)
    np.testing.assert_allclose(float(res.loss[0]), want, rtol=2e-3, err_msg=str(reg))
  assert len({float(r.loss[0]) for r in runs.values()}) == 3


def test_a_sweep_of_lr_ridge_and_jitter_compiles_one_batched_program_equal_to_runs_made_alone():
  fx, fy, sizes = _digits_clients([20, 12, 3], 20)
  base = KIPConfig(support_size=6, iterations=4, target_batch=5)
  values = [
    base._replace(lr=0.004),
    base._replace(lr=0.04, reg=1e-3),
    base._replace(lr=0.01, dup_jitter=0.1),
  ]
  key = jax.random.PRNGKey(2)
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    swept = [kip_distill_batched(fx, fy, sizes, cfg, key, 10, mesh=None) for cfg in values]
  assert compiled.counts()['jit(_batched_body)'] == 1, compiled.summary()
  for cfg, got in zip(values, swept):
    jax.clear_caches()
    alone = kip_distill_batched(fx, fy, sizes, cfg, key, 10, mesh=None)
    for field in ('x', 'y_matrix', 'loss', 'acc'):
      np.testing.assert_array_equal(getattr(got, field), getattr(alone, field), err_msg=field)
  # each value reached the program: the three sweeps' supports differ
  assert not np.allclose(swept[0].x, swept[1].x) and not np.allclose(swept[0].x, swept[2].x)


@pytest.mark.parametrize('x64', [False, True])
def test_split_scalars_carries_the_settings_in_the_runs_float_and_keys_programs_without_them(x64):
  """`KIPScalars` holds lr, reg and dup_jitter as float32 arrays, or float64 under `x64`, with
  the config's values (0.1 is not a float32 number: a float64 run keeps it exact); the static
  part is the same for every value of the three, and keeps the other settings."""
  cfg = KIPConfig(support_size=5, lr=0.1, reg=1e-3, dup_jitter=0.3, x64=x64)
  static, scalars = split_scalars(cfg)
  want = np.float64 if x64 else np.float32
  for name, value in zip(scalars._fields, (0.1, 1e-3, 0.3)):
    got = getattr(scalars, name)
    assert isinstance(got, np.ndarray) and got.dtype == want and got.shape == (), name
    assert got == want(value), name
  other, _ = split_scalars(cfg._replace(lr=0.5, reg=1.0, dup_jitter=0.0))
  assert static == other and hash(static) == hash(other)
  assert static.support_size == 5 and static.x64 == x64
