"""Replay of a rollout store: a resumable, shardable stream of :class:`RolloutBatch`, and a torch
``IterableDataset`` over it for ``DataLoader`` workers and ``accelerate`` processes.

The plan (which batches, in which order) is computed from the step files alone, before any
group data is read, so resuming from a cursor skips batches without reading them, and every
rank and worker derives the same plan and takes a disjoint share of it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from maxent_arrow.errors import StoreError
from maxent_arrow.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from maxent_arrow.store.store import OnError, RolloutStore, _Unit

__all__ = [
    "replay",
    "write_cache",
]


@dataclass(frozen=True)
class _Item:
    unit: int
    lo: int
    hi: int
    order: np.ndarray | None = None  # group indices (shuffled), else lo:hi


def _plan(units: list[_Unit], batch_groups: int | None, shuffle: bool, seed: int) -> list[_Item]:
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


def _fingerprint(units: list[_Unit], **params: Any) -> str:
    text = json.dumps({"units": [u.name for u in units], **params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _position(start: Any, fingerprint: str) -> int:
    if start is None:
        return 0
    if isinstance(start, str):
        start = json.loads(start)
    if isinstance(start, int) and not isinstance(start, bool):
        return start
    if not isinstance(start, dict) or "position" not in start:
        raise StoreError(f"replay: start must be a cursor from batch.cursor, got {start!r}")
    if start.get("fingerprint") not in (None, fingerprint):
        raise StoreError(
            "replay: the cursor was made by a different replay (other steps, arguments or store "
            "contents); pass the same steps=, batch_groups=, shuffle=, seed=, rank= and "
            "world_size= to resume"
        )
    return int(start["position"])


def replay(
    store: RolloutStore,
    *,
    steps: Iterable[int] | None,
    batch_groups: int | None,
    shuffle: bool,
    seed: int,
    start: Any,
    rank: int | None,
    world_size: int | None,
    kind: str | None,
    columns: list[str] | None,
    source: str,
    on_error: OnError,
) -> Iterator[RolloutBatch]:
    if batch_groups is not None and (
        isinstance(batch_groups, bool) or not isinstance(batch_groups, int) or batch_groups < 1
    ):
        raise StoreError(f"replay: batch_groups must be a positive int, got {batch_groups!r}")
    if (rank is None) != (world_size is None):
        raise StoreError("replay: give both rank and world_size, or neither")
    if world_size is not None and not 0 <= rank < world_size:
        raise StoreError(f"replay: rank must be in [0, {world_size}), got {rank}")
    if source not in ("auto", "cache", "parquet"):
        raise StoreError(f"replay: source must be 'auto', 'cache' or 'parquet', got {source!r}")
    units = store._units(kind=kind, steps=steps, on_error=on_error)
    items = _plan(units, batch_groups, shuffle, seed)
    fingerprint = _fingerprint(
        units, batch_groups=batch_groups, shuffle=shuffle, seed=seed, rank=rank, world=world_size
    )
    if world_size is not None:
        items = items[rank::world_size]
    position = _position(start, fingerprint)
    return _iterate(store, units, items, position, fingerprint, columns, source, on_error)


def _load_cache(store: RolloutStore, unit: _Unit) -> pa.RecordBatch | None:
    import pyarrow.ipc as ipc

    path = store._cache_dir / (unit.name.removesuffix(".parquet") + ".arrow")
    if not path.exists():
        return None
    path = store._path(store._cache_dir, path.name)
    try:
        # Memory-mapped and zero-copy: nothing is read until a column is touched.
        reader = ipc.open_file(pa.memory_map(str(path), "r"))
        return reader.get_batch(0)
    except (pa.ArrowException, OSError) as exc:
        raise StoreError(f"{path}: unreadable IPC cache file ({exc})") from None


def _iterate(
    store: RolloutStore,
    units: list[_Unit],
    items: list[_Item],
    position: int,
    fingerprint: str,
    columns: list[str] | None,
    source: str,
    on_error: OnError,
) -> Iterator[RolloutBatch]:
    loaded: tuple[int, pa.RecordBatch | pa.Table, pa.RecordBatch] | None = None
    for index in range(position, len(items)):
        item = items[index]
        unit = units[item.unit]
        try:
            if loaded is None or loaded[0] != item.unit:
                loaded = None  # drop the previous step before reading the next
                loaded = (item.unit, *_load(store, unit, columns, source))
        except StoreError as exc:
            store._fail(on_error, exc)
            continue
        _, groups, step_row = loaded
        if item.order is not None:
            part = groups.take(pa.array(item.order))
        elif item.lo == 0 and item.hi == groups.num_rows:
            part = groups
        else:
            part = groups.slice(item.lo, item.hi - item.lo)
        if part.num_rows != groups.num_rows:
            step_row = _partial_step_row(step_row, part)
        batch = RolloutBatch(part, step_row, validate=False)
        batch.cursor = {"position": index + 1, "fingerprint": fingerprint}
        yield batch
        # Hold no reference to this step while the next one loads (peak memory: one step).
        del batch, part, groups


def _load(store: RolloutStore, unit: _Unit, columns: list[str] | None, source: str):
    step_table, meta = store._step_table(unit.step_file)
    step_row = step_table.slice(unit.row, 1).combine_chunks().to_batches()[0]
    groups = None
    if source in ("auto", "cache"):
        try:
            groups = _load_cache(store, unit)
        except StoreError:
            if source == "cache":
                raise
            groups = None
        if groups is None and source == "cache":
            raise StoreError(f"{store.root}: no IPC cache copy of {unit.name}")
        if groups is not None and columns is not None:
            groups = groups.select([c for c in columns if c in groups.schema.names])
    if groups is None:
        table = store._read_group_file(unit.group_file, meta, columns)
        if unit.start or unit.num_groups != table.num_rows:
            table = table.slice(unit.start, unit.num_groups)
        batches = table.combine_chunks().to_batches()
        groups = batches[0] if len(batches) == 1 else pa.Table.from_batches(batches)
        if isinstance(groups, pa.Table):
            groups = groups.combine_chunks().to_batches()[0]
        if table.num_rows == 0:
            groups = pa.RecordBatch.from_pylist([], schema=table.schema)
    return groups, step_row


def _partial_step_row(step_row: pa.RecordBatch, part: pa.RecordBatch) -> pa.RecordBatch:
    """The step row of a part of a step: same scalars, its own group and sample counts."""
    completions = part.column("completions")
    offsets = completions.offsets.to_numpy()
    samples = int(offsets[-1] - offsets[0]) if len(offsets) else 0
    if part.num_rows and completions.offset:
        samples = int(np.diff(offsets[: part.num_rows + 1]).sum())
    names = step_row.schema.names
    arrays = list(step_row.columns)
    arrays[names.index("num_groups")] = pa.array([part.num_rows], pa.int32())
    arrays[names.index("num_samples")] = pa.array([samples], pa.int32())
    return pa.RecordBatch.from_arrays(arrays, schema=step_row.schema)


def write_cache(store: RolloutStore, batch: RolloutBatch, name: str) -> Path:
    """Write the IPC cache copy of a committed step (uncompressed: memory-mappable)."""
    import pyarrow.ipc as ipc

    from maxent_arrow.rollout.batch import STEP_META_KEY, step_row_to_json
    from maxent_arrow.store.files import write_atomic

    path = store._path(store._cache_dir, name.removesuffix(".parquet") + ".arrow")
    store._cache_dir.mkdir(exist_ok=True)
    meta = dict(batch.groups.schema.metadata or {})
    meta[STEP_META_KEY] = step_row_to_json(batch.step_row).encode()
    groups = batch.groups.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, groups.schema) as writer:
        writer.write_batch(groups)
    write_atomic(path, sink.getvalue(), overwrite=True)
    return path
