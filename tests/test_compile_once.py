"""Compile once: the rounds after the first of a multi-round method compile no XLA program.

A shape, a closure or a Python scalar that changes per round, or a jitted function built anew
every round, silently recompiles every round. These tests run each multi-round method family
through the driver on tiny configs and count the XLA compilations (`jfed.engine.compiles`) of
every driver step: from the step's start to the next step's start, so the driver's own checks
after a step count towards it. The first step may compile; the later ones must not, except the
steps a method documents as one-off (DynaFed's distillation round).

The counts do not depend on the tests that ran before in the process: every case starts from
empty in-memory caches (`jax.clear_caches`), and the persistent compilation cache of
tests/conftest.py only makes those first compilations cheap (a persistent-cache hit still
counts as a compilation). The first two tests show that the counter and the per-step harness do
see recompilations (they fail if JAX stops reporting its compile event).
"""

from typing import Dict, List, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import pytest

from experiments.configs import digits, fedhydra_digits
from jfed import driver, engine
from jfed.data import load_dataset
from jfed.distill import MSConfig, TeacherGroup, make_generator, model_stratification_python
from jfed.distill.synthesis import SynthesisConfig, synthesize
from jfed.engine import compiles
from jfed.models import get_model
from tests.support import hfldd_tiny_config


class StepCompiles(NamedTuple):
  setup: List[str]  # setup and init
  steps: List[List[str]]  # per driver step


def compiles_per_step(algorithm: driver.Algorithm, ctx: driver.RunContext) -> StepCompiles:
  """Runs `algorithm` through the driver and names what each step compiled."""
  starts: List[int] = []
  step, summarize = algorithm.step, algorithm.summarize

  def counted_step(ctx, aux, state, i):
    assert i == len(starts)
    starts.append(len(compiled))
    return step(ctx, aux, state, i)

  def counted_summarize(*args):
    starts.append(len(compiled))
    return summarize(*args)

  # Instance attributes shadow the methods for this run only.
  algorithm.step, algorithm.summarize = counted_step, counted_summarize
  with compiles.count_compilations() as compiled:
    driver.run(algorithm, ctx, progress=False)
  return StepCompiles(
    compiled.names[: starts[0]], [compiled.names[a:b] for a, b in zip(starts, starts[1:])]
  )


def run_method(method: str, config, dataset) -> StepCompiles:
  jax.clear_caches()
  algorithm = driver.build_algorithm(method, config)
  ctx = driver.make_context(config, dataset, driver.partition_clients(config, dataset.train_y))
  return compiles_per_step(algorithm, ctx)


def recompiling_steps(counts: StepCompiles, one_off: Sequence[int] = ()) -> Dict[int, List[str]]:
  """{step: names} of the steps after the first (and not one-off) that compiled something."""
  return {i: names for i, names in enumerate(counts.steps) if i > 0 and i not in one_off and names}


@pytest.fixture(scope='module')
def dataset():
  return load_dataset('digits')


# ------------------------------------------------------------------------------------------------
# the counter and the harness catch recompilation
# ------------------------------------------------------------------------------------------------
def test_the_counter_sees_every_compilation_and_no_cache_hit():
  x, longer = jnp.ones(3), [jnp.ones(4), jnp.ones(5)]

  @jax.jit
  def total(v):  # defined here, so that no earlier test compiled it
    return jnp.sum(v)

  with compiles.count_compilations() as outer:
    for scale in (1.0, 2.0, 3.0):  # a Python float closed over: a new program every time
      with compiles.count_compilations() as inner:
        jax.jit(lambda v, s=scale: v * s)(x).block_until_ready()
      assert len(inner) == 1, inner.summary()
    for v in longer:  # a shape that changes
      total(v).block_until_ready()
  assert outer.counts() == {'jit(<lambda>)': 3, 'jit(total)': 2}, outer.summary()

  f = jax.jit(lambda v: v + 1)

  def round_of_work():
    f(x * 2).block_until_ready()

  with compiles.count_compilations() as first:
    round_of_work()
  with compiles.count_compilations() as again:
    round_of_work()  # the same jitted function and eager op on the same shapes: cache hits
  assert first.counts()['jit(<lambda>)'] == 1, first.summary()
  assert not again.names, again.summary()


class _Config(NamedTuple):
  rounds: int


class _RecompilesFromRound(driver.Algorithm):
  """Steps from `bad_from` on close a Python float of the round over a new jitted function:
  the mistake the family tests exist to catch."""

  name, section, Config, step_name = 'recompiles', 'recompiles', _Config, 'round'
  bad_from = 2

  def num_steps(self, ctx):
    return self.config.rounds

  def init(self, ctx, aux):
    return jnp.zeros(4)

  def step(self, ctx, aux, state, i):
    if i >= self.bad_from:
      scale = float(i)
      state = jax.jit(lambda s: s + scale)(state)
    else:
      state = _add_one(state)
    return state, [{'round': i + 1, 'test_accuracy': float(state[0])}]


@jax.jit
def _add_one(s):
  return s + 1.0


def test_the_harness_attributes_a_per_round_recompilation_to_its_rounds(dataset):
  config = digits.get_config('smoke')
  ctx = driver.make_context(config, dataset, driver.partition_clients(config, dataset.train_y))
  counts = compiles_per_step(_RecompilesFromRound(_Config(rounds=4)), ctx)
  assert len(counts.steps) == 4
  assert recompiling_steps(counts).keys() == {2, 3}, counts
  for names in counts.steps[2:]:
    assert 'jit(<lambda>)' in names, counts


# ------------------------------------------------------------------------------------------------
# the method families
# ------------------------------------------------------------------------------------------------
# Tiny budgets: what matters is the code path of every round, not what the models learn. The
# MLP traces and runs in a fraction of the CNN's time and takes the same per-round paths
# (tests/test_driver.py runs every method on the CNN).
def _fedavg(strategy='loop'):
  c = digits.get_config('smoke')
  c.model, c.strategy = 'mlp', strategy
  # Partial participation: each round selects other clients, of other sizes.
  c.fedprox.rounds, c.fedprox.participation = 3, 0.6
  return c


def _hfldd():
  c = hfldd_tiny_config()
  c.hfldd.pretrain_epochs, c.hfldd.rounds, c.hfldd.local_epochs = 1, 3, 1
  c.fedseq.pretrain_epochs, c.fedseq.rounds, c.fedseq.local_epochs = 1, 3, 1
  d = c.dynafed
  # Rounds 1-2 record the trajectory, round 3 distils the synthetic set (once) and starts the
  # fine-tuning, round 4 is a round with fine-tuning.
  d.rounds, d.trajectory_rounds, d.local_epochs, d.participation = 4, 2, 1, 0.5
  d.finetune_epochs = 1
  return c


def _fedhydra():
  c = fedhydra_digits.get_config('smoke')
  c.model, c.partition.num_clients = 'mlp', 3
  # Two global rounds of two distillation epochs: step 1 is an epoch, step 2 a new round (local
  # training from the global model, new teachers, model stratification), step 3 an epoch.
  c.fedhydra.rounds, c.fedhydra.epochs, c.fedhydra.local_epochs, c.fedhydra.ms_T_G = 2, 2, 1, 1
  return c


# (method, config, the steps after the first that may compile: one-off stages). FedAvg also runs
# with its client map pinned to `scan` (the default on accelerators), whose compiled epoch has a
# static length, so that it is checked on every backend; the other families take the backend's
# default.
FAMILIES = [
  pytest.param('fedprox', _fedavg, (), id='fedavg-fedprox'),
  pytest.param('fedprox', lambda: _fedavg('scan'), (), id='fedavg-fedprox-scan'),
  pytest.param('hfldd', _hfldd, (), id='hfldd'),
  pytest.param('fedseq', _hfldd, (), id='fedseq'),
  pytest.param('dynafed', _hfldd, (2,), id='dynafed'),
  pytest.param('fedhydra', _fedhydra, (), id='fedhydra-rounds'),
]


@pytest.mark.parametrize('method,make_config,one_off', FAMILIES)
def test_rounds_after_the_first_compile_nothing(dataset, method, make_config, one_off):
  counts = run_method(method, make_config(), dataset)
  assert len(counts.steps) >= 3
  bad = recompiling_steps(counts, one_off)
  assert not bad, {i: compiles.Compilations(names).summary() for i, names in bad.items()}
  whole_run = compiles.Compilations(counts.setup + [n for names in counts.steps for n in names])
  again = {n: k for n, k in whole_run.counts().items() if n in LOOP_STEPS and k > 1}
  assert not again, f'compiled more than once: {again}'


# On CPU these run as Python loops of one jitted step. The loop's first call gets fresh
# (uncommitted) arrays and its later calls the outputs of steps on committed inputs (client
# models, teachers), which JAX compiles as a second program unless the loop commits its start
# (`engine.commit`): twice the compilation of a method's largest programs.
LOOP_STEPS = ('jit(_synthesis_step)', 'jit(_ms_step)', 'jit(kd_step)')


def test_the_generator_and_ms_loops_compile_their_step_once():
  """Teachers committed to a device (as client models are after training) and a loop started
  from fresh arrays: the first and later steps must share one program."""
  module = get_model('mlp', 10, (8, 8, 1))
  key = jax.random.PRNGKey(0)
  teachers = engine.commit(engine.init_models(module, (8, 8, 1), key, 2, same_init=False))
  generator = make_generator((8, 8, 1), nz=8, ngf=4)
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    synthesize(
      generator,
      TeacherGroup(module, teachers),
      None,
      None,
      10,
      key,
      SynthesisConfig(g_steps=3, batch_size=4, bn=0.0, adv=0.0, loop='python'),
    )
    model_stratification_python(
      TeacherGroup(module, teachers), generator, 10, key, MSConfig(T_G=3, batch_size=4)
    )
  counts = compiled.counts()
  assert counts['jit(_synthesis_step)'] == 1 and counts['jit(_ms_step)'] == 1, compiled.summary()
