"""Layers shared by all jfed models."""

import math
from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

# PyTorch's BatchNorm2d(momentum=0.1, eps=1e-5) in flax terms (reference-code.md §12).
TORCH_BN_MOMENTUM = 0.9
TORCH_BN_EPSILON = 1e-5


class BatchNorm(nn.Module):
  """BatchNorm with PyTorch defaults, masked batch statistics and input-statistics sowing.

  `mask` ([B] bool) keeps padded samples out of the batch statistics so that a padded client
  trains exactly as on its own samples. When the 'bn_inputs' collection is mutable, the layer
  sows the mean and biased variance of its *input* over all axes but the last: the quantities
  the DeepInversion BN-statistics loss compares with the running statistics.
  """

  momentum: float = TORCH_BN_MOMENTUM
  epsilon: float = TORCH_BN_EPSILON
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool, mask: Optional[jnp.ndarray] = None):
    bn = nn.BatchNorm(
      use_running_average=not train,
      momentum=self.momentum,
      epsilon=self.epsilon,
      dtype=self.dtype,
      name='bn',
    )
    if self.is_mutable_collection('bn_inputs') and not self.is_initializing():
      axes = tuple(range(x.ndim - 1))
      mean = jnp.mean(x, axis=axes)
      var = jnp.mean(jnp.square(x - mean), axis=axes)
      self.sow('bn_inputs', 'stats', (mean, var))
    if mask is None or not train:
      return bn(x)
    bn_mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x.shape)
    return bn(x, mask=bn_mask)


# ---------------------------------------------------------------------------------------------
# Penultimate features (FedProto's prototypes are class means of them)
# ---------------------------------------------------------------------------------------------
# Every classifier of the zoo sows the input of its output layer under this name. Sowing into a
# collection that is not mutable does nothing, so ordinary `apply` calls are unchanged; ask for
# the features with `apply_with_features`.
FEATURES = 'features'
INTERMEDIATES = 'intermediates'


def sow_features(module: nn.Module, h):
  """Records `h` (the classifier's input) as the model's penultimate features; returns `h`."""
  module.sow(INTERMEDIATES, FEATURES, h)
  return h


def apply_with_features(module, variables, x, train: bool = False, mask=None, rngs=None):
  """(logits, features [B, D], new batch_stats) of a zoo classifier in one forward pass.

  In train mode the BatchNorm statistics are updated (`mask` keeps padded rows out of them);
  in eval mode the returned batch_stats are the given ones. Raises ValueError for a model that
  does not sow its features.
  """
  mutable = [INTERMEDIATES, 'batch_stats'] if train else [INTERMEDIATES]
  logits, updates = module.apply(
    variables, x, train=train, mask=mask, mutable=mutable, rngs=rngs or {}
  )
  sown = updates.get(INTERMEDIATES, {}).get(FEATURES)
  if sown is None:
    raise ValueError(f'{type(module).__name__} does not expose its penultimate features')
  return logits, sown[-1], updates.get('batch_stats', variables.get('batch_stats', {}))


# ---------------------------------------------------------------------------------------------
# Small helpers shared by the model zoo (jfed/models/*.py). They create flax submodules, so call
# them only from inside a parent module's `@nn.compact` method.
# ---------------------------------------------------------------------------------------------
# PyTorch's default Conv2d/Linear weight init, kaiming_uniform_(a=sqrt(5)), is
# U(-1/sqrt(fan_in), 1/sqrt(fan_in)), i.e. variance 1/(3 fan_in).
torch_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform')


def torch_bias_init(fan_in: int):
  """PyTorch's default bias init U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

  Flax's bias init sees no fan-in, hence this closure.
  """
  bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


Padding = Union[int, str, Sequence[Tuple[int, int]]]


def _pairs(padding: Padding):
  if isinstance(padding, int):
    return ((padding, padding), (padding, padding))
  return padding


def conv(
  x,
  features: int,
  kernel_size: int,
  stride: int = 1,
  padding: Padding = 0,
  use_bias: bool = True,
  name: Optional[str] = None,
):
  """PyTorch-style Conv2d on NHWC input: integer `padding` pads p on every side like PyTorch."""
  fan_in = x.shape[-1] * kernel_size * kernel_size
  return nn.Conv(
    features,
    (kernel_size, kernel_size),
    strides=(stride, stride),
    padding=_pairs(padding),
    use_bias=use_bias,
    kernel_init=torch_kernel_init,
    bias_init=torch_bias_init(fan_in),
    name=name,
  )(x)


def dense(x, features: int, use_bias: bool = True, name: Optional[str] = None):
  """PyTorch-style Linear."""
  return nn.Dense(
    features,
    use_bias=use_bias,
    kernel_init=torch_kernel_init,
    bias_init=torch_bias_init(x.shape[-1]),
    name=name,
  )(x)


def max_pool(x, window: int = 2, stride: Optional[int] = None, padding: int = 0):
  """PyTorch MaxPool2d (floor mode; padding pads with -inf)."""
  stride = window if stride is None else stride
  return nn.max_pool(x, (window, window), strides=(stride, stride), padding=_pairs(padding))


def avg_pool(x, window: int = 2, stride: Optional[int] = None):
  """PyTorch AvgPool2d without padding (floor mode)."""
  stride = window if stride is None else stride
  return nn.avg_pool(x, (window, window), strides=(stride, stride), padding='VALID')


def pool2_or_skip(x, kind: str = 'max'):
  """2x2/stride-2 pooling, skipped when the feature map is already smaller than 2x2.

  Lets paper architectures designed for 28/32 px inputs run on 8x8 inputs (sklearn digits),
  where one pooling too many would otherwise produce an empty feature map.
  """
  if min(x.shape[-3], x.shape[-2]) < 2:
    return x
  return max_pool(x, 2) if kind == 'max' else avg_pool(x, 2)


def _adaptive_matrix(n_in: int, n_out: int) -> jnp.ndarray:
  rows = []
  for i in range(n_out):
    start = (i * n_in) // n_out
    end = -((-(i + 1) * n_in) // n_out)  # ceil((i + 1) * n_in / n_out)
    row = [0.0] * n_in
    for j in range(start, end):
      row[j] = 1.0 / (end - start)
    rows.append(row)
  return jnp.asarray(rows, jnp.float32)


def adaptive_avg_pool2d(x, output_size: Tuple[int, int]):
  """PyTorch AdaptiveAvgPool2d on NHWC input (same bins: floor(i*H/o) .. ceil((i+1)*H/o))."""
  ph = _adaptive_matrix(x.shape[-3], output_size[0]).astype(x.dtype)
  pw = _adaptive_matrix(x.shape[-2], output_size[1]).astype(x.dtype)
  return jnp.einsum('oh,...hwc,pw->...opc', ph, x, pw)


def global_avg_pool(x):
  """Mean over the spatial axes: [..., H, W, C] -> [..., C]."""
  return jnp.mean(x, axis=(-3, -2))


def flatten(x):
  """[B, ...] -> [B, prod(...)]."""
  return x.reshape((x.shape[0], -1))
