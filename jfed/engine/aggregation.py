"""Server-side aggregation of stacked client models."""

from typing import Any

import jax
import jax.numpy as jnp


def weighted_average(stacked: Any, weights) -> Any:
  """FedAvg: Σ_k w_k θ_k / Σ_k w_k over the leading client axis (BatchNorm statistics too,
  as averaging a PyTorch state_dict does)."""
  w = jnp.asarray(weights, jnp.float32)
  w = w / jnp.sum(w)
  return jax.tree.map(
    lambda a: jnp.tensordot(w, a.astype(jnp.float32), axes=1).astype(a.dtype), stacked
  )
