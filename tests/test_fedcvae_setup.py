"""FedCVAE's set-up options against ceh-2000/fed_cvae (docs/parity.md, "FedCVAE-Ens"): the server
classifier `fedcvae_classifier` (models/classifier.py), each user's CVAE from its own init
(`fedcvae.same_init`, the code's `--should_initialize_same_exp=0`), and the parity adapter's
32×32 images (`dataset.image_size`)."""

import json
import math

import jax
import numpy as np
import pytest

from experiments.parity import ref_fedcvae
from jfed import driver
from jfed.configs import fedmho_digits, fedmho_fashion_mnist
from jfed.methods import common, fedcvae, fedmho, generative
from jfed.models import get_model, param_count
from tests import oracle_numpy as onp
from tests.support import (
  comparable_summary,
  override,
  read_metrics,
  smoke_config,
  snapshot_every_step,
)

NUM_CLASSES = 10


def _params(shape, seed=0):
  model = get_model('fedcvae_classifier', NUM_CLASSES, shape)
  variables = model.init(jax.random.PRNGKey(seed), np.zeros((2, *shape), np.float32))
  return model, variables


# ------------------------------------------------------------------------- the server classifier
@pytest.mark.parametrize('side, features', [(32, 5 * 5 * 64), (28, 4 * 4 * 64)])
def test_fedcvae_classifier_has_the_reference_layers_and_parameter_count(side, features):
  """Conv5×5 1→32, Conv5×5 32→64 (unpadded), Linear(features → 512), Linear(512 → 10); at 32×32
  the reference's Linear(1600, 512)."""
  _, variables = _params((side, side, 1))
  p = variables['params']
  assert set(variables) == {'params'}  # no BatchNorm statistics
  assert {k: {n: v.shape for n, v in layer.items()} for k, layer in p.items()} == {
    'Conv_0': {'kernel': (5, 5, 1, 32), 'bias': (32,)},
    'Conv_1': {'kernel': (5, 5, 32, 64), 'bias': (64,)},
    'Dense_0': {'kernel': (features, 512), 'bias': (512,)},
    'Dense_1': {'kernel': (512, 10), 'bias': (10,)},
  }
  by_hand = 1 * 32 * 25 + 32 + 32 * 64 * 25 + 64 + features * 512 + 512 + 512 * 10 + 10
  assert param_count(p) == by_hand
  if side == 32:
    assert by_hand == 876_938


@pytest.mark.parametrize('shape', [(32, 32, 1), (28, 28, 1), (8, 8, 1)])
def test_fedcvae_classifier_forward_equals_numpy(shape):
  """Conv, max pool, conv, max pool (no nonlinearity after the convs), flatten (HWC), Linear,
  ReLU, Linear, in float64 NumPy from the same parameters; 8×8 digits pad the convs by 2."""
  model, variables = _params(shape)
  p = onp.to_numpy(variables['params'])
  x = np.random.default_rng(3).random((4, *shape), dtype=np.float32)
  pad = 0 if shape[0] >= 16 else 2
  h = onp.pool2(onp.conv2d(x, p['Conv_0'], pad))
  h = onp.pool2(onp.conv2d(h, p['Conv_1'], pad))
  assert h.shape[1:] == {32: (5, 5, 64), 28: (4, 4, 64), 8: (2, 2, 64)}[shape[0]]
  want = onp.dense(onp.relu(onp.dense(onp.flatten(h), p['Dense_0'])), p['Dense_1'])
  got = np.asarray(model.apply(variables, x))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(model.apply(variables, x, train=True)), got)


def test_fedcvae_classifier_equals_the_references_torch_layers():
  """The reference's own `Classifier` layers (models/classifier.py, written out in torch) with
  the same weights give the same logits at 32×32; PyTorch flattens CHW, jfed HWC, so the first
  Linear's rows are permuted for the copy."""
  torch = pytest.importorskip('torch')
  tnn = torch.nn
  ref = tnn.Sequential(
    tnn.Conv2d(in_channels=1, out_channels=32, kernel_size=(5, 5)),
    tnn.MaxPool2d((2, 2)),
    tnn.Conv2d(in_channels=32, out_channels=64, kernel_size=(5, 5)),
    tnn.MaxPool2d((2, 2)),
    tnn.Flatten(),
    tnn.Linear(1600, 512),
    tnn.ReLU(),
    tnn.Linear(512, NUM_CLASSES),
  )
  model, variables = _params((32, 32, 1))
  p = onp.to_numpy(variables['params'])
  with torch.no_grad():
    for i, name in ((0, 'Conv_0'), (2, 'Conv_1')):
      ref[i].weight.copy_(torch.from_numpy(p[name]['kernel'].transpose(3, 2, 0, 1).copy()))
      ref[i].bias.copy_(torch.from_numpy(p[name]['bias']))
    w = p['Dense_0']['kernel'].reshape(5, 5, 64, 512).transpose(2, 0, 1, 3).reshape(1600, 512)
    ref[5].weight.copy_(torch.from_numpy(w.T.copy()))
    ref[5].bias.copy_(torch.from_numpy(p['Dense_0']['bias']))
    ref[7].weight.copy_(torch.from_numpy(p['Dense_1']['kernel'].T.copy()))
    ref[7].bias.copy_(torch.from_numpy(p['Dense_1']['bias']))
    ref.double()
    x = np.random.default_rng(4).random((4, 32, 32, 1))
    want = ref(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
  got = np.asarray(model.apply(variables, x.astype(np.float32)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fedcvae_classifier_has_pytorchs_default_init():
  """kaiming_uniform(a=√5) weights and U(±1/√fan_in) biases: every entry within 1/√fan_in, the
  weights' std that of a uniform on it (bound/√3)."""
  _, variables = _params((32, 32, 1))
  p = variables['params']
  for name, fan_in in (('Conv_0', 25), ('Conv_1', 32 * 25), ('Dense_0', 1600), ('Dense_1', 512)):
    bound = 1 / math.sqrt(fan_in)
    kernel, bias = np.asarray(p[name]['kernel']), np.asarray(p[name]['bias'])
    assert np.abs(kernel).max() <= bound and np.abs(bias).max() <= bound, name
    assert abs(kernel.std() - bound / math.sqrt(3)) < 0.1 * bound, name
    assert np.abs(bias).max() > 0.5 * bound, name  # not zeros (flax's default bias init)


# ------------------------------------------------------------------------- the CVAE initialisation
_CLIENTS = 'cvae:size=small;cvae:size=small,hidden=8'


def _ctx(seed=0, **overrides):
  config = override(fedmho_digits.get_config('fedcvae,smoke'), client_models=_CLIENTS, **overrides)
  config.seed = seed
  return driver.context_of_config(config)


def _by_hand(ctx, group, spec_index, client_id=None):
  """The init of `group`'s module from the documented key: fold_in(fold_in(PRNGKey(seed), 1
  (Purpose.MODEL_INIT)), spec index), then fold_in(client id) per client; flax's own init."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(ctx.run.seed), 1), spec_index)
  if client_id is not None:
    key = jax.random.fold_in(key, client_id)
  x = np.zeros((2, *ctx.dataset.input_shape), np.float32)
  variables = group.module.init(key, x, np.zeros(2, np.int32), jax.random.PRNGKey(0))
  return variables['params']


def _close(got, want):
  # jit and eager inits differ in the last bit (XLA fuses the scaling); another key, entirely
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _client(tree, i):
  return jax.tree.map(lambda a: np.asarray(a[i]), tree)


@pytest.mark.parametrize('same_init', [True, False])
def test_cvae_inits_are_one_per_spec_or_one_per_client_from_the_documented_keys(same_init):
  ctx = _ctx()
  groups = generative.cvae_groups(ctx)
  assert [len(g.client_ids) for g in groups] == [5, 5]
  inits = generative.init_cvaes(ctx, groups, same_init)
  for spec_index, (g, init) in enumerate(zip(groups, inits)):
    for i, k in enumerate(g.client_ids):
      want = _by_hand(ctx, g, spec_index, None if same_init else int(k))
      jax.tree.map(_close, _client(init.params, i), want)
    first = jax.tree.leaves(_client(init.params, 0))
    for i in range(1, len(g.client_ids)):
      other = jax.tree.leaves(_client(init.params, i))
      same = all(np.array_equal(a, b) for a, b in zip(first, other))
      assert same == same_init


def _capture_training(monkeypatch):
  """common.train_groups replaced by one that records the initial models and returns them."""
  seen = []

  def no_training(trainers, groups, init, epochs, key, **kwargs):
    seen.append(list(init))
    return list(init), []

  monkeypatch.setattr(common, 'train_groups', no_training)
  return seen


def test_fedcvae_trains_from_per_client_inits_by_default_and_fedmho_from_one(monkeypatch):
  """FedCVAE's default (same_init False, the reference's) hands each client its own init to the
  local training; `same_init=True` and FedMHO (one initial model per architecture) one per
  spec."""
  assert fedcvae.FedCVAEConfig().same_init is False
  ctx = _ctx()
  groups = generative.cvae_groups(ctx)
  seen = _capture_training(monkeypatch)
  config = fedcvae.FedCVAEConfig(cvae_epochs=1)
  fedcvae.train_local_cvaes(ctx, config)
  for spec_index, g in enumerate(groups):
    for i, k in enumerate(g.client_ids):
      want = _by_hand(ctx, g, spec_index, int(k))
      jax.tree.map(_close, _client(seen[-1][spec_index].params, i), want)
  fedcvae.train_local_cvaes(_ctx(), config._replace(same_init=True))
  fedmho_settings = fedmho.FedMHO(fedmho.FedMHOConfig()).cvae_settings()
  assert fedmho_settings.same_init is True
  generative.local_cvaes(_ctx(), fedmho_settings._replace(epochs=1))
  for shared in seen[1:]:
    for spec_index, g in enumerate(groups):
      for i in range(len(g.client_ids)):
        want = _by_hand(ctx, g, spec_index)
        jax.tree.map(_close, _client(shared[spec_index].params, i), want)


def _steps(directory):
  return sorted(p.name for p in directory.iterdir() if p.name.isdigit())


def test_the_cvae_stage_cache_keeps_the_two_inits_apart(tmp_path, monkeypatch):
  """`local_cvaes_dir`: CVAEs from one init per spec and those from per-client inits are cached
  in two subfolders, whose producer.json say which; neither is read back for the other."""
  seen = _capture_training(monkeypatch)
  directory = tmp_path / 'cvaes'
  s = generative.CVAESettings(1, 'adam', 1e-3, 32, 'bce', 1.0)
  for same_init in (True, False, True, False):
    generative.local_cvaes(_ctx(local_cvaes_dir=str(directory)), s._replace(same_init=same_init))
  assert len(seen) == 2  # the second pair read the cache
  folders = sorted(directory.iterdir())
  assert [_steps(f) for f in folders] == [['1'], ['1']]
  made_by = [json.loads((f / 'producer.json').read_text())['settings'] for f in folders]
  assert sorted(m['same_init'] for m in made_by) == [False, True]
  per_client = generative.local_cvaes(
    _ctx(local_cvaes_dir=str(directory)), s._replace(same_init=False)
  )
  g = per_client.groups[0]
  want = _by_hand(_ctx(), g, 0, int(g.client_ids[1]))
  jax.tree.map(_close, _client(per_client.models[0].params, 1), want)


def test_fedcvae_ens_with_per_client_inits_resumes_from_its_cached_cvaes(tmp_path, monkeypatch):
  """A run killed after its next-to-last step resumes to the whole run's metrics and summary,
  reading the per-client-init CVAEs from their own stage (no CVAE is trained again)."""
  config = smoke_config('fedcvae_ens')
  config.fedcvae.same_init = False
  with monkeypatch.context() as m:
    snapshot_every_step(m, tmp_path / 'killed')
    whole = driver.run_experiment('fedcvae_ens', config, tmp_path / 'whole', progress=False)
  killed = tmp_path / 'killed' / str(whole.steps - 1)
  assert whole.steps > 1
  assert _steps(killed / 'local_cvaes') == [str(config.fedcvae.cvae_epochs)]

  def no_training(*args, **kwargs):
    raise AssertionError('the CVAE clients were trained again')

  monkeypatch.setattr(common, 'train_groups', no_training)
  resumed = driver.run_experiment('fedcvae_ens', config, killed, progress=False)
  assert read_metrics(killed) == read_metrics(tmp_path / 'whole')
  assert comparable_summary(resumed) == comparable_summary(whole)


# ------------------------------------------------------------------------------ where they are set
def test_configs_set_the_references_init_and_server_classifier():
  """FedMHO's tables run the FEDCVAE row as FedMHO's code (one init per architecture);
  fedmho_digits' fedcvae_v0 and the parity adapter as ceh-2000/fed_cvae (own inits, its
  classifier; the adapter also at 32×32)."""
  for config in (fedmho_digits.get_config('fedcvae'), fedmho_fashion_mnist.get_config('fedcvae')):
    assert config.fedcvae.same_init is True and config.fedcvae.protocol == 'fedmho'
    assert config.dataset.image_size == 0
  v0 = fedmho_digits.get_config('fedcvae_v0')
  assert v0.fedcvae.same_init is False and v0.fedcvae.server_model == 'fedcvae_classifier'
  assert v0.dataset.image_size == 0  # a run-level key: the digits tables keep 8×8
  overrides = ref_fedcvae.REFERENCE.methods['fedcvae_ens'].jfed_overrides(
    ref_fedcvae.DEFAULT_BUDGET
  )
  assert overrides['fedcvae.same_init'] is False
  assert overrides['fedcvae.server_model'] == overrides['model'] == 'fedcvae_classifier'
  assert overrides['dataset.image_size'] == 32
