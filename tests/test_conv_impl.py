"""The zoo's convolution forms (`conv_impl`, jfed.models.layers.conv) train alike."""

import jax
import numpy as np
import optax
import pytest

from jfed.data.federated import federate
from jfed.engine.state import init_models, init_train_state
from jfed.engine.training import GroupTrainer
from jfed.models import get_model

# Tiny widths keep each compile short; every conv kind of the four models is present
# (5x5 with bias, 3x3 with bias, 3x3 and strided / 1x1 shortcut convs without bias before BN).
CASES = {
  'cnn_mnist': dict(channels=(4, 8)),
  'vgg9': dict(width_mult=0.0625, fc_width=16),
  'resnet18': dict(width_mult=0.0625),
}
SHAPE = (8, 8, 1)


def _one_step(name: str, impl: str):
  module = get_model(name, 3, SHAPE, conv_impl=impl, **CASES[name])
  tx = optax.sgd(0.05, momentum=0.9)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, *SHAPE), dtype=np.float32)
  y = rng.integers(0, 3, 8).astype(np.int32)
  fed = federate(x, y, [np.arange(8)])
  state = init_train_state(tx, init_models(module, SHAPE, jax.random.key(0), 1))
  out, metrics = GroupTrainer(module, tx, 8, strategy='loop').train(
    state, fed, 1, jax.random.key(1)
  )
  return out, metrics


@pytest.mark.parametrize('name', sorted(CASES))
def test_one_training_step_is_the_same_in_the_matmul_form(name):
  ref, ref_metrics = _one_step(name, 'lax')
  got, metrics = _one_step(name, 'matmul')
  assert jax.tree.structure(ref) == jax.tree.structure(got)
  np.testing.assert_allclose(metrics.loss, ref_metrics.loss, rtol=1e-5, atol=1e-6)
  # One SGD step of lr 0.05 moves a weight by ~1e-2; a wrong form (a flipped or transposed
  # kernel, a shifted tap) differs by that much, float32 reassociation (through BatchNorm) by
  # ~1e-5.
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=2e-4)


def test_the_default_form_is_xla_convolution():
  module = get_model('cnn_mnist', 3, SHAPE)
  assert module.conv_impl == 'lax'
  jaxpr = jax.make_jaxpr(lambda v, x: module.apply(v, x))(
    module.init(jax.random.key(0), np.zeros((1, *SHAPE), np.float32)),
    np.zeros((2, *SHAPE), np.float32),
  )
  assert 'conv_general_dilated' in str(jaxpr)


@pytest.mark.parametrize('name', sorted(CASES))
def test_an_unknown_conv_impl_is_refused(name):
  with pytest.raises(ValueError, match='conv_impl'):
    get_model(name, 3, SHAPE, conv_impl='winograd', **CASES[name])
