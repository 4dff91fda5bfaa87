"""jfed's partition procedures against the authors' own partition functions, as distributions.

  python -m experiments.parity.partitions --reference_python=PATH/TO/venv/bin/python \
      --out=runs/parity/partitions [--draws=100] [--pairs=dense_dirichlet_a0.5,...]

jfed seeds its partitions with `np.random.default_rng(seed)`, the authors' codes seed the legacy
global `np.random` (or a `RandomState`), so the index lists cannot be the same; what can be the
same is the distribution they are drawn from. For each pair (jfed scheme, reference function) this
draws `--draws` partitions of the Fashion-MNIST training labels on each side, jfed's with seeds
S..S+N-1 (S = `--first_seed`, 0) and the reference's with the same seeds, used as the authors'
scripts use their seed, and compares the two samples of partitions statistic by statistic:

- draws refused (the call raised), and draws refused or leaving samples with no client: the
  fractions, Fisher's exact test;
- per successful draw: the unassigned samples, and the client sizes sorted largest first (the
  size of the r-th largest client, one value per draw, r = 1..n): two-sample Kolmogorov-Smirnov
  tests (`scipy.stats.ks_2samp`);
- pooled over the clients of all successful draws: the number of classes a client holds (count
  > 0), and the samples a client holds of a class (every cell of the [clients, classes] table):
  the KS distance of the pooled samples, with its p-value from a permutation test that shuffles
  whole draws between the sides (the values within one draw are not independent; whole draws
  are), since `ks_2samp`'s p assumes independent values.

A p < 0.05 says the procedures differ in that statistic; a larger p only says this many draws show
no difference. Per pair the table also gives the rows that differ after Holm's correction over the
pair's rows (family-wise 5 %).

The reference side runs in a subprocess of `--reference_python` (numpy, torch, torchvision)
through `experiments/parity/shims/partition_shim.py`, which imports the function from a scratch
checkout of the authors' repository (their files are never edited) and writes the per-draw
summaries; each is kept as `<out>/reference_<pair>.json` and reused by a rerun with the same
request. jfed's side uses the shim's own `summarize`, so both sides are summarised by one code.
Outputs: `<out>/partitions.md` (a table per pair) and `<out>/partitions.json` (every row, and the
per-draw summaries of both sides).

The checkouts (flags `--dense_dir`, `--fedmho_dir`, `--fed_cvae_dir`, `--niidbench_dir`) are
clones of github.com/zj-jayzhang/DENSE, github.com/YXShi2000/FedMHO (FedDF's pcode),
github.com/ceh-2000/fed_cvae and github.com/Xtra-Computing/NIID-Bench.
"""

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple
import warnings

import numpy as np

LEVEL = 0.05
PERMUTATIONS = 999
SHIM = pathlib.Path(__file__).resolve().parent / 'shims' / 'partition_shim.py'


@dataclasses.dataclass(frozen=True)
class Pair:
  """One comparison: a jfed scheme and the authors' function it claims to reproduce."""

  name: str
  scheme: str  # jfed's make_partition scheme
  jfed_kwargs: Tuple[Tuple[str, Any], ...]
  reference: str  # the shim's --reference
  repository: str  # owner/name of the public repository
  function: str  # the reference function as called, file:function
  marker: str  # a file every checkout of the repository has
  num_clients: int
  shim_args: Tuple[str, ...] = ()
  max_draws: Optional[int] = None  # a refusal check needs no hundred draws
  note: str = ''


def _dense(alpha: float) -> Pair:
  return Pair(
    name=f'dense_dirichlet_a{alpha}',
    scheme='dirichlet',
    jfed_kwargs=(('alpha', alpha),),
    reference='dense',
    repository='zj-jayzhang/DENSE',
    function=f"helpers/datasets.py:partition_data('fmnist', 'dirichlet', beta={alpha}, "
    'num_users=5) after helpers/utils.py:setup_seed(seed)',
    marker='helpers/datasets.py',
    num_clients=5,
    shim_args=(f'--alpha={alpha}',),
  )


def _feddf(alpha: float, clients: int) -> Pair:
  return Pair(
    name=f'feddf_dirichlet_a{alpha}_n{clients}',
    scheme='feddf_dirichlet',
    jfed_kwargs=(('alpha', alpha),),
    reference='fedmho',
    repository='YXShi2000/FedMHO',
    function='pcode/datasets/partition_data.py:DataPartitioner(conf, train, [1/n]*n, '
    f"'non_iid_dirichlet'), non_iid_alpha={alpha}, random_state=RandomState(seed)",
    marker='pcode/datasets/partition_data.py',
    num_clients=clients,
    shim_args=(f'--alpha={alpha}',),
    max_draws=10 if clients < 10 else None,
    note=(
      'FedDF groups clients into blocks of 10 "auxiliary workers" and asserts n >= 10 '
      '(partition_data.py:214); jfed raises PartitionError. A refusal check, 10 draws.'
      if clients < 10
      else ''
    ),
  )


def _fedcvae(alpha: float) -> Pair:
  return Pair(
    name=f'fedcvae_dirichlet_a{alpha}',
    scheme='fedcvae_dirichlet',
    jfed_kwargs=(('alpha', alpha),),
    reference='fed_cvae',
    repository='ceh-2000/fed_cvae',
    function=f"data.py:Data(seed, 'fashion', 5, alpha={alpha}, sample_ratio=1.0)"
    '.split_data_dirichlet',
    marker='data.py',
    num_clients=5,
    shim_args=(f'--alpha={alpha}', '--sample_ratio=1.0'),
  )


def _shards(k: int, clients: int) -> Pair:
  return Pair(
    name=f'shards_k{k}_n{clients}',
    scheme='shards',
    jfed_kwargs=(('k', k),),
    reference='niidbench',
    repository='Xtra-Computing/NIID-Bench',
    function=f"utils.py:partition_data('fmnist', ..., 'noniid-#label{k}', {clients}) after "
    'np.random.seed, torch.manual_seed, random.seed (experiments.py)',
    marker='utils.py',
    num_clients=clients,
    shim_args=(f'--k={k}',),
    note=(
      'With fewer clients than classes some class can have no owner; NIID-Bench then raises '
      'in np.array_split(idx_k, 0) (utils.py:383), jfed drops that class.'
      if clients < 10
      else ''
    ),
  )


# Co-Boosting (github.com/rong-dai/Co-Boosting) has no "noniid-#label": its `n_cls` partition
# (utils_fl.py) gives client i the fixed classes (k*i + j) mod C with <= 5 clients, so the #C=k
# pair uses NIID-Bench, where the scheme is defined.
PAIRS = (
  _dense(0.5),
  _dense(0.1),
  _feddf(0.5, 10),
  _feddf(0.1, 10),
  _feddf(0.5, 5),
  _fedcvae(0.5),
  _fedcvae(0.1),
  _shards(2, 10),
  _shards(3, 10),
  _shards(2, 5),
)


# ------------------------------------------------------------------------------------------------
# the shim's summary, shared by both sides
# ------------------------------------------------------------------------------------------------


def _shim():
  """The shim as a module (numpy only at import), for its `summarize`."""
  spec = importlib.util.spec_from_file_location('_partition_shim', SHIM)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def summarize(labels, parts, num_classes: int) -> Dict[str, Any]:
  """Client sizes, [clients, classes] counts, unassigned and doubly held samples of a partition."""
  return _shim().summarize(np.asarray(labels, np.int64), parts, num_classes)


def jfed_draws(
  labels: np.ndarray, scheme: str, num_clients: int, seeds: Sequence[int], **kwargs
) -> List[Dict[str, Any]]:
  """jfed's partitions, summarised per seed (a PartitionError is recorded, as the shim does).

  Args:
    labels: The training labels, shape [N].
    scheme: A `jfed.data.make_partition` scheme.
    num_clients: Clients per partition.
    seeds: One draw per seed.
    **kwargs: The scheme's arguments (alpha, k, ...).

  Returns:
    Per seed a dict: 'seed' and either the `summarize` keys or 'error'.
  """
  from jfed.data.partitions import PartitionError, make_partition  # pylint: disable=g-import-not-at-top

  shim = _shim()
  labels = np.asarray(labels, np.int64)
  num_classes = int(labels.max()) + 1
  draws = []
  for seed in seeds:
    try:
      parts = make_partition(labels, num_clients, scheme, seed, **kwargs)
      draws.append({'seed': int(seed), **shim.summarize(labels, parts, num_classes)})
    except PartitionError as e:
      draws.append({'seed': int(seed), 'error': f'{type(e).__name__}: {e}'})
  return draws


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  statistic: str
  jfed_mean: float
  reference_mean: float
  distance: float  # KS distance, or for Fisher rows the difference of the fractions
  p: float
  test: str
  verdict: str


def _ok(draws: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
  return [d for d in draws if 'error' not in d]


def _verdict(p: float, level: float = LEVEL) -> str:
  if math.isnan(p):
    return 'n/a'
  return 'differ' if p < level else 'no evidence of a difference'


def _constant_equal(a: np.ndarray, b: np.ndarray) -> bool:
  return a.size > 0 and b.size > 0 and np.all(a == a.flat[0]) and np.all(b == a.flat[0])


def ks_row(statistic: str, jfed: Sequence[float], reference: Sequence[float]) -> Row:
  """Two-sample KS test of per-draw values (independent across draws)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top

  a, b = np.asarray(jfed, np.float64), np.asarray(reference, np.float64)
  if len(a) < 2 or len(b) < 2:
    return Row(statistic, _mean(a), _mean(b), math.nan, math.nan, 'KS', 'n/a')
  if _constant_equal(a, b):
    return Row(statistic, _mean(a), _mean(b), 0.0, 1.0, 'KS', 'identical (constant)')
  with warnings.catch_warnings():  # tied values: scipy falls back from exact to asymptotic p
    warnings.filterwarnings('ignore', 'ks_2samp: Exact calculation unsuccessful')
    r = stats.ks_2samp(a, b)
  p = float(r.pvalue)
  return Row(statistic, _mean(a), _mean(b), float(r.statistic), p, 'KS', _verdict(p))


def _mean(x: np.ndarray) -> float:
  return float(np.mean(x)) if len(x) else math.nan


def draw_permutation_ks(
  jfed: Sequence[np.ndarray],
  reference: Sequence[np.ndarray],
  permutations: int = PERMUTATIONS,
  seed: int = 0,
) -> Tuple[float, float]:
  """KS distance of pooled values and its p from shuffling whole draws between the two sides.

  Args:
    jfed: Per draw of one side, the values it contributes (e.g. classes per client).
    reference: The same for the other side.
    permutations: Random relabellings of the draws.
    seed: Seed of the relabelling.

  Returns:
    (D, p): `ks_2samp`'s statistic on the pooled values and (1 + #{D* >= D}) / (1 + permutations).
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top

  groups = [np.asarray(g, np.float64).reshape(-1) for g in list(jfed) + list(reference)]
  n = len(jfed)

  def distance(order):
    a = np.sort(np.concatenate([groups[i] for i in order[:n]]))
    b = np.sort(np.concatenate([groups[i] for i in order[n:]]))
    x = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, x, side='right') / len(a)
    cdf_b = np.searchsorted(b, x, side='right') / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))  # ks_2samp's statistic, without its overhead

  pooled = [np.concatenate(groups[:n]), np.concatenate(groups[n:])]
  observed = float(stats.ks_2samp(*pooled, method='asymp').statistic)
  rng = np.random.default_rng(seed)
  hits = sum(
    distance(rng.permutation(len(groups))) >= observed - 1e-12 for _ in range(permutations)
  )
  return observed, (1 + hits) / (1 + permutations)


def pooled_row(
  statistic: str,
  jfed: Sequence[np.ndarray],
  reference: Sequence[np.ndarray],
  permutations: int = PERMUTATIONS,
) -> Row:
  """KS distance of values pooled over draws, p from a permutation of whole draws."""
  a_all = np.concatenate([np.ravel(g) for g in jfed]) if len(jfed) else np.zeros(0)
  b_all = np.concatenate([np.ravel(g) for g in reference]) if len(reference) else np.zeros(0)
  test = 'KS, draw permutation'
  if len(jfed) < 2 or len(reference) < 2:
    return Row(statistic, _mean(a_all), _mean(b_all), math.nan, math.nan, test, 'n/a')
  if _constant_equal(a_all, b_all):
    return Row(statistic, _mean(a_all), _mean(b_all), 0.0, 1.0, test, 'identical (constant)')
  d, p = draw_permutation_ks(jfed, reference, permutations)
  return Row(statistic, _mean(a_all), _mean(b_all), d, p, test, _verdict(p))


def fisher_row(statistic: str, jfed: Sequence[bool], reference: Sequence[bool]) -> Row:
  """Fractions of draws with a property, Fisher's exact test (two-sided)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top

  a, b = np.asarray(jfed, bool), np.asarray(reference, bool)
  fa, fb = _mean(a), _mean(b)
  if not len(a) or not len(b):
    return Row(statistic, fa, fb, math.nan, math.nan, 'Fisher', 'n/a')
  if _constant_equal(a, b):
    return Row(statistic, fa, fb, 0.0, 1.0, 'Fisher', 'identical (constant)')
  table = [[int(a.sum()), int(len(a) - a.sum())], [int(b.sum()), int(len(b) - b.sum())]]
  p = float(stats.fisher_exact(table).pvalue)
  return Row(statistic, fa, fb, abs(fa - fb), p, 'Fisher', _verdict(p))


def holm(pvalues: Sequence[float], level: float = LEVEL) -> List[bool]:
  """Holm's step-down rejections (family-wise `level`); NaN p-values are never rejected."""
  p = np.asarray(pvalues, np.float64)
  finite = [i for i in np.argsort(p, kind='stable') if not math.isnan(p[i])]
  reject = [False] * len(p)
  m = len(finite)
  for rank, i in enumerate(finite):
    if p[i] >= level / (m - rank):
      break
    reject[i] = True
  return reject


def compare(
  jfed: Sequence[Mapping[str, Any]],
  reference: Sequence[Mapping[str, Any]],
  num_clients: int,
  permutations: int = PERMUTATIONS,
) -> List[Row]:
  """Every statistic of two samples of partition draws (the module docstring lists them).

  Args:
    jfed: Per draw, `summarize`'s dict or {'error': ...}.
    reference: The same for the other procedure.
    num_clients: Clients per draw.
    permutations: Of the draw-permutation tests.

  Returns:
    The rows, each with its verdict ('differ', 'no evidence of a difference',
    'identical (constant)' or 'n/a').
  """
  rows = [
    fisher_row(
      'draws refused (raised)', ['error' in d for d in jfed], ['error' in d for d in reference]
    ),
    fisher_row(
      'draws refused or leaving samples unassigned',
      ['error' in d or d['unassigned'] > 0 for d in jfed],
      ['error' in d or d['unassigned'] > 0 for d in reference],
    ),
  ]
  a, b = _ok(jfed), _ok(reference)
  rows.append(
    ks_row('unassigned samples', [d['unassigned'] for d in a], [d['unassigned'] for d in b])
  )
  if any(d['duplicates'] for d in list(a) + list(b)):
    rows.append(
      ks_row('samples held twice', [d['duplicates'] for d in a], [d['duplicates'] for d in b])
    )
  sizes_a = np.array([sorted(d['sizes'], reverse=True) for d in a]).reshape(-1, num_clients)
  sizes_b = np.array([sorted(d['sizes'], reverse=True) for d in b]).reshape(-1, num_clients)
  for r in range(num_clients):
    rows.append(ks_row(f'client size, rank {r + 1} (largest first)', sizes_a[:, r], sizes_b[:, r]))
  counts_a = [np.asarray(d['class_counts']) for d in a]
  counts_b = [np.asarray(d['class_counts']) for d in b]
  rows.append(
    pooled_row(
      'classes per client (count > 0)',
      [(c > 0).sum(axis=1) for c in counts_a],
      [(c > 0).sum(axis=1) for c in counts_b],
      permutations,
    )
  )
  rows.append(pooled_row('samples per (client, class)', counts_a, counts_b, permutations))
  return rows


def pair_verdict(rows: Sequence[Row], level: float = LEVEL) -> Dict[str, Any]:
  """The rows with p < level, those that survive Holm's correction, and the pair's verdict."""
  pvalues = [r.p for r in rows]
  rejected = holm(pvalues, level)
  raw = [r.statistic for r in rows if not math.isnan(r.p) and r.p < level]
  corrected = [r.statistic for r, rej in zip(rows, rejected) if rej]
  tested = sum(not math.isnan(p) for p in pvalues)
  if corrected:
    verdict = 'differ'
  elif tested and all(r.verdict in ('identical (constant)', 'n/a') for r in rows):
    verdict = 'identical (every tested row constant)'
  elif tested:
    verdict = 'no evidence of a difference'
  else:
    verdict = 'n/a'
  return {'tested': tested, 'raw': raw, 'holm': corrected, 'verdict': verdict}


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def _fmt(v: float, digits: int = 1) -> str:
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return '–'
  if abs(v) >= 100 or float(v).is_integer():
    return f'{v:.{digits}f}'
  return f'{v:.3g}'


def _fmt_p(p: float) -> str:
  if math.isnan(p):
    return '–'
  return f'{p:.2e}' if p < 1e-3 else f'{p:.3f}'


def render_pair(pair: Pair, result: Mapping[str, Any]) -> str:
  """The markdown section of one pair."""
  rows = [Row(**r) for r in result['rows']]
  summary = result['summary']
  kwargs = ', '.join(f'{k}={v}' for k, v in pair.jfed_kwargs)
  seeds = '{}..{}'.format(*result['seeds']) if result.get('seeds') else '–'
  lines = [
    f'## {pair.name}',
    '',
    f'- jfed: `make_partition(train_y, {pair.num_clients}, {pair.scheme!r}, seed, {kwargs})`, '
    f'seeds {seeds} (`np.random.default_rng`)',
    f'- reference: {pair.repository}@{result["commit"][:10]} `{pair.function}`, seeds {seeds}',
    f'- draws: {result["draws"]} per side; successful: jfed {result["ok"][0]}, reference '
    f'{result["ok"][1]}',
  ]
  if result.get('errors'):
    for side, errors in zip(('jfed', 'reference'), result['errors']):
      if errors:
        lines.append(f'- {side} raised: ' + '; '.join(f'`{e}` ×{n}' for e, n in errors.items()))
  if pair.note:
    lines.append(f'- note: {pair.note}')
  lines += [
    '',
    '| statistic | jfed mean | reference mean | KS D (Fisher: Δ fraction) | p | test | verdict |',
    '|---|---:|---:|---:|---:|---|---|',
  ]
  for r in rows:
    lines.append(
      f'| {r.statistic} | {_fmt(r.jfed_mean)} | {_fmt(r.reference_mean)} | '
      f'{_fmt(r.distance, 3)} | {_fmt_p(r.p)} | {r.test} | {r.verdict} |'
    )
  lines += [
    '',
    f'Rows with p < {LEVEL}: {len(summary["raw"])} of {summary["tested"]} tested'
    + (f' ({", ".join(summary["raw"])})' if summary['raw'] else '')
    + f'; after Holm: {len(summary["holm"])}'
    + (f' ({", ".join(summary["holm"])})' if summary['holm'] else '')
    + f'. **Pair: {summary["verdict"]}.**',
    '',
  ]
  return '\n'.join(lines)


def render(pairs: Sequence[Pair], results: Mapping[str, Mapping[str, Any]], header: str) -> str:
  """The whole partitions.md: an overview, then a table per pair."""
  lines = [
    "# jfed's partitions against the authors' partition functions",
    '',
    header,
    '',
    '| pair | draws | rows p < 0.05 | after Holm | verdict |',
    '|---|---:|---:|---:|---|',
  ]
  for pair in pairs:
    s = results[pair.name]['summary']
    lines.append(
      f'| {pair.name} | {results[pair.name]["draws"]} | {len(s["raw"])}/{s["tested"]} | '
      f'{len(s["holm"])} | {s["verdict"]} |'
    )
  lines.append('')
  lines += [render_pair(pair, results[pair.name]) for pair in pairs]
  return '\n'.join(lines)


def _errors(draws: Sequence[Mapping[str, Any]]) -> Dict[str, int]:
  counts: Dict[str, int] = {}
  for d in draws:
    if 'error' in d:
      counts[d['error']] = counts.get(d['error'], 0) + 1
  return counts


def evaluate(
  pair: Pair,
  jfed: Sequence[Mapping[str, Any]],
  reference: Mapping[str, Any],
  permutations: int = PERMUTATIONS,
) -> Dict[str, Any]:
  """Rows, summary and the bookkeeping of one pair (what partitions.json keeps per pair)."""
  ref_draws = reference['draws']
  rows = compare(jfed, ref_draws, pair.num_clients, permutations)
  return {
    'draws': len(jfed),
    'seeds': [jfed[0]['seed'], jfed[-1]['seed']] if jfed else [],
    'ok': [len(_ok(jfed)), len(_ok(ref_draws))],
    'errors': [_errors(jfed), _errors(ref_draws)],
    'commit': reference.get('commit', ''),
    'rows': [dataclasses.asdict(r) for r in rows],
    'summary': pair_verdict(rows),
  }


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_string(
    'reference_python', sys.executable, 'Interpreter with numpy, torch, torchvision.'
  )
  flags.DEFINE_string('out', None, 'Output directory.')
  flags.DEFINE_integer('draws', 100, 'Partitions per side and pair.')
  flags.DEFINE_integer(
    'first_seed', 0, 'Seeds first_seed..first_seed+draws-1 (both sides); another range replicates.'
  )
  flags.DEFINE_list(
    'pairs', [p.name for p in PAIRS], 'Pairs to run: ' + ', '.join(p.name for p in PAIRS)
  )
  flags.DEFINE_integer('permutations', PERMUTATIONS, 'Relabellings of the draw-permutation tests.')
  flags.DEFINE_string(
    'dataset',
    'fashion_mnist',
    'jfed dataset whose labels are partitioned (10 classes: the references take the number of '
    'classes from their Fashion-MNIST branch).',
  )
  flags.DEFINE_string('data_dir', '', "jfed's data directory ('': its default search).")
  flags.DEFINE_string('dense_dir', '/work/scratch/dense', 'Checkout of zj-jayzhang/DENSE.')
  flags.DEFINE_string(
    'fedmho_dir', '/work/scratch/fedmho_partition', 'Checkout of YXShi2000/FedMHO.'
  )
  flags.DEFINE_string(
    'fed_cvae_dir', '/work/scratch/fed_cvae_partition', 'Checkout of ceh-2000/fed_cvae.'
  )
  flags.DEFINE_string(
    'niidbench_dir', '/work/scratch/niidbench_partition', 'Checkout of Xtra-Computing/NIID-Bench.'
  )
  flags.DEFINE_integer('timeout', 3600, 'Seconds one reference subprocess may run.')
  flags.mark_flag_as_required('out')


def _checkout(flag_values, pair: Pair) -> pathlib.Path:
  path = pathlib.Path(getattr(flag_values, f'{pair.reference}_dir')).resolve()
  if not (path / pair.marker).is_file():
    raise SystemExit(f'error: {path} holds no {pair.marker}: not a checkout of {pair.repository}')
  return path


def _reference_request(
  pair: Pair, seeds: Sequence[int], labels: Optional[np.ndarray] = None
) -> Dict[str, Any]:
  """What a stored reference result must match to be reused: function, knobs, seeds, labels."""
  request = {'reference': pair.reference, 'num_clients': pair.num_clients}
  if labels is not None:
    request['labels_sha256'] = _shim().labels_sha256(labels)
  for arg in pair.shim_args:
    key, _, value = arg.lstrip('-').partition('=')
    request[key] = type({'k': 0}.get(key, 0.0))(value)
  request['seeds'] = [int(s) for s in seeds]
  return request


def _cached(path: pathlib.Path, request: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
  if not path.is_file():
    return None
  stored = json.loads(path.read_text())
  for key, value in request.items():
    got = [d['seed'] for d in stored['draws']] if key == 'seeds' else stored.get(key)
    if got != value:
      return None
  return stored


def run_reference(
  flag_values, pair: Pair, out: pathlib.Path, seeds: Sequence[int], labels: np.ndarray
) -> Dict[str, Any]:
  """The reference's draws of `pair`: from `<out>/reference_<pair>.json` or its shim."""
  path = out / f'reference_{pair.name}.json'
  request = _reference_request(pair, seeds, labels)
  stored = _cached(path, request)
  if stored is not None:
    return stored
  cwd = out / 'reference_cwd' / pair.reference
  cwd.mkdir(parents=True, exist_ok=True)
  cmd = [
    flag_values.reference_python,
    str(SHIM),
    f'--reference={pair.reference}',
    f'--code={_checkout(flag_values, pair)}',
    f'--labels={out / "train_labels.npy"}',
    f'--test_labels={out / "test_labels.npy"}',
    f'--num_clients={pair.num_clients}',
    f'--seeds={seeds[0]}:{seeds[-1] + 1}',
    f'--out={path}',
    *pair.shim_args,
  ]
  env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', PYTHONDONTWRITEBYTECODE='1')
  env.pop('PYTHONPATH', None)
  t = time.time()
  proc = subprocess.run(
    cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=flag_values.timeout
  )
  if proc.returncode:
    raise SystemExit(f'error: {pair.name}: the shim failed:\n{proc.stderr[-4000:]}')
  print(f'{pair.name}: reference {len(seeds)} draws in {time.time() - t:.0f} s', flush=True)
  return json.loads(path.read_text())


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top

  from jfed.data import load_dataset  # pylint: disable=g-import-not-at-top

  fv = flags.FLAGS
  by_name = {p.name: p for p in PAIRS}
  unknown = [n for n in fv.pairs if n not in by_name]
  if unknown:
    raise SystemExit(f'error: unknown pairs {unknown}; known: {", ".join(by_name)}')
  pairs = [by_name[n] for n in fv.pairs]
  out = pathlib.Path(fv.out)
  out.mkdir(parents=True, exist_ok=True)
  data = load_dataset(fv.dataset, fv.data_dir or None)
  labels = np.asarray(data.train_y, np.int64)
  np.save(out / 'train_labels.npy', labels)
  np.save(out / 'test_labels.npy', np.asarray(data.test_y, np.int64))

  results, raw = {}, {}
  for pair in pairs:
    seeds = list(range(fv.first_seed, fv.first_seed + min(fv.draws, pair.max_draws or fv.draws)))
    reference = run_reference(fv, pair, out, seeds, labels)
    jfed = jfed_draws(labels, pair.scheme, pair.num_clients, seeds, **dict(pair.jfed_kwargs))
    results[pair.name] = evaluate(pair, jfed, reference, fv.permutations)
    raw[pair.name] = {'jfed': jfed, 'reference': reference}
    s = results[pair.name]['summary']
    print(f'{pair.name}: {s["verdict"]} (p < {LEVEL}: {s["raw"]}; Holm: {s["holm"]})', flush=True)

  header = (
    f'{fv.dataset} training labels ({len(labels)} samples, {int(labels.max()) + 1} classes); '
    f'up to {fv.draws} draws per side, seeds from {fv.first_seed}; permutation tests with '
    f'{fv.permutations} relabellings. `python -m experiments.parity.partitions '
    f'--draws={fv.draws} --first_seed={fv.first_seed} --pairs={",".join(fv.pairs)}`.'
  )
  (out / 'partitions.md').write_text(render(pairs, results, header))
  payload = {
    'dataset': fv.dataset,
    'draws': fv.draws,
    'first_seed': fv.first_seed,
    'permutations': fv.permutations,
    'pairs': {
      p.name: {**dataclasses.asdict(p), **results[p.name], 'per_draw': raw[p.name]} for p in pairs
    },
  }
  (out / 'partitions.json').write_text(json.dumps(payload, indent=1))
  print(f'wrote {out / "partitions.md"} and {out / "partitions.json"}')


if __name__ == '__main__':
  from absl import app  # pylint: disable=g-import-not-at-top

  _define_flags()
  app.run(main)
