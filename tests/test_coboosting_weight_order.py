"""Co-Boosting's ensemble-weight update order (`coboosting.weight_update_order`).

The reference (github.com/rong-dai/Co-Boosting, `datafree/synthesis/coboost.py`,
`COBOOSTSynthesizer.synthesize`) updates the ensemble weights over the labelled pool BEFORE
`self.data_pool.add(best_inputs, ...)` adds the epoch's batch: at epoch e the update passes over
the batches of epochs 0..e−1 ('before_batch', the default). jfed's former order passed over the
pool with epoch e's batch ('after_batch'). One epoch's update of `jfed.methods.coboosting` on a
tiny pool, three linear teachers, is checked against a hand-written numpy computation of
`coboost.py`'s loop (softmax cross-entropy of the weighted ensemble Σ w_k f_k / Σ w_k, its
gradient in w written out, w ← w − mu · wdc^e · sign(g), clipped to [0, 1] within ±1 of the
epoch's start), under both orders; the two orders give different weights.

From jfed the hand computation takes only inputs: the pool, the teachers' parameters and the
batch order, a permutation drawn from jfed's documented generator
`np.random.default_rng((seed, round, epoch, 7))`, once per `wa_steps` pass.
"""

import types

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from jfed.distill import TeacherGroup, pool_add, pool_init
from jfed.engine import ModelState
from jfed.methods import coboosting, oneshot

K, C, D = 3, 4, 4  # teachers, classes, pixels (2 × 2 × 1)
PER_EPOCH, KD_BATCH, SEED, ROUND, EPOCH = 3, 2, 5, 1, 1
MU, WDC, WA_STEPS = 0.3, 0.9, 2


class Linear(nn.Module):
  """A teacher: flatten → Dense(classes)."""

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.Dense(self.num_classes, name='fc')(x.reshape(x.shape[0], -1))


def _problem():
  rng = np.random.default_rng(0)
  kernel = rng.normal(0.0, 2.0, (K, D, C)).astype(np.float32)
  bias = rng.normal(0.0, 0.5, (K, C)).astype(np.float32)
  # epoch 0's batch, then epoch 1's: the images of epoch 1 carry labels the teachers disagree on
  x = rng.uniform(0.0, 1.0, (2 * PER_EPOCH, 2, 2, 1)).astype(np.float32)
  y = np.array([0, 1, 2, 3, 3, 2], np.int32)
  return kernel, bias, x, y


def _jfed_update(order: str, epoch: int = EPOCH):
  kernel, bias, x, y = _problem()
  pool = pool_init(2 * PER_EPOCH, (2, 2, 1))  # capacity: epochs × batch, as fresh_state sizes it
  pool = pool_add(pool, jnp.asarray(x[:PER_EPOCH]), jnp.asarray(y[:PER_EPOCH]))
  pool = pool_add(pool, jnp.asarray(x[PER_EPOCH:]), jnp.asarray(y[PER_EPOCH:]))
  params = {'fc': {'kernel': jnp.asarray(kernel), 'bias': jnp.asarray(bias)}}
  rd = types.SimpleNamespace(
    teachers=[TeacherGroup(Linear(C), ModelState(params, {}))], data=np.array([2, 0, 1])
  )
  settings = types.SimpleNamespace(
    kd_batch=KD_BATCH,
    kd=types.SimpleNamespace(strategy='loop'),
    synthesis=types.SimpleNamespace(batch_size=PER_EPOCH, g_steps=2, keep='best'),
  )
  aux = types.SimpleNamespace(settings=settings)
  ctx = types.SimpleNamespace(run=types.SimpleNamespace(seed=SEED))
  state = oneshot.ServerState(None, pool, None, jnp.full((K,), 1.0 / K, jnp.float32), None)
  c = coboosting.CoBoostingConfig(mu=MU, wdc=WDC, wa_steps=WA_STEPS, weight_update_order=order)
  new_state, record = coboosting.update_weights(c, ctx, aux, rd, state, ROUND, epoch)
  assert int(new_state.pool.count) == 2 * PER_EPOCH  # the pool itself is left as it was
  return np.asarray(new_state.extra, np.float64), record


def _hand_update(n: int) -> np.ndarray:
  """`coboost.py`'s weight loop over the first n pool images, in float64."""
  kernel, bias, x, y = (np.asarray(a, np.float64) for a in _problem())
  x, y = x[:n].reshape(n, -1), y[:n].astype(int)
  f = np.einsum('nd,kdc->knc', x, kernel) + bias[:, None, :]  # [K, n, C]
  w = np.full(K, 1.0 / K)
  w0 = w.copy()
  rng = np.random.default_rng((SEED, ROUND, EPOCH, 7))
  for _ in range(WA_STEPS):
    perm = rng.permutation(n)
    for start in range(0, n, KD_BATCH):
      idx = perm[start : start + KD_BATCH]
      fb = f[:, idx]  # [K, B, C]
      total = w.sum()
      t = np.einsum('k,kbc->bc', w, fb) / total
      p = np.exp(t - t.max(1, keepdims=True))
      p /= p.sum(1, keepdims=True)
      onehot = np.eye(C)[y[idx]]
      # d mean_b CE / d w_k = mean_b Σ_c (p − onehot)_bc · (f_k − t)_bc / Σ w
      g = np.einsum('bc,kbc->k', p - onehot, fb - t[None]) / (total * len(idx))
      assert np.all(np.abs(g) > 1e-4)  # no sign that float32 rounding could flip
      w = w - MU * WDC**EPOCH * np.sign(g)
      w = np.clip(w0 + np.clip(w - w0, -1.0, 1.0), 0.0, 1.0)
  return w


@pytest.mark.parametrize('order,n', [('before_batch', PER_EPOCH), ('after_batch', 2 * PER_EPOCH)])
def test_one_epochs_weight_update_matches_the_hand_computation_of_its_order(order, n):
  got, record = _jfed_update(order)
  want = _hand_update(n)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  by_client = np.zeros(K)
  by_client[[2, 0, 1]] = want
  assert record['ensemble_weights'] == pytest.approx(by_client.tolist(), abs=1e-6)


def test_the_two_orders_give_different_weights_and_the_default_is_the_references():
  before, _ = _jfed_update('before_batch')
  after, _ = _jfed_update('after_batch')
  assert np.max(np.abs(before - after)) > 0.1, (before, after)
  assert coboosting.CoBoostingConfig().weight_update_order == 'before_batch'


@pytest.mark.parametrize('order', coboosting.WEIGHT_UPDATE_ORDERS)
def test_the_first_epoch_keeps_the_uniform_weights(order):
  got, record = _jfed_update(order, epoch=0)
  np.testing.assert_array_equal(got, np.full(K, np.float32(1.0 / K)))
  assert record == {}
