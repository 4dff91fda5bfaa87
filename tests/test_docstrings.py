"""Docstring conventions, checked file by file with `ast`.

1. Papers are cited by their short form in docs/references.md and reference code by its public
   repository; never by names that exist only in the authors' workspace ("seed 003", the notes
   file reference-code.md), which a user of the library does not have.
2. Every public function or method under jfed/ with three or more parameters (self and cls not
   counted) has a Google-style `Args:` section and, when its return annotation is not None, a
   `Returns:` (or `Yields:`) section. An override is exempt when a base class of its (by name,
   anywhere under jfed/) documents the method with the same parameter names: restating the
   base's arguments on every method (the same `ctx:` line 58 times) said nothing new.

Both checks are parametrised by file, so a failure names the file and the lines to fix.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# "seed 003", "Seeds 000-004", "seed-001", "seed003", "reference-code.md", "reference-code §2.1".
PRIVATE_CITATION = re.compile(r'\bseeds?[\s_-]*0\d\d(?!\d)|\breference[-_]code\b', re.IGNORECASE)
ARGS_SECTION = re.compile(r'^\s*Args:\s*$', re.MULTILINE)
RETURNS_SECTION = re.compile(r'^\s*(Returns|Yields):', re.MULTILINE)
MIN_PARAMS = 3


def _python_files(*tops: str) -> list[str]:
  files = []
  for top in tops:
    files += [str(p.relative_to(ROOT)) for p in (ROOT / top).rglob('*.py')]
  return sorted(files)


CITED_FILES = _python_files('jfed', 'experiments')
DOCUMENTED_FILES = _python_files('jfed')


def private_citations(text: str) -> list[str]:
  """The private citations in `text`, as 'line N: match' strings."""
  return [
    f'line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}'
    for m in PRIVATE_CITATION.finditer(text)
  ]


def _public_functions(tree: ast.Module) -> list[tuple[ast.FunctionDef, ast.ClassDef | None]]:
  """Module-level functions and methods of public classes (nested functions are private)."""
  found = []

  def visit(body: list[ast.stmt], cls: ast.ClassDef | None) -> None:
    for node in body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if not node.name.startswith('_'):
          found.append((node, cls))
      elif isinstance(node, ast.ClassDef):
        if cls is None and not node.name.startswith('_'):
          visit(node.body, node)
      elif isinstance(node, (ast.If, ast.Try)):
        visit(node.body, cls)
        visit(node.orelse, cls)

  visit(tree.body, None)
  return found


def _n_params(fn: ast.FunctionDef, cls: ast.ClassDef | None) -> int:
  """Named parameters of `fn`, not counting a method's self/cls (nor *args / **kwargs)."""
  a = fn.args
  names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
  static = any(isinstance(d, ast.Name) and d.id == 'staticmethod' for d in fn.decorator_list)
  if cls is not None and not static and names and names[0] in ('self', 'cls'):
    names = names[1:]
  return len(names)


def _returns_value(fn: ast.FunctionDef) -> bool:
  r = fn.returns
  return r is not None and not (isinstance(r, ast.Constant) and r.value is None)


def _param_names(fn: ast.FunctionDef) -> tuple[str, ...]:
  a = fn.args
  return tuple(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)


def _base_names(cls: ast.ClassDef) -> list[str]:
  return [b.id if isinstance(b, ast.Name) else getattr(b, 'attr', '') for b in cls.bases]


def documented_methods(texts: list[str]) -> dict[str, tuple[list[str], dict]]:
  """Per class name: its bases' names and {method: (parameter names, docstring has Args:)}."""
  classes = {}
  for text in texts:
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.ClassDef):
        methods = {
          f.name: (_param_names(f), bool(ARGS_SECTION.search(ast.get_docstring(f) or '')))
          for f in node.body
          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        classes[node.name] = (_base_names(node), methods)
  return classes


def _restates_a_base(fn: ast.FunctionDef, cls: ast.ClassDef, classes: dict) -> bool:
  """Whether a base class of `cls` (transitively) documents `fn` with the same parameters."""
  seen, todo = set(), _base_names(cls)
  while todo:
    name = todo.pop()
    if name in seen or name not in classes:
      continue
    seen.add(name)
    bases, methods = classes[name]
    params, has_args = methods.get(fn.name, ((), False))
    if has_args and params == _param_names(fn):
      return True
    todo.extend(bases)
  return False


def undocumented(text: str, classes: dict | None = None) -> list[str]:
  """Public functions of 3+ parameters whose docstring lacks `Args:` or `Returns:` (overrides
  of a base method documented in `classes`, see `documented_methods`, excepted)."""
  problems = []
  for fn, cls in _public_functions(ast.parse(text)):
    if _n_params(fn, cls) < MIN_PARAMS:
      continue
    if cls is not None and classes and _restates_a_base(fn, cls, classes):
      continue
    doc = ast.get_docstring(fn) or ''
    missing = []
    if not ARGS_SECTION.search(doc):
      missing.append('Args:')
    if _returns_value(fn) and not RETURNS_SECTION.search(doc):
      missing.append('Returns:')
    if missing:
      name = f'{cls.name}.{fn.name}' if cls else fn.name
      problems.append(f'line {fn.lineno}: {name} lacks {" and ".join(missing)}')
  return problems


@pytest.mark.parametrize('path', CITED_FILES)
def test_no_private_citations(path):
  found = private_citations((ROOT / path).read_text())
  assert not found, f'{path} cites files a user does not have ({len(found)}): ' + '; '.join(found)


CLASSES = documented_methods([(ROOT / p).read_text() for p in DOCUMENTED_FILES])


@pytest.mark.parametrize('path', DOCUMENTED_FILES)
def test_public_functions_document_args_and_returns(path):
  problems = undocumented((ROOT / path).read_text(), CLASSES)
  assert not problems, f'{path} ({len(problems)}): ' + '; '.join(problems)


def test_checks_catch_what_they_should():
  bad_citation = '"""As in seed 003 Eq. 18 and reference-code.md §4.6; Seeds 000-004."""'
  assert len(private_citations(bad_citation)) == 3
  assert not private_citations('"""HFLDD (Shi et al., arXiv 2409.17517) Eq. 18; seed=3."""')
  code = '''
def f(a, b, c) -> int:
  """Does f.

  Args:
    a: x.
    b: y.
    c: z.
  """

class C:
  def m(self, a, b, c) -> None:
    """No sections."""

  def ok(self, a, b) -> int:
    """Two parameters: exempt."""

  def _private(self, a, b, c) -> int:
    """Private: exempt."""

def g(a, b, c):
  """Args:
    a: x.
    b: y.
    c: z.

  Returns:
    Nothing annotated, so this section is optional.
  """
'''
  assert undocumented(code) == ['line 2: f lacks Returns:', 'line 12: C.m lacks Args:']


def test_an_override_that_restates_its_base_method_is_exempt():
  code = """
class Base:
  def step(self, ctx, aux, state, i) -> int:
    \"\"\"Does a step.

    Args:
      ctx: a.
      aux: b.
      state: c.
      i: d.

    Returns:
      e.
    \"\"\"

class Mid(Base):
  pass

class Child(Mid):
  def step(self, ctx, aux, state, i) -> int:
    \"\"\"Child's step: only what differs.\"\"\"

  def other(self, ctx, aux, state) -> int:
    \"\"\"Not the base's method: needs its sections.\"\"\"

class Renamed(Base):
  def step(self, ctx, aux, state, step) -> int:
    \"\"\"Other parameter names: needs its sections.\"\"\"
"""
  classes = documented_methods([code])
  assert undocumented(code, classes) == [
    'line 23: Child.other lacks Args: and Returns:',
    'line 27: Renamed.step lacks Args: and Returns:',
  ]
