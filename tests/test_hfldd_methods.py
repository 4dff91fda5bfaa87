"""HFLDD, HFLDD w/o DD, FedSeq and DynaFed end to end on digits through the driver: learning,
outputs, Eq. 18 / 19 byte accounting, resume without distilling again, config checks; the MTT
loss and the KIP label distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver
from jfed.errors import ConfigError
from jfed.methods import hfldd
from jfed.methods.dynafed import trajectory_matching_loss
from jfed.methods.hfldd import kip_label_distribution
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
  assert summary['eval_samples'] == 360 - 60  # the public split is not evaluated on

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
  assert sum(summary['hybrid_sizes']) == 1437  # every training image, once
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
  summary = _run('dynafed', _iid(), tmp_path)
  assert summary.final_test_accuracy > CHANCE + 0.4, summary.final_test_accuracy
  records = read_metrics(tmp_path)
  assert [r['step'] for r in records] == [1, 2, 3]
  assert summary['distilled'] and summary['num_synthetic'] == 10
  last = records[-1]  # round T + 1 = 3: distilled, then fine-tuned after aggregation
  assert np.isfinite(last['matching_loss_first']) and np.isfinite(last['matching_loss_last'])
  assert 'test_accuracy_before_finetune' in last
  assert all('matching_loss_first' not in r for r in records[:-1])
  stages = summary['bytes_by_stage']
  assert stages['model_up'] == stages['model_down'] == sum(r['upload_bytes'] for r in records)
  assert summary.total_bytes == sum(stages.values()) == records[-1]['cumulative_bytes'] > 0
  assert len({r['upload_bytes'] for r in records}) == 1  # every client, every round


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
  grads = jax.grad(trajectory_matching_loss, argnums=(1, 2, 3))(
    apply, f32(x), f32(labels), jnp.float32(lr), f32(start), f32(target), jnp.asarray(batches)
  )
  assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in grads)


def test_kip_label_matrix_becomes_a_distribution():
  C = 4
  centred = np.eye(C)[[0, 2]] - 1.0 / C
  np.testing.assert_allclose(kip_label_distribution(centred), np.eye(C)[[0, 2]], atol=1e-7)
  learned = np.array([[0.5, 0.25, -1.0, -1.0], [-1.0, -1.0, -0.5, -2.0]])
  p = kip_label_distribution(learned)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(p[0], [0.75 / 1.25, 0.5 / 1.25, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(p[1], np.eye(C)[2])  # no positive entry -> argmax
