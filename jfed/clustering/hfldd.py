"""HFLDD client clustering (Shi et al., arXiv 2409.17517, §IV-B2, Eq. 4, Algorithm 1).

HFLDD has no public code (the authors' is "available upon request"). The steps:

1. every client infers soft labels `p_i ∈ [n_public, C]` on a shared public set;
2. the server builds the divergence matrix `S` (Eq. 4, `kl_similarity_matrix`):

       S[i, j] = (1 / n_public) Σ_x Σ_c p_i(x, c) · log(p_i(x, c) / p_j(x, c))
               = mean over public samples of KL(p_i(x) ‖ p_j(x))

   Eq. 4's symbols were lost in the extraction of the seed; the text says "pairwise divergences
   among these tensors", "KL divergence between any pair of clients' soft labels", cost
   O(n_public·C) per pair: this is the natural form. It is NOT symmetric (`symmetric=True`
   gives `(KL_ij + KL_ji) / 2`); `reduction='sum'` sums over public samples instead of
   averaging (only a global scale, which K-means on the rows does not care about);
3. K-means on the rows of `S` gives K homogeneous clusters (`homogeneous_clusters`);
4. Algorithm 1 (`heterogeneous_clusters`): repeatedly form a heterogeneous cluster by sampling
   (uniformly, without replacement) one client from each homogeneous cluster that still has
   clients. Smaller homogeneous clusters are exhausted first and sampling continues over the
   larger ones; once only ONE homogeneous cluster has clients left, its remaining clients are
   assigned one by one to individual (singleton) heterogeneous clusters: the "isolated nodes"
   of the paper's Fig. 4 and §VII. (This is also what the sampling loop itself produces when a
   single pool is left.) `leftover='distribute'` instead appends those clients round-robin to
   the existing heterogeneous clusters (an alternative reading, offered as an option);
5. `choose_heads`: one uniformly random head per heterogeneous cluster.

All randomness goes through `np.random.default_rng(seed)`.
"""

from typing import List, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

LEFTOVER_RULES = ('singleton', 'distribute')


@jax.jit
def _mean_kl_matrix(p: jax.Array, eps: float) -> jax.Array:
  p = jnp.clip(p, eps, 1.0)
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  logp = jnp.log(p)
  n = p.shape[1]
  neg_ent = jnp.einsum('inc,inc->i', p, logp) / n  # Σ p_i log p_i
  cross = (
    jnp.einsum('inc,jnc->ij', p, logp, precision=jax.lax.Precision.HIGHEST) / n
  )  # Σ p_i log p_j
  return neg_ent[:, None] - cross


def kl_similarity_matrix(
  soft_labels, eps: float = 1e-8, symmetric: bool = False, reduction: str = 'mean'
) -> np.ndarray:
  """HFLDD Eq. 4: `S[i, j] = mean_x KL(p_i(x) ‖ p_j(x))`.

  Args:
    soft_labels: [m, n_public, C] probabilities. Rows are re-normalised after clipping at
      `eps`, so `log 0` never occurs.
    eps: the clipping floor.
    symmetric: average the matrix with its transpose.
    reduction: 'mean' (Eq. 4) or 'sum' over the public samples.

  Returns:
    float64 [m, m], non-negative, with a zero diagonal.
  """
  p = jnp.asarray(soft_labels, jnp.float32)
  if p.ndim != 3:
    raise ValueError(f'soft_labels must be [clients, n_public, classes], got {p.shape}')
  s = np.asarray(_mean_kl_matrix(p, eps), np.float64)
  if reduction == 'sum':
    s = s * p.shape[1]
  elif reduction != 'mean':
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
  s = np.maximum(s, 0.0)  # KL >= 0; removes float round-off
  np.fill_diagonal(s, 0.0)
  if symmetric:
    s = 0.5 * (s + s.T)
  return s


def homogeneous_clusters(S, K: int, seed: int, n_init: int = 10) -> np.ndarray:
  """K-means (scikit-learn) on the rows of `S`.

  Args:
    S: [m, m] divergence matrix (`kl_similarity_matrix`).
    K: number of clusters, capped at the number of clients m.
    seed: K-means `random_state`.
    n_init: K-means restarts.

  Returns:
    int64 [m] cluster labels in [0, K).
  """
  S = np.asarray(S, np.float64)
  K = int(min(K, S.shape[0]))
  # Imported here: scikit-learn costs 1.4 s of start-up to every command that never clusters.
  from sklearn.cluster import KMeans  # pylint: disable=g-import-not-at-top

  km = KMeans(n_clusters=K, random_state=int(seed), n_init=n_init)
  return km.fit_predict(S).astype(np.int64)


def heterogeneous_clusters(
  homog_labels, seed: int, leftover: str = 'singleton'
) -> List[np.ndarray]:
  """HFLDD Algorithm 1: heterogeneous clusters from homogeneous-cluster labels.

  Each heterogeneous cluster takes one uniformly random not-yet-used client from every
  homogeneous cluster that still has clients, while at least two homogeneous clusters have
  clients left. Then the clients of the single remaining homogeneous cluster (if any) are placed
  by the `leftover` rule.

  Args:
    homog_labels: [m] homogeneous cluster of each client.
    seed: seed of the sampling.
    leftover: 'singleton': every remaining client is a cluster of its own (the paper's
      "isolated nodes"); 'distribute': they are appended round-robin to the clusters built so
      far (singletons when there are none).

  Returns:
    int64 arrays of sorted client ids, one per cluster; every client appears exactly once.
  """
  labels = np.asarray(homog_labels)
  rng = np.random.default_rng(seed)
  pools = [list(rng.permutation(np.flatnonzero(labels == k))) for k in np.unique(labels)]
  clusters: List[List[int]] = []
  while sum(1 for p in pools if p) >= 2:
    clusters.append([int(p.pop()) for p in pools if p])
  rest = [int(c) for p in pools for c in p]
  if leftover == 'singleton' or not clusters:
    clusters.extend([c] for c in rest)
  elif leftover == 'distribute':
    for i, c in enumerate(rest):
      clusters[i % len(clusters)].append(c)
  else:
    raise ValueError(f'leftover must be one of {LEFTOVER_RULES}, got {leftover!r}')
  return [np.asarray(sorted(c), np.int64) for c in clusters]


def choose_heads(clusters: Sequence[np.ndarray], seed: int) -> np.ndarray:
  """One uniformly random head per cluster: int64 [len(clusters)] client ids."""
  rng = np.random.default_rng(seed)
  return np.asarray([int(rng.choice(np.asarray(c))) for c in clusters], np.int64)


class HFLDDTopology(NamedTuple):
  """The server's clustering of HFLDD."""

  similarity: np.ndarray  # [m, m] Eq. 4
  homog_labels: np.ndarray  # [m] homogeneous cluster of each client
  clusters: list  # list of int64 arrays: heterogeneous clusters
  heads: np.ndarray  # [len(clusters)] head client of each cluster

  @property
  def members(self) -> List[np.ndarray]:
    """Per cluster, the non-head clients (those that distil and upload to the head)."""
    return [
      np.asarray([c for c in cl if c != h], np.int64) for cl, h in zip(self.clusters, self.heads)
    ]


def build_topology(
  soft_labels, K: int, seed: int, *, symmetric: bool = False, leftover: str = 'singleton'
) -> HFLDDTopology:
  """Steps 2 to 5 of HFLDD in one call.

  Args:
    soft_labels: [m, n_public, C] soft labels of every client on the public set.
    K: number of homogeneous clusters.
    seed: spawns independent sub-seeds for K-means, the sampling of Algorithm 1 and the heads.
    symmetric: symmetrise Eq. 4 (see `kl_similarity_matrix`).
    leftover: see `heterogeneous_clusters`.

  Returns:
    The topology: divergences, homogeneous labels, heterogeneous clusters and their heads.
  """
  ss = np.random.SeedSequence(seed).spawn(3)
  s_km, s_het, s_head = (int(s.generate_state(1)[0]) for s in ss)
  S = kl_similarity_matrix(soft_labels, symmetric=symmetric)
  homog = homogeneous_clusters(S, K, s_km)
  clusters = heterogeneous_clusters(homog, s_het, leftover=leftover)
  heads = choose_heads(clusters, s_head)
  return HFLDDTopology(S, homog, clusters, heads)


def cluster_label_coverage(clusters: Sequence[np.ndarray], class_table) -> np.ndarray:
  """Number of distinct classes held by each cluster.

  Args:
    clusters: client ids per cluster.
    class_table: [m, C] sample counts per client and class.

  Returns:
    int [len(clusters)].
  """
  table = np.asarray(class_table)
  return np.asarray([int(np.count_nonzero(table[np.asarray(c)].sum(0))) for c in clusters])
