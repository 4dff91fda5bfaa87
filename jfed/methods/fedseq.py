"""FedSeq (Zaccone et al.; RickZack/FedSeq, reference-code.md §9.6): superclients trained
sequentially, then FedAvg over superclients.

1. Client representers: every client trains locally (`common.local_models`,
   `fedseq.pretrain_epochs`; the reference trains LeNet for 10 epochs, we use the run's model),
   predicts the public exemplars (`fedseq.public`, default 'test_split': held out of the test
   split and excluded from evaluation, as in the reference) and uploads its confidence vector
   `conf[c] = Σ_{x of class c} p(x, c)`, normalised (`jfed.hfldd.fedseq_confidence`).
2. The server groups clients greedily into superclients (`jfed.hfldd.fedseq_clusters`:
   maximise `1 − KL(mean(cluster, client) ‖ uniform)` until a superclient holds
   `min_examples` examples or `max_clients` clients).
3. Each round, every (sampled, `participation`) superclient visits its clients in a fresh seeded
   random order; each client starts from the previous client's model (the first from the global
   model), trains `local_epochs` epochs on its own data with a fresh optimiser, and hands the
   model on; the last client uploads it. The server averages the superclient models weighted by
   their data size, evaluates and checkpoints the global model.

Superclients run in parallel: step j of the sequence trains the j-th client of every
superclient that has one as one client group (`common.train_groups`), so a round costs
max(superclient length) group calls, not one call per client.

Communication (comm.fedseq_transfers, Eq. 19): per round and superclient the server sends
the model to the first client, it is handed on n_c − 1 times and uploaded by the last client;
the one-off confidence-vector uploads are counted as a setup stage.
"""
import time

import jax
import numpy as np

from jfed import engine
from jfed.data import federate
from jfed.hfldd import comm, fedseq_clusters, fedseq_confidence
from jfed.io import ModelUpload, validate_model_upload, validate_tree
from jfed.methods import common
from jfed.methods.context import KEY_MODEL_INIT, KEY_ROUNDS, KEY_SAMPLING, RunContext
from jfed.methods.fedavg import select_clients, single_architecture
from jfed.methods.hfldd import client_probabilities, public_data
from jfed.methods.registry import register_method

KEY_ORDER = 41   # fold_in purpose of the per-round client orders inside superclients


def superclient_orders(key: jax.Array, clusters, selected) -> list:
  """Seeded random client order of every selected superclient for one round."""
  return [np.asarray(clusters[c])[np.asarray(jax.random.permutation(
      jax.random.fold_in(key, int(c)), len(clusters[c])))] for c in selected]


def _step_group(ctx: RunContext, full_group: common.ClientGroup, ids) -> common.ClientGroup:
  """The clients at one step of the sequences, padded to the largest client of the run, so
  that every step has the same array shapes and the step function compiles once."""
  fed = federate(ctx.dataset.train_x, ctx.dataset.train_y, [ctx.parts[k] for k in ids],
                 pad_to_multiple=int(full_group.fed.x.shape[1]))
  return common.ClientGroup(full_group.spec, full_group.module, np.asarray(ids), fed)


@register_method('fedseq')
def fedseq(ctx: RunContext) -> dict:
  cfg = ctx.config.fedseq
  spec = single_architecture(ctx)
  ds = ctx.dataset

  # client representers and superclients
  local = common.local_models(ctx, cfg.pretrain_epochs)
  public = public_data(ctx, cfg.public, cfg.public_size)
  probs = client_probabilities(ctx, local, public.x)
  conf = fedseq_confidence(probs, public.y, ds.num_classes).astype(np.float32)
  for k in range(ctx.num_clients):
    validate_tree(conf[k], np.zeros(ds.num_classes, np.float32), f'confidence of client {k}')
  clusters = fedseq_clusters(conf, ctx.client_sizes, cfg.min_examples, cfg.max_clients,
                             cfg.measure, cfg.code_compat)
  cluster_sizes = np.array([ctx.client_sizes[c].sum() for c in clusters])
  setup = [comm.Transfer(0, 'confidence', f'client{k}', 'server',
                         comm.serialized_nbytes(conf[k])) for k in range(ctx.num_clients)]
  setup_bytes = comm.total_bytes(setup)

  module = common.build_module(spec, ds)
  full_group = common.client_groups(ctx)[0]
  trainer = common.make_trainers(ctx, [full_group])[0]
  init = engine.init_model(module, ds.input_shape, ctx.derive_key(KEY_MODEL_INIT, 0))
  model_bytes = comm.serialized_nbytes(init)
  evaluator = engine.Evaluator(module, ctx.config.eval_batch_size, ctx.config.strategy)

  ckpt = ctx.checkpointer()
  start, global_model = ckpt.restore_latest(init)
  start = start or 0
  ctx.metrics.truncate_after(start)
  history = ctx.metrics.read()
  cumulative = history[-1]['cumulative_bytes'] if history else setup_bytes
  participation = cfg.get('participation', 1.0)
  for r in range(start, cfg.rounds):
    t0 = time.perf_counter()
    selected = select_clients(ctx.derive_key(KEY_SAMPLING, r), len(clusters), participation)
    orders = superclient_orders(ctx.derive_key(KEY_ORDER, r), clusters, selected)
    models = engine.replicate(global_model, len(selected))
    key = ctx.derive_key(KEY_ROUNDS, r)
    losses = []
    for j in range(max(len(o) for o in orders)):
      active = np.array([i for i, o in enumerate(orders) if len(o) > j])
      group = _step_group(ctx, full_group, [int(orders[i][j]) for i in active])
      (trained,), (metrics,) = common.train_groups(
          [trainer], [group], [engine.take(models, active)], cfg.local_epochs,
          jax.random.fold_in(key, j), label=f'round {r + 1}/{cfg.rounds} step {j + 1}')
      models = jax.tree.map(lambda a, b: a.at[active].set(b), models, trained)
      losses.append(metrics.loss[:, -1])
    for i, order in enumerate(orders):   # the last client of each superclient uploads
      validate_model_upload(ModelUpload(int(order[-1]), int(cluster_sizes[selected[i]]),
                                        engine.take(models, i)), init)
    global_model = engine.weighted_average(models, cluster_sizes[selected])
    accuracy = evaluator.accuracy(global_model, public.eval_x, public.eval_y)
    transfers = [t._replace(round=r + 1) for t in comm.fedseq_transfers(orders, model_bytes, 1)]
    stage = dict(comm.bytes_by_stage(transfers))
    cumulative += comm.total_bytes(transfers)
    ctx.metrics.write({
        'step': r + 1, 'round': r + 1, 'test_accuracy': accuracy,
        'train_loss': float(np.mean(np.concatenate(losses))), 'superclients': len(selected),
        'upload_bytes': stage.get('model_up', 0), 'download_bytes': stage.get('model_down', 0),
        'peer_bytes': stage.get('model_peer', 0), 'cumulative_bytes': int(cumulative),
        'seconds': time.perf_counter() - t0})
    print(f'round {r + 1}/{cfg.rounds}: test accuracy {accuracy:.4f} '
          f'({time.perf_counter() - t0:.1f}s)', flush=True)
    ckpt.save(r + 1, global_model)
  ckpt.close()

  history = [h for h in ctx.metrics.read() if 'test_accuracy' in h]
  accs = [h['test_accuracy'] for h in history]
  stages = {'confidence': setup_bytes,
            'model_down': int(sum(h['download_bytes'] for h in history)),
            'model_peer': int(sum(h['peer_bytes'] for h in history)),
            'model_up': int(sum(h['upload_bytes'] for h in history))}
  return {
      'final_test_accuracy': accs[-1], 'best_test_accuracy': max(accs), 'rounds': cfg.rounds,
      'step_name': 'round', 'public': public.source, 'eval_samples': int(len(public.eval_y)),
      'superclients': [c.tolist() for c in clusters],
      'superclient_sizes': cluster_sizes.tolist(), 'bytes_by_stage': stages,
      'total_bytes': int(sum(stages.values())), 'model_bytes': model_bytes}
