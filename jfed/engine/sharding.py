"""Placing a client group on a device mesh with a `clients` axis."""

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jfed.engine import multihost

CLIENTS = 'clients'


def client_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A 1-D mesh over `devices` (default: all) whose axis shards the client dimension."""
  devices = np.asarray(devices if devices is not None else jax.devices())
  return Mesh(devices, (CLIENTS,))


def padded_count(n: int, mesh: Mesh) -> int:
  d = mesh.shape[CLIENTS]
  return -(-n // d) * d


def client_block(num_clients: int, index: int, count: int) -> range:
  """Block `index` of `count` contiguous blocks of the client ids: the clients the index-th of
  `count` shards holds when a client axis is padded to a multiple of `count` and split evenly
  (a process's share under `loop`, a Flower SuperNode's clients).

  Args:
    num_clients: Number of client ids.
    index: Which block, in [0, count).
    count: Number of blocks (shards).

  Returns:
    The block's client ids (empty past the last client).
  """
  per_block = -(-num_clients // count)
  start = min(index * per_block, num_clients)
  return range(start, min(start + per_block, num_clients))


def pad_clients(tree: Any, n_total: int) -> Any:
  """Pads the leading client axis to `n_total` with zeros.

  Padded clients have size 0, so every training step leaves them untouched; callers slice them
  off afterwards.
  """

  def pad(a):
    a = jnp.asarray(a)
    extra = n_total - a.shape[0]
    if extra <= 0:
      return a
    return jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)])

  return jax.tree.map(pad, tree)


def shard_group(mesh: Mesh, tree: Any) -> Any:
  """Pads a stacked tree to a multiple of the mesh size and shards its client axis.

  On a mesh that spans processes each process supplies the shards on its own devices from its
  own (identical) copy of `tree`.
  """
  n = jax.tree.leaves(tree)[0].shape[0]
  tree = pad_clients(tree, padded_count(n, mesh))
  return place(mesh, tree, P(CLIENTS))


def replicate_on_mesh(mesh: Mesh, tree: Any) -> Any:
  """`tree` replicated on every device of the mesh (e.g. FedProx's anchor)."""
  return place(mesh, tree, P())


def place(mesh: Mesh, tree: Any, spec: P) -> Any:
  """`tree`'s arrays laid out on `mesh` by `spec` (global arrays when the mesh spans processes).

  Args:
    mesh: The device mesh.
    tree: A pytree of arrays, each a full copy.
    spec: How every leaf is sharded.

  Returns:
    The placed pytree.
  """
  if multihost.spans_processes(mesh):
    return jax.tree.map(lambda a: multihost.global_array(mesh, a, spec), tree)
  return jax.device_put(tree, NamedSharding(mesh, spec))
