"""The driver's scalar curves: TensorBoard event files that hold what metrics.jsonl holds, across
an interruption too, and the optional Weights & Biases logging (against a fake `wandb`)."""

import json
import sys
import types

import ml_collections
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jfed import driver
from jfed.configs import digits
from jfed.errors import ConfigError
from jfed.io.scalars import record_scalars
from tests.support import Interrupted, override


def _config(**logging):
  c = digits.get_config('smoke')
  c.fedavg.rounds = 3
  c = override(c, model='mlp')
  if logging:
    c.logging = ml_collections.ConfigDict(logging)
  return c


def _expected_curves(workdir):
  """{tag: [(step, value)]} from metrics.jsonl, flattened independently of jfed.io.scalars."""
  curves = {}

  def add(tag, step, value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
      return
    if isinstance(value, dict):
      for k, v in value.items():
        add(f'{tag}/{k}', step, v)
    elif isinstance(value, list):
      for i, v in enumerate(value):
        add(f'{tag}/{i}', step, v)
    else:
      # TensorBoard keeps float32 values
      curves.setdefault(tag, []).append((step, float(np.float32(value))))

  for line in (workdir / 'metrics.jsonl').read_text().splitlines():
    record = json.loads(line)
    for key, value in record.items():
      if key != 'step':
        add(key, record['step'], value)
  return curves


def _event_curves(workdir, purge_orphaned_data=True):
  acc = EventAccumulator(str(workdir / 'tensorboard'), purge_orphaned_data=purge_orphaned_data)
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()['scalars']}


def test_record_scalars_flattens_numbers_and_skips_the_rest():
  record = {
    'step': 4,
    'test_accuracy': np.float32(0.5),
    'clients': 5,
    'early_stop': True,
    'loss': float('nan'),
    'method': 'fedavg',
    'rejected_clients': [2, 7],
    'accuracy_by_cluster': {'a': 0.25, 'b': {'c': np.int64(3)}},
    'nothing': None,
  }
  assert record_scalars(record) == {
    'test_accuracy': 0.5,
    'clients': 5.0,
    'rejected_clients/0': 2.0,
    'rejected_clients/1': 7.0,
    'accuracy_by_cluster/a': 0.25,
    'accuracy_by_cluster/b/c': 3.0,
  }


def test_event_files_equal_metrics_for_a_whole_and_an_interrupted_run(tmp_path, monkeypatch):
  config = _config()
  driver.run_experiment('fedavg', config, tmp_path / 'whole', progress=False)
  whole = _event_curves(tmp_path / 'whole')
  assert whole == _expected_curves(tmp_path / 'whole')
  assert [s for s, _ in whole['test_accuracy']] == [1, 2, 3]
  assert {'train_loss', 'seconds', 'cumulative_bytes', 'upload_bytes'} <= set(whole)

  # A kill after step 3's events are written and flushed but before its checkpoint: the resumed
  # invocation starts again from the checkpoint of step 2 and writes step 3 once more.
  save = driver.RunCheckpointer.save

  at_the_kill = {}

  def die_before_saving_3(self, step, state, history=None):
    if step == 3:
      # what a SIGKILL leaves: the writer is not closed, so this is what each step's flush wrote
      at_the_kill.update(_event_curves(tmp_path / 'killed'))
      raise Interrupted()
    save(self, step, state, history)

  with monkeypatch.context() as m:
    m.setattr(driver.RunCheckpointer, 'save', die_before_saving_3)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedavg', config, tmp_path / 'killed', progress=False)
  assert [s for s, _ in at_the_kill['test_accuracy']] == [1, 2, 3]
  driver.run_experiment('fedavg', config, tmp_path / 'killed', progress=False)

  resumed = _event_curves(tmp_path / 'killed')
  assert resumed == _expected_curves(tmp_path / 'killed')
  # both invocations wrote step 3: only the resumed one's events are read
  assert len(list((tmp_path / 'killed' / 'tensorboard').iterdir())) == 2
  unpurged = _event_curves(tmp_path / 'killed', purge_orphaned_data=False)
  assert [s for s, _ in unpurged['seconds']] == [1, 2, 3, 3]
  assert [s for s, _ in resumed['seconds']] == [1, 2, 3]
  assert resumed['seconds'][2] == unpurged['seconds'][3] != unpurged['seconds'][2]
  # the curves of the resumed run are the uninterrupted run's
  assert set(resumed) == set(whole)
  for tag in ('test_accuracy', 'train_loss', 'cumulative_bytes'):
    assert [s for s, _ in resumed[tag]] == [s for s, _ in whole[tag]], tag
    np.testing.assert_allclose(
      [v for _, v in resumed[tag]], [v for _, v in whole[tag]], rtol=1e-6, err_msg=tag
    )


class _FakeWandb(types.ModuleType):
  """Records the calls the driver makes."""

  def __init__(self):
    super().__init__('wandb')
    self.calls = []

  def init(self, **kwargs):
    self.calls.append(('init', kwargs))

  def log(self, data, step=None):
    self.calls.append(('log', dict(data), step))

  def finish(self, exit_code=None):
    self.calls.append(('finish', exit_code))


def test_wandb_logs_the_same_scalars_and_resumes_its_run(tmp_path, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, 'wandb', fake)
  config = _config(wandb=True, wandb_project='jfed-test', tensorboard=False)
  workdir = tmp_path / 'run'
  save = driver.RunCheckpointer.save

  def die_after_saving_2(self, step, state, history=None):
    save(self, step, state, history)
    if step == 2:
      raise Interrupted()

  with monkeypatch.context() as m:
    m.setattr(driver.RunCheckpointer, 'save', die_after_saving_2)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedavg', config, workdir, progress=False)
  first = fake.calls
  fake.calls = []
  driver.run_experiment('fedavg', config, workdir, progress=False)
  second = fake.calls

  assert not (workdir / 'tensorboard').exists()  # logging.tensorboard = False
  run_id = (workdir / 'wandb_id').read_text().strip()
  for calls in (first, second):
    (kind, kwargs), *_ = calls
    assert kind == 'init'
    assert kwargs['project'] == 'jfed-test' and kwargs['resume'] == 'allow'
    assert kwargs['id'] == run_id and kwargs['name'] == 'run'
    assert kwargs['dir'] == str(workdir)
    assert kwargs['config']['logging'] == {
      'wandb': True,
      'wandb_project': 'jfed-test',
      'tensorboard': False,
    }
  assert first[-1] == ('finish', 1) and second[-1] == ('finish', None)
  logged = [(step, data) for kind, data, step in (c for c in first + second if c[0] == 'log')]
  assert [step for step, _ in logged] == [1, 2, 3]
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert logged == [(r['step'], record_scalars(r)) for r in records]
  assert logged[0][1]['test_accuracy'] == records[0]['test_accuracy']


def test_wandb_without_the_package_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # `import wandb` raises ImportError
  with pytest.raises(ConfigError, match='^logging.wandb is set but wandb is not installed; pip'):
    driver.run_experiment('fedavg', _config(wandb=True), tmp_path / 'run', progress=False)
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize(
  'logging,message',
  [
    ({'wandb': 'yes'}, 'logging.wandb must be True or False'),
    ({'tensorboard': 1}, 'logging.tensorboard must be True or False'),
    ({'wandb_project': ''}, 'logging.wandb_project must be a non-empty string'),
  ],
)
def test_bad_logging_keys_are_refused(tmp_path, logging, message):
  with pytest.raises(ConfigError, match=message):
    driver.run_experiment('fedavg', _config(**logging), tmp_path / 'run', progress=False)
  assert not (tmp_path / 'run').exists()


def test_logging_keys_are_not_part_of_the_workdir_identity(tmp_path):
  first = driver.run_experiment('fedavg', _config(tensorboard=False), tmp_path, progress=False)
  assert not (tmp_path / 'tensorboard').exists()
  again = driver.run_experiment('fedavg', _config(tensorboard=True), tmp_path, progress=False)
  assert again.seconds == first.seconds  # the finished run is kept, not refused nor rerun


def test_a_run_killed_before_its_first_checkpoint_starts_its_curves_afresh(tmp_path, monkeypatch):
  save = driver.RunCheckpointer.save

  def die_before_saving_1(self, step, state, history=None):
    if step == 1:
      raise Interrupted()
    save(self, step, state, history)

  with monkeypatch.context() as m:
    m.setattr(driver.RunCheckpointer, 'save', die_before_saving_1)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedavg', _config(), tmp_path, progress=False)
  driver.run_experiment('fedavg', _config(), tmp_path, progress=False)
  assert len(list((tmp_path / 'tensorboard').iterdir())) == 2
  curves = _event_curves(tmp_path)
  assert curves == _expected_curves(tmp_path)
  assert [s for s, _ in curves['seconds']] == [1, 2, 3]
