"""CVAE clients on the shared engine: their groups, local training, uploads and the server's
batched decoding (FedMHO §4.2, Algorithm 1 lines 3–7 and 11–12; FedCVAE,
`github.com/ceh-2000/fed_cvae`).

A client whose model spec is `cvae[:size=small|large|v0,latent=..,hidden=..]` is a *generative*
client. Its group is one compiled program like a classifier group: `GroupTrainer` runs the CVAE
objective (`cvae_objective`, Eq. 3) instead of the cross entropy, with each step's
reparameterisation noise drawn from the engine's per-step key. A trained client uploads a
`DecoderUpload`: its decoder parameters (and, for FedCVAE's v0 CVAE, the decoder's BatchNorm
running statistics, which its eval-mode generation uses) and its class counts. The server
decodes every decoder of a group in one vmapped call (`decode_group`).
"""

import functools
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jfed.cvae.losses import RECON_LOSSES, cvae_loss
from jfed.cvae.models import CVAE, resize_images
from jfed.engine import ModelState
from jfed.engine.state import RUN_ONCE
from jfed.io import DecoderUpload, serialized_nbytes, validate_decoder_upload

GENERATIVE_MODEL = 'cvae'
# A spec's latent size when it names none. CVAE-small: the FedMHO reference's default
# (`--latent_size`, YXShi2000/FedMHO:parameters.py), whose FLOPs are Table 2's 408.06K (Yao et
# al., "FedMHO", WWW'26); CVAE-large: 20, hard-coded there; FedCVAE's v0: 20, as before.
DEFAULT_LATENT = {'small': 2, 'large': 20, 'v0': 20}


def is_generative(spec: str) -> bool:
  """Whether a client model spec names a CVAE ('cvae' or 'cvae:size=large,...')."""
  return spec.strip().partition(':')[0].strip().lower() == GENERATIVE_MODEL


def build_cvae(kwargs: dict, num_classes: int, input_shape: Sequence[int]) -> CVAE:
  """The CVAE of a parsed spec's keyword arguments (size, latent, hidden, width_mult); latent
  defaults to `DEFAULT_LATENT` of the size.

  Args:
    kwargs: The spec's options: size ('small', 'large' or 'v0'), latent, hidden, width_mult.
    num_classes: Number of label classes the CVAE conditions on.
    input_shape: (H, W, C) of the dataset's images.

  Returns:
    The (uninitialised) CVAE module.
  """
  unknown = set(kwargs) - {'size', 'latent', 'hidden', 'width_mult'}
  if unknown:
    raise ValueError(
      f'Unknown CVAE option(s) {sorted(unknown)}; valid: size, latent, hidden, width_mult'
    )
  size = str(kwargs.get('size', 'small'))
  return CVAE(
    num_classes=int(num_classes),
    image_shape=tuple(int(d) for d in input_shape),
    size=size,
    latent=int(kwargs.get('latent', DEFAULT_LATENT.get(size, 20))),
    hidden=int(kwargs.get('hidden', 256)),
    width_mult=float(kwargs.get('width_mult', 1.0)),
  )


@functools.lru_cache(maxsize=None)  # one objective per loss: runs share its trainer's programs
def cvae_objective(recon: str = 'bce', beta: float = 1.0):
  """The engine's `LocalObjective` of a CVAE client: Eq. 3 on the batch's real samples.

  The reported loss is Eq. 3 itself; a CVAE predicts no label, so it reports 0 correct.
  """
  if recon not in RECON_LOSSES:
    raise ValueError(f'recon must be one of {RECON_LOSSES}, got {recon!r}')

  def objective(module, params, batch_stats, x, y, weights, key):
    if batch_stats:  # v0: BatchNorm on the real samples' batch statistics
      out, updates = module.apply(
        {'params': params, 'batch_stats': batch_stats},
        x,
        y,
        key,
        train=True,
        mask=weights > 0,
        mutable=['batch_stats'],
      )
      batch_stats = updates['batch_stats']
    else:
      out = module.apply({'params': params}, x, y, key)
    loss, (_, _, count) = cvae_loss(out, x, weights, beta, recon)
    return loss, (loss, jnp.zeros(()), count, batch_stats)

  return objective


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=RUN_ONCE)
def _init(module: CVAE, input_shape: Tuple[int, ...], key: jax.Array) -> ModelState:
  x = jnp.zeros((2, *input_shape), jnp.float32)
  labels = jnp.zeros((2,), jnp.int32)
  variables = module.init(key, x, labels, jax.random.PRNGKey(0))
  return ModelState(variables['params'], variables.get('batch_stats', {}))


def init_cvae(module: CVAE, input_shape: Sequence[int], key: jax.Array) -> ModelState:
  """Fresh CVAE variables.

  Args:
    module: The CVAE module.
    input_shape: (H, W, C) of the dataset's images.
    key: PRNG key of the init.

  Returns:
    The CVAE's ModelState.
  """
  return _init(module, tuple(int(d) for d in input_shape), key)


class DecoderUploads(NamedTuple):
  """What a group of CVAE clients sent, validated: stacked decoders and their class counts."""

  client_ids: np.ndarray  # [k] global ids
  decoders: Any  # decoder params stacked over the group's clients
  label_counts: np.ndarray  # [k, classes] int32
  upload_bytes: int
  decoder_stats: Any = None  # the decoders' BatchNorm statistics stacked ({} without BN)


def receive_decoder_uploads(
  client_ids: np.ndarray, models: ModelState, counts: np.ndarray, template: ModelState
) -> DecoderUploads:
  """Server side of the CVAE clients' uploads: each client's decoder and class counts are
  validated against the template's decoder; bytes are the msgpack size of each real upload.

  Args:
    client_ids: Global ids of the group's clients [k].
    models: The clients' CVAE states, stacked over the group.
    counts: Their class counts [k, num_classes].
    template: A CVAE state of the group's architecture (structure, shapes and dtypes).

  Returns:
    The validated DecoderUploads, with the total upload bytes.
  """
  template_decoder = template.params['decoder']
  template_stats = decoder_stats_of(template)
  stats = decoder_stats_of(models)
  total = 0
  num_classes = counts.shape[1]
  for i, cid in enumerate(client_ids):
    decoder, decoder_stats = jax.tree.map(lambda a, i=i: a[i], (models.params['decoder'], stats))
    upload = DecoderUpload(int(cid), int(counts[i].sum()), decoder, counts[i], decoder_stats)
    validate_decoder_upload(upload, template_decoder, num_classes, template_stats)
    total += serialized_nbytes(upload._asdict())
  return DecoderUploads(
    np.asarray(client_ids), models.params['decoder'], np.asarray(counts, np.int32), total, stats
  )


def decoder_stats_of(model: ModelState) -> Any:
  """The decoder's part of a CVAE's BatchNorm statistics ({} for the BN-free CVAEs)."""
  return (model.batch_stats or {}).get('decoder', {})


@functools.partial(jax.jit, static_argnums=(0, 5))
def decode_group(
  module: CVAE,
  decoders: Any,
  decoder_stats: Any,
  z: jax.Array,
  labels: jax.Array,
  out_hw: Optional[Tuple[int, int]] = None,
) -> jax.Array:
  """Images in [0, 1] (sigmoid of the logits, decoders in eval mode) from every decoder of a
  group in one call: decoders and their BatchNorm statistics ({} without BN) stacked [k],
  z [k, n, latent], labels [k, n] -> [k, n, H, W, C], resized to `out_hw` (default: the dataset's
  image size).

  Args:
    module: The group's CVAE module.
    decoders: Decoder parameters stacked [k].
    decoder_stats: Their BatchNorm statistics stacked [k] ({} without BN).
    z: Latents [k, n, latent].
    labels: Labels to decode [k, n].
    out_hw: (H, W) of the returned images; None takes the dataset's.

  Returns:
    Images [k, n, H, W, C] in [0, 1].
  """
  out_hw = tuple(module.image_shape[:2]) if out_hw is None else tuple(out_hw)

  def one(params, stats, zk, yk):
    variables = {'params': {'decoder': params}}
    if stats:
      variables['batch_stats'] = {'decoder': stats}
    logits = module.apply(variables, zk, yk, method='decode')
    return resize_images(jax.nn.sigmoid(logits), out_hw)

  return jax.vmap(one)(decoders, decoder_stats, z, labels)


def labels_of_counts(counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Per decoder, its labels (class c repeated counts[k, c] times) padded to the longest:
  ([k, n_max] int32 labels, [k, n_max] bool real)."""
  counts = np.asarray(counts, np.int64)
  n_max = max(1, int(counts.sum(1).max()))
  labels = np.zeros((len(counts), n_max), np.int32)
  real = np.zeros((len(counts), n_max), bool)
  for k, row in enumerate(counts):
    y = np.repeat(np.arange(len(row)), row)
    labels[k, : len(y)], real[k, : len(y)] = y, True
  return labels, real


def generate(
  module: CVAE,
  uploads: DecoderUploads,
  labels: np.ndarray,
  real: np.ndarray,
  z: jax.Array,
  out_hw: Optional[Tuple[int, int]] = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Decodes labels [k, n] (real [k, n]) from latents z [k, n, latent] with every decoder of
  `uploads`: (images [N, H, W, C] float32 at `out_hw` (default: the dataset's), labels [N],
  decoder client id [N]) of the real ones, decoder by decoder.

  Args:
    module: The group's CVAE module.
    uploads: The group's validated uploads.
    labels: Labels to decode [k, n], one row per decoder.
    real: [k, n] bool, the cells to keep (the rest pad each row to n).
    z: Latents [k, n, latent].
    out_hw: (H, W) of the images; None takes the dataset's.

  Returns:
    (images [N, H, W, C] float32, labels [N], decoder client id [N]), N the number of real cells.
  """
  stats = {} if uploads.decoder_stats is None else uploads.decoder_stats
  hw = None if out_hw is None else tuple(int(d) for d in out_hw)
  images = np.asarray(decode_group(module, uploads.decoders, stats, z, jnp.asarray(labels), hw))
  owner = np.broadcast_to(np.asarray(uploads.client_ids)[:, None], real.shape)
  return images[real], labels[real], owner[real]


def concat_generated(parts: List[Tuple[np.ndarray, np.ndarray, np.ndarray]]):
  """Concatenates the (images, labels, owners) of several decoder groups."""
  return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))
