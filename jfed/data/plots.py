"""Pictures of partitions, for reports and for eyeballing heterogeneity."""

import os
import pathlib
from typing import Optional

import numpy as np

from jfed.errors import WorkdirError


def plot_partition_bubbles(
  table, path, title: Optional[str] = None, annotate: bool = True, max_bubble_area: float = 900.0
) -> str:
  """FedHydra Fig. 9-style bubble plot of a [clients, classes] count table, saved as PNG.

  x = client id, y = class, bubble area proportional to the count (the largest cell gets
  `max_bubble_area` points^2), so label skew is visible at a glance. A Figure with an
  explicit Agg canvas is used instead of pyplot, so the global matplotlib backend of the
  calling process (e.g. a notebook) is left untouched.

  Args:
    table: [clients, classes] counts, e.g. from `class_count_table`.
    path: output PNG path (parent directories are created).
    title: optional title.
    annotate: write the count next to each non-empty bubble (skipped for large tables).
    max_bubble_area: marker area of the largest count, in points^2.

  Returns:
    The path written, as a string.
  """
  table = np.asarray(table)
  if table.ndim != 2:
    raise ValueError(f'table must be [clients, classes], got shape {table.shape}.')
  num_clients, num_classes = table.shape
  width, height = max(4.0, 0.6 * num_clients + 1.5), max(3.0, 0.4 * num_classes + 1.2)
  # matplotlib on first use: a run that plots nothing (a refused config, a Flower ClientApp
  # process) should not pay its import.
  from matplotlib import figure as mpl_figure  # pylint: disable=g-import-not-at-top
  from matplotlib.backends import backend_agg  # pylint: disable=g-import-not-at-top

  fig = mpl_figure.Figure(figsize=(width, height), dpi=120)
  backend_agg.FigureCanvasAgg(fig)
  # Fixed margins in inches for the known labels (tick numbers, axis names, a title line):
  # `tight_layout` measured every count label and took two thirds of the figure's time.
  fig.subplots_adjust(
    left=0.65 / width,
    right=1 - 0.15 / width,
    bottom=0.55 / height,
    top=1 - (0.4 if title else 0.15) / height,
  )
  ax = fig.add_subplot(1, 1, 1)
  clients, classes = np.nonzero(table > 0)
  counts = table[clients, classes].astype(np.float64)
  scale = max_bubble_area / counts.max() if counts.size else 0.0
  ax.scatter(
    clients,
    classes,
    s=counts * scale,
    c='tab:red',
    alpha=0.55,
    edgecolors='darkred',
    linewidths=0.6,
  )
  if annotate and num_clients * num_classes <= 400:
    for i, c, n in zip(clients, classes, counts):
      ax.annotate(
        str(int(n)),
        (i, c),
        xytext=(0, 0),
        textcoords='offset points',
        ha='center',
        va='center',
        fontsize=6,
      )
  ax.set_xticks(range(num_clients))
  ax.set_yticks(range(num_classes))
  ax.set_xlim(-0.7, num_clients - 0.3)
  ax.set_ylim(-0.7, num_classes - 0.3)
  ax.set_xlabel('Client ID')
  ax.set_ylabel('Class')
  ax.grid(True, linestyle=':', linewidth=0.5, alpha=0.6)
  ax.set_axisbelow(True)
  if title:
    ax.set_title(title, fontsize=9)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  # A temporary file and a rename: a run killed while drawing leaves no torn PNG behind, and a
  # resumed run may keep the file it finds.
  tmp = path.with_name(f'.{path.name}.tmp')
  try:
    fig.savefig(tmp, format='png')
    os.replace(tmp, path)
  except OSError as e:
    tmp.unlink(missing_ok=True)
    raise WorkdirError(f'cannot write {path}: {e.strerror or e}') from None
  return str(path)
