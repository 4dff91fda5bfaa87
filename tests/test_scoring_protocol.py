"""The scoring protocol, for every registered method: the test split is used for scoring only,
and scored whole.

Each method runs twice on its smallest config (tests/support.py's `smoke_config`): once on the
real test split, once on a test split whose images are noise and whose labels are shuffled.
Whatever a method trains, distils, validates, clusters or generates from must then be the same,
so its final state must be identical; only its reported accuracies may differ. A method that
picked a student by test accuracy, trained a generator on test images or used test images as a
public set would fail here.
"""

import jax
import numpy as np
import pytest

from jfed import driver
from jfed.data import load_dataset
from jfed.methods import available_methods
from tests.support import smoke_config


def final_state_and_summary(method, config, dataset):
  """The algorithm's state after its last step (no workdir) and what it summarises."""
  algorithm = driver.build_algorithm(method, config)
  ctx = driver.context_of_config(config, dataset)
  aux = algorithm.setup(ctx)
  state, history = algorithm.init(ctx, aux), []
  for i in range(algorithm.num_steps(ctx)):
    state, records = algorithm.step(ctx, aux, state, i)
    history += [{'step': i + 1, **r} for r in records]
  return state, dict(algorithm.summarize(ctx, aux, state, history)), history


def with_scrambled_test_split(dataset):
  rng = np.random.default_rng(12345)
  return dataset._replace(
    test_x=rng.uniform(size=dataset.test_x.shape).astype(dataset.test_x.dtype),
    test_y=rng.permutation(dataset.test_y),
  )


@pytest.mark.slow
@pytest.mark.parametrize('method', available_methods())
def test_the_test_split_changes_nothing_but_the_scores(method):
  config = smoke_config(method)
  dataset = load_dataset(config.dataset.name, config.dataset.get('data_dir') or None)
  state, summary, history = final_state_and_summary(method, config, dataset)
  scrambled, _, _ = final_state_and_summary(method, config, with_scrambled_test_split(dataset))
  leaves, other = jax.tree.leaves(state), jax.tree.leaves(scrambled)
  assert len(leaves) == len(other)
  for a, b in zip(leaves, other):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # scored on the whole test split
  assert summary.get('eval_samples', len(dataset.test_y)) == len(dataset.test_y)
  assert any(r.get('test_accuracy') is not None for r in history)
