"""A SuperNode's long-lived jfed worker (jfed/flower/worker.py, relay.py): the ClientApp process
Flower starts per message imports no JAX and forwards to one worker, which builds the node's
data and trainer once and answers as the node itself would."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip('flwr')

from jfed.errors import ConfigError  # noqa: E402
from jfed.flower import relay, transport  # noqa: E402
from jfed.flower.settings import config_record, keeps_process, load_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / 'experiments' / 'configs' / 'digits.py') + ':smoke'
OVERRIDES = ['--config.model=mlp']


def test_the_client_app_module_imports_no_jax():
  code = (
    'import sys, jfed_client_app, jfed.flower.client_app, jfed.flower.relay; '
    'print("jax" in sys.modules)'
  )
  run = subprocess.run(
    [sys.executable, '-c', code],
    cwd=ROOT / 'jfed' / 'flower' / 'app',  # where Flower imports the App's components
    env={**os.environ, 'PYTHONPATH': str(ROOT)},
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert run.stdout.strip() == 'False'


def test_a_bad_keep_process_node_config_is_one_clear_error():
  assert keeps_process({}) and not keeps_process({'keep-process': False})
  assert not keeps_process({'keep-process': 'false'})
  with pytest.raises(ConfigError, match='keep-process'):
    keeps_process({'keep-process': 'maybe'})


def _request(ctx, config):
  import jax  # pylint: disable=g-import-not-at-top

  from jfed import engine  # pylint: disable=g-import-not-at-top
  from jfed.methods import common  # pylint: disable=g-import-not-at-top

  (group,) = common.client_groups(ctx, np.array([0]))
  model = engine.init_model(group.module, ctx.dataset.input_shape, jax.random.PRNGKey(0))
  recipe = {
    'kind': 'classifier',
    'prox_mu': 0.0,
    'optimizer': config.optimizer.to_dict(),
    'optimizer_steps': 0,
  }
  return transport.TrainRequest(
    group.spec,
    json.dumps(recipe, sort_keys=True),
    np.array([0]),
    np.asarray(group.fed.sizes),
    transport.client_digests(group.fed, [0]),
    1,
    np.array([0, 3], np.uint32),
    [np.asarray(a) for a in jax.tree.leaves(model)],
    True,
    None,
  )


@pytest.mark.slow
def test_a_worker_serves_every_message_in_one_process_as_the_node_would():
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top

  config = load_config(SMOKE, OVERRIDES)
  ctx = context_of_config(config)
  request = _request(ctx, config)
  owner = os.getpid()  # the worker ends with this test process
  share = relay.NodeShare(config_record(config)['config_json'], 0, 2)
  path = relay.socket_path(share, owner)
  first = relay.forward(request.to_records(), share, owner)
  second = relay.forward(request.to_records(), share, owner)
  assert pathlib.Path(path).exists()  # still listening: one process for both messages
  # the node's setup (config, data, partition) counted in the first reply only
  assert first['metrics']['seconds'] > second['metrics']['seconds']
  here = transport.NodeTrainer(ctx, 0, 2).train(request)
  for reply in (first, second):
    assert list(reply['metrics']['client_ids']) == [0]
    for a, b in zip(reply['arrays'].to_numpy_ndarrays(), here['arrays'].to_numpy_ndarrays()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # a request the node refuses comes back as the node's error, and the worker keeps serving
  request.digests = ['not-it']
  with pytest.raises(ConfigError, match='data other than their partition'):
    relay.forward(request.to_records(), share, owner)
  assert pathlib.Path(path).exists()


def test_a_worker_sees_an_unreaped_owner_as_ended():
  """A SuperNode's SuperExec left a zombie (no init reaps it in a container) ends its worker."""
  import time  # pylint: disable=g-import-not-at-top

  owner = subprocess.Popen([sys.executable, '-c', 'pass'])
  deadline = time.monotonic() + 30
  while relay.alive(owner.pid) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not relay.alive(owner.pid)
  assert owner.poll() == 0  # reaped only now: it was a zombie above
  assert relay.alive(os.getpid())
