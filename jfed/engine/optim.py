"""The one optimiser builder (PyTorch semantics) and the learning-rate schedules it knows.

Client training (`GroupTrainer`: `build_optimizer(optimizer_spec(config.optimizer))`) and the
servers' distillation students (`jfed.distill.kd`) build their optimisers here and name their
schedules from the one set `SCHEDULES`:

  'constant'       the learning rate throughout;
  'cosine'         CosineAnnealingLR stepped every optimiser step: T_max = total_steps;
  'cosine_epochs'  CosineAnnealingLR stepped once per epoch: T_max = epochs.

The learning rate is an injected hyperparameter (`optax.inject_hyperparams`): it lives in the
optimiser state, so it is checkpointed with it and can be read back for the metrics. Built with
`total_steps` (and `epochs` for 'cosine_epochs'), the rate follows the schedule from the
optimiser's own step count. A caller whose epochs differ in length (a student distilled on a
growing pool) builds with 'constant' and sets every step's rate itself:
`set_learning_rate(opt_state, scheduled_lr(schedule, lr, step, total_steps, epoch, epochs))`.
"""

import math
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import optax

from jfed import typed_config as tc
from jfed.errors import ConfigError

OPTIMIZERS = ('sgd', 'adam')
SCHEDULES = ('constant', 'cosine', 'cosine_epochs')


class OptimizerSpec(NamedTuple):
  """A static (hashable) description of an optimiser: `make_optimizer`'s arguments."""

  name: str
  lr: float
  momentum: float = 0.0
  weight_decay: float = 0.0
  grad_clip: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  schedule: str = 'constant'
  # A user's own optax transformation (`jfed.run(..., client_optimizer=...)`): used as given,
  # in place of every field above; it is compared and hashed by identity.
  transform: Optional[optax.GradientTransformation] = None


def optimizer_spec(section: Any, where: str = 'optimizer') -> OptimizerSpec:
  """The `OptimizerSpec` of a config section (`config.optimizer`): `name` and `lr` required, the
  other fields optional with the spec's defaults (torch's: no momentum, decay or clipping,
  Adam's betas 0.9 / 0.999, a constant rate). Keys the spec does not know are ignored."""
  if section is None or not hasattr(section, 'keys'):
    raise ConfigError(f'config has no section {where!r}')
  hints = {'name': str, 'schedule': str}
  values = {}
  for name in OptimizerSpec._fields:
    if name == 'transform':  # not a config key: only `jfed.run` sets it
      continue
    if name in section:
      values[name] = tc.convert(section[name], hints.get(name, float), f'{where}.{name}')
    elif name not in OptimizerSpec._field_defaults:
      raise ConfigError(f'{where}.{name} is missing from the config')
  return OptimizerSpec(**values)


def check_schedule(schedule: str) -> None:
  if schedule not in SCHEDULES:
    raise ValueError(f'Unknown lr schedule {schedule!r}; valid: {", ".join(SCHEDULES)}')


def scheduled_lr(
  schedule: str, lr: float, step: int = 0, total_steps: int = 0, epoch: int = 0, epochs: int = 0
) -> float:
  """The learning rate after `step` of `total_steps` steps, in epoch `epoch` (0-based) of
  `epochs`: 'constant', 'cosine' (per step) or 'cosine_epochs' (per epoch).

  Args:
    schedule: 'constant', 'cosine' (per step) or 'cosine_epochs' (per epoch).
    lr: The base learning rate.
    step: Optimizer steps taken so far.
    total_steps: The steps of the whole schedule ('cosine').
    epoch: The current epoch, from 0 ('cosine_epochs').
    epochs: The epochs of the whole schedule ('cosine_epochs').

  Returns:
    The learning rate.
  """
  check_schedule(schedule)
  if schedule == 'constant':
    return float(lr)
  if schedule == 'cosine':
    if total_steps <= 0:
      raise ValueError("the 'cosine' schedule needs total_steps > 0")
    return 0.5 * lr * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))
  if epochs <= 0:
    raise ValueError("the 'cosine_epochs' schedule needs epochs > 0")
  return 0.5 * lr * (1.0 + math.cos(math.pi * min(epoch, epochs) / epochs))


def _schedule_fn(schedule: str, lr: float, total_steps: int, epochs: int):
  """The schedule as a function of the optimiser's step count (a float for 'constant')."""
  check_schedule(schedule)
  if schedule == 'constant':
    return lr
  if total_steps <= 0:
    raise ValueError(f'a {schedule!r} schedule needs total_steps > 0')
  if schedule == 'cosine':
    return optax.cosine_decay_schedule(lr, total_steps)
  if epochs <= 0:
    raise ValueError("the 'cosine_epochs' schedule needs epochs > 0")

  def per_epoch(count):
    epoch = jnp.minimum(count * epochs // total_steps, epochs)
    return 0.5 * lr * (1.0 + jnp.cos(jnp.pi * epoch / epochs))

  return per_epoch


def make_optimizer(
  name: str,
  lr: float,
  momentum: float = 0.0,
  weight_decay: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  schedule: str = 'constant',
  total_steps: int = 0,
  grad_clip: float = 0.0,
  epochs: int = 0,
) -> optax.GradientTransformation:
  """torch.optim.SGD / Adam: the gradient norm clipped (clip_grad_norm_, when grad_clip > 0),
  weight decay added to the gradient, then momentum / Adam; lr per `schedule` (module doc).

  Args:
    name: 'sgd' or 'adam'.
    lr: The base learning rate.
    momentum: SGD momentum.
    weight_decay: L2 weight decay, added to the gradient.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    schedule: The learning-rate schedule (see `scheduled_lr`).
    total_steps: The steps of the whole schedule ('cosine').
    grad_clip: The maximal global gradient norm; 0 for no clipping.
    epochs: The epochs of the whole schedule ('cosine_epochs').

  Returns:
    The optax transformation.
  """
  if name not in OPTIMIZERS:
    raise ValueError(f'Unknown optimizer {name!r}; valid: {", ".join(OPTIMIZERS)}')

  def build(learning_rate):
    parts = []
    if grad_clip:
      parts.append(optax.clip_by_global_norm(grad_clip))
    if weight_decay:
      parts.append(optax.add_decayed_weights(weight_decay))
    if name == 'sgd':
      parts.append(optax.sgd(learning_rate, momentum=momentum or None))
    else:
      parts.append(optax.adam(learning_rate, b1=b1, b2=b2))
    return parts[0] if len(parts) == 1 else optax.chain(*parts)

  return optax.inject_hyperparams(build)(
    learning_rate=_schedule_fn(schedule, lr, total_steps, epochs)
  )


def build_optimizer(
  spec: OptimizerSpec, total_steps: int = 0, epochs: int = 0
) -> optax.GradientTransformation:
  """The optimiser of `spec`, every field of it (clipping, Adam's betas, the schedule) applied.

  Args:
    spec: the optimiser (`optimizer_spec` reads one from a config section).
    total_steps: the optimiser steps a 'cosine' or 'cosine_epochs' schedule spans.
    epochs: the epochs a 'cosine_epochs' schedule spans.

  Returns:
    The optax transformation, its learning rate an injected hyperparameter.
  """
  if spec.transform is not None:
    return spec.transform
  return make_optimizer(
    spec.name,
    spec.lr,
    momentum=spec.momentum,
    weight_decay=spec.weight_decay,
    b1=spec.b1,
    b2=spec.b2,
    schedule=spec.schedule,
    total_steps=total_steps,
    grad_clip=spec.grad_clip,
    epochs=epochs,
  )


def set_learning_rate(opt_state: Any, lr) -> Any:
  """`opt_state` of a 'constant' optimiser with its learning rate replaced (jit-safe)."""
  return opt_state._replace(
    hyperparams={**opt_state.hyperparams, 'learning_rate': jnp.asarray(lr, jnp.float32)}
  )


def learning_rate_of(opt_state: Any) -> Any:
  return opt_state.hyperparams['learning_rate']


class SpecOptimizer:
  """`build_optimizer(spec, total_steps)` as an optax GradientTransformation (`init`/`update`)
  that is equal to, and hashes as, any other whose update program is the same: the spec with a
  constant learning rate left out (the rate lives in the optimiser state, `inject_hyperparams`,
  so every rate runs one program) and the steps a schedule spans. A compiled program that takes
  it as a static argument (`jfed.engine.training.ClientProgram`) thus serves every run that
  differs from another only in a constant rate: jit's own cache shares it, no cache of ours."""

  def __init__(self, spec: OptimizerSpec, total_steps: int = 0):
    self.spec, self.total_steps = spec, int(total_steps)
    # the optax transformation itself, equal only to itself: what a cache keyed by the
    # optimiser's numbers (jfed.engine.state's compiled init) must be keyed by
    self.transformation = build_optimizer(spec, self.total_steps)

  def _program(self):
    rate_in_state = self.spec.schedule == 'constant' and self.spec.transform is None
    return (self.spec._replace(lr=0.0) if rate_in_state else self.spec, self.total_steps)

  def __hash__(self) -> int:
    return hash(self._program())

  def __eq__(self, other) -> bool:
    return isinstance(other, SpecOptimizer) and self._program() == other._program()

  def init(self, params):
    return self.transformation.init(params)

  def update(self, updates, state, params=None):
    """The optax update of the spec's optimiser.

    Args:
      updates: The gradients.
      state: The optimiser state (its learning rate, for a constant schedule).
      params: The current parameters (weight decay reads them).

    Returns:
      (the parameter updates, the new optimiser state).
    """
    return self.transformation.update(updates, state, params)
