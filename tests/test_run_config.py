"""The typed run config: parsed once into `ctx.run`, read by the methods instead of `ctx.config`,
and the client optimiser built from every field of its `OptimizerSpec`."""

import pathlib
import re

import jax.numpy as jnp
import ml_collections
import pytest

from jfed import engine
from jfed.api import RunConfig, parse_run_config
from jfed.configs import base as configs
from jfed.errors import ConfigError

METHODS = pathlib.Path(__file__).resolve().parent.parent / 'jfed' / 'methods'


def test_no_method_reads_the_raw_config():
  reads = [
    f'{path.name}:{n}'
    for path in sorted(METHODS.glob('*.py'))
    for n, line in enumerate(path.read_text().splitlines(), 1)
    if re.search(r'\bctx\.config\b', line)
  ]
  assert reads == []


def test_the_base_config_parses_into_typed_sections():
  run = parse_run_config(configs.base_config())
  assert isinstance(run, RunConfig)
  assert run.optimizer == engine.OptimizerSpec('sgd', 0.01, momentum=0.9)
  assert (run.batch_size, run.strategy, run.attack.kind) == (64, 'auto', 'none')


def test_a_mistyped_shared_key_is_one_error_naming_it():
  config = ml_collections.ConfigDict({**configs.base_config().to_dict(), 'batch_size': 'many'})
  with pytest.raises(ConfigError, match='batch_size must be an integer'):
    parse_run_config(config)


def test_betas_and_grad_clip_of_the_config_reach_the_optimizer():
  """The old `optimizer_from_config` dropped b1, b2 and grad_clip: its first moment would hold
  the unclipped gradient and its moments Adam's default betas."""
  base = {'name': 'adam', 'lr': 1.0}
  clipped = engine.build_optimizer(
    engine.optimizer_spec(ml_collections.ConfigDict({**base, 'grad_clip': 1e-3}))
  )
  params = {'w': jnp.ones(3)}
  _, state = clipped.update({'w': jnp.full(3, 100.0)}, clipped.init(params), params)
  # the clipped gradient is in Adam's first moment: (1 - b1) * g with ||g|| = 1e-3
  mu = state.inner_state[1][0].mu['w']
  assert float(jnp.linalg.norm(mu)) == pytest.approx(0.1 * 1e-3, rel=1e-4)
  spec = engine.optimizer_spec(ml_collections.ConfigDict({**base, 'b1': 0.5, 'b2': 0.75}))
  assert (spec.b1, spec.b2) == (0.5, 0.75)
  tx = engine.build_optimizer(spec)
  _, state = tx.update({'w': jnp.full(3, 2.0)}, tx.init(params), params)
  assert float(state.inner_state[0].mu['w'][0]) == pytest.approx(0.5 * 2.0)
  assert float(state.inner_state[0].nu['w'][0]) == pytest.approx(0.25 * 4.0)


def test_validation_checks_the_parsed_run_config():
  """One reader of the shared keys: `validate_run_config` returns `parse_run_config`'s result,
  so a key the context reads can never be checked under another default or type."""
  from jfed.run_config import validate_run_config  # pylint: disable=g-import-not-at-top

  config = configs.base_config()
  assert validate_run_config(config, 'fedavg') == parse_run_config(config)
  # a mistyped momentum is refused by the one parser, with the key's name
  raw = config.to_dict()
  raw['optimizer']['momentum'] = 'fast'
  with pytest.raises(ConfigError, match='^optimizer.momentum '):
    validate_run_config(ml_collections.ConfigDict(raw))


def test_the_shared_keys_are_read_by_the_parser_only():
  """run_config.py checks the typed RunConfig; it reads raw only the keys no RunConfig field
  holds (a scheme's own partition keys, the method's participation, a removed key)."""
  source = (METHODS.parent / 'run_config.py').read_text()
  raw_reads = sorted(set(re.findall(r'\bconfig\.(?:get\(\')?(\w+)', source)))
  # dataset: the removed test_holdout key; get: the method's section; partition: alpha and k
  assert raw_reads == ['dataset', 'get', 'partition'], raw_reads
