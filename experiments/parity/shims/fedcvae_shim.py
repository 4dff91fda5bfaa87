"""Runs FedCVAE's own `main.py` (github.com/ceh-2000/fed_cvae) on jfed's client partition.

Executed by the reference's Python (torch, torchvision, scipy), never by jfed's: it imports
nothing of jfed. The reference's files are not edited; this shim is the whole patch, applied
when their modules load:

- device: CPU (`torch.cuda.is_available` is False; the code picks its device from it);
- data path: torchvision's MNIST/FashionMNIST get `--data_root` instead of the hard-coded
  'data/mnist' (`data.py:Data`), so nothing is downloaded;
- partition: the user subsets are `Subset(train split, jfed's index list)` of `--partition` (a
  JSON list of lists written by `experiments.parity`), whichever split the flags select
  (`Data.split_data_dirichlet` with `--alpha`, `random_split` without); the code's own
  transforms (ToTensor, Resize(32)) and everything after the split stay theirs. A subsampled
  train split (`--sample_ratio` < 1) is refused: the index lists are into the full split;
- imports: modules the code imports but the parity path never uses are stubs when absent
  (`matplotlib`, `seaborn`, `pandas`: data plots; `torchsummary`: `__main__` blocks), and so
  is `sklearn.preprocessing.OneHotEncoder`, with what `utils.one_hot_encode` asks of it
  (`sparse=False`, the categories 0..C−1: a float64 one-hot array); `torch.utils.tensorboard`
  is always replaced (below);
- results: `SummaryWriter` is a stub that writes nothing and records every `add_scalar` (the
  code logs its server test accuracy as `Global Accuracy/test`; run with `--should_log=1`),
  tagged with its phase: 'init' (before the users train), 'epoch' (after each server
  classifier epoch: `train_classifier` runs its epochs one call each and the shim calls the
  code's own `evaluate` in between, restoring torch's, numpy's and Python's RNG state after it,
  so training draws exactly what the unpatched run draws), 'final' (`Server.test`). Each user's
  sample count, `data_amt` and label pmf (`create_users`) are recorded too. All of it goes to
  `--result` as JSON when the run ends.

Budget flags (`--local_epochs`, `--classifier_epochs`, ...) and `--seed` / `--data_seed` go to
the reference unchanged, after `--`.
"""

import atexit
import json
import os
import random
import runpy
import sys
import time

from shim_common import parse_harness_flags, stub_module

RECORD = {'scalars': [], 'users': [], 'phase': 'init'}


def _importable(name):
  try:
    __import__(name)
    return True
  except ImportError:
    return False


class OneHotEncoder:
  """What `utils.one_hot_encode` uses of sklearn's: fixed categories, dense float64 output."""

  def __init__(self, sparse=True, categories='auto', **kwargs):
    del sparse, kwargs
    self.categories = categories

  def fit_transform(self, values):
    import numpy as np  # pylint: disable=g-import-not-at-top

    values = np.asarray(values).reshape(len(values), -1)[:, 0]
    categories = np.asarray(self.categories[0])
    out = (values[:, None] == categories[None, :]).astype(np.float64)
    if len(values) and not out.any(axis=1).all():
      raise ValueError('OneHotEncoder stub: a value outside the given categories')
    return out


class SummaryWriter:
  """Records `add_scalar`; every other writer method does nothing."""

  def __init__(self, *args, **kwargs):
    del args, kwargs

  def add_scalar(self, tag, value, step=None, *args, **kwargs):
    del args, kwargs
    RECORD['scalars'].append(
      {
        'tag': str(tag),
        'value': float(value),
        'step': None if step is None else int(step),
        'phase': RECORD['phase'],
        'time': time.time(),
      }
    )

  def __getattr__(self, name):
    return _noop_attribute(name)


def _noop(*args, **kwargs):
  del args, kwargs


def _noop_attribute(name):
  """A stub module's `__getattr__`: every public name is a no-op function."""
  if name.startswith('__'):  # inspect, pickle, ... probe dunders: keep them missing
    raise AttributeError(name)
  return _noop


def _install_stubs():
  noop = _noop
  if not _importable('matplotlib.pyplot'):
    pyplot = stub_module('matplotlib.pyplot', __getattr__=_noop_attribute)
    stub_module('matplotlib', pyplot=pyplot)
  for name in ('seaborn', 'pandas'):
    if not _importable(name):
      stub_module(name, __getattr__=_noop_attribute)
  if not _importable('torchsummary'):
    stub_module('torchsummary', summary=noop)
  if not _importable('sklearn.preprocessing'):
    preprocessing = stub_module('sklearn.preprocessing', OneHotEncoder=OneHotEncoder)
    stub_module('sklearn', preprocessing=preprocessing)
  try:
    import ipdb  # noqa: F401  # pylint: disable=unused-import,g-import-not-at-top
  except ImportError:
    stub_module('ipdb', set_trace=noop)


def _cpu_only(torch):
  torch.cuda.is_available = lambda: False


def _tensorboard_recorder(torch):
  import torch.utils  # pylint: disable=g-import-not-at-top

  module = stub_module('torch.utils.tensorboard', SummaryWriter=SummaryWriter)
  torch.utils.tensorboard = module


def _redirect_data_root(data_root):
  from torchvision import datasets  # pylint: disable=g-import-not-at-top

  for cls in (datasets.MNIST, datasets.FashionMNIST):
    if '__init__' not in vars(cls):
      continue
    original = cls.__init__

    def init(self, root, *args, _original=original, **kwargs):
      _original(self, data_root, *args, **kwargs)

    cls.__init__ = init


def _use_partition(ref_data, parts):
  from torch.utils.data import Subset  # pylint: disable=g-import-not-at-top

  def subsets(dataset, num_users):
    if isinstance(dataset, Subset):
      raise SystemExit('--sample_ratio < 1: the partition indexes the full training split')
    if num_users != len(parts):
      raise SystemExit(f'--num_users={num_users} but the partition file has {len(parts)} clients')
    top = max((max(p) for p in parts if len(p)), default=-1)
    if top >= len(dataset):
      raise SystemExit(f'the partition holds index {top}, the training split {len(dataset)}')
    print(f'shim: user subsets from the partition file, sizes {[len(p) for p in parts]}')
    return [Subset(dataset, list(p)) for p in parts]

  def split_data_dirichlet(self, dataset_train, visualize):
    del visualize
    return subsets(dataset_train, self.num_users)

  def random_split(dataset, lengths, generator=None):
    del generator
    return subsets(dataset, len(lengths))

  ref_data.Data.split_data_dirichlet = split_data_dirichlet
  ref_data.random_split = random_split


def _record_users(server_cls):
  original = server_cls.create_users

  def create_users(self):
    original(self)
    for u in self.users:
      RECORD['users'].append(
        {
          'n': len(u.dataloader.dataset),
          'data_amt': float(u.data_amt),
          'pmf': [float(p) for p in u.pmf],
        }
      )

  server_cls.create_users = create_users


def _test_every_classifier_epoch(server_cls, torch, np):
  original = server_cls.train_classifier

  def train_classifier(self, reinitialize_weights=False):
    epochs = self.classifier_epochs
    try:
      self.classifier_epochs = 1
      for e in range(epochs):
        original(self, reinitialize_weights=reinitialize_weights and e == 0)
        states = torch.get_rng_state(), np.random.get_state(), random.getstate()
        RECORD['phase'] = 'epoch'
        self.evaluate(e + 1)
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
    finally:
      self.classifier_epochs = epochs
      RECORD['phase'] = 'final'

  server_cls.train_classifier = train_classifier


def main():
  ours, reference_args = parse_harness_flags('main.py')

  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import torchvision  # noqa: F401  # pylint: disable=unused-import,g-import-not-at-top

  _install_stubs()  # after torch: torch._dynamo probes (find_spec) the modules stubbed here
  _cpu_only(torch)
  _tensorboard_recorder(torch)
  _redirect_data_root(ours.data_root)
  sys.path.insert(0, ours.ref_dir)

  import data as ref_data  # pylint: disable=g-import-not-at-top
  from servers import server_fed_cvae_kd  # pylint: disable=g-import-not-at-top

  with open(ours.partition) as f:
    parts = [[int(i) for i in p] for p in json.load(f)]
  _use_partition(ref_data, parts)
  _record_users(server_fed_cvae_kd.ServerFedCVAEKD)
  _test_every_classifier_epoch(server_fed_cvae_kd.ServerFedCVAEKD, torch, np)
  start = time.time()

  def write_result():
    result = {
      'scalars': RECORD['scalars'],
      'users': RECORD['users'],
      'seconds': time.time() - start,
      'args': reference_args,
    }
    with open(ours.result, 'w') as f:
      json.dump(result, f)

  atexit.register(write_result)
  sys.argv = [os.path.join(ours.ref_dir, ours.script)] + reference_args
  runpy.run_path(sys.argv[0], run_name='__main__')


if __name__ == '__main__':
  main()
