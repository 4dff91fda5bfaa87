"""The command line's small items (issue 82, item 5): result files readable under the umask, exit
status 1 for every `error:` line, the variants a refused config file offers, the default workdir
named, one log format for every method, no empty workdir left by a refused run."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

from absl import logging as absl_logging
import pytest

from jfed import console
from jfed.workdir import Workdir, atomic_write_text, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = '--config=digits:smoke'
ABSL_PREFIX = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d', re.M)


def _jfed(*args, cwd=ROOT, umask=None, timeout=300):
  return subprocess.run(
    [sys.executable, '-m', 'jfed', *args],
    cwd=cwd,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    capture_output=True,
    text=True,
    timeout=timeout,
    preexec_fn=None if umask is None else lambda: os.umask(umask),
  )


def _error_line(proc: subprocess.CompletedProcess) -> str:
  """The one stderr line of a refused command, which must start with `error:` (status 1)."""
  assert proc.returncode == 1, f'exit {proc.returncode}:\n{proc.stderr[-3000:]}'
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr[-3000:]
  return lines[0]


def _mode(path: pathlib.Path) -> int:
  return path.stat().st_mode & 0o777


# ---- 1, 4, 5: one small run of a method other than FedAvg, without --workdir -----------------


def test_a_default_workdir_run_is_named_readable_and_logs_plain_lines(tmp_path):
  proc = _jfed(
    '--method=local',
    SMOKE,
    '--config.model=mlp',
    '--config.local.epochs=1',
    cwd=tmp_path,
    umask=0o022,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (
    proc.stdout.splitlines()[0] == 'workdir: runs/local_digits (default; --workdir=DIR to choose)'
  )
  workdir = tmp_path / 'runs' / 'local_digits'
  for name in ('summary.json', 'metrics.jsonl', 'config.json', 'identity.json', 'partition.txt'):
    assert _mode(workdir / name) == 0o644, name
  loose = {str(p): oct(_mode(p)) for p in workdir.rglob('*') if p.is_file() and _mode(p) != 0o644}
  assert not loose, loose
  assert not ABSL_PREFIX.search(proc.stdout + proc.stderr), proc.stderr[-3000:]
  assert re.search(r'^local training \[mlp\]: final train accuracy', proc.stderr, re.M), proc.stderr


def test_atomic_files_take_the_umask_like_open(tmp_path):
  old = os.umask(0o027)
  try:
    atomic_write_text(tmp_path / 'a.txt', 'x')
    write_json(tmp_path / 'b.json', {'x': 1})
    (tmp_path / 'plain.txt').write_text('x')
  finally:
    os.umask(old)
  assert _mode(tmp_path / 'a.txt') == _mode(tmp_path / 'b.json') == 0o640
  assert _mode(tmp_path / 'plain.txt') == 0o640
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a.txt', 'b.json', 'plain.txt']


def test_an_identity_mismatch_suggests_another_workdir(tmp_path):
  wd = Workdir(tmp_path)
  write_json(tmp_path / 'identity.json', {'method': 'fedavg'})
  write_json(tmp_path / 'summary.json', {})
  with pytest.raises(ValueError, match='--workdir=DIR'):
    wd.check_identity({'method': 'fedprox'})


# ---- 2: every `error:` line exits 1 -----------------------------------------------------------


@pytest.mark.parametrize(
  'args, words',
  [
    ([SMOKE], '--method is required'),
    (['--method=fedavg', SMOKE, '--config.no_such_key=1'], 'unknown config key'),
    (['--method=fedavg', '--config=digits:no_such_variant'], "unknown config variant 'no_such"),
    (['--method=fedavg', '--config=no_such_file.py'], 'config file no_such_file.py not found'),
    (['--method=fedavg', '--config=no_such_config'], "config 'no_such_config' is neither"),
    (['--method=fedavg', SMOKE, '--init_timeout_s=5'], '--init_timeout_s applies only'),
  ],
)
def test_every_error_line_exits_1(tmp_path, args, words):
  proc = _jfed(*args, f'--workdir={tmp_path / "run"}')
  assert words in _error_line(proc)
  assert not (tmp_path / 'run').exists()


# ---- 3: a config file whose default suits one method names the variants that suit another ----


def test_a_refused_config_names_the_variants_the_method_runs_with(tmp_path):
  line = _error_line(_jfed('--method=fedavg', '--config=fashion_mnist', f'--workdir={tmp_path}/r'))
  assert 'optimizer.schedule=cosine' in line
  assert line.endswith(
    'fedavg runs with --config=fashion_mnist:iid or --config=fashion_mnist:oneshot'
  )


# ---- 5: the console's log format ---------------------------------------------------------------


def test_console_logging_prints_info_bare_and_warnings_with_a_prefix(monkeypatch):
  handler = absl_logging.get_absl_handler()
  monkeypatch.setattr(handler, 'filters', [])
  monkeypatch.setattr(handler.python_handler, 'formatter', handler.python_handler.formatter)
  verbosity = absl_logging.get_verbosity()
  try:
    console.console_logging()
    console.console_logging()  # idempotent: one formatter, one filter
  finally:
    absl_logging.set_verbosity(verbosity)
  own = str(ROOT / 'jfed' / 'methods' / 'common.py')

  def line(level, message='local training: %d', args=(3,), exc_info=None):
    record = logging.LogRecord('absl', level, own, 7, message, args, exc_info)
    return handler.format(record)

  assert line(logging.INFO) == 'local training: 3'
  assert line(logging.WARNING) == 'warning: local training: 3'
  assert re.match(r'E\d{4} \d\d:\d\d:\d\d.* common\.py:7\] local training: 3$', line(logging.ERROR))
  assert handler.filters == [console.jfed_record]


# ---- 6: a refused run leaves no workdir it created -------------------------------------------


def test_a_refused_run_removes_the_workdir_it_created_and_keeps_others(tmp_path):
  missing = ['--config.dataset.name=fashion_mnist', f'--config.dataset.data_dir={tmp_path}/none']
  created = tmp_path / 'new' / 'deeper' / 'run'
  assert 'not found' in _error_line(
    _jfed('--method=fedavg', SMOKE, *missing, f'--workdir={created}')
  )
  assert sorted(p.name for p in tmp_path.iterdir()) == []

  existing = tmp_path / 'existing'
  existing.mkdir()
  (existing / 'notes.txt').write_text('mine')
  empty = existing / 'empty'
  empty.mkdir()
  Workdir(existing).remove_if_unused()  # nothing created: nothing removed
  wd = Workdir(empty / 'a' / 'b')
  wd.prepare()
  (empty / 'a' / 'keep.txt').write_text('x')
  wd.remove_if_unused()
  assert (empty / 'a' / 'keep.txt').exists() and not (empty / 'a' / 'b').exists()
  assert json.dumps(
    sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*'))
  ) == json.dumps(
    [
      'existing',
      'existing/empty',
      'existing/empty/a',
      'existing/empty/a/keep.txt',
      'existing/notes.txt',
    ]
  )


def test_a_get_config_that_returns_nothing_is_named(tmp_path):
  (tmp_path / 'forgot.py').write_text('def get_config(arg=""):\n  config = None\n')
  proc = _jfed('--method=fedavg', f'--config={tmp_path / "forgot.py"}', cwd=tmp_path)
  assert 'get_config returned NoneType, not a ConfigDict' in _error_line(proc)
