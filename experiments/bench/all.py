"""Every jfed benchmark in one call, at sizes fit for the backend, into one Markdown report.

    python -m experiments.bench.all --out=DIR [--profile=auto|cpu|accelerator|tiny]
        [--only=client_training,model_stratification,kip] [--notorch] [--torch_threads=N]

Runs the client-training (`client_training.py`), model-stratification (`model_stratification.py`)
and KIP (`kip.py`) benchmarks through their `run(Sizes)` functions and writes

- DIR/report.md: device, versions, load average, a summary of the headline figures with their
  ratios against the PyTorch reference and against the per-client loop beside issue 14's goals
  (goals for accelerators; on CPU the figures are only reported), then each benchmark's tables;
- DIR/report.json: everything, raw numbers included.

Both are rewritten after every benchmark, so a run stopped by a time limit keeps the sections it
finished (the report names the ones not run).

Sizes (`PROFILES`): `cpu` keeps the whole run to a few minutes on 2 cores; `accelerator` (GPU or
TPU) runs client training at m = 10, 100, 1000 clients, model stratification at m x c = 100 x 10
and KIP at 100 clients (on an NVIDIA H200: 190, 112 and 53 s, compilation included); `tiny`
runs every code path in seconds of compute (tests/test_bench.py). `auto` picks `cpu` or
`accelerator` by backend.

A benchmark that raises is reported as failed (error and traceback in the report) and the others
still run; the exit status is 1 if any failed. Progress lines go to stderr.
"""

import datetime
import json
import os
import sys
import time
import traceback
from typing import Callable, Dict, NamedTuple

from experiments.bench import client_training, kip, model_stratification
from experiments.bench.machine import (
  cpu_count,
  environment,
  import_torch,
  load_average,
  log,
)
from jfed.workdir import atomic_write_text


class Benchmark(NamedTuple):
  title: str
  run: Callable[..., dict]
  sizes: type


BENCHMARKS: Dict[str, Benchmark] = {
  'client_training': Benchmark('Client training', client_training.run, client_training.Sizes),
  'model_stratification': Benchmark(
    'Model stratification', model_stratification.run, model_stratification.Sizes
  ),
  'kip': Benchmark('KIP', kip.run, kip.Sizes),
}

# Keyword arguments of each benchmark's Sizes. Measured runtimes: docs/performance.md.
PROFILES = {
  'cpu': {
    'client_training': dict(
      clients=(10, 100),
      # One step per client at m = 100 buys three interleaved rounds in the same time: on a
      # shared machine the load moves within a minute, and one round cannot tell 5% apart.
      steps=(2, 1),
      strategies=('loop', 'vmap'),  # scan: ~1.7 s per client-step on XLA:CPU (design.md)
      repeats=(3, 3),
      probe_clients=20,
      probe_steps=8,
      probe_repeats=5,
      eval_models=10,
      eval_examples=500,
      eval_batch=250,
      eval_repeats=2,
      models=('cnn_mnist', 'vgg9', 'resnet18', 'mlp'),
      model_steps=4,
      model_repeats=5,
    ),
    # The lax.scan forms take seconds per generator step on XLA:CPU; `loop` (a per-run scan)
    # costs what `batched` costs per step (docs/fedhydra.md), so only `batched` runs here,
    # on one run, and `python` (the CPU's ms_impl) is the one-run-at-a-time reference.
    'model_stratification': dict(
      clients=2,
      classes=5,
      T_G=5,
      ms_batch=8,
      stages=('ms',),
      forms=('python', 'batched', 'torch'),
      scan_runs=1,
    ),
    'kip': dict(clients=(10,), iterations=3, support=400, reference=True, reference_steps=10),
  },
  'accelerator': {
    'client_training': dict(
      clients=(10, 100, 1000),
      steps=10,
      strategies=('loop', 'vmap', 'scan'),
      repeats=2,
      legacy_max_clients=100,
      probe_clients=100,
      probe_steps=10,
      eval_models=100,
      eval_examples=10_000,
      eval_batch=1000,
    ),
    'model_stratification': dict(
      clients=100,
      classes=10,
      T_G=30,
      ms_batch=16,
      chunk_size=250,  # bounds the batched program's memory: 4 chunks of 250 runs
      stages=('ms', 'dense', 'hydra_kd'),
      g_steps=30,
      synthesis_batch=256,
      kd_batch=256,
      seq_runs=100,  # one-run-at-a-time forms: 100 of the 1000 runs, extrapolated
    ),
    'kip': dict(clients=(10, 100), iterations=20, support=400, reference=True),
  },
  'tiny': {
    'client_training': dict(
      clients=(2,),
      steps=1,
      strategies=('loop',),
      repeats=1,
      probe_clients=2,
      probe_steps=2,
      probe_repeats=1,
      eval_models=2,
      eval_examples=16,
      eval_batch=8,
      eval_repeats=1,
      models=('mlp',),
      model_steps=1,
      model_repeats=1,
    ),
    'model_stratification': dict(
      clients=1,
      classes=2,
      T_G=2,
      ms_batch=2,
      nz=8,
      ngf=4,
      stages=('ms',),
      forms=('loop', 'batched', 'torch'),
      scan_runs=1,
    ),
    'kip': dict(
      clients=(2,),
      iterations=2,
      support=4,
      target_batch=2,
      samples=8,
      reference=False,
    ),
  },
}

GOAL_NOTE = {
  True: 'goals are for accelerators; this is a CPU run, so the figures are reported only',
  False: 'goal met: yes / no',
}


def profile_for(backend: str, profile: str) -> str:
  if profile == 'auto':
    return 'cpu' if backend == 'cpu' else 'accelerator'
  if profile not in PROFILES:
    raise ValueError(f'unknown profile {profile!r}; valid: auto, {", ".join(PROFILES)}')
  return profile


def torch_threads_for(requested: int) -> int:
  """PyTorch's threads: `requested`, else one per CPU, or 1 on a busy machine, where OpenMP's
  spinning threads inflate its time many-fold (experiments/bench/README.md)."""
  if requested:
    return requested
  load, cpus = load_average(), cpu_count()
  return 1 if load is not None and load >= cpus else cpus


def run_all(
  out: str,
  profile: str = 'auto',
  only=tuple(BENCHMARKS),
  use_torch: bool = True,
  torch_threads: int = 0,
  command: str = '',
) -> dict:
  """Runs the benchmarks, writes DIR/report.md and DIR/report.json; returns the report dict."""
  env = environment()
  profile = profile_for(env['backend'], profile)
  unknown = set(only) - set(BENCHMARKS)
  if unknown:
    raise ValueError(f'unknown benchmarks {sorted(unknown)}; valid: {", ".join(BENCHMARKS)}')
  torch, torch_note = import_torch(use_torch)
  threads = torch_threads_for(torch_threads) if torch is not None else None
  env.update(
    torch_version=torch.__version__ if torch is not None else None,
    torch_cuda=bool(torch is not None and torch.cuda.is_available()),
    torch_threads=threads,
    torch_note=torch_note,
  )
  started = datetime.datetime.now(datetime.timezone.utc)
  log(
    f'bench.all: profile {profile}, backend {env["backend"]} ({env["device_kind"]}), '
    f'load {env["load_average"]}, torch {env["torch_version"] or torch_note}'
  )
  sections = {}
  t_all = time.perf_counter()
  names = [n for n in BENCHMARKS if n in only]

  def write_report() -> dict:
    report = {
      'command': command or f'python -m experiments.bench.all --out={out}',
      'profile': profile,
      'started_utc': started.isoformat(timespec='seconds'),
      'total_seconds': time.perf_counter() - t_all,
      'environment': env,
      'load_average_end': load_average(),
      'sections': sections,
      'pending': [n for n in names if n not in sections],
    }
    report['markdown'] = markdown(report)
    os.makedirs(out, exist_ok=True)
    atomic_write_text(f'{out}/report.json', json.dumps(report, indent=2, default=str))
    atomic_write_text(f'{out}/report.md', report['markdown'])
    return report

  # before and after every section, so that a run stopped by a time limit keeps what it measured
  report = write_report()
  for i, name in enumerate(names, 1):
    bench = BENCHMARKS[name]
    kwargs = dict(PROFILES[profile][name])
    if 'torch' in bench.sizes._fields:
      kwargs['torch'] = torch is not None
    if 'torch_threads' in bench.sizes._fields:
      kwargs['torch_threads'] = threads or 0
    log(f'[{i}/{len(names)}] {bench.title} ({profile} sizes), load {load_average()} ...')
    t0 = time.perf_counter()
    section = {'title': bench.title, 'sizes': kwargs, 'load_average_start': load_average()}
    try:
      section['result'] = bench.run(bench.sizes(**kwargs))
      section['status'] = 'ok'
    except Exception as e:  # noqa: BLE001  (one failing benchmark must not stop the others)
      section['status'] = 'failed'
      section['error'] = f'{type(e).__name__}: {e}'
      section['traceback'] = traceback.format_exc()
      log(f'[{i}/{len(names)}] {bench.title} FAILED: {section["error"]}')
    section['seconds'] = time.perf_counter() - t0
    section['load_average_end'] = load_average()
    log(f'[{i}/{len(names)}] {bench.title}: {section["status"]} in {section["seconds"]:.0f} s')
    sections[name] = section
    report = write_report()
  log(f'wrote {out}/report.md ({report["total_seconds"]:.0f} s in all)')
  return report


def _fmt(v, spec='.2f'):
  return 'n/a' if v is None else format(v, spec)


def _value(h):
  return f'{_fmt(h["value"])} {h["unit"]}'


def markdown(report: dict) -> str:
  env = report['environment']
  cpu = env['backend'] == 'cpu'
  torch = (
    f'{env["torch_version"]} ({"CUDA" if env["torch_cuda"] and not cpu else "CPU"}, '
    f'{env["torch_threads"]} threads)'
    if env['torch_version']
    else f'skipped: {env["torch_note"]} (ratios against PyTorch are n/a)'
  )
  lines = [
    '# jfed benchmarks (experiments.bench.all)',
    '',
    f'- command: `{report["command"]}`',
    f'- started {report["started_utc"]}, {report["total_seconds"]:.0f} s in all; profile '
    f'**{report["profile"]}**',
    f'- backend: **{env["backend"]}** ({env["device_kind"]}, {env["num_devices"]} device(s)); '
    f'CPUs: {env["cpu_count"]} ({env["cpu_model"]})',
    f'- jax {env["jax_version"]}, jaxlib {env["jaxlib_version"]}, flax {env["flax_version"]}, '
    f'optax {env["optax_version"]}, python {env["python_version"]}; PyTorch reference: {torch}',
    f'- load average (1 min): {env["load_average"]} at start, {report["load_average_end"]} at '
    'end, and per benchmark below',
    f'- XLA_FLAGS: `{env["xla_flags"]}`' if env.get('xla_flags') else '- XLA_FLAGS: not set',
    '',
    '## Summary',
    '',
    f"Ratios: the reference's time / jfed's (> 1: jfed is faster). Goals from issue 14; "
    f'{GOAL_NOTE[cpu]}.',
    '',
    '| benchmark | figure | jfed | reference | reference value | ratio | ratio vs PyTorch '
    '| ratio vs per-client loop | goal | goal met |',
    '|---|---|---:|---|---:|---:|---:|---:|---|---|',
  ]
  failed = []
  for name, sec in report['sections'].items():
    if sec['status'] != 'ok':
      failed.append(name)
      lines.append(f'| {sec["title"]} | **failed**: {sec["error"]} | | | | | | | | |')
      continue
    for h in sec['result']['headline']:
      torch_ratio = h['ratio'] if h['reference'].startswith('PyTorch') else h.get('torch_ratio')
      if h['goal_ratio'] is None or h['ratio'] is None:
        met = '—'
      elif cpu:
        met = 'CPU: n/a'
      else:
        met = 'yes' if h['ratio'] >= h['goal_ratio'] else 'no'
      lines.append(
        f'| {h["benchmark"]} | {h["figure"]} | {_value(h)} | {h["reference"]} '
        f'| {_fmt(h["reference_value"])} {h["unit"] if h["reference_value"] else ""} '
        f'| {_fmt(h["ratio"])} | {_fmt(torch_ratio)} | {_fmt(h.get("loop_ratio"))} '
        f'| {h["goal"]} | {met} |'
      )
  for name, sec in report['sections'].items():
    lines += [
      '',
      f'## {sec["title"]}',
      '',
      f'Status **{sec["status"]}**, {sec["seconds"]:.0f} s, load average '
      f'{sec["load_average_start"]} at start, {sec["load_average_end"]} at end. Sizes: '
      + ', '.join(f'{k}={v}' for k, v in sec['sizes'].items())
      + '.',
      '',
    ]
    if sec['status'] == 'ok':
      lines.append(sec['result']['table_markdown'])
    else:
      lines += [f'Error: `{sec["error"]}`', '', '```', sec['traceback'].rstrip(), '```']
  if failed:
    lines += ['', f'**Failed benchmarks: {", ".join(failed)}** (tracebacks above).']
  if report.get('pending'):
    lines += [
      '',
      f'**Not run: {", ".join(report["pending"])}** (the run stopped before them or is still '
      'running).',
    ]
  lines += ['', 'Raw numbers: report.json beside this file.', '']
  return '\n'.join(lines)


def define_flags():
  from absl import flags

  flags.DEFINE_string('out', None, 'Output directory for report.md and report.json.')
  flags.DEFINE_enum(
    'profile', 'auto', ['auto', *PROFILES], 'Sizes: auto picks cpu or accelerator by backend.'
  )
  flags.DEFINE_bool('tiny', False, 'Same as --profile=tiny: every code path in seconds.')
  flags.DEFINE_list('only', list(BENCHMARKS), 'Benchmarks to run.')
  flags.DEFINE_bool('torch', True, 'Time the PyTorch references (if torch is importable).')
  flags.DEFINE_integer(
    'torch_threads', 0, 'PyTorch threads (0: one per CPU, or 1 when the load >= CPUs).'
  )
  flags.mark_flag_as_required('out')


def main(argv):
  from absl import flags

  f = flags.FLAGS
  del argv  # absl consumed the flags; the report quotes the command line as typed
  command = ' '.join(['python -m experiments.bench.all', *sys.argv[1:]])
  report = run_all(
    f.out,
    profile='tiny' if f.tiny else f.profile,
    only=tuple(f.only),
    use_torch=f.torch,
    torch_threads=f.torch_threads,
    command=command.strip(),
  )
  return 1 if any(s['status'] != 'ok' for s in report['sections'].values()) else 0


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
