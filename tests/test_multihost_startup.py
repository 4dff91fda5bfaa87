"""Starting a multi-process run: launch flags checked before JAX sees them, and a start-up that
cannot form (no coordinator, a missing peer) ends in one `error:` line within a bounded time,
with progress lines while it waits, instead of hanging silently.

Every command that reaches `jax.distributed.initialize` runs in a subprocess with a hard
timeout: joining the runtime in the pytest process would change it for every later test, and a
hang must fail the test rather than the suite.
"""

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from jfed.engine import multihost
from jfed.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
HARD_TIMEOUT_S = 120  # far above what any of these commands needs; only a hang reaches it
INIT_TIMEOUT_S = 3


def _unused_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _main(tmp_path, *args) -> subprocess.CompletedProcess:
  return subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.main',
      '--method=fedavg',
      '--config=experiments/configs/digits.py:smoke',
      f'--workdir={tmp_path / "run"}',
      *args,
    ],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    capture_output=True,
    text=True,
    timeout=HARD_TIMEOUT_S,
  )


def _error_line(proc: subprocess.CompletedProcess, status: int = 1) -> str:
  """The one `error:` line a failed command ends with (and no traceback or abort before it)."""
  assert proc.returncode == status, f'exit {proc.returncode}:\n{proc.stderr[-3000:]}'
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert lines and lines[-1].startswith('error: '), proc.stderr[-3000:]
  assert [l for l in lines if l.startswith('error: ')] == lines[-1:], proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr and 'Check failure' not in proc.stderr, proc.stderr
  return lines[-1]


# ------------------------------------------------------------------------------------------------
# --coordinator is HOST:PORT
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
  'address,host,port',
  [
    ('localhost:1234', 'localhost', 1234),
    ('10.0.0.7:65535', '10.0.0.7', 65535),
    ('node-3.cluster.local:1', 'node-3.cluster.local', 1),
    ('[::1]:8476', '::1', 8476),
    ('[fe80::1%eth0]:8476', 'fe80::1%eth0', 8476),
  ],
)
def test_a_host_and_port_are_read_from_the_coordinator_address(address, host, port):
  assert multihost.parse_coordinator(address) == (host, port)


@pytest.mark.parametrize(
  'address,problem',
  [
    ('notahost', 'no port'),
    ('localhost:', 'no port'),
    (':1234', 'no host'),
    ('localhost:http', 'port http is not an integer'),
    ('localhost:0', 'port 0 is not in 1-65535'),
    ('localhost:65536', 'port 65536 is not in 1-65535'),
    ('localhost:-5', 'port -5 is not in 1-65535'),
    ('::1:1234', 'an IPv6 host goes in brackets'),
    ('[::1]', 'no port'),
    ('[::1:1234', 'an IPv6 host goes in brackets'),
    ('[]:1234', 'no host'),
    ('local host:1234', 'whitespace'),
    ('', 'no port'),
  ],
)
def test_a_coordinator_address_that_is_not_host_and_port_is_refused_naming_the_flag(
  address, problem
):
  with pytest.raises(ConfigError) as error:
    multihost.parse_coordinator(address)
  message = str(error.value)
  assert message.startswith(f'--coordinator={address} ') and problem in message, message
  assert 'HOST:PORT' in message


def test_a_coordinator_without_a_port_is_one_error_line_before_jax_is_asked(tmp_path):
  proc = _main(tmp_path, '--coordinator=notahost', '--num_processes=2', '--process_id=0')
  line = _error_line(proc)
  assert line.startswith('error: --coordinator=notahost ') and 'no port' in line, line
  assert not (tmp_path / 'run').exists()


# ------------------------------------------------------------------------------------------------
# --num_processes, --process_id and --init_timeout_s name themselves
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
  'num_processes,process_id,message',
  [
    (0, 0, '--num_processes=0 must be at least 1'),
    (-2, 0, '--num_processes=-2 must be at least 1'),
    (2, 2, '--process_id=2 is not in [0, 2) (--num_processes=2)'),
    (2, -1, '--process_id=-1 is not in [0, 2) (--num_processes=2)'),
  ],
)
def test_a_process_count_or_rank_out_of_range_names_its_own_flag(
  num_processes, process_id, message
):
  with pytest.raises(ConfigError) as error:
    multihost.initialize('localhost:1234', num_processes, process_id)
  assert str(error.value) == message


@pytest.mark.parametrize('timeout_s', [0, -1])
def test_an_initialization_timeout_that_is_not_positive_is_refused(timeout_s):
  with pytest.raises(ConfigError, match=f'--init_timeout_s={timeout_s} must be at least 1'):
    multihost.initialize('localhost:1234', 2, 0, timeout_s=timeout_s)


def test_an_initialization_timeout_without_a_multi_process_run_is_refused(tmp_path):
  proc = _main(tmp_path, '--init_timeout_s=10')
  line = _error_line(proc)  # a usage error: status 1, like every `error:` line
  assert '--init_timeout_s' in line and '--coordinator' in line, line
  assert not (tmp_path / 'run').exists()


def test_flower_and_a_coordinator_are_refused_before_waiting_for_any_peer(tmp_path):
  proc = _main(
    tmp_path,
    '--flower_supernodes=2',
    '--coordinator=127.0.0.1:1',
    '--num_processes=2',
    '--process_id=1',
  )
  assert 'choose one' in _error_line(proc)
  assert 'waiting' not in proc.stderr


def test_own_data_directories_without_flower_supernodes_are_refused(tmp_path):
  proc = _main(tmp_path, '--flower_data_dirs=a,b')
  assert '--flower_data_dirs needs --flower_supernodes' in _error_line(proc)
  assert not (tmp_path / 'run').exists()


# ------------------------------------------------------------------------------------------------
# a start-up that cannot form ends, within --init_timeout_s, with progress and one error line
# ------------------------------------------------------------------------------------------------
def _check_it_gave_up(proc, elapsed_s, coordinator, process):
  line = _error_line(proc)
  assert f'--coordinator={coordinator}' in line, line
  assert f'--init_timeout_s={INIT_TIMEOUT_S}' in line, line
  assert f'process {process} of 2' in line, line
  waiting = [l for l in proc.stderr.splitlines() if l.startswith('waiting ')]
  assert waiting and coordinator in waiting[0], proc.stderr
  assert all(f'of {INIT_TIMEOUT_S} s' in l for l in waiting), waiting
  # Bounded by the timeout (plus start-up), never by JAX's own 300 s default.
  assert elapsed_s < INIT_TIMEOUT_S + 60, elapsed_s


def test_a_process_whose_coordinator_never_answers_gives_up_after_the_timeout(tmp_path):
  coordinator = '127.0.0.1:1'  # a privileged port nobody listens on
  start = time.monotonic()
  proc = _main(
    tmp_path,
    f'--coordinator={coordinator}',
    '--num_processes=2',
    '--process_id=1',
    f'--init_timeout_s={INIT_TIMEOUT_S}',
  )
  _check_it_gave_up(proc, time.monotonic() - start, coordinator, 1)
  assert not (tmp_path / 'run').exists()


def test_process_0_whose_peer_never_comes_gives_up_after_the_timeout(tmp_path):
  coordinator = f'127.0.0.1:{_unused_port()}'
  start = time.monotonic()
  proc = _main(
    tmp_path,
    f'--coordinator={coordinator}',
    '--num_processes=2',
    '--process_id=0',
    f'--init_timeout_s={INIT_TIMEOUT_S}',
  )
  _check_it_gave_up(proc, time.monotonic() - start, coordinator, 0)
  assert not (tmp_path / 'run').exists()
