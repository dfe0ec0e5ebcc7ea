# The exports of maxent_arrow.train: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .evaluation import (
    evaluate as evaluate,
    greedy_generator as greedy_generator,
    should_evaluate as should_evaluate,
)
from .generation import (
    Rollouts as Rollouts,
    SamplingOptions as SamplingOptions,
    decode_completions as decode_completions,
    sample_groups as sample_groups,
)
from .offline import (
    ReplayedStep as ReplayedStep,
    StoreStep as StoreStep,
    recompute_errors as recompute_errors,
    replay_losses as replay_losses,
    train_from_store as train_from_store,
)
from .scoring import (
    ScoringOptions as ScoringOptions,
    TokenScores as TokenScores,
    reference_logprobs as reference_logprobs,
    score_tokens as score_tokens,
    sequence_scores as sequence_scores,
    supports_packing as supports_packing,
)
from .snapshots import snapshot_loader as snapshot_loader, snapshot_path as snapshot_path
from .supervised import (
    WarmStartOptions as WarmStartOptions,
    supervised_warm_start as supervised_warm_start,
)
from .trainer import MaxEntTrainer as MaxEntTrainer, TrainerOptions as TrainerOptions
