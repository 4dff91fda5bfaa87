"""What a client sends to the server: typed, serialised with msgpack, validated on arrival.

Communication cost is measured from these real serialised bytes (never estimated from parameter
counts), and the server rejects a malformed upload with a clear error instead of crashing later.
"""

from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np


class UploadError(ValueError):
  """An upload does not match what the server expects."""


class ModelUpload(NamedTuple):
  client_id: int
  num_samples: int
  model: Any  # ModelState of one client


class DecoderUpload(NamedTuple):
  """A CVAE client's upload (FedMHO §4.2, FedCVAE): its decoder and label distribution.

  The label distribution travels as class counts (pmf = counts / num_samples); FedCVAE's data
  share n_k / N is num_samples over the sum of every uploader's num_samples.
  """

  client_id: int
  num_samples: int
  decoder: Any  # params of the decoder submodule
  label_counts: Any  # [num_classes] int32
  decoder_stats: Any = None  # its BatchNorm running statistics (FedCVAE's v0); None: no BN


def serialize(tree: Any) -> bytes:
  return flax.serialization.msgpack_serialize(
    flax.serialization.to_state_dict(jax.tree.map(np.asarray, tree))
  )


def serialized_nbytes(tree: Any) -> int:
  return len(serialize(tree))


def validate_tree(tree: Any, template: Any, what: str = 'upload') -> None:
  """Raises UploadError unless `tree` matches the template's structure, shapes and dtypes.

  Floating leaves must also be finite.
  """
  got_struct, want_struct = jax.tree.structure(tree), jax.tree.structure(template)
  if got_struct != want_struct:
    raise UploadError(f'{what}: structure {got_struct} differs from the expected {want_struct}')
  paths = jax.tree_util.tree_flatten_with_path(template)[0]
  for (path, want), got in zip(paths, jax.tree.leaves(tree)):
    name = jax.tree_util.keystr(path)
    if jnp.shape(got) != jnp.shape(want) or jnp.result_type(got) != jnp.result_type(want):
      raise UploadError(
        f'{what}: {name} is {jnp.result_type(got)}{list(jnp.shape(got))}, '
        f'expected {jnp.result_type(want)}{list(jnp.shape(want))}'
      )
    # On the host, like the bytes sent: an eager jnp check compiles a program per leaf shape.
    if jnp.issubdtype(jnp.result_type(got), jnp.inexact) and not np.isfinite(np.asarray(got)).all():
      raise UploadError(f'{what}: {name} has non-finite values')


def validate_model_upload(upload: ModelUpload, template: Any) -> None:
  what = f'upload of client {upload.client_id}'
  if upload.num_samples <= 0:
    raise UploadError(f'{what}: num_samples must be positive, got {upload.num_samples}')
  validate_tree(upload.model, template, what)


def validate_decoder_upload(
  upload: DecoderUpload, template: Any, num_classes: int, template_stats: Any = None
) -> None:
  """Raises UploadError unless the decoder (and its BatchNorm statistics) match the templates
  and the label counts are num_classes non-negative integers summing to num_samples."""
  what = f'decoder upload of client {upload.client_id}'
  if upload.num_samples <= 0:
    raise UploadError(f'{what}: num_samples must be positive, got {upload.num_samples}')
  counts = np.asarray(upload.label_counts)
  if counts.shape != (num_classes,) or not np.issubdtype(counts.dtype, np.integer):
    raise UploadError(
      f'{what}: label_counts is {counts.dtype}{list(counts.shape)}, expected int[{num_classes}]'
    )
  if np.any(counts < 0) or int(counts.sum()) != int(upload.num_samples):
    raise UploadError(
      f'{what}: label_counts must be non-negative and sum to num_samples={upload.num_samples}, '
      f'got {counts.tolist()}'
    )
  validate_tree(upload.decoder, template, what)
  if template_stats or upload.decoder_stats:
    validate_tree(
      upload.decoder_stats or {}, template_stats or {}, f'{what} (BatchNorm statistics)'
    )


class PrototypeUpload(NamedTuple):
  """A FedProto client's upload (Tan et al., AAAI'22, reference-code.md §9.4): the mean
  embedding of each class it holds and its class counts (rows of absent classes are zero)."""

  client_id: int
  num_samples: int
  prototypes: Any  # [num_classes, D] float32
  label_counts: Any  # [num_classes] int32


class LogitsUpload(NamedTuple):
  """A FedMD client's upload (Li & Wang 2019, reference-code.md §9.5): its logits on the
  round's public alignment set."""

  client_id: int
  logits: Any  # [N_alignment, num_classes] float32


def _check_counts(what: str, counts: Any, num_samples: int, num_classes: int) -> np.ndarray:
  counts = np.asarray(counts)
  if counts.shape != (num_classes,) or not np.issubdtype(counts.dtype, np.integer):
    raise UploadError(
      f'{what}: label_counts is {counts.dtype}{list(counts.shape)}, expected int[{num_classes}]'
    )
  if np.any(counts < 0) or int(counts.sum()) != int(num_samples):
    raise UploadError(
      f'{what}: label_counts must be non-negative and sum to num_samples={num_samples}, '
      f'got {counts.tolist()}'
    )
  return counts


def validate_prototype_upload(upload: PrototypeUpload, num_classes: int, dim: int) -> None:
  """Raises UploadError unless the prototypes are finite float32[num_classes, dim], zero for the
  classes the client does not hold, and the counts are valid class counts of num_samples."""
  what = f'prototype upload of client {upload.client_id}'
  if upload.num_samples <= 0:
    raise UploadError(f'{what}: num_samples must be positive, got {upload.num_samples}')
  counts = _check_counts(what, upload.label_counts, upload.num_samples, num_classes)
  validate_tree(upload.prototypes, np.zeros((num_classes, dim), np.float32), what)
  absent = np.asarray(upload.prototypes)[counts == 0]
  if np.any(absent != 0):
    raise UploadError(f'{what}: prototypes of classes it does not hold must be zero')


def validate_logits_upload(upload: LogitsUpload, num_samples: int, num_classes: int) -> None:
  """Raises UploadError unless the logits are finite float32[num_samples, num_classes]."""
  what = f'logits upload of client {upload.client_id}'
  validate_tree(upload.logits, np.zeros((num_samples, num_classes), np.float32), what)
