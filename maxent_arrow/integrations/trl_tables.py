"""The group rows of a TRL generation round, from TRL's output dict (:mod:`.trl_contract`).

What a round of one process holds (the group layout of ``docs/arrow-layout.md``):

- one row per prompt group part (TRL's ``num_generations`` completions of a prompt, or the
  part of them this process holds), with a run-wide ``group_id``
  (``"{step}.{round}.{group}"``: the group's place in the round's global generation batch),
  ``group_size`` (the whole group's K) and each completion's ``completion_index`` in it;
- ``prompt_ids`` and ``completion_ids``: the exact tokens TRL trained on, un-padded with its
  masks (``completion_ids`` include the EOS token); ``prompt`` (plain text) or
  ``prompt_messages`` (a chat prompt, typed messages), ``completions`` (text) and, for chat,
  ``completion_messages``; ``answer`` when the dataset has an ``answer`` column (text, or any
  JSON value as its JSON text); ``example_id`` (the dataset index, or ``example_id=``'s
  column) and ``ds_<name>`` for each of ``record_columns`` (the dataset's Arrow types);
  ``extra_<name>`` per completion for each column the reward functions ``log_extra``;
- ``reward_names`` (TRL's reward function names) and ``reward_values`` (each function's raw,
  unweighted reward, NaN where it returned ``None``), ``total_utils`` (the weighted
  ``nansum``, NaN for an unscorable completion) and ``advantages`` (TRL's);
- when TRL computed them: ``ref_token_logp`` (``ref_per_token_logps``, β > 0) with
  ``ref_logp_sum_raw``/``ref_tok_counts``, ``behavior_token_logp`` (``old_per_token_logps``:
  the policy's log-probs at generation, the denominator of TRL's importance ratio) with
  ``behavior_logp_sum``, and the extra per-token columns ``sampling_token_logp`` (the
  generator's own log-probs, ``sampling_per_token_logps``: vLLM or a ``rollout_func``),
  ``importance_sampling_ratio`` (token-level vLLM correction; a sequence-level one is the
  per-completion ``sequence_importance_sampling_ratio``), ``tool_mask`` (int8, 1 on model
  tokens) and ``token_advantages`` (a subclass's per-token advantages);
- ``completion_info``: ``token_count``, ``truncated`` (the last token is not an EOS or pad,
  TRL's rule) and ``finish_reason`` (``"stop"`` or ``"length"``);
- the round's part of the off-policy contract (:func:`~.trl_config.trl_offpolicy`).

Multimodal inputs (``pixel_values`` and the like) are not stored.

The work is in two parts, so that the recorder's training step pays only for the first:
:func:`host_round` copies what the rows need out of TRL's tensors (one numpy mask select per
tensor for host tensors; on the device, then one copy, for accelerator ones) before TRL moves
on; :func:`round_table` builds the Arrow columns from that copy and the round's Python values
(:class:`RoundValues`), later, on the recorder's background thread. Both take the round's
:class:`RoundContext`. Python touches only the prompts and completions TRL gives as Python
objects (text or messages); the group structure is index arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import GroupIdentity, Ragged, regroup
from maxent_arrow.errors import LayoutError
from maxent_arrow.integrations.adapters import (
    completion_info,
    offpolicy_columns,
    offsets_of,
    reward_columns,
    row_sums,
    token_lists,
    truncation_flags,
)
from maxent_arrow.integrations.context import (
    DATASET,
    EXTRA,
    UserColumns,
    answer_text,
    example_id_array,
)
from maxent_arrow.integrations.messages import is_conversation, messages_array, strip_images
from maxent_arrow.integrations.trl_contract import TOKEN_COLUMNS, TrlOutput

__all__ = [
    "HostRound",
    "RoundContext",
    "RoundValues",
    "concat_rounds",
    "host_round",
    "round_table",
]


@dataclass(frozen=True)
class RoundContext:
    """Where a round of one process is stored and what holds for all of its completions.

    Parameters
    ----------
    step, rank, kind:
        Where the round is stored.
    group_size:
        TRL's ``num_generations`` (``num_generations_eval`` in eval).
    reward_names, reward_weights:
        The reward functions' names and weights (``total_utils`` is the weighted ``nansum``).
    round_index:
        Distinguishes rounds stored under one step (eval batches; part of ``group_id``).
    eos_token_ids, pad_token_id:
        TRL's EOS ids and pad id: a completion whose last token is neither is truncated.
    user_columns:
        The run's :class:`~maxent_arrow.integrations.context.UserColumns` (declares the
        types of new user columns); default a fresh one.
    offpolicy:
        The round's policy version, log-prob semantics and sampling parameters, one value
        for every completion (:func:`~.trl_config.trl_offpolicy`): ``policy_version``,
        ``logp_semantics`` and ``temperature``, ``top_p``, ``top_k``, ``min_p``.
    """

    step: int
    rank: int
    kind: str
    group_size: int
    reward_names: Sequence[str]
    reward_weights: Sequence[float]
    round_index: int = 0
    eos_token_ids: Sequence[int] = ()
    pad_token_id: int | None = None
    user_columns: UserColumns = field(default_factory=UserColumns)
    offpolicy: Mapping[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """How an error names the round."""
        return f"trl_group_table (step {self.step}, {self.kind})"


@dataclass(frozen=True)
class RoundValues:
    """A round's per-row values TRL holds as Python objects (B of each, one per completion).

    Parameters
    ----------
    prompts, completions:
        This process's prompts and decoded completions (``_calculate_rewards``' arguments):
        strings, or message lists for chat.
    answers:
        Per-row ``answer`` values from the dataset (text, or any JSON value, stored as its
        JSON text), or ``None``.
    example_ids:
        Per-row dataset example ids (the dataset index, or an id column's values): the
        ``example_id`` of each group (text; an int as its digits), or ``None``.
    dataset_columns:
        ``{name: per-row values}`` of dataset columns to keep: ``ds_<name>``, one value per
        group, in the type the context's ``user_columns`` declares (see :mod:`.context`).
    extras:
        ``{name: per-row values}`` the reward functions logged with ``log_extra``:
        ``extra_<name>``, one item per completion.
    """

    prompts: Sequence[Any]
    completions: Sequence[Any]
    answers: Sequence[Any] | None = None
    example_ids: Sequence[Any] | None = None
    dataset_columns: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    extras: Mapping[str, Sequence[Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class HostRound:
    """What a round's group rows need from TRL's tensors, copied to host arrays: the part of
    the work that must happen before TRL moves on (the rest, building the Arrow columns,
    can run later, on the recorder's background thread). Built by :func:`host_round`."""

    lengths: np.ndarray  # [B] completion token counts
    group_of: np.ndarray  # [B] group number in the round
    index: np.ndarray  # [B] completion index in the group
    starts: np.ndarray  # [P] first row of each part
    prompt_values: np.ndarray  # tokens of each part's prompt, concatenated
    prompt_counts: np.ndarray  # [P]
    completion_ids: np.ndarray  # tokens, concatenated
    truncated: np.ndarray  # [B]
    rewards: np.ndarray  # [B, F] float64
    advantages: np.ndarray  # [B] float64, or flat per-token float32 (`token_advantages`)
    per_token_advantages: bool
    tokens: dict[str, np.ndarray]  # column -> flat per-token values
    sequence_ratio: np.ndarray | None  # [B] float32


def host_round(
    output: TrlOutput,
    context: RoundContext,
    *,
    rows: int,
    first_index: int,
    rewards: Any,
    completion_lengths: Any = None,
) -> HostRound:
    """Copy what :func:`round_table` needs out of TRL's tensors; checks the shapes.

    ``rows``: this process's prompts (B, one per completion). ``first_index``: the global row of
    this process's first row in the round's generation batch (``process_index * B``): row
    ``g`` belongs to group ``g // group_size`` at index ``g % group_size``. ``rewards``: the
    raw rewards ``[B, F]`` (one column per reward function, NaN for None).
    ``completion_lengths``: token counts per row; default the ``completion_mask`` sums (give
    them under ``mask_truncated_completions``, which zeroes whole rows of the mask)."""
    b = rows
    ids = output.completion_ids
    if ids.shape[0] != b:
        raise LayoutError(
            f"trl_group_table: completion_ids: expected {b} rows (one per prompt), got "
            f"{ids.shape[0]}"
        )
    lengths = _lengths(output.completion_mask, completion_lengths)
    # Every [B, C] tensor un-padded by the completion lengths (Ragged.from_padded): numpy on
    # the host, so no torch operator runs on the training loop's thread and none wakes torch's
    # intra-op threads (which, spinning after the step's own work, make small torch calls cost
    # milliseconds); on the device for accelerator tensors, then one copy of the tokens alone.
    by_length = lengths if _on_host(ids) else torch.from_numpy(lengths).to(ids.device)

    def flat(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
        """The masked-in values, row after row, on the host."""
        rows = Ragged.from_padded(tensor.detach(), lengths=by_length, dtype=dtype)
        return rows.values.cpu().numpy()

    # Group structure: global row g -> group g // K, index g % K; a process's rows of one
    # group are consecutive, so a part starts wherever the group number changes.
    g = first_index + np.arange(b, dtype=np.int64)
    group_of = g // context.group_size
    starts = np.flatnonzero(np.concatenate([[True], group_of[1:] != group_of[:-1]]))
    prompt_values, prompt_counts = _prompt_tokens(output, starts)
    values = torch.as_tensor(rewards).detach().double().cpu().numpy().reshape(b, -1).copy()
    advantages = output.advantages
    per_token_advantages = advantages.dim() != 1
    tokens, sequence_ratio = _token_values(output, flat)
    return HostRound(
        lengths=lengths,
        group_of=group_of,
        index=(g % context.group_size).astype(np.int32),
        starts=starts,
        prompt_values=prompt_values,
        prompt_counts=prompt_counts,
        completion_ids=flat(ids, torch.int32),
        truncated=truncation_flags(
            ids, lengths, eos_token_ids=context.eos_token_ids, pad_token_id=context.pad_token_id
        ),
        rewards=values,
        advantages=(
            flat(advantages, torch.float32)
            if per_token_advantages
            else _host(advantages).astype(np.float64)
        ),
        per_token_advantages=per_token_advantages,
        tokens=tokens,
        sequence_ratio=sequence_ratio,
    )


def _lengths(mask: torch.Tensor, given: Any) -> np.ndarray:
    """The completion lengths: ``given``, or the mask's row sums."""
    if given is None:
        lengths = mask.numpy().sum(axis=1) if _on_host(mask) else mask.sum(dim=1).cpu().numpy()
    elif isinstance(given, torch.Tensor):
        lengths = given.cpu().numpy()
    else:
        lengths = given
    return np.asarray(lengths, dtype=np.int64)


def _token_values(
    output: TrlOutput, flat: Callable[[torch.Tensor, torch.dtype], np.ndarray]
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The optional per-token tensors, un-padded by ``flat``, by column; and a sequence-level
    importance ratio ``[B]``, or None."""
    tokens = {
        name: flat(getattr(output, key), torch.float32)
        for key, name in TOKEN_COLUMNS.items()
        if getattr(output, key) is not None
    }
    ratio, sequence_ratio = output.importance_sampling_ratio, None
    if ratio is not None:
        width = output.completion_ids.shape[1]
        if ratio.shape[1] == width and width != 1:
            tokens["importance_sampling_ratio"] = flat(ratio, torch.float32)
        else:
            sequence_ratio = _host(ratio[:, 0]).astype(np.float32)
    if output.tool_mask is not None:
        tokens["tool_mask"] = flat(output.tool_mask, torch.int8)
    return tokens, sequence_ratio


def round_table(host: HostRound, values: RoundValues, context: RoundContext) -> pa.Table:
    """The group rows of a round from its :class:`HostRound` (see the module doc)."""
    b = len(values.prompts)
    if len(values.completions) != b or len(host.lengths) != b:
        raise LayoutError(
            f"trl_group_table: completions: expected {len(host.lengths)} (one per prompt), got "
            f"{len(values.completions)} completions for {b} prompts"
        )
    starts = host.starts
    token_offsets = offsets_of(host.lengths)
    part_offsets = np.concatenate([starts, [b]]).astype(np.int64)

    def grouped(column: pa.Array) -> pa.Array:
        return regroup(column, part_offsets)

    def per_token(flat: np.ndarray, item: pa.DataType) -> pa.Array:
        return token_lists(flat, token_offsets, part_offsets, item=item)

    columns = _group_columns(host, values, context, part_offsets)
    columns.update(_completion_columns(values.completions, grouped))
    columns["completion_ids"] = per_token(host.completion_ids, pa.int32())
    columns["completion_info"] = grouped(completion_info(host.lengths, host.truncated))
    columns.update(
        reward_columns(
            host.rewards,
            context.reward_names,
            context.reward_weights,
            part_offsets,
            where="trl_group_table",
        )
    )
    if host.per_token_advantages:  # a subclass's per-token advantages
        columns["token_advantages"] = per_token(host.advantages, pa.float32())
    else:
        columns["advantages"] = grouped(pa.array(host.advantages))
    for name, flat in host.tokens.items():
        item = pa.int8() if flat.dtype == np.int8 else pa.float32()
        columns[name] = per_token(flat, item)
        if name == "ref_token_logp":
            columns["ref_logp_sum_raw"] = grouped(pa.array(row_sums(flat, token_offsets)))
            columns["ref_tok_counts"] = grouped(pa.array(host.lengths.astype(np.int32)))
        elif name == "behavior_token_logp":
            columns["behavior_logp_sum"] = grouped(pa.array(row_sums(flat, token_offsets)))
    if host.sequence_ratio is not None:
        columns["sequence_importance_sampling_ratio"] = grouped(pa.array(host.sequence_ratio))
    columns.update(offpolicy_columns(context.offpolicy, b, grouped))
    for name, logged in values.extras.items():
        if len(logged) != b:
            raise LayoutError(
                f"{context.where}: log_extra column {name!r}: expected {b} values (one per "
                f"completion of this process), got {len(logged)}"
            )
        extra = context.user_columns.extra_values(name, logged, where=context.where)
        columns[EXTRA + name] = grouped(extra)
    return pa.table(columns)


def _group_columns(
    host: HostRound, values: RoundValues, context: RoundContext, part_offsets: np.ndarray
) -> dict[str, pa.Array]:
    """The columns of each group part as a whole: identity, prompt, answer, example id and
    the dataset columns (each from the part's first row)."""
    starts, where = host.starts, context.where
    group_ids = pc.binary_join_element_wise(
        f"{context.step}.{context.round_index}",
        pc.cast(pa.array(host.group_of[starts]), pa.string()),
        ".",
    )
    columns: dict[str, pa.Array] = GroupIdentity.of(
        step=context.step,
        rank=context.rank,
        kind=context.kind,
        group_offsets=part_offsets,
        group_ids=group_ids,
        group_size=context.group_size,
        completion_index=host.index,
        round=context.round_index,
    ).columns()
    columns["prompt_ids"] = regroup(pa.array(host.prompt_values), offsets_of(host.prompt_counts))
    columns.update(_prompt_text(values.prompts, starts))
    if values.answers is not None:
        answers = values.answers
        columns["answer"] = pa.array(
            [answer_text(answers[i], where=f"{where}: answer of row {i}") for i in starts],
            pa.string(),
        )
    if values.example_ids is not None:
        ids = values.example_ids
        columns["example_id"] = example_id_array([ids[i] for i in starts], where=where)
    for name, column in values.dataset_columns.items():
        columns[DATASET + name] = context.user_columns.dataset_column(
            name, [column[i] for i in starts], where=where
        )
    return columns


def concat_rounds(tables: list[pa.Table]) -> pa.Table:
    """Rounds of one step as one table; a column only some rounds have is null in the others,
    and ``group_index`` runs over all of them."""
    table = pa.concat_tables(tables, promote_options="default")
    p = table.num_rows
    return table.set_column(
        table.schema.get_field_index("group_index"),
        "group_index",
        pa.array(np.arange(p, dtype=np.int32)),
    )


def _prompt_tokens(output: TrlOutput, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of each part's first row's prompt (un-padded from the left by its mask),
    and counts: selected on the device for accelerator tensors, then only they are copied."""
    ids, mask = output.prompt_ids, output.prompt_mask
    prompts = Ragged.from_padded(ids.detach(), mask, rows=starts, dtype=torch.int32)
    return prompts.values.cpu().numpy(), prompts.lengths().cpu().numpy()


def _prompt_text(prompts: Sequence[Any], starts: np.ndarray) -> dict[str, pa.Array]:
    """The prompt of each part's first row: ``prompt`` (text) or ``prompt_messages``."""
    first = [prompts[i] for i in starts]
    if first and is_conversation(first[0]):
        return {
            "prompt_messages": messages_array(
                [strip_images(c) for c in first], where="trl prompt_messages"
            )
        }
    return {"prompt": pa.array([p if isinstance(p, str) else str(p) for p in first], pa.string())}


def _completion_columns(completions: Sequence[Any], grouped: Any) -> dict[str, pa.Array]:
    """``completions`` (text) and, for chat, ``completion_messages``."""
    if completions and is_conversation(completions[0]):
        texts = [
            c[-1]["content"] if isinstance(c[-1].get("content"), str) else "" for c in completions
        ]
        messages = messages_array(
            [strip_images(c) for c in completions], where="trl completion_messages"
        )
        return {
            "completions": grouped(pa.array(texts, pa.string())),
            "completion_messages": grouped(messages),
        }
    return {"completions": grouped(pa.array(list(completions), pa.string()))}


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A copy on the host (the round is read after TRL moves on)."""
    return tensor.detach().cpu().numpy().copy()
