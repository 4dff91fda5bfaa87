"""Long phases log INFO progress (issue 37): DDPM training, a KIP solve and model stratification
each log a line as they start, then lines counted in steps (not epochs or chunks) at most every
few seconds, and one at the end. A fake clock that advances 6 s per reading makes every step
due, so the tests see the step granularity without waiting."""

import logging
import re
import time

import jax
import numpy as np
import pytest

from jfed.diffusion import train as ddpm_train
from jfed.distill import stratification as S
from jfed.engine import progress
from jfed.kip import KIPConfig, kip
from tests.support import DDPM_IMAGES, DDPM_TINY
from tests.test_stratification import CFG, GEN, KEY, MLP, stacked


@pytest.fixture
def info(caplog):
  caplog.set_level(logging.INFO, logger='absl')
  return caplog


@pytest.fixture
def fast_clock(monkeypatch):
  """time.monotonic for the progress lines, 6 s later at every reading."""
  now = [time.monotonic()]

  def monotonic():
    now[0] += 6.0
    return now[0]

  monkeypatch.setattr(progress.time, 'monotonic', monotonic)


def _lines(caplog, prefix):
  return [(r.created, r.getMessage()) for r in caplog.records if r.getMessage().startswith(prefix)]


def _counts(lines, total, unit):
  pattern = re.compile(rf': (\d+)/{total} {unit}s \(')
  return [int(m.group(1)) for _, message in lines for m in [pattern.search(message)] if m]


def test_ddpm_training_logs_its_start_and_then_steps(info, fast_clock):
  # tests/test_ddpm.py's network and data shapes: its compiled training step, not another one
  images = np.random.default_rng(0).random((DDPM_IMAGES, 8, 8, 1)).astype(np.float32)
  labels = np.arange(DDPM_IMAGES, dtype=np.int32) % 2
  cfg = ddpm_train.DDPMConfig(**{**DDPM_TINY, 'steps': 5})
  t0 = time.time()
  ddpm_train.train_ddpm(images, labels, 2, cfg, jax.random.key(0), strategy='loop')
  lines = _lines(info, f'DDPM training on {DDPM_IMAGES} images')
  assert lines[0][1] == f'DDPM training on {DDPM_IMAGES} images: 5 steps'
  assert lines[0][0] - t0 < 1.0  # before anything compiles
  counts = _counts(lines[1:], 5, 'step')
  assert counts == [1, 2, 3, 4, 5], lines  # every step of the one chunk, not once per chunk
  assert 'loss ' in lines[-1][1]


def test_a_kip_solve_logs_its_start_and_then_iterations(info, fast_clock):
  rng = np.random.default_rng(0)
  x = rng.random((3, 12, 4, 4, 1)).astype(np.float32)
  y = rng.integers(0, 3, (3, 12)).astype(np.int32)
  cfg = KIPConfig(support_size=4, iterations=6, target_batch=4)
  t0 = time.time()
  kip.kip_distill_batched(x, y, np.full(3, 12), cfg, jax.random.PRNGKey(0), 3)
  lines = _lines(info, 'KIP solve of 3 clients')
  assert lines[0][1] == 'KIP solve of 3 clients: 6 iterations'
  assert lines[0][0] - t0 < 1.0
  counts = _counts(lines[1:], 6, 'iteration')
  assert counts[-1] == 6 and len(counts) >= 3, lines  # from inside the one compiled program
  assert counts == sorted(counts)


def test_a_kip_program_has_no_host_callback_without_info_lines():
  """Without INFO it is the program it was (JAX's persistent cache stores it)."""
  cfg, scalars = kip.split_scalars(KIPConfig(support_size=4, iterations=3, target_batch=4))
  args = (
    np.zeros((2, 8, 4), np.float32),
    np.zeros((2, 8), np.int32),
    np.full(2, 8, np.int32),
    np.arange(2, dtype=np.int32),
    jax.random.PRNGKey(0),
    scalars,
  )
  quiet = kip._batched_program(cfg, 3, None, False).lower(*args).as_text()
  talking = kip._batched_program(cfg, 3, None, True).lower(*args).as_text()
  assert 'callback' not in quiet and 'callback' in talking


def test_model_stratification_logs_its_start_and_then_generator_steps(info, fast_clock):
  teachers = (MLP(), stacked(MLP(), 0, 2))
  t0 = time.time()
  S.model_stratification_python(teachers, GEN, 3, KEY, CFG)
  label = 'model stratification: 6 generator runs of T_G=4'
  lines = _lines(info, label)
  assert lines[0][1] == f'{label}: 24 generator steps'
  assert lines[0][0] - t0 < 1.0
  counts = _counts(lines[1:], 24, 'generator step')
  assert counts == list(range(1, 25)), lines  # every step, not once per run


def test_progress_lines_are_at_most_every_few_seconds(info):
  phase = progress.PhaseProgress('phase', 1000)
  for done in range(1, 1001):
    phase.update(done)
  messages = [r.getMessage() for r in info.records]
  assert messages == ['phase: 1000 steps', messages[-1]] and '1000/1000' in messages[-1]


def test_fedtsa_profiling_logs_its_start_and_then_clients(info, fast_clock):
  from jfed.profiling import proxy  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  task = proxy.ProxyTask(rng.random((64, 4, 4)), rng.integers(0, 3, 64), 3, hidden=4)
  proxy.measured_durations(task, 3, proxy.profile_from_rates([1.0], [1.0]), 0, repeats=1)
  lines = _lines(info, 'profiling: the proxy task 1x per client')
  assert lines[0][1] == 'profiling: the proxy task 1x per client: 3 clients'
  assert _counts(lines[1:], 3, 'client') == [1, 2, 3], lines
