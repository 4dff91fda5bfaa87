"""Helpers shared by the end-to-end tests."""

import json
import shutil

from experiments.configs import hfldd_digits
from jfed.driver import RunCheckpointer

HFLDD_CLIENTS = 20


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


def snapshot_every_step(monkeypatch, destination, on_save=None):
  """Copies the workdir to `destination`/<step> right after the driver's checkpoint of each step:
  the files a kill at that moment leaves (interrupt_after's), while the run goes on to its end.
  A resume test then needs one whole run and the resumed steps, not a third, interrupted run.
  `on_save(step)` is called after each copy (the end of the driver's work for that step)."""
  save = RunCheckpointer.save

  def save_then_copy(self, s, state, history=None):
    save(self, s, state, history)  # returns once the checkpoint is on disk
    shutil.copytree(self.directory.parent, destination / str(s))
    if on_save is not None:
      on_save(s)

  monkeypatch.setattr(RunCheckpointer, 'save', save_then_copy)


def comparable_summary(summary):
  """A run summary without its wall-clock fields, for run-to-run comparison."""
  return {k: v for k, v in summary.as_dict().items() if 'seconds' not in k}


def read_metrics(workdir):
  """metrics.jsonl records without their wall-clock fields, for run-to-run comparison."""
  records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  for r in records:
    r.pop('seconds', None)
  return records


def hfldd_tiny_config(**overrides):
  """The HFLDD family's test config: digits #C=1 over 20 clients (two per class, ~72 images
  each), an MLP, tiny budgets. Every test of the family starts here and changes only round and
  epoch counts, which shape no compiled program: the KIP scan length, the DynaFed trajectory
  and synthetic-set sizes and the client count stay the same, so the suite compiles their
  programs once (tests/conftest.py's persistent cache serves the other tests)."""
  c = hfldd_digits.get_config('smoke')
  c.model = 'mlp'
  c.partition.num_clients = HFLDD_CLIENTS
  c.hfldd.public_size = 60
  c.hfldd.pretrain_epochs, c.hfldd.rounds, c.hfldd.local_epochs = 2, 3, 4
  c.hfldd.kip.support_size, c.hfldd.kip.iterations = 10, 10
  c.fedseq.public_size, c.fedseq.pretrain_epochs = 60, 2
  c.fedseq.rounds, c.fedseq.local_epochs = 2, 2
  c.dynafed.rounds, c.dynafed.local_epochs = 3, 5
  c.dynafed.trajectory_rounds, c.dynafed.expert_epochs = 2, 1
  c.dynafed.ipc, c.dynafed.syn_steps, c.dynafed.iterations = 1, 2, 3
  c.dynafed.finetune_epochs = 2
  return override(c, **overrides)
