"""Client engine: every strategy gives the same numbers, padding is exact, sharding is neutral."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import engine
from jfed.data.federated import federate
from jfed.models.layers import BatchNorm


class TinyBNNet(nn.Module):
  num_classes: int = 3

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    # No bias before BN: its exact gradient is 0, and Adam would turn float noise of ~1e-9 in
    # that gradient into full-size steps that differ between strategies.
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    x = BatchNorm()(x, train, mask)
    x = nn.relu(x).reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes)(x)


def _toy_group(sizes=(13, 5, 9, 1), seed=0):
  rng = np.random.default_rng(seed)
  n = sum(sizes)
  x = rng.normal(size=(n, 4, 4, 1)).astype(np.float32)
  y = rng.integers(0, 3, size=n).astype(np.int32)
  bounds = np.cumsum((0,) + tuple(sizes))
  parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
  return x, y, parts


def _train(
  strategy,
  fed,
  tx_name='sgd',
  epochs=2,
  prox_mu=0.0,
  mesh=None,
  batch_size=4,
  client_ids=None,
  loop_threads=None,
):
  module = TinyBNNet()
  tx = engine.make_optimizer(tx_name, 0.05, momentum=0.9 if tx_name == 'sgd' else 0.0)
  models = engine.init_models(module, (4, 4, 1), jax.random.PRNGKey(0), fed.num_clients)
  state = engine.init_train_state(tx, models)
  anchor = engine.take(models.params, 0) if prox_mu else None
  trainer = engine.GroupTrainer(
    module, tx, batch_size, prox_mu=prox_mu, strategy=strategy, mesh=mesh, loop_threads=loop_threads
  )
  return trainer.train(
    state, fed, epochs, jax.random.PRNGKey(1), anchor=anchor, client_ids=client_ids
  )


# jitted: run op by op, taking a client compiled a slice and a squeeze per leaf shape
_take = jax.jit(engine.take)


def _assert_trees_close(a, b, atol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)


@pytest.mark.parametrize('tx_name,prox_mu', [('sgd', 0.0), ('adam', 0.0), ('sgd', 0.1)])
def test_all_strategies_give_the_same_numbers(tx_name, prox_mu):
  x, y, parts = _toy_group()
  fed = federate(x, y, parts)
  results = {s: _train(s, fed, tx_name, prox_mu=prox_mu) for s in ('loop', 'vmap', 'scan')}
  ref_state, ref_metrics = results['loop']
  for s in ('vmap', 'scan'):
    state, metrics = results[s]
    _assert_trees_close(ref_state, state)
    np.testing.assert_allclose(ref_metrics.loss, metrics.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ref_metrics.accuracy, metrics.accuracy)


@pytest.mark.parametrize('tx_name,prox_mu', [('sgd', 0.0), ('adam', 0.1)])
def test_loop_threads_train_each_client_exactly_as_the_plain_loop(tx_name, prox_mu):
  # Clients trained side by side on host threads: every client's state and metrics are the
  # plain loop's, bit for bit, in the clients' order (sizes differ, so a mix-up shows).
  x, y, parts = _toy_group(sizes=(13, 5, 9, 1, 7))
  fed = federate(x, y, parts)
  plain, plain_metrics = _train('loop', fed, tx_name, prox_mu=prox_mu, loop_threads=1)
  for threads in (2, 3):
    threaded, metrics = _train('loop', fed, tx_name, prox_mu=prox_mu, loop_threads=threads)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(threaded)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(plain_metrics.loss, metrics.loss)
    np.testing.assert_array_equal(plain_metrics.accuracy, metrics.accuracy)


def test_loop_threads_default_and_refusal(monkeypatch):
  monkeypatch.delenv('JFED_LOOP_THREADS', raising=False)
  assert engine.default_loop_threads('gpu') == 1
  assert engine.default_loop_threads('cpu') == (2 if (os.cpu_count() or 1) >= 2 else 1)
  monkeypatch.setenv('JFED_LOOP_THREADS', '3')
  assert engine.default_loop_threads('gpu') == engine.default_loop_threads('cpu') == 3
  assert engine.GroupTrainer(TinyBNNet(), engine.make_optimizer('sgd', 0.1), 4).loop_threads == 3
  for bad in ('0', 'two', '-1'):
    monkeypatch.setenv('JFED_LOOP_THREADS', bad)
    with pytest.raises(
      ValueError, match=f"JFED_LOOP_THREADS must be a positive integer, got '{bad}'"
    ):
      engine.default_loop_threads('cpu')
  with pytest.raises(ValueError, match='loop_threads must be at least 1'):
    engine.GroupTrainer(TinyBNNet(), engine.make_optimizer('sgd', 0.1), 4, loop_threads=0)


def test_loop_leaves_the_callers_state_usable():
  # The loop strategy donates per-client buffers to XLA; the caller's stacked state must survive
  # (FedAvg trains every round from the same global model) and give the same result again.
  x, y, parts = _toy_group()
  fed = federate(x, y, parts)
  module = TinyBNNet()
  tx = engine.make_optimizer('adam', 0.05)
  state = engine.init_train_state(
    tx, engine.init_models(module, (4, 4, 1), jax.random.PRNGKey(0), fed.num_clients)
  )
  trainer = engine.GroupTrainer(module, tx, 4, strategy='loop')
  first, first_metrics = trainer.train(state, fed, 2, jax.random.PRNGKey(1))
  again, again_metrics = trainer.train(state, fed, 2, jax.random.PRNGKey(1))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(first_metrics.loss, again_metrics.loss)


def test_padded_client_trains_exactly_on_its_own_samples():
  x, y, parts = _toy_group()
  fed = federate(x, y, parts)
  group_state, group_metrics = _train('vmap', fed)
  for k, part in enumerate(parts):
    alone = federate(x, y, [part])  # no padding at all
    single_state, single_metrics = _train('loop', alone, client_ids=[k])
    _assert_trees_close(_take(group_state, k), _take(single_state, 0))
    np.testing.assert_allclose(group_metrics.loss[k], single_metrics.loss[0], rtol=1e-5)


def test_padding_content_is_irrelevant():
  x, y, parts = _toy_group()
  fed = federate(x, y, parts)
  garbage = fed._replace(
    x=np.where(fed.mask[..., None, None, None], fed.x, 1e3), y=np.where(fed.mask, fed.y, 2)
  )
  _assert_trees_close(_train('scan', fed)[0], _train('scan', garbage)[0])


def test_every_sample_is_visited_once_per_epoch():
  sizes = jnp.array([7, 3, 0])
  orders = engine.training.client_orders(jax.random.PRNGKey(0), jnp.arange(3), sizes, 7, 8)
  orders = np.asarray(orders)  # sliced on the device, each row compiled its own slice
  for k, n in enumerate([7, 3, 0]):
    assert sorted(orders[k, :n].tolist()) == list(range(n))


@pytest.mark.parametrize('strategy', ['vmap', 'scan'])
def test_sharded_equals_unsharded(strategy):
  assert len(jax.devices()) == 4, 'conftest sets 4 fake CPU devices'
  x, y, parts = _toy_group(sizes=(13, 5, 9, 1, 6, 2))  # 6 clients: padded to 8 on 4 devices
  fed = federate(x, y, parts)
  mesh = engine.client_mesh()
  sharded, sharded_metrics = _train(strategy, fed, mesh=mesh)
  plain, plain_metrics = _train(strategy, fed)
  assert engine.num_stacked(sharded) == 6
  assert len(jax.tree.leaves(sharded)[0].sharding.device_set) == 4
  _assert_trees_close(sharded, plain)
  np.testing.assert_allclose(sharded_metrics.loss, plain_metrics.loss, rtol=1e-5)


def test_training_learns_and_prox_pulls_towards_anchor():
  x, y, parts = _toy_group(sizes=(40,))
  fed = federate(x, y, parts)
  _, metrics = _train('loop', fed, epochs=8)
  assert metrics.loss[0, -1] < metrics.loss[0, 0]
  far, _ = _train('loop', fed, epochs=4)
  near, _ = _train('loop', fed, epochs=4, prox_mu=50.0)
  init = engine.init_model(TinyBNNet(), (4, 4, 1), jax.random.PRNGKey(0)).params
  # jitted: run op by op, the distance compiled ~15 one-primitive programs
  dist = jax.jit(
    lambda p: sum(
      jnp.sum((a[0] - b) ** 2) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(init))
    )
  )
  assert float(dist(near.model.params)) < float(dist(far.model.params))


def test_group_evaluation_matches_single_model_evaluation():
  x, y, parts = _toy_group()
  fed = federate(x, y, parts)
  state, _ = _train('loop', fed)
  for strategy in ('loop', 'vmap'):
    ev = engine.Evaluator(TinyBNNet(), batch_size=7, strategy=strategy)
    accs = ev.group_accuracy(state.model, x, y)
    for k in range(len(parts)):
      assert accs[k] == pytest.approx(ev.accuracy(_take(state.model, k), x, y))


def test_weighted_average_is_fedavg():
  tree = {'w': jnp.array([[1.0, 2.0], [3.0, 6.0]])}
  avg = engine.weighted_average(tree, [1, 3])
  np.testing.assert_allclose(avg['w'], [2.5, 5.0])


def test_unknown_strategy_is_rejected():
  with pytest.raises(ValueError, match='valid: auto, loop, vmap, scan'):
    engine.resolve_strategy('pmap')
