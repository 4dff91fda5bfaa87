"""Client clustering: HFLDD's heterogeneous clusters (Eq. 4, Algorithm 1) and its topology
figure, FedSeq's greedy superclients."""

from jfed.clustering.fedseq import (
  MEASURES,
  cosine_measure,
  fedseq_clusters,
  fedseq_confidence,
  gini_measure,
  kullback_measure,
)
from jfed.clustering.hfldd import (
  LEFTOVER_RULES,
  HFLDDTopology,
  build_topology,
  choose_heads,
  cluster_label_coverage,
  heterogeneous_clusters,
  homogeneous_clusters,
  kl_similarity_matrix,
)
from jfed.clustering.plots import plot_topology, topology_layout
