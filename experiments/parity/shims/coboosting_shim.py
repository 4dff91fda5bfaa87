"""Runs Co-Boosting's own scripts (github.com/rong-dai/Co-Boosting) on jfed's client partition.

  coboosting_shim.py --ref_dir=CODE --partition=P.json --data_root=ROOT --result=R.json \
      -- fl_pretrain.py --dataset=fmnist ...      # or: -- datafree_kd.py --method=co_boosting ...

The first argument after `--` is the reference script (`fl_pretrain.py`: the clients;
`datafree_kd.py`: the server), the rest its own flags, unchanged. Executed by the reference's
Python (torch, torchvision), never by jfed's: it imports nothing of jfed. The reference's files
are not edited; this shim is the whole patch, applied before their modules load:

- device: `Tensor.cuda` and `Module.cuda` return their receiver, and `Tensor.to('cuda')`
  (`datafree_kd.py:cb_kd_train`, the ODS noise) stays on the CPU (the code has no device flag);
  every `DataLoader` runs in the main process without pinned memory (the code asks for 4 workers;
  this changes no number: worker or not, every loader iterator draws the same base seed);
- paths: the hard-coded '/gdata/...' log, checkpoint and synthetic-pool paths are remapped to
  './gdata/...' in the working directory (`os.makedirs`, `os.path.exists`,
  `logging.FileHandler`, `torch.save`, `torch.load`, `datafree.utils.ImagePool`), so the two
  scripts meet there as in the authors' set-up; `registry.get_dataset` gets `--data_root`;
- partition: `utils_fl.partition_data` returns the client index lists of `--partition` (a JSON
  list of lists written by `experiments.parity`), after the reference's own `load_data` and
  `record_net_data_stats`, so transforms and statistics stay theirs;
- model: the released `cnn` (`CNNCifar`, `datafree/models/classifiers/resnet.py`) has a 3-channel
  first convolution and cannot read MNIST / Fashion-MNIST (1 channel, which the code's own
  generator produces: `datafree_kd.py:201-202`); for those datasets `registry.get_model` gives it
  a 1-channel `conv1` (PyTorch's default init, the rest of the network unchanged);
- imports: `termcolor` (`datafree/utils/logger.py`) and `torchvision.models.utils` (removed from
  torchvision; `mobilenetv2.py` imports its `load_state_dict_from_url`) are stubs if absent;
- results, written to `--result` as JSON when the run ends: every `utils_fl.class_test` call in
  order with its accuracy (and the ensemble weights of a weighted ensemble), every
  `datafree.evaluators.Evaluator` call (the student's per-epoch test accuracy, from which the
  script takes its best), and, in `fl_pretrain.py`, each client's test accuracy after each
  local epoch: at the script's end-of-epoch log line the model being trained is read from
  `LocalUpdate.update_weights`'s frame and tested with the reference's own `utils_fl.test`
  (batch 256, as the script's test loader), the global RNG state saved and restored around it
  so the run's random stream is untouched.
"""

import atexit
import json
import logging
import os
import runpy
import sys
import time

from shim_common import parse_harness_flags, stub_module

GDATA = '/gdata/'
GRAY_DATASETS = ('mnist', 'fmnist')


def _install_stubs(torch):
  try:
    import termcolor  # noqa: F401  # pylint: disable=unused-import,g-import-not-at-top
  except ImportError:
    stub_module('termcolor', colored=lambda text, *args, **kwargs: text)
  try:
    import torchvision.models.utils  # noqa: F401  # pylint: disable=unused-import,g-import-not-at-top
  except ImportError:
    import torch.hub  # pylint: disable=g-import-not-at-top

    stub_module(
      'torchvision.models.utils', load_state_dict_from_url=torch.hub.load_state_dict_from_url
    )


def _cpu_only(torch):
  torch.Tensor.cuda = lambda self, *args, **kwargs: self
  torch.nn.Module.cuda = lambda self, *args, **kwargs: self
  original_to = torch.Tensor.to

  def to(self, *args, **kwargs):
    def cpu(d):
      is_cuda = (isinstance(d, str) and d.startswith('cuda')) or (
        isinstance(d, torch.device) and d.type == 'cuda'
      )
      return 'cpu' if is_cuda else d

    args = tuple(cpu(a) for a in args)
    if 'device' in kwargs:
      kwargs['device'] = cpu(kwargs['device'])
    return original_to(self, *args, **kwargs)

  torch.Tensor.to = to
  loader_init = torch.utils.data.DataLoader.__init__

  def init(self, *args, **kwargs):
    # positionally: dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, ...
    if len(args) > 5:
      raise TypeError('the shim expects num_workers by keyword')
    kwargs.update(num_workers=0, pin_memory=False)
    loader_init(self, *args, **kwargs)

  torch.utils.data.DataLoader.__init__ = init


def _remap_paths(torch, root):
  """'/gdata/...' -> '<root>/gdata/...' wherever the scripts read or write."""

  def remap(path):
    if isinstance(path, (str, os.PathLike)):
      text = os.fspath(path)
      if text.startswith(GDATA):
        return os.path.join(root, 'gdata', text[len(GDATA) :])
    return path

  makedirs, exists = os.makedirs, os.path.exists
  os.makedirs = lambda name, *args, **kwargs: makedirs(remap(name), *args, **kwargs)
  os.path.exists = lambda path: exists(remap(path))
  handler_init = logging.FileHandler.__init__
  logging.FileHandler.__init__ = lambda self, filename, *args, **kwargs: handler_init(
    self, remap(filename), *args, **kwargs
  )
  save, load = torch.save, torch.load
  torch.save = lambda obj, f, *args, **kwargs: save(obj, remap(f), *args, **kwargs)
  torch.load = lambda f, *args, **kwargs: load(remap(f), *args, **kwargs)
  return remap


def _reference_flag(args, name, default=None):
  """The value of `--name=v` / `--name v` among the reference's flags."""
  for i, arg in enumerate(args):
    if arg == f'--{name}' and i + 1 < len(args):
      return args[i + 1]
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
  return default


def main():
  ours, rest = parse_harness_flags()
  if not rest or not rest[0].endswith('.py'):
    raise SystemExit('usage: coboosting_shim.py OUR_FLAGS -- SCRIPT.py [its flags]')
  script, reference_args = rest[0], rest[1:]
  dataset = _reference_flag(reference_args, 'dataset', 'cifar10')

  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  _install_stubs(torch)
  _cpu_only(torch)
  remap = _remap_paths(torch, os.getcwd())
  sys.path.insert(0, ours.ref_dir)

  import datafree  # pylint: disable=g-import-not-at-top
  import registry as ref_registry  # pylint: disable=g-import-not-at-top
  import utils_fl  # pylint: disable=g-import-not-at-top

  # data root and 1-channel `cnn`
  get_dataset = ref_registry.get_dataset
  ref_registry.get_dataset = lambda name, data_root='data', *args, **kwargs: get_dataset(
    name, ours.data_root, *args, **kwargs
  )
  get_model = ref_registry.get_model

  def gray_model(name, num_classes, pretrained=False, **kwargs):
    model = get_model(name, num_classes, pretrained, **kwargs)
    conv1 = getattr(model, 'conv1', None)
    if dataset in GRAY_DATASETS and isinstance(conv1, torch.nn.Conv2d) and conv1.in_channels == 3:
      model.conv1 = torch.nn.Conv2d(
        1, conv1.out_channels, conv1.kernel_size, conv1.stride, conv1.padding,
        bias=conv1.bias is not None,
      )  # fmt: skip
    return model

  ref_registry.get_model = gray_model
  pool_init = datafree.utils.ImagePool.__init__
  datafree.utils.ImagePool.__init__ = lambda self, root: pool_init(self, remap(root))

  # partition
  with open(ours.partition) as f:
    parts = [np.asarray(p, dtype=np.int64) for p in json.load(f)]
  data = {}

  def partition_data(trn_dst, tst_dst, partition, beta=0.4, num_users=5, logger=None, args=None):
    del partition, beta  # the split is jfed's, written to --partition
    if num_users != len(parts):
      raise SystemExit(f'--num_users={num_users} but the partition file has {len(parts)} clients')
    _, y_train, _, _, train_dataset, test_dataset = utils_fl.load_data(trn_dst, tst_dst, args)
    user_groups = {i: p for i, p in enumerate(parts)}
    counts = utils_fl.record_net_data_stats(y_train, user_groups, logger)
    data['test'] = test_dataset
    return train_dataset, test_dataset, user_groups, counts

  utils_fl.partition_data = partition_data

  # results
  tests, evals, curves = [], [], {}
  original_class_test = utils_fl.class_test

  def recorded_class_test(model, test_loader, logger):
    acc, loss = original_class_test(model, test_loader, logger)
    record = {'accuracy': float(acc), 'loss': float(loss), 'model': type(model).__name__}
    weights = getattr(model, 'mdl_w_list', None)
    if weights is not None:
      record['weights'] = [float(w) for w in weights.detach().reshape(-1)]
    tests.append(record)
    return acc, loss

  utils_fl.class_test = recorded_class_test
  original_eval = datafree.evaluators.Evaluator.eval

  def recorded_eval(self, model, progress=False):
    results = original_eval(self, model, progress)
    (acc1, _), loss = results['Acc'], results['Loss']
    evals.append({'accuracy': float(acc1), 'loss': float(loss), 'time': time.time()})
    return results

  datafree.evaluators.Evaluator.eval = recorded_eval

  class ClientCurve(logging.Handler):
    """At `LocalUpdate.update_weights`'s end-of-epoch log line: the client's test accuracy."""

    def emit(self, record):
      if not str(record.msg).startswith('Iter:') or 'test' not in data:
        return
      frame = sys._getframe()  # pylint: disable=protected-access
      while frame is not None and frame.f_code.co_name != 'update_weights':
        frame = frame.f_back
      if frame is None:
        return
      model, client = frame.f_locals['model'], int(frame.f_locals['client_id'])
      rng = torch.get_rng_state()
      loader = torch.utils.data.DataLoader(data['test'], batch_size=256, shuffle=False)
      acc, _ = utils_fl.test(model, loader, None)
      torch.set_rng_state(rng)
      model.train()  # update_weights trains in train mode
      curves.setdefault(client, []).append(float(acc))

  curve_handler = ClientCurve(level=logging.DEBUG)
  logging.getLogger().addHandler(curve_handler)
  start = time.time()

  def write_result():
    result = {
      'script': script,
      'tests': tests,
      'evals': evals,
      'client_curves': [curves[k] for k in sorted(curves)],
      'seconds': time.time() - start,
      'args': reference_args,
    }
    with open(ours.result, 'w') as f:
      json.dump(result, f)

  atexit.register(write_result)
  sys.argv = [os.path.join(ours.ref_dir, script)] + reference_args
  runpy.run_path(sys.argv[0], run_name='__main__')


if __name__ == '__main__':
  main()
