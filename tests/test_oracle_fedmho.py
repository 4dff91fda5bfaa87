"""Oracle tests of FedMHO, FedMHO-MD, FedMHO-SD, FedCVAE-Ens and FedCVAE-KD: the server stage
from the clients' models, recomputed independently and compared with jfed's.

FedMHO: "FedMHO: Heterogeneous One-Shot Federated Learning Towards Resource-Constrained Edge
Devices", Yao et al., WWW'26; reference YXShi2000/FedMHO (pcode/aggregation/semi_supervised.py,
pcode/utils/data_clean.py). FedCVAE: "Data-Free One-Shot Federated Learning Under Very High
Statistical Heterogeneity", Heinbaugh, Luz-Ricca, Shao, ICLR'23; reference ceh-2000/fed_cvae
(servers/server_fed_cvae_ens.py, servers/server_fed_cvae_kd.py).

Each test runs the registered Algorithm's setup / init / step on a tiny digits problem (MLP
classifier clients, CVAE-small clients, one local epoch, one server epoch) and recomputes from
the *inputs* — the trained client models, the partition, and the random draws jfed made (latents,
labels, data order, derived from jfed's documented keys) — what the server must produce:

- FedMHO: Eq. 4's initial model (the uniform mean of the classifier clients), the per-class and
  per-decoder sample counts (int(N/C) per class split by n_kc^2 / sum_k n_kc^2 over the CVAE
  clients' label histograms), the decoded images (a NumPy forward of each client's decoder), the
  K-means filter (sklearn KMeans with one cluster per class, as the reference's data_clean, and
  the int(0.8 n_c) samples nearest to the centre), the teachers' logits (MD: the mean of the
  classifier clients' logits; SD: the initial model's; FedMHO: none) and one epoch of the global
  model with Adam on CE + KLDivLoss() (the reference's loss, in PyTorch).
- FedCVAE-Ens: the samples per decoder (int(n_k / N * N_syn), the last client the remainder),
  labels drawn from each client's label pmf, the decoded images, and one classifier epoch.
- FedCVAE-KD: the decoder targets, one epoch of the server decoder's distillation (summed BCE / B,
  Adam), the classifier set decoded by the distilled decoder and one classifier epoch.

Nothing here calls the jfed function under test: forward passes are NumPy (tests/oracle_numpy.py),
training is PyTorch (CPU, float64), mirroring the references' order of operations.
"""

from typing import Dict, List, Sequence

import jax
import numpy as np
import pytest
from sklearn.cluster import KMeans

from jfed import driver, engine
from jfed.configs import fedmho_digits
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import get_method
from tests import oracle_numpy as onp
from tests.support import shared_fixture_scope

# The oracles mirror the PyTorch reference code in float64 PyTorch: skipped where it is absent
# (the README's install; CI installs it).
torch = pytest.importorskip('torch')

FLOAT32 = {'rtol': 1e-4, 'atol': 1e-5}
# torch warns that KLDivLoss's 'mean' will change; the reference runs it, so the oracle does too
pytestmark = pytest.mark.filterwarnings('ignore::UserWarning:torch.nn.modules.loss')
NUM_CLASSES = 10
FEDMHO_CLIENTS = 'mlp;cvae:size=small;mlp;cvae:size=small;mlp;cvae:size=small,hidden=32'


# ---------------------------------------------------------------------------------------------
# helpers: configs, the specs per client, PyTorch training of an MLP
# ---------------------------------------------------------------------------------------------


def _tiny_config(client_models: str, num_clients: int):
  c = fedmho_digits.get_config('smoke')
  c.partition.update({'scheme': 'dirichlet', 'num_clients': num_clients, 'alpha': 0.5})
  c.model = 'mlp'
  c.client_models = client_models
  c.batch_size = 32
  c.eval_batch_size = 512
  return c


def _spec_of_client(config, k: int) -> str:
  specs = config.client_models.split(';')
  return specs[k % len(specs)]


def _client_ids(config, num_clients: int, cvae: bool) -> List[int]:
  """The CVAE clients (cvae=True) or the classifier clients, from the config's specs."""
  return [k for k in range(num_clients) if _spec_of_client(config, k).startswith('cvae') == cvae]


def _class_counts(ctx, ids: Sequence[int]) -> np.ndarray:
  """[clients, classes] label histograms of the clients' training samples, from the partition."""
  y = np.asarray(ctx.dataset.train_y)
  return np.stack([np.bincount(y[ctx.parts[k]], minlength=NUM_CLASSES) for k in ids])


def _generation_key(ctx):
  """jfed's documented draw of a one-shot round's synthetic set (an input of the oracles)."""
  return jax.random.fold_in(
    jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(ctx.key, int(Purpose.SERVER)), 0), 1),
    int(ServerRoundPurpose.GENERATION),
  )


def _decode(decoder: Dict, z: np.ndarray, labels: np.ndarray, shape=(8, 8, 1)) -> np.ndarray:
  """CVAE-small's decoder in NumPy: sigmoid(Dense(ReLU(Dense([z, onehot(y)]))))."""
  h = np.concatenate([np.asarray(z, np.float64), np.eye(NUM_CLASSES)[np.asarray(labels)]], 1)
  logits = onp.mlp_forward(onp.to_numpy(decoder), h)
  return (1.0 / (1.0 + np.exp(-logits))).reshape((len(h), *shape))


def _torch_mlp(params: Dict) -> List[torch.nn.Linear]:
  """torch.nn.Linear layers holding a jfed 'mlp' / CVAE-small decoder's Dense layers (float64)."""
  names = sorted(params, key=lambda k: int(k.split('_')[1]))
  layers = []
  for name in names:
    kernel = np.asarray(params[name]['kernel'], np.float64)
    layer = torch.nn.Linear(*kernel.shape).double()
    with torch.no_grad():
      layer.weight.copy_(torch.from_numpy(kernel.T.copy()))
      layer.bias.copy_(torch.from_numpy(np.asarray(params[name]['bias'], np.float64)))
    layers.append(layer)
  return layers


def _torch_forward(layers, x: torch.Tensor) -> torch.Tensor:
  h = x.reshape(len(x), -1)
  for layer in layers[:-1]:
    h = torch.relu(layer(h))
  return layers[-1](h)


def _torch_params(layers) -> Dict:
  return {
    f'Dense_{i}': {'kernel': l.weight.detach().numpy().T, 'bias': l.bias.detach().numpy()}
    for i, l in enumerate(layers)
  }


def _epoch_order(seed_path, n: int, batch: int) -> List[np.ndarray]:
  """The shuffled batches jfed visits (np.random.default_rng(seed_path).permutation): an input."""
  order = np.random.default_rng(seed_path).permutation(n)
  return [order[s : s + batch] for s in range(0, n, batch)]


def _train_classifier_torch(
  params, x, y, batches, lr, teacher_logits=None, loss_scale=1.0, losses=None
):
  """One epoch of the global model as the FedMHO reference trains it: Adam, per batch
  CE(f(x), y) [+ KLDivLoss()(log_softmax(f(x)), softmax(teacher))], in float64; each batch's
  scaled loss is appended to `losses` when given."""
  layers = _torch_mlp(params)
  opt = torch.optim.Adam([p for l in layers for p in l.parameters()], lr=lr)
  xt, yt = torch.from_numpy(np.asarray(x, np.float64)), torch.from_numpy(np.asarray(y, np.int64))
  kl = torch.nn.KLDivLoss()  # the reference's: default reduction 'mean', / (B·C)
  for idx in batches:
    idx = torch.from_numpy(idx)
    pred = _torch_forward(layers, xt[idx])
    loss = torch.nn.functional.cross_entropy(pred, yt[idx])
    if teacher_logits is not None:
      t = torch.from_numpy(np.asarray(teacher_logits, np.float64))[idx]
      loss = loss + kl(torch.log_softmax(pred, 1), torch.softmax(t, 1))
    opt.zero_grad()
    (loss_scale * loss).backward()
    if losses is not None:
      losses.append(loss_scale * float(loss.detach()))
    opt.step()
  return _torch_params(layers)


def _assert_trees_close(got, want, **tol):
  got, want = onp.to_numpy(got), onp.to_numpy(want)
  assert sorted(got) == sorted(want)
  for a, b in zip(onp.tree_leaves(got), onp.tree_leaves(want)):
    np.testing.assert_allclose(a, b, **(tol or FLOAT32))


def _run_setup(method: str, config, workdir=None):
  ctx = driver.context_of_config(config, workdir=workdir)
  algorithm = get_method(method).from_config(config)
  aux = algorithm.setup(ctx)
  return ctx, algorithm, aux


# ---------------------------------------------------------------------------------------------
# FedMHO, FedMHO-MD, FedMHO-SD
# ---------------------------------------------------------------------------------------------


def _fedmho_config():
  c = _tiny_config(FEDMHO_CLIENTS, 6)
  c.fedmho.update(
    {
      'local_epochs': 1,
      'cvae_epochs': 1,
      'cvae_lr': 1e-3,
      'cvae_batch': 32,
      'num_synthetic': 200,
      'clean_rate': 0.8,
      'epochs': 1,
      'lr': 1e-3,
      'batch': 32,
    }
  )
  return c


def fedmho_counts(histograms: np.ndarray, total: int) -> np.ndarray:
  """[decoders, classes]: the reference's get_synthesis_data_list, per class p and decoder k,
  int(n_kp^2 / sum_k' n_k'p^2 * int(N / C)) (uniform when no decoder holds p)."""
  per_class = int(total / NUM_CLASSES)
  out = np.zeros(histograms.shape, np.int64)
  for p in range(NUM_CLASSES):
    w = [float(n) ** 2 for n in histograms[:, p]]
    w = [1.0 / len(w)] * len(w) if sum(w) == 0 else [v / sum(w) for v in w]
    out[:, p] = [int(v * per_class) for v in w]
  return out


def kept_nearest(images: np.ndarray, labels: np.ndarray, rate: float) -> np.ndarray:
  """The reference's data_clean per class: KMeans(n_clusters=1, random_state=0) on the flat
  pixels, the int(rate · n_c) samples nearest (L2) to the centre (topk(largest=False))."""
  kept = []
  for c in np.unique(labels):
    members = np.flatnonzero(labels == c)
    features = images[members].reshape(len(members), -1).astype(np.float64)
    centre = KMeans(n_clusters=1, random_state=0, n_init=1).fit(features).cluster_centers_
    distance = np.linalg.norm(features - centre, axis=1)
    kept.append(members[np.argsort(distance, kind='stable')[: int(rate * len(members))]])
  return np.sort(np.concatenate(kept))


def _fedmho_oracle_synthetic(ctx, config, aux, total):
  """The synthetic set of `total` samples from the CVAE clients' decoders, in jfed's order
  (decoder group by group, client by client, class by class): (images, labels, owners)."""
  cvae_ids = _client_ids(config, ctx.num_clients, cvae=True)
  counts = fedmho_counts(_class_counts(ctx, cvae_ids), total)
  count_of = dict(zip(cvae_ids, counts))
  decoder_of = {}
  for g, m in zip(aux.cvaes.groups, aux.cvaes.models):  # the clients' trained CVAEs: inputs
    for i, k in enumerate(g.client_ids):
      decoder_of[int(k)] = jax.tree.map(lambda a, i=i: np.asarray(a[i]), m.params['decoder'])
  key = _generation_key(ctx)
  images, labels, owners = [], [], []
  specs = list(dict.fromkeys(_spec_of_client(config, k) for k in cvae_ids))
  for spec in specs:  # jfed decodes group by group, in order of first appearance
    ids = [k for k in cvae_ids if _spec_of_client(config, k) == spec]
    n_max = max(1, max(int(count_of[k].sum()) for k in ids))
    latent = 2  # CVAE-small's default latent size (the reference's --latent_size default)
    for k in ids:
      y = np.repeat(np.arange(NUM_CLASSES), count_of[k])
      z = np.asarray(jax.random.normal(jax.random.fold_in(key, k), (n_max, latent)))[: len(y)]
      images.append(_decode(decoder_of[k], z, y))
      labels.append(y)
      owners.append(np.full(len(y), k))
  return np.concatenate(images), np.concatenate(labels), np.concatenate(owners)


@pytest.fixture(scope=shared_fixture_scope)
def fedmho_runs(tmp_path_factory):
  """setup, init and one step of each variant on the same clients (trained identically);
  FedMHO-MD's in a workdir (where the synthetic set is saved), the others' in memory."""
  config = _fedmho_config()
  out = {}
  for method in ('fedmho', 'fedmho_md', 'fedmho_sd'):
    workdir = tmp_path_factory.mktemp(method) if method == 'fedmho_md' else None
    ctx, algorithm, aux = _run_setup(method, config, workdir)
    state, records = algorithm.step(ctx, aux, algorithm.init(ctx, aux), 0)
    out[method] = (ctx, aux, state, records)
  return config, out


@pytest.mark.parametrize('method', ['fedmho', 'fedmho_md', 'fedmho_sd'])
def test_fedmho_server_stage_matches_the_reference_recomputed(fedmho_runs, method):
  config, runs = fedmho_runs
  ctx, aux, state, records = runs[method]
  classifier_ids = _client_ids(config, ctx.num_clients, cvae=False)
  group = aux.local.groups[0]
  assert [int(k) for k in group.client_ids] == classifier_ids
  clients = [onp.take_client(aux.local.models[0].params, i) for i in range(len(classifier_ids))]

  # Eq. 4: the initial global model is the uniform mean of every classifier client
  initial = onp.weighted_average(clients, np.ones(len(clients)))
  _assert_trees_close(aux.initial.params, initial)

  # generation: per-class counts split over the decoders by n^2, decoded from each decoder
  images, labels, owners = _fedmho_oracle_synthetic(ctx, config, aux, config.fedmho.num_synthetic)
  np.testing.assert_array_equal(aux.synthetic.labels, labels)
  np.testing.assert_array_equal(aux.synthetic.owners, owners)
  np.testing.assert_allclose(aux.synthetic.images, images, **FLOAT32)

  # Algorithm 2: per class, the int(0.8 n_c) samples nearest to the K-means centre
  kept = kept_nearest(images, labels, config.fedmho.clean_rate)
  np.testing.assert_array_equal(aux.synthetic.kept, kept)
  x, y = images[kept], labels[kept]
  saved = ctx.workdir / 'synthetic.npz' if ctx.workdir else None
  assert (saved is not None) == (method == 'fedmho_md')
  if saved:  # the whole generated set in 1/255 steps, for experiments.generator_check
    with np.load(saved) as f:
      assert f['images'].dtype == np.uint8 and f['labels'].dtype == np.int32
      assert np.abs(f['images'].astype(int) - np.round(images * 255)).max() <= 1
      np.testing.assert_array_equal(f['labels'], labels)
      np.testing.assert_array_equal(f['kept'], kept)

  # the teachers (Eq. 5 MD: the classifier clients' mean logits; Eq. 6 SD: the initial model)
  teacher = {
    'fedmho': None,
    'fedmho_md': np.mean([onp.mlp_forward(p, x) for p in clients], axis=0),
    'fedmho_sd': onp.mlp_forward(initial, x),
  }[method]
  if teacher is None:
    assert aux.data.teacher is None
  else:
    np.testing.assert_allclose(np.asarray(aux.data.teacher), teacher, **FLOAT32)

  # one global epoch: Adam on CE + KLDivLoss() (the reference's sum, weight 1 each), from Eq. 4.
  # jfed's λ·CE + (1 − λ)·KL at λ = 0.5 is half of it: the same Adam steps (up to its epsilon).
  batches = _epoch_order((int(config.seed), 1, 0), len(y), config.fedmho.batch)
  losses = []
  want = _train_classifier_torch(
    initial,
    x,
    y,
    batches,
    config.fedmho.lr,
    teacher,
    loss_scale=1.0 if teacher is None else config.fedmho.lam,
    losses=losses,
  )
  _assert_trees_close(state.model.params, want, rtol=1e-4, atol=2e-5)
  (record,) = records
  assert sorted(record) == ['epoch', 'fusion_loss', 'test_accuracy']
  assert record['epoch'] == 1
  np.testing.assert_allclose(record['fusion_loss'], np.mean(losses), rtol=1e-4)
  test_x, test_y = np.asarray(ctx.dataset.test_x), np.asarray(ctx.dataset.test_y)
  accuracy = onp.accuracy(onp.mlp_forward(onp.to_numpy(want), test_x), test_y)
  assert record['test_accuracy'] == pytest.approx(accuracy, abs=1.5 / len(test_y))


def test_fedmho_md_and_sd_teachers_differ_and_fedmho_has_none(fedmho_runs):
  """A guard on the oracle itself: the three variants' targets are different problems."""
  _, runs = fedmho_runs
  md, sd = (np.asarray(runs[m][1].data.teacher) for m in ('fedmho_md', 'fedmho_sd'))
  assert np.abs(md - sd).max() > 1e-2
  assert runs['fedmho'][1].data.teacher is None


@pytest.mark.parametrize('method', ['fedmho', 'fedmho_sd'])
def test_fedmho_records_and_summary_report_what_the_server_built(
  fedmho_runs, method, tmp_path, monkeypatch
):
  """The setup record and the summary, field by field, against values recomputed from the
  clients' models and the synthetic set; the sample grid is drawn from the generated set and
  the filter's choice when the run has a workdir."""
  from jfed.cvae import plots as cvae_plots  # pylint: disable=g-import-not-at-top

  config, runs = fedmho_runs
  ctx, aux, state, _ = runs[method]
  algorithm = get_method(method).from_config(config)
  test_x, test_y = np.asarray(ctx.dataset.test_x), np.asarray(ctx.dataset.test_y)
  classifier_ids = _client_ids(config, ctx.num_clients, cvae=False)
  clients = [onp.take_client(aux.local.models[0].params, i) for i in range(len(classifier_ids))]
  initial = onp.weighted_average(clients, np.ones(len(clients)))
  initial_accuracy = onp.accuracy(onp.mlp_forward(initial, test_x), test_y)
  client_accuracy = [onp.accuracy(onp.mlp_forward(p, test_x), test_y) for p in clients]
  kept_labels = aux.synthetic.labels[aux.synthetic.kept]
  cvae_counts = _class_counts(ctx, _client_ids(config, ctx.num_clients, cvae=True))
  generated = int(fedmho_counts(cvae_counts, config.fedmho.num_synthetic).sum())
  classifier_bytes, decoder_bytes = aux.local.upload_bytes, aux.cvaes.upload_bytes
  assert 0 < decoder_bytes < classifier_bytes  # three MLPs against three small decoders

  (record,) = algorithm.setup_records(ctx, aux)
  assert record == {
    'round': 1,
    'clients': 6,
    'upload_bytes': classifier_bytes + decoder_bytes,
    'classifier_upload_bytes': classifier_bytes,
    'decoder_upload_bytes': decoder_bytes,
    'initial_test_accuracy': pytest.approx(initial_accuracy, abs=1.5 / len(test_y)),
    'synthetic_generated': generated,
    'synthetic_kept': len(kept_labels),
  }
  assert record['synthetic_kept'] < record['synthetic_generated']

  drawn = []
  monkeypatch.setattr(cvae_plots, 'plot_filter_grid', lambda *args: drawn.append(args))
  summary = algorithm.summarize(ctx, aux, state, [])  # no workdir: no figure
  assert not drawn
  with_workdir = driver.context_of_config(config, workdir=tmp_path)
  assert algorithm.summarize(with_workdir, aux, state, []) == summary
  ((path, images, labels, kept, classes),) = drawn
  assert path == tmp_path / 'synthetic_samples.png' and classes == NUM_CLASSES
  assert images is aux.synthetic.images and labels is aux.synthetic.labels
  assert kept is aux.synthetic.kept
  assert summary == {
    'teacher': {'fedmho': 'none', 'fedmho_sd': 'initial'}[method],
    'initial_test_accuracy': record['initial_test_accuracy'],
    'global_model': 'mlp',
    'client_models': [_spec_of_client(config, k) for k in range(ctx.num_clients)],
    'classifier_client_test_accuracy': {
      k: pytest.approx(a, abs=1.5 / len(test_y)) for k, a in zip(classifier_ids, client_accuracy)
    },
    'synthetic_generated': generated,
    'synthetic_kept': len(kept_labels),
    'synthetic_kept_per_class': [int(np.sum(kept_labels == c)) for c in range(NUM_CLASSES)],
    'classifier_upload_bytes': classifier_bytes,
    'decoder_upload_bytes': decoder_bytes,
    'excluded_cvae_clients': [],
    'clean_rate': 0.8,
  }
  # a class the filter kept nothing of still has its count: 0
  without_9 = aux.synthetic.kept[aux.synthetic.labels[aux.synthetic.kept] != 9]
  aux_9 = aux._replace(synthetic=aux.synthetic._replace(kept=without_9))
  per_class = algorithm.summarize(ctx, aux_9, state, [])['synthetic_kept_per_class']
  assert per_class == summary['synthetic_kept_per_class'][:9] + [0]


# ---------------------------------------------------------------------------------------------
# FedCVAE-Ens and FedCVAE-KD
# ---------------------------------------------------------------------------------------------

FEDCVAE_CLIENTS = 'cvae:size=small;cvae:size=small,hidden=32'


def _fedcvae_config():
  c = _tiny_config(FEDCVAE_CLIENTS, 5)
  c.fedcvae.update(
    {
      'protocol': 'fed_cvae',
      'cvae_epochs': 1,
      'cvae_lr': 1e-3,
      'cvae_batch': 32,
      'num_synthetic': 150,
      'z_bound': 3.0,
      'weight_by_share': True,
      'server_model': 'mlp',
      'epochs': 1,
      'lr': 1e-3,
      'batch': 32,
      'server_decoder': 'cvae:size=small',
      'decoder_samples': 120,
      'decoder_epochs': 1,
      'decoder_lr': 1e-2,
      'decoder_batch': 32,
    }
  )
  return c


def fedcvae_counts(sizes: np.ndarray, total: int) -> np.ndarray:
  """generate_dataset_from_user_decoders: user u decodes int(n_u / N · total); the last user (in
  user order) the remainder."""
  counts = [int(n / sizes.sum() * total) for n in sizes]
  counts[-1] = total - sum(counts[:-1])
  return np.asarray(counts)


def _fedcvae_oracle_synthetic(ctx, config, decoders, total, tag):
  """FedCVAE's draw from the users' decoders, with jfed's keys (inputs): per user k, labels from
  Categorical(pmf_k) and z from N(0, I) truncated to ±z_bound, decoded; in jfed's order (decoder
  group by group). Returns (images, labels, z)."""
  ids = list(range(ctx.num_clients))
  histograms = _class_counts(ctx, ids)
  counts = dict(zip(ids, fedcvae_counts(histograms.sum(1), total)))
  key = _generation_key(ctx)
  key = jax.random.fold_in(key, tag) if tag else key
  bound = config.fedcvae.z_bound
  images, labels, latents = [], [], []
  specs = list(dict.fromkeys(_spec_of_client(config, k) for k in ids))
  for spec in specs:
    group = [k for k in ids if _spec_of_client(config, k) == spec]
    n_max = max(1, max(int(counts[k]) for k in group))
    for k in group:
      pmf = histograms[k] / histograms[k].sum()
      with np.errstate(divide='ignore'):
        log_pmf = np.log(pmf).astype(np.float32)
      y = jax.random.categorical(jax.random.fold_in(key, 2 * k), log_pmf, shape=(n_max,))
      z = jax.random.truncated_normal(jax.random.fold_in(key, 2 * k + 1), -bound, bound, (n_max, 2))
      y, z = np.asarray(y)[: counts[k]], np.asarray(z)[: counts[k]]
      images.append(_decode(decoders[k], z, y))
      labels.append(y)
      latents.append(z)
  return np.concatenate(images), np.concatenate(labels), np.concatenate(latents)


def _user_decoders(aux) -> Dict[int, Dict]:
  out = {}
  for g, m in zip(aux.cvaes.groups, aux.cvaes.models):
    for i, k in enumerate(g.client_ids):
      out[int(k)] = jax.tree.map(lambda a, i=i: np.asarray(a[i]), m.params['decoder'])
  return out


def test_fedcvae_ens_server_matches_the_reference_recomputed():
  config = _fedcvae_config()
  ctx, algorithm, aux = _run_setup('fedcvae_ens', config)
  state, _ = algorithm.step(ctx, aux, algorithm.init(ctx, aux), 0)
  images, labels, _ = _fedcvae_oracle_synthetic(
    ctx, config, _user_decoders(aux), config.fedcvae.num_synthetic, 0
  )
  np.testing.assert_array_equal(aux.labels, labels)
  np.testing.assert_allclose(aux.images, images, **FLOAT32)
  # the classifier from its random init (an input), one epoch of Adam on the CE
  batches = _epoch_order((int(config.seed), 1, 0), len(labels), config.fedcvae.batch)
  want = _train_classifier_torch(aux.init.params, images, labels, batches, config.fedcvae.lr)
  _assert_trees_close(state.model.params, want, rtol=1e-4, atol=2e-5)


def test_fedcvae_ens_under_fedmhos_protocol_is_fedmhos_server_without_a_teacher():
  """fedcvae.protocol='fedmho' (the FEDCVAE row of FedMHO's tables): FedMHO's per-class counts
  over the decoders, Algorithm 2's filter, then CE from the random server model."""
  config = _fedcvae_config()
  config.fedcvae.update({'protocol': 'fedmho', 'clean_rate': 0.8, 'num_synthetic': 200})
  ctx, algorithm, aux = _run_setup('fedcvae_ens', config)
  state, _ = algorithm.step(ctx, aux, algorithm.init(ctx, aux), 0)
  images, labels, _ = _fedmho_oracle_synthetic(ctx, config, aux, config.fedcvae.num_synthetic)
  assert aux.generated == len(labels)
  kept = kept_nearest(images, labels, config.fedcvae.clean_rate)
  np.testing.assert_array_equal(aux.labels, labels[kept])
  np.testing.assert_allclose(aux.images, images[kept], **FLOAT32)
  batches = _epoch_order((int(config.seed), 1, 0), len(kept), config.fedcvae.batch)
  want = _train_classifier_torch(
    aux.init.params, images[kept], labels[kept], batches, config.fedcvae.lr
  )
  _assert_trees_close(state.model.params, want, rtol=1e-4, atol=2e-5)


def _distil_decoder_torch(params, z, y, x, batches, lr):
  """server_fed_cvae_kd's distillation: the server decoder reconstructs the users' decoded
  images from the same (z, y): BCEWithLogits(sum) / B, Adam."""
  layers = _torch_mlp(params)
  opt = torch.optim.Adam([p for l in layers for p in l.parameters()], lr=lr)
  onehot = np.eye(NUM_CLASSES)[np.asarray(y)]
  inputs = torch.from_numpy(np.concatenate([np.asarray(z, np.float64), onehot], 1))
  targets = torch.from_numpy(np.asarray(x, np.float64).reshape(len(x), -1))
  for idx in batches:
    idx = torch.from_numpy(idx)
    logits = _torch_forward(layers, inputs[idx])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
      logits, targets[idx], reduction='sum'
    ) / len(idx)
    opt.zero_grad()
    loss.backward()
    opt.step()
  return _torch_params(layers)


def test_fedcvae_kd_server_matches_the_reference_recomputed():
  config = _fedcvae_config()
  c = config.fedcvae
  ctx, algorithm, aux = _run_setup('fedcvae_kd', config)
  # the decoder targets: the users' decoders on FedCVAE's draw (its own tag)
  x, y, z = _fedcvae_oracle_synthetic(ctx, config, _user_decoders(aux), c.decoder_samples, 1)
  np.testing.assert_array_equal(np.asarray(aux.targets.y), y)
  np.testing.assert_allclose(np.asarray(aux.targets.z), z, **FLOAT32)
  np.testing.assert_allclose(np.asarray(aux.targets.x), x, **FLOAT32)

  state = algorithm.init(ctx, aux)
  state, _ = algorithm.step(ctx, aux, state, 0)  # the server decoder's epoch
  batches = _epoch_order((int(config.seed), 2, 0), len(y), c.decoder_batch)
  decoder = _distil_decoder_torch(aux.decoder_init.params, z, y, x, batches, c.decoder_lr)
  # Adam divides each step by sqrt(v): float32 rounding in a near-zero gradient moves a weight's
  # step by up to ~1% of the learning rate (1e-2 here), hence atol 1e-4.
  _assert_trees_close(state.decoder.model.params, decoder, rtol=1e-4, atol=1e-2 * c.decoder_lr)

  state, _ = algorithm.step(ctx, aux, state, c.decoder_epochs)  # the classifier's epoch
  # the classifier set: the distilled decoder on y uniform, z truncated normal (jfed's keys)
  k_y, k_z = jax.random.split(jax.random.fold_in(_generation_key(ctx), 2))
  labels = np.asarray(jax.random.randint(k_y, (c.num_synthetic,), 0, NUM_CLASSES))
  latents = np.asarray(
    jax.random.truncated_normal(k_z, -c.z_bound, c.z_bound, (c.num_synthetic, 2))
  )
  images = _decode(state.decoder.model.params, latents, labels)
  got_images, got_labels = aux.classifier_data
  np.testing.assert_array_equal(got_labels, labels)
  np.testing.assert_allclose(got_images, images, **FLOAT32)
  batches = _epoch_order((int(config.seed), 1, 0), len(labels), c.batch)
  want = _train_classifier_torch(aux.classifier_init.params, images, labels, batches, c.lr)
  _assert_trees_close(state.classifier.model.params, want, rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# FedMHO's one-shot FedAvg baseline: the prototype vote with the reference's small CNN
# ---------------------------------------------------------------------------------------------


def test_fedavg_vote_averages_vgg_logits_with_the_small_cnns_softmax_as_the_reference():
  """FedMHO's federated_average_ensemble: per architecture the uniform mean of its clients, then
  the argmax of the mean of the prototypes' *outputs*; the reference's CNN_MNIST outputs softmax
  probabilities (the other prototype, here an MLP for the VGG-9, logits)."""
  config = fedmho_digits.get_config('baselines,smoke')
  ctx = driver.context_of_config(config)
  algorithm = get_method('fedavg_vote').from_config(config)
  local = algorithm.setup(ctx)
  prototypes, (record,) = algorithm.step(ctx, local, algorithm.init(ctx, local), 0)
  specs = [g.spec for g in local.groups]
  assert specs == ['mlp', 'fedmho_cnn']
  outputs = []
  for g, m, got in zip(local.groups, local.models, prototypes):
    clients = [onp.take_client(m.params, i) for i in range(len(g.client_ids))]
    prototype = onp.weighted_average(clients, np.ones(len(clients)))
    _assert_trees_close(got.params, prototype)
    if g.spec == 'mlp':
      outputs.append(onp.mlp_forward(prototype, ctx.dataset.test_x))
    else:
      outputs.append(onp.fedmho_cnn_forward(prototype, ctx.dataset.test_x, softmax_output=True))
    # what the vote averages: the prototype's outputs (the CNN's probabilities)
    got_outputs = engine.Evaluator(g.module).logits(got, ctx.dataset.test_x)
    np.testing.assert_allclose(got_outputs, outputs[-1], **FLOAT32)
  np.testing.assert_allclose(outputs[1].sum(1), 1.0, atol=1e-9)
  vote = onp.accuracy(np.mean(outputs, axis=0), ctx.dataset.test_y)
  assert record['test_accuracy'] == pytest.approx(vote, abs=0.5 / len(ctx.dataset.test_y))
  per_prototype = [onp.accuracy(o, ctx.dataset.test_y) for o in outputs]
  assert list(record['prototype_test_accuracy'].values()) == pytest.approx(per_prototype, abs=1e-6)
