"""Checkpoints and client uploads."""

from jfed.io.checkpoint import Checkpointer, saved_steps
from jfed.io.uploads import (
  DecoderUpload,
  LogitsUpload,
  ModelUpload,
  PrototypeUpload,
  UploadError,
  check_num_samples,
  serialize,
  serialized_nbytes,
  update_norms,
  validate_decoder_upload,
  validate_logits_upload,
  validate_model_upload,
  validate_prototype_upload,
  validate_tree,
)
