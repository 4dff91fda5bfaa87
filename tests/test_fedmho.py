"""FedMHO / FedCVAE machinery: CVAE clients on the shared engine, their uploads, the server's
sample counts, the prototype vote of one-shot FedAvg, and (slow) that FedMHO-MD learns."""

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfed import driver, engine
from jfed.configs import fedmho_digits
from jfed.cvae import CVAE, decoder_kd, generation_counts
from jfed.cvae import clients as cvae_clients
from jfed.cvae.server import FusionTrainer, SyntheticSet
from jfed.data import class_count_table, federate, load_dataset
from jfed.engine import compiles
from jfed.errors import ConfigError, NonFiniteError
from jfed.io import DecoderUpload, UploadError, serialized_nbytes, validate_decoder_upload
from jfed.keys import Purpose, ServerRoundPurpose
from jfed.methods import common, fedcvae, generative, get_method
from jfed.models import get_model
from tests.support import override, read_metrics, record_sample_grids, smoke_config


def _cvae_group(sizes=(37, 12, 25)):
  ds = load_dataset('digits')
  rng = np.random.default_rng(0)
  parts = np.split(rng.permutation(len(ds.train_y))[: sum(sizes)], np.cumsum(sizes)[:-1])
  fed = federate(ds.train_x, ds.train_y, parts)
  module = cvae_clients.build_cvae({'size': 'small'}, 10, ds.input_shape)
  init = cvae_clients.init_cvae(module, ds.input_shape, jax.random.PRNGKey(0))
  return module, fed, engine.replicate(init, len(sizes)), class_count_table(ds.train_y, parts, 10)


def _train_cvaes(strategy, epochs=2):
  module, fed, models, _ = _cvae_group()
  tx = engine.make_optimizer('adam', 1e-3)
  trainer = engine.GroupTrainer(
    module, tx, 8, strategy=strategy, objective=cvae_clients.cvae_objective()
  )
  return trainer.train(engine.init_train_state(tx, models), fed, epochs, jax.random.PRNGKey(1))


def test_cvae_clients_train_the_same_under_every_strategy_and_their_loss_falls():
  results = {s: _train_cvaes(s) for s in ('loop', 'vmap', 'scan')}
  ref_state, ref_metrics = results['loop']
  for s in ('vmap', 'scan'):
    state, metrics = results[s]
    for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(state)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(ref_metrics.loss, metrics.loss, rtol=1e-4)
  # Eq. 3 per sample of 64 pixels starts near 64·ln 2 ≈ 44 and must fall within two epochs.
  assert np.all(ref_metrics.loss[:, 1] < ref_metrics.loss[:, 0])


def test_each_client_kind_compiles_its_step_once():
  """A CVAE group and a classifier group: one program per kind, not one per client or epoch."""
  jax.clear_caches()
  with compiles.count_compilations() as compiled:
    _train_cvaes('loop', epochs=3)
    ds = load_dataset('digits')
    fed = federate(ds.train_x, ds.train_y, [np.arange(40), np.arange(40, 70)])
    module = get_model('mlp', 10, ds.input_shape)
    tx = engine.make_optimizer('sgd', 0.05)
    models = engine.init_models(module, ds.input_shape, jax.random.PRNGKey(0), 2)
    engine.GroupTrainer(module, tx, 8, strategy='loop').train(
      engine.init_train_state(tx, models), fed, 3, jax.random.PRNGKey(1)
    )
  assert compiled.counts()['jit(_loop_client_step)'] == 2, compiled.summary()


def test_decoder_uploads_are_validated_and_their_bytes_counted():
  module, fed, models, counts = _cvae_group()
  counts = counts.astype(np.int32)
  np.testing.assert_array_equal(counts.sum(1), fed.sizes)
  template = engine.take(models, 0)
  got = cvae_clients.receive_decoder_uploads(np.array([4, 7, 9]), models, counts, template)
  one = DecoderUpload(4, int(fed.sizes[0]), template.params['decoder'], counts[0])
  assert got.upload_bytes == 3 * serialized_nbytes(one._asdict())
  assert got.upload_bytes > 3 * 4 * 10_000  # the decoder's ~20k float32 parameters
  decoder = template.params['decoder']
  bad = [
    DecoderUpload(4, 5, decoder, counts[0]),  # counts do not sum to num_samples
    DecoderUpload(4, int(fed.sizes[0]), decoder, counts[0, :9]),  # a class missing
    DecoderUpload(4, int(fed.sizes[0]), decoder, counts[0].astype(np.float32)),
    DecoderUpload(4, int(fed.sizes[0]), jax.tree.map(lambda a: a * np.nan, decoder), counts[0]),
    DecoderUpload(4, int(fed.sizes[0]), jax.tree.map(lambda a: a[:1], decoder), counts[0]),
  ]
  for upload in bad:
    with pytest.raises(UploadError):
      validate_decoder_upload(upload, decoder, 10)


def test_decoder_sample_counts_follow_the_reference():
  # int(share · N) per decoder, the last the remainder (`generate_dataset_from_user_decoders`).
  np.testing.assert_array_equal(
    fedcvae.decoder_sample_counts([30, 50, 20], 1001, True), [300, 500, 201]
  )
  np.testing.assert_array_equal(
    fedcvae.decoder_sample_counts([30, 50, 20], 1001, False), [333, 333, 335]
  )
  for weighted in (True, False):  # counts, to size arrays and slices with
    assert fedcvae.decoder_sample_counts([30, 50, 20], 1001, weighted).dtype == np.int64


def test_decoded_labels_and_counts_are_what_was_asked():
  module, fed, models, group_counts = _cvae_group()
  counts = np.array([[3, 0, 1] + [0] * 7, [0, 2, 0] + [0] * 7, [0] * 10])
  labels, real = cvae_clients.labels_of_counts(counts)
  assert labels.shape == (3, 4) and real.sum() == 6
  uploads = cvae_clients.receive_decoder_uploads(
    np.arange(3), models, group_counts.astype(np.int32), engine.take(models, 0)
  )
  z = jax.random.normal(jax.random.PRNGKey(0), (3, 4, module.latent))
  images, y, owner = cvae_clients.generate(module, uploads, labels, real, z)
  assert images.shape == (6, 8, 8, 1) and 0.0 <= images.min() and images.max() <= 1.0
  np.testing.assert_array_equal(y, [0, 0, 0, 2, 1, 1])
  np.testing.assert_array_equal(owner, [0, 0, 0, 0, 1, 1])
  # rows padded to the longest one, and never wider: one sample in all is one column
  labels, real = cvae_clients.labels_of_counts(np.array([[0, 1], [0, 0]]))
  assert labels.tolist() == [[1], [0]] and real.tolist() == [[True], [False]]


def test_fedavg_vote_is_the_argmax_of_the_mean_prototype_logits():
  config = fedmho_digits.get_config('baselines,smoke')
  ctx = driver.context_of_config(config)
  ds = ctx.dataset
  algorithm = get_method('fedavg_vote').from_config(config)
  local = algorithm.setup(ctx)
  _, (record,) = algorithm.step(ctx, local, algorithm.init(ctx, local), 0)
  assert len(local.groups) == 2
  logits = []
  for g, m in zip(local.groups, local.models):
    average = jax.tree.map(lambda a: np.mean(np.asarray(a), axis=0), m)  # uniform, by hand
    logits.append(engine.Evaluator(g.module).logits(average, ds.test_x))
  vote = np.mean(np.argmax(np.mean(logits, axis=0), -1) == ds.test_y)
  assert record['test_accuracy'] == pytest.approx(vote, abs=1e-6)
  accs = [np.mean(np.argmax(lg, -1) == ds.test_y) for lg in logits]
  assert list(record['prototype_test_accuracy'].values()) == pytest.approx(accs, abs=1e-6)


@pytest.mark.slow
def test_fedmho_md_learns_on_digits_above_its_initial_global_model():
  summary = driver.run_in_memory('fedmho_md', fedmho_digits.get_config())
  initial = summary['initial_test_accuracy']
  assert summary['final_test_accuracy'] > 0.35, summary['final_test_accuracy']
  assert summary['final_test_accuracy'] > initial + 0.1, (summary['final_test_accuracy'], initial)
  assert summary['synthetic_kept'] == sum(summary['synthetic_kept_per_class'])


def test_feddf_vote_is_the_argmax_of_the_mean_logits_of_its_best_students():
  config = fedmho_digits.get_config('baselines,smoke')
  config.feddf.update({'local_epochs': 1, 'total_steps': 4, 'eval_every': 2, 'patience': 100})
  ctx = driver.context_of_config(config)
  algorithm = get_method('feddf_vote').from_config(config)
  aux = algorithm.setup(ctx)
  state = algorithm.init(ctx, aux)
  records = []
  for i in range(algorithm.num_steps(ctx)):
    state, rs = algorithm.step(ctx, aux, state, i)
    records += rs
  assert aux.prototypes == ('mlp', 'fedmho_cnn') and algorithm.num_steps(ctx) == 4
  assert [r['prototype'] for r in records[:-1]] == ['mlp'] * 2 + ['fedmho_cnn'] * 2
  eval_x, eval_y = aux.auxes[0].eval_x, aux.auxes[0].eval_y
  logits = [
    engine.Evaluator(x.student_module).logits(s.extra.best, eval_x)
    for x, s in zip(aux.auxes, state)
  ]
  vote = np.mean(np.argmax(logits[0] + logits[1], -1) == eval_y)
  assert records[-1]['test_accuracy'] == pytest.approx(vote, abs=1e-6)
  # each student started from its own architecture's clients: not the same model twice
  assert jax.tree.structure(state[0].extra.best) != jax.tree.structure(state[1].extra.best)


def test_decoder_distillation_loss_is_the_summed_bce_over_the_batch_and_falls():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 4, 4, 1)).astype(np.float32)
  target = rng.uniform(size=(5, 4, 4, 1)).astype(np.float32)
  weights = np.array([1, 1, 1, 0, 0], np.float32)
  p = 1 / (1 + np.exp(-logits.astype(np.float64)))
  bce = -(target * np.log(p) + (1 - target) * np.log(1 - p))  # by hand
  expected = bce[:3].reshape(3, -1).sum(1).mean()
  assert float(decoder_kd.decoder_recon_loss(logits, target, weights)) == pytest.approx(
    expected, rel=1e-5
  )
  one = np.array([0, 1, 0, 0, 0], np.float32)  # a batch with a single real sample
  assert float(decoder_kd.decoder_recon_loss(logits, target, one)) == pytest.approx(
    bce[1].sum(), rel=1e-5
  )

  ds = load_dataset('digits')
  teacher_module = cvae_clients.build_cvae({'size': 'small'}, 10, ds.input_shape)
  teacher = cvae_clients.init_cvae(teacher_module, ds.input_shape, jax.random.PRNGKey(0))
  z = jax.random.normal(jax.random.PRNGKey(1), (96, teacher_module.latent))
  y = jax.numpy.arange(96) % 10
  x = jax.nn.sigmoid(teacher_module.apply({'params': teacher.params}, z, y, method='decode'))
  student = cvae_clients.init_cvae(teacher_module, ds.input_shape, jax.random.PRNGKey(2))
  distiller = decoder_kd.DecoderDistiller(teacher_module, engine.make_optimizer('adam', 1e-2))
  ts = distiller.init(engine.ModelState(student.params['decoder'], {}))
  data = decoder_kd.DecoderTargets(z, y, x)
  losses = []
  for e in range(5):
    ts, loss = distiller.epoch(ts, data, 32, np.random.default_rng(e))
    losses.append(loss)
  # BCE against soft targets is their entropy plus the KL to them: the KL part must shrink
  t = np.asarray(x, np.float64)
  entropy = -(t * np.log(t) + (1 - t) * np.log(1 - t)).reshape(len(t), -1).sum(1).mean()
  gaps = [loss - entropy for loss in losses]
  assert gaps[-1] < 0.5 * gaps[0], gaps


def test_decoder_distillation_of_a_batchnorm_decoder_trains_on_the_real_rows_decodes_in_eval():
  """FedCVAE's v0 server decoder (BatchNorm): a distillation step runs BatchNorm in train mode on
  the batch's real rows only (a padded batch steps exactly as the real rows alone, and the
  running statistics move); decoding runs in eval mode (a sample decodes the same alone or in a
  batch)."""
  module = CVAE(10, (8, 8, 1), 'v0', latent=4)
  full = cvae_clients.init_cvae(module, (8, 8, 1), jax.random.PRNGKey(0))
  decoder = engine.ModelState(full.params['decoder'], full.batch_stats['decoder'])
  # SGD: Adam's first step is lr·sign(g), which float32 rounding flips where g is near 0
  distiller = decoder_kd.DecoderDistiller(module, engine.make_optimizer('sgd', 0.1))
  ts = distiller.init(decoder)
  rng = np.random.default_rng(0)
  data = decoder_kd.DecoderTargets(
    jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
    jnp.arange(6) % 10,
    jnp.asarray(rng.uniform(size=(6, *module.native_shape)), jnp.float32),
  )
  alone, alone_loss = distiller._step(ts, data, jnp.arange(6), jnp.ones(6, bool))
  padded_idx, padded_mask = jnp.array([0, 1, 2, 3, 4, 5, 0, 0]), jnp.arange(8) < 6
  padded, padded_loss = distiller._step(ts, data, padded_idx, padded_mask)
  assert float(padded_loss) == pytest.approx(float(alone_loss), rel=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), alone.model, padded.model
  )
  moved = jax.tree.map(
    lambda a, b: not np.allclose(a, b), alone.model.batch_stats, decoder.batch_stats
  )
  assert all(jax.tree.leaves(moved))  # train mode: the running statistics took a step
  batch = distiller.decode(alone.model, data.z, data.y)
  single = distiller.decode(alone.model, data.z[:1], data.y[:1])
  np.testing.assert_allclose(single[0], batch[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fedcvae_kd_learns_on_digits():
  summary = driver.run_in_memory('fedcvae_kd', fedmho_digits.get_config('fedcvae_kd'))
  assert summary['final_test_accuracy'] > 0.4, summary['final_test_accuracy']


@pytest.mark.slow
def test_fedcvae_ens_with_its_own_v0_cvae_learns_on_digits():
  """Every client FedCVAE's v0 CVAE (32x32, BatchNorm; eval-mode decoding with the uploaded
  running statistics): the server classifier trained only on decoded samples beats chance (0.1)
  clearly. Measured 0.814 at this budget (15 CVAE epochs of Adam 3e-3; the variant's
  fedcvae_classifier, per-client CVAE inits); 0.844 with same_init, 0.453 with the VGG-9
  server model and one init per spec (before the variant took the reference's)."""
  config = fedmho_digits.get_config('fedcvae_v0')
  config.fedcvae.update({'cvae_epochs': 15, 'cvae_lr': 3e-3})
  summary = driver.run_in_memory('fedcvae_ens', config)
  assert summary['final_test_accuracy'] > 0.3, summary['final_test_accuracy']


def _diverge(monkeypatch, diverged):
  """Local CVAE training whose clients `diverged` ({group: [member index]}) end non-finite."""
  real_train = common.train_groups

  def train(*args, **kwargs):
    models, metrics = real_train(*args, **kwargs)
    if kwargs.get('label') == 'local CVAE training':
      models = [
        jax.tree.map(lambda a, rows=tuple(diverged.get(g, ())): a.at[rows, ...].set(np.nan), m)
        for g, m in enumerate(models)
      ]
    return models, metrics

  monkeypatch.setattr(generative.common, 'train_groups', train)


def test_a_diverged_cvae_client_is_excluded_and_the_run_goes_on(monkeypatch):
  """A CVAE whose training went non-finite sends a decoder the server cannot use: the server
  drops it (with the others' uploads received) instead of failing the run."""
  _diverge(monkeypatch, {0: [1]})  # the second client of the first group
  config = fedmho_digits.get_config('smoke')
  # N_syn at which the excluded decoder's share changes the total (the rounding of 200 hides it)
  config.fedmho.num_synthetic = 2000
  ctx = driver.context_of_config(config)
  ds = ctx.dataset
  cvaes = generative.local_cvaes(ctx, generative.CVAESettings(1, 'adam', 1e-3, 32, 'bce', 1.0))
  group = cvaes.groups[0]
  assert cvaes.excluded == [int(group.client_ids[1])]
  np.testing.assert_array_equal(cvaes.uploads[0].client_ids, np.delete(group.client_ids, 1))
  summary = driver.run_in_memory('fedmho_sd', config)
  assert summary['excluded_cvae_clients'] == cvaes.excluded
  assert np.isfinite(summary['final_test_accuracy'])

  def owed(ids):  # samples the decoders of `ids` generate: their class counts' share of N_syn
    counts = np.stack([np.bincount(ds.train_y[ctx.parts[k]], minlength=10) for k in ids])
    return int(generation_counts(counts, config.fedmho.num_synthetic).sum())

  # the server generated from the other decoders only, every sample they owe
  every = np.concatenate([g.client_ids for g in cvaes.groups])
  kept = [int(k) for k in every if int(k) not in cvaes.excluded]
  assert summary['synthetic_generated'] == owed(kept) != owed(every), (owed(kept), owed(every))


def test_cvae_small_clients_train_at_their_own_learning_rate_when_set():
  """FedMHO's reference trains CVAE-small at Adam 5e-2 and CVAE-large at 1e-3 (MNIST family)."""
  ds = load_dataset('digits')
  small = cvae_clients.build_cvae({'size': 'small'}, 10, ds.input_shape)
  large = cvae_clients.build_cvae({'size': 'large'}, 10, ds.input_shape)
  s = generative.CVAESettings(1, 'adam', 1e-3, 32, 'bce', 1.0, 5e-2)
  assert generative.group_lr(small, s) == 5e-2 and generative.group_lr(large, s) == 1e-3
  assert generative.group_lr(small, s._replace(small_lr=0.0)) == 1e-3


@pytest.mark.parametrize('module', ['fedmho_fashion_mnist', 'fedmho_digits'])
def test_every_run_of_the_fedmho_table_holds_out_the_same_training_samples(module, tmp_path):
  """One scoring protocol per table: every run holds the same training samples out of its
  clients (FedDF's distillation and validation images come from them), and the FEDCVAE row runs
  FedMHO's server protocol with FedMHO's server steps."""
  from experiments import fedmho_tables  # pylint: disable=g-import-not-at-top
  from experiments.seed_tables import load_config_module  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(__file__).parents[1] / 'experiments' / 'configs' / f'{module}.py'
  config_module = load_config_module(str(path), f'table_{module}')
  configs = {
    name: fedmho_tables.run_config(config_module, '', run, 0.5, 0, tmp_path)
    for name, run in fedmho_tables.RUNS.items()
  }
  sizes = {name: c.dataset.holdout_size for name, c in configs.items()}
  assert len(set(sizes.values())) == 1 and min(sizes.values()) > 0, sizes
  feddf = configs['feddf_vote'].feddf
  assert feddf.source == 'holdout'
  assert feddf.source_size + feddf.val_size * (feddf.val_split == 'holdout') <= sizes['feddf_vote']
  ens, mho = configs['fedcvae_ens'], configs['fedmho']
  assert ens.fedcvae.protocol == 'fedmho'
  for key in ('num_synthetic', 'clean_rate', 'epochs', 'lr', 'batch'):
    assert ens.fedcvae[key] == mho.fedmho[key], key


_FLOAT_KEYS = ('cvae_lr', 'z_bound', 'lr', 'decoder_lr')  # the rest are ints


def _zero_refused(section, name):
  """validate's message for `section.name = 0` (printed as the key's type: 0 or 0.0)."""
  return f'{section}.{name} must be positive, got {0.0 if name in _FLOAT_KEYS else 0}'


_FEDMHO_POSITIVE = (
  'local_epochs',
  'cvae_epochs',
  'cvae_lr',
  'cvae_batch',
  'num_synthetic',
  'epochs',
  'lr',
  'batch',
)


@pytest.mark.parametrize(
  'overrides, message',
  [({f'fedmho.{name}': 0}, _zero_refused('fedmho', name)) for name in _FEDMHO_POSITIVE]
  + [
    ({'fedmho.clean_rate': 0.0}, 'fedmho.clean_rate must be in (0, 1], got 0.0'),
    ({'fedmho.clean_rate': 1.5}, 'fedmho.clean_rate must be in (0, 1], got 1.5'),
    ({'fedmho.lam': -0.1}, 'fedmho.lam must be in [0, 1], got -0.1'),
    ({'fedmho.lam': 1.1}, 'fedmho.lam must be in [0, 1], got 1.1'),
    (
      {'fedmho.cvae_optimizer': 'rmsprop'},
      "fedmho.cvae_optimizer is 'rmsprop'; valid: sgd, adam",
    ),
    ({'fedmho.cvae_recon': 'l1'}, "fedmho.cvae_recon is 'l1'; valid: bce, mse"),
    ({'fedmho.kl_reduction': 'sum'}, "fedmho.kl_reduction is 'sum'; valid: batchmean, mean"),
  ],
  ids=list(_FEDMHO_POSITIVE)
  + ['clean_rate_0', 'clean_rate_over_1', 'lam_below_0', 'lam_over_1', 'optimizer', 'recon', 'kl'],
)
def test_bad_fedmho_settings_are_refused_with_their_whole_message(overrides, message):
  config = override(fedmho_digits.get_config('smoke'), **overrides)
  for method in ('fedmho', 'fedmho_md', 'fedmho_sd'):
    with pytest.raises(ConfigError) as info:
      driver.build_algorithm(method, config)
    assert str(info.value) == message


@pytest.mark.parametrize(
  'overrides',
  [
    {'fedmho.clean_rate': 1.0, 'fedmho.lam': 0.0},
    {'fedmho.lam': 1.0, 'fedmho.cvae_optimizer': 'sgd', 'fedmho.cvae_recon': 'mse'},
    {'fedmho.kl_reduction': 'batchmean'},
  ],
  ids=['no_filter_kl_only', 'ce_only_sgd_mse', 'batchmean'],
)
def test_fedmho_settings_at_their_limits_are_accepted(overrides):
  config = override(fedmho_digits.get_config('smoke'), **overrides)
  assert driver.build_algorithm('fedmho_md', config).config.clean_rate == config.fedmho.clean_rate


@pytest.mark.parametrize(
  'client_models, found',
  [
    ('mlp;cnn_mnist;cvae:size=small', "classifiers ['cnn_mnist', 'mlp'] and 3 CVAE client(s)"),
    ('mlp', "classifiers ['mlp'] and 0 CVAE client(s)"),
    ('cvae:size=small', 'classifiers [] and 10 CVAE client(s)'),
  ],
  ids=['two_architectures', 'no_cvae', 'no_classifier'],
)
def test_fedmho_needs_one_classifier_architecture_and_a_cvae_client(client_models, found):
  config = override(fedmho_digits.get_config('smoke'), client_models=client_models)
  ctx = driver.context_of_config(config)
  for method in ('fedmho', 'fedmho_sd'):
    with pytest.raises(ConfigError) as info:
      get_method(method).from_config(config).setup(ctx)
    assert str(info.value) == (
      f'{method} needs classifier clients of one architecture and at least one CVAE client; '
      f"client_models gives {found} (e.g. client_models = 'vgg9;cvae:size=small')"
    )


@pytest.mark.parametrize('method', ['fedcvae_ens', 'fedcvae_kd'])
def test_fedcvae_refuses_a_classifier_client_naming_them(method):
  config = override(
    fedmho_digits.get_config('fedcvae_kd,smoke'), client_models='cvae:size=small;mlp;mlp'
  )
  with pytest.raises(ConfigError) as info:
    get_method(method).from_config(config).setup(driver.context_of_config(config))
  assert str(info.value) == (
    f'{method}: every client must train a CVAE, but client_models gives classifiers to clients '
    "[1, 2, 4, 5, 7, 8] (e.g. client_models = 'cvae:size=large;cvae:size=small')"
  )


def test_fedcvae_kd_refuses_a_server_decoder_of_another_latent_before_any_client_trains(
  monkeypatch,
):
  """The server decoder is fed the users' z, so its latent must be theirs; the refusal comes
  from the specs, not after the clients' training."""
  monkeypatch.setattr(
    generative, 'local_cvaes', lambda *a: pytest.fail('trained before the refusal')
  )
  config = override(
    fedmho_digits.get_config('fedcvae_kd,smoke'),
    client_models='cvae:size=small,latent=20;cvae:size=small,latent=8',
    **{'fedcvae.server_decoder': 'cvae:size=v0,latent=20'},
  )
  ctx = driver.context_of_config(config)
  with pytest.raises(ConfigError) as info:
    get_method('fedcvae_kd').from_config(config).setup(ctx)
  assert str(info.value) == (
    "fedcvae.server_decoder 'cvae:size=v0,latent=20' has latent 20, but the users' decoders "
    'have [8, 20]: the server decoder is fed their z'
  )


def _first_step_size(tx) -> float:
  """|update| of a first Adam step on a gradient of ones: the learning rate (m̂ / √v̂ = 1).
  Adam is elementwise, so one parameter tells it (a whole CVAE's tree compiles a program per
  leaf shape)."""
  params = np.zeros(1, np.float32)
  updates, _ = tx.update(np.ones_like(params), tx.init(params), params)
  return float(np.abs(updates).max())


class _FakeTransport:
  def __init__(self):
    self.calls = []

  def trainer(self, spec, tx, recipe, sizes):
    self.calls.append((spec, tx, recipe, sizes))
    return spec


def test_cvae_trainers_give_each_group_its_learning_rate_batch_and_objective(monkeypatch):
  """In this process: one GroupTrainer per CVAE group with the settings' batch, the run's
  strategy and mesh, Eq. 3's objective with the settings' loss and β, and Adam at CVAE-small's
  own rate; on Flower nodes: the recipe the nodes build the same trainer from."""
  config = override(
    fedmho_digits.get_config('smoke'), client_models='mlp;cvae:size=small;cvae:size=v0,hidden=8'
  )
  s = generative.CVAESettings(3, 'adam', 1e-3, 16, 'mse', 0.5, small_lr=5e-2)
  objectives = []
  monkeypatch.setattr(
    cvae_clients, 'cvae_objective', lambda *args: objectives.append(args) or 'eq3'
  )
  ctx = driver.context_of_config(config)
  groups = generative.cvae_groups(ctx)
  assert [g.spec for g in groups] == ['cvae:size=small', 'cvae:size=v0,hidden=8']
  trainers = generative.cvae_trainers(ctx, groups, s)
  assert objectives == [('mse', 0.5)]
  for g, t, lr in zip(groups, trainers, (5e-2, 1e-3)):
    assert (t.module, t.batch_size, t.objective, t.mesh) == (g.module, 16, 'eq3', ctx.mesh)
    assert t.strategy == engine.GroupTrainer(g.module, t.tx, 16, strategy=ctx.run.strategy).strategy
    assert _first_step_size(t.tx) == pytest.approx(lr, rel=1e-3)

  transport = _FakeTransport()
  remote = driver.context_of_config(config, client_transport=transport)
  assert generative.cvae_trainers(remote, groups, s) == [g.spec for g in groups]
  recipe = {
    'kind': 'cvae',
    'upload': 'decoder',
    'epochs': 3,
    'optimizer': 'adam',
    'lr': 1e-3,
    'batch': 16,
    'recon': 'mse',
    'beta': 0.5,
    'small_lr': 5e-2,
  }
  assert [(spec, r) for spec, _, r, _ in transport.calls] == [(g.spec, recipe) for g in groups]
  for (_, tx, _, sizes), lr in zip(transport.calls, (5e-2, 1e-3)):
    np.testing.assert_array_equal(sizes, remote.client_sizes)
    assert _first_step_size(tx) == pytest.approx(lr, rel=1e-3)


def test_a_bad_cvae_spec_is_refused_naming_the_client_model():
  config = override(fedmho_digits.get_config('smoke'), client_models='mlp;cvae:size=small,depth=3')
  with pytest.raises(ConfigError) as info:
    generative.cvae_groups(driver.context_of_config(config))
  assert str(info.value) == (
    "client model 'cvae:size=small,depth=3': Unknown CVAE option(s) ['depth']; valid: size, "
    'latent, hidden, width_mult'
  )
  config = override(config, client_models='mlp;cvae:size=huge')
  ctx = driver.context_of_config(config)
  with pytest.raises(ConfigError) as info:
    generative.init_cvaes(ctx, generative.cvae_groups(ctx))
  assert str(info.value) == (
    "client model 'cvae:size=huge': CVAE size must be 'small', 'large' or 'v0', got 'huge'"
  )


def test_every_cvae_of_a_group_starts_from_the_init_keyed_by_its_specs_index():
  """Specs are indexed among all the clients' specs in order of first appearance (the
  classifier's 'mlp' is 0), so the two CVAE groups' inits are MODEL_INIT keys 1 and 2."""
  from jfed.keys import Purpose  # pylint: disable=g-import-not-at-top

  config = override(
    fedmho_digits.get_config('smoke'), client_models='mlp;cvae:size=small;cvae:size=small,hidden=8'
  )
  ctx = driver.context_of_config(config)
  groups = generative.cvae_groups(ctx)
  assert [g.client_ids.tolist() for g in groups] == [[1, 4, 7], [2, 5, 8]]
  for index, (g, stacked) in enumerate(zip(groups, generative.init_cvaes(ctx, groups)), 1):
    want = cvae_clients.init_cvae(
      g.module, ctx.dataset.input_shape, ctx.derive_key(Purpose.MODEL_INIT, index)
    )
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(want)):
      assert a.shape == (3, *b.shape)
      for k in range(3):
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b))


def test_the_synthetic_set_is_saved_in_255_steps_with_its_labels_and_kept_indices(tmp_path):
  config = fedmho_digits.get_config('smoke')
  images = np.array([-0.2, 0.0, 0.5 / 255, 0.499, 0.5, 1.0, 1.7, 0.3], np.float32)
  images = images.reshape(8, 1, 1, 1)
  labels = np.arange(8) % 3
  generative.save_synthetic(driver.context_of_config(config), images, labels)  # in memory
  ctx = driver.context_of_config(config, workdir=tmp_path)
  for kept, want_kept in ((None, np.arange(8)), (np.array([1, 6], np.int32), [1, 6])):
    generative.save_synthetic(ctx, images, labels, kept)
    with np.load(tmp_path / generative.SYNTHETIC_FILE) as f:
      assert f['images'].dtype == np.uint8 and f['images'].shape == images.shape
      np.testing.assert_array_equal(f['images'].ravel(), [0, 0, 0, 127, 128, 255, 255, 76])
      assert f['labels'].dtype == np.int32 and f['kept'].dtype == np.int64
      np.testing.assert_array_equal(f['labels'], labels)
      np.testing.assert_array_equal(f['kept'], want_kept)
  assert sorted(p.name for p in tmp_path.iterdir()) == [generative.SYNTHETIC_FILE]


_TWO_CVAE_GROUPS = 'mlp;cvae:size=small;cvae:size=small,hidden=8'
_ONE_EPOCH = generative.CVAESettings(1, 'adam', 1e-3, 32, 'bce', 1.0)


def test_a_cvae_client_whose_training_loss_goes_non_finite_is_excluded_not_fatal(
  monkeypatch, caplog
):
  """The training itself diverges (not the model after it): one client's images are NaN, so its
  loss is non-finite inside local CVAE training, which must warn and go on (`diverged='warn'`;
  the default raises); the server excludes that client, and the warning names it."""
  caplog.set_level(logging.WARNING, logger='absl')
  real_groups = generative.cvae_groups

  def poisoned(ctx):
    groups = real_groups(ctx)
    g = groups[0]
    x = np.array(g.fed.x, np.float32)
    x[1] = np.nan  # the second client of the first group
    return [g._replace(fed=g.fed._replace(x=x)), *groups[1:]]

  monkeypatch.setattr(generative, 'cvae_groups', poisoned)
  ctx = driver.context_of_config(fedmho_digits.get_config('smoke'))
  cvaes = generative.local_cvaes(ctx, generative.CVAESettings(1, 'adam', 1e-3, 32, 'bce', 1.0))
  group = cvaes.groups[0]
  assert cvaes.excluded == [int(group.client_ids[1])]
  [warning] = [r.getMessage() for r in caplog.records if 'excluding diverged' in r.getMessage()]
  assert warning.endswith(f'[{int(group.client_ids[1])}]'), warning
  np.testing.assert_array_equal(cvaes.uploads[0].client_ids, np.delete(group.client_ids, 1))


def test_a_group_whose_every_cvae_diverged_generates_nothing(monkeypatch):
  _diverge(monkeypatch, {0: [0, 1, 2]})
  config = override(fedmho_digits.get_config('smoke'), client_models=_TWO_CVAE_GROUPS)
  ctx = driver.context_of_config(config)
  cvaes = generative.local_cvaes(ctx, _ONE_EPOCH)
  assert cvaes.excluded == [1, 4, 7] and len(cvaes.uploads[0].client_ids) == 0
  synthetic = generative.fedmho_synthetic(ctx, cvaes, 300, 1.0)
  counts = np.stack(
    [np.bincount(ctx.dataset.train_y[ctx.parts[k]], minlength=10) for k in (2, 5, 8)]
  )
  assert set(synthetic.owners.tolist()) == {2, 5, 8}
  assert len(synthetic.labels) == int(generation_counts(counts, 300).sum())
  np.testing.assert_array_equal(synthetic.kept, np.arange(len(synthetic.labels)))


def test_fedcvae_draws_every_sample_from_the_decoders_left_when_a_whole_group_diverged(
  monkeypatch,
):
  """FedCVAE's server splits N_syn over the decoders it received (n_k / N of the remaining
  clients): a group with none left draws nothing, the next group still draws its share."""
  _diverge(monkeypatch, {0: [0, 1, 2]})
  config = override(fedmho_digits.get_config('fedcvae_kd,smoke'), client_models=_TWO_CVAE_GROUPS)
  ctx = driver.context_of_config(config)
  cvaes = generative.local_cvaes(ctx, _ONE_EPOCH)
  assert cvaes.excluded == [1, 4, 7] and len(cvaes.uploads[0].client_ids) == 0
  c = get_method('fedcvae_ens').from_config(config).config
  images, labels, z = fedcvae.synthesize(ctx, cvaes, c, 300)
  assert images.shape == (300, *ctx.dataset.input_shape) and labels.shape == (300,)
  assert z.shape == (300, cvaes.groups[1].module.latent)


def test_every_decoder_of_three_groups_generates_its_own_clients_share_of_each_class():
  """§4.2.2's split n_kc² / Σ n_k'c² of each class, read off per owner: with three CVAE groups
  the third group's clients must get their own rows of the counts, not the second group's."""
  config = override(
    fedmho_digits.get_config('smoke'),
    client_models='mlp;cvae:size=small;cvae:size=small,hidden=8;cvae:size=small,hidden=16',
  )
  ctx = driver.context_of_config(config)
  cvaes = generative.local_cvaes(ctx, _ONE_EPOCH)
  assert [len(u.client_ids) for u in cvaes.uploads] == [3, 2, 2]
  synthetic = generative.fedmho_synthetic(ctx, cvaes, 300, 1.0)
  owners = [k for u in cvaes.uploads for k in u.client_ids.tolist()]
  assert owners == [1, 5, 9, 2, 6, 3, 7]
  n = np.stack([np.bincount(ctx.dataset.train_y[ctx.parts[k]], minlength=10) for k in owners])
  squares = n.astype(np.float64) ** 2
  assert squares.sum(0).all()  # every class held by some decoder: no uniform fallback here
  want = np.floor(squares / squares.sum(0) * (300 // 10))  # the reference truncates with int()
  for row, k in enumerate(owners):
    got = np.bincount(synthetic.labels[synthetic.owners == k], minlength=10)
    np.testing.assert_array_equal(got, want[row], err_msg=f'client {k}')


def test_fedcvae_draws_from_every_decoder_of_three_groups_its_clients_share(monkeypatch):
  """ceh-2000/fed_cvae's split: decoder k draws int(n_k / N · N_syn) samples, the highest client
  id the remainder. With three CVAE groups the third group's clients must read their own counts,
  not the second group's."""
  config = override(
    fedmho_digits.get_config('smoke'),
    client_models='cvae:size=small;cvae:size=small,hidden=8;cvae:size=small,hidden=16',
  )
  ctx = driver.context_of_config(config)
  cvaes = generative.local_cvaes(ctx, _ONE_EPOCH)
  drawn = {}
  generate = cvae_clients.generate

  def record(module, upload, labels, real, z, out_hw):
    drawn.update(zip(upload.client_ids.tolist(), np.asarray(real).sum(1).tolist()))
    return generate(module, upload, labels, real, z, out_hw)

  monkeypatch.setattr(cvae_clients, 'generate', record)
  total = 301
  images, labels, _ = fedcvae.synthesize(ctx, cvaes, fedcvae.FedCVAEConfig(), total)
  ids = sorted(drawn)
  assert len(cvaes.uploads) == 3 and ids == list(range(config.partition.num_clients))
  sizes = np.array([len(ctx.parts[k]) for k in ids], np.float64)
  want = [int(n / sizes.sum() * total) for n in sizes[:-1]]
  want.append(total - sum(want))
  assert [drawn[k] for k in ids] == want
  assert len(images) == len(labels) == total


def test_fedcvae_trains_its_cvae_clients_with_its_settings_and_an_unweighted_kl(monkeypatch):
  """FedCVAE's clients train Eq. 3 with β = 1 (ceh-2000/fed_cvae's loss) at the section's
  epochs, optimiser, rate, batch and reconstruction loss, CVAE-small at its own rate, each from
  its own init unless `same_init`."""
  seen = []
  monkeypatch.setattr(generative, 'local_cvaes', lambda ctx, settings: seen.append(settings))
  config = fedcvae.FedCVAEConfig(
    cvae_epochs=3, cvae_optimizer='sgd', cvae_lr=0.02, cvae_batch=16, cvae_recon='mse'
  )
  fedcvae.train_local_cvaes(None, config._replace(cvae_small_lr=0.05))
  fedcvae.train_local_cvaes(None, config._replace(same_init=True))
  settings = generative.CVAESettings(
    epochs=3, optimizer='sgd', lr=0.02, batch=16, recon='mse', beta=1.0, same_init=False
  )
  assert seen == [settings._replace(small_lr=0.05), settings._replace(same_init=True)]


def test_local_cvaes_are_read_back_from_the_shared_directory_without_training(
  tmp_path, monkeypatch
):
  """`local_cvaes_dir`: runs that share one set of CVAE clients train them once; a second run
  (a new context, nothing in memory) restores every group's models from that directory."""
  config = override(
    fedmho_digits.get_config('smoke'),
    client_models=_TWO_CVAE_GROUPS,
    local_cvaes_dir=str(tmp_path / 'cvaes'),
  )
  first = generative.local_cvaes(driver.context_of_config(config), _ONE_EPOCH)
  (folder,) = (tmp_path / 'cvaes').iterdir()  # the subfolder of this run's producer
  assert [p.name for p in folder.iterdir() if p.name.isdigit()] == ['1']

  def no_training(*args, **kwargs):
    raise AssertionError('the CVAE clients were trained again')

  monkeypatch.setattr(common, 'train_groups', no_training)
  second = generative.local_cvaes(driver.context_of_config(config), _ONE_EPOCH)
  jax.tree.map(np.testing.assert_array_equal, first.uploads, second.uploads)


def test_a_run_whose_every_cvae_diverged_fails_naming_them(monkeypatch):
  _diverge(monkeypatch, {0: [0, 1, 2], 1: [0, 1, 2]})
  config = override(fedmho_digits.get_config('smoke'), client_models=_TWO_CVAE_GROUPS)
  with pytest.raises(NonFiniteError) as info:
    generative.local_cvaes(driver.context_of_config(config), _ONE_EPOCH)
  assert str(info.value) == (
    'every CVAE client diverged ([1, 4, 7, 2, 5, 8]); lower the CVAE learning rate'
  )


_FEDCVAE_POSITIVE = (
  'cvae_epochs',
  'cvae_lr',
  'cvae_batch',
  'num_synthetic',
  'z_bound',
  'epochs',
  'lr',
  'batch',
)
_FEDCVAE_KD_POSITIVE = ('decoder_samples', 'decoder_epochs', 'decoder_lr', 'decoder_batch')


@pytest.mark.parametrize(
  'methods, overrides, message',
  [
    (('fedcvae_ens', 'fedcvae_kd'), {f'fedcvae.{n}': 0}, _zero_refused('fedcvae', n))
    for n in _FEDCVAE_POSITIVE
  ]
  + [
    (('fedcvae_kd',), {f'fedcvae.{n}': 0}, _zero_refused('fedcvae', n))
    for n in _FEDCVAE_KD_POSITIVE
  ]
  + [
    (
      ('fedcvae_ens', 'fedcvae_kd'),
      {'fedcvae.cvae_small_lr': -1.0},
      'fedcvae.cvae_small_lr must be >= 0, got -1.0',
    ),
    (
      ('fedcvae_ens', 'fedcvae_kd'),
      {'fedcvae.clean_rate': 0.0},
      'fedcvae.clean_rate must be in (0, 1], got 0.0',
    ),
    (
      ('fedcvae_ens', 'fedcvae_kd'),
      {'fedcvae.protocol': 'dense'},
      "fedcvae.protocol is 'dense'; valid: fed_cvae, fedmho",
    ),
    (
      ('fedcvae_ens', 'fedcvae_kd'),
      {'fedcvae.cvae_optimizer': 'lion'},
      "fedcvae.cvae_optimizer is 'lion'; valid: sgd, adam",
    ),
    (
      ('fedcvae_ens', 'fedcvae_kd'),
      {'fedcvae.cvae_recon': 'l1'},
      "fedcvae.cvae_recon is 'l1'; valid: bce, mse",
    ),
    (
      ('fedcvae_kd',),
      {'fedcvae.server_decoder': 'mlp'},
      "fedcvae.server_decoder must be a CVAE spec ('cvae:...'), got 'mlp'",
    ),
  ],
  ids=[f'{n}' for n in _FEDCVAE_POSITIVE]
  + [f'kd_{n}' for n in _FEDCVAE_KD_POSITIVE]
  + ['small_lr', 'clean_rate', 'protocol', 'optimizer', 'recon', 'server_decoder'],
)
def test_bad_fedcvae_settings_are_refused_with_their_whole_message(methods, overrides, message):
  config = override(fedmho_digits.get_config('fedcvae_kd,smoke'), **overrides)
  for method in methods:
    with pytest.raises(ConfigError) as info:
      driver.build_algorithm(method, config)
    assert str(info.value) == message
  if methods == ('fedcvae_kd',):  # a key FedCVAE-Ens does not read
    driver.build_algorithm('fedcvae_ens', config)


def test_fedmho_cvae_clients_train_eq3_with_its_cvae_settings():
  """Eq. 3's KL term at weight 1 (β = 1, the reference's loss), with the fedmho.cvae_* keys and
  no separate CVAE-small rate (FedMHO's CVAE-small clients train at cvae_lr), one initial CVAE
  per architecture (FedMHO's master sends one model per arch)."""
  config = override(
    fedmho_digits.get_config('smoke'),
    **{
      'fedmho.cvae_epochs': 7,
      'fedmho.cvae_optimizer': 'sgd',
      'fedmho.cvae_lr': 0.03,
      'fedmho.cvae_batch': 24,
      'fedmho.cvae_recon': 'mse',
    },
  )
  for method in ('fedmho', 'fedmho_md', 'fedmho_sd'):
    settings = driver.build_algorithm(method, config).cvae_settings()
    assert settings == (7, 'sgd', 0.03, 24, 'mse', 1.0, 0.0, True)


def test_the_server_trains_with_lam_and_the_kl_reduction_of_the_config_fedmho_on_ce_alone():
  """FedMHO-MD/SD: λ = fedmho.lam and fedmho.kl_reduction; FedMHO (no teacher): CE alone (λ = 1);
  every one by Adam at fedmho.lr on the global architecture."""
  config = override(
    fedmho_digits.get_config('smoke'),
    **{
      'fedmho.lam': 0.3,
      'fedmho.kl_reduction': 'batchmean',
      'fedmho.lr': 0.02,
      'fedmho.local_epochs': 1,
      'fedmho.cvae_epochs': 1,
      'fedmho.num_synthetic': 50,
    },
  )
  ctx = driver.context_of_config(config)
  for method, lam in (('fedmho', 1.0), ('fedmho_md', 0.3), ('fedmho_sd', 0.3)):
    aux = get_method(method).from_config(config).setup(ctx)
    trainer = aux.trainer
    assert (trainer.lam, trainer.kl_reduction) == (lam, 'batchmean')
    assert trainer.module == aux.local.groups[0].module and aux.spec == 'mlp'
    assert _first_step_size(trainer.tx) == pytest.approx(0.02, rel=1e-3)


def test_a_server_epoch_draws_its_dropout_from_the_server_key_of_its_epoch():
  """fusion_epoch's order is default_rng((seed, 1, i)) and its dropout keys derive_key(SERVER, 1,
  i): checked on a VGG-9 (dropout 0.5) server classifier, where another key changes the step."""
  ctx = driver.context_of_config(fedmho_digits.get_config('smoke'))
  module = common.build_module('vgg9:width_mult=0.125,fc_width=16', ctx.dataset)
  init = engine.init_model(module, ctx.dataset.input_shape, jax.random.key(0))
  trainer = FusionTrainer(module, optax.sgd(0.1), 0.5)
  evaluator = engine.Evaluator(module, 100)
  rng = np.random.default_rng(0)
  data = SyntheticSet(
    rng.random((20, *ctx.dataset.input_shape), dtype=np.float32),
    rng.integers(0, 10, 20).astype(np.int32),
    rng.normal(size=(20, 10)).astype(np.float32),
  )
  state, loss, accuracy = generative.fusion_epoch(
    ctx, trainer, evaluator, trainer.init(init), data, 8, 3
  )

  def epoch(key):
    order = np.random.default_rng((int(ctx.run.seed), 1, 3))
    return trainer.epoch(trainer.init(init), data, 8, order, key)

  want, want_loss = epoch(ctx.derive_key(Purpose.SERVER, 1, 3))
  for a, b in zip(jax.tree.leaves(state.model.params), jax.tree.leaves(want.model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert loss == want_loss
  assert accuracy == evaluator.accuracy(want.model, ctx.dataset.test_x, ctx.dataset.test_y)
  other, _ = epoch(ctx.derive_key(Purpose.SERVER, 3))  # the test can tell keys apart
  assert any(
    not np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(other.model.params), jax.tree.leaves(want.model.params))
  )


@pytest.mark.parametrize('protocol', ['fedmho', 'fed_cvae'])
def test_fedcvae_ens_records_summary_and_grid_describe_its_synthetic_set(
  tmp_path, monkeypatch, protocol
):
  """FedCVAE-Ens under FedMHO's protocol (the filter drops samples) and ceh-2000/fed_cvae's
  (every one of num_synthetic samples kept): the setup record and the summary count the decoded
  and the kept samples, per class as written to synthetic.npz, the server model falls back to
  the run's, one record per classifier epoch, and the grid shows the kept set's first 64."""
  config = override(
    fedmho_digits.get_config('fedcvae,smoke'),
    **{
      'fedcvae.server_model': '',
      'partition.scheme': 'iid',
      'partition.num_clients': 4,
      'fedcvae.num_synthetic': 100,
      'fedcvae.protocol': protocol,
    },
  )
  grids = record_sample_grids(monkeypatch)
  summary = driver.run_experiment('fedcvae_ens', config, tmp_path, progress=False)
  saved = np.load(tmp_path / generative.SYNTHETIC_FILE)
  kept_labels = saved['labels'][saved['kept']]
  generated, kept = len(saved['labels']), len(kept_labels)
  if protocol == 'fedmho':
    assert 0 < kept < generated  # the filter at clean_rate dropped some
  else:
    assert kept == generated == 100
  records = read_metrics(tmp_path)
  setup, epochs = records[0], records[1:]
  assert {k: setup[k] for k in ('round', 'clients', 'synthetic_generated', 'synthetic_kept')} == {
    'round': 1,
    'clients': config.partition.num_clients,
    'synthetic_generated': generated,
    'synthetic_kept': kept,
  }
  assert setup['upload_bytes'] == summary['decoder_upload_bytes'] > 0
  assert [r['epoch'] for r in epochs] == [1, 2]  # fedcvae.epochs
  for r in epochs:
    assert 0.0 <= r['test_accuracy'] <= 1.0 and np.isfinite(r['train_loss'])
  assert summary['final_test_accuracy'] == epochs[-1]['test_accuracy']
  specs = [s.strip() for s in config.client_models.split(';')]
  n = config.partition.num_clients
  assert summary['client_models'] == [specs[i % len(specs)] for i in range(n)]
  assert (summary['server_model'], summary['protocol']) == ('mlp', protocol)
  assert (summary['synthetic_generated'], summary['synthetic_kept']) == (generated, kept)
  assert summary['synthetic_per_class'] == np.bincount(kept_labels, minlength=10).tolist()
  assert summary['excluded_cvae_clients'] == []
  ((name, images, labels, kwargs),) = grids
  assert (name, kwargs.get('title')) == ('synthetic_samples.png', 'decoded samples')
  np.testing.assert_array_equal(labels, kept_labels[:64])
  np.testing.assert_allclose(images, saved['images'][saved['kept']][:64] / 255.0, atol=0.5 / 255)


def test_fedcvae_ens_summary_counts_every_class_and_a_run_in_memory_draws_no_grid(monkeypatch):
  """The summary's per-class counts have one entry per class of the task, 0 for a class the
  kept set lacks (here the last), and a run without a workdir draws no sample grid."""
  config = fedmho_digits.get_config('fedcvae,smoke')
  ctx = driver.context_of_config(config)
  grids = record_sample_grids(monkeypatch)
  labels = np.array([0, 0, 3, 5, 8], np.int32)
  cvaes = generative.LocalCVAEs(groups=[], models=[], uploads=[], excluded=[2])
  aux = fedcvae.FedCVAEAux(
    None, None, cvaes, None, np.zeros((5, *ctx.dataset.input_shape), np.float32), labels, None, 9
  )
  summary = get_method('fedcvae_ens').from_config(config).summarize(ctx, aux, None, [])
  assert summary['synthetic_per_class'] == [2, 0, 0, 1, 0, 1, 0, 0, 1, 0]
  assert (summary['synthetic_generated'], summary['synthetic_kept']) == (9, 5)
  assert (summary['decoder_upload_bytes'], summary['excluded_cvae_clients']) == (0, [2])
  assert grids == []


def test_fedcvae_kd_records_summary_and_grid_describe_its_decoder_targets_and_samples(
  tmp_path, monkeypatch
):
  """FedCVAE-KD: decoder-distillation epochs first, then classifier epochs; the setup record and
  the summary count the decoder targets and the server decoder's samples, and the grid shows
  the first 64 of those samples. The classifier's set is decoded in chunks of 1,000: at 1,001
  samples every image keeps its label."""
  config = override(
    smoke_config('fedcvae_kd'),
    **{
      'fedcvae.server_model': '',
      'partition.scheme': 'iid',
      'partition.num_clients': 4,
      'fedcvae.num_synthetic': 1001,
    },
  )
  c = config.fedcvae
  grids = record_sample_grids(monkeypatch)
  sets = []
  fusion_epoch = generative.fusion_epoch

  def record_set(ctx, trainer, evaluator, state, data, batch, i):
    sets.append((data.x.shape[0], data.y.shape[0]))
    return fusion_epoch(ctx, trainer, evaluator, state, data, batch, i)

  monkeypatch.setattr(generative, 'fusion_epoch', record_set)
  summary = driver.run_experiment('fedcvae_kd', config, tmp_path, progress=False)
  records = read_metrics(tmp_path)
  setup, epochs = records[0], records[1:]
  assert {k: setup[k] for k in ('round', 'clients', 'decoder_targets')} == {
    'round': 1,
    'clients': config.partition.num_clients,
    'decoder_targets': c.decoder_samples,
  }
  assert setup['upload_bytes'] == summary['decoder_upload_bytes'] > 0
  assert [('decoder_loss' in r, r['epoch']) for r in epochs] == [(True, 1)] * c.decoder_epochs + [
    (False, c.decoder_epochs + e + 1) for e in range(c.epochs)
  ]
  for r in epochs[c.decoder_epochs :]:
    assert 0.0 <= r['test_accuracy'] <= 1.0 and np.isfinite(r['train_loss'])
  assert summary['final_test_accuracy'] == epochs[-1]['test_accuracy']
  assert summary['server_decoder'] == c.server_decoder
  assert (summary['server_model'], summary['decoder_targets']) == ('mlp', c.decoder_samples)
  assert summary['synthetic_generated'] == c.num_synthetic
  assert sets == [(c.num_synthetic, c.num_synthetic)] * c.epochs
  assert summary['excluded_cvae_clients'] == []
  specs = [s.strip() for s in config.client_models.split(';')]
  n = config.partition.num_clients
  assert summary['client_models'] == [specs[i % len(specs)] for i in range(n)]
  ((name, images, labels, kwargs),) = grids
  assert (name, kwargs.get('title')) == ('synthetic_samples.png', 'server decoder samples')
  assert images.shape[0] == labels.shape[0] == 64 and set(labels.tolist()) <= set(range(10))
  # Killed after its last checkpoint, before summary.json: the resumed run has no step left, so
  # its summary decodes the samples anew from the restored server decoder with the same key.
  (tmp_path / 'summary.json').unlink()
  again = driver.run_experiment('fedcvae_kd', config, tmp_path, progress=False)
  assert again['synthetic_generated'] == c.num_synthetic and len(grids) == 2
  np.testing.assert_array_equal(grids[1][2], labels)
  np.testing.assert_allclose(grids[1][1], images, atol=1e-5)


def test_fedcvae_kd_draws_its_decoder_targets_at_the_server_decoders_resolution():
  """The users' decoders (digits' 8x8) draw the distillation targets at the server decoder's
  own size: FedCVAE's v0 decoder is 32x32, as the reference's. The server decoder and the
  classifier start from the inits keyed by the server's first round and their purposes
  (generator, student; jfed.keys)."""
  config = override(
    fedmho_digits.get_config('fedcvae_kd,smoke'),
    **{
      'client_models': 'cvae:size=small,latent=10',
      'fedcvae.server_decoder': fedmho_digits.FEDCVAE_V0,
      'fedcvae.decoder_samples': 16,
      'partition.scheme': 'iid',
      'partition.num_clients': 2,
    },
  )
  ctx = driver.context_of_config(config)
  aux = driver.build_algorithm('fedcvae_kd', config).setup(ctx)
  assert aux.targets.x.shape == (16, 32, 32, 1)
  assert aux.targets.z.shape == (16, 10) and aux.targets.y.shape == (16,)
  module = generative.build_cvae_spec(fedmho_digits.FEDCVAE_V0, ctx.dataset)
  key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.GENERATOR)
  full = cvae_clients.init_cvae(module, ctx.dataset.input_shape, key)
  # v0's decoder has BatchNorm: its statistics start with it
  want = (full.params['decoder'], cvae_clients.decoder_stats_of(full))
  got = (aux.decoder_init.params, aux.decoder_init.batch_stats)
  assert jax.tree.leaves(want[1])
  jax.tree.map(np.testing.assert_array_equal, got, want)
  # the classifier starts from the init keyed by the server's first round and its student
  classifier = common.build_module(config.fedcvae.server_model, ctx.dataset)
  key = ctx.derive_key(Purpose.SERVER, 0, 1, ServerRoundPurpose.STUDENT)
  want = engine.init_model(classifier, ctx.dataset.input_shape, key)
  jax.tree.map(np.testing.assert_array_equal, aux.classifier_init, want)
