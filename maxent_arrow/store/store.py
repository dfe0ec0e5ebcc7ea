"""``RolloutStore``: a crash-safe directory of Parquet files, one pair per append, plus an optional
Arrow IPC cache for memory-mapped replay.

Layout (plain files that DuckDB, Polars, pyarrow datasets and HF ``datasets`` read as they are)::

    root/manifest.json                                   format, schema_version, run config
    root/groups/step-{step:010d}.rank-{rank:05d}.{kind}.parquet   group rows of one append
    root/steps/step-{step:010d}.rank-{rank:05d}.{kind}.parquet    its one step row
    root/cache/step-{step:010d}.rank-{rank:05d}.{kind}.arrow      IPC copy (optional)
    root/{groups,steps}/compact-{first:010d}-{last:010d}.{kind}.parquet   after compact()

The step file is the commit marker: it is linked into place last, so a group file is visible
only once its step file exists. The step file's metadata records the group file's size and
CRC-32, and the step file carries a CRC-32 of its own bytes (sealed into its footer), so a
truncated or bit-flipped file is caught on read and named by ``verify()``. Names starting with
``.tmp-`` are in-flight temp files that readers ignore and ``open`` cleans up.

Parquet: zstd; no dictionary encoding on token and log-prob columns; statistics on ``step``,
``rank`` and ``group_index`` only; page checksums; the schema version and run config in the
file metadata. Readers unify schemas across files by name (a reward function added mid-run
reads as nulls in older files); a column that changes type is refused at append time.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError, StoreError
from maxent_arrow.rollout.batch import BATCH_META_KEY, RolloutBatch
from maxent_arrow.store.admin import StoreProblem, VerifyReport, remove_orphans, remove_replaced
from maxent_arrow.store.files import (
    COMPACT_RE,
    UNIT_RE,
    OnError,
    _check_on_error,
    _json_meta,
    _jsonable_config,
    _sort_key,
    _step_set,
    _Unit,
    check_compression,
    check_root,
    check_seal,
    cleanup_temp,
    commit_temp,
    discard_temp,
    open_manifest,
    os_error,
    parquet_bytes,
    prepare_temp,
    store_lock,
    unit_name,
    write_parquet,
)

__all__ = ["RolloutStore", "StoreProblem", "VerifyReport", "FORMAT_NAME"]

FORMAT_NAME = "maxent-arrow-rollouts"
STORE_META_KEY = b"maxent_arrow.store"
CONFIG_META_KEY = b"maxent_arrow.config"


class RolloutStore:
    """A rollout store at ``root`` (created if missing).

    Parameters
    ----------
    root:
        The store directory. An existing file, or a directory that is not a store (no
        ``manifest.json`` but other content), is refused.
    config:
        The run config recorded in a new store's manifest (ignored when the store exists; each
        step row keeps its own snapshot).
    cache:
        Also write an Arrow IPC copy of every appended step to ``root/cache`` for memory-mapped,
        zero-copy replay.
    on_error:
        Default for ``read``/``replay``/``sql`` when a committed file is damaged: ``"raise"``
        a :class:`StoreError` naming it, or ``"skip"`` it with a warning.
    check_crc:
        Check each group file's CRC-32 when reading it (one extra pass over the bytes read).
    compression, compression_level:
        Parquet codec of the group files (default zstd level 1; ``"lz4"`` or ``"none"`` write
        faster and larger files).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        config: Mapping[str, Any] | None = None,
        cache: bool = False,
        on_error: OnError = "raise",
        check_crc: bool = True,
        compression: str = "zstd",
        compression_level: int | None = 1,
    ):
        self.root = check_root(root)
        self.cache_enabled = bool(cache)
        self.on_error = _check_on_error(on_error)
        self.check_crc = bool(check_crc)
        self.compression, self.compression_level = check_compression(compression, compression_level)
        self._step_tables: dict[str, tuple[tuple[int, int], pa.Table, dict]] = {}
        self._schemas: dict[str, tuple[tuple[int, int], pa.Schema]] = {}
        self._unified: dict[str, tuple[frozenset[str], pa.Schema]] = {}
        self._groups_dir = self.root / "groups"
        self._steps_dir = self.root / "steps"
        self._cache_dir = self.root / "cache"
        self.manifest = self._open(config)

    @classmethod
    def create(cls, root: str | os.PathLike[str], **options: Any) -> RolloutStore:
        """Create the store at ``root`` (or open it if it exists)."""
        return cls(root, **options)

    # ------------------------------------------------------------------ open / manifest
    def _open(self, config: Mapping[str, Any] | None) -> dict[str, Any]:
        dirs = (self._groups_dir, self._steps_dir, self._cache_dir)
        manifest = open_manifest(self.root, dirs, FORMAT_NAME, _jsonable_config(config))
        if os.access(self.root, os.W_OK):
            for directory in dirs:
                cleanup_temp(directory)
            remove_replaced(self)
            remove_orphans(self)
        return manifest

    @property
    def config(self) -> dict[str, Any]:
        """The run config recorded in the manifest."""
        return dict(self.manifest.get("config") or {})

    def __repr__(self) -> str:
        return f"RolloutStore({str(self.root)!r})"

    # ------------------------------------------------------------------ paths and listing
    def _path(self, directory: Path, name: str) -> Path:
        """``directory/name``, refused if it resolves outside the store (a symlink out)."""
        path = directory / name
        resolved = path.resolve()
        if not resolved.is_relative_to(self.root.resolve()):
            raise StoreError(f"{path}: resolves to {resolved}, outside the store {self.root}")
        return path

    def _names(self, directory: Path) -> list[str]:
        try:
            return sorted(n for n in os.listdir(directory) if not n.startswith("."))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise os_error("cannot list", directory, exc) from exc

    def _step_table(self, name: str) -> tuple[pa.Table, dict[str, Any]]:
        """The step file ``name`` (cached by size and mtime) and its store metadata."""
        path = self._path(self._steps_dir, name)
        try:
            st = path.stat()
        except OSError as exc:
            raise os_error("cannot read", path, exc) from exc
        key = (st.st_size, st.st_mtime_ns)
        hit = self._step_tables.get(name)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise os_error("cannot read", path, exc) from exc
        if check_seal(data) is False:
            raise StoreError(f"{path}: CRC-32 differs from the one sealed in the file (corrupt)")
        try:
            reader = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
            table = reader.read()
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{path}: unreadable step file ({exc})") from None
        S.check_version((table.schema.metadata or {}).get(S.METADATA_KEY), where=str(path))
        meta = _json_meta(table.schema, STORE_META_KEY)
        if "group_file" not in meta:
            raise StoreError(f"{path}: step file without store metadata (not written by append?)")
        self._step_tables[name] = (key, table, meta)
        return table, meta

    def _replaced(self, names: list[str]) -> set[str]:
        replaced: set[str] = set()
        for name in names:
            if COMPACT_RE.match(name):
                with contextlib.suppress(StoreError):
                    replaced.update(self._step_table(name)[1].get("replaces", []))
        return replaced

    def _committed_step_names(self) -> list[str]:
        names = [n for n in self._names(self._steps_dir) if UNIT_RE.match(n) or COMPACT_RE.match(n)]
        replaced = self._replaced(names)
        names = [n for n in names if n not in replaced and not n.endswith(".arrow")]
        return sorted(names, key=_sort_key)

    def committed_files(self, table: Literal["groups", "steps"] = "groups") -> list[Path]:
        """Paths of the fully committed files of ``table`` (``"groups"`` or ``"steps"``), in
        step order. Uncommitted group files (an append that crashed before its step file was
        linked), temp files and files replaced by ``compact`` are left out."""
        if table not in ("groups", "steps"):
            raise StoreError(f"committed_files: table must be 'groups' or 'steps', got {table!r}")
        names = self._committed_step_names()
        if table == "steps":
            return [self._steps_dir / n for n in names]
        out = []
        for name in names:
            path = self._groups_dir / name
            if path.exists():
                out.append(path)
        return out

    def _units(
        self,
        *,
        kind: str | None = None,
        steps: Iterable[int] | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError = "raise",
    ) -> list[_Unit]:
        wanted = None if steps is None else _step_set(steps)
        wanted_ranks = None if ranks is None else set(ranks)
        units = []
        for name in self._committed_step_names():
            match = UNIT_RE.match(name) or COMPACT_RE.match(name)
            if kind is not None and match.group(3) != kind:
                continue
            if wanted is not None and UNIT_RE.match(name) and int(match.group(1)) not in wanted:
                continue
            try:
                table, meta = self._step_table(name)
            except StoreError as exc:
                self._fail(on_error, exc)
                continue
            rows = table.select(["step", "rank", "kind", "num_groups"]).to_pydict()
            starts = meta.get("group_rows") or [0]
            for i, (step, rank, knd, count) in enumerate(
                zip(rows["step"], rows["rank"], rows["kind"], rows["num_groups"])
            ):
                if wanted is not None and step not in wanted:
                    continue
                if wanted_ranks is not None and rank not in wanted_ranks:
                    continue
                units.append(_Unit(step, rank, knd, name, meta["group_file"], i, starts[i], count))
        return sorted(units, key=lambda u: (u.step, u.kind, u.rank))

    def steps(
        self, *, kind: str | None = None, rank: int | None = None, on_error: OnError | None = None
    ) -> list[int]:
        """The distinct committed steps (of ``kind`` and ``rank``, if given), ascending."""
        ranks = None if rank is None else [rank]
        on_error = _check_on_error(on_error or self.on_error)
        return sorted({u.step for u in self._units(kind=kind, ranks=ranks, on_error=on_error)})

    def __len__(self) -> int:
        return len(self._units())

    def _fail(self, on_error: OnError, exc: StoreError) -> None:
        if on_error == "raise":
            raise exc
        warnings.warn(f"skipping damaged file: {exc}", stacklevel=3)

    # ------------------------------------------------------------------ schema
    def _file_schema(self, path: Path) -> pa.Schema:
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        hit = self._schemas.get(str(path))
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{path}: unreadable Parquet footer ({exc})") from None
        S.check_version((schema.metadata or {}).get(S.METADATA_KEY), where=str(path))
        self._schemas[str(path)] = (key, schema)
        return schema

    def schema(
        self, table: Literal["groups", "steps"] = "groups", *, on_error: OnError | None = None
    ) -> pa.Schema:
        """One schema over all committed files of ``table``, unified by column name.

        A column missing from older files is in it (those files read it as nulls); so is a
        reward function added mid-run (a new field of the ``rewards`` struct). With no files
        yet, the v1 schema (without ``rewards``).
        """
        files = self.committed_files(table)
        names = {p.name for p in files}
        # Incremental: committed files never change, so unify the cached result with the
        # new files only (an append must not cost O(files in the store)). After a compaction
        # removed files, start over.
        cached = self._unified.get(table)
        done: set[str] = set()
        schemas: list[pa.Schema] = []
        if cached is not None and cached[0] <= names:
            done, schemas = set(cached[0]), [cached[1]]
        for path in files:
            if path.name in done:
                continue
            try:
                schemas.append(self._file_schema(path))
                done.add(path.name)
            except StoreError as exc:
                self._fail(_check_on_error(on_error or self.on_error), exc)
        if not schemas:
            return S.group_schema() if table == "groups" else S.step_schema()
        unified = S.unify_schemas(schemas, where=f"{self.root}/{table}")
        self._unified[table] = (frozenset(done), unified)
        return unified

    # ------------------------------------------------------------------ append
    def append(self, batch: RolloutBatch) -> Path:
        """Write one step of one rank; returns the step file's path once it is durable.

        The group file and then the step file (the commit marker) are each written to a temp
        file, fsynced and renamed into place, and the directories fsynced. A (step, rank, kind)
        already in the store, a column whose type conflicts with the store's, a full disk or a
        read-only directory raise (:class:`StoreError`, :class:`SchemaError`) and leave the
        store as it was.
        """
        if not isinstance(batch, RolloutBatch):
            raise SchemaError(
                f"RolloutStore.append: expected a RolloutBatch, got {type(batch).__name__}"
            )
        name = unit_name(batch.step, batch.rank, batch.kind)
        S.check_version(
            (batch.groups.schema.metadata or {}).get(S.METADATA_KEY, S.SCHEMA_VERSION.encode()),
            where=f"batch for {name}",
        )
        self._check_conflicts(batch)
        group_path = self._path(self._groups_dir, name)
        step_path = self._path(self._steps_dir, name)
        self._refuse_duplicate(name, batch, step_path)  # early and cheap; again under the lock
        # The slow part (encoding and writing the group file) runs outside the lock, so ranks
        # appending at once only serialise on two renames.
        group_temp, size, crc = prepare_temp(
            group_path, produce=lambda sink: self._write_groups(batch, sink)
        )
        group_meta = {"group_file": name, "group_size": size, "group_crc32": crc}
        try:
            step_bytes = parquet_bytes(
                pa.Table.from_batches([batch.step_row]),
                {
                    STORE_META_KEY: json.dumps(group_meta).encode(),
                    S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
                },
                statistics=["step", "rank"],
                sealed=True,
            )
            step_temp, _, _ = prepare_temp(step_path, step_bytes)
        except BaseException:
            discard_temp(group_temp)
            raise
        try:
            with store_lock(self.root):
                self._refuse_duplicate(name, batch, step_path)
                commit_temp(group_temp, group_path, overwrite=True)
                try:
                    commit_temp(step_temp, step_path, overwrite=False)
                except BaseException:
                    # Not committed: remove the group file so the store is as it was.
                    with contextlib.suppress(OSError):
                        group_path.unlink()
                    raise
        finally:
            discard_temp(group_temp)  # no-ops once committed
            discard_temp(step_temp)
        if self.cache_enabled:
            try:
                self._write_cache(batch, name)
            except OSError as exc:
                warnings.warn(
                    f"step {name} is committed but its IPC cache copy failed: {exc}", stacklevel=2
                )
        return step_path

    def _refuse_duplicate(self, name: str, batch: RolloutBatch, step_path: Path) -> None:
        if step_path.exists() or name in self._replaced(self._names(self._steps_dir)):
            raise StoreError(
                f"{step_path}: step {batch.step} of rank {batch.rank} ({batch.kind}) is "
                "already in the store; each (step, rank, kind) is appended once"
            )

    def _check_conflicts(self, batch: RolloutBatch) -> None:
        for table, schema in (("groups", batch.groups.schema), ("steps", batch.step_row.schema)):
            # A damaged file must not block appends; verify() reports it.
            current = self.schema(table, on_error="skip")
            try:
                S.unify_schemas(
                    [current, schema], where=f"append of step {batch.step} to {self.root}/{table}"
                )
            except SchemaError as exc:
                raise SchemaError(f"{exc}; the store's files keep the first type") from None

    def _write_groups(self, batch: RolloutBatch, sink) -> None:
        meta = {
            S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
            CONFIG_META_KEY: (batch._scalar("config") or "{}").encode(),
        }
        raw = (batch.groups.schema.metadata or {}).get(BATCH_META_KEY)
        if raw:
            meta[BATCH_META_KEY] = raw
        names = batch.groups.schema.names
        dictionary = [n for n in ("prompt", "answer") if n in names]
        write_parquet(
            sink,
            pa.Table.from_batches([batch.groups]),
            meta,
            statistics=[n for n in ("step", "rank", "group_index") if n in names],
            dictionary=dictionary,
            compression=self.compression,
            compression_level=self.compression_level,
        )

    def _write_cache(self, batch: RolloutBatch, name: str) -> Path:
        from maxent_arrow.store.replay import write_cache

        return write_cache(self, batch, name)

    def build_cache(self, *, steps: Iterable[int] | None = None, kind: str | None = None) -> int:
        """Write IPC cache copies of committed steps that have none; returns how many."""
        made = 0
        for unit in self._units(kind=kind, steps=steps):
            target = self._cache_dir / (unit.name.removesuffix(".parquet") + ".arrow")
            if target.exists():
                continue
            self._write_cache(self._load_unit(unit), unit.name)
            made += 1
        return made

    # ------------------------------------------------------------------ reading
    def _read_group_file(self, name: str, meta: dict, columns: list[str] | None) -> pa.Table:
        """One group file, checked against the size and CRC its step file recorded."""
        from maxent_arrow.store.read import read_checked

        return read_checked(self._path(self._groups_dir, name), meta, columns, crc=self.check_crc)

    def _load_unit(self, unit: _Unit, columns: list[str] | None = None) -> RolloutBatch:
        table, meta = self._step_table(unit.step_file)
        groups = self._read_group_file(unit.group_file, meta, columns)
        if unit.start or unit.num_groups != groups.num_rows:
            groups = groups.slice(unit.start, unit.num_groups)
        return RolloutBatch(groups, table.slice(unit.row, 1).combine_chunks(), validate=False)

    def read(
        self,
        *,
        steps: Iterable[int] | None = None,
        columns: list[str] | None = None,
        filter: pc.Expression | None = None,
        kind: str | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError | None = None,
    ) -> pa.Table:
        """Group rows of the committed steps as one table over the unified schema.

        ``filter`` is a ``pyarrow.compute`` expression over the flat columns (``step``,
        ``rank``, ``group_index``, ``prompt``, ``answer``, ``seed_*``) or any column in
        ``columns``. A damaged file raises :class:`StoreError` naming it, or is skipped with a
        warning under ``on_error="skip"``.
        """
        from maxent_arrow.store.read import read_table

        return read_table(
            self,
            "groups",
            steps=steps,
            columns=columns,
            filter=filter,
            kind=kind,
            ranks=ranks,
            on_error=_check_on_error(on_error or self.on_error),
        )

    def read_steps(
        self,
        *,
        steps: Iterable[int] | None = None,
        columns: list[str] | None = None,
        filter: pc.Expression | None = None,
        kind: str | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError | None = None,
    ) -> pa.Table:
        """The step table (one row per step and rank) over the unified step schema."""
        from maxent_arrow.store.read import read_table

        return read_table(
            self,
            "steps",
            steps=steps,
            columns=columns,
            filter=filter,
            kind=kind,
            ranks=ranks,
            on_error=_check_on_error(on_error or self.on_error),
        )

    def replay(
        self,
        *,
        steps: Iterable[int] | None = None,
        batch_groups: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        start: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        kind: str | None = "train",
        columns: list[str] | None = None,
        source: Literal["auto", "cache", "parquet"] = "auto",
        on_error: OnError | None = None,
    ) -> Iterator[RolloutBatch]:
        """Stream committed steps back as :class:`RolloutBatch` objects, one file at a time.

        Parameters
        ----------
        steps, kind:
            Which steps (default: all ``"train"`` steps), in ascending (step, rank) order.
        batch_groups:
            Split each step into batches of at most this many groups (never mixing steps).
        shuffle, seed:
            Shuffle the order of the batches and the groups inside them, reproducibly.
        start:
            A cursor (``batch.cursor`` of a batch yielded earlier by the same replay) to resume
            after that batch; the plan (store contents and arguments) must be the same.
        rank, world_size:
            Keep only this rank's share of the batches (round robin), disjoint across ranks.
        source:
            ``"cache"`` memory-maps the IPC copies (zero-copy); ``"parquet"`` decodes the
            archive; ``"auto"`` uses the cache where a copy exists.
        """
        from maxent_arrow.store.replay import replay

        return replay(
            self,
            steps=steps,
            batch_groups=batch_groups,
            shuffle=shuffle,
            seed=seed,
            start=start,
            rank=rank,
            world_size=world_size,
            kind=kind,
            columns=columns,
            source=source,
            on_error=_check_on_error(on_error or self.on_error),
        )

    def sql(self, query: str, *, on_error: OnError | None = None) -> pa.Table:
        """Run DuckDB SQL over views ``groups`` (one row per group), ``samples`` (one row per
        completion, with ``k`` its index in the group) and ``steps``."""
        from maxent_arrow.store.read import run_sql

        return run_sql(self, query, on_error=_check_on_error(on_error or self.on_error))

    def verify(self) -> VerifyReport:
        """Check every file: readable, sizes and checksums as recorded, rows as the step rows
        say, caches equal to the archive. Names each damaged file in ``problems``."""
        from maxent_arrow.store.admin import verify

        return verify(self)

    def compact(
        self,
        *,
        kind: str | None = None,
        steps: Iterable[int] | None = None,
        max_steps: int | None = None,
    ) -> list[Path]:
        """Merge the per-append files of each kind (of ``steps``, if given; at most
        ``max_steps`` steps per merged file) into one group file and one step file.

        Atomic: the merged pair is committed (step file linked last) with the list of the
        files it replaces, so readers see either the old files or the merged ones, never both,
        also after a crash; the replaced files are deleted afterwards (or at the next open).
        Returns the new step files.
        """
        from maxent_arrow.store.admin import compact

        return compact(self, kind=kind, steps=steps, max_steps=max_steps)
