"""experiments/hfldd_compare renders the same Markdown from the same results as before it stood on
experiments/sweep.py (golden files written by the earlier code, tests/data/sweep_golden/):
the committed docs/results/hfldd_compare_* OUTs as their command lines rendered them, a small
synthetic OUT of the old results.json layout with every record shape, and a sweep run here with
a fake `jfed.driver.run_experiment` (no training). Regenerate the files (only when a table is
meant to change) with `python -m tests.test_hfldd_compare`."""

import json
import pathlib
import re
import shutil
from typing import Any, Dict, List

import ml_collections
import pytest

from experiments import hfldd_compare
from tests.support import needs_fashion_mnist

GOLDEN = pathlib.Path(__file__).parent / 'data' / 'sweep_golden'
SYNTHETIC = GOLDEN / 'hfldd_compare_synthetic'  # results.json of the old layout; run.md, merge.md
DOCS_GOLDEN = GOLDEN / 'hfldd_compare_docs'
DOCS = pathlib.Path(__file__).parent.parent / 'docs' / 'results'
METHODS = ['hfldd', 'fedavg', 'fedprox', 'fedseq', 'dynafed', 'centralized']
# --targets of each docs OUT's command line (in its results.md); the others took the default
DOC_TARGETS = {
  'hfldd_compare_digits_iid': [0.8, 0.9],
  'hfldd_compare_fashion_c1': [0.6, 0.7, 0.8],
  'hfldd_compare_fashion_c2': [0.6, 0.7, 0.8],
  'hfldd_compare_fashion_iid': [0.6, 0.7, 0.8],
}
# The backend sentence names the machine: the renderer's before, the runs' (their stamps) now.
BACKEND = re.compile(r'^Backend [^;\n]*;', re.MULTILINE)


def normalise(text: str) -> str:
  return BACKEND.sub('Backend <normalised>;', text)


def saved_config(out: pathlib.Path) -> ml_collections.ConfigDict:
  saved = json.loads((out / 'results.json').read_text())
  return ml_collections.ConfigDict(saved.get('config') or saved['meta']['config'])


def render_docs(name: str, tmp: pathlib.Path) -> str:
  """A docs OUT rendered as its command line did: nothing run, its results merged into a new
  OUT (`--seeds= --merge=DIR`)."""
  src = DOCS / name
  return hfldd_compare.run_compare(
    saved_config(src), tmp / name, METHODS, DOC_TARGETS[name], seeds=(), merge=[str(src)]
  )


def render_synthetic(tmp: pathlib.Path) -> str:
  return hfldd_compare.run_compare(
    saved_config(SYNTHETIC), tmp / 'merged', METHODS, [0.5, 0.9], seeds=(), merge=[str(SYNTHETIC)]
  )


class FakeSummary:
  """What hfldd_compare reads of `jfed.api.RunSummary`."""

  def __init__(self, **fields: Any):
    self.__dict__.update(fields)


def fake_run_experiment(method: str, config, workdir: pathlib.Path) -> FakeSummary:
  """A run without training: a deterministic accuracy curve and cumulative bytes per round
  (none per epoch) in workdir/metrics.jsonl, the extras the paper formulas read; FedProx fails."""
  if method == 'fedprox':
    raise RuntimeError('diverged')
  k, seed = METHODS.index(method), int(config.seed)
  per_epoch = method == 'centralized'
  n = 2 if per_epoch else 3
  accuracy = [round(0.3 + 0.15 * i + 0.02 * seed + 0.01 * k, 4) for i in range(n)]
  cumulative = [int(2_000_000 * (k + 1) * (i + 1) + 100_000 * seed) for i in range(n)]
  records: List[Dict[str, Any]] = [{'step': 0, 'stage': 'setup', 'bytes': 10}]
  for i in range(n):
    record = {'step': i + 1, 'test_accuracy': accuracy[i]}
    if not per_epoch:
      record['cumulative_bytes'] = cumulative[i]
    records.append(record)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  extras: Dict[str, Any] = {'eval_samples': 260}
  if method == 'hfldd':
    extras.update(heads=[0, 1], clusters=[[0, 1, 2], [3, 4, 5, 6]])
  if method == 'fedseq':
    extras.update(superclients=[[0, 1], [2, 3, 4]])
  return FakeSummary(
    final_test_accuracy=accuracy[-1],
    best_test_accuracy=max(accuracy),
    best_step=n,
    step_name='epoch' if per_epoch else 'round',
    total_bytes=None if per_epoch else cumulative[-1],
    seconds=10.0 + k + seed,
    extras=extras,
  )


def run_fake(tmp: pathlib.Path, monkeypatch, seeds=(0, 1), methods=tuple(METHODS)) -> str:
  from jfed import driver  # pylint: disable=g-import-not-at-top
  from tests.support import hfldd_tiny_config  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(driver, 'run_experiment', fake_run_experiment)
  return hfldd_compare.run_compare(hfldd_tiny_config(), tmp, list(methods), [0.5, 0.7], seeds=seeds)


def want(path: pathlib.Path) -> str:
  return path.read_text()


_DOC_NAMES = [
  pytest.param(n, marks=needs_fashion_mnist) if 'fashion' in n else n for n in sorted(DOC_TARGETS)
]


@pytest.mark.parametrize('name', _DOC_NAMES)
def test_the_docs_outs_render_as_their_command_lines_did(name, tmp_path):
  assert normalise(render_docs(name, tmp_path)) == want(DOCS_GOLDEN / f'{name}.md')


@pytest.mark.parametrize('name', _DOC_NAMES)
def test_without_a_config_the_results_render_with_the_config_they_ran_with(name, tmp_path):
  """The config files changed since these runs (keys renamed and added): the whole-config check
  refuses them against today's files, so rendering stored results takes no --config."""
  text = hfldd_compare.run_compare(
    None, tmp_path / name, METHODS, DOC_TARGETS[name], seeds=(), merge=[str(DOCS / name)]
  )
  assert normalise(text) == want(DOCS_GOLDEN / f'{name}.md')


def test_without_a_config_nothing_runs_and_nothing_to_render_is_one_error(tmp_path):
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top

  with pytest.raises(ConfigError, match=r'^--config: required to run seeds; --seeds= \(none\)'):
    hfldd_compare.run_compare(None, tmp_path, METHODS, [0.5], seeds=(0,))
  with pytest.raises(ConfigError, match='^--config: not given, and neither .* holds results$'):
    hfldd_compare.run_compare(None, tmp_path, METHODS, [0.5], seeds=())
  assert not list(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.slow  # the command in a subprocess
@needs_fashion_mnist
def test_the_render_command_of_a_docs_out(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  name = 'hfldd_compare_fashion_iid'
  command = [
    sys.executable,
    '-m',
    'experiments.hfldd_compare',
    f'--out={tmp_path}',
    '--seeds=',
    f'--merge={DOCS / name}',
  ]
  done = subprocess.run(
    command, cwd=DOCS.parent.parent, capture_output=True, text=True, timeout=300, check=False
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert normalise((tmp_path / 'results.md').read_text()) == want(DOCS_GOLDEN / f'{name}.md')


def test_a_merged_out_of_the_old_layout_renders_as_before(tmp_path):
  assert normalise(render_synthetic(tmp_path)) == want(SYNTHETIC / 'merge.md')


def test_a_sweep_run_here_renders_as_before(tmp_path, monkeypatch):
  assert normalise(run_fake(tmp_path, monkeypatch)) == want(SYNTHETIC / 'run.md')


@needs_fashion_mnist
def test_an_out_of_the_old_layout_re_renders_in_place_and_is_upgraded(tmp_path):
  """`--out=OLD_OUT --seeds=` re-renders the OUT's own results.json (before: nothing was read and
  nothing written); its runs keep the machine its results.md named, and the file is rewritten in
  the sweep layout, which renders the same again."""
  name = 'hfldd_compare_fashion_iid'
  out = tmp_path / name
  shutil.copytree(DOCS / name, out)
  args = (saved_config(out), out, METHODS, DOC_TARGETS[name])
  first = hfldd_compare.run_compare(*args, seeds=())
  assert normalise(first) == want(DOCS_GOLDEN / f'{name}.md')
  assert 'Backend cpu, jax 0.10.2;' in first  # from the old results.md, not this machine
  saved = json.loads((out / 'results.json').read_text())
  assert sorted(saved) == ['meta', 'results', 'target_tables'] and saved['meta']['seeds'] == [0]
  runs = saved['results'][hfldd_compare.CELL]['0']
  assert {r['backend'] for r in runs.values()} == {'cpu, jax 0.10.2'}
  assert hfldd_compare.run_compare(*args, seeds=()) == first


def test_a_repeated_sweep_skips_finished_runs_and_retries_failed_ones(tmp_path, monkeypatch):
  from jfed import driver  # pylint: disable=g-import-not-at-top

  text = run_fake(tmp_path, monkeypatch)
  calls = []

  def counting(method, config, workdir):
    calls.append((int(config.seed), method))
    return fake_run_experiment(method, config, workdir)

  monkeypatch.setattr(driver, 'run_experiment', counting)
  from tests.support import hfldd_tiny_config  # pylint: disable=g-import-not-at-top

  again = hfldd_compare.run_compare(
    hfldd_tiny_config(), tmp_path, METHODS, [0.5, 0.7], seeds=(0, 1)
  )
  assert calls == [(0, 'fedprox'), (1, 'fedprox')]  # only the failed runs run again
  assert again == text
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert saved['results'][hfldd_compare.CELL]['1']['fedprox'] == {
    'status': 'error',
    'error': 'RuntimeError: diverged',
  }
  assert saved['target_tables']['0.5']['0'][0]['method'] == 'hfldd'


def test_merge_joins_the_methods_of_one_seed_run_apart_and_refuses_conflicts(tmp_path, monkeypatch):
  """experiments/gpu_queue runs each (seed, method) in its own OUT and merges them: one seed's
  methods from several OUTs join one table (before: 'seed 0 is in two of the merged OUTs'); a
  run finished differently in two OUTs, or an OUT of another config, is refused in one line."""
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from tests.support import hfldd_tiny_config  # pylint: disable=g-import-not-at-top

  for method in ('hfldd', 'fedavg'):
    run_fake(tmp_path / method, monkeypatch, seeds=(0,), methods=(method,))
  gpu = json.loads((tmp_path / 'fedavg' / 'results.json').read_text())
  gpu['meta'].update(backend='gpu', device_kind='NVIDIA H100', jax_version='0.0.1')
  for record in gpu['results'][hfldd_compare.CELL]['0'].values():
    del record['backend']
  (tmp_path / 'fedavg' / 'results.json').write_text(json.dumps(gpu))
  config, merge = hfldd_tiny_config(), [str(tmp_path / 'hfldd'), str(tmp_path / 'fedavg')]
  text = hfldd_compare.run_compare(config, tmp_path / 'all', METHODS, [0.5], seeds=(), merge=merge)
  assert '| hfldd | 60.00 ± 0.00 (n=1) |' in text and '| fedavg | 61.00 ± 0.00 (n=1) |' in text
  assert 'except on gpu (NVIDIA H100), jax 0.0.1: compare seed 0 (fedavg)' in text

  changed = json.loads((tmp_path / 'hfldd' / 'results.json').read_text())
  changed['results'][hfldd_compare.CELL]['0']['hfldd']['final_test_accuracy'] = 0.1
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'results.json').write_text(json.dumps(changed))
  with pytest.raises(ConfigError, match='--merge: compare seed 0 hfldd differs'):
    hfldd_compare.run_compare(
      config, tmp_path / 'x', METHODS, [0.5], seeds=(), merge=[merge[0], str(tmp_path / 'other')]
    )
  other = hfldd_tiny_config(**{'hfldd.rounds': 9})
  with pytest.raises(ConfigError, match=r'^--merge: .*hfldd.results\.json was run with another'):
    hfldd_compare.run_compare(other, tmp_path / 'y', METHODS, [0.5], seeds=(), merge=merge[:1])
  with pytest.raises(ConfigError, match=r'all.results\.json was run with another config; use a'):
    hfldd_compare.run_compare(other, tmp_path / 'all', METHODS, [0.5], seeds=())


def _record(final: float, accuracy: List[float], mib_per_round: float) -> Dict[str, Any]:
  return {
    'final_test_accuracy': final,
    'accuracy': accuracy,
    'cumulative_bytes': [int((i + 1) * mib_per_round * 2**20) for i in range(len(accuracy))],
  }


def test_each_kind_of_paper_claim_gets_the_verdict_its_seeds_give():
  """Accuracy claims follow the paired t-test's sign; 'similar' holds only when the seeds
  cannot tell the two apart; traffic counts a target never reached as more than any."""
  results = {
    str(seed): {
      'hfldd': _record(0.90 + 0.01 * seed, [0.5, 0.8, 0.9], 2.0),
      'fedavg': _record(0.50 + 0.02 * seed, [0.2, 0.4, 0.5], 1.0),
      'fedseq': _record(0.895 + 0.012 * seed, [0.85, 0.88, 0.9], 1.0 + 2 * seed),
    }
    for seed in range(3)
  }
  claim = hfldd_compare.Claim
  verdict = hfldd_compare.claim_verdict
  assert verdict(claim('hfldd', 'fedavg', 'accuracy', ''), results)[1] == 'holds'
  assert verdict(claim('fedavg', 'hfldd', 'accuracy', ''), results)[1] == 'fails'
  assert verdict(claim('hfldd', 'fedavg', 'similar', ''), results)[1] == 'fails (hfldd higher)'
  assert verdict(claim('hfldd', 'fedseq', 'similar', ''), results)[1] == 'holds (within noise)'
  # fedavg never reaches 0.8: hfldd's 4 MiB is less in every seed
  shown, v, n = verdict(claim('hfldd', 'fedavg', 'traffic', ''), results, 0.8)
  assert (v, n) == (
    'holds',
    3,
  ) and shown == 'MiB per seed: 4.0 vs never; 4.0 vs never; 4.0 vs never'
  assert verdict(claim('fedavg', 'hfldd', 'traffic', ''), results, 0.8)[1] == 'fails'
  assert verdict(claim('hfldd', 'fedavg', 'traffic', ''), results, 0.95)[1] == 'neither reaches it'
  # fedseq reaches 0.85 at round 1 with 1, 3 and 5 MiB against hfldd's 6 (round 3): it wins all
  # three; at 0.9 (round 3: 3, 9, 15 MiB against 6) it wins one seed of three
  assert verdict(claim('fedseq', 'hfldd', 'traffic', ''), results, 0.85)[1] == 'holds'
  assert verdict(claim('fedseq', 'hfldd', 'traffic', ''), results, 0.9)[1] == 'mixed (1 of 3 seeds)'
  results['1']['fedavg'] = {'error': 'diverged'}
  assert verdict(claim('hfldd', 'fedavg', 'accuracy', ''), results)[2] == 2


def test_the_claims_checked_are_those_the_paper_makes_at_the_partitions_classes_per_client():
  config = ml_collections.ConfigDict({'partition': {'scheme': 'shards', 'k': 10}})
  results = {'0': {'hfldd': _record(0.9, [0.5, 0.9], 1.0)}}
  text = '\n'.join(hfldd_compare.claim_lines(config, results, [0.8]))
  assert (
    'MNIST statements at #C=10' in text and '| fedseq less traffic than hfldd to 80 % |' in text
  )
  config.partition.scheme = 'dirichlet'
  assert hfldd_compare.claim_lines(config, results, [0.8]) == []


if __name__ == '__main__':
  import tempfile  # pylint: disable=g-import-not-at-top

  class _Patch:
    def setattr(self, obj, name, value):
      setattr(obj, name, value)

  DOCS_GOLDEN.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as d:
    tmp = pathlib.Path(d)
    for name in DOC_TARGETS:
      (DOCS_GOLDEN / f'{name}.md').write_text(normalise(render_docs(name, tmp)))
    (SYNTHETIC / 'merge.md').write_text(normalise(render_synthetic(tmp)))
    shutil.rmtree(tmp / 'run', ignore_errors=True)
    (SYNTHETIC / 'run.md').write_text(normalise(run_fake(tmp / 'run', _Patch())))
  print('written under', GOLDEN)
