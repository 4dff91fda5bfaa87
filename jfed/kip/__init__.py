"""Kernel Inducing Points (KIP) dataset distillation with closed-form FC NTK/NNGP/RBF kernels."""

from jfed.kip.kernels import (
  KERNELS,
  fc_kernels,
  fc_nngp_kernel,
  fc_ntk_kernel,
  make_kernel_fn,
  rbf_kernel,
)
from jfed.kip.kip import (
  KIPConfig,
  KIPResult,
  KIPScalars,
  centered_one_hot,
  client_mesh,
  init_support,
  kernel_fn_from_config,
  kip_distill,
  kip_distill_batched,
  kip_distill_loop,
  krr_loss,
  krr_predict,
  sample_target_indices,
  split_scalars,
)
