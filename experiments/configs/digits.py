"""scikit-learn digits (embedded, no download): the README's main job.

Command (the README's):
  python -m experiments.main --method=fedavg --config=experiments/configs/digits.py \
      --workdir=runs/digits_fedavg
Expected: FedAvg, 5 clients, Dir(0.5), DENSE CNNMnist, 20 rounds x 2 local epochs.
Measured (CPU, 2 cores): 97.78% test accuracy in 42 s wall (36 s in the runner).
Variants: `digits.py:smoke` (seconds, used by the tests), `digits.py:iid`.
Other methods: --method=centralized | fedprox | local (each reads its own sub-config).
"""
from experiments.configs.common import base_config


def get_config(arg: str = ''):
  c = base_config()
  c.dataset.name = 'digits'
  c.model = 'cnn_mnist'
  c.batch_size = 32
  c.fedavg.rounds, c.fedavg.local_epochs = 20, 2
  c.fedprox.rounds, c.fedprox.local_epochs, c.fedprox.mu = 20, 2, 0.01
  c.centralized.epochs = 20
  c.local.epochs = 20
  if 'iid' in arg.split(','):
    c.partition.scheme = 'iid'
  if 'smoke' in arg.split(','):
    c.fedavg.rounds = c.fedprox.rounds = 2
    c.fedavg.local_epochs = c.fedprox.local_epochs = 1
    c.centralized.epochs = c.local.epochs = 2
  return c
