"""Runs that span two JAX processes (coordinator on localhost, gloo CPU collectives) give what
one process gives: the engine's sharded group, and FedAvg on digits through experiments.main."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import multihost_worker
from tests.support import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _run_processes(commands, timeout=TIMEOUT_S):
  """Starts one process per command, waits for all (killing all past `timeout`), and fails the
  test with the tails of their output when any fails."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  procs = [
    subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for c in commands
  ]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout)
      outputs.append(out.decode(errors='replace'))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f'process {i} exited with {p.returncode}:\n{out[-3000:]}'
  return outputs


def _leaves(params):
  return [np.asarray(a) for a in jax.tree.leaves(params)]


@pytest.mark.slow  # two processes started end to end (README: the slow set)
def test_a_sharded_group_spans_two_processes_and_trains_as_in_one(tmp_path):
  coordinator = f'localhost:{_free_port()}'
  _run_processes(
    [
      [sys.executable, '-m', 'tests.multihost_worker', coordinator, '2', str(i), str(tmp_path)]
      for i in range(2)
    ]
  )
  results = [np.load(tmp_path / f'process{i}.npz') for i in range(2)]
  for r in results:
    assert r['mesh_processes'].tolist() == [0, 1]
    assert not bool(r['group_fully_addressable'])  # each process holds only its own shards
  for strategy in multihost_worker.STRATEGIES:
    params, loss = multihost_worker.train_toy_group(strategy)  # one process, no mesh
    for r in results:  # every process ends with the whole group, as trained in one process
      np.testing.assert_allclose(r[f'{strategy}_loss'], loss, rtol=1e-5, atol=1e-6)
      for i, leaf in enumerate(_leaves(params)):
        np.testing.assert_allclose(r[f'{strategy}_param{i}'], leaf, rtol=1e-5, atol=1e-6)


def _final_state(workdir):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(workdir / 'checkpoints', item_names=('state', 'history'))
  step = manager.latest_step()
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  return step, state['state']


@pytest.mark.slow
def test_fedavg_on_digits_across_two_processes_ends_with_the_single_process_parameters(tmp_path):
  command = [
    sys.executable,
    '-m',
    'experiments.main',
    '--method=fedavg',
    '--config=experiments/configs/digits.py:smoke',
    '--config.shard=True',
  ]
  coordinator = f'localhost:{_free_port()}'
  two = tmp_path / 'two_processes'
  outputs = _run_processes(
    [
      command
      + [f'--workdir={two}', f'--coordinator={coordinator}', '--num_processes=2']
      + [f'--process_id={i}']
      for i in range(2)
    ]
  )
  assert 'fedavg done' in outputs[0] and 'fedavg done' not in outputs[1]  # process 0 reports
  one = tmp_path / 'one_process'
  _run_processes([command + [f'--workdir={one}']])
  step_two, state_two = _final_state(two)
  step_one, state_one = _final_state(one)
  assert step_two == step_one == 2
  for a, b in zip(_leaves(state_two), _leaves(state_one)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  two_acc = [r['test_accuracy'] for r in read_metrics(two) if 'test_accuracy' in r]
  one_acc = [r['test_accuracy'] for r in read_metrics(one) if 'test_accuracy' in r]
  assert two_acc == pytest.approx(one_acc) and two_acc[-1] > 0.3  # it learns (chance is 0.1)
  assert (two / 'summary.json').exists() and (two / 'accuracy.png').exists()


def test_launch_flags_that_do_not_go_together_are_refused():
  from jfed.engine import multihost  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  with pytest.raises(ConfigError, match='go together'):
    multihost.initialize('localhost:1234', None, 0)
  with pytest.raises(ConfigError, match='not in'):
    multihost.initialize('localhost:1234', 2, 2)


def test_every_process_ends_with_one_error_when_process_0_cannot_claim_the_workdir(tmp_path):
  not_a_directory = tmp_path / 'file'
  not_a_directory.write_text('')
  coordinator = f'localhost:{_free_port()}'
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        '-m',
        'experiments.main',
        '--method=fedavg',
        '--config=experiments/configs/digits.py:smoke',
        f'--workdir={not_a_directory}',
        f'--coordinator={coordinator}',
        '--num_processes=2',
        f'--process_id={i}',
      ],
      cwd=ROOT,
      env=env,
      stderr=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
    )
    for i in range(2)
  ]
  try:
    errors = [p.communicate(timeout=TIMEOUT_S)[1].decode() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [1, 1]  # neither waits forever for the other
  assert 'is not a directory' in errors[0]
  assert 'error: process 0 could not claim the workdir' in errors[1]
