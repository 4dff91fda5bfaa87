"""jfed from Python: `jfed.run(method, config, dataset)` trains and returns the model.

    import jfed

    config = jfed.config('digits')            # jfed/configs/digits.py; 'digits:smoke' for seconds
    config.fedavg.rounds = 5
    result = jfed.run('fedavg', config)       # in memory; workdir=... to keep files and resume
    result.summary['final_test_accuracy']
    result.model.accuracy(x, y)               # the server model (flax module + variables)
    [r['test_accuracy'] for r in result.history]

`dataset` is the config's (None), a `jfed.data.Dataset`, or the arrays `(train_x, train_y,
test_x, test_y)` of images [N, H, W, C] (or [N, H, W]) in [0, 1] with integer labels.
`client_optimizer` replaces the configured client optimiser by an optax transformation.
"""

from typing import Any, List, NamedTuple, Optional, Sequence, Union

import ml_collections
import numpy as np
import optax

from jfed import driver
from jfed.api import Record, RunSummary
from jfed.configs import named_config
from jfed.data import Dataset
from jfed.engine.evaluation import TrainedModel
from jfed.errors import ConfigError, DataError
from jfed.reporting import progress_lines

Arrays = Sequence[np.ndarray]


class RunResult(NamedTuple):
  """What `run` returns.

  Attributes:
    summary: final and best test accuracy, bytes, time and the method's extras (summary.json).
    history: every record of the run, in order (metrics.jsonl's lines).
    state: the method's final state (the pytree it checkpoints).
    model: the server model, or None where the method ends with client models only
      (`jfed.api.Algorithm.trained_model`).
  """

  summary: RunSummary
  history: List[Record]
  state: Any
  model: Optional[TrainedModel]


def config(name: str = 'digits', arg: str = '') -> ml_collections.ConfigDict:
  """jfed's config `name` (a file of jfed/configs: 'digits', 'fashion_mnist', 'fedhydra_digits',
  ...) with its variant argument; 'digits:smoke' is the same as ('digits', 'smoke')."""
  return named_config(name, arg)


def dataset_from_arrays(
  train_x: np.ndarray,
  train_y: np.ndarray,
  test_x: np.ndarray,
  test_y: np.ndarray,
  name: str = 'arrays',
  num_classes: Optional[int] = None,
) -> Dataset:
  """A `Dataset` of a user's arrays, checked.

  Args:
    train_x: training images [N, H, W, C] or [N, H, W], float in [0, 1] or uint8 in [0, 255].
    train_y: integer labels [N] in [0, num_classes).
    test_x: test images, as train_x.
    test_y: test labels.
    name: the dataset's name in summaries and plots.
    num_classes: None: one more than the largest label.

  Returns:
    The dataset (float32 images in [0, 1], int32 labels).
  """
  xs, ys = [], []
  for split, x, y in (('train', train_x, train_y), ('test', test_x, test_y)):
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 3:
      x = x[..., None]
    if x.ndim != 4 or len(x) != len(y) or y.ndim != 1 or not len(y):
      raise DataError(
        f'{split}: images [N, H, W, C] and labels [N] expected; got {x.shape} and {y.shape}'
      )
    if x.dtype == np.uint8:
      x = x.astype(np.float32) / 255.0
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)) or x.min() < 0 or x.max() > 1:
      raise DataError(f'{split}: float images must lie in [0, 1] (uint8 is scaled by 1/255)')
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
      raise DataError(f'{split}: labels must be non-negative integers')
    xs.append(x)
    ys.append(y.astype(np.int32))
  if xs[0].shape[1:] != xs[1].shape[1:]:
    raise DataError(f'train and test images differ in shape: {xs[0].shape} vs {xs[1].shape}')
  classes = int(max(ys[0].max(), ys[1].max())) + 1 if num_classes is None else int(num_classes)
  if max(ys[0].max(), ys[1].max()) >= classes:
    raise DataError(f'labels reach {max(ys[0].max(), ys[1].max())} but num_classes={classes}')
  return Dataset(name, xs[0], ys[0], xs[1], ys[1], classes)


def run(
  method: str,
  config: Union[ml_collections.ConfigDict, str, None] = None,
  dataset: Union[Dataset, Arrays, None] = None,
  *,
  workdir: Optional[str] = None,
  client_optimizer: Optional[optax.GradientTransformation] = None,
  progress: bool = False,
) -> RunResult:
  """Runs `method` and returns its summary, history, final state and server model.

  Args:
    method: a registered method ('fedavg', 'dense', 'fedhydra', ...; `jfed.methods.available_
      methods()`, or one registered with `jfed.methods.register_method`).
    config: the run config, or the name of one of jfed's ('digits:smoke'); None: 'digits'.
    dataset: None (the config's `dataset.name`), a `Dataset`, or the arrays (train_x, train_y,
      test_x, test_y).
    workdir: where checkpoints, metrics, summary and figures go, so that calling again resumes
      (as the command line does); None runs in memory and writes nothing.
    client_optimizer: an optax transformation for every client's local training instead of the
      configured `optimizer` (in memory only: a workdir could not tell it apart on a resume).
    progress: print a line per step and the progress of long work (local training, ...).

  Returns:
    The `RunResult`.

  Raises:
    ConfigError: a bad config, method or argument combination (one line saying which).
  """
  if config is None or isinstance(config, str):
    config = named_config(*(config or 'digits').partition(':')[::2])
  if dataset is not None and not isinstance(dataset, Dataset):
    if len(dataset) != 4:
      raise ConfigError('dataset: a Dataset or (train_x, train_y, test_x, test_y) expected')
    dataset = dataset_from_arrays(*dataset)
  if client_optimizer is not None:
    if workdir is not None:
      raise ConfigError('client_optimizer runs in memory only (workdir=None)')
    if not isinstance(client_optimizer, optax.GradientTransformation):
      raise ConfigError(
        f'client_optimizer must be an optax.GradientTransformation, not '
        f'{type(client_optimizer).__name__}'
      )
    shared = [k for k in ('local_models_dir', 'local_cvaes_dir') if config.get(k)]
    if shared:
      raise ConfigError(f'client_optimizer runs in memory only: unset {", ".join(shared)}')
  with progress_lines(progress):
    return _run(method, config, dataset, workdir, client_optimizer, progress)


def _run(method, config, dataset, workdir, client_optimizer, progress) -> RunResult:
  if workdir is not None:
    if dataset is not None:
      raise ConfigError(
        "a run with a workdir loads the config's dataset (dataset.name, dataset.data_dir), "
        'so that a resume reads the same; pass dataset only in memory (workdir=None)'
      )
    finished = driver.experiment_to_end(method, config, workdir, progress)
  else:
    algorithm = driver.build_algorithm(method, config)
    ctx = driver.context_of_config(config, dataset)
    if client_optimizer is not None:
      ctx.run = ctx.run._replace(optimizer=ctx.run.optimizer._replace(transform=client_optimizer))
    finished = driver.run_to_end(algorithm, ctx, progress)
  return RunResult(finished.summary, list(finished.history), finished.state, finished.model)
