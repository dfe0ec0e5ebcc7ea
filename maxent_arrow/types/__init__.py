"""The 15 seed records of ``maxent_grpo.training.types.rewards`` (:mod:`.rewards` is the
seed-compatible import path) and the settings types ``ValidationContext`` names
(:mod:`.settings`).

Names load on first use; importing this package imports no torch.
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".rewards": [
            "AdvantageStats",
            "BatchDiagnostics",
            "GenerationBatch",
            "LengthStats",
            "LossOutputs",
            "LossScalarBundle",
            "PromptCacheEntry",
            "PromptCompletionBatch",
            "QDistribution",
            "ReferenceLogprobs",
            "RewardComputation",
            "RewardMoments",
            "ScoreBatch",
            "SequenceScores",
            "ValidationContext",
        ],
        ".settings": [
            "EvaluationSettings",
            "GenerationFn",
            "GenerationSettings",
            "LoggingHandles",
            "RewardFn",
            "RewardSpec",
            "RuntimeHandles",
            "ScoringSettings",
        ],
    },
)
