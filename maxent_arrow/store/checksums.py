"""Checksums of the store's files: whole files, sealed step files, and Parquet column chunks.

DuckDB and Polars ignore Parquet page CRCs (a flipped byte comes back as a silently wrong
number from both), so verification is the store's own job (``docs/commit-protocol.md``):

- a **step file** carries the CRC-32 of its own bytes in its footer (:func:`seal`), checked
  whenever it is read;
- a **group file**'s size, whole-file CRC-32, footer CRC-32 and the CRC-32 of every column
  chunk are recorded in its step file at append (:func:`chunk_crcs`). Readers that decode
  everything (``read``, ``replay``, ``verify``) check the whole file; readers that hand
  files to DuckDB check the size and footer of every file and the chunks of the columns the
  query reads (:func:`check_chunks`).

Chunk CRCs cost no second pass over the bytes at append: the writer thread keeps the running
CRC-32 at every write boundary, Parquet column chunks start and end on write boundaries, and
the CRC of the bytes between two boundaries follows from the two running CRCs
(:func:`crc_between`), the way zlib's ``crc32_combine`` does.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow.parquet as pq

from maxent_arrow.errors import StoreError

__all__ = [
    "SEAL_KEY",
    "SEAL_PLACEHOLDER",
    "check_chunks",
    "check_seal",
    "chunk_crcs",
    "chunk_of",
    "covered",
    "chunk_ranges",
    "in_background",
    "crc32_of",
    "crc_between",
    "footer_range",
    "seal",
]


def crc32_of(data: Any) -> int:
    return zlib.crc32(memoryview(data).cast("B")) & 0xFFFFFFFF


def in_background(work: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``work`` (a checksum pass: zlib and file reads release the GIL) in a thread;
    the returned call waits for it and gives its result, or raises what it raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="maxent-arrow-check", daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return wait


# ---------------------------------------------------------------------------- CRC algebra
# zlib's CRC-32 is affine in its input: crc(X || Y) = crc(Y) xor Z_|Y|(crc(X)), where Z_n is
# the linear map "feed n zero bytes" on the 32-bit register. Z_n is applied as a product of
# precomputed operators for the powers of two in n (GF(2) 32x32 matrices as 32 column ints).
_POLY = 0xEDB88320


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[i]) for i in range(32)]


def _zero_operators(count: int = 48) -> list[list[int]]:
    """``[Z_1, Z_2, Z_4, ...]``: feeding 2^k zero bytes, for k < count."""
    one_bit = [_POLY] + [1 << i for i in range(31)]  # one zero bit
    two_bits = _square(one_bit)
    four_bits = _square(two_bits)
    byte = _square(four_bits)  # eight zero bits
    ops = [byte]
    for _ in range(count - 1):
        ops.append(_square(ops[-1]))
    return ops


_ZERO_OPS = _zero_operators()


def _feed_zeros(crc: int, length: int) -> int:
    k = 0
    while length:
        if length & 1:
            crc = _times(_ZERO_OPS[k], crc)
        length >>= 1
        k += 1
    return crc


def crc_between(crc_start: int, crc_end: int, length: int) -> int:
    """CRC-32 of bytes ``[a, b)`` from the running CRC-32s at ``a`` and ``b = a + length``."""
    return (crc_end ^ _feed_zeros(crc_start, length)) & 0xFFFFFFFF


# ---------------------------------------------------------------------------- step files
# A step file carries the CRC-32 of its own bytes in the footer's key-value metadata: the file
# is written with a placeholder, the CRC is taken with the placeholder zeroed, then patched in
# (same length, so the footer stays valid). The key is added by the Parquet writer only, not
# to the Arrow schema (which would embed a second, base64 copy).
SEAL_KEY = b"maxent_arrow.file_crc32"
_SEAL_MARK = b"maxent-crc32="
SEAL_PLACEHOLDER = _SEAL_MARK + b"00000000"


def seal(data: bytes) -> bytes:
    """Patch the CRC-32 of ``data`` (placeholder zeroed) into its placeholder."""
    at = data.rfind(SEAL_PLACEHOLDER)
    if at < 0:
        raise StoreError("seal: no checksum placeholder in the file")
    crc = crc32_of(data)
    out = bytearray(data)
    start = at + len(_SEAL_MARK)
    out[start : start + 8] = f"{crc:08x}".encode()
    return bytes(out)


def check_seal(data: Any, *, tail: int | None = None) -> bool | None:
    """Whether ``data`` (bytes, or any buffer: a memory map is not copied) matches the
    CRC-32 sealed into it (``None``: the file has no seal). ``tail``: the seal lies in the
    last ``tail`` bytes (an IPC file's footer), so only they are searched."""
    view = memoryview(data).cast("B")
    base = max(0, len(view) - tail) if tail is not None else 0
    at = bytes(view[base:]).rfind(_SEAL_MARK)
    if at < 0 and base > 0:  # a footer larger than ``tail``: search everything
        base, at = 0, bytes(view).rfind(_SEAL_MARK)
    if at < 0:
        # No marker. A file that still carries the seal's key had one: its marker is damaged.
        return False if bytes(view).rfind(SEAL_KEY) >= 0 else None
    start = base + at + len(_SEAL_MARK)
    stored = bytes(view[start : start + 8])
    try:
        expected = int(stored, 16)
    except ValueError:
        return False
    crc = zlib.crc32(view[:start])
    crc = zlib.crc32(b"00000000", crc)
    crc = zlib.crc32(view[start + 8 :], crc)
    return crc & 0xFFFFFFFF == expected


# ---------------------------------------------------------------------------- group files
def chunk_ranges(metadata: pq.FileMetaData) -> list[dict[str, tuple[int, int]]]:
    """Per row group, ``{column path: (offset, length)}`` of each column chunk's bytes."""
    out = []
    for r in range(metadata.num_row_groups):
        group = metadata.row_group(r)
        columns = {}
        for c in range(group.num_columns):
            chunk = group.column(c)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            columns[chunk.path_in_schema] = (int(start), int(chunk.total_compressed_size))
        out.append(columns)
    return out


def footer_range(size: int, metadata: pq.FileMetaData) -> tuple[int, int]:
    """``(offset, length)`` of the footer: the serialized metadata, its length and ``PAR1``."""
    length = metadata.serialized_size + 8
    return size - length, length


def chunk_crcs(
    metadata: pq.FileMetaData,
    size: int,
    boundaries: list[tuple[int, int]],
    read_range,
) -> dict[str, Any]:
    """The checksums a step file records for its group file: the footer's CRC-32 and, per row
    group, ``{column path: [offset, length, crc32]}``.

    ``boundaries`` are the running CRCs at the writer's write boundaries; a range that does
    not start and end on boundaries (never seen with pyarrow's writer) is read back with
    ``read_range(offset, length)``.
    """
    running = dict(boundaries)

    def crc(offset: int, length: int) -> int:
        a, b = running.get(offset), running.get(offset + length)
        if a is not None and b is not None:
            return crc_between(a, b, length)
        return crc32_of(read_range(offset, length))

    groups = [
        {path: [offset, length, crc(offset, length)] for path, (offset, length) in rg.items()}
        for rg in chunk_ranges(metadata)
    ]
    f_offset, f_length = footer_range(size, metadata)
    return {"footer": [f_offset, f_length, crc(f_offset, f_length)], "row_groups": groups}


def chunk_of(path: str, columns: Iterable[str]) -> bool:
    """Whether the column chunk at Parquet ``path`` may belong to one of ``columns``
    (top-level names).

    A Parquet path joins the names of its schema nodes with ``.``, and a column's own name
    may hold dots (``my.score``), so the path is not split: a chunk belongs to ``c`` when its
    path is ``c`` or starts with ``c.``. With columns ``my`` and ``my.score`` both present a
    chunk of the second also counts for the first: a check keyed on this reads more chunks,
    never fewer.
    """
    return any(path == c or path.startswith(c + ".") for c in columns)


def covered(path: str, columns: set[str] | None) -> bool:
    """:func:`chunk_of` with a fast path: the path's first part a wanted name (``None``: every
    chunk is wanted)."""
    if columns is None or path.split(".", 1)[0] in columns:
        return True
    return "." in path and chunk_of(path, columns)


def check_chunks(
    name: str,
    recorded: Mapping[str, Any],
    read_ranges,
    columns: Iterable[str] | None,
) -> None:
    """Check the footer and the chunks of ``columns`` (top-level names; ``None``: all)
    against the CRCs recorded at append; damage is a :class:`StoreError` naming the file and
    the column."""
    columns = None if columns is None else set(columns)
    wanted: list[tuple[str, int, int, int]] = []
    f_offset, f_length, f_crc = recorded["footer"]
    wanted.append(("(footer)", f_offset, f_length, f_crc))
    for group in recorded["row_groups"]:
        for path, (offset, length, crc) in group.items():
            if covered(path, columns):
                wanted.append((path, offset, length, crc))
    chunks = read_ranges([(offset, length) for _, offset, length, _ in wanted])
    for (path, offset, length, crc), data in zip(wanted, chunks):
        if len(data) != length:
            raise StoreError(f"{name}: column chunk {path} is cut short (truncated file)")
        got = crc32_of(data)
        if got != crc:
            raise StoreError(
                f"{name}: column chunk {path} at byte {offset}: CRC-32 {got:08x}, expected "
                f"{crc:08x} (corrupt)"
            )
