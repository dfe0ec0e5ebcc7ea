"""The settings and handle types that :class:`~maxent_arrow.types.rewards.ValidationContext` names.

They mirror the seed's ``training/types/runtime.py`` and ``training/types/logging.py`` closely
enough for an evaluation loop: plain dataclasses of live objects and numbers, no Arrow form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from maxent_arrow.errors import LayoutError

__all__ = [
    "EvaluationSettings",
    "GenerationFn",
    "GenerationSettings",
    "LoggingHandles",
    "RewardFn",
    "RewardSpec",
    "RuntimeHandles",
    "ScoringSettings",
]

T = TypeVar("T", covariant=True)

RewardFn = Callable[..., Sequence[float]]
"""A reward function: ``f(completions, answers, **kwargs) -> list[float]`` (one per completion)."""


class GenerationFn(Protocol, Generic[T]):
    """Generates ``num_samples`` completions per prompt: returns (grouped texts, grouped meta)."""

    def __call__(self, prompts: list[str], num_samples: int, *args: Any, **kwargs: Any) -> T: ...


@dataclass
class EvaluationSettings:
    """When and how much to evaluate."""

    enabled: bool = False
    rows: list[dict[str, str]] = field(default_factory=list)
    batch_size: int = 8
    every_n_steps: int | None = None
    seed_eval: int | None = None


@dataclass
class RewardSpec:
    """Reward functions and their weights (λ_j in ``U_i = Σ_j λ_j r_ij``)."""

    reward_funcs: list[RewardFn]
    reward_weights: list[float]
    reward_names: list[str] | None = None  # keys of per_reward_values (default: function names)

    def __post_init__(self) -> None:
        if len(self.reward_weights) != len(self.reward_funcs):
            raise LayoutError(
                f"RewardSpec.reward_weights: expected {len(self.reward_funcs)} weights (one per "
                f"reward function), got {len(self.reward_weights)}"
            )


@dataclass
class LoggingHandles:
    """Where metrics go: a ``log(metrics: dict, step: int)`` callable, and an optional store."""

    log_metrics: Callable[[dict[str, float], int], None] | None = None
    store: Any = None
    step: int = 0


@dataclass
class GenerationSettings:
    """Sampling settings of the generator."""

    max_prompt_len: int = 512
    max_completion_len: int = 256
    num_generations: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None


@dataclass
class ScoringSettings:
    """Teacher-forced scoring settings."""

    slice_size: int = 0
    score_tail_tokens: int | None = None
    pad_token_id: int | None = None
    temperature: float = 1.0


@dataclass
class RuntimeHandles:
    """Live objects of the run: device, reference model, prompt tokenization cache."""

    device: Any = None
    reference_model: Any = None
    prompt_cache_get: Callable[[str], Any] | None = None
