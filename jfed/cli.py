"""The one entry point: `jfed` (or `python -m jfed`) once installed, `python -m experiments.main`
from a checkout.

  jfed --method=NAME --config=FILE[:ARG] [--workdir=DIR]
      [--compilation_cache=DIR] [--coordinator=HOST:PORT --num_processes=N --process_id=I
      [--init_timeout_s=S]]

With --flower_supernodes=N the clients train on N Flower SuperNodes of a local deployment
(jfed/flower; README, "Flower"), the server stage runs in the ServerApp, and the workdir is the
same as in one process. With --coordinator (or --distributed) the run spans several JAX
processes: each runs the same command, client groups are sharded over all their devices (set
--config.shard=True), and only process 0 writes metrics, summaries and figures into the
workdir, which all processes share. While the processes gather, each says how long it has
waited; one that has not met all the others within --init_timeout_s ends with an `error:` line.

--config takes a config file or the name of one of jfed's own (`--config=digits:smoke` is
jfed/configs/digits.py with the variant argument 'smoke'). Config values can be overridden on
the command line, e.g. --config.fedavg.rounds=5. `--method=?` lists the methods. Without
--workdir the outputs go to runs/<method>_<dataset>, which the first line names. Expected
failures (bad flags or config, missing or corrupt data, a busy or unwritable workdir, training
that turns non-finite) end in one `error: ...` line and exit status 1; `--traceback` shows the
stack instead. Only an interrupted run (Ctrl-C) ends with status 130, the shell's own for it.
A run refused before it wrote anything removes the workdir it created.
"""

import importlib.util
import logging as std_logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from jfed import console, supervise
from jfed.configs import CONFIGS_DIR, config_names

FLAGS = flags.FLAGS
flags.DEFINE_string('method', None, 'Method to run; --method=? lists them.')
flags.DEFINE_string('workdir', None, 'Output directory (default: runs/<method>_<dataset>).')
flags.DEFINE_bool('traceback', False, 'Show the full stack of an error instead of one line.')
flags.DEFINE_string(
  'compilation_cache',
  None,
  "Directory for JAX's persistent compilation cache (off by default): later runs and resumes "
  'read the programs compiled here back instead of compiling them again.',
)
flags.DEFINE_string(
  'coordinator',
  None,
  'host:port of process 0 of a run that spans several processes (with --num_processes and '
  '--process_id); every process runs the same command with its own --process_id.',
)
flags.DEFINE_integer('num_processes', None, 'Processes of a multi-process run.')
flags.DEFINE_integer('process_id', None, "This process's rank in [0, --num_processes).")
flags.DEFINE_integer(
  'init_timeout_s',
  300,
  'Seconds a process of a multi-process run waits for all the others to join before it ends '
  'with an error (with --coordinator or --distributed).',
)
flags.DEFINE_bool(
  'distributed',
  False,
  "Join a multi-process run described by the cluster's environment (SLURM, Open MPI, "
  'Kubernetes, TPU pods) instead of the three flags above.',
)
flags.DEFINE_integer(
  'flower_supernodes',
  0,
  'Run through a local Flower deployment with this many SuperNodes (one SuperLink, N '
  "SuperNodes and `flwr run` as separate processes; pip install -e '.[flower]').",
)
flags.DEFINE_list(
  'flower_data_dirs',
  None,
  'With --flower_supernodes: one own-data directory per SuperNode (node config data-dir; '
  'client_<id>.npz files, docs/deployment.md); FedAvg and FedProx only.',
)
config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file (get_config(arg)).', lock_config=True
)


def _fail(message: str, status: int = 1):
  first = str(message).strip().splitlines() or ['unknown error']
  print(f'error: {first[0]}', file=sys.stderr)
  sys.exit(status)


def config_path(spec: str) -> str:
  """`--config`'s value with a bare name of jfed's own configs ('digits', 'digits:smoke')
  replaced by the path of its file (jfed/configs/digits.py); a path is kept as given."""
  name, colon, arg = spec.partition(':')
  if os.path.isfile(name) or '/' in name or name.endswith('.py'):
    return spec
  if name not in config_names():
    _fail(f"config {name!r} is neither a file nor one of jfed's: {', '.join(config_names())}")
  return str(CONFIGS_DIR / f'{name}.py') + colon + arg


def _parse_flags(argv):
  """absl's parser, with one `error:` line for a bad flag, config file, variant or config key."""
  argv = list(argv)
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith('--config='):
      spec = config_path(arg.split('=', 1)[1])
      argv[i] = '--config=' + spec
      path = spec.split(':', 1)[0]
      if not os.path.isfile(path):
        _fail(f'config file {path} not found')
  try:
    # ml_collections warns of a get_config that returned None before absl has a log format;
    # the `error:` line below says it, once
    quiet = std_logging.getLogger('absl')
    level, quiet.level = quiet.level, std_logging.ERROR
    try:
      rest = FLAGS(argv)
    finally:
      quiet.setLevel(level)
    if FLAGS.config is not None:  # applies the --config.key=value overrides
      FLAGS.config.get('seed')
    elif FLAGS['config'].present:
      made = type(FLAGS['config'].value).__name__  # the object get_config returned (None)
      _fail(f'{FLAGS["config"].config_filename}: get_config returned {made}, not a ConfigDict')
    return rest
  except Exception as e:  # pylint: disable=broad-except  # absl/ml_collections raise many types
    if '--traceback' in argv:
      raise
    cause = e
    while cause.__cause__ is not None or (
      cause.__context__ is not None and not isinstance(cause, flags.Error)
    ):
      cause = cause.__cause__ or cause.__context__
    if isinstance(cause, (KeyError, AttributeError)) and cause.args:
      message = f'unknown config key {cause.args[0]}'  # ml_collections suggests the right one
    else:
      message = str(cause)
      if 'Traceback (most recent call last)' in message:  # an error inside get_config(arg)
        last = [l for l in message.splitlines() if l.strip()][-1]
        message = last.split(': ', 1)[1] if ': ' in last else last
    _fail(' '.join(str(message).split()))


def _variant_hint(method: str) -> str:
  """For a config `method` refuses: '; ' and the --config values of its file's variants that
  `method` accepts, or '' if none does or the refusal is an override's.

  Only for a config file that declares `EXPERIMENTS`, the variant words that choose an
  experiment (as opposed to modifiers such as 'smoke'): its default may suit one method only
  (fashion_mnist.py's 'centralized' sets a cosine schedule that every federated method refuses),
  and the refusal alone does not say which variant to pick. Each such word is tried with the
  command's other words.
  """
  from jfed.driver import build_algorithm  # pylint: disable=g-import-not-at-top

  spec = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--config=')), None)
  if spec is None:
    return ''
  name, colon, arg = spec.partition(':')
  try:
    path = config_path(spec).partition(':')[0]
    loader = importlib.util.spec_from_file_location('_jfed_config_variants', path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    experiments = tuple(getattr(module, 'EXPERIMENTS', ()))
    if not experiments:
      return ''
    try:  # the file's config without the command's --config.key=value overrides
      build_algorithm(method, module.get_config(arg) if colon else module.get_config())
      return ''  # accepted: an override is what the method refuses
    except ValueError:
      pass
    others = [w.strip() for w in arg.split(',') if w.strip() and w.strip() not in experiments]
    accepted = []
    for word in experiments:
      variant = ','.join([word, *others])
      try:
        build_algorithm(method, module.get_config(variant))
      except ValueError:
        continue
      accepted.append(f'--config={name}:{variant}')
  except Exception:  # pylint: disable=broad-except  # a hint must not hide the error itself
    return ''
  return f'; {method} runs with {" or ".join(accepted)}' if accepted else ''


def main(argv):
  del argv
  from jfed.methods import available_methods  # pylint: disable=g-import-not-at-top

  method = FLAGS.method
  if method in (None, '', '?', 'list', 'help'):
    print('methods: ' + ', '.join(available_methods()))
    if method is None:
      _fail('--method is required (--method=? lists the methods)')
    return
  if FLAGS.config is None:
    _fail('--config is required, e.g. --config=digits')
  from jfed.errors import ConfigError, JfedError  # pylint: disable=g-import-not-at-top

  launch = (FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
  multi_process = FLAGS.distributed or any(v is not None for v in launch)
  if FLAGS['init_timeout_s'].present and not multi_process:
    _fail('--init_timeout_s applies only to a multi-process run (--coordinator or --distributed)')
  if FLAGS.flower_supernodes and FLAGS.coordinator:
    _fail('--flower_supernodes and --coordinator are two ways to run one job; choose one')
  if FLAGS.flower_data_dirs and not FLAGS.flower_supernodes:
    _fail('--flower_data_dirs needs --flower_supernodes (one directory per SuperNode)')
  workdir = FLAGS.workdir or f'runs/{method}_{FLAGS.config.dataset.name}'
  if multi_process and not FLAGS.traceback and not supervise.is_supervised():
    # JAX aborts a process whose peer died from C++; the parent turns that into one line
    sys.exit(
      supervise.run_supervised(
        [sys.executable, '-m', 'jfed', *sys.argv[1:]],
        workdir,
        FLAGS.process_id,
        FLAGS.num_processes,
        FLAGS.coordinator,
      )
    )
  if multi_process and supervise.is_supervised():
    supervise.end_with_parent()
  console.console_logging()
  try:
    try:
      summary = _run(method, workdir, multi_process)
    except Exception as e:  # pylint: disable=broad-except  # re-raised unless a peer is gone
      if multi_process and not FLAGS.traceback and supervise.peer_failure(e):
        _peer_lost(e, workdir)
      raise
  except KeyboardInterrupt:
    _fail('interrupted; run the same command again to resume', 130)
  except (JfedError, ValueError, OSError, EOFError) as e:
    # ValueError: a library's check of our input; OSError: an unreadable or truncated file.
    if FLAGS.traceback:
      raise
    name = getattr(e, 'filename', None)
    message = str(e) if not name or str(name) in str(e) else f'{name}: {e}'
    if isinstance(e, ConfigError):
      message += _variant_hint(method)
    _fail(message or type(e).__name__)
  from jfed.engine import multihost  # pylint: disable=g-import-not-at-top

  if not multihost.is_primary():
    return
  print(f'{method} done; outputs in {workdir}')
  for k in (
    'final_test_accuracy',
    'best_test_accuracy',
    'mean_test_accuracy',
    'backend',
    'seconds_this_invocation',
  ):
    if k in summary:
      print(f'  {k}: {summary[k]}')


def _peer_lost(error: BaseException, workdir: str) -> None:
  """A collective that lost its peer: one line, and out at once (a normal exit waits JAX's
  shutdown barrier out, about 80 s, and then aborts with a C++ stack all the same)."""
  what = supervise.describe_stop(
    [str(error)], FLAGS.process_id, FLAGS.num_processes, FLAGS.coordinator
  )
  sys.stdout.flush()
  print(supervise.error_line(what, workdir, FLAGS.num_processes), file=sys.stderr)
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access


def _run(method: str, workdir: str, multi_process: bool):
  """Joins the processes of a multi-process run, then runs the job; returns its summary."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.engine import multihost  # pylint: disable=g-import-not-at-top

  if multi_process:
    multihost.initialize(
      FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id, FLAGS.init_timeout_s
    )
  if FLAGS.compilation_cache:
    from jfed.engine.compiles import use_persistent_cache  # pylint: disable=g-import-not-at-top

    use_persistent_cache(FLAGS.compilation_cache)
  if not FLAGS.workdir and multihost.is_primary():  # another command may land in it too
    print(f'workdir: {workdir} (default; --workdir=DIR to choose)', flush=True)
  if FLAGS.flower_supernodes:
    from jfed.flower.deploy import run_local_deployment  # pylint: disable=g-import-not-at-top

    spec = next(config_path(a.split('=', 1)[1]) for a in sys.argv[1:] if a.startswith('--config='))
    overrides = [a for a in sys.argv[1:] if a.startswith('--config.')]
    return run_local_deployment(
      method, spec, overrides, workdir, FLAGS.flower_supernodes, data_dirs=FLAGS.flower_data_dirs
    )
  return run_experiment(method, FLAGS.config, workdir)


def run() -> None:
  """The console script `jfed` (and `python -m jfed`, `python -m experiments.main`)."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == '__main__':
  run()
