"""Differential privacy of FedAvg / FedProx (jfed/engine/privacy.py, jfed/methods/fedavg.py).

Every expected value is computed here independently of jfed: the clipping and the DP mean in
NumPy, the noise scale against its formula (z·C/m on the averaged update) over many draws, the
adaptive clip norm by Andrew et al.'s geometric update, and ε against dp-accounting called
directly and against the values TF Privacy published, reproduced from a NumPy implementation of
the sampled Gaussian's Rényi DP (Mironov, Talwar and Zhang 2019, integer orders).

The runs use tests/test_oracle_fedavg.py's tiny problem (96 digits, clients of 23, 41 and 12
images, a 10-unit MLP). With `fedavg.reuse_local_models` the clients' models are given, so the
server's DP mean can be checked to the last bit of its noise.
"""

import json
import math
import re
import types
from typing import Any, NamedTuple

import dp_accounting
from dp_accounting import rdp
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import gammaln, logsumexp

from jfed import engine
from jfed.driver import build_algorithm, run
from jfed.engine import privacy
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common, fedavg
from tests.support import Interrupted, comparable_summary, interrupt_after, read_metrics
from tests.test_oracle_fedavg import NARROW, _config, _context, _dataset, _run

DELTA = 1e-5


def _dp(**dp):
  """The tiny problem's config with DP on; `dp` sets keys of the dp section."""
  # reproducible noise (from the seed) unless a test asks for the default, the OS's randomness
  dp = {'reproducible_noise': True, **dp}
  overrides = {'dp.enabled': True, **{f'dp.{k}': v for k, v in dp.items()}}
  return overrides


# ---------------------------------------------------------------------------------------------
# (a) clipping
# ---------------------------------------------------------------------------------------------


def test_updates_above_the_clip_norm_are_scaled_to_it_and_the_others_kept():
  rng = np.random.default_rng(0)
  reference = rng.normal(size=50).astype(np.float32)
  directions = rng.normal(size=(6, 50))
  lengths = np.array([0.1, 0.5, 0.99, 1.01, 3.0, 40.0])
  x = reference + directions / np.linalg.norm(directions, axis=1)[:, None] * lengths[:, None]
  clipped, norms = privacy.clip_updates(
    jnp.asarray(x, jnp.float32), jnp.asarray(reference), jnp.float32(1.0)
  )
  delta = x - reference
  want = np.stack([d if np.linalg.norm(d) <= 1.0 else d / np.linalg.norm(d) for d in delta])
  np.testing.assert_allclose(np.asarray(clipped), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(norms), lengths, rtol=1e-5)
  out = np.linalg.norm(np.asarray(clipped), axis=1)
  np.testing.assert_allclose(out[3:], 1.0, rtol=1e-5)  # the long ones now have norm C
  np.testing.assert_allclose(out[:3], lengths[:3], rtol=1e-5)  # the short ones as they were


def _given_client_models(config, lengths, seed=0):
  """Client models init + Δ_k with ‖Δ_k‖ = lengths[k] (random directions), as the run's one-shot
  local-models stage; returns (stacked ModelState, init ModelState, [Δ_k flat])."""
  ctx = _context(config)
  module = common.build_module(NARROW, _dataset())
  init = engine.init_model(module, _dataset().input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
  flat, unravel = ravel_pytree(init)
  rng = np.random.default_rng(seed)
  deltas = []
  for length in lengths:
    d = rng.normal(size=flat.shape)
    deltas.append(d / np.linalg.norm(d) * length)
  models = engine.stack([unravel(jnp.asarray(flat + d, jnp.float32)) for d in deltas])
  return models, init, deltas


@pytest.mark.parametrize('accepted', [(0, 1, 2), (0, 1), ()])
def test_the_server_mean_is_the_clipped_updates_plus_noise_over_the_clients_per_round(accepted):
  # DP-FedAvg's fixed-denominator estimator with the clients counted equally (not by size):
  # θ_1 = θ_0 + (Σ_k clip(Δ_k, C) + N(0, (z C)² I)) / m, the noise from the documented key.
  # An upload the server rejects (here by its norm bound) adds nothing, m stays 3; a round whose
  # uploads were all rejected still releases the noise.
  z, clip, lengths = 0.5, 1.0, [0.3, 2.0, 5.0]
  config = _config(
    3, **{'fedavg.reuse_local_models': True, **_dp(noise_multiplier=z, clip_norm=clip)}
  )
  models, init, deltas = _given_client_models(config, lengths)
  flat0, unravel = ravel_pytree(init)
  if len(accepted) < 3:  # reject ‖Δ‖ > ratio ‖θ_0‖: the longest, or every one
    bound = 3.0 if accepted else 0.1
    config.server.max_update_norm_ratio = bound / float(jnp.linalg.norm(flat0))
    config.server.allow_empty_rounds = True
  _, rec, ctx = _run('fedavg', config, local_models=[models])
  key = jax.random.fold_in(ctx.derive_key(Purpose.PRIVACY, 0), privacy.UPDATE_NOISE)
  noise = z * clip * np.asarray(jax.random.normal(key, flat0.shape, jnp.float32), np.float64)
  clipped = [deltas[k] * min(1.0, clip / np.linalg.norm(deltas[k])) for k in accepted]
  want = np.asarray(flat0, np.float64) + (np.sum(clipped + [0 * noise], axis=0) + noise) / 3
  got = np.asarray(ravel_pytree(rec.states[0].model)[0], np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
  (record,) = rec.records[0]
  assert record['dp_clip_norm'] == clip and record['rejected_uploads'] == 3 - len(accepted)


# ---------------------------------------------------------------------------------------------
# (b) the noise scale
# ---------------------------------------------------------------------------------------------


def test_the_server_noise_on_the_averaged_update_has_std_z_c_over_m():
  # 40,000 coordinates of one draw, and 5 draws: the sample std of the noise on the mean update
  # is within 2 % of z·C/m (its standard error is 0.16 %), its mean within 4 standard errors of 0
  z, clip, m, d = 1.3, 0.7, 4, 40_000
  reference = {'w': jnp.zeros((d,), jnp.float32)}
  stacked = {'w': jnp.zeros((m, d), jnp.float32)}  # no update: the output is the noise alone
  draws = []
  for seed in range(5):
    noise = privacy.RoundNoise(
      jax.random.PRNGKey(seed), jnp.float32(clip), jnp.float32(z * clip), jnp.float32(0), m
    )
    out, _ = privacy.central_aggregate(stacked, reference, noise)
    draws.append(np.asarray(out['w'], np.float64))
  draws = np.stack(draws)
  want = z * clip / m
  assert np.std(draws) == pytest.approx(want, rel=0.02)
  assert abs(np.mean(draws)) < 4 * want / math.sqrt(draws.size)
  assert abs(np.corrcoef(draws[0], draws[1])[0, 1]) < 0.02  # each round its own draw


def test_a_round_with_fewer_clients_than_the_population_divides_by_its_clients_per_round():
  # participation 2/3 of 3 clients: m = 2. At z = 1000 the clipped updates (norm <= C) vanish
  # beside the noise, so the global model moves by the noise alone: std z·C/2 per coordinate,
  # not z·C/3. 870 coordinates: a 10 % tolerance is 4 standard errors.
  z, clip = 1000.0, 1e-3
  config = _config(3, **{'fedavg.participation': 2 / 3, **_dp(noise_multiplier=z, clip_norm=clip)})
  _, rec, ctx = _run('fedavg', config)
  module = common.build_module(NARROW, _dataset())
  init = engine.init_model(module, _dataset().input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
  moved = np.asarray(ravel_pytree(rec.states[0].model)[0] - ravel_pytree(init)[0])
  assert np.std(moved) == pytest.approx(z * clip / 2, rel=0.1)


def test_local_dp_noises_each_upload_with_std_z_c_and_independently_per_client():
  z, clip, d = 0.8, 2.0, 30_000
  reference = {'w': jnp.zeros((d,), jnp.float32)}
  far = np.zeros((3, d), np.float32)
  far[2, 0] = 10.0  # client 2's update is clipped to norm C before its noise
  out = privacy.privatize_locally(
    {'w': jnp.asarray(far)},
    reference,
    jax.random.PRNGKey(0),
    jnp.asarray([4, 7, 9]),
    jnp.float32(clip),
    jnp.float32(z),
  )['w']
  out = np.asarray(out, np.float64)
  for row in out:
    assert np.std(row[1:]) == pytest.approx(z * clip, rel=0.02)
  assert abs(np.corrcoef(out[0], out[1])[0, 1]) < 0.03
  quiet = privacy.privatize_locally(
    {'w': jnp.asarray(far)},
    reference,
    jax.random.PRNGKey(0),
    jnp.asarray([4, 7, 9]),
    jnp.float32(clip),
    jnp.float32(1e-7),
  )['w']
  assert float(quiet[2, 0]) == pytest.approx(clip, abs=1e-4)  # 10 clipped to C = 2
  assert float(jnp.max(jnp.abs(quiet[:2]))) < 1e-4


# ---------------------------------------------------------------------------------------------
# (c) the accountant
# ---------------------------------------------------------------------------------------------


def _sampled_gaussian_rdp(q: float, z: float, order: int) -> float:
  """RDP of order α (integer) of the Poisson-subsampled Gaussian (Mironov, Talwar and Zhang
  2019, Sec. 3.3): log(Σ_k C(α, k) (1−q)^(α−k) q^k exp((k² − k) / 2z²)) / (α − 1)."""
  k = np.arange(order + 1)
  log_binom = gammaln(order + 1) - gammaln(k + 1) - gammaln(order - k + 1)
  terms = log_binom + (order - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * z * z)
  return float(logsumexp(terms)) / (order - 1)


# TF Privacy (github.com/tensorflow/privacy, tutorials/README.md as of commit 0776ed1, 2019):
# `compute_dp_sgd_privacy.py --N=60000 --batch_size=256 --noise_multiplier=1.1 --epochs=60
# --delta=1e-5` "satisfies differential privacy with eps = 3.01", and its table's z = 1.3 for
# 15 epochs gives 1.19. Its steps are ceil(epochs N / batch) and its conversion the RDP bound
# ε = min_α RDP(α) + log(1/δ)/(α − 1) over orders that include 2..63, 128, 256, 512.
@pytest.mark.parametrize('z, epochs, published', [(1.1, 60, 3.01), (1.3, 15, 1.19)])
def test_epsilon_is_dp_accountings_and_reproduces_tf_privacys_published_values(
  z, epochs, published
):
  q, steps = 256 / 60000, math.ceil(epochs * 60000 / 256)
  ours = privacy.central_epsilon(q, z, steps, DELTA)
  accountant = rdp.RdpAccountant()
  accountant.compose(
    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
  )
  assert ours == accountant.get_epsilon(DELTA)

  orders = np.array(list(range(2, 64)) + [128, 256, 512])
  total = np.array([steps * _sampled_gaussian_rdp(q, z, a) for a in orders])
  classic = np.min(total - math.log(DELTA) / (orders - 1))
  assert classic == pytest.approx(published, abs=0.005)  # the published number, to its digits
  # dp-accounting converts RDP to (ε, δ) by the tighter bound of Balle et al. 2020 (Prop. 12 of
  # arXiv 2004.00010): the same RDP values give jfed's ε, below the published one
  tighter = np.min(total + np.log1p(-1 / orders) - np.log(DELTA * orders) / (orders - 1))
  assert ours == pytest.approx(tighter, rel=2e-3)
  assert ours < published


def test_adaptive_clipping_is_accounted_at_the_configured_noise_multiplier():
  # Andrew et al.'s Theorem 1: the sum at z_Δ and the count at σ_b compose into z
  z, sigma_b = 1.0, 2.5
  z_delta = privacy.update_noise_multiplier(z, sigma_b)
  assert z_delta == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5)
  assert privacy.central_epsilon(0.1, z, 50, DELTA, count_std=sigma_b) == pytest.approx(
    privacy.central_epsilon(0.1, z, 50, DELTA), rel=1e-9
  )


def test_local_dp_epsilon_is_the_gaussian_mechanism_at_half_the_noise_multiplier():
  accountant = rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(2.0 / 2), 5)
  assert privacy.local_epsilon(2.0, 5, DELTA) == accountant.get_epsilon(DELTA)


# ---------------------------------------------------------------------------------------------
# (d) a whole run: ε per round in metrics.jsonl, TensorBoard and the summary
# ---------------------------------------------------------------------------------------------


def _direct_epsilon(q, z, rounds):
  accountant = rdp.RdpAccountant()
  accountant.compose(
    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
  )
  return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize('method', ['fedavg', 'fedprox'])
def test_a_dp_run_records_epsilon_every_round_in_metrics_tensorboard_and_summary(tmp_path, method):
  from tensorboard.backend.event_processing.event_accumulator import (  # pylint: disable=g-import-not-at-top
    EventAccumulator,
  )

  z = 1.5
  config = _config(
    3,
    **{
      f'{method}.rounds': 2,
      f'{method}.participation': 2 / 3,
      **_dp(noise_multiplier=z, clip_norm=0.5),
    },
  )
  ctx = _context(config, workdir=tmp_path)
  summary = run(build_algorithm(method, config), ctx, progress=False)
  records = [r for r in read_metrics(tmp_path) if r['step'] > 0]
  want = [_direct_epsilon(2 / 3, z, r) for r in (1, 2)]
  assert [r['dp_epsilon'] for r in records] == pytest.approx(want, rel=1e-12)
  assert want[0] < want[1]
  assert [r['dp_clip_norm'] for r in records] == [0.5, 0.5]
  events = EventAccumulator(str(tmp_path / 'tensorboard'))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars('dp_epsilon')] == [
    (1, pytest.approx(want[0], rel=1e-6)),
    (2, pytest.approx(want[1], rel=1e-6)),
  ]
  dp = json.loads((tmp_path / 'summary.json').read_text())['dp']
  assert dp == summary['dp']
  assert {k: dp[k] for k in ('mechanism', 'delta', 'noise_multiplier', 'clip_norm')} == {
    'mechanism': 'central',
    'delta': DELTA,
    'noise_multiplier': z,
    'clip_norm': 0.5,
  }
  assert dp['epsilon'] == pytest.approx(want[1], rel=1e-12)
  assert dp['sampling_rate'] == pytest.approx(2 / 3) and dp['clients_per_round'] == 2
  assert dp['rounds'] == 2 and dp['accountant'].startswith('RDP (dp_epsilon) and PLD')
  assert dp['epsilon_pld'] < dp['epsilon'] and dp['sampling'].startswith('poisson')
  assert [r['dp_epsilon_pld'] for r in records][-1] == dp['epsilon_pld']


def test_without_dp_the_records_and_summary_carry_no_privacy_fields():
  summary, rec, _ = _run('fedavg', _config(3, **{'fedavg.rounds': 1}))
  assert not any(k.startswith('dp_') for k in rec.records[0][0])
  assert 'dp' not in summary.extras


def test_the_progress_line_names_epsilon(capsys):
  config = _config(3, **{'fedavg.rounds': 1, **_dp(noise_multiplier=2.0)})
  algorithm = build_algorithm('fedavg', config)
  run(algorithm, _context(config), progress=True)
  want = _direct_epsilon(1.0, 2.0, 1)
  assert f'fedavg round 1/1 (ε = {want:.3g} at δ = 1e-05): test accuracy' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# (e) adaptive clipping
# ---------------------------------------------------------------------------------------------


def test_one_adaptive_step_is_andrew_et_als_geometric_update():
  norms = np.array([0.2, 0.5, 0.9, 1.1, 3.0])
  clip, m, sigma_b, gamma, lr = 1.0, 5.0, 0.4, 0.5, 0.2
  key = jax.random.PRNGKey(3)
  fraction = privacy.noised_unclipped_fraction(
    jnp.asarray(norms, jnp.float32), jnp.float32(clip), key, jnp.float32(sigma_b), m
  )
  count_noise = sigma_b * float(jax.random.normal(key, (), jnp.float32))
  want_fraction = (np.sum((norms <= clip) - 0.5) + count_noise) / m + 0.5  # 3 of 5 unclipped
  assert float(fraction) == pytest.approx(want_fraction, rel=1e-6)
  got = privacy.next_clip_norm(jnp.float32(clip), fraction, gamma, lr)
  assert float(got) == pytest.approx(clip * math.exp(-lr * (want_fraction - gamma)), rel=1e-6)


def test_adaptive_clipping_converges_to_the_target_quantile_of_the_norms():
  norms = jnp.asarray(np.random.default_rng(1).lognormal(0.0, 1.0, 200), jnp.float32)
  for gamma in (0.2, 0.5, 0.8):
    clip = jnp.float32(50.0)
    for t in range(400):
      key = jax.random.PRNGKey(t)
      fraction = privacy.noised_unclipped_fraction(norms, clip, key, jnp.float32(1.0), 200)
      clip = privacy.next_clip_norm(clip, fraction, gamma, 0.2)
    assert float(jnp.mean(norms <= clip)) == pytest.approx(gamma, abs=0.05)


def test_an_adaptive_run_moves_its_clip_norm_by_the_noised_fraction_it_records():
  # C_1 = 100 lies far above every update norm: b̃ ≈ 1 > γ, so round 2's C shrinks to
  # C_1 exp(−η (b̃ − γ)), with the b̃ round 1 recorded
  c0, gamma, lr = 100.0, 0.5, 0.2
  dp = _dp(
    noise_multiplier=1.0,
    clip_norm=c0,
    adaptive=True,
    target_quantile=gamma,
    clip_lr=lr,
    count_noise_fraction=1.0,
  )
  summary, rec, _ = _run('fedavg', _config(3, **{'fedavg.rounds': 2, **dp}))
  first, second = rec.records[0][0], rec.records[1][0]
  assert first['dp_clip_norm'] == c0
  assert second['dp_clip_norm'] == pytest.approx(
    c0 * math.exp(-lr * (first['dp_unclipped_fraction'] - gamma)), rel=1e-6
  )
  assert second['dp_clip_norm'] < c0
  assert summary['dp']['update_noise_multiplier'] == pytest.approx((1 - (2 * 3.0) ** -2) ** -0.5)
  assert summary['dp']['target_quantile'] == gamma
  assert summary['dp']['count_noise_std'] == pytest.approx(3.0)  # σ_b = 1.0 · m
  assert summary['dp']['final_clip_norm'] == pytest.approx(
    second['dp_clip_norm'] * math.exp(-lr * (second['dp_unclipped_fraction'] - gamma)), rel=1e-6
  )


def test_an_adaptive_run_resumes_with_its_clip_norm(tmp_path, monkeypatch):
  dp = _dp(noise_multiplier=1.0, clip_norm=100.0, adaptive=True, count_noise_fraction=1.0)
  config = _config(3, **{'fedavg.rounds': 3, **dp})

  def run_in(workdir):
    ctx = _context(config, workdir=workdir)
    return run(build_algorithm('fedavg', config), ctx, progress=False)

  whole = run_in(tmp_path / 'whole')
  with monkeypatch.context() as m:
    interrupt_after(m, 1)
    with pytest.raises(Interrupted):
      run_in(tmp_path / 'killed')
  resumed = run_in(tmp_path / 'killed')
  assert comparable_summary(resumed) == comparable_summary(whole)
  assert read_metrics(tmp_path / 'killed') == read_metrics(tmp_path / 'whole')


# ---------------------------------------------------------------------------------------------
# (f) refused settings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'overrides, message',
  [
    (
      _dp(noise_multiplier=0.0),
      'dp.noise_multiplier must be positive when dp.enabled, got 0.0 (0 gives no privacy, '
      'ε = ∞; to clip without noise use aggregation.clip_norm)',
    ),
    (_dp(clip_norm=-1.0), 'dp.clip_norm must be positive, got -1.0'),
    (_dp(delta=1.0), 'dp.delta must be in (0, 1), got 1.0'),
    (_dp(delta=0.0), 'dp.delta must be in (0, 1), got 0.0'),
    (
      _dp(adaptive=True, local=True),
      'dp.adaptive needs the server-side mechanism: set dp.local=False or dp.adaptive=False',
    ),
    (
      _dp(adaptive=True, target_quantile=1.0, noise_multiplier=0.1),
      'dp.target_quantile must be in (0, 1), got 1.0',
    ),
    (_dp(adaptive=True, clip_lr=0.0, noise_multiplier=0.1), 'dp.clip_lr must be positive, got 0.0'),
    (
      _dp(adaptive=True, count_noise_fraction=0.0),
      'dp.count_noise_fraction must be positive, got 0.0',
    ),
    (
      _dp(adaptive=True, noise_multiplier=1.0),
      'dp.noise_multiplier=1 leaves no noise for the update sum under adaptive clipping: it '
      'must be below 2σ_b = 2 × dp.count_noise_fraction × 3 clients per round = 0.3; raise '
      'dp.count_noise_fraction or lower dp.noise_multiplier',
    ),
    (
      {**_dp(), 'aggregation.rule': 'median'},
      'dp.enabled (server-side) averages the clipped updates itself; aggregation.rule must be '
      "'mean', got 'median' (dp.local=True composes with any rule)",
    ),
    (
      {**_dp(), 'aggregation.clip_norm': 2.0},
      'dp.enabled clips the updates to dp.clip_norm itself; aggregation.clip_norm must be 0, '
      'got 2.0',
    ),
  ],
)
@pytest.mark.parametrize('method', ['fedavg', 'fedprox'])
def test_a_bad_dp_setting_is_refused_naming_the_key(method, overrides, message):
  with pytest.raises(ConfigError, match=f'^{re.escape(message)}$'):
    build_algorithm(method, _config(3, **overrides))


def test_local_dp_runs_with_a_robust_rule():
  config = _config(3, **{'aggregation.rule': 'median', **_dp(local=True, noise_multiplier=0.5)})
  summary, rec, _ = _run('fedavg', config)
  assert rec.records[0][0]['dp_epsilon'] == pytest.approx(privacy.local_epsilon(0.5, 1, DELTA))
  assert summary['dp']['mechanism'] == 'local' and summary['aggregation'] == 'median'


def test_dp_is_refused_for_a_method_that_does_not_implement_it():
  config = _config(3, **_dp())
  build_algorithm('fedavg', config)
  # the driver asks before it builds anything: a method that would ignore dp never runs
  with pytest.raises(ConfigError) as e:
    build_algorithm('dense', config)
  assert str(e.value) == (
    'dp.enabled: differential privacy is implemented for fedavg and fedprox only, not dense'
  )


# ---------------------------------------------------------------------------------------------
# the privacy–accuracy table's command
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dp_table_command_writes_its_table_and_plot(tmp_path):
  from experiments import dp_table  # pylint: disable=g-import-not-at-top

  out, doc = tmp_path / 'out', tmp_path / 'doc' / 'dp_digits.md'
  rows = ['no_dp', 'z1', 'adaptive_z2']
  text = dp_table.run_table('digits', out, [0, 1], rows, doc=str(doc), smoke=True)
  results = json.loads((out / 'results.json').read_text())['results']['dp']
  assert sorted(results) == ['0', '1'] and all(sorted(r) == sorted(rows) for r in results.values())
  # smoke: 10 clients, 5 per round, 2 rounds; ε after the last one
  eps = _direct_epsilon(0.5, 1.0, 2)
  assert all(r['z1']['epsilon'] == pytest.approx(eps, rel=1e-12) for r in results.values())
  assert all('epsilon' not in r['no_dp'] for r in results.values())
  assert f'| z1 | 1 | 0.5 | {eps:.3g} |' in text and '| no_dp | — | — | ∞ (no DP) |' in text
  assert doc.read_text() == text and '![final test accuracy against ε](dp_digits.png)' in text
  assert doc.with_suffix('.png').stat().st_size and (out / 'dp_digits_smoke.png').stat().st_size
  again = dp_table.run_table('digits', out, [0, 1], rows, smoke=True)  # finished runs skipped
  assert json.loads((out / 'results.json').read_text())['results']['dp'] == results
  assert again.replace('dp_digits_smoke.png', 'dp_digits.png') == text
  with pytest.raises(ConfigError, match='--rows: unknown'):
    dp_table.run_table('digits', out, [0], ['z3'], smoke=True)


class _RecordingServer(NamedTuple):
  """A run's server that records what it receives and aggregates nothing."""

  calls: list
  aggregator: Any = None
  attack: Any = None

  def receive(self, *args, **kwargs):
    self.calls.append((self.aggregator, args, kwargs))
    return 'aggregate', {'rejected_uploads': 3}


def _receive_through_dp_server(local: bool, count_std):
  """One `_DpServer.receive` of three clients' uploads in front of a `_RecordingServer`: the DP
  server, the recorded calls, the round's inputs and what `receive` returned."""
  calls = []
  dp = privacy.DpConfig(True, 0.5, 1.5, not local, 0.5, 0.2, 0.05, DELTA, local)
  noise = privacy.RoundNoise(
    jax.random.PRNGKey(3),
    jnp.float32(1.5),
    jnp.float32(0.75),
    jnp.float32(count_std or 0.0),
    jnp.float32(3),
  )
  dp_server = fedavg._DpServer(
    _RecordingServer(calls), fedavg.DpSetup(dp, 3, 1.0, count_std), noise
  )
  given = types.SimpleNamespace(
    group=types.SimpleNamespace(client_ids=np.array([4, 7, 9])),
    stacked={'w': jnp.arange(12, dtype=jnp.float32).reshape(3, 4)},
    reference={'w': jnp.ones((4,), jnp.float32)},
    weights=np.array([1.0, 2.0, 3.0]),
    replied=np.array([True, False, True]),
  )
  got = dp_server.receive(
    given.group,
    given.stacked,
    given.reference,
    'template',
    5,
    given.weights,
    taking_part=given.replied,
    declared_sizes=None,
  )
  return dp_server, calls, given, got


def test_local_dp_hands_the_server_the_noised_uploads_with_the_rounds_own_arguments():
  """Under local DP the run's server receives the clipped and noised uploads with everything
  else the round passed: the aggregation weights, the clients that replied (Flower's
  min-supernodes) and the sizes they declared. The DP server changes only the uploads."""
  dp_server, calls, given, got = _receive_through_dp_server(local=True, count_std=None)
  assert got == ('aggregate', {'rejected_uploads': 3})
  [(aggregator, args, kwargs)] = calls
  assert aggregator is None  # the run's own rule
  noise = dp_server.noise
  noised = privacy.privatize_locally(
    given.stacked,
    given.reference,
    noise.key,
    jnp.asarray([4, 7, 9]),
    noise.clip_norm,
    jnp.float32(0.5),
  )
  np.testing.assert_array_equal(args[1]['w'], noised['w'])
  assert not np.allclose(args[1]['w'], given.stacked['w'])
  assert args[0] is given.group and args[2] is given.reference and args[3:5] == ('template', 5)
  assert args[5] is given.weights
  assert kwargs == {'taking_part': given.replied, 'declared_sizes': None}


def test_central_dp_passes_the_rounds_arguments_on_and_noises_a_round_with_no_upload():
  """Server-side DP swaps only the aggregation rule; when every upload was rejected (the rule
  never ran), the round's model is the noise alone and its unclipped fraction is still released
  for adaptive clipping."""
  dp_server, calls, given, (model, record) = _receive_through_dp_server(local=False, count_std=0.2)
  [(aggregator, args, kwargs)] = calls
  assert callable(aggregator.aggregate) and args[0] is given.group and args[1] is given.stacked
  assert args[2] is given.reference and args[3:5] == ('template', 5) and args[5] is given.weights
  assert kwargs == {'taking_part': given.replied, 'declared_sizes': None}
  want_model, want_fraction = privacy.central_noise_only(given.reference, dp_server.noise)
  np.testing.assert_array_equal(model['w'], want_model['w'])
  # released to the round through its record (no state on the server), which takes it out
  assert record == {'rejected_uploads': 3, 'released_unclipped_fraction': want_fraction}


# ---------------------------------------------------------------------------------------------
# (issue 81) the sampling the accountant assumes, PLD beside RDP, settings that promise nothing
# ---------------------------------------------------------------------------------------------


def test_poisson_sampling_includes_each_client_at_rate_q_independently():
  """Cohort sizes over 4,000 draws of N = 20 at q = 0.3 are Binomial(N, q) (mean and variance
  within 4 standard errors) and every client's inclusion rate is q (each within 4 s.e.)."""
  n, q, draws = 20, 0.3, 4000
  chosen = np.zeros((draws, n), bool)
  for t in range(draws):
    ids = common.poisson_clients(jax.random.PRNGKey(t), n, q)
    assert np.all(np.diff(ids) > 0)
    chosen[t, ids] = True
  sizes = chosen.sum(1)
  mean_se = math.sqrt(n * q * (1 - q) / draws)
  assert abs(sizes.mean() - n * q) < 4 * mean_se
  var = n * q * (1 - q)
  assert abs(sizes.var(ddof=1) - var) < 4 * var * math.sqrt(2 / (draws - 1))
  per_client_se = math.sqrt(q * (1 - q) / draws)
  assert np.all(np.abs(chosen.mean(0) - q) < 4 * per_client_se)
  assert (sizes == 0).any() or n * math.log(1 - q) < math.log(1 / draws)


def test_a_dp_round_with_no_client_releases_the_noise_alone(monkeypatch):
  """Poisson cohorts vary: a round of none trains nobody and the model moves by the noise of
  std z·C/m only (DP-FedAvg's fixed denominator), recorded as 0 clients."""
  real, calls = common.poisson_clients, []

  def none_in_round_2(key, n, rate):
    calls.append(key)
    return np.zeros(0, np.int64) if len(calls) == 2 else real(key, n, rate)

  monkeypatch.setattr(common, 'poisson_clients', none_in_round_2)
  z, c = 1.5, 0.5
  config = _config(
    3, **{'fedavg.rounds': 2, 'fedavg.participation': 2 / 3, **_dp(noise_multiplier=z, clip_norm=c)}
  )
  _, rec, _ = _run('fedavg', config)
  assert rec.records[1][0]['clients'] == 0 and rec.records[1][0]['upload_bytes'] == 0
  before, after = (ravel_pytree(s.model.params)[0] for s in rec.states)
  noise = np.asarray(after - before)
  assert noise.std() == pytest.approx(z * c / 2, rel=0.1)  # m = round(2/3 · 3) = 2


def test_pld_epsilon_of_unsampled_gaussians_is_the_analytic_gaussian_mechanism():
  """q = 1: k rounds of noise multiplier z are one Gaussian mechanism of z/√k, whose exact
  (ε, δ) curve is Balle and Wang's (ICML 2018, Thm. 8): δ(ε) = Φ(1/(2s) − εs) − e^ε Φ(−1/(2s)
  − εs) with s = z/√k; ε solved from it by bisection. dp-accounting's PLD is pessimistic by
  its discretisation only; RDP is looser."""
  from scipy.stats import norm  # pylint: disable=g-import-not-at-top

  z, k, delta = 2.0, 30, 1e-5
  s = z / math.sqrt(k)

  def delta_of(eps):
    return norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s)

  lo, hi = 0.0, 100.0
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
  exact = hi
  pld = privacy.central_epsilon(1.0, z, k, delta, accountant='pld')
  assert exact <= pld <= exact * 1.01
  assert privacy.central_epsilon(1.0, z, k, delta) > pld


def test_the_sampled_gaussians_pld_epsilon_is_below_its_rdp_one():
  # σ = 3, 512 steps, q = 0.1, δ = 1e-6: the figure issue 81 cites (PLD ≈ 3.77), RDP 4.05
  pld = privacy.central_epsilon(0.1, 3.0, 512, 1e-6, accountant='pld')
  assert pld == pytest.approx(3.77, abs=0.01)
  assert pld < privacy.central_epsilon(0.1, 3.0, 512, 1e-6) == pytest.approx(4.05, abs=0.01)


def test_settings_that_promise_nothing_are_refused_in_one_line():
  # δ ≥ 1/N: publishing one client's data outright meets it
  with pytest.raises(ConfigError, match=r'dp.delta=0.5 is at least 1/N = 1/3'):
    build_algorithm('fedavg', _config(3, **_dp(delta=0.5)))
  # an accountant that cannot give a number: one ConfigError, no OverflowError traceback
  with pytest.raises(ConfigError, match='accountant cannot compute ε|gives ε'):
    privacy.central_epsilon(0.5, 1e300, 3, 1e-5)


def test_a_weak_epsilon_is_flagged_in_the_summary_and_on_the_console(caplog):
  config = _config(3, **{'fedavg.rounds': 2, **_dp(noise_multiplier=0.3, clip_norm=0.5)})
  summary, _, _ = _run('fedavg', config)
  assert summary['dp']['epsilon'] > privacy.WEAK_EPSILON and summary['dp']['epsilon_above_10']
  assert any('this run has little privacy' in r.getMessage() for r in caplog.records)


def test_the_default_noise_comes_from_the_os_and_a_seeded_one_is_refused_under_flower():
  """Two runs of one config differ by their noise (nobody can regenerate it from the config);
  `dp.reproducible_noise` repeats them, and is refused where a transport carries the config."""
  config = _config(3, **{'fedavg.rounds': 1, **_dp(noise_multiplier=1.0, reproducible_noise=False)})
  first, second = (
    ravel_pytree(_run('fedavg', config)[1].states[-1].model.params)[0] for _ in range(2)
  )
  assert not np.allclose(first, second)
  seeded = _config(3, **{'fedavg.rounds': 1, **_dp(noise_multiplier=1.0)})
  again = [ravel_pytree(_run('fedavg', seeded)[1].states[-1].model.params)[0] for _ in range(2)]
  np.testing.assert_array_equal(*again)
  algorithm = build_algorithm('fedavg', seeded)
  ctx = _context(seeded)
  ctx.client_transport = object()
  with pytest.raises(ConfigError, match='dp.reproducible_noise derives the noise from the config'):
    algorithm.setup(ctx)


def test_a_privacy_budget_stops_the_run_after_its_last_round_within_it():
  z, q = 1.5, 2 / 3
  budget = (_direct_epsilon(q, z, 3) + _direct_epsilon(q, z, 4)) / 2  # between rounds 3 and 4
  config = _config(
    3,
    **{
      'fedavg.rounds': 6,
      'fedavg.participation': q,
      **_dp(noise_multiplier=z, clip_norm=0.5, max_epsilon=budget),
    },
  )
  summary, rec, _ = _run('fedavg', config)
  assert len(rec.records) == 3 and summary['dp']['stopped_by_max_epsilon']
  assert summary['dp']['epsilon'] == pytest.approx(_direct_epsilon(q, z, 3), rel=1e-12)
  assert summary['dp']['epsilon'] <= budget < _direct_epsilon(q, z, 4)
  tiny = _config(3, **{'fedavg.participation': q, **_dp(noise_multiplier=z, max_epsilon=1e-3)})
  with pytest.raises(ConfigError, match=r'dp.max_epsilon=0.001 is exceeded by one round'):
    _run('fedavg', tiny)


def test_padding_a_poisson_cohort_to_its_bucket_changes_nothing(monkeypatch):
  """Cohorts are padded to a bucket of rows (one compiled shape per bucket, not per size) with
  clients that sit out: the run equals one without padding, and the records count only the
  sampled clients."""
  config = _config(
    6,
    **{
      'fedavg.rounds': 3,
      'fedavg.participation': 0.5,
      **_dp(noise_multiplier=1.0, clip_norm=0.5),
    },
  )
  padded = []
  real = common.padded_cohort

  def spy(selected, n, rate):
    ids, padding = real(selected, n, rate)
    padded.append((len(selected), len(ids)))
    return ids, padding

  monkeypatch.setattr(common, 'padded_cohort', spy)
  sizes = (23, 41, 12, 17, 30, 9)
  _, with_padding, _ = _run('fedavg', config, sizes)
  assert any(rows > size for size, rows in padded)
  counts = [r[0]['clients'] for r in with_padding.records]
  assert [c for c in counts if c] == [size for size, _ in padded]  # empty rounds pad nothing
  monkeypatch.setattr(common, 'padded_cohort', lambda s, n, q: (s, np.zeros(len(s), bool)))
  _, without, _ = _run('fedavg', config, sizes)
  np.testing.assert_array_equal(
    ravel_pytree(with_padding.states[-1].model.params)[0],
    ravel_pytree(without.states[-1].model.params)[0],
  )


def test_a_cohorts_bucket_covers_it_with_clients_outside_it():
  selected = np.array([3, 7, 9])
  ids, padding = common.padded_cohort(selected, 100, 0.5)
  assert len(ids) == 10 and np.all(np.diff(ids) > 0)  # ⌈2·sd⌉ = ⌈2·5⌉ = 10
  np.testing.assert_array_equal(ids[~padding], selected)
  assert not np.isin(ids[padding], selected).any()
  assert len(common.padded_cohort(np.arange(95), 100, 0.5)[0]) == 100  # never beyond N
