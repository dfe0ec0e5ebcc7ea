"""The DuckDB views of a saved run: which files, one schema over them, and the SQL of each view.

Used by :mod:`maxent_arrow.analytics.run`. Three things here are about speed on stores of many
small files (one pair per append), measured on 1000 files:

* DuckDB's ``union_by_name=true`` re-reads every file's footer each time a query binds the
  view (~0.3 s per query for 1000 files). Instead the files are grouped by schema (usually one
  or two sets), each set is read by position (only its first footer is read at bind time) and
  projected onto the unified schema in SQL (missing columns and missing reward functions as
  typed NULLs), and the sets are combined with ``UNION ALL``.
* ``kind`` is a constant per set (it comes from the file name), so a ``kind = 'train'``
  filter drops the other sets before any file is opened.
* ``parquet_metadata_cache`` keeps parsed footers between queries of one session.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as _schema
from maxent_arrow.errors import LayoutError, StoreError

__all__ = [
    "samples_view_sql",
    "ViewBuilder",
    "committed_files",
    "file_kind",
    "flat_columns",
    "quote",
    "read_schemas",
    "sql_string",
]

_KIND_RE = re.compile(r"\.([a-z][a-z0-9_]*)\.parquet$")


def quote(name: str) -> str:
    """A DuckDB identifier, quoted (column and reward-function names come from user data)."""
    return '"' + name.replace('"', '""') + '"'


def sql_string(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def file_kind(path: Path) -> str:
    """``"train"``/``"eval"``/...: the ``{kind}`` of ``step-….rank-….{kind}.parquet`` and of
    ``compact-…-….{kind}.parquet``."""
    match = _KIND_RE.search(path.name)
    return match.group(1) if match else "train"


def committed_files(root: str | Path, table: str) -> list[Path]:
    """The committed Parquet files of ``table`` (``"groups"`` or ``"steps"``).

    Asks ``RolloutStore.committed_files`` (which also knows about compacted files) when the
    directory is a store with a manifest; for a bare directory in the store's layout, applies
    the layout rule itself: ``.tmp-*`` files are in-flight writes, and a group file is visible
    only once the step file of the same name (its commit marker) exists. Never creates
    anything on disk.
    """
    if table not in ("groups", "steps"):
        raise LayoutError(f"committed_files: table must be 'groups' or 'steps', got {table!r}")
    root = Path(root)
    if (root / "manifest.json").exists():
        try:
            from maxent_arrow.store.store import RolloutStore
        except ImportError:  # pragma: no cover - the store ships with the package
            RolloutStore = None  # noqa: N806
        if RolloutStore is not None and hasattr(RolloutStore, "committed_files"):
            return [Path(p) for p in RolloutStore(root).committed_files(table)]
    step_dir = root / "steps"
    steps = (
        {p.name for p in step_dir.glob("*.parquet") if not p.name.startswith(".")}
        if step_dir.is_dir()
        else set()
    )
    if table == "steps":
        return sorted(step_dir / name for name in steps)
    group_dir = root / "groups"
    if not group_dir.is_dir():
        return []
    return sorted(
        p for p in group_dir.glob("*.parquet") if not p.name.startswith(".") and p.name in steps
    )


def read_schemas(files: Sequence[Path], *, progress: bool, what: str) -> list[pa.Schema]:
    """Each file's schema (footer only), version-checked."""
    iterator: Iterable[Path] = files
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(files, desc=f"reading {what} footers", unit="file", leave=False)
    out = []
    for path in iterator:
        try:
            file_schema = pq.read_schema(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise StoreError(f"{path}: not a readable Parquet file ({exc})") from None
        version = (file_schema.metadata or {}).get(_schema.METADATA_KEY)
        if version is not None:
            _schema.check_version(version, where=str(path))
        out.append(file_schema.remove_metadata())
    return out


class ViewBuilder:
    """Builds the SQL source of one table (groups or steps) over its committed files."""

    def __init__(
        self, con: Any, name: str, files: list[Path], schemas: list[pa.Schema], unified: pa.Schema
    ) -> None:
        self.con = con
        self.name = name
        self.files = files
        self.schemas = schemas
        self.unified = unified.remove_metadata()
        self._types = self._duck_types(self.unified, f"_types_{name}")

    def _duck_types(self, schema: pa.Schema, table: str) -> dict[str, str]:
        """DuckDB's spelling of each column type (and of each field of struct columns)."""
        empty = pa.table({f.name: pa.array([], f.type) for f in schema})
        self.con.register(table, empty)
        types = {row[0]: row[1] for row in self.con.execute(f"DESCRIBE {table}").fetchall()}
        self.con.unregister(table)
        for field in schema:
            if pa.types.is_struct(field.type) and len(field.type):
                sub = pa.schema(list(field.type))
                for key, value in self._duck_types(sub, f"{table}_{len(types)}").items():
                    types[f"{field.name}\x00{key}"] = value
        return types

    def _projection(self, file_schema: pa.Schema) -> list[str] | None:
        """SQL that maps a file's columns onto the unified schema, or None if it cannot."""
        out = []
        for field in self.unified:
            name = quote(field.name)
            if field.name not in file_schema.names:
                out.append(f"NULL::{self._types[field.name]} AS {name}")
                continue
            have = file_schema.field(field.name).type
            if have == field.type:
                out.append(name)
            elif pa.types.is_struct(have) and pa.types.is_struct(field.type):
                present = {f.name: f.type for f in have}
                parts = []
                for sub in field.type:
                    if sub.name in present and present[sub.name] == sub.type:
                        parts.append(f"{quote(sub.name)} := {name}.{quote(sub.name)}")
                    elif sub.name not in present:
                        t = self._types[f"{field.name}\x00{sub.name}"]
                        parts.append(f"{quote(sub.name)} := NULL::{t}")
                    else:
                        return None
                out.append(f"struct_pack({', '.join(parts)}) AS {name}")
            elif pa.types.is_null(have):
                out.append(f"NULL::{self._types[field.name]} AS {name}")
            else:
                return None
        return out

    def source(self, *, with_kind: bool) -> str:
        """A SQL relation over all files with the unified columns (+ ``kind``)."""
        if not self.files:
            empty = pa.table({f.name: pa.array([], f.type) for f in self.unified})
            self.con.register(f"_empty_{self.name}", empty)
            kind = ", NULL::VARCHAR AS kind" if with_kind else ""
            return f"(SELECT *{kind} FROM _empty_{self.name})"
        sets: dict[tuple[str, str], list[Path]] = {}
        schema_of: dict[str, pa.Schema] = {}
        for path, file_schema in zip(self.files, self.schemas):
            key = file_schema.to_string(show_field_metadata=False, show_schema_metadata=False)
            schema_of[key] = file_schema
            kind = file_kind(path) if with_kind else ""
            sets.setdefault((key, kind), []).append(path)
        parts = []
        for (key, kind), paths in sets.items():
            projection = self._projection(schema_of[key])
            listing = "[" + ", ".join(sql_string(str(p)) for p in paths) + "]"
            if projection is None:
                # A nested change we do not map by hand: let DuckDB unify this set by name.
                cols = ", ".join(quote(f.name) for f in self.unified)
                src = f"(SELECT {cols} FROM read_parquet({listing}, union_by_name=true))"
                projection = [quote(f.name) for f in self.unified]
            else:
                src = f"read_parquet({listing})"
            kind_col = f", {sql_string(kind)} AS kind" if with_kind else ""
            parts.append(f"SELECT {', '.join(projection)}{kind_col} FROM {src}")
        return "(" + " UNION ALL ".join(parts) + ")"


# Per-completion scalar columns of the flat relation: alias -> list expression over a group row.
def flat_columns(columns: set[str], reward_names: list[str]) -> dict[str, str]:
    """The per-completion scalars the ready-made queries use, as ``alias -> list expr``.

    Only scalars: token columns are never part of it. ``length`` is T_i (``ref_tok_counts``,
    else the generator's token count).
    """
    out: dict[str, str] = {}
    simple = {
        "total_util": "total_utils",
        "advantage": "advantages",
        "q": "q",
        "weight": "weights",
        "ref_logp_sum_raw": "ref_logp_sum_raw",
        "behavior_logp_sum": "behavior_logp_sum",
        "policy_entropy_sum": "policy_entropy_sum",
    }
    for alias, column in simple.items():
        if column in columns:
            out[alias] = quote(column)
    for name in reward_names:
        out[f"reward_{name}"] = f"rewards.{quote(name)}"
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


_SINGULAR = {
    "completions": "completion",
    "total_utils": "total_util",
    "advantages": "advantage",
    "weights": "weight",
    "ref_tok_counts": "ref_tok_count",
}


def samples_view_sql(
    columns: Iterable[str], reward_names: Sequence[str], source: str = "groups"
) -> str:
    """SQL of the ``samples`` view over ``source`` (group rows): one row per completion.

    ``sample_index`` is the completion's index in its group; each per-completion list becomes
    its singular column (``completion``, ``total_util``, ``advantage``, ``q``, ``weight`` ...),
    the completion info its fields, and each reward function ``reward_<name>`` (and a
    ``rewards`` struct). Subscripts come from ``generate_series`` and every column is indexed
    with the same subscript, so the lists stay aligned by construction and projection
    pushdown still reaches the Parquet scan. The one definition behind
    :class:`~maxent_arrow.analytics.RunAnalytics`, :meth:`RolloutStore.sql` and
    :meth:`ObjectStore.sql`.
    """
    cols = set(columns)
    keep = [
        c
        for c in (
            "step",
            "rank",
            "group_index",
            "kind",
            "prompt",
            "answer",
            "seed_semantic_entropy",
            "seed_advantage_scale",
        )
        if c in cols
    ]
    out = [f"g.{quote(c)}" for c in keep] + ["g._i - 1 AS sample_index"]
    for column in _schema.PER_COMPLETION_COLUMNS:
        if column not in cols:
            continue
        if column == "completion_info":
            for sub in _schema.COMPLETION_INFO_TYPE:
                out.append(f"g.completion_info[g._i].{quote(sub.name)} AS {quote(sub.name)}")
            continue
        out.append(f"g.{quote(column)}[g._i] AS {quote(_SINGULAR.get(column, column))}")
    if reward_names:
        fields = ", ".join(f"{quote(n)} := g.rewards.{quote(n)}[g._i]" for n in reward_names)
        out.append(f"struct_pack({fields}) AS rewards")
        out += [f"g.rewards.{quote(n)}[g._i] AS {quote('reward_' + n)}" for n in reward_names]
    return (
        f"SELECT {', '.join(out)} FROM (SELECT *, unnest(generate_series(1, "
        f"len(completions))) AS _i FROM {source}) g"
    )
