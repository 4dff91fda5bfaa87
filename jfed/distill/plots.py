"""Figures of the distillation methods: FedHydra's MS weight heatmap (seed 000 Fig. 5b), test
accuracy against distillation epoch (Figs. 3, 4, 6) and a grid of synthetic images (Fig. 12).

Matplotlib with the Agg canvas only (no pyplot state), so plotting is safe in tests and threads.
"""

from typing import Dict, Optional, Sequence, Tuple

import numpy as np


def _figure(size):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=size, dpi=120)
  FigureCanvasAgg(fig)
  return fig


def plot_ms_heatmap(
  path,
  weights,
  title: Optional[str] = None,
  client_names: Optional[Sequence[str]] = None,
  class_names: Optional[Sequence[str]] = None,
  annotate: bool = True,
  value_name: str = 'U_r',
):
  """Fig. 5b: the MS weights as a clients × classes heatmap; returns the (saved) Figure.

  `weights`: the paper's c × m matrix (U, U_r or U_c; row j = class, column k = client, as
  returned by `model_stratification`), drawn transposed so that rows are clients, as in Fig. 5b.
  Clients are numbered 0..m−1 by default, like partition.txt and partition.png.
  Every cell is annotated with its value when `annotate` (and the matrix is small enough).
  """
  w = np.asarray(weights, np.float64).T  # [m, c]
  m, c = w.shape
  fig = _figure((max(4.0, 0.6 * c + 2.0), max(2.5, 0.45 * m + 1.5)))
  ax = fig.add_subplot(1, 1, 1)
  im = ax.imshow(w, cmap='viridis', aspect='auto')
  fig.colorbar(im, ax=ax, label=value_name)
  ax.set_xticks(range(c))
  ax.set_xticklabels(class_names or [str(j) for j in range(c)])
  ax.set_yticks(range(m))
  ax.set_yticklabels(client_names or [f'client {k}' for k in range(m)])
  ax.set_xlabel('class')
  ax.set_ylabel('client model')
  if annotate and m * c <= 400:
    hi = np.nanmax(w) if w.size else 0.0
    for k in range(m):
      for j in range(c):
        ax.text(
          j,
          k,
          f'{w[k, j]:.2f}',
          ha='center',
          va='center',
          fontsize=6,
          color='black' if w[k, j] > 0.6 * hi else 'white',
        )
  if title:
    ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(str(path))
  return fig


def plot_accuracy_vs_epoch(
  path,
  series: Dict[str, Tuple[Sequence[float], Sequence[float]]],
  title: Optional[str] = None,
  hlines: Optional[Dict[str, float]] = None,
  xlabel: str = 'distillation epoch',
  ylabel: str = 'test accuracy',
) -> None:
  """Figs. 3/4/6: one line per method (or round): series[name] = (epochs, accuracies).
  `hlines`: horizontal reference lines, e.g. {'FedAvg': 0.75, 'OT': 0.71} for one-shot methods
  without distillation epochs."""
  fig = _figure((6.5, 4.0))
  ax = fig.add_subplot(1, 1, 1)
  for name, (xs, ys) in series.items():
    xs, ys = list(xs), list(ys)
    ax.plot(xs, ys, marker='o' if len(ys) < 30 else None, markersize=3, label=name)
  for i, (name, value) in enumerate((hlines or {}).items()):
    ax.axhline(
      value,
      linestyle='--',
      linewidth=1,
      color=f'C{(len(series) + i) % 10}',
      label=f'{name} (one-shot)',
    )
  from matplotlib.ticker import MaxNLocator

  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  if series or hlines:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(str(path))


def plot_image_grid(
  path, images, labels=None, title: Optional[str] = None, columns: int = 8
) -> None:
  """Fig. 12: a grid of (synthetic) images in [0, 1], NHWC, titled by their target labels."""
  x = np.clip(np.asarray(images, np.float32), 0.0, 1.0)
  n = len(x)
  if n == 0:
    return
  cols = min(columns, n)
  rows = -(-n // cols)
  fig = _figure((1.1 * cols, 1.2 * rows + (0.4 if title else 0.0)))
  for i in range(n):
    ax = fig.add_subplot(rows, cols, i + 1)
    img = x[i, ..., 0] if x.shape[-1] == 1 else x[i]
    ax.imshow(img, cmap='gray' if x.shape[-1] == 1 else None, vmin=0.0, vmax=1.0)
    ax.set_xticks([])
    ax.set_yticks([])
    if labels is not None:
      ax.set_title(str(int(np.asarray(labels)[i])), fontsize=7)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(str(path))
