"""One process of the two-process runs of tests/test_multihost.py.

  python -m tests.multihost_worker COORDINATOR NUM_PROCESSES PROCESS_ID OUT_DIR

Joins the run, trains a toy client group sharded over every process's devices with each
client-map strategy (FedProx, so the replicated anchor is exercised too) and saves what this
process ends with in OUT_DIR/process<ID>.npz, with where the group's shards lived.
"""

import sys

import flax.linen as nn
import jax
import numpy as np

from jfed import engine
from jfed.data.federated import federate
from jfed.engine import multihost, sharding

SIZES = (13, 5, 9, 1, 6, 2, 11)  # 7 clients: padded to a multiple of the global device count
STRATEGIES = ('vmap', 'scan', 'loop')


class TinyNet(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    del train, mask
    x = nn.relu(nn.Conv(4, (3, 3))(x)).reshape(x.shape[0], -1)
    return nn.Dense(3)(x)


def train_toy_group(strategy: str, mesh=None):
  """(stacked final params, per-client losses) of the toy group; the same data everywhere."""
  rng = np.random.default_rng(0)
  n = sum(SIZES)
  x = rng.normal(size=(n, 4, 4, 1)).astype(np.float32)
  y = rng.integers(0, 3, size=n).astype(np.int32)
  bounds = np.cumsum((0,) + SIZES)
  fed = federate(x, y, [np.arange(bounds[i], bounds[i + 1]) for i in range(len(SIZES))])
  module = TinyNet()
  tx = engine.make_optimizer('sgd', 0.05, momentum=0.9)
  models = engine.init_models(module, (4, 4, 1), jax.random.PRNGKey(0), len(SIZES))
  trainer = engine.GroupTrainer(module, tx, 4, prox_mu=0.1, strategy=strategy, mesh=mesh)
  state, metrics = trainer.train(
    engine.init_train_state(tx, models),
    fed,
    2,
    jax.random.PRNGKey(1),
    anchor=engine.take(models.params, 0),
  )
  return jax.tree.map(np.asarray, state.model.params), metrics.loss


def main(coordinator: str, num_processes: str, process_id: str, out_dir: str) -> None:
  multihost.initialize(coordinator, int(num_processes), int(process_id))
  mesh = engine.client_mesh()
  placed = sharding.shard_group(mesh, np.arange(len(SIZES), dtype=np.float32))
  out = {
    'mesh_processes': np.array(sorted({d.process_index for d in mesh.devices.flat})),
    'group_fully_addressable': np.array(placed.is_fully_addressable),
  }
  for strategy in STRATEGIES:
    params, loss = train_toy_group(strategy, mesh)
    out[f'{strategy}_loss'] = loss
    for i, leaf in enumerate(jax.tree.leaves(params)):
      out[f'{strategy}_param{i}'] = leaf
  np.savez(f'{out_dir}/process{process_id}.npz', **out)


if __name__ == '__main__':
  main(*sys.argv[1:])
