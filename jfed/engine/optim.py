"""Optimisers with PyTorch semantics, built from a config."""
import optax

OPTIMIZERS = ('sgd', 'adam')


def make_optimizer(name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
  """torch.optim.SGD / Adam: weight decay is added to the gradient before momentum/Adam."""
  if name == 'sgd':
    opt = optax.sgd(lr, momentum=momentum or None)
  elif name == 'adam':
    opt = optax.adam(lr, b1=b1, b2=b2)
  else:
    raise ValueError(f'Unknown optimizer {name!r}; valid: {", ".join(OPTIMIZERS)}')
  if weight_decay:
    return optax.chain(optax.add_decayed_weights(weight_decay), opt)
  return opt


def optimizer_from_config(cfg) -> optax.GradientTransformation:
  return make_optimizer(cfg.name, cfg.lr, momentum=cfg.get('momentum', 0.0),
                        weight_decay=cfg.get('weight_decay', 0.0))
