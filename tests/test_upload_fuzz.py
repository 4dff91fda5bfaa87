"""Fuzzed uploads (issue 38): the validator raises nothing but UploadError for any input, accepts
no malformed upload and refuses no well-formed one; the Flower bridge validates a node's reply
before it stacks or casts it.

Each fuzzed upload is a seeded mutation of a valid one: wrong dtypes (float64 among them), wrong
shapes, NaN/Inf, extra and missing keys, keys of mixed types, non-array leaves, nested and
cyclic garbage, None, strings, huge integers, hostile objects (whose __array__, __eq__, __hash__
or __repr__ raise), and bad num_samples. One in eight is a well-formed variant (device arrays,
Fortran order, read-only copies) that must pass.
"""

import collections
import fractions
import random
import types
from typing import Any, Callable, List, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed.engine import ModelState
from jfed.io import ModelUpload, UploadError, validate_model_upload

MAX_SAMPLES = 100


def _template() -> ModelState:
  """The variables of a small CNN with BatchNorm, as flax lays them out."""
  f32 = lambda *shape: np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)
  return ModelState(
    params={
      'Conv_0': {'kernel': f32(3, 3, 1, 4), 'bias': f32(4)},
      'BatchNorm_0': {'scale': f32(4), 'bias': f32(4)},
      'Dense_0': {'kernel': f32(16, 10), 'bias': f32(10)},
    },
    batch_stats={'BatchNorm_0': {'mean': f32(4), 'var': f32(4) + 2}},
  )


TEMPLATE = _template()


# ---- hostile objects -------------------------------------------------------------------------
class RaisingArray:
  def __array__(self, *args, **kwargs):
    raise RuntimeError('no array here')


class WrongArray:
  """__array__ returns something that is not an array."""

  def __array__(self, *args, **kwargs):
    return 'not an array'


class PerfectArray:
  """Converts to exactly the right array, but is no array: a leaf JAX would keep as an object."""

  def __init__(self, value):
    self.value = value

  def __array__(self, dtype=None, copy=None):
    return self.value


class MimicKey:
  """A key whose repr is "'bias'", equal to nothing, unorderable."""

  def __init__(self, text='bias'):
    self.text = text

  def __repr__(self):
    return repr(self.text)

  def __hash__(self):
    return hash(self.text)

  def __eq__(self, other):
    return False

  def __lt__(self, other):
    raise TypeError('unorderable')


class RaisingKey:
  def __hash__(self):
    return 7

  def __eq__(self, other):
    raise RuntimeError('no comparing')

  def __repr__(self):
    raise RuntimeError('no repr')


class RaisingDict(dict):
  def keys(self):
    raise RuntimeError('no keys')

  def items(self):
    raise RuntimeError('no items')

  def __iter__(self):
    raise RuntimeError('no iter')


class RaisingMapping(collections.abc.Mapping):
  def __getitem__(self, key):
    raise KeyError(key)

  def __iter__(self):
    raise RuntimeError('no iter')

  def __len__(self):
    raise RuntimeError('no len')


class RaisingClass:
  """An object whose __class__ raises (isinstance consults it)."""

  @property
  def __class__(self):
    raise RuntimeError('no class')


class HostileInt(int):
  def __int__(self):
    raise RuntimeError('no int')

  def __index__(self):
    raise RuntimeError('no index')


def _cyclic() -> list:
  a: list = []
  a.append(a)
  return a


def _deep(depth: int) -> Any:
  x: Any = np.zeros(4, np.float32)
  for _ in range(depth):
    x = [x]
  return x


def _garbage(rng: random.Random) -> Any:
  """A value that is never a well-formed leaf or subtree."""
  choices: List[Callable[[], Any]] = [
    lambda: None,
    lambda: 'hello',
    lambda: b'\x00\x01',
    lambda: 10**100,
    lambda: -(10**30),
    lambda: 2**63,
    lambda: 1.5,
    lambda: float('nan'),
    lambda: complex(1, 2),
    lambda: True,
    lambda: fractions.Fraction(1, 3),
    lambda: [],
    lambda: (),
    lambda: {},
    lambda: {1, 2},
    lambda: frozenset(),
    lambda: object(),
    lambda: RaisingArray(),
    lambda: WrongArray(),
    lambda: RaisingClass(),
    lambda: HostileInt(3),
    lambda: _cyclic(),
    lambda: _deep(rng.choice([50, 3000])),
    lambda: [np.zeros(4, np.float32)] * 3,
    lambda: {'a': {'b': {'c': None}}},
    lambda: {1: 'x', 'y': 2, (3,): None},
    lambda: {MimicKey(): 1},
    lambda: {RaisingKey(): 1, 'a': 2},
    lambda: RaisingDict(a=1),
    lambda: RaisingMapping(),
    lambda: types.MappingProxyType({'kernel': np.zeros(3, np.float32)}),
    lambda: np.array([1, 'a'], dtype=object),
    lambda: np.zeros(3, dtype=[('a', 'f4')]),
    lambda: np.array(['2020-01-01'], dtype='datetime64[D]'),
    lambda: jax.random.key(0),
    lambda: memoryview(np.zeros(4, np.float32)),
    lambda: np.zeros((0,), np.float32),
    lambda: Ellipsis,
    lambda: print,
    lambda: np,
    lambda: int,
  ]
  return rng.choice(choices)()


# ---- the mutations ---------------------------------------------------------------------------
def _copy(model: ModelState) -> ModelState:
  return jax.tree.map(np.array, model)


def _dicts(model: ModelState) -> List[Tuple[str, dict]]:
  """Every dict in the model, with a name."""
  out = []

  def visit(name, d):
    out.append((name, d))
    for k, v in d.items():
      if isinstance(v, dict):
        visit(f'{name}/{k}', v)

  visit('params', model.params)
  visit('batch_stats', model.batch_stats)
  return out


def _leaves(model: ModelState) -> List[Tuple[dict, str]]:
  return [(d, k) for _, d in _dicts(model) for k, v in d.items() if isinstance(v, np.ndarray)]


def _other_shape(rng: random.Random, a: np.ndarray) -> np.ndarray:
  options = [a[None], a.reshape(-1)[:-1], np.zeros((), a.dtype), np.concatenate([a, a])]
  if a.ndim > 1:
    options.append(a.reshape(-1))
    if a.shape[0] != a.shape[-1]:
      options.append(np.ascontiguousarray(a.T))
  return rng.choice(options)


BAD_DTYPES = [
  np.float64,
  np.float16,
  jnp.bfloat16,
  np.int32,
  np.int64,
  np.uint8,
  np.bool_,
  np.complex64,
  object,
  'U3',
]


MUTATIONS = (
  'dtype',
  'device_dtype',
  'shape',
  'nonfinite',
  'extra_key',
  'missing_key',
  'leaf',
  'non_array',
  'container',
  'rename',
  'whole',
  'num_samples',
)
WELL_FORMED = ('numpy', 'device', 'fortran', 'readonly', 'numpy_int')


def _mutate(rng: random.Random, model: ModelState) -> Tuple[Any, Any, str]:
  """(model, num_samples, what was done): one malformed upload."""
  kind = rng.choice(MUTATIONS + ('dtype', 'nonfinite', 'extra_key', 'leaf'))  # those twice
  leaves, dicts = _leaves(model), _dicts(model)
  num_samples: Any = rng.randint(1, MAX_SAMPLES)
  if kind == 'dtype':
    d, k = rng.choice(leaves)
    d[k] = d[k].astype(rng.choice(BAD_DTYPES))
  elif kind == 'device_dtype':
    d, k = rng.choice(leaves)
    d[k] = jnp.asarray(d[k], rng.choice([jnp.float16, jnp.bfloat16, jnp.int32]))
  elif kind == 'shape':
    d, k = rng.choice(leaves)
    d[k] = _other_shape(rng, d[k])
  elif kind == 'nonfinite':
    d, k = rng.choice(leaves)
    a = d[k].copy()
    a.reshape(-1)[rng.randrange(a.size)] = rng.choice([np.nan, np.inf, -np.inf])
    d[k] = a
  elif kind == 'extra_key':
    _, d = rng.choice(dicts)
    key = rng.choice(
      ['Dense_9', 'extra', 0, 1.5, None, (1, 2), b'k', True, frozenset(), MimicKey('x')]
    )
    d[key] = rng.choice([np.zeros(3, np.float32), _garbage(rng)])
  elif kind == 'missing_key':
    _, d = rng.choice([(n, d) for n, d in dicts if d])
    del d[rng.choice(list(d))]
  elif kind == 'leaf':
    d, k = rng.choice(leaves)
    d[k] = _garbage(rng)
  elif kind == 'container':
    _, d = rng.choice([(n, d) for n, d in dicts if '/' in n])  # params itself: 'whole'
    parent = next(p for _, p in dicts if any(v is d for v in p.values()))
    key = next(k for k, v in parent.items() if v is d)
    parent[key] = rng.choice(
      [
        lambda: flax.core.FrozenDict(d),
        lambda: collections.OrderedDict(d),
        lambda: collections.defaultdict(int, d),
        lambda: types.MappingProxyType(d),
        lambda: list(d.values()),
        lambda: tuple(d.values()),
        lambda: _garbage(rng),
      ]
    )()
  elif kind == 'rename':
    _, d = rng.choice([(n, d) for n, d in dicts if d])
    k = rng.choice(list(d))
    d[rng.choice([MimicKey(k), str(k).upper(), 0, RaisingKey()])] = d.pop(k)
  elif kind == 'whole':
    options = [
      lambda: _garbage(rng),
      lambda: (model.params, model.batch_stats),
      lambda: [model.params, model.batch_stats],
      lambda: {'params': model.params, 'batch_stats': model.batch_stats},
      lambda: model._replace(params=_garbage(rng)),
      lambda: model._replace(batch_stats=None),
      lambda: model._replace(params=flax.core.FrozenDict(model.params)),
    ]
    model = rng.choice(options)()
  elif kind == 'non_array':
    d, k = rng.choice(leaves)
    d[k] = rng.choice([PerfectArray(d[k]), d[k].tolist(), memoryview(d[k])])
  else:  # num_samples
    num_samples = rng.choice(
      [
        0,
        -3,
        MAX_SAMPLES + 1,
        10**30,
        1.0,
        float('nan'),
        '5',
        None,
        True,
        np.bool_(True),
        np.float32(5),
        np.uint64(2**64 - 1),
        fractions.Fraction(5),
        HostileInt(5),
        RaisingClass(),
        [5],
      ]
    )
  return model, num_samples, kind


def _well_formed(rng: random.Random, model: ModelState) -> Tuple[Any, Any, str]:
  variant = rng.choice(WELL_FORMED)
  if variant == 'device':
    model = jax.tree.map(jnp.asarray, model)
  elif variant == 'fortran':
    model = jax.tree.map(np.asfortranarray, model)
  elif variant == 'readonly':
    for a in jax.tree.leaves(model):
      a.flags.writeable = False
  n = np.int64(MAX_SAMPLES) if variant == 'numpy_int' else rng.randint(1, MAX_SAMPLES)
  return model, n, variant


def fuzz(count: int, seed: int) -> dict:
  """Validates `count` fuzzed uploads; counts by outcome, with the first examples of each
  failure."""
  rng = random.Random(seed)
  stats, kinds = collections.Counter(), collections.Counter()
  examples: dict = collections.defaultdict(list)
  for i in range(count):
    valid = rng.random() < 0.125
    model, num_samples, what = (_well_formed if valid else _mutate)(rng, _copy(TEMPLATE))
    kinds[what] += 1
    try:
      validate_model_upload(ModelUpload(i, num_samples, model), TEMPLATE, max_samples=MAX_SAMPLES)
      outcome = 'accepted' if valid else 'malformed_accepted'
    except UploadError as e:
      outcome = 'valid_refused' if valid else 'refused'
      if valid:
        examples['valid_refused'].append((what, str(e)))
      elif '\n' in str(e) or not str(e).startswith(f'upload of client {i}: '):
        outcome = 'unnamed_or_multiline_message'
        examples[outcome].append((what, str(e)))
    except Exception as e:  # anything but an UploadError is a crash
      outcome = 'crashed'
      examples['crashed'].append((what, f'{type(e).__name__}: {e}'))
    if outcome == 'malformed_accepted':
      examples[outcome].append(what)
    stats[outcome] += 1
  return {
    'stats': dict(stats),
    'kinds': dict(kinds),
    'examples': {k: v[:5] for k, v in examples.items() if v},
  }


def _assert_clean(result: dict, count: int) -> None:
  stats = result['stats']
  assert sum(stats.values()) == count
  for bad in ('crashed', 'malformed_accepted', 'valid_refused', 'unnamed_or_multiline_message'):
    assert stats.get(bad, 0) == 0, result
  assert stats['accepted'] > 0 and stats['refused'] > 0, result
  assert len(result['kinds']) == len(MUTATIONS) + len(WELL_FORMED), result['kinds']


def test_a_few_hundred_fuzzed_uploads_are_refused_or_accepted_never_crash():
  _assert_clean(fuzz(400, seed=38), 400)


@pytest.mark.slow
def test_ten_thousand_fuzzed_uploads_no_crash_and_no_malformed_accepted():
  _assert_clean(fuzz(10_000, seed=2026), 10_000)


def test_mixed_type_keys_are_an_upload_error():
  model = _copy(TEMPLATE)
  model.params['Dense_0'][0] = np.zeros(3, np.float32)
  with pytest.raises(
    UploadError, match=r"upload of client 1: .*unexpected params\['Dense_0'\]\[0\]"
  ):
    validate_model_upload(ModelUpload(1, 5, model), TEMPLATE)
  mimic = _copy(TEMPLATE)
  mimic.params['Dense_0'][MimicKey()] = mimic.params['Dense_0'].pop('bias')
  with pytest.raises(
    UploadError,
    match=r"params\['Dense_0'\] has the key 'bias' of type MimicKey, expected the str 'bias'",
  ):
    validate_model_upload(ModelUpload(1, 5, mimic), TEMPLATE)


def test_a_leaf_that_only_converts_to_an_array_is_refused():
  model = _copy(TEMPLATE)
  model.params['Dense_0']['bias'] = PerfectArray(model.params['Dense_0']['bias'])
  with pytest.raises(UploadError, match=r"params\['Dense_0'\]\['bias'\] is a PerfectArray"):
    validate_model_upload(ModelUpload(1, 5, model), TEMPLATE)


def test_an_upload_with_mixed_type_keys_is_dropped_and_the_round_goes_on(monkeypatch):
  """With on_invalid_upload=drop, the one hostile upload is excluded and counted; the others
  are aggregated (today such an upload stops the run with a ValueError)."""
  from jfed import engine
  from jfed.data import FederatedArrays
  from jfed.engine import aggregation, attacks
  from jfed.methods import common

  server = common.Server(
    aggregation.mean_aggregator(),
    attacks.AttackConfig('none', 0.0, '', 10.0),
    np.zeros(0, np.int64),
    jax.random.PRNGKey(0),
    'drop',
    0.0,
    np.full(3, 50),
  )
  stacked = jax.tree.map(lambda a: np.stack([a, a + 1, a + 2]), TEMPLATE)
  group = common.ClientGroup('cnn', None, np.arange(3), FederatedArrays(None, None, np.full(3, 9)))
  take = engine.take

  def hostile_take(tree, i):  # client 1 uploads params with an int key among the str ones
    one = take(tree, i)
    return one._replace(params={**one.params, 0: np.zeros(1, np.float32)}) if i == 1 else one

  monkeypatch.setattr(engine, 'take', hostile_take)
  model, record = server.receive(group, stacked, TEMPLATE, TEMPLATE, 0)
  assert record['rejected_clients'] == [1]
  np.testing.assert_allclose(
    model.params['Dense_0']['bias'], TEMPLATE.params['Dense_0']['bias'] + 1, rtol=1e-6
  )


# ---- the Flower bridge -----------------------------------------------------------------------
class _Reply:
  def __init__(self, content):
    self.content = content

  def has_error(self):
    return False


class _Grid:
  """One SuperNode that replies with the given arrays for clients 0 and 1."""

  def __init__(self, models, loss=(0.5, 0.5)):
    self.models, self.loss = models, list(loss)

  def get_node_ids(self):
    return [1]

  def send_and_receive(self, messages, timeout=None):
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    result = {
      'client_ids': [0, 1],
      'loss': self.loss,
      'accuracy': [0.5, 0.5],
      'seconds': 0.0,
      'num-examples': 10,
    }
    # Flower's record layout (jfed.flower.transport): 'metrics' and 'arrays'
    content = RecordDict(
      {'metrics': MetricRecord(result), 'arrays': ArrayRecord(numpy_ndarrays=self.models)}
    )
    return [_Reply(content)]


def _remote_train(models, **grid):
  pytest.importorskip('flwr')
  from jfed.data.federated import federate
  from jfed.engine.state import TrainState
  from jfed.flower import transport

  x = np.zeros((10, 2), np.float32)
  fed = federate(x, np.zeros(10, np.int32), [np.arange(5), np.arange(5, 10)])
  start = jax.tree.map(lambda a: np.stack([a, a]), TEMPLATE)

  class Transport(transport.FlowerTransport):
    def _exchange(self, content):  # no Flower run to address messages in
      return self.grid.send_and_receive([content])

  trainer = Transport(_Grid(models, **grid), 1).trainer(
    'cnn', None, {'kind': 'classifier'}, np.full(2, 5)
  )
  return trainer.train(TrainState(start, None), fed, 1, jax.random.PRNGKey(0))


def test_a_flower_reply_with_a_float64_leaf_is_refused_not_cast():
  leaves = [np.stack([a, a]) for a in jax.tree.leaves(TEMPLATE)]
  state, _ = _remote_train(leaves)  # a well-formed reply passes
  assert all(a.dtype == np.float32 for a in jax.tree.leaves(state.model))
  leaves[3] = leaves[3].astype(np.float64)
  name = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(TEMPLATE)[0][3][0])
  with pytest.raises(UploadError, match='^SuperNode reply for client 0: .* is float64'):
    _remote_train(leaves)
  assert name  # the leaf exists (its path is named in the message)


@pytest.mark.parametrize(
  'change, message',
  [
    (lambda leaves: leaves[:-1], r'carries 7 arrays, expected 8'),
    (lambda leaves: [a[:1] for a in leaves], r'has 1 rows, expected one per client \(2\)'),
    (lambda leaves: [np.zeros((), np.float32)] + leaves[1:], 'has 0 dimensions'),
  ],
  ids=['missing_leaf', 'missing_row', 'scalar'],
)
def test_a_malformed_flower_reply_is_an_upload_error(change, message):
  leaves = [np.stack([a, a]) for a in jax.tree.leaves(TEMPLATE)]
  with pytest.raises(UploadError, match=message):
    _remote_train(change(leaves))


def test_flower_reply_metrics_of_the_wrong_length_are_an_upload_error():
  leaves = [np.stack([a, a]) for a in jax.tree.leaves(TEMPLATE)]
  with pytest.raises(UploadError, match='loss has 3 values, expected 2'):
    _remote_train(leaves, loss=(0.1, 0.2, 0.3))
