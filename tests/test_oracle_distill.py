"""Oracle tests of the one-shot distillation family: DENSE, Co-Boosting, FedDF and FedDF-vote.

Each test runs the registered method's own code path (its Algorithm's setup / init / step, as the
driver does) on a tiny problem: sklearn digits (8x8), three clients whose uploaded models are
GIVEN (local training is replaced by fixed models with independent initialisations and BatchNorm
running statistics far from (0, 1)), a one-hidden-layer network with BatchNorm, one or two
server epochs of a few steps. An independent PyTorch computation, written from the papers'
equations and the reference code's order of operations, repeats the server stage from the same
inputs, and jfed must match it to float32 tolerance.

What the oracles take from jfed are inputs, not the computations under test: the client models
and data, the student's and the generator's initial parameters and the noise z (drawn from jfed's
keys by `jfed.distill.dense_generator_init`), and the random draws jfed makes from its documented
keys (generator targets, augmentation offsets and flips, ODS directions, KD batch orders), which
an oracle cannot reproduce any other way; they are re-derived here from the run's keys.

References:
- DENSE: Zhang et al., "DENSE: Data-Free One-Shot Federated Learning", NeurIPS'22, arXiv
  2112.12371; github.com/zj-jayzhang/DENSE (helpers/synthesizers.py, loop_df_fl.py).
- Co-Boosting: Dai et al., "Enhancing One-Shot Federated Learning Through Data and Ensemble
  Co-Boosting", ICLR'24, arXiv 2402.15070; github.com/rong-dai/Co-Boosting
  (datafree/synthesis/coboost.py, datafree_kd.py).
- FedDF: Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning",
  NeurIPS'20, arXiv 2006.07242; github.com/epfml/federated-learning-public-code (codes/FedDF-code,
  pcode/aggregation/noise_knowledge_transfer.py).
- FedDF-vote: FedMHO's heterogeneous FedDF baseline, github.com/YXShi2000/FedMHO.
"""

import math
import pathlib
import tempfile
from typing import Any, List, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver, engine
from jfed.configs.base import base_config
from jfed.data import load_dataset
from jfed.distill import dense_generator_init
from jfed.engine import ModelState
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common, feddf
from jfed.models import registry
from jfed.models.layers import BatchNorm

# The oracles mirror the PyTorch reference code in float64 PyTorch: skipped where it is absent
# (the README's install; CI installs it).
torch = pytest.importorskip('torch')
F = pytest.importorskip('torch.nn.functional')

BN_EPS = 1e-5
BN_MOMENTUM = 0.1  # PyTorch's convention: new = (1 − 0.1) · running + 0.1 · batch
RTOL, ATOL = 2e-4, 2e-5
WIDE, NARROW = 'oracle_bn', 'oracle_bn:hidden=4'


class OracleNet(nn.Module):
  """flatten → Dense(hidden) → BatchNorm → ReLU → Dense(classes): the BatchNorm gives DENSE's
  BN loss, FedDF's batch-statistics teachers and the students' running statistics something to
  act on."""

  num_classes: int
  hidden: int = 6

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    # no bias before the BatchNorm: with batch statistics its gradient is zero up to rounding,
    # which Adam would blow up to ±lr in either direction
    h = nn.Dense(self.hidden, use_bias=False, name='fc1')(x.reshape(x.shape[0], -1))
    h = nn.relu(BatchNorm(name='bn1')(h, train, mask))
    return nn.Dense(self.num_classes, name='fc2')(h)


@pytest.fixture(autouse=True)
def oracle_net(monkeypatch):
  registry.available_models()  # the zoo registers itself first
  monkeypatch.setitem(
    registry._REGISTRY,  # pylint: disable=protected-access
    'oracle_bn',
    lambda num_classes, input_shape, hidden=6: OracleNet(num_classes, int(hidden)),
  )


def given_client_models(monkeypatch) -> None:
  """Local training (`common.local_models`) replaced by fixed client models."""

  def local_models(ctx, epochs, client_ids=None, trainers=None):
    groups = common.client_groups(ctx, client_ids)
    models = []
    for gi, g in enumerate(groups):
      k = len(g.client_ids)
      key = jax.random.PRNGKey(100 + gi)
      init = engine.init_models(g.module, ctx.dataset.input_shape, key, k, same_init=False)
      rng = np.random.default_rng(gi)
      h = init.params['fc1']['kernel'].shape[-1]
      params = jax.tree.map(lambda a: a, init.params)
      params['bn1'] = {
        'bn': {
          'scale': jnp.asarray(rng.uniform(0.5, 1.5, (k, h)), jnp.float32),
          'bias': jnp.asarray(rng.normal(0.0, 0.3, (k, h)), jnp.float32),
        }
      }
      stats = {
        'bn1': {
          'bn': {
            'mean': jnp.asarray(rng.normal(0.0, 0.5, (k, h)), jnp.float32),
            'var': jnp.asarray(rng.uniform(0.5, 2.0, (k, h)), jnp.float32),
          }
        }
      }
      models.append(ModelState(params, stats))
    return common.LocalModels(groups, models, 0)

  monkeypatch.setattr(common, 'local_models', local_models)


def tiny_config(**sections):
  c = base_config()
  c.dataset.name = 'digits'
  c.dataset.holdout_size = 60
  c.model = WIDE
  c.partition.update({'scheme': 'dirichlet', 'num_clients': 3, 'alpha': 0.5, 'min_size': 10})
  c.eval_batch_size = 512
  for section, values in sections.items():
    c[section].update(values)
  return c


def run_steps(method: str, config, steps=None):
  """The method's Algorithm driven as the driver drives it; every state is kept."""
  algorithm = driver.build_algorithm(method, config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  states, history = [algorithm.init(ctx, aux)], []
  for i in range(algorithm.num_steps(ctx) if steps is None else steps):
    state, records = algorithm.step(ctx, aux, states[-1], i)
    states.append(state)
    history += [{'step': i + 1, **r} for r in records]
  return algorithm, ctx, aux, states, history


# ---------------------------------------------------------------------------------------------
# PyTorch forward passes and losses
# ---------------------------------------------------------------------------------------------
def to_torch(tree, requires_grad=False):
  return jax.tree.map(
    lambda a: torch.tensor(np.asarray(a), dtype=torch.float32, requires_grad=requires_grad), tree
  )


def to_numpy(tree):
  return jax.tree.map(lambda t: t.detach().numpy().copy(), tree)


def leaves(tree) -> List[torch.Tensor]:
  return jax.tree.leaves(tree)


def client_models(local: common.LocalModels):
  """[(params, batch_stats)] as torch trees, in the teachers' (group-concatenated) order."""
  out = []
  for m in local.models:
    for k in range(jax.tree.leaves(m.params)[0].shape[0]):
      out.append((to_torch(engine.take(m, k).params), to_torch(engine.take(m, k).batch_stats)))
  return out


def net(p, stats, x, batch_statistics: bool):
  """OracleNet: BatchNorm on the running statistics, or (a torch module in train mode) on the
  batch's, biased variance. Returns (logits, the BN input's batch mean, batch variance)."""
  h = x.reshape(x.shape[0], -1) @ p['fc1']['kernel']
  mean, var = h.mean(0), h.var(0, unbiased=False)
  m, v = (
    (mean, var) if batch_statistics else (stats['bn1']['bn']['mean'], stats['bn1']['bn']['var'])
  )
  h = (h - m) / torch.sqrt(v + BN_EPS) * p['bn1']['bn']['scale'] + p['bn1']['bn']['bias']
  return torch.relu(h) @ p['fc2']['kernel'] + p['fc2']['bias'], mean, var


def updated_statistics(stats, mean, var):
  """Running statistics after a train-mode batch (jfed's BatchNorm, flax's update: the biased
  batch variance)."""
  bn = stats['bn1']['bn']
  return {
    'bn1': {
      'bn': {
        'mean': (1 - BN_MOMENTUM) * bn['mean'] + BN_MOMENTUM * mean.detach(),
        'var': (1 - BN_MOMENTUM) * bn['var'] + BN_MOMENTUM * var.detach(),
      }
    }
  }


def kl_rows(s, t, T):
  """Σ_c softmax(t/T) · (log softmax(t/T) − log softmax(s/T)), per row (F.kl_div 'none' summed)."""
  log_p = F.log_softmax(t / T, dim=1)
  return (log_p.exp() * (log_p - F.log_softmax(s / T, dim=1))).sum(1)


def accuracy(p, stats, x, y) -> float:
  with torch.no_grad():
    logits, _, _ = net(p, stats, torch.tensor(np.asarray(x)), False)
  return float(np.mean(logits.argmax(1).numpy() == np.asarray(y)))


def assert_tree_close(got, want, rtol=RTOL, atol=ATOL):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def fedavg(models: Sequence[Any], sizes) -> Any:
  w = np.asarray(sizes, np.float64) / np.sum(sizes)
  return jax.tree.map(lambda *xs: sum(wk * np.asarray(x) for wk, x in zip(w, xs)), *models)


# ---------------------------------------------------------------------------------------------
# FedDF
# ---------------------------------------------------------------------------------------------
FEDDF = {
  'rounds': 1,
  'source_size': 20,
  'val_size': 30,
  'kd_batch': 8,
  'total_steps': 4,
  'eval_every': 2,
  'patience': 100,
  'kd_T': 2.0,  # FedDF's default is 1, where a T² factor would go unseen
}


FEDDF_SUMMARY = (
  'source',
  'source_size',
  'val_size',
  'val_split',
  'eval_samples',
  'best_val_accuracy',
  'early_stopped',
  'architectures',
  'students',
  'student_test_accuracy',
)


def feddf_student_oracle(start, teachers, pool_x, val_x, val_y, cfg, seed, r=1):
  """One FedDF round of one student (epfml FedDF-code `noise_knowledge_transfer`): from `start`
  (numpy (params, stats)), Adam(kd_lr) with CosineAnnealingLR over all the round's batches,
  KL(softmax(t) ‖ softmax(s)) 'batchmean' at T = 1 without T² against the mean of every
  teacher's logits, the teachers' BatchNorm on the batch (never eval()), clip_grad_norm_(5);
  validated every `eval_every` batches; the best-on-validation student (the start included).
  Returns (students after every epoch, validation accuracies, the best student)."""
  params, stats = to_torch(start[0], requires_grad=True), to_torch(start[1])
  if cfg.get('kd_optimizer', 'adam') == 'sgd':  # jfed's option; T² would show under SGD
    opt = torch.optim.SGD(leaves(params), lr=cfg['kd_lr'])
  else:
    opt = torch.optim.Adam(leaves(params), lr=cfg['kd_lr'], betas=(0.9, 0.999), eps=1e-8)
  epochs = math.ceil(cfg['total_steps'] / cfg['eval_every'])
  total = epochs * cfg['eval_every']
  pool = torch.tensor(np.asarray(pool_x))
  best, best_val = (to_numpy(params), to_numpy(stats)), accuracy(params, stats, val_x, val_y)
  students, vals, bad = [], [], 0
  for e in range(epochs):
    rng = np.random.default_rng((seed, r, e))
    n = len(pool)
    for b in range(cfg['eval_every']):
      idx = rng.choice(n, cfg['kd_batch'], replace=n < cfg['kd_batch'])
      for group in opt.param_groups:
        group['lr'] = (
          0.5 * cfg['kd_lr'] * (1 + math.cos(math.pi * (e * cfg['eval_every'] + b) / total))
        )
      x = pool[idx]
      with torch.no_grad():
        t = torch.stack([net(tp, ts, x, True)[0] for tp, ts in teachers]).mean(0)
      s, mean, var = net(params, stats, x, True)
      loss = kl_rows(s, t, cfg['kd_T']).mean()  # no T²
      opt.zero_grad()
      loss.backward()
      torch.nn.utils.clip_grad_norm_(leaves(params), 5.0)
      opt.step()
      stats = updated_statistics(stats, mean, var)
    val = accuracy(params, stats, val_x, val_y)
    students.append((to_numpy(params), to_numpy(stats)))
    vals.append(val)
    if val > best_val:
      best, best_val, bad = students[-1], val, 0
    else:
      bad += 1
    if bad * cfg['eval_every'] >= cfg['patience']:
      break
  return students, vals, best


def architecture_start(local: common.LocalModels, spec: str):
  """The size-weighted FedAvg of the uploads of `spec` (numpy params, stats)."""
  for g, m in zip(local.groups, local.models):
    if g.spec == spec:
      k = len(g.client_ids)
      takes = [engine.take(m, i) for i in range(k)]
      return (
        fedavg([t.params for t in takes], g.fed.sizes),
        fedavg([t.batch_stats for t in takes], g.fed.sizes),
      )
  raise AssertionError(spec)


def architecture_oracle(first: common.LocalModels, spec: str, student_aux, cfg, seed):
  """`feddf_student_oracle` for `spec`'s student: from its clients' FedAvg, against every
  client of `first`, on that student's distillation and validation sets."""
  data = student_aux.data
  return feddf_student_oracle(
    architecture_start(first, spec),
    client_models(first),
    data.pool.images,
    data.val_x,
    data.val_y,
    cfg,
    seed,
  )


def logits_by_client(teachers, local: common.LocalModels, x) -> List[np.ndarray]:
  """Each client's logits on `x` ([clients] of [N, classes], in client-id order) from the
  oracle's `teachers` (`client_models(local)`: in the groups' concatenated order)."""
  with torch.no_grad():
    by_teacher = [net(p, st, torch.tensor(np.asarray(x)), False)[0].numpy() for p, st in teachers]
  teacher_ids = np.concatenate([g.client_ids for g in local.groups]).tolist()
  return [by_teacher[teacher_ids.index(c)] for c in range(len(teacher_ids))]


def model_accuracy(model, x, y) -> float:
  """`accuracy` of an oracle's (params, stats) pair of numpy trees."""
  return accuracy(to_torch(model[0]), to_torch(model[1]), x, y)


@pytest.mark.parametrize('optimizer', ['adam', 'sgd'])
def test_feddf_distils_the_fedavg_start_against_the_mean_client_logits(monkeypatch, optimizer):
  """One round from given client models: the student starts from the size-weighted FedAvg,
  every Adam (FedDF's) or SGD step matches the oracle, the validation picks the best student
  and the round's accuracy is that student's on the whole test split."""
  given_client_models(monkeypatch)
  config = tiny_config(feddf=dict(FEDDF, kd_optimizer=optimizer))
  algorithm, ctx, aux, states, history = run_steps('feddf', config)
  student_aux = aux.auxes[0]
  local = student_aux.round_cache[1].local
  sizes = np.concatenate([g.fed.sizes for g in local.groups])
  assert len(set(sizes.tolist())) > 1  # unequal sizes: size weights differ from uniform ones
  data = student_aux.data
  # no test image: the distillation and validation images are a seeded draw of the held-out
  # training images, the first val_size of it validating
  holdout = ctx.dataset.holdout_x
  draw = np.sort(np.random.default_rng(config.seed).choice(len(holdout), 50, replace=False))
  np.testing.assert_array_equal(data.val_x, holdout[draw[:30]])
  np.testing.assert_array_equal(data.val_y, ctx.dataset.holdout_y[draw[:30]])
  np.testing.assert_array_equal(data.pool.images, holdout[draw[30:]])
  cfg = dict(FEDDF, kd_lr=config.feddf.kd_lr, kd_optimizer=optimizer)
  start = architecture_start(local, WIDE)
  students, vals, best = feddf_student_oracle(
    start, client_models(local), data.pool.images, data.val_x, data.val_y, cfg, config.seed
  )
  assert len(states) == 3 and len(students) == 2
  for state, (params, stats) in zip(states[1:], students):
    assert_tree_close(state[0].student.model.params, params)
    assert_tree_close(state[0].student.model.batch_stats, stats)
  np.testing.assert_allclose([h['val_accuracy'] for h in history], vals)
  start_val = model_accuracy(start, data.val_x, data.val_y)
  np.testing.assert_allclose(
    [h['best_val_accuracy'] for h in history], np.maximum.accumulate([start_val, *vals])[1:]
  )
  assert_tree_close(states[-1][0].extra.best.params, best[0])
  want = model_accuracy(best, ctx.dataset.test_x, ctx.dataset.test_y)
  assert history[-1]['round_accuracy'] == pytest.approx(want, abs=1e-6)
  assert algorithm.final_accuracy(history) == pytest.approx(want, abs=1e-6)
  assert [algorithm.step_label(i, 2) for i in range(2)] == ['epoch 1/2', 'epoch 2/2']
  # the given uploads (`given_client_models`) report 0 bytes
  assert algorithm.setup_records(ctx, aux) == [{'round': 1, 'clients': 3, 'upload_bytes': 0}]
  summary = algorithm.summarize(ctx, aux, states[-1], history)
  best_val = model_accuracy(best, data.val_x, data.val_y)
  assert {k: summary[k] for k in FEDDF_SUMMARY} == {
    'source': 'holdout',
    'source_size': FEDDF['source_size'],
    'val_size': FEDDF['val_size'],
    'val_split': 'holdout',
    'eval_samples': len(ctx.dataset.test_y),
    'best_val_accuracy': pytest.approx(best_val, abs=1e-6),
    'early_stopped': False,
    'architectures': 'all',
    'students': [WIDE],
    'student_test_accuracy': {WIDE: pytest.approx(want, abs=1e-6)},
  }


def record_round_starts(monkeypatch) -> List[Any]:
  """Local training of rounds r > 1 replaced by recording where every group starts, with the
  trainers and epochs it is given."""
  starts = []

  def train_groups(trainers, groups, models, epochs, key, label=''):
    starts.append((list(models), list(trainers), epochs))
    return list(models), None

  monkeypatch.setattr(common, 'train_groups', train_groups)
  return starts


@pytest.mark.parametrize('architectures', ['all', 'server'])
def test_heterogeneous_feddf_distils_every_architecture_and_sends_each_its_student(
  monkeypatch, architectures
):
  """Two architectures (clients 0 and 2 wide, client 1 narrow), two rounds. 'all' (Lin et al.'s
  heterogeneous FedDF): each architecture's student starts from the FedAvg of its own clients,
  is distilled against the logits of ALL clients, and in round 2 the clients of each
  architecture start from their architecture's student. 'server' (jfed's old behaviour): only
  the wide architecture is distilled; the narrow client continues from its own model."""
  given_client_models(monkeypatch)
  starts = record_round_starts(monkeypatch)
  config = tiny_config(feddf=dict(FEDDF, rounds=2, total_steps=2, architectures=architectures))
  config.client_models = f'{WIDE};{NARROW}'
  _, ctx, aux, states, history = run_steps('feddf', config)
  specs = [WIDE, NARROW] if architectures == 'all' else [WIDE]
  assert list(aux.architectures) == specs
  first = common.local_models(ctx, config.feddf.local_epochs)
  cfg = dict(FEDDF, total_steps=2, kd_lr=config.feddf.kd_lr)
  round1 = states[1]  # one epoch per round
  bests = {}
  for spec, state, student_aux in zip(specs, round1, aux.auxes):
    students, _, best = architecture_oracle(first, spec, student_aux, cfg, config.seed)
    assert_tree_close(state.student.model.params, students[0][0])
    assert_tree_close(state.extra.best.params, best[0])
    bests[spec] = state.extra.best
  assert len(starts) == 1  # round 2's local training
  start_models, trainers, epochs = starts[0]
  assert epochs == config.feddf.local_epochs
  # the run's trainers, built once in setup and shared by every student
  assert all(a.trainers is aux.auxes[0].trainers for a in aux.auxes)
  assert trainers == [aux.auxes[0].trainers[g.spec] for g in first.groups]
  for g, own, start in zip(first.groups, first.models, start_models):
    for k in range(len(g.client_ids)):
      want = bests[g.spec] if g.spec in bests else engine.take(own, k)
      assert_tree_close(engine.take(start, k).params, want.params, rtol=0, atol=0)
  x, y = ctx.dataset.test_x, ctx.dataset.test_y
  round1_accuracy = {
    spec: pytest.approx(accuracy(to_torch(b.params), to_torch(b.batch_stats), x, y))
    for spec, b in bests.items()
  }
  assert history[0]['round_accuracy'] == round1_accuracy[WIDE]
  # round 2 sends each architecture's student to its clients (wide: clients 0 and 2)
  receivers = {WIDE: 2, NARROW: 1}
  sent = sum(
    len(flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(b))) * receivers[spec]
    for spec, b in bests.items()
  )
  assert history[1]['download_bytes'] == sent
  if architectures == 'all':
    assert set(history[0]['student_test_accuracy']) == {WIDE, NARROW}
    assert history[0]['test_accuracy'] == history[0]['student_test_accuracy'][WIDE]
    assert history[0]['student_round_accuracy'] == round1_accuracy
  else:
    assert 'student_round_accuracy' not in history[0]


@pytest.mark.parametrize('patience, stops', [(2, (1, 2)), (4, (2, 3))])
def test_feddf_students_stop_early_each_on_its_own_validation(monkeypatch, patience, stops):
  """Two architectures, five epochs, `patience` KD steps (eval_every 2) without a gain in
  validation accuracy (a tie is no gain): each student stops where the oracle's does (`stops`:
  the wide and the narrow student's last epoch); a step after a student stopped leaves its
  state as it was and records only the students still running, and nothing once all stopped;
  the summary says the first student stopped."""
  given_client_models(monkeypatch)
  config = tiny_config(feddf=dict(FEDDF, total_steps=10, patience=patience))
  config.client_models = f'{WIDE};{NARROW}'
  algorithm, ctx, aux, states, history = run_steps('feddf', config)
  first = common.local_models(ctx, config.feddf.local_epochs)
  cfg = dict(FEDDF, total_steps=10, patience=patience, kd_lr=config.feddf.kd_lr)
  ran, best_accuracy = {}, {}
  for spec, student_aux in zip([WIDE, NARROW], aux.auxes):
    students, _, best = architecture_oracle(first, spec, student_aux, cfg, config.seed)
    ran[spec] = len(students)
    best_accuracy[spec] = pytest.approx(
      model_accuracy(best, ctx.dataset.test_x, ctx.dataset.test_y)
    )
  assert (ran[WIDE], ran[NARROW]) == stops  # the case this test is about
  assert len(states) == 6 and [h['step'] for h in history] == list(range(1, stops[1] + 1))
  for k, h in enumerate(history, 1):
    running = {spec for spec in (WIDE, NARROW) if ran[spec] >= k}
    assert set(h['student_test_accuracy']) == running
    ended = {spec: best_accuracy[spec] for spec in running if ran[spec] == k}
    assert h.get('student_round_accuracy') == (ended or None)
    if WIDE in running:  # the wide student's record is the step's record
      assert h['early_stop'] == (k == ran[WIDE])
    else:  # once it stopped, the step has a record of its own
      assert set(h) == {'step', 'round', 'epoch', 'student_test_accuracy'} | (
        {'student_round_accuracy'} if ended else set()
      )
      assert (h['round'], h['epoch']) == (1, k)
  for p, spec in enumerate([WIDE, NARROW]):
    stopped = states[ran[spec]][p].student.model.params
    for later in states[ran[spec] + 1 :]:
      assert_tree_close(later[p].student.model.params, stopped, rtol=0, atol=0)
  assert algorithm.summarize(ctx, aux, states[-1], history)['early_stopped']


def test_feddf_without_validation_keeps_the_last_student(monkeypatch):
  """val_size=0: no validation and no early stop; each epoch's student is the best, the round's
  accuracy is the last student's, and the summary reports no validation accuracy (-1)."""
  given_client_models(monkeypatch)
  config = tiny_config(feddf=dict(FEDDF, val_size=0, patience=0))
  algorithm, ctx, aux, states, history = run_steps('feddf', config)
  assert [h['step'] for h in history] == [1, 2]
  assert all('val_accuracy' not in h and 'early_stop' not in h for h in history)
  for state in states[1:]:
    assert_tree_close(state[0].extra.best.params, state[0].student.model.params, rtol=0, atol=0)
    assert not bool(state[0].stopped)
  assert history[-1]['round_accuracy'] == history[-1]['test_accuracy']
  summary = algorithm.summarize(ctx, aux, states[-1], history)
  assert summary['val_size'] == 0 and summary['best_val_accuracy'] == -1.0


def test_feddf_vote_is_the_argmax_of_the_prototypes_mean_logits(monkeypatch):
  """FedMHO's heterogeneous FedDF: one FedDF student per architecture (the oracle of FedDF's),
  then the vote: argmax of the mean of the best students' logits on the whole test split."""
  given_client_models(monkeypatch)
  config = tiny_config(feddf=FEDDF)
  config.client_models = f'{WIDE};{NARROW}'
  algorithm, ctx, aux, states, history = run_steps('feddf_vote', config)
  first = common.local_models(ctx, config.feddf.local_epochs)
  teachers = client_models(first)
  cfg = dict(FEDDF, kd_lr=config.feddf.kd_lr)
  assert aux.auxes[0].trainers is aux.auxes[1].trainers  # both read one set of uploads
  logits, best_vals = [], []
  for spec, state, student_aux in zip([WIDE, NARROW], states[-1], aux.auxes):
    students, vals, best = architecture_oracle(first, spec, student_aux, cfg, config.seed)
    assert_tree_close(state.extra.best.params, best[0])
    best_vals.append(model_accuracy(best, student_aux.data.val_x, student_aux.data.val_y))
    with torch.no_grad():
      x = torch.tensor(np.asarray(ctx.dataset.test_x))
      logits.append(net(to_torch(best[0]), to_torch(best[1]), x, False)[0].numpy())
    # each prototype's epochs: its name, its student's accuracies renamed, the round's last
    mine = [h for h in history if h.get('prototype') == spec]
    assert [h['epoch'] for h in mine] == [1, 2] and [h['val_accuracy'] for h in mine] == vals
    for h, student in zip(mine, students):
      want = model_accuracy(student, ctx.dataset.test_x, ctx.dataset.test_y)
      assert h['prototype_test_accuracy'] == pytest.approx(want, abs=1e-6)
    assert mine[-1]['prototype_accuracy'] == pytest.approx(
      model_accuracy(best, ctx.dataset.test_x, ctx.dataset.test_y), abs=1e-6
    )
  y = np.asarray(ctx.dataset.test_y)
  per_prototype = {s: np.mean(np.argmax(lg, 1) == y) for s, lg in zip([WIDE, NARROW], logits)}
  vote = np.mean(np.argmax(np.mean(logits, 0), 1) == y)
  assert len(states[-1]) == 2 and len(history) == 5  # 2 prototypes × 2 epochs, then the vote
  assert all('test_accuracy' not in h and 'round_accuracy' not in h for h in history[:-1])
  assert history[-1] == {
    'step': 4,
    'round': 1,
    'test_accuracy': pytest.approx(vote, abs=1e-6),
    'prototype_test_accuracy': pytest.approx(per_prototype, abs=1e-6),
    'mean_prototype_test_accuracy': pytest.approx(np.mean(list(per_prototype.values())), abs=1e-6),
  }
  assert [algorithm.step_label(i, 4) for i in (0, 3)] == [
    'prototype 1/2 epoch 1/2',
    'prototype 2/2 epoch 2/2',
  ]
  assert algorithm.setup_records(ctx, aux) == [{'round': 1, 'clients': 3, 'upload_bytes': 0}]
  summary = algorithm.summarize(ctx, aux, states[-1], history)
  client_logits = logits_by_client(teachers, first, ctx.dataset.test_x)
  assert summary == {
    'prototypes': [WIDE, NARROW],
    'prototype_test_accuracy': pytest.approx(per_prototype, abs=1e-6),
    'mean_prototype_test_accuracy': pytest.approx(np.mean(list(per_prototype.values())), abs=1e-6),
    'prototype_best_val_accuracy': pytest.approx(dict(zip([WIDE, NARROW], best_vals)), abs=1e-6),
    'eval_samples': len(y),
    'client_models': [WIDE, NARROW, WIDE],
    'client_test_accuracy': pytest.approx([np.mean(np.argmax(c, 1) == y) for c in client_logits]),
    'teacher_ensemble_test_accuracy': pytest.approx(
      np.mean(np.argmax(np.mean(client_logits, 0), 1) == y), abs=1e-6
    ),
  }


def test_feddf_takes_nothing_from_the_test_split_and_refuses_a_too_small_holdout():
  config = tiny_config(feddf=dict(FEDDF, source_size=50, val_size=30))
  with pytest.raises(ConfigError, match='dataset.holdout_size'):
    driver.build_algorithm('feddf', config)
  config.feddf.val_split = 'test'
  with pytest.raises(ConfigError, match='val_split'):
    driver.build_algorithm('feddf', config)


def test_feddf_draws_from_another_dataset_and_validates_on_the_training_split():
  """source='digits' (a dataset loaded apart from the clients'), val_split='train': the pool is a
  seeded draw of that dataset's training images, unlabelled; validation a seeded draw of the
  (clients') training split."""
  config = tiny_config(feddf=dict(FEDDF, source='digits', val_split='train'))
  ctx = driver.context_of_config(config)
  train_x, train_y = ctx.dataset.train_x, ctx.dataset.train_y
  cfg = driver.build_algorithm('feddf', config).config
  data = feddf.distillation_data(ctx, cfg)
  val = np.sort(np.random.default_rng(config.seed).choice(len(train_y), 30, replace=False))
  np.testing.assert_array_equal(data.val_x, train_x[val])
  np.testing.assert_array_equal(data.val_y, train_y[val])
  other = load_dataset('digits').train_x
  pool = np.sort(np.random.default_rng(config.seed).choice(len(other), 20, replace=False))
  assert data.source == 'digits' and data.pool.images.dtype == jnp.float32
  np.testing.assert_array_equal(data.pool.images, other[pool])
  assert data.pool.labels.dtype == jnp.int32 and np.all(np.asarray(data.pool.labels) == -1)
  assert data.pool.count.dtype == jnp.int32 and int(data.pool.count) == 20
  everything = feddf.distillation_data(ctx, cfg._replace(val_size=len(train_y)))
  assert len(everything.val_y) == len(train_y)
  with pytest.raises(ConfigError, match=f'the training split has {len(train_y)} samples'):
    feddf.distillation_data(ctx, cfg._replace(val_size=len(train_y) + 1))


@pytest.mark.parametrize(
  'key, value, message',
  [
    ('server_model', 'nonesuch', "feddf.server_model: unknown model 'nonesuch'"),
    ('source_size', 0, 'feddf.source_size'),
    ('patience', -1, 'feddf.patience'),
    ('teacher_bn', 'frozen', 'feddf.teacher_bn'),
    ('architectures', 'some', 'feddf.architectures'),
    ('source', 'nonesuch', "feddf.source is 'nonesuch'"),
    ('val_size', 41, r'feddf.source_size \+ val_size from'),
  ],
)
def test_feddf_refusals_name_the_key(key, value, message):
  config = tiny_config(feddf=dict(FEDDF, **{key: value}))
  with pytest.raises(ConfigError, match=message):
    driver.build_algorithm('feddf', config)


def test_feddf_vote_refuses_more_than_one_round():
  config = tiny_config(feddf=dict(FEDDF, rounds=2))
  with pytest.raises(ConfigError, match='feddf_vote is one-shot: feddf.rounds must be 1, got 2'):
    driver.build_algorithm('feddf_vote', config)


# ---------------------------------------------------------------------------------------------
# DENSE and Co-Boosting
# ---------------------------------------------------------------------------------------------
SYNTHESIS = {
  'rounds': 1,
  'g_steps': 3,
  'synthesis_batch': 8,
  'kd_batch': 4,
  'nz': 8,
  'ngf': 4,
  'lr_g': 0.05,
}


def generator(gp, z):
  """DENSE's generator (zj-jayzhang/DENSE models/generator.py) in NCHW, train-mode BatchNorm;
  returns NHWC images in [0, 1]."""

  def bn(x, p):
    mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + BN_EPS) * p['scale'][None, :, None, None] + p['bias'][
      None, :, None, None
    ]

  def conv(x, p):
    w = p['kernel'].permute(3, 2, 0, 1)  # HWIO → OIHW
    return F.conv2d(x, w, p.get('bias'), padding=1)

  channels = gp['bn0']['scale'].shape[0]
  x = z @ gp['l1']['kernel'] + gp['l1']['bias']
  side = int(math.isqrt(x.shape[1] // channels))
  x = F.interpolate(bn(x.reshape(z.shape[0], channels, side, side), gp['bn0']), scale_factor=2)
  x = F.leaky_relu(bn(conv(x, gp['conv1']), gp['bn1']), 0.2)
  x = F.leaky_relu(bn(conv(F.interpolate(x, scale_factor=2), gp['conv2']), gp['bn2']), 0.2)
  return torch.sigmoid(conv(x, gp['conv3'])).permute(0, 2, 3, 1)


def crop_flip(x, u, padding):
  """kornia RandomCrop(pad, zero fill) + RandomHorizontalFlip on NHWC from jfed's uniform draw
  u [3, B]: offsets floor(u[:2] · (2 pad + 1)), a flip where u[2] < 0.5."""
  h, w = x.shape[1], x.shape[2]
  if padding:
    xp = F.pad(x, (0, 0, padding, padding, padding, padding))
    n = 2 * padding + 1
    off = np.minimum(np.floor(u[:2] * n), n - 1).astype(int)
    x = torch.stack(
      [xp[b, off[0, b] : off[0, b] + h, off[1, b] : off[1, b] + w] for b in range(len(xp))]
    )
  flip = torch.tensor(u[2] < 0.5)[:, None, None, None]
  return torch.where(flip, x.flip(2), x)


# |gradient| below which an ensemble weight's sign step is float rounding's (see its use)
SIGN_TOLERANCE = 1e-6


def normalized(x, half: bool):
  """Co-Boosting's `Normalize((0.5,), (0.5,))` (`registry.py` `NORMALIZE_DICT`) where `half`
  (`dataset.normalization='half'`): the reference's teachers and student read [−1, 1] inputs."""
  return (x - 0.5) / 0.5 if half else x


def ensemble(per_client, weights):
  if weights is None:
    return per_client.mean(0)
  w = weights[:, None, None]
  return (w * per_client).sum(0) / (w.sum(0))


def synthesis_oracle(ctx, aux, teachers, student, r, e, kind, c, weights=None, half=False):
  """One generator epoch: DENSE `AdvSynthesizer.synthesize` / Co-Boosting `coboost.synthesize`.
  Fresh generator and z (jfed's draw), Adam([G, z], betas (0.5, 0.999)); per step the total
  loss before the step; the lowest-loss G(z) is kept. `c`: the method's config section; `half`:
  the models read normalizer(G(z)), and the kept batch is G(z) (`coboost.py` un-normalises it
  before the pool). Returns (best images, targets)."""
  batch = c.synthesis_batch
  key = jax.random.fold_in(ctx.derive_key(Purpose.SERVER, r, e), 0)
  g0, z0 = dense_generator_init(key, aux.generator, noise_batch=batch)
  y = jax.random.randint(jax.random.fold_in(key, 1), (batch,), 0, 10, jnp.int32)
  y = torch.tensor(np.asarray(jnp.sort(y) if kind == 'dense' else y), dtype=torch.long)
  keys = jax.random.split(jax.random.fold_in(key, 2), c.g_steps)
  gp, z = to_torch(g0.params, requires_grad=True), to_torch(z0, requires_grad=True)
  opt = torch.optim.Adam(leaves(gp) + [z], lr=c.lr_g, betas=(0.5, 0.999), eps=1e-8)
  sp, ss = student
  best_loss, best_x = math.inf, None
  for i in range(c.g_steps):
    x = generator(gp, z)
    xa = x
    if kind == 'dense':  # Co-Boosting feeds the un-augmented G(z)
      u = np.asarray(jax.random.uniform(keys[i], (3, batch)))
      xa = crop_flip(x, u, 1)
    xa = normalized(xa, half)
    outs = [net(tp, ts, xa, False) for tp, ts in teachers]
    t = ensemble(torch.stack([o[0] for o in outs]), weights)
    s = net(sp, ss, xa, False)[0]
    log_p = F.log_softmax(t, 1)
    if kind == 'dense':
      # Σ over every client's BN layer of ||rv − var|| + ||rm − mean|| (DeepInversion hook)
      l_bn = sum(
        torch.linalg.norm(ts['bn1']['bn']['var'] - o[2])
        + torch.linalg.norm(ts['bn1']['bn']['mean'] - o[1])
        for (tp, ts), o in zip(teachers, outs)
      )
      l_oh = F.cross_entropy(t, y)
      mask = (s.argmax(1) != t.argmax(1)).float()
      l_adv = -(mask * kl_rows(s, t, 1.0)).mean()
      loss = c.bn * l_bn + c.oh * l_oh + c.adv * l_adv
    else:
      p_y = log_p.gather(1, y[:, None])[:, 0].exp().detach()
      l_oh = ((1 - p_y) ** c.hs * F.cross_entropy(t, y, reduction='none')).mean()
      l_adv = -(kl_rows(s, t, c.adv_T) * c.adv_T**2).mean()
      loss = c.oh * l_oh + c.adv * l_adv
    if loss.item() < best_loss:
      best_loss, best_x = loss.item(), x.detach().clone()
    opt.zero_grad()
    loss.backward()
    if kind == 'coboosting':
      torch.nn.utils.clip_grad_norm_(leaves(gp), c.g_grad_clip)  # the generator's, not z's
    opt.step()
  return best_x.numpy(), y.numpy()


def kd_oracle(ctx, teachers, student, opt, pool_x, r, e, lr, kind, c, weights=None, half=False):
  """One KD pass over the whole pool (DENSE `kd_train`, Co-Boosting `cb_kd_train`): shuffled
  batches, the HFlip KD view, (Co-Boosting) the ODS step on the weighted teacher, KL at T
  × T² 'batchmean' against the (weighted) teacher, SGD(momentum) on the student in train mode.
  `c`: the method's config section (Co-Boosting's ODS step `odseta` is in its reference's
  normalised units: with `half` the pool images are normalised first, as the reference's loader
  does, and moved by odseta; without, moved by odseta × 0.5 in [0, 1] units)."""
  params, stats = student
  for group in opt.param_groups:
    group['lr'] = lr
  rng = np.random.default_rng((int(ctx.config.seed), r, e))
  perm = rng.permutation(len(pool_x))
  kd_key = jax.random.fold_in(ctx.derive_key(Purpose.SERVER, r, e), 1)
  pool = torch.tensor(pool_x)
  for b in range(len(pool_x) // c.kd_batch):
    key = jax.random.fold_in(kd_key, b)
    x = pool[perm[b * c.kd_batch : (b + 1) * c.kd_batch]]
    u = np.asarray(jax.random.uniform(jax.random.fold_in(key, 0), (3, c.kd_batch)))
    x = normalized(crop_flip(x, u, 0), half)

    def teacher(xx):
      return ensemble(torch.stack([net(tp, ts, xx, False)[0] for tp, ts in teachers]), weights)

    if kind == 'coboosting':
      direction = torch.tensor(
        np.asarray(
          jax.random.uniform(jax.random.fold_in(key, 1), (c.kd_batch, 10), minval=-1.0, maxval=1.0)
        )
      )
      xx = x.clone().requires_grad_(True)
      (direction * F.softmax(teacher(xx) / c.ods_T, 1)).sum().backward()
      x = (x + c.odseta * (1.0 if half else 0.5) * xx.grad.sign()).detach()
    with torch.no_grad():
      t = teacher(x)
    out, mean, var = net(params, stats, x, True)
    loss = (kl_rows(out, t, c.kd_T) * c.kd_T**2).mean()
    opt.zero_grad()
    loss.backward()
    if kind == 'coboosting':
      torch.nn.utils.clip_grad_norm_(leaves(params), c.kd_grad_clip)
    opt.step()
    stats = updated_statistics(stats, mean, var)
  return params, stats


def quantised(x):
  return np.floor(np.clip(x, 0.0, 1.0) * 255.0) / 255.0


def summarize(algorithm, ctx, aux, states, history):
  """The run's summary, with its figures drawn into a temporary workdir."""
  with tempfile.TemporaryDirectory() as workdir:
    with_workdir = driver.context_of_config(ctx.config, workdir=pathlib.Path(workdir))
    summary = algorithm.summarize(with_workdir, aux, states[-1], history)
    assert (pathlib.Path(workdir) / 'distillation_accuracy.png').exists()
  return summary


def pool_images(state):
  n = int(min(int(state.pool.count), state.pool.capacity))
  return np.asarray(state.pool.images[:n]).astype(np.float32) / 255.0, np.asarray(
    state.pool.labels[:n]
  )


def test_dense_one_server_epoch(monkeypatch):
  """DENSE from given client models: a fresh generator trained on bn · L_bn (summed over every
  client's BN layer) + oh · CE(mean teacher, y) + adv · L_adv (KL masked by the student's
  disagreement, T = 1) on the crop/flip view; its lowest-loss batch joins the uint8 pool; then
  the RANDOMLY initialised student (not a teacher, not FedAvg) takes SGD(momentum 0.9) steps
  on KL_T=20 × T² against the unweighted mean of all clients' logits."""
  given_client_models(monkeypatch)
  config = tiny_config(dense=dict(SYNTHESIS, epochs=1, kd_lr=0.01, bn=0.5, oh=1.0, adv=2.0))
  algorithm, ctx, aux, states, history = run_steps('dense', config)
  teachers = client_models(aux.round_cache[1].local)
  student = (to_torch(aux.random_student.params), to_torch(aux.random_student.batch_stats))
  best_x, labels = synthesis_oracle(ctx, aux, teachers, student, 1, 0, 'dense', config.dense)
  got_x, got_y = pool_images(states[1])
  np.testing.assert_array_equal(got_y, labels)
  np.testing.assert_allclose(got_x, quantised(best_x), atol=1.0 / 255 + 1e-6)
  params = to_torch(aux.random_student.params, requires_grad=True)
  opt = torch.optim.SGD(leaves(params), lr=0.01, momentum=0.9)
  params, stats = kd_oracle(
    ctx, teachers, (params, student[1]), opt, got_x, 1, 0, 0.01, 'dense', config.dense
  )
  assert_tree_close(states[1].student.model.params, to_numpy(params))
  assert_tree_close(states[1].student.model.batch_stats, to_numpy(stats))
  # the summary: the student's and every teacher's accuracy on the whole test split
  test_x, test_y = ctx.dataset.test_x, np.asarray(ctx.dataset.test_y)
  client_logits = logits_by_client(teachers, aux.round_cache[1].local, test_x)
  student_accuracy = accuracy(params, stats, test_x, test_y)
  assert summarize(algorithm, ctx, aux, states, history) == {
    'last_epoch_test_accuracy': pytest.approx(student_accuracy, abs=1e-6),
    'round_test_accuracy': [pytest.approx(student_accuracy, abs=1e-6)],
    'rounds': 1,
    'epochs': 1,
    'local_epochs': config.dense.local_epochs,
    'server_model': WIDE,
    'client_models': [WIDE] * 3,
    'client_test_accuracy': pytest.approx(
      [np.mean(np.argmax(c, 1) == test_y) for c in client_logits]
    ),
    'teacher_ensemble_test_accuracy': pytest.approx(
      np.mean(np.argmax(np.mean(client_logits, 0), 1) == test_y), abs=1e-6
    ),
    'upload_bytes_last_round': 0,  # given client models
    'bn_loss_mode': config.dense.bn_loss_mode,
    'pool_size': len(got_y),
  }


@pytest.mark.parametrize(
  'order,normalization',
  [('before_batch', 'none'), ('after_batch', 'none'), ('before_batch', 'half')],
)
def test_coboosting_three_server_epochs(monkeypatch, order, normalization):
  """Co-Boosting from given client models, three epochs (the third synthesises against weights
  the second moved): hard-sample synthesis ((1 − p_y) · CE)
  against the per-client weighted ensemble, adversarial KL at T = 3 × 9 without a mask, the
  generator's gradient norm clipped to 10, un-augmented G(z); from epoch 2 on the ensemble
  weights take signed-gradient steps on CE over the labelled pool (w − mu · wdc^e · sign(g),
  clipped to [0, 1] within ±1 of the epoch's start), the pool of the earlier epochs
  ('before_batch': `coboost.py:synthesize` updates before `data_pool.add`) or with this
  epoch's batch too ('after_batch'); the KD view of EVERY KD batch (not the
  stored pool) is moved by ODS along sign ∇_x Σ r ⊙ softmax(t_w(x)/4); the student takes
  SGD(momentum 0.9, wd 1e-4, grad clip 10) steps on KL_T=4 × 16 against the weighted teacher
  with the learning rate of CosineAnnealingLR over the epochs. `dataset.normalization='half'`:
  the oracle works as the reference does, in [−1, 1] (normalizer(G(z)) before the models, the
  pool normalised when read, the ODS step of odseta on the normalised image), jfed in [0, 1]
  with models that normalise their input."""
  given_client_models(monkeypatch)
  half = normalization == 'half'
  # Larger steps than the defaults, so that every mechanism moves the numbers by more than the
  # tolerance: weights that reach the [0, 1] bounds, a clipped generator gradient, a visible
  # ODS step.
  config = tiny_config(
    coboosting=dict(
      SYNTHESIS,
      epochs=3,
      mu=0.2,
      wdc=0.9,
      g_grad_clip=0.05,
      odseta=0.5,
      kd_lr=0.1,
      weight_update_order=order,
    )
  )
  config.dataset.normalization = normalization
  _, ctx, aux, states, history = run_steps('coboosting', config)
  c = config.coboosting
  teachers = client_models(aux.round_cache[1].local)
  params = to_torch(aux.random_student.params, requires_grad=True)
  stats = to_torch(aux.random_student.batch_stats)
  opt = torch.optim.SGD(leaves(params), lr=c.kd_lr, momentum=0.9, weight_decay=c.kd_weight_decay)
  w = torch.full((3,), 1.0 / 3)
  compared = []  # the epochs whose weight update was compared
  for e in range(c.epochs):
    state = states[e + 1]
    if e > 0:  # each epoch from jfed's student (checked equal below): ODS's sign() amplifies
      # float32 rounding from one epoch into the next
      with torch.no_grad():
        for t, a in zip(leaves(params), jax.tree.leaves(states[e].student.model.params)):
          t.copy_(torch.tensor(np.asarray(a)))
      stats = to_torch(states[e].student.model.batch_stats)
    best_x, labels = synthesis_oracle(
      ctx, aux, teachers, (params, stats), 1, e, 'coboosting', c, w, half
    )
    x, y = pool_images(state)
    np.testing.assert_array_equal(y[-len(labels) :], labels)
    np.testing.assert_allclose(x[-len(labels) :], quantised(best_x), atol=1.0 / 255 + 1e-6)
    if e > 0:  # the ensemble-weight update over the labelled pool
      w0 = w.clone()
      n = len(x) - len(labels) if order == 'before_batch' else len(x)
      rng = np.random.default_rng((int(config.seed), 1, e, 7))
      perm = rng.permutation(n)
      with torch.no_grad():
        per_client = torch.stack(
          [net(tp, ts, normalized(torch.tensor(x[:n]), half), False)[0] for tp, ts in teachers]
        )
      smallest = float('inf')
      for b in range(n // c.kd_batch):
        idx = perm[b * c.kd_batch : (b + 1) * c.kd_batch]
        wv = w.clone().requires_grad_(True)
        F.cross_entropy(
          ensemble(per_client[:, idx], wv), torch.tensor(y[idx], dtype=torch.long)
        ).backward()
        smallest = min(smallest, float(wv.grad.abs().min()))
        w = w - c.mu * c.wdc**e * wv.grad.sign()
        w = torch.clamp(w0 + torch.clamp(w - w0, -1.0, 1.0), 0.0, 1.0)
      if smallest < SIGN_TOLERANCE:
        # a gradient component within float32 rounding of 0: its sign is the kernels' (torch's
        # and XLA's logits differ in the last bits, by CPU), and sign() makes it a full step;
        # the epoch is not compared and the oracle goes on from jfed's weights
        w = torch.tensor(np.asarray(state.extra))
      else:
        np.testing.assert_allclose(np.asarray(state.extra), w.numpy(), rtol=1e-6)
        assert history[e]['ensemble_weights'] == pytest.approx(w.numpy().tolist(), abs=1e-6)
        compared.append(e)
    lr = 0.5 * c.kd_lr * (1 + math.cos(math.pi * e / c.epochs))
    params, stats = kd_oracle(
      ctx, teachers, (params, stats), opt, x, 1, e, lr, 'coboosting', c, w, half
    )
    # atol 1e-4: an ODS sign() of a near-zero input gradient may flip under float32 rounding
    assert_tree_close(state.student.model.params, to_numpy(params), atol=1e-4)
    assert_tree_close(state.student.model.batch_stats, to_numpy(stats))
  assert not np.allclose(w.numpy(), 1.0 / 3)  # the weights moved
  assert compared  # at least one epoch's update was checked (epoch 1 on the machines tried)
