"""One-shot distillation methods (DENSE, FedDF, Co-Boosting, OT, FedHydra) end to end on digits.

Budgets: experiments/configs/fedhydra_digits.py:quick, the smallest on which every method learns
(chance is 0.1 on the 10 digit classes); the homogeneous tests share one set of client models
(`local_dir`). Every end-to-end test checks that the method's model beats chance by a margin,
that it writes its outputs, and the method's own behaviour (pool growth, FedDF early stop,
rounds, FedHydra's model stratification on 2c/c, heterogeneous clients). That an interrupted run
resumes to the result of an uninterrupted one is tests/test_driver.py's test for every method;
FedDF's early stop (steps that record nothing) is resumed here. Most of the time is XLA:CPU
compilation.
"""

import json
import logging
import math
import pathlib
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed import driver, engine
from jfed.configs import fedhydra_digits
from jfed.data import load_dataset
from jfed.distill import (
  MSConfig,
  TeacherGroup,
  dense_generator_init,
  make_generator,
  model_stratification_loop,
  model_stratification_python,
  plots,
  resolve_ms_impl,
)
from jfed.engine import compiles, optim
from jfed.errors import ConfigError
from jfed.io import Checkpointer
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import available_methods, common, feddf, oneshot
from jfed.methods.ot import fusion_layers
from jfed.models import get_model
from jfed.models.layers import BatchNorm
from tests import oracle_numpy as onp
from tests.support import (
  comparable_summary,
  override,
  read_metrics,
  record_sample_grids,
  snapshot_every_step,
)

CHANCE = 0.1
LEARNED = CHANCE + 0.1  # every method's final model must beat chance by this margin


def _config(arg='quick', **overrides):
  return override(fedhydra_digits.get_config(arg), **overrides)


def _run(method, config, workdir):
  return driver.run_experiment(method, config, workdir, progress=False)


@pytest.fixture(scope='module')
def local_dir(tmp_path_factory):
  """One set of client models (Dir(0.5), quick budget) shared by the homogeneous tests."""
  return str(tmp_path_factory.mktemp('shared') / 'local_models')


def _epochs(workdir):
  """The distillation epochs' records (the setup record, step 0, holds the uploads)."""
  return [r for r in read_metrics(workdir) if r.get('test_accuracy') is not None]


# ----------------------------------------------------------------------------- pure pieces


def test_one_set_of_lr_schedules_for_clients_and_students():
  assert optim.SCHEDULES == ('constant', 'cosine', 'cosine_epochs')
  assert optim.scheduled_lr('constant', 0.1, step=7, total_steps=10) == 0.1
  assert optim.scheduled_lr('cosine_epochs', 0.1, epoch=0, epochs=10) == pytest.approx(0.1)
  assert optim.scheduled_lr('cosine_epochs', 0.1, epoch=5, epochs=10) == pytest.approx(0.05)
  assert optim.scheduled_lr('cosine', 0.1, step=50, total_steps=100) == pytest.approx(0.05)
  assert optim.scheduled_lr('cosine', 0.1, step=200, total_steps=100) == pytest.approx(0.0)
  with pytest.raises(ValueError, match='schedule'):
    optim.scheduled_lr('step', 0.1)
  # the optimiser follows the same formulas from its own step count (4 steps per epoch)
  params = {'w': jnp.ones(3)}
  for schedule in ('cosine', 'cosine_epochs'):
    tx = optim.make_optimizer('sgd', 0.1, schedule=schedule, total_steps=12, epochs=3)
    state = tx.init(params)
    for step in range(12):
      want = optim.scheduled_lr(schedule, 0.1, step=step, total_steps=12, epoch=step // 4, epochs=3)
      _, state = tx.update(params, state, params)
      assert float(optim.learning_rate_of(state)) == pytest.approx(want, abs=1e-7), (schedule, step)
  # a caller that drives the rate itself sets it in the state
  tx = optim.make_optimizer('sgd', 0.1)
  state = optim.set_learning_rate(tx.init(params), 0.025)
  updates, _ = tx.update({'w': jnp.ones(3)}, state, params)
  np.testing.assert_allclose(updates['w'], -0.025)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Conv(1, (3, 3))(x)


class _Residual(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    return nn.Dense(10)(_Block()(x).reshape(x.shape[0], -1))


def test_ot_fusion_layers_and_ms_impl():
  layers = fusion_layers(get_model('cnn_mnist', 10, (8, 8, 1)), (8, 8, 1), jax.random.PRNGKey(0))
  assert [(l.name, l.bn) for l in layers] == [
    ('Conv_0', 'BatchNorm_0'),
    ('Conv_1', 'BatchNorm_1'),
    ('Dense_0', None),
  ]
  with pytest.raises(ValueError, match='sequential'):  # a residual block is a submodule
    fusion_layers(_Residual(), (8, 8, 1), jax.random.PRNGKey(0))
  assert resolve_ms_impl('auto', 'cpu') == 'python'
  assert resolve_ms_impl('auto', 'gpu') == 'batched'
  assert {'dense', 'feddf', 'coboosting', 'ot', 'fedhydra'} <= set(available_methods())


class _TinyConv(nn.Module):
  @nn.compact
  def __call__(self, x, train=False, mask=None):
    x = nn.relu(BatchNorm()(nn.Conv(3, (3, 3))(x), train, mask))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_python_ms_equals_the_scan_forms():
  module = _TinyConv()
  states = engine.init_models(module, (8, 8, 1), jax.random.PRNGKey(0), 2, same_init=False)
  gen = make_generator((8, 8, 1), nz=8, ngf=4)
  cfg = MSConfig(T_G=4, batch_size=4, lr=1e-2)
  key = jax.random.PRNGKey(7)
  groups = [TeacherGroup(module, states), TeacherGroup(module, engine.take(states, np.array([1])))]
  want = model_stratification_loop(groups, gen, 3, key, cfg)
  got = model_stratification_python(groups, gen, 3, key, cfg)
  np.testing.assert_allclose(got.losses, want.losses, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got.U_r, want.U_r, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
  'method,overrides,message',
  [
    ('dense', {'dense.epochs': 0}, 'dense.epochs must be positive'),
    ('dense', {'dense.bn_loss_mode': 'torch'}, 'dense.bn_loss_mode'),
    ('dense', {'dense.server_model': 'transformer'}, 'dense.server_model'),
    ('coboosting', {'coboosting.kd_schedule': 'cosine_steps'}, 'valid: constant, cosine'),
    ('coboosting', {'coboosting.kd_batch': 0}, 'coboosting.kd_batch must be positive'),
    (
      'coboosting',
      {'coboosting.weight_update_order': 'after'},
      "^coboosting.weight_update_order is 'after'; valid: before_batch, after_batch$",
    ),
    ('feddf', {'feddf.eval_every': 0}, 'feddf.eval_every must be positive'),
    ('feddf', {'feddf.kd_optimizer': 'rmsprop'}, 'feddf.kd_optimizer'),
    ('fedhydra', {'fedhydra.aggregation': 'median'}, 'fedhydra.aggregation'),
    ('fedhydra', {'fedhydra.kd_data': 'all'}, 'fedhydra.kd_data'),
    # 'fixed' is FedDF's unlabelled set, which FedHydra has not
    (
      'fedhydra',
      {'fedhydra.kd_data': 'fixed'},
      "^fedhydra.kd_data is 'fixed'; valid: pool, batch$",
    ),
    ('fedhydra', {'fedhydra.rounds': -1}, 'fedhydra.rounds must be positive'),
    ('ot', {'ot.method': 'greedy'}, 'ot.method'),
    ('ot', {'ot.anchor': 5}, 'ot.anchor'),
  ],
)
def test_bad_configs_are_refused_with_the_key(method, overrides, message):
  with pytest.raises(ConfigError, match=message):
    driver.build_algorithm(method, _config('smoke', **overrides))


# The bounds every generator-distillation method checks (the shared validation of
# jfed/methods/oneshot.py), then each method's own; a message names the key and the value.
_SHARED_POSITIVE = (
  'rounds',
  'local_epochs',
  'epochs',
  'kd_batch',
  'g_steps',
  'synthesis_batch',
  'nz',
  'ngf',
  'kd_lr',
  'kd_T',
  'lr_g',
)
_POSITIVE = {'dense': _SHARED_POSITIVE, 'coboosting': _SHARED_POSITIVE + ('adv_T', 'ods_T', 'wdc')}
_SHARED_NON_NEGATIVE = ('kd_weight_decay',)
_NON_NEGATIVE = {
  'dense': _SHARED_NON_NEGATIVE + ('bn', 'oh', 'adv'),
  'coboosting': _SHARED_NON_NEGATIVE
  + ('kd_grad_clip', 'bn', 'oh', 'adv', 'hs', 'g_grad_clip', 'mu', 'wa_steps', 'odseta'),
}
_CHOICES = {
  'init': 'random, fedavg',
  'kd_augment': 'auto, none, flip, crop_flip',
  'kd_optimizer': 'sgd, adam',
}


def _refusal(method, key, value):
  with pytest.raises(ConfigError) as refused:
    driver.build_algorithm(method, _config('smoke', **{f'{method}.{key}': value}))
  return str(refused.value)


@pytest.mark.parametrize('method', ['dense', 'coboosting'])
def test_every_bound_of_a_generator_distillation_is_refused_naming_its_key_and_value(method):
  section = _config('smoke')[method]
  typed = lambda key, v: float(v) if isinstance(section[key], float) else v  # as parsed
  for key in _POSITIVE[method]:
    assert _refusal(method, key, 0) == f'{method}.{key} must be positive, got {typed(key, 0)}'
  assert _refusal(method, 'kd_lr', -0.5) == f'{method}.kd_lr must be positive, got -0.5'
  for key in _NON_NEGATIVE[method]:
    assert _refusal(method, key, -1) == f'{method}.{key} must be >= 0, got {typed(key, -1)}'
  for value in (1.0, -0.1):
    assert _refusal(method, 'kd_momentum', value) == (
      f'{method}.kd_momentum must be in [0, 1), got {value}'
    )
  for key, valid in _CHOICES.items():
    assert _refusal(method, key, 'x') == f"{method}.{key} is 'x'; valid: {valid}", key
  message = _refusal(method, 'server_model', ' Transformer:width=2')
  assert message.startswith(
    f"{method}.server_model: unknown model 'Transformer' in ' Transformer:width=2'; valid: "
  )
  assert 'cnn_mnist, ' in message and 'resnet18' in message
  # the bounds themselves are allowed
  for key in ('kd_momentum', 'kd_weight_decay', 'bn'):
    driver.build_algorithm(method, _config('smoke', **{f'{method}.{key}': 0.0}))
  driver.build_algorithm(method, _config('smoke', **{f'{method}.server_model': ' MLP '}))


# The shared bounds that FedHydra's and FedDF's configs hold (FedDF's student checks them)
_OWN_SHARED = {
  'fedhydra': (
    ('rounds', 'local_epochs', 'epochs', 'kd_batch', 'T_G', 'synthesis_batch', 'nz', 'ngf'),
    ('kd_lr', 'kd_T', 'lr_g'),
    ('kd_weight_decay',),
  ),
  'feddf': (('rounds', 'local_epochs', 'kd_batch'), ('kd_lr', 'kd_T'), ('kd_grad_clip',)),
}


@pytest.mark.parametrize('method', ['fedhydra', 'feddf'])
def test_the_shared_bounds_of_fedhydra_and_feddf_are_refused_naming_key_and_value(method):
  ints, floats, non_negative = _OWN_SHARED[method]
  for key in ints:
    assert _refusal(method, key, 0) == f'{method}.{key} must be positive, got 0'
  for key in floats:
    assert _refusal(method, key, 0) == f'{method}.{key} must be positive, got 0.0'
  for key in non_negative:
    assert _refusal(method, key, -1) == f'{method}.{key} must be >= 0, got -1.0'
  assert _refusal(method, 'init', 'x') == f"{method}.init is 'x'; valid: random, fedavg"
  if method == 'feddf':
    for key, valid in (('kd_optimizer', 'sgd, adam'), ('kd_schedule', 'constant, cosine')):
      assert _refusal(method, key, 'x').startswith(f"{method}.{key} is 'x'; valid: {valid}")
  else:
    assert _refusal(method, 'kd_momentum', 1.0) == (
      f'{method}.kd_momentum must be in [0, 1), got 1.0'
    )


def test_coboosting_refuses_a_kd_schedule_it_does_not_know_with_the_valid_ones():
  assert _refusal('coboosting', 'kd_schedule', 'x') == (
    "coboosting.kd_schedule is 'x'; valid: constant, cosine, cosine_epochs"
  )
  # per step: the growing pool's epochs have ever more steps, so the run's total is unknown
  assert _refusal('coboosting', 'kd_schedule', 'cosine') == (
    "coboosting.kd_schedule 'cosine' counts KD steps, which a growing synthetic pool does not "
    "fix in advance; use 'cosine_epochs' (the reference's CosineAnnealingLR over the epochs) or "
    "'constant'"
  )


def _settings(method, **overrides):
  """The Settings a method's run builds, on digits (8x8x1), 3 clients, clients mapped by scan."""
  config = _config('smoke', **{'strategy': 'scan', 'dataset.holdout_size': 0, **overrides})
  ds = load_dataset('digits')
  parts = np.array_split(np.arange(90), 3)
  algorithm = driver.build_algorithm(method, config)
  return algorithm.recipe.settings(driver.make_context(config, ds, parts))


def test_a_later_rounds_uploads_start_from_the_global_model_with_the_trainers_given_or_built():
  """Round 2's clients train from round 1's global model: refused without one; the run's
  trainers (`client_trainers`, what a method keeps in setup) and trainers built for the round
  train the same models."""
  config = _config('smoke', model='mlp', **{'dataset.holdout_size': 0})
  ds, parts = load_dataset('digits'), np.array_split(np.arange(90), 3)
  ctx = driver.make_context(config, ds, parts)
  message = '^round 2 of local training needs the global model of round 1$'
  with pytest.raises(ValueError, match=message):
    oneshot.round_uploads(ctx, 2, 1, 'mlp')
  first = oneshot.round_uploads(ctx, 1, 1, 'mlp')
  global_model = engine.weighted_average(first.models[0], first.groups[0].fed.sizes)
  built = oneshot.round_uploads(ctx, 2, 1, 'mlp', global_model)
  fresh = driver.make_context(config, ds, parts)
  trainers = common.client_trainers(fresh)
  given = oneshot.round_uploads(fresh, 2, 1, 'mlp', global_model, trainers=trainers)
  jax.tree.map(np.testing.assert_allclose, built.models, given.models)
  assert built.upload_bytes == given.upload_bytes > 0
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), built.models, first.models)
  assert max(jax.tree.leaves(moved)) > 0  # round 2 trained


def test_dense_settings_carry_every_key_of_its_config_where_the_paper_puts_it():
  """Each key of config.dense reaches the field the shared loop reads (values all distinct)."""
  s = _settings(
    'dense',
    **{
      'dense.rounds': 2,
      'dense.local_epochs': 3,
      'dense.epochs': 4,
      'dense.server_model': 'mlp',
      'dense.init': 'fedavg',
      'dense.lr_g': 0.0042,
      'dense.nz': 9,
      'dense.ngf': 5,
      'dense.kd_momentum': 0.55,
      'dense.pool_quantize': False,
      'dense.g_steps': 6,
      'dense.synthesis_batch': 12,
      'dense.bn': 0.3,
      'dense.oh': 0.6,
      'dense.adv': 0.9,
      'dense.kd_T': 7.5,
      'dense.kd_optimizer': 'adam',
      'dense.kd_lr': 0.123,
      'dense.kd_weight_decay': 0.0007,
      'dense.kd_batch': 14,
      'dense.kd_augment': 'crop_flip',
    },
  )
  assert (s.rounds, s.local_epochs, s.epochs, s.server_model, s.init) == (2, 3, 4, 'mlp', 'fedavg')
  assert (s.kd_batch, s.kd_data, s.nz, s.ngf, s.pool_quantize) == (14, 'pool', 9, 5, False)
  assert (s.keep_generator, s.generator, s.steps_per_epoch) == (False, 'dense', 0)
  g = s.synthesis
  assert (g.g_steps, g.batch_size, g.lr_g, g.bn, g.oh, g.adv) == (6, 12, 0.0042, 0.3, 0.6, 0.9)
  assert (g.crop_padding, g.strategy) == (1, 'vmap')  # 8 px: RandomCrop(1); scan maps as vmap
  k = s.kd
  assert (k.loss, k.T, k.t_squared, k.aggregation) == ('kl', 7.5, True, 'mean')
  assert (k.augment, k.crop_padding, k.strategy) == ('crop_flip', 1, 'vmap')
  assert tuple(s.opt) == (
    'adam',
    0.123,
    0.55,
    0.0007,
    0.0,
    0.9,
    0.999,
    'constant',
    None,
  )  # no own optax transformation
  # the official code's BN hooks never attach: 'code' drops the BN term
  assert _settings('dense', **{'dense.bn_loss_mode': 'code', 'dense.bn': 0.3}).synthesis.bn == 0.0
  # no server model: the run's model; 'auto' augmentation on digits: HFlip only
  s = _settings('dense', strategy='loop')
  assert s.server_model == 'cnn_mnist' and s.kd.augment == 'flip' and s.kd.strategy == 'loop'


def test_coboosting_settings_carry_every_key_of_its_config_where_the_paper_puts_it():
  s = _settings(
    'coboosting',
    **{
      'coboosting.g_steps': 6,
      'coboosting.synthesis_batch': 12,
      'coboosting.lr_g': 0.0042,
      'coboosting.bn': 0.3,
      'coboosting.oh': 0.6,
      'coboosting.adv': 0.9,
      'coboosting.hs': 1.5,
      'coboosting.adv_T': 2.5,
      'coboosting.g_grad_clip': 7.0,
      'coboosting.synthesis_augment': True,
      'coboosting.odseta': 0.2,
      'coboosting.ods_T': 3.5,
      'coboosting.kd_T': 6.5,
      'coboosting.kd_lr': 0.02,
      'coboosting.kd_momentum': 0.45,
      'coboosting.kd_weight_decay': 0.003,
      'coboosting.kd_grad_clip': 8.0,
      'coboosting.kd_schedule': 'constant',
      'coboosting.kd_batch': 24,
    },
  )
  g = s.synthesis
  assert (g.g_steps, g.batch_size, g.lr_g, g.bn, g.oh, g.adv) == (6, 12, 0.0042, 0.3, 0.6, 0.9)
  assert (g.hs, g.adv_T, g.grad_clip, g.augment) == (1.5, 2.5, 7.0, True)
  assert (g.crop_padding, g.strategy) == (1, 'vmap')
  k = s.kd
  assert (k.loss, k.T, k.t_squared, k.aggregation, k.ods_T) == ('kl', 6.5, True, 'weighted', 3.5)
  assert k.ods_eta == pytest.approx(0.2 * 0.5)  # 8/255 of [0, 1] is 2 x that in Normalize(0.5)
  assert (k.augment, k.crop_padding, k.strategy) == ('flip', 1, 'vmap')
  assert tuple(s.opt) == (
    'sgd',
    0.02,
    0.45,
    0.003,
    8.0,
    0.9,
    0.999,
    'constant',
    None,
  )  # no own optax transformation
  assert s.kd_batch == 24
  # a zero clip is no clip
  assert _settings('coboosting', **{'coboosting.g_grad_clip': 0.0}).synthesis.grad_clip is None


def test_fedhydra_and_feddf_settings_take_the_reference_values_for_keys_they_lack():
  """The shared defaults fill what a config has no key for: FedHydra's student is SGD at a
  constant rate without clipping, momentum from its block; FedDF's is Adam (Lin et al.'s)
  without momentum or weight decay, one epoch per `eval_every` steps of its fixed set, and no
  generator."""
  s = _settings(
    'fedhydra',
    **{'fedhydra.kd_lr': 0.03, 'fedhydra.kd_weight_decay': 0.002, 'fedhydra.kd_momentum': 0.8},
  )
  assert tuple(s.opt) == (
    'sgd',
    0.03,
    0.8,
    0.002,
    0.0,
    0.9,
    0.999,
    'constant',
    None,
  )  # no own optax transformation
  assert (s.kd_data, s.steps_per_epoch, s.keep_generator, s.generator) == (
    'pool',
    0,
    True,
    'fedhydra',
  )
  # FedDF builds a student per architecture (FedDFStudent): its recipe's settings
  overrides = {'feddf.kd_lr': 0.004, 'feddf.total_steps': 10, 'feddf.eval_every': 4}
  config = _config('smoke', **overrides)
  ctx = driver.context_of_config(config)
  s = feddf.recipe(driver.build_algorithm('feddf', config).config).settings(ctx)
  assert tuple(s.opt) == (
    'adam',
    0.004,
    0.0,
    0.0,
    5.0,
    0.9,
    0.999,
    'cosine',
    None,
  )  # no own optax transformation
  assert (s.kd_data, s.epochs, s.steps_per_epoch) == ('fixed', 3, 4)
  assert (s.synthesis, s.keep_generator) == (None, False)


def test_steps_are_rounds_times_epochs():
  config = _config('smoke,rounds=3')
  for method, per_round in (('dense', 2), ('feddf', 2), ('ot', 1)):
    algorithm = driver.build_algorithm(method, config)
    assert algorithm.num_steps(None) == 3 * per_round
  labels = [driver.build_algorithm('dense', config).step_label(i, 6) for i in (0, 3, 5)]
  assert labels == ['round 1/3 epoch 1/2', 'round 2/3 epoch 2/2', 'round 3/3 epoch 2/2']
  two_rounds = driver.build_algorithm('dense', _config('smoke,rounds=2'))
  assert two_rounds.step_label(2, 4) == 'round 2/2 epoch 1/2'
  assert driver.build_algorithm('dense', _config('smoke')).step_label(1, 2) == 'epoch 2/2'
  config = _config('smoke', **{'feddf.total_steps': 7, 'feddf.eval_every': 3})
  assert driver.build_algorithm('feddf', config).num_steps(None) == math.ceil(7 / 3)


# ----------------------------------------------------------------------------- end to end


# The slow set: the quick budget is the smallest on which every method learns (the synthesis
# methods need about 15 epochs to clear chance by the margin, a minute each on 2 cores). What
# the methods do at every step, and that they resume, runs at the smoke budget in
# tests/test_driver.py and below.
@pytest.mark.slow
@pytest.mark.parametrize('method', ['dense', 'feddf', 'coboosting', 'ot', 'fedhydra'])
def test_method_runs_end_to_end_and_learns(tmp_path, local_dir, method):
  config = _config(local_models_dir=local_dir)
  summary = _run(method, config, tmp_path)
  for name in ('config.json', 'metrics.jsonl', 'summary.json', 'accuracy.png', 'checkpoints'):
    assert (tmp_path / name).exists(), name
  records = _epochs(tmp_path)
  assert summary['final_test_accuracy'] > LEARNED, summary['final_test_accuracy']
  assert summary['best_test_accuracy'] >= max(r['test_accuracy'] for r in records) - 1e-9
  assert len(summary['client_test_accuracy']) == 5
  assert min(summary['client_test_accuracy']) > LEARNED
  assert summary['total_bytes'] > 0
  if method == 'ot':
    assert summary['step_name'] == 'round' and len(records) == 1
    assert 'plain_average_test_accuracy' in records[0]
    return
  assert summary['teacher_ensemble_test_accuracy'] > LEARNED
  assert summary['step_name'] == 'epoch'
  epochs = summary['epochs']
  assert (
    [r['step'] for r in records]
    == [r['epoch'] for r in records]
    == list(range(1, len(records) + 1))
  )
  assert len(records) == epochs or (method == 'feddf' and records[-1]['early_stop'])
  assert all(np.isfinite(r['kd_loss']) for r in records)
  assert records[-1]['round_accuracy'] == summary['final_test_accuracy']
  assert (tmp_path / 'distillation_accuracy.png').exists()
  if method != 'feddf':  # synthesis methods: a growing pool and a sample grid
    # FedHydra keeps every generator step's batch (FedHydra §2), the others the best one
    per_epoch = 32 * (config.fedhydra.T_G if method == 'fedhydra' else 1)
    assert [r['pool_size'] for r in records] == [per_epoch * (e + 1) for e in range(epochs)]
    assert (tmp_path / 'synthetic_samples.png').exists()
  if method == 'dense':
    assert summary['bn_loss_mode'] == config.dense.bn_loss_mode
    assert summary['pool_size'] == records[-1]['pool_size']
  if method == 'coboosting':
    w = np.asarray(summary['ensemble_weights'])
    assert w.shape == (5,) and np.all((w >= 0) & (w <= 1))
    assert records[-1]['lr'] < records[0]['lr']  # CosineAnnealingLR over the epochs
  if method == 'feddf':
    assert 'val_accuracy' in records[-1] and summary['eval_samples'] == 360
    assert records[-1]['lr'] < records[0]['lr']  # cosine over the KD steps
  if method == 'fedhydra':
    assert (tmp_path / 'model_stratification.npz').exists()
    assert (tmp_path / 'ms_heatmap.png').exists()
    assert np.asarray(summary['U_r_by_client']).shape == (10, 5)


@pytest.mark.slow  # the stratification must be learned
def test_fedhydra_2c_per_client_ms_finds_each_clients_classes(tmp_path, monkeypatch):
  """Fig. 5b: with the 2c/c partition, the MS weight of class j peaks at the client owning j
  (the stratification learned: at least 8 of 10 classes, where a random U_r finds about 2);
  the heatmap numbers the clients 0..m-1 like partition.txt. Smoke budget: the students of
  2c/c clients need far more than the quick budget to beat chance."""
  names = []
  heatmap = plots.plot_ms_heatmap

  def record_names(*args, **kwargs):
    names.append(kwargs['client_names'])
    return heatmap(*args, **kwargs)

  monkeypatch.setattr(plots, 'plot_ms_heatmap', record_names)
  config = _config('disjoint,smoke')
  summary = _run('fedhydra', config, tmp_path)
  for name in (
    'model_stratification.npz',
    'ms_heatmap.png',
    'distillation_accuracy.png',
    'synthetic_samples.png',
    'metrics.jsonl',
    'model_stratification',
  ):
    assert (tmp_path / name).exists(), name
  assert names == [[f'client {k} (cnn_mnist)' for k in range(5)]]
  assert summary['step_name'] == 'epoch' and len(_epochs(tmp_path)) == 2
  ds = load_dataset('digits')
  parts = driver.partition_clients(config, ds.train_y)
  owner = {int(j): k for k, p in enumerate(parts) for j in np.unique(ds.train_y[p])}
  with np.load(tmp_path / 'model_stratification.npz') as f:
    U_r, U = f['U_r_by_client'], f['U_by_client']  # [classes, clients], global client ids
  np.testing.assert_allclose(U_r.sum(1), 1.0, rtol=1e-5)
  hits_r = sum(int(np.argmax(U_r[j])) == owner[j] for j in range(10))
  hits_u = sum(int(np.argmax(U[j])) == owner[j] for j in range(10))
  assert hits_r >= 8 and hits_u >= 8, (hits_r, hits_u, U_r.round(2))
  np.testing.assert_allclose(summary['U_r_by_client'], U_r, rtol=1e-6)
  assert summary['ms_file'] == 'model_stratification.npz'


@pytest.mark.slow
def test_heterogeneous_clients_distil_into_one_server_model(tmp_path):
  """Clients of two architectures, one with BatchNorm and one without (groups of 3 and 2, each
  trained as its own compiled group): model stratification over both teacher groups, a
  generator that matches the BN statistics of one group only, and a CNNMnist student that
  starts from the FedAvg of the clients of its own architecture and learns. Table 3's five
  architectures with a ResNet18 server (`fedhydra_digits.py:hetero`) take the same code path at
  4x the compile time; each of those architectures trains in tests/test_models.py."""
  config = _config(client_models='cnn_mnist;mlp', **{'fedhydra.server_model': 'cnn_mnist'})
  summary = _run('fedhydra', config, tmp_path)
  assert summary['server_model'] == 'cnn_mnist'
  assert summary['client_models'] == ['cnn_mnist', 'mlp', 'cnn_mnist', 'mlp', 'cnn_mnist']
  assert len(summary['client_test_accuracy']) == 5
  with np.load(tmp_path / 'model_stratification.npz') as f:
    assert f['U_r'].shape == (10, 5)
  assert summary['teacher_ensemble_test_accuracy'] > LEARNED
  assert summary['final_test_accuracy'] > LEARNED, summary['final_test_accuracy']


def test_the_sample_grid_shows_the_first_64_synthetic_images_with_their_labels(
  tmp_path, monkeypatch
):
  """Round 1's grid is synthetic_samples.png, a later round's names its round; at most 64
  images, each with its label; without a workdir nothing is drawn."""
  drawn = []
  monkeypatch.setattr(plots, 'plot_image_grid', lambda *a, **kw: drawn.append((a, kw)))
  config = _config('smoke')
  algorithm = driver.build_algorithm('dense', config)
  x = np.random.default_rng(0).random((100, 8, 8, 1), np.float32)
  y = np.arange(100) % 10
  algorithm._save_samples(driver.context_of_config(config), (x, y), 1)
  assert not drawn
  ctx = driver.context_of_config(config, workdir=tmp_path)
  for r in (1, 3):
    algorithm._save_samples(ctx, (x, y), r)
  for ((path, images, labels), kw), name, r in zip(
    drawn, ('synthetic_samples.png', 'synthetic_samples_round3.png'), (1, 3)
  ):
    assert pathlib.Path(path) == tmp_path / name
    np.testing.assert_array_equal(images, x[:64])
    np.testing.assert_array_equal(labels, y[:64])
    assert kw == {'title': f'last synthetic batch (round {r})'}


def _key_bits(key) -> tuple:
  return tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())


def test_round_keys_take_the_documented_path_and_repeat_no_other_draw():
  """jfed.keys: a round-level draw is derive_key(SERVER, 0, r, purpose) and epoch e of round r
  draws from (SERVER, r, e), so no round key equals an epoch's, another round's or purpose's,
  or the same path under another first purpose."""
  ctx = driver.context_of_config(_config('smoke'))
  rounds, purposes = (1, 2, 3), list(ServerRoundPurpose)
  round_keys = [oneshot.round_key(ctx, r, q) for r in rounds for q in purposes]
  documented = [ctx.derive_key(Purpose.SERVER, 0, r, q) for r in rounds for q in purposes]
  assert [_key_bits(k) for k in round_keys] == [_key_bits(k) for k in documented]
  others = [ctx.derive_key(Purpose.SERVER, r, e) for r in rounds for e in range(6)]
  others += [
    ctx.derive_key(p, 0, r, q)
    for p in Purpose
    if p != Purpose.SERVER
    for r in rounds
    for q in purposes
  ]
  bits = [_key_bits(k) for k in round_keys + others]
  assert len(set(bits)) == len(bits)


def test_the_random_student_is_drawn_once_per_run_from_round_zeros_student_key(monkeypatch):
  """jfed.keys: the random server model (a student without a FedAvg start) is a run-level draw,
  derive_key(SERVER, 0, 0, STUDENT), apart from every round's draws (rounds count from 1).
  The student is scored with the run's strategy ('vmap' here; 'auto' is 'loop' on a CPU)."""
  config = _config('smoke', strategy='vmap')
  algorithm = driver.build_algorithm('dense', config)
  monkeypatch.setattr(algorithm, 'round', lambda *a, **kw: None)  # no local training here
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  want = engine.init_model(
    aux.student_module,
    ctx.dataset.input_shape,
    ctx.derive_key(Purpose.SERVER, 0, 0, ServerRoundPurpose.STUDENT),
  )
  jax.tree.map(np.testing.assert_array_equal, aux.random_student, want)
  assert aux.evaluator.strategy == 'vmap'


def test_a_later_rounds_clients_start_from_the_global_model_of_the_round_before(monkeypatch):
  """Round r > 1 (jfed.methods.oneshot's protocol, step 1): every client of the server's
  architecture downloads the round before's global model and trains from it, not from its own
  upload of that round, for the method's local epochs, with the run's trainers and a key of
  its own round (round 1's is derive_key(LOCAL_TRAINING))."""
  config = _config('smoke,rounds=2', model='mlp')
  algorithm = driver.build_algorithm('dense', config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  global_model = jax.tree.map(lambda a: a + 1.5, aux.random_student)
  started, calls = [], []

  def trained(trainers, groups, starts, epochs, key, **kwargs):
    started.extend(starts)
    calls.append((trainers, epochs, key, kwargs))
    return list(starts), []

  monkeypatch.setattr(common, 'train_groups', trained)
  algorithm.round(ctx, aux, 2, global_model)
  ((trainers, epochs, key, kwargs),) = calls
  assert trainers == [aux.trainers['mlp']] and epochs == config.dense.local_epochs
  assert kwargs == {'label': 'round 2 local training'}
  np.testing.assert_array_equal(key, ctx.derive_key(Purpose.LOCAL_TRAINING, 2))
  (start,) = started
  clients = config.partition.num_clients
  for got, want in zip(jax.tree.leaves(start), jax.tree.leaves(global_model)):
    np.testing.assert_array_equal(got, np.broadcast_to(want, (clients, *np.shape(want))))


@pytest.mark.parametrize('method', ['feddf', 'dense'])
def test_an_epoch_leaves_the_server_state_in_the_shapes_and_dtypes_of_the_rounds_start(method):
  """The round's fresh state and the state after its first epoch have the same tree, shapes and
  dtypes (FedDF's epoch writes its stop flag and best model): a checkpoint of any epoch restores
  into the template the fresh state gives, and no program taking the state compiles again."""
  config = _config('smoke', model='mlp')
  ctx = driver.context_of_config(config)
  algorithm = driver.build_algorithm(method, config)
  aux = algorithm.setup(ctx)
  state = algorithm.init(ctx, aux)
  after, _ = algorithm.step(ctx, aux, state, 0)
  spec = lambda tree: jax.tree.map(lambda a: (np.shape(a), np.asarray(a).dtype), tree)
  assert jax.tree.structure(after) == jax.tree.structure(state)
  assert spec(after) == spec(state)


@pytest.mark.parametrize(
  'method,overrides,every_epoch,dtype',
  [
    # DENSE's best batch an epoch, every epoch kept, stored as uint8 (its default)
    ('dense', {}, True, np.uint8),
    ('dense', {'dense.pool_quantize': False}, True, np.float32),
    # FedHydra keeps every synthesis iteration; kd_data='batch' reads the latest epoch alone
    ('fedhydra', {'fedhydra.kd_data': 'batch'}, False, np.uint8),
    ('fedhydra', {}, True, np.uint8),
  ],
)
def test_a_rounds_pool_holds_what_its_kd_reads_and_starts_empty(
  method, overrides, every_epoch, dtype
):
  """A round's fresh state: an empty pool sized for the images its KD reads (every epoch's,
  or the latest epoch's for kd_data='batch'), quantised as configured, and not stopped."""
  config = _config('smoke', model='mlp', **overrides)
  algorithm = driver.build_algorithm(method, config)
  ctx = driver.context_of_config(config)
  c = config[method]
  per_epoch = c.synthesis_batch * (c.T_G if method == 'fedhydra' else 1)
  aux = types.SimpleNamespace(settings=algorithm.recipe.settings(ctx), generator=None)
  aux.settings = aux.settings._replace(keep_generator=False)  # no generator to build here
  algorithm.recipe = algorithm.recipe._replace(init_extra=lambda ctx, aux, student: ())
  student = engine.init_model(
    get_model('mlp', 10, ctx.dataset.input_shape), ctx.dataset.input_shape, jax.random.key(0)
  )
  state = algorithm.fresh_state(ctx, aux, student, 1)
  capacity = per_epoch * (c.epochs if every_epoch else 1)
  assert state.pool.capacity == capacity and state.pool.images.dtype == dtype
  assert int(state.pool.count) == 0 and not bool(state.stopped)
  jax.tree.map(np.testing.assert_array_equal, state.student.model, student)


def test_a_later_rounds_student_starts_from_the_global_model_of_the_round_before(monkeypatch):
  """Round r > 1 of a method whose student starts at random (`init='random'`: DENSE,
  Co-Boosting, FedHydra): the server state of round r starts from the round before's global
  model `round_model(state)`, not from the run's random student."""
  config = _config('smoke,rounds=2', model='mlp')
  algorithm = driver.build_algorithm('dense', config)
  ctx = driver.context_of_config(config)
  aux = algorithm.setup(ctx)
  assert aux.settings.init == 'random'
  global_model = jax.tree.map(lambda a: a + 1.5, aux.random_student)
  recipe = algorithm.recipe._replace(round_model=lambda state: global_model)
  monkeypatch.setattr(algorithm, 'recipe', recipe)
  monkeypatch.setattr(common, 'train_groups', lambda t, g, starts, *a, **kw: (list(starts), []))
  state = algorithm.init(ctx, aux)
  started = []

  class Started(Exception):
    pass

  def fresh_state(ctx, aux, start, r):
    started.append((start, r))
    raise Started

  monkeypatch.setattr(algorithm, 'fresh_state', fresh_state)
  with pytest.raises(Started):
    algorithm.step(ctx, aux, state, aux.settings.epochs)  # round 2, epoch 1
  ((start, r),) = started
  assert r == 2
  jax.tree.map(np.testing.assert_array_equal, start, global_model)


@pytest.mark.parametrize('pool_images', [4, 3])
def test_a_fixed_kd_set_is_drawn_without_replacement_when_it_holds_a_batch(pool_images):
  """kd_data='fixed' (FedDF's unlabelled set): each step's batch is kd_batch distinct images
  when the set holds that many, drawn with replacement only from a smaller set; every mask
  entry is a real sample, as bool as the pool's epoch masks."""
  from jfed.distill.pool import pool_add, pool_init

  algorithm = driver.build_algorithm('dense', _config('smoke'))
  pool = pool_add(pool_init(pool_images, (2, 2, 1)), jnp.zeros((pool_images, 2, 2, 1)))
  algorithm.recipe = algorithm.recipe._replace(fixed_pool=lambda aux: pool)
  settings = types.SimpleNamespace(kd_data='fixed', kd_batch=4, steps_per_epoch=200)
  got, idx, mask = algorithm._kd_batches(
    types.SimpleNamespace(settings=settings), None, np.random.default_rng(0)
  )
  assert got is pool and idx.shape == mask.shape == (200, 4)
  assert mask.dtype == bool and mask.all()
  assert idx.min() >= 0 and idx.max() < pool_images
  distinct = {len(set(row)) for row in idx.tolist()}
  assert distinct == ({4} if pool_images == 4 else {1, 2, 3})


def _record_syntheses(monkeypatch) -> list:
  """Every call of the one-shot methods' synthesis from now on, as (the generator state it was
  given, its result), in order."""
  calls = []
  synthesize = oneshot.synthesize

  def recording(*args, generator_state=None, **kwargs):
    calls.append((generator_state, synthesize(*args, generator_state=generator_state, **kwargs)))
    return calls[-1][1]

  monkeypatch.setattr(oneshot, 'synthesize', recording)
  return calls


def test_fedhydra_carries_its_generator_from_epoch_to_epoch_and_dense_does_not(monkeypatch):
  """FedHydra Algorithm 1 line 10 keeps one generator through a round's epochs: epoch e's
  synthesis starts from the generator epoch e - 1 left. DENSE re-initialises it every epoch
  (no state passed). The round's sample grid shows the last epoch's last G(z) batch, though
  FedHydra's synthesis returns every iteration's images."""
  calls, passed, saved = _record_syntheses(monkeypatch), {}, {}
  config = _config('smoke', model='mlp')
  ctx = driver.context_of_config(config)
  first = {}
  for method in ('fedhydra', 'dense'):
    before = len(calls)
    algorithm = driver.build_algorithm(method, config)
    monkeypatch.setattr(
      algorithm, '_save_samples', lambda ctx, images, r: saved.setdefault(r, images)
    )
    aux = algorithm.setup(ctx)
    state = algorithm.init(ctx, aux)
    first[method] = state.generator
    for i in range(2):
      state, _ = algorithm.step(ctx, aux, state, i)
    passed[method] = calls[before:]
  (start_1, res_1), (start_2, res_2) = passed['fedhydra']
  assert jax.tree.leaves(first['fedhydra'])
  jax.tree.map(np.testing.assert_array_equal, start_1, first['fedhydra'])
  jax.tree.map(np.testing.assert_array_equal, start_2, res_1.generator)
  assert [start for start, _ in passed['dense']] == [None, None]
  batch = config.fedhydra.synthesis_batch
  assert len(res_2.images) > batch  # every iteration's images: the grid takes the last batch
  images, labels = saved[1]
  np.testing.assert_array_equal(images, res_2.images[-batch:])
  np.testing.assert_array_equal(labels, res_2.labels[-batch:])


def test_an_epochs_record_reports_its_synthesis_last_iteration_losses(monkeypatch):
  """The generator fields of an epoch's record: the synthesis' best loss, and its last
  iteration's total loss and components (BN, one-hot CE, adversarial), as DENSE logs them."""
  calls = _record_syntheses(monkeypatch)
  config = _config('smoke', model='mlp', **{'dense.g_steps': 3})
  ctx = driver.context_of_config(config)
  algorithm = driver.build_algorithm('dense', config)
  aux = algorithm.setup(ctx)
  _, (record,) = algorithm.step(ctx, aux, algorithm.init(ctx, aux), 0)
  ((_, res),) = calls
  losses, components = np.asarray(res.losses), np.asarray(res.components)
  assert len(losses) == len(components) > 2  # so that [-1] differs from [1] and [-2]
  assert record['gen_best_loss'] == float(res.best_loss)
  assert record['gen_loss'] == float(losses[-1])
  assert [record['gen_bn'], record['gen_oh'], record['gen_adv']] == components[-1].tolist()
  assert len(set(map(tuple, components[-3:].tolist()))) == 3


def test_fedhydra_starts_each_rounds_kept_generator_from_that_rounds_generator_key(monkeypatch):
  """FedHydra Algorithm 1 line 10: one generator per round, kept across its epochs; round r's
  is DENSE's re-init from derive_key(SERVER, 0, r, GENERATOR) (jfed.keys). DENSE, which
  re-initialises every epoch, keeps none."""
  config = _config('smoke')
  ctx = driver.context_of_config(config)
  states, generators = {}, {}
  for method in ('fedhydra', 'dense'):
    algorithm = driver.build_algorithm(method, config)
    monkeypatch.setattr(algorithm, 'round', lambda *a, **kw: None)  # no local training here
    aux = algorithm.setup(ctx)
    states[method] = [algorithm.init(ctx, aux)]
    states[method].append(algorithm.fresh_state(ctx, aux, aux.random_student, 2))
    generators[method] = aux.generator
  for r, state in enumerate(states['fedhydra'], start=1):
    key = ctx.derive_key(Purpose.SERVER, 0, r, ServerRoundPurpose.GENERATOR)
    want = dense_generator_init(key, generators['fedhydra'])
    assert jax.tree.leaves(want)
    jax.tree.map(np.testing.assert_array_equal, state.generator, want)
  assert all(jax.tree.leaves(s.generator) == [] for s in states['dense'])


def test_the_result_is_the_last_rounds_student_else_the_last_test_accuracy():
  algorithm = driver.build_algorithm('dense', _config('smoke,rounds=2'))
  history = [
    {'step': 1, 'test_accuracy': 0.3},
    {'step': 2, 'test_accuracy': 0.4, 'round_accuracy': 0.45},
    {'step': 3, 'test_accuracy': 0.6},
  ]
  assert algorithm.final_accuracy(history) == 0.45
  assert algorithm.final_accuracy(history[:1]) == 0.3  # no round ended yet
  assert algorithm.final_accuracy([]) is None


def test_the_accuracy_plot_draws_one_curve_per_round_over_its_epochs(tmp_path, monkeypatch):
  drawn = []
  monkeypatch.setattr(plots, 'plot_accuracy_vs_epoch', lambda *a, **kw: drawn.append((a, kw)))
  config = _config('smoke')
  algorithm = driver.build_algorithm('dense', config)
  epochs = [
    {'round': r, 'epoch': e, 'test_accuracy': r + e / 10} for r in (2, 1) for e in (1, 2, 3)
  ]
  algorithm._plot_accuracy(driver.context_of_config(config), epochs)
  assert not drawn
  algorithm._plot_accuracy(driver.context_of_config(config, workdir=tmp_path), epochs)
  (((path, curves), kw),) = drawn
  assert pathlib.Path(path) == tmp_path / 'distillation_accuracy.png'
  assert list(curves) == ['dense round 1', 'dense round 2']
  for r in (1, 2):
    assert curves[f'dense round {r}'] == ([1, 2, 3], [r + 0.1, r + 0.2, r + 0.3])
  assert kw == {'title': 'dense on digits: test accuracy vs distillation epoch'}


def test_multi_round_dense_numbers_steps_by_round_and_epoch_and_resumes_at_a_round_end(
  tmp_path, monkeypatch
):
  """Two rounds of two epochs (smoke budget, MLP clients: DENSE's learning with BN teachers is the
  end-to-end test's): steps count on across rounds, round 2's clients download the global model
  and upload again, and a run killed right after round 1's last checkpoint, or inside round 2,
  resumes to the uninterrupted result. Both rounds' clients train with the trainers built in
  setup: their step compiles once in the run."""
  config = _config('smoke,rounds=2', model='mlp')
  jax.clear_caches()  # programs are shared across runs (ClientProgram): count this run's own
  with monkeypatch.context() as m, compiles.count_compilations() as compiled:
    snapshot_every_step(m, tmp_path / 'killed')
    grids = record_sample_grids(m)
    whole = _run('dense', config, tmp_path / 'whole')
  assert compiled.counts()['jit(_loop_client_step)'] == 1
  # each round's last synthetic batch, every image tagged with the class it was generated for
  assert [name for name, *_ in grids] == ['synthetic_samples.png', 'synthetic_samples_round2.png']
  for _, images, labels, _ in grids:
    assert labels.shape == images.shape[:1] and set(labels.tolist()) <= set(range(10))
  records = _epochs(tmp_path / 'whole')
  assert [(r['round'], r['epoch'], r['step']) for r in records] == [
    (1, 1, 1),
    (1, 2, 2),
    (2, 1, 3),
    (2, 2, 4),
  ]
  assert len(whole['round_test_accuracy']) == 2 and whole['rounds'] == 2
  assert whole['final_test_accuracy'] == whole['round_test_accuracy'][-1]
  assert (tmp_path / 'whole' / 'round_models').exists()
  assert (tmp_path / 'whole' / 'synthetic_samples_round2.png').exists()
  assert records[2]['upload_bytes'] > 0 and records[2]['download_bytes'] > 0
  # killed at the round end, and inside round 2 (its data rebuilt from the run's stage cache)
  for killed_after in (2, 3):
    killed = tmp_path / 'killed' / str(killed_after)
    resumed = _run('dense', config, killed)
    assert read_metrics(killed) == read_metrics(tmp_path / 'whole')
    assert comparable_summary(resumed) == comparable_summary(whole)


def test_a_fedavg_init_without_a_client_of_the_server_architecture_starts_at_random_and_warns(
  tmp_path, caplog
):
  """init='fedavg' averages the uploads of the server's architecture; with none (MLP clients, a
  CNNMnist student) the student starts from its random init, and the log says so."""
  caplog.set_level(logging.WARNING, logger='absl')
  config = _config(
    'smoke', model='mlp', **{'dense.init': 'fedavg', 'dense.server_model': 'cnn_mnist'}
  )
  summary = _run('dense', config, tmp_path)
  assert summary['server_model'] == 'cnn_mnist'
  warnings = [r.getMessage() for r in caplog.records if 'random init' in r.getMessage()]
  assert warnings == ['dense: no client has the server architecture cnn_mnist; random init']


def test_feddf_early_stop_leaves_the_round_and_resumes_inside_it(tmp_path, monkeypatch):
  """patience 0: every round stops after its first epoch; the remaining steps record nothing
  and write no checkpoint (at the paper's budget each would be 1 GiB of unchanged teachers). A
  run killed inside a stopped round resumes to the uninterrupted result. Smoke budget with four
  epochs a round, MLP clients (FedDF's learning is the end-to-end test's)."""
  overrides = {'feddf.patience': 0, 'feddf.total_steps': 8, 'feddf.eval_every': 2}
  config = _config('smoke,rounds=2', model='mlp', **overrides)
  with monkeypatch.context() as m:
    snapshot_every_step(m, tmp_path / 'killed')
    whole = _run('feddf', config, tmp_path / 'whole')
  records = _epochs(tmp_path / 'whole')
  assert [(r['round'], r['epoch'], r['step']) for r in records] == [(1, 1, 1), (2, 1, 5)]
  assert all(r['early_stop'] for r in records) and whole['early_stopped']
  assert whole.steps == 8 and whole['final_test_accuracy'] == records[-1]['round_accuracy']
  assert sorted(int(p.name) for p in (tmp_path / 'killed').iterdir()) == [1, 5]
  resumed = _run('feddf', config, tmp_path / 'killed' / '1')
  assert read_metrics(tmp_path / 'killed' / '1') == read_metrics(tmp_path / 'whole')
  assert comparable_summary(resumed) == comparable_summary(whole)


def test_multi_round_feddf_starts_every_round_from_that_rounds_fedavg(tmp_path, monkeypatch):
  """FedDF (Lin et al. Alg. 1): each round's student is the FedAvg of that round's uploads,
  not the previous round's global model (which made multi-round FedDF stall near its round-4
  accuracy on Fashion-MNIST: the clients' progress reached the server only through the KD).
  Its per-step cosine starts again every round; an epoch records its last step's rate."""
  from jfed.methods import oneshot  # pylint: disable=g-import-not-at-top

  averages, starts = [], []
  average = oneshot.fedavg_of_matching
  fresh = oneshot.DistillationAlgorithm.fresh_state

  def record_average(local, spec):
    averages.append(average(local, spec))
    return averages[-1]

  def record_start(self, ctx, aux, student, r):
    starts.append((r, student))
    return fresh(self, ctx, aux, student, r)

  monkeypatch.setattr(oneshot, 'fedavg_of_matching', record_average)
  monkeypatch.setattr(oneshot.DistillationAlgorithm, 'fresh_state', record_start)
  overrides = {'feddf.total_steps': 6, 'feddf.eval_every': 3}
  config = _config('smoke,rounds=2', model='mlp', **overrides)
  _run('feddf', config, tmp_path)
  round2 = [student for r, student in starts if r == 2]
  assert len(averages) == 2 and round2  # one FedAvg per round, round 2's is its start
  # each round's cosine runs over its 6 KD steps; an epoch records the rate of its last step
  cosine = lambda step: 0.5 * config.feddf.kd_lr * (1 + math.cos(math.pi * step / 6))
  records = _epochs(tmp_path)
  assert [(r['round'], r['kd_steps']) for r in records] == [(1, 3), (1, 3), (2, 3), (2, 3)]
  np.testing.assert_allclose([r['lr'] for r in records], [cosine(s) for s in (2, 5, 2, 5)])
  for got, want in zip(jax.tree.leaves(round2[0].params), jax.tree.leaves(averages[-1].params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_multi_round_workdir_keeps_the_last_three_rounds_client_models(tmp_path):
  """Round r's client models are a stage of the workdir, read by round r + 1 and by a run
  resumed inside round r; the older rounds' are deleted, so that a run of many rounds (all
  clients' models each round) does not fill the disk."""
  config = _config('smoke,rounds=5', model='mlp', **{'feddf.total_steps': 1, 'feddf.eval_every': 1})
  _run('feddf', config, tmp_path)
  kept = sorted(int(p.name) for p in (tmp_path / 'round_models').iterdir() if p.name.isdigit())
  assert kept == [3, 4, 5]  # round 1's models are the cached local models, not this stage


def test_stored_kd_targets_of_a_later_round_are_that_rounds_teachers_logits(tmp_path, monkeypatch):
  """With the teachers' logits stored once per round (no KD augmentation, eval-mode teachers),
  every KD step of round r reads round r's teachers: FedDF's fixed set holds the same images
  in both rounds, so a store kept across rounds would hand round 2 the logits of round 1's
  teachers. Checked against the mean of the teachers' logits computed in NumPy."""
  calls = []
  run = oneshot.run_kd_steps

  def record(programs, ts, teachers, pool, epoch, key, targets=None, **kwargs):
    calls.append((teachers.states, pool, targets))
    return run(programs, ts, teachers, pool, epoch, key, targets, **kwargs)

  monkeypatch.setattr(oneshot, 'run_kd_steps', record)
  overrides = {'feddf.total_steps': 2, 'feddf.eval_every': 2, 'feddf.teacher_bn': 'running'}
  _run('feddf', _config('smoke,rounds=2', model='mlp', **overrides), tmp_path)
  assert len(calls) == 2  # one epoch a round
  for t_states, pool, targets in calls:
    assert targets is not None  # stored, not recomputed per step
    (params,) = [s.params for s in t_states]  # one MLP group, stacked over its clients
    n = int(pool.count)
    images = np.asarray(pool.images, np.float64)[:n]
    clients = len(jax.tree.leaves(params)[0])
    want = np.mean(
      [onp.mlp_forward(onp.take_client(params, c), images) for c in range(clients)], axis=0
    )
    np.testing.assert_allclose(np.asarray(targets)[:n], want, rtol=1e-4, atol=1e-4)
  # the two rounds' teachers differ, so a stale store would have failed above
  assert not np.allclose(np.asarray(calls[0][2]), np.asarray(calls[1][2]), atol=1e-3)


def _made_by(producer_file, stage, seed, model):
  made = json.loads(producer_file.read_text())
  return made['stage'] == stage and made['run']['seed'] == seed and made['run']['model'] == model


@pytest.mark.slow  # the quick budget's client models (shared with the end-to-end tests)
def test_oneshot_fedavg_averages_the_shared_local_models(tmp_path, local_dir):
  """`fedavg.reuse_local_models` (the Table 1/2 sweep): one-shot FedAvg is the size-weighted
  average of the very client models the distillation methods start from."""
  config = _config(local_models_dir=local_dir, **{'fedavg.reuse_local_models': True})
  summary = _run('fedavg', config, tmp_path / 'fedavg')  # fills local_dir if empty
  assert summary['reused_local_models'] and summary['rounds'] == 1
  assert summary['final_test_accuracy'] > LEARNED

  ds = driver.hold_out(config, load_dataset('digits'))
  parts = driver.partition_clients(config, ds.train_y)
  module = get_model(config.model, ds.num_classes, ds.input_shape)
  template = engine.init_models(module, ds.input_shape, jax.random.PRNGKey(0), len(parts))
  # the run's models sit in local_dir's subfolder of their producer (this seed and model)
  (folder,) = [
    f.parent
    for f in pathlib.Path(local_dir).glob('*/producer.json')
    if _made_by(f, stage='local_models', seed=config.seed, model=config.model)
  ]
  step, (models,), _ = Checkpointer(folder).restore_latest([template])
  assert step == config.fedavg.local_epochs
  average = engine.weighted_average(models, np.array([len(p) for p in parts]))
  want = engine.Evaluator(module, 256).accuracy(average, ds.test_x, ds.test_y)
  assert summary['final_test_accuracy'] == pytest.approx(want, abs=1e-6)

  with pytest.raises(ValueError, match='rounds = 1'):
    _run('fedavg', override(config, **{'fedavg.rounds': 2}), tmp_path / 'bad')


@pytest.mark.parametrize('augment', [False, True])
def test_coboosting_synthesises_from_unaugmented_generator_output_as_its_reference(augment):
  """coboost.py:synthesize feeds normalizer(G(z)) to the teachers; crop/flip is an option."""
  config = fedhydra_digits.get_config('smoke')
  if augment:
    config.coboosting.synthesis_augment = True
  ctx = driver.context_of_config(config)
  settings = driver.build_algorithm('coboosting', config).recipe.settings(ctx)
  assert settings.synthesis.augment is augment


def test_feddf_distils_on_an_out_of_domain_source_and_validates_on_held_out_training_images():
  """`feddf.source=<dataset>`: unlabelled images of another dataset's training split, resized
  to the clients' input shape; the validation images are training images no client holds
  (`val_split='holdout'`) or training images of the clients (`'train'`); no test image."""
  from jfed.data.transforms import match_input_shape  # pylint: disable=g-import-not-at-top
  from jfed.methods.feddf import distillation_data  # pylint: disable=g-import-not-at-top

  config = fedhydra_digits.get_config('smoke')
  config.feddf.source, config.feddf.source_size, config.feddf.val_size = 'digits', 50, 30
  digits = load_dataset('digits')
  # The clients see 16x16 images here, so the source must be resized to them.
  clients = digits._replace(
    train_x=match_input_shape(digits.train_x, (16, 16, 1)),
    test_x=match_input_shape(digits.test_x, (16, 16, 1)),
  )
  clients = driver.hold_out(config, clients)
  ctx = driver.make_context(config, clients, driver.partition_clients(config, clients.train_y))
  data = distillation_data(ctx, driver.build_algorithm('feddf', config).config)
  assert int(data.pool.count) == 50 and data.pool.images.shape[1:] == (16, 16, 1)
  sources = match_input_shape(digits.train_x, (16, 16, 1)).reshape(len(digits.train_x), -1)
  pool = np.asarray(data.pool.images[:50]).reshape(50, -1)
  # every pool image is one of the source's training images, resized (nearest in L2 is exact)
  d = ((pool[:, None, :] - sources[None, :, :]) ** 2).sum(-1)
  assert np.allclose(d.min(1), 0.0, atol=1e-8)

  def drawn_from(x, images):
    flat = images.reshape(len(images), -1)
    return np.allclose(((x.reshape(len(x), -1)[:, None] - flat[None]) ** 2).sum(-1).min(1), 0.0)

  assert len(data.val_y) == 30 and drawn_from(np.asarray(data.val_x), clients.holdout_x)
  # val_split='train': the validation images are training images of the clients
  config.feddf.val_split = 'train'
  data = distillation_data(ctx, driver.build_algorithm('feddf', config).config)
  assert len(data.val_y) == 30 and drawn_from(np.asarray(data.val_x), clients.train_x)


def test_fedhydra_kd_data_batch_distils_each_epoch_on_that_epochs_images_only(tmp_path):
  """kd_data='batch': the pool holds one synthesis epoch (every generator step's batch), so each
  epoch's KD is one shuffled pass over that epoch's images, not over every epoch's."""
  config = _config('smoke', model='mlp', **{'fedhydra.kd_data': 'batch'})
  _run('fedhydra', config, tmp_path)
  records = _epochs(tmp_path)
  per_epoch = config.fedhydra.synthesis_batch * config.fedhydra.T_G
  steps = math.ceil(per_epoch / config.fedhydra.kd_batch)
  assert len(records) > 1
  assert [(r['pool_size'], r['kd_steps']) for r in records] == [(per_epoch, steps)] * len(records)


def test_fedhydra_stored_teacher_targets_give_the_numbers_of_per_step_teachers(
  tmp_path, monkeypatch
):
  """FedHydra's KD computes each pool image's SA target once, when the image enters the pool
  (`oneshot.KDTargets`), instead of at every KD step: over two rounds (new teachers and MS
  weights in round 2) the records and the result are those of the per-step teachers
  (`kd_step`), every stored image's target is computed once, and no step runs the
  teachers."""
  from jfed.methods import fedhydra, oneshot  # pylint: disable=g-import-not-at-top

  config = _config('smoke,rounds=2', model='mlp')
  calls = {'rows': 0, 'kd_step': 0}
  from jfed.distill import kd  # pylint: disable=g-import-not-at-top

  teacher_rows, per_step = oneshot.pool_teacher_logits, kd.kd_step

  def counted_rows(programs, teachers, pool, idx):
    calls['rows'] += int(idx.shape[0])
    return teacher_rows(programs, teachers, pool, idx)

  def counted_step(*args):
    calls['kd_step'] += 1
    return per_step(*args)

  monkeypatch.setattr(oneshot, 'pool_teacher_logits', counted_rows)
  monkeypatch.setattr(kd, 'kd_step', counted_step)  # one call a step on the CPU
  made, make_generator = [], oneshot.make_generator
  monkeypatch.setattr(
    oneshot, 'make_generator', lambda *a, **kw: made.append(a[3:]) or make_generator(*a, **kw)
  )
  stored = _run('fedhydra', config, tmp_path / 'stored')
  assert made == [('fedhydra',)]  # the paper's generator (§4.1.3), FedHydra's default
  records = _epochs(tmp_path / 'stored')
  assert calls['kd_step'] == 0
  pool_per_round = max(r['pool_size'] for r in records)
  per_epoch = config.fedhydra.synthesis_batch * config.fedhydra.T_G
  assert per_epoch % config.fedhydra.kd_batch == 0  # whole blocks: no slot computed twice
  assert calls['rows'] == 2 * pool_per_round
  monkeypatch.setattr(
    fedhydra.FedHydra,
    'make_recipe',
    lambda self: fedhydra.recipe(self.config)._replace(kd_agg_fixed_in_round=False),
  )
  per_step_run = _run('fedhydra', config, tmp_path / 'per_step')
  assert calls['kd_step'] == sum(r['kd_steps'] for r in records)
  reference = _epochs(tmp_path / 'per_step')
  assert [r['kd_steps'] for r in records] == [r['kd_steps'] for r in reference]
  np.testing.assert_allclose(
    [r['kd_loss'] for r in records], [r['kd_loss'] for r in reference], rtol=1e-4
  )
  np.testing.assert_allclose(
    [r['test_accuracy'] for r in records], [r['test_accuracy'] for r in reference], atol=0.01
  )
  final = per_step_run['final_test_accuracy']
  assert stored['final_test_accuracy'] == pytest.approx(final, abs=0.01)
