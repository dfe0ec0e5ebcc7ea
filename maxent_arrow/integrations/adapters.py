"""What every trainer adapter builds the same way: the group rows of a trainer's padded batch.

A recorder for a trainer (:mod:`.trl`, :mod:`.verl`, the next one) turns the trainer's padded
tensors into the group rows of ``docs/arrow-layout.md``. What does not depend on the trainer
lives here, so a new adapter copies none of it:

- un-padding is :meth:`maxent_arrow.Ragged.from_padded` (by lengths or by a mask, on the host
  or the device); :func:`token_lists` makes a per-token column ``list<list<T>>`` of its rows;
- :func:`truncation_flags`: which completions were cut at the length limit (the last token is
  neither an EOS nor the pad token), and :func:`completion_info`, the ``completion_info``
  column they imply (token count, truncation, finish reason);
- :func:`reward_columns`: ``reward_names`` / ``reward_values`` (each function's raw reward)
  and ``total_utils`` (their weighted ``nansum``);
- the identity columns of the rows (whole groups or parts of them) are
  :class:`maxent_arrow.arrow.GroupIdentity`, the one builder every writer uses;
- :func:`row_sums`: per-completion sums of flat per-token values (``ref_logp_sum_raw``,
  ``behavior_logp_sum``); :func:`offsets_of`: offsets from lengths;
- :func:`offpolicy_columns`: the off-policy contract's per-completion columns of a batch whose
  completions share one policy version, log-prob semantics and sampling parameters.

Per-completion values are grouped with :func:`maxent_arrow.arrow.regroup` over the group
offsets. Everything is vectorised (numpy and Arrow; no Python loop over rows); the step row is
:func:`.steps.step_row`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import regroup
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError

__all__ = [
    "completion_info",
    "offpolicy_columns",
    "offsets_of",
    "reward_columns",
    "row_sums",
    "token_lists",
    "truncation_flags",
]


def offsets_of(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """int64 offsets (``len(lengths) + 1``, from 0) of rows of ``lengths`` entries."""
    counts = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def token_lists(
    flat: np.ndarray | pa.Array,
    token_offsets: np.ndarray,
    group_offsets: np.ndarray,
    *,
    item: pa.DataType | None = None,
) -> pa.Array:
    """A per-token column: ``list<list<item>>``, one inner list per completion (rows of
    ``token_offsets`` over ``flat``), grouped by ``group_offsets`` (completions per row).

    The items are non-nullable, as the group schema declares them (``item``: their type,
    default ``flat``'s; a ``fixed_size_list`` carries several values per token).
    """
    values: pa.Array = flat if isinstance(flat, pa.Array) else pa.array(flat)
    inner = pa.ListArray.from_arrays(pa.array(np.asarray(token_offsets, np.int32)), values)
    kind = item if item is not None else values.type
    inner = inner.cast(pa.list_(pa.field("item", kind, nullable=False)))
    return regroup(inner, np.asarray(group_offsets, np.int64))


def truncation_flags(
    ids: torch.Tensor | np.ndarray,
    lengths: torch.Tensor | np.ndarray | Sequence[int],
    *,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
) -> np.ndarray:
    """Which completions were truncated: bool ``[B]``, true where the last token
    (``ids[i, lengths[i] - 1]`` of the right-padded ``[B, C]`` ids) is neither one of
    ``eos_token_ids`` nor ``pad_token_id`` (TRL's rule); an empty completion is not truncated.

    ``ids`` on an accelerator are read there (one gather, ``B`` values copied back).
    """
    counts = lengths.cpu().numpy() if isinstance(lengths, torch.Tensor) else lengths
    counts = np.asarray(counts, dtype=np.int64)
    if ids.shape[0] != len(counts):
        raise LayoutError(
            f"truncation_flags: lengths: expected {ids.shape[0]} entries (the rows of ids), "
            f"got {len(counts)}"
        )
    last_position = np.maximum(counts - 1, 0)
    if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
        where = torch.as_tensor(last_position, device=ids.device)
        last = ids.gather(1, where[:, None])[:, 0].cpu().numpy()
    else:
        data = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        last = data[np.arange(len(counts)), last_position] if len(counts) else data[:0, 0]
    stops = [*eos_token_ids, *([] if pad_token_id is None else [pad_token_id])]
    return ~np.isin(last, stops) & (counts > 0)


def completion_info(lengths: np.ndarray, truncated: np.ndarray) -> pa.StructArray:
    """The ``completion_info`` column of completions (one struct each): ``finish_reason``
    (``"length"`` when truncated, else ``"stop"``), ``truncated`` and ``token_count``; the
    other fields null."""
    n = len(lengths)
    truncated = np.asarray(truncated, dtype=bool)
    return pa.StructArray.from_arrays(
        [
            pa.array(np.where(truncated, "length", "stop"), pa.string()),
            pa.nulls(n, pa.string()),
            pa.array(truncated),
            pa.array(np.asarray(lengths).astype(np.int32)),
            pa.nulls(n, pa.string()),
        ],
        fields=list(S.COMPLETION_INFO_TYPE),
    )


def reward_columns(
    values: np.ndarray,
    reward_names: Sequence[str],
    reward_weights: Sequence[float],
    group_offsets: np.ndarray,
    *,
    where: str = "reward_columns",
) -> dict[str, pa.Array]:
    """``reward_names`` / ``reward_values`` and ``total_utils`` of ``[B, F]`` raw rewards
    (one column per reward function, NaN where a function returned ``None``), grouped by
    ``group_offsets``.

    ``total_utils`` is the weighted ``nansum`` over the functions, NaN where every function
    returned ``None`` (an unscorable completion). ``where`` names the caller in errors.
    """
    values = np.asarray(values, dtype=np.float64)
    b, f = values.shape
    if f != len(reward_names) or f != len(reward_weights):
        raise LayoutError(
            f"{where}: rewards: expected {len(reward_names)} columns (one per reward "
            f"function), got {f}"
        )
    p = len(group_offsets) - 1
    names = pa.ListArray.from_arrays(
        pa.array(np.arange(0, (p + 1) * f, f, dtype=np.int32)),
        pa.array(list(reward_names) * p, pa.string()),
    )
    inner = pa.ListArray.from_arrays(
        pa.array(np.arange(0, (b + 1) * f, f, dtype=np.int32)), pa.array(values.reshape(-1))
    )
    weighted = np.nansum(values * np.asarray(reward_weights, np.float64)[None, :], axis=1)
    weighted[np.isnan(values).all(axis=1)] = np.nan
    return {
        "reward_names": names,
        "reward_values": regroup(inner, group_offsets),
        "total_utils": regroup(pa.array(weighted), group_offsets),
    }


def row_sums(flat: np.ndarray, token_offsets: np.ndarray) -> np.ndarray:
    """float64 sum of each completion's per-token values (rows of ``token_offsets`` over
    ``flat``); 0 for an empty completion.

    One ``np.add.reduceat`` over the non-empty rows only: with an empty row among its starts
    ``reduceat`` gives that row a value and, at the end, cuts the row before it short.
    """
    offsets = np.asarray(token_offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    sums = np.zeros(len(lengths))
    full = lengths > 0
    if full.any():
        sums[full] = np.add.reduceat(np.asarray(flat, dtype=np.float64), offsets[:-1][full])
    return sums


def offpolicy_columns(
    values: Mapping[str, Any], n: int, grouped: Callable[[pa.Array], pa.Array]
) -> dict[str, pa.Array]:
    """The off-policy contract's per-completion columns (``docs/arrow-layout.md``, "Off-policy
    data") for ``n`` completions sharing ``values``: ``policy_version``, ``logp_semantics``
    and the sampling parameters ``temperature``, ``top_p``, ``top_k``, ``min_p`` (each left
    out when None), grouped by ``grouped``."""
    names = {
        "policy_version": "completion_policy_version",
        "logp_semantics": "behavior_logp_semantics",
        **R.SAMPLING_COLUMNS,
    }
    return {
        name: grouped(pa.array(np.full(n, values[key])).cast(R.column(name).leaf))
        for key, name in names.items()
        if values.get(key) is not None
    }
