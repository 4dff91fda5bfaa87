"""Oracle test of FedHydra's server stage (issue 33): model stratification, stratified
aggregation and one HASA epoch, from given client models, against an independent PyTorch
computation written from the paper's equations.

FedHydra: Bai, Song, Wu et al., "FedHydra: a unified, data-free one-shot federated learning
framework" (arXiv 2410.21119, KDD'25), §3.2 (MS, Eqs. 1-7, Algorithm 2), §3.3 (SA, Eqs. 8-11,
Algorithm 3; HASA, Eqs. 12-19, Algorithm 1). Its generator step follows DENSE (Zhang et al.,
NeurIPS'22, github.com/zj-jayzhang/DENSE), which FedHydra builds on: Adam with betas
(0.5, 0.999), the generator's BatchNorm in train mode, teachers in eval mode.

The problem: sklearn digits restricted to 3 classes, 3 clients that each mostly own one class
(client 0: classes 0 and 1, client 1: 1 and 2, client 2: 2 and 0, unequal counts), jfed's
`cnn_mnist` (BatchNorm, so Eq. 14's BN term is live), FedHydra's §4.1.3 generator at nz = 8,
ngf = 4. jfed runs its registered Algorithm (setup: local training and MS, in the batched form
an accelerator picks, chunks of 4 runs; init; step 0: one HASA epoch of T_G = 2 generator steps
on 6 images, then one student step on the 12 pooled intermediates). The oracle takes jfed's
*inputs*: the client models, the random student, the initial generators and noise each run
draws from its key, the target labels. It recomputes, in float64 PyTorch, without jfed's
models, losses, optimisers or aggregation:

  MS   for every client k and class j a fresh generator trained T_G^MS Adam steps on
       CE(F_k(G(z)), j), the losses recorded before each step (Eq. 1); u_{k,j} (Eq. 2),
       U = uᵀ (c × m, Eq. 3), U_r: each row (class) normalised over clients (Eqs. 4-5),
       U_c: each column (client) normalised over classes (Eqs. 6-7);
  SA   P[i, j] = Σ_k U_r[y_i, k] · U_c[j, k] · P_k[i, j] (Eqs. 8-11), teacher k = client k;
  HASA the generator's loss CE(SA, y) + λ1·(1/m)Σ_k L_BN,k + λ2·(−KL(SA ‖ F_g)) (Eqs. 13-16)
       for T_G Adam steps (θ_G only, z fixed), every step's G(z) pooled with its label; the
       student's loss KL(SA ‖ F_g) + β·CE(F_g, argmax SA) (Eqs. 17-19) and one SGD step on
       the pool. λ2 and β are not 1, and both KLs are taken at a temperature other than 1
       (jfed's `adv_T`, `kd_T`; the paper's T = 1 is their default), so that a weight or a
       temperature lost on its way to the losses shows.
and compares MS's losses, u, U, U_r, U_c, the pool, the generator's parameters, the generator
losses and the student's parameters and BatchNorm statistics after the step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver
from jfed.configs.base import base_config
from jfed.data.datasets import Dataset
from jfed.distill import dense_generator_init, make_generator
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import fedhydra, oneshot
from tests.support import shared_fixture_scope

torch = pytest.importorskip('torch')
F = torch.nn.functional

NUM_CLASSES = 3
NZ, NGF = 8, 4
MS_T_G, MS_BATCH, MS_LR = 3, 4, 0.05
T_G, BATCH, LR_G = 2, 6, 0.01
LAMBDA1, LAMBDA2, BETA = 0.5, 0.7, 0.8
ADV_T, KD_T = 2.0, 1.5  # KL(softmax(P/T) ‖ softmax(s/T)), no T² (FedHydra's `t_squared=False`)
KD_LR = 0.1
BN_EPS = 1e-5
BN_MOMENTUM = 0.1  # PyTorch's: running ← (1 − 0.1)·running + 0.1·batch


# ---------------------------------------------------------------------------------------------
# the problem
# ---------------------------------------------------------------------------------------------


def _dataset_and_parts():
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top

  d = load_digits()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  y = d.target.astype(np.int32)
  keep = [np.flatnonzero(y == c) for c in range(NUM_CLASSES)]
  train = np.concatenate([k[:24] for k in keep])
  test = np.concatenate([k[24:34] for k in keep])
  ds = Dataset('digits', x[train], y[train], x[test], y[test], NUM_CLASSES)
  by_class = [np.flatnonzero(ds.train_y == c) for c in range(NUM_CLASSES)]
  # client k owns most of class k and a few of class k + 1 (unequal, so no U row is uniform)
  parts = [
    np.concatenate([by_class[0][:20], by_class[1][:3]]),
    np.concatenate([by_class[1][3:23], by_class[2][:6]]),
    np.concatenate([by_class[2][6:24], by_class[0][20:24]]),
  ]
  return ds, parts


def _config():
  c = base_config()
  c.seed = 4
  c.model = 'cnn_mnist'
  c.batch_size = 8
  c.optimizer.lr = 0.05
  c.partition.num_clients = 3
  c.logging.tensorboard = False
  c.fedhydra.update(
    {
      'local_epochs': 2,
      'epochs': 1,
      'T_G': T_G,
      'lr_g': LR_G,
      'synthesis_batch': BATCH,
      'lambda1': LAMBDA1,
      'lambda2': LAMBDA2,
      'nz': NZ,
      'ngf': NGF,
      'ms_T_G': MS_T_G,
      'ms_lr': MS_LR,
      'ms_batch': MS_BATCH,
      'ms_impl': 'batched',
      'ms_chunk': 4,  # lax.map over chunks of 4 of the 9 runs
      'beta': BETA,
      'adv_T': ADV_T,
      'kd_T': KD_T,
      'kd_lr': KD_LR,
      'kd_batch': T_G * BATCH,  # one student step on the whole pool
      'pool_quantize': False,
    }
  )
  return c


@pytest.fixture(scope=shared_fixture_scope)
def hydra_run(tmp_path_factory):
  """jfed's FedHydra on the tiny problem, in a workdir: the context, the aux after setup, the
  state before and after step 0 (one HASA epoch) and that step's record."""
  config = _config()
  ds, parts = _dataset_and_parts()
  ctx = driver.make_context(config, ds, parts, workdir=tmp_path_factory.mktemp('fedhydra'))
  algo = driver.build_algorithm('fedhydra', config)
  aux = algo.setup(ctx)
  state0 = algo.init(ctx, aux)
  state1, records = algo.step(ctx, aux, state0, 0)
  return ctx, aux, state0, state1, records[0]


# ---------------------------------------------------------------------------------------------
# PyTorch forward passes from flax parameter trees (NHWC in and out, float64)
# ---------------------------------------------------------------------------------------------


def _t(a):
  return torch.tensor(np.array(a, np.float64))


def _tree(tree, requires_grad=False):
  if hasattr(tree, 'items'):
    return {k: _tree(v, requires_grad) for k, v in tree.items()}
  return _t(tree).requires_grad_(requires_grad)


def _take(tree, k):
  return jax.tree.map(lambda a: np.asarray(a)[k], tree)


def _bn_batch_stats(h):
  """Mean and biased variance of an NCHW map over (N, H, W)."""
  return h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)


def _bn(h, scale, bias, mean, var):
  shape = (1, -1, 1, 1)
  return (h - mean.view(shape)) / torch.sqrt(var.view(shape) + BN_EPS) * scale.view(
    shape
  ) + bias.view(shape)


def cnn_mnist(params, stats, x, train=False):
  """DENSE's CNNMnist: [Conv5x5(pad 2) BN ReLU MaxPool2] x 2 -> Linear (flatten in HWC order,
  as the flax parameters expect). Returns (logits, per BN layer (input mean, input biased var)).
  train: BatchNorm on the batch's statistics (PyTorch's train mode), else the running ones."""
  h = x.permute(0, 3, 1, 2)
  inputs = []
  for i in (0, 1):
    conv = params[f'Conv_{i}']
    h = F.conv2d(h, conv['kernel'].permute(3, 2, 0, 1), conv['bias'], padding=2)
    mean, var = _bn_batch_stats(h)
    inputs.append((mean, var))
    bn, run = params[f'BatchNorm_{i}']['bn'], stats[f'BatchNorm_{i}']['bn']
    h = _bn(h, bn['scale'], bn['bias'], *((mean, var) if train else (run['mean'], run['var'])))
    h = F.max_pool2d(F.relu(h), 2)
  h = h.permute(0, 2, 3, 1).reshape(h.shape[0], -1)
  return h @ params['Dense_0']['kernel'] + params['Dense_0']['bias'], inputs


def generator(params, z, img_hw=8):
  """FedHydra's (Bai et al., KDD 2025) §4.1.3 generator in PyTorch: Linear -> (2ngf, s, s) -> 3 x
  [BN (train), LeakyReLU(0.2), ConvTranspose2d] (k4 s2 p1, k4 s2 p1, k3 s1 p1) -> Sigmoid. flax's
  ConvTranspose kernel [kh, kw, in, out] is unflipped; PyTorch's [in, out, kh, kw] is flipped.
  Returns (images NHWC, per BN layer its batch (mean, biased var))."""
  s = img_hw // 4
  h = z @ params['fc']['kernel'] + params['fc']['bias']
  h = h.reshape(z.shape[0], s, s, -1).permute(0, 3, 1, 2)
  stats = []
  for i, (stride, pad) in enumerate(((2, 1), (2, 1), (1, 1))):
    bn = params[f'bn{i}']
    mean, var = _bn_batch_stats(h)
    stats.append((mean, var))
    h = F.leaky_relu(_bn(h, bn['scale'], bn['bias'], mean, var), 0.2)
    w = params[f'convt{i}']['kernel'].permute(2, 3, 0, 1).flip(2, 3)
    h = F.conv_transpose2d(h, w, params[f'convt{i}']['bias'], stride=stride, padding=pad)
  return torch.sigmoid(h).permute(0, 2, 3, 1), stats


def _leaves(tree):
  if isinstance(tree, dict):
    return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
  return [tree]


class Adam:
  """torch.optim.Adam(lr, betas, eps=1e-8) written out: m, v, bias corrections."""

  def __init__(self, tree, lr, b1=0.5, b2=0.999, eps=1e-8):
    self.params, self.lr, self.b1, self.b2, self.eps, self.t = _leaves(tree), lr, b1, b2, eps, 0
    self.m = [torch.zeros_like(p) for p in self.params]
    self.v = [torch.zeros_like(p) for p in self.params]

  def step(self, loss):
    grads = torch.autograd.grad(loss, self.params)
    self.t += 1
    with torch.no_grad():
      for p, g, m, v in zip(self.params, grads, self.m, self.v):
        m.mul_(self.b1).add_((1 - self.b1) * g)
        v.mul_(self.b2).add_((1 - self.b2) * g * g)
        m_hat, v_hat = m / (1 - self.b1**self.t), v / (1 - self.b2**self.t)
        p.sub_(self.lr * m_hat / (torch.sqrt(v_hat) + self.eps))


def ce(logits, labels):
  return -torch.log_softmax(logits, -1)[torch.arange(len(labels)), labels].mean()


def kl_rows(teacher_logits, student_logits):
  """Σ_c p_c (log p_c − log q_c) per sample, p = softmax(teacher), q = softmax(student)."""
  log_p = torch.log_softmax(teacher_logits, -1)
  return (log_p.exp() * (log_p - torch.log_softmax(student_logits, -1))).sum(-1)


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------


def oracle_ms(teachers, generator_module, ms_key):
  """Algorithm 2 and Eqs. 1-7: (losses [m, c, T], u [m, c], U, U_r, U_c [c, m])."""
  m = len(teachers)
  losses = np.zeros((m, NUM_CLASSES, MS_T_G))
  for k, (params, stats) in enumerate(teachers):
    for j in range(NUM_CLASSES):
      # a fresh generator and noise per (client, class): the run's key is an input
      g0, z = dense_generator_init(
        jax.random.fold_in(ms_key, k * NUM_CLASSES + j), generator_module, noise_batch=MS_BATCH
      )
      g, z = _tree(g0.params, True), _t(z)
      opt = Adam(g, MS_LR)
      target = torch.full((MS_BATCH,), j, dtype=torch.long)
      for t in range(MS_T_G):
        x, _ = generator(g, z)
        loss = ce(cnn_mnist(params, stats, x)[0], target)
        losses[k, j, t] = loss.item()  # Eq. 1: recorded before the step
        opt.step(loss)
  u = (losses.max(-1) - losses.min(-1)) / losses.min(-1)  # Eq. 2
  U = u.T  # Eq. 3: c × m
  U_r = U / U.sum(1, keepdims=True)  # Eqs. 4-5: Σ_k over clients of each class row = 1
  U_c = U / U.sum(0, keepdims=True)  # Eqs. 6-7: Σ_j over classes of each client column = 1
  return losses, u, U, U_r, U_c


def oracle_sa(per_client, U_r, U_c, labels):
  """Eqs. 8-11, written as the paper does: P̂_k = P_k ⊙ (1·U_c(:, k)ᵀ); V = U_r(y, :);
  P(i, :) = V(i, :) × [P̂_1(i, :); ...; P̂_m(i, :)]."""
  U_r, U_c = _t(U_r), _t(U_c)
  hats = [P_k * U_c[:, k][None, :] for k, P_k in enumerate(per_client)]  # Eq. 8
  V = U_r[labels]  # Eq. 10, b × m
  stacked = torch.stack(hats, 1)  # [b, m, c]: row i is Eq. 9's Pⁱ
  return torch.einsum('bm,bmc->bc', V, stacked)  # Eq. 11


def bn_loss(bn_inputs, stats):
  """Eq. 14's per-model term (DeepInversion's form): Σ_l ||μ_l(x) − μ_k,l||₂ +
  ||σ²_l(x) − σ²_k,l||₂ with the BN inputs' batch mean and biased variance."""
  total = 0.0
  for i, (mean, var) in enumerate(bn_inputs):
    run = stats[f'BatchNorm_{i}']['bn']
    total = total + torch.linalg.norm(run['var'] - var) + torch.linalg.norm(run['mean'] - mean)
  return total


def oracle_hasa_epoch(teachers, U_r, U_c, gen_params, z, y, student):
  """Algorithm 1, lines 12-23, for one epoch (every generator intermediate pooled)."""
  g = _tree(gen_params, True)
  z, y = _t(z), torch.as_tensor(np.array(y), dtype=torch.long)
  s_params, s_stats = _tree(student.params), _tree(student.batch_stats)
  opt = Adam(g, LR_G)
  pool, comps = [], []
  for _ in range(T_G):
    x, _ = generator(g, z)
    outs = [cnn_mnist(p, st, x) for p, st in teachers]
    P = oracle_sa([o[0] for o in outs], U_r, U_c, y)  # Eq. 12
    l_ce = ce(P, y)  # Eq. 13
    l_bn = sum(bn_loss(o[1], st) for o, (_, st) in zip(outs, teachers)) / len(teachers)  # Eq. 14
    s_logits, _ = cnn_mnist(s_params, s_stats, x)  # the global model, eval mode
    l_ad = -kl_rows(P / ADV_T, s_logits / ADV_T).mean()  # Eq. 15
    loss = l_ce + LAMBDA1 * l_bn + LAMBDA2 * l_ad  # Eq. 16
    pool.append(x.detach())
    comps.append([l_bn.item(), l_ce.item(), l_ad.item()])
    opt.step(loss)
  x_pool = torch.cat(pool)
  y_pool = y.repeat(T_G)
  # model distillation (Eqs. 17-19) on the pool, the student in train mode
  with torch.no_grad():
    P = oracle_sa([cnn_mnist(p, st, x_pool)[0] for p, st in teachers], U_r, U_c, y_pool)
  w = _tree(student.params, True)
  s_logits, s_inputs = cnn_mnist(w, s_stats, x_pool, train=True)
  kd = kl_rows(P / KD_T, s_logits / KD_T) + BETA * F.cross_entropy(
    s_logits, P.argmax(-1), reduction='none'
  )
  # Eq. 18's hard label is SA's, not the student's: they differ on some pooled images
  hard_label_differs = float((P.argmax(-1) != s_logits.argmax(-1)).double().mean())
  kd = kd.mean()
  grads = torch.autograd.grad(kd, _leaves(w))
  # SGD(momentum 0.9): the first step's buffer is the gradient itself, so w ← w − lr·g
  stepped = {id(p): (p - KD_LR * g).detach().numpy() for p, g in zip(_leaves(w), grads)}
  new_params = _map_leaves(w, lambda p: stepped[id(p)])
  new_stats = {}
  for i, (mean, var) in enumerate(s_inputs):
    run = s_stats[f'BatchNorm_{i}']['bn']
    # flax's running variance takes the biased batch variance (PyTorch's the unbiased one)
    new_stats[f'BatchNorm_{i}'] = {
      'bn': {
        'mean': ((1 - BN_MOMENTUM) * run['mean'] + BN_MOMENTUM * mean).detach().numpy(),
        'var': ((1 - BN_MOMENTUM) * run['var'] + BN_MOMENTUM * var).detach().numpy(),
      }
    }
  return {
    'pool_x': x_pool.numpy(),
    'pool_y': y_pool.numpy(),
    'components': np.asarray(comps),
    'kd_loss': kd.item(),
    'hard_label_differs': hard_label_differs,
    'student_params': new_params,
    'student_stats': new_stats,
    'generator_params': _map_leaves(g, lambda p: p.detach().numpy()),
  }


def _map_leaves(tree, fn):
  if isinstance(tree, dict):
    return {k: _map_leaves(v, fn) for k, v in tree.items()}
  return fn(tree)


def _assert_tree_close(got, want, rtol, atol, where=''):
  if isinstance(want, dict):
    assert set(got) == set(want), where
    for k in want:
      _assert_tree_close(got[k], want[k], rtol, atol, f'{where}/{k}')
    return
  np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=atol, err_msg=where)


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------


def _teachers(aux):
  """The uploaded client models (the oracle's input), in global client order."""
  local = aux.round_cache[1].local
  (group,) = local.groups
  models = local.models[0]
  order = np.argsort(group.client_ids)
  return [
    (_tree(_take(models.params, i)), _tree(_take(models.batch_stats, i))) for i in order
  ], group.client_ids


def test_model_stratification_matches_equations_1_to_7(hydra_run):
  ctx, aux, _, _, _ = hydra_run
  teachers, ids = _teachers(aux)
  np.testing.assert_array_equal(ids, np.arange(3))
  gen = make_generator(ctx.dataset.input_shape, NZ, NGF, 'fedhydra')
  ms_key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.MODEL_STRATIFICATION)
  losses, u, U, U_r, U_c = oracle_ms(teachers, gen, ms_key)
  ms = aux.round_cache[1].data.ms
  np.testing.assert_allclose(ms.losses, losses, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ms.u, u, rtol=2e-3, atol=1e-5)
  np.testing.assert_allclose(ms.U, U, rtol=2e-3, atol=1e-5)
  np.testing.assert_allclose(ms.U_r, U_r, rtol=2e-3, atol=1e-5)
  np.testing.assert_allclose(ms.U_c, U_c, rtol=2e-3, atol=1e-5)
  assert ms.seconds.dtype == np.float32 and 0 < ms.seconds < 600  # the summary's ms_seconds
  # what the workdir keeps of it (model_stratification.npz; the heatmap of Fig. 5b)
  saved = np.load(ctx.output_path('model_stratification.npz'))
  np.testing.assert_array_equal(saved['teacher_client_ids'], np.arange(3))
  assert str(saved['impl']) == 'batched' and saved['seconds'] == ms.seconds
  for name, want in zip(('losses', 'u', 'U', 'U_r', 'U_c'), (losses, u, U, U_r, U_c)):
    for key in (name, f'{name}_by_client'):  # teachers 0, 1, 2 are clients 0, 1, 2
      np.testing.assert_allclose(saved[key], want, rtol=2e-3, atol=1e-5, err_msg=key)
  assert ctx.output_path('ms_heatmap.png').stat().st_size > 0
  # the problem is not degenerate: every row and column of U differs from uniform
  assert np.ptp(U_r, axis=1).min() > 0.02 and np.ptp(U_c, axis=0).min() > 0.02
  # SA uses the paper's Ū_r and Ū_c as they are (sa_in_model_scale='paper')
  sa = aux.round_cache[1].data.sa
  np.testing.assert_allclose(sa.U_r, U_r, rtol=2e-3, atol=1e-5)
  np.testing.assert_allclose(sa.U_c, U_c, rtol=2e-3, atol=1e-5)


def test_one_hasa_epoch_matches_equations_12_to_19(hydra_run):
  ctx, aux, state0, state1, record = hydra_run
  teachers, _ = _teachers(aux)
  ms = aux.round_cache[1].data.ms
  U_r, U_c = np.asarray(ms.U_r, np.float64), np.asarray(ms.U_c, np.float64)
  # jfed's draws for epoch 0 (inputs): Algorithm 1 line 10's generator, line 12's z and y
  key = jax.random.fold_in(ctx.derive_key(Purpose.SERVER, 1, 0), 0)
  z = jax.random.normal(key, (BATCH, NZ), jnp.float32)
  y = jax.random.randint(jax.random.fold_in(key, 1), (BATCH,), 0, NUM_CLASSES, jnp.int32)
  assert len(set(np.asarray(y).tolist())) > 1
  want = oracle_hasa_epoch(teachers, U_r, U_c, state0.generator.params, z, y, state0.student.model)
  n = T_G * BATCH
  assert int(state1.pool.count) == n
  np.testing.assert_array_equal(np.asarray(state1.pool.labels[:n]), want['pool_y'])
  np.testing.assert_allclose(np.asarray(state1.pool.images[:n]), want['pool_x'], atol=2e-5)
  np.testing.assert_allclose(
    [record['gen_bn'], record['gen_oh'], record['gen_adv']],
    want['components'][-1],
    rtol=1e-4,
    atol=1e-5,
  )
  # A bias followed by a train-mode BatchNorm has zero gradient (the batch mean removes it);
  # Adam turns float32 round-off there into steps of size lr, so those biases (which change no
  # image) are left out; every other generator parameter is compared.
  got_g = jax.tree.map(np.asarray, state1.generator.params)
  want_g = want['generator_params']
  for name in ('fc', 'convt0', 'convt1'):
    del got_g[name]['bias'], want_g[name]['bias']
  _assert_tree_close(got_g, want_g, 1e-4, 1e-5, 'generator')
  assert want['hard_label_differs'] > 0
  np.testing.assert_allclose(record['kd_loss'], want['kd_loss'], rtol=1e-4)
  _assert_tree_close(
    state1.student.model.params, want['student_params'], 1e-4, 1e-5, 'student params'
  )
  _assert_tree_close(
    state1.student.model.batch_stats, want['student_stats'], 1e-4, 1e-5, 'student BN'
  )
  # the step moved the student and the generator by more than the tolerance
  moved = max(
    float(np.abs(np.asarray(a) - np.asarray(b)).max())
    for a, b in zip(
      jax.tree.leaves(state1.student.model.params), jax.tree.leaves(state0.student.model.params)
    )
  )
  assert moved > 1e-3


def test_the_ae_ablation_reaches_synthesis_and_distillation():
  """Fig. 7's AE ablation: the mean of the teachers' logits, not SA, guides the generator and
  teaches the student."""
  config = _config()
  config.fedhydra.aggregation = 'ae'
  ctx = driver.make_context(config, *_dataset_and_parts())
  algo = driver.build_algorithm('fedhydra', config)
  settings = fedhydra.settings(algo.config, ctx)
  assert settings.synthesis.aggregation == 'mean'
  assert settings.kd.aggregation == 'mean'
  # and no model stratification: nothing would read its weights (no uploads are needed)
  assert fedhydra.stratify(algo.config, ctx, None, 1, None, None) is None
  # a round without MS hands synthesis and the KD targets no weights: the plain mean
  round_data = oneshot.RoundData(None, [], None)
  assert fedhydra.synthesis_weights(None, round_data) is None
  assert fedhydra.kd_weights(None, round_data) is None
