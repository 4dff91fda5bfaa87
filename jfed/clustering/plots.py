"""The HFLDD topology figure (Shi et al., arXiv 2409.17517, Fig. 4).

Clients are nodes coloured by homogeneous cluster, grouped into heterogeneous clusters: one star
per cluster, the head in the centre (a larger star marker), its members around it, edges
member -> head.

Uses the object-oriented matplotlib API with the Agg canvas, so it never touches the global
pyplot backend/state.
"""

import math
from typing import Optional, Sequence

import numpy as np

from jfed.figures import save_png


def topology_layout(
  clusters: Sequence[Sequence[int]], heads: Sequence[int], num_clients: Optional[int] = None
) -> np.ndarray:
  """Node positions [m, 2]: cluster stars on a grid, the head at each star's centre.

  Args:
    clusters: Per cluster, the ids of its clients.
    heads: Per cluster, the id of its head.
    num_clients: m; None takes the largest id + 1.

  Returns:
    Positions [m, 2] (clients in no cluster stay at the origin).
  """
  m = num_clients if num_clients is not None else 1 + max(int(c) for cl in clusters for c in cl)
  pos = np.zeros((m, 2))
  n = len(clusters)
  cols = max(1, math.ceil(math.sqrt(n)))
  for k, (cl, h) in enumerate(zip(clusters, heads)):
    cx, cy = 3.2 * (k % cols), -3.6 * (k // cols)
    pos[int(h)] = (cx, cy)
    members = [int(c) for c in cl if int(c) != int(h)]
    for j, c in enumerate(members):
      a = 2 * math.pi * j / max(len(members), 1) + math.pi / 2
      pos[c] = (cx + math.cos(a), cy + math.sin(a))
  return pos


def plot_topology(
  homog_labels,
  clusters: Sequence[Sequence[int]],
  heads: Sequence[int],
  path: str,
  title: Optional[str] = None,
  client_classes: Optional[Sequence[str]] = None,
  dpi: int = 120,
) -> str:
  """Writes the topology figure as a PNG.

  Args:
    homog_labels: [m] homogeneous cluster of each client (the node colour).
    clusters: client ids of every heterogeneous cluster.
    heads: the head of every cluster.
    path: the PNG file to write (its directory is created).
    title: the figure title (default: counts of clients, clusters and K).
    client_classes: optional text per client drawn under its node (e.g. its classes).
    dpi: resolution.

  Returns:
    `path`.
  """
  # pylint: disable=g-import-not-at-top
  import matplotlib
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D

  homog = np.asarray(homog_labels)
  m = homog.shape[0]
  pos = topology_layout(clusters, heads, m)
  K = int(homog.max()) + 1 if m else 1
  cmap = matplotlib.colormaps['tab10' if K <= 10 else 'tab20']
  colours = [cmap(int(k) % cmap.N) for k in homog]

  n = len(clusters)
  cols = max(1, math.ceil(math.sqrt(n)))
  rows = max(1, math.ceil(n / cols))
  fig = Figure(figsize=(max(4.0, 2.2 * cols + 1.8), max(3.5, 2.2 * rows + 0.8)), dpi=dpi)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  head_set = {int(h) for h in heads}
  for k, (cl, h) in enumerate(zip(clusters, heads)):
    hx, hy = pos[int(h)]
    for c in cl:
      if int(c) != int(h):
        ax.plot([pos[c, 0], hx], [pos[c, 1], hy], color='0.6', lw=0.8, zorder=1)
    ax.text(
      hx, hy - 1.55, f'cluster {k} ({len(cl)})', ha='center', va='top', fontsize=7, color='0.3'
    )
  members = [i for i in range(m) if i not in head_set]
  ax.scatter(
    pos[members, 0],
    pos[members, 1],
    s=140,
    c=[colours[i] for i in members],
    edgecolors='k',
    linewidths=0.5,
    zorder=2,
  )
  hl = sorted(head_set)
  ax.scatter(
    pos[hl, 0],
    pos[hl, 1],
    s=420,
    marker='*',
    c=[colours[i] for i in hl],
    edgecolors='k',
    linewidths=1.2,
    zorder=3,
  )
  for i in range(m):
    ax.text(pos[i, 0], pos[i, 1], str(i), ha='center', va='center', fontsize=6, zorder=4)
    if client_classes is not None:
      ax.text(
        pos[i, 0],
        pos[i, 1] - 0.2,
        str(client_classes[i]),
        ha='center',
        va='top',
        fontsize=5,
        color='0.25',
        zorder=4,
      )
  handles = [
    Line2D(
      [],
      [],
      marker='o',
      ls='',
      markerfacecolor=cmap(k % cmap.N),
      markeredgecolor='k',
      label=f'homog. {k}',
    )
    for k in range(K)
  ]
  handles.append(
    Line2D(
      [],
      [],
      marker='*',
      ls='',
      markersize=12,
      markerfacecolor='w',
      markeredgecolor='k',
      label='cluster head',
    )
  )
  ax.legend(
    handles=handles, loc='center left', bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False
  )
  ax.set_aspect('equal')
  ax.set_xticks([])
  ax.set_yticks([])
  for side in ax.spines.values():
    side.set_visible(False)
  ax.margins(0.08)
  ax.set_title(
    title or f'HFLDD topology: {m} clients, {n} heterogeneous clusters, K={K}', fontsize=9
  )
  fig.tight_layout()
  save_png(fig, path)
  return path
