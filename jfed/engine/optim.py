"""Optimisers with PyTorch semantics, built from a config."""
import optax

OPTIMIZERS = ('sgd', 'adam')


SCHEDULES = ('constant', 'cosine')


def make_optimizer(name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999, schedule: str = 'constant',
                   total_steps: int = 0) -> optax.GradientTransformation:
  """torch.optim.SGD / Adam: weight decay is added to the gradient before momentum/Adam.

  schedule='cosine' decays lr to 0 over `total_steps` optimiser steps (CosineAnnealingLR); the
  step count lives in the optimiser state, so it only makes sense where that state persists
  (centralized training), not with a fresh optimiser per FL round.
  """
  if schedule == 'cosine':
    if total_steps <= 0:
      raise ValueError('a cosine schedule needs total_steps > 0')
    lr = optax.cosine_decay_schedule(lr, total_steps)
  elif schedule != 'constant':
    raise ValueError(f'Unknown lr schedule {schedule!r}; valid: {", ".join(SCHEDULES)}')
  if name == 'sgd':
    opt = optax.sgd(lr, momentum=momentum or None)
  elif name == 'adam':
    opt = optax.adam(lr, b1=b1, b2=b2)
  else:
    raise ValueError(f'Unknown optimizer {name!r}; valid: {", ".join(OPTIMIZERS)}')
  if weight_decay:
    return optax.chain(optax.add_decayed_weights(weight_decay), opt)
  return opt


def optimizer_from_config(cfg, total_steps: int = 0) -> optax.GradientTransformation:
  return make_optimizer(cfg.name, cfg.lr, momentum=cfg.get('momentum', 0.0),
                        weight_decay=cfg.get('weight_decay', 0.0),
                        schedule=cfg.get('schedule', 'constant'), total_steps=total_steps)
