"""Helpers shared by the end-to-end tests."""

import io
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jfed import engine
from jfed.configs import digits, fedhydra_digits, fedmho_digits, fedtsa_digits, hfldd_digits
from jfed.driver import RunCheckpointer
from jfed.methods import common
from jfed.models import get_model

HFLDD_CLIENTS = 20
# The DDPM of the tests (jfed.diffusion.train.DDPMConfig's fields), trained on 40 images of 8x8x1
# in two classes: the tests that train one share its compiled training step (through the
# persistent compilation cache across modules and processes) instead of compiling their own
# (10-25 s each).
DDPM_TINY = dict(timesteps=20, base_channels=8, steps=30, batch=16, lr=2e-3)
DDPM_IMAGES = 40


# Set by experiments.dev.mutation for the pytest runs of mutmut.
MUTATION_ENV = 'JFED_MUTATION_TESTING'


def shared_fixture_scope(fixture_name, config) -> str:
  """The scope of a fixture whose one computation several tests check: 'module', but 'function'
  under mutation testing. mutmut credits a call made while a fixture is set up to the first test
  that requested the fixture, and runs only the credited tests against a mutant, so the other
  tests' checks of the same computation would never see the mutant."""
  del fixture_name, config
  return 'function' if os.environ.get(MUTATION_ENV) else 'module'


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


ONESHOT = ('dense', 'coboosting', 'feddf', 'fedhydra', 'ot')
HFLDD_FAMILY = ('hfldd', 'hfldd_nodd', 'fedseq', 'dynafed')


def _oneshot(**overrides):
  """The one-shot methods on MLP clients: what resume checks does not depend on the model, and
  the CNN paths (BatchNorm statistics, the DENSE BN loss) run in tests/test_oneshot_methods.py."""
  return override(fedhydra_digits.get_config('smoke'), **{'model': 'mlp', **overrides})


def _hfldd():
  c = hfldd_tiny_config()
  c.hfldd.pretrain_epochs, c.hfldd.rounds, c.hfldd.local_epochs = 1, 3, 1
  c.fedseq.pretrain_epochs, c.fedseq.rounds, c.fedseq.local_epochs = 1, 3, 1
  d = c.dynafed
  # Rounds 1-2 record the trajectory, round 3 distils the synthetic set (once) and starts the
  # fine-tuning, round 4 is a round with fine-tuning.
  d.rounds, d.trajectory_rounds, d.local_epochs, d.participation = 4, 2, 1, 0.5
  d.finetune_epochs = 1
  return c


def smoke_config(method: str):
  """The smallest config on which `method` runs at least two steps, and every kind of step."""
  if method == 'fedhydra':
    # Two global rounds of two distillation epochs: step 1 is an epoch, step 2 a new round
    # (local training from the global model, new teachers, model stratification), step 3 an
    # epoch.
    return _oneshot(
      **{
        'fedhydra.rounds': 2,
        'fedhydra.epochs': 2,
        'fedhydra.local_epochs': 1,
        'fedhydra.ms_T_G': 1,
      }
    )
  if method == 'coboosting':  # its ensemble weights adapt from epoch 2 on: a third epoch
    return _oneshot(**{'coboosting.epochs': 3})
  if method in ONESHOT:
    return _oneshot()
  if method in HFLDD_FAMILY:
    return _hfldd()
  if method in ('fedmho', 'fedmho_md', 'fedmho_sd'):
    return fedmho_digits.get_config('smoke')
  if method == 'fedcvae_ens':
    return fedmho_digits.get_config('fedcvae,smoke')
  if method == 'fedcvae_kd':  # its server decoder takes every user's latents: one latent size
    # Two CVAE-small groups (two specs): the driver's path is that of CVAE-large, whose init
    # alone compiles for 3.5 s; the oracle and FedMHO tests run CVAE-large.
    c = fedmho_digits.get_config('fedcvae_kd,smoke')
    c.client_models = 'cvae:size=small,latent=20;cvae:size=small,latent=20,hidden=64'
    return c
  if method in ('heterofl', 'fedproto', 'fedmd', 'fedtsa'):  # MLP widths, partial participation
    return fedtsa_digits.get_config('smoke')
  if method == 'feddf_vote':  # two prototypes of two epochs
    c = fedmho_digits.get_config('baselines,smoke')
    c.feddf.update({'local_epochs': 1, 'total_steps': 4, 'eval_every': 2, 'patience': 100})
    return c
  # Partial participation: each FedProx round selects other clients, of other sizes.
  c = digits.get_config('smoke')
  c.fedavg.rounds = c.fedprox.rounds = 3
  return override(c, **{'model': 'mlp', 'fedprox.participation': 0.6})


def fashion_mnist_missing() -> bool:
  """Whether Fashion-MNIST's IDX files are absent (CI installs the Debian package; a fresh
  machine may not have it): tests that read it skip then."""
  from jfed.data import datasets  # pylint: disable=g-import-not-at-top

  try:
    datasets._find_idx_dir('fashion_mnist', None)  # pylint: disable=protected-access
  except datasets.DatasetNotFoundError:
    return True
  return False


needs_fashion_mnist = pytest.mark.skipif(
  fashion_mnist_missing(),
  reason='Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)',
)


def record_training_labels(monkeypatch):
  """The progress label of every `jfed.methods.common.train_groups` call from now on, in order
  (one entry per client group trained)."""
  labels, train = [], common.train_groups

  def recording(trainers, groups, models, epochs, key, label='', **kwargs):
    labels.extend([label] * len(groups))
    return train(trainers, groups, models, epochs, key, label=label, **kwargs)

  monkeypatch.setattr(common, 'train_groups', recording)
  return labels


def dropout_losses_and_logits(objective, x, y, weights, *extra):
  """A local objective on a VGG-9 with live dropout (rate 0.5; 8x8x1 images, 10 classes): its
  loss at step keys 1 and 2, and flax's own train-mode logits of the real rows (the weighted
  ones, first) under dropout key 1, for the test to score as the objective should."""
  shape = x.shape[1:]
  vgg = get_model('vgg9', 10, shape, width_mult=1 / 16, fc_width=16)
  v = engine.init_model(vgg, shape, jax.random.PRNGKey(0))
  losses = [
    float(objective(vgg, v.params, {}, x, y, weights, jax.random.PRNGKey(k), *extra)[0])
    for k in (1, 2)
  ]
  real = int(np.sum(weights > 0))
  logits = vgg.apply(v.variables(), x[:real], train=True, rngs={'dropout': jax.random.PRNGKey(1)})
  return losses, np.asarray(logits)


class Terminal(io.StringIO):
  """A stderr that says it is a terminal, so `jfed.reporting.Progress` draws its line."""

  def isatty(self):
    return True

  def lines(self):
    """Every state the progress line(s) went through, stripped."""
    return [l.strip() for l in self.getvalue().replace('\n', '\r').split('\r') if l.strip()]


def record_sample_grids(monkeypatch):
  """Captures every sample grid a run plots (`jfed.distill.plots.plot_image_grid`, still drawn):
  a list of (file name, images, labels, keyword arguments) that fills as the run goes."""
  from jfed.distill import plots  # pylint: disable=g-import-not-at-top

  grids = []
  grid = plots.plot_image_grid

  def record(path, images, labels=None, **kwargs):
    grids.append((os.path.basename(path), np.asarray(images), np.asarray(labels), kwargs))
    return grid(path, images, labels, **kwargs)

  monkeypatch.setattr(plots, 'plot_image_grid', record)
  return grids
