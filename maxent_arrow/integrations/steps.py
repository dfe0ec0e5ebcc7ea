"""The step row of a group table that another trainer's recorder built: counts, reward
moments, length statistics, the reference and KL summaries, and the run config, all computed
from the group columns (vectorised), so a recorder only builds the group rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import schema as S
from maxent_arrow.rollout import RunConfig, StepHeader

__all__ = ["step_row"]

_STEP_TYPES = {f.name: f.type for f in S.STEP_FIELDS}


def _flat(groups: pa.Table, name: str, depth: int = 1) -> pa.ChunkedArray | None:
    if name not in groups.schema.names or groups.column(name).null_count == len(groups):
        return None
    column = groups.column(name)
    for _ in range(depth):
        column = pc.list_flatten(column)
    return column


def _numbers(column: pa.ChunkedArray | None) -> np.ndarray | None:
    if column is None:
        return None
    return np.asarray(column.to_numpy(), dtype=np.float64)


def _mean(values: np.ndarray) -> float | None:
    kept = values[~np.isnan(values)]
    return float(kept.mean()) if len(kept) else None


def step_row(
    groups: pa.Table,
    *,
    step: int,
    rank: int,
    kind: str,
    config: RunConfig | Mapping[str, Any] | None = None,
    max_completion_len: int | None = None,
) -> pa.RecordBatch:
    """The one-row step table of ``groups`` (one step of one rank).

    Reward moments are over ``total_utils`` (NaN utilities, unscorable completions, left
    out; population std). Length statistics use the ``completion_ids`` lengths and, with
    ``max_completion_len``, count a completion of that length as clipped. ``ref_logp_mean``
    and ``avg_completion_tokens`` come from ``ref_logp_sum_raw``/``ref_tok_counts``;
    ``kl_value`` is the token mean of the k3 KL between ``ref_token_logp`` and
    ``behavior_token_logp``, and the KL by length bucket is its per-completion mean, weighted
    by the token counts, per bucket. What a column does not allow is left null.
    """
    if isinstance(config, RunConfig):
        text = config.to_json()
    else:
        text = RunConfig.from_dict(dict(config or {})).to_json()
    sizes = pc.list_value_length(groups.column("completions")).to_numpy()
    values = StepHeader(
        step=step,
        rank=rank,
        kind=kind,
        num_groups=groups.num_rows,
        num_samples=int(np.sum(sizes)),
        config=text,
    ).values()
    utils = _numbers(_flat(groups, "total_utils"))
    if utils is not None and (~np.isnan(utils)).any():
        kept = utils[~np.isnan(utils)]
        values["reward_mean"], values["reward_std"] = float(kept.mean()), float(kept.std())
    ids = _flat(groups, "completion_ids")
    if ids is not None and len(ids) and max_completion_len:
        values.update(_length_stats(pc.list_value_length(ids).to_numpy(), max_completion_len))
    raw, counts = (
        _numbers(_flat(groups, "ref_logp_sum_raw")),
        _numbers(_flat(groups, "ref_tok_counts")),
    )
    if raw is not None and counts is not None and len(raw):
        values["ref_logp_mean"] = _mean(raw / np.maximum(counts, 1.0))
        values["avg_completion_tokens"] = float(counts.mean())
    ref, behavior = (
        _numbers(_flat(groups, "ref_token_logp", 2)),
        _numbers(_flat(groups, "behavior_token_logp", 2)),
    )
    if ref is not None and behavior is not None and len(ref) == len(behavior) and len(ref):
        delta = np.clip(ref - behavior, -60.0, 60.0)
        k3 = np.expm1(delta) - delta
        values["kl_value"] = _mean(k3)
        tokens = pc.list_value_length(_flat(groups, "ref_token_logp")).to_numpy()
        values.update(_kl_buckets(k3, tokens.astype(np.int64)))
    names = [f.name for f in S.STEP_FIELDS if f.name in values]
    fields = [pa.field(n, _STEP_TYPES[n], nullable=n not in S.STEP_REQUIRED) for n in names]
    return pa.RecordBatch.from_pydict({n: [values[n]] for n in names}, schema=pa.schema(fields))


def _kl_buckets(k3: np.ndarray, tokens: np.ndarray) -> dict[str, list]:
    """The per-token KL by completion-length bucket (``BatchDiagnostics``, ``docs/formulas.md``
    §3.10): per completion the token mean ``kl_i``, then ``Σ kl_i t_i / Σ t_i`` per bucket of
    ``t_i = max(T_i, 1)``; empty buckets are left out, as the trainer's diagnostics do."""
    starts = np.concatenate([[0], np.cumsum(tokens)[:-1]])
    sums = np.add.reduceat(k3, starts) if len(k3) else np.zeros(len(tokens))
    sums = np.where(tokens > 0, sums, 0.0)  # reduceat gives the next value for an empty row
    t = np.maximum(tokens, 1).astype(np.float64)
    kl = sums / t
    labels = list(S.KL_LENGTH_BUCKETS)
    bounds = [b for b in S.KL_LENGTH_BUCKETS.values() if b is not None]
    index = np.searchsorted(np.asarray(bounds, np.float64), t, side="left")
    weighted = np.bincount(index, weights=kl * t, minlength=len(labels))
    support = np.bincount(index, weights=t, minlength=len(labels))
    kept = np.flatnonzero(support > 0)
    return {
        "kl_length_buckets": [labels[i] for i in kept],
        "kl_per_token_by_len_bucket": [float(weighted[i] / support[i]) for i in kept],
        "kl_token_count_by_len_bucket": [float(support[i]) for i in kept],
    }


def _length_stats(lengths: np.ndarray, cap: int) -> dict[str, float]:
    """LengthStats of the token counts (``docs/formulas.md`` §2.13)."""
    t = lengths.astype(np.float64)
    clipped = t >= cap
    done = t[~clipped]
    return {
        "min_length": float(t.min()),
        "mean_length": float(t.mean()),
        "max_length": float(t.max()),
        "clipped_ratio": float(clipped.mean()),
        "min_terminated": float(done.min()) if len(done) else 0.0,
        "mean_terminated": float(done.mean()) if len(done) else 0.0,
        "max_terminated": float(done.max()) if len(done) else 0.0,
    }
