"""The base config every experiment config starts from; each method reads its own sub-config.

Also `variant_words`, which every `get_config(arg)` uses to split its variant argument (the part
after `:` in `--config=file.py:a,b`) and to refuse words it does not know.
"""

from typing import Callable, Iterable, List, TypeVar

import ml_collections

from jfed.errors import ConfigError

T = TypeVar('T')


def variant_words(arg: str, known: Iterable[str]) -> List[str]:
  """The comma-separated variant words of `arg`, in order; ConfigError on an unknown one.

  Args:
    arg: the config argument, e.g. 'iid,smoke' or 'dir=0.1,rounds=3' ('' or None: no words).
      Spaces around words and empty words (',,', a trailing comma) are ignored; a word given
      twice is kept once.
    known: the valid words. An entry ending in '=' (e.g. 'rounds=') is a prefix: it accepts
      any word 'rounds=<value>' with a non-empty value (see `variant_value`).

  Returns:
    The words of `arg`, stripped, without duplicates, in the order given.

  Raises:
    ConfigError: a word that is not known; the message lists the valid words.
  """
  known = tuple(known)
  words = []
  for word in (arg or '').split(','):
    word = word.strip()
    if word and word not in words:
      words.append(word)
  for word in words:
    name, eq, value = word.partition('=')
    if (not eq and word in known) or (eq and value and name + eq in known):
      continue
    valid = ', '.join(k + '<value>' if k.endswith('=') else k for k in known)
    raise ConfigError(
      f'unknown config variant {word!r} in {arg!r}; valid variants (comma-separated): {valid}'
    )
  return words


def variant_value(word: str, cast: Callable[[str], T]) -> T:
  """The value of a 'name=value' variant word, converted by `cast`; ConfigError if it fails."""
  name, _, value = word.partition('=')
  try:
    return cast(value)
  except ValueError:
    raise ConfigError(
      f'config variant {word!r}: {value!r} is not a valid {name} '
      f'({getattr(cast, "__name__", "value")} expected)'
    ) from None


def heterogeneity_rates(word: str) -> List[float]:
  """The pruning rates of a 'rates=0.1/0.4/0.7/1.0' word (FedTSA Table 4's degrees of model
  heterogeneity), fastest first; ConfigError unless each lies in (0, 1] and one is 1.0."""

  def cast(value: str) -> List[float]:
    rates = sorted({float(r) for r in value.split('/') if r.strip()}, reverse=True)
    if not rates or rates[0] != 1.0 or rates[-1] <= 0:
      raise ValueError(value)
    return rates

  cast.__name__ = 'list of rates in (0, 1] including 1.0, separated by /'
  return variant_value(word, cast)


def equal_share_models(model_at: Callable[[float], str], rates: List[float], n: int) -> str:
  """client_models for `n` clients split as evenly as the rates allow (the first rates take
  the remainder), fastest first: the baselines' clients of a 'rates=' degree."""
  counts = [n // len(rates) + (i < n % len(rates)) for i in range(len(rates))]
  return ';'.join(model_at(r) for r, k in zip(rates, counts) for _ in range(k))


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # holdout_size: training samples held out of every client (seeded), the source 'holdout' of
  # the servers' public, distillation and generator data. The test split is for scoring only;
  # every method of a comparison sets the same holdout_size, so their clients hold the same data.
  c.dataset = ml_collections.ConfigDict({'name': 'digits', 'data_dir': '', 'holdout_size': 0})
  # scheme: iid | dirichlet (alpha, min_size) | shards (#C=k: k) | disjoint (2c/c)
  #         | feddf_dirichlet (alpha) | fedcvae_dirichlet (alpha)
  c.partition = ml_collections.ConfigDict(
    {'scheme': 'dirichlet', 'num_clients': 5, 'alpha': 0.5, 'min_size': 10, 'k': 2}
  )
  c.model = 'cnn_mnist'
  c.client_models = ''  # heterogeneous: 'spec;spec;...' cycled over clients
  c.local_models_dir = ''  # reuse local models checkpointed by an earlier run
  c.local_cvaes_dir = ''  # reuse local CVAEs checkpointed by an earlier run (FedMHO, FedCVAE)
  c.optimizer = ml_collections.ConfigDict(
    {'name': 'sgd', 'lr': 0.01, 'momentum': 0.9, 'weight_decay': 0.0, 'schedule': 'constant'}
  )  # schedule: constant | cosine (centralized only)
  c.batch_size = 64
  c.strategy = 'auto'  # client map: auto | loop | vmap | scan
  c.shard = False  # shard client groups over all devices ('clients' mesh axis)
  c.eval_batch_size = 1000

  # The server side of model uploads, for every method that aggregates client models (FedAvg,
  # FedProx, one-shot FedAvg, HFLDD's and DynaFed's rounds, FedTSA's clusters):
  # jfed/engine/aggregation.py, attacks.py and common.Server.
  # rule: mean | median | trimmed_mean | krum | geometric_median; clip_norm > 0 clips updates.
  c.aggregation = ml_collections.ConfigDict(
    {
      'rule': 'mean',
      'trim_fraction': 0.1,
      'krum_byzantine': 1,
      'krum_selected': 1,
      'geomed_iterations': 100,
      'geomed_smoothing': 1e-6,
      'clip_norm': 0.0,
    }
  )
  # kind: none | sign_flip | scaling | noise | same_value | label_flip; the attackers are
  # `clients` ('0,3') or a seeded `fraction` of them.
  c.attack = ml_collections.ConfigDict(
    {'kind': 'none', 'fraction': 0.0, 'clients': '', 'strength': 10.0}
  )
  # on_invalid_upload: drop (log it, exclude the client, count it) | fail (stop the run);
  # max_update_norm_ratio > 0 rejects ||θ_k − θ_global|| > ratio · ||θ_global||;
  # allow_empty_rounds: a round whose uploads were all rejected keeps the global model (False:
  # such a round fails the run).
  c.server = ml_collections.ConfigDict(
    {'on_invalid_upload': 'drop', 'max_update_norm_ratio': 0.0, 'allow_empty_rounds': False}
  )
  # Every run's workdir/tensorboard event files (the scalars of metrics.jsonl); Weights & Biases
  # when wandb is installed (pip install -e '.[wandb]') and turned on. Not part of the workdir's
  # identity: a resumed run may change them.
  c.logging = ml_collections.ConfigDict(
    {'tensorboard': True, 'wandb': False, 'wandb_project': 'jfed'}
  )
  # FedAvg/FedProx's step on the pseudo-gradient (Reddi et al. 2021; jfed/engine/server_optim.py):
  # fedavg (the aggregate) | fedavgm | fedadam | fedyogi | fedadagrad.
  c.server_optimizer = ml_collections.ConfigDict(
    {'name': 'fedavg', 'lr': 1.0, 'momentum': 0.9, 'b1': 0.9, 'b2': 0.99, 'eps': 1e-3}
  )

  # Differential privacy of FedAvg / FedProx (DP-FedAvg; jfed/engine/privacy.py): every update
  # clipped to L2 norm clip_norm (adaptive: C follows the target_quantile of the update norms,
  # step clip_lr, its count noised with std count_noise_fraction x clients per round; Andrew et
  # al. 2021), Gaussian noise of std noise_multiplier x C on their sum at the server, or (local)
  # on each upload at its client; ε at delta is recorded every round.
  c.dp = ml_collections.ConfigDict(
    {
      'enabled': False,
      'noise_multiplier': 1.0,
      'clip_norm': 1.0,
      'adaptive': False,
      'target_quantile': 0.5,
      'clip_lr': 0.2,
      'count_noise_fraction': 0.05,
      'delta': 1e-5,
      'local': False,
    }
  )
  c.fedavg = ml_collections.ConfigDict(
    {'rounds': 1, 'local_epochs': 1, 'participation': 1.0, 'reuse_local_models': False}
  )
  c.fedprox = ml_collections.ConfigDict(
    {'rounds': 1, 'local_epochs': 1, 'participation': 1.0, 'mu': 0.01}
  )
  c.fedavg_vote = ml_collections.ConfigDict({'local_epochs': 1})
  c.centralized = ml_collections.ConfigDict({'epochs': 1})
  c.local = ml_collections.ConfigDict({'epochs': 1})
  # HFLDD (Shi et al., arXiv 2409.17517): label knowledge collection -> clustering -> KIP -> FedAvg
  # over heads.
  # Paper values (Sec. VI-A4) where the paper gives them; see jfed/methods/hfldd.py.
  c.hfldd = ml_collections.ConfigDict(
    {
      'pretrain_epochs': 1,
      'public': 'holdout',
      'public_size': 1000,
      'K': 10,
      'symmetric': False,
      'leftover': 'singleton',
      'distill': True,
      'image_dtype': 'uint8',
      'rounds': 1,
      'local_epochs': 1,
      'kip': ml_collections.ConfigDict(
        {
          'support_size': 400,
          'iterations': 3000,
          'lr': 0.004,
          'target_batch': 10,
          'learn_labels': False,
          'kernel': 'fc_ntk',
          'depth': 1,
          'reg': 1e-6,
          'x64': False,
        }
      ),
    }
  )
  # FedSeq (RickZack/FedSeq): greedy superclients from confidence vectors, sequential training.
  c.fedseq = ml_collections.ConfigDict(
    {
      'pretrain_epochs': 10,
      'public': 'holdout',
      'public_size': 1000,
      'min_examples': 800,
      'max_clients': 11,
      'measure': 'kullback',
      'code_compat': False,
      'rounds': 1,
      'local_epochs': 1,
      'participation': 1.0,
    }
  )
  # DynaFed (pipilurj/DynaFed): FedAvg + server-side trajectory matching + fine-tuning.
  # Reference defaults (CIFAR-10 scripts); experiment configs shrink them for CPU.
  c.dynafed = ml_collections.ConfigDict(
    {
      'rounds': 1,
      'local_epochs': 1,
      'participation': 1.0,  # the reference scripts: 0.4 (hfldd_*.py set it)
      'weighting': 'uniform',
      'trajectory_rounds': 24,
      'ipc': 15,
      'syn_steps': 20,
      'expert_epochs': 3,
      'min_start_epoch': 0,
      'max_start_epoch': 50,
      'weight_averaging': True,
      'least_ave_num': 2,
      'max_ave_num': 10,
      'iterations': 3000,
      'batch_syn': 0,
      'lr_img': 0.05,
      'lr_label': 0.01,
      'lr_lr': 1e-5,
      'lr_teacher': 0.04,
      'label_init': 0.0,
      'noise_mean': 0.5,
      'noise_std': 0.25,
      'finetune_epochs': 20,
      'finetune_lr': 1e-4,
      'finetune_batch': 256,
      # DSA during matching and fine-tuning (jfed/distill/diffaugment.py; '' or 'none': off)
      'dsa': 'color_crop_cutout_flip_scale_rotate',
      # the clients' optimiser: '' = the run's `optimizer`; else sgd | adam at client_lr
      'client_optimizer': 'adam',
      'client_lr': 1e-3,
    }
  )
  # One-shot distillation methods (jfed/methods/oneshot.py defines a round; each module's
  # docstring its settings). Defaults: the reference code / FedHydra
  # (Bai et al., KDD 2025) §4.1.5 (E = T_g = 200); experiment configs shrink them for CPU.
  c.dense = ml_collections.ConfigDict(
    {
      'rounds': 1,
      'local_epochs': 200,
      'epochs': 200,
      'server_model': '',
      'init': 'random',
      'g_steps': 30,
      'synthesis_batch': 256,
      'lr_g': 1e-3,
      'bn': 1.0,
      'oh': 1.0,
      'adv': 1.0,
      'bn_loss_mode': 'paper',
      'nz': 256,
      'ngf': 64,
      'kd_T': 20.0,
      'kd_optimizer': 'sgd',
      'kd_lr': 0.005,
      'kd_momentum': 0.9,
      'kd_weight_decay': 0.0,
      'kd_batch': 256,
      'kd_augment': 'auto',
      'pool_quantize': True,
    }
  )
  c.feddf = ml_collections.ConfigDict(
    {
      'rounds': 1,
      'local_epochs': 200,
      'server_model': '',
      'init': 'fedavg',
      'source': 'holdout',
      'source_size': 4000,
      'val_size': 1000,
      'val_split': 'holdout',  # 'train': validate on training images the clients also hold
      'kd_T': 1.0,
      'kd_optimizer': 'adam',
      'kd_lr': 1e-3,
      'kd_batch': 128,
      'total_steps': 10000,
      'eval_every': 100,
      'patience': 1000,
      'kd_grad_clip': 5.0,
      'kd_schedule': 'cosine',
      'kd_augment': 'none',
      'teacher_bn': 'batch',
      'architectures': 'all',  # 'server': distil only server_model's architecture
    }
  )
  c.coboosting = ml_collections.ConfigDict(
    {
      'rounds': 1,
      'local_epochs': 200,
      'epochs': 200,
      'server_model': '',
      'init': 'random',
      'g_steps': 30,
      'synthesis_batch': 128,
      'lr_g': 1e-3,
      'bn': 0.0,
      'oh': 1.0,
      'adv': 1.0,
      'hs': 1.0,
      'adv_T': 3.0,
      'g_grad_clip': 10.0,
      'nz': 256,
      'ngf': 64,
      'mu': 0.01,
      'wdc': 0.99,
      'wa_steps': 1,
      'odseta': 8 / 255,
      'ods_T': 4.0,
      'kd_T': 4.0,
      'kd_optimizer': 'sgd',
      'kd_lr': 0.01,
      'kd_momentum': 0.9,
      'kd_weight_decay': 1e-4,
      'kd_schedule': 'cosine_epochs',
      'kd_grad_clip': 10.0,
      'kd_batch': 128,
      'kd_augment': 'auto',
      'pool_quantize': True,
      'synthesis_augment': False,  # the reference synthesises from un-augmented G(z)
    }
  )
  c.ot = ml_collections.ConfigDict(
    {
      'rounds': 1,
      'local_epochs': 200,
      'method': 'exact',
      'epsilon': 0.01,
      'anchor': 0,
      'skip_last_layer': True,
      'weights': 'uniform',
      'squared': False,
      'bias_in_cost': True,
    }
  )
  c.fedhydra = ml_collections.ConfigDict(
    {
      'rounds': 1,
      'local_epochs': 200,
      'epochs': 200,
      'server_model': '',
      'init': 'random',
      'T_G': 30,
      'lr_g': 1e-3,
      'synthesis_batch': 256,
      'lambda1': 1.0,
      'lambda2': 1.0,
      'adv_T': 1.0,
      'generator_reset': False,
      'nz': 256,
      'ngf': 64,
      'generator': 'paper',  # FedHydra §4.1.3; 'dense': DENSE's generator
      'synthesis_keep': 'all',  # FedHydra §2: every intermediate batch; 'best': DENSE's one
      'ms_T_G': 30,
      'ms_lr': 1e-3,
      'ms_batch': 256,
      'ms_impl': 'auto',
      'ms_chunk': 0,
      'aggregation': 'sa',
      'sa_in_model_scale': 'paper',  # 'classes': Ū_c × c (SA logits at the clients' scale)
      'beta': 1.0,
      'kd_T': 1.0,
      'kd_lr': 0.01,
      'kd_momentum': 0.9,
      'kd_weight_decay': 0.0,
      'kd_batch': 256,
      'kd_data': 'pool',
      'kd_augment': 'none',
      'pool_quantize': True,
    }
  )
  # FedMHO (Yao et al., WWW 2026): classifier + CVAE clients; defaults are Table 7's
  # Fashion-MNIST column (the global model's Adam lr and epochs, the CVAE-small's Adam lr and
  # epochs, N_syn, R_th).
  c.fedmho = ml_collections.ConfigDict(
    {
      'local_epochs': 200,
      'cvae_epochs': 40,
      'cvae_optimizer': 'adam',
      'cvae_lr': 5e-2,
      'cvae_batch': 64,
      'cvae_recon': 'bce',
      'num_synthetic': 6000,
      'clean_rate': 0.8,
      'epochs': 20,
      'lr': 5e-4,
      'batch': 64,
      'lam': 0.5,
      'kl_reduction': 'mean',  # the reference's nn.KLDivLoss() ('batchmean': the paper's sum)
    }
  )
  # FedCVAE-Ens and -KD (github.com/ceh-2000/fed_cvae): CVAE clients only; the server classifier
  # from scratch. KD: the server decoder distilled from the users' (decoder_*: the reference's tuned
  # Fashion-MNIST values, experiments/best_hyperparameters/fashion/fedvae.txt).
  c.fedcvae = ml_collections.ConfigDict(
    {
      'cvae_epochs': 40,
      'cvae_optimizer': 'adam',
      'cvae_lr': 1e-3,
      'cvae_batch': 64,
      'cvae_recon': 'bce',
      'num_synthetic': 6000,
      'z_bound': 3.0,
      'weight_by_share': True,
      'server_model': '',
      'epochs': 20,
      'lr': 1e-3,
      'batch': 32,
      # 'fed_cvae': ceh-2000/fed_cvae's server; 'fedmho': the FEDCVAE row as FedMHO's reference
      # runs it (FedMHO's per-class generation and filter at clean_rate; Ens only)
      'protocol': 'fed_cvae',
      'clean_rate': 0.8,
      'cvae_small_lr': 0.0,  # > 0: CVAE-small clients' own Adam lr (FedMHO's reference: 5e-2)
      'server_decoder': 'cvae:size=v0',
      'decoder_samples': 5000,
      'decoder_epochs': 7,
      'decoder_lr': 1e-2,
      'decoder_batch': 32,
    }
  )
  # Model-heterogeneous baselines of FedTSA (Fan et al., ECCV 2024, §5.1). Defaults: the
  # reference code of each (docs/references.md); experiment configs shrink them for CPU.
  # HeteroFL: global model = `model`, clients = `client_models` (the same model, smaller
  # width_mult); diaoenmao/HeteroFL: 5 local epochs, frac 0.1, masked CE, static BN, clip 1.
  c.heterofl = ml_collections.ConfigDict(
    {
      'rounds': 300,
      'local_epochs': 5,
      'participation': 0.1,
      'masked_ce': True,
      'static_bn': True,
      'grad_clip': 1.0,
      'eval_submodels': True,
      'scaler': True,  # the reference's Scaler: hidden pre-activations / rate in training
    }
  )
  # FedProto (yuetan031/FedProto): 100 rounds of 1 local epoch, ld = 1; prototypes are the
  # features of the last local epoch's batches ('last_epoch'; 'after_training': a pass after
  # training). Prototypes are the models' own penultimate features; with `widest_features` the
  # layer feeding the classifier is built at the widest client's width (the reference's clients
  # differ before a prototype layer of one width); `embed_dim` > 0 instead adds a ReLU embedding
  # layer of that width, which the reference does not have.
  c.fedproto = ml_collections.ConfigDict(
    {
      'rounds': 100,
      'local_epochs': 1,
      'participation': 1.0,
      'ld': 1.0,
      'prototypes': 'last_epoch',
      'widest_features': True,
      'embed_dim': 0,
    }
  )
  # FedMD (diogenes0319/FedMD_clean, CIFAR_balance_conf.json): public pre-training 20 epochs of
  # batch 128, private 25 epochs of batch 32, then 20 rounds of N_alignment = 5000, digest 1
  # epoch of batch 256 (L1 on logits), revisit 4 epochs of batch 5; Adam 1e-3 throughout.
  c.fedmd = ml_collections.ConfigDict(
    {
      'rounds': 20,
      'public': 'holdout',
      'public_size': 5000,
      'public_epochs': 20,
      'public_batch': 128,
      'private_epochs': 25,
      'private_batch': 32,
      'alignment_size': 5000,
      'digest_epochs': 1,
      'digest_batch': 256,
      'revisit_epochs': 4,
      'revisit_batch': 5,
      # 'client': config.optimizer in every stage (the client optimiser of every other method
      # of a comparison); 'adam': the reference's Adam at `lr`
      'optimizer': 'client',
      'lr': 1e-3,
    }
  )
  # FedTSA (§5.1): 100 rounds, T = 5, 1 global epoch, KL-only, 200 images per prompt,
  # devices at rates 1.0 / 0.8 / 0.6 for 20 / 40 / 40 % of the clients, 100 local epochs (its
  # batch 100 and lr 0.03 are config.batch_size and config.optimizer). Its diffusion model is
  # Stable Diffusion v1-4 (source='pipeline'); the default here is a DDPM trained on held-out
  # data, since no weights can be downloaded. See jfed/methods/fedtsa.py.
  c.fedtsa = ml_collections.ConfigDict(
    {
      'rounds': 100,
      'local_epochs': 100,
      'participation': 1.0,
      'profile': 'simulated',
      'durations_file': '',
      'device_rates': '1.0,0.8,0.6',
      'device_shares': '0.2,0.4,0.4',
      'jitter': 0.02,
      'proxy_samples': 1000,
      'proxy_repeats': 3,
      'bandwidth': '0.1',
      'kde_space': 'log',
      'kde_min_bandwidth': 0.05,
      'rate_quantum': 0.1,
      'stage2': True,
      'global_epochs': 1,
      'temperature': 5.0,
      'kl_weight': 1.0,
      'stage2_lr': 0.0,
      'stage2_batch': 100,
      'stage2_bn_stats': 'keep',  # 'recalibrate': keep Stage 2's running-statistics updates
      'reported_model': 'widest',  # or 'client_weighted' (mean over clients of their cluster's)
      'source': 'ddpm',
      'images_per_prompt': 200,
      'prompt_template': 'a photo of real {}',
      'holdout': 'holdout',
      'holdout_size': 2000,
      'ddpm_steps': 1000,
      'ddpm_timesteps': 100,
      'ddpm_channels': 16,
      'ddpm_batch': 64,
      'ddpm_lr': 2e-3,
      'ddpm_guidance': 1.0,
      'ddpm_cache': '',
      'pipeline_dir': '',
      'pipeline_steps': 50,
      'pipeline_guidance': 7.5,
    }
  )
  return c
