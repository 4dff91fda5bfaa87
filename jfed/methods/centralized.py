"""Centralized training: the upper bound, all training data, same model, optimiser and epochs."""
import time

import numpy as np

from jfed import engine
from jfed.data import federate
from jfed.methods import common
from jfed.methods.context import KEY_LOCAL_TRAINING, KEY_MODEL_INIT, RunContext
from jfed.methods.fedavg import single_architecture
from jfed.methods.registry import register_method


@register_method('centralized')
def centralized(ctx: RunContext) -> dict:
  cfg = ctx.config.centralized
  spec = single_architecture(ctx)
  module = common.build_module(spec, ctx.dataset)
  ds = ctx.dataset
  fed = federate(ds.train_x, ds.train_y, [np.arange(len(ds.train_y))])
  group = common.ClientGroup(spec, module, np.array([0]), fed)
  steps_per_epoch = -(-len(ds.train_y) // ctx.config.batch_size)
  trainer = common.make_trainers(ctx, [group], total_steps=cfg.epochs * steps_per_epoch)[0]
  init = engine.init_models(module, ds.input_shape, ctx.derive_key(KEY_MODEL_INIT, 0), 1)
  # The optimiser state carries across epochs here, so it is part of the checkpoint.
  ckpt = ctx.checkpointer()
  start, state = ckpt.restore_latest(engine.init_train_state(trainer.tx, init))
  start = start or 0
  ctx.metrics.truncate_after(start)
  evaluator = engine.Evaluator(module, ctx.config.eval_batch_size, ctx.config.strategy)
  for epoch in range(start, cfg.epochs):
    t0 = time.perf_counter()
    state, metrics = trainer.train(state, fed, 1, ctx.derive_key(KEY_LOCAL_TRAINING, epoch),
                                   progress=None)
    accuracy = evaluator.accuracy(engine.take(state.model, 0), ds.test_x, ds.test_y)
    ctx.metrics.write({'step': epoch + 1, 'epoch': epoch + 1, 'test_accuracy': accuracy,
                       'train_loss': float(metrics.loss[0, -1]),
                       'train_accuracy': float(metrics.accuracy[0, -1]),
                       'seconds': time.perf_counter() - t0})
    print(f'epoch {epoch + 1}/{cfg.epochs}: test accuracy {accuracy:.4f} '
          f'({time.perf_counter() - t0:.1f}s)', flush=True)
    ckpt.save(epoch + 1, state)
  ckpt.close()
  accs = [h['test_accuracy'] for h in ctx.metrics.read()]
  return {'final_test_accuracy': accs[-1], 'best_test_accuracy': max(accs),
          'epochs': cfg.epochs, 'step_name': 'epoch'}
