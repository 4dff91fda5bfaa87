"""Caches shared between runs (`local_models_dir`, `local_cvaes_dir`) know what made them: a run
reads only results of its own data, partition, seed and settings (issue 85)."""

import json

import jax
import numpy as np
import pytest

from jfed.api import context_of_config
from jfed.configs import base as configs
from jfed.data import load_dataset
from jfed.methods import common
from tests.support import override


def _config(directory, **keys):
  c = configs.base_config()
  c.dataset.name = 'digits'
  c.partition.num_clients = 3
  c.local_models_dir = str(directory)
  return override(c, **keys)


def _local(config, epochs=1):
  ctx = context_of_config(config, load_dataset('digits'))
  return common.local_models(ctx, epochs).models


def _same(a, b):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b)))


def test_two_seeds_sharing_one_local_models_dir_get_their_own_models(tmp_path, monkeypatch):
  shared = tmp_path / 'shared'
  seed0 = _local(_config(shared, seed=0))
  seed1 = _local(_config(shared, seed=1))
  alone = _local(_config(tmp_path / 'alone', seed=1))
  assert _same(seed1, alone) and not _same(seed0, seed1)
  folders = sorted(p for p in shared.iterdir())
  made_by = [json.loads((f / 'producer.json').read_text()) for f in folders]
  assert sorted(m['run']['seed'] for m in made_by) == [0, 1]

  def no_training(*args, **kwargs):
    raise AssertionError('the clients were trained again')

  monkeypatch.setattr(common, 'train_groups', no_training)
  assert _same(_local(_config(shared, seed=0)), seed0)  # each reads its own back
  assert _same(_local(_config(shared, seed=1)), seed1)
  with pytest.raises(AssertionError, match='trained again'):  # another optimiser: not reused
    _local(_config(shared, seed=0, **{'optimizer.lr': 0.05}))
  with pytest.raises(AssertionError, match='trained again'):  # another partition
    _local(_config(shared, seed=0, **{'partition.scheme': 'iid'}))


def test_the_cache_folder_ignores_what_cannot_change_the_models(tmp_path):
  base = context_of_config(_config(tmp_path), load_dataset('digits'))
  other = context_of_config(
    _config(
      tmp_path / 'elsewhere',
      eval_batch_size=7,
      **{'aggregation.rule': 'median', 'logging.tensorboard': False},
    ),
    load_dataset('digits'),
  )
  assert (
    base.shared_cache_dir(str(tmp_path), 'local_models').name
    == other.shared_cache_dir(str(tmp_path), 'local_models').name
  )
  resized = context_of_config(_config(tmp_path, **{'dataset.normalization': 'half'}))
  assert (
    resized.shared_cache_dir(str(tmp_path), 'local_models').name
    != base.shared_cache_dir(str(tmp_path), 'local_models').name
  )
