"""FedAvg (McMahan et al.) and FedProx (Li et al.): one-shot (rounds=1) or multi-round.

Each round: the selected clients start from the global model, train `local_epochs` epochs on
their own data (FedProx adds mu/2 ||w - w_global||^2), upload their models, and the server
averages them weighted by client size. The global model is checkpointed after every round.

`reuse_local_models` (one-shot FedAvg only): average the shared one-shot client models
(`common.local_models`, read from `local_models_dir` when set) instead of training the clients
again. FedHydra's tables compare every method on the same local models; this also saves one
round of local training per partition in `experiments.fedhydra_tables`.
"""
import time

import jax
import numpy as np

from jfed import engine
from jfed.methods import common
from jfed.methods.context import KEY_MODEL_INIT, KEY_ROUNDS, KEY_SAMPLING, RunContext
from jfed.methods.registry import register_method


def select_clients(key: jax.Array, num_clients: int, participation: float) -> np.ndarray:
  """Seeded client sampling: round(participation * n) clients (at least one), sorted."""
  if not 0.0 < participation <= 1.0:
    raise ValueError(f'participation must be in (0, 1], got {participation}')
  count = max(1, int(round(participation * num_clients)))
  if count == num_clients:
    return np.arange(num_clients)
  return np.sort(np.asarray(jax.random.choice(key, num_clients, (count,), replace=False)))


def single_architecture(ctx: RunContext) -> str:
  specs = set(common.client_model_specs(ctx))
  if len(specs) != 1:
    raise ValueError(f'Parameter averaging needs one architecture; clients use {sorted(specs)}')
  return specs.pop()


def oneshot_from_local_models(ctx: RunContext, cfg) -> dict:
  """One-shot FedAvg as the size-weighted average of the shared local models."""
  if cfg.rounds != 1 or cfg.get('participation', 1.0) != 1.0:
    raise ValueError('reuse_local_models needs rounds = 1 and participation = 1 (one-shot FedAvg '
                     f'over every client); got rounds = {cfg.rounds}, participation = '
                     f"{cfg.get('participation', 1.0)}")
  single_architecture(ctx)
  t0 = time.perf_counter()
  local = common.local_models(ctx, cfg.local_epochs)
  (group,), (models,) = local.groups, local.models
  global_model = engine.weighted_average(models, group.fed.sizes)
  accuracy = common.test_accuracy(ctx, group.module, global_model)
  ctx.metrics.truncate_after(0)
  ctx.metrics.write({
      'step': 1, 'round': 1, 'test_accuracy': accuracy, 'clients': ctx.num_clients,
      'upload_bytes': local.upload_bytes, 'download_bytes': 0,
      'seconds': time.perf_counter() - t0})
  print(f'one-shot average of the shared local models: test accuracy {accuracy:.4f}', flush=True)
  return {'final_test_accuracy': accuracy, 'best_test_accuracy': accuracy, 'rounds': 1,
          'total_bytes': local.upload_bytes, 'step_name': 'round', 'reused_local_models': True}


def run_rounds(ctx: RunContext, cfg, prox_mu: float = 0.0) -> dict:
  if cfg.get('reuse_local_models', False):
    if prox_mu:
      raise ValueError('reuse_local_models is for one-shot FedAvg, not FedProx')
    return oneshot_from_local_models(ctx, cfg)
  single_architecture(ctx)
  full_group = common.client_groups(ctx)[0]
  module = full_group.module
  init = engine.init_model(module, ctx.dataset.input_shape, ctx.derive_key(KEY_MODEL_INIT, 0))
  ckpt = ctx.checkpointer()
  start, global_model = ckpt.restore_latest(init)
  start = start or 0
  ctx.metrics.truncate_after(start)
  trainer = common.make_trainers(ctx, [full_group], prox_mu)[0]
  evaluator = engine.Evaluator(module, ctx.config.eval_batch_size, ctx.config.strategy)
  participation = cfg.get('participation', 1.0)
  for r in range(start, cfg.rounds):
    t0 = time.perf_counter()
    key = ctx.derive_key(KEY_ROUNDS, r)
    selected = select_clients(ctx.derive_key(KEY_SAMPLING, r), ctx.num_clients, participation)
    group = full_group if len(selected) == ctx.num_clients else common.client_groups(ctx, selected)[0]
    starts = engine.replicate(global_model, len(selected))
    anchors = [global_model.params] if prox_mu else None
    (models,), (metrics,) = common.train_groups([trainer], [group], [starts], cfg.local_epochs,
                                                key, anchors, label=f'round {r + 1}/{cfg.rounds}')
    upload_bytes = common.receive_uploads([group], [models], [init])
    global_model = engine.weighted_average(models, group.fed.sizes)
    accuracy = evaluator.accuracy(global_model, ctx.dataset.test_x, ctx.dataset.test_y)
    download_bytes = upload_bytes  # the new global model goes back to the same clients
    ctx.metrics.write({
        'step': r + 1, 'round': r + 1, 'test_accuracy': accuracy,
        'train_loss': float(np.mean(metrics.loss[:, -1])),
        'clients': len(selected), 'upload_bytes': upload_bytes,
        'download_bytes': download_bytes, 'seconds': time.perf_counter() - t0})
    ckpt.save(r + 1, global_model)
    print(f'round {r + 1}/{cfg.rounds}: test accuracy {accuracy:.4f} '
          f'({time.perf_counter() - t0:.1f}s)', flush=True)
  ckpt.close()
  history = ctx.metrics.read()
  accs = [h['test_accuracy'] for h in history]
  return {
      'final_test_accuracy': accs[-1], 'best_test_accuracy': max(accs), 'rounds': cfg.rounds,
      'total_bytes': sum(h['upload_bytes'] + h['download_bytes'] for h in history),
      'step_name': 'round'}


@register_method('fedavg')
def fedavg(ctx: RunContext) -> dict:
  return run_rounds(ctx, ctx.config.fedavg)


@register_method('fedprox')
def fedprox(ctx: RunContext) -> dict:
  return run_rounds(ctx, ctx.config.fedprox, prox_mu=ctx.config.fedprox.mu)
