"""HFLDD (Shi et al., arXiv 2409.17517, Algorithm 2): dataset-distillation-based hybrid FL.

Setup (`HFLDD.setup`), each stage a shared block:

1. Label knowledge collection: every client pre-trains locally (`common.local_models`,
   `hfldd.pretrain_epochs` epochs), infers soft labels (softmax) on a public dataset
   (`jfed.data.public`, `hfldd.public` / `public_size`) and uploads them (float32
   [n_public, C], validated and counted in bytes). `public='holdout'` takes them from the
   training samples held out of every client (`dataset.holdout_size`); the test split is only
   ever scored, whole.
2. Server: Eq. 4 KL divergence matrix -> K-means (K homogeneous clusters) -> Algorithm 1
   heterogeneous clusters -> one random head per cluster (`jfed.clustering.build_topology`);
   the topology figure is written to workdir/topology.png.
3. IID dataset generation: every non-head member distils its data with KIP, ALL members of ALL
   clusters in one jitted program (`kip_distill_batched` over the stacked members; a driver
   stage, `ctx.stage('distilled', iterations, ...)`, so a resumed run does not distil again),
   and sends the distilled set to its head. Images cross the network as uint8
   (`image_dtype='uint8'`, the paper's 8 bits per pixel value: Eq. 18) or float32. Labels: the
   hard labels (int32) by default; with `kip.learn_labels` the learned KIP label matrix
   (float32 [S, C]) is sent and the head turns it into a distribution `max(y + 1/C, 0)`
   renormalised (KIP labels are centred one-hot `onehot - 1/C`, so an unlearned row maps back
   to its one-hot; a row with no positive entry falls back to the one-hot of its argmax); the
   head's own labels become one-hot then, and heads train with soft-label cross entropy.
   `distill=False` (method 'hfldd_nodd') is the paper's "HFLDD w/o DD" ablation: members send
   their raw data instead.

Steps: a round of FedAvg over the heads (`common.fedavg_round`), each head training
`local_epochs` epochs on its hybrid dataset (own data + received sets), weighted by hybrid
size; the global model is evaluated on the whole test split.

Communication (Eq. 18) is measured from the real msgpack-serialised payloads: the setup record
(step 0) carries the soft-label uploads (`upload_bytes`) and the member -> head sets
(`peer_bytes`), every round its model uploads and downloads; the summary's `bytes_by_stage`
is the protocol's account (`jfed.io.comm.hfldd_transfers`) and sums to `total_bytes`. The
initial model is sent as a seed and not counted (Sec. V-B).

KIP randomness: member j of the stacked member list uses fold_in(derive_key(Purpose.KIP), j).
"""

from typing import Any, Dict, List, NamedTuple, Sequence

from absl import logging
import numpy as np

from jfed import engine
from jfed import typed_config as tc
from jfed.api import Algorithm, RunContext
from jfed.clustering import (
  LEFTOVER_RULES,
  HFLDDTopology,
  build_topology,
  cluster_label_coverage,
  plot_topology,
)
from jfed.data import FederatedArrays, class_count_table, federate
from jfed.data.public import PublicData, check_holdout_fits, public_data
from jfed.engine import GroupTrainer, ModelState
from jfed.io import comm, validate_tree
from jfed.keys import Purpose
from jfed.kip import KERNELS, KIPConfig, kip_distill_batched
from jfed.methods import common
from jfed.methods.registry import register_method

IMAGE_DTYPES = ('uint8', 'float32')


class KIPSection(NamedTuple):
  """`hfldd.kip`: the members' KIP settings (see `jfed.kip.KIPConfig`)."""

  support_size: int = 400
  iterations: int = 3000
  lr: float = 0.004
  target_batch: int = 10
  learn_labels: bool = False
  kernel: str = 'fc_ntk'
  depth: int = 1
  reg: float = 1e-6
  x64: bool = False


class HFLDDConfig(NamedTuple):
  pretrain_epochs: int = 1
  public: str = 'holdout'
  public_size: int = 1000
  K: int = 10
  symmetric: bool = False
  leftover: str = 'singleton'
  distill: bool = True
  image_dtype: str = 'uint8'
  rounds: int = 1
  local_epochs: int = 1
  kip: KIPSection = KIPSection()


# ------------------------------------------------------------------------------------------------
# what crosses the network
# ------------------------------------------------------------------------------------------------
class DataUpload(NamedTuple):
  """A member's upload to its head: distilled (or, w/o DD, raw) images and labels."""

  x: np.ndarray  # [n, H, W, C] uint8 (0..255) or float32 in [0, 1]
  y: np.ndarray  # [n] int32 hard labels, or [n, C] float32 KIP label matrix


class DistilledSets(NamedTuple):
  """KIP output of every member (a driver stage, so a resumed run does not distil again)."""

  x: Any  # [members, S, H, W, C] float32, input space
  y: Any  # [members, S] int32 hard labels
  y_matrix: Any  # [members, S, C] float32 KIP label matrix
  loss: Any  # [members, iterations] KRR loss per step


def encode_images(x: np.ndarray, image_dtype: str) -> np.ndarray:
  """[0, 1] images as they cross the network: uint8 (0..255) or float32."""
  if image_dtype == 'uint8':
    return comm.to_uint8_images(x)
  if image_dtype == 'float32':
    return np.asarray(x, np.float32)
  raise ValueError(f'image_dtype must be one of {IMAGE_DTYPES}, got {image_dtype!r}')


def decode_images(x: np.ndarray) -> np.ndarray:
  """Received images back to float32 in [0, 1]."""
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
    fx[k, : len(y)], fy[k, : len(y)] = x, y
  return FederatedArrays(fx, fy, sizes)


def kip_config(k: KIPSection) -> KIPConfig:
  return KIPConfig(
    support_size=k.support_size,
    iterations=k.iterations,
    lr=k.lr,
    target_batch=k.target_batch,
    learn_labels=k.learn_labels,
    kernel=k.kernel,
    depth=k.depth,
    reg=k.reg,
    x64=k.x64,
  )


def distill_members(ctx: RunContext, kcfg: KIPConfig, members: np.ndarray) -> DistilledSets:
  """KIP for every member in ONE jitted program; a stage of the driver (computed once).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    kcfg: The KIP settings (support size, iterations, learning rate, kernel).
    members: The ids of the clients that distil (non-heads).

  Returns:
    The distilled sets (images, labels, label matrices, losses), stacked in `members` order.
  """
  ds = ctx.dataset
  S, C = kcfg.support_size, ds.num_classes
  template = DistilledSets(
    np.zeros((len(members), S, *ds.input_shape), np.float32),
    np.zeros((len(members), S), np.int32),
    np.zeros((len(members), S, C), np.float32),
    np.zeros((len(members), kcfg.iterations), np.float32),
  )

  def compute() -> DistilledSets:
    fed = federate(ds.train_x, ds.train_y, [ctx.parts[k] for k in members])
    logging.info(
      'KIP: %d members x %d iterations, support %d, in one jitted program',
      len(members),
      kcfg.iterations,
      S,
    )
    if ctx.client_transport is not None:  # each member distils on its own node
      sets = DistilledSets(
        *ctx.client_transport.distill(members, kcfg, ctx.derive_key(Purpose.KIP))
      )
    else:
      res = kip_distill_batched(
        fed.x, fed.y, fed.sizes, kcfg, ctx.derive_key(Purpose.KIP), C, mesh=ctx.mesh
      )
      sets = DistilledSets(*(np.asarray(a) for a in (res.x, res.y, res.y_matrix, res.loss)))
    logging.info('KIP: mean KRR loss %.4g -> %.4g', sets.loss[:, 0].mean(), sets.loss[:, -1].mean())
    return sets

  sets = ctx.stage('distilled', kcfg.iterations, template, compute)
  return DistilledSets(*(np.asarray(a) for a in sets))


def member_uploads(
  ctx: RunContext, cfg: HFLDDConfig, members: np.ndarray, distill: bool
) -> Dict[int, DataUpload]:
  """Every member's upload to its head, validated on arrival (as the head would).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    cfg: The method's config.
    members: The ids of the clients that upload to a head.
    distill: Whether members send distilled sets (HFLDD) or their raw data (the ablation).

  Returns:
    Each member's validated upload, by client id.
  """
  ds = ctx.dataset
  uploads = {}
  if distill:
    kcfg = kip_config(cfg.kip)
    sets = distill_members(ctx, kcfg, members)
    for j, cid in enumerate(members):
      y = sets.y_matrix[j] if kcfg.learn_labels else sets.y[j]
      uploads[int(cid)] = DataUpload(encode_images(sets.x[j], cfg.image_dtype), y)
  else:
    for cid in members:
      p = ctx.parts[int(cid)]
      uploads[int(cid)] = DataUpload(
        encode_images(ds.train_x[p], cfg.image_dtype), np.asarray(ds.train_y[p], np.int32)
      )
  for cid, up in uploads.items():
    template = DataUpload(
      np.zeros(up.x.shape, np.dtype(cfg.image_dtype)), np.zeros(up.y.shape, up.y.dtype)
    )
    validate_tree(up, template, f'data upload of client {cid}')
  return uploads


def hybrid_datasets(
  ctx: RunContext, topology: HFLDDTopology, uploads: Dict[int, DataUpload]
) -> FederatedArrays:
  """Per head: its own data + the sets its members sent (heads in topology order).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    topology: The clusters: each head and its members.
    uploads: Each member's upload, by client id.

  Returns:
    The heads' training sets, in topology order.
  """
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
    xs.append(
      np.concatenate([ds.train_x[own]] + [decode_images(uploads[int(c)].x) for c in members])
    )
    ys.append(
      np.concatenate([labels(ds.train_y[own])] + [labels(uploads[int(c)].y) for c in members])
    )
  return stack_clients(xs, ys)


def _client_classes(table: np.ndarray) -> List[str]:
  return [','.join(str(c) for c in np.flatnonzero(row)) for row in table]


# ------------------------------------------------------------------------------------------------
# the method
# ------------------------------------------------------------------------------------------------
class HFLDDAux(NamedTuple):
  public: PublicData
  topology: HFLDDTopology
  coverage: np.ndarray  # distinct classes per heterogeneous cluster
  group: common.ClientGroup  # the heads, on their hybrid datasets
  trainer: GroupTrainer
  evaluator: engine.Evaluator
  init: ModelState
  model_bytes: int
  transfers: List[comm.Transfer]  # the whole run's protocol account (Eq. 18)
  server: common.Server  # receives and aggregates the heads' uploads


@register_method('hfldd')
class HFLDD(Algorithm):
  """Complementary clusters; members send distilled data to their head; FedAvg over heads."""

  section = 'hfldd'
  server_round = True
  Config = HFLDDConfig
  step_name = 'round'

  @property
  def distill(self) -> bool:
    return self.config.distill

  def validate(self, config) -> None:
    c, where = self.config, self.section
    tc.require_positive(c, where, ('pretrain_epochs', 'public_size', 'K', 'rounds', 'local_epochs'))
    tc.require_choice(c.image_dtype, IMAGE_DTYPES, f'{where}.image_dtype')
    tc.require_choice(c.leftover, LEFTOVER_RULES, f'{where}.leftover')
    check_holdout_fits(config, c.public, c.public_size, f'{where}.public')
    if self.distill:
      k = c.kip
      tc.require_positive(k, f'{where}.kip', ('support_size', 'iterations', 'lr', 'target_batch'))
      tc.require_non_negative(k, f'{where}.kip', ('depth', 'reg'))
      tc.require_choice(k.kernel, KERNELS, f'{where}.kip.kernel')

  def trained_model(self, ctx: RunContext, aux: HFLDDAux, state: ModelState) -> engine.TrainedModel:
    """The global model."""
    return engine.TrainedModel(aux.evaluator.module, state)

  def num_steps(self, ctx: RunContext) -> int:
    return self.config.rounds

  def setup(self, ctx: RunContext) -> HFLDDAux:
    cfg, ds = self.config, ctx.dataset
    spec = common.single_architecture(ctx)

    # 1. label knowledge collection
    public = public_data(ds, cfg.public, cfg.public_size, ctx.run.seed)
    if ctx.client_transport is not None:  # on the clients' nodes: only the soft labels come back
      soft_labels = ctx.client_transport.soft_labels(ctx.num_clients, cfg.pretrain_epochs, public.x)
    else:
      local = common.local_models(ctx, cfg.pretrain_epochs)
      soft_labels = common.client_probabilities(ctx, local, public.x)
    soft_template = np.zeros(soft_labels.shape[1:], np.float32)
    for k in range(ctx.num_clients):
      validate_tree(soft_labels[k], soft_template, f'soft labels of client {k}')

    # 2. heterogeneous client clustering
    topo = build_topology(
      soft_labels, cfg.K, ctx.run.seed, symmetric=cfg.symmetric, leftover=cfg.leftover
    )
    table = class_count_table(ds.train_y, ctx.parts, ds.num_classes)
    path = ctx.output_path('topology.png')
    if path is not None:
      title = f'HFLDD topology: {ctx.num_clients} clients, {len(topo.clusters)} clusters, K={cfg.K}'
      plot_topology(
        topo.homog_labels,
        topo.clusters,
        topo.heads,
        str(path),
        title=title,
        client_classes=_client_classes(table),
      )

    # 3. IID dataset generation (KIP, or raw data without DD)
    members = np.concatenate([np.asarray(m, np.int64) for m in topo.members])
    uploads = member_uploads(ctx, cfg, members, self.distill) if len(members) else {}
    fed = hybrid_datasets(ctx, topo, uploads)

    # the heads' FedAvg
    module = common.build_module(spec, ds)
    group = common.ClientGroup(spec, module, np.asarray(topo.heads), fed)
    init = engine.init_model(module, ds.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0))
    model_bytes = comm.serialized_nbytes(init)
    transfers = comm.hfldd_transfers(
      [comm.serialized_nbytes(soft_labels[k]) for k in range(ctx.num_clients)],
      {cid: comm.serialized_nbytes(up) for cid, up in uploads.items()},
      topo.clusters,
      topo.heads,
      model_bytes,
      cfg.rounds,
      data_stage='distilled' if self.distill else 'raw_data',
    )
    return HFLDDAux(
      public,
      topo,
      cluster_label_coverage(topo.clusters, table),
      group,
      common.make_trainers(ctx, [group])[0],
      engine.Evaluator(module, ctx.run.eval_batch_size, ctx.run.strategy),
      init,
      model_bytes,
      transfers,
      common.make_server(ctx),
    )

  def setup_records(self, ctx: RunContext, aux: HFLDDAux) -> List[Dict[str, Any]]:
    setup = [t for t in aux.transfers if t.round == comm.SETUP_ROUND]
    return [
      {
        'stage': 'setup',
        **comm.record_bytes(setup),
        'num_clusters': len(aux.topology.clusters),
        'hybrid_sizes': aux.group.fed.sizes.tolist(),
      }
    ]

  def init(self, ctx: RunContext, aux: HFLDDAux) -> ModelState:
    return aux.init

  def step(self, ctx: RunContext, aux: HFLDDAux, state: ModelState, i: int):
    """One FedAvg round over the cluster heads' hybrid datasets."""
    cfg = self.config
    model, record = common.fedavg_round(
      common.RoundParts(aux.trainer, cfg.local_epochs, aux.init, aux.server),
      aux.group,
      state,
      ctx.derive_key(Purpose.ROUNDS, i),
      i,
      common.RoundOptions(label=f'round {i + 1}/{cfg.rounds}', declared_sizes=aux.group.fed.sizes),
    )
    accuracy = aux.evaluator.accuracy(model, aux.public.eval_x, aux.public.eval_y)
    return model, [{'round': i + 1, 'test_accuracy': accuracy, **record}]

  def summarize(self, ctx, aux: HFLDDAux, state, history) -> Dict[str, Any]:
    """The run summary: the topology, upload sizes and accuracies."""
    topo = aux.topology
    return {
      'rounds': self.config.rounds,
      'distill': self.distill,
      'public': aux.public.source,
      'clusters': [c.tolist() for c in topo.clusters],
      'heads': topo.heads.tolist(),
      'homogeneous_labels': topo.homog_labels.tolist(),
      'cluster_label_coverage': aux.coverage.tolist(),
      'hybrid_sizes': aux.group.fed.sizes.tolist(),
      'bytes_by_stage': dict(comm.bytes_by_stage(aux.transfers)),
      'setup_bytes': comm.total_bytes(aux.transfers, upto_round=comm.SETUP_ROUND),
      'model_bytes': aux.model_bytes,
    }


@register_method('hfldd_nodd')
class HFLDDNoDD(HFLDD):
  """The paper's "HFLDD w/o DD" ablation: members send their raw data to the heads."""

  @property
  def distill(self) -> bool:
    return False
