"""The workdir lock (issue 37, issue 38): a stale `.lock` of a dead process is reported in one line
and replaced, a run leaves none behind, a live holder refuses with a clear error, and neither a
forked child nor a file system without flock lets a dead pid block the next run."""

import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

from jfed import workdir as workdir_module
from jfed.errors import WorkdirBusy
from jfed.workdir import LOCK_FILE, Workdir

HOST = os.uname().nodename
DEAD_PID = 999999  # above the default pid_max (4194304 is the largest; 999999 is unused here)


def _workdir(tmp_path) -> Workdir:
  wd = Workdir(tmp_path / 'w')
  wd.prepare()
  return wd


def _dead_pid() -> int:
  assert not workdir_module.pid_alive(DEAD_PID)
  return DEAD_PID


def _holder(lock_path, text=None):
  """A live process that holds the flock on `lock_path`, whose file says `text` (default: its
  own 'pid N on HOST', as a run writes it)."""
  code = (
    'import fcntl, os, sys, time\n'
    f'f = open({str(lock_path)!r}, "a+")\n'
    'fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n'
    f'text = {text!r} or f"pid {{os.getpid()}} on {{os.uname().nodename}}\\n"\n'
    'f.seek(0); f.truncate(); f.write(text); f.flush()\n'
    'print("locked", flush=True)\n'
    'time.sleep(60)\n'
  )
  proc = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'locked'
  return proc


def test_a_finished_run_leaves_no_lock_file(tmp_path):
  wd = _workdir(tmp_path)
  with wd.lock():
    assert (wd.path / LOCK_FILE).read_text() == f'pid {os.getpid()} on {HOST}\n'
  assert not (wd.path / LOCK_FILE).exists()
  with wd.lock():  # and the next run locks again
    pass


def test_a_stale_lock_of_a_dead_process_is_reported_in_one_line_and_replaced(tmp_path, capsys):
  wd = _workdir(tmp_path)
  pid = _dead_pid()
  (wd.path / LOCK_FILE).write_text(f'pid {pid} on {HOST}\n')
  with wd.lock():
    assert (wd.path / LOCK_FILE).read_text() == f'pid {os.getpid()} on {HOST}\n'
  err = capsys.readouterr().err.splitlines()
  assert err == [
    f'warning: workdir {wd.path}: replaced the stale lock of pid {pid} which is no longer running'
  ]


def test_a_live_lock_refuses_naming_its_holder(tmp_path):
  wd = _workdir(tmp_path)
  proc = _holder(wd.path / LOCK_FILE)
  try:
    with pytest.raises(WorkdirBusy, match=f'^workdir {wd.path} is busy: a run .pid {proc.pid} on'):
      with wd.lock():
        pass
  finally:
    proc.kill()
    proc.wait()
  assert (wd.path / LOCK_FILE).exists()  # not the refused run's to remove


def test_a_lock_kept_by_a_process_the_dead_run_started_names_what_to_do(tmp_path):
  wd = _workdir(tmp_path)
  lock = wd.path / LOCK_FILE
  proc = _holder(lock, f'pid {_dead_pid()} on {HOST}\n')
  try:
    with pytest.raises(WorkdirBusy, match=rf'pid {DEAD_PID}\) is no longer running.*fuser -v'):
      with wd.lock():
        pass
  finally:
    proc.kill()
    proc.wait()


def test_a_child_forked_during_the_run_does_not_keep_the_lock(tmp_path):
  wd = _workdir(tmp_path)
  with wd.lock():
    with warnings.catch_warnings():
      # fork beside JAX's threads: Python's DeprecationWarning, JAX's RuntimeWarning
      warnings.simplefilter('ignore', DeprecationWarning)
      warnings.simplefilter('ignore', RuntimeWarning)
      child = os.fork()
    if child == 0:  # it would hold the flock for 30 s if it kept the descriptor
      time.sleep(30)
      os._exit(0)
  try:
    with wd.lock():
      pass
  finally:
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


def test_without_flock_the_pid_in_the_file_is_the_lock(tmp_path, monkeypatch, capsys):
  def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, 'No locks available')

  monkeypatch.setattr(fcntl, 'flock', no_flock)
  wd = _workdir(tmp_path)
  lock = wd.path / LOCK_FILE
  lock.write_text(f'pid {_dead_pid()} on {HOST}\n')
  with wd.lock():
    assert lock.read_text() == f'pid {os.getpid()} on {HOST}\n'
    with pytest.raises(WorkdirBusy, match=f'busy: a run .pid {os.getpid()} on'):
      with wd.lock():
        pass
  assert not lock.exists()
  assert f'replaced the stale lock of pid {DEAD_PID}' in capsys.readouterr().err
