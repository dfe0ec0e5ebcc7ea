"""SQL over a store: the DuckDB views ``groups``, ``samples`` and ``steps``, checked and
sandboxed. The one view builder behind :meth:`RolloutStore.sql`, ``RunAnalytics`` and
``maxent-arrow query``.

What a query sees and reads:

- ``groups``: one row per committed group row, unified across files by column name (a
  column an older writer lacked reads as NULL). Files of the current schema are read by
  DuckDB itself (projection and ``kind``/``step`` filters pushed into the Parquet scan);
  schema-1.x files are read, checked and upgraded by this library and handed to DuckDB as
  Arrow tables.
- ``samples``: one row per completion (``sample_index`` within the group row); every
  per-completion list indexed at the same position, so values stay aligned; ``K`` comes from
  the stored ``num_completions``, never from decoding strings; one ``reward_<name>`` column
  per reward function.
- ``steps``: the step rows, from the step files the store has already read and checked.

Checked: when the views are built, every committed group file's size and footer are checked
against its step file; before each query, the column chunks the query reads (DuckDB's plan
names them) are checked against the CRCs recorded at append (DuckDB and Polars ignore Parquet
page CRCs). With ``on_error="raise"`` a damaged or missing file is a :class:`StoreError`
naming it; with ``"skip"`` it is left out with a warning.

Sandboxed: a query is exactly one statement, a ``SELECT`` (or ``EXPLAIN``/``DESCRIBE`` of
one), checked with DuckDB's own parser before it runs; the connection may read only the
committed files (``allowed_paths``), has external access off and its configuration locked,
so no file is read or written outside the views and nothing is attached or installed. A long
query stops on Ctrl-C.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade
from maxent_arrow.errors import MissingExtraError, QueryError, StoreError
from maxent_arrow.store.backend import FileInfo
from maxent_arrow.store.catalog import Catalog, OnError, StepFile, fail
from maxent_arrow.store.checksums import check_chunks, crc32_of
from maxent_arrow.store.layout import GROUPS, STEPS
from maxent_arrow.store.reader import check_group_size, conform, read_group_file
from maxent_arrow.store.schemas import UnifiedSchemas

__all__ = ["SqlViews", "check_query", "duckdb_module", "quote", "samples_view_sql", "sql_string"]


def duckdb_module() -> Any:
    try:
        import duckdb
    except ImportError:
        raise MissingExtraError("duckdb", "analytics") from None
    return duckdb


def quote(name: str) -> str:
    """A DuckDB identifier, quoted (column and reward names come from user data)."""
    return '"' + name.replace('"', '""') + '"'


def sql_string(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


# ---------------------------------------------------------------------------- the sandbox
_EXPLAIN = re.compile(r"^\s*explain\s+(analyze\s+)?(\([^)]*\)\s*)?", re.IGNORECASE)


def check_query(query: str) -> str:
    """``query`` if it is one read-only statement, else a :class:`QueryError` saying why."""
    duckdb = duckdb_module()
    if not isinstance(query, str) or not query.strip().rstrip(";").strip():
        raise QueryError("query: expected one SQL statement, got an empty query")
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise QueryError(f"query: {str(exc).splitlines()[0]}") from None
    if len(statements) != 1:
        raise QueryError(f"query: expected exactly one SQL statement, got {len(statements)}")
    statement = statements[0]
    kind = statement.type
    if kind == duckdb.StatementType.EXPLAIN:
        inner = _EXPLAIN.sub("", statement.query, count=1)
        inner_statements = duckdb.extract_statements(inner) if inner.strip() else []
        if len(inner_statements) != 1 or inner_statements[0].type != duckdb.StatementType.SELECT:
            raise QueryError("query: EXPLAIN is allowed of a SELECT only")
    elif kind != duckdb.StatementType.SELECT:
        name = str(kind).rsplit(".", 1)[-1]
        raise QueryError(
            f"query: only SELECT (or EXPLAIN/DESCRIBE of one) may run; got a {name} statement"
        )
    return query


# ---------------------------------------------------------------------------- view SQL
_SINGULAR = {
    "completions": "completion",
    "completion_messages": "completion_message",
    "total_utils": "total_util",
    "advantages": "advantage",
    "weights": "weight",
    "ref_tok_counts": "ref_tok_count",
}
_GROUP_SCALARS = (
    "step",
    "rank",
    "kind",
    "group_index",
    "group_id",
    "group_size",
    "prompt",
    "prompt_messages",
    "answer",
    "seed_semantic_entropy",
    "seed_advantage_scale",
)


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
    out = [f"g.{quote(c)}" for c in _GROUP_SCALARS if c in cols]
    out.append("g._i - 1 AS sample_index")
    for column in S.PER_COMPLETION_COLUMNS:
        if column not in cols:
            continue
        if column == "completion_info":
            for sub in S.COMPLETION_INFO_TYPE:
                out.append(f"g.completion_info[g._i].{quote(sub.name)} AS {quote(sub.name)}")
            continue
        out.append(f"g.{quote(column)}[g._i] AS {quote(_SINGULAR.get(column, column))}")
    if "reward_names" in cols:
        out.append("g.reward_names AS reward_names")
        for name in reward_names:
            at = f"list_position(g.reward_names, {sql_string(name)})"
            out.append(f"g.reward_values[g._i][{at}] AS {quote('reward_' + name)}")
    k = "g.num_completions" if "num_completions" in cols else "len(g.completions)"
    return (
        f"SELECT {', '.join(out)} FROM (SELECT *, unnest(generate_series(1, "
        f"{k.removeprefix('g.')})) AS _i FROM {source}) g"
    )


def _duck_types(con: Any, *schemas: pa.Schema) -> dict[pa.DataType, str]:
    """DuckDB's spelling of each column type of ``schemas``. Asked only when a file lacks a
    column or types differ: handing DuckDB an Arrow table imports pandas (~0.7 s)."""
    types = list({f.type: None for schema in schemas for f in schema})
    empty = pa.table({f"c{i}": pa.array([], t) for i, t in enumerate(types)})
    con.register("_maxent_types", empty)
    try:
        rows = con.execute("DESCRIBE _maxent_types").fetchall()
        return {types[int(row[0][1:])]: row[1] for row in rows}
    finally:
        con.unregister("_maxent_types")


def _projection(unified: pa.Schema, file: pa.Schema, null, cast) -> list[str]:
    """SQL that maps a file's columns onto the unified schema (NULLs where absent)."""
    out = []
    for field in unified:
        name = quote(field.name)
        if field.name not in file.names or pa.types.is_null(file.field(field.name).type):
            out.append(null(field))
        elif file.field(field.name).type == field.type:
            out.append(name)
        else:
            out.append(cast(field))
    return out


class SqlViews:
    """A DuckDB connection with the store's views, checked and sandboxed.

    Parameters
    ----------
    catalog, schemas:
        The store's commit record and unified schemas.
    on_error:
        ``"raise"`` (a damaged or missing file is a :class:`StoreError` naming it) or
        ``"skip"`` (left out of the views with a warning).
    threads:
        DuckDB worker threads (default: DuckDB's, all cores).
    crc:
        Check footers and column chunks against the CRC-32s recorded at append (``False``:
        sizes only; the store's ``check_crc``).
    """

    def __init__(
        self,
        catalog: Catalog,
        schemas: UnifiedSchemas,
        *,
        on_error: OnError,
        threads: int | None = None,
        crc: bool = True,
    ):
        self.catalog = catalog
        self.schemas = schemas
        self.on_error = on_error
        self.threads = threads
        self.crc = crc
        self.con: Any = None
        self._checked: set[tuple[str, str]] = set()
        self.refresh()

    # ------------------------------------------------------------------ building
    def refresh(self) -> None:
        """List the committed files again and rebuild the views (a new connection)."""
        with self.catalog.snapshot():
            self._build()

    def _connect(self) -> None:
        """A new connection (the old one closed), with nothing registered yet."""
        if self.con is not None:
            self.con.close()
        self.con = duckdb_module().connect(database=":memory:")
        self._types: dict[pa.DataType, str] | None = None  # asked for when first needed
        self.step_paths: list[str] = []  # what DuckDB may read
        self.group_paths: list[str] = []
        if self.threads is not None:
            self.con.execute(f"SET threads = {int(self.threads)}")

    def _build(self) -> None:
        self._connect()
        self._checked.clear()
        backend = self.catalog.backend
        steps = list(self.catalog.committed_steps(self.on_error))
        listing = self.catalog.listing(GROUPS)
        self.files: list[tuple[str, StepFile]] = []  # (relative path, step file) read by DuckDB
        legacy: list[pa.Table] = []
        for step in steps:
            rel = f"{GROUPS}/{step.group_file}"
            try:
                if needs_upgrade(step.version):
                    legacy.append(read_group_file(backend, step, None, crc=True))
                else:
                    self._check_file(rel, step, listing.get(step.group_file))
                    self.files.append((rel, step))
            except StoreError as exc:
                fail(self.on_error, exc)
        self.group_schema = self.schemas.get(GROUPS, self.on_error)
        self.data_columns = self._data_columns(legacy)
        self.reward_names = self._reward_names(steps, legacy)
        self._create_steps(steps)
        self._create_groups(legacy)
        columns = set(self.group_schema.names)
        self.con.execute(f"CREATE VIEW samples AS {samples_view_sql(columns, self.reward_names)}")
        self._sandbox()

    def _check_file(self, rel: str, step: StepFile, info: FileInfo | None) -> None:
        """The size of a group file (``info``: from the directory listing) as its step file
        recorded it. Its footer is checked with the chunks before the first query that reads
        it (and the footer DuckDB binds a view to, when the view is made); a file written
        before chunk CRCs were recorded is checked whole, once."""
        backend = self.catalog.backend
        path = backend.fs_path(rel)
        check_group_size(path, step, info)
        if (
            self.crc
            and step.meta.get("chunks") is None
            and step.meta.get("group_crc32") is not None
        ):
            # Written before chunk CRCs were recorded: check the whole file once.
            if crc32_of(backend.read(rel)) != step.meta["group_crc32"]:
                raise StoreError(f"{path}: CRC-32 differs from the recorded one (corrupt)")
            self._checked.add((rel, "*"))

    def _data_columns(self, legacy: list[pa.Table]) -> set[str]:
        """Group columns that some file carries data in: those its batch had when appended
        (recorded in its step file); the rest of a file's columns are the run-wide layout's
        padding (``store/padding.py``). A file without the record counts with all of its."""
        if not self.files and not legacy:
            return set(self.group_schema.names)  # an empty store: the layout's typed views
        found: set[str] = set()
        for rel, step in self.files:
            recorded = step.meta.get("columns")
            found.update(recorded if recorded is not None else self.schemas.file(rel).names)
        for table in legacy:
            found.update(table.column_names)
        return found & set(self.group_schema.names)

    def _reward_names(self, steps: list[StepFile], legacy: list[pa.Table]) -> list[str]:
        names: dict[str, None] = {}
        for step in steps:
            for name in step.meta.get("reward_names") or []:
                names.setdefault(name)
        for table in legacy:
            if "reward_names" in table.column_names:
                flat = pc.list_flatten(table.column("reward_names"))
                for name in pc.unique(flat).to_pylist():
                    names.setdefault(name)
        return list(names)

    def _create_steps(self, steps: list[StepFile]) -> None:
        """The ``steps`` view: DuckDB reads the current step files itself (they were read
        and their seals checked already); schema-1.x rows, upgraded here, and step files on
        object stores are handed over as Arrow tables."""
        unified = self.schemas.get(STEPS, self.on_error).remove_metadata()
        self.step_schema = unified
        local = self.catalog.backend.local
        direct = [s for s in steps if local and not needs_upgrade(s.version)]
        handed = [s for s in steps if not (local and not needs_upgrade(s.version))]
        parts = []
        sets: dict[tuple[str, ...], list[str]] = {}  # DuckDB binds a set to its first file
        for step in direct:
            path = self.catalog.backend.fs_path(f"{STEPS}/{step.name}")
            sets.setdefault(tuple(step.schema.names), []).append(path)
            self.step_paths.append(path)
        for names, paths in sets.items():
            cols = ", ".join(quote(f.name) if f.name in names else self._null(f) for f in unified)
            listing = "[" + ", ".join(sql_string(p) for p in paths) + "]"
            parts.append(f"SELECT {cols} FROM read_parquet({listing})")
        if handed or not parts:
            tables = [conform(s.table.replace_schema_metadata(), unified) for s in handed]
            table = pa.concat_tables(tables) if tables else unified.empty_table()
            self.con.register("_maxent_step_rows", table)
            parts.append(
                f"SELECT {', '.join(quote(f.name) for f in unified)} FROM _maxent_step_rows"
            )
        self.con.execute(f"CREATE VIEW steps AS {' UNION ALL '.join(parts)}")

    def _cast(self, field: pa.Field) -> str:
        if self._types is None:
            self._types = _duck_types(self.con, self.group_schema, self.step_schema)
        return f"{quote(field.name)}::{self._types[field.type]} AS {quote(field.name)}"

    def _null(self, field: pa.Field) -> str:
        """A typed NULL for a column some files lack (DuckDB's spelling of its type)."""
        if self._types is None:
            self._types = _duck_types(self.con, self.group_schema, self.step_schema)
        return f"NULL::{self._types[field.type]} AS {quote(field.name)}"

    def _create_groups(self, legacy: list[pa.Table]) -> None:
        unified = self.group_schema.remove_metadata()
        parts = []
        sets: dict[str, tuple[pa.Schema, list[tuple[str, StepFile]]]] = {}
        keys: dict[int, str] = {}  # files of one schema share the schema object
        for rel, step in self.files:
            schema = self.schemas.file(rel)
            key = keys.get(id(schema))
            if key is None:
                key = schema.to_string(show_field_metadata=False, show_schema_metadata=False)
                keys[id(schema)] = key
            sets.setdefault(key, (schema, []))[1].append((rel, step))
        cols = ", ".join(quote(f.name) for f in unified)
        backend = self.catalog.backend
        for i, (schema, members) in enumerate(sets.values()):
            members = self._bindable(members)
            if not members:
                continue
            paths = [backend.fs_path(rel) for rel, _ in members]
            self.group_paths.extend(paths)
            projection = ", ".join(_projection(unified, schema, self._null, self._cast))
            if backend.local:
                listing = "[" + ", ".join(sql_string(p) for p in paths) + "]"
                parts.append(f"SELECT {projection} FROM read_parquet({listing})")
            else:
                # Object stores: DuckDB scans them through pyarrow datasets on the store's own
                # file system (projections and filters pushed down; no DuckDB extension).
                import pyarrow.dataset as pads  # only here: it costs ~0.7 s to import

                source = pads.dataset(
                    paths, schema=schema, format="parquet", filesystem=backend.filesystem
                )
                self.con.register(f"_maxent_set_{i}", source)
                parts.append(f"SELECT {projection} FROM _maxent_set_{i}")
        if legacy:
            table = pa.concat_tables([conform(t, unified) for t in legacy])
            self.con.register("_maxent_legacy_groups", table)
            parts.append(f"SELECT {cols} FROM _maxent_legacy_groups")
        if not parts:
            self.con.register("_maxent_no_groups", unified.empty_table())
            parts.append(f"SELECT {cols} FROM _maxent_no_groups")
        self.con.execute(f"CREATE VIEW groups AS {' UNION ALL '.join(parts)}")

    def _bindable(self, members: list[tuple[str, StepFile]]) -> list[tuple[str, StepFile]]:
        """``members`` from the first whose footer is sound: DuckDB binds a view over a set of
        files to the first file's footer, so that one is checked now (the others before the
        first query that reads them). A damaged one is raised, or skipped with a warning."""
        backend = self.catalog.backend
        for at, (rel, step) in enumerate(members):
            chunks = step.meta.get("chunks")
            if chunks is None or not self.crc:
                return members[at:]
            try:
                check_chunks(
                    backend.fs_path(rel), chunks, lambda r, rel=rel: backend.read_ranges(rel, r), ()
                )
            except StoreError as exc:
                fail(self.on_error, exc)
                self.files.remove((rel, step))
                continue
            return members[at:]
        return []

    def _sandbox(self) -> None:
        """Only the committed files may be read; nothing written, attached or installed."""
        if self.catalog.backend.local and (self.group_paths or self.step_paths):
            paths = self.group_paths + self.step_paths
            self.con.execute(f"SET allowed_paths = [{', '.join(sql_string(p) for p in paths)}]")
        self.con.execute("SET enable_external_access = false")
        self.con.execute("SET lock_configuration = true")

    # ------------------------------------------------------------------ querying
    def _scanned_columns(self, query: str) -> set[str] | None:
        """Top-level columns the Parquet scans of ``query`` read (from DuckDB's plan), or
        ``None`` when the plan does not say (then every column is checked)."""
        try:
            rows = self.con.execute("EXPLAIN (FORMAT JSON) " + query).fetchall()
        except Exception:
            return None
        found: set[str] = set()
        known = set(self.group_schema.names)

        def walk(node: dict) -> bool:
            info = node.get("extra_info") or {}
            if (
                "PARQUET" in str(node.get("name", "")).upper()
                or info.get("Function") == "READ_PARQUET"
            ):
                projections = info.get("Projections")
                if projections is None:
                    return False
                items = projections if isinstance(projections, list) else [projections]
                for item in items:
                    found.update(
                        n for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(item)) if n in known
                    )
                filters = info.get("Filters")
                if filters:
                    found.update(
                        n for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(filters)) if n in known
                    )
            return all(walk(child) for child in node.get("children", []))

        try:
            plans = json.loads(rows[0][1])
        except (ValueError, IndexError, TypeError):
            return None
        ok = all(walk(plan) for plan in (plans if isinstance(plans, list) else [plans]))
        return found if ok else None

    def check_columns(self, columns: set[str] | None, *, footers: bool = False) -> None:
        """Check the footer and the chunks of ``columns`` (``None``: all) in every file the
        views read (``footers``: the footers even where no column is asked for); a damaged
        file is raised, or left out (the views rebuilt without it) with a warning."""
        if not self.crc:
            return
        backend = self.catalog.backend
        damaged = False
        for rel, step in self.files:
            wanted = set(self.group_schema.names) if columns is None else columns
            todo = {
                c
                for c in wanted
                if (rel, c) not in self._checked and (rel, "*") not in self._checked
            }
            chunks = step.meta.get("chunks")
            footer = footers and (rel, "(footer)") not in self._checked
            if (not todo and not footer) or chunks is None:
                continue
            try:
                check_chunks(
                    backend.fs_path(rel),
                    chunks,
                    lambda r, rel=rel: backend.read_ranges(rel, r),
                    todo,
                )
            except StoreError as exc:
                fail(self.on_error, exc)
                damaged = True
                continue
            self._checked.update((rel, c) for c in todo | {"(footer)"})
        if damaged:
            # Leave the damaged files out: rebuild without them (skip mode only).
            bad = {rel for rel, step in self.files if not self._file_ok(rel, step, columns)}
            self._exclude(bad)

    def check_footers(self) -> None:
        """Check the footer of every file the views read (what ``inspect`` vouches for)."""
        self.check_columns(set(), footers=True)

    def _file_ok(self, rel: str, step: StepFile, columns: set[str] | None) -> bool:
        backend = self.catalog.backend
        try:
            check_chunks(
                backend.fs_path(rel),
                step.meta["chunks"],
                lambda r: backend.read_ranges(rel, r),
                columns,
            )
        except StoreError:
            return False
        return True

    def _exclude(self, bad: set[str]) -> None:
        keep = [(rel, step) for rel, step in self.files if rel not in bad]
        self.files = keep
        self._connect()
        steps = [step for _, step in keep]
        self._create_steps(steps)
        self._create_groups([])
        columns = set(self.group_schema.names)
        self.con.execute(f"CREATE VIEW samples AS {samples_view_sql(columns, self.reward_names)}")
        self._sandbox()

    def query(self, query: str, params: Any = None, *, trusted: bool = False) -> pa.Table:
        """Run ``query`` and return its result as one Arrow table.

        User queries are checked (:func:`check_query`); ``trusted`` queries (this library's
        own: views, materialised tables) are not. The columns the query reads are checked
        first; Ctrl-C stops the query (``KeyboardInterrupt``).
        """
        if not trusted:
            check_query(query)
        if self.crc:
            self.check_columns(self._scanned_columns(query))
        return self._run(query, params)

    def _run(self, query: str, params: Any) -> pa.Table:
        duckdb = duckdb_module()
        result: dict[str, Any] = {}

        def work() -> None:
            relation = None
            try:
                relation = self.con.sql(query, params=params)
                result["table"] = pa.table({}) if relation is None else relation.to_arrow_table()
            except BaseException as exc:  # re-raised in the caller's thread
                # Without its traceback: the frames would keep the relation, and with it the
                # connection, busy after an interrupt.
                result["error"] = exc.with_traceback(None)
            finally:
                del relation

        # The query runs in a worker thread so that Ctrl-C (delivered to the main thread)
        # can interrupt it; DuckDB's own call does not return to Python until it is done.
        thread = threading.Thread(target=work, name="maxent-arrow-query", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.1)
        except KeyboardInterrupt:
            self.con.interrupt()
            thread.join()
            raise
        error = result.get("error")
        if error is not None:
            if isinstance(error, duckdb.Error):
                raise StoreError(f"query failed: {str(error).splitlines()[0]}") from None
            raise error
        return result["table"]

    def explain(self, query: str) -> str:
        """DuckDB's physical plan of ``query`` (shows which columns each scan reads)."""
        check_query(query)
        return "\n".join(row[1] for row in self.con.execute(f"EXPLAIN {query}").fetchall())

    def close(self) -> None:
        """Close the connection. After an interrupt DuckDB may still be winding the statement
        down for a moment ("connection is busy"): interrupt again and retry, and never let a
        close error hide the interrupt that caused it."""
        con, self.con = self.con, None
        if con is None:
            return
        duckdb = duckdb_module()
        for _ in range(50):
            try:
                con.close()
                return
            except duckdb.Error:
                con.interrupt()
                time.sleep(0.02)
