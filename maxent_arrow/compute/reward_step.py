"""The whole reward step, ``GenerationBatch`` -> ``RewardComputation`` (``docs/formulas.md``
§4.1 step 2), and the entropy-bonus update of step 5b.

The reward functions are the only per-sample Python: they take the flat lists of completion
and answer strings and return floats. Everything after that call works on Arrow arrays and
torch tensors: the truncation flags come from the completion-info struct columns, the
behaviour log-likelihoods from one Arrow JSON parse of the metadata, and the group math from
:mod:`maxent_arrow.compute.group_math`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import torch

from maxent_arrow import compute as C
from maxent_arrow.arrow import Ragged, arrow_to_torch, list_offsets, torch_to_arrow
from maxent_arrow.compute.seed_grpo import SeedGrpoSettings, SeedGrpoStats, seed_grpo_statistics
from maxent_arrow.errors import ComputeError, SchemaError
from maxent_arrow.types import (
    AdvantageStats,
    GenerationBatch,
    QDistribution,
    RewardComputation,
    SampleColumns,
    SeedColumns,
    rewards_batch,
    sample_messages,
)

__all__ = ["compute_rewards", "apply_entropy_bonus", "behavior_logprobs_from_meta"]

# Keys under which the original's metadata carried the sequence log-prob and token count
# (``docs/seed-bugs.md`` §2: the same quantity under several names), in order of precedence.
_SUM_KEYS = ("logprob_sum", "cumulative_logprob", "logprob")
_COUNT_KEYS = ("token_count", "num_tokens")


def _column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    index = batch.schema.get_field_index(name)
    return None if index < 0 else batch.column(index)


def _grouped_arrow(ragged: Ragged) -> pa.Array:
    return (
        ragged.to(torch.device("cpu")).to_arrow()
        if ragged.device.type != "cpu"
        else (ragged.to_arrow())
    )


def _call_reward(j: int, fn: Any, completions: list[str], answers: list[str]) -> np.ndarray:
    name = getattr(fn, "__name__", type(fn).__name__)
    values = fn(completions, answers)
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().to(torch.float64).numpy()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise SchemaError(
            f"compute_rewards: reward function {j} ({name}) returned {type(values).__name__}, "
            "expected a list of floats"
        )
    if len(values) != len(completions):
        raise ComputeError(
            f"compute_rewards: reward function {j} ({name}) returned {len(values)} values, "
            f"expected {len(completions)} (one per completion)"
        )
    try:
        # None (a reward that does not apply) becomes NaN, which U counts as 0 (§3.1).
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.ndim != 1:
        for i, v in enumerate(values):  # only on the error path, to name the sample
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
                raise SchemaError(
                    f"compute_rewards: reward function {j} ({name}) returned {v!r} at sample "
                    f"{i}, expected a float"
                )
        raise SchemaError(f"compute_rewards: reward function {j} ({name}) returned non-floats")
    return array


def _truncated(info: pa.Array | None, max_completion_len: int | None) -> pa.Array | None:
    """``truncated | finish_reason == "length" | token_count >= max_completion_len`` per sample
    (``info``: the ``completion_info`` column, one list of structs per group)."""
    if info is None:
        return None
    flat = info.flatten()
    if not isinstance(flat, pa.StructArray):
        return None
    # The info column may be a slice of a larger batch; struct_field honours its offset.
    flags = pc.fill_null(pc.struct_field(flat, "truncated"), False)
    reason = pc.struct_field(flat, "finish_reason")
    flags = pc.or_(flags, pc.fill_null(pc.equal(reason, "length"), False))
    if max_completion_len is not None:
        hit = pc.greater_equal(pc.struct_field(flat, "token_count"), max_completion_len)
        flags = pc.or_(flags, pc.fill_null(hit, False))
    # A null info row (no metadata for that completion) is not truncated.
    return pc.fill_null(flags, False)


def behavior_logprobs_from_meta(meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour (generation) log-prob sums and token counts from the JSON metadata.

    ``meta``: JSON texts, flat ``[N]`` or grouped (a ``list<string>`` array such as the
    ``ref_meta`` column), or a ``GenerationBatch`` (its ``grouped_ref_meta``). One Arrow JSON
    parse of all entries (no per-sample ``json.loads``). The sum is the first of
    ``logprob_sum``, ``cumulative_logprob``, ``logprob``, else the sum of ``token_logprobs``;
    the count ``token_count``, ``num_tokens``, else the length of ``token_logprobs``. Missing
    values are NaN. Returns float64 ``[N]`` tensors.
    """
    if isinstance(meta, GenerationBatch):
        meta = meta.column("ref_meta")
    if isinstance(meta, pa.ChunkedArray):
        meta = meta.combine_chunks()
    if isinstance(meta, pa.Array) and (
        pa.types.is_list(meta.type) or pa.types.is_large_list(meta.type)
    ):
        meta = meta.flatten()
    if not isinstance(meta, pa.Array) or not pa.types.is_string(meta.type):
        raise SchemaError("behavior_logprobs_from_meta: expected JSON metadata text")
    n = len(meta)
    if n == 0:
        return torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64)
    text = pc.fill_null(pc.if_else(pc.equal(meta, "null"), "{}", meta), "{}")
    lines = pc.binary_join_element_wise(text, pa.scalar(""), "\n")
    _, offsets, data = lines.buffers()
    bounds = np.frombuffer(offsets, dtype=np.int32)[lines.offset : lines.offset + n + 1]
    body = data[int(bounds[0]) : int(bounds[-1])]
    fields = [(k, pa.float64()) for k in _SUM_KEYS] + [(k, pa.float64()) for k in _COUNT_KEYS]
    table, error = None, None
    # Try with the per-token list first; metadata whose `token_logprobs` holds non-numbers
    # (raw vLLM objects) parses without it.
    for extra in ([("token_logprobs", pa.list_(pa.float64()))], []):
        options = pj.ParseOptions(
            explicit_schema=pa.schema(fields + extra), unexpected_field_behavior="ignore"
        )
        try:
            table = pj.read_json(pa.BufferReader(body), parse_options=options)
            break
        except pa.ArrowInvalid as exc:
            error = exc
    if table is None:
        raise SchemaError(f"behavior_logprobs_from_meta: unreadable metadata ({error})")
    if table.num_rows != n:
        raise SchemaError(
            f"behavior_logprobs_from_meta: expected {n} metadata objects, parsed {table.num_rows}"
        )
    total = pc.coalesce(*(table.column(k) for k in _SUM_KEYS))
    count = pc.coalesce(*(table.column(k) for k in _COUNT_KEYS))
    if "token_logprobs" in table.column_names:
        tokens = table.column("token_logprobs").combine_chunks()
        sums = _list_sums(tokens)
        total = pc.coalesce(total, pa.array(sums, mask=np.asarray(tokens.is_null())))
        count = pc.coalesce(count, pc.cast(pc.list_value_length(tokens), pa.float64()))

    def tensor(column: pa.ChunkedArray) -> torch.Tensor:
        array = pc.fill_null(column, math.nan).combine_chunks()
        return arrow_to_torch(pc.cast(array, pa.float64()))

    return tensor(total), tensor(count)


def _list_sums(tokens: pa.Array) -> np.ndarray:
    lengths = np.asarray(pc.fill_null(pc.list_value_length(tokens), 0), dtype=np.int64)
    values = arrow_to_torch(pc.fill_null(tokens.flatten(), math.nan)).to(torch.float64)
    bounds = torch.zeros(lengths.size + 1, dtype=torch.int64)
    torch.cumsum(torch.from_numpy(lengths), 0, out=bounds[1:])
    sums = torch.segment_reduce(values, "sum", offsets=bounds, unsafe=True, initial=0)
    return sums.numpy()


def compute_rewards(
    generation_batch: GenerationBatch,
    reward_funcs: Sequence[Any],
    *,
    weights: Sequence[float],
    reward_names: Sequence[str] | None = None,
    scale_rewards: bool = True,
    q_temperature: float = 1.0,
    q_epsilon: float = 1e-6,
    zero_truncated_completion_rewards: bool = False,
    max_completion_len: int | None = None,
    seed_grpo: SeedGrpoSettings | None = None,
    device: torch.device | str | None = None,
) -> RewardComputation:
    """Rewards, utilities, moments, advantages (SEED-scaled), q: ``RewardComputation`` (§3.1-3.4).

    Parameters
    ----------
    generation_batch:
        P prompt groups of completions.
    reward_funcs:
        ``f(completions, answers) -> list[float]`` over the N flat completions and their
        answers (each prompt's answer repeated K times). ``None`` entries count as NaN.
    weights:
        ``λ_j`` per function.
    reward_names:
        Keys of ``per_reward_values`` (default ``reward_0``, ``reward_1``, ... as the seed).
    zero_truncated_completion_rewards, max_completion_len:
        Set ``U_i = 0`` for completions flagged truncated, with ``finish_reason == "length"``,
        or with ``token_count >= max_completion_len`` in their completion info.
    seed_grpo:
        Enable SEED-GRPO scaling (needs ``grouped_ref_meta`` with log-prob sums and counts).
    device:
        Where the group math runs (default CPU); the record's lists are Arrow on the host.
    """
    gen = generation_batch.to_arrow()  # checked here; the record's own batch when Arrow-born
    group_offsets = _group_offsets(gen)
    names = _reward_names(reward_funcs, weights, reward_names)
    device = torch.device(device) if device is not None else torch.device("cpu")
    offsets = torch.from_numpy(group_offsets).to(device)
    inputs = _RewardInputs.of(gen, generation_batch, group_offsets)
    raw = {
        name: torch.from_numpy(_call_reward(j, fn, inputs.completions, inputs.answers))
        for j, (name, fn) in enumerate(zip(names, reward_funcs))
    }
    truncated = None
    if zero_truncated_completion_rewards:
        flags = _truncated(inputs.info, max_completion_len)
        if flags is not None:
            truncated = torch.from_numpy(np.asarray(flags.to_numpy(zero_copy_only=False)))
    utils = C.total_utils(
        {k: v.to(device) for k, v in raw.items()},
        list(weights),
        truncated=None if truncated is None else truncated.to(device),
        offsets=offsets,
    )
    samples = inputs.samples(
        gen,
        total_utils=torch_to_arrow(utils.values),
        rewards={k: torch_to_arrow(v) for k, v in raw.items()},
    )
    return _assemble(
        utils,
        samples,
        scale_rewards=scale_rewards,
        q_temperature=q_temperature,
        q_epsilon=q_epsilon,
        seed=_seed_statistics(gen, inputs, seed_grpo, offsets, device),
    )


def _seed_columns(seed: SeedGrpoStats) -> SeedColumns:
    """SEED-GRPO's results as the RewardComputation record batch holds them: the per-group
    columns and the two scalars."""
    return SeedColumns(
        semantic_entropy=torch_to_arrow(seed.semantic_entropy.cpu()),
        advantage_scale=torch_to_arrow(seed.scales.cpu()),
        alpha_effective=seed.alpha_effective,
        max_possible_entropy=seed.max_possible_entropy,
    )


def _group_offsets(gen: pa.RecordBatch) -> np.ndarray:
    """The groups' offsets into the flat completions; an empty batch or group is refused."""
    grouped = gen.column("completions")
    if len(grouped) == 0:
        raise ComputeError("compute_rewards: generation_batch: expected at least one group, got 0")
    offsets = list_offsets(grouped)
    sizes = np.diff(offsets)
    if (sizes == 0).any():
        g = int(np.flatnonzero(sizes == 0)[0])
        raise ComputeError(
            f"compute_rewards: generation_batch.grouped_completions: group {g} is empty (size 0)"
        )
    return offsets


def _reward_names(
    reward_funcs: Sequence[Any], weights: Sequence[float], reward_names: Sequence[str] | None
) -> list[str]:
    """One distinct name and one weight per reward function (names default as the seed's)."""
    if len(weights) != len(reward_funcs):
        raise ComputeError(
            f"compute_rewards: weights: expected {len(reward_funcs)} (one per reward function), "
            f"got {len(weights)}"
        )
    names = (
        list(reward_names)
        if reward_names is not None
        else [f"reward_{j}" for j in range(len(reward_funcs))]
    )
    if len(names) != len(reward_funcs) or len(set(names)) != len(names):
        raise ComputeError(
            f"compute_rewards: reward_names: expected {len(reward_funcs)} distinct names, got "
            f"{names!r}"
        )
    return names


@dataclass(frozen=True)
class _RewardInputs:
    """What the reward functions see (flat completions and answers, each prompt's answer
    repeated K times) and the flat columns the result is built from."""

    completions_arrow: pa.Array
    group_of_sample: pa.Array
    messages: pa.Array | None
    completions: list
    answers: list
    info: pa.Array | None

    @classmethod
    def of(cls, gen: pa.RecordBatch, gb: GenerationBatch, offsets: np.ndarray) -> _RewardInputs:
        grouped = gen.column("completions")
        sizes = np.diff(offsets)
        group_of_sample = pa.array(np.repeat(np.arange(len(grouped), dtype=np.int32), sizes))
        messages = sample_messages(_column(gen, "completion_messages"), offsets)
        completions_arrow = grouped.flatten()
        if messages is None:
            completions = completions_arrow.to_pylist()
        else:  # chat completions reach the reward functions as message lists, as in the seed
            completions = [c for group in gb.grouped_completions for c in group]
        answers = gen.column("answer").take(group_of_sample).to_pylist()
        info = _column(gen, "completion_info")
        return cls(completions_arrow, group_of_sample, messages, completions, answers, info)

    def samples(
        self, gen: pa.RecordBatch, *, total_utils: pa.Array, rewards: dict[str, pa.Array]
    ) -> SampleColumns:
        """The flat ``[N]`` columns of the ``RewardComputation``: the prompt/completion pairs
        of ``pairs`` (the completion info their metadata, and ``completion_metadata`` the
        same object, as in the seed), the utilities, the per-reward values, the ref meta."""
        prompt_messages = _column(gen, "prompt_messages")
        return SampleColumns(
            total_utils=total_utils,
            # Each group's prompt for its samples: a dictionary over the group prompts.
            prompts=pa.DictionaryArray.from_arrays(self.group_of_sample, gen.column("prompt")),
            completions=self.completions_arrow,
            rewards=rewards,
            prompt_messages=None
            if prompt_messages is None
            else prompt_messages.take(self.group_of_sample),
            completion_messages=self.messages,
            pairs_metadata=None if self.info is None else self.info.flatten(),
            ref_meta=_flat_ref_meta(_column(gen, "ref_meta")),
            completion_metadata_is_pairs_metadata=self.info is not None,
        )


def _seed_statistics(
    gen: pa.RecordBatch,
    inputs: _RewardInputs,
    settings: SeedGrpoSettings | None,
    offsets: torch.Tensor,
    device: torch.device,
):
    """SEED-GRPO statistics when enabled (they need the ref meta's log-prob sums)."""
    if settings is None:
        return None
    ref_meta = _column(gen, "ref_meta")
    if ref_meta is None:
        raise ComputeError(
            "compute_rewards: seed_grpo needs generation_batch.grouped_ref_meta (log-prob "
            "sums and token counts), got None"
        )
    lp, count = behavior_logprobs_from_meta(ref_meta)
    return seed_grpo_statistics(
        inputs.completions_arrow,
        lp.to(device),
        count.to(device),
        offsets=offsets,
        settings=settings,
    )


def _flat_ref_meta(grouped: pa.Array | None) -> pa.Array | None:
    if grouped is None:
        return None
    flat = grouped.flatten()
    # The seed sets ref_logprob_meta to None when no entry carries a payload.
    if flat.null_count == len(flat) or pc.all(pc.equal(flat, "null")).as_py():
        return None
    return flat


def _advantages_and_q(
    utils: Ragged,
    *,
    scale_rewards: bool,
    q_temperature: float,
    q_epsilon: float,
    seed_scales: torch.Tensor | None,
):
    moments = C.reward_moments(utils)
    adv = C.group_advantages(utils, scale_rewards=scale_rewards)
    if seed_scales is not None:
        adv = C.apply_group_scales(adv, seed_scales)
    q = C.q_distribution(utils, temperature=q_temperature, epsilon=q_epsilon)
    return moments, _grouped_arrow(adv), _grouped_arrow(q)


def _assemble(
    utils: Ragged,
    samples: SampleColumns,
    *,
    scale_rewards: bool,
    q_temperature: float,
    q_epsilon: float,
    seed: SeedGrpoStats | None,
) -> RewardComputation:
    """The ``RewardComputation``, Arrow-born: its lists are made only when read."""
    moments, adv_arrow, q_arrow = _advantages_and_q(
        utils,
        scale_rewards=scale_rewards,
        q_temperature=q_temperature,
        q_epsilon=q_epsilon,
        seed_scales=None if seed is None else seed.scales,
    )
    batch = rewards_batch(
        advantages=adv_arrow,
        q=q_arrow,
        samples=samples,
        moments=(moments.mean, moments.std),
        seed=None if seed is None else _seed_columns(seed),
    )
    return RewardComputation.from_arrow(batch)


def apply_entropy_bonus(
    reward_computation: RewardComputation,
    policy_entropy_sum: Any,
    token_counts: Any,
    *,
    coef: float,
    scale_rewards: bool = True,
    q_temperature: float = 1.0,
    q_epsilon: float = 1e-6,
) -> RewardComputation:
    """The policy-entropy bonus of §3.5, as a new ``RewardComputation``.

    ``U <- U + c σ_R z``; moments, advantages (SEED scales re-applied) and q are recomputed
    from the new U; ``per_reward_values`` gains ``policy_entropy_group_zscore``,
    ``policy_entropy_per_token`` and ``entropy_bonus``; ``entropy_bonus_scale`` is σ_R. With
    ``coef == 0`` the input is returned unchanged, as the original skips the step.
    """
    rc = reward_computation
    if coef == 0:
        return rc
    batch = rc.to_arrow()  # checked; the record's own batch while it is untouched
    offsets = torch.from_numpy(list_offsets(batch.column("advantages")))
    total = batch.column("total_utils").flatten()
    utils = Ragged(arrow_to_torch(total).to(torch.float64), offsets, validate=False)
    bonus = C.entropy_bonus(
        utils, policy_entropy_sum, token_counts, coef=coef, reward_std=rc.moments.std
    )
    scales = _column(batch, "seed_advantage_scale")
    new_utils = Ragged(bonus.utils.values.cpu(), offsets, validate=False)
    moments, adv_arrow, q_arrow = _advantages_and_q(
        new_utils,
        scale_rewards=scale_rewards,
        q_temperature=q_temperature,
        q_epsilon=q_epsilon,
        seed_scales=None if scales is None else arrow_to_torch(scales),
    )
    per_reward = dict(rc.per_reward_values)
    per_reward["policy_entropy_group_zscore"] = bonus.zscore.values.cpu().tolist()
    per_reward["policy_entropy_per_token"] = bonus.per_token.values.cpu().tolist()
    per_reward["entropy_bonus"] = bonus.bonus.values.cpu().tolist()
    # Pairs, metadata and the SEED fields are carried over as they are (still in Arrow when
    # they were never read: `replace` does not read the fields it keeps).
    return dataclasses.replace(
        rc,
        total_utils=new_utils.values.tolist(),
        per_reward_values=per_reward,
        advantage=AdvantageStats.from_arrow(pa.record_batch({"advantages": adv_arrow})),
        q_distribution=QDistribution.from_arrow(pa.record_batch({"q": q_arrow})),
        moments=moments,
        entropy_bonus_scale=bonus.scale,
    )
