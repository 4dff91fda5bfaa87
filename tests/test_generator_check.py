"""experiments.generator_check: the synthetic set a FedMHO run writes, and the shares of kept and
removed samples a reference classifier labels as their conditioned class."""

import numpy as np
import pytest

from experiments import generator_check as gc
from jfed.methods import generative


class _Context:
  def __init__(self, workdir):
    self.workdir = workdir

  def output_path(self, name):
    return None if self.workdir is None else self.workdir / name


def test_saved_samples_round_trip_to_1_255_steps(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.uniform(-0.1, 1.1, (6, 4, 4, 1)).astype(np.float32)
  labels = np.array([0, 1, 2, 0, 1, 2])
  generative.save_synthetic(_Context(tmp_path), images, labels, np.array([0, 2, 5]))
  x, y, kept = gc.load_synthetic(tmp_path)
  np.testing.assert_allclose(x, np.clip(images, 0, 1), atol=0.5 / 255 + 1e-7)
  np.testing.assert_array_equal(y, labels)
  np.testing.assert_array_equal(kept, [0, 2, 5])
  generative.save_synthetic(_Context(tmp_path), images, labels)  # no filter: every sample kept
  np.testing.assert_array_equal(gc.load_synthetic(tmp_path)[2], np.arange(6))
  generative.save_synthetic(_Context(None), images, labels)  # a run in memory writes nothing


def test_score_counts_kept_and_removed_samples_and_classes():
  labels = np.array([0, 0, 1, 1, 2, 2, 0, 1])
  predicted = np.array([0, 1, 1, 1, 0, 0, 0, 0])
  kept = np.array([0, 1, 2, 3, 4, 5])  # 6 and 7 removed: one right (6), one wrong (7)
  s = gc.score('r', predicted, labels, kept, classes=4)
  assert (s.generated, s.kept) == (8, 6)
  assert s.kept_accuracy == pytest.approx(3 / 6)
  assert s.removed_accuracy == pytest.approx(1 / 2)
  assert s.per_class[:3] == pytest.approx([0.5, 1.0, 0.0]) and np.isnan(s.per_class[3])
  text = gc.render([s], {'model': 'mlp', 'epochs': 1, 'dataset': 'd', 'test_accuracy': 0.9})
  assert '| r | 8 | 6 | 50.0 % | 50.0 % | class 2: 0.0 % | no |' in text
  everything = gc.score('f', labels, labels, np.arange(8), classes=3)  # no filter (FedTSA)
  text = gc.render([everything], {'model': 'm', 'epochs': 1, 'dataset': 'd', 'test_accuracy': 1})
  assert '| f | 8 | 8 | 100.0 % | — (none removed) | class 0: 100.0 % | yes |' in text


def test_a_run_without_samples_is_refused(tmp_path):
  with pytest.raises(Exception, match='synthetic.npz does not exist'):
    gc.load_synthetic(tmp_path)
