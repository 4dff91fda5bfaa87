"""HFLDD, HFLDD w/o DD, FedSeq and DynaFed end to end on digits through the driver: learning,
outputs, Eq. 18 / 19 byte accounting, resume without distilling again, config checks; the MTT
loss (value and gradients against NumPy), DynaFed's DSA in matching and fine-tuning, its client
optimiser, and the KIP label distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfed import driver, engine
from jfed.engine import GroupTrainer
from jfed.errors import ConfigError
from jfed.methods import dynafed, hfldd
from jfed.methods.dynafed import trajectory_matching_loss
from jfed.methods.hfldd import kip_label_distribution
from jfed.models.registry import get_model
from tests.support import (
  HFLDD_CLIENTS,
  Interrupted,
  hfldd_tiny_config,
  interrupt_after,
  read_metrics,
)

CHANCE = 0.1  # ten classes
NUM_CLIENTS = HFLDD_CLIENTS


def _config(**overrides):
  return hfldd_tiny_config(**overrides)


def _iid(**overrides):
  return _config(**{'partition.k': 10, **overrides})


def _run(method, config, workdir):
  return driver.run_experiment(method, config, workdir, progress=False)


@pytest.fixture(scope='module')
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
  assert summary.final_test_accuracy > CHANCE + 0.4, summary.final_test_accuracy
  assert (
    summary['eval_samples'] == 360
  )  # the whole test split; the public set is held-out training data

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
  assert records[0]['upload_bytes'] == stages['confidence']
  # per round: one download per superclient, n_c - 1 hand-offs, one upload: N + S model copies
  for r in records[1:]:
    assert r['download_bytes'] == r['upload_bytes'] == len(superclients) * summary['model_bytes']
    assert (
      r['download_bytes'] + r['peer_bytes'] + r['upload_bytes']
      == (NUM_CLIENTS + len(superclients)) * summary['model_bytes']
    )


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
    module,
    model,
    x,
    labels,
    2,
    jax.random.key(2),
  )
  reference = dynafed.finetune(
    GroupTrainer(module, tx, 4, objective=dynafed.FinetuneObjective()),
    module,
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
    ('dynafed', {'dynafed.weighting': 'median'}, 'dynafed.weighting'),
    ('dynafed', {'dynafed.expert_epochs': 5}, 'expert_epochs'),
    ('dynafed', {'dynafed.ipc': 0}, 'dynafed.ipc must be positive'),
    ('dynafed', {'dynafed.dsa': 'color_blur'}, "dynafed.dsa: unknown DSA transform.*'blur'"),
    ('dynafed', {'dynafed.client_optimizer': 'rmsprop'}, 'dynafed.client_optimizer'),
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
  learned = np.array([[0.5, 0.25, -1.0, -1.0], [-1.0, -1.0, -0.5, -2.0]])
  p = kip_label_distribution(learned)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(p[0], [0.75 / 1.25, 0.5 / 1.25, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(p[1], np.eye(C)[2])  # no positive entry -> argmax
