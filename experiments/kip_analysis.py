"""What KIP changes in HFLDD's distillation, per number of classes per client #C (issue 12).

    python -m experiments.kip_analysis --dataset=digits --classes_per_client=1,2,10 \
        --out=runs/kip_analysis_digits [--seeds=0,1,2] [--labels=fixed,learned] [--smoke]

For every #C and seed, with the HFLDD config of the dataset (experiments/configs/
hfldd_<dataset>.py, its `smoke` variant with --smoke; `partition.k` = #C, `seed` = the seed),
the client partition HFLDD uses (`jfed.driver.partition_clients`) and the members' KIP stage of
the method (`jfed.methods.hfldd.distill_members` with `hfldd.kip_config`, every client
distilling its own data, client i with fold_in(KIP key, i)):
- the KRR loss of KIP per iteration (mean over the clients; first / last value, a plot);
- the mean absolute pixel change of the distilled support against its initialisation (the same
  KIP program run for 0 iterations: the class-balanced raw images it starts from), in [0, 1]
  pixel units, and the share of the uint8 values that HFLDD sends that differ;
- the test accuracy (all test images) of the config's model trained with its optimiser and
  batch size, for `hfldd.rounds x hfldd.local_epochs` epochs (what a cluster head's local
  training gets over a whole run), from one initialisation and one data order, on (a) the union
  of every client's distilled set and (b) the union of the raw subsets KIP started from (the
  same images before KIP, the same number). Both go through the uint8 encoding HFLDD's members
  send (`hfldd.encode_images` / `decode_images`);
- with --labels=...,learned the same KIP with `learn_labels=True` (KIPConfig's label learning;
  the model then trains on `hfldd.kip_label_distribution` soft labels, as HFLDD's heads do),
  plus how far the labels moved.

Writes OUT/kip_analysis.md (mean ± sample std over seeds), OUT/kip_loss.png and
OUT/results.json, the latter after every finished part: rerunning the command skips what is done
(a changed setting is refused). Seeds may also run as separate commands into one OUT, one after
the other (results.json is read at the start).
"""

import json
import pathlib
import time
from typing import Any, Dict, List, Sequence

from absl import flags, logging
import numpy as np

from experiments import sweep
from experiments.seed_tables import mean_std, report_date, value_stats
from jfed.configs import hfldd_digits, hfldd_fashion_mnist
from jfed.figures import save_png

FLAGS = flags.FLAGS

CONFIGS = {'digits': hfldd_digits, 'fashion_mnist': hfldd_fashion_mnist}
LABEL_MODES = ('fixed', 'learned')

# HFLDD (Shi et al., arXiv 2409.17517) on KIP, its support/target choice and its labels (the
# only passages that bear on them).
HFLDD_QUOTES = (
  (
    'III-A',
    'the KIP method is to find a ditilled dataset that is approximate to the target dataset by '
    'minimizing the following loss function [(1)] where [λ] is a regularization parameter; [y_s] '
    'and [y_t] are the labels of [X_s] and [X_t], respectively',
  ),
  (
    'IV-A, step 4',
    'all clients, except the cluster head, perform dataset distillation to generate distilled '
    'data that approximates their local data distribution. These distilled data are sent to the '
    'cluster head.',
  ),
  (
    'VI-A4',
    'The learning rate for optimizing the distilled data is 0.004, and the maximum number of '
    'distillation iterations is 3000. In each iteration, a minibatch of 10 samples is drawn from '
    'the original dataset to compute the kernel regression loss and update the distilled data.',
  ),
  (
    'V-B',
    'transmitting each distilled data incurs a communication overhead of [b_d] (1 × 8 bits or '
    '3 × 8 bits',
  ),
  (
    'VII',
    'HFLDD relies on dataset distillation to compress local data into distilled data, which '
    'inevitably introduces information loss, particularly under highly imbalanced or '
    'long-tailed label distributions.',
  ),
)
HFLDD_READING = (
  'The paper never mentions learning the labels (only "the distilled data" is optimised, and '
  'Eq. 18 counts 8 bits per value of a distilled sample and nothing for its label), nor how the '
  'support set is initialised. Its target is "a minibatch of 10 samples drawn from the original '
  'dataset", i.e. the member\'s own local data, and the distilled data should approximate "their '
  'local data distribution". At #C=1 that makes every support and target label the same class, '
  'as in jfed. Neither choice avoids the degenerate case: there is no other class in the '
  "member's data to draw a target from, and label learning (not in the paper; KIPConfig's "
  'learn_labels, measured below) has no signal to learn from either (see "Why").'
)
WHY = (
  'With one class, every row of the support labels Y_s and of the target labels is the same '
  'centred one-hot v = e_c - 1/C, so the KRR prediction is K_ts (K_ss + λ I)^-1 Y_s = a v^T with '
  'a = K_ts (K_ss + λ I)^-1 1, and the loss is 0.5 |v|^2 / C · mean((a - 1)^2): KIP only asks '
  'the kernel regressor to reproduce the constant 1 on the target images, which real images of '
  'the same class already nearly do (and the KRR target accuracy is trivially 100%: the '
  'argmax of a v is c whenever a > 0). The loss holds no information about the other classes. '
  'The label gradient is (K_ss + λ I)^-1 K_st (a - 1) v^T / (n_t C): every row a multiple of v, '
  'so learned labels (Adam, sign-like per coordinate) move the own class by one amount and all '
  'C - 1 other classes by one common amount per support image: a sharper or uniformly smoothed '
  'one-hot label, nothing about which other class an image resembles (checked on digits, #C=1, '
  '10 clients, 40 x 300: the other nine entries of a learned row differ by at most 2e-6).'
)


def define_flags() -> None:
  """Defined only when run as a command (importing the module in tests defines no flags)."""
  flags.DEFINE_enum('dataset', None, list(CONFIGS), 'HFLDD config: experiments/configs/hfldd_*.')
  flags.DEFINE_list('classes_per_client', ['1', '2', '10'], '#C values (shard partition k).')
  # --out (results.json, kip_analysis.md, png), --seeds (partition, KIP keys, model init), --smoke
  sweep.define_flags(None, merge=False, smoke="The config's `smoke` variant (short KIP).")
  flags.DEFINE_list('labels', list(LABEL_MODES), f'KIP label modes: {", ".join(LABEL_MODES)}.')
  flags.mark_flags_as_required(['dataset', 'out'])


# ------------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------------
def analysis_config(dataset: str, classes_per_client: int, seed: int, smoke: bool = False):
  """The HFLDD config of `dataset` with #C = `classes_per_client` and `seed`."""
  c = CONFIGS[dataset].get_config('smoke' if smoke else '')
  c.partition.k = int(classes_per_client)
  c.seed = int(seed)
  # The analysis trains on the clients' own or distilled sets and reads no public set: every
  # training sample stays with the clients, as in the analyses already reported, and the
  # (unused) public source is one that needs no holdout. The config ties holdout_size to
  # hfldd.public_size by reference: unlink it rather than zero both.
  del c.dataset['holdout_size']
  c.dataset.holdout_size = 0
  c.hfldd.public = c.dataset.name
  return c


def training_epochs(config) -> int:
  """Epochs of the distilled/raw training: a cluster head's local epochs over a whole run of
  the dataset's full config (`smoke` too: its 3 rounds would leave the model at chance)."""
  h = CONFIGS[config.dataset.name].get_config('').hfldd
  return int(h.rounds * h.local_epochs)


def settings(config, smoke: bool) -> Dict[str, Any]:
  """What a results.json was computed with (a resumed OUT must match)."""
  k = config.hfldd.kip
  return {
    'dataset': config.dataset.name,
    'smoke': bool(smoke),
    'num_clients': int(config.partition.num_clients),
    'partition': config.partition.scheme,
    'kip': {key: k[key] for key in sorted(k.keys())},
    'image_dtype': config.hfldd.image_dtype,
    'model': config.model,
    'optimizer': config.optimizer.to_dict(),
    'batch_size': int(config.batch_size),
    'epochs': training_epochs(config),
  }


# ------------------------------------------------------------------------------------------------
# the measurements
# ------------------------------------------------------------------------------------------------
def pixel_change(x, x0) -> float:
  """Mean absolute pixel change |x - x0| over every value of the distilled sets."""
  return float(np.mean(np.abs(np.asarray(x, np.float64) - np.asarray(x0, np.float64))))


def sent_images(x, image_dtype: str) -> np.ndarray:
  """The images a head receives: the member's encoding (uint8) decoded back to [0, 1]."""
  from jfed.methods import hfldd  # pylint: disable=g-import-not-at-top

  return hfldd.decode_images(hfldd.encode_images(np.asarray(x), image_dtype))


def client_context(config, dataset, parts):
  """A run context in memory (no workdir) for `config`: the keys HFLDD's run derives."""
  from jfed.driver import make_context  # pylint: disable=g-import-not-at-top

  return make_context(config, dataset, parts)


def kip_config_of(config, learn_labels: bool):
  """The KIPConfig HFLDD runs for `config` (`hfldd.kip_config` of its parsed section)."""
  from jfed.methods import hfldd  # pylint: disable=g-import-not-at-top

  kip = hfldd.HFLDD.from_config(config).config.kip
  return hfldd.kip_config(kip)._replace(learn_labels=bool(learn_labels))


def distilled_sets(config, dataset, parts, learn_labels: bool):
  """HFLDD's KIP stage (`distill_members`) with every client as a member, in client order."""
  from jfed.methods import hfldd  # pylint: disable=g-import-not-at-top

  ctx = client_context(config, dataset, parts)  # a fresh context: the stage memo is per context
  return hfldd.distill_members(ctx, kip_config_of(config, learn_labels), np.arange(len(parts)))


def initial_sets(config, dataset, parts):
  """The support sets KIP starts from: its program for 0 iterations (same keys and jitter).

  Returns:
    (x [clients, S, ...] float32 in [0, 1], y [clients, S] int32): raw images of the clients, the
    class-balanced selection of `jfed.kip.init_support` (repeated copies, when a client has fewer
    images than S, carry KIP's jitter).
  """
  from jfed.data import federate  # pylint: disable=g-import-not-at-top
  from jfed.keys import Purpose  # pylint: disable=g-import-not-at-top
  from jfed.kip import kip_distill_batched  # pylint: disable=g-import-not-at-top

  ctx = client_context(config, dataset, parts)
  kcfg = kip_config_of(config, False)._replace(iterations=0)
  fed = federate(dataset.train_x, dataset.train_y, parts)
  res = kip_distill_batched(
    fed.x, fed.y, fed.sizes, kcfg, ctx.derive_key(Purpose.KIP), dataset.num_classes, mesh=ctx.mesh
  )
  return np.asarray(res.x), np.asarray(res.y)


class ModelTrainer:
  """The config's model, optimiser and batch size on one dataset; compiled once, reused."""

  def __init__(self, config, dataset, parts):
    from jfed import engine  # pylint: disable=g-import-not-at-top
    from jfed.methods import common  # pylint: disable=g-import-not-at-top

    ctx = client_context(config, dataset, parts)
    spec = common.single_architecture(ctx)
    self.module = common.build_module(spec, dataset)
    self.dataset = dataset
    self.epochs = training_epochs(config)
    # make_trainers reads only the group's module; hard and soft labels share the trainer
    self.trainer = common.make_trainers(ctx, [common.ClientGroup(spec, self.module, None, None)])[0]
    self.evaluator = engine.Evaluator(self.module, config.eval_batch_size, config.strategy)

  def test_accuracy(self, config, x: np.ndarray, y: np.ndarray) -> float:
    """Trains from `config`'s initial model on (x, y) and returns the test accuracy."""
    from jfed import engine  # pylint: disable=g-import-not-at-top
    from jfed.keys import Purpose  # pylint: disable=g-import-not-at-top
    from jfed.methods import hfldd  # pylint: disable=g-import-not-at-top

    ctx = client_context(config, self.dataset, [np.arange(len(y))])
    fed = hfldd.stack_clients([np.asarray(x, np.float32)], [np.asarray(y)])
    trainer = self.trainer
    init = engine.init_models(
      self.module, self.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, 0), 1
    )
    state = engine.init_train_state(trainer.tx, init)
    state, _ = trainer.train(state, fed, self.epochs, ctx.derive_key(Purpose.LOCAL_TRAINING, 0))
    return self.evaluator.accuracy(
      engine.take(state.model, 0), self.dataset.test_x, self.dataset.test_y
    )


def union(x: np.ndarray) -> np.ndarray:
  """[clients, S, ...] -> [clients · S, ...]."""
  x = np.asarray(x)
  return x.reshape((-1,) + x.shape[2:])


def kip_record(
  sets, x0: np.ndarray, y0: np.ndarray, image_dtype: str, learn_labels: bool
) -> Dict[str, Any]:
  """Loss curve, pixel and label changes of one KIP run (every client) from its start (x0, y0)."""
  from jfed.methods import hfldd  # pylint: disable=g-import-not-at-top

  loss = np.asarray(sets.loss, np.float64)  # [clients, iterations]
  curve = loss.mean(0)
  sent, sent0 = hfldd.encode_images(sets.x, image_dtype), hfldd.encode_images(x0, image_dtype)
  record = {
    'loss_curve': curve.tolist(),
    'loss_first': float(curve[0]),
    'loss_last': float(curve[-1]),
    'loss_ratio': float(curve[-1] / curve[0]) if curve[0] > 0 else None,
    'pixel_change': pixel_change(sets.x, x0),
    'pixel_change_sent': pixel_change(
      sent_images(sets.x, image_dtype), sent_images(x0, image_dtype)
    ),
    'sent_values_changed': float(np.mean(sent != sent0)),
    'pixels_outside_01': float(np.mean((sets.x < 0) | (sets.x > 1))),
  }
  if learn_labels:
    y_mat = np.asarray(sets.y_matrix, np.float64)
    c = y_mat.shape[-1]
    start = np.eye(c)[np.asarray(y0)] - 1.0 / c  # KIP's centred one-hot labels
    record['label_change'] = float(np.mean(np.abs(y_mat - start)))
    record['label_argmax_changed'] = float(np.mean(np.asarray(sets.y) != np.asarray(y0)))
    dist = hfldd.kip_label_distribution(y_mat.reshape(-1, c))
    record['soft_label_max_mean'] = float(dist.max(-1).mean())
  return record


# ------------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------------
def analyse(
  dataset_name: str,
  k: int,
  seed: int,
  smoke: bool,
  labels: Sequence[str],
  record: Dict[str, Any],
  dataset,
  trainer: ModelTrainer,
  save,
) -> None:
  """Fills `record` (results[#C][seed]) with the parts not done yet, saving after each."""
  from jfed.driver import partition_clients  # pylint: disable=g-import-not-at-top
  from jfed.methods import hfldd  # pylint: disable=g-import-not-at-top

  config = analysis_config(dataset_name, k, seed, smoke)
  todo = [m for m in ('raw', *labels) if m not in record]
  if not todo:
    return
  parts = partition_clients(config, dataset.train_y)
  record['client_sizes'] = [len(p) for p in parts]
  record['client_classes'] = [int(len(np.unique(dataset.train_y[p]))) for p in parts]
  image_dtype = config.hfldd.image_dtype
  t = time.time()
  x0, y0 = initial_sets(config, dataset, parts)
  init_seconds = time.time() - t
  for mode in todo:
    print(f'=== #C={k} seed={seed} {mode}', flush=True)
    t = time.time()
    if mode == 'raw':
      acc = trainer.test_accuracy(config, sent_images(union(x0), image_dtype), union(y0))
      record['raw'] = {'test_accuracy': acc, 'seconds': time.time() - t + init_seconds}
    else:
      learn = mode == 'learned'
      sets = distilled_sets(config, dataset, parts, learn)
      kip_seconds = time.time() - t
      out = kip_record(sets, x0, y0, image_dtype, learn)
      labels_ = hfldd.kip_label_distribution(union(sets.y_matrix)) if learn else union(sets.y)
      out['test_accuracy'] = trainer.test_accuracy(
        config, sent_images(union(sets.x), image_dtype), labels_
      )
      out['kip_seconds'] = kip_seconds
      out['seconds'] = time.time() - t
      record[mode] = out
    print(
      f'    test accuracy {record[mode]["test_accuracy"]:.4f}'
      + (
        f', KRR loss {record[mode]["loss_first"]:.3g} -> {record[mode]["loss_last"]:.3g}, '
        f'pixel change {record[mode]["pixel_change"]:.4f}'
        if mode != 'raw'
        else ''
      )
      + f' ({record[mode]["seconds"]:.0f} s)',
      flush=True,
    )
    save()


def _values(results, k: int, mode: str, key: str) -> List[float]:
  return [
    r[mode][key]
    for r in results.get(str(k), {}).values()
    if isinstance(r.get(mode), dict) and r[mode].get(key) is not None
  ]


def _paired(results, k: int, mode: str) -> List[float]:
  """Per seed: test accuracy on distilled minus on the raw subset."""
  return [
    r[mode]['test_accuracy'] - r['raw']['test_accuracy']
    for r in results.get(str(k), {}).values()
    if 'raw' in r and mode in r
  ]


def _sci(values: Sequence[float]) -> str:
  if not len(values):
    return '—'
  m, s = value_stats(values)
  return f'{m:.2e} ± {s:.1e}'


def _num(values: Sequence[float], digits: int = 4) -> str:
  return mean_std(values, 1.0, digits) or '—'


def render(base_config, results: Dict, plan: Dict, meta: Dict) -> str:
  c, h = base_config, base_config.hfldd
  kip = h.kip
  lines = [
    f'# What KIP changes in HFLDD: {c.dataset.name}',
    '',
    f'Backend {meta["backend"]}, jax {meta["jax_version"]}, {meta["date"]}; commands: '
    + '; '.join(f'`{command}`' for command in meta['commands'])
    + '.',
    f'Config experiments/configs/hfldd_{c.dataset.name}.py'
    + (' (smoke)' if meta['smoke'] else '')
    + f': {c.partition.num_clients} clients, NIID-Bench shards with #C classes per client '
    f"(the partition HFLDD uses for that seed); every client distils its own data with HFLDD's "
    f'KIP stage: {kip.support_size} images per client × {kip.iterations} iterations, lr '
    f'{kip.lr}, target batch {kip.target_batch} of its own images, {kip.kernel} (depth '
    f'{kip.depth}), reg {kip.reg}, {"float64" if kip.x64 else "float32"}. Training: '
    f'{c.model}, {c.optimizer.name} lr {c.optimizer.lr} momentum {c.optimizer.momentum}, '
    f'batch {c.batch_size}, {training_epochs(c)} epochs (hfldd.rounds × local_epochs of the full '
    'config), one '
    'initialisation and data order per seed for every training set; test accuracy on all test '
    'images. Images go through the uint8 encoding members send.',
    '',
    "- distilled: the union of every client's KIP output "
    f'({c.partition.num_clients} × {kip.support_size} images); raw subset: the union of the '
    'images KIP started from (same images before KIP, same number, one-hot labels).',
    "- KRR loss: mean over the clients of the loss on the step's target batch, at the first and "
    'the last iteration. Pixel change: mean |x_KIP - x_init| over all values, [0, 1] pixel '
    'units (one uint8 step = 0.0039); "as sent": after uint8 quantisation, and the share of sent '
    "uint8 values that differ from the raw subset's.",
    '- learned labels: KIPConfig(learn_labels=True); the model trains on '
    "hfldd.kip_label_distribution soft labels, as HFLDD's heads do. Label change: mean "
    '|Y_s - Y_s,init| of the centred one-hot matrix.',
    '',
    'Mean ± sample std over seeds (n = seeds).',
    '',
    '| #C | KIP labels | n | KRR loss, first | KRR loss, last | last / first | pixel change '
    '| pixel change as sent | sent values changed | test acc. distilled (%) | test acc. raw '
    'subset (%) | distilled − raw (points) | label change |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for k in plan['classes_per_client']:
    for mode in plan['labels']:
      n = len(_values(results, k, mode, 'test_accuracy'))
      if not n:
        continue
      lines.append(
        f'| {k} | {mode} | {n} | {_sci(_values(results, k, mode, "loss_first"))} | '
        f'{_sci(_values(results, k, mode, "loss_last"))} | '
        f'{_num(_values(results, k, mode, "loss_ratio"), 3)} | '
        f'{_num(_values(results, k, mode, "pixel_change"))} | '
        f'{_num(_values(results, k, mode, "pixel_change_sent"))} | '
        f'{mean_std(_values(results, k, mode, "sent_values_changed"), 100.0, 1) or "—"}% | '
        f'{mean_std(_values(results, k, mode, "test_accuracy")) or "—"} | '
        f'{mean_std(_values(results, k, "raw", "test_accuracy")) or "—"} | '
        f'{mean_std(_paired(results, k, mode)) or "—"} | '
        + (_num(_values(results, k, mode, 'label_change')) if mode == 'learned' else '—')
        + ' |'
      )
  seconds = [
    r[m]['kip_seconds']
    for per_seed in results.values()
    for r in per_seed.values()
    for m in LABEL_MODES
    if m in r
  ]
  if seconds:
    lines += [
      '',
      f'KIP time per run (all clients, one jitted program, compilation included): '
      f'{np.mean(seconds):.0f} s mean, {np.max(seconds):.0f} s max.',
    ]
  lines += [
    '',
    '## Why #C=1 is degenerate',
    '',
    WHY,
    '',
    '## HFLDD (Shi et al., arXiv 2409.17517) on label learning and the support/target choice',
    '',
  ]
  lines += [f'- §{where}: "{text}"' for where, text in HFLDD_QUOTES]
  lines += ['', HFLDD_READING, '', 'Loss curves: kip_loss.png; every number: results.json.']
  return '\n'.join(lines) + '\n'


def plot(path: pathlib.Path, results: Dict, plan: Dict, title: str) -> None:
  """KRR loss per iteration (log scale) and relative to its first value, per #C and label mode."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(10, 3.8), dpi=120)
  FigureCanvasAgg(fig)
  axes = [fig.add_subplot(1, 2, j + 1) for j in range(2)]
  for i, k in enumerate(plan['classes_per_client']):
    for mode in plan['labels']:
      curves = [np.asarray(c) for c in _values(results, k, mode, 'loss_curve')]
      if not curves:
        continue
      curves = np.stack(curves)  # [seeds, iterations]
      style = '-' if mode == 'fixed' else '--'
      label = f'#C={k}, {mode} labels (n={len(curves)})'
      for ax, ys in ((axes[0], curves), (axes[1], curves / curves[:, :1])):
        mean = ys.mean(0)
        x = np.arange(1, len(mean) + 1)
        ax.plot(x, mean, style, color=f'C{i}', label=label, linewidth=1)
        if len(ys) > 1:
          lo, hi = ys.min(0), ys.max(0)
          ax.fill_between(x, lo, hi, color=f'C{i}', alpha=0.15, linewidth=0)
  for ax, ylabel in zip(axes, ('KRR loss (mean over clients)', 'loss / loss at iteration 1')):
    ax.set_yscale('log')
    ax.set_xlabel('KIP iteration')
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which='both')
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(fontsize=7)
  fig.suptitle(f'{title}: mean over seeds (band: min-max)', fontsize=10)
  fig.tight_layout()
  save_png(fig, path)


def run_analysis(
  dataset_name: str,
  classes_per_client: Sequence[int],
  out: pathlib.Path,
  seeds: Sequence[int] = (0, 1, 2),
  labels: Sequence[str] = LABEL_MODES,
  smoke: bool = False,
  command: str = '',
) -> str:
  """Runs every (#C, seed) part not in OUT/results.json yet; rewrites results.json,
  kip_analysis.md and kip_loss.png after each; returns the markdown."""
  import jax  # pylint: disable=g-import-not-at-top

  from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top
  from jfed.driver import partition_clients  # pylint: disable=g-import-not-at-top
  from jfed.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from jfed.workdir import atomic_write_text, write_json  # pylint: disable=g-import-not-at-top

  if dataset_name not in CONFIGS:
    raise ConfigError(f'--dataset: {dataset_name!r}; valid: {", ".join(CONFIGS)}')
  unknown = [m for m in labels if m not in LABEL_MODES]
  if unknown:
    raise ConfigError(f'--labels: unknown {unknown}; valid: {", ".join(LABEL_MODES)}')
  classes_per_client = [int(k) for k in classes_per_client]
  base = analysis_config(dataset_name, classes_per_client[0], 0, smoke)
  mine = settings(base, smoke)
  out.mkdir(parents=True, exist_ok=True)
  results_path = out / 'results.json'
  results: Dict[str, Dict[str, Dict[str, Any]]] = {}
  commands = []
  if results_path.exists():
    saved = json.loads(results_path.read_text())
    if saved['meta']['settings'] != json.loads(json.dumps(mine)):
      raise ConfigError(
        f'{results_path} was computed with other settings ({saved["meta"]["settings"]}); '
        'use another --out'
      )
    results = saved['results']
    commands = saved['meta'].get('commands', [])
  command = command or f'python -m experiments.kip_analysis --dataset={dataset_name}'
  if command not in commands:
    commands.append(command)
  meta = {
    'backend': jax.default_backend(),
    'jax_version': jax.__version__,
    'date': report_date(),
    'commands': commands,
    'smoke': bool(smoke),
    'settings': mine,
  }
  plan = {'classes_per_client': classes_per_client, 'labels': list(labels)}
  dataset = load_dataset(base.dataset.name, base.dataset.get('data_dir') or None)
  trainer = ModelTrainer(base, dataset, partition_clients(base, dataset.train_y))

  def save():
    # the tables show every #C and label mode of OUT, this command's and earlier ones'
    plan['classes_per_client'] = sorted({*classes_per_client, *(int(k) for k in results)})
    plan['labels'] = [
      m
      for m in LABEL_MODES
      if m in labels or any(m in r for s in results.values() for r in s.values())
    ]
    write_json(results_path, {'meta': meta, 'results': results})
    atomic_write_text(out / 'kip_analysis.md', render(base, results, plan, meta))
    plot(out / 'kip_loss.png', results, plan, f'KIP in HFLDD, {base.dataset.name}')

  for seed in seeds:
    for k in classes_per_client:
      record = results.setdefault(str(k), {}).setdefault(str(int(seed)), {})
      analyse(dataset_name, k, int(seed), smoke, labels, record, dataset, trainer, save)
  save()
  return (out / 'kip_analysis.md').read_text()


def main(argv):
  import sys  # pylint: disable=g-import-not-at-top

  from jfed.engine.compiles import use_persistent_cache  # pylint: disable=g-import-not-at-top

  del argv
  logging.set_verbosity(logging.WARNING)
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  use_persistent_cache(str(out / 'compilation_cache'), min_compile_seconds=0.2)
  command = 'python -m experiments.kip_analysis ' + ' '.join(sys.argv[1:])
  print(
    run_analysis(
      FLAGS.dataset,
      FLAGS.classes_per_client,
      out,
      [int(s) for s in FLAGS.seeds],
      FLAGS.labels,
      FLAGS.smoke,
      command,
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)
