"""OT model fusion (Singh & Jaggi, NeurIPS'20; sidak/otfusion weight mode, reference-code.md §9.2)
as a one-shot FL baseline (FedHydra's "OT").

Each round: the clients' uploaded models (`oneshot.round_local_models`: round 1 trains every
client `local_epochs` from the shared init; round r > 1 starts every client from the previous
fused model) are fused by `jfed.distill.ot_fuse_states`: every model is aligned layer by layer
to the anchor client's neurons with an optimal-transport plan ('exact': assignment / transport
LP, 'sinkhorn': ott-jax entropic OT with `epsilon`) and the aligned models are averaged
(uniform weights as otfusion, or `weights='size'`). No server training. The fused model is
evaluated, checkpointed (resume per round) and, for multi-round runs, sent back to the clients.
For reference the metrics and summary also report the plain (unaligned) average of the same
uploads (`plain_average_test_accuracy`, same weights). Note: in the one-shot protocol every
client starts from ONE shared initial model (DENSE, FedHydra); after local training the
neurons usually still correspond, the exact OT plans are then permutation-free (measured on
digits, 20 local epochs: identity at every layer) and OT equals the plain average. otfusion's
own setting fuses independently initialised models.

Single architecture, sequential models only (cnn_mnist / fedhydra_cnn2, lenet, mlp, cnn_cifar,
fedhydra_cnn3): the fused layers are the model's Conv/Dense layers in creation order, each
followed BatchNorm transported with it; residual / inception models are refused with a message.

Config (`config.ot`): rounds, local_epochs, method, epsilon, anchor, skip_last_layer, weights,
squared, bias_in_cost.
"""
import time

import numpy as np

from jfed import engine
from jfed.distill import FusionLayer, ot_fuse_states
from jfed.methods import common, oneshot
from jfed.methods.context import KEY_MODEL_INIT, RunContext
from jfed.methods.fedavg import single_architecture
from jfed.methods.registry import register_method


def fusion_layers(module, input_shape, key) -> list:
  """The Conv/Dense layers of a sequential model in forward (creation) order, each with the
  BatchNorm that follows it."""
  params = engine.init_model(module, input_shape, key).params
  layers = []
  for name, sub in params.items():
    keys = set(sub)
    if 'kernel' in keys and keys <= {'kernel', 'bias'}:
      layers.append(FusionLayer(name))
    elif name.startswith('BatchNorm') and layers and layers[-1].bn is None:
      layers[-1] = FusionLayer(layers[-1].name, name)
    else:
      raise ValueError(f'OT fusion handles sequential Conv/Dense(+BatchNorm) models only; '
                       f'{type(module).__name__} has the submodule {name!r}')
  return layers


@register_method('ot')
def ot(ctx: RunContext) -> dict:
  cfg = ctx.config.ot
  spec = single_architecture(ctx)
  module = common.build_module(spec, ctx.dataset)
  layers = fusion_layers(module, ctx.dataset.input_shape, ctx.derive_key(KEY_MODEL_INIT, 0))
  if cfg.weights not in ('uniform', 'size'):
    raise ValueError(f"ot.weights must be 'uniform' or 'size', got {cfg.weights!r}")
  evaluator = engine.Evaluator(module, ctx.config.eval_batch_size, ctx.config.strategy)
  template = engine.init_model(module, ctx.dataset.input_shape, ctx.derive_key(KEY_MODEL_INIT, 0))
  ckpt = ctx.checkpointer()
  start, global_model = ckpt.restore_latest(template)
  start = start or 0
  ctx.metrics.truncate_after(start)
  local = None
  for r in range(start + 1, int(cfg.rounds) + 1):
    t0 = time.perf_counter()
    local = oneshot.round_local_models(ctx, r, int(cfg.local_epochs), spec,
                                       global_model if r > 1 else None)
    models, sizes = local.models[0], local.groups[0].fed.sizes
    weights = None if cfg.weights == 'uniform' else np.asarray(sizes, np.float64)
    t_fuse = time.perf_counter()
    global_model = ot_fuse_states(models, layers, method=cfg.method, epsilon=float(cfg.epsilon),
                                  anchor=int(cfg.anchor), weights=weights,
                                  skip_last_layer=bool(cfg.skip_last_layer),
                                  squared=bool(cfg.squared), bias_in_cost=bool(cfg.bias_in_cost))
    fuse_seconds = time.perf_counter() - t_fuse
    plain = engine.weighted_average(models, np.ones(len(sizes)) if weights is None else sizes)
    accuracy = evaluator.accuracy(global_model, ctx.dataset.test_x, ctx.dataset.test_y)
    plain_accuracy = evaluator.accuracy(plain, ctx.dataset.test_x, ctx.dataset.test_y)
    ctx.metrics.write({'step': r, 'round': r, 'test_accuracy': accuracy,
                       'plain_average_test_accuracy': plain_accuracy,
                       'upload_bytes': local.upload_bytes, 'fusion_seconds': fuse_seconds,
                       'seconds': time.perf_counter() - t0})
    ckpt.save(r, global_model)
    print(f'ot round {r}/{cfg.rounds}: test accuracy {accuracy:.4f} (plain average '
          f'{plain_accuracy:.4f}, fusion {fuse_seconds:.1f}s)', flush=True)
  ckpt.close()
  if local is None:
    local = oneshot.round_local_models(ctx, int(cfg.rounds), int(cfg.local_epochs), spec, None)
  history = ctx.metrics.read()
  accs = [h['test_accuracy'] for h in history]
  return {'final_test_accuracy': accs[-1], 'best_test_accuracy': max(accs),
          'plain_average_test_accuracy': history[-1]['plain_average_test_accuracy'],
          'round_test_accuracy': accs, 'rounds': int(cfg.rounds),
          'local_epochs': int(cfg.local_epochs), 'ot_method': cfg.method,
          'fused_layers': [l.name for l in layers],
          'client_test_accuracy': common.client_accuracies(ctx, local).tolist(),
          'upload_bytes': sum(h['upload_bytes'] for h in history), 'step_name': 'round'}
