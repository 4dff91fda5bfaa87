"""What a run prints: jfed's INFO lines (the phases of a run) by default, the libraries' INFO
lines (orbax logs every checkpoint step) only with an explicit --verbosity."""

import logging
import os
import re
import subprocess
import sys

import pytest

from experiments import sweep
from jfed import console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(path, level):
  return logging.LogRecord('absl', level, path, 1, 'message', None, None)


def test_the_default_filter_keeps_jfeds_info_and_every_warning():
  own = os.path.join(ROOT, 'jfed', 'methods', 'hfldd.py')
  assert console.jfed_record(_record(own, logging.INFO))
  orbax = '/usr/lib/python3/site-packages/orbax/checkpoint/checkpoint_manager.py'
  assert not console.jfed_record(_record(orbax, logging.INFO))
  assert console.jfed_record(_record(orbax, logging.WARNING))


def test_a_table_command_filters_the_libraries_info_lines_too(monkeypatch):
  """The table and sweep commands (sweep.run_command; the GPU queue's chunks are such commands):
  a chunk's log had ended in 200 of orbax's checkpoint lines and no progress line."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top

  handler = absl_logging.get_absl_handler()
  seen = []
  monkeypatch.setattr(handler, 'filters', [])
  monkeypatch.setattr(sys, 'argv', ['table'])
  verbosity = absl_logging.get_verbosity()
  try:  # INFO left on would put progress callbacks in other tests' programs
    with pytest.raises(SystemExit):
      sweep.run_command(lambda argv: seen.append(list(handler.filters)), lambda: None)
  finally:
    absl_logging.set_verbosity(verbosity)
  assert seen == [[console.jfed_record]]


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
  phases = re.compile(
    r'^(fedmho_md: \d+ synthetic samples generated|local CVAE training \[\S+\]: final loss)', re.M
  )
  default = _run(tmp_path / 'a')
  assert len(set(phases.findall(default))) == 2, default  # generation, CVAE training
  assert not re.search(r'^[IWEF]\d{4} ', default, re.M), default  # bare lines, no absl prefix
  assert phases.findall(_run(tmp_path / 'b', '--verbosity=-1')) == []  # WARNING: no INFO line
