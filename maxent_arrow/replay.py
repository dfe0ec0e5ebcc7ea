"""Replay of a rollout store: a resumable, shardable stream of :class:`RolloutBatch`, and a torch
``IterableDataset`` over it for ``DataLoader`` workers and ``accelerate`` processes.

The plan (which batches, in which order) is computed from the step files alone, before any
group data is read, so resuming from a cursor skips batches without reading them, and every
rank and worker derives the same plan and takes a disjoint share of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from maxent_arrow.batch import RolloutBatch
from maxent_arrow.errors import StoreError

if TYPE_CHECKING:
    from maxent_arrow.store import OnError, RolloutStore, _Unit

__all__ = [
    "replay",
    "write_cache",
    "ReplayDataset",
    "process_shard",
    "recompute",
    "RECOMPUTE_DEFAULTS",
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


def process_shard() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: accelerate's when it is set up, else torch
    distributed's, else ``(0, 1)``."""
    try:
        from accelerate.state import PartialState

        if PartialState._shared_state:  # initialised by an Accelerator or PartialState()
            state = PartialState()
            return int(state.process_index), int(state.num_processes)
    except ImportError:
        pass
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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

    from maxent_arrow.batch import STEP_META_KEY, step_row_to_json
    from maxent_arrow.store_files import write_atomic

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


# ---------------------------------------------------------------------------- torch
def _dataset_base():
    import torch.utils.data

    return torch.utils.data.IterableDataset


class ReplayDataset(_dataset_base()):
    """A torch ``IterableDataset`` over :meth:`RolloutStore.replay`.

    Each ``DataLoader`` worker of each process takes a disjoint, round-robin share of the
    replay plan (process rank and count from ``accelerate`` when it is set up, else
    ``torch.distributed``, else one process), so no group is seen twice across workers and
    ranks. Use ``DataLoader(dataset, batch_size=None)``: each item is already a batch.

    Parameters
    ----------
    root:
        The store directory (the store is opened inside each worker).
    transform:
        Applied to each :class:`RolloutBatch` in the worker (e.g. to build padded tensors);
        default: the batch itself.
    rank, world_size:
        Override the process shard.
    **replay_kwargs:
        ``steps``, ``batch_groups``, ``shuffle``, ``seed``, ``kind``, ``columns``, ``source``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        transform: Callable[[RolloutBatch], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        **replay_kwargs: Any,
    ):
        super().__init__()
        self.root = Path(root)
        self.transform = transform
        self.rank = rank
        self.world_size = world_size
        self.replay_kwargs = replay_kwargs
        for bad in ("rank", "world_size", "start"):
            if bad in replay_kwargs:
                raise StoreError(f"ReplayDataset: {bad} is set per process/worker, not in kwargs")

    def __iter__(self) -> Iterator[Any]:
        import torch.utils.data

        from maxent_arrow.store import RolloutStore

        if self.rank is None:
            rank, world = process_shard()
        else:
            rank, world = self.rank, self.world_size or 1
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        store = RolloutStore(self.root)
        stream = store.replay(
            rank=rank * workers + worker, world_size=world * workers, **self.replay_kwargs
        )
        for batch in stream:
            yield batch if self.transform is None else self.transform(batch)


# ---------------------------------------------------------------------------- recompute
# Config keys (in the step's ``config`` snapshot) that the derived quantities depend on, with
# the defaults of the original pipeline (semantics §3.2, §3.4, §3.6).
RECOMPUTE_DEFAULTS: dict[str, Any] = {
    "scale_rewards": True,
    "advantage_eps": 1e-4,
    "q_temperature": 1.0,
    "q_epsilon": 1e-6,
    "tau": None,
    "beta": 0.0,
    "weight_denominator": "tau",
    "len_norm_ref": True,
    "length_reweight": False,
}


def recompute(batch: RolloutBatch, **overrides: Any) -> dict[str, Any]:
    """Advantages, q and MaxEnt weights of a replayed step, from its stored facts.

    Uses the stored utilities ``total_utils`` (after any entropy bonus), the stored SEED-GRPO
    group scales, the stored reference sums and token counts, and the step's config snapshot
    (keys of :data:`RECOMPUTE_DEFAULTS`; ``overrides`` replace them, e.g. a new ``tau``).
    Returns :class:`~maxent_arrow.Ragged` values keyed ``"advantages"``, ``"q"`` and, when
    ``tau`` and the reference columns are known, ``"weights"``, grouped like the batch.
    """
    import torch

    from maxent_arrow import compute as C

    unknown = set(overrides) - set(RECOMPUTE_DEFAULTS)
    if unknown:
        raise StoreError(f"recompute: unknown settings {sorted(unknown)}")
    config = batch.config
    cfg = {k: config.get(k, v) for k, v in RECOMPUTE_DEFAULTS.items()} | overrides
    utils = batch.ragged("total_utils")
    if utils is None:
        raise StoreError(f"recompute: step {batch.step} has no total_utils column")
    utils = utils.with_values(utils.values.to(torch.float64))
    adv = C.group_advantages(
        utils, scale_rewards=bool(cfg["scale_rewards"]), eps=cfg["advantage_eps"]
    )
    scales = batch.column("seed_advantage_scale")
    if scales is not None and scales.null_count == 0:
        adv = C.apply_group_scales(adv, torch.from_numpy(scales.to_numpy(zero_copy_only=False)))
    q = C.q_distribution(utils, temperature=cfg["q_temperature"], epsilon=cfg["q_epsilon"])
    out: dict[str, Any] = {"advantages": adv, "q": q}
    raw, counts = batch.ragged("ref_logp_sum_raw"), batch.ragged("ref_tok_counts")
    if cfg["tau"] is not None and raw is not None and counts is not None:
        t = counts.values.to(torch.float64)
        # ρ = R / max(T, 1) (the seed's `ref_logp_sum`) or the raw sum R.
        rho = raw.values / t.clamp(min=1) if cfg["len_norm_ref"] else raw.values
        out["weights"] = C.maxent_weights(
            q,
            rho,
            tau=cfg["tau"],
            beta=cfg["beta"],
            denominator=cfg["weight_denominator"],
            token_counts=t,
            length_reweight=bool(cfg["length_reweight"]),
        )
    return out
