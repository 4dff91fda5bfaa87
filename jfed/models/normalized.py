"""A classifier that normalises its input first: the authors' loaders' `Normalize` moved into
the model, so the data and every generated image stay in [0, 1] (`dataset.normalization`)."""

import flax.linen as nn


class InputNormalized(nn.Module):
  """`inner` applied to (x − mean) / std.

  The inner module shares this module's scope, so the variables (and a checkpoint of them) are
  exactly the inner model's, and its options (`num_classes`) stay readable.
  """

  inner: nn.Module
  mean: float
  std: float

  def setup(self):
    nn.share_scope(self, self.inner)

  @property
  def num_classes(self) -> int:
    return self.inner.num_classes

  def __call__(self, x, *args, **kwargs):
    return self.inner((x - self.mean) / self.std, *args, **kwargs)
