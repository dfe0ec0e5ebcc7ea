"""The take files: each committed unit's groups as an Arrow IPC file of one record batch per
group, so that a random take of a group reads that group's bytes and checks exactly them.

The Parquet archive is laid out for scans (a unit's rows are one row group, and a compacted
segment holds many units): a sampled group read from it costs its whole row group, every
group of its step. A take file (``take/{unit}.arrow``, written beside the commit, derived
data like the IPC cache) holds the same rows, uncompressed, one batch per group (row ``i``
is batch ``i``), and says in its footer where each batch's message lies and its XXH3-64::

    maxent_arrow.take        {"unit": ..., "group_crc32": ..., "groups": n}
    maxent_arrow.take_index  "maxent-take=" + hex: the frame's XXH3-64 (16 digits), then per
                             batch its offset (12), its length (8) and its XXH3-64 (16)

The *frame* is every byte outside the batches (the magic, the schema message, the footer),
the index's digits read as ``0``. A reader checks a file's frame once per process (the
``takes`` cache of :mod:`~maxent_arrow.store.storage.caches`: its schema and its index) and
then, for each group it serves, reads that batch's bytes (one ``pread``) into memory of its
own, checks their XXH3-64 and decodes them: a group costs its own bytes, a file truncated or
rewritten afterwards cannot touch what was served, and damage is a :class:`StoreError` naming
the file and the group. A file is served only for the commit it copies: its record names the
unit and the CRC-32 of the group file the unit was appended in (kept through compaction), so
the take file of an earlier commit of the same unit (a re-run) is never served; a unit
without one is read from the archive.

A compaction writes one take file for its segment (``take/{segment}.arrow``, its record
naming the segment's file, the CRC-32 of its group file and each unit's first row), served
for the segment's units in place of theirs: a sampler over a compacted store opens a file
per segment, not per unit (each file's frame is checked once per process, ~0.16 ms).

A plain reader opens a take file as what it is, an Arrow IPC file (``pyarrow.ipc``,
``polars.read_ipc``), one batch per group.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_groups
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import StepFile
from maxent_arrow.store.io.cache import unit_group_crc32
from maxent_arrow.store.storage.backend import Backend
from maxent_arrow.store.storage.caches import CACHES
from maxent_arrow.store.storage.checksums import SEAL_KEY
from maxent_arrow.store.storage.names import take_name
from maxent_arrow.store.storage.padding import strip_padding

__all__ = [
    "INDEX_KEY",
    "SegmentUnits",
    "TAKE_META_KEY",
    "TakeFile",
    "current_take",
    "open_take",
    "segment_take",
    "take_batches",
    "take_rows",
    "write_segment_take",
    "write_take",
]

TAKE_META_KEY = b"maxent_arrow.take"
INDEX_KEY = b"maxent_arrow.take_index"
_MARK = b"maxent-take="
_FRAME_DIGITS = 16
_ENTRY = (12, 8, 16)  # hex digits of a batch's offset, length and XXH3-64
_ENTRY_DIGITS = sum(_ENTRY)
_TRAILER = 10  # the footer's length (int32) and the magic "ARROW1"
_TAIL = 1 << 16  # bytes read first from a file's end (its footer, as a rule)
_KEYS = (TAKE_META_KEY, INDEX_KEY)


@dataclasses.dataclass(frozen=True)
class SegmentUnits:
    """The units of a compacted segment's take file: each one's first row, and the columns
    of the segment a reader of the unit's rows drops (the padding the segment gave a unit
    that has no data in them: ``strip_padding``)."""

    starts: Mapping[str, int]
    padding: Mapping[str, list[str]]


def write_take(
    backend: Backend,
    groups: pa.RecordBatch,
    unit: str,
    group_crc32: int | None,
    units: SegmentUnits | None = None,
) -> None:
    """Write the take file of ``unit`` (module docstring; ``groups``: its committed group
    rows, ``group_crc32``: the CRC-32 of the group file they were committed in) into
    ``take/``. A compacted segment's (``unit``: its file name) names its ``units``.
    Derived data: a file lost or torn in a crash is never served (its checksums), and the
    unit is read from the archive instead."""
    n = groups.num_rows
    meta = dict(groups.schema.metadata or {})
    for key in (*_KEYS, SEAL_KEY):
        meta.pop(key, None)
    record: dict[str, Any] = {"unit": unit, "group_crc32": group_crc32, "groups": n}
    if units is not None:
        record["units"] = dict(units.starts)
        record["padding"] = dict(units.padding)
    meta[TAKE_META_KEY] = json.dumps(record).encode()
    width = _FRAME_DIGITS + n * _ENTRY_DIGITS
    meta[INDEX_KEY] = _MARK + b"0" * width
    batch = groups.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    digits = [""]  # the frame's, once known
    lo = hi = -1
    with ipc.new_file(sink, batch.schema) as writer:
        for i in range(n):
            row = batch.slice(i, 1)
            writer.write_batch(row)
            # The file writer writes each batch as its encapsulated message (the schema
            # before the first): the same bytes, ending where the sink is now.
            message = row.serialize()
            at, hi = sink.tell() - message.size, sink.tell()
            lo = at if lo < 0 else lo
            digits.append(f"{at:012x}{message.size:08x}{xxhash.xxh3_64_intdigest(message):016x}")
    data = bytearray(sink.getvalue().to_pybytes())
    if lo < 0:  # no groups: every byte is frame
        lo = hi = len(data)
    view = memoryview(data)
    hasher = xxhash.xxh3_64(view[:lo])  # the frame, its digits still zeros
    hasher.update(view[hi:])
    digits[0] = f"{hasher.intdigest():016x}"
    text = "".join(digits).encode()
    del view
    for mark in (data.find(_MARK), data.rfind(_MARK)):
        data[mark + len(_MARK) : mark + len(_MARK) + width] = text
    backend.write_derived(take_name(unit), data)


def write_segment_take(
    backend: Backend,
    groups: pa.Table,
    segment: str,
    group_crc32: int | None,
    units: Sequence[tuple[str, int]],
) -> None:
    """Write the take file of the compacted segment ``segment`` (its file name): ``groups``,
    its rows, of ``units`` (each unit's name and number of groups, in order); what a reader of
    a unit's rows drops (the padding the segment gave a unit that has no data in a column,
    :func:`~maxent_arrow.store.storage.padding.strip_padding`) recorded per unit."""
    starts: dict[str, int] = {}
    padding: dict[str, list[str]] = {}
    at = 0
    for name, count in units:
        starts[name] = at
        kept = set(strip_padding(groups.slice(at, count), R.GROUP).schema.names)
        dropped = [column for column in groups.schema.names if column not in kept]
        if dropped:
            padding[name] = dropped
        at += count
    meta = {**(groups.schema.metadata or {}), S.METADATA_KEY: S.SCHEMA_VERSION.encode()}
    batches = groups.replace_schema_metadata(meta).combine_chunks().to_batches()
    if batches:
        write_take(backend, batches[0], segment, group_crc32, SegmentUnits(starts, padding))


def _zero_digits(piece: bytearray, width: int) -> None:
    """The index's ``width`` digits in ``piece`` (a copy of the schema's metadata) read as
    ``0``, as they were when the frame was hashed."""
    at = piece.find(_MARK)
    while at >= 0:
        start = at + len(_MARK)
        piece[start : start + width] = b"0" * min(width, len(piece) - start)
        at = piece.find(_MARK, start + width)


_DIGITS_RE = re.compile(rb"[0-9a-f]*")


@dataclasses.dataclass(frozen=True)
class TakeFile:
    """A take file whose frame was checked: its schema (without the take keys), its record
    and where each group's batch lies, with its XXH3-64."""

    rel: str
    size: int
    schema: pa.Schema
    record: dict[str, Any]
    offsets: np.ndarray
    lengths: np.ndarray
    hashes: np.ndarray

    @property
    def groups(self) -> int:
        return len(self.offsets)


def _corrupt(backend: Backend, rel: str, what: str) -> StoreError:
    return StoreError(f"{backend.path(rel)}: take file: {what} (corrupt)")


def _parse_index(backend: Backend, rel: str, tail: bytes) -> tuple[int, np.ndarray, int]:
    """The frame's XXH3-64, the ``[n, 3]`` entries (offset, length, XXH3-64) written in the
    footer's copy of the index (the last in ``tail``) and its width in digits."""
    mark = tail.rfind(_MARK)
    if mark < 0:
        raise _corrupt(backend, rel, "no index in its footer")
    start = mark + len(_MARK)
    match = _DIGITS_RE.match(tail, start)
    digits = tail[start : match.end() if match else start].decode()
    if len(digits) < _FRAME_DIGITS or (len(digits) - _FRAME_DIGITS) % _ENTRY_DIGITS:
        raise _corrupt(backend, rel, "its index is damaged")
    frame = int(digits[:_FRAME_DIGITS], 16)
    # Each entry's 36 digits are 18 bytes (big-endian): the offset's 6, the length's 4, the
    # XXH3-64's 8; read all at once.
    raw = np.frombuffer(bytes.fromhex(digits[_FRAME_DIGITS:]), np.uint8).reshape(-1, 18)
    weights = [np.uint64(1) << np.uint64(8 * i) for i in range(8)][::-1]
    entries = np.zeros((len(raw), 3), dtype=np.uint64)
    for column, (lo, hi) in enumerate(((0, 6), (6, 10), (10, 18))):
        part = raw[:, lo:hi].astype(np.uint64)
        entries[:, column] = (part * np.array(weights[8 - (hi - lo) :], np.uint64)).sum(
            axis=1, dtype=np.uint64
        )
    return frame, entries, len(digits)


def open_take(backend: Backend, rel: str) -> TakeFile | None:
    """The take file ``rel`` with its frame checked (once per process: the ``takes``
    cache), ``None`` if there is none; a :class:`StoreError` naming the file when it is not
    one, or damaged."""
    key = (backend.uri, rel)
    cached = CACHES.takes.get(key)
    if cached is not None:
        return cached
    info = backend.stat(rel)
    if info is None:
        return None
    size = info.size
    if size < 8 + _TRAILER:
        raise _corrupt(backend, rel, f"{size} bytes")
    first = min(size, _TAIL)
    tail = backend.read_ranges(rel, [(size - first, first)])[0]
    if tail[-6:] != b"ARROW1":
        raise _corrupt(backend, rel, "no Arrow IPC footer")
    footer = size - _TRAILER - int.from_bytes(tail[-_TRAILER:-6], "little", signed=True)
    if not 8 <= footer < size:
        raise _corrupt(backend, rel, "its footer overruns it")
    if footer < size - first:  # a footer longer than the first read
        tail = backend.read_ranges(rel, [(footer, size - footer)])[0]
    else:
        tail = tail[footer - (size - first) :]
    frame, entries, width = _parse_index(backend, rel, tail)
    offsets, lengths, hashes = (entries[:, i].copy() for i in range(3))
    lo = int(offsets[0]) if len(offsets) else footer
    hi = int(offsets[-1] + lengths[-1]) if len(offsets) else footer
    contiguous = np.array_equal(offsets[1:], offsets[:-1] + lengths[:-1])
    if not (8 <= lo <= hi <= footer) or not contiguous:
        raise _corrupt(backend, rel, "its index names bytes outside its batches")
    head = bytearray(backend.read_ranges(rel, [(0, lo)])[0])
    if hi >= size - len(tail):
        end = bytearray(tail[hi - (size - len(tail)) :])
    else:
        end = bytearray(backend.read_ranges(rel, [(hi, size - hi)])[0])
    pieces = [head, end]
    for piece in pieces:
        _zero_digits(piece, width)
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    if hasher.intdigest() != frame:
        raise _corrupt(
            backend, rel, f"frame (schema, footer) XXH3-64 {hasher.intdigest():016x}, "
            f"expected {frame:016x}"
        )  # fmt: skip
    try:
        schema = ipc.read_schema(pa.py_buffer(bytes(head[8:])))
    except (pa.ArrowException, ValueError) as exc:
        raise _corrupt(backend, rel, f"unreadable schema ({exc})") from None
    meta = dict(schema.metadata or {})
    try:
        record = json.loads(meta.get(TAKE_META_KEY, b""))
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("groups") != len(offsets):
        raise _corrupt(backend, rel, "no record of its unit, or one that disagrees")
    schema = schema.with_metadata({k: v for k, v in meta.items() if k not in _KEYS})
    take = TakeFile(rel, size, schema, record, offsets, lengths, hashes)
    CACHES.takes.put(key, take)
    return take


def _decode(backend: Backend, take: TakeFile, row: int, data: bytes) -> pa.RecordBatch:
    try:
        message = ipc.read_message(pa.py_buffer(data))
        return ipc.read_record_batch(message, take.schema)
    except (pa.ArrowException, ValueError) as exc:
        raise _corrupt(backend, take.rel, f"group {row} unreadable ({exc})") from None


def _read(
    backend: Backend, take: TakeFile, rows: Sequence[int], check: bool
) -> tuple[list[pa.RecordBatch], int | None]:
    """The batches of ``rows``, or the first row whose bytes do not match their XXH3-64
    (the file changed since its frame was checked, or is damaged)."""
    ranges = [(int(take.offsets[r]), int(take.lengths[r])) for r in rows]
    out = []
    for row, data in zip(rows, backend.read_ranges(take.rel, ranges), strict=True):
        if len(data) != take.lengths[row]:
            return out, row
        if check and xxhash.xxh3_64_intdigest(data) != int(take.hashes[row]):
            return out, row
        out.append(_decode(backend, take, row, data))
    return out, None


def current_take(
    backend: Backend, step: StepFile, unit: str, *, fresh: bool = False
) -> TakeFile | None:
    """The take file of the committed ``unit`` (its frame checked), or ``None`` when it has
    none that copies this commit. ``fresh``: look at the file again rather than at what
    this process checked of it before (it may have been written again since)."""
    expected = unit_group_crc32(step, unit)
    if expected is None:
        return None
    rel = take_name(unit)
    if fresh:
        CACHES.takes.pop((backend.uri, rel))
    take = open_take(backend, rel)
    if take is None:
        return None
    if take.record.get("group_crc32") != expected or take.record.get("unit") != unit:
        # Another commit's copy, or one rewritten since it was checked: look once more.
        return None if fresh else current_take(backend, step, unit, fresh=True)
    return take


def take_batches(backend: Backend, take: TakeFile) -> list[pa.RecordBatch]:
    """Every batch of the take file ``take``, each checked by its XXH3-64 (``verify``);
    damage is a :class:`StoreError` naming the file and the group."""
    batches, damaged = _read(backend, take, range(take.groups), True)
    if damaged is not None:
        raise _corrupt(backend, take.rel, f"group {damaged}: its bytes differ from their XXH3-64")
    return batches


def segment_take(backend: Backend, step: StepFile, *, fresh: bool = False) -> TakeFile | None:
    """The take file of the compacted segment ``step`` (one for all its units, written by
    the compaction: ``take/{segment}.arrow``, its record naming each unit's first row), or
    ``None``: ``step`` is not a segment, or it has none of this commit. ``fresh``: as
    :func:`current_take`."""
    if not step.meta.get("unit_crc32"):
        return None
    rel = take_name(step.name)
    if fresh:
        CACHES.takes.pop((backend.uri, rel))
    take = open_take(backend, rel)
    if take is None:
        return None
    record = take.record
    if (
        record.get("unit") != step.name
        or record.get("group_crc32") != step.meta.get("group_crc32")
        or not isinstance(record.get("units"), dict)
    ):
        return None if fresh else segment_take(backend, step, fresh=True)
    return take


def take_rows(
    backend: Backend,
    step: StepFile,
    unit: str,
    rows: Sequence[int],
    *,
    check: bool = True,
) -> list[pa.RecordBatch] | None:
    """The group rows ``rows`` (positions in the unit) of the committed ``unit``, one batch
    each, from its segment's take file (a compacted unit) or its own; ``None`` when it has
    none that copies this commit (the caller reads the archive). ``check``: each batch's
    XXH3-64 is checked (module docstring); damage is a :class:`StoreError` naming the file
    and the group."""
    take, first, padding = segment_take(backend, step), 0, None
    if take is not None and isinstance(take.record["units"].get(unit), int):
        first = take.record["units"][unit]
        padding = (take.record.get("padding") or {}).get(unit)

        def again() -> TakeFile | None:
            return segment_take(backend, step, fresh=True)

    else:
        take = current_take(backend, step, unit)

        def again() -> TakeFile | None:
            return current_take(backend, step, unit, fresh=True)

    if take is None:
        return None
    rows = [first + r for r in rows]
    bad = [r for r in rows if not 0 <= r < take.groups]
    if bad:
        raise StoreError(
            f"{backend.path(take.rel)}: take file of {take.groups} groups, asked for group {bad[0]}"
        )
    batches, damaged = _read(backend, take, rows, check)
    if damaged is not None:  # the file changed since its frame was checked: look again
        take = again()
        if take is None:
            return None
        batches, damaged = _read(backend, take, rows, check)
        if damaged is not None:
            raise _corrupt(
                backend, take.rel, f"group {damaged}: its bytes differ from their XXH3-64"
            )
    if padding:  # (the columns the archive's reader drops from this unit's rows)
        kept = [name for name in take.schema.names if name not in padding]
        batches = [b.select(kept) for b in batches]
    version = (take.schema.metadata or {}).get(S.METADATA_KEY)
    if needs_upgrade(version):
        table = upgrade_groups(pa.Table.from_batches(batches), kind=unit.split(".")[2])
        batches = table.to_batches()
    return batches
