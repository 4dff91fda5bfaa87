"""A Stable-Diffusion-style text-to-image pipeline loaded from a local directory.

FedTSA's server (Fan et al., ECCV 2024, §4.4) does not train a generator: it feeds the clients'
prompt pool to a pre-trained Stable Diffusion v1-4 model and uses the images it returns for the
Stage-2 deep mutual learning; §5.1 gives the prompts as "A photo of real {class}".
`LocalDiffusionSource` is that generator as an `ImageSource`: it loads a diffusers pipeline from a
directory named in the config (nothing is downloaded: the weights must already be on disk, e.g. a
`save_pretrained` or Hub snapshot of `CompVis/stable-diffusion-v1-4`) and returns the images at the
task's shape.

PyTorch, diffusers and transformers are optional dependencies: they are imported only when a
pipeline is loaded, so `jfed.diffusion` imports without them.

On a GPU, JAX preallocates most of the device memory by default, which leaves too little for the
PyTorch pipeline; run with `XLA_PYTHON_CLIENT_PREALLOCATE=false` (or a smaller
`XLA_PYTHON_CLIENT_MEM_FRACTION`) when both share one GPU, and call `close()` once the images are
generated.
"""

import importlib.util
import json
import os
import re
from typing import Any, Dict, Optional, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jfed.diffusion.source import PromptPool, SyntheticImages
from jfed.errors import ConfigError, DataError

# ITU-R BT.601 luma weights, the usual RGB -> grey conversion (what PIL's convert('L') uses).
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)

# Components (model_index.json's keys without a leading '_') that a directory may lack: the
# pipeline then runs without the safety checker.
_OPTIONAL_COMPONENTS = ('safety_checker', 'feature_extractor')


def image_seeds(key: jax.Array, num_prompts: int, per_prompt: int) -> np.ndarray:
  """One 64-bit PyTorch seed per image, [num_prompts * per_prompt] uint64, prompt-major.

  Image i of prompt p is seeded from fold_in(fold_in(key, p), i), so it does not change with
  `per_prompt`, the number of prompts after p, or the batch size it is generated in.

  Args:
    key: The generation key.
    num_prompts: Number of prompts P.
    per_prompt: Images per prompt.

  Returns:
    The seeds, as above.
  """
  if num_prompts * per_prompt == 0:
    return np.zeros((0,), np.uint64)

  def one(p, i):
    return jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, p), i), (2,), jnp.uint32)

  p, i = np.meshgrid(np.arange(num_prompts), np.arange(per_prompt), indexing='ij')
  bits = np.asarray(jax.vmap(one)(jnp.asarray(p.ravel()), jnp.asarray(i.ravel())), np.uint64)
  return (bits[:, 0] << np.uint64(32)) | bits[:, 1]


def to_task_images(rgb: np.ndarray, image_shape: Tuple[int, int, int]) -> np.ndarray:
  """Pipeline output [B, h, w, 3] in [0, 1] -> the task's [B, H, W, C] float32 in [0, 1].

  Resizes with an antialiased linear filter (the generator's 512x512 images shrink to e.g. 32x32,
  where plain bilinear sampling would alias) and, for C == 1, converts to grey with BT.601 luma.
  """
  h, w, c = image_shape
  x = np.asarray(rgb, np.float32)
  if x.shape[1:3] != (h, w):
    x = np.asarray(
      jax.image.resize(x, (x.shape[0], h, w, x.shape[3]), method='linear', antialias=True)
    )
  if c == 1:
    x = (x @ _LUMA)[..., None]
  return np.clip(x, 0.0, 1.0).astype(np.float32)


def _read_model_index(path: str) -> Dict[str, Any]:
  """Checks that `path` holds a diffusers pipeline; returns its model_index.json."""
  if not os.path.isdir(path):
    raise DataError(f'diffusion pipeline directory {path!r} does not exist or is not a directory')
  index_file = os.path.join(path, 'model_index.json')
  if not os.path.isfile(index_file):
    raise DataError(
      f'{path!r} is not a diffusers pipeline directory: it has no model_index.json '
      '(save one with pipeline.save_pretrained(path) or copy a Hub snapshot there)'
    )
  try:
    with open(index_file) as f:
      index = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f'{index_file}: cannot read it as JSON: {e}') from e
  if not isinstance(index, dict) or '_class_name' not in index:
    raise DataError(f'{index_file}: not a diffusers model index (no _class_name)')
  missing = [
    name
    for name, spec in index.items()
    if not name.startswith('_')
    and name not in _OPTIONAL_COMPONENTS
    and isinstance(spec, list)
    and spec[0] is not None
    and not os.path.isdir(os.path.join(path, name))
  ]
  if missing:
    raise DataError(f'diffusion pipeline {path!r} lacks its component folder(s) {missing}')
  return index


def _absent(path: str, index: Dict[str, Any], name: str) -> bool:
  spec = index.get(name)
  return (
    not isinstance(spec, list) or spec[0] is None or not os.path.isdir(os.path.join(path, name))
  )


class LocalDiffusionSource:
  """FedTSA's Stage-2 image generator (§4.4): text-to-image diffusion from local disk.

  Implements `jfed.diffusion.source.ImageSource`. The pipeline is loaded on the first `generate`
  and kept until `close()`; the directory is checked at construction so a bad config fails
  before any training.
  """

  def __init__(
    self,
    path: str,
    image_shape: Tuple[int, int, int],
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    batch_size: int = 8,
    device: str = 'auto',
    dtype: str = 'auto',
    resolution: Optional[int] = None,
  ):
    """Checks the directory and the settings; loads nothing yet.

    Args:
      path: a directory holding a diffusers text-to-image pipeline (model_index.json and its
        component folders), e.g. Stable Diffusion v1-4 as the paper uses (§4.4).
      image_shape: the task's (H, W, C), C in {1, 3}; images are resized (and greyed) to it.
      num_inference_steps: denoising steps per image (the diffusers default for SD v1-4: 50).
      guidance_scale: classifier-free guidance weight (SD v1-4's usual 7.5; <= 1 disables it).
      batch_size: images per pipeline call.
      device: a PyTorch device ('cpu', 'cuda', 'cuda:1', 'mps') or 'auto' (CUDA, then MPS,
        then the CPU).
      dtype: 'float32', 'float16', 'bfloat16' or 'auto' (float16 on CUDA, float32 elsewhere).
      resolution: the side of the square images the pipeline generates before resizing; None:
        the pipeline's native size (512 for SD v1-4).

    Raises:
      DataError: `path` is not a loadable pipeline directory (the message names it).
      ConfigError: a setting is out of range.
    """
    self.path = os.path.abspath(os.path.expanduser(str(path)))
    self.image_shape = tuple(int(s) for s in image_shape)
    if len(self.image_shape) != 3 or self.image_shape[2] not in (1, 3) or min(self.image_shape) < 1:
      raise ConfigError(f'image_shape must be (H, W, C) with C in {{1, 3}}, got {image_shape}')
    if num_inference_steps < 1 or batch_size < 1:
      raise ConfigError(
        f'num_inference_steps and batch_size must be >= 1, got {num_inference_steps}, {batch_size}'
      )
    if dtype not in ('auto', 'float32', 'float16', 'bfloat16'):
      raise ConfigError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if resolution is not None and (resolution < 8 or resolution % 8):
      raise ConfigError(f'resolution must be a positive multiple of 8, got {resolution}')
    self.num_inference_steps = int(num_inference_steps)
    self.guidance_scale = float(guidance_scale)
    self.batch_size = int(batch_size)
    self.device = device
    self.dtype = dtype
    self.resolution = resolution
    self._index = _read_model_index(self.path)
    self._pipe = None

  @property
  def pipeline(self):
    """The loaded diffusers pipeline (loading it on first use)."""
    if self._pipe is None:
      self._pipe = self._load()
    return self._pipe

  def _load(self):
    try:
      # pylint: disable=g-import-not-at-top
      import diffusers
      import torch
      import transformers  # noqa: F401  (the text encoder and tokenizer come from it)
    except ImportError as e:
      raise ConfigError(
        f'LocalDiffusionSource needs torch, diffusers and transformers ({e}); install them '
        '(pip install diffusers transformers torch)'
      ) from e
    device = self.device
    if device == 'auto':
      if torch.cuda.is_available():
        device = 'cuda'
      elif torch.backends.mps.is_available():
        device = 'mps'
      else:
        device = 'cpu'
    dtype = self.dtype
    if dtype == 'auto':
      # Half precision is how SD v1-4 is usually run on a GPU (half the memory); CPUs have no
      # fast float16 kernels.
      dtype = 'float16' if device.startswith('cuda') else 'float32'
    # diffusers 0.40 renamed torch_dtype to dtype (the old name warns).
    major_minor = tuple(int(v) for v in re.findall(r'\d+', diffusers.__version__)[:2])
    dtype_arg = 'dtype' if major_minor >= (0, 40) else 'torch_dtype'
    kwargs: Dict[str, Any] = {'local_files_only': True, dtype_arg: getattr(torch, dtype)}
    if 'safety_checker' in self._index and _absent(self.path, self._index, 'safety_checker'):
      # Without this, SD pipelines refuse to load a directory saved without the checker.
      kwargs.update(safety_checker=None, requires_safety_checker=False)
      if 'feature_extractor' in self._index and _absent(
        self.path, self._index, 'feature_extractor'
      ):
        kwargs['feature_extractor'] = None
    if importlib.util.find_spec('accelerate') is None:
      # The default would only warn that accelerate is missing and fall back to this.
      kwargs['low_cpu_mem_usage'] = False
    try:
      pipe = diffusers.AutoPipelineForText2Image.from_pretrained(self.path, **kwargs)
    except Exception as e:  # diffusers raises OSError, ValueError, KeyError, ... for a bad folder
      first = str(e).strip().splitlines()[0] if str(e).strip() else ''
      raise DataError(
        f'cannot load the diffusion pipeline in {self.path!r}: {type(e).__name__}: {first}'
      ) from e
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    logging.info('Loaded %s from %s on %s (%s)', type(pipe).__name__, self.path, device, dtype)
    return pipe

  def generate(self, pool: PromptPool, per_prompt: int, key: jax.Array) -> SyntheticImages:
    """`per_prompt` images for every prompt of the pool, labelled with the prompt's class.

    Args:
      pool: the server's prompt pool (§4.4), e.g. "A photo of real {class}" per class (§5.1).
      per_prompt: images per prompt.
      key: seeds every image's initial latent noise (see `image_seeds`): the same key, pool
        and settings give the same images on the same device.

    Returns:
      `SyntheticImages`: images [P * per_prompt, H, W, C] float32 in [0, 1], prompt-major (the
      `per_prompt` images of prompt 0 first), and labels [P * per_prompt] int32.
    """
    prompts = tuple(str(p) for p in pool.prompts)
    class_ids = np.asarray(pool.class_ids, np.int32).reshape(-1)
    if class_ids.shape[0] != len(prompts):
      raise ValueError(f'the pool has {len(prompts)} prompts but {class_ids.shape[0]} class ids')
    if per_prompt < 0:
      raise ValueError(f'per_prompt must be >= 0, got {per_prompt}')
    labels = np.repeat(class_ids, per_prompt)
    n = labels.shape[0]
    h, w, c = self.image_shape
    images = np.zeros((n, h, w, c), np.float32)
    if n == 0:
      return SyntheticImages(images=images, labels=labels)

    pipe = self.pipeline  # first: says what to install when torch or diffusers is missing
    import torch  # pylint: disable=g-import-not-at-top

    seeds = image_seeds(key, len(prompts), per_prompt)
    item_prompts = [p for p in prompts for _ in range(per_prompt)]
    size = {} if self.resolution is None else {'height': self.resolution, 'width': self.resolution}
    flagged = 0
    for start in range(0, n, self.batch_size):
      stop = min(start + self.batch_size, n)
      # CPU generators: the initial noise is then the same whatever device the pipeline runs on.
      generators = [torch.Generator('cpu').manual_seed(int(s)) for s in seeds[start:stop]]
      with torch.inference_mode():
        out = pipe(
          prompt=item_prompts[start:stop],
          num_inference_steps=self.num_inference_steps,
          guidance_scale=self.guidance_scale,
          generator=generators,
          output_type='np',
          **size,
        )
      images[start:stop] = to_task_images(out.images, self.image_shape)
      flagged += sum(bool(f) for f in (getattr(out, 'nsfw_content_detected', None) or ()))
    if flagged:
      logging.warning(
        'The safety checker blanked %d of %d generated images (they are kept, black)', flagged, n
      )
    return SyntheticImages(images=images, labels=labels)

  def close(self) -> None:
    """Drops the pipeline and returns its GPU memory (a later `generate` loads it again)."""
    if self._pipe is None:
      return
    self._pipe = None
    import torch  # pylint: disable=g-import-not-at-top

    if torch.cuda.is_available():
      torch.cuda.empty_cache()


def write_class_grid(
  images: SyntheticImages,
  path: str,
  per_class: int = 8,
  max_classes: int = 20,
  scale: Optional[int] = None,
) -> str:
  """Writes a PNG with one row per class (ascending label) of its first `per_class` images,
  each pixel drawn `scale` x `scale` (default: 8x8 digits at 8, 28-32 px images at 2).

  Args:
    images: The generated images and their labels.
    path: The PNG to write.
    per_class: Images shown per class (columns).
    max_classes: Classes shown at most (rows).
    scale: Pixel magnification; None picks one from the image size.

  Returns:
    `path` (its directory is created).
  """
  # pylint: disable=g-import-not-at-top
  import matplotlib.image

  x = np.clip(np.asarray(images.images, np.float32), 0.0, 1.0)
  y = np.asarray(images.labels)
  if x.shape[0] == 0:
    raise ValueError('no images to draw')
  _, h, w, c = x.shape
  classes = np.unique(y)[:max_classes]
  pad = 2
  grid = np.ones((len(classes) * (h + pad) + pad, per_class * (w + pad) + pad, c), np.float32)
  for r, k in enumerate(classes):
    for j, img in enumerate(x[y == k][:per_class]):
      top, left = pad + r * (h + pad), pad + j * (w + pad)
      grid[top : top + h, left : left + w] = img
  scale = max(1, 64 // max(h, w)) if scale is None else int(scale)
  grid = np.repeat(np.repeat(grid, scale, axis=0), scale, axis=1)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if c == 1:
    matplotlib.image.imsave(path, grid[..., 0], cmap='gray', vmin=0.0, vmax=1.0)
  else:
    matplotlib.image.imsave(path, grid)
  return path
