"""The scoring protocol (`jfed.data.public`, `dataset.holdout_size`): the test split is for
scoring only and always scored whole; public and distillation data come from training samples
held out of every client, or from another dataset."""

import numpy as np
import pytest

from jfed import driver
from jfed.configs import digits as digits_config
from jfed.data import load_dataset
from jfed.data.public import check_holdout_fits, hold_out_train, public_data
from jfed.errors import ConfigError
from jfed.run_config import validate_run_config
from tests.support import override


@pytest.fixture(scope='module')
def digits():
  return load_dataset('digits')


def tiny_config(**overrides):
  config = digits_config.get_config()
  config.model = 'mlp'
  config.dataset.holdout_size = 0
  return override(config, **overrides)


def test_the_holdout_is_a_seeded_draw_of_the_training_split_and_leaves_the_test_split(digits):
  seed, size = 3, 100
  held = hold_out_train(digits, size, seed)
  # independently: the seeded draw the docstring documents
  idx = np.sort(np.random.default_rng(seed).choice(len(digits.train_y), size, replace=False))
  keep = np.setdiff1d(np.arange(len(digits.train_y)), idx)
  np.testing.assert_array_equal(held.holdout_x, digits.train_x[idx])
  np.testing.assert_array_equal(held.train_y, digits.train_y[keep])
  np.testing.assert_array_equal(held.test_x, digits.test_x)
  np.testing.assert_array_equal(held.test_y, digits.test_y)


def test_a_public_set_comes_from_the_holdout_and_the_whole_test_split_is_scored(digits):
  held = hold_out_train(digits, 100, 0)
  public = public_data(held, 'holdout', 40, 0)
  assert len(public.x) == 40 and len(public.eval_y) == len(digits.test_y)
  held_rows = {row.tobytes() for row in held.holdout_x}
  assert all(row.tobytes() in held_rows for row in public.x)
  test_rows = {row.tobytes() for row in digits.test_x}
  assert not any(row.tobytes() in test_rows for row in public.x)
  whole = public_data(held, 'holdout', 100, 0)  # all of them, in order
  np.testing.assert_array_equal(whole.x, held.holdout_x)
  # another dataset's training split: scoring stays on the whole test split
  assert len(public_data(held, 'digits', 40, 0).eval_y) == len(digits.test_y)


@pytest.mark.parametrize(
  'size, public_size, message',
  [(0, 1, 'holdout_size=0'), (800, 1, 'holdout_size=800'), (100, 101, 'public_size=101')],
)
def test_bad_holdouts_fail_with_the_key_to_change(digits, size, public_size, message):
  with pytest.raises(ConfigError, match=message):
    held = hold_out_train(digits, size, 0)  # digits' training split holds 1437: at most 718
    public_data(held, 'holdout', public_size, 0)


def test_a_method_checks_its_holdout_before_anything_runs():
  config = tiny_config()
  config.dataset.holdout_size = 10
  with pytest.raises(ConfigError, match='dataset.holdout_size=60'):
    check_holdout_fits(config, 'holdout', 60, 'hfldd.public')
  with pytest.raises(ConfigError, match="hfldd.public is 'test_split'"):
    check_holdout_fits(config, 'test_split', 60, 'hfldd.public')
  check_holdout_fits(config, 'digits', 60, 'hfldd.public')  # another dataset needs no holdout


def test_the_old_test_holdout_and_negative_sizes_are_refused():
  config = tiny_config()
  config.dataset.holdout_size = -1
  with pytest.raises(ConfigError, match='dataset.holdout_size must be >= 0'):
    validate_run_config(config)
  config.dataset.holdout_size = 0
  config.dataset.test_holdout = 60
  with pytest.raises(ConfigError, match='dataset.test_holdout is gone'):
    validate_run_config(config)


def test_the_context_holds_out_before_partitioning_and_refuses_a_dataset_that_did_not(digits):
  config = tiny_config()
  config.dataset.holdout_size = 50
  ctx = driver.context_of_config(config, digits)
  assert len(ctx.dataset.train_y) == len(digits.train_y) - 50
  assert len(ctx.dataset.holdout_y) == 50 and len(ctx.dataset.test_y) == len(digits.test_y)
  assert max(int(p.max()) for p in ctx.parts) < len(ctx.dataset.train_y)
  with pytest.raises(ConfigError, match='holds nothing out'):
    driver.make_context(config, digits, driver.partition_clients(config, digits.train_y))


def test_a_baseline_reports_the_whole_test_split(digits):
  config = tiny_config(**{'fedavg.rounds': 1, 'fedavg.local_epochs': 1})
  config.dataset.holdout_size = 60
  summary = driver.run_in_memory('fedavg', config, digits)
  assert summary['eval_samples'] == len(digits.test_y) == 360
