"""Maintenance of a store: ``verify`` (find damage), ``compact`` (merge files atomically) and
``repair`` (move crash leftovers aside).

``verify`` only reads. ``compact`` and ``repair`` are writers and take the store lock, so they
exist on local stores only (``docs/commit-protocol.md``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_groups
from maxent_arrow.errors import StoreError
from maxent_arrow.store.backend import Backend, crash_point, is_temp_name, writer_alive
from maxent_arrow.store.cache import CACHE_META_KEY, unit_group_crc32
from maxent_arrow.store.catalog import Catalog, StepFile, Unit
from maxent_arrow.store.checksums import check_chunks, check_seal
from maxent_arrow.store.layout import (
    CACHE,
    GROUPS,
    MANIFEST,
    QUARANTINE,
    STEPS,
    cache_name,
    compact_name,
    parse_name,
    unit_name,
)
from maxent_arrow.store.manifest import read as read_manifest
from maxent_arrow.store.parquet import group_file_settings, write_parquet
from maxent_arrow.store.reader import conform, read_group_file
from maxent_arrow.store.schemas import UnifiedSchemas
from maxent_arrow.store.writer import group_file_meta, step_file_bytes

__all__ = ["RepairReport", "StoreProblem", "VerifyReport", "compact", "repair", "verify"]


@dataclass(frozen=True)
class StoreProblem:
    path: Any
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass
class VerifyReport:
    """What :meth:`RolloutStore.verify` found: ``problems`` (damage) and ``notes`` (harmless
    leftovers such as uncommitted group files of a crashed append)."""

    checked: int = 0
    problems: list[StoreProblem] = field(default_factory=list)
    notes: list[StoreProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        lines = [f"{self.checked} files checked, {len(self.problems)} problems"]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        lines += [f"  note {p}" for p in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- verify
def verify(catalog: Catalog) -> VerifyReport:
    """Check every file: the manifest; each step file (seal, name, rows); each committed
    group file (size, CRC-32 of the whole file and of every chunk, rows); each cache copy.
    Leftovers (temp files, uncommitted or replaced files) are notes, not problems."""
    report = VerifyReport()
    backend = catalog.backend
    try:
        read_manifest(backend)
    except StoreError as exc:
        report.problems.append(StoreProblem(backend.path(MANIFEST), str(exc)))
    names = catalog.step_names()
    replaced = catalog.hidden(names, "skip")
    committed: set[str] = set()
    for name in names:
        path = backend.path(f"{STEPS}/{name}")
        if name in replaced:
            report.notes.append(
                StoreProblem(path, "replaced by a compaction; `repair` moves it aside")
            )
            continue
        report.checked += 1
        try:
            step = catalog.step_file(name)
        except StoreError as exc:
            report.problems.append(StoreProblem(path, str(exc).removeprefix(f"{path}: ")))
            continue
        committed.add(step.group_file)
        _verify_step(report, backend, step)
    _leftovers(report, backend, committed, replaced)
    return report


def _verify_step(report: VerifyReport, backend: Backend, step: StepFile) -> None:
    path = backend.path(f"{STEPS}/{step.name}")
    parsed = parse_name(step.name)
    rows = {c: step.column(c) for c in ("step", "rank", "kind", "num_groups")}
    if not parsed.compacted and (
        len(rows["step"]) != 1
        or rows["step"][0] != parsed.first_step
        or rows["rank"][0] != parsed.first_rank
        or rows["kind"][0] != parsed.kind
    ):
        report.problems.append(StoreProblem(path, f"step row {rows} does not match the file name"))
    rel = f"{GROUPS}/{step.group_file}"
    group_path = backend.path(rel)
    report.checked += 1
    try:
        groups = read_group_file(backend, step, None, crc=True)
        if step.meta.get("chunks") is not None:
            check_chunks(
                str(group_path), step.meta["chunks"], lambda r: backend.read_ranges(rel, r), None
            )
    except StoreError as exc:
        report.problems.append(StoreProblem(group_path, str(exc).removeprefix(f"{group_path}: ")))
        return
    if groups.num_rows != sum(rows["num_groups"]):
        report.problems.append(
            StoreProblem(
                group_path,
                f"{groups.num_rows} group rows, the step rows say {sum(rows['num_groups'])}",
            )
        )
    if not parsed.compacted and groups.num_rows:
        steps = set(groups.column("step").unique().to_pylist())
        if steps != {parsed.first_step}:
            report.problems.append(
                StoreProblem(
                    group_path, f"holds steps {sorted(steps)}, expected {parsed.first_step}"
                )
            )
    if not backend.local:
        return
    units = zip(rows["step"], rows["rank"], rows["kind"], rows["num_groups"], step.starts)
    for number, rank, kind, count, start in units:
        _verify_cache(report, backend, step, unit_name(number, rank, kind), groups, start, count)


def _verify_cache(
    report: VerifyReport,
    backend: Backend,
    step: StepFile,
    unit: str,
    groups: pa.Table,
    start: int,
    count: int,
) -> None:
    """A unit's IPC cache copy, if any: its seal, and its rows against the archive's."""
    cache = f"{CACHE}/{cache_name(unit)}"
    if backend.stat(cache) is None:
        return
    report.checked += 1
    try:
        data = backend.read(cache).to_pybytes()
        if check_seal(data) is False:
            raise StoreError("IPC cache CRC-32 differs from the one sealed in it (corrupt)")
        cached = ipc.open_file(pa.BufferReader(data)).read_all()
        recorded = json.loads((cached.schema.metadata or {}).get(CACHE_META_KEY, b"{}"))
        if recorded.get("group_crc32") not in (None, unit_group_crc32(step, unit)):
            report.notes.append(
                StoreProblem(backend.path(cache), "copy of another commit of its unit (not served)")
            )
            return
        if needs_upgrade((cached.schema.metadata or {}).get(S.METADATA_KEY)):
            cached = upgrade_groups(cached, kind=unit.split(".")[2])
        archived = groups.slice(start, count)
        for name in cached.column_names:
            if name not in archived.column_names or not cached.column(name).equals(
                archived.column(name)
            ):
                raise StoreError(f"IPC cache differs from the Parquet archive (column {name!r})")
    except (StoreError, pa.ArrowException, OSError, ValueError) as exc:
        report.problems.append(StoreProblem(backend.path(cache), str(exc)))


def _leftovers(
    report: VerifyReport, backend: Backend, committed: set[str], replaced: set[str]
) -> None:
    for name in backend.list(GROUPS):
        path = backend.path(f"{GROUPS}/{name}")
        if is_temp_name(name):
            report.notes.append(StoreProblem(path, "temp file of an unfinished write"))
        elif name in replaced:
            report.notes.append(
                StoreProblem(path, "replaced by a compaction; `repair` moves it aside")
            )
        elif parse_name(name) is not None and name not in committed:
            report.notes.append(StoreProblem(path, "uncommitted (an append that did not finish)"))
    for directory in (STEPS, CACHE):
        for name in backend.list(directory):
            if is_temp_name(name):
                report.notes.append(
                    StoreProblem(
                        backend.path(f"{directory}/{name}"), "temp file of an unfinished write"
                    )
                )


# ---------------------------------------------------------------------------- compact
def _local_only(backend: Backend, what: str) -> None:
    if not backend.local:
        raise StoreError(
            f"{backend.uri}: {what} needs a local store (atomic renames and a lock); on object "
            "storage each rank is the only writer of its own files"
        )


def compact(
    catalog: Catalog,
    schemas: UnifiedSchemas,
    *,
    kind: str | None,
    steps: Iterable[int] | None,
    ranks: Iterable[int] | None,
    max_steps: int | None,
    compression: str,
    compression_level: int | None,
    loose_only: bool = False,
) -> list[Any]:
    """Merge committed files (per kind; ``max_steps`` distinct steps per segment) into
    segments, each committed atomically: readers see the inputs or the segment, never both
    and never neither, also after a crash at any point. ``loose_only`` merges one-step files
    only (segments stay as they are: the writer's policy never rewrites data twice). Returns
    the new step files."""
    backend = catalog.backend
    _local_only(backend, "compact")
    if max_steps is not None and max_steps < 1:
        raise StoreError(f"compact: max_steps must be >= 1, got {max_steps}")
    units = catalog.units(kind=kind, steps=steps, ranks=ranks)
    if loose_only:
        units = [u for u in units if not parse_name(u.step_file).compacted]
    by_kind: dict[str, list[Unit]] = {}
    for unit in units:
        by_kind.setdefault(unit.kind, []).append(unit)
    made = []
    for knd, members in sorted(by_kind.items()):
        distinct = sorted({u.step for u in members})
        size = max_steps or len(distinct)
        for at in range(0, len(distinct), size):
            chosen = set(distinct[at : at + size])
            chunk = [u for u in members if u.step in chosen]
            files = sorted({u.step_file for u in chunk})
            # Whole files only: a segment that holds steps outside this chunk stays as it is.
            whole = [f for f in files if {u.step for u in units if u.step_file == f} <= chosen]
            chunk = [u for u in chunk if u.step_file in whole]
            if len(whole) < 2:
                continue  # one file is already as compact as it gets
            made.append(
                _compact_files(catalog, schemas, knd, chunk, compression, compression_level)
            )
    return made


def _keep_nullability(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with the non-null flags of ``schema`` (``conform`` makes every column
    nullable), so that a segment's rows read back equal to the appended ones."""
    fields = [
        pa.field(
            f.name, f.type, nullable=schema.field(f.name).nullable or table.column(i).null_count > 0
        )
        for i, f in enumerate(table.schema)
    ]
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def _compact_files(
    catalog: Catalog,
    schemas: UnifiedSchemas,
    kind: str,
    units: list[Unit],
    compression: str,
    compression_level: int | None,
) -> Any:
    backend = catalog.backend
    group_schema = schemas.get(GROUPS, "raise")
    step_schema = schemas.get(STEPS, "raise")
    inputs = sorted({u.step_file for u in units})
    steps = {name: catalog.step_file(name) for name in inputs}
    groups, rows, starts, at = [], [], [], 0
    tables = {name: read_group_file(backend, step, None, crc=True) for name, step in steps.items()}
    for unit in units:
        table = tables[unit.step_file].slice(unit.start, unit.num_groups)
        groups.append(conform(table, group_schema))
        rows.append(conform(steps[unit.step_file].table.slice(unit.row, 1), step_schema))
        starts.append(at)
        at += unit.num_groups
    replaces = sorted({*inputs, *(r for step in steps.values() for r in step.replaces)})
    name = compact_name(
        kind,
        (min(u.step for u in units), max(u.step for u in units)),
        (min(u.rank for u in units), max(u.rank for u in units)),
        [(n, steps[n].meta.get("group_crc32")) for n in inputs],
    )
    group_table = _keep_nullability(pa.concat_tables(groups), group_schema)
    meta_schema = {S.METADATA_KEY: S.SCHEMA_VERSION.encode()}
    group = backend.write_temp(
        f"{GROUPS}/{name}",
        produce=lambda sink: write_parquet(
            sink,
            group_table,
            meta_schema,
            **group_file_settings(group_table.schema),
            compression=compression,
            compression_level=compression_level,
        ),
    )
    crash_point("compact:group-written")
    reward_names = sorted(
        {n for step in steps.values() for n in step.meta.get("reward_names") or []}
    )
    # Each unit's rows are those of the group file it was appended in: its IPC cache copy,
    # tied to that file's CRC-32, stays valid in the segment.
    unit_crc32 = {}
    for unit in units:
        source = steps[unit.step_file].meta
        unit_crc32[unit.name] = (source.get("unit_crc32") or {}).get(
            unit.name, source.get("group_crc32")
        )
    # The columns any input carried data in (unknown when an input did not record them).
    recorded = [steps[n].meta.get("columns") for n in inputs]
    columns = (
        None
        if any(c is None for c in recorded)
        else list(dict.fromkeys(c for names in recorded for c in names))
    )
    try:
        meta = group_file_meta(
            backend,
            group,
            group_rows=starts,
            replaces=replaces,
            reward_names=reward_names,
            unit_crc32=unit_crc32,
            **({} if columns is None else {"columns": columns}),
        )
        step_rows = _keep_nullability(pa.concat_tables(rows), step_schema)
        step = backend.write_temp(f"{STEPS}/{name}", step_file_bytes(step_rows, meta))
    except BaseException:
        backend.discard(group)
        raise
    crash_point("compact:step-written")
    try:
        with backend.lock():
            current = set(catalog.committed())
            gone = [n for n in inputs if n not in current]
            if gone:
                raise StoreError(f"compact: {gone[0]} was compacted by another writer meanwhile")
            backend.publish(group, exclusive=False)
            crash_point("compact:group-published")
            try:
                backend.publish(step, exclusive=True)
            except BaseException:
                with contextlib.suppress(OSError, StoreError):
                    backend.remove(f"{GROUPS}/{name}")
                raise
    finally:
        backend.discard(group)
        backend.discard(step)
    crash_point("compact:committed")
    # Committed: the inputs are hidden by `replaces`; removing them is only tidying.
    for replaced in inputs:
        backend.remove(f"{GROUPS}/{replaced}")
        crash_point("compact:cleaning")
        backend.remove(f"{STEPS}/{replaced}")
    with contextlib.suppress(OSError):
        backend.sync(GROUPS)
        backend.sync(STEPS)
    return backend.path(f"{STEPS}/{name}")


# ---------------------------------------------------------------------------- repair
@dataclass
class RepairReport:
    """What :meth:`RolloutStore.repair` did: each file moved to ``quarantine/`` and why,
    and what it left alone (temp files of writers still running)."""

    moved: list[StoreProblem] = field(default_factory=list)
    kept: list[StoreProblem] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.moved)} files moved to quarantine/"]
        lines += [f"  moved {p}" for p in self.moved]
        lines += [f"  kept {p}" for p in self.kept]
        return "\n".join(lines)


def repair(catalog: Catalog) -> RepairReport:
    """Move leftovers of crashed writes into ``quarantine/`` (never delete): temp files of
    writers that are gone, group files no step file commits, and files a committed compaction
    replaced. Runs under the store lock, so no commit is in flight."""
    backend = catalog.backend
    _local_only(backend, "repair")
    report = RepairReport()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    with backend.lock():
        names = catalog.step_names()
        replaced = catalog.hidden(names, "skip")
        committed = {n for n in names if n not in replaced}

        def move(directory: str, name: str, why: str) -> None:
            dest = f"{QUARANTINE}/{stamp}/{directory}/{name.lstrip('.')}"
            backend.move(f"{directory}/{name}", dest)
            report.moved.append(StoreProblem(backend.path(f"{directory}/{name}"), why))

        for directory in (GROUPS, STEPS, CACHE):
            for name, info in backend.list(directory).items():
                if is_temp_name(name):
                    if writer_alive(name, info.mtime_ns):
                        report.kept.append(
                            StoreProblem(
                                backend.path(f"{directory}/{name}"), "temp file of a running writer"
                            )
                        )
                    else:
                        move(directory, name, "temp file of a writer that is gone")
                elif name in replaced and directory != CACHE:
                    move(directory, name, "replaced by a committed compaction")
                elif directory == GROUPS and parse_name(name) is not None and name not in committed:
                    move(directory, name, "group file no step file commits (a crashed append)")
        for directory in (GROUPS, STEPS):
            with contextlib.suppress(OSError):
                backend.sync(directory)
    return report
