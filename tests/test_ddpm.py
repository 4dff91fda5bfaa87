"""FedTSA's class-conditional DDPM: the forward process against numpy, the network's shapes and
conditioning, the training loss going down, deterministic guided sampling compiled once, the
cache (reuse, retrain on other data, corrupt file), and (slow) that its samples of digits are
recognisable to a classifier trained on real digits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from jfed.diffusion import ddpm
from jfed.diffusion import train as ddpm_train
from jfed.diffusion.source import build_prompt_pool
from jfed.diffusion.unet import UNet
from tests.support import DDPM_IMAGES, DDPM_TINY

TINY = ddpm_train.DDPMConfig(**DDPM_TINY)


def _toy_images(n=DDPM_IMAGES, size=8, seed=0):
  """Two classes: a bright top half (0) or a bright bottom half (1), plus noise."""
  rng = np.random.default_rng(seed)
  labels = np.arange(n) % 2
  images = np.zeros((n, size, size, 1), np.float32)
  images[labels == 0, : size // 2] = 1.0
  images[labels == 1, size // 2 :] = 1.0
  images = np.clip(images + 0.05 * rng.standard_normal(images.shape), 0, 1)
  return images.astype(np.float32), labels.astype(np.int32)


def test_schedule_and_q_sample_match_numpy():
  schedule = ddpm.linear_schedule(200)
  betas = np.linspace(5 * 1e-4, 5 * 0.02, 200)
  np.testing.assert_allclose(schedule.betas, betas, rtol=1e-5)
  np.testing.assert_allclose(schedule.alpha_bars, np.cumprod(1 - betas), rtol=1e-4)
  rng = np.random.default_rng(0)
  x0 = rng.uniform(-1, 1, (3, 4, 4, 1)).astype(np.float32)
  noise = rng.standard_normal(x0.shape).astype(np.float32)
  t = np.array([0, 57, 199])
  abar = np.cumprod(1 - betas)[t][:, None, None, None]
  expected = np.sqrt(abar) * x0 + np.sqrt(1 - abar) * noise
  got = ddpm.q_sample(schedule, jnp.asarray(x0), jnp.asarray(t), jnp.asarray(noise))
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
  # Nearly all signal gone at the last step, as in DDPM at T = 1000.
  assert float(schedule.alpha_bars[-1]) < 1e-3


@pytest.fixture(scope='module')
def tiny_params():
  """The DDPM that TINY trains on the toy images (key 0), trained once for the module's tests."""
  images, labels = _toy_images()
  return ddpm_train.train_ddpm(images, labels, 2, TINY, jax.random.key(0))


@pytest.mark.parametrize('size,channels', [(8, 1), (28, 1), (32, 3)])
def test_unet_output_shape_for_any_image_size(size, channels):
  net = UNet(num_classes=10, base_channels=8)
  x = jax.ShapeDtypeStruct((2, size, size, channels), jnp.float32)
  labels = jax.ShapeDtypeStruct((2,), jnp.int32)
  params = jax.eval_shape(net.init, jax.random.key(0), x, labels, labels)
  out = jax.eval_shape(net.apply, params, x, labels, labels)
  assert out.shape == x.shape and out.dtype == jnp.float32


def test_unet_conditioning_and_guidance(tiny_params):
  """The label changes the prediction, and guided eps is (1 + w) cond - w uncond (w = 0: the
  conditional prediction alone)."""
  # The trained toy DDPM, not fresh weights: a fresh network's zero-initialised output layer
  # predicts eps = 0, which would hide the conditioning (and perturbing fresh weights cost a
  # compile of the initialiser, 9 s of this test's 17).
  net = ddpm_train.make_network(2, TINY)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
  t, y = jnp.array([3, 15]), jnp.array([0, 1])
  params = tiny_params
  # One jitted network, called five times: two compilations (batch 2, and guidance's batch of 4)
  # instead of one program holding seven inlined copies of the network.
  fn = jax.jit(lambda p, x, t, y: net.apply({'params': p}, x, t, y))

  cond, other, uncond, guided_0, guided_2 = (
    fn(params, x, t, y),
    fn(params, x, t, jnp.array([1, 0])),
    fn(params, x, t, jnp.array([2, 2])),
    ddpm.guided_eps(fn, params, x, t, y, 2, 0.0),
    ddpm.guided_eps(fn, params, x, t, y, 2, 2.0),
  )
  assert cond.shape == x.shape
  assert float(jnp.max(jnp.abs(cond - other))) > 1e-4
  np.testing.assert_allclose(guided_0, cond, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(guided_2, 3 * cond - 2 * uncond, rtol=1e-4, atol=1e-5)


def test_training_loss_decreases_and_is_deterministic(tiny_params):
  images, labels = _toy_images()
  # Two chunks of 100 steps (measured chunk losses 0.29 then 0.09; 0.07 and 0.06 after 400).
  cfg = TINY._replace(steps=200)
  log = []
  params = ddpm_train.train_ddpm(images, labels, 2, cfg, jax.random.key(0), loss_log=log)
  assert len(log) == 2
  assert log[-1] < 0.7 * log[0], log
  again = ddpm_train.train_ddpm(images, labels, 2, TINY, jax.random.key(0))
  first = tiny_params  # the same data, settings and key
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, first)
  assert params is not None


def test_generate_order_labels_determinism_and_one_compilation(tiny_params):
  source = ddpm_train.DDPMImageSource(tiny_params, TINY, 2, (8, 8, 1))
  pool = build_prompt_pool([['a photo of real bottom'], ['a photo of real top']], ['top', 'bottom'])
  out = source.generate(pool, 3, jax.random.key(5))
  np.testing.assert_array_equal(out.labels, [1, 1, 1, 0, 0, 0])
  assert out.images.shape == (6, 8, 8, 1) and out.images.dtype == np.float32
  assert out.images.min() >= 0 and out.images.max() <= 1
  again = source.generate(pool, 3, jax.random.key(5))
  np.testing.assert_array_equal(out.images, again.images)
  other = source.generate(pool, 3, jax.random.key(6))
  assert not np.array_equal(out.images, other.images)
  assert source.sampler.compilations() == 1


def test_cache_reuse_retrain_and_corrupt_file(tmp_path):
  images, labels = _toy_images()
  path = tmp_path / 'ddpm.msgpack'
  key = jax.random.key(0)
  first, loaded = ddpm_train.load_or_train(path, images, labels, 2, TINY, key)
  assert not loaded and path.exists()
  again, loaded = ddpm_train.load_or_train(path, images, labels, 2, TINY, key)
  assert loaded
  jax.tree_util.tree_map(np.testing.assert_array_equal, first, again)
  # Other training data: retrained, and the cache now holds the new weights.
  other, loaded = ddpm_train.load_or_train(path, images[::-1], labels[::-1], 2, TINY, key)
  assert not loaded
  _, loaded = ddpm_train.load_or_train(path, images[::-1], labels[::-1], 2, TINY, key)
  assert loaded
  # Other settings: retrained too.
  _, loaded = ddpm_train.load_or_train(path, images, labels, 2, TINY._replace(steps=20), key)
  assert not loaded
  # A truncated file (a kill during a non-atomic write) is retrained over, not an error.
  path.write_bytes(path.read_bytes()[:100])
  _, loaded = ddpm_train.load_or_train(path, images, labels, 2, TINY, key)
  assert not loaded
  _, loaded = ddpm_train.load_or_train(path, images, labels, 2, TINY, key)
  assert loaded
  assert [p.name for p in tmp_path.iterdir()] == ['ddpm.msgpack']  # no temporary files left
  del other


@pytest.mark.parametrize(
  'change,message',
  [
    ({'timesteps': 1}, 'timesteps'),
    ({'lr': float('nan')}, 'lr'),
    ({'guidance': -1.0}, 'guidance'),
    ({'steps': 0}, 'steps'),
  ],
)
def test_bad_settings_one_line_errors(change, message):
  images, labels = _toy_images()
  with pytest.raises(ValueError, match=message) as err:
    ddpm_train.train_ddpm(images, labels, 2, TINY._replace(**change), jax.random.key(0))
  assert '\n' not in str(err.value)


def test_labels_beyond_classes_rejected():
  images, labels = _toy_images()
  with pytest.raises(ValueError, match='labels'):
    ddpm_train.train_ddpm(images, labels + 1, 2, TINY, jax.random.key(0))


@pytest.mark.slow
def test_samples_of_digits_are_recognisable():
  """A DDPM trained on 900 digits (the default settings: 16 channels, 1,000 steps, T = 100,
  guidance 1) generates images that a classifier trained on the other (real) digits labels as
  the prompted class far above chance (10 %): measured 99.4 % on 500 samples (86.6 % without
  guidance; 24 % before the EMA warm-up, which this test caught)."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
  cfg = ddpm_train.DDPMConfig()
  params = ddpm_train.train_ddpm(x[:900], y[:900], 10, cfg, jax.random.key(0))
  source = ddpm_train.DDPMImageSource(params, cfg, 10, (8, 8, 1))
  labels = np.repeat(np.arange(10), 30)
  samples = source.sample_labels(labels, jax.random.key(1))
  classifier = LogisticRegression(max_iter=2000).fit(x[900:].reshape(len(x) - 900, -1), y[900:])
  accuracy = classifier.score(samples.reshape(len(samples), -1), labels)
  assert accuracy > 0.8, accuracy


def test_loop_and_scan_sample_the_same_images(tiny_params):
  params = tiny_params
  labels = np.array([0, 1, 1])
  looped = ddpm_train.DDPMImageSource(params, TINY, 2, (8, 8, 1), strategy='loop')
  scanned = ddpm_train.DDPMImageSource(params, TINY, 2, (8, 8, 1), strategy='scan')
  np.testing.assert_allclose(
    looped.sample_labels(labels, jax.random.key(3)),
    scanned.sample_labels(labels, jax.random.key(3)),
    atol=1e-4,
  )


@pytest.mark.slow
def test_loop_and_scan_train_the_same_network():
  """Same losses and the same noise predictions. Not the same raw weights: a conv bias before
  GroupNorm has an exactly-zero gradient, and Adam turns its float noise (different in the two
  programs) into full-size steps that the network's output never sees."""
  images, labels = _toy_images()
  cfg = TINY._replace(steps=5)
  logs = {'loop': [], 'scan': []}
  params = {
    s: ddpm_train.train_ddpm(
      images, labels, 2, cfg, jax.random.key(0), loss_log=logs[s], strategy=s
    )
    for s in logs
  }
  np.testing.assert_allclose(logs['loop'], logs['scan'], rtol=1e-5)
  net = ddpm_train.make_network(2, cfg)
  x, t, y = jnp.asarray(images[:8] * 2 - 1), jnp.arange(8) % 20, jnp.asarray(labels[:8])
  outputs = {s: net.apply({'params': p}, x, t, y) for s, p in params.items()}
  assert float(jnp.max(jnp.abs(outputs['loop']))) > 1e-3  # the network is not still zero
  np.testing.assert_allclose(outputs['loop'], outputs['scan'], rtol=1e-3, atol=1e-4)


def test_cache_before_any_training_in_a_fresh_process(tmp_path):
  """load_or_train's first DDPM call in a process is the shape template (under a trace): the
  programs it caches must not hold tracers (an UnexpectedTracerError in fedtsa runs).

  The other tests' network and data shapes (TINY, _toy_images): the child process reads their
  compiled training step from the persistent compilation cache (tests/conftest.py) instead of
  compiling it again (20 s)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  images, labels = _toy_images()
  np.savez(tmp_path / 'toy.npz', x=images, y=labels)
  script = (
    'import jax, numpy as np\n'
    'from jfed.diffusion import train as t\n'
    f'cfg = t.{TINY._replace(steps=2)!r}\n'
    f'data = np.load({str(tmp_path / "toy.npz")!r})\n'
    f'p, loaded = t.load_or_train({str(tmp_path / "d.msgpack")!r}, data["x"], data["y"], 2, cfg,'
    ' jax.random.key(0))\n'
    'assert not loaded\n'
  )
  subprocess.run([sys.executable, '-c', script], check=True, timeout=600)
