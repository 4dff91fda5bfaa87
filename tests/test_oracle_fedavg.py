"""Oracle tests of the FedAvg family: fedavg, fedprox, fedavg_vote, centralized, local, ot.

Each test runs the registered method through `jfed.driver.run` on a tiny deterministic problem
(a slice of sklearn digits, 'mlp' models 5-20 units wide, clients of unequal sizes, batch 8 so
that every client ends an epoch on a partial batch) and compares what it returns with an
independent computation in NumPy (tests/oracle_numpy.py): the local SGD epochs by hand-written
backprop and torch.optim.SGD's update, the averages, the forward passes and the accuracies on the
full test split.

What the oracles take from jfed are inputs, not the computations under test: the initial
parameters jfed drew (`jfed.engine.init_model` with the run's keys), the data and the partition,
and the order in which local training visits a client's samples (`oracle_numpy.visiting_order`,
the documented key derivation of jfed/engine/training.py: a random draw, like a DataLoader's
shuffle, which an oracle cannot reproduce any other way).

References: FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS'17, arXiv 1602.05629); FedProx (Li et al., "Federated Optimization in
Heterogeneous Networks", MLSys'20, arXiv 1812.06127; proximal step as github.com/RickZack/FedSeq
src/optim/pgd.py); the prototype vote of FedMHO (github.com/YXShi2000/FedMHO,
`federated_average_ensemble`); OT fusion (Singh & Jaggi, "Model Fusion via Optimal Transport",
NeurIPS'20, arXiv 1910.05653; github.com/sidak/otfusion wasserstein_ensemble.py, weight mode).
"""

import itertools
import re
from typing import Dict, List, Sequence

import jax
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from jfed import engine
from jfed.configs.base import base_config
from jfed.data import load_dataset
from jfed.data.datasets import Dataset
from jfed.driver import build_algorithm, make_context, run
from jfed.engine import ModelState
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.methods import common
from tests import oracle_numpy as onp
from tests.support import override

BATCH = 8
SIZES = (23, 41, 12)  # unequal, none a multiple of BATCH
# base_config()'s client optimiser, SGD with momentum 0.9, at a rate at which a few steps move the
# clients apart: at its 0.01 they stay so close to the shared init that several score alike,
# and a test could not tell them apart
LR, MOMENTUM = 0.1, 0.9
NARROW, WIDE = 'mlp:width_mult=0.05', 'mlp:width_mult=0.1'  # hidden widths 10 and 20
HETERO = {'client_models': f'{NARROW};{WIDE}'}  # clients 0, 2 narrow; 1, 3 wide
HETERO_SIZES = (23, 41, 12, 17)  # 93 of the 96 training images


# ---------------------------------------------------------------------------------------------
# the tiny problem
# ---------------------------------------------------------------------------------------------

_DIGITS = {}


def _dataset() -> Dataset:
  """96 training and 50 test images of sklearn digits."""
  if not _DIGITS:
    d = load_dataset('digits')
    _DIGITS['d'] = Dataset(
      'digits', d.train_x[:96], d.train_y[:96], d.test_x[:50], d.test_y[:50], d.num_classes
    )
  return _DIGITS['d']


def _parts(sizes: Sequence[int]) -> List[np.ndarray]:
  """Disjoint random client index sets of the given sizes (some training samples left over)."""
  order = np.random.default_rng(7).permutation(len(_dataset().train_y))
  bounds = np.cumsum((0,) + tuple(sizes))
  return [np.sort(order[bounds[k] : bounds[k + 1]]) for k in range(len(sizes))]


def _config(num_clients: int, **overrides):
  c = base_config()
  c.dataset.name = 'digits'
  c.model = NARROW
  c.batch_size = BATCH
  c.eval_batch_size = 16  # several evaluation batches, the last one partial
  c.partition.num_clients = num_clients
  assert c.optimizer.name == 'sgd' and c.optimizer.momentum == MOMENTUM
  c.optimizer.lr = LR
  return override(c, **overrides)


def _context(config, sizes: Sequence[int] = SIZES, workdir=None):
  """The run context of `config` on the tiny problem, its clients of these sizes."""
  return make_context(config, _dataset(), _parts(sizes), workdir)


class _Recorder:
  """Keeps what the registered algorithm's setup and steps return while `run` drives it."""

  def __init__(self, algorithm):
    self.aux, self.states, self.records = None, [], []
    setup, step = algorithm.setup, algorithm.step

    def recording_setup(ctx):
      self.aux = setup(ctx)
      return self.aux

    def recording_step(ctx, aux, state, i):
      state, records = step(ctx, aux, state, i)
      self.states.append(state)
      self.records.append(records)
      return state, records

    algorithm.setup, algorithm.step = recording_setup, recording_step


def _run(method: str, config, sizes=SIZES, local_models=None, dataset=None):
  """(summary, recorder, ctx) of `method` run in memory on the tiny problem (or on `dataset`,
  the tiny problem's images changed). `local_models` ([stacked ModelState] per architecture)
  seeds the run's one-shot local-models stage: the server stage then starts from these given
  client models."""
  algorithm = build_algorithm(method, config)
  recorder = _Recorder(algorithm)
  ctx = make_context(config, _dataset() if dataset is None else dataset, _parts(sizes))
  if local_models is not None:
    epochs = config[method].local_epochs
    ctx.stage('local_models', epochs, None, lambda: local_models)
  return run(algorithm, ctx, progress=False), recorder, ctx


def _init_params(spec: str, key) -> Dict:
  """The initial parameters jfed draws for `spec` with `key` (an input of the oracles)."""
  module = common.build_module(spec, _dataset())
  return onp.to_numpy(engine.init_model(module, _dataset().input_shape, key).params)


def _client_data(ctx, k: int):
  idx = ctx.parts[k]
  return ctx.dataset.train_x[idx], ctx.dataset.train_y[idx]


def _test_accuracy(params) -> float:
  return onp.accuracy(onp.mlp_forward(params, _dataset().test_x), _dataset().test_y)


def _assert_full_test_split(summary):
  assert summary['eval_samples'] == len(_dataset().test_y) == 50


@pytest.fixture
def scored(monkeypatch):
  """(params, number of samples) of every model jfed scores with `Evaluator.accuracy`, in order:
  which model a method reports, and on how much of the test split."""
  calls = []
  accuracy = engine.Evaluator.accuracy

  def recording_accuracy(self, model, x, y):
    calls.append((onp.to_numpy(model.params), len(y)))
    return accuracy(self, model, x, y)

  monkeypatch.setattr(engine.Evaluator, 'accuracy', recording_accuracy)
  return calls


def _assert_scored(scored, models):
  """jfed scored exactly `models`, in this order, each on the full test split."""
  assert len(scored) == len(models)
  for (params, samples), want in zip(scored, models):
    assert samples == len(_dataset().test_y)
    onp.assert_tree_close(params, want)


# ---------------------------------------------------------------------------------------------
# the oracle helpers against their definitions
# ---------------------------------------------------------------------------------------------


def test_numpy_forward_passes_match_the_models():
  x = _dataset().test_x[:7]
  for spec, forward in [
    (NARROW, lambda v: onp.mlp_forward(v['params'], x)),
    ('fedmho_cnn:softmax_output=0', lambda v: onp.fedmho_cnn_forward(v['params'], x)),
    ('fedmho_cnn:softmax_output=1', lambda v: onp.fedmho_cnn_forward(v['params'], x, True)),
    ('cnn_mnist', lambda v: onp.cnn_mnist_forward(v['params'], v['batch_stats'], x)),
  ]:
    module = common.build_module(spec, _dataset())
    state = engine.init_model(module, _dataset().input_shape, jax.random.PRNGKey(3))
    # non-trivial running statistics, so that eval-mode BN is exercised
    stats = jax.tree.map(lambda a: a + 0.3, state.batch_stats)
    variables = {'params': state.params, 'batch_stats': stats}
    want = np.asarray(module.apply(variables, x, train=False))
    np.testing.assert_allclose(forward(onp.to_numpy(variables)), want, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings('ignore:reduction:UserWarning')  # torch's note on KLDivLoss 'mean'
def test_numpy_losses_and_sgd_match_torch():
  torch = pytest.importorskip('torch')
  rng = np.random.default_rng(0)
  logits, teacher = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
  labels = rng.integers(0, 4, 5)
  t = lambda a: torch.tensor(a, dtype=torch.float64)
  np.testing.assert_allclose(
    onp.cross_entropy(logits, labels),
    torch.nn.functional.cross_entropy(t(logits), torch.tensor(labels)).item(),
  )
  for reduction in ('batchmean', 'mean', 'sum'):
    want = torch.nn.KLDivLoss(reduction=reduction)(
      torch.log_softmax(t(logits), -1), torch.softmax(t(teacher), -1)
    )
    got = onp.kl_div(logits, onp.softmax(teacher), reduction)
    np.testing.assert_allclose(got, want.item(), rtol=1e-12)
  # three steps of torch.optim.SGD (momentum, weight decay, Nesterov) on a quadratic
  for nesterov in (False, True):
    w0 = rng.normal(size=(3, 2))
    tw = t(w0).requires_grad_()
    opt = torch.optim.SGD([tw], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    params, buffers = {'w': w0}, None
    for _ in range(3):
      opt.zero_grad()
      (tw**3).sum().backward()
      opt.step()
      grads = {'w': 3 * params['w'] ** 2}
      params, buffers = onp.sgd_momentum_step(
        params, grads, buffers, 0.1, 0.9, weight_decay=0.01, nesterov=nesterov
      )
    np.testing.assert_allclose(params['w'], tw.detach().numpy(), rtol=1e-12)


def test_numpy_mlp_gradients_match_finite_differences():
  rng = np.random.default_rng(1)
  params = _init_params(NARROW, jax.random.PRNGKey(0))
  anchor = onp.tree_map(lambda a: a + rng.normal(size=a.shape) * 0.1, params)
  x, y = _dataset().train_x[:6], _dataset().train_y[:6]
  _, grads = onp.mlp_loss_and_grads(params, x, y, prox_mu=0.3, anchor=anchor)
  for name, leaf, index in [
    ('Dense_0', 'kernel', (20, 3)),
    ('Dense_1', 'bias', (4,)),
    ('Dense_2', 'kernel', (7, 2)),
  ]:

    def loss_at(delta):
      p = onp.tree_map(np.copy, params)
      p[name][leaf][index] += delta
      return onp.mlp_loss_and_grads(p, x, y, prox_mu=0.3, anchor=anchor)[0]

    numeric = (loss_at(1e-6) - loss_at(-1e-6)) / 2e-6
    np.testing.assert_allclose(grads[name][leaf][index], numeric, rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# FedAvg and FedProx: whole rounds
# ---------------------------------------------------------------------------------------------


def _oracle_rounds(
  ctx,
  rounds: int,
  epochs: int,
  prox_mu=0.0,
  weight_decay=0.0,
  server_momentum=None,
  participation=1.0,
):
  """Global models and test accuracies after each of `rounds` FedAvg rounds (McMahan et al.,
  Algorithm 1): every client starts from the global model with a fresh SGD optimiser, trains
  `epochs` epochs (FedProx: + mu/2 ||w − w_global||²), and the global model becomes the average
  of the client models weighted by n_k / n. With `server_momentum` β, FedAvgM's server step
  v ← β v + (θ − aggregate), θ ← θ − v (server lr 1) instead. With `participation` < 1, only
  the round's sampled clients train and are averaged (the draw is an input, see `_sampled`)."""
  global_params = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  velocity = None
  out = []
  for r in range(rounds):
    key = ctx.derive_key(Purpose.ROUNDS, r)
    clients, sizes, losses = [], [], []
    for k in _sampled(ctx, r, participation):
      x, y = _client_data(ctx, k)
      params, _, epoch_losses = onp.mlp_local_sgd(
        global_params,
        x,
        y,
        onp.epoch_orders(key, k, len(y), epochs),
        BATCH,
        LR,
        MOMENTUM,
        weight_decay=weight_decay,
        prox_mu=prox_mu,
        anchor=global_params,
      )
      clients.append(params)
      sizes.append(len(y))
      losses.append(epoch_losses[-1])
    aggregate = onp.weighted_average(clients, sizes)
    if server_momentum is None:
      global_params = aggregate
    else:
      grad = onp.tree_map(lambda g, a: g - a, global_params, aggregate)
      velocity = (
        grad
        if velocity is None
        else onp.tree_map(lambda v, g: server_momentum * v + g, velocity, grad)
      )
      global_params = onp.tree_map(lambda g, v: g - v, global_params, velocity)
    out.append((global_params, _test_accuracy(global_params), float(np.mean(losses))))
  return out


def _sampled(ctx, r: int, participation: float) -> List[int]:
  """The clients of round r (the draw is an input of the oracle: `onp.sampled_clients`)."""
  return onp.sampled_clients(ctx.derive_key(Purpose.SAMPLING, r), ctx.num_clients, participation)


@pytest.mark.parametrize('server_optimizer', ['fedavg', 'fedavgm'])
def test_fedavg_rounds_match_the_oracle(server_optimizer, scored):
  config = _config(
    3,
    **{
      'fedavg.rounds': 2,
      'fedavg.local_epochs': 1,
      'server_optimizer.name': server_optimizer,
      'server_optimizer.lr': 1.0,
      'server_optimizer.momentum': 0.9,
    },
  )
  summary, rec, ctx = _run('fedavg', config)
  momentum = 0.9 if server_optimizer == 'fedavgm' else None
  want = _oracle_rounds(ctx, 2, 1, server_momentum=momentum)
  _assert_scored(scored, [params for params, _, _ in want])  # the global model, not the aggregate
  for r, (params, acc, loss) in enumerate(want):
    onp.assert_tree_close(rec.states[r].model.params, params)
    (record,) = rec.records[r]
    assert record['test_accuracy'] == pytest.approx(acc, abs=1e-9)
    assert record['train_loss'] == pytest.approx(loss, rel=1e-4)
    assert record['clients'] == 3
  assert summary['final_test_accuracy'] == pytest.approx(want[-1][1], abs=1e-9)
  _assert_full_test_split(summary)


def test_fedavg_with_partial_participation_matches_the_oracle():
  # 3 of 4 clients a round: the round's group is padded to the largest client's batches
  config = _config(4, **{'fedavg.rounds': 2, 'fedavg.participation': 0.75})
  summary, rec, ctx = _run('fedavg', config, HETERO_SIZES)
  want = _oracle_rounds(ctx, 2, 1, participation=0.75)
  assert [_sampled(ctx, r, 0.75) for r in range(2)] != [[0, 1, 2]] * 2  # not the first three
  for r, (params, acc, loss) in enumerate(want):
    onp.assert_tree_close(rec.states[r].model.params, params)
    (record,) = rec.records[r]
    assert record['clients'] == 3
    assert record['test_accuracy'] == pytest.approx(acc, abs=1e-9)
    assert record['train_loss'] == pytest.approx(loss, rel=1e-4)
  _assert_full_test_split(summary)


def test_recomputed_bn_statistics_are_the_static_bn_of_the_averaged_weights_on_the_clients():
  # bn_stats changes the global model's running statistics only: the weights are the same as
  # with the averaged statistics (train-mode training never reads the running ones)
  runs = {}
  for bn_stats in ('averaged', 'recomputed'):
    overrides = {'fedavg.rounds': 2, 'fedavg.bn_stats': bn_stats}
    runs[bn_stats] = _run('fedavg', _config(3, model='cnn_mnist', **overrides))
  _, averaged, _ = runs['averaged']
  summary, rec, ctx = runs['recomputed']
  images = np.concatenate([_client_data(ctx, k)[0] for k in range(3)])
  test_x, test_y = _dataset().test_x, _dataset().test_y
  for r in range(2):
    params = onp.to_numpy(rec.states[r].model.params)
    onp.assert_tree_close(params, onp.to_numpy(averaged.states[r].model.params))
    want = onp.cnn_mnist_static_bn(params, images, BATCH)
    onp.assert_tree_close(rec.states[r].model.batch_stats, want)
    (record,) = rec.records[r]
    acc = onp.accuracy(onp.cnn_mnist_forward(params, want, test_x), test_y)
    assert record['test_accuracy'] == pytest.approx(acc, abs=1e-9)
    assert 'averaged_bn_test_accuracy' not in averaged.records[r][0]
  stats = averaged.states[0].model.batch_stats['BatchNorm_1']['bn']['var']
  assert not np.allclose(stats, rec.states[0].model.batch_stats['BatchNorm_1']['bn']['var'])
  # the same weights with the averaged statistics: what the averaged run scored
  assert rec.records[0][0]['averaged_bn_test_accuracy'] == averaged.records[0][0]['test_accuracy']
  _assert_full_test_split(summary)


def test_one_shot_fedavg_of_shared_local_models_recomputes_its_bn_statistics_too():
  """`reuse_local_models` (one round over the shared one-shot uploads) takes the same
  `bn_stats` path as a training round: the static BN of the averaged weights on the clients."""
  overrides = {'fedavg.reuse_local_models': True, 'fedavg.bn_stats': 'recomputed'}
  _, rec, ctx = _run('fedavg', _config(3, model='cnn_mnist', **overrides))
  images = np.concatenate([_client_data(ctx, k)[0] for k in range(3)])
  params = onp.to_numpy(rec.states[0].model.params)
  want = onp.cnn_mnist_static_bn(params, images, BATCH)
  onp.assert_tree_close(rec.states[0].model.batch_stats, want)
  (record,) = rec.records[0]
  assert record['reused_local_models'] and 'averaged_bn_test_accuracy' in record


def test_recomputed_bn_statistics_are_refused_under_differential_privacy():
  config = _config(3, model='cnn_mnist', **{'fedavg.bn_stats': 'recomputed', 'dp.enabled': True})
  with pytest.raises(
    ConfigError,
    match=r"^fedavg.bn_stats='recomputed' reads the clients' raw images outside the DP mechanism: "
    r"use 'averaged' with dp.enabled$",
  ):
    build_algorithm('fedavg', config)
  with pytest.raises(ConfigError, match='fedprox.bn_stats'):
    build_algorithm('fedprox', _config(3, **{'fedprox.bn_stats': 'running'}))


def test_fedprox_round_matches_the_oracle():
  # FedSeq's FedProx setting (pgd.yaml: weight decay 4e-4) with a mu large enough to matter.
  # FedSeq's PGD adds mu (w − w_global) to the step *after* the momentum update, but into the
  # momentum buffer itself (its d_p is the buffer), so it takes exactly torch.optim.SGD's steps
  # on the gradient of CE + mu/2 ||w − w_global||², the oracle's (and FedDF's) form.
  config = _config(
    3,
    **{
      'fedprox.rounds': 2,
      'fedprox.local_epochs': 2,
      'fedprox.mu': 0.5,
      'optimizer.weight_decay': 4e-4,
    },
  )
  summary, rec, ctx = _run('fedprox', config)
  want = _oracle_rounds(ctx, 2, 2, prox_mu=0.5, weight_decay=4e-4)
  for r, (params, acc, loss) in enumerate(want):
    onp.assert_tree_close(rec.states[r].model.params, params)
    assert rec.records[r][0]['test_accuracy'] == pytest.approx(acc, abs=1e-9)
  # the proximal term changes the result: the same run with mu = 0 is another model
  plain = _oracle_rounds(ctx, 1, 2, prox_mu=0.0, weight_decay=4e-4)[0][0]
  assert not np.allclose(plain['Dense_0']['kernel'], want[0][0]['Dense_0']['kernel'], atol=1e-4)
  _assert_full_test_split(summary)


# ---------------------------------------------------------------------------------------------
# one-shot local models: local, fedavg_vote
# ---------------------------------------------------------------------------------------------


def _oracle_local_models(ctx, specs: Sequence[str], epochs: int) -> List[Dict]:
  """Every client's one-shot local model: from its architecture's initial model (one per
  distinct spec, in order of first appearance), `epochs` epochs of SGD on its own data."""
  distinct = list(dict.fromkeys(specs))
  inits = {
    s: _init_params(s, ctx.derive_key(Purpose.MODEL_INIT, i)) for i, s in enumerate(distinct)
  }
  key = ctx.derive_key(Purpose.LOCAL_TRAINING)
  models = []
  for k, spec in enumerate(specs):
    x, y = _client_data(ctx, k)
    params, _, _ = onp.mlp_local_sgd(
      inits[spec], x, y, onp.epoch_orders(key, k, len(y), epochs), BATCH, LR, MOMENTUM
    )
    models.append(params)
  return models


def test_one_shot_fedavg_of_the_shared_local_models_matches_the_oracle():
  # reuse_local_models: one round that averages the shared one-shot local models (by size)
  config = _config(3, **{'fedavg.local_epochs': 2, 'fedavg.reuse_local_models': True})
  summary, rec, ctx = _run('fedavg', config)
  clients = _oracle_local_models(ctx, [NARROW] * 3, 2)
  want = onp.weighted_average(clients, SIZES)
  onp.assert_tree_close(rec.states[0].model.params, want)
  (record,) = rec.records[0]
  assert record['reused_local_models'] and record['clients'] == 3
  assert record['test_accuracy'] == pytest.approx(_test_accuracy(want), abs=1e-9)
  _assert_full_test_split(summary)


def test_local_matches_the_oracle():
  # 10 epochs: enough for the clients' accuracies to differ, so that a mix-up of clients shows
  config = _config(4, **{'local.epochs': 10, **HETERO})
  summary, rec, ctx = _run('local', config, HETERO_SIZES)
  specs = [NARROW, WIDE, NARROW, WIDE]
  accs = [_test_accuracy(p) for p in _oracle_local_models(ctx, specs, 10)]
  assert len(set(accs)) == 4
  got = [records[0] for records in rec.records]
  assert [r['client'] for r in got] == [0, 1, 2, 3]
  assert [r['model'] for r in got] == specs
  assert [r['train_size'] for r in got] == list(HETERO_SIZES)
  np.testing.assert_allclose([r['test_accuracy'] for r in got], accs, atol=1e-9)
  # Local's reported number: the unweighted mean of the clients' own test accuracies.
  assert summary['final_test_accuracy'] == pytest.approx(np.mean(accs), abs=1e-9)
  assert summary['mean_test_accuracy'] == pytest.approx(np.mean(accs), abs=1e-9)
  np.testing.assert_allclose(summary['client_test_accuracy'], accs, atol=1e-9)
  # every client uploads its float32 model once: its parameters' bytes plus msgpack's framing
  weights = sum(
    leaf.size
    for spec in specs
    for leaf in jax.tree.leaves(_init_params(spec, jax.random.PRNGKey(0)))
  )
  assert 4 * weights <= summary['upload_bytes'] <= 4 * weights + 512 * len(specs)
  _assert_full_test_split(summary)


def test_fedavg_vote_matches_the_oracle(monkeypatch):
  # The accuracies alone hardly tell a vote from another on 50 images: the logits jfed scores
  # are recorded where it scores them and compared with the oracle's.
  scored = []
  accuracy_of_logits = common.accuracy_of_logits

  def recording_accuracy_of_logits(logits, labels):
    scored.append((np.asarray(logits), np.asarray(labels)))
    return accuracy_of_logits(logits, labels)

  monkeypatch.setattr(common, 'accuracy_of_logits', recording_accuracy_of_logits)
  config = _config(4, **{'fedavg_vote.local_epochs': 1, **HETERO})
  summary, rec, ctx = _run('fedavg_vote', config, HETERO_SIZES)
  specs = [NARROW, WIDE, NARROW, WIDE]
  clients = _oracle_local_models(ctx, specs, 1)
  # FedMHO's "model prototypes": the *uniform* average within each architecture
  prototypes = {
    spec: onp.weighted_average([clients[k] for k in range(4) if specs[k] == spec], [1.0, 1.0])
    for spec in (NARROW, WIDE)
  }
  (narrow_got, wide_got) = rec.states[0]
  onp.assert_tree_close(narrow_got.params, prototypes[NARROW])
  onp.assert_tree_close(wide_got.params, prototypes[WIDE])
  test_x, test_y = _dataset().test_x, _dataset().test_y
  logits = {s: onp.mlp_forward(p, test_x) for s, p in prototypes.items()}
  # the vote: argmax of the mean of the prototypes' logits
  mean_logits = (logits[NARROW] + logits[WIDE]) / 2
  vote = onp.accuracy(mean_logits, test_y)
  # what jfed scored: each prototype's logits, then their mean, on the full test split
  assert len(scored) == 3
  for (got, labels), want in zip(scored, [logits[NARROW], logits[WIDE], mean_logits]):
    np.testing.assert_array_equal(labels, test_y)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  (record,) = rec.records[0]
  assert record['test_accuracy'] == pytest.approx(vote, abs=1e-9)
  per_prototype = {s: onp.accuracy(lg, test_y) for s, lg in logits.items()}
  assert record['prototype_test_accuracy'] == pytest.approx(per_prototype, abs=1e-9)
  assert record['mean_prototype_test_accuracy'] == pytest.approx(
    np.mean(list(per_prototype.values())), abs=1e-9
  )
  assert summary['final_test_accuracy'] == pytest.approx(vote, abs=1e-9)
  _assert_full_test_split(summary)


# ---------------------------------------------------------------------------------------------
# centralized
# ---------------------------------------------------------------------------------------------


def test_centralized_matches_the_oracle(scored):
  config = _config(3, **{'centralized.epochs': 2})
  summary, rec, ctx = _run('centralized', config)
  ds = _dataset()
  params = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  buffers = None  # one optimiser for the whole run: its momentum carries across epochs
  for epoch in range(2):
    order = onp.visiting_order(
      jax.random.fold_in(ctx.derive_key(Purpose.LOCAL_TRAINING, epoch), 0), 0, len(ds.train_y)
    )
    params, buffers, (loss,) = onp.mlp_local_sgd(
      params, ds.train_x, ds.train_y, [order], BATCH, LR, MOMENTUM, buffers=buffers
    )
    onp.assert_tree_close(engine.take(rec.states[epoch].model.params, 0), params)
    (record,) = rec.records[epoch]
    assert record['test_accuracy'] == pytest.approx(_test_accuracy(params), abs=1e-9)
    assert record['train_loss'] == pytest.approx(loss, rel=1e-4)
    _assert_scored(scored[epoch : epoch + 1], [params])
  _assert_full_test_split(summary)


def test_centralized_trains_one_model_under_a_schedule_over_all_its_steps():
  # A cosine schedule spans epochs x ceil(n / batch) optimiser steps: batch 10 does not divide the
  # 96 images, so 2 x 10 = 20 steps, the last batch of each epoch partial (6 images).
  batch, epochs = 10, 2
  config = _config(3, **{'centralized.epochs': epochs, 'batch_size': batch})
  config.optimizer.schedule = 'cosine'
  summary, rec, ctx = _run('centralized', config)
  ds = _dataset()
  total = epochs * -(-len(ds.train_y) // batch)
  assert total == 20

  def cosine(step: int) -> float:  # optax.cosine_decay_schedule(LR, total), alpha 0
    return 0.5 * LR * (1.0 + np.cos(np.pi * min(step, total) / total))

  params = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  buffers, step, accuracies = None, 0, []
  for epoch in range(epochs):
    order = onp.visiting_order(
      jax.random.fold_in(ctx.derive_key(Purpose.LOCAL_TRAINING, epoch), 0), 0, len(ds.train_y)
    )
    params, buffers, _ = onp.mlp_local_sgd(
      params,
      ds.train_x,
      ds.train_y,
      [order],
      batch,
      cosine,
      MOMENTUM,
      buffers=buffers,
      first_step=step,
      epoch_accuracies=accuracies,
    )
    step += -(-len(ds.train_y) // batch)
    state = rec.states[epoch]
    # one model, not a stack of several of which the first is scored
    assert {leaf.shape[0] for leaf in jax.tree.leaves(state.model.params)} == {1}
    onp.assert_tree_close(engine.take(state.model.params, 0), params)
    (record,) = rec.records[epoch]
    assert record['epoch'] == epoch + 1
    assert record['train_accuracy'] == pytest.approx(accuracies[epoch], abs=1e-6)
  assert summary['epochs'] == epochs


@pytest.mark.parametrize('method', ['centralized', 'local'])
def test_a_non_positive_epoch_count_is_refused_naming_its_field(method):
  with pytest.raises(ConfigError, match=rf'^{method}\.epochs must be positive, got 0$'):
    build_algorithm(method, _config(3, **{f'{method}.epochs': 0}))


# ---------------------------------------------------------------------------------------------
# OT fusion
# ---------------------------------------------------------------------------------------------


def _stack(models: Sequence[Dict]) -> ModelState:
  return ModelState(jax.tree.map(lambda *a: np.stack(a).astype(np.float32), *models), {})


def _permute_hidden(params: Dict, perms: Sequence[np.ndarray]) -> Dict:
  """The same function with hidden layer l's units reordered by perms[l]."""
  p = onp.tree_map(np.copy, params)
  names = sorted(p)  # Dense_0 .. Dense_L
  for l, perm in enumerate(perms):
    p[names[l]]['kernel'] = p[names[l]]['kernel'][:, perm]
    p[names[l]]['bias'] = p[names[l]]['bias'][perm]
    p[names[l + 1]]['kernel'] = p[names[l + 1]]['kernel'][perm, :]
  return p


def test_ot_fuses_a_permuted_copy_to_the_aligned_average(scored):
  ctx_key = jax.random.PRNGKey(11)
  base = _init_params(NARROW, ctx_key)
  rng = np.random.default_rng(3)
  perms = [rng.permutation(10), rng.permutation(10)]
  # client 1: client 0's network with its hidden units permuted, plus a small change
  noise = onp.tree_map(lambda a: rng.normal(size=a.shape) * 1e-3, base)
  client1 = _permute_hidden(onp.tree_map(lambda a, n: a + n, base, noise), perms)
  config = _config(2, **{'ot.local_epochs': 1})
  summary, rec, _ = _run('ot', config, (23, 41), local_models=[_stack([base, client1])])
  # aligned to the anchor (client 0), client 1 is base + noise: the fused model is their mean
  want = onp.tree_map(lambda a, n: a + n / 2, base, noise)
  onp.assert_tree_close(rec.states[0].params, want)
  (record,) = rec.records[0]
  assert record['test_accuracy'] == pytest.approx(_test_accuracy(want), abs=1e-9)
  plain = onp.weighted_average([base, client1], [1, 1])
  assert record['plain_average_test_accuracy'] == pytest.approx(_test_accuracy(plain), abs=1e-9)
  _assert_scored(scored, [want, plain])
  _assert_full_test_split(summary)


def _brute_force_alignment(rows_i: np.ndarray, rows_r: np.ndarray, squared: bool) -> np.ndarray:
  """perm with row perm[b] of rows_i matched to row b of rows_r: the exact OT plan between two
  uniform measures of equal size is a permutation (Birkhoff), so the cheapest of all of them,
  under the plain Euclidean ground cost (otfusion's --not-squared)."""
  n = len(rows_r)
  dist = np.linalg.norm(rows_i[:, None, :] - rows_r[None, :, :], axis=-1)
  dist = dist**2 if squared else dist
  best = min(itertools.permutations(range(n)), key=lambda p: sum(dist[p[b], b] for b in range(n)))
  return np.asarray(best)


def _oracle_ot(
  models: Sequence[Dict],
  anchor: int,
  squared: bool = False,
  bias_in_cost: bool = True,
  weights: Sequence[float] = (),
  skip_last_layer: bool = True,
) -> Dict:
  """otfusion's weight mode (--exact, --correction, --skip-last-layer, bias in the cost), every
  model aligned to the anchor, then the average (uniform, or by `weights`): layer by layer,
  incoming weights first re-indexed by the previous layer's matching, then the rows (incoming
  weights, bias) matched to the anchor's by the exact OT plan; without --skip-last-layer the
  output layer's rows too (by scipy's assignment solver: 10! orders are too many to list)."""
  names = sorted(models[anchor])
  aligned = []
  for i, m in enumerate(models):
    if i == anchor:
      aligned.append(m)
      continue
    out, prev = {}, None
    for l, name in enumerate(names):
      w = m[name]['kernel'] if prev is None else m[name]['kernel'][prev, :]
      b = m[name]['bias']
      last = l == len(names) - 1
      if not last or not skip_last_layer:
        wr, br = models[anchor][name]['kernel'], models[anchor][name]['bias']
        feats_i = np.concatenate([w.T, b[:, None]], 1) if bias_in_cost else w.T
        feats_r = np.concatenate([wr.T, br[:, None]], 1) if bias_in_cost else wr.T
        if last:
          dist = np.linalg.norm(feats_i[:, None, :] - feats_r[None, :, :], axis=-1)
          rows, cols = linear_sum_assignment(dist**2 if squared else dist)
          prev = rows[np.argsort(cols)]
        else:
          prev = _brute_force_alignment(feats_i, feats_r, squared)
        w, b = w[:, prev], b[prev]
      out[name] = {'kernel': w, 'bias': b}
    aligned.append(out)
  return onp.weighted_average(aligned, list(weights) or np.ones(len(models)))


# hidden widths 5: 5! alignments for the oracle to search
TINY = 'mlp:width_mult=0.025'


def _unrelated_tiny_models() -> List[Dict]:
  """Three independently initialised TINY models, for which the plain Euclidean cost, its square
  and the cost without the biases pick different matchings."""
  return [_init_params(TINY, jax.random.PRNGKey(59 + k)) for k in range(3)]


@pytest.mark.parametrize('anchor', [0, 2])
def test_ot_fusion_of_unrelated_models_matches_the_oracle(anchor):
  models = _unrelated_tiny_models()
  config = _config(3, **{'ot.local_epochs': 1, 'ot.anchor': anchor, 'model': TINY})
  summary, rec, _ = _run('ot', config, local_models=[_stack(models)])
  want = _oracle_ot(models, anchor)
  onp.assert_tree_close(rec.states[0].params, want)
  assert rec.records[0][0]['test_accuracy'] == pytest.approx(_test_accuracy(want), abs=1e-9)
  # the generic case is not trivial: the models are not aligned as they come
  plain = onp.weighted_average(models, np.ones(3))
  assert not np.allclose(plain['Dense_0']['kernel'], want['Dense_0']['kernel'], atol=1e-3)
  for variant in ({'squared': True}, {'bias_in_cost': False}):
    other = _oracle_ot(models, anchor, **variant)
    assert not np.allclose(other['Dense_1']['kernel'], want['Dense_1']['kernel'], atol=1e-3)
  _assert_full_test_split(summary)


@pytest.mark.parametrize(
  'option, value',
  [('squared', True), ('bias_in_cost', False), ('weights', 'size'), ('skip_last_layer', False)],
)
def test_ot_options_match_the_oracle(option, value, scored):
  models = _unrelated_tiny_models()
  config = _config(3, **{'ot.local_epochs': 1, f'ot.{option}': value, 'model': TINY})
  summary, rec, _ = _run('ot', config, local_models=[_stack(models)])
  sizes = list(SIZES) if option == 'weights' else []
  variant = {} if option == 'weights' else {option: value}
  want = _oracle_ot(models, 0, weights=sizes, **variant)
  onp.assert_tree_close(rec.states[0].params, want)
  default = _oracle_ot(models, 0)  # the option changes the fused model
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(default)))
  (record,) = rec.records[0]
  assert record['round'] == 1
  assert record['test_accuracy'] == pytest.approx(_test_accuracy(want), abs=1e-9)
  plain = onp.weighted_average(models, sizes or np.ones(3))
  assert record['plain_average_test_accuracy'] == pytest.approx(_test_accuracy(plain), abs=1e-9)
  _assert_scored(scored, [want, plain])  # the plain average with the same weights


def test_ot_sinkhorn_runs_with_its_epsilon():
  # entropic plans: a small epsilon is near the exact plan's fusion, a large one far from it
  models = _unrelated_tiny_models()
  exact = _oracle_ot(models, 0)
  fused = {}
  for epsilon in (1e-3, 10.0):
    config = _config(
      3,
      **{'ot.local_epochs': 1, 'ot.method': 'sinkhorn', 'ot.epsilon': epsilon, 'model': TINY},
    )
    _, rec, _ = _run('ot', config, local_models=[_stack(models)])
    fused[epsilon] = rec.states[0].params
  gap = lambda p: max(
    float(np.abs(np.asarray(a) - b).max())
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(exact))
  )
  assert gap(fused[1e-3]) < 0.05 < gap(fused[10.0])


def test_ot_second_round_trains_every_client_from_the_fused_model_then_fuses_again():
  models = _unrelated_tiny_models()
  config = _config(3, **{'ot.local_epochs': 1, 'ot.rounds': 2, 'ot.anchor': 1, 'model': TINY})
  summary, rec, ctx = _run('ot', config, local_models=[_stack(models)])
  fused1 = _oracle_ot(models, 1)
  onp.assert_tree_close(rec.states[0].params, fused1)
  # round 2: every client one epoch of SGD from the round-1 fused model, a fresh optimiser
  key = ctx.derive_key(Purpose.LOCAL_TRAINING, 2)
  clients = []
  for k in range(3):
    x, y = _client_data(ctx, k)
    orders = onp.epoch_orders(key, k, len(y), 1)
    clients.append(onp.mlp_local_sgd(fused1, x, y, orders, BATCH, LR, MOMENTUM)[0])
  fused2 = _oracle_ot(clients, 1)
  onp.assert_tree_close(rec.states[1].params, fused2)
  (record,) = rec.records[1]
  assert record['round'] == 2
  assert record['test_accuracy'] == pytest.approx(_test_accuracy(fused2), abs=1e-9)
  plain = onp.weighted_average(clients, np.ones(3))
  assert record['plain_average_test_accuracy'] == pytest.approx(_test_accuracy(plain), abs=1e-9)
  # the fused model goes down to the 3 clients; each client's model comes up, in both rounds
  weights = sum(leaf.size for leaf in jax.tree.leaves(fused1))
  assert 4 * weights * 3 <= record['download_bytes'] <= (4 * weights + 512) * 3
  assert 'download_bytes' not in rec.records[0][0]
  assert summary['upload_bytes'] == 2 * rec.records[0][0]['upload_bytes']
  assert summary['round_test_accuracy'] == pytest.approx(
    [_test_accuracy(fused1), _test_accuracy(fused2)], abs=1e-9
  )
  assert summary['plain_average_test_accuracy'] == record['plain_average_test_accuracy']
  assert summary['fused_layers'] == ['Dense_0', 'Dense_1', 'Dense_2']
  # the clients' own models of the last round, each scored alone
  np.testing.assert_allclose(
    summary['client_test_accuracy'], [_test_accuracy(c) for c in clients], atol=1e-9
  )
  assert (summary['rounds'], summary['local_epochs'], summary['ot_method']) == (2, 1, 'exact')


@pytest.mark.parametrize(
  'key, value, message',
  [
    ('ot.rounds', 0, 'ot.rounds must be positive, got 0'),
    ('ot.local_epochs', 0, 'ot.local_epochs must be positive, got 0'),
    ('ot.epsilon', 0.0, 'ot.epsilon must be positive, got 0.0'),
    ('ot.method', 'greedy', "ot.method is 'greedy'; valid: exact, sinkhorn"),
    ('ot.weights', 'mass', "ot.weights is 'mass'; valid: uniform, size"),
    ('ot.anchor', 3, 'ot.anchor must be a client id in [0, 3), got 3'),
  ],
)
def test_a_bad_ot_setting_is_refused_naming_the_key_and_the_value(key, value, message):
  with pytest.raises(ConfigError, match='^' + re.escape(message) + '$'):
    build_algorithm('ot', _config(3, **{key: value}))
