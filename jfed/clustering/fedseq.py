"""FedSeq superclients (Zaccone et al., ICPR 2022; `github.com/RickZack/FedSeq`,
`src/algo/fedseq_modules/`).

`src/algo/fedseq_modules/greedy_cluster_maker.py` and `client_evaluator.py`: every client is
represented by a confidence vector over the classes (`fedseq_confidence`), and superclients
are grown greedily so that the union of their members is as close to uniform as the measure
says (`fedseq_clusters`).
"""

import itertools
from typing import List

import numpy as np


def fedseq_confidence(probs, public_labels) -> np.ndarray:
  """FedSeq's client representer (`client_evaluator.py:__get_prediction`).

  Args:
    probs: [m, n_public, C] softmax outputs of each client's locally trained model on the
      public exemplars.
    public_labels: [n_public] labels of the exemplars.

  Returns:
    float64 [m, C]: `conf[i, c] = Σ_{x: y(x) = c} p_i(x, c)`, normalised to sum 1 per client.
  """
  probs = np.asarray(probs, np.float64)
  onehot = np.eye(probs.shape[-1])[np.asarray(public_labels)]  # [n, C]
  conf = np.einsum('inc,nc->ic', probs, onehot)
  return conf / np.maximum(conf.sum(-1, keepdims=True), 1e-300)


def _xlogy(x, y):
  """`x · log y`, 0 where x = 0 (y is only read where x > 0, so log never sees 0)."""
  return x * np.log(np.where(x > 0, y, 1.0))


def kullback_measure(cluster_vec, client_vec) -> float:
  """FedSeq 'kullback': `1 − Σ_i m_i log(m_i·C)` with `m = (cluster + client) / 2`.

  Higher means the union is closer to uniform. `0·log 0 := 0` (the reference code yields NaN
  there, which then never wins the `>` comparison).
  """
  m = (np.asarray(cluster_vec, np.float64) + np.asarray(client_vec, np.float64)) / 2
  return float(1.0 - np.sum(_xlogy(m, m * m.size)))


def gini_measure(cluster_vec, client_vec) -> float:
  """FedSeq 'gini': `1 − Σ_i m_i²` with `m = (cluster + client) / 2`."""
  m = (np.asarray(cluster_vec, np.float64) + np.asarray(client_vec, np.float64)) / 2
  return float(1.0 - np.sum(m * m))


def cosine_measure(cluster_vec, client_vec) -> float:
  """FedSeq 'cosine': the cosine distance between the cluster and the client vector."""
  a = np.asarray(cluster_vec, np.float64)
  b = np.asarray(client_vec, np.float64)
  return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


MEASURES = {'kullback': kullback_measure, 'gini': gini_measure, 'cosine': cosine_measure}


def fedseq_clusters(
  confidences,
  num_examples,
  min_examples: int = 800,
  max_clients: int = 11,
  measure: str = 'kullback',
  code_compat: bool = False,
) -> List[np.ndarray]:
  """FedSeq's `GreedyClusterMaker`.

  A cluster starts with representer = uniform; while its number of examples is below
  `min_examples` and its number of clients below `max_clients`, the remaining client
  maximising `measure(cluster_representer, client_vec)` is added (the first index wins ties);
  the representer is the data-size-weighted mean of the members' vectors. Otherwise the
  cluster is closed and a new one started. The last cluster, if it has fewer than
  `min_examples` examples, is emptied into the other clusters that have room (fewer than
  `max_clients`), visiting them cyclically in increasing order of examples (popping its
  clients from the end). Deviations from the reference, only in its failure cases: if there is
  no other cluster or no room anywhere, the undersized cluster is kept (the reference asserts
  or silently drops clients).

  Args:
    confidences: [m, C] client representers (`fedseq_confidence`).
    num_examples: [m] local dataset sizes.
    min_examples: a superclient is closed once it holds this many examples ...
    max_clients: ... or this many clients.
    measure: 'kullback', 'gini' or 'cosine' (`MEASURES`).
    code_compat: replicate the reference's search, which starts from `best_diff = 0,
      best_index = 0`: a client only wins with a strictly positive score, so when every score
      is negative (the 'kullback' score `1 − KL(m ‖ uniform)` is < 0 once KL > 1, e.g. for
      near one-hot confidences) the first remaining client is taken instead of the best one.

  Returns:
    int64 arrays of client ids, one per superclient, in insertion order.
  """
  conf = np.asarray(confidences, np.float64)
  n_ex = np.asarray(num_examples, np.int64)
  m, C = conf.shape
  if measure not in MEASURES:
    raise ValueError(f'measure must be one of {sorted(MEASURES)}, got {measure!r}')
  fn = MEASURES[measure]
  uniform = np.full(C, 1.0 / C)

  def representer(members):
    if not members:
      return uniform
    w = n_ex[members].astype(np.float64)
    return (conf[members] * (w / w.sum())[:, None]).sum(0)

  remaining = list(range(m))
  clusters: List[List[int]] = []
  cur: List[int] = []
  while remaining:
    if n_ex[cur].sum() < min_examples and len(cur) < max_clients:
      rep = representer(cur)
      best_diff, best_idx = (0.0 if code_compat else -np.inf), 0
      for idx, c in enumerate(remaining):
        d = fn(rep, conf[c])
        if d > best_diff:
          best_diff, best_idx = d, idx
      cur.append(remaining.pop(best_idx))
    else:
      clusters.append(cur)
      cur = []
  if cur:
    if n_ex[cur].sum() < min_examples and clusters:
      room = sorted((c for c in clusters if len(c) < max_clients), key=lambda c: int(n_ex[c].sum()))
      for target in itertools.cycle(room):  # empty when no cluster has room
        if len(target) < max_clients:
          target.append(cur.pop())
        if not cur or all(len(c) >= max_clients for c in room):
          break
      if cur:
        clusters.append(cur)
    else:
      clusters.append(cur)
  return [np.asarray(c, np.int64) for c in clusters]
