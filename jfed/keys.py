"""Every purpose for which a random key is derived from the run's root key, in one place.

A method derives its keys as `ctx.derive_key(Purpose.X, step, ...)`: `fold_in` of the root key
with the purpose, then with the step. Distinct purposes give independent streams, and a step's
keys depend only on (seed, purpose, step), so a resumed run draws the same numbers as an
uninterrupted one. The values are part of every recorded result: never renumber a member.
"""

import enum


@enum.unique
class Purpose(enum.IntEnum):
  """First `fold_in` of the root key."""

  MODEL_INIT = 1  # initial (global or per-architecture) models
  LOCAL_TRAINING = 2  # one-shot local training (round r > 1: fold_in(r))
  ROUNDS = 3  # multi-round client training, per round
  SERVER = 4  # one-shot server: distillation epochs and round-level draws
  SAMPLING = 5  # client participation, per round
  KIP = 31  # HFLDD members' KIP distillation
  SUPERCLIENT_ORDER = 41  # FedSeq client order inside superclients, per round
  SYNTHETIC_SET = 51  # DynaFed trajectory matching
  FINETUNE = 52  # DynaFed fine-tuning on the synthetic set, per round
  ALIGNMENT = 61  # FedMD: the public alignment subset, per round
  PUBLIC_TRAINING = 62  # FedMD: transfer learning on the labelled public data
  DIGEST = 63  # FedMD: fitting the consensus logits, per round
  STAGE2_IMAGES = 71  # FedTSA: the synthetic images of Stage 2 (generation)
  DIFFUSION = 72  # FedTSA: training the DDPM
  ATTACK = 81  # simulated attacks: fold_in(0) the attackers, fold_in(1) then round r the uploads
  PRIVACY = 91  # DP-FedAvg's noise (jfed/engine/privacy.py), per round


@enum.unique
class ServerRoundPurpose(enum.IntEnum):
  """One-shot round-level draws: derive_key(Purpose.SERVER, 0, round, purpose).

  Epoch e of round r uses derive_key(Purpose.SERVER, r, e) with r >= 1, a disjoint path.
  """

  STUDENT = 1  # the random server model
  GENERATOR = 2  # a generator kept across the epochs of a round
  MODEL_STRATIFICATION = 3  # FedHydra MS
  GENERATION = 4  # CVAE decoders: latents and labels of the synthetic set
