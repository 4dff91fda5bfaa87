"""Re-checks the surviving mutants of a mutation report against today's tests, in minutes.

    python -m experiments.dev.mutation_recheck --report=docs/results/mutation/profiling.md \
        --tests=tests.test_profiling --names=kde_clusters,pruning_rates

`experiments.dev.mutation` (mutmut) takes about 10-20 s per mutant and worker; after new tests are
written for its survivors, this applies each survivor's one-line change (the `-`/`+` lines of
its diff in the report, matched without indentation inside the mutated function) to a copy of
the module, imports the copy, points the test module's `--names` at the copy's functions and
calls every test function of the test module (parametrised cases expanded; tests taking pytest
fixtures other than `tmp_path` are skipped). A mutant is killed by the first test that raises.
Prints one line per survivor: `killed by <test>`, `SURVIVED`, or `not applied` (a change this
simple matcher cannot replay, e.g. a deleted argument line: check those by hand). The next
mutmut run of the module is the authoritative score.
"""

import importlib
import importlib.util
import inspect
import pathlib
import re
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string('report', None, 'A mutation report: experiments.dev.mutation OUT/<module>.md.')
flags.DEFINE_string('tests', None, 'The test module, dotted (e.g. tests.test_profiling).')
flags.DEFINE_list('names', None, 'The names the test module imported from the mutated module.')

ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTANT = re.compile(r'### (\S+)\n\n```diff\n(.*?)```', re.S)

Case = Tuple[str, Callable, Dict[str, Any]]


def test_cases(module) -> List[Case]:
  """(name, function, keyword arguments) of every test function, parametrised cases expanded."""
  cases = []
  for name, fn in inspect.getmembers(module, inspect.isfunction):
    if not name.startswith('test_'):
      continue
    params = [m for m in getattr(fn, 'pytestmark', []) if m.name == 'parametrize']
    wanted = set(inspect.signature(fn).parameters) - {'tmp_path'}
    if params:
      names = params[0].args[0]
      names = [a.strip() for a in names.split(',')] if isinstance(names, str) else list(names)
      wanted -= set(names)
      for values in params[0].args[1]:
        values = getattr(values, 'values', values)
        kwargs = dict(zip(names, (values,) if len(names) == 1 else values))
        cases.append((name, fn, kwargs))
    elif not wanted:
      cases.append((name, fn, {}))
    if params and wanted:  # other fixtures: not replayable here
      cases = [c for c in cases if c[1] is not fn]
  return cases


def mutated_source(source: str, mutant: str, diff: str) -> Optional[str]:
  """`source` with the mutant's changed lines replayed; None where they cannot be matched."""
  function = re.search(r'x_(\w+?)__mutmut', mutant).group(1)
  changes = [l for l in diff.splitlines() if l[:1] in '-+' and l[:3] not in ('---', '+++')]
  removed = [l[1:].strip() for l in changes if l[0] == '-']
  added = [l[1:].strip() for l in changes if l[0] == '+']
  if not removed or len(removed) != len(added):
    return None
  lines = source.split('\n')
  at = next((i for i, l in enumerate(lines) if re.match(rf'\s*def {function}\s*\(', l)), None)
  if at is None:
    return None
  for old, new in zip(removed, added):
    k = next((i for i in range(at, len(lines)) if lines[i].strip() == old), None)
    if k is None:
      return None
    lines[k] = lines[k][: len(lines[k]) - len(lines[k].lstrip())] + new
    at = k + 1
  return '\n'.join(lines)


def first_failure(cases: List[Case]) -> Optional[str]:
  for name, fn, kwargs in cases:
    if 'tmp_path' in inspect.signature(fn).parameters:
      kwargs = {**kwargs, 'tmp_path': pathlib.Path(tempfile.mkdtemp())}
    try:
      fn(**kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      return f'{name}[{", ".join(map(str, kwargs.values()))}] ({type(e).__name__})'
  return None


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # the tests' progress lines
  sys.path.insert(0, str(ROOT))
  tests = importlib.import_module(FLAGS.tests)
  cases = test_cases(tests)
  report = pathlib.Path(FLAGS.report).read_text()
  path = ROOT / re.search(r'^Files: ([^,.\s]+\.py)', report, re.M).group(1)
  source = path.read_text()
  if first_failure(cases):
    raise app.UsageError(f'{FLAGS.tests} fails on the unmutated code: {first_failure(cases)}')
  for mutant, diff in MUTANT.findall(report):
    changed = mutated_source(source, mutant, diff)
    if changed is None:
      print(f'{mutant}: not applied')
      continue
    copy = pathlib.Path(tempfile.mkdtemp()) / path.name
    copy.write_text(changed)
    spec = importlib.util.spec_from_file_location(f'mutated_{path.stem}', copy)
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
    except Exception as e:  # pylint: disable=broad-except
      print(f'{mutant}: killed at import ({type(e).__name__})')
      continue
    saved = {n: getattr(tests, n) for n in FLAGS.names}
    for n in FLAGS.names:
      setattr(tests, n, getattr(module, n))
    try:
      killer = first_failure(cases)
    finally:
      for n, v in saved.items():
        setattr(tests, n, v)
    print(f'{mutant}: ' + (f'killed by {killer}' if killer else 'SURVIVED'), flush=True)


if __name__ == '__main__':
  flags.mark_flags_as_required(['report', 'tests', 'names'])
  app.run(main)
