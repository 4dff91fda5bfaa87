"""FedTSA (seed 001): the Stage-2 deep-mutual-learning loss against its formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import engine
from jfed.distill.losses import consensus_logits, mutual_learning_loss
from jfed.distill.mutual import MutualLearner, MutualLearningConfig
from jfed.models import get_model


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_dml_loss_is_the_kl_to_the_mean_logits_at_temperature_t():
  """Eqs. 6–8: KL(softmax(z̄/T) ‖ softmax(z_r/T)) with z̄ the mean of the M models' logits,
  averaged over the real samples; Eq. 9 adds (1 − α)·CE; padding is ignored."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 6, 10)) * 3  # M = 3 cluster models, 6 samples, 10 classes
  labels = rng.integers(0, 10, 6)
  weights = np.array([1, 1, 1, 1, 1, 0], np.float32)
  z_bar = logits.mean(0)
  np.testing.assert_allclose(np.asarray(consensus_logits(list(logits))), z_bar, atol=1e-6)
  for T in (1.0, 5.0):
    p, q = _softmax(z_bar / T), _softmax(logits[1] / T)
    kl = (p * (np.log(p) - np.log(q))).sum(-1)
    got = mutual_learning_loss(jnp.asarray(logits[1]), jnp.asarray(z_bar), T, weights=weights)
    np.testing.assert_allclose(float(got), kl[:5].mean(), rtol=1e-5)
    scaled = mutual_learning_loss(
      jnp.asarray(logits[1]), jnp.asarray(z_bar), T, weights=weights, t_squared=True
    )
    np.testing.assert_allclose(float(scaled), T * T * kl[:5].mean(), rtol=1e-5)
    ce = -np.log(_softmax(logits[1])[np.arange(6), labels])
    mixed = mutual_learning_loss(
      jnp.asarray(logits[1]), jnp.asarray(z_bar), T, jnp.asarray(labels), 0.8, weights
    )
    np.testing.assert_allclose(float(mixed), (0.8 * kl + 0.2 * ce)[:5].mean(), rtol=1e-5)
  # The consensus is a fixed target: no gradient flows into it.
  grad = jax.grad(lambda c: mutual_learning_loss(jnp.asarray(logits[0]), c, 5.0))(
    jnp.asarray(z_bar)
  )
  assert not np.any(np.asarray(grad))
  with pytest.raises(ValueError, match='labels'):
    mutual_learning_loss(jnp.asarray(logits[0]), jnp.asarray(z_bar), 5.0, kl_weight=0.5)


def test_mutual_learning_step_uses_the_pre_update_consensus_and_models_agree_more():
  """One batch by hand: every model's logits from the same (pre-update) parameters, their mean
  as the fixed target, one SGD step each; and over epochs the models' predictions converge."""
  shape = (8, 8, 1)
  modules = [get_model('mlp', 10, shape, hidden=(h,)) for h in (16, 32)]
  models = [engine.init_model(m, shape, jax.random.PRNGKey(i)) for i, m in enumerate(modules)]
  x = jnp.asarray(np.random.default_rng(1).uniform(size=(24, *shape)), jnp.float32)
  y = jnp.zeros(24, jnp.int32)
  tx = engine.make_optimizer('sgd', 0.5)
  learner = MutualLearner(modules, tx, MutualLearningConfig(temperature=2.0))
  states, _ = learner.epoch(learner.init(models), x, y, 24, np.random.default_rng(0))

  logits = [m.apply({'params': s.params}, x) for m, s in zip(modules, models)]
  target = (logits[0] + logits[1]) / 2
  for m, s, new in zip(modules, models, states):
    grads = jax.grad(lambda p, m=m: mutual_learning_loss(m.apply({'params': p}, x), target, 2.0))(
      s.params
    )
    want = jax.tree.map(lambda p, g: p - 0.5 * g, s.params, grads)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(new.model.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

  def disagreement(states):
    p = [jax.nn.softmax(m.apply({'params': s.model.params}, x)) for m, s in zip(modules, states)]
    return float(jnp.mean(jnp.abs(p[0] - p[1])))

  before = disagreement(learner.init(models))
  for e in range(20):
    states, _ = learner.epoch(states, x, y, 8, np.random.default_rng(e))
  assert disagreement(states) < 0.5 * before, (before, disagreement(states))
