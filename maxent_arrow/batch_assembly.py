"""``RolloutBatch.from_parts`` (one step's seed objects to a group batch and a step row) and the
layout checks of ``RolloutBatch(groups, step_row)``.

Per-sample ``[N]`` columns of the seed classes (``to_arrow()`` layouts of
:mod:`maxent_arrow.types.records`, named like the group table on purpose) are regrouped by the
generation's group offsets: a new offsets buffer over the same child values, no copy of the
token or log-prob bytes (a cast copies only when a dtype must change, e.g. int64 token ids to
int32).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow import schema as S
from maxent_arrow.batch import (
    _GROUP_TYPES,
    _STEP_TYPES,
    BATCH_META_KEY,
    KINDS_PATTERN,
    _cast,
    _combined,
    _int_arg,
    _json_config,
    _regroup,
)
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.ragged import Ragged, list_offsets
from maxent_arrow.types import rewards as R
from maxent_arrow.types.columns import dtype_name
from maxent_arrow.views import GroupedSequence

__all__ = ["assemble", "normalise"]

_IDS_TYPE = dict((f.name, f.type) for f in S.GROUP_FIELDS)["completion_ids"]


def _typed(name: str, value: Any, kind: Any, expected: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise SchemaError(
            f"RolloutBatch.from_parts: {name} expected a {expected}, got {type(value).__name__}"
        )
    return value


def _column(rb: pa.RecordBatch, name: str) -> pa.Array | None:
    if name not in rb.schema.names:
        return None
    return rb.column(name)


def _check_rows(owner: str, array: pa.Array, n: int) -> None:
    if len(array) != n:
        raise LayoutError(
            f"RolloutBatch.from_parts: {owner} expected {n} rows (one per completion, as "
            f"generation), got {len(array)}"
        )


def _check_offsets(owner: str, got: np.ndarray, expected: np.ndarray) -> None:
    if len(got) != len(expected):
        raise LayoutError(
            f"RolloutBatch.from_parts: {owner} expected {len(expected) - 1} groups (as "
            f"generation), got {len(got) - 1}"
        )
    if not np.array_equal(got, expected):
        g = int(np.flatnonzero(np.diff(got) != np.diff(expected))[0])
        raise LayoutError(
            f"RolloutBatch.from_parts: {owner} expected {int(expected[g + 1] - expected[g])} "
            f"completions at group {g} (as generation), got {int(got[g + 1] - got[g])}"
        )


def _split_info(info: pa.Array | None, offsets: np.ndarray):
    """Completion info without ``token_ids`` (they go to ``completion_ids``) and those ids."""
    if info is None:
        return None, None
    flat = info.flatten()
    names = [f.name for f in flat.type]
    token_ids = None
    if "token_ids" in names:
        candidate = flat.field(names.index("token_ids"))
        if candidate.null_count == 0:
            token_ids = _regroup(candidate, offsets)
        elif candidate.null_count != len(candidate):
            i = int(np.flatnonzero(~candidate.is_valid().to_numpy(zero_copy_only=False))[0])
            g = int(np.searchsorted(offsets, i, side="right") - 1)
            raise LayoutError(
                "RolloutBatch.from_parts: generation.grouped_completion_info has token_ids for "
                f"some completions only (missing at group {g}, sample {i - offsets[g]})"
            )
    arrays = []
    for field in S.COMPLETION_INFO_TYPE:
        if field.name in names:
            arrays.append(flat.field(names.index(field.name)).cast(field.type))
        else:
            arrays.append(pa.nulls(len(flat), field.type))
    struct = pa.StructArray.from_arrays(
        arrays,
        fields=list(S.COMPLETION_INFO_TYPE),
        mask=flat.is_null() if flat.null_count else None,
    )
    return _regroup(struct, offsets), token_ids


def _ids_into_extra(info: pa.Array, token_ids: pa.Array) -> pa.Array:
    """Keep completion-info token ids that differ from the scored ids in the JSON ``extra``.

    A rare path (re-tokenised completions, semantics §6.3), so a loop over samples is fine.
    """
    flat = info.flatten()
    extras = flat.field("extra").to_pylist()
    ids = token_ids.flatten().to_pylist()
    merged = []
    for extra, item in zip(extras, ids):
        data = json.loads(extra) if extra else {}
        data["token_ids"] = item
        merged.append(json.dumps(data))
    arrays = [flat.field(i) for i in range(flat.type.num_fields)]
    arrays[flat.type.get_field_index("extra")] = pa.array(merged, pa.string())
    struct = pa.StructArray.from_arrays(arrays, fields=list(flat.type))
    return _regroup(struct, list_offsets(info))


def _grouped_floats(name: str, value: Any, offsets: np.ndarray) -> pa.Array:
    """Per-sample values (flat ``[N]`` or already grouped) as ``list<double>`` by group."""
    if isinstance(value, R.AdvantageStats | R.QDistribution):
        value = value.grouped
    if isinstance(value, Ragged):
        value = value.to_arrow()
    if isinstance(value, GroupedSequence):
        value = value.arrow
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, list | tuple) and value and isinstance(value[0], list | tuple):
        value = pa.array(value, pa.list_(pa.float64()))
    if isinstance(value, pa.Array) and (
        pa.types.is_list(value.type) or pa.types.is_large_list(value.type)
    ):
        _check_offsets(name, list_offsets(value), offsets)
        flat = value.flatten()
    else:
        from maxent_arrow.types import fields as F

        flat = F.ensure_float_list(f"RolloutBatch.from_parts: {name}", value).arrow
        _check_rows(name, flat, int(offsets[-1]))
    if flat.null_count:
        raise LayoutError(f"RolloutBatch.from_parts: {name} has a null value")
    return _regroup(flat.cast(pa.float64()), offsets)


def _counts_int32(name: str, array: pa.Array) -> pa.Array:
    try:
        return array.cast(pa.int32())  # safe cast: refuses fractional or out-of-range counts
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise LayoutError(
            f"RolloutBatch.from_parts: {name} expected whole numbers ({exc})"
        ) from None


def _per_token(name: str, array: pa.Array | None, offsets: np.ndarray, kind: pa.DataType):
    if array is None:
        return None
    _check_rows(name, array, int(offsets[-1]))
    inner = pa.list_(pa.field("item", kind, nullable=False))
    return _regroup(array.cast(inner), offsets)


def _scalars(record: Any, names: list[str]) -> dict[str, Any]:
    return {name: getattr(record, name) for name in names}


def assemble(
    cls,
    step: int,
    *,
    generation: R.GenerationBatch,
    rewards: R.RewardComputation | None,
    score_batch: R.ScoreBatch | None,
    reference: R.ReferenceLogprobs | None,
    scores: R.SequenceScores | None,
    length_stats: R.LengthStats | None,
    loss: R.LossOutputs | R.LossScalarBundle | None,
    diagnostics: R.BatchDiagnostics | None,
    weights: Any,
    rank: int,
    kind: str,
    config: Mapping[str, Any] | None,
    policy_version: int | None,
    behavior_token_logp: Any = None,
):
    import re

    step = _int_arg("step", step)
    rank = _int_arg("rank", rank)
    if not isinstance(kind, str) or not re.fullmatch(KINDS_PATTERN, kind):
        raise SchemaError(
            f"RolloutBatch.kind: expected a lowercase name matching {KINDS_PATTERN} (e.g. "
            f"'train', 'eval'), got {kind!r}"
        )
    if not isinstance(generation, R.GenerationBatch):
        raise SchemaError(
            f"RolloutBatch.from_parts: generation expected a GenerationBatch, got "
            f"{type(generation).__name__}"
        )
    _typed("rewards", rewards, R.RewardComputation, "RewardComputation")
    _typed("score_batch", score_batch, R.ScoreBatch, "ScoreBatch")
    _typed("reference", reference, R.ReferenceLogprobs, "ReferenceLogprobs")
    _typed("scores", scores, R.SequenceScores, "SequenceScores")
    _typed("length_stats", length_stats, R.LengthStats, "LengthStats")
    _typed("loss", loss, R.LossOutputs | R.LossScalarBundle, "LossOutputs or LossScalarBundle")
    _typed("diagnostics", diagnostics, R.BatchDiagnostics, "BatchDiagnostics")
    config_text = _json_config(config)

    gen = generation.to_arrow()
    p = gen.num_rows
    completions = gen.column("completions")
    offsets = list_offsets(completions)
    n = int(offsets[-1]) if len(offsets) else 0
    meta: dict[str, Any] = {"dtypes": {}, "widths": {}}
    columns: dict[str, pa.Array | None] = {
        "step": pa.array(np.full(p, step, dtype=np.int64)),
        "rank": pa.array(np.full(p, rank, dtype=np.int32)),
        "group_index": pa.array(np.arange(p, dtype=np.int32)),
        "prompt": gen.column("prompt"),
        "answer": gen.column("answer"),
        "completions": completions,
        "ref_meta": _column(gen, "ref_meta"),
    }
    info, info_ids = _split_info(_column(gen, "completion_info"), offsets)
    columns["completion_info"] = info
    step_values: dict[str, Any] = {
        "step": step,
        "rank": rank,
        "kind": kind,
        "num_groups": p,
        "num_samples": n,
        "created_at": dt.datetime.now(dt.UTC),
        "policy_version": policy_version,
        "config": config_text,
    }

    # Token ids: exact scored ids first; the generator's ids otherwise.
    completion_ids = None
    if score_batch is not None:
        sb = score_batch.to_arrow()
        _check_rows("score_batch", sb.column("completion_ids"), n)
        sizes = np.diff(offsets)
        if p and int(sizes.min()) == 0:
            g = int(np.flatnonzero(sizes == 0)[0])
            raise LayoutError(
                f"RolloutBatch.from_parts: group {g} has no completions, so its prompt ids "
                "cannot be taken from score_batch"
            )
        columns["prompt_ids"] = sb.column("prompt_ids").take(pa.array(offsets[:-1]))
        completion_ids = _per_token(
            "score_batch.completion_ids", sb.column("completion_ids"), offsets, pa.int32()
        )
    if info_ids is not None:
        info_ids = info_ids.cast(_IDS_TYPE)
        if completion_ids is None:
            completion_ids = info_ids
            meta["info_token_ids"] = True
        elif info_ids.flatten().equals(completion_ids.flatten()):
            meta["info_token_ids"] = True
        else:
            columns["completion_info"] = _ids_into_extra(info, info_ids)
    columns["completion_ids"] = completion_ids

    reward_names: list[str] = []
    if rewards is not None:
        _check_offsets("rewards.advantage.grouped", rewards.advantage.grouped.offsets, offsets)
        rc = rewards.to_arrow()
        _check_offsets("rewards.q_distribution.grouped", list_offsets(rc.column("q")), offsets)
        for name in ("total_utils", "rewards", "advantages", "q"):
            columns[name] = _column(rc, name)
        for name in ("seed_semantic_entropy", "seed_advantage_scale"):
            columns[name] = _column(rc, name)
        if columns["rewards"] is not None:
            reward_names = [f.name for f in columns["rewards"].type]
        step_values.update(
            reward_mean=rewards.moments.mean,
            reward_std=rewards.moments.std,
            entropy_bonus_scale=rewards.entropy_bonus_scale,
            seed_alpha_effective=rewards.seed_alpha_effective,
            seed_max_possible_entropy=rewards.seed_max_possible_entropy,
        )
    if weights is not None:
        columns["weights"] = _grouped_floats("weights", weights, offsets)

    if reference is not None:
        rf = reference.to_arrow()
        for name in ("ref_logp_sum", "ref_tok_counts", "ref_logp_sum_raw", "ref_token_logp"):
            value = getattr(reference, name)
            if value is not None:
                meta["dtypes"][name] = dtype_name(value.dtype)
        if reference.ref_token_mask is not None:
            meta["dtypes"]["ref_token_mask"] = dtype_name(reference.ref_token_mask.dtype)
        meta["has_ref_mask"] = reference.ref_token_mask is not None
        if reference.ref_token_logp is not None:
            meta["widths"]["ref_token_logp"] = int(reference.ref_token_logp.shape[1])
        raw = rf.column("ref_logp_sum_raw")
        _check_rows("reference.ref_logp_sum_raw", raw, n)
        columns["ref_logp_sum_raw"] = _regroup(raw.cast(pa.float64()), offsets)
        columns["ref_tok_counts"] = _regroup(
            _counts_int32("reference.ref_tok_counts", rf.column("ref_tok_counts")), offsets
        )
        columns["ref_token_logp"] = _per_token(
            "reference.ref_token_logp", _column(rf, "ref_token_logp"), offsets, pa.float32()
        )
        step_values.update(
            ref_logp_mean=reference.ref_logp_mean,
            avg_completion_tokens=reference.avg_completion_tokens,
        )
    if scores is not None:
        ss = scores.to_arrow()
        for name, target in (
            ("behavior_logp_sum", "behavior_logp_sum"),
            ("policy_entropy_sum", "policy_entropy_sum"),
        ):
            value = _column(ss, name)
            if value is not None:
                _check_rows(f"scores.{name}", value, n)
                # Sums stay in double (semantics §6.6).
                columns[target] = _regroup(value.cast(pa.float64()), offsets)
        columns["behavior_token_logp"] = _per_token(
            "scores.old_token_logp", _column(ss, "old_token_logp"), offsets, pa.float32()
        )
    if behavior_token_logp is not None:
        # The sampler's own rows (one value per generated token) take precedence over the
        # scorer's view of them, which covers only the scored tokens.
        rows = (
            behavior_token_logp.to_arrow()
            if isinstance(behavior_token_logp, Ragged)
            else behavior_token_logp
        )
        columns["behavior_token_logp"] = _per_token(
            "behavior_token_logp", rows, offsets, pa.float32()
        )
    if length_stats is not None:
        step_values.update(
            _scalars(length_stats, [f.name for f in dataclasses.fields(length_stats)])
        )
    if loss is not None:
        bundle = loss.scalars if isinstance(loss, R.LossOutputs) else loss
        step_values.update(dataclasses.asdict(bundle))
    if diagnostics is not None:
        values = dataclasses.asdict(diagnostics)
        for name in ("kl_per_token_by_len_bucket", "kl_token_count_by_len_bucket"):
            values[name] = list(values[name].items())
        step_values.update(values)

    schema = S.group_schema(reward_names)
    fields, arrays = [], []
    for field in schema:
        array = columns.get(field.name)
        if array is None:
            continue
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        fields.append(pa.field(field.name, field.type, nullable=field.nullable))
        arrays.append(array if array.type == field.type else array.cast(field.type))
    metadata = {
        S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
        BATCH_META_KEY: json.dumps(meta, sort_keys=True).encode(),
    }
    groups = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=metadata))
    step_schema = S.step_schema()
    step_row = pa.RecordBatch.from_pydict(
        {f.name: [step_values.get(f.name)] for f in step_schema}, schema=step_schema
    )
    return cls(groups, step_row)


# ---------------------------------------------------------------------------- layout checks
def normalise(groups: pa.RecordBatch, step_row: pa.RecordBatch):
    """Check the layout and cast known columns to their v1 types (one pass over offsets)."""
    names = groups.schema.names
    for name in S.GROUP_REQUIRED:
        if name not in names:
            raise SchemaError(f"RolloutBatch.groups: missing required column {name!r}")
    if step_row.num_rows != 1:
        raise LayoutError(f"RolloutBatch.step_row: expected one row, got {step_row.num_rows}")
    for name in S.STEP_REQUIRED:
        if name not in step_row.schema.names:
            raise SchemaError(f"RolloutBatch.step_row: missing required column {name!r}")
    # Casts change nothing when types already match; they make a nullable-item list produced
    # by pyarrow defaults match the schema's non-nullable items, so files unify.
    arrays, fields = [], []
    for field in groups.schema:
        array = _combined(groups.column(field.name))
        target = _GROUP_TYPES.get(field.name)
        if field.name == "rewards":
            target = _rewards_target(array)
        if target is not None:
            array = _cast(field.name, array, target)
        arrays.append(array)
        fields.append(pa.field(field.name, array.type, nullable=field.name not in S.GROUP_REQUIRED))
    groups = pa.RecordBatch.from_arrays(
        arrays, schema=pa.schema(fields, metadata=groups.schema.metadata)
    )
    row_arrays, row_fields = [], []
    for field in step_row.schema:
        array = _combined(step_row.column(field.name))
        target = _STEP_TYPES.get(field.name)
        if target is not None:
            array = _cast(field.name, array, target)
        row_arrays.append(array)
        row_fields.append(
            pa.field(field.name, array.type, nullable=field.name not in S.STEP_REQUIRED)
        )
    step_row = pa.RecordBatch.from_arrays(
        row_arrays, schema=pa.schema(row_fields, metadata=step_row.schema.metadata)
    )
    _check_groups(groups, step_row)
    return groups, step_row


def _rewards_target(array: pa.Array) -> pa.DataType:
    if not pa.types.is_struct(array.type):
        raise SchemaError(
            f"RolloutBatch column 'rewards': expected struct<list<double>>, got {array.type}"
        )
    return S.rewards_type([f.name for f in array.type])


def _check_groups(groups: pa.RecordBatch, step_row: pa.RecordBatch) -> None:
    row = {n: step_row.column(n)[0].as_py() for n in S.STEP_REQUIRED}
    p = groups.num_rows
    for name in ("step", "rank"):
        column = groups.column(name)
        if column.null_count or (p and not pc.all(pc.equal(column, row[name])).as_py()):
            bad = int(np.flatnonzero(column.to_numpy(zero_copy_only=False) != row[name])[0])
            raise LayoutError(
                f"RolloutBatch.groups column {name!r}: expected {row[name]} (the step row's) "
                f"in every group, got {column[bad].as_py()} at group {bad}"
            )
    if row["num_groups"] != p:
        raise LayoutError(
            f"RolloutBatch.step_row.num_groups: expected {p} (rows of groups), got "
            f"{row['num_groups']}"
        )
    completions = groups.column("completions")
    if completions.null_count:
        raise LayoutError("RolloutBatch.groups column 'completions': a group is null")
    offsets = list_offsets(completions)
    n = int(offsets[-1]) if len(offsets) else 0
    if row["num_samples"] != n:
        raise LayoutError(
            f"RolloutBatch.step_row.num_samples: expected {n} (completions in all groups), "
            f"got {row['num_samples']}"
        )
    sizes = np.diff(offsets)
    for name in S.PER_COMPLETION_COLUMNS:
        if name == "completions" or name not in groups.schema.names:
            continue
        _check_grouped(name, groups.column(name), sizes)
    if "rewards" in groups.schema.names:
        rewards = groups.column("rewards")
        for i, field in enumerate(rewards.type):
            _check_grouped(f"rewards.{field.name}", rewards.field(i), sizes)
    for name in S.PER_TOKEN_COLUMNS:
        if name in groups.schema.names:
            inner = groups.column(name).flatten()
            if inner.null_count:
                raise LayoutError(
                    f"RolloutBatch column {name!r}: a completion's token list is null"
                )
            if inner.flatten().null_count:
                raise LayoutError(f"RolloutBatch column {name!r}: a null inside a token list")


def _check_grouped(name: str, column: pa.Array, sizes: np.ndarray) -> None:
    if column.null_count == len(column):
        return  # an optional column absent for the whole batch
    if column.null_count:
        bad = int(np.flatnonzero(~column.is_valid().to_numpy(zero_copy_only=False))[0])
        raise LayoutError(f"RolloutBatch column {name!r}: group {bad} is null")
    got = np.diff(list_offsets(column))
    if not np.array_equal(got, sizes):
        g = int(np.flatnonzero(got != sizes)[0])
        raise LayoutError(
            f"RolloutBatch column {name!r}: expected {sizes[g]} values at group {g} (as "
            f"completions), got {got[g]}"
        )
    if not pa.types.is_list(column.type.value_type) and column.flatten().null_count:
        raise LayoutError(f"RolloutBatch column {name!r}: a null inside a group")
