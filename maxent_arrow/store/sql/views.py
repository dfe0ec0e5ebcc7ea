"""SQL over a store: the DuckDB views ``groups``, ``samples`` and ``steps``, checked and
sandboxed. The one view builder behind :meth:`RolloutStore.sql`, ``RunAnalytics`` and
``maxent-arrow query``.

:class:`SqlViews` composes three parts: the plan of the views (:mod:`.plan`, pure), the
checksum ledger (:mod:`.ledger`) and the sandboxed, interruptible connection
(:mod:`.session`).

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

import contextlib
import gc
import hashlib
import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import int64_scalar
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store.history.catalog import (
    Catalog,
    OnError,
    StepFile,
    fail,
    step_rows_of,
)
from maxent_arrow.store.history.records import lifecycle_keys, read_records, trainer_attempts
from maxent_arrow.store.history.schemas import UnifiedSchemas
from maxent_arrow.store.io.reader import read_group_file
from maxent_arrow.store.sql.ledger import ChecksumLedger
from maxent_arrow.store.sql.plan import FileSet, HistoryViews, TableSource, ViewPlan, plan_views
from maxent_arrow.store.sql.session import (
    QueryLimits,
    SqlSession,
    check_query,
    check_timeout,
    duckdb_module,
)
from maxent_arrow.store.storage.caches import CACHES
from maxent_arrow.store.storage.names import GROUPS, STEPS

__all__ = [
    "SqlViews",
    "check_bound",
    "collector_paused",
    "plan_scans",
    "scanned_columns",
    "views_signature",
]


def check_bound(steps: object) -> tuple[int, int]:
    """A step bound ``(first, last)`` (inclusive) as two ints; anything else (a bare int, a
    list of another length, floats, bools, first > last) is an :class:`ArgumentError`."""
    if not isinstance(steps, tuple | list) or len(steps) != 2:
        raise ArgumentError(f"steps: expected (first, last), got {steps!r}")
    first, last = steps
    for value in (first, last):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArgumentError(f"steps: expected ints (first, last), got {steps!r}")
    if first > last:
        raise ArgumentError(f"steps: first {first} is after last {last} in {steps!r}")
    return int(first), int(last)


def _scan(node: dict) -> bool:
    """Whether a plan node scans data: a Parquet file set DuckDB reads itself, or an Arrow
    table or dataset handed to it (a store on object storage)."""
    name = str(node.get("name", "")).upper()
    function = str((node.get("extra_info") or {}).get("Function", "")).upper()
    return any("PARQUET" in x or "ARROW_SCAN" in x for x in (name, function))


def _named(item: str, known: dict[str, list[str]]) -> list[str]:
    """The known columns a scan's projection item names: the item itself (DuckDB compares
    identifiers without regard to case), or a column whose name it starts with (a struct
    field, ``name.field``)."""
    lower = item.lower()
    hit = known.get(lower)
    if hit is not None:
        return hit
    return [c for key, names in known.items() for c in names if lower.startswith(key + ".")]


def plan_scans(plan_json: str | None, known: Iterable[str]) -> tuple[bool, set[str] | None]:
    """What the data scans of a DuckDB plan (``EXPLAIN (FORMAT JSON)`` text) read: whether
    there is any (then every file's footer is parsed, even by a ``count(*)`` that reads no
    column), and the columns of ``known`` they read (``None``: the plan does not say, so
    every column must be checked).

    Column names are matched as DuckDB spells them in the plan, whatever they hold (spaces,
    dots, dashes, other scripts) and without regard to case; a filter's text counts every
    known name it contains. Both rules can only add columns, never miss one.
    """
    if plan_json is None:
        return True, None
    try:
        plans = json.loads(plan_json)
    except (ValueError, TypeError):
        return True, None
    by_lower: dict[str, list[str]] = {}
    for name in known:
        by_lower.setdefault(name.lower(), []).append(name)
    found: set[str] = set()
    touched = False

    def walk(node: dict) -> bool:
        nonlocal touched
        if _scan(node):
            touched = True
            info = node.get("extra_info") or {}
            projections = info.get("Projections")
            if projections is None:
                return False
            items = projections if isinstance(projections, list) else [projections]
            for item in items:
                if str(item):
                    found.update(_named(str(item), by_lower))
            filters = info.get("Filters")
            if filters:
                text = str(filters).lower()
                found.update(c for key, names in by_lower.items() if key in text for c in names)
        return all(walk(child) for child in node.get("children", []))

    ok = all(walk(plan) for plan in (plans if isinstance(plans, list) else [plans]))
    return touched, (found if ok else None)


def scanned_columns(plan_json: str | None, known: set[str]) -> set[str] | None:
    """Top-level columns (of ``known``) that the data scans of a DuckDB plan read, or
    ``None`` when the plan does not say (then every column must be checked); see
    :func:`plan_scans`."""
    return plan_scans(plan_json, known)[1]


# Queries tried again after files moved under the views (each retry follows a real move).
_RETRIES = 8
# Query plans' scans kept per session (per process, by the views' text: the process caches'
# ``plans``).
_PLANS_KEPT = 256


# Pauses of the collector by threads building views at once: the first turns it off, the
# last turns it back on (if it was on when the first began).
_pause_lock = threading.Lock()
_pause_holders = 0
_pause_restores = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the views are built (the pattern of
    Mercurial's ``nogc``): building them parses the log's record of every file, tens of
    thousands of small containers that all live on, and with the collector on each would be
    examined again every 700 allocations, with a full collection of the process's objects
    (~20 ms after importing pyarrow and DuckDB) part way through.

    The pause is the process's (the collector is global): other threads run without the
    cyclic collector meanwhile (reference counting still frees what they drop). Threads
    pausing at once share one pause: the collector comes back on when the last one leaves,
    if it was on when the first one came, also after an exception. A ``gc.disable()`` made
    by other code during a pause is undone when the pause ends."""
    global _pause_holders, _pause_restores
    held = False
    try:
        with _pause_lock:
            if _pause_holders == 0:
                _pause_restores = gc.isenabled()
                gc.disable()
            _pause_holders += 1
            held = True
        yield
    finally:
        if held:
            with _pause_lock:
                _pause_holders -= 1
                if _pause_holders == 0 and _pause_restores:
                    gc.enable()


def views_signature(plan: ViewPlan) -> bytes:
    """A digest of the views a plan creates (their statements and registered names)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, sql in sorted(plan.views.items()):
        digest.update(f"{len(name)}:{name}{len(sql)}:{sql}".encode())
    for name in sorted(plan.tables):
        digest.update(f"table {len(name)}:{name}".encode())
    return digest.digest()


class SqlViews:
    """A DuckDB session with the store's views, checked and sandboxed; a context manager.

    Parameters
    ----------
    catalog, schemas:
        The store's commit record and unified schemas.
    on_error:
        ``"raise"`` (a damaged or missing file is a :class:`StoreError` naming it) or
        ``"skip"`` (left out of the views with a warning).
    threads:
        DuckDB worker threads (default: the cores this process may use).
    limits:
        Memory, threads and timeout of every query (:class:`~.session.QueryLimits`; default
        sized from the machine, no timeout).
    crc:
        Check footers and column chunks against the CRC-32s recorded at append (``False``:
        sizes only; the store's ``check_crc``).
    steps:
        ``(first, last)``: views of those steps only (inclusive). Only the files holding one
        of them are named to DuckDB, checked, or visited here (the commit log's index of its
        files by step), so a bounded query costs what its steps cost, not what the run does;
        the views' columns are those of these files. ``None``: every step.

    The file list is taken when the views are built; :meth:`refresh` takes it again.
    """

    def __init__(
        self,
        catalog: Catalog,
        schemas: UnifiedSchemas,
        *,
        on_error: OnError,
        threads: int | None = None,
        crc: bool = True,
        limits: QueryLimits | None = None,
        steps: tuple[int, int] | None = None,
    ):
        self.catalog = catalog
        self.bound = None if steps is None else check_bound(steps)
        self.limits = limits or QueryLimits()
        self.schemas = schemas
        self.on_error: OnError = on_error
        self.threads = threads
        self.crc = crc
        self.ledger = ChecksumLedger(catalog.backend, on_error=on_error, crc=crc)
        self.session: SqlSession | None = None
        self.plan = ViewPlan()
        # What the views read, set by refresh(): current-layout group files DuckDB reads
        # (relative path, step file), the step files, and schema-1.x group rows decoded here.
        self.files: list[tuple[str, StepFile]] = []
        self.steps: list[StepFile] = []
        self.steps_by_path: list[str] = []  # the step files DuckDB reads (relative paths)
        self.built: dict[str, str] = {}  # where the views read each file from
        self.legacy: list[pa.Table] = []
        # A store with a commit log: the files of the history the views leave out (the
        # ``superseded`` view), its catalog, and its record tables.
        self.other: list[tuple[str, StepFile]] = []
        self.other_catalog: Catalog | None = None
        self.reads = "effective"  # the history the views' groups read
        self.records: dict[str, pa.Table] = {}
        self.group_schema: pa.Schema = S.group_schema()
        self.step_schema: pa.Schema = S.step_schema()
        self.data_columns: set[str] = set()
        self.reward_names: list[str] = []
        # This library's own tables and statements on the session (register, execute),
        # replayed on every new session built over the same files.
        self.own: list[tuple[str, Any]] = []
        # The log version the views were built at (``None``: a store without a log).
        self.version: int | None = None
        # What the data scans of each query read (plan_scans of DuckDB's plan), per query
        # text, for the session's views: a repeated query is not planned twice.
        self.scans: dict[str, tuple[bool, set[str] | None]] = {}
        self.signature = b""  # views_signature of the installed views
        self.refresh()

    def __enter__(self) -> SqlViews:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def con(self) -> Any:
        """The DuckDB connection (for this library's own registered tables and views)."""
        if self.session is None:
            raise StoreError("SqlViews: closed")
        return self.session.con

    @property
    def step_paths(self) -> list[str]:
        """The step files DuckDB reads by path."""
        names = {self.catalog.backend.fs_path(f"{STEPS}/{s.name}") for s in self.steps}
        return [p for p in self.plan.allowed_paths if p in names]

    # ------------------------------------------------------------------ building
    def refresh(self) -> None:
        """List the committed files again and rebuild the views (a new session, without the
        tables registered on the old one)."""
        with collector_paused(), self.catalog.snapshot():
            backend = self.catalog.backend
            self.ledger.clear()
            self.own.clear()
            catalog = self.catalog
            self.version = catalog.version
            names = self._bounded_names(self.catalog)
            self.steps = list(self.catalog.committed_steps(self.on_error, names))
            # (bounded: a stat per file read, not a listing of every group file)
            listing = self.catalog.listing(GROUPS) if names is None else None
            self.files, self.legacy = [], []
            for step in self.steps:
                rel = f"{GROUPS}/{step.group_file}"
                try:
                    if needs_upgrade(step.version):
                        table = read_group_file(backend, step, None, crc=True)
                        self.legacy.append(self._in_bound(table))
                    else:
                        info = (
                            backend.stat(rel) if listing is None else listing.get(step.group_file)
                        )
                        self.ledger.admit(rel, step, info)
                        self.files.append((rel, step))
                except StoreError as exc:
                    fail(self.on_error, exc)
            self._refresh_history(listing)
            groups = None if names is None else [f"{GROUPS}/{s.group_file}" for s in self.steps]
            stepfiles = None if names is None else [f"{STEPS}/{s.name}" for s in self.steps]
            self.group_schema = self.schemas.visible(GROUPS, self.on_error, groups)
            self.step_schema = self.schemas.visible(STEPS, self.on_error, stepfiles)
            self.step_schema = self.step_schema.remove_metadata()
            self.data_columns = self._data_columns()
            self.reward_names = self._reward_names()
            self._install()

    def current(self) -> bool:
        """Whether the views still show what the store holds, so that a query may run on
        them as they are (one connection for a session of queries): the commit log is at
        the version they were built at (one read of the next entry's name), and every file
        they read is as it was then (its size and modification time: one ``lstat`` each
        on a local disk), so what :mod:`~maxent_arrow.store.storage.verified` promises holds as on a
        new session. Never current: a store without a log, an object store, views that may have left
        a damaged file out (``on_error="skip"``), closed views. Then :meth:`refresh`."""
        catalog = self.catalog
        if self.session is None or self.version is None or self.on_error != "raise":
            return False
        if catalog.version != self.version:
            return False
        return catalog.backend.unchanged(self.ledger.stamps())

    def _bounded_names(self, catalog: Catalog) -> list[str] | None:
        """The committed step files of the bound (``None``: unbounded, every one)."""
        if self.bound is None:
            return None
        return catalog.committed_between(*self.bound, self.on_error)

    def _in_bound(self, table: pa.Table) -> pa.Table:
        """``table``'s rows of the bound's steps (rows decoded here: schema-1.x files)."""
        if self.bound is None:
            return table
        step = table.column("step")
        first, last = self.bound
        keep = pc.and_(
            pc.greater_equal(step, int64_scalar(first)), pc.less_equal(step, int64_scalar(last))
        )
        return table.filter(keep)

    def _where(self, catalog: Catalog, name: str) -> str | None:
        """The row filter of step file ``name``'s rows: its history's, and the bound's."""
        where = catalog.row_filter(name)
        if self.bound is None:
            return where
        bound = f"step BETWEEN {int(self.bound[0])} AND {int(self.bound[1])}"
        return bound if where is None else f"({where}) AND {bound}"

    def _refresh_history(self, listing: dict | None) -> None:
        """The other history's files and the record tables (none, for a store without a
        commit log: it has one history and no record tables)."""
        self.other, self.other_catalog, self.records = [], None, {}
        catalog = self.catalog
        other = catalog.with_history(
            "effective" if catalog.history == "superseded" else "superseded"
        )
        self.other_catalog = other
        self.reads = catalog.history
        for step in other.committed_steps(self.on_error, self._bounded_names(other)):
            rel = f"{GROUPS}/{step.group_file}"
            if needs_upgrade(step.version):
                continue  # schema-1.x stores have no commit log
            try:
                info = (
                    catalog.backend.stat(rel) if listing is None else listing.get(step.group_file)
                )
                self.ledger.admit(rel, step, info)
                self.other.append((rel, step))
            except StoreError as exc:
                fail(self.on_error, exc)
        state = catalog.state()
        for name in sorted(state.records):
            try:
                self.records[name] = read_records(catalog.backend, state, name, catalog.history)
            except StoreError as exc:
                fail(self.on_error, exc)

    def _data_columns(self) -> set[str]:
        """Group columns that some file carries data in: those its batch had when appended
        (recorded in its step file); the rest of a file's columns are the run-wide layout's
        padding (``store/storage/padding.py``). A file without the record counts with all of its."""
        if not self.files and not self.legacy:
            return set(self.group_schema.names)  # an empty store: the layout's typed views
        found: set[str] = set()
        for rel, step in self.files:
            recorded = step.meta.get("columns")
            found.update(recorded if recorded is not None else self.schemas.file(rel).names)
        for table in self.legacy:
            found.update(table.column_names)
        return found & set(self.group_schema.names)

    def _reward_names(self) -> list[str]:
        names: dict[str, None] = {}
        for step in self.steps:
            for name in step.meta.get("reward_names") or []:
                names.setdefault(name)
        for table in self.legacy:
            if "reward_names" in table.column_names:
                flat = pc.list_flatten(table.column("reward_names"))
                for name in pc.unique(flat).to_pylist():
                    names.setdefault(name)
        return list(names)

    def _install(self) -> None:
        """A new session holding views over :attr:`files`, :attr:`steps` and :attr:`legacy`.
        DuckDB opens files as it creates the views: one a compaction moved to retired/
        meanwhile is read there (:meth:`_relocate`)."""
        duckdb = duckdb_module()
        for attempt in range(3):
            try:
                return self._install_once()
            except duckdb.Error as exc:
                if attempt == 2 or not self._relocate(install=False):
                    raise StoreError(
                        f"{self.catalog.backend.uri}: cannot build the SQL views: "
                        f"{str(exc).splitlines()[0]}"
                    ) from None

    def _install_once(self) -> None:
        self.scans.clear()  # new views: plan again
        if self.session is not None:
            self.session.close()
        self.session = session = SqlSession(threads=self.threads, limits=self.limits)
        backend = self.catalog.backend
        # Files of one schema form one set (DuckDB binds a set to its first file's footer).
        group_sets, self.files = self._group_sets(self.files, self.catalog)
        history = None
        if self.other_catalog is not None:  # (built with the views: always, once refreshed)
            other_sets, self.other = self._group_sets(self.other, self.other_catalog)
            records = self.records.get(R.LIFECYCLE)
            history = HistoryViews(
                reads=self.reads,
                other_sets=other_sets,
                dropped=None
                if records is None
                else lifecycle_keys(
                    records, "dropped", attempts=trainer_attempts(self.other_catalog.state())
                ),
                records=self.records,
            )
        # Step files: DuckDB reads the current ones itself where it can open them (they were
        # read and their seals checked already); the others are handed over as Arrow rows.
        # With a commit log, a step file is read by DuckDB where it is there and sound (its
        # size and CRC-32 as the log recorded them, checked once per process), with the same
        # row filter as its group file; else its rows come from the log (:meth:`_by_path`).
        step_sets: list[FileSet] = []
        handed: list[StepFile] = []
        by_names: dict[tuple[tuple[str, ...], str | None], list[StepFile]] = {}
        for step in self.steps:
            if needs_upgrade(step.version) or not self._by_path(step):
                handed.append(step)
            else:
                where = self._where(self.catalog, step.name)
                by_names.setdefault((tuple(step.schema.names), where), []).append(step)
        self.steps_by_path = []
        for (_, where), members in by_names.items():
            rels = [self.ledger.where(f"{STEPS}/{s.name}") for s in members]
            source = backend.duckdb_source(rels, members[0].schema)
            if source.paths:
                step_sets.append(FileSet(members[0].schema, source, where))
                self.steps_by_path += [f"{STEPS}/{s.name}" for s in members]
            else:
                handed.extend(members)
        step_rows = None
        if handed:
            rows = step_rows_of(
                handed, lambda s, step: self.catalog.keeps(s.name, step) and self._has(step)
            )
            step_rows = S.conform(rows, self.step_schema)
        legacy = (
            pa.concat_tables([S.conform(t, self.group_schema) for t in self.legacy])
            if self.legacy
            else None
        )
        spelled: dict[pa.DataType, str] = {}

        def spell(kind: pa.DataType) -> str:
            if not spelled:
                types = [f.type for f in self.group_schema] + [f.type for f in self.step_schema]
                spelled.update(session.spell(types))
            return spelled[kind]

        self.plan = plan_views(
            TableSource(self.group_schema, group_sets, legacy),
            TableSource(self.step_schema, step_sets, step_rows),
            self.reward_names,
            spell,
            history,
        )
        session.install(self.plan)
        self.signature = views_signature(self.plan)
        self.built = {rel: self.ledger.where(rel) for rel in [r for r, _ in self.files]}
        self.built.update((rel, self.ledger.where(rel)) for rel in self.steps_by_path)
        for kind, item in self.own:
            if kind == "register":
                session.register(*item)
            else:
                session.execute(item)

    def _has(self, step: int) -> bool:
        """Whether ``step`` is in the bound (every step when unbounded)."""
        return self.bound is None or self.bound[0] <= step <= self.bound[1]

    def _by_path(self, step: StepFile) -> bool:
        """Whether DuckDB reads step file ``step`` by path (else its rows are handed over)."""
        return self.catalog.admit_step_file(step.name, self.ledger.admit_step)

    def _group_sets(
        self, files: list[tuple[str, StepFile]], catalog: Catalog
    ) -> tuple[list[FileSet], list[tuple[str, StepFile]]]:
        """``files`` as file sets DuckDB reads, one per schema and row filter (a file the
        history reads in part, a segment a resumed run superseded in part, forms a set of
        its own, with its filter), and the files kept (a damaged one left out)."""
        backend = catalog.backend
        sets: list[FileSet] = []
        by_schema: dict[tuple, tuple[pa.Schema, str | None, list[tuple[str, StepFile]]]] = {}
        for rel, step in files:
            schema = self.schemas.file(rel)  # files of one schema share the object
            where = self._where(catalog, step.name)
            by_schema.setdefault((id(schema), where), (schema, where, []))[2].append((rel, step))
        for schema, where, members in by_schema.values():
            sound = self.ledger.first_sound(members)
            dropped = {rel for rel, _ in members[: len(members) - len(sound)]}
            if dropped:
                files = [f for f in files if f[0] not in dropped]
            if sound:
                rels = [self.ledger.where(rel) for rel, _ in sound]
                sets.append(FileSet(schema, backend.duckdb_source(rels, schema), where))
        return sets, files

    def _relocate(self, *, install: bool = True) -> bool:
        """After a query failed: whether files the views read were moved to retired/ by a
        compaction since the views were built (then the views are rebuilt over the files
        where they are now: the same bytes, the same rows). A file that is in neither place
        (retired longer ago than the grace period) is a :class:`StoreError` asking for a
        :meth:`refresh`."""
        moved = False
        rels = [rel for rel, _ in self.files] + self.steps_by_path
        for rel in rels:
            if self.catalog.backend.stat(self.ledger.where(rel)) is not None:
                # Found where the ledger reads it: moved if the views read it elsewhere (a
                # check that found it moved followed it, the views did not).
                moved = moved or self.ledger.where(rel) != self.built.get(rel, rel)
                continue
            if not self.ledger.relocate(rel):
                raise StoreError(
                    f"{self.catalog.backend.path(rel)}: gone since these views were built "
                    "(replaced by a compaction longer ago than the grace period of its retired "
                    "copy, or deleted); refresh() them (RunAnalytics.refresh)"
                )
            moved = True
        if moved and install:
            self._install()
        return moved

    # ------------------------------------------------------------------ checking
    def check_columns(self, columns: set[str] | None, *, footers: bool = False) -> None:
        """Check the footer and the chunks of ``columns`` (``None``: all) in every file the
        views read (``footers``: the footers even where no column is asked for); a damaged
        file is raised, or left out (the views rebuilt without it) with a warning."""
        damaged = self.ledger.check(
            self.files, columns, all_columns=self.group_schema.names, footers=footers
        )
        if damaged:
            self.files = [f for f in self.files if f[0] not in damaged]
            self._install()

    def check_footers(self) -> None:
        """Check the footer of every file the views read (what ``inspect`` vouches for)."""
        self.check_columns(set(), footers=True)

    # ------------------------------------------------------------------ querying
    def _session(self) -> SqlSession:
        if self.session is None:
            raise StoreError("SqlViews: the session is closed")
        return self.session

    def query(
        self,
        query: str,
        params: Any = None,
        *,
        trusted: bool = False,
        timeout: float | None = None,
    ) -> pa.Table:
        """Run ``query`` and return its result as one Arrow table.

        User queries are checked (:func:`~.session.check_query`); ``trusted`` queries (this
        library's own: views, materialised tables) are not. The footers and the columns the
        query reads are checked first; Ctrl-C stops the query (``KeyboardInterrupt``), and so
        does ``timeout`` (seconds; default :attr:`limits`' timeout), with a
        :class:`StoreError`.
        """
        timeout = check_timeout(timeout)
        if not trusted:
            check_query(query, self._session().con)  # one connection per session
        # A compaction may move files under the views between any two steps: each retry
        # follows the files that moved (a bounded number: every move is a commit).
        for attempt in range(_RETRIES):
            try:
                if self.crc:
                    # Every file's footer whenever the query scans files at all: DuckDB
                    # parses each footer it opens, also for a count(*) that reads no column.
                    touched, columns = self._scans(query)
                    if touched:
                        self.check_columns(columns, footers=True)
                return self._session().run(query, params, timeout=timeout)
            except StoreError:
                # A compaction may have moved the files under the views: read them there.
                if attempt == _RETRIES - 1 or not self._relocate():
                    raise
        raise AssertionError("unreachable")

    def _scans(self, query: str) -> tuple[bool, set[str] | None]:
        """What the data scans of ``query`` read on these views (:func:`plan_scans` of
        DuckDB's plan), planned once per query text while the views stand, and once per
        process for views of the same text (a new store object over an unchanged store):
        which columns a query reads depends on its text and the views' only."""
        found = self.scans.get(query)
        if found is not None:
            return found
        key = None if self.own else (self.signature, query)
        if key is not None:
            found = CACHES.plans.get(key)
        if found is None:
            plan = self._session().plan_json(query)
            found = plan_scans(plan, self.group_schema.names)
            if plan is None:
                return found
            if key is not None:
                CACHES.plans.put(key, found)
        if len(self.scans) >= _PLANS_KEPT:
            self.scans.pop(next(iter(self.scans)))
        self.scans[query] = found
        return found

    def register(self, name: str, table: Any) -> None:
        """Make an Arrow table of this library's own queryable as ``name`` (trusted)."""
        self._session().register(name, table)
        self.own.append(("register", (name, table)))
        self.scans.clear()  # a name may now read something else

    def execute(self, sql: str) -> None:
        """Run a statement of this library's own (a view over registered tables; trusted)."""
        self._session().execute(sql)
        self.own.append(("execute", sql))
        self.scans.clear()

    def explain(self, query: str) -> str:
        """DuckDB's physical plan of ``query`` (shows which columns each scan reads)."""
        check_query(query, self._session().con)
        return self._session().explain(query)

    def render(self, table: pa.Table, *, max_rows: int) -> str:
        """``table``'s first ``max_rows`` rows as a box table, drawn on this session."""
        return self._session().render(table, max_rows=max_rows)

    def close(self) -> None:
        """Close the session (see :meth:`~.session.SqlSession.close`)."""
        session, self.session = self.session, None
        if session is not None:
            session.close()
