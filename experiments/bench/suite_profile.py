"""Where a test-suite run spent its time and memory, from pytest's `--compile-profile` file.

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) python -m pytest -q -n auto --dist loadfile \
        -m "not slow" --compile-profile=/tmp/profile.jsonl
    python -m experiments.bench.suite_profile /tmp/profile.jsonl [--files=15] [--tests=0]

tests/conftest.py writes one JSON line per test (wall and CPU seconds, XLA compilation seconds and
count, tracing and lowering seconds, the costliest programs, the process's peak memory so far and
its xdist worker). This prints the totals, each worker's peak resident memory with the test where
it was reached and the five tests that raised it most, and the costliest files by test-seconds
(with their compile seconds and programs); `--tests=N` adds the N slowest tests. It reads a file
only, in a second or two: the figures of docs/performance.md's suite-time section come from it.
"""

import collections
import json
from typing import Dict, List, Sequence

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer('files', 15, 'how many of the costliest test files to list')
flags.DEFINE_integer('tests', 0, 'how many of the slowest tests to list (0: none)')


def read_profile(path: str) -> List[Dict]:
  """The profile's records, one per test; blank lines are skipped."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _seconds(record: Dict, key: str) -> float:
  return float(record.get(key, 0.0))  # tracing and lowering: profiles since 2026-12-02 only


def summarize(records: Sequence[Dict], files: int = 15, tests: int = 0) -> str:
  """The report as text (see the module docstring)."""
  total = lambda key: sum(_seconds(r, key) for r in records)
  lines = [
    f'{len(records)} tests, {total("wall"):.0f} test-seconds: {total("compile"):.0f} s compiling '
    f'{sum(int(r["compiles"]) for r in records)} programs, {total("lower"):.0f} s lowering, '
    f'{total("trace"):.0f} s tracing'
  ]
  by_worker = collections.defaultdict(list)
  for r in records:
    by_worker[r.get('worker', 'main')].append(r)
  for worker, rs in sorted(by_worker.items()):
    peak = max(r['max_rss_mb'] for r in rs)
    reached = next(r for r in rs if r['max_rss_mb'] == peak)
    lines.append(
      f'{worker}: {sum(_seconds(r, "wall") for r in rs):.0f} test-seconds, peak {peak} MB at '
      f'{reached["test"]}'
    )
    rises = sorted(
      ((b['max_rss_mb'] - a['max_rss_mb'], b['test']) for a, b in zip(rs, rs[1:])),
      key=lambda rise: -rise[0],
    )
    lines += [f'  +{mb} MB {test}' for mb, test in rises[:5] if mb > 0]
  per_file = collections.defaultdict(lambda: [0.0, 0.0, 0])
  for r in records:
    row = per_file[r['test'].split('::')[0]]
    row[0] += _seconds(r, 'wall')
    row[1] += _seconds(r, 'compile')
    row[2] += int(r['compiles'])
  lines.append('costliest files (test-seconds; compile seconds; programs):')
  for name, (wall, compile_s, programs) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[
    :files
  ]:
    lines.append(f'  {name}: {wall:.0f} s; {compile_s:.0f} s; {programs}')
  if tests:
    lines.append('slowest tests (seconds; compile seconds):')
    for r in sorted(records, key=lambda r: -_seconds(r, 'wall'))[:tests]:
      lines.append(f'  {_seconds(r, "wall"):.1f}; {_seconds(r, "compile"):.1f}  {r["test"]}')
  return '\n'.join(lines)


def main(argv):
  if len(argv) != 2:
    raise app.UsageError('one argument: the --compile-profile file')
  print(summarize(read_profile(argv[1]), FLAGS.files, FLAGS.tests))


if __name__ == '__main__':
  app.run(main)
