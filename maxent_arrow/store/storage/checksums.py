"""Checksums of the store's files: whole files, sealed step files, and Parquet column chunks.

Three algorithms: zlib's **CRC-32** (whole group files, step-file seals, log entries; every
record before this version); **CRC32C** (Castagnoli, the hardware instruction through
``google-crc32c``, 5-6x zlib's speed), the column-chunk checksums of group files written by
this version (a CRC, so a chunk's follows from the writer's running values); and
**XXH3-64** (``xxhash``, about twice CRC32C), the per-column checksums of IPC cache files.
Each record names its algorithm (chunks: ``"algorithm"``, absent: CRC-32; cache files: the
key they are stored under), so stores that recorded CRC-32 keep reading.

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

import functools
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import google_crc32c
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from maxent_arrow.errors import StoreError

__all__ = [
    "ALGORITHMS",
    "CHUNK_ALGORITHM",
    "SEAL_KEY",
    "SEAL_PLACEHOLDER",
    "checksum",
    "crc32c_of",
    "xxh3_of",
    "xxh3_stream",
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
    "row_groups_of",
    "seal",
]


def crc32_of(data: Any) -> int:
    return zlib.crc32(memoryview(data).cast("B")) & 0xFFFFFFFF


def crc32c_of(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data`` (any buffer, not copied), continuing ``value``."""
    # The C extension takes bytes or a read-only buffer that needs no release (an Arrow
    # buffer); anything else is wrapped, zero-copy. It releases the GIL on bytes only.
    if not isinstance(data, bytes | pa.Buffer):
        data = pa.py_buffer(data)
    return google_crc32c.extend(value, data) & 0xFFFFFFFF


def xxh3_stream() -> Any:
    """A streaming XXH3-64 (``.update(buffer)``, ``.intdigest()``): fed the pieces of a
    buffer in order, its digest is :func:`xxh3_of` of the whole (how a checked read hashes
    each piece of an IPC cache file as it lands)."""
    return xxhash.xxh3_64()


def xxh3_of(pieces: Iterable[Any]) -> int:
    """XXH3-64 of the concatenation of ``pieces`` (buffers, not copied; the ``xxhash``
    package runs at ~30 GB/s, about twice CRC32C, and releases the GIL). Not combinable like
    a CRC: used where the pieces are at hand when the checksum is made (IPC cache columns)."""
    hasher = xxh3_stream()
    for piece in pieces:
        hasher.update(piece)
    return hasher.intdigest()


# The checksums a record may name, and the one this version writes for column chunks.
ALGORITHMS = ("crc32", "crc32c")
CHUNK_ALGORITHM = "crc32c"
_LABEL = {"crc32": "CRC-32", "crc32c": "CRC32C"}


def checksum(data: Any, algorithm: str) -> int:
    """The ``algorithm`` checksum (:data:`ALGORITHMS`) of ``data``."""
    if algorithm == "crc32c":
        return crc32c_of(data)
    if algorithm == "crc32":
        return crc32_of(data)
    raise StoreError(f"unknown checksum algorithm {algorithm!r} (expected one of {ALGORITHMS})")


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
# CRC32C has the same form with the Castagnoli polynomial.
_POLYS = {"crc32": 0xEDB88320, "crc32c": 0x82F63B78}


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


def _zero_operators(poly: int, count: int = 48) -> list[list[int]]:
    """``[Z_1, Z_2, Z_4, ...]``: feeding 2^k zero bytes, for k < count."""
    one_bit = [poly] + [1 << i for i in range(31)]  # one zero bit
    two_bits = _square(one_bit)
    four_bits = _square(two_bits)
    byte = _square(four_bits)  # eight zero bits
    ops = [byte]
    for _ in range(count - 1):
        ops.append(_square(ops[-1]))
    return ops


@functools.cache
def _zero_ops(algorithm: str) -> list[list[int]]:
    """:func:`_zero_operators` of ``algorithm``, built on first use (a reader that only
    checks never needs them)."""
    return _zero_operators(_POLYS[algorithm])


def _feed_zeros(crc: int, length: int, algorithm: str) -> int:
    ops = _zero_ops(algorithm)
    k = 0
    while length:
        if length & 1:
            crc = _times(ops[k], crc)
        length >>= 1
        k += 1
    return crc


def crc_between(crc_start: int, crc_end: int, length: int, algorithm: str = "crc32") -> int:
    """The CRC (``"crc32"`` or ``"crc32c"``) of bytes ``[a, b)`` from the running CRCs at
    ``a`` and ``b = a + length``."""
    return (crc_end ^ _feed_zeros(crc_start, length, algorithm)) & 0xFFFFFFFF


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
    algorithm: str = "crc32",
) -> dict[str, Any]:
    """The checksums a step file records for its group file: the footer's and, per row
    group, ``{column path: [offset, length, checksum]}``, with the rows of each row group
    (``row_group_rows``) and the ``algorithm`` that made them.

    ``boundaries`` are the running checksums (of ``algorithm``) at the writer's write
    boundaries; a range that does not start and end on boundaries (never seen with
    pyarrow's writer) is read back with ``read_range(offset, length)``.
    """
    running = dict(boundaries)

    def crc(offset: int, length: int) -> int:
        a, b = running.get(offset), running.get(offset + length)
        if a is not None and b is not None:
            return crc_between(a, b, length, algorithm)
        return checksum(read_range(offset, length), algorithm)

    groups: list[dict[str, list[int]]] = []
    rows: list[int] = []
    for r, ranges in enumerate(chunk_ranges(metadata)):
        group = {}
        for path, (offset, length) in ranges.items():
            group[path] = [offset, length, crc(offset, length)]
        groups.append(group)
        rows.append(metadata.row_group(r).num_rows)
    f_offset, f_length = footer_range(size, metadata)
    out: dict[str, Any] = {
        "footer": [f_offset, f_length, crc(f_offset, f_length)],
        "row_groups": groups,
        "row_group_rows": rows,
    }
    if algorithm != "crc32":  # records without the key are CRC-32 (every older store)
        out["algorithm"] = algorithm
    return out


def row_groups_of(recorded: Mapping[str, Any], start: int, count: int) -> list[int] | None:
    """The row groups holding rows ``[start, start + count)`` of a group file, from the
    row counts its chunk record holds (``None``: not recorded, an older record)."""
    rows = recorded.get("row_group_rows")
    if rows is None:
        return None
    out, at = [], 0
    for index, n in enumerate(rows):
        if at < start + count and start < at + n:
            out.append(index)
        at += n
    return out


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


def covered(path: str, columns: set[str] | frozenset[str] | None) -> bool:
    """:func:`chunk_of` with a fast path: the path's first part a wanted name (``None``: every
    chunk is wanted)."""
    if columns is None or path.split(".", 1)[0] in columns:
        return True
    return "." in path and chunk_of(path, columns)


@functools.lru_cache(maxsize=1 << 14)
def _covered_by(path: str, columns: frozenset[str] | None) -> bool:
    """:func:`covered`, remembered: every file of a run holds the same chunk paths, and a
    query checks them all against one set of columns."""
    return covered(path, columns)


def check_chunks(
    name: str,
    recorded: Mapping[str, Any],
    read_ranges,
    columns: Iterable[str] | None,
    *,
    row_groups: Iterable[int] | None = None,
    labels: Sequence[str] | None = None,
) -> None:
    """Check the footer and the chunks of ``columns`` (top-level names; ``None``: all) in
    ``row_groups`` (indices; ``None``: all) against the checksums recorded at append, with
    the algorithm the record names; damage is a :class:`StoreError` naming the file, the
    row group (``labels[i]``: what it holds, e.g. its step) and the column."""
    columns = None if columns is None else frozenset(columns)
    algorithm = recorded.get("algorithm", "crc32")
    label = _LABEL.get(algorithm, algorithm)
    wanted: list[tuple[str, int, int, int]] = []
    f_offset, f_length, f_crc = recorded["footer"]
    wanted.append(("(footer)", f_offset, f_length, f_crc))
    groups = recorded["row_groups"]
    chosen = range(len(groups)) if row_groups is None else row_groups
    for index in chosen:
        where = "" if len(groups) == 1 else f"row group {index}"
        if where and labels is not None and index < len(labels) and labels[index]:
            where += f" ({labels[index]})"
        for path, (offset, length, crc) in groups[index].items():
            if _covered_by(path, columns):
                wanted.append((f"{where}, {path}" if where else path, offset, length, crc))
    chunks = read_ranges([(offset, length) for _, offset, length, _ in wanted])
    for (path, offset, length, crc), data in zip(wanted, chunks):
        if len(data) != length:
            raise StoreError(f"{name}: column chunk {path} is cut short (truncated file)")
        got = checksum(data, algorithm)
        if got != crc:
            raise StoreError(
                f"{name}: column chunk {path} at byte {offset}: {label} {got:08x}, expected "
                f"{crc:08x} (corrupt)"
            )
