"""HFLDD, HFLDD w/o DD, FedSeq and DynaFed end to end on digits through the driver: learning,
outputs, Eq. 18 / 19 byte accounting, resume without distilling again, config checks; the MTT
loss (value and gradients against NumPy), DynaFed's DSA in matching and fine-tuning, its client
optimiser, and the KIP label distribution."""

import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfed import driver, engine
from jfed.engine import GroupTrainer, compiles
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common, dynafed, fedseq, hfldd
from jfed.methods.dynafed import trajectory_matching_loss
from jfed.methods.hfldd import kip_label_distribution
from jfed.models.layers import BatchNorm
from jfed.models.registry import get_model
from tests.support import (
  HFLDD_CLIENTS,
  Interrupted,
  Terminal,
  hfldd_tiny_config,
  interrupt_after,
  read_metrics,
  shared_fixture_scope,
)

CHANCE = 0.1  # ten classes
NUM_CLIENTS = HFLDD_CLIENTS


def _config(**overrides):
  return hfldd_tiny_config(**overrides)


def _iid(**overrides):
  return _config(**{'partition.k': 10, **overrides})


def _run(method, config, workdir):
  return driver.run_experiment(method, config, workdir, progress=False)


@pytest.fixture(scope=shared_fixture_scope)
def hfldd_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('hfldd_whole')
  return workdir, _run('hfldd', _config(), workdir)


def test_hfldd_learns_at_c1_and_writes_its_outputs(hfldd_run):
  workdir, summary = hfldd_run
  for name in (
    'topology.png',
    'metrics.jsonl',
    'summary.json',
    'accuracy.png',
    'checkpoints',
    'local_models',
    'distilled',
  ):
    assert (workdir / name).exists(), name
  records = read_metrics(workdir)
  assert [r['step'] for r in records] == [0, 1, 2, 3]
  assert [r.get('round') for r in records] == [None, 1, 2, 3]
  assert summary.final_test_accuracy > CHANCE + 0.4, summary.final_test_accuracy
  # the whole test split; the public set is held-out training data
  assert summary['eval_samples'] == 360 and summary['public'] == 'holdout'
  assert summary['rounds'] == 3 and summary['distill']
  assert len(summary['homogeneous_labels']) == NUM_CLIENTS
  assert summary['model_bytes'] > 0 and 0 < summary['setup_bytes'] < summary.total_bytes
  setup = records[0]
  assert setup['stage'] == 'setup' and setup['num_clusters'] == len(summary['clusters']) == 2
  assert setup['hybrid_sizes'] == summary['hybrid_sizes'] and len(summary['hybrid_sizes']) == 2

  # every client in exactly one cluster; #C=1 -> each heterogeneous cluster has one client of
  # every homogeneous cluster, i.e. as many distinct classes as clients: here all ten
  clusters = summary['clusters']
  assert sorted(c for cl in clusters for c in cl) == list(range(NUM_CLIENTS))
  assert all(h in cl for h, cl in zip(summary['heads'], clusters))
  assert summary['cluster_label_coverage'] == [len(cl) for cl in clusters] == [10, 10]


def test_hfldd_bytes_follow_eq_18(hfldd_run):
  workdir, summary = hfldd_run
  records = read_metrics(workdir)
  stages = summary['bytes_by_stage']
  assert set(stages) == {'soft_labels', 'distilled', 'model_down', 'model_up'}
  # the protocol's account (per stage) = the driver's total of the measured records
  assert summary.total_bytes == sum(stages.values()) == records[-1]['cumulative_bytes']
  setup, rounds = records[0], records[1:]
  assert setup['stage'] == 'setup' and setup['download_bytes'] == 0
  assert setup['upload_bytes'] == stages['soft_labels']  # clients -> server
  assert setup['peer_bytes'] == stages['distilled']  # members -> their heads
  assert summary['setup_bytes'] == setup['upload_bytes'] + setup['peer_bytes']
  # Eq. 18 terms: N · n_public · C float32 soft labels, the members' uint8 images (+ int32
  # labels) sent to their heads, 2 · T · |H| models; measured = payload + msgpack overhead
  members = NUM_CLIENTS - len(summary['heads'])
  assert 0 < stages['soft_labels'] - NUM_CLIENTS * 60 * 10 * 4 <= NUM_CLIENTS * 40
  assert 0 < stages['distilled'] - members * 10 * (8 * 8 + 4) <= members * 80
  assert stages['model_up'] == stages['model_down'] == sum(r['upload_bytes'] for r in rounds)
  assert stages['model_up'] == 3 * len(summary['heads']) * summary['model_bytes']


def test_hfldd_resumes_to_the_same_result_without_distilling_again(
  hfldd_run, tmp_path, monkeypatch
):
  whole_dir, whole = hfldd_run
  with monkeypatch.context() as m:
    interrupt_after(m, 1)
    with pytest.raises(Interrupted):
      _run('hfldd', _config(), tmp_path)
  assert [r['step'] for r in read_metrics(tmp_path)] == [0, 1]

  def no_kip(*args, **kwargs):
    raise AssertionError('KIP ran again on resume')

  monkeypatch.setattr(hfldd, 'kip_distill_batched', no_kip)
  resumed = _run('hfldd', _config(), tmp_path)
  assert read_metrics(tmp_path) == read_metrics(whole_dir)
  assert resumed.final_test_accuracy == whole.final_test_accuracy
  assert resumed.total_bytes == whole.total_bytes
  assert resumed['clusters'] == whole['clusters']


def test_hfldd_without_distillation_sends_raw_data_in_memory(hfldd_run):
  _, with_dd = hfldd_run
  summary = driver.run_in_memory('hfldd_nodd', _config(**{'hfldd.rounds': 1}))
  assert not summary['distill']
  assert summary.final_test_accuracy > CHANCE + 0.3, summary.final_test_accuracy
  stages = summary['bytes_by_stage']
  assert 'raw_data' in stages and 'distilled' not in stages
  assert summary.total_bytes == sum(stages.values())
  assert summary['clusters'] == with_dd['clusters']  # same pre-training, same topology
  assert sum(summary['hybrid_sizes']) == 1437 - 60  # every client's training image, once
  assert stages['raw_data'] > with_dd['bytes_by_stage']['distilled']


def test_fedseq_learns_and_counts_eq_19(tmp_path):
  summary = _run('fedseq', _iid(), tmp_path)
  assert summary.final_test_accuracy > CHANCE + 0.4, summary.final_test_accuracy
  records = read_metrics(tmp_path)
  assert [r['step'] for r in records] == [0, 1, 2]
  superclients = summary['superclients']
  assert sorted(c for cl in superclients for c in cl) == list(range(NUM_CLIENTS))
  stages = summary['bytes_by_stage']
  assert set(stages) == {'confidence', 'model_down', 'model_peer', 'model_up'}
  assert summary.total_bytes == sum(stages.values()) == records[-1]['cumulative_bytes'] > 0
  assert records[0]['stage'] == 'setup' and records[0]['superclients'] == len(superclients)
  assert records[0]['upload_bytes'] == stages['confidence']
  # N float32 confidence vectors of C = 10 (payload + msgpack overhead)
  assert 0 < stages['confidence'] - NUM_CLIENTS * 10 * 4 <= NUM_CLIENTS * 40
  sizes = driver.context_of_config(_iid()).client_sizes
  assert summary['superclient_sizes'] == [int(sizes[c].sum()) for c in superclients]
  assert (summary['rounds'], summary['public']) == (2, 'holdout')
  # per round: one download per superclient, n_c - 1 hand-offs, one upload: N + S model copies
  for r in records[1:]:
    assert (r['round'], r['superclients']) == (r['step'], len(superclients))
    assert 0 < r['train_loss'] < 3
    assert r['download_bytes'] == r['upload_bytes'] == len(superclients) * summary['model_bytes']
    assert (
      r['download_bytes'] + r['peer_bytes'] + r['upload_bytes']
      == (NUM_CLIENTS + len(superclients)) * summary['model_bytes']
    )


def test_fedseq_wiring_public_draw_clustering_keys_orders_and_uploads(monkeypatch):
  config = _unlinked_holdout(
    _iid(
      **{
        'seed': 3,
        'fedseq.measure': 'gini',
        'fedseq.code_compat': True,
        'fedseq.min_examples': 150,
        'fedseq.max_clients': 4,
        'fedseq.participation': 0.5,
        'fedseq.local_epochs': 1,
      }
    ),
    100,
  )
  clustered, trained, uploads = [], [], []
  cluster, train, validate = (
    fedseq.fedseq_clusters,
    common.train_groups,
    fedseq.validate_model_upload,
  )

  def record_clusters(*args):
    clustered.append(args)
    return cluster(*args)

  def record_training(trainers, groups, models, epochs, key, label):
    trained.append((groups[0].client_ids.tolist(), np.asarray(key), label))
    return train(trainers, groups, models, epochs, key, label=label)

  def record_upload(upload, reference):
    uploads.append((upload.client_id, upload.num_samples))
    return validate(upload, reference)

  monkeypatch.setattr(fedseq, 'fedseq_clusters', record_clusters)
  monkeypatch.setattr(fedseq, 'validate_model_upload', record_upload)
  ctx = driver.context_of_config(config)
  algorithm = driver.build_algorithm('fedseq', config)
  aux = algorithm.setup(ctx)
  monkeypatch.setattr(common, 'train_groups', record_training)  # the rounds' training only

  # the public set: 60 of the 100 held-out training samples, drawn with the run's seed
  rows = np.sort(np.random.default_rng(3).choice(100, 60, replace=False))
  np.testing.assert_array_equal(aux.public.x, ctx.dataset.holdout_x[rows])
  # the confidences (float32, one distribution per client) go to the configured clustering
  ((conf, sizes, min_examples, max_clients, measure, code_compat),) = clustered
  assert conf.dtype == np.float32 and conf.shape == (NUM_CLIENTS, 10)
  np.testing.assert_allclose(conf.sum(1), 1, rtol=1e-6)
  np.testing.assert_array_equal(sizes, ctx.client_sizes)
  assert (min_examples, max_clients, measure, code_compat) == (150, 4, 'gini', True)
  # the model's bytes: its float32 parameters plus msgpack's framing
  num_params = sum(a.size for a in jax.tree.leaves(aux.init))
  assert 0 < aux.model_bytes - 4 * num_params <= 400

  state = algorithm.init(ctx, aux)
  superclients = [c.tolist() for c in aux.superclients]
  for i in range(2):
    trained.clear()
    uploads.clear()
    state, (record,) = algorithm.step(ctx, aux, state, i)
    # half of the superclients, drawn with round i's sampling key; each visits its clients in
    # the order drawn from round i's order key folded with its id
    count = round(0.5 * len(superclients))
    selected = np.sort(
      jax.random.choice(ctx.derive_key(Purpose.SAMPLING, i), len(superclients), (count,), False)
    )
    orders = [
      np.asarray(superclients[c])[
        jax.random.permutation(
          jax.random.fold_in(ctx.derive_key(Purpose.SUPERCLIENT_ORDER, i), int(c)),
          len(superclients[c]),
        )
      ].tolist()
      for c in selected
    ]
    assert record['superclients'] == len(selected) == count
    steps = max(len(o) for o in orders)
    assert [t[0] for t in trained] == [[o[j] for o in orders if len(o) > j] for j in range(steps)]
    for j, (_, key, label) in enumerate(trained):
      want = jax.random.fold_in(ctx.derive_key(Purpose.ROUNDS, i), j)
      np.testing.assert_array_equal(key, np.asarray(want))
      assert label == f'round {i + 1}/2 step {j + 1}'
    # the last client of each superclient uploads the superclient's model and data size
    assert uploads == [(o[-1], int(ctx.client_sizes[o].sum())) for o in orders]


def test_fedseq_pads_every_step_to_the_largest_client_so_later_rounds_compile_nothing():
  # the round's orders change which clients share a step; padded to the run's largest client
  # (not to the step's), every step keeps its shapes and round 2 reuses round 1's programs
  config = _config(**{'fedseq.min_examples': 150, 'fedseq.max_clients': 4})
  with config.unlocked():
    config.partition.scheme, config.partition.alpha, config.partition.min_size = (
      'dirichlet',
      0.5,
      10,
    )
  ctx = driver.context_of_config(config)
  algorithm = driver.build_algorithm('fedseq', config)
  aux = algorithm.setup(ctx)
  state, _ = algorithm.step(ctx, aux, algorithm.init(ctx, aux), 0)
  assert np.ptp(ctx.client_sizes) > config.batch_size  # steps of clients of unlike sizes
  with compiles.count_compilations() as compiled:
    algorithm.step(ctx, aux, state, 1)
  assert not compiled.names, compiled.names


def test_a_non_finite_confidence_is_refused_naming_the_client(monkeypatch):
  from jfed.io import UploadError

  def probabilities(ctx, local, x):
    probs = np.full((NUM_CLIENTS, len(x), 10), 0.1, np.float32)
    probs[2, 0, 0] = np.nan
    return probs

  monkeypatch.setattr(common, 'client_probabilities', probabilities)
  config = _config()
  with pytest.raises(UploadError, match='confidence of client 2'):
    driver.build_algorithm('fedseq', config).setup(driver.context_of_config(config))


def test_dynafed_distils_fine_tunes_and_learns(tmp_path):
  """The reference's options (hfldd_digits.py): DSA in matching and fine-tuning, client Adam
  1e-3, participation 0.4."""
  config = _iid()
  d = config.dynafed
  assert (d.dsa, d.client_optimizer, d.client_lr, d.participation) == (
    'color_crop_cutout_flip_scale_rotate',
    'adam',
    1e-3,
    0.4,
  )
  summary = _run('dynafed', config, tmp_path)
  assert summary.final_test_accuracy > CHANCE + 0.4, summary.final_test_accuracy
  records = read_metrics(tmp_path)
  assert [r['step'] for r in records] == [1, 2, 3]
  assert [r['clients'] for r in records] == [8, 8, 8]  # 0.4 of 20 clients per round
  assert summary['distilled'] and summary['num_synthetic'] == 10
  last = records[-1]  # round T + 1 = 3: distilled, then fine-tuned after aggregation
  assert last['matching_loss_first'] > 0 and last['matching_loss_last'] > 0
  # the learned student lr moved by Adam(lr_lr): at most lr_lr per iteration, and not 0
  moved = abs(last['syn_lr'] - d.lr_teacher)
  assert 0 < moved <= d.iterations * d.lr_lr * 1.01, moved
  assert 'test_accuracy_before_finetune' in last
  assert all('matching_loss_first' not in r for r in records[:-1])
  stages = summary['bytes_by_stage']
  assert stages['model_up'] == stages['model_down'] == sum(r['upload_bytes'] for r in records)
  assert summary.total_bytes == sum(stages.values()) == records[-1]['cumulative_bytes'] > 0
  assert len({r['upload_bytes'] for r in records}) == 1  # 8 model copies every round


def test_dynafed_distils_once_then_fine_tunes_every_round_on_the_same_set(monkeypatch):
  config = _config(
    **{
      'dynafed.rounds': 4,
      'dynafed.trajectory_rounds': 2,
      'dynafed.participation': 1.0,
      'dynafed.weighting': 'size',
    }
  )
  ctx = driver.context_of_config(config)
  algorithm = driver.build_algorithm('dynafed', config)
  aux = algorithm.setup(ctx)
  states, records, rounds, tunes = [algorithm.init(ctx, aux)], [], [], []
  # the checkpointed state: θ_0 then zeros on the trajectory, an empty synthetic set
  init = states[0]
  for leaf, param in zip(jax.tree.leaves(init.trajectory), jax.tree.leaves(init.model.params)):
    assert leaf.shape == (3, *param.shape) and leaf.dtype == param.dtype
    np.testing.assert_array_equal(leaf[0], param)
    assert not np.any(leaf[1:])
  assert (init.syn_x.shape, init.syn_labels.shape, init.syn_lr.shape) == (
    (10, 8, 8, 1),
    (10, 10),
    (),
  )
  for zeros in (init.syn_x, init.syn_labels, init.syn_lr):
    assert zeros.dtype == jnp.float32 and not np.any(zeros)
  # participation draws round i's clients with its sampling key
  sampled = driver.build_algorithm('dynafed', _config(**{'dynafed.participation': 0.4}))
  for i in range(2):
    want = jax.random.choice(ctx.derive_key(Purpose.SAMPLING, i), NUM_CLIENTS, (8,), False)
    np.testing.assert_array_equal(sampled._participants(ctx, i), np.sort(want))  # pylint: disable=protected-access

  fedavg_round, finetune = common.fedavg_round, dynafed.finetune

  def recording_round(parts, group, model, key, step, options):
    rounds.append((np.asarray(key), options.label, options.weights))
    return fedavg_round(parts, group, model, key, step, options)

  def recording_finetune(*args):
    tunes.append(np.asarray(args[-1]))
    return finetune(*args)

  monkeypatch.setattr(common, 'fedavg_round', recording_round)
  monkeypatch.setattr(dynafed, 'finetune', recording_finetune)
  for i in range(4):
    state, (record,) = algorithm.step(ctx, aux, states[-1], i)
    states.append(state)
    records.append(record)
  assert [r['round'] for r in records] == [1, 2, 3, 4]
  assert ['matching_loss_first' in r for r in records] == [False, False, True, False]
  assert ['test_accuracy_before_finetune' in r for r in records] == [False, False, True, True]
  # round i: its rounds key and label, size weights (None); fine-tuning from round T + 1 on,
  # with that round's fine-tuning key
  for i, (key, label, weights) in enumerate(rounds):
    np.testing.assert_array_equal(key, np.asarray(ctx.derive_key(Purpose.ROUNDS, i)))
    assert (label, weights) == (f'round {i + 1}/4', None)
  assert len(tunes) == 2
  for i, key in zip((2, 3), tunes):
    np.testing.assert_array_equal(key, np.asarray(ctx.derive_key(Purpose.FINETUNE, i)))
  # θ_1 and θ_2 are rounds 1 and 2's global models; the trajectory then stays as it is
  for leaf, first, second, later in zip(
    jax.tree.leaves(states[2].trajectory),
    jax.tree.leaves(states[1].model.params),
    jax.tree.leaves(states[2].model.params),
    jax.tree.leaves(states[4].trajectory),
  ):
    np.testing.assert_array_equal(leaf[1], first)
    np.testing.assert_array_equal(leaf[2], second)
    np.testing.assert_array_equal(later, leaf)
  # the set distilled in round T + 1 is the one round T + 2 fine-tunes on
  assert np.any(np.asarray(states[3].syn_x) != 0)
  for a, b in zip(states[3][2:], states[4][2:]):
    np.testing.assert_array_equal(a, b)
  summary = algorithm.summarize(ctx, aux, states[-1], records)
  assert (summary['rounds'], summary['distilled'], summary['num_synthetic']) == (4, True, 10)
  # a run that ends with its trajectory distils nothing
  config = _config(**{'dynafed.rounds': 2, 'dynafed.trajectory_rounds': 2})
  algorithm = driver.build_algorithm('dynafed', config)
  assert not algorithm.summarize(ctx, aux, states[-1], records[:2])['distilled']
  # 'uniform' passes equal weights (the reference's reduce_average)
  uniform = driver.build_algorithm('dynafed', _config(**{'dynafed.participation': 1.0}))
  rounds.clear()
  uniform.step(ctx, uniform.setup(ctx), states[0], 0)
  np.testing.assert_array_equal(rounds[0][2], np.ones(NUM_CLIENTS))


# Slow: a second whole DynaFed run that compiles its own programs (16 s). The fast set still
# checks the DSA words (tests/test_diffaugment.py), the client-optimizer setting (the next test)
# and a whole DynaFed run (the test above).
@pytest.mark.slow
def test_dynafed_runs_and_learns_with_the_other_options(tmp_path):
  """Another DSA strategy, the clients on plain SGD, every client in every round."""
  config = _iid(
    **{
      'dynafed.dsa': 'crop_flip',
      'dynafed.client_optimizer': 'sgd',
      'dynafed.client_lr': 0.05,
      'dynafed.participation': 1.0,
    }
  )
  summary = _run('dynafed', config, tmp_path)
  assert summary.final_test_accuracy > CHANCE + 0.4, summary.final_test_accuracy
  assert [r['clients'] for r in read_metrics(tmp_path)] == [NUM_CLIENTS] * 3


def test_dynafed_client_optimizer_is_the_named_one_or_the_runs():
  cfg = _config().dynafed
  section = dynafed.client_optimizer(cfg)
  assert (section.name, section.lr) == ('adam', 1e-3)
  state = engine.build_optimizer(engine.optimizer_spec(section)).init({'w': jnp.zeros(3)})
  assert float(state.hyperparams['learning_rate']) == pytest.approx(1e-3)
  cfg.client_optimizer = ''
  assert dynafed.client_optimizer(cfg) is None  # common.make_trainers: the run's optimizer
  assert dynafed.pixel_dsa(_config(**{'dynafed.dsa': 'none'}).dynafed) is None
  dsa = dynafed.pixel_dsa(_config().dynafed)
  assert (dsa.strategy, dsa.mean, dsa.std) == ('color_crop_cutout_flip_scale_rotate', 0.5, 0.25)


def _flip_all(key, x):
  """A deterministic stand-in for DSA (hashable: a static argument of the jitted loss)."""
  del key
  return x[:, :, ::-1, :]


def test_matching_and_fine_tuning_apply_the_augmentation():
  """With augment = a fixed flip, matching and fine-tuning equal their un-augmented forms on
  flipped images: the augmentation is applied to every student step and fine-tuning batch."""
  rng = np.random.default_rng(0)
  shape, n, C = (8, 8, 1), 6, 10
  module = get_model('mlp', C, shape)
  model = engine.init_model(module, shape, jax.random.key(0))
  apply = dynafed.student_apply_fn(module, model.batch_stats)
  x = jnp.asarray(rng.uniform(size=(n, *shape)), jnp.float32)
  labels = jnp.asarray(rng.normal(size=(n, C)), jnp.float32)
  target = jax.tree.map(lambda p: p + 0.01, model.params)
  batches = jnp.asarray(np.stack([rng.permutation(n)[:4] for _ in range(3)]))
  args = (labels, jnp.float32(0.1), model.params, target, batches)
  plain = trajectory_matching_loss(apply, _flip_all(None, x), *args)
  augmented = trajectory_matching_loss(apply, x, *args, jax.random.key(1), augment=_flip_all)
  np.testing.assert_allclose(float(augmented), float(plain), rtol=1e-6)
  assert abs(float(trajectory_matching_loss(apply, x, *args)) - float(plain)) > 1e-6

  tx = optax.adam(1e-2)
  tuned = dynafed.finetune(
    GroupTrainer(module, tx, 4, objective=dynafed.FinetuneObjective(_flip_all)),
    model,
    x,
    labels,
    2,
    jax.random.key(2),
  )
  reference = dynafed.finetune(
    GroupTrainer(module, tx, 4, objective=dynafed.FinetuneObjective()),
    model,
    _flip_all(None, x),
    labels,
    2,
    jax.random.key(2),
  )
  for a, b in zip(jax.tree.leaves(tuned.params), jax.tree.leaves(reference.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  changed = [np.any(a != b) for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(model))]
  assert any(changed)


def _reference_ranges(T, cfg):
  """image_synthesizer.py:Synthesizer.synthesize's ranges for a trajectory θ_0..θ_T: start
  epochs (np.random.randint's [low, high)), and the averaging counts (random.choice of range)."""
  curr_max = min(cfg['max_start_epoch'], T - cfg['expert_epochs'])
  starts = [0] if curr_max == 0 else list(range(cfg['min_start_epoch'], curr_max + 1))
  e, m = cfg['expert_epochs'], cfg['max_ave_num']
  upper = m + 1 if m < e else e + 1
  return starts, list(range(cfg['least_ave_num'], upper))


@pytest.mark.parametrize(
  'T,expert,min_start,max_start,least,most',
  [(24, 3, 0, 50, 2, 10), (10, 2, 3, 5, 1, 1), (6, 4, 1, 50, 2, 3), (3, 3, 0, 50, 2, 10)],
)
def test_dynafed_draws_starts_and_averaged_targets_from_the_references_ranges(
  T, expert, min_start, max_start, least, most
):
  cfg = {
    'expert_epochs': expert,
    'min_start_epoch': min_start,
    'max_start_epoch': max_start,
    'least_ave_num': least,
    'max_ave_num': most,
  }
  starts, counts = _reference_ranges(T, cfg)
  schedule = dynafed.matching_schedule(dynafed.DynaFedConfig(weight_averaging=True, **cfg), T + 1)
  # θ_t = one-hot e_t: a start reads as its index, an averaged target as its picks' histogram
  trajectory = {'w': jnp.eye(T + 1)}
  seen_starts, seen_first, seen_most = set(), False, False
  for i in range(300):
    start, target = dynafed.sample_target(jax.random.key(i), trajectory, schedule)
    start, target = np.asarray(start['w']), np.asarray(target['w'])
    s = int(np.argmax(start))
    np.testing.assert_array_equal(start, np.eye(T + 1)[s])
    seen_starts.add(s)
    # the mean of k draws (with replacement) of θ_{s+1..s+expert}
    assert target.sum() == pytest.approx(1.0, abs=1e-6)
    support = np.flatnonzero(target > 1e-7)
    assert s + 1 <= support.min() and support.max() <= s + expert
    seen_first = seen_first or support.min() == s + 1
    k = [c for c in counts if np.allclose(target * c, np.round(target * c), atol=1e-5)]
    assert k, (target, counts)
    seen_most = seen_most or k == [max(counts)]  # a mean only the largest count can give
  assert seen_starts == set(starts)
  assert seen_most
  assert seen_first  # θ_{s+1} is among the candidates
  plain = dynafed.matching_schedule(dynafed.DynaFedConfig(weight_averaging=False, **cfg), T + 1)
  too_short = f'dynafed: trajectory_rounds={expert - 1} must be >= expert_epochs={expert}'
  with pytest.raises(ValueError, match=too_short):
    dynafed.matching_schedule(dynafed.DynaFedConfig(**cfg), expert)
  for i in range(40):
    start, target = dynafed.sample_target(jax.random.key(i), trajectory, plain)
    s = int(np.argmax(start['w']))
    np.testing.assert_array_equal(target['w'], np.eye(T + 1)[s + expert])


def test_student_batches_are_consecutive_chunks_of_fresh_permutations():
  idx = np.asarray(dynafed.student_batches(jax.random.key(0), 5, 4, 3))
  assert idx.shape == (4, 3)
  flat = idx.reshape(-1)  # 12 indices: two whole permutations of 0..4, then 2 distinct ones
  assert sorted(flat[:5]) == sorted(flat[5:10]) == list(range(5))
  assert len(set(flat[10:])) == 2 and not np.array_equal(flat[:5], flat[5:10])
  other = np.asarray(dynafed.student_batches(jax.random.key(1), 5, 4, 3))
  assert not np.array_equal(idx, other)


class _NormalisedLinear(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    return nn.Dense(3)(BatchNorm()(x.reshape(len(x), -1), train, mask))


def test_bn_passes_are_three_ema_updates_on_the_whole_synthetic_set(monkeypatch):
  # server.py:datadistill: `for _ in range(3): model(x_dis)` in train mode, no gradient
  rng = np.random.default_rng(0)
  x = rng.normal(2.0, 3.0, size=(6, 2, 2, 1)).astype(np.float32)
  module = _NormalisedLinear()
  model = engine.init_model(module, (2, 2, 1), jax.random.key(0))
  out = dynafed._bn_passes(module, model, x, 6, 3, jax.random.key(1))  # pylint: disable=protected-access
  decay = 0.9**3  # PyTorch's momentum 0.1 per pass
  flat = x.reshape(6, -1).astype(np.float64)
  stats = out.batch_stats['BatchNorm_0']['bn']
  np.testing.assert_allclose(stats['mean'], (1 - decay) * flat.mean(0), rtol=1e-5)
  np.testing.assert_allclose(stats['var'], decay + (1 - decay) * flat.var(0), rtol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, out.params, model.params)  # untouched
  # the matching's student normalises with the batch's statistics (train mode)
  dense = model.params['Dense_0']
  normalised = (flat - flat.mean(0)) / np.sqrt(flat.var(0) + 1e-5)
  logits = dynafed.student_apply_fn(module, model.batch_stats)(model.params, x)
  np.testing.assert_allclose(
    logits, normalised @ dense['kernel'] + dense['bias'], rtol=1e-4, atol=1e-5
  )

  # finetune: the passes run on the un-augmented synthetic set, in the tuner's batches
  calls = []

  passes_fn = dynafed._bn_passes  # pylint: disable=protected-access

  def record(module_, model_, x_, batch, passes, key):
    calls.append((module_, np.asarray(x_), batch, passes, key))
    return passes_fn(module_, model_, x_, batch, passes, key)

  monkeypatch.setattr(dynafed, '_bn_passes', record)
  labels = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
  trainer = GroupTrainer(
    module, optax.adam(1e-3), 4, objective=dynafed.FinetuneObjective(_flip_all)
  )
  dynafed.finetune(trainer, model, x, labels, 1, jax.random.key(2))
  ((bn_module, seen, batch, passes, key),) = calls
  assert bn_module is module
  assert (
    jax.random.key_data(key).tolist()
    == jax.random.key_data(jax.random.fold_in(jax.random.key(2), 1)).tolist()
  )  # the passes' shuffles: their own stream of the fine-tuning key
  np.testing.assert_array_equal(seen, x)
  assert (batch, passes) == (4, 3)


def test_matching_augments_with_the_configured_dsa_runs_a_bn_student_and_shows_progress(
  monkeypatch,
):
  seen = []
  loss = dynafed.trajectory_matching_loss

  def recording_loss(*args, augment=None):
    seen.append(augment)
    return loss(*args, augment=augment)

  monkeypatch.setattr(dynafed, 'trajectory_matching_loss', recording_loss)
  terminal = Terminal()
  monkeypatch.setattr(sys, 'stderr', terminal)
  cfg = dynafed.DynaFedConfig(ipc=1, syn_steps=1, expert_epochs=1, iterations=10, dsa='flip')
  module = _NormalisedLinear()  # BatchNorm: the student runs on batch statistics
  model = engine.init_model(module, (2, 2, 1), jax.random.key(0))
  trajectory = jax.tree.map(lambda p: jnp.stack([p, p + 0.1]), model.params)
  x, labels, lr, losses = dynafed.distill_synthetic_set(
    module, model, trajectory, cfg, 3, (2, 2, 1), jax.random.key(1)
  )
  assert seen == [dynafed.pixel_dsa(cfg)] and seen[0] is not None  # traced once
  assert x.shape == (3, 2, 2, 1) and labels.shape == (3, 3) and losses.shape == (10,)
  assert np.isfinite(losses).all() and float(lr) != cfg.lr_teacher
  # on a terminal: one line per iteration, the loss every 10th
  lines = terminal.getvalue().split('\r')[1:]
  assert [line.split()[3] for line in lines] == [f'{i}/10' for i in range(1, 11)]
  assert all(line.startswith('DynaFed trajectory matching ') for line in lines)
  assert all(' iterations ' in line for line in lines)
  assert [line.rstrip().endswith(f'loss {losses[-1]:.4f}') for line in lines] == [False] * 9 + [
    True
  ]
  assert all(re.search(r'eta +\d+s$', line.rstrip()) for line in lines[:-1])  # nothing after


@pytest.mark.parametrize(
  'method,overrides,message',
  [
    ('hfldd', {'hfldd.rounds': 0}, 'hfldd.rounds must be positive'),
    ('hfldd', {'hfldd.image_dtype': 'float16'}, 'hfldd.image_dtype'),
    ('hfldd', {'hfldd.leftover': 'drop'}, 'hfldd.leftover'),
    ('hfldd', {'hfldd.public': 'cifar'}, 'hfldd.public'),
    ('hfldd', {'hfldd.kip.kernel': 'cnn'}, 'hfldd.kip.kernel'),
    ('hfldd', {'hfldd.kip.support_size': 0}, 'hfldd.kip.support_size must be positive'),
    ('fedseq', {'fedseq.measure': 'euclid'}, 'fedseq.measure'),
    ('fedseq', {'fedseq.participation': 0.0}, r'participation must be in \(0, 1\]'),
    ('fedseq', {'fedseq.rounds': 0}, 'fedseq.rounds must be positive'),
    ('dynafed', {'dynafed.lr_lr': -1.0}, 'dynafed.lr_lr'),
    ('dynafed', {'dynafed.participation': 1.5}, 'dynafed.participation'),
    ('dynafed', {'dynafed.weighting': 'median'}, 'dynafed.weighting'),
    (
      'dynafed',
      {'dynafed.expert_epochs': 5},
      r'dynafed.expert_epochs \(5\) must be <= dynafed.trajectory_rounds \(2\): a matching '
      'target lies expert_epochs rounds after its start on the trajectory',
    ),
    ('dynafed', {'dynafed.ipc': 0}, 'dynafed.ipc must be positive'),
    ('dynafed', {'dynafed.dsa': 'color_blur'}, "dynafed.dsa: unknown DSA transform.*'blur'"),
    (
      'dynafed',
      {'dynafed.client_optimizer': 'rmsprop'},
      r"dynafed.client_optimizer is 'rmsprop'; valid: '' \(the run's optimizer\), sgd, adam$",
    ),
    ('dynafed', {'dynafed.min_start_epoch': -1}, 'dynafed.min_start_epoch'),
    ('dynafed', {'dynafed.client_lr': 0.0}, 'dynafed.client_lr must be positive'),
  ],
)
def test_bad_config_is_refused_before_anything_is_written(tmp_path, method, overrides, message):
  with pytest.raises(ConfigError, match=message):
    _run(method, _config(**overrides), tmp_path / 'w')
  assert not (tmp_path / 'w').exists()


def test_trajectory_matching_loss_equals_its_formula_on_a_linear_model():
  rng = np.random.default_rng(0)
  n, d, C, steps, lr = 6, 4, 3, 3, 0.3
  x = rng.normal(size=(n, d))
  labels = rng.normal(size=(n, C))
  start = {'b': rng.normal(size=C), 'w': rng.normal(size=(d, C))}
  target = {'b': rng.normal(size=C), 'w': rng.normal(size=(d, C))}
  batches = np.stack([rng.permutation(n)[:4] for _ in range(steps)])

  def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  # reference: explicit SGD with the analytic gradient of mean_{B,C}(-softmax(y) log_softmax(z))
  w, b = start['w'].copy(), start['b'].copy()
  for idx in batches:
    xb, q = x[idx], softmax(labels[idx])
    g = (softmax(xb @ w + b) - q) / (len(idx) * C)
    w, b = w - lr * xb.T @ g, b - lr * g.sum(0)
  dist = lambda p: sum(np.sum((p[k] - target[k]) ** 2) for k in ('w', 'b'))
  expected = dist({'w': w, 'b': b}) / dist(start)

  apply = lambda p, xb: xb @ p['w'] + p['b']
  f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)
  got = trajectory_matching_loss(
    apply, f32(x), f32(labels), jnp.float32(lr), f32(start), f32(target), jnp.asarray(batches)
  )
  np.testing.assert_allclose(float(got), expected, rtol=1e-5)

  # gradients in the learned lr, labels and images against central differences of the NumPy
  # loss (float64)
  def numpy_loss(x_, labels_, lr_):
    w, b = start['w'].copy(), start['b'].copy()
    for idx in batches:
      xb, q = x_[idx], softmax(labels_[idx])
      g = (softmax(xb @ w + b) - q) / (len(idx) * C)
      w, b = w - lr_ * xb.T @ g, b - lr_ * g.sum(0)
    return dist({'w': w, 'b': b}) / dist(start)

  g_x, g_labels, g_lr = jax.grad(trajectory_matching_loss, argnums=(1, 2, 3))(
    apply, f32(x), f32(labels), jnp.float32(lr), f32(start), f32(target), jnp.asarray(batches)
  )
  eps = 1e-5
  dx, dl = rng.normal(size=x.shape), rng.normal(size=labels.shape)
  for got_dir, fn in (
    (float(g_lr), lambda t: numpy_loss(x, labels, lr + t)),
    (float(np.sum(np.asarray(g_x) * dx)), lambda t: numpy_loss(x + t * dx, labels, lr)),
    (float(np.sum(np.asarray(g_labels) * dl)), lambda t: numpy_loss(x, labels + t * dl, lr)),
  ):
    expected_dir = (fn(eps) - fn(-eps)) / (2 * eps)
    np.testing.assert_allclose(got_dir, expected_dir, rtol=2e-3, atol=1e-6)


def test_kip_label_matrix_becomes_a_distribution():
  C = 4
  centred = np.eye(C)[[0, 2]] - 1.0 / C
  np.testing.assert_allclose(kip_label_distribution(centred), np.eye(C)[[0, 2]], atol=1e-7)
  learned = np.array(
    [[0.5, 0.25, -1.0, -1.0], [-1.0, -1.0, -0.5, -2.0], [0.25, 0.0, -1.0, -1.0]], np.float32
  )
  p = kip_label_distribution(learned)
  assert p.dtype == np.float32
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(p[0], [0.75 / 1.25, 0.5 / 1.25, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(p[1], np.eye(C)[2])  # no positive entry -> argmax
  # positive mass below 1 is normalised too, not replaced by the argmax
  np.testing.assert_allclose(p[2], [0.5 / 0.75, 0.25 / 0.75, 0, 0], rtol=1e-6)


def test_the_kip_section_reaches_kip_field_by_field():
  # Every field away from its default, so that a field dropped on the way (KIPConfig's own
  # default taking its place) shows.
  section = hfldd.KIPSection(
    support_size=7,
    iterations=3,
    lr=0.05,
    target_batch=4,
    learn_labels=True,
    kernel='rbf',
    depth=2,
    reg=1e-3,
    x64=True,
  )
  assert all(getattr(section, f) != getattr(hfldd.KIPSection(), f) for f in section._fields)
  kcfg = hfldd.kip_config(section)
  assert {f: getattr(kcfg, f) for f in section._fields} == section._asdict()


def test_the_topology_plot_names_each_clients_classes():
  table = np.array([[3, 0, 2], [0, 0, 1], [0, 0, 0]])
  assert hfldd._client_classes(table) == ['0,2', '2', '']


class _ClientNodes:
  """A client transport (the Flower bridge's interface) whose nodes return given soft labels and
  seeded distilled sets, recording what the server asked for."""

  def __init__(self, soft_labels=None):
    self.soft = soft_labels
    self.asked = []  # soft-label requests
    self.distilled = []  # KIP requests

  def soft_labels(self, num_clients, epochs, public_x):
    self.asked.append((num_clients, epochs, np.asarray(public_x).copy()))
    return self.soft

  def trainer(self, spec, tx, recipe, sizes):
    assert spec == 'mlp', spec  # the nodes build the heads' architecture from its spec
    del recipe, sizes  # the heads train here
    return GroupTrainer(get_model('mlp', 10, (8, 8, 1)), tx, 16)

  def distill(self, members, kip, key):
    self.distilled.append((np.asarray(members).copy(), kip, key))
    rng = np.random.default_rng(0)
    m, s = len(members), kip.support_size
    return (
      rng.random((m, s, 8, 8, 1)).astype(np.float32),
      rng.integers(0, 10, (m, s)).astype(np.int32),
      rng.normal(size=(m, s, 10)).astype(np.float32),
      rng.random((m, kip.iterations)).astype(np.float32),
    )


def test_kip_goes_to_the_members_nodes_and_is_read_back_from_the_workdir(tmp_path):
  # With a client transport (Flower), each member distils on its own node: the transport gets
  # the members, the KIP settings and the run's KIP key; the sets it returns are the stage's,
  # cached in the workdir and read back with their dtypes by a resumed run without distilling.
  from jfed.keys import Purpose
  from jfed.kip import KIPConfig

  config = _config()
  kcfg = KIPConfig(support_size=4, iterations=3)
  members = np.array([1, 3, 4])
  nodes = _ClientNodes()
  ctx = driver.context_of_config(config, workdir=tmp_path, client_transport=nodes)
  sets = hfldd.distill_members(ctx, kcfg, members)
  ((sent_members, sent_kip, sent_key),) = nodes.distilled
  np.testing.assert_array_equal(sent_members, members)
  assert sent_kip == kcfg
  np.testing.assert_array_equal(
    jax.random.key_data(sent_key), jax.random.key_data(ctx.derive_key(Purpose.KIP))
  )
  expected = _ClientNodes().distill(members, kcfg, None)
  for got, want in zip(sets, expected):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)

  resumed_nodes = _ClientNodes()
  resumed = driver.context_of_config(config, workdir=tmp_path, client_transport=resumed_nodes)
  again = hfldd.distill_members(resumed, kcfg, members)
  assert not resumed_nodes.distilled  # read back, not distilled again
  for got, want in zip(again, expected):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_images_cross_the_network_as_uint8_or_float32_and_come_back_as_float32():
  x = np.array([[0.0, 0.5], [1.0, 0.25]], np.float64)
  as_float = hfldd.encode_images(x, 'float32')
  assert as_float.dtype == np.float32
  np.testing.assert_array_equal(as_float, x)
  as_bytes = hfldd.encode_images(x, 'uint8')
  assert as_bytes.dtype == np.uint8
  for sent in (as_bytes, x):
    back = hfldd.decode_images(sent)
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, x, atol=0.5 / 255)
  with pytest.raises(ValueError, match=r"image_dtype must be one of .*uint8.*got 'int8'"):
    hfldd.encode_images(x, 'int8')


def test_clients_are_stacked_zero_padded_with_their_sizes():
  xs = [np.ones((3, 2, 2, 1)), 2 * np.ones((1, 2, 2, 1))]  # float64 in, float32 out
  for ys in ([np.array([1, 2, 0]), np.array([4])], [np.eye(3), np.full((1, 3), 0.5)]):
    fed = hfldd.stack_clients(xs, ys)
    assert fed.sizes.dtype == np.int32 and fed.sizes.tolist() == [3, 1]
    assert fed.x.dtype == np.float32 and fed.x.shape == (2, 3, 2, 2, 1)
    assert fed.y.dtype == ys[0].dtype and fed.y.shape == (2, 3, *ys[0].shape[1:])
    np.testing.assert_array_equal(fed.x[1], np.concatenate([xs[1], np.zeros((2, 2, 2, 1))]))
    np.testing.assert_array_equal(fed.y[0], ys[0])
    np.testing.assert_array_equal(fed.y[1, 1:], 0)


def test_members_with_learned_labels_send_their_label_distributions():
  from jfed.kip import KIPConfig

  members = np.array([1, 3])
  nodes = _ClientNodes()
  ctx = driver.context_of_config(_config(), client_transport=nodes)
  cfg = hfldd.HFLDDConfig(kip=hfldd.KIPSection(support_size=4, iterations=3, learn_labels=True))
  uploads = hfldd.member_uploads(ctx, cfg, members, distill=True)
  kcfg = KIPConfig(support_size=4, iterations=3, learn_labels=True)
  ((_, sent_kip, _),) = nodes.distilled
  assert sent_kip == kcfg
  y_matrix = _ClientNodes().distill(members, kcfg, None)[2]
  assert sorted(uploads) == [1, 3]
  for j, cid in enumerate(members):
    np.testing.assert_array_equal(uploads[int(cid)].y, y_matrix[j])


def test_heads_train_on_their_own_data_then_their_members_sets_hard_or_soft():
  # Each head's set: its own samples, then each member's upload in member order; with soft
  # (learned KIP) labels anywhere, every label becomes a float32 distribution: the heads' own
  # labels one-hot and the members' label matrices `kip_label_distribution`.
  import types

  DataUpload = hfldd.DataUpload
  ctx = driver.context_of_config(_config())
  ds = ctx.dataset
  topology = types.SimpleNamespace(heads=np.array([0, 5]), members=[np.array([2]), np.array([])])
  images = np.full((3, 8, 8, 1), 51, np.uint8)  # 0.2 in [0, 1]
  hard = hfldd.hybrid_datasets(ctx, topology, {2: DataUpload(images, np.array([7, 8, 9]))})
  own0, own5 = ctx.parts[0], ctx.parts[5]
  assert hard.sizes.tolist() == [len(own0) + 3, len(own5)]
  assert hard.y.dtype == np.int32
  np.testing.assert_array_equal(hard.y[0, : hard.sizes[0]], np.r_[ds.train_y[own0], 7, 8, 9])
  np.testing.assert_allclose(hard.x[0, len(own0) : hard.sizes[0]], 0.2, rtol=1e-6)
  np.testing.assert_array_equal(hard.x[1, : len(own5)], ds.train_x[own5])

  matrix = np.array([[0.9, -0.1] + [-0.1] * 8] * 3, np.float32)
  soft = hfldd.hybrid_datasets(ctx, topology, {2: DataUpload(images, matrix)})
  assert soft.y.dtype == np.float32 and soft.y.shape[-1] == 10
  np.testing.assert_array_equal(soft.y[1, : len(own5)], np.eye(10)[ds.train_y[own5]])
  np.testing.assert_allclose(
    soft.y[0, len(own0) : soft.sizes[0]], hfldd.kip_label_distribution(matrix), rtol=1e-6
  )


def test_a_member_upload_of_the_wrong_image_dtype_is_refused_naming_the_client(monkeypatch):
  from jfed.io import UploadError

  ctx = driver.context_of_config(_config())
  monkeypatch.setattr(hfldd, 'encode_images', lambda x, dtype: np.asarray(x, np.float32))
  with pytest.raises(UploadError, match='data upload of client 3'):
    hfldd.member_uploads(ctx, hfldd.HFLDDConfig(), np.array([3]), distill=False)


def _unlinked_holdout(config, size):
  # the config ties dataset.holdout_size to hfldd.public_size; a public set drawn from a larger
  # held-out set needs the two apart
  with config.unlocked():
    del config.dataset['holdout_size']
    config.dataset.holdout_size = size
  return config


def test_a_fedseq_public_set_larger_than_the_held_out_set_is_refused_by_name(tmp_path):
  config = _unlinked_holdout(_config(), 60)
  config.fedseq.public_size = 100
  with pytest.raises(ConfigError, match="fedseq.public='holdout' needs 100 training samples"):
    _run('fedseq', config, tmp_path / 'w')
  assert not (tmp_path / 'w').exists()


def test_setup_asks_the_nodes_for_soft_labels_on_the_seeded_public_draw_and_clusters_them():
  from jfed.clustering import build_topology

  config = _unlinked_holdout(
    _config(**{'seed': 3, 'hfldd.symmetric': True, 'hfldd.leftover': 'distribute'}), 100
  )
  rng = np.random.default_rng(1)
  soft = rng.dirichlet(np.full(10, 0.3), size=(NUM_CLIENTS, 60)).astype(np.float32)
  nodes = _ClientNodes(soft)
  ctx = driver.context_of_config(config, client_transport=nodes)
  aux = driver.build_algorithm('hfldd', config).setup(ctx)

  # the public set: 60 of the 100 held-out training samples, drawn with the run's seed
  ds = ctx.dataset
  rows = np.sort(np.random.default_rng(3).choice(100, 60, replace=False))
  ((num_clients, epochs, public_x),) = nodes.asked
  assert (num_clients, epochs) == (NUM_CLIENTS, config.hfldd.pretrain_epochs)
  np.testing.assert_array_equal(public_x, ds.holdout_x[rows])
  np.testing.assert_array_equal(aux.public.y, ds.holdout_y[rows])
  # the nodes' soft labels, clustered with the configured Eq. 4 symmetry and leftover rule
  expected = build_topology(soft, config.hfldd.K, 3, symmetric=True, leftover='distribute')
  plain = build_topology(soft, config.hfldd.K, 3)
  assert not np.allclose(expected.similarity, plain.similarity)
  np.testing.assert_allclose(aux.topology.similarity, expected.similarity)
  assert [c.tolist() for c in aux.topology.clusters] == [c.tolist() for c in expected.clusters]


def test_soft_labels_of_the_wrong_dtype_are_refused_naming_the_client():
  from jfed.io import UploadError

  soft = np.full((NUM_CLIENTS, 60, 10), 0.1, np.float64)  # the nodes should send float32
  ctx = driver.context_of_config(_config(), client_transport=_ClientNodes(soft))
  with pytest.raises(UploadError, match='soft labels of client 0'):
    driver.build_algorithm('hfldd', _config()).setup(ctx)


def test_every_method_of_the_comparison_starts_from_fedavgs_initial_model():
  # HFLDD's tables compare it with FedAvg, FedSeq and DynaFed from one initial global model.
  config = _config()
  ctx = driver.context_of_config(config)
  starts = {}
  for method in ('fedavg', 'hfldd', 'fedseq', 'dynafed'):
    algorithm = driver.build_algorithm(method, config)
    aux = algorithm.setup(ctx)
    state = algorithm.init(ctx, aux)
    starts[method] = getattr(state, 'global_model', getattr(state, 'model', state))
  for method in ('hfldd', 'fedseq', 'dynafed'):
    for a, b in zip(jax.tree.leaves(starts['fedavg']), jax.tree.leaves(starts[method])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # DynaFed's server fine-tunes with the configured DSA and Adam at finetune_lr and batch
  assert aux.tuner.objective == dynafed.FinetuneObjective(dynafed.pixel_dsa(config.dynafed))
  assert aux.tuner.objective.augment is not None
  assert aux.tuner.batch_size == config.dynafed.finetune_batch


def test_when_every_cluster_is_one_client_nothing_is_distilled_and_hfldd_is_fedavg():
  # K = 1: one homogeneous cluster, so every heterogeneous cluster is a single client, its own
  # head. Nothing is distilled, and a round is FedAvg's round over all the clients: the same
  # clients, data orders (the round's key), weights and start.
  from jfed.io import comm

  config = _config(**{'hfldd.K': 1, 'hfldd.rounds': 2, 'fedavg.rounds': 2})
  config.fedavg.local_epochs = config.hfldd.local_epochs
  ctx = driver.context_of_config(config)
  models, auxes = {}, {}
  for method in ('hfldd', 'fedavg'):
    algorithm = driver.build_algorithm(method, config)
    aux = auxes[method] = algorithm.setup(ctx)
    state = algorithm.init(ctx, aux)
    for i in range(2):
      state, _ = algorithm.step(ctx, aux, state, i)
    models[method] = getattr(state, 'global_model', state)
  topo = auxes['hfldd'].topology
  assert sorted(topo.heads.tolist()) == list(range(NUM_CLIENTS))
  assert [c.tolist() for c in topo.clusters] == [[h] for h in topo.heads.tolist()]
  stages = dict(comm.bytes_by_stage(auxes['hfldd'].transfers))
  assert set(stages) == {'soft_labels', 'model_down', 'model_up'}
  for a, b in zip(jax.tree.leaves(models['fedavg']), jax.tree.leaves(models['hfldd'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('key', ['depth', 'reg'])
def test_a_negative_kip_depth_or_ridge_is_refused_by_name(key):
  with pytest.raises(ConfigError, match=f'hfldd.kip.{key} must be >= 0, got -1'):
    driver.build_algorithm('hfldd', _config(**{f'hfldd.kip.{key}': -1}))
