"""Cross-device scale (issue 83): memory set by the data, a round's cost set by its cohort."""

import time
import tracemalloc

import numpy as np
import pytest

import jfed
from jfed.data import federate
from jfed.data.federated import cohort_length


def _skewed_parts(n: int, clients: int, seed: int = 0):
  """One client of half the data and many small ones: padding to n_max would cost
  clients × n/2 samples."""
  order = np.random.default_rng(seed).permutation(n)
  return [order[: n // 2], *np.array_split(order[n // 2 :], clients - 1)]


def test_federating_a_skewed_split_costs_its_index_lists_not_padded_copies():
  n, clients = 20_000, 200
  x = np.random.default_rng(0).random((n, 28, 28, 1), dtype=np.float32)  # 63 MB
  y = np.arange(n) % 10
  parts = _skewed_parts(n, clients)
  tracemalloc.start()
  fed = federate(x, y, parts, pad_to_multiple=32)
  cohort = fed.take([3, 50, 199], length=64)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 0.05 * x.nbytes  # padded, it would be 200 × 10,016 samples: 100 × the data
  # the cohort holds exactly its clients' samples, in their order, zero beyond their sizes
  for row, k in enumerate([3, 50, 199]):
    size = len(parts[k])
    assert cohort.sizes[row] == size
    np.testing.assert_array_equal(cohort.x[row, :size], x[parts[k]])
    np.testing.assert_array_equal(cohort.y[row, :size], y[parts[k]])
    assert not cohort.x[row, size:].any() and not cohort.y[row, size:].any()
  # the padded arrays, where a method asks for them, are the same as before
  assert fed.x.shape == (clients, 10_016, 28, 28, 1)
  np.testing.assert_array_equal(fed.x[0, : n // 2], x[parts[0]])
  np.testing.assert_array_equal(fed.mask.sum(1), [len(p) for p in parts])


def test_a_cohort_far_smaller_than_the_largest_client_gets_its_own_bucket():
  # whole batches of the largest member, rounded up to a power of two
  assert cohort_length(np.array([3, 70, 9]), 32, 10_016) == 128
  assert cohort_length(np.array([1]), 32, 10_016) == 32
  # a federation without such a client keeps one length for every round
  assert cohort_length(np.array([300, 10]), 32, 416) == 416


@pytest.mark.slow  # ~20 s on 2 cores, most of it compiling
def test_a_round_of_100_clients_out_of_100000_one_sample_clients():
  n = 100_000
  rng = np.random.default_rng(0)
  x, y = rng.random((n, 4, 4, 1), dtype=np.float32), rng.integers(0, 10, n)
  config = jfed.config('digits', 'smoke')
  config.partition.scheme = 'iid'
  config.partition.num_clients = n
  config.dataset.holdout_size = 0
  config.model = 'mlp'
  config.fedavg.rounds = 2
  config.fedavg.participation = 100 / n
  start = time.perf_counter()
  result = jfed.run('fedavg', config, (x, y, x[:200], y[:200]))
  assert time.perf_counter() - start < 120
  assert [r['clients'] for r in result.history] == [100, 100]
  assert result.summary['num_clients'] == n


@pytest.mark.parametrize('poisson', ['sampler', 'dp'])
def test_rules_that_count_their_uploads_refuse_a_poisson_cohort(poisson):
  from jfed.driver import build_algorithm  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  config = jfed.config('digits')
  config.partition.num_clients = 50
  config.fedavg.participation = 0.5
  config.aggregation.rule = 'krum'
  build_algorithm('fedavg', config)  # 25 uploads a round: Krum's n >= 2f + 3 holds
  if poisson == 'dp':
    config.dp.enabled = True
  else:
    config.fedavg.sampler = 'poisson'
  with pytest.raises(ConfigError, match="a Poisson cohort's size varies"):
    build_algorithm('fedavg', config)
