"""The SQL of a store's views, planned from its files and schemas, without DuckDB.

A plan says what :class:`~.views.SqlViews` creates: the view statements
(``steps``, ``groups``, ``samples``), the Arrow tables or datasets to register under a name
(rows this library decoded itself: schema-1.x files, step rows on object stores, files on a
file system DuckDB cannot open), and the paths the sandbox allows. Everything here is a pure
function of its inputs (a type speller is passed in), so the plan is tested without a
connection.

The naming rule of the ``samples`` view (one row per completion, each per-completion list
column under its singular alias, one ``reward_<name>`` column per reward function) is
:data:`SAMPLE_ALIASES` and :func:`reward_aliases`: the analytics use the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.rollout.config import unique_names
from maxent_arrow.store.storage.backend import DuckSource

__all__ = [
    "TableSource",
    "GROUP_SCALARS",
    "SAMPLE_ALIASES",
    "UNSCORED_AS_NULL",
    "FileSet",
    "HistoryViews",
    "ViewPlan",
    "plan_views",
    "quote",
    "reward_alias",
    "reward_aliases",
    "samples_view_sql",
    "scored",
    "sql_string",
]

# A per-completion list column -> its name in the ``samples`` view (one value per row).
SAMPLE_ALIASES: dict[str, str] = {
    c.name: c.sample_alias for c in R.columns(R.GROUP, level=("completion", "token"))
}
# Group columns repeated on each of the group's completion rows in ``samples`` (the reward
# names are added beside the ``reward_<name>`` columns).
GROUP_SCALARS = R.names(
    R.GROUP, level="group", where=lambda c: c.in_samples and c.name != "reward_names"
)


# Scores whose NaN means "not scored" (TRL turns a reward function's None into NaN; a
# completion no function scored has a NaN utility): NULL in the views, so that a plain avg()
# or count() is right (docs/formulas.md, "Step statistics").
UNSCORED_AS_NULL = ("total_utils",)


def scored(expression: str) -> str:
    """``expression`` (a double) with NaN as NULL: an unscored completion."""
    return f"nullif({expression}, 'NaN'::DOUBLE)"


def reward_alias(name: str) -> str:
    """The ``samples`` column of reward function ``name`` when no other reward's column
    clashes with it (:func:`reward_aliases` gives every reward's, clashes resolved). A NUL
    character, which no DuckDB identifier can hold, reads as ``\u2400`` (the NUL symbol)."""
    return "reward_" + name.replace("\x00", "\u2400")


def reward_aliases(names: Sequence[str]) -> dict[str, str]:
    """The ``samples`` column of each reward function in ``names``, unique without regard to
    case (DuckDB's identifiers ignore it, so ``reward_Acc`` and ``reward_acc`` would be one
    column), by the rule that makes a run's reward names unique
    (:func:`~maxent_arrow.rollout.config.unique_names`: the first keeps its name, a later
    one gets ``_1``, ``_2``...), with ``names`` and ``values`` taken by the list columns
    ``reward_names`` and ``reward_values``. A store written before that rule may hold
    clashing names; its columns are told apart here."""
    distinct = list(dict.fromkeys(names))
    unique = unique_names(("names", "values", *distinct))[2:]
    return {name: reward_alias(alias) for name, alias in zip(distinct, unique)}


def quote(name: str) -> str:
    """A DuckDB identifier, quoted (column and reward names come from user data)."""
    return '"' + name.replace('"', '""') + '"'


def sql_string(text: str) -> str:
    """A DuckDB string literal (a NUL character, which would end the statement's text, is
    spelled ``chr(0)``)."""
    text = str(text)
    if "\x00" in text:
        return "(" + " || chr(0) || ".join(sql_string(part) for part in text.split("\x00")) + ")"
    return "'" + text.replace("'", "''") + "'"


def samples_view_sql(
    columns: Iterable[str], reward_names: Sequence[str], source: str = "groups"
) -> str:
    """SQL of the ``samples`` view over ``source`` (group rows): one row per completion.

    Subscripts come from ``generate_series(1, num_completions)`` and every column is indexed
    with the same subscript, so the lists stay aligned by construction and projection
    pushdown still reaches the Parquet scan (DuckDB does not push projections through a
    multi-column ``UNNEST``).
    """
    cols = set(columns)
    out = [f"g.{quote(c)}" for c in GROUP_SCALARS if c in cols]
    # A run's user columns (registry.PREFIXES): dataset columns repeated on each completion's
    # row, logged per-completion columns indexed like the registered ones.
    levels = {c: p.level for c in columns if (p := R.prefix_of(c)) is not None}
    out.extend(f"g.{quote(c)}" for c, level in levels.items() if level == "group")
    out.append("g._i - 1 AS sample_index")
    out.extend(
        f"g.{quote(c)}[g._i] AS {quote(c)}" for c, level in levels.items() if level == "completion"
    )
    for column, alias in SAMPLE_ALIASES.items():
        if column not in cols:
            continue
        if column == "completion_info":
            for sub in S.COMPLETION_INFO_TYPE:
                out.append(f"g.completion_info[g._i].{quote(sub.name)} AS {quote(sub.name)}")
            continue
        value = f"g.{quote(column)}[g._i]"
        if column in UNSCORED_AS_NULL:
            value = scored(value)
        out.append(f"{value} AS {quote(alias)}")
    if "reward_names" in cols:
        out.append("g.reward_names AS reward_names")
        for name, alias in reward_aliases(reward_names).items():
            at = f"list_position(g.reward_names, {sql_string(name)})"
            value = scored(f"g.reward_values[g._i][{at}]")
            out.append(f"{value} AS {quote(alias)}")
    k = "num_completions" if "num_completions" in cols else "len(completions)"
    return (
        f"SELECT {', '.join(out)} FROM (SELECT *, unnest(generate_series(1, {k})) AS _i "
        f"FROM {source}) g"
    )


@dataclass(frozen=True)
class FileSet:
    """Parquet files of one schema and how DuckDB reads them (its paths, or a dataset);
    ``where``: a filter of their rows (the steps of the history read, in a file that a
    resumed run superseded in part), or ``None``."""

    schema: pa.Schema
    source: DuckSource
    where: str | None = None


@dataclass
class ViewPlan:
    """What to create on a connection: ``views`` (name -> ``SELECT``, in creation order),
    ``tables`` to register first (name -> Arrow table or dataset) and the ``allowed_paths``
    of the sandbox (the files the views read by path)."""

    views: dict[str, str] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)
    allowed_paths: list[str] = field(default_factory=list)


Speller = Callable[[pa.DataType], str]


def _null(field_: pa.Field, spell: Speller) -> str:
    """A typed NULL for a column some files lack."""
    return f"NULL::{spell(field_.type)} AS {quote(field_.name)}"


def _projection(unified: pa.Schema, file: pa.Schema, spell: Speller) -> str:
    """SQL that maps a file's columns onto the unified schema (NULLs where absent)."""
    out = []
    for f in unified:
        name = quote(f.name)
        if f.name not in file.names or pa.types.is_null(file.field(f.name).type):
            out.append(_null(f, spell))
        elif file.field(f.name).type == f.type:
            out.append(name)
        else:
            out.append(f"{name}::{spell(f.type)} AS {name}")
    return ", ".join(out)


def _union(
    name: str,
    unified: pa.Schema,
    sets: list[FileSet],
    rows: pa.Table | None,
    plan: ViewPlan,
    spell: Speller,
) -> None:
    """The view ``name`` over ``unified``: one ``SELECT`` per file set, and the rows decoded
    here (``rows``, registered as a table) or an empty table when there is nothing."""
    parts = []
    for i, files in enumerate(sets):
        projection = _projection(unified, files.schema, spell)
        where = f" WHERE {files.where}" if files.where else ""
        if files.source.paths:
            plan.allowed_paths.extend(files.source.paths)
            listing = "[" + ", ".join(sql_string(p) for p in files.source.paths) + "]"
            parts.append(f"SELECT {projection} FROM read_parquet({listing}){where}")
        elif files.source.dataset is not None:
            table = f"_maxent_{name}_set_{i}"
            plan.tables[table] = files.source.dataset
            parts.append(f"SELECT {projection} FROM {table}{where}")
    if rows is not None or not parts:
        table = f"_maxent_{name}_rows"
        plan.tables[table] = S.conform(rows, unified) if rows is not None else S.empty(unified)
        parts.append(f"SELECT {', '.join(quote(f.name) for f in unified)} FROM {table}")
    plan.views[name] = " UNION ALL ".join(parts)


@dataclass(frozen=True)
class TableSource:
    """What a view of one table reads: its unified ``schema``, the file ``sets`` DuckDB reads
    (one set per schema: DuckDB binds a set to its first file's footer) and the ``rows``
    decoded by this library instead (``None`` when there are none)."""

    schema: pa.Schema
    sets: list[FileSet]
    rows: pa.Table | None = None


def plan_views(
    groups: TableSource,
    steps: TableSource,
    reward_names: Sequence[str],
    spell: Speller,
    history: HistoryViews | None = None,
) -> ViewPlan:
    """The plan of the views ``steps``, ``groups`` and ``samples`` (and the views of the
    run's :class:`HistoryViews`). ``spell`` gives DuckDB's name of an Arrow type (asked only
    for a column some files lack or store with another type)."""
    plan = ViewPlan()
    group_schema, step_schema = groups.schema.remove_metadata(), steps.schema.remove_metadata()
    group_sets, group_rows = groups.sets, groups.rows
    _union("steps", step_schema, steps.sets, steps.rows, plan, spell)
    if history is None:
        _union("groups", group_schema, group_sets, group_rows, plan, spell)
    else:
        _history_views(plan, history, group_schema, group_sets, group_rows, spell)
    plan.views["samples"] = samples_view_sql(group_schema.names, reward_names)
    if history is not None:
        plan.views["samples_all"] = samples_view_sql(
            group_schema.names, reward_names, source="groups_all"
        )
        for name, table in history.records.items():
            plan.tables[f"_maxent_records_{name}"] = table
            plan.views[name] = f"SELECT * FROM _maxent_records_{name}"
    return plan


@dataclass
class HistoryViews:
    """What a store with a commit log adds to its views: which history ``groups`` reads
    (``"effective"``, ``"all"`` or ``"superseded"``), the files of the other history
    (``superseded``; ``groups_all`` is every attempt's), the stored groups the run dropped
    (``step``, ``rank``, ``kind``, ``group_index``; left out of ``groups`` in the effective
    history: ``groups_all`` keeps them) and the record tables (a view each)."""

    reads: str
    # The files of the other history: the superseded ones (the ``superseded`` view) where
    # ``groups`` reads the effective or all; the effective ones where it reads the superseded.
    other_sets: list[FileSet]
    dropped: pa.Table | None = None
    records: dict[str, pa.Table] = field(default_factory=dict)


def _history_views(
    plan: ViewPlan,
    history: HistoryViews,
    group_schema: pa.Schema,
    group_sets: list[FileSet],
    group_rows: pa.Table | None,
    spell: Speller,
) -> None:
    """``groups``, ``superseded`` and ``groups_all`` (``groups`` is what the store reads;
    in the effective history without the dropped groups)."""
    drop = history.reads == "effective" and history.dropped is not None and history.dropped.num_rows
    stored = "_maxent_groups_stored" if drop else "groups"
    _union(stored, group_schema, group_sets, group_rows, plan, spell)
    if drop:
        plan.tables["_maxent_dropped"] = history.dropped
        match = " AND ".join(f"d.{quote(k)} = g.{quote(k)}" for k in R.ROW_KEY)
        plan.views["groups"] = (
            f"SELECT g.* FROM {stored} g WHERE NOT EXISTS "
            f"(SELECT 1 FROM _maxent_dropped d WHERE {match})"
        )
    if history.reads == "superseded":
        plan.views["superseded"] = "SELECT * FROM groups"
        _union("_maxent_groups_effective", group_schema, history.other_sets, None, plan, spell)
        plan.views["groups_all"] = (
            "SELECT * FROM groups UNION ALL SELECT * FROM _maxent_groups_effective"
        )
        return
    _union("superseded", group_schema, history.other_sets, None, plan, spell)
    if history.reads == "all":
        plan.views["groups_all"] = f"SELECT * FROM {stored}"
    else:
        plan.views["groups_all"] = f"SELECT * FROM {stored} UNION ALL SELECT * FROM superseded"
