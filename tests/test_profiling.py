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
  assert 0 < task.seconds(repeats=2) < 30  # one pass over 256 digits
  with pytest.raises(
    ValueError, match='^the proxy task needs at least one batch of 32 samples, got 31$'
  ):
    ProxyTask(ds.train_x[:31], ds.train_y[:31], 10)
  # Each client's own measured time (stubbed: real timings on a shared CPU are noisy) times its
  # device class's slow-down.
  times = iter([0.010, 0.011, 0.012, 0.013, 0.014, 0.015])
  task.seconds = lambda repeats: next(times)
  d = measured_durations(task, 6, p, seed=0, repeats=3)
  want = np.array([0.010, 0.011, 0.012, 0.013, 0.014, 0.015]) * np.where(d.device_class, 2.0, 1.0)
  np.testing.assert_allclose(d.durations, want)
  # with jitter: the lognormal noise of the seed's second stream on top
  times = iter([0.010, 0.011, 0.012, 0.013, 0.014, 0.015])
  jittered = measured_durations(task, 6, p, seed=0, repeats=3, jitter=0.2)
  noise = np.random.default_rng((0, 1)).lognormal(0.0, 0.2, 6)
  np.testing.assert_allclose(jittered.durations, want * noise)
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
  """The clustering settings of FedTSA's config (jfed/configs/base.py)."""
  from jfed.configs import base as common  # pylint: disable=g-import-not-at-top

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


def _kde_clusters_by_hand(durations, bandwidth, grid_size, quantum, space, min_bandwidth):
  """FedTSA §4.3 written out in NumPy, without scipy or jfed: a Gaussian KDE whose kernel sd is
  scipy's rule (Scott n^(-1/5), Silverman (3n/4)^(-1/5), or a factor) times the sample sd
  (ddof 1), floored at `min_bandwidth`; the density on `grid_size` points over the sample ± 3
  sd; grid points strictly below the left neighbour and not above the right one, strictly
  inside the sample's range, as boundaries (kept only with a client on each side, counted from
  the previous kept one); clients numbered by the boundaries below them; r_k = the fastest
  cluster's mean over cluster k's, rounded to `quantum` (at least one) with the fastest 1."""
  d = np.asarray(durations, np.float64)
  x = np.log(d) if space == 'log' else d
  n = len(x)
  factor = {'scott': n ** (-1 / 5), 'silverman': (n * 3 / 4) ** (-1 / 5)}.get(bandwidth, bandwidth)
  sd = max(float(factor) * float(np.std(x, ddof=1)), min_bandwidth)
  grid = np.linspace(x.min() - 3 * sd, x.max() + 3 * sd, grid_size)
  density = np.exp(-0.5 * ((grid[:, None] - x[None, :]) / sd) ** 2).sum(1)
  density /= n * sd * np.sqrt(2 * np.pi)
  edges = []
  for j in range(1, grid_size - 1):
    if density[j] < density[j - 1] and density[j] <= density[j + 1] and x.min() < grid[j] < x.max():
      b = float(np.exp(grid[j])) if space == 'log' else float(grid[j])
      lower = edges[-1] if edges else -np.inf
      if ((d > lower) & (d < b)).any() and (d > b).any():
        edges.append(b)
  assignments = np.array([sum(e < v for e in edges) for v in d])
  means = np.array([d[assignments == k].mean() for k in range(len(edges) + 1)])
  rates = means.min() / means
  if quantum:
    rates = np.round(np.maximum(np.round(rates / quantum) * quantum, quantum), 10)
    rates[np.argmin(means)] = 1.0
  shown_grid = np.exp(grid) if space == 'log' else grid
  return assignments, np.array(edges), means, rates, shown_grid, density, sd


@pytest.mark.parametrize(
  'seed,bandwidth,grid_size,quantum,space,min_bandwidth',
  [
    (0, 0.2, 2048, 0.0, 'duration', 0.0),
    (1, 'scott', 512, 0.1, 'duration', 0.0),
    (2, 'silverman', 301, 0.0, 'log', 0.0),
    (3, 0.05, 1000, 0.25, 'log', 0.08),  # the floor binds: 0.05 x sd is below 0.08
    (4, 0.3, 777, 0.0, 'duration', 0.01),  # a floor that does not bind
    (5, 0.02, 4000, 0.05, 'duration', 0.0),  # a narrow kernel
    # classes so far apart that the density underflows to zero, then to steps of subnormal
    # numbers, between them: each step down passes the minimum test, and only the first of a
    # gap has a client on each side of it
    (6, 0.01, 3000, 0.0, 'duration', 0.0),
  ],
)
def test_kde_clusters_is_the_papers_procedure_computed_independently(
  seed, bandwidth, grid_size, quantum, space, min_bandwidth
):
  """Every field of the result, for three device classes of unequal sizes, shuffled."""
  rng = np.random.default_rng(seed)
  modes = (1.0, 5.0, 30.0) if seed == 6 else (1.0, 1.4, 2.3)
  durations = np.concatenate([rng.normal(m, 0.03 * m, k) for m, k in zip(modes, (5, 9, 6))])
  durations = rng.permutation(durations)
  got = kde_clusters(durations, bandwidth, grid_size, quantum, space, min_bandwidth)
  assignments, edges, means, rates, grid, density, sd = _kde_clusters_by_hand(
    durations, bandwidth, grid_size, quantum, space, min_bandwidth
  )
  np.testing.assert_array_equal(got.assignments, assignments)
  np.testing.assert_allclose(got.boundaries, edges, rtol=1e-12)
  np.testing.assert_allclose(got.means, means, rtol=1e-12)
  np.testing.assert_allclose(got.rates, rates, rtol=1e-12)
  np.testing.assert_allclose(got.grid, grid, rtol=1e-12)
  np.testing.assert_allclose(got.density, density, rtol=1e-9, atol=1e-300)  # subnormal tails
  assert got.bandwidth == pytest.approx(sd, rel=1e-12) and got.space == space
  assert len(got.grid) == grid_size and got.assignments.dtype.kind == 'i'


def test_one_device_class_is_one_cluster_with_the_mean_and_rate_one():
  # equal up to 1e-12 of the slowest: 1e-10 s apart at 1000 s is one class
  for durations in ([2.5], [3.0, 3.0, 3.0], [1000.0, 1000.0 + 1e-10, 1000.0]):
    c = kde_clusters(durations, space='log')
    assert c.assignments.dtype == np.int64
    np.testing.assert_array_equal(c.assignments, np.zeros(len(durations)))
    assert c.boundaries.shape == (0,) and c.bandwidth == 0.0 and c.space == 'log'
    np.testing.assert_array_equal(c.means, [np.mean(durations)])
    np.testing.assert_array_equal(c.rates, [1.0])
    np.testing.assert_array_equal(c.grid, [min(durations)])
    np.testing.assert_array_equal(c.density, [1.0])


@pytest.mark.parametrize(
  'kwargs,message',
  [
    ({'durations': []}, 'no client durations to cluster'),
    ({'durations': [1.0, np.inf]}, r'client durations must be finite and > 0, got \[1.0, inf\]'),
    ({'durations': [1.0, 0.0]}, r'client durations must be finite and > 0, got \[1.0, 0.0\]'),
    ({'bandwidth': 'normal'}, "bandwidth must be 'scott', 'silverman' or a float, got 'normal'"),
    ({'bandwidth': 0.0}, 'bandwidth factor must be > 0, got 0.0'),
    ({'bandwidth': -1}, 'bandwidth factor must be > 0, got -1'),
    ({'space': 'seconds'}, "space must be 'duration' or 'log', got 'seconds'"),
    ({'min_bandwidth': -0.1}, 'min_bandwidth must be >= 0, got -0.1'),
  ],
)
def test_each_bad_setting_is_refused_with_its_message(kwargs, message):
  args = {'durations': [1.0, 2.0, 2.1], **kwargs}
  with pytest.raises(ValueError, match=f'^{message}$'):
    kde_clusters(**args)


def test_pruning_rates_round_to_the_quantum_but_never_below_one_quantum():
  np.testing.assert_allclose(pruning_rates([1.0, 1.27, 40.0]), [1.0, 1 / 1.27, 0.025])
  np.testing.assert_array_equal(pruning_rates([1.0, 1.27, 40.0], 0.1), [1.0, 0.8, 0.1])
  # the fastest is 1.0 exactly wherever it sits, even where rounding would give it another value
  np.testing.assert_array_equal(pruning_rates([3.0, 2.0, 6.0], 0.3), [0.6, 1.0, 0.3])


def test_two_clients_can_be_two_clusters_and_durations_are_read_flat_as_floats():
  two = kde_clusters([1.0, 2.0], 0.1)
  np.testing.assert_array_equal(two.assignments, [0, 1])
  np.testing.assert_allclose(two.rates, [1.0, 0.5])
  durations, truth = _three_modes()
  flat = kde_clusters(durations, 0.2)
  assert len(flat.grid) == 2048  # the default grid
  nested = kde_clusters(durations.reshape(4, 5), 0.2)  # a table of durations, read row by row
  np.testing.assert_array_equal(nested.assignments, truth)
  np.testing.assert_array_equal(nested.density, flat.density)
  whole = kde_clusters([1, 1, 1, 4, 4, 4], 0.3)  # integer seconds
  np.testing.assert_allclose(whole.means, [1.0, 4.0])
  assert whole.grid.dtype == np.float64


def test_between_two_candidate_boundaries_there_is_always_a_client():
  """Why kde.py's kept-boundary rule never drops anything in practice (mutation triage,
  docs/results/mutation/profiling_triage.md): over random samples, settings and grids, two
  consecutive density minima inside the sample's range always have a client between them."""
  rng = np.random.default_rng(0)
  checked = 0
  for _ in range(2000):
    n = int(rng.integers(2, 8))
    draw = int(rng.integers(3))
    d = [rng.uniform(0.5, 3, n), np.round(rng.uniform(0.5, 3, n), 1), np.exp(rng.normal(0, 1, n))]
    d = np.sort(np.abs(d[draw]) + 0.01)
    if np.ptp(d) < 1e-6:
      continue
    space = ('duration', 'log')[int(rng.integers(2))]
    c = kde_clusters(
      d,
      float(rng.choice([0.01, 0.05, 0.1, 0.2, 0.5])),
      int(rng.choice([64, 301, 2048])),
      space=space,
    )
    x = np.log(d) if space == 'log' else d
    grid = np.log(c.grid) if space == 'log' else c.grid
    den = c.density
    inner = np.flatnonzero((den[1:-1] < den[:-2]) & (den[1:-1] <= den[2:])) + 1
    candidates = [grid[i] for i in inner if x.min() < grid[i] < x.max()]
    for lo, hi in zip(candidates[:-1], candidates[1:]):
      assert np.any((x > lo) & (x < hi)), (d, space)
    checked += len(candidates) > 1
  assert checked > 200  # cases with two or more candidates were drawn


def test_device_profiles_normalise_shares_and_refuse_bad_rates_or_shares():
  """Shares are normalised (a zero share allowed), slow-downs are fastest rate / rate; every bad
  input is refused with its whole message."""
  p = profile_from_rates([1.0, 0.5, 0.25], [2, 2, 0])
  np.testing.assert_allclose(p.shares, (0.5, 0.5, 0.0))
  np.testing.assert_allclose(p.slowdowns, (1.0, 2.0, 4.0))
  shape = r'^rates \(1\.0,\) and shares \(1\.0, 1\.0\) must be non-empty and of equal length$'
  with pytest.raises(ValueError, match=shape):
    profile_from_rates([1.0], [1, 1])
  with pytest.raises(ValueError, match=r'^rates \(\) and shares \(\) must be non-empty'):
    profile_from_rates([], [])
  for rates, shares in [([0.0, 1.0], [1, 1]), ([1.5, 1.0], [1, 1]), ([1.0, 0.5], [1, -1]),
                        ([1.0, 0.5], [0, 0])]:  # fmt: skip
    message = rf'^rates must be in \(0, 1\] and shares non-negative, got .*{shares[1]}\.0\)$'
    with pytest.raises(ValueError, match=message):
      profile_from_rates(rates, shares)


def test_devices_are_assigned_by_largest_remainder_and_durations_scale_by_class():
  """10 clients at shares 0.25 / 0.35 / 0.4: floors 2, 3, 4 and the one left to the first of the
  tied largest remainders (3, 3, 4); a duration is base × slow-down × lognormal(0, σ) noise from
  the seed's second stream, and the record keeps the median base time and its source."""
  p = profile_from_rates([1.0, 0.5, 0.25], [0.25, 0.35, 0.4])
  classes = assign_devices(10, p, seed=3)
  assert np.bincount(classes, minlength=3).tolist() == [3, 3, 4]
  d = simulated_durations(np.full(10, 2.0), 10, p, jitter=0.1, seed=3)
  noise = np.random.default_rng((3, 1)).lognormal(0.0, 0.1, 10)
  np.testing.assert_array_equal(d.device_class, classes)
  np.testing.assert_allclose(d.durations, 2.0 * np.array([1.0, 2.0, 4.0])[classes] * noise)
  assert d.base_seconds == 2.0 and d.source == 'simulated'


def test_a_durations_file_is_recorded_as_read_and_a_zero_duration_is_refused(tmp_path):
  path = tmp_path / 'durations.json'
  path.write_text('[2, 2.1, 10]')
  d = read_durations(str(path), 3)
  assert d.durations.dtype == np.float64 and d.durations.tolist() == [2.0, 2.1, 10.0]
  assert d.base_seconds == 0.0 and d.device_class.tolist() == [-1, -1, -1]
  assert d.source == str(path)
  path.write_text('[2, 0, 10]')
  with pytest.raises(ValueError, match='finite and > 0'):
    read_durations(str(path), 3)
