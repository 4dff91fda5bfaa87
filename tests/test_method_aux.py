"""A method builds its trainers and its server in `setup` and keeps them in its aux: no cache
keyed by the run context, and every round trains with the same (once compiled) trainer."""

import ast
import inspect
import pathlib
from typing import List

import pytest

from jfed import driver
from jfed.configs import digits
from jfed.engine import GroupTrainer
from jfed.methods import coboosting, common, dense, feddf, fedhydra, oneshot
from tests.support import override, smoke_config

METHODS_DIR = pathlib.Path(common.__file__).parent
# What builds a trainer or a server; a step that calls one rebuilds (and recompiles) every round.
BUILDERS = ('make_trainers', 'client_trainers', 'make_server', 'run_trainers', 'run_server')


def _module_trees():
  for path in sorted(METHODS_DIR.glob('*.py')):
    yield path.name, ast.parse(path.read_text())


def test_no_method_module_keeps_a_cache_keyed_by_the_run_context():
  """Per-run objects live in the aux a method's `setup` returns, not in module globals."""
  found = []
  for name, tree in _module_trees():
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        modules = [a.name for a in node.names] + [getattr(node, 'module', None) or '']
        if 'weakref' in modules:
          found.append(f'{name}:{node.lineno} imports weakref')
    for node in tree.body:  # module-level assignments
      # a container made at import time (not a type alias) that mentions contexts or weak keys
      if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
        node.value, (ast.Call, ast.Dict, ast.DictComp)
      ):
        text = ast.unparse(node)
        if 'RunContext' in text or 'Weak' in text:
          found.append(f'{name}:{node.lineno} {text}')
  assert not found, found
  assert not hasattr(common, 'run_trainers') and not hasattr(common, 'run_server')


def test_no_step_builds_a_trainer_or_a_server():
  """`step` (and what a method class calls from it) reads the trainers and the server from aux."""
  calls = []
  for name, tree in _module_trees():
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
      for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
        # under mutmut a method `m` of class C is also `xǁCǁm__mutmut_orig` and `..._<n>`
        method = fn.name.split('ǁ')[-1].split('__mutmut_')[0]
        if method in ('setup', '__init__') or method.startswith('_setup'):
          continue
        for node in ast.walk(fn):
          if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else ''
            callee = callee or (node.func.id if isinstance(node.func, ast.Name) else '')
            if callee in BUILDERS:
              calls.append(f'{name}: {cls.name}.{fn.name} calls {callee}')
  assert not calls, calls


@pytest.fixture(name='built')
def _built(monkeypatch) -> List[GroupTrainer]:
  """Every GroupTrainer `common` builds during the test, in order."""
  built = []

  class Counting(GroupTrainer):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      built.append(self)

  monkeypatch.setattr(common, 'GroupTrainer', Counting)
  return built


@pytest.fixture(name='trained_with')
def _trained_with(monkeypatch) -> List[List[GroupTrainer]]:
  """The trainers of every `common.train_groups` call during the test, in order."""
  used = []
  train = common.train_groups

  def recording(trainers, *args, **kwargs):
    used.append(list(trainers))
    return train(trainers, *args, **kwargs)

  monkeypatch.setattr(common, 'train_groups', recording)
  return used


def _steps(method: str, config, steps: int):
  """`method` driven as the driver drives it, in memory."""
  algorithm = driver.build_algorithm(method, config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  state = algorithm.init(ctx, aux)
  for i in range(steps):
    state, _ = algorithm.step(ctx, aux, state, i)
  return aux


def test_fedavg_rounds_train_with_the_trainer_and_server_built_in_setup(
  monkeypatch, built, trained_with
):
  servers = []
  make_server = common.make_server
  monkeypatch.setattr(
    common, 'make_server', lambda ctx: servers.append(make_server(ctx)) or servers[-1]
  )
  config = override(digits.get_config('smoke'), **{'model': 'mlp', 'fedavg.rounds': 2})
  aux = _steps('fedavg', config, 2)
  assert built == [aux.trainer]
  assert trained_with == [[aux.trainer], [aux.trainer]]
  assert servers == [aux.server]


def test_every_round_of_a_multi_round_oneshot_method_trains_with_the_trainers_of_setup(
  built, trained_with
):
  """OT's round 1 (`local_models`) and round 2 (`round_uploads`) train every client with the
  one trainer of its architecture that `setup` built: its programs compile once per run."""
  config = override(smoke_config('ot'), **{'ot.rounds': 2, 'ot.local_epochs': 1})
  aux = _steps('ot', config, 2)
  (trainer,) = aux.trainers.values()
  assert built == [trainer]
  assert trained_with == [[trainer], [trainer]]


def test_groups_of_one_architecture_share_one_trainer():
  config = override(digits.get_config('smoke'), model='mlp')
  ctx = driver.context_of_config(config)
  (group,) = common.client_groups(ctx)
  first, second = common.make_trainers(ctx, [group, group])
  assert first is second
  assert list(common.client_trainers(ctx)) == ['mlp']


def test_each_distillation_family_declares_a_recipe_of_plain_functions():
  """DENSE, Co-Boosting, FedDF's student and FedHydra are their module's `recipe(config)` run
  by the one shared step: their classes override no step of the loop, only say what they are."""
  config = override(smoke_config('fedhydra'), model='mlp')
  allowed = {'validate', 'make_recipe', 'epochs_per_round', 'trained_model'}
  ctx = driver.context_of_config(config)
  for cls, section in (
    (dense.Dense, 'dense'),
    (coboosting.CoBoosting, 'coboosting'),
    (feddf.FedDFStudent, 'feddf'),
    (fedhydra.FedHydra, 'fedhydra'),
  ):
    own = {
      n
      for n, v in vars(cls).items()
      # 'ǁ': mutmut's copies of a method (`xǁCǁm__mutmut_<n>`), present under mutation testing
      if inspect.isfunction(v) and not n.startswith('__') and 'ǁ' not in n
    }
    assert own <= allowed, (cls.__name__, own - allowed)
    algorithm = cls.from_config(config)
    recipe = algorithm.recipe
    assert isinstance(recipe, oneshot.Recipe)
    # a stored image's teacher target is fixed through a round but under Co-Boosting's weights
    assert recipe.kd_agg_fixed_in_round is (cls is not coboosting.CoBoosting)
    functions = recipe._replace(kd_agg_fixed_in_round=None)
    assert all(callable(f) for f in functions if f is not None)
    assert algorithm.recipe.settings(ctx).rounds == getattr(config, section).rounds


def test_a_recipe_without_a_fixed_pool_says_so_when_asked_for_one():
  """A method author's mistake (kd_data='fixed' in a recipe that has no set to read), named."""
  with pytest.raises(ValueError, match="^kd_data='fixed' needs a recipe with a fixed_pool$"):
    oneshot.Recipe(settings=None).fixed_pool(None)
