"""Mutation testing of the method layer with mutmut: does a test notice a wrong weight, a swapped
argument, a dropped loss term?

For each module named, a scratch copy of the working tree (tracked and untracked, not ignored
files; `--scratch`/<module>, kept, so that a stopped run resumes where it stopped) gets a
`[tool.mutmut]` section that mutates that module alone and runs the module's own fast tests
(`MODULES`: its oracle test and its unit tests), then `mutmut run`. Each module's verdicts are
also kept outside the scratch copy (`--state`, by default runs/mutation/state, which git ignores),
so that a stopped run resumes from them on the same machine or, copied, on another (a lent GPU's
CPUs); the verdicts of every module's last run are in the results archive
(docs/results/ARCHIVE.md). mutmut 3 runs, for each mutant, only the tests
that call the mutated function; its workers come from a fork server that imports nothing but
the scientific stack (JAX must not be initialised before a fork).

    python -m experiments.dev.mutation --modules=aggregation,fedavg --max_children=2 \
        --out=docs/results/mutation

Writes OUT/<module>.md (score, every surviving mutant's diff) and OUT/summary.md (a row per
module, merged with the modules run before). After a `--rerun_survivors` pass,

    python -m experiments.dev.mutation --check_triage --modules=all

lists, per module, the survivors that its triage file (OUT/<module>_triage.md) sorts as killed,
and the functions whose source changed since its kept verdicts (their mutants, untested, are
what the next run of the module tests).
Killed counts timeouts as killed (mutmut's score); 'no tests' are mutants of code no selected
test runs. Cost on 2 CPU cores: about 10-20 s per mutant and worker; a module has 180-2,200
mutants.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Set, Tuple
import warnings

from absl import app, flags

from jfed.workdir import atomic_write_text

FLAGS = flags.FLAGS
flags.DEFINE_list('modules', ['aggregation'], 'keys of MODULES, or "all"')
flags.DEFINE_integer('max_children', 2, 'mutmut workers')
flags.DEFINE_float(
  'timeout_multiplier',
  60.0,
  "mutmut's timeout_multiplier (its default 15): a mutant's wall limit is (the tests' measured "
  'seconds + 1) times this, and a mutant child compiles its JAX programs afresh, so at 15 on '
  'loaded cores correct code timed out (34 of 129 mutants of centralized.py). Changing it re-runs '
  'the timed-out mutants of a resumed module.',
)
flags.DEFINE_string(
  'select',
  'not slow',
  "pytest's -m expression for every test run: by default a module's fast tests only (its oracle "
  "and unit tests), not the end-to-end 'learns' runs marked slow, which a survivor of a function "
  "they call would otherwise run in full (FedHydra, DENSE and Co-Boosting's take about a minute "
  "each). Changing it re-collects which tests call which function; the kept verdicts stay. '' "
  'runs every test of the files, as before 2026-12-02.',
)
flags.DEFINE_string('out', 'docs/results/mutation', 'report folder')
flags.DEFINE_bool(
  'rerun_survivors',
  False,
  "Forget the resumed module's verdicts of surviving and untested mutants, so that mutmut runs "
  'them (only them) again against the tests as they are now: the authoritative check of a triage.',
)
flags.DEFINE_string(
  'state',
  'runs/mutation/state',
  "where each module's verdicts are kept (<state>/<module>/<file>.meta, mutmut's own per-file "
  'record), saved every minute while mutmut runs and restored into a new scratch copy: a run '
  'stopped on one machine resumes on another (mutmut keeps the verdicts of the functions whose '
  'source is unchanged and tests the rest again)',
)
flags.DEFINE_string(
  'merge', None, "Instead of running: add another report folder's modules (summary.json) to OUT"
)
flags.DEFINE_list(
  'merge_only',
  None,
  "With --merge: take only these modules' rows (the other folder may hold older runs of the rest)",
)
flags.DEFINE_bool(
  'check_triage',
  False,
  'Instead of running: for each of --modules, compare its kept verdicts (--state) with its '
  "triage file (OUT/<module>_triage.md): the mutants its 'Killed ...' sections name that "
  'still survive, after a --rerun_survivors pass the one thing left to explain; and the '
  'functions changed since the kept verdicts, whose mutants no run has tested (needs mutmut)',
)
flags.DEFINE_string(
  'scratch',
  os.path.join(tempfile.gettempdir(), 'jfed-mutation'),
  "where each module's copy and mutmut's state live: a stopped run resumes from there",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]

# module key -> (files to mutate, the tests that check them)
MODULES: Dict[str, Tuple[List[str], List[str]]] = {
  'aggregation': (
    ['jfed/engine/aggregation.py'],
    [
      'tests/test_robust_aggregation.py',
      'tests/test_oracle_fedavg.py',
      'tests/test_settings_refused.py',
    ],
  ),
  'fedavg': (
    ['jfed/methods/fedavg.py'],
    ['tests/test_oracle_fedavg.py', 'tests/test_fedavg_mutants.py', 'tests/test_privacy.py'],
  ),
  'centralized_local': (
    ['jfed/methods/centralized.py', 'jfed/methods/local.py'],
    ['tests/test_oracle_fedavg.py'],
  ),
  'ot': (
    ['jfed/methods/ot.py', 'jfed/distill/ot_fusion.py'],
    ['tests/test_oracle_fedavg.py', 'tests/test_ot_fusion.py'],
  ),
  'feddf': (['jfed/methods/feddf.py'], ['tests/test_oracle_distill.py']),
  'oneshot': (
    ['jfed/methods/oneshot.py', 'jfed/methods/dense.py', 'jfed/methods/coboosting.py'],
    [
      'tests/test_oracle_distill.py',
      'tests/test_oneshot_methods.py',
      'tests/test_method_aux.py',
      # the reservoir's KD targets and resume (fedhydra.pool_limit)
      'tests/test_fedhydra_pool.py',
    ],
  ),
  'synthesis': (
    ['jfed/distill/synthesis.py', 'jfed/distill/generator.py', 'jfed/distill/pool.py'],
    [
      'tests/test_oracle_distill.py',
      'tests/test_oneshot_methods.py',
      'tests/test_kd_block.py',
      # the pool, the generator and the synthesis loop's scan form against NumPy and Python
      'tests/test_distill_losses.py',
      # the reservoir (pool_reservoir_add): its size, uniformity and resume
      'tests/test_fedhydra_pool.py',
    ],
  ),
  'diffaugment': (
    ['jfed/distill/diffaugment.py'],
    ['tests/test_diffaugment.py', 'tests/test_oracle_hfldd.py'],
  ),
  'distill_losses': (
    ['jfed/distill/losses.py', 'jfed/distill/kd.py', 'jfed/distill/ensemble.py'],
    [
      'tests/test_oracle_distill.py',
      'tests/test_distill_losses.py',
      # kd_block and its scan; FedTSA's mutual-learning loss and consensus
      'tests/test_kd_block.py',
      'tests/test_fedtsa.py',
    ],
  ),
  'fedhydra': (
    ['jfed/methods/fedhydra.py', 'jfed/distill/stratification.py'],
    [
      'tests/test_oracle_fedhydra.py',
      'tests/test_stratification.py',
      'tests/test_fedhydra_pool.py',
    ],
  ),
  # one module per file: each mutant re-runs whole setups (tens of seconds on 2 cores)
  'fedmho': (['jfed/methods/fedmho.py'], ['tests/test_oracle_fedmho.py', 'tests/test_fedmho.py']),
  'fedcvae': (
    ['jfed/methods/fedcvae.py'],
    ['tests/test_oracle_fedmho.py', 'tests/test_fedmho.py'],
  ),
  'generative': (
    ['jfed/methods/generative.py'],
    ['tests/test_oracle_fedmho.py', 'tests/test_fedmho.py'],
  ),
  'cvae': (
    ['jfed/cvae/server.py', 'jfed/cvae/losses.py'],
    ['tests/test_oracle_fedmho.py', 'tests/test_fusion_trainer.py', 'tests/test_cvae.py'],
  ),
  'fedtsa': (
    ['jfed/methods/fedtsa.py', 'jfed/distill/mutual.py'],
    ['tests/test_oracle_fedtsa.py', 'tests/test_fedtsa.py'],
  ),
  'heterofl_fedproto_fedmd': (
    ['jfed/methods/heterofl.py', 'jfed/methods/fedproto.py', 'jfed/methods/fedmd.py'],
    ['tests/test_oracle_fedtsa.py', 'tests/test_heterofl.py', 'tests/test_fedproto_fedmd.py'],
  ),
  'profiling': (
    ['jfed/profiling/kde.py'],
    ['tests/test_oracle_fedtsa.py', 'tests/test_profiling.py'],
  ),
  'hfldd': (
    ['jfed/methods/hfldd.py', 'jfed/clustering/hfldd.py'],
    ['tests/test_oracle_hfldd.py', 'tests/test_hfldd_clustering.py', 'tests/test_hfldd_methods.py'],
  ),
  'kip': (
    ['jfed/kip/kip.py', 'jfed/kip/kernels.py'],
    ['tests/test_oracle_hfldd.py', 'tests/test_kip.py', 'tests/test_phase_progress.py'],
  ),
  'fedseq_dynafed': (
    ['jfed/methods/fedseq.py', 'jfed/methods/dynafed.py', 'jfed/clustering/fedseq.py'],
    ['tests/test_oracle_hfldd.py', 'tests/test_hfldd_methods.py', 'tests/test_hfldd_clustering.py'],
  ),
  'cvae_clients': (
    [
      'jfed/cvae/clients.py',
      'jfed/cvae/decoder_kd.py',
      'jfed/cvae/synthetic.py',
      'jfed/cvae/models.py',
    ],
    ['tests/test_oracle_fedmho.py', 'tests/test_cvae.py', 'tests/test_fedmho.py'],
  ),
  'profiling_proxy': (
    ['jfed/profiling/proxy.py'],
    ['tests/test_oracle_fedtsa.py', 'tests/test_profiling.py', 'tests/test_phase_progress.py'],
  ),
  'methods_common': (
    ['jfed/methods/common.py', 'jfed/methods/seed_batch.py'],
    [
      'tests/test_oracle_fedavg.py',
      'tests/test_seed_batch.py',
      'tests/test_settings_refused.py',
      'tests/test_methods_common.py',
    ],
  ),
}

# The method layer and its building blocks (issue 33), each file in exactly one module of MODULES,
# except these: figures only (plots.py), package re-exports (__init__.py) and the name table of
# the registry (its refusals are tested by tests/test_driver.py, too slow to run per mutant).
MUTATED_PACKAGES = (
  'jfed/methods',
  'jfed/distill',
  'jfed/cvae',
  'jfed/kip',
  'jfed/clustering',
  'jfed/profiling',
  'jfed/engine/aggregation.py',
)
NOT_MUTATED = ('plots.py', '__init__.py', 'jfed/methods/registry.py')

# Imported by the fork server before it forks a worker: the libraries, never jfed (the mutated
# copy must be imported by the worker) and nothing that starts JAX's backend threads.
PRELOAD = ('numpy', 'scipy', 'sklearn', 'jax', 'jax.numpy', 'flax.linen', 'optax', 'pytest')


def _toml_list(items: List[str]) -> str:
  return '[' + ', '.join(json.dumps(i) for i in items) + ']'


def scratch_copy(dest: pathlib.Path) -> None:
  """The working tree's tracked and untracked (not ignored) files, copied to `dest`."""
  files = subprocess.run(
    ['git', 'ls-files', '-co', '--exclude-standard'],
    cwd=ROOT,
    check=True,
    capture_output=True,
    text=True,
  ).stdout.split()
  for name in files:
    src = ROOT / name
    if src.is_file():
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dest / name)


SELECTION_FILE = 'jfed_mutation_select.txt'


def configure(
  dest: pathlib.Path,
  paths: List[str],
  tests: List[str],
  select: str = '',
  timeout_multiplier: float = 60.0,
) -> None:
  """Appends the module's mutmut section to the scratch copy's pyproject.toml. A scratch copy
  whose recorded test selection (`select`, pytest's -m) differs loses mutmut's record of which
  tests call which function: kept, with a new selection, mutmut would clear every verdict; gone,
  it collects the record again and keeps the verdicts of unchanged functions."""
  (dest / 'mutmut_preload.txt').write_text('\n'.join(PRELOAD) + '\n')
  selection = dest / SELECTION_FILE
  before = selection.read_text() if selection.exists() else ''
  if before != select:
    (dest / 'mutants' / 'mutmut-stats.json').unlink(missing_ok=True)
  selection.write_text(select)
  pytest_args = ['-p', 'no:cacheprovider'] + (['-m', select] if select else [])
  with open(dest / 'pyproject.toml', 'a') as f:
    f.write(
      '\n[tool.mutmut]\n'
      f'paths_to_mutate = {_toml_list(paths)}\n'
      f'tests_dir = {_toml_list(tests)}\n'
      'also_copy = ["jfed/", "experiments/", "tests/"]\n'
      f'pytest_add_cli_args = {_toml_list(pytest_args)}\n'
      'process_isolation = "forkserver"\n'
      'forkserver_warmup = "import"\n'
      'preload_modules_file = "mutmut_preload.txt"\n'
      f'timeout_multiplier = {timeout_multiplier}\n'
    )


def forget_survivors(dest: pathlib.Path) -> int:
  """Clears the verdict of every surviving mutant (exit code 0: the tests passed) and of every
  mutant no test ran (33) in mutmut's per-file state, so that the next `mutmut run` tests them
  again, and mutmut's record of which tests call which function, so that it is taken again from
  the tests as they are now (mutmut watches only pyproject.toml for that). Returns how many."""
  (dest / 'mutants' / 'mutmut-stats.json').unlink(missing_ok=True)
  count = 0
  for meta_path in (dest / 'mutants').rglob('*.meta'):
    meta = json.loads(meta_path.read_text())
    codes = meta.get('exit_code_by_key', {})
    forgotten = [name for name, code in codes.items() if code in (0, 33)]
    for name in forgotten:
      codes[name] = None
    count += len(forgotten)
    meta_path.write_text(json.dumps(meta, indent=4))
  return count


def _meta_files(paths: List[str]) -> List[str]:
  return [f'{p}.meta' for p in paths]


def _verdict_count(meta_path: pathlib.Path) -> int:
  if not meta_path.exists():
    return -1
  try:
    codes = json.loads(meta_path.read_text()).get('exit_code_by_key', {})
  except json.JSONDecodeError:
    return -1
  return sum(code is not None for code in codes.values())


def restore_verdicts(dest: pathlib.Path, state: pathlib.Path, paths: List[str]) -> int:
  """Copies a kept per-file record into the scratch copy where it holds more verdicts than the
  copy's own (a new machine, a cleared /tmp, a run that went further elsewhere). Returns how
  many files were restored."""
  restored = 0
  for name in _meta_files(paths):
    kept, here = state / name, dest / 'mutants' / name
    if kept.exists() and _verdict_count(kept) > _verdict_count(here):
      here.parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(kept, here)
      restored += 1
  return restored


def save_verdicts(dest: pathlib.Path, state: pathlib.Path, paths: List[str]) -> None:
  """Keeps the scratch copy's per-file records (verdicts by mutant, hashes by function)."""
  for name in _meta_files(paths):
    here = dest / 'mutants' / name
    if here.exists():
      text = here.read_text()
      try:
        json.loads(text)
      except json.JSONDecodeError:  # caught mid-write by mutmut: the next save takes it
        continue
      (state / name).parent.mkdir(parents=True, exist_ok=True)
      atomic_write_text(state / name, text)


def _mutmut_env() -> Dict[str, str]:
  # tests/support.py's shared_fixture_scope: fixtures that several tests check set up per test
  return {**os.environ, 'JFED_MUTATION_TESTING': '1'}


def _mutmut(dest: pathlib.Path, *args: str, log=None) -> str:
  out = subprocess.run(
    [sys.executable, '-m', 'mutmut', *args],
    cwd=dest,
    env=_mutmut_env(),
    stdout=log or subprocess.PIPE,
    # mutmut's deprecation warnings (paths_to_mutate, tests_dir) stay out of the reports
    stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
    text=True,
  )
  return out.stdout or ''


def run_module(key: str, out: pathlib.Path, previous: Optional[Dict] = None) -> Dict:
  paths, tests = MODULES[key]
  t0 = time.time()
  dest = pathlib.Path(FLAGS.scratch) / key
  dest.mkdir(parents=True, exist_ok=True)
  scratch_copy(dest)
  configure(dest, paths, tests, FLAGS.select, FLAGS.timeout_multiplier)
  state = pathlib.Path(FLAGS.state) / key
  restored = restore_verdicts(dest, state, paths)
  if restored:
    print(f'{key}: verdicts of {restored} file(s) restored from {state}', flush=True)
  if FLAGS.rerun_survivors:
    print(f'{key}: {forget_survivors(dest)} surviving or untested mutants to run again', flush=True)
  with open(out / f'{key}.log', 'a') as log:
    run = subprocess.Popen(
      [sys.executable, '-m', 'mutmut', 'run', '--max-children', str(FLAGS.max_children)],
      cwd=dest,
      env=_mutmut_env(),
      stdout=log,
      stderr=subprocess.STDOUT,
      text=True,
    )
    try:
      while run.poll() is None:
        try:
          run.wait(timeout=60)
        except subprocess.TimeoutExpired:
          save_verdicts(dest, state, paths)
    finally:
      if run.poll() is None:  # the runner itself was stopped: stop mutmut too
        run.terminate()
        run.wait()
      save_verdicts(dest, state, paths)
  _mutmut(dest, 'export-cicd-stats')
  stats_path = dest / 'mutants' / 'mutmut-cicd-stats.json'
  stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
  survivors = [
    line.strip().split(':')[0]
    for line in _mutmut(dest, 'results').splitlines()
    if line.strip().endswith(': survived')
  ]
  diffs = {name: _mutmut(dest, 'show', name) for name in survivors}
  tested = stats.get('total', 0) - stats.get('skipped', 0) - stats.get('no_tests', 0)
  killed = stats.get('killed', 0) + stats.get('timeout', 0)
  row = {
    'module': key,
    'files': paths,
    'tests': tests,
    'select': FLAGS.select,
    'stats': stats,
    'score': (killed / tested) if tested else None,
    'survivors': survivors,
    'minutes': (time.time() - t0) / 60,
    'machine': f'{os.cpu_count()} CPU cores, {FLAGS.max_children} workers',
  }
  if FLAGS.rerun_survivors and previous:
    # the module's first full run, before the tests written for its survivors
    row['first_run'] = previous.get('first_run') or {
      k: previous[k] for k in ('stats', 'score', 'minutes', 'machine') if k in previous
    }
  lines = [
    f'# Mutation testing: {key}',
    '',
    f'Files: {", ".join(paths)}. Tests: {", ".join(tests)}'
    + (f' (pytest -m "{FLAGS.select}").' if FLAGS.select else ' (every test of the files).'),
    f'Command: `python -m experiments.dev.mutation --modules={key} '
    f'--max_children={FLAGS.max_children} --select="{FLAGS.select}"` '
    f'({row["minutes"]:.0f} min on {row["machine"]}).',
    '',
    f'mutmut stats: {json.dumps(stats)}',
    'Score (killed + timeout over mutants some test ran): '
    + (f'{100 * row["score"]:.1f}%' if row['score'] is not None else 'n/a'),
    '',
    f'## Surviving mutants ({len(survivors)})',
    '',
  ]
  for name, diff in diffs.items():
    lines += [f'### {name}', '', '```diff', re.sub(r'\n+$', '', diff), '```', '']
  atomic_write_text(out / f'{key}.md', '\n'.join(lines) + '\n')
  return row


def write_summary(out: pathlib.Path, rows: Dict[str, Dict]) -> None:
  """OUT/summary.json (every module's row) and OUT/summary.md (their table; a module's triage,
  OUT/<module>_triage.md, linked where it exists)."""
  atomic_write_text(out / 'summary.json', json.dumps(rows, indent=2) + '\n')
  table = [
    '# Mutation scores (mutmut; `python -m experiments.dev.mutation`)',
    '',
    'Score: killed + timeout over the mutants some selected test ran. Survivors, each with',
    'its diff: `<module>.md`; their triage (killed by a new test, or why equivalent):',
    '`<module>_triage.md`. Where the survivors were run again against the tests written for',
    'them (`--rerun_survivors`), the row is that run and "first run" the full run before it.',
    '',
    '| module | mutants | killed | timeout | survived | no tests | score | minutes | machine '
    '| first run | triage |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for k, r in rows.items():
    s = r['stats']
    score = f'{100 * r["score"]:.1f}%' if r['score'] is not None else 'n/a'
    triage = f'[{k}_triage.md]({k}_triage.md)' if (out / f'{k}_triage.md').exists() else '—'
    first = r.get('first_run')
    if not first:
      first_cell = '—'
    elif 'note' in first:  # a first run stopped part-way: its counts so far
      first_cell = first['note']
    else:
      first_cell = (
        f'{100 * first["score"]:.1f}%, {first["stats"].get("survived", 0)} survived, '
        f'{first["minutes"]:.0f} min'
      )
    table.append(
      f'| {k} | {s.get("total", 0)} | {s.get("killed", 0)} | {s.get("timeout", 0)} | '
      f'{s.get("survived", 0)} | {s.get("no_tests", 0)} | {score} | {r["minutes"]:.0f} | '
      f'{r.get("machine", "2 CPU cores, 2 workers")} | {first_cell} | {triage} |'
    )
  atomic_write_text(out / 'summary.md', '\n'.join(table) + '\n')


def merge(
  out: pathlib.Path, rows: Dict[str, Dict], other: pathlib.Path, only: Optional[List[str]] = None
) -> None:
  """Adds the modules of another report folder (a run on another machine) to OUT: their rows and
  their <module>.md reports; `only` names the modules to take."""
  path = other / 'summary.json'
  if not path.exists():
    raise app.UsageError(f'--merge={other}: no summary.json there')
  theirs = json.loads(path.read_text())
  missing = [k for k in only or [] if k not in theirs]
  if missing:
    raise app.UsageError(f'--merge_only: {missing} not in {path}')
  for key, row in theirs.items():
    if only is not None and key not in only:
      continue
    if key not in MODULES:
      raise app.UsageError(f'--merge={other}: unknown module {key!r}')
    shutil.copyfile(other / f'{key}.md', out / f'{key}.md')
    rows[key] = row


# A triage names mutants as mutmut numbers them per function: `FedDF.step` 9, 12-14 and 20.
_TRIAGE_NAMES = re.compile(r'`([A-Za-z_][\w.]*)` ((?:\d+(?:-\d+)?(?:,? (?:and )?)?)+)')


def triage_claims(text: str) -> Set[Tuple[str, int]]:
  """The (function, mutant number) pairs that a triage's sections headed 'Killed ...' name, the
  function as written there (`Class.method` or `function`); a section of mutants killed by
  tests outside the module's list names survivors by design and is left out. A heuristic: a
  range that a sentence then splits, or numbers of an earlier pass, are taken as written."""
  claims = set()
  for section in re.split(r'^## ', text, flags=re.M)[1:]:
    if not section.startswith('Killed') or 'outside' in section.split('\n', 1)[0]:
      continue
    for name, numbers in _TRIAGE_NAMES.findall(' '.join(section.split())):
      for first, last in re.findall(r'(\d+)(?:-(\d+))?', numbers):
        claims.update((name, n) for n in range(int(first), int(last or first) + 1))
  return claims


def _readable(function: str) -> str:
  """mutmut's function name `xǁClassǁmethod` or `x_function` as `Class.method` or `function`."""
  name = function[2:] if function.startswith('x_') else function.removeprefix('x')
  return name.strip('ǁ').replace('ǁ', '.')


def _function_of(mutant: str) -> Tuple[str, int]:
  """mutmut's key `pkg.module.xǁClassǁmethod__mutmut_7` as ('Class.method', 7)."""
  name, number = mutant.rsplit('.', 1)[-1].rsplit('__mutmut_', 1)
  return _readable(name), int(number)


def claimed_survivors(
  claims: Set[Tuple[str, int]], verdicts: Dict[str, Optional[int]]
) -> List[str]:
  """The survivors (exit code 0) among `verdicts` that `claims` sorts as killed; a claim written
  without its class matches that method of any class."""
  found = []
  for mutant, code in verdicts.items():
    if code != 0:
      continue
    name, number = _function_of(mutant)
    if (name, number) in claims or (name.rsplit('.', 1)[-1], number) in claims:
      found.append(mutant)
  return sorted(found)


def changed_functions(
  hashes: Dict[str, str], mutant_names: List[str], kept_hashes: Dict[str, str]
) -> Tuple[List[str], int]:
  """The functions whose mutmut hash differs from the kept one (or that are new), and how many
  of `mutant_names` (mutmut's `function__mutmut_N`) they hold: `mutmut run` clears exactly
  those verdicts, so this is the work left before the module's score describes its source."""
  changed = sorted(f for f, h in hashes.items() if kept_hashes.get(f) != h)
  names = set(changed)
  return changed, sum(m.rsplit('__mutmut_', 1)[0] in names for m in mutant_names)


def function_hashes(path: str, code: str) -> Tuple[Dict[str, str], List[str]]:
  """mutmut's hash of each function of `code` (file `path`) and its mutants' names, computed by
  mutmut itself as `mutmut run` does before it compares them with the kept ones."""
  try:
    from mutmut.mutation import file_mutation  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # not installed, or a mutmut older than the one pyproject names
    raise SystemExit(  # one line, not absl's usage text
      f"reading mutmut's function hashes needs mutmut (pip install -e '.[mutation]'): {e}"
    ) from e

  cwd = os.getcwd()
  with tempfile.TemporaryDirectory() as config_dir, warnings.catch_warnings():
    # mutmut reads its settings from the working directory's pyproject.toml, and needs one
    warnings.simplefilter('ignore')  # its deprecation of paths_to_mutate, which configure writes
    pathlib.Path(config_dir, 'pyproject.toml').write_text(
      f'[tool.mutmut]\npaths_to_mutate = {_toml_list([path])}\n'
    )
    os.chdir(config_dir)
    try:
      mutated = file_mutation.mutate_file_contents(path, code)
    finally:
      os.chdir(cwd)
  return dict(mutated.hash_by_function_name), list(mutated.mutant_names)


def kept_records(key: str, state: pathlib.Path) -> Dict[str, Optional[Dict]]:
  """Each file of a module and its kept mutmut record (verdicts, function hashes), or None."""
  records = {}
  for path, name in zip(MODULES[key][0], _meta_files(MODULES[key][0])):
    kept = state / key / name
    records[path] = json.loads(kept.read_text()) if kept.exists() else None
  return records


def check_source(records: Dict[str, Optional[Dict]]) -> None:
  """Prints, per file of a module (`kept_records`), the functions changed since its kept
  verdicts and how many mutants they hold."""
  for path, record in records.items():
    if record is None:
      print(f'  {path}: no kept verdicts (run before they were kept), its changes unknown')
      continue
    hashes, mutants = function_hashes(path, (ROOT / path).read_text())
    changed, count = changed_functions(hashes, mutants, record.get('hash_by_function_name', {}))
    if changed:
      print(
        f'  {path}: {count} mutants untested, of what changed since: '
        + ', '.join(map(_readable, changed))
      )


def check_triage(key: str, out: pathlib.Path, records: Dict[str, Optional[Dict]]) -> List[str]:
  """Prints and returns `claimed_survivors` for a module's kept records (`kept_records`) and
  its triage file."""
  triage = out / f'{key}_triage.md'
  if not triage.exists():
    raise app.UsageError(f'--check_triage: no {triage}')
  verdicts: Dict[str, Optional[int]] = {}
  for record in records.values():
    if record is not None:
      verdicts.update(record['exit_code_by_key'])
  claims = triage_claims(triage.read_text())
  found = claimed_survivors(claims, verdicts)
  codes = list(verdicts.values())
  other = len(codes) - codes.count(1) - codes.count(0) - codes.count(None)
  print(
    f'{key}: {len(claims)} mutants sorted as killed; verdicts {codes.count(1)} killed, '
    f'{codes.count(0)} survived, {codes.count(None)} pending, {other} other (timeout, crash); '
    'sorted as killed yet surviving '
    f"(each to read in the triage: killed since, or an older pass's number): {len(found)}",
    *found,
    sep='\n  ',
  )
  return found


def main(argv):
  del argv
  # `timeout` and kill stop the runner with SIGTERM: unwind, so that mutmut is stopped and the
  # verdicts so far are kept (run_module's finally)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  keys = list(MODULES) if FLAGS.modules == ['all'] else FLAGS.modules
  unknown = [k for k in keys if k not in MODULES]
  if unknown:
    raise app.UsageError(f'unknown --modules {unknown}; known: {", ".join(MODULES)}')
  out = pathlib.Path(FLAGS.out)
  if FLAGS.check_triage:  # reads the triages and kept verdicts only: writes nothing
    for key in keys:
      records = kept_records(key, pathlib.Path(FLAGS.state))
      check_triage(key, out, records)
      check_source(records)
    return
  out.mkdir(parents=True, exist_ok=True)
  summary_path = out / 'summary.json'
  rows = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  if FLAGS.merge:
    merge(out, rows, pathlib.Path(FLAGS.merge), FLAGS.merge_only)
    write_summary(out, rows)
    return
  for key in keys:
    print(f'mutating {key} ...', flush=True)
    rows[key] = run_module(key, out, rows.get(key))
    r = rows[key]
    print(f'{key}: {r["stats"]} ({r["minutes"]:.0f} min)', flush=True)
    write_summary(out, rows)


if __name__ == '__main__':
  app.run(main)
