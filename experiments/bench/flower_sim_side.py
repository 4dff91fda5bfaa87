"""Flower's side of `experiments/bench/cross_device.py`: FedAvg in Flower's simulation engine.

Runs in its own virtual environment (flwr[simulation] with Ray, and PyTorch), not jfed's, so it
imports nothing of jfed: `cross_device.py` writes the data and the client index lists as .npy
files into a directory and runs

    FLSIM/bin/python experiments/bench/flower_sim_side.py --data=DIR --clients=N --cohort=C \
        --rounds=R [--batch=32 --lr=0.01 --momentum=0.9 --cpus=2 --seed=0]

It prints one JSON line: the seconds of each round (from one end of the server's evaluation of
the global model to the next, as jfed's rounds end with theirs), the evaluation accuracy, the
parameter count and the versions. The ServerApp is Flower's message-API `FedAvg` strategy
(`fraction_train` = C / N, no federated evaluation; centralised evaluation on DIR's eval
arrays through `evaluate_fn`), the ClientApp trains DENSE's CNNMnist in PyTorch: a fresh SGD
each round, one epoch over the client's shuffled samples in batches of `batch` (the last one
partial), plain cross entropy. Ray runs one actor per CPU (`client_resources.num_cpus = 1`),
each with one PyTorch thread.
"""

import argparse
import importlib
import json
import os
import random
import resource
import sys
import time

import numpy as np
import torch
from torch import nn


class CNNMnist(nn.Module):
  """DENSE's CNNMnist, as jfed's `cnn_mnist`: 29,034 parameters for 28 x 28 x 1 and 10 classes."""

  def __init__(self, num_classes: int = 10):
    super().__init__()
    self.features = nn.Sequential(
      nn.Conv2d(1, 16, 5, padding=2),
      nn.BatchNorm2d(16),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Conv2d(16, 32, 5, padding=2),
      nn.BatchNorm2d(32),
      nn.ReLU(),
      nn.MaxPool2d(2),
    )
    self.fc = nn.Linear(7 * 7 * 32, num_classes)

  def forward(self, x):
    return self.fc(torch.flatten(self.features(x), 1))


def num_params(model: nn.Module) -> int:
  return sum(p.numel() for p in model.parameters())


_DATA = {}


def load_data(directory: str) -> dict:
  """DIR's arrays, memory-mapped, once per process (each Ray actor loads its own view)."""
  if directory not in _DATA:
    _DATA[directory] = {
      name: np.load(os.path.join(directory, f'{name}.npy'), mmap_mode='r')
      for name in ('train_x', 'train_y', 'eval_x', 'eval_y', 'parts_flat', 'parts_offsets')
    }
  return _DATA[directory]


def client_indices(data: dict, partition: int) -> np.ndarray:
  start, stop = data['parts_offsets'][partition], data['parts_offsets'][partition + 1]
  return np.asarray(data['parts_flat'][start:stop])


def to_nchw(x: np.ndarray) -> torch.Tensor:
  # a copy: a memory-mapped slice is read-only, which torch warns about
  return torch.from_numpy(np.array(np.asarray(x).transpose(0, 3, 1, 2), order='C'))


def local_train(
  model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, lr: float, momentum: float
) -> None:
  """One epoch of SGD over (x, y), shuffled, the last batch partial."""
  model.train()
  opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
  order = torch.randperm(len(x))
  for start in range(0, len(x), batch):
    i = order[start : start + batch]
    opt.zero_grad()
    nn.functional.cross_entropy(model(x[i]), y[i]).backward()
    opt.step()


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 1000) -> float:
  model.eval()
  correct = 0
  with torch.no_grad():
    for s in range(0, len(x), batch):
      logits = model(to_nchw(x[s : s + batch]))
      correct += int((logits.argmax(1).numpy() == np.asarray(y[s : s + batch])).sum())
  return correct / max(1, len(x))


def client_train(msg, context):
  """The ClientApp's train: the global model, one local epoch on this node's partition."""
  # pylint: disable=g-import-not-at-top
  from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

  torch.set_num_threads(1)
  config = msg.content['config']
  data = load_data(str(config['data']))
  # sorted: a memory-mapped read in file order (local_train shuffles)
  idx = np.sort(client_indices(data, int(context.node_config['partition-id'])))
  x = to_nchw(data['train_x'][idx])
  y = torch.from_numpy(np.asarray(data['train_y'][idx]).astype(np.int64))
  model = CNNMnist()
  model.load_state_dict(msg.content['arrays'].to_torch_state_dict())
  local_train(model, x, y, int(config['batch']), float(config['lr']), float(config['momentum']))
  content = RecordDict(
    {'arrays': ArrayRecord(model.state_dict()), 'metrics': MetricRecord({'num-examples': len(idx)})}
  )
  return Message(content=content, reply_to=msg)


def build_apps(args):
  """The ClientApp and ServerApp of one benchmark run, and the server's (round, time, accuracy)
  marks.

  Call it on this file imported as the module `flower_sim_side`, not as `__main__` (see `main`).
  """
  # pylint: disable=g-import-not-at-top  # flwr and Ray only where the apps are built
  from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
  from flwr.clientapp import ClientApp
  from flwr.serverapp import Grid, ServerApp
  from flwr.serverapp.strategy import FedAvg

  client_app = ClientApp()
  client_app.train()(client_train)

  server_app = ServerApp()
  marks = []

  @server_app.main()
  def main(grid: Grid, context: Context) -> None:
    del context
    # `sample_nodes` draws the cohort with Python's `random`.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = CNNMnist()
    data = load_data(args.data)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
      model.load_state_dict(arrays.to_torch_state_dict())
      acc = accuracy(model, data['eval_x'], data['eval_y'])
      marks.append((server_round, time.perf_counter(), acc))
      return MetricRecord({'accuracy': acc})

    strategy = FedAvg(
      fraction_train=args.cohort / args.clients,
      fraction_evaluate=0.0,
      min_train_nodes=args.cohort,
      min_available_nodes=args.clients,
    )
    config = ConfigRecord(
      {'data': args.data, 'batch': args.batch, 'lr': args.lr, 'momentum': args.momentum}
    )
    strategy.start(
      grid=grid,
      initial_arrays=ArrayRecord(model.state_dict()),
      num_rounds=args.rounds,
      train_config=config,
      evaluate_fn=evaluate,
    )

  return client_app, server_app, marks


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data', required=True)
  parser.add_argument('--clients', type=int, required=True)
  parser.add_argument('--cohort', type=int, required=True)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--lr', type=float, default=0.01)
  parser.add_argument('--momentum', type=float, default=0.9)
  parser.add_argument('--cpus', type=int, default=os.cpu_count() or 1)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  args.data = os.path.abspath(args.data)
  # Before flwr and Ray are imported: no telemetry calls from a machine that may have no
  # network, and one OpenMP thread in each Ray actor (which inherit this environment and get
  # one CPU each).
  os.environ.setdefault('FLWR_TELEMETRY_ENABLED', '0')
  os.environ.setdefault('OMP_NUM_THREADS', '1')

  import flwr  # pylint: disable=g-import-not-at-top
  from flwr.simulation import run_simulation  # pylint: disable=g-import-not-at-top
  import ray  # pylint: disable=g-import-not-at-top

  # Ray pickles the ClientApp with every message it sends to an actor. Taken from a module the
  # actors can import (as `flwr run` loads an app), its functions go by reference; defined in
  # __main__ they would go by value with every global they reach, the data cache included: the
  # whole training set with each message (measured: 0.5 s a client, 10 GB of object store).
  here = os.path.dirname(os.path.abspath(__file__))
  os.environ['PYTHONPATH'] = os.pathsep.join(filter(None, [here, os.environ.get('PYTHONPATH')]))
  side = importlib.import_module('flower_sim_side')
  client_app, server_app, marks = side.build_apps(args)
  side.load_data(args.data)  # what Ray pickles once the server has loaded its evaluation data
  pickled_app_bytes = len(ray.cloudpickle.dumps(client_app))
  start = time.perf_counter()
  run_simulation(
    server_app=server_app,
    client_app=client_app,
    num_supernodes=args.clients,
    backend_name='ray',
    backend_config={
      'client_resources': {'num_cpus': 1, 'num_gpus': 0.0},
      'init_args': {'num_cpus': args.cpus, 'num_gpus': 0, 'logging_level': 'ERROR'},
    },
  )
  wall = time.perf_counter() - start
  if len(marks) != args.rounds + 1:
    sys.exit(f'error: {len(marks) - 1} of {args.rounds} rounds ran (see the log above)')
  times = [marks[r][1] - marks[r - 1][1] for r in range(1, len(marks))]
  print(
    json.dumps(
      {
        'round_seconds': times,
        'setup_s': marks[0][1] - start,
        'wall_s': wall,
        'accuracy': marks[-1][2],
        'num_params': num_params(CNNMnist()),
        'actors': args.cpus,
        'pickled_client_app_bytes': pickled_app_bytes,
        'own_maxrss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        'children_maxrss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        'versions': {'flwr': flwr.__version__, 'ray': ray.__version__, 'torch': torch.__version__},
      }
    ),
    flush=True,
  )


if __name__ == '__main__':
  main()
