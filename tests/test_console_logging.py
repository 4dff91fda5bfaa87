"""What a run prints: jfed's INFO lines (the phases of a run) by default, the libraries' INFO
lines (orbax logs every checkpoint step) only with an explicit --verbosity."""

import logging
import os
import re
import subprocess
import sys

import pytest

from experiments import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(path, level):
  return logging.LogRecord('absl', level, path, 1, 'message', None, None)


def test_the_default_filter_keeps_jfeds_info_and_every_warning():
  assert cli._jfed_record(_record(os.path.join(ROOT, 'jfed', 'methods', 'hfldd.py'), logging.INFO))
  orbax = '/usr/lib/python3/site-packages/orbax/checkpoint/checkpoint_manager.py'
  assert not cli._jfed_record(_record(orbax, logging.INFO))
  assert cli._jfed_record(_record(orbax, logging.WARNING))


def _run(tmp_path, *extra):
  return subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.main',
      '--method=fedmho_md',
      '--config=experiments/configs/fedmho_digits.py:smoke',
      f'--workdir={tmp_path}',
      *extra,
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=True,
  ).stderr


@pytest.mark.slow  # two smoke runs of FedMHO-MD through the command line
def test_a_run_shows_its_phases_and_verbosity_is_honoured(tmp_path):
  info = re.compile(r'^I\d{4} .*? (\S+\.py):\d+\]', re.M)
  default = info.findall(_run(tmp_path / 'a'))
  assert 'fedmho.py' in default and 'generative.py' in default  # generation, CVAE training
  assert not any(f.startswith(('checkpoint', 'async_checkpointer')) for f in default)
  assert info.findall(_run(tmp_path / 'b', '--verbosity=-1')) == []  # WARNING: no INFO line
