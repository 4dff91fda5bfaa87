"""FedTSA's Stage-2 image sources: the prompt pool and its interface (`source`), a
class-conditional DDPM in Flax (`ddpm`, `unet`, `train`) and a local diffusers pipeline
(`local_pipeline`, optional extra; torch is imported only when it is used)."""

from jfed.diffusion.source import (
  DEFAULT_PROMPT_TEMPLATE,
  ImageSource,
  PromptPool,
  PublicImageSource,
  SyntheticImages,
  build_prompt_pool,
  class_prompts,
)
