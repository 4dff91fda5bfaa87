"""Pictures of partitions, for reports and for eyeballing heterogeneity."""

from typing import Optional

import numpy as np

from jfed.errors import WorkdirError
from jfed.figures import save_png

# Up to this many clients the bubble plot (one column per client) stays readable; above it a
# bounded-size summary figure is drawn instead (`_plot_partition_summary`).
BUBBLE_MAX_CLIENTS = 100
# The summary figure's size in inches (at 120 dpi: 1,440 x 540 px), whatever the client count.
SUMMARY_FIGSIZE = (12.0, 4.5)
# Most client columns of the summary's heat map: more clients are averaged in bins.
HEATMAP_MAX_COLUMNS = 400


def plot_partition_bubbles(
  table, path, title: Optional[str] = None, annotate: bool = True, max_bubble_area: float = 900.0
) -> str:
  """FedHydra Fig. 9-style bubble plot of a [clients, classes] count table, saved as PNG.

  x = client id, y = class, bubble area proportional to the count (the largest cell gets
  `max_bubble_area` points^2), so label skew is visible at a glance. A Figure with an
  explicit Agg canvas is used instead of pyplot, so the global matplotlib backend of the
  calling process (e.g. a notebook) is left untouched.

  Above `BUBBLE_MAX_CLIENTS` clients a bubble plot would be 0.6 inch per client (720,000 px
  wide at 10,000 clients), so a summary of fixed size (`SUMMARY_FIGSIZE`) is drawn instead: a
  heat map of the clients' class proportions, clients sorted by their largest class and its
  share and averaged in at most `HEATMAP_MAX_COLUMNS` bins, beside a histogram of the client
  sizes. `annotate` and `max_bubble_area` apply to the bubble plot only.

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
  if num_clients > BUBBLE_MAX_CLIENTS:
    return _save(_plot_partition_summary(table, title), path)
  width, height = max(4.0, 0.6 * num_clients + 1.5), max(3.0, 0.4 * num_classes + 1.2)
  fig = _figure(width, height)
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
  return _save(fig, path)


def _figure(width: float, height: float):
  """A matplotlib Figure on its own Agg canvas (the process's pyplot backend is left alone)."""
  # matplotlib on first use: a run that plots nothing (a refused config, a Flower ClientApp
  # process) should not pay its import.
  from matplotlib import figure as mpl_figure  # pylint: disable=g-import-not-at-top
  from matplotlib.backends import backend_agg  # pylint: disable=g-import-not-at-top

  fig = mpl_figure.Figure(figsize=(width, height), dpi=120)
  backend_agg.FigureCanvasAgg(fig)
  return fig


def _client_order(table) -> np.ndarray:
  """The summary heat map's client order: by largest class, then that class's share (descending),
  then size (descending), so clients of like mixes sit together."""
  table = np.asarray(table, dtype=np.float64)
  sizes = table.sum(axis=1)
  shares = table / np.maximum(sizes, 1.0)[:, None]
  top = shares.argmax(axis=1)
  return np.lexsort((-sizes, -shares.max(axis=1), top))


def _plot_partition_summary(table: np.ndarray, title: Optional[str]):
  """The bounded-size figure of a large table: binned class-share heat map and size histogram."""
  num_clients, num_classes = table.shape
  order = _client_order(table)
  sizes = table.sum(axis=1).astype(np.float64)
  shares = table[order] / np.maximum(sizes[order], 1.0)[:, None]
  bins = min(num_clients, HEATMAP_MAX_COLUMNS)
  starts = np.linspace(0, num_clients, bins + 1).astype(np.int64)[:-1]
  widths = np.diff(np.append(starts, num_clients))
  binned = np.add.reduceat(shares, starts, axis=0) / widths[:, None]

  fig = _figure(*SUMMARY_FIGSIZE)
  # the third column only keeps the colour bar's labels off the histogram's
  grid = fig.add_gridspec(1, 4, width_ratios=(2.2, 0.05, 0.2, 1.0), wspace=0.05)
  ax = fig.add_subplot(grid[0, 0])
  image = ax.imshow(
    binned.T,
    aspect='auto',
    origin='lower',
    interpolation='nearest',
    cmap='viridis',
    vmin=0.0,
    vmax=1.0,
    extent=(0, num_clients, -0.5, num_classes - 0.5),
  )
  ax.set_xlabel(
    f'clients, sorted by largest class and its share ({num_clients}'
    + (f'; {bins} bins of ~{num_clients / bins:.0f})' if bins < num_clients else ')'),
    fontsize=8,
  )
  ax.set_ylabel('Class')
  if num_classes <= 20:
    ax.set_yticks(range(num_classes))
  ax.set_title('share of each class in a client', fontsize=9)
  fig.colorbar(image, cax=fig.add_subplot(grid[0, 1]))
  hist = fig.add_subplot(grid[0, 3])
  hist.hist(sizes, bins=50, color='tab:red', alpha=0.7)
  hist.set_xlabel('client size (samples)', fontsize=8)
  hist.set_ylabel('clients', fontsize=8)
  hist.set_title(
    f'sizes: min {sizes.min():.0f}, median {np.median(sizes):g}, max {sizes.max():.0f}', fontsize=9
  )
  if sizes.max() > 50 * max(np.median(sizes), 1.0):  # a heavy tail: counts on a log scale
    hist.set_yscale('log')
  if title:
    fig.suptitle(title, fontsize=10)
  fig.subplots_adjust(left=0.06, right=0.98, bottom=0.13, top=0.84 if title else 0.9)
  return fig


def _save(fig, path) -> str:
  """Writes `fig` as the PNG `path` (parent directories created); the path as a string."""
  try:
    return save_png(fig, path)
  except OSError as e:
    raise WorkdirError(f'cannot write {path}: {e.strerror or e}') from None
