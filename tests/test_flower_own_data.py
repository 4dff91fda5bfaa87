"""SuperNodes that serve their own data (node config `data-dir`, jfed/flower/own_data.py): the
server learns the clients' sizes from the nodes, trains them there and checks what comes back.

Driven in this process through the Flower records (tests/test_flower.py's in-process
transport), without starting Flower."""

import pathlib

import numpy as np
import pytest

pytest.importorskip('flwr')

from jfed.engine import sharding  # noqa: E402
from jfed.errors import ConfigError  # noqa: E402
from jfed.flower import own_data, transport  # noqa: E402
from jfed.flower.settings import (  # noqa: E402
  RunSettings,
  check_settings,
  load_config,
  node_data_dir,
  require_own_data,
)
from jfed.io.uploads import UploadError  # noqa: E402
from tests.test_flower import _InProcessTransport  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / 'experiments' / 'configs' / 'digits.py') + ':smoke'
# Four local epochs: at the smoke budget's one, two rounds of the MLP stay near chance.
OVERRIDES = ['--config.model=mlp', '--config.fedavg.rounds=2', '--config.fedavg.local_epochs=4']
NODES = 2


def _config():
  return load_config(SMOKE, OVERRIDES)


def _write_node_dirs(tmp_path, config, ctx, x_dtype=np.float32):
  """One data-dir per node, written from the seeded partition of `ctx`: node p holds the
  clients of its block, as a whole-dataset SuperNode p would."""
  dirs = []
  for p in range(NODES):
    folder = tmp_path / f'node{p}'
    folder.mkdir()
    clients = {}
    for c in sharding.client_block(len(ctx.parts), p, NODES):
      x = ctx.dataset.train_x[ctx.parts[c]]
      if x_dtype == np.uint8:
        x = np.round(x * 255).astype(np.uint8)
      clients[c] = (x, ctx.dataset.train_y[ctx.parts[c]])
    own_data.write_clients(str(folder), clients)
    dirs.append(folder)
  return dirs


class _Recording:
  """Wraps an algorithm's step to keep the state of the last one (the final global model)."""

  def __init__(self, algorithm):
    self.state, step = None, algorithm.step

    def recording_step(ctx, aux, state, i):
      state, records = step(ctx, aux, state, i)
      self.state = state
      return state, records

    algorithm.step = recording_step


def _own_data_run(method, config, dirs, nodes=None):
  """`method` over SuperNodes serving `dirs` (in this process), as the ServerApp runs it:
  describe, then the clients as declared; (final params, summary, transport)."""
  from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top
  from jfed.driver import build_algorithm, declared_parts, hold_out, make_context, run  # pylint: disable=g-import-not-at-top

  nodes = nodes or [transport.NodeTrainer.serving(config, str(d)) for d in dirs]
  bridge = _InProcessTransport(nodes)
  dataset = hold_out(config, load_dataset('digits'))
  counts = bridge.describe(config.partition.num_clients, dataset.input_shape, dataset.num_classes)
  ctx = make_context(config, dataset, declared_parts(counts.sum(1)), client_transport=bridge)
  algorithm = build_algorithm(method, config)
  recording = _Recording(algorithm)
  summary = run(algorithm, ctx, progress=False)
  return recording.state.model.params, summary, bridge, counts


@pytest.mark.parametrize('participation', [1.0, 0.4])
def test_fedavg_over_own_data_nodes_gives_the_whole_dataset_result(tmp_path, participation):
  """Two nodes serving files written from the seeded partition end where the whole-dataset
  run over that partition ends (with participation 0.4, a round may ask a node for none of its
  clients)."""
  import jax  # pylint: disable=g-import-not-at-top

  from jfed.driver import build_algorithm, context_of_config, run  # pylint: disable=g-import-not-at-top

  config = load_config(SMOKE, OVERRIDES + [f'--config.fedavg.participation={participation}'])
  seeded = context_of_config(config)
  dirs = _write_node_dirs(tmp_path, config, seeded)
  params, summary, bridge, counts = _own_data_run('fedavg', config, dirs)
  # the server learnt the sizes and label counts from the nodes, not from its own partition
  expected = np.stack([np.bincount(seeded.dataset.train_y[p], minlength=10) for p in seeded.parts])
  np.testing.assert_array_equal(counts, expected)
  assert bridge.own_data == (seeded.dataset.input_shape, 10)
  algorithm = build_algorithm('fedavg', config)  # the whole dataset, in this process
  whole = context_of_config(config)
  recording = _Recording(algorithm)
  plain = run(algorithm, whole, progress=False)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(recording.state.model.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  for key in ('final_test_accuracy', 'total_bytes'):
    assert summary[key] == plain[key], key
  assert summary['final_test_accuracy'] > 0.15  # it learns (chance is 0.1)


def test_fedprox_runs_on_uint8_own_data(tmp_path):
  """uint8 images are scaled by 1/255 on the node; FedProx's anchor crosses as in simulation."""
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top

  config = load_config(SMOKE, ['--config.model=mlp'])
  dirs = _write_node_dirs(tmp_path, config, context_of_config(config), x_dtype=np.uint8)
  _, summary, bridge, _ = _own_data_run('fedprox', config, dirs)
  assert summary['final_test_accuracy'] is not None
  assert len(bridge.exchange_seconds) == 1 + config.fedprox.rounds  # describe, then the rounds


def _one_client(tmp_path, name='client_0.npz', **arrays):
  folder = tmp_path / 'data'
  folder.mkdir(exist_ok=True)
  np.savez(folder / name, **arrays)
  return folder


def _images(n=3, shape=(8, 8, 1)):
  return np.random.default_rng(0).uniform(size=(n, *shape)).astype(np.float32)


@pytest.mark.parametrize(
  'name,arrays,message',
  [
    ('client_0.npz', {'x': _images(3, (8, 8)), 'y': np.zeros(3, int)}, r'x has shape \[3, 8, 8\]'),
    ('client_0.npz', {'x': _images(), 'y': np.zeros(2, int)}, r'y has shape \[2\], expected \[3\]'),
    ('client_0.npz', {'x': _images(), 'y': np.zeros(3, np.float32)}, 'y is float32'),
    ('client_0.npz', {'x': _images() * 3, 'y': np.zeros(3, int)}, r'x spans \[0.*, 2.*\]'),
    ('client_0.npz', {'x': _images() * np.nan, 'y': np.zeros(3, int)}, 'non-finite'),
    ('client_0.npz', {'x': _images().astype(np.int32), 'y': np.zeros(3, int)}, 'x is int32'),
    ('client_0.npz', {'x': _images(0), 'y': np.zeros(0, int)}, 'holds no samples'),
    ('client_0.npz', {'y': np.zeros(3, int)}, 'no x array'),
    ('client_0.npz', {'x': _images(), 'y': -np.ones(3, int)}, 'negative label -1'),
    ('client_9.npz', {'x': _images(), 'y': np.zeros(3, int)}, r'client 9 is not in \[0, 5\)'),
  ],
)
def test_a_bad_client_file_is_one_line_naming_it(tmp_path, name, arrays, message):
  folder = _one_client(tmp_path, name, **arrays)
  with pytest.raises(ConfigError, match=message) as e:
    own_data.load_clients(str(folder), 5)
  assert str(folder / name) in str(e.value) and '\n' not in str(e.value)


def test_a_pickled_object_array_is_refused_not_unpickled(tmp_path):
  folder = tmp_path / 'data'
  folder.mkdir()
  x = np.empty(3, object)
  x[:] = [_images(1)[0]] * 3
  np.savez(folder / 'client_1.npz', x=x, y=np.zeros(3, int))  # pickles the object array
  with pytest.raises(ConfigError, match=r'client_1\.npz: holds an object array \(a pickle\)'):
    own_data.load_clients(str(folder), 5)


def test_a_missing_empty_or_unreadable_data_dir_is_one_line(tmp_path):
  with pytest.raises(ConfigError, match=r'^node config data-dir=.*nowhere: no such directory$'):
    own_data.load_clients(str(tmp_path / 'nowhere'), 5)
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'notes.txt').write_text('not a client')
  with pytest.raises(ConfigError, match='holds no client_<id>.npz file'):
    own_data.load_clients(str(tmp_path / 'empty'), 5)
  (tmp_path / 'bad').mkdir()
  (tmp_path / 'bad' / 'client_2.npz').write_bytes(b'not a zip')
  with pytest.raises(ConfigError, match=r'client_2\.npz: not a readable \.npz file'):
    own_data.load_clients(str(tmp_path / 'bad'), 5)


def test_files_that_do_not_fit_the_runs_dataset_are_refused_at_the_first_message(tmp_path):
  """Image shape and label range need the dataset, which the server sends (describe)."""
  clients = own_data.load_clients(
    str(_one_client(tmp_path, x=_images(3, (4, 4, 1)), y=np.zeros(3, int))), 5
  )
  with pytest.raises(ConfigError, match=r'client_0\.npz: x has images of shape \[4, 4, 1\]'):
    own_data.check_spec(clients, (8, 8, 1), 10)
  clients = own_data.load_clients(
    str(_one_client(tmp_path, 'client_1.npz', x=_images(), y=np.array([0, 10, 2]))), 5
  )
  with pytest.raises(
    ConfigError, match=r'client_1\.npz: y holds the label 10, outside .*\[0, 10\)'
  ):
    own_data.check_spec({1: clients[1]}, (8, 8, 1), 10)
  node = transport.NodeTrainer.serving(_config(), str(tmp_path / 'data'))
  with pytest.raises(ConfigError, match=r'a SuperNode failed: .*x has images of shape \[4, 4, 1\]'):
    _describe([node])


class _Failing(_InProcessTransport):
  """A node's exception comes back as a Flower error reply (as the ClientApp's would)."""

  def _exchange(self, content):
    replies = []
    for node in self.node_trainers:
      try:
        replies.append(_Reply(node.handle(content)))
      except ConfigError as e:
        replies.append(_ErrorReply(f'ConfigError: {e}'))
    return replies


class _Reply:
  def __init__(self, content):
    self.content = content

  def has_error(self):
    return False


class _ErrorReply:
  def __init__(self, reason):
    self.error = type('Error', (), {'reason': reason})()

  def has_error(self):
    return True


def _describe(nodes, num_clients=5):
  return _Failing(nodes).describe(num_clients, (8, 8, 1), 10)


def test_a_client_that_two_nodes_declare_is_refused(tmp_path):
  config = _config()
  rng = np.random.default_rng(0)
  for node, ids in (('a', [0, 1, 2]), ('b', [2, 3, 4])):
    (tmp_path / node).mkdir()
    for c in ids:
      np.savez(tmp_path / node / f'client_{c}.npz', x=_images(4), y=rng.integers(0, 10, 4))
  nodes = [transport.NodeTrainer.serving(config, str(tmp_path / n)) for n in 'ab']
  with pytest.raises(ConfigError, match=r'^client 2 is declared by 2 SuperNodes'):
    _describe(nodes)
  # and a client no node declares
  with pytest.raises(ConfigError, match=r'^no SuperNode declares client\(s\) \[3, 4\]'):
    _describe(nodes[:1])
  assert _describe(nodes[:1], num_clients=3).shape == (3, 10)


def test_the_server_refuses_a_reply_that_trained_on_another_size(tmp_path):
  """A node's reply says how many samples each client trained on: not the declared size is an
  upload error."""
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top

  config = _config()
  dirs = _write_node_dirs(tmp_path, config, context_of_config(config))

  class Lying(transport.NodeTrainer):
    def handle(self, content, setup_seconds=0.0):
      reply = super().handle(content, setup_seconds)
      if 'sizes' in reply['metrics']:
        reply['metrics']['sizes'] = [n + 1 for n in reply['metrics']['sizes']]
      return reply

  honest = transport.NodeTrainer.serving(config, str(dirs[0]))
  lying = Lying.serving(config, str(dirs[1]))
  with pytest.raises(UploadError, match=r'trained on \d+ samples, but the server asked for \d+'):
    _own_data_run('fedavg', config, dirs, nodes=[honest, lying])


def test_a_node_and_a_server_that_disagree_on_whose_data_refuse_in_one_line(tmp_path):
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top

  config = _config()
  seeded = context_of_config(config)
  dirs = _write_node_dirs(tmp_path, config, seeded)
  own = transport.NodeTrainer.serving(config, str(dirs[0]))
  with pytest.raises(ConfigError, match='has no node config data-dir'):
    _describe([transport.NodeTrainer(seeded, 0, 1)])
  simulation = _InProcessTransport([own])
  from jfed.driver import build_algorithm, run  # pylint: disable=g-import-not-at-top

  with pytest.raises(ConfigError, match='serves its own data .* start the run with run config'):
    run(
      build_algorithm('fedavg', config),
      context_of_config(config, client_transport=simulation),
      progress=False,
    )


@pytest.mark.parametrize('method', ['dense', 'hfldd', 'fedmho', 'fedavg_vote'])
def test_a_method_other_than_fedavg_or_fedprox_is_refused_in_one_line(method):
  settings = RunSettings(method, SMOKE, [], '/tmp/w', 2, own_data=True)
  with pytest.raises(ConfigError, match=rf'^own-data=true: {method} cannot run on SuperNodes'):
    check_settings(settings)
  check_settings(settings._replace(own_data=False))  # the simulation runs it
  check_settings(settings._replace(method='fedprox'))


def test_a_label_flip_attack_on_own_data_is_refused():
  config = load_config(SMOKE, ['--config.attack.kind=label_flip', '--config.attack.fraction=0.2'])
  with pytest.raises(ConfigError, match='^own-data=true with attack.kind=label_flip'):
    require_own_data('fedavg', config)
  require_own_data('fedavg', _config())


def test_the_node_config_data_dir():
  assert node_data_dir({'partition-id': 0, 'num-partitions': 2}) is None
  assert node_data_dir({'data-dir': '/data/clients'}) == '/data/clients'
  with pytest.raises(ConfigError, match='data-dir and partition-id'):
    node_data_dir({'data-dir': '/d', 'partition-id': 0, 'num-partitions': 2})
  with pytest.raises(ConfigError, match='expected a directory path'):
    node_data_dir({'data-dir': 3})


@pytest.mark.parametrize(
  'method,layout,message',
  [
    ('fedavg', [[0, 1, 2]], '1 data directories for 2 SuperNodes'),
    ('fedavg', [[0, 1, 2], [2, 3, 4]], r'client 2 has a file in 2 data directories'),
    ('fedavg', [[0, 1], [3, 4]], r'no data directory holds client\(s\) \[2\]'),
    ('dense', [[0, 1, 2], [3, 4]], '^own-data=true: dense cannot run'),
  ],
)
def test_a_bad_own_data_deployment_fails_in_one_line_before_any_flower_process(
  tmp_path, method, layout, message
):
  from jfed.flower.deploy import run_local_deployment  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  dirs = []
  for k, ids in enumerate(layout):
    (tmp_path / f'n{k}').mkdir()
    for c in ids:
      np.savez(tmp_path / f'n{k}' / f'client_{c}.npz', x=_images(4), y=rng.integers(0, 10, 4))
    dirs.append(str(tmp_path / f'n{k}'))
  with pytest.raises(ConfigError, match=message):
    run_local_deployment(method, SMOKE, OVERRIDES, tmp_path / 'w', 2, data_dirs=dirs)
  assert not (tmp_path / 'w').exists()  # nothing started, nothing written


@pytest.mark.slow
def test_fedavg_through_a_local_deployment_of_own_data_supernodes(tmp_path):
  """Real SuperLink and SuperNodes (node config data-dir, run config own-data=true) over files
  written from the seeded partition: the in-process model, and the declared sizes recorded."""
  import json  # pylint: disable=g-import-not-at-top

  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top
  from jfed.flower.deploy import run_local_deployment  # pylint: disable=g-import-not-at-top
  from tests.test_flower import _final_params, _in_process  # pylint: disable=g-import-not-at-top

  config = _config()
  seeded = context_of_config(config)
  dirs = [str(d) for d in _write_node_dirs(tmp_path, config, seeded)]
  flower = tmp_path / 'flower'
  summary = run_local_deployment('fedavg', SMOKE, OVERRIDES, flower, NODES, 600, data_dirs=dirs)
  in_process = tmp_path / 'in_process'
  _in_process('fedavg', in_process, OVERRIDES)
  for a, b in zip(_final_params(flower), _final_params(in_process)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert summary['final_test_accuracy'] > 0.15
  bridge = json.loads((flower / 'flower.json').read_text())
  assert bridge['own_data_client_sizes'] == [len(p) for p in seeded.parts]
  assert bridge['exchanges'] == 1 + config.fedavg.rounds  # describe, then the rounds


def test_exported_node_directories_hold_each_nodes_block_of_the_seeded_partition(tmp_path):
  """`experiments.export_clients` writes what a whole-dataset SuperNode of the same partition id
  would train, in the format `load_clients` reads; a second export into the same directory and
  a node id out of range are refused before anything is written."""
  from experiments import export_clients  # pylint: disable=g-import-not-at-top
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top

  config = _config()
  ctx = context_of_config(config)
  seen = []
  for p in range(NODES):
    export_clients.export(config, str(tmp_path / f'n{p}'), p, NODES)
    loaded = own_data.load_clients(str(tmp_path / f'n{p}'), config.partition.num_clients)
    assert list(loaded) == list(sharding.client_block(len(ctx.parts), p, NODES))
    for c, data in loaded.items():
      np.testing.assert_array_equal(data.x, ctx.dataset.train_x[ctx.parts[c]])
      np.testing.assert_array_equal(data.y, ctx.dataset.train_y[ctx.parts[c]])
    seen += list(loaded)
  assert sorted(seen) == list(range(len(ctx.parts)))
  with pytest.raises(ConfigError, match='already holds client'):
    export_clients.export(config, str(tmp_path / 'n0'), 0, NODES)
  with pytest.raises(ConfigError, match='partition_id=2'):
    export_clients.export(config, str(tmp_path / 'bad'), 2, NODES)
  assert not (tmp_path / 'bad').exists()
