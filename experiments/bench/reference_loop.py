"""The `loop` client map and `loop` evaluation as they were before issue 14, for timing only.

jfed's `loop` strategy (`GroupTrainer._loop_epoch`, `Evaluator.group_logits`) now dispatches
less per step (issue 14, item 3). These subclasses keep the previous host-side code verbatim so
that one benchmark run measures before and after side by side on the same machine and load.
They run the same jitted per-client step, so they give the same numbers (checked by
tests/test_bench.py); they are not part of jfed.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jfed.engine.evaluation import Evaluator, _pad_batches
from jfed.engine.training import GroupTrainer, _client_arrays, _client_step


class LegacyLoopTrainer(GroupTrainer):
  """`GroupTrainer` with strategy `loop` run as before issue 14.

  Per step: the step index as a Python int (a host->device conversion), one jitted step without
  donation and one more dispatch to add the step's metrics; per client: one dispatch per state
  leaf to slice it and four more for the client's data; per epoch: one per leaf to stack.
  """

  def __init__(self, module, tx, batch_size, prox_mu=0.0):
    super().__init__(module, tx, batch_size, prox_mu=prox_mu, strategy='loop')
    self._legacy_step = jax.jit(_client_step, static_argnums=0)

  def _loop_epoch(self, state, fed, length, orders, sizes, keys, anchor, context=None, owned=None):
    del sizes  # the old code converted each client's size from the host copy
    sizes_np = np.asarray(fed.sizes)
    if owned is not None and len(owned) != len(sizes_np):
      raise ValueError('the pre-issue-14 loop trains every client in one process')
    if context is not None:
      raise ValueError('the pre-issue-14 loop had no per-client context (HeteroFL masks)')
    new_states, epoch_stats = [], []
    for k in range(len(sizes_np)):
      ts = jax.tree.map(lambda a, k=k: a[k], state)
      # (the client's data as jfed's loop now sends it: one client at a time, from the host)
      xk, yk = _client_arrays(fed, k, length)
      order, size, ck = orders[k], jnp.int32(sizes_np[k]), keys[k]
      acc = jnp.zeros(3)
      for s in range(math.ceil(int(sizes_np[k]) / self.batch_size)):
        client = (xk, yk, order, size, ck)
        ts, st = self._legacy_step(self.program, ts, client, s, anchor, None)
        acc = acc + st
      new_states.append(ts)
      epoch_stats.append(acc)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *new_states)
    return stacked, jnp.stack(epoch_stats)


class LegacyLoopEvaluator(Evaluator):
  """`Evaluator` with strategy `loop` as before issue 14: one model and one batch per call,
  the batch sent from the host each time and every result fetched before the next call."""

  def __init__(self, module, batch_size=1000):
    super().__init__(module, batch_size, strategy='loop')

  def logits(self, model, x):
    xb, n = _pad_batches(np.asarray(x), self.batch_size)
    out = [self._logits(model, b) for b in xb]
    return np.concatenate([np.asarray(o) for o in out])[:n]

  def group_logits(self, models, x):
    m = jax.tree.leaves(models)[0].shape[0]
    return np.stack([self.logits(jax.tree.map(lambda a, k=k: a[k], models), x) for k in range(m)])
