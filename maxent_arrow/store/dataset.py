"""``ReplayDataset``: a torch ``IterableDataset`` over :meth:`RolloutStore.replay`, for
``DataLoader`` workers and ``accelerate`` processes (this module imports torch)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed
import torch.utils.data

from maxent_arrow.errors import StoreError
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store.store import RolloutStore

__all__ = ["ReplayDataset", "process_shard"]


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
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ReplayDataset(torch.utils.data.IterableDataset):
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
