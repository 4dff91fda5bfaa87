"""FedMHO, FedMHO-MD and FedMHO-SD ("FedMHO: Heterogeneous One-Shot Federated Learning Towards
Resource-Constrained Edge Devices", Yao et al., WWW'26; reference YXShi2000/FedMHO): one-shot FL
with classifier clients and CVAE clients.

Clients (Algorithm 1, lines 3–7): a client whose spec is a classifier (VGG-9 in the paper)
trains it `local_epochs` epochs with the shared `config.optimizer` (Table 7: SGD 5e-3, momentum
0.9) and uploads it; a client whose spec is `cvae[:size=..]` trains a CVAE with Eq. 3
(`cvae_*` keys; Table 7: Adam 5e-2 for the MNIST family's CVAE-small) and uploads its decoder
and class counts. Each kind and architecture is one compiled group (`jfed.methods.generative`).

Server (setup, once):
1. the global model is the uniform mean of the classifier clients (Eq. 4; all of one
   architecture, which is also the global model's);
2. data generation (§4.2.2): per class, N_syn / C samples split over the decoders by
   n_kc² / Σ n_k'c² (`jfed.cvae.generation_counts`, the reference's weighting), z ~ N(0, I),
   each decoder group decoded in one vmapped call;
3. unsupervised data optimisation (Algorithm 2): per class, keep the R_th = `clean_rate`
   fraction nearest to the class mean (`clean_rate = 1` disables it; Table 4);
4. the teachers' logits on the kept set, computed once: FedMHO-MD the mean logits of the
   classifier clients (Eq. 5), FedMHO-SD the initial global model's (Eq. 6), FedMHO none.
A step is one global epoch (Table 7: 20 for FMNIST) of Adam(`lr`) on Eq. 7,
λ·CE + (1 − λ)·KL (λ = `lam`, 0.5; FedMHO: CE only), batches of `batch` (64) in a seeded order.

`kl_reduction`: 'mean' (default) is the reference's `nn.KLDivLoss()` default reduction, the KL
summed over the batch and classes / (B·C) (YXShi2000/FedMHO:pcode/aggregation/semi_supervised.py,
whose loss CE + KL is λ = 0.5 here up to a factor 2 that Adam does not see); 'batchmean' is the
paper's KL summed over classes / B, C times the reference's weight.

Config (`config.fedmho`): the fields of `FedMHOConfig`.
"""

from typing import Any, Dict, List, NamedTuple

from absl import logging
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.cvae import plots as cvae_plots
from jfed.cvae.losses import RECON_LOSSES
from jfed.cvae.server import FusionTrainer, SyntheticSet
from jfed.engine import ModelState, TrainState
from jfed.engine.optim import OPTIMIZERS
from jfed.errors import ConfigError
from jfed.methods import common, generative
from jfed.methods.registry import register_method

KL_REDUCTIONS = ('batchmean', 'mean')


class FedMHOConfig(NamedTuple):
  local_epochs: int = 200
  cvae_epochs: int = 40
  cvae_optimizer: str = 'adam'
  cvae_lr: float = 5e-2
  cvae_batch: int = 64
  cvae_recon: str = 'bce'
  num_synthetic: int = 6000
  clean_rate: float = 0.8
  epochs: int = 20
  lr: float = 5e-4
  batch: int = 64
  lam: float = 0.5
  kl_reduction: str = 'mean'  # the reference's nn.KLDivLoss() ('batchmean': the paper's sum)


class FedMHOAux(NamedTuple):
  spec: str  # the classifiers' (and global model's) architecture
  trainer: FusionTrainer
  evaluator: engine.Evaluator
  local: common.LocalModels
  cvaes: generative.LocalCVAEs
  synthetic: generative.Synthetic
  data: SyntheticSet  # the kept set with its teacher logits, on the device
  initial: ModelState
  initial_accuracy: float


class _FedMHOBase(Algorithm):
  section = 'fedmho'
  Config = FedMHOConfig
  step_name = 'epoch'
  teacher = 'none'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(
      c,
      where,
      (
        'local_epochs',
        'cvae_epochs',
        'cvae_lr',
        'cvae_batch',
        'num_synthetic',
        'epochs',
        'lr',
        'batch',
      ),
    )
    tc.require_fraction(c.clean_rate, f'{where}.clean_rate')
    tc.require(0.0 <= c.lam <= 1.0, f'{where}.lam must be in [0, 1], got {c.lam}')
    tc.require_choice(c.cvae_optimizer, OPTIMIZERS, f'{where}.cvae_optimizer')
    tc.require_choice(c.cvae_recon, RECON_LOSSES, f'{where}.cvae_recon')
    tc.require_choice(c.kl_reduction, KL_REDUCTIONS, f'{where}.kl_reduction')

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.epochs

  def cvae_settings(self) -> generative.CVAESettings:
    c = self.config
    return generative.CVAESettings(
      c.cvae_epochs, c.cvae_optimizer, c.cvae_lr, c.cvae_batch, c.cvae_recon, 1.0
    )

  def setup(self, ctx: RunContext) -> FedMHOAux:
    c = self.config
    classifier_ids, generative_ids = generative.split_clients(ctx)
    specs = sorted({ctx.federation.specs[k] for k in classifier_ids})
    if len(specs) != 1 or not len(generative_ids):
      raise ConfigError(
        f'{self.name} needs classifier clients of one architecture and at least one CVAE '
        f'client; client_models gives classifiers {specs} and {len(generative_ids)} CVAE '
        "client(s) (e.g. client_models = 'vgg9;cvae:size=small')"
      )
    local = common.local_models(ctx, c.local_epochs, classifier_ids)
    cvaes = generative.local_cvaes(ctx, self.cvae_settings())
    group, models = local.groups[0], local.models[0]
    initial = engine.commit(engine.weighted_average(models, np.ones(len(group.client_ids))))
    synthetic = generative.fedmho_synthetic(ctx, cvaes, c.num_synthetic, c.clean_rate)
    generative.save_synthetic(ctx, synthetic.images, synthetic.labels, synthetic.kept)
    x = synthetic.images[synthetic.kept]
    evaluator = engine.Evaluator(group.module, ctx.run.eval_batch_size, ctx.run.strategy)
    teacher = None
    if self.teacher == 'clients':
      teacher = np.mean(evaluator.group_logits(models, x), axis=0)
    elif self.teacher == 'initial':
      teacher = evaluator.logits(initial, x)
    data = engine.commit(
      SyntheticSet(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(synthetic.labels[synthetic.kept], jnp.int32),
        None if teacher is None else jnp.asarray(teacher, jnp.float32),
      )
    )
    tx = engine.make_optimizer('adam', c.lr)
    lam = 1.0 if self.teacher == 'none' else c.lam
    trainer = FusionTrainer(group.module, tx, lam, c.kl_reduction)
    initial_accuracy = evaluator.accuracy(initial, ctx.dataset.test_x, ctx.dataset.test_y)
    logging.info(
      '%s: %d synthetic samples generated, %d kept; initial global model %.4f',
      self.name,
      len(synthetic.labels),
      len(synthetic.kept),
      initial_accuracy,
    )
    return FedMHOAux(
      group.spec,
      trainer,
      evaluator,
      local,
      cvaes,
      synthetic,
      data,
      initial,
      initial_accuracy,
    )

  def setup_records(self, ctx: RunContext, aux: FedMHOAux) -> List[Dict[str, Any]]:
    return [
      {
        'round': 1,
        'clients': ctx.num_clients,
        'upload_bytes': aux.local.upload_bytes + aux.cvaes.upload_bytes,
        'classifier_upload_bytes': aux.local.upload_bytes,
        'decoder_upload_bytes': aux.cvaes.upload_bytes,
        'initial_test_accuracy': aux.initial_accuracy,
        'synthetic_generated': int(len(aux.synthetic.labels)),
        'synthetic_kept': int(len(aux.synthetic.kept)),
      }
    ]

  def init(self, ctx: RunContext, aux: FedMHOAux) -> TrainState:
    return engine.commit(aux.trainer.init(aux.initial))

  def step(self, ctx: RunContext, aux: FedMHOAux, state: TrainState, i: int):
    state, loss, accuracy = generative.fusion_epoch(
      ctx, aux.trainer, aux.evaluator, state, aux.data, self.config.batch, i
    )
    return state, [{'epoch': i + 1, 'test_accuracy': accuracy, 'fusion_loss': loss}]

  def summarize(self, ctx: RunContext, aux: FedMHOAux, state: TrainState, history):
    self._plot_samples(ctx, aux.synthetic)
    counts = np.bincount(
      aux.synthetic.labels[aux.synthetic.kept], minlength=ctx.dataset.num_classes
    )
    return {
      'teacher': self.teacher,
      'initial_test_accuracy': aux.initial_accuracy,
      'global_model': aux.spec,
      'client_models': list(ctx.federation.specs),
      'classifier_client_test_accuracy': dict(
        zip(
          [int(k) for k in aux.local.groups[0].client_ids],
          aux.evaluator.group_accuracy(
            aux.local.models[0], ctx.dataset.test_x, ctx.dataset.test_y
          ).tolist(),
        )
      ),
      'synthetic_generated': int(len(aux.synthetic.labels)),
      'synthetic_kept': int(len(aux.synthetic.kept)),
      'synthetic_kept_per_class': counts.tolist(),
      'classifier_upload_bytes': aux.local.upload_bytes,
      'decoder_upload_bytes': aux.cvaes.upload_bytes,
      'excluded_cvae_clients': aux.cvaes.excluded,
      'clean_rate': self.config.clean_rate,
    }

  def _plot_samples(self, ctx: RunContext, s: generative.Synthetic) -> None:
    path = ctx.output_path('synthetic_samples.png')
    if path is None or not len(s.labels):
      return
    cvae_plots.plot_filter_grid(path, s.images, s.labels, s.kept, ctx.dataset.num_classes)


@register_method('fedmho')
class FedMHO(_FedMHOBase):
  """Eq. 4 init, CVAE-generated data, CE only (no answer to knowledge forgetting)."""

  teacher = 'none'


@register_method('fedmho_md')
class FedMHOMD(_FedMHOBase):
  """FedMHO + KL towards the mean logits of the classifier clients (Eq. 5, 7)."""

  teacher = 'clients'


@register_method('fedmho_sd')
class FedMHOSD(_FedMHOBase):
  """FedMHO + KL towards the initial (Eq. 4) global model (Eq. 6, 7)."""

  teacher = 'initial'
