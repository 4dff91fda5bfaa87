"""Writes a SuperNode's own-data directory from a config's seeded partition: the clients of one
node's block as `client_<id>.npz` files (jfed/flower/own_data.py's format), to try the Flower
own-data mode (node config `data-dir`, run config `own-data=true`; README, "Flower: real
separate clients") on the embedded datasets before bringing private data.

    python -m experiments.export_clients --config=experiments/configs/digits.py:smoke \
        --out=data/node0 --partition_id=0 --num_partitions=2     # and --partition_id=1 ...

Node `partition_id` of `num_partitions` gets the clients a whole-dataset SuperNode with the same
`partition-id`/`num-partitions` would train (`jfed.engine.sharding.client_block`), so a run on the
exported directories ends with the whole-dataset run's model (tests/test_flower_own_data.py).
Images are written as the loaders give them (float32 in [0, 1]); a few seconds on digits.
"""

from typing import List

from absl import app, flags, logging
from ml_collections import config_flags

from jfed.api import context_of_config
from jfed.engine.sharding import client_block
from jfed.errors import ConfigError
from jfed.flower.own_data import write_clients

FLAGS = flags.FLAGS


def define_flags() -> None:
  config_flags.DEFINE_config_file('config', None, 'A config file, FILE[:variant words].')
  flags.DEFINE_string('out', None, "The node's data directory (new or empty).")
  flags.DEFINE_integer('partition_id', 0, 'Which node: 0 .. num_partitions - 1.')
  flags.DEFINE_integer('num_partitions', 1, 'How many SuperNodes share the clients.')


def export(config, out: str, partition_id: int, num_partitions: int) -> List[str]:
  """Writes node `partition_id`'s clients of `config`'s partition to `out`; returns the files."""
  if num_partitions < 1 or not 0 <= partition_id < num_partitions:
    raise ConfigError(
      f'--partition_id={partition_id} must be in [0, --num_partitions={num_partitions})'
    )
  clients = config.partition.num_clients
  if num_partitions > clients:
    raise ConfigError(f'--num_partitions={num_partitions} is more than the {clients} clients')
  ctx = context_of_config(config)
  train_x, train_y = ctx.dataset.train_x, ctx.dataset.train_y
  block = client_block(len(ctx.parts), partition_id, num_partitions)
  return [
    str(p)
    for p in write_clients(out, {c: (train_x[ctx.parts[c]], train_y[ctx.parts[c]]) for c in block})
  ]


def main(argv) -> None:
  del argv
  if FLAGS.config is None or not FLAGS.out:
    raise app.UsageError('--config and --out are required')
  if not FLAGS['verbosity'].present:  # JAX's backend probing says nothing a user needs here
    logging.set_verbosity(logging.WARNING)
  try:
    files = export(FLAGS.config, FLAGS.out, FLAGS.partition_id, FLAGS.num_partitions)
  except ConfigError as e:
    raise SystemExit(f'error: {e}') from None
  print(f'wrote {len(files)} client files to {FLAGS.out}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
