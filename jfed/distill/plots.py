"""Figures of the distillation methods: FedHydra's (Bai et al., KDD 2025) MS weight heatmap (Fig.
5b), test accuracy against distillation epoch (Figs. 3, 4, 6) and a grid of synthetic images (Fig.
12).

Matplotlib with the Agg canvas only (no pyplot state), so plotting is safe in tests and threads.
"""

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from jfed.figures import save_png


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

  Args:
    path: Where the figure is saved (PNG, PDF, ... by suffix).
    weights: The c × m matrix, as above.
    title: Axes title; None for none.
    client_names: Row labels (m); None numbers them.
    class_names: Column labels (c); None numbers them.
    annotate: Write each value in its cell.
    value_name: Label of the colour bar.
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
  save_png(fig, path)
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
  without distillation epochs.

  Args:
    path: Where the figure is saved.
    series: name -> (epochs, accuracies), one line each.
    title: Axes title; None for none.
    hlines: name -> accuracy, as above; None for none.
    xlabel: x-axis label.
    ylabel: y-axis label.
  """
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
  save_png(fig, path)


def image_mosaic(images, columns: int = 8, pad: int = 1) -> np.ndarray:
  """Images NHWC in [0, 1] tiled row-major into one [rows·(H+pad)−pad, cols·(W+pad)−pad, C]
  array, white between tiles and after the last one.

  Args:
    images: [N, H, W, C], values in [0, 1] (clipped).
    columns: Tiles per row at most.
    pad: Width in pixels of the white gaps.

  Returns:
    The mosaic, float32.
  """
  x = np.clip(np.asarray(images, np.float32), 0.0, 1.0)
  n, h, w, ch = x.shape
  cols = min(columns, n)
  rows = -(-n // cols)
  canvas = np.ones((rows * (h + pad) - pad, cols * (w + pad) - pad, ch), np.float32)
  for i in range(n):
    r, c = divmod(i, cols)
    canvas[r * (h + pad) : r * (h + pad) + h, c * (w + pad) : c * (w + pad) + w] = x[i]
  return canvas


def plot_image_grid(
  path, images, labels=None, title: Optional[str] = None, columns: int = 8
) -> None:
  """Fig. 12: a grid of (synthetic) images in [0, 1], NHWC, each tagged with its target label.

  One image of the tiled grid rather than a subplot per image: 64 subplots took 1.8 s to lay out
  and save, on every round of every synthesis run.

  Args:
    path: Where the figure is saved.
    images: [N, H, W, C] in [0, 1]; nothing is written when N is 0.
    labels: Each image's target label [N]; None for none.
    title: Figure title; None for none.
    columns: Tiles per row at most.
  """
  x = np.asarray(images, np.float32)
  n = len(x)
  if n == 0:
    return
  h, w = x.shape[1:3]
  pad = max(1, h // 8)
  cols = min(columns, n)
  rows = -(-n // cols)
  mosaic = image_mosaic(x, cols, pad)
  fig = _figure((1.1 * cols, 1.1 * rows + (0.4 if title else 0.0)))
  ax = fig.add_axes((0.0, 0.0, 1.0, 0.94 if title else 1.0))
  gray = mosaic.shape[-1] == 1
  ax.imshow(mosaic[..., 0] if gray else mosaic, cmap='gray' if gray else None, vmin=0.0, vmax=1.0)
  ax.set_axis_off()
  if labels is not None:
    for i, label in enumerate(np.asarray(labels)[:n]):
      r, c = divmod(i, cols)
      ax.text(
        c * (w + pad),
        r * (h + pad),
        str(int(label)),
        color='red',
        fontsize=7,
        va='top',
        ha='left',
        bbox={'facecolor': 'white', 'alpha': 0.7, 'pad': 0.5, 'linewidth': 0},
      )
  if title:
    fig.suptitle(title, fontsize=9)
  save_png(fig, path)
