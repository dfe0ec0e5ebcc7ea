"""Reading group files, checked against what their step file recorded, and the unified table.

One checked reader for every path that decodes group rows (``read``, ``replay``, ``verify``,
the Ray reader, ``compact``): the file's size first; then the checksums of what is decoded:
the footer and the column chunks read (of the columns read, in the row groups read: a
compacted segment keeps one row group per unit, so one step of it is decoded and checked
alone), or, for files whose step file recorded no CRC32C chunk checksums and that are read
whole, the CRC-32 of the whole file. Damage is a :class:`StoreError` naming the file, the
row group's step and the column. Schema-1.x files come back in the current layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import lists as L
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import (
    GROUP_ID_INPUTS,
    OFFSET_BASIS,
    needs_upgrade,
    upgrade_groups,
)
from maxent_arrow.errors import ArgumentError, SchemaError, StoreError
from maxent_arrow.store.history.catalog import (
    Catalog,
    OnError,
    Selection,
    StepFile,
    fail,
    is_missing,
    locate,
)
from maxent_arrow.store.storage.backend import Backend, FileInfo, missing_error
from maxent_arrow.store.storage.caches import CACHES
from maxent_arrow.store.storage.checksums import (
    check_chunks,
    covered,
    crc32_of,
    in_background,
    row_groups_of,
)
from maxent_arrow.store.storage.names import GROUPS, parse_name

__all__ = [
    "GroupFileRead",
    "check_group_bytes",
    "check_group_size",
    "check_known_columns",
    "read_group_file",
    "read_table",
    "row_group_labels",
]


# Parsed footers of group files read here, by (committed path, the footer's recorded offset,
# length and CRC32C): a segment's footer is large (one entry per row group and column; ~0.5 MB
# for 100 steps) and parsing it costs more than decoding one step. Group files are never
# rewritten, and the footer's bytes are still checked against the CRC on every read: an entry
# is added only after a read whose checks passed, so it is the parse of the recorded bytes.
# (The process caches' ``footers``; and ``labels``: row_group_labels of the step files read,
# by name: labels for 100 units cost ~4 ms a read.)


def _kind_of(step: StepFile) -> str:
    parsed = parse_name(step.name)
    if parsed is not None:
        return parsed.kind
    kinds = step.table.column("kind").unique().to_pylist()
    return kinds[0] if kinds else "train"


def check_group_size(path: Any, step: StepFile, info: FileInfo | None) -> None:
    """The group file of ``step`` is there (``info``), of the size its step file recorded."""
    check_group_bytes(path, step.meta.get("group_size"), info)


def check_group_bytes(path: Any, expected: int | None, info: FileInfo | None) -> None:
    """A committed group file is there (``info``), of the size its commit recorded
    (``expected``; ``None``: not recorded)."""
    if info is None:
        raise missing_error(f"{path}: group file missing (its step file is committed)")
    if expected is not None and info.size != expected:
        raise StoreError(
            f"{path}: size {info.size} bytes, expected {expected} (truncated or changed)"
        )


def read_group_file(
    backend: Backend,
    step: StepFile,
    columns: Iterable[str] | None,
    *,
    crc: bool = True,
    rows: tuple[int, int] | None = None,
) -> pa.Table:
    """The group rows of ``step``'s group file (``columns`` of them, or all), checked; read
    from ``retired/`` when a compaction moved the file there after the caller listed the
    store. ``rows=(start, count)``: only those rows (of the file), decoding and checking
    only the row groups that hold them where the step file recorded row groups."""
    rel = f"{GROUPS}/{step.group_file}"
    found = locate(backend, rel)
    try:
        return _read_group_file(backend, step, columns, crc, rel, found, rows)
    except StoreError as exc:
        if not is_missing(exc):
            raise
        again = locate(backend, rel)  # moved between the stat and the read?
        if again is None or (found is not None and again[0] == found[0]):
            raise
        return _read_group_file(backend, step, columns, crc, rel, again, rows)


def row_group_labels(step: StepFile) -> list[str]:
    """What each row group of ``step``'s group file holds (``"step 12 rank 0 train"``,
    several units joined), for the errors that name a damaged row group."""
    counts = (step.meta.get("chunks") or {}).get("row_group_rows") or []
    starts = step.starts
    units = list(zip(starts, step.column("step"), step.column("rank"), step.column("kind")))
    labels, at = [], 0
    for n in counts:
        inside = [u for u in units if at <= u[0] < at + max(n, 1)]
        if not inside:  # a unit split into several row groups: the one it started in
            inside = [max((u for u in units if u[0] <= at), default=units[0])] if units else []
        labels.append("; ".join(f"step {s} rank {r} {k}" for _, s, r, k in inside))
        at += n
    return labels


def _read_group_file(
    backend: Backend,
    step: StepFile,
    columns: Iterable[str] | None,
    crc: bool,
    committed: str,
    found: tuple[str, FileInfo] | None,
    rows: tuple[int, int] | None,
) -> pa.Table:
    path = backend.path(committed)  # errors name the committed path
    rel, info = found if found is not None else (committed, None)
    check_group_size(path, step, info)
    upgrade = needs_upgrade(step.version)
    wanted = None if columns is None else list(dict.fromkeys(columns))
    # Parquet page CRCs are checked only where no CRC recorded at commit covers the bytes.
    pages = crc
    pending = None
    known = None  # the parsed footer's key in the footers cache
    chunks = step.meta.get("chunks")
    # The row groups to decode (None: all) and the file row the first of them starts at.
    groups, first = None, 0
    if rows is not None and chunks is not None and not upgrade:
        picked = row_groups_of(chunks, *rows)
        if picked and len(picked) < len(chunks["row_groups"]):
            groups = picked
            first = sum(chunks["row_group_rows"][: picked[0]])
    labels = None
    if chunks and len(chunks["row_groups"]) > 1:
        labels = CACHES.labels.get(step.name)  # a committed step file is never rewritten
        if labels is None:
            labels = row_group_labels(step)
            CACHES.labels.put(step.name, labels)
    try:
        source: Any
        paths = {path for rg in (chunks or {}).get("row_groups", []) for path in rg}
        # Partial: some chunk belongs to no wanted column (names may hold dots: chunk_of).
        want = None if wanted is None else set(wanted)
        partial = groups is not None or (
            want is not None and not all(covered(p, want) for p in paths)
        )
        # CRC32C chunk records check a whole read too (~5x faster than the file's CRC-32).
        by_chunks = chunks is not None and chunks.get("algorithm") == "crc32c"
        if crc and (partial or by_chunks) and chunks is not None and not upgrade:
            read_chunks: Callable[[list[tuple[int, int]]], list[Any]]
            if (
                backend.can_mmap
                or not partial
                or (2 * _chunk_bytes(chunks, want, groups) >= (info.size if info else 0))
            ):
                # The bytes checked are the bytes decoded: mapped (local: no copy, only the
                # pages of the chunks read are touched; group files are never rewritten), or
                # read once when most of the file is read.
                whole = _map(backend, rel)
                read_chunks = functools.partial(_slices, whole)
                source = pa.BufferReader(whole)
            else:
                # Only the chunks decoded, and the footer: no read of the rest of the file.
                read_chunks = functools.partial(backend.read_ranges, rel)
                source = backend.open(rel)
            # The pass runs beside the decode; nothing is returned before it has matched.
            pending = in_background(
                lambda: check_chunks(
                    str(path), chunks, read_chunks, wanted, row_groups=groups, labels=labels
                )
            )
            pages = False
        elif crc and step.meta.get("group_crc32") is not None:
            data = backend.read(rel)
            # The CRC pass runs beside the decode (both release the GIL); nothing decoded is
            # returned before it has matched.
            pending = in_background(lambda: _whole_crc(data, step, path))
            source, pages = pa.BufferReader(data), False
        else:
            source = backend.open(rel)
        footer = (chunks or {}).get("footer") if pending is not None else None
        known = None if footer is None else (str(path), tuple(footer))
        reader = pq.ParquetFile(
            source,
            page_checksum_verification=pages,
            metadata=None if known is None else CACHES.footers.get(known),
        )
        present = reader.schema_arrow.names
        if wanted is not None:
            # A 1.x file has `rewards`, not reward_names/reward_values; read what upgrades.
            if upgrade and {"reward_names", "reward_values"} & set(wanted):
                wanted = [*wanted, "rewards", *OFFSET_BASIS]
            if upgrade:
                wanted = [*wanted, *GROUP_ID_INPUTS, *OFFSET_BASIS]
            wanted = [c for c in dict.fromkeys(wanted) if c in present]
        if groups is None:
            table = reader.read(columns=wanted)
        else:
            table = reader.read_row_groups(groups, columns=wanted)
    except StoreError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        if pending is not None:
            pending()  # damage explains an unreadable file best
        raise StoreError(f"{path}: unreadable group file ({exc})") from None
    if pending is not None:
        pending()
        if known is not None and known not in CACHES.footers:
            CACHES.footers.put(known, reader.metadata)
    S.check_version((table.schema.metadata or {}).get(S.METADATA_KEY), where=str(path))
    if upgrade:
        table = upgrade_groups(table, kind=_kind_of(step))
        if columns is not None:
            table = table.select([c for c in dict.fromkeys(columns) if c in table.column_names])
    if rows is not None:
        start, count = rows[0] - first, rows[1]
        if start or count != table.num_rows:
            table = table.slice(start, count)
    return table


def _chunk_bytes(chunks: dict[str, Any], want: set[str] | None, groups: list[int] | None) -> int:
    """How many bytes the chunks of columns ``want`` in row groups ``groups`` hold."""
    row_groups = chunks["row_groups"]
    chosen = range(len(row_groups)) if groups is None else groups
    return sum(
        length
        for index in chosen
        for path, (_, length, _) in row_groups[index].items()
        if covered(path, want)
    )


def _map(backend: Backend, rel: str) -> pa.Buffer:
    """All bytes of ``rel``: a memory map where the backend has one, else read."""
    if not backend.can_mmap:
        return backend.read(rel)
    try:
        with pa.memory_map(str(backend.fs_path(rel)), "r") as mapped:
            return mapped.read_buffer()
    except (pa.ArrowException, OSError):
        return backend.read(rel)  # errors as the backend words them


def _slices(buffer: pa.Buffer, ranges: list[tuple[int, int]]) -> list[pa.Buffer]:
    """Zero-copy slices of ``buffer`` (cut short at its end, as a read of a file would be)."""
    return [buffer.slice(o, max(0, min(n, buffer.size - o))) for o, n in ranges]


def _whole_crc(data: Any, step: StepFile, path: Any) -> None:
    got = crc32_of(data)
    if got != step.meta["group_crc32"]:
        raise StoreError(
            f"{path}: CRC-32 {got:08x}, expected {step.meta['group_crc32']:08x} (corrupt)"
        )


class GroupFileRead:
    """One group file to read and the row ranges (one per unit) to take from it: what a
    reader in another process (a Ray task) needs, picklable."""

    def __init__(self, backend: Backend, step: StepFile, units: list[tuple[str, int, int]]):
        self.backend = backend
        self.step = step
        self.units = units  # (unit name, first row, rows)

    @property
    def path(self) -> str:
        return self.backend.fs_path(f"{GROUPS}/{self.step.group_file}")

    @property
    def size(self) -> int | None:
        return self.step.meta.get("group_size")

    @property
    def num_rows(self) -> int:
        return sum(count for _, _, count in self.units)

    def read(self, columns: Iterable[str] | None, *, crc: bool = True) -> pa.Table:
        """Every row of the file."""
        return read_group_file(self.backend, self.step, columns, crc=crc)

    def read_units(
        self, columns: Iterable[str] | None, *, crc: bool = True
    ) -> list[tuple[str, pa.Table]]:
        """Each unit's rows (``(unit name, rows)``), decoding and checking only the row
        groups that hold them."""
        if not self.units:
            return []
        lo = min(start for _, start, _ in self.units)
        hi = max(start + count for _, start, count in self.units)
        table = read_group_file(self.backend, self.step, columns, crc=crc, rows=(lo, hi - lo))
        return [(name, table.slice(start - lo, count)) for name, start, count in self.units]


def flat_columns(schema: pa.Schema) -> list[str]:
    """The columns a row filter may use: every column that is not a list or a struct."""
    return [f.name for f in schema if not (pa.types.is_list(f.type) or pa.types.is_struct(f.type))]


def check_known_columns(columns: Any, unified: pa.Schema, *, where: str) -> None:
    """``columns`` is ``None`` or a list of column names of ``unified``: a string, a
    non-string name or an unknown column is refused by name."""
    if columns is None:
        return
    if (
        isinstance(columns, str | bytes)
        or not isinstance(columns, list | tuple)
        or not all(isinstance(c, str) for c in columns)
    ):
        raise ArgumentError(f"{where}: columns must be a list of column names, got {columns!r}")
    unknown = [c for c in columns if c not in unified.names]
    if unknown:
        raise SchemaError(f"{where}: unknown column(s) {unknown}; the store has {unified.names}")


def read_table(
    catalog: Catalog, unified: pa.Schema, table: str, selection: Selection, *, crc: bool
) -> pa.Table:
    """Rows of ``table`` (``"groups"`` or ``"steps"``) of the committed units of
    ``selection``, as one table over ``unified``, the store's unified schema of that table."""
    columns, filter = selection.columns, selection.filter
    on_error: OnError = selection.on_error or "raise"
    check_known_columns(columns, unified, where=f"RolloutStore.read ({table})")
    wanted = unified.names if columns is None else list(columns)
    # A filter may use the flat columns, so read them too (token columns only when asked).
    needed = wanted if filter is None else list(dict.fromkeys(wanted + flat_columns(unified)))
    target = pa.schema([unified.field(n) for n in needed], metadata=unified.metadata)
    units = catalog.units(selection)
    by_file: dict[str, list] = {}
    for unit in units:
        by_file.setdefault(unit.step_file, []).append(unit)
    parts: list[pa.Table] = []
    for step_name, members in by_file.items():
        try:
            step = catalog.step_file(step_name)
            if table == "steps":
                data = step.table.take(L.int64_array([u.row for u in members]))
            else:
                lo = min(u.start for u in members)
                hi = max(u.start + u.num_groups for u in members)
                data = read_group_file(catalog.backend, step, needed, crc=crc, rows=(lo, hi - lo))
                keep = [i - lo for u in members for i in range(u.start, u.start + u.num_groups)]
                if len(keep) != data.num_rows:
                    data = data.take(L.int64_array(keep))
        except StoreError as exc:
            fail(on_error, exc)
            continue
        parts.append(S.conform(data, target))
    result = pa.concat_tables(parts) if parts else S.empty(target)
    if filter is not None:
        try:
            result = result.filter(filter).select(wanted)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ArgumentError(f"RolloutStore.read: filter {filter}: {exc}") from None
    return result.replace_schema_metadata(unified.metadata)
