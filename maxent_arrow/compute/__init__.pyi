# The exports of maxent_arrow.compute: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .diagnostics import (
    batch_diagnostics as batch_diagnostics,
    kl_by_length_bucket as kl_by_length_bucket,
)
from .group_math import (
    AGGREGATIONS as AGGREGATIONS,
    LENGTH_FIELDS as LENGTH_FIELDS,
    EntropyBonus as EntropyBonus,
    SCALE_REWARDS as SCALE_REWARDS,
    ScaleRewards as ScaleRewards,
    ScoredMoments as ScoredMoments,
    WeightEntropy as WeightEntropy,
    apply_group_scales as apply_group_scales,
    clipped_flags as clipped_flags,
    entropy_bonus as entropy_bonus,
    group_advantages as group_advantages,
    group_entropy as group_entropy,
    length_stats as length_stats,
    length_summary as length_summary,
    maxent_weights as maxent_weights,
    merge_step_rows as merge_step_rows,
    multi_objective_advantages as multi_objective_advantages,
    q_distribution as q_distribution,
    reward_moments as reward_moments,
    scored_moments as scored_moments,
    total_utils as total_utils,
    weight_entropy as weight_entropy,
)
from .kl import (
    LossType as LossType,
    k3 as k3,
    sequence_kl as sequence_kl,
    token_kl as token_kl,
    token_rows as token_rows,
)
from .loss import (
    ClipSettings as ClipSettings,
    evaluate_losses as evaluate_losses,
    grpo_loss as grpo_loss,
    maxent_loss as maxent_loss,
)
from .offpolicy import (
    IS_SAFETY_BOUND as IS_SAFETY_BOUND,
    KeptMass as KeptMass,
    kept_mass_audit as kept_mass_audit,
    kept_set_log_mass as kept_set_log_mass,
    kept_set_ratio as kept_set_ratio,
    RS_MODES as RS_MODES,
    TRL_IS_MODES as TRL_IS_MODES,
    ImportanceWeights as ImportanceWeights,
    RejectionMask as RejectionMask,
    RolloutCorrection as RolloutCorrection,
    offpolicy_metrics as offpolicy_metrics,
    rollout_correction as rollout_correction,
    rollout_is_weights as rollout_is_weights,
    rollout_rejection_mask as rollout_rejection_mask,
    trl_importance_metrics as trl_importance_metrics,
    trl_importance_ratio as trl_importance_ratio,
)
from .reward_step import (
    apply_entropy_bonus as apply_entropy_bonus,
    behavior_logprobs_from_meta as behavior_logprobs_from_meta,
    compute_rewards as compute_rewards,
)
from .seed_grpo import (
    SeedGrpoSettings as SeedGrpoSettings,
    SeedGrpoStats as SeedGrpoStats,
    answer_clusters as answer_clusters,
    extract_answers as extract_answers,
    seed_grpo_statistics as seed_grpo_statistics,
)
from .segments import (
    Segments as Segments,
    as_ragged as as_ragged,
    as_sample_vector as as_sample_vector,
)
