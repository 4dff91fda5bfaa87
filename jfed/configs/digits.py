"""scikit-learn digits (embedded, no download): the README's main job, and every method quickly.

Command (the README's):
  python -m experiments.main --method=fedavg --config=experiments/configs/digits.py \
      --workdir=runs/digits_fedavg
Expected: FedAvg, 5 clients, Dir(0.5), DENSE CNNMnist, 20 rounds x 2 local epochs.
Measured (seed 0, CPU, jax 0.10.2, the idle 2 cores, empty compilation cache, 2026-11-26; 150
training images held out of every client): 98.33% test accuracy (best 98.61% at round 18) in
20.1 s wall (16.2 s in the driver), 0.67 GB peak memory.

Every method runs on the same data and partition (--method=NAME; each reads its own section)
at a digits-sized budget: seconds to a few minutes on 2 CPU cores.
  fedavg, fedprox   20 rounds x 2 local epochs (FedProx mu = 0.01)
  centralized       20 epochs on all the training data (the upper bound)
  local             20 epochs per client (the clients' own models)
  dense, coboosting, feddf, ot, fedhydra
                    one-shot: 20 local epochs per client (~35 s), then DENSE 20, Co-Boosting 15,
                    FedHydra 20 distillation epochs of 30 generator steps on 64 images (FedHydra:
                    MS with T_G = 30 on 16 images); FedDF 400 Adam steps on 90 held-out
                    training images; OT fuses the local models. Add
                    --config.local_models_dir=runs/<first run>/local_models to train the local
                    models once for all of them.
  hfldd, hfldd_nodd, fedseq, dynafed
                    20 rounds x 2 local epochs; public set = 100 training images held out
                    of every client (`dataset.holdout_size` = 150 for every method); HFLDD:
                    5 pre-training epochs, KIP 40 images x 300 iterations (K is capped at
                    the 5 clients); FedSeq: hfldd_digits.py's budget; DynaFed: its
                    budget with 50 trajectory-matching iterations.
Measured (seed 0; jfed at f14526d, whose runner ran these methods before the driver migration;
2 CPU cores shared with other jobs at load average 3-6, so expect roughly half alone), final
(best) test accuracy and wall time: Co-Boosting 28.6% (31.1%) 4.8 min, DENSE 60.3% (61.1%)
3.8 min, FedHydra 84.2% at epoch 20 of a 30-epoch run that took 6.0 min (~4.7 min for 20;
stratification 45 s), FedDF 78.6% 50 s, OT 74.4% 27 s, HFLDD 94.2% (95.4%) 83 s, FedSeq 98.8%
(99.6%) 93 s, DynaFed 96.9% 3.4 min with 100 matching iterations (of which 93 s matching).
These were measured before the scoring protocol of issue 33 (test split for scoring only,
150 training images held out of every client); every method now scores all 360 test images.
These budgets follow fedhydra_digits.py and hfldd_digits.py, with fewer distillation epochs for
DENSE, Co-Boosting and FedHydra (common.py's defaults, 200 local + 200 distillation epochs, are
for accelerators). For the papers' settings on digits, with measured comparisons, use
fedhydra_digits.py (one-shot family, 40 distillation epochs) and hfldd_digits.py (HFLDD family:
20 clients at #C=1, the label skew HFLDD targets).

Variants (comma-separated, e.g. `digits.py:iid,smoke`):
  smoke   seconds-long budgets for every method (used by the tests; accuracy meaningless)
  iid     IID partition instead of Dir(0.5)
"""

from jfed.configs.base import base_config, variant_words
from jfed.errors import ConfigError

VARIANTS = ('smoke', 'iid')


def _update(section, **values) -> None:
  """Sets existing keys only: a key missing from common.py is a mistake here, not a new key."""
  for key, value in values.items():
    if key not in section:
      raise ConfigError(f'digits.py sets {key!r}, which is not a key of its config section')
    section[key] = value


def get_config(arg: str = ''):
  words = variant_words(arg, VARIANTS)
  c = base_config()
  c.dataset.name = 'digits'
  c.model = 'cnn_mnist'
  c.batch_size = 32
  # 150 training images no client holds: FedDF's 90 distillation and 60 validation images and
  # the HFLDD family's 100 public images come from them; every method's clients lose the same.
  c.dataset.holdout_size = 150
  if 'iid' in words:
    c.partition.scheme = 'iid'

  rounds, epochs = 20, 2
  _update(c.fedavg, rounds=rounds, local_epochs=epochs)
  _update(c.fedprox, rounds=rounds, local_epochs=epochs, mu=0.01)
  c.centralized.epochs = 20
  c.local.epochs = 20

  # One-shot family (fedhydra_digits.py's budget, fewer distillation epochs).
  generator = {'synthesis_batch': 64, 'nz': 64, 'ngf': 32, 'kd_batch': 64}
  _update(c.dense, local_epochs=20, epochs=20, g_steps=30, kd_lr=0.01, **generator)
  _update(c.coboosting, local_epochs=20, epochs=15, g_steps=30, **generator)
  _update(c.fedhydra, local_epochs=20, epochs=20, T_G=30, ms_T_G=30, ms_batch=16, **generator)
  _update(
    c.feddf,
    local_epochs=20,
    source_size=90,
    val_size=60,
    total_steps=400,
    eval_every=20,
    patience=100,
    kd_batch=32,
  )
  _update(c.ot, local_epochs=20)

  # HFLDD family (hfldd_digits.py's budget).
  h = c.hfldd
  _update(h, pretrain_epochs=5, public_size=100, rounds=rounds, local_epochs=epochs)
  _update(h.kip, support_size=40, iterations=300, target_batch=10)
  _update(
    c.fedseq,
    pretrain_epochs=5,
    public_size=100,
    min_examples=700,
    max_clients=11,
    rounds=rounds,
    local_epochs=epochs,
  )
  _update(
    c.dynafed,
    rounds=rounds,
    local_epochs=epochs,
    trajectory_rounds=5,
    expert_epochs=2,
    ipc=5,
    syn_steps=10,
    iterations=50,
    finetune_epochs=5,
    finetune_batch=256,
  )

  if 'smoke' in words:
    _update(c.fedavg, rounds=2, local_epochs=1)
    _update(c.fedprox, rounds=2, local_epochs=1)
    c.centralized.epochs = c.local.epochs = 2
    tiny = {'local_epochs': 2, 'synthesis_batch': 16, 'nz': 16, 'ngf': 8, 'kd_batch': 16}
    _update(c.dense, epochs=2, g_steps=2, **tiny)
    _update(c.coboosting, epochs=2, g_steps=2, **tiny)
    _update(c.fedhydra, epochs=2, T_G=2, ms_T_G=4, ms_batch=8, ms_lr=0.05, **tiny)
    _update(
      c.feddf,
      local_epochs=2,
      source_size=40,
      val_size=20,
      total_steps=4,
      eval_every=2,
      patience=4,
      kd_batch=16,
    )
    _update(c.ot, local_epochs=2)
    _update(h, pretrain_epochs=2, rounds=2, local_epochs=1)
    _update(h.kip, support_size=20, iterations=30)
    _update(c.fedseq, pretrain_epochs=2, rounds=2, local_epochs=1, min_examples=400)
    _update(
      c.dynafed,
      rounds=2,
      local_epochs=1,
      trajectory_rounds=2,
      expert_epochs=1,
      ipc=2,
      syn_steps=3,
      iterations=10,
      finetune_epochs=2,
    )
  return c
