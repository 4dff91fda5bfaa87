"""The test session's own setup (tests/conftest.py): each xdist worker on a core of its own."""

import os

import pytest

from tests import conftest


def _pins(monkeypatch, worker, count, cpus=(0, 2, 5)):
  """`_pin_xdist_worker_to_one_core`'s one call of `sched_setaffinity` as (pid, cores), or None."""
  pinned = []
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(cpus))
  monkeypatch.setattr(os, 'sched_setaffinity', lambda pid, mask: pinned.append((pid, set(mask))))
  for name, value in (('PYTEST_XDIST_WORKER', worker), ('PYTEST_XDIST_WORKER_COUNT', count)):
    if value is None:
      monkeypatch.delenv(name, raising=False)
    else:
      monkeypatch.setenv(name, value)
  core = conftest._pin_xdist_worker_to_one_core()
  assert len(pinned) <= 1 and (core is None) == (not pinned)
  assert core is None or pinned[0][1] == {core}
  return pinned[0] if pinned else None


def test_each_worker_is_pinned_to_the_core_of_its_number(monkeypatch):
  assert [_pins(monkeypatch, f'gw{i}', '3') for i in range(3)] == [(0, {0}), (0, {2}), (0, {5})]
  assert _pins(monkeypatch, 'gw1', '2', cpus=(7, 3)) == (0, {7})


@pytest.mark.parametrize(
  'worker,count',
  [
    (None, None),  # no xdist: the one process keeps every core
    ('gw0', '1'),  # -n 1: its one worker keeps every core
    ('gw0', '4'),  # more workers than the 3 cores it may run on: pinning would stack them
  ],
)
def test_without_a_core_per_worker_nothing_is_pinned(monkeypatch, worker, count):
  assert _pins(monkeypatch, worker, count) is None


def test_this_worker_runs_on_the_one_core_it_was_pinned_to():
  """The live check: in the suite's own `-n auto` run on N workers for N cores or more, this
  process may run on one core only."""
  if conftest.PINNED_CORE is None:
    pytest.skip('not pinned here: no xdist, one worker, more workers than cores, or switched off')
  assert os.sched_getaffinity(0) == {conftest.PINNED_CORE}
