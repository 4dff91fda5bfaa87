"""jfed side by side with the authors' own code, on the same client data.

  python -m experiments.parity --method=dense:fedavg --reference_dir=PATH/TO/DENSE \
      --reference_python=PATH/TO/venv/bin/python --seeds=0,1,2 --alpha=0.5 \
      --budget=local_epochs=10 --out=runs/parity/dense_dir0.5

`--method=REFERENCE:METHOD` names the authors' code (a module `experiments/parity/ref_<name>.py`)
and what of it to compare. Per seed: jfed draws the client partition (`jfed.data.make_partition`)
and writes its index lists to `<out>/seed<s>/partition.json`; the reference runs from a scratch
copy of `--reference_dir` through its shim (experiments/parity/shims/: device, data path,
partition file, W&B stubs; the budget goes as the reference's own flags) in a subprocess, one
per stage; jfed runs its methods on the same index lists (experiments/parity/jfed_side.py). Both
score on the full test split. Each side's results are kept (`reference_<name>_<stage>.json`,
`jfed.json`), so a rerun skips what is done, and `--side=reference` / `--side=jfed` run the two
sides in separate processes. `<out>/parity_<name>_<method>.md` is the table: per-client local
accuracy, the teacher ensemble, each method's final (and best) accuracy per seed, and over the
seeds the mean ± std of both sides with a paired test and an equivalence test
(experiments/parity/stats.py).

The reference's dependencies (torch, torchvision, ...) live in the interpreter given by
`--reference_python`; jfed's process never imports them.
"""

import gzip
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import List

from absl import app, flags, logging
import numpy as np

from experiments.parity import references
from experiments.parity.tables import read_json as _read_json
from experiments.parity.tables import render
from jfed.workdir import atomic_write_bytes, atomic_write_text

FLAGS = flags.FLAGS
flags.DEFINE_string('method', None, 'What to compare: REFERENCE:METHOD, e.g. dense:fedavg.')
flags.DEFINE_string('reference_dir', None, "A checkout of the authors' code (never edited).")
flags.DEFINE_string('reference_python', sys.executable, 'The interpreter with its dependencies.')
flags.DEFINE_string('out', None, 'Output directory (partitions, both sides, parity.md).')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds: each its own partition and both runs.')
flags.DEFINE_string('dataset', 'fashion_mnist', 'Dataset (the reference must know it).')
flags.DEFINE_string('data_dir', '', "jfed's data directory ('' : its default search).")
flags.DEFINE_integer('num_clients', 5, 'Clients.')
flags.DEFINE_string('scheme', 'dirichlet', "jfed's partition scheme (dirichlet: NIID-Bench's).")
flags.DEFINE_float('alpha', 0.5, 'Dirichlet concentration.')
flags.DEFINE_list(
  'budget',
  [],
  "key=value pairs over the reference's default budget (both sides), e.g. "
  'local_epochs=10,kd_epochs=20; the keys are those of its DEFAULT_BUDGET.',
)
flags.DEFINE_enum('side', 'both', ['both', 'reference', 'jfed', 'table'], 'What to run.')
flags.DEFINE_integer('torch_threads', 2, 'OMP_NUM_THREADS of the reference process.')
flags.DEFINE_integer(
  'jfed_seed_offset',
  0,
  "Added to jfed's config seed (its init, data order and server keys), not to the partition's.",
)
flags.DEFINE_integer(
  'reference_seed_offset',
  0,
  "Added to the seed the reference is given (its init and data order), not to the partition's: "
  "a second reference run on the same clients measures the reference's own run-to-run spread.",
)
flags.DEFINE_string(
  'publish',
  None,
  "Also copy the table and every seed's results (not partitions, models or logs) here, e.g. "
  'docs/results/parity/<name>.',
)

# the file names torchvision's MNIST-style datasets look for under <root>/<Class>/raw
TORCHVISION_NAMES = {
  ('train', 'images'): 'train-images-idx3-ubyte',
  ('train', 'labels'): 'train-labels-idx1-ubyte',
  ('test', 'images'): 't10k-images-idx3-ubyte',
  ('test', 'labels'): 't10k-labels-idx1-ubyte',
}


def load_dataset():
  from jfed.data import load_dataset as load  # pylint: disable=g-import-not-at-top

  return load(FLAGS.dataset, FLAGS.data_dir or None)


def write_json(path: pathlib.Path, value) -> None:
  """`value` as JSON, its keys in their order (the tables keep the order of the rows)."""
  atomic_write_text(path, json.dumps(value, indent=1))


def write_partition(seed_dir: pathlib.Path, labels: np.ndarray, seed: int) -> List[np.ndarray]:
  """jfed's partition of this seed, as JSON index lists the reference's shim reads."""
  from jfed.data import make_partition  # pylint: disable=g-import-not-at-top

  path = seed_dir / 'partition.json'
  kwargs = {'alpha': FLAGS.alpha} if 'dirichlet' in FLAGS.scheme else {}
  parts = make_partition(labels, FLAGS.num_clients, FLAGS.scheme, seed, **kwargs)
  if path.is_file():
    stored = [np.asarray(p, np.int64) for p in json.loads(path.read_text())]
    if len(stored) != len(parts) or any(not np.array_equal(a, b) for a, b in zip(stored, parts)):
      raise SystemExit(f'error: {path} holds another partition: use a new --out')
  else:
    seed_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, [p.tolist() for p in parts])
  return parts


def torchvision_root(out: pathlib.Path, folder: str) -> pathlib.Path:
  """The IDX files jfed reads, decompressed where torchvision's MNIST classes look for them."""
  from jfed.data.datasets import idx_files  # pylint: disable=g-import-not-at-top

  root = out / 'torchvision_data'
  raw = root / folder / 'raw'
  raw.mkdir(parents=True, exist_ok=True)
  for (split, kind), src in idx_files(FLAGS.dataset, FLAGS.data_dir or None).items():
    dst = raw / TORCHVISION_NAMES[(split, kind)]
    if not dst.is_file():
      opener = gzip.open if src.suffix == '.gz' else open
      with opener(src, 'rb') as f:
        data = f.read()
      atomic_write_bytes(dst, data)
  return root


def run_reference(ref, method, out: pathlib.Path, seed: int, seed_dir: pathlib.Path, budget):
  code = ref.prepare(pathlib.Path(FLAGS.reference_dir).resolve(), out)
  data_root = torchvision_root(out, ref.torchvision_folder[FLAGS.dataset])
  cwd = seed_dir / f'reference_{ref.name}'
  (cwd / 'df_ckpt').mkdir(parents=True, exist_ok=True)
  for stage in method.stages:
    result_path = seed_dir / f'reference_{ref.name}_{stage}.json'
    if result_path.is_file():
      continue
    raw = cwd / f'{stage}_recorded.json'
    ref_seed = seed + FLAGS.reference_seed_offset
    names = ref.datasets[FLAGS.dataset]
    args = list(ref.stage_args(stage, names, budget, ref_seed, FLAGS.num_clients))
    cmd = [
      FLAGS.reference_python,
      str(ref.shim),
      f'--ref_dir={code}',
      f'--partition={seed_dir / "partition.json"}',
      f'--data_root={data_root}',
      f'--result={raw}',
      '--',
      *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(FLAGS.torch_threads), PYTHONUNBUFFERED='1')
    print(f'reference {ref.name} {stage}, seed {seed}: {" ".join(args)}', flush=True)
    start = time.time()
    with open(cwd / f'{stage}.log', 'w') as log:
      rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
      raise SystemExit(f'error: the reference exited with {rc}; see {cwd / f"{stage}.log"}')
    result = ref.read(stage, json.loads(raw.read_text()), FLAGS.num_clients, budget)
    result.update(seconds=time.time() - start, args=args)
    write_json(result_path, result)


def run_jfed(method, seed: int, seed_dir: pathlib.Path, dataset, parts, budget) -> None:
  from experiments.parity import jfed_side  # pylint: disable=g-import-not-at-top
  from jfed.configs.base import base_config  # pylint: disable=g-import-not-at-top

  path = seed_dir / 'jfed.json'
  previous = _read_json(path) or {}
  done = previous.get('methods', {})
  if all(m in done for m in method.jfed_methods):
    return
  config = base_config()
  config.seed = seed + FLAGS.jfed_seed_offset
  config.dataset.name = FLAGS.dataset
  config.dataset.data_dir = FLAGS.data_dir
  config.partition.num_clients = FLAGS.num_clients
  config.logging.tensorboard = False
  for key, value in method.jfed_overrides(budget).items():
    section, _, field = key.rpartition('.')
    (config[section] if section else config)[field] = value
  start = time.time()
  result = jfed_side.run_methods(
    config,
    dataset,
    parts,
    method.jfed_methods,
    budget['local_epochs'],
    seed_dir / 'jfed_local_models',
    done,
    method.jfed_local,
  )
  result['seconds'] = time.time() - start
  write_json(path, result)


def main(argv):
  del argv
  if not FLAGS.out or not FLAGS.method:
    raise app.UsageError('--method and --out are required')
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  try:
    ref, method = references.find_method(FLAGS.method)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.dataset not in ref.datasets:
    raise app.UsageError(f'{ref.name} runs on {sorted(ref.datasets)}, not {FLAGS.dataset!r}')
  out = pathlib.Path(FLAGS.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  try:
    budget = references.parse_budget(ref.default_budget, FLAGS.budget)
  except ValueError as e:
    raise app.UsageError(f'--budget: {e}') from None
  seeds = [int(s) for s in FLAGS.seeds]
  params_path = out / f'parity_{ref.name}_{FLAGS.method.partition(":")[2] or ref.name}.json'
  if FLAGS.side != 'table':
    write_json(params_path, {'flags': FLAGS.flag_values_dict(), 'budget': budget})
    if FLAGS.side in ('both', 'reference') and not FLAGS.reference_dir:
      raise app.UsageError('--reference_dir is required to run the reference')
    dataset = load_dataset()
    for seed in seeds:
      seed_dir = out / f'seed{seed}'
      parts = write_partition(seed_dir, dataset.train_y, seed)
      if FLAGS.side in ('both', 'reference'):
        run_reference(ref, method, out, seed, seed_dir, budget)
      if FLAGS.side in ('both', 'jfed'):
        run_jfed(method, seed, seed_dir, dataset, parts, budget)
  text = render(out, ref, method, seeds, _read_json(params_path) or {})
  params_path.with_suffix('.md').write_text(text)
  if FLAGS.publish:
    publish(out, pathlib.Path(FLAGS.publish), params_path, seeds)
  print(text)


def publish(out: pathlib.Path, dest: pathlib.Path, params_path: pathlib.Path, seeds) -> None:
  """The table, its parameters and each seed's result files (small JSON) under `dest`."""
  dest.mkdir(parents=True, exist_ok=True)
  for path in (params_path, params_path.with_suffix('.md')):
    (dest / path.name).write_bytes(path.read_bytes())
  for s in seeds:
    for path in sorted((out / f'seed{s}').glob('*.json')):
      if path.name == 'partition.json':  # jfed redraws it from the seed
        continue
      (dest / f'seed{s}').mkdir(exist_ok=True)
      (dest / f'seed{s}' / path.name).write_bytes(path.read_bytes())


if __name__ == '__main__':
  app.run(main)
