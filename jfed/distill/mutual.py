"""Deep mutual learning of heterogeneous models on a shared synthetic set: FedTSA's Stage 2 (FedTSA,
Fan et al., ECCV 2024, §4.4, Eqs. 6–9; the deep mutual learning of Zhang et al., CVPR 2018, with the
mean of all models' logits as the target).

Per batch, every model computes its logits in train mode from the same parameters (before any of
them updates, as a PyTorch loop `outputs = [m(x) for m in models]` followed by one step per model
does); the consensus z̄ is their mean (Eq. 7), held fixed; then each model takes one optimiser
step on `mutual_learning_loss` towards it. BatchNorm normalises with each batch's statistics;
the models' running statistics are kept as they came in unless `keep_running_stats` is False
(then each step's running-average update on the shared images is kept). Models of different
widths are different compiled programs: one jitted logits function and one jitted step per
model, each compiled once per run.
"""

from typing import List, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfed.data.batches import epoch_order
from jfed.distill.losses import consensus_logits, mutual_learning_loss
from jfed.engine.state import ModelState, TrainState


class MutualLearningConfig(NamedTuple):
  temperature: float = 5.0  # T of Eq. 6 (the paper's default)
  kl_weight: float = 1.0  # α of Eq. 9; 1 = KL only (the paper's default)
  t_squared: bool = False  # the paper writes no T² factor
  # True: the forward passes use each batch's statistics (train mode) but the models' BatchNorm
  # running statistics stay as they came in; False: each step's running-average update is kept
  # (recalibration on the shared images).
  keep_running_stats: bool = True


class _Member:
  """One model's jitted train-mode logits and its jitted optimiser step."""

  def __init__(self, module, tx: optax.GradientTransformation, cfg: MutualLearningConfig):
    self.module, self.tx, self.cfg = module, tx, cfg
    self.logits = jax.jit(self._logits)
    self.step = jax.jit(self._step)

  def _forward(self, params, batch_stats, x, mask):
    logits, updates = self.module.apply(
      {'params': params, 'batch_stats': batch_stats},
      x,
      train=True,
      mask=mask,
      mutable=['batch_stats'],
    )
    return logits, updates.get('batch_stats', batch_stats)

  def _logits(self, model: ModelState, x, mask):
    return self._forward(model.params, model.batch_stats, x, mask)[0]

  def _step(self, ts: TrainState, x, y, mask, consensus):
    weights = mask.astype(jnp.float32)

    def objective(params):
      logits, stats = self._forward(params, ts.model.batch_stats, x, mask)
      loss = mutual_learning_loss(
        logits,
        consensus,
        self.cfg.temperature,
        y,
        self.cfg.kl_weight,
        weights,
        self.cfg.t_squared,
      )
      return loss, stats

    (loss, stats), grads = jax.value_and_grad(objective, has_aux=True)(ts.model.params)
    updates, opt_state = self.tx.update(grads, ts.opt_state, ts.model.params)
    if self.cfg.keep_running_stats:
      stats = ts.model.batch_stats
    return TrainState(
      ModelState(optax.apply_updates(ts.model.params, updates), stats), opt_state
    ), loss


class MutualLearner:
  """Stage 2 over a fixed list of (heterogeneous) modules; build once per run."""

  def __init__(
    self,
    modules: Sequence,
    tx: optax.GradientTransformation,
    cfg: MutualLearningConfig = MutualLearningConfig(),
  ):
    self.members = [_Member(m, tx, cfg) for m in modules]
    self.tx = tx

  def init(self, models: Sequence[ModelState]) -> List[TrainState]:
    """A fresh optimiser state per model (a new Stage 2 every round)."""
    return [TrainState(m, self.tx.init(m.params)) for m in models]

  def epoch(
    self,
    states: Sequence[TrainState],
    x: jnp.ndarray,
    y: jnp.ndarray,
    batch: int,
    rng: np.random.Generator,
  ) -> Tuple[List[TrainState], np.ndarray]:
    """One shuffled epoch over (x, y) (the last batch padded and masked); returns the new states
    and each model's mean batch loss [M].

    Args:
      states: The M models' TrainStates.
      x: The shared synthetic images [N, H, W, C].
      y: Their labels [N].
      batch: Batch size.
      rng: Host generator of the shuffle.

    Returns:
      (new TrainStates, mean batch loss of each model [M]).
    """
    states = list(states)
    idx, mask = epoch_order(int(y.shape[0]), batch, rng)
    losses = []
    for b in range(len(idx)):
      xb, yb = x[jnp.asarray(idx[b])], y[jnp.asarray(idx[b])]
      mb = jnp.asarray(mask[b])
      target = consensus_logits([m.logits(s.model, xb, mb) for m, s in zip(self.members, states)])
      row = []
      for r, member in enumerate(self.members):
        states[r], loss = member.step(states[r], xb, yb, mb, target)
        row.append(loss)
      losses.append(row)
    return states, np.mean(np.asarray(losses), axis=0)
