"""VGG-9 of FedMHO / FedDF (YXShi2000/FedMHO:pcode/models/vgg.py:VGG9), no BatchNorm.

Conv3x3(64, pad 1) ReLU MaxPool2 -> Conv3x3(128) ReLU MaxPool2 -> Conv3x3(256) ReLU
-> Conv3x3(256) ReLU MaxPool2 -> AdaptiveAvgPool(7, 7) -> Flatten(256*7*7 = 12544)
-> Linear(4096) ReLU Dropout(0.5) -> Linear(4096) ReLU Dropout(0.5) -> Linear(num_classes).
32x32x3, 10 classes: 69,167,498 parameters, as PyTorch (28x28x1: 69,166,346). The adaptive
pooling *upsamples* the 4x4 (32px), 3x3 (28px) or 1x1 (8px) map to 7x7 exactly as PyTorch's
AdaptiveAvgPool2d does, so every input size works without deviation.

Dropout: active only in train mode *and* when a 'dropout' PRNG stream is supplied
(`module.apply(..., train=True, rngs={'dropout': key})`). jfed's local trainer and FedMHO's
server supply one (the engine's per-step key), as the reference trains with dropout; the
distillation students of DENSE / Co-Boosting / FedDF get none and train VGG-9 without it.
`width_mult` scales the conv widths and `fc_width` the two hidden FC layers (defaults are the
paper's; smaller values exist for cheap tests).
"""

import math
from typing import Sequence

import flax.linen as nn

from jfed.models.layers import (
  CONV_IMPLS,
  adaptive_avg_pool2d,
  conv,
  dense,
  flatten,
  pool2_or_skip,
  sow_features,
)
from jfed.models.registry import register_model


class VGG9(nn.Module):
  num_classes: int
  channels: Sequence[int] = (64, 128, 256, 256)
  fc_width: int = 4096
  dropout_rate: float = 0.5
  conv_impl: str = 'lax'  # form of the convolutions (`jfed.models.layers.conv`)

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del mask  # no BatchNorm
    c1, c2, c3, c4 = self.channels
    impl = self.conv_impl
    x = pool2_or_skip(nn.relu(conv(x, c1, 3, padding=1, impl=impl)))
    x = pool2_or_skip(nn.relu(conv(x, c2, 3, padding=1, impl=impl)))
    x = nn.relu(conv(x, c3, 3, padding=1, impl=impl))
    x = pool2_or_skip(nn.relu(conv(x, c4, 3, padding=1, impl=impl)))
    x = flatten(adaptive_avg_pool2d(x, (7, 7)))
    deterministic = not train or not self.has_rng('dropout')
    for _ in range(2):
      x = nn.relu(dense(x, self.fc_width))
      x = nn.Dropout(self.dropout_rate, deterministic=deterministic)(x)
    return dense(sow_features(self, x), self.num_classes)


@register_model('vgg9')
def vgg9(
  num_classes,
  input_shape,
  width_mult: float = 1.0,
  fc_width: int = 4096,
  dropout_rate: float = 0.5,
  conv_impl: str = 'lax',
):
  """FedMHO/FedDF VGG-9 (see the module docstring).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    width_mult: Scales every channel count c to ceil(width_mult * c).
    fc_width: Width of the two hidden fully connected layers.
    dropout_rate: Dropout after each hidden fully connected layer (in training, given a
      'dropout' key).
    conv_impl: The convolutions' form ('lax', 'matmul', 'auto'; see `jfed.models.layers.conv`).
  """
  del input_shape
  if width_mult <= 0:
    raise ValueError(f'width_mult must be > 0, got {width_mult}')
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f'conv_impl must be one of {CONV_IMPLS}, got {conv_impl!r}')
  channels = tuple(max(1, int(math.ceil(width_mult * c))) for c in (64, 128, 256, 256))
  return VGG9(
    num_classes=num_classes,
    channels=channels,
    fc_width=int(fc_width),
    dropout_rate=float(dropout_rate),
    conv_impl=conv_impl,
  )
