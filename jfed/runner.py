"""Runs one method on one config into a workdir: the library side of experiments/main.py."""
import json
import pathlib
import platform
import time
from typing import Any, Dict, List

import jax
import ml_collections
import numpy as np

from jfed import __version__
from jfed.data import class_count_table, format_count_table, load_dataset, make_partition
from jfed.engine import client_mesh
from jfed.methods import RunContext, get_method
from jfed.reporting import MetricsWriter, plot_curves, write_json

# Which partition arguments each scheme takes from config.partition.
_PARTITION_ARGS = {
    'iid': (), 'disjoint': (), 'shards': ('k',), 'dirichlet': ('alpha', 'min_size'),
    'feddf_dirichlet': ('alpha',), 'fedcvae_dirichlet': ('alpha',),
}


def partition_clients(config: ml_collections.ConfigDict, labels: np.ndarray) -> List[np.ndarray]:
  p = config.partition
  if p.scheme not in _PARTITION_ARGS:
    raise ValueError(f'Unknown partition scheme {p.scheme!r}; valid: {", ".join(_PARTITION_ARGS)}')
  kwargs = {name: p[name] for name in _PARTITION_ARGS[p.scheme] if name in p}
  return make_partition(labels, p.num_clients, p.scheme, config.seed, **kwargs)


def _check_resume_config(workdir: pathlib.Path, config_json: str) -> None:
  """A workdir belongs to one config: resuming with another would mix two experiments."""
  path = workdir / 'config.json'
  if path.exists() and json.loads(path.read_text()) != json.loads(config_json):
    raise ValueError(f'{workdir} holds a run with a different config; use a new --workdir '
                     f'(or delete {workdir}) to start this one.')


def run_experiment(method: str, config: ml_collections.ConfigDict, workdir) -> Dict[str, Any]:
  """Loads data, partitions it, runs `method`, and writes the run's outputs to `workdir`.

  Outputs: config.json (resolved), partition.txt and partition.png (client x class counts),
  metrics.jsonl, summary.json, accuracy.png, and the method's checkpoints and figures. Running
  again on the same workdir resumes from the last checkpoint.
  """
  method_fn = get_method(method)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  config_json = config.to_json_best_effort(sort_keys=True, indent=2)
  _check_resume_config(workdir, config_json)
  (workdir / 'config.json').write_text(config_json + '\n')

  dataset = load_dataset(config.dataset.name, config.dataset.get('data_dir') or None)
  parts = partition_clients(config, dataset.train_y)
  table = class_count_table(dataset.train_y, parts, dataset.num_classes)
  (workdir / 'partition.txt').write_text(format_count_table(table) + '\n')
  from jfed.data.plots import plot_partition_bubbles
  plot_partition_bubbles(table, workdir / 'partition.png',
                         title=f'{dataset.name}: {config.partition.scheme} partition')

  mesh = client_mesh() if config.get('shard', False) and jax.device_count() > 1 else None
  ctx = RunContext(config=config, dataset=dataset, parts=parts, workdir=workdir,
                   key=jax.random.PRNGKey(config.seed), metrics=MetricsWriter(
                       workdir / 'metrics.jsonl'), mesh=mesh)
  print(f'{method} on {dataset.name} ({jax.default_backend()}): {len(parts)} clients, '
        f'sizes {[len(p) for p in parts]}', flush=True)
  start = time.perf_counter()
  summary = dict(method_fn(ctx))
  summary.update({
      'method': method, 'dataset': dataset.name, 'num_clients': len(parts),
      'partition': config.partition.scheme, 'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()], 'jax_version': jax.__version__,
      'jfed_version': __version__, 'host': platform.node(),
      'seconds_this_invocation': time.perf_counter() - start})
  write_json(workdir / 'summary.json', summary)
  _plot_accuracy(ctx, summary)
  return summary


def _plot_accuracy(ctx: RunContext, summary: Dict[str, Any]) -> None:
  records = [r for r in ctx.metrics.read() if 'test_accuracy' in r]
  if not records:
    return
  step_name = summary.get('step_name', 'step')
  plot_curves(ctx.workdir / 'accuracy.png',
              {summary['method']: [r['test_accuracy'] for r in records]},
              xlabel=step_name, ylabel='test accuracy',
              x={summary['method']: [r['step'] for r in records]},
              title=f"{summary['method']} on {summary['dataset']} "
                    f"({summary['num_clients']} clients, {summary['partition']})")
