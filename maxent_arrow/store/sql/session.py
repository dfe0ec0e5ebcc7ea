"""A DuckDB connection for the store's views: sandboxed, interruptible, a context manager.

The sandbox: once the views are created, the connection may read only the files the views
read by path (``allowed_paths``), has external access off and its configuration locked, so a
query can neither read nor write a file outside the store nor attach or install anything.
Allowed paths alone would not be enough (``COPY … TO '<allowed file>' (USE_TMP_FILE false)``
overwrites it), hence the statement check of :func:`check_query` before any user query runs.

A query runs in a worker thread so that Ctrl-C (delivered to the main thread) interrupts it:
DuckDB's own call does not return to Python until it is done.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from maxent_arrow.errors import ArgumentError, MissingExtraError, QueryError, StoreError
from maxent_arrow.store.sql.plan import ViewPlan

__all__ = [
    "KEPT_FOOTERS_FILES",
    "QueryLimits",
    "SqlSession",
    "check_query",
    "check_timeout",
    "default_memory",
    "duckdb_module",
    "machine_memory",
    "machine_threads",
]


def duckdb_module() -> Any:
    """``duckdb``, or a :class:`MissingExtraError` naming the extra to install."""
    try:
        import duckdb
    except ImportError:
        raise MissingExtraError("duckdb", "analytics") from None
    return duckdb


# Whitespace or a comment between the words of ``EXPLAIN [ANALYZE] [(options)]``.
_GAP = r"(?:\s|--[^\n]*(?:\n|$)|/\*.*?\*/)"
_EXPLAIN = re.compile(
    rf"^{_GAP}*explain{_GAP}*(?:analyze{_GAP}*)?(?:\([^)]*\){_GAP}*)?", re.IGNORECASE | re.DOTALL
)


# A new connection that has only parsed a query (check_query before any session, as the
# command line checks a query before it opens the store): the next session starts from it
# rather than opening another in-memory database (~20 ms each).
_spare: list[Any] = []
_spare_lock = threading.Lock()


def _take_spare() -> Any:
    with _spare_lock:
        return _spare.pop() if _spare else None


def check_query(query: str, con: Any = None) -> str:
    """``query`` if it is one read-only statement, else a :class:`QueryError` saying why.
    Parsed on connection ``con`` (a session's own; default a fresh connection, which the next
    :class:`SqlSession` then takes as its own)."""
    if con is None:
        with _spare_lock:
            if not _spare:
                _spare.append(duckdb_module().connect(database=":memory:"))
            return _check_query(query, _spare[0])
    return _check_query(query, con)


def _check_query(query: str, parser: Any) -> str:
    duckdb = duckdb_module()
    if not isinstance(query, str) or not query.strip().rstrip(";").strip():
        raise QueryError("query: expected one SQL statement, got an empty query")
    try:
        statements = parser.extract_statements(query)
    except duckdb.Error as exc:
        raise QueryError(f"query: {str(exc).splitlines()[0]}") from None
    if len(statements) != 1:
        raise QueryError(f"query: expected exactly one SQL statement, got {len(statements)}")
    statement = statements[0]
    kind = statement.type
    if kind == duckdb.StatementType.EXPLAIN:
        inner = _EXPLAIN.sub("", statement.query, count=1)
        try:
            inner_statements = parser.extract_statements(inner) if inner.strip() else []
        except duckdb.Error:
            inner_statements = []
        if len(inner_statements) != 1 or inner_statements[0].type != duckdb.StatementType.SELECT:
            raise QueryError("query: EXPLAIN is allowed of a SELECT only")
    elif kind != duckdb.StatementType.SELECT:
        name = str(kind).rsplit(".", 1)[-1]
        raise QueryError(
            f"query: only SELECT (or EXPLAIN/DESCRIBE of one) may run; got a {name} statement"
        )
    return query


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when
    lower (a container's; DuckDB's own default looks at the machine only, and a query
    sized to the host's memory is killed by the container's OOM killer)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit():
                total = min(total, int(text))
    return total


def machine_threads() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# The share of the machine's memory a query may use, and again its result: DuckDB's own
# memory limit does not cover the Arrow result handed back to Python.
MEMORY_SHARE = 0.4


def default_memory() -> int:
    """The default memory limit of a query: :data:`MEMORY_SHARE` of :func:`machine_memory`."""
    return max(int(machine_memory() * MEMORY_SHARE), 1 << 26)


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` if it is ``None`` or a positive, finite number of seconds, else an
    :class:`ArgumentError`."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout < float("inf")
    ):
        raise ArgumentError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    return float(timeout)


# Rows per Arrow batch of a result (the result's size is checked batch by batch).
_RESULT_BATCH_ROWS = 1 << 17


# Sessions over at most this many files keep their parsed footers (SqlSession.install):
# DuckDB keeps ~190 KB per file (measured with DuckDB 2.0 on the store's files), so at most
# ~100 MB; a session over more files parses each footer where it reads it.
KEPT_FOOTERS_FILES = 512


class _ResultTooLarge(Exception):
    """A result over the memory limit (raised in the query's worker thread)."""


@dataclass(frozen=True)
class QueryLimits:
    """What one query may take: ``memory`` bytes inside DuckDB and again for its result,
    ``threads`` DuckDB worker threads, and ``timeout`` seconds (``None``: no limit).

    Defaults are sized from the machine (:func:`machine_memory`, :func:`machine_threads`).
    DuckDB does not spill to disk here (a reader writes nothing, and DuckDB's default spill
    directory is ``.tmp`` in the working directory): a query that needs more memory fails
    with DuckDB's out-of-memory error.
    """

    memory: int = field(default_factory=default_memory)
    threads: int = field(default_factory=machine_threads)
    timeout: float | None = None

    def __post_init__(self) -> None:
        for name, low in (("memory", 1 << 20), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(f"query limits: {name} must be an int >= {low}, got {value!r}")
        check_timeout(self.timeout)


class SqlSession:
    """One in-memory DuckDB connection holding the store's views.

    Parameters
    ----------
    threads:
        DuckDB worker threads (default: :attr:`QueryLimits.threads`, the cores this process
        may use).
    limits:
        Memory, threads and timeout of every query (:class:`QueryLimits`; ``threads`` above
        overrides its threads).

    :meth:`install` creates a :class:`~.plan.ViewPlan`'s views and then sets the
    sandbox, which cannot be changed afterwards; :meth:`register` adds a table for this
    library's own (trusted) queries.
    """

    def __init__(self, *, threads: int | None = None, limits: QueryLimits | None = None):
        limits = limits or QueryLimits()
        if threads is not None:
            limits = QueryLimits(memory=limits.memory, threads=threads, timeout=limits.timeout)
        self.limits = limits
        self.con: Any = _take_spare() or duckdb_module().connect(database=":memory:")
        self.sandboxed = False
        self.con.execute(f"SET threads = {int(limits.threads)}")
        self.con.execute(f"SET memory_limit = '{int(limits.memory)}B'")
        # No spill files (DuckDB's default for an in-memory database is ./.tmp), and no
        # progress bar drawn on stdout between the rows a command prints.
        self.con.execute("SET temp_directory = ''")
        self.con.execute("SET enable_progress_bar = false")

    def install(self, plan: ViewPlan) -> None:
        """Register the plan's tables, create its views, then lock the connection down:
        only the plan's paths may be read, no external access, configuration locked."""
        if self.sandboxed:
            raise StoreError("SqlSession.install: the session is sandboxed already")
        if len(plan.allowed_paths) <= KEPT_FOOTERS_FILES:
            # Each file's footer parsed once per session, not once per view bound over it and
            # again per query (a segment of step-grain row groups has a large footer: 4x
            # faster views and 1.5-2x faster queries on compacted stores). DuckDB parses a
            # footer again when the file's modification time moves on; its bytes are this
            # library's to check (CRC32C, before the first query that reads the file).
            self.con.execute("SET parquet_metadata_cache = true")
        for name, table in plan.tables.items():
            self.con.register(name, table)
        for name, sql in plan.views.items():
            self.con.execute(f"CREATE VIEW {name} AS {sql}")
        if plan.allowed_paths:
            # As a bound parameter: a list literal of thousands of paths costs DuckDB more
            # to parse and bind than the setting itself.
            self.con.execute("SET allowed_paths = $1", [list(plan.allowed_paths)])
        self.con.execute("SET enable_external_access = false")
        self.con.execute("SET lock_configuration = true")
        self.sandboxed = True

    def __enter__(self) -> SqlSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, name: str, table: Any) -> None:
        """Make ``table`` (Arrow) queryable as ``name`` (this library's own tables)."""
        self.con.register(name, table)

    def execute(self, sql: str) -> None:
        """Run a statement of this library's own (``CREATE VIEW`` over registered tables)."""
        self.con.execute(sql)

    def spell(self, types: Iterable[pa.DataType]) -> dict[pa.DataType, str]:
        """DuckDB's name of each Arrow type (handing DuckDB an Arrow table imports pandas,
        ~0.7 s: asked only when a file lacks a column or stores another type)."""
        return spell_types(self.con, types)

    def run(self, query: str, params: Any = None, *, timeout: float | None = None) -> pa.Table:
        """Run ``query`` (already checked, or trusted) and return its result as Arrow.

        Ctrl-C interrupts it (``KeyboardInterrupt``); so does ``timeout`` (seconds; default
        the session's :attr:`QueryLimits.timeout`), raising a :class:`StoreError`. A DuckDB
        error (out of memory included) and a result larger than the memory limit are a
        :class:`StoreError` too.
        """
        duckdb = duckdb_module()
        result: dict[str, Any] = {}
        budget = int(self.limits.memory)
        timeout = self.limits.timeout if timeout is None else timeout

        def work() -> None:
            relation = reader = None
            try:
                relation = self.con.sql(query, params=params)
                if relation is None:
                    result["table"] = pa.table({})
                    return
                # In batches, so that a result larger than the memory limit stops the query
                # instead of the machine (DuckDB's limit does not cover the Arrow result).
                reader = relation.to_arrow_reader(_RESULT_BATCH_ROWS)
                batches, size = [], 0
                for batch in reader:
                    size += batch.nbytes
                    if size > budget:
                        raise _ResultTooLarge(
                            f"query failed: its result exceeds the memory limit of "
                            f"{budget / 2**20:,.0f} MiB; aggregate, or add a LIMIT"
                        )
                    batches.append(batch)
                result["table"] = pa.Table.from_batches(batches, schema=reader.schema)
            except BaseException as exc:  # re-raised in the caller's thread
                # Without its traceback: the frames would keep the relation, and with it the
                # connection, busy after an interrupt.
                result["error"] = exc.with_traceback(None)
            finally:
                del relation, reader

        thread = threading.Thread(target=work, name="maxent-arrow-query", daemon=True)
        thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while thread.is_alive():
                thread.join(0.1)
                if deadline is not None and time.monotonic() > deadline and thread.is_alive():
                    self._stop(thread)
                    raise StoreError(
                        f"query stopped after its timeout of {timeout:g} s (timeout=, --timeout)"
                    )
        except KeyboardInterrupt:
            self._stop(thread)
            raise
        error = result.get("error")
        if error is not None:
            if isinstance(error, duckdb.Error):
                raise StoreError(f"query failed: {str(error).splitlines()[0]}") from None
            if isinstance(error, _ResultTooLarge):
                raise StoreError(str(error)) from None
            raise error
        return result["table"]

    def _stop(self, thread: threading.Thread) -> None:
        """Interrupt until the worker is done: an interrupt that lands between DuckDB
        planning the statement and starting to execute it is cleared by the start."""
        while thread.is_alive():
            self.con.interrupt()
            thread.join(0.1)

    def plan_json(self, query: str) -> str | None:
        """DuckDB's plan of ``query`` as JSON text, or ``None`` if it cannot be planned."""
        try:
            rows = self.con.execute("EXPLAIN (FORMAT JSON) " + query).fetchall()
            return rows[0][1]
        except Exception:
            return None

    def explain(self, query: str) -> str:
        """DuckDB's physical plan of ``query`` (already checked)."""
        return "\n".join(row[1] for row in self.con.execute(f"EXPLAIN {query}").fetchall())

    def render(self, table: pa.Table, *, max_rows: int) -> str:
        """``table``'s first ``max_rows`` rows as DuckDB's box table, drawn on this
        connection (no second one is opened to print)."""
        relation = self.con.from_arrow(table.slice(0, max_rows))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            relation.show(max_rows=max(max_rows, 1))
        return out.getvalue()

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


def spell_types(con: Any, types: Iterable[pa.DataType]) -> dict[pa.DataType, str]:
    """DuckDB's name of each Arrow type in ``types``, asked of connection ``con``."""
    distinct = list(dict.fromkeys(types))
    if not distinct:
        return {}
    empty = pa.table({f"c{i}": pa.array([], t) for i, t in enumerate(distinct)})
    con.register("_maxent_types", empty)
    try:
        rows = con.execute("DESCRIBE _maxent_types").fetchall()
        return {distinct[int(row[0][1:])]: row[1] for row in rows}
    finally:
        con.unregister("_maxent_types")
