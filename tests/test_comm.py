"""Communication accounting from serialised bytes (seed 003 Eq. 3 / 18 / 19, Tables III–V)."""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from jfed.io.comm import (
  Transfer,
  bytes_by_stage,
  cumulative_bytes,
  fedavg_cost_bits,
  fedavg_transfers,
  fedseq_cost_bits,
  fedseq_transfers,
  format_target_table,
  hfldd_cost_bits,
  hfldd_transfers,
  record_bytes,
  rounds_to_target,
  serialized_nbytes,
  target_table_rows,
  to_uint8_images,
  total_bytes,
)


def _ext_array_bytes(shape, itemsize, dtype_name):
  """Hand count of flax's msgpack encoding of one ndarray (ext type wrapping
  packb((shape, dtype_name, raw_bytes)))."""
  n = int(np.prod(shape)) * itemsize
  assert len(shape) < 16 and all(s < 128 for s in shape) and len(dtype_name) < 32
  payload = (
    1  # fixarray(3)
    + 1
    + len(shape)  # fixarray(len(shape)) of positive fixints
    + 1
    + len(dtype_name)  # fixstr
    + (2 if n < 256 else 3 if n < 65536 else 5)
    + n
  )  # bin8/16/32
  if payload in (1, 2, 4, 8, 16):
    head = 2  # fixext
  else:
    head = 3 if payload < 256 else 4 if payload < 65536 else 6  # ext8/16/32
  return head + payload


def test_serialized_nbytes_hand_count():
  # {'w': float32[3]}: fixmap(1) + fixstr 'w' + ext8(25-byte payload)
  assert serialized_nbytes({'w': np.zeros(3, np.float32)}) == 1 + 2 + _ext_array_bytes(
    (3,), 4, 'float32'
  )
  assert serialized_nbytes({'w': np.zeros(3, np.float32)}) == 31
  tree = {'w': jnp.zeros(3), 'b': np.zeros((2, 2), np.float32)}  # jax arrays work too
  assert serialized_nbytes(tree) == (
    1 + 2 + _ext_array_bytes((3,), 4, 'float32') + 2 + _ext_array_bytes((2, 2), 4, 'float32')
  )
  assert serialized_nbytes(np.zeros((4, 5), np.uint8)) == _ext_array_bytes((4, 5), 1, 'uint8')


def test_bytes_scale_as_4_per_param_plus_small_overhead():
  for n in (1, 10, 1000, 100_000):
    over = serialized_nbytes(np.zeros(n, np.float32)) - 4 * n
    assert 10 <= over <= 30, (n, over)

  # a model-like pytree: overhead = per-leaf encoding + keys, independent of the sizes
  def model(width):
    return {
      'params': {
        'Dense_0': {
          'kernel': np.zeros((64, width), np.float32),
          'bias': np.zeros(width, np.float32),
        },
        'Dense_1': {'kernel': np.zeros((width, 10), np.float32), 'bias': np.zeros(10, np.float32)},
      }
    }

  for width in (8, 100, 1000):
    num_params = 64 * width + width + width * 10 + 10
    over = serialized_nbytes(model(width)) - 4 * num_params
    assert 4 * 16 <= over <= 4 * 30 + 60, (width, over)


def test_namedtuple_upload_and_uint8_images():
  class Upload(NamedTuple):
    x: np.ndarray
    y: np.ndarray

  x = to_uint8_images(np.random.default_rng(0).random((5, 8, 8, 1)))
  assert x.dtype == np.uint8 and x.max() <= 255
  nb = serialized_nbytes(Upload(x, np.zeros(5, np.int32)))
  assert 5 * 64 + 5 * 4 < nb < 5 * 64 + 5 * 4 + 80
  np.testing.assert_array_equal(to_uint8_images(np.array([0.0, 0.5, 1.0, 2.0])), [0, 128, 255, 255])


def test_fedavg_totals_add_up_exactly():
  model = {'w': np.zeros((30, 10), np.float32), 'b': np.zeros(10, np.float32)}
  nb = serialized_nbytes(model)
  tr = fedavg_transfers(model, rounds=3, participants=range(7))
  assert len(tr) == 3 * 7 * 2
  assert total_bytes(tr) == 2 * 3 * 7 * nb
  assert total_bytes(tr, upto_round=2) == 2 * 2 * 7 * nb
  assert total_bytes(tr, stage='model_up') == 3 * 7 * nb
  assert dict(bytes_by_stage(tr)) == {'model_down': 21 * nb, 'model_up': 21 * nb}
  np.testing.assert_array_equal(cumulative_bytes(tr, 3), [14 * nb, 28 * nb, 42 * nb])
  # analytic Eq. 3 = the payload bits; measured = analytic + per-message overhead
  analytic = fedavg_cost_bits(3, 7, 310) // 8
  assert analytic == 2 * 3 * 7 * 310 * 4
  assert 0 < total_bytes(tr) - analytic <= 42 * 80
  # partial participation: one list per round
  tr = fedavg_transfers(nb, 2, [[0, 1], [2]])
  assert total_bytes(tr) == 2 * 3 * nb and {t.round for t in tr} == {1, 2}
  with pytest.raises(ValueError):
    fedavg_transfers(nb, 3, [[0, 1], [2]])


def test_hfldd_totals_add_up_exactly():
  N, n_pub, C, rounds = 6, 20, 10, 4
  soft = [np.full((n_pub, C), 0.1, np.float32) for _ in range(N)]
  distilled = [
    {'x': to_uint8_images(np.zeros((7, 8, 8, 1))), 'y': np.zeros(7, np.int32)} for _ in range(N)
  ]
  model = {'w': np.zeros((50, 10), np.float32)}
  clusters = [np.array([0, 3, 4]), np.array([1, 5]), np.array([2])]
  heads = np.array([3, 1, 2])
  tr = hfldd_transfers(soft, distilled, clusters, heads, model, rounds)
  nb_soft, nb_dist, nb_model = (
    serialized_nbytes(soft[0]),
    serialized_nbytes(distilled[0]),
    serialized_nbytes(model),
  )
  members = 3  # 0 and 4 -> head 3, 5 -> head 1
  expect = N * nb_soft + members * nb_dist + 2 * rounds * len(heads) * nb_model
  assert total_bytes(tr) == expect
  dist = [t for t in tr if t.stage == 'distilled']
  assert sorted((t.sender, t.receiver) for t in dist) == [
    ('client0', 'client3'),
    ('client4', 'client3'),
    ('client5', 'client1'),
  ]
  assert all(t.round == 0 for t in tr if t.stage in ('soft_labels', 'distilled'))
  cum = cumulative_bytes(tr, rounds)
  assert cum[0] == N * nb_soft + members * nb_dist + 2 * 3 * nb_model and cum[-1] == expect
  # Eq. 18 (bits): soft labels at 32 bits, distilled images at 8 bits per pixel
  analytic = hfldd_cost_bits(N, n_pub, C, [7] * members, 8 * 8 * 8, rounds, 3, 500) // 8
  payload_extra = members * 7 * 4  # the int32 labels are not in Eq. 18
  assert 0 < expect - analytic - payload_extra <= len(tr) * 80
  # dict form of distilled uploads
  assert (
    total_bytes(hfldd_transfers(soft, dict(enumerate(distilled)), clusters, heads, model, rounds))
    == expect
  )


def test_fedseq_totals():
  clusters = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5])]
  tr = fedseq_transfers(clusters, 1000, rounds=2)
  assert total_bytes(tr) == 2 * ((3 + 1) + (2 + 1) + (1 + 1)) * 1000
  assert total_bytes(tr, stage='model_peer') == 2 * (2 + 1) * 1000
  assert fedseq_cost_bits(2, 10, 10, 250) == 2 * 10 * 11 * 250 * 32
  even = [np.arange(i * 4, i * 4 + 4) for i in range(5)]
  assert total_bytes(fedseq_transfers(even, 250 * 4, 3)) == fedseq_cost_bits(3, 5, 4, 250) // 8
  # one round at a time (what FedSeq records per step) adds up to the whole run
  one = fedseq_transfers(clusters, 1000, 1, first_round=2)
  assert {t.round for t in one} == {2}
  assert total_bytes(one) == total_bytes(tr, stage=None) - total_bytes(tr, upto_round=1)


def test_record_bytes_splits_by_direction():
  clusters = [np.array([0, 1, 2]), np.array([3])]
  fields = record_bytes(fedseq_transfers(clusters, 100, 1))
  assert fields == {'upload_bytes': 2 * 100, 'download_bytes': 2 * 100, 'peer_bytes': 2 * 100}
  soft = [np.zeros((4, 3), np.float32)] * 3
  setup = [
    t
    for t in hfldd_transfers(
      soft, {1: 50, 2: 70}, [np.array([0, 1, 2])], [0], 10, 1, data_stage='raw_data'
    )
    if t.round == 0
  ]
  assert dict(bytes_by_stage(setup)) == {
    'soft_labels': 3 * serialized_nbytes(soft[0]),
    'raw_data': 120,
  }
  assert record_bytes(setup) == {
    'upload_bytes': 3 * serialized_nbytes(soft[0]),
    'download_bytes': 0,
    'peer_bytes': 120,
  }


def test_rounds_to_target():
  acc = [0.1, 0.5, 0.79, 0.8, 0.9, 0.7]
  assert rounds_to_target(acc, 0.8) == 4
  assert rounds_to_target(acc, 0.05) == 1
  assert rounds_to_target(acc, 0.95) is None
  assert rounds_to_target([], 0.5) is None


def test_target_table_rows_and_format():
  a = [Transfer(0, 'distilled', 'client1', 'client0', 1_000_000)] + [
    Transfer(r, 'model_up', 'client0', 'server', 500_000) for r in range(1, 11)
  ]
  b = [
    Transfer(r, 'model_up', f'client{c}', 'server', 500_000)
    for r in range(1, 11)
    for c in range(10)
  ]
  results = [
    ('HFLDD', [0.5, 0.81, 0.9] + [0.9] * 7, a),
    ('FedAvg', [0.2, 0.3, 0.5, 0.6, 0.805, 0.9] + [0.9] * 4, b),
    ('FedSeq', [0.1] * 10, b),
  ]
  rows = target_table_rows(results, 0.8, reference='HFLDD')
  assert rows[0].rounds == 2 and rows[0].traffic_bytes == 1_000_000 + 2 * 500_000
  assert rows[0].accuracy == pytest.approx(0.81) and rows[0].ratio == pytest.approx(1.0)
  assert rows[1].rounds == 5 and rows[1].traffic_bytes == 5 * 10 * 500_000
  assert rows[1].ratio == pytest.approx(12.5) and rows[1].traffic_mb == pytest.approx(25.0)
  assert rows[2].rounds is None and rows[2].ratio is None
  text = format_target_table(rows)
  assert 'Accuracy=80%' in text and '| HFLDD | FedAvg | FedSeq |' in text
  assert '2/81.00%' in text and '5/80.50%' in text and '25.0M' in text and '12.5X' in text
  assert '| Ratio | 1.0X | 12.5X | — |' in text
