"""DynaFed (Pi et al., CVPR 2023; `github.com/pipilurj/DynaFed`).

FedAvg rounds (clients start from the global model, train `local_epochs`, the server averages:
`weighting='uniform'` as the reference's `reduce_average`, or 'size'). The server records the
global-model trajectory θ_0 (init), θ_1, ..., θ_T after rounds 1..T (`trajectory_rounds` = T;
the reference's `minimum_trajectory_length` 25 means T = 24). At the start of round T+1 it
distils a synthetic set by trajectory matching (MTT) on that trajectory, once (the reference
scripts use `maximum_distill_round` 1), and from then on, after every aggregation, fine-tunes
the global model on it.

Trajectory matching (image_synthesizer.py:Synthesizer.synthesize), per iteration:
  start epoch s ~ U{min_start, ..., min(max_start, T − expert_epochs)} (0 if that is 0);
  target θ* = θ_{s+expert_epochs}, or with `weight_averaging` (the reference scripts) the mean of
  n ~ U{least_ave_num, ..., min(max_ave_num, expert_epochs)} checkpoints drawn with
  replacement from θ_{s+1..s+expert_epochs};
  student: syn_steps SGD steps from θ_s, θ ← θ − lr_syn · ∇ kd(f_θ(x_b), ŷ_b), where
  kd(out, y) = mean over B·C of −softmax(y)·log_softmax(out) and x_b are `batch_syn` synthetic
  images (0 = all of them, the reference default);
  loss = ‖θ_student − θ*‖² / ‖θ_s − θ*‖² (`trajectory_matching_loss`, pure and jitted);
  Adam on the images (lr_img), the label logits (lr_label) and lr_syn (lr_lr).
The synthetic images are `ipc` per class, learned in a normalised space (pixel = noise_mean +
noise_std · z, z initialised N(0, 1): the reference's "noise" init in its normalised space);
labels are logits initialised at label_init · onehot (0: uniform), lr_syn at lr_teacher.
BatchNorm models run the student in train mode (batch statistics; running stats discarded).

Fine-tuning (server.py:datadistill): BN statistics re-estimated with 3 passes over the
synthetic set (models with BatchNorm only), then `finetune_epochs` (distill_iter) epochs of
Adam(finetune_lr) on soft labels softmax(label logits), batch `finetune_batch`, through
`GroupTrainer` on the reference's kd_loss (`FinetuneObjective`: soft-label CE / C).

DSA (`dsa`, jfed/distill/diffaugment.py): the reference runs `DiffAugment(x, dsa_strategy)`
with its default strategy 'color_crop_cutout_flip_scale_rotate' (mode 'S': one of the six
transform groups per call, fresh per-sample parameters, no Siamese seed) on the synthetic batch
of every student step of the matching and of every fine-tuning step (not on the BN passes);
jfed does the same, in the reference's normalised space (noise_mean, noise_std). '' or 'none'
turns it off.

Clients (`client_optimizer`, `client_lr`): the reference's clients use Adam lr 1e-3
(`local_optimizer`), the default here; '' uses the run's `optimizer` section instead (the
optimiser of the other methods of a comparison).

Reference defaults (common.py base config, CIFAR-10 scripts): T=24, ipc 15, syn_steps 20,
expert_epochs 3, iterations 3000, lr_img 5e-2, lr_label 1e-2, lr_lr 1e-5, lr_teacher 0.04,
label_init 0, max_start_epoch 50, weight averaging of 2..3 checkpoints, distill_iter 20,
distill_lr 1e-4, batch 256, DSA 'color_crop_cutout_flip_scale_rotate'; 80 clients,
participation 0.4 (`participation`; the base config keeps 1.0, the HFLDD comparison configs
set 0.4), client Adam 1e-3, 1 local epoch, batch 32.

Rounds are steps; the round body is `common.fedavg_round` (uniform weights passed as
`weights`). The state (global model, trajectory, synthetic set) is checkpointed by the driver
after every round, so a run resumed after round T does not distil again.

Communication = FedAvg's (Eq. 3): the distillation is server-side. Every round records the
measured model uploads and downloads; the summary's `bytes_by_stage` is the protocol's account
(`jfed.io.comm.fedavg_transfers` over each round's participants).
"""

import functools
import math
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.data import FederatedArrays
from jfed.distill.diffaugment import DiffAugment, strategy_words
from jfed.engine import GroupTrainer, ModelState
from jfed.errors import ConfigError
from jfed.io import comm
from jfed.keys import Purpose
from jfed.methods import common
from jfed.methods.registry import register_method
from jfed.reporting import Progress

WEIGHTINGS = ('uniform', 'size')
CLIENT_OPTIMIZERS = ('', 'sgd', 'adam')  # '': the run's `optimizer` section


class DynaFedConfig(NamedTuple):
  rounds: int = 1
  local_epochs: int = 1
  participation: float = 1.0  # the reference scripts: 0.4 (hfldd_*.py set it)
  weighting: str = 'uniform'
  trajectory_rounds: int = 24
  ipc: int = 15
  syn_steps: int = 20
  expert_epochs: int = 3
  min_start_epoch: int = 0
  max_start_epoch: int = 50
  weight_averaging: bool = True
  least_ave_num: int = 2
  max_ave_num: int = 10
  iterations: int = 3000
  batch_syn: int = 0
  lr_img: float = 0.05
  lr_label: float = 0.01
  lr_lr: float = 1e-5
  lr_teacher: float = 0.04
  label_init: float = 0.0
  noise_mean: float = 0.5
  noise_std: float = 0.25
  finetune_epochs: int = 20
  finetune_lr: float = 1e-4
  finetune_batch: int = 256
  # DSA during matching and fine-tuning (jfed/distill/diffaugment.py; '' or 'none': off)
  dsa: str = 'color_crop_cutout_flip_scale_rotate'
  # the clients' optimiser: '' = the run's `optimizer`; else sgd | adam at client_lr
  client_optimizer: str = 'adam'
  client_lr: float = 1e-3


class DynaFedState(NamedTuple):
  """Everything a resumed run needs, checkpointed after every round."""

  model: ModelState  # global model
  trajectory: Any  # params stacked [T + 1, ...]: θ_0 .. θ_T (zeros beyond the rounds done)
  syn_x: Any  # [ipc·C, H, W, C] synthetic images in [0, 1]-space (zeros until distilled)
  syn_labels: Any  # [ipc·C, C] label logits
  syn_lr: Any  # [] learned student learning rate


# ------------------------------------------------------------------------------------------------
# trajectory matching
# ------------------------------------------------------------------------------------------------
def kd_loss(logits, label_logits):
  """DynaFed's utils.kd_loss: mean over B·C of −softmax(labels) · log_softmax(logits)."""
  return jnp.mean(-jax.nn.softmax(label_logits, -1) * jax.nn.log_softmax(logits, -1))


def _squared_distance(a, b):
  return sum(jnp.sum(jnp.square(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=('augment',))
def trajectory_matching_loss(
  apply_fn: Callable,
  syn_x,
  syn_labels,
  syn_lr,
  start_params,
  target_params,
  batches,
  aug_key=None,
  augment: Optional[Callable] = None,
):
  """‖θ_student − θ*‖² / ‖θ_start − θ*‖² after len(batches) SGD steps on synthetic data.

  apply_fn(params, x) -> logits; batches: int [syn_steps, batch] indices of the synthetic
  minibatch of each student step; the step is θ ← θ − syn_lr · ∇_θ kd_loss(apply_fn(θ, x_b),
  syn_labels_b), where x_b = augment(fold_in(aug_key, step), syn_x[b]) when `augment` (a
  hashable (key, x) -> x, e.g. `DiffAugment`) is given: fresh parameters every step, as the
  reference's `DiffAugment` call in each student step. Differentiable in syn_x, syn_labels and
  syn_lr.

  Args:
    apply_fn: `apply_fn(params, x) -> logits` of the student.
    syn_x: The synthetic images, [n, H, W, C].
    syn_labels: Their (learned, soft) labels, [n, C].
    syn_lr: The learned student learning rate (a scalar).
    start_params: θ_start, the trajectory point the student starts from.
    target_params: θ*, the trajectory point it should reach.
    batches: Int [syn_steps, batch] indices of the synthetic minibatch of each student step.
    aug_key: The PRNG key of the augmentations (folded with the step).
    augment: A hashable `(key, x) -> x` augmentation; None for none.

  Returns:
    The normalised matching loss (a scalar).
  """

  def step(params, inputs):
    s, idx = inputs
    x = syn_x[idx]
    if augment is not None:
      x = augment(jax.random.fold_in(aug_key, s), x)
    grads = jax.grad(lambda p: kd_loss(apply_fn(p, x), syn_labels[idx]))(params)
    return jax.tree.map(lambda p, g: p - syn_lr * g, params, grads), None

  steps = jnp.arange(batches.shape[0])
  student, _ = jax.lax.scan(step, start_params, (steps, batches))
  return _squared_distance(student, target_params) / _squared_distance(start_params, target_params)


def student_apply_fn(module, batch_stats) -> Callable:
  """apply(params, x) -> logits in train mode (BatchNorm on batch statistics, not updated)."""

  def apply(params, x):
    if not batch_stats:
      return module.apply({'params': params}, x, train=True)
    logits, _ = module.apply(
      {'params': params, 'batch_stats': batch_stats}, x, train=True, mutable=['batch_stats']
    )
    return logits

  return apply


def student_batches(key, num_syn: int, syn_steps: int, batch: int) -> jax.Array:
  """[syn_steps, batch] indices: consecutive chunks of fresh random permutations.

  Args:
    key: The PRNG key of the permutations.
    num_syn: The number of synthetic samples.
    syn_steps: Student steps per matching iteration.
    batch: Samples per student step.

  Returns:
    Int [syn_steps, batch] indices.
  """
  perms = math.ceil(syn_steps * batch / num_syn)
  idx = jnp.concatenate(
    [jax.random.permutation(jax.random.fold_in(key, i), num_syn) for i in range(perms)]
  )
  return idx[: syn_steps * batch].reshape(syn_steps, batch)


class MatchingSchedule(NamedTuple):
  """Static sampling ranges of one trajectory (Python ints, fixed for a run)."""

  min_start: int
  max_start: int  # inclusive
  expert_epochs: int
  weight_averaging: bool
  least_ave: int
  max_ave: int  # inclusive


def matching_schedule(cfg, trajectory_len: int) -> MatchingSchedule:
  """The sampling ranges of `distill_synthetic_set` for a trajectory θ_0 .. θ_{len - 1}."""
  expert = int(cfg.expert_epochs)
  if trajectory_len - 1 - expert < 0:
    raise ValueError(
      f'dynafed: trajectory_rounds={trajectory_len - 1} must be >= expert_epochs={expert}'
    )
  max_start = min(int(cfg.max_start_epoch), trajectory_len - 1 - expert)
  min_start = min(int(cfg.min_start_epoch), max_start)  # the reference: 0 when max_start is 0
  max_ave = min(int(cfg.max_ave_num), expert)  # reference: range(least, min(max+1, e+1))
  least = max(1, min(int(cfg.least_ave_num), max_ave))
  return MatchingSchedule(min_start, max_start, expert, bool(cfg.weight_averaging), least, max_ave)


def sample_target(key, trajectory, schedule: MatchingSchedule):
  """(start params, target params) of one matching iteration (traceable).

  Args:
    key: The PRNG key of the draw.
    trajectory: The global models θ_0..θ_T, stacked along a leading axis.
    schedule: The static ranges of start epochs, expert epochs and averaged targets.

  Returns:
    (start params, target params): θ_s and θ_{s + expert_epochs}, or an average of random later
      points when the schedule averages weights.
  """
  k_start, k_num, k_pick = jax.random.split(key, 3)
  s = jax.random.randint(k_start, (), schedule.min_start, schedule.max_start + 1)
  start = jax.tree.map(lambda t: t[s], trajectory)
  if not schedule.weight_averaging:
    return start, jax.tree.map(lambda t: t[s + schedule.expert_epochs], trajectory)
  num = jax.random.randint(k_num, (), schedule.least_ave, schedule.max_ave + 1)
  picks = jax.random.randint(k_pick, (schedule.max_ave,), s + 1, s + schedule.expert_epochs + 1)
  w = (jnp.arange(schedule.max_ave) < num) / num
  target = jax.tree.map(lambda t: jnp.tensordot(w.astype(t.dtype), t[picks], axes=1), trajectory)
  return start, target


def pixel_dsa(cfg) -> Optional[DiffAugment]:
  """`cfg.dsa` on images in [0, 1]-space, applied in the reference's normalised space
  (noise_mean, noise_std); None when the strategy is empty ('' / 'none')."""
  if not strategy_words(cfg.dsa):
    return None
  return DiffAugment(cfg.dsa, float(cfg.noise_mean), float(cfg.noise_std))


def distill_synthetic_set(
  module, model: ModelState, trajectory, cfg, num_classes: int, input_shape, key
):
  """Trajectory matching: returns (images in [0,1]-space, label logits, lr_syn, losses).

  Args:
    module: The global model's flax module.
    model: The global model (its batch statistics are used).
    trajectory: The global models θ_0..θ_T, stacked along a leading axis.
    cfg: The method's config (synthetic-set size, iterations, learning rates, DSA).
    num_classes: Number of classes.
    input_shape: The (H, W, C) shape of one image.
    key: The PRNG key of the distillation.

  Returns:
    (images in [0, 1]-space, label logits, learned lr, matching losses per iteration).
  """
  ipc, C = int(cfg.ipc), num_classes
  n = ipc * C
  schedule = matching_schedule(cfg, jax.tree.leaves(trajectory)[0].shape[0])
  batch = int(cfg.batch_syn) or n
  apply = student_apply_fn(module, model.batch_stats)
  mean, std = float(cfg.noise_mean), float(cfg.noise_std)
  k_init, k_iter = jax.random.split(key)
  params = (
    jax.random.normal(k_init, (n, *input_shape), jnp.float32),  # z
    float(cfg.label_init) * jax.nn.one_hot(jnp.repeat(jnp.arange(C), ipc), C),
    jnp.asarray(float(cfg.lr_teacher), jnp.float32),
  )
  tx = optax.multi_transform(
    {'img': optax.adam(cfg.lr_img), 'label': optax.adam(cfg.lr_label), 'lr': optax.adam(cfg.lr_lr)},
    ('img', 'label', 'lr'),
  )
  opt_state = tx.init(params)

  augment = pixel_dsa(cfg)

  def objective(p, k):
    k_target, k_batch, k_aug = jax.random.split(k, 3)
    start, target = sample_target(k_target, trajectory, schedule)
    batches = student_batches(k_batch, n, int(cfg.syn_steps), batch)
    return trajectory_matching_loss(
      apply, mean + std * p[0], p[1], p[2], start, target, batches, k_aug, augment=augment
    )

  @jax.jit
  def iteration(p, s, k):
    loss, g = jax.value_and_grad(objective)(p, k)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  progress = Progress('DynaFed trajectory matching', int(cfg.iterations), 'iteration')
  losses = []
  for it in range(int(cfg.iterations)):
    params, opt_state, loss = iteration(params, opt_state, jax.random.fold_in(k_iter, it))
    losses.append(loss)
    progress.update(it + 1, f'loss {float(loss):.4f}' if (it + 1) % 10 == 0 else '')
  return mean + std * params[0], params[1], params[2], np.asarray(jnp.stack(losses))


# ------------------------------------------------------------------------------------------------
# server-side fine-tuning on the synthetic set
# ------------------------------------------------------------------------------------------------
def _bn_passes(module, model: ModelState, x, batch: int, passes: int, key) -> ModelState:
  """The reference's `with no_grad: for _ in range(3): model(x_dis)` in train mode."""
  if not model.batch_stats:
    return model

  @jax.jit
  def forward(stats, xb):
    _, upd = module.apply(
      {'params': model.params, 'batch_stats': stats}, xb, train=True, mutable=['batch_stats']
    )
    return upd['batch_stats']

  stats = model.batch_stats
  for p in range(passes):
    order = np.asarray(jax.random.permutation(jax.random.fold_in(key, p), len(x)))
    for i in range(0, len(x), batch):
      stats = forward(stats, x[order[i : i + batch]])
  return ModelState(model.params, stats)


class FinetuneObjective(NamedTuple):
  """The reference's fine-tuning loss (server.py:datadistill, utils.kd_loss): the mean over B·C
  of −softmax(y) · log_softmax(f(x)), i.e. `engine.classification_objective`'s soft-label cross
  entropy / C. The scale matters under Adam where a gradient is as small as Adam's eps. With
  `augment` the batches first go through it (`DiffAugment`: fresh per-sample parameters every
  step, as the reference's fine-tuning batches)."""

  augment: Optional[Callable] = None

  def __call__(self, module, params, batch_stats, x, y, weights, key):
    if self.augment is not None:
      k_aug, key = jax.random.split(key)
      x = self.augment(k_aug, x)
    loss, (reported, correct, count, stats) = engine.classification_objective(
      module, params, batch_stats, x, y, weights, key
    )
    num_classes = y.shape[-1]
    return loss / num_classes, (reported / num_classes, correct, count, stats)


def finetune(
  trainer: GroupTrainer, model: ModelState, syn_x, syn_labels, epochs: int, key
) -> ModelState:
  """BN re-estimation on the synthetic set (un-augmented, as the reference), then `epochs`
  epochs of soft-label training (augmented when the trainer's objective augments).

  Args:
    trainer: The server's trainer (the global model's module, its objective and optimizer).
    model: The global model to fine-tune.
    syn_x: The synthetic images.
    syn_labels: Their soft labels (logits).
    epochs: Epochs of fine-tuning.
    key: The PRNG key of shuffling and augmentation.

  Returns:
    The fine-tuned model.
  """
  x = np.asarray(syn_x)
  model = _bn_passes(trainer.module, model, x, trainer.batch_size, 3, jax.random.fold_in(key, 1))
  y = np.asarray(jax.nn.softmax(syn_labels, -1), np.float32)
  fed = FederatedArrays(x[None], y[None], np.array([len(x)], np.int32))
  state = engine.init_train_state(trainer.tx, engine.replicate(model, 1))
  state, _ = trainer.train(state, fed, epochs, key)
  return engine.take(state.model, 0)


# ------------------------------------------------------------------------------------------------
# the method
# ------------------------------------------------------------------------------------------------
def client_optimizer(cfg) -> Optional[ml_collections.ConfigDict]:
  """The clients' optimiser section: None (the run's `optimizer`) when `client_optimizer` is
  '', else that optimiser with torch's defaults and lr `client_lr` (the reference's
  `local_optimizer` ["Adam", {"lr": 0.001}])."""
  if not cfg.client_optimizer:
    return None
  return ml_collections.ConfigDict({'name': cfg.client_optimizer, 'lr': float(cfg.client_lr)})


class DynaFedAux(NamedTuple):
  full_group: common.ClientGroup
  trainer: GroupTrainer  # the clients' local training
  tuner: GroupTrainer  # the server's fine-tuning on the synthetic set
  evaluator: engine.Evaluator
  init: ModelState
  server: common.Server  # receives and aggregates the clients' uploads


@register_method('dynafed')
class DynaFed(Algorithm):
  """FedAvg whose global model is fine-tuned on a synthetic set distilled from its trajectory."""

  section = 'dynafed'
  server_round = True
  Config = DynaFedConfig
  step_name = 'round'

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(
      c,
      where,
      (
        'rounds',
        'local_epochs',
        'trajectory_rounds',
        'ipc',
        'syn_steps',
        'expert_epochs',
        'least_ave_num',
        'max_ave_num',
        'iterations',
        'lr_img',
        'lr_teacher',
        'noise_std',
        'finetune_epochs',
        'finetune_lr',
        'finetune_batch',
      ),
    )
    tc.require_non_negative(
      c, where, ('min_start_epoch', 'max_start_epoch', 'batch_syn', 'lr_label', 'lr_lr')
    )
    tc.require_fraction(c.participation, f'{where}.participation')
    tc.require_choice(c.weighting, WEIGHTINGS, f'{where}.weighting')
    tc.require(
      c.client_optimizer in CLIENT_OPTIMIZERS,
      f"{where}.client_optimizer is {c.client_optimizer!r}; valid: '' (the run's optimizer), "
      + ', '.join(CLIENT_OPTIMIZERS[1:]),
    )
    tc.require(
      not c.client_optimizer or c.client_lr > 0,
      f'{where}.client_lr must be positive when {where}.client_optimizer is set, got {c.client_lr}',
    )
    try:
      strategy_words(c.dsa)
    except ValueError as e:
      raise ConfigError(f'{where}.dsa: {e}') from None
    tc.require(
      c.expert_epochs <= c.trajectory_rounds,
      f'{where}.expert_epochs ({c.expert_epochs}) must be <= '
      f'{where}.trajectory_rounds ({c.trajectory_rounds}): a matching target lies '
      'expert_epochs rounds after its start on the trajectory',
    )

  def trained_model(
    self, ctx: RunContext, aux: DynaFedAux, state: DynaFedState
  ) -> engine.TrainedModel:
    """The global model (after its fine-tuning)."""
    return engine.TrainedModel(aux.evaluator.module, state.model)

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def setup(self, ctx: RunContext) -> DynaFedAux:
    cfg = self.config
    common.single_architecture(ctx)
    full_group = common.client_groups(ctx)[0]
    module = full_group.module
    init = engine.init_model(module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
    augment = pixel_dsa(cfg)
    tuner = GroupTrainer(
      module,
      optax.adam(cfg.finetune_lr),
      cfg.finetune_batch,
      strategy=ctx.run.strategy,
      objective=FinetuneObjective(augment),
    )
    return DynaFedAux(
      full_group,
      common.make_trainers(ctx, [full_group], optimizer=client_optimizer(cfg))[0],
      tuner,
      engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy),
      init,
      common.make_server(ctx),
    )

  def init(self, ctx: RunContext, aux: DynaFedAux) -> DynaFedState:
    ds, init = ctx.dataset, aux.init
    T = self.config.trajectory_rounds
    n_syn = self.config.ipc * ds.num_classes
    trajectory = jax.tree.map(
      lambda p: jnp.zeros((T + 1, *p.shape), p.dtype).at[0].set(p), init.params
    )
    return DynaFedState(
      init,
      trajectory,
      jnp.zeros((n_syn, *ds.input_shape), jnp.float32),
      jnp.zeros((n_syn, ds.num_classes), jnp.float32),
      jnp.zeros((), jnp.float32),
    )

  def _participants(self, ctx: RunContext, i: int) -> np.ndarray:
    return common.select_clients(
      ctx.derive_key(Purpose.SAMPLING, i), ctx.num_clients, self.config.participation
    )

  def step(self, ctx: RunContext, aux: DynaFedAux, state: DynaFedState, i: int):
    """One FedAvg round; after the trajectory's last round, distils the synthetic set once, and
    fine-tunes the global model on it every round.
    """
    cfg, ds = self.config, ctx.dataset
    T = cfg.trajectory_rounds
    record = {}
    if i == T:  # the trajectory θ_0..θ_T is complete: distil once
      syn_x, syn_labels, syn_lr, losses = distill_synthetic_set(
        aux.full_group.module,
        state.model,
        state.trajectory,
        cfg,
        ds.num_classes,
        ds.input_shape,
        ctx.derive_key(Purpose.SYNTHETIC_SET),
      )
      state = state._replace(syn_x=syn_x, syn_labels=syn_labels, syn_lr=syn_lr)
      record.update(
        {
          'matching_loss_first': float(losses[0]),  # iterations >= 1 (validate)
          'matching_loss_last': float(losses[-1]),
          'syn_lr': float(syn_lr),
        }
      )
    group = common.participating_group(ctx, aux.full_group, self._participants(ctx, i))
    weights = np.ones(len(group.client_ids)) if cfg.weighting == 'uniform' else None
    model, round_record = common.fedavg_round(
      common.RoundParts(aux.trainer, cfg.local_epochs, aux.init, aux.server),
      group,
      state.model,
      ctx.derive_key(Purpose.ROUNDS, i),
      i,
      common.RoundOptions(weights=weights, label=f'round {i + 1}/{cfg.rounds}'),
    )
    if i >= T:
      record['test_accuracy_before_finetune'] = aux.evaluator.accuracy(model, ds.test_x, ds.test_y)
      model = finetune(
        aux.tuner,
        model,
        state.syn_x,
        state.syn_labels,
        cfg.finetune_epochs,
        ctx.derive_key(Purpose.FINETUNE, i),
      )
    state = state._replace(model=model)
    if i + 1 <= T:
      state = state._replace(
        trajectory=jax.tree.map(lambda t, p: t.at[i + 1].set(p), state.trajectory, model.params)
      )
    accuracy = aux.evaluator.accuracy(model, ds.test_x, ds.test_y)
    return state, [{'round': i + 1, 'test_accuracy': accuracy, **round_record, **record}]

  def summarize(self, ctx, aux: DynaFedAux, state, history) -> Dict[str, Any]:
    """The run summary: accuracies, communication and the synthetic set."""
    cfg = self.config
    transfers = comm.fedavg_transfers(
      comm.serialized_nbytes(aux.init),
      cfg.rounds,
      [self._participants(ctx, i).tolist() for i in range(cfg.rounds)],
    )
    return {
      'rounds': cfg.rounds,
      'distilled': cfg.rounds > cfg.trajectory_rounds,
      'num_synthetic': cfg.ipc * ctx.dataset.num_classes,
      'bytes_by_stage': dict(comm.bytes_by_stage(transfers)),
    }
