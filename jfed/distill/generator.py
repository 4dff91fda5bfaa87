"""DENSE / Co-Boosting image generator and FedHydra's (Bai et al., KDD 2025, §4.1.3).

DENSE's is `Generator` of `github.com/zj-jayzhang/DENSE` (`models/generator.py`), which
Co-Boosting (`github.com/rong-dai/Co-Boosting`) reuses.

    z[nz] → Dense(nz, 2·ngf·s_h·s_w) → reshape (s_h, s_w, 2·ngf)          (s = img_size // 4)
    → BN(2ngf) → Upsample×2 (nearest)
    → Conv3×3 2ngf→2ngf pad 1 no-bias → BN → LeakyReLU(0.2) → Upsample×2
    → Conv3×3 2ngf→ngf pad 1 no-bias → BN → LeakyReLU(0.2)
    → Conv3×3 ngf→C pad 1 (bias) → Sigmoid                                  (output in [0, 1])

s = H // 4 gives 8 for 32 px, 7 for 28 px and 2 for the 8×8 sklearn digits; H and W must be
multiples of 4. The generator's BatchNorm layers use the batch statistics whenever `train=True`
(the reference code keeps the generator in train mode during synthesis), PyTorch semantics
(flax momentum 0.9, eps 1e-5).

The module's initialisers are DENSE's `reset_model` distribution: Conv/Dense kernels ~ N(0, 0.02),
biases 0, BN scale ~ N(1, 0.02), BN bias 0. `dense_generator_init` draws the same distribution with
a single random call (fast to compile) and is what synthesis / model stratification use; it is
jittable and vmappable over keys (MS initialises m·c generators in one call).

The convolutions are `jfed.models.layers.Conv` / `ConvTranspose`: flax's parameters and numbers,
computed on CPU as shifted-slice matmuls where XLA:CPU's convolutions are several times slower
(the wide layers; docs/fedhydra.md, "Generator convolutions on CPU").
"""

import functools
import math
from typing import Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from jfed.engine.state import ModelState
from jfed.models.layers import CONV_IMPLS, Conv, ConvTranspose

GEN_BN_MOMENTUM = 0.9  # PyTorch momentum 0.1
GEN_BN_EPSILON = 1e-5


def _normal(stddev: float, mean: float = 0.0):
  def init(key, shape, dtype=jnp.float32):
    return mean + stddev * jax.random.normal(key, shape, dtype)

  return init


def upsample_nearest_2x(x: jnp.ndarray) -> jnp.ndarray:
  """`nn.Upsample(scale_factor=2)` (nearest) on NHWC."""
  return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def _generator_bn(train: bool, name: str) -> nn.BatchNorm:
  """The BatchNorm of both generators (DENSE's momentum, epsilon and N(1, 0.02) scales)."""
  return nn.BatchNorm(
    use_running_average=not train,
    momentum=GEN_BN_MOMENTUM,
    epsilon=GEN_BN_EPSILON,
    scale_init=_normal(0.02, 1.0),
    bias_init=nn.initializers.zeros,
    name=name,
  )


class DenseGenerator(nn.Module):
  """DENSE generator producing images of shape `img_shape` = (H, W, C) in [0, 1]."""

  img_shape: Sequence[int]
  nz: int = 256
  ngf: int = 64
  conv_impl: str = 'auto'  # jfed.models.layers.CONV_IMPLS

  @nn.compact
  def __call__(self, z: jnp.ndarray, train: bool = True) -> jnp.ndarray:
    h, w, c = self.img_shape
    if h % 4 or w % 4:
      raise ValueError(f'DenseGenerator needs H, W divisible by 4, got {self.img_shape}')
    sh, sw = h // 4, w // 4
    kinit, binit = _normal(0.02), nn.initializers.zeros
    x = nn.Dense(2 * self.ngf * sh * sw, kernel_init=kinit, bias_init=binit, name='l1')(z)
    # PyTorch reshapes to (N, 2ngf, s, s); in NHWC the same numbers are laid out channel-first
    # and then moved last, so a weight port would permute; for training from scratch it is moot.
    x = x.reshape(z.shape[0], 2 * self.ngf, sh, sw).transpose(0, 2, 3, 1)
    x = _generator_bn(train, 'bn0')(x)
    x = upsample_nearest_2x(x)
    conv = functools.partial(
      Conv, kernel_size=(3, 3), padding=1, kernel_init=kinit, impl=self.conv_impl
    )
    x = conv(2 * self.ngf, use_bias=False, name='conv1')(x)
    x = nn.leaky_relu(_generator_bn(train, 'bn1')(x), 0.2)
    x = upsample_nearest_2x(x)
    x = conv(self.ngf, use_bias=False, name='conv2')(x)
    x = nn.leaky_relu(_generator_bn(train, 'bn2')(x), 0.2)
    x = conv(c, use_bias=True, bias_init=binit, name='conv3')(x)
    return nn.sigmoid(x)


class FedHydraGenerator(nn.Module):
  """FedHydra (Bai et al., KDD 2025) §4.1.3: "a fully connected layer that transforms the input
  noise vector into a 2D feature map", then "three upsampling convolutional layers, each consisting
  of batch normalization, LeakyReLU activation, and 2D transposed convolutions", then a Sigmoid.

      z → Dense(nz, 2·ngf·s·s) → reshape (s, s, 2ngf)
      → [BN → LeakyReLU(0.2) → ConvT 2ngf→2ngf]  → [BN → LeakyReLU(0.2) → ConvT 2ngf→ngf]
      → [BN → LeakyReLU(0.2) → ConvT ngf→C] → Sigmoid

  Not stated by the paper, chosen here: the widths (DENSE's 2ngf / ngf, so the two generators
  cost about the same), LeakyReLU slope 0.2 and the initialisation (DENSE's, as the FedHydra
  code builds on DENSE), and the strides. Three ×2 layers cannot reach 28 px from an integer
  map, so the map starts at s = H/4 as DENSE's (7 for 28 px, 8 for 32 px, 2 for the 8 px
  digits), the first two layers upsample ×2 (PyTorch ConvTranspose2d k4 s2 p1 = flax 'SAME'
  k4 s2) and the last keeps the size (k3 s1 p1).
  """

  img_shape: Sequence[int]
  nz: int = 256
  ngf: int = 64
  conv_impl: str = 'auto'  # jfed.models.layers.CONV_IMPLS

  def strides(self) -> Sequence[int]:
    h, w, _ = self.img_shape
    if h % 4 or w % 4:
      raise ValueError(f'FedHydraGenerator needs H, W divisible by 4, got {self.img_shape}')
    return (2, 2, 1)

  @nn.compact
  def __call__(self, z: jnp.ndarray, train: bool = True) -> jnp.ndarray:
    h, w, c = self.img_shape
    strides = self.strides()
    scale = math.prod(strides)
    sh, sw = h // scale, w // scale
    kinit, binit = _normal(0.02), nn.initializers.zeros
    x = nn.Dense(2 * self.ngf * sh * sw, kernel_init=kinit, bias_init=binit, name='fc')(z)
    x = x.reshape(z.shape[0], sh, sw, 2 * self.ngf)
    widths = (2 * self.ngf, self.ngf, c)
    for i, (features, stride) in enumerate(zip(widths, strides)):
      x = nn.leaky_relu(_generator_bn(train, f'bn{i}')(x), 0.2)
      x = ConvTranspose(
        features,
        (4, 4) if stride == 2 else (3, 3),
        strides=(stride, stride),
        kernel_init=kinit,
        bias_init=binit,
        name=f'convt{i}',
        impl=self.conv_impl,
      )(x)
    return nn.sigmoid(x)


GENERATORS = {'dense': DenseGenerator, 'fedhydra': FedHydraGenerator}


def make_generator(
  input_shape: Sequence[int],
  nz: int = 256,
  ngf: int = 64,
  kind: str = 'dense',
  conv_impl: str = 'auto',
) -> nn.Module:
  """Generator for a dataset's `input_shape` (H, W, C): DENSE's (DENSE, Co-Boosting) or FedHydra's
  (Bai et al., KDD 2025, §4.1.3). `conv_impl` (jfed.models.layers.CONV_IMPLS) forces how its
  convolutions compute ('auto': the matmul form on CPU where it is faster).

  Args:
    input_shape: (H, W, C) of the dataset's images.
    nz: Length of the noise vector z.
    ngf: Base channel width.
    kind: 'dense' or 'fedhydra'.
    conv_impl: One of jfed.models.layers.CONV_IMPLS.

  Returns:
    The (uninitialised) generator module.
  """
  if kind not in GENERATORS:
    raise ValueError(f'generator {kind!r}; valid: {sorted(GENERATORS)}')
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f'conv_impl {conv_impl!r}; valid: {CONV_IMPLS}')
  shape = tuple(int(v) for v in input_shape)
  return GENERATORS[kind](img_shape=shape, nz=nz, ngf=ngf, conv_impl=conv_impl)


@functools.lru_cache(maxsize=None)
def _variable_shapes(generator: DenseGenerator):
  z = jax.ShapeDtypeStruct((2, generator.nz), jnp.float32)
  return jax.eval_shape(functools.partial(generator.init, train=False), jax.random.PRNGKey(0), z)


def dense_generator_init(key: jax.Array, generator: DenseGenerator, noise_batch: int = 0):
  """DENSE `reset_model`: fresh generator variables — kernels ~ N(0, 0.02), biases 0,
  BN scale ~ N(1, 0.02), BN bias 0, running mean 0 / var 1. Jittable and vmappable over `key`.

  All random numbers come from ONE `jax.random.normal` draw (XLA:CPU spends ~0.4 s compiling every
  threefry call, so the per-leaf draws of `generator.init` cost seconds per compiled program);
  the distribution is DENSE's, the stream differs from `generator.init`. With `noise_batch` > 0 the
  same draw also yields z ~ N(0, I) of shape [noise_batch, nz], returned as (state, z).

  Args:
    key: PRNG key of the draw.
    generator: The generator module.
    noise_batch: Rows of z to draw too; 0 draws none.

  Returns:
    The generator's ModelState, or (ModelState, z [noise_batch, nz]) when noise_batch > 0.
  """
  shapes = _variable_shapes(generator)
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(shapes['params']))
  random_leaves = [k for k in sorted(flat) if k[-1] in ('kernel', 'scale')]
  sizes = [math.prod(flat[k].shape) for k in random_leaves]
  total = sum(sizes) + noise_batch * generator.nz
  draw = jax.random.normal(key, (total,), jnp.float32)
  params, off = {}, 0
  for k in sorted(flat):
    shape = flat[k].shape
    if k[-1] in ('kernel', 'scale'):
      n = math.prod(shape)
      v = draw[off : off + n].reshape(shape) * 0.02
      off += n
      params[k] = v + 1.0 if k[-1] == 'scale' else v
    else:
      params[k] = jnp.zeros(shape, jnp.float32)
  bs = {
    k: (jnp.ones if k[-1] == 'var' else jnp.zeros)(v.shape, jnp.float32)
    for k, v in flax.traverse_util.flatten_dict(flax.core.unfreeze(shapes['batch_stats'])).items()
  }
  state = ModelState(
    params=flax.traverse_util.unflatten_dict(params),
    batch_stats=flax.traverse_util.unflatten_dict(bs),
  )
  if noise_batch:
    return state, draw[off:].reshape(noise_batch, generator.nz)
  return state
