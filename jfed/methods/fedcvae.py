"""FedCVAE-Ens ("Data-Free One-Shot Federated Learning Under Very High Statistical
Heterogeneity", Heinbaugh, Luz-Ricca, Shao, ICLR'23; reference ceh-2000/fed_cvae), the baseline
FedMHO calls FEDCVAE: every client trains a CVAE, the server decodes a synthetic set
from the uploaded decoders and trains a classifier from scratch on it, in one round.

Clients: every client's spec must be `cvae[:size=..]` (FedMHO Table 1: CVAE-large and
CVAE-small); each trains Eq. 3 for `cvae_epochs` (`jfed.methods.generative`) and uploads its
decoder and class counts (its data share n_k / N follows from the counts of all uploads).
`same_init` False (default): every client's CVAE starts from its own random init, as the
reference's users (`--should_initialize_same_exp=0`); True: the clients of a spec from one init
(FedMHO's reference; `generative.init_cvaes` gives the keys).

Server (setup): decoder k generates n_k = int(share_k · N_syn) samples (`weight_by_share`,
reference default; else N_syn / K), the last client (highest id) the remainder; labels
y ~ Categorical(pmf_k), z ~ N(0, I) truncated to [−z_bound, z_bound] (the reference's misnamed
`uniform_range`, tuned to (−3, 3)); x = sigmoid(decoder_k(z, y)). A step is one epoch of
Adam(`lr`) cross entropy of a randomly initialised `server_model` (default `config.model`) on
that set, batches of `batch`.

`protocol` (FedCVAE-Ens): 'fed_cvae' (default) draws the set as above, as ceh-2000/fed_cvae does;
'fedmho' runs the FEDCVAE row as FedMHO's reference runs it (YXShi2000/FedMHO with every client a
CVAE: pcode/aggregation/semi_supervised.py): FedMHO's generation (int(N_syn / C) per class, split
over the decoders by n_kc² / Σ n_k'c², z ~ N(0, I)) and Algorithm 2's filter (`clean_rate`), the
same server stage as FedMHO without a teacher, from the random `server_model` (no client has a
classifier to average). FedMHO's tables set it with FedMHO's server Adam lr, batch and epochs,
so both rows take the same server steps. `cvae_small_lr` (> 0) trains the CVAE-small clients at
their own Adam lr (FedMHO's reference: 5e-2, CVAE-large 1e-3).
FedCVAE-KD, which FedMHO's reference does not run, always draws as ceh-2000/fed_cvae.

Config (`config.fedcvae`): the fields of `FedCVAEConfig`.
"""

from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.cvae import clients as cvae_clients
from jfed.cvae import decoder_kd
from jfed.cvae.losses import RECON_LOSSES
from jfed.cvae.server import FusionTrainer, SyntheticSet
from jfed.distill import plots as distill_plots
from jfed.engine import ModelState, TrainState
from jfed.engine.optim import OPTIMIZERS
from jfed.errors import ConfigError
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import common, generative
from jfed.methods.registry import register_method


class FedCVAEConfig(NamedTuple):
  cvae_epochs: int = 40
  cvae_optimizer: str = 'adam'
  cvae_lr: float = 1e-3
  cvae_batch: int = 64
  cvae_recon: str = 'bce'
  num_synthetic: int = 6000
  z_bound: float = 3.0
  weight_by_share: bool = True
  server_model: str = ''
  epochs: int = 20
  lr: float = 1e-3
  batch: int = 32
  # 'fed_cvae': ceh-2000/fed_cvae's server; 'fedmho': the FEDCVAE row as FedMHO's reference
  # runs it (FedMHO's per-class generation and filter at clean_rate; Ens only)
  protocol: str = 'fed_cvae'
  clean_rate: float = 0.8
  cvae_small_lr: float = 0.0  # > 0: CVAE-small clients' own Adam lr (FedMHO's reference: 5e-2)
  # False: every client's CVAE from its own init (ceh-2000/fed_cvae's default
  # --should_initialize_same_exp=0); True: the clients of a CVAE spec from one init (FedMHO's
  # reference, one initial model per architecture; jfed's old behaviour)
  same_init: bool = False


PROTOCOLS = ('fed_cvae', 'fedmho')


class FedCVAEAux(NamedTuple):
  trainer: FusionTrainer
  evaluator: engine.Evaluator
  cvaes: generative.LocalCVAEs
  data: SyntheticSet
  images: np.ndarray
  labels: np.ndarray
  init: Any
  generated: int  # samples decoded (before FedMHO's filter under protocol 'fedmho')


def decoder_sample_counts(sizes: np.ndarray, total: int, weight_by_share: bool) -> np.ndarray:
  """Samples per decoder: int(n_k / N · total), or total // K; the last takes the remainder
  (`generate_dataset_from_user_decoders`).

  Args:
    sizes: n_k, the clients' training-set sizes, [K].
    total: The number of samples to draw in all.
    weight_by_share: Whether decoder k draws in proportion to n_k / N (else equally).

  Returns:
    Samples per decoder, [K] ints summing to `total`.
  """
  sizes = np.asarray(sizes, np.float64)
  if weight_by_share:
    counts = np.floor(sizes / sizes.sum() * total).astype(np.int64)
  else:
    counts = np.full(len(sizes), total // len(sizes), np.int64)
  counts[-1] = total - counts[:-1].sum()
  return counts


def synthesize(
  ctx: RunContext,
  cvaes: generative.LocalCVAEs,
  cfg: FedCVAEConfig,
  total: int,
  tag: int = 0,
  out_hw: Optional[Tuple[int, int]] = None,
):
  """`total` samples from the users' decoders as `generate_dataset_from_user_decoders` draws
  them: (images [N, H, W, C] in [0, 1] at `out_hw` (default: the dataset's size), labels [N],
  latents [N, latent], None where the decoders' latent sizes differ); `tag` separates the draws
  of different uses (0: the Ens classifier set, 1: FedCVAE-KD's decoder targets).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    cvaes: The clients' trained CVAEs (their decoders draw the samples).
    cfg: The method's config (latent size, sampling weights).
    total: The number of samples to draw in all.
    tag: Separates the draws of different uses (0: the Ens classifier set, 1: FedCVAE-KD's decoder
      targets).
    out_hw: The (H, W) of the returned images; None for the dataset's.

  Returns:
    (images [N, H, W, C] in [0, 1], labels [N], latents [N, latent] or None where the decoders'
    latent sizes differ).
  """
  sizes = np.concatenate([u.label_counts.sum(1) for u in cvaes.uploads])
  # The reference's "last user" (the remainder) is the last in client order, not group order.
  by_id = np.argsort(np.concatenate([u.client_ids for u in cvaes.uploads]), kind='stable')
  counts = np.empty(len(sizes), np.int64)
  counts[by_id] = decoder_sample_counts(sizes[by_id], total, cfg.weight_by_share)
  key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.GENERATION)
  key = jax.random.fold_in(key, tag) if tag else key
  parts, latents, row = [], [], 0
  for g, u in zip(cvaes.groups, cvaes.uploads):
    n = counts[row : row + len(u.client_ids)]
    row += len(u.client_ids)
    if not len(n):  # every client of the group was excluded
      continue
    n_max = max(1, int(n.max()))
    ids = jnp.asarray(u.client_ids)
    pmf = u.label_counts / np.maximum(u.label_counts.sum(1, keepdims=True), 1)
    log_pmf = jnp.log(jnp.asarray(pmf, jnp.float32))
    labels = jax.vmap(
      lambda c, lp: jax.random.categorical(jax.random.fold_in(key, 2 * c), lp, shape=(n_max,))
    )(ids, log_pmf)
    z = jax.vmap(
      lambda c: jax.random.truncated_normal(
        jax.random.fold_in(key, 2 * c + 1), -cfg.z_bound, cfg.z_bound, (n_max, g.module.latent)
      )
    )(ids)
    real = np.arange(n_max)[None, :] < n[:, None]
    parts.append(cvae_clients.generate(g.module, u, np.asarray(labels, np.int32), real, z, out_hw))
    latents.append(np.asarray(z)[real])
  images, labels, _ = cvae_clients.concat_generated(parts)
  # FedCVAE-Ens's decoders may differ in latent size (CVAE-large and CVAE-small); only
  # FedCVAE-KD reads the latents, and it refuses users of different latent sizes.
  widths = {z.shape[1] for z in latents}
  return images, labels, np.concatenate(latents) if len(widths) == 1 else None


def require_all_generative(ctx: RunContext, method: str) -> None:
  classifier_ids, _ = generative.split_clients(ctx)
  if len(classifier_ids):
    raise ConfigError(
      f'{method}: every client must train a CVAE, but client_models gives classifiers to '
      f'clients {classifier_ids.tolist()} (e.g. client_models = '
      "'cvae:size=large;cvae:size=small')"
    )


def train_local_cvaes(ctx: RunContext, c: FedCVAEConfig) -> generative.LocalCVAEs:
  return generative.local_cvaes(
    ctx,
    generative.CVAESettings(
      c.cvae_epochs,
      c.cvae_optimizer,
      c.cvae_lr,
      c.cvae_batch,
      c.cvae_recon,
      1.0,
      c.cvae_small_lr,
      c.same_init,
    ),
  )


def server_classifier(ctx: RunContext, c: FedCVAEConfig):
  """(the server classifier's random init, its trainer (Adam `lr`, CE), its evaluator)."""
  module = common.build_module(c.server_model or ctx.run.model, ctx.dataset)
  init = engine.commit(
    engine.init_model(
      module,
      ctx.dataset.input_shape,
      ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.STUDENT),
    )
  )
  trainer = FusionTrainer(module, engine.make_optimizer('adam', c.lr), lam=1.0)
  evaluator = engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy)
  return init, trainer, evaluator


def plot_samples(ctx: RunContext, images: np.ndarray, labels: np.ndarray, title: str) -> None:
  """Saves a grid of synthetic samples as synthetic_samples.png in the workdir (if any).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    images: Images [N, H, W, C] in [0, 1]; the first 64 are drawn.
    labels: Their labels, [N].
    title: The figure's title.
  """
  path = ctx.output_path('synthetic_samples.png')
  if path is not None and len(labels):
    distill_plots.plot_image_grid(path, images[:64], labels[:64], title=title)


def validate_common(c: FedCVAEConfig, where: str) -> None:
  tc.require_positive(
    c,
    where,
    ('cvae_epochs', 'cvae_lr', 'cvae_batch', 'num_synthetic', 'z_bound', 'epochs', 'lr', 'batch'),
  )
  tc.require_non_negative(c, where, ('cvae_small_lr',))
  tc.require_fraction(c.clean_rate, f'{where}.clean_rate')
  tc.require_choice(c.protocol, PROTOCOLS, f'{where}.protocol')
  tc.require_choice(c.cvae_optimizer, OPTIMIZERS, f'{where}.cvae_optimizer')
  tc.require_choice(c.cvae_recon, RECON_LOSSES, f'{where}.cvae_recon')


@register_method('fedcvae_ens')
class FedCVAEEns(Algorithm):
  """CVAE clients only; a server classifier trained from scratch on decoded samples."""

  section = 'fedcvae'
  Config = FedCVAEConfig
  step_name = 'epoch'

  def validate(self, config) -> None:
    validate_common(self.config, self.section)

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.epochs

  def setup(self, ctx: RunContext) -> FedCVAEAux:
    c = self.config
    require_all_generative(ctx, self.name)
    cvaes = train_local_cvaes(ctx, c)
    if c.protocol == 'fedmho':
      s = generative.fedmho_synthetic(ctx, cvaes, c.num_synthetic, c.clean_rate)
      generative.save_synthetic(ctx, s.images, s.labels, s.kept)
      images, labels, generated = s.images[s.kept], s.labels[s.kept], len(s.labels)
    else:
      images, labels, _ = synthesize(ctx, cvaes, c, c.num_synthetic)
      generative.save_synthetic(ctx, images, labels)
      generated = len(labels)
    init, trainer, evaluator = server_classifier(ctx, c)
    data = engine.commit(
      SyntheticSet(jnp.asarray(images, jnp.float32), jnp.asarray(labels, jnp.int32), None)
    )
    return FedCVAEAux(trainer, evaluator, cvaes, data, images, labels, init, generated)

  def setup_records(self, ctx: RunContext, aux: FedCVAEAux):
    return [
      {
        'round': 1,
        'clients': ctx.num_clients,
        'upload_bytes': aux.cvaes.upload_bytes,
        'synthetic_generated': aux.generated,
        'synthetic_kept': int(len(aux.labels)),
      }
    ]

  def init(self, ctx: RunContext, aux: FedCVAEAux) -> TrainState:
    return engine.commit(aux.trainer.init(aux.init))

  def step(self, ctx: RunContext, aux: FedCVAEAux, state: TrainState, i: int):
    """One epoch of training the server classifier on the decoded samples."""
    state, loss, accuracy = generative.fusion_epoch(
      ctx, aux.trainer, aux.evaluator, state, aux.data, self.config.batch, i
    )
    return state, [{'epoch': i + 1, 'test_accuracy': accuracy, 'train_loss': loss}]

  def summarize(self, ctx: RunContext, aux: FedCVAEAux, state: TrainState, history):
    """The run summary; also plots the decoded samples."""
    plot_samples(ctx, aux.images, aux.labels, 'decoded samples')
    return {
      'server_model': self.config.server_model or ctx.run.model,
      'client_models': list(ctx.federation.specs),
      'protocol': self.config.protocol,
      'synthetic_generated': aux.generated,
      'synthetic_kept': int(len(aux.labels)),
      'synthetic_per_class': np.bincount(aux.labels, minlength=ctx.dataset.num_classes).tolist(),
      'decoder_upload_bytes': aux.cvaes.upload_bytes,
      'excluded_cvae_clients': aux.cvaes.excluded,
    }


class DecoderDistillation(NamedTuple):
  """FedCVAE-KD's own keys: the server decoder distilled from the users' decoders (defaults: the
  reference's tuned Fashion-MNIST values, `github.com/ceh-2000/fed_cvae`,
  experiments/best_hyperparameters/fashion/fedvae.txt)."""

  server_decoder: str = 'cvae:size=v0'
  decoder_samples: int = 5000
  decoder_epochs: int = 7
  decoder_lr: float = 1e-2
  decoder_batch: int = 32


# `config.fedcvae` for FedCVAE-KD: FedCVAE-Ens's settings, then the decoder's (one flat section).
FedCVAEKDConfig = tc.concat('FedCVAEKDConfig', __name__, FedCVAEConfig, DecoderDistillation)


class FedCVAEKDAux:
  """The run's constants; the classifier's training set is decoded once the server decoder is
  distilled (step `decoder_epochs`) and cached here (rebuilt from the checkpoint on resume)."""

  def __init__(self, cvaes, targets, distiller, decoder_init, classifier, classifier_init):
    self.cvaes, self.targets, self.distiller = cvaes, targets, distiller
    self.decoder_init = decoder_init
    self.trainer, self.evaluator = classifier
    self.classifier_init = classifier_init
    self.classifier_data: Optional[Tuple[np.ndarray, np.ndarray]] = None


class FedCVAEKDState(NamedTuple):
  decoder: TrainState  # the server decoder (params, batch_stats) and its Adam state
  classifier: TrainState


@register_method('fedcvae_kd')
class FedCVAEKD(Algorithm):
  """FedCVAE-KD (`github.com/ceh-2000/fed_cvae`) in one round: the server decoder is distilled
  from the users' decoders, then decodes the server classifier's training set.

  Steps 1..`decoder_epochs`: epochs of the server decoder (`server_decoder`, a CVAE spec whose
  decoder part is used; the reference's is FedCVAE's own v0) on `decoder_samples` targets drawn
  from the users' decoders as FedCVAE-Ens draws its set (`jfed.cvae.decoder_kd`), Adam
  `decoder_lr`, batches of `decoder_batch`, starting from its random init (the reference's
  defaults should_avg = 0, should_fine_tune = 1). Then `num_synthetic` samples from the server
  decoder in eval mode, y uniform over the classes, z ~ N(0, I) truncated to ±`z_bound`, and
  steps `decoder_epochs`+1.. are the `epochs` epochs of the classifier from scratch (as Ens).
  """

  section = 'fedcvae'
  Config = FedCVAEKDConfig
  step_name = 'epoch'

  def validate(self, config) -> None:
    c = self.config
    validate_common(c, self.section)
    tc.require_positive(
      c, self.section, ('decoder_samples', 'decoder_epochs', 'decoder_lr', 'decoder_batch')
    )
    tc.require(
      cvae_clients.is_generative(c.server_decoder),
      f"{self.section}.server_decoder must be a CVAE spec ('cvae:...'), got {c.server_decoder!r}",
    )

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.decoder_epochs + self.config.epochs

  def setup(self, ctx: RunContext) -> FedCVAEKDAux:
    c = self.config
    require_all_generative(ctx, self.name)
    module = generative.build_cvae_spec(c.server_decoder, ctx.dataset)
    # refused before any client trains: the server decoder is fed the users' z
    specs = set(ctx.federation.specs)
    latents = {generative.build_cvae_spec(spec, ctx.dataset).latent for spec in specs}
    if latents != {module.latent}:
      raise ConfigError(
        f'{self.section}.server_decoder {c.server_decoder!r} has latent {module.latent}, but '
        f"the users' decoders have {sorted(latents)}: the server decoder is fed their z"
      )
    cvaes = train_local_cvaes(ctx, c)
    # The targets at the server decoder's own resolution (v0: 32×32, as the reference's).
    images, labels, z = synthesize(
      ctx, cvaes, c, c.decoder_samples, tag=1, out_hw=module.native_shape[:2]
    )
    targets = engine.commit(
      decoder_kd.DecoderTargets(
        jnp.asarray(z, jnp.float32), jnp.asarray(labels, jnp.int32), jnp.asarray(images)
      )
    )
    key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.GENERATOR)
    full = cvae_clients.init_cvae(module, ctx.dataset.input_shape, key)
    decoder_init = engine.commit(
      ModelState(full.params['decoder'], cvae_clients.decoder_stats_of(full))
    )
    distiller = decoder_kd.DecoderDistiller(module, engine.make_optimizer('adam', c.decoder_lr))
    init, trainer, evaluator = server_classifier(ctx, c)
    return FedCVAEKDAux(cvaes, targets, distiller, decoder_init, (trainer, evaluator), init)

  def setup_records(self, ctx: RunContext, aux: FedCVAEKDAux):
    return [
      {
        'round': 1,
        'clients': ctx.num_clients,
        'upload_bytes': aux.cvaes.upload_bytes,
        'decoder_targets': int(aux.targets.y.shape[0]),
      }
    ]

  def init(self, ctx: RunContext, aux: FedCVAEKDAux) -> FedCVAEKDState:
    return engine.commit(
      FedCVAEKDState(aux.distiller.init(aux.decoder_init), aux.trainer.init(aux.classifier_init))
    )

  def _classifier_data(self, ctx: RunContext, aux: FedCVAEKDAux, decoder: ModelState):
    if aux.classifier_data is None:
      c, n = self.config, self.config.num_synthetic
      key = jax.random.fold_in(
        ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.GENERATION), 2
      )
      k_y, k_z = jax.random.split(key)
      labels = jax.random.randint(k_y, (n,), 0, ctx.dataset.num_classes, jnp.int32)
      z = jax.random.truncated_normal(k_z, -c.z_bound, c.z_bound, (n, aux.distiller.module.latent))
      images = np.concatenate(
        [
          np.asarray(aux.distiller.decode(decoder, z[s : s + 1000], labels[s : s + 1000]))
          for s in range(0, n, 1000)
        ]
      )
      aux.classifier_data = (images, np.asarray(labels))
    return aux.classifier_data

  def step(self, ctx: RunContext, aux: FedCVAEKDAux, state: FedCVAEKDState, i: int):
    """One epoch of distilling the clients' decoders into the server decoder, or (after
    `decoder_epochs`) of training the classifier on its samples.
    """
    c = self.config
    if i < c.decoder_epochs:
      decoder, loss = aux.distiller.epoch(
        engine.commit(state.decoder),
        aux.targets,
        c.decoder_batch,
        np.random.default_rng((int(ctx.run.seed), 2, i)),
      )
      return state._replace(decoder=decoder), [{'epoch': i + 1, 'decoder_loss': loss}]
    images, labels = self._classifier_data(ctx, aux, state.decoder.model)
    data = SyntheticSet(jnp.asarray(images, jnp.float32), jnp.asarray(labels, jnp.int32), None)
    classifier, loss, accuracy = generative.fusion_epoch(
      ctx, aux.trainer, aux.evaluator, state.classifier, data, c.batch, i - c.decoder_epochs
    )
    record = {'epoch': i + 1, 'test_accuracy': accuracy, 'train_loss': loss}
    return state._replace(classifier=classifier), [record]

  def summarize(self, ctx: RunContext, aux: FedCVAEKDAux, state: FedCVAEKDState, history):
    """The run summary; also plots the server decoder's samples."""
    images, labels = self._classifier_data(ctx, aux, state.decoder.model)
    plot_samples(ctx, images, labels, 'server decoder samples')
    return {
      'server_model': self.config.server_model or ctx.run.model,
      'server_decoder': self.config.server_decoder,
      'client_models': list(ctx.federation.specs),
      'decoder_targets': int(aux.targets.y.shape[0]),
      'synthetic_generated': int(len(labels)),
      'decoder_upload_bytes': aux.cvaes.upload_bytes,
      'excluded_cvae_clients': aux.cvaes.excluded,
    }
