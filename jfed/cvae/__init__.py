"""Conditional VAEs for one-shot FL with generative clients (FedMHO, FedCVAE): the models, the
client objective (Eq. 3) and the server's synthetic set (generation counts, K-means filter)."""

from jfed.cvae.losses import cvae_loss, cvae_terms
from jfed.cvae.models import CVAE, CVAEOutput, reparameterize
from jfed.cvae.synthetic import generation_counts, kmeans_filter, kmeans_keep

__all__ = [
  'CVAE',
  'CVAEOutput',
  'cvae_loss',
  'cvae_terms',
  'generation_counts',
  'kmeans_filter',
  'kmeans_keep',
  'reparameterize',
]
