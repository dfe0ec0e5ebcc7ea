"""The commit: the one function that makes a group file and its step file part of the store.

Append (:mod:`.writer`) and compaction (:mod:`.compaction`) both end in :func:`commit_unit`,
so the protocol of ``docs/commit-protocol.md`` is written once:

1. the group file is encoded into a temp file (hidden, never ``*.parquet``) while a writer
   thread writes and checksums the bytes (:func:`write_group_file`); fsynced. This runs
   outside any lock, so writers committing at once serialise only on step 3;
2. the step file (the step rows, and in its metadata the group file's size, CRC-32, footer
   and column-chunk CRCs, :func:`group_file_meta`) is written into a temp file, sealed with
   its own CRC-32 (:func:`step_file_bytes`); fsynced;
3. under the store lock (where the backend has one): the caller's precondition is checked
   again (no duplicate step; the inputs of a compaction still committed), the group file is
   renamed into place, then the step file is published exclusively. The step file's
   appearance is the commit; if publishing it fails the group file is removed again (under
   a lock only: on object storage it may be another writer's), and the temp files are
   dropped in every case.

A crash before step 3's publish leaves nothing a reader of this library sees (temp files, at
most an uncommitted group file); after it, the whole unit. ``crash_point`` names each stage
(``{operation}:group-written``, ``step-written``, ``locked``, ``group-published``,
``committed``) for the kill and stop tests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import StoreError
from maxent_arrow.store.backend import Backend, Pending, crash_point
from maxent_arrow.store.catalog import step_rows_json
from maxent_arrow.store.checksums import chunk_crcs
from maxent_arrow.store.names import GROUPS, STEPS, STORE_META_KEY, UNIT_META_KEY
from maxent_arrow.store.parquet import group_file_settings, parquet_bytes, write_parquet
from maxent_arrow.store.schemas import schema_key

__all__ = ["commit_unit", "group_file_meta", "step_file_bytes", "write_group_file"]


def write_group_file(
    backend: Backend,
    final: str,
    table: pa.Table,
    metadata: dict[bytes, bytes],
    *,
    compression: str,
    compression_level: int | None,
) -> Pending:
    """Encode ``table`` as the group file ``final`` (relative path) into a durable temp file,
    with the group files' Parquet settings (:func:`.parquet.group_file_settings`)."""
    return backend.write_temp(
        final,
        produce=lambda sink: write_parquet(
            sink,
            table,
            metadata,
            **group_file_settings(table.schema),
            compression=compression,
            compression_level=compression_level,
        ),
    )


def group_file_meta(backend: Backend, pending: Pending, **extra: Any) -> dict[str, Any]:
    """What a step file records of its group file: name, size, CRC-32, chunk CRCs and the key
    of its schema (files of one schema are read as one set, with one footer read)."""
    with backend.open_pending(pending) as source:
        metadata = pq.read_metadata(source)

        def read_range(offset: int, length: int) -> bytes:
            return source.read_at(length, offset)

        chunks = chunk_crcs(metadata, pending.size, pending.boundaries, read_range)
    name = pending.final.rsplit("/", 1)[-1]
    return {
        "group_file": name,
        "group_size": pending.size,
        "group_crc32": pending.crc,
        "schema_key": schema_key(metadata.schema.to_arrow_schema()),
        "chunks": chunks,
        **extra,
    }


def step_file_bytes(step_rows: pa.Table, meta: dict[str, Any]) -> bytes:
    """A sealed step file: the step rows, with the store metadata (and the rows again, as
    JSON, for the catalog) in the file metadata."""
    meta = {**meta, "rows": step_rows_json(step_rows)}
    return parquet_bytes(
        step_rows,
        {STORE_META_KEY: json.dumps(meta).encode(), S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
        statistics=["step", "rank"],
        sealed=True,
    )


def commit_unit(
    backend: Backend,
    name: str,
    groups: pa.Table,
    group_metadata: dict[bytes, bytes],
    step_rows: pa.Table,
    record: dict[str, Any],
    *,
    check: Callable[[], None],
    operation: str,
    compression: str,
    compression_level: int | None,
    run: str | None = None,
    lock_timeout: float | None = None,
) -> Pending:
    """Write and commit the unit ``name``: its group file (``groups``, with
    ``group_metadata`` in the Parquet footer) and its step file (``step_rows``, with
    ``record`` beside what :func:`group_file_meta` records, and the unit's own name and
    ``run``, the store's run identity, in both files). ``lock_timeout``: seconds to wait
    for the store lock (``None``: as long as it takes). ``check`` raises when the commit
    must not happen; it runs once before anything is written and again under the lock.
    Returns the committed group file's pending record (its size and CRC-32). Raises
    (:class:`StoreError`, ``OSError`` as ``StoreError``) with the store as it was."""
    check()  # early and cheap: refuse before encoding anything
    # Who this unit is, in both files: a step file names its unit and run (readers refuse a
    # copy under another name or from another run), and a group file whose step file is
    # lost still says what it is (verify: a suspected lost commit).
    identity = {"unit": name, **({} if run is None else {"run": run})}
    record = {**record, **identity}
    group_metadata = {**group_metadata, UNIT_META_KEY: json.dumps(identity).encode()}
    group = write_group_file(
        backend,
        f"{GROUPS}/{name}",
        groups,
        group_metadata,
        compression=compression,
        compression_level=compression_level,
    )
    crash_point(f"{operation}:group-written")
    try:
        meta = group_file_meta(backend, group, **record)
        step = backend.write_temp(f"{STEPS}/{name}", step_file_bytes(step_rows, meta))
    except BaseException:
        backend.discard(group)
        raise
    crash_point(f"{operation}:step-written")
    try:
        with backend.lock(lock_timeout):
            check()
            crash_point(f"{operation}:locked")
            backend.publish(group, exclusive=False)
            crash_point(f"{operation}:group-published")
            try:
                backend.publish(step, exclusive=True)
            except BaseException:
                # Not committed: remove the group file so the store is as it was, where it
                # is certainly ours (under the lock). Without a lock (object storage) a
                # refused step object means another writer committed this name, and the
                # group object may be the one it committed.
                if backend.can_lock:
                    with contextlib.suppress(OSError, StoreError):
                        backend.remove(f"{GROUPS}/{name}")
                raise
    finally:
        backend.discard(group)  # no-ops once published
        backend.discard(step)
    crash_point(f"{operation}:committed")
    return group
