"""Simulated hostile clients: which clients attack, and what they send instead of their model.

Model-poisoning attacks rewrite an attacker's upload from its honestly trained model θ_k and
the model it started from (the reference: the global model of the round, or a one-shot run's
initial model), with Δ_k = θ_k − reference and s = `strength`:

  'sign_flip'   reference − s Δ_k (Byzantine sign flipping; Allen-Zhu et al. 2021, Karimireddy
                et al. 2022);
  'scaling'     reference + s Δ_k (boosted / model-replacement updates; Bagdasaryan et al. 2020);
  'noise'       reference + s ε, ε ~ N(0, I) per coordinate (the Gaussian attack; Xie et al.
                2018, Fang et al. 2020);
  'same_value'  every attacker sends the same model, every coordinate equal to s (the
                same-value attack of Li et al., AAAI'19 "RSA"; colluding clients).

'label_flip' is a data-poisoning attack: the attacker trains honestly on labels y ↦ C − 1 − y
(Fang et al. 2020; Tolpegin et al. 2020) and uploads what it trained.

The attackers are drawn once per run from the run's seed (`attack.fraction` of the clients,
rounded), or named (`attack.clients`). Their uploads then go through the server's validation
like any other, as a real attacker's would.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

ATTACKS = ('none', 'sign_flip', 'scaling', 'noise', 'same_value', 'label_flip')
MODEL_ATTACKS = ('sign_flip', 'scaling', 'noise', 'same_value')


class AttackConfig(NamedTuple):
  """The `attack` config section."""

  kind: str  # one of ATTACKS
  fraction: float  # of the clients, rounded, drawn from the seed (when `clients` is empty)
  clients: str  # comma-separated client ids; overrides `fraction`
  strength: float  # s above (unused by label_flip)


def strength_problem(kind: str, strength: float) -> Optional[str]:
  """Why `strength` would make `kind` another attack than the one recorded, or None.

  A negative s turns sign_flip (reference − s Δ) into scaling by |s| and scaling into a sign
  flip, and noise's s is a standard deviation; same_value sends any value s, and label_flip
  does not read s.
  """
  if strength >= 0 or kind not in ('sign_flip', 'scaling', 'noise'):
    return None
  head = f'attack.strength={strength:g} is negative: '
  if kind == 'sign_flip':
    return (
      f'{head}sign_flip sends reference - s*update, so s={strength:g} is a x{-strength:g} '
      f'scaling attack recorded as a sign flip; use attack.strength={-strength:g} (or '
      'attack.kind=scaling)'
    )
  if kind == 'scaling':
    return (
      f'{head}scaling sends reference + s*update, so s={strength:g} is a sign flip recorded as '
      f'scaling; use attack.kind=sign_flip with attack.strength={-strength:g}'
    )
  return (
    f'{head}noise adds N(0, s^2) per coordinate, s is its standard deviation; use '
    f'attack.strength={-strength:g}'
  )


def parse_client_ids(text: str, num_clients: int) -> np.ndarray:
  """'0, 3,7' -> [0, 3, 7]; ValueError naming a word that is not a client id."""
  ids = []
  for word in filter(None, (w.strip() for w in text.split(','))):
    if not word.isdigit() or int(word) >= num_clients:
      raise ValueError(f'attack.clients: {word!r} is not a client id in 0..{num_clients - 1}')
    ids.append(int(word))
  return np.unique(np.asarray(ids, np.int64))


def config_problem(config: AttackConfig, num_clients: int) -> Optional[str]:
  """Why `config` is not one well-defined attack, or None: the one place of its rules, read by
  the run-config checks and by `attacker_ids`.

  Args:
    config: The attack settings.
    num_clients: Number of clients in the run.

  Returns:
    A one-line problem naming the key, or None.
  """
  t = config
  if t.kind not in ATTACKS:
    return f'attack.kind is {t.kind!r}; valid: {", ".join(ATTACKS)}'
  problem = strength_problem(t.kind, t.strength)
  if problem is not None:
    return problem
  if not 0.0 <= t.fraction <= 1.0:
    return f'attack.fraction must be in [0, 1], got {t.fraction}'
  try:
    parse_client_ids(t.clients, num_clients)
  except ValueError as e:
    return str(e)
  if t.clients.strip() and t.fraction > 0:
    return (
      f'attack.clients={t.clients!r} and attack.fraction={t.fraction:g} both choose the '
      'attackers; set one of them (attack.fraction=0 with a list of clients)'
    )
  return None


def attacker_ids(config: AttackConfig, num_clients: int, key: jax.Array) -> np.ndarray:
  """The attacking clients' ids (sorted), fixed for the run.

  Args:
    config: The attack settings (kind, an explicit client list or a fraction).
    num_clients: Number of clients in the run.
    key: PRNG key of the random choice (used when no list is given).

  Returns:
    The attackers' ids, sorted int64 (empty without an attack).

  Raises:
    ValueError: `config_problem`'s, the command line's refusals.
  """
  problem = config_problem(config, num_clients)
  if problem is not None:
    raise ValueError(problem)
  if config.kind == 'none':
    return np.zeros((0,), np.int64)
  if config.clients.strip():
    return parse_client_ids(config.clients, num_clients)
  count = int(round(config.fraction * num_clients))
  if count == 0:
    return np.zeros((0,), np.int64)
  return np.sort(np.asarray(jax.random.permutation(key, num_clients)[:count], np.int64))


def flip_labels(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """y ↦ C − 1 − y."""
  return (num_classes - 1 - np.asarray(labels)).astype(np.asarray(labels).dtype)


def _poison_one(kind: str, strength: float, model: Any, reference: Any, key: jax.Array) -> Any:
  leaves, treedef = jax.tree.flatten(model)
  refs = jax.tree.leaves(reference)
  keys = jax.random.split(key, len(leaves))
  out = []
  for leaf, ref, k in zip(leaves, refs, keys):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      out.append(leaf)
    elif kind == 'sign_flip':
      out.append(ref - strength * (leaf - ref))
    elif kind == 'scaling':
      out.append(ref + strength * (leaf - ref))
    elif kind == 'noise':
      out.append(ref + strength * jax.random.normal(k, leaf.shape, leaf.dtype))
    elif kind == 'same_value':
      out.append(jnp.full_like(leaf, strength))
    else:
      raise ValueError(f'{kind!r} is not a model-poisoning attack; valid: {MODEL_ATTACKS}')
  return jax.tree.unflatten(treedef, out)


def poison_uploads(
  kind: str,
  strength: float,
  stacked: Any,
  reference: Any,
  attacking: np.ndarray,
  key: jax.Array,
) -> Any:
  """The stacked uploads with every row where `attacking` ([K] bool) replaced by the attack's.

  `reference` is one model (the clients' common start) or stacked like `stacked`.

  Args:
    kind: One of MODEL_ATTACKS; any other kind returns `stacked` unchanged.
    strength: The attack's scale (factor, noise std or value, by kind).
    stacked: The round's uploads, stacked over a leading client axis [K].
    reference: As above.
    attacking: [K] bool, the rows to replace.
    key: PRNG key of a noise attack.

  Returns:
    The uploads, stacked like `stacked`.
  """
  attacking = np.asarray(attacking, bool)
  if kind not in MODEL_ATTACKS or not attacking.any():
    return stacked
  k = attacking.shape[0]
  stacked_reference = jax.tree.leaves(reference)[0].ndim == jax.tree.leaves(stacked)[0].ndim
  references = (
    reference
    if stacked_reference
    else jax.tree.map(lambda r: jnp.broadcast_to(r, (k,) + r.shape), reference)
  )
  poisoned = jax.vmap(lambda m, r, kk: _poison_one(kind, strength, m, r, kk))(
    stacked, references, jax.random.split(key, k)
  )
  mask = jnp.asarray(attacking)
  return jax.tree.map(
    lambda p, h: jnp.where(mask.reshape((k,) + (1,) * (h.ndim - 1)), p, h), poisoned, stacked
  )
