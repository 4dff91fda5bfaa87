"""The multi-machine Flower recipes of docs/deployment.md, run as written on separate "machines":
the SuperLink, each SuperNode and `flwr run` each in their own network namespace with their own
address, joined by veth pairs on a bridge (no route out of the machine). Two recipes: every
SuperNode rebuilding its clients from the config and seed (`flower-recipe`), and every SuperNode
serving its own clients' files (`flower-recipe-own-data`).

Also, in this process: a SuperNode loads the config the server sends, not a file at the same
path (the rule the recipe no longer needs)."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import pytest

pytest.importorskip('flwr')

from jfed.errors import ConfigError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / 'experiments' / 'configs' / 'digits.py') + ':smoke'
RECIPE = 'flower-recipe'  # every SuperNode rebuilds its clients from the config and seed
OWN_DATA_RECIPE = 'flower-recipe-own-data'  # every SuperNode serves its own clients' files
ROLES = {'server': 'on the server machine', 'node': 'on each client machine', 'user': 'anywhere'}


def recipe_block(text: str, name: str = RECIPE) -> str:
  """The fenced bash block between the markers `<!-- NAME: ... -->` and `<!-- end NAME -->` of
  a Markdown file."""
  start = text.index(f'<!-- {name}:')
  body = text[start : text.index(f'<!-- end {name} -->', start)]
  return re.search(r'```bash\n(.*?)```', body, re.S).group(1)


def recipe_commands(block: str) -> Dict[str, List[str]]:
  """{role: its command lines}: the comment above a line names its machine."""
  commands: Dict[str, List[str]] = {role: [] for role in ROLES}
  role = None
  for line in block.splitlines():
    if line.startswith('#'):
      role = next((r for r, words in ROLES.items() if words in line), None)
      assert role, f'recipe comment names no machine: {line}'
    elif line.strip():
      commands[role].append(line)
  return commands


def test_the_recipe_has_a_command_for_every_machine():
  commands = recipe_commands(recipe_block((ROOT / 'docs' / 'deployment.md').read_text()))
  assert len(commands['server']) == 1 and '--host 0.0.0.0' in commands['server'][0]
  assert len(commands['node']) == 1 and '$SERVER' in commands['node'][0]
  assert any('insecure = true' in line for line in commands['user'])
  assert commands['user'][-1].startswith('flwr run ')


def test_the_own_data_recipe_differs_from_the_recipe_only_in_the_node_and_run_lines():
  docs = (ROOT / 'docs' / 'deployment.md').read_text()
  base, own = (
    recipe_commands(recipe_block(docs)),
    recipe_commands(recipe_block(docs, OWN_DATA_RECIPE)),
  )
  assert own['server'] == base['server']
  assert own['user'][:-1] == base['user'][:-1]  # the same federation in config.toml
  (node,) = own['node']
  # a double-quoted TOML string, so that the shell expands $DATA_DIR inside it
  assert '--node-config "data-dir=\\"$DATA_DIR\\""' in node and 'partition-id' not in node
  assert node.replace('--node-config "data-dir=\\"$DATA_DIR\\""', '') == base['node'][0].replace(
    '--node-config "partition-id=$I num-partitions=$N"', ''
  )
  assert own['user'][-1] == base['user'][-1][:-1] + ' own-data=true"'


def test_the_readme_links_the_tested_recipes():
  """The README points at the section of docs/deployment.md that holds both recipes (the README
  itself no longer repeats them), and that section holds them."""
  readme = (ROOT / 'README.md').read_text()
  section = 'flower-on-separate-machines-issue-37'
  assert f'docs/deployment.md#{section}' in readme
  docs = (ROOT / 'docs' / 'deployment.md').read_text()
  heading = docs.index('\n## Flower on separate machines (issue 37)')
  following = docs.find('\n## ', heading + 1)
  body = docs[heading : following if following > 0 else None]
  for name in (RECIPE, OWN_DATA_RECIPE):
    assert recipe_block(body, name) == recipe_block(docs, name)


def test_a_supernode_takes_the_config_the_server_sends_as_data_not_code(tmp_path):
  """The server sends the resolved values, which the node rebuilds on its own jfed's base
  config; a message with a config file's source (code, as jfed sent before 2026-12-07) or a
  key the node's jfed does not know is refused in one line."""
  from jfed.flower.node_config import config_from_json  # pylint: disable=g-import-not-at-top
  from jfed.flower.settings import (  # pylint: disable=g-import-not-at-top
    config_json_of_record,
    config_record,
    load_config,
  )

  source = pathlib.Path(SMOKE.partition(':')[0])
  server_copy = tmp_path / 'server' / 'my_digits.py'
  server_copy.parent.mkdir()
  shutil.copy(source, server_copy)
  server = load_config(f'{server_copy}:smoke', ['--config.seed=7', '--config.model=mlp'])
  record = config_record(server)
  server_copy.unlink()  # the node never reads the server's file
  assert set(record) == {'config_json'} and 'def get_config' not in record['config_json']
  node = config_from_json(config_json_of_record(record))
  assert node.seed == 7 and node.model == 'mlp'
  assert node.to_json(sort_keys=True) == server.to_json(sort_keys=True)

  code = {'config_source': source.read_text(), 'config_name': 'x.py', 'config_arg': 'smoke'}
  with pytest.raises(ConfigError, match='runs no code from messages'):
    config_json_of_record(code)
  sent = json.loads(record['config_json'])
  sent['fedavg']['evil'] = "__import__('os').system('true')"
  with pytest.raises(ConfigError, match='key fedavg.evil, which this node'):
    config_from_json(json.dumps(sent))
  sent = json.loads(record['config_json'])
  sent['seed'] = 'seven'
  with pytest.raises(ConfigError, match="seed='seven'; this node's jfed expects an integer"):
    config_from_json(json.dumps(sent))
  with pytest.raises(ConfigError, match='not JSON'):
    config_from_json('{')


def _ip(*args: str) -> None:
  subprocess.run(['ip', *args], check=True, capture_output=True, timeout=30)


class Namespaces:
  """Network namespaces `machines` on a bridge in the first one's namespace, 10.R.0.(k+1)/24."""

  def __init__(self, machines: List[str]):
    tag = f'{os.getpid() % 10000}'
    self.names = {m: f'jfed{tag}{m}' for m in machines}
    subnet = 200 + os.getpid() % 50
    self.address = {m: f'10.{subnet}.0.{k + 1}' for k, m in enumerate(machines)}
    hub = self.names[machines[0]]
    for m in machines:
      _ip('netns', 'add', self.names[m])
      _ip('-n', self.names[m], 'link', 'set', 'lo', 'up')
    _ip('-n', hub, 'link', 'add', 'br0', 'type', 'bridge')
    _ip('-n', hub, 'addr', 'add', f'{self.address[machines[0]]}/24', 'dev', 'br0')
    _ip('-n', hub, 'link', 'set', 'br0', 'up')
    for k, m in enumerate(machines[1:]):
      ours, theirs = f'jv{tag}h{k}', f'jv{tag}n{k}'
      _ip('link', 'add', ours, 'type', 'veth', 'peer', 'name', theirs)
      _ip('link', 'set', ours, 'netns', hub)
      _ip('link', 'set', theirs, 'netns', self.names[m])
      _ip('-n', hub, 'link', 'set', ours, 'master', 'br0')
      _ip('-n', hub, 'link', 'set', ours, 'up')
      _ip('-n', self.names[m], 'addr', 'add', f'{self.address[m]}/24', 'dev', theirs)
      _ip('-n', self.names[m], 'link', 'set', theirs, 'up')

  def command(self, machine: str, line: str) -> List[str]:
    return ['ip', 'netns', 'exec', self.names[machine], 'bash', '-c', line]

  def delete(self) -> None:
    for name in self.names.values():  # a namespace's veth ends go with it
      subprocess.run(['ip', 'netns', 'del', name], capture_output=True, timeout=30, check=False)


def _namespaces_or_skip(machines: List[str]) -> Namespaces:
  if not shutil.which('ip'):
    pytest.skip('network namespaces: no `ip` command (iproute2)')
  if os.geteuid() != 0:
    pytest.skip('network namespaces need root')
  try:
    return Namespaces(machines)
  except subprocess.CalledProcessError as e:
    subprocess.run(['ip', 'netns', 'del', f'jfed{os.getpid() % 10000}link'], capture_output=True)
    pytest.skip(f'network namespaces cannot be created here: {e.stderr.decode().strip()}')


def _wait_for_line(path: pathlib.Path, pattern: str, process, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if path.exists() and re.search(pattern, path.read_text(errors='replace')):
      return
    assert process.poll() is None, f'{path.name} exited: {path.read_text(errors="replace")[-2000:]}'
    time.sleep(0.5)
  raise AssertionError(f'no {pattern!r} in {path} within {timeout_s} s')


def _run_recipe_across_namespaces(
  tmp_path: pathlib.Path,
  commands: Dict[str, List[str]],
  nodes: int,
  node_env: Optional[Callable[[int], Dict[str, str]]] = None,
) -> Tuple[pathlib.Path, subprocess.CompletedProcess]:
  """Runs a recipe's lines, each in its machine's namespace: the SuperLink, `nodes` SuperNodes
  (node i with $I=i and `node_env(i)`) and then the user's lines in order; (workdir, the last
  user line's completed process). Every process and namespace is gone on return."""
  machines = ['link'] + [f'node{i}' for i in range(nodes)] + ['user']
  spaces = _namespaces_or_skip(machines)
  processes: List[subprocess.Popen] = []
  logs = tmp_path / 'logs'
  logs.mkdir()
  workdir = tmp_path / 'run'

  def env(machine: str, **extra: str) -> Dict[str, str]:
    home = tmp_path / 'flwr_home' / machine  # each machine's own Flower state
    return dict(
      os.environ,
      FLWR_HOME=str(home),
      SERVER=spaces.address['link'],
      N=str(nodes),
      CONFIG=SMOKE,
      WORKDIR=str(workdir),
      # jfed "installed" on each machine: importable from the checkout
      PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get('PYTHONPATH')) if p),
      PATH=os.pathsep.join((str(pathlib.Path(sys.executable).parent), os.environ['PATH'])),
      **extra,
    )

  def start(machine: str, line: str, **extra: str) -> pathlib.Path:
    log = logs / f'{machine}.log'
    with open(log, 'w') as out:
      processes.append(
        subprocess.Popen(
          spaces.command(machine, line),
          env=env(machine, **extra),
          cwd=ROOT,
          stdout=out,
          stderr=subprocess.STDOUT,
          start_new_session=True,  # one group per machine, stopped together
        )
      )
    return log

  try:
    (server,) = commands['server']
    log = start('link', server)
    _wait_for_line(log, r'Starting Flower SuperLink|Flower ECE|listen', processes[0], 120)
    time.sleep(2)
    (node_line,) = commands['node']
    for i in range(nodes):
      start(f'node{i}', node_line, I=str(i), **(node_env(i) if node_env else {}))
    run = None
    for line in commands['user']:
      run = subprocess.run(
        spaces.command('user', line),
        env=env('user'),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
      )
      assert run.returncode == 0, f'{line}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}'
    node_logs = '\n'.join(
      f'{log.name}: {log.read_text(errors="replace")[-1500:]}' for log in sorted(logs.iterdir())
    )
    assert (workdir / 'summary.json').exists(), (
      f'no summary: {run.stdout[-4000:]}{run.stderr}\n{node_logs}'
    )
    # the server's per-exchange progress reached the console of `flwr run --stream`
    assert re.search(
      rf'flower: exchange 1: {nodes}/{nodes} SuperNodes replied', run.stdout + run.stderr
    )
    return workdir, run
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    for p in processes:
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    spaces.delete()


@pytest.mark.slow
def test_the_recipe_runs_fedavg_across_network_namespaces(tmp_path):
  commands = recipe_commands(recipe_block((ROOT / 'docs' / 'deployment.md').read_text()))
  nodes = 2
  workdir, _ = _run_recipe_across_namespaces(tmp_path, commands, nodes)
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['final_test_accuracy'] > 0.3  # it learns (chance is 0.1)
  bridge = json.loads((workdir / 'flower.json').read_text())
  assert bridge['supernodes'] == nodes


@pytest.mark.slow
def test_the_own_data_recipe_runs_fedavg_across_network_namespaces(tmp_path):
  """Each SuperNode's $DATA_DIR holds only its own clients' files (written from the config's
  seeded partition, node i the block a whole-dataset SuperNode i would rebuild): the run ends
  with the whole-dataset in-process run's parameters, the server having learnt every client's
  size from the nodes."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from experiments import export_clients  # pylint: disable=g-import-not-at-top
  from jfed.driver import context_of_config  # pylint: disable=g-import-not-at-top
  from jfed.flower.settings import load_config  # pylint: disable=g-import-not-at-top
  from tests.test_flower import _final_params, _in_process  # pylint: disable=g-import-not-at-top

  docs = (ROOT / 'docs' / 'deployment.md').read_text()
  commands = recipe_commands(recipe_block(docs, OWN_DATA_RECIPE))
  nodes = 2
  config = load_config(SMOKE, [])  # the recipe's overrides="[]"
  seeded = context_of_config(config)
  data_dirs = []
  for i in range(nodes):
    folder = tmp_path / 'data' / f'node{i}'  # node i's machine: its clients' files, no others
    export_clients.export(config, str(folder), i, nodes)
    data_dirs.append(str(folder))
  assert sorted(p.name for d in data_dirs for p in pathlib.Path(d).iterdir()) == sorted(
    f'client_{c}.npz' for c in range(len(seeded.parts))
  )

  workdir, _ = _run_recipe_across_namespaces(
    tmp_path, commands, nodes, node_env=lambda i: {'DATA_DIR': data_dirs[i]}
  )
  bridge = json.loads((workdir / 'flower.json').read_text())
  assert bridge['supernodes'] == nodes
  assert bridge['own_data_client_sizes'] == [len(p) for p in seeded.parts]
  assert bridge['exchanges'] == 1 + config.fedavg.rounds  # describe, then the rounds
  in_process = tmp_path / 'in_process'
  _in_process('fedavg', in_process)
  for a, b in zip(_final_params(workdir), _final_params(in_process), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  summary = json.loads((workdir / 'summary.json').read_text())
  plain = json.loads((in_process / 'summary.json').read_text())
  assert summary['final_test_accuracy'] == plain['final_test_accuracy']
