"""FedTSA's resource profiling and KDE clustering (FedTSA, Fan et al., ECCV 2024, §4.3)."""

import json

import numpy as np
import pytest
from scipy import stats

from jfed.data import load_dataset
from jfed.profiling import (
  ProxyTask,
  assign_devices,
  kde_clusters,
  measured_durations,
  profile_from_rates,
  pruning_rates,
  read_durations,
  simulated_durations,
)
from jfed.profiling.plots import plot_kde


def _three_modes(seed=0):
  rng = np.random.default_rng(seed)
  groups = [rng.normal(m, 0.02, n) for m, n in ((1.0, 4), (1.25, 8), (1.667, 8))]
  return np.concatenate(groups), np.repeat([0, 1, 2], [4, 8, 8])


def test_three_device_modes_give_three_clusters_at_the_density_minima():
  durations, truth = _three_modes()
  c = kde_clusters(durations, bandwidth=0.2)
  np.testing.assert_array_equal(c.assignments, truth)
  assert len(c.boundaries) == 2
  # Each boundary is a local minimum of scipy's own KDE of the same sample.
  kde = stats.gaussian_kde(durations, bw_method=0.2)
  for b in c.boundaries:
    step = 1e-3
    assert kde(b)[0] <= kde(b - step)[0] and kde(b)[0] <= kde(b + step)[0]
  means = np.array([durations[truth == k].mean() for k in range(3)])
  np.testing.assert_allclose(c.means, means)
  np.testing.assert_allclose(c.rates, means[0] / means)  # r = t_fastest / t_cluster
  np.testing.assert_allclose(c.rates, [1.0, 0.8, 0.6], atol=0.02)
  np.testing.assert_allclose(kde_clusters(durations, 0.2, quantum=0.1).rates, [1.0, 0.8, 0.6])


def test_wide_bandwidth_merges_modes_and_one_mode_is_one_cluster():
  durations, _ = _three_modes()
  assert len(kde_clusters(durations, 'silverman').means) < 3
  one = kde_clusters(np.full(6, 2.0))
  np.testing.assert_array_equal(one.assignments, 0)
  np.testing.assert_array_equal(one.rates, [1.0])
  np.testing.assert_allclose(pruning_rates([2.0, 4.0, 3.0], 0.25), [1.0, 0.5, 0.75])


@pytest.mark.parametrize('bad', [[1.0, np.nan], [1.0, -2.0], [], [0.0, 1.0]])
def test_bad_durations_are_refused(bad):
  with pytest.raises(ValueError, match='durations'):
    kde_clusters(bad)


def test_device_profiles_and_the_durations_file(tmp_path):
  p = profile_from_rates([1.0, 0.8, 0.6], [0.2, 0.4, 0.4])
  np.testing.assert_allclose(p.slowdowns, [1.0, 1.25, 1 / 0.6])
  classes = assign_devices(20, p, 3)
  np.testing.assert_array_equal(np.bincount(classes), [4, 8, 8])
  d = simulated_durations(0.5, 20, p, 0.0, 3)
  np.testing.assert_allclose(d.durations, 0.5 * np.asarray(p.slowdowns)[classes])
  c = kde_clusters(simulated_durations(0.5, 20, p, 0.01, 3).durations, 0.2, quantum=0.1)
  np.testing.assert_array_equal(c.assignments, classes)
  np.testing.assert_allclose(c.rates, [1.0, 0.8, 0.6])

  path = tmp_path / 'durations.json'
  path.write_text(json.dumps([1.5, 2.0, 3.0]))
  np.testing.assert_allclose(read_durations(str(path), 3).durations, [1.5, 2.0, 3.0])
  (tmp_path / 'd.txt').write_text('1.5, 2\n3')
  np.testing.assert_allclose(read_durations(str(tmp_path / 'd.txt'), 3).durations, [1.5, 2, 3])
  for text, n, match in (
    ('[1, 2]', 3, '2 values for 3'),
    ('[1, -2, 3]', 3, '> 0'),
    ('a b', 2, 'numbers'),
  ):
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
      read_durations(str(path), n)
  with pytest.raises(ValueError, match='does not exist'):
    read_durations(str(tmp_path / 'missing.json'), 3)


def test_the_proxy_task_is_timed_here_and_scaled_by_the_profile(tmp_path):
  ds = load_dataset('digits')
  task = ProxyTask(ds.train_x[:256], ds.train_y[:256], 10, epochs=2)
  p = profile_from_rates([1.0, 0.5], [0.5, 0.5])
  assert task.seconds(repeats=2) > 0
  # Each client's own measured time (stubbed: real timings on a shared CPU are noisy) times its
  # device class's slow-down.
  times = iter([0.010, 0.011, 0.012, 0.013, 0.014, 0.015])
  task.seconds = lambda repeats: next(times)
  d = measured_durations(task, 6, p, seed=0, repeats=3)
  want = np.array([0.010, 0.011, 0.012, 0.013, 0.014, 0.015]) * np.where(d.device_class, 2.0, 1.0)
  np.testing.assert_allclose(d.durations, want)
  np.testing.assert_array_equal(np.bincount(d.device_class), [3, 3])
  plot_kde(kde_clusters(d.durations, 0.3), d.durations, str(tmp_path / 'kde.png'))
  assert (tmp_path / 'kde.png').stat().st_size > 5000


TABLE4_DEGREES = (
  [1.0],
  [0.5, 1.0],
  [0.6, 0.8, 1.0],
  [0.1, 0.4, 0.7, 1.0],
  [0.1, 0.3, 0.5, 0.7, 1.0],
)


def _fedtsa_kde_settings():
  """The clustering settings of FedTSA's config (experiments/configs/common.py)."""
  from experiments.configs import common  # pylint: disable=g-import-not-at-top

  c = common.base_config().fedtsa
  return dict(
    bandwidth=float(c.bandwidth),
    quantum=c.rate_quantum,
    space=c.kde_space,
    min_bandwidth=c.kde_min_bandwidth,
  ), c.jitter


@pytest.mark.parametrize('rates', TABLE4_DEGREES, ids=lambda r: '/'.join(map(str, r)))
def test_fedtsa_defaults_recover_every_table4_degree(rates):
  """FedTSA's clustering finds each degree's device classes exactly (20 clients, the config's
  jitter, 10 seeds): in seconds, the std-scaled bandwidth split one class at its noise and
  merged 1.0/0.7/0.4 into one cluster at [0.1, 0.4, 0.7, 1.0]."""
  settings, jitter = _fedtsa_kde_settings()
  fastest_first = sorted(rates, reverse=True)
  p = profile_from_rates(fastest_first, [1 / len(rates)] * len(rates))
  for seed in range(10):
    d = simulated_durations(0.02, 20, p, jitter, seed)
    c = kde_clusters(d.durations, **settings)
    np.testing.assert_array_equal(c.assignments, d.device_class, err_msg=f'seed {seed}')
    np.testing.assert_allclose(c.rates, fastest_first)
  # the old default (seconds, factor 0.25, no floor) fails both ends of the table
  one = simulated_durations(0.02, 20, profile_from_rates([1.0], [1.0]), jitter, 0).durations
  assert len(kde_clusters(one, 0.25).means) > 1


def test_log_space_kde_is_the_kde_of_log_durations_with_a_bandwidth_floor():
  durations, truth = _three_modes()
  c = kde_clusters(durations, 0.2, space='log')
  np.testing.assert_array_equal(c.assignments, truth)
  kde = stats.gaussian_kde(np.log(durations), bw_method=0.2)
  assert c.space == 'log' and c.bandwidth == pytest.approx(np.sqrt(kde.covariance[0, 0]))
  for b in c.boundaries:  # boundaries are reported in seconds, minima of the log-space KDE
    x, step = np.log(b), 1e-3
    assert kde(x)[0] <= kde(x - step)[0] and kde(x)[0] <= kde(x + step)[0]
  ends = np.log([durations.min(), durations.max()]) + np.array([-3, 3]) * c.bandwidth
  np.testing.assert_allclose(c.grid[[0, -1]], np.exp(ends))  # the grid in seconds
  floored = kde_clusters(durations, 0.01, space='log', min_bandwidth=0.3)
  assert floored.bandwidth == pytest.approx(0.3)
  assert len(floored.means) == 1  # a 0.3 kernel (35 % in duration) merges the three classes
  with pytest.raises(ValueError, match='space'):
    kde_clusters(durations, space='seconds')
