"""Everything a method needs to run, built once from the config by the runner."""
import pathlib
from typing import Any, List, NamedTuple, Optional

import jax
import ml_collections
import numpy as np

from jfed.data import Dataset
from jfed.io import Checkpointer
from jfed.reporting import MetricsWriter


class RunContext(NamedTuple):
  config: ml_collections.ConfigDict
  dataset: Dataset
  parts: List[np.ndarray]       # one index array into dataset.train_x per client
  workdir: pathlib.Path
  key: jax.Array                # root key; methods derive theirs with fold_in(key, purpose)
  metrics: MetricsWriter
  mesh: Optional[Any]           # jax.sharding.Mesh with a 'clients' axis, or None

  def checkpointer(self, name: str = 'checkpoints') -> Checkpointer:
    return Checkpointer(self.workdir / name)

  def derive_key(self, *path: int) -> jax.Array:
    key = self.key
    for p in path:
      key = jax.random.fold_in(key, p)
    return key

  @property
  def num_clients(self) -> int:
    return len(self.parts)

  @property
  def client_sizes(self) -> np.ndarray:
    return np.array([len(p) for p in self.parts])


# Purposes for fold_in on the root key, so every method derives independent streams.
KEY_MODEL_INIT = 1
KEY_LOCAL_TRAINING = 2
KEY_ROUNDS = 3
KEY_SERVER = 4
KEY_SAMPLING = 5
