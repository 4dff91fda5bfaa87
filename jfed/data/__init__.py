"""Datasets, label-skew partitions and padded per-client arrays."""

from jfed.data.datasets import (
  Dataset,
  DatasetNotFoundError,
  available_datasets,
  class_names,
  load_dataset,
  read_idx,
)
from jfed.data.federated import FederatedArrays, federate
from jfed.data.partitions import (
  PartitionError,
  available_schemes,
  class_count_table,
  format_count_table,
  make_partition,
  partition_client_dirichlet,
  partition_dirichlet,
  partition_disjoint,
  partition_fedcvae_dirichlet,
  partition_feddf_dirichlet,
  partition_iid,
  partition_shards_k,
  partition_unbalanced_iid,
  unassigned_count,
)
