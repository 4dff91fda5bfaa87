"""HFLDD (Shi et al., seed 003, Algorithm 2): dataset-distillation-based hybrid FL.

Stages, each built from shared blocks:

1. Label knowledge collection: every client pre-trains locally (`common.local_models`,
   `hfldd.pretrain_epochs` epochs), infers soft labels (softmax) on a public dataset and uploads
   them (float32 [n_public, C], validated and counted in bytes). `hfldd.public`:
   - 'test_split': `public_size` samples held out of the main dataset's test split (seeded);
     they are then EXCLUDED from evaluation (HFLDD reports accuracy on the rest);
   - a dataset name (e.g. 'fashion_mnist', the paper's public set for MNIST clients):
     `public_size` samples of that dataset's training split, resized (bilinear) and
     channel-matched to the main dataset's input shape; evaluation uses the full test split.
2. Server: Eq. 4 KL divergence matrix -> K-means (K homogeneous clusters) -> Algorithm 1
   heterogeneous clusters -> one random head per cluster (`jfed.hfldd.build_topology`); the
   topology figure is written to workdir/topology.png.
3. IID dataset generation: every non-head member distils its data with KIP, ALL members of ALL
   clusters in one jitted program (`kip_distill_batched` over the stacked members), and sends
   the distilled set to its head. Images cross the network as uint8 (`image_dtype='uint8'`,
   the paper's 8 bits per pixel value: Eq. 18) or float32. Labels: the hard labels (int32)
   by default; with `kip.learn_labels` the learned KIP label matrix (float32 [S, C]) is sent and
   the head turns it into a distribution `max(y + 1/C, 0)` renormalised (KIP labels are
   centred one-hot `onehot - 1/C`, so an unlearned row maps back to its one-hot; a row with
   no positive entry falls back to the one-hot of its argmax); the head's own labels become
   one-hot then, and heads train with soft-label cross entropy.
   `distill=False` (method 'hfldd_nodd') is the paper's "HFLDD w/o DD" ablation: members send
   their raw data instead.
4. Model training: FedAvg over the heads, each training `local_epochs` epochs per round on
   its hybrid dataset (own data + received sets), weighted by hybrid size; the global model is
   evaluated and checkpointed after every round (resume like FedAvg).

Communication (Eq. 18) is measured from the real msgpack-serialised payloads and recorded per
stage (`jfed.hfldd.comm.hfldd_transfers`): metrics carry 'upload_bytes', 'download_bytes' and
'cumulative_bytes' (setup stages included); the summary carries 'bytes_by_stage' and
'total_bytes' (= their sum). The initial model is sent as a seed and not counted (Sec. V-B).

Resume: local models are checkpointed by `common.local_models`, the KIP results under
workdir/distilled; soft labels and the topology are recomputed (deterministic) from them.
KIP randomness: member j of the stacked member list uses fold_in(derive_key(KEY_KIP), j).
"""
import time
from typing import Any, Dict, List, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed.data import FederatedArrays, class_count_table, federate, load_dataset
from jfed.data.transforms import match_input_shape
from jfed.hfldd import build_topology, cluster_label_coverage, comm
from jfed.hfldd.plots import plot_topology
from jfed.io import validate_tree
from jfed.kip import KIPConfig, kip_distill_batched
from jfed.methods import common
from jfed.methods.context import KEY_MODEL_INIT, KEY_ROUNDS, RunContext
from jfed.methods.fedavg import single_architecture
from jfed.methods.registry import register_method

KEY_KIP = 31           # fold_in purpose of the members' KIP keys
IMAGE_DTYPES = ('uint8', 'float32')


# ----------------------------------------------------------------------------------------------
# public data (shared with FedSeq)
# ----------------------------------------------------------------------------------------------
class PublicData(NamedTuple):
  x: np.ndarray        # [n_public, H, W, C] in the main dataset's input shape
  y: np.ndarray        # [n_public] labels of the public samples (in their own dataset)
  eval_x: np.ndarray   # the test samples used for evaluation
  eval_y: np.ndarray
  source: str


def public_data(ctx: RunContext, source: str, size: int) -> PublicData:
  """The public set of HFLDD / FedSeq (see the module docstring), sampled with config.seed."""
  ds = ctx.dataset
  rng = np.random.default_rng(ctx.config.seed)
  size = int(size)
  if source == 'test_split':
    n = len(ds.test_y)
    if not 0 < size <= n // 2:
      raise ValueError(f'public_size={size}: a public set held out of the test split must hold '
                       f'between 1 and half of its {n} samples; set public_size accordingly.')
    idx = np.sort(rng.choice(n, size, replace=False))
    keep = np.setdiff1d(np.arange(n), idx)
    return PublicData(ds.test_x[idx], ds.test_y[idx], ds.test_x[keep], ds.test_y[keep], source)
  other = load_dataset(source)
  if not 0 < size <= len(other.train_y):
    raise ValueError(f'public_size={size} but {source} has {len(other.train_y)} training samples')
  idx = np.sort(rng.choice(len(other.train_y), size, replace=False))
  return PublicData(match_input_shape(other.train_x[idx], ds.input_shape), other.train_y[idx],
                    ds.test_x, ds.test_y, source)


def client_probabilities(ctx: RunContext, local: common.LocalModels, x: np.ndarray) -> np.ndarray:
  """Softmax outputs [m, n, C] of every client's local model on x, indexed by client id."""
  out = np.zeros((ctx.num_clients, len(x), ctx.dataset.num_classes), np.float32)
  for g, models in zip(local.groups, local.models):
    ev = engine.Evaluator(g.module, ctx.config.eval_batch_size, ctx.config.strategy)
    out[g.client_ids] = np.asarray(jax.nn.softmax(jnp.asarray(ev.group_logits(models, x)), -1))
  return out


# ----------------------------------------------------------------------------------------------
# what crosses the network
# ----------------------------------------------------------------------------------------------
class DataUpload(NamedTuple):
  """A member's upload to its head: distilled (or, w/o DD, raw) images and labels."""
  x: np.ndarray   # [n, H, W, C] uint8 (0..255) or float32 in [0, 1]
  y: np.ndarray   # [n] int32 hard labels, or [n, C] float32 KIP label matrix


class DistilledSets(NamedTuple):
  """KIP output of every member (checkpointed so a resumed run does not distil again)."""
  x: Any          # [members, S, H, W, C] float32, input space
  y: Any          # [members, S] int32 hard labels
  y_matrix: Any   # [members, S, C] float32 KIP label matrix
  loss: Any       # [members, iterations] KRR loss per step


def encode_images(x: np.ndarray, image_dtype: str) -> np.ndarray:
  if image_dtype == 'uint8':
    return comm.to_uint8_images(x)
  if image_dtype == 'float32':
    return np.asarray(x, np.float32)
  raise ValueError(f'image_dtype must be one of {IMAGE_DTYPES}, got {image_dtype!r}')


def decode_images(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x)
  return x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)


def kip_label_distribution(y_matrix: np.ndarray) -> np.ndarray:
  """KIP label matrix (centred one-hot, possibly learned) -> class distribution [S, C]."""
  y = np.asarray(y_matrix, np.float64)
  c = y.shape[-1]
  p = np.maximum(y + 1.0 / c, 0.0)
  total = p.sum(-1, keepdims=True)
  onehot = np.eye(c)[np.argmax(y, -1)]
  return np.where(total > 0, p / np.where(total > 0, total, 1.0), onehot).astype(np.float32)


def stack_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> FederatedArrays:
  """Zero-padded FederatedArrays from per-client arrays (labels int [n] or float [n, C])."""
  sizes = np.array([len(y) for y in ys], np.int32)
  n_max = int(sizes.max())
  fx = np.zeros((len(xs), n_max, *xs[0].shape[1:]), np.float32)
  fy = np.zeros((len(ys), n_max, *ys[0].shape[1:]), ys[0].dtype)
  for k, (x, y) in enumerate(zip(xs, ys)):
    fx[k, :len(y)], fy[k, :len(y)] = x, y
  return FederatedArrays(fx, fy, sizes)


def kip_config(cfg) -> KIPConfig:
  k = cfg.kip
  return KIPConfig(support_size=int(k.support_size), iterations=int(k.iterations),
                   lr=float(k.lr), target_batch=int(k.target_batch),
                   learn_labels=bool(k.learn_labels), kernel=str(k.kernel), depth=int(k.depth),
                   reg=float(k.reg), x64=bool(k.get('x64', False)))


def distill_members(ctx: RunContext, kcfg: KIPConfig, members: np.ndarray) -> DistilledSets:
  """KIP for every member in ONE jitted program, or its checkpoint from an earlier run."""
  ds = ctx.dataset
  S, C = kcfg.support_size, ds.num_classes
  template = DistilledSets(np.zeros((len(members), S, *ds.input_shape), np.float32),
                           np.zeros((len(members), S), np.int32),
                           np.zeros((len(members), S, C), np.float32),
                           np.zeros((len(members), kcfg.iterations), np.float32))
  ckpt = ctx.checkpointer('distilled')
  step, sets = ckpt.restore_latest(template)
  if step is None:
    fed = federate(ds.train_x, ds.train_y, [ctx.parts[k] for k in members])
    print(f'KIP: {len(members)} members x {kcfg.iterations} iterations, support '
          f'{S}, in one jitted program ...', flush=True)
    t0 = time.perf_counter()
    res = kip_distill_batched(fed.x, fed.y, fed.sizes, kcfg, ctx.derive_key(KEY_KIP), C,
                              mesh=ctx.mesh)
    sets = DistilledSets(*(np.asarray(a) for a in (res.x, res.y, res.y_matrix, res.loss)))
    print(f'KIP done in {time.perf_counter() - t0:.1f}s; mean KRR loss '
          f'{sets.loss[:, 0].mean():.4g} -> {sets.loss[:, -1].mean():.4g}', flush=True)
    ckpt.save(kcfg.iterations, sets)
  ckpt.close()
  return DistilledSets(*(np.asarray(a) for a in sets))


def member_uploads(ctx: RunContext, cfg, members: np.ndarray, distill: bool
                   ) -> Dict[int, DataUpload]:
  """Every member's upload to its head, validated on arrival (as the head would)."""
  ds = ctx.dataset
  uploads = {}
  if distill:
    kcfg = kip_config(cfg)
    sets = distill_members(ctx, kcfg, members)
    for j, cid in enumerate(members):
      y = sets.y_matrix[j] if kcfg.learn_labels else sets.y[j]
      uploads[int(cid)] = DataUpload(encode_images(sets.x[j], cfg.image_dtype), y)
  else:
    for cid in members:
      p = ctx.parts[int(cid)]
      uploads[int(cid)] = DataUpload(encode_images(ds.train_x[p], cfg.image_dtype),
                                     np.asarray(ds.train_y[p], np.int32))
  for cid, up in uploads.items():
    template = DataUpload(np.zeros(up.x.shape, np.dtype(cfg.image_dtype)),
                          np.zeros(up.y.shape, up.y.dtype))
    validate_tree(up, template, f'data upload of client {cid}')
  return uploads


def hybrid_datasets(ctx: RunContext, topology, uploads: Dict[int, DataUpload]
                    ) -> FederatedArrays:
  """Per head: its own data + the sets its members sent (heads in topology order)."""
  ds = ctx.dataset
  soft = any(np.ndim(u.y) == 2 for u in uploads.values())
  C = ds.num_classes

  def labels(y):
    y = np.asarray(y)
    if not soft:
      return y.astype(np.int32)
    return kip_label_distribution(y) if y.ndim == 2 else np.eye(C, dtype=np.float32)[y]

  xs, ys = [], []
  for head, members in zip(topology.heads, topology.members):
    own = ctx.parts[int(head)]
    xs.append(np.concatenate([ds.train_x[own]] + [decode_images(uploads[int(c)].x)
                                                  for c in members]))
    ys.append(np.concatenate([labels(ds.train_y[own])] + [labels(uploads[int(c)].y)
                                                          for c in members]))
  return stack_clients(xs, ys)


# ----------------------------------------------------------------------------------------------
# the method
# ----------------------------------------------------------------------------------------------
def _client_classes(table: np.ndarray) -> List[str]:
  return [','.join(str(c) for c in np.flatnonzero(row)) for row in table]


def run_hfldd(ctx: RunContext, cfg, distill: bool) -> dict:
  spec = single_architecture(ctx)
  ds = ctx.dataset
  t_setup = time.perf_counter()

  # 1. label knowledge collection
  local = common.local_models(ctx, cfg.pretrain_epochs)
  public = public_data(ctx, cfg.public, cfg.public_size)
  soft_labels = client_probabilities(ctx, local, public.x)
  soft_template = np.zeros(soft_labels.shape[1:], np.float32)
  for k in range(ctx.num_clients):
    validate_tree(soft_labels[k], soft_template, f'soft labels of client {k}')
  soft_bytes = [comm.serialized_nbytes(soft_labels[k]) for k in range(ctx.num_clients)]

  # 2. heterogeneous client clustering
  topo = build_topology(soft_labels, int(cfg.K), ctx.config.seed, symmetric=cfg.symmetric,
                        leftover=cfg.leftover)
  table = class_count_table(ds.train_y, ctx.parts, ds.num_classes)
  coverage = cluster_label_coverage(topo.clusters, table)
  plot_topology(topo.homog_labels, topo.clusters, topo.heads, str(ctx.workdir / 'topology.png'),
                title=f"HFLDD topology: {ctx.num_clients} clients, {len(topo.clusters)} clusters,"
                      f" K={cfg.K}", client_classes=_client_classes(table))

  # 3. IID dataset generation (KIP, or raw data without DD)
  members = np.concatenate([np.asarray(m, np.int64) for m in topo.members] or
                           [np.zeros(0, np.int64)])
  uploads = member_uploads(ctx, cfg, members, distill) if len(members) else {}
  data_bytes = {cid: comm.serialized_nbytes(up) for cid, up in uploads.items()}
  fed = hybrid_datasets(ctx, topo, uploads)
  setup_seconds = time.perf_counter() - t_setup

  # 4. FedAvg over the heads on their hybrid datasets
  module = common.build_module(spec, ds)
  group = common.ClientGroup(spec, module, np.asarray(topo.heads), fed)
  trainer = common.make_trainers(ctx, [group])[0]
  init = engine.init_model(module, ds.input_shape, ctx.derive_key(KEY_MODEL_INIT, 0))
  model_bytes = comm.serialized_nbytes(init)
  transfers = comm.hfldd_transfers(soft_bytes, data_bytes, topo.clusters, topo.heads,
                                   model_bytes, cfg.rounds)
  if not distill:
    transfers = [t._replace(stage='raw_data') if t.stage == 'distilled' else t for t in transfers]
  cumulative = comm.cumulative_bytes(transfers, cfg.rounds)
  setup_bytes = comm.total_bytes(transfers, upto_round=0)

  ckpt = ctx.checkpointer()
  start, global_model = ckpt.restore_latest(init)
  start = start or 0
  ctx.metrics.truncate_after(start)
  if start == 0:
    ctx.metrics.write({
        'step': 0, 'stage': 'setup', 'soft_label_bytes': int(sum(soft_bytes)),
        'data_bytes': int(sum(data_bytes.values())), 'upload_bytes': setup_bytes,
        'download_bytes': 0, 'cumulative_bytes': setup_bytes, 'num_clusters': len(topo.clusters),
        'hybrid_sizes': fed.sizes, 'seconds': setup_seconds})
  evaluator = engine.Evaluator(module, ctx.config.eval_batch_size, ctx.config.strategy)
  heads = len(topo.heads)
  for r in range(start, cfg.rounds):
    t0 = time.perf_counter()
    starts = engine.replicate(global_model, heads)
    (models,), (metrics,) = common.train_groups(
        [trainer], [group], [starts], cfg.local_epochs, ctx.derive_key(KEY_ROUNDS, r),
        label=f'round {r + 1}/{cfg.rounds}')
    upload_bytes = common.receive_uploads([group], [models], [init])
    global_model = engine.weighted_average(models, fed.sizes)
    accuracy = evaluator.accuracy(global_model, public.eval_x, public.eval_y)
    ctx.metrics.write({
        'step': r + 1, 'round': r + 1, 'test_accuracy': accuracy,
        'train_loss': float(np.mean(metrics.loss[:, -1])), 'clients': heads,
        'upload_bytes': upload_bytes, 'download_bytes': heads * model_bytes,
        'cumulative_bytes': int(cumulative[r]), 'seconds': time.perf_counter() - t0})
    print(f'round {r + 1}/{cfg.rounds}: test accuracy {accuracy:.4f} '
          f'({time.perf_counter() - t0:.1f}s)', flush=True)
    ckpt.save(r + 1, global_model)
  ckpt.close()

  accs = [h['test_accuracy'] for h in ctx.metrics.read() if 'test_accuracy' in h]
  stages = dict(comm.bytes_by_stage(transfers))
  return {
      'final_test_accuracy': accs[-1], 'best_test_accuracy': max(accs), 'rounds': cfg.rounds,
      'step_name': 'round', 'distill': distill, 'public': public.source,
      'eval_samples': int(len(public.eval_y)),
      'clusters': [c.tolist() for c in topo.clusters], 'heads': topo.heads.tolist(),
      'homogeneous_labels': topo.homog_labels.tolist(),
      'cluster_label_coverage': coverage.tolist(), 'hybrid_sizes': fed.sizes.tolist(),
      'bytes_by_stage': stages, 'total_bytes': int(sum(stages.values())),
      'setup_bytes': setup_bytes, 'model_bytes': model_bytes}


@register_method('hfldd')
def hfldd(ctx: RunContext) -> dict:
  return run_hfldd(ctx, ctx.config.hfldd, distill=bool(ctx.config.hfldd.distill))


@register_method('hfldd_nodd')
def hfldd_nodd(ctx: RunContext) -> dict:
  """The paper's "HFLDD w/o DD" ablation: members send their raw data to the heads."""
  return run_hfldd(ctx, ctx.config.hfldd, distill=False)
