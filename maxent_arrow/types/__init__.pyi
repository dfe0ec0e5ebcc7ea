# The exports of maxent_arrow.types: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .base import evolve as evolve, records_equal as records_equal
from .columns import record_scalars as record_scalars
from .computation import (
    SampleColumns as SampleColumns,
    SeedColumns as SeedColumns,
    rewards_batch as rewards_batch,
)
from .records import sample_messages as sample_messages
from .rewards import (
    AdvantageStats as AdvantageStats,
    BatchDiagnostics as BatchDiagnostics,
    GenerationBatch as GenerationBatch,
    LengthStats as LengthStats,
    LossOutputs as LossOutputs,
    LossScalarBundle as LossScalarBundle,
    PromptCacheEntry as PromptCacheEntry,
    PromptCompletionBatch as PromptCompletionBatch,
    QDistribution as QDistribution,
    ReferenceLogprobs as ReferenceLogprobs,
    RewardComputation as RewardComputation,
    RewardMoments as RewardMoments,
    ScoreBatch as ScoreBatch,
    SequenceScores as SequenceScores,
    ValidationContext as ValidationContext,
)
from .settings import (
    EvaluationSettings as EvaluationSettings,
    GenerationFn as GenerationFn,
    GenerationSettings as GenerationSettings,
    LoggingHandles as LoggingHandles,
    RewardFn as RewardFn,
    RewardSpec as RewardSpec,
    RuntimeHandles as RuntimeHandles,
    ScoringSettings as ScoringSettings,
)
from .tensors import GivenForm as GivenForm, reference_batch as reference_batch
