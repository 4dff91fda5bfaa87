"""Runs that span several JAX processes (hosts) with one global device mesh.

Every process runs the same program on the same inputs: each derives the dataset, the client
partition and every key from the config's seed, so each holds an identical copy of everything
host-side. A client group is the one thing split across processes: `global_array` builds it
from each process's own copy (`jax.make_array_from_callback` reads only the shards that live
on the process's devices), and `to_host` gathers what training produced back to every process,
where aggregation, evaluation and the server stages run unchanged (and identically) on NumPy
or process-local arrays. Only the primary process writes metrics, summaries and figures; every
process takes part in checkpoints, which orbax coordinates (they hold host NumPy arrays, the
form orbax accepts from several processes, in a directory all processes share).
"""

from typing import Any, Optional

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jfed.errors import ConfigError, WorkdirError


def initialize(
  coordinator: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
) -> None:
  """Joins the JAX distributed runtime; call before anything touches a device.

  With no arguments JAX reads the cluster's own environment (SLURM, Open MPI, Kubernetes, TPU
  pods); otherwise all three name the coordinator's host:port, the number of processes and
  this process's rank.
  """
  given = [v is not None for v in (coordinator, num_processes, process_id)]
  if any(given) and not all(given):
    raise ConfigError(
      '--coordinator, --num_processes and --process_id go together '
      '(or give none of them to read the cluster environment)'
    )
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ConfigError(f'--process_id={process_id} is not in [0, {num_processes})')
  try:
    # CPU devices of different processes only meet through a collectives library; GPUs and
    # TPUs bring their own and ignore this option.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  except (AttributeError, ValueError):  # a JAX without the option: nothing to choose
    pass
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
  except RuntimeError as e:  # an unreachable coordinator, a rank taken twice, ...
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ConfigError(f'cannot join the multi-process run at {coordinator}: {first}') from e


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0; always true in one process)."""
  return jax.process_index() == 0


def spans_processes(mesh: Optional[Mesh]) -> bool:
  return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def global_array(mesh: Mesh, value: Any, spec: P) -> jax.Array:
  """A global array laid out by `spec` from this process's full copy of `value`."""
  value = np.asarray(value)
  return jax.make_array_from_callback(
    value.shape, NamedSharding(mesh, spec), lambda index: value[index]
  )


def to_host(tree: Any) -> Any:
  """Every array of `tree` as a NumPy array holding its full value, on every process.

  Arrays split across processes are all-gathered (every process must call this with the same
  tree); the rest are copied from their device.
  """

  def one(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)

  return jax.tree.map(one, tree)


def broadcast_from_primary(value: np.ndarray) -> np.ndarray:
  """The primary process's `value` on every process (same shape and dtype everywhere)."""
  if jax.process_count() == 1:
    return np.asarray(value)
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def agree(ok: bool, what: str) -> None:
  """Ends every process with one error when the primary could not do `what` (no process waits
  forever on a collective the primary will never join)."""
  if jax.process_count() > 1 and not bool(broadcast_from_primary(np.int32(ok))):
    if is_primary():
      return  # the primary raises its own, more precise error
    raise WorkdirError(f'process 0 could not {what}; its error says why')
