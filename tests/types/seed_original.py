"""The seed's ``maxent_grpo.training.types.rewards`` as plain dataclasses: the reference that
the drop-in tests hold our records against.

Transcribed from ``reference/seed_types_rewards_api.txt`` (the seed's API text): the same class
names, fields, field order, defaults, annotations in the seed's spelling (``List``, ``Dict``,
``Optional``) and properties, as plain ``@dataclass`` classes (generated ``__init__``,
``__eq__`` and ``__repr__``, class-level defaults). ``Tensor`` is ``Any`` at run time, as in
the seed: its API text gives ``completion_ids: Tensor`` as the attribute but
``completion_ids (Any)`` as the resolved parameter type. ``ValidationContext``'s handles are
annotated ``Any`` (the seed names accelerate's and transformers' classes, which this project
does not import) and its settings types are this project's (``maxent_arrow.types.settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from maxent_arrow.types.settings import (
    EvaluationSettings,
    GenerationFn,
    GenerationSettings,
    LoggingHandles,
    RewardSpec,
    RuntimeHandles,
    ScoringSettings,
)

if TYPE_CHECKING:
    from torch import Tensor
else:
    Tensor = Any

__all__ = [
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
]


@dataclass
class PromptCacheEntry:
    """Cached prompt tokenization used during scoring."""

    input_ids: List[int]
    attention_mask: List[int]

    @property
    def length(self) -> int:
        """Return cached prompt length."""
        return len(self.input_ids)


@dataclass
class GenerationBatch:
    """Completions grouped per prompt after filtering."""

    prompts: List[str]
    answers: List[str]
    grouped_completions: List[List[str]]
    grouped_ref_meta: Optional[List[List[Optional[Any]]]]
    grouped_completion_info: Optional[List[List[Dict[str, Any]]]] = None


@dataclass
class PromptCompletionBatch:
    """Flattened prompt/completion pairs."""

    prompts: List[str]
    completions: List[str]
    metadata: Optional[List[Dict[str, Any]]] = None


@dataclass
class AdvantageStats:
    """Grouped and flattened advantages."""

    grouped: List[List[float]]
    samples: List[float]


@dataclass
class QDistribution:
    """Sequence-level q-distribution."""

    grouped: List[List[float]]
    samples: List[float]


@dataclass
class RewardMoments:
    """Summary statistics for sequence rewards."""

    mean: float
    std: float


@dataclass
class RewardComputation:
    """Utility values and statistics computed per batch."""

    total_utils: List[float]
    per_reward_values: Dict[str, List[float]]
    advantage: AdvantageStats
    pairs: PromptCompletionBatch
    q_distribution: QDistribution
    moments: RewardMoments
    ref_logprob_meta: Optional[List[Optional[Any]]] = None
    completion_metadata: Optional[List[Dict[str, Any]]] = None
    entropy_bonus_scale: Optional[float] = None
    seed_semantic_entropies: Optional[List[float]] = None
    seed_advantage_scales: Optional[List[float]] = None
    seed_alpha_effective: Optional[float] = None
    seed_max_possible_entropy: Optional[float] = None

    @property
    def advantage_samples(self) -> List[float]:
        """Return flattened advantage samples for logging."""
        return self.advantage.samples

    @property
    def q_grouped(self) -> List[List[float]]:
        """Expose grouped q-values for downstream weighting."""
        return self.q_distribution.grouped

    @property
    def train_reward_mean(self) -> float:
        """Return the cached mean reward."""
        return self.moments.mean

    @property
    def train_reward_std(self) -> float:
        """Return the cached reward standard deviation."""
        return self.moments.std


@dataclass
class ScoreBatch:
    """Prompt cache entries and completion tokens ready for scoring."""

    prompt_entries: List["PromptCacheEntry"]
    completion_ids: Tensor
    completion_attention_mask: Tensor
    pad_token_id: int
    max_prompt_len: int
    slice_size: int
    total_sequences: int
    score_tail_tokens: Optional[int] = None


@dataclass
class SequenceScores:
    """Bundle sequence-level log-prob statistics."""

    cur_logp_sum: Any
    behavior_logp_sum: Any
    log_ratio_train: Any
    denom_tok_tensor: Any
    pooled_hidden: Optional[Any] = None
    policy_entropy_sum: Optional[Any] = None
    token_logp: Optional[Any] = None
    token_mask: Optional[Any] = None
    old_token_logp: Optional[Any] = None


@dataclass
class ReferenceLogprobs:
    """Reference-model log-prob summaries."""

    ref_logp_sum: Any
    ref_tok_counts: Any
    ref_logp_sum_raw: Any
    ref_logp_mean: float
    avg_completion_tokens: float
    ref_token_logp: Optional[Any] = None
    ref_token_mask: Optional[Any] = None


@dataclass
class LossScalarBundle:
    """Scalar contributions tracked for logging."""

    total_loss: float
    policy_loss: float
    clip_loss: Optional[float]
    kl_loss: float
    weighted_kl_loss: float


@dataclass
class LossOutputs:
    """Loss terms computed for a batch."""

    loss: Any
    scalars: LossScalarBundle
    log_ratio_train: Any
    denom_tok_tensor: Any

    @property
    def total_loss_scalar(self) -> float:
        """Convenience accessor for the total loss scalar."""
        return self.scalars.total_loss

    @property
    def policy_loss_scalar(self) -> float:
        """Convenience accessor for the policy loss scalar."""
        return self.scalars.policy_loss

    @property
    def clip_loss_scalar(self) -> Optional[float]:
        """Convenience accessor for the clip-objective scalar."""
        return self.scalars.clip_loss

    @property
    def kl_loss_scalar(self) -> float:
        """Convenience accessor for the KL scalar."""
        return self.scalars.kl_loss

    @property
    def weighted_kl_loss_scalar(self) -> float:
        """Convenience accessor for the weighted KL scalar."""
        return self.scalars.weighted_kl_loss


@dataclass
class LengthStats:
    """Summary of completion lengths for metrics."""

    min_length: float
    mean_length: float
    max_length: float
    clipped_ratio: float
    min_terminated: float
    mean_terminated: float
    max_terminated: float


@dataclass
class BatchDiagnostics:
    """Additional scalar stats recorded for metrics."""

    kl_value: Optional[float]
    clip_ratio: float
    clip_ratio_low_mean: float
    clip_ratio_low_min: float
    clip_ratio_high_mean: float
    clip_ratio_high_max: float
    clip_ratio_region_mean: float
    kl_per_token_by_len_bucket: Dict[str, float]
    kl_token_count_by_len_bucket: Dict[str, float]


@dataclass
class ValidationContext:
    """Handles required for the optional evaluation loop."""

    evaluation: EvaluationSettings
    accelerator: Any
    model: Any
    tokenizer: Any
    reward: RewardSpec
    generator: GenerationFn[Any]
    logging: LoggingHandles
    eval_reward: Optional[RewardSpec] = None
    runtime: Optional["RuntimeHandles"] = None
    generation: Optional["GenerationSettings"] = None
    scoring: Optional["ScoringSettings"] = None
