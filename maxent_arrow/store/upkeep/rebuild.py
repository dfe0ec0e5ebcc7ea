"""Rebuilding lost commit log entries from what survives (``repair``'s first step).

An entry is *lost* when it is missing or damaged while the evidence says it was committed:
a later entry, the log's head, or a checkpoint of a later version (``docs/commit-protocol.md``,
"The log proves its own completeness"). Each lost version is rebuilt, in order, from:

1. a checkpoint of a later version, which holds the state it led to: the unit, the attempt,
   the record file or the files it took out of the history that carry its version;
2. else the files no surviving entry names: a step file records its unit's commit (its store
   metadata, its step rows, sealed with its own CRC-32), a record table's file its table;
   the one such file (of several, the one written before the next surviving entry) is the
   lost entry's, by the attempt of the unit committed nearest to it;
3. else an attempt the surviving entries name but no entry began (its resume point is not
   known: none is assumed);
4. else nothing survives to rebuild it: the version is filled with a ``noop`` that says so,
   so readers serve the rest, and ``verify`` keeps naming the loss.

A lost version with several candidate files is not guessed at: it stays lost, named, and the
files are kept. Nothing an entry could name is moved aside while any version is lost.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import zlib
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import Catalog, step_rows_json
from maxent_arrow.store.history.checkpoint import state_from_checkpoint
from maxent_arrow.store.history.listing import read_step_file
from maxent_arrow.store.history.log import CommitLog, entry_name
from maxent_arrow.store.history.operations import (
    AppendRecords,
    AppendUnit,
    BeginAttempt,
    CompactUnits,
    DropUnits,
    Entry,
    Noop,
    Operation,
    UnitOperation,
)
from maxent_arrow.store.history.state import Attempt, LogState
from maxent_arrow.store.storage.backend import is_temp_name
from maxent_arrow.store.storage.names import GROUPS, LOG, RECORDS, STEPS, UnitName, parse_name

__all__ = ["Rebuilt", "rebuild_lost"]


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """What :func:`rebuild_lost` did for one lost version: ``how`` it was rebuilt (``None``:
    it was not: ``why``), and the files it named."""

    version: int
    how: str | None
    why: str = ""
    files: tuple[str, ...] = ()


def rebuild_lost(catalog: Catalog, log: CommitLog) -> list[Rebuilt]:
    """Rebuild every lost version of ``log`` (the module docstring), under the store lock the
    caller holds. Returns what was done for each; an empty list: nothing was lost."""
    state = log.state()
    lost = log.lost
    backend = catalog.backend
    listed = {
        int(name[:20])
        for name in backend.list(LOG)
        if len(name) == 25 and name.endswith(".json") and name[:20].isdigit()
    }
    last = max([*listed, lost.evidence if lost is not None else 0, state.version])
    # Versions missing anywhere (a reader from the newest checkpoint never reads those
    # before it, a tail from the start does), and those the log's last read found lost
    # after the state it reached (missing, or damaged).
    missing = [v for v in range(1, last + 1) if v not in listed]
    if lost is not None:
        missing = sorted({*missing, lost.version})
    if not missing:
        return []
    survivors = {
        e.version: e for e in log.surviving_after(missing[0] - 1, last) if e.version not in missing
    }
    candidates = _orphans(catalog, state, survivors.values())
    later = _checkpoint_states(catalog, missing[0])
    done: list[Rebuilt] = []
    for version in missing:
        after = min((v for v in survivors if v > version), default=None)
        deadline = _entry_time(survivors[after]) if after is not None else None
        made: Any = _from_checkpoints(later, version)
        how = "from a later checkpoint"
        if made is None:
            made, how = _from_files(candidates, deadline), "from its files"
        if made is None:
            made, how = _from_attempts(state, survivors.values()), "from the later entries"
        if isinstance(made, str):  # not rebuilt, and why
            done.append(Rebuilt(version, None, made))
            continue
        if made is None:
            made = (Noop(f"lost entry {version}: nothing survived to rebuild it from"), "", ())
            how = "nothing survived to rebuild it from: a noop that says so"
        operation, attempt, files = made
        if isinstance(operation, UnitOperation) and not attempt:
            # A step file does not record its attempt: the nearest surviving unit's.
            attempt = _neighbour_attempt(state, survivors, version)
        data = Entry(version, operation, attempt, state.run or log.run).encode()
        name = entry_name(version)
        if backend.stat(name) is not None:  # damaged: its bytes are kept aside first
            backend.move(name, f"{LOG}/.damaged-{version:020d}.json")
        if not backend.put_if_absent(name, data):
            raise StoreError(f"{backend.path(name)}: written by another writer while repairing")
        for rel in files:
            candidates.pop(rel, None)
        done.append(Rebuilt(version, how, files=files))
    log.state()  # (read again: the log is whole, or still says which version is not)
    return done


def _entry_time(entry: Entry) -> float | None:
    try:
        return dt.datetime.fromisoformat(entry.time).timestamp()
    except ValueError:
        return None


def _orphans(
    catalog: Catalog, state: LogState, survivors: Any
) -> dict[str, tuple[Operation, str, tuple[str, ...], float]]:
    """The files no surviving entry names, each as the operation that would commit it (with
    its attempt, its files and its modification time): step files (read and checked by
    their seal) and record files."""
    backend = catalog.backend
    named = {rel for rel in state.units} | set(state.retiring)
    named |= {f"{GROUPS}/{e.record['group_file']}" for e in state.units.values()}
    named |= {str(i["path"]) for items in state.records.values() for i in items}
    for entry in survivors:
        operation = entry.operation
        if isinstance(operation, UnitOperation):
            named |= {operation.step_file, f"{GROUPS}/{operation.record['group_file']}"}
        elif isinstance(operation, AppendRecords):
            named.add(str(operation.file["path"]))
    out: dict[str, tuple[Operation, str, tuple[str, ...], float]] = {}
    for name, info in backend.list(STEPS).items():
        rel = f"{STEPS}/{name}"
        parsed = parse_name(name)
        if is_temp_name(name) or parsed is None or rel in named:
            continue
        try:
            step, size, crc = read_step_file(backend, rel, name, catalog.run_id)
        except StoreError:
            continue  # damaged: not a commit of this store
        group = f"{GROUPS}/{step.group_file}"
        if backend.stat(group) is None:
            continue
        record = {**step.meta, "rows": step_rows_json(step.table), "schema_version": step.version}
        kind = CompactUnits if cast(UnitName, parsed).compacted else AppendUnit
        out[rel] = (kind(rel, record, size, crc), "", (rel, group), info.mtime_ns / 1e9)
    for table in backend.subdirectories(RECORDS):
        for name, info in backend.list(f"{RECORDS}/{table}").items():
            rel = f"{RECORDS}/{table}/{name}"
            if is_temp_name(name) or rel in named:
                continue
            try:
                data = backend.read(rel)
                read = pq.read_table(pa.BufferReader(data))
            except (StoreError, pa.ArrowException, OSError):
                continue
            file = {
                "path": rel,
                "size": data.size,
                "crc32": zlib.crc32(data) & 0xFFFFFFFF,
                "rows": read.num_rows,
                "columns": {f.name: str(f.type) for f in read.schema},
            }
            out[rel] = (AppendRecords(table, file), "", (rel,), info.mtime_ns / 1e9)
    return out


def _checkpoint_states(catalog: Catalog, first: int) -> list[LogState]:
    """The states of the readable checkpoints of versions at or after ``first``."""
    backend = catalog.backend
    out = []
    for name in sorted(backend.list(LOG)):
        if not (name.startswith("checkpoint-") and name.endswith(".parquet")):
            continue
        try:
            if int(name[len("checkpoint-") : -len(".parquet")]) < first:
                continue
            out.append(state_from_checkpoint(backend.read(f"{LOG}/{name}").to_pybytes()))
        except (StoreError, ValueError, KeyError, TypeError, pa.ArrowException):
            continue
    return out


def _from_checkpoints(
    states: list[LogState], version: int
) -> tuple[Operation, str, tuple[str, ...]] | None:
    """The operation of ``version`` as a later checkpoint's state shows it: the unit it
    committed (and the files it replaced), the attempt it began, the record file it
    committed, or the files it dropped."""
    for state in states:
        units = [e for e in state.units.values() if e.version == version]
        replaced = tuple(sorted(r for r, v in state.retiring.items() if v == version and
                                r.startswith(f"{STEPS}/")))  # fmt: skip
        if units:
            e = units[0]
            parsed = parse_name(e.step_file.rpartition("/")[2])
            kind = CompactUnits if parsed is not None and parsed.compacted else AppendUnit
            # (a checkpoint's record and its rows are parsed when first used: made plain)
            record = {k: dict(v.items()) if isinstance(v, dict) else v
                      for k, v in e.record.items()}  # fmt: skip
            operation = kind(e.step_file, record, e.step_size, e.step_crc32, replaced)
            group = f"{GROUPS}/{record['group_file']}"
            return operation, e.attempt, (e.step_file, group)
        for attempt in state.attempts:
            if attempt.version == version:
                return BeginAttempt(dataclasses.replace(attempt, version=0)), attempt.id, ()
        for name, items in state.records.items():
            for item in items:
                if item.get("version") == version:
                    file = {k: v for k, v in item.items() if k not in ("attempt", "version")}
                    return AppendRecords(name, file), str(item.get("attempt") or ""), ()
        if replaced:
            return DropUnits(replaced, "superseded"), "", ()
    return None


def _from_files(
    candidates: dict[str, tuple[Operation, str, tuple[str, ...], float]], deadline: float | None
) -> tuple[Operation, str, tuple[str, ...]] | str | None:
    """The one file (a step file, a record file) no surviving entry names (of several, the
    one written before the next surviving entry: a copy or a restore from a backup moves
    the times); several still: a reason not to guess (``str``)."""
    fitting = list(candidates.values())
    if len(fitting) > 1 and deadline is not None:
        fitting = [c for c in fitting if c[3] <= deadline + 1.0]
    if len(fitting) > 1:
        return (
            f"{len(fitting)} files no entry names could be the lost entry's "
            f"({', '.join(sorted(f[2][0] for f in fitting)[:3])}...): not guessed at; kept"
        )
    if not fitting:
        return None
    operation, attempt, files, _ = fitting[0]
    return operation, attempt, files


def _neighbour_attempt(state: LogState, survivors: dict[int, Entry], version: int) -> str:
    """The attempt of the unit committed nearest to ``version`` (the one after it first)."""
    for v in sorted(survivors, key=lambda v: (abs(v - version), v < version)):
        if isinstance(survivors[v].operation, UnitOperation):
            return survivors[v].attempt
    units = sorted(state.units.values(), key=lambda e: e.version)
    return units[-1].attempt if units else ""


def _from_attempts(
    state: LogState, survivors: Any
) -> tuple[Operation, str, tuple[str, ...]] | None:
    """An attempt the surviving entries name that no entry began: its entry, rebuilt (its
    resume point unknown: none)."""
    begun = {a.id for a in state.attempts}
    for entry in survivors:
        if isinstance(entry.operation, BeginAttempt):
            begun.add(entry.operation.attempt.id)
    for entry in survivors:
        if entry.attempt and entry.attempt not in begun:
            attempt = Attempt(id=entry.attempt, mode="rebuilt")
            return BeginAttempt(attempt), entry.attempt, ()
    return None
