"""The local models of several seeds trained as one client group (jfed/methods/seed_batch.py):
equal to each seed's own run, and what breaks that equality is noticed."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments import fedhydra_tables, fedmho_tables
from jfed import driver, engine
from jfed.configs import fedhydra_digits, fedmho_digits
from jfed.data import federate, load_dataset
from jfed.errors import ConfigError, NonFiniteError
from jfed.keys import Purpose
from jfed.methods import common, seed_batch
from tests.support import Terminal, override

EPOCHS = 2
SEEDS = (0, 1)


def tiny_config(seed: int, directory, **overrides):
  """Digits, an MLP, 3 clients: the cell of one seed."""
  c = fedhydra_digits.get_config('smoke')
  override(c, **{'model': 'mlp', 'partition.num_clients': 3, 'seed': seed, **overrides})
  c.local_models_dir = str(directory)
  c.fedavg.reuse_local_models = True
  return c


@pytest.fixture(scope='module')
def digits():
  return load_dataset('digits')


def own_run_models(config, dataset):
  """What the seed's own run trains: `common.local_models` with no cache in place."""
  return common.local_models(driver.context_of_config(config, dataset), EPOCHS).models


def assert_models_equal(got, want, exact: bool):
  leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(leaves_got, leaves_want):
    if exact:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def models_differ(got, want) -> bool:
  return any(
    not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )


def test_per_client_keys_train_as_the_group_key(digits):
  """GroupTrainer.train with one key per client (all the same) is the single-key training."""
  c = tiny_config(0, '')
  ctx = driver.context_of_config(c, digits)
  (group,) = common.client_groups(ctx)
  (init,) = common.init_group_models(ctx, [group])
  (trainer,) = common.make_trainers(ctx, [group])
  key = jax.random.PRNGKey(3)
  m = len(group.client_ids)

  def train(k):
    state = engine.init_train_state(trainer.tx, init)
    return trainer.train(state, group.fed, 1, k, client_ids=group.client_ids)[0].model

  assert_models_equal(train(jnp.broadcast_to(key, (m, 2))), train(key), exact=True)
  with pytest.raises(ValueError, match='2 per-client keys for a group of 3 clients'):
    train(jnp.broadcast_to(key, (2, 2)))


@pytest.mark.parametrize('strategy,shard', [('auto', False), ('scan', True)])
def test_seeds_batched_equal_their_own_runs(tmp_path, digits, monkeypatch, strategy, shard):
  """Every client's trained parameters, then one-shot FedAvg over them, as in each seed's run.

  'auto' is `loop` on CPU: the batched program runs every client's steps as its own run does,
  so the numbers are bit for bit the same. 'scan' over a sharded client axis (2 seeds x 3
  clients, padded to 8 on the 4 fake devices) maps clients by vmap: equal up to float error."""
  extra = {'strategy': strategy, 'shard': shard}
  batched = [tiny_config(s, tmp_path / f'batched{s}', **extra) for s in SEEDS]
  alone = [tiny_config(s, tmp_path / f'alone{s}', **extra) for s in SEEDS]
  done = seed_batch.pretrain_local_models(batched, EPOCHS, dataset=digits)
  assert [(d.seed, d.trained) for d in done] == [(0, True), (1, True)]
  want = [own_run_models(c, digits) for c in alone]
  assert models_differ(want[0], want[1])  # the seeds differ: partition, init, keys

  def no_training(*args, **kwargs):
    raise AssertionError('the cache of the batched seeds was not used')

  monkeypatch.setattr(common, 'train_groups', no_training)
  for c, w in zip(batched, want):
    got = common.local_models(driver.context_of_config(c, digits), EPOCHS).models
    assert_models_equal(got, w, exact=strategy == 'auto')
  for c_batched, c_alone in zip(batched, alone):  # a method's result over them
    got = driver.run_in_memory('fedavg', c_batched, digits)
    ref = driver.run_in_memory('fedavg', c_alone, digits)
    assert got.extras['reused_local_models'] and ref.extras['reused_local_models']
    if strategy == 'auto':
      assert got.final_test_accuracy == ref.final_test_accuracy
    else:
      assert got.final_test_accuracy == pytest.approx(ref.final_test_accuracy, abs=2e-3)


def wrong_keys(contexts):
  """Seed 1's clients train with seed 0's local-training keys."""
  original = contexts[1].derive_key

  def derive_key(purpose, *path):
    if purpose == Purpose.LOCAL_TRAINING:
      return contexts[0].derive_key(purpose, *path)
    return original(purpose, *path)

  contexts[1].derive_key = derive_key


def wrong_partition(contexts):
  """Seed 1's clients hold seed 0's data."""
  contexts[1].parts = list(contexts[0].parts)


def wrong_init(contexts):
  """Seed 1's clients start from seed 0's initial model."""
  original = contexts[1].derive_key

  def derive_key(purpose, *path):
    if purpose == Purpose.MODEL_INIT:
      return contexts[0].derive_key(purpose, *path)
    return original(purpose, *path)

  contexts[1].derive_key = derive_key


@pytest.mark.parametrize('mutate', [wrong_keys, wrong_partition, wrong_init])
def test_the_comparison_notices_a_seed_trained_with_another_seeds_inputs(tmp_path, digits, mutate):
  """The equality above can fail: seed 1 trained in the batch with seed 0's keys, data or
  init is not seed 1's own run (and seed 0 still is)."""
  configs = [tiny_config(s, tmp_path / f'b{s}') for s in SEEDS]
  contexts = [driver.context_of_config(c, digits) for c in configs]
  mutate(contexts)
  got = seed_batch.train_seeds(contexts, EPOCHS)
  want = [own_run_models(tiny_config(s, tmp_path / f'a{s}'), digits) for s in SEEDS]
  assert_models_equal(got[0], want[0], exact=True)
  assert models_differ(got[1], want[1])


def test_a_seed_whose_cache_exists_is_not_retrained(tmp_path, digits, monkeypatch):
  configs = [tiny_config(s, tmp_path / f'seed{s}') for s in (0, 1, 2)]
  seed_batch.pretrain_local_models(configs[:1], EPOCHS, dataset=digits)
  written = sorted(p.stat().st_mtime_ns for p in (tmp_path / 'seed0').rglob('*'))
  trained_seeds = []
  train_seeds = seed_batch.train_seeds

  def spy(contexts, *args, **kwargs):
    trained_seeds.append([int(c.config.seed) for c in contexts])
    return train_seeds(contexts, *args, **kwargs)

  monkeypatch.setattr(seed_batch, 'train_seeds', spy)
  done = seed_batch.pretrain_local_models(configs, EPOCHS, dataset=digits)
  assert [d.trained for d in done] == [False, True, True]
  assert [(d.seed, d.directory) for d in done] == [
    (s, str(tmp_path / f'seed{s}')) for s in (0, 1, 2)
  ]
  assert trained_seeds == [[1, 2]]
  assert sorted(p.stat().st_mtime_ns for p in (tmp_path / 'seed0').rglob('*')) == written
  assert seed_batch.pretrain_local_models(configs, EPOCHS, dataset=digits)[2].trained is False
  assert trained_seeds == [[1, 2]]
  # another tag (epochs) is other models: trained, beside the first
  assert all(d.trained for d in seed_batch.pretrain_local_models(configs, 1, dataset=digits))


def test_without_a_dataset_the_seeds_train_on_the_first_configs_dataset_from_its_data_dir(
  tmp_path, digits, monkeypatch
):
  data_dir = str(tmp_path / 'data')
  configs = [tiny_config(s, tmp_path / f'seed{s}', **{'dataset.data_dir': data_dir}) for s in SEEDS]
  loads, given = [], []
  monkeypatch.setattr(
    seed_batch.api,
    'load_run_dataset',
    lambda config: loads.append((config.dataset.name, config.dataset.data_dir)) or digits,
  )
  context_of_config = seed_batch.api.context_of_config
  monkeypatch.setattr(
    seed_batch.api,
    'context_of_config',
    lambda config, dataset: given.append(dataset) or context_of_config(config, dataset),
  )
  assert all(d.trained for d in seed_batch.pretrain_local_models(configs, 1))
  assert loads == [('digits', data_dir)]
  assert len(given) == len(SEEDS) and all(d is digits for d in given)


def test_seeds_pretrained_for_some_clients_equal_their_own_runs_of_those_clients(
  tmp_path, digits, monkeypatch
):
  """FedMHO's classifier clients are some of the clients: the seeds' cache holds the models
  their runs train for exactly those clients."""
  ids = [0, 2]
  batched = [tiny_config(s, tmp_path / f'batched{s}') for s in SEEDS]
  alone = [tiny_config(s, tmp_path / f'alone{s}') for s in SEEDS]
  seed_batch.pretrain_local_models(batched, 1, client_ids=ids, dataset=digits)
  want = [common.local_models(driver.context_of_config(c, digits), 1, ids).models for c in alone]
  monkeypatch.setattr(common, 'train_groups', None)  # the cache must serve them
  for c, w in zip(batched, want):
    got = common.local_models(driver.context_of_config(c, digits), 1, ids).models
    assert jax.tree.leaves(got)[0].shape[0] == len(ids)
    assert_models_equal(got, w, exact=True)


def test_train_seeds_names_the_seed_and_clients_whose_training_diverges(tmp_path, digits):
  nan = digits._replace(train_x=np.full_like(digits.train_x, np.nan))
  contexts = [
    driver.context_of_config(tiny_config(s, tmp_path / f's{s}'), d)
    for s, d in zip(SEEDS, (digits, nan))
  ]
  contexts[1].parts = [contexts[1].parts[0][:1]] + list(contexts[1].parts[1:])  # one sample
  message = (
    r'^local training of seed 1: the training loss of client\(s\) \[0, 1, 2\] \(mlp\) became '
    r'non-finite; lower the learning rate or check the data$'
  )
  with pytest.raises(NonFiniteError, match=message):
    seed_batch.train_seeds(contexts, 1)


def test_train_seeds_shows_the_progress_of_each_architectures_epochs(tmp_path, digits, monkeypatch):
  terminal = Terminal()
  monkeypatch.setattr(sys, 'stderr', terminal)
  contexts = [driver.context_of_config(tiny_config(s, tmp_path / f's{s}'), digits) for s in SEEDS]
  seed_batch.train_seeds(contexts, 2)
  lines = terminal.lines()
  for epoch in (1, 2):
    assert any(
      line.startswith(f'local training of seeds [0, 1] [mlp x6] {epoch}/2 epochs')
      and 'epoch/s' in line
      for line in lines
    ), lines


def test_train_seeds_refuses_seeds_of_other_architectures(tmp_path, digits):
  contexts = [
    driver.context_of_config(tiny_config(0, tmp_path / 'a'), digits),
    driver.context_of_config(tiny_config(1, tmp_path / 'b', model='cnn_mnist'), digits),
  ]
  with pytest.raises(
    ConfigError, match=r'^the seeds of a cell must have the same client architectures$'
  ):
    seed_batch.train_seeds(contexts, 1)


@pytest.mark.parametrize('epochs', [0, -1])
def test_pretraining_refuses_local_epochs_below_one(tmp_path, epochs):
  configs = [tiny_config(s, tmp_path / f'seed{s}') for s in SEEDS]
  with pytest.raises(ConfigError, match=rf'^local epochs must be positive, got {epochs}$'):
    seed_batch.pretrain_local_models(configs, epochs)


def test_configs_that_are_not_one_cell_are_refused(tmp_path):
  a, b = tiny_config(0, tmp_path / 'a'), tiny_config(1, tmp_path / 'b')
  b.optimizer.lr = 0.5
  with pytest.raises(ConfigError, match=r'seed 1 is not of the cell of seed 0: optimizer.lr'):
    seed_batch.check_one_cell([a, b])
  with pytest.raises(
    ConfigError, match=r'^pretrain_local_models needs the config of at least one seed$'
  ):
    seed_batch.check_one_cell([])
  with pytest.raises(ConfigError, match='the seeds of a cell must differ'):
    seed_batch.check_one_cell([a, tiny_config(0, tmp_path / 'c')])
  with pytest.raises(ConfigError, match='distinct local_models_dir'):
    seed_batch.check_one_cell([a, tiny_config(1, tmp_path / 'a')])
  with pytest.raises(ConfigError, match=r'local_models_dir is not set for seed\(s\) \[1\]'):
    seed_batch.check_one_cell([a, tiny_config(1, '')])
  seed_batch.check_one_cell([a, tiny_config(1, tmp_path / 'b')])  # seed and dirs may differ
  # where the curves go may differ; a top-level *_dir too; a nested one (the data) may not
  seed_batch.check_one_cell(
    [a, tiny_config(1, tmp_path / 'b', **{'logging.wandb': True, 'local_cvaes_dir': 'x'})]
  )
  nested = tiny_config(1, tmp_path / 'b', **{'dataset.data_dir': '/elsewhere'})
  with pytest.raises(
    ConfigError,
    match=r"^seed 1 is not of the cell of seed 0: dataset.data_dir = '/elsewhere', not ''",
  ):
    seed_batch.check_one_cell([a, nested])
  # a key that only one seed's config has
  extra = tiny_config(1, tmp_path / 'b')
  extra.fedavg.new_key = 3
  message = r"^seed 1 is not of the cell of seed 0: fedavg.new_key = 3, not '<unset>' \(the seeds"
  with pytest.raises(ConfigError, match=message):
    seed_batch.check_one_cell([a, extra])
  message = r"^seed 0 is not of the cell of seed 1: fedavg.new_key = '<unset>', not 3 \(the seeds"
  with pytest.raises(ConfigError, match=message):
    seed_batch.check_one_cell([extra, a])


def test_local_epochs_of_the_methods_that_share_local_models():
  c = tiny_config(0, '')
  c.feddf.local_epochs, c.fedhydra.local_epochs = 3, 4
  assert seed_batch.local_epochs_of('feddf', c) == 3
  assert seed_batch.local_epochs_of('fedhydra', c) == 4
  assert seed_batch.local_epochs_of('fedavg', c) == c.fedavg.local_epochs
  c.fedavg.reuse_local_models = False
  assert seed_batch.local_epochs_of('fedavg', c) is None  # FedAvg trains its own clients
  assert seed_batch.local_epochs_of('fedprox', c) is None
  c.local.epochs = 5  # the per-client baseline reads the shared models of its own epochs
  assert seed_batch.local_epochs_of('local', c) == 5
  # a FedAvg section that does not name reuse_local_models trains its own clients
  c.fedavg = ml_collections.ConfigDict({'local_epochs': 2})
  assert seed_batch.local_epochs_of('fedavg', c) is None


def test_merged_group_pads_each_seed_to_the_longest_client():
  x = np.arange(20, dtype=np.float32)[:, None]
  y = np.arange(20) % 3
  a = federate(x, y, [np.arange(0, 3), np.arange(3, 5)])
  b = federate(x, y, [np.arange(5, 12)])
  g = seed_batch.merge_groups(
    [common.ClientGroup('mlp', None, np.array([0, 1]), a), common.ClientGroup('mlp', None, [0], b)]
  )
  assert g.fed.x.shape == (3, 7, 1) and g.client_ids.tolist() == [0, 1, 0]
  assert g.fed.sizes.tolist() == [3, 2, 7] and g.spec == 'mlp'
  np.testing.assert_array_equal(g.fed.x[0, :3, 0], [0, 1, 2])
  np.testing.assert_array_equal(g.fed.x[0, 3:], 0)
  # a seed one sample shorter than the longest is padded too
  c = federate(x, y, [np.arange(12, 18)])
  g = seed_batch.merge_groups(
    [common.ClientGroup('mlp', None, [0], c), common.ClientGroup('mlp', None, [0], b)]
  )
  assert g.fed.y.shape == (2, 7) and g.fed.sizes.tolist() == [6, 7]
  np.testing.assert_array_equal(g.fed.y[0], [0, 1, 2, 0, 1, 2, 0])  # y = i % 3 for i = 12..17, 0


def count_calls(monkeypatch, module, name):
  """Replaces module.name by a wrapper that records the arguments of each call."""
  calls = []
  original = getattr(module, name)

  def spy(*args, **kwargs):
    calls.append((args, kwargs))
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, spy)
  return calls


def finals(out, partitions, seeds, methods):
  results = json.loads((out / 'results.json').read_text())['results']
  return {
    (p, s, m): results[p][str(s)][m].get('final_test_accuracy', results[p][str(s)][m])
    for p in partitions
    for s in seeds
    for m in methods
  }


@pytest.mark.slow  # two sweeps of the table command
def test_fedhydra_tables_train_the_seeds_local_models_in_one_program(tmp_path, monkeypatch):
  """The table command pre-trains each partition's seeds at once; the runs read those models
  (no run trains a client) and give the numbers of the sweep that trains them seed by seed; a
  rerun trains nothing."""
  config = override(fedhydra_digits.get_config('smoke'), **{'model': 'mlp'})
  methods, partitions = ['fedavg', 'feddf'], ['dir0.5']
  calls = count_calls(monkeypatch, common, 'train_groups')
  # the first round's local models (a later round's trains from the global model, in its run)
  runs_training = lambda: [c for c in calls if 'label' not in c[1]]
  batches = count_calls(monkeypatch, seed_batch, 'train_seeds')
  fedhydra_tables.run_sweep(config, tmp_path / 'one_by_one', methods, partitions, SEEDS, (), False)
  assert len(runs_training()) == len(SEEDS) and not batches
  calls.clear()
  fedhydra_tables.run_sweep(config, tmp_path / 'batched', methods, partitions, SEEDS)
  assert not runs_training(), 'a run trained its clients instead of reading the batched ones'
  assert [[int(c.config.seed) for c in b[0][0]] for b in batches] == [list(SEEDS)]
  want = finals(tmp_path / 'one_by_one', partitions, SEEDS, methods)
  assert finals(tmp_path / 'batched', partitions, SEEDS, methods) == want
  assert all(isinstance(v, float) for v in want.values()), want
  for s in SEEDS:
    assert (tmp_path / 'batched' / f'seed{s}' / 'dir0.5' / 'local_models').is_dir()
  # resumed: every seed has its models (and its runs are finished): nothing trains again
  (tmp_path / 'batched' / 'seed1' / 'dir0.5' / 'feddf' / 'summary.json').unlink()
  fedhydra_tables.run_sweep(config, tmp_path / 'batched', methods, partitions, SEEDS)
  assert len(batches) == 1 and not runs_training()


@pytest.mark.slow  # two sweeps of the table command
def test_fedmho_tables_batch_the_baseline_clients_of_the_seeds(tmp_path, monkeypatch):
  config = str(pathlib.Path(fedmho_digits.__file__))
  runs_training = count_calls(monkeypatch, common, 'train_groups')
  batches = count_calls(monkeypatch, seed_batch, 'train_seeds')
  args = ('smoke', ['fedavg_vote'], [0.5], list(SEEDS))
  fedmho_tables.run_sweep(config, args[0], tmp_path / 'a', *args[1:], batch_seeds=False)
  assert len(runs_training) == len(SEEDS) and not batches
  runs_training.clear()
  fedmho_tables.run_sweep(config, args[0], tmp_path / 'b', *args[1:])
  assert not runs_training and len(batches) == 1
  assert finals(tmp_path / 'b', ['0.5'], SEEDS, ['fedavg_vote']) == finals(
    tmp_path / 'a', ['0.5'], SEEDS, ['fedavg_vote']
  )


def test_pretrain_cell_trains_the_seeds_whose_unfinished_runs_read_missing_models(
  tmp_path, monkeypatch
):
  asked = []
  monkeypatch.setattr(
    seed_batch,
    'pretrain_local_models',
    lambda configs, epochs, dataset=None: asked.append(([c.seed for c in configs], epochs)) or [],
  )

  def plan(seed, finished=()):
    c = tiny_config(seed, tmp_path / f'seed{seed}' / 'local_models')
    c.feddf.local_epochs = 3
    runs = []
    for m in ('fedavg', 'feddf', 'fedprox'):
      workdir = tmp_path / f'seed{seed}' / m
      if m in finished:
        workdir.mkdir(parents=True)
        (workdir / 'summary.json').write_text('{}')
      runs.append(seed_batch.PlannedRun(m, c, workdir))
    return runs

  # seed 0's FedAvg is done: its E = 2 models are wanted by seeds 1 and 2 only; FedDF's E = 3
  # by all three; FedProx trains its own clients every round
  seed_batch.pretrain_cell([plan(0, ('fedavg',)), plan(1), plan(2)])
  assert sorted(asked) == [([0, 1, 2], 3), ([1, 2], EPOCHS)]
  asked.clear()
  seed_batch.pretrain_cell([plan(0), plan(1, ('fedavg', 'feddf'))])  # one seed alone: its run
  assert asked == []
  # runs without a local_models_dir train their own clients: nothing to train ahead
  no_cache = [plan(s) for s in range(3)]
  for runs in no_cache:
    runs[0].config.local_models_dir = ''
  seed_batch.pretrain_cell(no_cache)
  assert asked == []


def test_pretrain_cell_trains_each_cell_apart_with_the_dataset_given_and_returns_every_batch(
  tmp_path, monkeypatch, digits
):
  """Seeds 0-1 at one learning rate and 2-3 at another are two cells: two batches, each with the
  dataset handed in, and the result holds both batches' models."""
  asked = []

  def fake(configs, epochs, dataset=None):
    asked.append(([c.seed for c in configs], epochs, dataset))
    return [f'trained {c.seed}' for c in configs]

  monkeypatch.setattr(seed_batch, 'pretrain_local_models', fake)
  dataset = digits
  seeds = []
  for seed in range(4):
    c = tiny_config(seed, tmp_path / f'seed{seed}', **{'optimizer.lr': 0.1 if seed < 2 else 0.05})
    seeds.append([seed_batch.PlannedRun('fedavg', c, tmp_path / f'seed{seed}' / 'fedavg')])
  done = seed_batch.pretrain_cell(seeds, dataset)
  assert sorted((s, e) for s, e, _ in asked) == [([0, 1], EPOCHS), ([2, 3], EPOCHS)]
  assert all(d is dataset for _, _, d in asked)
  assert sorted(done) == [f'trained {s}' for s in range(4)]
