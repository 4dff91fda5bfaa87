"""FedAvg under attack (issue 10): the base config of `experiments.robustness`.

Command (every aggregator x attack x attacker fraction, 3 seeds, then the table and plot):
  python -m experiments.robustness --config=experiments/configs/robustness.py:dataset=digits \
      --out=runs/robustness_digits
  python -m experiments.robustness \
      --config=experiments/configs/robustness.py:dataset=fashion_mnist \
      --out=runs/robustness_fashion_mnist
The command sets `aggregation`, `attack` and `seed` per run; this file fixes the rest.

  dataset=digits  scikit-learn digits (embedded), 10 clients, Dir(0.5), MLP, 20 rounds x 2 local
                  epochs, batch 32, SGD 0.05 momentum 0.9 (the default job).
  dataset=fashion_mnist
                  Fashion-MNIST (the Debian package), 10 clients, Dir(0.5), MLP, 3 rounds x 1
                  local epoch, batch 64, SGD 0.05 momentum 0.9.
  smoke           2 rounds (tests).

Robust rules' settings, fixed as a server that does not know the attack would fix them:
trimmed mean β = 0.2 per side and Krum f = 2 (a bound of 20% attackers among 10 clients).
`CLIP_NORM` is the update norm of the command's 'clipped_mean' row (the config itself does not
clip): about the median honest update norm of a clean round, measured (digits 0.4-2.1 over
rounds 1-3, Fashion-MNIST 2.1-5.8).
Expected results and times: docs/robustness.md, "Robust aggregation, attacks, server optimisers,
TensorBoard (issue 10)"; tables in docs/results/robustness_*.md.
"""

from jfed.configs.base import base_config, variant_value, variant_words
from jfed.errors import ConfigError

VARIANTS = ('dataset=', 'smoke')
DATASETS = ('digits', 'fashion_mnist')
CLIP_NORM = {'digits': 1.0, 'fashion_mnist': 3.0}


def get_config(arg: str = ''):
  words = variant_words(arg, VARIANTS)
  datasets = [variant_value(w, str) for w in words if w.startswith('dataset=')] or ['digits']
  if len(datasets) > 1 or datasets[0] not in DATASETS:
    raise ConfigError(f'robustness.py: dataset= takes one of {", ".join(DATASETS)}, got {datasets}')
  c = base_config()
  c.dataset.name = datasets[0]
  c.partition.scheme = 'dirichlet'
  c.partition.num_clients = 10
  c.partition.alpha = 0.5
  c.model = 'mlp'
  c.optimizer.lr = 0.05
  c.fedavg.local_epochs = 1
  if c.dataset.name == 'digits':
    c.batch_size = 32
    c.fedavg.rounds, c.fedavg.local_epochs = 20, 2
  else:
    c.batch_size = 64
    c.fedavg.rounds = 3  # 234 runs of 3 seeds in about an hour on 2 CPU cores
  c.aggregation.trim_fraction = 0.2
  c.aggregation.krum_byzantine = 2
  if 'smoke' in words:
    c.fedavg.rounds = 2
  return c
