"""Checkpoints and client uploads."""

from jfed.io.checkpoint import Checkpointer
from jfed.io.uploads import (
  DecoderUpload,
  ModelUpload,
  UploadError,
  serialize,
  serialized_nbytes,
  validate_decoder_upload,
  validate_model_upload,
  validate_tree,
)
