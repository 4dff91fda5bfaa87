"""What the command-line tools print: INFO for jfed's own records (the phases of a run: KIP,
model stratification, DDPM training, generation) and every warning, but not the libraries' INFO
(orbax logs about 30 lines for every checkpoint step, which buried a GPU chunk's progress at the
end of its log). An explicit --verbosity is honoured as absl defines it."""

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


def console_logging() -> None:
  """INFO for jfed's records and WARNING for the libraries', unless --verbosity was given."""
  if flags.FLAGS['verbosity'].present:
    return
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(jfed_record)  # addFilter dedupes
