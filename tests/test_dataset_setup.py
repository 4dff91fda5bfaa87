"""`dataset.image_size` and `dataset.normalization`: the authors' resize and `Normalize` of
Co-Boosting's and FedCVAE's loaders, as run options (issue 80)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver
from jfed.api import context_of_config, load_run_dataset
from jfed.configs import base as configs
from jfed.data import load_dataset
from jfed.data.transforms import configure
from jfed.errors import ConfigError
from jfed.methods import common
from jfed.models import get_model
from jfed.run_config import validate_run_config
from tests.support import override


def _bilinear_half_pixel(x: np.ndarray, size: int) -> np.ndarray:
  """Upsampling NHWC images by hand: torchvision's bilinear `Resize` (align_corners=False; the
  source coordinate (i + 0.5) · in / out − 0.5, clamped at 0; no antialiasing when enlarging)."""
  n, h, w, c = x.shape

  def taps(n_in):
    src = np.maximum((np.arange(size) + 0.5) * n_in / size - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(int), n_in - 1)
    hi = np.minimum(lo + 1, n_in - 1)
    return lo, hi, src - lo

  rl, rh, rf = taps(h)
  cl, ch, cf = taps(w)
  rows = x[:, rl] * (1 - rf)[None, :, None, None] + x[:, rh] * rf[None, :, None, None]
  return rows[:, :, cl] * (1 - cf)[None, None, :, None] + rows[:, :, ch] * cf[None, None, :, None]


def _digits(**keys):
  c = configs.base_config()
  c.dataset.name = 'digits'
  c.partition.num_clients = 3
  c.fedavg.rounds = 1
  c.fedavg.local_epochs = 1
  return override(c, **keys)


def test_image_size_resizes_every_split_as_torchvision_does():
  digits = load_dataset('digits')
  out = configure(digits, 12)
  assert out.input_shape == (12, 12, 1) and out.test_x.shape == (len(digits.test_y), 12, 12, 1)
  np.testing.assert_allclose(out.train_x, _bilinear_half_pixel(digits.train_x, 12), atol=1e-5)
  np.testing.assert_allclose(out.test_x, _bilinear_half_pixel(digits.test_x, 12), atol=1e-5)
  assert out.train_y is digits.train_y and not out.train_x.flags.writeable
  assert out.train_x.min() >= 0.0 and out.train_x.max() <= 1.0
  assert configure(digits).train_x is digits.train_x  # 0: the files' size, nothing copied


def test_the_run_sees_the_configured_dataset_and_its_held_out_split():
  config = _digits(**{'dataset.image_size': 16, 'dataset.holdout_size': 50})
  loaded = load_run_dataset(config)
  assert loaded.input_shape == (16, 16, 1) and load_run_dataset(config) is loaded  # cached
  ctx = context_of_config(config, load_dataset('digits'))  # a dataset given: configured too
  assert ctx.dataset.input_shape == (16, 16, 1) and ctx.dataset.holdout_x.shape[1:] == (16, 16, 1)


def test_half_normalization_feeds_the_model_x_minus_half_over_half_with_the_same_variables():
  digits = configure(load_dataset('digits'), 0, 'half')
  plain = get_model('cnn_mnist', 10, digits.input_shape)
  wrapped = common.build_module('cnn_mnist', digits)
  x = jnp.asarray(digits.test_x[:8])
  variables = plain.init(jax.random.PRNGKey(0), x)
  assert jax.tree.structure(wrapped.init(jax.random.PRNGKey(0), x)) == jax.tree.structure(variables)
  np.testing.assert_allclose(
    wrapped.apply(variables, x), plain.apply(variables, (x - 0.5) / 0.5), atol=1e-6
  )
  assert not np.allclose(wrapped.apply(variables, x), plain.apply(variables, x), atol=1e-3)
  assert wrapped.num_classes == 10
  assert common.build_module('cnn_mnist', load_dataset('digits')) == plain  # 'none': unwrapped


def test_fedavg_runs_at_a_resized_normalised_set_up():
  summary = driver.run_in_memory(
    'fedavg', _digits(**{'dataset.image_size': 16, 'dataset.normalization': 'half'})
  )
  assert summary.final_test_accuracy > 0.3


@pytest.mark.parametrize(
  'keys, message',
  [
    ({'dataset.image_size': -1}, 'dataset.image_size must be >= 0'),
    (
      {'dataset.normalization': 'imagenet'},
      "dataset.normalization is 'imagenet'; valid: none, half",
    ),
  ],
)
def test_a_bad_setting_is_one_config_error(keys, message):
  with pytest.raises(ConfigError, match=message):
    validate_run_config(_digits(**keys))
