"""``repair``: move leftovers of crashed writes aside, into ``quarantine/``; never delete.

It takes the store lock (so no commit is in flight) and moves temp files of writers that are
gone and files no commit log entry names (writes that did not finish); what a committed
compaction replaced goes to ``retired/``, as the compaction would have done. A lost step file
is written again from the log's record of it, a lost group file from its units' IPC cache
copies. Temp files of writers still running stay. It moves other writers' files, so it needs
a backend that can lock and rename atomically (local stores). A store without a commit log
is not repaired (:class:`~maxent_arrow.errors.ReadOnlyFormatError`: upgrade it first).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.registry import UNIT_KEY
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import Catalog, StepFile
from maxent_arrow.store.history.log import CommitLog, entry_name
from maxent_arrow.store.history.operations import RestoreUnit, RewriteStepFile
from maxent_arrow.store.history.state import LogState, UnitEntry
from maxent_arrow.store.io.cache import read_cache, unit_group_crc32
from maxent_arrow.store.io.commit import (
    CommitRequest,
    UnitFiles,
    WriteSettings,
    commit_unit,
    step_file_bytes,
)
from maxent_arrow.store.storage.backend import is_temp_name, writer_alive
from maxent_arrow.store.storage.names import (
    CACHE,
    GROUPS,
    LOG,
    QUARANTINE,
    RECORDS,
    STEPS,
    UnitName,
    compact_name,
    parse_name,
    unit_name,
)
from maxent_arrow.store.storage.padding import pad_to_layout
from maxent_arrow.store.upkeep.compaction import retire
from maxent_arrow.store.upkeep.rebuild import rebuild_lost
from maxent_arrow.store.upkeep.verify import StoreProblem, describe_units

__all__ = ["RepairReport", "repair"]


@dataclass
class RepairReport:
    """What :meth:`RolloutStore.repair` did: each file moved to ``quarantine/`` and why,
    and what it left alone (temp files of writers still running)."""

    moved: list[StoreProblem] = field(default_factory=list)
    kept: list[StoreProblem] = field(default_factory=list)
    # Lost committed files written again (stores with a commit log): from the log's record
    # (a step file) or from IPC cache copies (a group file).
    restored: list[StoreProblem] = field(default_factory=list)
    # Lost commit log entries rebuilt from what survived (``rebuild``).
    rebuilt: list[StoreProblem] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"{len(self.moved)} files moved to quarantine/, {len(self.restored)} restored, "
            f"{len(self.rebuilt)} lost log entries rebuilt"
        ]
        lines += [f"  rebuilt {p}" for p in self.rebuilt]
        lines += [f"  restored {p}" for p in self.restored]
        lines += [f"  moved {p}" for p in self.moved]
        lines += [f"  kept {p}" for p in self.kept]
        return "\n".join(lines)


def repair(catalog: Catalog, *, lock_timeout: float | None = None) -> RepairReport:
    """Move leftovers of crashed writes into ``quarantine/`` (never delete): temp files of
    writers that are gone, files no commit log entry names, and files a committed compaction
    replaced; write lost committed files again from what survives. Runs under the store lock,
    so no commit is in flight."""
    log = catalog.writable("repair")
    backend = catalog.backend
    backend.require("can_rewrite", "repair")
    report = RepairReport()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    with backend.lock(lock_timeout):
        for done in rebuild_lost(catalog, log):
            path = backend.path(entry_name(done.version))
            if done.how is None:
                report.kept.append(StoreProblem(path, f"lost entry, not rebuilt: {done.why}"))
            else:
                shown = f" ({', '.join(done.files)})" if done.files else ""
                report.rebuilt.append(StoreProblem(path, f"lost entry rebuilt {done.how}{shown}"))
        if log.lost is not None:
            # A version still lost: any file no entry names may be its, so nothing moves.
            report.kept.append(
                StoreProblem(
                    backend.path(entry_name(log.lost.version)),
                    "still lost: no file was moved aside (any may be the lost commit's)",
                )
            )
            return report
        _repair_logged(catalog, log, report, stamp, lock_timeout)
    return report


def _repair_logged(
    catalog: Catalog, log: CommitLog, report: RepairReport, stamp: str, lock_timeout: float | None
) -> None:
    """A store with a commit log, under its lock (no commit in flight: a writer publishes its
    files under the lock, at its commit): a file no entry names is a leftover and moves aside;
    a lost step file is rewritten from the log's record of it; a lost group file is restored
    from the IPC cache copies of its units (a new commit that replaces the lost one, by the
    same attempt), or kept reported when there are none."""
    backend = catalog.backend
    state = log.state()
    live: set[str] = set()
    for rel, entry in state.units.items():
        live |= {rel, f"{GROUPS}/{entry.record['group_file']}"}

    def move(rel: str, why: str) -> None:
        directory, _, name = rel.partition("/")
        backend.move(rel, f"{QUARANTINE}/{stamp}/{directory}/{name.lstrip('.')}")
        report.moved.append(StoreProblem(backend.path(rel), why))

    # What each directory's files must be named by (None: only temp files are looked at):
    # the units' files, the record tables' files (a table's first write may have died before
    # its entry), and the cache and the log, whose temp files only are leftovers.
    records = {str(i["path"]) for items in state.records.values() for i in items}
    directories: list[tuple[str, set[str] | None]] = [
        (GROUPS, live),
        (STEPS, live),
        (CACHE, None),
        (LOG, None),
        *((f"{RECORDS}/{name}", records) for name in backend.subdirectories(RECORDS)),
    ]
    for directory, committed in directories:
        for name, info in backend.list(directory).items():
            rel = f"{directory}/{name}"
            if is_temp_name(name):
                if writer_alive(name, info.mtime_ns):
                    report.kept.append(
                        StoreProblem(backend.path(rel), "temp file of a running writer")
                    )
                else:
                    move(rel, "temp file of a writer that is gone")
            elif committed is None:
                continue
            elif rel in state.retiring:
                # What a compaction (or a drop) that stopped before tidying left: retired as
                # it would have done, where readers pinned to an older version find it.
                retire(backend, rel)
                report.moved.append(
                    StoreProblem(backend.path(rel), "replaced (commit log): moved to retired/")
                )
            elif rel not in committed:
                move(rel, "no commit log entry names it (a write that did not finish)")
    for rel, entry in sorted(state.units.items()):
        step = catalog.step_file(rel.rpartition("/")[2])
        what = describe_units(entry.record)
        if backend.stat(f"{GROUPS}/{step.group_file}") is None:
            restored = restore_from_cache(log, step, entry, lock_timeout)
            path = backend.path(f"{GROUPS}/{step.group_file}")
            if restored is None:
                report.kept.append(
                    StoreProblem(path, f"lost group file of {what}: no IPC cache copy of it")
                )
            else:
                report.restored.append(
                    StoreProblem(path, f"lost group file of {what}: restored as {restored}")
                )
        else:
            info = backend.stat(rel)
            if info is None:
                why = "lost"
            elif info.size != entry.step_size or (
                entry.step_crc32 is not None
                and zlib.crc32(backend.read(rel)) & 0xFFFFFFFF != entry.step_crc32
            ):
                why = "damaged"
                move(rel, f"damaged step file of {what} (its size or CRC-32 is not the log's)")
            else:
                continue
            data = step_file_bytes(step.table, _stored_meta(step.meta))
            backend.write_file(rel, data)
            log.commit(
                RewriteStepFile(rel, len(data), zlib.crc32(data) & 0xFFFFFFFF),
                attempt=entry.attempt,
                locked=True,
            )
            report.restored.append(
                StoreProblem(
                    backend.path(rel), f"{why} step file of {what}: written again from the log"
                )
            )
    for directory in (GROUPS, STEPS):
        with contextlib.suppress(OSError):
            backend.sync(directory)


def _stored_meta(record: Mapping[str, Any]) -> dict[str, Any]:
    """The store metadata a step file holds, from its commit record in the log."""
    return {k: v for k, v in record.items() if k not in ("rows", "schema_version")}


def restore_from_cache(
    log: CommitLog, step: StepFile, entry: UnitEntry, lock_timeout: float | None
) -> str | None:
    """Commit the rows of a lost group file again from its units' IPC cache copies (checked
    against their seals and tied to the lost file's CRC-32): new files, by the attempt that
    wrote the lost ones, replacing them. Returns the new step file's name, or ``None`` when
    a unit has no cache copy (nothing is written)."""
    backend = log.backend
    parts = []
    for s, r, k in zip(*(step.column(c) for c in UNIT_KEY)):
        batch = read_cache(backend, step, unit_name(s, r, k), check=True)
        if batch is None:
            return None
        parts.append(pa.Table.from_batches([batch]))
    meta = _stored_meta(step.meta)
    families = tuple(meta.get("families") or ())
    groups = pad_to_layout(
        pa.concat_tables(parts, promote_options="default"), S.group_schema(families=families)
    )
    parsed = cast(UnitName, parse_name(step.name))
    keys = list(zip(*(step.column(c) for c in UNIT_KEY)))
    name = (
        compact_name(
            parsed.kind,
            (parsed.first_step, parsed.last_step),
            (parsed.first_rank, parsed.last_rank),
            [(step.name, "restored")],
        )
        if parsed.compacted
        else unit_name(*keys[0])
    )
    record = {
        k: v
        for k, v in meta.items()
        if k
        not in ("group_file", "group_size", "group_crc32", "schema_key", "chunks", "unit", "run")
    }
    # Cache copies (and readers' checks of them) stay tied to the CRC-32 of the file each
    # unit was appended in.
    record["unit_crc32"] = {
        unit_name(*key): unit_group_crc32(step, unit_name(*key)) for key in keys
    }

    def still_lost(state: LogState) -> None:
        if entry.step_file not in state.units:
            raise StoreError(f"repair: {step.name} was replaced by another writer meanwhile")

    unit = UnitFiles(
        name,
        groups,
        {S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
        step.table,
        record,
        row_groups=[part.num_rows for part in parts],  # a segment: one row group per unit
    )
    request = CommitRequest(
        RestoreUnit,
        entry.attempt,
        still_lost,
        WriteSettings("zstd", None, lock_timeout),
        replaces=(step.name,),
        locked=True,
    )
    return commit_unit(log, unit, request).name
