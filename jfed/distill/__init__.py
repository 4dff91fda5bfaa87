"""Data-free distillation building blocks: generator, losses, teacher ensembles, synthetic pool,
FedHydra model stratification / stratified aggregation, generator synthesis, the KD step, OT
fusion."""

from jfed.distill.ensemble import (
  TeacherGroup,
  coboosting_weight_update,
  combine_logits,
  ensemble_logits,
  group_outputs,
  num_teachers,
  teacher_outputs,
)
from jfed.distill.generator import (
  GENERATORS,
  DenseGenerator,
  FedHydraGenerator,
  dense_generator_init,
  make_generator,
)
from jfed.distill.kd import (
  KDConfig,
  KDEpoch,
  KDPrograms,
  Teachers,
  committed,
  crop_padding,
  gather_batch,
  kd_step,
  per_sample_loss,
  resolve_augment,
  student_optimizer,
  student_state,
  teacher_groups,
)
from jfed.distill.losses import (
  adversarial_loss,
  bn_statistics_loss,
  cross_entropy,
  disagreement_mask,
  hard_sample_cross_entropy,
  kl_divergence,
  knowledge_fusion_loss,
)
from jfed.distill.ot_fusion import (
  FusionLayer,
  align_to_anchor,
  ot_fuse,
  ot_fuse_states,
  transport_plan,
)
from jfed.distill.pool import (
  ImagePool,
  augment,
  epoch_batches,
  pool_add,
  pool_gather,
  pool_init,
  pool_reservoir_add,
  pool_sample,
  pool_size,
)
from jfed.distill.stratification import (
  MS_COMPUTE_DTYPES,
  MS_FUNCTIONS,
  MS_IMPLS,
  MS_LAYOUTS,
  MSConfig,
  StratificationResult,
  average_ensemble,
  model_stratification,
  model_stratification_loop,
  model_stratification_python,
  ms_step_flops,
  normalise_U,
  resolve_ms_impl,
  stratification_from_losses,
  stratified_aggregation,
  stratified_weights,
  variation_degree,
)
from jfed.distill.synthesis import (
  KEEP,
  SAWeights,
  SynthesisConfig,
  SynthesisResult,
  coboosting_config,
  dense_config,
  fedhydra_config,
  images_per_epoch,
  synthesize,
)
