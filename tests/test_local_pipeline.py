"""`LocalDiffusionSource`: FedTSA's (Fan et al., ECCV 2024) Stable Diffusion generator,
loaded from disk.

No weights can be downloaded here, so the pipeline tests build a tiny randomly initialised
Stable-Diffusion-style pipeline (UNet, VAE, CLIP text encoder, a CLIP tokenizer from a vocabulary
written here, DDIM), save it with `save_pretrained` and load it back through the source. They
skip where torch, diffusers or transformers are not installed.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jfed.diffusion import local_pipeline
from jfed.diffusion.local_pipeline import LocalDiffusionSource
from jfed.diffusion.source import PromptPool, SyntheticImages
from jfed.errors import ConfigError, DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL = PromptPool(
  prompts=('A photo of real cat', 'A photo of real dog'), class_ids=np.array([3, 5], np.int32)
)


def _write_tokenizer_files(directory):
  """A tiny CLIP BPE vocabulary: the specials, every letter alone and word-final, a few merges."""
  letters = [chr(c) for c in range(ord('a'), ord('z') + 1)]
  merges = ['p h', 'ph o', 'pho t', 'phot o</w>', 'r e', 're a', 'rea l</w>', 'c a', 'ca t</w>']
  tokens = ['<|startoftext|>', '<|endoftext|>'] + letters + [f'{l}</w>' for l in letters]
  tokens += [m.replace(' ', '') for m in merges]
  vocab_file = os.path.join(directory, 'vocab.json')
  merges_file = os.path.join(directory, 'merges.txt')
  with open(vocab_file, 'w') as f:
    json.dump({t: i for i, t in enumerate(tokens)}, f)
  with open(merges_file, 'w') as f:
    f.write('#version: 0.2\n' + '\n'.join(merges) + '\n')
  return vocab_file, merges_file, len(tokens)


@pytest.fixture(autouse=True, scope='module')
def _one_torch_thread():
  """The tiny models run 10x faster on one thread than on two that share the cores with another
  test process (measured on 2 cores: 0.08 s vs 0.7-1.5 s a call)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    yield
    return
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def tiny_pipeline_dir(tmp_path_factory):
  """A saved tiny random text-to-image pipeline: 16x16 RGB images from 8x8x4 latents."""
  torch = pytest.importorskip('torch')
  diffusers = pytest.importorskip('diffusers')
  transformers = pytest.importorskip('transformers')
  root = tmp_path_factory.mktemp('tiny_sd')
  vocab_file, merges_file, vocab_size = _write_tokenizer_files(str(root))
  tokenizer = transformers.CLIPTokenizer(vocab_file, merges_file, model_max_length=16)
  torch.manual_seed(0)
  text_encoder = transformers.CLIPTextModel(
    transformers.CLIPTextConfig(
      vocab_size=vocab_size,
      hidden_size=32,
      intermediate_size=37,
      num_hidden_layers=2,
      num_attention_heads=4,
      max_position_embeddings=16,
      bos_token_id=0,
      eos_token_id=1,
      pad_token_id=1,
    )
  )
  unet = diffusers.UNet2DConditionModel(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=('DownBlock2D', 'CrossAttnDownBlock2D'),
    up_block_types=('CrossAttnUpBlock2D', 'UpBlock2D'),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=8,
  )
  vae = diffusers.AutoencoderKL(
    sample_size=16,
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(8, 16),
    down_block_types=('DownEncoderBlock2D',) * 2,
    up_block_types=('UpDecoderBlock2D',) * 2,
    layers_per_block=1,
    norm_num_groups=8,
  )
  scheduler = diffusers.DDIMScheduler(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule='scaled_linear',
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
  )
  pipe = diffusers.StableDiffusionPipeline(
    vae=vae,
    text_encoder=text_encoder,
    tokenizer=tokenizer,
    unet=unet,
    scheduler=scheduler,
    safety_checker=None,
    feature_extractor=None,
    requires_safety_checker=False,
  )
  path = str(root / 'pipeline')
  pipe.save_pretrained(path)
  return path


@pytest.fixture(scope='module')
def grey_source(tiny_pipeline_dir):
  return LocalDiffusionSource(
    tiny_pipeline_dir, (28, 28, 1), num_inference_steps=2, batch_size=3, device='cpu'
  )


def test_grey_images_have_the_task_shape_range_and_prompt_labels(grey_source):
  out = grey_source.generate(POOL, 2, jax.random.key(0))
  assert isinstance(out, SyntheticImages)
  assert out.images.shape == (4, 28, 28, 1) and out.images.dtype == np.float32
  assert out.images.min() >= 0.0 and out.images.max() <= 1.0
  assert out.images.std() > 0.01  # not a constant (e.g. blanked) image
  assert out.labels.dtype == np.int32
  np.testing.assert_array_equal(out.labels, [3, 3, 5, 5])
  # Every image has its own noise: the two images of one prompt differ.
  assert np.abs(out.images[0] - out.images[1]).max() > 1e-3


def test_same_key_same_images_other_key_other_images(grey_source):
  a = grey_source.generate(POOL, 2, jax.random.key(0))
  b = grey_source.generate(POOL, 2, jax.random.key(0))
  c = grey_source.generate(POOL, 2, jax.random.key(1))
  np.testing.assert_array_equal(a.images, b.images)
  assert np.abs(a.images - c.images).max() > 1e-3


def test_rgb_images_batch_size_independence_and_grey_is_their_luma(tiny_pipeline_dir, grey_source):
  rgb_source = LocalDiffusionSource(
    tiny_pipeline_dir, (28, 28, 3), num_inference_steps=2, batch_size=2, device='cpu'
  )
  rgb = rgb_source.generate(POOL, 2, jax.random.key(0))
  assert rgb.images.shape == (4, 28, 28, 3) and rgb.images.dtype == np.float32
  assert rgb.images.min() >= 0.0 and rgb.images.max() <= 1.0
  np.testing.assert_array_equal(rgb.labels, [3, 3, 5, 5])
  # Image (p, i) is seeded by (key, p, i) alone: batches of 2 here, of 3 and 1 in grey_source.
  grey = grey_source.generate(POOL, 2, jax.random.key(0))
  luma = rgb.images @ np.array([0.299, 0.587, 0.114], np.float32)
  np.testing.assert_allclose(luma, grey.images[..., 0], atol=2e-3)


def test_zero_images_and_mismatched_pool(grey_source):
  out = grey_source.generate(POOL, 0, jax.random.key(0))
  assert out.images.shape == (0, 28, 28, 1) and out.labels.shape == (0,)
  with pytest.raises(ValueError, match='2 prompts but 1 class ids'):
    grey_source.generate(PromptPool(POOL.prompts, np.array([0], np.int32)), 1, jax.random.key(0))


def test_missing_or_invalid_directory_is_a_one_line_error_naming_it(tmp_path):
  missing = str(tmp_path / 'no_such_pipeline')
  with pytest.raises(ValueError, match='no_such_pipeline') as e:
    LocalDiffusionSource(missing, (28, 28, 1))
  assert isinstance(e.value, DataError) and '\n' not in str(e.value)
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(DataError, match='no model_index.json') as e:
    LocalDiffusionSource(str(empty), (28, 28, 1))
  assert str(empty) in str(e.value)
  (empty / 'model_index.json').write_text(
    json.dumps(
      {'_class_name': 'StableDiffusionPipeline', 'unet': ['diffusers', 'UNet2DConditionModel']}
    )
  )
  with pytest.raises(DataError, match=r"lacks its component folder\(s\) \['unet'\]"):
    LocalDiffusionSource(str(empty), (28, 28, 1))


def test_corrupt_weights_fail_to_load_with_the_path(tiny_pipeline_dir, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top

  broken = tmp_path / 'broken'
  shutil.copytree(tiny_pipeline_dir, broken)
  for name in os.listdir(broken / 'unet'):
    if name.endswith('.safetensors'):
      (broken / 'unet' / name).write_bytes(b'not safetensors')
  source = LocalDiffusionSource(str(broken), (28, 28, 1), device='cpu')
  with pytest.raises(DataError, match='cannot load the diffusion pipeline') as e:
    source.generate(POOL, 1, jax.random.key(0))
  assert str(broken) in str(e.value) and '\n' not in str(e.value)


def test_settings_are_checked():
  with pytest.raises(ValueError, match='C in'):
    LocalDiffusionSource('/nonexistent', (28, 28, 2))
  with pytest.raises(ValueError, match='multiple of 8'):
    LocalDiffusionSource('/nonexistent', (28, 28, 3), resolution=100)


def test_image_seeds_depend_only_on_key_prompt_and_index():
  key = jax.random.key(7)
  three = local_pipeline.image_seeds(key, 2, 3).reshape(2, 3)
  two = local_pipeline.image_seeds(key, 2, 2).reshape(2, 2)
  np.testing.assert_array_equal(three[:, :2], two)
  assert three.dtype == np.uint64 and len(np.unique(three)) == 6
  assert not np.array_equal(local_pipeline.image_seeds(jax.random.key(8), 2, 2).reshape(2, 2), two)


def test_to_task_images_resizes_with_antialiasing_and_greys_with_bt601():
  stripes = np.zeros((1, 64, 64, 3), np.float32)
  stripes[:, :, ::2] = 1.0  # one-pixel stripes average to mid-grey when shrunk 8x
  small = local_pipeline.to_task_images(stripes, (8, 8, 3))
  assert small.shape == (1, 8, 8, 3)
  np.testing.assert_allclose(small, 0.5, atol=0.07)
  red = np.zeros((1, 4, 4, 3), np.float32)
  red[..., 0] = 1.0
  np.testing.assert_allclose(local_pipeline.to_task_images(red, (4, 4, 1)), 0.299, atol=1e-6)


def test_write_class_grid(tmp_path):
  import matplotlib.image  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  images = SyntheticImages(
    images=rng.random((6, 8, 8, 1), dtype=np.float32), labels=np.array([0, 0, 2, 2, 2, 1], np.int32)
  )
  path = local_pipeline.write_class_grid(
    images, str(tmp_path / 'figs' / 'grid.png'), per_class=2, scale=1
  )
  grid = matplotlib.image.imread(path)
  assert grid.shape[:2] == (3 * 10 + 2, 2 * 10 + 2)
  # row 2 (class 2) holds images 2 and 3 in place
  np.testing.assert_allclose(
    grid[2 * 10 + 2 : 2 * 10 + 10, 2:10, 0], images.images[2, ..., 0], atol=0.01
  )
  big = matplotlib.image.imread(local_pipeline.write_class_grid(images, str(tmp_path / 'b.png')))
  assert big.shape[:2] == (8 * (3 * 10 + 2), 8 * (8 * 10 + 2))  # 8 per class, 8x8 drawn 8x


def test_without_the_packages_loading_says_what_to_install(tmp_path, monkeypatch):
  (tmp_path / 'model_index.json').write_text(json.dumps({'_class_name': 'StableDiffusionPipeline'}))
  source = LocalDiffusionSource(str(tmp_path), (28, 28, 1))
  monkeypatch.setitem(sys.modules, 'diffusers', None)  # as if not installed
  with pytest.raises(ConfigError, match='needs torch, diffusers and transformers'):
    source.generate(POOL, 1, jax.random.key(0))


def test_importing_the_module_does_not_import_torch():
  code = 'import sys, jfed.diffusion.local_pipeline; print("torch" in sys.modules)'
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == 'False'
