"""What every benchmark reports about the machine it ran on."""

import os
import platform
import sys
from typing import Optional


def cpu_count() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def load_average() -> Optional[float]:
  """1-minute load average: a busy machine (load > CPUs) distorts every figure, torch's most."""
  try:
    return round(os.getloadavg()[0], 2)
  except (AttributeError, OSError):
    return None


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)
