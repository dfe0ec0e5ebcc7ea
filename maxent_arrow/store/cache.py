"""The IPC cache: an uncompressed Arrow IPC copy of a committed unit, memory-mapped for
zero-copy replay (local stores only).

A cache file is derived data: it is written after the commit, never counts as one, and is
served only if it is the copy of the committed group file it claims to be (its record names
the unit and the group file's CRC-32) and, when checked, if its own bytes match the CRC-32
sealed into it. A file in ``cache/`` without that record and seal is never served. ``verify``
checks every cache file in full.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_groups
from maxent_arrow.errors import StoreError
from maxent_arrow.rollout import STEP_META_KEY, RolloutBatch, step_row_to_json
from maxent_arrow.store.backend import Backend
from maxent_arrow.store.catalog import StepFile
from maxent_arrow.store.checksums import SEAL_KEY, SEAL_PLACEHOLDER, check_seal, seal
from maxent_arrow.store.names import CACHE, cache_name

__all__ = ["CACHE_META_KEY", "read_cache", "unit_group_crc32", "write_cache"]

# JSON in a cache file's schema metadata: the unit and the CRC of the group file it copies.
CACHE_META_KEY = b"maxent_arrow.cache"


def unit_group_crc32(step: StepFile, unit: str) -> int | None:
    """The CRC-32 of the group file ``unit`` was appended in: what its cache copy is tied to
    (a compacted segment records it per unit, so copies stay valid through compaction)."""
    return (step.meta.get("unit_crc32") or {}).get(unit, step.meta.get("group_crc32"))


def write_cache(
    backend: Backend, batch: RolloutBatch, unit: str, group_crc32: int | None = None
) -> None:
    """Write the IPC cache copy of a committed unit (uncompressed: memory-mappable)."""
    meta = dict(batch.groups.schema.metadata or {})
    meta[STEP_META_KEY] = step_row_to_json(batch.step_row).encode()
    meta[CACHE_META_KEY] = json.dumps({"unit": unit, "group_crc32": group_crc32}).encode()
    meta[SEAL_KEY] = SEAL_PLACEHOLDER
    groups = batch.groups.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, groups.schema) as writer:
        writer.write_batch(groups)
    backend.makedirs(CACHE)
    backend.write_file(f"{CACHE}/{cache_name(unit)}", seal(sink.getvalue().to_pybytes()))


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
    backend: Backend, step: StepFile, unit: str, *, check: bool
) -> pa.RecordBatch | None:
    """The cached group rows of ``unit``, or ``None`` when there is no cache copy of the
    committed rows: no file, or a file without the record (unit, CRC-32 of the committed
    group file) and seal that this library writes into every copy.

    ``check``: the file is read into memory once, and the bytes that are served are the ones
    whose sealed CRC-32 was checked (a damaged copy is a :class:`StoreError`); another
    program truncating the file afterwards cannot touch them. Without ``check`` the copy is
    memory-mapped (zero-copy, only the pages used are read), unchecked; a file truncated by
    another program while mapped then ends the process with SIGBUS.
    """
    rel = f"{CACHE}/{cache_name(unit)}"
    if not backend.can_mmap or backend.stat(rel) is None:
        return None
    path = backend.path(rel)
    try:
        if check:
            data = _read_whole(str(path))
            sealed = check_seal(data, tail=1 << 16)
            if sealed is None:
                return None  # not a copy this library wrote: never served
            if not sealed:
                raise StoreError(
                    f"{path}: IPC cache CRC-32 differs from the one sealed in it (corrupt)"
                )
            source: Any = pa.py_buffer(data)
        else:
            source = pa.memory_map(str(path), "r")
        reader = ipc.open_file(source)
        batch = reader.get_batch(0)
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
    return batch
