"""A run's generated training set on disk (workdir/synthetic.npz), for
`experiments.generator_check`: the images as uint8 in 1/255 steps, their labels and the indices
a filter kept (all where there is none). Written by every method that trains on generated data
from a conditional generator: FedMHO, FedCVAE (CVAE decoders) and FedTSA (its Stage-2 images).
"""

import io
import pathlib
from typing import Optional

import numpy as np

from jfed.workdir import atomic_write_bytes

SYNTHETIC_FILE = 'synthetic.npz'


def save_synthetic(
  path: Optional[pathlib.Path],
  images: np.ndarray,
  labels: np.ndarray,
  kept: Optional[np.ndarray] = None,
) -> None:
  """Writes the generated set to `path` atomically; nothing when `path` is None (a run in memory,
  or a process other than the primary).

  Args:
    path: The file to write, usually `ctx.output_path(SYNTHETIC_FILE)`.
    images: The generated images, [N, H, W, C] in [0, 1] (clipped).
    labels: Their conditioned classes, [N].
    kept: The indices a filter kept; None for all.
  """
  if path is None:
    return
  buffer = io.BytesIO()
  np.savez_compressed(
    buffer,
    images=np.round(np.clip(images, 0.0, 1.0) * 255).astype(np.uint8),
    labels=np.asarray(labels, np.int32),
    kept=np.arange(len(labels)) if kept is None else np.asarray(kept, np.int64),
  )
  atomic_write_bytes(path, buffer.getvalue())
