"""experiments/sweep.py: the runner the table commands stand on (resume, one error shape, atomic
writes, merge with backend stamps, statistics, table and plot writers). No run of jfed: each
`execute` is a stub returning a record."""

import json
import pathlib
import sys

import pytest

from experiments import sweep
from jfed.errors import ConfigError

META = {'backend': 'cpu', 'device_kind': 'cpu', 'jax_version': '0.0.0'}


def _open(tmp_path, seeds=(0, 1), merge=()):
  s = sweep.Sweep.open(tmp_path / 'out', seeds, merge, budget='smoke')
  s.meta.update(META)  # the machine the records are stamped with
  s.render = lambda s: {'tables.md': '\n'.join(sweep.table_lines(['Run', 'n'], [['a', '1']]))}
  return s


def test_a_sweep_skips_finished_runs_records_failures_in_one_shape_and_retries_them(tmp_path):
  calls = []

  def ok(value):
    def execute():
      calls.append(value)
      return {'final_test_accuracy': value, 'best_test_accuracy': value + 0.1}

    return execute

  def boom():
    calls.append('boom')
    raise RuntimeError('diverged')

  s = _open(tmp_path)
  s.run_one('c', 0, 'a', ok(0.5))
  s.run_one('c', 0, 'b', boom)
  saved = json.loads((tmp_path / 'out' / 'results.json').read_text())
  assert saved['results']['c']['0']['b'] == {'status': 'error', 'error': 'RuntimeError: diverged'}
  assert saved['meta']['budget'] == 'smoke' and saved['meta']['seeds'] == [0, 1]
  assert (tmp_path / 'out' / 'tables.md').read_text().startswith('| Run | n |')
  # the next invocation reads the file back: 'a' is skipped, the failed 'b' runs again
  again = _open(tmp_path)
  assert again.run_one('c', 0, 'a', ok(0.9)) is None
  assert again.run_one('c', 0, 'b', ok(0.7))['final_test_accuracy'] == 0.7
  assert calls == [0.5, 'boom', 0.7]
  assert again.results['c']['0']['a']['final_test_accuracy'] == 0.5
  assert again.results['c']['0']['a']['backend'] == 'cpu, jax 0.0.0'  # stamped where it ran


def test_save_writes_through_the_atomic_writer(tmp_path, monkeypatch):
  """fedmho_tables wrote results.json with Path.write_text (a kill mid-write tore it); every
  file a Sweep writes goes through jfed.workdir.atomic_write_text."""
  from jfed import workdir  # pylint: disable=g-import-not-at-top

  written = []
  real = workdir.atomic_write_text
  monkeypatch.setattr(
    workdir, 'atomic_write_text', lambda path, text: (written.append(path.name), real(path, text))
  )
  _open(tmp_path).save()
  assert sorted(written) == ['results.json', 'tables.md']


def test_merge_keeps_each_runs_backend_and_joins_the_seeds(tmp_path):
  other = tmp_path / 'gpu'
  other.mkdir()
  meta = {'backend': 'gpu', 'device_kind': 'NVIDIA H100', 'jax_version': '0.0.1', 'seeds': [2]}
  results = {'c': {'2': {'a': {'final_test_accuracy': 0.8, 'best_test_accuracy': 0.9}}}}
  (other / 'results.json').write_text(json.dumps({'meta': meta, 'results': results}))
  s = _open(tmp_path, seeds=(0,), merge=[str(other)])
  s.run_one('c', 0, 'a', lambda: {'final_test_accuracy': 0.6, 'best_test_accuracy': 0.7})
  saved = json.loads((tmp_path / 'out' / 'results.json').read_text())
  assert saved['meta']['seeds'] == [0, 2]
  assert saved['results']['c']['2']['a']['backend'] == 'gpu (NVIDIA H100), jax 0.0.1'
  assert saved['results']['c']['0']['a']['backend'] == 'cpu, jax 0.0.0'
  with pytest.raises(ConfigError, match='--merge: .*nope.* does not exist'):
    sweep.Sweep.open(tmp_path / 'out', [0], [str(tmp_path / 'nope')])


def test_derived_data_is_written_beside_the_results_and_not_read_back(tmp_path):
  s = _open(tmp_path)
  s.derived = lambda s: {'tables': {'n': len(s.results)}, 'results': 'ignored'}
  s.run_one('c', 0, 'a', lambda: {'final_test_accuracy': 0.5})
  saved = json.loads((tmp_path / 'out' / 'results.json').read_text())
  assert list(saved) == ['meta', 'results', 'tables'] and saved['tables'] == {'n': 1}
  assert _open(tmp_path).results == {'c': {'0': {'a': saved['results']['c']['0']['a']}}}


def test_old_shape_errors_stay_errors_when_stamped_and_conflicting_merges_are_config_errors():
  from experiments import seed_tables  # pylint: disable=g-import-not-at-top

  results = {'c': {'0': {'a': {'error': 'x'}, 'b': {'final_test_accuracy': 0.5}}}}
  seed_tables.stamp_backend(results, META)
  assert results['c']['0']['a'] == {'error': 'x'}  # a stamp would have made it a finished run
  assert results['c']['0']['b']['backend'] == 'cpu, jax 0.0.0'
  theirs = {'c': {'0': {'a': {'final_test_accuracy': 0.6}, 'b': {'final_test_accuracy': 0.7}}}}
  with pytest.raises(ConfigError, match='^--merge: c seed 0 b differs between the sweeps$'):
    seed_tables.merge_seed_results(results, theirs)


def test_cell_stats_give_mean_and_sample_std_of_final_and_best_with_failures_counted():
  results = {
    'c': {
      '0': {'a': {'final_test_accuracy': 0.5, 'best_test_accuracy': 0.6}},
      '1': {'a': {'final_test_accuracy': 0.7, 'best_test_accuracy': 0.8}},
      '2': {'a': sweep.error_record(ValueError('x'))},
      '3': {'a': {'error': 'hfldd_compare shape'}},
    }
  }
  final = sweep.cell_stats(results, 'c', 'a', 'final_test_accuracy')
  best = sweep.cell_stats(results, 'c', 'a', 'best_test_accuracy')
  assert final.mean == pytest.approx(60.0) and final.std == pytest.approx(14.1421356)
  assert best.mean == pytest.approx(70.0) and (final.n, final.errors) == (2, 2)
  assert sweep.is_error({'error': 'x'}) and not sweep.is_error({'error': None, 'x': 1})
  none = sweep.cell_stats(results, 'd', 'a', 'final_test_accuracy')
  assert none.n == 0 and none.mean != none.mean  # NaN


def test_table_and_plot_writers(tmp_path):
  assert sweep.table_lines(['Rule', '10%', '20%'], [['mean', '1', '2']]) == [
    '| Rule | 10% | 20% |',
    '|---|---:|---:|',
    '| mean | 1 | 2 |',
  ]
  path = tmp_path / 'p.png'
  panels = {'noise': {'mean': ([0, 0.1], [90.0, 80.0], [1.0, 2.0])}, 'scaling': {}}
  sweep.plot_errorbar_panels(path, panels, 'fraction', 'accuracy (%)', 'title', ylim=(0, 100))
  assert path.read_bytes()[:4] == b'\x89PNG'


def test_check_known_names_the_flag_and_the_valid_names():
  sweep.check_known('runs', ['a'], ['a', 'b'])
  with pytest.raises(ConfigError, match=r"^--runs: unknown \['c'\]; valid: a, b$"):
    sweep.check_known('runs', ['a', 'c'], ['a', 'b'])


def test_a_commands_user_error_is_one_error_line(monkeypatch, capsys):
  def main(argv):
    del argv
    raise ConfigError("--runs: unknown ['x']\n  more")

  monkeypatch.setattr(sys, 'argv', ['cmd'])
  with pytest.raises(SystemExit) as exit_:
    sweep.run_command(main, lambda: None)
  assert exit_.value.code == 1
  assert capsys.readouterr().err.strip() == "error: --runs: unknown ['x'] more"


def test_hfldd_compare_records_a_failed_run_in_the_one_error_shape(tmp_path):
  """hfldd_compare wrote {'error': message}; it now writes `sweep.error_record`'s shape in the
  sweep layout, and still reads the old one (docs/results/hfldd_compare_*/results.json)."""
  from experiments import hfldd_compare  # pylint: disable=g-import-not-at-top
  from tests.support import hfldd_tiny_config  # pylint: disable=g-import-not-at-top

  hfldd_compare.run_compare(hfldd_tiny_config(), tmp_path, ['no_such_method'], [0.5], seeds=[0])
  saved = json.loads((tmp_path / 'results.json').read_text())
  record = saved['results'][hfldd_compare.CELL]['0']['no_such_method']
  assert record['status'] == 'error' and record['error'].startswith('ConfigError: ')
  old = {'0': {'a': {'error': 'x'}}, '1': {'a': {'final_test_accuracy': 1.0}}}
  assert hfldd_compare.finished(old, 'a') == [{'final_test_accuracy': 1.0}]


@pytest.mark.slow  # a command in a subprocess
@pytest.mark.parametrize(
  'args, message',
  [
    (['--config=experiments/configs/fedtsa_digits.py:bogus'], "unknown config variant 'bogus'"),
    (['--config=experiments/configs/nope.py'], '--config: file experiments/configs/nope.py'),
    (['--config=experiments/configs/fedtsa_digits.py', '--runs=x'], "--runs: unknown ['x']"),
  ],
)
def test_a_table_commands_bad_flag_is_one_error_line(args, message, tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top

  command = [sys.executable, '-m', 'experiments.fedtsa_tables', f'--out={tmp_path}', *args]
  done = subprocess.run(
    command, cwd=pathlib.Path(__file__).parent.parent, capture_output=True, text=True, timeout=300
  )
  assert done.returncode in (1, 2)
  lines = [line for line in done.stderr.splitlines() if line.startswith('error:')]
  assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]
  assert 'Traceback' not in done.stderr


def test_last_fifth_rise_and_the_per_step_curve_from_metrics(tmp_path):
  from experiments import seed_tables  # pylint: disable=g-import-not-at-top

  curve = [0.1, 0.3, 0.5, 0.6, 0.65, 0.7, 0.72, 0.74, 0.75, 0.76]  # fifths of 2 steps
  assert seed_tables.last_fifth_rise(curve) == pytest.approx((0.755 - 0.73), abs=1e-12)
  assert seed_tables.last_fifth_rise([0.5] * 7) == 0.0  # a plateau
  assert seed_tables.last_fifth_rise([0.1, 0.2, 0.3, 0.4]) is None  # too short to tell
  records = [
    {'step': 0, 'stage': 'setup', 'test_accuracy': 0.05},  # setup: not a step of the curve
    {'step': 1, 'round': 1, 'test_accuracy': 0.2},
    {'step': 2, 'distill_step': 1},  # no accuracy
    {'step': 2, 'round': 2, 'test_accuracy': 0.3},
    {'step': 2, 'round': 2, 'test_accuracy': 0.35},  # the step's last record wins
    {'step': 3, 'test_accuracy': None},
  ]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  assert seed_tables.step_accuracies(tmp_path) == [0.2, 0.35]
