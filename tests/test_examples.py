"""examples/ runs as a user runs it: copied out of the checkout, in a process of its own.

A copy in a temporary directory, run with that directory as the working directory and no
PYTHONPATH, sees jfed as installed and nothing of tests/ (the editable install still maps
experiments/, so the child refuses that package itself).
"""

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / 'examples'
# Installed before anything else in a child: an import of the checkout's other packages fails.
REFUSE_CHECKOUT = textwrap.dedent("""\
  import importlib.abc
  import sys


  class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name.partition('.')[0] in ('experiments', 'tests'):
        raise ModuleNotFoundError(f'an example imported {name!r}', name=name)
      return None


  sys.meta_path.insert(0, _Refuse())
""")
# Imports custom_method (registering 'fedavgm'), then prints what the test checks, as JSON.
CHECK_CUSTOM_METHOD = textwrap.dedent("""\
  import json

  import jax
  import numpy as np

  import custom_method
  import jfed
  from jfed.configs import config_names
  from jfed.errors import ConfigError

  out = {'configs': {name: len(jfed.config(name)) for name in config_names()}}
  config = jfed.config('digits', 'smoke')
  out['section'] = config.fedavgm.to_dict()
  try:
    jfed.run('fedavgm', config)
  except ConfigError as e:
    out['error'] = str(e)
  config.fedavgm.rounds = config.fedavg.rounds = 2
  config.server_optimizer.update(name='fedavgm', lr=1.0, momentum=0.5)
  mine, builtin = jfed.run('fedavgm', config), jfed.run('fedavg', config)
  out['accuracies'] = [[r['test_accuracy'] for r in x.history] for x in (mine, builtin)]
  out['max_difference'] = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(mine.model.state), jax.tree.leaves(builtin.model.state))
  )
  print(json.dumps(out))
""")


def _run(tmp_path, script: str, timeout: int) -> str:
  """Runs `script` (a file of tmp_path) with tmp_path as cwd and no PYTHONPATH; its stdout."""
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  done = subprocess.run(
    [sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.fixture
def custom_method_copy(tmp_path):
  shutil.copy(EXAMPLES / 'custom_method.py', tmp_path)
  return tmp_path


def test_custom_method_imports_only_jfed_jax_and_the_standard_library():
  tree = ast.parse((EXAMPLES / 'custom_method.py').read_text())
  modules = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
  modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
  assert {m.partition('.')[0] for m in modules} <= {'jax', 'jfed', *sys.stdlib_module_names}


def test_custom_method_is_at_most_fifty_lines_after_its_docstring():
  tree = ast.parse((EXAMPLES / 'custom_method.py').read_text())
  code = tree.body[1:]  # after the docstring
  assert code[-1].end_lineno - code[0].lineno + 1 <= 50


def test_custom_method_learns_when_run_as_a_script(custom_method_copy):
  (custom_method_copy / 'run.py').write_text(
    REFUSE_CHECKOUT + "import runpy\nrunpy.run_path('custom_method.py', run_name='__main__')\n"
  )
  out = _run(custom_method_copy, 'run.py', timeout=300)
  accuracy = float(out.strip().splitlines()[-1].split(':')[-1])
  assert accuracy > 0.8  # chance is 0.1; 5 rounds at the smoke budget: 0.958 (seeds 1-3: 0.89-0.91)


def test_custom_method_registered_leaves_configs_loading_and_equals_fedavg_with_momentum(
  custom_method_copy,
):
  (custom_method_copy / 'check.py').write_text(REFUSE_CHECKOUT + CHECK_CUSTOM_METHOD)
  out = json.loads(_run(custom_method_copy, 'check.py', timeout=300).strip().splitlines()[-1])
  # every built-in config loads with a method whose Config has a field without default
  assert 'digits' in out['configs'] and len(out['configs']) > 5
  assert out['section'] == {'local_epochs': 1, 'server_momentum': 0.5}
  assert out['error'] == (
    'fedavgm.rounds is missing from the config (no default: set config.fedavgm.rounds)'
  )
  # jfed's FedAvg with server_optimizer 'fedavgm' (optax's heavy-ball SGD) is the same method
  mine, builtin = out['accuracies']
  assert mine == builtin and len(mine) == 2
  assert out['max_difference'] < 1e-5


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  nbclient = pytest.importorskip('nbclient')
  nbformat = pytest.importorskip('nbformat')
  pytest.importorskip('ipykernel')
  source = EXAMPLES / 'quickstart.ipynb'
  nb = nbformat.read(source, as_version=4)
  assert all(not c.get('outputs') for c in nb.cells), 'store the notebook without outputs'
  shutil.copy(source, tmp_path)
  monkeypatch.setenv('MPLBACKEND', 'Agg')
  monkeypatch.delenv('PYTHONPATH', raising=False)
  monkeypatch.chdir(tmp_path)
  nb = nbformat.read(tmp_path / 'quickstart.ipynb', as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=240, kernel_name='python3', resources={'metadata': {'path': str(tmp_path)}}
  )
  client.execute()
  printed = ''.join(o.get('text', '') for c in nb.cells if c.cell_type == 'code' for o in c.outputs)
  assert 'fedavg:' in printed and 'feddf:' in printed
  accuracy = float(printed.split('test accuracy: ')[1].split('%')[0]) / 100
  assert accuracy > 0.5
  assert any('image/png' in o.get('data', {}) for c in nb.cells for o in c.get('outputs', []))
