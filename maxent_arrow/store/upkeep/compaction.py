"""``compact``: merge committed files into segments, each committed atomically.

A segment's group file and step file are written and committed by the one commit function
(:func:`~maxent_arrow.store.io.commit.commit_unit`), its step file listing every file it replaces
(and what they replaced): readers see the inputs or the segment, never both and never neither, also
after a crash at any point. The inputs leave ``groups/`` and ``steps/`` after the commit. Compaction
rewrites other writers' files, so it needs a backend that can lock and rename atomically
(local stores). Its inputs are not deleted but moved to ``retired/`` and removed by a later
compaction after :data:`RETIRE_SECONDS`, so that readers that listed the store before it
keep reading them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

import pyarrow as pa

from maxent_arrow.arguments import check_optional_int
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import EVERYTHING, Catalog, Selection, Unit, is_missing
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import CompactUnits, DropUnits, RetireFiles
from maxent_arrow.store.history.schemas import UnifiedSchemas
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.io.commit import CommitRequest, UnitFiles, WriteSettings, commit_unit
from maxent_arrow.store.io.reader import read_group_file
from maxent_arrow.store.io.take import write_segment_take
from maxent_arrow.store.storage.backend import Backend
from maxent_arrow.store.storage.crashpoints import crash_point
from maxent_arrow.store.storage.names import (
    GROUPS,
    RETIRED,
    STEPS,
    UnitName,
    compact_name,
    parse_name,
    retired_path,
    take_name,
)

__all__ = ["RETIRE_SECONDS", "Compaction", "compact", "expire_retired", "retire"]


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What a compaction merges: at most ``max_steps`` distinct steps per segment (``None``:
    all the chosen steps of a kind and attempt in one); ``loose_only``: one-step files only
    (segments stay as they are: the writer's policy never rewrites data twice);
    ``drop_superseded``: first retire the units later attempts superseded."""

    max_steps: int | None = None
    loose_only: bool = False
    drop_superseded: bool = False

    def __post_init__(self) -> None:
        check_optional_int(self.max_steps, "compact: max_steps", low=1)


@dataclasses.dataclass(frozen=True)
class _Job:
    """One compaction's store: its catalog, log, schemas and write settings."""

    catalog: Catalog
    log: CommitLog
    schemas: UnifiedSchemas
    settings: WriteSettings


def compact(
    catalog: Catalog,
    schemas: UnifiedSchemas,
    selection: Selection = EVERYTHING,
    policy: Compaction = Compaction(),
    settings: WriteSettings = WriteSettings(),
    progress: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Merge the committed files of ``selection`` (its kind, steps and ranks) into segments
    as ``policy`` says, each committed atomically: readers see the inputs or the segment,
    never both and never neither, also after a crash at any point. ``progress(done,
    total)`` is told of the files considered (``total``: those of the chosen units) as each
    segment is committed. Returns the new step files. Compacts on any backend whose log
    entries are created exclusively (S3 too: its files are never renamed in place)."""
    backend = catalog.backend
    log = catalog.writable("compact")
    backend.require("exclusive_create", "compact")
    job = _Job(catalog, log, schemas, settings)
    made = []
    if policy.drop_superseded:
        made += _drop_superseded(job, selection.kind)
    # Every attempt's units (a superseded one is still kept, until it is retired), each
    # merged only with its own attempt's: a segment belongs to the attempt that wrote it.
    catalog = catalog.with_history("all")
    units = catalog.units(dataclasses.replace(selection, on_error="raise"))
    max_steps, loose_only = policy.max_steps, policy.loose_only
    if loose_only:
        # A unit's step file is a committed store file name, so it parses.
        units = [u for u in units if not cast(UnitName, parse_name(u.step_file)).compacted]
    by_kind: dict[tuple[str, str], list[Unit]] = {}
    for unit in units:
        by_kind.setdefault((unit.kind, catalog.attempt_of(unit.step_file)), []).append(unit)
    total, done = len({u.step_file for u in units}), 0
    if progress is not None:
        progress(0, total)
    for (knd, _), members in sorted(by_kind.items()):
        distinct = sorted({u.step for u in members})
        size = max_steps or len(distinct)
        for at in range(0, len(distinct), size):
            chosen = set(distinct[at : at + size])
            chunk = [u for u in members if u.step in chosen]
            files = sorted({u.step_file for u in chunk})
            # Whole files only: a segment that holds steps outside this chunk stays as it is.
            whole = [f for f in files if {u.step for u in units if u.step_file == f} <= chosen]
            chunk = [u for u in chunk if u.step_file in whole]
            done += len(files)
            if len(whole) < 2:
                continue  # one file is already as compact as it gets
            made.append(_compact_files(dataclasses.replace(job, catalog=catalog), knd, chunk))
            if progress is not None:
                progress(min(done, total), total)
    if not made:  # each merge tidies retired/; without one, do it here
        _expire(log)
    if made:
        # The files a plain reader's checkpoint lists just moved to retired/: a new one.
        with contextlib.suppress(OSError, StoreError):
            log.write_checkpoint()
    if progress is not None:
        progress(total, total)
    return made


def _drop_superseded(job: _Job, kind: str | None) -> list[Any]:
    """Retire what later attempts superseded: the files whose every unit is superseded leave
    the history in one ``drop`` entry (then ``retired/``, like a compaction's inputs); a
    segment superseded in part is rewritten with its effective units only. Returns the new
    step files."""
    catalog, log = job.catalog, job.log
    state = log.state().copy()  # the log's own state object moves on at each commit
    doomed, partial = [], []
    for rel, entry in sorted(state.units.items()):
        rows = entry.record.get("rows") or {}
        if kind is not None and kind not in rows.get("kind", ()):
            continue
        effective = state.effective_units(entry)
        if not any(effective):
            doomed.append(rel)
        elif not all(effective):
            partial.append(rel.rpartition("/")[2])

    def still_committed(now: LogState) -> None:
        gone = [rel for rel in doomed if rel not in now.units]
        if gone:
            raise StoreError(f"compact: {gone[0]} was retired by another writer meanwhile")

    backend = catalog.backend
    if doomed:
        log.commit(
            DropUnits(tuple(doomed), "superseded"),
            check=still_committed,
            lock_timeout=job.settings.lock_timeout,
        )
        for rel in doomed:
            group = state.units[rel].record["group_file"]
            retire(backend, f"{GROUPS}/{group}")
            crash_point("drop:cleaning")
            retire(backend, rel)
    made = []
    effective = catalog.with_history("effective")
    for name in partial:
        units = [u for u in effective.units() if u.step_file == name]
        only = dataclasses.replace(job, catalog=effective)
        made.append(_compact_files(only, units[0].kind, units))
    return made


def _expire(log: CommitLog) -> None:
    """Remove retired files past the grace period; the commit log records that they are gone."""
    gone = expire_retired(log.backend, RETIRE_SECONDS)
    if gone:
        log.commit(RetireFiles(tuple(rel.removeprefix(f"{RETIRED}/") for rel in gone)))


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


def _compact_files(job: _Job, kind: str, units: list[Unit]) -> Any:
    """Merge ``units`` (of ``kind``, one attempt's) into one segment, committed in place of
    the files that held them; the inputs then move to ``retired/``."""
    catalog, log, schemas = job.catalog, job.log, job.schemas
    backend = catalog.backend
    group_schema = schemas.get(GROUPS, "raise")
    step_schema = schemas.get(STEPS, "raise")
    inputs = sorted({u.step_file for u in units})
    steps = {name: catalog.step_file(name) for name in inputs}
    groups, rows, starts, at = [], [], [], 0
    tables = {name: read_group_file(backend, step, None, crc=True) for name, step in steps.items()}
    for unit in units:
        table = tables[unit.step_file].slice(unit.start, unit.num_groups)
        groups.append(S.conform(table, group_schema))
        rows.append(S.conform(steps[unit.step_file].table.slice(unit.row, 1), step_schema))
        starts.append(at)
        at += unit.num_groups
    replaces = sorted({*inputs, *(r for step in steps.values() for r in step.replaces)})
    name = compact_name(
        kind,
        (min(u.step for u in units), max(u.step for u in units)),
        (min(u.rank for u in units), max(u.rank for u in units)),
        [(n, steps[n].meta.get("group_crc32")) for n in inputs],
    )
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
        else list(dict.fromkeys(c for names in cast(list[list[str]], recorded) for c in names))
    )

    def inputs_still_committed(state: LogState) -> None:
        current = {rel.rpartition("/")[2] for rel in state.units}
        gone = [n for n in inputs if n not in current]
        if gone:
            raise StoreError(f"compact: {gone[0]} was compacted by another writer meanwhile")

    unit = UnitFiles(
        name,
        _keep_nullability(pa.concat_tables(groups), group_schema),
        {S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
        _keep_nullability(pa.concat_tables(rows), step_schema),
        {
            "group_rows": starts,
            "replaces": replaces,
            "reward_names": reward_names,
            "unit_crc32": unit_crc32,
            **({} if columns is None else {"columns": columns}),
        },
        row_groups=_row_groups([u.num_groups for u in units]),
    )
    request = CommitRequest(
        CompactUnits,
        catalog.attempt_of(inputs[0]),
        inputs_still_committed,
        job.settings,
        replaces=tuple(inputs),
    )
    committed = commit_unit(log, unit, request)
    name = committed.name
    _write_segment_take(backend, committed, unit.groups, units, inputs)
    # Committed: the inputs are hidden by `replaces`. They leave groups/ and steps/ (plain
    # readers glob those) for retired/, where readers that listed the store before this
    # commit still find them, until RETIRE_SECONDS have passed.
    for replaced in inputs:
        retire(backend, f"{GROUPS}/{replaced}")
        crash_point("compact:cleaning")
        retire(backend, f"{STEPS}/{replaced}")
    with contextlib.suppress(OSError):
        backend.sync(GROUPS)
        backend.sync(STEPS)
    _expire(log)
    return backend.path(f"{STEPS}/{name}")


def _write_segment_take(
    backend: Backend, committed: Any, groups: pa.Table, units: list[Unit], inputs: list[str]
) -> None:
    """The committed segment's take file (:mod:`~maxent_arrow.store.io.take`), when its
    inputs had take files (the store writes them): one for all its units, so a sampler opens
    a file per segment. Derived data: a failure is a warning, the archive serves."""
    names = [take_name(u.name) for u in units] + [take_name(n) for n in inputs]
    if not any(backend.stat(rel) is not None for rel in names):
        return
    try:
        write_segment_take(
            backend,
            groups,
            committed.name,
            committed.group.crc,
            [(u.name, u.num_groups) for u in units],
        )
    except (OSError, StoreError, pa.ArrowException) as exc:
        warnings.warn(
            f"segment {committed.name} is committed but its take file failed: {exc}", stacklevel=4
        )


# A segment keeps one row group per unit (a reader of one step decodes and checks only its
# rows), a unit of more groups than this split into row groups of at most this many.
ROW_GROUP_GROUPS = 4096


def _row_groups(counts: list[int]) -> list[int]:
    """The row counts of a segment's row groups: one per unit of ``counts`` groups."""
    out = []
    for count in counts:
        while count > ROW_GROUP_GROUPS:
            out.append(ROW_GROUP_GROUPS)
            count -= ROW_GROUP_GROUPS
        out.append(count)
    return out


# How long a compaction's inputs stay in retired/ for the readers that listed the store
# before it (docs/commit-protocol.md, "Readers and compaction").
RETIRE_SECONDS = 3600.0


def retire(backend: Backend, rel: str) -> None:
    """Move the replaced file ``rel`` to ``retired/``, dated now (its modification time)."""
    try:
        backend.touch(rel)
        backend.move(rel, retired_path(rel))
    except FileNotFoundError:
        pass  # retired already (a compaction that crashed while tidying, run again)
    except StoreError as exc:
        if not is_missing(exc):
            raise


def expire_retired(backend: Backend, grace: float) -> list[str]:
    """Remove retired files older than ``grace`` seconds; returns their relative paths. No
    reader that started more than ``grace`` seconds ago needs them any longer: replay
    re-plans a unit whose files are gone from the commit record, SQL views are refreshed."""
    limit = time.time_ns() - int(grace * 1e9)
    gone = []
    for directory in (GROUPS, STEPS):
        where = retired_path(directory)
        for name, info in backend.list(where).items():
            if info.mtime_ns < limit:
                backend.remove(f"{where}/{name}")
                gone.append(f"{where}/{name}")
    return gone
