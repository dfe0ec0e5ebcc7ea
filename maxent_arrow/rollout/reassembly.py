"""``reassemble``: the parts of a group that ranks wrote separately, merged into one row.

A trainer that spreads one prompt's K completions over processes (TRL's sampler does) has each
rank write the part it holds: rows of one step and kind with the same ``group_id``, each with
its own ``num_completions``, the whole group's ``group_size`` and each completion's
``completion_index`` in the whole group (``docs/arrow-layout.md``). Readers that need whole
groups (replay, the SQL views, :func:`~maxent_arrow.rollout.recompute`) call
:func:`reassemble` on the rows of a step from every rank.

The choice: merge at read time, not at write time. Each process writes only what it holds (no
gather to one process, no cross-rank coordination of a write), and a merge needs nothing but
the rows themselves.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow import single_array
from maxent_arrow.errors import LayoutError, SchemaError

__all__ = ["reassemble"]

_KEYS = ("step", "kind", "group_id")


def reassemble(table: pa.Table | pa.RecordBatch) -> pa.Table:
    """Merge the parts of each group (same ``step``, ``kind`` and ``group_id``) into one row.

    Parameters
    ----------
    table:
        Group rows in the store's group layout, e.g. ``store.read(steps=[s])`` (every rank of a
        step). Rows of different steps and kinds may be mixed.

    Returns
    -------
    pa.Table
        One row per group, in the order of each group's first row in ``table``, with the same
        schema. A group stored whole is returned as stored; a table with no group in parts is
        returned unchanged (no copy). In a merged row:

        - per-completion columns (``completions``, ``completion_ids``, ``advantages``,
          ``reward_values``, ... and any extra list column whose length is
          ``num_completions`` in every row) hold the completions of all parts, ordered by
          ``completion_index`` (by row order where it is absent); a column that is null in
          some part is null for the merged group;
        - ``num_completions`` is the sum over the parts; a group some rank did not write stays
          short of its ``group_size``;
        - every other column (``rank``, ``group_index``, ``prompt``, ``prompt_ids``,
          ``reward_names``, ...) is the first part's (with store reads, the lowest rank's).

    Raises
    ------
    LayoutError
        A completion index that two parts of one group both hold (a part written twice), or
        more completions than the group's ``group_size``, naming the step, kind and group.

    Notes
    -----
    Vectorised: one sort of the row keys, one sort of the completions by (group, index), and
    one ``take`` per per-completion column; no Python loop over groups or completions.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise SchemaError(f"reassemble: expected a pyarrow Table, got {type(table).__name__}")
    names = table.schema.names
    for name in ("step", "group_id", "completions"):
        if name not in names:
            raise SchemaError(f"reassemble: missing required column {name!r}")
    n = table.num_rows
    if n < 2:
        return table
    row_key, heads = _group_keys(table)
    if len(heads) == n:
        return table  # no group is in parts
    # Output groups in the order of their first row; `out_of` maps a key to its output row.
    order = np.argsort(heads, kind="stable")
    out_of = np.empty(len(heads), dtype=np.int64)
    out_of[order] = np.arange(len(heads))
    head_rows = heads[order]

    sizes = np.asarray(pc.list_value_length(table.column("completions")).to_numpy(), np.int64)
    comp_row = np.repeat(np.arange(n), sizes)
    comp_out = out_of[row_key][comp_row]
    index = _completion_index(table, int(sizes.sum()))
    perm = np.lexsort((index, comp_out))
    new_sizes = np.bincount(comp_out, minlength=len(heads)).astype(np.int64)
    _check_merged(table, perm, comp_out, index, new_sizes, head_rows)
    offsets = np.concatenate([[0], np.cumsum(new_sizes)])

    columns = []
    for field in table.schema:
        column = table.column(field.name)
        if field.name == "num_completions":
            merged = pa.array(new_sizes, field.type)
        elif _is_per_completion(field, column, sizes):
            values, valid = _merge_values(column, comp_row, perm, row_key, out_of)
            merged = _list_of(values, valid, offsets, field.type, new_sizes)
        else:
            merged = column.take(pa.array(head_rows))
        columns.append(merged)
    return pa.Table.from_arrays(columns, schema=table.schema)


def _group_keys(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group key (0..G-1) and each key's first row, from one sort."""
    n = table.num_rows
    keys = {name: table.column(name) for name in _KEYS if name in table.schema.names}
    keys["__position"] = pa.array(np.arange(n))
    sort_keys = [(name, "ascending") for name in keys]
    sort = pc.sort_indices(pa.table(keys), sort_keys=sort_keys).to_numpy()
    new = np.zeros(n, dtype=bool)
    new[0] = True
    for name in keys:
        if name == "__position":
            continue
        values = keys[name].take(pa.array(sort))
        differs = pc.not_equal(values.slice(1), values.slice(0, n - 1))
        new[1:] |= np.asarray(differs.to_numpy(zero_copy_only=False), dtype=bool)
    key_sorted = np.cumsum(new) - 1
    row_key = np.empty(n, dtype=np.int64)
    row_key[sort] = key_sorted
    # The position is the last sort key, so a key's first sorted row is its first row.
    return row_key, sort[new]


def _completion_index(table: pa.Table, total: int) -> np.ndarray:
    """Each completion's index in its whole group (row order where the column is absent)."""
    if "completion_index" in table.schema.names:
        column = table.column("completion_index")
        if column.null_count == 0:
            flat = pc.list_flatten(column)
            if len(flat) == total:
                return np.asarray(flat.to_numpy(), dtype=np.int64)
    return np.arange(total, dtype=np.int64)


def _check_merged(
    table: pa.Table,
    perm: np.ndarray,
    comp_out: np.ndarray,
    index: np.ndarray,
    new_sizes: np.ndarray,
    head_rows: np.ndarray,
) -> None:
    """No completion index twice in a group, no group larger than its group_size."""
    g, i = comp_out[perm], index[perm]
    twice = np.flatnonzero((g[1:] == g[:-1]) & (i[1:] == i[:-1]))
    if len(twice):
        group = int(g[twice[0]])
        raise LayoutError(
            f"reassemble: {_where(table, head_rows[group])}: completion_index "
            f"{int(i[twice[0]])} is held by two parts (a part written twice?)"
        )
    if "group_size" in table.schema.names:
        whole = table.column("group_size").take(pa.array(head_rows)).to_numpy()
        over = np.flatnonzero(new_sizes > whole)
        if len(over):
            group = int(over[0])
            raise LayoutError(
                f"reassemble: {_where(table, head_rows[group])}: {int(new_sizes[group])} "
                f"completions in its parts, more than its group_size {int(whole[group])}"
            )


def _where(table: pa.Table, row: int) -> str:
    values = {n: table.column(n)[int(row)].as_py() for n in _KEYS if n in table.schema.names}
    return ", ".join(f"{name} {value!r}" for name, value in values.items())


def _is_per_completion(field: pa.Field, column: pa.ChunkedArray, sizes: np.ndarray) -> bool:
    """A known per-completion column, or an extra list column of ``num_completions`` items
    in every row that has it."""
    if field.name in S.PER_COMPLETION_COLUMNS:
        return True
    if field.name in S.GROUP_REQUIRED or any(f.name == field.name for f in S.GROUP_FIELDS):
        return False
    if not (pa.types.is_list(field.type) or pa.types.is_large_list(field.type)):
        return False
    if column.null_count == len(column):
        return False
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    valid = ~np.isnan(lengths) if lengths.dtype.kind == "f" else np.ones(len(lengths), bool)
    return bool(np.array_equal(lengths[valid].astype(np.int64), sizes[valid]))


def _merge_values(
    column: pa.ChunkedArray,
    comp_row: np.ndarray,
    perm: np.ndarray,
    row_key: np.ndarray,
    out_of: np.ndarray,
) -> tuple[pa.Array, np.ndarray]:
    """The completions' values in merged order, and which output groups are valid."""
    flat = pc.list_flatten(column)
    groups = len(out_of)
    if column.null_count == 0:
        values = flat.take(pa.array(perm))
        return _single(values), np.ones(groups, dtype=bool)
    row_valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    # A merged group is valid only if every part of it is.
    invalid_parts = np.bincount(out_of[row_key][~row_valid], minlength=groups)
    group_valid = invalid_parts == 0
    comp_valid = row_valid[comp_row]
    position = np.cumsum(comp_valid) - 1  # where each valid completion's value is in `flat`
    comp_out = out_of[row_key][comp_row]
    keep = perm[group_valid[comp_out[perm]]]
    values = flat.take(pa.array(position[keep]))
    return _single(values), group_valid


def _list_of(
    values: pa.Array,
    valid: np.ndarray,
    offsets: np.ndarray,
    kind: pa.DataType,
    new_sizes: np.ndarray,
) -> pa.Array:
    """The merged list column: ``values`` cut by ``offsets``, null where not ``valid``."""
    if not valid.all():
        offsets = np.concatenate([[0], np.cumsum(np.where(valid, new_sizes, 0))])
    mask = None if valid.all() else pa.array(~valid)
    if pa.types.is_large_list(kind):
        array = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values, mask=mask)
    else:
        array = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=mask)
    return array.cast(kind) if array.type != kind else array


def _single(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return single_array(values) if isinstance(values, pa.ChunkedArray) else values
