"""HFLDD and its baselines on scikit-learn digits (embedded, no download): a laptop-sized
version of HFLDD's MNIST experiment (#C=1: every client holds one class).

Command:
  python -m experiments.main --method=hfldd --config=experiments/configs/hfldd_digits.py \
      --workdir=runs/hfldd_digits
Setup: 20 clients, #C=1 (NIID-Bench shards, k=1: two clients per class, ~72 images each),
HFLDD's MNIST CNN ('hfldd_cnn_mnist' = LeNet-5 with max pooling, padded for 8x8 inputs),
public set = 100 training images held out of every client (`dataset.holdout_size` = 100 for
every method, baselines included; every method is scored on all 360 test images), K=10,
KIP 40 images per member (FC1 NTK, lr 0.004, target batch 10, 300 iterations), 20 rounds x
2 local epochs over the cluster heads, SGD 0.05 momentum 0.9, batch 32.
Expected: 2 heterogeneous clusters of 10 clients that each cover all 10 classes (one client
of every homogeneous cluster), and test accuracy (on all 360 test images):
  measured (seed 0, CPU, jax 0.10.2, public set held out of the training split): HFLDD
  93.06% after 20 rounds (best 95.83% at round 18; 50% reached at round 5 with 1.8 MB of
  traffic, 80% at round 7 with 2.5 MB; 7.0 MB in all). Before the scoring protocol (public
  set held out of the test split, scored on the other 260): 95.38% (best 95.77%), the same
  clusters and traffic. Baselines at #C=1 with the earlier protocol: FedAvg 10.00%, FedProx
  9.72%, FedSeq 10.77% and DynaFed 9.72% stay near chance; centralized 96.67% (20 epochs,
  best 97.78%).
Time: hfldd alone 21.2 s wall on the idle 2 CPU cores with an empty compilation cache (0.94 GB
peak; 2026-11-26; 93.06% final, 95.83% best, as above). Earlier, beside other jobs (load ~5):
1 min 44 s, and 4 min 33 s for the whole comparison below.

Comparison with every baseline (figure + Tables III-V layout):
  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_digits.py \
      --out=runs/hfldd_compare_digits --targets=0.5,0.8

IID (#C=10, HFLDD's Tables III-V setting), 3 seeds, 39 min on the 2 cores:
  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_digits.py:iid \
      --out=runs/hfldd_compare_digits_iid --targets=0.8,0.9
  measured (docs/results/hfldd_compare_digits_iid/), final %: HFLDD 95.00 ± 1.54, FedSeq
  95.38 ± 2.14, DynaFed 64.23 ± 5.00, FedAvg 32.05 ± 7.71, FedProx 32.05 ± 8.07, centralized
  96.67 ± 0.59; 80% at round 6.0 (FedSeq) and 9.0 (HFLDD), never for the others.

IID at the `plateau` budget (100 rounds for every method), 3 seeds, 1 h 41 min on the 2 cores
beside other jobs (2026-11-27):
  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_digits.py:iid,plateau \
      --out=runs/hfldd_compare_digits_iid_plateau --targets=0.8,0.9
  measured (docs/results/hfldd_compare_digits_iid_plateau/), final %: HFLDD 95.37 ± 0.42,
  FedSeq 96.85 ± 0.70, FedAvg 95.00 ± 1.94, FedProx 94.91 ± 1.95, DynaFed 92.31 ± 1.25,
  centralized 97.87 ± 0.70; 80% at round 10.0 (HFLDD, 11.9 MiB) and 7.0 (FedSeq, 12.6 MiB).

#C=2 at the `plateau` budget, 3 seeds, 77 min on the 2 cores beside a mutation run (2026-12-02):
  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_digits.py:c2,plateau \
      --out=runs/hfldd_compare_digits_c2_plateau --targets=0.5,0.8
  measured (docs/results/hfldd_compare_digits_c2_plateau/), final %: HFLDD 95.74 ± 0.70,
  FedSeq 97.50 ± 0.73, FedAvg 92.22 ± 2.82, FedProx 90.93 ± 2.74, DynaFed 28.89 ± 1.27,
  centralized 97.87 ± 0.70; 80% at round 9.0 (HFLDD, 5.6 MiB) and 35.7 (FedSeq, 64.2 MiB).
  FedAvg and FedProx still rise there: FedAvg reaches 96.1% at 300 rounds (seed 0).
#C=2 at the paper's 300 rounds for every method, 3 seeds, 83 min on the 2 cores beside another
job (2026-12-02; DynaFed 45 of them):
  python -m experiments.hfldd_compare --config=experiments/configs/hfldd_digits.py:c2,paper_rounds \
      --out=runs/hfldd_compare_digits_c2_paper_rounds --targets=0.5,0.8
  measured (docs/results/hfldd_compare_digits_c2_paper_rounds/), final %: HFLDD 96.11 ± 1.00,
  FedSeq 97.59 ± 0.58, FedAvg 96.67 ± 0.48, FedProx 96.48 ± 0.16, DynaFed 52.69 ± 12.03,
  centralized 97.78 ± 0.83; 80% at round 8.7 (HFLDD, 5.4 MiB), FedAvg 40.4x its traffic.

Variants (comma-separated): `c2` (#C=2), `iid` (#C=10), `nodd` (HFLDD w/o DD: raw data to
the heads), `plateau` (100 rounds for every method instead of 20: where FedAvg's IID curve
reaches its plateau), `paper_rounds` (the paper's 300 rounds for every method: FedAvg's plateau at
#C=2), `fmpublic` (public set = 100 Fashion-MNIST images resized to 8x8, the paper's
choice of a different public dataset; needs dataset-fashion-mnist), `smoke` (about a minute
for hfldd, used by the tests: 10 clients, 3 rounds, KIP 30 iterations).
"""

from jfed.configs.base import base_config, variant_words

VARIANTS = ('c2', 'iid', 'nodd', 'fmpublic', 'plateau', 'paper_rounds', 'smoke')


def get_config(arg: str = ''):
  args = set(variant_words(arg, VARIANTS))
  c = base_config()
  c.dataset.name = 'digits'
  c.partition.scheme, c.partition.num_clients, c.partition.k = 'shards', 20, 1
  if 'c2' in args:
    c.partition.k = 2
  if 'iid' in args:
    c.partition.k = 10
  c.model = 'hfldd_cnn_mnist'
  c.batch_size = 32
  c.optimizer.lr, c.optimizer.momentum = 0.05, 0.9

  # 'plateau': the rounds at which FedAvg's IID curve is within 1 point of where it stays up to
  # 300 rounds (the paper's count): 93.5 % over rounds 96-100, 94.3-94.7 % from round 120 to
  # 300 (`--config=...:iid --config.fedavg.rounds=300`, seed 0, CPU, 2026-11-27); at 20 rounds
  # FedAvg is still at 9.7 %
  # 'paper_rounds': the paper's 300 for every method; at #C=2 FedAvg still rises 10 points over
  # the last fifth of 100 rounds and passes HFLDD by round 300 (seed 0, CPU, 2026-12-02)
  rounds = 300 if 'paper_rounds' in args else (100 if 'plateau' in args else 20)
  epochs = 2
  h = c.hfldd
  h.pretrain_epochs = 5
  h.public, h.public_size = ('fashion_mnist' if 'fmpublic' in args else 'holdout'), 100
  if h.public == 'holdout':  # the same training samples held out of every method's clients
    c.dataset.holdout_size = h.get_ref('public_size')  # follows a --config override
  h.K = 10
  h.rounds, h.local_epochs = rounds, epochs
  h.distill = 'nodd' not in args
  h.kip.support_size, h.kip.iterations, h.kip.target_batch = 40, 300, 10
  c.fedavg.rounds, c.fedavg.local_epochs = rounds, epochs
  c.fedprox.rounds, c.fedprox.local_epochs = rounds, epochs
  c.centralized.epochs = rounds
  c.local.epochs = h.pretrain_epochs
  s = c.fedseq
  s.pretrain_epochs, s.public, s.public_size = 5, h.public, h.get_ref('public_size')
  s.min_examples, s.max_clients = 700, 11  # ~10 clients of ~72 images per superclient
  s.rounds, s.local_epochs = rounds, epochs
  d = c.dynafed
  d.rounds, d.local_epochs = rounds, epochs
  d.participation, d.client_optimizer, d.client_lr = 0.4, 'adam', 1e-3  # the reference's
  # of the 20 (plateau: 100, paper_rounds: 300) rounds (the reference: 24 of 200)
  d.trajectory_rounds = 10
  d.ipc, d.syn_steps, d.expert_epochs, d.max_start_epoch = 15, 20, 3, 50
  d.iterations = 1000  # the reference: 3000
  d.finetune_epochs, d.finetune_batch = 20, 256

  if 'smoke' in args:
    c.partition.num_clients = 10
    rounds = 3
    h.pretrain_epochs, h.rounds, h.local_epochs = 2, rounds, 1
    h.kip.support_size, h.kip.iterations = 20, 30
    c.fedavg.rounds = c.fedprox.rounds = c.centralized.epochs = rounds
    c.fedavg.local_epochs = c.fedprox.local_epochs = 1
    c.local.epochs = h.pretrain_epochs
    s.pretrain_epochs, s.rounds, s.local_epochs, s.min_examples = 2, rounds, 1, 400
    d.rounds, d.local_epochs, d.trajectory_rounds, d.expert_epochs = rounds, 1, 2, 1
    d.ipc, d.syn_steps, d.iterations, d.finetune_epochs = 2, 3, 10, 2
  return c
