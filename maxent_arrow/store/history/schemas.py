"""One schema over a store's files, unified by column name, kept up to date incrementally.

Committed files never change, so the unified schema of ``n`` files is the unification of the
schema of ``n - 1`` files with the new one: an append costs one footer read, not one per file
in the store. After a compaction removed files, it starts over. Schema-1.x files contribute
the schema they are read as (the current layout).
"""

from __future__ import annotations

import functools
import hashlib

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_groups, upgrade_steps
from maxent_arrow.errors import StoreError
from maxent_arrow.store.history.catalog import Catalog, OnError, fail, locate
from maxent_arrow.store.storage.names import GROUPS, STEPS

__all__ = ["UnifiedSchemas", "file_schema", "schema_key"]


def file_schema(catalog: Catalog, rel: str, where: str | None = None) -> pa.Schema:
    """The schema of one committed file as this library reads it (footer only), read from
    ``where`` (default ``rel``; a compaction may have moved it to retired/)."""
    backend = catalog.backend
    try:
        with backend.open(where or rel) as source:
            schema = pq.read_schema(source)
    except (pa.ArrowException, OSError, ValueError) as exc:  # damaged bytes
        raise StoreError(f"{backend.path(rel)}: unreadable Parquet footer ({exc})") from None
    version = S.check_version(
        (schema.metadata or {}).get(S.METADATA_KEY), where=str(backend.path(rel))
    )
    if needs_upgrade(version):
        table, name = rel.split("/", 1)
        step = catalog.step_file(name)
        empty = S.empty(schema)
        if table == GROUPS:
            kind = step.table.column("kind")[0].as_py() if step.table.num_rows else "train"
            schema = upgrade_groups(empty, kind=kind).schema
        else:
            schema = upgrade_steps(empty).schema
    return schema


def schema_key(schema: pa.Schema) -> str:
    """A short digest of a file's Arrow schema (names, types, nullability; no metadata),
    recorded in its step file at append (one digest per schema: a run appends one again and
    again)."""
    return _digest(schema.remove_metadata())


@functools.lru_cache(maxsize=256)
def _digest(schema: pa.Schema) -> str:
    text = schema.to_string(show_field_metadata=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class UnifiedSchemas:
    """The unified schema of the committed group files and of the step files.

    A step file's schema is the one of the step rows the catalog has already read. A group
    file's schema is read from its footer once per schema: files whose step file records the
    same ``schema_key`` share it (the key is covered by the step file's seal, and the group
    file's footer by the footer CRC checked before a query).
    """

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self._files: dict[str, tuple[tuple[int, int], pa.Schema]] = {}
        self._by_key: dict[str, pa.Schema] = {}
        self._unified: dict[str, tuple[frozenset[str], pa.Schema]] = {}
        self._families: tuple[str, ...] | None = None  # fixed once a step file records them

    def families(self, on_error: OnError = "skip") -> tuple[str, ...] | None:
        """The run's layout families (``docs/arrow-layout.md``), or ``None`` for a store with
        no committed step yet. Step files written since schema 2.1 record them (fixed at the
        run's first append); for older stores they are inferred from the columns the files
        carry data in (their step files' ``columns`` record, else the file's own columns)."""
        if self._families is not None:
            return self._families
        found: set[str] = set()
        for step in self.catalog.committed_steps(on_error):
            recorded = step.meta.get("families")
            if recorded:
                self._families = tuple(f for f in R.FAMILIES if f in recorded)
                return self._families
            columns = step.meta.get("columns")
            if columns is None:
                try:
                    columns = self.file(f"{GROUPS}/{step.group_file}").names
                except StoreError as exc:
                    fail(on_error, exc)
                    continue
            found |= R.family_of_columns(columns, R.GROUP)
        return tuple(f for f in R.FAMILIES if f in found) if found else None

    def visible(self, table: str, on_error: OnError, files: list[str] | None = None) -> pa.Schema:
        """The unified schema of ``table`` as readers see it: without the registered columns
        outside the run's families (the null padding of stores written before families were
        recorded); columns outside the registry stay. ``files``: of those committed files
        only (relative paths; a step-bounded reader's), else of every committed one."""
        unified = self.get(table, on_error, files)
        families = self.families(on_error)
        if families is None:
            return unified
        return S.visible(unified, families, R.GROUP if table == GROUPS else R.STEP)

    def file(self, rel: str) -> pa.Schema:
        """The schema of the committed file ``rel`` as this library reads it."""
        table, _, name = rel.partition("/")
        key = None
        if self.catalog.is_committed_step(name):
            step = self.catalog.step_file(name)
            if table == STEPS:
                return step.schema
            key = step.meta.get("schema_key")
            if key is not None and key in self._by_key:
                return self._by_key[key]
        found = locate(self.catalog.backend, rel)  # in place, or retired meanwhile
        if found is None:
            raise StoreError(f"{self.catalog.backend.path(rel)}: missing")
        where, info = found
        stamp = (info.size, info.mtime_ns)
        hit = self._files.get(rel)
        if hit is not None and hit[0][0] == stamp[0] and (hit[0] == stamp or where != rel):
            return hit[1]
        schema = file_schema(self.catalog, rel, where)
        self._files[rel] = (stamp, schema)
        if key is not None:
            self._by_key[key] = schema
        return schema

    def get(self, table: str, on_error: OnError, files: list[str] | None = None) -> pa.Schema:
        """The unified schema of ``table`` (``"groups"`` or ``"steps"``) over the committed
        ``files`` (default all); with no files yet, the current layout's."""
        # A missing group file is raised where it is read (self.file), not by a listing of
        # every file on every call (an append asks for the schema).
        if files is None:
            files = self.catalog.committed_files(table, on_error, present=False)
        names = set(files)
        cached = self._unified.get(table)
        done: set[str] = set()
        schemas: list[pa.Schema] = []
        if cached is not None and cached[0] <= names:
            done, schemas = set(cached[0]), [cached[1]]
        for rel in files:
            if rel in done:
                continue
            try:
                schemas.append(self.file(rel))
                done.add(rel)
            except StoreError as exc:
                fail(on_error, exc)
        if not schemas:
            return S.group_schema() if table == GROUPS else S.step_schema()
        if cached is not None and len(schemas) == 1 and schemas[0] is cached[1]:
            return cached[1]  # no file since: unified already
        root = self.catalog.backend.path(table if table in (GROUPS, STEPS) else "")
        distinct = list({id(s): s for s in schemas}.values())  # files share schema objects
        unified = S.unify_schemas(distinct, where=str(root))
        self._unified[table] = (frozenset(done), unified)
        return unified
