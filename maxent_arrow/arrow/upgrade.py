"""Reading older files: schema 1.x group and step tables in the layout of schema 2.0.

Version 2 changed, on top of 1.x: a ``kind`` column in group files (1.x kept it in the file
name only), a stored group identity (``group_id``, ``group_size``, ``num_completions``,
``completion_index``), raw rewards as ``reward_names`` / ``reward_values`` instead of a struct
with one field per reward function, and the KL length buckets of the step table as lists
instead of maps (``docs/arrow-layout.md``). Everything here is Arrow and numpy, no torch.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.identity import completion_index_of
from maxent_arrow.arrow.lists import list_offsets, regroup, single_array

__all__ = [
    "GROUP_ID_INPUTS",
    "OFFSET_BASIS",
    "needs_upgrade",
    "reward_lists",
    "upgrade_groups",
    "upgrade_steps",
]

# What a 1.x group table needs to be read in the 2.0 layout: the columns of its default group
# id (`{step}.{rank}.{group_index}`), and a per-completion column for the group offsets (K).
GROUP_ID_INPUTS = ("step", "rank", "group_index")
OFFSET_BASIS = ("completions", "total_utils")


def needs_upgrade(version: str | bytes | None) -> bool:
    """Whether a file written with schema ``version`` is read through this module."""
    if isinstance(version, bytes):
        version = version.decode()
    return version is not None and int(str(version).split(".")[0]) < S.SCHEMA_MAJOR


def reward_lists(
    names: list[str], values: list[np.ndarray], offsets: np.ndarray
) -> tuple[pa.Array, pa.Array]:
    """``reward_names`` and ``reward_values`` for rows grouped by ``offsets`` whose
    completions all have the rewards ``names`` (``values[j]``: ``[N]`` floats of ``names[j]``).
    """
    p = len(offsets) - 1
    r = len(names)
    name_offsets = np.arange(p + 1, dtype=np.int64) * r
    reward_names = regroup(
        pa.array(np.tile(np.array(names, dtype=object), p), pa.string()), name_offsets
    )
    n = int(offsets[-1]) if len(offsets) else 0
    matrix = np.empty((n, r), dtype=np.float64)
    for j, column in enumerate(values):
        matrix[:, j] = column
    inner = regroup(pa.array(matrix.reshape(-1)), np.arange(n + 1, dtype=np.int64) * r)
    return reward_names, regroup(inner, offsets)


def _v1_rewards(rewards: pa.Array, offsets: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """The 1.x ``rewards`` struct (one ``list<double>`` field per function, null in rows
    written before that function existed) as ``reward_names`` / ``reward_values``."""
    fields = [f.name for f in rewards.type]
    valid = np.array(
        [
            np.asarray(rewards.field(i).is_valid().to_numpy(zero_copy_only=False))
            for i in range(len(fields))
        ],
        dtype=bool,
    ).reshape(len(fields), -1)
    if rewards.null_count:
        valid &= np.asarray(rewards.is_valid().to_numpy(zero_copy_only=False))[None, :]
    p = len(offsets) - 1
    names_parts, values_parts = [None] * p, [None] * p
    # One pass per distinct set of present rewards (a run has one or two), not per row.
    patterns = {tuple(valid[:, g]) for g in range(p)}
    for pattern in patterns:
        rows = np.flatnonzero([tuple(valid[:, g]) == pattern for g in range(p)])
        present = [f for f, keep in zip(fields, pattern) if keep]
        take = pa.array(rows)
        sizes = np.diff(offsets)[rows]
        sub_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=sub_offsets[1:])
        columns = [
            np.asarray(
                rewards.field(fields.index(f)).take(take).flatten().to_numpy(zero_copy_only=False),
                dtype=np.float64,
            )
            for f in present
        ]
        names, values = reward_lists(present, columns, sub_offsets)
        for k, g in enumerate(rows):
            names_parts[g] = names.slice(k, 1)
            values_parts[g] = values.slice(k, 1)
    if p == 0:
        return reward_lists([], [], offsets)
    return pa.concat_arrays(names_parts), pa.concat_arrays(values_parts)


def upgrade_groups(table: pa.Table, *, kind: str) -> pa.Table:
    """A 1.x group table (all of one ``kind``, which 1.x kept in the file name) in the
    2.0 layout; columns not read stay absent."""
    names = table.column_names
    p = table.num_rows
    columns: dict[str, pa.Array] = {n: single_array(table.column(n)) for n in names}
    columns["kind"] = pa.array([kind] * p, pa.string())
    basis = next((columns[n] for n in OFFSET_BASIS if n in columns), None)
    offsets = None
    if basis is not None:
        offsets = list_offsets(basis)
        sizes = np.diff(offsets).astype(np.int32)
        columns["num_completions"] = pa.array(sizes)
        columns["group_size"] = pa.array(sizes)
        columns["completion_index"] = completion_index_of(sizes)
    if set(GROUP_ID_INPUTS) <= set(names):
        columns["group_id"] = pc.binary_join_element_wise(
            pc.cast(columns["step"], pa.string()),
            pc.cast(columns["rank"], pa.string()),
            pc.cast(columns["group_index"], pa.string()),
            ".",
        )
    rewards = columns.pop("rewards", None)
    if rewards is not None and basis is not None:
        assert offsets is not None  # set with basis
        columns["reward_names"], columns["reward_values"] = _v1_rewards(rewards, offsets)
    order = [f for f in S.GROUP_FIELDS if f.name in columns]
    extra = [n for n in columns if n not in S.group_schema().names]
    fields = [pa.field(f.name, f.type, nullable=f.nullable) for f in order]
    arrays = [
        columns[f.name].cast(f.type) if columns[f.name].type != f.type else columns[f.name]
        for f in order
    ]
    fields += [pa.field(n, columns[n].type) for n in extra]
    arrays += [columns[n] for n in extra]
    meta = dict(table.schema.metadata or {})
    meta[S.METADATA_KEY] = S.SCHEMA_VERSION.encode()
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))


def upgrade_steps(table: pa.Table) -> pa.Table:
    """A 1.x step table in the 2.0 layout: the KL bucket maps as lists over
    ``kl_length_buckets``."""
    columns = {n: single_array(table.column(n)) for n in table.column_names}
    maps = [n for n in S.BUCKET_COLUMNS if n in columns and pa.types.is_map(columns[n].type)]
    if maps:
        # Each row keeps its own buckets (the labels of its first map), in their order.
        rows = {n: columns[n].to_pylist() for n in maps}
        labels: list[list[str] | None] = []
        for i in range(table.num_rows):
            first = next((rows[n][i] for n in maps if rows[n][i] is not None), None)
            labels.append(None if first is None else [k for k, _ in first])
        columns["kl_length_buckets"] = pa.array(labels, pa.list_(pa.string()))
        for n in maps:
            out = []
            for row_labels, items in zip(labels, rows[n]):
                found = dict(items or [])
                out.append(
                    None if row_labels is None else [float(found.get(k, 0.0)) for k in row_labels]
                )
            columns[n] = pa.array(out, pa.list_(pa.float64()))
    order = [f for f in S.STEP_FIELDS if f.name in columns]
    extra = [n for n in columns if n not in S.step_schema().names]
    fields = [pa.field(f.name, f.type, nullable=f.nullable) for f in order] + [
        pa.field(n, columns[n].type) for n in extra
    ]
    arrays = [
        columns[f.name].cast(f.type) if columns[f.name].type != f.type else columns[f.name]
        for f in order
    ]
    arrays += [columns[n] for n in extra]
    meta = dict(table.schema.metadata or {})
    meta[S.METADATA_KEY] = S.SCHEMA_VERSION.encode()
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))
