"""experiments/dev/probes.py: how a probe's ending is classified, and (slow) a handful of probes run
as the whole list runs them (`python -m experiments.dev.probes`)."""

import pytest

from experiments.dev import probes


def test_endings_are_classified():
  assert probes.classify(None, '') == 'hang'
  assert probes.classify(0, 'warning: something\n') == 'success'
  assert probes.classify(1, 'I1126 line\nerror: workdir w is busy\n') == 'error'
  assert probes.classify(2, 'error: --config is required\n') == 'error'
  assert probes.classify(1, 'Traceback (most recent call last):\nerror: x\n') == 'traceback'
  assert probes.classify(0, 'Traceback (most recent call last):\n') == 'traceback'
  assert probes.classify(-6, 'F1126 check failed\n') == 'crash'
  assert probes.classify(1, 'no error line\n') == 'crash'


def test_every_probe_has_a_unique_name_and_an_expected_ending():
  names = [p.name for p in probes.PROBES]
  assert len(names) == len(set(names))
  assert {p.expect for p in probes.PROBES} <= {'error', 'success'}


@pytest.mark.slow
@pytest.mark.parametrize(
  'name',
  [
    'coordinator_without_port',
    'gzip_bomb_idx',
    'bad_magic_idx',
    'stale_lock',
    'live_lock',
    'dead_peer',
    'dead_coordinator',
    'unverified_checkpoint_diverges',
  ],
)
def test_a_probe_ends_as_expected(name, tmp_path):
  (probe,) = [p for p in probes.PROBES if p.name == name]
  result = probes.run_probe(probe, tmp_path)
  assert result.ok, (result.outcome, result.error_line, result.command)
