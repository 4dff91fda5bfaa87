"""Every config file builds exactly the dicts it built before the method configs carried their
own defaults: `base_config()`, and each file's `get_config` with no variant, with each variant
and with all of them, compared as canonical JSON (so 1 and 1.0 differ).

Regenerate the fixture only for an intended change: `python -m tests.test_config_snapshot`.
"""

import importlib
import json
import pathlib
from typing import Dict

from jfed.configs import base as common

FIXTURE = pathlib.Path(__file__).resolve().parent / 'data' / 'config_snapshot.json'
CONFIG_DIR = pathlib.Path(common.__file__).parent
# A sample value for each variant that takes one (as in test_configs).
VALUES = {
  'rounds=': 'rounds=2',
  'dir=': 'dir=0.1',
  'rates=': 'rates=0.5/1.0',
  'source=': 'source=public',
  'dataset=': 'dataset=digits',
}


def _canonical(config) -> str:
  return json.dumps(config.to_dict(), sort_keys=True)


def snapshot() -> Dict[str, str]:
  out = {'common.base_config()': _canonical(common.base_config())}
  for path in sorted(CONFIG_DIR.glob('*.py')):
    if path.stem in ('__init__', 'base'):
      continue
    module = importlib.import_module(f'jfed.configs.{path.stem}')
    words = [VALUES.get(w, w) for w in getattr(module, 'VARIANTS', ())]
    for arg in ['', *words, ','.join(words)]:
      out[f'{path.stem}.get_config({arg!r})'] = _canonical(module.get_config(arg))
  return out


def test_every_config_is_the_one_of_the_snapshot():
  expected = json.loads(FIXTURE.read_text())
  actual = snapshot()
  assert sorted(actual) == sorted(expected)
  changed = [name for name in expected if actual[name] != expected[name]]
  assert changed == []


if __name__ == '__main__':
  FIXTURE.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + '\n')
