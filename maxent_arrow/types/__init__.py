"""The 15 seed records of ``maxent_grpo.training.types.rewards`` (:mod:`.rewards` is the
seed-compatible import path), the settings types ``ValidationContext`` names
(:mod:`.settings`), and the helpers of code that makes records from Arrow columns or reads
their batches (``rewards_batch``, ``reference_batch``, ``sample_messages``,
``record_scalars``); ``evolve`` (``dataclasses.replace`` that keeps undecoded fields in Arrow)
and ``records_equal`` (records compared by value, as a round trip through Arrow keeps them).

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
        ".base": ["evolve", "records_equal"],
        ".columns": ["record_scalars"],
        ".computation": ["rewards_batch"],
        ".records": ["sample_messages"],
        ".tensors": ["reference_batch"],
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
