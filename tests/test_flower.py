"""The Flower bridge: a real local deployment (SuperLink and two SuperNodes as separate
processes on localhost) gives the in-process result, and a one-shot method completes through it.

The request/reply encoding and a node's refusals are tested in this process."""

import json
import os
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip('flwr')

from jfed.data.federated import federate  # noqa: E402
from jfed.engine import sharding  # noqa: E402
from jfed.errors import ConfigError  # noqa: E402
from jfed.flower import transport  # noqa: E402
from tests.support import read_metrics  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / 'experiments' / 'configs' / 'digits.py') + ':smoke'


def test_each_client_is_held_by_exactly_one_supernode():
  for clients, nodes in [(5, 2), (7, 3), (2, 4), (20, 1)]:
    held = [list(sharding.client_block(clients, p, nodes)) for p in range(nodes)]
    assert sorted(c for block in held for c in block) == list(range(clients))


def test_a_train_request_survives_its_flower_records():
  rng = np.random.default_rng(0)
  request = transport.TrainRequest(
    spec='mlp',
    recipe='{"kind": "classifier", "prox_mu": 0.01}',
    client_ids=np.array([3, 1]),
    sizes=np.array([5, 0]),
    digests=['a', 'b'],
    epochs=2,
    key=np.array([0, 42], np.uint32),
    start=[rng.normal(size=(3, 4)).astype(np.float32), np.zeros(4, np.float32)],
    start_shared=True,
    anchor=[np.ones((3, 4), np.float32)],
  )
  back = transport.TrainRequest.from_records(request.to_records())
  for name in ('spec', 'recipe', 'epochs', 'start_shared', 'digests'):
    assert getattr(back, name) == getattr(request, name)
  for name in ('client_ids', 'sizes', 'key'):
    np.testing.assert_array_equal(getattr(back, name), getattr(request, name))
  for a, b in zip(back.start + back.anchor, request.start + request.anchor):
    np.testing.assert_array_equal(a, b)


def test_the_digest_of_a_client_sees_its_samples_and_labels():
  x = np.arange(24, dtype=np.float32).reshape(6, 2, 2, 1)
  y = np.array([0, 1, 2, 0, 1, 2])
  fed = federate(x, y, [np.arange(3), np.arange(3, 6)])
  base = transport.client_digests(fed, range(2))
  assert base[0] != base[1]
  flipped = fed._replace(y=np.where(fed.y == 0, 1, fed.y))
  assert transport.client_digests(flipped, range(2))[0] != base[0]
  fewer = fed._replace(sizes=np.array([2, 3], np.int32))
  assert transport.client_digests(fewer, range(2)) == [
    transport.client_digests(fewer, [0])[0],
    base[1],
  ]


def test_a_node_refuses_to_train_a_client_on_data_it_does_not_hold():
  from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top
  from jfed.driver import hold_out, make_context, partition_clients  # pylint: disable=g-import-not-at-top
  from jfed.flower.settings import load_config  # pylint: disable=g-import-not-at-top

  config = load_config(SMOKE, ['--config.model=mlp'])
  dataset = hold_out(config, load_dataset('digits'))
  ctx = make_context(config, dataset, partition_clients(config, dataset.train_y))
  node = transport.NodeTrainer(ctx, 0, 2)
  recipe = '{"kind": "classifier", "prox_mu": 0.0, "optimizer_steps": 0}'
  request = transport.TrainRequest(
    'mlp', recipe, np.array([0]), np.array([5]), ['not-it'], 1, np.array([0, 0], np.uint32),
    [], True, None,
  )  # fmt: skip
  with pytest.raises(ConfigError, match='data other than their partition'):
    node.train(request)
  with pytest.raises(ConfigError, match='partition-id 2'):
    transport.NodeTrainer(ctx, 2, 2)


def _in_process(method, workdir, overrides=()):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  command = [sys.executable, '-m', 'experiments.main', f'--method={method}', f'--config={SMOKE}']
  subprocess.run(
    command + list(overrides) + [f'--workdir={workdir}'], cwd=ROOT, check=True, timeout=600
  )


def _final_params(workdir):
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(workdir / 'checkpoints', item_names=('state', 'history'))
  step = manager.latest_step()
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  return [np.asarray(a) for a in jax.tree.leaves(state['state'])]


@pytest.mark.slow
def test_fedavg_through_a_local_flower_deployment_gives_the_in_process_model(tmp_path):
  from jfed.flower.deploy import run_local_deployment  # pylint: disable=g-import-not-at-top

  flower = tmp_path / 'flower'
  summary = run_local_deployment('fedavg', SMOKE, [], flower, 2, timeout_s=600)
  in_process = tmp_path / 'in_process'
  _in_process('fedavg', in_process)
  for a, b in zip(_final_params(flower), _final_params(in_process)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  accuracies = [r['test_accuracy'] for r in read_metrics(flower) if 'test_accuracy' in r]
  assert accuracies == [
    r['test_accuracy'] for r in read_metrics(in_process) if 'test_accuracy' in r
  ]
  assert summary['final_test_accuracy'] > 0.3  # it learns (chance is 0.1)
  bridge = json.loads((flower / 'flower.json').read_text())
  assert bridge['supernodes'] == 2 and bridge['message_bytes_received'] > 0
  # jfed's own accounting of the uploads, as in one process
  assert (
    summary['total_bytes'] == json.loads((in_process / 'summary.json').read_text())['total_bytes']
  )


@pytest.mark.slow
def test_dense_completes_through_a_local_flower_deployment_with_validated_uploads(tmp_path):
  from jfed.flower.deploy import run_local_deployment  # pylint: disable=g-import-not-at-top

  summary = run_local_deployment('dense', SMOKE, [], tmp_path / 'dense', 2, timeout_s=600)
  records = read_metrics(tmp_path / 'dense')
  uploads = [r for r in records if r['step'] == 0 and r.get('upload_bytes')]
  assert uploads and uploads[0]['upload_bytes'] > 0  # validated and counted by the server
  assert summary['final_test_accuracy'] is not None


@pytest.mark.slow
def test_fedmho_with_cvae_clients_on_the_supernodes_gives_the_in_process_result(tmp_path):
  from jfed.flower.deploy import run_local_deployment  # pylint: disable=g-import-not-at-top

  fedmho = str(ROOT / 'experiments' / 'configs' / 'fedmho_digits.py') + ':smoke'
  flower = run_local_deployment('fedmho', fedmho, [], tmp_path / 'flower', 2, timeout_s=600)
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  subprocess.run(
    [sys.executable, '-m', 'experiments.main', '--method=fedmho', f'--config={fedmho}']
    + [f'--workdir={tmp_path / "in_process"}'],
    cwd=ROOT,
    check=True,
    timeout=600,
  )
  in_process = json.loads((tmp_path / 'in_process' / 'summary.json').read_text())
  # classifier and CVAE clients trained on the nodes: the server's stage sees the same uploads
  for key in ('final_test_accuracy', 'best_test_accuracy', 'total_bytes'):
    assert flower[key] == in_process[key], key
  assert json.loads((tmp_path / 'flower' / 'flower.json').read_text())['exchanges'] == 2


class _Reply:
  def __init__(self, content):
    self.content = content

  def has_error(self):
    return False


class _InProcessTransport(transport.FlowerTransport):
  """The server's transport with 'SuperNodes' that are NodeTrainers in this process: the
  requests and replies still go through their Flower records."""

  def __init__(self, node_trainers):
    self.node_trainers = node_trainers
    super().__init__(grid=self, num_nodes=len(node_trainers))

  def get_node_ids(self):  # the grid's one method wait_for_nodes uses
    return list(range(len(self.node_trainers)))

  def _exchange(self, content):
    return [_Reply(node.handle(content)) for node in self.node_trainers]


def _smoke_context(*overrides, **kwargs):
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top
  from jfed.flower.settings import load_config  # pylint: disable=g-import-not-at-top

  # Four local epochs: at the smoke budget's one, two rounds of the MLP stay near chance.
  config = load_config(SMOKE, ['--config.model=mlp', '--config.fedprox.local_epochs=4', *overrides])
  return config, context_of_config(config, **kwargs)


class _WireTap(_InProcessTransport):
  """Keeps every reply's arrays as they cross the wire (Flower records, decoded)."""

  def __init__(self, node_trainers):
    super().__init__(node_trainers)
    self.replies = []

  def _exchange(self, content):
    replies = super()._exchange(content)
    for r in replies:
      if 'arrays' in r.content and 'metrics' in r.content:
        ids = list(r.content['metrics']['client_ids'])
        self.replies.append((content, ids, r.content['arrays'].to_numpy_ndarrays()))
    return replies


def test_local_dp_clips_and_noises_each_update_on_the_node_before_it_replies(monkeypatch):
  """dp.local under the bridge: what crosses the wire is already clipped and noised (the
  server never holds a clean update, and does not privatise it again)."""
  from jfed.driver import build_algorithm, run  # pylint: disable=g-import-not-at-top
  from jfed.engine import privacy  # pylint: disable=g-import-not-at-top

  clip, z = 1e-3, 1.0
  dp = ['--config.dp.enabled=True', '--config.dp.local=True', '--config.fedavg.rounds=1']
  dp += [f'--config.dp.clip_norm={clip}', f'--config.dp.noise_multiplier={z}']
  config, node_ctx = _smoke_context(*dp)
  callers = []
  privatize = privacy.privatize_locally

  def counted(*args, **kwargs):
    callers.append(sys._getframe(1).f_globals['__name__'])  # pylint: disable=protected-access
    return privatize(*args, **kwargs)

  monkeypatch.setattr(privacy, 'privatize_locally', counted)
  tap = _WireTap([transport.NodeTrainer(node_ctx, p, 2) for p in range(2)])
  _, ctx = _smoke_context(*dp, client_transport=tap)
  run(build_algorithm('fedavg', config), ctx, progress=False)
  assert callers and set(callers) == {'jfed.flower.transport'}  # the nodes, never the server

  request, ids, arrays = tap.replies[0]
  start = np.concatenate([a.ravel() for a in request['arrays'].to_numpy_ndarrays()])
  # the same request without local DP: the node's clean training result
  clean_request = transport.TrainRequest.from_records(request)
  recipe = json.loads(clean_request.recipe)
  del recipe['local_dp']
  clean_request.recipe = json.dumps(recipe, sort_keys=True)
  clean_reply = transport.NodeTrainer(node_ctx, 0, 2).train(clean_request)
  clean = clean_reply['arrays'].to_numpy_ndarrays()
  for row in range(len(ids)):
    sent = np.concatenate([a[row].ravel() for a in arrays]) - start
    trained = np.concatenate([a[row].ravel() for a in clean]) - start
    # the clean update is far larger than C; what was sent is C-clipped plus N(0, (zC)^2 I)
    assert np.linalg.norm(trained) > 100 * clip
    assert np.std(sent) == pytest.approx(z * clip, rel=0.1)
    assert abs(np.mean(sent)) < 0.1 * z * clip


def test_fedprox_through_the_transport_gives_the_in_process_summary():
  from jfed.driver import build_algorithm, run  # pylint: disable=g-import-not-at-top

  config, node_ctx = _smoke_context()
  flower = _InProcessTransport([transport.NodeTrainer(node_ctx, p, 2) for p in range(2)])
  _, ctx = _smoke_context(client_transport=flower)
  bridged = run(build_algorithm('fedprox', config), ctx, progress=False)
  _, plain_ctx = _smoke_context()
  plain = run(build_algorithm('fedprox', config), plain_ctx, progress=False)
  for key in ('final_test_accuracy', 'best_test_accuracy', 'total_bytes'):
    assert bridged[key] == plain[key], key
  assert bridged['final_test_accuracy'] > 0.15  # it learns: 2 rounds of an MLP, chance 0.1
  assert len(flower.exchange_seconds) == 2 and flower.bytes_received > flower.bytes_sent > 0


def test_a_client_no_supernode_holds_stops_the_run():
  from jfed.driver import build_algorithm, run  # pylint: disable=g-import-not-at-top

  config, node_ctx = _smoke_context()
  missing_one = _InProcessTransport([transport.NodeTrainer(node_ctx, 0, 2)])  # node 1 of 2
  _, ctx = _smoke_context(client_transport=missing_one)
  with pytest.raises(ConfigError, match='no SuperNode holds client'):
    run(build_algorithm('fedavg', config), ctx, progress=False)


class _DroppingTransport(_InProcessTransport):
  """The last SuperNode's reply to the second exchange is lost (a node that went away)."""

  def _exchange(self, content):
    replies = super()._exchange(content)
    return replies[:-1] if len(self.exchange_seconds) == 1 else replies


def test_fedavg_goes_on_without_a_supernode_that_did_not_reply_when_allowed():
  """min-supernodes (Flower's min_fit_clients): round 2 aggregates the clients that came back,
  records the dropped ones, and counts only the uploads that arrived; without it the run stops
  naming the missing nodes."""
  from jfed.driver import build_algorithm, run  # pylint: disable=g-import-not-at-top

  config, node_ctx = _smoke_context()
  nodes = [transport.NodeTrainer(node_ctx, p, 2) for p in range(2)]
  held_by_last = sorted(int(c) for c in nodes[-1].owned)
  strict = _DroppingTransport(nodes)
  _, ctx = _smoke_context(client_transport=strict)
  with pytest.raises(ConfigError, match=r'^1 of 2 SuperNodes did not reply .*at least 2 must'):
    run(build_algorithm('fedavg', config), ctx, progress=False)
  tolerant = _DroppingTransport(nodes)
  tolerant.min_nodes = 1
  _, ctx = _smoke_context(client_transport=tolerant)
  algorithm, rounds = build_algorithm('fedavg', config), []
  step = algorithm.step

  def recording_step(ctx, aux, state, i):
    state, records = step(ctx, aux, state, i)
    rounds.extend(records)
    return state, records

  algorithm.step = recording_step
  run(algorithm, ctx, progress=False)
  assert tolerant.dropped == [[], held_by_last]
  assert [r.get('dropped_clients', []) for r in rounds] == [[], held_by_last]
  n = len(node_ctx.parts)
  assert [r['clients'] for r in rounds] == [n, n - len(held_by_last)]
  assert rounds[1]['upload_bytes'] * n == rounds[0]['upload_bytes'] * (n - len(held_by_last))


def test_going_on_without_supernodes_is_refused_for_a_method_that_needs_every_client():
  from jfed.flower.settings import RunSettings, check_settings  # pylint: disable=g-import-not-at-top

  check_settings(RunSettings('fedprox', SMOKE, [], '/tmp/w', 3, 2))
  with pytest.raises(ConfigError, match='^min-supernodes=2 < supernodes=3: dense needs every'):
    check_settings(RunSettings('dense', SMOKE, [], '/tmp/w', 3, 2))
  with pytest.raises(ConfigError, match=r'^min-supernodes must be in \[0, supernodes = 3\]'):
    check_settings(RunSettings('fedavg', SMOKE, [], '/tmp/w', 3, 4))


@pytest.mark.slow  # HFLDD's four phases through the Flower bridge end to end (README: slow set)
@pytest.mark.parametrize('method', ['hfldd', 'hfldd_nodd'])
def test_hfldd_phases_through_the_transport_give_the_in_process_summary(method):
  """Soft labels, KIP on the members' nodes and the heads' hybrid data all cross the bridge."""
  from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top
  from jfed.driver import build_algorithm, hold_out, make_context, partition_clients, run  # pylint: disable=g-import-not-at-top
  from tests.support import hfldd_tiny_config  # pylint: disable=g-import-not-at-top

  config = hfldd_tiny_config()
  dataset = hold_out(config, load_dataset('digits'))
  parts = partition_clients(config, dataset.train_y)
  nodes = [transport.NodeTrainer(make_context(config, dataset, parts), p, 3) for p in range(3)]
  bridge = _InProcessTransport(nodes)
  bridged = run(
    build_algorithm(method, config), make_context(config, dataset, parts, client_transport=bridge)
  )
  plain = run(build_algorithm(method, config), make_context(config, dataset, parts))
  for key in ('final_test_accuracy', 'best_test_accuracy', 'total_bytes', 'clusters', 'heads'):
    assert bridged[key] == plain[key], key
  assert bridged['final_test_accuracy'] > 0.3  # it learns (chance is 0.1)
  # soft labels, KIP (hfldd only), then one exchange per round
  rounds = config.hfldd.rounds
  assert len(bridge.exchange_seconds) == (2 if method == 'hfldd' else 1) + rounds


@pytest.mark.parametrize(
  'method,overrides,message',
  [
    ('dynafed', [], 'does not run through Flower'),
    ('fedavg', ['--config.fedavg.rounds=0'], 'rounds'),
  ],
)
def test_a_bad_deployment_fails_in_one_line_before_any_flower_process(
  tmp_path, method, overrides, message
):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  run = subprocess.run(
    [sys.executable, '-m', 'experiments.main', f'--method={method}', f'--config={SMOKE}']
    + overrides
    + [f'--workdir={tmp_path / "w"}', '--flower_supernodes=2'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 1
  lines = run.stderr.strip().splitlines()
  assert lines[-1].startswith('error: ') and message in lines[-1]
  assert not (tmp_path / 'w' / 'flower_logs').exists()  # nothing started


class _RecordingTransport(_InProcessTransport):
  def __init__(self, node_trainers):
    self.sent, self.replies = [], []
    super().__init__(node_trainers)

  def _exchange(self, content):
    self.sent.append(content)
    replies = super()._exchange(content)
    self.replies.extend(r.content for r in replies)
    return replies


def test_fedprox_messages_have_the_record_layout_flower_mods_wrap():
  """One ArrayRecord (the start model; FedProx's anchor is that model, not sent again) and one
  ConfigRecord out; `arrays` and a `metrics` MetricRecord with `num-examples` back."""
  from jfed.driver import build_algorithm, run  # pylint: disable=g-import-not-at-top

  config, node_ctx = _smoke_context()
  flower = _RecordingTransport([transport.NodeTrainer(node_ctx, p, 2) for p in range(2)])
  _, ctx = _smoke_context(client_transport=flower)
  run(build_algorithm('fedprox', config), ctx, progress=False)
  for content in flower.sent:
    assert list(content.array_records) == ['arrays'] and list(content.config_records) == ['config']
    assert content['config']['anchor_is_start']
  for k, reply in enumerate(flower.replies):
    assert 'arrays' in reply.array_records and list(reply.metric_records) == ['metrics']
    asked = flower.sent[k // 2]['config']  # two nodes' replies per request
    sizes = dict(zip(asked['client_ids'], asked['sizes']))
    clients = list(reply['metrics']['client_ids'])
    assert clients and reply['metrics']['num-examples'] == sum(sizes[c] for c in clients)


def test_a_local_deployment_streams_the_servers_lines_as_they_come(tmp_path):
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  from jfed.flower.deploy import stream_command  # pylint: disable=g-import-not-at-top

  arrivals = []
  code = 'import time; print("round 1", flush=True); time.sleep(2); print("round 2")'
  start = time.monotonic()
  status = stream_command(
    [sys.executable, '-c', code], dict(os.environ), str(tmp_path), tmp_path / 'log', 60,
    echo=lambda line: arrivals.append((line, time.monotonic() - start)),
  )  # fmt: skip
  assert status == 0 and [line for line, _ in arrivals] == ['round 1\n', 'round 2\n']
  assert arrivals[1][1] - arrivals[0][1] > 1.5  # the first line did not wait for the end
  assert (tmp_path / 'log').read_text() == 'round 1\nround 2\n'
  with pytest.raises(ConfigError, match='ran past'):
    stream_command([sys.executable, '-c', 'import time; time.sleep(30)'], dict(os.environ),
                   str(tmp_path), tmp_path / 'log2', 1)  # fmt: skip
