"""HFLDD building blocks: client clustering (HFLDD Alg. 1 / Eq. 4, FedSeq greedy),
communication accounting from serialised bytes (Eq. 3 / 18 / 19, Tables III–V), topology plot."""

from jfed.hfldd.clustering import (HFLDDTopology, build_topology, choose_heads,
                                   cluster_label_coverage, fedseq_clusters, fedseq_confidence,
                                   heterogeneous_clusters, homogeneous_clusters,
                                   kl_similarity_matrix)
from jfed.hfldd.comm import (TargetRow, Transfer, bytes_by_stage, cumulative_bytes,
                             fedavg_cost_bits, fedavg_transfers, fedseq_cost_bits,
                             fedseq_transfers, format_target_table, hfldd_cost_bits,
                             hfldd_transfers, model_round_transfers, rounds_to_target,
                             serialized_nbytes, target_table_rows, to_uint8_images, total_bytes)

__all__ = [
    "HFLDDTopology", "build_topology", "choose_heads", "cluster_label_coverage",
    "fedseq_clusters", "fedseq_confidence", "heterogeneous_clusters", "homogeneous_clusters",
    "kl_similarity_matrix",
    "TargetRow", "Transfer", "bytes_by_stage", "cumulative_bytes", "fedavg_cost_bits",
    "fedavg_transfers", "fedseq_cost_bits", "fedseq_transfers", "format_target_table",
    "hfldd_cost_bits", "hfldd_transfers", "model_round_transfers", "rounds_to_target",
    "serialized_nbytes", "target_table_rows", "to_uint8_images", "total_bytes",
]
