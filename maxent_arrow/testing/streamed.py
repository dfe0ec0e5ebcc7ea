"""The smallest batch a generator feeding a trainer writes: groups that are positions of a
prompt stream, with only the columns a batch requires (no torch, no seed objects).
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from maxent_arrow.rollout import RolloutBatch


def streamed_batch(
    step: int,
    first: int,
    size: int,
    *,
    k: int = 2,
    utils: Sequence[Sequence[float]] | None = None,
) -> RolloutBatch:
    """One train step of rank 0 holding the prompts ``first .. first + size - 1`` of a stream.

    Parameters
    ----------
    step:
        The step of the batch.
    first, size:
        The stream position of its first group and the number of groups: group ``g`` has
        ``stream_index`` ``first + g``, the prompt ``"prompt {position}"`` and the
        completions ``"completion {position}.{i}"``.
    k:
        The completions of each group.
    utils:
        ``size`` lists of ``k`` total utilities, one list a group (stored as
        ``total_utils``); none by default.

    Returns
    -------
    RolloutBatch
        A batch of the required columns, ``prompt``, ``completions`` and ``stream_index``
        (and ``total_utils`` when given): what :meth:`RolloutStore.frontier
        <maxent_arrow.store.RolloutStore.frontier>` and the lifecycle records read.
    """
    positions = range(first, first + size)
    groups: dict[str, pa.Array | list] = {}
    groups["step"] = pa.array([step] * size, pa.int64())
    groups["rank"] = pa.array([0] * size, pa.int32())
    groups["kind"] = ["train"] * size
    groups["group_index"] = pa.array(range(size), pa.int32())
    groups["group_id"] = [f"{step}.0.{g}" for g in range(size)]
    groups["group_size"] = pa.array([k] * size, pa.int32())
    groups["num_completions"] = pa.array([k] * size, pa.int32())
    groups["prompt"] = [f"prompt {p}" for p in positions]
    groups["completions"] = [[f"completion {p}.{i}" for i in range(k)] for p in positions]
    if utils is not None:
        groups["total_utils"] = [list(u) for u in utils]
    groups["stream_index"] = pa.array(positions, pa.int64())
    row: dict[str, pa.Array | list] = {}
    row["step"] = pa.array([step], pa.int64())
    row["rank"] = pa.array([0], pa.int32())
    row["kind"] = ["train"]
    row["num_groups"] = pa.array([size], pa.int32())
    row["num_samples"] = pa.array([size * k], pa.int32())
    return RolloutBatch(pa.table(groups), pa.table(row))
