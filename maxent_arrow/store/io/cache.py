"""The IPC cache: an uncompressed Arrow IPC copy of a committed unit, memory-mapped for
zero-copy replay (local stores only).

A cache file is derived data: it is written after the commit, never counts as one, and is
served only if it is the copy of the committed group file it claims to be (its record names
the unit and the group file's CRC-32) and, when checked, if the bytes served match the
checksums written into it. A file in ``cache/`` without that record and those checksums is
never served. ``verify`` checks every cache file in full.

**Checked per column, as read.** A copy written by this version carries, in its footer, the
XXH3-64 of each column's buffers and of its *frame* (every byte that is not a column buffer:
the schema, the batch's buffer layout, the footer). A checked read reads the file's metadata
(its first and last bytes: the layout), then the frame and the columns it serves
(``columns``) into memory of its own, at their offsets, in pieces of :data:`READ_PIECE`
bytes, each fed to a streaming XXH3-64 right after it lands (while it is still in the CPU's
cache: the bytes come from memory once, copy and check in one pass), and checks those,
nothing else: a replay of three token columns pays for those three, the other columns'
bytes are never read. Damage in a column served, or in the frame, is a :class:`StoreError`
naming the file and the column; damage in a column not read is found by the read that reads
it and by ``verify``. The bytes served are the bytes checked, in memory of their own, so a
program that truncates or rewrites the file while a batch is in use cannot touch them, nor
end the process with SIGBUS (the memory of a copy is reused by the next read once every view
of it is gone). Unchecked, the copy is memory-mapped (zero-copy, pages read as used; a file
truncated under the mapping then ends the reader with SIGBUS). Copies written before (one
CRC-32 sealed over the whole file) are read whole and checked whole, as before.
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
from maxent_arrow.store.history.catalog import StepFile
from maxent_arrow.store.storage.backend import Backend
from maxent_arrow.store.storage.checksums import SEAL_KEY, check_seal, xxh3_of, xxh3_stream
from maxent_arrow.store.storage.names import CACHE, cache_name

__all__ = [
    "CACHE_META_KEY",
    "READ_PIECE",
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


def _expected(path: Any, recorded: bytes, columns: int) -> list[int]:
    """The XXH3-64s recorded in a cache file's footer (the frame's, then each column's)."""
    width = _DIGITS * (1 + columns)
    digits = recorded[len(_MARK) :] if recorded.startswith(_MARK) else b""
    try:
        expected = [int(digits[i : i + _DIGITS], 16) for i in range(0, width, _DIGITS)]
    except ValueError:
        expected = []
    if len(digits) != width or len(expected) != 1 + columns:
        raise StoreError(f"{path}: IPC cache checksums damaged (corrupt)")
    return expected


def _served(names: list[str], columns: Iterable[str] | None) -> list[int]:
    """The indices of the columns a read of ``columns`` (``None``: all) serves, in order."""
    return [
        names.index(n) for n in dict.fromkeys(names if columns is None else columns) if n in names
    ]


def _damaged_frame(path: Any, got: int, expected: int) -> StoreError:
    return StoreError(
        f"{path}: IPC cache frame (schema, layout, footer): XXH3-64 {got:016x}, "
        f"expected {expected:016x} (corrupt)"
    )


def _damaged_column(path: Any, name: str, got: int, expected: int) -> StoreError:
    return StoreError(
        f"{path}: IPC cache column {name!r}: XXH3-64 {got:016x}, expected {expected:016x} (corrupt)"
    )


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
    expected = _expected(path, recorded, batch.num_columns)
    width = _DIGITS * (1 + batch.num_columns)
    base = pa.py_buffer(data).address if not isinstance(data, pa.Buffer) else data.address
    frame = _frame_hash(view, _layout(batch, base), _hole(view, width))
    if frame != expected[0]:
        raise _damaged_frame(path, frame, expected[0])
    names = batch.schema.names
    for index in _served(names, columns):
        got = _column_hash(batch.column(index))
        if got != expected[1 + index]:
            raise _damaged_column(path, names[index], got, expected[1 + index])
    return True


# Pieces of a checked read: each is hashed right after it lands, while it is still in the
# CPU's cache, so the bytes come from memory once (copy and check in one pass).
READ_PIECE = 1 << 20
# What a byte range of a cache file is, beside a column's index: the frame, the checksums'
# digits in the footer (hashed as "0"s), or a column not served (never read).
_FRAME, _HOLE, _SKIP = -1, -2, -3


class _Plan:
    """The byte ranges of a cache file a checked read reads, in file order, and the XXH3-64
    each feeds: the frame's, or that of the column served it belongs to. A column whose
    buffers lie in the file in the order it is hashed in (every copy this library writes) is
    hashed as it is read; any other is hashed from the copy afterwards. ``body`` and
    ``footer``: where the batch's body and the footer begin (every buffer lies between);
    ``read``: the bytes before ``read[0]`` and from ``read[1]`` on are already read."""

    def __init__(
        self,
        path: str,
        size: int,
        layout: list[list[tuple[int, int]]],
        served: list[int],
        body: int,
        footer: int,
        read: tuple[int, int],
    ):
        keep = set(served)
        owners = sorted((offset, length, i) for i, ranges in enumerate(layout)
                        for offset, length in ranges)  # fmt: skip
        segments: list[tuple[int, int, int]] = []
        at = 0
        for offset, length, i in owners:
            if offset < max(at, body) or offset + length > footer:
                raise StoreError(
                    f"{path}: IPC cache file: overlapping or out-of-body buffers (corrupt)"
                )
            if offset > at:
                segments.append((at, offset, _FRAME))
            segments.append((offset, offset + length, i if i in keep else _SKIP))
            at = offset + length
        segments.append((at, size, _FRAME))  # the footer's in it: where the digits lie
        self.segments = segments
        runs: list[list[int]] = []
        for lo, hi, who in segments:
            lo, hi = max(lo, read[0]), min(hi, read[1])
            if who == _SKIP or lo >= hi:
                continue
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        self.runs = [(lo, hi) for lo, hi in runs]
        self.frame = xxh3_stream()
        self.columns = {i: xxh3_stream() for i in served if layout[i] == sorted(layout[i])}
        self._next = 0  # the next segment to feed
        self._fed = 0  # the file offset fed up to

    def hole(self, lo: int, width: int) -> None:
        """The checksums' hex digits lie at ``[lo, lo + width)``, in the last segment (the
        footer's copy of the schema metadata): hashed as "0"s."""
        *segments, (tail, end, who) = self.segments
        self.segments = [
            *segments,
            (tail, lo, who),
            (lo, lo + width, _HOLE),
            (lo + width, end, who),
        ]

    def feed(self, view: memoryview, upto: int) -> None:
        """Hash the bytes read, from where the last call stopped up to ``upto``."""
        segments, k, fed = self.segments, self._next, self._fed
        while k < len(segments):
            lo, hi, who = segments[k]
            stop = min(hi, upto)
            if stop > fed:
                if who == _FRAME:
                    self.frame.update(view[fed:stop])
                elif who == _HOLE:
                    self.frame.update(b"0" * (stop - fed))
                elif (hasher := self.columns.get(who)) is not None:
                    hasher.update(view[fed:stop])
                fed = stop
            if stop < hi:
                break
            k += 1
        self._next, self._fed = k, fed


def _fill(fd: int, path: str, view: memoryview, lo: int, hi: int) -> None:
    """Read the bytes ``[lo, hi)`` of the file ``fd`` into ``view`` at the same offsets."""
    part = view[lo:hi]
    while len(part):
        n = os.preadv(fd, [part], hi - len(part))
        if not n:
            raise StoreError(f"{path}: IPC cache file cut short while read (truncated)")
        part = part[n:]


def _int32(view: memoryview, at: int) -> int:
    return int.from_bytes(view[at : at + 4], "little", signed=True)


class _Metadata:
    """The metadata of an IPC cache file, read into ``view`` (the file's bytes at their
    offsets): its footer (the schema, and where the batch lies) and its first two messages
    (the schema, and the batch's buffer layout). The bytes before ``head`` and from ``tail``
    on are read; ``footer``: where the footer begins."""

    def __init__(self, fd: int, path: str, view: memoryview, size: int):
        self.fd, self.path, self.view, self.size = fd, path, view, size
        self.head, self.tail = 0, size
        self.read_head(min(size, _METADATA))
        self.read_tail(size - _METADATA)
        length = _int32(view, size - 10) if size >= 10 + 8 else -1
        self.footer = size - 10 - length
        if length < 0 or self.footer < 8 or bytes(view[size - 6 :]) != _MAGIC:
            raise StoreError(f"{path}: IPC cache file: no Arrow IPC footer (corrupt)")
        self.read_tail(self.footer)

    def read_head(self, hi: int) -> None:
        if hi > self.size:
            raise StoreError(f"{self.path}: IPC cache file: its messages overrun it (corrupt)")
        if hi > self.head:
            _fill(self.fd, self.path, self.view, self.head, min(hi, self.tail))
            self.head = hi

    def read_tail(self, lo: int) -> None:
        lo = max(lo, self.head)
        if lo < self.tail:
            _fill(self.fd, self.path, self.view, lo, self.tail)
            self.tail = lo

    def body(self) -> int:
        """Where the batch's body begins: after the magic, the schema message and the
        batch's message (each a continuation marker, a length and a flatbuffer; the schema
        has no body), read here."""
        at = 8  # the magic, padded
        for _ in range(2):
            self.read_head(at + 8)
            if _int32(self.view, at) != -1 or _int32(self.view, at + 4) < 0:
                raise StoreError(f"{self.path}: IPC cache file: not a message at {at} (corrupt)")
            at += 8 + _int32(self.view, at + 4)
            self.read_head(at)
        return at


# Bytes read first at each end of a cache file: its metadata (one read each, as a rule).
_METADATA = 1 << 16
_MAGIC = b"ARROW1"


def _read_checked(path: str, wanted: list[str] | None) -> pa.RecordBatch | None:
    """What a checked read of ``wanted`` (``None``: every column) serves: the frame and
    those columns' buffers, read into memory of the reader's own at their file offsets and
    checked against their XXH3-64s in the same pass (each piece hashed as it lands, while it
    is still in the CPU's cache), and the batch over that copy. ``None``: a copy without
    per-column checksums (sealed whole).

    The file's metadata (its first and last bytes) is read first and gives the layout; the
    other columns' bytes are never read (their pages stay unallocated). The bytes served are
    the bytes checked, so a program that truncates the file afterwards cannot touch them (a
    file cut short while read is a :class:`StoreError`). Damage is a :class:`StoreError`
    naming the file and the column, or the frame."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        array = _take(size)
        data = array[:size]
        view = memoryview(data.data)
        meta = _Metadata(fd, path, view, size)
        # The memory goes back to the pool when Arrow frees the last view of it.
        buffer = pa.foreign_buffer(data.ctypes.data, size, base=_Lease(array))
        reader = ipc.open_file(buffer)
        recorded = (reader.schema.metadata or {}).get(CHECKSUMS_KEY)
        if recorded is None:
            return None
        names = reader.schema.names
        expected = _expected(path, recorded, len(names))
        if reader.num_record_batches != 1 or any(
            pa.types.is_dictionary(f.type) for f in reader.schema
        ):
            raise StoreError(f"{path}: IPC cache file: not one batch of plain columns (corrupt)")
        body = meta.body()
        batch = reader.get_batch(0)
        base = buffer.address
        layout = [
            [(b.address - base, b.size) for b in _buffers(c) if b.size] for c in batch.columns
        ]
        served = _served(names, wanted)
        plan = _Plan(path, size, layout, served, body, meta.footer, (meta.head, meta.tail))
        mark = bytes(view[meta.footer :]).rfind(_MARK)
        digits = meta.footer + mark + len(_MARK)
        width = _DIGITS * (1 + len(names))
        if mark < 0 or digits + width > size:
            raise StoreError(f"{path}: IPC cache file: its checksums are missing from the footer")
        plan.hole(digits, width)
        for lo, hi in plan.runs:
            for at in range(lo, hi, READ_PIECE):
                end = min(hi, at + READ_PIECE)
                _fill(fd, path, view, at, end)
                plan.feed(view, end)  # while the piece is still in the CPU's cache
        plan.feed(view, size)
    finally:
        os.close(fd)
    if (frame := plan.frame.intdigest()) != expected[0]:
        raise _damaged_frame(path, frame, expected[0])
    for i in served:
        hasher = plan.columns.get(i)
        got = hasher.intdigest() if hasher is not None else _column_hash(batch.column(i))
        if got != expected[1 + i]:
            raise _damaged_column(path, names[i], got, expected[1 + i])
    return batch


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
    # An eighth more, so that the next steps, a little larger (token counts vary), reuse it
    # rather than fault in fresh memory; pages never written are never allocated.
    return np.empty(size + size // 8, np.uint8)


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
        batch = _read_checked(path, wanted)
        if batch is not None:
            return batch
    else:
        mapped = pa.memory_map(path, "r").read_buffer()
        batch = ipc.open_file(mapped).get_batch(0)
        if not check or check_cache_columns(path, mapped, batch, wanted):
            return batch
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
    checked against their XXH3-64s as they land, and the bytes served are the ones checked
    (module docstring); a copy written before per-column checksums is read whole and its sealed
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
        present = set(batch.schema.names)
        batch = batch.select([c for c in wanted if c in present])
    return batch
