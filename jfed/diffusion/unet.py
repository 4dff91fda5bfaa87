"""The noise-prediction network of FedTSA's class-conditional DDPM: a small U-Net.

Architecture after Ho et al. (2020) scaled down to what trains in minutes on a CPU: residual
blocks of GroupNorm + SiLU + 3x3 conv with the timestep and class embedding added between the
two convolutions, one block per resolution on the way down and up (skip connections by
concatenation), stride-2 convolution down, nearest-neighbour upsampling + conv up. There is no
self-attention: at 8x8 (digits) and 28x28 (MNIST family) the receptive field of the two-level
network already covers the image, and attention would dominate the CPU cost.

The class label `num_classes` is the "no class" token of classifier-free guidance (Ho &
Salimans, 2022): the network is trained with labels dropped to it, and sampling mixes the
conditional and unconditional predictions.

Any image size works: the input is padded (reflect) to a multiple of 2**(levels - 1) and the
output cropped back, so 8, 28 and 32 pixel images share the code. Two levels by default: on
XLA:CPU a 3x3 convolution's cost grows with width squared, and the digits DDPM at 16 channels and
two levels already makes samples a classifier of real digits labels 99 % right.
"""

import math
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


def timestep_embedding(t: jnp.ndarray, dim: int) -> jnp.ndarray:
  """Sinusoidal embedding of integer timesteps [B] -> [B, dim] (Vaswani et al., as in DDPM)."""
  half = dim // 2
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  args = t.astype(jnp.float32)[:, None] * freqs[None, :]
  return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


def _groups(channels: int) -> int:
  for g in (8, 4, 2):
    if channels % g == 0:
      return g
  return 1


class ResBlock(nn.Module):
  channels: int

  @nn.compact
  def __call__(self, x, emb):
    h = nn.silu(nn.GroupNorm(num_groups=_groups(x.shape[-1]))(x))
    h = nn.Conv(self.channels, (3, 3))(h)
    h = h + nn.Dense(self.channels)(nn.silu(emb))[:, None, None, :]
    h = nn.silu(nn.GroupNorm(num_groups=_groups(self.channels))(h))
    h = nn.Conv(self.channels, (3, 3))(h)
    if x.shape[-1] != self.channels:
      x = nn.Conv(self.channels, (1, 1))(x)
    return x + h


class UNet(nn.Module):
  """eps_theta(x_t, t, y): predicts the noise in x_t ([B, H, W, C] in about [-1, 1])."""

  num_classes: int  # labels 0..num_classes-1; num_classes = unconditional
  base_channels: int = 32
  channel_mults: Sequence[int] = (1, 2)

  @nn.compact
  def __call__(self, x, t, y):
    height, width, out_channels = x.shape[1], x.shape[2], x.shape[3]
    multiple = 2 ** (len(self.channel_mults) - 1)
    pad_h, pad_w = (-height) % multiple, (-width) % multiple
    if pad_h or pad_w:
      x = jnp.pad(x, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode='reflect')

    dim = 4 * self.base_channels
    emb = timestep_embedding(t, self.base_channels)
    emb = nn.Dense(dim)(nn.silu(nn.Dense(dim)(emb)))
    emb = emb + nn.Embed(self.num_classes + 1, dim)(y)

    h = nn.Conv(self.base_channels, (3, 3))(x)
    skips = [h]
    for level, mult in enumerate(self.channel_mults):
      h = ResBlock(self.base_channels * mult)(h, emb)
      skips.append(h)
      if level < len(self.channel_mults) - 1:
        h = nn.Conv(h.shape[-1], (3, 3), strides=(2, 2))(h)
    h = ResBlock(h.shape[-1])(h, emb)
    for level, mult in reversed(list(enumerate(self.channel_mults))):
      h = ResBlock(self.base_channels * mult)(jnp.concatenate([h, skips.pop()], -1), emb)
      if level > 0:
        h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)
        h = nn.Conv(h.shape[-1], (3, 3))(h)
    h = ResBlock(self.base_channels)(jnp.concatenate([h, skips.pop()], -1), emb)
    h = nn.silu(nn.GroupNorm(num_groups=_groups(self.base_channels))(h))
    # Zero-initialised output: the untrained network predicts eps = 0, a stable start.
    out = nn.Conv(out_channels, (3, 3), kernel_init=nn.initializers.zeros)(h)
    return out[:, :height, :width, :]
