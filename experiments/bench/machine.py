"""What every benchmark reports about the machine it ran on."""

import json
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


def import_torch(enabled: bool = True):
  """torch, or None with the reason logged: every benchmark runs without its reference."""
  if not enabled:
    return None, 'disabled'
  try:
    import torch
  except ImportError as e:
    log(f'PyTorch not importable ({e}): no PyTorch reference timings.')
    return None, f'not importable ({e})'
  return torch, None


def environment() -> dict:
  """Backend, devices, versions, CPUs, load and XLA_FLAGS: the header of every benchmark report.

  XLA_FLAGS is recorded because it can change XLA:CPU's kernels (YNNPACK, Eigen, oneDNN) and
  with them every time in the report.
  """
  import flax
  import jax
  import jaxlib
  import optax

  return {
    'backend': jax.default_backend(),
    'device_kind': jax.devices()[0].device_kind,
    'num_devices': jax.device_count(),
    'jax_version': jax.__version__,
    'jaxlib_version': jaxlib.__version__,
    'flax_version': flax.__version__,
    'optax_version': optax.__version__,
    'python_version': platform.python_version(),
    'cpu_count': cpu_count(),
    'cpu_model': cpu_model(),
    'load_average': load_average(),
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
  }


def write_json(path: str, payload: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(payload, f, indent=2, default=str)
  log(f'wrote {path}')
