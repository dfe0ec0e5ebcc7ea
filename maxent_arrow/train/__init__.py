"""Training with the store underneath: sampling K completions (:mod:`.generation`),
teacher-forced scoring (:mod:`.scoring`), the MaxEnt-GRPO trainer (:mod:`.trainer`),
evaluation through the seed's ``ValidationContext`` (:mod:`.evaluation`) and the offline
re-scoring of saved steps (:mod:`.offline`).
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".generation": ["Rollouts", "sample_groups"],
        ".scoring": [
            "TokenScores",
            "reference_logprobs",
            "score_tokens",
            "sequence_scores",
            "supports_packing",
        ],
        ".trainer": ["MaxEntTrainer"],
        ".snapshots": ["snapshot_loader", "snapshot_path"],
        ".evaluation": ["evaluate", "greedy_generator", "should_evaluate"],
        ".offline": ["ReplayedStep", "recompute_errors", "replay_losses"],
    },
)
