"""What a method stands on: `Algorithm`, `RunContext`, `RunSummary` and the records of a step.

A method is an `Algorithm` (in the spirit of fedjax's `FederatedAlgorithm` and optax's pairs of
pure functions): a typed config parsed once from the config file, and

  setup(ctx) -> aux                    one-off stages (local models, clustering, KIP, ...),
                                       cached by the driver's stage checkpoints (`ctx.stage`);
  init(ctx, aux) -> state              the state before step 0 (also the restore template);
  step(ctx, aux, state, i) -> (state, records)
                                       step i of `num_steps(ctx)` (a round, an epoch, ...).

`jfed.driver.run` runs it. This module sits below every method family and the driver: it imports
only the data, engine, io and key modules, so a method never imports the loop that runs it. The
run's context is built here too (`make_context`, `context_of_config`): from a config, a dataset
and the seeded client partition.
"""

import dataclasses
import hashlib
import json
import pathlib
from typing import (
  Any,
  Callable,
  ClassVar,
  Dict,
  Generic,
  Iterator,
  List,
  Mapping,
  NamedTuple,
  Optional,
  Sequence,
  Tuple,
  TypeVar,
)

import jax
import ml_collections
import numpy as np

from jfed import __version__, typed_config
from jfed.data import Dataset, make_partition
from jfed.data.partitions import partition_arguments
from jfed.data.public import hold_out_train, holdout_size
from jfed.data.transforms import configure, load_configured
from jfed.engine import multihost
from jfed.engine.aggregation import AggregationConfig
from jfed.engine.attacks import AttackConfig, attacker_ids
from jfed.engine.evaluation import TrainedModel
from jfed.engine.optim import OptimizerSpec, optimizer_spec
from jfed.engine.privacy import DpConfig
from jfed.engine.server_optim import ServerOptimizerConfig
from jfed.engine.sharding import client_mesh
from jfed.errors import ConfigError
from jfed.io import Checkpointer
from jfed.io.scalars import LoggingConfig
from jfed.keys import Purpose
from jfed.workdir import array_fingerprint, atomic_write_text, jsonable

Record = Dict[str, Any]
ConfigT = TypeVar('ConfigT')
AuxT = TypeVar('AuxT')
StateT = TypeVar('StateT')

# Record fields that count as communication; their running sum is `cumulative_bytes`.
BYTE_FIELDS = ('upload_bytes', 'download_bytes', 'peer_bytes')


# ------------------------------------------------------------------------------------------------
# what a method sees
# ------------------------------------------------------------------------------------------------
# The shared keys that cannot change a stage's result: where caches go, the evaluation batch,
# the server's side of uploads (it acts after the stage), logging (`RunContext.producer`).
_NOT_STAGE_INPUTS = (
  'local_models_dir',
  'local_cvaes_dir',
  'eval_batch_size',
  'aggregation',
  'server',
  'server_optimizer',
  'logging',
)
_PRODUCER_FILE = 'producer.json'


class Federation(NamedTuple):
  """The clients' views that follow from the config alone, derived once per run (a method reads
  them; it never parses `client_models` or draws the attackers again).

  Attributes:
    specs: per client, its model spec (`client_models` cycled over the clients, or `model`).
    architectures: the distinct specs, in order of first appearance (the order of client
      groups and of their models' init keys).
    attackers: the attacking clients' global ids, sorted (empty without an attack).
  """

  specs: Tuple[str, ...]
  architectures: Tuple[str, ...]
  attackers: np.ndarray


def build_federation(run: 'RunConfig', num_clients: int, attack_key: jax.Array) -> Federation:
  """The Federation of `num_clients` clients under `run`; `attack_key` draws the attackers.

  Args:
    run: The run's typed config (`client_models`, `model`, `attack`).
    num_clients: The number of clients.
    attack_key: The PRNG key of the attackers' draw (Purpose.ATTACK).

  Returns:
    The Federation.

  Raises:
    ValueError: the attack settings do not fit the clients (`jfed.engine.attacks`).
  """
  listed = [s.strip() for s in run.client_models.split(';') if s.strip()] or [run.model.strip()]
  specs = tuple(listed[k % len(listed)] for k in range(num_clients))
  return Federation(
    specs, tuple(dict.fromkeys(specs)), attacker_ids(run.attack, num_clients, attack_key)
  )


class RunContext:
  """Everything a method needs, built once by the driver.

  Attributes:
    config: the whole resolved config (for the driver and the loggers; methods read `run`).
    run: the typed keys every method shares (`RunConfig`), parsed once from `config`.
    dataset: the loaded dataset.
    parts: one index array into `dataset.train_x` per client.
    key: the root key; methods derive theirs with `derive_key(Purpose.X, ...)`.
    mesh: a `jax.sharding.Mesh` with a 'clients' axis, or None.
    workdir: where the run writes, or None for a run in memory.
    client_transport: where client training runs when not in this process (the Flower
      bridge's `jfed.flower.transport.FlowerTransport`), or None.
    is_primary: whether this process writes the run's files (only process 0 of a run that
      spans several processes; see jfed.engine.multihost).
    federation: the clients' model specs and attackers (`Federation`).
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    dataset: Dataset,
    parts: Sequence[np.ndarray],
    key: jax.Array,
    mesh: Any = None,
    workdir: Optional[pathlib.Path] = None,
    client_transport: Any = None,
  ):
    self.config, self.dataset, self.parts = config, dataset, list(parts)
    self.run = parse_run_config(config)
    self.client_transport = client_transport
    self.key, self.mesh = key, mesh
    self.workdir = None if workdir is None else pathlib.Path(workdir)
    self.is_primary = multihost.is_primary()
    self.federation = build_federation(
      self.run, len(self.parts), self.derive_key(Purpose.ATTACK, 0)
    )
    self._memo: Dict[Tuple[str, int], Any] = {}
    self._data_digest: Optional[Tuple[str, str]] = None

  @property
  def num_clients(self) -> int:
    return len(self.parts)

  @property
  def client_sizes(self) -> np.ndarray:
    return np.array([len(p) for p in self.parts])

  def derive_key(self, purpose: Purpose, *path: int) -> jax.Array:
    key = jax.random.fold_in(self.key, int(purpose))
    for p in path:
      key = jax.random.fold_in(key, int(p))
    return key

  def output_path(self, name: str) -> Optional[pathlib.Path]:
    """Where a method writes a figure or file of its own; None for a run in memory and in the
    processes other than the primary."""
    return None if self.workdir is None or not self.is_primary else self.workdir / name

  def producer(self, name: str, settings: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """What a stage's result depends on, for a cache shared between runs: the stage, its own
    `settings`, the data (fingerprint of the clients' training split and its normalisation),
    the clients' index lists, and every shared key but those that cannot reach a stage (where
    caches and files go, the evaluation batch, the server's handling of uploads, logging)."""
    if self._data_digest is None:
      d = self.dataset
      lengths = np.asarray([len(p) for p in self.parts], np.int64)
      self._data_digest = (
        array_fingerprint(d.train_x, d.train_y),
        array_fingerprint(lengths, *[np.asarray(p, np.int64) for p in self.parts]),
      )
    run = self.run._asdict()
    for key in _NOT_STAGE_INPUTS:
      run.pop(key)
    run['dataset'] = {**run['dataset']._asdict(), 'data_dir': None}  # the fingerprint says
    return jsonable(
      {
        'stage': name,
        'settings': dict(settings or {}),
        'data': {'fingerprint': self._data_digest[0], 'normalization': self.dataset.normalization},
        'parts': self._data_digest[1],
        'run': run,
        'jfed_version': __version__,
      }
    )

  def shared_cache_dir(
    self, directory: str, name: str, settings: Optional[Mapping[str, Any]] = None
  ) -> pathlib.Path:
    """Where stage `name` of this run keeps its cache inside a shared `directory`
    (`local_models_dir`, `local_cvaes_dir`): a folder named by the digest of its `producer`, so
    runs that differ in anything the stage depends on (the seed, the partition, the data, the
    clients' optimiser, ...) never read each other's results; its `producer.json` says what
    made it.

    Args:
      directory: the shared cache directory.
      name: the stage.
      settings: the stage's own settings (`producer`).

    Returns:
      The subfolder of this run's producer (not created here).
    """
    return self._shared_cache(directory, name, settings)[0]

  def _shared_cache(
    self, directory: str, name: str, settings: Optional[Mapping[str, Any]]
  ) -> Tuple[pathlib.Path, str]:
    """`shared_cache_dir` and the producer.json text its name is the digest of."""
    text = json.dumps(self.producer(name, settings), sort_keys=True, indent=1)
    return pathlib.Path(directory) / hashlib.sha256(text.encode()).hexdigest()[:16], text

  def _open_shared_cache(
    self, directory: str, name: str, settings: Optional[Mapping[str, Any]]
  ) -> pathlib.Path:
    path, text = self._shared_cache(directory, name, settings)
    if self.is_primary and not (path / _PRODUCER_FILE).exists():
      path.mkdir(parents=True, exist_ok=True)
      atomic_write_text(path / _PRODUCER_FILE, text + '\n')
    return path

  def stage(
    self,
    name: str,
    tag: int,
    template: Any,
    compute: Callable[[], Any],
    directory: Optional[str] = None,
    max_to_keep: int = 2,
    settings: Optional[Mapping[str, Any]] = None,
  ) -> Any:
    """The result of a one-off stage, computed once per run and cached.

    Args:
      name: the stage (its checkpoints live in `<workdir>/<name>`).
      tag: what distinguishes versions of the stage (epochs trained, a round number); a cached
        result with another tag is not reused.
      template: a pytree with the result's structure, shapes and dtypes (restore target).
      compute: produces the result when no cached one exists.
      directory: a cache shared between runs (e.g. `local_models_dir`) to read and write
        instead, in the subfolder of this run's `shared_cache_dir`.
      max_to_keep: tags kept.
      settings: the stage's own settings that its result depends on beyond the run's shared
        keys (`producer`); they key a shared `directory`'s subfolder.

    Returns:
      The result, from the cache when the workdir (or `directory`) holds it.
    """
    memo_key = (directory or name, int(tag))
    if memo_key in self._memo:
      return self._memo[memo_key]
    if self.workdir is None and directory is None:
      result = compute()
    else:
      ckpt = Checkpointer(
        self._open_shared_cache(directory, name, settings) if directory else self.workdir / name,
        max_to_keep=max_to_keep,
      )
      try:
        result = None
        if int(tag) in ckpt.steps():
          result = ckpt.restore_stage(int(tag), template)
        if result is None:
          result = compute()
          ckpt.save(int(tag), result)
      finally:
        ckpt.close()
    self._memo[memo_key] = result
    return result


class Algorithm(Generic[ConfigT, AuxT, StateT]):
  """A method: a typed config and setup / init / step. Subclass, then `@register_method`.

  Class attributes:
    name: the `--method` name.
    section: the config section it reads (`config.<section>`).
    Config: a NamedTuple type of the section's keys (its defaults generate the base config).
    step_name: what a step is, for messages, metrics and plots ('round', 'epoch', 'client').
    server_round: its client models go through `jfed.methods.common.Server` (the one place
      where model-poisoning attacks rewrite uploads, `server.max_update_norm_ratio` rejects them
      and `aggregation.rule` runs); a method that aggregates in its own way (distillation,
      optimal transport, masked averaging, chains, generators, prototypes) or not at all refuses
      those settings instead of ignoring them.
    label_flip_unsupported: why a label-flipping attacker cannot run under it ('' : its clients
      train on `common.client_groups`' data, where labels are flipped, and it runs to the end).
    differential_privacy: it reads the `dp` section (DP-FedAvg's clipping and noise).
    lr_schedule: it honours `optimizer.schedule='cosine'` (one schedule across one training
      run); client optimisers restart every round, so nothing else has a run for it to span.
  """

  name: ClassVar[str] = ''
  section: ClassVar[str] = ''
  Config: ClassVar[type] = type(None)
  step_name: ClassVar[str] = 'round'
  server_round: ClassVar[bool] = False
  label_flip_unsupported: ClassVar[str] = ''
  differential_privacy: ClassVar[bool] = False
  lr_schedule: ClassVar[bool] = False

  def __init__(self, config: ConfigT):
    self.config = config

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> 'Algorithm':
    algorithm = cls(typed_config.parse(cls.Config, config.get(cls.section), cls.section))
    algorithm.validate(config)
    return algorithm

  def validate(self, config: ml_collections.ConfigDict) -> None:
    """Checks the typed config (and shared keys it depends on); raises ConfigError."""

  def num_steps(self, ctx: RunContext) -> int:
    raise NotImplementedError

  def setup(self, ctx: RunContext) -> AuxT:
    return None

  def setup_records(self, ctx: RunContext, aux: AuxT) -> List[Record]:
    """Records of the setup stages (bytes of one-off uploads, ...), written as step 0."""
    return []

  def init(self, ctx: RunContext, aux: AuxT) -> StateT:
    raise NotImplementedError

  def step(self, ctx: RunContext, aux: AuxT, state: StateT, i: int) -> Tuple[StateT, List[Record]]:
    """Step i of the method (a round, an epoch, ...): the driver checkpoints and logs what it
    returns.

    Args:
      ctx: The run context (dataset, clients, run config, stage cache).
      aux: The run-level state built in `setup` (trainers, evaluators, data).
      state: The state after step i - 1 (from `init` for i = 0).
      i: The step, from 0 to num_steps - 1.

    Returns:
      The new state (checkpointed after the step) and the step's records. The input state's
      own leaves (arrays) with no records mean the step changed nothing (FedDF after its early
      stop): the driver writes no checkpoint for it, since the previous one holds that state.
    """
    raise NotImplementedError

  def step_label(self, i: int, n: int, aux: Optional[AuxT] = None) -> str:
    """How progress lines and errors name a step.

    Args:
      i: The step (from 0).
      n: The run's steps.
      aux: The run's set-up, once there is one (FedAvg adds ε under DP); None before.

    Returns:
      The label, e.g. 'round 3/10'.
    """
    del aux
    return f'{self.step_name} {i + 1}/{n}'

  def trained_model(self, ctx: RunContext, aux: AuxT, state: StateT) -> Optional[TrainedModel]:
    """The server model a finished run leaves (`jfed.run(...).model`).

    Args:
      ctx: The run context.
      aux: The run-level state built in `setup`.
      state: The final state.

    Returns:
      The model, or None where the method ends with client models only (Local, FedProto,
      FedMD, ...) or with several server models.
    """
    del ctx, aux, state
    return None

  def final_accuracy(self, history: Sequence[Record]) -> Optional[float]:
    """The run's result: by default the last recorded test accuracy."""
    accs = [r['test_accuracy'] for r in history if r.get('test_accuracy') is not None]
    return accs[-1] if accs else None

  def summarize(
    self, ctx: RunContext, aux: AuxT, state: StateT, history: Sequence[Record]
  ) -> Dict[str, Any]:
    """The method's extras for the summary (cluster assignments, client accuracies, ...).

    Args:
      ctx: The run context (dataset, clients, run config, stage cache).
      aux: The run-level state built in `setup`.
      state: The final state.
      history: The records of every step of the run.

    Returns:
      Extra fields of summary.json.
    """
    return {}


@dataclasses.dataclass(frozen=True)
class RunSummary(Mapping):
  """The typed result of a run. Also a read-only mapping of its flat JSON form, so
  `summary['final_test_accuracy']` and `summary['<extra>']` both work."""

  method: str
  dataset: str
  step_name: str
  steps: int
  final_test_accuracy: Optional[float]
  best_test_accuracy: Optional[float]
  best_step: Optional[int]
  total_bytes: Optional[int]
  seconds: float  # compute time of every step and stage, all invocations
  seconds_this_invocation: float
  num_clients: int
  partition: str
  backend: str
  extras: Dict[str, Any] = dataclasses.field(default_factory=dict)
  environment: Dict[str, Any] = dataclasses.field(default_factory=dict)

  def as_dict(self) -> Dict[str, Any]:
    out = dict(self.extras)
    out.update(self.environment)
    for f in dataclasses.fields(self):
      if f.name not in ('extras', 'environment'):
        out[f.name] = getattr(self, f.name)
    out['extras'] = sorted(self.extras)
    return jsonable(out)

  @classmethod
  def from_dict(cls, d: Dict[str, Any]) -> 'RunSummary':
    names = {f.name for f in dataclasses.fields(cls)} - {'extras', 'environment'}
    extra_names = set(d.get('extras', []))
    return cls(
      **{n: d.get(n) for n in names},
      extras={k: d[k] for k in extra_names if k in d},
      environment={
        k: v for k, v in d.items() if k not in names and k not in extra_names and k != 'extras'
      },
    )

  def __getitem__(self, key: str) -> Any:
    return self.as_dict()[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self.as_dict())

  def __len__(self) -> int:
    return len(self.as_dict())


# ------------------------------------------------------------------------------------------------
# the run's shared settings, typed
# ------------------------------------------------------------------------------------------------
class ServerConfig(NamedTuple):
  """The `server` config section: what happens to an upload that fails validation."""

  on_invalid_upload: str = 'drop'  # 'drop': log it and exclude the client; 'fail': stop the run
  max_update_norm_ratio: float = 0.0  # > 0: reject ||θ_k − θ_global|| > ratio · ||θ_global||
  # a round whose uploads were all rejected keeps the global model (False: it fails the run)
  allow_empty_rounds: bool = False


class DatasetSpec(NamedTuple):
  """The `dataset` section."""

  name: str = 'digits'
  data_dir: str = ''  # '' : the loader's default
  # training samples held out of every client (seeded), the source 'holdout' of the servers'
  # public, distillation and generator data; every method of a comparison sets the same size
  holdout_size: int = 0
  # every split resized to image_size × image_size at load (bilinear, antialiased: torchvision's
  # Resize); 0 keeps the files' size. Co-Boosting's and FedCVAE's codes resize to 32
  image_size: int = 0
  # 'none' | 'half': what every classifier applies to its input first, the data staying in
  # [0, 1] (`jfed.data.transforms.NORMALIZATIONS`); 'half' is the [-1, 1] of Co-Boosting's code
  normalization: str = 'none'


class PartitionSpec(NamedTuple):
  """The `partition` section's keys every scheme has (the scheme's own are read by
  `partition_clients`)."""

  # iid | dirichlet (alpha, min_size) | shards (#C=k: k) | disjoint (2c/c)
  # | feddf_dirichlet (alpha) | fedcvae_dirichlet (alpha)
  scheme: str = 'dirichlet'
  num_clients: int = 5


class RunConfig(NamedTuple):
  """The keys every method shares, typed: parsed once when the context is built (`ctx.run`).

  A method reads its own section from its `Algorithm.config` and these from `ctx.run`; the
  ml_collections config stays on the context (`ctx.config`) for the driver and the loggers.
  """

  # The defaults are the base config's (jfed/configs/base.py generates it from them).
  seed: int = 0
  dataset: DatasetSpec = DatasetSpec()
  partition: PartitionSpec = PartitionSpec()
  model: str = 'cnn_mnist'  # the server's (and by default every client's) model spec
  client_models: str = ''  # 'spec;spec;...' cycled over the clients, or '' for `model`
  local_models_dir: str = ''  # '' : train the one-shot methods' local models in the workdir
  local_cvaes_dir: str = ''  # '' : train the local CVAEs (FedMHO, FedCVAE) in the workdir
  # the clients' optimiser; schedule: constant | cosine (centralized only)
  optimizer: OptimizerSpec = OptimizerSpec('sgd', 0.01, momentum=0.9)
  batch_size: int = 64
  # the clients' BatchNorm/dropout mode in local training: 'train' (every epoch), or
  # 'eval_after_first_epoch': eval mode from each local training's second epoch on, as DENSE's
  # `LocalUpdate` runs (its per-epoch test leaves the model in eval mode; FedHydra's tables)
  local_bn: str = 'train'
  eval_batch_size: int = 1000
  strategy: str = 'auto'  # the client map: one of jfed.engine.STRATEGIES
  shard: bool = False  # shard client groups over all devices ('clients' mesh axis)
  # The server side of model uploads, for every method that aggregates client models
  # (jfed/engine/aggregation.py, attacks.py and common.Server); clip_norm > 0 clips updates.
  aggregation: AggregationConfig = AggregationConfig(
    rule='mean',
    trim_fraction=0.1,
    krum_byzantine=1,
    krum_selected=1,
    geomed_iterations=100,
    geomed_smoothing=1e-6,
    clip_norm=0.0,
  )
  # the attackers are `clients` ('0,3') or a seeded `fraction` of them
  attack: AttackConfig = AttackConfig(kind='none', fraction=0.0, clients='', strength=10.0)
  server: ServerConfig = ServerConfig()
  # FedAvg/FedProx's step on the pseudo-gradient (Reddi et al. 2021; engine/server_optim.py)
  server_optimizer: ServerOptimizerConfig = ServerOptimizerConfig(
    name='fedavg', lr=1.0, momentum=0.9, b1=0.9, b2=0.99, eps=1e-3
  )
  # DP-FedAvg / FedProx (jfed/engine/privacy.py; adaptive clipping: Andrew et al. 2021)
  dp: DpConfig = DpConfig(
    enabled=False,
    noise_multiplier=1.0,
    clip_norm=1.0,
    adaptive=False,
    target_quantile=0.5,
    clip_lr=0.2,
    count_noise_fraction=0.05,
    delta=1e-5,
    local=False,
    reproducible_noise=False,
    max_epsilon=0.0,
  )
  # not part of the workdir's identity: a resumed run may change them
  logging: LoggingConfig = LoggingConfig(tensorboard=True, wandb=False, wandb_project='jfed')


def _optional(config: Any, key: str, default: Any, kind: type) -> Any:
  return typed_config.convert(config.get(key, default), kind, key)


def parse_run_config(config: ml_collections.ConfigDict) -> RunConfig:
  """The typed shared keys of `config`; ConfigError naming the first key missing or mistyped.

  Args:
    config: the whole resolved config.

  Returns:
    Its `RunConfig`.
  """
  dataset = config.get('dataset')
  if dataset is None:
    raise ConfigError("config has no section 'dataset'")
  partition = typed_config.parse(PartitionSpec, config.get('partition'), 'partition')
  log = config.get('logging', None) or {}
  return RunConfig(
    seed=typed_config.convert(config.get('seed'), int, 'seed'),
    dataset=DatasetSpec(
      typed_config.convert(dataset.get('name'), str, 'dataset.name'),
      str(dataset.get('data_dir') or ''),
      typed_config.convert(dataset.get('holdout_size', 0), int, 'dataset.holdout_size'),
      typed_config.convert(dataset.get('image_size', 0), int, 'dataset.image_size'),
      typed_config.convert(dataset.get('normalization', 'none'), str, 'dataset.normalization'),
    ),
    partition=partition,
    model=typed_config.convert(config.get('model'), str, 'model'),
    client_models=_optional(config, 'client_models', '', str),
    local_models_dir=str(config.get('local_models_dir') or ''),
    local_cvaes_dir=str(config.get('local_cvaes_dir') or ''),
    optimizer=optimizer_spec(config.get('optimizer')),
    batch_size=typed_config.convert(config.get('batch_size'), int, 'batch_size'),
    local_bn=_optional(config, 'local_bn', 'train', str),
    eval_batch_size=typed_config.convert(config.get('eval_batch_size'), int, 'eval_batch_size'),
    strategy=_optional(config, 'strategy', 'auto', str),
    shard=_optional(config, 'shard', False, bool),
    aggregation=typed_config.parse(AggregationConfig, config.get('aggregation'), 'aggregation'),
    attack=typed_config.parse(AttackConfig, config.get('attack'), 'attack'),
    server=typed_config.parse(ServerConfig, config.get('server'), 'server'),
    server_optimizer=typed_config.parse(
      ServerOptimizerConfig, config.get('server_optimizer'), 'server_optimizer'
    ),
    dp=typed_config.parse(DpConfig, config.get('dp'), 'dp'),
    # the keys only; jfed.io.scalars.logging_config checks them (and W&B) for a run that writes
    logging=LoggingConfig(
      log.get('tensorboard', True), log.get('wandb', False), log.get('wandb_project', 'jfed')
    ),
  )


# ------------------------------------------------------------------------------------------------
# the run's context from its config
# ------------------------------------------------------------------------------------------------
def partition_clients(config: ml_collections.ConfigDict, labels: np.ndarray) -> List[np.ndarray]:
  """The seeded client partition of `config.partition`."""
  p = config.partition
  kwargs = {name: p[name] for name in partition_arguments(p.scheme) if name in p}
  return make_partition(labels, p.num_clients, p.scheme, config.seed, **kwargs)


def _setup(config: ml_collections.ConfigDict) -> Tuple[int, str]:
  """The config's `dataset.image_size` and `dataset.normalization` (their defaults if unset)."""
  d = config.dataset
  return int(d.get('image_size', 0) or 0), str(d.get('normalization', 'none') or 'none')


def load_run_dataset(config: ml_collections.ConfigDict) -> Dataset:
  """The config's dataset as its run sees it: `dataset.name` from `dataset.data_dir`, resized to
  `dataset.image_size` with `dataset.normalization` recorded (cached)."""
  return load_configured(
    str(config.dataset.name), config.dataset.get('data_dir') or None, *_setup(config)
  )


def hold_out(config: ml_collections.ConfigDict, dataset: Dataset) -> Dataset:
  """`dataset` less the `dataset.holdout_size` training samples no client may hold (they go to
  `holdout_x/holdout_y`, for the server's public or distillation data); unchanged when 0."""
  size = holdout_size(config)
  if not size or dataset.holdout_x is not None:
    return dataset
  return hold_out_train(dataset, size, config.seed)


def make_context(
  config: ml_collections.ConfigDict,
  dataset: Dataset,
  parts: Sequence[np.ndarray],
  workdir=None,
  client_transport=None,
) -> RunContext:
  """The run's context over `dataset` (after `hold_out`) and `parts`; the shared keys of
  `config` are parsed here, once (`ctx.run`).

  Args:
    config: the whole resolved config.
    dataset: the dataset, its held-out samples already split off (`hold_out`).
    parts: one index array into `dataset.train_x` per client.
    workdir: where the run writes, or None for a run in memory.
    client_transport: where client training runs when not in this process, or None.

  Returns:
    The context.
  """
  if holdout_size(config) and dataset.holdout_x is None:
    raise ConfigError(
      f'dataset.holdout_size={holdout_size(config)} but the dataset given holds nothing out: '
      'build the context with jfed.driver.context_of_config, or pass jfed.driver.hold_out(config, '
      'dataset) and a partition of its training split'
    )
  mesh = client_mesh() if config.get('shard', False) and jax.device_count() > 1 else None
  key = jax.random.PRNGKey(config.seed)
  return RunContext(config, dataset, parts, key, mesh, workdir, client_transport)


def context_of_config(
  config: ml_collections.ConfigDict, dataset: Optional[Dataset] = None, **context
) -> RunContext:
  """The run's context from its config alone: the dataset (loaded unless given), the seeded
  partition, and `make_context`'s keywords (workdir, client_transport)."""
  if dataset is None:
    dataset = load_run_dataset(config)
  else:  # a dataset loaded elsewhere, at the config's size and normalisation
    dataset = configure(dataset, *_setup(config))
  dataset = hold_out(config, dataset)
  return make_context(config, dataset, partition_clients(config, dataset.train_y), **context)
