"""Aggregators, server optimisers and attacks against their definitions (issue 10)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import optimize, stats

from jfed.engine import ModelState, attacks, server_optim
from jfed.engine.aggregation import AggregationConfig, make_aggregator, trimmed_mean_rows


def _config(rule='mean', **kw):
  base = dict(
    rule=rule,
    trim_fraction=0.1,
    krum_byzantine=1,
    krum_selected=1,
    geomed_iterations=200,
    geomed_smoothing=1e-9,
    clip_norm=0.0,
  )
  base.update(kw)
  return AggregationConfig(**base)


def _stack(rows):
  """Client k's model {'w': rows[k, :3] as [3], 'b': rows[k, 3:] as [.., 1]}, stacked."""
  rows = np.asarray(rows, np.float32)
  return ModelState({'w': jnp.asarray(rows[:, :3]), 'b': jnp.asarray(rows[:, 3:, None])}, {})


def _flat(model):
  return np.concatenate([np.ravel(model.params['w']), np.ravel(model.params['b'])])


def _aggregate(config, rows, weights=None, reference=None):
  rows = np.asarray(rows, np.float32)
  ref_rows = np.zeros((1, rows.shape[1])) if reference is None else np.asarray([reference])
  reference = jax.tree.map(lambda a: a[0], _stack(ref_rows))
  weights = np.ones(len(rows)) if weights is None else weights
  return _flat(make_aggregator(config).aggregate(_stack(rows), weights, reference))


RNG = np.random.default_rng(0)
FIVE = RNG.normal(size=(5, 5)).astype(np.float32)


def test_weighted_mean_is_numpys_average():
  w = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
  np.testing.assert_allclose(
    _aggregate(_config('mean'), FIVE, w), np.average(FIVE, axis=0, weights=w), rtol=1e-5
  )


def test_median_of_five_known_vectors():
  rows = [[1, 9, 0, 5, 2], [2, 8, 0, 4, 3], [3, 7, 100, 3, 4], [4, 6, -100, 2, 5], [5, 5, 0, 1, 6]]
  np.testing.assert_array_equal(_aggregate(_config('median'), rows), [3, 7, 0, 3, 4])
  np.testing.assert_allclose(_aggregate(_config('median'), FIVE), np.median(FIVE, axis=0))


@pytest.mark.parametrize('beta', [0.0, 0.1, 0.2, 0.3])
def test_trimmed_mean_equals_scipys_trim_mean(beta):
  rows = RNG.normal(size=(10, 5)).astype(np.float32)
  rows[3] = 1e6  # one outlier in every coordinate
  got = _aggregate(_config('trimmed_mean', trim_fraction=beta), rows)
  np.testing.assert_allclose(got, stats.trim_mean(rows, beta, axis=0), rtol=1e-5)


def test_trimmed_mean_that_drops_everyone_is_refused():
  with pytest.raises(ValueError, match=r'trim_fraction must be in \[0, 0.5\), got 0.5'):
    _aggregate(_config('trimmed_mean', trim_fraction=0.5), FIVE[:2])
  with pytest.raises(ValueError, match='drops every one'):  # the rows' function on its own
    trimmed_mean_rows(jnp.asarray(FIVE[:2], jnp.float32), 0.5)


def test_krum_picks_the_known_honest_client():
  honest = np.array([[0.0, 0, 0, 0, 0], [0.1, 0, 0, 0, 0], [-0.1, 0, 0, 0, 0], [0, 0.12, 0, 0, 0]])
  rows = np.concatenate([honest, [[50.0, -50, 50, -50, 50]]])
  # Scores (f = 1: K - f - 2 = 2 nearest others): client 0 is 0.01 + 0.01 from clients 1, 2.
  np.testing.assert_array_equal(_aggregate(_config('krum', krum_byzantine=1), rows), honest[0])
  # Multi-Krum (m = 3) averages the three best-scored: clients 0, 1, 2.
  got = _aggregate(_config('krum', krum_byzantine=1, krum_selected=3), rows, [1, 1, 2, 1, 1])
  np.testing.assert_allclose(got, np.average(honest[:3], axis=0, weights=[1, 1, 2]), atol=1e-7)


def test_krum_scores_by_brute_force():
  from jfed.engine.aggregation import krum_scores

  x = RNG.normal(size=(7, 4))
  f = 2
  want = []
  for i in range(7):
    d = sorted(np.sum((x[i] - x[j]) ** 2) for j in range(7) if j != i)
    want.append(sum(d[: 7 - f - 2]))
  np.testing.assert_allclose(krum_scores(jnp.asarray(x, jnp.float32), f), want, rtol=1e-5)


def test_geometric_median_of_symmetric_points_is_their_centre():
  c = np.array([1.0, -2.0, 3.0, 0.5, 0.0])
  e = np.eye(5)
  rows = np.concatenate([c + e[:2] * 3, c - e[:2] * 3])  # a square around c
  np.testing.assert_allclose(_aggregate(_config('geometric_median'), rows), c, atol=1e-5)


def test_geometric_median_minimises_the_weighted_sum_of_distances():
  rows = RNG.normal(size=(6, 5))
  rows[0] += 40.0
  w = np.array([1.0, 2, 1, 3, 1, 1])
  objective = lambda v: np.sum(w * np.linalg.norm(rows - v, axis=1))
  best = optimize.minimize(
    objective,
    rows.mean(0),
    method='Nelder-Mead',
    options={'xatol': 1e-10, 'fatol': 1e-12, 'maxiter': 40000, 'maxfev': 40000},
  )
  got = _aggregate(_config('geometric_median'), rows, w)
  assert objective(got) <= best.fun + 1e-4
  np.testing.assert_allclose(got, best.x, atol=2e-3)


@pytest.mark.parametrize('rule', ['mean', 'median', 'krum', 'geometric_median'])
def test_norm_clipping_bounds_every_update(rule):
  reference = np.full(5, 2.0, np.float32)
  rows = reference + RNG.normal(size=(5, 5)).astype(np.float32) * np.array(
    [[1], [10], [100], [0.01], [1000]], np.float32
  )
  got = _aggregate(_config(rule, clip_norm=0.5), rows, reference=reference)
  assert np.linalg.norm(got - reference) <= 0.5 + 1e-5
  if rule == 'mean':  # the mean of the clipped updates, computed by hand
    d = rows - reference
    clipped = d * np.minimum(1, 0.5 / np.linalg.norm(d, axis=1, keepdims=True))
    np.testing.assert_allclose(got, reference + clipped.mean(0), rtol=1e-5)


def test_aggregators_keep_structure_and_dtypes_with_batch_statistics():
  stacked = ModelState(
    {'k': jnp.arange(12.0).reshape(4, 3)}, {'bn': {'mean': jnp.arange(8.0).reshape(4, 2)}}
  )
  ref = jax.tree.map(lambda a: a[0], stacked)
  for rule in ('median', 'trimmed_mean', 'krum', 'geometric_median'):
    out = make_aggregator(_config(rule)).aggregate(stacked, np.ones(4), ref)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    assert all(
      a.shape == b.shape and a.dtype == b.dtype
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
    )
  np.testing.assert_allclose(
    make_aggregator(_config('median'))
    .aggregate(stacked, np.ones(4), ref)
    .batch_stats['bn']['mean'],
    [3.0, 4.0],
  )


# ---- server optimisers -----------------------------------------------------------------------

SERVER = dict(lr=0.1, momentum=0.9, b1=0.9, b2=0.99, eps=1e-3)


def _models(seed):
  r = np.random.default_rng(seed)
  return ModelState({'w': jnp.asarray(r.normal(size=(3, 2)), jnp.float32)}, {'s': jnp.ones(2)})


@pytest.mark.parametrize(
  'name, by_hand',
  [
    ('fedavgm', optax.sgd(0.1, momentum=0.9)),
    ('fedadam', optax.adam(0.1, b1=0.9, b2=0.99, eps=1e-3)),
    ('fedyogi', optax.yogi(0.1, b1=0.9, b2=0.99, eps=1e-3)),
    ('fedadagrad', optax.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-3)),
  ],
)
def test_server_optimiser_is_optax_on_the_pseudo_gradient(name, by_hand):
  tx = server_optim.make_server_optimizer(server_optim.ServerOptimizerConfig(name, **SERVER))
  model = _models(0)
  state, hand_params, hand_state = tx.init(model.params), model.params, by_hand.init(model.params)
  for r in range(3):
    aggregate = _models(r + 1)
    model, state = server_optim.server_update(tx, state, model, aggregate)
    grad = jax.tree.map(lambda g, a: g - a, hand_params, aggregate.params)
    updates, hand_state = by_hand.update(grad, hand_state, hand_params)
    hand_params = optax.apply_updates(hand_params, updates)
    np.testing.assert_allclose(model.params['w'], hand_params['w'], rtol=1e-6)
    assert model.batch_stats is aggregate.batch_stats  # statistics are not optimised


def test_fedavgm_is_heavy_ball_momentum_and_fedavg_is_the_aggregate():
  cfg = server_optim.ServerOptimizerConfig('fedavgm', **SERVER)
  tx = server_optim.make_server_optimizer(cfg)
  model = _models(0)
  state = tx.init(model.params)
  w, v = np.asarray(model.params['w'], np.float64), 0.0
  for r in range(3):
    aggregate = _models(r + 1)
    model, state = server_optim.server_update(tx, state, model, aggregate)
    v = 0.9 * v + (w - np.asarray(aggregate.params['w']))  # Hsu et al. 2019
    w = w - 0.1 * v
    np.testing.assert_allclose(model.params['w'], w, rtol=1e-5, atol=1e-7)
  plain = server_optim.make_server_optimizer(cfg._replace(name='fedavg'))
  out, _ = server_optim.server_update(plain, plain.init(model.params), model, _models(9))
  np.testing.assert_allclose(out.params['w'], _models(9).params['w'], rtol=1e-6)


# ---- attacks ---------------------------------------------------------------------------------


def test_model_attacks_rewrite_only_the_attackers_uploads():
  stacked, reference = _stack(FIVE), jax.tree.map(lambda a: a[0] * 0 + 1.0, _stack(FIVE))
  attacking = np.array([False, True, False, False, True])
  ref = _flat(reference)
  key = jax.random.PRNGKey(0)

  def rows(kind, s):
    out = attacks.poison_uploads(kind, s, stacked, reference, attacking, key)
    return np.stack([_flat(jax.tree.map(lambda a, i=i: a[i], out)) for i in range(5)])

  flipped = rows('sign_flip', 10.0)
  np.testing.assert_allclose(flipped[attacking], ref - 10 * (FIVE[attacking] - ref), rtol=1e-5)
  np.testing.assert_array_equal(flipped[~attacking], FIVE[~attacking])
  scaled = rows('scaling', 3.0)
  np.testing.assert_allclose(scaled[attacking], ref + 3 * (FIVE[attacking] - ref), rtol=1e-5)
  np.testing.assert_array_equal(rows('same_value', 7.0)[attacking], np.full((2, 5), 7.0))
  noisy = attacks.poison_uploads(
    'noise',
    2.0,
    ModelState({'w': jnp.zeros((5, 20000))}, {}),
    ModelState({'w': jnp.zeros(20000)}, {}),
    attacking,
    key,
  )
  w = np.asarray(noisy.params['w'])
  assert abs(w[1].std() - 2.0) < 0.05 and abs(w[1].mean()) < 0.05 and not (w[1] == w[4]).all()
  assert (w[~attacking] == 0).all()


def test_attackers_are_seeded_or_named_and_labels_flip():
  cfg = attacks.AttackConfig('sign_flip', 0.2, '', 10.0)
  a = attacks.attacker_ids(cfg, 20, jax.random.PRNGKey(1))
  assert len(a) == 4 and len(set(a.tolist())) == 4
  np.testing.assert_array_equal(a, attacks.attacker_ids(cfg, 20, jax.random.PRNGKey(1)))
  assert not np.array_equal(a, attacks.attacker_ids(cfg, 20, jax.random.PRNGKey(2)))
  named = cfg._replace(clients='3, 1', fraction=0.0)
  np.testing.assert_array_equal(attacks.attacker_ids(named, 20, jax.random.PRNGKey(1)), [1, 3])
  # the library refuses what the command line refuses: a list and a fraction together
  with pytest.raises(ValueError, match="attack.clients='3, 1' and attack.fraction=0.2 both"):
    attacks.attacker_ids(cfg._replace(clients='3, 1'), 20, jax.random.PRNGKey(1))
  with pytest.raises(ValueError, match='attack.strength=-1 is negative'):
    attacks.attacker_ids(cfg._replace(strength=-1.0), 20, jax.random.PRNGKey(1))
  assert len(attacks.attacker_ids(cfg._replace(kind='none'), 20, jax.random.PRNGKey(1))) == 0
  with pytest.raises(ValueError, match="'20' is not a client id"):
    attacks.parse_client_ids('1,20', 20)
  np.testing.assert_array_equal(attacks.flip_labels(np.array([0, 3, 9]), 10), [9, 6, 0])


# ---- edge cases found by mutation testing (/tmp/agent_notes/aggregation_survivors.md) ----------


def test_trimmed_mean_keeps_one_middle_client_of_three():
  # K = 3, beta = 0.4: floor(1.2) = 1 dropped per side, the middle value (the median) remains.
  rows = np.array([[1.0, 5, 0, 2, 9], [2.0, 3, 0, 7, 8], [4.0, 4, 1, 3, 7]])
  got = _aggregate(_config('trimmed_mean', trim_fraction=0.4), rows)
  np.testing.assert_array_equal(got, [2, 4, 0, 3, 8])


def test_multi_krum_keeping_every_client_is_the_weighted_mean():
  rows = RNG.normal(size=(5, 4)).astype(np.float32)  # K = 5 clients wider than D = 4
  w = np.array([1.0, 2, 3, 4, 5])
  got = _aggregate(_config('krum', krum_byzantine=1, krum_selected=5), rows, w)
  np.testing.assert_allclose(got, np.average(rows, axis=0, weights=w), rtol=1e-5)


def test_krum_refuses_bad_counts_with_their_numbers():
  rows = RNG.normal(size=(4, 5)).astype(np.float32)  # K = 4 clients, D = 5
  with pytest.raises(ValueError, match=r'multi-Krum keeps 1\.\.4 clients, got 5'):
    _aggregate(_config('krum', krum_byzantine=1, krum_selected=5), rows)
  with pytest.raises(ValueError, match=r'Krum needs K > f \+ 2; got K=4 clients and f=2'):
    _aggregate(_config('krum', krum_byzantine=2), rows)


def test_unknown_rule_is_refused_with_the_valid_ones():
  with pytest.raises(
    ValueError,
    match=r"aggregation.rule is 'bogus'; valid: mean, median, trimmed_mean, krum, "
    r'geometric_median$',
  ):
    make_aggregator(_config('bogus'))


@pytest.mark.parametrize('iterations', [1, 2])
def test_geometric_median_runs_exactly_the_configured_weiszfeld_steps(iterations):
  rows = RNG.normal(size=(5, 5))
  w = np.array([1.0, 2, 3, 4, 5])
  v = np.average(rows, axis=0, weights=w)  # Weiszfeld starts from the weighted mean
  for _ in range(iterations):
    beta = w / np.linalg.norm(rows - v, axis=1)
    v = beta @ rows / beta.sum()
  got = _aggregate(_config('geometric_median', geomed_iterations=iterations), rows, w)
  np.testing.assert_allclose(got, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('clip_norm', [0.0, 1e6])
def test_half_precision_weights_are_normalised_in_float32(clip_norm):
  # 1/3 is 0.33325 in float16: normalising there would give a mean of 0.99976, not 1.
  rows = np.ones((3, 5), np.float32)
  got = _aggregate(_config('mean', clip_norm=clip_norm), rows, np.ones(3, np.float16))
  np.testing.assert_allclose(got, np.ones(5), rtol=1e-6)


@pytest.mark.parametrize('rule, clip_norm', [('mean', 0.0), ('mean', 1e6), ('median', 0.0)])
def test_bfloat16_models_come_back_in_bfloat16(rule, clip_norm):
  stacked = ModelState({'w': jnp.arange(12.0, dtype=jnp.bfloat16).reshape(4, 3)}, {})
  ref = jax.tree.map(lambda a: a[0], stacked)
  out = make_aggregator(_config(rule, clip_norm=clip_norm)).aggregate(stacked, np.ones(4), ref)
  assert out.params['w'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out.params['w'], np.float32), [4.5, 5.5, 6.5])


@pytest.mark.parametrize(
  'rule, clip_norm, name',
  [
    ('mean', 0.0, 'mean'),
    ('mean', 0.5, 'mean+clip(0.5)'),
    ('krum', 0.0, 'krum'),
    ('krum', 0.5, 'krum+clip(0.5)'),
    ('median', 2.0, 'median+clip(2)'),
  ],
)
def test_aggregator_names_record_rule_and_clipping(rule, clip_norm, name):
  assert make_aggregator(_config(rule, clip_norm=clip_norm)).name == name


def test_a_trimmed_mean_that_trims_none_of_its_uploads_says_so_with_its_numbers(caplog):
  """Fewer uploads than the config check saw (rejected ones, a small FedTSA cluster) can leave a
  trimmed mean trimming nothing: it is then the plain mean, and a warning names the fraction and
  the count; one that trims says nothing."""
  caplog.set_level(logging.WARNING, logger='absl')
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
  np.testing.assert_allclose(trimmed_mean_rows(x, 0.2), np.mean(np.asarray(x), 0), rtol=1e-6)
  assert [r.getMessage() for r in caplog.records] == [
    'trimmed mean with trim_fraction=0.2 trims none of 4 uploads: this aggregate is the plain mean'
  ]
  caplog.clear()
  want = np.mean(np.sort(np.asarray(x), 0)[1:3], 0)
  np.testing.assert_allclose(trimmed_mean_rows(x, 0.25), want, rtol=1e-6)
  assert not caplog.records


def test_the_library_refuses_what_the_command_line_refuses():
  """`make_aggregator` runs the run-config checks (`aggregation.config_problem`): the no-op
  trimmed mean and Krum without its guarantee (given the uploads per aggregation), and a clip
  norm so small that every update vanishes in float32 (issue 85: 1e-30 froze training)."""
  with pytest.raises(ValueError, match='trimmed mean would be the plain mean'):
    make_aggregator(_config('trimmed_mean', trim_fraction=0.1), num_uploads=5)
  with pytest.raises(ValueError, match='2f'):
    make_aggregator(_config('krum', krum_byzantine=1), num_uploads=4)
  with pytest.raises(ValueError, match=r'aggregation.clip_norm=1e-30 is below 1e-06'):
    make_aggregator(_config('mean', clip_norm=1e-30))
  assert make_aggregator(_config('trimmed_mean', trim_fraction=0.2), num_uploads=5).name
  assert make_aggregator(_config('mean', clip_norm=1e-6)).name == 'mean+clip(1e-06)'
