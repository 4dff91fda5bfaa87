"""FedCVAE-Ens (Heinbaugh et al., ICLR'23; ceh-2000/fed_cvae, reference-code.md §3.3–§3.4), the
baseline FedMHO calls FEDCVAE: every client trains a CVAE, the server decodes a synthetic set
from the uploaded decoders and trains a classifier from scratch on it, in one round.

Clients: every client's spec must be `cvae[:size=..]` (FedMHO Table 1: CVAE-large and
CVAE-small); each trains Eq. 3 for `cvae_epochs` (`jfed.methods.generative`) and uploads its
decoder and class counts (its data share n_k / N follows from the counts of all uploads).

Server (setup): decoder k generates n_k = int(share_k · N_syn) samples (`weight_by_share`,
reference default; else N_syn / K), the last decoder the remainder; labels y ~ Categorical(pmf_k),
z ~ N(0, I) truncated to [−z_bound, z_bound] (the reference's misnamed `uniform_range`, tuned to
(−3, 3)); x = sigmoid(decoder_k(z, y)). A step is one epoch of Adam(`lr`) cross entropy of a
randomly initialised `server_model` (default `config.model`) on that set, batches of `batch`.

Config (`config.fedcvae`): the fields of `FedCVAEConfig`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.cvae import clients as cvae_clients
from jfed.cvae.losses import RECON_LOSSES
from jfed.cvae.server import FusionTrainer, SyntheticSet
from jfed.driver import Algorithm
from jfed.engine import TrainState
from jfed.engine.optim import OPTIMIZERS
from jfed.errors import ConfigError
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import common, generative
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method


class FedCVAEConfig(NamedTuple):
  cvae_epochs: int
  cvae_optimizer: str
  cvae_lr: float
  cvae_batch: int
  cvae_recon: str
  num_synthetic: int
  z_bound: float
  weight_by_share: bool
  server_model: str
  epochs: int
  lr: float
  batch: int


class FedCVAEAux(NamedTuple):
  module: Any
  trainer: FusionTrainer
  evaluator: engine.Evaluator
  cvaes: generative.LocalCVAEs
  data: SyntheticSet
  images: np.ndarray
  labels: np.ndarray
  init: Any


def decoder_sample_counts(sizes: np.ndarray, total: int, weight_by_share: bool) -> np.ndarray:
  """Samples per decoder: int(n_k / N · total), or total // K; the last takes the remainder
  (`generate_dataset_from_user_decoders`)."""
  sizes = np.asarray(sizes, np.float64)
  if weight_by_share:
    counts = np.floor(sizes / sizes.sum() * total).astype(np.int64)
  else:
    counts = np.full(len(sizes), total // len(sizes), np.int64)
  counts[-1] = total - counts[:-1].sum()
  return counts


def synthesize(ctx: RunContext, cvaes: generative.LocalCVAEs, cfg: FedCVAEConfig):
  sizes = np.concatenate([u.label_counts.sum(1) for u in cvaes.uploads])
  counts = decoder_sample_counts(sizes, cfg.num_synthetic, cfg.weight_by_share)
  key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.GENERATION)
  parts, row = [], 0
  for g, u in zip(cvaes.groups, cvaes.uploads):
    n = counts[row : row + len(g.client_ids)]
    row += len(g.client_ids)
    n_max = max(1, int(n.max()))
    ids = jnp.asarray(g.client_ids)
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
    parts.append(cvae_clients.generate(g.module, u, np.asarray(labels, np.int32), real, z))
  images, labels, _ = cvae_clients.concat_generated(parts)
  return images, labels


@register_method('fedcvae_ens')
class FedCVAEEns(Algorithm):
  """CVAE clients only; a server classifier trained from scratch on decoded samples."""

  section = 'fedcvae'
  Config = FedCVAEConfig
  step_name = 'epoch'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(
      c,
      where,
      ('cvae_epochs', 'cvae_lr', 'cvae_batch', 'num_synthetic', 'z_bound', 'epochs', 'lr', 'batch'),
    )
    tc.require_choice(c.cvae_optimizer, OPTIMIZERS, f'{where}.cvae_optimizer')
    tc.require_choice(c.cvae_recon, RECON_LOSSES, f'{where}.cvae_recon')

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.epochs

  def setup(self, ctx: RunContext) -> FedCVAEAux:
    c = self.config
    classifier_ids, _ = generative.split_clients(ctx)
    if len(classifier_ids):
      raise ConfigError(
        f'{self.name}: every client must train a CVAE, but client_models gives classifiers to '
        f'clients {classifier_ids.tolist()} (e.g. client_models = '
        "'cvae:size=large;cvae:size=small')"
      )
    cvaes = generative.local_cvaes(
      ctx,
      generative.CVAESettings(
        c.cvae_epochs, c.cvae_optimizer, c.cvae_lr, c.cvae_batch, c.cvae_recon, 1.0
      ),
    )
    images, labels = synthesize(ctx, cvaes, c)
    module = common.build_module(c.server_model or ctx.config.model, ctx.dataset)
    init = engine.commit(
      engine.init_model(
        module,
        ctx.dataset.input_shape,
        ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.STUDENT),
      )
    )
    data = engine.commit(
      SyntheticSet(jnp.asarray(images, jnp.float32), jnp.asarray(labels, jnp.int32), None)
    )
    trainer = FusionTrainer(module, engine.make_optimizer('adam', c.lr), lam=1.0)
    evaluator = engine.Evaluator(module, ctx.config.eval_batch_size, ctx.config.strategy)
    return FedCVAEAux(module, trainer, evaluator, cvaes, data, images, labels, init)

  def setup_records(self, ctx: RunContext, aux: FedCVAEAux):
    return [
      {
        'round': 1,
        'clients': ctx.num_clients,
        'upload_bytes': aux.cvaes.upload_bytes,
        'synthetic_generated': int(len(aux.labels)),
      }
    ]

  def init(self, ctx: RunContext, aux: FedCVAEAux) -> TrainState:
    return engine.commit(aux.trainer.init(aux.init))

  def step(self, ctx: RunContext, aux: FedCVAEAux, state: TrainState, i: int):
    state, loss, accuracy = generative.fusion_epoch(
      ctx, aux.trainer, aux.evaluator, state, aux.data, self.config.batch, i
    )
    return state, [{'epoch': i + 1, 'test_accuracy': accuracy, 'train_loss': loss}]

  def summarize(self, ctx: RunContext, aux: FedCVAEAux, state: TrainState, history):
    path = ctx.output_path('synthetic_samples.png')
    if path is not None and len(aux.labels):
      from jfed.distill import plots  # pylint: disable=g-import-not-at-top

      plots.plot_image_grid(path, aux.images[:64], aux.labels[:64], title='decoded samples')
    return {
      'server_model': self.config.server_model or ctx.config.model,
      'client_models': common.client_model_specs(ctx),
      'synthetic_generated': int(len(aux.labels)),
      'synthetic_per_class': np.bincount(aux.labels, minlength=ctx.dataset.num_classes).tolist(),
      'decoder_upload_bytes': aux.cvaes.upload_bytes,
    }
