"""``compact``: merge committed files into segments, each committed atomically.

A segment's group file and step file are written and committed by the one commit function
(:func:`.commit.commit_unit`), its step file listing every file it replaces (and what they
replaced): readers see the inputs or the segment, never both and never neither, also after a
crash at any point. The inputs leave ``groups/`` and ``steps/`` after the commit. Compaction
rewrites other writers' files, so it needs a backend that can lock and rename atomically
(local stores). Its inputs are not deleted but moved to ``retired/`` and removed by a later
compaction after :data:`RETIRE_SECONDS`, so that readers that listed the store before it
keep reading them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import pyarrow as pa

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store.backend import Backend, crash_point
from maxent_arrow.store.catalog import Catalog, Unit, is_missing
from maxent_arrow.store.commit import commit_unit
from maxent_arrow.store.names import (
    GROUPS,
    STEPS,
    UnitName,
    compact_name,
    parse_name,
    retired_path,
)
from maxent_arrow.store.reader import read_group_file
from maxent_arrow.store.schemas import UnifiedSchemas

__all__ = ["RETIRE_SECONDS", "compact", "expire_retired", "retire"]


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
    lock_timeout: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Merge committed files (per kind; ``max_steps`` distinct steps per segment) into
    segments, each committed atomically: readers see the inputs or the segment, never both
    and never neither, also after a crash at any point. ``loose_only`` merges one-step files
    only (segments stay as they are: the writer's policy never rewrites data twice).
    ``progress(done, total)`` is told of the files considered (``total``: those of the chosen
    units) as each segment is committed. Returns the new step files."""
    backend = catalog.backend
    backend.require("can_rewrite", "compact")
    if max_steps is not None and (
        isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
    ):
        raise ArgumentError(f"compact: max_steps must be None or an int >= 1, got {max_steps!r}")
    units = catalog.units(kind=kind, steps=steps, ranks=ranks)
    if loose_only:
        # A unit's step file is a committed store file name, so it parses.
        units = [u for u in units if not cast(UnitName, parse_name(u.step_file)).compacted]
    by_kind: dict[str, list[Unit]] = {}
    for unit in units:
        by_kind.setdefault(unit.kind, []).append(unit)
    made = []
    total, done = len({u.step_file for u in units}), 0
    if progress is not None:
        progress(0, total)
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
            done += len(files)
            if len(whole) < 2:
                continue  # one file is already as compact as it gets
            made.append(
                _compact_files(
                    catalog, schemas, knd, chunk, compression, compression_level, lock_timeout
                )
            )
            if progress is not None:
                progress(min(done, total), total)
    if not made:  # each merge tidies retired/; without one, do it here
        expire_retired(backend, RETIRE_SECONDS)
    if progress is not None:
        progress(total, total)
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
    lock_timeout: float | None,
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

    def inputs_still_committed() -> None:
        current = set(catalog.committed())
        gone = [n for n in inputs if n not in current]
        if gone:
            raise StoreError(f"compact: {gone[0]} was compacted by another writer meanwhile")

    commit_unit(
        backend,
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
        check=inputs_still_committed,
        operation="compact",
        compression=compression,
        compression_level=compression_level,
        run=catalog.run_id,
        lock_timeout=lock_timeout,
    )
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
    expire_retired(backend, RETIRE_SECONDS)
    return backend.path(f"{STEPS}/{name}")


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
