"""Server optimisers on the pseudo-gradient (Reddi et al., ICLR'21, "Adaptive Federated
Optimization"; Hsu et al. 2019 for FedAvgM).

A round's pseudo-gradient is Δ = θ_global − aggregate(client models): the descent direction
that plain FedAvg follows with step 1 (θ ← θ − 1·Δ = the aggregate). A server optimiser is
an optax transformation applied to Δ:

  'fedavg'      θ ← aggregate (SGD with lr 1; no state);
  'fedavgm'     SGD with server learning rate and heavy-ball momentum;
  'fedadam'     optax.adam(lr, b1, b2, eps = τ);
  'fedyogi'     optax.yogi(lr, b1, b2, eps = τ);
  'fedadagrad'  optax.adagrad(lr, eps = τ).

optax's Adam corrects the moments' bias and its Adagrad has no first moment; Reddi et al.'s
Algorithm 2 has neither correction and gives Adagrad the β1 momentum. docs/robustness.md records
this. Only the parameters follow the optimiser: BatchNorm statistics are not trained, so the
global model takes their aggregate as FedAvg does.
"""

from typing import Any, NamedTuple, Tuple

import jax
import optax

from jfed.engine.state import ModelState

SERVER_OPTIMIZERS = ('fedavg', 'fedavgm', 'fedadam', 'fedyogi', 'fedadagrad')


class ServerOptimizerConfig(NamedTuple):
  """The `server_optimizer` config section."""

  name: str  # one of SERVER_OPTIMIZERS
  lr: float  # server learning rate η (ignored by 'fedavg')
  momentum: float  # FedAvgM's β
  b1: float
  b2: float
  eps: float  # Reddi et al.'s adaptivity τ


def make_server_optimizer(config: ServerOptimizerConfig) -> optax.GradientTransformation:
  c = config
  if c.name == 'fedavg':
    return optax.sgd(1.0)
  if c.name == 'fedavgm':
    return optax.sgd(c.lr, momentum=c.momentum or None)
  if c.name == 'fedadam':
    return optax.adam(c.lr, b1=c.b1, b2=c.b2, eps=c.eps)
  if c.name == 'fedyogi':
    return optax.yogi(c.lr, b1=c.b1, b2=c.b2, eps=c.eps)
  if c.name == 'fedadagrad':
    return optax.adagrad(c.lr, initial_accumulator_value=0.0, eps=c.eps)
  raise ValueError(f'unknown server optimizer {c.name!r}; valid: {", ".join(SERVER_OPTIMIZERS)}')


def pseudo_gradient(global_params: Any, aggregate_params: Any) -> Any:
  return jax.tree.map(lambda g, a: g - a, global_params, aggregate_params)


def server_update(
  tx: optax.GradientTransformation, opt_state: Any, global_model: ModelState, aggregate: ModelState
) -> Tuple[ModelState, Any]:
  """(new global model, new optimiser state) after one step of `tx` on the pseudo-gradient.

  Args:
    tx: The server optimiser.
    opt_state: Its state.
    global_model: The current global model.
    aggregate: The round's aggregate of the uploads (its BN statistics are taken as they are).

  Returns:
    (new global model, new optimiser state).
  """
  grads = pseudo_gradient(global_model.params, aggregate.params)
  updates, opt_state = tx.update(grads, opt_state, global_model.params)
  params = optax.apply_updates(global_model.params, updates)
  return ModelState(params, aggregate.batch_stats), opt_state
