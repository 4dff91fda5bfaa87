"""Small CNNs and an MLP used by the seed papers and their baselines.

All models take NHWC float32 images and return logits [B, num_classes]; `mask` ([B] bool) is
passed to every BatchNorm (models without BN accept and ignore it). Weights use PyTorch's
default init (kaiming_uniform(a=sqrt(5)) = variance_scaling(1/3, fan_in, uniform); biases
U(+-1/sqrt(fan_in))), see `jfed.models.layers`. PyTorch paddings are reproduced exactly (explicit
symmetric padding, floor-mode pooling). Flatten order is HWC (flax) instead of PyTorch's CHW:
this only matters when porting PyTorch weights.

Every model supports 8x8x1 (sklearn digits), 28x28x1 (MNIST family) and 32x32x3 (CIFAR/SVHN)
inputs; where a paper architecture would shrink an 8x8 input to nothing, the docstring says
what changes for small inputs (the 28/32 px behaviour is always the paper's).
"""

import math
from typing import Sequence, Tuple

import flax.linen as nn
import jax

from jfed.models.layers import (
  CONV_IMPLS,
  BatchNorm,
  conv,
  dense,
  flatten,
  pool2_or_skip,
  sow_features,
)
from jfed.models.registry import register_model


def _valid_or_same(x, kernel_size: int, min_valid_size: int) -> int:
  """Padding for a paper's unpadded ('valid') conv: 0, or k//2 when the input is too small."""
  return 0 if min(x.shape[-3], x.shape[-2]) >= min_valid_size else kernel_size // 2


# --------------------------------------------------------------------------------------------
# DENSE (zj-jayzhang/DENSE:models/nets.py) and FedHydra's precursor (Jun-B0518/ICDE2025-FL-SA)
# --------------------------------------------------------------------------------------------
class CNNMnist(nn.Module):
  """DENSE `CNNMnist` (also FL-SA/FedHydra's `CNNMnist`, identical code).

  Conv5x5(16, pad 2) BN ReLU MaxPool2 -> Conv5x5(32, pad 2) BN ReLU MaxPool2 -> Linear.
  28x28x1: FC input 7*7*32 = 1568, 29,034 parameters for 10 classes (as PyTorch).
  32x32x3 -> FC input 8*8*32; 8x8x1 -> 2*2*32 (no deviation needed: convs are padded).
  `embed_dim` > 0 (default 0: none) inserts Linear(embed_dim) + ReLU before the classifier
  (FedProto's fc1 embedding, `github.com/yuetan031/FedProto`).
  """

  num_classes: int
  channels: Tuple[int, int] = (16, 32)
  embed_dim: int = 0
  conv_impl: str = 'lax'  # form of the convolutions (`jfed.models.layers.conv`)

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    for ch in self.channels:
      x = conv(x, ch, 5, padding=2, impl=self.conv_impl)
      x = BatchNorm()(x, train, mask)
      x = nn.relu(x)
      x = pool2_or_skip(x, 'max')
    x = flatten(x)
    if self.embed_dim:
      x = nn.relu(dense(x, self.embed_dim))
    return dense(sow_features(self, x), self.num_classes)


class CNNCifar(nn.Module):
  """DENSE `CNNCifar` (no BN): Conv3x3(128) ReLU MaxPool2 -> Conv3x3(128) ReLU MaxPool2 ->
  Conv3x3(128) ReLU -> Linear. Convs are unpadded: 32px -> 4x4x128 = 2048 FC inputs,
  28px -> 3x3x128. `channels=(256, 256, 128)` gives DENSE's `CNNCifar100`.

  Deviation for small inputs: below 18 px the three valid convolutions would shrink the map to
  nothing, so for inputs smaller than 18x18 (8x8 digits) the convs use padding 1
  (8x8 -> 2x2x128 FC inputs).
  """

  num_classes: int
  channels: Tuple[int, int, int] = (128, 128, 128)
  hidden: Tuple[int, ...] = ()  # extra ReLU FC layers before the classifier (CNNCifar2: (64,))

  MIN_VALID_SIZE = 18

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask  # no BatchNorm / dropout
    pad = _valid_or_same(x, 3, self.MIN_VALID_SIZE)
    for i, ch in enumerate(self.channels):
      x = nn.relu(conv(x, ch, 3, padding=pad))
      if i < len(self.channels) - 1:
        x = pool2_or_skip(x, 'max')
    x = flatten(x)
    for h in self.hidden:
      x = nn.relu(dense(x, h))
    return dense(sow_features(self, x), self.num_classes)


class LeNet(nn.Module):
  """LeNet-5: Conv5x5(6) ReLU Pool2 -> Conv5x5(16) ReLU Pool2 -> FC120 ReLU -> FC84 ReLU -> FC.

  Unpadded convs as in kuangliu/pytorch-cifar and HFLDD: 32x32x3 -> 5*5*16 = 400 FC inputs;
  28x28x1 -> 4*4*16 = 256 (44,426 parameters for 10 classes, HFLDD's count).
  `pool` is 'avg' (FedHydra App. G: "two convolutional layers paired with average pooling")
  or 'max' (kuangliu, HFLDD).
  Deviation for small inputs: for inputs smaller than 16x16 (8x8 digits) the convs use
  padding 2 (8x8 -> 2x2x16 FC inputs).
  """

  num_classes: int
  pool: str = 'avg'
  channels: Tuple[int, int] = (6, 16)
  hidden: Tuple[int, int] = (120, 84)

  MIN_VALID_SIZE = 16

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask
    if self.pool not in ('avg', 'max'):
      raise ValueError(f"LeNet pool must be 'avg' or 'max', got {self.pool!r}")
    pad = _valid_or_same(x, 5, self.MIN_VALID_SIZE)
    for ch in self.channels:
      x = nn.relu(conv(x, ch, 5, padding=pad))
      x = pool2_or_skip(x, self.pool)
    x = flatten(x)
    for h in self.hidden:
      x = nn.relu(dense(x, h))
    return dense(sow_features(self, x), self.num_classes)


class HFLDDCifarCNN(nn.Module):
  """HFLDD (Shi et al., arXiv 2409.17517, Sec. VI-A2) CIFAR-10 CNN: four blocks of
  [Conv3x3(pad 1) BN ReLU] x2 + MaxPool2, then one Linear.

  The paper gives only the structure and a total of 1,020,160 parameters; channel counts are
  not given and no natural choice reproduces that total exactly. We use the usual doubling
  widths (32, 64, 128, 256) (1,184,426 parameters for 32x32x3 / 10 classes) and Conv-BN-ReLU
  order. 32px -> 2x2x256 FC inputs; 28px -> 1x1x256; 8px -> 1x1x256 (the 4th pooling is
  skipped once the map is 1x1).
  """

  num_classes: int
  channels: Tuple[int, ...] = (32, 64, 128, 256)

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    for ch in self.channels:
      for _ in range(2):
        x = conv(x, ch, 3, padding=1)
        x = BatchNorm()(x, train, mask)
        x = nn.relu(x)
      x = pool2_or_skip(x, 'max')
    return dense(sow_features(self, flatten(x)), self.num_classes)


class ConvNetIN(nn.Module):
  """HFLDD's CINIC-10 model = the dataset-distillation 'ConvNet': three blocks of
  Conv3x3(128, pad 1) InstanceNorm(affine) ReLU AvgPool2, then Linear.
  32x32x3, 10 classes: 320,010 parameters (matches the paper). InstanceNorm is GroupNorm with
  one channel per group (PyTorch `GroupNorm(C, C)`, eps 1e-5). 8px -> 1x1x128.
  """

  num_classes: int
  width: int = 128
  depth: int = 3

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask
    for _ in range(self.depth):
      x = conv(x, self.width, 3, padding=1)
      x = nn.GroupNorm(num_groups=None, group_size=1, epsilon=1e-5)(x)
      x = nn.relu(x)
      x = pool2_or_skip(x, 'avg')
    return dense(sow_features(self, flatten(x)), self.num_classes)


class FedMHOCNN(nn.Module):
  """FedMHO's small CNN for the MNIST family (YXShi2000/FedMHO:pcode/models/cnn.py:CNN_MNIST,
  also DENSE-code/models/cnn.py): Conv5x5(10) MaxPool2 ReLU -> Conv5x5(20) MaxPool2 ReLU ->
  Linear(320, C); 8,490 parameters at 28x28x1 (as PyTorch). Unpadded convs, padded (k//2) on
  inputs too small for them (8x8 digits).

  `softmax_output`: the reference returns softmax *probabilities*, which its cross entropy then
  treats as logits (a double softmax) and its prototype vote averages with the VGG-9's logits.
  The registered 'fedmho_cnn' follows the reference (softmax_output=1); 'fedmho_cnn:
  softmax_output=0' returns logits, the CNN trained with cross entropy that the paper describes.
  """

  num_classes: int
  softmax_output: bool = False
  MIN_VALID_SIZE = 12

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask  # no BatchNorm or dropout
    pad = _valid_or_same(x, 5, self.MIN_VALID_SIZE)
    for ch in (10, 20):
      x = nn.relu(pool2_or_skip(conv(x, ch, 5, padding=pad), 'max'))
    x = dense(sow_features(self, flatten(x)), self.num_classes)
    return jax.nn.softmax(x) if self.softmax_output else x


class FedCVAEClassifier(nn.Module):
  """FedCVAE's server classifier (ceh-2000/fed_cvae:models/classifier.py:Classifier):
  Conv5x5(32) MaxPool2 -> Conv5x5(64) MaxPool2 -> Flatten -> Linear(512) ReLU -> Linear, with no
  nonlinearity after the convolutions and no BatchNorm or dropout, as the reference.

  Unpadded convs: the reference's 32x32 inputs (it resizes every split) give 5*5*64 = 1600 FC
  inputs and 876,938 parameters for 1 channel and 10 classes (as PyTorch); 28x28 gives 4*4*64.
  The reference hard-codes Linear(1600, 512); here its input width follows the image size.
  Deviation for small inputs: below 16x16 (8x8 digits) the convs use padding 2, as `LeNet`
  (8x8 -> 2x2x64 FC inputs).
  """

  num_classes: int
  channels: Tuple[int, int] = (32, 64)
  hidden: int = 512

  MIN_VALID_SIZE = 16

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask  # no BatchNorm or dropout
    pad = _valid_or_same(x, 5, self.MIN_VALID_SIZE)
    for ch in self.channels:
      x = pool2_or_skip(conv(x, ch, 5, padding=pad), 'max')
    x = nn.relu(dense(flatten(x), self.hidden))
    return dense(sow_features(self, x), self.num_classes)


class MLP(nn.Module):
  """FedAvg's '2NN': Flatten -> [Linear(200) ReLU] x2 -> Linear (199,210 params on MNIST).
  `embed_dim` > 0 (default 0: none) adds one more Linear(embed_dim) ReLU before the classifier
  (FedProto's fixed-width embedding)."""

  num_classes: int
  hidden: Tuple[int, ...] = (200, 200)
  embed_dim: int = 0

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask
    x = flatten(x)
    for h in self.hidden + ((self.embed_dim,) if self.embed_dim else ()):
      x = nn.relu(dense(x, h))
    return dense(sow_features(self, x), self.num_classes)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------
@register_model('cnn_mnist')
def cnn_mnist(
  num_classes,
  input_shape,
  channels: Sequence[int] = (16, 32),
  embed_dim: int = 0,
  conv_impl: str = 'lax',
):
  """DENSE CNNMnist (see `CNNMnist`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    channels: Output channels of the two convolution blocks.
    embed_dim: Width of a ReLU embedding layer before the classifier; 0 for none.
    conv_impl: The convolutions' form ('lax', 'matmul', 'auto'; see `jfed.models.layers.conv`).
  """
  del input_shape
  if embed_dim < 0:
    raise ValueError(f'embed_dim must be >= 0, got {embed_dim}')
  return CNNMnist(
    num_classes=num_classes,
    channels=tuple(channels),
    embed_dim=int(embed_dim),
    conv_impl=_conv_impl(conv_impl),
  )


def _conv_impl(impl: str) -> str:
  if impl not in CONV_IMPLS:
    raise ValueError(f'conv_impl must be one of {CONV_IMPLS}, got {impl!r}')
  return impl


@register_model('fedmho_cnn')
def fedmho_cnn(num_classes, input_shape, softmax_output: int = 1):
  """FedMHO's small CNN (see `FedMHOCNN`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    softmax_output: 1 (default) outputs softmax probabilities, as the reference code
      `github.com/YXShi2000/FedMHO` does; 0 outputs logits.
  """
  del input_shape
  return FedMHOCNN(num_classes=num_classes, softmax_output=bool(softmax_output))


@register_model('fedcvae_classifier')
def fedcvae_classifier(num_classes, input_shape):
  """FedCVAE's server classifier (see `FedCVAEClassifier`): the FedCVAE-Ens / -KD server model
  of `github.com/ceh-2000/fed_cvae`.

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
  """
  del input_shape
  return FedCVAEClassifier(num_classes=num_classes)


@register_model('cnn_cifar')
def cnn_cifar(num_classes, input_shape, channels: Sequence[int] = (128, 128, 128)):
  """DENSE CNNCifar (see `CNNCifar`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    channels: Output channels of the three convolution blocks.
  """
  del input_shape
  return CNNCifar(num_classes=num_classes, channels=tuple(channels))


@register_model('fedhydra_cnn2')
def fedhydra_cnn2(num_classes, input_shape):
  """FedHydra's two-layer CNN (MNIST/FMNIST client model).

  FedHydra (Bai et al., KDD 2025, Sec. 4.1.3, App. G) gives no layer sizes; its released
  precursor code (`github.com/Jun-B0518/ICDE2025-FL-SA` `models/nets.py`) defines exactly
  DENSE's CNNMnist (two Conv5x5 blocks, 16 and 32 channels, BN, max pooling, one Linear), which
  we use. Same architecture as 'cnn_mnist'.
  """
  del input_shape
  return CNNMnist(num_classes=num_classes)


@register_model('fedhydra_cnn3')
def fedhydra_cnn3(num_classes, input_shape):
  """FedHydra's three-layer CNN (SVHN/CIFAR-10 client model; one of the two "custom CNNs").

  The paper gives no layer sizes (App. G: "two to three convolutional layers with ReLU ...
  followed by max pooling and fully connected layers ... often starting with 32 filters and
  increasing depth gradually"). FedHydra is a DENSE fork, and DENSE's heterogeneous setting
  (heter_fl.py) uses CNNCifar2, which fits that description; we use it: unpadded Conv3x3
  32, 64, 64 (ReLU; max pooling after the first two) -> Linear(64) ReLU -> Linear. No BN.
  32px -> 4x4x64 = 1024 FC inputs. The other three-conv CNN of that setting is 'cnn_cifar'.
  Small inputs (< 18 px): convs use padding 1, as in `CNNCifar`.
  """
  del input_shape
  return CNNCifar(num_classes=num_classes, channels=(32, 64, 64), hidden=(64,))


@register_model('lenet')
def lenet(num_classes, input_shape, pool: str = 'avg'):
  """LeNet-5 with ReLU (see `LeNet`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    pool: 'avg' (default, as in FedHydra App. G) or 'max' pooling.
  """
  del input_shape
  return LeNet(num_classes=num_classes, pool=pool)


@register_model('hfldd_cnn_mnist')
def hfldd_cnn_mnist(num_classes, input_shape):
  """HFLDD (Shi et al., arXiv 2409.17517, Sec. VI-A2) MNIST CNN: "two convolutional layers with
  ReLU activations and max pooling, followed by flattening and three fully connected layers",
  44,426 parameters. That count is reproduced exactly by LeNet-5 with max pooling on 28x28x1
  (conv 6/16 5x5 unpadded, FC 256-120-84-10), which is what this is."""
  del input_shape
  return LeNet(num_classes=num_classes, pool='max')


@register_model('hfldd_cnn_cifar')
def hfldd_cnn_cifar(num_classes, input_shape, channels: Sequence[int] = (32, 64, 128, 256)):
  """HFLDD CIFAR-10 CNN (see `HFLDDCifarCNN`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    channels: Output channels of the four blocks (our choice; the paper gives none).
  """
  del input_shape
  return HFLDDCifarCNN(num_classes=num_classes, channels=tuple(channels))


@register_model('hfldd_cnn_cinic')
def hfldd_cnn_cinic(num_classes, input_shape, width: int = 128, depth: int = 3):
  """HFLDD CINIC-10 ConvNet (see `ConvNetIN`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    width: Channels of every convolution block.
    depth: Number of convolution blocks.
  """
  del input_shape
  return ConvNetIN(num_classes=num_classes, width=width, depth=depth)


@register_model('mlp')
def mlp(
  num_classes,
  input_shape,
  hidden: Sequence[int] = (200, 200),
  width_mult: float = 1.0,
  embed_dim: int = 0,
):
  """Two-hidden-layer MLP, 200 units each (see `MLP`).

  Args:
    num_classes: Number of output classes (logits per example).
    input_shape: The (H, W, C) shape of one input image.
    hidden: Widths of the hidden layers.
    width_mult: Scales each hidden width h to ceil(width_mult * h) (HeteroFL's model rate, as
      its reference MLP).
    embed_dim: Width of a ReLU embedding layer before the classifier; 0 for none (see `MLP`).
  """
  del input_shape
  if width_mult <= 0:
    raise ValueError(f'width_mult must be > 0, got {width_mult}')
  if embed_dim < 0:
    raise ValueError(f'embed_dim must be >= 0, got {embed_dim}')
  hidden = tuple(max(1, int(math.ceil(width_mult * h))) for h in hidden)
  return MLP(num_classes=num_classes, hidden=hidden, embed_dim=int(embed_dim))
