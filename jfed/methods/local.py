"""Local: each client's own model on the global test set (FedHydra Table 3's M1..Mm columns)."""
import numpy as np

from jfed.methods import common
from jfed.methods.context import RunContext
from jfed.methods.registry import register_method


@register_method('local')
def local(ctx: RunContext) -> dict:
  models = common.local_models(ctx, ctx.config.local.epochs)
  acc = common.client_accuracies(ctx, models)
  specs = common.client_model_specs(ctx)
  for k, a in enumerate(acc):
    ctx.metrics.write({'step': k + 1, 'client': k, 'model': specs[k], 'test_accuracy': float(a),
                       'train_size': int(ctx.client_sizes[k])})
  return {'client_test_accuracy': acc.tolist(), 'mean_test_accuracy': float(np.mean(acc)),
          'best_test_accuracy': float(np.max(acc)), 'final_test_accuracy': float(np.mean(acc)),
          'upload_bytes': models.upload_bytes, 'step_name': 'client'}
