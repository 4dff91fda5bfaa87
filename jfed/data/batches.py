"""Shuffled epochs of padded batches, shared by the server-side trainers of several families."""

from typing import Tuple

import numpy as np


def epoch_order(n: int, batch: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
  """([batches, batch] indices, [batches, batch] mask) of one shuffled epoch over n samples.

  Args:
    n: the number of samples.
    batch: the batch size; the last batch is padded with index 0 and masked out.
    rng: the generator that draws the permutation.

  Returns:
    The indices and the mask (True where the index is a real sample), batch by batch.
  """
  nb = max(1, -(-n // batch))
  idx = np.zeros(nb * batch, np.int32)
  mask = np.zeros(nb * batch, bool)
  idx[:n], mask[:n] = rng.permutation(n), True
  return idx.reshape(nb, batch), mask.reshape(nb, batch)
