"""What FedAvg, FedProx and FedAvgVote promise beyond their oracles' numbers.

tests/test_oracle_fedavg.py checks the models and accuracies these methods compute; these tests
check the rest a user relies on (docs/results/mutation/fedavg_triage.md lists the mutants of
jfed/methods/fedavg.py each one kills): a bad config is refused, naming the key and the value;
the server optimiser's settings reach the server step; the one-shot reuse of the shared local
models bounds updates from their shared init; the records and the summary carry their fields
with the right values; a diverging round is named in the error; FedAvgVote resumes from its
checkpoint. Every expected value is written out here or computed in NumPy on the tiny problem of
tests/test_oracle_fedavg.py, whose helpers these tests reuse.
"""

import re

import flax.serialization
import ml_collections
import numpy as np
import pytest

from jfed.driver import build_algorithm, run
from jfed.errors import ConfigError, NonFiniteError
from jfed.keys import Purpose
from tests import oracle_numpy as onp
from tests.support import Interrupted, comparable_summary, interrupt_after
from tests.test_oracle_fedavg import (
  HETERO,
  HETERO_SIZES,
  NARROW,
  SIZES,
  WIDE,
  _config,
  _context,
  _init_params,
  _oracle_local_models,
  _oracle_rounds,
  _run,
  _test_accuracy,
)

SERVER_OPTIMIZER = {
  'name': 'fedavg',
  'lr': 1.0,
  'momentum': 0.9,
  'b1': 0.9,
  'b2': 0.99,
  'eps': 1e-3,
}


def _upload_bytes(params) -> int:
  """The size of one client's upload: the msgpack of its model's variables (an MLP: no
  BatchNorm statistics), as jfed/io/uploads.py documents it."""
  arrays = onp.tree_map(lambda a: np.asarray(a, np.float32), params)
  return len(flax.serialization.msgpack_serialize({'params': arrays, 'batch_stats': {}}))


# ---------------------------------------------------------------------------------------------
# config checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'method, overrides, message',
  [
    ('fedavg', {'fedavg.rounds': 0}, 'fedavg.rounds must be positive, got 0'),
    ('fedprox', {'fedprox.local_epochs': 0}, 'fedprox.local_epochs must be positive, got 0'),
    ('fedavg', {'fedavg.participation': 1.5}, 'fedavg.participation must be in (0, 1], got 1.5'),
    ('fedprox', {'fedprox.participation': 0.0}, 'fedprox.participation must be in (0, 1], got 0.0'),
    ('fedprox', {'fedprox.mu': -0.1}, 'fedprox.mu must be >= 0, got -0.1'),
    (
      'fedavg_vote',
      {'fedavg_vote.local_epochs': 0},
      'fedavg_vote.local_epochs must be positive, got 0',
    ),
    (
      'fedavg',
      {'server_optimizer.name': 'sgd'},
      "server_optimizer.name is 'sgd'; valid: fedavg, fedavgm, fedadam, fedyogi, fedadagrad",
    ),
    ('fedavg', {'server_optimizer.lr': 0.0}, 'server_optimizer.lr must be positive, got 0.0'),
    (
      'fedprox',
      {'server_optimizer.eps': -1e-3},
      'server_optimizer.eps must be positive, got -0.001',
    ),
    (
      'fedavg',
      {'server_optimizer.momentum': 1.0},
      'server_optimizer.momentum must be in [0, 1), got 1.0',
    ),
    ('fedavg', {'server_optimizer.b1': -0.1}, 'server_optimizer.b1 must be in [0, 1), got -0.1'),
    ('fedavg', {'server_optimizer.b2': 1.0}, 'server_optimizer.b2 must be in [0, 1), got 1.0'),
    (
      'fedavg',
      {'fedavg.reuse_local_models': True, 'fedavg.rounds': 2},
      'reuse_local_models needs rounds = 1 and participation = 1 (one-shot FedAvg over every '
      'client); got rounds = 2, participation = 1.0',
    ),
    (
      'fedavg',
      {'fedavg.reuse_local_models': True, 'fedavg.participation': 0.5},
      'reuse_local_models needs rounds = 1 and participation = 1 (one-shot FedAvg over every '
      'client); got rounds = 1, participation = 0.5',
    ),
  ],
)
def test_a_bad_setting_is_refused_naming_the_key_and_the_value(method, overrides, message):
  with pytest.raises(ConfigError, match=f'^{re.escape(message)}$'):
    build_algorithm(method, _config(3, **overrides))


@pytest.mark.parametrize(
  'section, message',
  [
    (None, "config has no section 'server_optimizer'"),
    (
      {k: v for k, v in SERVER_OPTIMIZER.items() if k != 'eps'},
      'server_optimizer.eps is missing from the config',
    ),
    ({**SERVER_OPTIMIZER, 'lr': 'fast'}, "server_optimizer.lr must be a number, got 'fast'"),
  ],
)
def test_a_malformed_server_optimizer_section_is_named(section, message):
  config = _config(3)
  del config['server_optimizer']
  if section is not None:
    config.server_optimizer = ml_collections.ConfigDict(section)
  for method in ('fedavg', 'fedprox'):
    with pytest.raises(ConfigError, match=f'^{re.escape(message)}$'):
      build_algorithm(method, config)


def test_fedavgm_without_momentum_is_server_sgd():
  # momentum 0 is a valid FedAvgM (and b1 0 a valid first moment): θ ← θ − lr (θ − aggregate)
  config = _config(
    3,
    **{
      'server_optimizer.name': 'fedavgm',
      'server_optimizer.lr': 0.5,
      'server_optimizer.momentum': 0.0,
      'server_optimizer.b1': 0.0,
    },
  )
  summary, rec, ctx = _run('fedavg', config)
  start = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  ((aggregate, _, _),) = _oracle_rounds(ctx, 1, 1)  # plain FedAvg's global model: the aggregate
  want = onp.tree_map(lambda g, a: g - 0.5 * (g - a), start, aggregate)
  onp.assert_tree_close(rec.states[0].model.params, want)
  assert summary['server_optimizer'] == 'fedavgm'


# ---------------------------------------------------------------------------------------------
# one-shot FedAvg of the shared local models (reuse_local_models)
# ---------------------------------------------------------------------------------------------

ONE_SHOT = {'fedavg.local_epochs': 2, 'fedavg.reuse_local_models': True}


def _norm(tree) -> float:
  return float(np.sqrt(sum(np.sum(np.square(a)) for a in onp.tree_leaves(tree))))


def test_one_shot_fedavg_bounds_the_updates_from_the_shared_init():
  # server.max_update_norm_ratio measures each local model's update from the model the clients
  # started from (the shared init, the global model of round 1): a bound between the two largest
  # ratios rejects exactly the client that moved farthest
  config = _config(3, **ONE_SHOT)
  ctx = _context(config)
  start = _init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0))
  clients = _oracle_local_models(ctx, [NARROW] * 3, 2)
  ratios = [
    _norm(onp.tree_map(lambda c, s: c - s, client, start)) / _norm(start) for client in clients
  ]
  farthest = int(np.argmax(ratios))
  bound = (sorted(ratios)[-1] + sorted(ratios)[-2]) / 2
  config.server.max_update_norm_ratio = bound
  _, rec, _ = _run('fedavg', config)
  kept = [k for k in range(3) if k != farthest]
  want = onp.weighted_average([clients[k] for k in kept], [SIZES[k] for k in kept])
  onp.assert_tree_close(rec.states[0].model.params, want)
  (record,) = rec.records[0]
  assert record['rejected_uploads'] == 1 and record['rejected_clients'] == [farthest]
  assert record['test_accuracy'] == pytest.approx(_test_accuracy(want), abs=1e-9)


def test_one_shot_fedavg_records_its_uploads_and_no_download():
  config = _config(3, **ONE_SHOT)
  summary, rec, ctx = _run('fedavg', config)
  each = _upload_bytes(_init_params(NARROW, ctx.derive_key(Purpose.MODEL_INIT, 0)))
  (record,) = rec.records[0]
  # the record's fields (metrics.jsonl's columns, tensorboard's scalars), and nothing else
  assert set(record) == {
    'round',
    'test_accuracy',
    'clients',
    'upload_bytes',
    'download_bytes',
    'rejected_uploads',
    'reused_local_models',
  }
  assert record['round'] == 1 and record['clients'] == 3 and record['reused_local_models']
  # the shared local models were uploaded once, and nothing goes back to the clients
  assert record['upload_bytes'] == 3 * each
  assert record['download_bytes'] == 0
  assert summary['total_bytes'] == 3 * each
  assert summary['rounds'] == 1
  assert summary['reused_local_models'] is True


# ---------------------------------------------------------------------------------------------
# multi-round FedAvg and FedProx: records, summary, errors
# ---------------------------------------------------------------------------------------------


def test_fedavg_summary_names_the_server_setup_and_the_rounds_are_numbered():
  config = _config(
    3,
    **{
      'fedavg.rounds': 2,
      'server_optimizer.name': 'fedavgm',
      'aggregation.rule': 'median',
      'attack.kind': 'sign_flip',
      'attack.clients': '2',
    },
  )
  summary, rec, _ = _run('fedavg', config)
  assert [records[0]['round'] for records in rec.records] == [1, 2]
  assert {
    k: summary[k]
    for k in ('rounds', 'reused_local_models', 'aggregation', 'server_optimizer', 'attack')
  } == {
    'rounds': 2,
    'reused_local_models': False,
    'aggregation': 'median',
    'server_optimizer': 'fedavgm',
    'attack': 'sign_flip',
  }
  assert summary['attackers'] == [2]


def test_a_diverging_round_is_named_in_the_error():
  # a learning rate at which the clients' training loss overflows in the first round: the error
  # says which round of how many (the label FedAvg.step gives common.fedavg_round)
  config = _config(3, **{'fedprox.rounds': 2, 'optimizer.lr': 1e30})
  with pytest.raises(NonFiniteError, match=r'^round 1/2: the training loss of client\(s\) '):
    _run('fedprox', config)


# ---------------------------------------------------------------------------------------------
# FedAvgVote
# ---------------------------------------------------------------------------------------------


def test_fedavg_vote_records_and_summarizes_its_prototypes():
  config = _config(4, **{'fedavg_vote.local_epochs': 1, **HETERO})
  summary, rec, ctx = _run('fedavg_vote', config, HETERO_SIZES)
  specs = [NARROW, WIDE, NARROW, WIDE]
  clients = _oracle_local_models(ctx, specs, 1)
  accs = {
    spec: _test_accuracy(
      onp.weighted_average([clients[k] for k in range(4) if specs[k] == spec], [1.0, 1.0])
    )
    for spec in (NARROW, WIDE)
  }
  uploads = sum(_upload_bytes(c) for c in clients)
  (record,) = rec.records[0]
  assert record['round'] == 1 and record['clients'] == 4
  assert record['upload_bytes'] == uploads
  assert summary['total_bytes'] == uploads
  assert summary['prototype_test_accuracy'] == pytest.approx(accs, abs=1e-9)
  assert summary['mean_prototype_test_accuracy'] == pytest.approx(
    (accs[NARROW] + accs[WIDE]) / 2, abs=1e-9
  )
  assert summary['client_models'] == specs


def test_fedavg_vote_resumes_from_its_checkpoint(tmp_path, monkeypatch):
  # killed after its one round's checkpoint, before the summary: the rerun restores the
  # checkpoint (into the state template `init` gives) and ends as an uninterrupted run does.
  # Three clients: the wide architecture's group holds a single client.
  config = _config(3, **{'fedavg_vote.local_epochs': 1, **HETERO})

  def run_in(workdir):
    ctx = _context(config, workdir=workdir)
    return run(build_algorithm('fedavg_vote', config), ctx, progress=False)

  whole = run_in(tmp_path / 'whole')
  with monkeypatch.context() as m:
    interrupt_after(m, 1)
    with pytest.raises(Interrupted):
      run_in(tmp_path / 'killed')
  assert not (tmp_path / 'killed' / 'summary.json').exists()
  resumed = run_in(tmp_path / 'killed')
  assert comparable_summary(resumed) == comparable_summary(whole)
