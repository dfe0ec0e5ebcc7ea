"""Record the rollouts of an unmodified ``trl.GRPOTrainer`` into a rollout store
(``pip install 'maxent-arrow[trl]'``; written against TRL 1.16).

:class:`RecordingGRPOTrainer` is ``trl.GRPOTrainer`` with :class:`RolloutRecorder` mixed in:
pass ``rollout_store=`` (a path, URI or :class:`~maxent_arrow.store.RolloutStore`) and train as
usual. Every generation round is written once, as one append per process (each process writes
its own rank; nothing is gathered to one process to be written), keyed by the optimizer step
(``state.global_step``) at which it was generated: with ``steps_per_generation`` or
``num_iterations`` > 1 a round serves several optimizer steps and is stored under the first.
Evaluation rounds are stored as ``kind="eval"``, one append per evaluation.

What a round holds (the group layout of ``docs/arrow-layout.md``):

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
  TRL's rule) and ``finish_reason`` (``"stop"`` or ``"length"``).

Multimodal inputs (``pixel_values`` and the like) are not stored. The step row carries
:class:`~maxent_arrow.rollout.RunConfig` with TRL's settings (β, ε / ε_high, ``loss_type``,
``scale_rewards``, ``reward_weights``, ``multi_objective_aggregation``, temperature,
``num_generations``, lengths, the tokenizer's name and vocabulary size; the rest of TRL's
settings under ``extra["trl"]``), so :func:`~maxent_arrow.rollout.recompute` reproduces TRL's
advantages from a stored step.

Cost to the training step: only :func:`host_round`, one numpy mask select per tensor (about
0.5 ms of CPU for 64 completions of 128 tokens, less than TRL's own completions Parquet);
:func:`round_table` (the Arrow columns), the step row and the durable append run on a
background thread (``background=False``: all on the loop). ``benchmarks/bench_integrations.py``
measures both against TRL's logging.

Partial groups: TRL's sampler gives each process consecutive rows of the global generation
batch, so a prompt's completions can be spread over processes, and each process then writes
its part. Readers see whole groups through :func:`~maxent_arrow.rollout.reassemble`, which
merges the parts of a step by ``group_id`` in ``completion_index`` order.

The step row holds ``policy_version`` (``global_step`` at generation) and the
``log_metric`` values (``metric_names`` / ``metric_values`` / ``metric_counts``). Each of
TRL's log calls becomes a ``trainer_metrics`` record (:func:`trl_metrics_row`), joined to the
rollout step its data came from by the step rule (:func:`rollout_step`).

No public TRL hook exposes the batch (callbacks get no tensors), so the recorder overrides the
private ``_generate_and_score_completions`` (its output dict) and ``_calculate_rewards`` (the
per-function rewards, prompts and completions, and what the reward functions logged, TRL's
``_pending_extra_logs`` / ``_pending_metrics``); ``tests/integrations/test_trl.py`` fails
loudly when TRL changes either. TRL's figures come through the Trainer's public ``log``.

**Resumes and re-runs** (``docs/integrations.md``, "Resume and re-run"). Each ``train()`` call
is an attempt of the run (:mod:`maxent_arrow.store.history.attempts`), begun in the store before its
first step. ``train(resume_from_checkpoint=...)`` (``True``: the last checkpoint in
``output_dir``; or a path) resumes the store at the checkpoint's ``global_step`` g, read from
its ``trainer_state.json``: TRL's first round after the resume is generated at g and stored as
step g (the step rule below), so the stored steps >= g of earlier attempts, rounds TRL
regenerates, are superseded, and readers see what the resumed run trained on. A fresh
``train()`` into a store that holds steps of an earlier run is refused before its first step
(a :class:`~maxent_arrow.errors.StoreError` naming the choices: resume, or a new run
directory); ``rollout_if_exists="new_attempt"`` records it as a new attempt that supersedes
the earlier run, ``"resume"`` continues after its last step.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import GroupIdentity, Ragged, regroup
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow.registry import CORE, TRL
from maxent_arrow.errors import (
    ArgumentError,
    LayoutError,
    MissingExtraError,
    SchemaError,
    StoreError,
)
from maxent_arrow.integrations.adapters import (
    completion_info,
    offpolicy_columns,
    offsets_of,
    reward_columns,
    row_sums,
    token_lists,
    truncation_flags,
)
from maxent_arrow.integrations.appender import Appender
from maxent_arrow.integrations.context import (
    DATASET,
    EXTRA,
    INDEX_KEY,
    UserColumns,
    answer_text,
    dataset_types,
    example_id_array,
    with_index,
)
from maxent_arrow.integrations.messages import is_conversation, messages_array, strip_images
from maxent_arrow.integrations.steps import step_row
from maxent_arrow.rollout import (
    METRICS_KEY,
    RolloutBatch,
    RunConfig,
    declare_families,
    trainer_metrics_table,
)
from maxent_arrow.store import RolloutStore
from maxent_arrow.store.history.attempts import IF_EXISTS, IfExists

try:
    import trl
    from transformers import TrainerState
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOTrainer  # pyright: ignore[reportPrivateImportUsage] - trl's lazy module
except ImportError:  # pragma: no cover - the extra is installed where this module is used
    raise MissingExtraError("trl", "trl") from None

__all__ = [
    "ALWAYS_OUTPUT_KEYS",
    "OPTIONAL_OUTPUT_KEYS",
    "HostRound",
    "LOGGED_STEP_OFFSET",
    "RecordingGRPOTrainer",
    "RolloutRecorder",
    "checkpoint_step",
    "host_round",
    "logged_kind",
    "register_trl_log",
    "rollout_step",
    "round_table",
    "trl_metrics_row",
    "trl_trainer_metrics",
    "trl_group_table",
    "trl_offpolicy",
    "trl_run_config",
]

# The keys of `_generate_and_score_completions`' output in TRL 1.16: always there, and only
# under some settings (β > 0, vLLM, tools, images). A key outside both is new in TRL: the
# recorder warns once and does not store it; the tests fail on it.
ALWAYS_OUTPUT_KEYS = frozenset(
    {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "advantages",
        "num_items_in_batch",
    }
)
OPTIONAL_OUTPUT_KEYS = frozenset(
    {
        "old_per_token_logps",
        "ref_per_token_logps",
        "sampling_per_token_logps",
        "importance_sampling_ratio",
        "tool_mask",
        # multimodal model inputs: not stored
        "pixel_values",
        "image_grid_thw",
        "pixel_attention_mask",
        "spatial_shapes",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
        "num_images",
        "num_tiles",
    }
)
# Per-token log-prob tensors and their columns (list<list<float32>>, one row per completion).
_TOKEN_COLUMNS = {
    "ref_per_token_logps": "ref_token_logp",
    "old_per_token_logps": "behavior_token_logp",
    "sampling_per_token_logps": "sampling_token_logp",
}


# ---------------------------------------------------------------------------- the group table
def trl_group_table(
    outputs: Mapping[str, Any],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    rewards: Any,
    reward_names: Sequence[str],
    reward_weights: Sequence[float],
    step: int,
    rank: int,
    kind: str,
    group_size: int,
    first_index: int,
    round_index: int = 0,
    answers: Sequence[Any] | None = None,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    completion_lengths: Any = None,
    example_ids: Sequence[Any] | None = None,
    dataset_columns: Mapping[str, Sequence[Any]] | None = None,
    extras: Mapping[str, Sequence[Any]] | None = None,
    user_columns: UserColumns | None = None,
    offpolicy: Mapping[str, Any] | None = None,
) -> pa.Table:
    """The group rows of one generation round of one process, from TRL's tensors.

    Vectorised: each tensor is un-padded with one boolean mask select (numpy for host
    tensors, on the device for accelerator ones, then one copy); the group structure is index
    arithmetic. Python touches only the
    prompts and completions TRL gives as Python objects (text or messages).

    Parameters
    ----------
    outputs:
        The dict ``_generate_and_score_completions`` returned on this process (B rows).
    prompts, completions:
        This process's prompts and decoded completions (``_calculate_rewards``' arguments):
        strings, or message lists for chat.
    rewards:
        This process's raw rewards ``[B, F]`` (one column per reward function, NaN for None).
    reward_names, reward_weights:
        The reward functions' names and weights (``total_utils`` is the weighted ``nansum``).
    step, rank, kind:
        Where the round is stored.
    group_size:
        TRL's ``num_generations`` (``num_generations_eval`` in eval).
    first_index:
        The global row of this process's first row in the round's generation batch
        (``process_index * B``): row ``g`` belongs to group ``g // group_size`` at index
        ``g % group_size``.
    round_index:
        Distinguishes rounds stored under one step (eval batches; part of ``group_id``).
    answers:
        Per-row ``answer`` values from the dataset (text, or any JSON value, stored as its
        JSON text), or ``None``.
    eos_token_ids, pad_token_id:
        TRL's EOS ids and pad id: a completion whose last token is neither is truncated.
    completion_lengths:
        Token counts per row; default the ``completion_mask`` sums (give them under
        ``mask_truncated_completions``, which zeroes whole rows of the mask).
    example_ids:
        Per-row dataset example ids (the dataset index, or an id column's values): the
        ``example_id`` of each group (text; an int as its digits).
    dataset_columns:
        ``{name: per-row values}`` of dataset columns to keep: ``ds_<name>``, one value per
        group, in the type ``user_columns`` declares (see :mod:`.context`).
    extras:
        ``{name: per-row values}`` the reward functions logged with ``log_extra``:
        ``extra_<name>``, one item per completion.
    user_columns:
        The run's :class:`~maxent_arrow.integrations.context.UserColumns` (declares the
        types of new user columns); default a fresh one.
    offpolicy:
        The round's policy version, log-prob semantics and sampling parameters, one value
        for every completion (:func:`trl_offpolicy`; see :func:`round_table`).
    """
    host = host_round(
        outputs,
        rows=len(prompts),
        group_size=group_size,
        first_index=first_index,
        rewards=rewards,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        completion_lengths=completion_lengths,
    )
    return round_table(
        host,
        prompts=prompts,
        completions=completions,
        reward_names=reward_names,
        reward_weights=reward_weights,
        step=step,
        rank=rank,
        kind=kind,
        group_size=group_size,
        round_index=round_index,
        answers=answers,
        example_ids=example_ids,
        dataset_columns=dataset_columns,
        extras=extras,
        user_columns=user_columns,
        offpolicy=offpolicy,
    )


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
    outputs: Mapping[str, Any],
    *,
    rows: int,
    group_size: int,
    first_index: int,
    rewards: Any,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    completion_lengths: Any = None,
) -> HostRound:
    """Copy what :func:`round_table` needs out of TRL's tensors (see :func:`trl_group_table`
    for the arguments); validates the output keys and shapes."""
    b = rows
    missing = ALWAYS_OUTPUT_KEYS - set(outputs)
    if missing:
        raise SchemaError(f"trl_group_table: outputs: missing TRL keys {sorted(missing)}")
    ids, mask = outputs["completion_ids"], outputs["completion_mask"]
    if ids.shape[0] != b:
        raise LayoutError(
            f"trl_group_table: completion_ids: expected {b} rows (one per prompt), got "
            f"{ids.shape[0]}"
        )
    if completion_lengths is None:
        lengths = mask.numpy().sum(axis=1) if _on_host(mask) else mask.sum(dim=1).cpu().numpy()
    elif isinstance(completion_lengths, torch.Tensor):
        lengths = completion_lengths.cpu().numpy()
    else:
        lengths = completion_lengths
    lengths = np.asarray(lengths, dtype=np.int64)
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
    group_of = g // group_size
    starts = np.flatnonzero(np.concatenate([[True], group_of[1:] != group_of[:-1]]))
    prompt_values, prompt_counts = _prompt_tokens(outputs, starts)
    values = torch.as_tensor(rewards).detach().double().cpu().numpy().reshape(b, -1).copy()
    advantages = outputs["advantages"]
    per_token_advantages = advantages.dim() != 1
    tokens = {
        name: flat(outputs[key], torch.float32)
        for key, name in _TOKEN_COLUMNS.items()
        if outputs.get(key) is not None
    }
    ratio, sequence_ratio = outputs.get("importance_sampling_ratio"), None
    if ratio is not None:
        if ratio.shape[1] == ids.shape[1] and ids.shape[1] != 1:
            tokens["importance_sampling_ratio"] = flat(ratio, torch.float32)
        else:
            sequence_ratio = _host(ratio[:, 0]).astype(np.float32)
    if outputs.get("tool_mask") is not None:
        tokens["tool_mask"] = flat(outputs["tool_mask"], torch.int8)
    return HostRound(
        lengths=lengths,
        group_of=group_of,
        index=(g % group_size).astype(np.int32),
        starts=starts,
        prompt_values=prompt_values,
        prompt_counts=prompt_counts,
        completion_ids=flat(ids, torch.int32),
        truncated=truncation_flags(
            ids, lengths, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id
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


def round_table(
    host: HostRound,
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    reward_names: Sequence[str],
    reward_weights: Sequence[float],
    step: int,
    rank: int,
    kind: str,
    group_size: int,
    round_index: int = 0,
    answers: Sequence[Any] | None = None,
    example_ids: Sequence[Any] | None = None,
    dataset_columns: Mapping[str, Sequence[Any]] | None = None,
    extras: Mapping[str, Sequence[Any]] | None = None,
    user_columns: UserColumns | None = None,
    offpolicy: Mapping[str, Any] | None = None,
) -> pa.Table:
    """The group rows of a round from its :class:`HostRound` (see :func:`trl_group_table`).

    ``offpolicy``: the round's part of the off-policy contract, one value for every
    completion (:func:`trl_offpolicy`): ``policy_version``, ``logp_semantics`` and the
    sampling parameters ``temperature``, ``top_p``, ``top_k``, ``min_p``."""
    b = len(prompts)
    if len(completions) != b or len(host.lengths) != b:
        raise LayoutError(
            f"trl_group_table: completions: expected {len(host.lengths)} (one per prompt), got "
            f"{len(completions)} completions for {b} prompts"
        )
    starts = host.starts
    token_offsets = offsets_of(host.lengths)
    part_offsets = np.concatenate([starts, [b]]).astype(np.int64)

    def grouped(values: pa.Array) -> pa.Array:
        return regroup(values, part_offsets)

    def per_token(flat: np.ndarray, item: pa.DataType) -> pa.Array:
        return token_lists(flat, token_offsets, part_offsets, item=item)

    group_ids = pc.binary_join_element_wise(
        f"{step}.{round_index}", pc.cast(pa.array(host.group_of[starts]), pa.string()), "."
    )
    columns: dict[str, pa.Array] = GroupIdentity.of(
        step=step,
        rank=rank,
        kind=kind,
        group_offsets=part_offsets,
        group_ids=group_ids,
        group_size=group_size,
        completion_index=host.index,
        round=round_index,
    ).columns()
    columns["prompt_ids"] = regroup(pa.array(host.prompt_values), offsets_of(host.prompt_counts))
    columns.update(_prompt_text(prompts, starts))
    where = f"trl_group_table (step {step}, {kind})"
    if answers is not None:
        columns["answer"] = pa.array(
            [answer_text(answers[i], where=f"{where}: answer of row {i}") for i in starts],
            pa.string(),
        )
    if example_ids is not None:
        columns["example_id"] = example_id_array([example_ids[i] for i in starts], where=where)
    user = user_columns if user_columns is not None else UserColumns()
    for name, values in (dataset_columns or {}).items():
        columns[DATASET + name] = user.dataset_column(
            name, [values[i] for i in starts], where=where
        )
    columns.update(_completion_columns(completions, grouped))
    columns["completion_ids"] = per_token(host.completion_ids, pa.int32())
    columns["completion_info"] = grouped(completion_info(host.lengths, host.truncated))
    columns.update(
        reward_columns(
            host.rewards, reward_names, reward_weights, part_offsets, where="trl_group_table"
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
    columns.update(offpolicy_columns(offpolicy or {}, b, grouped))
    for name, values in (extras or {}).items():
        if len(values) != b:
            raise LayoutError(
                f"{where}: log_extra column {name!r}: expected {b} values (one per completion "
                f"of this process), got {len(values)}"
            )
        columns[EXTRA + name] = grouped(user.extra_values(name, values, where=where))
    return pa.table(columns)


def trl_offpolicy(trainer: Any, *, step: int) -> dict[str, Any]:
    """What TRL shows of the off-policy contract for a round generated at ``step``: the
    policy version (``global_step``), the sampling parameters of ``GRPOConfig`` (``top_k``
    None or 0 stored as 0: off; ``min_p`` None as 0.0), and the log-prob semantics:
    ``processed`` under vLLM (TRL asks vLLM for ``processed_logprobs``, and refuses a server
    that gives others), and without vLLM when nothing cuts the distribution (no top-p, top-k or
    min-p: TRL's ``old_per_token_logps`` at the sampling temperature are then the sampled
    distribution's); otherwise unknown (not stored)."""
    args = trainer.args
    top_p = float(args.top_p) if args.top_p is not None else 1.0
    top_k = int(args.top_k or 0)
    min_p = float(args.min_p or 0.0)
    uncut = top_p >= 1.0 and top_k == 0 and min_p == 0.0
    return {
        "policy_version": int(step),
        "temperature": float(trainer.temperature),
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "logp_semantics": "processed" if (args.use_vllm or uncut) else None,
    }


def _prompt_tokens(outputs: Mapping[str, Any], starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of each part's first row's prompt (un-padded from the left by its mask),
    and counts: selected on the device for accelerator tensors, then only they are copied."""
    ids, mask = outputs["prompt_ids"], outputs["prompt_mask"]
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


# ---------------------------------------------------------------------------- the config
def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=True)
        return value
    except (TypeError, ValueError):
        return repr(value)


def trl_run_config(trainer: Any) -> RunConfig:
    """TRL's settings as the replay contract (:class:`~maxent_arrow.rollout.RunConfig`).

    ``max_prompt_len``: TRL 1.16 does not truncate prompts, so the model's context length
    (``max_position_embeddings``) is recorded as the bound.
    """
    args = trainer.args
    tok = trainer._tokenizer  # TRL's own attribute: the processor's tokenizer
    model_config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    context = getattr(model_config, "max_position_embeddings", None) or 0
    world = trainer.accelerator.num_processes
    names = list(trainer.reward_func_names)
    trl_extra = {
        "version": trl.__version__,
        "num_generations_eval": trainer.num_generations_eval,
        "num_iterations": trainer.num_iterations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "per_device_eval_batch_size": args.per_device_eval_batch_size,
        "generation_batch_size": args.generation_batch_size,
        "world_size": world,
        "importance_sampling_level": args.importance_sampling_level,
        "delta": args.delta,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "mask_truncated_completions": args.mask_truncated_completions,
        "use_bias_correction_kl": args.use_bias_correction_kl,
        "top_entropy_quantile": args.top_entropy_quantile,
        "off_policy_mask_threshold": args.off_policy_mask_threshold,
        "use_vllm": args.use_vllm,
        "vllm_importance_sampling_correction": args.vllm_importance_sampling_correction,
        "vllm_importance_sampling_mode": args.vllm_importance_sampling_mode,
        "vllm_importance_sampling_clip_max": getattr(args, "vllm_importance_sampling_clip_max", None),
        "vllm_importance_sampling_clip_min": getattr(args, "vllm_importance_sampling_clip_min", None),
        "generation_kwargs": _json_safe(args.generation_kwargs),
        "chat_template_kwargs": _json_safe(args.chat_template_kwargs),
        "eos_token_ids": list(trainer.eos_token_ids),
    }
    return RunConfig(
        reward_names=tuple(names),
        reward_weights=tuple(float(w) for w in trainer.reward_weights.tolist()),
        scale_rewards=trainer.scale_rewards,
        multi_objective_aggregation=trainer.multi_objective_aggregation,
        unscorable="exclude",
        advantage_eps=1e-4,
        beta=float(trainer.beta),
        mode="grpo",
        loss_type=trainer.loss_type,
        use_clip_objective=True,
        clip_eps_low=float(trainer.epsilon_low),
        clip_eps_high=float(trainer.epsilon_high),
        num_generations=int(trainer.num_generations),
        max_prompt_len=int(context),
        max_completion_len=int(trainer.max_completion_length),
        gen_temperature=float(trainer.temperature),
        top_p=float(args.top_p),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        tokenizer={
            "name": tok.name_or_path or type(tok).__name__,
            "class": type(tok).__name__,
            "vocab_size": tok.vocab_size,
            "len": len(tok),
        },
        model=getattr(model_config, "_name_or_path", None) or None,
        prompts_per_step=int(args.generation_batch_size // trainer.num_generations),
        learning_rate=float(args.learning_rate),
        seed=int(args.seed),
        trainer=f"trl.GRPOTrainer {trl.__version__}",
        extra={"trl": trl_extra},
    )


# ---------------------------------------------------------------------------- TRL's log
# The step-numbering rule (docs/integrations.md, "Step numbers"): a training round generated
# at TRL's global_step s is stored as step s, and TRL logs what it measured of it under the
# step its update completes, s + 1; an evaluation round is stored and logged at its own step.
LOGGED_STEP_OFFSET = {"train": 1, "eval": 0}
# TRL's log keys of the record table's figure columns (from the registry).
_FIGURES = {c.logged_as: c.name for c in R.columns(R.TRAINER_METRICS) if c.logged_as}


def logged_kind(entry: Mapping[str, Any]) -> str | None:
    """Which kind of record a ``log_history`` entry is: ``"train"`` (a training log, it has
    ``loss``), ``"eval"`` (an evaluation, ``eval_`` keys) or ``None`` (the end-of-training
    summary, ``train_runtime`` and the like: not a record)."""
    if "loss" in entry:
        return "train"
    if any(key.startswith("eval_") for key in entry):
        return "eval"
    return None


def rollout_step(optimizer_step: int, kind: str, train_steps: Sequence[int]) -> int | None:
    """The stored rollout step whose data TRL's logged step ``optimizer_step`` trained on:
    for training, the latest round generated at a global_step of at most
    ``optimizer_step - 1`` (``train_steps``: the run's stored train steps, ascending; a round
    serves ``num_iterations × steps_per_generation`` micro-steps); for an evaluation, its own
    step. ``None`` when no stored round precedes it."""
    if kind != "train":
        return optimizer_step - LOGGED_STEP_OFFSET[kind]
    i = bisect.bisect_right(train_steps, optimizer_step - LOGGED_STEP_OFFSET[kind])
    return int(train_steps[i - 1]) if i else None


def trl_metrics_row(
    entry: Mapping[str, Any],
    *,
    train_steps: Sequence[int],
    previous: int = 0,
    counts: Mapping[str, int] | None = None,
) -> dict[str, Any] | None:
    """The ``trainer_metrics`` record of one ``log_history`` entry, or ``None`` for an entry
    that is not a record (:func:`logged_kind`).

    ``previous`` is the optimizer step of the run's previous training log (TRL averages the
    loss and its own figures over the steps since); ``counts`` the ``loss_batches`` and
    ``rounds`` TRL averaged (the recorder counts them; unknown afterwards)."""
    kind = logged_kind(entry)
    if kind is None:
        return None
    t = int(entry["step"])
    averaged = t - previous if kind == "train" else 0
    prefix = "eval_" if kind == "eval" else ""
    values = {k.removeprefix(prefix): v for k, v in entry.items() if k != "step"}
    row: dict[str, Any] = {
        "optimizer_step": t,
        "kind": kind,
        "step": rollout_step(t, kind, train_steps),
        "first_step": rollout_step(t - max(averaged, 1) + 1, kind, train_steps),
        "averaged_steps": averaged,
        **(counts or {}),
    }
    for key, column in _FIGURES.items():
        row[column] = values.pop(key, None)
    row[METRICS_KEY] = {k: v for k, v in values.items() if v is None or isinstance(v, int | float)}
    return row


def trl_trainer_metrics(
    log_history: Sequence[Mapping[str, Any]], *, train_steps: Sequence[int]
) -> pa.Table:
    """The ``trainer_metrics`` records of TRL's log (``trainer.state.log_history``, or the
    ``log_history`` of a checkpoint's ``trainer_state.json``): one per training log and per
    evaluation, joined to the stored rollout steps ``train_steps`` by :func:`rollout_step`.
    What the recorder writes during training, less the counts only it sees."""
    steps = sorted(set(train_steps))
    rows, previous = [], 0
    for entry in log_history:
        row = trl_metrics_row(entry, train_steps=steps, previous=previous)
        if row is None:
            continue
        if row["kind"] == "train":
            previous = row["optimizer_step"]
        rows.append(row)
    return trainer_metrics_table(rows)


def register_trl_log(
    views: Any, log_history: Sequence[Mapping[str, Any]], *, name: str = "trl_log"
) -> pa.Table:
    """Make TRL's log queryable beside a store: registers the records of ``log_history``
    (:func:`trl_trainer_metrics`, joined to the store's train steps) as the view ``name`` on
    ``views`` (a :class:`~maxent_arrow.RunAnalytics` or the store's ``sql_views()``), where
    ``optimizer_step`` is TRL's logged ``step`` and ``(step, kind)`` joins ``steps``,
    ``groups`` and ``samples``. Returns the registered table."""
    session = getattr(views, "views", views)
    stored = session.query("SELECT DISTINCT step FROM steps WHERE kind = 'train'", trusted=True)
    table = trl_trainer_metrics(log_history, train_steps=stored.column("step").to_pylist())
    session.register(name, table)
    return table


# ---------------------------------------------------------------------------- resumes
def checkpoint_step(
    resume_from_checkpoint: str | os.PathLike[str] | bool | None,
    output_dir: str | os.PathLike[str] | None,
) -> int | None:
    """The step at which ``Trainer.train(resume_from_checkpoint=...)`` resumes, as the store
    numbers steps: the checkpoint's ``global_step`` (its ``trainer_state.json``), where TRL
    generates, and the recorder stores, the resumed run's first round. ``True`` means the
    last checkpoint in ``output_dir``; ``None`` or ``False``: no resume (``None``).

    Raises as ``Trainer.train`` would: ``ValueError`` when ``output_dir`` holds no
    checkpoint, ``FileNotFoundError`` when the checkpoint has no ``trainer_state.json``."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    path: str | os.PathLike[str] | None
    if resume_from_checkpoint is True:
        path = None if output_dir is None else get_last_checkpoint(str(output_dir))
        if path is None:  # Trainer.train's own words
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
    else:
        path = resume_from_checkpoint
    return int(TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME)).global_step)


# ---------------------------------------------------------------------------- the recorder
# A mixin over TRL's trainer: checkers see the trainer's attributes and `super()` methods it
# uses; at run time its base stays `object` (the trainer comes in through the subclass's MRO).
if TYPE_CHECKING:
    _Trainer = GRPOTrainer
else:
    _Trainer = object


class RolloutRecorder(_Trainer):
    """Mixin that records every generation round of a ``trl.GRPOTrainer`` (see the module
    doc). Put it before the trainer class: ``class T(RolloutRecorder, GRPOTrainer)``.

    Parameters
    ----------
    rollout_store:
        A :class:`~maxent_arrow.store.RolloutStore`, or a path or URI where one is created
        (every process creates or opens the same store; each appends its own rank). Each
        ``train()`` writes through a store object of its own attempt
        (:meth:`begin_rollout_attempt`), kept as ``rollout_store``.
    rollout_if_exists:
        What a fresh ``train()`` (not resumed from a checkpoint) does when the store holds
        steps of an earlier run: ``"error"`` (the default, unless the given store object says
        otherwise: refused before the first step, naming the choices), ``"new_attempt"``
        (recorded in full as a new attempt that supersedes the earlier run) or ``"resume"``
        (continue after its last step). A resume from a checkpoint always resumes the store at
        the checkpoint's step.
    record_eval:
        Also record evaluation rounds (``kind="eval"``).
    background:
        Build the Arrow columns and append on a background thread
        (:class:`~maxent_arrow.integrations.appender.Appender`), in order, at most two steps
        in flight: the training step pays only for copying the round's values out of TRL's
        tensors (:func:`host_round`). An append that fails is raised by the next round or at the
        end of ``train``/``evaluate``; everything submitted is durable when they return.
        ``False`` appends synchronously.
    example_id:
        The dataset column whose value identifies an example (each group's ``example_id``).
        Default: the example's index in its dataset; the recorder adds it to the datasets'
        rows as ``maxent_example_index`` (reward functions see it among their keyword
        arguments).
    record_columns:
        Dataset columns to keep, each as the group column ``ds_<name>`` with the dataset's own
        Arrow type. The dataset's other columns (besides ``prompt``, ``answer`` and the id) are
        not recorded; a warning lists them once, when the recorder starts.
    *args, **kwargs:
        Those of the trainer.
    """

    def __init__(
        self,
        *args: Any,
        rollout_store: RolloutStore | str | os.PathLike[str],
        rollout_if_exists: IfExists | None = None,
        record_eval: bool = True,
        background: bool = True,
        example_id: str | None = None,
        record_columns: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        if example_id is None:  # the index travels with each row
            args, kwargs = _indexed_datasets(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)
        if isinstance(record_columns, str):
            raise SchemaError("RolloutRecorder: record_columns: expected a list of names")
        self._rollout_id_key = example_id or INDEX_KEY
        self._rollout_record = tuple(record_columns)
        dataset, record_types = self._dataset_context(example_id)
        config = trl_run_config(self)
        self.rollout_config = config.replace(extra={**config.extra, "dataset": dataset})
        if rollout_if_exists is not None and rollout_if_exists not in IF_EXISTS:
            raise ArgumentError(
                f"RolloutRecorder: rollout_if_exists: expected one of {IF_EXISTS}, got "
                f"{rollout_if_exists!r}"
            )
        self._rollout_if_exists: IfExists | None = rollout_if_exists
        if isinstance(rollout_store, RolloutStore):
            self.rollout_store = rollout_store
        else:
            self.rollout_store = RolloutStore.create(
                rollout_store,
                config=self.rollout_config.to_dict(),
                if_exists=rollout_if_exists or "error",
            )
        self.record_eval = record_eval
        self.rollout_appender = Appender(background=background)
        # Read once: a tokenizer's special-token properties cost a lookup per access.
        self._rollout_pad_id = cast(int | None, self._tokenizer.pad_token_id)
        self._rollout_capture: tuple | None = None
        self._rollout_pending: dict[str, _Pending] = {}
        # The attempt this trainer writes as (begun by train(), or an evaluation outside it),
        # and whether its store keeps record tables (a store with a commit log).
        self.rollout_attempt: str | None = None
        self._rollout_records = False
        # What this rank already stored, in the effective history (a round of a step stored
        # there is not stored again; a resume supersedes the steps it regenerates).
        rank = self.accelerator.process_index
        units = self.rollout_store.units(ranks=[rank])
        self._rollout_written: set[tuple[int, str]] = {(u.step, u.kind) for u in units}
        self._rollout_unknown: set[str] = set()
        # The run's user columns: those its stored files have (a resumed run), then the
        # dataset columns asked for, with the dataset's types.
        stored = self.rollout_store.schema() if units else pa.schema([])
        self.rollout_columns = UserColumns.of_schema(stored)
        for name, kind in record_types.items():
            self.rollout_columns.declare(DATASET + name, kind)
        # log_extra columns are fixed at the run's first round (None until then).
        extras = [n.removeprefix(EXTRA) for n in stored.names if n.startswith(EXTRA)]
        self._rollout_extras: list[str] | None = extras if units else None
        self._rollout_late: set[str] = set()  # log_extra columns left out (said once)
        # The trainer-figure records (docs/arrow-layout.md, "Trainer metrics"): the stored
        # train steps they join to, and the records of this trainer's logs.
        self._rollout_train_steps = sorted({u.step for u in units if u.kind == "train"})
        self.rollout_metrics: list[dict[str, Any]] = []
        self._rollout_answers: bool | None = None  # answers JSON-able (known at the 1st round)

    def _dataset_context(
        self, example_id: str | None
    ) -> tuple[dict[str, Any], dict[str, pa.DataType]]:
        """What of the dataset rows is recorded (the run config's ``extra["dataset"]``) and
        the Arrow types of the columns to keep, checked against the dataset's columns; the one
        warning about the rest."""
        types = dataset_types(self.train_dataset) or {}
        names = [n for n in types if n != INDEX_KEY]
        asked = [*self._rollout_record, *([example_id] if example_id else [])]
        missing = [n for n in asked if types and n not in types]
        if missing:
            raise SchemaError(
                f"RolloutRecorder: record_columns/example_id: the dataset has no column "
                f"{missing}; its columns are {names}"
            )
        kept = {"prompt", "answer", *asked}
        left_out = [n for n in names if n not in kept]
        if self.args.remove_unused_columns:
            warnings.warn(
                "RolloutRecorder: remove_unused_columns=True: TRL drops every dataset column "
                "but the prompt, so example_id, answer and record_columns are not recorded",
                stacklevel=3,
            )
        elif left_out:
            warnings.warn(
                f"RolloutRecorder: dataset columns not recorded: {left_out} "
                "(record_columns=[...] keeps them as ds_<name> columns)",
                stacklevel=3,
            )
        answer = types.get("answer")
        record_types = {n: types[n] for n in self._rollout_record if n in types}
        info = {
            "example_id": example_id or "index",
            "columns": {n: str(kind) for n, kind in record_types.items()},
            "answer": None if answer is None else ("text" if answer == pa.string() else "json"),
            "not_recorded": left_out,
        }
        return info, record_types

    # -- TRL's private methods, extended (the tests pin their signatures and outputs)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # What the reward functions logged (log_extra / log_metric) for this process's rows,
        # before _generate_and_score_completions gathers and clears it.
        extras = {k: list(v) for k, v in self._pending_extra_logs.items()}
        metrics = {k: list(v) for k, v in self._pending_metrics.items()}
        self._rollout_capture = (
            prompts,
            completions,
            completion_ids_list,
            rewards,
            extras,
            metrics,
        )
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.record_round(inputs, output)
        return output

    # -- the Trainer's public hook for what it logs
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        assert self.model is not None  # set by the trainer
        mode = "train" if self.model.training else "eval"
        # What TRL is about to average (it clears these in its log): one entropy per loss
        # computation, one reward per generation round.
        counts = {
            "loss_batches": len(self._metrics[mode].get("entropy", ())),
            "rounds": len(self._metrics[mode].get("reward", ())),
        }
        super().log(logs, start_time)
        *earlier, entry = self.state.log_history
        previous = next((int(e["step"]) for e in reversed(earlier) if logged_kind(e) == "train"), 0)
        self.record_log(entry, counts, previous=previous)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, as an attempt of the run in the store, begun before the first
        step (:meth:`begin_rollout_attempt`): a resume from a checkpoint resumes the store at
        the checkpoint's ``global_step``."""
        step = checkpoint_step(resume_from_checkpoint, self.args.output_dir)
        self.begin_rollout_attempt(resume_from=step)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.flush_rollouts()
            self.rollout_appender.wait()
            if self._rollout_records and self.accelerator.is_main_process:
                # The log checkpoint plain readers read (docs/commit-protocol.md); a failure
                # costs them freshness, never data.
                with contextlib.suppress(OSError, StoreError):
                    self.rollout_store.checkpoint()

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        if self.rollout_attempt is None:  # an evaluation before any train(): its own attempt
            self.begin_rollout_attempt()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.flush_rollouts("eval")
            self.rollout_appender.wait()

    # -- the attempt
    def begin_rollout_attempt(self, *, resume_from: int | None = None) -> str | None:
        """Begin this trainer's next attempt in the store (``train()`` calls it first): a
        resume at step ``resume_from`` (a checkpoint's ``global_step``: the stored steps from
        there on, of earlier attempts, are superseded), or a fresh run, which a store that
        holds an earlier run's steps refuses unless ``rollout_if_exists`` (or the given store
        object) says ``"new_attempt"`` or ``"resume"``. Each call is an attempt of its own
        (:meth:`~maxent_arrow.store.RolloutStore.next_attempt`), whose store object becomes
        ``rollout_store``. A refusal raises :class:`~maxent_arrow.errors.StoreError` before
        anything is written, and the trainer keeps the store object it had. Returns the
        attempt id (``None``: a store without a commit log, which keeps no attempts)."""
        store = self.rollout_store
        # HF's Trainer evaluates at a step before it saves that step's checkpoint, and the
        # resumed run does not evaluate there again: evaluations resume a step later.
        opened = store.next_attempt(
            resume_from=resume_from,
            if_exists=self._rollout_if_exists,
            resume_kinds=None if resume_from is None else {"eval": resume_from + 1},
        )
        try:
            begun = opened.begin_attempt(config=self.rollout_config.to_dict())
        except StoreError as exc:
            if resume_from is not None or not store.units():
                raise
            raise StoreError(
                f"{exc}. With TRL: train(resume_from_checkpoint=True) (or a checkpoint's path) "
                "resumes the run from its last checkpoint; a new output_dir and rollout_store "
                "start a new run; rollout_if_exists='new_attempt' records this run over the "
                "earlier one"
            ) from exc
        self.rollout_store = opened
        self.rollout_attempt = begun or opened.attempt_spec.id
        self._rollout_records = begun is not None
        # The effective history now: what a resume superseded is not this run's any more.
        units = opened.units(ranks=[self.accelerator.process_index])
        self._rollout_written = {(u.step, u.kind) for u in units}
        self._rollout_train_steps = sorted({u.step for u in units if u.kind == "train"})
        return begun

    # -- recording
    def record_round(self, inputs: Sequence[Mapping[str, Any]], output: Mapping[str, Any]) -> None:
        """Build this process's group rows of the round TRL just generated and scored."""
        capture, self._rollout_capture = self._rollout_capture, None
        assert self.model is not None  # set by the trainer
        kind = "train" if self.model.training else "eval"
        if kind == "eval" and not self.record_eval:
            return
        if capture is None:
            raise LayoutError(
                "RolloutRecorder: _generate_and_score_completions returned without calling "
                "_calculate_rewards; TRL's flow changed (this recorder is written for 1.16)"
            )
        unknown = set(output) - ALWAYS_OUTPUT_KEYS - OPTIONAL_OUTPUT_KEYS - self._rollout_unknown
        if unknown:
            self._rollout_unknown |= unknown
            warnings.warn(
                f"RolloutRecorder: TRL returned keys it did not in 1.16, not recorded: "
                f"{sorted(unknown)}",
                stacklevel=2,
            )
        prompts, completions, ids_list, rewards, logged, metrics = capture
        b = len(prompts)
        rank = self.accelerator.process_index
        step = int(self.state.global_step)
        pending = self._rollout_pending.get(kind)
        if pending is not None and pending.step != step:
            self.flush_rollouts(kind)
            pending = None
        if pending is None:
            pending = self._rollout_pending[kind] = _Pending(step)
            if kind == "train" and step not in self._rollout_train_steps:
                bisect.insort(self._rollout_train_steps, step)
        lengths = None
        if self.mask_truncated_completions:  # the mask zeroes truncated rows: use the ids
            lengths = np.fromiter(map(len, ids_list), dtype=np.int64, count=b)
        group_size = self.num_generations if kind == "train" else self.num_generations_eval
        assert group_size is not None  # GRPOTrainer sets both
        # On the loop: copy what is needed out of TRL's tensors (TRL moves on after this).
        host = host_round(
            output,
            rows=b,
            group_size=group_size,
            first_index=rank * b,
            rewards=rewards[rank * b : (rank + 1) * b],
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self._rollout_pad_id,
            completion_lengths=lengths,
        )
        for name, values in metrics.items():
            pending.add_metric(name, values)
        # Later, with the append (on the background thread): the Arrow columns. TRL does not
        # touch the prompt and completion lists, the logged values or the dataset rows after
        # this call.
        pending.rounds.append(
            functools.partial(
                round_table,
                host,
                prompts=prompts,
                completions=completions,
                reward_names=self.rollout_config.reward_names,
                reward_weights=self.rollout_config.reward_weights,
                step=step,
                rank=rank,
                kind=kind,
                group_size=group_size,
                round_index=len(pending.rounds),
                answers=self._round_answers(inputs),
                example_ids=_Column(inputs, self._rollout_id_key),
                dataset_columns={n: _Column(inputs, n) for n in self._rollout_record},
                extras=self._round_extras(logged, b),
                user_columns=self.rollout_columns,
                offpolicy=trl_offpolicy(self, step=step),
            )
        )
        # A GRPOConfig, whose __post_init__ sets steps_per_generation (TRL declares the
        # TrainingArguments base, and the field Optional).
        args: Any = self.args
        generate_every = args.steps_per_generation * self.num_iterations
        if kind == "train" and generate_every >= self.args.gradient_accumulation_steps:
            # Rounds are at least an optimizer step apart: none can share this step.
            self.flush_rollouts(kind)

    def record_log(
        self, entry: Mapping[str, Any], counts: Mapping[str, int], *, previous: int = 0
    ) -> None:
        """Record one entry of TRL's log (:func:`trl_metrics_row`; ``previous``: the step of
        the run's previous training log) in ``rollout_metrics`` and, from the main process,
        in the store's ``trainer_metrics`` records."""
        row = trl_metrics_row(
            entry, train_steps=self._rollout_train_steps, previous=previous, counts=counts
        )
        if row is None:
            return
        self.rollout_metrics.append(row)
        if self._rollout_records and self.accelerator.is_main_process:
            table = trainer_metrics_table([row])
            append = self.rollout_store.append_records
            self.rollout_appender.submit(functools.partial(append, R.TRAINER_METRICS, table))

    def trainer_metrics(self) -> pa.Table:
        """The ``trainer_metrics`` records of this trainer's logs so far."""
        return trainer_metrics_table(self.rollout_metrics)

    def _round_answers(self, inputs: Sequence[Mapping[str, Any]]) -> Sequence[Any] | None:
        """The rows' answers, or None: no ``answer`` key, or answers JSON cannot hold (said
        once, at the first round)."""
        if not inputs or "answer" not in inputs[0]:
            return None
        if self._rollout_answers is None:
            try:
                answer_text(inputs[0]["answer"], where="RolloutRecorder: answer")
                self._rollout_answers = True
            except SchemaError as exc:
                self._rollout_answers = False
                warnings.warn(f"{exc}; the answers are not recorded", stacklevel=3)
        return _Column(inputs, "answer") if self._rollout_answers else None

    def _round_extras(self, logged: Mapping[str, list], b: int) -> dict[str, Sequence[Any]]:
        """The log_extra columns of a round: the run's, fixed at its first round (a column a
        round did not log is null there); a column first logged later is left out, and said
        once."""
        if self._rollout_extras is None:
            self._rollout_extras = sorted(logged)
        late = sorted(set(logged) - set(self._rollout_extras) - self._rollout_late)
        if late:
            self._rollout_late.update(late)
            warnings.warn(
                f"RolloutRecorder: log_extra columns {late} were first logged after the run's "
                "first round, whose columns fix the run's schema; they are not recorded",
                stacklevel=3,
            )
        return {n: logged.get(n, [None] * b) for n in self._rollout_extras}

    def flush_rollouts(self, kind: str | None = None) -> None:
        """Submit the pending rounds (of ``kind``, or all) as one append per kind (see
        ``background``; :meth:`Appender.wait` on ``rollout_appender`` makes them durable)."""
        for name in [kind] if kind is not None else list(self._rollout_pending):
            pending = self._rollout_pending.pop(name, None)
            if pending is None:
                continue
            if (pending.step, name) in self._rollout_written:
                warnings.warn(
                    f"RolloutRecorder: a {name} round at step {pending.step} of rank "
                    f"{self.accelerator.process_index} is already stored (a second evaluation "
                    "at one step, or a run continued at a step the store holds); this one is "
                    "not recorded",
                    stacklevel=2,
                )
                continue
            self._rollout_written.add((pending.step, name))
            self.rollout_appender.submit(
                _append_job(
                    self.rollout_store,
                    pending,
                    self.rollout_columns,
                    rank=self.accelerator.process_index,
                    kind=name,
                    config=self.rollout_config,
                    max_completion_len=self.max_completion_length,
                )
            )


def _indexed_datasets(init: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The trainer's arguments with ``train_dataset`` and ``eval_dataset`` carrying each row's
    index (:func:`~.context.with_index`)."""
    bound = inspect.signature(init).bind_partial(*args, **kwargs)
    for name in ("train_dataset", "eval_dataset"):
        if bound.arguments.get(name) is not None:
            bound.arguments[name] = with_index(bound.arguments[name])
    return bound.args, bound.kwargs


@dataclass
class _Pending:
    """The rounds of one step and kind not yet appended, and the metrics logged in them."""

    step: int
    rounds: list[Callable[[], pa.Table]] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    def add_metric(self, name: str, values: Sequence[Any]) -> None:
        total = self.metrics.setdefault(name, [0.0, 0])
        numbers = [float(v) for v in values]
        total[0] += math.fsum(numbers)
        total[1] += len(numbers)

    def metric_means(self) -> dict[str, tuple[float, int]]:
        return {n: (t[0] / t[1], int(t[1])) for n, t in self.metrics.items() if t[1]}


def _append_job(
    store: RolloutStore, pending: _Pending, user_columns: UserColumns, **where: Any
) -> Callable[[], None]:
    """The append of one step: its rounds' group rows built and joined, every user column of
    the run, the step row, the batch's layout check and the durable write (run by the
    Appender, on its thread)."""
    rounds, step = list(pending.rounds), pending.step
    metrics = pending.metric_means()

    def job() -> None:
        tables = [build() for build in rounds]
        groups = tables[0] if len(tables) == 1 else _concat(tables)
        groups = declare_families(user_columns.complete(groups), (CORE, TRL))
        row = step_row(groups, step=step, policy_version=step, metrics=metrics, **where)
        store.append(RolloutBatch(groups, row))

    return job


class _Column(Sequence):
    """One key of the dataset rows, read by index (only the rows that are looked at)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], key: str) -> None:
        self.rows, self.key = rows, key

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        return self.rows[i].get(self.key)


def _concat(tables: list[pa.Table]) -> pa.Table:
    """Rounds of one step as one table; a column only some rounds have is null in the others,
    and ``group_index`` runs over all of them."""
    table = pa.concat_tables(tables, promote_options="default")
    p = table.num_rows
    return table.set_column(
        table.schema.get_field_index("group_index"),
        "group_index",
        pa.array(np.arange(p, dtype=np.int32)),
    )


class RecordingGRPOTrainer(RolloutRecorder, GRPOTrainer):
    """``trl.GRPOTrainer`` that records every generation round into a rollout store: the
    trainer's arguments plus ``rollout_store=`` and ``record_eval=``
    (:class:`RolloutRecorder`)."""
