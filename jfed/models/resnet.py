"""CIFAR ResNet-18 (kuangliu/pytorch-cifar, as used by DENSE, FedHydra, FedTSA, HeteroFL).

Stem Conv3x3(stride 1, pad 1, no bias) BN ReLU (no max pool) -> BasicBlock stages [2, 2, 2, 2]
with strides 1, 2, 2, 2 -> global average pooling -> Linear. Convs have no bias; shortcut is
Conv1x1(stride) + BN when the shape changes. PyTorch default init (see `jfed.models.layers`).
Width 1, 32x32x3, 10 classes: 11,173,962 parameters, as PyTorch (BN running stats excluded).

`width_mult` (HeteroFL's model rate / FedTSA's pruning rate) scales the hidden sizes of the
stem and every block to ceil(width_mult * [64, 128, 256, 512]); the classifier keeps all classes.
`embed_dim` > 0 (default 0: none) inserts Linear(embed_dim) + ReLU between the pooling and the
classifier, so that ResNets of different widths share one embedding width (FedProto's
prototypes, `github.com/yuetan031/FedProto`). The classifier's input is sown as the model's features
(`jfed.models.layers.apply_with_features`).
Inputs: 32px -> final map 4x4, 28px -> 4x4, 8px -> 1x1 (strided convs pad 1 like PyTorch);
global average pooling equals kuangliu's avg_pool2d(4) on 32px inputs.
"""

import math
from typing import Sequence, Tuple

import flax.linen as nn

from jfed.models.layers import CONV_IMPLS, BatchNorm, conv, dense, global_avg_pool, sow_features
from jfed.models.registry import register_model


def scaled_widths(widths: Sequence[int], width_mult: float) -> Tuple[int, ...]:
  """HeteroFL's `ceil(rate * width)` (at least 1)."""
  return tuple(max(1, int(math.ceil(width_mult * w))) for w in widths)


class BasicBlock(nn.Module):
  features: int
  stride: int = 1
  conv_impl: str = 'lax'

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    impl = self.conv_impl
    out = conv(x, self.features, 3, stride=self.stride, padding=1, use_bias=False, impl=impl)
    out = nn.relu(BatchNorm()(out, train, mask))
    out = conv(out, self.features, 3, stride=1, padding=1, use_bias=False, impl=impl)
    out = BatchNorm()(out, train, mask)
    shortcut = x
    if self.stride != 1 or x.shape[-1] != self.features:
      shortcut = conv(x, self.features, 1, stride=self.stride, padding=0, use_bias=False)
      shortcut = BatchNorm()(shortcut, train, mask)
    return nn.relu(out + shortcut)


class ResNet(nn.Module):
  """CIFAR-style ResNet with BasicBlocks (see module docstring)."""

  num_classes: int
  stage_sizes: Tuple[int, ...] = (2, 2, 2, 2)
  widths: Tuple[int, ...] = (64, 128, 256, 512)
  embed_dim: int = 0
  conv_impl: str = 'lax'  # form of the stride-1 convolutions (`jfed.models.layers.conv`)

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = conv(x, self.widths[0], 3, stride=1, padding=1, use_bias=False, impl=self.conv_impl)
    x = nn.relu(BatchNorm()(x, train, mask))
    for i, (blocks, width) in enumerate(zip(self.stage_sizes, self.widths)):
      for j in range(blocks):
        stride = 2 if (i > 0 and j == 0) else 1
        x = BasicBlock(width, stride, self.conv_impl)(x, train, mask)
    h = global_avg_pool(x)
    if self.embed_dim:
      h = nn.relu(dense(h, self.embed_dim))
    return dense(sow_features(self, h), self.num_classes)


@register_model('resnet18')
def resnet18(
  num_classes, input_shape, width_mult: float = 1.0, embed_dim: int = 0, conv_impl: str = 'lax'
):
  """CIFAR ResNet-18 (see the module docstring).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    width_mult: Scales the stage widths to ceil(width_mult * [64, 128, 256, 512]).
    embed_dim: Width of a ReLU embedding layer before the classifier; 0 for none.
    conv_impl: The convolutions' form ('lax', 'matmul', 'auto'; see `jfed.models.layers.conv`).
  """
  del input_shape
  if width_mult <= 0:
    raise ValueError(f'width_mult must be > 0, got {width_mult}')
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f'conv_impl must be one of {CONV_IMPLS}, got {conv_impl!r}')
  if embed_dim < 0:
    raise ValueError(f'embed_dim must be >= 0, got {embed_dim}')
  return ResNet(
    num_classes=num_classes,
    stage_sizes=(2, 2, 2, 2),
    widths=scaled_widths((64, 128, 256, 512), width_mult),
    embed_dim=int(embed_dim),
    conv_impl=conv_impl,
  )
