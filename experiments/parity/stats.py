"""The statistics of a parity table: paired by seed (both sides of a seed share its partition).

"jfed differs from the reference" only from a two-sided paired t-test at 5 %; "jfed matches the
reference" only from an equivalence test (two one-sided paired t-tests, TOST) at a stated margin,
never from a non-significant difference.
"""

from typing import NamedTuple, Sequence

import numpy as np

LEVEL = 0.05
MARGIN = 2.0  # points of accuracy: the parity margin


class Verdict(NamedTuple):
  seeds: int
  mean_difference: float  # jfed − reference, points
  difference_p: float  # two-sided paired t-test; NaN with fewer than 2 seeds
  equivalence_p: float  # TOST at ±margin; NaN with fewer than 2 seeds
  margin: float
  verdict: str  # 'equivalent', 'different', 'inconclusive' or 'too few seeds'


def paired_verdict(
  jfed: Sequence[float], reference: Sequence[float], margin: float = MARGIN, level: float = LEVEL
) -> Verdict:
  """The verdict on values paired by seed (in accuracy points).

  'equivalent': TOST rejects |mean difference| ≥ margin at `level`; 'different': the paired
  t-test rejects a zero mean difference at `level` (and TOST does not show equivalence);
  'inconclusive': neither.
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top  # ~1 s of imports, used here only

  a, b = np.asarray(jfed, np.float64), np.asarray(reference, np.float64)
  if a.shape != b.shape:
    raise ValueError(f'paired values differ in length: {a.shape} vs {b.shape}')
  d = a - b
  n = len(d)
  if n < 2:
    mean = float(d.mean()) if n else float('nan')
    return Verdict(n, mean, float('nan'), float('nan'), margin, 'too few seeds')
  mean = float(d.mean())
  if np.all(d == d[0]):  # no spread: the t statistics are infinite
    p_diff = 1.0 if mean == 0 else 0.0
    p_eq = 0.0 if abs(mean) < margin else 1.0
  else:
    p_diff = float(stats.ttest_1samp(d, 0.0).pvalue)
    p_low = float(stats.ttest_1samp(d, -margin, alternative='greater').pvalue)
    p_high = float(stats.ttest_1samp(d, margin, alternative='less').pvalue)
    p_eq = max(p_low, p_high)
  if p_eq < level:
    verdict = 'equivalent'
  elif p_diff < level:
    verdict = 'different'
  else:
    verdict = 'inconclusive'
  return Verdict(n, mean, p_diff, p_eq, margin, verdict)


def mean_std(values: Sequence[float]) -> str:
  v = np.asarray(values, np.float64)
  if not len(v):
    return '—'
  if len(v) == 1:
    return f'{v[0]:.2f}'
  return f'{v.mean():.2f} ± {v.std(ddof=1):.2f}'
