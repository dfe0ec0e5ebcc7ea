"""The per-completion relations the ready-made queries run on.

:class:`RunRelations` wraps a store's SQL views (:class:`~maxent_arrow.store.SqlViews`) and
knows which per-completion scalars a run has (``total_util``, ``advantage``, ``q``,
``weight``, one ``reward_<name>`` per reward function, ``length``, ``truncated``...), as list
expressions over a group row. :meth:`RunRelations.flat` gives them one row per completion:
from the in-memory ``sample_scalars`` table after :meth:`materialize`, else one ``UNNEST``
per needed list column, in lockstep, straight from the Parquet scan (never a token or text
column).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError
from maxent_arrow.store import SqlViews
from maxent_arrow.store.sql.plan import (
    SAMPLE_ALIASES,
    UNSCORED_AS_NULL,
    quote,
    reward_aliases,
    scored,
    sql_string,
)

__all__ = ["GROUP_KEY", "RunRelations", "flat_columns"]

# A group is (step, kind, group_id): the parts of a group that ranks stored separately
# (TRL spreads a prompt's completions over processes) count as one group.
GROUP_KEY = ", ".join(R.GROUP_KEY)
_ROW_KEY = ", ".join((*R.ROW_KEY, "group_id"))
# The per-completion scores (float columns; group-table names) -> flat aliases: the samples
# view's. Rankings and histograms take any of them by either name.
SCORE_COLUMNS = tuple(
    c.name
    for c in R.columns(R.GROUP, level="completion")
    if c.name in R.numbers() and pa.types.is_floating(c.type.value_type)
)
SCORE_ALIASES = {column: SAMPLE_ALIASES[column] for column in SCORE_COLUMNS}
# What `materialize` keeps in memory: the scalars the ready-made queries use.
_MATERIALIZED = ("total_util", "advantage", "q", "weight", "length")


def flat_columns(columns: set[str], reward_names: Sequence[str]) -> dict[str, str]:
    """The per-completion scalars of a run, as ``alias -> list expression over a group row``.

    Only scalars: token and text columns are never part of it. ``length`` is T_i
    (``ref_tok_counts``, else the generator's token count).
    """
    out: dict[str, str] = {}
    for column in SCORE_COLUMNS:
        if column in columns:
            out[SAMPLE_ALIASES[column]] = (
                f"list_transform({quote(column)}, lambda x: {scored('x')})"
                if column in UNSCORED_AS_NULL
                else quote(column)
            )
    if "reward_values" in columns:
        for name, alias in reward_aliases(reward_names).items():
            at = f"list_position(reward_names, {sql_string(name)})"
            out[alias] = f"list_transform(reward_values, lambda x: {scored(f'x[{at}]')})"
    info = "completion_info" in columns
    if "ref_tok_counts" in columns:
        out["length"] = "ref_tok_counts"
    elif info:
        out["length"] = "list_transform(completion_info, lambda x: x.token_count)"
    if info:
        out["truncated"] = (
            "list_transform(completion_info, "
            "lambda x: coalesce(x.truncated, x.finish_reason = 'length'))"
        )
    return out


def _flatten_groups(rows: pa.Table, aliases: list[str]) -> pa.Table:
    """One row per completion from group rows (``step, rank, group_index, _k`` and aligned
    list columns): the lists flattened (zero-copy), the keys repeated K times.

    Flattening Arrow lists and scanning the result in place (a registered Arrow table) is
    cheaper than ``CREATE TABLE ... AS SELECT unnest(...)``, which copies every value into
    DuckDB's own storage (``benchmarks/bench_analytics.py``).
    """
    sizes = pc.fill_null(rows.column("_k"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    owner = pa.array(np.repeat(np.arange(sizes.size), sizes))
    starts = np.cumsum(sizes) - sizes
    # The row key, repeated per completion (`kind` is the table's own: one table per kind).
    columns: dict[str, Any] = {
        name: rows.column(name).take(owner) for name in R.ROW_KEY if name != "kind"
    }
    # Dictionary-encoded: one small string per group, an int per completion.
    columns["group_id"] = rows.column("group_id").dictionary_encode().take(owner)
    columns["sample_index"] = pa.array(np.arange(len(owner)) - starts[owner.to_numpy()])
    for alias in aliases:
        chunks = [chunk.flatten() for chunk in rows.column(alias).chunks]
        columns[alias] = pa.chunked_array(chunks, type=rows.schema.field(alias).type.value_type)
    return pa.table(columns)


class RunRelations:
    """SQL relations of one completion per row over a store's views."""

    def __init__(self, views: SqlViews):
        self.views = views
        self.materialized = False
        self._materialized: set[str] = set()
        self.rebuild()

    def rebuild(self) -> None:
        """Re-read the views' schema and reward names (after :meth:`SqlViews.refresh`)."""
        self.group_columns = set(self.views.data_columns)  # padding-only columns left out
        self.reward_names: list[str] = list(self.views.reward_names)
        self.flat_exprs = flat_columns(self.group_columns, self.reward_names)
        if self.materialized:
            self.materialized = False
            self.materialize()

    def sql(self, query: str, params: Any = None) -> pa.Table:
        """Run one of this library's own queries (checked like any query, not sandboxed)."""
        return self.views.query(query, params, trusted=True)

    def where(self, *, kind: str | None, steps: int | Iterable[int] | None = None) -> str:
        """A ``WHERE`` clause for ``kind`` and ``steps`` (both checked before inlining)."""
        parts = []
        if kind is not None:
            try:
                S.check_kind(kind, where="kind")
            except Exception:
                raise LayoutError(
                    f"kind: expected None or a name matching {S.KIND_PATTERN} (such as 'train' "
                    f"or 'eval'), got {kind!r}"
                ) from None
            parts.append(f"kind = '{kind}'")
        if steps is not None:
            wanted = [steps] if isinstance(steps, int | np.integer) else list(steps)
            try:
                ints = [int(s) for s in wanted]
            except (TypeError, ValueError):
                raise LayoutError(f"steps: expected integers, got {wanted!r}") from None
            parts.append(f"step IN ({', '.join(map(str, ints))})" if ints else "FALSE")
        return ("WHERE " + " AND ".join(parts)) if parts else ""

    def alias(self, name: str, *, what: str) -> str:
        """The flat alias of a per-completion score: a group column or a reward function."""
        alias = SCORE_ALIASES.get(name, name)
        if alias in self.flat_exprs:
            return alias
        reward = reward_aliases(self.reward_names).get(name)
        if reward is not None and reward in self.flat_exprs:
            return reward
        known = [c for c, a in SCORE_ALIASES.items() if a in self.flat_exprs] + self.reward_names
        raise LayoutError(f"{what}: unknown score {name!r}; expected one of {known}")

    def flat(
        self, aliases: Sequence[str], *, kind: str | None, steps: int | Iterable[int] | None = None
    ) -> str:
        """A relation with ``step, rank, kind, group_index, group_id`` and the given
        per-completion scalars, one row per completion."""
        where = self.where(kind=kind, steps=steps)
        if self.materialized and set(aliases) <= self._materialized:
            cols = ", ".join(quote(a) for a in aliases)
            return f"(SELECT {_ROW_KEY}, {cols} FROM sample_scalars {where})"
        cols = ", ".join(f"unnest({self.flat_exprs[a]}) AS {quote(a)}" for a in aliases)
        return f"(SELECT {_ROW_KEY}, {cols} FROM groups {where})"

    def materialize(self) -> None:
        """Build the in-memory ``sample_scalars`` table (one scan of the scalar list columns)
        and answer :meth:`flat` from it from now on."""
        if self.materialized:
            return
        exprs = [
            (a, e)
            for a, e in self.flat_exprs.items()
            if a in _MATERIALIZED or a.startswith("reward_")
        ]
        # A list missing from an older file is padded with K nulls so all stay aligned.
        lists = "".join(
            f", coalesce({e}, list_resize([], num_completions)) AS {quote(a)}" for a, e in exprs
        )
        kinds = self.sql("SELECT DISTINCT kind FROM steps ORDER BY kind").column("kind").to_pylist()
        parts = []
        for i, kind in enumerate(kinds):
            rows = self.sql(
                f"SELECT step, rank, group_index, group_id, num_completions AS _k{lists} "
                "FROM groups "
                f"WHERE kind = {sql_string(kind)}"
            )
            table = _flatten_groups(rows, [a for a, _ in exprs])
            # One Arrow table per kind, combined by a view with `kind` as a constant: a filter
            # on kind then drops whole tables instead of comparing a string per completion.
            self.views.register(f"_sample_scalars_{i}", table)
            rest = ", ".join(quote(c) for c in table.column_names if c not in ("step", "rank"))
            parts.append(
                f"SELECT step, rank, {sql_string(kind)} AS kind, {rest} FROM _sample_scalars_{i}"
            )
        if not parts:
            cols = ", ".join(f"NULL::DOUBLE AS {quote(a)}" for a, _ in exprs)
            parts.append(
                "SELECT NULL::BIGINT AS step, NULL::INTEGER AS rank, NULL::VARCHAR AS kind, "
                "NULL::INTEGER AS group_index, NULL::VARCHAR AS group_id, "
                "NULL::BIGINT AS sample_index"
                f"{', ' + cols if cols else ''} WHERE FALSE"
            )
        self.views.execute(f"CREATE OR REPLACE VIEW sample_scalars AS {' UNION ALL '.join(parts)}")
        self.materialized = True
        self._materialized = {a for a, _ in exprs}
