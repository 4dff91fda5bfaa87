"""FedHydra model stratification (U, U_r, U_c; batched MS == per-(k, j) loop) and SA (Eqs. 8–11)."""

import os
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver
from jfed.configs.base import base_config
from jfed.data.datasets import Dataset
from jfed.distill import ensemble, generator
from jfed.distill import stratification as S
from jfed.engine.state import ModelState
from jfed.errors import ConfigError
from jfed.methods import fedhydra
from jfed.models.layers import BatchNorm
from tests.support import shared_fixture_scope

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- U, U_r, U_c


def test_U_hand_example():
  # losses[k, j, t]: m = 2 clients, c = 2 classes, T_G = 3
  losses = np.array(
    [[[2.0, 1.0, 0.5], [1.0, 1.0, 1.0]], [[4.0, 2.0, 1.0], [3.0, 2.0, 2.0]]], np.float32
  )
  # u_{k,j} = (max − min) / min:  u00 = 1.5/0.5 = 3, u01 = 0, u10 = 3/1 = 3, u11 = 1/2 = 0.5
  u = np.array([[3.0, 0.0], [3.0, 0.5]])
  np.testing.assert_allclose(S.variation_degree(losses), u, rtol=1e-6)
  r = S.stratification_from_losses(losses)
  U = np.array(
    [
      [3.0, 3.0],  # class 0: clients 0, 1
      [0.0, 0.5],
    ]
  )  # class 1
  np.testing.assert_allclose(r.U, U, rtol=1e-6)
  # Eq. 4/5: each row over clients sums to 1
  np.testing.assert_allclose(r.U_r, [[0.5, 0.5], [0.0, 1.0]], rtol=1e-6)
  # Eq. 6/7: each column over classes sums to 1: client 0 [3, 0]/3, client 1 [3, .5]/3.5
  np.testing.assert_allclose(r.U_c, [[1.0, 6 / 7], [0.0, 1 / 7]], rtol=1e-6)
  # a class nobody guides → uniform row
  U_r, U_c = S.normalise_U(np.array([[1.0, 3.0], [0.0, 0.0]]))
  np.testing.assert_allclose(U_r, [[0.25, 0.75], [0.5, 0.5]])
  np.testing.assert_allclose(U_c, [[1.0, 1.0], [0.0, 0.0]])


def naive_sa(P, U_r, U_c, y):
  """Algorithm 3 with Python loops: Eq. 8 P̂_k, Eq. 9 Pⁱ, Eq. 10 V, Eq. 11 P."""
  m, b, c = P.shape
  P_hat = np.zeros_like(P)
  for k in range(m):  # Eq. 8: P_k ⊙ (1_{b×1} × U_c(:,k)ᵀ)
    ones_b = np.ones((b, 1))
    P_hat[k] = P[k] * (ones_b @ U_c[:, k][None, :])
  V = np.stack([U_r[y[i], :] for i in range(b)])  # Eq. 10, b × m
  out = np.zeros((b, c))
  for i in range(b):
    P_i = np.stack([P_hat[k][i, :] for k in range(m)])  # Eq. 9, m × c
    for j in range(c):  # Eq. 11: V(i,:) × Pⁱ
      out[i, j] = sum(V[i, k] * P_i[k, j] for k in range(m))
  return out


def test_stratified_aggregation_matches_loops():
  rng = np.random.default_rng(0)
  m, b, c = 3, 7, 4
  P = rng.normal(size=(m, b, c)).astype(np.float32)
  U = rng.random((c, m)).astype(np.float32)
  U_r, U_c = (np.asarray(a) for a in S.normalise_U(U))
  y = rng.integers(0, c, b).astype(np.int32)
  want = naive_sa(P, U_r, U_c, y)
  got = S.stratified_aggregation(jnp.asarray(P), U_r, U_c, jnp.asarray(y))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # the same through ensemble.combine_logits with per-(sample, client, class) weights
  W = S.stratified_weights(U_r, U_c, jnp.asarray(y))
  np.testing.assert_allclose(
    ensemble.combine_logits(jnp.asarray(P), W, normalize=False), want, rtol=1e-5, atol=1e-6
  )
  # without Eq. 8 (inter-model only) and AE
  want_inter = naive_sa(P, U_r, np.ones_like(U_c), y)
  np.testing.assert_allclose(
    S.stratified_aggregation(P, U_r, U_c, y, in_model=False), want_inter, rtol=1e-5, atol=1e-6
  )
  W_inter = S.stratified_weights(U_r, U_c, jnp.asarray(y), in_model=False)
  assert W_inter.shape == (b, m, c)
  np.testing.assert_allclose(
    ensemble.combine_logits(jnp.asarray(P), W_inter, normalize=False),
    want_inter,
    rtol=1e-5,
    atol=1e-6,
  )
  np.testing.assert_allclose(S.average_ensemble(P), P.mean(0), rtol=1e-6)


# ----------------------------------------------------------------------------- MS


class ConvNet(nn.Module):
  nc: int = 3

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = nn.Conv(3, (3, 3))(x)
    x = nn.relu(BatchNorm()(x, train, mask))
    return nn.Dense(self.nc)(x.reshape(x.shape[0], -1))


class MLP(nn.Module):
  nc: int = 3

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    return nn.Dense(self.nc)(nn.tanh(nn.Dense(5)(x.reshape(x.shape[0], -1))))


def stacked(module, seed, n):
  sts = []
  for k in jax.random.split(jax.random.PRNGKey(seed), n):
    v = module.init(k, jnp.zeros((2, 8, 8, 1)))
    sts.append(ModelState(v['params'], v.get('batch_stats', {})))
  return jax.tree.map(lambda *a: jnp.stack(a), *sts)


GEN = generator.make_generator((8, 8, 1), nz=8, ngf=4)
CFG = S.MSConfig(T_G=4, batch_size=4, lr=1e-2)
KEY = jax.random.PRNGKey(7)


@pytest.fixture(scope=shared_fixture_scope)
def batched_conv():
  return S.model_stratification(
    ensemble.TeacherGroup(ConvNet(), stacked(ConvNet(), 0, 2)), GEN, 3, KEY, CFG
  )


def test_batched_ms_equals_loop(batched_conv):
  loop = S.model_stratification_loop((ConvNet(), stacked(ConvNet(), 0, 2)), GEN, 3, KEY, CFG)
  a = batched_conv
  assert a.losses.shape == (2, 3, 4) and a.U.shape == (3, 2)
  np.testing.assert_allclose(a.losses, loop.losses, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(a.U_r, loop.U_r, rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(a.U_c, loop.U_c, rtol=1e-3, atol=1e-5)
  # the generator actually trains: the CE of the guided class goes down
  assert np.all(np.asarray(a.losses)[..., -1] < np.asarray(a.losses)[..., 0])
  np.testing.assert_allclose(np.asarray(a.U_r).sum(1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(a.U_c).sum(0), 1.0, rtol=1e-5)


def test_heterogeneous_ms(batched_conv):
  groups = [(ConvNet(), stacked(ConvNet(), 0, 2)), (MLP(), stacked(MLP(), 1, 1))]
  r = S.model_stratification(groups, GEN, 3, KEY, CFG)
  assert r.losses.shape == (3, 3, 4) and r.U_r.shape == (3, 3)
  np.testing.assert_allclose(r.losses[:2], batched_conv.losses, rtol=1e-6)
  # client 2 (the MLP group) uses the run keys of global client index 2
  keys = S._run_keys(KEY, 2, 1, 3)
  st = stacked(MLP(), 1, 1)
  p, bs = jax.tree.map(lambda a: a[0], st.params), jax.tree.map(lambda a: a[0], st.batch_stats)
  for j in range(3):
    want = S._ms_single_run_jit(MLP(), GEN, CFG, p, bs, keys[j], jnp.int32(j))
    np.testing.assert_allclose(r.losses[2, j], want, rtol=2e-5, atol=1e-6)


def test_sharded_ms_matches_one_device(batched_conv):
  """m·c = 6 runs sharded over the suite's 4 forced host devices (tests/conftest.py), padded to
  8, equal the same runs on one device."""
  assert len(jax.devices()) == 4
  one = S.model_stratification(
    ensemble.TeacherGroup(ConvNet(), stacked(ConvNet(), 0, 2)),
    GEN,
    3,
    KEY,
    CFG,
    devices=jax.devices()[:1],
  )
  np.testing.assert_allclose(batched_conv.losses, one.losses, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(batched_conv.U_r, one.U_r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
  'conv_impl,chunk_size,devices', [('lax', None, 1), ('matmul', 3, 1), ('lax', 6, 4)]
)
def test_client_layout_equals_the_run_layout(batched_conv, conv_impl, chunk_size, devices):
  """layout='clients' (clients vmapped, then classes sharing the client's weights) runs the same
  m·c runs as the flat layout: whole or in chunks of clients, with the generator's convolutions
  as matmuls, and sharded over the 4 forced host devices (2 clients padded to 4)."""
  gen = generator.make_generator((8, 8, 1), nz=8, ngf=4, conv_impl=conv_impl)
  r = S.model_stratification(
    ensemble.TeacherGroup(ConvNet(), stacked(ConvNet(), 0, 2)),
    gen,
    3,
    KEY,
    CFG,
    chunk_size=chunk_size,
    devices=jax.devices()[:devices],
    layout='clients',
  )
  np.testing.assert_allclose(r.losses, batched_conv.losses, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(r.U_r, batched_conv.U_r, rtol=1e-3, atol=1e-5)


def _convolution_dtypes(cfg):
  """The operand types of every convolution and matmul in one compiled MS step."""
  teachers = stacked(ConvNet(), 0, 1)
  variables = jax.tree.map(
    lambda a: a[0], {'params': teachers.params, 'batch_stats': teachers.batch_stats}
  )
  carry, z = S._ms_run_init(GEN, cfg, KEY)
  step = jax.jit(S._ms_step, static_argnums=(0, 1, 2))
  text = step.lower(ConvNet(), GEN, cfg, carry, z, variables, 0).as_text()
  ops = [
    l for l in text.splitlines() if 'stablehlo.convolution' in l or 'stablehlo.dot_general' in l
  ]
  return ops, step(ConvNet(), GEN, cfg, carry, z, variables, 0)


def test_bf16_ms_computes_in_bf16_and_keeps_float32_state_near_the_float32_runs(batched_conv):
  """compute_dtype='bfloat16' (mixed precision): every convolution and matmul of G and F_k in
  bf16, while G's parameters, BN statistics, Adam state and the recorded losses stay float32;
  the losses stay near the float32 runs', in the batched and the CPU's run-by-run forms alike."""
  bf16 = CFG._replace(compute_dtype='bfloat16')
  ops, (carry, loss) = _convolution_dtypes(bf16)
  assert len(ops) >= 6 and all('bf16' in op and 'f32>' not in op.split('->')[0] for op in ops), ops
  assert loss.dtype == jnp.float32
  assert {a.dtype for a in jax.tree.leaves(carry) if jnp.issubdtype(a.dtype, jnp.floating)} == {
    jnp.dtype(jnp.float32)
  }
  f32_ops, _ = _convolution_dtypes(CFG)
  assert len(f32_ops) == len(ops) and not any('bf16' in op for op in f32_ops)
  group = ensemble.TeacherGroup(ConvNet(), stacked(ConvNet(), 0, 2))
  batched = S.model_stratification(group, GEN, 3, KEY, bf16)
  assert np.asarray(batched.losses).dtype == np.float32
  np.testing.assert_allclose(batched.losses, batched_conv.losses, rtol=3e-2)
  assert not np.array_equal(batched.losses, batched_conv.losses)
  python = S.model_stratification_python(group, GEN, 3, KEY, bf16)
  np.testing.assert_allclose(python.losses, batched.losses, rtol=3e-2)
  with pytest.raises(
    ValueError, match=r"^MS compute_dtype 'float16'; valid: \('float32', 'bfloat16'\)$"
  ):
    S.model_stratification(group, GEN, 3, KEY, CFG._replace(compute_dtype='float16'))


def test_an_unknown_ms_layout_is_refused():
  group = ensemble.TeacherGroup(ConvNet(), stacked(ConvNet(), 0, 2))
  with pytest.raises(ValueError, match="layout 'flat'; valid"):
    S.model_stratification(group, GEN, 3, KEY, CFG, layout='flat')


def test_ms_heatmap_numbers_clients_from_zero(tmp_path):
  """Clients are 0..m-1 in the heatmap, as in partition.txt and partition.png."""
  from jfed.distill import plots  # pylint: disable=g-import-not-at-top

  U_r, _ = S.normalise_U(np.random.default_rng(0).random((10, 5)))
  fig = plots.plot_ms_heatmap(tmp_path / 'ms.png', U_r)
  assert (tmp_path / 'ms.png').exists()
  labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
  assert labels == [f'client {k}' for k in range(5)]
  assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [str(j) for j in range(10)]


def test_sa_logits_are_a_cth_of_the_clients_unless_rescaled():
  """Eq. 8's Ū_c sums to 1 over the c classes (Eq. 6), so with even class weights the paper's
  SA is the U_r-weighted client logits divided by c; 'classes' restores the clients' scale
  and keeps the relative weighting (exactly c times the paper's SA)."""
  from jfed.methods.fedhydra import sa_weights  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  k, b, c = 4, 6, 10
  logits = jnp.asarray(rng.normal(size=(k, b, c)) * 5, jnp.float32)
  labels = jnp.asarray(rng.integers(0, c, b))
  U = rng.uniform(0.1, 1.0, size=(c, k))
  U_r = jnp.asarray(U / U.sum(1, keepdims=True), jnp.float32)  # Eq. 4: over clients
  U_c = jnp.asarray(U / U.sum(0, keepdims=True), jnp.float32)  # Eq. 6: over classes
  paper = S.stratified_aggregation(logits, *sa_weights(U_r, U_c, 'paper'), labels)
  scaled = S.stratified_aggregation(logits, *sa_weights(U_r, U_c, 'classes'), labels)
  np.testing.assert_allclose(scaled, c * paper, rtol=1e-5)
  even = jnp.full((c, k), 1.0 / c)
  by_hand = np.einsum('bk,kbc->bc', np.asarray(U_r)[np.asarray(labels)], np.asarray(logits)) / c
  np.testing.assert_allclose(
    S.stratified_aggregation(logits, *sa_weights(U_r, even, 'paper'), labels), by_hand, rtol=1e-5
  )


def test_ms_step_flops_match_a_hand_count_of_the_layers():
  """XLA's count of one MS step is, within the padding taps it skips, 2 x the multiply-adds of
  G's layers three times (forward, input and weight gradients) and of F_k's twice (forward,
  input gradients only), per image."""
  from jfed.distill import MSConfig, make_generator, ms_step_flops
  from jfed.models import get_model

  nz, ngf, batch = 64, 16, 4
  generator = make_generator((28, 28, 1), nz, ngf)
  teacher = get_model('cnn_mnist', 10, (28, 28, 1))
  variables = teacher.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1)))
  cfg = MSConfig(T_G=2, batch_size=batch)
  conv = lambda hw, cin, cout, k: 2 * hw * hw * cin * cout * k * k
  g_forward = (
    2 * nz * 2 * ngf * 7 * 7
    + conv(14, 2 * ngf, 2 * ngf, 3)
    + conv(28, 2 * ngf, ngf, 3)
    + conv(28, ngf, 1, 3)
  )
  f_forward = conv(28, 1, 16, 5) + conv(14, 16, 32, 5) + 2 * 7 * 7 * 32 * 10
  hand = batch * (3 * g_forward + 2 * f_forward)
  counted = ms_step_flops(teacher, variables, generator, cfg)
  assert 0.85 * hand < counted < 1.1 * hand, (counted, hand)


def test_fedhydra_names_round_one_files_plainly_and_later_rounds_by_number():
  """What docs/fedhydra.md and the table commands read: model_stratification.npz and
  ms_heatmap.png for a one-round run, a _round<r> suffix from round 2 on."""
  assert fedhydra._file_name('ms_heatmap', 1, 'png') == 'ms_heatmap.png'
  assert fedhydra._file_name('model_stratification', 2, 'npz') == 'model_stratification_round2.npz'


def test_fedhydra_saves_ms_in_global_client_order_and_names_each_client_in_the_heatmap(
  tmp_path, monkeypatch
):
  """Teachers in another order than the clients and m != c: each `*_by_client` array puts
  teacher i's row (client-major: losses, u) or column (class-major: U, U_r, U_c) at its
  client id, and the heatmap gets U_r by client with 'client k (architecture)' labels."""
  m, c, t_g = 3, 4, 5
  ids = np.array([2, 0, 1])
  losses = np.random.default_rng(1).random((m, c, t_g)).astype(np.float32) + 0.5
  ms = S.stratification_from_losses(losses)
  ms = fedhydra.Stratification(*(np.asarray(a) for a in ms), seconds=np.float32(1.5))
  ctx = types.SimpleNamespace(
    output_path=lambda name: tmp_path / name,
    dataset=types.SimpleNamespace(name='digits'),
    run=types.SimpleNamespace(partition=types.SimpleNamespace(scheme='dir')),
    # client_models 'mlp:hidden=8;cnn_mnist' cycled over the three clients
    federation=types.SimpleNamespace(specs=('mlp:hidden=8', 'cnn_mnist', 'mlp:hidden=8')),
    num_clients=m,
  )
  drawn = {}
  monkeypatch.setattr(
    fedhydra.plots, 'plot_ms_heatmap', lambda path, w, **kw: drawn.update(path=path, w=w, **kw)
  )
  fedhydra._write_ms(ctx, 2, ms, ids, 'batched')
  saved = np.load(tmp_path / 'model_stratification_round2.npz')
  for name in ('losses', 'u'):  # client-major
    want = np.zeros_like(getattr(ms, name))
    for i, k in enumerate(ids):
      want[k] = getattr(ms, name)[i]
    np.testing.assert_array_equal(saved[f'{name}_by_client'], want, err_msg=name)
  for name in ('U', 'U_r', 'U_c'):  # [classes, clients]
    want = np.zeros_like(getattr(ms, name))
    for i, k in enumerate(ids):
      want[:, k] = getattr(ms, name)[:, i]
    np.testing.assert_array_equal(saved[f'{name}_by_client'], want, err_msg=name)
    np.testing.assert_array_equal(saved[name], getattr(ms, name))
  np.testing.assert_array_equal(saved['teacher_client_ids'], ids)
  assert str(saved['impl']) == 'batched' and saved['seconds'] == np.float32(1.5)
  assert drawn['path'] == tmp_path / 'ms_heatmap_round2.png'
  np.testing.assert_array_equal(drawn['w'], saved['U_r_by_client'])
  assert drawn['client_names'] == ['client 0 (mlp)', 'client 1 (cnn_mnist)', 'client 2 (mlp)']
  assert drawn['title'] == 'FedHydra MS weights U_r (round 2, digits, dir)'


@pytest.mark.parametrize(
  'key, value',
  [
    ('kd_T', 0.0),  # the shared one-shot checks
    ('adv_T', 0.0),
    ('ms_batch', 0),
    ('lambda2', -1.0),
    ('ms_chunk', -1),
    ('aggregation', 'median'),
    ('generator', 'gan'),
    ('synthesis_keep', 'some'),
    ('ms_impl', 'gpu'),
    ('ms_compute_dtype', 'float16'),
    ('sa_in_model_scale', 'rows'),
  ],
)
def test_fedhydra_refusals_name_the_key(key, value):
  config = base_config()
  config.fedhydra[key] = value
  with pytest.raises(ConfigError, match=rf'^fedhydra\.{key}\b'):
    driver.build_algorithm('fedhydra', config)


def test_run_by_run_visits_every_client_of_every_group_with_its_own_key():
  """The loop and Python MS forms (the CPU's): three architecture groups of 2, 1 and 2 clients,
  each (client, class) run with its own teacher, label and key fold_in(key, k·c + j), k the
  client's index over all groups, as the batched form draws them; the losses in client order."""
  c, T_G, key = 3, 2, jax.random.PRNGKey(11)
  sizes = (2, 1, 2)
  first = np.cumsum((0,) + sizes)
  groups = [
    (f'arch{g}', ModelState({'w': first[g] + np.arange(m, dtype=np.float32)}, {}))
    for g, m in enumerate(sizes)
  ]
  calls = []

  def run(module, teacher_vars, run_key, label, tick):
    k = int(teacher_vars['params']['w'])
    calls.append((module, k, int(label), np.asarray(jax.random.key_data(run_key))))
    tick(T_G, 0.0)
    return np.array([4.0 + k + int(label), 2.0], np.float32)

  result = S._run_by_run(groups, c, key, T_G, run)
  assert [(m, k, j) for m, k, j, _ in calls] == [
    (f'arch{g}', k, j)
    for g, m in enumerate(sizes)
    for k in range(first[g], first[g] + m)
    for j in range(c)
  ]
  for _, k, j, run_key in calls:
    want = jax.random.key_data(jax.random.fold_in(key, k * c + j))
    np.testing.assert_array_equal(run_key, np.asarray(want))
  want_losses = np.stack(
    [[[4.0 + k + j, 2.0] for j in range(c)] for k in range(sum(sizes))]
  ).astype(np.float32)
  np.testing.assert_array_equal(result.losses, want_losses)


def test_which_ms_form_runs_where_and_bad_choices_refused():
  assert S.resolve_ms_impl('auto', 'cpu') == 'python'
  assert S.resolve_ms_impl('auto', 'gpu') == 'batched'
  assert S.resolve_ms_impl('loop', 'gpu') == 'loop'
  with pytest.raises(ValueError, match=r"ms_impl must be one of .*got 'gpu'"):
    S.resolve_ms_impl('gpu')
  with pytest.raises(ValueError, match=r"sa_in_model_scale 'rows'; valid"):
    fedhydra.sa_weights(np.ones((3, 2)), np.ones((3, 2)), 'rows')


@pytest.mark.parametrize('impl', ['python', 'loop', 'batched'])
def test_fedhydras_ms_and_synthesis_settings_reach_what_runs_them(impl, monkeypatch):
  """Settings that move no oracle number still reach the code they configure: MS's compute
  dtype and T_G / lr / batch, the chunk size (to the batched form only: the others take none),
  synthesis' `every_term`; the round keeps its teachers' client ids and MS's arrays in float32."""
  m, c, t_g = 3, 3, 4
  rng = np.random.default_rng(0)
  x = rng.random((12, 8, 8, 1), np.float32)
  y = np.tile(np.arange(c, dtype=np.int32), 4)
  ds = Dataset('digits', x, y, x[:6], y[:6], c)
  config = base_config()
  config.partition.num_clients = m
  config.fedhydra.update(
    {
      'ms_impl': impl,
      'ms_chunk': 5,
      'ms_compute_dtype': 'bfloat16',
      'ms_T_G': t_g,
      'ms_lr': 0.02,
      'ms_batch': 7,
      'synthesis_every_term': True,
    }
  )
  ctx = driver.make_context(config, ds, [np.arange(4) + 4 * k for k in range(m)])
  hydra = driver.build_algorithm('fedhydra', config).config
  assert fedhydra.settings(hydra, ctx).synthesis.every_term is True
  assert (
    fedhydra.settings(hydra._replace(synthesis_every_term=False), ctx).synthesis.every_term is False
  )

  calls = []
  losses = 1.0 + rng.random((m, c, t_g))  # float64: MS's arrays are stored as float32

  def record(teachers, generator, num_classes, key, cfg, **kw):
    calls.append((teachers, num_classes, cfg, kw))
    return S.stratification_from_losses(losses)

  monkeypatch.setitem(fedhydra.MS_FUNCTIONS, impl, record)
  ids = np.array([2, 0, 1])
  local = types.SimpleNamespace(groups=[types.SimpleNamespace(client_ids=ids)])
  teachers = object()
  got = fedhydra.stratify(hydra, ctx, None, 1, local, teachers)
  [(got_teachers, num_classes, cfg, kw)] = calls
  assert got_teachers is teachers and num_classes == c
  assert cfg == S.MSConfig(T_G=t_g, lr=0.02, batch_size=7, compute_dtype='bfloat16')
  assert kw == ({'chunk_size': 5} if impl == 'batched' else {})
  np.testing.assert_array_equal(got.client_ids, ids)
  for name in ('losses', 'u', 'U', 'U_r', 'U_c', 'seconds'):
    assert np.asarray(getattr(got.ms, name)).dtype == np.float32, name
  np.testing.assert_allclose(got.ms.losses, losses, rtol=1e-6)


def test_cast_floats_casts_floating_leaves_and_keeps_integer_ones():
  """MS's mixed precision casts what G and F_k compute with: float leaves to the compute dtype,
  integer leaves (a step counter, say) as they are."""
  tree = {'w': jnp.ones((2,), jnp.float32), 'n': jnp.arange(3, dtype=jnp.int32)}
  cast = S._cast_floats(tree, jnp.bfloat16)
  assert cast['w'].dtype == jnp.bfloat16 and cast['n'].dtype == jnp.int32
  np.testing.assert_array_equal(cast['n'], [0, 1, 2])
