"""Label-skew partitions of a training set over federated clients.

Each scheme reproduces the partition code of the paper whose numbers we compare against:
`github.com/Xtra-Computing/NIID-Bench` (`utils.py`) for DENSE and FedHydra,
`github.com/epfml/federated-learning-public-code` (`codes/FedDF-code/pcode/datasets/`) for FedDF
and FedMHO, and `github.com/ceh-2000/fed_cvae` (`data.py`) for FedCVAE. The same heterogeneity
knob means different things in DENSE, FedDF and FedCVAE, so "Dirichlet alpha=0.5" is only
comparable within one scheme. Two cross-device schemes follow FedLab's procedures instead and
never redraw, so they scale to 10,000 clients and more: `client_dirichlet` (each client draws
its own class mix) and `unbalanced_iid` (log-normal or power-law client sizes, IID within a
client).

All functions take the label vector, draw every random number from
`np.random.default_rng(seed)` (one generator per call, so a partition is a pure function of
its arguments), and return one int64 index array per client. Within a client the index
order is random. Impossible requests raise `PartitionError` (a ValueError) instead of
looping forever or silently returning empty clients.
"""

import math
from typing import Callable, Optional, Sequence

import numpy as np

from jfed.errors import ConfigError


class PartitionError(ConfigError):
  """A partition request that cannot be satisfied (bad arguments or too little data)."""


def _as_labels(labels) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1:
    raise PartitionError(f'labels must be 1-D, got shape {labels.shape}.')
  if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0):
    raise PartitionError('labels must be non-negative integers.')
  return labels.astype(np.int64)


def _num_classes(labels: np.ndarray, num_classes: Optional[int]) -> int:
  inferred = int(labels.max()) + 1 if labels.size else 0
  if num_classes is None:
    return inferred
  if num_classes < inferred:
    raise PartitionError(f'num_classes={num_classes} but labels go up to {inferred - 1}.')
  return int(num_classes)


def _check_num_clients(num_clients: int, num_samples: int) -> None:
  if num_clients < 1:
    raise PartitionError(f'num_clients must be >= 1, got {num_clients}.')
  if num_clients > num_samples:
    raise PartitionError(
      f'num_clients={num_clients} exceeds the number of samples ({num_samples}).'
    )


def _check_alpha(alpha: float) -> None:
  if not alpha > 0:  # Also rejects NaN.
    raise PartitionError(f'Dirichlet concentration alpha must be > 0, got {alpha}.')


def _finish(parts: Sequence, rng: np.random.Generator) -> list:
  """Shuffles each client's indices (order is arbitrary in every scheme) as int64."""
  return [rng.permutation(np.asarray(p, dtype=np.int64)) for p in parts]


def partition_iid(labels, num_clients: int, seed: int) -> list:
  """Uniformly random split into near-equal parts (sizes differ by at most one).

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n.
    seed: Seed of the generator every random draw comes from.

  Returns:
    A list of n int64 arrays of sample indices, one per client.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(labels))
  return [p.astype(np.int64) for p in np.array_split(order, num_clients)]


def _balanced_dirichlet_split(
  labels: np.ndarray,
  pool: np.ndarray,
  num_clients: int,
  alpha: float,
  num_classes: int,
  rng: np.random.Generator,
  min_size: int,
  max_tries: int,
  shuffle_classes: bool,
) -> list:
  """NIID-Bench's per-class Dirichlet split of `pool` with the balance rule.

  For every class a proportion vector p ~ Dir(alpha * 1) is drawn; clients that already
  hold >= len(pool) / num_clients samples get p_j = 0 (the balance rule that keeps one
  client from swallowing everything), p is renormalised and the class's indices are cut at
  cumsum(p) * n_c. The whole draw is repeated until every client holds >= min_size samples.

  When a tiny alpha makes p vanish on every still-open client (0/0 in the reference code,
  which then splits at garbage positions), the attempt is discarded and redrawn.
  """
  cap = len(pool) / num_clients
  pool_labels = labels[pool]
  for _ in range(max_tries):
    chunks = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    failed = False
    for c in range(num_classes):
      idx_c = pool[pool_labels == c]
      if shuffle_classes:
        idx_c = rng.permutation(idx_c)
      p = rng.dirichlet(np.full(num_clients, alpha))
      p = p * (sizes < cap)
      total = p.sum()
      if not total > 0:
        failed = True
        break
      cuts = (np.cumsum(p / total) * len(idx_c)).astype(np.int64)[:-1]
      for j, piece in enumerate(np.split(idx_c, cuts)):
        chunks[j].append(piece)
        sizes[j] += len(piece)
    if not failed and sizes.min() >= min_size:
      return [np.concatenate(c) if c else np.zeros(0, np.int64) for c in chunks]
  raise PartitionError(
    f'Dirichlet partition (alpha={alpha}, {num_clients} clients, {len(pool)} samples) did '
    f'not give every client >= {min_size} samples in {max_tries} tries. Use a larger '
    f'alpha, fewer clients, a smaller min_size or more max_tries.'
  )


def partition_dirichlet(
  labels, num_clients: int, alpha: float, seed: int, min_size: int = 10, max_tries: int = 1000
) -> list:
  """DENSE / NIID-Bench "noniid-labeldir" Dirichlet label skew.

  As `partition_data` in `github.com/Xtra-Computing/NIID-Bench` (`utils.py`), identical in
  `github.com/zj-jayzhang/DENSE` (`helpers/datasets.py`).

  Per class: shuffle its indices, p ~ Dir(alpha * 1_n), zero out clients already holding
  >= N/n samples, renormalise, split by cumsum; redraw everything until the smallest client
  has >= min_size samples (NIID-Bench/DENSE use 10); finally shuffle each client. Client
  sizes are unequal. Used by DENSE, FedHydra (FL-SA) and the NIID-Bench baselines.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n.
    alpha: Dirichlet concentration; smaller is more skewed.
    seed: Seed of the generator every random draw comes from.
    min_size: Smallest client size accepted; smaller draws are redrawn.
    max_tries: Redraws allowed before PartitionError.

  Returns:
    A list of n int64 arrays of sample indices, one per client.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  _check_alpha(alpha)
  if min_size * num_clients > len(labels):
    raise PartitionError(
      f'min_size={min_size} for {num_clients} clients needs '
      f'{min_size * num_clients} samples, only {len(labels)} given.'
    )
  rng = np.random.default_rng(seed)
  parts = _balanced_dirichlet_split(
    labels,
    np.arange(len(labels)),
    num_clients,
    alpha,
    _num_classes(labels, None),
    rng,
    min_size,
    max_tries,
    shuffle_classes=True,
  )
  return _finish(parts, rng)


def partition_shards_k(
  labels, num_clients: int, k: int, seed: int, num_classes: Optional[int] = None
) -> list:
  """NIID-Bench "#C=k" (noniid-#label{k}): every client sees exactly k classes.

  As `partition_data` in `github.com/Xtra-Computing/NIID-Bench` (`utils.py`).

  Client i owns class i mod C plus k-1 further distinct classes drawn uniformly at random;
  each class's shuffled indices are `array_split` equally among its owners. k = C gives each
  client an equal share of every class.

  Unassigned samples: a class that no client owns is dropped, its samples go to no one
  (NIID-Bench itself would crash there, `np.array_split(idx, 0)`). That is certain when
  num_clients * k < C and possible whenever num_clients < C, because the k-1 extra classes
  are random: e.g. k=2 on 5 clients of 10 classes covers classes 0-4 plus at most five
  random others, so usually some classes (and their samples) are left out. Only with
  num_clients >= C is every class owned. `unassigned_count(parts, len(labels))` tells how
  many samples were dropped; the command-line driver notes it in partition.txt and prints it.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n.
    k: Number of distinct classes each client holds, in [1, C].
    seed: Seed of the generator every random draw comes from.
    num_classes: C; None takes max(labels) + 1.

  Returns:
    A list of n int64 arrays of sample indices, one per client.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  num_classes = _num_classes(labels, num_classes)
  if not 1 <= k <= num_classes:
    raise PartitionError(f'k (classes per client) must be in [1, {num_classes}], got {k}.')
  rng = np.random.default_rng(seed)
  owned = []
  for i in range(num_clients):
    classes = [i % num_classes]
    while len(classes) < k:
      c = int(rng.integers(num_classes))
      if c not in classes:
        classes.append(c)
    owned.append(classes)
  parts = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    owners = [i for i in range(num_clients) if c in owned[i]]
    idx_c = rng.permutation(np.flatnonzero(labels == c))
    if not owners:
      continue
    for i, piece in zip(owners, np.array_split(idx_c, len(owners))):
      parts[i].append(piece)
  return _finish([np.concatenate(p) for p in parts], rng)


def partition_disjoint(
  labels, num_clients: int, seed: int, num_classes: Optional[int] = None
) -> list:
  """FedHydra Table 2 "2c/c"-style: clients own disjoint sets of whole classes.

  The classes are shuffled and `array_split` into num_clients groups (C/m each; when m
  does not divide C the first C mod m clients get one class more); a client receives every
  sample of its classes. This is the most extreme label skew: no class is shared.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n, at most C.
    seed: Seed of the generator every random draw comes from.
    num_classes: C; None takes max(labels) + 1.

  Returns:
    A list of n int64 arrays of sample indices, one per client.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  num_classes = _num_classes(labels, num_classes)
  if num_clients > num_classes:
    raise PartitionError(
      f'Disjoint partition needs num_clients <= num_classes, got '
      f'{num_clients} clients for {num_classes} classes.'
    )
  rng = np.random.default_rng(seed)
  groups = np.array_split(rng.permutation(num_classes), num_clients)
  return _finish([np.flatnonzero(np.isin(labels, g)) for g in groups], rng)


def partition_feddf_dirichlet(
  labels, num_clients: int, alpha: float, seed: int, group_size: int = 10, max_tries: int = 1000
) -> list:
  """FedDF / FedMHO `build_non_iid_by_dirichlet` + `DataPartitioner`.

  As `github.com/epfml/federated-learning-public-code` and `github.com/YXShi2000/FedMHO` do it
  (`codes/FedDF-code/pcode/datasets/partition_data.py` and `create_dataset.py` in the former).

  The samples are shuffled and cut into ceil(n / group_size) consecutive blocks, one per
  group of `group_size` (10) "auxiliary workers" (the last block takes the remainder); each
  block gets the balanced per-class Dirichlet split, redrawn until every worker of the group
  holds >= int(0.5 * block / workers) samples. The per-worker lists are concatenated and
  the concatenation is re-sliced into n equal chunks of N // n: final sizes are equal, the
  label skew comes from the ordering, and the N mod n trailing samples are dropped (as
  FedDF's `int(N / n)` slicing does). FedDF asserts n >= group_size.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n, at least `group_size`.
    alpha: Dirichlet concentration; smaller is more skewed.
    seed: Seed of the generator every random draw comes from.
    group_size: Workers per block (FedDF's 10).
    max_tries: Redraws of a block allowed before PartitionError.

  Returns:
    A list of n int64 arrays of N // n sample indices each, one per client.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  _check_alpha(alpha)
  if num_clients < group_size:
    raise PartitionError(
      f'FedDF Dirichlet partition needs num_clients >= {group_size} '
      f'(its auxiliary-worker group size), got {num_clients}.'
    )
  num_classes = _num_classes(labels, None)
  n = len(labels)
  rng = np.random.default_rng(seed)
  order = rng.permutation(n)
  num_groups = math.ceil(num_clients / group_size)
  block = int(group_size / num_clients * n)
  lists, remaining = [], num_clients
  for g in range(num_groups):
    pool = order[g * block : (n if g == num_groups - 1 else (g + 1) * block)]
    workers = min(group_size, remaining)
    remaining -= group_size
    lists += _balanced_dirichlet_split(
      labels,
      pool,
      workers,
      alpha,
      num_classes,
      rng,
      min_size=int(0.5 * len(pool) / workers),
      max_tries=max_tries,
      shuffle_classes=False,
    )
  flat = np.concatenate(lists)
  chunk = n // num_clients
  return _finish([flat[i * chunk : (i + 1) * chunk] for i in range(num_clients)], rng)


def partition_fedcvae_dirichlet(
  labels,
  num_clients: int,
  alpha: float,
  seed: int,
  sample_ratio: float = 1.0,
  num_classes: Optional[int] = None,
) -> list:
  """FedCVAE's Dirichlet split (`split_data_dirichlet`, `github.com/ceh-2000/fed_cvae`, `data.py`).

  Unlike DENSE, the Dirichlet is drawn per *client* over classes: props_u ~ Dir(alpha * 1_C),
  stacked [U, C] and normalised per class column; client u gets int(props[u, c] * n_c) of
  class c (consecutive pieces of the shuffled class), and the samples left over by the
  flooring go one by one to uniformly random clients. Optionally only a random
  `sample_ratio` of the data is used first (FedCVAE: 0.5 on MNIST/FMNIST). There is no
  minimum size: with tiny alpha some clients can be (nearly) empty, as in the original.
  A class column that is all zero (possible for tiny alpha) is handed out entirely as
  leftovers instead of the original's 0/0.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients U.
    alpha: Dirichlet concentration; smaller is more skewed.
    seed: Seed of the generator every random draw comes from.
    sample_ratio: Fraction of the data, in (0, 1], drawn before partitioning.
    num_classes: C; None takes max(labels) + 1.

  Returns:
    A list of U int64 arrays of sample indices, one per client (some may be empty).
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  _check_alpha(alpha)
  if not 0 < sample_ratio <= 1:
    raise PartitionError(f'sample_ratio must be in (0, 1], got {sample_ratio}.')
  num_classes = _num_classes(labels, num_classes)
  rng = np.random.default_rng(seed)
  pool = np.arange(len(labels))
  if sample_ratio < 1:
    pool = rng.permutation(len(labels))[: int(len(labels) * sample_ratio)]
    if num_clients > len(pool):
      raise PartitionError(
        f'num_clients={num_clients} exceeds the {len(pool)} samples '
        f'kept by sample_ratio={sample_ratio}.'
      )
  class_idx = [rng.permutation(pool[labels[pool] == c]) for c in range(num_classes)]
  props = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)  # [U, C]
  col = props.sum(axis=0, keepdims=True)
  scaled = np.divide(props, col, out=np.zeros_like(props), where=col > 0)
  parts = [[] for _ in range(num_clients)]
  for c, idx_c in enumerate(class_idx):
    counts = (scaled[:, c] * len(idx_c)).astype(np.int64)
    ends = np.cumsum(counts)
    for u in range(num_clients):
      parts[u].append(idx_c[ends[u] - counts[u] : ends[u]])
    leftover = idx_c[ends[-1] :]
    owners = rng.integers(num_clients, size=len(leftover))
    for u in range(num_clients):
      parts[u].append(leftover[owners == u])
  return _finish([np.concatenate(p) for p in parts], rng)


SIZE_DISTRIBUTIONS = ('equal', 'lognormal', 'powerlaw')


def _client_sizes(
  num_clients: int,
  num_samples: int,
  distribution: str,
  sigma: float,
  exponent: float,
  rng: np.random.Generator,
) -> np.ndarray:
  """Client sizes summing to num_samples, each at least 1.

  'equal': sizes differ by at most one. Otherwise every client gets one sample and the other
  N - n are shared in proportion to per-client weights w_i (largest-remainder rounding), so
  size_i - 1 is w_i times a common scale, up to rounding: 'lognormal' draws log w_i ~ N(0,
  sigma^2), 'powerlaw' draws Pareto weights, P(w > x) = x^-exponent for x >= 1.
  """
  if distribution not in SIZE_DISTRIBUTIONS:
    raise PartitionError(
      f'size_distribution is {distribution!r}; valid: {", ".join(SIZE_DISTRIBUTIONS)}.'
    )
  if distribution == 'equal':
    return num_samples // num_clients + (np.arange(num_clients) < num_samples % num_clients)
  if distribution == 'lognormal':
    if not sigma >= 0:  # Also rejects NaN.
      raise PartitionError(f'size_sigma must be >= 0, got {sigma}.')
    log_w = sigma * rng.standard_normal(num_clients)
  else:
    if not exponent > 0:
      raise PartitionError(f'size_exponent must be > 0, got {exponent}.')
    log_w = rng.standard_exponential(num_clients) / exponent  # exp(E / a) is Pareto(a)
  # In log space first: a small exponent gives weights that overflow a float64.
  weights = np.exp(log_w - log_w.max())
  spare = num_samples - num_clients
  quota = spare * weights / weights.sum()
  sizes = np.floor(quota).astype(np.int64)
  sizes[np.argsort(sizes - quota, kind='stable')[: spare - sizes.sum()]] += 1
  return sizes + 1


def _split_by_owner(
  indices: np.ndarray, owners: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list:
  """Per client, the `indices` whose owner it is, in random order (one sort for all clients)."""
  order = np.lexsort((rng.random(len(indices)), owners))
  counts = np.bincount(owners, minlength=num_clients)
  return np.split(indices[order].astype(np.int64), np.cumsum(counts)[:-1])


def partition_unbalanced_iid(
  labels,
  num_clients: int,
  seed: int,
  size_distribution: str = 'lognormal',
  size_sigma: float = 1.0,
  size_exponent: float = 1.5,
) -> list:
  """IID within each client, unequal client sizes, as natural clients of a cross-device population.

  Sizes: every client holds at least one sample; the remaining N - n are shared in proportion
  to per-client weights w_i with largest-remainder rounding, so every sample is used and
  size_i - 1 = w_i * (N - n) / sum(w) up to rounding. 'lognormal' draws log w_i ~ N(0,
  size_sigma^2) as FedLab's `lognormal_unbalance_partition` does (FedLab: "FedLab: A Flexible
  Federated Learning Framework", Zeng, Liang, Hu, Wang and Xu, JMLR 24(100), 2023;
  `github.com/SMILELab-FL/FedLab`, `fedlab/utils/dataset/functional.py`; FedLab floors the
  sizes and has no minimum). 'powerlaw' draws Pareto weights, P(w > x) = x^-size_exponent for
  x >= 1 (density proportional to x^-(size_exponent + 1); its mean is infinite for
  size_exponent <= 1): the power-law device sizes of FedProx's synthetic data ("Federated
  Optimization in Heterogeneous Networks", Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith,
  MLSys 2020) in a parameterisation of ours. 'equal' gives sizes that differ by at most one
  (then this is `partition_iid`'s law). The samples are shuffled once and cut at the sizes.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n.
    seed: Seed of the generator every random draw comes from.
    size_distribution: 'lognormal', 'powerlaw' or 'equal'.
    size_sigma: Standard deviation of log w for 'lognormal' (0: equal sizes up to rounding).
    size_exponent: Pareto tail exponent of w for 'powerlaw'; smaller is more unequal.

  Returns:
    A list of n int64 arrays of sample indices, one per client, each non-empty.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  rng = np.random.default_rng(seed)
  sizes = _client_sizes(num_clients, len(labels), size_distribution, size_sigma, size_exponent, rng)
  order = rng.permutation(len(labels)).astype(np.int64)
  return np.split(order, np.cumsum(sizes)[:-1])


def partition_client_dirichlet(
  labels,
  num_clients: int,
  alpha: float,
  seed: int,
  size_distribution: str = 'lognormal',
  size_sigma: float = 1.0,
  size_exponent: float = 1.5,
  num_classes: Optional[int] = None,
) -> list:
  """Per-client Dirichlet label skew: each client draws its own class mix; never redraws.

  The per-client prior of Hsu, Qi and Brown ("Measuring the Effects of Non-Identical Data
  Distribution for Federated Visual Classification", arXiv 1909.06335, 2019) and FedDyn
  ("Federated Learning Based on Dynamic Regularization", Acar, Zhao, Matas, Mattina, Whatmough
  and Saligrama, ICLR 2021), as FedLab implements it (`client_inner_dirichlet_partition` in
  `github.com/SMILELab-FL/FedLab`, `fedlab/utils/dataset/functional.py`). Unlike NIID-Bench's
  per-class split (`partition_dirichlet`), nothing is redrawn, so it scales to cross-device
  populations (10,000 clients in well under a second).

  1. Sizes s_i from `size_distribution` (see `partition_unbalanced_iid`; they sum to N and
     are each >= 1).
  2. Class mix p_i ~ Dir(alpha * 1_C) per client (Hsu et al.'s Dir(alpha' * prior) with a
     uniform prior is this with alpha = alpha' / C), and wanted counts ~ Multinomial(s_i, p_i).
  3. The clients, in a random order, take their wanted counts from the shuffled class pools
     without replacement; where a pool runs dry the later clients get what is left of it.
  4. Fallback: each client short of s_i draws the missing samples from Multinomial over the
     classes that still have samples, with its p_i renormalised to them (what FedLab's
     redraw-until-a-class-has-samples loop amounts to; the remaining pools' proportions for
     a client whose p_i is zero on all of them), and step 3 repeats. Every pass either fills
     every client or empties a class, so at most C passes; as the sizes sum to N, every
     sample ends up with exactly one client.

  FedLab draws sample by sample from uniformly random clients instead of whole counts per
  client in a random order; both give each client Multinomial(s_i, p_i) counts until pools
  run dry.

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n.
    alpha: Dirichlet concentration of each client's class mix; smaller is more skewed.
    seed: Seed of the generator every random draw comes from.
    size_distribution: 'lognormal', 'powerlaw' or 'equal' (Hsu et al.'s and FedDyn's equal
      sizes).
    size_sigma: Standard deviation of log w for 'lognormal'.
    size_exponent: Pareto tail exponent of w for 'powerlaw'.
    num_classes: C; None takes max(labels) + 1.

  Returns:
    A list of n int64 arrays of sample indices, one per client, each non-empty.
  """
  labels = _as_labels(labels)
  _check_num_clients(num_clients, len(labels))
  _check_alpha(alpha)
  num_classes = _num_classes(labels, num_classes)
  rng = np.random.default_rng(seed)
  sizes = _client_sizes(num_clients, len(labels), size_distribution, size_sigma, size_exponent, rng)
  props = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
  order = rng.permutation(num_clients)
  left = np.bincount(labels, minlength=num_classes)
  granted = np.zeros((num_clients, num_classes), np.int64)
  want = rng.multinomial(sizes, props)
  for _ in range(num_classes + 1):
    # Served in `order`: a client gets what the clients before it left of each pool.
    queued = want[order]
    before = np.cumsum(queued, axis=0) - queued
    got = np.clip(left - before, 0, queued)
    granted[order] += got
    left -= got.sum(axis=0)
    short = sizes - granted.sum(axis=1)
    if not short.any():
      break
    mix = props * (left > 0)
    total = mix.sum(axis=1, keepdims=True)
    mix = np.where(total > 0, mix / np.where(total > 0, total, 1.0), left / left.sum())
    want = rng.multinomial(short, mix)
  assert not (sizes - granted.sum(axis=1)).any()
  pieces, owners = [], []
  for c in range(num_classes):
    take = granted[:, c]
    pieces.append(rng.permutation(np.flatnonzero(labels == c))[: take.sum()])
    owners.append(np.repeat(np.arange(num_clients), take))
  return _split_by_owner(np.concatenate(pieces), np.concatenate(owners), num_clients, rng)


_SCHEMES: dict = {
  'iid': partition_iid,
  'dirichlet': partition_dirichlet,
  'shards': partition_shards_k,
  'disjoint': partition_disjoint,
  'feddf_dirichlet': partition_feddf_dirichlet,
  'fedcvae_dirichlet': partition_fedcvae_dirichlet,
  'client_dirichlet': partition_client_dirichlet,
  'unbalanced_iid': partition_unbalanced_iid,
}


# The config.partition keys each scheme takes as arguments.
_SCHEME_ARGUMENTS = {
  'iid': (),
  'disjoint': (),
  'shards': ('k',),
  'dirichlet': ('alpha', 'min_size'),
  'feddf_dirichlet': ('alpha',),
  'fedcvae_dirichlet': ('alpha',),
  'client_dirichlet': ('alpha', 'size_distribution', 'size_sigma', 'size_exponent'),
  'unbalanced_iid': ('size_distribution', 'size_sigma', 'size_exponent'),
}


def available_schemes() -> list:
  return list(_SCHEMES)


def partition_arguments(scheme: str) -> tuple:
  """The config.partition keys that `scheme` takes (e.g. ('alpha', 'min_size'))."""
  if scheme not in _SCHEME_ARGUMENTS:
    raise PartitionError(f'Unknown partition scheme {scheme!r}; valid: {", ".join(_SCHEMES)}.')
  return _SCHEME_ARGUMENTS[scheme]


def make_partition(labels, num_clients: int, scheme: str, seed: int, **kw) -> list:
  """Dispatches to the partition function of `scheme`; `kw` are its extra arguments.

  E.g. make_partition(y, 5, 'dirichlet', 0, alpha=0.5) or
  make_partition(y, 10, 'shards', 0, k=2).

  Args:
    labels: Integer class label of every training sample, shape [N].
    num_clients: Number of clients n.
    scheme: Name of the scheme, a key of the registry (e.g. 'iid', 'dirichlet', 'shards').
    seed: Seed of the generator every random draw comes from.
    **kw: The scheme's own arguments (alpha, k, ...).

  Returns:
    A list of n int64 arrays of sample indices, one per client.
  """
  fn: Optional[Callable] = _SCHEMES.get(scheme)
  if fn is None:
    raise PartitionError(f'Unknown partition scheme {scheme!r}; valid: {", ".join(_SCHEMES)}.')
  return fn(labels, num_clients, seed=seed, **kw)


def unassigned_count(parts: Sequence, num_samples: int) -> int:
  """How many of the samples 0..num_samples-1 no client holds.

  Nonzero for `shards` when some class has no owner (see `partition_shards_k`), for
  `feddf_dirichlet` (the N mod n tail) and for `fedcvae_dirichlet` with sample_ratio < 1.
  A sample held by two clients counts once.

  Raises:
    PartitionError: an index outside [0, num_samples) or a negative num_samples.
  """
  if num_samples < 0:
    raise PartitionError(f'num_samples must be >= 0, got {num_samples}.')
  assigned = np.zeros(int(num_samples), dtype=bool)
  for i, p in enumerate(parts):
    p = np.asarray(p, dtype=np.int64).reshape(-1)
    if p.size and (p.min() < 0 or p.max() >= num_samples):
      raise PartitionError(f'parts[{i}] holds indices outside [0, {num_samples}).')
    assigned[p] = True
  return int(num_samples - np.count_nonzero(assigned))


def class_count_table(labels, parts: Sequence, num_classes: int) -> np.ndarray:
  """[clients, classes] int64 table: how many samples of each class each client holds.

  Args:
    labels: Integer class label of every training sample, shape [N].
    parts: Per client, the indices into `labels` it holds.
    num_classes: Number of columns C.

  Returns:
    The [len(parts), C] int64 count table.
  """
  labels = _as_labels(labels)
  if labels.size and labels.max() >= num_classes:
    raise PartitionError(f'labels go up to {labels.max()}, num_classes={num_classes}.')
  table = np.zeros((len(parts), num_classes), dtype=np.int64)
  for i, p in enumerate(parts):
    table[i] = np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=num_classes)
  return table


# Up to this many clients partition.txt lists every client; above it a summary and the first and
# last `TABLE_EDGE_ROWS` rows.
FULL_TABLE_MAX_CLIENTS = 100
TABLE_EDGE_ROWS = 5
# The quantiles of the summary, with their column names.
SUMMARY_QUANTILES = (
  ('min', 0.0),
  ('p10', 0.1),
  ('p25', 0.25),
  ('median', 0.5),
  ('p75', 0.75),
  ('p90', 0.9),
  ('max', 1.0),
)


def _aligned(rows: Sequence) -> list:
  """The rows of cells as lines, each column right-aligned to its widest cell."""
  widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
  return ['  '.join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]


def format_count_table(table) -> str:
  """Plain-text class-count table with row and column totals.

  Up to `FULL_TABLE_MAX_CLIENTS` clients, one row per client. Above, a file of one line per
  client would run to 10,000 lines at cross-device scale, so the text starts with a summary
  instead: the client and sample counts, the quantiles (numpy's default, linear) of the
  samples per client and of the classes per client (classes with a nonzero count), then the
  table's first and last `TABLE_EDGE_ROWS` client rows around a '...' line, and the total per
  class as the last line, as in the full table.
  """
  table = np.asarray(table, dtype=np.int64)
  num_clients, num_classes = table.shape
  header = ['client'] + [f'c{c}' for c in range(num_classes)] + ['total']
  shown = np.arange(num_clients)
  if num_clients > FULL_TABLE_MAX_CLIENTS:
    shown = np.r_[shown[:TABLE_EDGE_ROWS], shown[-TABLE_EDGE_ROWS:]]
  rows = [[str(i)] + [str(v) for v in table[i]] + [str(table[i].sum())] for i in shown]
  total = ['total'] + [str(v) for v in table.sum(axis=0)] + [str(table.sum())]
  lines = _aligned([header] + rows + [total])
  rule = '-' * len(lines[0])
  if num_clients <= FULL_TABLE_MAX_CLIENTS:
    return '\n'.join([lines[0], rule] + lines[1:-1] + [rule, lines[-1]])
  body = lines[1 : 1 + TABLE_EDGE_ROWS] + ['...'] + lines[1 + TABLE_EDGE_ROWS : -1]
  return '\n'.join(
    _count_summary(table)
    + ['', f'the first and last {TABLE_EDGE_ROWS} of the {num_clients} clients:', lines[0], rule]
    + body
    + [rule, lines[-1]]
  )


def _count_summary(table: np.ndarray) -> list:
  """The summary lines of a large count table: counts, then the per-client quantiles."""
  num_clients, num_classes = table.shape
  sizes = table.sum(axis=1)
  classes = np.count_nonzero(table, axis=1)
  head = [
    f'{num_clients} clients, {int(sizes.sum())} samples, {num_classes} classes; '
    f'{int(np.count_nonzero(sizes == 0))} clients empty (summary: more than '
    f'{FULL_TABLE_MAX_CLIENTS} clients)',
    '',
  ]
  names = [name for name, _ in SUMMARY_QUANTILES]
  rows = [['per client'] + names + ['mean']]
  for label, values in (('samples', sizes), ('classes', classes)):
    q = np.quantile(values, [p for _, p in SUMMARY_QUANTILES])
    rows.append([label] + [f'{v:g}' for v in q] + [f'{values.mean():.4g}'])
  return head + _aligned(rows)
