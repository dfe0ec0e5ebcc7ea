"""maxent-arrow: an Apache Arrow columnar batch store for GRPO-style LLM reinforcement learning.

The public surface: the seed's 15 per-batch dataclasses (facades over Arrow record batches),
``Ragged`` (zero-copy torch views of Arrow list columns, padded or packed in one pass), the
rollout batch and store, analytics, and the error hierarchy. The package tree is the
architecture (``docs/architecture.md``): ``errors`` · ``arrow`` · ``types`` · ``compute`` |
``ingest`` · ``rollout`` · ``store`` · ``analytics`` | ``train`` · ``integrations`` ·
``demo`` · ``cli``, each importing only the ones before it.

Every name loads on first use (:mod:`maxent_arrow.lazy`): ``import maxent_arrow`` imports no
torch, so commands that make no tensor start fast.
"""

from __future__ import annotations

import atexit
import gc

from maxent_arrow import lazy

__version__ = "0.1.0"

# Arrow scanners and readers abandoned before exit keep native worker threads alive; if they
# are only collected during interpreter teardown, after Arrow's pools are gone, the process
# aborts with "terminate called without an active exception" (apache/arrow#34314,
# huggingface/datasets#7566). Collecting them while Arrow is still alive joins those threads.
atexit.register(gc.collect)

_lazy_names, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".types": [
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
        ".errors": [
            "ArgumentError",
            "ComputeError",
            "LayoutError",
            "MaxentArrowError",
            "MissingExtraError",
            "QueryError",
            "SchemaError",
            "SchemaVersionError",
            "ShapeError",
            "StoreError",
        ],
        ".arrow": ["Ragged"],
        ".rollout": ["RolloutBatch", "RunConfig", "recompute"],
        ".store": ["ReplayDataset", "RolloutStore"],
        ".analytics": ["RunAnalytics", "build_report"],
        ".ingest": ["build_score_batch"],
        ".compute": ["compute_rewards"],
    },
)

__all__ = [*_lazy_names, "__version__"]
