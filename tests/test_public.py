"""The public set (`jfed.data.public`) and `dataset.test_holdout`: in a comparison every method,
baselines included, is scored on the same test samples, and a 'test_split' public set is drawn
from the held-out ones without touching them."""

import numpy as np
import pytest

from experiments.configs import hfldd_digits, hfldd_fashion_mnist
from jfed import driver
from jfed.data import load_dataset
from jfed.data.public import hold_out_test, public_data
from jfed.errors import ConfigError
from jfed.typed_config import validate_run_config


@pytest.fixture(scope='module')
def digits():
  return load_dataset('digits')


def test_held_out_public_set_is_the_one_drawn_from_the_whole_test_split(digits):
  seed, size = 3, 100
  direct = public_data(digits, 'test_split', size, seed)
  held = hold_out_test(digits, size, seed)
  via_holdout = public_data(held, 'test_split', size, seed)
  # independently: the seeded draw the public set documents
  idx = np.sort(np.random.default_rng(seed).choice(len(digits.test_y), size, replace=False))
  keep = np.setdiff1d(np.arange(len(digits.test_y)), idx)
  for got in (direct, via_holdout):
    np.testing.assert_array_equal(got.x, digits.test_x[idx])
    np.testing.assert_array_equal(got.eval_y, digits.test_y[keep])
  np.testing.assert_array_equal(held.test_x, digits.test_x[keep])
  assert len(held.test_y) + len(held.holdout_y) == len(digits.test_y)


def test_a_smaller_public_set_comes_from_the_holdout_and_never_from_the_evaluated_samples(digits):
  held = hold_out_test(digits, 100, 0)
  public = public_data(held, 'test_split', 40, 0)
  assert len(public.x) == 40 and len(public.eval_y) == len(digits.test_y) - 100
  held_rows = {row.tobytes() for row in held.holdout_x}
  assert all(row.tobytes() in held_rows for row in public.x)
  # an out-of-distribution public set leaves evaluation on the held-out-reduced split too
  assert len(public_data(held, 'digits', 40, 0).eval_y) == len(digits.test_y) - 100


@pytest.mark.parametrize(
  'size, message', [(0, 'test_holdout=0'), (200, 'test_holdout=200'), (100, 'public_size=101')]
)
def test_bad_holdouts_fail_with_the_key_to_change(digits, size, message):
  with pytest.raises(ConfigError, match=message):
    held = hold_out_test(digits, size, 0)  # digits' test split holds 360: at most 180
    public_data(held, 'test_split', size + 1, 0)


def test_every_method_of_the_hfldd_comparison_evaluates_on_the_same_samples(digits):
  config = hfldd_digits.get_config('smoke')
  config.hfldd.public_size = 60  # a --config override moves the holdout and FedSeq's set with it
  assert config.dataset.test_holdout == config.fedseq.public_size == 60
  validate_run_config(config)
  parts = driver.partition_clients(config, digits.train_y)
  ctx = driver.make_context(config, digits, parts)
  assert len(ctx.dataset.test_y) == len(digits.test_y) - 60  # what FedAvg and DynaFed score on
  public = public_data(ctx.dataset, config.hfldd.public, config.hfldd.public_size, config.seed)
  np.testing.assert_array_equal(public.eval_y, ctx.dataset.test_y)  # what HFLDD scores on
  # an out-of-distribution public set holds nothing out
  assert hfldd_digits.get_config('fmpublic').dataset.test_holdout == 0
  assert hfldd_fashion_mnist.get_config('c1').dataset.test_holdout == 0
  assert hfldd_fashion_mnist.get_config('c1,indist').dataset.test_holdout == 1000


def test_a_negative_holdout_is_refused_by_the_config_check():
  config = hfldd_digits.get_config('smoke')
  config.dataset.test_holdout = -1
  with pytest.raises(ConfigError, match='dataset.test_holdout must be >= 0'):
    validate_run_config(config)


def test_a_baseline_reports_the_samples_it_was_scored_on(digits):
  from tests.support import hfldd_tiny_config  # pylint: disable=g-import-not-at-top

  config = hfldd_tiny_config(**{'fedavg.rounds': 1, 'fedavg.local_epochs': 1})
  summary = driver.run_in_memory('fedavg', config, digits)
  assert summary['eval_samples'] == len(digits.test_y) - 60 == 300
