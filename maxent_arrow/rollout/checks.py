"""The checks and codecs of a :class:`~maxent_arrow.rollout.RolloutBatch`, without torch: the
metadata keys, the column types, the checks of ``RolloutBatch(groups, step_row)`` and the step
row as JSON.

The layout itself (every column, its type and meaning) is ``docs/arrow-layout.md``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arguments import is_int
from maxent_arrow.arrow import (
    decode_gaps,
    find_in_sets,
    first_bad_gap,
    list_offsets,
    single_array,
)
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError, SchemaError

__all__ = [
    "BATCH_META_KEY",
    "StepHeader",
    "batch_families",
    "declare_families",
    "GROUP_TYPES",
    "STEP_META_KEY",
    "STEP_TYPES",
    "cast_column",
    "check_offpolicy",
    "config_json",
    "int_arg",
    "normalise",
    "rewards_by_name",
    "step_row_from_json",
    "step_row_to_json",
]

# Groups-batch metadata (JSON): tensor dtypes and flags needed to give the seed objects back
# exactly as they were given; it travels in the Parquet and IPC schema metadata.
BATCH_META_KEY = b"maxent_arrow.batch"
# The step row of a batch, as JSON, in the metadata of ``to_arrow()``'s table.
STEP_META_KEY = b"maxent_arrow.step_row"

GROUP_TYPES = {f.name: f.type for f in S.group_schema()}
STEP_TYPES = {f.name: f.type for f in S.step_schema()}


@dataclasses.dataclass(frozen=True)
class StepHeader:
    """The identity, counts, time and config every step row starts with (its fields are the
    step table's columns of those names); each writer of step rows (:func:`step_values` of
    the seed records, the TRL and verl recorders) adds its statistics to :meth:`values`."""

    step: int
    rank: int
    kind: str
    num_groups: int
    num_samples: int
    config: str
    policy_version: int | None = None
    created_at: dt.datetime = dataclasses.field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def values(self) -> dict[str, Any]:
        """The header as step-row values (``step`` and ``rank`` checked ints)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["step"] = int_arg("step", self.step)
        out["rank"] = int_arg("rank", self.rank)
        return out


def batch_families(groups: pa.RecordBatch, step_row: pa.RecordBatch) -> tuple[str, ...]:
    """The run layout families of a batch (``docs/arrow-layout.md``): those its metadata
    declares (:func:`declare_families`; this library's trainer, the TRL and verl recorders),
    else those its columns imply. Always with ``core``."""
    raw = (groups.schema.metadata or {}).get(BATCH_META_KEY)
    declared = json.loads(raw).get("families") if raw else None
    if declared:
        found = {R.CORE, *declared}
    else:  # the columns that hold data (a column of nulls is another layout's padding)
        found = R.family_of_columns(_with_data(groups), R.GROUP) | R.family_of_columns(
            _with_data(step_row), R.STEP
        )
    unknown = sorted(found - set(R.FAMILIES))
    if unknown:
        raise SchemaError(
            f"RolloutBatch families: unknown {unknown}; expected some of {list(R.FAMILIES)}"
        )
    return tuple(sorted(found, key=R.FAMILIES.index))  # (in the registry's order)


def _with_data(batch: pa.RecordBatch) -> list[str]:
    return [
        name
        for name, column in zip(batch.schema.names, batch.columns)
        if column.null_count < len(column)
    ]


def declare_families(groups: pa.RecordBatch | pa.Table, families: tuple[str, ...]) -> Any:
    """``groups`` with ``families`` declared in its batch metadata (the run layout a writer
    of this kind of batch keeps, whatever columns one batch happens to fill)."""
    meta = dict(groups.schema.metadata or {})
    raw = meta.get(BATCH_META_KEY)
    batch_meta = json.loads(raw) if raw else {}
    batch_meta["families"] = sorted(set(families) | {R.CORE})
    meta[BATCH_META_KEY] = json.dumps(batch_meta, sort_keys=True).encode()
    return groups.replace_schema_metadata(meta)


def cast_column(name: str, array: pa.Array, target: pa.DataType) -> pa.Array:
    if array.type == target:
        return array
    try:
        return array.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise SchemaError(
            f"RolloutBatch column {name!r}: expected {target}, got {array.type}"
        ) from (exc)


def config_json(config: Mapping[str, Any] | None) -> str:
    if config is None:
        return "{}"
    if not isinstance(config, Mapping):
        raise SchemaError(f"RolloutBatch.config: expected a dict, got {type(config).__name__}")
    try:
        return json.dumps(dict(config), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"RolloutBatch.config: expected JSON-serialisable values ({exc})"
        ) from None


def int_arg(name: str, value: Any, *, minimum: int = 0) -> int:
    if not is_int(value):
        raise SchemaError(f"RolloutBatch.{name}: expected an int, got {type(value).__name__}")
    if int(value) < minimum:
        raise LayoutError(f"RolloutBatch.{name}: expected >= {minimum}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------- step row JSON
def step_row_to_json(row: pa.RecordBatch) -> str:
    """The one-row step batch as JSON text (timestamps as ISO strings)."""
    item = row.to_pylist()[0]
    for name, value in item.items():
        if isinstance(value, dt.datetime):
            item[name] = value.isoformat()
        elif isinstance(value, float) and not math.isfinite(value):
            item[name] = repr(value)  # JSON has no NaN; "nan"/"inf" round-trip via float()
    return json.dumps(item, sort_keys=True)


def step_row_from_json(text: str | bytes) -> pa.RecordBatch:
    item = json.loads(text)
    fields = []
    values = {}
    for name, value in item.items():
        kind = STEP_TYPES.get(name)
        if kind is None:
            continue
        if pa.types.is_timestamp(kind) and isinstance(value, str):
            value = dt.datetime.fromisoformat(value)
        elif pa.types.is_floating(kind) and isinstance(value, str):
            value = float(value)
        fields.append(pa.field(name, kind, nullable=name not in S.STEP_REQUIRED))
        values[name] = [value]
    order = [f for f in S.step_schema() if f.name in values]
    schema = pa.schema([f for f in order])
    return pa.RecordBatch.from_pydict({f.name: values[f.name] for f in order}, schema=schema)


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
        array = single_array(groups.column(field.name))
        target = GROUP_TYPES.get(field.name)
        if target is not None:
            array = cast_column(field.name, array, target)
        arrays.append(array)
        fields.append(pa.field(field.name, array.type, nullable=field.name not in S.GROUP_REQUIRED))
    groups = pa.RecordBatch.from_arrays(
        arrays, schema=pa.schema(fields, metadata=groups.schema.metadata)
    )
    row_arrays, row_fields = [], []
    for field in step_row.schema:
        array = single_array(step_row.column(field.name))
        target = STEP_TYPES.get(field.name)
        if target is not None:
            array = cast_column(field.name, array, target)
        row_arrays.append(array)
        row_fields.append(
            pa.field(field.name, array.type, nullable=field.name not in S.STEP_REQUIRED)
        )
    step_row = pa.RecordBatch.from_arrays(
        row_arrays, schema=pa.schema(row_fields, metadata=step_row.schema.metadata)
    )
    _check_groups(groups, step_row)
    return groups, step_row


def _check_groups(groups: pa.RecordBatch, step_row: pa.RecordBatch) -> None:
    row = {n: step_row.column(n)[0].as_py() for n in S.STEP_REQUIRED}
    p = groups.num_rows
    for name in ("step", "rank", "kind"):
        column = groups.column(name)
        if column.null_count or (p and not pc.all(pc.equal(column, row[name])).as_py()):
            values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=object)
            bad = int(np.flatnonzero(values != row[name])[0])
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
    _check_group_index(groups)
    _check_counts(groups, sizes)
    _check_prompts(groups)
    for name in S.PER_COMPLETION_COLUMNS:
        if name == "completions" or name not in groups.schema.names:
            continue
        _check_grouped(name, groups.column(name), sizes)
    _check_rewards(groups)
    for name in S.PER_TOKEN_COLUMNS:
        if name in groups.schema.names:
            inner = groups.column(name).flatten()
            if inner.null_count:
                raise LayoutError(
                    f"RolloutBatch column {name!r}: a completion's token list is null"
                )
            if inner.flatten().null_count:
                raise LayoutError(f"RolloutBatch column {name!r}: a null inside a token list")
    check_offpolicy(groups)


def _check_prompts(groups: pa.RecordBatch) -> None:
    """A group's prompt is text or chat messages, not both (neither is allowed: a table of
    token ids only, or rows merged from files that lack the prompt text)."""
    if "prompt_messages" not in groups.schema.names or "prompt" not in groups.schema.names:
        return
    text = np.asarray(groups.column("prompt").is_valid().to_numpy(zero_copy_only=False))
    chat = np.asarray(groups.column("prompt_messages").is_valid().to_numpy(zero_copy_only=False))
    bad = np.flatnonzero(text & chat)
    if bad.size:
        raise LayoutError(
            f"RolloutBatch columns 'prompt' and 'prompt_messages': group {int(bad[0])} has "
            "both; a prompt is text or chat messages"
        )


def _check_group_index(groups: pa.RecordBatch) -> None:
    """A ``group_index`` names one group of its append: a lifecycle record addresses a
    group by it (step, rank, kind, ``group_index``), so two rows sharing one would be
    trained, dropped and counted as one."""
    column = groups.column("group_index")
    if column.null_count:
        g = int(np.flatnonzero(~column.is_valid().to_numpy(zero_copy_only=False))[0])
        raise LayoutError(f"RolloutBatch column 'group_index': null at group {g}")
    values = np.asarray(column.to_numpy(zero_copy_only=False))
    order = np.argsort(values, kind="stable")
    repeated = np.flatnonzero(values[order][1:] == values[order][:-1])
    if repeated.size:
        value = values[order[repeated[0]]]
        rows = np.flatnonzero(values == value).tolist()
        raise LayoutError(
            f"RolloutBatch column 'group_index': expected one group per index, got "
            f"group_index {int(value)} at groups {rows}"
        )


def _check_counts(groups: pa.RecordBatch, sizes: np.ndarray) -> None:
    """``num_completions`` is each row's K; ``group_size`` (the whole group's) is not less."""
    own = np.asarray(groups.column("num_completions").to_numpy(zero_copy_only=False))
    if not np.array_equal(own, sizes):
        g = int(np.flatnonzero(own != sizes)[0])
        raise LayoutError(
            f"RolloutBatch column 'num_completions': expected {sizes[g]} at group {g} (its "
            f"completions), got {own[g]}"
        )
    whole = np.asarray(groups.column("group_size").to_numpy(zero_copy_only=False))
    if (whole < sizes).any():
        g = int(np.flatnonzero(whole < sizes)[0])
        raise LayoutError(
            f"RolloutBatch column 'group_size': expected at least {sizes[g]} at group {g} "
            f"(its completions), got {whole[g]}"
        )


def _check_rewards(groups: pa.RecordBatch) -> None:
    """Each completion has one reward value per reward name of its row."""
    names = groups.schema.names
    if ("reward_names" in names) != ("reward_values" in names):
        raise SchemaError("RolloutBatch: reward_names and reward_values go together")
    if "reward_names" not in names:
        return
    reward_names, values = groups.column("reward_names"), groups.column("reward_values")
    if reward_names.null_count != values.null_count:
        raise LayoutError("RolloutBatch: reward_names and reward_values are null in other rows")
    if values.null_count == len(values):
        return
    per_row = np.diff(list_offsets(reward_names))
    per_value = np.diff(list_offsets(values.flatten()))
    expected = np.repeat(per_row, np.diff(list_offsets(values)))
    if not np.array_equal(per_value, expected):
        i = int(np.flatnonzero(per_value != expected)[0])
        offsets = list_offsets(values)
        g = int(np.searchsorted(offsets, i, side="right") - 1)
        raise LayoutError(
            f"RolloutBatch column 'reward_values': expected {expected[i]} values (one per "
            f"reward name) at group {g}, sample {i - offsets[g]}, got {per_value[i]}"
        )


def rewards_by_name(groups: pa.RecordBatch) -> dict[str, np.ndarray]:
    """The raw rewards of every completion, ``{name: [N] float64}`` (NaN where a row lacks
    that reward function), in the order the names first appear."""
    if "reward_names" not in groups.schema.names:
        return {}
    reward_names = single_array(groups.column("reward_names"))
    values = single_array(groups.column("reward_values"))
    if values.null_count == len(values):
        return {}
    sizes = np.diff(list_offsets(values))
    flat = np.asarray(values.flatten().flatten().to_numpy(zero_copy_only=False), dtype=np.float64)
    n = int(sizes.sum())
    first = reward_names[0].as_py() if len(reward_names) else None
    if (
        first is not None
        and pc.all(pc.equal(pc.list_value_length(reward_names), len(first))).as_py()
    ):
        same = pc.equal(reward_names.flatten(), pa.array(first * len(reward_names), pa.string()))
        if pc.all(same).as_py():  # one set of reward functions for every row: one reshape
            matrix = flat.reshape(n, len(first))
            return {name: matrix[:, j] for j, name in enumerate(first)}
    names_per_row = reward_names.to_pylist()
    out: dict[str, np.ndarray] = {}
    start_row, start_value = 0, 0
    for g, row in enumerate(names_per_row):
        count = int(sizes[g])
        if row:
            block = flat[start_value : start_value + count * len(row)].reshape(count, len(row))
            for j, name in enumerate(row):
                out.setdefault(name, np.full(n, np.nan))[start_row : start_row + count] = block[
                    :, j
                ]
            start_value += count * len(row)
        start_row += count
    return out


# Per-completion columns that are null in the rows that do not use them: completion_messages
# in a group whose completions are plain strings.
_NULL_ROWS_ALLOWED = ("completion_messages",)


def _check_grouped(name: str, column: pa.Array, sizes: np.ndarray) -> None:
    if column.null_count == len(column):
        return  # an optional column absent for the whole batch
    valid = np.ones(len(column), dtype=bool)
    if column.null_count:
        valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
        if name not in _NULL_ROWS_ALLOWED:
            bad = int(np.flatnonzero(~valid)[0])
            raise LayoutError(f"RolloutBatch column {name!r}: group {bad} is null")
    got = np.diff(list_offsets(column))
    if not np.array_equal(got[valid], sizes[valid]):
        g = int(np.flatnonzero(valid & (got != sizes))[0])
        raise LayoutError(
            f"RolloutBatch column {name!r}: expected {sizes[g]} values at group {g} (as "
            f"completions), got {got[g]}"
        )
    if not pa.types.is_list(column.type.value_type) and column.flatten().null_count:
        raise LayoutError(f"RolloutBatch column {name!r}: a null inside a group")


# ---------------------------------------------------------------------------- off-policy
def _where(groups: pa.RecordBatch, sample: int, token: int | None = None) -> str:
    """``group g, sample i[, token t]`` of flat completion ``sample``."""
    offsets = list_offsets(groups.column("completions"))
    g = int(np.searchsorted(offsets, sample, side="right") - 1)
    text = f"group {g}, sample {sample - int(offsets[g])}"
    return text if token is None else f"{text}, token {token}"


def _flat(groups: pa.RecordBatch, name: str) -> pa.Array | None:
    """Column ``name`` flattened to one item per completion, or None when absent or all null."""
    if name not in groups.schema.names:
        return None
    column = single_array(groups.column(name))
    if column.null_count == len(column):
        return None
    return column.flatten()


def _numbers(array: pa.Array) -> np.ndarray:
    return np.asarray(array.to_numpy(zero_copy_only=False))


def check_offpolicy(groups: pa.RecordBatch) -> None:
    """The off-policy contract's columns (``docs/arrow-layout.md``, "Off-policy data"): versions
    >= 0 and their runs well formed, known log-prob semantics, sampling parameters in range,
    per-token sets with one set per completion token, kept sets ascending and holding the
    sampled token, top-k ids and log-probs parallel; a :class:`LayoutError` names the column
    and the group, sample and token. Vectorised over offsets."""
    versions = _flat(groups, "completion_policy_version")
    if versions is not None:
        v = _numbers(versions)
        if (v < 0).any():
            i = int(np.flatnonzero(v < 0)[0])
            raise LayoutError(
                f"RolloutBatch column 'completion_policy_version': expected >= 0 at "
                f"{_where(groups, i)}, got {int(v[i])}"
            )
    semantics = _flat(groups, "behavior_logp_semantics")
    if semantics is not None:
        known = pc.is_in(semantics, value_set=pa.array(R.LOGP_SEMANTICS))
        bad = np.flatnonzero(~_numbers(known).astype(bool))
        if bad.size:
            i = int(bad[0])
            raise LayoutError(
                f"RolloutBatch column 'behavior_logp_semantics': expected one of "
                f"{list(R.LOGP_SEMANTICS)} at {_where(groups, i)}, got {semantics[i].as_py()!r}"
            )
    _check_sampling(groups)
    _check_version_runs(groups)
    _check_token_sets(groups)


# Each sampling parameter's valid range: (low, low inclusive, high, high inclusive).
_RANGES = {
    "temperature": (0.0, False, math.inf, False),
    "top_p": (0.0, False, 1.0, True),
    "top_k": (0.0, True, math.inf, False),
    "min_p": (0.0, True, 1.0, True),
}


def _check_sampling(groups: pa.RecordBatch) -> None:
    for param, name in R.SAMPLING_COLUMNS.items():
        values = _flat(groups, name)
        if values is None:
            continue
        x = _numbers(values).astype(np.float64)
        low, low_in, high, high_in = _RANGES[param]
        ok = (x >= low if low_in else x > low) & (x <= high if high_in else x < high)
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            raise LayoutError(
                f"RolloutBatch column {name!r}: {param} out of range at {_where(groups, i)}: "
                f"{x[i]}"
            )


def _token_counts(groups: pa.RecordBatch) -> np.ndarray | None:
    ids = _flat(groups, "completion_ids")
    return None if ids is None else np.diff(list_offsets(ids))


def _check_version_runs(groups: pa.RecordBatch) -> None:
    starts, versions = _flat(groups, "version_run_starts"), _flat(groups, "version_run_versions")
    if starts is None and versions is None:
        return
    if starts is None or versions is None:
        raise SchemaError(
            "RolloutBatch: version_run_starts and version_run_versions go together"
        )
    runs = np.diff(list_offsets(starts))
    if not np.array_equal(runs, np.diff(list_offsets(versions))):
        i = int(np.flatnonzero(runs != np.diff(list_offsets(versions)))[0])
        raise LayoutError(
            f"RolloutBatch column 'version_run_versions': expected one version per run of "
            f"'version_run_starts' ({runs[i]}) at {_where(groups, i)}"
        )
    s, v = _numbers(starts.flatten()), _numbers(versions.flatten())
    owner = np.repeat(np.arange(len(runs)), runs)
    first = np.zeros(len(s), dtype=bool)
    first[list_offsets(starts)[:-1][runs > 0]] = True
    problems = [
        ("version_run_starts", first & (s != 0), "the first run starts at token 0"),
        ("version_run_starts", ~first & (np.diff(s, prepend=0) <= 0), "run starts increase"),
        ("version_run_versions", ~first & (np.diff(v, prepend=0) < 0), "versions never decrease"),
    ]
    counts = _token_counts(groups)
    if counts is not None:
        problems.append(("version_run_starts", s >= counts[owner], "runs start below the "
                         "completion's token count"))
    policy = _flat(groups, "completion_policy_version")
    if policy is not None:
        problems.append(("version_run_versions", first & (v != _numbers(policy)[owner]),
                         "the first run's version is completion_policy_version"))
    for name, bad, rule in problems:
        hits = np.flatnonzero(bad)
        if hits.size:
            j = int(hits[0])
            raise LayoutError(
                f"RolloutBatch column {name!r}: {rule}; not so at "
                f"{_where(groups, int(owner[j]))}, run {j - int(list_offsets(starts)[owner[j]])}"
            )


def _check_token_sets(groups: pa.RecordBatch) -> None:
    counts = _token_counts(groups)
    ids = _flat(groups, "completion_ids")
    token_sets = {}
    for name in R.names(R.GROUP, level="token", where=lambda c: c.kept_set or (
            c.name.startswith("topk_"))):
        rows = _flat(groups, name)
        if rows is None:
            continue
        if counts is None:
            raise SchemaError(f"RolloutBatch column {name!r}: needs completion_ids (its tokens)")
        got = np.diff(list_offsets(rows))
        valid = _numbers(rows.is_valid()).astype(bool)
        bad = np.flatnonzero(valid & (got != counts))
        if bad.size:
            i = int(bad[0])
            raise LayoutError(
                f"RolloutBatch column {name!r}: expected {counts[i]} token sets (one per "
                f"completion token) at {_where(groups, i)}, got {got[i]}"
            )
        token_sets[name] = rows
    if "topk_token_ids" in token_sets or "topk_token_logp" in token_sets:
        a, b = token_sets.get("topk_token_ids"), token_sets.get("topk_token_logp")
        if a is None or b is None:
            raise SchemaError("RolloutBatch: topk_token_ids and topk_token_logp go together")
        ka, kb = np.diff(list_offsets(a.flatten())), np.diff(list_offsets(b.flatten()))
        if not np.array_equal(ka, kb):
            t = int(np.flatnonzero(ka != kb)[0])
            i, tok = _token_of(a, t)
            raise LayoutError(
                f"RolloutBatch column 'topk_token_logp': expected {ka[t]} log-probs (one per "
                f"top-k id) at {_where(groups, i, tok)}, got {kb[t]}"
            )
    kept = token_sets.get("kept_token_ids")
    if kept is None or ids is None:
        return
    sets = kept.flatten()
    set_offsets = list_offsets(sets)
    gaps = _numbers(sets.flatten()).astype(np.int64)
    sizes = np.diff(set_offsets)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    bad = first_bad_gap(gaps, set_offsets)
    if bad is not None:
        i, tok = _token_of(kept, int(owner[bad]))
        raise LayoutError(
            f"RolloutBatch column 'kept_token_ids': a set is not ascending and gap-coded at "
            f"{_where(groups, i, tok)}"
        )
    decoded = decode_gaps(gaps, set_offsets)
    sampled = _numbers(ids.flatten()).astype(np.int64)
    # Each token's sampled id must be in its set (ascending: checked above).
    tokens = np.arange(len(sizes), dtype=np.int64)
    found = find_in_sets(decoded, set_offsets, sampled, tokens, ascending=True) >= 0
    missing = np.flatnonzero(~found)
    if missing.size:
        t = int(missing[0])
        i, tok = _token_of(kept, t)
        raise LayoutError(
            f"RolloutBatch column 'kept_token_ids': the sampled token {int(sampled[t])} is not "
            f"in its kept set at {_where(groups, i, tok)}"
        )


def _token_of(rows: pa.Array, token: int) -> tuple[int, int]:
    """(completion, token within it) of flat token ``token`` of per-completion ``rows``."""
    offsets = list_offsets(rows)
    i = int(np.searchsorted(offsets, token, side="right") - 1)
    return i, token - int(offsets[i])
