"""The statistics of experiments/parity/partitions.py: jfed's partitions against the authors'
partition functions as distributions. No torch and no reference code: the "reference" here is
jfed itself under other seeds or another scheme."""

import json
import math

from absl import flags
import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.parity import partitions as pp

# 10 classes of 200 samples: big enough for the Dirichlet schemes' min_size, fast to partition.
LABELS = np.repeat(np.arange(10), 200)
PERMUTATIONS = 199


def _draws(scheme, seeds, num_clients=5, **kwargs):
  return pp.jfed_draws(LABELS, scheme, num_clients, seeds, **kwargs)


def _row(rows, statistic):
  (row,) = [r for r in rows if r.statistic == statistic]
  return row


def test_summarize_counts_classes_unassigned_and_doubly_held_samples():
  labels = np.array([0, 0, 1, 1, 2, 2])
  s = pp.summarize(labels, [[0, 2, 3], [3, 4]], 3)
  assert s['sizes'] == [3, 2]
  assert s['class_counts'] == [[1, 2, 0], [0, 1, 1]]
  assert s['unassigned'] == 2  # samples 1 and 5
  assert s['duplicates'] == 1  # sample 3
  assert pp.summarize(labels, [[0, 1, 2], [3, 4, 5]], 3)['unassigned'] == 0


def test_same_procedure_under_two_seed_ranges_is_not_flagged():
  a = _draws('dirichlet', range(60), alpha=0.5)
  b = _draws('dirichlet', range(1000, 1060), alpha=0.5)
  rows = pp.compare(a, b, 5, PERMUTATIONS)
  summary = pp.pair_verdict(rows)
  assert summary['verdict'] == 'no evidence of a difference', summary
  assert not summary['holm']
  sizes = _row(rows, 'client size, rank 1 (largest first)')
  assert sizes.verdict == 'no evidence of a difference' and sizes.p > 0.05
  assert sizes.jfed_mean == pytest.approx(np.mean([max(d['sizes']) for d in a]))


def test_clearly_different_procedures_are_flagged():
  dirichlet = _draws('dirichlet', range(60), alpha=0.5)
  iid = _draws('iid', range(60))
  rows = pp.compare(dirichlet, iid, 5, PERMUTATIONS)
  summary = pp.pair_verdict(rows)
  assert summary['verdict'] == 'differ'
  for statistic in (
    'client size, rank 1 (largest first)',
    'client size, rank 5 (largest first)',
    'samples per (client, class)',
  ):
    assert statistic in summary['holm']
    row = _row(rows, statistic)
    assert row.verdict == 'differ' and row.p < 0.01
  # iid clients hold 400 samples each and every class.
  assert _row(rows, 'client size, rank 1 (largest first)').reference_mean == 400
  assert _row(rows, 'classes per client (count > 0)').reference_mean == 10


def test_a_subtler_difference_is_flagged_too():
  """Same scheme, alpha 0.5 against 0.2: the class mix per client changes."""
  rows = pp.compare(
    _draws('dirichlet', range(60), alpha=0.5),
    _draws('dirichlet', range(60), alpha=0.2),
    5,
    PERMUTATIONS,
  )
  assert _row(rows, 'classes per client (count > 0)').verdict == 'differ'
  assert pp.pair_verdict(rows)['verdict'] == 'differ'


def test_ks_rows_use_scipy_and_recognise_equal_constants():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=50), rng.normal(0.8, size=50)
  row = pp.ks_row('x', a, b)
  ref = scipy_stats.ks_2samp(a, b)
  assert row.distance == pytest.approx(ref.statistic) and row.p == pytest.approx(ref.pvalue)
  assert row.test == 'KS' and row.jfed_mean == pytest.approx(a.mean())
  same = pp.ks_row('x', [6000] * 10, [6000] * 10)
  assert same.verdict == 'identical (constant)' and same.p == 1.0
  # two different constants are not identical: D = 1
  apart = pp.ks_row('x', [1] * 10, [2] * 10)
  assert apart.distance == 1.0 and apart.p < 0.05
  assert pp.ks_row('x', [1.0], [1.0, 2.0]).verdict == 'n/a'


def test_draw_permutation_p_counts_relabellings_of_whole_draws():
  """3 draws of 0s against 3 draws of 1s: D = 1; of the C(6, 3) = 20 relabellings of draws, 2
  separate the sides completely, so p -> 2/20. A per-value permutation (300 zeros against 300
  ones) would give p ~ 1e-178 instead."""
  jfed = [np.zeros(100)] * 3
  reference = [np.ones(100)] * 3
  d, p = pp.draw_permutation_ks(jfed, reference, permutations=2000, seed=1)
  assert d == 1.0
  assert p == pytest.approx(0.1, abs=0.02)  # ± 3 standard errors of 2000 relabellings
  # the observed distance is ks_2samp's on the pooled values
  rng = np.random.default_rng(2)
  a = [rng.integers(0, 5, size=7) for _ in range(4)]
  b = [rng.integers(1, 6, size=7) for _ in range(5)]
  d, p = pp.draw_permutation_ks(a, b, permutations=99)
  assert d == pytest.approx(scipy_stats.ks_2samp(np.concatenate(a), np.concatenate(b)).statistic)
  assert 1 / 100 <= p <= 1
  # identical sides: every relabelling reaches the observed D = 0, so p is 1
  assert pp.draw_permutation_ks([a[0]], [a[0]], permutations=20)[1] == 1.0


def test_refusals_are_compared_by_fisher_exact_test():
  ok = [{'seed': 0, 'sizes': [1, 1], 'class_counts': [[1], [1]], 'unassigned': 0, 'duplicates': 0}]
  refused = [{'seed': 0, 'error': 'ValueError: no'}]
  row = pp.fisher_row('r', [False] * 20, [True] * 20)
  assert row.verdict == 'differ' and row.distance == 1.0
  assert row.p == pytest.approx(scipy_stats.fisher_exact([[0, 20], [20, 0]]).pvalue)
  assert pp.fisher_row('r', [True] * 5, [True] * 5).verdict == 'identical (constant)'
  assert pp.fisher_row('r', [True, False] * 10, [False, True] * 10).verdict == (
    'no evidence of a difference'
  )
  rows = pp.compare(ok * 20, refused * 20, 2, PERMUTATIONS)
  assert _row(rows, 'draws refused (raised)').verdict == 'differ'
  # nothing to compare the distributions on: n/a, not "no difference"
  assert _row(rows, 'client size, rank 1 (largest first)').verdict == 'n/a'
  assert _row(rows, 'samples per (client, class)').verdict == 'n/a'


def test_jfed_refusals_are_recorded_per_draw():
  draws = _draws('feddf_dirichlet', range(3), num_clients=5, alpha=0.5)
  assert all(d['error'].startswith('PartitionError') for d in draws)
  assert [d['seed'] for d in draws] == [0, 1, 2]
  # both sides refusing every draw: nothing differs, and nothing but the refusals is compared
  both = pp.pair_verdict(pp.compare(draws, draws, 5, PERMUTATIONS))
  assert both['verdict'] == 'identical (every tested row constant)' and both['tested'] == 2
  shards = _draws('shards', range(20), k=2)
  # #C=2 on 5 clients of 10 classes: classes nobody owns are dropped, nearly every draw
  assert sum(d['unassigned'] > 0 for d in shards) >= 18


def test_holm_steps_down_and_skips_missing_p_values():
  assert pp.holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
  assert pp.holm([0.01, 0.02, 0.03]) == [True, True, True]  # 0.01<1/60, 0.02<1/40, 0.03<1/20
  assert pp.holm([math.nan, 0.02, 0.2]) == [False, True, False]
  assert pp.holm([0.06]) == [False]


def test_report_names_the_pair_rows_and_verdicts():
  pair = pp.PAIRS[0]
  jfed = _draws('dirichlet', range(8), alpha=0.5)
  reference = {'commit': 'abc123def456', 'draws': _draws('iid', range(8))}
  result = json.loads(json.dumps(pp.evaluate(pair, jfed, reference, permutations=49)))
  text = pp.render([pair], {pair.name: result}, 'header line')
  assert f'## {pair.name}' in text and 'zj-jayzhang/DENSE@abc123def4' in text
  assert '| client size, rank 1 (largest first) |' in text
  assert '| differ |' in text and '**Pair: differ.**' in text
  assert f'| {pair.name} | 8 |' in text and 'seeds 0..7' in text


def test_pairs_and_cached_reference_requests(tmp_path):
  names = [p.name for p in pp.PAIRS]
  assert len(set(names)) == len(names)
  assert {p.scheme for p in pp.PAIRS} == {
    'dirichlet',
    'feddf_dirichlet',
    'fedcvae_dirichlet',
    'shards',
  }
  pair = [p for p in pp.PAIRS if p.name == 'dense_dirichlet_a0.1'][0]
  request = pp._reference_request(pair, range(3))
  assert request == {'reference': 'dense', 'num_clients': 5, 'alpha': 0.1, 'seeds': [0, 1, 2]}
  path = tmp_path / 'reference.json'
  stored = {'reference': 'dense', 'num_clients': 5, 'alpha': 0.1, 'k': 2, 'draws': []}
  stored['draws'] = [{'seed': s, 'error': 'x'} for s in range(3)]
  stored['labels_sha256'] = pp._shim().labels_sha256(LABELS)
  path.write_text(json.dumps(stored))
  assert pp._cached(path, request) == stored
  assert pp._cached(path, pp._reference_request(pair, range(3), LABELS)) == stored
  assert pp._cached(path, pp._reference_request(pair, range(3), LABELS[::-1])) is None
  assert pp._cached(path, pp._reference_request(pair, range(1, 4))) is None  # other seeds
  other = [p for p in pp.PAIRS if p.name == 'dense_dirichlet_a0.5'][0]
  assert pp._cached(path, pp._reference_request(other, range(3))) is None  # other alpha


def test_importing_the_module_defines_no_flags():
  """Its flags are defined only when run as a program (another harness shares flag names)."""
  assert 'permutations' not in flags.FLAGS
