"""jfed's internal import graph: no circle, no upward arrow, no jfed import hidden in a function.

The graph is read from the source with `ast` (module-level and function-level imports alike), so
the test needs no import of jfed and sees imports a run never executes.
"""

import ast
import pathlib
from typing import Dict, List, NamedTuple, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent / 'jfed'

# Packages and modules of jfed, lowest first; a module may import from its own layer or below.
# `typed_config` holds only the parsing primitives (engine's sections use them);
# `run_config` checks the whole run config and needs the model names of every family.
LAYERS = (
  ('jfed', 'errors'),
  ('typed_config', 'keys', 'workdir', 'figures', 'reporting', 'console', 'supervise'),
  ('io',),
  ('data',),
  ('models',),
  ('engine',),
  ('api',),
  ('kip', 'clustering', 'distill', 'cvae', 'profiling', 'diffusion'),
  ('run_config',),
  ('methods',),
  ('configs',),
  ('driver',),
  ('runs',),
  ('flower',),
  ('cli', '__main__'),
)

# Circles allowed: a registry that imports the modules registering into it.
ALLOWED_CYCLES: Set[frozenset] = {
  frozenset({'jfed.models.registry', f'jfed.models.{m}'})
  for m in ('cnn', 'googlenet', 'resnet', 'vgg')
}

# Imports inside a function, allowed where the imported module is an optional dependency's
# door or the import is lazy on purpose: (importing module, imported module).
ALLOWED_IN_FUNCTION = {
  # the model registry imports the architectures it registers on first use
  ('jfed.models.registry', 'jfed.models.cnn'),
  ('jfed.models.registry', 'jfed.models.googlenet'),
  ('jfed.models.registry', 'jfed.models.resnet'),
  ('jfed.models.registry', 'jfed.models.vgg'),
  # Flower starts a ClientApp process per message: it loads JAX (through the worker's trainer)
  # only when node config keep-process=false has it train in that process
  ('jfed.flower.client_app', 'jfed.flower.worker'),
}


# Modules whose jfed imports may all sit in functions: the command line imports JAX and the
# methods only once its flags are parsed, so `--help` and a bad flag answer at once.
LAZY_MODULES = {'jfed.cli'}


class Edge(NamedTuple):
  source: str
  target: str
  in_function: bool
  line: int


def _modules() -> Dict[str, pathlib.Path]:
  modules = {}
  for path in ROOT.rglob('*.py'):
    parts = list(path.relative_to(ROOT.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts = parts[:-1]
    modules['.'.join(parts)] = path
  return modules


def _resolve(name: str, modules: Dict[str, pathlib.Path]) -> str:
  """The module a dotted import name lands in (`from jfed.x import y`: jfed.x.y or jfed.x)."""
  while name and name not in modules:
    name = name.rpartition('.')[0]
  return name


def import_edges() -> List[Edge]:
  modules = _modules()
  edges = []
  for source, path in modules.items():
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f'{node.module}.{a.name}' for a in node.names]
      else:
        continue
      in_function, up = False, node
      while up in parents:
        up = parents[up]
        in_function |= isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
      for name in names:
        if name.split('.')[0] != 'jfed':
          continue
        target = _resolve(name, modules)
        if target and target != source:
          edges.append(Edge(source, target, in_function, node.lineno))
  return edges


def layer(module: str) -> int:
  parts = module.split('.')
  top = parts[1] if len(parts) > 1 else 'jfed'
  for rank, names in enumerate(LAYERS):
    if top in names:
      return rank
  raise AssertionError(f'{module} is in no layer of LAYERS: add it')


def _cycles(edges: List[Edge]) -> List[List[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  graph: Dict[str, Set[str]] = {}
  for e in edges:
    graph.setdefault(e.source, set()).add(e.target)
    graph.setdefault(e.target, set())
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_module_has_a_layer():
  for module in _modules():
    layer(module)


def test_no_import_circle():
  edges = [e for e in import_edges() if frozenset({e.source, e.target}) not in ALLOWED_CYCLES]
  assert _cycles(edges) == []


def test_no_upward_import():
  upward = [
    f'{e.source}:{e.line} imports {e.target}'
    for e in import_edges()
    if layer(e.target) > layer(e.source)
  ]
  assert upward == []


def test_no_jfed_import_inside_a_function():
  hidden = [
    f'{e.source}:{e.line} imports {e.target}'
    for e in import_edges()
    if e.in_function
    and (e.source, e.target) not in ALLOWED_IN_FUNCTION
    and e.source not in LAZY_MODULES
  ]
  assert hidden == []
