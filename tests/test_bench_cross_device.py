"""experiments/bench/cross_device.py: each side runs at a tiny size, DrJAX's round is FedAvg."""

import ast
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.bench import cross_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {'clients': 20, 'cohort': 4, 'rounds': 2, 'seed': 0}


@pytest.fixture(scope='module')
def tiny_data(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('cross_device'))
  # synthetic: Fashion-MNIST cut into 20 clients would train 3,000 samples per client
  meta = cross_device.prepare_data(directory, 20, eval_size=50, synthetic=True, samples=400)
  return directory, meta


def test_prepare_data_writes_equal_iid_index_lists(tiny_data):
  directory, meta = tiny_data
  data = cross_device.load_data(directory)
  parts = cross_device.client_parts(data)
  assert meta == {'dataset': 'synthetic', 'train': 400, 'eval': 50}
  assert [len(p) for p in parts] == [20] * 20
  assert sorted(np.concatenate(parts)) == list(range(400))


def test_cohort_batches_pad_the_last_batch_and_shorter_clients():
  parts = [np.arange(5), np.arange(5, 12), np.arange(12, 21)]
  idx, mask, sizes = cross_device.cohort_batches(parts, [2, 0], 4, np.random.default_rng(0))
  assert idx.shape == mask.shape == (2, 3, 4)
  assert mask.sum(axis=(1, 2)).tolist() == [9, 5] and sizes.tolist() == [9, 5]
  assert sorted(idx[0][mask[0]]) == list(range(12, 21))
  assert sorted(idx[1][mask[1]]) == list(range(5))
  assert not mask[1, 2].any()  # client 0's third step is all padding
  # a cohort of clients smaller than a batch trains on batches of their own size
  idx, mask, _ = cross_device.cohort_batches(
    [np.arange(6)] * 3, [0, 1], 32, np.random.default_rng(0)
  )
  assert idx.shape == (2, 1, 6) and mask.all()


def _reference_fedavg(module, params, stats, x, y, client_rows, lr, momentum):
  """FedAvg of one round without DrJAX, masks or optax: each client's real rows batch by batch,
  SGD with momentum and the weighted mean in NumPy (flax only for the gradients)."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  def loss(p, s, xb, yb):
    logits, new = module.apply(
      {'params': p, 'batch_stats': s}, xb, train=True, mutable=['batch_stats']
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), new['batch_stats']

  grad = jax.jit(jax.grad(loss, has_aux=True))
  trained, sizes = [], []
  for batches in client_rows:
    p = jax.tree.map(np.asarray, params)
    s = jax.tree.map(np.asarray, stats)
    trace = jax.tree.map(np.zeros_like, p)
    for rows in batches:
      g, s = grad(p, s, x[rows], y[rows])
      trace = jax.tree.map(lambda t, gi: np.asarray(gi) + momentum * t, trace, g)
      p = jax.tree.map(lambda a, t: a - lr * t, p, trace)
    trained.append((p, jax.tree.map(np.asarray, s)))
    sizes.append(sum(len(r) for r in batches))
  w = np.asarray(sizes, np.float64) / sum(sizes)
  mean = lambda trees: jax.tree.map(lambda *leaves: sum(wi * l for wi, l in zip(w, leaves)), *trees)
  return mean([t[0] for t in trained]), mean([t[1] for t in trained])


def test_drjax_round_is_size_weighted_fedavg_of_each_clients_sgd():
  pytest.importorskip('drjax')
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jfed.models import get_model  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  x = rng.random((21, 8, 8, 1), dtype=np.float32)
  y = rng.integers(0, 10, 21).astype(np.int32)
  # unequal sizes: a partial last batch (5 = 4 + 1) and a client with a wholly padded step
  parts = [np.arange(5), np.arange(5, 12), np.arange(12, 21)]
  module = get_model('cnn_mnist', 10, (8, 8, 1))
  variables = module.init(jax.random.key(1), jnp.zeros((1, 8, 8, 1)), train=False)
  params, stats = variables['params'], variables['batch_stats']
  lr, momentum = 0.05, 0.9
  idx, mask, sizes = cross_device.cohort_batches(parts, [0, 1, 2], 4, rng)
  got = cross_device.make_drjax_round(module, 3, lr, momentum)(
    params, stats, x[idx], y[idx], mask, sizes
  )
  rows = [
    [idx[j, s][mask[j, s]] for s in range(idx.shape[1]) if mask[j, s].any()] for j in range(3)
  ]
  want = _reference_fedavg(module, params, stats, x, y, rows, lr, momentum)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), want[0], params))
  assert max(moved) > 1e-3  # the round trained
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=2e-5)


# 7 s on 2 cores at load 4 (two tiny FedAvg runs, mostly compiling)
def test_jfed_and_drjax_sides_give_finite_round_times(tiny_data):
  pytest.importorskip('drjax')
  directory, _ = tiny_data
  spec = {**TINY, 'data': directory}
  for run in (cross_device.run_jfed, cross_device.run_drjax):
    result = run(spec)
    assert len(result['round_seconds']) == 2, result
    assert all(math.isfinite(s) and s > 0 for s in result['round_seconds']), result
    assert result['median_round_s'] == result['round_seconds'][1]
    assert 0.0 <= result['accuracy'] <= 1.0 and result['backend'] in ('cpu', 'gpu', 'tpu')


def test_flower_model_has_jfeds_parameter_count():
  pytest.importorskip('torch')
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from experiments.bench import flower_sim_side  # pylint: disable=g-import-not-at-top
  from jfed.models import get_model, param_count  # pylint: disable=g-import-not-at-top

  module = get_model('cnn_mnist', 10, (28, 28, 1))
  variables = module.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)), train=False)
  assert flower_sim_side.num_params(flower_sim_side.CNNMnist()) == param_count(variables['params'])


def test_flower_side_imports_nothing_of_jfed():
  tree = ast.parse(cross_device.FLOWER_SIDE.read_text())
  modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  assert 'torch' in modules and not [m for m in modules if m.split('.')[0] == 'jfed']


def test_tree_memory_counts_a_child_process():
  # a grandchild that touches 80 MB for a second and a half
  grandchild = 'import time; b = bytearray(80 << 20); b[::4096] = bytes(20480); time.sleep(1.5)'
  child = f'import subprocess, sys; subprocess.run([sys.executable, "-c", {grandchild!r}])'
  proc = subprocess.Popen([sys.executable, '-c', child])
  memory = cross_device.TreeMemory(proc.pid, interval=0.05)
  proc.wait(timeout=60)
  memory.stop()
  assert memory.peak_mb > 70 and memory.peak_processes == 2


def test_report_gives_the_ratios_and_the_errors():
  meta = {
    'date': '2026-01-01',
    'command': 'python -m experiments.bench.cross_device',
    'dataset': 'synthetic',
    'cohort': 4,
    'rounds': 2,
    'lr': 0.01,
    'momentum': 0.9,
    'eval_size': 50,
    'cpus': 2,
    'load_start': 1.0,
    'commit': 'abc',
    'jfed_uncommitted': [],
  }
  row = {'clients': 20, 'backend': 'cpu', 'first_round_s': 3.0, 'peak_tree_mb': 500.0}
  row.update(own_maxrss_mb=400.0, accuracy=0.5, load_start=1.0, device='cpu')
  rows = [
    {**row, 'system': 'jfed', 'median_round_s': 0.5},
    {**row, 'system': 'drjax', 'median_round_s': 1.0},
    {'system': 'flower', 'clients': 20, 'load_start': 1.0, 'error': 'no venv'},
  ]
  md = cross_device.report({'meta': meta, 'rows': rows})
  assert '| 20 | 0.50 | n/a |' in md
  assert '| 20 | Flower (Ray, PyTorch) | error: no venv |' in md


@pytest.mark.slow  # 30-60 s: Ray starts its processes and actors
@pytest.mark.skipif(
  not os.path.exists(cross_device.FLOWER_PYTHON),
  reason="no Flower simulation venv (experiments/bench/cross_device.py's --flower_python)",
)
def test_flower_side_runs_fedavg_in_the_simulation_engine(tiny_data):
  directory, _ = tiny_data
  spec = {**TINY, 'data': directory, 'lr': 0.01, 'momentum': 0.9}
  spec.update(flower_python=cross_device.FLOWER_PYTHON, flower_cpus=2)
  row = cross_device.run_system('flower', spec, timeout=600)
  assert 'error' not in row, json.dumps(row)
  assert len(row['round_seconds']) == 2 and all(s > 0 for s in row['round_seconds'])
  assert row['num_params'] == 29034 and row['peak_tree_processes'] > 1
  # Ray sends the ClientApp with every message: its code by reference, not the data it reads
  assert row['pickled_client_app_bytes'] < 10_000
