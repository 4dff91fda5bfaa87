"""Compile once: the rounds after the first of a multi-round method compile no XLA program.

A shape, a closure or a Python scalar that changes per round, or a jitted function built anew
every round, silently recompiles every round. tests/test_driver.py's resume test runs every
registered method through the driver on a tiny config and counts the XLA compilations
(`jfed.engine.compiles`) of every driver step; here the counter and a per-step harness are shown
to see recompilations, FedAvg's `scan` map (the accelerator default) is counted, and the
generator and MS loops are shown to compile their step once. The first step may compile; the
later ones must not, except the steps a method documents as one-off (DynaFed's distillation
round).

The counts do not depend on the tests that ran before in the process: every case starts from
empty in-memory caches (`jax.clear_caches`), and the persistent compilation cache of
tests/conftest.py only makes those first compilations cheap (a persistent-cache hit still
counts as a compilation). The first two tests show that the counter and the per-step harness do
see recompilations (they fail if JAX stops reporting its compile event).
"""

from typing import Dict, List, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver, engine
from jfed.configs import digits
from jfed.data import load_dataset
from jfed.distill import MSConfig, TeacherGroup, make_generator, model_stratification_python
from jfed.distill.synthesis import SynthesisConfig, fedhydra_config, synthesize
from jfed.engine import compiles
from jfed.models import get_model


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
  ctx = driver.context_of_config(config, dataset)
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
  ctx = driver.context_of_config(config, dataset)
  counts = compiles_per_step(_RecompilesFromRound(_Config(rounds=4)), ctx)
  assert len(counts.steps) == 4
  assert recompiling_steps(counts).keys() == {2, 3}, counts
  for names in counts.steps[2:]:
    assert 'jit(<lambda>)' in names, counts


# ------------------------------------------------------------------------------------------------
# the method families
# ------------------------------------------------------------------------------------------------
# Every registered method is counted step by step by tests/test_driver.py's resume test (the
# same clean caches and the same rule, on its run with the loop strategy of CPU). Here FedAvg
# also runs with its client map pinned to `scan` (the default on accelerators), whose compiled
# epoch has a static length, so that it is checked on every backend. Partial participation: each
# round selects other clients, of other sizes.
def test_scan_rounds_after_the_first_compile_nothing(dataset):
  c = digits.get_config('smoke')
  c.model, c.strategy = 'mlp', 'scan'
  c.fedprox.rounds, c.fedprox.participation = 3, 0.6
  counts = run_method('fedprox', c, dataset)
  assert len(counts.steps) >= 3
  bad = recompiling_steps(counts)
  assert not bad, {i: compiles.Compilations(names).summary() for i, names in bad.items()}


# On CPU the generator, MS and KD steps run as Python loops of one jitted step. The loop's first
# call gets fresh (uncommitted) arrays and its later calls the outputs of steps on committed
# inputs (client models, teachers), which JAX compiles as a second program unless the loop
# commits its start (`engine.commit`): twice the compilation of a method's largest programs.


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


def test_a_lambda_sweep_compiles_the_generator_step_once_and_equals_runs_one_at_a_time():
  """FedHydra's Table 6 (λ1, λ2 in {0, 0.5, 1}): with `every_term` the loss weights are values of
  one program, zeros included; each sweep point equals the run made alone (whose zero weights
  skip their terms)."""
  module = get_model('cnn_mnist', 10, (8, 8, 1))
  key = jax.random.PRNGKey(1)
  teachers = engine.commit(engine.init_models(module, (8, 8, 1), key, 2, same_init=False))
  student = engine.init_models(module, (8, 8, 1), jax.random.PRNGKey(2), 1)
  student = jax.tree.map(lambda a: a[0], student)
  generator = make_generator((8, 8, 1), nz=8, ngf=4)
  sweep = [(1.0, 1.0), (0.5, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0)]

  def run(lambda1, lambda2, every_term):
    cfg = fedhydra_config(
      lambda1, lambda2, g_steps=2, batch_size=4, aggregation='mean', loop='python'
    )._replace(every_term=every_term)
    return synthesize(generator, TeacherGroup(module, teachers), module, student, 10, key, cfg)

  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    swept = [run(l1, l2, True) for l1, l2 in sweep]
  assert compiled.counts()['jit(_synthesis_step)'] == 1, compiled.summary()
  for (l1, l2), got in zip(sweep, swept):
    alone = run(l1, l2, False)
    np.testing.assert_allclose(got.losses, alone.losses, rtol=1e-6)
    np.testing.assert_allclose(got.images, alone.images, rtol=1e-6, atol=1e-7)
    # the terms a zero weight skips alone are still computed in the sweep
    assert (np.asarray(got.components) != 0).all()
  # and the weights do reach the program: different λ, different generators
  assert not np.allclose(swept[0].images, swept[4].images)
