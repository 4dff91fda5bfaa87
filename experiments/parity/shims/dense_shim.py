"""Runs DENSE's own `loop_df_fl.py` (github.com/zj-jayzhang/DENSE) on jfed's client partition.

Executed by the reference's Python (torch, torchvision, kornia), never by jfed's: it imports
nothing of jfed. The reference's files are not edited; this shim is the whole patch, applied
when their modules load:

- device: where torch sees no GPU, `Tensor.cuda` and `Module.cuda` return their receiver (the
  code calls `.cuda()` everywhere and has no device flag); on a GPU the code runs as written;
- data path: torchvision's MNIST/FashionMNIST get `--data_root` instead of the hard-coded
  '/dataset' (`helpers/datasets.py:load_data`);
- partition: `helpers.datasets.partition_data` returns the client index lists of `--partition`
  (a JSON list of lists written by `experiments.parity`), after the reference's own `load_data`
  and `record_net_data_stats`, so transforms and statistics stay theirs;
- imports: `torch._six`, removed in torch 2.0 and imported by `models/vit.py`, is a stub;
- logging: `wandb` is a no-op module (the code logs to W&B; no network here), `ipdb` a stub
  if absent;
- results: every call of `helpers.utils.test` is recorded, in order, with the accuracy it
  returned, and written to `--result` as JSON when the run ends.

Budget flags (`--local_ep`, `--epochs`, `--g_steps`, ...) and `--seed` go to the reference
unchanged, after `--`.
"""

import atexit
import json
import os
import runpy
import sys
import time
import types

from shim_common import parse_harness_flags, stub_module


def _install_stubs():
  noop = lambda *args, **kwargs: None
  plot = types.SimpleNamespace(line_series=noop)
  stub_module('wandb', init=noop, log=noop, plot=plot, finish=noop)
  try:
    import ipdb  # noqa: F401  # pylint: disable=unused-import,g-import-not-at-top
  except ImportError:
    stub_module('ipdb', set_trace=noop)


def _old_torch_names(torch):
  """`torch._six` (gone since torch 2.0), which `models/vit.py` imports at load time."""
  import collections.abc  # pylint: disable=g-import-not-at-top

  if '_six' not in dir(torch):
    six = stub_module('torch._six', container_abcs=collections.abc, string_classes=(str,))
    six.int_classes = int
    torch._six = six  # pylint: disable=protected-access


def _cpu_only(torch):
  torch.Tensor.cuda = lambda self, *args, **kwargs: self
  torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _redirect_data_root(data_root):
  try:
    from torchvision import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:  # a reference that reads no torchvision dataset
    return

  for cls in (datasets.MNIST, datasets.FashionMNIST):
    original = cls.__init__

    def init(self, root, *args, _original=original, **kwargs):
      _original(self, data_root, *args, **kwargs)

    cls.__init__ = init


def main():
  ours, reference_args = parse_harness_flags('loop_df_fl.py')

  _install_stubs()
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  _old_torch_names(torch)
  if not torch.cuda.is_available():
    _cpu_only(torch)
  _redirect_data_root(ours.data_root)
  sys.path.insert(0, ours.ref_dir)

  import helpers.datasets as ref_datasets  # pylint: disable=g-import-not-at-top
  import helpers.utils as ref_utils  # pylint: disable=g-import-not-at-top

  with open(ours.partition) as f:
    parts = [np.asarray(p, dtype=np.int64) for p in json.load(f)]

  def partition_data(dataset, partition, beta=0.4, num_users=5):
    del partition, beta  # the split is jfed's, written to --partition
    if num_users != len(parts):
      raise SystemExit(f'--num_users={num_users} but the partition file has {len(parts)} clients')
    x_train, y_train, _, _, train_dataset, test_dataset = ref_datasets.load_data(dataset)
    user_groups = {i: p for i, p in enumerate(parts)}
    counts = ref_datasets.record_net_data_stats(y_train, user_groups)
    return train_dataset, test_dataset, user_groups, counts

  ref_datasets.partition_data = partition_data

  tests = []
  original_test = ref_utils.test

  def recorded_test(model, test_loader):
    acc, loss = original_test(model, test_loader)
    tests.append({'accuracy': float(acc), 'loss': float(loss), 'time': time.time()})
    return acc, loss

  ref_utils.test = recorded_test
  start = time.time()

  def write_result():
    result = {'tests': tests, 'seconds': time.time() - start, 'args': reference_args}
    with open(ours.result, 'w') as f:
      json.dump(result, f)

  atexit.register(write_result)
  sys.argv = [os.path.join(ours.ref_dir, ours.script)] + reference_args
  runpy.run_path(sys.argv[0], run_name='__main__')


if __name__ == '__main__':
  main()
