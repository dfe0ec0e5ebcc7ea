"""Group math on (values, offsets), in torch, the same code on CPU and GPU.

Utilities, group advantages, q-distributions, MaxEnt weights, reward moments and length stats
(:mod:`.group_math`), SEED-GRPO scaling (:mod:`.seed_grpo`), the whole reward step
(:mod:`.reward_step`), KL (:mod:`.kl`), the MaxEnt and GRPO losses (:mod:`.loss`) and the batch
diagnostics (:mod:`.diagnostics`), all over segment reductions (:mod:`.segments`). The
formulas are ``docs/formulas.md``; no Python loop over groups or samples.
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".group_math": [
            "AGGREGATIONS",
            "LENGTH_FIELDS",
            "SCALE_REWARDS",
            "EntropyBonus",
            "ScaleRewards",
            "ScoredMoments",
            "WeightEntropy",
            "apply_group_scales",
            "clipped_flags",
            "entropy_bonus",
            "group_advantages",
            "group_entropy",
            "length_stats",
            "length_summary",
            "maxent_weights",
            "merge_step_rows",
            "multi_objective_advantages",
            "q_distribution",
            "reward_moments",
            "scored_moments",
            "total_utils",
            "weight_entropy",
        ],
        ".segments": ["Segments", "as_ragged", "as_sample_vector"],
        ".seed_grpo": [
            "SeedGrpoSettings",
            "SeedGrpoStats",
            "answer_clusters",
            "extract_answers",
            "seed_grpo_statistics",
        ],
        ".reward_step": ["apply_entropy_bonus", "behavior_logprobs_from_meta", "compute_rewards"],
        ".kl": ["LossType", "k3", "sequence_kl", "token_kl", "token_rows"],
        ".loss": ["ClipSettings", "evaluate_losses", "grpo_loss", "maxent_loss"],
        ".diagnostics": ["batch_diagnostics", "kl_by_length_bucket"],
    },
)
