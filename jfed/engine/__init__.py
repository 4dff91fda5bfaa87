"""Client groups, client-map strategies, sharding, evaluation and aggregation."""

from jfed.engine.aggregation import weighted_average
from jfed.engine.evaluation import BatchNormStatistics, Evaluator, TrainedModel
from jfed.engine.optim import (
  OptimizerSpec,
  SpecOptimizer,
  build_optimizer,
  make_optimizer,
  optimizer_spec,
)
from jfed.engine.sharding import client_mesh
from jfed.engine.state import (
  ModelState,
  TrainState,
  commit,
  init_model,
  init_models,
  init_train_state,
  num_stacked,
  replicate,
  stack,
  take,
  unstack,
)
from jfed.engine.training import (
  STRATEGIES,
  ClientProgram,
  GroupTrainer,
  LocalObjective,
  TrainMetrics,
  classification_objective,
  default_loop_threads,
  resolve_strategy,
)
