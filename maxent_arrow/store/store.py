"""``RolloutStore``: one class for a store on local disk or on any ``pyarrow.fs`` file system.

A store is a directory of plain Parquet files (``docs/arrow-layout.md``): per append, a group
file (one row per prompt group) and a step file (its step row and the commit record). The
read side (opening, listing, reading, SQL, ``verify``) is :class:`.readonly.ReadOnlyStore`;
this class adds the writer (:mod:`.writer`, built on the first append, committing through
:mod:`.commit`), replay (:mod:`.replay`), the IPC cache (:mod:`.cache`) and maintenance
(:mod:`.compaction`, :mod:`.repair`).

Opening a store only reads: it creates nothing and removes nothing. :meth:`RolloutStore.create`
creates one. Leftovers of crashed writes are invisible to every reader here and are moved
aside only by :meth:`RolloutStore.repair`.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store import manifest
from maxent_arrow.store.backend import Backend, open_backend
from maxent_arrow.store.cache import unit_group_crc32, write_cache
from maxent_arrow.store.catalog import OnError
from maxent_arrow.store.compaction import compact
from maxent_arrow.store.names import cache_name, parse_name
from maxent_arrow.store.padding import strip_padding
from maxent_arrow.store.parquet import check_compression
from maxent_arrow.store.reader import check_known_columns, read_group_file
from maxent_arrow.store.readonly import ReadOnlyStore
from maxent_arrow.store.repair import RepairReport, repair
from maxent_arrow.store.replay import ReplayOptions, replay
from maxent_arrow.store.session import check_timeout
from maxent_arrow.store.writer import Writer

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = ["DEFAULT_COMPACT_EVERY", "RolloutStore"]

# One-step files per rank and kind that the writer merges into one segment (``compact_every``).
DEFAULT_COMPACT_EVERY = 100


class RolloutStore(ReadOnlyStore):
    """An existing rollout store at ``root``, to read, append to, replay and maintain.

    Parameters
    ----------
    root:
        A local directory (a path or ``file://``), a ``pyarrow.fs`` URI such as
        ``s3://bucket/run?endpoint_override=127.0.0.1:9000&scheme=http``, or a path on an
        explicit ``filesystem``. A directory without a ``manifest.json`` is refused (the error
        names ``root/store`` when the store is one level down).
    filesystem:
        An explicit ``pyarrow.fs.FileSystem`` for ``root``.
    cache:
        Also write an Arrow IPC copy of every appended step to ``root/cache`` for
        memory-mapped, zero-copy replay (local stores).
    on_error:
        Default for the readers when a committed file is damaged or missing: ``"raise"`` a
        :class:`StoreError` naming it, or ``"skip"`` it with a warning.
    check_crc:
        Check what is read against the CRC-32s recorded at commit (whole files for
        ``read``/``replay``, the footer and the column chunks a query reads for SQL).
    compression, compression_level:
        Parquet codec of the group files this object writes (default zstd level 1; ``"lz4"``
        or ``"none"`` write faster and larger files).
    compact_every:
        The small-file policy of this writer (local stores): once a rank has this many
        committed one-step files of a kind, the append that made it so merges them into one
        segment (:meth:`compact`, atomic and crash-safe), so that a long run is a few files
        per rank rather than one per step, for every reader. The append is committed before
        the merge starts; a merge that fails is a warning, retried at the next append.
        ``None`` never merges. Each row is written twice in all (once per append, once in its
        segment); segments are never merged again.
    lock_timeout:
        Seconds an append, ``compact`` or ``repair`` waits for the store lock (local stores)
        before a :class:`StoreError` naming its holder (pid and host); ``None`` waits as
        long as it takes, and after two seconds logs whom it waits for.
    query_timeout:
        Seconds any one SQL query may run (``None``: no limit).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Backend,
        *,
        filesystem: pafs.FileSystem | None = None,
        cache: bool = False,
        on_error: OnError = "raise",
        check_crc: bool = True,
        compression: str = "zstd",
        compression_level: int | None = 1,
        compact_every: int | None = DEFAULT_COMPACT_EVERY,
        lock_timeout: float | None = None,
        query_timeout: float | None = None,
    ):
        super().__init__(
            root,
            filesystem=filesystem,
            on_error=on_error,
            check_crc=check_crc,
            query_timeout=query_timeout,
        )
        self.lock_timeout = check_timeout(lock_timeout)
        every = compact_every
        bad = isinstance(every, bool) or not isinstance(every, int) or every < 2
        if every is not None and bad:
            raise StoreError(f"compact_every: expected None or an int >= 2, got {compact_every!r}")
        self.compact_every = compact_every
        self.cache_enabled = bool(cache)
        self.compression, self.compression_level = check_compression(compression, compression_level)

    @functools.cached_property
    def writer(self) -> Writer:
        """The writer of this store object, built on the first append (a store only read
        never builds one)."""
        return Writer(
            self.catalog,
            self.schemas,
            compression=self.compression,
            compression_level=self.compression_level,
            cache=self.cache_enabled,
            lock_timeout=self.lock_timeout,
        )

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str] | Backend,
        *,
        config: Mapping[str, Any] | None = None,
        filesystem: pafs.FileSystem | None = None,
        **options: Any,
    ) -> RolloutStore:
        """Create a store at ``root`` (or open the one there) and return it.

        ``config`` (a dict or :class:`~maxent_arrow.rollout.RunConfig`) goes into a new
        store's manifest; an existing store keeps its own (each step row carries its own
        snapshot anyway). Ranks creating one store at once all succeed with one manifest. A
        non-empty directory that is not a store is refused, and nothing is written into it.
        ``options`` are those of the constructor.
        """
        backend = open_backend(root, filesystem)
        manifest.create(backend, config)
        return cls(backend, **options)

    # ------------------------------------------------------------------ writing
    def append(self, batch: RolloutBatch) -> Any:
        """Write one step of one rank; returns the step file's path once it is durable and
        committed (``docs/commit-protocol.md``). A (step, rank, kind) already in the store, a
        column whose type conflicts with the store's, a full disk or a read-only directory
        raise (:class:`StoreError`, :class:`SchemaError`) and leave the store as it was."""
        path = self.writer.append(batch)
        if self.compact_every is not None and self.backend.can_rewrite:
            self._merge_small_files(batch.rank, batch.kind)
        return path

    def _merge_small_files(self, rank: int, kind: str) -> None:
        """The ``compact_every`` policy: merge the rank's one-step files of ``kind`` once
        there are enough of them."""
        loose = [
            name
            for name in self.catalog.committed("skip")
            if (parsed := parse_name(name)) is not None
            and not parsed.compacted
            and parsed.first_rank == rank
            and parsed.kind == kind
        ]
        if len(loose) < cast(int, self.compact_every):  # called only when it is set
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a damaged file is verify's to report
                compact(
                    self.catalog,
                    self.schemas,
                    kind=kind,
                    steps=None,
                    ranks=[rank],
                    max_steps=None,
                    compression=self.compression,
                    compression_level=self.compression_level,
                    loose_only=True,
                    lock_timeout=self.lock_timeout,
                )
        except (StoreError, OSError) as exc:
            warnings.warn(
                f"{self.uri}: the append is committed, but merging the {len(loose)} one-step "
                f"files of rank {rank} ({kind}) failed and is retried at the next append: {exc}",
                stacklevel=3,
            )

    def build_cache(self, *, steps: Iterable[int] | None = None, kind: str | None = None) -> int:
        """Write IPC cache copies of committed units that have none; returns how many."""
        made = 0
        for unit in self.units(kind=kind, steps=steps):
            if self.backend.stat(f"cache/{cache_name(unit.name)}") is not None:
                continue
            step = self.catalog.step_file(unit.step_file)
            table = read_group_file(self.backend, step, None, crc=self.check_crc)
            groups = strip_padding(table.slice(unit.start, unit.num_groups), S.group_schema())
            step_row = strip_padding(step.table.slice(unit.row, 1), S.step_schema())
            batch = RolloutBatch(groups, step_row, validate=False)
            write_cache(self.backend, batch, unit.name, unit_group_crc32(step, unit.name))
            made += 1
        return made

    # ------------------------------------------------------------------ replay
    def replay(
        self, options: ReplayOptions | None = None, /, **kwargs: Any
    ) -> Iterator[RolloutBatch]:
        """Stream committed steps back as :class:`RolloutBatch` objects, one file at a time.

        Options are those of :class:`~maxent_arrow.store.replay.ReplayOptions` (``steps``,
        ``kind`` (default ``"train"``), ``batch_groups``, ``shuffle``, ``seed``, ``start``,
        ``shard``, ``columns``, ``source``, ``on_error``, ``whole_groups``),
        as keywords or one object. ``whole_groups=True`` gives one batch per step with the
        parts of each group that ranks stored separately merged (TRL runs).
        """
        if options is None:
            try:
                options = ReplayOptions(**kwargs)
            except TypeError as exc:  # an unknown keyword
                raise ArgumentError(f"replay: {exc}") from None
        elif kwargs:
            raise ArgumentError("replay: pass a ReplayOptions or keywords, not both")
        on_error = self._on_error(options.on_error)
        if options.columns is not None:  # unknown names are refused, as by read()
            schema = self.schemas.get("groups", on_error)
            check_known_columns(options.columns, schema, where="replay")
        return replay(self.catalog, options, on_error=on_error, crc=self.check_crc)

    # ------------------------------------------------------------------ maintenance
    def compact(
        self,
        *,
        kind: str | None = None,
        steps: Iterable[int] | None = None,
        ranks: Iterable[int] | None = None,
        max_steps: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Any]:
        """Merge committed files (of ``kind``, ``steps`` and ``ranks``, if given; at most
        ``max_steps`` steps per segment) into segments, each committed atomically with the
        list of files it replaces: readers see the old files or the segment, never both and
        never neither, also after a crash. Local stores only. Returns the new step files.
        ``progress(done, total)``: told of the files merged so far (a progress bar)."""
        return compact(
            self.catalog,
            self.schemas,
            kind=kind,
            steps=steps,
            ranks=ranks,
            max_steps=max_steps,
            compression=self.compression,
            compression_level=self.compression_level,
            lock_timeout=self.lock_timeout,
            progress=progress,
        )

    def repair(self) -> RepairReport:
        """Move leftovers of crashed writes (temp files of writers that are gone, uncommitted
        group files, files a committed compaction replaced) into ``quarantine/``; says what it
        moved. Local stores only."""
        return repair(self.catalog, lock_timeout=self.lock_timeout)
