"""Does FedHydra's mixed-precision MS keep its accuracy? float32 against bfloat16 MS, over seeds.

    python -m experiments.ms_precision --config=experiments/configs/fedhydra_digits.py:quick \
        --out=runs/ms_precision_digits [--seeds=0,1,2] [--doc=docs/results/ms_precision_digits.md]

Every (dtype, seed) is one FedHydra run (`jfed.driver.run_experiment`) into
OUT/<dtype>/seed<s>/ with `fedhydra.ms_compute_dtype` set to that dtype and everything else
from --config (rerunning resumes and skips finished runs). Issue 34's bar: bfloat16 MS (G and
F_k compute in bf16; G's parameters, Adam state and the losses in float32) within 0.5 points of
float32 MS in final test accuracy on digits. Writes OUT/results.json and OUT/ms_precision.md:
final and best test accuracy mean ± std over seeds per dtype, the paired difference of the
final accuracies (bfloat16 - float32, mean ± std over seeds), the largest difference of the
SA weights U_r and U_c between the two dtypes' MS, and MS seconds (backend named). On a CPU
bf16 is emulated and slower; the speed is the accelerator's (experiments.bench.model_stratification,
form batched_bf16).
"""

import pathlib
import shutil
import time
from typing import Sequence

from absl import flags, logging
import numpy as np

from experiments import sweep
from experiments.seed_tables import backend_line, mean_std, seed_values

FLAGS = flags.FLAGS

DTYPES = ('float32', 'bfloat16')
CELL = 'ms_precision'  # results.json's one cell: results[CELL][seed][dtype]
SUMMARY_KEYS = ('final_test_accuracy', 'best_test_accuracy', 'seconds')
BAR_POINTS = 0.5  # issue 34: bf16 MS within this many points of float32 MS


def define_flags() -> None:
  sweep.define_flags(
    'runs/ms_precision', merge=False, config='FedHydra config file (FILE or FILE:words).'
  )
  flags.DEFINE_string('doc', '', 'Also write the table here.')


def run_config(config, dtype: str, seed: int):
  c = config.copy_and_resolve_references()
  c.seed = seed
  c.fedhydra.ms_compute_dtype = dtype
  return c


def _ms_weights(workdir: pathlib.Path) -> dict:
  """The first round's MS weights FedHydra saved (model_stratification.npz)."""
  with np.load(workdir / 'model_stratification.npz') as saved:
    return {name: np.asarray(saved[name]).tolist() for name in ('U_r', 'U_c', 'seconds')}


def _verdict(diffs: Sequence[float]) -> str:
  """Whether the mean paired difference (fractions) is within BAR_POINTS, at two standard
  errors: a seed-to-seed spread wider than the bar decides nothing."""
  mean = 100 * abs(float(np.mean(diffs)))
  two_se = 200 * float(np.std(diffs, ddof=1)) / np.sqrt(len(diffs)) if len(diffs) > 1 else np.inf
  if mean + two_se <= BAR_POINTS:
    return f'**within** the {BAR_POINTS} point bar (|mean| + 2 standard errors)'
  if mean - two_se > BAR_POINTS:
    return f'**not within** the {BAR_POINTS} point bar (|mean| - 2 standard errors)'
  return (
    f'**not decided**: |mean| ± 2 standard errors ({mean:.2f} ± {two_se:.2f}) spans the '
    f'{BAR_POINTS} point bar'
  )


def render(config, results: dict, meta: dict) -> str:
  c = config.fedhydra
  lines = [
    f'# FedHydra with float32 and bfloat16 model stratification on {config.dataset.name}',
    '',
    f'Command: `python -m experiments.ms_precision` ({meta["date"]}; '
    f'{backend_line(results, meta)}; seeds {meta["seeds"]}).',
    '',
    f'FedHydra, {config.partition.num_clients} clients ({config.partition.scheme}), model '
    f'{config.model}; MS: T_G = {c.ms_T_G}, batch {c.ms_batch}, Adam lr {c.ms_lr}, form '
    f"{c.ms_impl}. bfloat16: the generators and teachers compute in bf16, the generators' "
    'parameters, Adam state and the recorded losses stay float32.',
    '',
    'Test accuracy (%), mean ± std over seeds.',
    '',
    '| MS compute dtype | final accuracy | best accuracy | MS seconds | run seconds |',
    '|---|---:|---:|---:|---:|',
  ]
  for dtype in DTYPES:
    cells = [
      mean_std(seed_values(results, CELL, dtype, key)) or '—'
      for key in ('final_test_accuracy', 'best_test_accuracy')
    ]
    ms_s = mean_std(seed_values(results, CELL, dtype, 'ms_seconds'), scale=1.0, digits=1) or '—'
    run_s = mean_std(seed_values(results, CELL, dtype, 'seconds'), scale=1.0, digits=1) or '—'
    lines.append(f'| {dtype} | {cells[0]} | {cells[1]} | {ms_s} | {run_s} |')
  f32, bf16 = DTYPES
  paired = [
    runs
    for _, runs in sorted(results.get(CELL, {}).items())
    if all(sweep.is_finished(runs.get(d)) for d in DTYPES)
  ]
  if paired:
    diffs = [r[bf16]['final_test_accuracy'] - r[f32]['final_test_accuracy'] for r in paired]
    weight_gap = max(
      float(np.max(np.abs(np.subtract(r[bf16][k], r[f32][k]))))
      for r in paired
      for k in ('U_r', 'U_c')
    )
    lines += [
      '',
      f'- final accuracy, bfloat16 - float32, paired by seed: {mean_std(diffs)} points '
      f'(n = {len(diffs)}): {_verdict(diffs)}.',
      f"- largest |U_r| or |U_c| difference between the dtypes' first-round MS: {weight_gap:.3g}.",
    ]
  return '\n'.join(lines) + '\n'


def run_table(config, out: pathlib.Path, seeds: Sequence[int], doc: str = '') -> str:
  """Runs every (dtype, seed) not finished yet; rewrites results.json and the table after
  each run; returns the table."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top
  from jfed.workdir import atomic_write_text  # pylint: disable=g-import-not-at-top

  out.mkdir(parents=True, exist_ok=True)
  s = sweep.Sweep.open(out, sorted(seeds))
  s.render = lambda s: {'ms_precision.md': render(config, s.results, s.meta)}

  def execute(dtype: str, seed: int, workdir: pathlib.Path) -> sweep.Record:
    t0 = time.perf_counter()
    summary = run_experiment('fedhydra', run_config(config, dtype, seed), workdir, progress=False)
    record = sweep.summary_record(summary, SUMMARY_KEYS)
    record['wall_seconds'] = time.perf_counter() - t0
    weights = _ms_weights(workdir)
    record.update(U_r=weights['U_r'], U_c=weights['U_c'], ms_seconds=weights['seconds'])
    return record

  for seed in seeds:
    for dtype in DTYPES:
      workdir = out / dtype / f'seed{seed}'
      s.run_one(
        CELL,
        seed,
        dtype,
        lambda: execute(dtype, seed, workdir),  # pylint: disable=cell-var-from-loop
        f'{dtype} seed={seed} -> {workdir}',
      )
  s.save()
  table = s.text('ms_precision.md')
  if doc:
    target = pathlib.Path(doc)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, table)
    shutil.copyfile(out / 'results.json', target.with_suffix('.json'))
  return table


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  print(run_table(FLAGS.config, pathlib.Path(FLAGS.out), [int(s) for s in FLAGS.seeds], FLAGS.doc))


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
