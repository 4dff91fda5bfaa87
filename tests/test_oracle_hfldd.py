"""Oracle tests of the HFLDD family: HFLDD, HFLDD w/o DD, FedSeq and DynaFed.

Each test runs one whole round of the registered algorithm (`setup`, `init`, `step`) on a tiny
deterministic problem (3 classes of random 8x8 images, 3 to 6 clients, jfed's 'mlp', full-batch
local training so that the data order does not matter) and recomputes it here, independently:
NumPy for the forward passes and plain SGD, PyTorch (float64 autograd) where a gradient of a
kernel or of an unrolled training run is needed. jfed's own results enter only as inputs (the
clients' pre-trained models, the initial model, keys jfed drew, the random order in which a
superclient visits its clients) or as what is checked.

Papers and reference code:
- HFLDD: "Dataset-Distillation-Based Hybrid Federated Learning on Non-IID Data", Shi et al.,
  arXiv 2409.17517 (Eq. 4, Algorithms 1 and 2; no public code).
- KIP: "Dataset Distillation with Infinitely Wide Convolutional Networks" / "Dataset
  Meta-Learning from Kernel Ridge-Regression", Nguyen, Chen, Lee, ICLR'21
  (google-research/google-research, kip/KIP.ipynb).
- FedSeq: "Speeding up Heterogeneous Federated Learning with Sequentially Trained Superclients",
  Zaccone et al., ICPR'22 (RickZack/FedSeq, src/algo/fedseq_modules/).
- DynaFed: "DynaFed: Tackling Client Data Heterogeneity with Global Dynamics", Pi et al.,
  CVPR'23 (pipilurj/DynaFed, image_synthesizer.py, server.py).
"""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.cluster import KMeans

from jfed import driver
from jfed.clustering import fedseq_clusters, fedseq_confidence
from jfed.configs.base import base_config
from jfed.data.datasets import Dataset
from jfed.keys import Purpose
from jfed.kip import fc_ntk_kernel, krr_loss
from jfed.methods import common, hfldd
from tests import oracle_numpy as onp
from tests.support import shared_fixture_scope

# The oracles mirror the PyTorch reference code in float64 PyTorch: skipped where it is absent
# (the README's install; CI installs it).
torch = pytest.importorskip('torch')

C = 3
SHAPE = (8, 8, 1)
FEATURES = 64
BATCH = 64  # larger than every client and hybrid dataset: one full-batch step per epoch
LR, MOMENTUM = 0.1, 0.9
HOLDOUT_PER_CLASS, TEST_PER_CLASS = 8, 10


# ------------------------------------------------------------------------------------------------
# the tiny problem
# ------------------------------------------------------------------------------------------------
def _images(rng, labels, templates):
  """Class template + noise through a sigmoid: every pixel distinct and strictly inside (0, 1)."""
  z = templates[labels] + 0.7 * rng.normal(size=(len(labels), FEATURES))
  return (1.0 / (1.0 + np.exp(-z))).reshape(len(labels), *SHAPE).astype(np.float32)


def tiny_problem(client_class_counts, seed=0):
  """A Dataset whose training split is the clients' data in client order, with a held-out part
  (the public set's source) and a test split; `client_class_counts[k][c]` samples of class c at
  client k."""
  rng = np.random.default_rng(seed)
  templates = 1.5 * rng.normal(size=(C, FEATURES))
  labels = [np.repeat(np.arange(C), counts) for counts in client_class_counts]
  labels = [rng.permutation(y) for y in labels]
  train_y = np.concatenate(labels).astype(np.int32)
  holdout_y = np.repeat(np.arange(C), HOLDOUT_PER_CLASS).astype(np.int32)
  test_y = np.repeat(np.arange(C), TEST_PER_CLASS).astype(np.int32)
  dataset = Dataset(
    'tiny',
    _images(rng, train_y, templates),
    train_y,
    _images(rng, test_y, templates),
    test_y,
    C,
    _images(rng, holdout_y, templates),
    holdout_y,
  )
  bounds = np.cumsum([0] + [len(y) for y in labels])
  parts = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  return dataset, parts


def tiny_config(num_clients):
  c = base_config()
  c.dataset.name = 'digits'  # validation only: the data are given
  c.dataset.holdout_size = C * HOLDOUT_PER_CLASS
  c.partition.scheme, c.partition.num_clients = 'iid', num_clients
  c.model = 'mlp'
  c.batch_size = BATCH
  c.optimizer.name, c.optimizer.lr, c.optimizer.momentum = 'sgd', LR, MOMENTUM
  c.logging.tensorboard = False
  return c


def run_round(method, config, ctx):
  """The registered algorithm's setup, init and first step: (algorithm, aux, state, new state,
  the step's records)."""
  algorithm = driver.build_algorithm(method, config)
  aux = algorithm.setup(ctx)
  state = algorithm.init(ctx, aux)
  new_state, records = algorithm.step(ctx, aux, state, 0)
  return algorithm, aux, state, new_state, records


def client_params(local: common.LocalModels, k: int):
  """Client k's pre-trained parameters (NumPy) out of the stacked local models."""
  (group,), (models,) = local.groups, local.models
  row = int(np.flatnonzero(np.asarray(group.client_ids) == k)[0])
  return onp.take_client(models.params, row)


def full_batch_sgd(params, x, y, epochs):
  """`epochs` local epochs of one full batch each (the data order cannot matter)."""
  orders = [np.arange(len(y))] * epochs
  out, _, _ = onp.mlp_local_sgd(params, x, y, orders, BATCH, LR, MOMENTUM)
  return out


def assert_heads_fedavg(state, new_state, records, hybrid, local_epochs, ds):
  """The round: every head trains from the global model on its hybrid set; the new global model
  is their FedAvg weighted by hybrid size, scored on the whole test split."""
  start = onp.to_numpy(state.params)
  heads = [full_batch_sgd(start, x, y, local_epochs) for x, y in hybrid]
  expected = onp.weighted_average(heads, [len(y) for _, y in hybrid])
  onp.assert_tree_close(new_state.params, expected)
  logits = onp.mlp_forward(expected, ds.test_x)
  assert records[0]['test_accuracy'] == pytest.approx(onp.accuracy(logits, ds.test_y))


def assert_rows_of(rows, pool, absent=()):
  """Every row of `rows` is a row of `pool` and of none of `absent`."""
  pool = {r.tobytes() for r in np.asarray(pool, np.float32)}
  assert all(r.tobytes() in pool for r in np.asarray(rows, np.float32))
  for other in absent:
    other = {r.tobytes() for r in np.asarray(other, np.float32)}
    assert not any(r.tobytes() in other for r in np.asarray(rows, np.float32))


# ------------------------------------------------------------------------------------------------
# HFLDD: Eq. 4, K-means, Algorithm 1, KIP, the heads' FedAvg
# ------------------------------------------------------------------------------------------------
HFLDD_CLIENTS = [  # clients dominated by each class: three homogeneous groups of 3, 2 and 2
  (8, 2, 0),
  (7, 0, 3),
  (9, 1, 0),
  (2, 8, 0),
  (0, 7, 3),
  (0, 2, 8),
  (3, 0, 7),
]
KIP_LR, KIP_SUPPORT, KIP_ITERATIONS = 0.01, 4, 2


def hfldd_config():
  c = tiny_config(len(HFLDD_CLIENTS))
  h = c.hfldd
  h.pretrain_epochs, h.public, h.public_size, h.K = 3, 'holdout', 16, 3
  h.rounds, h.local_epochs = 1, 2
  h.image_dtype = 'float32'  # uint8 is checked by the w/o DD test (raw images)
  k = h.kip
  k.support_size, k.iterations, k.lr, k.target_batch = KIP_SUPPORT, KIP_ITERATIONS, KIP_LR, 10
  # RBF: the FC NTK of a support point that coincides with a target point (KIP starts from the
  # member's real images, its targets) has a kink (arccos at correlation 1), so its gradient is
  # defined only up to round-off there; the NTK's value and gradient are checked apart
  # (test_kip_fc_ntk_loss_and_gradient_equal_an_independent_computation). float64 so that the
  # first, sign-like Adam step is not decided by round-off where a gradient is tiny.
  k.kernel, k.reg, k.x64 = 'rbf', 1e-6, True
  return c


def oracle_soft_labels(params, public_x):
  return onp.softmax(onp.mlp_forward(params, public_x))


def oracle_divergence_matrix(p, eps=1e-8):
  """Eq. 4: S[i, j] = (1 / n_public) Σ_x Σ_c p_i(x, c) log(p_i(x, c) / p_j(x, c)), with a floor
  `eps` under the probabilities."""
  p = np.clip(np.asarray(p, np.float64), eps, 1.0)
  p = p / p.sum(-1, keepdims=True)
  m = len(p)
  s = np.zeros((m, m))
  for i in range(m):
    for j in range(m):
      s[i, j] = np.mean(np.sum(p[i] * (np.log(p[i]) - np.log(p[j])), -1))
  return s


def as_partition(labels):
  labels = np.asarray(labels)
  return sorted(sorted(np.flatnonzero(labels == k).tolist()) for k in np.unique(labels))


def algorithm_1_signatures(homog):
  """What Algorithm 1 must produce, as the multiset of homogeneous labels of each heterogeneous
  cluster: while two or more homogeneous clusters have clients, a cluster takes one client of
  each of them; the clients left in the last one become singletons."""
  sizes = collections.Counter(np.asarray(homog).tolist())
  ordered = sorted(sizes.values())
  rounds = ordered[-2] if len(ordered) > 1 else 0
  signatures = [tuple(sorted(k for k, n in sizes.items() if n >= r)) for r in range(1, rounds + 1)]
  largest = max(sizes, key=sizes.get)
  signatures += [(largest,)] * (sizes[largest] - rounds)
  return sorted(signatures)


def _rbf(a, b, gamma):
  d = a[:, None, :] - b[None, :, :]
  return torch.exp(-gamma * (d * d).sum(-1))


def krr_loss_torch(xs, ys, xt, yt, kernel, reg):
  """KIP's loss: 0.5 · mean((K_ts (K_ss + reg · tr(K_ss) / n_s · I)⁻¹ y_s − y_t)²)."""
  k_ss, k_ts = kernel(xs, xs), kernel(xt, xs)
  n = k_ss.shape[0]
  k_reg = k_ss + abs(reg) * torch.trace(k_ss) / n * torch.eye(n, dtype=k_ss.dtype)
  pred = k_ts @ torch.linalg.solve(k_reg, ys)
  return 0.5 * torch.mean((pred - yt) ** 2)


def adam_update(g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-8):
  """torch.optim.Adam's step t (1-based): (update to add, m, v)."""
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
  return -lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def oracle_kip(x_member, y_member, distilled_x, lr, iterations, reg):
  """KIP for one member, from its own data: standardise with its own statistics; identify the
  real images the support started from (each distilled image is within a few Adam steps of
  one); then `iterations` Adam steps on the KRR loss with the member's whole data as target.

  Returns (distilled images, their labels, the support's start indices, the loss per step)."""
  x = np.asarray(x_member, np.float64).reshape(len(x_member), -1)
  mean = x.mean()
  std = np.sqrt(np.mean((x - mean) ** 2)) + 1e-6
  xs = (x - mean) / std
  y_centred = np.eye(C)[y_member] - 1.0 / C
  out = (np.asarray(distilled_x, np.float64).reshape(len(distilled_x), -1) - mean) / std
  distance = np.abs(out[:, None, :] - xs[None, :, :]).max(-1)  # [S, n]
  start = distance.argmin(1)
  assert distance[np.arange(len(start)), start].max() <= 3 * lr * iterations, (
    'a distilled image is no few-steps perturbation of its own member real image'
  )
  assert len(set(start.tolist())) == len(start)
  support, m, v = xs[start].copy(), 0.0, 0.0
  gamma = 1.0 / xs.shape[1]
  target_x, target_y = torch.tensor(xs), torch.tensor(y_centred)
  support_y = torch.tensor(y_centred[start])
  losses = []
  for t in range(1, iterations + 1):
    s = torch.tensor(support, requires_grad=True)
    loss = krr_loss_torch(s, support_y, target_x, target_y, lambda a, b: _rbf(a, b, gamma), reg)
    loss.backward()
    losses.append(float(loss.detach()))
    update, m, v = adam_update(s.grad.numpy(), m, v, t, lr)
    support = support + update
  images = (support * std + mean).reshape(len(start), *SHAPE)
  return images, np.asarray(y_member)[start], start, np.asarray(losses)


def assert_class_balanced(chosen, labels, size):
  """KIP's class-balanced start: round robin over the classes present (r full rounds, then one
  more sample of some of the classes that still have one)."""
  have = collections.Counter(np.asarray(labels).tolist())
  taken = collections.Counter(np.asarray(chosen).tolist())
  r = max(k for k in range(size + 1) if sum(min(n, k) for n in have.values()) <= size)
  assert sum(taken.values()) == size and set(taken) <= set(have)
  assert all(min(n, r) <= taken[c] <= min(n, r + 1) for c, n in have.items())


@pytest.fixture(scope=shared_fixture_scope)
def hfldd_problem():
  dataset, parts = tiny_problem(HFLDD_CLIENTS)
  config = hfldd_config()
  ctx = driver.make_context(config, dataset, parts)
  _, aux, state, new_state, records = run_round('hfldd', config, ctx)
  return config, ctx, aux, state, new_state, records


def test_hfldd_public_set_soft_labels_eq4_kmeans_and_algorithm_1(hfldd_problem):
  config, ctx, aux, _, _, _ = hfldd_problem
  ds, h = ctx.dataset, config.hfldd
  # the public set: held-out training samples, neither a client's nor the test split's
  assert len(aux.public.x) == h.public_size
  assert_rows_of(aux.public.x, ds.holdout_x, absent=(ds.train_x, ds.test_x))
  assert len(aux.public.eval_y) == len(ds.test_y)  # scored on the whole test split

  # soft labels of every client's own pre-trained model -> Eq. 4 (KL(p_i ‖ p_j), sample mean)
  local = common.local_models(ctx, h.pretrain_epochs)
  soft = np.stack(
    [oracle_soft_labels(client_params(local, k), aux.public.x) for k in range(ctx.num_clients)]
  )
  divergences = oracle_divergence_matrix(soft)
  assert not np.allclose(divergences, divergences.T, rtol=1e-2)  # the direction is pinned
  topo = aux.topology
  np.testing.assert_allclose(topo.similarity, divergences, rtol=1e-4, atol=1e-6)

  # K-means (scikit-learn, the same seed) on the ROWS of Eq. 4's matrix
  km_seed = int(np.random.SeedSequence(config.seed).spawn(3)[0].generate_state(1)[0])
  homog = KMeans(n_clusters=h.K, random_state=km_seed, n_init=10).fit_predict(divergences)
  assert as_partition(topo.homog_labels) == as_partition(homog)
  # ... a Lloyd fixed point: every row is nearest to the centroid of its own cluster
  centroids = {k: divergences[homog == k].mean(0) for k in np.unique(homog)}
  for i, row in enumerate(divergences):
    nearest = min(centroids, key=lambda k: np.sum((row - centroids[k]) ** 2))
    assert nearest == homog[i]

  # Algorithm 1: one client of every homogeneous cluster per heterogeneous cluster, leftovers
  # alone; every client exactly once; every head inside its own cluster
  clusters = [np.asarray(c) for c in topo.clusters]
  assert sorted(np.concatenate(clusters).tolist()) == list(range(ctx.num_clients))
  got = sorted(tuple(sorted(homog[c].tolist())) for c in clusters)
  assert got == algorithm_1_signatures(homog)
  assert len(topo.heads) == len(clusters)
  assert all(int(head) in c.tolist() for head, c in zip(topo.heads, clusters))


def test_hfldd_topology_clusters_the_rows_of_eq4_and_leaves_singletons():
  """Soft labels whose Eq. 4 matrix clusters differently by rows, by columns and symmetrised,
  and whose homogeneous clusters are unequal (Algorithm 1's leftovers)."""
  rng = np.random.default_rng(1)
  soft = onp.softmax(2.5 * rng.normal(size=(8, 12, C)))
  seed, K = 0, 3
  topo = hfldd.build_topology(soft, K, seed)
  divergences = oracle_divergence_matrix(soft)
  np.testing.assert_allclose(topo.similarity, divergences, rtol=1e-4, atol=1e-6)
  km_seed = int(np.random.SeedSequence(seed).spawn(3)[0].generate_state(1)[0])

  def kmeans(matrix):
    return KMeans(n_clusters=K, random_state=km_seed, n_init=10).fit_predict(matrix)

  rows = kmeans(divergences)
  assert as_partition(rows) != as_partition(kmeans(divergences.T))
  assert as_partition(rows) != as_partition(kmeans((divergences + divergences.T) / 2))
  assert as_partition(topo.homog_labels) == as_partition(rows)
  assert len(set(collections.Counter(rows.tolist()).values())) > 1
  got = sorted(tuple(sorted(rows[c].tolist())) for c in topo.clusters)
  assert got == algorithm_1_signatures(rows)
  assert any(len(c) == 1 for c in topo.clusters)


def test_hfldd_kip_members_send_to_their_heads_and_the_heads_fedavg(hfldd_problem):
  config, ctx, aux, state, new_state, records = hfldd_problem
  ds, h = ctx.dataset, config.hfldd
  topo = aux.topology
  members = np.concatenate([np.asarray(m, np.int64) for m in topo.members])
  assert len(members) == ctx.num_clients - len(topo.heads) > 0
  sets = hfldd.distill_members(ctx, hfldd.kip_config(h.kip), members)

  # KIP of every member on its own data: the sets, their labels and the KRR loss of each step
  distilled = {}
  for j, member in enumerate(members):
    part = ctx.parts[int(member)]
    x, y, start, losses = oracle_kip(
      ds.train_x[part], ds.train_y[part], sets.x[j], KIP_LR, KIP_ITERATIONS, h.kip.reg
    )
    np.testing.assert_allclose(sets.x[j], x, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(sets.y[j], y)
    np.testing.assert_allclose(sets.loss[j], losses, rtol=1e-6, atol=1e-12)
    assert_class_balanced(y, ds.train_y[part], KIP_SUPPORT)
    distilled[int(member)] = (x, y)

  # each head: its own data, then its members' sets in member order; sizes are the weights
  hybrid = []
  for i, (head, cluster_members) in enumerate(zip(topo.heads, topo.members)):
    own = ctx.parts[int(head)]
    x = np.concatenate([ds.train_x[own]] + [distilled[int(m)][0] for m in cluster_members])
    y = np.concatenate([ds.train_y[own]] + [distilled[int(m)][1] for m in cluster_members])
    n = int(aux.group.fed.sizes[i])
    assert n == len(y)
    np.testing.assert_allclose(aux.group.fed.x[i, :n], x, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(aux.group.fed.y[i, :n], y)
    hybrid.append((x, y))
  assert list(aux.group.client_ids) == [int(hd) for hd in topo.heads]

  assert_heads_fedavg(state, new_state, records, hybrid, h.local_epochs, ds)


def test_hfldd_without_dd_sends_the_raw_uint8_images_to_the_same_heads(hfldd_problem):
  config, ctx, aux_dd, _, _, _ = hfldd_problem
  ds, h = ctx.dataset, config.hfldd
  config = hfldd_config()
  config.hfldd.image_dtype = 'uint8'
  _, aux, state, new_state, records = run_round('hfldd_nodd', config, ctx)
  topo = aux.topology
  assert [c.tolist() for c in topo.clusters] == [c.tolist() for c in aux_dd.topology.clusters]
  np.testing.assert_array_equal(topo.heads, aux_dd.topology.heads)

  def sent(x):  # 8 bits per value on the wire (Eq. 18), back to [0, 1] at the head
    return np.round(np.clip(np.asarray(x, np.float64), 0, 1) * 255) / 255

  hybrid = []
  for head, cluster_members in zip(topo.heads, topo.members):
    own = ctx.parts[int(head)]
    x = np.concatenate(
      [ds.train_x[own]] + [sent(ds.train_x[ctx.parts[int(m)]]) for m in cluster_members]
    )
    y = np.concatenate([ds.train_y[ctx.parts[int(c)]] for c in [head, *cluster_members]])
    hybrid.append((x, y))
  assert aux.group.fed.sizes.tolist() == [len(y) for _, y in hybrid]
  assert_heads_fedavg(state, new_state, records, hybrid, h.local_epochs, ds)


# ------------------------------------------------------------------------------------------------
# KIP's default kernel: the FC NTK's KRR loss and its gradient in the support set
# ------------------------------------------------------------------------------------------------
def ntk_torch(x1, x2, depth=1, w_std=2**0.5, b_std=0.1, same=False):
  """The infinite-width NTK of Flatten -> [Dense ReLU] x depth -> Dense in the NTK
  parameterisation (neural_tangents.stax with W_std, b_std): the arc-cosine recursion of Cho &
  Saul for ReLU. With `same`, the diagonal (correlation 1) takes its closed form, where arccos
  has no derivative."""
  d = x1.shape[1]
  w2, b2 = w_std**2, b_std**2
  nngp = x1 @ x2.T / d
  d1, d2 = (x1 * x1).sum(1) / d, (x2 * x2).sum(1) / d
  ntk = torch.zeros_like(nngp)
  eye = torch.eye(len(x1), dtype=torch.bool) if same else None
  for _ in range(depth):
    nngp, d1, d2 = w2 * nngp + b2, w2 * d1 + b2, w2 * d2 + b2
    ntk = nngp + w2 * ntk
    norm = torch.sqrt(d1[:, None] * d2[None, :])
    c = torch.clamp(nngp / norm, -1.0, 1.0)
    if same:
      c = torch.where(eye, torch.zeros_like(c), c)
    theta = torch.arccos(c)
    j0 = (math.pi - theta) / (2 * math.pi)
    j1 = (torch.sqrt(1 - c * c) + (math.pi - theta) * c) / (2 * math.pi)
    if same:
      j0 = torch.where(eye, torch.full_like(j0, 0.5), j0)
      j1 = torch.where(eye, torch.full_like(j1, 0.5), j1)
    ntk = ntk * j0
    nngp = norm * j1
    d1, d2 = d1 / 2, d2 / 2
  nngp = w2 * nngp + b2
  return nngp + w2 * ntk


def test_kip_fc_ntk_loss_and_gradient_equal_an_independent_computation():
  rng = np.random.default_rng(1)
  n_s, n_t, reg = 5, 9, 1e-3
  xs = rng.normal(size=(n_s, FEATURES))
  xt = rng.normal(size=(n_t, FEATURES))
  ys = np.eye(C)[rng.integers(0, C, n_s)] - 1.0 / C
  yt = np.eye(C)[rng.integers(0, C, n_t)] - 1.0 / C

  s = torch.tensor(xs, requires_grad=True)

  def kernel(a, b):
    return ntk_torch(a, b, same=a is b)

  expected = krr_loss_torch(s, torch.tensor(ys), torch.tensor(xt), torch.tensor(yt), kernel, reg)
  expected.backward()

  def loss(support):
    return krr_loss(support, jnp.asarray(ys), jnp.asarray(xt), jnp.asarray(yt), fc_ntk_kernel, reg)[
      0
    ]

  with jax.enable_x64(True):
    got, grad = jax.value_and_grad(loss)(jnp.asarray(xs))
    got, grad = float(got), np.asarray(grad)
  np.testing.assert_allclose(got, float(expected.detach()), rtol=1e-8)
  np.testing.assert_allclose(grad, s.grad.numpy(), rtol=1e-7, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# FedSeq: confidence vectors, greedy superclients, sequential training, FedAvg of superclients
# ------------------------------------------------------------------------------------------------
FEDSEQ_CLIENTS = [(6, 2, 0), (0, 9, 1), (1, 1, 10), (7, 0, 2), (0, 8, 3), (2, 2, 6)]


def fedseq_config():
  c = tiny_config(len(FEDSEQ_CLIENTS))
  s = c.fedseq
  s.pretrain_epochs, s.public, s.public_size = 3, 'holdout', 18
  s.min_examples, s.max_clients, s.measure = 25, 3, 'kullback'
  s.rounds, s.local_epochs, s.participation = 1, 3, 1.0
  return c


def oracle_confidence(params, public_x, public_y):
  """client_evaluator.py: conf[c] = Σ over exemplars of class c of softmax(f(x))[c], normalised."""
  p = onp.softmax(onp.mlp_forward(params, public_x))
  conf = np.array([p[np.asarray(public_y) == c, c].sum() for c in range(C)])
  return conf / conf.sum()


def test_fedseq_confidence_and_greedy_superclients_follow_the_reference():
  """Data on which a size-weighted and an unweighted representer group differently and an
  undersized last superclient is redistributed."""
  rng = np.random.default_rng(8)
  conf = rng.dirichlet([0.3] * C, size=12)
  sizes = rng.integers(5, 40, 12).tolist()
  expected = onp.fedseq_greedy_superclients(conf, sizes, 60, 4)
  assert expected != onp.fedseq_greedy_superclients(conf, sizes, 60, 4, weighted=False)
  assert any(sum(sizes[k] for k in c[:-1]) >= 60 for c in expected)  # one was redistributed
  got = fedseq_clusters(conf, sizes, min_examples=60, max_clients=4, measure='kullback')
  assert [c.tolist() for c in got] == expected

  probs = onp.softmax(rng.normal(size=(4, 15, C)))
  labels = rng.integers(0, C, 15)
  conf = np.stack([[p[labels == c, c].sum() for c in range(C)] for p in probs])
  np.testing.assert_allclose(
    fedseq_confidence(probs, labels), conf / conf.sum(1, keepdims=True), rtol=1e-12
  )


def test_fedseq_superclients_sequential_training_and_aggregation():
  dataset, parts = tiny_problem(FEDSEQ_CLIENTS, seed=1)
  config = fedseq_config()
  ctx = driver.make_context(config, dataset, parts)
  algorithm, aux, state, new_state, records = run_round('fedseq', config, ctx)
  s = config.fedseq
  assert_rows_of(aux.public.x, dataset.holdout_x, absent=(dataset.train_x, dataset.test_x))

  local = common.local_models(ctx, s.pretrain_epochs)
  conf = np.stack(
    [
      oracle_confidence(client_params(local, k), aux.public.x, aux.public.y)
      for k in range(ctx.num_clients)
    ]
  )
  sizes = [len(p) for p in parts]
  expected = onp.fedseq_greedy_superclients(conf, sizes, s.min_examples, s.max_clients)
  assert [c.tolist() for c in aux.superclients] == expected
  assert len(expected) > 1 and any(len(c) > 1 for c in expected)

  # the round: each superclient hands the model from client to client in its round's order
  selected, orders = algorithm._round_plan(ctx, aux, 0)  # pylint: disable=protected-access
  assert list(selected) == list(range(len(expected)))
  for order, superclient in zip(orders, expected):
    assert sorted(order.tolist()) == sorted(superclient)
  start = onp.to_numpy(state.params)
  models, last_epoch_losses = [], []
  for order in orders:
    params = start
    for k in order:  # a fresh optimiser per client
      x, y = dataset.train_x[parts[k]], dataset.train_y[parts[k]]
      epochs = [np.arange(len(y))] * s.local_epochs
      params, _, losses = onp.mlp_local_sgd(params, x, y, epochs, BATCH, LR, MOMENTUM)
      last_epoch_losses.append(losses[-1])
    models.append(params)
  weights = [sum(sizes[k] for k in c) for c in expected]
  global_params = onp.weighted_average(models, weights)
  onp.assert_tree_close(new_state.params, global_params)
  logits = onp.mlp_forward(global_params, dataset.test_x)
  assert records[0]['test_accuracy'] == pytest.approx(onp.accuracy(logits, dataset.test_y))
  # the round's training loss: every client's last local epoch, averaged over the clients
  assert records[0]['train_loss'] == pytest.approx(np.mean(last_epoch_losses), rel=1e-5)


# ------------------------------------------------------------------------------------------------
# DynaFed: trajectory, one matching step, fine-tuning on the synthetic set
# ------------------------------------------------------------------------------------------------
DYNAFED_CLIENTS = [(5, 3, 0), (0, 6, 6), (2, 0, 8)]  # unequal sizes: uniform ≠ size weights


def dynafed_config():
  c = tiny_config(len(DYNAFED_CLIENTS))
  c.dataset.holdout_size = 0
  d = c.dynafed
  d.rounds, d.local_epochs, d.participation, d.weighting = 2, 2, 1.0, 'uniform'
  d.trajectory_rounds, d.expert_epochs = 1, 1
  d.ipc, d.syn_steps, d.iterations, d.batch_syn = 2, 2, 3, 0
  d.lr_img, d.lr_label, d.lr_lr, d.lr_teacher = 0.05, 0.01, 1e-5, 0.04
  d.label_init, d.noise_mean, d.noise_std = 0.5, 0.5, 0.25  # label_init 0 (reference) is uniform
  d.finetune_epochs, d.finetune_lr, d.finetune_batch = 2, 1e-3, 256
  d.dsa = 'none'
  d.client_optimizer, d.client_lr = 'adam', 1e-3
  return c


def _torch_tree(params):
  return {
    k: {n: torch.tensor(np.asarray(a, np.float64)) for n, a in v.items()}
    for k, v in onp.to_numpy(params).items()
  }


def mlp_torch(params, x):
  names = sorted(params, key=lambda k: int(k.split('_')[1]))
  h = x.reshape(len(x), -1)
  for name in names[:-1]:
    h = torch.relu(h @ params[name]['kernel'] + params[name]['bias'])
  return h @ params[names[-1]]['kernel'] + params[names[-1]]['bias']


def kd_loss_torch(logits, label_logits):
  """DynaFed utils.kd_loss: mean over B·C of −softmax(labels) · log_softmax(logits)."""
  return torch.mean(-torch.softmax(label_logits, -1) * torch.log_softmax(logits, -1))


def adam_train(params, loss_fn, steps, lr):
  """`steps` torch.optim.Adam steps (a fresh optimiser) of a loss of the parameter tree."""
  params = onp.to_numpy(params)
  m = onp.tree_map(np.zeros_like, params)
  v = onp.tree_map(np.zeros_like, params)
  for t in range(1, steps + 1):
    tree = {
      k: {n: torch.tensor(a, requires_grad=True) for n, a in layer.items()}
      for k, layer in params.items()
    }
    loss_fn(tree).backward()
    grads = {k: {n: a.grad.numpy() for n, a in layer.items()} for k, layer in tree.items()}
    out = onp.tree_map(lambda g, mm, vv: adam_update(g, mm, vv, t, lr), grads, m, v)
    params = onp.tree_map(lambda p, o: p + o[0], params, out)
    m = onp.tree_map(lambda o: o[1], out)
    v = onp.tree_map(lambda o: o[2], out)
  return params


def client_ce(x, y):
  x, y = torch.tensor(np.asarray(x, np.float64)), torch.tensor(np.asarray(y, np.int64))
  return lambda tree: torch.nn.functional.cross_entropy(mlp_torch(tree, x), y)


def oracle_matching(z0, start, target, cfg):
  """image_synthesizer.py: from θ_start, syn_steps SGD steps of kd_loss on the synthetic set (all
  of it per step: batch_syn 0) with the learned lr; loss ‖θ_student − θ*‖² / ‖θ_start − θ*‖²;
  Adam on the images (lr_img), the label logits (lr_label) and the lr (lr_lr).
  Returns (images in pixel space, label logits, lr, loss per iteration)."""
  n = len(z0)
  z = np.asarray(z0, np.float64)
  labels = cfg.label_init * np.eye(C)[np.repeat(np.arange(C), cfg.ipc)]
  lr = np.float64(cfg.lr_teacher)
  state = {'z': (0.0, 0.0), 'labels': (0.0, 0.0), 'lr': (0.0, 0.0)}
  start_t, target_t = _torch_tree(start), _torch_tree(target)
  leaves = lambda tree: [tree[k][p] for k in sorted(tree) for p in sorted(tree[k])]
  denominator = sum(torch.sum((a - b) ** 2) for a, b in zip(leaves(start_t), leaves(target_t)))
  losses = []
  for t in range(1, cfg.iterations + 1):
    z_t = torch.tensor(z, requires_grad=True)
    labels_t = torch.tensor(labels, requires_grad=True)
    lr_t = torch.tensor(lr, requires_grad=True)
    x = (cfg.noise_mean + cfg.noise_std * z_t).reshape(n, -1)
    student = {
      k: {p: a.clone().requires_grad_(True) for p, a in v.items()} for k, v in start_t.items()
    }
    for _ in range(cfg.syn_steps):
      flat = leaves(student)
      grads = torch.autograd.grad(
        kd_loss_torch(mlp_torch(student, x), labels_t), flat, create_graph=True
      )
      it = iter(g for g in grads)
      student = {
        k: {p: student[k][p] - lr_t * next(it) for p in sorted(student[k])} for k in sorted(student)
      }
    loss = sum(torch.sum((a - b) ** 2) for a, b in zip(leaves(student), leaves(target_t)))
    loss = loss / denominator
    loss.backward()
    losses.append(float(loss.detach()))
    for name, value, grad, step in (
      ('z', z, z_t.grad.numpy(), cfg.lr_img),
      ('labels', labels, labels_t.grad.numpy(), cfg.lr_label),
      ('lr', lr, lr_t.grad.numpy(), cfg.lr_lr),
    ):
      update, m, v = adam_update(grad, *state[name], t, step)
      state[name] = (m, v)
      if name == 'z':
        z = value + update
      elif name == 'labels':
        labels = value + update
      else:
        lr = value + update
  return cfg.noise_mean + cfg.noise_std * z, labels, float(lr), np.asarray(losses)


def test_dynafed_trajectory_matching_and_fine_tuning():
  dataset, parts = tiny_problem(DYNAFED_CLIENTS, seed=2)
  config = dynafed_config()
  d = config.dynafed
  ctx = driver.make_context(config, dataset, parts)
  algorithm = driver.build_algorithm('dynafed', config)
  aux = algorithm.setup(ctx)
  state0 = algorithm.init(ctx, aux)
  state1, _ = algorithm.step(ctx, aux, state0, 0)
  state2, records = algorithm.step(ctx, aux, state1, 1)

  def fedavg(start):  # every client from the global model, Adam (client_lr), uniform mean
    models = [
      adam_train(
        start, client_ce(dataset.train_x[p], dataset.train_y[p]), d.local_epochs, d.client_lr
      )
      for p in parts
    ]
    return onp.weighted_average(models, np.ones(len(models)))

  # round 1: FedAvg, its global model is the trajectory's θ_1 (θ_0 the initial model)
  theta0 = onp.to_numpy(state0.model.params)
  theta1 = fedavg(theta0)
  onp.assert_tree_close(state1.model.params, theta1)
  trajectory = onp.to_numpy(state1.trajectory)
  onp.assert_tree_close(onp.tree_map(lambda a: a[0], trajectory), theta0, rtol=0, atol=0)
  onp.assert_tree_close(onp.tree_map(lambda a: a[1], trajectory), theta1)

  # round 2 = T + 1: distil once (start θ_0, target θ_1: the only pair of a 1-round trajectory)
  key = jax.random.split(ctx.derive_key(Purpose.SYNTHETIC_SET))[0]  # the noise jfed drew
  n = d.ipc * C
  z0 = np.asarray(jax.random.normal(key, (n, *SHAPE), jnp.float32))
  syn_x, syn_labels, syn_lr, losses = oracle_matching(z0, theta0, theta1, d)
  np.testing.assert_allclose(state2.syn_x, syn_x, rtol=0, atol=1e-5)
  np.testing.assert_allclose(state2.syn_labels, syn_labels, rtol=0, atol=1e-6)
  assert float(state2.syn_lr) == pytest.approx(syn_lr, abs=1.2e-8)  # a float32 ulp per update
  assert records[0]['matching_loss_first'] == pytest.approx(losses[0], rel=1e-4)
  assert records[0]['matching_loss_last'] == pytest.approx(losses[-1], rel=1e-4)

  # then FedAvg from θ_1, and the server fine-tunes the aggregate on the synthetic set
  # (each stage from jfed's result of the stage before, checked above: an Adam step of a
  # gradient near Adam's eps would otherwise carry float32 differences on)
  averaged = fedavg(onp.to_numpy(state1.model.params))
  accuracy_before = onp.accuracy(onp.mlp_forward(averaged, dataset.test_x), dataset.test_y)
  assert records[0]['test_accuracy_before_finetune'] == pytest.approx(accuracy_before)
  # (on the synthetic set jfed holds, equal to the oracle's above)
  x_syn = torch.tensor(np.asarray(state2.syn_x, np.float64).reshape(n, -1))
  y_syn = torch.tensor(np.asarray(state2.syn_labels, np.float64))
  tuned = adam_train(
    averaged,
    lambda tree: kd_loss_torch(mlp_torch(tree, x_syn), y_syn),
    d.finetune_epochs,
    d.finetune_lr,
  )
  onp.assert_tree_close(state2.model.params, tuned)
  assert records[0]['test_accuracy'] == pytest.approx(
    onp.accuracy(onp.mlp_forward(tuned, dataset.test_x), dataset.test_y)
  )
