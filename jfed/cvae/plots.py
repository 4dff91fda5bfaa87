"""FedMHO Fig. 9: synthetic samples per class, those Algorithm 2 kept beside those it removed."""

import numpy as np

from jfed.distill.plots import plot_image_grid


def plot_filter_grid(path, images, labels, kept, num_classes: int, per_class: int = 5) -> None:
  """One row per class: `per_class` kept samples (nearest the class mean first), then up to
  `per_class` removed ones (farthest first); an empty cell where a class has fewer.

  Args:
    path: Where the figure is saved.
    images: The generated images [N, H, W, C] in [0, 1].
    labels: Their labels [N].
    kept: Indices of the images the K-means filter kept.
    num_classes: Number of rows.
    per_class: Kept (and removed) images shown per class.
  """
  images, labels = np.asarray(images, np.float32), np.asarray(labels)
  is_kept = np.zeros(len(labels), bool)
  is_kept[np.asarray(kept, int)] = True
  cells, tags = [], []
  blank = np.zeros_like(images[0])
  for c in range(num_classes):
    members = np.flatnonzero(labels == c)
    flat = images[members].reshape(len(members), -1)
    distance = np.linalg.norm(flat - flat.mean(0), axis=1) if len(members) else np.zeros(0)
    order = members[np.argsort(distance, kind='stable')]
    kept_c = [i for i in order if is_kept[i]][:per_class]
    removed_c = [i for i in order[::-1] if not is_kept[i]][:per_class]
    for group in (kept_c, removed_c):
      cells += [images[i] for i in group] + [blank] * (per_class - len(group))
      tags += [c] * len(group) + [-1] * (per_class - len(group))
  plot_image_grid(
    path,
    np.stack(cells),
    None,
    title=f'synthetic samples per class: {per_class} kept (left), {per_class} removed (right)',
    columns=2 * per_class,
  )
