"""maxent-arrow: an Apache Arrow columnar batch store for GRPO-style LLM reinforcement learning.

The public surface: the seed's 15 per-batch dataclasses (facades over Arrow record batches),
``Ragged`` (zero-copy torch views of Arrow list columns, padded or packed in one pass), the
error hierarchy, and, loaded on first use, the rollout batch and store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maxent_arrow.errors import (
    ComputeError,
    LayoutError,
    MaxentArrowError,
    MissingExtraError,
    SchemaError,
    SchemaVersionError,
    StoreError,
)
from maxent_arrow.ragged import Ragged
from maxent_arrow.types.rewards import (
    AdvantageStats,
    BatchDiagnostics,
    GenerationBatch,
    LengthStats,
    LossOutputs,
    LossScalarBundle,
    PromptCacheEntry,
    PromptCompletionBatch,
    QDistribution,
    ReferenceLogprobs,
    RewardComputation,
    RewardMoments,
    ScoreBatch,
    SequenceScores,
    ValidationContext,
)

__version__ = "0.1.0"

# Heavier parts load on first attribute access, so `import maxent_arrow` stays fast.
_LAZY = {
    "RolloutBatch": "maxent_arrow.batch",
    "RolloutStore": "maxent_arrow.store",
}

if TYPE_CHECKING:
    from maxent_arrow.batch import RolloutBatch
    from maxent_arrow.store import RolloutStore


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'maxent_arrow' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "AdvantageStats",
    "BatchDiagnostics",
    "ComputeError",
    "GenerationBatch",
    "LayoutError",
    "LengthStats",
    "LossOutputs",
    "LossScalarBundle",
    "MaxentArrowError",
    "MissingExtraError",
    "PromptCacheEntry",
    "PromptCompletionBatch",
    "QDistribution",
    "Ragged",
    "ReferenceLogprobs",
    "RewardComputation",
    "RewardMoments",
    "RolloutBatch",
    "RolloutStore",
    "SchemaError",
    "SchemaVersionError",
    "ScoreBatch",
    "SequenceScores",
    "StoreError",
    "ValidationContext",
    "__version__",
]
