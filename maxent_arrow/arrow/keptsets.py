"""Kept-token sets: per token, the vocabulary ids a sampler kept after top-k / top-p / min-p,
stored gap-coded (``kept_token_ids``, ``docs/arrow-layout.md``, "Kept sets").

A set is stored ascending as its first id, then each id minus the one before (every gap after
the first is >= 1). With Parquet's byte-stream split and zstd the gaps' low and high bytes
compress apart: a top-k of 64 over a 32k vocabulary takes about 1.36 bytes per kept id. Dense
sets need no bitmap form: random sets of a 32k vocabulary (zstd 1) take 0.60 bytes per id at
10 % of the vocabulary (a bitmap: 1.25), 0.32 at 50 % (a bitmap: 0.25) and 0.135 at 90 % (a
bitmap: 0.139), since the gaps are then mostly 1. Everything is numpy over offsets, no torch
and no loop over tokens.

The column is ``list<list<large_list<int32>>>``: one list per completion, one set per token;
the innermost offsets are int64, since a step's kept ids pass int32 (512 x 16 completions of
1024 tokens at top-k 64 are 5.4e8 ids).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow.lists import list_offsets, regroup, single_array
from maxent_arrow.errors import LayoutError

__all__ = [
    "KEPT_IDS_TYPE",
    "decode_gaps",
    "encode_gaps",
    "find_in_sets",
    "first_bad_gap",
    "kept_ids_array",
    "token_sets",
]

_ITEM = pa.field("item", pa.int32(), nullable=False)
KEPT_IDS_TYPE = pa.list_(
    pa.field("item", pa.list_(pa.field("item", pa.large_list(_ITEM), nullable=False)), False)
)


def _starts(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    return offsets[:-1][nonempty], lengths


def first_bad_gap(gaps: np.ndarray, offsets: np.ndarray) -> int | None:
    """The flat position of the first gap code that breaks the rule of a stored set (its first
    id >= 0, every later gap >= 1: ascending, no id twice), or ``None`` when all keep it."""
    gaps = np.asarray(gaps)
    starts, _ = _starts(np.asarray(offsets, dtype=np.int64))
    first = np.zeros(len(gaps), dtype=bool)
    first[starts] = True
    bad = np.flatnonzero(np.where(first, gaps < 0, gaps <= 0))
    return int(bad[0]) if bad.size else None


def encode_gaps(ids: np.ndarray, offsets: np.ndarray, *, where: str = "kept_token_ids") -> np.ndarray:
    """Gap codes (int32) of the sets ``ids[offsets[t]:offsets[t+1]]`` (each sorted ascending
    first; an id twice in one set, or a negative id, is a :class:`LayoutError` naming the set)."""
    ids = np.asarray(ids, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    if len(ids) != (int(offsets[-1]) if len(offsets) else 0):
        raise LayoutError(f"{where}: offsets end at {int(offsets[-1])}, values are {len(ids)}")
    lengths = np.diff(offsets)
    owner = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    order = np.lexsort((ids, owner))  # ascending within each set, sets in place
    ids = ids[order]
    gaps = np.diff(ids, prepend=np.int64(0))
    starts, _ = _starts(offsets)
    gaps[starts] = ids[starts]
    bad = first_bad_gap(gaps, offsets)
    if bad is not None:
        t = int(owner[bad])
        if ids[bad] < 0:  # sorted: a negative id comes first in its set
            raise LayoutError(f"{where}: a negative id in set {t}")
        raise LayoutError(f"{where}: id {int(ids[bad])} twice in set {t}")
    if ids.size and int(ids.max()) > np.iinfo(np.int32).max:
        raise LayoutError(f"{where}: an id does not fit int32")
    return gaps.astype(np.int32)


def decode_gaps(gaps: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The ids (int64) of gap codes ``gaps`` of the sets delimited by ``offsets``."""
    total = np.cumsum(np.asarray(gaps, dtype=np.int64))
    starts, lengths = _starts(np.asarray(offsets, dtype=np.int64))
    base = np.zeros(len(lengths), dtype=np.int64)
    nonempty = lengths > 0
    before = starts - 1
    base[nonempty] = np.where(before >= 0, total[np.maximum(before, 0)], 0)
    return total - np.repeat(base, lengths)


def find_in_sets(
    set_ids: np.ndarray,
    set_offsets: np.ndarray,
    ids: np.ndarray,
    owner: np.ndarray,
    *,
    ascending: bool = False,
) -> np.ndarray:
    """Where each ``ids[j]`` stands in set ``owner[j]`` (the sets ``set_ids[set_offsets[t]:
    set_offsets[t+1]]``): its flat position in ``set_ids``, -1 where the set lacks it. One
    search over ``(set, id)`` keys, no loop over sets; ``ascending=True`` when every set is
    sorted already (a decoded kept set), which spares the sort. Ids must be below 2**32."""
    set_ids = np.asarray(set_ids, dtype=np.int64)
    set_offsets = np.asarray(set_offsets, dtype=np.int64)
    sets = np.repeat(np.arange(len(set_offsets) - 1, dtype=np.int64), np.diff(set_offsets))
    keys = sets << 32 | set_ids
    order = None if ascending else np.argsort(keys, kind="stable")
    if order is not None:
        keys = keys[order]
    wanted = np.asarray(owner, dtype=np.int64) << 32 | np.asarray(ids, dtype=np.int64)
    if not len(keys):
        return np.full(len(wanted), -1, dtype=np.int64)
    hit = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    found = keys[hit] == wanted
    position = hit if order is None else order[hit]
    return np.where(found, position, -1).astype(np.int64)


def kept_ids_array(
    ids: np.ndarray,
    set_offsets: np.ndarray,
    token_offsets: np.ndarray,
    group_offsets: np.ndarray,
    *,
    where: str = "kept_token_ids",
) -> pa.Array:
    """The ``kept_token_ids`` column: sets ``ids[set_offsets[t]:set_offsets[t+1]]`` of every
    token, tokens of completion ``i`` at ``token_offsets[i]:token_offsets[i+1]``, completions of
    group ``g`` at ``group_offsets[g]:group_offsets[g+1]``."""
    set_offsets = np.asarray(set_offsets, dtype=np.int64)
    gaps = encode_gaps(ids, set_offsets, where=where)
    sets = pa.LargeListArray.from_arrays(pa.array(set_offsets), pa.array(gaps, pa.int32()))
    sets = sets.cast(KEPT_IDS_TYPE.value_type.value_type)
    per_completion = regroup(sets, np.asarray(token_offsets, dtype=np.int64))
    return regroup(per_completion, np.asarray(group_offsets, dtype=np.int64)).cast(KEPT_IDS_TYPE)


def token_sets(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, set_offsets)`` of a ``kept_token_ids`` column (or of its per-completion or
    per-token flattening): every token's kept ids, decoded, in token order (int64)."""
    sets = single_array(column)
    while not pa.types.is_large_list(sets.type):
        sets = sets.flatten()
    offsets = list_offsets(sets)
    gaps = np.asarray(sets.flatten().to_numpy(zero_copy_only=False))
    offsets = offsets - offsets[0] if len(offsets) else offsets
    return decode_gaps(gaps, offsets), offsets
