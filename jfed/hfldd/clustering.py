"""Client clustering for HFLDD (seed 003, §IV-B2, Eq. 4, Algorithm 1) and FedSeq (greedy).

HFLDD (Shi et al.; no public code, reference-code.md §7):

1. every client infers soft labels ``p_i ∈ [n_public, C]`` on a shared public set;
2. the server builds the divergence matrix ``S`` (Eq. 4, :func:`kl_similarity_matrix`)::

       S[i, j] = (1 / n_public) Σ_x Σ_c p_i(x, c) · log(p_i(x, c) / p_j(x, c))
               = mean over public samples of KL(p_i(x) ‖ p_j(x))

   Eq. 4's symbols were lost in the extraction of the seed; the text says "pairwise divergences
   among these tensors", "KL divergence between any pair of clients' soft labels", cost
   O(n_public·C) per pair — this is the natural form. It is NOT symmetric (``symmetric=True``
   gives ``(KL_ij + KL_ji)/2``); ``reduction='sum'`` sums over public samples instead of
   averaging (only a global scale, which K-means on the rows does not care about);
3. K-means on the rows of ``S`` -> K homogeneous clusters (:func:`homogeneous_clusters`);
4. Algorithm 1 (:func:`heterogeneous_clusters`): repeatedly form a heterogeneous cluster by
   sampling (uniformly, without replacement) one client from each homogeneous cluster that still
   has clients. Smaller homogeneous clusters are exhausted first and sampling continues over the
   larger ones; once only ONE homogeneous cluster has clients left, its remaining clients are
   assigned one by one to individual (singleton) heterogeneous clusters — the "isolated nodes"
   of the seed's Fig. 4 and §VII. (This is also what the sampling loop itself produces when a
   single pool is left.) ``leftover='distribute'`` instead appends those clients round-robin to
   the existing heterogeneous clusters (an alternative reading, offered as an option);
5. :func:`choose_heads`: one uniformly random head per heterogeneous cluster.

FedSeq (``RickZack/FedSeq:src/algo/fedseq_modules/greedy_cluster_maker.py``, reference-code.md
§9.6): :func:`fedseq_confidence` and :func:`fedseq_clusters`.

All randomness goes through ``np.random.default_rng(seed)``.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.cluster import KMeans

__all__ = [
    "kl_similarity_matrix",
    "homogeneous_clusters",
    "heterogeneous_clusters",
    "choose_heads",
    "HFLDDTopology",
    "build_topology",
    "cluster_label_coverage",
    "fedseq_confidence",
    "fedseq_clusters",
    "kullback_measure",
    "gini_measure",
    "cosine_measure",
]


# ----------------------------------------------------------------------------------------------
# HFLDD
# ----------------------------------------------------------------------------------------------

@jax.jit
def _mean_kl_matrix(p: jax.Array, eps: float) -> jax.Array:
    p = jnp.clip(p, eps, 1.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    logp = jnp.log(p)
    n = p.shape[1]
    neg_ent = jnp.einsum("inc,inc->i", p, logp) / n                     # Σ p_i log p_i
    cross = jnp.einsum("inc,jnc->ij", p, logp,
                       precision=jax.lax.Precision.HIGHEST) / n          # Σ p_i log p_j
    return neg_ent[:, None] - cross


def kl_similarity_matrix(soft_labels, eps: float = 1e-8, symmetric: bool = False,
                         reduction: str = "mean") -> np.ndarray:
    """HFLDD Eq. 4: ``S[i, j] = mean_x KL(p_i(x) ‖ p_j(x))`` -> float64 [m, m], zero diagonal.

    soft_labels: [m, n_public, C] probabilities (rows are re-normalised after clipping at
    ``eps`` so that ``log 0`` never occurs). ``symmetric``: average with the transpose.
    ``reduction``: 'mean' (default) or 'sum' over public samples.
    """
    p = jnp.asarray(soft_labels, jnp.float32)
    if p.ndim != 3:
        raise ValueError(f"soft_labels must be [clients, n_public, classes], got {p.shape}")
    s = np.asarray(_mean_kl_matrix(p, eps), np.float64)
    if reduction == "sum":
        s = s * p.shape[1]
    elif reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    s = np.maximum(s, 0.0)       # KL >= 0; removes float round-off
    np.fill_diagonal(s, 0.0)
    if symmetric:
        s = 0.5 * (s + s.T)
    return s


def homogeneous_clusters(S, K: int, seed: int, n_init: int = 10) -> np.ndarray:
    """K-means (scikit-learn) on the rows of ``S`` -> int64 labels [m] in [0, K).

    ``K`` is capped at the number of clients.
    """
    S = np.asarray(S, np.float64)
    K = int(min(K, S.shape[0]))
    km = KMeans(n_clusters=K, random_state=int(seed), n_init=n_init)
    return km.fit_predict(S).astype(np.int64)


def heterogeneous_clusters(homog_labels, seed: int, leftover: str = "singleton"
                           ) -> list[np.ndarray]:
    """HFLDD Algorithm 1: heterogeneous clusters from homogeneous-cluster labels.

    Each heterogeneous cluster takes one uniformly random not-yet-used client from every
    homogeneous cluster that still has clients, while at least two homogeneous clusters have
    clients left. Then the clients of the single remaining homogeneous cluster (if any) become
    singleton clusters (``leftover='singleton'``, the paper's "isolated nodes") or are appended
    round-robin to the clusters built so far (``leftover='distribute'``; singletons if there are
    none). Returns a list of int64 arrays of client ids; every client appears exactly once.
    """
    labels = np.asarray(homog_labels)
    rng = np.random.default_rng(seed)
    pools = [list(rng.permutation(np.flatnonzero(labels == k))) for k in np.unique(labels)]
    clusters: list[list[int]] = []
    while sum(1 for p in pools if p) >= 2:
        clusters.append([int(p.pop()) for p in pools if p])
    rest = [int(c) for p in pools for c in p]
    if leftover == "singleton" or not clusters:
        clusters.extend([c] for c in rest)
    elif leftover == "distribute":
        for i, c in enumerate(rest):
            clusters[i % len(clusters)].append(c)
    else:
        raise ValueError(f"leftover must be 'singleton' or 'distribute', got {leftover!r}")
    return [np.asarray(sorted(c), np.int64) for c in clusters]


def choose_heads(clusters: Sequence[np.ndarray], seed: int) -> np.ndarray:
    """One uniformly random head per cluster -> int64 [len(clusters)] client ids."""
    rng = np.random.default_rng(seed)
    return np.asarray([int(rng.choice(np.asarray(c))) for c in clusters], np.int64)


class HFLDDTopology(NamedTuple):
    similarity: np.ndarray          # [m, m] Eq. 4
    homog_labels: np.ndarray        # [m] homogeneous cluster of each client
    clusters: list                  # list of int64 arrays: heterogeneous clusters
    heads: np.ndarray               # [len(clusters)] head client of each cluster

    @property
    def members(self) -> list:
        """Per cluster, the non-head clients (those that distil and upload to the head)."""
        return [np.asarray([c for c in cl if c != h], np.int64)
                for cl, h in zip(self.clusters, self.heads)]


def build_topology(soft_labels, K: int, seed: int, *, symmetric: bool = False,
                   leftover: str = "singleton") -> HFLDDTopology:
    """Steps 2–3 of HFLDD in one call (independent sub-seeds for K-means, sampling, heads)."""
    ss = np.random.SeedSequence(seed).spawn(3)
    s_km, s_het, s_head = (int(s.generate_state(1)[0]) for s in ss)
    S = kl_similarity_matrix(soft_labels, symmetric=symmetric)
    homog = homogeneous_clusters(S, K, s_km)
    clusters = heterogeneous_clusters(homog, s_het, leftover=leftover)
    heads = choose_heads(clusters, s_head)
    return HFLDDTopology(S, homog, clusters, heads)


def cluster_label_coverage(clusters: Sequence[np.ndarray], class_table) -> np.ndarray:
    """Number of distinct classes held by each cluster (class_table: [m, C] sample counts)."""
    table = np.asarray(class_table)
    return np.asarray([int(np.count_nonzero(table[np.asarray(c)].sum(0))) for c in clusters])


# ----------------------------------------------------------------------------------------------
# FedSeq
# ----------------------------------------------------------------------------------------------

def fedseq_confidence(probs, public_labels, num_classes: int | None = None) -> np.ndarray:
    """FedSeq client representer (``client_evaluator.py:__get_prediction``).

    probs: [m, n_public, C] softmax outputs of each client's locally trained model on the
    exemplars; public_labels: [n_public]. ``conf[i, c] = Σ_{x: y(x)=c} p_i(x, c)``, normalised
    to sum 1 per client -> [m, C].
    """
    probs = np.asarray(probs, np.float64)
    y = np.asarray(public_labels, np.int64)
    C = probs.shape[-1] if num_classes is None else int(num_classes)
    onehot = np.eye(C)[y]                                   # [n, C]
    conf = np.einsum("inc,nc->ic", probs[..., :C], onehot)
    return conf / np.maximum(conf.sum(-1, keepdims=True), 1e-300)


def _xlogy(x, y):
    x = np.asarray(x, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, x * np.log(np.where(x > 0, y, 1.0)), 0.0)


def kullback_measure(cluster_vec, client_vec) -> float:
    """FedSeq 'kullback': ``1 − Σ_i m_i log(m_i·C)``, ``m = (cluster + client)/2`` (higher = the
    union is closer to uniform). ``0·log 0 := 0`` (the reference code yields NaN there, which
    then never wins the ``>`` comparison)."""
    m = (np.asarray(cluster_vec, np.float64) + np.asarray(client_vec, np.float64)) / 2
    return float(1.0 - np.sum(_xlogy(m, m * m.size)))


def gini_measure(cluster_vec, client_vec) -> float:
    m = (np.asarray(cluster_vec, np.float64) + np.asarray(client_vec, np.float64)) / 2
    return float(1.0 - np.sum(m * m))


def cosine_measure(cluster_vec, client_vec) -> float:
    a = np.asarray(cluster_vec, np.float64)
    b = np.asarray(client_vec, np.float64)
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


_MEASURES = {"kullback": kullback_measure, "gini": gini_measure, "cosine": cosine_measure}


def fedseq_clusters(confidences, num_examples, min_examples: int = 800, max_clients: int = 11,
                    measure: str = "kullback", code_compat: bool = False) -> list[np.ndarray]:
    """FedSeq ``GreedyClusterMaker`` -> list of int64 arrays of client ids (in insertion order).

    confidences: [m, C] client representers (:func:`fedseq_confidence`); num_examples: [m]
    local dataset sizes. A cluster starts with representer = uniform; while its number of
    examples < ``min_examples`` and its number of clients < ``max_clients`` the remaining client
    maximising ``measure(cluster_representer, client_vec)`` is added (first index wins ties); the
    representer is the data-size-weighted mean of the members' vectors. ``code_compat=True``
    replicates the reference's search, which starts from ``best_diff = 0, best_index = 0``: a
    client only wins with a strictly positive score, so when every score is negative (the
    'kullback' score ``1 − KL(m ‖ uniform)`` is < 0 once KL > 1, e.g. for near one-hot
    confidences) the first remaining client is taken instead of the best one. Otherwise the cluster is closed and a new
    one started. The last cluster, if it has fewer than ``min_examples`` examples, is emptied
    into the other clusters that have room (< ``max_clients``), visiting them cyclically in
    increasing order of examples (popping its clients from the end). Deviations from the
    reference, only in its failure cases: if there is no other cluster or no room anywhere the
    undersized cluster is kept (the reference asserts / silently drops clients).
    """
    conf = np.asarray(confidences, np.float64)
    n_ex = np.asarray(num_examples, np.int64)
    m, C = conf.shape
    fn = _MEASURES[measure]
    uniform = np.full(C, 1.0 / C)

    def representer(members):
        if not members:
            return uniform
        w = n_ex[members].astype(np.float64)
        return (conf[members] * (w / w.sum())[:, None]).sum(0)

    remaining = list(range(m))
    clusters: list[list[int]] = []
    cur: list[int] = []
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
            room = sorted((c for c in clusters if len(c) < max_clients),
                          key=lambda c: int(n_ex[c].sum()))
            for target in itertools.cycle(room) if room else ():
                if len(target) < max_clients:
                    target.append(cur.pop())
                if not cur or all(len(c) >= max_clients for c in room):
                    break
            if cur:
                clusters.append(cur)
        else:
            clusters.append(cur)
    return [np.asarray(c, np.int64) for c in clusters]
