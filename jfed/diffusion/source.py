"""Where FedTSA's Stage-2 images come from: the prompt pool and the one interface every image source
implements (FedTSA, Fan et al., ECCV 2024, §4.4: clients upload prompts "a photo of real {class}" to
the server's prompt pool; a text-to-image model turns each prompt into images).

Sources (chosen by config in `jfed.methods.fedtsa`):
- `jfed.diffusion.train.DDPMImageSource`: a class-conditional DDPM trained here (the default,
  since no diffusion weights can be downloaded);
- `jfed.diffusion.local_pipeline.LocalDiffusionSource`: a Stable-Diffusion-style pipeline from a
  local directory (the paper's setting);
- `PublicImageSource`: images of a labelled public dataset, per_prompt of each prompt's class.
"""

import re
from typing import NamedTuple, Protocol, Sequence, Tuple

import jax
import numpy as np

DEFAULT_PROMPT_TEMPLATE = 'a photo of real {}'


def class_prompts(
  class_names: Sequence[str], template: str = DEFAULT_PROMPT_TEMPLATE
) -> Tuple[str, ...]:
  """One prompt per class, e.g. 'a photo of real sneaker'."""
  return tuple(template.format(name) for name in class_names)


class PromptPool(NamedTuple):
  """The server's pool of the prompts clients uploaded."""

  prompts: Tuple[str, ...]
  class_ids: np.ndarray  # [P] int32: the class each prompt is about


def _class_of(prompt: str, class_names: Sequence[str]) -> int:
  """The class a prompt names: whole-word, case-insensitive matches of the class names; among
  overlapping matches the longest wins ('t-shirt/top' over 'shirt')."""
  text = prompt.lower()
  spans = []
  for c, name in enumerate(class_names):
    pattern = r'(?<![\w-])' + re.escape(name.lower()) + r'(?![\w-])'
    spans += [(m.start(), m.end(), c) for m in re.finditer(pattern, text)]
  kept = [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]
  named = sorted({c for _, _, c in kept})
  if len(named) != 1:
    what = 'no class' if not named else f'{len(named)} classes'
    raise ValueError(
      f'prompt {prompt!r} names {what} of {list(class_names)}; each prompt must name one class'
    )
  return named[0]


def build_prompt_pool(
  uploaded: Sequence[Sequence[str]],
  class_names: Sequence[str],
) -> PromptPool:
  """The union of the clients' uploaded prompts (deduplicated, in order of first appearance),
  each mapped to the class it names; ValueError (one line) for a prompt naming no class or
  several."""
  prompts = tuple(dict.fromkeys(p.strip() for client in uploaded for p in client if p.strip()))
  if not prompts:
    raise ValueError('the prompt pool is empty: no client uploaded a prompt')
  ids = np.array([_class_of(p, class_names) for p in prompts], np.int32)
  return PromptPool(prompts, ids)


class SyntheticImages(NamedTuple):
  images: np.ndarray  # [N, H, W, C] float32 in [0, 1], the task's image shape
  labels: np.ndarray  # [N] int32: the class of the prompt each image came from


class ImageSource(Protocol):
  def generate(self, pool: PromptPool, per_prompt: int, key: jax.Array) -> SyntheticImages:
    """Images for every prompt of the pool.

    Args:
      pool: The server's prompt pool.
      per_prompt: Images generated per prompt.
      key: PRNG key of the generation.

    Returns:
      The images in the task's shape, prompt-major, with their prompts' classes.
    """


class PublicImageSource:
  """`per_prompt` images of each prompt's class drawn (without replacement where possible) from
  a labelled public set already in the task's shape."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images = np.asarray(images, np.float32)
    self.labels = np.asarray(labels, np.int32)

  def generate(self, pool: PromptPool, per_prompt: int, key: jax.Array) -> SyntheticImages:
    """`per_prompt` public images of each prompt's class.

    Args:
      pool: The server's prompt pool.
      per_prompt: Images drawn per prompt.
      key: PRNG key of the draw.

    Returns:
      The images, prompt-major, with their classes.
    """
    seed = int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in np.asarray(pool.class_ids):
      members = np.flatnonzero(self.labels == c)
      if not len(members):
        raise ValueError(f'the public image set has no image of class {int(c)}')
      pick = rng.choice(members, per_prompt, replace=per_prompt > len(members))
      xs.append(self.images[pick])
      ys.append(np.full(per_prompt, c, np.int32))
    return SyntheticImages(np.concatenate(xs), np.concatenate(ys))
