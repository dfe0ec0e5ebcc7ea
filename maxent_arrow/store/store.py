"""``RolloutStore``: one class for a store on local disk or on any ``pyarrow.fs`` file system.

A store is a directory of plain Parquet files (``docs/arrow-layout.md``): per append, a group
file (one row per prompt group) and a step file (its step row and the commit record). The
read side (opening, listing, reading, SQL, ``verify``) is
:class:`~maxent_arrow.store.readonly.ReadOnlyStore`; this class adds the writer
(:mod:`~maxent_arrow.store.io.writer`, built on the first append, committing through
:mod:`~maxent_arrow.store.io.commit`), replay (:mod:`~maxent_arrow.store.io.replay`), the IPC cache
(:mod:`~maxent_arrow.store.io.cache`) and maintenance (:mod:`~maxent_arrow.store.upkeep.compaction`,
:mod:`~maxent_arrow.store.upkeep.repair`).

Opening a store only reads: it creates nothing and removes nothing. :meth:`RolloutStore.create`
creates one. Leftovers of crashed writes are invisible to every reader here and are moved
aside only by :meth:`RolloutStore.repair`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import os
import socket
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, Unpack, cast

import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arguments import is_int
from maxent_arrow.arrow import lists as L
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store.history import manifest
from maxent_arrow.store.history.attempts import AttemptSpec, IfExists, next_attempt_id
from maxent_arrow.store.history.catalog import (
    History,
    OnError,
    Selection,
    Unit,
    check_history,
    check_on_error,
)
from maxent_arrow.store.history.records import (
    check_lifecycle_groups,
    lifecycle_rows,
    prepare_records,
    settle_pending,
)
from maxent_arrow.store.io.cache import unit_group_crc32, write_cache
from maxent_arrow.store.io.commit import WriteSettings
from maxent_arrow.store.io.reader import check_known_columns, read_group_file, read_table
from maxent_arrow.store.io.replay import ReplayOptions, as_batch, replay
from maxent_arrow.store.io.take import (
    current_take,
    segment_take,
    write_segment_take,
    write_take,
)
from maxent_arrow.store.io.writer import Writer
from maxent_arrow.store.readonly import ReadOnlyStore
from maxent_arrow.store.sql.session import check_timeout
from maxent_arrow.store.storage.backend import Backend, open_backend
from maxent_arrow.store.storage.caches import Cache
from maxent_arrow.store.storage.names import GROUPS, MANIFEST, cache_name, parse_name
from maxent_arrow.store.storage.padding import strip_padding
from maxent_arrow.store.storage.parquet import check_compression
from maxent_arrow.store.upkeep.compaction import Compaction, compact
from maxent_arrow.store.upkeep.repair import RepairReport, repair

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = ["DEFAULT_COMPACT_EVERY", "RolloutStore", "StoreKeywords", "StoreOptions"]

# One-step files per rank and kind that the writer merges into one segment (``compact_every``).
DEFAULT_COMPACT_EVERY = 100


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """The options of a :class:`RolloutStore` (its parameters: what each means is said
    there), checked when made. One value, so that the store opened again with the same
    options and one changed is a :func:`dataclasses.replace`
    (:meth:`RolloutStore.next_attempt`)."""

    cache: bool = False
    take: bool = True
    on_error: OnError = "raise"
    check_crc: bool = True
    compression: str = "zstd"
    compression_level: int | None = 1
    compact_every: int | None = DEFAULT_COMPACT_EVERY
    lock_timeout: float | None = None
    query_timeout: float | None = None
    if_exists: IfExists | None = None
    resume_from: int | None = None
    attempt: str | None = None
    role: str = "trainer"
    attempts: History = "effective"
    resume_kinds: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        every = self.compact_every
        if every is not None and (not is_int(every) or every < 2):
            raise StoreError(f"compact_every: expected None or an int >= 2, got {every!r}")
        check_on_error(self.on_error)
        check_history(self.attempts)
        _, level = check_compression(self.compression, self.compression_level)
        object.__setattr__(self, "compression_level", level)
        object.__setattr__(self, "lock_timeout", check_timeout(self.lock_timeout))
        object.__setattr__(self, "query_timeout", check_timeout(self.query_timeout))
        object.__setattr__(self, "cache", bool(self.cache))
        object.__setattr__(self, "take", bool(self.take))
        object.__setattr__(self, "check_crc", bool(self.check_crc))

    def attempt_spec(self) -> AttemptSpec:
        """How this store object's writes begin their attempt (checked here)."""
        return AttemptSpec(
            if_exists=self.if_exists,
            resume_from=self.resume_from,
            attempt=self.attempt,
            role=self.role,
            resume_kinds=self.resume_kinds,
        )


class StoreKeywords(TypedDict, total=False):
    """:class:`StoreOptions` as keywords of :class:`RolloutStore` (a test keeps the two
    declarations the same)."""

    cache: bool
    take: bool
    on_error: OnError
    check_crc: bool
    compression: str
    compression_level: int | None
    compact_every: int | None
    lock_timeout: float | None
    query_timeout: float | None
    if_exists: IfExists | None
    resume_from: int | None
    attempt: str | None
    role: str
    attempts: History
    resume_kinds: Mapping[str, int] | None


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
    take:
        Also write every appended step's take file (``root/take``, one Arrow IPC batch per
        group, :mod:`~maxent_arrow.store.io.take`), so that the replay sampler's random
        groups read and check only their own bytes; without one a group is read from its
        step's row group of the archive. On by default.
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
    if_exists, resume_from, resume_kinds, attempt, role:
        How this object's writes begin their attempt, in a store with a commit log
        (:class:`~maxent_arrow.store.history.attempts.AttemptSpec`): a fresh run into a store that
        holds steps of an earlier run is refused (``if_exists="error"``, the default) before
        anything is written; ``resume_from=step`` resumes it at a checkpoint's step (the
        stored steps from there on are superseded), ``if_exists="resume"`` continues after
        its last step, ``if_exists="new_attempt"`` records a re-run that supersedes it all;
        ``resume_kinds`` a kind's own resume point (``{"eval": s + 1}``).
        Ranks of one launch share one attempt
        (:func:`~maxent_arrow.store.history.attempts.default_attempt_id`).
    attempts:
        Which history the readers of this object see (``"effective"``, ``"all"``,
        ``"superseded"``; :class:`ReadOnlyStore`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Backend,
        options: StoreOptions | None = None,
        /,
        *,
        filesystem: pafs.FileSystem | None = None,
        **keywords: Unpack[StoreKeywords],
    ):
        try:
            options = dataclasses.replace(options or StoreOptions(), **keywords)
        except TypeError as exc:  # an unknown keyword
            raise ArgumentError(f"RolloutStore: {exc}") from None
        super().__init__(
            root,
            filesystem=filesystem,
            on_error=options.on_error,
            check_crc=options.check_crc,
            query_timeout=options.query_timeout,
            attempts=options.attempts,
        )
        self.options = options
        self.attempt_spec = options.attempt_spec()
        if options.if_exists is not None or options.resume_from is not None:
            # A resume or a re-run is a write: refused now by a store that cannot be written
            # (a store without a commit log), not silently ignored.
            resume = options.resume_from is not None
            self.catalog.writable("a resume" if resume else f"if_exists={options.if_exists!r}")
        self.lock_timeout = options.lock_timeout
        self.compact_every = options.compact_every
        self.cache_enabled = options.cache
        self.compression, self.compression_level = options.compression, options.compression_level
        self.settings = WriteSettings(
            options.compression, options.compression_level, options.lock_timeout
        )

    @functools.cached_property
    def writer(self) -> Writer:
        """The writer of this store object, built on the first append (a store only read
        never builds one)."""
        return Writer(
            self.catalog,
            self.schemas,
            self.settings,
            cache=self.cache_enabled,
            take=self.options.take,
            attempt=self.attempt_spec,
        )

    def begin_attempt(self, *, config: Mapping[str, Any] | None = None) -> str:
        """Begin this object's attempt now (an append begins it otherwise), so that a fresh
        run into a store holding an earlier run's steps is refused before any training
        step: call it when the trainer starts. ``config``: the run config to record with
        the attempt. Returns the attempt id. A store without a commit log refuses it
        (:class:`~maxent_arrow.errors.ReadOnlyFormatError`)."""
        return self.writer.begin_attempt(config=config)

    def next_attempt(
        self,
        *,
        resume_from: int | None = None,
        if_exists: IfExists | None = None,
        resume_kinds: Mapping[str, int] | None = None,
    ) -> RolloutStore:
        """This store opened again, with this object's options and history, for the next
        trainer run of this process: an attempt of its own
        (:func:`~maxent_arrow.store.history.attempts.next_attempt_id` of this object's attempt id).
        For a trainer that learns where it resumes only when it starts
        (``train(resume_from_checkpoint=...)``).

        ``resume_from``: the run resumes at that step (a checkpoint's), whatever this object
        says for a fresh run (a different resume point of its own is refused). Otherwise a
        fresh run, as ``if_exists`` says, by default as this object does (``"error"``:
        refused by :meth:`begin_attempt` when the store holds an earlier run's steps; a
        ``"resume"`` of this object keeps its resume point)."""
        spec = self.attempt_spec
        own = spec.resume_from if spec.if_exists == "resume" else None
        if resume_from is not None:
            if own is not None and own != resume_from:
                raise ArgumentError(
                    f"{self.uri}: this store object resumes at step {own}, the run at step "
                    f"{resume_from}; open it without resume_from= (the checkpoint says where "
                    "the run resumes)"
                )
            if_exists = "resume"
        else:
            if_exists = if_exists or spec.if_exists
            resume_from = own if if_exists == "resume" else None
        if resume_kinds is None and resume_from is not None and resume_from == own:
            resume_kinds = spec.resume_kinds  # this object's own resume point, as it says
        options = dataclasses.replace(
            self.options,
            if_exists=if_exists,
            resume_from=resume_from,
            attempt=next_attempt_id(spec.id),
            role=spec.role,
            attempts=self.catalog.history,
            resume_kinds=resume_kinds if resume_from is not None else None,
        )
        return type(self)(self.backend, options)

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str] | Backend,
        *,
        config: Mapping[str, Any] | None = None,
        filesystem: pafs.FileSystem | None = None,
        **options: Unpack[StoreKeywords],
    ) -> RolloutStore:
        """Create a store at ``root`` and return it, open to write.

        ``config`` (a dict or :class:`~maxent_arrow.rollout.RunConfig`) goes into a new
        store's manifest. Ranks creating one store at once all succeed with one manifest. A
        non-empty directory that is not a store is refused, and nothing is written into it.
        ``if_exists``: what a store already there means for this run, as in the constructor
        (``"error"``: a fresh run into a store that holds steps is refused at its first
        write; ``"resume"``; ``"new_attempt"``). Not given, an existing store is opened and
        continued (``"resume"``), as before, with a DeprecationWarning: say which.
        ``options`` are those of the constructor.
        """
        backend = open_backend(root, filesystem)
        existed = backend.stat(MANIFEST) is not None
        manifest.create(backend, config)
        if_exists = options.get("if_exists")
        if existed and if_exists is None and options.get("resume_from") is None:
            warnings.warn(
                f"RolloutStore.create({backend.uri!r}): the store exists; opening it without "
                "if_exists= is deprecated (pass if_exists='resume' to continue it, 'error' to "
                "refuse a fresh run into it, or 'new_attempt')",
                DeprecationWarning,
                stacklevel=2,
            )
            options["if_exists"] = "resume"
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

    def append_records(self, name: str, rows: Any) -> int:
        """Append ``rows`` (a pyarrow Table or RecordBatch) to record table ``name``: a
        registered one (``trainer_metrics``, ``lifecycle``: checked against the registry) or
        a table of the user's own (``[a-z][a-z0-9_]*``; each column keeps its first type).
        Committed through the log as this object's attempt
        (:mod:`~maxent_arrow.store.history.records`); returns the log version. Bad rows raise
        :class:`SchemaError` naming the column and row, and nothing is written. A
        ``lifecycle`` record addresses exactly one stored group of the effective history
        (else a :class:`ShapeError` naming it)."""
        if name == R.LIFECYCLE:
            rows = prepare_records(name, rows)
            self._check_lifecycle(rows)
        return self.writer.append_records(name, rows)

    def _check_lifecycle(self, records: pa.Table) -> None:
        """Refuse ``lifecycle`` records that do not each address one stored group: the key
        columns of the effective units of the steps they name, matched. A unit's keys are
        read once per store object (:attr:`_unit_keys`: a committed unit's rows never
        change), so a consumer that records every batch (the replay sampler) reads each
        unit's keys once, not once per batch."""
        steps = pc.unique(records.column("rollout_step")).to_pylist()
        with self.catalog.snapshot():
            catalog = self.catalog.with_history("effective")
            units = catalog.units(Selection(steps, on_error=self.on_error))
            keys = {u: (u.group_file, u.start, u.num_groups, u.step, u.rank, u.kind) for u in units}
            found = {u: hit for u in units if (hit := self._unit_keys.get(keys[u])) is not None}
            missing = [u for u in units if u not in found]
            if missing:
                unified = self.schemas.visible(GROUPS, self.on_error)
                selection = Selection(
                    {u.step for u in missing}, columns=list(R.ROW_KEY), on_error=self.on_error
                )
                rows = read_table(catalog, unified, GROUPS, selection, crc=self.check_crc)
                for u in missing:  # (scalars from buffers: a Python value imports pandas)
                    step = pc.equal(rows["step"], L.int64_scalar(u.step))
                    rank = pc.equal(rows["rank"], L.int64_scalar(u.rank))
                    kind = pc.equal(rows["kind"], L.text_scalar(u.kind))
                    found[u] = rows.filter(pc.and_(pc.and_(step, rank), kind))
                    self._unit_keys.put(keys[u], found[u])
        if found:
            stored = pa.concat_tables([found[u] for u in units], promote_options="permissive")
        else:
            stored = S.empty(pa.schema([f for f in S.group_schema() if f.name in R.ROW_KEY]))
        check_lifecycle_groups(records, stored)

    @functools.cached_property
    def _unit_keys(self) -> Cache[tuple[Any, ...], pa.Table]:
        """The keys (step, rank, kind, group_index) of the committed units this object
        checked lifecycle records against, by group file, rows and unit (bounded)."""
        return Cache("unit keys", 4096, "the group keys of units lifecycle records named")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_unit_keys", None)  # (holds a lock; filled again on use)
        return state

    def checkpoint(self) -> int:
        """Write a checkpoint of the commit log now (also ``log/_checkpoint.parquet``: what
        plain readers read, ``docs/commit-protocol.md``) and return its version. Writers
        write one every 100 commits; call it (or ``maxent-arrow checkpoint``) when a run
        ends, or use the store as a context manager, which does on exit.

        On an object whose writer committed for its attempt, it first records that the
        attempt ended (a row of the ``attempt_ends`` record table): what tells a finished
        attempt from a crashed one (``inspect``'s attempt status). An attempt that commits
        again afterwards is unfinished again."""
        settle_pending(self.uri)  # (rows this process handed a background writer)
        if "writer" in self.__dict__ and self.writer.committed:
            self._record_end()
        return self.catalog.writable("a checkpoint").write_checkpoint()

    def _record_end(self) -> None:
        """The ``attempt_ends`` row of this object's attempt: when, and which process."""
        row = {
            "ended_at": pa.array([dt.datetime.now(dt.UTC)], pa.timestamp("us", tz="UTC")),
            "host": pa.array([socket.gethostname()], pa.string()),
            "pid": pa.array([os.getpid()], pa.int64()),
        }
        self.writer.append_records(R.ATTEMPT_ENDS, pa.table(row))

    def __enter__(self) -> RolloutStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """A checkpoint of the log when this object committed anything (a failure to write
        it is a warning: nothing committed depends on it); left without an exception, the
        end of this object's attempt is recorded with it (:meth:`checkpoint`)."""
        self.close()  # the SQL session sql() holds
        settle_pending(self.uri)  # (rows this process handed a background writer)
        if "writer" in self.__dict__ and self.writer.committed:
            try:
                if kind is None:
                    self.checkpoint()
                else:  # the attempt did not finish: a checkpoint only
                    self.catalog.writable("a checkpoint").write_checkpoint()
            except (OSError, StoreError) as error:
                warnings.warn(f"{self.uri}: no checkpoint written at close ({error})", stacklevel=2)

    def record_lifecycle(
        self, groups: pa.Table, *, step: int, event: str, reason: str | None = None
    ) -> int:
        """Record what became of the stored ``groups`` (rows as :meth:`read` returns them,
        with ``step``, ``rank``, ``kind``, ``group_index`` and, when numbered,
        ``stream_index``) at trainer step ``step``: ``event="trained"``, or ``"dropped"``
        with a ``reason`` (``zero_std``, ``stale``, ``filtered``, ``failed``, ``aborted``).
        Record it when the decision is made, in the trainer step it belongs to: a resume at
        an earlier step supersedes it (``docs/commit-protocol.md``, "Lifecycle")."""
        return self.append_records(
            R.LIFECYCLE, lifecycle_rows(groups, step=step, event=event, reason=reason)
        )

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
                    Selection(kind=kind, ranks=[rank]),
                    Compaction(loose_only=True),
                    self.settings,
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
            groups = strip_padding(table.slice(unit.start, unit.num_groups), R.GROUP)
            step_row = strip_padding(step.table.slice(unit.row, 1), R.STEP)
            batch = RolloutBatch(groups, step_row, validate=False)
            write_cache(self.backend, batch, unit.name, unit_group_crc32(step, unit.name))
            made += 1
        return made

    def build_takes(self, *, steps: Iterable[int] | None = None, kind: str | None = None) -> int:
        """Write the take file (:mod:`~maxent_arrow.store.io.take`) of every committed unit
        that has none of its commit (a store written before take files, or with
        ``take=False``), each from its own rows of the archive (checked); returns how many."""
        made = 0
        units = self.units(kind=kind, steps=steps)
        segments: dict[str, list[Unit]] = {}
        for unit in units:
            if self.catalog.step_file(unit.step_file).meta.get("unit_crc32"):
                segments.setdefault(unit.step_file, []).append(unit)
        served: set[str] = set()  # the segments with a take file of their own
        for name, members in segments.items():  # a segment's: one for all its units
            step = self.catalog.step_file(name)
            if len(members) != len(step.starts):
                continue  # not all its units chosen: theirs, below
            served.add(name)
            if segment_take(self.backend, step) is not None:
                continue
            table = read_group_file(self.backend, step, None, crc=self.check_crc)
            order = sorted(members, key=lambda u: u.start)
            write_segment_take(
                self.backend, table, step.name, step.meta.get("group_crc32"),
                [(u.name, u.num_groups) for u in order],
            )  # fmt: skip
            made += 1
        for unit in units:
            step = self.catalog.step_file(unit.step_file)
            if unit.step_file in served or current_take(self.backend, step, unit.name):
                continue
            rows = (unit.start, unit.num_groups)
            table = read_group_file(self.backend, step, None, crc=self.check_crc, rows=rows)
            groups = strip_padding(as_batch(table), R.GROUP)
            write_take(self.backend, groups, unit.name, unit_group_crc32(step, unit.name))
            made += 1
        return made

    # ------------------------------------------------------------------ replay
    def replay(
        self, options: ReplayOptions | None = None, /, **kwargs: Any
    ) -> Iterator[RolloutBatch]:
        """Stream committed steps back as :class:`RolloutBatch` objects, one file at a time.

        Options are those of :class:`~maxent_arrow.store.io.replay.ReplayOptions` (``steps``,
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
        drop_superseded: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Any]:
        """Merge committed files (of ``kind``, ``steps`` and ``ranks``, if given; at most
        ``max_steps`` steps per segment) into segments, each committed atomically with the
        list of files it replaces: readers see the old files or the segment, never both and
        never neither, also after a crash. ``drop_superseded``: first retire the steps that a
        resumed attempt superseded (they leave ``attempts="all"`` too). Local stores, and
        object stores with a commit log. Returns the new step files.
        ``progress(done, total)``: told of the files merged so far (a progress bar)."""
        return compact(
            self.catalog,
            self.schemas,
            Selection(steps, kind, ranks),
            Compaction(max_steps=max_steps, drop_superseded=drop_superseded),
            self.settings,
            progress,
        )

    def repair(self) -> RepairReport:
        """Move leftovers of crashed writes (temp files of writers that are gone, uncommitted
        group files, files a committed compaction replaced) into ``quarantine/``; says what it
        moved. Local stores only."""
        return repair(self.catalog, lock_timeout=self.lock_timeout)
