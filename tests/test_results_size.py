"""docs/results/ holds curated tables and figures only (issue 84): what git tracks there stays
under RESULTS_LIMIT_BYTES, and no generated state (mutmut's verdicts, raw GPU-queue runs) is
tracked. Where it went: docs/results/ARCHIVE.md."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_LIMIT_BYTES = 6 * 1000 * 1000


def _tracked(folder: str):
  try:
    listing = subprocess.run(
      ['git', 'ls-files', '-z', folder], cwd=ROOT, capture_output=True, check=True
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip('not a git checkout')
  return [ROOT / name for name in listing.decode().split('\0') if name]


def test_tracked_results_stay_small():
  sizes = {p: p.stat().st_size for p in _tracked('docs/results') if p.is_file()}
  total = sum(sizes.values())
  largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
  assert total <= RESULTS_LIMIT_BYTES, (
    f'{total} bytes tracked in docs/results; the largest: '
    + ', '.join(f'{p.relative_to(ROOT)} ({sizes[p]})' for p in largest)
  )


def test_no_generated_state_is_tracked():
  generated = [
    p.relative_to(ROOT).as_posix()
    for p in _tracked('docs/results')
    if p.suffix in ('.meta', '.jsonl', '.log') or p.name.endswith('_first_run.md')
  ]
  assert not generated, generated[:10]
