"""Training a server classifier on a fixed synthetic set (FedMHO's knowledge fusion, FedCVAE's
server classifier).

One epoch visits the set in a seeded random order in batches of `batch` (the last one partial,
its padding masked out), one jitted step per batch that minimises FedMHO's Eq. 7
(`jfed.distill.knowledge_fusion_loss`): λ·CE + (1 − λ)·KL towards fixed teacher logits, or the
CE alone when there is no teacher (FedMHO, FedCVAE). The teachers' logits on the synthetic set
never change (no augmentation), so they are computed once per run (`SyntheticSet.teacher`) rather
than at every step as the reference does.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfed.data.batches import epoch_order
from jfed.distill.losses import knowledge_fusion_loss
from jfed.engine import ModelState, TrainState


class SyntheticSet(NamedTuple):
  """The server's training set: images, labels and the teachers' logits (None: no teacher)."""

  x: Any  # [N, H, W, C] float32 in [0, 1]
  y: Any  # [N] int32
  teacher: Optional[Any]  # [N, C] float32 or None


class FusionTrainer:
  """The jitted step of one server classifier and optimiser, compiled once per run."""

  def __init__(
    self,
    module,
    tx: optax.GradientTransformation,
    lam: float,
    kl_reduction: str = 'mean',
  ):
    self.module, self.tx, self.lam, self.kl_reduction = module, tx, float(lam), kl_reduction
    self._step = jax.jit(self._train_step)

  def init(self, model: ModelState) -> TrainState:
    return TrainState(model, self.tx.init(model.params))

  def _train_step(self, ts: TrainState, data: SyntheticSet, idx, mask, key):
    x, y = data.x[idx], data.y[idx]
    teacher = None if data.teacher is None else data.teacher[idx]
    weights = mask.astype(jnp.float32)

    def objective(params):
      logits, updates = self.module.apply(
        {'params': params, 'batch_stats': ts.model.batch_stats},
        x,
        train=True,
        mask=mask,
        mutable=['batch_stats'],
        rngs={'dropout': key},
      )
      loss = knowledge_fusion_loss(logits, y, teacher, self.lam, weights, self.kl_reduction)
      return loss, updates.get('batch_stats', ts.model.batch_stats)

    (loss, stats), grads = jax.value_and_grad(objective, has_aux=True)(ts.model.params)
    updates, opt_state = self.tx.update(grads, ts.opt_state, ts.model.params)
    return TrainState(
      ModelState(optax.apply_updates(ts.model.params, updates), stats), opt_state
    ), loss

  def epoch(
    self, ts: TrainState, data: SyntheticSet, batch: int, rng: np.random.Generator, key: jax.Array
  ):
    """One epoch over `data`; returns (new state, mean batch loss).

    Args:
      ts: The global model's TrainState.
      data: The server's synthetic training set.
      batch: Batch size.
      rng: Host generator of the shuffle.
      key: PRNG key of the epoch (one fold per batch).
    """
    idx, mask = epoch_order(int(data.y.shape[0]), batch, rng)
    losses = []
    for b in range(len(idx)):
      ts, loss = self._step(
        ts, data, jnp.asarray(idx[b]), jnp.asarray(mask[b]), jax.random.fold_in(key, b)
      )
      losses.append(loss)
    return ts, float(np.mean(np.asarray(losses)))
