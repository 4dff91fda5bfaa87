"""jfed: one-shot and heterogeneous federated learning in JAX/Flax.

    import jfed
    result = jfed.run('fedavg', jfed.config('digits'))   # summary, history, state, model

`run`, `config`, `RunResult` and `dataset_from_arrays` come from jfed.runs, `base_config` (every
default) from jfed.configs.base, `Algorithm` and `register_method` (a method of one's own) from
jfed.api and jfed.methods. They load on first use, so `import jfed` stays cheap.
"""

import importlib

__version__ = '0.1.0'

_LAZY = {
  'run': 'jfed.runs',
  'config': 'jfed.runs',
  'RunResult': 'jfed.runs',
  'dataset_from_arrays': 'jfed.runs',
  'base_config': 'jfed.configs.base',
  'Algorithm': 'jfed.api',
  'RunContext': 'jfed.api',
  'register_method': 'jfed.methods',
  'available_methods': 'jfed.methods',
}

__all__ = ['__version__', *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
