"""Oracle tests of the FedTSA family: fedtsa, heterofl, fedproto, fedmd.

Each test runs the registered method through `jfed.driver.run` on a tiny deterministic problem
(slices of sklearn digits, 'mlp' models 5-20 units wide, 2-3 clients, batch 8) and compares what
it returns with an independent computation written in the test: forward passes, losses and
gradients in PyTorch (float64 autograd, `torch.optim.SGD` and `clip_grad_norm_` as the reference
code runs them), averages, prototypes, clusters and accuracies in NumPy (tests/oracle_numpy.py).

What the oracles take from jfed are inputs, not the computations under test: the initial
parameters (the run's `init`), the data and the partition, and the random draws: the order in
which local training visits a client's samples (`oracle_numpy.visiting_order`), FedMD's
alignment subset, FedTSA's Stage-2 images and the Stage-2 batch order.

References: FedTSA (Fan, Wu, Su, Hui, "FedTSA: A Cluster-based Two-Stage Aggregation Method for
Model-heterogeneous Federated Learning", ECCV'24, arXiv 2407.05098; no public code: §4.3 Eqs. 2-4,
§4.4 Eqs. 6-9); HeteroFL (Diao, Ding, Tarokh, ICLR'21, arXiv 2010.01264;
github.com/diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients
src/fed.py, src/modules/modules.py Scaler); FedProto (Tan et al., AAAI'22, arXiv 2105.00243;
github.com/yuetan031/FedProto lib/update.py update_weights_het, lib/utils.py agg_func and
proto_aggregation); FedMD (Li & Wang, arXiv 1910.03581; github.com/diogenes0319/FedMD_clean
FedMD.py).
"""

from typing import Callable, Dict, List, Optional, Sequence

import flax
import jax
import numpy as np
import pytest

from jfed import engine
from jfed.configs.base import base_config
from jfed.data import load_dataset
from jfed.data.batches import epoch_order
from jfed.data.datasets import Dataset
from jfed.distill.mutual import MutualLearner, MutualLearningConfig
from jfed.driver import build_algorithm, make_context, run
from jfed.keys import Purpose
from jfed.models import get_model
from tests import oracle_numpy as onp
from tests.support import override, record_training_labels

# The oracles mirror the PyTorch reference code in float64 PyTorch: skipped where it is absent
# (the README's install; CI installs it).
torch = pytest.importorskip('torch')

BATCH = 8
LR, MOMENTUM = 0.01, 0.9  # base_config()'s client optimiser: SGD with momentum
WIDE, NARROW = 'mlp:width_mult=0.1', 'mlp:width_mult=0.05'  # hidden widths 20 and 10


@pytest.fixture(autouse=True)
def _torch_float64():
  """The oracles compute in float64; other modules' torch tests keep torch's float32 default."""
  previous = torch.get_default_dtype()
  torch.set_default_dtype(torch.float64)
  yield
  torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------------------------
# the tiny problem
# ---------------------------------------------------------------------------------------------

_DIGITS = {}


def _digits():
  if not _DIGITS:
    _DIGITS['d'] = load_dataset('digits')
  return _DIGITS['d']


def _dataset(n_train: int = 96, n_test: int = 50, n_holdout: int = 0) -> Dataset:
  """n_train client images, n_holdout held-out training images (no client's), n_test test."""
  d = _digits()
  hold = slice(n_train, n_train + n_holdout)
  return Dataset(
    'digits',
    d.train_x[:n_train],
    d.train_y[:n_train],
    d.test_x[:n_test],
    d.test_y[:n_test],
    d.num_classes,
    holdout_x=d.train_x[hold] if n_holdout else None,
    holdout_y=d.train_y[hold] if n_holdout else None,
  )


def _parts(dataset: Dataset, sizes: Sequence[int], classes=None, seed: int = 7):
  """Disjoint client index sets of the given sizes; with `classes` (per client, or None), a
  client draws only images of those classes."""
  rng = np.random.default_rng(seed)
  free = np.ones(len(dataset.train_y), bool)
  parts = []
  for k, size in enumerate(sizes):
    ok = free.copy()
    if classes is not None and classes[k] is not None:
      ok &= np.isin(dataset.train_y, classes[k])
    idx = np.sort(rng.choice(np.flatnonzero(ok), size, replace=False))
    free[idx] = False
    parts.append(idx)
  return parts


def _config(num_clients: int, **overrides):
  c = base_config()
  c.dataset.name = 'digits'
  c.model = WIDE
  c.batch_size = BATCH
  c.eval_batch_size = 16
  c.partition.num_clients = num_clients
  return override(c, **overrides)


class _Recorder:
  """Keeps what the registered algorithm's setup and steps return while `run` drives it."""

  def __init__(self, algorithm):
    self.aux, self.before, self.after, self.records = None, [], [], []
    setup, step = algorithm.setup, algorithm.step

    def recording_setup(ctx):
      self.aux = setup(ctx)
      return self.aux

    def recording_step(ctx, aux, state, i):
      self.before.append(state)
      state, records = step(ctx, aux, state, i)
      self.after.append(state)
      self.records.append(records)
      return state, records

    algorithm.setup, algorithm.step = recording_setup, recording_step


def _run(method: str, config, dataset: Dataset, parts):
  algorithm = build_algorithm(method, config)
  recorder = _Recorder(algorithm)
  ctx = make_context(config, dataset, parts)
  summary = run(algorithm, ctx, progress=False)
  return summary, recorder, ctx


# ---------------------------------------------------------------------------------------------
# PyTorch: the MLP, its loss and torch.optim.SGD
# ---------------------------------------------------------------------------------------------


def _names(params) -> List[str]:
  return sorted(params, key=lambda k: int(k.split('_')[1]))


def _to_torch(params) -> Dict[str, Dict[str, torch.Tensor]]:
  return {
    n: {leaf: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for leaf, v in l.items()}
    for n, l in params.items()
  }


def _to_numpy(tparams) -> Dict:
  return {n: {leaf: v.detach().numpy().copy() for leaf, v in l.items()} for n, l in tparams.items()}


def torch_mlp(tparams, x, hidden_scale: float = 1.0):
  """(logits, penultimate features) of jfed's 'mlp' (flatten -> [Dense ReLU] x L -> Dense); every
  hidden Dense's output divided by `hidden_scale` before its ReLU (HeteroFL's Scaler)."""
  names = _names(tparams)
  h = torch.as_tensor(np.asarray(x, np.float64)).reshape(len(x), -1)
  for n in names[:-1]:
    h = torch.relu((h @ tparams[n]['kernel'] + tparams[n]['bias']) / hidden_scale)
  out = tparams[names[-1]]
  return h @ out['kernel'] + out['bias'], h


def torch_local_sgd(
  params,
  x,
  y,
  orders,
  loss_fn: Callable,
  batch: int = BATCH,
  lr: float = LR,
  momentum: float = MOMENTUM,
  grad_clip: float = 0.0,
  optimizer=None,
  tparams=None,
  on_batch: Optional[Callable] = None,
  epoch_losses: Optional[List[float]] = None,
):
  """Mini-batches in each epoch's visiting order (the last one partial), one torch.optim.SGD
  step on loss_fn(tparams, xb, yb) each; `on_batch(epoch, tparams, xb, yb)` runs before the
  step. Appends each epoch's mean loss over its samples (each batch's before its step) to
  `epoch_losses` when given. Returns (tparams, optimizer): pass them back to continue with the
  same optimiser."""
  tparams = tparams or _to_torch(params)
  leaves = [v for n in _names(tparams) for v in tparams[n].values()]
  optimizer = optimizer or torch.optim.SGD(leaves, lr=lr, momentum=momentum)
  x, y = np.asarray(x), np.asarray(y)
  for e, order in enumerate(orders):
    total = 0.0
    for start in range(0, len(order), batch):
      idx = order[start : start + batch]
      optimizer.zero_grad()
      if on_batch is not None:
        on_batch(e, tparams, x[idx], y[idx])
      loss = loss_fn(tparams, x[idx], y[idx])
      loss.backward()
      total += float(loss.detach()) * len(idx)
      if grad_clip:
        # torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6); optax by max_norm / norm:
        # the 1e-6 is far below the test's tolerance.
        torch.nn.utils.clip_grad_norm_(leaves, grad_clip)
      optimizer.step()
    if epoch_losses is not None:
      epoch_losses.append(total / len(order))
  return tparams, optimizer


def _msgpack_nbytes(tree) -> int:
  """The bytes of `tree` as jfed sends it: flax's msgpack of its state dict, every leaf a NumPy
  array (an int as a 0-d int64 array)."""
  tree = jax.tree.map(np.asarray, tree)
  return len(flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(tree)))


def _prototype_upload_nbytes(cid: int, size: int, classes: int, dim: int, counts) -> int:
  upload = {
    'client_id': cid,
    'num_samples': size,
    'prototypes': np.zeros((classes, dim), np.float32),
    'label_counts': np.asarray(counts, np.int32),
  }
  return _msgpack_nbytes(upload)


def _ce(logits, y):
  return torch.nn.functional.cross_entropy(logits, torch.as_tensor(np.asarray(y), dtype=torch.long))


def _mlp_logits(params, x) -> np.ndarray:
  return onp.mlp_forward(onp.to_numpy(params), x)


# ---------------------------------------------------------------------------------------------
# HeteroFL
# ---------------------------------------------------------------------------------------------


def _corner(params, shapes):
  """The sub-model of the first rows/columns of every leaf (HeteroFL's `distribute`)."""
  return {
    n: {
      leaf: np.asarray(v)[tuple(slice(0, s) for s in np.shape(shapes[n][leaf]))]
      for leaf, v in l.items()
    }
    for n, l in params.items()
  }


def _mlp_shapes(width: int):
  """Zero arrays shaped as the 'mlp' of two hidden layers of `width` on 8x8 digits."""
  shapes = {
    'Dense_0': {'kernel': (64, width), 'bias': (width,)},
    'Dense_1': {'kernel': (width, width), 'bias': (width,)},
    'Dense_2': {'kernel': (width, 10), 'bias': (10,)},
  }
  return {n: {leaf: np.zeros(s) for leaf, s in l.items()} for n, l in shapes.items()}


def _heterofl_round(glob, ds, parts, key, clients, rates, epochs, masked_ce=True, scaler=True):
  """One HeteroFL round from the global MLP `glob` (hidden 20-20): each of `clients` trains the
  leading corner of every layer at its rate (hidden width 20 · rate) for `epochs` epochs with SGD,
  gradients clipped at 1, the CE of its logits with the classes outside its label set set to 0
  (`masked_ce`; else plain CE) and every hidden Dense's output divided by its rate (`scaler`);
  every entry of the new global model is the mean over the clients whose corner holds it, an
  output column only over the clients whose label set holds the class (with or without
  `masked_ce`, as the reference's `combine`). Returns (new global, each client's last-epoch
  loss, each client's number of parameters)."""
  trained, label_sets, last_epoch_losses, num_params = [], [], [], []
  for k in clients:
    x, y = ds.train_x[parts[k]], ds.train_y[parts[k]]
    held = np.isin(np.arange(10), np.unique(y))
    label_sets.append(held)
    shapes = _mlp_shapes(round(20 * rates[k]))
    mask = torch.as_tensor(held if masked_ce else np.ones(10, bool))

    def loss(tp, xb, yb, r=rates[k] if scaler else 1.0, mask=mask):
      logits, _ = torch_mlp(tp, xb, hidden_scale=r)
      return _ce(logits.masked_fill(~mask, 0.0), yb)  # the reference's masked_fill(.., 0)

    epoch_losses = []
    tp, _ = torch_local_sgd(
      _corner(glob, shapes),
      x,
      y,
      onp.epoch_orders(key, k, len(y), epochs),
      loss,
      grad_clip=1.0,
      epoch_losses=epoch_losses,
    )
    trained.append(_to_numpy(tp))
    last_epoch_losses.append(epoch_losses[-1])
    num_params.append(sum(a.size for layer in shapes.values() for a in layer.values()))
  want = {}
  for n, layer in glob.items():
    want[n] = {}
    for leaf, g in layer.items():
      total, count = np.zeros_like(g), np.zeros_like(g)
      for t, held in zip(trained, label_sets):
        sub = t[n][leaf]
        ones = np.ones_like(sub)
        if n == 'Dense_2':  # the output layer: classes on the last axis
          ones = ones * held
        corner = tuple(slice(0, s) for s in sub.shape)
        total[corner] += sub * ones
        count[corner] += ones
      want[n][leaf] = np.where(count > 0, total / np.maximum(count, 1), g)
  return want, last_epoch_losses, num_params


def test_heterofl_one_round_slices_trains_with_the_scaler_and_averages_entries_over_holders():
  """Global MLP 20-20, clients at rates 1, 0.5, 0.5 (hidden 20 or 10): each client trains the
  leading corner of every layer with masked CE, the Scaler (hidden outputs / rate), gradient
  clipping at 1 and SGD; every entry of the new global model is the mean over the clients whose
  corner holds it, an output column only over the clients whose label set holds the class. Each
  rate's sub-model of the new global model is scored too."""
  ds = _dataset(n_train=96)
  classes = [None, [0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]]  # class 9: client 0 alone
  parts = _parts(ds, (21, 19, 14), classes)
  config = _config(
    3,
    client_models=f'{WIDE};{NARROW};{NARROW}',
    **{'heterofl.rounds': 1, 'heterofl.local_epochs': 2, 'heterofl.participation': 1.0},
  )
  summary, rec, ctx = _run('heterofl', config, ds, parts)
  glob = onp.to_numpy(rec.before[0].params)
  rates = {0: 1.0, 1: 0.5, 2: 0.5}
  want, last_epoch_losses, num_params = _heterofl_round(
    glob, ds, parts, ctx.derive_key(Purpose.ROUNDS, 0), range(3), rates, 2
  )
  onp.assert_tree_close(rec.after[0].params, want)
  acc = onp.accuracy(onp.mlp_forward(want, ds.test_x), ds.test_y)
  assert summary.final_test_accuracy == pytest.approx(acc, abs=1e-9)
  ((record,),) = rec.records
  assert (record['round'], record['clients']) == (1, 3)
  # the round's loss: each client's last epoch (masked CE, per sample), averaged over clients
  assert record['train_loss'] == pytest.approx(np.mean(last_epoch_losses), rel=1e-5)
  # every client uploads its float32 slice (no running statistics) and downloads one as large
  slices = [_corner(glob, _mlp_shapes(round(20 * rates[k]))) for k in range(3)]
  want_bytes = sum(
    _msgpack_nbytes(engine.ModelState(onp.tree_map(np.float32, p), {})) for p in slices
  )
  assert record['upload_bytes'] == want_bytes == record['download_bytes']
  assert 4 * sum(num_params) < want_bytes
  # each rate's sub-model of the new global model: its leading corner (no norm layer to
  # recalibrate), scored on the whole test split
  half = _corner(want, _mlp_shapes(10))
  assert half['Dense_1']['kernel'].shape == (10, 10)
  sub_acc = onp.accuracy(onp.mlp_forward(half, ds.test_x), ds.test_y)
  assert record['submodel_test_accuracy'] == pytest.approx({'1': acc, '0.5': sub_acc}, abs=1e-9)
  assert summary['submodel_test_accuracy'] == record['submodel_test_accuracy']
  assert summary['client_rates'] == [1.0, 0.5, 0.5] and summary['rounds'] == 1
  assert summary['client_models'] == [WIDE, NARROW, NARROW]
  assert summary['output_layer'] == 'Dense_2'
  empty = build_algorithm('heterofl', config).summarize(ctx, rec.aux, rec.after[0], [])
  assert empty['submodel_test_accuracy'] is None and empty['rounds'] == 1  # before any round


def test_heterofl_sampled_rounds_without_mask_or_scaler_chain_the_global_model(monkeypatch):
  """Four clients at rates 1, 0.5, 1, 0.5; half of them a round, drawn with the round's sampling
  key; plain CE and no Scaler (`masked_ce`/`scaler` off); the output columns still averaged
  over the clients holding the class. Round 2 starts from round 1's global model; a client that
  sits a round out changes nothing."""
  ds = _dataset(n_train=110)
  classes = [[0, 1, 2, 3, 4], None, [5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7]]
  parts = _parts(ds, (18, 22, 16, 20), classes)
  config = _config(
    4,
    client_models=f'{WIDE};{NARROW}',
    **{
      'heterofl.rounds': 2,
      'heterofl.local_epochs': 1,
      'heterofl.participation': 0.5,
      'heterofl.masked_ce': False,
      'heterofl.scaler': False,
      'heterofl.eval_submodels': False,
    },
  )
  labels = record_training_labels(monkeypatch)
  summary, rec, ctx = _run('heterofl', config, ds, parts)
  rates = {0: 1.0, 1: 0.5, 2: 1.0, 3: 0.5}
  glob = onp.to_numpy(rec.before[0].params)
  draws = []
  for r in range(2):
    clients = onp.sampled_clients(ctx.derive_key(Purpose.SAMPLING, r), 4, 0.5)
    draws.append(clients)
    glob, losses, _ = _heterofl_round(
      glob, ds, parts, ctx.derive_key(Purpose.ROUNDS, r), clients, rates, 1, False, False
    )
    onp.assert_tree_close(rec.after[r].params, glob)
    (record,) = rec.records[r]
    assert (record['round'], record['clients']) == (r + 1, 2)
    assert record['train_loss'] == pytest.approx(np.mean(losses), rel=1e-5)
    assert record['test_accuracy'] == pytest.approx(
      onp.accuracy(onp.mlp_forward(glob, ds.test_x), ds.test_y), abs=1e-9
    )
    assert 'submodel_test_accuracy' not in record
  assert draws[0] != draws[1]  # the seed gives two different draws: each round's key is read
  assert summary['submodel_test_accuracy'] is None
  assert labels == ['round 1/2'] * 2 + ['round 2/2'] * 2  # one call, two groups, a round


# ---------------------------------------------------------------------------------------------
# FedProto
# ---------------------------------------------------------------------------------------------


def _client_params(state, groups, cid: int, plain: bool = False):
  """Client `cid`'s parameters out of per-group stacked models (FedProto's `state.models`, or
  the tuple itself when `plain`)."""
  models = state if plain else state.models
  for g, m in zip(groups, models):
    hits = np.flatnonzero(np.asarray(g.client_ids) == cid)
    if len(hits):
      return onp.take_client(m.params, int(hits[0]))
  raise KeyError(cid)


def _prototype_pull_loss(protos, support, ld: float) -> Callable:
  """FedProto's local loss on the MLP: CE + ld · MSE(embedding, global prototype of its class),
  the MSE a mean over the batch's B·D elements, rows of classes without a prototype pulling
  nowhere (the reference's `loss_mse(proto_new, protos)`)."""

  def loss(tp, xb, yb):
    logits, f = torch_mlp(tp, xb)
    target = f.detach().clone()  # rows without a global prototype: no pull
    has = support[yb]
    target[torch.as_tensor(has)] = torch.as_tensor(protos[yb[has]])
    return _ce(logits, yb) + ld * torch.mean((target - f) ** 2)

  return loss


def _assert_fedproto_readings(summary, params, protos, support, holds, ds):
  """Inference: the classifier, or the nearest global prototype (smallest MSE); the reference's
  readings on a client's own classes: both restricted to the test images of those classes,
  the prototypes to those classes. Every client is scored, whether it took part or not."""
  acc, proto_acc, local_acc, local_proto_acc = [], [], [], []
  for k in range(len(params)):
    logits, f = torch_mlp(_to_torch(params[k]), ds.test_x)
    pred = np.argmax(logits.detach().numpy(), 1)
    dist = ((f.detach().numpy()[:, None, :] - protos[None]) ** 2).mean(-1)
    own = holds[k][ds.test_y]
    acc.append(np.mean(pred == ds.test_y))
    proto_acc.append(np.mean(np.argmin(np.where(support, dist, np.inf), 1) == ds.test_y))
    local_acc.append(np.mean(pred[own] == ds.test_y[own]))
    nearest_own = np.argmin(np.where(support & holds[k], dist[own], np.inf), 1)
    local_proto_acc.append(np.mean(nearest_own == ds.test_y[own]))
  assert summary.final_test_accuracy == pytest.approx(np.mean(acc), abs=1e-9)
  assert summary['proto_test_accuracy'] == pytest.approx(np.mean(proto_acc), abs=1e-9)
  assert summary['local_test_accuracy'] == pytest.approx(np.mean(local_acc), abs=1e-9)
  assert summary['local_proto_test_accuracy'] == pytest.approx(np.mean(local_proto_acc), abs=1e-9)
  assert summary['client_test_accuracy'] == pytest.approx(acc, abs=1e-9)


def test_fedproto_two_rounds_collect_last_epoch_prototypes_and_pull_embeddings_to_them():
  """Clients WIDE (20-20), NARROW (10 wide, its last hidden layer widened to 20: one prototype
  width), WIDE; classes 0-5, 3-9 and all. Round 1: CE only (no global prototypes yet); each
  client's prototypes are the class means of the embeddings of its last local epoch's batches,
  each computed before that batch's step; a global prototype is the unweighted mean over the
  clients holding the class. Round 2: CE + ld·MSE(embedding, global prototype of its class), the
  MSE a mean over the batch's B·D elements."""
  ds = _dataset(n_train=120)
  classes = [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9], None]
  parts = _parts(ds, (24, 16, 32), classes)
  epochs, ld = 2, 0.7
  config = _config(
    3,
    client_models=f'{WIDE};{NARROW}',
    **{
      'fedproto.rounds': 2,
      'fedproto.local_epochs': epochs,
      'fedproto.ld': ld,
      'fedproto.participation': 1.0,
    },
  )
  summary, rec, ctx = _run('fedproto', config, ds, parts)
  groups = rec.aux.groups
  assert rec.aux.dim == 20
  narrow = _client_params(rec.before[0], groups, 1)
  assert narrow['Dense_0']['kernel'].shape == (64, 10)  # its own width before the prototype layer
  assert narrow['Dense_1']['kernel'].shape == (10, 20)
  params = {k: _client_params(rec.before[0], groups, k) for k in range(3)}
  holds = np.stack([np.isin(np.arange(10), ds.train_y[p]) for p in parts])
  protos, support = np.zeros((10, 20)), np.zeros(10, bool)
  for r in range(2):
    key = ctx.derive_key(Purpose.ROUNDS, r)
    local, losses = {}, []
    for k in range(3):
      x, y = ds.train_x[parts[k]], ds.train_y[parts[k]]
      orders = onp.epoch_orders(key, k, len(y), epochs - 1)
      orders += onp.epoch_orders(jax.random.fold_in(key, epochs - 1), k, len(y), 1)
      sums, counts = np.zeros((10, 20)), np.zeros(10)

      def collect(e, tp, xb, yb, sums=sums, counts=counts):
        if e == epochs - 1:  # the reference resets agg_protos_label every epoch
          with torch.no_grad():
            _, f = torch_mlp(tp, xb)
          np.add.at(sums, yb, f.numpy())
          np.add.at(counts, yb, 1)

      loss = _prototype_pull_loss(protos.copy(), support.copy(), ld)
      epoch_losses = []
      tp, _ = torch_local_sgd(
        params[k], x, y, orders, loss, on_batch=collect, epoch_losses=epoch_losses
      )
      params[k] = _to_numpy(tp)
      local[k] = sums / np.maximum(counts, 1)[:, None]
      losses.append(epoch_losses[-1])
    support = holds.any(0)
    (record,) = rec.records[r]
    assert (record['round'], record['clients']) == (r + 1, 3)
    assert record['classes_with_prototype'] == int(support.sum()) == 10
    # the round's loss: each client's last epoch (CE + ld · MSE, per sample), over the clients
    assert record['train_loss'] == pytest.approx(np.mean(losses), rel=1e-5)
    # up: 3 clients' [C, D] float32 prototypes and class counts; down: the [C, D] global ones
    # and their support, to each
    assert record['upload_bytes'] == sum(
      _prototype_upload_nbytes(
        k, len(parts[k]), 10, 20, np.bincount(ds.train_y[parts[k]], None, 10)
      )
      for k in range(3)
    )
    down = {'prototypes': np.zeros((10, 20), np.float32), 'support': np.zeros(10, np.int32)}
    assert record['download_bytes'] == 3 * _msgpack_nbytes(down)
    protos = (
      sum(local[k] * holds[k][:, None] for k in range(3)) / np.maximum(holds.sum(0), 1)[:, None]
    )
    np.testing.assert_allclose(
      rec.after[r].protos.prototypes, protos, rtol=1e-4, atol=1e-5, err_msg=f'round {r + 1}'
    )
    # the global prototypes keep the initial state's dtypes (one program, one checkpoint layout)
    got, init = rec.after[r].protos, rec.before[0].protos
    assert (got.prototypes.dtype, got.support.dtype) == (init.prototypes.dtype, init.support.dtype)
  for k in range(3):
    onp.assert_tree_close(_client_params(rec.after[1], groups, k), params[k])
  _assert_fedproto_readings(summary, params, protos, support, holds, ds)
  assert (summary['rounds'], summary['embedding_dim']) == (2, 20)
  empty = build_algorithm('fedproto', config).summarize(ctx, rec.aux, rec.after[1], [])
  assert empty['client_test_accuracy'] is None and empty['proto_test_accuracy'] is None


def test_fedproto_sampled_clients_with_an_embedding_layer_and_prototypes_after_training(
  monkeypatch,
):
  """Clients WIDE, NARROW, WIDE, each with a 6-wide ReLU embedding layer before its classifier
  (`embed_dim`); two of them a round, drawn with the round's sampling key; one local epoch of
  CE + ld·MSE to the previous round's global prototypes; the local prototypes are the class
  means of the trained model's embeddings of all the client's images (`after_training`); the
  global ones are the mean over this round's uploaders holding the class. A client that sits
  a round out keeps its model and uploads nothing."""
  ds = _dataset(n_train=110)
  classes = [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9], [0, 1, 7, 8, 9]]
  parts = _parts(ds, (22, 18, 20), classes)  # 22: the class means' last chunk is padded
  ld = 0.5
  config = _config(
    3,
    client_models=f'{WIDE};{NARROW}',
    **{
      'fedproto.rounds': 2,
      'fedproto.local_epochs': 1,
      'fedproto.ld': ld,
      'fedproto.participation': 0.67,
      'fedproto.prototypes': 'after_training',
      'fedproto.embed_dim': 6,
    },
  )
  labels = record_training_labels(monkeypatch)
  summary, rec, ctx = _run('fedproto', config, ds, parts)
  groups = rec.aux.groups
  params = {k: _client_params(rec.before[0], groups, k) for k in range(3)}
  assert params[1]['Dense_1']['kernel'].shape == (10, 10)  # its own widths, then the embedding
  assert params[1]['Dense_2']['kernel'].shape == (10, 6)
  holds = np.stack([np.isin(np.arange(10), ds.train_y[p]) for p in parts])
  protos, support, draws = np.zeros((10, 6)), np.zeros(10, bool), []
  for r in range(2):
    clients = onp.sampled_clients(ctx.derive_key(Purpose.SAMPLING, r), 3, 0.67)
    draws.append(clients)
    key = ctx.derive_key(Purpose.ROUNDS, r)
    local, losses = {}, []
    for k in clients:
      x, y = ds.train_x[parts[k]], ds.train_y[parts[k]]

      loss = _prototype_pull_loss(protos.copy(), support.copy(), ld)
      epoch_losses = []
      tp, _ = torch_local_sgd(
        params[k], x, y, onp.epoch_orders(key, k, len(y), 1), loss, epoch_losses=epoch_losses
      )
      params[k] = _to_numpy(tp)
      with torch.no_grad():
        _, f = torch_mlp(tp, x)
      f = f.numpy()
      local[k] = np.stack([f[y == c].mean(0) if np.any(y == c) else np.zeros(6) for c in range(10)])
      losses.append(epoch_losses[-1])
    held = holds[clients]
    support = held.any(0)
    protos = (
      sum(local[k] * holds[k][:, None] for k in clients) / np.maximum(held.sum(0), 1)[:, None]
    )
    np.testing.assert_allclose(
      rec.after[r].protos.prototypes, protos, rtol=1e-4, atol=1e-5, err_msg=f'round {r + 1}'
    )
    np.testing.assert_array_equal(rec.after[r].protos.support, held.sum(0))
    for k in range(3):
      onp.assert_tree_close(_client_params(rec.after[r], groups, k), params[k])
    (record,) = rec.records[r]
    assert (record['round'], record['clients']) == (r + 1, 2)
    assert record['classes_with_prototype'] == int(support.sum())
    assert record['train_loss'] == pytest.approx(np.mean(losses), rel=1e-5)
    # up: 2 clients' [C, D] float32 prototypes and class counts; down: the global ones, to each
    assert record['upload_bytes'] == sum(
      _prototype_upload_nbytes(k, len(parts[k]), 10, 6, np.bincount(ds.train_y[parts[k]], None, 10))
      for k in clients
    )
    down = {'prototypes': np.zeros((10, 6), np.float32), 'support': np.zeros(10, np.int32)}
    assert record['download_bytes'] == 2 * _msgpack_nbytes(down)
  assert draws[0] != draws[1]  # each round's sampling key is read
  assert labels == ['round 1/2'] * 2 + ['round 2/2'] * 2
  _assert_fedproto_readings(summary, params, protos, support, holds, ds)
  assert (summary['rounds'], summary['embedding_dim']) == (2, 6)
  assert summary['client_models'] == [WIDE, NARROW, WIDE]


# ---------------------------------------------------------------------------------------------
# FedMD
# ---------------------------------------------------------------------------------------------


def _alignment(ctx, r: int, public_size: int, alignment_size: int) -> np.ndarray:
  """Round r's alignment subset of the public set: `alignment_size` of its indices drawn without
  replacement with the round's alignment key, sorted (the draw is an input of the oracle)."""
  key = ctx.derive_key(Purpose.ALIGNMENT, r)
  return np.sort(np.asarray(jax.random.choice(key, public_size, (alignment_size,), replace=False)))


def _adam(params, lr: float):
  """A fresh torch.optim.Adam (betas 0.9/0.999, eps 1e-8) over `params`: (tparams, optimizer)
  for `torch_local_sgd`."""
  tparams = _to_torch(params)
  leaves = [v for n in _names(tparams) for v in tparams[n].values()]
  return tparams, torch.optim.Adam(leaves, lr=lr)


def test_fedmd_transfer_learning_then_a_round_of_consensus_digest_and_revisit(monkeypatch):
  """Clients WIDE, NARROW, WIDE; a labelled public set of 40 held-out training images. Transfer
  learning: each architecture trains on the public set, then each client on its private data.
  Round 1: the consensus is the mean of all clients' logits on the alignment subset; every
  client regresses its logits onto it with the L1 loss (Keras mean_absolute_error), then
  revisits its private data with CE; each stage a fresh SGD (the clients' optimiser)."""
  ds = _dataset(n_train=100, n_holdout=40)
  parts = _parts(ds, (26, 19, 33))
  config = _config(
    3,
    client_models=f'{WIDE};{NARROW}',
    **{
      'dataset.holdout_size': 40,
      'fedmd.rounds': 1,
      'fedmd.public': 'holdout',
      'fedmd.public_size': 40,
      'fedmd.public_epochs': 1,
      'fedmd.public_batch': BATCH,
      'fedmd.private_epochs': 1,
      'fedmd.private_batch': BATCH,
      'fedmd.alignment_size': 24,
      'fedmd.digest_epochs': 1,
      'fedmd.digest_batch': BATCH,
      'fedmd.revisit_epochs': 1,
      'fedmd.revisit_batch': BATCH,
    },
  )
  labels = record_training_labels(monkeypatch)
  summary, rec, ctx = _run('fedmd', config, ds, parts)
  specs = [WIDE, NARROW]
  spec_of = {0: WIDE, 1: NARROW, 2: WIDE}

  def ce_loss(tp, xb, yb):
    return _ce(torch_mlp(tp, xb)[0], yb)

  # Transfer learning: once per architecture on the public set, then per client.
  public_key = ctx.derive_key(Purpose.PUBLIC_TRAINING)
  pretrained = {}
  for idx, spec in enumerate(specs):
    module = get_model('mlp', 10, ds.input_shape, width_mult=0.1 if spec == WIDE else 0.05)
    init = engine.init_model(module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, idx))
    tp, _ = torch_local_sgd(
      onp.to_numpy(init.params),
      ds.holdout_x,
      ds.holdout_y,
      onp.epoch_orders(public_key, idx, 40, 1),
      ce_loss,
    )
    pretrained[spec] = _to_numpy(tp)
  private_key = ctx.derive_key(Purpose.LOCAL_TRAINING)
  params = {}
  for k in range(3):
    x, y = ds.train_x[parts[k]], ds.train_y[parts[k]]
    tp, _ = torch_local_sgd(
      pretrained[spec_of[k]], x, y, onp.epoch_orders(private_key, k, len(y), 1), ce_loss
    )
    params[k] = _to_numpy(tp)
  transfer_acc = [onp.accuracy(_mlp_logits(params[k], ds.test_x), ds.test_y) for k in range(3)]
  np.testing.assert_allclose(rec.aux.transfer_accuracy, transfer_acc, atol=1e-9)
  for k in range(3):
    onp.assert_tree_close(_client_params(rec.before[0], rec.aux.groups, k, plain=True), params[k])

  # Round 1.
  align = _alignment(ctx, 0, 40, 24)
  align_x = ds.holdout_x[align]
  consensus = np.mean([_mlp_logits(params[k], align_x) for k in range(3)], axis=0)
  digest_key, revisit_key = ctx.derive_key(Purpose.DIGEST, 0), ctx.derive_key(Purpose.ROUNDS, 0)
  digest_loss, revisit_loss = [], []  # one epoch each per client
  for k in range(3):
    index = np.arange(len(align))  # the digest's samples are the alignment images

    def l1(tp, xb, yb):
      return torch.mean(torch.abs(torch_mlp(tp, align_x[xb])[0] - torch.as_tensor(consensus[yb])))

    tp, _ = torch_local_sgd(
      params[k],
      index,
      index,
      onp.epoch_orders(digest_key, k, len(index), 1),
      l1,
      epoch_losses=digest_loss,
    )
    x, y = ds.train_x[parts[k]], ds.train_y[parts[k]]
    tp, _ = torch_local_sgd(
      _to_numpy(tp),
      x,
      y,
      onp.epoch_orders(revisit_key, k, len(y), 1),
      ce_loss,
      epoch_losses=revisit_loss,
    )
    params[k] = _to_numpy(tp)
    onp.assert_tree_close(_client_params(rec.after[0], rec.aux.groups, k, plain=True), params[k])
  acc = [onp.accuracy(_mlp_logits(params[k], ds.test_x), ds.test_y) for k in range(3)]
  assert summary.final_test_accuracy == pytest.approx(np.mean(acc), abs=1e-9)
  assert summary['eval_samples'] == len(ds.test_y)  # the whole test split, never a public set
  assert summary['client_test_accuracy'] == pytest.approx(acc, abs=1e-9)
  assert summary['transfer_test_accuracy'] == pytest.approx(np.mean(transfer_acc), abs=1e-9)
  assert (summary['rounds'], summary['public']) == (1, 'holdout')
  ((record,),) = rec.records
  assert (record['round'], record['clients']) == (1, 3)
  assert record['test_accuracy'] == pytest.approx(np.mean(acc), abs=1e-9)
  # each client's epoch losses: the L1 digest and the CE revisit, averaged over the clients
  assert record['digest_loss'] == pytest.approx(np.mean(digest_loss), rel=1e-5)
  assert record['train_loss'] == pytest.approx(np.mean(revisit_loss), rel=1e-5)
  # up: each client's [24, 10] float32 logits; down: the consensus, to every client
  logits = np.zeros((24, 10), np.float32)
  assert record['upload_bytes'] == sum(
    _msgpack_nbytes({'client_id': k, 'logits': logits}) for k in range(3)
  )
  assert record['download_bytes'] == 3 * _msgpack_nbytes(logits)
  (setup,) = build_algorithm('fedmd', config).setup_records(ctx, rec.aux)
  assert setup['stage'] == 'transfer learning'
  assert setup['transfer_client_test_accuracy'] == pytest.approx(transfer_acc, abs=1e-9)
  assert setup['transfer_test_accuracy'] == pytest.approx(np.mean(transfer_acc), abs=1e-9)
  empty = build_algorithm('fedmd', config).summarize(ctx, rec.aux, rec.after[0], [])
  assert empty['client_test_accuracy'] is None and empty['public'] == 'holdout'
  public, private = 'transfer learning: public data', 'transfer learning: private data'
  assert labels == [public, private] * 2 + ['round 1/1 digest', 'round 1/1 revisit'] * 2


def test_fedmd_two_rounds_with_adam_and_no_public_pretraining_or_revisit(monkeypatch):
  """The reference's optimiser (`optimizer='adam'`: a fresh Adam at `lr` in every stage); no
  public-set training (each architecture's init goes straight to its clients' private data);
  two rounds, each with its own alignment subset of a public set of 30 of the 36 held-out
  images (the run's seeded draw), of consensus and two digest epochs and no
  revisit (the round reports no training loss). Digest batches of 5: with an even batch the L1
  gradient of an output bias can be an exact tie of signs, zero in float64 but float32 rounding
  noise in jfed, which Adam's normalised step turns into a visible update (measured: 2e-3)."""
  ds = _dataset(n_train=90, n_holdout=36)
  parts = _parts(ds, (30, 22, 26))
  lr = 0.01
  config = _config(
    3,
    client_models=f'{WIDE};{NARROW}',
    **{
      'dataset.holdout_size': 36,
      'fedmd.rounds': 2,
      'fedmd.public': 'holdout',
      'fedmd.public_size': 30,
      'fedmd.public_epochs': 0,
      'fedmd.private_epochs': 1,
      'fedmd.private_batch': BATCH,
      'fedmd.alignment_size': 15,
      'fedmd.digest_epochs': 2,
      'fedmd.digest_batch': 5,
      'fedmd.revisit_epochs': 0,
      'fedmd.optimizer': 'adam',
      'fedmd.lr': lr,
    },
  )
  labels = record_training_labels(monkeypatch)
  summary, rec, ctx = _run('fedmd', config, ds, parts)

  def ce_loss(tp, xb, yb):
    return _ce(torch_mlp(tp, xb)[0], yb)

  # the public set: 30 of the 36 held-out images, drawn with the run's seed (an input)
  public = np.sort(np.random.default_rng(config.seed).choice(36, 30, replace=False))
  public_x = ds.holdout_x[public]
  private_key = ctx.derive_key(Purpose.LOCAL_TRAINING)
  params = {}
  for k, spec in enumerate((WIDE, NARROW, WIDE)):
    module = get_model('mlp', 10, ds.input_shape, width_mult=0.1 if spec == WIDE else 0.05)
    init = engine.init_model(
      module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, int(spec == NARROW))
    )
    x, y = ds.train_x[parts[k]], ds.train_y[parts[k]]
    tparams, adam = _adam(onp.to_numpy(init.params), lr)
    tp, _ = torch_local_sgd(
      None,
      x,
      y,
      onp.epoch_orders(private_key, k, len(y), 1),
      ce_loss,
      tparams=tparams,
      optimizer=adam,
    )
    params[k] = _to_numpy(tp)
    onp.assert_tree_close(_client_params(rec.before[0], rec.aux.groups, k, plain=True), params[k])
  aligns = []
  for r in range(2):
    align = _alignment(ctx, r, 30, 15)
    aligns.append(align)
    align_x = public_x[align]
    consensus = np.mean([_mlp_logits(params[k], align_x) for k in range(3)], axis=0)
    digest_key = ctx.derive_key(Purpose.DIGEST, r)
    digest_loss = []
    for k in range(3):
      index = np.arange(len(align))

      def l1(tp, xb, yb, align_x=align_x, consensus=consensus):
        logits = torch_mlp(tp, align_x[xb])[0]
        return torch.mean(torch.abs(logits - torch.as_tensor(consensus[yb])))

      epoch_losses = []
      tparams, adam = _adam(params[k], lr)
      tp, _ = torch_local_sgd(
        None,
        index,
        index,
        onp.epoch_orders(digest_key, k, len(index), 2),
        l1,
        batch=5,
        tparams=tparams,
        optimizer=adam,
        epoch_losses=epoch_losses,
      )
      params[k] = _to_numpy(tp)
      digest_loss.append(epoch_losses[-1])
      onp.assert_tree_close(_client_params(rec.after[r], rec.aux.groups, k, plain=True), params[k])
    (record,) = rec.records[r]
    acc = [onp.accuracy(_mlp_logits(params[k], ds.test_x), ds.test_y) for k in range(3)]
    assert (record['round'], record['clients']) == (r + 1, 3)
    assert record['client_test_accuracy'] == pytest.approx(acc, abs=1e-9)
    assert record['digest_loss'] == pytest.approx(np.mean(digest_loss), rel=1e-5)
    assert 'train_loss' not in record
    logits = np.zeros((15, 10), np.float32)
    assert record['upload_bytes'] == sum(
      _msgpack_nbytes({'client_id': k, 'logits': logits}) for k in range(3)
    )
    assert record['download_bytes'] == 3 * _msgpack_nbytes(logits)
  assert not np.array_equal(aligns[0], aligns[1])  # each round's alignment key is read
  private = 'transfer learning: private data'
  assert labels == [private] * 2 + ['round 1/2 digest'] * 2 + ['round 2/2 digest'] * 2
  assert summary.final_test_accuracy == pytest.approx(np.mean(acc), abs=1e-9)
  assert summary['client_test_accuracy'] == pytest.approx(acc, abs=1e-9)  # the last round's
  assert summary['client_models'] == [WIDE, NARROW, WIDE]


# ---------------------------------------------------------------------------------------------
# FedTSA
# ---------------------------------------------------------------------------------------------

DURATIONS = [1.25, 1.0, 1.7, 1.02, 1.66, 1.27]  # three device classes, interleaved over clients


def _kde_clusters(durations, factor=0.1, floor=0.05, grid_size=2048, quantum=0.1):
  """§4.3: a Gaussian KDE (Eq. 4) of the log durations with bandwidth factor × sample std (at
  least `floor`); its local minima between the fastest and slowest client split the clients;
  cluster k's rate is the fastest cluster's mean duration over its own (to `quantum`)."""
  d = np.asarray(durations, np.float64)
  x = np.log(d)
  h = max(factor * np.std(x, ddof=1), floor)
  grid = np.linspace(x.min() - 3 * h, x.max() + 3 * h, grid_size)
  density = np.exp(-0.5 * ((grid[:, None] - x[None]) / h) ** 2).sum(1)
  cuts = [
    grid[i]
    for i in range(1, grid_size - 1)
    if density[i] < density[i - 1] and density[i] <= density[i + 1] and x.min() < grid[i] < x.max()
  ]
  cluster = np.searchsorted(np.asarray(cuts), x)
  means = np.array([d[cluster == c].mean() for c in range(len(cuts) + 1)])
  rates = np.round(np.round(means.min() / means / quantum) * quantum, 10)
  return cluster, rates


def test_fedtsa_clusters_averages_in_cluster_and_learns_mutually_from_the_mean_logits(tmp_path):
  """Six clients whose proxy durations come in three classes, interleaved over the client ids:
  the KDE puts {1, 3}, {0, 5}, {2, 4} together at rates 1.0, 0.8, 0.6, and each cluster trains
  the MLP at its width. One round: Stage 1 is FedAvg weighted by client size inside each
  cluster; Stage 2 is one epoch of deep mutual learning on the Stage-2 images, where per batch
  the consensus is the mean of ALL cluster models' logits (Eq. 7, computed before any model
  steps) and each model takes one SGD step on α·KL(softmax(z̄/T) ‖ softmax(z/T)) + (1 − α)·CE
  (Eqs. 8-9, α = 0.5, T = 5). The reported model is the rate-1.0 cluster's."""
  path = tmp_path / 'durations.json'
  path.write_text(str(DURATIONS))
  cluster, rates = _kde_clusters(DURATIONS)
  np.testing.assert_array_equal(cluster, [1, 0, 2, 0, 2, 1])  # the hand-derived grouping
  np.testing.assert_allclose(rates, [1.0, 0.8, 0.6])

  ds = _dataset(n_train=100, n_holdout=60)
  sizes = (13, 9, 17, 11, 8, 14)
  parts = _parts(ds, sizes)
  T, alpha, lr2 = 5.0, 0.5, 0.05
  config = _config(
    6,
    **{
      'dataset.holdout_size': 60,
      'fedtsa.rounds': 1,
      'fedtsa.local_epochs': 1,
      'fedtsa.participation': 1.0,
      'fedtsa.profile': 'file',
      'fedtsa.durations_file': str(path),
      'fedtsa.source': 'public',
      'fedtsa.holdout': 'holdout',
      'fedtsa.holdout_size': 60,
      'fedtsa.images_per_prompt': 3,
      'fedtsa.stage2_batch': BATCH,
      'fedtsa.temperature': T,
      'fedtsa.kl_weight': alpha,
      'fedtsa.stage2_lr': lr2,
    },
  )
  summary, rec, ctx = _run('fedtsa', config, ds, parts)
  aux = rec.aux
  np.testing.assert_array_equal(aux.clusters.assignments, cluster)
  np.testing.assert_allclose(aux.clusters.rates, rates)
  assert [g.client_ids.tolist() for g in aux.groups] == [[1, 3], [0, 5], [2, 4]]
  widths = [onp.to_numpy(m.params)['Dense_0']['kernel'].shape[1] for m in rec.before[0]]
  assert widths == [20, 16, 12]  # ⌈rate · 20⌉

  # Stage 1: in-cluster FedAvg of the members' local epochs.
  stage1 = []
  for k, g in enumerate(aux.groups):
    key = ctx.derive_key(Purpose.ROUNDS, 0, k)
    start = onp.to_numpy(rec.before[0][k].params)
    trained, weights = [], []
    for cid in g.client_ids:
      x, y = ds.train_x[parts[cid]], ds.train_y[parts[cid]]
      tp, _ = torch_local_sgd(
        start,
        x,
        y,
        onp.epoch_orders(key, cid, len(y), 1),
        lambda tp, xb, yb: _ce(torch_mlp(tp, xb)[0], yb),
      )
      trained.append(_to_numpy(tp))
      weights.append(len(y))
    stage1.append(onp.weighted_average(trained, weights))
  stage1_acc = [onp.accuracy(onp.mlp_forward(p, ds.test_x), ds.test_y) for p in stage1]
  np.testing.assert_allclose(rec.records[0][0]['stage1_cluster_test_accuracy'], stage1_acc)

  # Stage 2: deep mutual learning on the Stage-2 images (an input: real held-out images).
  images, labels = np.asarray(aux.images.images), np.asarray(aux.images.labels)
  np.testing.assert_array_equal(labels, np.repeat(np.arange(10), 3))
  key = ctx.derive_key(Purpose.SERVER, 1, 0)
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).astype(np.uint32))
  batches, mask = epoch_order(len(labels), BATCH, rng)  # the batch order: an input
  models = [_to_torch(p) for p in stage1]
  optims = [
    torch.optim.SGD([v for n in _names(m) for v in m[n].values()], lr=lr2, momentum=MOMENTUM)
    for m in models
  ]
  for b in range(len(batches)):
    idx = batches[b][mask[b]]
    xb, yb = images[idx], labels[idx]
    with torch.no_grad():
      consensus = torch.stack([torch_mlp(m, xb)[0] for m in models]).mean(0)
    p = torch.softmax(consensus / T, -1)
    for m, opt in zip(models, optims):
      opt.zero_grad()
      z = torch_mlp(m, xb)[0]
      kl = torch.sum(p * (torch.log(p) - torch.log_softmax(z / T, -1)), -1).mean()
      (alpha * kl + (1 - alpha) * _ce(z, yb)).backward()
      opt.step()
  final = [_to_numpy(m) for m in models]
  for k in range(3):
    onp.assert_tree_close(rec.after[0][k].params, final[k])
  acc = [onp.accuracy(onp.mlp_forward(p, ds.test_x), ds.test_y) for p in final]
  record = rec.records[0][0]
  np.testing.assert_allclose(record['cluster_test_accuracy'], acc)
  assert summary.final_test_accuracy == pytest.approx(acc[0], abs=1e-9)  # the rate-1.0 model
  members = np.array([len(g.client_ids) for g in aux.groups])
  assert record['client_weighted_test_accuracy'] == pytest.approx(
    float(np.dot(acc, members) / members.sum()), abs=1e-9
  )
  assert summary['eval_samples'] == len(ds.test_y)


def test_stage2_keeps_the_running_statistics_unless_asked_to_recalibrate():
  """The paper says nothing of BatchNorm in Stage 2: by default its train-mode steps change the
  parameters only; 'recalibrate' keeps each step's running-average update on the images."""
  shape = (8, 8, 1)
  modules = [get_model('cnn_mnist', 10, shape, channels=(c, 4)) for c in (2, 3)]
  models = [engine.init_model(m, shape, jax.random.PRNGKey(i)) for i, m in enumerate(modules)]
  x = np.random.default_rng(0).uniform(size=(16, *shape)).astype(np.float32)
  y = np.zeros(16, np.int32)
  tx = engine.make_optimizer('sgd', 0.1)
  for keep in (True, False):
    learner = MutualLearner(modules, tx, MutualLearningConfig(keep_running_stats=keep))
    states, _ = learner.epoch(learner.init(models), x, y, 8, np.random.default_rng(0))
    for before, after in zip(models, states):
      same = [
        np.array_equal(a, b)
        for a, b in zip(
          jax.tree.leaves(before.batch_stats), jax.tree.leaves(after.model.batch_stats)
        )
      ]
      assert all(same) if keep else not any(same)
      assert not np.allclose(
        before.params['Dense_0']['kernel'], after.model.params['Dense_0']['kernel']
      )
  assert base_config().fedtsa.stage2_bn_stats == 'keep'
  assert base_config().fedtsa.reported_model == 'widest'
  assert base_config().fedmd.optimizer == 'client'
  assert base_config().heterofl.scaler
  assert base_config().fedproto.prototypes == 'last_epoch'
  assert base_config().fedproto.embed_dim == 0


def test_recomputed_bn_statistics_are_each_clusters_static_bn_on_its_members_images(tmp_path):
  """`fedtsa.bn_stats='recomputed'`: after Stage 1 each cluster model's running statistics are
  the mean over batches of the clients' batch size of every BN layer's input statistics, on the
  images of that cluster's members only (the layers' sown statistics: an input), not the
  average of the members' running statistics; Stage 2 keeps them by default."""
  import flax  # pylint: disable=g-import-not-at-top

  path = tmp_path / 'durations.json'
  path.write_text(str([1.0, 1.7, 1.02, 1.66]))  # two device classes: two clusters of two
  ds = _dataset(n_train=100, n_holdout=60)
  parts = _parts(ds, (13, 9, 17, 11))
  overrides = {
    'model': 'resnet18:width_mult=0.0625',
    'dataset.holdout_size': 60,
    'fedtsa.holdout_size': 60,
    'fedtsa.rounds': 1,
    'fedtsa.local_epochs': 1,
    'fedtsa.profile': 'file',
    'fedtsa.durations_file': str(path),
    'fedtsa.stage2': False,
  }
  runs = {
    bn: _run('fedtsa', _config(4, **overrides, **{'fedtsa.bn_stats': bn}), ds, parts)
    for bn in ('averaged', 'recomputed')
  }
  _, averaged, _ = runs['averaged']
  _, rec, _ = runs['recomputed']
  assert [g.client_ids.tolist() for g in rec.aux.groups] == [[0, 2], [1, 3]]
  for k, g in enumerate(rec.aux.groups):
    model = rec.after[0][k]
    onp.assert_tree_close(model.params, averaged.after[0][k].params)  # the weights are the same
    x = np.concatenate([ds.train_x[parts[cid]] for cid in g.client_ids])
    apply = jax.jit(
      lambda v, xb, m=g.module: m.apply(v, xb, train=True, mutable=['bn_inputs', 'batch_stats'])
    )
    sown = [
      flax.traverse_util.flatten_dict(apply(model.variables(), x[s : s + BATCH])[1]['bn_inputs'])
      for s in range(0, len(x), BATCH)
    ]
    got = flax.traverse_util.flatten_dict(model.batch_stats)
    was = flax.traverse_util.flatten_dict(averaged.after[0][k].batch_stats)
    assert len(sown[0]) * 2 == len(got)
    for layer in sown[0]:  # (..., 'BatchNorm_i', 'stats') -> (..., 'BatchNorm_i', 'bn', 'mean')
      for j, stat in enumerate(('mean', 'var')):
        want = np.mean([np.asarray(s[layer][0][j]) for s in sown], axis=0)
        where = (*layer[:-1], 'bn', stat)
        np.testing.assert_allclose(got[where], want, rtol=1e-4, atol=1e-5, err_msg=str(where))
        assert not np.allclose(was[where], want, rtol=1e-4, atol=1e-5)
