"""Batched evaluation of one model or many models (a stacked group) at once."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jfed.engine.state import ModelState
from jfed.engine.training import resolve_strategy


def _pad_batches(x: np.ndarray, batch_size: int):
  n = x.shape[0]
  batches = max(1, -(-n // batch_size))
  pad = batches * batch_size - n
  xp = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x
  return xp.reshape(batches, batch_size, *x.shape[1:]), n


class Evaluator:
  """Jitted eval-mode logits for one architecture; reuse it so it compiles once.

  A stacked group is evaluated one batch of examples at a time, every model of the group in one
  call: with strategy `loop` (the CPU default) as a `lax.map` over the models, so each model's
  convolutions stay ordinary ones (client-batched convolutions are several times slower on
  XLA:CPU: experiments/bench/client_training.py, evaluation table), otherwise vmapped.
  """

  def __init__(self, module, batch_size: int = 1000, strategy: str = 'auto'):
    self.module = module
    self.batch_size = batch_size
    self.strategy = resolve_strategy(strategy)
    self._logits = jax.jit(self._apply)
    if self.strategy == 'loop':
      self._group_logits = jax.jit(lambda models, x: lax.map(lambda m: self._apply(m, x), models))
    else:
      self._group_logits = jax.jit(jax.vmap(self._apply, in_axes=(0, None)))

  def _apply(self, model: ModelState, x):
    return self.module.apply(model.variables(), x, train=False)

  def _batches(self, x: np.ndarray):
    # The calls queue up without waiting for each other; results come back once, at the end.
    xb, n = _pad_batches(np.asarray(x), self.batch_size)
    return (jnp.asarray(b) for b in xb), n

  def logits(self, model: ModelState, x: np.ndarray) -> np.ndarray:
    """Logits [N, C] of a single model."""
    xb, n = self._batches(x)
    out = [self._logits(model, b) for b in xb]
    return np.concatenate(jax.device_get(out))[:n]

  def group_logits(self, models: ModelState, x: np.ndarray) -> np.ndarray:
    """Logits [M, N, C] of every model of a stacked group."""
    xb, n = self._batches(x)
    out = [self._group_logits(models, b) for b in xb]
    return np.concatenate(jax.device_get(out), axis=1)[:, :n]

  def accuracy(self, model: ModelState, x, y) -> float:
    return float(np.mean(np.argmax(self.logits(model, x), -1) == np.asarray(y)))

  def group_accuracy(self, models: ModelState, x, y) -> np.ndarray:
    return np.mean(np.argmax(self.group_logits(models, x), -1) == np.asarray(y)[None], axis=1)
