"""FedTSA's (Fan et al., ECCV 2024) proxy task (§4.3): every client trains a one-hidden-layer MLP on
a scaled-down dataset and reports how long it took; the durations are what the server clusters.

Simulated clients share one machine, so each client runs the task here (the median of `repeats`
timed runs of a training loop compiled once, before any timing) and its duration is that
measured time × its device class's slow-down (× optional lognormal jitter, σ = `jitter`).
Device classes are (share of clients, slow-down) pairs; `profile_from_rates` builds them from
target pruning rates (a device r times as fast as the fastest trains a model r times as wide),
e.g. the paper's 20 % / 40 % / 40 % of clients at rates 1.0 / 0.8 / 0.6. Durations measured on
real devices are read from a file (`read_durations`) and used as they are.
"""

import json
import pathlib
import time
from typing import NamedTuple, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfed.engine.progress import PhaseProgress


class DeviceProfile(NamedTuple):
  shares: Tuple[float, ...]  # fraction of the clients in each device class
  slowdowns: Tuple[float, ...]  # each class's duration over the fastest's


class ClientDurations(NamedTuple):
  durations: np.ndarray  # [n] seconds per client
  base_seconds: float  # the proxy task's measured time here (0 when read from a file)
  device_class: np.ndarray  # [n] int, -1 when read from a file
  source: str  # 'simulated' or the file's path


def profile_from_rates(rates: Sequence[float], shares: Sequence[float]) -> DeviceProfile:
  rates, shares = tuple(float(r) for r in rates), tuple(float(s) for s in shares)
  if len(rates) != len(shares) or not rates:
    raise ValueError(f'rates {rates} and shares {shares} must be non-empty and of equal length')
  if any(not 0 < r <= 1 for r in rates) or any(s < 0 for s in shares) or sum(shares) <= 0:
    raise ValueError(f'rates must be in (0, 1] and shares non-negative, got {rates}, {shares}')
  total = sum(shares)
  return DeviceProfile(tuple(s / total for s in shares), tuple(max(rates) / r for r in rates))


def assign_devices(num_clients: int, profile: DeviceProfile, seed: int) -> np.ndarray:
  """[n] device class per client: round(share · n) clients per class (largest remainders
  first), in a seeded random order over the clients.

  Args:
    num_clients: n.
    profile: The device classes' shares (and slow-downs).
    seed: Seed of the order.

  Returns:
    Device class index per client [n].
  """
  exact = np.asarray(profile.shares) * num_clients
  counts = np.floor(exact).astype(int)
  for k in np.argsort(-(exact - counts), kind='stable')[: num_clients - counts.sum()]:
    counts[k] += 1
  classes = np.repeat(np.arange(len(counts)), counts)
  return np.random.default_rng(seed).permutation(classes)


class _MLP(nn.Module):
  hidden: int
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x.reshape((x.shape[0], -1))))
    return nn.Dense(self.num_classes)(x)


class ProxyTask:
  """The proxy task, compiled once: SGD epochs of the one-hidden-layer MLP over (x, y)."""

  def __init__(
    self,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    hidden: int = 64,
    epochs: int = 1,
    batch: int = 32,
    seed: int = 0,
  ):
    n = (len(y) // batch) * batch
    if n == 0:
      raise ValueError(f'the proxy task needs at least one batch of {batch} samples, got {len(y)}')
    self.xb = jnp.asarray(x[:n], jnp.float32).reshape((n // batch, batch, -1))
    self.yb = jnp.asarray(y[:n], jnp.int32).reshape((n // batch, batch))
    model, tx = _MLP(hidden, num_classes), optax.sgd(0.05)

    def train(params, xb, yb):
      def step(carry, batch_xy):
        params, opt = carry
        bx, by = batch_xy

        def loss(p):
          logits = model.apply({'params': p}, bx)
          return optax.softmax_cross_entropy_with_integer_labels(logits, by).mean()

        updates, opt = tx.update(jax.grad(loss)(params), opt)
        return (optax.apply_updates(params, updates), opt), None

      def epoch(carry, _):
        return jax.lax.scan(step, carry, (xb, yb))[0], None

      return jax.lax.scan(epoch, (params, tx.init(params)), None, length=epochs)[0][0]

    self._train = jax.jit(train)
    self.params = model.init(jax.random.PRNGKey(seed), self.xb[0])['params']
    jax.block_until_ready(self._train(self.params, self.xb, self.yb))  # compile before timing

  def seconds(self, repeats: int = 1) -> float:
    """Median wall time of `repeats` runs of the task."""
    times = []
    for _ in range(max(1, repeats)):
      start = time.perf_counter()
      jax.block_until_ready(self._train(self.params, self.xb, self.yb))
      times.append(time.perf_counter() - start)
    return float(np.median(times))


def measured_durations(
  task: ProxyTask,
  num_clients: int,
  profile: DeviceProfile,
  seed: int,
  repeats: int = 3,
  jitter: float = 0.0,
) -> ClientDurations:
  """Each simulated client runs the proxy task here (the median of `repeats` runs: its real
  measured time on this machine), times its device class's slow-down, times optional lognormal
  jitter (σ = `jitter`).

  Args:
    task: The proxy task.
    num_clients: n.
    profile: The device classes' shares and slow-downs.
    seed: Seed of the device assignment and the jitter.
    repeats: Runs of the task per client; the median counts.
    jitter: σ of the lognormal noise; 0 adds none.

  Returns:
    ClientDurations (seconds per client, the median base time, device classes).
  """
  phase = PhaseProgress(
    f'profiling: the proxy task {max(1, repeats)}x per client', num_clients, 'client'
  )
  base = []
  for k in range(num_clients):
    base.append(task.seconds(repeats))
    phase.update(k + 1)
  return simulated_durations(np.array(base), num_clients, profile, jitter, seed)


def simulated_durations(
  base_seconds,
  num_clients: int,
  profile: DeviceProfile,
  jitter: float,
  seed: int,
) -> ClientDurations:
  """base_seconds (a scalar or one time per client) × each client's slow-down × jitter.

  Args:
    base_seconds: The proxy task's time on the reference device, a scalar or one per client.
    num_clients: n.
    profile: The device classes' shares and slow-downs.
    jitter: σ of the lognormal noise; 0 adds none.
    seed: Seed of the device assignment and the jitter.

  Returns:
    ClientDurations (seconds per client, the median base time, device classes).
  """
  classes = assign_devices(num_clients, profile, seed)
  noise = np.random.default_rng((seed, 1)).lognormal(0.0, jitter, num_clients) if jitter else 1.0
  durations = np.asarray(base_seconds, np.float64) * np.asarray(profile.slowdowns)[classes] * noise
  return ClientDurations(durations, float(np.median(base_seconds)), classes, 'simulated')


def read_durations(path: str, num_clients: int) -> ClientDurations:
  """Durations measured on real devices: a JSON list, or numbers separated by commas, spaces
  or newlines; one per client, finite and > 0."""
  p = pathlib.Path(path)
  if not p.is_file():
    raise ValueError(f'durations file {path} does not exist')
  text = p.read_text().strip()
  try:
    values = json.loads(text) if text.startswith('[') else text.replace(',', ' ').split()
    d = np.asarray([float(v) for v in values], np.float64)
  except (ValueError, TypeError):
    raise ValueError(f'durations file {path}: expected numbers, got {text[:60]!r}') from None
  if len(d) != num_clients:
    raise ValueError(f'durations file {path} has {len(d)} values for {num_clients} clients')
  if not np.all(np.isfinite(d)) or np.any(d <= 0):
    raise ValueError(f'durations file {path}: every duration must be finite and > 0')
  return ClientDurations(d, 0.0, np.full(num_clients, -1), str(p))
