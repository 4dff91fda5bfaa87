"""experiments.bn_check: a FedAvg run's saved global models scored with the averaged, the
recomputed and the test batch's BatchNorm statistics."""

import pytest

from experiments import bn_check
from jfed import driver
from jfed.configs import digits
from jfed.errors import ConfigError


def test_bn_check_scores_the_saved_models_as_the_run_did_and_recomputes_their_statistics(
  tmp_path,
):
  config = digits.get_config('smoke')  # cnn_mnist: BatchNorm after each convolution
  config.fedavg.rounds = 2
  summary = driver.run_experiment('fedavg', config, tmp_path)
  scores = bn_check.check('fedavg', config, tmp_path, passes=3)
  assert [s.step for s in scores] == [1, 2]
  # the averaged statistics are the run's own evaluation of its final model
  assert scores[-1].running == pytest.approx(summary['final_test_accuracy'])
  # no pass keeps the averaged statistics; passes replace them
  kept = bn_check.check('fedavg', config, tmp_path, passes=0)
  assert [s.recomputed for s in kept] == [s.running for s in kept]
  table = bn_check.table(scores)
  assert table.splitlines()[2].startswith('| 1 | ')

  with pytest.raises(ConfigError, match='FedAvg-family'):
    bn_check.check('feddf', config, tmp_path, passes=1)
  with pytest.raises(ConfigError, match='holds no checkpoint'):
    bn_check.check('fedavg', config, tmp_path / 'nothing', passes=1)
