"""Runs FedMHO's own `main.py` (github.com/YXShi2000/FedMHO) on jfed's client partition.

Executed by the reference's Python (torch, torchvision), never by jfed's: it imports nothing of
jfed. The reference's files are not edited; this shim is the whole patch, applied when their
modules load:

- MPI: the code is a master/worker program over `torch.distributed`'s MPI backend
  (`main.py:main`, `pcode/master_lmf.py`, `pcode/worker_lmf.py`). Here the world runs in this
  one process: `torch.distributed`'s calls are replaced by an in-memory world (`_World`) and the
  master runs as usual; when it waits for a worker's model (`irecv(...).wait()`), that worker
  runs from its start to its upload (`main.main` with the worker's rank: its own `init_config`,
  so its own `torch.manual_seed`, as a separate MPI process has; the master's random state is
  restored afterwards). Workers therefore train one after the other, each as its own process
  would. One communication round only (FedMHO is one-shot);
- device: where torch sees no GPU, `Tensor.cuda` and `Module.cuda` return their receiver
  (`--on_cuda=False` is passed, but `pcode/aggregation/semi_supervised.py` calls `.cuda()`
  unconditionally); on a GPU `--on_cuda=True` replaces it and the code runs as written;
- data path: torchvision's FashionMNIST/MNIST get `--data_root` instead of `<data_dir>/<name>`;
- partition: `DataPartitioner` with the run's `--partition_data` scheme takes the client index
  lists of `--partition` (a JSON list of lists into the training split, written by
  `experiments.parity`) instead of drawing its own; the master records the class counts of those
  lists as the reference does (`record_class_distribution`, read by the server's generation
  weights);
- imports: `lmdb`, `cv2`, `msgpack`, `msgpack_numpy` (LMDB/ImageNet loaders), `bit2byte`,
  `skimage` (HOG features, off) and `matplotlib` (figures) are no-op stubs when missing, and
  `sklearn.cluster.KMeans` a one-cluster stub whose centre is the mean of the points (the only
  use, `pcode/utils/data_clean.py`, fits one cluster, whose k-means optimum is the mean);
  `pcode/utils/data_clean.py:visualize_and_save_images` (a figure of 64 kept samples, which
  fails on classes with fewer) is a no-op;
- hash seed: the process re-executes itself with PYTHONHASHSEED=0 (the master builds its client
  model templates in the order of a `set` of architecture names, and so draws their initial
  weights in that order);
- results: every `pcode.master_utils.validate` call of the master is recorded with its label and
  top-1 accuracy; after each epoch of the server's training (`semi_supervised.aggregate`) the
  global model is tested on the master's test loader (eval mode, the random state saved and
  restored, so the run goes on as without it); the kept/generated counts of the K-means filter
  are recorded per class; all written to `--result` as JSON when the run ends.

Shim options, given among the reference's flags and removed before the reference parses them:
`--shim_server_epochs=N` (N > 0: the server trains N epochs instead of the hard-coded 20 for
Fashion-MNIST of `semi_supervised.aggregate`); `--shim_local_models=PATH` (the received local
models are saved there and, on a later run whose flags differ from this one's at most in
`--is_md` / `--is_sd` and whose partition is the same, read back instead of training the workers
again: FedMHO, -MD and -SD differ only on the server, and the workers never read those flags);
`--shim_cvae_lr=LR` (LR > 0: the CVAE clients' Adam takes LR instead of the hard-coded rate of
`pcode/worker_lmf.py:Worker._train`, 5e-2 for CVAE-small on (Fashion-)MNIST, at which a CVAE
now and then diverges and the run stops: its NaN reconstruction fails `binary_cross_entropy`);
`--shim_eval_clients=True` (each received classifier is tested on the master's test loader).
"""

import argparse
import atexit
import builtins
import collections
import copy
import hashlib
import json
import os
import random
import sys
import time

from shim_common import parse_harness_flags, stub_package

CACHE_VERSION = 1
SERVER_FLAGS = ('--is_md', '--is_sd')  # the flags FedMHO, -MD and -SD differ in


def _missing(name):
  try:
    __import__(name)
    return False
  except ImportError:
    return True


class _NoOp:
  """Anything: every attribute, call and index is another no-op."""

  def __getattr__(self, name):
    return _no_op_attribute(name)

  def __call__(self, *args, **kwargs):
    return _NoOp()

  def __getitem__(self, key):
    return _NoOp()

  def __iter__(self):
    return iter((_NoOp(), _NoOp()))


def _no_op_attribute(name):
  if name.startswith('__'):  # module protocol (__file__, __spec__ ...): as a real module
    raise AttributeError(name)
  return _NoOp()


def _install_stubs(np):
  noop = lambda *args, **kwargs: None  # noqa: E731
  for name in ('lmdb', 'cv2', 'bit2byte', 'msgpack'):
    if _missing(name):
      stub_package(name)
  if _missing('msgpack_numpy'):
    stub_package('msgpack_numpy', patch=noop)
  if _missing('skimage.feature'):
    stub_package('skimage')
    stub_package('skimage.feature', hog=noop)
  if _missing('matplotlib.pyplot'):
    stub_package('matplotlib', use=noop)
    pyplot = stub_package('matplotlib.pyplot')
    pyplot.__getattr__ = _no_op_attribute
    stub_package('matplotlib.lines', Line2D=_NoOp)
  if _missing('sklearn.cluster'):

    class KMeans:
      """sklearn's KMeans for n_clusters=1: the centre is the mean of the points."""

      def __init__(self, n_clusters=8, **kwargs):
        if n_clusters != 1:
          raise NotImplementedError('the shim stubs KMeans for one cluster only')
        del kwargs

      def fit(self, x):
        x = np.asarray(x)
        self.cluster_centers_ = x.astype(np.float64).mean(0, keepdims=True).astype(x.dtype)
        self.labels_ = np.zeros(len(x), np.int32)
        return self

    stub_package('sklearn')
    stub_package('sklearn.cluster', KMeans=KMeans)


def _cpu_only(torch):
  torch.Tensor.cuda = lambda self, *args, **kwargs: self
  torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _redirect_data_root(data_root):
  from torchvision import datasets  # pylint: disable=g-import-not-at-top

  for cls in (datasets.MNIST, datasets.FashionMNIST):
    original = cls.__init__

    def init(self, root, *args, _original=original, **kwargs):
      kwargs['download'] = False
      _original(self, data_root, *args, **kwargs)

    cls.__init__ = init


class _Request:
  def __init__(self, wait):
    self._wait = wait

  def wait(self, *args, **kwargs):
    del args, kwargs
    if self._wait is not None:
      self._wait()
      self._wait = None
    return True

  def is_completed(self):
    return self._wait is None


class _World:
  """`torch.distributed` for a master (rank 0) and workers run on demand in this process."""

  def __init__(self, run_worker):
    self.rank = 0
    self.run_worker = run_worker
    self.done = set()
    self.mail = collections.defaultdict(collections.deque)
    self.broadcasts = {}

  def install(self, dist):
    dist.init_process_group = lambda *args, **kwargs: None
    dist.is_initialized = lambda: True
    dist.is_available = lambda: True
    dist.get_rank = lambda *args, **kwargs: self.rank
    dist.get_world_size = lambda *args, **kwargs: self.world_size
    dist.barrier = lambda *args, **kwargs: None
    dist.broadcast = self.broadcast
    dist.send = self.send
    dist.isend = self.isend
    dist.recv = self.recv
    dist.irecv = self.irecv
    dist.all_reduce = self.all_reduce

  world_size = 1

  def broadcast(self, tensor, src, *args, **kwargs):
    del args, kwargs
    if self.rank == src:
      self.broadcasts[src] = tensor.detach().clone()
    else:
      tensor.copy_(self.broadcasts[src])

  def send(self, tensor, dst, *args, **kwargs):
    del args, kwargs
    self.mail[(self.rank, dst)].append(tensor.detach().clone())

  def isend(self, tensor, dst, *args, **kwargs):
    self.send(tensor, dst, *args, **kwargs)
    return _Request(None)

  def recv(self, tensor, src, *args, **kwargs):
    del args, kwargs
    key = (src, self.rank)
    if not self.mail[key]:
      if self.rank != 0 or src in self.done:
        raise RuntimeError(f'rank {self.rank} waits for a message from rank {src} that never comes')
      self.done.add(src)
      self.run_worker(src)
    if not self.mail[key]:
      raise RuntimeError(f'worker {src} ended without sending its model')
    tensor.copy_(self.mail[key].popleft())
    return src

  def irecv(self, tensor, src, *args, **kwargs):
    return _Request(lambda: self.recv(tensor, src, *args, **kwargs))

  def all_reduce(self, tensor, *args, **kwargs):
    del tensor, args, kwargs  # a world of one process at a time: the sum is the tensor


def _accuracy(torch, model, loader):
  """Top-1 accuracy (%) of `model` on `loader`, in eval mode; the random state and the model's
  mode are restored (a DataLoader draws its base seed from the global generator)."""
  state = torch.get_rng_state()
  training = model.training
  model.eval()
  device = next(model.parameters()).device
  correct = total = 0
  with torch.no_grad():
    for x, y in loader:
      x, y = x.to(device), y.to(device)
      correct += int((model(x).argmax(1) == y).sum())
      total += int(len(y))
  model.train(training)
  torch.set_rng_state(state)
  return 100.0 * correct / total


def _cache_key(reference_args, cvae_lr, partition_path):
  kept = [a for a in reference_args if not a.startswith(SERVER_FLAGS)]
  with open(partition_path, 'rb') as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  return json.dumps(
    {'version': CACHE_VERSION, 'args': kept, 'cvae_lr': cvae_lr, 'partition': digest}
  )


def main():
  ours, rest = parse_harness_flags()
  shim_parser = argparse.ArgumentParser(allow_abbrev=False)
  shim_parser.add_argument('--shim_server_epochs', type=int, default=0)
  shim_parser.add_argument('--shim_cvae_lr', type=float, default=0.0)
  shim_parser.add_argument('--shim_local_models', default='')
  shim_parser.add_argument('--shim_eval_clients', default='False')
  shim, reference_args = shim_parser.parse_known_args(rest)
  eval_clients = shim.shim_eval_clients.lower() in ('1', 'true', 'yes')

  if os.environ.get('PYTHONHASHSEED') != '0':
    os.environ['PYTHONHASHSEED'] = '0'
    os.execv(sys.executable, [sys.executable, *sys.argv])

  import numpy as np  # pylint: disable=g-import-not-at-top

  _install_stubs(np)
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top

  if torch.cuda.is_available():
    reference_args = ['--on_cuda=True' if a.startswith('--on_cuda') else a for a in reference_args]
  else:
    _cpu_only(torch)
  _redirect_data_root(ours.data_root)
  sys.path.insert(0, ours.ref_dir)
  sys.argv = [os.path.join(ours.ref_dir, 'main.py'), *reference_args]

  record = {
    'validations': [],
    'fusion_curve': [],
    'synthetic': [],
    'client_accuracy': {},
    'client_archs': {},
    'local_models_cached': False,
    'local_training_seconds': 0.0,
    'args': reference_args,
    'shim': vars(shim),
  }
  start = time.time()

  def write_result():
    record['seconds'] = time.time() - start
    with open(ours.result, 'w') as f:
      json.dump(record, f)

  atexit.register(write_result)

  import main as ref_main  # pylint: disable=g-import-not-at-top
  import parameters  # pylint: disable=g-import-not-at-top
  import pcode.aggregation.semi_supervised as semi  # pylint: disable=g-import-not-at-top
  import pcode.datasets.partition_data as partition_data  # pylint: disable=g-import-not-at-top
  import pcode.master_lmf as master_lmf  # pylint: disable=g-import-not-at-top
  import pcode.master_utils as master_utils  # pylint: disable=g-import-not-at-top
  import pcode.utils.data_clean as data_clean  # pylint: disable=g-import-not-at-top
  from pcode.utils.tensor_buffer import TensorBuffer  # pylint: disable=g-import-not-at-top
  import pcode.worker_lmf as worker_lmf  # pylint: disable=g-import-not-at-top

  conf0 = parameters.get_args()
  if conf0.n_comm_rounds != 1:
    raise SystemExit('the shim runs one communication round (FedMHO is one-shot)')
  if 'semi_supervised' not in conf0.fl_aggregate:
    raise SystemExit('the shim runs fl_aggregate scheme=semi_supervised (FedMHO) only')

  # --- the world: workers run when the master waits for their models -----------------------
  def run_worker(rank):
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    begin = time.time()
    world.rank = rank
    try:
      ref_main.main(parameters.get_args())
    finally:
      world.rank = 0
      torch.set_rng_state(states[0])
      np.random.set_state(states[1])
      random.setstate(states[2])
      if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
      record['local_training_seconds'] += time.time() - begin

  world = _World(run_worker)
  world.world_size = int(conf0.n_clients * conf0.participation_ratio) + 1
  world.install(dist)

  # --- the partition: jfed's index lists ---------------------------------------------------
  with open(ours.partition) as f:
    parts = [[int(i) for i in p] for p in json.load(f)]
  original_partition = partition_data.DataPartitioner.partition_indices

  def partition_indices(self, indices):
    if self.partition_type != conf0.partition_data:
      return original_partition(self, indices)
    if len(self.partition_sizes) != len(parts):
      raise SystemExit(
        f'--n_clients={len(self.partition_sizes)} but the partition file has {len(parts)} clients'
      )
    self.partitions = [list(p) for p in parts]
    if self.conf.graph.rank == 0:
      partition_data.shared_targets_of_partitions = partition_data.record_class_distribution(
        self.partitions, self.data.targets, print_fn=self.conf.logger.log
      ).items()
    return None

  partition_data.DataPartitioner.partition_indices = partition_indices

  # --- records -----------------------------------------------------------------------------
  original_validate = master_utils.validate

  def validate(conf, coordinator, model, criterion, metrics, data_loader, *args, **kwargs):
    perf = original_validate(conf, coordinator, model, criterion, metrics, data_loader, *args,
                             **kwargs)  # fmt: skip
    if world.rank == 0 and perf is not None:
      label = kwargs.get('label', args[0] if args else 'test_loader')
      record['validations'].append({'label': label, 'top1': float(perf['top1'])})
    return perf

  master_utils.validate = validate

  original_clean = data_clean.data_clean

  def clean(dataset, device, from_pretrain_model=False, category=0, threshold=0.8):
    kept = original_clean(dataset, device, from_pretrain_model, category, threshold)
    record['synthetic'].append(
      {'class': int(category), 'generated': len(dataset), 'kept': len(kept)}
    )
    return kept

  semi.data_clean = clean
  data_clean.visualize_and_save_images = lambda *args, **kwargs: None

  builtin_range = builtins.range
  hooked = []

  def server_epochs(model, loader, n):
    for epoch in builtin_range(n):
      yield epoch
      record['fusion_curve'].append(_accuracy(torch, model, loader))

  def patched_range(*args):
    frame = sys._getframe(1)  # pylint: disable=protected-access
    if frame.f_code is semi.aggregate.__code__ and len(args) == 1:
      local = frame.f_locals
      if 'train_dataloader' in local and args[0] == local.get('epochs'):
        hooked.append(args[0])
        record['server_epochs_reference'] = int(args[0])
        n = shim.shim_server_epochs or args[0]
        record['server_epochs'] = int(n)
        return server_epochs(local['resnet_model'], local['test_data_loader'], n)
    return builtin_range(*args)

  semi.range = patched_range

  # --- the CVAE clients' learning rate (hard-coded in Worker._train) ------------------------
  adam = torch.optim.Adam
  worker_train = worker_lmf.Worker._train.__code__

  class Adam(adam):
    def __init__(self, params, lr=1e-3, *args, **kwargs):
      frame = sys._getframe(1)  # pylint: disable=protected-access
      if shim.shim_cvae_lr and frame.f_code is worker_train:
        if 'vae' in frame.f_locals['self'].arch:
          record['cvae_lr'] = {'reference': lr, 'run': shim.shim_cvae_lr}
          lr = shim.shim_cvae_lr
      super().__init__(params, lr, *args, **kwargs)

  torch.optim.Adam = Adam

  # --- the local models: trained by the workers, or read back ------------------------------
  original_receive = master_lmf.Master._receive_models_from_selected_clients
  key = _cache_key(reference_args, shim.shim_cvae_lr, ours.partition)
  cache = shim.shim_local_models

  def evaluate_clients(self, flatten_local_models):
    for client_id, tb in flatten_local_models.items():
      arch = self.clientid2arch[client_id]
      record['client_archs'][str(client_id)] = arch
      if 'vae' in arch:
        continue
      model = copy.deepcopy(self.client_models[arch])
      state = model.state_dict()
      tb.unpack(state.values())
      model.load_state_dict(state)
      record['client_accuracy'][str(client_id)] = _accuracy(torch, model, self.test_loaders[0])
      del model

  def receive(self, selected_client_ids):
    stored = None
    if cache and os.path.isfile(cache):
      stored = torch.load(cache, weights_only=False)
      if stored.get('key') != key:
        print(f'shim: {cache} holds other local models; training the workers', flush=True)
        stored = None
    if stored is not None:
      out = {}
      for client_id in selected_client_ids:
        arch = self.clientid2arch[client_id]
        tb = TensorBuffer(list(self.client_models[arch].state_dict().values()))
        tb.buffer = stored['buffers'][client_id].to(tb.buffer.device).clone()
        out[client_id] = tb
      record['local_models_cached'] = True
      record['local_training_seconds'] = stored['local_training_seconds']
      record['client_accuracy'] = stored['client_accuracy']
      record['client_archs'] = stored['client_archs']
      print(f'shim: local models read from {cache}', flush=True)
      return out
    out = original_receive(self, selected_client_ids)
    if eval_clients:
      evaluate_clients(self, out)
    if cache:
      tmp = cache + '.tmp'
      torch.save(
        {
          'key': key,
          'buffers': {c: tb.buffer.cpu() for c, tb in out.items()},
          'local_training_seconds': record['local_training_seconds'],
          'client_accuracy': record['client_accuracy'],
          'client_archs': record['client_archs'],
        },
        tmp,
      )
      os.replace(tmp, cache)
    return out

  master_lmf.Master._receive_models_from_selected_clients = receive

  ref_main.main(conf0)
  if not hooked:
    raise SystemExit('the server epoch loop of semi_supervised.aggregate was not found')


if __name__ == '__main__':
  main()
