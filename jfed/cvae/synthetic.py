"""The server's synthetic set from CVAE decoders (FedMHO §4.2.2, §4.4, Algorithm 2).

`generation_counts` splits N_syn over classes and decoders as the reference code does
(`YXShi2000/FedMHO:pcode/aggregation/semi_supervised.py:get_synthesis_data_list`): every class
gets int(N_syn / C) samples, and decoder k generates int(w_kc · that) of class c, with
w_kc = n_kc² / Σ_k' n_k'c² from the clients' class counts (uniform over decoders when no CVAE
client holds the class). Rounding down leaves a class a few samples short, as in the reference.

`kmeans_filter` is Algorithm 2: per class, K-means with one cluster (whose centre is the class
mean: K-means with k = 1 converges to it in one step), and the int(R_th · n_c) samples nearest
to it (Euclidean distance over the flattened pixels) are kept (`pcode/utils/data_clean.py`).
R_th = 1 keeps every sample (the Table 4 ablation).
"""

import numpy as np


def generation_counts(class_counts: np.ndarray, total: int) -> np.ndarray:
  """[decoders, classes] sample counts for class counts [decoders, classes] and N_syn `total`."""
  counts = np.asarray(class_counts, np.float64)
  if counts.ndim != 2 or counts.shape[0] < 1:
    raise ValueError(f'class_counts must be [decoders, classes], got shape {counts.shape}')
  if np.any(counts < 0):
    raise ValueError('class counts must be non-negative')
  k, c = counts.shape
  per_class = int(total / c)
  squared = counts**2
  column = squared.sum(0, keepdims=True)
  weights = np.where(column > 0, squared / np.where(column > 0, column, 1.0), 1.0 / k)
  return np.floor(weights * per_class).astype(np.int64)


def kmeans_keep(features: np.ndarray, ratio: float) -> np.ndarray:
  """Indices (ascending) of the int(ratio · n) rows of `features` [n, ...] nearest to their
  mean: one class of Algorithm 2."""
  if not 0.0 < ratio <= 1.0:
    raise ValueError(f'R_th must be in (0, 1], got {ratio}')
  flat = np.asarray(features, np.float64).reshape(len(features), -1)
  keep = int(ratio * len(flat))
  if keep >= len(flat):
    return np.arange(len(flat))
  distance = np.linalg.norm(flat - flat.mean(0, keepdims=True), axis=1)
  return np.sort(np.argsort(distance, kind='stable')[:keep])


def kmeans_filter(images: np.ndarray, labels: np.ndarray, ratio: float) -> np.ndarray:
  """Algorithm 2 over every class: the indices (ascending) of the samples kept.

  Args:
    images: Generated images [N, ...].
    labels: Their labels [N].
    ratio: R_th in (0, 1], the fraction of each class kept.

  Returns:
    Indices into `images` of the kept samples, ascending.
  """
  labels = np.asarray(labels)
  members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
  kept = [m[kmeans_keep(images[m], ratio)] for m in members]
  return np.sort(np.concatenate(kept)) if kept else np.zeros(0, np.int64)
