"""The zoo's convolution forms (`conv_impl`, jfed.models.layers.conv) train alike."""

import jax
import numpy as np
import optax
import pytest

from jfed.data.federated import federate
from jfed.engine.state import init_models, init_train_state
from jfed.engine.training import GroupTrainer
from jfed.models import get_model
from jfed.models.resnet import ResNet

# Tiny widths keep each compile short; every conv kind of the four models is present
# (5x5 with bias, 3x3 with bias, 3x3 and strided / 1x1 shortcut convs without bias before BN).
CASES = {
  'cnn_mnist': dict(channels=(4, 8)),
  'vgg9': dict(width_mult=0.0625, fc_width=16),
  'resnet18': dict(width_mult=0.0625),
}
# The fast set trains the CNN and a two-stage ResNet: the ResNet-18 blocks (a stride-1 block, then
# a strided block with its 1x1 shortcut) at a third of ResNet-18's compile time; VGG-9's 3x3
# convolutions with bias are the CNN's path at another kernel size. The whole VGG-9 and
# ResNet-18 train in the slow set; test_the_zoo_models_take_the_form_asked_for checks in the
# fast set, by tracing alone, that they wire `conv_impl` through to every stride-1 convolution.
FAST = ('cnn_mnist', 'resnet_2_stages')
SLOW = ('vgg9', 'resnet18')
SHAPE = (8, 8, 1)


def _model(name: str, impl: str):
  if name == 'resnet_2_stages':
    return ResNet(3, stage_sizes=(1, 1), widths=(4, 8), conv_impl=impl)
  return get_model(name, 3, SHAPE, conv_impl=impl, **CASES[name])


def _one_step(name: str, impl: str):
  module = _model(name, impl)
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


@pytest.mark.parametrize('name', [*FAST, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW)])
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


def _traced_forward(module) -> str:
  """The forward pass's jaxpr: traced on abstract variables, nothing compiled or run."""
  x = np.zeros((2, *SHAPE), np.float32)
  variables = jax.eval_shape(module.init, jax.random.key(0), x)
  return str(jax.make_jaxpr(lambda v, x: module.apply(v, x))(variables, x))


def test_the_default_form_is_xla_convolution():
  module = get_model('cnn_mnist', 3, SHAPE)
  assert module.conv_impl == 'lax'
  assert 'conv_general_dilated' in _traced_forward(module)


# XLA convolutions in each model's forward pass: every convolution in the 'lax' form; in the
# 'matmul' form only the ones that form leaves to XLA (ResNet-18's 3 strided convolutions and
# their 3 1x1 shortcuts).
CONVS = {'cnn_mnist': (2, 0), 'vgg9': (4, 0), 'resnet18': (20, 6)}


@pytest.mark.parametrize('name', sorted(CONVS))
def test_the_zoo_models_take_the_form_asked_for(name):
  counts = tuple(
    _traced_forward(get_model(name, 3, SHAPE, conv_impl=impl, **CASES[name])).count(
      'conv_general_dilated'
    )
    for impl in ('lax', 'matmul')
  )
  assert counts == CONVS[name]


@pytest.mark.parametrize('name', sorted(CASES))
def test_an_unknown_conv_impl_is_refused(name):
  with pytest.raises(ValueError, match='conv_impl'):
    get_model(name, 3, SHAPE, conv_impl='winograd', **CASES[name])
