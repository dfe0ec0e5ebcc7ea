"""``ReadOnlyStore``: what can be done with a store without writing to it.

Opening, listing, reading, SQL and ``verify``: the read side of
:class:`~maxent_arrow.store.RolloutStore`, which adds appending, replay and maintenance. The
commands that only read (``maxent-arrow inspect``, ``query``, ``report``, ``export``,
``verify``) and the analytics open a store through this class, so they import none of the
write side: no writer, commit, compaction, repair or replay module (a subprocess test in
``tests/test_architecture.py`` checks it).

Opening a store only reads ``manifest.json``: it creates nothing and removes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import MaxentArrowError, StoreError
from maxent_arrow.store.history import manifest
from maxent_arrow.store.history.catalog import (
    History,
    OnError,
    Selection,
    Unit,
    check_history,
    check_on_error,
)
from maxent_arrow.store.history.formats import open_catalog
from maxent_arrow.store.history.records import (
    Frontier,
    check_record_table,
    frontier_of,
    read_records,
    record_filter,
    record_names,
    settle_pending,
)
from maxent_arrow.store.history.schemas import UnifiedSchemas
from maxent_arrow.store.history.tail import DEFAULT_POLL, TailEvent, tail
from maxent_arrow.store.io.reader import GroupFileRead, read_table
from maxent_arrow.store.sql.session import QueryLimits, check_timeout
from maxent_arrow.store.sql.views import SqlViews, check_bound
from maxent_arrow.store.storage.backend import Backend, open_backend
from maxent_arrow.store.storage.names import GROUPS, STEPS
from maxent_arrow.store.upkeep.verify import VerifyReport, verify

if TYPE_CHECKING:
    import pyarrow.fs as pafs


__all__ = ["ReadOnlyStore"]

# Sessions sql() holds per store object (one per settings: on_error, timeout, step bound).
_HELD_SESSIONS = 4


class ReadOnlyStore:
    """An existing rollout store at ``root``, opened for reading.

    Parameters
    ----------
    root:
        A local directory (a path or ``file://``), a ``pyarrow.fs`` URI such as
        ``s3://bucket/run?endpoint_override=127.0.0.1:9000&scheme=http``, or a path on an
        explicit ``filesystem``. A directory without a ``manifest.json`` is refused (the error
        names ``root/store`` when the store is one level down).
    filesystem:
        An explicit ``pyarrow.fs.FileSystem`` for ``root``.
    on_error:
        Default for the readers when a committed file is damaged or missing: ``"raise"`` a
        :class:`StoreError` naming it, or ``"skip"`` it with a warning.
    check_crc:
        Check what is read against the CRC-32s recorded at commit (whole files for
        ``read``/``replay``, the footer and the column chunks a query reads for SQL).
    query_timeout:
        Seconds any one SQL query may run (``sql``, ``sql_views``, the analytics and the
        report over this store); ``None``: no limit. Memory and threads of a query are
        bounded by :class:`~maxent_arrow.store.sql.session.QueryLimits` (sized from the machine).
    attempts:
        Which history every reader of this object sees (stores with a commit log):
        ``"effective"`` (the default: what the model trained on; steps a resumed or re-run
        attempt superseded are left out), ``"all"`` (every attempt's), or ``"superseded"``
        (only what later attempts superseded). ``docs/commit-protocol.md``, "Attempts".
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Backend,
        *,
        filesystem: pafs.FileSystem | None = None,
        on_error: OnError = "raise",
        check_crc: bool = True,
        query_timeout: float | None = None,
        attempts: History = "effective",
    ):
        self.query_timeout = check_timeout(query_timeout)
        self.backend = open_backend(root, filesystem)
        self.manifest = manifest.read(self.backend)
        self.on_error: OnError = check_on_error(on_error)
        self.check_crc = bool(check_crc)
        self.catalog = open_catalog(self.backend, self.manifest, history=check_history(attempts))
        self.schemas = UnifiedSchemas(self.catalog)
        # sql()'s session, held across calls while the store is unchanged (:meth:`sql`).
        self._held: dict[tuple, SqlViews] = {}
        self._sql_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_held"], state["_sql_lock"] = {}, None  # a connection and a lock stay here
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sql_lock = threading.Lock()

    def __enter__(self) -> ReadOnlyStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the SQL session :meth:`sql` holds (a later :meth:`sql` opens a new one)."""
        with self._sql_lock:
            held, self._held = self._held, {}
        for views in held.values():
            views.close()

    # ------------------------------------------------------------------ identity
    @property
    def root(self) -> Any:
        """The store's path: a ``Path`` for a local store, a ``PurePosixPath`` on
        :attr:`filesystem` otherwise."""
        return self.backend.root

    @property
    def uri(self) -> str:
        return self.backend.uri

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self.backend.filesystem

    @property
    def config(self) -> dict[str, Any]:
        """The run config recorded in the manifest."""
        return dict(self.manifest.get("config") or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def _on_error(self, on_error: OnError | None) -> OnError:
        return check_on_error(on_error or self.on_error)

    # ------------------------------------------------------------------ listing
    def units(
        self,
        *,
        kind: str | None = None,
        steps: Iterable[int] | int | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError | None = None,
    ) -> list[Unit]:
        """The committed units (step, rank, kind) and where their rows are."""
        selection = Selection(steps, kind, ranks, on_error=self._on_error(on_error))
        return self.catalog.units(selection)

    def steps(
        self, *, kind: str | None = None, rank: int | None = None, on_error: OnError | None = None
    ) -> list[int]:
        """The distinct committed steps (of ``kind`` and ``rank``, if given), ascending."""
        ranks = None if rank is None else [rank]
        return sorted({u.step for u in self.units(kind=kind, ranks=ranks, on_error=on_error)})

    def __len__(self) -> int:
        return len(self.units())

    def committed_files(
        self, table: Literal["groups", "steps"] = "groups", *, on_error: OnError | None = None
    ) -> list[Any]:
        """Paths (``Path`` locally, ``PurePosixPath`` on :attr:`filesystem`) of the committed
        files of ``table``, in step order: what a plain reader should read. A committed group
        file that is missing raises (or is skipped with a warning)."""
        return [
            self.backend.path(rel)
            for rel in self.catalog.committed_files(table, self._on_error(on_error))
        ]

    def file_reads(
        self,
        *,
        steps: Iterable[int] | int | None = None,
        kind: str | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError | None = None,
    ) -> list[GroupFileRead]:
        """One picklable, checked read per committed group file (with the row ranges of its
        units): what a reader in another process (a Ray task) needs."""
        by_file: dict[str, list[Unit]] = {}
        for unit in self.units(kind=kind, steps=steps, ranks=ranks, on_error=on_error):
            by_file.setdefault(unit.step_file, []).append(unit)
        return [
            GroupFileRead(
                self.backend,
                self.catalog.step_file(name),
                [(u.name, u.start, u.num_groups) for u in members],
            )
            for name, members in by_file.items()
        ]

    # ------------------------------------------------------------------ schema
    def schema(
        self, table: Literal["groups", "steps"] = "groups", *, on_error: OnError | None = None
    ) -> pa.Schema:
        """One schema over all committed files of ``table``, unified by column name (a column
        missing from older files reads as nulls in them); with no files yet, the current
        layout's."""
        if table not in (GROUPS, STEPS):
            raise StoreError(f"schema: table must be 'groups' or 'steps', got {table!r}")
        return self.schemas.visible(table, self._on_error(on_error))

    # ------------------------------------------------------------------ reading
    def read(
        self,
        *,
        steps: Iterable[int] | int | None = None,
        columns: list[str] | None = None,
        filter: pc.Expression | None = None,
        kind: str | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError | None = None,
    ) -> pa.Table:
        """Group rows of the committed steps as one table over the unified schema.

        ``filter`` is a ``pyarrow.compute`` expression over the flat columns (``step``,
        ``rank``, ``kind``, ``group_index``, ``prompt``, ``answer``, ``seed_*``) or any column
        in ``columns``. A damaged file raises :class:`StoreError` naming it, or is skipped
        with a warning under ``on_error="skip"``.
        """
        return self._read("groups", Selection(steps, kind, ranks, columns, filter, on_error))

    def read_steps(
        self,
        *,
        steps: Iterable[int] | int | None = None,
        columns: list[str] | None = None,
        filter: pc.Expression | None = None,
        kind: str | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError | None = None,
    ) -> pa.Table:
        """The step table (one row per step, rank and kind) over the unified step schema."""
        return self._read("steps", Selection(steps, kind, ranks, columns, filter, on_error))

    def _read(self, table: str, selection: Selection) -> pa.Table:
        on_error = self._on_error(selection.on_error)
        selection = dataclasses.replace(selection, on_error=on_error)
        unified = self.schemas.visible(table, on_error)
        return read_table(self.catalog, unified, table, selection, crc=self.check_crc)

    def sql_views(
        self,
        *,
        on_error: OnError | None = None,
        threads: int | None = None,
        timeout: float | None = None,
        limits: QueryLimits | None = None,
        steps: tuple[int, int] | None = None,
    ) -> SqlViews:
        """A DuckDB connection with the views ``groups``, ``samples`` and ``steps`` over the
        committed files, checked and sandboxed (:class:`~maxent_arrow.store.sql.views.SqlViews`);
        close it when done. Each query may run ``timeout`` seconds (default the store's
        ``query_timeout``) within ``limits`` (default sized from the machine). ``steps``:
        ``(first, last)``, views of those steps only (only their files are read)."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        limits = limits or QueryLimits()
        timeout = check_timeout(timeout) or limits.timeout or self.query_timeout
        return SqlViews(
            self.catalog,
            self.schemas,
            on_error=self._on_error(on_error),
            threads=threads,
            crc=self.check_crc,
            limits=QueryLimits(memory=limits.memory, threads=limits.threads, timeout=timeout),
            steps=steps,
        )

    def sql(
        self,
        query: str,
        *,
        on_error: OnError | None = None,
        timeout: float | None = None,
        steps: tuple[int, int] | None = None,
    ) -> pa.Table:
        """Run one read-only DuckDB query over the views ``groups`` (one row per group),
        ``samples`` (one row per completion) and ``steps``; the result as Arrow. It may run
        ``timeout`` seconds (default the store's ``query_timeout``; a :class:`StoreError`
        after it). ``steps``: ``(first, last)``, the views hold those steps only, and only
        the files holding them are read and checked (a query of a few steps of a long run
        costs what those steps cost).

        The session (its connection, views and checks) is held for the next call while the
        store is unchanged: the log at the same version and each file read of the same size
        and modification time (:meth:`~maxent_arrow.store.sql.views.SqlViews.current`); a commit
        or a changed file rebuilds it. :meth:`close` closes it."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        if not self._sql_lock.acquire(blocking=False):
            # Another thread is querying on the held session: a session of this call's own.
            with self.sql_views(on_error=on_error, timeout=timeout, steps=steps) as views:
                return views.query(query)
        try:
            return self._held_query(query, on_error=on_error, timeout=timeout, steps=steps)
        finally:
            self._sql_lock.release()

    def _held_query(
        self,
        query: str,
        *,
        on_error: OnError | None,
        timeout: float | None,
        steps: tuple[int, int] | None,
    ) -> pa.Table:
        """:meth:`sql` on the session held for its settings: one connection and one set of
        views for a session of queries, used as they are while the log is at the version
        they were built at and each file they read is unchanged
        (:meth:`~maxent_arrow.store.sql.views.SqlViews.current`), rebuilt otherwise. An interrupt
        closes it."""
        bound = None if steps is None else check_bound(steps)
        key = (self._on_error(on_error), check_timeout(timeout), bound)
        views = self._held.pop(key, None)
        if views is not None and not views.current():
            views.close()
            views = None
        if views is None:
            views = self.sql_views(on_error=on_error, timeout=timeout, steps=steps)
        try:
            result = views.query(query)
        except MaxentArrowError:
            # A mistake in the statement, a failure while it ran, a damaged file: the
            # session is as it was (the next call checks the store again).
            self._keep(key, views)
            raise
        except BaseException:
            views.close()  # an interrupt: not reused
            raise
        self._keep(key, views)
        return result

    def _keep(self, key: tuple, views: SqlViews) -> None:
        self._held[key] = views
        while len(self._held) > _HELD_SESSIONS:
            self._held.pop(next(iter(self._held))).close()

    def live_files(
        self, table: str = "groups", *, attempts: History | None = None
    ) -> list[tuple[Any, str | None]]:
        """What a plain reader reads for ``table`` (``"groups"``, ``"steps"`` or
        ``"records:<name>"``) in the history this store reads (``attempts`` overrides it):
        each live file's path and the row filter it needs (``"step < 7"``: a segment a
        resumed run superseded in part), or ``None``. The same list as the log checkpoint's
        (``docs/commit-protocol.md``, "Plain readers"). A record table the store has none of
        is an :class:`~maxent_arrow.errors.ArgumentError` naming those it has."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        if table not in (GROUPS, STEPS) and not table.startswith("records:"):
            raise StoreError(
                f"live_files: table must be 'groups', 'steps' or 'records:<name>', got {table!r}"
            )
        history = self.catalog.history if attempts is None else check_history(attempts)
        catalog = self.catalog.with_history(history)
        with catalog.snapshot():
            state = catalog.state()
            out: list[tuple[Any, str | None]] = []
            if table.startswith("records:"):
                name = check_record_table(state, table.partition(":")[2])
                for item in state.records.get(name, []):
                    where = record_filter(state, item, history)
                    if where is not False:
                        path = self.backend.path(item["path"])
                        out.append((path, None if where is True else where))
                return out
            for name in catalog.committed(self.on_error):
                step = catalog.step_file(name)
                rel = f"{GROUPS}/{step.group_file}" if table == GROUPS else f"{STEPS}/{name}"
                out.append((self.backend.path(rel), catalog.row_filter(name)))
            return out

    def attempts(self) -> list[dict[str, Any]]:
        """The run's attempts (writer sessions: launches, resumes, re-runs), in the order they
        began: id, role, mode, the step it resumed from, start time, host, pid, config and
        the log version that began it (``[]``: a store without a commit log)."""
        return [{**a.to_json(), "version": a.version} for a in self.catalog.attempts()]

    # ------------------------------------------------------------------ records
    def record_names(self) -> list[str]:
        """The store's record tables (``trainer_metrics``, ``lifecycle``, a user's own), by
        name (none in a store without a commit log); each is also a SQL view of that name."""
        return record_names(self.catalog.state())

    def read_records(self, name: str, *, attempts: History | None = None) -> pa.Table:
        """The rows of record table ``name`` (:mod:`~maxent_arrow.store.history.records`) in the
        history this store reads (``attempts`` overrides it), checked against the log; an
        ``attempt`` column says which attempt wrote each row. A table the registry declares
        (``trainer_metrics``, ``lifecycle``) never appended reads as its layout, empty; a
        name the store has no table of is an :class:`~maxent_arrow.errors.ArgumentError`
        naming the tables it has."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        history = self.catalog.history if attempts is None else check_history(attempts)
        state = self.catalog.state()
        return read_records(self.backend, state, check_record_table(state, name), history)

    def lifecycle(self, *, attempts: History | None = None) -> pa.Table:
        """What became of the stored groups: the ``lifecycle`` records (trained at a step, or
        dropped with a reason; ``docs/commit-protocol.md``, "Lifecycle")."""
        return self.read_records(R.LIFECYCLE, attempts=attempts)

    def frontier(self) -> Frontier:
        """Where the run's consumer stands in its prompt stream: the lowest stream position
        not consumed (trained or dropped) in the effective history, and the stored groups
        in flight (``docs/commit-protocol.md``, "Exactly once"). Whatever history this
        object reads, the frontier is the effective one's."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        self.catalog.require_history("frontier")
        with self.catalog.snapshot():
            catalog = self.catalog.with_history("effective")
            unified = self.schemas.visible(GROUPS, self.on_error)
            selection = Selection(columns=[*R.ROW_KEY, "stream_index"], on_error=self.on_error)
            groups = read_table(catalog, unified, GROUPS, selection, crc=self.check_crc)
            lifecycle = read_records(self.backend, catalog.state(), R.LIFECYCLE, "effective")
        return frontier_of(groups, lifecycle)

    # ------------------------------------------------------------------ live
    def tail(
        self,
        *,
        kind: str | None = None,
        since: int | None = None,
        poll: float = DEFAULT_POLL,
        timeout: float | None = None,
        inotify: bool = True,
    ) -> Iterator[TailEvent]:
        """Each step unit as its commit lands (a generator;
        :mod:`~maxent_arrow.store.history.tail`).

        Yields a :class:`~maxent_arrow.store.history.tail.TailEvent` per unit committed into the
        effective history after log version ``since`` (``None``: from now on; ``0``: from
        the first commit), of ``kind`` if given, in commit order, and a ``"superseded"``
        event when a new attempt (a resume, a re-run) takes steps delivered before out of
        the history. ``event.version`` is the cursor: pass it back as ``since`` to resume
        after it. Delivery is at least once; a consumer that saves the cursor with its own
        checkpoint sees each event exactly once (``docs/commit-protocol.md``, "Live tail").
        ``store.read(**event.selection)`` reads a step event's rows.

        Locally it waits on inotify (Linux), else and on object stores it reads the next
        log entry every ``poll`` seconds (one read, never a listing). ``timeout``: return
        when no event came for this many seconds (``None``: run until closed).
        ``inotify=False`` polls locally too."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        return tail(
            self.catalog.tail_log(),
            kind=kind,
            since=since,
            poll=poll,
            timeout=timeout,
            inotify=inotify,
        )

    # ------------------------------------------------------------------ checking
    def verify(self, *, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Check every file: readable, sizes and checksums as recorded, rows as the step rows
        say, caches equal to the archive. Names each damaged file in ``problems``.
        ``progress(done, total)``: told of the step files checked so far (a progress bar)."""
        settle_pending(self.uri)  # (rows this process handed a writer)
        return verify(self.catalog, progress=progress)
