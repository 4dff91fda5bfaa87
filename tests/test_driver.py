"""The driver: resume of every method, workdirs that cannot mix or lose results, clean failures."""

import ast
import fcntl
import json
import pathlib
import shutil
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jfed import driver, engine
from jfed import typed_config as tc
from jfed.configs import digits
from jfed.data import load_dataset
from jfed.engine import compiles
from jfed.errors import ConfigError, NonFiniteError, WorkdirBusy, WorkdirError
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import available_methods, common
from jfed.workdir import dumps
from tests.support import (
  Interrupted,
  comparable_summary,
  interrupt_after,
  override,
  read_metrics,
  smoke_config,
  snapshot_every_step,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _digits(**overrides):
  c = digits.get_config('smoke')
  c.fedavg.rounds = c.fedprox.rounds = 3
  return override(c, **overrides)


def _workdir_config(**overrides):
  """For the tests of workdirs, checkpoints and failures: the MLP runs in a third of the CNN's
  time, and what those tests check does not depend on the model."""
  return _digits(**{'model': 'mlp', **overrides})


# Driver steps after the first that may compile: the first use of a stage (Co-Boosting's
# ensemble-weight step runs from epoch 2 on) and one-off stages (DynaFed's round 3 distils the
# synthetic set), FedCVAE-KD's step 2 starts the classifier after the decoder, and FedDF-vote's
# step 3 starts the student of the second architecture.
ONE_OFF_STEPS = {'coboosting': (2,), 'dynafed': (3,), 'fedcvae_kd': (2,), 'feddf_vote': (3,)}
# Methods whose loop steps legitimately compile once per student architecture.
PROGRAMS_PER_LOOP_STEP = {'feddf_vote': 2}
# On CPU these run as Python loops of one jitted step, whose first call must not compile a
# second program for the later ones (tests/test_compile_once.py).
LOOP_STEPS = (
  'jit(_synthesis_step)',
  'jit(_ms_step)',
  'jit(kd_step)',
  'jit(kd_step_on_targets)',
  'jit(_kd_block)',
  'jit(_kd_block_on_targets)',
  'jit(pool_teacher_logits)',
)


# Resume at a round boundary of the one-shot loop is test_oneshot_methods.py's multi-round DENSE;
# a real interruption (an exception out of the run) is test_a_kill_leaves_what_....
# One-step methods have nothing to resume mid-run (fedavg_vote: tests/test_fedmho.py).
SINGLE_STEP = ('fedavg_vote',)
# Variants whose driver loop and resume path are those of a sibling kept in the fast set
# (fedcvae_kd, fedmho, hfldd); their server steps are checked by the oracle tests. About a
# sixth of this test's cold compile time.
SLOW_RESUME = ('fedcvae_ens', 'fedmho_md', 'fedmho_sd', 'hfldd_nodd')


@pytest.mark.parametrize(
  'method',
  [
    pytest.param(m, marks=pytest.mark.slow) if m in SLOW_RESUME else m
    for m in sorted(set(available_methods()) - set(SINGLE_STEP))
  ],
)
def test_every_method_resumes_to_the_result_of_an_uninterrupted_run_and_compiles_once(
  tmp_path, monkeypatch, method
):
  """The workdir as a kill after the next-to-last step leaves it resumes to the whole run; and
  the whole run, from empty in-memory caches, compiles nothing in its steps after the first: a
  shape, a closure or a Python scalar that changes per step, or a jitted function built anew
  every step, would recompile every step (tests/test_compile_once.py counts how)."""
  config = smoke_config(method)
  jax.clear_caches()  # a persistent-cache hit still counts as a compilation
  saved_at = {0: 0}
  with monkeypatch.context() as m, compiles.count_compilations() as compiled:
    snapshot_every_step(m, tmp_path / 'killed', lambda s: saved_at.setdefault(s, len(compiled)))
    whole = driver.run_experiment(method, config, tmp_path / 'whole', progress=False)
  assert whole.steps > 1 and sorted(saved_at) == list(range(whole.steps + 1))
  per_step = {s: compiled.names[saved_at[s - 1] : saved_at[s]] for s in range(2, whole.steps + 1)}
  recompiled = {
    s: compiles.Compilations(names).summary()
    for s, names in per_step.items()
    if names and s not in ONE_OFF_STEPS.get(method, ())
  }
  assert not recompiled, recompiled
  programs = PROGRAMS_PER_LOOP_STEP.get(method, 1)
  twice = {n: k for n, k in compiled.counts().items() if n in LOOP_STEPS and k > programs}
  assert not twice, f'compiled more than once: {twice}'

  killed = tmp_path / 'killed' / str(whole.steps - 1)
  assert max(r['step'] for r in read_metrics(killed)) == whole.steps - 1
  resumed = driver.run_experiment(method, config, killed, progress=False)
  assert read_metrics(killed) == read_metrics(tmp_path / 'whole')
  assert comparable_summary(resumed) == comparable_summary(whole)


class _FedAvgMConfig(NamedTuple):
  rounds: int
  local_epochs: int
  server_momentum: float


class _FedAvgM(driver.Algorithm):
  """docs/driver.md's example of a new method on the interface (not registered)."""

  name, section, Config, step_name = 'fedavgm', 'fedavgm', _FedAvgMConfig, 'round'

  def validate(self, config):
    tc.require_positive(self.config, self.section, ('rounds', 'local_epochs'))

  def num_steps(self, ctx):
    return self.config.rounds

  def setup(self, ctx):
    common.single_architecture(ctx)
    group = common.client_groups(ctx)[0]
    return (
      group,
      common.make_trainers(ctx, [group])[0],
      engine.init_model(
        group.module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0)
      ),
      common.make_server(ctx),
    )

  def init(self, ctx, aux):
    return aux[2], jax.tree.map(jnp.zeros_like, aux[2])  # (global model, velocity)

  def step(self, ctx, aux, state, i):
    group, trainer, template, server = aux
    (model, velocity) = state
    avg, record = common.fedavg_round(
      common.RoundParts(trainer, self.config.local_epochs, template, server),
      group,
      model,
      ctx.derive_key(Purpose.ROUNDS, i),
      i,
    )
    velocity = jax.tree.map(
      lambda v, a, m: self.config.server_momentum * v + (m - a), velocity, avg, model
    )
    model = jax.tree.map(lambda m, v: m - v, model, velocity)
    accuracy = engine.Evaluator(group.module, 1000).accuracy(
      model, ctx.dataset.test_x, ctx.dataset.test_y
    )
    return (model, velocity), [{'round': i + 1, 'test_accuracy': accuracy, **record}]


def test_the_documented_new_method_runs_on_the_interface_and_equals_fedavg_at_momentum_0(
  tmp_path, monkeypatch
):
  """FedAvgM at momentum 0 against FedAvg run in memory (which writes nothing)."""
  config = _digits()
  config.fedavgm = ml_collections.ConfigDict(
    {'rounds': 3, 'local_epochs': config.fedavg.local_epochs, 'server_momentum': 0.0}
  )
  dataset = load_dataset('digits')
  ctx = driver.context_of_config(config, dataset)
  summary = driver.run(_FedAvgM.from_config(config), ctx, progress=False)
  monkeypatch.chdir(tmp_path)
  reference = driver.run_in_memory('fedavg', config)
  assert isinstance(reference, driver.RunSummary) and list(tmp_path.iterdir()) == []
  assert summary.final_test_accuracy > 0.5
  assert summary.final_test_accuracy == pytest.approx(reference.final_test_accuracy, abs=0.01)
  assert summary.total_bytes == reference.total_bytes
  with pytest.raises(ConfigError, match='fedavgm.rounds must be positive'):
    _FedAvgM.from_config(override(config, **{'fedavgm.rounds': 0}))


def test_fedavg_writes_every_output_and_learns(tmp_path):
  summary = driver.run_experiment('fedavg', _digits(), tmp_path, progress=False)
  for name in (
    'identity.json',
    'config.json',
    'metrics.jsonl',
    'summary.json',
    'accuracy.png',
    'partition.txt',
    'partition.png',
    'checkpoints',
  ):
    assert (tmp_path / name).exists(), name
  records = read_metrics(tmp_path)
  assert [r['step'] for r in records] == [1, 2, 3]
  assert summary.final_test_accuracy > 0.5  # chance is 0.1
  assert summary.best_test_accuracy == max(r['test_accuracy'] for r in records)
  assert summary.total_bytes == records[-1]['cumulative_bytes'] > 0
  assert json.loads((tmp_path / 'summary.json').read_text())['final_test_accuracy'] == (
    summary.final_test_accuracy
  )


def test_a_finished_run_is_kept_and_says_so(tmp_path, capsys):
  first = driver.run_experiment('fedavg', _workdir_config(), tmp_path)
  again = driver.run_experiment('fedavg', _workdir_config(), tmp_path)
  assert 'already complete' in capsys.readouterr().out
  assert again.seconds == first.seconds
  # this invocation's time (it ran nothing), while summary.json keeps the finishing one's
  assert again.seconds_this_invocation < first.seconds_this_invocation
  saved = json.loads((tmp_path / 'summary.json').read_text())
  assert saved['seconds_this_invocation'] == first.seconds_this_invocation


def _listing(workdir, depth=3):
  # '.lock' is left out: a run that ends by an exception removes it, a killed one leaves it (the
  # next start replaces a dead pid's lock: tests/test_workdir_lock.py).
  return sorted(
    str(p.relative_to(workdir))
    for p in workdir.rglob('*')
    if len(p.relative_to(workdir).parts) <= depth and p.name != '.lock'
  )


def test_a_kill_leaves_what_the_resume_tests_snapshot_and_resume_says_where(
  tmp_path, monkeypatch, capsys
):
  """snapshot_every_step (the resume tests' stand-in for a kill) copies the very files that a
  run killed after the same step leaves, and the killed run resumes from that step."""
  config = _workdir_config()
  with monkeypatch.context() as m:
    interrupt_after(m, 2)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedavg', config, tmp_path / 'killed')
  with monkeypatch.context() as m:
    snapshot_every_step(m, tmp_path / 'snapshots')
    whole = driver.run_experiment('fedavg', config, tmp_path / 'whole')
  snapshot = tmp_path / 'snapshots' / '2'
  assert _listing(tmp_path / 'killed') == _listing(snapshot)
  assert read_metrics(tmp_path / 'killed') == read_metrics(snapshot)
  resumed = driver.run_experiment('fedavg', config, tmp_path / 'killed')
  assert 'resuming from round 2' in capsys.readouterr().out
  assert comparable_summary(resumed) == comparable_summary(whole)


def test_another_method_into_a_finished_workdir_is_refused(tmp_path):
  driver.run_experiment('fedavg', _workdir_config(), tmp_path, progress=False)
  with pytest.raises(WorkdirError, match='differs in .*method'):
    driver.run_experiment('fedprox', _workdir_config(), tmp_path, progress=False)
  with pytest.raises(WorkdirError, match='differs in .*method'):
    driver.run_experiment('centralized', _workdir_config(), tmp_path, progress=False)
  with pytest.raises(WorkdirError, match=r'config\.seed'):
    driver.run_experiment('fedavg', _workdir_config(seed=7), tmp_path, progress=False)


def test_a_busy_workdir_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
  tmp_path.mkdir(exist_ok=True)
  with open(tmp_path / '.lock', 'w') as holder:
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(WorkdirBusy, match='busy'):
      driver.run_experiment('fedavg', _workdir_config(), tmp_path, progress=False)
  assert not (tmp_path / 'config.json').exists()
  # the lock file of a killed run (no process holds it any more) does not block
  (tmp_path / '.lock').write_text('pid 999999 on a dead host\n')
  summary = driver.run_experiment('fedavg', _workdir_config(), tmp_path, progress=False)
  assert summary.steps == 3


def test_a_torn_metrics_file_cannot_shorten_the_history(tmp_path, monkeypatch):
  whole = driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'whole', progress=False)
  with monkeypatch.context() as m:
    interrupt_after(m, 2)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'torn', progress=False)
  metrics = tmp_path / 'torn' / 'metrics.jsonl'
  metrics.write_text(metrics.read_text()[:25])  # a kill in the middle of a rewrite
  resumed = driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'torn', progress=False)
  assert read_metrics(tmp_path / 'torn') == read_metrics(tmp_path / 'whole')
  assert resumed.best_test_accuracy == whole.best_test_accuracy
  assert resumed.total_bytes == whole.total_bytes


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_one(
  tmp_path, monkeypatch, capsys
):
  whole = driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'whole', progress=False)
  with monkeypatch.context() as m:
    interrupt_after(m, 2)
    with pytest.raises(Interrupted):
      driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'run', progress=False)
  latest = tmp_path / 'run' / 'checkpoints' / '2'
  for f in (latest / 'state').rglob('*'):
    if f.is_file() and f.stat().st_size > 0 and 'metadata' not in f.name:
      f.unlink()
  resumed = driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'run')
  out = capsys.readouterr()
  assert 'does not restore' in out.err and 'resuming from round 1' in out.out
  assert read_metrics(tmp_path / 'run') == read_metrics(tmp_path / 'whole')
  assert resumed.final_test_accuracy == whole.final_test_accuracy
  # when no checkpoint restores, the error names the directory
  for step_dir in (tmp_path / 'run' / 'checkpoints').iterdir():
    if step_dir.name.isdigit():
      shutil.rmtree(step_dir / 'state')
  (tmp_path / 'run' / 'summary.json').unlink()
  with pytest.raises(WorkdirError, match='checkpoints'):
    driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'run', progress=False)


def test_a_config_that_fails_after_the_start_does_not_block_the_fixed_run(tmp_path):
  with pytest.raises(ValueError, match='clients'):  # found when the data are partitioned
    driver.run_experiment(
      'fedavg', _workdir_config(**{'partition.num_clients': 5000}), tmp_path, progress=False
    )
  summary = driver.run_experiment('fedavg', _workdir_config(), tmp_path, progress=False)
  assert summary.steps == 3


def test_training_that_turns_non_finite_stops_with_the_step_and_client(tmp_path):
  with pytest.raises(NonFiniteError, match=r'client\(s\) \[\d.*non-finite'):
    driver.run_experiment(
      'fedavg', _workdir_config(**{'optimizer.lr': 1e30}), tmp_path, progress=False
    )
  with pytest.raises(NonFiniteError, match='epoch 1'):
    driver.run_experiment(
      'centralized', _workdir_config(**{'optimizer.lr': 1e30}), tmp_path / 'c', progress=False
    )


def test_a_non_finite_state_is_named_by_its_path():
  state = {'a': jnp.ones(3), 'b': {'c': jnp.array([1.0, jnp.nan])}, 'n': jnp.arange(3)}
  with pytest.raises(NonFiniteError, match=r"state\['b'\]\['c'\] became non-finite at round 2"):
    driver._check_finite_state(state, 'round 2')
  driver._check_finite_state({'a': jnp.ones(3), 'n': jnp.arange(3)}, 'round 1')
  # the accelerators' form: one program per state structure
  finite = driver._all_finite([jnp.ones(2), jnp.array([jnp.inf]), jnp.array([jnp.nan])])
  np.testing.assert_array_equal(np.asarray(finite), [True, False, False])


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'fedavg.rounds': 0}, 'fedavg.rounds must be positive'),
    ({'batch_size': -32}, 'batch_size must be positive'),
    ({'batch_size': 0}, 'batch_size must be positive'),
    ({'optimizer.lr': float('nan')}, 'optimizer.lr must be finite'),
    ({'fedavg.participation': 1.5}, r'participation must be in \(0, 1\]'),
    ({'partition.alpha': -1.0}, 'alpha'),
    ({'partition.scheme': 'zipf'}, 'valid'),
    ({'model': 'transformer'}, 'valid'),
    ({'strategy': 'pmap'}, 'valid'),
  ],
)
def test_bad_config_is_refused_before_anything_is_written(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    driver.run_experiment('fedavg', _workdir_config(**overrides), tmp_path / 'w', progress=False)
  assert not (tmp_path / 'w').exists()


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / 'file').write_text('x')
  with pytest.raises(WorkdirError, match='not a directory'):
    driver.run_experiment('fedavg', _workdir_config(), tmp_path / 'file', progress=False)


def test_metrics_hold_no_bare_non_finite_tokens():
  text = dumps({'loss': float('nan'), 'x': [float('inf'), 1.5], 'y': np.float32('nan')})
  assert json.loads(text) == {'loss': None, 'x': [None, 1.5], 'y': None}


def test_every_key_purpose_is_distinct():
  assert len({int(p) for p in Purpose}) == len(Purpose)
  assert len({int(p) for p in ServerRoundPurpose}) == len(ServerRoundPurpose)


def test_no_method_module_imports_another_method_module():
  methods_dir = ROOT / 'jfed' / 'methods'
  method_modules = {p.stem for p in methods_dir.glob('*.py')} - {
    '__init__',
    'common',
    'context',
    'registry',
    'oneshot',
    'generative',
  }
  for path in methods_dir.glob('*.py'):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == 'jfed.methods':
          names = [a.name for a in node.names]
        elif node.module.startswith('jfed.methods.'):
          names = [node.module.rsplit('.', 1)[1]]
      elif isinstance(node, ast.Import):
        names = [a.name.rsplit('.', 1)[1] for a in node.names if a.name.startswith('jfed.methods.')]
      bad = (set(names) & method_modules) - {path.stem}
      assert not bad, f'{path.name} imports the method module(s) {sorted(bad)}'


def test_no_method_module_checkpoints_or_reads_metrics_itself():
  for path in (ROOT / 'jfed' / 'methods').glob('*.py'):
    text = path.read_text()
    for word in ('Checkpointer', 'metrics.jsonl', 'ctx.metrics', 'restore_latest'):
      assert word not in text, f'{path.name} uses {word}'


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
def _main(*args, cwd=ROOT):
  return subprocess.run(
    [sys.executable, '-m', 'experiments.main', *args],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=cwd,
  )


def _one_error_line(proc):
  assert proc.returncode != 0
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr
  return lines[0]


@pytest.mark.parametrize(
  'args,message',
  [
    (['--config.fedavg.rounds=0'], 'fedavg.rounds must be positive'),
    (['--config.batch_size=-32'], 'batch_size must be positive'),
    (['--config.optimizer.lr=nan'], 'optimizer.lr must be finite'),
    (['--config=experiments/configs/digits.py:smok'], 'smok'),
    (['--config.fedavg.roundz=3'], 'roundz'),
    (['--config=experiments/configs/nonexistent.py'], 'nonexistent.py'),
    (['--method=nope'], 'Unknown method'),
  ],
)
def test_main_turns_bad_input_into_one_error_line(tmp_path, args, message):
  base = [
    '--method=fedavg',
    '--config=experiments/configs/digits.py:smoke',
    f'--workdir={tmp_path / "w"}',
  ]
  keys = {a.split('=')[0] for a in args}
  proc = _main(*[a for a in base if a.split('=')[0] not in keys], *args)
  assert message in _one_error_line(proc)
  assert not (tmp_path / 'w' / 'config.json').exists()


def test_main_lists_methods_without_a_config():
  proc = _main('--method=?')
  assert proc.returncode == 0
  assert 'fedavg' in proc.stdout and 'hfldd' in proc.stdout


@pytest.mark.slow  # three whole commands, one a run from its own empty compilation cache (12 s)
def test_main_runs_keeps_its_programs_in_the_cache_and_resumes_a_finished_run(tmp_path):
  cache = tmp_path / 'cache'
  args = [
    '--method=fedavg',
    '--config=experiments/configs/digits.py:smoke',
    '--config.model=mlp',
    f'--workdir={tmp_path / "run"}',
    f'--compilation_cache={cache}',
  ]
  first = _main(*args)
  assert first.returncode == 0, first.stderr
  assert 'final_test_accuracy' in first.stdout
  assert any(p.name.startswith('jit__loop_client_step') for p in cache.iterdir()), sorted(
    p.name for p in cache.iterdir()
  )
  again = _main(*args)
  assert again.returncode == 0 and 'already complete' in again.stdout
  other = _main(*args[1:], '--method=fedprox')
  assert 'differs in' in _one_error_line(other)
