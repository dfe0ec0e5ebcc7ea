"""``append``: one step of one rank, checked, then written and committed by the one commit
function (:func:`~.commit.commit_unit`, the protocol of ``docs/commit-protocol.md``).

Before anything is written, the batch is refused when its (step, rank, kind) is already
committed (also inside a compacted segment; checked again under the lock) or a column's type
conflicts with the store's. After the commit, the unit's take file and the optional IPC cache
copy (derived data, never part of a commit).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Mapping
from typing import Any, cast

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError, StoreError
from maxent_arrow.rollout import BATCH_META_KEY, RolloutBatch
from maxent_arrow.store.history.attempts import AttemptSpec, attempt_entry
from maxent_arrow.store.history.catalog import Catalog
from maxent_arrow.store.history.log import CommitLog, HoldsLock
from maxent_arrow.store.history.operations import AppendUnit
from maxent_arrow.store.history.records import commit_records, prepare_records
from maxent_arrow.store.history.schemas import UnifiedSchemas
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.io.cache import write_cache
from maxent_arrow.store.io.commit import CommitRequest, UnitFiles, WriteSettings, commit_unit
from maxent_arrow.store.io.take import write_take
from maxent_arrow.store.storage.names import CONFIG_META_KEY, STEPS, unit_name
from maxent_arrow.store.storage.padding import pad_to_layout

__all__ = ["Writer"]

CURRENT = S.SCHEMA_VERSION.encode()


def _reward_names(groups: pa.RecordBatch | pa.Table) -> list[str]:
    if "reward_names" not in groups.schema.names:
        return []
    column = groups.column("reward_names")
    return sorted(set(column.flatten().unique().to_pylist()) - {None})


@dataclasses.dataclass
class _Seen:
    """The store as a writer saw it at log ``version``: its unified group and step schemas,
    its layout families (``None``: nothing committed yet) and their padded layouts; and the
    schemas of the batch last appended with this view (``None``: none), since a batch of the
    same schemas unifies to the same (a run appends one schema again and again)."""

    version: int
    groups: pa.Schema
    steps: pa.Schema
    families: tuple[str, ...] | None
    layouts: tuple[pa.Schema, pa.Schema] | None = None
    batch: tuple[pa.Schema, pa.Schema] | None = None


class Writer(HoldsLock):
    """Appends to one store."""

    def __init__(
        self,
        catalog: Catalog,
        schemas: UnifiedSchemas,
        settings: WriteSettings,
        *,
        cache: bool,
        take: bool = True,
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
        self.take = take
        self._seen: _Seen | None = None
        self._log: CommitLog | None = None
        # One commit of this writer at a time (the replay sampler's lifecycle records commit
        # from a thread of their own; re-entrant: an append begins its attempt).
        self._lock = threading.RLock()

    def append(self, batch: RolloutBatch) -> Any:
        with self._lock:
            if not isinstance(batch, RolloutBatch):
                raise SchemaError(
                    f"RolloutStore.append: expected a RolloutBatch, got {type(batch).__name__}"
                )
            key = batch.unit
            name = unit_name(*key)
            version = (batch.groups.schema.metadata or {}).get(S.METADATA_KEY)
            if version not in (None, CURRENT):  # (this library's own version needs no check)
                S.check_version(version, where=f"batch for {name}")
            log = self._log or self.catalog.writable("append")
            self._log = log
            seen, view = self._view(batch, log.state().version)
            families = cast(tuple[str, ...], view.families)
            layouts = cast(tuple[pa.Schema, pa.Schema], view.layouts)
            unit = UnitFiles(
                name,
                pad_to_layout(pa.Table.from_batches([batch.groups]), layouts[0]),
                self._group_metadata(batch),
                pad_to_layout(pa.Table.from_batches([batch.step_row]), layouts[1]),
                {
                    "reward_names": _reward_names(batch.groups),
                    # the rest is padding (store/storage/padding.py)
                    "columns": batch.groups.schema.names,
                    "families": list(families),
                },
            )
            request = CommitRequest(
                AppendUnit,
                self._begun or self.begin_attempt(),
                functools.partial(self._refuse_duplicate, name, key),
                self.settings,
            )
            committed = commit_unit(log, unit, request)
            self.committed += 1
            # What this writer knows of the store is true at its own commit's version: the next
            # append, if nothing commits meanwhile, reads no file to check its columns.
            if seen.batch != view.batch:  # (else the padded files' schemas were unified too)
                where = "the writer's view"
                view = dataclasses.replace(
                    view,
                    groups=S.unify_schemas([view.groups, unit.groups.schema], where=where),
                    steps=S.unify_schemas([view.steps, unit.step_rows.schema], where=where),
                )
            view.version = committed.version
            self._seen = view
            if self.take:
                try:
                    write_take(self.backend, batch.groups, name, committed.group.crc)
                except (OSError, StoreError) as exc:
                    warnings.warn(
                        f"step {name} is committed but its take file failed: {exc}", stacklevel=3
                    )
            if self.cache and self.backend.can_mmap:
                try:
                    write_cache(self.backend, batch, name, committed.group.crc)
                except (OSError, StoreError) as exc:
                    warnings.warn(
                        f"step {name} is committed but its IPC cache copy failed: {exc}",
                        stacklevel=3,
                    )
            return self.backend.path(f"{STEPS}/{committed.name}")

    def append_records(self, name: str, rows: Any) -> int:
        """Append ``rows`` to record table ``name`` (:mod:`~maxent_arrow.store.history.records`) as
        this writer's attempt; returns the log version that committed them."""
        with self._lock:
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
        with self._lock:
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

    def _view(self, batch: RolloutBatch, version: int) -> tuple[_Seen, _Seen]:
        """The store as of log ``version`` (as this writer left it at its last commit when
        that is the version, no other commit since; else from the committed files, where a
        damaged file does not block an append: ``verify`` reports it), and the same with
        ``batch`` in it: the store's schemas unified with the batch's (a column whose type
        conflicts with the store's is refused) and the run's families (the store's, fixed at
        its first append, which must hold every family the batch has)."""
        seen = self._seen
        if seen is None or seen.version != version:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                seen = _Seen(
                    version,
                    self.schemas.get("groups", "skip"),
                    self.schemas.get("steps", "skip"),
                    self.schemas.families("skip"),
                )
        schemas = (batch.groups.schema, batch.step_row.schema)
        unified = (seen.groups, seen.steps)
        if seen.batch != schemas:
            unified = (
                self._unify(batch.step, "groups", seen.groups, schemas[0]),
                self._unify(batch.step, "steps", seen.steps, schemas[1]),
            )
        mine, run = batch.families, seen.families
        if run is None:
            run = mine
        extra = sorted(set(mine) - set(run), key=R.FAMILIES.index)
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
        layouts = seen.layouts
        if layouts is not None and seen.families == run and seen.batch == schemas:
            return seen, seen  # (the store as the last append left it, this batch in it)
        if layouts is None or seen.families != run:
            layouts = (S.group_schema(families=run), S.step_schema(families=run))
        return seen, _Seen(seen.version, unified[0], unified[1], run, layouts, schemas)

    def _unify(self, step: int, table: str, current: pa.Schema, schema: pa.Schema) -> pa.Schema:
        """``current`` (the store's ``table`` schema) unified with a batch's ``schema``; a
        column whose type conflicts is refused."""
        try:
            where = f"append of step {step} to {self.backend.path(table)}"
            return S.unify_schemas([current, schema], where=where)
        except SchemaError as exc:
            raise SchemaError(f"{exc}; the store's files keep the first type") from None

    def _refuse_duplicate(self, name: str, key: tuple[int, int, str], state: LogState) -> None:
        """Refuse a (step, rank, kind) the store holds already as effective history (a
        superseded write of a resumed run's step is no duplicate)."""
        if state.effective_write(*key) is not None:
            step, rank, kind = key
            raise StoreError(
                f"{self.backend.path(f'{STEPS}/{name}')}: step {step} of rank {rank} ({kind}) "
                "is already in the store; each (step, rank, kind) is appended once"
            )

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
