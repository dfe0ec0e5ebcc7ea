# The exports of maxent_arrow: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

__version__: str

from .analytics import RunAnalytics as RunAnalytics, build_report as build_report
from .arrow import Ragged as Ragged
from .compute import compute_rewards as compute_rewards
from .errors import (
    ArgumentError as ArgumentError,
    ComputeError as ComputeError,
    LayoutError as LayoutError,
    LostEntryError as LostEntryError,
    MaxentArrowError as MaxentArrowError,
    MissingExtraError as MissingExtraError,
    QueryError as QueryError,
    ReadOnlyFormatError as ReadOnlyFormatError,
    SchemaError as SchemaError,
    SchemaVersionError as SchemaVersionError,
    ShapeError as ShapeError,
    StoreError as StoreError,
)
from .ingest import build_score_batch as build_score_batch
from .rollout import RolloutBatch as RolloutBatch, RunConfig as RunConfig, recompute as recompute
from .store import ReplayDataset as ReplayDataset, RolloutStore as RolloutStore
from .types import (
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
