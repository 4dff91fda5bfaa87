"""FedHydra's stage-by-stage study (experiments/fedhydra_mechanism.py) takes its settings as a
config file with overrides, as every experiment does: the `mechanism` variant is the study's
budget, each --partitions cell replaces the config's partition, and the local-model cache is
keyed by what the local models depend on."""

import pytest

from experiments import fedhydra_mechanism as study
from jfed.configs import fedhydra_digits, fedhydra_fashion_mnist
from jfed.errors import ConfigError


def test_the_mechanism_variant_is_the_studys_budget_on_both_datasets():
  for config in (
    fedhydra_fashion_mnist.get_config('mechanism'),
    fedhydra_digits.get_config('quick,mechanism'),
  ):
    h = config.fedhydra
    assert (h.local_epochs, h.epochs, h.T_G, h.synthesis_batch) == (5, 15, 10, 32)
    assert (h.ms_T_G, h.ms_batch, h.kd_batch) == (20, 16, 128)
    assert config.local.epochs == config.fedavg.local_epochs == 5


def test_each_cell_replaces_the_partition_and_keeps_the_rest():
  base = fedhydra_fashion_mnist.get_config('mechanism')
  two = study.partition_config(base, '2cc')
  skewed = study.partition_config(base, 'dir0.1')
  assert two.partition.scheme == 'disjoint'
  assert (skewed.partition.scheme, skewed.partition.alpha) == ('dirichlet', 0.1)
  assert base.partition.alpha == 0.5 and two.fedhydra.epochs == skewed.fedhydra.epochs == 15
  for bad in ('dirx', 'iid'):
    with pytest.raises(ConfigError, match=f"--partitions: '{bad}' is not dir<alpha> or 2cc"):
      study.partition_config(base, bad)


def test_the_local_model_cache_is_keyed_by_what_local_training_depends_on():
  base = fedhydra_fashion_mnist.get_config('mechanism')
  key = study.local_models_key(base)
  assert study.local_models_key(study.partition_config(base, '2cc')) == key
  other = fedhydra_fashion_mnist.get_config('mechanism')
  other.model = 'mlp'
  assert study.local_models_key(other) != key
  other = fedhydra_fashion_mnist.get_config('mechanism')
  other.fedhydra.epochs = 30  # distillation only: the same local models
  assert study.local_models_key(other) == key
  other.optimizer.lr = 0.05
  assert study.local_models_key(other) != key
