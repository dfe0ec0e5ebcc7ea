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
from maxent_arrow.store.history.catalog import Catalog
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import AppendUnit
from maxent_arrow.store.history.records import commit_records, prepare_records
from maxent_arrow.store.history.schemas import UnifiedSchemas
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.io.cache import write_cache
from maxent_arrow.store.io.commit import CommitRequest, UnitFiles, WriteSettings, commit_unit
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
        settings: WriteSettings,
        *,
        cache: bool,
        attempt: AttemptSpec | None = None,
    ):
        self.catalog = catalog
        self.attempt = attempt or AttemptSpec()
        self._begun: str | None = None
        self.committed = 0  # commits made through this writer (appends and records)
        self.settings = settings
        self.lock_timeout = settings.lock_timeout
        self.backend = catalog.backend
        self.schemas = schemas
        self.cache = cache

    def append(self, batch: RolloutBatch) -> Any:
        if not isinstance(batch, RolloutBatch):
            raise SchemaError(
                f"RolloutStore.append: expected a RolloutBatch, got {type(batch).__name__}"
            )
        name = unit_name(batch.step, batch.rank, batch.kind)
        version = (batch.groups.schema.metadata or {}).get(S.METADATA_KEY)
        S.check_version(version or S.SCHEMA_VERSION.encode(), where=f"batch for {name}")
        log = self.catalog.writable("append")
        self._check_conflicts(batch)
        families = self._run_families(batch)
        unit = UnitFiles(
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
        )
        request = CommitRequest(
            AppendUnit,
            self.begin_attempt(),
            lambda state: self._refuse_duplicate(name, batch, state),
            self.settings,
        )
        committed = commit_unit(log, unit, request)
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
        log = self.catalog.writable(f"records of {name!r}")
        table = prepare_records(name, rows)
        attempt = self.begin_attempt()
        version = commit_records(
            self.backend,
            log,
            name,
            table,
            attempt=attempt,
            lock_timeout=self.lock_timeout,
            compression=self.settings.compression,
        )
        self.committed += 1
        return version

    def begin_attempt(self, *, config: Mapping[str, Any] | None = None) -> str:
        """Record this writer's attempt in the commit log, once. A fresh run into a store
        that holds an earlier run's steps is refused here
        (:func:`~maxent_arrow.store.history.attempts.attempt_entry`); so is a store without a
        commit log (:class:`~maxent_arrow.errors.ReadOnlyFormatError`)."""
        if self._begun is not None:
            return self._begun
        log: CommitLog = self.catalog.writable("a new attempt")
        spec = self.attempt
        if config is not None:
            spec.config = dict(config)
        uri = self.backend.uri
        # The entry is made from the newest state, under the lock (``None``: begun already,
        # by another rank of the launch or before).
        log.commit(
            lambda state: attempt_entry(spec, state, uri),
            attempt=spec.id,
            lock_timeout=self.lock_timeout,
        )
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

    def _refuse_duplicate(self, name: str, batch: RolloutBatch, state: LogState) -> None:
        """Refuse a (step, rank, kind) the store holds already as effective history (a
        superseded write of a resumed run's step is no duplicate)."""
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
