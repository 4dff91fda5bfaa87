"""FedHydra's own generator (Bai et al., KDD 2025, §4.1.3) and its use of every generator
intermediate (§2), checked against a PyTorch build of the described generator and against the
synthesis loop's own loss trace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfed.distill import (
  FedHydraGenerator,
  dense_generator_init,
  fedhydra_config,
  images_per_epoch,
  make_generator,
  synthesize,
)
from jfed.engine import init_model
from jfed.models import get_model

torch = pytest.importorskip('torch')


def _torch_paper_generator(nz, ngf, s, channels, strides):
  """FedHydra §4.1.3 written in PyTorch: Linear → 2D map → 3 × [BN, LeakyReLU, ConvTranspose2d]
  → Sigmoid (k4 s2 p1 for the ×2 layers, k3 s1 p1 for a size-keeping one)."""
  layers = []
  widths = (2 * ngf, 2 * ngf, ngf, channels)
  for i, stride in enumerate(strides):
    k, p = (4, 1) if stride == 2 else (3, 1)
    layers += [
      torch.nn.BatchNorm2d(widths[i]),
      torch.nn.LeakyReLU(0.2),
      torch.nn.ConvTranspose2d(widths[i], widths[i + 1], k, stride, p),
    ]
  fc = torch.nn.Linear(nz, 2 * ngf * s * s)
  body = torch.nn.Sequential(*layers, torch.nn.Sigmoid())
  return fc, body


def _port(fc, body, ngf, s):
  """Flax parameters holding the PyTorch generator's weights (NCHW → NHWC; flax's ConvTranspose
  does not flip its kernel, PyTorch's transposed convolution does)."""
  c2 = 2 * ngf
  w = fc.weight.detach().numpy()  # [c2·s·s, nz], rows in (c, h, w) order
  b = fc.bias.detach().numpy()
  order = np.arange(c2 * s * s).reshape(c2, s, s).transpose(1, 2, 0).reshape(-1)  # (h, w, c)
  params = {'fc': {'kernel': jnp.asarray(w[order].T), 'bias': jnp.asarray(b[order])}}
  bns = [m for m in body if isinstance(m, torch.nn.BatchNorm2d)]
  convs = [m for m in body if isinstance(m, torch.nn.ConvTranspose2d)]
  for i, (bn, conv) in enumerate(zip(bns, convs)):
    params[f'bn{i}'] = {
      'scale': jnp.asarray(bn.weight.detach().numpy()),
      'bias': jnp.asarray(bn.bias.detach().numpy()),
    }
    k = conv.weight.detach().numpy()  # [in, out, kh, kw]
    params[f'convt{i}'] = {
      'kernel': jnp.asarray(k[:, :, ::-1, ::-1].transpose(2, 3, 0, 1)),
      'bias': jnp.asarray(conv.bias.detach().numpy()),
    }
  return params


@pytest.mark.parametrize(
  'shape, s, strides', [((28, 28, 1), 7, (2, 2, 1)), ((32, 32, 3), 8, (2, 2, 1))]
)
@pytest.mark.parametrize('conv_impl', ['lax', 'matmul'])
def test_fedhydra_generator_is_the_papers_architecture(shape, s, strides, conv_impl):
  nz, ngf = 12, 4
  torch.manual_seed(0)
  fc, body = _torch_paper_generator(nz, ngf, s, shape[2], strides)
  for m in body:  # non-trivial BN affine parameters
    if isinstance(m, torch.nn.BatchNorm2d):
      torch.nn.init.normal_(m.weight, 1.0, 0.3)
      torch.nn.init.normal_(m.bias, 0.0, 0.3)
  z = np.random.default_rng(0).normal(size=(6, nz)).astype(np.float32)
  with torch.no_grad():
    h = fc(torch.tensor(z)).view(6, 2 * ngf, s, s)
    want = body.train()(h).numpy().transpose(0, 2, 3, 1)
  gen = make_generator(shape, nz, ngf, 'fedhydra', conv_impl=conv_impl)
  assert isinstance(gen, FedHydraGenerator) and tuple(gen.strides()) == strides
  # The initialisers jitted (op by op they compiled ~40 one-primitive programs per shape); the
  # forward is not: one program with the matmul convolutions compiled slower than its primitives.
  init = jax.jit(
    lambda: (
      gen.init(jax.random.PRNGKey(0), jnp.zeros((2, nz)), train=False),
      dense_generator_init(jax.random.PRNGKey(1), gen),
    )
  )
  variables, state = init()
  got, _ = gen.apply(
    {'params': _port(fc, body, ngf, s), 'batch_stats': variables['batch_stats']},
    jnp.asarray(z),
    train=True,
    mutable=['batch_stats'],
  )
  assert got.shape == (6, *shape)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
  # the DENSE-style initialiser covers every parameter of this generator too
  assert jax.tree.structure(state.params) == jax.tree.structure(variables['params'])


def _tiny_teachers():
  module = get_model('mlp', 10, (8, 8, 1), hidden=(16,))
  states = [init_model(module, (8, 8, 1), jax.random.PRNGKey(i)) for i in range(2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
  return module, stacked


def test_keep_all_puts_every_generator_step_in_the_pool_and_best_is_one_of_them():
  """keep='all' returns the G(z) of every step, in order, with the epoch's labels; keep='best'
  (DENSE) returns the one whose loss (logged before its step) is the lowest: the same images."""
  module, stacked = _tiny_teachers()
  gen = make_generator((8, 8, 1), nz=8, ngf=4, kind='fedhydra')
  student = init_model(module, (8, 8, 1), jax.random.PRNGKey(9))
  key = jax.random.PRNGKey(3)
  kw = dict(g_steps=4, batch_size=6, loop='python', aggregation='mean', lambda1=0.0)
  every = synthesize(
    gen, (module, stacked), module, student, 10, key, fedhydra_config(keep='all', **kw), None
  )
  best = synthesize(
    gen, (module, stacked), module, student, 10, key, fedhydra_config(keep='best', **kw), None
  )
  assert images_per_epoch(fedhydra_config(keep='all', **kw)) == 24
  assert every.images.shape == (24, 8, 8, 1) and best.images.shape == (6, 8, 8, 1)
  np.testing.assert_array_equal(np.asarray(every.labels), np.tile(np.asarray(best.labels), 4))
  np.testing.assert_allclose(np.asarray(every.losses), np.asarray(best.losses), rtol=1e-6)
  steps = np.asarray(every.images).reshape(4, 6, 8, 8, 1)
  assert np.abs(steps[0] - steps[-1]).max() > 1e-4  # the generator moved between steps
  i = int(np.argmin(np.asarray(best.losses)))
  np.testing.assert_allclose(np.asarray(best.images), steps[i], atol=1e-6)
  # the scan form returns the same intermediates
  scan = synthesize(
    gen,
    (module, stacked),
    module,
    student,
    10,
    key,
    fedhydra_config(
      keep='all', g_steps=4, batch_size=6, loop='scan', aggregation='mean', lambda1=0.0
    ),
    None,
  )
  np.testing.assert_allclose(np.asarray(scan.images), np.asarray(every.images), atol=1e-5)
