"""KIP distillation throughput: all clients in one jitted program vs a per-client loop, and the
KIP notebook's reference setting for one client.

    python -m experiments.bench.kip [--clients=10,100] [--iterations=10] [--support=400]
        [--target_batch=10] [--samples=600] [--noreference] [--reference_steps=300]
        [--out=FILE.json]

1. HFLDD setting (seed 003 Sec. VI-A4: 400 distilled images per client, target minibatch 10,
   lr 0.004, FC1 NTK, float32) for m clients of `samples` random 28x28x1 images each, the same
   `iterations` for both forms:
   - batched: `jfed.kip.kip_distill_batched` (vmap over the client axis, one program, no mesh);
   - loop: `jfed.kip.kip_distill_loop` (the single-client jitted program in a Python loop).
   Compilation is excluded: the batched program is compiled ahead of time
   (`.lower(...).compile()`, its time reported) and the compiled executable is timed; the loop
   runs one warm-up client first (every client shares the program). Both end with
   `jax.block_until_ready`.
2. Reference (KIP notebook, reference-code.md §6): FC1 NTK, support 100, target batch 5000,
   300 Adam steps at lr 0.04, float64 (`jax_enable_x64` in the notebook), one client with
   10,000 random images of `--reference_shape` (default 32x32x3, CIFAR-10's), compiled ahead
   of time and timed; to set beside the public notebook's ~63 s for the same loop (on its own,
   unspecified hardware: not a like-for-like comparison).

KIP's cost does not depend on pixel values, so random data is used (no dataset needed).
Prints a Markdown table with the backend, jax version, CPU count and load average; `--out`
also writes it and the raw numbers as JSON. Default runtime: 5 min 7 s measured on 2 loaded
CPU cores (~1.5 min of it in the float64 reference); `--noreference` or smaller --clients/
--iterations/--support shrink it.

Measured on XLA:CPU (2 cores, load ~5, jax 0.10.2): the batched program is 0.55x the loop's
speed at m=10 and 1.9x at m=100 (batched Cholesky/matmuls on CPU gain little; the one-program
form is meant for accelerators, where the loop is dispatch-bound); the reference setting ran
300 float64 steps in 78 s (+7 s compile), beside the notebook's ~63 s on its own hardware.
"""

import json
import os
import platform
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.machine import cpu_count, load_average, log

FLAGS = flags.FLAGS
flags.DEFINE_list('clients', ['10', '100'], 'Numbers of clients m.')
flags.DEFINE_integer('iterations', 10, 'KIP iterations per client (same for batched and loop).')
flags.DEFINE_integer('support', 400, 'Distilled images per client (HFLDD: 400).')
flags.DEFINE_integer('target_batch', 10, 'Real samples per KIP step (HFLDD: 10).')
flags.DEFINE_integer('samples', 600, 'Real images per client (100 Fashion-MNIST clients: 600).')
flags.DEFINE_bool('reference', True, 'Also time the KIP notebook setting for one client.')
flags.DEFINE_integer('reference_steps', 300, 'Steps of the reference setting (notebook: 300).')
flags.DEFINE_list('reference_shape', ['32', '32', '3'], 'Image shape of the reference setting.')
flags.DEFINE_bool('reference_x64', True, 'Run the reference in float64 like the notebook.')
flags.DEFINE_string('out', None, 'Optional JSON file for the table and the raw numbers.')

NUM_CLASSES = 10
NOTEBOOK_SECONDS = 63.0  # the public KIP notebook's reported time for its default loop


def make_clients(m: int, n: int, shape, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.random((m, n, *shape), dtype=np.float32)
  y = rng.integers(0, NUM_CLASSES, (m, n)).astype(np.int32)
  return x, y, np.full(m, n, np.int32)


def _ready(tree):
  return jax.block_until_ready(tree)


def time_batched(x, y, sizes, config, key):
  from jfed.kip.kip import _batched_program

  prog = _batched_program(config, NUM_CLASSES, None)
  args = (
    jnp.asarray(x),
    jnp.asarray(y),
    jnp.asarray(sizes),
    jnp.arange(len(sizes), dtype=jnp.int32),
    key,
  )
  t0 = time.perf_counter()
  compiled = prog.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  res = _ready(compiled(*args))
  return compile_s, time.perf_counter() - t0, res


def time_loop(x, y, sizes, config, key):
  from jfed.kip import kip_distill, kip_distill_loop

  t0 = time.perf_counter()
  _ready(kip_distill(x[0], y[0], int(sizes[0]), config, key, NUM_CLASSES, client_index=0))
  warm_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  res = _ready(kip_distill_loop(x, y, sizes, config, key, NUM_CLASSES))
  return warm_s, time.perf_counter() - t0, res


def time_reference(config, shape, key):
  from jfed.kip.kip import _distill_one_jit, _x64_scope

  x, y, sizes = make_clients(1, 10_000, shape, seed=1)
  with _x64_scope(config):
    args = (jnp.asarray(x[0]), jnp.asarray(y[0]), jnp.asarray(int(sizes[0]), jnp.int32), key)
    t0 = time.perf_counter()
    compiled = _distill_one_jit.lower(*args, config, NUM_CLASSES).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = _ready(compiled(*args))
    run_s = time.perf_counter() - t0
  return compile_s, run_s, res


def main(argv):
  del argv
  from jfed.kip import KIPConfig

  backend = jax.default_backend()
  meta = {
    'backend': backend,
    'device_kind': jax.devices()[0].device_kind,
    'jax_version': jax.__version__,
    'cpu_count': cpu_count(),
    'load_average': load_average(),
    'python_version': platform.python_version(),
  }
  log(
    f'backend {backend} ({meta["device_kind"]}), jax {jax.__version__}, CPUs '
    f'{meta["cpu_count"]}, load average {meta["load_average"]}'
  )
  key = jax.random.PRNGKey(0)
  hfldd = KIPConfig(
    support_size=FLAGS.support,
    iterations=FLAGS.iterations,
    lr=0.004,
    target_batch=FLAGS.target_batch,
  )
  rows = []
  for m in [int(c) for c in FLAGS.clients]:
    x, y, sizes = make_clients(m, FLAGS.samples, (28, 28, 1))
    log(f'm={m}: batched ...')
    c_s, b_s, bres = time_batched(x, y, sizes, hfldd, key)
    log(f'm={m}: batched compile {c_s:.1f}s, run {b_s:.2f}s; loop ...')
    w_s, l_s, lres = time_loop(x, y, sizes, hfldd, key)
    log(f'm={m}: loop warm-up {w_s:.1f}s, run {l_s:.2f}s')
    diff = float(np.max(np.abs(np.asarray(bres.x) - np.stack([np.asarray(r.x) for r in lres]))))
    per = 1000.0 / (m * FLAGS.iterations)
    rows.append(
      {
        'setting': 'HFLDD',
        'clients': m,
        'mode': 'batched (1 program)',
        'iterations': FLAGS.iterations,
        'support': FLAGS.support,
        'target_batch': FLAGS.target_batch,
        'dtype': 'float32',
        'compile_s': c_s,
        'run_s': b_s,
        'ms_per_client_iter': b_s * per,
        'speedup_vs_loop': l_s / b_s,
        'max_abs_diff_vs_loop': diff,
      }
    )
    rows.append(
      {
        'setting': 'HFLDD',
        'clients': m,
        'mode': 'per-client loop',
        'iterations': FLAGS.iterations,
        'support': FLAGS.support,
        'target_batch': FLAGS.target_batch,
        'dtype': 'float32',
        'compile_s': w_s,
        'run_s': l_s,
        'ms_per_client_iter': l_s * per,
        'speedup_vs_loop': 1.0,
        'max_abs_diff_vs_loop': 0.0,
      }
    )
  if FLAGS.reference:
    shape = tuple(int(s) for s in FLAGS.reference_shape)
    ref = KIPConfig(
      support_size=100,
      iterations=FLAGS.reference_steps,
      lr=0.04,
      target_batch=5000,
      x64=FLAGS.reference_x64,
    )
    log(
      f'reference: {FLAGS.reference_steps} steps, support 100, target 5000, {shape}, '
      f'{"float64" if FLAGS.reference_x64 else "float32"} ...'
    )
    c_s, r_s, res = time_reference(ref, shape, key)
    log(f'reference: compile {c_s:.1f}s, run {r_s:.1f}s; final loss {float(res.loss[-1]):.4g}')
    rows.append(
      {
        'setting': f'KIP notebook (FC1 NTK, {"x".join(map(str, shape))})',
        'clients': 1,
        'mode': 'single client',
        'iterations': FLAGS.reference_steps,
        'support': 100,
        'target_batch': 5000,
        'dtype': 'float64' if FLAGS.reference_x64 else 'float32',
        'compile_s': c_s,
        'run_s': r_s,
        'ms_per_client_iter': 1000.0 * r_s / FLAGS.reference_steps,
        'speedup_vs_loop': None,
        'max_abs_diff_vs_loop': None,
        'notebook_s': NOTEBOOK_SECONDS,
      }
    )

  lines = [
    '# KIP distillation benchmark',
    '',
    f'- backend: **{backend}** ({meta["device_kind"]}), jax {jax.__version__}, '
    f'{meta["cpu_count"]} CPUs, load average at start {meta["load_average"]}',
    f'- HFLDD rows: random 28x28x1 clients of {FLAGS.samples} images, FC1 NTK, lr 0.004; '
    'compile time excluded from "run s" (batched: AOT compile; loop: one warm-up client)',
    f'- reference row: the KIP notebook setting; the public notebook reports '
    f'~{NOTEBOOK_SECONDS:.0f} s on its own hardware',
    '',
    '| setting | clients | mode | iterations | support | target batch | dtype '
    '| compile (warm-up) s | run s | ms / client-iteration | batched speed-up '
    '| max abs diff vs loop |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    sp = '—' if r['speedup_vs_loop'] is None else f'{r["speedup_vs_loop"]:.2f}x'
    df = '—' if r['max_abs_diff_vs_loop'] is None else f'{r["max_abs_diff_vs_loop"]:.1e}'
    lines.append(
      f'| {r["setting"]} | {r["clients"]} | {r["mode"]} | {r["iterations"]} | '
      f'{r["support"]} | {r["target_batch"]} | {r["dtype"]} | {r["compile_s"]:.1f} '
      f'| {r["run_s"]:.2f} | {r["ms_per_client_iter"]:.1f} | {sp} | {df} |'
    )
  table = '\n'.join(lines)
  print(table)
  if FLAGS.out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, 'w') as f:
      json.dump({'meta': meta, 'rows': rows, 'table': table}, f, indent=2)


if __name__ == '__main__':
  app.run(main)
