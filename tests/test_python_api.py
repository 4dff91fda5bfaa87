"""jfed's Python API (`jfed.run`, `jfed.config`, jfed/runs.py): what a notebook user calls."""

import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jfed
from jfed.data import load_dataset
from jfed.errors import ConfigError, DataError


def _smoke(**overrides):
  config = jfed.config('digits', 'smoke')
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  return config


def _same(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b)))


def _largest_difference(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope='module')
def digits():
  return load_dataset('digits')


def test_run_returns_the_model_it_scored_and_every_record(digits, capsys):
  result = jfed.run('fedavg', _smoke(**{'fedavg.rounds': 2}))
  assert capsys.readouterr() == ('', '')  # progress=False: no progress lines either
  assert [r['step'] for r in result.history] == [1, 2]
  accuracy = result.model.accuracy(digits.test_x, digits.test_y)
  assert accuracy == pytest.approx(result.summary['final_test_accuracy'], abs=1e-9)
  assert result.history[-1]['test_accuracy'] == pytest.approx(accuracy, abs=1e-9)
  # the model is a plain flax module and its variables: applied by hand it predicts the same
  logits = result.model.module.apply(
    result.model.state.variables(), digits.test_x[:50], train=False
  )
  np.testing.assert_array_equal(np.argmax(logits, -1), result.model.predict(digits.test_x[:50]))
  assert _same(result.state.model, result.model.state)


def test_a_users_optax_transformation_trains_the_clients():
  """With optax.set_to_zero() no client's weights move, so one round and two rounds end with
  the same global weights (BatchNorm's running statistics still move); with the configured SGD
  they do not (the control)."""

  def final(rounds, tx):
    return jfed.run('fedavg', _smoke(**{'fedavg.rounds': rounds}), client_optimizer=tx).model

  frozen = final(1, optax.set_to_zero()), final(2, optax.set_to_zero())
  assert _largest_difference(frozen[0].state.params, frozen[1].state.params) < 1e-6  # averaging
  trained = final(1, None), final(2, None)
  assert _largest_difference(trained[0].state.params, trained[1].state.params) > 1e-3


def test_own_arrays_are_checked_and_trained_on(digits):
  d = digits
  result = jfed.run(
    'centralized',
    _smoke(**{'dataset.holdout_size': 0}),
    dataset=((d.train_x[..., 0] * 255).astype(np.uint8), d.train_y, d.test_x, d.test_y),
  )
  assert result.summary['final_test_accuracy'] > 0.5  # 2 epochs on all of digits
  with pytest.raises(DataError, match=r'\[0, 1\]'):
    jfed.run('fedavg', _smoke(), dataset=(d.train_x * 2, d.train_y, d.test_x, d.test_y))
  with pytest.raises(DataError, match='labels'):
    jfed.run('fedavg', _smoke(), dataset=(d.train_x, d.train_y[:10], d.test_x, d.test_y))


def test_a_workdir_run_resumes_and_gives_the_same_result_back(tmp_path):
  config = _smoke(**{'fedavg.rounds': 2})
  first = jfed.run('fedavg', config, workdir=str(tmp_path / 'run'))
  assert (tmp_path / 'run' / 'summary.json').exists()
  again = jfed.run('fedavg', config, workdir=str(tmp_path / 'run'))  # complete: read back
  assert _same(first.model.state, again.model.state)
  assert [r['test_accuracy'] for r in again.history] == [r['test_accuracy'] for r in first.history]


def test_refusals_are_one_clear_line(tmp_path):
  with pytest.raises(ConfigError, match='in memory only'):
    jfed.run('fedavg', _smoke(), workdir=str(tmp_path), client_optimizer=optax.sgd(0.1))
  with pytest.raises(ConfigError, match='GradientTransformation'):
    jfed.run('fedavg', _smoke(), client_optimizer='adam')
  with pytest.raises(ConfigError, match='digits, fashion_mnist'):
    jfed.config('digitz')
  assert not list(tmp_path.iterdir())


def test_the_command_line_takes_a_config_by_name(tmp_path):
  command = [sys.executable, '-m', 'jfed', '--method=fedavg', f'--workdir={tmp_path / "w"}']
  ok = subprocess.run(
    command + ['--config=digits:smoke', '--config.fedavg.rounds=1'],
    capture_output=True,
    text=True,
    check=False,
  )
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert (tmp_path / 'w' / 'summary.json').exists()
  bad = subprocess.run(command + ['--config=digitz'], capture_output=True, text=True, check=False)
  assert bad.returncode != 0
  assert bad.stderr.strip().splitlines()[-1].startswith("error: config 'digitz'")


@pytest.mark.slow  # a smoke run of each (10-40 s apiece on 2 cores)
@pytest.mark.parametrize('method', ['centralized', 'feddf', 'dense', 'hfldd', 'fedseq', 'dynafed'])
def test_every_server_model_is_the_one_the_run_scored(method, digits):
  result = jfed.run(method, _smoke())
  assert result.model is not None
  want = result.summary['final_test_accuracy']
  assert result.model.accuracy(digits.test_x, digits.test_y) == pytest.approx(want, abs=1e-9)
