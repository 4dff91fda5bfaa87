"""Draws client partitions with the authors' own partition function, one draw per seed.

Executed by the reference's Python (torch, torchvision), never by jfed's: it imports nothing of
jfed. `--code` is a scratch checkout of the authors' repository; its files are not edited or
copied: the function is imported from there and called as their scripts call it, with the RNG
seeded per draw as their scripts seed it. The only patches are the data loaders (the labels come
from `--labels`, and `--test_labels` where the code counts classes on the test split) and stub
modules for plotting/metrics libraries the partition never calls:

- `dense` (github.com/zj-jayzhang/DENSE): `helpers.datasets.partition_data(dataset, 'dirichlet',
  beta, num_users)` after `helpers.utils.setup_seed(seed)` (`loop_df_fl.py`); `load_data` is
  patched.
- `fedmho` (github.com/YXShi2000/FedMHO, FedDF's pcode): `pcode.datasets.partition_data.
  DataPartitioner` with `partition_type='non_iid_dirichlet'` and `partition_sizes = [1/n] * n`
  (`pcode/create_dataset.py:define_data_loader`), on the train split as `define_val_dataset`
  leaves it with `--train_data_ratio 1 --val_data_ratio 0` (an 'origin' DataPartitioner's
  first part), with `conf.random_state = np.random.RandomState(seed)` (`main.py`,
  `--same_seed_process True`). The dataset object is a stand-in holding the labels as a torch
  tensor in `.targets`, as torchvision's FashionMNIST does.
- `fed_cvae` (github.com/ceh-2000/fed_cvae): `data.Data(seed, 'fashion', num_users, writer=None,
  central=False, sample_ratio, alpha)`, which seeds `np.random` itself; torchvision's
  FashionMNIST is patched in `data` with a stand-in yielding (None, label), and the result of
  `np.random.choice` in `data` converts with int() as under NumPy 1 (`data.py:266`; NumPy 2
  raises there).
- `niidbench` (github.com/Xtra-Computing/NIID-Bench): `utils.partition_data('fmnist', ...,
  'noniid-#label{k}', n_parties, beta)` after `np.random.seed`, `torch.manual_seed` and
  `random.seed` (`experiments.py`); `load_fmnist_data` is patched.

A draw that raises is recorded with its error. Per draw the JSON holds the client sizes, the
[clients, classes] count table, how many samples no client holds and how many are held twice.

  python partition_shim.py --reference=dense --code=DIR --labels=train.npy \
      --test_labels=test.npy --num_clients=5 --alpha=0.5 --seeds=0:100 --out=draws.json
"""

import argparse
import contextlib
import hashlib
import importlib.machinery
import io
import json
import os
import subprocess
import sys
import types

import numpy as np


def _stub_module(name, **attrs):
  """A stand-in module (with a spec: torch's import-time scans call importlib.util.find_spec)."""
  module = types.ModuleType(name)
  module.__spec__ = importlib.machinery.ModuleSpec(name, None)
  for key, value in attrs.items():
    setattr(module, key, value)
  sys.modules[name] = module
  return module


def _stub_if_missing(name, **attrs):
  try:
    __import__(name)
  except ImportError:
    parent, _, child = name.rpartition('.')
    module = _stub_module(name, **attrs)
    if parent:
      setattr(sys.modules.get(parent) or _stub_module(parent), child, module)


def labels_sha256(labels):
  """Fingerprint of the label vector (as int64), so a stored result names the labels it used."""
  return hashlib.sha256(np.ascontiguousarray(labels, dtype=np.int64).tobytes()).hexdigest()


def summarize(labels, parts, num_classes):
  """Client sizes, the count table, unassigned and doubly held samples of one partition."""
  parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
  flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  unique = np.unique(flat)
  return {
    'sizes': [int(len(p)) for p in parts],
    'class_counts': [np.bincount(labels[p], minlength=num_classes).tolist() for p in parts],
    'unassigned': int(len(labels) - len(unique)),
    'duplicates': int(len(flat) - len(unique)),
  }


class _OneElementInt(np.ndarray):
  """An array whose int() is its single element's, as for every ndarray before NumPy 2."""

  def __int__(self):
    return int(self.item())


def _numpy_one_int_choice():
  """numpy as FedCVAE's `data.py` sees it: `np.random.choice` returns a `_OneElementInt`.

  `data.py:266` assigns each leftover sample with `int(np.random.choice(users, size=1))`, which
  NumPy 2 refuses (int() of a 1-D array). The draws and the random stream are NumPy's own (the
  global RandomState that `np.random.seed` seeds); only the int() of the result is NumPy 1's.
  """
  random = types.ModuleType('numpy.random')
  random.__dict__.update(np.random.__dict__)
  random.choice = lambda *a, **k: np.asarray(np.random.choice(*a, **k)).view(_OneElementInt)
  proxy = types.ModuleType('numpy')
  proxy.__dict__.update(np.__dict__)
  proxy.random = random
  return proxy


class _Draws:
  """What each reference returns per seed: a list of index arrays, one per client."""

  def __init__(self, args, labels, test_labels):
    self.args = args
    self.labels = labels
    self.test_labels = test_labels
    sys.path.insert(0, args.code)

  def dense(self):
    from helpers import datasets, utils  # pylint: disable=g-import-not-at-top

    labels, test_labels = self.labels, self.test_labels
    datasets.load_data = lambda dataset: (None, labels, None, test_labels, None, None)

    def draw(seed):
      utils.setup_seed(seed)
      _, _, net_dataidx_map, _ = datasets.partition_data(
        'fmnist', 'dirichlet', beta=self.args.alpha, num_users=self.args.num_clients
      )
      return [net_dataidx_map[j] for j in range(self.args.num_clients)]

    return draw

  def fedmho(self):
    from pcode.datasets import partition_data as pd  # pylint: disable=g-import-not-at-top
    import torch  # pylint: disable=g-import-not-at-top

    class Targets:  # torchvision's FashionMNIST as far as DataPartitioner looks at it
      def __init__(self, targets):
        self.targets = torch.from_numpy(targets)

      def __len__(self):
        return len(self.targets)

    n = self.args.num_clients
    dataset = Targets(self.labels)

    def draw(seed):
      conf = types.SimpleNamespace(
        graph=types.SimpleNamespace(rank=0),
        data='fashionmnist',
        non_iid_alpha=self.args.alpha,
        random_state=np.random.RandomState(seed),
        logger=types.SimpleNamespace(log=lambda *a, **k: None),
      )
      torch.manual_seed(seed)
      train = pd.DataPartitioner(
        conf, dataset, [1.0, 0.0, 0.0], partition_type='origin', consistent_indices=False
      ).use(0)
      partitioner = pd.DataPartitioner(
        conf, train, [1.0 / n for _ in range(n)], partition_type='non_iid_dirichlet'
      )
      return [partitioner.partitions[i] for i in range(n)]

    return draw

  def fed_cvae(self):
    _stub_if_missing('matplotlib')
    _stub_if_missing('matplotlib.pyplot')
    _stub_if_missing('pandas')
    _stub_if_missing('seaborn')
    import data  # pylint: disable=g-import-not-at-top

    labels, test_labels = self.labels, self.test_labels

    class FashionMNIST:  # yields (image, label) like torchvision's; the image is never read
      def __init__(self, root, download=False, train=True, transform=None):
        del root, download, transform
        self.targets = labels if train else test_labels

      def __len__(self):
        return len(self.targets)

      def __getitem__(self, i):
        return None, int(self.targets[i])

    data.FashionMNIST = FashionMNIST
    data.np = _numpy_one_int_choice()

    def draw(seed):
      d = data.Data(
        seed,
        'fashion',
        self.args.num_clients,
        writer=None,
        central=False,
        sample_ratio=self.args.sample_ratio,
        alpha=self.args.alpha,
        visualize=False,
      )
      return [subset.indices for subset in d.train_data]

    return draw

  def niidbench(self):
    import random  # pylint: disable=g-import-not-at-top

    import torch  # pylint: disable=g-import-not-at-top

    _stub_if_missing('sklearn')
    _stub_if_missing('sklearn.metrics', confusion_matrix=None)
    _stub_if_missing('sklearn.datasets', load_svmlight_file=None)
    import utils  # pylint: disable=g-import-not-at-top

    labels, test_labels = self.labels, self.test_labels
    utils.load_fmnist_data = lambda datadir: (None, labels, None, test_labels)
    partition = f'noniid-#label{self.args.k}'

    def draw(seed):
      np.random.seed(seed)
      torch.manual_seed(seed)
      random.seed(seed)
      out = utils.partition_data('fmnist', './data', './logs', partition, self.args.num_clients)
      net_dataidx_map = out[4]
      return [net_dataidx_map[j] for j in range(self.args.num_clients)]

    return draw


def _seeds(spec):
  first, _, last = spec.partition(':')
  return list(range(int(first), int(last))) if last else [int(s) for s in spec.split(',')]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument(
    '--reference', required=True, choices=['dense', 'fedmho', 'fed_cvae', 'niidbench']
  )
  parser.add_argument('--code', required=True, help="scratch checkout of the authors' repository")
  parser.add_argument('--labels', required=True, help='train labels, .npy')
  parser.add_argument('--test_labels', required=True, help='test labels, .npy')
  parser.add_argument('--num_clients', type=int, required=True)
  parser.add_argument('--alpha', type=float, default=0.5)
  parser.add_argument('--k', type=int, default=2)
  parser.add_argument('--sample_ratio', type=float, default=1.0)
  parser.add_argument('--seeds', default='0:100', help='FIRST:END or a comma list')
  parser.add_argument('--out', required=True)
  args = parser.parse_args()
  args.code = os.path.abspath(args.code)

  labels = np.load(args.labels).astype(np.int64)
  test_labels = np.load(args.test_labels).astype(np.int64)
  num_classes = int(labels.max()) + 1
  draw = getattr(_Draws(args, labels, test_labels), args.reference)()
  draws = []
  for seed in _seeds(args.seeds):
    try:
      with contextlib.redirect_stdout(io.StringIO()):  # their per-draw class-count prints
        parts = draw(seed)
      draws.append({'seed': seed, **summarize(labels, parts, num_classes)})
    except Exception as e:  # pylint: disable=broad-except  # recorded: a refusal is a result
      draws.append({'seed': seed, 'error': f'{type(e).__name__}: {e}'})
  commit = subprocess.run(
    ['git', '-C', args.code, 'rev-parse', 'HEAD'], capture_output=True, text=True, check=False
  ).stdout.strip()
  result = {
    'reference': args.reference,
    'code': args.code,
    'commit': commit,
    'num_clients': args.num_clients,
    'alpha': args.alpha,
    'k': args.k,
    'sample_ratio': args.sample_ratio,
    'labels_sha256': labels_sha256(labels),
    'draws': draws,
  }
  tmp = args.out + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(result, f)
  os.replace(tmp, args.out)


if __name__ == '__main__':
  main()
