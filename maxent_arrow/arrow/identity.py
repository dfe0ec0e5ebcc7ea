"""The identity columns of group rows: one builder for every writer.

Schema 2.0 stores, for every group row, its ``kind``, a run-wide ``group_id``, the whole
group's size ``group_size``, this row's ``num_completions`` and each completion's
``completion_index`` in the group (``docs/arrow-layout.md``); 2.1 adds the generation
``round``. A trainer that keeps a prompt's completions on one rank writes them all from the
group sizes alone; one that spreads them over ranks gives its own ids, sizes and indices
(:class:`GroupIdentity`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow.lists import regroup
from maxent_arrow.errors import LayoutError

__all__ = ["GroupIdentity", "completion_index_of", "default_group_ids"]


_INDEX_TYPE = pa.list_(pa.field("item", pa.int32(), nullable=False))


def completion_index_of(sizes: np.ndarray) -> pa.Array:
    """``list<int32>`` of ``0..K_i-1`` for rows of ``sizes`` completions."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], sizes)
    return regroup(pa.array(flat.astype(np.int32)), offsets).cast(_INDEX_TYPE)


def default_group_ids(step: int, rank: int, count: int) -> pa.Array:
    """``"{step}.{rank}.{group_index}"`` for the ``count`` groups of one step of one rank:
    unique within a step (a trainer with its own prompt ids passes those instead)."""
    return pa.array([f"{step}.{rank}.{g}" for g in range(count)], pa.string())


@dataclasses.dataclass(frozen=True)
class GroupIdentity:
    """Where each group row sits in the run: the identity columns of the group table (the
    column registry's ``identity`` columns, one field each), built for a trainer that writes
    whole groups (:meth:`of`, from the group sizes) or spreads them over ranks (its own ids,
    whole-group sizes and completion indices). :meth:`columns` gives them by name."""

    step: pa.Array
    rank: pa.Array
    kind: pa.Array
    group_index: pa.Array
    group_id: pa.Array
    group_size: pa.Array
    num_completions: pa.Array
    completion_index: pa.Array
    round: pa.Array

    @classmethod
    def of(
        cls,
        *,
        step: int,
        rank: int,
        kind: str,
        group_offsets: np.ndarray,
        group_ids: pa.Array | Sequence[str] | None = None,
        group_size: int | np.ndarray | None = None,
        completion_index: pa.Array | np.ndarray | None = None,
        round: int = 0,
    ) -> GroupIdentity:
        """The identity of rows of completions ``group_offsets[g]:group_offsets[g + 1]``.

        ``group_ids``: one run-wide id per row (default ``"{step}.{rank}.{group_index}"``);
        ``group_size``: the whole group's K, one for all rows or one per row, when a row holds
        a part of its group (default: the row's own count); ``completion_index``: each
        completion's index in its whole group, flat (default counted ``0..K_i-1``);
        ``round``: the generation round within the step."""
        offsets = np.asarray(group_offsets, dtype=np.int64)
        p = len(offsets) - 1
        counts = np.diff(offsets).astype(np.int32)
        ids: pa.Array
        if group_ids is None:
            ids = default_group_ids(step, rank, p)
        elif isinstance(group_ids, pa.Array):
            ids = group_ids
        else:
            ids = pa.array(list(group_ids), pa.string())
        if len(ids) != p:
            raise LayoutError(f"group_ids: expected {p} ids (one per row), got {len(ids)}")
        sizes = counts if group_size is None else np.broadcast_to(np.asarray(group_size), (p,))
        if completion_index is None:
            index = completion_index_of(counts)
        else:
            flat: pa.Array = (
                completion_index
                if isinstance(completion_index, pa.Array)
                else pa.array(np.asarray(completion_index, np.int32))
            )
            index = regroup(flat.cast(pa.int32()), offsets).cast(_INDEX_TYPE)
        return cls(
            step=pa.array(np.full(p, step, np.int64)),
            rank=pa.array(np.full(p, rank, np.int32)),
            kind=pa.array([kind] * p, pa.string()),
            group_index=pa.array(np.arange(p, dtype=np.int32)),
            group_id=ids.cast(pa.string()),
            group_size=pa.array(np.asarray(sizes, dtype=np.int32)),
            num_completions=pa.array(counts),
            completion_index=index,
            round=pa.array(np.full(p, round, np.int32)),
        )

    def columns(self) -> dict[str, pa.Array]:
        """The identity columns by name, in layout order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
