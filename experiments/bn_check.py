"""Does a FedAvg-family global model's test accuracy depend on its averaged BatchNorm statistics?

    python -m experiments.bn_check --method=fedavg \
        --config=experiments/configs/fedtsa_digits.py:pruned,dir=0.6 --config.seed=2 \
        --config.optimizer.lr=0.01 --config.fedavg.rounds=40 --workdir=runs/fedavg_pruned

Reads the run's saved checkpoints (the driver keeps the last two; the run in --workdir must have
been made with the same --method and --config) and scores each saved global model on the whole
test split three ways: with the running statistics the server averaged (what the run reports),
with statistics recomputed on every client's training images (the averaged weights' own
statistics, `--passes` train-mode passes so that the momentum-0.9 running averages forget the
averaged ones), and with each test batch's own statistics. If the first jumps from round to
round while the second does not, the averaged statistics, not the averaged weights, make the
jumps (FedTSA's digits baselines, BUILD_NOTES.md). Nothing in the workdir is written.
"""

import pathlib
from typing import List, NamedTuple

from absl import flags
import jax.numpy as jnp
import numpy as np

from experiments import sweep

FLAGS = flags.FLAGS


def define_flags() -> None:
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  config_flags.DEFINE_config_file(
    'config', None, 'Experiment config (get_config(arg)) of the run in --workdir.'
  )
  flags.DEFINE_string('method', 'fedavg', "The run's method: fedavg or fedprox.")
  flags.DEFINE_string('workdir', None, "The run's workdir (its checkpoints are read).")
  flags.mark_flags_as_required(['config', 'workdir'])
  flags.DEFINE_integer('passes', 60, 'Train-mode passes that recompute the BN statistics.')


class Scores(NamedTuple):
  """One saved global model's test accuracy (in [0, 1]) under three sets of BN statistics."""

  step: int
  running: float  # the averaged running statistics (the run's own evaluation)
  recomputed: float  # statistics of the averaged weights on the clients' training images
  test_batch: float  # each evaluation batch's own statistics


def recomputed_stats(module, model, x, passes: int):
  """BatchNorm running statistics of `model`'s weights on `x`: `passes` train-mode passes, each
  moving the running averages towards the batch statistics of `x` by (1 - momentum)."""
  stats = model.batch_stats
  for _ in range(passes):
    _, updated = module.apply(
      {'params': model.params, 'batch_stats': stats}, x, train=True, mutable=['batch_stats']
    )
    stats = updated['batch_stats']
  return stats


def check(method: str, config, workdir: pathlib.Path, passes: int) -> List[Scores]:
  from jfed import driver  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from jfed.io.checkpoint import saved_steps  # pylint: disable=g-import-not-at-top
  from jfed.methods import common  # pylint: disable=g-import-not-at-top

  if method not in ('fedavg', 'fedprox'):
    raise ConfigError(f'--method={method}: bn_check reads FedAvg-family runs (fedavg, fedprox)')
  steps = saved_steps(workdir / 'checkpoints')
  if not steps:
    raise ConfigError(f'{workdir / "checkpoints"} holds no checkpoint: run the method there first')
  ctx = driver.context_of_config(config)
  algorithm = driver.build_algorithm(method, config)
  aux = algorithm.setup(ctx)
  template = algorithm.init(ctx, aux)
  module = aux.full_group.module
  if not template.model.batch_stats:
    raise ConfigError(f'{config.model!r} has no BatchNorm: nothing to check')
  ds = ctx.dataset
  train_x = jnp.asarray(common.clients_training_images(ctx, range(ctx.num_clients)))
  test_x, test_y = jnp.asarray(ds.test_x), np.asarray(ds.test_y)

  def accuracy(variables, train: bool) -> float:
    if train:
      logits, _ = module.apply(variables, test_x, train=True, mutable=['batch_stats'])
    else:
      logits = module.apply(variables, test_x, train=False)
    return float((np.argmax(np.asarray(logits), -1) == test_y).mean())

  checkpointer = driver.RunCheckpointer(workdir / 'checkpoints')
  out = []
  for step in steps:
    model = checkpointer.restore(step, template).model
    stats = recomputed_stats(module, model, train_x, passes)
    out.append(
      Scores(
        step,
        accuracy(model.variables(), False),
        accuracy({'params': model.params, 'batch_stats': stats}, False),
        accuracy(model.variables(), True),
      )
    )
  return out


def table(scores: List[Scores]) -> str:
  head = ['step', 'running (averaged)', "recomputed (clients' training images)", 'test batch']
  rows = [
    [str(s.step), *(f'{100 * a:.2f}' for a in (s.running, s.recomputed, s.test_batch))]
    for s in scores
  ]
  return '\n'.join(sweep.table_lines(head, rows))


def main(argv):
  del argv
  print(table(check(FLAGS.method, FLAGS.config, pathlib.Path(FLAGS.workdir), FLAGS.passes)))


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
