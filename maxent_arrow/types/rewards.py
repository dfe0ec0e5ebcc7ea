"""The 15 per-batch dataclasses of ``maxent_grpo.training.types.rewards``, over Arrow.

Names, fields, field order, defaults and properties are the seed's (see
``reference/seed_types_rewards_api.txt``), so code written against that module keeps working.
They are real dataclasses (``dataclasses.fields`` and ``replace`` work), constructible from the
seed's Python types. Each value is normalised when it is assigned (in ``__init__`` or later, as
the original pipeline reassigns fields in place):

- list fields hold Arrow-backed read-only views (:mod:`maxent_arrow.arrow.sequences`);
- ``grouped`` and ``samples`` pairs are one Arrow list array and its flattened child;
- tensor fields keep the tensors given (gradients included).

Every class but ``ValidationContext`` has ``to_arrow()`` and ``from_arrow()``; tensors pass
through ``.detach().cpu()`` and come back as zero-copy tensors. The Arrow layouts are in
:mod:`maxent_arrow.types.records`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import pyarrow as pa
from torch import Tensor

from maxent_arrow.errors import LayoutError
from maxent_arrow.types import fields as F
from maxent_arrow.types.base import (
    _ensure_prompt_entries,
    _float_vector,
    _GroupedPair,
    _ids_matrix,
    _matrix,
    _opt,
    _opt_float,
    _Record,
    _TensorRecord,
    _typed,
    _vector,
)

# Imported at run time (not under TYPE_CHECKING) so that `typing.get_type_hints` resolves every
# class's annotations, as it does on the seed's module; both imports are already loaded.
from maxent_arrow.types.settings import (
    EvaluationSettings,
    GenerationFn,
    GenerationSettings,
    LoggingHandles,
    RewardSpec,
    RuntimeHandles,
    ScoringSettings,
)

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


# ---------------------------------------------------------------------------- PromptCacheEntry
@dataclass(eq=False)
class PromptCacheEntry(_Record):
    """Cached prompt tokenization used during scoring."""

    input_ids: list[int]
    attention_mask: list[int]

    _convert: ClassVar[dict] = {
        "input_ids": F.ensure_token_list,
        "attention_mask": lambda field, value: F.ensure_token_list(field, value, kind=pa.int8()),
    }

    def __post_init__(self) -> None:
        if len(self.attention_mask) != len(self.input_ids):
            raise LayoutError(
                f"PromptCacheEntry.attention_mask: expected {len(self.input_ids)} entries "
                f"(as input_ids), got {len(self.attention_mask)}"
            )

    @property
    def length(self) -> int:
        """Return cached prompt length."""
        return len(self.input_ids)


# ---------------------------------------------------------------------------- generation
@dataclass(eq=False)
class GenerationBatch(_Record):
    """Completions grouped per prompt after filtering."""

    prompts: list[str]
    answers: list[str]
    grouped_completions: list[list[str]]
    grouped_ref_meta: list[list[Any | None]] | None
    grouped_completion_info: list[list[dict[str, Any]]] | None = None

    _convert: ClassVar[dict] = {
        "prompts": F.ensure_str_list,
        "answers": F.ensure_str_list,
        "grouped_completions": F.ensure_grouped_strings,
        "grouped_ref_meta": F.ensure_grouped_json,
        "grouped_completion_info": F.ensure_grouped_info,
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check that prompts, answers and every per-completion field agree per group."""
        if len(self.answers) != len(self.prompts):
            raise LayoutError(
                f"GenerationBatch.answers: expected {len(self.prompts)} answers (one per "
                f"prompt), got {len(self.answers)}"
            )
        if len(self.grouped_completions) != len(self.prompts):
            raise LayoutError(
                f"GenerationBatch.grouped_completions: expected {len(self.prompts)} groups (one "
                f"per prompt), got {len(self.grouped_completions)}"
            )
        F.check_same_groups(
            "GenerationBatch",
            "grouped_completions",
            self.grouped_completions,
            {
                "grouped_ref_meta": self.grouped_ref_meta,
                "grouped_completion_info": self.grouped_completion_info,
            },
        )


@dataclass(eq=False)
class PromptCompletionBatch(_Record):
    """Flattened prompt/completion pairs."""

    prompts: list[str]
    completions: list[str]
    metadata: list[dict[str, Any]] | None = None

    _convert: ClassVar[dict] = {
        "prompts": F.ensure_str_list,
        "completions": F.ensure_str_list,
        "metadata": F.ensure_info_list,
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        n = len(self.prompts)
        for name in ("completions", "metadata"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise LayoutError(
                    f"PromptCompletionBatch.{name}: expected {n} entries (one per prompt), "
                    f"got {len(value)}"
                )


# ---------------------------------------------------------------------------- grouped pairs
@dataclass(eq=False)
class AdvantageStats(_GroupedPair):
    """Grouped and flattened advantages."""

    grouped: list[list[float]]
    samples: list[float]


@dataclass(eq=False)
class QDistribution(_GroupedPair):
    """Sequence-level q-distribution."""

    grouped: list[list[float]]
    samples: list[float]


@dataclass(eq=False)
class RewardMoments(_Record):
    """Summary statistics for sequence rewards."""

    mean: float
    std: float

    _convert: ClassVar[dict] = {"mean": F.ensure_float, "std": F.ensure_float}


@dataclass(eq=False)
class RewardComputation(_Record):
    """Utility values and statistics computed per batch."""

    total_utils: list[float]
    per_reward_values: dict[str, list[float]]
    advantage: AdvantageStats
    pairs: PromptCompletionBatch
    q_distribution: QDistribution
    moments: RewardMoments
    ref_logprob_meta: list[Any | None] | None = None
    completion_metadata: list[dict[str, Any]] | None = None
    entropy_bonus_scale: float | None = None
    seed_semantic_entropies: list[float] | None = None
    seed_advantage_scales: list[float] | None = None
    seed_alpha_effective: float | None = None
    seed_max_possible_entropy: float | None = None

    _convert: ClassVar[dict] = {
        "total_utils": F.ensure_float_list,
        "per_reward_values": F.ensure_column_dict,
        "advantage": _typed(AdvantageStats),
        "pairs": _typed(PromptCompletionBatch),
        "q_distribution": _typed(QDistribution),
        "moments": _typed(RewardMoments),
        "ref_logprob_meta": F.ensure_json_list,
        "completion_metadata": F.ensure_info_list,
        "entropy_bonus_scale": _opt_float,
        "seed_semantic_entropies": lambda f, v: F.ensure_float_list(f, v, optional=True),
        "seed_advantage_scales": lambda f, v: F.ensure_float_list(f, v, optional=True),
        "seed_alpha_effective": _opt_float,
        "seed_max_possible_entropy": _opt_float,
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every ``[N]`` field has N entries, every ``[P]`` field P, and q matches the groups."""
        n = len(self.total_utils)
        per_sample = {
            "advantage.samples": self.advantage.samples,
            "q_distribution.samples": self.q_distribution.samples,
            "pairs.prompts": self.pairs.prompts,
            "ref_logprob_meta": self.ref_logprob_meta,
            "completion_metadata": self.completion_metadata,
            **{f"per_reward_values[{k!r}]": v for k, v in self.per_reward_values.items()},
        }
        for name, value in per_sample.items():
            if value is not None and len(value) != n:
                raise LayoutError(
                    f"RewardComputation.{name}: expected {n} values (one per sample, as "
                    f"total_utils), got {len(value)}"
                )
        F.check_same_groups(
            "RewardComputation",
            "advantage.grouped",
            self.advantage.grouped,
            {"q_distribution.grouped": self.q_distribution.grouped},
        )
        groups = len(self.advantage.grouped)
        for name in ("seed_semantic_entropies", "seed_advantage_scales"):
            value = getattr(self, name)
            if value is not None and len(value) != groups:
                raise LayoutError(
                    f"RewardComputation.{name}: expected {groups} values (one per group), "
                    f"got {len(value)}"
                )

    @property
    def advantage_samples(self) -> list[float]:
        """Return flattened advantage samples for logging."""
        return self.advantage.samples

    @property
    def q_grouped(self) -> list[list[float]]:
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
@dataclass(eq=False)
class ScoreBatch(_TensorRecord):
    """Prompt cache entries and completion tokens ready for scoring.

    In Arrow, ``completion_ids`` is stored ragged: each row keeps the tokens its attention mask
    marks (the mask must be ones then zeros) and comes back right-padded with ``pad_token_id``.
    """

    prompt_entries: list[PromptCacheEntry]
    completion_ids: Tensor
    completion_attention_mask: Tensor
    pad_token_id: int
    max_prompt_len: int
    slice_size: int
    total_sequences: int
    score_tail_tokens: int | None = None

    _convert: ClassVar[dict] = {
        "prompt_entries": _ensure_prompt_entries,
        "completion_ids": _ids_matrix,
        "completion_attention_mask": lambda f, v: F.ensure_tensor(f, v, ndim=2, kind="int"),
        "pad_token_id": lambda f, v: F.ensure_int(f, v, minimum=0),
        "max_prompt_len": lambda f, v: F.ensure_int(f, v, minimum=0),
        "slice_size": lambda f, v: F.ensure_int(f, v, minimum=1),
        "total_sequences": lambda f, v: F.ensure_int(f, v, minimum=0),
        "score_tail_tokens": lambda f, v: F.ensure_int(f, v, optional=True, minimum=0),
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        ids, mask = self.completion_ids, self.completion_attention_mask
        if tuple(mask.shape) != tuple(ids.shape):
            raise LayoutError(
                f"ScoreBatch.completion_attention_mask: expected shape {tuple(ids.shape)} (as "
                f"completion_ids), got {tuple(mask.shape)}"
            )
        if len(self.prompt_entries) != ids.shape[0]:
            raise LayoutError(
                f"ScoreBatch.prompt_entries: expected {ids.shape[0]} entries (one per row of "
                f"completion_ids), got {len(self.prompt_entries)}"
            )
        if self.total_sequences != ids.shape[0]:
            raise LayoutError(
                f"ScoreBatch.total_sequences: expected {ids.shape[0]} (rows of completion_ids), "
                f"got {self.total_sequences}"
            )


@dataclass(eq=False)
class SequenceScores(_TensorRecord):
    """Bundle sequence-level log-prob statistics.

    ``cur_logp_sum`` keeps its gradient here; ``to_arrow`` stores a detached copy. Per-token
    tensors (``token_logp``, ``old_token_logp``) are stored ragged by ``token_mask``.
    """

    cur_logp_sum: Any
    behavior_logp_sum: Any
    log_ratio_train: Any
    denom_tok_tensor: Any
    pooled_hidden: Any | None = None
    policy_entropy_sum: Any | None = None
    token_logp: Any | None = None
    token_mask: Any | None = None
    old_token_logp: Any | None = None

    _convert: ClassVar[dict] = {
        "cur_logp_sum": _float_vector,
        "behavior_logp_sum": _float_vector,
        "log_ratio_train": _float_vector,
        "denom_tok_tensor": _float_vector,
        "pooled_hidden": _opt(lambda f, v: F.ensure_tensor(f, v, ndim=2, kind="float")),
        "policy_entropy_sum": _opt(_float_vector),
        "token_logp": _opt(lambda f, v: F.ensure_tensor(f, v, ndim=2, kind="float")),
        "token_mask": _opt(_matrix),
        "old_token_logp": _opt(lambda f, v: F.ensure_tensor(f, v, ndim=2, kind="float")),
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        n = self.cur_logp_sum.shape[0]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value.shape[0] != n:
                raise LayoutError(
                    f"SequenceScores.{f.name}: expected {n} rows (as cur_logp_sum), got "
                    f"{value.shape[0]}"
                )
        shape = None if self.token_logp is None else tuple(self.token_logp.shape)
        for name in ("token_mask", "old_token_logp"):
            value = getattr(self, name)
            if value is not None and shape is not None and tuple(value.shape) != shape:
                raise LayoutError(
                    f"SequenceScores.{name}: expected shape {shape} (as token_logp), got "
                    f"{tuple(value.shape)}"
                )


@dataclass(eq=False)
class ReferenceLogprobs(_TensorRecord):
    """Reference-model log-prob summaries.

    As in the seed, ``ref_logp_sum`` is a per-token mean (R_i / max(T_i, 1)) despite its name,
    ``ref_logp_sum_raw`` the sum R_i, and ``ref_logp_mean`` the mean of the raw sums.
    """

    ref_logp_sum: Any
    ref_tok_counts: Any
    ref_logp_sum_raw: Any
    ref_logp_mean: float
    avg_completion_tokens: float
    ref_token_logp: Any | None = None
    ref_token_mask: Any | None = None

    _convert: ClassVar[dict] = {
        "ref_logp_sum": _float_vector,
        "ref_tok_counts": _vector,
        "ref_logp_sum_raw": _float_vector,
        "ref_logp_mean": F.ensure_float,
        "avg_completion_tokens": F.ensure_float,
        "ref_token_logp": _opt(lambda f, v: F.ensure_tensor(f, v, ndim=2, kind="float")),
        "ref_token_mask": _opt(_matrix),
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        n = self.ref_logp_sum.shape[0]
        for name in ("ref_tok_counts", "ref_logp_sum_raw", "ref_token_logp", "ref_token_mask"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != n:
                raise LayoutError(
                    f"ReferenceLogprobs.{name}: expected {n} rows (as ref_logp_sum), got "
                    f"{value.shape[0]}"
                )
        if self.ref_token_logp is not None and self.ref_token_mask is not None:
            if self.ref_token_mask.shape != self.ref_token_logp.shape:
                raise LayoutError(
                    f"ReferenceLogprobs.ref_token_mask: expected shape "
                    f"{tuple(self.ref_token_logp.shape)} (as ref_token_logp), got "
                    f"{tuple(self.ref_token_mask.shape)}"
                )


# ---------------------------------------------------------------------------- loss
@dataclass(eq=False)
class LossScalarBundle(_Record):
    """Scalar contributions tracked for logging."""

    total_loss: float
    policy_loss: float
    clip_loss: float | None
    kl_loss: float
    weighted_kl_loss: float

    _convert: ClassVar[dict] = {
        "total_loss": F.ensure_float,
        "policy_loss": F.ensure_float,
        "clip_loss": _opt_float,
        "kl_loss": F.ensure_float,
        "weighted_kl_loss": F.ensure_float,
    }


@dataclass(eq=False)
class LossOutputs(_TensorRecord):
    """Loss terms computed for a batch. ``loss`` keeps its graph; ``to_arrow`` stores its value."""

    loss: Any
    scalars: LossScalarBundle
    log_ratio_train: Any
    denom_tok_tensor: Any

    _convert: ClassVar[dict] = {
        "loss": lambda f, v: F.ensure_tensor(f, v, ndim=0, kind="float"),
        "scalars": _typed(LossScalarBundle),
        "log_ratio_train": _float_vector,
        "denom_tok_tensor": _float_vector,
    }

    @property
    def total_loss_scalar(self) -> float:
        """Convenience accessor for the total loss scalar."""
        return self.scalars.total_loss

    @property
    def policy_loss_scalar(self) -> float:
        """Convenience accessor for the policy loss scalar."""
        return self.scalars.policy_loss

    @property
    def clip_loss_scalar(self) -> float | None:
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


@dataclass(eq=False)
class LengthStats(_Record):
    """Summary of completion lengths for metrics."""

    min_length: float
    mean_length: float
    max_length: float
    clipped_ratio: float
    min_terminated: float
    mean_terminated: float
    max_terminated: float

    _convert: ClassVar[dict] = {
        name: F.ensure_float
        for name in (
            "min_length",
            "mean_length",
            "max_length",
            "clipped_ratio",
            "min_terminated",
            "mean_terminated",
            "max_terminated",
        )
    }


@dataclass(eq=False)
class BatchDiagnostics(_Record):
    """Additional scalar stats recorded for metrics.

    As in the seed, the ``clip_ratio*`` fields measure the policy-vs-reference log-ratio, not
    PPO clipping; the bucket dicts are keyed ``"0-32"``, ``"33-64"``, ``"65-128"``,
    ``"129-256"``, ``"257+"`` (empty buckets omitted).
    """

    kl_value: float | None
    clip_ratio: float
    clip_ratio_low_mean: float
    clip_ratio_low_min: float
    clip_ratio_high_mean: float
    clip_ratio_high_max: float
    clip_ratio_region_mean: float
    kl_per_token_by_len_bucket: dict[str, float]
    kl_token_count_by_len_bucket: dict[str, float]

    _convert: ClassVar[dict] = {
        "kl_value": _opt_float,
        **{
            name: F.ensure_float
            for name in (
                "clip_ratio",
                "clip_ratio_low_mean",
                "clip_ratio_low_min",
                "clip_ratio_high_mean",
                "clip_ratio_high_max",
                "clip_ratio_region_mean",
            )
        },
        "kl_per_token_by_len_bucket": F.ensure_float_dict,
        "kl_token_count_by_len_bucket": F.ensure_float_dict,
    }


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
    eval_reward: RewardSpec | None = None
    runtime: RuntimeHandles | None = None
    generation: GenerationSettings | None = None
    scoring: ScoringSettings | None = None
