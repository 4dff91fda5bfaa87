"""OT fusion (Singh & Jaggi weight mode): permuted copies are recovered, identical models are a
fixed point, exact alignment preserves the function, plans satisfy their marginals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.distance import cdist

from jfed.distill import FusionLayer
from jfed.distill import ot_fusion as F
from jfed.engine.state import ModelState
from jfed.errors import ConfigError
from jfed.methods.ot import fusion_layers
from jfed.models import get_model
from jfed.models.layers import BatchNorm


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(8, name='fc1')(x))
    x = nn.relu(nn.Dense(6, name='fc2')(x))
    return nn.Dense(3, name='fc3')(x)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = nn.relu(BatchNorm(name='bn1')(nn.Conv(4, (3, 3), name='conv1')(x), train, mask))
    x = nn.relu(BatchNorm(name='bn2')(nn.Conv(5, (3, 3), name='conv2')(x), train, mask))
    x = nn.max_pool(x, (2, 2), (2, 2))
    return nn.Dense(3, name='fc')(x.reshape(x.shape[0], -1))


MLP_LAYERS = ['fc1', 'fc2', 'fc3']
CNN_LAYERS = [F.FusionLayer('conv1', 'bn1'), F.FusionLayer('conv2', 'bn2'), 'fc']
X = jax.random.uniform(jax.random.PRNGKey(9), (5, 6, 6, 1))


def init(module, seed, random_stats=True):
  v = module.init(jax.random.PRNGKey(seed), jnp.zeros((2, 6, 6, 1)))
  bs = v.get('batch_stats', {})
  if random_stats and bs:
    rng = np.random.default_rng(seed)
    bs = jax.tree_util.tree_map_with_path(
      lambda p, a: jnp.asarray(
        rng.random(a.shape) + (0.5 if p[-1].key == 'var' else -0.5), jnp.float32
      ),
      bs,
    )
    v = {
      'params': jax.tree.map(
        lambda a: a + 0.05 * jnp.asarray(rng.normal(size=a.shape), jnp.float32), v['params']
      ),
      'batch_stats': bs,
    }
  return ModelState(v['params'], bs)


def apply(module, st, x=X):
  return module.apply({'params': st.params, 'batch_stats': st.batch_stats}, x, train=False)


def permute_mlp(st, p1, p2):
  P = jax.tree.map(np.asarray, st.params)
  P['fc1']['kernel'] = P['fc1']['kernel'][:, p1]
  P['fc1']['bias'] = P['fc1']['bias'][p1]
  P['fc2']['kernel'] = P['fc2']['kernel'][p1][:, p2]
  P['fc2']['bias'] = P['fc2']['bias'][p2]
  P['fc3']['kernel'] = P['fc3']['kernel'][p2]
  return ModelState(jax.tree.map(jnp.asarray, P), {})


def permute_cnn(st, p1, p2):
  P = jax.tree.map(np.asarray, st.params)
  B = jax.tree.map(np.asarray, st.batch_stats)
  P['conv1']['kernel'] = P['conv1']['kernel'][..., p1]
  P['conv1']['bias'] = P['conv1']['bias'][p1]
  for tree in (P, B):
    for k in tree['bn1']['bn']:
      tree['bn1']['bn'][k] = tree['bn1']['bn'][k][p1]
    for k in tree['bn2']['bn']:
      tree['bn2']['bn'][k] = tree['bn2']['bn'][k][p2]
  P['conv2']['kernel'] = P['conv2']['kernel'][:, :, p1][..., p2]
  P['conv2']['bias'] = P['conv2']['bias'][p2]
  k = P['fc']['kernel']  # NHWC flatten: [S·C, out] with the channel fastest
  P['fc']['kernel'] = k.reshape(-1, 5, k.shape[-1])[:, p2].reshape(k.shape)
  return ModelState(jax.tree.map(jnp.asarray, P), jax.tree.map(jnp.asarray, B))


def assert_tree_close(a, b, **kw):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


P1, P2 = np.array([3, 0, 7, 5, 1, 6, 2, 4]), np.array([4, 2, 0, 5, 1, 3])


def test_mlp_permuted_copy_recovered():
  net, st = MLP(), init(MLP(), 0)
  perm = permute_mlp(st, P1, P2)
  np.testing.assert_allclose(apply(net, perm), apply(net, st), rtol=1e-5, atol=1e-6)
  assert not np.allclose(perm.params['fc1']['kernel'], st.params['fc1']['kernel'])
  fused, _ = F.ot_fuse([st.params, perm.params], MLP_LAYERS, anchor=0)
  assert_tree_close(fused, st.params, rtol=1e-6, atol=1e-7)
  fused, _ = F.ot_fuse([st.params, perm.params], MLP_LAYERS, anchor=1)
  assert_tree_close(fused, perm.params, rtol=1e-6, atol=1e-7)
  # entropic plan with a small epsilon recovers it approximately
  fused, _ = F.ot_fuse([st.params, perm.params], MLP_LAYERS, method='sinkhorn', epsilon=1e-3)
  assert_tree_close(fused, st.params, rtol=0, atol=2e-3)


def _cnn_and_permuted_copy():
  """A CNN with BatchNorm and the same function with its channels reordered."""
  st = init(CNN(), 1)
  return st, permute_cnn(st, np.array([2, 0, 3, 1]), np.array([4, 1, 3, 0, 2]))


def test_cnn_bn_flatten_permuted_copy_recovered():
  net, (st, perm) = CNN(), _cnn_and_permuted_copy()
  np.testing.assert_allclose(apply(net, perm), apply(net, st), rtol=1e-5, atol=1e-5)
  fp, fbs = F.ot_fuse(
    [st.params, perm.params],
    CNN_LAYERS,
    batch_stats_list=[st.batch_stats, perm.batch_stats],
    anchor=0,
  )
  assert_tree_close(fp, st.params, rtol=1e-6, atol=1e-7)
  assert_tree_close(fbs, st.batch_stats, rtol=1e-6, atol=1e-7)
  # stacked-state entry point, three models (orig, permuted, orig)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), st, perm, st)
  fused = F.ot_fuse_states(stacked, CNN_LAYERS)
  np.testing.assert_allclose(apply(net, fused), apply(net, st), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('method', ['exact', 'sinkhorn'])
def test_identical_models_are_a_fixed_point(method):
  for net, layers, seed in [(MLP(), MLP_LAYERS, 2), (CNN(), CNN_LAYERS, 3)]:
    st = init(net, seed)
    bsl = [st.batch_stats] * 3 if st.batch_stats else None
    fp, fbs = F.ot_fuse([st.params] * 3, layers, batch_stats_list=bsl, method=method, epsilon=1e-3)
    tol = dict(rtol=1e-6, atol=1e-7) if method == 'exact' else dict(rtol=0, atol=2e-3)
    assert_tree_close(fp, st.params, **tol)
    if bsl:
      assert_tree_close(fbs, st.batch_stats, **tol)


def test_exact_alignment_preserves_function_and_fusion_averages():
  net, a, b = CNN(), init(CNN(), 4), init(CNN(), 5)
  pb, bsb, plans = F.align_to_anchor(
    b.params, a.params, CNN_LAYERS, b.batch_stats, return_plans=True
  )
  for T in plans:  # equal widths + exact ⇒ permutation matrices
    np.testing.assert_allclose(T.sum(0), 1.0)
    np.testing.assert_allclose(T.sum(1), 1.0)
    assert set(np.unique(T)) <= {0.0, 1.0}
  np.testing.assert_allclose(apply(net, ModelState(pb, bsb)), apply(net, b), rtol=1e-5, atol=1e-5)
  fp, fbs = F.ot_fuse(
    [a.params, b.params],
    CNN_LAYERS,
    batch_stats_list=[a.batch_stats, b.batch_stats],
    weights=[3.0, 1.0],
  )
  want = jax.tree.map(lambda x, y: 0.75 * x + 0.25 * y, a.params, pb)
  assert_tree_close(fp, want, rtol=1e-5, atol=1e-6)


def test_transport_plans():
  rng = np.random.default_rng(0)
  for n, m in [(5, 5), (4, 6)]:
    C = rng.random((n, m))
    T = F.transport_plan(C, 'exact', 0.0)
    np.testing.assert_allclose(T.sum(1), 1 / n, atol=1e-9)
    np.testing.assert_allclose(T.sum(0), 1 / m, atol=1e-9)
    Ts = F.transport_plan(C, 'sinkhorn', epsilon=1e-2, threshold=1e-7)
    np.testing.assert_allclose(Ts.sum(0), 1 / m, atol=1e-4)
    assert (T * C).sum() <= (Ts * C).sum() + 1e-6  # exact plan is optimal
    Tt = F.transport_plan(C, 'sinkhorn', epsilon=1e-4, threshold=1e-7)
    assert abs((Tt * C).sum() - (T * C).sum()) < 5e-3  # small ε → exact cost


# ----------------------------------------------------------------------------- the method's layers
# `jfed.methods.ot.fusion_layers` reads a model's fusable layers: its Conv/Dense layers in creation
# order, each with the BatchNorm right after it; anything else is refused in one line.


class _Param(nn.Module):
  """A submodule with the given parameter names (shape [n, 4])."""

  names: tuple

  @nn.compact
  def __call__(self, x):
    for name in self.names:
      x = x @ self.param(name, nn.initializers.ones, (x.shape[-1], 4))
    return x


class _Stack(nn.Module):
  """Dense ('d'), BatchNorm ('b') or `_Param` ('p:<names>') submodules in this order."""

  kinds: tuple

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = x.reshape(x.shape[0], -1)
    for kind in self.kinds:
      if kind == 'd':
        x = nn.Dense(4)(x)
      elif kind == 'b':
        x = BatchNorm()(x, train, mask)
      else:
        x = _Param(tuple(kind[2:].split(',')))(x)
    return x


def _fusion_layers(module, shape=(6, 6, 1)):
  return fusion_layers(module, shape, jax.random.PRNGKey(0))


def test_fusion_layers_pair_each_layer_with_the_batchnorm_right_after_it():
  # cnn_mnist: 5x5 conv, BN, ReLU, pool, twice, then the classifier
  assert _fusion_layers(get_model('cnn_mnist', 10, (28, 28, 1)), (28, 28, 1)) == [
    FusionLayer('Conv_0', 'BatchNorm_0'),
    FusionLayer('Conv_1', 'BatchNorm_1'),
    FusionLayer('Dense_0'),
  ]
  # a BatchNorm belongs to the layer just before it, not to an earlier one
  assert _fusion_layers(_Stack(('d', 'd', 'b', 'd', 'b', 'd'))) == [
    FusionLayer('Dense_0'),
    FusionLayer('Dense_1', 'BatchNorm_0'),
    FusionLayer('Dense_2', 'BatchNorm_1'),
    FusionLayer('Dense_3'),
  ]


@pytest.mark.parametrize(
  'kinds, submodule',
  [
    (('b', 'd'), 'BatchNorm_0'),  # a BatchNorm with no layer before it
    (('d', 'b', 'b', 'd'), 'BatchNorm_1'),  # a second BatchNorm after one layer
    (('d', 'p:kernel,scale'), '_Param_0'),  # a layer with more than a kernel and a bias
    (('d', 'p:weight'), '_Param_0'),  # neither a layer nor a BatchNorm
  ],
)
def test_fusion_layers_refuse_what_is_not_a_sequential_conv_dense_bn_model(kinds, submodule):
  with pytest.raises(
    ConfigError,
    match=(
      r'^OT fusion handles sequential Conv/Dense\(\+BatchNorm\) models only; '
      rf"_Stack has the submodule '{submodule}'$"
    ),
  ):
    _fusion_layers(_Stack(kinds))


@pytest.mark.parametrize('squared', [False, True])
def test_ground_metric_is_the_float64_euclidean_distance(squared):
  # float32 rows (a model's weights): the cost is computed in float64, as scipy's cdist
  rng = np.random.default_rng(5)
  x = (rng.normal(size=(4, 7)) * 3).astype(np.float32)
  y = (x[[2, 0, 3, 1]] + rng.normal(size=(4, 7)) * 1e-3).astype(np.float32)
  got = F.ground_metric(x, y, squared)
  want = cdist(
    x.astype(np.float64), y.astype(np.float64), 'sqeuclidean' if squared else 'euclidean'
  )
  assert got.dtype == np.float64
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_an_unknown_transport_method_is_refused_naming_it():
  with pytest.raises(ValueError, match=r"^method must be 'exact' or 'sinkhorn', got 'greedy'$"):
    F.transport_plan(np.ones((2, 2)), 'greedy', 0.01)


def test_layers_that_cannot_be_aligned_are_refused_in_one_line():
  # a kernel neither Dense [in, out] nor Conv [kh, kw, in, out]
  with pytest.raises(ValueError, match=r'^unsupported kernel rank 3$'):
    F._to_rows(np.zeros((2, 3, 4)))
  # a 3x3 convolution with 6 inputs after a layer of 3 units: only a Dense after a flatten may
  # see a multiple of the previous layer's units
  with pytest.raises(ValueError, match=r'^cannot align 6 inputs with a \(3, 3\) transport map$'):
    F._align_inputs(np.zeros((2, 6, 9)), np.eye(3))


def test_the_defaults_are_otfusions_weight_mode_in_every_entry_point():
  # github.com/sidak/otfusion as jfed's OT baseline runs it: --exact, --skip-last-layer, the
  # plain (not squared) Euclidean ground metric with the bias appended to each row; epsilon 0.01
  # for the entropic plan
  rng = np.random.default_rng(6)
  # unrelated models with biases of the weights' scale, so that every setting matters
  a, b = (
    {
      name: {'kernel': np.asarray(l['kernel']), 'bias': rng.normal(size=l['bias'].shape) * 0.5}
      for name, l in init(MLP(), seed).params.items()
    }
    for seed in (5, 8)
  )
  reference = dict(
    method='exact', epsilon=1e-2, skip_last_layer=True, squared=False, bias_in_cost=True
  )
  changed = {'squared': True, 'bias_in_cost': False, 'skip_last_layer': False}
  # the entropic plans cost a compilation each: their one setting, epsilon, is checked alone
  for method in ('exact', 'sinkhorn'):
    chosen = {**reference, 'method': method}
    variants = changed if method == 'exact' else {'epsilon': 1.0}
    runs = [
      (F.ot_fuse, lambda **kw: F.ot_fuse([a, b], MLP_LAYERS, **kw)[0]),
      (F.align_to_anchor, lambda **kw: F.align_to_anchor(b, a, MLP_LAYERS, **kw)[0]),
    ]
    for function, run in runs:
      by_default = run() if method == 'exact' else run(method=method)
      assert_tree_close(by_default, run(**chosen), rtol=0, atol=0)
      for name, value in variants.items():  # each default is one that changes the result
        other = run(**{**chosen, name: value})
        assert any(
          not np.allclose(x, y) for x, y in zip(jax.tree.leaves(other), jax.tree.leaves(by_default))
        ), (function.__name__, name)


def test_layers_given_as_name_pairs_are_fusion_layers():
  st, perm = _cnn_and_permuted_copy()
  as_pairs = [('conv1', 'bn1'), ('conv2', 'bn2'), 'fc']
  for layers in (as_pairs, CNN_LAYERS):
    fused, stats = F.ot_fuse(
      [st.params, perm.params], layers, batch_stats_list=[st.batch_stats, perm.batch_stats]
    )
    assert_tree_close(fused, st.params, rtol=1e-6, atol=1e-7)
    assert_tree_close(stats, st.batch_stats, rtol=1e-6, atol=1e-7)


def test_a_wider_model_split_from_the_anchor_aligns_back_to_the_anchor():
  # the model's 4 hidden units are two copies of each of the anchor's 2: the exact plan between
  # the uniform measures (1/4 each, 1/2 each) sends 1/4 along each copy, and the column-normalised
  # plan averages the copies back into the anchor's units
  rng = np.random.default_rng(8)
  anchor = {
    'fc1': {'kernel': rng.normal(size=(5, 2)), 'bias': rng.normal(size=2)},
    'fc2': {'kernel': rng.normal(size=(2, 3)), 'bias': rng.normal(size=3)},
  }
  copies = np.array([1, 0, 0, 1])
  wide = {
    'fc1': {'kernel': anchor['fc1']['kernel'][:, copies], 'bias': anchor['fc1']['bias'][copies]},
    'fc2': {'kernel': anchor['fc2']['kernel'][copies] / 2, 'bias': anchor['fc2']['bias']},
  }
  aligned, _ = F.align_to_anchor(wide, anchor, ['fc1', 'fc2'])
  np.testing.assert_allclose(aligned['fc1']['kernel'], anchor['fc1']['kernel'], atol=1e-12)
  np.testing.assert_allclose(aligned['fc1']['bias'], anchor['fc1']['bias'], atol=1e-12)


def test_a_layer_without_bias_is_aligned_by_its_weights_alone():
  rng = np.random.default_rng(9)
  anchor = {'fc1': {'kernel': rng.normal(size=(5, 3))}, 'fc2': {'kernel': rng.normal(size=(3, 2))}}
  perm = np.array([2, 0, 1])
  model = {
    'fc1': {'kernel': anchor['fc1']['kernel'][:, perm]},
    'fc2': {'kernel': anchor['fc2']['kernel'][perm]},
  }
  aligned, stats = F.align_to_anchor(model, anchor, ['fc1', 'fc2'])
  assert_tree_close(aligned, anchor, rtol=0, atol=1e-6)
  assert stats is None  # no statistics in, none out


def test_models_with_different_numbers_of_classes_are_refused():
  rng = np.random.default_rng(10)
  anchor = {'fc': {'kernel': rng.normal(size=(5, 3)), 'bias': np.zeros(3)}}
  other = {'fc': {'kernel': rng.normal(size=(5, 4)), 'bias': np.zeros(4)}}
  with pytest.raises(ValueError, match=r'^last layer fc: output widths differ \(4 vs 3\)$'):
    F.align_to_anchor(other, anchor, ['fc'])


@pytest.mark.parametrize('x64', [False, True])
def test_float32_models_come_back_float32(x64):
  # the plans and the alignment are computed in float64; the models keep their own dtype, in an
  # x64 scope too (where a float64 leaf would no longer be narrowed on its way back to JAX)
  st, perm = _cnn_and_permuted_copy()
  with jax.enable_x64(x64):
    aligned, stats = F.align_to_anchor(perm.params, st.params, CNN_LAYERS, perm.batch_stats)
    fused, fused_stats = F.ot_fuse(
      [st.params, perm.params], CNN_LAYERS, batch_stats_list=[st.batch_stats, perm.batch_stats]
    )
  for tree in (aligned, stats, fused, fused_stats):
    assert {np.asarray(leaf).dtype for leaf in jax.tree.leaves(tree)} == {np.dtype(np.float32)}


def test_batchnorm_statistics_of_another_width_are_refused():
  st = init(CNN(), 1)
  stats = jax.tree.map(lambda a: a, st.batch_stats)
  stats['bn1']['bn']['mean'] = jnp.zeros(5)  # conv1 has 4 channels
  with pytest.raises(ValueError, match=r'^BN leaf bn1/bn/mean has 5 channels, layer has 4$'):
    F.align_to_anchor(st.params, st.params, CNN_LAYERS, stats)
