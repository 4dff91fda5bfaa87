"""Adversarial probes of the command line (issues 37 and 38), re-runnable.

    nice python -m experiments.dev.probes [--only=NAME,...] [--out=docs/results/probes.md]

Each probe writes what it needs into a fresh temporary directory (a corrupted checkpoint, a
hostile IDX file, a stale lock, ...), runs one command (mostly `python -m experiments.main` on
digits with an MLP and one or two rounds) under a timeout, and classifies how it ended:

  error       exit status 1 or 2 with an `error: ...` line and no traceback
  success     exit status 0 and no traceback
  traceback   a Python traceback on the console
  crash       a non-zero exit without an `error:` line (a signal, a C++ abort)
  hang        still running at the timeout (killed)

A probe passes when its outcome is the one expected (an error for hostile input, a success for
what must work, e.g. a stale lock replaced) and the error line, or for a success stderr, matches
the probe's pattern. The table (command, expected, outcome, seconds, the error line) goes to
`--out`. The whole list takes a few minutes on 2 CPU cores; tests/test_probes.py (slow set)
runs a handful.
"""

import dataclasses
import gzip
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOST = os.uname().nodename
N_MNIST = 400  # training images of the probes' MNIST files (the smoke config holds 150 out)
DEAD_PID = 999999
BASE = (
  '--method=fedavg',
  '--config=experiments/configs/digits.py:smoke',
  '--config.model=mlp',
  '--config.fedavg.rounds=1',
  '--workdir={tmp}/w',
)

Cleanup = Optional[Callable[[], None]]


@dataclasses.dataclass
class Probe:
  """One hostile (or must-work) invocation; `{tmp}` in `args` is the probe's directory."""

  name: str
  what: str
  args: Sequence[str]  # after `python -m experiments.main`, or the whole argv with `raw`
  expect: str  # 'error' | 'success'
  match: str = ''  # regex the error line (a success: stderr) must match
  setup: Optional[Callable[[pathlib.Path], Cleanup]] = None
  raw: bool = False  # args is the whole command
  timeout_s: float = 180.0


@dataclasses.dataclass
class Result:
  probe: Probe
  command: str
  outcome: str
  seconds: float
  error_line: str
  stderr_lines: int
  ok: bool


# ---- files the probes write ------------------------------------------------------------------

_IDX_TYPE = {'uint8': 0x08, 'float32': 0x0D}


def _idx(array: np.ndarray, magic: Optional[bytes] = None) -> bytes:
  header = magic or bytes([0, 0, _IDX_TYPE[array.dtype.name], array.ndim])
  body = array.astype(array.dtype.newbyteorder('>')).tobytes()
  return header + struct.pack(f'>{array.ndim}I', *array.shape) + body


def _mnist_dir(tmp: pathlib.Path, n: int = N_MNIST, **replace: bytes) -> pathlib.Path:
  """An MNIST-layout directory of n training and n/2 test images (gzipped IDX), with the
  named files' uncompressed bytes (or, for names ending in '.raw', the file's bytes) replaced."""
  d = tmp / 'mnist'
  d.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  files = {
    'train-images-idx3-ubyte': _idx(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
    'train-labels-idx1-ubyte': _idx((np.arange(n) % 10).astype(np.uint8)),
    't10k-images-idx3-ubyte': _idx(rng.integers(0, 256, (n // 2, 28, 28), dtype=np.uint8)),
    't10k-labels-idx1-ubyte': _idx((np.arange(n // 2) % 10).astype(np.uint8)),
  }
  for stem, data in files.items():
    raw = replace.get(stem + '.raw')
    path = d / f'{stem}.gz'
    path.write_bytes(raw if raw is not None else gzip.compress(replace.get(stem, data)))
  return d


def _gzip_bomb() -> bytes:
  """A valid header and images, then 1 GiB of zeros in 1 MiB gzip members (~1 MB on disk)."""
  head = gzip.compress(_idx(np.zeros((N_MNIST, 28, 28), np.uint8)))
  return head + gzip.compress(bytes(1 << 20), compresslevel=9) * 1024


MNIST = ('--config.dataset.name=mnist', '--config.dataset.data_dir={tmp}/mnist')


def _floats_with_one_above_one(n: int) -> np.ndarray:
  """n float images in [0, 1] but for one value of 1.01: a file of pixel values by its range."""
  images = np.full((n, 28, 28), 0.5, np.float32)
  images[0, 0, 0] = 1.01
  return images


def _with_mnist(**replace) -> Callable[[pathlib.Path], Cleanup]:
  def setup(tmp: pathlib.Path) -> Cleanup:
    _mnist_dir(tmp, **replace)
    return None

  return setup


def _data_file_replaced(kind: str) -> Callable[[pathlib.Path], Cleanup]:
  """The MNIST directory with its training images replaced by a FIFO or a link to /dev/zero."""

  def setup(tmp: pathlib.Path) -> Cleanup:
    path = _mnist_dir(tmp) / 'train-images-idx3-ubyte.gz'
    path.unlink()
    if kind == 'fifo':
      os.mkfifo(path)
    else:
      path.symlink_to('/dev/zero')
    return None

  return setup


def _config_file(text: str) -> Callable[[pathlib.Path], Cleanup]:
  """A config file `config.py` in the probe's directory."""

  def setup(tmp: pathlib.Path) -> Cleanup:
    (tmp / 'config.py').write_text(text)
    return None

  return setup


def _main(*args: str) -> List[str]:
  return [sys.executable, '-m', 'experiments.main', *args]


def _run_quietly(argv: Sequence[str], tmp: pathlib.Path) -> None:
  subprocess.run(
    [a.format(tmp=tmp) for a in argv],
    cwd=ROOT,
    check=True,
    capture_output=True,
    timeout=600,
    env=_env(),
  )


def _largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [f for f in (step_dir / 'state').rglob('*') if f.is_file() and f.parent.name == 'd']
  return max(files, key=lambda f: f.stat().st_size)


def _flip_a_byte(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


TWO_ROUNDS = tuple(
  a if a != '--config.fedavg.rounds=1' else '--config.fedavg.rounds=2' for a in BASE
)
THREE_ROUNDS = tuple(
  a if a != '--config.fedavg.rounds=1' else '--config.fedavg.rounds=3' for a in BASE
)


def _interrupted_run(steps_to_damage: Sequence[str]) -> Callable[[pathlib.Path], Cleanup]:
  """A finished 2-round run with its summary removed (as a kill after round 2's checkpoint
  leaves it) and a byte flipped in the given checkpoints."""

  def setup(tmp: pathlib.Path) -> Cleanup:
    _run_quietly(_main(*TWO_ROUNDS), tmp)
    (tmp / 'w' / 'summary.json').unlink()
    for step in steps_to_damage:
      _flip_a_byte(_largest_data_file(tmp / 'w' / 'checkpoints' / step))
    return None

  return setup


def _finished_run_with(truncated: str, keep_summary: bool) -> Callable[[pathlib.Path], Cleanup]:
  """A finished 2-round run with the first half of its file `truncated` (and its summary
  removed unless `keep_summary`, so the run must resume from its checkpoints)."""

  def setup(tmp: pathlib.Path) -> Cleanup:
    _run_quietly(_main(*TWO_ROUNDS), tmp)
    path = tmp / 'w' / truncated
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    if not keep_summary:
      (tmp / 'w' / 'summary.json').unlink()
    return None

  return setup


def _stale_lock(tmp: pathlib.Path) -> Cleanup:
  (tmp / 'w').mkdir()
  (tmp / 'w' / '.lock').write_text(f'pid {DEAD_PID} on {HOST}\n')
  return None


def _live_lock(tmp: pathlib.Path) -> Cleanup:
  (tmp / 'w').mkdir()
  code = (
    'import fcntl, os, time\n'
    f'f = open({str(tmp / "w" / ".lock")!r}, "a+")\n'
    'fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n'
    'f.write(f"pid {os.getpid()} on {os.uname().nodename}\\n"); f.flush()\n'
    'print("locked", flush=True)\n'
    'time.sleep(600)\n'
  )
  proc = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
  proc.stdout.readline()

  def cleanup():
    proc.kill()
    proc.wait()

  return cleanup


def _workdir_is_a_file(tmp: pathlib.Path) -> Cleanup:
  (tmp / 'w').write_text('not a directory\n')
  return None


def _damaged_local_models(tmp: pathlib.Path) -> Cleanup:
  """Another run's `local_models_dir` cache, with a byte flipped."""
  _run_quietly(_main(*LOCAL, '--workdir={tmp}/first'), tmp)
  # <cache>/<producer key>/<step>: the stage cache is keyed by what made it (issue 85)
  steps = [p for p in (tmp / 'cache').glob('*/*') if p.name.isdigit()]
  if not steps:
    raise OSError(f'the first run left no cached stage in {tmp / "cache"}')
  _flip_a_byte(_largest_data_file(steps[0]))
  return None


def _unverified_checkpoint_of_huge_values(tmp: pathlib.Path) -> Cleanup:
  """A 3-round run interrupted after round 2, whose checkpoint 2 has no checksums (an earlier
  jfed, or a kill between orbax's commit and the checksums) and holds finite values that
  training turns into NaN (every float × 1e30, as a flipped exponent bit could)."""
  _run_quietly(_main(*THREE_ROUNDS), tmp)
  (tmp / 'w' / 'summary.json').unlink()
  shutil.rmtree(tmp / 'w' / 'checkpoints' / '3')  # as a kill right after round 2's checkpoint
  code = (
    'import sys, jax, orbax.checkpoint as ocp\n'
    "m = ocp.CheckpointManager(sys.argv[1], item_names=('state', 'history'))\n"
    'a = ocp.args\n'
    'saved = m.restore(2, args=a.Composite(state=a.StandardRestore(), history=a.JsonRestore()))\n'
    "state = jax.tree.map(lambda x: x * 1e30 if x.dtype.kind == 'f' else x, saved['state'])\n"
    'm.delete(2)\n'
    "h = a.JsonSave(saved['history'])\n"
    'm.save(2, args=a.Composite(state=a.StandardSave(state), history=h))\n'
    'm.wait_until_finished(); m.close()\n'
  )
  subprocess.run(
    [sys.executable, '-c', code, str(tmp / 'w' / 'checkpoints')],
    check=True,
    capture_output=True,
    env=_env(),
    timeout=120,
  )
  return None


def _dead_peer(victim: int) -> List[str]:
  """Two processes of a 300-round run on one coordinator; `victim` is killed (SIGKILL) once a
  first checkpoint is committed, and the command is the survivor's.

  The watcher looks for any committed step, not step 1: with `max_to_keep` 2 step 1 is gone
  once step 3 is saved, and a watcher slowed by a loaded machine missed it once, leaving the
  victim to run all 300 rounds. Its output goes to /dev/null so that it never holds the probe's
  pipes, and it gives up after 240 s.
  """
  survivor = 1 - victim

  def command(rank: int) -> str:
    args = _main(
      *BASE[:-2],
      '--config.fedavg.rounds=300',
      '--config.shard=True',
      '--workdir={tmp}/w',
      '--coordinator=127.0.0.1:{port}',
      '--num_processes=2',
      f'--process_id={rank}',
    )
    return ' '.join(shlex.quote(a) for a in args)

  script = (
    'export XLA_FLAGS=--xla_force_host_platform_device_count=2; '
    f'{command(victim)} >/dev/null 2>&1 & victim=$!; '
    '(for _ in $(seq 1200); do '
    "if ls {tmp}/w/checkpoints 2>/dev/null | grep -qx '[0-9][0-9]*'; "
    'then kill -9 $victim; break; fi; '
    'sleep 0.2; done) >/dev/null 2>&1 & '
    f'exec {command(survivor)}'
  )
  return ['bash', '-c', script]


LOCAL = (
  '--method=local',
  '--config=experiments/configs/digits.py:smoke',
  '--config.model=mlp',
  '--config.local.epochs=1',
  '--config.local_models_dir={tmp}/cache',
)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _fuzz_uploads(count: int, seed: int = 0) -> int:
  """`count` seeded hostile uploads through the server's validator: 0 when every one is
  refused with an UploadError (or is valid), else 1 with an `error:` line."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jfed.engine import ModelState  # pylint: disable=g-import-not-at-top
  from jfed.io import ModelUpload, UploadError, validate_model_upload  # pylint: disable=g-import-not-at-top

  template = ModelState({'dense': {'kernel': jnp.zeros((4, 3)), 'bias': jnp.zeros(3)}}, {})
  rng = np.random.default_rng(seed)
  leaves = [
    np.zeros((4, 3), np.float32),
    np.zeros((4, 3), np.float64),
    np.full((4, 3), np.nan, np.float32),
    np.zeros(3, np.float32),
    np.zeros((3, 4), np.float32),
    'text',
    None,
    1.5,
    [1, 2],
    {'x': 1},
    {1: 'a', 'b': 2},
    object(),
  ]

  def hostile():
    choice = rng.integers(6)
    if choice == 0:
      return leaves[rng.integers(len(leaves))]
    if choice == 1:
      return {'dense': {'kernel': leaves[rng.integers(len(leaves))], 'bias': jnp.zeros(3)}}
    if choice == 2:
      return ModelState({'dense': {rng.integers(9): 1, 'bias': leaves[rng.integers(12)]}}, {})
    if choice == 3:
      return ModelState({'dense': {'kernel': leaves[rng.integers(12)], 'bias': jnp.zeros(3)}}, {})
    if choice == 4:
      return ModelState(leaves[rng.integers(12)], leaves[rng.integers(12)])
    return ModelState({'dense': [leaves[rng.integers(12)]] * int(rng.integers(3))}, {})

  accepted = 0
  for i in range(count):
    upload = ModelUpload(int(rng.integers(-2, 5)), int(rng.integers(-5, 50)), hostile())
    try:
      validate_model_upload(upload, template, max_samples=40)
      accepted += 1
    except UploadError:
      pass
    except Exception as e:  # pylint: disable=broad-except  # what the probe looks for
      print(f'error: fuzzed upload {i} crashed the validator: {type(e).__name__}: {e}')
      return 1
  print(f'{count} fuzzed uploads: {accepted} valid, {count - accepted} refused')
  return 0


# ---- the list --------------------------------------------------------------------------------

PROBES: List[Probe] = [
  Probe('baseline', 'fedavg on digits, 1 round', BASE, 'success'),
  Probe(
    'corrupted_checkpoint',
    'a flipped byte in the newest checkpoint of an interrupted run',
    TWO_ROUNDS,
    'success',
    r'checkpoint 2 .* does not restore',
    _interrupted_run(['2']),
  ),
  Probe(
    'corrupted_checkpoints_all',
    'a flipped byte in every checkpoint',
    TWO_ROUNDS,
    'error',
    r'no checkpoint in .*checkpoints restores',
    _interrupted_run(['1', '2']),
  ),
  Probe(
    'damaged_stage_cache',
    "a flipped byte in another run's local_models_dir cache",
    (*LOCAL, '--workdir={tmp}/second'),
    'success',
    r'cached stage 1 in .* is damaged',
    _damaged_local_models,
  ),
  Probe(
    'gzip_bomb_idx',
    'a 1 MB gzip that inflates to 1 GiB',
    (*BASE, *MNIST),
    'error',
    r'train-images-idx3-ubyte.gz.*more data than its header',
    _with_mnist(**{'train-images-idx3-ubyte.raw': _gzip_bomb()}),
  ),
  Probe(
    'zero_sample_idx',
    'training images and labels of 0 samples',
    (*BASE, *MNIST),
    'error',
    r'holds no samples',
    _with_mnist(
      **{
        'train-images-idx3-ubyte': _idx(np.zeros((0, 28, 28), np.uint8)),
        'train-labels-idx1-ubyte': _idx(np.zeros((0,), np.uint8)),
      }
    ),
  ),
  Probe(
    'mismatched_shapes_idx',
    'test images 32x32, training images 28x28',
    (*BASE, *MNIST),
    'error',
    r't10k-images-idx3-ubyte.gz',
    _with_mnist(**{'t10k-images-idx3-ubyte': _idx(np.zeros((N_MNIST // 2, 32, 32), np.uint8))}),
  ),
  Probe(
    'truncated_identity',
    'identity.json cut in half, the same config: resumes by config.json',
    TWO_ROUNDS,
    'success',
    r'identity.json is damaged; workdir .* resumes by its config.json',
    _finished_run_with('identity.json', keep_summary=False),
  ),
  Probe(
    'get_config_returns_none',
    'a config file whose get_config forgets its return',
    ('--method=fedavg', '--config={tmp}/config.py', '--workdir={tmp}/run'),
    'error',
    r'config.py: get_config returned NoneType, not a ConfigDict',
    _config_file('def get_config(arg=""):\n  config = None\n'),
  ),
  Probe(
    'truncated_summary',
    'summary.json cut in half',
    TWO_ROUNDS,
    'error',
    r'summary.json is damaged .*delete it and run again',
    _finished_run_with('summary.json', keep_summary=True),
  ),
  Probe(
    'clip_norm_below_float32',
    'aggregation.clip_norm=1e-30: every clipped update would vanish',
    (*BASE, '--config.aggregation.clip_norm=1e-30'),
    'error',
    r'aggregation.clip_norm=1e-30 is below 1e-06',
  ),
  Probe(
    'attack_clients_and_fraction',
    'attack.clients and attack.fraction both set',
    (
      *BASE,
      '--config.attack.kind=sign_flip',
      '--config.attack.clients=0',
      '--config.attack.fraction=0.4',
    ),
    'error',
    r"attack.clients='0' and attack.fraction=0.4 both choose the attackers",
  ),
  Probe(
    'mixed_scale_idx',
    'training floats in [0, 1], test floats with one value of 1.01',
    (*BASE, *MNIST),
    'error',
    r'train-images-idx3-ubyte.gz holds floats already scaled.*t10k-images-idx3-ubyte.gz holds '
    r'float32 pixel values.*must share one scale',
    _with_mnist(
      **{
        'train-images-idx3-ubyte': _idx(np.full((N_MNIST, 28, 28), 0.5, np.float32)),
        't10k-images-idx3-ubyte': _idx(_floats_with_one_above_one(N_MNIST // 2)),
      }
    ),
  ),
  Probe(
    'bad_magic_idx',
    'an IDX file with a bad type byte in its magic number',
    (*BASE, *MNIST),
    'error',
    r'train-images-idx3-ubyte.gz.*magic number',
    _with_mnist(
      **{
        'train-images-idx3-ubyte': _idx(
          np.zeros((N_MNIST, 28, 28), np.uint8), magic=bytes([0, 0, 0x0A, 3])
        )
      }
    ),
  ),
  Probe(
    'float_idx',
    'float32 IDX images already in [0, 1]',
    (*BASE, *MNIST),
    'success',
    '',
    _with_mnist(
      **{
        'train-images-idx3-ubyte': _idx(
          np.random.default_rng(1).random((N_MNIST, 28, 28)).astype(np.float32)
        ),
        't10k-images-idx3-ubyte': _idx(
          np.random.default_rng(2).random((N_MNIST // 2, 28, 28)).astype(np.float32)
        ),
      }
    ),
  ),
  Probe(
    'coordinator_without_port',
    '--coordinator=notahost',
    (*BASE, '--coordinator=notahost', '--num_processes=2', '--process_id=1'),
    'error',
    r'--coordinator',
  ),
  Probe(
    'unreachable_coordinator',
    'process 1 of 2, nobody at the coordinator, --init_timeout_s=5',
    (
      *BASE,
      '--coordinator=127.0.0.1:1',
      '--num_processes=2',
      '--process_id=1',
      '--init_timeout_s=5',
    ),
    'error',
    r'5 s|timed out|did not',
    timeout_s=90,
  ),
  Probe(
    'coordinator_without_peer',
    'process 0 of 2, the other never starts, --init_timeout_s=5',
    (
      *BASE,
      '--coordinator=127.0.0.1:{port}',
      '--num_processes=2',
      '--process_id=0',
      '--init_timeout_s=5',
    ),
    'error',
    r'5 s|timed out|did not',
    timeout_s=90,
  ),
  Probe(
    'num_processes_zero',
    '--num_processes=0',
    (*BASE, '--coordinator=127.0.0.1:1234', '--num_processes=0', '--process_id=0'),
    'error',
    r'--num_processes',
  ),
  Probe(
    'init_timeout_alone',
    '--init_timeout_s without a multi-process run',
    (*BASE, '--init_timeout_s=5'),
    'error',
    r'--init_timeout_s applies only',
  ),
  Probe(
    'trimmed_mean_trims_nothing',
    'trimmed_mean, trim_fraction 0.1 of 5 clients',
    (*BASE, '--config.aggregation.rule=trimmed_mean'),
    'error',
    r'aggregation.trim_fraction=0.1 trims',
  ),
  Probe(
    'krum_too_few_clients',
    'Krum f = 2 with n = 5 < 2f + 3',
    (*BASE, '--config.aggregation.rule=krum', '--config.aggregation.krum_byzantine=2'),
    'error',
    r'aggregation.krum_byzantine=2',
  ),
  Probe(
    'negative_attack_strength',
    'sign_flip with strength -10',
    (
      *BASE,
      '--config.attack.kind=sign_flip',
      '--config.attack.clients=1',
      '--config.attack.strength=-10',
    ),
    'error',
    r'attack.strength=-10',
  ),
  Probe(
    'all_uploads_rejected',
    'every client a x100 scaler, norm bound 0.01',
    (
      *BASE,
      '--config.attack.kind=scaling',
      '--config.attack.fraction=1.0',
      '--config.attack.strength=100',
      '--config.server.max_update_norm_ratio=0.01',
    ),
    'error',
    r'rejected, so nothing was aggregated',
  ),
  Probe(
    'all_uploads_rejected_allowed',
    'the same with server.allow_empty_rounds=True',
    (
      *BASE,
      '--config.attack.kind=scaling',
      '--config.attack.fraction=1.0',
      '--config.attack.strength=100',
      '--config.server.max_update_norm_ratio=0.01',
      '--config.server.allow_empty_rounds=True',
    ),
    'success',
    r'every upload was rejected',
  ),
  Probe(
    'ignored_aggregation_rule',
    'aggregation.rule=median for DENSE (no server round)',
    (
      '--method=dense',
      '--config=experiments/configs/fedhydra_digits.py:smoke',
      '--config.model=mlp',
      '--config.aggregation.rule=median',
      '--workdir={tmp}/w',
    ),
    'error',
    r'aggregation.rule=median: dense would ignore it',
  ),
  Probe(
    'ignored_label_flip',
    'attack.kind=label_flip for centralized training',
    (
      '--method=centralized',
      '--config=experiments/configs/digits.py:smoke',
      '--config.model=mlp',
      '--config.attack.kind=label_flip',
      '--config.attack.clients=0',
      '--workdir={tmp}/w',
    ),
    'error',
    r'attack.kind=label_flip is not supported by centralized',
  ),
  Probe(
    'negative_seed',
    '--config.seed=-1',
    (*BASE, '--config.seed=-1'),
    'error',
    r'seed',
  ),
  Probe(
    'diverging_lr',
    'optimizer.lr=1e6: the loss turns non-finite',
    (*BASE, '--config.optimizer.lr=1e6'),
    'error',
    r'non-finite|diverg',
  ),
  Probe(
    'unknown_config_key',
    '--config.fedavg.roundz=1',
    (*BASE, '--config.fedavg.roundz=1'),
    'error',
    r'roundz',
  ),
  Probe(
    'missing_config_file',
    '--config=nowhere.py',
    ('--method=fedavg', '--config=nowhere.py', '--workdir={tmp}/w'),
    'error',
    r'config file nowhere.py not found',
  ),
  Probe(
    'unknown_method',
    '--method=fedfoo',
    ('--method=fedfoo', '--config=experiments/configs/digits.py:smoke', '--workdir={tmp}/w'),
    'error',
    r'fedfoo',
  ),
  Probe(
    'workdir_is_a_file',
    '--workdir names a regular file',
    BASE,
    'error',
    r'is not a directory',
    _workdir_is_a_file,
  ),
  Probe(
    'unwritable_workdir',
    '--workdir on a read-only file system (/proc)',
    tuple(a if not a.startswith('--workdir') else '--workdir=/proc/jfed-probe/w' for a in BASE),
    'error',
    r'cannot be written',
  ),
  Probe(
    'write_limit_figure',
    'writes above 16 KiB fail (ulimit -f 16): the partition figure (24 KB) cannot be written',
    ('bash', '-c', 'ulimit -f 16 && exec ' + ' '.join(shlex.quote(a) for a in _main(*BASE))),
    'error',
    r'partition\.png',
    raw=True,
  ),
  Probe(
    'write_limit_checkpoint',
    'writes above 100 KiB fail (ulimit -f 100): the first checkpoint (203 KB) cannot be written',
    ('bash', '-c', 'ulimit -f 100 && exec ' + ' '.join(shlex.quote(a) for a in _main(*BASE))),
    'error',
    r'cannot write checkpoint 1',
    raw=True,
  ),
  Probe(
    'stale_lock',
    f'.lock of a dead process (pid {DEAD_PID})',
    BASE,
    'success',
    rf'replaced the stale lock of pid {DEAD_PID}',
    _stale_lock,
  ),
  Probe(
    'live_lock',
    'another live process holds the workdir lock',
    BASE,
    'error',
    r'is busy: a run \(pid \d+',
    _live_lock,
  ),
  Probe(
    'fifo_data_file',
    'a FIFO in place of the training images (a read would block)',
    (*BASE, *MNIST),
    'error',
    r'train-images-idx3-ubyte.gz is a FIFO, not a regular file',
    _data_file_replaced('fifo'),
  ),
  Probe(
    'device_data_file',
    'a link to /dev/zero in place of the training images (endless)',
    (*BASE, *MNIST),
    'error',
    r'train-images-idx3-ubyte.gz is a character device, not a regular file',
    _data_file_replaced('device'),
  ),
  Probe(
    'dead_peer',
    'process 1 of 2 killed (SIGKILL) after the first checkpoint; the command is process 0',
    _dead_peer(victim=1),
    'error',
    r'^error: process 1 of the multi-process run stopped .*resume from checkpoint \d+ in ',
    raw=True,
    timeout_s=300,
  ),
  Probe(
    'dead_coordinator',
    'process 0 of 2 (the coordinator) killed after the first checkpoint; the command is process 1',
    _dead_peer(victim=0),
    'error',
    r'^error: process 0 of the multi-process run \(its coordinator at .*resume from checkpoint',
    raw=True,
    timeout_s=300,
  ),
  Probe(
    'unverified_checkpoint_diverges',
    'resume from a checkpoint without checksums whose values training turns into NaN',
    THREE_ROUNDS,
    'error',
    r'unverified checkpoint 2 .*set aside as .*2\.set-aside; run the same command again',
    _unverified_checkpoint_of_huge_values,
  ),
  Probe(
    'local_models_of_another_model',
    "local_models_dir holding an MLP's client models, asked for CNNs: computed into their own key",
    (*LOCAL[:2], '--config.model=cnn_mnist', *LOCAL[3:], '--workdir={tmp}/second'),
    'success',
    '',
    lambda tmp: _run_quietly(_main(*LOCAL, '--workdir={tmp}/first'), tmp),
  ),
  Probe(
    'fuzzed_uploads',
    '2,000 seeded hostile uploads through the server validator',
    (sys.executable, '-m', 'experiments.dev.probes', '--fuzz_uploads=2000'),
    'success',
    '',
    raw=True,
  ),
]


# ---- running them ----------------------------------------------------------------------------


def _env() -> Dict[str, str]:
  env = dict(os.environ)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env.setdefault('MPLBACKEND', 'Agg')
  env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  return env


def classify(returncode: Optional[int], stderr: str) -> str:
  """'hang' (returncode None), 'traceback', 'error', 'crash' or 'success'."""
  if returncode is None:
    return 'hang'
  if 'Traceback (most recent call last)' in stderr:
    return 'traceback'
  if returncode == 0:
    return 'success'
  if returncode in (1, 2) and _error_line(stderr):
    return 'error'
  return 'crash'


def _error_line(text: str) -> str:
  lines = [l for l in text.splitlines() if l.startswith('error: ')]
  return lines[-1] if lines else ''


def run_probe(probe: Probe, workroot: Optional[pathlib.Path] = None) -> Result:
  """Runs `probe` in a fresh directory (under `workroot`, or a temporary one)."""
  with tempfile.TemporaryDirectory(dir=workroot, prefix=f'{probe.name}.') as d:
    tmp = pathlib.Path(d)
    try:
      cleanup = probe.setup(tmp) if probe.setup else None
    except (OSError, subprocess.SubprocessError) as e:  # the probe could not be set up
      stderr = getattr(e, 'stderr', b'') or b''
      last = (stderr.decode(errors='replace').strip().splitlines() or [str(e)])[-1]
      return Result(probe, '(setup)', 'setup failed', 0.0, last[:300], 0, False)
    port = _free_port()
    argv = [a.format(tmp=tmp, port=port) for a in probe.args]
    if not probe.raw:
      argv = _main(*argv)
    start = time.monotonic()
    try:
      proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
      )
      try:
        out, err = proc.communicate(timeout=probe.timeout_s)
        code = proc.returncode
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    finally:
      if cleanup is not None:
        cleanup()
    seconds = time.monotonic() - start
    stderr = err + out if probe.raw else err
    outcome = classify(code, stderr)
    line = _error_line(stderr)
    ok = outcome == probe.expect and (
      not probe.match or re.search(probe.match, line if outcome == 'error' else stderr) is not None
    )
    shown = ' '.join(shlex.quote(a) for a in argv).replace(str(tmp), '$TMP')
    shown = shown.replace(sys.executable, 'python')
    return Result(
      probe, shown, outcome, seconds, line.replace(str(tmp), '$TMP'), len(stderr.splitlines()), ok
    )


def _cell(text: str, limit: int = 160) -> str:
  text = text if len(text) <= limit else text[: limit - 1] + '…'
  return text.replace('|', '\\|')


def table(results: Sequence[Result]) -> str:
  rows = [
    '| probe | what | command | expected | outcome | s | stderr lines | error line |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for r in results:
    outcome = r.outcome if r.ok else f'**{r.outcome} (not as expected)**'
    rows.append(
      f'| {r.probe.name} | {_cell(r.probe.what)} | `{_cell(r.command, 400)}` | {r.probe.expect} '
      f'| {outcome} | {r.seconds:.1f} | {r.stderr_lines} | {_cell(r.error_line, 240)} |'
    )
  return '\n'.join(rows)


def main(argv: Sequence[str]) -> int:
  args = dict(a[2:].split('=', 1) for a in argv if a.startswith('--') and '=' in a)
  if 'fuzz_uploads' in args:
    return _fuzz_uploads(int(args['fuzz_uploads']))
  only = [n for n in args.get('only', '').split(',') if n]
  unknown = set(only) - {p.name for p in PROBES}
  if unknown:
    print(f'error: unknown probe(s) {sorted(unknown)}; valid: {[p.name for p in PROBES]}')
    return 2
  probes = [p for p in PROBES if not only or p.name in only]
  results = []
  for probe in probes:
    result = run_probe(probe)
    results.append(result)
    print(
      f'{probe.name}: {result.outcome} in {result.seconds:.1f} s '
      f'({"ok" if result.ok else "NOT AS EXPECTED"}) {result.error_line}',
      flush=True,
    )
  out = args.get('out')
  if out:
    bad = [r.probe.name for r in results if not r.ok]
    head = (
      f'Probes run {time.strftime("%Y-%m-%d", time.gmtime())} with '
      f'`python -m experiments.dev.probes` on {os.cpu_count()} CPU cores '
      f'(load average {os.getloadavg()[0]:.1f} at the end): '
      f'{len(results) - len(bad)} of {len(results)} as expected'
      + (f'; not as expected: {", ".join(bad)}' if bad else '')
      + '.\n\n'
    )
    pathlib.Path(out).write_text(head + table(results) + '\n')
  return 0 if all(r.ok for r in results) else 1


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
