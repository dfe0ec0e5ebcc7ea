"""The commit: the one function that makes a group file and its step file part of the store.

Append (:mod:`.writer`) and compaction (:mod:`~maxent_arrow.store.upkeep.compaction`) both end in
:func:`commit_unit`,
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

**Stores with a commit log** (format 3, :mod:`~maxent_arrow.store.history.log`): steps 1 and 2 as
above, under a file name of the commit's own (the unit's name and a token), so no other writer's
file can be overwritten and no lock is needed to publish; 3. both files are published (exclusively),
then the commit is the log's next entry, created exclusively after the precondition is
checked again against the log's newest state. A refused or failed entry removes the two
files again. A crash before the entry leaves files no entry names (leftovers ``repair``
moves aside); after it, the whole unit. Stages: ``group-published``, ``step-published``,
``log:entry-written``, ``committed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import step_rows_json
from maxent_arrow.store.history.log import CommitLog, LogState
from maxent_arrow.store.history.schemas import schema_key
from maxent_arrow.store.storage.backend import Backend, Pending, crash_point
from maxent_arrow.store.storage.checksums import CHUNK_ALGORITHM, chunk_crcs
from maxent_arrow.store.storage.names import (
    GROUPS,
    STEPS,
    STORE_META_KEY,
    UNIT_META_KEY,
    with_token,
)
from maxent_arrow.store.storage.parquet import group_file_settings, parquet_bytes, write_parquet

__all__ = ["Committed", "commit_unit", "group_file_meta", "step_file_bytes", "write_group_file"]


def write_group_file(
    backend: Backend,
    final: str,
    table: pa.Table,
    metadata: dict[bytes, bytes],
    *,
    compression: str,
    compression_level: int | None,
    row_groups: Sequence[int] | None = None,
) -> Pending:
    """Encode ``table`` as the group file ``final`` (relative path) into a durable temp file,
    with the group files' Parquet settings
    (:func:`~maxent_arrow.store.storage.parquet.group_file_settings`) and
    ``row_groups`` (row counts; default one row group)."""
    return backend.write_temp(
        final,
        produce=lambda sink: write_parquet(
            sink,
            table,
            metadata,
            **group_file_settings(table.schema),
            compression=compression,
            compression_level=compression_level,
            row_groups=row_groups,
        ),
    )


def group_file_meta(backend: Backend, pending: Pending, **extra: Any) -> dict[str, Any]:
    """What a step file records of its group file: name, size, CRC-32, chunk CRCs and the key
    of its schema (files of one schema are read as one set, with one footer read)."""
    with backend.open_pending(pending) as source:
        metadata = pq.read_metadata(source)

        def read_range(offset: int, length: int) -> bytes:
            return source.read_at(length, offset)

        # CRC32C from the writer's running CRC32C at each write boundary (a write whose
        # boundaries were not kept: CRC-32, as before).
        if pending.boundaries_c:
            chunks = chunk_crcs(
                metadata, pending.size, pending.boundaries_c, read_range, CHUNK_ALGORITHM
            )
        else:
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


@dataclasses.dataclass(frozen=True)
class Committed:
    """What :func:`commit_unit` committed: the file name of its group and step files (the
    unit's name, with a token of its own in a store with a commit log), the group file's
    pending record (size, CRC-32) and the log version (``None`` without a log)."""

    name: str
    group: Pending
    version: int | None = None


def commit_unit(
    backend: Backend,
    name: str,
    groups: pa.Table,
    group_metadata: dict[bytes, bytes],
    step_rows: pa.Table,
    record: dict[str, Any],
    *,
    check: Callable[[LogState | None], None],
    operation: str,
    compression: str,
    compression_level: int | None,
    run: str | None = None,
    lock_timeout: float | None = None,
    log: CommitLog | None = None,
    attempt: str = "",
    replaces: Sequence[str] = (),
    locked: bool = False,
    row_groups: Sequence[int] | None = None,
) -> Committed:
    """Write and commit the unit ``name``: its group file (``groups``, with
    ``group_metadata`` in the Parquet footer) and its step file (``step_rows``, with
    ``record`` beside what :func:`group_file_meta` records, and the unit's own name and
    ``run``, the store's run identity, in both files). ``lock_timeout``: seconds to wait
    for the store lock (``None``: as long as it takes).

    ``check(state)`` raises when the commit must not happen; it runs once before anything
    is written and again at the commit: under the lock, with the log's newest state
    (``None`` without a log). With a ``log`` the files get a name of their own
    (:func:`~maxent_arrow.store.storage.names.with_token`), the commit is the log's next entry
    (written by ``attempt``; a compaction's ``replaces`` its inputs' step files) and a refused
    commit removes its own files. ``locked``: the caller holds the store lock (``repair``).
    ``row_groups``: the group file's row groups (row counts; a segment keeps one per unit). Raises
    (:class:`StoreError`, ``OSError`` as ``StoreError``) with the store as it was."""
    if log is not None:
        name = with_token(name)
    check(None if log is None else log.state())  # early and cheap: refuse before encoding
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
        row_groups=row_groups,
    )
    crash_point(f"{operation}:group-written")
    try:
        meta = group_file_meta(backend, group, **record)
        step = backend.write_temp(f"{STEPS}/{name}", step_file_bytes(step_rows, meta))
    except BaseException:
        backend.discard(group)
        raise
    crash_point(f"{operation}:step-written")
    if log is not None:
        version = _commit_to_log(
            backend, log, name, group, step, meta, step_rows, check, operation, attempt,
            replaces, lock_timeout, locked,
        )  # fmt: skip
        crash_point(f"{operation}:committed")
        return Committed(name, group, version)
    try:
        with contextlib.nullcontext() if locked else backend.lock(lock_timeout):
            check(None)
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
    return Committed(name, group)


def _commit_to_log(
    backend: Backend,
    log: CommitLog,
    name: str,
    group: Pending,
    step: Pending,
    meta: dict[str, Any],
    step_rows: pa.Table,
    check: Callable[[LogState | None], None],
    operation: str,
    attempt: str,
    replaces: Sequence[str],
    lock_timeout: float | None,
    locked: bool,
) -> int:
    """Publish the unit's files (names of their own) and commit them as the log's next
    entry; a refused or failed commit removes them again (they are certainly ours), so the
    store is as it was. The files are published at the commit, under the store lock where
    the backend has one: ``repair`` (which holds it) never sees a published file that no
    entry names yet as anything but a leftover of a writer that is gone."""
    entry = {
        "op": operation,
        "attempt": attempt,
        "step_file": f"{STEPS}/{name}",
        "step_size": step.size,
        "step_crc32": step.crc,
        # The commit record, as the step file holds it, and its rows: readers read the log,
        # never the step files (plain readers do).
        "record": {
            **meta,
            "rows": step_rows_json(step_rows),
            "schema_version": S.SCHEMA_VERSION,
        },
        "replaces": [f"{STEPS}/{r}" for r in replaces],
    }
    published = False

    def at_commit(state: LogState) -> None:
        nonlocal published
        check(state)
        if not published:
            crash_point(f"{operation}:locked")  # checked at the commit, nothing published
            backend.publish(group, exclusive=True)
            crash_point(f"{operation}:group-published")
            backend.publish(step, exclusive=True)
            published = True
            crash_point(f"{operation}:step-published")

    try:
        version = log.commit(entry, check=at_commit, lock_timeout=lock_timeout, locked=locked)
        assert version is not None  # at_commit never declines
        return version
    except BaseException:
        # Our files go again unless the entry made it (an interrupt just after its creation):
        # a leftover is harmless, removing a committed file is a loss.
        with contextlib.suppress(Exception):
            if f"{STEPS}/{name}" not in log.state().units:
                for rel in (f"{GROUPS}/{name}", f"{STEPS}/{name}"):
                    backend.remove(rel)
        raise
    finally:
        backend.discard(group)
        backend.discard(step)
