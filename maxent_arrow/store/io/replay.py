"""Replay of a rollout store: a resumable, shardable stream of :class:`RolloutBatch`.

The plan (which batches, in which order) is computed from the step files alone, before any
group data is read, so resuming from a cursor skips batches without reading them, and every
rank and worker derives the same plan and takes a disjoint share of it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from maxent_arrow.arguments import check_int, int_set
from maxent_arrow.arrow import list_offsets
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.rollout import RolloutBatch, reassemble
from maxent_arrow.store.history.catalog import (
    Catalog,
    OnError,
    Selection,
    Unit,
    check_on_error,
    fail,
    is_missing,
)
from maxent_arrow.store.io.cache import read_cache
from maxent_arrow.store.io.reader import read_group_file
from maxent_arrow.store.storage.padding import strip_padding

__all__ = [
    "SOURCES",
    "as_batch",
    "ReplayOptions",
    "Source",
    "check_shard",
    "check_source",
    "load_unit_groups",
    "completion_counts",
    "partial_step_row",
    "replay",
    "sample_count",
    "unit_step_row",
]

Source = Literal["auto", "cache", "mapped", "parquet"]
SOURCES: tuple[Source, ...] = ("auto", "cache", "mapped", "parquet")


def check_source(source: object, *, where: str) -> None:
    """``source`` is one of :data:`SOURCES`, else an :class:`ArgumentError` naming ``where``."""
    if not isinstance(source, str) or source not in SOURCES:
        raise ArgumentError(
            f"{where}: source must be one of {', '.join(map(repr, SOURCES))}, got {source!r}"
        )


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """What :meth:`RolloutStore.replay` streams, and how.

    Parameters
    ----------
    steps, kind:
        Which steps (default: all ``"train"`` steps; ``kind=None`` for every kind), in
        ascending (step, kind, rank) order.
    batch_groups:
        Split each step into batches of at most this many groups (never mixing steps).
    shuffle, seed:
        Shuffle the order of the batches and the groups inside them, reproducibly.
    start:
        A cursor (``batch.cursor`` of a batch yielded earlier by the same replay) to resume
        after that batch; the plan (store contents and arguments) must be the same.
    shard:
        ``(index, count)``: keep only this consumer's share of the batches (round robin),
        disjoint across the ``count`` consumers (ranks times data-loader workers). Not the
        rank that *wrote* a step (``RolloutStore.read(ranks=)``).
    rank, world_size:
        Deprecated spelling of ``shard=(rank, world_size)``.
    columns:
        Group columns to read (default all).
    source:
        ``"cache"`` reads the IPC copies (the columns served copied into memory of the
        reader's own and hashed in the same pass: a program truncating the file under a
        batch kills no reader); ``"mapped"`` serves the IPC copies' mapping itself, checked
        in place (no copy, as torch's mapped load: such a truncation then ends the
        process with SIGBUS); ``"parquet"`` decodes the archive; ``"auto"`` uses the cache
        (as ``"cache"``) where a copy of the committed file exists.
    on_error:
        ``"raise"`` on a damaged file (naming it) or ``"skip"`` it with a warning; default
        the store's.
    whole_groups:
        One batch per (step, kind) holding every rank's rows, with the parts of a group that
        ranks stored separately merged into one row
        (:func:`~maxent_arrow.rollout.reassemble`; TRL spreads a prompt's completions over
        processes). Not with ``batch_groups`` (a step's group count is known once merged);
        ``shuffle`` shuffles the batches and the groups inside each.
    """

    steps: Iterable[int] | int | None = None
    batch_groups: int | None = None
    shuffle: bool = False
    seed: int = 0
    start: Any = None
    shard: tuple[int, int] | None = None
    rank: int | None = None
    world_size: int | None = None
    kind: str | None = "train"
    columns: list[str] | None = None
    source: Source = "auto"
    on_error: OnError | None = None
    whole_groups: bool = False

    def selection(self, on_error: OnError) -> Selection:
        """The committed rows this replay serves (its steps, kind and columns)."""
        return Selection(self.steps, self.kind, columns=self.columns, on_error=on_error)

    def __post_init__(self) -> None:
        if self.whole_groups and self.batch_groups is not None:
            raise ArgumentError(
                "replay: whole_groups gives one batch per step; batch_groups cannot split it "
                "(its group count is known once the ranks' parts are merged)"
            )
        b = self.batch_groups
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ArgumentError(f"replay: batch_groups must be a positive int, got {b!r}")
        if self.steps is not None:
            int_set(self.steps, what="replay: steps")
        columns = self.columns
        if columns is not None and (
            isinstance(columns, str | bytes)
            or not isinstance(columns, list | tuple)
            or not all(isinstance(c, str) for c in columns)
        ):
            raise ArgumentError(f"replay: columns must be a list of column names, got {columns!r}")
        # (numpy seeds its generators with ints >= 0 only)
        check_int(self.seed, "replay: seed", low=0)
        if self.rank is not None or self.world_size is not None:
            if self.shard is not None:
                raise ArgumentError("replay: give shard=(index, count), not also rank/world_size")
            if self.rank is None or self.world_size is None:
                raise ArgumentError("replay: give both rank and world_size, or neither")
            warnings.warn(
                "replay(rank=, world_size=) is deprecated: use shard=(index, count) (the "
                "consumer's share; `rank` elsewhere means the rank that wrote a step)",
                DeprecationWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "shard", (self.rank, self.world_size))
        if self.shard is not None:
            object.__setattr__(self, "shard", check_shard(self.shard, where="replay"))
        check_source(self.source, where="replay")
        if self.on_error is not None:
            check_on_error(self.on_error)


def check_shard(shard: Any, *, where: str) -> tuple[int, int]:
    """``shard`` as ``(index, count)`` with ``0 <= index < count``, else an
    :class:`ArgumentError` naming ``where``."""
    try:
        index, count = shard
    except (TypeError, ValueError):
        raise ArgumentError(f"{where}: shard must be (index, count), got {shard!r}") from None
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (index, count))
    if not ints or count < 1 or not 0 <= index < count:
        raise ArgumentError(
            f"{where}: shard must be (index, count) with 0 <= index < count, got {shard!r}"
        )
    return index, count


@dataclass(frozen=True)
class _Item:
    unit: int
    lo: int
    hi: int
    order: np.ndarray | None = None  # group indices (shuffled), else lo:hi


def _plan(units: list[Unit], batch_groups: int | None, shuffle: bool, seed: int) -> list[_Item]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(units)) if shuffle else np.arange(len(units))
    items: list[_Item] = []
    for u in order.tolist():
        count = units[u].num_groups
        size = count if batch_groups is None else batch_groups
        groups = rng.permutation(count) if shuffle else None
        for lo in range(0, max(count, 1), max(size, 1)):
            hi = min(lo + size, count)
            items.append(_Item(u, lo, hi, None if groups is None else groups[lo:hi]))
    return items


def _fingerprint(units: list[Unit], **params: Any) -> str:
    text = json.dumps({"units": [u.name for u in units], **params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _position(start: Any, fingerprint: str, count: int) -> int:
    """Where a replay of ``count`` batches starts: after the batch ``start`` (a cursor, its
    JSON text, or a position) was yielded."""
    if start is None:
        return 0
    given = start
    if isinstance(start, str):
        try:
            start = json.loads(start)
        except ValueError:
            raise ArgumentError(
                f"replay: start must be a cursor from batch.cursor, got {given!r}"
            ) from None
    if isinstance(start, dict) and "position" in start:
        if start.get("fingerprint") not in (None, fingerprint):
            raise StoreError(
                "replay: the cursor was made by a different replay (other steps, arguments or "
                "store contents); pass the same steps=, batch_groups=, shuffle=, seed= and "
                "shard= to resume"
            )
        position = start["position"]
    else:
        position = start
    # A position counts batches already yielded: never negative (a Python index from the end
    # would replay the last batches again) and never past the plan.
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= count:
        raise ArgumentError(
            f"replay: start must be a cursor from batch.cursor (a position in [0, {count}] of "
            f"this replay), got {given!r}"
        )
    return position


def replay(
    catalog: Catalog, options: ReplayOptions, *, on_error: OnError, crc: bool
) -> Iterator[RolloutBatch]:
    """The batches of ``options``' plan, from its cursor on (see :class:`ReplayOptions`)."""
    o = options
    units = catalog.units(o.selection(on_error))
    items = _plan(units, o.batch_groups, o.shuffle, o.seed)
    fingerprint = _fingerprint(
        units,
        batch_groups=o.batch_groups,
        shuffle=o.shuffle,
        seed=o.seed,
        shard=o.shard,
    )
    if o.whole_groups:
        fingerprint = _fingerprint(units, whole_groups=True, shuffle=o.shuffle, seed=o.seed)
        merged = _by_step(units, o.shuffle, o.seed)
        if o.shard is not None:
            merged = merged[o.shard[0] :: o.shard[1]]
        position = _position(o.start, fingerprint, len(merged))
        return _iterate_whole(catalog, merged, position, fingerprint, o, on_error, crc)
    if o.shard is not None:
        items = items[o.shard[0] :: o.shard[1]]
    position = _position(o.start, fingerprint, len(items))
    return _iterate(catalog, units, items, position, fingerprint, o, on_error, crc)


def load_unit_groups(
    catalog: Catalog,
    unit: Unit,
    *,
    columns: list[str] | None = None,
    source: Source = "auto",
    crc: bool = True,
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """The group rows and the step row of one committed ``unit``, read as :func:`replay`
    reads them (the IPC cache where asked, checksums checked when ``crc``): the loader the
    replay sampler (:mod:`maxent_arrow.store.feed.sampler`) shares with the replay stream."""
    return _load_unit(catalog, unit, ReplayOptions(columns=columns, source=source), crc)


def _by_step(units: list[Unit], shuffle: bool, seed: int) -> list[list[Unit]]:
    """The units of each (step, kind), in plan order (shuffled when asked)."""
    steps: dict[tuple[int, str], list[Unit]] = {}
    for unit in units:
        steps.setdefault((unit.step, unit.kind), []).append(unit)
    merged = list(steps.values())
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(merged))
        merged = [merged[i] for i in order]
    return merged


def _iterate_whole(
    catalog: Catalog,
    merged: list[list[Unit]],
    position: int,
    fingerprint: str,
    options: ReplayOptions,
    on_error: OnError,
    crc: bool,
) -> Iterator[RolloutBatch]:
    for index in range(position, len(merged)):
        _release_unused()  # (the previous step was dropped after its yield)
        try:
            loaded = [_load_unit(catalog, unit, options, crc) for unit in merged[index]]
        except StoreError as exc:
            fail(on_error, exc)
            continue
        parts = [pa.Table.from_batches([groups]) for groups, _ in loaded]
        groups = as_batch(reassemble(pa.concat_tables(parts, promote_options="default")))
        if options.shuffle:
            order = np.random.default_rng([options.seed, index]).permutation(groups.num_rows)
            groups = groups.take(pa.array(order))
        step_row = partial_step_row(loaded[0][1], groups)  # the lowest rank's scalars
        batch = RolloutBatch(groups, step_row, validate=False)
        batch.cursor = {"position": index + 1, "fingerprint": fingerprint}
        yield batch
        del batch, groups, parts, loaded


def _iterate(
    catalog: Catalog,
    units: list[Unit],
    items: list[_Item],
    position: int,
    fingerprint: str,
    options: ReplayOptions,
    on_error: OnError,
    crc: bool,
) -> Iterator[RolloutBatch]:
    loaded: tuple[int, pa.RecordBatch, pa.RecordBatch] | None = None
    for index in range(position, len(items)):
        item = items[index]
        unit = units[item.unit]
        try:
            if loaded is None or loaded[0] != item.unit:
                loaded = None  # drop the previous step before reading the next
                _release_unused()
                loaded = (item.unit, *_load_unit(catalog, unit, options, crc))
        except StoreError as exc:
            fail(on_error, exc)
            continue
        _, groups, step_row = loaded
        if item.order is not None:
            part = groups.take(pa.array(item.order))
        elif item.lo == 0 and item.hi == groups.num_rows:
            part = groups
        else:
            part = groups.slice(item.lo, item.hi - item.lo)
        if part.num_rows != groups.num_rows:
            step_row = partial_step_row(step_row, part)
        batch = RolloutBatch(part, step_row, validate=False)
        batch.cursor = {"position": index + 1, "fingerprint": fingerprint}
        yield batch
        # Hold no reference to this step while the next one loads (peak memory: one step).
        del batch, part, groups


def _release_unused() -> None:
    """Hand the memory pool's freed pages back to the system before the next step decodes
    (~0.1 ms): what the last step's decode freed is not kept beside the next one's."""
    pa.default_memory_pool().release_unused()


def as_batch(table: pa.Table) -> pa.RecordBatch:
    """``table`` as one record batch (its chunks combined; an empty one of its schema)."""
    if table.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    return table.combine_chunks().to_batches()[0]


def _load_unit(
    catalog: Catalog, unit: Unit, options: ReplayOptions, crc: bool
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """:func:`_load` of ``unit`` where the plan found it, or, if a compaction has replaced
    that file since (and its retired copy is gone too), where the commit record has it now:
    a unit's rows never change, whichever file holds them."""
    try:
        return _load(catalog, unit, options, crc)
    except StoreError as exc:
        if not is_missing(exc):
            raise
        moved = _current(catalog, unit)
        if moved is None:
            raise
        return _load(catalog, moved, options, crc)


def _current(catalog: Catalog, unit: Unit) -> Unit | None:
    """``unit`` as the commit record has it now, if another file holds it than the plan's."""
    try:
        now = catalog.units(Selection([unit.step], unit.kind, [unit.rank]))
    except StoreError:
        return None
    for other in now:
        if (other.step, other.rank, other.kind) == (unit.step, unit.rank, unit.kind):
            return other if other.step_file != unit.step_file else None
    return None


def _load(
    catalog: Catalog, unit: Unit, options: ReplayOptions, crc: bool
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    step = catalog.step_file(unit.step_file)
    step_row = unit_step_row(catalog, unit)
    groups = None
    if options.source != "parquet":
        try:
            # Only the columns served are checked (and copied in, unless "mapped").
            groups = read_cache(
                catalog.backend,
                step,
                unit.name,
                check=crc,
                columns=options.columns,
                private=options.source != "mapped",
            )
        except StoreError:
            if options.source != "auto":
                raise
            groups = None
        if groups is None and options.source != "auto":
            raise StoreError(f"{catalog.backend.uri}: no IPC cache copy of {unit.name}")
        if groups is not None and options.columns is not None:
            present = set(groups.schema.names)
            groups = groups.select([c for c in options.columns if c in present])
    if groups is None:
        rows = (unit.start, unit.num_groups)  # only the row groups of this unit
        table = read_group_file(catalog.backend, step, options.columns, crc=crc, rows=rows)
        groups = as_batch(table)
    # Padding of the run-wide layout reads as absent (also in caches built from the archive).
    return strip_padding(groups, R.GROUP), step_row


def completion_counts(part: pa.RecordBatch) -> np.ndarray:
    """The completions of each group row of ``part``, from whichever of its columns says
    (``num_completions``, else a per-completion or per-token column: a read of chosen
    columns may hold no ``completions``); a :class:`StoreError` when none does."""
    names = part.schema.names
    if "num_completions" in names:
        column = part.column("num_completions").fill_null(0)
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.int64)
    for name in names:
        try:
            level = R.column(name).level
        except KeyError:
            continue
        if level in ("completion", "token"):
            return np.diff(list_offsets(part.column(name))).astype(np.int64)
    if not part.num_rows:
        return np.zeros(0, dtype=np.int64)
    raise StoreError(
        f"the columns read ({', '.join(names)}) say nothing of how many completions each "
        "group holds: read num_completions or a per-completion column too"
    )


def sample_count(part: pa.RecordBatch) -> int:
    """The completions of the group rows ``part`` (:func:`completion_counts`)."""
    return int(completion_counts(part).sum())


def unit_step_row(catalog: Catalog, unit: Unit) -> pa.RecordBatch:
    """The step row of a committed ``unit`` (its layout's padding read as absent), from its
    step file's record."""
    step = catalog.step_file(unit.step_file)
    step_row = step.table.slice(unit.row, 1).combine_chunks().to_batches()[0]
    return strip_padding(step_row, R.STEP)


def partial_step_row(
    step_row: pa.RecordBatch, part: pa.RecordBatch, samples: int | None = None
) -> pa.RecordBatch:
    """The step row of a part of a step: same scalars, its own group and sample counts
    (``samples``: its completions, when ``part`` holds no column that says:
    :func:`sample_count`)."""
    samples = sample_count(part) if samples is None else samples
    names = step_row.schema.names
    arrays = list(step_row.columns)
    # From numpy: a list of Python ints would make pyarrow import pandas.
    arrays[names.index("num_groups")] = pa.array(np.array([part.num_rows], np.int32))
    arrays[names.index("num_samples")] = pa.array(np.array([samples], np.int32))
    return pa.RecordBatch.from_arrays(arrays, schema=step_row.schema)
