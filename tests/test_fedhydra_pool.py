"""FedHydra's bounded KD pool (`fedhydra.pool_limit`, issue 80): a uniform reservoir
(`jfed.distill.pool_reservoir_add`, Vitter's algorithm R) in place of the paper's unbounded pool.

The reservoir's size and uniformity on synthetic streams; then on digits (the `smoke` budget, an
MLP student): pool_limit=0 is the unbounded pool bit for bit, the reservoir's stored KD targets
are those of its images, and an interrupted run resumes to the uninterrupted one's pool and
accuracy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver
from jfed.configs import fedhydra_digits
from jfed.distill import kd
from jfed.distill import pool as P
from jfed.errors import ConfigError
from jfed.methods import oneshot
from tests.support import (
  Interrupted,
  comparable_summary,
  interrupt_after,
  override,
  read_metrics,
)

# ---------------------------------------------------------------------- the reservoir itself

# A stream of 64 images in batches of these sizes: two exceed the reservoir, one straddles its
# filling, so that several images of one batch can draw the same slot.
BATCHES = (5, 9, 20, 3, 25, 2)
STREAM = sum(BATCHES)
SIZE = 16


def _stream(key, size=SIZE, batches=BATCHES, add=P.pool_reservoir_add):
  """The labels the pool holds after each batch of a stream whose image i has label i (and
  pixel value i / STREAM), and the pools; `add` the insertion rule under test."""
  pool = P.pool_init(size, (1, 1, 1))
  start, pools = 0, []
  for b, n in enumerate(batches):
    labels = jnp.arange(start, start + n, dtype=jnp.int32)
    images = (labels / STREAM).astype(jnp.float32).reshape(n, 1, 1, 1)
    pool, _ = add(pool, images, labels, jax.random.fold_in(key, b))
    pools.append(pool)
    start += n
  return pools


def test_a_reservoir_holds_min_of_its_size_and_the_images_seen():
  for seed in range(10):
    pools = _stream(jax.random.key(seed))
    seen = np.cumsum(BATCHES)
    ring = P.pool_init(SIZE, (1, 1, 1))
    start = 0
    for pool, s, n in zip(pools, seen, BATCHES):
      held = int(P.pool_size(pool))
      labels = np.asarray(pool.labels)[:held]
      assert int(pool.count) == s and held == min(SIZE, s)
      # every filled slot holds one distinct image seen so far, its own pixel beside its label
      assert len(set(labels.tolist())) == held and labels.min() >= 0 and labels.max() < s
      np.testing.assert_allclose(np.asarray(pool.images)[:held, 0, 0, 0], labels / STREAM)
      assert (np.asarray(pool.labels)[held:] == -1).all()
      if s <= SIZE:  # while the stream fits, exactly the ring buffer
        new = jnp.arange(start, start + n, dtype=jnp.int32)
        ring = P.pool_add(ring, (new / STREAM).astype(jnp.float32).reshape(n, 1, 1, 1), new)
        jax.tree.map(np.testing.assert_array_equal, pool, ring)
      start += n


def test_the_slots_it_returns_are_where_the_kept_images_went():
  pool = P.pool_init(SIZE, (1, 1, 1), quantize=True)
  pool, _ = P.pool_reservoir_add(pool, jnp.zeros((30, 1, 1, 1)), jnp.arange(30), jax.random.key(0))
  labels = jnp.arange(30, 70)
  images = jnp.linspace(0, 1, 40).reshape(40, 1, 1, 1)
  before = np.asarray(pool.labels)
  after, slots = P.pool_reservoir_add(pool, images, labels, jax.random.key(1))
  slots = np.asarray(slots)
  kept = slots < SIZE
  assert after.images.dtype == jnp.uint8 and kept.any() and not kept.all()
  assert len(set(slots[kept].tolist())) == kept.sum()  # one image per slot
  np.testing.assert_array_equal(np.asarray(after.labels)[slots[kept]], np.asarray(labels)[kept])
  np.testing.assert_array_equal(
    np.asarray(after.images)[slots[kept]], np.asarray(P.quantize_uint8(images))[kept]
  )
  untouched = np.setdiff1d(np.arange(SIZE), slots[kept])
  np.testing.assert_array_equal(np.asarray(after.labels)[untouched], before[untouched])
  # the same key on the same pool makes the same pool
  again, _ = P.pool_reservoir_add(pool, images, labels, jax.random.key(1))
  jax.tree.map(np.testing.assert_array_equal, again, after)


# Biased rules the uniformity test must reject.
def _keep_first(pool, images, labels, key):
  n, t = images.shape[0], pool.count + jnp.arange(images.shape[0])
  slots = jnp.where(t < pool.capacity, t, pool.capacity)
  return _write(pool, images, labels, slots, n)


def _keep_last(pool, images, labels, key):  # the ring buffer
  n, t = images.shape[0], pool.count + jnp.arange(images.shape[0])
  slots = t % pool.capacity
  keep = t >= pool.count + n - pool.capacity  # a batch longer than the pool: its last images
  return _write(pool, images, labels, jnp.where(keep, slots, pool.capacity), n)


def _draw_below_t(pool, images, labels, key):
  """Algorithm R with an off-by-one draw: j uniform in [0, t) instead of [0, t]."""
  n, t = images.shape[0], pool.count + jnp.arange(images.shape[0])
  draw = jax.random.randint(key, (n,), 0, jnp.maximum(t, 1))
  slot = jnp.where(t < pool.capacity, t, draw)
  last = jnp.full((pool.capacity,), -1).at[slot].max(jnp.arange(n), mode='drop')
  kept = (slot < pool.capacity) & (last[jnp.minimum(slot, pool.capacity - 1)] == jnp.arange(n))
  return _write(pool, images, labels, jnp.where(kept, slot, pool.capacity), n)


def _write(pool, images, labels, slots, n):
  return (
    P.ImagePool(
      pool.images.at[slots].set(images, mode='drop'),
      pool.labels.at[slots].set(labels, mode='drop'),
      pool.count + n,
    ),
    slots,
  )


STREAMS = 20000
# Under the null each image's count over the streams is Binomial(STREAMS, SIZE / STREAM): a
# deviation of Z standard deviations has two-sided probability about 2e-9 per image, 1.3e-7 for
# any of the 64 (Bonferroni). The sums over each run of SIZE images use the binomial variance,
# which bounds theirs (a stream keeps exactly SIZE images: its counts are negatively
# correlated). The off-by-one rule below sits about 15 standard deviations off in its first run.
Z = 6.0


def _inclusion_counts(add) -> np.ndarray:
  """How often each image of the stream is in the final pool, over STREAMS seeded streams."""
  keys = jax.random.split(jax.random.key(80), STREAMS)
  final = jax.jit(jax.vmap(lambda k: _stream(k, add=add)[-1].labels))(keys)
  return np.bincount(np.asarray(final).ravel(), minlength=STREAM)[:STREAM]


def _uniform(counts: np.ndarray) -> bool:
  """Whether every image, and every run of SIZE images of the stream, is kept as often as
  probability SIZE / STREAM makes likely (within Z standard deviations)."""
  p = SIZE / STREAM
  z = (counts - STREAMS * p) / np.sqrt(STREAMS * p * (1 - p))
  runs = counts.reshape(-1, SIZE).sum(1)
  z_runs = (runs - STREAMS * SIZE * p) / np.sqrt(STREAMS * SIZE * p * (1 - p))
  return bool(np.abs(z).max() < Z and np.abs(z_runs).max() < Z)


def test_every_image_of_the_stream_is_kept_with_probability_size_over_seen():
  counts = _inclusion_counts(P.pool_reservoir_add)
  assert counts.sum() == STREAMS * SIZE
  assert _uniform(counts), counts
  # the test has the power to see biased rules: the first or last SIZE images, and algorithm R
  # drawing from [0, t) (the first SIZE images kept with probability 15/63, the rest 16/63)
  for biased in (_keep_first, _keep_last, _draw_below_t):
    assert not _uniform(_inclusion_counts(biased)), biased.__name__


# ---------------------------------------------------------------------- FedHydra with a reservoir

EPOCHS = 3
PER_EPOCH = 64  # smoke: T_G = 2 generator steps on 32 images, every one kept
LIMIT = 100  # the stream of 192 images overflows it from epoch 2 on


@pytest.fixture(scope='module')
def local_dir(tmp_path_factory):
  """One set of client models shared by every run of this module."""
  return str(tmp_path_factory.mktemp('pool') / 'local_models')


def _config(local_dir, **overrides):
  c = fedhydra_digits.get_config('smoke')
  return override(
    c,
    **{
      'model': 'mlp',
      'local_models_dir': local_dir,
      'fedhydra.epochs': EPOCHS,
      **overrides,
    },
  )


def _steps(config, check_targets=False):
  """Every epoch of a run, step by step: the synthesised batches, the records, the final state.
  With check_targets, each epoch's stored KD targets are checked against a fresh computation
  over the whole pool."""
  algorithm = driver.build_algorithm('fedhydra', config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  state = algorithm.init(ctx, aux)
  synthesised, records = [], []
  synthesize = oneshot.synthesize

  def recording(*args, **kwargs):
    res = synthesize(*args, **kwargs)
    synthesised.append((res.images, res.labels))
    return res

  with pytest.MonkeyPatch.context() as m:
    m.setattr(oneshot, 'synthesize', recording)
    for i in range(EPOCHS):
      state, rec = algorithm.step(ctx, aux, state, i)
      records += rec
      if check_targets:
        stored = aux.kd_targets
        rd = algorithm.round(ctx, aux, 1)
        aux.kd_targets = None
        s = aux.settings
        programs = kd.KDPrograms(
          s.kd, s.opt, tuple(t.module for t in rd.teachers), aux.student_module
        )
        teachers = kd.Teachers(
          tuple(t.states for t in rd.teachers), algorithm.recipe.kd_agg(state, rd)
        )
        fresh = algorithm._pool_targets(aux, 1, state.pool, programs, teachers)  # pylint: disable=protected-access
        held = int(P.pool_size(state.pool))
        np.testing.assert_array_equal(np.asarray(stored.logits)[:held], np.asarray(fresh)[:held])
        aux.kd_targets = stored
  return synthesised, records, state


def _no_reservoir(*args, **kwargs):
  raise AssertionError('pool_limit=0 must not use the reservoir')


def test_pool_limit_zero_is_the_unbounded_pool_bit_for_bit(local_dir, monkeypatch):
  """The default keeps the old pool: every synthesised image appended by `pool_add` to a pool of
  epochs × T_G × batch images (the code before pool_limit), never the reservoir; a reservoir
  the stream never fills is the same pool and the same run."""
  with monkeypatch.context() as m:
    m.setattr(oneshot, 'pool_reservoir_add', _no_reservoir)
    synthesised, records, state = _steps(_config(local_dir))
  old = P.pool_init(EPOCHS * PER_EPOCH, (8, 8, 1), quantize=True)
  for images, labels in synthesised:
    old = P.pool_add(old, images, labels)
  jax.tree.map(np.testing.assert_array_equal, state.pool, old)
  assert [r['pool_size'] for r in records] == [64, 128, 192]
  _, big_records, big = _steps(_config(local_dir, **{'fedhydra.pool_limit': EPOCHS * PER_EPOCH}))
  jax.tree.map(np.testing.assert_array_equal, big.pool, old)
  assert big_records == records


def test_a_reservoir_bounds_the_pool_and_its_targets_are_those_of_its_images(local_dir):
  synthesised, records, state = _steps(
    _config(local_dir, **{'fedhydra.pool_limit': LIMIT}), check_targets=True
  )
  pool = state.pool
  assert pool.capacity == LIMIT and int(pool.count) == EPOCHS * PER_EPOCH
  assert pool.images.dtype == jnp.uint8 and pool.images.nbytes == LIMIT * 8 * 8
  assert [r['pool_size'] for r in records] == [64, LIMIT, LIMIT]
  assert [r['kd_steps'] for r in records] == [2, 4, 4]  # ⌈100 / 32⌉ once full
  # every held image is one of the stream's, stored where the reservoir put it
  stream = np.concatenate([np.asarray(P.quantize_uint8(x)) for x, _ in synthesised])
  held = np.asarray(pool.images)
  matches = [np.flatnonzero((stream == held[s]).all(axis=(1, 2, 3))) for s in range(LIMIT)]
  assert all(len(m) for m in matches)
  # and images of later epochs displaced some of the first epoch's
  first_epoch = sum(bool((m < PER_EPOCH).all()) for m in matches)
  assert first_epoch < PER_EPOCH


def test_a_reservoirs_scattered_slots_are_computed_at_their_rows_in_few_blocks():
  """The written slots of a reservoir epoch, each at its row of its aligned block of 8, in as
  many blocks as the most frequent row needs; the other rows name no slot (the capacity)."""
  slots = np.array([3, 11, 19, 4, 40, 47, 0])  # rows 3, 3, 3, 4, 0, 7, 0
  blocks = oneshot._scattered_blocks(slots, 8, 50)  # pylint: disable=protected-access
  assert blocks.shape == (3, 8)
  held = blocks[blocks < 50]
  assert sorted(held.tolist()) == sorted(slots.tolist())
  rows = np.nonzero(blocks < 50)[1]
  np.testing.assert_array_equal(held % 8, rows)
  assert oneshot._scattered_blocks(np.array([], int), 8, 50).shape == (0, 8)  # pylint: disable=protected-access


def test_an_interrupted_run_resumes_to_the_same_pool_and_accuracy(tmp_path, local_dir):
  config = _config(local_dir, **{'fedhydra.pool_limit': LIMIT})
  pools = {}
  step = oneshot.DistillationAlgorithm.step

  def recording(run):
    def wrapped(self, ctx, aux, state, i):
      state, rec = step(self, ctx, aux, state, i)
      pools[run, i] = jax.tree.map(np.asarray, state.pool)
      return state, rec

    return wrapped

  with pytest.MonkeyPatch.context() as m:
    m.setattr(oneshot.DistillationAlgorithm, 'step', recording('whole'))
    whole = driver.run_experiment('fedhydra', config, tmp_path / 'whole', progress=False)
  with pytest.MonkeyPatch.context() as m:
    interrupt_after(m, 2)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedhydra', config, tmp_path / 'killed', progress=False)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(oneshot.DistillationAlgorithm, 'step', recording('resumed'))
    resumed = driver.run_experiment('fedhydra', config, tmp_path / 'killed', progress=False)
  assert sorted(i for run, i in pools if run == 'resumed') == [EPOCHS - 1]  # only the last
  last = EPOCHS - 1
  assert int(pools['whole', last].count) > LIMIT  # the draws of the resumed epoch mattered
  jax.tree.map(np.testing.assert_array_equal, pools['resumed', last], pools['whole', last])
  assert resumed.final_test_accuracy == whole.final_test_accuracy
  assert read_metrics(tmp_path / 'killed') == read_metrics(tmp_path / 'whole')
  assert comparable_summary(resumed) == comparable_summary(whole)
  assert whole.as_dict()['pool_capacity'] == LIMIT


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'fedhydra.pool_limit': -1}, 'fedhydra.pool_limit must be >= 0, got -1'),
    (
      {'fedhydra.pool_limit': 10, 'fedhydra.kd_data': 'batch'},
      "fedhydra.pool_limit: a reservoir needs kd_data='pool' (kd_data='batch' keeps one epoch)",
    ),
  ],
)
def test_a_pool_limit_it_cannot_honour_is_refused_in_one_line(overrides, message, local_dir):
  with pytest.raises(ConfigError) as refused:
    driver.build_algorithm('fedhydra', _config(local_dir, **overrides))
  assert str(refused.value) == message
