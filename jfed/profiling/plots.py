"""The KDE clustering figure (FedTSA, Fan et al., ECCV 2024, §4.3): the density of the clients'
proxy-task durations, the cluster boundaries at its local minima, and every client on the duration
axis coloured by cluster, with each cluster's pruning rate in the legend. Agg canvas, no global
pyplot state."""

import numpy as np

from jfed.figures import save_png
from jfed.profiling.kde import KDEClusters


def plot_kde(clusters: KDEClusters, durations, path: str, dpi: int = 120) -> None:
  # pylint: disable=g-import-not-at-top
  """Draws `clusters`' density, boundaries and clients, and saves the figure to `path`.

  Args:
    clusters: The result of `kde_clusters` on `durations`.
    durations: The clients' proxy-task durations [n].
    path: Where the PNG is written.
    dpi: Resolution.
  """
  import matplotlib
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  d = np.asarray(durations, np.float64)
  fig = Figure(figsize=(6.4, 3.6), dpi=dpi)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  ax.plot(clusters.grid, clusters.density, color='0.2', lw=1.5, label='KDE')
  for b in clusters.boundaries:
    ax.axvline(b, color='0.5', ls='--', lw=1)
  colours = matplotlib.colormaps['tab10']
  floor = -0.04 * float(np.max(clusters.density))
  for k, (mean, rate) in enumerate(zip(clusters.means, clusters.rates)):
    members = d[clusters.assignments == k]
    ax.scatter(
      members,
      np.full(len(members), floor),
      marker='|',
      s=200,
      color=colours(k % 10),
      label=f'cluster {k}: {len(members)} clients, mean {mean:.3g}s, rate {rate:.2f}',
    )
  if clusters.space == 'log':  # the density is per unit of log duration
    ax.set_xscale('log')
    ax.set_ylabel('density of log duration')
    ax.set_title(f'KDE clustering (bandwidth {clusters.bandwidth:.3g} in log seconds)')
  else:
    ax.set_ylabel('density')
    ax.set_title(f'KDE clustering (bandwidth {clusters.bandwidth:.3g}s)')
  ax.set_xlabel('proxy-task duration (s)')
  ax.legend(fontsize=7, loc='upper right')
  fig.tight_layout()
  save_png(fig, path)
