"""What a client sends to the server: typed, serialised with msgpack, validated on arrival.

Communication cost is measured from these real serialised bytes (never estimated from parameter
counts), and the server rejects a malformed upload with a clear error instead of crashing later.

Validation is strict, because an upload is untrusted input: the key paths, container types
and keys, shapes and exact dtypes must be the template's (a float64 leaf is refused, not cast),
every leaf must be an array, floating values must be finite, `num_samples` must be a positive
integer no larger than what the client holds, and a model update may be bounded relative to the
global model. The upload's structure is read without JAX and compared with the template before
any leaf is flattened or converted, so that any input, however hostile (keys of mixed types,
cyclic or 10^4-deep nesting, objects whose methods raise), ends in a refusal: every refusal is
an `UploadError` whose one-line message names the client and the offending key path, and the
validators raise nothing else (tests/test_upload_fuzz.py).
"""

from collections.abc import Mapping
import math
import numbers
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import flax.core
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
# An upload's containers are read here without JAX, whose flattening sorts dict keys (and
# raises on keys of mixed types), opens any registered node and recurses without bound; the
# upload is compared with the template before any of its leaves is flattened, converted or cast.

# At most this many key paths are named per list in a structure message; the rest are counted.
_MAX_NAMED = 4
# Longer reprs of keys and errors are cut in messages.
_MAX_REPR = 80


def _type_name(x: Any) -> str:
  """The name of x's type (not of x.__class__, which an object may fake)."""
  try:
    return str(type(x).__name__)
  except Exception:  # a metaclass with a hostile __name__
    return 'object'


def _safe_repr(x: Any) -> str:
  """repr(x) on one line of at most _MAX_REPR characters; a repr that fails is named so."""
  try:
    text = ' '.join(repr(x).split())
  except Exception:  # a hostile __repr__
    return f'<{_type_name(x)} whose repr fails>'
  return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 1] + '…'


def _error_text(e: BaseException) -> str:
  try:
    text = ' '.join(str(e).split())
  except Exception:  # a hostile __str__
    text = ''
  text = f'{_type_name(e)}: {text}' if text else _type_name(e)
  return text if len(text) <= 2 * _MAX_REPR else text[: 2 * _MAX_REPR - 1] + '…'


class _Entry(NamedTuple):
  """One step of a key path, rendered as JAX's keystr renders it."""

  kind: str  # 'key' (a mapping's), 'index' (a list's or tuple's), 'attr' (a NamedTuple's)
  key: Any

  def __str__(self) -> str:
    plain = type(self.key) in (str, int)
    if self.kind == 'attr':
      return f'.{self.key}' if plain else f'.{_safe_repr(self.key)}'
    if self.kind == 'index':
      return f'[{self.key}]' if plain else f'[{_safe_repr(self.key)}]'
    return f'[{_safe_repr(self.key)}]'

  def label(self) -> str:
    return _safe_repr(self.key)

  def same(self, other: '_Entry') -> bool:
    """Exactly the same key: of the same type and equal (a key can be equal to, or print like,
    another of another type)."""
    return self.kind == other.kind and type(self.key) is type(other.key) and self.key == other.key


def _name(path: Sequence[_Entry]) -> str:
  # A NamedTuple field renders as '.params'; messages read better as "params['Dense_0']".
  return ''.join(str(e) for e in path).lstrip('.') or 'value'


def _some(names: Sequence[str]) -> str:
  shown = ', '.join(names[:_MAX_NAMED])
  return shown + (f' and {len(names) - _MAX_NAMED} more' if len(names) > _MAX_NAMED else '')


def _in_key_order(items: List[Tuple[Any, Any]]) -> List[Tuple[Any, Any]]:
  """Mapping items sorted by key as JAX orders a dict's; as given when the keys do not sort."""
  try:
    return sorted(items, key=lambda kv: kv[0])
  except Exception:  # keys of mixed types, or a hostile __lt__: the structure check names them
    return items


def _jax_entry(entry: Any) -> _Entry:
  for attr, kind in (('key', 'key'), ('name', 'attr'), ('idx', 'index')):
    if hasattr(entry, attr):
      return _Entry(kind, getattr(entry, attr))
  return _Entry('index', str(entry).strip('[]'))


def _children(x: Any) -> Optional[List[Tuple[_Entry, Any]]]:
  """x's children, or None when x is a leaf (None is one: it is named where an array is due).

  Mappings (registered with JAX or not, so that their keys can be named), lists, tuples and
  NamedTuples are read without calling anything of x's own type; other nodes registered with
  JAX (flax structs) through JAX, one level. Raises whatever a hostile object raises.
  """
  t = type(x)  # not x.__class__, which an object may fake
  if x is None:
    return None
  if issubclass(t, dict):
    items = list(dict.items(x))  # the dict's own items: a subclass's overrides are not called
  elif issubclass(t, Mapping):
    items = list(x.items())
  else:
    items = None
  if items is not None:
    return [(_Entry('key', k), v) for k, v in _in_key_order(items)]
  if t is list or t is tuple:
    return [(_Entry('index', i), v) for i, v in enumerate(x)]
  if issubclass(t, tuple) and isinstance(getattr(t, '_fields', None), tuple):  # a NamedTuple
    values = tuple.__getitem__(x, slice(None))
    if len(values) != len(t._fields):
      raise ValueError(f'{len(values)} values for the {len(t._fields)} fields of {t.__name__}')
    return [(_Entry('attr', f), v) for f, v in zip(t._fields, values)]
  if issubclass(t, (np.ndarray, np.generic, jax.Array, str, bytes, numbers.Number)):
    return None
  flat = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
  if len(flat) == 1 and flat[0][1] is x:
    return None
  return [(_jax_entry(path[0]), child) for path, child in flat]


def _readable_children(what: str, x: Any, path: Tuple[_Entry, ...]):
  try:
    return _children(x)
  except Exception as e:  # untrusted input: a container that cannot be read is a refusal
    raise UploadError(
      f'{what}: {_name(path)} is a {_type_name(x)} that cannot be read ({_error_text(e)})'
    ) from None


class _Shape(NamedTuple):
  """A tree's (key path, leaf) pairs, the depth of its deepest node and its node count."""

  leaves: List[Tuple[Tuple[_Entry, ...], Any]]
  depth: int
  nodes: int


def _leaves_with_paths(
  tree: Any, what: str, max_depth: Optional[int] = None, max_nodes: Optional[int] = None
) -> _Shape:
  """`tree`'s leaves with their key paths, walked without recursion. A node `max_depth` deep is
  taken for a leaf (unopened): an upload deeper than its template, cyclic or nested 10^4 deep,
  is named there and refused; one of more than `max_nodes` nodes (a list holding itself 1000
  times) is refused before it is walked."""
  out, deepest, nodes = [], 0, 1
  stack = [((), tree)]
  while stack:
    path, x = stack.pop()
    deepest = max(deepest, len(path))
    children = None
    if max_depth is None or len(path) < max_depth:
      children = _readable_children(what, x, path)
    if children is None:
      out.append((path, x))
      continue
    nodes += len(children)
    if max_nodes is not None and nodes > max_nodes:
      raise UploadError(
        f'{what}: structure differs from the template: more than {max_nodes} containers and leaves'
      )
    stack.extend((path + (entry,), child) for entry, child in reversed(children))
  return _Shape(out, deepest, nodes)


def _is_jax_leaf(x: Any) -> bool:
  """Whether JAX takes x for a leaf (an unregistered mapping such as a mappingproxy is one)."""
  try:
    flat = jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)
  except Exception:  # a registered node whose flattening fails: a container all the same
    return False
  return len(flat) == 1 and flat[0] is x


def _container_mismatch(
  what: str, got: Any, want: Any, path: Tuple[_Entry, ...] = ()
) -> Optional[str]:
  """Where the upload's containers differ from the template's although the key paths of their
  leaves agree (a dict where a FrozenDict is due, an empty subtree more or less, a key that only
  prints like the template's)."""
  want_children = _children(want)
  if want_children is None:
    return None
  want_desc = f'a {type(want).__name__} of [{", ".join(e.label() for e, _ in want_children)}]'
  got_children = _readable_children(what, got, path)
  if got_children is None or _is_jax_leaf(got):
    return f'{_name(path)} is a {_type_name(got)} (not a pytree container), expected {want_desc}'
  same = (
    type(got) is type(want)
    and len(got_children) == len(want_children)
    and all(g.same(w) for (g, _), (w, _) in zip(got_children, want_children))
  )
  if not same:
    for g, _ in got_children:
      lookalike = [w for w, _ in want_children if w.label() == g.label() and not g.same(w)]
      if lookalike and not any(g.same(w) for w, _ in want_children):
        return (
          f'{_name(path)} has the key {g.label()} of type {_type_name(g.key)}, expected the '
          f'{_type_name(lookalike[0].key)} {lookalike[0].label()}'
        )
    got_desc = f'a {_type_name(got)} of [{", ".join(e.label() for e, _ in got_children)}]'
    return f'{_name(path)} is {got_desc}, expected {want_desc}'
  for (entry, g), (_, w) in zip(got_children, want_children):
    found = _container_mismatch(what, g, w, path + (entry,))
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


def _is_array(x: Any) -> bool:
  return issubclass(type(x), (np.ndarray, np.generic, jax.Array))


def _host_array(what: str, name: str, leaf: Any, expected: str) -> np.ndarray:
  """The upload's leaf as a host array; anything that is not one is an UploadError."""
  if leaf is None:
    raise UploadError(f'{what}: {name} is None, expected {expected}')
  try:
    # On the host, like the bytes sent: an eager jnp check compiles a program per leaf shape.
    a = np.asarray(leaf)
    if not isinstance(a, np.ndarray):
      raise TypeError(f'np.asarray gave a {_type_name(a)}')
    return a
  except Exception as e:  # untrusted input: any failure to convert is a refusal
    raise UploadError(
      f'{what}: {name} is a {_type_name(leaf)} that is not an array ({_error_text(e)}), '
      f'expected {expected}'
    ) from None


def validate_tree(
  tree: Any, template: Any, what: str = 'upload', require_finite: bool = True
) -> None:
  """Raises UploadError, and nothing else, unless `tree` matches the template exactly.

  The key paths of the leaves, the container types and keys (of the same types), the shapes
  and the dtypes (numpy's, with no canonicalisation: float64 is not float32) must be the
  template's, every leaf must be an array (NumPy's or JAX's, not an object that converts to
  one), and floating leaves must be finite (unless `require_finite` is False). The upload's
  structure is read and compared before any of its leaves is converted. Messages name the key
  path: "upload of client 3: params['Dense_0']['kernel'] is float64[64, 10], expected
  float32[64, 10]".

  Args:
    tree: The received pytree (untrusted).
    template: A pytree of the expected structure, shapes and dtypes (e.g. the global model).
    what: Names the upload in error messages, e.g. 'upload of client 3'.
    require_finite: Refuse NaN and infinite values in floating leaves.

  Raises:
    UploadError: on the first mismatch, naming its key path.
  """
  want = _leaves_with_paths(template, 'template')
  # One level deeper than the template names what is too deep; twice its nodes (and some) name
  # what is missing and unexpected in any upload that is not hostile.
  got = _leaves_with_paths(tree, what, want.depth + 1, 2 * want.nodes + 1000)
  got_names = {_name(p): leaf for p, leaf in got.leaves}
  want_names = {_name(p): leaf for p, leaf in want.leaves}
  missing = [n for n in want_names if n not in got_names]
  unexpected = [n for n in got_names if n not in want_names]
  if missing or unexpected:
    parts = ([f'missing {_some(missing)}'] if missing else []) + (
      [f'unexpected {_some(unexpected)}'] if unexpected else []
    )
    raise UploadError(f'{what}: structure differs from the template: {"; ".join(parts)}')
  found = _container_mismatch(what, tree, template)
  if found:
    raise UploadError(f'{what}: structure differs from the template: {found}')
  for name, want_leaf in want_names.items():
    got_leaf = got_names[name]
    if want_leaf is None:
      if got_leaf is not None:
        raise UploadError(f'{what}: {name} is a {_type_name(got_leaf)}, expected None')
      continue
    dtype, shape = _spec(want_leaf)
    expected = _describe(dtype, shape)
    a = _host_array(what, name, got_leaf, expected)
    if a.dtype != dtype or a.shape != shape:
      kind = '' if _is_array(got_leaf) else f' ({_type_name(got_leaf)})'
      raise UploadError(
        f'{what}: {name} is {_describe(a.dtype, a.shape)}{kind}, expected {expected}'
      )
    if not _is_array(got_leaf):
      raise UploadError(
        f'{what}: {name} is a {_type_name(got_leaf)}, not an array, expected {expected}'
      )
    if require_finite and jnp.issubdtype(dtype, jnp.inexact) and not np.isfinite(a).all():
      raise UploadError(f'{what}: {name} has non-finite values')


# ------------------------------------------------------------------------------------------------
# num_samples and the update norm
# ------------------------------------------------------------------------------------------------
def check_num_samples(what: str, num_samples: Any, max_samples: Optional[int] = None) -> int:
  """`num_samples` as an int; UploadError unless it is a positive integer (Python or NumPy, not
  bool, float or str) and, when `max_samples` is given, at most `max_samples`.

  Args:
    what: Names the upload in error messages.
    num_samples: The claimed number of training samples (untrusted).
    max_samples: The number of samples the client holds; None sets no upper bound.

  Returns:
    `num_samples` as a Python int.
  """
  t = type(num_samples)  # not num_samples.__class__, which an object may fake
  n = None
  if issubclass(t, (numbers.Integral, np.integer)) and not issubclass(t, (bool, np.bool_)):
    try:
      n = int(num_samples)
    except Exception:  # an int subclass whose __int__ fails
      n = None
  if type(n) is not int:
    raise UploadError(
      f'{what}: num_samples must be a positive integer, '
      f'got {_safe_repr(num_samples)} ({_type_name(num_samples)})'
    )
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
  integer, at most `max_samples` when given).

  Args:
    upload: The CVAE client's upload.
    template: Decoder parameters of the expected structure, shapes and dtypes.
    num_classes: Length the label counts must have.
    template_stats: The decoder's BatchNorm statistics template; None for a decoder without any.
    max_samples: The number of samples the client holds; None sets no upper bound.
  """
  what = f'decoder upload of client {upload.client_id}'
  n = check_num_samples(what, upload.num_samples, max_samples)
  _check_counts(what, upload.label_counts, n, num_classes)
  validate_tree(upload.decoder, template, what)
  # No statistics are None or an empty mapping (never the truth value of an untrusted object).
  stats = {} if _is_empty(upload.decoder_stats) else upload.decoder_stats
  want_stats = {} if _is_empty(template_stats) else template_stats
  validate_tree(stats, want_stats, f'{what} (BatchNorm statistics)')


def _is_empty(tree: Any) -> bool:
  """None, or a dict or FrozenDict without keys."""
  if tree is None:
    return True
  t = type(tree)
  return (issubclass(t, dict) and dict.__len__(tree) == 0) or (
    t is flax.core.FrozenDict and len(tree) == 0
  )


class PrototypeUpload(NamedTuple):
  """A FedProto client's upload (FedProto, Tan et al., AAAI 2022;
  `github.com/yuetan031/FedProto`, `lib/update.py`): the mean embedding of each class it
  holds and its class counts (rows of absent classes are zero)."""

  client_id: int
  num_samples: int
  prototypes: Any  # [num_classes, D] float32
  label_counts: Any  # [num_classes] int32


class LogitsUpload(NamedTuple):
  """A FedMD client's upload (FedMD, Li & Wang, NeurIPS 2019 workshop;
  `github.com/diogenes0319/FedMD_clean`, `FedMD.py`): its logits on the round's public
  alignment set."""

  client_id: int
  logits: Any  # [N_alignment, num_classes] float32


def _check_counts(what: str, counts: Any, num_samples: int, num_classes: int) -> np.ndarray:
  counts = _host_array(what, 'label_counts', counts, f'int[{num_classes}]')
  if counts.shape != (num_classes,) or not np.issubdtype(counts.dtype, np.integer):
    raise UploadError(
      f'{what}: label_counts is {counts.dtype}{list(counts.shape)}, expected int[{num_classes}]'
    )
  # Each count at most num_samples first: int64 counts could sum to it modulo 2**64.
  if np.any(counts < 0) or np.any(counts > num_samples) or int(counts.sum()) != int(num_samples):
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
  positive integer, at most `max_samples` when given).

  Args:
    upload: The FedProto client's upload.
    num_classes: Rows of the prototype matrix (and length of the label counts).
    dim: Embedding width, the prototype matrix's columns.
    max_samples: The number of samples the client holds; None sets no upper bound.
  """
  what = f'prototype upload of client {upload.client_id}'
  n = check_num_samples(what, upload.num_samples, max_samples)
  counts = _check_counts(what, upload.label_counts, n, num_classes)
  validate_tree(upload.prototypes, np.zeros((num_classes, dim), np.float32), what)
  absent = np.asarray(upload.prototypes)[counts == 0]
  if np.any(absent != 0):
    raise UploadError(f'{what}: prototypes of classes it does not hold must be zero')


def validate_logits_upload(upload: LogitsUpload, num_samples: int, num_classes: int) -> None:
  """Raises UploadError unless the logits are finite float32[num_samples, num_classes].

  Args:
    upload: The FedMD client's upload.
    num_samples: Size of the round's public alignment set, the logits' rows.
    num_classes: The logits' columns.
  """
  what = f'logits upload of client {upload.client_id}'
  validate_tree(upload.logits, np.zeros((num_samples, num_classes), np.float32), what)
