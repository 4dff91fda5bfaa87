"""Strict server-side validation of uploads: every malformed upload is an UploadError whose
message names the client and the key path (or num_samples), never a TypeError or a silent cast."""

import types

import flax
import jax
import numpy as np
import pytest

from jfed import engine
from jfed.io import (
  DecoderUpload,
  ModelUpload,
  PrototypeUpload,
  UploadError,
  validate_decoder_upload,
  validate_model_upload,
  validate_prototype_upload,
  validate_tree,
)
from jfed.models import get_model

KERNEL = r"params\['Dense_0'\]\['kernel'\]"


@pytest.fixture(scope='module')
def template():
  """A real flax model's variables (a CNN, so with BatchNorm statistics), on the host."""
  module = get_model('cnn_mnist', 10, (8, 8, 1))
  state = engine.init_model(module, (8, 8, 1), jax.random.PRNGKey(0))
  return jax.tree.map(np.asarray, state)


def _replace(state, path, value):
  """`state` with the leaf at `path` (a tuple of keys under params/batch_stats) replaced."""
  params = jax.tree.map(lambda a: a, state.params)  # a copy of the nested dicts
  node = params
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value
  return state._replace(params=params)


def _check(model, template, match, **kwargs):
  with pytest.raises(UploadError, match=match):
    validate_model_upload(ModelUpload(3, 100, model), template, **kwargs)


def test_a_valid_upload_passes(template):
  validate_model_upload(ModelUpload(3, 100, template), template)
  validate_model_upload(ModelUpload(3, np.int64(100), template), template, max_samples=100)
  # device arrays of the right dtypes are fine too
  validate_model_upload(ModelUpload(3, 100, jax.tree.map(jax.numpy.asarray, template)), template)


@pytest.mark.parametrize(
  'value,message',
  [
    (lambda k: k.astype(np.float64), r'is float64\[128, 10\], expected float32\[128, 10\]'),
    (lambda k: k.astype(np.int32), r'is int32\[128, 10\], expected float32\[128, 10\]'),
    (lambda k: k[:, :5], r'is float32\[128, 5\], expected float32\[128, 10\]'),
    (lambda k: 'hello', r'is <U5\[\] \(str\), expected float32\[128, 10\]'),
    (lambda k: None, r'is None, expected float32\[128, 10\]'),
    (lambda k: object(), r'is \|O\[\] \(object\), expected float32\[128, 10\]'),
    (lambda k: 1.5, r'is float64\[\] \(float\), expected float32\[128, 10\]'),
    (lambda k: np.where(np.arange(10) == 3, np.inf, k).astype(np.float32), 'has non-finite'),
    (lambda k: np.full_like(k, np.nan), 'has non-finite'),
  ],
  ids=['float64', 'int', 'shape', 'str', 'none', 'object', 'python_float', 'inf', 'nan'],
)
def test_a_malformed_leaf_is_named_by_its_key_path(template, value, message):
  model = _replace(template, ('Dense_0', 'kernel'), value(template.params['Dense_0']['kernel']))
  _check(model, template, f'^upload of client 3: {KERNEL} {message}')


def test_an_array_that_cannot_be_built_is_an_upload_error(template):
  class Hostile:
    def __array__(self, *args, **kwargs):
      raise TypeError('no array here')

  model = _replace(template, ('Dense_0', 'kernel'), Hostile())
  _check(model, template, f'{KERNEL} is a Hostile that is not an array')


def test_missing_extra_and_renamed_keys_are_named(template):
  bias = r"params\['Dense_0'\]\['bias'\]"
  params = dict(template.params)
  dense = dict(params['Dense_0'])
  del dense['bias']
  _check(template._replace(params={**params, 'Dense_0': dense}), template, f'missing {bias}$')
  extra = {**params, 'Dense_9': {'bias': np.zeros(3, np.float32)}}
  _check(
    template._replace(params=extra), template, r"^[^;]*: unexpected params\['Dense_9'\]\['bias'\]$"
  )
  renamed = {**params, 'Dense_1': params['Dense_0']}
  del renamed['Dense_0']
  _check(
    template._replace(params=renamed),
    template,
    rf"missing {bias}, {KERNEL}; unexpected params\['Dense_1'\]\['bias'\], "
    r"params\['Dense_1'\]\['kernel'\]$",
  )
  # a batch_stats key lost: the BatchNorm statistics are checked like the parameters
  stats = dict(template.batch_stats)
  del stats['BatchNorm_1']
  _check(
    template._replace(batch_stats=stats),
    template,
    r"missing batch_stats\['BatchNorm_1'\]\['bn'\]\['mean'\], "
    r"batch_stats\['BatchNorm_1'\]\['bn'\]\['var'\]$",
  )


def test_long_key_lists_are_capped():
  template = {f'w{i}': np.zeros(2, np.float32) for i in range(10)}
  upload = {f'v{i}': np.zeros(2, np.float32) for i in range(10)}
  with pytest.raises(
    UploadError, match=r"missing \['w0'\], \['w1'\], \['w2'\], \['w3'\] and 6 more"
  ):
    validate_tree(upload, template, 'upload of client 1')


def test_container_types_must_be_the_templates(template):
  frozen = template._replace(params=flax.core.FrozenDict(template.params))
  _check(frozen, template, 'params is a FrozenDict .*, expected a dict')
  proxy = template._replace(params=types.MappingProxyType(template.params))
  _check(proxy, template, 'params is a mappingproxy \\(not a pytree container\\)')
  _check({'params': template.params}, template, 'missing params')
  # plain dict trees: a nested dict where an array is due, a list where a dict is due
  t = {'a': {'b': np.zeros(3, np.float32)}}
  with pytest.raises(
    UploadError, match=r"missing \['a'\]\['b'\]; unexpected \['a'\]\['b'\]\['c'\]"
  ):
    validate_tree({'a': {'b': {'c': np.zeros(3, np.float32)}}}, t)
  with pytest.raises(UploadError, match=r"missing \['a'\]\['b'\]; unexpected \['a'\]\[0\]"):
    validate_tree({'a': [np.zeros(3, np.float32)]}, t)


@pytest.mark.parametrize(
  'num_samples,message',
  [
    (float('nan'), r'got nan \(float\)'),
    (1e18, r'got 1e\+18 \(float\)'),
    (100.0, r'got 100.0 \(float\)'),
    ('100', r"got '100' \(str\)"),
    (True, r'got True \(bool\)'),
    (None, r'got None \(NoneType\)'),
    (0, 'got 0$'),
    (-3, 'got -3$'),
    (101, 'num_samples = 101 exceeds the 100 samples the client holds$'),
  ],
)
def test_num_samples_must_be_a_positive_integer_within_the_partition(
  template, num_samples, message
):
  with pytest.raises(UploadError, match=f'^upload of client 3: .*{message}'):
    validate_model_upload(ModelUpload(3, num_samples, template), template, max_samples=100)
  # decoder and prototype uploads share the check
  decoder = DecoderUpload(4, num_samples, {'w': np.zeros(2, np.float32)}, np.array([1, 2]))
  with pytest.raises(UploadError, match='num_samples'):
    validate_decoder_upload(decoder, {'w': np.zeros(2, np.float32)}, 2, max_samples=100)
  proto = PrototypeUpload(5, num_samples, np.zeros((2, 3), np.float32), np.array([1, 2]))
  with pytest.raises(UploadError, match='num_samples'):
    validate_prototype_upload(proto, 2, 3, max_samples=100)


def _scaled(state, factor):
  return jax.tree.map(lambda a: (a * factor).astype(a.dtype), state)


@pytest.fixture(scope='module')
def reference(template):
  # The global model: non-zero BatchNorm statistics too, so that they count in both norms.
  return jax.tree.map(lambda a: a + np.float32(0.5), template)


@pytest.mark.parametrize('factor', [1e30, -100.0, -10.0])
def test_an_update_beyond_the_norm_bound_is_refused(template, reference, factor):
  model = _scaled(reference, factor)
  _check(
    model,
    template,
    r'update norm \|\|model - global\|\| = \S+ exceeds 10 x \|\|global\|\| = 10 x \S+ = \S+$',
    reference=reference,
    max_update_norm_ratio=10.0,
  )


def test_an_update_just_under_the_bound_passes(template, reference):
  # θ = 10.99 θ_ref: ||θ − θ_ref|| = 9.99 ||θ_ref||, under the bound of 10 ||θ_ref||
  model = _scaled(reference, 10.99)
  validate_model_upload(
    ModelUpload(3, 100, model), template, reference=reference, max_update_norm_ratio=10.0
  )
  # ... and just over it is refused; the BatchNorm statistics count: scaling them alone by
  # 1 + 11 · ||θ_ref|| / ||stats_ref|| moves the model by 11 ||θ_ref||
  sq = lambda tree: sum(
    float(np.sum(np.square(a, dtype=np.float64))) for a in jax.tree.leaves(tree)
  )
  factor = 1 + 11 * np.sqrt(
    (sq(reference.params) + sq(reference.batch_stats)) / sq(reference.batch_stats)
  )
  stats_only = reference._replace(batch_stats=_scaled(reference.batch_stats, factor))
  _check(stats_only, template, 'update norm', reference=reference, max_update_norm_ratio=10.0)


def test_the_norm_bound_needs_a_reference(template):
  with pytest.raises(ValueError, match='reference'):
    validate_model_upload(ModelUpload(3, 100, template), template, max_update_norm_ratio=10.0)
