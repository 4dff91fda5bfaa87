"""Blocks shared by the methods with CVAE clients (FedMHO, FedCVAE); not a method itself.

Clients are split by kind: a spec `cvae[:size=..,latent=..,hidden=..]` (see `jfed.cvae.clients`)
makes a generative client, any other spec a classifier. Each distinct CVAE spec is one compiled
group (`ClientGroup` with a `CVAE` module), trained by the shared engine with the CVAE objective;
the local CVAEs are a driver stage ('local_cvaes', tagged by their epochs, read from
`config.local_cvaes_dir` when set) so a sweep over server-side methods trains them once.
"""

from typing import Any, List, NamedTuple, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jfed import engine
from jfed.api import RunContext
from jfed.cvae import clients as cvae_clients
from jfed.cvae import generation_counts, kmeans_filter
from jfed.cvae.server import FusionTrainer, SyntheticSet
from jfed.data import class_count_table
from jfed.engine import ModelState
from jfed.errors import ConfigError, NonFiniteError
from jfed.io import synthetic as synthetic_io
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import common


class CVAESettings(NamedTuple):
  """How CVAE clients train (FedMHO Table 7; FedCVAE `github.com/ceh-2000/fed_cvae`)."""

  epochs: int
  optimizer: str
  lr: float
  batch: int
  recon: str  # 'bce' | 'mse'
  beta: float
  small_lr: float = 0.0  # CVAE-small groups' lr (0: `lr`); FedMHO's reference: 5e-2 vs 1e-3
  # True: the clients of a CVAE spec start from one init (FedMHO's reference: one initial model
  # per architecture); False: each client its own (ceh-2000/fed_cvae's users, `init_cvaes`)
  same_init: bool = True


def group_lr(module, s: CVAESettings) -> float:
  """The learning rate of a CVAE group: `s.small_lr` for CVAE-small when set, else `s.lr` (the
  FedMHO reference trains CVAE-small at Adam 5e-2 and CVAE-large at 1e-3 on the MNIST family,
  YXShi2000/FedMHO:pcode/worker_lmf.py)."""
  return s.small_lr if s.small_lr and module.size == 'small' else s.lr


def split_clients(ctx: RunContext):
  """(classifier client ids, generative client ids), each ascending."""
  specs = list(ctx.federation.specs)
  generative = np.array([k for k, s in enumerate(specs) if cvae_clients.is_generative(s)], int)
  classifiers = np.array([k for k, s in enumerate(specs) if not cvae_clients.is_generative(s)])
  return classifiers.astype(int), generative


def build_cvae_spec(spec: str, dataset):
  """The CVAE module of a `cvae:...` spec for `dataset`; ConfigError on a bad option."""
  _, kwargs = common.parse_model_spec(spec)
  try:
    return cvae_clients.build_cvae(kwargs, dataset.num_classes, dataset.input_shape)
  except ValueError as e:
    raise ConfigError(f'client model {spec!r}: {e}') from None


def cvae_groups(ctx: RunContext) -> List[common.ClientGroup]:
  """The generative clients grouped by CVAE spec, in order of first appearance."""
  return common.client_groups(ctx, split_clients(ctx)[1], build=build_cvae_spec)


def init_cvaes(
  ctx: RunContext, groups: Sequence[common.ClientGroup], same_init: bool = True
) -> List[ModelState]:
  """The CVAE clients' initial models, stacked per group.

  The key of a spec is derive_key(MODEL_INIT, the spec's index among all specs). `same_init`:
  every CVAE of the group starts from that key's init (FedMHO's reference sends one initial
  model per architecture); else client k starts from the init of fold_in(that key, k), k its
  global id (ceh-2000/fed_cvae builds every user's CVAE from its own draw,
  `--should_initialize_same_exp=0`).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    groups: The CVAE client groups.
    same_init: One init per group (True) or one per client (False).

  Returns:
    One ModelState per group, its leaves stacked over the group's clients.
  """
  all_specs = list(ctx.federation.architectures)
  shape = ctx.dataset.input_shape
  out = []
  for g in groups:
    key = ctx.derive_key(Purpose.MODEL_INIT, all_specs.index(g.spec))
    try:
      if same_init:
        init = engine.replicate(
          engine.commit(cvae_clients.init_cvae(g.module, shape, key)), len(g.client_ids)
        )
      else:
        init = engine.stack(
          [
            cvae_clients.init_cvae(g.module, shape, jax.random.fold_in(key, int(k)))
            for k in g.client_ids
          ]
        )
    except ValueError as e:  # e.g. CVAE-large on images whose sides are not multiples of 4
      raise ConfigError(f'client model {g.spec!r}: {e}') from None
    out.append(engine.commit(init))
  return out


def cvae_trainers(ctx: RunContext, groups: Sequence[common.ClientGroup], s: CVAESettings):
  """The CVAE groups' trainers: the engine with the CVAE objective, or on Flower SuperNodes
  (which build these same trainers from the recipe) when the run has a client transport.

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    groups: The CVAE client groups.
    s: How the CVAEs train (epochs, optimizer, learning rates, batch size, loss).

  Returns:
    One trainer per group.
  """
  specs = [engine.OptimizerSpec(s.optimizer, group_lr(g.module, s)) for g in groups]
  if ctx.client_transport is not None:
    # the nodes train from the server's initial models (`init_cvaes`): same_init is not theirs
    settings = {k: v for k, v in s._asdict().items() if k != 'same_init'}
    recipe = {'kind': 'cvae', 'upload': 'decoder', **settings}
    return [
      ctx.client_transport.trainer(g.spec, engine.build_optimizer(spec), recipe, ctx.client_sizes)
      for g, spec in zip(groups, specs)
    ]
  objective = cvae_clients.cvae_objective(s.recon, s.beta)
  return [
    common.group_trainer(ctx, g.module, spec, s.batch, objective=objective)
    for g, spec in zip(groups, specs)
  ]


class LocalCVAEs(NamedTuple):
  groups: List[common.ClientGroup]
  models: List[ModelState]  # stacked per group
  uploads: List[cvae_clients.DecoderUploads]  # per group, of its clients that were not excluded
  excluded: List[int]  # clients whose CVAE diverged (non-finite decoder): no upload received

  @property
  def upload_bytes(self) -> int:
    return int(sum(u.upload_bytes for u in self.uploads))


def finite_clients(stacked: Any) -> np.ndarray:
  """[k] bool: whether every leaf of client k's slice of a stacked pytree is finite."""
  leaves = [np.asarray(x).reshape(x.shape[0], -1) for x in jax.tree.leaves(stacked)]
  return np.all(np.stack([np.isfinite(x).all(1) for x in leaves]), axis=0)


def local_cvaes(ctx: RunContext, s: CVAESettings) -> LocalCVAEs:
  """Every generative client's CVAE trained `s.epochs` epochs (a driver stage), and the
  validated decoder uploads.

  A client whose CVAE diverged (a non-finite decoder; Table 7's Adam 5e-2 does this now and then
  on Fashion-MNIST) sends nothing the server can use: it is excluded, with a warning, instead of
  failing the run, and the others' uploads are received as usual.

  The stage is cached under 'local_cvaes' in the workdir, or in `local_cvaes_dir` in the
  subfolder of the run and of `s` (`RunContext.shared_cache_dir`), tagged by the epochs."""
  groups = cvae_groups(ctx)
  init = init_cvaes(ctx, groups, s.same_init)

  def train():
    trainers = cvae_trainers(ctx, groups, s)
    models, metrics = common.train_groups(
      trainers,
      groups,
      init,
      s.epochs,
      ctx.derive_key(Purpose.LOCAL_TRAINING),
      label='local CVAE training',
      diverged='warn',
    )
    for g, m in zip(groups, metrics):
      logging.info(
        'local CVAE training [%s]: final loss %s', g.spec, np.round(m.loss[:, -1], 2).tolist()
      )
    return list(models)

  models = ctx.stage(
    'local_cvaes',
    s.epochs,
    list(init),
    train,
    directory=ctx.run.local_cvaes_dir or None,
    settings=s._asdict(),
  )
  uploads, excluded = [], []
  for g, m, i in zip(groups, models, init):
    keep = finite_clients((m.params['decoder'], cvae_clients.decoder_stats_of(m)))
    if not keep.all():
      logging.warning('excluding diverged CVAE client(s) %s', g.client_ids[~keep].tolist())
      excluded += [int(c) for c in g.client_ids[~keep]]
    ids = g.client_ids[keep]
    uploads.append(
      cvae_clients.receive_decoder_uploads(
        ids,
        engine.take(m, np.flatnonzero(keep)),
        class_count_table(
          ctx.dataset.train_y, [ctx.parts[k] for k in ids], ctx.dataset.num_classes
        ).astype(np.int32),
        engine.take(i, 0),
      )
    )
  if not any(len(u.client_ids) for u in uploads):
    raise NonFiniteError(f'every CVAE client diverged ({excluded}); lower the CVAE learning rate')
  return LocalCVAEs(groups, list(models), uploads, excluded)


class Synthetic(NamedTuple):
  """The generated set before the filter and which samples the filter kept."""

  images: np.ndarray  # [N, H, W, C] in [0, 1]
  labels: np.ndarray  # [N]
  owners: np.ndarray  # [N] the generating decoder's client id
  kept: np.ndarray  # indices kept by Algorithm 2


def fedmho_synthetic(
  ctx: RunContext, cvaes: LocalCVAEs, total: int, clean_rate: float
) -> Synthetic:
  """FedMHO's data generation (§4.2.2: int(N_syn / C) per class, split over the decoders by
  n_kc² / Σ n_k'c², z ~ N(0, I)) and Algorithm 2's filter, over every decoder group (FedMHO;
  FedCVAE-Ens under FedMHO's protocol).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    cvaes: The clients' trained CVAEs.
    total: N_syn, the number of samples to generate before filtering.
    clean_rate: R_th in (0, 1], the fraction of each class's samples the filter keeps.

  Returns:
    The generated images and labels and the indices the filter kept.
  """
  counts = generation_counts(np.concatenate([u.label_counts for u in cvaes.uploads]), total)
  key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.GENERATION)
  parts, row = [], 0
  for g, u in zip(cvaes.groups, cvaes.uploads):
    group_counts = counts[row : row + len(u.client_ids)]
    row += len(u.client_ids)
    if not len(group_counts):  # every client of the group was excluded
      continue
    labels, real = cvae_clients.labels_of_counts(group_counts)
    z = jax.vmap(
      lambda c: jax.random.normal(jax.random.fold_in(key, c), (labels.shape[1], g.module.latent))
    )(jnp.asarray(u.client_ids))
    parts.append(cvae_clients.generate(g.module, u, labels, real, z))
  images, labels, owners = cvae_clients.concat_generated(parts)
  return Synthetic(images, labels, owners, kmeans_filter(images, labels, clean_rate))


SYNTHETIC_FILE = synthetic_io.SYNTHETIC_FILE


def save_synthetic(
  ctx: RunContext, images: np.ndarray, labels: np.ndarray, kept: Optional[np.ndarray] = None
) -> None:
  """workdir/synthetic.npz (`jfed.io.synthetic`): the generated set, its labels and the indices
  the filter kept, so that `experiments.generator_check` can score the samples with a classifier
  trained on real data (nothing written in memory).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    images: The generated images, [N, H, W, C] in [0, 1].
    labels: Their labels, [N].
    kept: The indices the filter kept; None for all.
  """
  synthetic_io.save_synthetic(ctx.output_path(SYNTHETIC_FILE), images, labels, kept)


def fusion_epoch(
  ctx: RunContext,
  trainer: FusionTrainer,
  evaluator: engine.Evaluator,
  state: engine.TrainState,
  data: SyntheticSet,
  batch: int,
  i: int,
):
  """Step i of a server classifier trained on a fixed synthetic set (FedMHO, FedCVAE): one
  epoch in the order np.random.default_rng((seed, 1, i)) with dropout keys of
  derive_key(SERVER, 1, i); returns (state, mean batch loss, test accuracy).

  Args:
    ctx: The run context (dataset, clients, run config, stage cache).
    trainer: The server classifier's trainer.
    evaluator: Evaluates the classifier on the test set.
    state: The classifier's training state.
    data: The synthetic training set.
    batch: Samples per step.
    i: The epoch, from 0 (it seeds the order and dropout).

  Returns:
    (state, mean batch loss, test accuracy).
  """
  state, loss = trainer.epoch(
    engine.commit(state),
    data,
    batch,
    np.random.default_rng((int(ctx.run.seed), 1, i)),
    ctx.derive_key(Purpose.SERVER, 1, i),
  )
  return state, loss, evaluator.accuracy(state.model, ctx.dataset.test_x, ctx.dataset.test_y)
