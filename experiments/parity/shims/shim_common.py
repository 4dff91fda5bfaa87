"""What every shim shares: stand-in modules and the harness's own flags.

Imported by the shims as a sibling (a script's directory leads `sys.path`), under the
reference's Python; like them it imports nothing of jfed. `partition_shim.py` keeps its own
stand-in helper: `experiments.parity.partitions` also loads that file by path into jfed's
process, where this sibling is not on `sys.path`.
"""

import argparse
import importlib.machinery
import sys
import types
from typing import List, Optional, Tuple


def stub_module(name: str, package: bool = False, **attrs) -> types.ModuleType:
  """A stand-in module registered as `name`, with a spec (torch's import-time scans call
  `importlib.util.find_spec` on what is in `sys.modules`), set as its parent's attribute when the
  parent is loaded; `package`: `import name.child` may find children stubbed under it."""
  module = types.ModuleType(name)
  if package:
    module.__path__ = []
  module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
  for key, value in attrs.items():
    setattr(module, key, value)
  sys.modules[name] = module
  parent, _, child = name.rpartition('.')
  if parent in sys.modules:
    setattr(sys.modules[parent], child, module)
  return module


def stub_package(name: str, **attrs) -> types.ModuleType:
  """`stub_module` of a package."""
  return stub_module(name, package=True, **attrs)


def parse_harness_flags(script: Optional[str] = None) -> Tuple[argparse.Namespace, List[str]]:
  """The flags `experiments.parity` gives every shim (`--ref_dir`, `--partition`, `--data_root`,
  `--result`, and `--script` with this default when given), and the rest, after an optional
  `--`: the reference's own."""
  parser = argparse.ArgumentParser()
  for flag in ('--ref_dir', '--partition', '--data_root', '--result'):
    parser.add_argument(flag, required=True)
  if script is not None:
    parser.add_argument('--script', default=script)
  ours, rest = parser.parse_known_args()
  return ours, rest[1:] if rest[:1] == ['--'] else rest
