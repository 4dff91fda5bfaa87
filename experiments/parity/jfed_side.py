"""jfed's side of a parity run: the methods a user runs, on the client index lists the reference
code reads too.

One context per seed (`jfed.api.make_context` over the given partition), so every method of the
seed shares its local models (the context's stage memo, and `local_models_dir` on disk so an
interrupted parity run resumes without training the clients again).
"""

import pathlib
from typing import Any, Dict, Optional, Sequence

import ml_collections
import numpy as np

from experiments.parity import references
from jfed import driver, engine
from jfed.api import make_context
from jfed.data import Dataset
from jfed.data.transforms import configure
from jfed.methods import common


def local_results(ctx, epochs: int) -> Dict[str, Any]:
  """Per-client test accuracy of jfed's local models, their mean-logit ensemble and their
  uniform (DENSE's `average_weights`) and size-weighted (FedAvg's) parameter averages, in %."""
  local = common.local_models(ctx, epochs)
  logits = common.client_test_logits(ctx, local)
  test_y = ctx.dataset.test_y
  group = local.groups[0]
  models = local.models[0]
  evaluator = engine.Evaluator(group.module, ctx.run.eval_batch_size, ctx.run.strategy)
  uniform = engine.weighted_average(models, np.ones(len(group.client_ids), np.float32))
  weighted = engine.weighted_average(models, group.fed.sizes)
  test_x = ctx.dataset.test_x
  return {
    'client_accuracy': [100 * float(a) for a in common.accuracy_of_logits(logits, test_y)],
    'ensemble_accuracy': 100 * float(common.accuracy_of_logits(logits.mean(0), test_y)),
    'uniform_average_accuracy': 100 * float(evaluator.accuracy(uniform, test_x, test_y)),
    'weighted_average_accuracy': 100 * float(evaluator.accuracy(weighted, test_x, test_y)),
  }


def run_methods(
  config: ml_collections.ConfigDict,
  dataset: Dataset,
  parts: Sequence[np.ndarray],
  methods: Sequence[str],
  local_epochs: int,
  local_models_dir: pathlib.Path,
  done: Optional[Dict[str, Any]] = None,
  with_local: bool = True,
) -> Dict[str, Any]:
  """Runs jfed's `methods` on `parts` of `dataset` (in memory, sharing one set of local models).

  Args:
    config: the whole run config (its partition section is ignored: `parts` is the split).
    dataset: the loaded dataset, nothing held out, at its files' size (the config's
      `dataset.image_size` and `dataset.normalization` are applied here).
    parts: one index array into `dataset.train_x` per client.
    methods: registered jfed methods run after the local models, e.g. ('fedavg', 'dense').
    local_epochs: the clients' local epochs.
    local_models_dir: where the local models are cached.
    done: summaries of methods already run (kept, not run again).
    with_local: whether to report the shared local models too (`local_results`).

  Returns:
    `local_results` plus each method's summary (final and best test accuracy in %).
  """
  config = ml_collections.ConfigDict(config)
  config.local_models_dir = str(local_models_dir)
  # The reference's own set-up (resizing keeps the index lists valid)
  dataset = configure(dataset, config.dataset.image_size, config.dataset.normalization)
  ctx = make_context(config, dataset, [np.asarray(p, np.int64) for p in parts])
  out: Dict[str, Any] = local_results(ctx, local_epochs) if with_local else {}
  summaries: Dict[str, Dict[str, Any]] = dict(done or {})
  for method in methods:
    if method in summaries:
      continue
    summary = driver.run(driver.build_algorithm(method, config), ctx, progress=True)
    summaries[method] = {
      'final_accuracy': 100 * float(summary['final_test_accuracy']),
      'best_accuracy': 100 * float(summary['best_test_accuracy']),
      'seconds': float(summary['seconds']),
    }
  out['methods'] = summaries
  return out


def rows(result: Dict[str, Any], labels: Dict[str, str]) -> Dict[str, float]:
  """The parity table's rows of one seed's `run_methods` result (names as the references')."""
  out: Dict[str, float] = {}
  if 'client_accuracy' in result:
    out.update(
      references.local_rows(
        result['client_accuracy'],
        result['ensemble_accuracy'],
        result['uniform_average_accuracy'],
      )
    )
  for method, summary in result.get('methods', {}).items():
    label = labels.get(method, method)
    if method == 'fedavg':  # one round: final and best are one number
      out[label] = summary['final_accuracy']
      continue
    out[f'{label} final'] = summary['final_accuracy']
    out[f'{label} best'] = summary['best_accuracy']
  return out
