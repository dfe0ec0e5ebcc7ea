"""How the store writes Parquet: one row group per append (a compacted segment: one per unit),
the settings of each column, and sealed step files.

Group files: zstd level 1 by default (token ids and log-probs compress little more at higher
levels, which cost several times the time); the column settings come from the column registry
(:mod:`maxent_arrow.arrow.registry`): dictionary encoding only on the repeated strings (on
token and log-prob columns it makes writes ~4x slower for little gain), byte-stream split on
the per-token floats (they compress better at no extra cost), statistics only on what readers
filter on; page checksums; the schema version in the file metadata (``docs/arrow-layout.md``,
"Parquet settings").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import StoreError
from maxent_arrow.store.storage.checksums import SEAL_KEY, SEAL_PLACEHOLDER, seal

__all__ = [
    "COMPRESSIONS",
    "check_compression",
    "footer_value",
    "ParquetLayout",
    "group_file_layout",
    "parquet_bytes",
    "write_parquet",
]

COMPRESSIONS = ("zstd", "lz4", "snappy", "gzip", "brotli", "none")


def check_compression(compression: str, level: int | None) -> tuple[str, int | None]:
    """The Parquet codec of group files and its level (kept only for codecs that have one)."""
    if compression not in COMPRESSIONS:
        raise StoreError(
            f"compression: expected one of {', '.join(COMPRESSIONS)}, got {compression!r}"
        )
    return compression, level if compression in ("zstd", "gzip", "brotli") else None


def _leaf(kind: pa.DataType) -> pa.DataType:
    while pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    return kind


def _depth(kind: pa.DataType) -> int:
    depth = 0
    while pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind, depth = kind.value_type, depth + 1
    return depth


@dataclasses.dataclass(frozen=True)
class ParquetLayout:
    """How a file is written: the columns with statistics and with a dictionary (``True``:
    all), the Parquet paths written with byte-stream-split, whether it is sealed with its
    own CRC-32 (step files), the codec and its level, and its row groups (row counts that
    add up to the table's; ``None``: one row group)."""

    statistics: tuple[str, ...] = ()
    dictionary: tuple[str, ...] | bool = False
    byte_stream_split: tuple[str, ...] = ()
    sealed: bool = False
    compression: str = "zstd"
    compression_level: int | None = 1
    row_groups: Sequence[int] | None = None


@functools.lru_cache(maxsize=64)
def group_file_layout(
    schema: pa.Schema,
    compression: str = "zstd",
    compression_level: int | None = 1,
    row_groups: tuple[int, ...] | None = None,
) -> ParquetLayout:
    """The layout of a group file with this schema, from the column registry (one answer
    per schema and settings: a run appends one schema again and again)."""
    registered = {c.name: c for c in R.columns(R.GROUP)}
    present = [registered[n] for n in schema.names if n in registered]
    return ParquetLayout(
        dictionary=tuple(c.name for c in present if c.dictionary),
        statistics=tuple(c.name for c in present if c.statistics),
        # Parquet paths of the per-token floats (``name.list.element.list.element``) and of
        # the gap-coded kept-token sets (one level deeper).
        byte_stream_split=tuple(
            c.name + ".list.element" * _depth(schema.field(c.name).type)
            for c in present
            if c.kept_set
            or (c.byte_stream_split and pa.types.is_floating(_leaf(schema.field(c.name).type)))
        ),
        compression=compression,
        compression_level=compression_level,
        row_groups=row_groups,
    )


def write_parquet(
    sink, table: pa.Table, metadata: dict[bytes, bytes], layout: ParquetLayout
) -> None:
    """Write ``table`` as one Parquet file to ``sink`` with ``metadata`` in its footer, as
    ``layout`` says: one row group, or one of each row count of its ``row_groups`` (a
    compacted segment's units)."""
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    compression, compression_level = layout.compression, layout.compression_level
    if compression in ("none", "uncompressed", None):
        compression, compression_level = "none", None
    dictionary = layout.dictionary
    if not isinstance(dictionary, bool):
        dictionary = list(dictionary)
    splits = list(layout.byte_stream_split) or False
    with pq.ParquetWriter(
        sink,
        table.schema,
        compression=compression,
        compression_level=compression_level,
        # pyarrow takes a bool or a list of columns for these three; its defaults make them
        # `bool` to a checker.
        use_dictionary=dictionary,  # pyright: ignore[reportArgumentType]
        write_statistics=list(layout.statistics),  # pyright: ignore[reportArgumentType]
        write_page_checksum=True,
        store_schema=True,
        use_byte_stream_split=splits,  # pyright: ignore[reportArgumentType]
    ) as writer:
        # One row group per step: a step is read whole, and one chunk per column means readers
        # get contiguous arrays without a concatenating copy; a reader of one step of a
        # segment decodes (and checks) its row group only.
        sizes = [n for n in layout.row_groups if n > 0] if layout.row_groups else []
        if len(sizes) < 2:
            writer.write_table(table, row_group_size=max(table.num_rows, 1))
        else:
            if sum(sizes) != table.num_rows:
                raise StoreError(
                    f"row groups of {sum(sizes)} rows for a table of {table.num_rows} rows"
                )
            at = 0
            for n in sizes:
                writer.write_table(table.slice(at, n), row_group_size=n)
                at += n
        if layout.sealed:
            writer.add_key_value_metadata({SEAL_KEY: SEAL_PLACEHOLDER})


def parquet_bytes(
    table: pa.Table, metadata: dict[bytes, bytes], layout: ParquetLayout
) -> pa.Buffer | bytes:
    """Parquet bytes in memory; sealed files come back with their own CRC patched in."""
    sink = pa.BufferOutputStream()
    write_parquet(sink, table, metadata, layout)
    if layout.sealed:
        return seal(sink.getvalue().to_pybytes())
    return sink.getvalue()


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """A ULEB128 varint at ``at``: its value and the offset after it."""
    value, shift = 0, 0
    while at < len(data):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    raise ValueError("varint runs past the end")


def _uleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def footer_value(data: bytes, key: bytes) -> bytes | None:
    """The value of footer key-value metadata ``key`` in the Parquet file ``data``, found in
    the bytes without decoding the footer (``None`` when absent).

    A footer ``KeyValue`` is a Thrift compact struct: field 1 (binary, header ``0x18``), a
    varint length and the key, field 2 (binary, ``0x18``), a varint length and the value, then
    a stop byte. Decoding a whole step-file footer costs ~0.3 ms; this costs microseconds, and
    is used only on files whose sealed CRC-32 has been checked (the bytes are the writer's).
    """
    needle = b"\x18" + _uleb(len(key)) + key + b"\x18"
    at = data.rfind(needle)
    if at < 0:
        return None
    try:
        length, start = _varint(data, at + len(needle))
    except ValueError:
        return None
    end = start + length
    if end >= len(data) or data[end] != 0:  # the struct's stop byte
        return None
    return bytes(data[start:end])
