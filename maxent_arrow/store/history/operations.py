"""The commit log's operations: one frozen dataclass per kind of entry, each with its
encoding, its decoding and what it does to the state (:meth:`Operation.apply`).

An entry is an envelope (:class:`Entry`: its version, the run, the attempt that wrote it, its
time) around one operation. Builders (the writer, compaction, repair, records, upgrade)
construct the operation; the log (:class:`~maxent_arrow.store.history.log.CommitLog`) commits
it as the next entry. The file of an entry is JSON::

    {"format": 1, "version": v, "time": ..., "run": ..., "attempt": ..., "op": ..., <fields>,
     "crc32": <CRC-32 of the canonical JSON without it>}

with, by ``op`` (the encoding is frozen: ``data/golden_v3`` holds one of each):

``"attempt"`` (:class:`BeginAttempt`)
    a writer session begins; its ``attempt`` field is the attempt itself (not its id) and
    ``superseded`` lists the units of earlier attempts it supersedes (a resume's tombstones).
``"append"`` (:class:`AppendUnit`)
    a unit: its step file and group file (relative paths) and its commit record (the step
    file's store metadata: sizes, checksums, columns, reward names, families, step rows).
``"compact"`` (:class:`CompactUnits`)
    a segment that replaces step files (``replaces``), atomically.
``"restore"`` (:class:`RestoreUnit`)
    ``repair``'s new copy of a unit whose group file was lost (from its IPC cache copies),
    replacing it, by the attempt that wrote it.
``"step_file"`` (:class:`RewriteStepFile`)
    ``repair`` wrote the step file of a committed unit again (lost or damaged) from the log's
    record of it: its new size and CRC-32.
``"drop"`` (:class:`DropUnits`)
    step files (``replaces``) leave the history: superseded units, retired by
    ``compact(drop_superseded=True)``.
``"records"`` (:class:`AppendRecords`)
    rows of a record table (trainer figures, group lifecycle): a Parquet file, its size and
    CRC-32, its row count.
``"retire"`` (:class:`RetireFiles`)
    files no reader may need any more (superseded or replaced, past the grace period).
``"noop"`` (:class:`Noop`)
    nothing; ``why`` says what it stands for (``repair``'s mark of a lost version that
    nothing survived to rebuild).
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as dt
import json
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar

from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.state import Attempt, LogState, UnitEntry

__all__ = [
    "LOG_FORMAT",
    "OPERATIONS",
    "AppendRecords",
    "AppendUnit",
    "BeginAttempt",
    "CompactUnits",
    "DropUnits",
    "Entry",
    "Noop",
    "Operation",
    "RestoreUnit",
    "RetireFiles",
    "RewriteStepFile",
    "UnitOperation",
    "crc32",
    "decode_entry",
]

LOG_FORMAT = 1


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Operation(abc.ABC):
    """One kind of commit: :attr:`OP` names it in the entry, :meth:`fields` are its JSON
    fields beside the envelope's, :meth:`decode` reads them back, :meth:`apply` changes the
    state as the commit does."""

    OP: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.OP:
            OPERATIONS[cls.OP] = cls

    @abc.abstractmethod
    def fields(self) -> dict[str, Any]: ...

    @classmethod
    @abc.abstractmethod
    def decode(cls, entry: Mapping[str, Any]) -> Operation: ...

    @abc.abstractmethod
    def apply(self, state: LogState, version: int, attempt: str) -> None: ...


# op name -> its class (filled as each class is defined)
OPERATIONS: dict[str, type[Operation]] = {}


@dataclasses.dataclass(frozen=True)
class BeginAttempt(Operation):
    """A writer session begins (:class:`~maxent_arrow.store.history.state.Attempt`), with
    the units of earlier attempts it supersedes (``{"attempt": id, "steps": [...]}`` each)."""

    OP: ClassVar[str] = "attempt"
    attempt: Attempt
    superseded: tuple[Mapping[str, Any], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"attempt": self.attempt.to_json(), "superseded": [dict(s) for s in self.superseded]}

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> BeginAttempt:
        return cls(Attempt.from_json(entry["attempt"]), tuple(entry.get("superseded") or ()))

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        state.attempts.append(dataclasses.replace(self.attempt, version=version))
        state.cutoffs.clear()


@dataclasses.dataclass(frozen=True)
class UnitOperation(Operation):
    """A unit's files committed: its step file (relative path), the step file's size and
    CRC-32, its commit record (which names the group file), and the step files it replaces
    (a compaction's inputs; a restore's lost unit)."""

    step_file: str
    record: Mapping[str, Any]
    step_size: int | None = None
    step_crc32: int | None = None
    replaces: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {
            "step_file": self.step_file,
            "step_size": self.step_size,
            "step_crc32": self.step_crc32,
            "record": self.record,
            "replaces": list(self.replaces),
        }

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> UnitOperation:
        return cls(
            entry["step_file"],
            entry["record"],
            entry.get("step_size"),
            entry.get("step_crc32"),
            tuple(entry.get("replaces") or ()),
        )

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        if self.replaces:
            state.leave(self.replaces, version)
        # (its counts, what inspect reads, are computed from the record when first asked for
        # and kept by the next checkpoint)
        entry = UnitEntry(
            self.step_file, self.record, attempt, version, self.step_size, self.step_crc32
        )
        state.add_unit(self.step_file, entry)


@dataclasses.dataclass(frozen=True)
class AppendUnit(UnitOperation):
    """One step of one rank appended (the tail's step events)."""

    OP: ClassVar[str] = "append"


@dataclasses.dataclass(frozen=True)
class CompactUnits(UnitOperation):
    """A segment committed in place of the step files it replaces."""

    OP: ClassVar[str] = "compact"


@dataclasses.dataclass(frozen=True)
class RestoreUnit(UnitOperation):
    """``repair``'s new copy of a unit whose group file was lost, replacing it."""

    OP: ClassVar[str] = "restore"


@dataclasses.dataclass(frozen=True)
class DropUnits(Operation):
    """Step files leave the history (superseded units, retired by a compaction)."""

    OP: ClassVar[str] = "drop"
    replaces: tuple[str, ...]
    why: str = "superseded"

    def fields(self) -> dict[str, Any]:
        return {"replaces": list(self.replaces), "why": self.why}

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> DropUnits:
        return cls(tuple(entry.get("replaces") or ()), str(entry.get("why") or ""))

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        state.leave(self.replaces, version)


@dataclasses.dataclass(frozen=True)
class RewriteStepFile(Operation):
    """A committed unit's step file written again (by ``repair``): its new size and CRC-32."""

    OP: ClassVar[str] = "step_file"
    step_file: str
    step_size: int | None
    step_crc32: int | None

    def fields(self) -> dict[str, Any]:
        return {"step_file": self.step_file, "step_size": self.step_size,
                "step_crc32": self.step_crc32}  # fmt: skip

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> RewriteStepFile:
        return cls(entry["step_file"], entry.get("step_size"), entry.get("step_crc32"))

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        unit = state.units.get(self.step_file)
        if unit is not None:
            state.units[self.step_file] = dataclasses.replace(
                unit, step_size=self.step_size, step_crc32=self.step_crc32
            )


@dataclasses.dataclass(frozen=True)
class AppendRecords(Operation):
    """A file of record table ``name`` committed: ``file`` holds its ``path``, ``size``,
    ``crc32``, ``rows`` and ``columns`` (name -> type)."""

    OP: ClassVar[str] = "records"
    name: str
    file: Mapping[str, Any]

    def fields(self) -> dict[str, Any]:
        return {"name": self.name, "file": dict(self.file)}

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> AppendRecords:
        return cls(entry["name"], entry["file"])

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        state.records.setdefault(self.name, []).append(
            {**self.file, "attempt": attempt, "version": version}
        )


@dataclasses.dataclass(frozen=True)
class RetireFiles(Operation):
    """Files past the grace period, gone for good (relative paths)."""

    OP: ClassVar[str] = "retire"
    files: tuple[str, ...]

    def fields(self) -> dict[str, Any]:
        return {"files": list(self.files)}

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> RetireFiles:
        return cls(tuple(entry.get("files") or ()))

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        state.retire(self.files)


@dataclasses.dataclass(frozen=True)
class Noop(Operation):
    """An entry that changes nothing; ``why``: what it stands for (``repair`` fills a lost
    version that nothing survived to rebuild with one that says so)."""

    OP: ClassVar[str] = "noop"
    why: str = ""

    def fields(self) -> dict[str, Any]:
        return {"why": self.why} if self.why else {}

    @classmethod
    def decode(cls, entry: Mapping[str, Any]) -> Noop:
        return cls(str(entry.get("why") or ""))

    def apply(self, state: LogState, version: int, attempt: str) -> None:
        if self.why:
            state.notes[version] = self.why


# ---------------------------------------------------------------------------- entries
@dataclasses.dataclass(frozen=True)
class Entry:
    """One committed entry: its version, its operation, the attempt that wrote it (its id:
    ``""`` for upkeep that belongs to no attempt), the store's run and the time it was made."""

    version: int
    operation: Operation
    attempt: str = ""
    run: str | None = None
    time: str = ""

    @property
    def op(self) -> str:
        return self.operation.OP

    def apply(self, state: LogState) -> None:
        """Apply this entry to ``state``, whose version must be :attr:`version` - 1."""
        if self.version != state.version + 1:
            raise StoreError(
                f"commit log: entry {self.version} applied after version {state.version}"
            )
        if state.run is None:
            state.run = self.run
        self.operation.apply(state, self.version, self.attempt)
        state.version = self.version

    def encode(self) -> bytes:
        """The bytes of its file: JSON, with the CRC-32 of its canonical form."""
        body: dict[str, Any] = {
            "format": LOG_FORMAT,
            "version": self.version,
            "time": self.time or dt.datetime.now(dt.UTC).isoformat(),
            "run": self.run,
            "attempt": self.attempt,
            "op": self.operation.OP,
            # (an attempt entry's own ``attempt`` field is the attempt, not its id)
            **self.operation.fields(),
        }
        body["crc32"] = crc32(_canonical(body))
        # (NaN and infinities as Python's json writes them: step rows may hold them.)
        return json.dumps(body, sort_keys=True, allow_nan=True).encode()


def _canonical(entry: Mapping[str, Any]) -> bytes:
    """The JSON of ``entry`` without its ``crc32``, as its CRC-32 is computed over."""
    body = entry
    if "crc32" in body:
        body = dict(body)
        del body["crc32"]
    return json.dumps(body, sort_keys=True, allow_nan=True, separators=(",", ":")).encode()


def decode_entry(data: bytes, version: int, where: str) -> Entry:
    """An entry file's bytes, checked (a JSON object of this format, for ``version``, whose
    CRC-32 of its canonical JSON is the one it carries) and decoded."""
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise StoreError(f"{where}: unreadable commit log entry ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != LOG_FORMAT:
        raise StoreError(f"{where}: not a commit log entry of format {LOG_FORMAT}")
    if raw.get("crc32") != crc32(_canonical(raw)):
        raise StoreError(f"{where}: CRC-32 differs from the one in the entry (corrupt)")
    if raw.get("version") != version:
        said = raw.get("version")
        raise StoreError(f"{where}: entry says version {said}, its name says {version}")
    kind = OPERATIONS.get(str(raw.get("op")))
    if kind is None:
        raise StoreError(f"{where}: commit log entry {version} has an unknown op {raw.get('op')!r}")
    try:
        operation = kind.decode(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{where}: commit log entry {version} ({kind.OP}) lacks {exc}") from None
    attempt = operation.attempt.id if isinstance(operation, BeginAttempt) else raw.get("attempt")
    return Entry(version, operation, str(attempt or ""), raw.get("run"), str(raw.get("time", "")))
