"""The shared helpers of jfed.methods.common that the oracle tests reach at one setting only,
or not at all, each against a computation written here (NumPy forward passes of
tests/oracle_numpy.py on tests/test_oracle_fedavg.py's tiny digits problem): client sampling's
refusals; a round's participating group (rows, order, padding) and a sitting-out client's size;
what a FedAvg round hands its server and records, and what it does with a client whose
training diverges; the server under an attack with a client sitting out and declared sizes;
one trainer per architecture, and trainers shared by a sweep's runs; test accuracy and every
client's own probabilities and accuracy by global client id."""

import pathlib
import sys
import types
from unittest import mock

import flax.serialization
import jax
import numpy as np
import optax
import pytest

from jfed import driver, engine
from jfed.configs import fedmho_digits
from jfed.data import load_dataset
from jfed.data.datasets import Dataset
from jfed.data.federated import FederatedArrays
from jfed.driver import make_context
from jfed.engine import compiles, optim
from jfed.errors import ConfigError, JfedError, NonFiniteError
from jfed.io import UploadError
from jfed.keys import Purpose
from jfed.methods import common, generative
from tests import oracle_numpy as onp
from tests.support import Terminal, comparable_summary, override, smoke_config
from tests.test_oracle_fedavg import (
  HETERO,
  HETERO_SIZES,
  NARROW,
  SIZES,
  WIDE,
  _config,
  _context,
  _dataset,
  _parts,
  _run,
)


def _msgpack_bytes(state, client=None) -> int:
  """Bytes of `state` (a ModelState, or client `client` of a stacked one) as flax's msgpack
  serialises its NumPy state dict: what an upload or a download of it costs."""
  if client is not None:
    state = jax.tree.map(lambda a: a[client], state)
  tree = flax.serialization.to_state_dict(jax.tree.map(np.asarray, state))
  return len(flax.serialization.msgpack_serialize(tree))


@pytest.mark.parametrize(
  'spec, name, kwargs',
  [
    ('mlp', 'mlp', {}),
    (' resnet18: width_mult =0.5,depth=2 ', 'resnet18', {'width_mult': 0.5, 'depth': 2}),
    ('cvae:size=small, latent = 20,', 'cvae', {'size': 'small', 'latent': 20}),
    (
      'vgg9:fc_width=512,width_mult=1e-1,conv_impl= matmul ',
      'vgg9',
      {'fc_width': 512, 'width_mult': 0.1, 'conv_impl': 'matmul'},
    ),
    ('cnn_mnist:', 'cnn_mnist', {}),
  ],
)
def test_a_model_spec_is_a_name_and_typed_keyword_values(spec, name, kwargs):
  got_name, got = common.parse_model_spec(spec)
  assert got_name == name and got == kwargs
  assert [type(v) for v in got.values()] == [type(v) for v in kwargs.values()]


@pytest.mark.parametrize('spec', ['mlp:width_mult', 'resnet18:width_mult=0.5,depth'])
def test_a_model_spec_without_a_value_is_refused_naming_it(spec):
  with pytest.raises(ValueError) as refused:
    common.parse_model_spec(spec)
  assert str(refused.value) == f'Malformed model spec {spec!r}: expected name:key=value,...'


def test_client_model_specs_cycle_the_list_over_the_clients_and_default_to_the_model():
  def federation(client_models, n=5, model=NARROW):
    config = _config(n, model=model, client_models=client_models)
    return _context(config, [6] * n).federation

  assert federation('').specs == (NARROW,) * 5 == federation(' ; ').specs
  cycled = federation(f' {WIDE} ;{NARROW};')
  assert cycled.specs == (WIDE, NARROW, WIDE, NARROW, WIDE)
  assert cycled.architectures == (WIDE, NARROW)  # first appearance: the groups' order
  assert federation(f'{NARROW};{WIDE};{NARROW}').architectures == (NARROW, WIDE)
  ctx = _context(_config(3, client_models=f'{WIDE};{NARROW}'), [6] * 3)
  with pytest.raises(ConfigError) as refused:
    common.single_architecture(ctx)
  assert str(refused.value) == (
    f"Parameter averaging needs one architecture; clients use ['{NARROW}', '{WIDE}']"
  )
  assert common.single_architecture(_context(_config(3), [6] * 3)) == NARROW
  module = common.build_module(WIDE, _dataset())
  assert module.hidden == (20, 20) and module.num_classes == 10


@pytest.mark.parametrize('participation', [0.0, -0.1, 1.01, 1.5, 2.0])
def test_client_sampling_refuses_a_participation_outside_zero_to_one(participation):
  with pytest.raises(
    ConfigError, match=rf'^participation must be in \(0, 1\], got {participation}$'
  ):
    common.select_clients(jax.random.key(0), 10, participation)


@pytest.mark.parametrize('participation, count', [(0.01, 1), (0.3, 3), (1.0, 10)])
def test_client_sampling_draws_round_pn_distinct_sorted_clients(participation, count):
  got = common.select_clients(jax.random.key(3), 10, participation)
  assert len(got) == count == len(set(got.tolist()))
  assert np.all(np.diff(got) > 0) and 0 <= got.min() and got.max() < 10


def test_client_groups_follow_the_ids_given_by_architecture_and_flip_only_the_attackers_labels():
  """Clients 0, 2 narrow and 1, 3 wide; asked for [3, 2, 1], the wide group comes first (3's
  architecture), each keeps the order given, and under a label-flipping attack on client 1 only
  its real labels become C - 1 - y."""
  config = _config(4, **HETERO, **{'attack.kind': 'label_flip', 'attack.clients': '1'})
  ctx = _context(config, HETERO_SIZES)
  groups = common.client_groups(ctx, [3, 2, 1])
  assert [(g.spec, g.client_ids.tolist()) for g in groups] == [(WIDE, [3, 1]), (NARROW, [2])]
  assert groups[0].module.hidden == (20, 20) and groups[1].module.hidden == (10, 10)
  y = _dataset().train_y
  parts = _parts(HETERO_SIZES)
  for g in groups:
    for row, k in enumerate(g.client_ids):
      n = HETERO_SIZES[k]
      want = 9 - y[parts[k]] if k == 1 else y[parts[k]]
      np.testing.assert_array_equal(np.asarray(g.fed.y)[row, :n], want)
      np.testing.assert_array_equal(np.asarray(g.fed.x)[row, :n], _dataset().train_x[parts[k]])
      assert int(g.fed.sizes[row]) == n
  plain = common.client_groups(_context(_config(4, **HETERO), HETERO_SIZES))
  assert [g.client_ids.tolist() for g in plain] == [[0, 2], [1, 3]]
  np.testing.assert_array_equal(np.asarray(plain[1].fed.y)[0, : HETERO_SIZES[1]], y[parts[1]])
  # a model-poisoning attacker trains on its true labels
  config = _config(4, **HETERO, **{'attack.kind': 'sign_flip', 'attack.clients': '1'})
  poisoning = common.client_groups(_context(config, HETERO_SIZES))
  np.testing.assert_array_equal(np.asarray(poisoning[1].fed.y)[0, : HETERO_SIZES[1]], y[parts[1]])


def test_every_client_of_an_architecture_starts_from_its_one_model_whichever_clients_are_asked():
  """An architecture's initial model is drawn from MODEL_INIT and its place among all the run's
  architectures (jfed.keys), so the wide clients start alike alone or with the narrow ones."""
  ctx = _context(_config(4, **HETERO), HETERO_SIZES)
  both = common.init_group_models(ctx, common.client_groups(ctx))
  (wide,) = common.init_group_models(ctx, common.client_groups(ctx, [3, 1]))
  for models, index, module, count in (
    (both[0], 0, NARROW, 2),
    (both[1], 1, WIDE, 2),
    (wide, 1, WIDE, 2),
  ):
    variables = common.build_module(module, ctx.dataset).init(
      ctx.derive_key(Purpose.MODEL_INIT, index), np.zeros((1, 8, 8, 1), np.float32), train=False
    )
    for k in range(count):
      onp.assert_tree_close(
        onp.to_numpy(onp.take_client(models.params, k)),
        onp.to_numpy(variables['params']),
        rtol=1e-6,
        atol=1e-7,  # jitted init against flax's eager one: a last bit
      )
  assert jax.tree.leaves(both[1].params)[0].shape[0] == 2


def test_a_groups_trainer_maps_its_clients_as_the_run_says_and_over_its_devices():
  ctx = _context(_config(4, strategy='scan', shard=True), [6] * 4)
  (group,) = common.client_groups(ctx)
  assert ctx.mesh is not None  # the suite's four fake CPU devices
  trainer = common.group_trainer(ctx, group.module, engine.OptimizerSpec('sgd', 0.1), 8)
  assert (trainer.strategy, trainer.mesh) == ('scan', ctx.mesh)


def test_local_models_train_with_the_trainers_given_and_count_every_upload(monkeypatch):
  """A method's own trainers (built in its setup) train the local models, as the ones built
  here would; none are built; the bytes are every client's serialised upload."""
  config = _config(4, **HETERO)
  ctx = _context(config, HETERO_SIZES)
  trainers = common.client_trainers(ctx)
  built = common.make_trainers
  monkeypatch.setattr(common, 'make_trainers', None)
  terminal = Terminal()
  with mock.patch.object(sys, 'stderr', terminal):
    local = common.local_models(ctx, 1, trainers=trainers)
  assert any(l.startswith(f'local training [{WIDE} x2] 1/1 epochs') for l in terminal.lines())
  monkeypatch.setattr(common, 'make_trainers', built)
  again = common.local_models(_context(config, HETERO_SIZES), 1)
  for a, b in zip(local.models, again.models):
    onp.assert_tree_close(onp.to_numpy(a.params), onp.to_numpy(b.params), rtol=0, atol=0)
  assert local.upload_bytes == sum(2 * _msgpack_bytes(m, 0) for m in local.models)
  assert [g.client_ids.tolist() for g in local.groups] == [[0, 2], [1, 3]]


def test_a_rounds_group_keeps_the_selected_rows_in_order_padded_to_whole_batches_of_the_largest():
  """5 clients of one architecture with up to 7 samples, batch 3: a round of clients 1 and 4
  keeps their rows (x, y, sizes) in the group's order, and pads the sample axis to 9 (whole
  batches of the largest client of the full group), whoever takes part; the client axis is not
  padded."""
  rng = np.random.default_rng(0)
  m, n_max, b = 5, 7, 3
  sizes = np.array([7, 2, 5, 3, 6], np.int32)
  x = rng.random((m, n_max, 4, 4, 1)).astype(np.float32)
  y = rng.integers(0, 10, (m, n_max)).astype(np.int32)
  ids = np.array([3, 1, 4, 0, 2])  # global ids in the group's order
  full = common.ClientGroup('mlp', None, ids, FederatedArrays(x, y, sizes))
  ctx = types.SimpleNamespace(run=types.SimpleNamespace(batch_size=b))

  got = common.participating_group(ctx, full, np.array([1, 4]))

  rows = [1, 2]  # where global ids 1 and 4 sit in the group
  want_x = np.zeros((2, 9, 4, 4, 1), np.float32)
  want_y = np.zeros((2, 9), np.int32)
  for i, r in enumerate(rows):
    want_x[i, :n_max], want_y[i, :n_max] = x[r], y[r]
  np.testing.assert_array_equal(got.client_ids, [1, 4])
  np.testing.assert_array_equal(got.fed.x, want_x)
  np.testing.assert_array_equal(got.fed.y, want_y)
  np.testing.assert_array_equal(got.fed.sizes, sizes[rows])
  assert got.spec == 'mlp'
  # every client taking part: the full group itself
  assert common.participating_group(ctx, full, np.arange(5)) is full


def _digits_with_nan_images(*clients: int):
  """The oracle tests' tiny digits problem with every training image of `clients` made NaN, so
  that their local training loss turns non-finite in the first step."""
  d = _dataset()
  x = np.array(d.train_x, np.float32)
  for k in clients:
    x[_parts(SIZES)[k]] = np.nan
  return Dataset(d.name, x, d.train_y, d.test_x, d.test_y, d.num_classes)


def _run_fedavg(config, dataset):
  """(summary, every step's records in order) of FedAvg on `dataset`."""
  summary, recorder, _ = _run('fedavg', config, dataset=dataset)
  return summary, [r for step in recorder.records for r in step]


def test_a_clean_round_stops_at_a_client_whose_training_diverges_naming_round_and_client():
  config = _config(3, **{'fedavg.rounds': 1})
  with pytest.raises(
    NonFiniteError,
    match=r'^round 1/1: the training loss of client\(s\) \[1\] \(mlp:width_mult=0.05\) became '
    r'non-finite; lower the learning rate or check the data$',
  ):
    _run_fedavg(config, _digits_with_nan_images(1))


class _Transport:
  """A stand-in for the Flower bridge: records what each client trainer is built from."""

  def __init__(self):
    self.calls = []

  def trainer(self, spec, tx, recipe, sizes):
    self.calls.append((spec, tx, recipe, sizes))
    return f'remote {spec}'


class _SilentClientTrainer:
  """A Flower round's trainer whose client 1 did not reply (its loss never came back: NaN)."""

  tx = optax.sgd(0.1)

  def train(self, state, fed, epochs, key, **kwargs):
    loss = np.array([[0.5], [np.nan], [0.4]])
    return state, engine.TrainMetrics(loss, np.zeros_like(loss), np.array([True, False, True]))


def test_a_client_that_did_not_reply_is_not_taken_for_one_that_diverged():
  ctx = _context(_config(3), SIZES)
  groups = common.client_groups(ctx)
  models = common.init_group_models(ctx, groups)
  (trained,), _ = common.train_groups([_SilentClientTrainer()], groups, models, 1, None)
  assert trained is not None


def test_trainers_on_a_client_transport_are_built_from_the_recipe_once_per_architecture():
  ctx = _context(_config(4, **HETERO), HETERO_SIZES)
  groups = common.client_groups(ctx)
  ctx.client_transport = _Transport()
  spec = engine.OptimizerSpec('sgd', 0.2, momentum=0.5, schedule='cosine')
  got = common.make_trainers(ctx, groups[:1] + groups, prox_mu=0.03, optimizer=spec, total_steps=9)
  assert got == [f'remote {NARROW}', f'remote {NARROW}', f'remote {WIDE}']
  assert [c[0] for c in ctx.client_transport.calls] == [NARROW, WIDE]
  for _, tx, recipe, sizes in ctx.client_transport.calls:
    assert recipe == {
      'kind': 'classifier',
      'prox_mu': 0.03,
      'optimizer': spec._asdict(),
      'optimizer_steps': 9,
    }
    np.testing.assert_array_equal(sizes, HETERO_SIZES)
    state = tx.init({'w': np.zeros(2, np.float32)})
    assert float(optim.learning_rate_of(state)) == pytest.approx(0.2)  # step 0 of the cosine
  section = {'name': 'adam', 'lr': 0.004}  # a config section, as the bridge's recipe carries
  ctx.client_transport = _Transport()
  common.make_trainers(ctx, groups[:1], optimizer=section)
  assert (
    ctx.client_transport.calls[0][2]['optimizer'] == engine.OptimizerSpec('adam', 0.004)._asdict()
  )


def test_train_groups_names_only_clients_with_data_whose_loss_is_not_finite():
  """Client 1 holds no samples (no loss to speak of), client 2's one image is NaN: 'raise' names
  client 2 under the caller's label; 'warn' returns every model, client 2's not finite."""
  d = _dataset()
  parts = _parts((23, 0, 1))
  x = np.array(d.train_x, np.float32)
  x[parts[2]] = np.nan
  nan = Dataset(d.name, x, d.train_y, d.test_x, d.test_y, d.num_classes)
  ctx = make_context(_config(3), nan, parts)
  groups = common.client_groups(ctx)
  trainers = common.make_trainers(ctx, groups)
  models = common.init_group_models(ctx, groups)
  key = jax.random.PRNGKey(0)
  message = (
    r'^pretraining: the training loss of client\(s\) \[2\] \(mlp:width_mult=0.05\) became '
    r'non-finite; lower the learning rate or check the data$'
  )
  terminal = Terminal()
  with pytest.raises(NonFiniteError, match=message), mock.patch.object(sys, 'stderr', terminal):
    common.train_groups(trainers, groups, models, 1, key, label='pretraining')
  lines = terminal.lines()
  assert any(
    l.startswith('pretraining [mlp:width_mult=0.05 x3] 1/1 epochs') and 'epoch/s' in l
    for l in lines
  ), lines
  (trained,), (metrics,) = common.train_groups(
    trainers, groups, models, 1, key, label='pretraining', diverged='warn'
  )
  finite = [
    bool(np.all(np.isfinite(onp.take_client(trained.params, k)['Dense_0']['kernel'])))
    for k in range(3)
  ]
  assert finite == [True, True, False]
  assert np.asarray(metrics.loss).shape[0] == 3


def test_under_an_attack_an_honest_client_whose_training_diverges_is_rejected_not_fatal():
  """A poisoned global model can make honest training diverge: under a simulated attack that
  client's upload is rejected (logged), and the round aggregates the others."""
  config = _config(3, **{'fedavg.rounds': 1, 'attack.kind': 'sign_flip', 'attack.clients': '2'})
  summary, (record,) = _run_fedavg(config, _digits_with_nan_images(1))
  assert record['rejected_clients'] == [1] and record['rejected_uploads'] == 1
  assert np.isfinite(record['train_loss']) and np.isfinite(summary['final_test_accuracy'])


def test_a_round_whose_every_upload_is_rejected_records_no_training_loss():
  config = _config(
    3,
    **{
      'fedavg.rounds': 1,
      'attack.kind': 'sign_flip',
      'attack.clients': '2',
      'server.allow_empty_rounds': True,
    },
  )
  _, (record,) = _run_fedavg(config, _digits_with_nan_images(0, 1, 2))
  assert record['rejected_clients'] == [0, 1, 2] and record['train_loss'] is None


class _ReceivingServer:
  """A server that records what a round hands it and keeps the global model."""

  attack = types.SimpleNamespace(kind='none')

  def __init__(self):
    self.calls = []

  def receive(self, group, stacked, reference, template, step, weights=None, **kwargs):
    self.calls.append(dict(group=group, stacked=stacked, step=step, weights=weights, **kwargs))
    return reference, {'upload_bytes': 7, 'rejected_uploads': 0}


def test_a_fedavg_round_hands_the_server_its_weights_sizes_and_every_reply_and_counts_downloads():
  """What `fedavg_round` forwards (DynaFed's uniform weights, HFLDD's declared sizes) and what its
  record adds: every client's download of the global model, the mean of the clients' last
  training losses, no dropped clients in a round where every client replied."""
  config = _config(3)
  ctx = _context(config, SIZES)
  (group,) = common.client_groups(ctx)
  (trainer,) = common.make_trainers(ctx, [group])
  (model,) = common.init_group_models(ctx, [group])
  global_model = jax.tree.map(lambda a: a[0], model)
  server = _ReceivingServer()
  weights, declared = np.array([1.0, 2.0, 3.0]), np.array([5, 6, 7])
  _, record = common.fedavg_round(
    common.RoundParts(trainer, 1, global_model, server),
    group,
    global_model,
    jax.random.key(0),
    4,
    common.RoundOptions(weights=weights, declared_sizes=declared),
  )
  (call,) = server.calls
  assert call['group'] is group and call['step'] == 4
  np.testing.assert_array_equal(call['weights'], weights)
  np.testing.assert_array_equal(call['declared_sizes'], declared)
  np.testing.assert_array_equal(call['taking_part'], [True, True, True])
  # the three clients trained from the global model and uploaded different models
  leaves = jax.tree.leaves(call['stacked'].params)
  assert all(a.shape[0] == 3 for a in leaves)
  assert not np.allclose(leaves[0][0], leaves[0][1])
  assert record['download_bytes'] == 3 * _msgpack_bytes(global_model)
  assert (
    record['clients'] == 3 and record['upload_bytes'] == 7 and np.isfinite(record['train_loss'])
  )
  assert 'dropped_clients' not in record


def test_the_runs_client_trainers_are_one_per_architecture_each_with_its_own_model():
  config = _config(4, **HETERO)
  ctx = _context(config, HETERO_SIZES)
  trainers = common.client_trainers(ctx)
  assert list(trainers) == [NARROW, WIDE]
  for spec, trainer in trainers.items():
    assert trainer.module == common.build_module(spec, ctx.dataset)
  assert trainers[NARROW] is not trainers[WIDE]


def _random_local_models(ctx, seed: int) -> common.LocalModels:
  """Every client's model with its own random parameters (so that no two score alike), by
  architecture group; clients 0, 2 narrow and 1, 3 wide under HETERO."""
  groups = common.client_groups(ctx)
  models = []
  for g in groups:
    stacked = [
      engine.init_model(g.module, ctx.dataset.input_shape, jax.random.key(seed * 100 + int(k)))
      for k in g.client_ids
    ]
    models.append(jax.tree.map(lambda *a: np.stack(a), *stacked))
  return common.LocalModels(groups, models, 0)


def test_a_models_test_accuracy_scores_the_whole_test_split():
  config = _config(3)
  ctx = _context(config, SIZES)
  module = common.build_module(NARROW, ctx.dataset)
  model = engine.init_model(module, ctx.dataset.input_shape, jax.random.key(5))
  want = onp.accuracy(
    onp.mlp_forward(onp.to_numpy(model.params), _dataset().test_x), ctx.dataset.test_y
  )
  assert common.test_accuracy(ctx, module, model) == pytest.approx(want, abs=1e-9)
  evaluator = engine.Evaluator(module, 7, 'loop')
  assert common.test_accuracy(ctx, module, model, evaluator) == pytest.approx(want, abs=1e-9)


def test_client_probabilities_and_accuracies_are_each_clients_own_model_by_global_id():
  config = _config(4, **HETERO)
  ctx = _context(config, HETERO_SIZES)
  local = _random_local_models(ctx, 1)
  x = _dataset().train_x[:9]
  probs = common.client_probabilities(ctx, local, x)
  accs = common.client_accuracies(ctx, local)
  assert probs.shape == (4, 9, 10) and probs.dtype == np.float32
  for g, models in zip(local.groups, local.models):
    for i, k in enumerate(g.client_ids):
      params = onp.to_numpy(onp.take_client(models.params, i))
      np.testing.assert_allclose(
        probs[k], onp.softmax(onp.mlp_forward(params, x)), rtol=1e-4, atol=1e-6, err_msg=str(k)
      )
      want = onp.accuracy(onp.mlp_forward(params, _dataset().test_x), ctx.dataset.test_y)
      assert accs[k] == pytest.approx(want, abs=1e-9)
  assert len(set(np.round(accs, 6).tolist())) > 1


def test_a_client_sitting_out_keeps_its_rows_at_size_zero():
  sizes = np.array([7, 2, 5], np.int32)
  fed = FederatedArrays(np.ones((3, 7, 2)), np.ones((3, 7), np.int32), sizes)
  group = common.ClientGroup('mlp', None, np.array([4, 0, 2]), fed)
  got = common.sitting_out_as_size_zero(group, np.array([True, False, True]))
  assert got.fed.sizes.dtype == np.int32
  np.testing.assert_array_equal(got.fed.sizes, [7, 0, 5])
  assert got.fed.x is fed.x and got.fed.y is fed.y and got.client_ids is group.client_ids


def test_runs_share_the_client_step_and_equal_runs_made_alone():
  """A process's runs share their clients' compiled step through jit's cache
  (`engine.ClientProgram`): three FedAvg runs at two learning rates and two seeds compile it once
  and give what each gives in a fresh process (caches cleared); another momentum is another
  program."""
  configs = [
    _config(3, **{'fedavg.rounds': 2}),
    _config(3, **{'fedavg.rounds': 2, 'optimizer.lr': 0.03}),
    _config(3, **{'fedavg.rounds': 2, 'optimizer.lr': 0.03, 'seed': 1}),
  ]
  alone = []
  for c in configs:
    jax.clear_caches()
    alone.append(_run_fedavg(c, _dataset()))
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    shared = [_run_fedavg(c, _dataset()) for c in configs]
  assert compiled.counts()['jit(_loop_client_step)'] == 1, compiled.summary()
  for (summary_a, records_a), (summary_s, records_s) in zip(alone, shared):
    assert records_s == records_a
    assert summary_s['final_test_accuracy'] == summary_a['final_test_accuracy']
  assert [r['train_loss'] for _, (r, _) in alone][0] != [r['train_loss'] for _, (r, _) in alone][1]
  with compiles.count_compilations() as compiled:
    _run_fedavg(_config(3, **{'fedavg.rounds': 1, 'optimizer.momentum': 0.5}), _dataset())
  assert compiled.counts()['jit(_loop_client_step)'] == 1, compiled.summary()


@pytest.mark.parametrize('method', ['fedproto', 'fedmd', 'heterofl'])
def test_a_methods_second_seed_compiles_no_client_step(method):
  """The methods that train with their own objective (FedProto's prototype loss, FedMD's digest,
  HeteroFL's masked CE per width) share their programs too: the second seed compiles no client
  step, and both seeds give what they give alone."""
  configs = [override(smoke_config(method), seed=seed) for seed in (0, 1)]
  ds = load_dataset('digits')
  jax.clear_caches()
  alone = comparable_summary(driver.run_in_memory(method, configs[1], ds))
  jax.clear_caches()
  first = driver.run_in_memory(method, configs[0], ds)
  with compiles.count_compilations() as compiled:
    second = driver.run_in_memory(method, configs[1], ds)
  assert not [n for n in compiled.names if 'client_step' in n], compiled.summary()
  assert comparable_summary(second) == alone != comparable_summary(first)


def test_cvae_trainers_of_another_seed_share_the_programs_and_carry_their_own_learning_rates():
  """FedMHO's CVAE clients (CVAE-small at its own rate): another seed's trainers have the same
  programs (equal `ClientProgram`s), each with its own group's optimiser; another loss is
  another program."""
  ds = load_dataset('digits')
  config = override(
    fedmho_digits.get_config('smoke'),
    **{'client_models': 'mlp;cvae:size=small;cvae:size=large', 'dataset.holdout_size': 0},
  )
  n = config.partition.num_clients
  parts = np.array_split(np.arange(10 * n), n)
  settings = generative.CVAESettings(1, 'adam', 1e-3, 16, 'bce', 1.0, small_lr=5e-2)
  trainers = []
  for seed in (0, 1):
    ctx = make_context(override(config, seed=seed), ds, parts)
    groups = generative.cvae_groups(ctx)
    trainers.append(generative.cvae_trainers(ctx, groups, settings))
  other = generative.cvae_trainers(ctx, groups, settings._replace(beta=2.0))
  first, second = trainers
  assert len(first) == 2 and first[0].program != first[1].program  # two sizes, two rates
  for a, b, c in zip(first, second, other):
    assert a is not b and a.program == b.program and hash(a.program) == hash(b.program)
    assert c.program != a.program
  lrs = [float(optim.learning_rate_of(t.tx.init({'w': np.zeros(2)}))) for t in second]
  assert lrs == pytest.approx([generative.group_lr(g.module, settings) for g in groups])
  assert {g.module.size for g in groups} == {'small', 'large'}


def test_trainers_share_programs_unless_module_optimiser_objective_batch_prox_or_schedule_differ():
  """Whatever shapes a trainer's programs makes its `ClientProgram` another; a constant
  learning rate does not (it lives in the optimiser state), and each trainer keeps its own."""
  ctx = _context(_config(3), SIZES)
  (group,) = common.client_groups(ctx)
  spec = engine.OptimizerSpec('sgd', 0.1, momentum=0.9)
  other = common.build_module(WIDE, ctx.dataset)
  base = common.group_trainer(ctx, group.module, spec, 8)
  variants = {
    'lr': common.group_trainer(ctx, group.module, spec._replace(lr=0.5), 8),
    'module': common.group_trainer(ctx, other, spec, 8),
    'weight decay': common.group_trainer(ctx, group.module, spec._replace(weight_decay=0.1), 8),
    'objective': common.group_trainer(
      ctx, group.module, spec, 8, objective=lambda *a: engine.classification_objective(*a)
    ),
    'batch': common.group_trainer(ctx, group.module, spec, 4),
    'prox': common.group_trainer(ctx, group.module, spec, 8, prox_mu=0.01),
    'schedule': common.group_trainer(
      ctx, group.module, spec._replace(schedule='cosine'), 8, total_steps=5
    ),
  }
  cosine_longer = common.group_trainer(
    ctx, group.module, spec._replace(schedule='cosine'), 8, total_steps=6
  )
  cosine_faster = common.group_trainer(  # a schedule's rate is in the program
    ctx, group.module, spec._replace(schedule='cosine', lr=0.5), 8, total_steps=5
  )
  assert variants['lr'].program == base.program  # the rate lives in the optimiser state
  for name, trainer in variants.items():
    if name != 'lr':
      assert trainer.program != base.program, name
  assert cosine_longer.program != variants['schedule'].program  # steps shape the rate
  assert cosine_faster.program != variants['schedule'].program
  assert variants['objective'].objective is not engine.classification_objective
  assert base.objective is engine.classification_objective
  assert (variants['batch'].batch_size, variants['prox'].prox_mu) == (4, 0.01)
  assert variants['module'].module is other and base.module is group.module
  assert (base.strategy, base.mesh) == (engine.resolve_strategy(ctx.run.strategy), ctx.mesh)
  params = {'w': np.zeros(2, np.float32)}
  lr = lambda t: float(optim.learning_rate_of(t.tx.init(params)))
  assert (lr(base), lr(variants['lr'])) == (pytest.approx(0.1), pytest.approx(0.5))


def test_a_program_whose_module_cannot_be_hashed_is_equal_only_to_itself():
  """An array among a module's fields makes it unhashable: its trainer still trains (its
  program is equal to itself alone) instead of failing jit's static-argument hash."""
  program = engine.ClientProgram([1, 2], engine.classification_objective, None, 8, 0.0)
  assert program == program and hash(program) == id(program)
  assert program != engine.ClientProgram([1, 2], engine.classification_objective, None, 8, 0.0)


def _server_round(declared_sizes=None, weights=None, taking_part=(True, True, False), **overrides):
  """Three clients' uploads (their init plus a random update each) received by the server of a
  sign-flip attack on client 1 with strength 2, client 2 sitting out: (aggregate, record, the
  global model, the uploads as NumPy trees, the clients' sizes)."""
  config = _config(
    3,
    **{'attack.kind': 'sign_flip', 'attack.clients': '1', 'attack.strength': 2.0, **overrides},
  )
  ctx = _context(config, SIZES)
  (group,) = common.client_groups(ctx)
  (models,) = common.init_group_models(ctx, [group])
  reference = jax.tree.map(lambda a: a[0], models)
  rng = np.random.default_rng(4)
  stacked = jax.tree.map(lambda a: a + rng.normal(0, 0.1, a.shape).astype(a.dtype), models)
  server = common.make_server(ctx)
  aggregate, record = server.receive(
    group,
    stacked,
    reference,
    reference,
    0,
    weights=weights,
    taking_part=np.array(taking_part),
    declared_sizes=declared_sizes,
  )
  uploads = [onp.to_numpy(onp.take_client(stacked.params, k)) for k in range(3)]
  return aggregate, record, onp.to_numpy(reference.params), uploads, np.asarray(group.fed.sizes)


def test_the_server_flips_the_attackers_upload_and_averages_the_clients_taking_part():
  aggregate, record, ref, uploads, sizes = _server_round()
  flipped = onp.tree_map(lambda r, u: r - 2.0 * (u - r), ref, uploads[1])
  want = onp.weighted_average([uploads[0], flipped], [sizes[0], sizes[1]])
  onp.assert_tree_close(onp.to_numpy(aggregate.params), want, rtol=1e-5, atol=1e-6)
  assert record['rejected_uploads'] == 0 and 'rejected_clients' not in record


def test_the_server_rejects_an_upload_claiming_more_samples_than_declared():
  sizes = np.asarray(_server_round()[4])
  aggregate, record, ref, uploads, _ = _server_round(np.array([sizes[0], 1, sizes[2]]))
  assert record['rejected_clients'] == [1] and record['rejected_uploads'] == 1
  onp.assert_tree_close(onp.to_numpy(aggregate.params), uploads[0], rtol=1e-5, atol=1e-6)


def test_the_server_averages_with_the_weights_it_is_given_and_counts_the_bytes_received():
  """Weights other than the sizes (FedAvg's callers may pass them) weight the mean; the record
  counts one serialised upload per client taking part."""
  aggregate, record, _, uploads, _ = _server_round(
    weights=np.array([1.0, 3.0, 5.0]), **{'attack.kind': 'none'}
  )
  want = onp.weighted_average([uploads[0], uploads[1]], [1.0, 3.0])
  onp.assert_tree_close(onp.to_numpy(aggregate.params), want, rtol=1e-5, atol=1e-6)
  one = engine.ModelState(jax.tree.map(lambda a: np.asarray(a, np.float32), uploads[0]), {})
  assert record['upload_bytes'] == 2 * _msgpack_bytes(one)


def test_the_server_clips_each_update_around_the_global_model_before_averaging():
  aggregate, _, ref, uploads, sizes = _server_round(
    **{'attack.kind': 'none', 'aggregation.clip_norm': 0.05}
  )
  flat = lambda tree: np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])
  clipped = []
  for u in uploads[:2]:
    norm = np.linalg.norm(flat(u) - flat(ref))
    assert norm > 0.05  # the bound bites
    clipped.append(onp.tree_map(lambda r, x: r + (x - r) * (0.05 / norm), ref, u))
  want = onp.weighted_average(clipped, sizes[:2])
  onp.assert_tree_close(onp.to_numpy(aggregate.params), want, rtol=1e-4, atol=1e-6)


def test_an_empty_round_of_one_rejected_upload_names_that_client():
  sizes = np.asarray(_server_round()[4])
  message = (
    r'^round 1: the only upload \(client 1\) was rejected, so nothing was aggregated '
    r'\(the last: .*client 1.*\); set server.allow_empty_rounds=True to keep the global model '
    r'in such a round$'
  )
  with pytest.raises(JfedError, match=message):
    _server_round(np.array([sizes[0], 1, sizes[2]]), taking_part=(False, True, False))


def test_the_attackers_are_drawn_from_the_attack_key_of_the_run():
  """jfed.keys: the attackers come from fold_in(ATTACK, 0), the server's attack draws from
  fold_in(ATTACK, 1): another seed, other attackers; a list names them."""
  drawn = {}
  for seed in (0, 1, 2):
    config = _config(10, seed=seed, **{'attack.kind': 'noise', 'attack.fraction': 0.4})
    ctx = _context(config, [6] * 10)
    order = np.asarray(jax.random.permutation(ctx.derive_key(Purpose.ATTACK, 0), 10))
    other = np.asarray(jax.random.permutation(ctx.derive_key(Purpose.ATTACK, 1), 10))
    if seed == 0:  # the attacks' key would draw other attackers
      assert sorted(order[:4]) != sorted(other[:4])
    drawn[seed] = ctx.federation.attackers.tolist()
    assert drawn[seed] == sorted(order[:4].tolist())
    bits = lambda key: np.asarray(jax.random.bits(key, (4,))).tolist()
    assert bits(common.make_server(ctx).attack_key) == bits(ctx.derive_key(Purpose.ATTACK, 1))
  assert len({tuple(v) for v in drawn.values()}) == 3
  listed = _config(10, **{'attack.kind': 'noise', 'attack.clients': '7,2'})
  assert _context(listed, [6] * 10).federation.attackers.tolist() == [2, 7]


def test_one_shot_uploads_are_validated_per_client_and_counted_per_group():
  """Two architectures (clients 0, 2 narrow; 1, 3 wide): the bytes are every client's own
  serialised model; a non-finite or misshapen model is refused naming its global client id."""
  ctx = _context(_config(4, **HETERO), HETERO_SIZES)
  groups = common.client_groups(ctx)
  models = common.init_group_models(ctx, groups)
  templates = [engine.take(m, 0) for m in models]
  want = sum(_msgpack_bytes(m, k) for m, g in zip(models, groups) for k in range(len(g.client_ids)))
  assert [g.client_ids.tolist() for g in groups] == [[0, 2], [1, 3]]
  assert common.receive_uploads(groups, models, templates) == want
  nan = jax.tree.map(lambda a: a.at[1].set(np.nan) if a.ndim > 1 else a, models[1])
  with pytest.raises(UploadError, match=r'^upload of client 3: .*non-finite'):
    common.receive_uploads(groups, [models[0], nan], templates)
  with pytest.raises(UploadError, match=r'^upload of client 0: '):
    common.receive_uploads(groups, [models[1], models[1]], [templates[0], templates[1]])


def test_a_server_set_to_fail_stops_at_an_invalid_upload_naming_the_client():
  sizes = np.asarray(_server_round()[4])
  with pytest.raises(UploadError, match=r'client 1'):
    _server_round(np.array([sizes[0], 1, sizes[2]]), **{'server.on_invalid_upload': 'fail'})


def test_only_the_federation_builder_derives_the_clients_specs_and_attackers():
  """`client_models` is parsed and the attackers drawn once per run (`jfed.api.build_federation`,
  `RunContext.federation`); a method reads the federation, never derives them again."""
  root = pathlib.Path(common.__file__).resolve().parents[2]
  offenders = []
  for path in sorted((root / 'jfed').rglob('*.py')):
    name = path.relative_to(root).as_posix()
    text = path.read_text()
    # api.py builds the federation; attacks.py defines attacker_ids; run_config.py checks the
    # config's model names before there is a run
    exempt = ('jfed/api.py', 'jfed/engine/attacks.py', 'jfed/run_config.py')
    if name not in exempt and ('client_models.split' in text or 'attacker_ids(' in text):
      offenders.append(name)
  assert not offenders, offenders
