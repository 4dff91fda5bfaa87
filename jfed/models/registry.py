"""Model registry: `get_model(name, num_classes, input_shape, **kw) -> flax.linen.Module`.

A registered builder is a callable `builder(num_classes, input_shape, **kw) -> nn.Module`
(a function or a module class whose fields include `num_classes`; see `register_model`).
Every model maps NHWC float32 images to logits: `__call__(x, train=False, mask=None)`.
"""

from typing import Any, Callable, Dict, List, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np

_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
  """Decorator registering `builder(num_classes, input_shape, **kw) -> nn.Module` under `name`."""
  key = name.lower()

  def wrap(builder):
    if key in _REGISTRY:
      raise ValueError(f'Model {name!r} is already registered')
    _REGISTRY[key] = builder
    return builder

  return wrap


def available_models() -> List[str]:
  _ensure_zoo_loaded()
  return sorted(_REGISTRY)


def _validate_input_shape(input_shape: Sequence[int]) -> Tuple[int, int, int]:
  shape = tuple(int(d) for d in input_shape)
  if len(shape) != 3 or min(shape) < 1:
    raise ValueError(f'input_shape must be (H, W, C) with positive sizes, got {input_shape!r}')
  return shape


def get_model(name: str, num_classes: int, input_shape: Sequence[int], **kw: Any) -> nn.Module:
  """Build the model registered as `name` for `num_classes` classes and (H, W, C) inputs.

  Args:
    name: The registered model name ('mlp', 'resnet18', ...).
    num_classes: Number of output classes.
    input_shape: The (H, W, C) shape of one input image.
    **kw: The model's own options (width_mult, embed_dim, ...).

  Returns:
    The (unbound) flax module.
  """
  _ensure_zoo_loaded()
  key = str(name).lower()
  if key not in _REGISTRY:
    raise ValueError(f'Unknown model {name!r}; valid names: {", ".join(sorted(_REGISTRY))}')
  if int(num_classes) < 1:
    raise ValueError(f'num_classes must be >= 1, got {num_classes!r}')
  shape = _validate_input_shape(input_shape)
  return _REGISTRY[key](num_classes=int(num_classes), input_shape=shape, **kw)


def param_count(params: Any) -> int:
  """Number of scalars in a parameter pytree (pass `variables['params']`: BN running stats,
  which live in 'batch_stats', are then excluded, as in PyTorch's `parameters()`)."""
  return int(sum(np.prod(np.shape(leaf), dtype=np.int64) for leaf in jax.tree.leaves(params)))


def _ensure_zoo_loaded():
  # The model files register themselves on import; importing them here (lazily, to avoid an
  # import cycle) makes `get_model` work even when only `jfed.models.registry` was imported.
  from jfed.models import cnn, googlenet, resnet, vgg  # noqa: F401
