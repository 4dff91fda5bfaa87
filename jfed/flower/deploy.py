"""A local Flower deployment of a jfed run: one SuperLink, N SuperNodes, `flwr run`.

Every component is its own process on localhost, exactly as on separate machines (only the
addresses differ; README, "Flower"). The processes are stopped when the run ends, fails or is
interrupted; their logs stay in `<workdir>/flower_logs`.
"""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional, Sequence

from jfed.driver import build_algorithm
from jfed.errors import ConfigError
from jfed.flower import own_data
from jfed.flower.settings import load_config, require_own_data, require_supported

APP_DIR = pathlib.Path(__file__).resolve().parent / 'app'
FEDERATION = 'jfed-local'


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _tool(name: str) -> str:
  here = pathlib.Path(sys.executable).parent / name
  found = str(here) if here.exists() else shutil.which(name)
  if not found:
    raise ConfigError(f"{name} not found: install the Flower extra (pip install -e '.[flower]')")
  return found


def _wait_for_port(port: int, process: subprocess.Popen, what: str, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise ConfigError(f'{what} exited with status {process.returncode} before it listened')
    with socket.socket() as s:
      if s.connect_ex(('127.0.0.1', port)) == 0:
        return
    time.sleep(0.2)
  raise ConfigError(f'{what} did not listen on port {port} within {timeout_s:.0f} s')


def stream_command(
  command: List[str], env: dict, cwd: str, log_path: pathlib.Path, timeout_s: float, echo=None
) -> int:
  """Runs `command`, each output line to `log_path` and, as it arrives, to `echo` (default:
  stderr); its exit status (ConfigError past `timeout_s`).

  Args:
    command: The command line.
    env: Its environment.
    cwd: Its working directory.
    log_path: The file every output line is appended to.
    timeout_s: How long it may run, in seconds.
    echo: Called with each output line as it arrives; None prints to stderr.

  Returns:
    The command's exit status.
  """
  echo = echo or (lambda line: print(line, end='', file=sys.stderr, flush=True))
  with open(log_path, 'w') as log:
    process = subprocess.Popen(
      command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      errors='replace',
    )  # fmt: skip

    def pump() -> None:
      for line in process.stdout:
        log.write(line)
        log.flush()
        echo(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
      process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      raise ConfigError(f'{command[0]} ran past its {timeout_s:.0f} s limit') from None
    finally:
      reader.join(timeout=10)
  return process.returncode


def _checked_data_dirs(
  method: str, config, data_dirs: Sequence[str], num_supernodes: int
) -> List[str]:
  """The SuperNodes' data directories, absolute, after the checks the server and nodes make
  (method, file format, each client in exactly one directory), so that a bad one fails in one
  line before any Flower process starts."""
  if len(data_dirs) != num_supernodes:
    raise ConfigError(
      f'{len(data_dirs)} data directories for {num_supernodes} SuperNodes: give one per SuperNode'
    )
  require_own_data(method, config)
  num_clients = int(config.partition.num_clients)
  declared = [list(own_data.load_clients(d, num_clients)) for d in data_dirs]
  twice = own_data.duplicate_clients(declared)
  if twice:
    cid, nodes = next(iter(twice.items()))
    raise ConfigError(
      f'client {cid} has a file in {len(nodes)} data directories '
      f'({", ".join(str(data_dirs[k]) for k in nodes)}): give each client to one SuperNode'
    )
  missing = sorted(set(range(num_clients)) - {c for ids in declared for c in ids})
  if missing:
    raise ConfigError(
      f'no data directory holds client(s) {missing} (partition.num_clients = {num_clients})'
    )
  return [str(pathlib.Path(d).absolute()) for d in data_dirs]


def run_local_deployment(
  method: str,
  config_spec: str,
  overrides: Sequence[str],
  workdir,
  num_supernodes: int,
  timeout_s: float = 3600.0,
  keep_process: bool = True,
  data_dirs: Optional[Sequence[str]] = None,
) -> dict:
  """Runs `method` through a local Flower deployment; returns the run's summary.json.

  `keep_process=False` has every message trained in its own ClientApp process, as Flower
  starts it (jfed/flower/worker.py says why the default keeps one).

  Args:
    method: The registered method name.
    config_spec: The run config file.
    overrides: Config overrides, as `key=value` strings.
    workdir: The directory of the run's outputs.
    num_supernodes: How many local SuperNodes share the clients.
    timeout_s: How long the run may take, in seconds.
    keep_process: Whether each SuperNode keeps one long-lived jfed worker (see
      jfed/flower/worker.py).
    data_dirs: One directory of `client_<id>.npz` files per SuperNode (node config `data-dir`,
      jfed/flower/own_data.py): the SuperNodes serve their own data (FedAvg and FedProx only);
      None: each rebuilds its block of the seeded partition.

  Returns:
    The run's summary.json, as a dict.
  """
  if num_supernodes < 1:
    raise ConfigError(f'--flower_supernodes must be at least 1, got {num_supernodes}')
  workdir = pathlib.Path(workdir).absolute()
  path, _, arg = config_spec.partition(':')
  spec = str(pathlib.Path(path).absolute()) + (f':{arg}' if arg else '')
  # A bad method or config fails here, in one line, before any Flower process starts.
  require_supported(method)
  config = load_config(spec, overrides)
  build_algorithm(method, config)
  if data_dirs is not None:
    data_dirs = _checked_data_dirs(method, config, data_dirs, num_supernodes)
  logs = workdir / 'flower_logs'
  logs.mkdir(parents=True, exist_ok=True)
  home = pathlib.Path(tempfile.mkdtemp(prefix='jfed-flwr-'))
  link_port = _free_port()
  (home / 'config.toml').write_text(
    f'[superlink]\ndefault = "{FEDERATION}"\n\n'
    f'[superlink.{FEDERATION}]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n'
  )
  root = str(APP_DIR.parents[2])  # the folder jfed is imported from
  env = dict(
    os.environ,
    FLWR_HOME=str(home),
    # The ServerApp's progress reaches `flwr run --stream` as it is printed, not at exit.
    PYTHONUNBUFFERED='1',
    # Flower's SuperExec looks for a message to start a ClientApp for once a second by default.
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL='0.1',
    PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get('PYTHONPATH')) if p),
    # The SuperLink and SuperNodes start Flower's other programs by name.
    PATH=os.pathsep.join((str(pathlib.Path(sys.executable).parent), os.environ.get('PATH', ''))),
  )
  # Flower starts a new ClientApp process for every message (its token is single-use), so each
  # round would compile the node's training again: JAX's persistent cache turns that into reads.
  env.setdefault('JAX_COMPILATION_CACHE_DIR', str(home / 'jax_cache'))
  processes: List[subprocess.Popen] = []

  def start(name: str, command: List[str]) -> subprocess.Popen:
    log = open(logs / f'{name}.log', 'w')  # pylint: disable=consider-using-with
    p = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    processes.append(p)
    return p

  try:
    link = start(
      'superlink',
      [
        _tool('flower-superlink'),
        '--insecure',
        '--port',
        str(link_port),
        '--disable-runtime-dependency-installation',
      ],
    )
    _wait_for_port(link_port, link, 'flower-superlink', 120)
    for i in range(num_supernodes):
      start(
        f'supernode{i}',
        [
          _tool('flower-supernode'),
          '--insecure',
          '--superlink',
          f'127.0.0.1:{link_port}',
          '--port',
          str(_free_port()),
          '--node-config',
          (
            f'partition-id={i} num-partitions={num_supernodes}'
            if data_dirs is None
            else f'data-dir={json.dumps(data_dirs[i])}'  # a TOML string
          )
          + f' keep-process={str(keep_process).lower()}',
        ],
      )
    run_config = {
      'method': method,
      'config': spec,
      'overrides': json.dumps(list(overrides)),
      'workdir': str(workdir),
      'supernodes': num_supernodes,
      'own-data': data_dirs is not None,
    }
    toml = home / 'run_config.toml'
    toml.write_text(''.join(f'{k} = {json.dumps(v)}\n' for k, v in run_config.items()))
    command = [
      _tool('flwr'), 'run', str(APP_DIR), FEDERATION, '--run-config', str(toml), '--stream'
    ]  # fmt: skip
    returncode = stream_command(command, env, root, logs / 'flwr_run.log', timeout_s)
    summary = workdir / 'summary.json'
    if returncode != 0 or not summary.exists():
      tail = (logs / 'flwr_run.log').read_text(errors='replace').strip().splitlines()[-3:]
      raise ConfigError(
        f'the Flower run ended without a summary (flwr run status {returncode}; logs in '
        f'{logs}): {" | ".join(tail)}'
      )
    return json.loads(summary.read_text())
  finally:
    for p in reversed(processes):
      if p.poll() is None:
        p.terminate()
    for p in processes:
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    shutil.rmtree(home, ignore_errors=True)
