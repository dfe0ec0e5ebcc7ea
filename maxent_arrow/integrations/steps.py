"""The step row of a group table that another trainer's recorder built: counts, reward
moments, length statistics, the reference and KL summaries, and the run config, all computed
from the group columns (vectorised) by the one definition of each statistic
(:mod:`maxent_arrow.compute.group_math`, :func:`maxent_arrow.compute.kl_by_length_bucket`),
so a recorder only builds the group rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import schema as S
from maxent_arrow.compute import (
    clipped_flags,
    k3,
    kl_by_length_bucket,
    length_summary,
    scored_moments,
)
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
    """A float64 copy (writable: torch refuses to wrap Arrow's read-only memory)."""
    if column is None:
        return None
    return np.array(column.to_numpy(), dtype=np.float64)


def _mean(values: np.ndarray) -> float | None:
    kept = values[~np.isnan(values)]
    return float(kept.mean()) if len(kept) else None


def _truncated(groups: pa.Table) -> np.ndarray | None:
    """The generator's per-completion ``truncated`` flags, when every completion has one."""
    info = _flat(groups, "completion_info")
    if info is None:
        return None
    flags = pc.struct_field(info, "truncated")
    if flags.null_count:
        return None
    return np.asarray(flags.to_numpy(zero_copy_only=False), dtype=bool)


def step_row(
    groups: pa.Table,
    *,
    step: int,
    rank: int,
    kind: str,
    config: RunConfig | Mapping[str, Any] | None = None,
    max_completion_len: int | None = None,
    policy_version: int | None = None,
    metrics: Mapping[str, tuple[float, int]] | None = None,
) -> pa.RecordBatch:
    """The one-row step table of ``groups`` (one step of one rank).

    ``policy_version``: the optimizer updates the generating policy had
    (``docs/integrations.md``, "Step numbers"). ``metrics``: ``{name: (mean, count)}`` of
    scalar metrics logged while the step was scored (TRL's ``log_metric``), stored as
    ``metric_names`` / ``metric_values`` / ``metric_counts``.

    Reward moments are over ``total_utils`` (NaN utilities, unscored completions, left out
    and counted; population std, where TRL logs the Bessel-corrected one). Length statistics
    use the ``completion_ids`` lengths; a completion is clipped at ``max_completion_len`` when
    it is given, else at the config's (the cap the analytics use), else by the generator's
    ``truncated`` flag. ``ref_logp_mean``
    and ``avg_completion_tokens`` come from ``ref_logp_sum_raw``/``ref_tok_counts``;
    ``kl_value`` is the token mean of the k3 KL between ``ref_token_logp`` and
    ``behavior_token_logp``, and the KL by length bucket is its per-completion mean, weighted
    by the token counts, per bucket. What a column does not allow is left null.
    """
    run_config = (
        config if isinstance(config, RunConfig) else RunConfig.from_dict(dict(config or {}))
    )
    text = run_config.to_json()
    # One cap for the step row and the analytics: the argument, else the step's config's.
    cap = run_config.max_completion_len if max_completion_len is None else max_completion_len
    sizes = pc.list_value_length(groups.column("completions")).to_numpy()
    values = StepHeader(
        step=step,
        rank=rank,
        kind=kind,
        num_groups=groups.num_rows,
        num_samples=int(np.sum(sizes)),
        config=text,
        policy_version=policy_version,
    ).values()
    if metrics:
        values["metric_names"] = list(metrics)
        values["metric_values"] = [float(mean) for mean, _ in metrics.values()]
        values["metric_counts"] = [int(count) for _, count in metrics.values()]
    utils = _numbers(_flat(groups, "total_utils"))
    if utils is not None:
        moments = scored_moments(torch.from_numpy(utils))
        values["num_scored"] = moments.scored
        values["reward_mean"], values["reward_std"] = moments.mean, moments.std
    ids = _flat(groups, "completion_ids")
    truncated = _truncated(groups)
    if ids is not None and len(ids) and (cap or truncated is not None):
        lengths = torch.from_numpy(pc.list_value_length(ids).to_numpy().astype(np.int64))
        clipped = clipped_flags(
            lengths,
            max_completion_len=cap or None,
            truncated=None if truncated is None else torch.from_numpy(truncated),
        )
        values.update(length_summary(lengths, clipped))
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
        per_token = k3(torch.from_numpy(ref - behavior))
        values["kl_value"] = float(per_token.mean())
        tokens = torch.from_numpy(
            pc.list_value_length(_flat(groups, "ref_token_logp")).to_numpy().astype(np.int64)
        )
        # Per completion the token mean of the k3 KL (an empty completion: 0), by bucket.
        owner = torch.repeat_interleave(torch.arange(len(tokens)), tokens)
        sums = torch.zeros(len(tokens), dtype=torch.float64).index_add_(0, owner, per_token)
        per_token_kl, support = kl_by_length_bucket(sums / tokens.clamp(min=1), tokens)
        values["kl_length_buckets"] = list(per_token_kl)
        values["kl_per_token_by_len_bucket"] = list(per_token_kl.values())
        values["kl_token_count_by_len_bucket"] = [support[b] for b in per_token_kl]
    names = [f.name for f in S.STEP_FIELDS if f.name in values]
    fields = [pa.field(n, _STEP_TYPES[n], nullable=n not in S.STEP_REQUIRED) for n in names]
    return pa.RecordBatch.from_pydict({n: [values[n]] for n in names}, schema=pa.schema(fields))
