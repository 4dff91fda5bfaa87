"""Distillation and synthesis losses of DENSE, FedDF, Co-Boosting, FedHydra, FedMHO and FedTSA
(pure).

Notation: s = student logits [B, C], t = teacher logits [B, C], y = int labels [B],
p = softmax(t/T), q = softmax(s/T). All functions are differentiable w.r.t. both logits; callers
that want a frozen teacher pass `jax.lax.stop_gradient(t)` (the synthesis losses need gradients
through the teacher, because the generator's input reaches the teacher).
"""

from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp

_REDUCTIONS = ('batchmean', 'mean', 'sum', 'none')


def kl_divergence(
  student_logits: jnp.ndarray,
  teacher_logits: jnp.ndarray,
  T: float,
  reduction: str,
  t_squared: bool = False,
) -> jnp.ndarray:
  """PyTorch `F.kl_div(log_softmax(s/T), softmax(t/T), reduction)` (× T² if `t_squared`).

  Element-wise  KL_elem[b, c] = p[b,c] · (log p[b,c] − log q[b,c]),
  p = softmax(t/T), q = softmax(s/T).
  reduction: 'none' → KL_elem [B, C]; 'sum' → Σ_bc; 'batchmean' → Σ_bc / B (the true KL averaged
  over the batch; DENSE / FedDF); 'mean' → Σ_bc / (B·C) (PyTorch's element mean; FedMHO, FL-SA).
  DENSE/Co-Boosting KD use 'batchmean' with T² ; FedDF uses 'batchmean' without T².

  Args:
    student_logits: s, shape [..., C].
    teacher_logits: t, the same shape (not detached here).
    T: Softmax temperature.
    reduction: 'none', 'sum', 'batchmean' or 'mean', as above.
    t_squared: Multiply by T².

  Returns:
    KL_elem [..., C] for 'none', else a scalar.
  """
  if reduction not in _REDUCTIONS:
    raise ValueError(f'reduction must be one of {_REDUCTIONS}, got {reduction!r}')
  log_q = jax.nn.log_softmax(student_logits / T, axis=-1)
  log_p = jax.nn.log_softmax(teacher_logits / T, axis=-1)
  p = jnp.exp(log_p)
  elem = p * (log_p - log_q)
  if t_squared:
    elem = elem * (T * T)
  if reduction == 'none':
    return elem
  if reduction == 'sum':
    return jnp.sum(elem)
  if reduction == 'batchmean':
    return jnp.sum(elem) / elem.shape[0]
  return jnp.mean(elem)


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray, reduction: str = 'mean') -> jnp.ndarray:
  """CE_b = −log softmax(logits)[b, y_b];  'mean' → mean_b CE_b, 'none' → [B].

  Args:
    logits: Shape [B, C].
    labels: Integer class labels, shape [B].
    reduction: 'mean' or 'none'.

  Returns:
    A scalar, or the per-sample CE [B] for 'none'.
  """
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1).squeeze(-1)
  if reduction == 'none':
    return ce
  if reduction == 'mean':
    return jnp.mean(ce)
  raise ValueError(f'reduction must be mean or none, got {reduction!r}')


def knowledge_fusion_loss(
  student_logits: jnp.ndarray,
  labels: jnp.ndarray,
  teacher_logits: Optional[jnp.ndarray],
  lam: float,
  weights: Optional[jnp.ndarray],
  kl_reduction: str,
) -> jnp.ndarray:
  """FedMHO's global-model loss, Eq. 7: λ · CE(s, y) + (1 − λ) · KL(softmax(t) ‖ softmax(s)).

  teacher_logits: FedMHO-MD's mean of the classifier clients' logits (Eq. 5), FedMHO-SD's initial
  global model's logits (Eq. 6), or None for FedMHO (CE only). T = 1. `weights` [B] (1 real, 0
  padding) average over the real samples. kl_reduction 'batchmean' is the KL of the paper
  (summed over classes); 'mean' is the reference's `nn.KLDivLoss()` default, 1/C of it
  (`github.com/YXShi2000/FedMHO`, `pcode/aggregation/semi_supervised.py`, whose loss CE + KL_mean
  is this at λ = 0.5 up to a factor 2 that Adam does not see).

  Args:
    student_logits: The global model's logits s, shape [B, C].
    labels: The synthetic samples' (conditioning) labels y, shape [B].
    teacher_logits: t, shape [B, C], or None (CE only), as above.
    lam: λ, the weight of the CE term.
    weights: [B] sample weights, 1 real and 0 padding; None weighs every sample 1.
    kl_reduction: 'batchmean' or 'mean', as above.

  Returns:
    The scalar loss, averaged over the real samples.
  """
  if kl_reduction not in ('batchmean', 'mean'):
    raise ValueError(f"kl_reduction must be 'batchmean' or 'mean', got {kl_reduction!r}")
  w = jnp.ones(student_logits.shape[0]) if weights is None else weights.astype(jnp.float32)
  per_sample = cross_entropy(student_logits, labels, 'none')
  if teacher_logits is not None:
    kl = jnp.sum(
      kl_divergence(student_logits, jax.lax.stop_gradient(teacher_logits), 1.0, 'none'), -1
    )
    if kl_reduction == 'mean':
      kl = kl / student_logits.shape[-1]
    per_sample = lam * per_sample + (1.0 - lam) * kl
  return jnp.sum(per_sample * w) / jnp.maximum(jnp.sum(w), 1.0)


def consensus_logits(cluster_logits) -> jnp.ndarray:
  """FedTSA's (Fan et al., ECCV 2024) global knowledge, Eq. 7: z̄ = (1/M) Σ_r z_r over the M cluster
  models' logits ([M, B, C] array or a sequence of [B, C])."""
  return jnp.mean(jnp.stack([jnp.asarray(z) for z in cluster_logits]), axis=0)


def mutual_learning_loss(
  logits: jnp.ndarray,
  consensus: jnp.ndarray,
  temperature: float = 5.0,
  labels: Optional[jnp.ndarray] = None,
  kl_weight: float = 1.0,
  weights: Optional[jnp.ndarray] = None,
  t_squared: bool = False,
) -> jnp.ndarray:
  """FedTSA's (Fan et al., ECCV 2024) Stage-2 loss of one cluster model (Eqs. 6–9), averaged over
  the real samples (`weights` [B]: 1 real, 0 padding):

  KL(softmax(z̄/T) ‖ softmax(z_r/T)) summed over classes (Eq. 8, the consensus z̄ of Eq. 7 held
  fixed), KL-only by default (kl_weight = 1, the paper's setting); with `labels` (the prompts'
  classes of the generated images) and kl_weight = α < 1, Eq. 9: α·KL + (1 − α)·CE. The paper
  writes no T² factor; `t_squared` multiplies the KL by T² as Hinton's distillation does.

  Args:
    logits: The cluster model's logits z_r, shape [B, C].
    consensus: The consensus logits z̄ (Eq. 7), shape [B, C]; no gradient flows into it.
    temperature: T of both softmaxes.
    labels: Classes of the generated images, shape [B]; needed when kl_weight < 1.
    kl_weight: α of Eq. 9; 1 gives the KL alone.
    weights: [B], 1 real and 0 padding; None weighs every sample 1.
    t_squared: Multiply the KL by T².

  Returns:
    The scalar loss.
  """
  kl = jnp.sum(
    kl_divergence(logits, jax.lax.stop_gradient(consensus), temperature, 'none', t_squared), -1
  )
  per_sample = kl
  if kl_weight < 1.0:
    if labels is None:
      raise ValueError('kl_weight < 1 (KL + CE, Eq. 9) needs the labels of the synthetic images')
    per_sample = kl_weight * kl + (1.0 - kl_weight) * cross_entropy(logits, labels, 'none')
  w = jnp.ones(logits.shape[0]) if weights is None else weights.astype(jnp.float32)
  return jnp.sum(per_sample * w) / jnp.maximum(jnp.sum(w), 1.0)


def hard_sample_cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray, hs: float) -> jnp.ndarray:
  """Co-Boosting hard-sample synthesis loss (coboost.py):

  L = mean_b ( (1 − p_y[b])^hs · CE_b ),   p_y[b] = softmax(logits)[b, y_b]  (p_y detached).

  Args:
    logits: The teacher ensemble's logits on the synthetic batch, shape [B, C].
    labels: The batch's target labels y, shape [B].
    hs: Exponent of the hardness weight (1 − p_y); 0 gives plain CE.

  Returns:
    The scalar loss.
  """
  logp = jax.nn.log_softmax(logits, axis=-1)
  logp_y = jnp.take_along_axis(logp, labels[:, None].astype(jnp.int32), axis=-1).squeeze(-1)
  p_y = jax.lax.stop_gradient(jnp.exp(logp_y))
  return jnp.mean(jnp.power(1.0 - p_y, hs) * (-logp_y))


def disagreement_mask(student_logits: jnp.ndarray, teacher_logits: jnp.ndarray) -> jnp.ndarray:
  """DENSE mask_b = 1[argmax s_b ≠ argmax t_b] (float, no gradient)."""
  m = jnp.argmax(student_logits, -1) != jnp.argmax(teacher_logits, -1)
  return jax.lax.stop_gradient(m.astype(student_logits.dtype))


def adversarial_loss(
  student_logits: jnp.ndarray,
  teacher_logits: jnp.ndarray,
  T: float,
  use_mask: bool,
  t_squared: bool,
) -> jnp.ndarray:
  """Generator adversarial (model-discrepancy) loss:

      L_adv = − mean_b ( mask_b · Σ_c KL_elem[b, c] )    [× T² if t_squared]
      KL_elem = softmax(t/T) · (log_softmax(t/T) − log_softmax(s/T))

  DENSE: T=1, mask = 1[argmax s ≠ argmax t], no T². Co-Boosting: T=3, no mask, × T².
  FedHydra Eq. 15 (−KL(P, F_g)): T=1, no mask (the paper states none).

  Args:
    student_logits: s, shape [B, C].
    teacher_logits: t, shape [B, C].
    T: Softmax temperature.
    use_mask: Count only the samples on which student and teacher disagree (DENSE).
    t_squared: Multiply by T².

  Returns:
    The scalar loss (≤ 0: the generator minimises it to maximise the discrepancy).
  """
  per_sample = jnp.sum(kl_divergence(student_logits, teacher_logits, T, 'none', t_squared), -1)
  if use_mask:
    per_sample = per_sample * disagreement_mask(student_logits, teacher_logits)
  return -jnp.mean(per_sample)


# ---------------------------------------------------------------------------------------------
# DeepInversion BN-statistics loss
# ---------------------------------------------------------------------------------------------


def _bn_pairs(bn_inputs: Any, batch_stats: Any):
  """Yield (mean_in, var_in, running_mean, running_var) for every sown BN input statistic."""
  flat_in = flax.traverse_util.flatten_dict(flax.core.unfreeze(bn_inputs))
  flat_bs = flax.traverse_util.flatten_dict(flax.core.unfreeze(batch_stats))
  for path, sown in sorted(flat_in.items()):
    prefix = path[:-1]  # drop the sow name ('stats')
    for suffix in (('bn',), ()):
      mkey, vkey = prefix + suffix + ('mean',), prefix + suffix + ('var',)
      if mkey in flat_bs and vkey in flat_bs:
        break
    else:
      raise KeyError(f'no running statistics for BN input statistics at {"/".join(path)}')
    for mean_in, var_in in sown:  # one entry per call of the layer
      yield mean_in, var_in, flat_bs[mkey], flat_bs[vkey]


def bn_statistics_loss(bn_inputs: Any, batch_stats: Any) -> jnp.ndarray:
  """DeepInversion / DENSE BN-statistics loss of one model (helpers/utils.py:DeepInversionHook):

      L_bn = Σ_layers ( ||running_var_l − var_l(x)||₂ + ||running_mean_l − mean_l(x)||₂ )

  with mean_l / var_l the per-channel mean and *biased* variance of the BN layer's input over
  (N, H, W) (sown by jfed.models.layers.BatchNorm into collection 'bn_inputs'). Plain L2 norms,
  not squared, no division. A group of clients gets one loss per model by mapping this over
  them (`jfed.distill.ensemble.teacher_outputs`); the methods combine those.

  Args:
    bn_inputs: The 'bn_inputs' collection of one model's forward pass on the synthetic batch.
    batch_stats: The model's 'batch_stats' (running statistics), the same structure.

  Returns:
    The scalar loss (float32).

  Raises:
    ValueError: statistics with a leading model axis (several models at once).
  """
  total = jnp.zeros((), jnp.float32)
  for mean_in, var_in, rmean, rvar in _bn_pairs(bn_inputs, batch_stats):
    if jnp.ndim(mean_in) != 1 or jnp.ndim(rmean) != 1:
      raise ValueError(
        'bn_statistics_loss takes one model: per-channel statistics, got shapes '
        f'{jnp.shape(mean_in)} and {jnp.shape(rmean)}'
      )
    total = total + jnp.linalg.norm(rvar - var_in) + jnp.linalg.norm(rmean - mean_in)
  return total
