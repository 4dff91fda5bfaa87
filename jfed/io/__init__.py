"""Checkpoints and client uploads."""

from jfed.io.checkpoint import Checkpointer
from jfed.io.uploads import (
  ModelUpload,
  UploadError,
  serialize,
  serialized_nbytes,
  validate_model_upload,
  validate_tree,
)
