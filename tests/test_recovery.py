"""A workdir whose bookkeeping files are damaged can still be resumed or is named with the way
to recover (issue 85): identity.json rebuilt from config.json when the config is the same, a
damaged summary.json named with what to do."""

import json
import shutil

import pytest

from jfed import driver
from jfed.configs import digits
from jfed.errors import WorkdirError
from tests.support import override


def _config(**overrides):
  c = digits.get_config('smoke')
  c.fedavg.rounds = 2
  return override(c, model='mlp', **overrides)


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A finished 2-round run and its summary."""
  workdir = tmp_path_factory.mktemp('finished')
  return workdir, driver.run_experiment('fedavg', _config(), workdir, progress=False)


def _copy(finished, tmp_path):
  workdir = tmp_path / 'w'
  shutil.copytree(finished[0], workdir)
  return workdir


def test_a_damaged_identity_is_rebuilt_from_an_equal_config_json(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  text = (workdir / 'identity.json').read_text()
  (workdir / 'identity.json').write_text(text[: len(text) // 2])  # truncated
  (workdir / 'summary.json').unlink()  # so the run must resume from its checkpoints
  summary = driver.run_experiment('fedavg', _config(), workdir, progress=False)
  assert summary.final_test_accuracy == pytest.approx(finished[1].final_test_accuracy)
  assert json.loads((workdir / 'identity.json').read_text())['method'] == 'fedavg'


def test_a_missing_identity_with_another_config_is_refused_naming_what_differs(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  (workdir / 'identity.json').unlink()
  with pytest.raises(WorkdirError, match=r'holds a run \(by its config.json\) that differs in'):
    driver.run_experiment('fedavg', _config(seed=7), workdir, progress=False)


def test_identity_and_config_json_both_damaged_is_an_unknown_run(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  (workdir / 'identity.json').write_text('{"meth')
  (workdir / 'config.json').write_text('')
  with pytest.raises(WorkdirError, match=r'identity.json is damaged and config.json cannot be'):
    driver.run_experiment('fedavg', _config(), workdir, progress=False)


def test_a_damaged_summary_is_named_and_deleting_it_resumes(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  text = (workdir / 'summary.json').read_text()
  (workdir / 'summary.json').write_text(text[: len(text) // 2])
  with pytest.raises(WorkdirError, match=r'summary.json is damaged .*delete it and run again'):
    driver.run_experiment('fedavg', _config(), workdir, progress=False)
  (workdir / 'summary.json').unlink()
  summary = driver.run_experiment('fedavg', _config(), workdir, progress=False)
  assert summary.final_test_accuracy == pytest.approx(finished[1].final_test_accuracy)
