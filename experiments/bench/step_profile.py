"""Where one client step's time goes: device time per step and its costliest XLA operations.

    python -m experiments.bench.step_profile [--models=cnn_mnist,vgg9,resnet18,mlp]
        [--steps=30] [--top=12] [--out=FILE.md]

For each model of `model_zoo_training.MODELS` (the configs' CPU client models at the configs' batch
sizes), the jitted client step the `loop` strategy runs (`GroupTrainer`, SGD lr 0.01 momentum 0.9,
forward + backward + optimiser) is called `steps` times under `jax.profiler` after a warm-up.
Reported per step: the device time (XLA's thunk executor), the wall time of the same steps run again
outside the profiler, the step's FLOPs (XLA's cost analysis) and the rate they run at, against a
float32 matmul's rate on the same machine, the `top` operations by time, each with its output shape
and the JAX operation it came from, and the time by kind of operation (XLA's fusion kind; library
fusions and convolutions split into forward, backward and unnamed, which in a convolution net are
the kernel gradients). The device time counts the operations XLA's thunk executor runs and waits
for; where XLA hands convolutions to Eigen (YNNPACK's fusions switched off in XLA_FLAGS) it read
54-66 % of the wall time (2026-12-04: ResNet-18, CNNMnist, VGG-9), so compare flag settings by wall
time.

Unlike `client_training`, which times whole epochs against PyTorch, this isolates the compiled
step from the host loop and from the machine's load swings across minutes: run it on two
commits to see what a change to a layer did (a few seconds per model on 2 cores; ResNet-18
about 15 s).
"""

import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.machine import environment, load_average, log
from experiments.bench.model_zoo_training import (
  INPUT_SHAPE,
  MODELS,
  NUM_CLASSES,
  client_optimizer,
  jfed_module,
  timed,
)


def _events(trace_dir: str) -> list:
  (path,) = glob.glob(f'{trace_dir}/**/*.trace.json.gz', recursive=True)
  with gzip.open(path) as f:
    return [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']


def _op_origins(hlo_text: str) -> dict:
  """{instruction name: (output shape, the JAX op_name that produced it)} of compiled HLO."""
  origins = {}
  for m in re.finditer(r'^\s*%(\S+) = (\S+) .*$', hlo_text, re.M):
    op = re.search(r'op_name="([^"]*)"', m.group(0))
    origins[m.group(1)] = (m.group(2), op.group(1) if op else '')
  return origins


def op_kind(op: str, origin: str) -> str:
  """An operation's kind: its name without XLA's `.N` suffix and, for library fusions and
  convolutions, whether JAX's forward or its transpose (the backward) produced it."""
  kind = re.sub(r'\.\d+$', '', op)
  if not kind.startswith(('ynn_fusion', 'xnn_fusion', 'conv')):
    return kind
  if 'transpose(jvp(' in origin:
    return f'{kind} (backward)'
  return f'{kind} (forward)' if 'jvp(' in origin else f'{kind} (no JAX op name)'


def profile_model(name: str, steps: int, top: int) -> dict:
  """Device ms per step and the `top` costliest operations of `name`'s client step."""
  from jfed.engine import training
  from jfed.engine.state import init_models, init_train_state

  case = MODELS[name]
  module = jfed_module(name)
  tx = client_optimizer()
  state = init_train_state(tx, init_models(module, INPUT_SHAPE, jax.random.key(0), 1))
  ts = jax.tree.map(lambda a: a[0], state)
  n = 4 * case.batch
  x = jnp.asarray(np.random.default_rng(0).standard_normal((n, *INPUT_SHAPE), np.float32))
  y = jnp.arange(n) % NUM_CLASSES
  trainer = training.GroupTrainer(module, tx, case.batch, strategy='loop')
  client = (x, y, jnp.arange(n), jnp.int32(n), jax.random.key(1))
  args = (trainer.program, ts, jnp.zeros(3), client, jnp.int32(0))
  step = jax.jit(training._loop_client_step, static_argnums=0)  # pylint: disable=protected-access
  compiled = step.lower(*args, None).compile()
  origins = _op_origins(compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list on older jax

  def run(k):
    out = None
    for _ in range(k):
      out = step(*args, None)
    jax.block_until_ready(out)

  run(5)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      run(steps)
    events = _events(trace_dir)
  by_name = collections.Counter()
  for e in events:
    by_name[e['name']] += e['dur']
  ops = [(k, v) for k, v in by_name.items() if k in origins]
  ops.sort(key=lambda kv: -kv[1])
  kinds = collections.defaultdict(lambda: [0, 0.0])
  for k, v in ops:
    kind = kinds[op_kind(k, origins[k][1])]
    kind[0] += 1
    kind[1] += v / steps / 1e3
  device_ms = by_name['ThunkExecutor::Execute'] / steps / 1e3
  wall_s = min(timed(lambda: run(steps)) for _ in range(2))  # the better of two, unprofiled
  gflop = float(cost.get('flops', 0.0)) / 1e9
  return {
    'model': case.spec,
    'batch': case.batch,
    'device_ms': device_ms,
    'wall_ms': wall_s / steps * 1e3,
    'gflop': gflop,  # XLA's count for the whole step (forward, backward, optimiser)
    'gflops_per_s': gflop / (device_ms / 1e3) if device_ms > 0 else 0.0,
    'top_ops': [
      {'op': k, 'ms': v / steps / 1e3, 'shape': origins[k][0], 'origin': origins[k][1]}
      for k, v in ops[:top]
    ],
    'kinds': sorted(
      ({'kind': k, 'ops': n, 'ms': ms} for k, (n, ms) in kinds.items()), key=lambda d: -d['ms']
    ),
  }


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
  """The best rate of an n x n float32 matmul through XLA on this machine, in GFLOP/s: what a
  step made of matmuls could reach here."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, a))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best / 1e9


def report(rows: list, env: dict, steps: int, matmul_rate: float = 0.0, kinds: int = 10) -> str:
  lines = [
    '### Client step profile (`python -m experiments.bench.step_profile`)',
    '',
    f'{env["backend"]} ({env["device_kind"]}), jax {env["jax_version"]}, {env["cpu_count"]} '
    f'CPUs; {steps} profiled steps per model after a warm-up; load average {load_average()}.',
  ]
  if matmul_rate:
    lines[-1] += f' A 2048x2048 float32 matmul through XLA runs at {matmul_rate:.0f} GFLOP/s.'
  if env.get('xla_flags'):
    lines[-1] += f' XLA_FLAGS: `{env["xla_flags"]}`.'
  for r in rows:
    lines += [
      '',
      f'**`{r["model"]}`, batch {r["batch"]}: {r["device_ms"]:.2f} ms device time per step**, '
      f'{r["gflop"]:.3f} GFLOP (XLA cost analysis), {r["gflops_per_s"]:.0f} GFLOP/s; '
      f'wall time {r["wall_ms"]:.2f} ms per step',
      '',
      '| op | ms/step | output | from |',
      '|---|---:|---|---|',
    ]
    lines += [
      f'| {o["op"]} | {o["ms"]:.3f} | `{o["shape"]}` | {o["origin"][-80:]} |' for o in r['top_ops']
    ]
    if r.get('kinds'):
      lines += ['', '| kind of operation | ops | ms/step | share |', '|---|---:|---:|---:|']
      lines += [
        f'| {k["kind"]} | {k["ops"]} | {k["ms"]:.2f} | {k["ms"] / r["device_ms"]:.0%} |'
        for k in r['kinds'][:kinds]
      ]
  return '\n'.join(lines)


def main(argv):
  del argv
  from absl import flags

  f = flags.FLAGS
  env = environment()
  rows = []
  for name in f.models:
    log(f'profiling {name}')
    rows.append(profile_model(name, f.steps, f.top))
    row = rows[-1]
    log(f'  {row["device_ms"]:.2f} ms device time, {row["wall_ms"]:.2f} ms wall time per step')
  table = report(rows, env, f.steps, matmul_gflops())
  print(table)
  if f.out:
    with open(f.out, 'w') as out:
      out.write(table + '\n')


if __name__ == '__main__':
  from absl import app, flags

  flags.DEFINE_list('models', list(MODELS), f'Models to profile: {", ".join(MODELS)}.')
  flags.DEFINE_integer('steps', 30, 'Profiled steps per model.')
  flags.DEFINE_integer('top', 12, 'Costliest operations listed per model.')
  flags.DEFINE_string('out', None, 'Optional Markdown file for the report.')
  app.run(main)
