"""Step checkpoints of a run's typed state through orbax-checkpoint."""
import pathlib
from typing import Any, Optional

import orbax.checkpoint as ocp


class Checkpointer:
  """Saves the run state after each completed step (round, epoch) and restores the latest.

  A run killed at any point resumes from the last completed step; since every random key is
  derived from (seed, step), the resumed run ends with the same result as an uninterrupted one.
  """

  def __init__(self, directory, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def save(self, step: int, state: Any) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
    self._manager.wait_until_finished()

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore(self, step: int, template: Any) -> Any:
    return self._manager.restore(step, args=ocp.args.StandardRestore(template))

  def restore_latest(self, template: Any):
    """(step, state) of the latest checkpoint, or (None, template) when there is none."""
    step = self.latest_step()
    if step is None:
      return None, template
    return step, self.restore(step, template)

  def close(self) -> None:
    self._manager.close()
