"""The server side of one-shot methods that distil client models into a server model.

DENSE, Co-Boosting, FedHydra and FedDF all run THIS loop; each method module only says how it
synthesises data, how the teachers are combined, which student loss it uses, and what (if
anything) it does between synthesis and distillation (`DistillMethod` hooks).

Protocol of one global round r (r = 1..rounds):

1. Clients upload their locally trained models (`round_local_models`). Round 1:
   `common.local_models` (every client trains `local_epochs` epochs from the shared init; the
   result is checkpointed under workdir/local_models or read from `config.local_models_dir`).
   Round r > 1: every client whose architecture equals the server model's starts from the
   previous round's global (server) model, every other client from its own round r−1 model;
   all train `local_epochs` epochs (checkpointed under workdir/round_models, step r).
2. Teachers: one `TeacherGroup` per architecture group of the uploaded models (eval mode).
3. Server model (`<method>.server_model`, default `config.model`): round 1 starts random
   (`init='random'`, DENSE / Co-Boosting / FedHydra Algorithm 1 line 10) or from the FedAvg of
   the clients that share its architecture (`init='fedavg'`, FedDF); round r > 1 starts from
   the previous round's global model. A fresh optimiser, pool and generator every round.
4. `epochs` distillation epochs. Epoch e:
     a. synthesis (not FedDF): one `jfed.distill.synthesize` call (g_steps generator steps on
        `synthesis_batch` images), its best batch and target labels are appended to the pool;
     b. the method's `before_kd` hook (Co-Boosting: ensemble-weight update);
     c. distillation: the student takes SGD/Adam steps on KD batches — the whole pool in
        shuffled batches (`kd_data='pool'`, DENSE), only the batch synthesised this epoch
        (`'batch'`, FedHydra Algorithm 1 read literally) or `steps_per_epoch` batches of a fixed
        unlabelled set (`'fixed'`, FedDF);
     d. test accuracy of the student; the method's `after_epoch` hook (FedDF: validation,
        best-on-val model, early stop);
     e. one metrics record {'step', 'round', 'epoch', 'test_accuracy', losses, ...} and a
        checkpoint of `ServerState` (student + optimiser, pool, generator, method extras).
   step = (r − 1) · epochs + e, so a multi-round run has one increasing step axis.
5. The round's global model is `method.round_model(state)` (the final student; FedDF: the
   best-on-val student), evaluated and sent back to the clients for round r + 1.

Resume: every key is `ctx.derive_key(KEY_SERVER, r, e, ...)`, the KD batch order is
`np.random.default_rng((seed, r, e))`, and the state after every epoch is checkpointed, so a run
killed at any point and restarted ends with the same metrics as an uninterrupted one.
"""
import functools
import math
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from jfed import engine
from jfed.distill import (TeacherGroup, augment, cross_entropy, dense_generator_init,
                          combine_logits, epoch_batches, kl_divergence, make_generator, pool_add,
                          pool_gather, pool_init, pool_size, synthesize, teacher_outputs)
from jfed.distill.synthesis import SynthesisConfig, aggregate_teachers
from jfed.engine import ModelState, TrainState
from jfed.io import Checkpointer
from jfed.methods import common
from jfed.methods.context import KEY_LOCAL_TRAINING, KEY_SERVER, RunContext

KD_DATA = ('pool', 'batch', 'fixed')
KD_AUGMENT = ('auto', 'none', 'flip', 'crop_flip')
SCHEDULES = ('constant', 'cosine_epochs', 'cosine_steps')


# Epoch e (0-based) of round r (1-based) uses derive_key(KEY_SERVER, r, e); round-level draws use
# derive_key(KEY_SERVER, 0, r, purpose), a disjoint path.
ROUND_KEY_STUDENT = 1
ROUND_KEY_GENERATOR = 2
ROUND_KEY_MS = 3


def round_key(ctx: RunContext, r: int, purpose: int) -> jax.Array:
  return ctx.derive_key(KEY_SERVER, 0, r, purpose)


# ---------------------------------------------------------------------------------------------
# static settings
# ---------------------------------------------------------------------------------------------
class KDConfig(NamedTuple):
  """How one KD step turns a batch into a student loss (static: part of the compiled step).

  loss 'kl':       Σ_c KL_elem(softmax(t/T) ‖ softmax(s/T)) per sample (× T² if t_squared),
                   averaged over the real samples = F.kl_div(..., 'batchmean') (DENSE, FedDF,
                   Co-Boosting `KLDiv`).
  loss 'fedhydra': Eq. 19 per sample: the same KL (Eq. 17) + β · CE(s, argmax t) (Eq. 18).
  aggregation:     teacher logits t from the per-client logits (synthesis.aggregate_teachers):
                   'mean' (DENSE, FedDF avg_logits), 'weighted' (Co-Boosting, weights from the
                   method), 'sa' / 'sa_inter' (FedHydra SA with the pool's target labels).
  augment:         KD view of a stored image: 'none', 'flip' (HFlip), 'crop_flip'
                   (RandomCrop(pad) + HFlip).
  ods_eta:         Co-Boosting ODS: x ← x + eta · sign(∇_x Σ r ⊙ softmax(t(x)/ods_T)), r ~ U(−1, 1).
  """
  loss: str = 'kl'
  T: float = 1.0
  t_squared: bool = False
  beta: float = 1.0
  aggregation: str = 'mean'
  augment: str = 'none'
  crop_padding: int = 4
  ods_eta: float = 0.0
  ods_T: float = 4.0
  strategy: str = 'auto'


class OptConfig(NamedTuple):
  """Student optimiser with PyTorch semantics: clip_grad_norm_ (if grad_clip > 0), weight decay
  added to the gradient, SGD(momentum) or Adam; the learning rate is set every step by the host
  (`schedule`), so it lives in the optimiser state and survives a resume."""
  name: str = 'sgd'
  lr: float = 0.01
  momentum: float = 0.9
  weight_decay: float = 0.0
  grad_clip: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  schedule: str = 'constant'   # 'constant' | 'cosine_epochs' (per epoch) | 'cosine_steps'


def student_tx(ocfg: OptConfig) -> optax.GradientTransformation:
  def build(learning_rate):
    parts = []
    if ocfg.grad_clip:
      parts.append(optax.clip_by_global_norm(ocfg.grad_clip))
    if ocfg.weight_decay:
      parts.append(optax.add_decayed_weights(ocfg.weight_decay))
    if ocfg.name == 'sgd':
      parts.append(optax.sgd(learning_rate, momentum=ocfg.momentum or None))
    elif ocfg.name == 'adam':
      parts.append(optax.adam(learning_rate, b1=ocfg.b1, b2=ocfg.b2))
    else:
      raise ValueError(f"student optimizer must be 'sgd' or 'adam', got {ocfg.name!r}")
    return optax.chain(*parts)
  return optax.inject_hyperparams(build)(learning_rate=ocfg.lr)


def learning_rate(ocfg: OptConfig, epoch: int, epochs: int, step: int = 0,
                  total_steps: int = 1) -> float:
  """lr of the `epoch`-th epoch (0-based) / `step`-th step: constant, CosineAnnealingLR stepped
  once per epoch (T_max = epochs, Co-Boosting) or per step (T_max = total_steps, FedDF)."""
  if ocfg.schedule == 'constant':
    return ocfg.lr
  if ocfg.schedule == 'cosine_epochs':
    return 0.5 * ocfg.lr * (1.0 + math.cos(math.pi * epoch / max(epochs, 1)))
  if ocfg.schedule == 'cosine_steps':
    return 0.5 * ocfg.lr * (1.0 + math.cos(math.pi * min(step, total_steps) / max(total_steps, 1)))
  raise ValueError(f'Unknown student lr schedule {ocfg.schedule!r}; valid: {", ".join(SCHEDULES)}')


def teacher_strategy(ctx: RunContext) -> str:
  s = ctx.config.get('strategy', 'auto')
  return {'scan': 'vmap'}.get(s, s) if s != 'auto' else 'auto'


def resolve_augment(kind: str, dataset_name: str) -> str:
  """'auto' = DENSE's KD transform: RandomCrop + HFlip for CIFAR, HFlip for the others."""
  if kind not in KD_AUGMENT:
    raise ValueError(f'Unknown KD augmentation {kind!r}; valid: {", ".join(KD_AUGMENT)}')
  if kind != 'auto':
    return kind
  return 'crop_flip' if 'cifar' in dataset_name.lower() else 'flip'


def crop_padding(input_shape: Sequence[int]) -> int:
  """RandomCrop padding 4 (DENSE, 28/32 px); H // 8 for small images (1 px on 8×8 digits)."""
  return 4 if min(input_shape[:2]) >= 28 else max(1, int(input_shape[0]) // 8)


# ---------------------------------------------------------------------------------------------
# the compiled KD step (module-level jit: cached across runs of one process)
# ---------------------------------------------------------------------------------------------
def _groups(modules, states):
  return [TeacherGroup(m, s) for m, s in zip(modules, states)]


def teacher_logits(kcfg: KDConfig, modules, states, x, y, agg):
  per_client, _ = teacher_outputs(_groups(modules, states), x, False, kcfg.strategy)
  return aggregate_teachers(kcfg, per_client, y, agg)


def per_sample_loss(kcfg: KDConfig, s: jnp.ndarray, t: jnp.ndarray) -> jnp.ndarray:
  t = jax.lax.stop_gradient(t)
  kl = jnp.sum(kl_divergence(s, t, kcfg.T, 'none', kcfg.t_squared), axis=-1)
  if kcfg.loss == 'kl':
    return kl
  if kcfg.loss == 'fedhydra':
    return kl + kcfg.beta * cross_entropy(s, jnp.argmax(t, -1), 'none')
  raise ValueError(f"KD loss must be 'kl' or 'fedhydra', got {kcfg.loss!r}")


def _kd_view(kcfg: KDConfig, key, x):
  if kcfg.augment == 'none':
    return x
  return augment(key, x, kcfg.crop_padding if kcfg.augment == 'crop_flip' else 0, True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def kd_step(kcfg: KDConfig, ocfg: OptConfig, teacher_modules, student_module, ts: TrainState,
            teacher_states, agg, pool, idx, mask, key, lr):
  """One student step on pool[idx] (mask: real samples). Returns (new TrainState, mean loss)."""
  x, y = pool_gather(pool, idx)
  k_aug, k_ods = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
  x = _kd_view(kcfg, k_aug, x)
  if kcfg.ods_eta > 0:
    r = jax.random.uniform(k_ods, (x.shape[0], student_module.num_classes), minval=-1.0,
                           maxval=1.0)
    score = lambda xx: jnp.sum(r * jax.nn.softmax(
        teacher_logits(kcfg, teacher_modules, teacher_states, xx, y, agg) / kcfg.ods_T))
    x = jax.lax.stop_gradient(x + kcfg.ods_eta * jnp.sign(jax.grad(score)(x)))
  t = jax.lax.stop_gradient(teacher_logits(kcfg, teacher_modules, teacher_states, x, y, agg))
  w = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(w), 1.0)

  def objective(params):
    s, upd = student_module.apply({'params': params, 'batch_stats': ts.model.batch_stats}, x,
                                  train=True, mask=mask, mutable=['batch_stats'])
    loss = jnp.sum(per_sample_loss(kcfg, s, t) * w) / count
    return loss, upd.get('batch_stats', ts.model.batch_stats)

  (loss, new_bs), grads = jax.value_and_grad(objective, has_aux=True)(ts.model.params)
  opt_state = ts.opt_state._replace(
      hyperparams={**ts.opt_state.hyperparams, 'learning_rate': jnp.asarray(lr, jnp.float32)})
  updates, opt_state = student_tx(ocfg).update(grads, opt_state, ts.model.params)
  return TrainState(ModelState(optax.apply_updates(ts.model.params, updates), new_bs),
                    opt_state), loss


# ---------------------------------------------------------------------------------------------
# state, settings and hooks of one method
# ---------------------------------------------------------------------------------------------
class ServerState(NamedTuple):
  """Everything the server carries from one distillation epoch to the next (checkpointed)."""
  student: TrainState
  pool: Any            # ImagePool of synthetic images + target labels (placeholder for FedDF)
  generator: Any       # ModelState of a generator kept across epochs, else ModelState({}, {})
  extra: Any           # method-specific pytree (Co-Boosting weights, FedDF best model, ...)
  stopped: Any         # bool scalar: the round ended early (FedDF early stopping)


class Settings(NamedTuple):
  """What one distillation method is, in the terms of the shared loop."""
  rounds: int
  local_epochs: int
  epochs: int
  server_model: str
  init: str                               # 'random' | 'fedavg'
  kd: KDConfig
  opt: OptConfig
  kd_batch: int
  kd_data: str                            # 'pool' | 'batch' | 'fixed'
  synthesis: Optional[SynthesisConfig]    # None: no generator (FedDF)
  keep_generator: bool = False            # continue one generator across epochs (FedHydra)
  nz: int = 256
  ngf: int = 64
  pool_quantize: bool = True
  steps_per_epoch: int = 0                # kd_data='fixed': KD steps per epoch


class DistillMethod:
  """Hooks of one method; the defaults are DENSE's (nothing besides synthesis + KD)."""
  name = 'distill'

  def __init__(self, ctx: RunContext, settings: Settings):
    self.ctx, self.s = ctx, settings

  def eval_data(self) -> Tuple[np.ndarray, np.ndarray]:
    return self.ctx.dataset.test_x, self.ctx.dataset.test_y

  def setup_round(self, r: int, local: common.LocalModels, teachers: List[TeacherGroup]) -> Any:
    """Per-round constants (FedHydra: MS; FedDF: the unlabelled and validation sets)."""
    return None

  def init_extra(self, student: ModelState, num_teachers: int) -> Any:
    return jnp.zeros((), jnp.float32)

  def synthesis_agg(self, state: ServerState, aux: Any) -> Any:
    return None

  def kd_agg(self, state: ServerState, aux: Any) -> Any:
    return None

  def fixed_pool(self, aux: Any):
    raise NotImplementedError

  def before_kd(self, state: ServerState, aux, teachers, r: int, e: int
                ) -> Tuple[ServerState, Dict[str, Any]]:
    return state, {}

  def after_epoch(self, state: ServerState, aux, evaluator, test_accuracy: float, r: int,
                  e: int) -> Tuple[ServerState, Dict[str, Any]]:
    return state, {}

  def round_model(self, state: ServerState) -> ModelState:
    return state.student.model

  def round_accuracy(self, state: ServerState, last_test_accuracy: float) -> float:
    return last_test_accuracy

  def summary(self, state: ServerState, aux) -> Dict[str, Any]:
    return {}


# ---------------------------------------------------------------------------------------------
# uploads of every round
# ---------------------------------------------------------------------------------------------
def round_local_models(ctx: RunContext, r: int, local_epochs: int, server_spec: str,
                       global_model: Optional[ModelState]) -> common.LocalModels:
  """The client models uploaded in round r (see the module docstring). Round-r models are
  checkpointed (workdir/round_models, step r) so that a resumed run does not retrain them."""
  first = common.local_models(ctx, local_epochs)
  if r == 1:
    return first
  ckpt = Checkpointer(ctx.workdir / 'round_models', max_to_keep=3)
  try:
    latest = ckpt.latest_step() or 1
    if latest >= r:
      models = ckpt.restore(r, first.models)
    else:
      if global_model is None:
        raise ValueError(f'round {r} needs the global model of round {r - 1}')
      prev = first.models if r == 2 else ckpt.restore(r - 1, first.models)
      starts = [engine.replicate(global_model, len(g.client_ids)) if g.spec == server_spec
                else p for g, p in zip(first.groups, prev)]
      trainers = common.make_trainers(ctx, first.groups)
      models, _ = common.train_groups(trainers, first.groups, starts, local_epochs,
                                      ctx.derive_key(KEY_LOCAL_TRAINING, r),
                                      label=f'round {r} local training')
      ckpt.save(r, list(models))
  finally:
    ckpt.close()
  upload = common.receive_uploads(first.groups, models,
                                  [engine.take(m, 0) for m in first.models])
  return common.LocalModels(first.groups, list(models), upload)


def committed(tree: Any) -> Any:
  """The tree on the default device, committed. jit's cache key includes whether an argument
  is committed, and the outputs of a jitted step are: committing the inputs up front keeps the
  first and later epochs on one compiled program instead of two."""
  return jax.device_put(tree, jax.devices()[0])


def teacher_groups(local: common.LocalModels) -> List[TeacherGroup]:
  return [TeacherGroup(g.module, committed(m)) for g, m in zip(local.groups, local.models)]


def teacher_client_ids(local: common.LocalModels) -> np.ndarray:
  """Global client id of each teacher, in the teachers' (group-concatenated) order."""
  return np.concatenate([g.client_ids for g in local.groups])


def fedavg_of_matching(local: common.LocalModels, spec: str) -> Optional[ModelState]:
  """FedAvg (size-weighted) of the uploaded models whose architecture is `spec`, if any."""
  for g, m in zip(local.groups, local.models):
    if g.spec == spec:
      return engine.weighted_average(m, g.fed.sizes)
  return None


def fresh_state(method: DistillMethod, student: ModelState, num_teachers: int,
                input_shape, key) -> ServerState:
  s = method.s
  tx = student_tx(s.opt)
  if s.synthesis is not None:
    capacity = max(1, s.epochs * s.synthesis.batch_size)
    pool = pool_init(capacity, input_shape, quantize=s.pool_quantize)
  else:
    pool = pool_init(1, input_shape, quantize=False)
  if s.keep_generator:
    gen = dense_generator_init(key, make_generator(input_shape, s.nz, s.ngf))
  else:
    gen = ModelState({}, {})
  return committed(ServerState(TrainState(student, tx.init(student.params)), pool, gen,
                               method.init_extra(student, num_teachers),
                               jnp.zeros((), jnp.bool_)))


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def _kd_batches(method: DistillMethod, state: ServerState, aux, rng: np.random.Generator):
  s = method.s
  if s.kd_data == 'pool':
    idx, mask = epoch_batches(state.pool, rng, s.kd_batch)
    return state.pool, idx, mask
  if s.kd_data == 'batch':
    n, cap = s.synthesis.batch_size, state.pool.capacity
    latest = (int(state.pool.count) - n + np.arange(n)) % cap
    nb = -(-n // s.kd_batch)
    idx = np.zeros(nb * s.kd_batch, np.int32)
    mask = np.zeros(nb * s.kd_batch, bool)
    idx[:n], mask[:n] = latest[rng.permutation(n)], True
    return state.pool, idx.reshape(nb, -1), mask.reshape(nb, -1)
  if s.kd_data == 'fixed':
    pool = method.fixed_pool(aux)
    n = int(pool_size(pool))
    idx = np.stack([rng.choice(n, s.kd_batch, replace=n < s.kd_batch)
                    for _ in range(s.steps_per_epoch)]).astype(np.int32)
    return pool, idx, np.ones_like(idx, bool)
  raise ValueError(f'Unknown kd_data {s.kd_data!r}; valid: {", ".join(KD_DATA)}')


def _distill_epoch(method: DistillMethod, state: ServerState, aux, teachers, student_module,
                   r: int, e: int, generator) -> Tuple[ServerState, Dict[str, Any], np.ndarray]:
  ctx, s = method.ctx, method.s
  key = ctx.derive_key(KEY_SERVER, r, e)
  record: Dict[str, Any] = {}
  images = None
  if s.synthesis is not None:
    res = synthesize(generator, teachers, student_module, state.student.model,
                     ctx.dataset.num_classes, jax.random.fold_in(key, 0), s.synthesis,
                     agg=method.synthesis_agg(state, aux),
                     generator_state=state.generator if s.keep_generator else None)
    state = state._replace(pool=pool_add(state.pool, res.images, res.labels),
                           generator=res.generator if s.keep_generator else state.generator)
    comps = np.asarray(res.components)[-1]
    record.update({'gen_best_loss': float(res.best_loss),
                   'gen_loss': float(np.asarray(res.losses)[-1]),
                   'gen_bn': float(comps[0]), 'gen_oh': float(comps[1]),
                   'gen_adv': float(comps[2])})
    images = np.asarray(res.images), np.asarray(res.labels)
  state, extra_record = method.before_kd(state, aux, teachers, r, e)
  record.update(extra_record)
  pool, idx, mask = _kd_batches(method, state, aux, np.random.default_rng(
      (int(ctx.config.seed), r, e)))
  modules = tuple(t.module for t in teachers)
  t_states = tuple(t.states for t in teachers)
  agg = method.kd_agg(state, aux)
  ts, losses = state.student, []
  total_steps = s.epochs * max(1, s.steps_per_epoch)
  kd_key = jax.random.fold_in(key, 1)
  lr = learning_rate(s.opt, e, s.epochs)
  for b in range(idx.shape[0]):
    if s.opt.schedule == 'cosine_steps':
      lr = learning_rate(s.opt, e, s.epochs, e * s.steps_per_epoch + b, total_steps)
    ts, loss = kd_step(s.kd, s.opt, modules, student_module, ts, t_states, agg, pool,
                       jnp.asarray(idx[b]), jnp.asarray(mask[b]), jax.random.fold_in(kd_key, b),
                       lr)
    losses.append(loss)
  record.update({'kd_loss': float(np.mean(np.asarray(losses))) if losses else float('nan'),
                 'kd_steps': int(idx.shape[0]), 'lr': float(lr),
                 'pool_size': int(pool_size(state.pool))})
  return state._replace(student=ts), record, images


def run_distillation(method: DistillMethod) -> Dict[str, Any]:
  """Runs `method` for its rounds × epochs with checkpoint/resume; returns the summary dict."""
  ctx, s = method.ctx, method.s
  if s.kd_data not in KD_DATA:
    raise ValueError(f'Unknown kd_data {s.kd_data!r}; valid: {", ".join(KD_DATA)}')
  if s.rounds < 1 or s.epochs < 1:
    raise ValueError(f'{method.name}: rounds and epochs must be >= 1, got {s.rounds}, {s.epochs}')
  server_spec = s.server_model or ctx.config.model
  student_module = common.build_module(server_spec, ctx.dataset)
  shape = ctx.dataset.input_shape
  generator = make_generator(shape, s.nz, s.ngf) if s.synthesis is not None else None
  num_teachers = ctx.num_clients
  random_student = engine.init_model(student_module, shape, round_key(ctx, 0, ROUND_KEY_STUDENT))
  gen_key = lambda r: round_key(ctx, r, ROUND_KEY_GENERATOR)
  template = fresh_state(method, random_student, num_teachers, shape, gen_key(1))
  eval_x, eval_y = method.eval_data()
  evaluator = engine.Evaluator(student_module, ctx.config.eval_batch_size, ctx.config.strategy)

  ckpt = ctx.checkpointer()
  latest, state = ckpt.restore_latest(template)
  state = committed(state)
  latest = latest or 0
  ctx.metrics.truncate_after(latest)
  if latest:
    r = (latest - 1) // s.epochs + 1
    e_done = latest - (r - 1) * s.epochs
    round_complete = e_done == s.epochs or bool(state.stopped)
    if round_complete:
      r, e_done = r + 1, 0
  else:
    r, e_done, round_complete = 1, 0, False
  # the previous round's global model, needed when a new round starts
  global_model = method.round_model(state) if round_complete else None
  round_acc = [rec['round_accuracy'] for rec in ctx.metrics.read() if 'round_accuracy' in rec]
  upload_bytes, local, aux, teachers = 0, None, None, None
  t_round = time.perf_counter()
  while r <= s.rounds:
    local = round_local_models(ctx, r, s.local_epochs, server_spec, global_model)
    upload_bytes = local.upload_bytes
    teachers = teacher_groups(local)
    aux = committed(method.setup_round(r, local, teachers))
    if e_done == 0:  # a new round
      if global_model is not None:
        start = global_model
      elif s.init == 'fedavg':
        start = fedavg_of_matching(local, server_spec)
        if start is None:
          logging.warning('%s: no client has the server architecture %s; random init',
                          method.name, server_spec)
          start = random_student
      elif s.init == 'random':
        start = random_student
      else:
        raise ValueError(f"init must be 'random' or 'fedavg', got {s.init!r}")
      state = fresh_state(method, start, num_teachers, shape, gen_key(r))
    last_acc = None
    for e in range(e_done, s.epochs):
      if bool(state.stopped):
        break
      t0 = time.perf_counter()
      state, record, images = _distill_epoch(method, state, aux, teachers, student_module,
                                             r, e, generator)
      last_acc = evaluator.accuracy(state.student.model, eval_x, eval_y)
      state, extra = method.after_epoch(state, aux, evaluator, last_acc, r, e)
      step = (r - 1) * s.epochs + e + 1
      record = {'step': step, 'round': r, 'epoch': e + 1, 'test_accuracy': last_acc,
                **record, **extra}
      done = e + 1 == s.epochs or bool(state.stopped)
      if done:
        record['round_accuracy'] = method.round_accuracy(state, last_acc)
      record['seconds'] = time.perf_counter() - t0
      ctx.metrics.write(record)
      if images is not None and done:
        _save_samples(ctx, images, r)
      ckpt.save(step, state)
      print(f'{method.name} round {r}/{s.rounds} epoch {e + 1}/{s.epochs}: test accuracy '
            f'{last_acc:.4f}' + (f" kd_loss {record['kd_loss']:.4f}" if 'kd_loss' in record
                                 else '') + f' ({record["seconds"]:.1f}s)', flush=True)
      if done:
        round_acc.append(record['round_accuracy'])
    global_model = method.round_model(state)
    r, e_done = r + 1, 0
  ckpt.close()
  history = ctx.metrics.read()
  accs = [h['test_accuracy'] for h in history]
  if local is None:  # everything was already done: rebuild the last round's uploads for the summary
    local = round_local_models(ctx, s.rounds, s.local_epochs, server_spec, global_model)
    upload_bytes = local.upload_bytes
    teachers = teacher_groups(local)
    aux = method.setup_round(s.rounds, local, teachers)
  from jfed.distill import plots
  plots.plot_accuracy_vs_epoch(
      ctx.workdir / 'distillation_accuracy.png',
      {f'{method.name} round {rr}': ([h['epoch'] for h in history if h['round'] == rr],
                                     [h['test_accuracy'] for h in history if h['round'] == rr])
       for rr in sorted({h['round'] for h in history})},
      title=f'{method.name} on {ctx.dataset.name}: test accuracy vs distillation epoch')
  final = round_acc[-1] if round_acc else accs[-1]
  client_logits, test_y = common.client_test_logits(ctx, local), ctx.dataset.test_y
  summary = {
      'final_test_accuracy': final, 'best_test_accuracy': max(accs + [final]),
      'last_epoch_test_accuracy': accs[-1], 'round_test_accuracy': round_acc,
      'step_name': 'epoch', 'rounds': s.rounds, 'epochs': s.epochs,
      'local_epochs': s.local_epochs, 'server_model': server_spec,
      'client_models': common.client_model_specs(ctx),
      'client_test_accuracy': common.accuracy_of_logits(client_logits, test_y).tolist(),
      # the mean-logit ensemble (DENSE's teacher), a reference for the students
      'teacher_ensemble_test_accuracy': float(common.accuracy_of_logits(
          np.asarray(combine_logits(client_logits)), test_y)),
      'upload_bytes_last_round': upload_bytes,
      'distill_seconds_this_invocation': time.perf_counter() - t_round}
  summary.update(method.summary(state, aux))
  return summary


def _save_samples(ctx: RunContext, images, r: int) -> None:
  from jfed.distill import plots
  x, y = images
  name = 'synthetic_samples.png' if r == 1 else f'synthetic_samples_round{r}.png'
  plots.plot_image_grid(ctx.workdir / name, x[:64], y[:64],
                        title=f'last synthetic batch (round {r})')


# ---------------------------------------------------------------------------------------------
# config helpers shared by the method modules
# ---------------------------------------------------------------------------------------------
def base_settings(ctx: RunContext, cfg, synthesis, kd: KDConfig, opt: OptConfig,
                  **kw) -> Settings:
  """The Settings fields every distillation method reads the same way from its sub-config."""
  values = dict(rounds=int(cfg.get('rounds', 1)), local_epochs=int(cfg.local_epochs),
                epochs=int(cfg.get('epochs', 1)), server_model=cfg.get('server_model', ''),
                init=cfg.get('init', 'random'), kd=kd, opt=opt,
                kd_batch=int(cfg.get('kd_batch', 256)), kd_data=cfg.get('kd_data', 'pool'),
                synthesis=synthesis, nz=int(cfg.get('nz', 256)), ngf=int(cfg.get('ngf', 64)),
                pool_quantize=bool(cfg.get('pool_quantize', True)))
  values.update(kw)
  return Settings(**values)


def synthesis_common(ctx: RunContext, cfg) -> dict:
  return dict(g_steps=int(cfg.g_steps), batch_size=int(cfg.synthesis_batch),
              lr_g=float(cfg.lr_g), crop_padding=crop_padding(ctx.dataset.input_shape),
              strategy=teacher_strategy(ctx))


def opt_config(cfg, prefix: str = 'kd_', name: str = 'sgd') -> OptConfig:
  g = lambda k, d: cfg.get(prefix + k, d)
  return OptConfig(name=g('optimizer', name), lr=float(g('lr', 0.01)),
                   momentum=float(g('momentum', 0.9)), weight_decay=float(g('weight_decay', 0.0)),
                   grad_clip=float(g('grad_clip', 0.0) or 0.0), b1=float(g('b1', 0.9)),
                   b2=float(g('b2', 0.999)), schedule=g('schedule', 'constant'))
