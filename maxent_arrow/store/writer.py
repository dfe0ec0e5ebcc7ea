"""``append``: one step of one rank, written durably and committed atomically.

The commit protocol (``docs/commit-protocol.md``):

1. refuse a (step, rank, kind) already committed (also inside a compacted segment) and a
   column whose type conflicts with the store's;
2. encode the group file into a temp file (hidden, not ``*.parquet``) while a writer thread
   writes and checksums the bytes; fsync. The slow part runs outside any lock, so ranks
   appending at once only serialise on step 4;
3. write the step file (the step row, and in its metadata the group file's size, CRC-32,
   footer and column-chunk CRCs) into a temp file, sealed with its own CRC; fsync;
4. under the store lock (local stores): check again for a duplicate, rename the group file
   into place, then link the step file into place (refusing an existing one). The step
   file's appearance is the commit; if linking it fails the group file is removed again.
   On object stores each file is one PUT, group first, step last (one writer per rank).

A crash before step 4's link leaves nothing a reader of this library sees (temp files and at
most an uncommitted group file, which ``repair`` moves to ``quarantine/``); after it, the
whole step. ``crash_point`` names each stage for the kill tests.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError, StoreError
from maxent_arrow.rollout import BATCH_META_KEY, RolloutBatch
from maxent_arrow.store.backend import Backend, Pending, crash_point
from maxent_arrow.store.cache import write_cache
from maxent_arrow.store.catalog import Catalog, step_rows_json
from maxent_arrow.store.checksums import chunk_crcs
from maxent_arrow.store.layout import CONFIG_META_KEY, GROUPS, STEPS, STORE_META_KEY, unit_name
from maxent_arrow.store.padding import pad_to_layout
from maxent_arrow.store.parquet import group_file_settings, parquet_bytes, write_parquet
from maxent_arrow.store.schemas import UnifiedSchemas, schema_key

__all__ = ["Writer", "group_file_meta", "step_file_bytes"]


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


def _reward_names(groups: pa.RecordBatch | pa.Table) -> list[str]:
    if "reward_names" not in groups.schema.names:
        return []
    column = groups.column("reward_names")
    return sorted({n for n in column.flatten().unique().to_pylist() if n is not None})


class Writer:
    """Appends to one store."""

    def __init__(
        self,
        catalog: Catalog,
        schemas: UnifiedSchemas,
        *,
        compression: str,
        compression_level: int | None,
        cache: bool,
    ):
        self.catalog = catalog
        self.backend = catalog.backend
        self.schemas = schemas
        self.compression = compression
        self.compression_level = compression_level
        self.cache = cache

    def append(self, batch: RolloutBatch) -> Any:
        if not isinstance(batch, RolloutBatch):
            raise SchemaError(
                f"RolloutStore.append: expected a RolloutBatch, got {type(batch).__name__}"
            )
        name = unit_name(batch.step, batch.rank, batch.kind)
        version = (batch.groups.schema.metadata or {}).get(S.METADATA_KEY)
        S.check_version(version or S.SCHEMA_VERSION.encode(), where=f"batch for {name}")
        self._check_conflicts(batch)
        self._refuse_duplicate(name, batch)  # early and cheap; again under the lock
        group = self.backend.write_temp(
            f"{GROUPS}/{name}", produce=lambda sink: self._write_groups(batch, sink)
        )
        crash_point("append:group-written")
        try:
            meta = group_file_meta(
                self.backend,
                group,
                reward_names=_reward_names(batch.groups),
                columns=batch.groups.schema.names,  # the rest is padding (store/padding.py)
            )
            step_rows = pad_to_layout(pa.Table.from_batches([batch.step_row]), S.step_schema())
            step_bytes = step_file_bytes(step_rows, meta)
            step = self.backend.write_temp(f"{STEPS}/{name}", step_bytes)
        except BaseException:
            self.backend.discard(group)
            raise
        crash_point("append:step-written")
        try:
            self._commit(name, batch, group, step)
        finally:
            self.backend.discard(group)  # no-ops once committed
            self.backend.discard(step)
        crash_point("append:committed")
        if self.cache and self.backend.local:
            try:
                write_cache(self.backend, batch, name, group.crc)
            except (OSError, StoreError) as exc:
                warnings.warn(
                    f"step {name} is committed but its IPC cache copy failed: {exc}", stacklevel=3
                )
        return self.backend.path(f"{STEPS}/{name}")

    def _commit(self, name: str, batch: RolloutBatch, group: Pending, step: Pending) -> None:
        with self.backend.lock():
            self._refuse_duplicate(name, batch)
            self.backend.publish(group, exclusive=False)
            crash_point("append:group-published")
            try:
                self.backend.publish(step, exclusive=True)
            except BaseException:
                # Not committed: remove the group file so the store is as it was.
                with contextlib.suppress(OSError, StoreError):
                    self.backend.remove(f"{GROUPS}/{name}")
                raise

    def _refuse_duplicate(self, name: str, batch: RolloutBatch) -> None:
        names = self.catalog.step_names()
        if name in names or name in self.catalog.hidden(names, "skip"):
            raise StoreError(
                f"{self.backend.path(f'{STEPS}/{name}')}: step {batch.step} of rank "
                f"{batch.rank} ({batch.kind}) is already in the store; each (step, rank, kind) "
                "is appended once"
            )

    def _check_conflicts(self, batch: RolloutBatch) -> None:
        for table, schema in (("groups", batch.groups.schema), ("steps", batch.step_row.schema)):
            # A damaged file must not block appends; verify() reports it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                current = self.schemas.get(table, "skip")
            try:
                S.unify_schemas(
                    [current, schema],
                    where=f"append of step {batch.step} to {self.backend.path(table)}",
                )
            except SchemaError as exc:
                raise SchemaError(f"{exc}; the store's files keep the first type") from None

    def _write_groups(self, batch: RolloutBatch, sink) -> None:
        meta = {
            S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
            CONFIG_META_KEY: (batch.step_row.column("config")[0].as_py() or "{}").encode()
            if "config" in batch.step_row.schema.names
            else b"{}",
        }
        raw = (batch.groups.schema.metadata or {}).get(BATCH_META_KEY)
        if raw:
            meta[BATCH_META_KEY] = raw
        table = pad_to_layout(pa.Table.from_batches([batch.groups]), S.group_schema())
        write_parquet(
            sink,
            table,
            meta,
            **group_file_settings(table.schema),
            compression=self.compression,
            compression_level=self.compression_level,
        )
