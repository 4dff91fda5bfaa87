"""What a client sends to the server: typed, serialised with msgpack, validated on arrival.

Communication cost is measured from these real serialised bytes (never estimated from parameter
counts), and the server rejects a malformed upload with a clear error instead of crashing later.

Validation is strict, because an upload is untrusted input: the key paths, container types,
shapes and exact dtypes must be the template's (a float64 leaf is refused, not cast), floating
values must be finite, `num_samples` must be a positive integer no larger than what the client
holds, and a model update may be bounded relative to the global model. Every refusal is an
`UploadError` whose one-line message names the client and the offending key path.
"""

from collections.abc import Mapping
import math
import numbers
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

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


# ------------------------------------------------------------------------------------------------
# structure
# ------------------------------------------------------------------------------------------------
# At most this many key paths are named per list in a structure message; the rest are counted.
_MAX_NAMED = 4


def _name(path: Sequence[Any]) -> str:
  # A NamedTuple field renders as '.params'; messages read better as "params['Dense_0']".
  return jax.tree_util.keystr(tuple(path)).lstrip('.') or 'value'


def _is_none(x: Any) -> bool:
  return x is None


def _leaves_with_paths(tree: Any) -> List[Tuple[Tuple[Any, ...], Any]]:
  """(key path, leaf) pairs; None counts as a leaf (so that it is named where an array is due),
  and mappings that are not registered pytrees (JAX would take them for leaves) are opened, so
  their keys can be named too."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)[0]:
    if isinstance(leaf, Mapping):
      try:
        items = sorted(leaf.items(), key=lambda kv: str(kv[0]))
      except Exception:  # a hostile mapping: left a leaf, which the dtype check names
        out.append((path, leaf))
        continue
      for key, value in items:
        out.extend(
          (path + (jax.tree_util.DictKey(key),) + sub, v) for sub, v in _leaves_with_paths(value)
        )
    else:
      out.append((path, leaf))
  return out


def _some(names: Sequence[str]) -> str:
  shown = ', '.join(names[:_MAX_NAMED])
  return shown + (f' and {len(names) - _MAX_NAMED} more' if len(names) > _MAX_NAMED else '')


def _children(x: Any) -> Optional[List[Tuple[Any, Any]]]:
  """x's children as (key, child), or None when JAX takes x for a leaf (None is a container
  without children)."""
  children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
  if len(children) == 1 and children[0][1] is x:
    return None
  return [(path[0], child) for path, child in children]


def _key_label(key: Any) -> str:
  for attr in ('key', 'name', 'idx'):  # DictKey, GetAttrKey, SequenceKey
    if hasattr(key, attr):
      return repr(getattr(key, attr))
  return str(key)


def _container_mismatch(got: Any, want: Any, path: Tuple[Any, ...] = ()) -> Optional[str]:
  """Where the upload's containers differ from the template's although the key paths of their
  leaves agree (a dict where a FrozenDict is due, an empty subtree more or less)."""
  want_children = _children(want)
  if want_children is None:
    return None
  want_desc = f'a {type(want).__name__} of [{", ".join(_key_label(k) for k, _ in want_children)}]'
  got_children = _children(got)
  if got_children is None:
    return f'{_name(path)} is a {type(got).__name__} (not a pytree container), expected {want_desc}'
  got_desc = f'a {type(got).__name__} of [{", ".join(_key_label(k) for k, _ in got_children)}]'
  if got_desc != want_desc or type(got) is not type(want):
    return f'{_name(path)} is {got_desc}, expected {want_desc}'
  for (key, g), (_, w) in zip(got_children, want_children):
    found = _container_mismatch(g, w, path + (key,))
    if found:
      return found
  return None


# ------------------------------------------------------------------------------------------------
# leaves
# ------------------------------------------------------------------------------------------------
def _describe(dtype: np.dtype, shape: Sequence[int]) -> str:
  kind = dtype.name if dtype.kind in 'biufcV' else dtype.str  # V: bfloat16 and kin
  return f'{kind}{list(shape)}'


def _spec(x: Any) -> Tuple[np.dtype, Tuple[int, ...]]:
  """A template leaf's dtype and shape, read without a device-to-host copy."""
  if hasattr(x, 'dtype') and hasattr(x, 'shape'):
    return np.dtype(x.dtype), tuple(x.shape)
  a = np.asarray(x)
  return a.dtype, a.shape


def _host_array(what: str, name: str, leaf: Any, expected: str) -> np.ndarray:
  """The upload's leaf as a host array; anything that is not one is an UploadError."""
  if leaf is None:
    raise UploadError(f'{what}: {name} is None, expected {expected}')
  try:
    # On the host, like the bytes sent: an eager jnp check compiles a program per leaf shape.
    return np.asarray(leaf)
  except Exception as e:  # untrusted input: any failure to convert is a refusal
    raise UploadError(
      f'{what}: {name} is a {type(leaf).__name__} that is not an array ({e}), expected {expected}'
    ) from None


def validate_tree(tree: Any, template: Any, what: str = 'upload') -> None:
  """Raises UploadError unless `tree` matches the template exactly.

  The key paths of the leaves, the container types, the shapes and the dtypes (numpy's, with no
  canonicalisation: float64 is not float32) must be the template's, and floating leaves must be
  finite. Messages name the key path: "upload of client 3: params['Dense_0']['kernel'] is
  float64[64, 10], expected float32[64, 10]".
  """
  got = _leaves_with_paths(tree)
  want = _leaves_with_paths(template)
  got_names = {_name(p): leaf for p, leaf in got}
  want_names = {_name(p): leaf for p, leaf in want}
  missing = [n for n in want_names if n not in got_names]
  unexpected = [n for n in got_names if n not in want_names]
  if missing or unexpected:
    parts = ([f'missing {_some(missing)}'] if missing else []) + (
      [f'unexpected {_some(unexpected)}'] if unexpected else []
    )
    raise UploadError(f'{what}: structure differs from the template: {"; ".join(parts)}')
  if jax.tree.structure(tree, is_leaf=_is_none) != jax.tree.structure(template, is_leaf=_is_none):
    found = _container_mismatch(tree, template)
    raise UploadError(f'{what}: structure differs from the template: {found or "containers"}')
  for name, want_leaf in want_names.items():
    got_leaf = got_names[name]
    if want_leaf is None:
      if got_leaf is not None:
        raise UploadError(f'{what}: {name} is a {type(got_leaf).__name__}, expected None')
      continue
    dtype, shape = _spec(want_leaf)
    expected = _describe(dtype, shape)
    a = _host_array(what, name, got_leaf, expected)
    if a.dtype != dtype or a.shape != shape:
      plain = isinstance(got_leaf, (np.ndarray, np.generic, jax.Array))
      kind = '' if plain else f' ({type(got_leaf).__name__})'
      raise UploadError(
        f'{what}: {name} is {_describe(a.dtype, a.shape)}{kind}, expected {expected}'
      )
    if jnp.issubdtype(dtype, jnp.inexact) and not np.isfinite(a).all():
      raise UploadError(f'{what}: {name} has non-finite values')


# ------------------------------------------------------------------------------------------------
# num_samples and the update norm
# ------------------------------------------------------------------------------------------------
def check_num_samples(what: str, num_samples: Any, max_samples: Optional[int] = None) -> int:
  """`num_samples` as an int; UploadError unless it is a positive integer (Python or NumPy, not
  bool, float or str) and, when `max_samples` is given, at most `max_samples`."""
  is_int = isinstance(num_samples, (numbers.Integral, np.integer)) and not isinstance(
    num_samples, (bool, np.bool_)
  )
  if not is_int:
    raise UploadError(
      f'{what}: num_samples must be a positive integer, '
      f'got {num_samples!r} ({type(num_samples).__name__})'
    )
  n = int(num_samples)
  if n <= 0:
    raise UploadError(f'{what}: num_samples must be a positive integer, got {n}')
  if max_samples is not None and n > int(max_samples):
    raise UploadError(
      f'{what}: num_samples = {n} exceeds the {int(max_samples)} samples the client holds'
    )
  return n


def _floating_leaves(tree: Any) -> Dict[str, Any]:
  return {
    _name(p): leaf
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if jnp.issubdtype(_spec(leaf)[0], jnp.inexact)
  }


def update_norms(model: Any, reference: Any) -> Tuple[float, float]:
  """(||model − reference||_2, ||reference||_2) over every floating leaf together (parameters
  and BatchNorm statistics of a ModelState), in float64 on the host."""
  got, ref = _floating_leaves(model), _floating_leaves(reference)
  if set(got) != set(ref):
    raise ValueError(
      "the reference model does not have the upload template's floating leaves: "
      f'{_some(sorted(set(got) ^ set(ref)))}'
    )
  delta_sq = ref_sq = 0.0
  for name, r in ref.items():
    r = np.asarray(r, np.float64)
    d = np.asarray(got[name], np.float64) - r
    delta_sq += float(np.vdot(d, d))
    ref_sq += float(np.vdot(r, r))
  return math.sqrt(delta_sq), math.sqrt(ref_sq)


def validate_model_upload(
  upload: ModelUpload,
  template: Any,
  *,
  max_samples: Optional[int] = None,
  reference: Any = None,
  max_update_norm_ratio: Optional[float] = None,
) -> None:
  """Raises UploadError unless `upload` is a well-formed model from a client.

  Args:
    upload: the client's upload.
    template: the structure, shapes and exact dtypes its model must have (see validate_tree).
    max_samples: the most samples the client may claim (what its partition holds); None: any
      positive integer.
    reference: the global model the client started from (the template's structure); needed by
      `max_update_norm_ratio`.
    max_update_norm_ratio: when given (> 0), the update bound: the upload is refused when
      ||model − reference||_2 > max_update_norm_ratio · max(||reference||_2, 1e-12), both norms
      over every floating leaf together (parameters and BatchNorm statistics), computed on the
      host in float64. Catches scaled and sign-flipped models (θ · 1e30, θ · −100) that are
      finite and well-shaped.

  Raises:
    UploadError: the upload is malformed; the message names the client and what is wrong.
    ValueError: `max_update_norm_ratio` without a `reference`, or a non-positive ratio.
  """
  what = f'upload of client {upload.client_id}'
  check_num_samples(what, upload.num_samples, max_samples)
  validate_tree(upload.model, template, what)
  if max_update_norm_ratio is None:
    return
  if reference is None:
    raise ValueError('max_update_norm_ratio needs the reference (global) model')
  if not max_update_norm_ratio > 0:
    raise ValueError(f'max_update_norm_ratio must be positive, got {max_update_norm_ratio}')
  delta, ref = update_norms(upload.model, reference)
  bound = max_update_norm_ratio * max(ref, 1e-12)
  if not delta <= bound:
    raise UploadError(
      f'{what}: update norm ||model - global|| = {delta:.6g} exceeds '
      f'{max_update_norm_ratio:g} x ||global|| = {max_update_norm_ratio:g} x {ref:.6g} '
      f'= {bound:.6g}'
    )


def validate_decoder_upload(
  upload: DecoderUpload,
  template: Any,
  num_classes: int,
  template_stats: Any = None,
  *,
  max_samples: Optional[int] = None,
) -> None:
  """Raises UploadError unless the decoder (and its BatchNorm statistics) match the templates
  and the label counts are num_classes non-negative integers summing to num_samples (a positive
  integer, at most `max_samples` when given)."""
  what = f'decoder upload of client {upload.client_id}'
  n = check_num_samples(what, upload.num_samples, max_samples)
  _check_counts(what, upload.label_counts, n, num_classes)
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
  counts = _host_array(what, 'label_counts', counts, f'int[{num_classes}]')
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


def validate_prototype_upload(
  upload: PrototypeUpload, num_classes: int, dim: int, *, max_samples: Optional[int] = None
) -> None:
  """Raises UploadError unless the prototypes are finite float32[num_classes, dim], zero for the
  classes the client does not hold, and the counts are valid class counts of num_samples (a
  positive integer, at most `max_samples` when given)."""
  what = f'prototype upload of client {upload.client_id}'
  n = check_num_samples(what, upload.num_samples, max_samples)
  counts = _check_counts(what, upload.label_counts, n, num_classes)
  validate_tree(upload.prototypes, np.zeros((num_classes, dim), np.float32), what)
  absent = np.asarray(upload.prototypes)[counts == 0]
  if np.any(absent != 0):
    raise UploadError(f'{what}: prototypes of classes it does not hold must be zero')


def validate_logits_upload(upload: LogitsUpload, num_samples: int, num_classes: int) -> None:
  """Raises UploadError unless the logits are finite float32[num_samples, num_classes]."""
  what = f'logits upload of client {upload.client_id}'
  validate_tree(upload.logits, np.zeros((num_samples, num_classes), np.float32), what)
