"""HeteroFL's sub-models as pure functions on parameter pytrees (Diao et al., ICLR 2021;
`github.com/diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients`,
`src/fed.py` `Federation.distribute` and `combine`).

A client of width rate r holds the sub-model made of the *first* ceil(r·n) channels of every
hidden layer of the global model: each layer's inputs follow the previous layer's kept channels
and the output layer keeps every class. For a model whose widths all scale with one rate and
which pools globally before its classifier (ResNet-18's `width_mult`), that sub-model is the
leading corner of every leaf of the global pytree, `leaf[:s_0, :s_1, ...]` with `s` the
client's leaf shape. So slicing needs nothing but the client model's shapes, and the server's
aggregation scatters each client's leaves back into their corners:

  every entry = the mean over the clients that hold it (count-based, element-wise);
  entries no client holds keep the global value;
  rows of the output layer (its last, class axis) count only for clients whose label set
  contains the class (the reference's `label_split`).
"""

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _shape(leaf) -> tuple:
  return tuple(leaf.shape) if hasattr(leaf, 'shape') else tuple(np.shape(leaf))


def check_sliceable(full: Any, template: Any, what: str = 'sub-model') -> None:
  """Raises ValueError unless `template` has `full`'s structure and every leaf fits in the
  corresponding global leaf (same rank, no axis longer).

  Args:
    full: The global model's parameters.
    template: The sub-model's parameters (or their shapes).
    what: Names the sub-model in the error.
  """
  if jax.tree.structure(full) != jax.tree.structure(template):
    raise ValueError(f'{what}: its structure differs from the global model')
  paths = jax.tree_util.tree_flatten_with_path(full)[0]
  for (path, a), t in zip(paths, jax.tree.leaves(template)):
    sa, st = _shape(a), _shape(t)
    if len(sa) != len(st) or any(n > m for n, m in zip(st, sa)):
      raise ValueError(
        f'{what}: {jax.tree_util.keystr(path)} has shape {list(st)}, which is not a '
        f'sub-block of the global {list(sa)}'
      )


def slice_tree(full: Any, template: Any) -> Any:
  """The sub-model of `full` with `template`'s shapes: the leading corner of every leaf."""
  return jax.tree.map(lambda a, t: a[tuple(slice(0, n) for n in _shape(t))], full, template)


def _pad_corner(a: jax.Array, shape: Sequence[int]) -> jax.Array:
  """[m, *s] -> [m, *shape], zeros outside the leading corner."""
  return jnp.pad(a, [(0, 0)] + [(0, n - k) for k, n in zip(a.shape[1:], shape)])


def output_layer_name(params: Any, num_classes: int) -> str:
  """The top-level key of a zoo classifier's output layer: its last unnamed Dense ('Dense_k'
  with the largest k), whose kernel's last axis is the classes."""
  dense = [k for k in params if str(k).startswith('Dense_') and str(k)[6:].isdigit()]
  if not dense:
    raise ValueError('the model has no top-level Dense layer to treat as its output layer')
  name = max(dense, key=lambda k: int(str(k)[6:]))
  classes = _shape(params[name]['kernel'])[-1]
  if classes != num_classes:
    raise ValueError(f'{name} has {classes} outputs, not the {num_classes} classes')
  return name


def scatter_average(
  full: Any,
  groups: Sequence[Any],
  weights: Sequence[Any],
  class_masks: Optional[Sequence[Any]] = None,
  output_layer: Optional[str] = None,
) -> Any:
  """HeteroFL's `combine`: every entry of `full` averaged over the clients that hold it.

  Args:
    full: the global tree (params or BatchNorm statistics).
    groups: per client group, its clients' trees stacked on a leading axis; every leaf is a
      leading corner of the global leaf (`check_sliceable`).
    weights: per group, [m] with 1 for a client whose upload counts and 0 for one that did not
      take part this round.
    class_masks: per group, [m, C] with 1 where the client's label set holds class c; used for
      the leaves under the top-level key `output_layer`, whose last axis is the classes.
    output_layer: that key, or None (no class masking, e.g. for BatchNorm statistics).

  Returns:
    The new global tree: count-weighted means where at least one client counts, the old global
    values elsewhere.
  """
  full_paths, treedef = jax.tree_util.tree_flatten_with_path(full)
  group_leaves = [jax.tree.leaves(g) for g in groups]
  out = []
  for i, (path, a) in enumerate(full_paths):
    in_output = output_layer is not None and class_masks is not None and path[0].key == output_layer
    total = jnp.zeros(a.shape, jnp.float32)
    count = jnp.zeros(a.shape, jnp.float32)
    for g, leaves in enumerate(group_leaves):
      b = leaves[i].astype(jnp.float32)
      w = jnp.asarray(weights[g], jnp.float32).reshape((-1,) + (1,) * (b.ndim - 1))
      entry = jnp.broadcast_to(w, b.shape)
      if in_output:
        mask = jnp.asarray(class_masks[g], jnp.float32)  # [m, C] on the last axis
        entry = entry * mask.reshape((mask.shape[0],) + (1,) * (b.ndim - 2) + (mask.shape[1],))
      total = total + jnp.sum(_pad_corner(b * entry, a.shape), axis=0)
      count = count + jnp.sum(_pad_corner(entry, a.shape), axis=0)
    mean = total / jnp.maximum(count, 1.0)
    out.append(jnp.where(count > 0, mean, a.astype(jnp.float32)).astype(a.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)
