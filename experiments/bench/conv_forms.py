"""The generators' convolutions in XLA's form and as shifted-slice matmuls (jfed.models.layers).

    python -m experiments.bench.conv_forms [--batch=64] [--ngf=64] [--repeats=3] [--out=FILE]

Times one jitted forward + backward (gradients of the input and the kernel) of every
convolution of DENSE's generator and of FedHydra's (Bai et al., KDD 2025, §4.1.3) at 28×28 output,
nz-free (the layer alone, on random input), in both forms of `layers.Conv` / `layers.ConvTranspose`
(`impl='lax'`: XLA's convolution; `impl='matmul'`), and says which form `impl='auto'` takes on
this backend. The thresholds of `layers.use_matmul_conv` come from this table on the 2-core CPU.
"""

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments.bench.machine import environment, load_average, log, write_json


class Layer(NamedTuple):
  name: str
  kind: str  # 'conv' | 'conv_transpose'
  hw: int  # input map size
  cin: int
  cout: int
  kernel: int
  stride: int


def generator_layers(ngf: int, channels: int = 1):
  return [
    Layer('DENSE conv1 (14x14)', 'conv', 14, 2 * ngf, 2 * ngf, 3, 1),
    Layer('DENSE conv2 (28x28)', 'conv', 28, 2 * ngf, ngf, 3, 1),
    Layer('DENSE conv3 (28x28, image)', 'conv', 28, ngf, channels, 3, 1),
    Layer('FedHydra convt0 (7->14)', 'conv_transpose', 7, 2 * ngf, 2 * ngf, 4, 2),
    Layer('FedHydra convt1 (14->28)', 'conv_transpose', 14, 2 * ngf, ngf, 4, 2),
    Layer('FedHydra convt2 (28, image)', 'conv_transpose', 28, ngf, channels, 3, 1),
  ]


def module(layer: Layer, impl: str):
  from jfed.models import layers

  k = (layer.kernel, layer.kernel)
  if layer.kind == 'conv':
    return layers.Conv(layer.cout, k, padding=layer.kernel // 2, impl=impl)
  return layers.ConvTranspose(layer.cout, k, strides=(layer.stride, layer.stride), impl=impl)


def time_layer(layer: Layer, impl: str, batch: int, repeats: int) -> float:
  m = module(layer, impl)
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, layer.hw, layer.hw, layer.cin))
  params = m.init(jax.random.PRNGKey(0), x)
  step = jax.jit(jax.grad(lambda p, xx: jnp.sum(jnp.square(m.apply(p, xx))), argnums=(0, 1)))
  jax.block_until_ready(step(params, x))
  t0 = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(step(params, x))
  return (time.perf_counter() - t0) / repeats


def run(batch: int = 64, ngf: int = 64, repeats: int = 3) -> dict:
  from jfed.models import layers

  meta = environment()
  log(f'conv forms: backend {meta["backend"]}, load {meta["load_average"]}')
  rows = []
  for layer in generator_layers(ngf):
    out = layer.hw * layer.stride
    auto = layers.use_matmul_conv(
      'auto', layer.cin, layer.cout, out * out if layer.kind == 'conv' else 0
    )
    times = {impl: time_layer(layer, impl, batch, repeats) for impl in ('lax', 'matmul')}
    rows.append({**layer._asdict(), **times, 'auto': 'matmul' if auto else 'lax'})
    log(f'  {layer.name}: lax {times["lax"]:.3f} s, matmul {times["matmul"]:.3f} s')
  meta.update(batch=batch, ngf=ngf, repeats=repeats, load_average_end=load_average())
  return {'name': 'conv_forms', 'meta': meta, 'results': rows, 'table_markdown': report(meta, rows)}


def report(meta, rows) -> str:
  lines = [
    f'### Generator convolutions, forward + backward, batch {meta["batch"]}, ngf {meta["ngf"]}',
    '',
    f'Backend {meta["backend"]}; load average {meta["load_average"]} at start, '
    f'{meta["load_average_end"]} at end.',
    '',
    '| layer | C_in -> C_out | XLA conv (s) | matmul (s) | XLA / matmul | auto takes |',
    '|---|---|---:|---:|---:|---|',
  ]
  for r in rows:
    lines.append(
      f'| {r["name"]} | {r["cin"]} -> {r["cout"]} | {r["lax"]:.3f} | {r["matmul"]:.3f} | '
      f'{r["lax"] / r["matmul"]:.2f} | {r["auto"]} |'
    )
  return '\n'.join(lines)


def main(argv):
  del argv
  from absl import flags

  f = flags.FLAGS
  result = run(f.batch, f.ngf, f.repeats)
  print(result['table_markdown'])
  if f.out:
    write_json(f.out, result)


if __name__ == '__main__':
  from absl import app, flags

  flags.DEFINE_integer('batch', 64, 'Images per call (the CPU budget synthesis batch).')
  flags.DEFINE_integer('ngf', 64, 'Generator width (DENSE: 64).')
  flags.DEFINE_integer('repeats', 3, 'Timed calls per layer and form (after one warm-up).')
  flags.DEFINE_string('out', None, 'Optional JSON file for the table and the raw numbers.')
  app.run(main)
