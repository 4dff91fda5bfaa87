"""FedProto and FedMD: penultimate features of the zoo, the prototype loss and aggregation,
nearest-prototype inference, typed uploads, FedMD's consensus and L1 digest, and learning on
digits."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver, engine
from jfed.configs import fedtsa_digits
from jfed.data import federate, load_dataset
from jfed.data.datasets import Dataset
from jfed.data.public import PublicData
from jfed.engine import compiles
from jfed.errors import ConfigError, NonFiniteError
from jfed.io import (
  LogitsUpload,
  PrototypeUpload,
  UploadError,
  validate_logits_upload,
  validate_prototype_upload,
)
from jfed.keys import Purpose
from jfed.methods import common, fedmd
from jfed.methods.fedmd import consensus_logits, digest_objective, l1_loss
from jfed.methods.fedproto import (
  CLASS_SUMS,
  ClassMeans,
  GlobalPrototypes,
  aggregate_prototypes,
  feature_dim,
  fedproto_objective,
  nearest_prototype,
  prototype_mse,
  with_class_sums,
  without_class_sums,
)
from jfed.models import get_model
from jfed.models.layers import apply_with_features
from tests import oracle_numpy as onp
from tests.support import dropout_losses_and_logits, override, record_training_labels

SHAPE = (8, 8, 1)


def _init(name, **kw):
  module = get_model(name, 10, SHAPE, **kw)
  return module, engine.init_model(module, SHAPE, jax.random.PRNGKey(0))


def _images(n, seed=0):
  return np.random.default_rng(seed).random((n, *SHAPE), dtype=np.float32)


@pytest.mark.parametrize(
  'name,kw,dim',
  [
    ('mlp', {'width_mult': 0.1}, 20),
    ('mlp', {'width_mult': 0.1, 'embed_dim': 6}, 6),
    ('cnn_mnist', {'embed_dim': 12}, 12),
    ('resnet18', {'width_mult': 1 / 32, 'embed_dim': 12}, 12),
  ],
)
def test_features_are_the_input_of_the_output_layer(name, kw, dim):
  module, model = _init(name, **kw)
  x = _images(4)
  # jitted: run op by op, the two forwards compiled 15-50 one-primitive programs
  (logits, features, stats), plain = jax.jit(
    lambda v, x: (apply_with_features(module, v, x), module.apply(v, x))
  )(model.variables(), x)
  assert features.shape == (4, dim)
  np.testing.assert_allclose(logits, plain, rtol=1e-5, atol=1e-6)
  out = model.params[max(k for k in model.params if k.startswith('Dense_'))]
  np.testing.assert_allclose(logits, features @ out['kernel'] + out['bias'], rtol=1e-4, atol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, stats, model.batch_stats)  # eval: unchanged


def test_fedproto_loss_is_cross_entropy_plus_ld_times_the_prototype_mse():
  module, model = _init('mlp', width_mult=0.1, embed_dim=5)
  x = _images(6, seed=1)
  y = np.array([0, 2, 2, 5, 1, 3])
  weights = np.array([1, 1, 1, 1, 1, 0], np.float32)  # the last row is padding
  rng = np.random.default_rng(2)
  protos = rng.normal(size=(10, 5)).astype(np.float32)
  support = np.array([2, 0, 1, 0, 0, 3, 0, 0, 0, 0], np.int32)  # classes 1 and 3: no prototype
  # jitted as training runs it: op by op, the objective compiled ~40 one-primitive programs
  objective = jax.jit(fedproto_objective(0.7), static_argnums=0)
  loss, (reported, correct, count, _) = objective(
    module,
    model.params,
    {},
    x,
    y,
    weights,
    jax.random.PRNGKey(0),
    GlobalPrototypes(protos, support),
  )
  logits, f, _ = jax.jit(lambda v, x: apply_with_features(module, v, x))(
    {'params': model.params}, x
  )
  logits, f = np.asarray(logits, np.float64), np.asarray(f, np.float64)
  ce = np.log(np.exp(logits).sum(1)) - logits[np.arange(6), y]
  mse = sum(np.sum((f[i] - protos[y[i]]) ** 2) for i in range(5) if support[y[i]] > 0) / (5 * 5)
  np.testing.assert_allclose(loss, np.mean(ce[:5]) + 0.7 * mse, rtol=1e-5)
  assert mse > 0 and reported == loss and count == 5
  assert correct == np.sum((np.argmax(logits, 1) == y)[:5])
  # without any global prototype (round 1) the loss is the cross entropy
  none = GlobalPrototypes(protos, np.zeros(10, np.int32))
  loss0, _ = objective(module, model.params, {}, x, y, weights, jax.random.PRNGKey(0), none)
  np.testing.assert_allclose(loss0, np.mean(ce[:5]), rtol=1e-5)


def test_global_prototypes_are_the_unweighted_mean_over_the_clients_holding_the_class():
  rng = np.random.default_rng(0)
  counts = np.array([[5, 0, 2], [1, 1, 0], [0, 0, 0], [9, 3, 0]])
  protos = rng.normal(size=(4, 3, 2)).astype(np.float32) * (counts > 0)[..., None]
  got = aggregate_prototypes(protos, counts)
  for c in range(3):
    holders = [k for k in range(4) if counts[k, c] > 0]
    np.testing.assert_allclose(got.prototypes[c], np.mean(protos[holders, c], axis=0), rtol=1e-6)
    assert got.support[c] == len(holders)
  counts[:, 2] = 0
  got = aggregate_prototypes(protos * (counts > 0)[..., None], counts)
  assert got.support[2] == 0 and np.all(got.prototypes[2] == 0)


def test_local_prototypes_are_class_means_of_train_mode_embeddings_batch_by_batch():
  """Batches of 8 in order, BatchNorm on each batch's real samples; the second client's last
  batches are padding only (no statistics: they must not poison the sums)."""
  # CNNMnist's two BatchNorms: a ResNet-18's forward compiled 4x longer (5 s of its programs)
  module, model = _init('cnn_mnist', channels=(4, 8), embed_dim=6)
  rng = np.random.default_rng(0)
  x, y = _images(25, seed=4), rng.integers(0, 3, 25)
  fed = federate(x, y, [np.arange(20), np.arange(20, 25)])
  models = engine.replicate(model, 2)
  with compiles.count_compilations() as compiled:
    got = ClassMeans(module, 10, 8, 'loop')(models, fed, 6)
  # the last chunk (4 of 8 samples) is padded to the chunk: one program for every chunk
  assert compiled.names.count('jit(<lambda>)') == 1, compiled.names
  # jitted: run op by op, the forward compiled one program per primitive
  features = jax.jit(lambda v, x: apply_with_features(module, v, x, train=True)[1])
  for k, (start, size) in enumerate([(0, 20), (20, 5)]):
    feats = np.concatenate(
      [
        features(model.variables(), x[b : min(b + 8, start + size)])
        for b in range(start, start + size, 8)
      ]
    )
    labels = y[start : start + size]
    for c in range(10):
      want = feats[labels == c].mean(0) if np.any(labels == c) else np.zeros(6)
      np.testing.assert_allclose(got[k, c], want, rtol=1e-4, atol=1e-5)


def test_class_means_are_the_same_mapped_over_clients_as_looped():
  """strategy='vmap' (accelerators) maps the class means over the clients, 'loop' (CPU) runs
  them one by one: the same means."""
  module, model = _init('mlp', width_mult=0.1)
  x, y = _images(13, seed=3), np.random.default_rng(1).integers(0, 4, 13)
  fed = federate(x, y, [np.arange(9), np.arange(9, 13)])
  models = engine.replicate(model, 2)
  dim = feature_dim(module, SHAPE)
  looped = ClassMeans(module, 10, 4, 'loop')(models, fed, dim)
  mapped = ClassMeans(module, 10, 4, 'vmap')(models, fed, dim)
  assert np.any(looped) and looped.shape == (2, 10, dim)
  np.testing.assert_allclose(mapped, looped, rtol=1e-5, atol=1e-6)


def test_class_sums_are_zeroed_per_client_of_the_group_and_stripped_after():
  _, model = _init('mlp', width_mult=0.1)  # leaves [2, 20] and wider once stacked
  models = engine.replicate(model, 2)
  with_sums = with_class_sums(models, 10, 6)
  sums = with_sums.batch_stats[CLASS_SUMS]
  assert sums['sums'].shape == (2, 10, 6) and sums['counts'].shape == (2, 10)
  assert not np.any(sums['sums']) and not np.any(sums['counts'])
  stripped, means = without_class_sums(with_sums)
  assert CLASS_SUMS not in stripped.batch_stats and np.shape(means) == (2, 10, 6)


def test_nearest_prototype_inference():
  protos = GlobalPrototypes(
    np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [1.0, 1.0]], np.float32),
    np.array([1, 2, 1, 0]),  # class 3 has no prototype
  )
  features = np.array([[9.0, 1.0], [1.0, 1.0], [2.0, 8.0], [7.0, 4.0]], np.float32)
  # [1, 1] is class 3's prototype, but class 3 has none: the nearest with one is class 0
  np.testing.assert_array_equal(nearest_prototype(features, protos), [1, 0, 2, 1])
  # restricted to a client's classes {0, 2}
  np.testing.assert_array_equal(
    nearest_prototype(features, protos, allowed=[1, 0, 1, 1]), [0, 0, 2, 0]
  )
  # stacked over clients
  assert nearest_prototype(np.stack([features, features]), protos).shape == (2, 4)
  # against the brute-force distances on random embeddings (the method expands |f - p|²)
  rng = np.random.default_rng(0)
  many = rng.normal(size=(3, 50, 16)).astype(np.float32)
  protos = GlobalPrototypes(rng.normal(size=(5, 16)).astype(np.float32), np.ones(5))
  brute = np.argmin(np.square(many[..., None, :] - protos.prototypes).sum(-1), -1)
  np.testing.assert_array_equal(nearest_prototype(many, protos), brute)


def test_prototype_and_logits_uploads_are_validated():
  counts = np.array([3, 0, 1], np.int32)
  good = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]], np.float32)
  validate_prototype_upload(PrototypeUpload(0, 4, good, counts), 3, 2)
  with pytest.raises(UploadError, match='sum to num_samples'):
    validate_prototype_upload(PrototypeUpload(0, 5, good, counts), 3, 2)
  with pytest.raises(UploadError, match='does not hold must be zero'):
    validate_prototype_upload(PrototypeUpload(0, 4, good + 1, counts), 3, 2)
  with pytest.raises(UploadError, match='expected float32'):
    validate_prototype_upload(PrototypeUpload(0, 4, good[:, :1], counts), 3, 2)
  validate_logits_upload(LogitsUpload(1, np.zeros((5, 3), np.float32)), 5, 3)
  with pytest.raises(UploadError, match='non-finite'):
    validate_logits_upload(LogitsUpload(1, np.full((5, 3), np.nan, np.float32)), 5, 3)


def test_fedmd_consensus_is_the_mean_logit_and_the_digest_loss_is_l1():
  logits = np.random.default_rng(0).normal(size=(3, 4, 10)).astype(np.float32)
  np.testing.assert_allclose(consensus_logits(logits), logits.mean(0), rtol=1e-6)
  module, model = _init('mlp', width_mult=0.1)
  x = _images(4, seed=3)
  target = np.asarray(consensus_logits(logits))
  weights = np.array([1, 1, 1, 0], np.float32)
  # jitted as training runs it: op by op, the objective compiled ~10 one-primitive programs
  loss, (reported, correct, count, _) = jax.jit(digest_objective, static_argnums=0)(
    module, model.params, {}, x, target, weights, jax.random.PRNGKey(0)
  )
  out = np.asarray(jax.jit(module.apply)({'params': model.params}, x))
  np.testing.assert_allclose(loss, np.mean(np.abs(out[:3] - target[:3])), rtol=1e-5)
  assert reported == loss and count == 3
  assert correct == np.sum((out.argmax(1) == target.argmax(1))[:3])
  np.testing.assert_allclose(l1_loss(jnp.zeros((2, 2)), jnp.ones((2, 2)), jnp.ones(2)), 1.0)


def test_fedmd_digest_runs_in_train_mode_with_masked_batchnorm_and_its_dropout_key():
  """The digest's forward pass is a training pass: BatchNorm on the real rows' statistics (the
  padded rows masked out, the running statistics updated from them) and dropout drawn from the
  step's key; a batch with one real row is that row's mean absolute error."""
  module, model = _init('cnn_mnist')
  x = _images(6, seed=5)
  target = np.random.default_rng(1).normal(size=(6, 10)).astype(np.float32)
  weights = np.array([1, 1, 1, 1, 0, 0], np.float32)  # the last two rows are padding
  digest = jax.jit(digest_objective, static_argnums=0)
  loss, (_, _, count, stats) = digest(
    module, model.params, model.batch_stats, x, target, weights, jax.random.PRNGKey(0)
  )
  logits, updates = jax.jit(lambda v, x: module.apply(v, x, train=True, mutable=['batch_stats']))(
    model.variables(), x[:4]
  )
  np.testing.assert_allclose(loss, np.mean(np.abs(np.asarray(logits) - target[:4])), rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    stats,
    updates['batch_stats'],
  )
  assert count == 4
  # 'correct' counts the real rows whose argmax agrees with the consensus's
  agreeing = np.concatenate([np.asarray(logits), np.eye(10, dtype=np.float32)[:2]])
  agreeing[3] = np.roll(agreeing[3], 1)  # one real row disagrees
  _, (_, correct, _, _) = digest(
    module, model.params, model.batch_stats, x, agreeing, weights, jax.random.PRNGKey(0)
  )
  assert correct == 3
  # dropout (VGG-9, rate 0.5) follows the step's key
  losses, logits = dropout_losses_and_logits(digest, x, target, weights)
  np.testing.assert_allclose(losses[0], np.mean(np.abs(logits - target[:4])), rtol=1e-5)
  assert losses[0] != losses[1]
  one_row = l1_loss(jnp.asarray(target[:2]) + 1.0, jnp.asarray(target[:2]), jnp.array([1.0, 0.0]))
  np.testing.assert_allclose(one_row, 1.0, rtol=1e-6)


def test_fedproto_objective_trains_with_masked_batchnorm_its_dropout_key_and_collects_real_rows():
  """A FedProto client's step is a training pass: BatchNorm on the real rows' statistics (the
  padded rows masked out), CE + ld · the prototype MSE over the real rows whose class has a
  prototype (over rows · D), the class sums of the real rows' embeddings only, and dropout from
  the step's key; a batch with one real row is that row's squared distance over D."""
  module, model = _init('cnn_mnist')
  x = _images(6, seed=5)
  y = np.array([0, 1, 1, 2, 3, 3], np.int32)
  weights = np.array([1, 1, 1, 1, 0, 0], np.float32)  # the last two rows are padding
  rng = np.random.default_rng(2)
  dim = 128  # cnn_mnist on 8x8: 2 x 2 x 32
  protos = GlobalPrototypes(
    rng.normal(size=(10, dim)).astype(np.float32), np.array([1, 1, 0, 1] + [0] * 6, np.int32)
  )
  stats = {
    **model.batch_stats,
    CLASS_SUMS: {'sums': np.zeros((10, dim), np.float32), 'counts': np.zeros(10, np.float32)},
  }
  objective = jax.jit(fedproto_objective(0.5), static_argnums=0)
  loss, (_, correct, count, new_stats) = objective(
    module, model.params, stats, x, y, weights, jax.random.PRNGKey(0), protos
  )
  logits, updates = module.apply(
    model.variables(), x[:4], train=True, mutable=['batch_stats', 'intermediates']
  )
  logits, (features,) = np.asarray(logits), updates['intermediates']['features']
  features = np.asarray(features, np.float64)
  ce = onp.cross_entropy(logits, y[:4])
  has = protos.support[y[:4]] > 0  # class 2 has no prototype
  mse = (((features - protos.prototypes[y[:4]]) ** 2).sum(1) * has).sum() / (4 * dim)
  np.testing.assert_allclose(loss, ce + 0.5 * mse, rtol=1e-5)
  assert count == 4 and correct == int((logits.argmax(1) == y[:4]).sum())
  own = {k: v for k, v in new_stats.items() if k != CLASS_SUMS}
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), own, updates['batch_stats']
  )
  onehot = np.eye(10)[y[:4]]
  np.testing.assert_allclose(
    new_stats[CLASS_SUMS]['sums'], onehot.T @ features, rtol=1e-5, atol=1e-5
  )
  np.testing.assert_array_equal(new_stats[CLASS_SUMS]['counts'], onehot.sum(0))
  # dropout (VGG-9, rate 0.5) follows the step's key
  none = GlobalPrototypes(np.zeros((10, 16), np.float32), np.zeros(10, np.int32))
  losses, logits = dropout_losses_and_logits(objective, x, y, weights, none)
  np.testing.assert_allclose(losses[0], onp.cross_entropy(logits, y[:4]), rtol=1e-5)
  assert losses[0] != losses[1]
  one_row = prototype_mse(
    jnp.asarray(protos.prototypes[:2]) + 2.0, jnp.array([0, 1]), jnp.array([1.0, 0.0]), protos
  )
  np.testing.assert_allclose(one_row, 4.0, rtol=1e-6)


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'fedproto.participation': 1.5}, r'^fedproto\.participation '),
    ({'fedproto.ld': -1.0}, r'^fedproto\.ld must be >= 0, got -1\.0$'),
    ({'fedproto.prototypes': 'bad'}, r"^fedproto\.prototypes is 'bad'; valid: "),
  ],
)
def test_fedproto_refusals_name_the_section(overrides, message):
  with pytest.raises(ConfigError, match=message):
    driver.build_algorithm('fedproto', override(fedtsa_digits.get_config('smoke'), **overrides))


def test_fedproto_refuses_unequal_embedding_widths_and_fedmd_bad_sizes():
  config = override(fedtsa_digits.get_config('smoke'), **{'fedproto.widest_features': False})
  with pytest.raises(
    ConfigError,
    match=r'^fedproto needs one embedding width across client models, got \{.*\}; set '
    r'fedproto\.widest_features=True or fedproto\.embed_dim > 0$',
  ):
    driver.run_in_memory('fedproto', config)
  config = override(fedtsa_digits.get_config('smoke'), **{'fedmd.alignment_size': 41})
  with pytest.raises(ConfigError, match='alignment_size=41 exceeds fedmd.public_size=40'):
    driver.build_algorithm('fedmd', config)
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{'model': 'lenet', 'client_models': '', 'fedproto.embed_dim': 16},
  )
  with pytest.raises(ConfigError, match='has no embed_dim option'):
    driver.run_in_memory('fedproto', config)


def _two_mlp_clients(**overrides):
  """The smoke config for two clients of one small MLP on a dataset and partition the test
  builds (nothing held out)."""
  return override(
    fedtsa_digits.get_config('smoke'),
    **{
      'partition.num_clients': 2,
      'dataset.holdout_size': 0,
      'client_models': '',
      'model': 'mlp:width_mult=0.05',
      **overrides,
    },
  )


def test_fedproto_names_the_clients_whose_loss_turns_non_finite():
  """Client 0 holds one image; both clients' images are NaN, and both are named."""
  d = load_dataset('digits')
  x = np.full_like(d.train_x[:21], np.nan)
  ds = Dataset('digits', x, d.train_y[:21], d.test_x[:20], d.test_y[:20], 10)
  config = _two_mlp_clients(**{'fedproto.local_epochs': 2, 'fedproto.participation': 1.0})
  ctx = driver.make_context(config, ds, [np.arange(1), np.arange(1, 21)])
  with pytest.raises(
    NonFiniteError,
    match=r'^fedproto: the training loss of client\(s\) \[0, 1\] \(mlp:width_mult=0.05\) became '
    r'non-finite; lower the learning rate or check the data$',
  ):
    driver.run(driver.build_algorithm('fedproto', config), ctx, progress=False)


def test_fedproto_scores_zero_on_its_own_classes_when_the_test_split_has_none_of_them():
  """Both clients hold only classes 5-9 and the test split only classes 0-4: the readings on a
  client's own classes have no test sample and count as 0 (not NaN)."""
  d = load_dataset('digits')
  train = np.flatnonzero(d.train_y >= 5)[:40]
  test = np.flatnonzero(d.test_y < 5)[:20]
  ds = Dataset('digits', d.train_x[train], d.train_y[train], d.test_x[test], d.test_y[test], 10)
  config = _two_mlp_clients(**{'fedproto.rounds': 1})
  algorithm = driver.build_algorithm('fedproto', config)
  ctx = driver.make_context(config, ds, [np.arange(20), np.arange(20, 40)])
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # a mean over no sample would warn
    summary = driver.run(algorithm, ctx, progress=False)
  assert summary['local_test_accuracy'] == 0.0
  assert summary['local_proto_test_accuracy'] == 0.0


@pytest.mark.parametrize(
  'client_models,narrow,want',
  [
    # ResNet-18: the pooled last stage is the feature; the narrow one's last stage widened
    (
      'resnet18:width_mult=0.0625;resnet18:width_mult=0.03125',
      'resnet18:width_mult=0.03125',
      {'widths': (2, 4, 8, 32)},
    ),
    # a one-hidden-layer CNN next to the 200-200 MLP: its only hidden layer widened
    ('mlp;fedhydra_cnn3', 'fedhydra_cnn3', {'hidden': (200,)}),
    ('mlp:width_mult=0.1;mlp:width_mult=0.05', 'mlp:width_mult=0.05', {'hidden': (10, 20)}),
  ],
)
def test_widest_features_widen_only_the_layer_feeding_the_classifier(client_models, narrow, want):
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{'model': client_models.split(';')[0], 'client_models': client_models},
  )
  algorithm = driver.build_algorithm('fedproto', config)
  ctx = driver.context_of_config(config)
  build = algorithm._widest_features_build(ctx)
  module = build(narrow, ctx.dataset)
  for field, value in want.items():
    assert tuple(getattr(module, field)) == value
  wide = client_models.split(';')[0]
  assert build(wide, ctx.dataset) == algorithm._build(wide, ctx.dataset)  # the widest unchanged


def test_fedproto_clients_start_from_their_own_draws_of_their_architectures_init_key():
  """Every client starts from its own init (the reference builds each local model anew), drawn
  from the MODEL_INIT key of its architecture's index among the client model specs, split
  over the group's clients; the global prototypes start empty."""
  config = override(fedtsa_digits.get_config('smoke'), **{'partition.num_clients': 4})
  ctx = driver.context_of_config(config)
  aux = driver.build_algorithm('fedproto', config).setup(ctx)
  specs = list(ctx.federation.architectures)
  assert len(aux.groups) == 2
  for g, models in zip(aux.groups, aux.init.models):
    key = ctx.derive_key(Purpose.MODEL_INIT, specs.index(g.spec))
    draws = jax.random.split(key, len(g.client_ids))
    assert len(draws) > 1
    for j, draw in enumerate(draws):
      want = engine.init_model(g.module, ctx.dataset.input_shape, draw)
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), engine.take(models, j), want
      )
  np.testing.assert_array_equal(aux.init.protos.prototypes, np.zeros((10, aux.dim)))
  np.testing.assert_array_equal(aux.init.protos.support, np.zeros(10))


def test_widest_features_refuse_a_narrower_model_with_no_layer_to_widen():
  config = override(
    fedtsa_digits.get_config('smoke'), **{'model': 'mlp', 'client_models': 'mlp;cnn_mnist'}
  )
  algorithm = driver.build_algorithm('fedproto', config)
  ctx = driver.context_of_config(config)
  with pytest.raises(
    ConfigError,
    match=r"^fedproto.widest_features: model 'cnn_mnist' has no layer to widen to the feature "
    r'width 200 of the other clients; set fedproto.embed_dim > 0$',
  ):
    algorithm._widest_features_build(ctx)('cnn_mnist', ctx.dataset)


def test_fedmd_refuses_public_labels_beyond_the_tasks_classes(monkeypatch):
  def beyond(dataset, source, size, seed):
    x = dataset.train_x[:size]
    return PublicData(x, np.full(size, 10), dataset.test_x, dataset.test_y, source)

  monkeypatch.setattr(fedmd, 'public_data', beyond)
  config = fedtsa_digits.get_config('smoke')
  with pytest.raises(
    ConfigError,
    match=r"^fedmd.public='holdout' has labels up to 10, beyond the 10 classes of digits$",
  ):
    driver.run_in_memory('fedmd', config)


def test_fedmd_caches_its_transfer_learning_in_the_workdir_per_epoch_budget(tmp_path, monkeypatch):
  """A second setup in the same workdir reloads the transfer-learned models (no training); a
  different number of public or private epochs trains again (and is kept beside the first)."""
  labels = record_training_labels(monkeypatch)

  def setup(**overrides):
    config = override(
      fedtsa_digits.get_config('smoke'),
      **{'fedmd.public_epochs': 0, 'fedmd.private_epochs': 1, **overrides},
    )
    ctx = driver.context_of_config(config, workdir=tmp_path)
    del labels[:]
    aux = driver.build_algorithm('fedmd', config).setup(ctx)
    return aux, [label for label in labels if label.startswith('transfer')]

  first, trained = setup()
  assert trained and (tmp_path / 'fedmd_transfer').is_dir()
  again, trained = setup()
  assert not trained  # reloaded
  for a, b in zip(first.init, again.init):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  np.testing.assert_array_equal(again.transfer_accuracy, first.transfer_accuracy)
  _, trained = setup(**{'fedmd.public_epochs': 1})  # public 1, private 1: not public 0's cache
  assert 'transfer learning: public data' in trained
  _, trained = setup(**{'fedmd.private_epochs': 2})
  assert trained == ['transfer learning: private data'] * 2  # one per architecture group


def test_fedmd_stages_of_one_batch_size_and_loss_share_one_trainer(monkeypatch):
  """Transfer learning on the public and the private data and the revisit train with the
  cross-entropy at one batch size here, so one trainer (one compiled program) per architecture;
  the digest, another loss, has its own."""
  trainers, train = [], common.train_groups

  def recording(group_trainers, groups, models, epochs, key, label='', **kwargs):
    trainers.extend((label, t) for t in group_trainers)
    return train(group_trainers, groups, models, epochs, key, label=label, **kwargs)

  monkeypatch.setattr(common, 'train_groups', recording)
  batch = {f'fedmd.{stage}_batch': 8 for stage in ('public', 'private', 'revisit', 'digest')}
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{'fedmd.public_epochs': 1, 'fedmd.private_epochs': 1, **batch},
  )
  ctx = driver.context_of_config(config)
  aux = driver.build_algorithm('fedmd', config).setup(ctx)
  assert len(aux.groups) == 2
  want = [('transfer learning: public data', aux.revisit[0])]
  want += [('transfer learning: private data', aux.revisit[0])]
  want += [('transfer learning: public data', aux.revisit[1])]
  want += [('transfer learning: private data', aux.revisit[1])]
  assert [(label, id(t)) for label, t in trainers] == [(label, id(t)) for label, t in want]
  assert aux.revisit[0] is not aux.revisit[1]
  assert not {id(t) for t in aux.digest} & {id(t) for t in aux.revisit}


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'fedmd.digest_batch': 0}, r'^fedmd.digest_batch must be positive, got 0$'),
    ({'fedmd.public_epochs': -1}, r'^fedmd.public_epochs must be >= 0, got -1$'),
    ({'fedmd.optimizer': 'bad'}, r"^fedmd.optimizer is 'bad'; valid: client, adam$"),
    (
      {'fedmd.public_size': 1000, 'fedmd.alignment_size': 10},
      r"^fedmd.public='holdout' needs 1000 training samples held out of the clients but ",
    ),
  ],
)
def test_fedmd_refusals_name_the_section(overrides, message):
  config = override(fedtsa_digits.get_config('smoke'), **overrides)
  with pytest.raises(ConfigError, match=message):
    driver.build_algorithm('fedmd', config)


@pytest.mark.slow
def test_fedproto_learns_on_digits():
  """A CNN and an MLP client family with 128-wide embeddings; 10 rounds of 2 local epochs."""
  config = override(
    fedtsa_digits.get_config(''),
    **{
      'model': 'cnn_mnist',
      'client_models': 'cnn_mnist;mlp:width_mult=0.64',
      'fedproto.embed_dim': 0,
      'fedproto.rounds': 10,
    },
  )
  summary = driver.run_in_memory('fedproto', config)
  print('fedproto', {k: v for k, v in summary.items() if 'accuracy' in k})
  assert summary['embedding_dim'] == 128
  assert summary.final_test_accuracy > 0.5  # chance is 0.1
  assert summary['proto_test_accuracy'] > 0.5
  assert summary['local_proto_test_accuracy'] > 0.7


@pytest.mark.slow
def test_fedmd_learns_on_digits():
  """A CNN and an MLP client family; 180 public images; 5 rounds."""
  config = override(
    fedtsa_digits.get_config(''),
    **{
      'model': 'cnn_mnist',
      'client_models': 'cnn_mnist;mlp',
      'fedmd.rounds': 5,
      'fedmd.private_epochs': 5,
      'fedmd.revisit_epochs': 1,
    },
  )
  summary = driver.run_in_memory('fedmd', config)
  print('fedmd', summary.final_test_accuracy, summary['transfer_test_accuracy'])
  assert summary.final_test_accuracy > 0.6  # chance is 0.1
  assert summary['eval_samples'] == 360  # the whole test split
