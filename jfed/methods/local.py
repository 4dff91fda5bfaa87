"""Local: each client's own model on the global test set (FedHydra Table 3's M1..Mm columns).

Setup trains every client (`common.local_models`, one compiled program per architecture group)
and evaluates them in one pass; step k records client k.
"""

from typing import NamedTuple

import numpy as np

from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.methods import common
from jfed.methods.registry import register_method


class LocalConfig(NamedTuple):
  epochs: int = 1


class LocalAux(NamedTuple):
  accuracies: np.ndarray  # test accuracy of every client's model, by client id
  specs: list
  upload_bytes: int


@register_method('local')
class Local(Algorithm):
  """Every client's locally trained model, evaluated alone; a step is a client."""

  section = 'local'
  Config = LocalConfig
  step_name = 'client'

  def validate(self, config) -> None:
    tc.require_positive(self.config, self.section, ('epochs',))

  def num_steps(self, ctx: RunContext) -> int:
    return ctx.num_clients

  def setup(self, ctx: RunContext) -> LocalAux:
    models = common.local_models(ctx, self.config.epochs)
    return LocalAux(
      common.client_accuracies(ctx, models), list(ctx.federation.specs), models.upload_bytes
    )

  def init(self, ctx: RunContext, aux: LocalAux) -> np.ndarray:
    return np.zeros((), np.int32)

  def step(self, ctx: RunContext, aux: LocalAux, state, k: int):
    """Client k's record: its own model's test accuracy.

    Args:
      ctx: The run context (dataset, clients, run config, stage cache).
      aux: The run-level state built in `setup`.
      state: Unused (the clients were trained in `setup`).
      k: The client, from 0.

    Returns:
      The unchanged state and client k's record.
    """
    return state, [
      {
        'client': k,
        'model': aux.specs[k],
        'test_accuracy': float(aux.accuracies[k]),
        'train_size': int(ctx.client_sizes[k]),
      }
    ]

  def final_accuracy(self, history):
    return float(np.mean([r['test_accuracy'] for r in history]))

  def summarize(self, ctx, aux: LocalAux, state, history):
    """The run summary: every client's test accuracy and their mean."""
    return {
      'client_test_accuracy': aux.accuracies.tolist(),
      'mean_test_accuracy': float(np.mean(aux.accuracies)),
      'upload_bytes': aux.upload_bytes,
    }
