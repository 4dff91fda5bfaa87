"""FedTSA's (Fan et al., ECCV 2024) resource-oriented clustering (§4.3, Eqs. 2–4): a Gaussian kernel
density estimate of the clients' proxy-task durations; its local minima are the cluster boundaries,
and each cluster's pruning rate is the fastest cluster's mean duration over its own.

The paper (§4.3) names neither the bandwidth nor the axis. `space` is the axis the KDE runs
on: 'duration' (seconds) or 'log' (log seconds, the default in FedTSA's config): a device k
times slower sits log k further away wherever it is, and a multiplicative measurement noise has
one width for every device class. The bandwidth rule is scipy's (`scipy.stats.gaussian_kde`):
'scott', 'silverman', or a float factor that multiplies the sample standard deviation (scipy's
`bw_method`); `min_bandwidth` (in the units of `space`) is a floor on the kernel's standard
deviation. Both rules scale with the spread of the sample, so without a floor one device class
plus a 2 % noise is split at the noise's own gaps (0/20 draws of 20 clients gave one cluster).
The density is evaluated on `grid_size` points spanning the sample ± 3 bandwidths; a grid
point lower than both neighbours and lying between the fastest and the slowest client is a
boundary. Boundaries that would leave a cluster empty are dropped. Clusters are numbered
fastest first. `boundaries`, `means` and `grid` are in seconds whatever the space; `density`
and `bandwidth` are in the units of `space`.
"""

from typing import NamedTuple, Union

import numpy as np

Bandwidth = Union[str, float]


class KDEClusters(NamedTuple):
  assignments: np.ndarray  # [n] int: each client's cluster, 0 = fastest
  boundaries: np.ndarray  # [K - 1] durations separating the clusters
  means: np.ndarray  # [K] mean duration of each cluster
  rates: np.ndarray  # [K] pruning rate per cluster (1.0 for the fastest)
  grid: np.ndarray  # where the density was evaluated
  density: np.ndarray  # the KDE on the grid (per unit of `space`)
  bandwidth: float  # the kernel's standard deviation (in the units of `space`)
  space: str = 'duration'  # the axis of the KDE: 'duration' (s) or 'log' (log s)


def pruning_rates(means: np.ndarray, quantum: float = 0.0) -> np.ndarray:
  """r_k = min mean / mean_k (§4.3); with `quantum` > 0, rounded to the nearest multiple of it
  (at least one quantum), so that e.g. 0.79 and 0.81 both become 0.8 at quantum 0.1."""
  means = np.asarray(means, np.float64)
  rates = means.min() / means
  if quantum > 0:
    rates = np.round(np.maximum(np.round(rates / quantum) * quantum, quantum), 10)
    rates[np.argmin(means)] = 1.0
  return rates


def _validate(durations: np.ndarray) -> np.ndarray:
  d = np.asarray(durations, np.float64).reshape(-1)
  if d.size == 0:
    raise ValueError('no client durations to cluster')
  if not np.all(np.isfinite(d)) or np.any(d <= 0):
    raise ValueError(f'client durations must be finite and > 0, got {d.tolist()}')
  return d


SPACES = ('duration', 'log')


def kde_clusters(
  durations,
  bandwidth: Bandwidth = 'scott',
  grid_size: int = 2048,
  quantum: float = 0.0,
  space: str = 'duration',
  min_bandwidth: float = 0.0,
) -> KDEClusters:
  """Clusters 1-D durations at the local minima of their Gaussian KDE (see module doc).

  Args:
    durations: Each client's proxy-task duration [n] (seconds, > 0).
    bandwidth: 'scott', 'silverman' or a positive factor of the sample standard deviation.
    grid_size: Points the density is evaluated at.
    quantum: Rounds each pruning rate to the nearest multiple of it; 0 does not round.
    space: 'duration' or 'log' (the KDE runs on log durations).
    min_bandwidth: Lower bound on the bandwidth, in units of `space`.

  Returns:
    KDEClusters: each client's cluster (0 = fastest), boundaries, means, pruning rates and the
    density on its grid.
  """
  d = _validate(durations)
  if isinstance(bandwidth, str) and bandwidth not in ('scott', 'silverman'):
    raise ValueError(f"bandwidth must be 'scott', 'silverman' or a float, got {bandwidth!r}")
  if not isinstance(bandwidth, str) and not float(bandwidth) > 0:
    raise ValueError(f'bandwidth factor must be > 0, got {bandwidth}')
  if space not in SPACES:
    raise ValueError(f"space must be 'duration' or 'log', got {space!r}")
  if not min_bandwidth >= 0:
    raise ValueError(f'min_bandwidth must be >= 0, got {min_bandwidth}')
  if d.size < 2 or np.ptp(d) <= 1e-12 * d.max():  # one device class: nothing to split
    grid = np.array([d.min()])
    return KDEClusters(
      np.zeros(d.size, np.int64),
      np.zeros(0),
      np.array([d.mean()]),
      np.ones(1),
      grid,
      np.ones(1),
      0.0,
      space,
    )
  # scipy.stats on first use: importing it costs about 1 s of CPU, paid by every command (the
  # method registry imports this module) instead of only by FedTSA's clustering.
  from scipy import stats  # pylint: disable=g-import-not-at-top

  x = np.log(d) if space == 'log' else d
  kde = stats.gaussian_kde(x, bw_method=bandwidth)
  h = float(np.sqrt(kde.covariance[0, 0]))
  if h < min_bandwidth:  # scipy's kernel sd is factor x sample sd: a floor is a smaller factor
    kde = stats.gaussian_kde(x, bw_method=min_bandwidth / float(np.std(x, ddof=1)))
    h = float(np.sqrt(kde.covariance[0, 0]))
  grid = np.linspace(x.min() - 3 * h, x.max() + 3 * h, int(grid_size))
  density = kde(grid)
  inner = np.flatnonzero((density[1:-1] < density[:-2]) & (density[1:-1] <= density[2:])) + 1
  boundaries = [grid[i] for i in inner if x.min() < grid[i] < x.max()]
  if space == 'log':
    boundaries, grid = [float(np.exp(b)) for b in boundaries], np.exp(grid)
  kept = []
  for b in boundaries:  # keep a boundary only if clients lie on both sides of it
    lower = kept[-1] if kept else -np.inf
    if np.any((d > lower) & (d < b)) and np.any(d > b):
      kept.append(b)
  edges = np.asarray(kept)
  assignments = np.searchsorted(edges, d)
  means = np.array([d[assignments == k].mean() for k in range(len(edges) + 1)])
  return KDEClusters(
    assignments, edges, means, pruning_rates(means, quantum), grid, density, h, space
  )
