"""experiments.mutation's re-run of a triaged module: which mutants' verdicts it forgets."""

import json

from experiments import mutation


def test_rerun_forgets_survivors_and_untested_mutants_only(tmp_path):
  meta = tmp_path / 'mutants' / 'jfed' / 'methods' / 'feddf.py.meta'
  meta.parent.mkdir(parents=True)
  codes = {'survived': 0, 'killed': 1, 'untested': 33, 'timeout': 36, 'pending': None}
  meta.write_text(json.dumps({'exit_code_by_key': codes, 'durations_by_key': {}}))
  stats = tmp_path / 'mutants' / 'mutmut-stats.json'
  stats.write_text('{}')
  assert mutation.forget_survivors(tmp_path) == 2
  assert json.loads(meta.read_text())['exit_code_by_key'] == {
    'survived': None,
    'killed': 1,
    'untested': None,
    'timeout': 36,
    'pending': None,
  }
  assert not stats.exists()  # which tests call which function is taken again
