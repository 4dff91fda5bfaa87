"""What the table commands over seeds share (fedmho_tables, fedtsa_tables): loading the config
file they sweep, and the mean ± sample std over seeds of an accuracy, as text and for plots."""

import importlib.util
from typing import Optional, Sequence, Tuple

from absl import app
import numpy as np


def load_config_module(path: str, name: str):
  """The config file at `path` as a module named `name`; UsageError if it has no get_config."""
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise app.UsageError(f'--config={path!r}: not a Python file')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_config'):
    raise app.UsageError(f'--config={path!r} has no get_config')
  return module


def percent_stats(values: Sequence[float]) -> Tuple[float, float]:
  """Mean and sample std (ddof 1; 0 for one seed) of accuracies in [0, 1], in %; NaN mean for
  none."""
  v = 100 * np.asarray(values, np.float64)
  if not len(v):
    return float('nan'), 0.0
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def percent_stats_each(samples: Sequence[Sequence[float]]) -> Tuple[np.ndarray, np.ndarray]:
  """`percent_stats` of every sample (a bar or a point of a plot): means and stds, [n] each."""
  stats = np.array([percent_stats(v) for v in samples], np.float64).reshape(-1, 2)
  return stats[:, 0], stats[:, 1]


def mean_std(values: Sequence[float]) -> Optional[str]:
  """'mean ± std' in % with 2 decimals, or None for no values."""
  if not len(values):
    return None
  mean, std = percent_stats(values)
  return f'{mean:.2f} ± {std:.2f}'
