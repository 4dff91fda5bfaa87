"""Batched evaluation of one model or many models (a stacked group) at once."""

import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jfed.engine.state import ModelState
from jfed.engine.training import resolve_strategy
from jfed.models.layers import TORCH_BN_MOMENTUM, apply_with_features


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
      self._group_outputs = jax.jit(
        lambda models, x: lax.map(lambda m: self._apply_features(m, x), models)
      )
    else:
      self._group_logits = jax.jit(jax.vmap(self._apply, in_axes=(0, None)))
      self._group_outputs = jax.jit(jax.vmap(self._apply_features, in_axes=(0, None)))

  def _apply(self, model: ModelState, x):
    return self.module.apply(model.variables(), x, train=False)

  def _apply_features(self, model: ModelState, x):
    logits, features, _ = apply_with_features(self.module, model.variables(), x)
    return logits, features

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

  def group_outputs(self, models: ModelState, x: np.ndarray):
    """Logits [M, N, C] and penultimate features [M, N, D] of every model of a stacked group
    (models that sow their features: `jfed.models.layers.apply_with_features`)."""
    xb, n = self._batches(x)
    out = jax.device_get([self._group_outputs(models, b) for b in xb])
    logits = np.concatenate([o[0] for o in out], axis=1)[:, :n]
    return logits, np.concatenate([o[1] for o in out], axis=1)[:, :n]

  def accuracy(self, model: ModelState, x, y) -> float:
    """Top-1 accuracy of one model.

    Args:
      model: The model's state.
      x: Images [N, H, W, C].
      y: Labels [N].

    Returns:
      The fraction of correct predictions.
    """
    return float(np.mean(np.argmax(self.logits(model, x), -1) == np.asarray(y)))

  def group_accuracy(self, models: ModelState, x, y) -> np.ndarray:
    """Top-1 accuracy of each model of a stacked group.

    Args:
      models: The group's states, stacked over a leading model axis [M].
      x: Images [N, H, W, C].
      y: Labels [N].

    Returns:
      Accuracies [M].
    """
    return np.mean(np.argmax(self.group_logits(models, x), -1) == np.asarray(y)[None], axis=1)


@functools.lru_cache(maxsize=8)
def _evaluator(module, batch_size: int) -> 'Evaluator':
  """One Evaluator (and so one compiled program) per architecture and batch size."""
  return Evaluator(module, batch_size)


class TrainedModel(NamedTuple):
  """A run's server model: its flax module and variables (`jfed.run(...).model`).

  `logits`, `predict` and `accuracy` evaluate it in eval mode (BatchNorm's running statistics),
  as the run scored it; `module.apply(model.state.variables(), x, train=False)` is the same.
  """

  module: Any
  state: ModelState

  def logits(self, x, batch_size: int = 1000) -> np.ndarray:
    """Logits [N, C] of images `x` [N, H, W, C] (in [0, 1], as the datasets hold them)."""
    return _evaluator(self.module, batch_size).logits(self.state, x)

  def predict(self, x, batch_size: int = 1000) -> np.ndarray:
    """Predicted labels [N]."""
    return np.argmax(self.logits(x, batch_size), -1)

  def accuracy(self, x, y, batch_size: int = 1000) -> float:
    """Top-1 accuracy.

    Args:
      x: Images [N, H, W, C].
      y: Labels [N].
      batch_size: Images per evaluation call.

    Returns:
      The fraction of correct predictions.
    """
    return float(np.mean(self.predict(x, batch_size) == np.asarray(y)))


class BatchNormStatistics:
  """HeteroFL's static BatchNorm statistics (sBN; diaoenmao/HeteroFL:src/train_classifier_fed.py
  `stats`): a model trained without running statistics gets, for evaluation, the cumulative
  statistics of a train-mode pass over data, i.e. PyTorch's `momentum=None`: the unweighted mean
  over batches of each batch's statistics (a last partial batch counts as one batch).

  Each batch runs in train mode from zero statistics, so the updated statistics are
  (1 - momentum) times the batch's own (flax's update rule with the zoo's PyTorch momentum,
  `jfed.models.layers.TORCH_BN_MOMENTUM`). Flax's batch variance is the biased one (PyTorch's
  running variance uses the unbiased one: a factor n/(n-1), n = batch x pixels). Compiled once
  per architecture; reuse the instance.
  """

  def __init__(self, module, batch_size: int):
    self.module = module
    self.batch_size = int(batch_size)
    self._scale = 1.0 / (1.0 - TORCH_BN_MOMENTUM)
    self._batch = jax.jit(self._batch_stats)

  def _batch_stats(self, params, total, x, mask, weight):
    zeros = jax.tree.map(jnp.zeros_like, total)
    _, updates = self.module.apply(
      {'params': params, 'batch_stats': zeros}, x, train=True, mask=mask, mutable=['batch_stats']
    )
    return jax.tree.map(lambda t, s: t + weight * s, total, updates['batch_stats'])

  def __call__(self, model: ModelState, x: np.ndarray) -> dict:
    """The batch_stats of `model` for evaluation, computed on `x`."""
    if not model.batch_stats:
      return model.batch_stats
    xb, n = _pad_batches(np.asarray(x), self.batch_size)
    total = jax.tree.map(jnp.zeros_like, model.batch_stats)
    weight = jnp.float32(self._scale / len(xb))
    for i, b in enumerate(xb):
      mask = np.arange(i * self.batch_size, (i + 1) * self.batch_size) < n
      total = self._batch(model.params, total, jnp.asarray(b), jnp.asarray(mask), weight)
    return total
