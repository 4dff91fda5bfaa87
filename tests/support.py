"""Helpers shared by the end-to-end tests."""

import json

from jfed.driver import RunCheckpointer


def override(config, **overrides):
  """Sets dotted config keys: override(c, **{'fedavg.rounds': 2, 'seed': 1})."""
  for key, value in overrides.items():
    node = config
    *path, last = key.split('.')
    for p in path:
      node = node[p]
    node[last] = value
  return config


class Interrupted(Exception):
  """Stands for a kill of the process."""


def interrupt_after(monkeypatch, step):
  """Simulates a kill right after the driver's checkpoint of `step` is written."""
  save = RunCheckpointer.save

  def save_then_die(self, s, state, history=None):
    save(self, s, state, history)
    if s == step:
      raise Interrupted()

  monkeypatch.setattr(RunCheckpointer, 'save', save_then_die)


def read_metrics(workdir):
  """metrics.jsonl records without their wall-clock fields, for run-to-run comparison."""
  records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  for r in records:
    r.pop('seconds', None)
  return records
