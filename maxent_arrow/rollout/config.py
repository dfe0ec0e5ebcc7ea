"""``RunConfig``: the replay contract, stored as JSON with every step.

Everything a step was computed with, so that a replay recomputes it without the trainer: the
group math (reward weights, advantage scaling, q temperature and floor, τ, β, the weight
convention), the loss (mode, aggregation, clip settings), the lengths and the tokenizer. One
definition, written by the trainers (ours, and the TRL recorder) and read by
:func:`~maxent_arrow.rollout.recompute`, the offline re-scoring and the Ray recompute.

Settings of other trainers that have no field here travel in ``extra`` (JSON), so a config
written by a newer or foreign writer still loads. Older snapshots used ``scale_rewards`` as a
bool; it loads as ``"group"`` (True) or ``"none"`` (False).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from maxent_arrow.errors import SchemaError

__all__ = ["RunConfig", "ScaleRewards", "unique_names"]

# How advantages are scaled after the group mean is subtracted: by the group's std ("group",
# the GRPO paper and our default), by the std of the whole batch ("batch", TRL's option), or
# not at all ("none", Dr. GRPO).
ScaleRewards = Literal["group", "batch", "none"]
_SCALES = ("group", "batch", "none")
# How several reward functions make one advantage (TRL's ``multi_objective_aggregation``):
# weight and sum the raw rewards, then normalise ("sum_then_normalize", ours and TRL's
# default), or normalise each function's rewards per group first ("normalize_then_sum", GDPO).
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# A completion every reward function gave no value for (NaN in every reward column): its
# utility is the nansum 0 and it counts in its group ("zero", ours), or it is left out of the
# group's mean and std and gets advantage 0 ("exclude", TRL's "unscorable" rows).
_UNSCORABLE = ("zero", "exclude")


def unique_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` made unique, case-insensitively (DuckDB's identifiers are, and the views have
    one ``reward_<name>`` column per name): the first of each name keeps it, a later one gets
    the first free ``_1``, ``_2``... suffix. Stable: the same names give the same result."""
    taken: set[str] = set()
    out = []
    for name in names:
        candidate, n = name, 0
        while candidate.casefold() in taken:
            n += 1
            candidate = f"{name}_{n}"
        taken.add(candidate.casefold())
        out.append(candidate)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The settings of a run that a stored step depends on.

    Group math
        ``reward_names`` (unique in a run: two functions a trainer names alike, such as
        TRL's two ``<lambda>``, or ``Acc`` and ``acc``, become ``<lambda>`` and
        ``<lambda>_1``; the names as given stay in ``reward_functions``) and
        ``reward_weights`` (λ_j of ``total_utils``), ``scale_rewards``
        (:data:`ScaleRewards`), ``multi_objective_aggregation`` (``"sum_then_normalize"`` or
        ``"normalize_then_sum"``, TRL's option), ``unscorable`` (``"zero"``, or ``"exclude"``
        as TRL: a completion with no reward value at all is left out of its group's
        statistics and gets advantage 0), ``advantage_eps``, ``q_temperature`` (T_q), ``q_epsilon``
        (ε), ``tau`` (τ; ``None``: no MaxEnt weights), ``beta`` (β),
        ``weight_denominator`` (``"tau"`` or ``"tau+beta"``), ``len_norm_ref`` (ρ is the
        per-token mean R/T, else the raw sum R), ``length_reweight``.
    Loss
        ``mode`` (``"maxent"`` or ``"grpo"``), ``loss_type`` (``"bnpo"``, ``"dr_grpo"``,
        ``"grpo"``; a TRL run records its own, e.g. ``"dapo"``), ``use_clip_objective``,
        ``clip_eps_low``, ``clip_eps_high``, ``clip_objective_coef``.
    Generation and tokens
        ``num_generations`` (K), ``max_prompt_len``, ``max_completion_len``,
        ``gen_temperature``, ``top_p``, ``pad_token_id``, ``eos_token_id``, ``tokenizer``
        (name, vocabulary size, hash), ``model``.
    Training
        ``prompts_per_step``, ``learning_rate``, ``seed``, ``trainer`` (who wrote the step).
    ``extra``
        Anything else, JSON (another trainer's settings).
    """

    # group math
    reward_names: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    reward_functions: tuple[str, ...] = ()
    scale_rewards: ScaleRewards = "group"
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = (
        "sum_then_normalize"
    )
    unscorable: Literal["zero", "exclude"] = "zero"
    advantage_eps: float = 1e-4
    q_temperature: float = 1.0
    q_epsilon: float = 1e-6
    tau: float | None = None
    beta: float = 0.0
    weight_denominator: Literal["tau", "tau+beta"] = "tau"
    len_norm_ref: bool = True
    length_reweight: bool = False
    # loss
    mode: Literal["maxent", "grpo"] = "maxent"
    loss_type: str = "bnpo"
    use_clip_objective: bool = False
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_objective_coef: float = 1.0
    # generation and tokens
    num_generations: int = 8
    max_prompt_len: int = 32
    max_completion_len: int = 12
    gen_temperature: float = 1.0
    top_p: float = 1.0
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    tokenizer: Mapping[str, Any] | str = field(default_factory=dict)
    model: str | None = None
    # training
    prompts_per_step: int = 8
    learning_rate: float = 3e-3
    seed: int = 0
    trainer: str = "maxent-arrow"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        scale = self.scale_rewards
        if isinstance(scale, bool):  # the older bool spelling
            object.__setattr__(self, "scale_rewards", "group" if scale else "none")
        elif scale not in _SCALES:
            raise SchemaError(f"RunConfig.scale_rewards: expected one of {_SCALES}, got {scale!r}")
        if self.multi_objective_aggregation not in _AGGREGATIONS:
            raise SchemaError(
                f"RunConfig.multi_objective_aggregation: expected one of {_AGGREGATIONS}, got "
                f"{self.multi_objective_aggregation!r}"
            )
        if self.unscorable not in _UNSCORABLE:
            raise SchemaError(
                f"RunConfig.unscorable: expected one of {_UNSCORABLE}, got {self.unscorable!r}"
            )
        given = tuple(self.reward_names)
        object.__setattr__(self, "reward_names", unique_names(given))
        if self.reward_names != given and not self.reward_functions:
            object.__setattr__(self, "reward_functions", given)
        object.__setattr__(self, "reward_functions", tuple(self.reward_functions))
        object.__setattr__(self, "reward_weights", tuple(float(w) for w in self.reward_weights))
        if self.reward_weights and len(self.reward_weights) != len(self.reward_names):
            raise SchemaError(
                f"RunConfig.reward_weights: expected {len(self.reward_names)} weights (one per "
                f"reward name), got {len(self.reward_weights)}"
            )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the ``config`` column of the step table)."""
        out = dataclasses.asdict(self)
        out["reward_names"] = list(self.reward_names)
        out["reward_functions"] = list(self.reward_functions)
        out["reward_weights"] = list(self.reward_weights)
        if isinstance(self.tokenizer, Mapping):
            out["tokenizer"] = dict(self.tokenizer)
        out["extra"] = dict(self.extra)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str | bytes | None) -> RunConfig:
        """A ``RunConfig`` from a stored snapshot (a dict or its JSON text).

        Keys this class does not know go to ``extra``; a snapshot's ``reward_weights`` may be
        a list (in ``reward_names`` order) or a ``{name: λ}`` dict.
        """
        if data is None:
            return cls()
        if isinstance(data, str | bytes):
            try:
                data = json.loads(data or "{}")
            except ValueError as exc:
                raise SchemaError(f"RunConfig: unreadable JSON ({exc})") from None
        if not isinstance(data, Mapping):
            raise SchemaError(f"RunConfig: expected a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known and k != "extra"}
        extra = {
            **dict(data.get("extra") or {}),
            **{k: v for k, v in data.items() if k not in known},
        }
        weights = values.get("reward_weights")
        if isinstance(weights, Mapping):
            names = list(values.get("reward_names") or weights)
            values["reward_names"] = names
            values["reward_weights"] = [float(weights.get(n, 0.0)) for n in names]
        try:
            return cls(**values, extra=extra)
        except TypeError as exc:
            raise SchemaError(f"RunConfig: {exc}") from None

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes``; a name that is not a field is refused (a typo is not
        silently ignored)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise SchemaError(f"RunConfig: unknown settings {unknown}")
        return dataclasses.replace(self, **changes)

    @property
    def weights_by_name(self) -> dict[str, float]:
        """``{reward name: λ}``."""
        return dict(zip(self.reward_names, self.reward_weights))
