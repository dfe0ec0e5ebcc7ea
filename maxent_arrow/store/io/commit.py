"""The commit: the one function that makes a group file and its step file part of the store.

Append (:mod:`.writer`), compaction (:mod:`~maxent_arrow.store.upkeep.compaction`) and
repair's restore (:mod:`~maxent_arrow.store.upkeep.repair`) all end in :func:`commit_unit`,
so the protocol of ``docs/commit-protocol.md`` is written once:

1. the group file is encoded into a temp file (hidden, never ``*.parquet``) while a writer
   thread writes and checksums the bytes (:func:`write_group_file`); fsynced. This runs
   outside any lock, so writers committing at once serialise only on step 3;
2. the step file (the step rows, and in its metadata the group file's size, CRC-32, footer
   and column-chunk CRCs, :func:`group_file_meta`) is written into a temp file, sealed with
   its own CRC-32 (:func:`step_file_bytes`); fsynced. Both under a file name of the commit's
   own (the unit's name and a token), so no other writer's file is ever overwritten;
3. at the commit (under the store lock where the backend has one) the caller's precondition
   is checked against the log's newest state (no duplicate step; the inputs of a compaction
   still committed), both files are published exclusively, and the commit is the log's next
   entry (:class:`~maxent_arrow.store.history.operations.UnitOperation`), created exclusively.
   A refused or failed entry removes the two files again.

A crash before the entry leaves files no entry names (leftovers ``repair`` moves aside);
after it, the whole unit. The stages are crash points of the registry
(:data:`~maxent_arrow.store.storage.crashpoints.CRASH_POINTS`): ``{op}:group-written``,
``step-written``, ``locked``, ``group-published``, ``step-published``, then
``log:entry-written`` and ``{op}:committed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.store.history.catalog import step_rows_json
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import UnitOperation
from maxent_arrow.store.history.schemas import schema_key
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.storage.backend import Backend, Pending
from maxent_arrow.store.storage.checksums import CHUNK_ALGORITHM, chunk_crcs
from maxent_arrow.store.storage.crashpoints import crash_point
from maxent_arrow.store.storage.names import (
    GROUPS,
    STEPS,
    STORE_META_KEY,
    UNIT_META_KEY,
    with_token,
)
from maxent_arrow.store.storage.parquet import (
    ParquetLayout,
    group_file_layout,
    parquet_bytes,
    write_parquet,
)

__all__ = [
    "CommitRequest",
    "Committed",
    "UnitFiles",
    "WriteSettings",
    "commit_unit",
    "group_file_meta",
    "step_file_bytes",
    "write_group_file",
]


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
    with the group files' Parquet layout
    (:func:`~maxent_arrow.store.storage.parquet.group_file_layout`) and
    ``row_groups`` (row counts; default one row group)."""
    groups = None if row_groups is None else tuple(row_groups)
    layout = group_file_layout(table.schema, compression, compression_level, groups)
    produce = functools.partial(write_parquet, table=table, metadata=metadata, layout=layout)
    return backend.write_temp(final, produce=produce)


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


def step_file_bytes(
    step_rows: pa.Table, meta: dict[str, Any], rows: dict[str, list] | None = None
) -> bytes:
    """A sealed step file: the step rows, with the store metadata (and the rows again, as
    JSON, for the catalog: ``rows``, made from ``step_rows`` when not given) in the file
    metadata."""
    meta = {**meta, "rows": step_rows_json(step_rows) if rows is None else rows}
    return parquet_bytes(
        step_rows,
        {STORE_META_KEY: json.dumps(meta).encode(), S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
        STEP_FILE_LAYOUT,
    )


# Step files: statistics on the unit's key, sealed with their own CRC-32.
STEP_FILE_LAYOUT = ParquetLayout(statistics=("step", "rank"), sealed=True)


@dataclasses.dataclass(frozen=True)
class UnitFiles:
    """What a commit writes: the unit ``name``'s group rows (``groups``, with
    ``group_metadata`` in the Parquet footer, in ``row_groups``: row counts, default one row
    group) and its step rows (``step_rows``), with ``record`` beside what
    :func:`group_file_meta` records in the step file."""

    name: str
    groups: pa.Table
    group_metadata: dict[bytes, bytes]
    step_rows: pa.Table
    record: dict[str, Any]
    row_groups: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class WriteSettings:
    """How a writer writes: the Parquet codec of its group files and its level (kept only
    for codecs that have one), and the seconds it waits for the store lock (``None``: as
    long as it takes)."""

    compression: str = "zstd"
    compression_level: int | None = 1
    lock_timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class CommitRequest:
    """How a unit is committed: as which operation (``AppendUnit``, ``CompactUnits``,
    ``RestoreUnit``), by which attempt, under which precondition (``check(state)`` raises
    when the commit must not happen: it runs once before anything is written and again at
    the commit, with the log's newest state), with which settings, replacing which step
    files (names); ``locked``: the caller holds the store lock already (``repair``)."""

    operation: type[UnitOperation]
    attempt: str
    check: Callable[[LogState], None]
    settings: WriteSettings = WriteSettings()
    replaces: tuple[str, ...] = ()
    locked: bool = False


@dataclasses.dataclass(frozen=True)
class Committed:
    """What :func:`commit_unit` committed: the file name of its group and step files (the
    unit's name with a token of its own), the group file's pending record (size, CRC-32) and
    the log version."""

    name: str
    group: Pending
    version: int


def commit_unit(log: CommitLog, unit: UnitFiles, request: CommitRequest) -> Committed:
    """Write and commit ``unit`` through ``log`` as ``request`` says (the module docstring):
    its files get a name of their own (:func:`~maxent_arrow.store.storage.names.with_token`),
    the unit's own name and the store's run in both, and the commit is the log's next entry.
    Raises (:class:`StoreError`, ``OSError`` as ``StoreError``) with the store as it was."""
    backend, op = log.backend, request.operation.OP
    name = with_token(unit.name)
    request.check(log.state())  # early and cheap: refuse before encoding
    # Who this unit is, in both files: a step file names its unit and run (readers refuse a
    # copy under another name or from another run), and a group file whose step file is
    # lost still says what it is (verify: a suspected lost commit).
    identity = {"unit": name, **({} if log.run is None else {"run": log.run})}
    record = {**unit.record, **identity}
    group = write_group_file(
        backend,
        f"{GROUPS}/{name}",
        unit.groups,
        {**unit.group_metadata, UNIT_META_KEY: json.dumps(identity).encode()},
        compression=request.settings.compression,
        compression_level=request.settings.compression_level,
        row_groups=unit.row_groups,
    )
    crash_point(f"{op}:group-written")
    rows = step_rows_json(unit.step_rows)
    try:
        meta = group_file_meta(backend, group, **record)
        step = backend.write_temp(f"{STEPS}/{name}", step_file_bytes(unit.step_rows, meta, rows))
    except BaseException:
        backend.discard(group)
        raise
    crash_point(f"{op}:step-written")
    operation = request.operation(
        f"{STEPS}/{name}",
        # The commit record, as the step file holds it, and its rows: readers read the log,
        # never the step files (plain readers do).
        {**meta, "rows": rows, "schema_version": S.SCHEMA_VERSION},
        step.size,
        step.crc,
        tuple(f"{STEPS}/{r}" for r in request.replaces) if request.replaces else (),
    )
    published = False

    def at_commit(state: LogState) -> None:
        # The files are published at the commit, under the store lock where the backend has
        # one: ``repair`` (which holds it) never sees a published file that no entry names
        # yet as anything but a leftover of a writer that is gone.
        nonlocal published
        request.check(state)
        if not published:
            crash_point(f"{op}:locked")  # checked at the commit, nothing published
            backend.publish(group, exclusive=True)
            crash_point(f"{op}:group-published")
            backend.publish(step, exclusive=True)
            published = True
            crash_point(f"{op}:step-published")

    try:
        version = log.commit(
            operation,
            attempt=request.attempt,
            check=at_commit,
            lock_timeout=request.settings.lock_timeout,
            locked=request.locked,
        )
        assert version is not None  # an operation is always committed (or refused)
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
    crash_point(f"{op}:committed")
    return Committed(name, group, version)
