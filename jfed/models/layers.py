"""Layers shared by all jfed models."""

import math
from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

# PyTorch's BatchNorm2d(momentum=0.1, eps=1e-5) in flax terms (flax's momentum is 1 - PyTorch's).
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
    if self.is_mutable_collection('bn_inputs') and not self.is_initializing():
      axes = tuple(range(x.ndim - 1))
      mean = jnp.mean(x, axis=axes)
      var = jnp.mean(jnp.square(x - mean), axis=axes)
      self.sow('bn_inputs', 'stats', (mean, var))
    if mask is None or not train or self.is_initializing():
      bn = nn.BatchNorm(
        use_running_average=not train,
        momentum=self.momentum,
        epsilon=self.epsilon,
        dtype=self.dtype,
        name='bn',
      )
      return bn(x)
    return _RowWeightedBatchNorm(self.momentum, self.epsilon, self.dtype, name='bn')(x, mask)


class _RowWeightedBatchNorm(nn.Module):
  """flax's train-mode `nn.BatchNorm` (fast variance, same variables) with the statistics taken
  over the rows `mask` ([B] bool) keeps: `nn.BatchNorm(mask=...)` with the mask per row.

  flax takes a mask as large as the input, so XLA:CPU sums a broadcast mask and selects over
  every element; weighting per-row sums costs a matrix-vector product instead (measured: about
  a tenth of CNNMnist's training step on the CPU).
  """

  momentum: float
  epsilon: float
  dtype: Any = None

  @nn.compact
  def __call__(self, x, mask):
    features = (x.shape[-1],)
    ra_mean = self.variable('batch_stats', 'mean', lambda s: jnp.zeros(s, jnp.float32), features)
    ra_var = self.variable('batch_stats', 'var', lambda s: jnp.ones(s, jnp.float32), features)
    stats_dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
    weights = mask.astype(stats_dtype)
    xs = x.astype(stats_dtype).reshape(x.shape[0], -1, x.shape[-1])
    count = jnp.sum(weights) * xs.shape[1]
    mean = weights @ jnp.sum(xs, 1) / count
    mean2 = weights @ jnp.sum(jnp.square(xs), 1) / count
    var = jnp.maximum(0.0, mean2 - jnp.square(mean))
    ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
    ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
    scale = self.param('scale', nn.initializers.ones, features, jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, features, jnp.float32)
    y = (x - mean) * (jax.lax.rsqrt(var + self.epsilon) * scale) + bias
    return jnp.asarray(y, self.dtype or jnp.result_type(x, scale, bias))


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
  in eval mode the returned batch_stats are the given ones.

  Args:
    module: A zoo classifier (a flax module that sows its penultimate features).
    variables: Its variables ({'params': ..., 'batch_stats': ...}).
    x: A batch of inputs, [B, H, W, C].
    train: Whether BatchNorm uses (and updates) the batch statistics.
    mask: [B] bool, the real (unpadded) rows of `x`; None for all.
    rngs: PRNG keys for stochastic layers (dropout), by collection name.

  Returns:
    (logits [B, num_classes], features [B, D], batch_stats).

  Raises:
    ValueError: The model does not sow its features.
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
  impl: str = 'lax',
):
  """PyTorch-style Conv2d on NHWC input: integer `padding` pads p on every side like PyTorch.

  `impl` ('lax', default: XLA's convolution, today's path; 'matmul' or 'auto': see
  `use_matmul_conv`) picks the form of a stride-1 convolution with integer padding; the
  parameters ('kernel', 'bias') and their names are the same in every form, so a model trained
  in one form loads in another. Strided convolutions always take XLA's form.

  Args:
    x: Input, [B, H, W, C_in].
    features: Output channels.
    kernel_size: Side of the square kernel.
    stride: Stride in both spatial dimensions.
    padding: Pixels of zero padding on every side (an int, as PyTorch), or a flax padding.
    use_bias: Whether to add a bias.
    name: The submodule's name (its parameters' scope).
    impl: The form of a stride-1 convolution: 'lax', 'matmul' or 'auto'.
  """
  fan_in = x.shape[-1] * kernel_size * kernel_size
  if impl not in CONV_IMPLS:
    raise ValueError(f'conv impl {impl!r}; valid: {CONV_IMPLS}')
  if impl != 'lax' and stride == 1 and isinstance(padding, int):
    return Conv(
      features,
      (kernel_size, kernel_size),
      padding=padding,
      use_bias=use_bias,
      kernel_init=torch_kernel_init,
      bias_init=torch_bias_init(fan_in),
      impl=impl,
      name=name,
    )(x)
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
  """PyTorch-style Linear.

  Args:
    x: Input, [..., D_in].
    features: Output width.
    use_bias: Whether to add a bias.
    name: The submodule's name (its parameters' scope).
  """
  return nn.Dense(
    features,
    use_bias=use_bias,
    kernel_init=torch_kernel_init,
    bias_init=torch_bias_init(x.shape[-1]),
    name=name,
  )(x)


def max_pool(x, window: int = 2, stride: Optional[int] = None, padding: int = 0):
  """PyTorch MaxPool2d (floor mode; padding pads with -inf).

  Args:
    x: Input, [B, H, W, C].
    window: Side of the square pooling window.
    stride: Stride in both spatial dimensions; None for `window`.
    padding: Pixels of -inf padding on every side.
  """
  stride = window if stride is None else stride
  if stride == window and padding == 0:
    # Non-overlapping windows: a reshape and a max. XLA's form (reduce_window, whose gradient is
    # select_and_scatter) made CNNMnist's whole CPU training step 3x slower (BUILD_NOTES).
    *lead, height, width, channels = x.shape
    rows, cols = height // window, width // window
    x = x[..., : rows * window, : cols * window, :]  # floor mode
    return _blocked_max(x.reshape(*lead, rows, window, cols, window, channels))
  return nn.max_pool(x, (window, window), strides=(stride, stride), padding=_pairs(padding))


@jax.custom_jvp
def _blocked_max(blocks):
  """[..., H, k, W, k, C] -> [..., H, W, C], the max over each k x k block."""
  return jnp.max(blocks, axis=(-4, -2))


@_blocked_max.defjvp
def _blocked_max_jvp(primals, tangents):
  # PyTorch's MaxPool2d (and select_and_scatter) passes the gradient to the first maximum of a
  # window in row-major order; jnp.max would split it among tied maxima, and ties are common
  # (equal conv outputs over a blank background). A JVP, not a VJP, so forward mode works too.
  (blocks,), (tangent,) = primals, tangents
  out = _blocked_max(blocks)
  window = blocks.shape[-2]
  out_tangent = jnp.zeros_like(out)
  seen = jnp.zeros(out.shape, bool)
  for i in range(window):
    for j in range(window):
      first = (blocks[..., i, :, j, :] == out) & ~seen
      out_tangent = jnp.where(first, tangent[..., i, :, j, :], out_tangent)
      seen = seen | first
  return out, out_tangent


def avg_pool(x, window: int = 2, stride: Optional[int] = None):
  """PyTorch AvgPool2d without padding (floor mode).

  Args:
    x: Input, [B, H, W, C].
    window: Side of the square pooling window.
    stride: Stride in both spatial dimensions; None for `window`.
  """
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


# ---------------------------------------------------------------------------------------------
# Convolutions as shifted-slice matmuls (XLA:CPU)
# ---------------------------------------------------------------------------------------------
CONV_IMPLS = ('auto', 'lax', 'matmul')
# 'auto' takes the matmul form on CPU for every transposed convolution and for convolutions
# with a 28×28 or larger output, where both channel counts reach MATMUL_MIN_CHANNELS: there
# XLA:CPU's own convolutions are 3-8× slower (docs/fedhydra.md, "Generator convolutions on CPU"),
# while with few channels (CNNMnist, an image output layer) or small maps they are as fast or
# faster than the matmul.
MATMUL_MIN_CHANNELS = 32
MATMUL_MIN_CONV_PIXELS = 28 * 28


def use_matmul_conv(impl: str, in_features: int, features: int, out_pixels: int = 0) -> bool:
  """Whether a convolution or a transposed convolution runs as shifted-slice matmuls.

  Args:
    impl: The requested form: 'lax' (never), 'matmul' (always) or 'auto' (on CPU only, for
      wide enough channels and large enough maps).
    in_features: Input channels.
    features: Output channels.
    out_pixels: The output map's H·W for a convolution; 0 for a transposed convolution.

  Returns:
    True to use the matmul form.
  """
  if impl not in CONV_IMPLS:
    raise ValueError(f'conv impl {impl!r}; valid: {CONV_IMPLS}')
  if impl != 'auto':
    return impl == 'matmul'
  if jax.default_backend() != 'cpu' or min(in_features, features) < MATMUL_MIN_CHANNELS:
    return False
  return out_pixels == 0 or out_pixels >= MATMUL_MIN_CONV_PIXELS


def _taps_matmul(xp, kernel_taps, offsets, out_h: int, out_w: int):
  """Σ over taps of xp[:, dy + q, dx + p, :] @ kernel_tap, as one matmul of the concatenated
  shifted slices ([B, out_h, out_w, taps·C_in] @ [taps·C_in, C_out])."""
  cols = jnp.concatenate([xp[:, dy : dy + out_h, dx : dx + out_w, :] for dy, dx in offsets], -1)
  return cols @ jnp.concatenate(kernel_taps, 0)


def conv_transpose_padding(k: int, s: int) -> Tuple[int, int]:
  """lax.conv_transpose's 'SAME' padding of the stride-dilated input for kernel k, stride s."""
  pad_len = k + s - 2
  pad_lo = k - 1 if s > k - 1 else math.ceil(pad_len / 2)
  return pad_lo, pad_len - pad_lo


def conv_transpose_matmul(x, kernel, strides: Tuple[int, int]):
  """flax ConvTranspose(padding='SAME', transpose_kernel=False) as one shifted-slice matmul per
  output phase (sub-pixel form): output row s·q + r sums x[q + d_t]·w[t] over the taps t whose
  stride-dilated position lands on it, so no multiply touches a dilation zero.

  Args:
    x: Input, [B, H, W, C_in].
    kernel: The flax ConvTranspose kernel, [kh, kw, C_in, C_out].
    strides: (sh, sw), the upsampling factors.
  """
  (kh, kw), (sh, sw) = kernel.shape[:2], strides
  h, w = x.shape[1], x.shape[2]

  def phase_taps(k, s):  # per output phase r: [(tap t, input offset d_t)]
    lo, _ = conv_transpose_padding(k, s)
    return [[(t, (r + t - lo) // s) for t in range(k) if (r + t - lo) % s == 0] for r in range(s)]

  rows, cols = phase_taps(kh, sh), phase_taps(kw, sw)
  offs_y = [d for taps in rows for _, d in taps]
  offs_x = [d for taps in cols for _, d in taps]
  py = (max(0, -min(offs_y)), max(0, max(offs_y)))
  px = (max(0, -min(offs_x)), max(0, max(offs_x)))
  xp = jnp.pad(x, ((0, 0), py, px, (0, 0)))
  phases = []
  for ty in rows:
    row = []
    for tx in cols:
      taps = [(a, b) for a in ty for b in tx]
      offsets = [(dy + py[0], dx + px[0]) for (_, dy), (_, dx) in taps]
      row.append(_taps_matmul(xp, [kernel[a, b] for (a, _), (b, _) in taps], offsets, h, w))
    phases.append(jnp.stack(row, 3))  # [B, h, w, sw, C]
  y = jnp.stack(phases, 2)  # [B, h, sh, w, sw, C]
  return y.reshape(x.shape[0], h * sh, w * sw, kernel.shape[-1])


class Conv(nn.Module):
  """nn.Conv (stride 1, symmetric integer padding) with the same parameters ('kernel' [kh, kw,
  C_in, C_out], 'bias'), computed as a shifted-slice matmul where `impl` says so."""

  features: int
  kernel_size: Tuple[int, int]
  padding: int = 0
  use_bias: bool = True
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros
  impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    kh, kw = self.kernel_size
    kernel = self.param('kernel', self.kernel_init, (kh, kw, x.shape[-1], self.features))
    p = self.padding
    out_h, out_w = x.shape[1] + 2 * p - kh + 1, x.shape[2] + 2 * p - kw + 1
    if use_matmul_conv(self.impl, x.shape[-1], self.features, out_h * out_w):
      xp = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
      offsets = [(i, j) for i in range(kh) for j in range(kw)]
      y = _taps_matmul(xp, [kernel[i, j] for i, j in offsets], offsets, out_h, out_w)
    else:
      y = jax.lax.conv_general_dilated(
        x, kernel, (1, 1), ((p, p), (p, p)), dimension_numbers=('NHWC', 'HWIO', 'NHWC')
      )
    if self.use_bias:
      y = y + self.param('bias', self.bias_init, (self.features,))
    return y


class ConvTranspose(nn.Module):
  """nn.ConvTranspose(padding='SAME') with the same parameters, computed per output phase as a
  shifted-slice matmul (`conv_transpose_matmul`) where `impl` says so."""

  features: int
  kernel_size: Tuple[int, int]
  strides: Tuple[int, int] = (1, 1)
  use_bias: bool = True
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros
  impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', self.kernel_init, (*self.kernel_size, x.shape[-1], self.features))
    if use_matmul_conv(self.impl, x.shape[-1], self.features):
      y = conv_transpose_matmul(x, kernel, self.strides)
    else:
      y = jax.lax.conv_transpose(
        x, kernel, self.strides, 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC')
      )
    if self.use_bias:
      y = y + self.param('bias', self.bias_init, (self.features,))
    return y
