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


def test_each_worker_is_pinned_to_the_cpu_of_its_number(monkeypatch):
  assert [_pins(monkeypatch, f'gw{i}', '3') for i in range(3)] == [(0, {0}), (0, {2}), (0, {5})]
  # In the CPUs' order, not the set's ({9, 1} iterates as 9, 1).
  assert _pins(monkeypatch, 'gw1', '2', cpus=(9, 1)) == (0, {9})


@pytest.mark.parametrize(
  'worker,count',
  [
    (None, None),  # no xdist: the one process keeps every core
    (None, '3'),  # a worker count but no worker id: not an xdist worker
    ('gw0', '1'),  # -n 1: its one worker keeps every core
    ('gw0', '4'),  # more workers than the 3 CPUs it may run on: pinning would stack them
    ('gw0', '2'),  # fewer (with SMT, `-n auto` counts cores): which CPUs are siblings is unknown
  ],
)
def test_without_a_core_per_worker_nothing_is_pinned(monkeypatch, worker, count):
  assert _pins(monkeypatch, worker, count) is None


def test_this_worker_runs_on_the_one_core_it_was_pinned_to():
  """The live check: in the suite's own `-n auto` run with a worker per CPU, this process may
  run on one CPU only."""
  if conftest.PINNED_CORE is None:
    pytest.skip('not pinned here: no xdist, one worker, workers and CPUs not one to one, or off')
  assert os.sched_getaffinity(0) == {conftest.PINNED_CORE}
