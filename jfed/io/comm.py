"""Communication cost from the real serialised bytes of what crosses the network.

Two accounts, kept side by side:

1. Measured (the primary one). Every transfer of a run is a `Transfer` (round, stage, sender,
   receiver, nbytes), with `nbytes` measured by `serialized_nbytes` = `len(flax.serialization.
   msgpack_serialize(to_state_dict(payload)))` (never pickle). A float32 array of n entries
   serialises to `4·n + ~16–26` bytes (msgpack ext header, shape, dtype name), plus the keys of
   the dict structure.
2. Analytic (`*_cost_bits`): the formulas of HFLDD (Shi et al., arXiv 2409.17517) in the form
   that reproduces its Tables III–V from the paper's own settings (tests/test_comm.py checks
   every cell).
   The tables' "MB" is MiB (2^20 bytes): `bits_to_mib`.

Run-level builders produce the transfer lists of the protocols compared in HFLDD:

* FedAvg / FedProx / DynaFed (Eq. 3): per round every participating client downloads the global
  model and uploads its local model, `2 · T · N` messages (`fedavg_transfers`). The tables count
  `(2T + 1) · N` model copies (`fedavg_cost_bits`); the measured account has no initial model
  download because every jfed client starts from the same seeded init (Sec. V-B: "the
  initialization of the server model can be sent as a random seed").
* HFLDD (Eq. 18): (i) every client uploads its soft labels `[n_public, C]` once; (ii) every
  non-head member sends its distilled set to its head (uint8 images, the paper's 8 bits per
  grey or per RGB channel value: `to_uint8_images`; jfed also sends the labels, which Eq. 18
  does not count); (iii) per round the server <-> head model exchange, `2 · T · |H|` messages
  (`hfldd_transfers`). The tables count `(2T + 1) · |H|` model copies (`hfldd_cost_bits`).
* FedSeq (Eq. 19, not legible in the paper's text): per round and superclient the server sends the
  model to the first client, it is handed client -> client n_c − 1 times, and the last client
  uploads it, `T · Σ_c (n_c + 1)` messages (`fedseq_transfers`), plus the one-off upload of
  every client's confidence vector (recorded by `jfed.methods.fedseq`). The tables count
  `(110 + 120 · T)` model copies at the paper's 10 clusters × 10 clients (`fedseq_cost_bits`).

Rounds are 1-based; setup stages (soft labels, distilled sets) have `round = 0` and count
towards every cumulative total. `record_bytes` maps transfers to the `upload_bytes` /
`download_bytes` / `peer_bytes` fields of the driver's metric records.
"""

from typing import (
  Any,
  Callable,
  Dict,
  Iterable,
  List,
  Mapping,
  NamedTuple,
  Optional,
  Sequence,
  Tuple,
  Union,
)

import numpy as np

from jfed.io.uploads import serialized_nbytes

SETUP_ROUND = 0


def to_uint8_images(x) -> np.ndarray:
  """Quantises [0, 1] images to uint8, `round(255 · clip(x, 0, 1))`.

  The paper counts distilled images at 8 bits per channel value.
  """
  return np.round(np.clip(np.asarray(x, np.float64), 0.0, 1.0) * 255.0).astype(np.uint8)


# ------------------------------------------------------------------------------------------------
# transfers
# ------------------------------------------------------------------------------------------------
class Transfer(NamedTuple):
  """One message of a protocol."""

  round: int  # 1-based FL round; 0 = one-off setup stage
  stage: str  # 'model_down' | 'model_up' | 'model_peer' | 'soft_labels' | 'distilled' | ...
  sender: str  # 'server' or f'client{i}'
  receiver: str
  nbytes: int


def _nbytes(payload_or_nbytes: Any) -> int:
  if isinstance(payload_or_nbytes, (int, np.integer)):
    return int(payload_or_nbytes)
  return serialized_nbytes(payload_or_nbytes)


def _client(i) -> str:
  return f'client{int(i)}'


def model_round_transfers(
  round: int,
  model: Any,
  participants: Iterable[int],
  *,  # pylint: disable=redefined-builtin
  down: bool = True,
  up: bool = True,
  up_model: Any = None,
) -> List[Transfer]:
  """One FL round: server -> client (the global model) and client -> server (its local model).

  Args:
    round: the 1-based round.
    model: the global model payload (a pytree) or its byte count.
    participants: client ids.
    down: count the downloads.
    up: count the uploads.
    up_model: the uploaded payload or its byte count (default: `model`).

  Returns:
    The round's transfers, client by client.
  """
  nb_down = _nbytes(model)
  nb_up = nb_down if up_model is None else _nbytes(up_model)
  out = []
  for c in participants:
    if down:
      out.append(Transfer(round, 'model_down', 'server', _client(c), nb_down))
    if up:
      out.append(Transfer(round, 'model_up', _client(c), 'server', nb_up))
  return out


def fedavg_transfers(
  model: Any, rounds: int, participants: Union[Sequence[int], Sequence[Sequence[int]]]
) -> List[Transfer]:
  """FedAvg / FedProx / DynaFed (Eq. 3): 2 messages per round and participant.

  No initial model download (clients start from a seeded init), unlike `fedavg_cost_bits`.

  Args:
    model: the model payload or its byte count.
    rounds: number of rounds T.
    participants: one list of clients used every round, or one list per round (partial
      participation).

  Returns:
    The transfers of all rounds.
  """
  nb = _nbytes(model)
  parts = list(participants)
  per_round = parts if len(parts) and not np.isscalar(parts[0]) else [parts] * rounds
  if len(per_round) != rounds:
    raise ValueError(f'{len(per_round)} participant lists for {rounds} rounds')
  out: List[Transfer] = []
  for r, clients in enumerate(per_round, start=1):
    out += model_round_transfers(r, nb, clients)
  return out


def hfldd_transfers(
  soft_labels: Sequence[Any],
  distilled: Union[Mapping[int, Any], Sequence[Any]],
  clusters: Sequence[Sequence[int]],
  heads: Sequence[int],
  model: Any,
  rounds: int,
  data_stage: str = 'distilled',
) -> List[Transfer]:
  """HFLDD (Eq. 18) from the actual uploads; the initial model is a seed (not counted).

  Args:
    soft_labels: per client (index = client id) the uploaded soft-label payload or its bytes.
    distilled: per client the distilled-set payload or its bytes: a sequence indexed by client
      id or a mapping {client id: payload}. Only non-head members send theirs (to their head).
    clusters: the heterogeneous clusters (client ids).
    heads: the head of every cluster.
    model: the model payload or its byte count, exchanged server <-> every head each round.
    rounds: number of rounds T.
    data_stage: the stage name of the member -> head sets ('raw_data' for HFLDD w/o DD).

  Returns:
    Setup transfers (round 0: soft labels, then the members' sets), then every round's.
  """
  out = [
    Transfer(SETUP_ROUND, 'soft_labels', _client(i), 'server', _nbytes(p))
    for i, p in enumerate(soft_labels)
  ]
  get = distilled.__getitem__
  for cl, h in zip(clusters, heads):
    for c in cl:
      if int(c) != int(h):
        out.append(Transfer(SETUP_ROUND, data_stage, _client(c), _client(h), _nbytes(get(int(c)))))
  nb = _nbytes(model)
  for r in range(1, rounds + 1):
    out += model_round_transfers(r, nb, heads)
  return out


def fedseq_transfers(
  clusters: Sequence[Sequence[int]], model: Any, rounds: int, first_round: int = 1
) -> List[Transfer]:
  """FedSeq's model messages, as jfed runs it (the paper's count: `fedseq_cost_bits`).

  Per round and cluster: server -> first client, client -> next client (n_c − 1 hand-offs),
  last client -> server. FedSeq shuffles the order every round; the count does not depend on
  it.

  Args:
    clusters: client ids of every superclient, in the order they are visited.
    model: the model payload or its byte count.
    rounds: number of rounds with these clusters.
    first_round: the number of the first of them.

  Returns:
    The transfers of all rounds.
  """
  nb = _nbytes(model)
  out: List[Transfer] = []
  for r in range(first_round, first_round + rounds):
    for cl in clusters:
      cl = [int(c) for c in cl]
      if not cl:
        continue
      out.append(Transfer(r, 'model_down', 'server', _client(cl[0]), nb))
      for a, b in zip(cl[:-1], cl[1:]):
        out.append(Transfer(r, 'model_peer', _client(a), _client(b), nb))
      out.append(Transfer(r, 'model_up', _client(cl[-1]), 'server', nb))
  return out


def total_bytes(
  transfers: Iterable[Transfer], upto_round: Optional[int] = None, stage: Optional[str] = None
) -> int:
  """Sum of `nbytes`, optionally only of rounds <= `upto_round` and of one `stage`.

  Args:
    transfers: The transfer list of a run (from `*_transfers`).
    upto_round: Last round counted (inclusive); None counts every round.
    stage: Only transfers of this stage (e.g. 'model_up'); None counts every stage.

  Returns:
    The total in bytes.
  """
  return int(
    sum(
      t.nbytes
      for t in transfers
      if (upto_round is None or t.round <= upto_round) and (stage is None or t.stage == stage)
    )
  )


def bytes_by_stage(transfers: Iterable[Transfer]) -> List[Tuple[str, int]]:
  """[(stage, bytes)] in order of first appearance."""
  acc: Dict[str, int] = {}
  for t in transfers:
    acc[t.stage] = acc.get(t.stage, 0) + t.nbytes
  return list(acc.items())


def cumulative_bytes(transfers: Iterable[Transfer], rounds: int) -> np.ndarray:
  """int64 [rounds]: the total bytes after round r at index r − 1, setup included."""
  per = np.zeros(rounds + 1, np.int64)
  for t in transfers:
    if t.round <= rounds:
      per[t.round] += t.nbytes
  return np.cumsum(per)[1:]


def record_bytes(transfers: Iterable[Transfer]) -> Dict[str, int]:
  """The byte fields of a driver record: to the server, from the server, between clients.

  Args:
    transfers: the transfers of one step (or of the setup).

  Returns:
    {'upload_bytes', 'download_bytes', 'peer_bytes'}.
  """
  out = {'upload_bytes': 0, 'download_bytes': 0, 'peer_bytes': 0}
  for t in transfers:
    field = (
      'upload_bytes'
      if t.receiver == 'server'
      else 'download_bytes'
      if t.sender == 'server'
      else 'peer_bytes'
    )
    out[field] += int(t.nbytes)
  return out


# ------------------------------------------------------------------------------------------------
# HFLDD's analytic traffic (bits), in the form that reproduces its Tables III–V
# ------------------------------------------------------------------------------------------------
MIB = 2**20  # Tables III–V label their unit "MB", but only 2^20-byte units reproduce them
PARAM_BITS = 32  # b: Sec. V-B, "usually 32 bits"
VALUE_BITS = 8  # b_d per grey value or RGB channel value: Sec. V-B, "1 × 8 bits or 3 × 8 bits"


def bits_to_mib(bits: Union[int, float]) -> float:
  """Bits in MiB, the unit Tables III–V print (as "MB")."""
  return bits / 8 / MIB


def fedavg_cost_bits(rounds: int, num_clients: int, num_params: int, bits: int = PARAM_BITS) -> int:
  """FedAvg / FedProx / DynaFed as HFLDD Tables III–V count them: `(2T + 1) · N · |w| · b`.

  Eq. 3 itself is not legible in the paper's text; Sec. III-B says its cost "comes from the local
  model upload and the global model download" (2T copies per client) and Sec. VI-C applies it
  to FedProx and DynaFed too. The tables count one copy more per client: (2T + 1) · N with
  N = 100 reproduces the nine FedAvg / FedProx / DynaFed cells (eight rounded to the printed
  digit; Table IV's DynaFed prints 23738.7 for 23738.77 MiB, truncated), 2T · N none. The paper
  does not say what the extra copy is; the initial model download is the natural reading.
  `fedavg_transfers` (measured) has no such download: jfed clients start from a seeded init.

  Args:
    rounds: T.
    num_clients: N, the clients of every round.
    num_params: |w|.
    bits: b per parameter.

  Returns:
    The cost in bits.
  """
  return (2 * rounds + 1) * num_clients * num_params * bits


def hfldd_cost_bits(
  num_clients: int,
  n_public: int,
  num_classes: int,
  distilled_sizes: Sequence[int],
  sample_bits: int,
  rounds: int,
  num_heads: int,
  num_params: int,
  bits: int = PARAM_BITS,
) -> int:
  """HFLDD (Shi et al., arXiv 2409.17517) Eq. 18 as Tables III–V count it.

  `N · n_pub · C · b + Σ_{members} |D̃_i| · b_d + (2T + 1) · |H| · |w| · b`: soft labels
  uploaded once, distilled sets sent member -> head once (heads send none), and the model
  exchange between the server and the heads. Sec. V-B describes the last term as T rounds of
  server <-> head traffic with the initial model sent as a seed, but only the (2T + 1) form
  reproduces Tables III–V (with N = 100, n_pub = 1000, C = 10, b = 32, 400 distilled images of
  8 bits per value per member, |H| = 16 / 23 / 26; each of those |H| is the only one in
  1..100 that reproduces its table). Like `fedavg_cost_bits`, one copy per head more than the
  measured `hfldd_transfers`.

  Args:
    num_clients: N.
    n_public: public samples (soft labels per client).
    num_classes: C.
    distilled_sizes: |D̃_i| of every non-head member.
    sample_bits: b_d per image (H · W · channels · 8 for uint8 images).
    rounds: T.
    num_heads: |H|.
    num_params: |w|.
    bits: b, bits per soft label and parameter.

  Returns:
    The cost in bits.
  """
  return (
    num_clients * n_public * num_classes * bits
    + int(sum(distilled_sizes)) * sample_bits
    + (2 * rounds + 1) * num_heads * num_params * bits
  )


def fedseq_cost_bits(
  rounds: int, cluster_sizes: Sequence[int], num_params: int, bits: int = PARAM_BITS
) -> int:
  """FedSeq as HFLDD Tables III–V count it: `(Σ_c (n_c + 1) + T · Σ_c (n_c + 2)) · |w| · b`.

  Eq. 19 is not legible in the paper's text ("parameter sharing between clients within cluster
  and across clusters", N_c clusters of n_c clients). At the paper's N_c = n_c = 10 the three
  FedSeq cells are reproduced by (110 + 120 · T) model copies, and by no other a + b · T with
  integers a, b < 400. How 110 and 120 split over N_c and n_c is a guess, exact only at
  10 × 10: per round and cluster n_c + 2 = download, n_c hand-offs round the ring ("clients
  form a ring topology", Sec. II-C) back to the first client, upload; once, n_c + 1 per
  cluster, which the paper does not explain. The measured `fedseq_transfers` has n_c + 1 per
  round and cluster (no ring closure) and no one-off model term.

  Args:
    rounds: T.
    cluster_sizes: n_c of every cluster (superclient).
    num_params: |w|.
    bits: b per parameter.

  Returns:
    The cost in bits.
  """
  sizes = [int(n) for n in cluster_sizes]
  copies = sum(n + 1 for n in sizes) + rounds * sum(n + 2 for n in sizes)
  return copies * num_params * bits


# ------------------------------------------------------------------------------------------------
# rounds and traffic to reach a target accuracy (HFLDD, Shi et al., arXiv 2409.17517, Tables III–V)
# ------------------------------------------------------------------------------------------------
def rounds_to_target(acc_per_round, target: float) -> Optional[int]:
  """The first round whose accuracy reaches `target`.

  Args:
    acc_per_round: `acc_per_round[r - 1]` is the accuracy after round r.
    target: in the same unit as the accuracies.

  Returns:
    The 1-based round, or None if the target is never reached.
  """
  acc = np.asarray(acc_per_round, np.float64)
  hit = np.flatnonzero(acc >= target)
  return int(hit[0]) + 1 if hit.size else None


class TargetRow(NamedTuple):
  """One method's column of Tables III–V: measured bytes and, beside them, the paper's count."""

  method: str
  target: float
  rounds: Optional[int]  # None: target never reached
  accuracy: Optional[float]  # accuracy at that round
  traffic_bytes: Optional[int]  # measured total up to and including that round (setup included)
  ratio: Optional[float]  # measured traffic / that of the reference method
  paper_bits: Optional[int] = None  # the `*_cost_bits` formula at `rounds`, if one applies
  paper_ratio: Optional[float] = None  # paper_bits / that of the reference method

  @property
  def traffic_mb(self) -> Optional[float]:
    """Measured traffic in MB = 10^6 bytes."""
    return None if self.traffic_bytes is None else self.traffic_bytes / 1e6

  @property
  def traffic_mib(self) -> Optional[float]:
    """Measured traffic in MiB, the unit of the paper's tables."""
    return None if self.traffic_bytes is None else self.traffic_bytes / MIB

  @property
  def paper_mib(self) -> Optional[float]:
    return None if self.paper_bits is None else bits_to_mib(self.paper_bits)


def target_table_rows(
  results: Sequence[Tuple[str, Any, Sequence[Transfer]]],
  target: float,
  reference: Optional[str] = None,
  paper_bits: Optional[Mapping[str, Callable[[int], Optional[int]]]] = None,
) -> List[TargetRow]:
  """Rows of HFLDD's (Shi et al., arXiv 2409.17517) Tables III–V.

  Args:
    results: (method, accuracy per round, transfers) per method.
    target: the target accuracy.
    reference: the method whose traffic is 1X (default: the first).
    paper_bits: per method, rounds -> the paper formula's bits (`fedavg_cost_bits` etc. with the
      run's settings bound), or None where no formula applies.

  Returns:
    One row per method; `ratio` is None when either method misses the target.
  """
  paper_bits = paper_bits or {}
  rows = []
  for name, acc, transfers in results:
    r = rounds_to_target(acc, target)
    if r is None:
      rows.append(TargetRow(name, target, None, None, None, None))
    else:
      formula = paper_bits.get(name)
      rows.append(
        TargetRow(
          name,
          target,
          r,
          float(np.asarray(acc)[r - 1]),
          total_bytes(transfers, upto_round=r),
          None,
          None if formula is None else formula(r),
        )
      )
  ref_name = rows[0].method if (reference is None and rows) else reference
  ref = next((row for row in rows if row.method == ref_name), None)

  def ratio(value, ref_value):
    return None if (value is None or not ref_value) else value / ref_value

  return [
    row._replace(
      ratio=ratio(row.traffic_bytes, ref and ref.traffic_bytes),
      paper_ratio=ratio(row.paper_bits, ref and ref.paper_bits),
    )
    for row in rows
  ]


def format_target_table(rows: Sequence[TargetRow], percent: bool = True) -> str:
  """A Markdown table in the layout of Tables III–V (metrics as rows, methods as columns).

  Traffic is in MiB (the tables' "MB"): the measured serialised bytes, and the paper's formula
  when any row has one.
  """
  if not rows:
    return ''
  scale = 100.0 if percent else 1.0
  unit = '%' if percent else ''
  tgt = f'{rows[0].target * scale:g}{unit}'

  def cells(values, fmt):
    return ' | '.join('—' if v is None else fmt.format(v) for v in values)

  cell_r = [
    ('—' if r.rounds is None else f'{r.rounds}/{r.accuracy * scale:.2f}{unit}') for r in rows
  ]
  lines = [
    f'Accuracy={tgt}',
    '| Metrics | ' + ' | '.join(r.method for r in rows) + ' |',
    '|---|' + '---|' * len(rows),
    '| rounds/Accuracy | ' + ' | '.join(cell_r) + ' |',
    '| Traffic, measured (MiB) | ' + cells([r.traffic_mib for r in rows], '{:.1f}') + ' |',
  ]
  with_paper = any(r.paper_bits is not None for r in rows)
  if with_paper:
    lines.append(
      '| Traffic, paper formula (MiB) | ' + cells([r.paper_mib for r in rows], '{:.1f}') + ' |'
    )
  lines.append('| Ratio, measured | ' + cells([r.ratio for r in rows], '{:.1f}X') + ' |')
  if with_paper:
    lines.append(
      '| Ratio, paper formula | ' + cells([r.paper_ratio for r in rows], '{:.1f}X') + ' |'
    )
  return '\n'.join(lines)
