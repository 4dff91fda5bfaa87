"""FedTSA's client resource profiling (the proxy task) and KDE clustering
(FedTSA, Fan et al., ECCV 2024, §4.3)."""

from jfed.profiling.kde import SPACES as KDE_SPACES
from jfed.profiling.kde import KDEClusters, kde_clusters, pruning_rates
from jfed.profiling.proxy import (
  ClientDurations,
  DeviceProfile,
  ProxyTask,
  assign_devices,
  measured_durations,
  profile_from_rates,
  read_durations,
  simulated_durations,
)
