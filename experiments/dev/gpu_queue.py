"""The GPU queue: the papers' own budgets in chunks, run whenever a GPU is lent.

A lent GPU comes for about 15 minutes, at most 10 minutes a command, and what comes back from it
is a few small files (no checkpoints). So the papers' budgets are cut into chunks, one (table
cell, seed, method or method group) each, that run as one table command into their own folder;
what finished comes back as one small archive per chunk and is merged here into
docs/results/gpu_queue/, with its backend, device and measured time in the ledger.

On the GPU machine (the repository's working tree; Fashion-MNIST's IDX files under
$JFED_DATA_DIR/fashion-mnist):

    python -m experiments.dev.gpu_queue --next --out=$OUT [--parallel=3] [--limit_s=480]

runs the first `--parallel` chunks the ledger does not hold as done, each in its own process
(the GPU's memory split between them; a chunk marked `alone`, FedMHO's, runs by itself), then
the next batch while at least MIN_START_S of `--limit_s` is left (at most `--max_chunks` in
all), stops any still running after `--limit_s` seconds, and writes OUT/<chunk>.tar.gz: the
chunk's results (tables, results.json, metrics.jsonl and summary.json of every run, figures;
no checkpoints), its log and its ledger entry. Back here:

    python -m experiments.dev.gpu_queue --ingest=DIR    # DIR: the folder the archives came back to
    python -m experiments.dev.gpu_queue --list          # done / partial / next, with measured costs

`--ingest` unpacks each archive, keeps its curated part in docs/results/gpu_queue/<chunk>/ (the
ledger entry and run/'s tables, figures and results.json, which the group's merge reads) and the
raw rest (every run's metrics, summaries and figures, the log) in runs/gpu_queue/<chunk>/, out of
git; it records the chunk in docs/results/gpu_queue/ledger.json and re-renders each table group
that can merge its chunks (docs/results/gpu_queue/<group>/tables.md). A chunk stopped by the
limit is 'partial': its finished runs are kept, `--list` shows how far its runs got, and
`--next` runs it again, whole (checkpoints do not come back), so a chunk that cannot finish in
one call must be cut smaller.
FedMHO's chunks of one seed share their trained client sets on the machine that runs them
(`--clients_root` beside the chunk folders): a call that runs FedAvg/FedDF's chunk, then
DENSE's, trains the baselines' 200-epoch clients once.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app, flags

from jfed.workdir import atomic_write_text

FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / 'docs' / 'results' / 'gpu_queue'
RAW = ROOT / 'runs' / 'gpu_queue'  # git ignores runs/
LEDGER = 'ledger.json'
# What comes back of a chunk's folder: results and curves, never checkpoints or arrays.
KEPT_SUFFIXES = ('.md', '.json', '.jsonl', '.png', '.log')
MAX_KEPT_BYTES = 4 << 20
LOG_TAIL_LINES = 200


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One command of a table sweep, sized for one call on a lent GPU.

  Attributes:
    name: the chunk's key (ledger, archive and folder name).
    group: the table cell it belongs to; chunks of a group are merged into one table.
    module: the table command (`python -m <module>`).
    args: its flags, `--out` excepted.
    merge_args: the flags with which `module --merge=...` renders the group's table; empty when
      the command cannot merge (the group's chunks then keep their own tables).
    alone: runs with no other chunk beside it (the whole GPU and the machine's CPU threads).
    shared_clients: the command takes `--clients_root`: the chunks of a group that one machine
      runs share their trained client sets (FedMHO's baselines train once for FedAvg/FedDF,
      DENSE and Co-Boosting of a seed).
  """

  name: str
  group: str
  module: str
  args: Tuple[str, ...]
  merge_args: Tuple[str, ...] = ()
  alone: bool = False
  shared_clients: bool = False


FEDHYDRA_CONFIG = 'experiments/configs/fedhydra_fashion_mnist.py:paper'
FEDMHO_CONFIG = 'experiments/configs/fedmho_fashion_mnist.py'
HFLDD_CONFIG = 'experiments/configs/hfldd_fashion_mnist.py:paper,c1'
FEDHYDRA_METHODS = ('dense', 'coboosting', 'fedhydra', 'fedavg,ot,feddf')
FEDMHO_RUNS = (
  'fedmho,fedmho_md,fedmho_sd',
  'fedavg_vote,feddf_vote',
  'dense',
  'coboosting',
  'fedcvae_ens',
  'fedmho_md_nofilter,fedmho_sd_nofilter',
  'fedcvae_kd',
)
HFLDD_METHODS = ('hfldd', 'fedavg', 'fedprox', 'fedseq', 'dynafed', 'centralized')
SEEDS = (0, 1, 2)


def _fedhydra(partition: str, seed: int, methods: str) -> Chunk:
  cell = partition.replace('/', '')
  group = f'fedhydra_t1t2_fmnist_{cell}_paper'
  common = (f'--config={FEDHYDRA_CONFIG}', f'--partitions={partition}')
  return Chunk(
    name=f'{group}_s{seed}_{methods.replace(",", "_")}',
    group=group,
    module='experiments.fedhydra_tables',
    args=common + (f'--seeds={seed}', f'--methods={methods}'),
    merge_args=common + ('--methods=fedavg,ot,feddf,dense,coboosting,fedhydra',),
  )


# FedHydra's own chunks above keep the paper's unbounded KD pool and cannot finish in a call
# (skipped in the ledger: 62 of 200 epochs in 470 s). These run it with the pool bounded to a
# uniform reservoir (`fedhydra.pool_limit`, not the paper's; docs/fedhydra.md, "A bounded KD pool")
# in groups of their own. The size, from the H100 chunk of 2026-11-26 (beside two other chunks):
# setup 177 s, epoch 1 15 s (compiles), then per epoch 0.294 s + 6.67 µs per pooled image (a
# least-squares fit of its 61 step times; the KD pass) + about 1.7 µs per pool slot (the
# per-epoch checkpoint: 2.6 s of wall time an epoch beyond the step's for the 1.2 GB pool). At
# N = 61,440 (8 epochs' 7,680 images; 240 KD steps of 256): 0.294 + 0.410 + 0.104 = 0.81 s an
# epoch, 199 × 0.81 = 161 s, 177 + 15 + 161 = 353 s of the call's 470 (a quarter to spare).
FEDHYDRA_POOL_LIMIT = 61440


def _fedhydra_pool(partition: str, seed: int, limit: int = FEDHYDRA_POOL_LIMIT) -> Chunk:
  cell = partition.replace('/', '')
  group = f'fedhydra_t1t2_fmnist_{cell}_paper_pool{limit}'
  common = (
    f'--config={FEDHYDRA_CONFIG}',
    f'--config.fedhydra.pool_limit={limit}',
    f'--partitions={partition}',
  )
  return Chunk(
    name=f'{group}_s{seed}_fedhydra',
    group=group,
    module='experiments.fedhydra_tables',
    args=common + (f'--seeds={seed}', '--methods=fedhydra'),
    merge_args=common + ('--methods=fedhydra',),
  )


def _fedmho(alpha: float, seed: int, runs: str) -> Chunk:
  # Alone: each chunk trains its clients at the paper's 200 local epochs, which beside two other
  # chunks ran at 0.45 epoch/s on an H100 (about 450 s before the server stage; 2026-11-27).
  group = f'fedmho_t3_fmnist_dir{alpha}_paper'
  return Chunk(
    alone=True,
    shared_clients=True,
    name=f'{group}_s{seed}_{runs.replace(",", "_")}',
    group=group,
    module='experiments.fedmho_tables',
    args=(
      f'--config={FEDMHO_CONFIG}',
      '--budget=paper',
      f'--alphas={alpha}',
      f'--seeds={seed}',
      f'--runs={runs}',
    ),
  )


def _hfldd(seed: int, method: str) -> Chunk:
  group = 'hfldd_t3_fmnist_c1_paper'
  common = (f'--config={HFLDD_CONFIG}',)
  return Chunk(
    name=f'{group}_s{seed}_{method}',
    group=group,
    module='experiments.hfldd_compare',
    args=common + (f'--seeds={seed}', f'--methods={method}'),
    merge_args=common + ('--seeds=', f'--methods={",".join(HFLDD_METHODS)}'),
  )


# The parity chunks (experiments/parity): jfed and the authors' code on the same partition and
# seed at the paper's budget. The authors' checkouts travel in `.ref/<name>` (`.device/prepare.sh`
# copies them there from PARITY_REFS) and run under the machine's python3, which has torch.
PARITY_REF_ROOT = '.ref'
PARITY_RUNS = (
  # (reference, parity method, partition alpha, budget, the harness's other flags)
  # FedHydra Table 1's Dir(0.5) cell at its §4.1.5 budget (E = 200, T_g = 200 epochs of
  # T_G = 30 generator steps on 256 images)
  ('dense', 'dense', 0.5, 'local_epochs=200,kd_epochs=200,g_steps=30,synthesis_batch=256', ()),
  # fl_pretrain.sh / co_boosting.sh: 100 local epochs, 200 distillation epochs (the code's set-up:
  # 32x32, [-1, 1], through the adapter's options)
  ('coboosting', 'coboosting', 0.5, 'local_epochs=100,kd_epochs=200', ()),
  # FedMHO Table 7 (Fashion-MNIST): 200 local epochs, 40 CVAE epochs at the code's Adam 5e-2,
  # 20 server epochs, 10 clients on FedDF's split
  (
    'fedmho',
    'all',
    0.5,
    'local_epochs=200,cvae_epochs=40,cvae_lr=0.05,server_epochs=20',
    ('--num_clients=10', '--scheme=feddf_dirichlet'),
  ),
  # the authors' Fashion-MNIST hyperparameters (onefedvae.txt: 25 CVAE epochs, 5,000 samples)
  ('fedcvae', 'fedcvae_ens', 0.5, 'local_epochs=25', ('--scheme=fedcvae_dirichlet',)),
)


def _parity(
  reference: str, method: str, alpha: float, budget: str, flags: Sequence[str], seed: int
) -> Chunk:
  group = f'parity_{reference}_{method}_fmnist_dir{alpha}_paper'
  return Chunk(
    alone=True,  # two processes (the reference's torch and jfed) share the GPU in turn
    name=f'{group}_s{seed}',
    group=group,
    module='experiments.parity',
    args=(
      f'--method={reference}:{method}',
      f'--reference_dir={PARITY_REF_ROOT}/{reference}',
      '--reference_python=python3',
      f'--alpha={alpha}',
      f'--seeds={seed}',
      f'--budget={budget}',
      *flags,
    ),
  )


def chunks() -> List[Chunk]:
  """Every chunk in the order the queue runs them: the parity chunks of each seed first (jfed
  against the authors' code at the paper's budget), then issue 36's headline cells (FedHydra
  Table 1 Dir(0.5) and Table 2 2c/c, each followed by FedHydra with a bounded pool, FedMHO
  Table 3 α = 0.5, HFLDD Table III #C = 1), seed 0 of each before the other seeds. FedTSA's
  paper budget (ResNet-18, 100 rounds of 100 local epochs) is not chunked: a round's state (ten
  ResNet-18s) is larger than what comes back from a call."""
  out = [_parity(*run, seed) for seed in SEEDS for run in PARITY_RUNS]
  for seed in SEEDS:
    for partition in ('dir0.5', '2c/c'):
      out += [_fedhydra(partition, seed, m) for m in FEDHYDRA_METHODS]
      out.append(_fedhydra_pool(partition, seed))
    out += [_fedmho(0.5, seed, r) for r in FEDMHO_RUNS]
    out += [_hfldd(seed, m) for m in HFLDD_METHODS]
  return out


# --- the ledger -------------------------------------------------------------------------------


def read_ledger(results: pathlib.Path) -> Dict[str, dict]:
  path = results / LEDGER
  if not path.exists():
    return {}
  try:
    ledger = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise app.UsageError(f'{path} is not JSON ({e}); restore it from git') from None
  if not isinstance(ledger, dict):
    raise app.UsageError(f'{path} is not an object of chunk entries; restore it from git')
  return ledger


def pending(all_chunks: Sequence[Chunk], ledger: Dict[str, dict]) -> List[Chunk]:
  """The chunks `--next` may run: neither done nor skipped."""
  return [c for c in all_chunks if ledger.get(c.name, {}).get('status') not in ('done', 'skipped')]


def skip(names: Sequence[str], reason: str, results: pathlib.Path = RESULTS) -> None:
  """Marks chunks 'skipped' (with the measured reason): `--next` passes over them, e.g. a chunk
  that cannot finish within one call and cannot be cut smaller."""
  known = {c.name for c in chunks()}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise app.UsageError(f'--skip: not chunks of this queue: {unknown}')
  if not reason:
    raise app.UsageError('--skip needs --reason (what was measured)')
  ledger = read_ledger(results)
  for name in names:
    ledger[name] = {**ledger.get(name, {}), 'status': 'skipped', 'reason': reason}
  results.mkdir(parents=True, exist_ok=True)
  atomic_write_text(results / LEDGER, json.dumps(ledger, indent=2, sort_keys=True) + '\n')


def listing(all_chunks: Sequence[Chunk], ledger: Dict[str, dict]) -> str:
  """One line per chunk: status, measured seconds, device, and the runs' progress."""
  rows = [
    '| # | chunk | status | seconds | device | date | progress |',
    '|---|---|---|---:|---|---|---|',
  ]
  next_name = next((c.name for c in pending(all_chunks, ledger)), None)
  for i, c in enumerate(all_chunks, 1):
    e = ledger.get(c.name)
    status = e['status'] if e else 'not run'
    if c.name == next_name:
      status += ' (next)'
    rows.append(
      f'| {i} | {c.name} | {status} | {e.get("seconds", "") if e else ""} | '
      f'{e.get("device", "") if e else ""} | {e.get("date", "") if e else ""} | '
      f'{(e.get("progress") or e.get("reason", "")) if e else ""} |'
    )
  return '\n'.join(rows)


# --- running chunks (on the GPU machine) ---------------------------------------------------------


def run_progress(folder: pathlib.Path) -> str:
  """How far each run in `folder` got: '<run>: <last step> (<last test accuracy>)', from the
  last record of its metrics.jsonl that has a step."""
  parts = []
  for metrics in sorted(folder.rglob('metrics.jsonl')):
    last = None
    for line in metrics.read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and 'step' in record:
        last = record
    if last is not None:
      run = metrics.parent.relative_to(folder).as_posix()
      acc = last.get('test_accuracy')
      parts.append(f'{run}: step {last["step"]}' + (f' ({acc:.4f})' if acc is not None else ''))
  return '; '.join(parts)


# A phase's progress line (jfed.engine.progress), e.g.
# 'local training [vgg9 x5] 55/200 epochs    0.47 epoch/s    118s eta   311s'.
PHASE_LINE = re.compile(
  r'^(?P<phase>\S.*?) (?P<done>\d+)/(?P<total>\d+) (?P<unit>[a-z]+)\b.*?'
  r'(?P<elapsed>\d+)s eta\s+(?P<eta>\d+)s\s*$'
)


def log_progress(log: pathlib.Path) -> str:
  """The last phase progress line of a chunk's log, for a chunk stopped before any run recorded
  a step: '<phase> <done>/<total> <unit> after <elapsed> s (eta <eta> s)'; '' when none."""
  if not log.exists():
    return ''
  for line in reversed(log.read_text(errors='replace').splitlines()):
    m = PHASE_LINE.match(line.strip())
    if m:
      return (
        f'{m["phase"]} {m["done"]}/{m["total"]} {m["unit"]} after {m["elapsed"]} s '
        f'(eta {m["eta"]} s)'
      )
  return ''


def machine() -> Dict[str, str]:
  """The backend, device kind and JAX version the chunks ran on, as the sweeps record them.
  Called once the chunks have ended, and without preallocation, so that this process takes no
  GPU memory from them."""
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
  from experiments.seed_tables import machine_meta  # pylint: disable=g-import-not-at-top

  return machine_meta()


def start(chunk: Chunk, folder: pathlib.Path, memory_fraction: float) -> subprocess.Popen:
  folder.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f'{memory_fraction:.2f}')
  env['PYTHONUNBUFFERED'] = '1'
  log = open(folder / 'chunk.log', 'w')  # pylint: disable=consider-using-with
  args = [*chunk.args, f'--out={folder / "run"}']
  if chunk.shared_clients:  # beside the chunks' folders: never packed
    args.append(f'--clients_root={folder.parent / "clients" / chunk.group}')
  return subprocess.Popen(
    [sys.executable, '-m', chunk.module, *args],
    cwd=ROOT,
    env=env,
    stdout=log,
    stderr=subprocess.STDOUT,
    start_new_session=True,  # the limit stops the command and every process it started
  )


def stop(process: subprocess.Popen) -> None:
  for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
    if process.poll() is not None:
      return
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    try:
      process.wait(wait)
    except subprocess.TimeoutExpired:
      pass


def has_errors(folder: pathlib.Path) -> bool:
  """Whether a results.json in `folder` records a run that failed."""
  for path in folder.rglob('results.json'):
    if '"status": "error"' in path.read_text():
      return True
  return False


def pack(chunk: Chunk, folder: pathlib.Path, entry: dict, out: pathlib.Path) -> pathlib.Path:
  """OUT/<chunk>.tar.gz: the entry and the folder's small result files."""
  atomic_write_text(folder / 'entry.json', json.dumps(entry, indent=2) + '\n')
  log = folder / 'chunk.log'
  if log.exists():  # the log's end says why a chunk stopped; its progress lines run to megabytes
    lines = log.read_text(errors='replace').splitlines()[-LOG_TAIL_LINES:]
    atomic_write_text(log, '\n'.join(lines) + '\n')
  archive = out / f'{chunk.name}.tar.gz'
  with tarfile.open(archive, 'w:gz') as tar:
    for path in sorted(folder.rglob('*')):
      if (
        path.is_file()
        and path.suffix in KEPT_SUFFIXES
        and path.stat().st_size <= MAX_KEPT_BYTES
        and 'checkpoints' not in path.relative_to(folder).parts
      ):
        tar.add(path, arcname=path.relative_to(folder).as_posix())
  return archive


def next_batch(queue: Sequence[Chunk], parallel: int) -> List[Chunk]:
  """The chunks the next call runs side by side: the first pending chunk alone if it must run
  alone, else up to `parallel` pending chunks in queue order, stopping before one that must."""
  batch: List[Chunk] = []
  for chunk in queue[:parallel]:
    if chunk.alone:
      return batch or [chunk]
    batch.append(chunk)
  return batch


POLL_S = 2.0  # how often run_next looks at its chunks
# A batch is started only with this much of the call's limit left: less finishes no chunk.
MIN_START_S = 90.0


def run_next(
  out: pathlib.Path,
  parallel: int,
  limit_s: float,
  scratch: pathlib.Path,
  max_chunks: int = 6,
) -> List[str]:
  """Runs the pending chunks, `parallel` side by side (or one that must run alone), batch after
  batch while at least MIN_START_S of the `limit_s` seconds is left and at most `max_chunks`
  in all (a call brings back 8 files), and packs each into `out`; returns their names. A batch
  still running at the limit is stopped."""
  t0, ran = time.time(), []
  queue = pending(chunks(), read_ledger(RESULTS))  # the ledger changes only at --ingest
  while True:
    left = limit_s - (time.time() - t0)
    queue = [c for c in queue if c.name not in ran]
    batch = next_batch(queue, parallel)
    if not batch:
      if not ran:
        print('The queue is empty: every chunk is done.')
      return ran
    if ran and (left < MIN_START_S or len(ran) + len(batch) > max_chunks):
      return ran
    run_batch(batch, out, left, scratch)
    ran += [c.name for c in batch]


def run_batch(
  batch: Sequence[Chunk], out: pathlib.Path, limit_s: float, scratch: pathlib.Path
) -> None:
  """Runs `batch` side by side for at most `limit_s` seconds and packs each chunk into `out`."""
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  running = {}
  for chunk in batch:
    print(f'start {chunk.name}: {chunk.module} {" ".join(chunk.args)}', flush=True)
    running[chunk.name] = (chunk, start(chunk, scratch / chunk.name, 0.9 / len(batch)))
  seconds = {}
  while len(seconds) < len(batch):
    time.sleep(POLL_S)
    for name, (_, process) in running.items():
      if name not in seconds and process.poll() is not None:
        seconds[name] = round(time.time() - t0)
        print(f'end {name}: exit {process.returncode} after {seconds[name]} s', flush=True)
    if time.time() - t0 > limit_s:
      for name, (_, process) in running.items():
        if name not in seconds:
          stop(process)
          seconds[name] = None
          print(f'stopped {name} at the {limit_s:.0f} s limit', flush=True)
  meta = machine()
  for name, (chunk, process) in running.items():
    folder = scratch / name
    if seconds[name] is None:
      status = 'partial'
    elif process.returncode != 0 or has_errors(folder):
      status = 'failed'
    else:
      status = 'done'
    entry = {
      'status': status,
      'seconds': seconds[name] if seconds[name] is not None else f'>{limit_s:.0f}',
      'parallel': len(batch),
      'returncode': process.returncode,
      'progress': run_progress(folder / 'run') or log_progress(folder / 'chunk.log'),
      'command': f'python -m {chunk.module} {" ".join(chunk.args)}',
      'backend': meta['backend'],
      'device': meta['device_kind'],
      'jax': meta['jax_version'],
      'date': time.strftime('%Y-%m-%d', time.gmtime()),
    }
    print(f'{name}: {status}; {entry["progress"]}', flush=True)
    pack(chunk, folder, entry, out)


# --- ingesting what came back (here) -----------------------------------------------------------


def _extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
  """Unpacks `archive` into `dest`, refusing members that would land outside it or are not plain
  files or folders (a hostile or broken archive)."""
  with tarfile.open(archive, 'r:gz') as tar:
    for member in tar.getmembers():
      target = (dest / member.name).resolve()
      if not (member.isfile() or member.isdir()) or dest.resolve() not in target.parents:
        raise app.UsageError(f'{archive}: member {member.name!r} is not a file inside the chunk')
    tar.extractall(dest)  # every member checked above


def curated(relative: pathlib.PurePath) -> bool:
  """Whether a chunk's file stays in docs/results: its ledger entry and run/'s own tables,
  figures and results.json (what a table links to and the group's merge reads)."""
  parts = relative.parts
  if parts == ('entry.json',):
    return True
  return (
    len(parts) == 2
    and parts[0] == 'run'
    and (parts[1] == 'results.json' or relative.suffix in ('.md', '.png'))
  )


def set_raw_aside(dest: pathlib.Path, raw: pathlib.Path) -> None:
  """Moves what `curated` does not keep from the chunk folder `dest` to `raw` (replaced)."""
  if raw.exists():
    shutil.rmtree(raw)
  for path in sorted(dest.rglob('*')):
    relative = path.relative_to(dest)
    if path.is_file() and not curated(relative):
      (raw / relative).parent.mkdir(parents=True, exist_ok=True)
      shutil.move(path, raw / relative)
  for folder in sorted((p for p in dest.rglob('*') if p.is_dir()), reverse=True):
    if not any(folder.iterdir()):
      folder.rmdir()


def render_group(group: str, members: Sequence[Chunk], results: pathlib.Path) -> Optional[str]:
  """Re-renders a group's merged table from its finished chunks, if its command can merge."""
  mergeable = [
    c for c in members if c.merge_args and (results / c.name / 'run' / 'results.json').exists()
  ]
  if not mergeable:
    return None
  dirs = ','.join(str(results / c.name / 'run') for c in mergeable)
  out = results / group
  subprocess.run(
    [
      sys.executable,
      '-m',
      mergeable[0].module,
      *mergeable[0].merge_args,
      f'--merge={dirs}',
      f'--out={out}',
    ],
    cwd=ROOT,
    check=True,
    stdout=subprocess.DEVNULL,
  )
  return str(out)


def ingest(
  folder: pathlib.Path, results: pathlib.Path = RESULTS, raw: pathlib.Path = RAW
) -> List[str]:
  """Merges every <chunk>.tar.gz in `folder` into `results` (its raw part into `raw`); returns
  the chunks ingested."""
  known = {c.name: c for c in chunks()}
  archives = sorted(folder.glob('*.tar.gz'))
  if not archives:
    raise app.UsageError(f'{folder} holds no <chunk>.tar.gz')
  ledger = read_ledger(results)
  names = []
  for archive in archives:
    name = archive.name[: -len('.tar.gz')]
    if name not in known:  # e.g. the device script's mutation.tar.gz beside the chunks
      print(f'{archive}: {name!r} is not a chunk of this queue, left alone')
      continue
    dest = results / name
    if ledger.get(name, {}).get('status') == 'done':
      print(f'{name}: already done here, kept as it is')
      continue
    if dest.exists():  # an earlier partial run of the chunk: replaced, not mixed
      shutil.rmtree(dest)
    dest.mkdir(parents=True)
    _extract(archive, dest)
    entry = json.loads((dest / 'entry.json').read_text())
    entry['progress'] = entry.get('progress') or log_progress(dest / 'chunk.log')
    set_raw_aside(dest, raw / name)
    ledger[name] = entry
    names.append(name)
  results.mkdir(parents=True, exist_ok=True)
  atomic_write_text(results / LEDGER, json.dumps(ledger, indent=2, sort_keys=True) + '\n')
  for group in sorted({known[n].group for n in names}):
    rendered = render_group(group, [c for c in chunks() if c.group == group], results)
    if rendered:
      print(f'{group}: table in {rendered}/tables.md')
  return names


def main(argv):
  del argv
  if FLAGS.skip:
    skip(FLAGS.skip, FLAGS.reason)
  if FLAGS.ingest:
    for name in ingest(pathlib.Path(FLAGS.ingest)):
      print(f'ingested {name}')
  elif FLAGS.next:
    if not FLAGS.out:
      raise app.UsageError('--next needs --out (the folder the archives go to)')
    run_next(
      pathlib.Path(FLAGS.out),
      FLAGS.parallel,
      FLAGS.limit_s,
      pathlib.Path(FLAGS.scratch),
      FLAGS.max_chunks,
    )
  if FLAGS.list or not (FLAGS.next or FLAGS.ingest or FLAGS.skip):
    print(listing(chunks(), read_ledger(RESULTS)))


if __name__ == '__main__':
  flags.DEFINE_bool('list', False, 'Show every chunk: done, partial, next, measured cost.')
  flags.DEFINE_bool(
    'next',
    False,
    'Run the pending chunks, --parallel side by side, batch after batch within --limit_s (on a '
    'GPU machine).',
  )
  flags.DEFINE_string('out', None, 'With --next: where the chunk archives are written.')
  flags.DEFINE_string('ingest', None, 'Merge the chunk archives in this folder into docs/results.')
  flags.DEFINE_integer('parallel', 3, 'Chunks run side by side, the GPU memory split between them.')
  flags.DEFINE_float('limit_s', 480, 'Chunks still running after this many seconds are stopped.')
  flags.DEFINE_integer('max_chunks', 6, 'With --next: at most this many chunks (archives) a call.')
  flags.DEFINE_list('skip', [], "Mark these chunks 'skipped' (needs --reason).")
  flags.DEFINE_string('reason', '', 'With --skip: why, with what was measured.')
  flags.DEFINE_string('scratch', '/tmp/jfed-gpu-queue', "Where the chunks' run folders live.")
  app.run(main)
