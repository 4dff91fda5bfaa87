"""FedHydra's mechanism stage by stage: where its student falls below one-shot FedAvg.

FedHydra (Bai, Song, Wu et al., "FedHydra: a unified, data-free one-shot federated learning
framework", arXiv 2410.21119, KDD'25) distils the clients' models into a student through model
stratification (MS) and stratified aggregation (SA). This study runs FedHydra through its
registered Algorithm (setup, init, one `step` per distillation epoch) and after every epoch
measures what each stage hands to the next:

* MS: U_r and U_c against the partition's class ownership (each class's share of the clients'
  samples, each client's share of its classes).
* the pool: its class balance as it grows, and for the images the epoch added, per generator
  step t, how strongly the teacher SA routes them to (the owner of their label, `argmax_k U_r`)
  calls them their label, and whether a reference classifier trained on the clients' pooled
  real data (a diagnostic only, never used by the method) sees the label in them.
* the KD targets: SA against the plain mean-logit ensemble on the pool (argmax agreement, how
  often each equals the stored label, entropy), and SA's logit scale.
* the student: test accuracy each epoch (eval-mode BatchNorm, as scored) and with BatchNorm on
  each test batch's own statistics (whether its running statistics, accumulated on synthetic
  images, are what fails), how many classes it predicts, and how well it fits the pool.
* the baselines of the same local models: one-shot FedAvg, the mean-logit ensemble, the clients.

    python -m experiments.fedhydra_mechanism \
        --config=experiments/configs/fedhydra_fashion_mnist.py:mechanism \
        --partitions=dir0.5,dir0.1,2cc --train_size=12000 --out=docs/results/fedhydra_mechanism

(`--config=experiments/configs/fedhydra_digits.py:quick,mechanism` on digits; the config's
`partition` is replaced by each of `--partitions`; `--config.fedhydra.epochs=30` and the like
override it, as for every experiment. The results of docs/results/ ran with the same settings
given as separate flags: `--dataset`, `--local_epochs=5 --epochs=15 --T_G=10 ...`.)

Writes OUT.json (every number) and OUT.md (the tables). `--variants` runs FedHydra variants on
the same local models and MS (each a comma-free list of `field=value` overrides of
`config.fedhydra` joined by '+', e.g. `keep_best:synthesis_keep=best`).
"""

import functools
import hashlib
import json
import pathlib
import time
from typing import Any, Dict, List

from absl import app, flags
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

from jfed import driver, engine
from jfed.api import load_run_dataset
from jfed.data import class_count_table
from jfed.data.datasets import Dataset
from jfed.distill import TeacherGroup, stratified_aggregation
from jfed.distill.ensemble import teacher_outputs
from jfed.distill.pool import pool_gather, pool_size
from jfed.errors import ConfigError
from jfed.methods import common

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags (defined when it runs, so that importing the module defines none)."""
  config_flags.DEFINE_config_file(
    'config',
    'experiments/configs/fedhydra_fashion_mnist.py:mechanism',
    'A FedHydra config file (FILE[:words]); its partition is replaced by each of --partitions',
  )
  flags.DEFINE_list('partitions', ['dir0.5', 'dir0.1', '2cc'], 'dir<alpha> | 2cc')
  flags.DEFINE_integer('train_size', 0, 'use the first N training images (0: all)')
  flags.DEFINE_list('variants', ['default:'], 'name:field=value+field=value (config.fedhydra)')
  flags.DEFINE_integer('judge_epochs', 2, 'epochs of the reference classifier on real data')
  flags.DEFINE_string('out', 'docs/results/fedhydra_mechanism', 'output path stem (.json, .md)')
  flags.DEFINE_string('local_models_root', '/tmp/fedhydra_mechanism_local', 'local models cache')
  flags.DEFINE_list('merge', [], 'OUT.json files of runs to merge into --out (runs nothing else)')


def partition_config(base: ml_collections.ConfigDict, partition: str) -> ml_collections.ConfigDict:
  """`base` with the partition of a --partitions cell: 'dir<alpha>' (Dirichlet) or '2cc' (each
  client owns two whole classes: FedHydra's 2c/c)."""
  c = ml_collections.ConfigDict(base.to_dict())
  if partition == '2cc':
    c.partition.scheme = 'disjoint'
  elif partition.startswith('dir'):
    c.partition.scheme = 'dirichlet'
    try:
      c.partition.alpha = float(partition[3:])
    except ValueError:
      raise ConfigError(f'--partitions: {partition!r} is not dir<alpha> or 2cc') from None
  else:
    raise ConfigError(f'--partitions: {partition!r} is not dir<alpha> or 2cc')
  return c


def parse_variant(text: str):
  name, _, spec = text.partition(':')
  overrides = {}
  for item in filter(None, spec.split('+')):
    k, _, v = item.partition('=')
    try:
      overrides[k] = json.loads(v)
    except json.JSONDecodeError:
      overrides[k] = v
  return name, overrides


@functools.partial(jax.jit, static_argnums=0)
def _per_client(modules, states, x):
  groups = [TeacherGroup(m, s) for m, s in zip(modules, states)]
  return teacher_outputs(groups, x)[0]


def per_client_logits(teachers, x, chunk=1000) -> np.ndarray:
  modules = tuple(t.module for t in teachers)
  states = tuple(t.states for t in teachers)
  out = [
    np.asarray(_per_client(modules, states, jnp.asarray(x[i : i + chunk])))
    for i in range(0, len(x), chunk)
  ]
  return np.concatenate(out, 1)


def softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def entropy(p):
  return float(np.mean(-np.sum(p * np.log(np.clip(p, 1e-12, None)), -1)))


def train_judge(dataset: Dataset, parts, epochs: int, seed: int):
  """A CNN trained on the clients' pooled real images: a diagnostic reader of synthetic images."""
  module = common.build_module('cnn_mnist', dataset)
  model = engine.init_model(module, dataset.input_shape, jax.random.PRNGKey(seed + 1000))
  idx = np.concatenate(parts)
  x, y = dataset.train_x[idx], dataset.train_y[idx]
  tx = optax.sgd(0.01, momentum=0.9)
  opt = tx.init(model.params)

  @jax.jit
  def step(params, bs, opt, xb, yb):
    def loss_fn(p):
      logits, upd = module.apply(
        {'params': p, 'batch_stats': bs}, xb, train=True, mutable=['batch_stats']
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), upd

    (_, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), upd['batch_stats'], opt

  rng = np.random.default_rng(seed)
  params, bs = model.params, model.batch_stats
  for _ in range(epochs):
    perm = rng.permutation(len(x))
    for b in range(len(x) // 128):
      j = perm[b * 128 : (b + 1) * 128]
      params, bs, opt = step(params, bs, opt, jnp.asarray(x[j]), jnp.asarray(y[j]))
  judge = engine.ModelState(params, bs)
  ev = engine.Evaluator(module, 1000, 'auto')
  return module, judge, ev


def batch_bn_accuracy(module, model, x, y, batch=1000) -> float:
  """Accuracy with BatchNorm on each test batch's own statistics (train-mode BN, no update kept)."""
  fn = jax.jit(
    lambda p, bs, xb: module.apply(
      {'params': p, 'batch_stats': bs}, xb, train=True, mutable=['batch_stats']
    )[0]
  )
  hits = 0
  for i in range(0, len(x), batch):
    hits += int(
      np.sum(
        np.argmax(np.asarray(fn(model.params, model.batch_stats, x[i : i + batch])), -1)
        == y[i : i + batch]
      )
    )
  return hits / len(x)


def ms_against_ownership(U_r, U_c, counts) -> Dict[str, Any]:
  """U_r [c, m] against each class's sample shares over clients, U_c against each client's
  class shares; counts [m, c]."""
  counts = np.asarray(counts, np.float64)
  class_share = (counts / np.maximum(counts.sum(0, keepdims=True), 1)).T  # [c, m] rows sum 1
  client_share = (counts / np.maximum(counts.sum(1, keepdims=True), 1)).T  # [c, m] cols sum 1
  U_r, U_c = np.asarray(U_r), np.asarray(U_c)
  return {
    'U_r_argmax_is_largest_owner': float(np.mean(U_r.argmax(1) == class_share.argmax(1))),
    'U_r_tv_to_class_share': float(np.mean(0.5 * np.abs(U_r - class_share).sum(1))),
    'U_r_weight_on_non_owners': float(np.mean(np.sum(U_r * (class_share == 0), 1))),
    'U_c_tv_to_client_share': float(np.mean(0.5 * np.abs(U_c - client_share).sum(0))),
    'U_c_weight_on_unheld_classes': float(np.mean(np.sum(U_c * (client_share == 0), 0))),
  }


def epoch_diagnostics(aux, rd, state, record, judge, dataset, prev_count) -> Dict[str, Any]:
  s = aux.settings
  C = dataset.num_classes
  n = int(pool_size(state.pool))
  x, y = pool_gather(state.pool, jnp.arange(n))
  x, y = np.asarray(x), np.asarray(y)
  P = per_client_logits(rd.teachers, x)  # [K, n, C]
  ae = P.mean(0)
  if rd.data is None:  # aggregation='ae': no MS; the target is the mean-logit ensemble
    sa, owner = ae, np.zeros(C, int)
  else:
    U_r, U_c = (np.asarray(a) for a in rd.data.sa)
    sa = np.asarray(stratified_aggregation(jnp.asarray(P), U_r, U_c, jnp.asarray(y)))
    owner = U_r.argmax(1)  # [c]
  hist = np.bincount(y, minlength=C)
  owner_logits = P[owner[y], np.arange(n)]  # [n, C]
  judge_module, judge_model, judge_ev = judge
  judge_pred = np.argmax(judge_ev.logits(judge_model, x), -1)
  # the images this epoch added, by generator step t (keep='all': step-major blocks of B)
  new = np.arange(prev_count, n)
  B = s.synthesis.batch_size
  steps = max(1, len(new) // B)
  per_step = []
  for t in range(steps):
    j = new[t * B : (t + 1) * B]
    per_step.append(
      {
        'owner_p_label': float(np.mean(softmax(owner_logits[j])[np.arange(len(j)), y[j]])),
        'sa_p_label': float(np.mean(softmax(sa[j])[np.arange(len(j)), y[j]])),
        'judge_eq_label': float(np.mean(judge_pred[j] == y[j])),
      }
    )
  student = state.student.model
  s_pool = np.argmax(aux.evaluator.logits(student, x), -1)
  test_pred = np.argmax(aux.evaluator.logits(student, aux.eval_x), -1)
  pred_hist = np.bincount(test_pred, minlength=C) / len(test_pred)
  return {
    'epoch': record['epoch'],
    'test_accuracy': record['test_accuracy'],
    'test_accuracy_batch_bn': batch_bn_accuracy(
      aux.student_module, student, aux.eval_x, np.asarray(aux.eval_y)
    ),
    'classes_predicted_over_1pct': int(np.sum(pred_hist > 0.01)),
    'test_pred_max_share': float(pred_hist.max()),
    'pool_size': n,
    'pool_min_max_class': [int(hist.min()), int(hist.max())],
    'pool_sa_argmax_eq_label': float(np.mean(sa.argmax(1) == y)),
    'pool_ae_argmax_eq_label': float(np.mean(ae.argmax(1) == y)),
    'pool_sa_ae_agree': float(np.mean(sa.argmax(1) == ae.argmax(1))),
    'pool_judge_eq_label': float(np.mean(judge_pred == y)),
    'pool_judge_eq_sa': float(np.mean(judge_pred == sa.argmax(1))),
    'pool_judge_eq_ae': float(np.mean(judge_pred == ae.argmax(1))),
    'pool_sa_entropy': entropy(softmax(sa)),
    'pool_ae_entropy': entropy(softmax(ae)),
    'pool_sa_logit_range': float(np.mean(sa.max(1) - sa.min(1))),
    'pool_ae_logit_range': float(np.mean(ae.max(1) - ae.min(1))),
    'student_fits_sa_on_pool': float(np.mean(s_pool == sa.argmax(1))),
    'new_by_generator_step': per_step,
    **{k: record.get(k) for k in ('gen_oh', 'gen_bn', 'gen_adv', 'kd_loss', 'kd_steps')},
  }


def local_models_key(config: ml_collections.ConfigDict) -> str:
  """What the cached local models depend on beyond dataset, partition and seed: the clients'
  models, optimiser, batch and local epochs (a short digest)."""
  keys = ('model', 'client_models', 'optimizer', 'batch_size')
  what = {k: config.get(k) for k in keys} | {'epochs': config.fedhydra.local_epochs}
  text = json.dumps(ml_collections.ConfigDict(what).to_dict(), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:10]


def run_partition(base, dataset, partition, variants) -> Dict[str, Any]:
  config = partition_config(base, partition)
  cache = (
    pathlib.Path(FLAGS.local_models_root)
    / f'{config.dataset.name}_{FLAGS.train_size}'
    / f'{partition}_seed{config.seed}_E{config.fedhydra.local_epochs}_{local_models_key(config)}'
  )
  config.local_models_dir = str(cache / 'local_models')
  ctx = driver.context_of_config(config, dataset)
  C = dataset.num_classes
  counts = class_count_table(ctx.dataset.train_y, ctx.parts, C)
  t0 = time.time()
  judge = train_judge(ctx.dataset, ctx.parts, FLAGS.judge_epochs, config.seed)
  out: Dict[str, Any] = {
    'partition': partition,
    'class_counts': counts.tolist(),
    'judge_test_accuracy': judge[2].accuracy(judge[1], ctx.dataset.test_x, ctx.dataset.test_y),
    'variants': {},
  }
  print(
    f'[{partition}] judge {out["judge_test_accuracy"]:.4f} in {time.time() - t0:.0f}s', flush=True
  )
  for text in variants:
    name, overrides = parse_variant(text)
    vc = config.copy_and_resolve_references()
    for k, v in overrides.items():
      vc.fedhydra[k] = v
    algo = driver.build_algorithm('fedhydra', vc)
    t0 = time.time()
    aux = algo.setup(ctx)
    rd = aux.round_cache[1]
    local = rd.local
    g = local.groups[0]
    fedavg = engine.weighted_average(local.models[0], g.fed.sizes)
    client_logits = common.client_test_logits(ctx, local)
    test_y = np.asarray(ctx.dataset.test_y)
    P_test = np.asarray(client_logits)
    v: Dict[str, Any] = {
      'overrides': overrides,
      'fedavg_test_accuracy': aux.evaluator.accuracy(fedavg, ctx.dataset.test_x, test_y),
      'ensemble_test_accuracy': float(np.mean(P_test.mean(0).argmax(1) == test_y)),
      'client_test_accuracy': common.accuracy_of_logits(P_test, test_y).tolist(),
    }
    if rd.data is not None:
      U_r, U_c = (np.asarray(a) for a in rd.data.sa)
      sa_true = np.asarray(
        stratified_aggregation(jnp.asarray(P_test), U_r, U_c, jnp.asarray(test_y))
      )
      v.update(
        {
          'U_r': np.asarray(rd.data.ms.U_r).round(4).tolist(),
          'ms': ms_against_ownership(rd.data.ms.U_r, rd.data.ms.U_c, counts),
          # SA routed by the TRUE label: how good SA's targets are on real images
          'sa_true_label_test_accuracy': float(np.mean(sa_true.argmax(1) == test_y)),
        }
      )
    print(
      f'[{partition}/{name}] setup {time.time() - t0:.0f}s fedavg '
      f'{v["fedavg_test_accuracy"]:.4f} ensemble {v["ensemble_test_accuracy"]:.4f} '
      f'ms {v.get("ms")}',
      flush=True,
    )
    state = algo.init(ctx, aux)
    epochs, prev = [], 0
    for i in range(algo.num_steps(ctx)):
      t1 = time.time()
      state, recs = algo.step(ctx, aux, state, i)
      d = epoch_diagnostics(aux, rd, state, recs[0], judge, ctx.dataset, prev)
      prev = d['pool_size'] if vc.fedhydra.kd_data == 'pool' else 0
      epochs.append(d)
      print(
        f'[{partition}/{name}] epoch {i + 1}: acc {d["test_accuracy"]:.4f} '
        f'(batch-BN {d["test_accuracy_batch_bn"]:.4f}) classes {d["classes_predicted_over_1pct"]}'
        f' pool {d["pool_size"]} sa=y {d["pool_sa_argmax_eq_label"]:.3f} '
        f'judge=y {d["pool_judge_eq_label"]:.3f} judge=sa {d["pool_judge_eq_sa"]:.3f} '
        f'first/last step owner p(y) {d["new_by_generator_step"][0]["owner_p_label"]:.3f}/'
        f'{d["new_by_generator_step"][-1]["owner_p_label"]:.3f} ({time.time() - t1:.0f}s)',
        flush=True,
      )
    acc = [e['test_accuracy'] for e in epochs]
    v.update(
      {
        'epochs': epochs,
        'final': acc[-1],
        'best': max(acc),
        'best_epoch': int(np.argmax(acc)) + 1,
        'seconds': time.time() - t0,
      }
    )
    out['variants'][name] = v
  return out


def markdown(results: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
  lines = [
    '# FedHydra mechanism study',
    '',
    'Commands: ' + '; '.join(f'`{c}`' for c in meta.get('commands', [meta['command']])),
    f'backend={meta["backend"]}, jax {meta["jax"]}.',
    '',
    '| partition | variant | FedAvg | ensemble | SA (true label) | final | best (epoch) | '
    'batch-BN final | U_r→owner | U_r on non-owners |',
    '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for r in results:
    for name, v in r['variants'].items():
      ms = v.get('ms', {})
      lines.append(
        f'| {r["partition"]} | {name} | {100 * v["fedavg_test_accuracy"]:.2f} | '
        f'{100 * v["ensemble_test_accuracy"]:.2f} | '
        f'{100 * v.get("sa_true_label_test_accuracy", float("nan")):.2f} | '
        f'{100 * v["final"]:.2f} | {100 * v["best"]:.2f} ({v["best_epoch"]}) | '
        f'{100 * v["epochs"][-1]["test_accuracy_batch_bn"]:.2f} | '
        f'{ms.get("U_r_argmax_is_largest_owner", float("nan")):.2f} | '
        f'{ms.get("U_r_weight_on_non_owners", float("nan")):.3f} |'
      )
  for r in results:
    for name, v in r['variants'].items():
      lines += [
        '',
        f'## {r["partition"]} / {name} '
        f'(judge test accuracy {100 * r["judge_test_accuracy"]:.1f} %)',
        '',
        '| epoch | acc | batch-BN acc | classes | pool | min/max class | SA=y | AE=y | SA=AE | '
        'judge=y | judge=SA | H(SA) | H(AE) | fit | owner p(y) t=1 / last | judge=y t=1 / last |',
        '|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|',
      ]
      for e in v['epochs']:
        st = e['new_by_generator_step']
        lines.append(
          f'| {e["epoch"]} | {100 * e["test_accuracy"]:.1f} | '
          f'{100 * e["test_accuracy_batch_bn"]:.1f} | {e["classes_predicted_over_1pct"]} | '
          f'{e["pool_size"]} | '
          f'{e["pool_min_max_class"][0]}/{e["pool_min_max_class"][1]} | '
          f'{e["pool_sa_argmax_eq_label"]:.2f} | {e["pool_ae_argmax_eq_label"]:.2f} | '
          f'{e["pool_sa_ae_agree"]:.2f} | {e["pool_judge_eq_label"]:.2f} | '
          f'{e["pool_judge_eq_sa"]:.2f} | {e["pool_sa_entropy"]:.2f} | '
          f'{e["pool_ae_entropy"]:.2f} | '
          f'{e["student_fits_sa_on_pool"]:.2f} | {st[0]["owner_p_label"]:.2f} / '
          f'{st[-1]["owner_p_label"]:.2f} | {st[0]["judge_eq_label"]:.2f} / '
          f'{st[-1]["judge_eq_label"]:.2f} |'
        )
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  import sys  # pylint: disable=g-import-not-at-top

  from absl import logging  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)

  base = FLAGS.config
  for partition in FLAGS.partitions:  # a bad cell is refused before anything runs
    try:
      partition_config(base, partition)
    except ConfigError as e:
      raise app.UsageError(str(e)) from None
  dataset = load_run_dataset(base)
  if FLAGS.train_size:
    dataset = dataset._replace(
      train_x=dataset.train_x[: FLAGS.train_size], train_y=dataset.train_y[: FLAGS.train_size]
    )
  meta = {
    'command': 'python -m experiments.fedhydra_mechanism ' + ' '.join(sys.argv[1:]),
    'backend': jax.default_backend(),
    'jax': jax.__version__,
  }
  out = pathlib.Path(FLAGS.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  if FLAGS.merge:  # partitions run as separate processes, one table
    runs = [json.loads(pathlib.Path(f).read_text()) for f in FLAGS.merge]
    merged = {'meta': {**runs[0]['meta'], 'commands': [r['meta']['command'] for r in runs]}}
    merged['results'] = [res for r in runs for res in r['results']]
    out.with_suffix('.json').write_text(json.dumps(merged, indent=1))
    out.with_suffix('.md').write_text(markdown(merged['results'], merged['meta']))
    return
  results = []
  for p in FLAGS.partitions:
    results.append(run_partition(base, dataset, p, FLAGS.variants))
    out.with_suffix('.json').write_text(json.dumps({'meta': meta, 'results': results}, indent=1))
    out.with_suffix('.md').write_text(markdown(results, meta))


if __name__ == '__main__':
  define_flags()
  app.run(main)
