"""maxent-arrow: an Apache Arrow columnar batch store for GRPO-style LLM reinforcement learning.

The public surface: the seed's 15 per-batch dataclasses (facades over Arrow record batches),
``Ragged`` (zero-copy torch views of Arrow list columns, padded or packed in one pass), the
error hierarchy, and, loaded on first use, the rollout batch and store.
"""

from __future__ import annotations

import atexit
import gc
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

# Arrow scanners and readers abandoned before exit keep native worker threads alive; if they
# are only collected during interpreter teardown, after Arrow's pools are gone, the process
# aborts with "terminate called without an active exception" (apache/arrow#34314,
# huggingface/datasets#7566). Collecting them while Arrow is still alive joins those threads.
atexit.register(gc.collect)

# Heavier parts load on first attribute access, so `import maxent_arrow` stays fast.
_LAZY = {
    "RolloutBatch": "maxent_arrow.batch",
    "RolloutStore": "maxent_arrow.store",
    "ReplayDataset": "maxent_arrow.replay",
    "RunAnalytics": "maxent_arrow.analytics",
    "build_score_batch": "maxent_arrow.ingest",
    "build_report": "maxent_arrow.report",
    "compute_rewards": "maxent_arrow.reward_step",
}

if TYPE_CHECKING:
    from maxent_arrow.analytics import RunAnalytics
    from maxent_arrow.batch import RolloutBatch
    from maxent_arrow.ingest import build_score_batch
    from maxent_arrow.replay import ReplayDataset
    from maxent_arrow.report import build_report
    from maxent_arrow.reward_step import compute_rewards
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
    "ReplayDataset",
    "RolloutBatch",
    "RolloutStore",
    "RunAnalytics",
    "SchemaError",
    "SchemaVersionError",
    "ScoreBatch",
    "SequenceScores",
    "StoreError",
    "ValidationContext",
    "__version__",
    "build_report",
    "build_score_batch",
    "compute_rewards",
]
