"""The 15 per-batch dataclasses of ``maxent_grpo.training.types.rewards``, over Arrow.

Names, fields, field order, defaults and properties are the seed's (see
``docs/formulas.md`` §2, one section per class), so code written against that module keeps working
when it imports this one instead. They are real dataclasses (``dataclasses.fields``,
``replace``, ``asdict`` work) that hold exactly what they are given, as the seed's do: list
fields are the caller's lists, tensors stay tensors, placeholders and stand-ins are accepted.
Nothing is checked or copied at construction.

Arrow is underneath (:mod:`maxent_arrow.types.base`): ``to_arrow()`` checks the values and
converts them (tensors through ``.detach().cpu()``), raising
:class:`~maxent_arrow.SchemaError` / :class:`~maxent_arrow.LayoutError` with the field and
position for what Arrow cannot hold; ``validate()`` runs the same checks. ``from_arrow()``
keeps the record batch and decodes each field into plain Python on first access, while
``column()``, ``ragged()`` and ``tensor()`` view the batch without copying. The layouts are
in :mod:`maxent_arrow.types.records`, :mod:`maxent_arrow.types.computation` and
:mod:`maxent_arrow.types.tensors`.
``ValidationContext`` holds live handles and stays a plain dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, TypeVar, dataclass_transform

from maxent_arrow.types.base import Record, record
from maxent_arrow.types.computation import RewardsLayout
from maxent_arrow.types.records import (
    EntryLayout,
    GenerationLayout,
    GroupedPairLayout,
    PairsLayout,
    ScalarLayout,
)

# Imported at run time (not under TYPE_CHECKING) so that `typing.get_type_hints` resolves every
# class's annotations, as it does on the seed's module.
from maxent_arrow.types.settings import (
    EvaluationSettings,
    GenerationFn,
    GenerationSettings,
    LoggingHandles,
    RewardSpec,
    RuntimeHandles,
    ScoringSettings,
)
from maxent_arrow.types.tensors import LossLayout, ReferenceLayout, ScoreBatchLayout, ScoresLayout

# The annotations are the seed's, in its spelling (`List`, `Dict`, `Optional`): tools that read
# them at run time (`typing.get_type_hints`, pydantic's `TypeAdapter`, OmegaConf's
# `structured`) see the same types as on the original. `Tensor` is torch's for type checkers
# and `Any` at run time, as in the seed, whose signature reads `completion_ids (Any)`: pydantic
# and OmegaConf accept `Any`, and refuse `torch.Tensor`.
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


T = TypeVar("T")


# `dataclass_transform`: a checker sees through this name to `dataclass` (an alias of
# `dataclass(...)` hides the fields, so every constructor call looked wrong to it).
@dataclass_transform(eq_default=False)
def DATACLASS(cls: type[T]) -> type[T]:
    return dataclass(eq=False, repr=False)(cls)


# ---------------------------------------------------------------------------- PromptCacheEntry
@record(EntryLayout())
@DATACLASS
class PromptCacheEntry(Record):
    """Cached prompt tokenization used during scoring."""

    input_ids: List[int]
    attention_mask: List[int]

    @property
    def length(self) -> int:
        """Return cached prompt length."""
        return len(self.input_ids)


# ---------------------------------------------------------------------------- generation
@record(GenerationLayout())
@DATACLASS
class GenerationBatch(Record):
    """Completions grouped per prompt after filtering.

    A prompt (or a completion) may be a string or a list of chat messages (``{"role",
    "content", ...}`` dicts), mixed within a batch; a group's completions are all one or the
    other. In Arrow a message list is stored in ``prompt_messages`` / ``completion_messages``
    (``list<struct<role, content, extra>>``, other keys and non-text content as JSON in
    ``extra``): ``prompt`` is null for it, and ``completions`` holds its assistant text (the
    string contents of its assistant messages, joined by newlines) so that SQL and reward
    functions still read text. ``from_arrow`` gives back exactly the strings and message lists
    that were given.
    """

    prompts: List[str]
    answers: List[str]
    grouped_completions: List[List[str]]
    grouped_ref_meta: Optional[List[List[Optional[Any]]]]
    grouped_completion_info: Optional[List[List[Dict[str, Any]]]] = None


@record(PairsLayout())
@DATACLASS
class PromptCompletionBatch(Record):
    """Flattened prompt/completion pairs (strings or chat-message lists, as in
    :class:`GenerationBatch`)."""

    prompts: List[str]
    completions: List[str]
    metadata: Optional[List[Dict[str, Any]]] = None


# ---------------------------------------------------------------------------- grouped pairs
@record(GroupedPairLayout("advantages"))
@DATACLASS
class AdvantageStats(Record):
    """Grouped and flattened advantages (one ``list<double>`` column in Arrow; ``to_arrow``
    refuses a ``samples`` that is not ``grouped`` flattened)."""

    grouped: List[List[float]]
    samples: List[float]


@record(GroupedPairLayout("q"))
@DATACLASS
class QDistribution(Record):
    """Sequence-level q-distribution (stored like :class:`AdvantageStats`)."""

    grouped: List[List[float]]
    samples: List[float]


@record(ScalarLayout())
@DATACLASS
class RewardMoments(Record):
    """Summary statistics for sequence rewards."""

    mean: float
    std: float


@record(RewardsLayout(AdvantageStats, PromptCompletionBatch, QDistribution, RewardMoments))
@DATACLASS
class RewardComputation(Record):
    """Utility values and statistics computed per batch.

    As in the seed, ``completion_metadata`` is usually the same list object as
    ``pairs.metadata``; ``to_arrow`` stores it once then, and ``from_arrow`` gives the aliasing
    back.
    """

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


# ---------------------------------------------------------------------------- tensors
@record(ScoreBatchLayout(PromptCacheEntry))
@DATACLASS
class ScoreBatch(Record):
    """Prompt cache entries and completion tokens ready for scoring.

    In Arrow, ``completion_ids`` is stored ragged: each row keeps the tokens its attention mask
    marks (the mask must be ones then zeros) and comes back right-padded with ``pad_token_id``
    (rows whose padding holds other ids are stored whole). ``column("prompt_ids")`` views the
    prompt entries' ids without building them.
    """

    prompt_entries: List[PromptCacheEntry]
    completion_ids: Tensor
    completion_attention_mask: Tensor
    pad_token_id: int
    max_prompt_len: int
    slice_size: int
    total_sequences: int
    score_tail_tokens: Optional[int] = None


@record(ScoresLayout())
@DATACLASS
class SequenceScores(Record):
    """Bundle sequence-level log-prob statistics.

    ``cur_logp_sum`` keeps its gradient here; ``to_arrow`` stores a detached copy. Per-token
    tensors (``token_logp``, ``old_token_logp``) are stored ragged by ``token_mask``.
    """

    cur_logp_sum: Any
    behavior_logp_sum: Any
    log_ratio_train: Any
    denom_tok_tensor: Any
    pooled_hidden: Optional[Any] = None
    policy_entropy_sum: Optional[Any] = None
    token_logp: Optional[Any] = None
    token_mask: Optional[Any] = None
    old_token_logp: Optional[Any] = None


@record(ReferenceLayout())
@DATACLASS
class ReferenceLogprobs(Record):
    """Reference-model log-prob summaries.

    As in the seed, ``ref_logp_sum`` is a per-token mean (R_i / max(T_i, 1)) despite its name,
    ``ref_logp_sum_raw`` the sum R_i, and ``ref_logp_mean`` the mean of the raw sums.
    """

    ref_logp_sum: Any
    ref_tok_counts: Any
    ref_logp_sum_raw: Any
    ref_logp_mean: float
    avg_completion_tokens: float
    ref_token_logp: Optional[Any] = None
    ref_token_mask: Optional[Any] = None


# ---------------------------------------------------------------------------- loss
@record(ScalarLayout(optional=("clip_loss",)))
@DATACLASS
class LossScalarBundle(Record):
    """Scalar contributions tracked for logging."""

    total_loss: float
    policy_loss: float
    clip_loss: Optional[float]
    kl_loss: float
    weighted_kl_loss: float


@record(LossLayout(LossScalarBundle))
@DATACLASS
class LossOutputs(Record):
    """Loss terms computed for a batch. ``loss`` keeps its graph; ``to_arrow`` stores its value."""

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


@record(ScalarLayout())
@DATACLASS
class LengthStats(Record):
    """Summary of completion lengths for metrics."""

    min_length: float
    mean_length: float
    max_length: float
    clipped_ratio: float
    min_terminated: float
    mean_terminated: float
    max_terminated: float


@record(
    ScalarLayout(
        optional=("kl_value",),
        buckets=("kl_per_token_by_len_bucket", "kl_token_count_by_len_bucket"),
    )
)
@DATACLASS
class BatchDiagnostics(Record):
    """Additional scalar stats recorded for metrics.

    As in the seed, the ``clip_ratio*`` fields measure the policy-vs-reference log-ratio, not
    PPO clipping; the bucket dicts are keyed ``"0-32"``, ``"33-64"``, ``"65-128"``,
    ``"129-256"``, ``"257+"`` (empty buckets omitted).
    """

    kl_value: Optional[float]
    clip_ratio: float
    clip_ratio_low_mean: float
    clip_ratio_low_min: float
    clip_ratio_high_mean: float
    clip_ratio_high_max: float
    clip_ratio_region_mean: float
    kl_per_token_by_len_bucket: Dict[str, float]
    kl_token_count_by_len_bucket: Dict[str, float]


# ---------------------------------------------------------------------------- validation
@dataclass
class ValidationContext:
    """Handles required for the optional evaluation loop (live objects; no Arrow form)."""

    evaluation: EvaluationSettings
    accelerator: Any
    model: Any
    tokenizer: Any
    reward: RewardSpec
    generator: GenerationFn[Any]
    logging: LoggingHandles
    eval_reward: Optional[RewardSpec] = None
    runtime: Optional[RuntimeHandles] = None
    generation: Optional[GenerationSettings] = None
    scoring: Optional[ScoringSettings] = None
