"""Independent NumPy computations for the oracle tests (tests/test_oracle_*.py).

Nothing here calls jfed's models, losses, optimisers or aggregation: the oracle tests compare
jfed's results with these re-implementations written from the papers' equations and PyTorch's
documented semantics. Everything computes in float64 (jfed computes in float32, so compare with
a float32 tolerance).

Parameter trees use Flax's naming, as jfed's models create them (jfed/models/cnn.py):

  mlp           {'Dense_0': {'kernel': [in, h0], 'bias': [h0]}, 'Dense_1': ..., 'Dense_L': ...}:
                flatten (HWC order) -> [Dense ReLU] x L -> Dense; the last Dense gives the logits.
  fedmho_cnn    {'Conv_0', 'Conv_1': {'kernel': [kh, kw, in, out], 'bias'}, 'Dense_0'}:
                [Conv5x5 MaxPool2 ReLU] x 2 -> flatten -> Dense.
  cnn_mnist     {'Conv_i', 'BatchNorm_i': {'bn': {'scale', 'bias'}}, 'Dense_0'} with
                batch_stats {'BatchNorm_i': {'bn': {'mean', 'var'}}}:
                [Conv5x5(pad 2) BN ReLU MaxPool2] x 2 -> flatten -> Dense (eval-mode BN).

Images are NHWC; a flatten is the row-major reshape of [B, H, W, C] (channel fastest), as flax's.

Contents: forward passes (`mlp_forward`, `fedmho_cnn_forward`, `cnn_mnist_forward` and their
layers), `mlp_loss_and_grads` (hand-written backprop), the losses (`softmax`, `log_softmax`,
`cross_entropy`, `kl_div`), `sgd_momentum_step` (torch.optim.SGD), `mlp_local_sgd` (a client's
local epochs), `weighted_average` and `visiting_order` (the data order jfed draws: an input).

Other families' helpers may append functions here; do not change the existing ones.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

BN_EPSILON = 1e-5  # PyTorch's BatchNorm2d eps, which jfed's BatchNorm uses


# ---------------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------------


def to_numpy(tree: Any) -> Any:
  """A nested dict of arrays (a Flax params tree, jax arrays or not) as float64 NumPy arrays."""
  if isinstance(tree, dict) or hasattr(tree, 'items'):
    return {k: to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)


def tree_map(fn, *trees: Any) -> Any:
  """fn over the leaves of nested dicts of the same structure."""
  first = trees[0]
  if isinstance(first, dict):
    return {k: tree_map(fn, *(t[k] for t in trees)) for k in first}
  return fn(*trees)


def tree_leaves(tree: Any) -> List[np.ndarray]:
  """The leaves in sorted-key order (the order of jax.tree.leaves for dicts)."""
  if isinstance(tree, dict):
    return [leaf for k in sorted(tree) for leaf in tree_leaves(tree[k])]
  return [tree]


def take_client(stacked: Any, k: int) -> Any:
  """Client k's tree of a tree stacked along a leading client axis."""
  return tree_map(lambda a: np.asarray(a, np.float64)[k], stacked)


def weighted_average(trees: Sequence[Any], weights: Sequence[float]) -> Any:
  """Σ_k w_k θ_k / Σ_k w_k, leaf by leaf (FedAvg's aggregate with w_k = n_k)."""
  w = np.asarray(weights, np.float64)
  w = w / w.sum()
  return tree_map(
    lambda *leaves: sum(wk * np.asarray(l, np.float64) for wk, l in zip(w, leaves)), *trees
  )


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------


def relu(x: np.ndarray) -> np.ndarray:
  return np.maximum(x, 0.0)


def flatten(x: np.ndarray) -> np.ndarray:
  return np.asarray(x, np.float64).reshape(len(x), -1)


def dense(x: np.ndarray, layer: Dict[str, np.ndarray]) -> np.ndarray:
  """x @ kernel + bias (kernel [in, out], the transpose of torch.nn.Linear's weight)."""
  out = np.asarray(x, np.float64) @ np.asarray(layer['kernel'], np.float64)
  return out + np.asarray(layer['bias'], np.float64) if 'bias' in layer else out


def conv2d(x: np.ndarray, layer: Dict[str, np.ndarray], padding: int = 0) -> np.ndarray:
  """Stride-1 cross-correlation of NHWC x with an HWIO kernel, zero padding p on every side
  (torch.nn.Conv2d(padding=p) with the kernel's axes moved)."""
  k = np.asarray(layer['kernel'], np.float64)
  kh, kw = k.shape[:2]
  x = np.pad(np.asarray(x, np.float64), ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  out_h, out_w = x.shape[1] - kh + 1, x.shape[2] - kw + 1
  out = np.zeros((x.shape[0], out_h, out_w, k.shape[3]))
  for i in range(kh):
    for j in range(kw):
      out += x[:, i : i + out_h, j : j + out_w, :] @ k[i, j]
  return out + np.asarray(layer['bias'], np.float64) if 'bias' in layer else out


def pool2(x: np.ndarray, kind: str = 'max') -> np.ndarray:
  """2x2 stride-2 floor-mode pooling (torch MaxPool2d(2) / AvgPool2d(2)); skipped on a map
  smaller than 2x2 (jfed's rule for 8x8 inputs)."""
  b, h, w, c = x.shape
  if min(h, w) < 2:
    return x
  h2, w2 = h // 2, w // 2
  blocks = x[:, : 2 * h2, : 2 * w2, :].reshape(b, h2, 2, w2, 2, c)
  return blocks.max(axis=(2, 4)) if kind == 'max' else blocks.mean(axis=(2, 4))


def batchnorm_eval(x: np.ndarray, scale, bias, mean, var, eps: float = BN_EPSILON) -> np.ndarray:
  """Eval-mode BatchNorm over the last (channel) axis with running statistics."""
  return (x - mean) / np.sqrt(np.asarray(var, np.float64) + eps) * scale + bias


# ---------------------------------------------------------------------------------------------
# models (eval mode)
# ---------------------------------------------------------------------------------------------


def _dense_names(params: Dict[str, Any]) -> List[str]:
  return sorted((k for k in params if k.startswith('Dense_')), key=lambda k: int(k.split('_')[1]))


def mlp_forward(params: Dict[str, Any], x: np.ndarray) -> np.ndarray:
  """Logits of jfed's 'mlp': flatten -> [Dense ReLU] x L -> Dense."""
  names = _dense_names(params)
  h = flatten(x)
  for name in names[:-1]:
    h = relu(dense(h, params[name]))
  return dense(h, params[names[-1]])


def _valid_or_same(x: np.ndarray, kernel_size: int, min_valid_size: int) -> int:
  return 0 if min(x.shape[1], x.shape[2]) >= min_valid_size else kernel_size // 2


def fedmho_cnn_forward(
  params: Dict[str, Any], x: np.ndarray, softmax_output: bool = False
) -> np.ndarray:
  """jfed's 'fedmho_cnn' (YXShi2000/FedMHO CNN_MNIST): [Conv5x5 MaxPool2 ReLU] x 2 -> Dense;
  the convs are unpadded on inputs of at least 12 px and padded by 2 below (8x8 digits)."""
  h = np.asarray(x, np.float64)
  for name in ('Conv_0', 'Conv_1'):
    h = relu(pool2(conv2d(h, params[name], _valid_or_same(h, 5, 12)), 'max'))
  logits = dense(flatten(h), params['Dense_0'])
  return softmax(logits) if softmax_output else logits


def cnn_mnist_forward(
  params: Dict[str, Any], batch_stats: Dict[str, Any], x: np.ndarray
) -> np.ndarray:
  """jfed's 'cnn_mnist' (DENSE CNNMnist) in eval mode: [Conv5x5(pad 2) BN ReLU MaxPool2] x n ->
  Dense (without its optional embedding layer)."""
  h = np.asarray(x, np.float64)
  convs = sorted((k for k in params if k.startswith('Conv_')), key=lambda k: int(k.split('_')[1]))
  for i, name in enumerate(convs):
    h = conv2d(h, params[name], padding=2)
    bn, stats = params[f'BatchNorm_{i}']['bn'], batch_stats[f'BatchNorm_{i}']['bn']
    h = pool2(relu(batchnorm_eval(h, bn['scale'], bn['bias'], stats['mean'], stats['var'])))
  return dense(flatten(h), params['Dense_0'])


def cnn_mnist_static_bn(params: Dict[str, Any], x: np.ndarray, batch: int) -> Dict[str, Any]:
  """HeteroFL's static BatchNorm statistics of a 'cnn_mnist' on x (diaoenmao/HeteroFL `stats`,
  torch BatchNorm2d(momentum=None) in train mode): each BN layer's running mean / variance is the
  mean over consecutive batches of `batch` (the last one partial) of the batch's per-channel mean
  / biased variance of the layer's input, every layer normalised by its batch's own statistics."""
  convs = sorted((k for k in params if k.startswith('Conv_')), key=lambda k: int(k.split('_')[1]))
  sums = {f'BatchNorm_{i}': [0.0, 0.0] for i in range(len(convs))}
  starts = range(0, len(x), batch)
  for start in starts:
    h = np.asarray(x[start : start + batch], np.float64)
    for i, name in enumerate(convs):
      h = conv2d(h, params[name], padding=2)
      mean, var = h.mean(axis=(0, 1, 2)), h.var(axis=(0, 1, 2))
      sums[f'BatchNorm_{i}'][0] += mean
      sums[f'BatchNorm_{i}'][1] += var
      bn = params[f'BatchNorm_{i}']['bn']
      h = pool2(relu(batchnorm_eval(h, bn['scale'], bn['bias'], mean, var)))
  n = len(starts)
  return {k: {'bn': {'mean': m / n, 'var': v / n}} for k, (m, v) in sums.items()}


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
  return float(np.mean(np.argmax(logits, -1) == np.asarray(labels)))


# ---------------------------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------------------------


def log_softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
  z = np.asarray(logits, np.float64)
  z = z - z.max(axis=axis, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
  return np.exp(log_softmax(logits, axis))


def cross_entropy(logits: np.ndarray, labels: np.ndarray, weights=None) -> float:
  """torch.nn.functional.cross_entropy (mean over samples) of integer labels; with `weights`
  ([B], e.g. 1 real / 0 padding) the weighted mean Σ w_i ce_i / Σ w_i."""
  lp = log_softmax(logits)
  per_sample = -lp[np.arange(len(lp)), np.asarray(labels)]
  if weights is None:
    return float(per_sample.mean())
  w = np.asarray(weights, np.float64)
  return float((per_sample * w).sum() / max(w.sum(), 1.0))


def kl_div(
  student_logits: np.ndarray,
  teacher_probs: np.ndarray,
  reduction: str = 'batchmean',
) -> float:
  """torch.nn.KLDivLoss(reduction)(log_softmax(student), teacher_probs) =
  Σ p (log p − log q), divided by B ('batchmean'), by B·C ('mean', KLDivLoss's default) or not
  at all ('sum'). Terms with p = 0 contribute 0 (torch's xlogy)."""
  p = np.asarray(teacher_probs, np.float64)
  log_q = log_softmax(student_logits)
  with np.errstate(divide='ignore', invalid='ignore'):
    terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - log_q), 0.0)
  total = terms.sum()
  if reduction == 'batchmean':
    return float(total / p.shape[0])
  if reduction == 'mean':
    return float(total / p.size)
  if reduction == 'sum':
    return float(total)
  raise ValueError(f'unknown reduction {reduction!r}')


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def mlp_loss_and_grads(
  params: Dict[str, Any],
  x: np.ndarray,
  y: np.ndarray,
  prox_mu: float = 0.0,
  anchor: Optional[Dict[str, Any]] = None,
) -> Tuple[float, Dict[str, Any]]:
  """Mean cross entropy of `mlp_forward` on (x, y) and its gradient, by hand-written backprop;
  with prox_mu > 0, plus FedProx's mu/2 ||w − anchor||² (gradient mu (w − anchor))."""
  names = _dense_names(params)
  acts = [flatten(x)]  # the input of every Dense
  for name in names[:-1]:
    acts.append(relu(dense(acts[-1], params[name])))
  logits = dense(acts[-1], params[names[-1]])
  b = len(logits)
  loss = cross_entropy(logits, y)
  delta = softmax(logits)
  delta[np.arange(b), np.asarray(y)] -= 1.0
  delta /= b  # d loss / d logits
  grads = {}
  for i in reversed(range(len(names))):
    layer = params[names[i]]
    grads[names[i]] = {'kernel': acts[i].T @ delta, 'bias': delta.sum(0)}
    if i:
      delta = (delta @ np.asarray(layer['kernel'], np.float64).T) * (acts[i] > 0)
  if prox_mu:
    diff = tree_map(
      lambda w, a: np.asarray(w, np.float64) - np.asarray(a, np.float64), params, anchor
    )
    loss += 0.5 * prox_mu * sum(float(np.sum(d * d)) for d in tree_leaves(diff))
    grads = tree_map(lambda g, d: g + prox_mu * d, grads, diff)
  return loss, grads


def sgd_momentum_step(
  params: Any,
  grads: Any,
  buffers: Optional[Any],
  lr: float,
  momentum: float = 0.0,
  weight_decay: float = 0.0,
  dampening: float = 0.0,
  nesterov: bool = False,
) -> Tuple[Any, Any]:
  """One torch.optim.SGD step: g ← g + wd·w; b ← g on the first step (`buffers` None), else
  b ← μ·b + (1 − dampening)·g; d = g + μ·b (Nesterov) or b; w ← w − lr·d.
  Returns (new params, new buffers)."""

  def one(w, g, b):
    g = g + weight_decay * w
    if momentum:
      b = np.array(g, np.float64) if b is None else momentum * b + (1.0 - dampening) * g
      d = g + momentum * b if nesterov else b
    else:
      d = g
    return w - lr * d, b

  if buffers is None:
    buffers = tree_map(lambda w: None, params)
  out = tree_map(lambda w, g, b: one(np.asarray(w, np.float64), g, b), params, grads, buffers)
  new_params = tree_map(lambda pair: pair[0], out)
  new_buffers = tree_map(lambda pair: pair[1], out)
  return new_params, new_buffers


def mlp_local_sgd(
  params: Dict[str, Any],
  x: np.ndarray,
  y: np.ndarray,
  orders: Sequence[np.ndarray],
  batch_size: int,
  lr: Union[float, Callable[[int], float]],
  momentum: float = 0.0,
  weight_decay: float = 0.0,
  prox_mu: float = 0.0,
  anchor: Optional[Dict[str, Any]] = None,
  buffers: Optional[Any] = None,
  first_step: int = 0,
  epoch_accuracies: Optional[List[float]] = None,
) -> Tuple[Dict[str, Any], Any, List[float]]:
  """A client's local training of an 'mlp' as a PyTorch loop runs it: for each epoch's visiting
  order (a permutation of the client's samples), mini-batches of `batch_size` in that order (the
  last one partial, DataLoader(drop_last=False)), one `sgd_momentum_step` on each batch's mean
  cross entropy (+ the FedProx term). A fresh optimiser unless `buffers` are given. `lr` is a
  rate or a schedule of the optimiser step (counted from `first_step`, as a torch LR scheduler
  stepped per batch). Appends each epoch's training accuracy (the batches' predictions before
  their step, over samples) to `epoch_accuracies` when given.
  Returns (params, momentum buffers, per-epoch mean training loss over samples)."""
  params = to_numpy(params)
  x, y = np.asarray(x, np.float64), np.asarray(y)
  epoch_losses = []
  step = first_step
  for order in orders:
    order = np.asarray(order)
    total, correct = 0.0, 0
    for start in range(0, len(order), batch_size):
      idx = order[start : start + batch_size]
      loss, grads = mlp_loss_and_grads(params, x[idx], y[idx], prox_mu, anchor)
      logits = mlp_forward(params, x[idx])
      total += cross_entropy(logits, y[idx]) * len(idx)
      correct += int(np.sum(np.argmax(logits, -1) == y[idx]))
      rate = lr(step) if callable(lr) else lr
      params, buffers = sgd_momentum_step(params, grads, buffers, rate, momentum, weight_decay)
      step += 1
    epoch_losses.append(total / max(len(order), 1))
    if epoch_accuracies is not None:
      epoch_accuracies.append(correct / max(len(order), 1))
  return params, buffers, epoch_losses


def visiting_order(epoch_key, client_id: int, size: int) -> np.ndarray:
  """The order in which jfed's local training visits a client's `size` samples in an epoch.

  This is an *input* of the oracles (the random data order jfed drew), taken from jfed's
  documented derivation (jfed/engine/training.py, `client_orders`): sample i gets the sort key
  uniform(fold_in(fold_in(epoch_key, client_id), i)) and the client visits its samples in
  ascending order of those keys. epoch_key = fold_in(training key, epoch)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  ckey = jax.random.fold_in(epoch_key, int(client_id))
  u = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(ckey, i)))(jnp.arange(size))
  return np.argsort(np.asarray(u), kind='stable')


def sampled_clients(sampling_key, num_clients: int, participation: float) -> List[int]:
  """The clients of a round: all, or round(participation · K) (at least one) drawn without
  replacement with the round's sampling key, sorted: the random draw jfed makes (an input of the
  oracles, as `visiting_order`)."""
  import jax  # pylint: disable=g-import-not-at-top

  count = max(1, int(round(participation * num_clients)))
  if count == num_clients:
    return list(range(num_clients))
  drawn = jax.random.choice(sampling_key, num_clients, (count,), replace=False)
  return sorted(int(k) for k in np.asarray(drawn))


def epoch_orders(key, client_id: int, size: int, epochs: int, first_epoch: int = 0):
  """`visiting_order` of epochs first_epoch .. first_epoch + epochs - 1 (epoch key =
  fold_in(key, epoch))."""
  import jax  # pylint: disable=g-import-not-at-top

  return [
    visiting_order(jax.random.fold_in(key, e), client_id, size)
    for e in range(first_epoch, first_epoch + epochs)
  ]


def assert_tree_close(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-5) -> None:
  """Two nested trees of arrays ({layer: {leaf: array}}, or deeper) have the same keys and close
  leaves."""
  _assert_close(to_numpy(got), to_numpy(want), rtol, atol, '')


def _assert_close(got: Any, want: Any, rtol: float, atol: float, path: str) -> None:
  if not isinstance(want, dict):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=path)
    return
  assert isinstance(got, dict) and sorted(got) == sorted(want), path
  for name in want:
    _assert_close(got[name], want[name], rtol, atol, f'{path}/{name}')


# ---------------------------------------------------------------------------------------------
# FedSeq (Zaccone et al., ICPR 2022; RickZack/FedSeq)
# ---------------------------------------------------------------------------------------------


def fedseq_greedy_superclients(
  conf: np.ndarray,
  sizes: Sequence[int],
  min_examples: int,
  max_clients: int,
  measure: str = 'kullback',
  code_compat: bool = False,
  weighted: bool = True,
) -> List[List[int]]:
  """GreedyClusterMaker as RickZack/FedSeq runs it (src/algo/fedseq_modules/
  greedy_cluster_maker.py, cluster_maker.py), on inputs where its redistribution assertion
  holds: grow a cluster by the remaining client maximising `measure(representer, client)` (the
  first index wins ties; with `code_compat` the search starts at 0 as the reference's, else at
  −inf) until it holds `min_examples` examples or `max_clients` clients; the representer is the
  members' size-weighted mean (a plain mean unless `weighted`; uniform when empty); an undersized
  last cluster is emptied from its end into the clusters with room, fewest examples first."""
  measures = {
    'kullback': lambda a, b: 1 - np.sum([v * np.log(v * len(a)) for v in (a + b) / 2]),
    'gini': lambda a, b: 1 - np.sum(((a + b) / 2) ** 2),
    'cosine': lambda a, b: 1 - np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)),
  }
  score = measures[measure]
  rem = list(range(len(conf)))
  clusters, cluster = [], []
  while rem:
    if sum(sizes[k] for k in cluster) < min_examples and len(cluster) < max_clients:
      if cluster:
        w = np.array([sizes[k] if weighted else 1 for k in cluster], np.float64)
        rep = sum(conf[k] * wk / w.sum() for k, wk in zip(cluster, w))
      else:
        rep = np.full(conf.shape[1], 1 / conf.shape[1])
      best_diff, best_index = (0, 0) if code_compat else (-np.inf, 0)
      for index, k in enumerate(rem):
        d = score(rep, conf[k])
        if d > best_diff:
          best_diff, best_index = d, index
      cluster.append(rem.pop(best_index))
    else:
      clusters.append(cluster)
      cluster = []
  if cluster:
    if sum(sizes[k] for k in cluster) < min_examples:
      total = sum(len(c) for c in clusters) + len(cluster)
      assert -(-total // len(clusters)) <= max_clients  # _verify_constraints
      room = [c for c in clusters if len(c) < max_clients]
      room.sort(key=lambda c: sum(sizes[k] for k in c))
      i = 0
      while cluster:
        if len(room[i % len(room)]) < max_clients:
          room[i % len(room)].append(cluster.pop())
        i += 1
    else:
      clusters.append(cluster)
  return clusters
