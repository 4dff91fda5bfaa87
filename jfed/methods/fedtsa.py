"""FedTSA (Fan, Wu, Su, Hui, ECCV 2024, arXiv 2407.05098): clients clustered by how fast their
devices are, a width-pruned model per cluster, FedAvg inside each cluster (Stage 1) and deep
mutual learning of the cluster models on diffusion-generated images at the server (Stage 2). No
public code exists: the paper is the specification.

Setup (once per run; every part cached in the workdir, so a resumed run sees the same clusters
and images):
1. Resource profiling (§4.3, `jfed.profiling`): each client's duration on the proxy task (a
   one-hidden-layer MLP on `proxy_samples` images of the dataset). Simulated clients share this
   machine, so `profile`:
   - 'simulated' (default): the task is timed here once (median of `proxy_repeats` runs) and
     every client's duration is that time × its device class's slow-down × seeded lognormal
     jitter (σ = `jitter`); device classes come from `device_rates` and `device_shares` (the
     paper's 1.0/0.8/0.6 for 20/40/40 %: a device r times as fast trains a model r times as
     wide). The clustering is then a function of the seed (the KDE's bandwidth factor and the
     rates are scale-free).
   - 'measured': every client runs the task here (its own median time) × slow-down × jitter.
   - 'file': durations measured on real devices (`durations_file`), used as they are.
2. KDE clustering (Eqs. 2–4): Gaussian KDE of the durations on the axis `kde_space` ('log'
   seconds by default, or 'duration'), bandwidth `bandwidth` ('scott', 'silverman' or a factor
   of the standard deviation, scipy's `bw_method`) but at least `kde_min_bandwidth`; its local
   minima split the clients; cluster k's pruning rate is the fastest cluster's mean duration
   over its own, rounded to `rate_quantum`. The figure `kde_clusters.png` shows the density,
   boundaries and clients.
3. Models: cluster k trains `config.model` (a ResNet-18 or MLP, whose `width_mult` scales every
   hidden layer to ⌈rate · channels⌉ while the classifier keeps all classes) at width_mult ×
   rate_k: one compiled client group per cluster.
4. Stage-2 images (§4.4): each client uploads one prompt per class of its task
   (`prompt_template`, "a photo of real {class}"); the server's prompt pool is their union, and
   the image source (`source`) makes `images_per_prompt` images of each prompt:
   - 'ddpm' (default): a class-conditional DDPM in Flax (`jfed.diffusion.train`), trained once
     on `holdout_size` labelled images of `holdout` ('holdout': training samples held out of
     every client by `dataset.holdout_size`; or another dataset's training split; never the
     test split), cached in `ddpm_cache` (default `<workdir>/ddpm.msgpack`) and reused by later
     runs with the same settings and data; each prompt is mapped to its class;
   - 'pipeline': a Stable-Diffusion-style pipeline from the local directory `pipeline_dir`
     (`jfed.diffusion.local_pipeline`, the paper's SD v1-4; the `diffusion` extra);
   - 'public': those held-out images themselves, `images_per_prompt` of each prompt's class.
   A grid of the images is written to `stage2_images.png`, and the images with their prompts'
   classes to `synthetic.npz` (`experiments.generator_check` scores them).

Each round (`participation` of the clients, seeded):
- Stage 1: inside every cluster, the selected members train the cluster model for
  `local_epochs` epochs (config.optimizer, fresh per round), upload it (validated, bytes
  counted) and the server averages them weighted by client size (FedAvg); a cluster none of
  whose members was selected keeps its model;
- `bn_stats`: each aggregated cluster model's BatchNorm running statistics are 'averaged'
  (default: the members' running statistics averaged like the weights; the paper says nothing of
  BatchNorm) or 'recomputed' on the cluster members' training images (`common.BN_STATS`);
- Stage 2 (`stage2`, skipped with a single cluster): the cluster models learn from each other
  on the Stage-2 images for `global_epochs` epochs (`jfed.distill.mutual`): per batch of
  `stage2_batch` the consensus is the mean of all cluster models' logits (Eq. 7) and each model
  takes one step of KL(softmax(z̄/T) ‖ softmax(z/T)) (Eqs. 6, 8; `temperature` T = 5), or
  `kl_weight`·KL + (1 − `kl_weight`)·CE on the prompts' classes (Eq. 9); optimiser
  config.optimizer's at `stage2_lr` (0: config.optimizer.lr). The forward passes are in train
  mode (BatchNorm on each batch's statistics); `stage2_bn_stats` says what happens to the
  cluster models' running statistics: 'keep' (default: the Stage-1 averages of the clients'
  statistics; the paper says nothing of BatchNorm, so Stage 2 changes parameters only) or
  'recalibrate' (each train-mode step's running-average update on the Stage-2 images is kept,
  so after an epoch they are mostly statistics of those images);
- every cluster model is scored on the whole test split. `test_accuracy` is the reported
  model's (`reported_model`): 'widest' (default: the rate-1.0 cluster's unpruned model, the
  counterpart of the other methods' server model; the paper defines no mean over clusters) or
  'client_weighted' (the mean over clients of their cluster model's accuracy);
  `cluster_test_accuracy` lists each cluster's, fastest (widest) first, and
  `client_weighted_test_accuracy` is always recorded.

Defaults are the paper's (§5.1): 100 rounds, T = 5, 1 global epoch, KL-only, 200 images per
prompt, rates 1.0/0.8/0.6 for 20/40/40 % of the clients. Not stated by the paper, and chosen
here: the Stage-2 optimiser and batch (the clients' optimiser, batch 100 as the clients');
whether "200 images" is per prompt or in total (per prompt here: 200 images in total would be
20 per class on CIFAR-10); the KDE's axis and bandwidth (log durations, factor 0.1, at least
0.05: the one setting measured to recover every Table 4 degree's device classes, see
docs/fedtsa.md, "KDE clustering"); BatchNorm in Stage 2 and the reported model (above).

Config (`config.fedtsa`): the fields of `FedTSAConfig`.
"""

import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data import class_names, federate
from jfed.data.public import PublicData, check_holdout_fits, public_data
from jfed.diffusion import (
  PromptPool,
  PublicImageSource,
  SyntheticImages,
  build_prompt_pool,
  class_prompts,
)
from jfed.diffusion import train as ddpm_train
from jfed.diffusion.local_pipeline import LocalDiffusionSource, write_class_grid
from jfed.distill.mutual import MutualLearner, MutualLearningConfig
from jfed.engine import ModelState
from jfed.errors import ConfigError
from jfed.io import serialized_nbytes
from jfed.io import synthetic as synthetic_io
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method
from jfed.profiling import (
  KDE_SPACES,
  ClientDurations,
  KDEClusters,
  ProxyTask,
  kde_clusters,
  measured_durations,
  profile_from_rates,
  read_durations,
  simulated_durations,
)
from jfed.profiling.plots import plot_kde

PROFILES = ('simulated', 'measured', 'file')
SOURCES = ('ddpm', 'pipeline', 'public')
STAGE2_BN_STATS = ('keep', 'recalibrate')
REPORTED_MODELS = ('widest', 'client_weighted')
# Models whose `width_mult` prunes every hidden layer and keeps the classes.
PRUNABLE_MODELS = ('resnet18', 'mlp')


class FedTSAConfig(NamedTuple):
  rounds: int = 100
  local_epochs: int = 100
  participation: float = 1.0
  # Resource profiling and clustering.
  profile: str = 'simulated'
  durations_file: str = ''
  device_rates: str = '1.0,0.8,0.6'
  device_shares: str = '0.2,0.4,0.4'
  jitter: float = 0.02
  proxy_samples: int = 1000
  proxy_repeats: int = 3
  bandwidth: str = '0.1'
  kde_space: str = 'log'
  kde_min_bandwidth: float = 0.05
  rate_quantum: float = 0.1
  # Stage 2.
  stage2: bool = True
  global_epochs: int = 1
  temperature: float = 5.0
  kl_weight: float = 1.0
  stage2_lr: float = 0.0
  stage2_batch: int = 100
  stage2_bn_stats: str = 'keep'  # 'recalibrate': keep Stage 2's running-statistics updates
  bn_stats: str = 'averaged'  # Stage 1's: or 'recomputed' (common.BN_STATS)
  reported_model: str = 'widest'  # or 'client_weighted' (mean over clients of their cluster's)
  # Stage-2 images.
  source: str = 'ddpm'
  images_per_prompt: int = 200
  prompt_template: str = 'a photo of real {}'
  holdout: str = 'holdout'
  holdout_size: int = 2000
  ddpm_steps: int = 1000
  ddpm_timesteps: int = 100
  ddpm_channels: int = 16
  ddpm_batch: int = 64
  ddpm_lr: float = 2e-3
  ddpm_guidance: float = 1.0
  ddpm_cache: str = ''
  pipeline_dir: str = ''
  pipeline_steps: int = 50
  pipeline_guidance: float = 7.5


def parse_floats(text: str, where: str) -> Tuple[float, ...]:
  try:
    values = tuple(float(v) for v in str(text).replace(';', ',').split(',') if v.strip())
  except ValueError:
    raise ConfigError(f'{where} must be comma-separated numbers, got {text!r}') from None
  if not values:
    raise ConfigError(f'{where} is empty')
  return values


def parse_bandwidth(text: str):
  """'scott' | 'silverman' | a positive factor of the durations' standard deviation."""
  text = str(text).strip().lower()
  if text in ('scott', 'silverman'):
    return text
  try:
    factor = float(text)
  except ValueError:
    factor = -1.0
  if not factor > 0:
    raise ConfigError(
      f"fedtsa.bandwidth must be 'scott', 'silverman' or a factor > 0, got {text!r}"
    )
  return factor


def cluster_spec(model: str, rate: float) -> str:
  """`model` at width_mult × rate, e.g. ('resnet18:width_mult=0.5', 0.6) -> width_mult=0.3."""
  name, kwargs = common.parse_model_spec(model)
  if name.lower() not in PRUNABLE_MODELS:
    raise ConfigError(
      f'fedtsa prunes the width of {", ".join(PRUNABLE_MODELS)}; config.model is {model!r}'
    )
  kwargs['width_mult'] = float(kwargs.get('width_mult', 1.0)) * float(rate)
  args = ','.join(f'{k}={v:.6g}' if isinstance(v, float) else f'{k}={v}' for k, v in kwargs.items())
  return f'{name}:{args}'


class FedTSAAux(NamedTuple):
  durations: ClientDurations
  clusters: KDEClusters
  groups: List[common.ClientGroup]  # one per cluster, fastest first
  trainers: List[engine.GroupTrainer]
  templates: List[ModelState]  # what each cluster's uploads must look like
  init: Tuple[ModelState, ...]
  evaluators: List[engine.Evaluator]
  eval_x: np.ndarray
  eval_y: np.ndarray
  pool: Optional[PromptPool]
  images: Optional[SyntheticImages]
  learner: Optional[MutualLearner]
  setup_record: Dict[str, Any]
  server: common.Server  # attack simulation, validation and the in-cluster aggregation rule
  bn: List[Optional[common.BatchNormRecompute]]  # per cluster; None: bn_stats='averaged'


@register_method('fedtsa')
class FedTSA(Algorithm):
  """KDE clusters of device speed, pruned model per cluster, in-cluster FedAvg, server DML."""

  section = 'fedtsa'
  server_round = True
  label_flip_unsupported = "it builds its cluster groups from the clients' unflipped data"
  Config = FedTSAConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(
      c,
      where,
      ('rounds', 'local_epochs', 'global_epochs', 'temperature', 'stage2_batch', 'proxy_samples'),
    )
    tc.require_positive(c, where, ('proxy_repeats', 'images_per_prompt'))
    tc.require_non_negative(c, where, ('jitter', 'rate_quantum', 'stage2_lr', 'kde_min_bandwidth'))
    tc.require_choice(c.kde_space, KDE_SPACES, f'{where}.kde_space')
    tc.require_fraction(c.participation, f'{where}.participation')
    tc.require(0.0 <= c.kl_weight <= 1.0, f'{where}.kl_weight must be in [0, 1], got {c.kl_weight}')
    tc.require_choice(c.profile, PROFILES, f'{where}.profile')
    tc.require_choice(c.source, SOURCES, f'{where}.source')
    tc.require_choice(c.stage2_bn_stats, STAGE2_BN_STATS, f'{where}.stage2_bn_stats')
    tc.require_choice(c.bn_stats, common.BN_STATS, f'{where}.bn_stats')
    tc.require_choice(c.reported_model, REPORTED_MODELS, f'{where}.reported_model')
    tc.require(
      c.profile != 'file' or bool(c.durations_file),
      f"{where}.profile='file' needs {where}.durations_file",
    )
    if c.profile != 'file':
      profile_from_rates(
        parse_floats(c.device_rates, f'{where}.device_rates'),
        parse_floats(c.device_shares, f'{where}.device_shares'),
      )
    parse_bandwidth(c.bandwidth)
    tc.require('{}' in c.prompt_template, f'{where}.prompt_template must contain {{}}')
    if c.source in ('ddpm', 'public'):
      tc.require_positive(c, where, ('holdout_size',))
      check_holdout_fits(config, c.holdout, c.holdout_size, f'{where}.holdout')
    if c.stage2 and c.source == 'ddpm':
      tc.require_positive(
        c, where, ('ddpm_steps', 'ddpm_timesteps', 'ddpm_channels', 'ddpm_batch', 'ddpm_lr')
      )
    if c.stage2 and c.source == 'pipeline':
      tc.require(bool(c.pipeline_dir), f"{where}.source='pipeline' needs {where}.pipeline_dir")
    cluster_spec(config.model, 1.0)

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  # Setup.

  def _durations(self, ctx: RunContext) -> ClientDurations:
    c, ds, n = self.config, ctx.dataset, ctx.num_clients
    if c.profile == 'file':
      return read_durations(c.durations_file, n)
    profile = profile_from_rates(  # validate() refused bad lists already, with these names
      parse_floats(c.device_rates, 'fedtsa.device_rates'),
      parse_floats(c.device_shares, 'fedtsa.device_shares'),
    )
    seed = int(ctx.run.seed)

    def measure() -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
      k = min(int(c.proxy_samples), len(ds.train_y))
      task = ProxyTask(ds.train_x[:k], ds.train_y[:k], ds.num_classes, seed=seed)
      if c.profile == 'measured':
        d = measured_durations(task, n, profile, seed, c.proxy_repeats, c.jitter)
      else:
        d = simulated_durations(task.seconds(c.proxy_repeats), n, profile, c.jitter, seed)
      logging.info('fedtsa: proxy task %.4fs here; durations %s', d.base_seconds, d.durations)
      return d.durations, d.device_class.astype(np.float64), np.array([d.base_seconds])

    template = (np.zeros(n), np.zeros(n), np.zeros(1))
    durations, classes, base = ctx.stage('fedtsa_profile', 0, template, measure)
    return ClientDurations(
      np.asarray(durations, np.float64),
      float(np.asarray(base)[0]),
      np.asarray(classes).astype(np.int64),
      c.profile,
    )

  def _holdout(self, ctx: RunContext) -> Optional[PublicData]:
    c = self.config
    if c.source == 'pipeline' or not c.stage2:
      return None
    return public_data(ctx.dataset, c.holdout, c.holdout_size, int(ctx.run.seed))

  def _prompt_pool(self, ctx: RunContext) -> Tuple[PromptPool, int]:
    """Every client uploads one prompt per class of its task; returns the pool and the bytes."""
    ds = ctx.dataset
    names = class_names(ds.name, ds.num_classes)
    uploads = [class_prompts(names, self.config.prompt_template)] * ctx.num_clients
    nbytes = sum(len('\n'.join(u).encode()) for u in uploads)
    return build_prompt_pool(uploads, names), nbytes

  def _image_source(
    self, ctx: RunContext, holdout: Optional[PublicData]
  ) -> Tuple[Any, Dict[str, Any]]:
    """The Stage-2 image source and its record fields (the DDPM's training, when it trains)."""
    c, ds = self.config, ctx.dataset
    if c.source == 'public':
      return PublicImageSource(holdout.x, holdout.y), {}
    if c.source == 'pipeline':
      source = LocalDiffusionSource(
        c.pipeline_dir,
        ds.input_shape,
        num_inference_steps=c.pipeline_steps,
        guidance_scale=c.pipeline_guidance,
      )
      return source, {}
    if np.max(holdout.y) >= ds.num_classes:
      raise ConfigError(
        f'fedtsa.holdout={c.holdout!r} has labels beyond the {ds.num_classes} classes of {ds.name}'
      )
    cfg = ddpm_train.DDPMConfig(
      timesteps=c.ddpm_timesteps,
      base_channels=c.ddpm_channels,
      steps=c.ddpm_steps,
      batch=c.ddpm_batch,
      lr=c.ddpm_lr,
      guidance=c.ddpm_guidance,
    )
    own_cache = ctx.output_path('ddpm.msgpack')
    cache = c.ddpm_cache or (str(own_cache) if own_cache is not None else None)
    start = time.perf_counter()
    key = ctx.derive_key(Purpose.DIFFUSION)
    if cache:
      params, loaded = ddpm_train.load_or_train(
        cache, holdout.x, holdout.y, ds.num_classes, cfg, key
      )
    else:
      params, loaded = ddpm_train.train_ddpm(holdout.x, holdout.y, ds.num_classes, cfg, key), False
    fields = {
      'ddpm_loaded_from_cache': bool(loaded),
      'ddpm_seconds': time.perf_counter() - start,
      'ddpm_training_images': int(len(holdout.y)),
    }
    return ddpm_train.DDPMImageSource(params, cfg, ds.num_classes, ds.input_shape), fields

  def _images(
    self, ctx: RunContext, pool: PromptPool, holdout
  ) -> Tuple[SyntheticImages, Dict[str, Any]]:
    """The Stage-2 images (a stage: cached) and the record fields of their making (none when
    they came from the stage cache)."""
    c, ds = self.config, ctx.dataset
    n = len(pool.prompts) * c.images_per_prompt
    template = SyntheticImages(np.zeros((n, *ds.input_shape), np.float32), np.zeros((n,), np.int32))
    fields: Dict[str, Any] = {}

    def generate() -> SyntheticImages:
      source, made = self._image_source(ctx, holdout)
      start = time.perf_counter()
      images = source.generate(pool, c.images_per_prompt, ctx.derive_key(Purpose.STAGE2_IMAGES))
      fields.update(made, generation_seconds=time.perf_counter() - start)
      if hasattr(source, 'close'):
        source.close()
      return SyntheticImages(
        np.asarray(images.images, np.float32), np.asarray(images.labels, np.int32)
      )

    # The tag names what the images depend on besides the workdir's config.
    tag = SOURCES.index(c.source) * 1_000_000 + c.images_per_prompt
    images = ctx.stage('fedtsa_images', tag, template, generate)
    if images.images.shape != template.images.shape:
      raise ConfigError(
        f'the Stage-2 source gave images of shape {images.images.shape[1:]}, '
        f'not the task shape {ds.input_shape}'
      )
    return images, fields

  def setup(self, ctx: RunContext) -> FedTSAAux:
    c, cfg, ds = self.config, ctx.run, ctx.dataset
    durations = self._durations(ctx)
    clusters = kde_clusters(
      durations.durations,
      parse_bandwidth(c.bandwidth),
      quantum=c.rate_quantum,
      space=c.kde_space,
      min_bandwidth=c.kde_min_bandwidth,
    )
    groups = []
    for k, rate in enumerate(clusters.rates):
      spec = cluster_spec(cfg.model, rate)
      members = np.flatnonzero(clusters.assignments == k)
      fed = federate(ds.train_x, ds.train_y, [ctx.parts[j] for j in members])
      groups.append(common.ClientGroup(spec, common.build_module(spec, ds), members, fed))
    init = tuple(
      engine.commit(
        engine.init_model(g.module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, k))
      )
      for k, g in enumerate(groups)
    )
    record: Dict[str, Any] = {
      'stage': 'profiling and clustering',
      'proxy_seconds': durations.base_seconds,
      'client_durations': durations.durations.tolist(),
      'cluster_of_client': clusters.assignments.tolist(),
      'cluster_rates': clusters.rates.tolist(),
      'cluster_sizes': [len(g.client_ids) for g in groups],
      'cluster_models': [g.spec for g in groups],
      'kde_bandwidth': clusters.bandwidth,
    }
    logging.info(
      'fedtsa: %d clusters, rates %s, sizes %s',
      len(groups),
      record['cluster_rates'],
      record['cluster_sizes'],
    )
    kde_path = ctx.output_path('kde_clusters.png')
    if kde_path is not None:
      plot_kde(clusters, durations.durations, str(kde_path))
    holdout = self._holdout(ctx)
    pool, images, learner = None, None, None
    if c.stage2 and len(groups) > 1:
      pool, prompt_bytes = self._prompt_pool(ctx)
      record['prompt_upload_bytes'] = prompt_bytes
      record['upload_bytes'] = prompt_bytes
      images, fields = self._images(ctx, pool, holdout)
      record.update(fields)
      record['stage2_images'] = int(len(images.labels))
      grid_path = ctx.output_path('stage2_images.png')
      if grid_path is not None:
        write_class_grid(images, str(grid_path))
      synthetic_io.save_synthetic(
        ctx.output_path(synthetic_io.SYNTHETIC_FILE), images.images, images.labels
      )
      o = cfg.optimizer
      tx = engine.build_optimizer(o._replace(lr=c.stage2_lr or o.lr, schedule='constant'))
      learner = MutualLearner(
        [g.module for g in groups],
        tx,
        MutualLearningConfig(
          temperature=c.temperature,
          kl_weight=c.kl_weight,
          keep_running_stats=c.stage2_bn_stats == 'keep',
        ),
      )
    return FedTSAAux(
      durations=durations,
      clusters=clusters,
      groups=groups,
      trainers=common.make_trainers(ctx, groups),
      templates=list(init),
      init=init,
      evaluators=[engine.Evaluator(g.module, cfg.eval_batch_size, cfg.strategy) for g in groups],
      eval_x=ds.test_x,
      eval_y=ds.test_y,
      pool=pool,
      images=images,
      learner=learner,
      setup_record=record,
      server=common.make_server(ctx),
      bn=[common.bn_recompute(ctx, g.module, g.client_ids, c.bn_stats) for g in groups],
    )

  def setup_records(self, ctx: RunContext, aux: FedTSAAux) -> List[Dict[str, Any]]:
    return [aux.setup_record]

  def init(self, ctx: RunContext, aux: FedTSAAux) -> Tuple[ModelState, ...]:
    return aux.init

  # Rounds.

  def _stage2(
    self, ctx: RunContext, aux: FedTSAAux, models: List[ModelState], i: int
  ) -> Tuple[List[ModelState], float]:
    c = self.config
    x, y = jnp.asarray(aux.images.images), jnp.asarray(aux.images.labels)
    states = aux.learner.init(models)
    losses = []
    for e in range(c.global_epochs):
      key = ctx.derive_key(Purpose.SERVER, i + 1, e)
      rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).astype(np.uint32))
      states, loss = aux.learner.epoch(states, x, y, c.stage2_batch, rng)
      losses.append(loss)
    return [s.model for s in states], float(np.mean(losses))

  def cluster_accuracies(self, aux: FedTSAAux, models) -> np.ndarray:
    return np.array(
      [ev.accuracy(m, aux.eval_x, aux.eval_y) for ev, m in zip(aux.evaluators, models)]
    )

  def step(
    self, ctx: RunContext, aux: FedTSAAux, state: Tuple[ModelState, ...], i: int
  ) -> Tuple[Tuple[ModelState, ...], List[Dict[str, Any]]]:
    """One FedTSA round: each cluster's selected clients train and are aggregated (stage 1), then
    the cluster models learn from each other by distillation (stage 2).
    """
    c = self.config
    selected = common.select_clients(
      ctx.derive_key(Purpose.SAMPLING, i), ctx.num_clients, c.participation
    )
    models, losses, upload_bytes, rejected = [], [], 0, 0
    for k, (g, trainer, model) in enumerate(zip(aux.groups, aux.trainers, state)):
      taking_part = np.isin(g.client_ids, selected)
      if not taking_part.any():  # no member of this cluster takes part: its model waits
        models.append(model)
        continue
      round_group = common.sitting_out_as_size_zero(g, taking_part)
      (trained,), (metrics,) = common.train_groups(
        [trainer],
        [round_group],
        [engine.replicate(model, len(g.client_ids))],
        c.local_epochs,
        ctx.derive_key(Purpose.ROUNDS, i, k),
        label=f'round {i + 1}/{c.rounds} cluster {k} (rate {aux.clusters.rates[k]:g})',
      )
      aggregate, received = aux.server.receive(
        round_group, trained, model, aux.templates[k], i, taking_part=taking_part, part=k
      )
      upload_bytes += received['upload_bytes']
      rejected += received['rejected_uploads']
      if aux.bn[k] is not None and aggregate.batch_stats:
        aggregate = aux.bn[k](aggregate)
      models.append(aggregate)
      losses.extend(np.asarray(metrics.loss)[taking_part, -1].tolist())
    record: Dict[str, Any] = {'round': i + 1}
    if aux.learner is not None:
      record['stage1_cluster_test_accuracy'] = self.cluster_accuracies(aux, models).tolist()
      models, record['stage2_loss'] = self._stage2(ctx, aux, models, i)
    accuracy = self.cluster_accuracies(aux, models)
    sizes = np.array([len(g.client_ids) for g in aux.groups], np.float64)
    client_weighted = float(np.sum(accuracy * sizes) / np.sum(sizes))
    widest = int(np.argmax(aux.clusters.rates))
    record.update(
      {
        'test_accuracy': (
          float(accuracy[widest]) if c.reported_model == 'widest' else client_weighted
        ),
        'client_weighted_test_accuracy': client_weighted,
        'cluster_test_accuracy': accuracy.tolist(),
        'train_loss': float(np.mean(losses)),
        'clients': len(losses),
        'upload_bytes': upload_bytes,
        'download_bytes': upload_bytes,
        'rejected_uploads': rejected,
      }
    )
    return tuple(models), [record]

  def summarize(self, ctx, aux: FedTSAAux, state, history) -> Dict[str, Any]:
    """The run summary: clusters, communication and final accuracies."""
    last = history[-1] if history else {}
    return {
      'rounds': self.config.rounds,
      'clusters': len(aux.groups),
      'cluster_rates': aux.clusters.rates.tolist(),
      'cluster_sizes': [len(g.client_ids) for g in aux.groups],
      'cluster_models': [g.spec for g in aux.groups],
      'cluster_test_accuracy': last.get('cluster_test_accuracy'),
      'client_weighted_test_accuracy': last.get('client_weighted_test_accuracy'),
      'stage2': aux.learner is not None,
      'source': self.config.source if aux.learner is not None else None,
      'stage2_images': 0 if aux.images is None else int(len(aux.images.labels)),
      'eval_samples': int(len(aux.eval_y)),
      'reported_model': self.config.reported_model,
      'model_bytes': [serialized_nbytes(t) for t in aux.templates],
    }
