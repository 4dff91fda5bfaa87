"""HeteroFL: sub-model slicing and the count-based scatter average, the masked cross entropy,
static BatchNorm statistics, per-client objective context in every client-map strategy, and
learning on digits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfed import driver, engine
from jfed.configs import fedtsa_digits
from jfed.data import federate, load_dataset
from jfed.data.datasets import Dataset
from jfed.engine import submodels
from jfed.errors import ConfigError
from jfed.io.uploads import UploadError, serialized_nbytes
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.heterofl import (
  client_rates,
  mask_logits,
  masked_classification_objective,
  model_shapes,
  scale_hidden_layers,
)
from jfed.models import get_model
from tests import oracle_numpy as onp
from tests.support import dropout_losses_and_logits, override

SHAPE = (8, 8, 1)


def _init(name, **kw):
  module = get_model(name, 10, SHAPE, **kw)
  return module, engine.init_model(module, SHAPE, jax.random.PRNGKey(0))


def _random_like(shapes, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


def test_slicing_at_rate_one_is_the_identity_and_a_half_rate_takes_the_leading_channels():
  module, full = _init('resnet18', width_mult=1 / 16)

  def slice_to(shapes):  # jitted: run op by op, each slice compiled a program per leaf shape
    return jax.jit(lambda t: submodels.slice_tree(t, shapes))(full)

  same = slice_to(model_shapes(module, SHAPE))
  jax.tree.map(np.testing.assert_array_equal, same, full)
  half = model_shapes(get_model('resnet18', 10, SHAPE, width_mult=1 / 32), SHAPE)
  sub = slice_to(half)
  # the stem conv keeps the first 2 of 4 output channels, a block conv the first 4x4 of 8x8
  np.testing.assert_array_equal(
    sub.params['Conv_0']['kernel'], full.params['Conv_0']['kernel'][..., :2]
  )
  k = full.params['BasicBlock_2']['Conv_0']['kernel']
  assert k.shape[-2:] == (4, 8)
  np.testing.assert_array_equal(sub.params['BasicBlock_2']['Conv_0']['kernel'], k[:, :, :2, :4])
  # the output layer keeps every class
  assert sub.params['Dense_0']['kernel'].shape == (16, 10)
  with pytest.raises(ValueError, match='not a sub-block'):
    submodels.check_sliceable(half, model_shapes(module, SHAPE))


def _independent_mean(full, clients, masks, output_layer):
  """Entry by entry: the mean over the clients whose corner holds the entry (output-layer entries
  only from clients holding the class); entries nobody holds keep the global value."""
  out = {}
  for path, a in jax.tree_util.tree_flatten_with_path(full)[0]:
    a = np.asarray(a)
    total, count = np.zeros(a.shape), np.zeros(a.shape)
    leaves = [np.asarray(dict(jax.tree_util.tree_flatten_with_path(c)[0])[path]) for c in clients]
    for leaf, mask in zip(leaves, masks):
      for idx in np.ndindex(*leaf.shape):
        if path[0].key == output_layer and not mask[idx[-1]]:
          continue
        total[idx] += leaf[idx]
        count[idx] += 1
    out[path] = np.where(count > 0, total / np.maximum(count, 1), a)
  return out


def test_scatter_average_of_two_half_and_one_full_client_is_the_count_based_mean_entry_by_entry():
  _, full = _init('resnet18', width_mult=1 / 16)
  full_shapes = jax.eval_shape(lambda: full.params)
  half_shapes = model_shapes(get_model('resnet18', 10, SHAPE, width_mult=1 / 32), SHAPE).params
  halves = [_random_like(half_shapes, 1), _random_like(half_shapes, 2)]
  whole = _random_like(full_shapes, 3)
  masks = np.array([[1, 1, 0, 0, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], np.float32)
  whole_mask = np.array([[1] * 9 + [0]], np.float32)  # class 9: held by nobody
  output = submodels.output_layer_name(full.params, 10)
  assert output == 'Dense_0'
  # jitted as the method runs it (eagerly every leaf's ops compile on their own: seconds), with
  # the clients' stacking (eagerly ~40 one-primitive programs)
  scatter_average = jax.jit(
    lambda full, halves, whole, weights, masks: submodels.scatter_average(
      full, [engine.stack(halves), engine.stack([whole])], weights, masks, output_layer=output
    )
  )
  got = scatter_average(full.params, halves, whole, [np.ones(2), np.ones(1)], [masks, whole_mask])
  want = _independent_mean(full.params, halves + [whole], list(masks) + list(whole_mask), output)
  for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]:
    np.testing.assert_allclose(leaf, want[path], rtol=1e-6, atol=1e-6, err_msg=str(path))
  # spot checks: an entry all three hold, one only the full client holds, a class nobody holds
  k = lambda t: np.asarray(t['BasicBlock_0']['Conv_0']['kernel'])  # noqa: E731
  np.testing.assert_allclose(
    k(got)[0, 0, 0, 0], np.mean([k(t)[0, 0, 0, 0] for t in halves + [whole]]), rtol=1e-6
  )
  np.testing.assert_allclose(k(got)[0, 0, 3, 3], k(whole)[0, 0, 3, 3], rtol=1e-6)
  np.testing.assert_array_equal(
    got['Dense_0']['kernel'][:, 9], full.params['Dense_0']['kernel'][:, 9]
  )
  # a client that sat the round out (weight 0) changes nothing
  without = scatter_average(
    full.params, halves, whole, [np.array([1.0, 0.0]), np.ones(1)], [masks, whole_mask]
  )
  want = _independent_mean(full.params, [halves[0], whole], [masks[0], whole_mask[0]], output)
  for path, leaf in jax.tree_util.tree_flatten_with_path(without)[0]:
    np.testing.assert_allclose(leaf, want[path], rtol=1e-6, atol=1e-6, err_msg=str(path))


def test_masked_cross_entropy_equals_a_hand_computation():
  module, model = _init('mlp', width_mult=0.1)
  rng = np.random.default_rng(0)
  x = rng.random((6, *SHAPE), dtype=np.float32)
  y = np.array([1, 3, 3, 1, 7, 0])
  weights = np.array([1, 1, 1, 1, 1, 0], np.float32)  # the last row is padding
  label_mask = np.zeros(10, np.float32)
  label_mask[[1, 3, 7]] = 1
  # jitted as training runs it: op by op, the objective compiled ~25 one-primitive programs
  loss, (reported, correct, count, _) = jax.jit(masked_classification_objective, static_argnums=0)(
    module, model.params, {}, x, y, weights, jax.random.PRNGKey(1), label_mask
  )
  logits = np.asarray(jax.jit(module.apply)({'params': model.params}, x), np.float64)
  z = np.where(label_mask > 0, logits, 0.0)  # masked_fill(label_mask == 0, 0)
  per = np.log(np.sum(np.exp(z), axis=1)) - z[np.arange(6), y]
  np.testing.assert_allclose(loss, np.sum(per[:5]) / 5, rtol=1e-5)
  assert reported == loss and count == 5
  assert correct == np.sum((np.argmax(z, 1) == y)[:5])
  np.testing.assert_array_equal(jax.jit(mask_logits)(jnp.ones((1, 10)), label_mask)[0], label_mask)


def test_the_objective_context_reaches_every_client_the_same_way_in_every_strategy():
  """Two clients with different label masks: loop, vmap and scan train the same models."""
  module, model = _init('mlp', width_mult=0.1)
  rng = np.random.default_rng(0)
  x, y = rng.random((50, *SHAPE), dtype=np.float32), rng.integers(0, 10, 50)
  fed = federate(x, y, [np.arange(0, 30), np.arange(30, 50)])
  masks = jnp.asarray((np.arange(10)[None] < np.array([[4], [10]])).astype(np.float32))
  results = {}
  for strategy in ('loop', 'vmap', 'scan'):
    trainer = engine.GroupTrainer(
      module, optax.sgd(0.1), 8, strategy=strategy, objective=masked_classification_objective
    )
    state = engine.init_train_state(trainer.tx, engine.replicate(model, 2))
    state, metrics = trainer.train(state, fed, 2, jax.random.PRNGKey(3), context=masks)
    results[strategy] = (state.model.params, metrics.loss)
  for strategy in ('vmap', 'scan'):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      results[strategy],
      results['loop'],
    )
  # the mask matters: unmasked training gives other models
  trainer = engine.GroupTrainer(module, optax.sgd(0.1), 8, strategy='loop')
  state = engine.init_train_state(trainer.tx, engine.replicate(model, 2))
  plain, _ = trainer.train(state, fed, 2, jax.random.PRNGKey(3))
  assert not np.allclose(
    plain.model.params['Dense_0']['kernel'][0], results['loop'][0]['Dense_0']['kernel'][0]
  )


@pytest.mark.parametrize(
  'name,kw,output_layer',
  [('cnn_mnist', {}, 'Dense_0'), ('resnet18', {'width_mult': 1 / 16}, 'Dense_0')],
)
def test_the_scaler_multiplies_every_hidden_conv_and_dense_map_but_the_output_layer(
  name, kw, output_layer
):
  """The reference's Scaler divides the output of every hidden convolution and linear map by the
  rate (`Scaler` after each `nn.Conv2d` / `nn.Linear` of its conv and resnet models), folded into
  their kernels and biases: convolutions at any depth (ResNet's in its blocks) scale, BatchNorm
  and the output layer do not."""
  _, model = _init(name, **kw)
  scaled = scale_hidden_layers(model.params, 3.0, output_layer)
  leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
  got = dict(
    zip(
      ['/'.join(str(k.key) for k in path) for path, _ in leaves],
      jax.tree.leaves(scaled),
    )
  )
  conv_leaves = 0
  for path, leaf in leaves:
    names = [str(k.key) for k in path]
    module, param = names[-2], names[-1]
    linear = module.split('_')[0] in ('Conv', 'Dense') and param in ('kernel', 'bias')
    factor = 3.0 if linear and names[0] != output_layer else 1.0
    conv_leaves += module.startswith('Conv') and factor == 3.0
    np.testing.assert_array_equal(
      got['/'.join(names)], np.asarray(leaf) * factor, err_msg=str(names)
    )
  assert conv_leaves >= (2 if name == 'cnn_mnist' else 17)


def test_every_rate_gets_its_submodel_accuracy_when_two_client_specs_share_one():
  """Two client specs at rate 1 before one at 0.5: the sub-model accuracies skip the repeated
  rate and still score the one after it."""
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{'client_models': 'mlp;mlp:width_mult=1.0;mlp:width_mult=0.5', 'partition.num_clients': 3},
  )
  algorithm = driver.build_algorithm('heterofl', config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  assert aux.rates == [1.0, 1.0, 0.5]
  ds = ctx.dataset
  got = algorithm._submodel_accuracies(aux, algorithm.init(ctx, aux), ds.test_x, ds.test_y)
  assert sorted(got) == ['0.5', '1']


def test_setup_draws_the_global_model_from_the_first_model_init_key():
  config = fedtsa_digits.get_config('smoke')
  algorithm = driver.build_algorithm('heterofl', config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  want = engine.init_model(
    get_model('mlp', 10, SHAPE), SHAPE, ctx.derive_key(Purpose.MODEL_INIT, 0)
  )
  jax.tree.map(np.testing.assert_array_equal, aux.init, want)


def test_static_batchnorm_off_validates_uploads_with_their_running_statistics():
  """With `static_bn=False` a client's upload keeps its BatchNorm running statistics, and the
  server checks it against a template that has them (ResNet-18 sub-models; no training)."""
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{
      'model': 'resnet18:width_mult=0.0625',
      'client_models': 'resnet18:width_mult=0.0625;resnet18:width_mult=0.03125',
      'partition.num_clients': 2,
      'heterofl.static_bn': False,
    },
  )
  algorithm = driver.build_algorithm('heterofl', config)
  aux = algorithm.setup(driver.context_of_config(config))
  assert all(t.batch_stats for t in aux.templates)
  models = [engine.replicate(t, len(g.client_ids)) for t, g in zip(aux.templates, aux.groups)]
  total = algorithm._receive(aux, models, [np.ones(len(g.client_ids)) for g in aux.groups])
  assert total == sum(
    serialized_nbytes(t) * len(g.client_ids) for t, g in zip(aux.templates, aux.groups)
  )


def test_a_participants_non_finite_upload_is_refused_by_client_id_and_a_sitting_out_one_unread():
  config = override(fedtsa_digits.get_config('smoke'), **{'partition.num_clients': 4})
  algorithm = driver.build_algorithm('heterofl', config)
  aux = algorithm.setup(driver.context_of_config(config))
  g = aux.groups[-1]
  assert len(g.client_ids) == 2
  models = [engine.replicate(t, len(grp.client_ids)) for t, grp in zip(aux.templates, aux.groups)]
  poisoned = jax.tree.map(lambda a: a.at[1].set(jnp.nan), models[-1])  # the group's 2nd client
  models[-1] = poisoned
  weights = [np.ones(len(grp.client_ids)) for grp in aux.groups]
  weights[-1] = np.array([1.0, 0.0])  # it sits the round out: its model is not read
  algorithm._receive(aux, models, weights)
  weights[-1] = np.array([1.0, 1.0])
  with pytest.raises(UploadError, match=rf'\bclient {int(g.client_ids[1])}\b'):
    algorithm._receive(aux, models, weights)


def _no_training_metrics(groups):
  """Zero loss and accuracy for every client of `groups`: what a fake local training returns."""
  return [
    engine.TrainMetrics(np.zeros((len(g.client_ids), 1)), np.zeros((len(g.client_ids), 1)))
    for g in groups
  ]


def test_without_static_batchnorm_a_round_scatter_averages_the_clients_running_statistics(
  monkeypatch,
):
  """`static_bn=False`: the new global running statistics are each entry's mean over the
  participants whose sub-model holds it (the old value where none does), like the parameters.
  Local training is replaced by random statistics (ResNet-18 at widths 1/16 and 1/32; three
  clients, one sitting out)."""
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{
      'model': 'resnet18:width_mult=0.0625',
      'client_models': 'resnet18:width_mult=0.0625;resnet18:width_mult=0.03125',
      'partition.num_clients': 3,
      'heterofl.static_bn': False,
      'heterofl.participation': 0.67,
      'heterofl.eval_submodels': False,
    },
  )
  algorithm = driver.build_algorithm('heterofl', config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  rng = np.random.default_rng(3)
  uploads = []

  def trained(trainers, groups, starts, epochs, key, label='', **kwargs):
    models = [
      s._replace(
        batch_stats=jax.tree.map(lambda a: rng.random(a.shape, np.float32) + 1, s.batch_stats)
      )
      for s in starts
    ]
    uploads.append([(g, m) for g, m in zip(groups, models)])
    return models, _no_training_metrics(groups)

  monkeypatch.setattr(common, 'train_groups', trained)
  state = algorithm.init(ctx, aux)
  state = state._replace(batch_stats=jax.tree.map(lambda a: a + 0.5, state.batch_stats))
  new, _ = algorithm.step(ctx, aux, state, 0)
  (round_uploads,) = uploads
  participants = [np.asarray(g.fed.sizes) > 0 for g, _ in round_uploads]
  assert 0 < sum(int(p.sum()) for p in participants) < 3
  old_leaves, treedef = jax.tree_util.tree_flatten(state.batch_stats)
  want = []
  for i, old in enumerate(old_leaves):
    old = np.asarray(old, np.float64)
    total, count = np.zeros_like(old), np.zeros_like(old)
    for (g, m), took_part in zip(round_uploads, participants):
      for j in np.flatnonzero(took_part):
        leaf = np.asarray(jax.tree.leaves(m.batch_stats)[i][j], np.float64)
        corner = tuple(slice(0, n) for n in leaf.shape)
        total[corner] += leaf
        count[corner] += 1
    want.append(np.where(count > 0, total / np.maximum(count, 1), old))
  got = jax.tree.leaves(new.batch_stats)
  assert len(got) == len(want) > 10
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_static_batchnorm_statistics_are_the_mean_over_batches_of_the_batch_input_statistics():
  module, model = _init('cnn_mnist')
  x = np.random.default_rng(0).random((48, *SHAPE), dtype=np.float32)
  stats = engine.BatchNormStatistics(module, 16)(model, x)
  sown = []
  # jitted: run op by op, the CNN's forward compiled ~40 one-primitive programs
  apply = jax.jit(lambda v, x: module.apply(v, x, train=True, mutable=['bn_inputs', 'batch_stats']))
  for b in range(3):  # the BN layers sow their input's mean and biased variance
    _, upd = apply(model.variables(), x[16 * b : 16 * (b + 1)])
    sown.append(upd['bn_inputs'])
  for layer in ('BatchNorm_0', 'BatchNorm_1'):
    mean = np.mean([s[layer]['stats'][0][0] for s in sown], axis=0)
    var = np.mean([s[layer]['stats'][0][1] for s in sown], axis=0)
    np.testing.assert_allclose(stats[layer]['bn']['mean'], mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats[layer]['bn']['var'], var, rtol=1e-4, atol=1e-5)


def test_rates_come_from_the_client_specs_and_bad_ones_are_refused():
  assert client_rates(
    'resnet18:width_mult=0.5', ['resnet18:width_mult=0.25', 'resnet18:width_mult=0.5']
  ) == {
    'resnet18:width_mult=0.25': 0.5,
    'resnet18:width_mult=0.5': 1.0,
  }
  assert client_rates('mlp', ['mlp', 'mlp:width_mult=0.5']) == {
    'mlp': 1.0,
    'mlp:width_mult=0.5': 0.5,
  }
  with pytest.raises(
    ConfigError,
    match=r'^heterofl needs a width-scalable global model \(resnet18, mlp\); config.model is '
    r"'cnn_mnist'$",
  ):
    client_rates('cnn_mnist', ['cnn_mnist'])
  with pytest.raises(ConfigError, match='wider than the global'):
    client_rates('resnet18:width_mult=0.25', ['resnet18:width_mult=0.5'])
  with pytest.raises(ConfigError, match='at another width_mult'):
    client_rates('resnet18', ['mlp'])
  config = override(fedtsa_digits.get_config('smoke'), **{'heterofl.participation': 0.0})
  with pytest.raises(ConfigError, match=r'heterofl.participation must be in \(0, 1\]'):
    driver.build_algorithm('heterofl', config)


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'heterofl.rounds': 0}, r'^heterofl\.rounds must be positive, got 0$'),
    ({'heterofl.grad_clip': -1.0}, r'^heterofl\.grad_clip must be >= 0, got -1\.0$'),
    # the client specs are checked when the run is built, before any data is read
    ({'client_models': 'mlp;mlp:width_mult=2.0'}, 'is wider than the global model'),
    ({'client_models': 'mlp:width_mult=0.5;resnet18'}, "client model 'resnet18' must be"),
  ],
)
def test_heterofl_refusals_name_the_section_and_bad_client_models_are_refused_when_built(
  overrides, message
):
  with pytest.raises(ConfigError, match=message):
    driver.build_algorithm('heterofl', override(fedtsa_digits.get_config('smoke'), **overrides))


def test_a_heterofl_clients_step_trains_with_masked_batchnorm_and_its_dropout_key():
  """HeteroFL's local objective (any zoo model) is a training pass: BatchNorm on the real rows'
  statistics (padded rows masked out) and dropout from the step's key; CE over the real rows of
  the logits with the classes the client lacks set to 0 (the reference's masked_fill)."""
  module, model = _init('cnn_mnist')
  # running statistics away from their init, so that a lost batch_stats collection shows
  model = model._replace(batch_stats=jax.tree.map(lambda a: a + 0.3, model.batch_stats))
  x = np.random.default_rng(5).random((6, *SHAPE), dtype=np.float32)
  y = np.array([0, 1, 1, 2, 3, 3], np.int32)
  weights = np.array([1, 1, 1, 1, 0, 0], np.float32)
  held = np.array([1, 1, 1, 0] + [0] * 6, np.float32)  # class 3 only in the padding
  objective = jax.jit(masked_classification_objective, static_argnums=0)
  loss, (_, _, count, stats) = objective(
    module, model.params, model.batch_stats, x, y, weights, jax.random.PRNGKey(0), held
  )
  logits, updates = module.apply(model.variables(), x[:4], train=True, mutable=['batch_stats'])
  masked = np.where(held > 0, np.asarray(logits, np.float64), 0.0)
  np.testing.assert_allclose(loss, onp.cross_entropy(masked, y[:4]), rtol=1e-5)
  assert count == 4
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    stats,
    updates['batch_stats'],
  )
  losses, logits = dropout_losses_and_logits(objective, x, y, weights, np.ones(10, np.float32))
  np.testing.assert_allclose(losses[0], onp.cross_entropy(logits, y[:4]), rtol=1e-5)
  assert losses[0] != losses[1]


def _sown_batch_statistics(module, params, x, batch):
  """{BN layer path: (mean, biased var)} of each BN layer's input in a train-mode pass over `x`
  in batches of `batch`, averaged over the batches: PyTorch's momentum=None running statistics
  (HeteroFL's `stats`), from the statistics the layers sow."""
  zeros = jax.tree.map(
    lambda s: jnp.zeros(s.shape, s.dtype), model_shapes(module, SHAPE).batch_stats
  )
  apply = jax.jit(
    lambda p, xb: module.apply(
      {'params': p, 'batch_stats': zeros}, xb, train=True, mutable=['bn_inputs', 'batch_stats']
    )
  )
  sums = {}
  starts = range(0, len(x), batch)
  for start in starts:
    _, sown = apply(params, x[start : start + batch])
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown['bn_inputs'])[0]:
      layer = tuple(str(getattr(k, 'key', k)) for k in path[:-3])  # drop 'stats', 0, (mean|var)
      which = int(getattr(path[-1], 'idx', 0))
      sums.setdefault(layer, [0.0, 0.0])[which] += np.asarray(leaf, np.float64) / len(starts)
  return sums


def test_static_batchnorm_of_a_round_comes_from_the_new_global_model_on_every_clients_images(
  monkeypatch,
):
  """A ResNet-18 round (global width 1/16, clients at rates 1 and 0.5): the global model's
  evaluation statistics are those of a train-mode pass of its *new* parameters over all the
  clients' training images, client by client; each rate's sub-model gets its own. Local
  training is replaced by random parameter moves (compiling two ResNet-18 client steps was
  most of this test's time): the new parameters differ from the old ones all the same."""
  d = load_dataset('digits')
  ds = Dataset('digits', d.train_x[:48], d.train_y[:48], d.test_x[:40], d.test_y[:40], 10)
  parts = [np.arange(24, 48), np.arange(0, 24)]  # client 0 holds the later images
  config = override(
    fedtsa_digits.get_config('smoke'),
    **{
      'model': 'resnet18:width_mult=0.0625',
      'client_models': 'resnet18:width_mult=0.0625;resnet18:width_mult=0.03125',
      'partition.num_clients': 2,
      'dataset.holdout_size': 0,
      'batch_size': 16,
      'heterofl.rounds': 1,
      'heterofl.local_epochs': 1,
      'heterofl.participation': 1.0,
    },
  )
  algorithm = driver.build_algorithm('heterofl', config)
  ctx = driver.make_context(config, ds, parts)
  aux = algorithm.setup(ctx)
  rng = np.random.default_rng(5)

  def trained(trainers, groups, starts, epochs, key, label='', **kwargs):
    move = lambda a: a + rng.normal(0, 0.1, a.shape).astype(np.float32)
    moved = [s._replace(params=jax.tree.map(move, s.params)) for s in starts]
    return moved, _no_training_metrics(groups)

  monkeypatch.setattr(common, 'train_groups', trained)
  state = algorithm.init(ctx, aux)
  new, (record,) = algorithm.step(ctx, aux, state, 0)
  assert not np.allclose(jax.tree.leaves(new.params)[0], jax.tree.leaves(state.params)[0])
  images = np.concatenate([ds.train_x[p] for p in parts])
  want = _sown_batch_statistics(
    get_model('resnet18', 10, SHAPE, width_mult=0.0625), new.params, images, 16
  )
  got = {
    tuple(str(getattr(k, 'key', k)) for k in path[:-2]): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(new.batch_stats)[0]
    if str(getattr(path[-1], 'key', '')) == 'mean'
  }
  assert set(got) == set(want) and len(want) > 10
  for layer, (mean, var) in want.items():
    np.testing.assert_allclose(got[layer], mean, rtol=1e-4, atol=1e-5, err_msg=str(layer))
    bn = new.batch_stats
    for name in layer:
      bn = bn[name]
    np.testing.assert_allclose(bn['bn']['var'], var, rtol=1e-4, atol=1e-5, err_msg=str(layer))
  # the rate-0.5 sub-model: the leading corner of the new parameters, its own statistics
  half = get_model('resnet18', 10, SHAPE, width_mult=0.03125)
  shapes = model_shapes(half, SHAPE)
  sub = submodels.slice_tree(new, shapes)
  stats = _sown_batch_statistics(half, sub.params, images, 16)
  batch_stats = {}
  for layer, (mean, var) in stats.items():
    node = batch_stats
    for name in layer:
      node = node.setdefault(name, {})
    node['bn'] = {'mean': jnp.asarray(mean, jnp.float32), 'var': jnp.asarray(var, jnp.float32)}
  sub = engine.ModelState(sub.params, batch_stats)
  acc = engine.Evaluator(half, 16).accuracy(sub, ds.test_x, ds.test_y)
  assert record['submodel_test_accuracy']['0.5'] == pytest.approx(acc, abs=1e-9)
  full = engine.Evaluator(get_model('resnet18', 10, SHAPE, width_mult=0.0625), 16)
  assert record['test_accuracy'] == pytest.approx(full.accuracy(new, ds.test_x, ds.test_y))


@pytest.mark.slow
def test_heterofl_learns_on_digits():
  """ResNet-18 at rates 1 and 0.5 of width 0.25; 4 rounds of 2 local epochs."""
  config = override(
    fedtsa_digits.get_config(''),
    **{
      'client_models': 'resnet18:width_mult=0.25;resnet18:width_mult=0.125',
      'heterofl.rounds': 4,
    },
  )
  summary = driver.run_in_memory('heterofl', config)
  print('heterofl', summary.final_test_accuracy, summary['submodel_test_accuracy'])
  assert summary.final_test_accuracy > 0.6  # chance is 0.1
  assert summary['submodel_test_accuracy']['0.5'] > 0.5
  assert summary['client_rates'] == [1.0, 0.5, 1.0, 0.5, 1.0]
