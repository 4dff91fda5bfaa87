"""Expected failures: the `jfed` command (jfed/cli.py) prints each as one `error: ...` line.

Every class here is a ValueError too, so code that already catches ValueError for bad input keeps
working.
"""


class JfedError(ValueError):
  """A failure the user can fix: bad config, missing data, a busy workdir, ..."""


class ConfigError(JfedError):
  """The config is invalid; raised before anything is written or loaded."""


class DataError(JfedError):
  """A data file is missing, corrupt or holds values jfed cannot use; the message names it."""


class WorkdirError(JfedError):
  """The workdir cannot be used: not a directory, unwritable, or holding another run."""


class WorkdirBusy(WorkdirError):
  """Another process is running in the workdir."""


class NonFiniteError(JfedError):
  """A loss, metric or parameter became NaN or infinite; the message names the step."""
