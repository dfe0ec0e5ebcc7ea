"""The layout rules of a :class:`~maxent_arrow.rollout.RolloutBatch`, without torch: the
metadata keys, the column types, the checks of ``RolloutBatch(groups, step_row)`` and the step
row as JSON.

The layout itself (every column, its type and meaning) is ``docs/arrow-layout.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.lists import list_offsets, single_array
from maxent_arrow.errors import LayoutError, SchemaError

__all__ = [
    "BATCH_META_KEY",
    "GROUP_TYPES",
    "STEP_META_KEY",
    "STEP_TYPES",
    "cast_column",
    "config_json",
    "int_arg",
    "normalise",
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
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SchemaError(f"RolloutBatch.{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise LayoutError(f"RolloutBatch.{name}: expected >= {minimum}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------- step row JSON
def step_row_to_json(row: pa.RecordBatch) -> str:
    """The one-row step batch as JSON text (maps as objects, timestamps as ISO strings)."""
    item = row.to_pylist()[0]
    for name, value in item.items():
        if isinstance(value, dt.datetime):
            item[name] = value.isoformat()
        elif isinstance(value, list) and value and isinstance(value[0], tuple):
            item[name] = dict(value)
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
        elif pa.types.is_map(kind) and isinstance(value, dict):
            value = list(value.items())
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
        if field.name == "rewards":
            target = _rewards_target(array)
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
