"""Typed model and training state, single or stacked over a leading client axis."""

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax


class ModelState(NamedTuple):
  """Variables of one model, or of a group stacked along a leading client axis."""

  params: Any
  batch_stats: Any  # {} for models without BatchNorm.

  def variables(self):
    return {'params': self.params, 'batch_stats': self.batch_stats}


class TrainState(NamedTuple):
  model: ModelState
  opt_state: Any


def init_model(module, input_shape: Sequence[int], key: jax.Array) -> ModelState:
  dummy = jnp.zeros((2, *input_shape), jnp.float32)
  variables = module.init(key, dummy, train=False)
  return ModelState(params=variables['params'], batch_stats=variables.get('batch_stats', {}))


def init_models(module, input_shape, key, num_models: int, same_init: bool = True) -> ModelState:
  """A stacked group of `num_models` models, all from one init (DENSE/FedAvg) or independent."""
  if same_init:
    return replicate(init_model(module, input_shape, key), num_models)
  keys = jax.random.split(key, num_models)
  return stack([init_model(module, input_shape, k) for k in keys])


def stack(trees: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any) -> list:
  n = jax.tree.leaves(tree)[0].shape[0]
  return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


def replicate(tree: Any, n: int) -> Any:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def take(tree: Any, index) -> Any:
  """Select client(s) `index` (int or index array) from a stacked tree."""
  return jax.tree.map(lambda x: x[index], tree)


def init_train_state(tx: optax.GradientTransformation, models: ModelState) -> TrainState:
  """Fresh optimiser state for a stacked group.

  PyTorch FL code builds a new optimiser per round.
  """
  return TrainState(model=models, opt_state=jax.vmap(tx.init)(models.params))


def num_stacked(tree: Any) -> int:
  return jax.tree.leaves(tree)[0].shape[0]
