"""FedCVAE-Ens (Heinbaugh et al., ICLR 2023), `github.com/ceh-2000/fed_cvae`, `main.py`.

One stage, `ens`: `main.py --algorithm=fedcvaeens`. Every user trains its own CVAE (version 0,
z_dim `z_dim`, Adam `local_lr`, batch 32, `local_epochs` epochs); the server decodes
`classifier_samples` images from the users' decoders (n_u = int(data_amt_u · N), the last user
the remainder; y ~ the user's label pmf; z ~ a standard normal truncated to ±`z_bound`, the
code's `uniform_range`) and trains its classifier from its random init for `classifier_epochs`
epochs (Adam 1e-3, batch 32). The code tests the server classifier before the users train and
once at the end (`Server.test`); the shim also tests it after every classifier epoch (with the
torch RNG restored, so the run is the unpatched one), which gives the best epoch.

The authors' Fashion-MNIST settings (`experiments/best_hyperparameters/fashion/onefedvae.txt`):
local_epochs 25, local_LR 1e-3, z_dim 10, beta 1, classifier_num_train_samples 5000,
classifier_epochs 5, uniform_range (−3, 3), sample_ratio 0.5, 10 users; DEFAULT_BUDGET is those.
The users hold jfed's index lists of the full training split (the harness draws the partition
with no `sample_ratio`: `--scheme=fedcvae_dirichlet` is the code's `split_data_dirichlet` at
sample_ratio 1, and `--alpha` is its `--alpha`), so the reference runs with `--sample_ratio=1`.
The code's clients train CVAEs only: there is no per-client accuracy to report.
"""

from typing import Any, Dict, Mapping

from experiments.parity.references import SHIMS, Budget, ParityMethod, Reference

DEFAULT_BUDGET: Budget = {
  'local_epochs': 25,  # the users' CVAE epochs (`--local_epochs`)
  'local_lr': 1e-3,  # their Adam lr (`--local_LR`)
  'z_dim': 10,
  'classifier_samples': 5000,  # `--classifier_num_train_samples`
  'classifier_epochs': 5,
  'z_bound': 3.0,  # `--uniform_range=(-z_bound,z_bound)`
}

# What the code fixes and jfed is told: batch 32 (users' and server's DataLoaders), the server
# classifier's Adam lr (`servers/server_fed_cvae_kd.py`), beta (jfed's FedCVAE fixes it at 1).
BATCH = 32
SERVER_LR = 1e-3
BETA = 1.0
# fed_cvae's `models/classifier.py:Classifier` (Conv5×5 32, MaxPool2, Conv5×5 64, MaxPool2,
# Linear 1600→512, ReLU, Linear; no nonlinearity after the convs): jfed's `fedcvae_classifier`.
SERVER_MODEL = 'fedcvae_classifier'
# The code resizes every split to 32×32 (`data.py:64,93`, `Resize(32)` on the tensors): the
# classifier trains on 32×32 decoded images and is tested at 32×32.
IMAGE_SIZE = 32
# the shim's phases of the code's server tests: before the users train, after each classifier
# epoch (the shim's), at the end (`Server.test`)
PHASES = ('init', 'epoch', 'final')


def stage_args(stage: str, names: Mapping[str, str], b: Budget, seed: int, clients: int):
  del stage
  z = float(b['z_bound'])
  return [
    '--algorithm=fedcvaeens',
    f'--dataset={names["dataset"]}',
    f'--num_users={clients}',
    '--sample_ratio=1',
    f'--seed={seed}',
    f'--data_seed={seed}',
    '--use_adam=1',
    f'--local_epochs={b["local_epochs"]}',
    f'--local_LR={b["local_lr"]}',
    f'--z_dim={b["z_dim"]}',
    f'--beta={BETA}',
    f'--classifier_num_train_samples={b["classifier_samples"]}',
    f'--classifier_epochs={b["classifier_epochs"]}',
    f'--uniform_range=({-z},{z})',
    '--should_weight_exp=1',
    '--should_initialize_same_exp=0',
    # the shim's SummaryWriter stub records the code's test accuracies (nothing is written)
    '--should_log=1',
    '--cur_run_name=parity',
  ]


def read(stage: str, recorded: Mapping[str, Any], clients: int, b: Budget) -> Dict[str, Any]:
  """What the shim recorded: the code's `Global Accuracy/test` scalars, by phase."""
  del stage
  tests = [t for t in recorded['scalars'] if t['tag'] == 'Global Accuracy/test']
  by_phase = {p: [float(t['value']) for t in tests if t['phase'] == p] for p in PHASES}
  e = int(b['classifier_epochs'])
  if len(by_phase['init']) != 1 or len(by_phase['epoch']) != e or len(by_phase['final']) != 1:
    counts = {p: len(v) for p, v in by_phase.items()}
    raise ValueError(f'FedCVAE-Ens recorded tests {counts}, expected init 1, epoch {e}, final 1')
  curve = by_phase['epoch']
  final = by_phase['final'][0]
  if abs(final - curve[-1]) > 1e-6:
    raise ValueError(f'the final test ({final}) is not the last epoch test ({curve[-1]})')
  users = recorded.get('users', [])
  if len(users) != clients:
    raise ValueError(f'FedCVAE-Ens recorded {len(users)} users, expected {clients}')
  return {
    'rows': {'FedCVAE-Ens final': final, 'FedCVAE-Ens best': max(curve)},
    'curve': curve,
    'initial_accuracy': by_phase['init'][0],
    'users': users,
  }


def _ens(b: Budget) -> Dict[str, Any]:
  return {
    'model': SERVER_MODEL,
    'dataset.image_size': IMAGE_SIZE,
    'client_models': f'cvae:size=v0,latent={int(b["z_dim"])}',
    'batch_size': BATCH,
    'fedcvae.protocol': 'fed_cvae',
    'fedcvae.cvae_epochs': b['local_epochs'],
    'fedcvae.cvae_optimizer': 'adam',
    'fedcvae.cvae_lr': b['local_lr'],
    'fedcvae.cvae_batch': BATCH,
    'fedcvae.cvae_recon': 'bce',
    'fedcvae.num_synthetic': b['classifier_samples'],
    'fedcvae.z_bound': b['z_bound'],
    'fedcvae.weight_by_share': True,
    'fedcvae.same_init': False,  # every user its own CVAE (`--should_initialize_same_exp=0`)
    'fedcvae.server_model': SERVER_MODEL,
    'fedcvae.epochs': b['classifier_epochs'],
    'fedcvae.lr': SERVER_LR,
    'fedcvae.batch': BATCH,
  }


REFERENCE = Reference(
  name='fedcvae',
  repository='ceh-2000/fed_cvae',
  marker='servers/server_fed_cvae_ens.py',
  shim=SHIMS / 'fedcvae_shim.py',
  datasets={'fashion_mnist': {'dataset': 'fashion'}},
  torchvision_folder={'fashion_mnist': 'FashionMNIST'},
  default_budget=DEFAULT_BUDGET,
  stage_args=stage_args,
  read=read,
  methods={
    'fedcvae_ens': ParityMethod(
      ('ens',), ('fedcvae_ens',), {'fedcvae_ens': 'FedCVAE-Ens'}, _ens, jfed_local=False
    ),
  },
)
