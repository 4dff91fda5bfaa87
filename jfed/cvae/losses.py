"""The CVAE client objective, FedMHO Eq. 3 (as `utils.py` of
`github.com/ceh-2000/fed_cvae` and `pcode/worker_lmf.py` of `github.com/YXShi2000/FedMHO`).

Per sample i: recon_i = Σ_pixels BCE(sigmoid(x̂_i), x_i) (or, for FedCVAE's 3-channel images,
Σ_pixels (sigmoid(x̂_i) − x_i)²) and KL_i = −½ Σ_j (1 + log σ²_ij − μ²_ij − σ²_ij); the loss is
the mean over the batch's real samples of recon_i + β · KL_i. That is Eq. 3 (both terms averaged
over the mini-batch), FedMHO's `loss_fn_cvae` ((BCE_sum + KLD_sum) / B) and FedCVAE's
(BCE_sum / B + β · mean_b KL) at β = 1.

A CVAE that works at its own resolution (FedCVAE's v0: 32×32) is compared with the images
resized to it (bilinear), as the reference resizes its MNIST-family data to 32 before training.
"""

from typing import Tuple

import jax
import jax.numpy as jnp
import optax

from jfed.cvae.models import CVAEOutput, resize_images

RECON_LOSSES = ('bce', 'mse')


def cvae_terms(out: CVAEOutput, x: jnp.ndarray, recon: str) -> Tuple[jnp.ndarray, ...]:
  """Per-sample (reconstruction, KL) terms, each [B].

  Args:
    out: The CVAE's output on x.
    x: The input images [B, H, W, C] in [0, 1] (resized to the reconstruction's size).
    recon: 'bce' (Σ_pixels BCE on the logits) or 'mse' (Σ_pixels squared error of the sigmoid).

  Returns:
    (reconstruction [B], KL [B]).
  """
  x = resize_images(x, out.recon_logits.shape[-3:-1])
  axes = tuple(range(1, x.ndim))
  if recon == 'bce':
    r = jnp.sum(optax.sigmoid_binary_cross_entropy(out.recon_logits, x), axis=axes)
  elif recon == 'mse':
    r = jnp.sum(jnp.square(jax.nn.sigmoid(out.recon_logits) - x), axis=axes)
  else:
    raise ValueError(f'recon must be one of {RECON_LOSSES}, got {recon!r}')
  kl = -0.5 * jnp.sum(1.0 + out.logvar - jnp.square(out.mu) - jnp.exp(out.logvar), axis=-1)
  return r, kl


def cvae_loss(
  out: CVAEOutput, x: jnp.ndarray, weights: jnp.ndarray, beta: float = 1.0, recon: str = 'bce'
):
  """Eq. 3 over the real samples (weights [B]: 1 real, 0 padding).

  Args:
    out: The CVAE's output on x.
    x: The input images [B, H, W, C] in [0, 1].
    weights: [B], 1 real and 0 padding.
    beta: Weight of the KL term.
    recon: 'bce' or 'mse' (see `cvae_terms`).

  Returns:
    (loss, (mean reconstruction term, mean KL term, real-sample count)).
  """
  r, kl = cvae_terms(out, x, recon)
  count = jnp.maximum(jnp.sum(weights), 1.0)
  mean = lambda v: jnp.sum(v * weights) / count
  return mean(r + beta * kl), (mean(r), mean(kl), jnp.sum(weights))
