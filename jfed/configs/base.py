"""The base config every experiment config starts from; each method reads its own sub-config.

Also `variant_words`, which every `get_config(arg)` uses to split its variant argument (the part
after `:` in `--config=file.py:a,b`) and to refuse words it does not know.
"""

from typing import Any, Callable, Iterable, List, TypeVar

import ml_collections

from jfed import api
from jfed.errors import ConfigError
from jfed.methods import registry

T = TypeVar('T')


def variant_words(arg: str, known: Iterable[str]) -> List[str]:
  """The comma-separated variant words of `arg`, in order; ConfigError on an unknown one.

  Args:
    arg: the config argument, e.g. 'iid,smoke' or 'dir=0.1,rounds=3' ('' or None: no words).
      Spaces around words and empty words (',,', a trailing comma) are ignored; a word given
      twice is kept once.
    known: the valid words. An entry ending in '=' (e.g. 'rounds=') is a prefix: it accepts
      any word 'rounds=<value>' with a non-empty value (see `variant_value`).

  Returns:
    The words of `arg`, stripped, without duplicates, in the order given.

  Raises:
    ConfigError: a word that is not known; the message lists the valid words.
  """
  known = tuple(known)
  words = []
  for word in (arg or '').split(','):
    word = word.strip()
    if word and word not in words:
      words.append(word)
  for word in words:
    name, eq, value = word.partition('=')
    if (not eq and word in known) or (eq and value and name + eq in known):
      continue
    valid = ', '.join(k + '<value>' if k.endswith('=') else k for k in known)
    raise ConfigError(
      f'unknown config variant {word!r} in {arg!r}; valid variants (comma-separated): {valid}'
    )
  return words


def variant_value(word: str, cast: Callable[[str], T]) -> T:
  """The value of a 'name=value' variant word, converted by `cast`; ConfigError if it fails."""
  name, _, value = word.partition('=')
  try:
    return cast(value)
  except ValueError:
    raise ConfigError(
      f'config variant {word!r}: {value!r} is not a valid {name} '
      f'({getattr(cast, "__name__", "value")} expected)'
    ) from None


def heterogeneity_rates(word: str) -> List[float]:
  """The pruning rates of a 'rates=0.1/0.4/0.7/1.0' word (FedTSA Table 4's degrees of model
  heterogeneity), fastest first; ConfigError unless each lies in (0, 1] and one is 1.0."""

  def cast(value: str) -> List[float]:
    rates = sorted({float(r) for r in value.split('/') if r.strip()}, reverse=True)
    if not rates or rates[0] != 1.0 or rates[-1] <= 0:
      raise ValueError(value)
    return rates

  cast.__name__ = 'list of rates in (0, 1] including 1.0, separated by /'
  return variant_value(word, cast)


def equal_share_models(model_at: Callable[[float], str], rates: List[float], n: int) -> str:
  """client_models for `n` clients split as evenly as the rates allow (the first rates take
  the remainder), fastest first: the baselines' clients of a 'rates=' degree.

  Args:
    model_at: the model spec of a pruning rate.
    rates: the rates, fastest first.
    n: the clients.

  Returns:
    The ';'-separated client_models.
  """
  counts = [n // len(rates) + (i < n % len(rates)) for i in range(len(rates))]
  return ';'.join(model_at(r) for r, k in zip(rates, counts) for _ in range(k))


# Base config keys that no typed config declares: the partition schemes' own arguments (read by
# jfed.api.partition_clients, each scheme the ones `partition_arguments` names).
PARTITION_ARGUMENTS = {
  'alpha': 0.5,
  'min_size': 10,
  'k': 2,
  # the client sizes of the cross-device schemes (client_dirichlet, unbalanced_iid)
  'size_distribution': 'lognormal',
  'size_sigma': 1.0,
  'size_exponent': 1.5,
}
# OptimizerSpec fields the base config leaves out, so `optimizer_spec` fills them with its own
# defaults (no clipping; Adam's betas 0.9 / 0.999; no own optax transformation).
OPTIMIZER_LEFT_OUT = ('grad_clip', 'b1', 'b2', 'transform')


def section_of(defaults: Any) -> ml_collections.ConfigDict:
  """A NamedTuple of defaults as a config section (a nested NamedTuple as a nested section).

  Args:
    defaults: a NamedTuple instance, or a NamedTuple type: then only its fields with a default
      (a method of one's own may declare required fields, which `typed_config.parse` reports
      as missing when a run leaves them unset).

  Returns:
    The section.
  """
  values = defaults._field_defaults if isinstance(defaults, type) else defaults._asdict()
  return ml_collections.ConfigDict(
    {k: section_of(v) if hasattr(v, '_fields') else v for k, v in values.items()}
  )


def base_config() -> ml_collections.ConfigDict:
  """The config every experiment config starts from, generated from the typed configs' defaults.

  The shared keys are `jfed.api.RunConfig()`'s; each registered method adds its `Config`'s
  defaults as `config.<section>` (methods that share a section, such as FedCVAE-Ens and -KD, add
  the union of their fields). A field without a default gets no key: a run of that method must
  set it (`typed_config.parse` names it otherwise).

  Returns:
    A new, unlocked ConfigDict.

  Raises:
    ValueError: two methods that share a section disagree on a default.
  """
  c = section_of(api.RunConfig())
  c.partition.update(PARTITION_ARGUMENTS)
  for name in OPTIMIZER_LEFT_OUT:
    del c.optimizer[name]
  for method in registry.available_methods():
    cls = registry.get_method(method)
    section = section_of(cls.Config)
    if cls.section not in c:
      c[cls.section] = ml_collections.ConfigDict()
    for key, value in section.items():
      if key in c[cls.section] and c[cls.section][key] != value:
        raise ValueError(
          f'{method}: default {cls.section}.{key}={value!r} disagrees with the '
          f'one of another method of the section, {c[cls.section][key]!r}'
        )
      c[cls.section][key] = value
  return c
