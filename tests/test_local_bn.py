"""`local_bn='eval_after_first_epoch'`: DENSE's LocalUpdate, whose per-epoch test leaves the model
in eval mode for every later epoch (zj-jayzhang/DENSE, loop_df_fl.py: `model.train()` once,
then `test()` -> `model.eval()` after each epoch).

The oracle is a hand-written full-batch loop (SGD with momentum written out, the model's
`apply` called in train mode for epoch 1 and in eval mode after), not jfed's trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfed import engine
from jfed.data import load_dataset
from jfed.data.federated import federate
from jfed.engine.training import GroupTrainer, supervised_loss
from jfed.errors import ConfigError
from jfed.methods import common
from jfed.models import get_model

LR, MOMENTUM, N, EPOCHS = 0.05, 0.9, 40, 3


def assert_tree_close(got, want, rtol, atol):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _setup():
  data = load_dataset('digits')
  module = get_model('cnn_mnist', data.num_classes, data.input_shape)
  init = engine.init_model(module, data.input_shape, jax.random.PRNGKey(3))
  x, y = data.train_x[:N], data.train_y[:N]
  return module, init, x, y


def _oracle(module, init, x, y, train_mode_epochs):
  """Full batch: one step an epoch on all N samples, so the data order cannot matter."""
  params, stats = init.params, init.batch_stats
  velocity = jax.tree.map(jnp.zeros_like, params)
  history = []
  for epoch in range(EPOCHS):
    train = epoch < train_mode_epochs

    def loss_fn(p, train=train):
      if train:
        logits, new = module.apply(
          {'params': p, 'batch_stats': stats}, x, train=True, mutable=['batch_stats']
        )
        new_stats = new['batch_stats']
      else:
        logits, new_stats = module.apply({'params': p, 'batch_stats': stats}, x), stats
      loss = jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
      return loss, new_stats

    grads, stats = jax.grad(loss_fn, has_aux=True)(params)
    # PyTorch's SGD momentum: v = mu v + g; p -= lr v
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    params = jax.tree.map(lambda p, v: p - LR * v, params, velocity)
    history.append(stats)
  return engine.ModelState(params, stats), history


def _jfed(module, init, x, y, train_mode_epochs, strategy='loop'):
  tx = optax.sgd(LR, momentum=MOMENTUM)
  trainer = GroupTrainer(module, tx, 64, strategy=strategy, train_mode_epochs=train_mode_epochs)
  fed = federate(x, y, [np.arange(N)])
  state = engine.init_train_state(tx, engine.replicate(init, 1))
  state, metrics = trainer.train(state, fed, EPOCHS, jax.random.PRNGKey(0))
  return engine.take(state.model, 0), metrics


@pytest.mark.parametrize('strategy', ['loop', 'scan'])
def test_eval_mode_after_the_first_epoch_matches_the_hand_written_loop(strategy):
  module, init, x, y = _setup()
  want, history = _oracle(module, init, x, y, train_mode_epochs=1)
  got, metrics = _jfed(module, init, x, y, 1, strategy)
  assert_tree_close(got, want, rtol=1e-4, atol=1e-5)
  # the running statistics moved in epoch 1 only
  assert_tree_close(history[2], history[0], rtol=0, atol=0)
  assert metrics.loss.shape == (1, EPOCHS)
  # ... and differ from training in train mode throughout (the default), which the oracle
  # also reproduces
  always, _ = _jfed(module, init, x, y, 0, strategy)
  want_always, _ = _oracle(module, init, x, y, train_mode_epochs=EPOCHS)
  assert_tree_close(always, want_always, rtol=1e-4, atol=1e-5)
  gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(got.batch_stats), jax.tree.leaves(always.batch_stats))
  )
  assert gap > 1e-3


def test_the_second_half_goes_on_with_the_first_halfs_orders_and_optimiser():
  """Two epochs in train mode then one in eval mode with mini-batches: the same models as the
  train-mode trainer for epochs 1-2 followed by an eval-mode trainer for epoch 3 started at
  `first_epoch=2` with the first's optimiser state."""
  module, init, x, y = _setup()
  tx = optax.sgd(LR, momentum=MOMENTUM)
  fed = federate(x, y, [np.arange(N)])
  key = jax.random.PRNGKey(5)
  start = engine.init_train_state(tx, engine.replicate(init, 1))
  split, _ = GroupTrainer(module, tx, 16, strategy='loop', train_mode_epochs=2).train(
    start, fed, 3, key
  )
  head, _ = GroupTrainer(module, tx, 16, strategy='loop').train(start, fed, 2, key)
  from jfed.engine.training import eval_mode_objective

  tail = GroupTrainer(module, tx, 16, strategy='loop', objective=eval_mode_objective)
  want, _ = tail.train(head, fed, 1, key, first_epoch=2)
  assert_tree_close(split.model, want.model, rtol=1e-5, atol=1e-6)
  assert_tree_close(split.opt_state, want.opt_state, rtol=1e-5, atol=1e-6)


def test_eval_mode_loss_is_the_supervised_loss_in_eval_mode():
  module, init, x, y = _setup()
  from jfed.engine.training import eval_mode_objective

  loss, (_, _, count, stats) = eval_mode_objective(
    module, init.params, init.batch_stats, x, y, jnp.ones(N), jax.random.PRNGKey(0)
  )
  want, _, _ = supervised_loss(module.apply(init.variables(), x), y, jnp.ones(N))
  assert float(loss) == pytest.approx(float(want), rel=1e-6) and int(count) == N
  assert stats is init.batch_stats


def test_the_option_is_refused_where_it_cannot_apply():
  module, _, _, _ = _setup()
  with pytest.raises(ValueError, match='>= 0'):
    GroupTrainer(module, optax.sgd(0.1), 8, train_mode_epochs=-1)
  with pytest.raises(ValueError, match='classification objective'):
    GroupTrainer(module, optax.sgd(0.1), 8, objective=lambda *a: None, train_mode_epochs=1)
  assert common.local_train_mode_epochs('eval_after_first_epoch', engine.classification_objective)
  assert common.local_train_mode_epochs('train', engine.classification_objective) == 0
  assert common.local_train_mode_epochs('eval_after_first_epoch', lambda *a: None) == 0
  with pytest.raises(ConfigError, match='local_bn'):
    common.local_train_mode_epochs('eval', engine.classification_objective)


def test_the_command_line_refuses_an_unknown_mode(tmp_path):
  from jfed.configs import digits
  from jfed.run_config import validate_run_config

  c = digits.get_config('smoke')
  c.local_bn = 'frozen'
  with pytest.raises(ConfigError, match="local_bn is 'frozen'; valid: train, eval_after"):
    validate_run_config(c, 'fedavg')
