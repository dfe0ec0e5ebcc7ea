"""The identity columns of group rows written whole by one rank.

Schema 2.0 stores, for every group row, its ``kind``, a run-wide ``group_id``, the whole
group's size ``group_size``, this row's ``num_completions`` and each completion's
``completion_index`` in the group (``docs/arrow-layout.md``). A trainer that keeps a prompt's
completions on one rank writes them all from the group sizes alone; one that spreads them over
ranks gives its own ids and indices.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow.lists import regroup

__all__ = ["completion_index", "default_group_ids", "identity_columns"]


def completion_index(sizes: np.ndarray) -> pa.Array:
    """``list<int32>`` of ``0..K_i-1`` for rows of ``sizes`` completions."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], sizes)
    return regroup(pa.array(flat.astype(np.int32)), offsets)


def default_group_ids(step: int, rank: int, count: int) -> pa.Array:
    """``"{step}.{rank}.{group_index}"`` for the ``count`` groups of one step of one rank:
    unique within a step (a trainer with its own prompt ids passes those instead)."""
    return pa.array([f"{step}.{rank}.{g}" for g in range(count)], pa.string())


def identity_columns(step: int, rank: int, kind: str, sizes: np.ndarray) -> dict[str, pa.Array]:
    """``kind``, ``group_index``, ``group_id``, ``group_size``, ``num_completions`` and
    ``completion_index`` of groups of ``sizes`` completions, each written whole."""
    sizes = np.asarray(sizes, dtype=np.int32)
    p = len(sizes)
    return {
        "kind": pa.array([kind] * p, pa.string()),
        "group_index": pa.array(np.arange(p, dtype=np.int32)),
        "group_id": default_group_ids(step, rank, p),
        "group_size": pa.array(sizes),
        "num_completions": pa.array(sizes),
        "completion_index": completion_index(sizes),
    }
