"""Cross-device scale (issue 83): partitions, reports and client samplers at 10,000 clients.

Every expected number is computed here with NumPy or from a closed form, not with jfed:
- the count-table summary's quantiles with `np.quantile`, the figure's size from the PNG header;
- the per-client Dirichlet's class mixes against the Dirichlet-multinomial law: the share of
  single-class clients, C * prod_{j<s} (alpha + j) / (C alpha + j) for clients of s samples, and
  the mean class entropy of an independent NumPy draw of Dir(alpha) proportions and multinomial
  counts;
- the log-normal and Pareto client sizes against their quantile functions;
- each sampler's inclusion rate against its formula (uniform m/N, Poisson q, size-weighted the
  exact inclusion probabilities of successive sampling, enumerated over every ordered draw).
"""

import itertools
import re
import time
import types

import jax
import numpy as np
import pytest
from scipy import stats

from jfed import api
from jfed.configs.base import PARTITION_ARGUMENTS, base_config
from jfed.data import partitions, plots
from jfed.driver import build_algorithm
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common
from tests import oracle_numpy as onp
from tests.test_oracle_fedavg import (
  BATCH,
  LR,
  MOMENTUM,
  NARROW,
  _client_data,
  _config,
  _context,
  _init_params,
  _run,
)

N_CLIENTS = 10_000
N_SAMPLES = 60_000
C = 10


def _balanced_labels(seed: int = 0) -> np.ndarray:
  """60,000 labels, 6,000 of each of 10 classes, in random order (Fashion-MNIST's train split)."""
  return np.random.default_rng(seed).permutation(np.repeat(np.arange(C), N_SAMPLES // C))


def _counts(labels, parts) -> np.ndarray:
  return np.stack([np.bincount(labels[p], minlength=C) for p in parts])


def _entropy(counts: np.ndarray) -> np.ndarray:
  """Per row, the entropy (nats) of the row's empirical class distribution."""
  p = counts / counts.sum(axis=1, keepdims=True)
  with np.errstate(divide='ignore', invalid='ignore'):
    return -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)


def _random_count_table(seed: int = 0) -> np.ndarray:
  """A [10000, 10] table drawn in NumPy: Poisson(6) sizes (some clients empty), Dir(0.3) mixes."""
  rng = np.random.default_rng(seed)
  sizes = rng.poisson(6, N_CLIENTS)
  return rng.multinomial(sizes, rng.dirichlet(np.full(C, 0.3), N_CLIENTS))


def _png_size(path) -> tuple:
  """(width, height) in pixels, read from the PNG's IHDR chunk."""
  with open(path, 'rb') as f:
    head = f.read(24)
  assert head[:8] == b'\x89PNG\r\n\x1a\n' and head[12:16] == b'IHDR'
  return int.from_bytes(head[16:20], 'big'), int.from_bytes(head[20:24], 'big')


# ---------------------------------------------------------------------------------------------
# reports: partition.png and partition.txt
# ---------------------------------------------------------------------------------------------


def test_partition_figure_of_10000_clients_is_bounded_and_fast(tmp_path):
  table = _random_count_table()
  start = time.perf_counter()
  path = plots.plot_partition_bubbles(table, tmp_path / 'partition.png', title='10,000 clients')
  elapsed = time.perf_counter() - start
  width, height = _png_size(path)
  # 12 x 4.5 inches at 120 dpi; the bubble plot was 720,180 px wide (43 MB) at this size
  assert (width, height) == (1440, 540)
  assert (tmp_path / 'partition.png').stat().st_size < 1_000_000
  assert elapsed < 5.0, f'{elapsed:.1f} s'


@pytest.mark.parametrize('num_clients, width', [(100, (0.6 * 100 + 1.5) * 120), (101, 1440)])
def test_bubble_plot_up_to_100_clients_then_the_bounded_summary(tmp_path, num_clients, width):
  table = _random_count_table()[:num_clients]
  path = plots.plot_partition_bubbles(table, tmp_path / 'p.png')
  assert _png_size(path)[0] == int(width)


def _summary_row(text: str, label: str) -> list:
  (line,) = [line for line in text.splitlines() if line.split()[:1] == [label]]
  return [float(v) for v in line.split()[1:]]


def test_count_table_of_10000_clients_is_a_summary_with_numpys_numbers():
  table = _random_count_table()
  text = partitions.format_count_table(table)
  lines = text.splitlines()
  assert len(lines) < 30
  sizes, classes = table.sum(axis=1), np.count_nonzero(table, axis=1)
  first = re.fullmatch(
    r'(\d+) clients, (\d+) samples, (\d+) classes; (\d+) clients empty .*', lines[0]
  )
  assert first is not None, lines[0]
  assert [int(g) for g in first.groups()] == [
    N_CLIENTS,
    int(sizes.sum()),
    C,
    int(np.sum(sizes == 0)),
  ]
  assert np.sum(sizes == 0) > 0  # the table has empty clients to count
  (header,) = [line.split() for line in lines if line.split()[:2] == ['per', 'client']]
  assert header[2:] == ['min', 'p10', 'p25', 'median', 'p75', 'p90', 'max', 'mean']
  q = [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1]
  for label, values in (('samples', sizes), ('classes', classes)):
    row = _summary_row(text, label)
    np.testing.assert_allclose(row[:-1], np.quantile(values, q), rtol=1e-6)
    assert row[-1] == pytest.approx(values.mean(), rel=1e-3)
  # the first and last five clients' rows, then the totals per class
  for i in (0, 1, 2, 3, 4, 9995, 9996, 9997, 9998, 9999):
    assert _summary_row(text, str(i)) == [*table[i], table[i].sum()]
  assert '...' in lines
  assert lines[-1].split() == ['total', *map(str, table.sum(axis=0)), str(table.sum())]


def test_count_table_of_100_clients_lists_every_client():
  table = _random_count_table()[:100]
  lines = partitions.format_count_table(table).splitlines()
  assert len(lines) == 100 + 4  # header, rule, 100 clients, rule, totals
  assert [line.split()[0] for line in lines[2:-2]] == [str(i) for i in range(100)]


# ---------------------------------------------------------------------------------------------
# cross-device partitions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'scheme, kwargs',
  [
    ('client_dirichlet', {'alpha': 0.5}),
    ('client_dirichlet', {'alpha': 0.1, 'size_distribution': 'equal'}),
    ('client_dirichlet', {'alpha': 0.01, 'size_distribution': 'powerlaw'}),
    ('unbalanced_iid', {}),
    ('unbalanced_iid', {'size_distribution': 'powerlaw', 'size_exponent': 0.8}),
  ],
)
def test_10000_clients_of_60000_samples_in_well_under_seconds(scheme, kwargs):
  labels = _balanced_labels()
  start = time.perf_counter()
  parts = partitions.make_partition(labels, N_CLIENTS, scheme, seed=0, **kwargs)
  elapsed = time.perf_counter() - start
  assert elapsed < 3.0, f'{elapsed:.2f} s'
  assert len(parts) == N_CLIENTS
  assert all(p.dtype == np.int64 and len(p) >= 1 for p in parts)
  flat = np.concatenate(parts)
  assert len(np.unique(flat)) == len(flat) == N_SAMPLES  # every sample exactly once


def test_the_niid_bench_dirichlet_cannot_do_what_the_per_client_one_does():
  # the motivation: Dir(0.1) over 1,000 clients with min_size 1 (issue 83) is refused after its
  # redraws, the per-client Dirichlet gives every client at least one sample at once
  labels = _balanced_labels()
  with pytest.raises(partitions.PartitionError, match='in 3 tries'):
    partitions.partition_dirichlet(labels, 1000, alpha=0.1, seed=0, min_size=1, max_tries=3)
  parts = partitions.partition_client_dirichlet(labels, 1000, alpha=0.1, seed=0)
  assert min(len(p) for p in parts) >= 1


@pytest.mark.parametrize('alpha', [0.1, 0.5, 2.0])
def test_client_dirichlet_class_mixes_follow_the_dirichlet_multinomial_law(alpha):
  labels = _balanced_labels(1)
  parts = partitions.partition_client_dirichlet(
    labels, N_CLIENTS, alpha, seed=3, size_distribution='equal'
  )
  counts = _counts(labels, parts)
  assert (counts.sum(axis=1) == 6).all()
  # P(all s samples of one class) = C E[p^s], p ~ Beta(alpha, (C - 1) alpha)
  single = C * np.prod([(alpha + j) / (C * alpha + j) for j in range(6)])
  sd = np.sqrt(single * (1 - single) / N_CLIENTS)
  observed = np.mean(np.count_nonzero(counts, axis=1) == 1)
  # + a margin for the few samples that step 3's dry pools send elsewhere
  assert abs(observed - single) < 4 * sd + 0.003, (observed, single)
  rng = np.random.default_rng(12345)
  reference = rng.multinomial(6, rng.dirichlet(np.full(C, alpha), N_CLIENTS))
  assert _entropy(counts).mean() == pytest.approx(_entropy(reference).mean(), abs=0.02)


def test_client_dirichlet_with_a_large_alpha_is_iid_by_chi_square():
  labels = _balanced_labels(2)
  parts = partitions.partition_client_dirichlet(
    labels, 1000, alpha=1e4, seed=0, size_distribution='equal'
  )
  counts = _counts(labels, parts)
  expected = counts.sum(axis=1, keepdims=True) / C
  chi2 = ((counts - expected) ** 2 / expected).sum()
  df = counts.shape[0] * (C - 1)
  assert abs(chi2 - df) < 5 * np.sqrt(2 * df), (chi2, df)


@pytest.mark.parametrize('scheme', ['unbalanced_iid', 'client_dirichlet'])
def test_lognormal_sizes_have_the_lognormal_quantiles(scheme):
  # size - 1 = w (N - n) / sum(w), log w ~ N(0, sigma^2): log quantiles are
  # log((N - n) / n) - sigma^2 / 2 + sigma z_p once sum(w) / n is near E[w] = exp(sigma^2 / 2)
  n, total, sigma = N_CLIENTS, 600_000, 1.0
  labels = np.random.default_rng(0).integers(0, C, total)
  alpha = {'alpha': 0.5} if scheme == 'client_dirichlet' else {}
  parts = partitions.make_partition(
    labels, n, scheme, seed=5, size_distribution='lognormal', size_sigma=sigma, **alpha
  )
  sizes = np.array([len(p) for p in parts])
  assert sizes.sum() == total and sizes.min() >= 1
  q = np.array([0.1, 0.25, 0.5, 0.75, 0.9])
  want = np.log((total - n) / n) - sigma**2 / 2 + sigma * stats.norm.ppf(q)
  np.testing.assert_allclose(np.log(np.quantile(sizes - 1, q)), want, atol=0.07)


@pytest.mark.parametrize('exponent', [1.5, 3.0])
def test_powerlaw_sizes_have_the_pareto_quantile_ratios(exponent):
  # P(w > x) = x^-a: the p-quantile over the median is ((1 - p) / 0.5)^(-1/a), whatever the scale
  n, total = N_CLIENTS, 600_000
  labels = np.zeros(total, np.int64)
  parts = partitions.partition_unbalanced_iid(
    labels, n, seed=2, size_distribution='powerlaw', size_exponent=exponent
  )
  sizes = np.array([len(p) for p in parts]) - 1.0
  q = np.array([0.1, 0.25, 0.75, 0.9, 0.95])
  want = -np.log((1 - q) / 0.5) / exponent

  def log_quantile_se(p):  # sqrt(p (1 - p) / n) / (f(x_p) x_p), f(x) x = a (1 - p) for Pareto
    return np.sqrt(p * (1 - p) / n) / (exponent * (1 - p))

  got = np.log(np.quantile(sizes, q) / np.median(sizes))
  # + 0.02 for the rounding of sizes to whole samples
  tolerance = 4.5 * (log_quantile_se(q) + log_quantile_se(0.5)) + 0.02
  assert (np.abs(got - want) < tolerance).all(), (got, want, tolerance)


def test_unbalanced_iid_with_equal_sizes_is_a_near_equal_split():
  parts = partitions.partition_unbalanced_iid(
    np.zeros(1003, np.int64), 10, seed=0, size_distribution='equal'
  )
  assert sorted(len(p) for p in parts) == [100] * 7 + [101] * 3


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'size_distribution': 'zipf'}, "size_distribution is 'zipf'; valid: equal, lognormal"),
    ({'size_sigma': -1.0}, 'size_sigma must be >= 0, got -1.0'),
    ({'size_distribution': 'powerlaw', 'size_exponent': 0.0}, 'size_exponent must be > 0'),
    ({'alpha': 0.0}, 'alpha must be > 0'),
  ],
)
def test_bad_size_arguments_are_partition_errors(kwargs, match):
  labels = _balanced_labels()
  with pytest.raises(partitions.PartitionError, match=match):
    partitions.partition_client_dirichlet(labels, 100, **{'alpha': 0.5, 'seed': 0, **kwargs})


def test_the_schemes_take_their_arguments_from_the_config():
  assert partitions.partition_arguments('client_dirichlet') == (
    'alpha',
    'size_distribution',
    'size_sigma',
    'size_exponent',
  )
  assert partitions.partition_arguments('unbalanced_iid') == (
    'size_distribution',
    'size_sigma',
    'size_exponent',
  )
  config = base_config()
  for key in ('size_distribution', 'size_sigma', 'size_exponent'):
    assert config.partition[key] == PARTITION_ARGUMENTS[key]
  config.partition.num_clients = N_CLIENTS
  config.partition.scheme = 'unbalanced_iid'
  config.partition.size_distribution = 'powerlaw'
  config.partition.size_exponent = 1.0
  labels = _balanced_labels()
  got = api.partition_clients(config, labels)
  want = partitions.partition_unbalanced_iid(
    labels, N_CLIENTS, config.seed, size_distribution='powerlaw', size_exponent=1.0
  )
  assert all(np.array_equal(a, b) for a, b in zip(got, want))
  config.partition.scheme = 'client_dirichlet'
  config.partition.alpha = 0.05
  assert len(api.partition_clients(config, labels)) == N_CLIENTS


# ---------------------------------------------------------------------------------------------
# client samplers
# ---------------------------------------------------------------------------------------------

# FedAvg's rounds' clients before `sampler` existed (jfed/methods/common.py `select_clients` at
# the commit before, with `ctx.derive_key(Purpose.SAMPLING, r)`), rounds 0-5 of the tiny problem
RECORDED_UNIFORM = {
  (10, 0.3): [[0, 3, 9], [2, 6, 8], [7, 8, 9], [0, 3, 5], [2, 8, 9], [1, 5, 7]],
  (12, 0.5): [
    [0, 1, 3, 4, 9, 11],
    [1, 2, 4, 5, 6, 8],
    [0, 1, 7, 8, 9, 11],
    [0, 3, 5, 6, 9, 11],
    [2, 5, 7, 8, 9, 10],
    [1, 5, 6, 7, 8, 11],
  ],
}
NO_DP = types.SimpleNamespace(dp=None)


def _cohorts(method: str, sizes, rounds: int, **overrides):
  """The (selected ids, padding, weights) of `rounds` rounds as the method draws them."""
  config = _config(len(sizes), **{f'{method}.{k}': v for k, v in overrides.items()})
  algorithm = build_algorithm(method, config)
  ctx = _context(config, sizes)
  return [algorithm.cohort(ctx, NO_DP, r) for r in range(rounds)]


@pytest.mark.parametrize('method', ['fedavg', 'fedprox'])
@pytest.mark.parametrize('num_clients, participation', sorted(RECORDED_UNIFORM))
def test_uniform_sampler_draws_the_clients_it_drew_before(method, num_clients, participation):
  drawn = _cohorts(method, (8,) * num_clients, 6, participation=participation)
  for (selected, padding, weights), want in zip(
    drawn, RECORDED_UNIFORM[num_clients, participation]
  ):
    assert padding is None and weights is None
    assert selected.dtype == np.int32 and selected.tolist() == want


def test_uniform_sampler_includes_every_client_at_rate_m_over_n():
  n, participation, rounds = 20, 0.25, 400
  drawn = _cohorts('fedavg', (4,) * n, rounds, participation=participation)
  hits = np.zeros(n)
  for selected, _, _ in drawn:
    assert len(set(selected.tolist())) == len(selected) == 5
    hits[selected] += 1
  rate = 5 / n
  assert abs(hits.sum() / (n * rounds) - rate) < 1e-12  # fixed size: exactly m per round
  assert np.abs(hits / rounds - rate).max() < 4.5 * np.sqrt(rate * (1 - rate) / rounds)


def test_poisson_sampler_includes_each_client_with_probability_q():
  n, q, rounds = 20, 0.2, 1000
  drawn = _cohorts('fedprox', (4,) * n, rounds, participation=q, sampler='poisson')
  hits, cohort_sizes = np.zeros(n), []
  for ids, padding, weights in drawn:
    assert weights is None
    selected = ids if padding is None else ids[~padding]
    hits[selected] += 1
    cohort_sizes.append(len(selected))
  se = np.sqrt(q * (1 - q) / (n * rounds))
  assert abs(hits.sum() / (n * rounds) - q) < 4.5 * se
  assert np.abs(hits / rounds - q).max() < 4.5 * np.sqrt(q * (1 - q) / rounds)
  # Binomial(N, q) cohorts, not a fixed size: variance N q (1 - q) = 3.2
  assert np.var(cohort_sizes) == pytest.approx(n * q * (1 - q), rel=0.2)


def _successive_inclusion(p: np.ndarray, m: int) -> np.ndarray:
  """Exact inclusion probabilities of m draws without replacement, each proportional to p among
  the units not yet drawn: the sum over every ordered draw of its probability."""
  pi = np.zeros(len(p))
  for draw in itertools.permutations(range(len(p)), m):
    prob, left = 1.0, 1.0
    for k in draw:
      prob *= p[k] / left
      left -= p[k]
    pi[list(draw)] += prob
  return pi


@pytest.mark.parametrize('sizes, m', [((1, 1, 1, 7), 2), ((1, 2, 3, 4, 10), 3)])
def test_size_weighted_sampler_has_the_inclusion_probabilities_of_successive_sampling(sizes, m):
  rounds = 3000
  p = np.asarray(sizes, np.float64) / sum(sizes)
  pi = _successive_inclusion(p, m)
  assert pi.sum() == pytest.approx(m)
  hits = np.zeros(len(sizes))
  root = jax.random.key(11)
  for r in range(rounds):
    selected = common.size_weighted_clients(jax.random.fold_in(root, r), sizes, m)
    assert len(np.unique(selected)) == m
    hits[selected] += 1
  tolerance = 4.5 * np.sqrt(pi * (1 - pi) / rounds) + 1e-9
  assert (np.abs(hits / rounds - pi) < tolerance).all(), (hits / rounds, pi)
  # and not the naive m * p (which exceeds 1 for the largest client of the first case)
  assert np.abs(pi - np.minimum(m * p, 1)).max() > 0.05


def test_size_weighted_sampler_in_fedavg_draws_m_clients_with_equal_weights():
  sizes = (2, 4, 6, 8, 20, 40)
  drawn = _cohorts('fedavg', sizes, 300, participation=0.5, sampler='size_weighted')
  hits = np.zeros(len(sizes))
  for selected, padding, weights in drawn:
    assert padding is None and len(selected) == 3
    np.testing.assert_array_equal(weights, np.ones(3))
    hits[selected] += 1
  pi = _successive_inclusion(np.asarray(sizes) / sum(sizes), 3)
  assert np.abs(hits / 300 - pi).max() < 4.5 * np.sqrt(0.25 / 300)


def test_size_weighted_sampler_never_draws_an_empty_client_and_refuses_too_few():
  key = jax.random.key(0)
  for r in range(50):
    got = common.size_weighted_clients(jax.random.fold_in(key, r), [3, 0, 5, 0, 1], 3)
    assert got.tolist() == [0, 2, 4]
  with pytest.raises(ConfigError, match='needs as many non-empty clients; 3 of 5 hold samples'):
    common.size_weighted_clients(key, [3, 0, 5, 0, 1], 4)


@pytest.mark.parametrize(
  'overrides, message',
  [
    (
      {'fedavg.sampler': 'weighted'},
      "fedavg.sampler is 'weighted'; valid: uniform, poisson, size_weighted",
    ),
    (
      {'fedavg.sampler': 'size_weighted', 'dp.enabled': True},
      "fedavg.sampler='size_weighted' is not the uniform Poisson sampling the DP accountant "
      "assumes: use 'uniform' or 'poisson' with dp.enabled",
    ),
    (
      {'fedavg.sampler': 'poisson', 'dp.enabled': True, 'dp.local': True},
      "fedavg.sampler='poisson': dp.local draws fixed-size uniform cohorts (it claims no "
      "amplification by sampling): use 'uniform'",
    ),
  ],
)
def test_a_bad_sampler_is_refused_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=f'^{re.escape(message)}$'):
    build_algorithm('fedavg', _config(10, **overrides))


def test_poisson_sampler_with_server_side_dp_is_the_dp_sampling():
  build_algorithm('fedavg', _config(10, **{'fedavg.sampler': 'poisson', 'dp.enabled': True}))
  build_algorithm('fedprox', _config(10, **{'fedprox.sampler': 'uniform', 'dp.enabled': True}))


# ---------------------------------------------------------------------------------------------
# whole rounds with the new samplers, against a NumPy FedAvg round
# ---------------------------------------------------------------------------------------------

SIZES4 = (23, 41, 12, 17)


def _oracle_round(ctx, r: int, global_params, clients, weights):
  """FedAvg round r by hand (as tests/test_oracle_fedavg.py's oracle): `clients` train one
  epoch of SGD from the global model and are averaged with `weights`."""
  key = ctx.derive_key(Purpose.ROUNDS, r)
  models = []
  for k in clients:
    x, y = _client_data(ctx, k)
    params, _, _ = onp.mlp_local_sgd(
      global_params, x, y, onp.epoch_orders(key, k, len(y), 1), BATCH, LR, MOMENTUM
    )
    models.append(params)
  return onp.weighted_average(models, weights)


def test_a_size_weighted_round_averages_its_clients_equally():
  config = _config(4, **{'fedavg.rounds': 2, 'fedavg.participation': 0.5})
  config.fedavg.sampler = 'size_weighted'
  _, rec, ctx = _run('fedavg', config, SIZES4)
  params = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  sizes = np.asarray(SIZES4)
  for r in range(2):
    clients = common.size_weighted_clients(ctx.derive_key(Purpose.SAMPLING, r), sizes, 2)
    params = _oracle_round(ctx, r, params, clients.tolist(), [1.0, 1.0])
    onp.assert_tree_close(rec.states[r].model.params, params)
    assert rec.records[r][0]['clients'] == 2


def test_a_poisson_round_averages_its_cohort_by_size_and_an_empty_one_changes_nothing(
  monkeypatch,
):
  config = _config(4, **{'fedavg.rounds': 2, 'fedavg.participation': 0.5})
  config.fedavg.sampler = 'poisson'
  # momentum would move the model on the zero pseudo-gradient of an empty round
  config.server_optimizer.name = 'fedavgm'
  config.server_optimizer.lr = 1.0
  config.server_optimizer.momentum = 0.9
  real = common.poisson_clients
  second = jax.random.key_data(_context(config, SIZES4).derive_key(Purpose.SAMPLING, 1))

  def none_in_round_2(key, num_clients, rate):
    if np.array_equal(jax.random.key_data(key), second):
      return np.zeros(0, np.int64)
    return real(key, num_clients, rate)

  monkeypatch.setattr(common, 'poisson_clients', none_in_round_2)
  _, rec, ctx = _run('fedavg', config, SIZES4)
  clients = real(ctx.derive_key(Purpose.SAMPLING, 0), 4, 0.5).tolist()
  assert 0 < len(clients) < 4 and rec.records[0][0]['clients'] == len(clients)
  params = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  # FedAvgM's first step from zero velocity at server lr 1 lands on the aggregate
  want = _oracle_round(ctx, 0, params, clients, [SIZES4[k] for k in clients])
  onp.assert_tree_close(rec.states[0].model.params, want)
  assert rec.records[1][0]['clients'] == 0
  onp.assert_tree_close(rec.states[1].model.params, rec.states[0].model.params, 0, 0)
