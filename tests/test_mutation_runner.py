"""experiments.dev.mutation's re-run of a triaged module: which mutants' verdicts it forgets."""

import json
import tomllib

from absl import app
import pytest

from experiments.dev import mutation


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


def test_verdicts_kept_in_the_repository_resume_a_new_scratch_copy(tmp_path):
  paths = ['jfed/methods/feddf.py']
  old, new, state = tmp_path / 'old', tmp_path / 'new', tmp_path / 'state'
  meta = old / 'mutants' / 'jfed' / 'methods' / 'feddf.py.meta'
  meta.parent.mkdir(parents=True)
  record = {'exit_code_by_key': {'a': 1, 'b': 0}, 'hash_by_function_name': {'f': 'h'}}
  meta.write_text(json.dumps(record))
  mutation.save_verdicts(old, state, paths)
  assert json.loads((state / 'jfed/methods/feddf.py.meta').read_text()) == record
  # a new machine: the record goes where mutmut reads it before it generates the mutants
  assert mutation.restore_verdicts(new, state, paths) == 1
  assert json.loads((new / 'mutants/jfed/methods/feddf.py.meta').read_text()) == record
  # a scratch copy with as many verdicts of its own keeps its record; one with fewer takes ours
  assert mutation.restore_verdicts(new, state, paths) == 0
  behind = {'exit_code_by_key': {'a': 1, 'b': None}, 'hash_by_function_name': {'f': 'h'}}
  (new / 'mutants/jfed/methods/feddf.py.meta').write_text(json.dumps(behind))
  assert mutation.restore_verdicts(new, state, paths) == 1
  assert json.loads((new / 'mutants/jfed/methods/feddf.py.meta').read_text()) == record
  # a record caught mid-write is not kept over the last good one
  meta.write_text('{"exit_code_by')
  mutation.save_verdicts(old, state, paths)
  assert json.loads((state / 'jfed/methods/feddf.py.meta').read_text()) == record


def test_every_file_of_the_method_layer_is_in_exactly_one_module():
  root = mutation.ROOT
  files = set()
  for entry in mutation.MUTATED_PACKAGES:
    path = root / entry
    found = [path] if path.is_file() else sorted(path.glob('*.py'))
    files.update(str(f.relative_to(root)) for f in found)
  expected = {
    f
    for f in files
    if not any(f == skip or f.endswith('/' + skip) for skip in mutation.NOT_MUTATED)
  }
  mutated = [f for paths, _ in mutation.MODULES.values() for f in paths]
  assert sorted(mutated) == sorted(set(mutated)), 'a file is in two modules'
  assert set(mutated) == expected
  for paths, tests in mutation.MODULES.values():
    for name in paths + tests:
      assert (root / name).is_file(), name


def _row(module, survived, first_run=None):
  row = {
    'module': module,
    'stats': {'total': 10, 'killed': 10 - survived, 'survived': survived},
    'score': (10 - survived) / 10,
    'minutes': 3.0,
    'machine': '2 CPU cores, 2 workers',
  }
  if first_run:
    row['first_run'] = first_run
  return row


def test_merge_only_takes_the_named_modules_and_a_part_way_first_run_shows_its_note(tmp_path):
  out, other = tmp_path / 'out', tmp_path / 'other'
  out.mkdir()
  other.mkdir()
  rows = {'fedhydra': _row('fedhydra', 2)}
  theirs = {'fedhydra': _row('fedhydra', 9), 'kip': _row('kip', 1, {'note': 'stopped at 5 of 10'})}
  (other / 'summary.json').write_text(json.dumps(theirs))
  for key in theirs:
    (other / f'{key}.md').write_text(f'# {key}, theirs\n')
  mutation.merge(out, rows, other, ['kip'])
  assert rows['fedhydra']['stats']['survived'] == 2  # our newer fedhydra row stays
  assert rows['kip'] == theirs['kip'] and (out / 'kip.md').exists()
  assert not (out / 'fedhydra.md').exists()
  mutation.write_summary(out, rows)
  kip_line = [ln for ln in (out / 'summary.md').read_text().splitlines() if ln.startswith('| kip')]
  assert 'stopped at 5 of 10' in kip_line[0]
  mutation.merge(out, rows, other, None)  # everything
  assert rows['fedhydra']['stats']['survived'] == 9


def test_merge_only_refuses_a_module_the_folder_lacks(tmp_path):
  (tmp_path / 'summary.json').write_text('{}')
  with pytest.raises(app.UsageError, match='not in'):
    mutation.merge(tmp_path, {}, tmp_path, ['kip'])


def test_the_test_selection_reaches_mutmut_and_a_new_one_recollects_which_tests_call_what(
  tmp_path,
):
  stats = tmp_path / 'mutants' / 'mutmut-stats.json'
  stats.parent.mkdir()

  def configure(select):
    (tmp_path / 'pyproject.toml').write_text('[project]\nname = "x"\n')
    mutation.configure(tmp_path, ['jfed/methods/feddf.py'], ['tests/test_x.py'], select)
    return tomllib.loads((tmp_path / 'pyproject.toml').read_text())['tool']['mutmut']

  stats.write_text('{}')  # a scratch copy from before the selection existed ran every test
  section = configure('not slow')
  assert section['pytest_add_cli_args'] == ['-p', 'no:cacheprovider', '-m', 'not slow']
  assert section['tests_dir'] == ['tests/test_x.py']
  assert not stats.exists()
  stats.write_text('{}')
  configure('not slow')
  assert stats.exists()  # the same selection keeps mutmut's record
  assert configure('')['pytest_add_cli_args'] == ['-p', 'no:cacheprovider']
  assert not stats.exists()


def test_the_triage_check_lists_survivors_a_killed_section_names_and_nothing_else(tmp_path):
  triage = """# m

## Killed by new tests

- `test_a`. Kills `FedDF.step` 9, 12-14 and 20, `_pool` 3.
- `test_b`: kills `summarize` 2 and 4.

## Killed by tests outside this module's list

- `recipe` 6: a slow test.

## Equivalent

- `FedDF.step` 15, `_pool` 1.
"""
  claims = mutation.triage_claims(triage)
  step = {('FedDF.step', n) for n in (9, 12, 13, 14, 20)}
  assert claims == step | {('_pool', 3), ('summarize', 2), ('summarize', 4)}
  verdicts = {
    'jfed.methods.feddf.xǁFedDFǁstep__mutmut_13': 0,  # named killed, survives: listed
    'jfed.methods.feddf.xǁFedDFǁstep__mutmut_14': 1,
    'jfed.methods.feddf.xǁFedDFǁstep__mutmut_15': 0,  # equivalent
    'jfed.methods.feddf.xǁFedDFVoteǁsummarize__mutmut_4': 0,  # a method named without its class
    'jfed.methods.feddf.x__pool__mutmut_3': 0,
    'jfed.methods.feddf.x__pool__mutmut_1': 0,
    'jfed.methods.feddf.x_recipe__mutmut_6': 0,  # killed outside the list: expected to survive
    'jfed.methods.feddf.xǁFedDFǁstep__mutmut_9': None,  # pending
  }
  assert mutation.claimed_survivors(claims, verdicts) == [
    'jfed.methods.feddf.x__pool__mutmut_3',
    'jfed.methods.feddf.xǁFedDFVoteǁsummarize__mutmut_4',
    'jfed.methods.feddf.xǁFedDFǁstep__mutmut_13',
  ]
  out, state = tmp_path / 'out', tmp_path / 'state'
  meta = state / 'feddf' / 'jfed' / 'methods' / 'feddf.py.meta'
  meta.parent.mkdir(parents=True)
  meta.write_text(json.dumps({'exit_code_by_key': verdicts}))
  out.mkdir()
  records = mutation.kept_records('feddf', state)
  assert records == {'jfed/methods/feddf.py': {'exit_code_by_key': verdicts}}
  with pytest.raises(app.UsageError, match='feddf_triage.md'):
    mutation.check_triage('feddf', out, records)
  (out / 'feddf_triage.md').write_text(triage)
  assert len(mutation.check_triage('feddf', out, records)) == 3


def test_changed_functions_are_those_whose_hash_moved_or_is_new_with_their_mutants():
  kept = {'x_kept': 'a', 'xǁServerǁstep': 'b', 'x_removed': 'c'}
  now = {'x_kept': 'a', 'xǁServerǁstep': 'B', 'x_added': 'd'}
  mutants = ['x_kept__mutmut_1', 'xǁServerǁstep__mutmut_1', 'xǁServerǁstep__mutmut_2']
  mutants += ['x_added__mutmut_1', 'x_kept_too__mutmut_1']  # a name sharing a prefix
  assert mutation.changed_functions(now, mutants, kept) == (['x_added', 'xǁServerǁstep'], 3)


def test_a_changed_function_gets_a_new_mutmut_hash_and_an_unchanged_one_keeps_it():
  pytest.importorskip('mutmut')
  before = 'def f(a):\n  return a + 1\n\n\ndef g(a):\n  return a * 2\n'
  after = before.replace('a * 2', 'a * 3')
  old, _ = mutation.function_hashes('jfed/tiny.py', before)
  new, mutants = mutation.function_hashes('jfed/tiny.py', after)
  changed, count = mutation.changed_functions(new, mutants, old)
  assert changed == ['x_g'] and count == sum(m.startswith('x_g__') for m in mutants) > 0
  assert mutation.changed_functions(old, mutants, old) == ([], 0)
