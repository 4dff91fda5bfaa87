"""One-shot distillation methods (DENSE, FedDF, Co-Boosting, OT, FedHydra) end to end on digits.

Budgets are tiny (experiments/configs/fedhydra_digits.py:smoke): the tests check that every
method runs, writes its outputs, resumes exactly and runs multi-round / heterogeneous, and that
FedHydra's model stratification finds each 2c/c client's own classes (seed 000 Fig. 5b); they
do not check accuracy. Most of their time is XLA:CPU compilation.
"""
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import fedhydra_digits
from jfed.data import load_dataset
from jfed import engine
from jfed.distill import (MSConfig, TeacherGroup, fedhydra_global_loss, kd_loss, make_generator,
                          model_stratification_loop, model_stratification_python)
from jfed.io import Checkpointer
from jfed.methods import available_methods, oneshot
from jfed.methods.fedhydra import resolve_ms_impl
from jfed.methods.ot import fusion_layers
from jfed.models import get_model
from jfed.models.layers import BatchNorm
from jfed.runner import partition_clients, run_experiment
from tests.support import override


def _config(arg='smoke', **overrides):
  return override(fedhydra_digits.get_config(arg), **overrides)


@pytest.fixture(scope='module')
def local_dir(tmp_path_factory):
  """One set of client models (Dir(0.5), smoke budget) shared by the homogeneous tests."""
  return str(tmp_path_factory.mktemp('shared') / 'local_models')


def _records(workdir):
  records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  for r in records:
    r.pop('seconds', None)
  return records


# ----------------------------------------------------------------------------- pure pieces

def test_kd_losses_match_the_distill_blocks():
  rng = np.random.default_rng(0)
  s, t = (jnp.asarray(rng.normal(size=(6, 4)) * 2, jnp.float32) for _ in range(2))
  kl = oneshot.KDConfig(loss='kl', T=20.0, t_squared=True)
  np.testing.assert_allclose(jnp.mean(oneshot.per_sample_loss(kl, s, t)), kd_loss(s, t, 20.0),
                             rtol=1e-5)
  hydra = oneshot.KDConfig(loss='fedhydra', T=1.0, beta=0.5)
  np.testing.assert_allclose(jnp.mean(oneshot.per_sample_loss(hydra, s, t)),
                             fedhydra_global_loss(s, t, beta=0.5), rtol=1e-5)


def test_student_lr_schedules():
  cos = oneshot.OptConfig(lr=0.1, schedule='cosine_epochs')
  assert oneshot.learning_rate(cos, 0, 10) == pytest.approx(0.1)
  assert oneshot.learning_rate(cos, 5, 10) == pytest.approx(0.05)
  steps = oneshot.OptConfig(lr=0.1, schedule='cosine_steps')
  assert oneshot.learning_rate(steps, 0, 4, step=100, total_steps=100) == pytest.approx(0.0)
  with pytest.raises(ValueError, match='schedule'):
    oneshot.learning_rate(oneshot.OptConfig(schedule='step'), 0, 1)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Conv(1, (3, 3))(x)


class _Residual(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    return nn.Dense(10)(_Block()(x).reshape(x.shape[0], -1))


def test_ot_fusion_layers_and_ms_impl():
  layers = fusion_layers(get_model('cnn_mnist', 10, (8, 8, 1)), (8, 8, 1), jax.random.PRNGKey(0))
  assert [(l.name, l.bn) for l in layers] == [('Conv_0', 'BatchNorm_0'),
                                              ('Conv_1', 'BatchNorm_1'), ('Dense_0', None)]
  with pytest.raises(ValueError, match='sequential'):   # a residual block is a submodule
    fusion_layers(_Residual(), (8, 8, 1), jax.random.PRNGKey(0))
  assert resolve_ms_impl('auto', 'cpu') == 'python'
  assert resolve_ms_impl('auto', 'gpu') == 'batched'
  assert {'dense', 'feddf', 'coboosting', 'ot', 'fedhydra'} <= set(available_methods())


class _TinyConv(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = nn.relu(BatchNorm()(nn.Conv(3, (3, 3))(x), train, mask))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_python_ms_equals_the_scan_forms():
  module = _TinyConv()
  states = engine.init_models(module, (8, 8, 1), jax.random.PRNGKey(0), 2, same_init=False)
  gen = make_generator((8, 8, 1), nz=8, ngf=4)
  cfg = MSConfig(T_G=4, batch_size=4, lr=1e-2)
  key = jax.random.PRNGKey(7)
  groups = [TeacherGroup(module, states), TeacherGroup(module, engine.take(states, np.array([1])))]
  want = model_stratification_loop(groups, gen, 3, key, cfg)
  got = model_stratification_python(groups, gen, 3, key, cfg)
  np.testing.assert_allclose(got.losses, want.losses, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got.U_r, want.U_r, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize('method', ['dense', 'feddf', 'coboosting', 'ot'])
def test_method_runs_end_to_end(tmp_path, local_dir, method):
  summary = run_experiment(method, _config(local_models_dir=local_dir), tmp_path)
  for name in ('config.json', 'metrics.jsonl', 'summary.json', 'accuracy.png', 'checkpoints'):
    assert (tmp_path / name).exists(), name
  records = _records(tmp_path)
  assert 0.0 <= summary['final_test_accuracy'] <= 1.0
  assert summary['best_test_accuracy'] >= max(r['test_accuracy'] for r in records) - 1e-9
  assert len(summary['client_test_accuracy']) == 5
  if method == 'ot':
    assert summary['step_name'] == 'round' and len(records) == 1
    assert 'plain_average_test_accuracy' in records[0]
    return
  assert summary['step_name'] == 'epoch'
  assert [r['step'] for r in records] == [1, 2] and [r['epoch'] for r in records] == [1, 2]
  assert all(np.isfinite(r['kd_loss']) for r in records)
  assert (tmp_path / 'distillation_accuracy.png').exists()
  if method != 'feddf':   # synthesis methods: a growing pool and a sample grid
    assert [r['pool_size'] for r in records] == [16, 32]
    assert (tmp_path / 'synthetic_samples.png').exists()
  if method == 'coboosting':
    w = np.asarray(summary['ensemble_weights'])
    assert w.shape == (5,) and np.all((w >= 0) & (w <= 1))
  if method == 'feddf':
    assert 'val_accuracy' in records[-1] and summary['eval_samples'] == 360 - 40 - 20


def test_fedhydra_2c_per_client_ms_finds_each_clients_classes(tmp_path):
  """Fig. 5b: with the 2c/c partition, the MS weight of class j peaks at the client owning j."""
  config = _config('disjoint,smoke')
  summary = run_experiment('fedhydra', config, tmp_path)
  for name in ('model_stratification.npz', 'ms_heatmap.png', 'distillation_accuracy.png',
               'synthetic_samples.png', 'metrics.jsonl'):
    assert (tmp_path / name).exists(), name
  assert summary['step_name'] == 'epoch' and len(_records(tmp_path)) == 2
  ds = load_dataset('digits')
  parts = partition_clients(config, ds.train_y)
  owner = {int(j): k for k, p in enumerate(parts) for j in np.unique(ds.train_y[p])}
  with np.load(tmp_path / 'model_stratification.npz') as f:
    U_r, U = f['U_r_by_client'], f['U_by_client']     # [classes, clients], global client ids
  np.testing.assert_allclose(U_r.sum(1), 1.0, rtol=1e-5)
  hits_r = sum(int(np.argmax(U_r[j])) == owner[j] for j in range(10))
  hits_u = sum(int(np.argmax(U[j])) == owner[j] for j in range(10))
  assert hits_r >= 8 and hits_u >= 8, (hits_r, hits_u, U_r.round(2))
  assert np.asarray(summary['U_r_by_client']).shape == (10, 5)


def test_heterogeneous_five_architectures_with_resnet18_server(tmp_path):
  summary = run_experiment('fedhydra', _config('hetero,smoke'), tmp_path)
  assert summary['server_model'].startswith('resnet18')
  assert [s.split(':')[0] for s in summary['client_models']] == [
      'googlenet', 'resnet18', 'fedhydra_cnn3', 'cnn_mnist', 'lenet']
  assert len(summary['client_test_accuracy']) == 5
  with np.load(tmp_path / 'model_stratification.npz') as f:
    assert f['U_r'].shape == (10, 5)
  assert 0.0 <= summary['final_test_accuracy'] <= 1.0


class _Interrupted(Exception):
  pass


@pytest.mark.parametrize('method', ['dense', 'coboosting', 'feddf', 'fedhydra'])
def test_interrupted_distillation_resumes_to_the_same_result(tmp_path, monkeypatch, local_dir,
                                                             method):
  """Killed right after the epoch-1 checkpoint, restarted: the same metrics and final model
  (student, pool, kept generator, Co-Boosting weights, FedDF best model, FedHydra MS)."""
  config = _config(local_models_dir=local_dir)
  whole = run_experiment(method, config, tmp_path / 'whole')
  save = Checkpointer.save

  def save_then_die(self, step, state):   # a kill right after the server checkpoint of epoch 1
    save(self, step, state)
    if self.directory.name == 'checkpoints' and step == 1:
      raise _Interrupted()
  with monkeypatch.context() as m:
    m.setattr(Checkpointer, 'save', save_then_die)
    with pytest.raises(_Interrupted):
      run_experiment(method, config, tmp_path / 'resumed')
  assert len(_records(tmp_path / 'resumed')) == 1
  resumed = run_experiment(method, config, tmp_path / 'resumed')
  assert resumed['final_test_accuracy'] == whole['final_test_accuracy']
  assert _records(tmp_path / 'resumed') == _records(tmp_path / 'whole')


def test_multi_round_dense(tmp_path, local_dir):
  summary = run_experiment('dense', _config('rounds=2,smoke', local_models_dir=local_dir),
                           tmp_path)
  records = _records(tmp_path)
  assert [(r['round'], r['epoch'], r['step']) for r in records] == [
      (1, 1, 1), (1, 2, 2), (2, 1, 3), (2, 2, 4)]
  assert len(summary['round_test_accuracy']) == 2 and summary['rounds'] == 2
  assert (tmp_path / 'round_models').exists()
  assert summary['final_test_accuracy'] == summary['round_test_accuracy'][-1]


def test_oneshot_fedavg_averages_the_shared_local_models(tmp_path, local_dir):
  """`fedavg.reuse_local_models` (the Table 1/2 sweep): one-shot FedAvg is the size-weighted
  average of the very client models the distillation methods start from."""
  config = _config(local_models_dir=local_dir, **{'fedavg.reuse_local_models': True})
  summary = run_experiment('fedavg', config, tmp_path / 'fedavg')   # fills local_dir if empty
  assert summary['reused_local_models'] and summary['rounds'] == 1

  ds = load_dataset('digits')
  parts = partition_clients(config, ds.train_y)
  module = get_model(config.model, ds.num_classes, ds.input_shape)
  template = engine.init_models(module, ds.input_shape, jax.random.PRNGKey(0), len(parts))
  step, (models,) = Checkpointer(pathlib.Path(local_dir)).restore_latest([template])
  assert step == config.fedavg.local_epochs
  average = engine.weighted_average(models, np.array([len(p) for p in parts]))
  want = engine.Evaluator(module, 256).accuracy(average, ds.test_x, ds.test_y)
  assert summary['final_test_accuracy'] == pytest.approx(want, abs=1e-6)

  with pytest.raises(ValueError, match='rounds = 1'):
    run_experiment('fedavg', override(config, **{'fedavg.rounds': 2}), tmp_path / 'bad')
