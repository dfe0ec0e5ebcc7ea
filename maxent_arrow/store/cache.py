"""The IPC cache: an uncompressed Arrow IPC copy of a committed unit, memory-mapped for
zero-copy replay (local stores only).

A cache file is derived data: it is written after the commit, never counts as one, and is
served only if it is the copy of the committed group file it claims to be (its record names
the unit and the group file's CRC-32) and, when checked, if the bytes served match the
checksums written into it. A file in ``cache/`` without that record and those checksums is
never served. ``verify`` checks every cache file in full.

**Checked per column, as read.** A copy written by this version carries, in its footer, the
XXH3-64 of each column's buffers and of its *frame* (every byte that is not a column buffer:
the schema, the batch's buffer layout, the footer). A checked read reads the frame and the
columns it serves (``columns``) into memory, at their offsets, and checks those, nothing
else: a replay of three token columns pays for those three (a copy and a hash at memory
speed, ~30 GB/s for XXH3), the other columns' bytes are never read. Damage in a column
served, or in the frame, is a :class:`StoreError` naming the column; damage in a column not
read is found by the read that reads it and by ``verify``. The bytes served are the bytes
checked, in memory of their own, so a program that truncates or rewrites the file while a
batch is in use cannot touch them, nor end the process with SIGBUS (the memory of a copy is
reused by the next read once every view of it is gone). Unchecked, the copy is
memory-mapped (zero-copy, pages read as used; a file truncated under the mapping then ends
the reader with SIGBUS). Copies written before (one CRC-32 sealed over the whole file) are
read whole and checked whole, as before.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_groups
from maxent_arrow.errors import StoreError
from maxent_arrow.rollout import STEP_META_KEY, RolloutBatch, step_row_to_json
from maxent_arrow.store.backend import Backend
from maxent_arrow.store.catalog import StepFile
from maxent_arrow.store.checksums import SEAL_KEY, check_seal, xxh3_of
from maxent_arrow.store.names import CACHE, cache_name

__all__ = [
    "CACHE_META_KEY",
    "check_cache_columns",
    "read_cache",
    "unit_group_crc32",
    "write_cache",
]

# JSON in a cache file's schema metadata: the unit and the CRC of the group file it copies.
CACHE_META_KEY = b"maxent_arrow.cache"
# The XXH3-64 of the frame and of each column, as hex, patched into the footer's copy of the
# schema metadata after the file is written (a placeholder of the same length first).
CHECKSUMS_KEY = b"maxent_arrow.cache_xxh3"
_MARK = b"maxent-xxh3="
_DIGITS = 16  # hex digits of one checksum


def unit_group_crc32(step: StepFile, unit: str) -> int | None:
    """The CRC-32 of the group file ``unit`` was appended in: what its cache copy is tied to
    (a compacted segment records it per unit, so copies stay valid through compaction)."""
    return (step.meta.get("unit_crc32") or {}).get(unit, step.meta.get("group_crc32"))


def write_cache(
    backend: Backend, batch: RolloutBatch, unit: str, group_crc32: int | None = None
) -> None:
    """Write the IPC cache copy of a committed unit (uncompressed: memory-mappable), with
    the XXH3-64 of its frame and of each column."""
    meta = dict(batch.groups.schema.metadata or {})
    meta[STEP_META_KEY] = step_row_to_json(batch.step_row).encode()
    meta[CACHE_META_KEY] = json.dumps({"unit": unit, "group_crc32": group_crc32}).encode()
    meta.pop(SEAL_KEY, None)
    width = _DIGITS * (1 + batch.groups.num_columns)
    meta[CHECKSUMS_KEY] = _MARK + b"0" * width
    groups = batch.groups.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, groups.schema) as writer:
        writer.write_batch(groups)
    data = bytearray(sink.getvalue().to_pybytes())
    view = memoryview(data)
    written = ipc.open_file(pa.py_buffer(data)).get_batch(0)
    layout = _layout(written, pa.py_buffer(data).address)
    hole = _hole(view, width)
    sums = [_frame_hash(view, layout, hole)]
    sums += [_column_hash(written.column(i)) for i in range(written.num_columns)]
    data[hole[0] : hole[0] + width] = "".join(f"{c:016x}" for c in sums).encode()
    backend.makedirs(CACHE)
    backend.write_file(f"{CACHE}/{cache_name(unit)}", bytes(data))


def _buffers(array: Any) -> list[Any]:
    return [b for b in array.buffers() if b is not None]


def _column_hash(array: Any) -> int:
    """XXH3-64 of a column's buffers (its children's too), in order."""
    return xxh3_of(_buffers(array))


def _layout(batch: pa.RecordBatch, base: int) -> list[tuple[int, int]]:
    """The file ranges (offset, length) of every buffer of ``batch`` (zero-copy from the file
    at address ``base``), sorted."""
    ranges = []
    for column in batch.columns:
        for buffer in _buffers(column):
            if buffer.size:
                ranges.append((buffer.address - base, buffer.size))
    return sorted(ranges)


def _hole(view: memoryview, width: int) -> tuple[int, int]:
    """Where the checksums' hex digits lie (the footer's copy, the last in the file)."""
    at = bytes(view[max(0, len(view) - (1 << 16)) :]).rfind(_MARK)
    if at < 0:
        at = bytes(view).rfind(_MARK)
        if at < 0:
            raise StoreError("IPC cache file: its checksums are missing from the footer")
    else:
        at += max(0, len(view) - (1 << 16))
    return at + len(_MARK), width


def _frame_hash(view: memoryview, layout: list[tuple[int, int]], hole: tuple[int, int]) -> int:
    """XXH3-64 of every byte outside the buffers of ``layout``, the checksums' digits read as
    ``0``."""
    at = 0
    pieces = []
    for offset, length in layout:
        if offset < at or offset + length > len(view):
            raise StoreError("IPC cache file: overlapping or out-of-file buffers (corrupt)")
        pieces.append((at, offset))
        at = offset + length
    pieces.append((at, len(view)))
    h0, h1 = hole[0], hole[0] + hole[1]
    parts: list[Any] = []
    for lo, hi in pieces:
        if lo < h1 and h0 < hi:
            a, b = max(lo, h0), min(hi, h1)
            parts += [view[lo:a], b"0" * (b - a), view[b:hi]]
        else:
            parts.append(view[lo:hi])
    return xxh3_of(parts)


def check_cache_columns(
    path: Any, data: Any, batch: pa.RecordBatch, columns: Iterable[str] | None
) -> bool | None:
    """Check the frame and ``columns`` (``None``: all) of the cache file ``data`` (its
    bytes, mapped or read; ``batch`` read zero-copy from them) against the XXH3-64s in its
    footer (XXH3-64). ``None``: the file carries none (an older copy: sealed whole). Damage is a
    :class:`StoreError` naming the file and the column."""
    recorded = (batch.schema.metadata or {}).get(CHECKSUMS_KEY)
    if recorded is None:
        return None
    view = memoryview(data).cast("B")
    width = _DIGITS * (1 + batch.num_columns)
    digits = recorded[len(_MARK) :] if recorded.startswith(_MARK) else b""
    try:
        expected = [int(digits[i : i + _DIGITS], 16) for i in range(0, width, _DIGITS)]
    except ValueError:
        expected = []
    if len(digits) != width or len(expected) != 1 + batch.num_columns:
        raise StoreError(f"{path}: IPC cache checksums damaged (corrupt)")
    base = pa.py_buffer(data).address if not isinstance(data, pa.Buffer) else data.address
    frame = _frame_hash(view, _layout(batch, base), _hole(view, width))
    if frame != expected[0]:
        raise StoreError(
            f"{path}: IPC cache frame (schema, layout, footer): XXH3-64 {frame:016x}, "
            f"expected {expected[0]:016x} (corrupt)"
        )
    names = batch.schema.names
    indices = [
        names.index(n) for n in dict.fromkeys(names if columns is None else columns) if n in names
    ]
    hashes = [_column_hash(batch.column(i)) for i in indices]
    for index, got in zip(indices, hashes):
        name = names[index]
        if got != expected[1 + index]:
            raise StoreError(
                f"{path}: IPC cache column {name!r}: XXH3-64 {got:016x}, expected "
                f"{expected[1 + index]:016x} (corrupt)"
            )
    return True


def _read_served(path: str, wanted: list[str] | None) -> tuple[pa.Buffer, pa.RecordBatch] | None:
    """A private copy of what a read of ``wanted`` (``None``: every column) serves: the
    frame and those columns' buffers, read into memory at their offsets (the other columns'
    bytes are never read: their pages stay unallocated), and the batch over it. ``None``: a
    copy without per-column checksums (sealed whole). The layout is taken from a memory map
    of the file (its metadata pages only); the bytes served are read, so a program that
    truncates the file afterwards cannot touch them (a file cut short while read is a
    :class:`StoreError`)."""
    mapped = pa.memory_map(path, "r").read_buffer()
    full = ipc.open_file(mapped).get_batch(0)
    if CHECKSUMS_KEY not in (full.schema.metadata or {}):
        return None
    names = full.schema.names
    keep = set(names if wanted is None else wanted)
    skip = sorted(
        (buffer.address - mapped.address, buffer.size)
        for name, column in zip(names, full.columns)
        if name not in keep
        for buffer in _buffers(column)
        if buffer.size
    )
    size = mapped.size
    del full, mapped
    array = _take(size)
    data = array[:size]
    pieces, at = [], 0
    for offset, length in skip:
        if offset > at:
            pieces.append((at, offset))
        at = max(at, offset + length)
    pieces.append((at, size))
    fd = os.open(path, os.O_RDONLY)
    try:
        for lo, hi in pieces:
            view = memoryview(data.data)[lo:hi]
            while len(view):
                n = os.preadv(fd, [view], lo + (hi - lo - len(view)))
                if not n:
                    raise StoreError(f"{path}: IPC cache file cut short while read (truncated)")
                view = view[n:]
    finally:
        os.close(fd)
    # The memory goes back to the pool when Arrow frees the last view of it.
    buffer = pa.foreign_buffer(data.ctypes.data, size, base=_Lease(array))
    return buffer, ipc.open_file(buffer).get_batch(0)


# Memory for the copies served: the last one freed is kept and reused by the next read, so a
# replay that drops each step before the next (as replay does) writes into memory that is
# already mapped (no page faults: a read costs a copy at memory speed). At most one idle
# buffer, the largest.
_SPARE: list[np.ndarray] = []
_SPARE_LOCK = threading.Lock()


def _take(size: int) -> np.ndarray:
    with _SPARE_LOCK:
        if _SPARE and _SPARE[0].size >= size:
            return _SPARE.pop()
    return np.empty(size, np.uint8)  # pages never written are never allocated


class _Lease:
    """The owner of a served copy's memory: Arrow holds it while any view is alive."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __del__(self) -> None:
        try:
            with _SPARE_LOCK:
                if not _SPARE or _SPARE[0].size < self.array.size:
                    _SPARE[:] = [self.array]
        except Exception:  # interpreter shutdown
            pass


def _open(
    path: str, wanted: list[str] | None, *, check: bool, private: bool
) -> pa.RecordBatch | None:
    """The batch of the cache file ``path`` (:func:`read_cache`), checked when asked;
    ``None``: a checked read of a file that carries no checksums of this library."""
    if check and private:
        served = _read_served(path, wanted)
    else:
        mapped = pa.memory_map(path, "r").read_buffer()
        batch = ipc.open_file(mapped).get_batch(0)
        if not check:
            return batch
        served = (mapped, batch) if CHECKSUMS_KEY in (batch.schema.metadata or {}) else None
    if served is not None:
        check_cache_columns(path, served[0], served[1], wanted)
        return served[1]
    data = _read_whole(path)  # an older copy: one CRC-32 sealed over it
    sealed = check_seal(data, tail=1 << 16)
    if sealed is None:
        return None
    if not sealed:
        raise StoreError(f"{path}: IPC cache CRC-32 differs from the one sealed in it (corrupt)")
    return ipc.open_file(pa.py_buffer(data)).get_batch(0)


def _read_whole(path: str) -> bytearray:
    """All bytes of ``path``, read once into memory (a :class:`StoreError` if the file
    changes size meanwhile)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise StoreError(f"{path}: IPC cache file cut short while read (truncated)")
            got += n
    return data


def read_cache(
    backend: Backend,
    step: StepFile,
    unit: str,
    *,
    check: bool,
    columns: Iterable[str] | None = None,
    private: bool = True,
) -> pa.RecordBatch | None:
    """The cached group rows of ``unit`` (``columns`` of them, or all), or ``None`` when
    there is no cache copy of the committed rows: no file, or a file without the record
    (unit, CRC-32 of the committed group file) and checksums that this library writes into
    every copy.

    ``check``: the frame and the columns served are read into memory (only those bytes) and
    checked against their XXH3-64s, and the bytes served are the ones checked (module
    docstring); a copy written before per-column checksums is read whole and its sealed
    CRC-32 checked. Unchecked, the copy is memory-mapped (zero-copy, pages read as used).
    ``private=False`` checks the columns served in the mapping itself and serves the mapping
    (no copy: ~1.3x torch's memory-mapped load where the copy costs ~2x, but a file truncated
    by another program while a batch is in use then ends the process with SIGBUS, as it does
    torch's mapped tensors); not used by the readers of this version.
    """
    rel = f"{CACHE}/{cache_name(unit)}"
    if not backend.can_mmap or backend.stat(rel) is None:
        return None
    path = backend.path(rel)
    wanted = None if columns is None else list(dict.fromkeys(columns))
    try:
        batch = _open(str(path), wanted, check=check, private=private)
        if batch is None:
            return None  # not a copy this library wrote: never served
    except StoreError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:  # damaged bytes
        raise StoreError(f"{path}: unreadable IPC cache file ({exc})") from None
    try:
        recorded = json.loads((batch.schema.metadata or {}).get(CACHE_META_KEY, b"{}"))
    except ValueError:
        recorded = None
    expected = unit_group_crc32(step, unit)
    if (
        not isinstance(recorded, dict)
        or recorded.get("unit") != unit
        or expected is None
        or recorded.get("group_crc32") != expected
    ):
        return None  # no record, or a copy of another commit of this unit: not served
    version = (batch.schema.metadata or {}).get(S.METADATA_KEY)
    if needs_upgrade(version):
        table = upgrade_groups(pa.Table.from_batches([batch]), kind=unit.split(".")[2])
        batch = table.combine_chunks().to_batches()[0]
    if wanted is not None:
        batch = batch.select([c for c in wanted if c in batch.schema.names])
    return batch
