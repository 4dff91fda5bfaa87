"""The foundation methods through the runner: FedProx vs FedAvg, heterogeneous groups, input
errors found with the data, and server-side upload validation. (Resume, workdir and command-line
cases: tests/test_driver.py.)"""

import numpy as np
import pytest

from jfed import engine
from jfed.configs import digits
from jfed.driver import run_experiment
from jfed.errors import ConfigError
from jfed.io import ModelUpload, UploadError, validate_model_upload
from jfed.methods import available_methods, get_method
from tests.support import override, read_metrics


def _config(**overrides):
  c = digits.get_config('smoke')
  c.fedavg.rounds = 3
  return override(c, **overrides)


def test_fedprox_and_fedavg_differ_only_by_the_proximal_term(tmp_path):
  """With mu = 0 FedProx is FedAvg: every round's record (losses, accuracy) is the same; with
  mu > 0 the proximal term changes the local training, so the records differ."""
  # The MLP: what is compared does not depend on the model, and with the smoke config's CNN the
  # three runs (FedAvg, FedProx at two mu) took 18 s of CPU instead of 11, most of it compiling.
  c = _config(**{'model': 'mlp', 'fedprox.rounds': 2, 'fedavg.rounds': 2, 'fedprox.mu': 0.0})
  c.fedprox.local_epochs = c.fedavg.local_epochs
  a = run_experiment('fedavg', c, tmp_path / 'a', progress=False)
  b = run_experiment('fedprox', c, tmp_path / 'b', progress=False)
  numbers = lambda w: [
    {k: v for k, v in r.items() if isinstance(v, float) and 'second' not in k and k != 'time'}
    for r in read_metrics(w)
  ]
  same, prox = numbers(tmp_path / 'a'), numbers(tmp_path / 'b')
  assert any('loss' in k for r in same for k in r)
  assert [sorted(r) for r in same] == [sorted(r) for r in prox]
  for ra, rb in zip(same, prox):
    for k in ra:
      assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), k
  c.fedprox.mu = 1.0
  run_experiment('fedprox', c, tmp_path / 'c', progress=False)
  moved = numbers(tmp_path / 'c')
  assert any(abs(ra[k] - rc[k]) > 1e-4 for ra, rc in zip(same, moved) for k in ra if 'loss' in k), (
    'a proximal term of mu=1 changed no loss'
  )
  assert a['final_test_accuracy'] == pytest.approx(b['final_test_accuracy'])


def test_local_runs_heterogeneous_clients_as_groups(tmp_path):
  c = _config(client_models='cnn_mnist;mlp', **{'partition.scheme': 'iid', 'local.epochs': 3})
  summary = run_experiment('local', c, tmp_path, progress=False)
  assert len(summary['client_test_accuracy']) == 5
  assert summary['mean_test_accuracy'] > 0.3  # IID clients learn: well above chance (0.1)
  assert summary.final_test_accuracy == pytest.approx(summary['mean_test_accuracy'])
  assert (tmp_path / 'local_models').exists()


def test_parameter_averaging_rejects_mixed_architectures(tmp_path):
  with pytest.raises(ConfigError, match='one architecture'):
    run_experiment('fedavg', _config(client_models='cnn_mnist;lenet'), tmp_path, progress=False)


def test_unknown_method_lists_the_valid_ones():
  with pytest.raises(ConfigError, match='valid methods: .*fedavg'):
    get_method('fedsgd')
  assert {'fedavg', 'fedprox', 'centralized', 'local'} <= set(available_methods())


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'partition.num_clients': 5000}, 'clients'),
    ({'partition.scheme': 'shards', 'partition.k': 11}, 'k'),
    ({'dataset.name': 'mnist', 'dataset.data_dir': '/nonexistent'}, 'IDX'),
  ],
)
def test_input_errors_found_with_the_data_have_clear_messages(tmp_path, overrides, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    run_experiment('fedavg', _config(**overrides), tmp_path, progress=False)


def test_server_rejects_malformed_uploads():
  template = engine.ModelState({'w': np.zeros((2, 3), np.float32)}, {})
  ok = ModelUpload(0, 10, engine.ModelState({'w': np.ones((2, 3), np.float32)}, {}))
  validate_model_upload(ok, template)
  bad_shape = ok._replace(model=engine.ModelState({'w': np.ones((3, 2), np.float32)}, {}))
  with pytest.raises(UploadError, match=r'expected float32\[2, 3\]'):
    validate_model_upload(bad_shape, template)
  with pytest.raises(UploadError, match='non-finite'):
    validate_model_upload(
      ok._replace(model=engine.ModelState({'w': np.full((2, 3), np.nan, np.float32)}, {})), template
    )
  with pytest.raises(UploadError, match='structure'):
    validate_model_upload(
      ok._replace(model=engine.ModelState({'v': np.ones((2, 3))}, {})), template
    )
  with pytest.raises(UploadError, match='num_samples'):
    validate_model_upload(ok._replace(num_samples=0), template)
