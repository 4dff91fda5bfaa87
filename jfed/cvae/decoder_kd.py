"""FedCVAE-KD's server decoder distillation (FedCVAE, Heinbaugh et al., ICLR 2023;
`github.com/ceh-2000/fed_cvae`, `servers/server_fed_cvae_kd.py:distill_user_decoders`).

The users' decoders (eval mode) decode (z, y) pairs into targets sigmoid(x̂); the server's decoder
is trained, in train mode, to reconstruct each target from the same (z, y) with the CVAE's
reconstruction loss — the BCE between sigmoid(server logits) and the target summed over pixels,
averaged over the batch (`reconstruction_loss` for one-channel images) — with Adam, in shuffled
batches (the last one partial, its padding masked out), for a number of epochs. One jitted step
per batch, compiled once per run.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfed.cvae.models import CVAE, to_image_shape
from jfed.data.batches import epoch_order
from jfed.engine import ModelState, TrainState


class DecoderTargets(NamedTuple):
  """The distillation set: latents, labels and the user decoders' images in [0, 1]."""

  z: Any  # [N, latent] float32
  y: Any  # [N] int32
  x: Any  # [N, H, W, C] float32


def decoder_recon_loss(logits: jnp.ndarray, target: jnp.ndarray, weights: jnp.ndarray):
  """Σ_pixels BCE(sigmoid(logits), target), averaged over the real samples (weights 1).

  Args:
    logits: Decoder output logits [B, H, W, C].
    target: The user decoders' images [B, H, W, C] in [0, 1].
    weights: [B], 1 real and 0 padding.

  Returns:
    The scalar loss.
  """
  axes = tuple(range(1, target.ndim))
  per_sample = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, target), axis=axes)
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


class DecoderDistiller:
  """The jitted step of one server decoder (the `decoder` part of a CVAE) and its optimiser."""

  def __init__(self, module: CVAE, tx: optax.GradientTransformation):
    self.module, self.tx = module, tx
    self._step = jax.jit(self._train_step)

  def init(self, decoder: ModelState) -> TrainState:
    """`decoder`: ModelState(params of the CVAE's decoder, its batch_stats or {})."""
    return TrainState(decoder, self.tx.init(decoder.params))

  def _apply(self, decoder: ModelState, z, y, train: bool, mask=None):
    """(logits, new batch_stats) of the decoder; BatchNorm statistics (of the real samples,
    `mask`) update in train mode."""
    if not decoder.batch_stats:  # BN-free decoders (CVAE-small, CVAE-large)
      variables = {'params': {'decoder': decoder.params}}
      return self.module.apply(variables, z, y, method='decode'), decoder.batch_stats
    variables = {
      'params': {'decoder': decoder.params},
      'batch_stats': {'decoder': decoder.batch_stats},
    }
    if not train:
      return self.module.apply(variables, z, y, train=False, method='decode'), decoder.batch_stats
    logits, updates = self.module.apply(
      variables, z, y, train=True, mask=mask, method='decode', mutable=['batch_stats']
    )
    return logits, updates['batch_stats']['decoder']

  def _train_step(self, ts: TrainState, data: DecoderTargets, idx, mask):
    z, y, x = data.z[idx], data.y[idx], data.x[idx]
    weights = mask.astype(jnp.float32)

    def objective(params):
      model = ModelState(params, ts.model.batch_stats)
      logits, stats = self._apply(model, z, y, train=True, mask=mask)
      return decoder_recon_loss(logits, x, weights), stats

    (loss, stats), grads = jax.value_and_grad(objective, has_aux=True)(ts.model.params)
    updates, opt_state = self.tx.update(grads, ts.opt_state, ts.model.params)
    return TrainState(
      ModelState(optax.apply_updates(ts.model.params, updates), stats), opt_state
    ), loss

  def epoch(self, ts: TrainState, data: DecoderTargets, batch: int, rng: np.random.Generator):
    """One shuffled epoch over `data`; returns (new state, mean batch loss).

    Args:
      ts: The server decoder's TrainState.
      data: The distillation set.
      batch: Batch size.
      rng: Host generator of the shuffle.
    """
    idx, mask = epoch_order(int(data.y.shape[0]), batch, rng)
    losses = []
    for b in range(len(idx)):
      ts, loss = self._step(ts, data, jnp.asarray(idx[b]), jnp.asarray(mask[b]))
      losses.append(loss)
    return ts, float(np.mean(np.asarray(losses)))

  def decode(self, decoder: ModelState, z, y) -> jnp.ndarray:
    """Images in [0, 1] from the server decoder in eval mode, at the dataset's image size.

    Args:
      decoder: The server decoder's state.
      z: Latents [B, latent].
      y: Labels [B].

    Returns:
      Images [B, H, W, C] in [0, 1].
    """
    logits, _ = self._apply(decoder, z, y, train=False)
    return to_image_shape(self.module, jax.nn.sigmoid(logits))
