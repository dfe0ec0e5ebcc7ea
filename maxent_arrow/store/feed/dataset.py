"""``ReplayDataset``: a torch ``IterableDataset`` over :meth:`RolloutStore.replay`, for
``DataLoader`` workers and ``accelerate`` processes (this module imports torch)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed
import torch.utils.data

from maxent_arrow.errors import ArgumentError
from maxent_arrow.store.feed.sampler import ReplaySampler, SamplerOptions
from maxent_arrow.store.io.replay import check_shard
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
        The store: a directory or a URI such as ``s3://…`` (opened inside each worker).
    transform:
        Applied to each :class:`RolloutBatch` in the worker (e.g. to build padded tensors);
        default: the batch itself.
    shard:
        ``(index, count)`` of this process among the consumers (default: the process rank
        and count, :func:`process_shard`); each data-loader worker takes its part of it.
    rank, world_size:
        Deprecated spelling of ``shard=(rank, world_size)``.
    sampler:
        Sample whole groups through the replay sampler
        (:class:`~.sampler.ReplaySampler`) with these options instead of
        streaming the replay plan: each item is a
        :class:`~.sampler.SampledBatch`; the sampler's share is this
        worker's (its options' ``shard`` is set per process and worker).
    **replay_kwargs:
        ``steps``, ``batch_groups``, ``shuffle``, ``seed``, ``kind``, ``columns``, ``source``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        transform: Callable[[Any], Any] | None = None,
        shard: tuple[int, int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        sampler: SamplerOptions | None = None,
        **replay_kwargs: Any,
    ):
        super().__init__()
        # A URI stays a string: a Path would turn ``s3://b/run`` into a local ``s3:/b/run``.
        self.root = os.fspath(root)
        self.transform = transform
        if rank is not None or world_size is not None:
            if shard is not None or rank is None:
                raise ArgumentError("ReplayDataset: give shard=(index, count) only")
            warnings.warn(
                "ReplayDataset(rank=, world_size=) is deprecated: use shard=(index, count)",
                DeprecationWarning,
                stacklevel=2,
            )
            shard = (rank, world_size or 1)
        self.shard = None if shard is None else check_shard(shard, where="ReplayDataset")
        self.replay_kwargs = replay_kwargs
        if sampler is not None and (replay_kwargs or sampler.shard is not None):
            raise ArgumentError(
                "ReplayDataset: with sampler=, the options are the sampler's (and its shard "
                "is set per process and worker)"
            )
        self.sampler = sampler
        for bad in ("shard", "rank", "world_size", "start"):
            if bad in replay_kwargs:
                raise ArgumentError(
                    f"ReplayDataset: {bad} is set per process and worker, not in kwargs"
                )

    def __iter__(self) -> Iterator[Any]:
        index, count = process_shard() if self.shard is None else self.shard
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        store = RolloutStore(self.root)
        if self.sampler is not None:
            shard = (index * workers + worker, count * workers)
            options = dataclasses.replace(self.sampler, shard=shard)
            for sampled in ReplaySampler(store, options):
                yield sampled if self.transform is None else self.transform(sampled)
            return
        stream = store.replay(
            shard=(index * workers + worker, count * workers), **self.replay_kwargs
        )
        for batch in stream:
            yield batch if self.transform is None else self.transform(batch)
