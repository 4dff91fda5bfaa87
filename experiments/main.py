"""The one entry point: python -m experiments.main --method=NAME --config=FILE[:ARG] [--workdir=DIR].

Config values can be overridden on the command line, e.g. --config.fedavg.rounds=5.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jfed.methods import available_methods

FLAGS = flags.FLAGS
flags.DEFINE_string('method', None, 'Method to run (see --helpfull for the list).')
flags.DEFINE_string('workdir', None, 'Output directory (default: runs/<method>_<dataset>).')
config_flags.DEFINE_config_file('config', None, 'Experiment config file (get_config(arg)).',
                                lock_config=True)
flags.mark_flags_as_required(['method', 'config'])


def main(argv):
  del argv
  from jfed.runner import run_experiment
  method = FLAGS.method
  if method not in available_methods():
    sys.exit(f'Unknown method {method!r}; valid methods: {", ".join(available_methods())}')
  config = FLAGS.config
  workdir = FLAGS.workdir or f'runs/{method}_{config.dataset.name}'
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  try:
    summary = run_experiment(method, config, workdir)
  except (ValueError, FileNotFoundError) as e:  # bad input: a message, not a traceback
    sys.exit(f'error: {e}')
  keys = [k for k in ('final_test_accuracy', 'best_test_accuracy', 'mean_test_accuracy',
                      'backend', 'seconds_this_invocation') if k in summary]
  print(f'{method} done; outputs in {workdir}')
  for k in keys:
    print(f'  {k}: {summary[k]}')


if __name__ == '__main__':
  app.run(main)
