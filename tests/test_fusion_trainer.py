"""`jfed.cvae.server.FusionTrainer` (FedMHO's knowledge fusion, FedCVAE's server classifier) on a
model with BatchNorm and dropout, against one epoch written out step by step.

The oracle tests of FedMHO and FedCVAE (tests/test_oracle_fedmho.py) train MLP classifiers, which
have neither BatchNorm nor dropout, so they cannot see whether the server step trains in train
mode, keeps padded samples out of the batch statistics, keeps the new running statistics, draws
fresh dropout masks per batch, or hands the optimiser the parameters (weight decay needs them).
FedMHO's VGG-9 has both layers. Here the epoch is recomputed from its definition: batches from
the seeded permutation (the last one padded and masked), the model in train mode on each batch
with the mask and the batch's dropout key fold_in(key, b), Eq. 7's loss written out (λ·CE +
(1 − λ)·KL(softmax(t) ‖ softmax(s)), summed over classes, 'mean' dividing it by C, averaged over
the real samples), torch.optim.SGD's momentum and weight decay written out, the running statistics
carried from batch to batch.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfed.cvae.server import FusionTrainer, SyntheticSet
from jfed.engine import ModelState
from jfed.models.layers import BatchNorm

CLASSES, N, BATCH = 4, 13, 5  # three batches, the last with 3 real samples and 2 padded
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 0.05


class _BNDropoutNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Dense(6)(x.reshape(x.shape[0], -1))
    x = nn.relu(BatchNorm()(x, train, mask))
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return nn.Dense(CLASSES)(x)


class _PlainNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask  # no BatchNorm, no dropout
    return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


def _sgd(lr, momentum, weight_decay):
  """torch.optim.SGD(lr, momentum, weight_decay) as optax: weight decay needs the parameters."""
  return optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(lr, momentum=momentum))


def _loss(logits, labels, teacher, lam, kl_reduction, weights):
  log_s = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  per_sample = -jnp.take_along_axis(log_s, labels[:, None], axis=-1)[:, 0]
  if teacher is not None:
    log_t = teacher - jax.scipy.special.logsumexp(teacher, axis=-1, keepdims=True)
    kl = jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
    if kl_reduction == 'mean':
      kl = kl / CLASSES
    per_sample = lam * per_sample + (1.0 - lam) * kl
  return jnp.sum(per_sample * weights) / jnp.sum(weights)


def _expected_epoch(module, variables, data, lam, kl_reduction, seed, key):
  """One epoch by its definition; returns (params, batch_stats, mean batch loss)."""
  params, stats = variables['params'], variables['batch_stats']
  velocity = jax.tree.map(jnp.zeros_like, params)
  order = np.random.default_rng(seed).permutation(N)

  def objective(p, stats, x, y, teacher, mask, dropout_key):
    logits, new = module.apply(
      {'params': p, 'batch_stats': stats},
      x,
      train=True,
      mask=mask,
      mutable=['batch_stats'],
      rngs={'dropout': dropout_key},
    )
    weights = mask.astype(jnp.float32)
    return _loss(logits, y, teacher, lam, kl_reduction, weights), new['batch_stats']

  loss_and_grads = jax.jit(jax.value_and_grad(objective, has_aux=True))
  losses = []
  for b, start in enumerate(range(0, N, BATCH)):
    real = order[start : start + BATCH]
    idx = np.concatenate([real, np.zeros(BATCH - len(real), int)])  # padded with sample 0
    mask = jnp.asarray(np.arange(BATCH) < len(real))
    teacher = None if data.teacher is None else data.teacher[idx]
    (loss, stats), grads = loss_and_grads(
      params, stats, data.x[idx], data.y[idx], teacher, mask, jax.random.fold_in(key, b)
    )
    grads = jax.tree.map(lambda g, w: g + WEIGHT_DECAY * w, grads, params)
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    params = jax.tree.map(lambda w, v: w - LR * v, params, velocity)
    losses.append(float(loss))
  return params, stats, float(np.mean(losses))


def _data(with_teacher: bool) -> SyntheticSet:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.uniform(size=(N, 3, 3, 1)), jnp.float32)
  y = jnp.asarray(rng.integers(0, CLASSES, N), jnp.int32)
  teacher = jnp.asarray(rng.normal(size=(N, CLASSES)) * 2, jnp.float32) if with_teacher else None
  return SyntheticSet(x, y, teacher)


@pytest.mark.parametrize(
  'with_teacher, lam, kl_reduction',
  [(True, 0.3, 'batchmean'), (True, 0.6, 'mean'), (False, 1, 'mean')],
)
def test_one_epoch_trains_batchnorm_and_dropout_as_written_out(with_teacher, lam, kl_reduction):
  module = _BNDropoutNet()
  data = _data(with_teacher)
  variables = module.init(jax.random.PRNGKey(1), data.x[:2])
  # running statistics away from their initial 0 / 1, so that keeping or dropping them shows
  variables = {
    'params': variables['params'],
    'batch_stats': jax.tree.map(lambda a: a + 0.25, variables['batch_stats']),
  }
  trainer = FusionTrainer(module, _sgd(LR, MOMENTUM, WEIGHT_DECAY), lam, kl_reduction)
  key = jax.random.PRNGKey(7)
  state = trainer.init(ModelState(variables['params'], variables['batch_stats']))
  state, loss = trainer.epoch(state, data, BATCH, np.random.default_rng(3), key)

  params, stats, mean_loss = _expected_epoch(module, variables, data, lam, kl_reduction, 3, key)
  for got, want in ((state.model.params, params), (state.model.batch_stats, stats)):
    jax.tree.map(
      lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6),
      got,
      want,
    )
  assert loss == pytest.approx(mean_loss, rel=1e-5)
  # the check can see a difference: the epoch moved the parameters and the statistics
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), params, variables['params'])
  assert max(jax.tree.leaves(moved)) > 1e-3


def test_a_model_without_batchnorm_keeps_its_empty_statistics():
  # FedMHO's small CNN and the MLPs have no BatchNorm: the state keeps the structure it had (an
  # empty statistics collection), so that it can be checkpointed and uploaded like any other.
  module = _PlainNet()
  data = _data(True)
  variables = module.init(jax.random.PRNGKey(1), data.x[:2])
  model = ModelState(variables['params'], variables.get('batch_stats', {}))
  trainer = FusionTrainer(module, _sgd(LR, MOMENTUM, WEIGHT_DECAY), 0.5)
  state = trainer.init(model)
  state, _ = trainer.epoch(state, data, BATCH, np.random.default_rng(3), jax.random.PRNGKey(7))
  assert jax.tree.structure(state.model) == jax.tree.structure(model)
