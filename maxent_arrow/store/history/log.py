"""The commit log: the ordered, append-only record of every commit of a store.

::

    root/log/{version:020d}.json          one entry per commit, created exclusively: the commit
    root/log/checkpoint-{version}.parquet the state at that version (every CHECKPOINT_EVERY)
    root/log/_checkpoint.parquet          the newest checkpoint, under a stable name (a copy)
    root/log/_last_checkpoint.json        which checkpoint is newest (a hint; readers check it)

A commit is the exclusive creation of the next entry: on a local disk a hard link under the
store lock (``link`` refuses an existing name), on S3 a conditional PUT (``If-None-Match: *``,
through boto3: ``pyarrow.fs`` has no conditional create). Two writers racing for a version
never both win: the loser reads the winner's entry, checks its own commit still makes sense
(its unit not committed meanwhile) and takes the next version. Files an entry names are
written and made durable before it, so an entry never names a file that is not there; a file
no entry names is a leftover of a crashed write, invisible to every reader.

A reader reads the newest checkpoint, then the entries after it, in order, until a version is
missing: never a listing of the store's files, so opening costs O(entries since the last
checkpoint), not O(commits). A reader pins the version it read: what it serves is the state
at that version, whatever commits after it (``docs/commit-protocol.md``).

Entries are JSON objects ``{"format": 1, "version": v, "time": ..., "run": ..., "attempt":
..., "op": ...}`` with, by ``op``:

``"attempt"``
    a writer session begins (:class:`Attempt`); ``superseded`` lists the units of earlier
    attempts it supersedes (the tombstones of a resume).
``"append"``
    a unit: its step file and group file (relative paths) and its commit record (the step
    file's store metadata: sizes, checksums, columns, reward names, families, step rows).
``"compact"``
    a segment that replaces step files (``replaces``), atomically.
``"restore"``
    ``repair``'s new copy of a unit whose group file was lost (from its IPC cache copies),
    replacing it, by the attempt that wrote it.
``"step_file"``
    ``repair`` wrote the step file of a committed unit again (lost or damaged) from the
    log's record of it: its new size and CRC-32.
``"drop"``
    step files (``replaces``) leave the store's history: superseded units, retired by
    ``compact(drop_superseded=True)``.
``"records"``
    rows of a record table (trainer figures, group lifecycle): a Parquet file, its size and
    CRC-32, its row count.
``"retire"``
    files no reader may need any more (superseded or replaced, past the grace period).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import errno
import json
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import StoreError
from maxent_arrow.store.storage.backend import crash_point
from maxent_arrow.store.storage.names import GROUPS, LOG, parse_name

__all__ = [
    "CHECKPOINT_EVERY",
    "CHECKPOINT_ROW_GROUP",
    "LOG_FORMAT",
    "CommitLog",
    "Attempt",
    "LogState",
    "UnitEntry",
    "count_runs",
    "entry_name",
    "entry_summaries",
    "step_runs",
    "unit_summary",
    "unit_kind",
    "parse_entry",
]

LOG_FORMAT = 1
# A checkpoint every this many versions: a reader replays at most this many entries.
CHECKPOINT_EVERY = 100
CHECKPOINT = "_checkpoint.parquet"
_UNIT_ROWS = ("step_file", "group_file")  # a checkpoint's rows of a unit
LAST_CHECKPOINT = "_last_checkpoint.json"


def entry_name(version: int) -> str:
    """``log/{version:020d}.json``: sortable, one per version."""
    return f"{LOG}/{version:020d}.json"


def checkpoint_name(version: int) -> str:
    return f"{LOG}/checkpoint-{version:020d}.parquet"


TRAINER = "trainer"  # the role of a writer that trains (TRL, verl, ours): its drops shape `groups`


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One writer session of a run (every rank of one launch shares it).

    ``resume_from``: the step it resumed at (every stored step at or after it, written by an
    earlier attempt of the same ``role``, is superseded), ``None`` for a session that
    continues where the store ends (supersedes nothing); ``role``: what it writes
    (``"trainer"``: a trainer that generates and trains, as TRL and ours; an asynchronous
    generator and trainer are two roles). ``version``: the log version that began it."""

    id: str
    role: str = TRAINER
    resume_from: int | None = None
    started_at: str = ""
    mode: str = "new"
    host: str = ""
    pid: int = 0
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    version: int = 0
    # Kinds whose resume point is not ``resume_from`` (``{"eval": g + 1}``: a trainer that
    # evaluated at its checkpoint's step before saving it does not evaluate there again).
    resume_kinds: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def resumes_at(self, kind: str | None = None) -> int | None:
        """The step this attempt resumed ``kind`` at (``None``: it supersedes nothing)."""
        if self.resume_from is None:
            return None
        return self.resume_from if kind is None else self.resume_kinds.get(kind, self.resume_from)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = dict(self.config)
        out["resume_kinds"] = dict(self.resume_kinds)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Attempt:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class ParsedOnUse(dict):
    """A ``dict`` whose contents are parsed from text when first used (:meth:`_load`): the
    lookups, views, equality and pickling of its subclasses go through here."""

    __slots__ = ()
    _load: Callable[[], None]  # each subclass parses its own text

    def __getitem__(self, key: str) -> Any:
        self._load()
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._load()
        return super().get(key, default)

    def values(self) -> Any:
        self._load()
        return super().values()

    def items(self) -> Any:
        self._load()
        return super().items()

    def __eq__(self, other: object) -> bool:
        self._load()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (dict, (dict(self.items()),))


class LazyRows(ParsedOnUse):
    """A unit's step rows (column name -> values) as a checkpoint holds them: JSON text,
    parsed when a value is first asked for. The column names are known without parsing, so
    a reader that needs only a file's schema or record (SQL views over a long run's
    checkpoint) never parses its rows. Behaves as the parsed ``dict`` in every other way
    (``json.dumps`` and ``dict()`` go through :meth:`items` and :meth:`keys`)."""

    __slots__ = ("_names", "_text")

    def __init__(self, text: str | Callable[[], str], names: list[str]):
        super().__init__()
        # The JSON text, or how to get it (the checkpoint's ``rows`` column is read only
        # when some unit's rows are first asked for); ``None`` once parsed.
        self._text: str | Callable[[], str] | None = text
        self._names = list(names)

    def _load(self) -> None:
        if self._text is not None:
            text, self._text = self._text, None
            super().update(json.loads(text if isinstance(text, str) else text()))

    def text(self) -> str:
        """The rows as JSON text (as read, when not parsed yet)."""
        text = self._text
        if text is None:
            return json.dumps(dict(super().items()))
        return text if isinstance(text, str) else text()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names) if self._text is not None else super().__iter__()

    def keys(self) -> Any:
        return dict.fromkeys(self._names).keys() if self._text is not None else super().keys()

    def __len__(self) -> int:
        return len(self._names) if self._text is not None else super().__len__()

    def __contains__(self, key: object) -> bool:
        return key in self._names if self._text is not None else super().__contains__(key)

    def __repr__(self) -> str:
        return f"LazyRows({self._names})" if self._text is not None else super().__repr__()


class LazyRecord(ParsedOnUse):
    """A unit's commit record as a checkpoint holds it: the row's ``item`` JSON, parsed when
    the record is first used (opening a long run's log parses no record; a reader parses
    those of the files it reads). Behaves as the parsed ``dict`` in every other way."""

    __slots__ = ("_item", "_rows", "stamp")

    def __init__(
        self, item: str | Callable[[], str], rows: Callable[[], str] | str | None, stamp: tuple
    ):
        super().__init__()
        # The item JSON, or how to read it (its row group of the checkpoint, when first
        # used); ``None`` once parsed.
        self._item: str | Callable[[], str] | None = item
        self._rows = rows
        # (step_size, step_crc32, version) of the entry it was read with: a checkpoint of
        # an unchanged entry writes the item text again without parsing it.
        self.stamp = stamp

    def text_of_rows(self) -> str | None:
        """The step rows' JSON text (read from the checkpoint; ``None``: none)."""
        rows = self._rows
        return rows if rows is None or isinstance(rows, str) else rows()

    @property
    def item_text(self) -> str | None:
        """The item JSON as read (``None`` once parsed)."""
        item = self._item
        return item() if callable(item) else item

    @property
    def parsed(self) -> bool:
        """Whether the item was parsed (a reader used the record)."""
        return self._item is None

    def _load(self) -> None:
        if self._item is not None:
            text = self._item
            item, self._item = json.loads(text() if callable(text) else text), None
            record = item["record"]
            if "row_names" in item and self._rows is not None:
                record["rows"] = LazyRows(self._rows, item["row_names"])
            super().update(record)

    def __iter__(self) -> Iterator[str]:
        self._load()
        return super().__iter__()

    def keys(self) -> Any:
        self._load()
        return super().keys()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def __contains__(self, key: object) -> bool:
        self._load()
        return super().__contains__(key)

    def __repr__(self) -> str:
        self._load()
        return super().__repr__()


@dataclasses.dataclass(frozen=True)
class UnitEntry:
    """A committed step file: its relative path, its commit record (the step file's store
    metadata), the attempt that wrote it, the version that committed it, and the step file's
    size and CRC-32 (what ``verify`` checks it against)."""

    step_file: str
    record: Mapping[str, Any]
    attempt: str
    version: int
    step_size: int | None = None
    step_crc32: int | None = None
    # The counts of its units (:func:`unit_summary`), as a checkpoint holds them: JSON text,
    # or how to read it (the checkpoint's ``summary`` column is read when first asked for);
    # ``None``: not recorded (an entry, an older checkpoint), computed from the record.
    summary: str | Callable[[], str | None] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )


@dataclasses.dataclass
class LogState:
    """The store's state at :attr:`version`, built by applying entries in order."""

    version: int = 0
    run: str | None = None
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    # step file (relative path) -> its entry, for every step file not replaced by a compaction
    units: dict[str, UnitEntry] = dataclasses.field(default_factory=dict)
    # record table name -> [(relative path, size, crc32, rows, attempt, version)]
    records: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # files replaced or superseded and not yet retired: relative path -> version it left
    retiring: dict[str, int] = dataclasses.field(default_factory=dict)
    # the entries of replaced step files not yet retired (readers that planned before the
    # replacement still read them, from retired/)
    replaced: dict[str, UnitEntry] = dataclasses.field(default_factory=dict)
    # the same, as a checkpoint holds them, parsed when first asked for (a long run's
    # checkpoint holds a compaction's every input, which readers rarely ask for):
    # relative path -> (item JSON, attempt, version)
    replaced_raw: dict[str, tuple[str, str, int]] = dataclasses.field(default_factory=dict)
    # (step, rank, kind) -> the step files that hold a write of it (an index of `units`,
    # built when first asked for: a reader never asks, a writer once per process)
    indexed: dict[tuple[int, int, str], list[str]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )
    # (attempt, kind) -> its cutoff, until the next attempt begins (readers ask per unit)
    cutoffs: dict[tuple[str, str | None], int | None] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # version -> :meth:`effective` at it (a state at one version never changes)
    effective_at: dict[int, dict[str, UnitEntry]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def writes(self) -> dict[tuple[int, int, str], list[str]]:
        """(step, rank, kind) -> the step files that hold a write of it."""
        if self.indexed is None:
            self.indexed = {}
            for rel, entry in self.units.items():
                self._index(rel, entry)
        return self.indexed

    def _index(self, rel: str, entry: UnitEntry) -> None:
        assert self.indexed is not None
        rows = entry.record.get("rows", {})
        for key in zip(rows.get("step", ()), rows.get("rank", ()), rows.get("kind", ())):
            self.indexed.setdefault(key, []).append(rel)

    def writes_of(self, step: int, rank: int, kind: str) -> list[UnitEntry]:
        """The committed writes of one unit (several when attempts rewrote it)."""
        return [self.units[rel] for rel in self.writes.get((step, rank, kind), ())]

    def _add(self, rel: str, entry: UnitEntry) -> None:
        self.units[rel] = entry
        if self.indexed is not None:
            self._index(rel, entry)

    def _drop(self, rel: str) -> UnitEntry | None:
        entry = self.units.pop(rel, None)
        if entry is not None and self.indexed is not None:
            rows = entry.record.get("rows", {})
            for key in zip(rows.get("step", ()), rows.get("rank", ()), rows.get("kind", ())):
                held = self.indexed.get(key)
                if held and rel in held:
                    held.remove(rel)
        return entry

    @property
    def resumed(self) -> bool:
        """Whether any attempt after the first resumed (else nothing is superseded: every
        cutoff is ``None``, and no unit's rows need reading to know it is effective)."""
        return any(a.resume_from is not None for a in self.attempts[1:])

    def copy(self) -> LogState:
        """A copy that later entries do not change (a reader's pinned version)."""
        return LogState(
            version=self.version,
            run=self.run,
            attempts=list(self.attempts),
            units=dict(self.units),
            records={k: list(v) for k, v in self.records.items()},
            retiring=dict(self.retiring),
            replaced=dict(self.replaced),
            replaced_raw=dict(self.replaced_raw),
            indexed=None if self.indexed is None else {k: list(v) for k, v in self.indexed.items()},
        )

    def apply(self, entry: Mapping[str, Any]) -> None:
        """Apply the next entry (its version must be :attr:`version` + 1)."""
        version = int(entry["version"])
        if version != self.version + 1:
            raise StoreError(f"commit log: entry {version} applied after version {self.version}")
        op = entry.get("op")
        attempt = str(entry.get("attempt") or "")
        if self.run is None:
            self.run = entry.get("run")
        if op == "attempt":
            self.attempts.append(Attempt.from_json({**entry["attempt"], "version": version}))
            self.cutoffs.clear()
        elif op in ("append", "compact", "restore", "drop"):
            for rel in entry.get("replaces") or ():
                gone = self._drop(rel)
                if gone is not None:
                    self.replaced[rel] = gone
                    self.retiring[rel] = version
                    self.retiring[f"{GROUPS}/{gone.record['group_file']}"] = version
            rel = entry.get("step_file")
            if rel is None:  # a drop: files leave the history, none comes in
                self.version = version
                return
            record = entry["record"]
            self._add(
                rel,
                UnitEntry(
                    rel,
                    record,
                    attempt,
                    version,
                    entry.get("step_size"),
                    entry.get("step_crc32"),
                    # Its counts, once (the next checkpoint keeps them): inspect's reading.
                    json.dumps(unit_summary(record)),
                ),
            )
        elif op == "step_file":
            rel = entry["step_file"]
            unit = self.units.get(rel)
            if unit is not None:
                self.units[rel] = dataclasses.replace(
                    unit, step_size=entry.get("step_size"), step_crc32=entry.get("step_crc32")
                )
        elif op == "records":
            self.records.setdefault(entry["name"], []).append(
                {**entry["file"], "attempt": attempt, "version": version}
            )
        elif op == "retire":
            for rel in entry.get("files") or ():
                self.retiring.pop(rel, None)
                self.replaced.pop(rel, None)
                self.replaced_raw.pop(rel, None)
        elif op != "noop":
            raise StoreError(f"commit log: entry {version} has an unknown op {op!r}")
        self.version = version

    def replaced_entry(self, rel: str) -> UnitEntry | None:
        """The entry of step file ``rel`` that a compaction (or a drop) replaced, until it is
        retired (``None``: not one)."""
        entry = self.replaced.get(rel)
        if entry is None and rel in self.replaced_raw:
            text, attempt, version = self.replaced_raw.pop(rel)
            entry = _unit_from_item(json.loads(text), {"attempt": attempt, "version": version})
            self.replaced[rel] = entry
        return entry

    # ------------------------------------------------------------------ the history
    def attempt(self, attempt_id: str) -> Attempt | None:
        for a in self.attempts:
            if a.id == attempt_id:
                return a
        return None

    def cutoff(self, attempt_id: str, kind: str | None = None) -> int | None:
        """The first step of ``attempt_id``'s writes (of ``kind``) that later attempts
        supersede: the lowest resume point of a later attempt of its role (``None``: nothing
        superseded). A step is *effective* when it is below its attempt's cutoff."""
        key = (attempt_id, kind)
        if key in self.cutoffs:
            return self.cutoffs[key]
        if not self.resumed:
            return None
        mine = self.attempt(attempt_id)
        points = [
            point
            for a in self.attempts
            if mine is not None
            and a.version > mine.version
            and a.role == mine.role
            and (point := a.resumes_at(kind)) is not None
        ]
        self.cutoffs[key] = cut = min(points) if points else None
        return cut

    def is_effective(self, step: int, attempt_id: str, kind: str | None = None) -> bool:
        """Whether ``attempt_id``'s write of ``step`` (of ``kind``) is the run's history."""
        cut = self.cutoff(attempt_id, kind)
        return cut is None or step < cut

    def effective_units(self, e: UnitEntry) -> list[bool]:
        """For each unit of step file ``e`` (its step rows, in order): effective or not."""
        rows = e.record.get("rows", {})
        steps = rows.get("step") or []
        kinds = rows.get("kind") or [None] * len(steps)
        return [self.is_effective(s, e.attempt, k) for s, k in zip(steps, kinds)]

    def superseded_steps(self) -> list[int]:
        """The steps of which some committed write was superseded by a later attempt, in
        order. Only the step files that reach their attempt's cutoff have their step rows
        read (a file name says its kind and its last step): none in a run never resumed."""
        out: set[int] = set()
        if not self.resumed:
            return []
        for rel, e in self.units.items():
            parsed = parse_name(rel.rpartition("/")[2])
            cut = self.cutoff(e.attempt, parsed.kind if parsed is not None else unit_kind(e))
            if cut is None or (parsed is not None and parsed.last_step < cut):
                continue  # every unit of the file is below its cutoff: effective
            steps = e.record["rows"]["step"]
            out.update(s for s, kept in zip(steps, self.effective_units(e)) if not kept)
        return sorted(out)

    def effective(self) -> dict[str, UnitEntry]:
        """The committed step files with at least one effective unit (a compacted segment
        may be superseded in part: readers filter its rows by :meth:`cutoff`)."""
        hit = self.effective_at.get(self.version)
        if hit is None:
            if not self.resumed:
                hit = dict(self.units)  # nothing superseded
            else:
                hit = {rel: e for rel, e in self.units.items() if any(self.effective_units(e))}
            self.effective_at.clear()
            self.effective_at[self.version] = hit
        return hit

    # ------------------------------------------------------------------ checkpoints
    def to_table(self) -> pa.Table:
        """The state as a checkpoint table: one row per live item, typed columns for plain
        readers (``kind``, ``path``, ``effective``) and the item itself as JSON."""
        rows: list[dict[str, Any]] = []
        effective = self.effective()
        resumed = self.resumed
        for rel, e in list(self.units.items()):
            # (a unit's group file has its step file's name: the commit rule)
            group = f"{GROUPS}/{rel.rpartition('/')[2]}"
            item, rows_text = _unit_item_text(e)
            summary = _summary_text(e)
            if e.summary is None:  # (read from an older checkpoint: computed once, kept)
                self.units[rel] = dataclasses.replace(e, summary=summary)
            for kind, path in (("step_file", rel), ("group_file", group)):
                rows.append(
                    {
                        "kind": kind,
                        "path": path,
                        "effective": rel in effective,
                        "cutoff": self.cutoff(e.attempt, unit_kind(e)) if resumed else None,
                        "attempt": e.attempt,
                        "version": e.version,
                        "step_size": e.step_size,
                        "step_crc32": e.step_crc32,
                        # The unit's record once, on its step file's row; its step rows
                        # beside it (parsed by a reader only when it needs them).
                        "item": item if kind == "step_file" else "{}",
                        "rows": rows_text if kind == "step_file" else None,
                        # Its counts (inspect reads these, never the rows).
                        "summary": summary if kind == "step_file" else None,
                    }
                )
        for name, files in self.records.items():
            for f in files:
                rows.append(
                    {
                        "kind": f"records:{name}",
                        "path": f["path"],
                        "effective": True,
                        # Rows of steps at or after it are superseded (records with a step).
                        "cutoff": self.cutoff(f["attempt"]),
                        "attempt": f["attempt"],
                        "version": f["version"],
                        "item": json.dumps(f),
                    }
                )
        for a in self.attempts:
            rows.append(
                {
                    "kind": "attempt",
                    "path": None,
                    "effective": True,
                    "cutoff": None,
                    "attempt": a.id,
                    "version": a.version,
                    "item": json.dumps(a.to_json()),
                }
            )
        for path, version in self.retiring.items():
            gone = self.replaced.get(path)
            raw = self.replaced_raw.get(path)
            if gone is not None:
                attempt, item = gone.attempt, json.dumps(_unit_item(gone))
            elif raw is not None:
                attempt, item = raw[1], raw[0]
            else:
                attempt, item = None, "{}"
            rows.append(
                {
                    "kind": "retiring",
                    "path": path,
                    "effective": False,
                    "cutoff": None,
                    "attempt": attempt,
                    "version": version,
                    "item": item,
                }
            )
        schema = pa.schema(
            [
                ("kind", pa.string()),
                ("path", pa.string()),
                ("effective", pa.bool_()),
                # Rows of the file at or after this step are superseded (a resume).
                ("cutoff", pa.int64()),
                ("attempt", pa.string()),
                ("version", pa.int64()),
                ("item", pa.string()),
                # A unit's step rows (JSON, column name -> values); its item records their
                # names (``row_names``). Older checkpoints hold them inside the item.
                ("rows", pa.string()),
                # A step file's size and CRC-32 (also in its item): read without the item.
                ("step_size", pa.int64()),
                ("step_crc32", pa.int64()),
                # A step file's counts (:func:`unit_summary`, JSON): what ``inspect`` reads.
                # Older checkpoints lack it; they are computed from the rows.
                ("summary", pa.string()),
            ],
            metadata={
                b"maxent_arrow.log": json.dumps(
                    {"format": LOG_FORMAT, "version": self.version, "run": self.run}
                ).encode()
            },
        )
        # The units last (:func:`checkpoint_bytes` gives the other rows a row group of their
        # own: a reader reads their items at once and a unit's item when first used).
        rows = [r for r in rows if r["kind"] not in _UNIT_ROWS] + [
            r for r in rows if r["kind"] in _UNIT_ROWS
        ]
        return pa.Table.from_pylist(rows, schema=schema)

    @classmethod
    def from_bytes(cls, data: bytes) -> LogState:
        """The state of a checkpoint file's bytes. The units' records (``item``), step rows
        (``rows``: most of a long run's checkpoint) and summaries are read when first asked
        for, one row group at a time (a checkpoint written as one row group: the column)."""
        source = pq.ParquetFile(pa.BufferReader(data))
        names = source.schema_arrow.names
        if "rows" not in names:
            return cls.from_table(source.read(use_threads=False))
        lazy = {"rows", "summary", "item"}
        table = source.read([n for n in names if n not in lazy], use_threads=False)
        groups = [source.metadata.row_group(i).num_rows for i in range(source.num_row_groups)]
        starts = [sum(groups[:i]) for i in range(len(groups))]
        columns: dict[tuple[str, int], list[str | None]] = {}

        def read(name: str, index: int) -> str | None:
            group = bisect.bisect_right(starts, index) - 1
            key = (name, group)
            if key not in columns:
                part = pq.ParquetFile(pa.BufferReader(data)).read_row_group(
                    group, [name], use_threads=False
                )
                columns[key] = part.column(0).to_pylist()
            return columns[key][index - starts[group]]

        def text_of(name: str) -> Callable[[int], Callable[[], str]]:
            """How to get row ``index``'s ``name`` (a column every row holds)."""

            def at(index: int) -> Callable[[], str]:
                def fetch() -> str:
                    text = read(name, index)
                    assert text is not None
                    return text

                return fetch

            return at

        def summary_of(index: int) -> Callable[[], str | None] | None:
            return (lambda: read("summary", index)) if "summary" in names else None

        return cls.from_table(table, text_of("rows"), summary_of, text_of("item"))

    @classmethod
    def from_table(
        cls,
        table: pa.Table,
        rows_of: Callable[[int], Callable[[], str]] | None = None,
        summary_of: Callable[[int], Callable[[], str | None] | None] | None = None,
        item_of: Callable[[int], Callable[[], str]] | None = None,
    ) -> LogState:
        """The state of a checkpoint table (``rows_of(i)``, ``summary_of(i)``,
        ``item_of(i)``: how to get row ``i``'s step rows, summary and item when the table
        was read without those columns)."""
        meta = json.loads((table.schema.metadata or {})[b"maxent_arrow.log"])
        state = cls(version=int(meta["version"]), run=meta.get("run"))
        for index, row in enumerate(table.to_pylist()):
            kind = row["kind"]
            if kind == "group_file":
                continue  # its unit is the step file's row
            lazy = kind == "step_file" and rows_of is not None and "step_size" in row
            if item_of is not None and not lazy:
                row["item"] = item_of(index)()
            if kind == "retiring":
                state.retiring[row["path"]] = row["version"]
                if row["item"] != "{}":
                    state.replaced_raw[row["path"]] = (row["item"], row["attempt"], row["version"])
                continue
            if lazy and rows_of is not None:
                # This format: the record parsed when first used.
                stamp = (row["step_size"], row["step_crc32"], row["version"])
                item = row["item"] if item_of is None else item_of(index)
                record = LazyRecord(item, rows_of(index), stamp)
                summary = row.get("summary") if summary_of is None else summary_of(index)
                entry = UnitEntry(
                    row["path"], record, row["attempt"], *stamp[2:], *stamp[:2], summary
                )
                state._add(row["path"], entry)
                continue
            item = json.loads(row["item"])
            if kind == "step_file":
                if "row_names" in item:
                    text = row.get("rows") if rows_of is None else rows_of(index)
                    item["record"]["rows"] = LazyRows(text, item.pop("row_names"))
                state._add(item["step_file"], _unit_from_item(item, row))
            elif kind == "attempt":
                state.attempts.append(Attempt.from_json(item))
            elif kind.startswith("records:"):
                state.records.setdefault(kind.partition(":")[2], []).append(item)
        state.attempts.sort(key=lambda a: a.version)
        return state


def unit_kind(e: UnitEntry) -> str | None:
    """The kind of step file ``e``'s units (a file holds one kind)."""
    kinds = e.record.get("rows", {}).get("kind") or [None]
    return kinds[0]


def step_runs(steps: list[int]) -> list[list[int]]:
    """Sorted distinct ``steps`` as runs ``[first, stride, count]`` (arithmetic progressions:
    a segment of 100 train steps is one run, its eval steps every 10th another)."""
    runs: list[list[int]] = []
    for step in steps:
        if runs:
            first, stride, count = runs[-1]
            if count == 1:
                runs[-1] = [first, step - first, 2]
                continue
            if step == first + stride * count:
                runs[-1][2] = count + 1
                continue
        runs.append([step, 1, 1])
    return runs


def count_runs(runs: list[list[int]]) -> int:
    """The number of distinct steps in ``runs`` (:func:`step_runs`' runs, of any number of
    files, overlapping or not): merged as intervals where they share a stride and an offset
    (files of one kind do), else counted as a set."""
    classes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for first, stride, count in {(r[0], r[1] if r[2] > 1 else 1, r[2]) for r in runs}:
        classes.setdefault((stride, first % stride), []).append((first, first + stride * count))
    if len(classes) > 1:
        seen: set[int] = set()
        for (stride, _), spans in classes.items():
            for lo, hi in spans:
                seen.update(range(lo, hi, stride))
        return len(seen)
    total = 0
    for (stride, _), spans in classes.items():
        end = None
        for lo, hi in sorted(spans):
            if end is not None and lo < end:
                lo = end
            if hi > lo:
                total += (hi - lo) // stride
                end = hi
    return total


def unit_summary(
    record: Mapping[str, Any], keep: Callable[[int, str | None], bool] | None = None
) -> dict[str, Any]:
    """What a description of the run (``maxent-arrow inspect``) needs of one step file, from
    its commit record, so that it is read without the file's step rows: per kind of its
    step rows (those ``keep(step, kind)`` keeps; default every one) the steps
    (:func:`step_runs`), the rows, the sums of ``num_groups`` and ``num_samples`` (``None``
    where every value is null, as SQL sums), the ranks, and each distinct ``config`` with
    its last step; and the file's reward names, schema version and group file size."""
    rows = record.get("rows") or {}
    size = len(rows.get("step") or ())

    def column(name: str) -> list[Any]:
        values = rows.get(name)
        return list(values) if values is not None else [None] * size

    per: dict[str | None, dict[str, Any]] = {}
    for step, rank, kind, groups, samples, config in zip(*map(column, R.UNIT_COUNTS)):
        if keep is not None and not keep(step, kind):
            continue
        k = per.get(kind)
        if k is None:
            k = per[kind] = {
                "steps": set(), "rows": 0, "groups": None, "samples": None, "ranks": set(),
                "configs": {},
            }  # fmt: skip
        k["steps"].add(step)
        k["rows"] += 1
        if groups is not None:
            k["groups"] = (k["groups"] or 0) + groups
        if samples is not None:
            k["samples"] = (k["samples"] or 0) + samples
        if rank is not None:
            k["ranks"].add(rank)
        if config is not None:
            k["configs"][config] = max(step, k["configs"].get(config, step))
    return {
        "kinds": [
            {
                "kind": kind,
                "steps": step_runs(sorted(k["steps"])),
                "rows": k["rows"],
                "groups": k["groups"],
                "samples": k["samples"],
                "ranks": sorted(k["ranks"]),
                "configs": [[config, last] for config, last in k["configs"].items()],
            }
            for kind, k in per.items()
        ],
        "reward_names": list(record.get("reward_names") or []),
        "schema_version": record.get("schema_version"),
        "group_size": record.get("group_size"),
    }


def entry_summaries(entries: list[UnitEntry]) -> list[dict[str, Any]]:
    """:func:`unit_summary` of each step file of ``entries``: the one the log keeps (parsed
    in one pass for all), else computed from its record (a checkpoint written before
    summaries)."""
    texts = [e.summary() if callable(e.summary) else e.summary for e in entries]
    parsed = iter(json.loads("[" + ",".join(t for t in texts if t is not None) + "]"))
    return [unit_summary(e.record) if t is None else next(parsed) for e, t in zip(entries, texts)]


def _summary_text(e: UnitEntry) -> str:
    text = e.summary() if callable(e.summary) else e.summary
    return json.dumps(unit_summary(e.record)) if text is None else text


def _unit_item(e: UnitEntry) -> dict[str, Any]:
    """A unit entry as a checkpoint's ``item`` JSON (its attempt and version are columns)."""
    return {
        "step_file": e.step_file,
        "record": e.record,
        "step_size": e.step_size,
        "step_crc32": e.step_crc32,
        "unit_version": e.version,
    }


def _unit_item_text(e: UnitEntry) -> tuple[str, str | None]:
    """A unit entry as a checkpoint row's ``item`` JSON without its step rows, and the rows
    as JSON text of their own (passed through unparsed when read from a checkpoint)."""
    record = e.record
    if isinstance(record, LazyRecord) and record.item_text is not None:
        if record.stamp == (e.step_size, e.step_crc32, e.version):
            return record.item_text, record.text_of_rows()
    rows = e.record.get("rows") if isinstance(e.record, Mapping) else None
    if not isinstance(rows, dict):
        return json.dumps(_unit_item(e)), None
    record = {k: v for k, v in e.record.items() if k != "rows"}
    item = {**_unit_item(e), "record": record, "row_names": list(rows)}
    text = rows.text() if isinstance(rows, LazyRows) else json.dumps(rows)
    return json.dumps(item), text


def _unit_from_item(item: Mapping[str, Any], row: Mapping[str, Any]) -> UnitEntry:
    return UnitEntry(
        item["step_file"],
        item["record"],
        row["attempt"],
        int(item.get("unit_version", row["version"])),
        item.get("step_size"),
        item.get("step_crc32"),
    )


def _canonical(entry: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in entry.items() if k != "crc32"}
    return json.dumps(body, sort_keys=True, allow_nan=True, separators=(",", ":")).encode()


def parse_entry(data: bytes, version: int, where: str) -> dict[str, Any]:
    """A log entry's JSON, checked: an object of this format, for ``version``, whose CRC-32
    (of its canonical JSON) is the one it carries."""
    try:
        entry = json.loads(data)
    except ValueError as exc:
        raise StoreError(f"{where}: unreadable commit log entry ({exc})") from None
    if not isinstance(entry, dict) or entry.get("format") != LOG_FORMAT:
        raise StoreError(f"{where}: not a commit log entry of format {LOG_FORMAT}")
    if entry.get("crc32") != crc32(_canonical(entry)):
        raise StoreError(f"{where}: CRC-32 differs from the one in the entry (corrupt)")
    if entry.get("version") != version:
        raise StoreError(
            f"{where}: entry says version {entry.get('version')}, its name says {version}"
        )
    return entry


def encode_entry(entry: Mapping[str, Any]) -> bytes:
    """An entry as the bytes of its file: JSON, with the time it was made and the CRC-32 of
    its canonical form."""
    full = {"format": LOG_FORMAT, "time": dt.datetime.now(dt.UTC).isoformat(), **entry}
    full["crc32"] = crc32(_canonical(full))
    # (NaN and infinities as Python's json writes them: step rows may hold them.)
    return json.dumps(full, sort_keys=True, allow_nan=True).encode()


# A checkpoint's row groups of units (two rows each: the step file and the group file).
CHECKPOINT_ROW_GROUP = 1024


def checkpoint_bytes(state: LogState) -> bytes:
    """A checkpoint file's bytes (Parquet, zstd): the attempts, record files and retiring
    files in a row group of their own (read whole when a reader opens it), then the units
    in row groups of :data:`CHECKPOINT_ROW_GROUP` rows (their records read when used)."""
    table = state.to_table()
    kinds = table.column("kind").to_pylist()
    head = next((i for i, k in enumerate(kinds) if k in _UNIT_ROWS), len(kinds))
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema, compression="zstd") as writer:
        if head or not len(kinds):
            writer.write_table(table.slice(0, head))
        if head < len(kinds):
            writer.write_table(table.slice(head), row_group_size=CHECKPOINT_ROW_GROUP)
    return sink.getvalue().to_pybytes()


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def versions_after(start: int) -> Iterator[int]:
    version = start + 1
    while True:
        yield version
        version += 1


# ---------------------------------------------------------------------------- the log itself
class CommitLog:
    """The commit log of one store: its state at the newest version this object has read,
    kept up to date incrementally, and the one way to commit."""

    def __init__(self, backend: Any, run: str | None = None):
        self.backend = backend
        self.run = run
        self._state: LogState | None = None
        # Whether a reader holds :attr:`_state` pinned (:meth:`pin`): the next entry is then
        # applied to a copy (copy on write: pinning costs nothing while nothing commits).
        self._pinned = False

    def pin(self) -> LogState:
        """The state at the newest version, which later entries never change (a reader's
        pinned version). Costs no copy unless this object applies an entry while it is
        held."""
        state = self.state()
        self._pinned = True
        return state

    def _own(self, state: LogState) -> LogState:
        """``state`` made this object's own to change (a copy when a reader pinned it)."""
        if self._pinned:
            state = state.copy()
            self._state = state
            self._pinned = False
        return state

    # ------------------------------------------------------------------ reading
    def state(self, *, fresh: bool = True) -> LogState:
        """The state at the newest version (``fresh``: read the entries committed since the
        last call; else the state as last read, a pinned version)."""
        state = self._state
        if state is None:
            state = self._from_checkpoint() or LogState(run=self.run)
            self._state = state  # (a state shared with other readers is copied on write)
        elif not fresh:
            return state
        for version in versions_after(state.version):
            data = self._read_entry(version)
            if data is None:
                break
            if state is self._state:
                state = self._own(state)
            state.apply(parse_entry(data, version, str(self.backend.path(entry_name(version)))))
        self._state = state
        return state

    def entry(self, version: int) -> dict[str, Any] | None:
        """The entry of ``version``, parsed and checked (``None``: not committed yet). One
        read, no listing (:mod:`.tail` polls this)."""
        data = self._read_entry(version)
        if data is None:
            return None
        return parse_entry(data, version, str(self.backend.path(entry_name(version))))

    def state_at(self, version: int) -> LogState:
        """The state at ``version`` exactly (a consumer's cursor), not the newest: the newest
        checkpoint at or below it (the pointer's, else the one at each multiple of
        :data:`CHECKPOINT_EVERY` below it, one stat each), then the entries up to it. A
        version past the log's end is a :class:`StoreError`."""
        if version < 0:
            raise StoreError(f"commit log: no version {version} (versions start at 1; 0: empty)")
        state = self._checkpoint_at_or_below(version) or LogState(run=self.run)
        while state.version < version:
            nxt = state.version + 1
            entry = self.entry(nxt)
            if entry is None:
                raise StoreError(
                    f"{self.backend.uri}: the commit log ends at version {state.version}, "
                    f"before version {version} (a cursor of another store?)"
                )
            state.apply(entry)
        return state

    def _checkpoint_at_or_below(self, version: int) -> LogState | None:
        pointer = f"{LOG}/{LAST_CHECKPOINT}"
        candidates: list[tuple[int, int | None]] = []
        if self.backend.stat(pointer) is not None:
            with contextlib.suppress(StoreError, ValueError, KeyError, TypeError):
                hint = json.loads(self.backend.read(pointer).to_pybytes())
                if int(hint["version"]) <= version:
                    candidates.append((int(hint["version"]), int(hint["crc32"])))
        candidates += [
            (v, None)
            for v in range(version // CHECKPOINT_EVERY * CHECKPOINT_EVERY, 0, -CHECKPOINT_EVERY)
        ]
        for at, crc in candidates:
            name = checkpoint_name(at)
            if self.backend.stat(name) is None:
                continue
            try:
                data = self.backend.read(name).to_pybytes()
                if crc is not None and crc32(data) != crc:
                    raise StoreError("checkpoint CRC-32 differs from the one recorded")
                state = LogState.from_bytes(data)
            except (StoreError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
                where = self.backend.path(name)
                warnings.warn(f"{where}: checkpoint not used ({exc})", stacklevel=3)
                continue
            if state.version == at:
                return state
        return None

    def _read_entry(self, version: int) -> bytes | None:
        """The entry of ``version`` (``None``: not committed yet). One read, no listing: on
        an object store one GET per poll."""
        try:
            return self.backend.read(entry_name(version)).to_pybytes()
        except StoreError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise

    def _from_checkpoint(self) -> LogState | None:
        """The state of the newest readable checkpoint (``None``: none yet)."""
        pointer = f"{LOG}/{LAST_CHECKPOINT}"
        if self.backend.stat(pointer) is None:
            return None
        try:
            hint = json.loads(self.backend.read(pointer).to_pybytes())
            key = (self.backend.uri, int(hint["version"]), int(hint["crc32"]))
            state = _CHECKPOINTS.get(key)
            if state is None:
                data = self.backend.read(checkpoint_name(int(hint["version"]))).to_pybytes()
                if crc32(data) != hint["crc32"]:
                    raise StoreError("checkpoint CRC-32 differs from the one recorded")
                state = LogState.from_bytes(data)
                _CHECKPOINTS[key] = state
                while len(_CHECKPOINTS) > _CHECKPOINTS_KEPT:
                    _CHECKPOINTS.pop(next(iter(_CHECKPOINTS)))
            # Shared with every reader of this checkpoint in the process: pinned, so this
            # log applies its next entry to a copy (and the records parsed by one reader
            # are parsed for all).
            self._pinned = True
            return state
        except (StoreError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            # A damaged checkpoint costs time, not correctness: replay the entries instead.
            where = self.backend.path(pointer)
            warnings.warn(f"{where}: checkpoint not used ({exc})", stacklevel=3)
            return None

    # ------------------------------------------------------------------ committing
    def commit(
        self,
        fields: Mapping[str, Any],
        *,
        check: Callable[[LogState], bool | None] | None = None,
        lock_timeout: float | None = None,
        locked: bool = False,
    ) -> int | None:
        """Commit one entry (``fields`` without ``version``) and return its version.

        Under the store lock where the backend has one, ``check(state)`` runs on the newest
        state: it raises when the commit must not happen, and returns ``False`` when it need
        not (nothing is committed; ``None`` is returned). Then the next entry is created
        exclusively. A writer that loses a race for a version (object stores: no lock) reads
        the winner's entry, checks again and takes the next version. ``locked``: the caller
        holds the store lock already (``repair``)."""
        for _ in range(_RACES):
            with contextlib.nullcontext() if locked else self.backend.lock(lock_timeout):
                state = self.state()
                if check is not None and check(state) is False:
                    return None
                version = state.version + 1
                entry = {**fields, "version": version, "run": state.run or self.run}
                data = encode_entry(entry)
                crash_point("log:entry-written")
                if self.backend.put_if_absent(entry_name(version), data):
                    state = self._own(state)
                    state.apply(parse_entry(data, version, entry_name(version)))
                    if version % CHECKPOINT_EVERY == 0:
                        with contextlib.suppress(OSError, StoreError):
                            self.write_checkpoint(state)  # a speed-up: failing it loses nothing
                    return version
        raise StoreError(
            f"{self.backend.uri}: lost the race for a commit log version {_RACES} times"
        )

    def write_checkpoint(self, state: LogState | None = None) -> int:
        """Write a checkpoint of ``state`` (default: the newest) and point readers at it, also
        under the stable name ``log/_checkpoint.parquet`` (what plain readers read). Returns
        its version. A crash leaves the older checkpoint in use."""
        state = state or self.state()
        data = checkpoint_bytes(state)
        self.backend.write_file(checkpoint_name(state.version), data)
        self.backend.write_file(f"{LOG}/{CHECKPOINT}", data)
        hint = {"version": state.version, "crc32": crc32(data), "size": len(data)}
        self.backend.write_file(f"{LOG}/{LAST_CHECKPOINT}", json.dumps(hint).encode())
        return state.version


_RACES = 1000

# The states of the checkpoints this process has read, by (store, version, CRC-32): a store
# opened again in the process (a new store object, a new SQL session) reads no checkpoint.
# A state at one version never changes (entries after it are applied to a copy).
_CHECKPOINTS: dict[tuple[str, int, int], LogState] = {}
_CHECKPOINTS_KEPT = 8
