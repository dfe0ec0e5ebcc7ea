"""``append``: one step of one rank, checked, then written and committed by the one commit
function (:func:`~.commit.commit_unit`, the protocol of ``docs/commit-protocol.md``).

Before anything is written, the batch is refused when its (step, rank, kind) is already
committed (also inside a compacted segment; checked again under the lock) or a column's type
conflicts with the store's. After the commit, the optional IPC cache copy (never part of a
commit).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError, StoreError
from maxent_arrow.rollout import BATCH_META_KEY, RolloutBatch
from maxent_arrow.store.history.attempts import AttemptSpec, attempt_entry
from maxent_arrow.store.history.catalog import Catalog, LogCatalog
from maxent_arrow.store.history.log import LogState
from maxent_arrow.store.history.records import commit_records, prepare_records
from maxent_arrow.store.history.schemas import UnifiedSchemas
from maxent_arrow.store.io.cache import write_cache
from maxent_arrow.store.io.commit import commit_unit
from maxent_arrow.store.storage.names import CONFIG_META_KEY, STEPS, unit_name
from maxent_arrow.store.storage.padding import pad_to_layout

__all__ = ["Writer"]


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
        lock_timeout: float | None = None,
        attempt: AttemptSpec | None = None,
    ):
        self.catalog = catalog
        self.log = catalog.log if isinstance(catalog, LogCatalog) else None
        self.attempt = attempt or AttemptSpec()
        self._begun: str | None = None
        self.committed = 0  # commits made through this writer (appends and records)
        self.lock_timeout = lock_timeout
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
        families = self._run_families(batch)
        attempt = self.begin_attempt()
        committed = commit_unit(
            self.backend,
            name,
            pad_to_layout(pa.Table.from_batches([batch.groups]), S.group_schema(families=families)),
            self._group_metadata(batch),
            pad_to_layout(
                pa.Table.from_batches([batch.step_row]), S.step_schema(families=families)
            ),
            {
                "reward_names": _reward_names(batch.groups),
                # the rest is padding (store/storage/padding.py)
                "columns": batch.groups.schema.names,
                "families": list(families),
            },
            check=lambda state: self._refuse_duplicate(name, batch, state),
            operation="append",
            compression=self.compression,
            compression_level=self.compression_level,
            run=self.catalog.run_id,
            lock_timeout=self.lock_timeout,
            log=self.log,
            attempt=attempt or "",
        )
        self.committed += 1
        if self.cache and self.backend.can_mmap:
            try:
                write_cache(self.backend, batch, name, committed.group.crc)
            except (OSError, StoreError) as exc:
                warnings.warn(
                    f"step {name} is committed but its IPC cache copy failed: {exc}", stacklevel=3
                )
        return self.backend.path(f"{STEPS}/{committed.name}")

    def append_records(self, name: str, rows: Any) -> int:
        """Append ``rows`` to record table ``name`` (:mod:`~maxent_arrow.store.history.records`) as
        this writer's attempt; returns the log version that committed them."""
        table = prepare_records(name, rows)
        if self.log is None:
            raise StoreError(
                f"{self.backend.uri}: a store written before the commit log (format < 3) keeps "
                f"no record tables; records of {name!r} need a store of this version"
            )
        attempt = self.begin_attempt()
        version = commit_records(
            self.backend,
            self.log,
            name,
            table,
            attempt=attempt or "",
            lock_timeout=self.lock_timeout,
            compression=self.compression,
        )
        self.committed += 1
        return version

    def begin_attempt(self, *, config: Mapping[str, Any] | None = None) -> str | None:
        """Record this writer's attempt in the commit log, once (a store without a log has no
        attempts: ``None``). A fresh run into a store that holds an earlier run's steps is
        refused here (:func:`~maxent_arrow.store.history.attempts.attempt_entry`)."""
        if self.log is None:
            return None
        if self._begun is not None:
            return self._begun
        spec = self.attempt
        if config is not None:
            spec.config = dict(config)
        uri = self.backend.uri

        def begin(state: LogState) -> bool | None:
            entry = attempt_entry(spec, state, uri)
            if entry is None:
                return False  # begun already (another rank of the launch, or before)
            fields.update(entry)
            return None

        # The entry is made from the newest state, under the lock: `begin` fills `fields`,
        # which the log reads after the check has run.
        fields: dict[str, Any] = {}
        self.log.commit(fields, check=begin, lock_timeout=self.lock_timeout)
        self._begun = spec.id
        return spec.id

    def _run_families(self, batch: RolloutBatch) -> tuple[str, ...]:
        """The run's layout families: the store's (fixed at its first append), which must
        hold every family the batch has; the batch's own for the first append."""
        mine = batch.families
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a damaged file is verify's to report
            run = self.schemas.families("skip")
        if run is None:
            return mine
        extra = [f for f in mine if f not in run]
        if extra:
            own = sorted(
                c.name
                for c in R.columns(R.GROUP)
                if c.name in batch.groups.schema.names and not c.in_layout(run)
            )
            raise SchemaError(
                f"append of step {batch.step} to {self.backend.uri}: the batch has columns of "
                f"the {', '.join(extra)} layout ({', '.join(own) or 'declared'}), but this run's "
                f"layout, fixed at its first append, is {', '.join(run)}; a run keeps one "
                "layout (write it to a store of its own)"
            )
        return run

    def _refuse_duplicate(self, name: str, batch: RolloutBatch, state: LogState | None) -> None:
        """Refuse a (step, rank, kind) the store holds already: in a store with a commit
        log, as effective history (a superseded write of a resumed run's step is no
        duplicate); else as any committed step file."""
        if state is None:
            names = self.catalog.step_names()
            taken = name in names or name in self.catalog.hidden(names, "skip")
        else:
            taken = any(
                state.is_effective(batch.step, e.attempt, batch.kind)
                for e in state.writes_of(batch.step, batch.rank, batch.kind)
            )
        if taken:
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

    @staticmethod
    def _group_metadata(batch: RolloutBatch) -> dict[bytes, bytes]:
        """A group file's footer metadata: the schema version, the run config (a lone group
        file is self-describing) and the batch's own metadata (seed dtypes and flags)."""
        meta = {
            S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
            CONFIG_META_KEY: (batch.step_row.column("config")[0].as_py() or "{}").encode()
            if "config" in batch.step_row.schema.names
            else b"{}",
        }
        raw = (batch.groups.schema.metadata or {}).get(BATCH_META_KEY)
        if raw:
            meta[BATCH_META_KEY] = raw
        return meta
