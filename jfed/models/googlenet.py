"""GoogLeNet, CIFAR variant of kuangliu/pytorch-cifar (FedHydra's client model M1).

Stem Conv3x3(192, pad 1) BN ReLU -> Inception a3, b3 -> MaxPool(3, stride 2, pad 1)
-> a4 .. e4 -> MaxPool(3, 2, 1) -> a5, b5 -> global average pooling -> Linear.
Inception branches (each conv followed by BN and ReLU; convs have biases, as in the reference):
1x1 | 1x1 -> 3x3 | 1x1 -> 3x3 -> 3x3 (kuangliu's '5x5' branch) | MaxPool(3, 1, 1) -> 1x1.
Width 1, 32x32x3, 10 classes: 6,166,250 parameters, as PyTorch.

Deviations: global average pooling replaces kuangliu's AvgPool2d(8) (identical for 32px inputs,
whose final map is 8x8; needed for 28px -> 7x7 and 8px -> 2x2 maps). `width_mult` (default 1)
scales every channel count to ceil(width_mult * c), for cheap tests and width-heterogeneous FL;
it is not in the reference.
"""

import math
from typing import Tuple

import flax.linen as nn
import jax.numpy as jnp

from jfed.models.layers import BatchNorm, conv, dense, global_avg_pool, max_pool, sow_features
from jfed.models.registry import register_model

# (n1x1, n3x3red, n3x3, n5x5red, n5x5, pool_planes) of kuangliu's a3 .. b5.
_INCEPTION_CFG = {
  'a3': (64, 96, 128, 16, 32, 32),
  'b3': (128, 128, 192, 32, 96, 64),
  'a4': (192, 96, 208, 16, 48, 64),
  'b4': (160, 112, 224, 24, 64, 64),
  'c4': (128, 128, 256, 24, 64, 64),
  'd4': (112, 144, 288, 32, 64, 64),
  'e4': (256, 160, 320, 32, 128, 128),
  'a5': (256, 160, 320, 32, 128, 128),
  'b5': (384, 192, 384, 48, 128, 128),
}


class _ConvBNReLU(nn.Module):
  features: int
  kernel_size: int

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    x = conv(x, self.features, self.kernel_size, padding=self.kernel_size // 2)
    return nn.relu(BatchNorm()(x, train, mask))


class Inception(nn.Module):
  n1x1: int
  n3x3red: int
  n3x3: int
  n5x5red: int
  n5x5: int
  pool_planes: int

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    y1 = _ConvBNReLU(self.n1x1, 1, name='b1')(x, train, mask)
    y2 = _ConvBNReLU(self.n3x3red, 1, name='b2_0')(x, train, mask)
    y2 = _ConvBNReLU(self.n3x3, 3, name='b2_1')(y2, train, mask)
    y3 = _ConvBNReLU(self.n5x5red, 1, name='b3_0')(x, train, mask)
    y3 = _ConvBNReLU(self.n5x5, 3, name='b3_1')(y3, train, mask)
    y3 = _ConvBNReLU(self.n5x5, 3, name='b3_2')(y3, train, mask)
    y4 = max_pool(x, 3, stride=1, padding=1)
    y4 = _ConvBNReLU(self.pool_planes, 1, name='b4')(y4, train, mask)
    return jnp.concatenate([y1, y2, y3, y4], axis=-1)


class GoogLeNet(nn.Module):
  """See module docstring."""

  num_classes: int
  width_mult: float = 1.0

  def _c(self, n: int) -> int:
    return max(1, int(math.ceil(self.width_mult * n)))

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = _ConvBNReLU(self._c(192), 3, name='pre_layers')(x, train, mask)
    for stage in (('a3', 'b3'), ('a4', 'b4', 'c4', 'd4', 'e4'), ('a5', 'b5')):
      if stage[0] != 'a3':
        x = max_pool(x, 3, stride=2, padding=1)
      for name in stage:
        cfg: Tuple[int, ...] = tuple(self._c(n) for n in _INCEPTION_CFG[name])
        x = Inception(*cfg, name=name)(x, train, mask)
    return dense(sow_features(self, global_avg_pool(x)), self.num_classes, name='linear')


@register_model('googlenet')
def googlenet(num_classes, input_shape, width_mult: float = 1.0):
  """kuangliu CIFAR GoogLeNet (see the module docstring).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    width_mult: Scales every channel count c to ceil(width_mult * c).
  """
  del input_shape
  if width_mult <= 0:
    raise ValueError(f'width_mult must be > 0, got {width_mult}')
  return GoogLeNet(num_classes=num_classes, width_mult=float(width_mult))
