"""``verify``: find damage in a store, reading only.

Every file is checked: the manifest; each step file (its seal, its name against its rows);
each committed group file (size, CRC-32 of the whole file and of every chunk, row count);
each IPC cache copy (seal, rows against the archive). Damage is a *problem*; harmless
leftovers of crashed writes (temp files, uncommitted or replaced files) are *notes*.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.registry import UNIT_KEY
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_groups
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import Catalog, StepFile
from maxent_arrow.store.history.manifest import read as read_manifest
from maxent_arrow.store.history.state import LogState, UnitEntry
from maxent_arrow.store.io.cache import CACHE_META_KEY, check_cache_columns, unit_group_crc32
from maxent_arrow.store.io.reader import read_group_file, row_group_labels
from maxent_arrow.store.io.take import TakeFile, current_take, segment_take, take_batches
from maxent_arrow.store.storage.backend import Backend
from maxent_arrow.store.storage.checksums import check_chunks, check_seal, crc32_of
from maxent_arrow.store.storage.names import (
    CACHE,
    GROUPS,
    LOG,
    MANIFEST,
    STEPS,
    UnitName,
    cache_name,
    parse_name,
    take_name,
    unit_name,
)

__all__ = ["StoreProblem", "VerifyReport", "describe_units", "verify"]


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


def verify(catalog: Catalog, *, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every file: the manifest; each committed step file (its size and CRC-32 as
    committed); each committed group file (size, CRC-32 of the whole file and of every
    chunk, rows); each cache copy; the record tables' files; and what the catalog finds of its
    own records and of the files it does not commit (:meth:`~maxent_arrow.store.history.
    catalog.Catalog.audit`: a lost log entry, a suspected lost commit are problems; leftovers
    of writes that did not finish are notes). A missing committed file is *lost*, named with
    its steps. One problem never stops the report. ``progress(done, total)`` is told of the
    committed step files (each with its group file) checked so far."""
    report = VerifyReport()
    backend = catalog.backend
    for rel, target in backend.escapes():
        report.problems.append(
            StoreProblem(
                backend.root / rel,
                f"a symbolic link to {target}, outside the store: never read or written",
            )
        )
    try:
        read_manifest(backend)
    except StoreError as exc:
        report.problems.append(StoreProblem(backend.root / MANIFEST, str(exc)))
    try:
        state = catalog.state()
    except StoreError as exc:
        report.problems.append(StoreProblem(backend.root / LOG, str(exc)))
        return report
    with catalog.snapshot():
        live = _verify_units(report, catalog, state, progress)
        _verify_records(report, backend, state)
        audit = catalog.audit(live)
    report.problems += [StoreProblem(backend.root / rel, why) for rel, why in audit.problems]
    report.notes += [StoreProblem(backend.root / rel, why) for rel, why in audit.notes]
    return report


def _verify_units(
    report: VerifyReport,
    catalog: Catalog,
    state: LogState,
    progress: Callable[[int, int], None] | None,
) -> set[str]:
    """Every committed unit's files, against its commit: a missing one is a *lost* commit,
    named with its steps. Returns the files that are live (committed, or retiring)."""
    backend = catalog.backend
    live = set(state.retiring)
    total = len(state.units)
    for done, (rel, entry) in enumerate(sorted(state.units.items())):
        if progress is not None:
            progress(done, total)
        name = rel.rpartition("/")[2]
        step = catalog.step_file(name)
        group_rel = f"{GROUPS}/{step.group_file}"
        live |= {rel, group_rel}
        what = f"{describe_units(entry.record)}, committed at log version {entry.version}"
        report.checked += 1
        try:
            _check_step_file(backend, entry, what)
        except StoreError as exc:
            report.problems.append(StoreProblem(backend.root / rel, str(exc)))
        try:
            present = backend.stat(group_rel) is not None
        except StoreError as exc:  # a path refused (a symlink out): reported, and on
            report.problems.append(StoreProblem(backend.root / group_rel, str(exc)))
            continue
        if not present:
            restorable = backend.can_mmap and all(
                backend.stat(f"{CACHE}/{cache_name(unit_name(s, r, k))}") is not None
                for s, r, k in _unit_keys(entry.record)
            )
            how = (
                "`repair` restores it from its IPC cache copies"
                if restorable
                else "no IPC cache copy to restore it from"
            )
            report.problems.append(
                StoreProblem(backend.root / group_rel, f"lost: the group file of {what}; {how}")
            )
            continue
        try:
            _verify_step(report, backend, step)
        except StoreError as exc:  # a path refused (a symlink out): reported, and on
            report.problems.append(StoreProblem(backend.root / rel, str(exc)))
    if progress is not None:
        progress(total, total)
    return live


def _verify_records(report: VerifyReport, backend: Backend, state: LogState) -> None:
    """Every committed file of a record table, against its size and CRC-32 in the log."""
    for name, items in sorted(state.records.items()):
        for item in items:
            rel = str(item["path"])
            report.checked += 1
            try:
                data = backend.read(rel)
            except StoreError:
                report.problems.append(
                    StoreProblem(backend.root / rel, f"lost: a committed file of records {name!r}")
                )
                continue
            if data.size != item["size"] or zlib.crc32(data) & 0xFFFFFFFF != item["crc32"]:
                report.problems.append(
                    StoreProblem(
                        backend.root / rel,
                        f"damaged: a file of records {name!r} (its size or CRC-32 is not the "
                        "log's)",
                    )
                )


def _unit_keys(record: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    rows = record.get("rows") or {}
    return list(zip(rows.get("step", ()), rows.get("rank", ()), rows.get("kind", ())))


def describe_units(record: Mapping[str, Any]) -> str:
    """The units a commit record holds, in words: ``step 3 (rank 0, train)``."""
    keys = _unit_keys(record)
    if len(keys) == 1:
        step, rank, kind = keys[0]
        return f"step {step} (rank {rank}, {kind})"
    steps = sorted({k[0] for k in keys})
    return f"steps {steps[0]}..{steps[-1]} ({len(keys)} units)"


def _check_step_file(backend: Backend, entry: UnitEntry, what: str) -> None:
    """A committed step file against its commit: present, of the recorded size and CRC-32."""
    info = backend.stat(entry.step_file)  # (a path refused: the caller reports it)
    if info is None:
        raise StoreError(
            f"lost: the step file of {what}; readers read its record from the log, "
            "`repair` rewrites it from there"
        )
    if entry.step_size is not None and info.size != entry.step_size:
        raise StoreError(f"{info.size} bytes, the commit log recorded {entry.step_size}")
    if entry.step_crc32 is not None:
        crc = zlib.crc32(backend.read(entry.step_file)) & 0xFFFFFFFF
        if crc != entry.step_crc32:
            raise StoreError("CRC-32 differs from the one the commit log recorded (corrupt)")


def _verify_step(report: VerifyReport, backend: Backend, step: StepFile) -> None:
    path = backend.path(f"{STEPS}/{step.name}")
    parsed = cast(UnitName, parse_name(step.name))  # a committed step file's name
    rows = {c: step.column(c) for c in (*UNIT_KEY, "num_groups")}
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
        chunks = step.meta.get("chunks")
        if chunks is not None:
            labels = row_group_labels(step) if len(chunks["row_groups"]) > 1 else None
            check_chunks(
                str(group_path),
                chunks,
                lambda r: backend.read_ranges(rel, r),
                None,
                labels=labels,
            )
        whole = step.meta.get("group_crc32")
        if chunks is not None and chunks.get("algorithm") is not None and whole is not None:
            # Readers checked the chunks (CRC32C); every byte of the file has its CRC-32.
            got = crc32_of(backend.read(rel))
            if got != whole:
                raise StoreError(f"{group_path}: CRC-32 {got:08x}, expected {whole:08x} (corrupt)")
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
    units = zip(rows["step"], rows["rank"], rows["kind"], rows["num_groups"], step.starts)
    for number, rank, kind, count, start in units:
        name = unit_name(number, rank, kind)
        _verify_take(report, backend, step, name, groups.slice(start, count))
        if backend.can_mmap:  # (no IPC cache on other backends)
            _verify_cache(report, backend, step, name, groups, start, count)
    if parsed.compacted:
        _verify_segment_take(report, backend, step, groups)


def _verify_take(
    report: VerifyReport, backend: Backend, step: StepFile, unit: str, archived: pa.Table
) -> None:
    """A unit's take file, if any: its frame and every group's XXH3-64, and its rows against
    the archive's (``archived``)."""
    find = lambda: current_take(backend, step, unit, fresh=True)  # noqa: E731
    _check_take(report, backend, take_name(unit), find, archived, "its unit")


def _verify_segment_take(
    report: VerifyReport, backend: Backend, step: StepFile, groups: pa.Table
) -> None:
    """A compacted segment's take file, if any (:func:`_verify_take`, over all its rows)."""
    find = lambda: segment_take(backend, step, fresh=True)  # noqa: E731
    _check_take(report, backend, take_name(step.name), find, groups, "its segment")


def _check_take(
    report: VerifyReport,
    backend: Backend,
    rel: str,
    find: Callable[[], TakeFile | None],
    archived: pa.Table,
    of: str,
) -> None:
    if not _present(backend, rel):
        return
    report.checked += 1
    try:
        take = find()
        if take is None:
            report.notes.append(
                StoreProblem(backend.path(rel), f"take file of another commit of {of} (not served)")
            )
            return
        batches = take_batches(backend, take)
        taken = pa.Table.from_batches(batches, schema=batches[0].schema) if batches else None
        if taken is None or taken.num_rows != archived.num_rows:
            rows = 0 if taken is None else taken.num_rows
            raise StoreError(f"take file of {rows} groups, the archive has {archived.num_rows}")
        _check_copy(taken, archived, "take file")
    except (StoreError, pa.ArrowException, OSError, ValueError) as exc:
        report.problems.append(StoreProblem(backend.path(rel), str(exc)))


def _present(backend: Backend, rel: str) -> bool:
    """Whether the derived file ``rel`` (a take file, a cache copy) is there to check; a
    symbolic link out of the store is not (reported as such: ``Backend.escapes``)."""
    try:
        return backend.stat(rel) is not None
    except StoreError:
        return False


def _check_copy(copy: pa.Table, archived: pa.Table, what: str) -> None:
    """A :class:`StoreError` naming the first column of ``copy`` (a derived file's rows)
    that is not the archive's."""
    for name in copy.column_names:
        if name not in archived.column_names or not _same_values(
            copy.column(name), archived.column(name)
        ):
            raise StoreError(f"{what} differs from the Parquet archive (column {name!r})")


def _same_values(a: pa.ChunkedArray | pa.Array, b: pa.ChunkedArray | pa.Array) -> bool:
    """``a`` and ``b`` hold the same values, a NaN equal to a NaN (Arrow's ``equals`` says
    a NaN differs from itself: a stored NaN reward would read as damage)."""
    if a.equals(b):
        return True
    if isinstance(a, pa.ChunkedArray):
        a = a.combine_chunks()
    if isinstance(b, pa.ChunkedArray):
        b = b.combine_chunks()
    if a.type != b.type or len(a) != len(b) or not a.is_null().equals(b.is_null()):
        return False
    kind = a.type
    if pa.types.is_floating(kind):
        nan = pc.is_nan(a)  # (null where ``a`` is: the nulls matched above)
        if not nan.equals(pc.is_nan(b)):
            return False
        keep = pc.invert(nan)  # (a filter drops the nulls; no Python value: that imports pandas)
        return pc.filter(a, keep).equals(pc.filter(b, keep))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return pc.list_value_length(a).equals(pc.list_value_length(b)) and _same_values(
            pc.list_flatten(a), pc.list_flatten(b)
        )
    if pa.types.is_struct(kind):
        return all(_same_values(a.field(i), b.field(i)) for i in range(kind.num_fields))
    return False


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
    if not _present(backend, cache):
        return
    report.checked += 1
    try:
        data = backend.read(cache)
        try:
            # A copy of this version: the CRC32C of its frame and of every column.
            batch = ipc.open_file(pa.BufferReader(data)).get_batch(0)
            sealed = check_cache_columns(backend.path(cache), data, batch, None)
        except StoreError:
            raise
        except (pa.ArrowException, OSError, ValueError):
            sealed = None  # unreadable as IPC: the seal's check below says why
        if sealed is None:  # an older copy: one CRC-32 sealed over the whole file
            sealed = check_seal(data.to_pybytes())
            if sealed is False:
                raise StoreError("IPC cache CRC-32 differs from the one sealed in it (corrupt)")
        cached = ipc.open_file(pa.BufferReader(data)).read_all()
        try:
            recorded = json.loads((cached.schema.metadata or {}).get(CACHE_META_KEY, b"{}"))
        except ValueError:
            recorded = None
        if sealed is None or not isinstance(recorded, dict) or recorded.get("unit") != unit:
            report.notes.append(
                StoreProblem(
                    backend.path(cache),
                    "not a cache copy written by this library (no seal or record); never served",
                )
            )
            return
        if recorded.get("group_crc32") != unit_group_crc32(step, unit):
            report.notes.append(
                StoreProblem(backend.path(cache), "copy of another commit of its unit (not served)")
            )
            return
        if needs_upgrade((cached.schema.metadata or {}).get(S.METADATA_KEY)):
            cached = upgrade_groups(cached, kind=unit.split(".")[2])
        archived = groups.slice(start, count)
        _check_copy(cached, archived, "IPC cache")
    except (StoreError, pa.ArrowException, OSError, ValueError) as exc:
        report.problems.append(StoreProblem(backend.path(cache), str(exc)))
