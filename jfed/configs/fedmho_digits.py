"""FedMHO, its variants and its baselines on the embedded scikit-learn digits (8×8, no download).

Commands (the client set is a variant word, because the methods of FedMHO's Table 1 give
clients different models):
  python -m experiments.main --method=fedmho_md --config=experiments/configs/fedmho_digits.py \
      --workdir=runs/digits_fedmho_md               # also fedmho, fedmho_sd
  python -m experiments.main --method=fedcvae_ens \
      --config=experiments/configs/fedmho_digits.py:fedcvae --workdir=runs/digits_fedcvae
  python -m experiments.main --method=fedcvae_kd \
      --config=experiments/configs/fedmho_digits.py:fedcvae_kd --workdir=runs/digits_fedcvae_kd
  python -m experiments.main --method=fedavg_vote|dense|coboosting|feddf \
      --config=experiments/configs/fedmho_digits.py:baselines --workdir=runs/digits_<method>
  FedMHO-MD/-SD reuse FedMHO's clients: --config.local_models_dir=runs/digits_fedmho_md/local_models
      --config.local_cvaes_dir=runs/digits_fedmho_md/local_cvaes

Default: 10 clients, FedDF's Dirichlet(0.5) partition (FedMHO §5.1.1), 5 VGG-9 clients at
width 1/4 with 128-wide FC layers (8×8 inputs) and 5 CVAE-small clients (Table 1). CPU budget:
the classifiers train 30 epochs with Adam 1e-3 (Table 7's SGD 5e-3 for 200 epochs does not move
a VGG-9 without BatchNorm in 30 epochs of ~140 samples; the paper's own Adam setting of A.3.6 is
5e-4), batch 32; CVAEs 30 epochs of Adam 1e-3; N_syn = 2,000, R_th = 0.8; 10 global epochs of
Adam 1e-3, λ = 0.5. FedCVAE-Ens runs as FedMHO's reference runs its FEDCVAE row
(`fedcvae.protocol='fedmho'`: FedMHO's generation, filter and server settings).
Measured (seed 0, jax 0.10.2, CPU, 2 cores): see docs/fedmho.md "FedMHO and FedCVAE".

The `plateau` budget (issue 36): the default's 30 local epochs leave the classifier clients far
below what they reach alone, so the one-shot methods are compared on weak teachers. Client test
accuracy vs local epochs (seed 0, α = 0.5, the `local` method on the baselines' client set, whose
VGG-9 clients hold FedMHO's VGG-9 clients' data; mean over the 5 clients of each model, %):
  epochs      10    30    60    100   150   200   300
  VGG-9       10.1  32.8  48.9  54.9  58.1  59.7  61.9
  small CNN   13.2  27.1  27.5  29.4  31.4  31.4  33.3
  python -m experiments.client_curve --config=experiments/configs/fedmho_digits.py:baselines \
      --epochs=10,30,60,100,150,200,300 --seeds=0 --out=runs/fedmho_client_curve
At 200 epochs (the paper's) both are within 3 points of the best measured (the VGG-9 still gains
about 2 points per 100 epochs; the small CNN, whose reference ends in a softmax before the cross
entropy, stays near 30 %). The CVAEs' 40 epochs are the paper's; at the default's 30, 88.2 % of
FedMHO-MD's kept samples are labelled as their class by a real-data classifier
(docs/results/generator_check_fedmho_digits.md), and the table command repeats that check per run.
  python -m experiments.fedmho_tables --config=experiments/configs/fedmho_digits.py \
      --budget=plateau --seeds=0,1,2 --alphas=0.5,0.1 --reference_model=mlp \
      --reference_epochs=10 --out=runs/fedmho_tables_digits_plateau
  measured: docs/results/fedmho_tables_digits_plateau/ and docs/fedmho.md.

Variants (comma-separated):
  fedcvae    every client a CVAE, CVAE-large and CVAE-small alternating (Table 1's FEDCVAE)
  fedcvae_kd as fedcvae with CVAE-small at latent 20, the CVAE-large's (FedCVAE-KD's server
             decoder, FedCVAE's v0 at latent 20, is fed every user's latents)
  fedcvae_v0 every client FedCVAE's own CVAE (v0, 32×32 with BatchNorm, latent 10 as the
             reference's MNIST/Fashion-MNIST setting), each from its own init, a v0 server
             decoder for fedcvae_kd, and ceh-2000/fed_cvae's server (`fedcvae.protocol=
             'fed_cvae'`) and classifier (`fedcvae_classifier`, on the 8×8 digits)
  baselines  VGG-9 and FedMHO's small CNN alternating (Table 1's FedAvg/FedDF/DENSE/Co-Boosting);
             the DENSE / Co-Boosting / FedDF server model is the VGG-9
  plateau    issue 36's mechanism budget: every classifier client (FedMHO's VGG-9, the baselines'
             VGG-9 and small CNN, `local`) 200 local epochs and every CVAE client 40, the
             paper's numbers (Table 7), with the default's Adam 1e-3 for all; DENSE's and
             Co-Boosting's VGG-9 students 60 epochs of Adam 1e-3 (default: 20 of SGD); the
             other servers unchanged
  smoke      seconds-long budgets (MLP classifiers, 1–2 epochs, 200 samples): the driver's
             resume tests; accuracy meaningless
  dir=A      Dirichlet α (default 0.5)
"""

from jfed.configs.base import base_config, variant_value, variant_words

VARIANTS = ('fedcvae', 'fedcvae_kd', 'fedcvae_v0', 'baselines', 'plateau', 'smoke', 'dir=')
# 'plateau': the local epochs of every classifier client (FedMHO's, the baselines', `local`'s)
# and of every CVAE client; the paper's 200 and 40 (FedMHO Table 7), with the default's Adam.
PLATEAU_LOCAL_EPOCHS = 200
PLATEAU_CVAE_EPOCHS = 40
PLATEAU_KD_EPOCHS = 60  # DENSE's and Co-Boosting's server epochs (the paper: 200)
# Issue 36's precondition evidence behind a budget word, printed in experiments.fedmho_tables'
# header (measured with the commands of the docstring, seed 0, α = 0.5, CPU).
EVIDENCE = {
  'plateau': (
    '- local classifier clients vs local epochs (`experiments.client_curve`, `local` method, '
    'Adam 1e-3, batch 32, seed 0, α = 0.5; mean client test accuracy % (lowest–highest client)): '
    'VGG-9 10: 10.1, 30: 32.8, 60: 48.9, 100: 54.9, 150: 58.1, 200: 59.7 (47.2–70.6), '
    '300: 61.9 (52.5–69.4); small CNN 10: 13.2, 30: 27.1, 60: 27.5, 100: 29.4, 150: 31.4, '
    '200: 31.4 (20.0–39.2), 300: 33.3 (20.0–48.9). At 200 epochs both are within 3 points of '
    'the best measured (VGG-9 2.2 below its 300-epoch mean, still rising about 2 points per 100 '
    'epochs; the default 30 epochs: 29 points below).',
    "- DENSE's and Co-Boosting's VGG-9 students (seed 0, α = 0.5): 10.00 % after 20 epochs of "
    "the references' SGD (5e-3 / 1e-2); with Adam 1e-3 DENSE leaves chance at epoch 14 (18.6 % "
    'at 20), hence 60 epochs of Adam 1e-3. Compare their rows with the teacher ensemble row.',
  ),
}
VGG = 'vgg9:width_mult=0.25,fc_width=128'
FEDMHO_CLIENTS = f'{VGG};cvae:size=small'
FEDCVAE_CLIENTS = 'cvae:size=large;cvae:size=small'
FEDCVAE_KD_CLIENTS = 'cvae:size=large;cvae:size=small,latent=20'
FEDCVAE_V0 = 'cvae:size=v0,latent=10'
BASELINE_CLIENTS = f'{VGG};fedmho_cnn'


def get_config(arg: str = ''):
  args = variant_words(arg, VARIANTS)
  c = base_config()
  c.dataset.name = 'digits'
  c.partition.update({'scheme': 'feddf_dirichlet', 'num_clients': 10, 'alpha': 0.5})
  c.model = VGG
  c.client_models = FEDMHO_CLIENTS
  c.optimizer.update({'name': 'adam', 'lr': 1e-3, 'momentum': 0.0})
  c.batch_size = 32
  c.fedmho.update(
    {
      'local_epochs': 30,
      'cvae_epochs': 30,
      'cvae_lr': 1e-3,
      'cvae_batch': 32,
      'num_synthetic': 2000,
      'epochs': 10,
      'lr': 1e-3,
      'batch': 32,
    }
  )
  m = c.fedmho
  c.fedcvae.update(
    {
      'protocol': 'fedmho',  # FedMHO's FEDCVAE row: its generation, filter and server
      'same_init': True,  # and its one initial CVAE per architecture
      'cvae_epochs': m.cvae_epochs,
      'cvae_batch': m.cvae_batch,
      'num_synthetic': m.num_synthetic,
      'clean_rate': m.clean_rate,
      'epochs': m.epochs,
      'lr': m.lr,
      'batch': m.batch,
      'decoder_samples': 2000,
      'decoder_epochs': 7,
    }
  )
  c.fedavg_vote.local_epochs = 30
  for m in ('dense', 'coboosting', 'feddf'):
    c[m].local_epochs = 30
    c[m].server_model = VGG
  for m in ('dense', 'coboosting'):
    c[m].update(
      {'epochs': 20, 'g_steps': 10, 'synthesis_batch': 32, 'nz': 32, 'ngf': 16, 'kd_batch': 32}
    )
  # FedDF's 90 distillation and 60 validation images: training images no client holds (the
  # test split is for scoring only); every method of the table loses the same 150.
  c.dataset.holdout_size = 150
  c.feddf.update(
    {
      'source_size': 90,
      'val_size': 60,
      'total_steps': 200,
      'eval_every': 20,
      'patience': 100,
      'kd_batch': 32,
    }
  )
  if 'fedcvae' in args:
    c.client_models = FEDCVAE_CLIENTS
  if 'fedcvae_kd' in args:
    c.client_models = FEDCVAE_KD_CLIENTS
  if 'fedcvae_v0' in args:
    c.client_models = FEDCVAE_V0
    c.fedcvae.server_decoder = FEDCVAE_V0
    # ceh-2000/fed_cvae's server, its classifier, and every user's CVAE from its own init (the
    # images stay 8×8: the reference resizes to 32×32, dataset.image_size, a run-level key)
    c.fedcvae.update(
      {'protocol': 'fed_cvae', 'server_model': 'fedcvae_classifier', 'same_init': False}
    )
  if 'baselines' in args:
    c.client_models = BASELINE_CLIENTS
  for a in args:
    if a.startswith('dir='):
      c.partition.alpha = variant_value(a, float)
  if 'plateau' in args:
    c.fedmho.update({'local_epochs': PLATEAU_LOCAL_EPOCHS, 'cvae_epochs': PLATEAU_CVAE_EPOCHS})
    c.fedcvae.cvae_epochs = PLATEAU_CVAE_EPOCHS
    c.fedavg_vote.local_epochs = PLATEAU_LOCAL_EPOCHS
    c.local.epochs = PLATEAU_LOCAL_EPOCHS
    for m in ('dense', 'coboosting', 'feddf'):
      c[m].local_epochs = PLATEAU_LOCAL_EPOCHS
    # The VGG-9 student (no BatchNorm) stays at chance under the references' SGD here (DENSE
    # and Co-Boosting 10.00 % at 20 epochs, seed 0, α = 0.5); Adam 1e-3 moves it, as in
    # fedmho_fashion_mnist.py's CPU budget, and 60 epochs give it 3x the default's KD steps.
    for m in ('dense', 'coboosting'):
      c[m].update({'epochs': PLATEAU_KD_EPOCHS, 'kd_optimizer': 'adam', 'kd_lr': 1e-3})
  if 'smoke' in args:
    c.model = 'mlp'
    c.client_models = c.client_models.replace(VGG, 'mlp')
    c.fedmho.update({'local_epochs': 1, 'cvae_epochs': 1, 'num_synthetic': 200, 'epochs': 2})
    c.fedcvae.update(
      {
        'cvae_epochs': 1,
        'num_synthetic': 200,
        'epochs': 2,
        'server_model': 'mlp',
        'decoder_samples': 200,
        'decoder_epochs': 1,
      }
    )
    c.fedavg_vote.local_epochs = 1
  return c
