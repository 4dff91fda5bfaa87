"""The KIP analysis command (issue 12): what KIP changes at #C=1, in smoke mode on digits."""

import json

import jax
import numpy as np
import pytest

from experiments import kip_analysis
from jfed.data import load_dataset
from jfed.driver import partition_clients
from jfed.errors import ConfigError
from jfed.keys import Purpose
from jfed.kip import init_support
from jfed.methods import hfldd


def test_pixel_and_label_changes_match_numpy():
  rng = np.random.default_rng(0)
  clients, support, c = 3, 5, 10
  x0 = rng.uniform(0, 1, (clients, support, 8, 8, 1)).astype(np.float32)
  x = x0 + rng.normal(0, 0.05, x0.shape).astype(np.float32)
  y0 = rng.integers(0, c, (clients, support))
  y_matrix = np.eye(c)[y0] - 1.0 / c + rng.normal(0, 0.01, (clients, support, c))
  y_matrix[0, 0] = np.eye(c)[(y0[0, 0] + 1) % c]  # one label learned into another class
  sets = hfldd.DistilledSets(x, y_matrix.argmax(-1), y_matrix, np.ones((clients, 7)))

  expected = np.abs(x.astype(np.float64) - x0.astype(np.float64)).sum() / x0.size
  assert kip_analysis.pixel_change(x, x0) == pytest.approx(expected, rel=1e-12)
  assert kip_analysis.pixel_change(x0, x0) == 0.0
  record = kip_analysis.kip_record(sets, x0, y0, 'uint8', learn_labels=True)
  assert record['pixel_change'] == pytest.approx(expected, rel=1e-12)
  q, q0 = (np.round(np.clip(a, 0, 1) * 255) for a in (x, x0))
  assert record['pixel_change_sent'] == pytest.approx(np.abs(q - q0).mean() / 255, rel=1e-6)
  assert record['sent_values_changed'] == pytest.approx(np.mean(q != q0))
  assert record['pixels_outside_01'] == pytest.approx(np.mean((x < 0) | (x > 1)))
  start = np.eye(c)[y0] - 1.0 / c
  assert record['label_change'] == pytest.approx(np.abs(y_matrix - start).mean())
  assert record['label_argmax_changed'] == pytest.approx(1 / (clients * support))


def _raw_subset(config, dataset, parts):
  """KIP's initial support, recomputed here: client i's key is fold_in(KIP key, i), its first
  third selects `init_support`'s indices into the client's own images."""
  root = jax.random.fold_in(jax.random.PRNGKey(config.seed), int(Purpose.KIP))
  kip = config.hfldd.kip
  # One compiled selection for every client: labels zero padded to the largest client (the
  # padded tail is never selected, and the selection's random keys are per element), not 10
  # op-by-op runs at 10 lengths (17 s of compiling).
  select = jax.jit(init_support, static_argnums=(3, 4))
  n_max = max(len(p) for p in parts)
  xs, ys = [], []
  for i, p in enumerate(parts):
    k_init = jax.random.split(jax.random.fold_in(root, i), 3)[0]
    y = dataset.train_y[p]
    padded = np.zeros(n_max, y.dtype)
    padded[: len(y)] = y
    idx = np.asarray(select(k_init, padded, len(y), kip.support_size, dataset.num_classes))
    assert len(np.unique(idx)) == kip.support_size  # fewer than the client's images: no repeats
    xs.append(dataset.train_x[p][idx])
    ys.append(y[idx])
  return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.slow  # a whole command end to end (README: the slow set)
def test_smoke_on_digits_at_one_class_per_client(tmp_path):
  text = kip_analysis.run_analysis('digits', [1], tmp_path, seeds=[0], labels=['fixed'], smoke=True)
  saved = json.loads((tmp_path / 'results.json').read_text())
  record = saved['results']['1']['0']
  assert record['client_classes'] == [1] * 10
  kip = record['fixed']
  assert kip['pixel_change'] > 0
  curve = np.asarray(kip['loss_curve'])
  assert len(curve) == saved['meta']['settings']['kip']['iterations']
  assert curve[-5:].mean() < curve[:5].mean()  # KIP lowers its (tiny) loss
  assert curve[0] < 1e-3  # ... which starts near zero at #C=1
  assert (tmp_path / 'kip_loss.png').stat().st_size > 0
  assert '| 1 | fixed | 1 |' in text

  # the raw-subset accuracy: the images KIP started from, recomputed independently
  dataset = load_dataset('digits')
  config = kip_analysis.analysis_config('digits', 1, 0, smoke=True)
  x, y = _raw_subset(config, dataset, partition_clients(config, dataset.train_y))
  trainer = kip_analysis.ModelTrainer(config, dataset, [np.arange(len(y))])
  accuracy = trainer.test_accuracy(config, kip_analysis.sent_images(x, 'uint8'), y)
  assert accuracy == record['raw']['test_accuracy']
  assert accuracy > 0.5  # 200 raw images of all 10 classes: far above chance

  # resuming skips what is done; other settings in the same OUT are refused
  again = kip_analysis.run_analysis(
    'digits', [1], tmp_path, seeds=[0], labels=['fixed'], smoke=True
  )
  assert again.split('\n', 3)[3] == text.split('\n', 3)[3]
  with pytest.raises(ConfigError, match='other settings'):
    kip_analysis.run_analysis('digits', [1], tmp_path, seeds=[0], labels=['fixed'])
