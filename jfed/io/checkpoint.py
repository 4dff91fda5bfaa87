"""Step checkpoints of a run's typed state through orbax-checkpoint.

Each checkpoint holds the state and, for the driver's run checkpoints, the run's metric history
as JSON in the same orbax step: the two are committed together, so a resumed run never pairs a
state with a history of another step. A checkpoint that fails to restore (a deleted or
truncated file) is skipped for the older one that `max_to_keep` keeps, with a warning, and
removed so the resumed run can write that step again.
"""

import pathlib
import sys
from typing import Any, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jfed.errors import WorkdirError


class Checkpointer:
  """Saves a state per completed step (round, epoch, stage) and restores the latest that loads.

  A run killed at any point resumes from the last completed step; since every random key is
  derived from (seed, purpose, step), the resumed run ends with the result of an uninterrupted
  one.
  """

  def __init__(self, directory, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
      self.directory,
      item_names=('state', 'history'),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )

  def save(self, step: int, state: Any, history: Optional[List[Any]] = None) -> None:
    items = {'state': ocp.args.StandardSave(_host_arrays(state))}
    if history is not None:
      items['history'] = ocp.args.JsonSave({'records': history})
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._manager.wait_until_finished()

  def steps(self) -> List[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore(self, step: int, template: Any, with_history: bool = False):
    items = {'state': ocp.args.StandardRestore(_host_arrays(template))}
    if with_history:
      items['history'] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state = _like_template(restored['state'], template)
    if with_history:
      return state, list(restored['history']['records'])
    return state

  def restore_latest(
    self, template: Any, with_history: bool = False
  ) -> Tuple[Optional[int], Any, List[Any]]:
    """(step, state, history) of the newest checkpoint that restores; (None, template, [])
    when there is none. Raises WorkdirError when checkpoints exist but none restores."""
    steps = self.steps()
    errors = []
    for step in reversed(steps):
      try:
        out = self.restore(step, template, with_history)
      except Exception as e:  # pylint: disable=broad-except  # orbax raises many types
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        errors.append(f'step {step}: {type(e).__name__}: {first_line}')
        print(
          f'warning: checkpoint {step} in {self.directory} does not restore '
          f'({errors[-1]}); trying an older one',
          file=sys.stderr,
          flush=True,
        )
        continue
      state, history = out if with_history else (out, [])
      if errors:
        # The newer steps cannot be restored; remove them so that the resumed run can save
        # those steps again.
        for newer in [s for s in steps if s > step]:
          self._manager.delete(newer)
        print(
          f'warning: restored the older checkpoint {step} in {self.directory} and removed '
          'the newer ones that do not restore',
          file=sys.stderr,
          flush=True,
        )
      return step, state, history
    if steps:
      raise WorkdirError(
        f'no checkpoint in {self.directory} restores ({"; ".join(errors)}); '
        'delete that directory to start the stage again'
      )
    return None, template, []

  def close(self) -> None:
    self._manager.close()


def _host_arrays(tree: Any) -> Any:
  """In a run of several processes, device arrays as NumPy: orbax takes a process's own device
  arrays from one process only (each holds the same value; see jfed.engine.multihost)."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


def _like_template(restored: Any, template: Any) -> Any:
  if jax.process_count() == 1:
    return restored
  return jax.tree.map(
    lambda r, t: jnp.asarray(r) if isinstance(t, jax.Array) else r, restored, template
  )
