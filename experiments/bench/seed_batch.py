"""The local models of several seeds: trained in one program (jfed.methods.seed_batch) vs one
seed at a time (each seed's run, as a table sweep without --batch_seeds).

    nice python -m experiments.bench.seed_batch [--config=fedhydra_digits] [--model=cnn_mnist]
        [--clients=5] [--epochs=2] [--seeds=0,1,2] [--repeats=3] [--strategy=auto]
        [--out=FILE.json]

From Python: `run(Sizes(...))` returns the table and the raw numbers as a dict.

Both forms do what a table command does for one cell, end to end and cold: build each seed's
run context (data partition) and train every client's local models for `epochs` epochs, writing
each seed's `local_models_dir` checkpoint.
- one at a time, compiling anew: `common.local_models(ctx, epochs)` per seed after
  `jax.clear_caches()`, so each seed compiles its trainer's programs (what every run did before
  issue 84);
- one at a time: the same without clearing: the seeds after the first run the first seed's
  programs (`jfed.engine.training.ClientProgram`: jit's cache shares them);
- batched: `seed_batch.pretrain_local_models(configs, epochs)`: one client group of all seeds'
  clients per architecture, one trainer.
Every timed call writes into fresh directories and the forms alternate (`repeats` rounds), so a
change of machine load hits both alike; the median is reported, with the first round (compiling
XLA's programs for the first time in the process) reported apart. The client-map strategy is the
config's (`auto`: `loop` on CPU, `scan` elsewhere), the one the table commands use.

On CPU the `loop` strategy runs the clients one after another in either form, so the batched
form saves only the per-seed trainer set-up (tracing and compiling its programs, per-run
dispatch); under `scan` (GPU/TPU) the S seeds' clients are one vmapped program, so S seeds cost
about one seed's time while the device is not saturated.

Measured on XLA:CPU (2 cores shared with other jobs, load average 2.7 and 4.2 at the start,
jax 0.10.2, `loop`), 3 seeds of fedhydra_digits' cell with cnn_mnist clients, 5 per seed: at 2
local epochs one at a time 15.2 s, batched 7.0 s (2.2x; first rounds 17.1 s and 9.1 s); at 10
local epochs 19.9 s and 13.8 s (1.45x; first rounds 44.7 s and 14.9 s). The saving is about the
(S - 1) trainers' compilations, so on CPU it shrinks relative to the total as the local epochs
grow. Not measured on a GPU yet. Sharing the programs (2026-11-29, the same cell at 2 local
epochs, 2 cores beside a FedTSA sweep, load 3.3): one at a time 7.80 s, sharing 4.24 s (1.84x),
batched 3.73 s (2.09x).
"""

import pathlib
import shutil
import statistics
import tempfile
import time
from typing import List, NamedTuple, Sequence

from experiments.bench.machine import environment, load_average, log, write_json

CONFIGS = ('fedhydra_digits', 'fedhydra_fashion_mnist')


class Sizes(NamedTuple):
  config: str = 'fedhydra_digits'  # an experiments/configs module with get_config('')
  model: str = 'cnn_mnist'
  clients: int = 5
  epochs: int = 2
  seeds: Sequence[int] = (0, 1, 2)
  repeats: int = 3
  strategy: str = 'auto'


def _configs(sizes: Sizes, root: pathlib.Path) -> list:
  import importlib  # pylint: disable=g-import-not-at-top

  module = importlib.import_module(f'jfed.configs.{sizes.config}')
  out = []
  for seed in sizes.seeds:
    c = module.get_config('')
    c.model, c.client_models, c.strategy = sizes.model, '', sizes.strategy
    c.partition.num_clients, c.seed = sizes.clients, seed
    c.local_models_dir = str(root / f'seed{seed}')
    out.append(c)
  return out


def _one_at_a_time(configs, epochs: int, dataset) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  from jfed import driver  # pylint: disable=g-import-not-at-top
  from jfed.methods import common  # pylint: disable=g-import-not-at-top

  for c in configs:
    models = common.local_models(driver.context_of_config(c, dataset), epochs).models
    jax.block_until_ready(models)


def _one_at_a_time_compiling_anew(configs, epochs: int, dataset) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  from jfed import driver  # pylint: disable=g-import-not-at-top
  from jfed.methods import common  # pylint: disable=g-import-not-at-top

  for c in configs:  # every seed compiles its programs, as runs did before issue 84
    jax.clear_caches()
    models = common.local_models(driver.context_of_config(c, dataset), epochs).models
    jax.block_until_ready(models)


def _batched(configs, epochs: int, dataset) -> None:
  from jfed.methods import seed_batch  # pylint: disable=g-import-not-at-top

  done = seed_batch.pretrain_local_models(configs, epochs, dataset=dataset)
  assert all(d.trained for d in done)


def run(sizes: Sizes) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top
  from jfed.engine import resolve_strategy  # pylint: disable=g-import-not-at-top

  start_load = load_average()
  scratch = pathlib.Path(tempfile.mkdtemp(prefix='bench_seed_batch_'))
  probe = _configs(sizes, scratch)[0]
  dataset = load_dataset(probe.dataset.name, probe.dataset.get('data_dir') or None)
  forms = {
    'one at a time, compiling anew': _one_at_a_time_compiling_anew,
    'one at a time': _one_at_a_time,
    'batched': _batched,
  }
  times = {name: [] for name in forms}
  try:
    for r in range(sizes.repeats):
      for name, form in forms.items():
        configs = _configs(sizes, scratch / f'{r}_{name.replace(" ", "_")}')
        t0 = time.perf_counter()
        form(configs, sizes.epochs, dataset)
        times[name].append(time.perf_counter() - t0)
        log(f'round {r + 1}: {name} {times[name][-1]:.2f} s')
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  warm = {name: statistics.median(t[1:]) if len(t) > 1 else t[0] for name, t in times.items()}
  strategy = resolve_strategy(probe.strategy)
  env = environment()
  lines = [
    f'# {len(sizes.seeds)} seeds: local models batched vs one seed at a time',
    '',
    f'Backend {jax.default_backend()} ({env.get("device_kind", "")}), jax {jax.__version__}, '
    f'{env.get("cpu_count")} CPUs, load average {start_load} at the start. {sizes.config} '
    f'({probe.dataset.name}), {sizes.model}, {sizes.clients} clients per seed, {sizes.epochs} '
    f"local epochs, batch {probe.batch_size}, strategy '{sizes.strategy}' = {strategy}.",
    '',
    '| form | first round (s) | median of later rounds (s) | rounds (s) |',
    '|---|---:|---:|---|',
  ]
  for name, t in times.items():
    lines.append(
      f'| {name} | {t[0]:.2f} | {warm[name]:.2f} | ' + ', '.join(f'{x:.2f}' for x in t) + ' |'
    )
  ratio = warm['one at a time'] / warm['batched']
  sharing = warm['one at a time, compiling anew'] / warm['one at a time']
  lines += [
    '',
    f'Speed-up of the batched form (later rounds): {ratio:.2f}x; of one seed at a time sharing '
    f"the trainers' programs through jit's cache (every run since issue 84) over compiling "
    f'them anew per seed: {sharing:.2f}x.',
  ]
  return {
    'markdown': '\n'.join(lines) + '\n',
    'sizes': sizes._asdict(),
    'strategy': strategy,
    'seconds': times,
    'speedup': ratio,
    'speedup_sharing': sharing,
    'environment': env,
  }


def main(argv: List[str]) -> None:
  del argv
  from absl import flags, logging  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO

  f = flags.FLAGS
  result = run(
    Sizes(
      f.config,
      f.model,
      f.clients,
      f.epochs,
      tuple(int(s) for s in f.seeds),
      f.repeats,
      f.strategy,
    )
  )
  print(result['markdown'])
  if f.out:
    write_json(f.out, result)


if __name__ == '__main__':
  from absl import app, flags

  DEFAULT = Sizes()

  flags.DEFINE_enum('config', DEFAULT.config, CONFIGS, 'The cell: a FedHydra table config.')
  flags.DEFINE_string('model', DEFAULT.model, 'The clients (a model spec).')
  flags.DEFINE_integer('clients', DEFAULT.clients, 'Clients per seed.')
  flags.DEFINE_integer('epochs', DEFAULT.epochs, 'Local epochs.')
  flags.DEFINE_list('seeds', [str(s) for s in DEFAULT.seeds], 'Seeds of the cell.')
  flags.DEFINE_integer('repeats', DEFAULT.repeats, 'Timed rounds of both forms.')
  flags.DEFINE_string('strategy', DEFAULT.strategy, 'Client-map strategy (auto: the backend’s).')
  flags.DEFINE_string('out', '', 'Also write the table and raw numbers as JSON here.')
  app.run(main)
