"""A rollout store on any ``pyarrow.fs`` file system: S3 (and S3-compatible servers), GCS,
HDFS, or a local directory, with the same layout and file format as :class:`RolloutStore`.

``ObjectStore("s3://bucket/run-7?endpoint_override=127.0.0.1:9000&scheme=http")`` appends,
reads, replays and runs DuckDB SQL exactly as ``RolloutStore`` does on a local directory; a
store copied between the two (``aws s3 sync``) reads the same through either.

Everything above the file primitives is ``RolloutStore``'s own code, borrowed rather than
copied: the unit listing, schema unification, ``read``, ``replay`` (and its sharding) and the
conflict checks. This class supplies only what touches files, through ``pyarrow.fs``: listing,
reading (with the size and CRC-32 checks the step file records), and writing.

Commit on object storage: a PUT is atomic (an object is visible whole or not at all), so the
group object is written first and the step object, the commit marker, last; a crash between the
two leaves an uncommitted group object that readers ignore. Object stores have no atomic
create-if-absent through ``pyarrow.fs``, so the "append each (step, rank, kind) once" check is
a read before the write: safe when, as the layout intends, each rank writes its own files.
On a local file system, where a write is not atomic, use :class:`RolloutStore` (temp files,
renames, fsync, locks); :func:`open_store` does so for local paths.
``verify``, ``compact`` and the IPC cache are local-directory features (``RolloutStore``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import PurePosixPath
from typing import Any, Literal
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import MissingExtraError, SchemaError, StoreError
from maxent_arrow.rollout.batch import RolloutBatch
from maxent_arrow.store.files import (
    TEMP_PREFIX,
    check_compression,
    check_seal,
    crc32_of,
    parquet_bytes,
    unit_name,
)
from maxent_arrow.store.store import (
    FORMAT_NAME,
    STORE_META_KEY,
    RolloutStore,
    _check_on_error,
    _json_meta,
    _jsonable_config,
)

__all__ = ["ObjectStore", "open_store", "read_group_object", "resolve_filesystem"]


def resolve_filesystem(
    uri: str | os.PathLike[str], filesystem: pafs.FileSystem | None = None
) -> tuple[pafs.FileSystem, str]:
    """The file system and the path on it for ``uri``.

    ``uri`` is a URI pyarrow understands (``s3://bucket/prefix``, with options such as
    ``?endpoint_override=host:port&scheme=http&region=...`` in the query) or a local path.
    With an explicit ``filesystem`` the scheme and query are dropped and the rest is its path.
    """
    text = os.fspath(uri)
    if not text or "\x00" in text:
        raise StoreError(f"invalid store URI {text!r}")
    if filesystem is not None:
        parsed = urlparse(text)
        if parsed.scheme and len(parsed.scheme) > 1:  # not a Windows drive letter
            text = parsed.netloc + parsed.path
        return filesystem, text.rstrip("/")
    if "://" not in text:
        return pafs.LocalFileSystem(), os.path.abspath(text)
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise StoreError(f"{text}: no pyarrow file system for this URI ({exc})") from None
    return fs, path.rstrip("/")


def read_group_object(
    fs: pafs.FileSystem,
    path: str,
    meta: Mapping[str, Any],
    columns: list[str] | None,
    *,
    crc: bool = True,
    size: int | None = None,
) -> pa.Table:
    """Read a group file from ``fs`` after checking its size (always) and CRC-32 (when
    ``crc``) against what its step file recorded (``meta``); damage is a :class:`StoreError`
    naming the file. ``size`` skips a metadata request when a listing already gave it.

    With ``crc`` the whole object is fetched in one request (the checksum needs every byte);
    without it only the footer and the wanted columns' pages are read.
    """
    try:
        if size is None:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                raise StoreError(f"{path}: group file missing (its step file is committed)")
            size = info.size
        expected = meta.get("group_size")
        if expected is not None and size != expected:
            raise StoreError(
                f"{path}: size {size} bytes, expected {expected} (truncated or changed)"
            )
        if crc:
            with fs.open_input_stream(path) as stream:
                data = stream.read_buffer()
            got = crc32_of(data)
            if meta.get("group_crc32") is not None and got != meta["group_crc32"]:
                raise StoreError(
                    f"{path}: CRC-32 {got:08x}, expected {meta['group_crc32']:08x} (corrupt)"
                )
            source: Any = pa.BufferReader(data)
        else:
            source = fs.open_input_file(path)
        reader = pq.ParquetFile(source, page_checksum_verification=True)
        if columns is not None:
            present = set(reader.schema_arrow.names)
            columns = [c for c in columns if c in present]
        table = reader.read(columns=columns)
    except StoreError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable group file ({exc})") from None
    S.check_version((table.schema.metadata or {}).get(S.METADATA_KEY), where=path)
    return table


class ObjectStore:
    """A rollout store at ``uri`` on a ``pyarrow.fs`` file system (created if missing).

    Parameters
    ----------
    uri:
        ``s3://bucket/prefix`` (options in the query, credentials from the usual AWS
        environment), any other pyarrow URI, or a path on ``filesystem``.
    filesystem:
        An explicit ``pyarrow.fs.FileSystem`` (e.g. ``S3FileSystem(endpoint_override=...)``).
    config, on_error, check_crc, compression, compression_level:
        As for :class:`RolloutStore`.

    The public methods are those of ``RolloutStore`` that make sense without a local
    directory: ``append``, ``steps``, ``read``, ``read_steps``, ``replay``, ``schema``,
    ``committed_files`` (paths on ``self.filesystem``) and ``sql``.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        filesystem: pafs.FileSystem | None = None,
        config: Mapping[str, Any] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        check_crc: bool = True,
        compression: str = "zstd",
        compression_level: int | None = 1,
    ):
        self.uri = os.fspath(uri)
        self.filesystem, self.root = resolve_filesystem(uri, filesystem)
        if not self.root.strip("/"):
            raise StoreError(f"{self.uri}: refusing a bucket or file system root as a store")
        self.on_error = _check_on_error(on_error)
        self.check_crc = bool(check_crc)
        # The group files' codec, read by the borrowed RolloutStore._write_groups.
        self.compression, self.compression_level = check_compression(compression, compression_level)
        self.cache_enabled = False
        self._dirs_made = False
        self._groups_dir = f"{self.root}/groups"
        self._steps_dir = f"{self.root}/steps"
        self._listing: dict[str, dict[str, pafs.FileInfo]] = {}
        self._step_tables: dict[str, tuple[tuple, pa.Table, dict]] = {}
        self._schemas: dict[str, tuple[tuple, pa.Schema]] = {}
        self._unified: dict[str, tuple[frozenset[str], pa.Schema]] = {}
        self.manifest = self._open(config)

    def __repr__(self) -> str:
        return f"ObjectStore({self.uri!r})"

    # ------------------------------------------------------------------ file primitives
    def _info(self, path: str) -> pafs.FileInfo:
        try:
            return self.filesystem.get_file_info(path)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{path}: cannot stat ({exc})") from None

    def _get(self, path: str) -> pa.Buffer:
        try:
            with self.filesystem.open_input_stream(path) as stream:
                return stream.read_buffer()
        except FileNotFoundError:
            raise StoreError(f"{path}: missing") from None
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{path}: cannot read ({exc})") from None

    def _put(self, path: str, data: pa.Buffer | bytes) -> None:
        try:
            with self.filesystem.open_output_stream(path) as out:
                out.write(data)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"cannot write {path}: {exc}") from None

    def _names(self, directory: str) -> list[str]:
        """Names in ``directory`` (one LIST request), remembered with their sizes and mtimes."""
        selector = pafs.FileSelector(directory, allow_not_found=True, recursive=False)
        try:
            infos = self.filesystem.get_file_info(selector)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"cannot list {directory}: {exc}") from None
        found = {i.base_name: i for i in infos if i.type == pafs.FileType.File}
        self._listing[directory] = found
        return sorted(n for n in found if not n.startswith("."))

    def _listed(self, directory: str, name: str) -> pafs.FileInfo:
        info = self._listing.get(directory, {}).get(name)
        return info if info is not None else self._info(f"{directory}/{name}")

    def _open(self, config: Mapping[str, Any] | None) -> dict[str, Any]:
        path = f"{self.root}/manifest.json"
        info = self._info(path)
        if info.type == pafs.FileType.NotFound:
            root = self._info(self.root)
            if root.type == pafs.FileType.File:
                raise StoreError(f"{self.uri}: exists and is not a directory")
            names = self._names(self.root) if root.type == pafs.FileType.Directory else []
            # Another rank may have created the store since the check above.
            foreign = [n for n in names if n != "manifest.json" and not n.startswith(TEMP_PREFIX)]
            if foreign:
                raise StoreError(
                    f"{self.uri}: not a rollout store (no manifest.json) and not empty"
                )
            if "manifest.json" in names:
                info = self._info(path)
        if info.type == pafs.FileType.NotFound:
            manifest = {
                "format": FORMAT_NAME,
                "schema_version": S.SCHEMA_VERSION,
                "created_at": dt.datetime.now(dt.UTC).isoformat(),
                "config": _jsonable_config(config),
            }
            try:
                self.filesystem.create_dir(self.root, recursive=True)
            except (pa.ArrowException, OSError) as exc:
                raise StoreError(f"cannot create the store at {self.uri}: {exc}") from None
            # Two ranks creating the store at once write equivalent manifests; either wins.
            self._put(path, json.dumps(manifest, indent=2).encode())
        try:
            manifest = json.loads(self._get(path).to_pybytes())
        except ValueError as exc:
            raise StoreError(f"{path}: unreadable manifest ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise StoreError(f"{path}: not a {FORMAT_NAME} manifest")
        S.check_version(manifest.get("schema_version"), where=path)
        return manifest

    @property
    def config(self) -> dict[str, Any]:
        """The run config recorded in the manifest."""
        return dict(self.manifest.get("config") or {})

    def _step_table(self, name: str) -> tuple[pa.Table, dict[str, Any]]:
        """The step file ``name`` (cached by size and mtime) and its store metadata."""
        path = f"{self._steps_dir}/{name}"
        info = self._listed(self._steps_dir, name)
        if info.type == pafs.FileType.NotFound:
            raise StoreError(f"{path}: step file missing")
        key = (info.size, info.mtime_ns)
        hit = self._step_tables.get(name)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        data = self._get(path).to_pybytes()
        if check_seal(data) is False:
            raise StoreError(f"{path}: CRC-32 differs from the one sealed in the file (corrupt)")
        try:
            table = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read()
        except pa.ArrowException as exc:
            raise StoreError(f"{path}: unreadable step file ({exc})") from None
        S.check_version((table.schema.metadata or {}).get(S.METADATA_KEY), where=path)
        meta = _json_meta(table.schema, STORE_META_KEY)
        if "group_file" not in meta:
            raise StoreError(f"{path}: step file without store metadata (not written by append?)")
        self._step_tables[name] = (key, table, meta)
        return table, meta

    def _file_schema(self, path: str | PurePosixPath) -> pa.Schema:
        path = str(path)
        directory, _, name = path.rpartition("/")
        info = self._listed(directory, name)
        key = (info.size, info.mtime_ns)
        hit = self._schemas.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            schema = pq.read_schema(path, filesystem=self.filesystem)
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{path}: unreadable Parquet footer ({exc})") from None
        S.check_version((schema.metadata or {}).get(S.METADATA_KEY), where=path)
        self._schemas[path] = (key, schema)
        return schema

    def _read_group_file(self, name: str, meta: dict, columns: list[str] | None) -> pa.Table:
        info = self._listing.get(self._groups_dir, {}).get(name)
        return read_group_object(
            self.filesystem,
            f"{self._groups_dir}/{name}",
            meta,
            columns,
            crc=self.check_crc,
            size=None if info is None else info.size,
        )

    def committed_files(self, table: Literal["groups", "steps"] = "groups") -> list[PurePosixPath]:
        """Paths (on :attr:`filesystem`; ``str()`` them for pyarrow) of the committed files of
        ``table``, in step order."""
        if table not in ("groups", "steps"):
            raise StoreError(f"committed_files: table must be 'groups' or 'steps', got {table!r}")
        names = self._committed_step_names()
        if table == "steps":
            return [PurePosixPath(self._steps_dir, n) for n in names]
        present = set(self._names(self._groups_dir))
        return [PurePosixPath(self._groups_dir, n) for n in names if n in present]

    # ------------------------------------------------------------------ borrowed logic
    # RolloutStore's code above the file primitives, run on this class's primitives.
    _replaced = RolloutStore._replaced
    _committed_step_names = RolloutStore._committed_step_names
    _units = RolloutStore._units
    _fail = RolloutStore._fail
    _check_conflicts = RolloutStore._check_conflicts
    _write_groups = RolloutStore._write_groups
    steps = RolloutStore.steps
    __len__ = RolloutStore.__len__
    schema = RolloutStore.schema
    read = RolloutStore.read
    read_steps = RolloutStore.read_steps

    def replay(self, *, source: str = "parquet", **kwargs: Any) -> Iterator[RolloutBatch]:
        """As :meth:`RolloutStore.replay` (same plan, cursors and ``rank``/``world_size``
        sharding), from the Parquet objects: there is no memory-mapped cache remotely."""
        if source not in ("auto", "parquet"):
            raise StoreError(f"ObjectStore.replay: source {source!r}: no IPC cache on {self.uri}")
        from maxent_arrow.store.replay import replay

        defaults = dict(
            steps=None, batch_groups=None, shuffle=False, seed=0, start=None, rank=None,
            world_size=None, kind="train", columns=None,
        )  # fmt: skip
        unknown = set(kwargs) - set(defaults) - {"on_error"}
        if unknown:
            raise TypeError(f"ObjectStore.replay: unexpected arguments {sorted(unknown)}")
        on_error = _check_on_error(kwargs.pop("on_error", None) or self.on_error)
        return replay(self, **{**defaults, **kwargs}, source="parquet", on_error=on_error)

    # ------------------------------------------------------------------ append
    def append(self, batch: RolloutBatch) -> str:
        """Write one step of one rank: the group object, then the step object (the commit
        marker). Returns the step object's path. The same refusals as
        :meth:`RolloutStore.append` (duplicate unit, conflicting column type), nothing written.
        """
        if not isinstance(batch, RolloutBatch):
            raise SchemaError(
                f"ObjectStore.append: expected a RolloutBatch, got {type(batch).__name__}"
            )
        name = unit_name(batch.step, batch.rank, batch.kind)
        S.check_version(
            (batch.groups.schema.metadata or {}).get(S.METADATA_KEY, S.SCHEMA_VERSION.encode()),
            where=f"batch for {name}",
        )
        self._check_conflicts(batch)
        step_names = self._names(self._steps_dir)
        if name in step_names or name in self._replaced(step_names):
            raise StoreError(
                f"{self._steps_dir}/{name}: step {batch.step} of rank {batch.rank} "
                f"({batch.kind}) is already in the store; each (step, rank, kind) is appended once"
            )
        sink = pa.BufferOutputStream()
        self._write_groups(batch, sink)  # RolloutStore's own encoding: the same bytes
        groups_bytes = sink.getvalue()
        group_meta = {
            "group_file": name,
            "group_size": groups_bytes.size,
            "group_crc32": crc32_of(groups_bytes),
        }
        # The same bytes RolloutStore.append writes, so either class reads the other's files.
        step_bytes = parquet_bytes(
            pa.Table.from_batches([batch.step_row]),
            {
                STORE_META_KEY: json.dumps(group_meta).encode(),
                S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
            },
            statistics=["step", "rank"],
            sealed=True,
        )
        if not self._dirs_made:
            # Needed on file systems with real directories; a no-op marker on object stores.
            for directory in (self._groups_dir, self._steps_dir):
                try:
                    self.filesystem.create_dir(directory, recursive=True)
                except (pa.ArrowException, OSError) as exc:
                    raise StoreError(f"cannot create {directory}: {exc}") from None
            self._dirs_made = True
        self._put(f"{self._groups_dir}/{name}", groups_bytes)
        self._put(f"{self._steps_dir}/{name}", step_bytes)
        return f"{self._steps_dir}/{name}"

    # ------------------------------------------------------------------ SQL
    def sql(self, query: str) -> pa.Table:
        """DuckDB SQL over the views ``groups``, ``samples`` and ``steps``, as
        :meth:`RolloutStore.sql`. DuckDB scans the objects through pyarrow datasets on this
        file system (projections and filters pushed down), so it needs no S3 extension."""
        try:
            import duckdb
        except ImportError:
            raise MissingExtraError("duckdb", "analytics") from None
        import pyarrow.dataset as pads

        from maxent_arrow.store.read import query_arrow, samples_sql

        con = duckdb.connect()
        try:
            for table in ("groups", "steps"):
                schema = self.schema(table)
                files = [str(p) for p in self.committed_files(table)]
                source = pads.dataset(
                    files, schema=schema, format="parquet", filesystem=self.filesystem
                )
                con.register(f"_{table}_source", source)
                con.execute(f"CREATE VIEW {table} AS SELECT * FROM _{table}_source")
                if table == "groups":
                    con.execute(f"CREATE VIEW samples AS {samples_sql(schema)}")
            return query_arrow(con, query, owner="ObjectStore.sql")
        finally:
            con.close()


def open_store(
    uri: str | os.PathLike[str] | RolloutStore | ObjectStore,
    *,
    filesystem: pafs.FileSystem | None = None,
    **kwargs: Any,
) -> RolloutStore | ObjectStore:
    """A store object for ``uri``: a :class:`RolloutStore` for a local path (atomic renames,
    locks, the IPC cache), an :class:`ObjectStore` for a URI with a scheme (``s3://``...) or
    an explicit ``filesystem``. A store object is returned as it is."""
    if isinstance(uri, RolloutStore | ObjectStore):
        return uri
    text = os.fspath(uri)
    if filesystem is None and ("://" not in text or text.startswith("file://")):
        return RolloutStore(text.removeprefix("file://"), **kwargs)
    return ObjectStore(text, filesystem=filesystem, **kwargs)
