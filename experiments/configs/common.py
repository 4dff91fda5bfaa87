"""The base config every experiment config starts from; each method reads its own sub-config."""
import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.dataset = ml_collections.ConfigDict({'name': 'digits', 'data_dir': ''})
  # scheme: iid | dirichlet (alpha, min_size) | shards (#C=k: k) | disjoint (2c/c)
  #         | feddf_dirichlet (alpha) | fedcvae_dirichlet (alpha)
  c.partition = ml_collections.ConfigDict(
      {'scheme': 'dirichlet', 'num_clients': 5, 'alpha': 0.5, 'min_size': 10, 'k': 2})
  c.model = 'cnn_mnist'
  c.client_models = ''          # heterogeneous: 'spec;spec;...' cycled over clients
  c.local_models_dir = ''       # reuse local models checkpointed by an earlier run
  c.optimizer = ml_collections.ConfigDict(
      {'name': 'sgd', 'lr': 0.01, 'momentum': 0.9, 'weight_decay': 0.0,
       'schedule': 'constant'})  # schedule: constant | cosine (centralized only)
  c.batch_size = 64
  c.strategy = 'auto'           # client map: auto | loop | vmap | scan
  c.shard = False               # shard client groups over all devices ('clients' mesh axis)
  c.eval_batch_size = 1000

  c.fedavg = ml_collections.ConfigDict({'rounds': 1, 'local_epochs': 1, 'participation': 1.0})
  c.fedprox = ml_collections.ConfigDict(
      {'rounds': 1, 'local_epochs': 1, 'participation': 1.0, 'mu': 0.01})
  c.centralized = ml_collections.ConfigDict({'epochs': 1})
  c.local = ml_collections.ConfigDict({'epochs': 1})
  return c
