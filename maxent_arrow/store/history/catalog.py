"""The catalog: what a store has committed, asked of one object whatever the store's format.

Every reader of the store (``read``, ``replay``, SQL, ``verify``, the Ray reader, the
analytics and the explorer) asks the catalog which units are committed, where their rows are,
which history they belong to, and what the run's attempts and record tables are, so the commit
rule is applied in one place. :class:`Catalog` answers all of it from one
:class:`~maxent_arrow.store.history.state.LogState`; its two implementations differ only in
where that state comes from and in whether it can be written:

- :class:`~maxent_arrow.store.history.logged.LogCatalog`: the commit log's (the format every
  store is written in);
- :class:`~maxent_arrow.store.history.listing.ListingCatalog`: a store written before the commit
  log, its state derived from a listing of its step files; read-only (``maxent-arrow upgrade``
  gives it a log).

:func:`~maxent_arrow.store.history.formats.open_catalog` picks one from the manifest. No caller
learns which it holds: a store without a log answers "no history" (no attempts, no record
tables, nothing superseded) and refuses writes with one typed error.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import errno
import functools
import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import pyarrow as pa
import pyarrow.json as pj

from maxent_arrow.arguments import int_set
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.registry import UNIT_KEY
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store.history.operations import Operation
from maxent_arrow.store.history.state import (
    Attempt,
    LogState,
    UnitEntry,
    entry_summaries,
    unit_kind,
    unit_summary,
)
from maxent_arrow.store.storage.backend import Backend, FileInfo, missing_error
from maxent_arrow.store.storage.names import GROUPS, STEPS, UnitName, parse_name, retired_path

if TYPE_CHECKING:
    from maxent_arrow.store.history.log import CommitLog

__all__ = [
    "EVERYTHING",
    "HISTORIES",
    "Audit",
    "Selection",
    "Catalog",
    "History",
    "OnError",
    "StepFile",
    "Unit",
    "check_history",
    "check_on_error",
    "fail",
    "is_missing",
    "locate",
    "rows_table",
    "step_rows_json",
    "step_rows_of",
    "step_set",
    "unit_sort_key",
]

OnError = Literal["raise", "skip"]


def locate(backend: Backend, rel: str) -> tuple[str, FileInfo] | None:
    """Where the committed file ``rel`` is now, and its size: in place, or moved to
    ``retired/`` by a compaction that replaced it after the reader listed the store
    (``docs/commit-protocol.md``, "Readers and compaction"); ``None`` if it is in neither."""
    for where in (rel, retired_path(rel)):
        info = backend.stat(where)
        if info is not None:
            return where, info
    return None


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says a file is not there (as opposed to damaged)."""
    return isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENOENT


def check_on_error(value: str) -> OnError:
    if not isinstance(value, str) or value not in ("raise", "skip"):
        raise ArgumentError(f"on_error must be 'raise' or 'skip', got {value!r}")
    return value  # type: ignore[return-value]


def fail(on_error: OnError, exc: StoreError) -> None:
    """Raise ``exc`` (``"raise"``) or warn that the damaged file it names is skipped."""
    if on_error == "raise":
        raise exc
    warnings.warn(f"skipping damaged file: {exc}", stacklevel=3)


def step_rows_json(table: pa.Table) -> dict[str, list]:
    """The step rows as JSON-ready columns (timestamps as integers), recorded in the step
    file's metadata so that the catalog can read a step file without decoding its Parquet."""
    out = {}
    for name, column in zip(table.column_names, table.columns):
        if pa.types.is_timestamp(column.type):
            column = column.cast(pa.int64())
        out[name] = column.to_pylist()
    return out


@functools.lru_cache(maxsize=64)
def _layout_schema(names: tuple[str, ...]) -> pa.Schema:
    """The step layout's fields of ``names`` (one object per set of names)."""
    layout = S.step_schema()
    return pa.schema([layout.field(name) for name in names])


def rows_table(rows: dict[str, list], layout: pa.Schema) -> pa.Table | None:
    """The step rows recorded by :func:`step_rows_json` as a table of ``layout``'s types, or
    ``None`` when they hold a column outside the layout (then the Parquet is decoded)."""
    if not set(rows) <= set(layout.names):
        return None
    fields = [layout.field(name) for name in rows]
    # Parsed by Arrow's JSON reader, one line per row: ``pa.array`` of Python values imports
    # pandas (0.4 s) on its first call, which the command line never pays. Timestamps are
    # read as their integers.
    parsed = pa.schema(
        [pa.field(f.name, pa.int64() if pa.types.is_timestamp(f.type) else f.type) for f in fields]
    )
    names = list(rows)
    lines = b"".join(
        json.dumps(dict(zip(names, values)), allow_nan=True).encode() + b"\n"
        for values in zip(*rows.values())
    )
    if not lines:
        return S.empty(parsed).cast(pa.schema(fields))
    table = pj.read_json(
        pa.BufferReader(lines),
        read_options=pj.ReadOptions(use_threads=False),
        parse_options=pj.ParseOptions(explicit_schema=parsed, unexpected_field_behavior="error"),
    )
    return table.select(names).cast(pa.schema(fields))


def step_rows_of(steps: Sequence[StepFile], keeps: Callable[[StepFile, int], bool]) -> pa.Table:
    """The step rows of ``steps`` that ``keeps(step_file, step)`` keeps, as one table of the
    step layout's columns (those any of them has). Rows recorded as JSON are parsed in one
    pass for all files (a parse per file costs ~0.7 ms, which a store of many files pays on
    every SQL session); files whose rows were decoded from Parquet add their own tables."""
    layout = S.step_schema()
    lines: list[bytes] = []
    names: set[str] = set()
    decoded: list[pa.Table] = []
    for s in steps:
        rows = s.meta.get("rows")
        if s.decoded is not None or rows is None or not set(rows) <= set(layout.names):
            keep = [i for i, step in enumerate(s.column("step")) if keeps(s, step)]
            decoded.append(s.table.take(pa.array(keep, pa.int64())).replace_schema_metadata())
            continue
        columns = list(rows)
        names.update(columns)
        for values in zip(*rows.values()):
            row = dict(zip(columns, values))
            if keeps(s, row["step"]):
                lines.append(json.dumps(row, allow_nan=True).encode())
    fields = [f for f in layout if f.name in names]
    parsed = pa.schema(
        [pa.field(f.name, pa.int64() if pa.types.is_timestamp(f.type) else f.type) for f in fields]
    )
    if lines:
        table = pj.read_json(
            pa.BufferReader(b"\n".join(lines) + b"\n"),
            read_options=pj.ReadOptions(use_threads=False),
            parse_options=pj.ParseOptions(
                explicit_schema=parsed, unexpected_field_behavior="error"
            ),
        ).cast(pa.schema(fields))
    else:
        table = S.empty(pa.schema(fields))
    if not decoded:
        return table
    return pa.concat_tables([table, *decoded], promote_options="permissive")


@dataclass(frozen=True)
class StepFile:
    """A committed step file: its step rows (current layout) and its store metadata.

    Files written by this version record their step rows as JSON in the metadata: the rows
    are then built from it on first use (:attr:`table`), and the Parquet is never decoded.
    """

    name: str
    meta: dict[str, Any]
    version: str
    decoded: pa.Table | None = None

    @functools.cached_property
    def table(self) -> pa.Table:
        if self.decoded is not None:
            return self.decoded
        return rows_table(self.meta["rows"], S.step_schema())

    @functools.cached_property
    def schema(self) -> pa.Schema:
        """The schema of the step rows (without building them from JSON)."""
        if self.decoded is not None:
            return self.decoded.schema
        return _layout_schema(tuple(self.meta["rows"]))

    def column(self, name: str) -> list:
        """One column of the step rows as a list (from the JSON rows when recorded)."""
        rows = self.meta.get("rows")
        if rows is not None and self.decoded is None:
            return list(rows[name])
        return self.table.column(name).to_pylist()

    @property
    def group_file(self) -> str:
        return self.meta["group_file"]

    @property
    def starts(self) -> list[int]:
        """The first group row of each step row (one per unit) in the group file."""
        return list(self.meta.get("group_rows") or [0])

    @property
    def replaces(self) -> list[str]:
        return list(self.meta.get("replaces") or [])


@dataclass(frozen=True)
class Unit:
    """One committed (step, rank, kind): where its step row and its group rows are."""

    step: int
    rank: int
    kind: str
    step_file: str
    group_file: str
    row: int  # its row in the step file
    start: int  # its first row in the group file
    num_groups: int

    @property
    def name(self) -> str:
        """The unit's own file name (also for a unit inside a compacted segment)."""
        return f"step-{self.step:010d}.rank-{self.rank:05d}.{self.kind}.parquet"


def unit_sort_key(name: str, parsed: UnitName) -> tuple:
    """The order units are listed in: (step, kind, rank), one-step files before segments."""
    return (parsed.first_step, parsed.kind, parsed.first_rank, not parsed.compacted, name)


def step_set(steps: Iterable[int] | int) -> set[int]:
    """The steps asked for (:func:`int_set`)."""
    return int_set(steps, what="steps")


History = Literal["effective", "all", "superseded"]
HISTORIES = ("effective", "all", "superseded")


def check_history(value: object) -> History:
    if value not in HISTORIES:
        raise ArgumentError(f"attempts: expected one of {HISTORIES}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class Selection:
    """Which committed rows a read path serves, one value shared by ``read``, ``replay``,
    the replay sampler and compaction: ``steps`` (an int or ints; ``None``: every step),
    ``kind`` (``None``: every kind), ``ranks`` (the ranks that wrote them), ``columns`` (group
    columns; ``None``: all), ``filter`` (a ``pyarrow.compute`` expression over the flat
    columns) and ``on_error`` (a damaged file: ``"raise"`` or ``"skip"``; ``None``: the
    store's default). Checked when made."""

    steps: Iterable[int] | int | None = None
    kind: str | None = None
    ranks: Iterable[int] | None = None
    columns: list[str] | None = None
    filter: Any = None
    on_error: OnError | None = None

    def __post_init__(self) -> None:
        if self.steps is not None:
            object.__setattr__(self, "steps", frozenset(step_set(self.steps)))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", frozenset(int_set(self.ranks, what="ranks")))
        if self.kind is not None and not isinstance(self.kind, str):
            raise ArgumentError(f"kind: expected a kind name (train, eval), got {self.kind!r}")
        if self.on_error is not None:
            check_on_error(self.on_error)
        if self.columns is not None and (
            isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns)
        ):
            raise ArgumentError(f"columns: expected a list of column names, got {self.columns!r}")


#: Every committed row.
EVERYTHING = Selection()


@dataclass
class Audit:
    """What a catalog finds of its own records and of the files it does not commit
    (:meth:`Catalog.audit`; ``verify`` reports it): ``problems`` are damage (a lost log entry,
    an unreadable step file, a suspected lost commit), ``notes`` harmless leftovers of writes
    that did not finish; each a (relative path, what it is) pair."""

    problems: list[tuple[str, str]]
    notes: list[tuple[str, str]]


class Catalog(abc.ABC):
    """What one store has committed, at one version of its history.

    Everything is answered from :meth:`state` (within :meth:`snapshot`, one pinned version):
    the committed step files and their records, the units and where their rows are, the
    history each belongs to. ``history``: the units readers see: ``"effective"`` (the run's
    history: not superseded by a later attempt), ``"all"``, or ``"superseded"``. ``run_id``:
    the store's run identity (its manifest's; ``None`` for stores created before it).
    """

    def __init__(self, backend: Backend, run_id: str | None, history: History = "effective"):
        self.backend = backend
        self.run_id = run_id
        self.history: History = check_history(history)
        self._pinned: LogState | None = None
        self._listing: dict[str, dict[str, FileInfo]] = {}
        self._frozen = False
        # step file name -> (the record it was built from, the StepFile)
        self._files: dict[str, tuple[Mapping[str, Any], StepFile]] = {}
        # (the state, its version, its step files in order): :meth:`step_names`' last answer
        self._names: tuple[LogState, int, list[str]] | None = None
        # (the state, its version, each step file's first step in that order, the widest
        # span of steps in one file): :meth:`committed_between`'s index
        self._firsts: tuple[LogState, int, list[int], int] | None = None

    # ------------------------------------------------------------------ the state
    @abc.abstractmethod
    def newest(self) -> LogState:
        """The newest state of the store's history (read again on each call)."""

    @abc.abstractmethod
    def pinned(self) -> LogState:
        """The newest state, which later commits never change (a reader's pin)."""

    @abc.abstractmethod
    def with_history(self, history: History) -> Catalog:
        """A catalog of the same store that sees ``history`` (and the same pin)."""

    @property
    @abc.abstractmethod
    def version(self) -> int | None:
        """The version of the history read (``None``: a store without a commit log, whose
        history has no versions)."""

    def state(self) -> LogState:
        """The state: the pinned version within :meth:`snapshot`, else the newest."""
        return self._pinned if self._pinned is not None else self.newest()

    def listing(self, directory: str, *, fresh: bool = True) -> dict[str, FileInfo]:
        """The files of ``groups/`` or ``steps/`` (one LIST on object stores); within
        :meth:`snapshot`, listed once."""
        if (fresh and not self._frozen) or directory not in self._listing:
            self._listing[directory] = self.backend.list(directory)
        return self._listing[directory]

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """One version of the history (and one listing of each directory) for everything
        done inside: a reader building one view of the store pins the version it read."""
        outer, frozen = self._pinned, self._frozen
        self._pinned = self.pinned() if outer is None else outer
        if not frozen:
            self._listing.clear()
            self._frozen = True
        try:
            yield
        finally:
            self._pinned = outer
            self._frozen = frozen

    def share_pin(self, other: Catalog) -> Catalog:
        """``other`` pinned to this catalog's pinned version (:meth:`with_history`)."""
        other._pinned = self._pinned
        return other

    # ------------------------------------------------------------------ the history
    def attempts(self) -> list[Attempt]:
        """The run's attempts, in the order they began (none for a store without a log)."""
        return list(self.state().attempts)

    def account(self) -> dict[str, Any] | None:
        """The history in figures (what ``inspect`` prints): the log version, the attempts,
        the steps later attempts superseded and the rows of each record table; ``None``: a
        store without a commit log has no history."""
        state = self.state()
        return {
            "log_version": state.version,
            "attempts": [
                {
                    "id": a.id,
                    "role": a.role,
                    "mode": a.mode,
                    "resume_from": a.resume_from,
                    "started_at": a.started_at,
                }
                for a in state.attempts
            ],
            "superseded_steps": state.superseded_steps(),
            "records": {
                n: sum(int(i["rows"]) for i in items) for n, items in state.records.items()
            },
        }

    @abc.abstractmethod
    def writable(self, what: str) -> CommitLog:
        """The commit log that ``what`` (an append, a compaction...) commits through; a store
        that cannot be written raises
        :class:`~maxent_arrow.errors.ReadOnlyFormatError` naming ``maxent-arrow upgrade``."""

    @abc.abstractmethod
    def log_plan(self) -> list[Operation] | None:
        """The operations of a commit log that would say exactly what this catalog says (what
        ``maxent-arrow upgrade`` writes), in order; ``None``: the store has its log."""

    @abc.abstractmethod
    def tail_log(self) -> CommitLog:
        """A commit log object of a tail's own, to follow the history as it commits (a store
        without a commit log has no tail: a :class:`StoreError`)."""

    def require_history(self, what: str) -> None:
        """Refuse ``what`` (a frontier, a tail) on a store without a commit log: a
        :class:`StoreError` saying so (a store with one has nothing to refuse)."""
        return None

    @abc.abstractmethod
    def audit(self, live: set[str]) -> Audit:
        """The damage in the catalog's own records, and what the files of the store that
        are not ``live`` (relative paths of the committed files and of those retiring) are."""

    def step_seal(self, name: str) -> tuple[int | None, int | None]:
        """The size and CRC-32 of step file ``name`` as its commit recorded them (``None``:
        not recorded), what a reader of the file itself checks it against."""
        entry = self.entry(name)
        return (None, None) if entry is None else (entry.step_size, entry.step_crc32)

    def admit_step_file(
        self, name: str, admit: Callable[[str, int | None, int | None], bool]
    ) -> bool:
        """Whether a reader may read step file ``name`` by path (DuckDB's views): when
        ``admit(rel, size, crc32)`` checks it against its commit's seal (local stores; on an
        object store each would be a GET, and its rows are in the history already)."""
        if not self.backend.can_mmap:
            return False
        size, crc = self.step_seal(name)
        return admit(f"{STEPS}/{name}", size, crc)

    # ------------------------------------------------------------------ step files
    def step_names(self) -> list[str]:
        """The committed step files (every attempt's), in (step, kind, rank) order (sorted
        once per version)."""
        state = self.state()
        cached = self._names
        if cached is not None and cached[0] is state and cached[1] == state.version:
            return list(cached[2])
        names = [rel.rpartition("/")[2] for rel in state.units]
        parsed = [(n, p) for n in names if (p := parse_name(n)) is not None]
        out = [n for n, p in sorted(parsed, key=lambda x: unit_sort_key(*x))]
        self._names = (state, state.version, out)
        return list(out)

    def entry(self, name: str) -> UnitEntry | None:
        """Step file ``name``'s entry: committed, or replaced since a reader planned (its
        entry stays until the file is retired: the reader still reads it, from retired/)."""
        state = self.state()
        rel = f"{STEPS}/{name}"
        return state.units.get(rel) or state.replaced_entry(rel)

    def is_committed_step(self, name: str) -> bool:
        """Whether ``name`` is a step file this catalog knows as committed."""
        return self.entry(name) is not None

    def step_file(self, name: str) -> StepFile:
        """A committed step file's record, from the history (the step file is not read)."""
        entry = self.entry(name)
        if entry is None:
            raise missing_error(f"{self.backend.path(f'{STEPS}/{name}')}: not committed")
        hit = self._files.get(name)
        if hit is not None and hit[0] is entry.record:
            return hit[1]
        record = dict(entry.record)
        version = str(record.pop("schema_version", S.SCHEMA_VERSION))
        step = StepFile(name, record, version)
        self._files[name] = (entry.record, step)
        return step

    def losses(self) -> list[StoreError]:
        """What this catalog cannot serve of what was committed: a lost log entry (and the
        commits it hides), an unreadable step file of an older store. Every read of the
        committed files raises the first (``on_error="skip"``: warns of each): never a
        shorter history in silence."""
        return []

    def committed(self, on_error: OnError = "raise", history: History | None = None) -> list[str]:
        """The step files of ``history`` (default this catalog's)."""
        for exc in self.losses():
            fail(on_error, exc)
        state = self.state()
        which = check_history(history or self.history)
        if which == "all":
            keep = set(state.units)
        else:
            effective = set(state.effective())
            if which == "effective":
                keep = effective
            elif not state.resumed:
                keep = set()  # nothing superseded
            else:  # superseded: files with at least one superseded unit
                keep = {
                    rel
                    for rel, e in state.units.items()
                    if rel not in effective or not all(state.effective_units(e))
                }
        return [n for n in self.step_names() if f"{STEPS}/{n}" in keep]

    def committed_between(self, first: int, last: int, on_error: OnError = "raise") -> list[str]:
        """Names of the committed step files holding a step in ``first..last`` (inclusive),
        in :meth:`committed`'s order, from an index of the step files by first step (built
        once per version): the work grows with the files of the bound, not with the run."""
        state = self.state()
        names = self.step_names()
        index = self._firsts
        if index is None or index[0] is not state or index[1] != state.version:
            parsed = [cast(UnitName, parse_name(n)) for n in names]
            firsts = [p.first_step for p in parsed]
            span = max((p.last_step - p.first_step for p in parsed), default=0)
            index = self._firsts = (state, state.version, firsts, span)
        firsts, span = index[2], index[3]
        lo = bisect.bisect_left(firsts, first - span)
        hi = bisect.bisect_right(firsts, last)
        which = self.history
        out = []
        for name in names[lo:hi]:
            parsed = cast(UnitName, parse_name(name))
            if parsed.last_step < first or not self._in_history(name, state, which):
                continue
            out.append(name)
        return out

    def _in_history(self, name: str, state: LogState, which: History) -> bool:
        """Whether step file ``name`` is in ``which`` history (:meth:`committed`'s rule, for
        one file)."""
        rel = f"{STEPS}/{name}"
        entry = state.units.get(rel)
        if entry is None:
            return False
        if which == "all":
            return True
        effective = rel in state.effective()
        if which == "effective":
            return effective
        return state.resumed and (not effective or not all(state.effective_units(entry)))

    def committed_steps(
        self, on_error: OnError = "raise", names: list[str] | None = None
    ) -> Iterator[StepFile]:
        """The committed step files (``names``: those of them, e.g. from
        :meth:`committed_between`); a damaged one is raised or skipped."""
        for name in self.committed(on_error) if names is None else names:
            try:
                yield self.step_file(name)
            except StoreError as exc:
                fail(on_error, exc)

    def units(self, selection: Selection = EVERYTHING) -> list[Unit]:
        """The committed units of ``selection`` (its steps, kind and ranks; a damaged file
        raised or skipped as its ``on_error`` says, default raise) of one pinned version, in
        (step, kind, rank) order."""
        kind, on_error = selection.kind, selection.on_error or "raise"
        wanted = cast("frozenset[int] | None", selection.steps)
        wanted_ranks = cast("frozenset[int] | None", selection.ranks)
        units = []
        with self.snapshot():
            for name in self.committed(on_error):
                parsed = cast(UnitName, parse_name(name))  # committed names are store names
                if kind is not None and parsed.kind != kind:
                    continue
                if wanted is not None and not any(
                    parsed.first_step <= s <= parsed.last_step for s in wanted
                ):
                    continue
                try:
                    step_file = self.step_file(name)
                except StoreError as exc:
                    fail(on_error, exc)
                    continue
                columns = [step_file.column(c) for c in (*UNIT_KEY, "num_groups")]
                starts = step_file.starts
                for i, (step, rank, knd, count) in enumerate(zip(*columns)):
                    if wanted is not None and step not in wanted:
                        continue
                    if not self.keeps(name, step):
                        continue
                    if wanted_ranks is not None and rank not in wanted_ranks:
                        continue
                    units.append(
                        Unit(step, rank, knd, name, step_file.group_file, i, starts[i], count)
                    )
        return sorted(units, key=lambda u: (u.step, u.kind, u.rank))

    def committed_files(
        self, table: str, on_error: OnError = "raise", *, present: bool = True
    ) -> list[str]:
        """Relative paths of the committed files of ``table`` (``"groups"``/``"steps"``);
        ``present``: check that each group file is there (a listing of ``groups/``)."""
        if table not in (GROUPS, STEPS):
            raise StoreError(f"committed_files: table must be 'groups' or 'steps', got {table!r}")
        names = self.committed(on_error)
        if table == STEPS:
            return [f"{STEPS}/{n}" for n in names]
        # (a unit's group file has its step file's name: the commit rule)
        if not present:
            return [f"{GROUPS}/{n}" for n in names]
        listed = self.listing(GROUPS)
        out = []
        for name in names:
            rel = f"{GROUPS}/{name}"
            try:
                # Not listed: moved to retired/ by a compaction since steps/ was listed?
                if name in listed or locate(self.backend, rel) is not None:
                    out.append(rel)
                    continue
                path = self.backend.root / rel
                raise missing_error(f"{path}: group file missing (its step file is committed)")
            except StoreError as exc:  # missing, or a link out of the store
                fail(on_error, exc)
        return out

    # ------------------------------------------------------------------ the history's rules
    def summaries(self) -> list[tuple[str, dict[str, Any]]]:
        """Each committed step file of this catalog's history with the counts of its units
        in that history (:func:`~maxent_arrow.store.history.state.unit_summary`; what
        ``inspect`` prints, summed): the history's summary of the file where every unit of it
        is in the history, so no step rows are read, else counted from its step rows with the
        history's filter (a segment a resume superseded in part)."""
        files = [(n, e) for n in self.committed() if (e := self.entry(n)) is not None]
        whole = [self._whole(name, entry) for name, entry in files]
        kept = iter(entry_summaries([e for (_, e), w in zip(files, whole) if w]))
        out = []
        for (name, entry), w in zip(files, whole):
            summary = (
                next(kept)
                if w
                else unit_summary(entry.record, lambda step, _kind, n=name: self.keeps(n, step))
            )
            if summary.get("schema_version") is None:
                summary["schema_version"] = S.SCHEMA_VERSION  # (as :meth:`step_file` reads it)
            out.append((name, summary))
        return out

    def _whole(self, name: str, entry: UnitEntry) -> bool:
        """Whether every unit of step file ``name`` is in this catalog's history: from its
        name's step range where that decides it (no step rows read), else :meth:`row_filter`."""
        state = self.state()
        if self.history == "all" or not state.resumed:
            return True
        parsed = parse_name(name)
        if parsed is not None:
            cut = state.cutoff(entry.attempt, parsed.kind)
            if cut is None:
                return True
            if self.history == "effective" and parsed.last_step < cut:
                return True  # every unit below the cutoff
            if self.history == "superseded" and parsed.first_step >= cut:
                return True  # every unit at or past it
        return self.row_filter(name) is None

    def attempt_of(self, name: str) -> str:
        """The attempt that wrote step file ``name`` (``""``: a store without attempts)."""
        entry = self.entry(name)
        return "" if entry is None else entry.attempt

    def row_filter(self, name: str) -> str | None:
        """SQL that keeps the rows of step file ``name``'s group file in the history this
        catalog reads, when it holds some that are not (``None``: every row)."""
        if self.history == "all" or not self.state().resumed:
            return None  # every unit of the file is in the history
        entry = self.entry(name)
        if entry is None:
            return None
        cut = self.state().cutoff(entry.attempt, unit_kind(entry))
        steps = entry.record["rows"]["step"]
        if cut is None or not any(s >= cut for s in steps) or not any(s < cut for s in steps):
            return None  # the whole file is in, or out of, the history
        return f"step < {int(cut)}" if self.history == "effective" else f"step >= {int(cut)}"

    def keeps(self, name: str, step: int) -> bool:
        """Whether the unit of ``step`` in step file ``name`` is in this catalog's history."""
        if self.history == "all":
            return True
        entry = self.entry(name)
        if entry is None:
            return False
        effective = self.state().is_effective(step, entry.attempt, unit_kind(entry))
        return effective if self.history == "effective" else not effective
