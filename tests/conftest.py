"""Test session setup: each xdist worker on a core of its own, four fake CPU devices and JAX's
persistent compilation cache.

Four fake CPU devices, so sharded code (client training, KIP, model stratification) is exercised
on any machine. Many tests compile the same small programs (the same model and step on digits)
in new trainer objects or new processes; the persistent cache turns those recompilations into
disk reads. Rendered reports carry a fixed date. The environment variables reach the
`experiments.main` subprocesses too.
"""

import collections
import gc
import importlib.metadata
import json
import logging
import os
import pathlib
import re
import resource
import tempfile
import time


def _pin_xdist_worker_to_one_core():
  """Pins xdist worker i to the i-th CPU it may run on, before XLA starts, where there are as
  many workers as such CPUs (`-n auto` on a machine without SMT).

  Unpinned, each worker's XLA:CPU runtime sizes its thread pool to every core it may run on, so
  the two workers' threads share both cores. The cold suite in two interleaved pairs on the
  idle 2 cores (2026-12-04): 5 min 51 s pinned / 6 min 5 s unpinned, 5 min 41 s / 5 min 52 s.
  Returns the CPU, or None where workers and CPUs do not pair one to one (no xdist, `-n 1`, more
  or fewer workers than CPUs: with SMT, `-n auto` counts physical cores, and two workers on
  sibling threads of one core would be slower). The processes a test starts share its CPU (the
  slow set passes so). `JFED_TEST_PIN_CORES=0` in the environment leaves the workers unpinned."""
  worker = os.environ.get('PYTEST_XDIST_WORKER', '')
  count = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '0') or 0)
  if not worker.startswith('gw') or not hasattr(os, 'sched_setaffinity'):
    return None
  cpus = sorted(os.sched_getaffinity(0))
  if count != len(cpus):
    return None
  core = cpus[int(worker[2:]) % len(cpus)]
  os.sched_setaffinity(0, {core})
  return core


PINNED_CORE = (
  _pin_xdist_worker_to_one_core() if os.environ.get('JFED_TEST_PIN_CORES', '1') != '0' else None
)

# XLA's backend optimisation level 1 (default 2): measured on the suite's compile-heavy modules
# (KIP, engine, distillation losses, stratification) 9% less CPU time, and on the one-shot
# end-to-end tests 5%; level 0 made the execution-heavy tests up to 5x slower.
# Single-threaded Eigen calls: `-n auto` already runs one test process per core, and two
# processes of two Eigen threads each on 2 cores took 6 min 33 s for the cold suite against
# 6 min 11 s single-threaded (2026-11-28). On jaxlib 0.10, also XLA:CPU's older
# (non-fusion-emitter) code generator: it halved the compile time of tests/test_kip.py (34 s to
# 16 s), ran the execution-heavy one-shot tests 6% faster, and took the cold suite from 8 min 4 s
# to 6 min 33 s; jaxlib 0.11 no longer registers that flag (an unknown flag aborts XLA).
_XLA_FLAGS = (
  '--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=1'
  ' --xla_cpu_multi_thread_eigen=false'
)
if importlib.metadata.version('jaxlib').startswith('0.10.'):
  _XLA_FLAGS += ' --xla_cpu_use_fusion_emitters=false'
os.environ.setdefault('XLA_FLAGS', _XLA_FLAGS)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('MPLBACKEND', 'Agg')
# Reports are stamped with this date (2026-01-01), not today's: a test that renders a table, then
# resumes and renders it again must not fail for the clock passing midnight between the two.
os.environ.setdefault('SOURCE_DATE_EPOCH', '1767225600')
_CACHE = os.environ.setdefault(
  'JAX_COMPILATION_CACHE_DIR', str(pathlib.Path(tempfile.gettempdir()) / 'jfed-test-jax-cache')
)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


@pytest.fixture(autouse=True, scope='module')
def _free_compiled_programs():
  """Drops each module's compiled programs: kept for the whole session they reached 5.6 GB of
  resident memory; the persistent cache still serves later modules that compile the same."""
  yield
  jax.clear_caches()
  gc.collect()


def pytest_collection_modifyitems(config, items):
  """Runs the tests marked `slow` first, so that with `-n auto` the longest ones start at once
  instead of ending the session alone on one core."""
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)


def pytest_addoption(parser):
  parser.addoption(
    '--compile-profile',
    default=None,
    help='Append one JSON line per test to this file: wall and process CPU seconds, and the '
    "seconds and number of XLA compilations (JAX's backend_compile_duration events) it caused, "
    'the seconds it spent tracing and lowering programs, '
    'the compile seconds of its 20 costliest program names, and the peak resident memory of '
    'its process so far. Where the cold suite spends its '
    'time: run it with an empty JAX_COMPILATION_CACHE_DIR (the per-program log makes the run '
    'about a quarter slower).',
  )


_COMPILES = {'seconds': 0.0, 'count': 0, 'trace': 0.0, 'lower': 0.0}
# JAX's duration events of the two stages before XLA's: tracing to a jaxpr and lowering to MLIR.
_STAGE_EVENTS = {
  '/jax/core/compile/jaxpr_trace_duration': 'trace',
  '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
}


def _count_compile(event: str, duration: float, **_) -> None:
  if event == '/jax/core/compile/backend_compile_duration':
    _COMPILES['seconds'] += duration
    _COMPILES['count'] += 1
  elif event in _STAGE_EVENTS:
    _COMPILES[_STAGE_EVENTS[event]] += duration


class _CompiledPrograms(logging.Handler):
  """Seconds of XLA compilation per program name, from JAX's own debug line for each."""

  PATTERN = re.compile(r'Finished XLA compilation of (.+) in ([0-9.e-]+) sec')

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.seconds = collections.Counter()

  def emit(self, record):
    match = self.PATTERN.match(record.getMessage())
    if match:
      self.seconds[match.group(1)] += float(match.group(2))


_PROGRAMS = _CompiledPrograms()


def pytest_configure(config):
  if config.getoption('--compile-profile'):
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    dispatch_log = logging.getLogger('jax._src.dispatch')
    dispatch_log.setLevel(logging.DEBUG)
    dispatch_log.addHandler(_PROGRAMS)
    dispatch_log.propagate = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  path = item.config.getoption('--compile-profile')
  if not path:
    yield
    return
  before = dict(_COMPILES)
  _PROGRAMS.seconds.clear()
  wall, cpu = time.perf_counter(), time.process_time()
  yield
  record = {
    'test': item.nodeid,
    'wall': time.perf_counter() - wall,
    'cpu': time.process_time() - cpu,
    'compile': _COMPILES['seconds'] - before['seconds'],
    'compiles': _COMPILES['count'] - before['count'],
    'trace': round(_COMPILES['trace'] - before['trace'], 3),
    'lower': round(_COMPILES['lower'] - before['lower'], 3),
    'programs': {name: round(t, 3) for name, t in _PROGRAMS.seconds.most_common(20)},
    # the process's peak so far (Linux: KiB), and which xdist worker: where a peak is reached
    'max_rss_mb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    'worker': os.environ.get('PYTEST_XDIST_WORKER', 'main'),
  }
  with open(path, 'a') as f:  # one short line per write: xdist workers may share the file
    f.write(json.dumps(record) + '\n')
