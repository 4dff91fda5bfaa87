"""The parity table of a `python -m experiments.parity` output folder (no flags here, so tests
and other tools import it freely)."""

import json
import pathlib
from typing import Any, Dict, List, Optional

from experiments.parity import stats


def read_json(path: pathlib.Path) -> Optional[Dict[str, Any]]:
  return json.loads(path.read_text()) if path.is_file() else None


def seed_rows(out: pathlib.Path, ref, method, seeds: List[int]) -> Dict[int, Dict[str, Any]]:
  """Per seed, name -> (jfed, reference), either None where that side has no such row; seeds
  where a side has not finished are left out."""
  from experiments.parity import jfed_side  # pylint: disable=g-import-not-at-top

  rows: Dict[int, Dict[str, Any]] = {}
  for s in seeds:
    d = out / f'seed{s}'
    ours = read_json(d / 'jfed.json')
    stages = [read_json(d / f'reference_{ref.name}_{st}.json') for st in method.stages]
    if ours is None or any(r is None for r in stages):
      continue
    if not all(m in ours.get('methods', {}) for m in method.jfed_methods):
      continue
    ours['methods'] = {m: ours['methods'][m] for m in method.jfed_methods}
    theirs: Dict[str, float] = {}
    for r in stages:
      theirs.update(r['rows'])
    mine = jfed_side.rows(ours, dict(method.labels))
    names = list(dict.fromkeys([*theirs, *mine]))
    rows[s] = {n: (mine.get(n), theirs.get(n)) for n in names}
  return rows


def _cell(v: Optional[float]) -> str:
  return '—' if v is None else f'{v:.2f}'


def render(out: pathlib.Path, ref, method, seeds: List[int], params: Dict[str, Any]) -> str:
  """The parity table of `out` as Markdown."""
  flags_used = params.get('flags', {})
  budget = params.get('budget', {})
  rows = seed_rows(out, ref, method, seeds)
  lines = [
    f'# Parity: jfed against {ref.repository} ({flags_used.get("method")})',
    '',
    f'Dataset {flags_used.get("dataset")}, {flags_used.get("num_clients")} clients, partition '
    f'`{flags_used.get("scheme")}` (alpha {flags_used.get("alpha")}) drawn by jfed and read by '
    'both sides; every accuracy on the full test split, in %. Budget (both sides): '
    + ', '.join(f'{k} {v}' for k, v in budget.items())
    + '.',
    '',
    f'Regenerate: `python -m experiments.parity --side=table --method={flags_used.get("method")} '
    '--out=<this folder>` (the flags used are in the parity_*.json beside this file).',
    '',
  ]
  if not rows:
    return '\n'.join(lines + ['No seed has both sides yet.', ''])
  names = list(dict.fromkeys(n for row in rows.values() for n in row))
  lines += [
    '## Per seed',
    '',
    '| seed | row | jfed | reference | jfed − reference |',
    '|---|---|---:|---:|---:|',
  ]
  for s, row in rows.items():
    for name in names:
      a, b = row.get(name, (None, None))
      diff = f'{a - b:+.2f}' if a is not None and b is not None else ''
      lines.append(f'| {s} | {name} | {_cell(a)} | {_cell(b)} | {diff} |')
  lines += [
    '',
    f'## Over {len(rows)} seeds ({", ".join(str(s) for s in rows)})',
    '',
    f'Mean ± sample std. Paired by seed: "equivalent" when the equivalence test (two one-sided '
    f'paired t-tests, TOST) at ±{stats.MARGIN:g} points rejects a larger difference at '
    f'{stats.LEVEL:.0%}; "different" when the two-sided paired t-test rejects no difference at '
    f'{stats.LEVEL:.0%}; "inconclusive" when neither does (more seeds are needed).',
    '',
    '| row | jfed | reference | mean difference | p (difference) | p (equivalence) | verdict |',
    '|---|---:|---:|---:|---:|---:|---|',
  ]
  for name in names:
    pairs = [row.get(name, (None, None)) for row in rows.values()]
    a = [p[0] for p in pairs if p[0] is not None]
    b = [p[1] for p in pairs if p[1] is not None]
    if len(a) != len(pairs) or len(b) != len(pairs):
      lines.append(f'| {name} | {stats.mean_std(a)} | {stats.mean_std(b)} | | | | one side only |')
      continue
    v = stats.paired_verdict(a, b)
    lines.append(
      f'| {name} | {stats.mean_std(a)} | {stats.mean_std(b)} | {v.mean_difference:+.2f} | '
      f'{v.difference_p:.3f} | {v.equivalence_p:.3f} | {v.verdict} |'
    )
  curves = _curves(out, ref, list(rows))
  if curves:
    lines += ['', "## The reference clients' test accuracy by local epoch (plateau check)", '']
    lines += curves
  return '\n'.join(lines) + '\n'


def _curves(out: pathlib.Path, ref, seeds: List[int]) -> List[str]:
  lines = []
  for s in seeds:
    for path in sorted((out / f'seed{s}').glob(f'reference_{ref.name}_*.json')):
      for k, c in enumerate(read_json(path).get('client_curves', [])):
        tail = ', '.join(f'{x:.1f}' for x in c[-5:])
        lines.append(f'- seed {s}, client {k}: epoch 1 {c[0]:.1f}, last five epochs {tail}')
  return lines
