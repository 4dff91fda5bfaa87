"""The runner and the foundation methods: outputs, resume, heterogeneity, errors for bad input."""
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.configs import digits
from jfed import engine
from jfed.io import ModelUpload, UploadError, validate_model_upload
from jfed.methods import available_methods, get_method
from jfed.runner import run_experiment
from tests.support import Interrupted, interrupt_after, override, read_metrics


def _config(**overrides):
  c = digits.get_config('smoke')
  c.fedavg.rounds = 3
  return override(c, **overrides)


def test_fedavg_writes_every_output(tmp_path):
  summary = run_experiment('fedavg', _config(), tmp_path)
  for name in ('config.json', 'metrics.jsonl', 'summary.json', 'accuracy.png', 'partition.txt',
               'partition.png', 'checkpoints'):
    assert (tmp_path / name).exists(), name
  assert len(read_metrics(tmp_path)) == 3
  assert summary['backend'] == jax.default_backend()
  assert 0.0 <= summary['final_test_accuracy'] <= 1.0
  assert summary['total_bytes'] > 0


@pytest.mark.parametrize('method,interrupt_at', [('fedavg', 2), ('centralized', 1)])
def test_interrupted_run_resumes_to_the_same_result(tmp_path, monkeypatch, method, interrupt_at):
  config = _config()
  whole = run_experiment(method, config, tmp_path / 'whole')
  with monkeypatch.context() as m:
    interrupt_after(m, interrupt_at)
    with pytest.raises(Interrupted):
      run_experiment(method, config, tmp_path / 'resumed')
  assert len(read_metrics(tmp_path / 'resumed')) == interrupt_at
  resumed = run_experiment(method, config, tmp_path / 'resumed')
  assert resumed['final_test_accuracy'] == whole['final_test_accuracy']
  assert read_metrics(tmp_path / 'resumed') == read_metrics(tmp_path / 'whole')


def test_fedprox_and_fedavg_differ_only_by_the_proximal_term(tmp_path):
  c = _config(**{'fedprox.rounds': 1, 'fedavg.rounds': 1, 'fedprox.mu': 0.0})
  c.fedprox.local_epochs = c.fedavg.local_epochs
  a = run_experiment('fedavg', c, tmp_path / 'a')
  b = run_experiment('fedprox', c, tmp_path / 'b')
  assert a['final_test_accuracy'] == pytest.approx(b['final_test_accuracy'])


def test_local_runs_heterogeneous_clients_as_groups(tmp_path):
  c = _config(client_models='cnn_mnist;lenet;mlp', **{'partition.scheme': 'iid',
                                                       'local.epochs': 3})
  summary = run_experiment('local', c, tmp_path)
  assert len(summary['client_test_accuracy']) == 5
  assert summary['mean_test_accuracy'] > 0.3  # IID clients learn: well above chance (0.1)
  assert (tmp_path / 'local_models').exists()


def test_parameter_averaging_rejects_mixed_architectures(tmp_path):
  with pytest.raises(ValueError, match='one architecture'):
    run_experiment('fedavg', _config(client_models='cnn_mnist;lenet'), tmp_path)


def test_resume_with_another_config_is_refused(tmp_path):
  run_experiment('fedavg', _config(**{'fedavg.rounds': 1}), tmp_path)
  with pytest.raises(ValueError, match='different config'):
    run_experiment('fedavg', _config(**{'fedavg.rounds': 1, 'seed': 7}), tmp_path)


def test_unknown_method_lists_the_valid_ones():
  with pytest.raises(ValueError, match='valid methods: .*fedavg'):
    get_method('fedsgd')
  assert {'fedavg', 'fedprox', 'centralized', 'local'} <= set(available_methods())


@pytest.mark.parametrize('overrides,message', [
    ({'partition.num_clients': 5000}, 'clients'),
    ({'partition.alpha': -1.0}, 'alpha'),
    ({'partition.scheme': 'shards', 'partition.k': 11}, 'k'),
    ({'partition.scheme': 'zipf'}, 'valid'),
    ({'dataset.name': 'mnist', 'dataset.data_dir': '/nonexistent'}, 'IDX'),
    ({'model': 'transformer'}, 'valid'),
    ({'strategy': 'pmap'}, 'valid'),
])
def test_bad_input_fails_with_a_clear_message(tmp_path, overrides, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    run_experiment('fedavg', _config(**overrides), tmp_path)


def test_main_reports_errors_without_a_traceback(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.main', '--method=nope',
       '--config=experiments/configs/digits.py:smoke', f'--workdir={tmp_path}'],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert 'Unknown method' in proc.stderr and 'fedavg' in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_server_rejects_malformed_uploads():
  template = engine.ModelState({'w': np.zeros((2, 3), np.float32)}, {})
  ok = ModelUpload(0, 10, engine.ModelState({'w': np.ones((2, 3), np.float32)}, {}))
  validate_model_upload(ok, template)
  bad_shape = ok._replace(model=engine.ModelState({'w': np.ones((3, 2), np.float32)}, {}))
  with pytest.raises(UploadError, match=r'expected float32\[2, 3\]'):
    validate_model_upload(bad_shape, template)
  with pytest.raises(UploadError, match='non-finite'):
    validate_model_upload(ok._replace(model=engine.ModelState(
        {'w': np.full((2, 3), np.nan, np.float32)}, {})), template)
  with pytest.raises(UploadError, match='structure'):
    validate_model_upload(ok._replace(model=engine.ModelState({'v': np.ones((2, 3))}, {})),
                          template)
  with pytest.raises(UploadError, match='num_samples'):
    validate_model_upload(ok._replace(num_samples=0), template)
