"""Typed model and training state, single or stacked over a leading client axis."""

import functools
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


def _init(module, input_shape: tuple, key: jax.Array) -> ModelState:
  dummy = jnp.zeros((2, *input_shape), jnp.float32)
  variables = module.init(key, dummy, train=False)
  return ModelState(params=variables['params'], batch_stats=variables.get('batch_stats', {}))


# One compiled program per (architecture, input shape): run op by op, a GoogLeNet init dispatches
# and compiles hundreds of small programs (a minute on XLA:CPU). It runs once, so the backend's
# optimisation passes only cost time: at level 0 its compilation is about 4x faster. The compiler
# options of every program that runs once per model (`jax.jit(..., compiler_options=RUN_ONCE)`;
# JAX refuses them on a jit that may be called under another trace, as the DDPM's init is).
RUN_ONCE = {'xla_backend_optimization_level': 0}
_init_one = jax.jit(_init, static_argnums=(0, 1), compiler_options=RUN_ONCE)
_init_many = jax.jit(
  jax.vmap(_init, in_axes=(None, None, 0)), static_argnums=(0, 1), compiler_options=RUN_ONCE
)


def init_model(module, input_shape: Sequence[int], key: jax.Array) -> ModelState:
  """Fresh variables of one model.

  Args:
    module: The flax module.
    input_shape: Shape of one input (H, W, C).
    key: PRNG key of the init.

  Returns:
    The model's ModelState.
  """
  return _init_one(module, tuple(input_shape), key)


def init_models(module, input_shape, key, num_models: int, same_init: bool = True) -> ModelState:
  """A stacked group of `num_models` models, all from one init (DENSE/FedAvg) or independent.

  Args:
    module: The flax module.
    input_shape: Shape of one input (H, W, C).
    key: PRNG key of the init(s).
    num_models: Models in the group.
    same_init: One init copied to every model; False draws one per model.

  Returns:
    A ModelState whose leaves have a leading model axis [num_models].
  """
  if same_init:
    return replicate(init_model(module, input_shape, key), num_models)
  return _init_many(module, tuple(input_shape), jax.random.split(key, num_models))


def stack(trees: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any) -> list:
  n = jax.tree.leaves(tree)[0].shape[0]
  return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


@functools.partial(jax.jit, static_argnums=1)
def replicate(tree: Any, n: int) -> Any:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


@jax.jit
def take(tree: Any, index) -> Any:
  """Select client(s) `index` (int or index array) from a stacked tree; one compiled program
  per tree structure, not one per leaf shape."""
  return jax.tree.map(lambda x: x[index], tree)


def init_train_state(tx: optax.GradientTransformation, models: ModelState) -> TrainState:
  """Fresh optimiser state for a stacked group.

  PyTorch FL code builds a new optimiser per round.
  """
  first = jax.tree.leaves(models.params)[0]
  # The optimiser state lives where the models do (sharded over the client axis or not).
  sharding = first.sharding if isinstance(first, jax.Array) and first.committed else None
  # A SpecOptimizer equals another of another constant rate: the compiled init, which holds
  # the rate, is cached by its transformation instead.
  tx = getattr(tx, 'transformation', tx)
  return TrainState(model=models, opt_state=_stacked_init(tx, sharding)(models.params))


@functools.lru_cache(maxsize=64)
def _stacked_init(tx: optax.GradientTransformation, sharding: Any) -> Any:
  """One compiled init per (optimiser, placement): run op by op, `vmap(tx.init)` compiled one
  small program per parameter shape and state leaf (about 40 for a CVAE, every round's trainer)."""
  return jax.jit(jax.vmap(tx.init), out_shardings=sharding)


def num_stacked(tree: Any) -> int:
  return jax.tree.leaves(tree)[0].shape[0]


def commit(tree: Any) -> Any:
  """Pins every uncommitted array of `tree` to the device(s) it is on; values are unchanged.

  JAX compiles separate programs for committed and uncommitted arguments. A loop of jitted steps
  whose first call gets fresh arrays (uncommitted) and whose later calls get the outputs of
  steps on committed inputs (client models, teachers) would compile its step twice.
  """

  def pin(x):
    if isinstance(x, jax.Array) and not x.committed:
      return jax.device_put(x, x.sharding)
    return x

  return jax.tree.map(pin, tree)
