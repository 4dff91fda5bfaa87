"""What the command-line tools print: INFO for jfed's own records (the phases of a run: KIP,
model stratification, DDPM training, generation) and every warning, but not the libraries' INFO
(orbax logs about 30 lines for every checkpoint step, which buried a GPU chunk's progress at the
end of its log). INFO lines are their bare message, like the progress lines every method prints,
and warnings start with `warning:`; errors keep absl's prefix (level, time, thread, file:line),
since they locate a failure. An explicit --verbosity or --showprefixforinfo keeps absl's format
for every record, as absl defines it."""

import logging as std_logging
import os

from absl import flags, logging

_JFED = os.path.dirname(os.path.abspath(__file__))
# jfed's package, and beside it in a checkout the experiments' scripts (not site-packages: an
# installed jfed's neighbours are the libraries)
OWN_CODE = tuple(
  d + os.sep
  for d in (_JFED, os.path.join(os.path.dirname(_JFED), 'experiments'))
  if os.path.isdir(d)
)


def jfed_record(record: std_logging.LogRecord) -> bool:
  """Whether a log record is worth the console by default: any warning or error, and the INFO
  lines of jfed and the experiments' scripts."""
  return record.levelno >= std_logging.WARNING or record.pathname.startswith(OWN_CODE)


class ConsoleFormatter(std_logging.Formatter):
  """INFO as the bare message, WARNING as `warning: message`, ERROR and above in absl's format.

  Only the console's lines change: `error:` stays the one line a failed command ends with.
  """

  def __init__(self, absl_formatter: std_logging.Formatter):
    super().__init__()
    self.absl_formatter = absl_formatter

  def format(self, record: std_logging.LogRecord) -> str:
    if record.levelno >= std_logging.ERROR:
      return self.absl_formatter.format(record)
    message = super().format(record)
    return f'warning: {message}' if record.levelno >= std_logging.WARNING else message


def console_logging() -> None:
  """INFO for jfed's records and WARNING for the libraries', in the console's format, unless
  --verbosity was given."""
  if flags.FLAGS['verbosity'].present:
    return
  logging.set_verbosity(logging.INFO)
  handler = logging.get_absl_handler()
  handler.addFilter(jfed_record)  # addFilter dedupes
  current = handler.python_handler.formatter
  if not flags.FLAGS['showprefixforinfo'].present and not isinstance(current, ConsoleFormatter):
    handler.setFormatter(ConsoleFormatter(current or logging.PythonFormatter()))
