"""``BatchDiagnostics``: KL and policy-vs-reference clip-region fractions.

As in the original, the ``clip_ratio*`` fields measure how far the *policy* drifted from the
*reference* (``log π_θ - log π_ref`` outside ``[ln(1 - ε_low), ln(1 + ε_high)]``), not PPO
clipping against the behaviour policy, and they are computed even when the clip objective is
off. The KL is also reported per completion-length bucket (token-weighted), with the buckets of
:data:`maxent_arrow.arrow.schema.KL_LENGTH_BUCKETS`.

Two cases, chosen by the inputs:

- per token (``token_logp`` and ``ref_token_logp``): ``kl_value`` is aggregated like the loss
  KL; per-sample ``kl_i = Σ_t k3 / Σ_t m`` with ``t_i = Σ_t m`` feeds the buckets; the
  fractions count tokens;
- per sequence (``cur_logp_sum``, ``token_counts``, ``ref_logp_mean``): ``δ_i = ρ̄_i -
  S_i/T_i``, ``kl_value`` is the *unweighted* mean of ``k3(δ_i)`` (unlike the token-weighted
  loss KL), the buckets use ``k3(δ_i)`` and ``T_i``, the fractions count sequences.

Without reference statistics every field is 0 and the bucket dicts are empty. The formulas are
``docs/formulas.md`` §3.10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.arrow.schema import KL_LENGTH_BUCKETS
from maxent_arrow.compute.kl import LossType, check_same_rows, k3, token_kl, token_rows
from maxent_arrow.compute.segments import Segments, as_sample_vector, work_dtype
from maxent_arrow.errors import ComputeError
from maxent_arrow.types import BatchDiagnostics

__all__ = ["batch_diagnostics", "kl_by_length_bucket"]

_LABELS = list(KL_LENGTH_BUCKETS)
_UPPER = [bound for bound in KL_LENGTH_BUCKETS.values() if bound is not None]


def _bucket_sums(kl: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[2, buckets]``: Σ kl_i t_i and Σ t_i per bucket, ``t_i = max(T_i, 1)``."""
    t = lengths.to(kl.dtype).clamp(min=1.0)
    bounds = torch.tensor(_UPPER, dtype=kl.dtype, device=kl.device)
    # right=False: bucket b holds upper[b-1] < t <= upper[b], so 32 -> "0-32", 33 -> "33-64".
    index = torch.bucketize(t, bounds, right=False)
    sums = torch.zeros(2, len(_LABELS), dtype=kl.dtype, device=kl.device)
    sums[0].index_add_(0, index, kl * t)
    sums[1].index_add_(0, index, t)
    return sums


def _bucket_dicts(sums: list[list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    weighted, tokens = sums
    per_token = {}
    counts = {}
    for label, num, den in zip(_LABELS, weighted, tokens):
        if den > 0:  # empty buckets are omitted, as in the original
            per_token[label] = num / den
            counts[label] = den
    return per_token, counts


def kl_by_length_bucket(
    kl_per_sample: torch.Tensor, lengths: torch.Tensor
) -> tuple[dict[str, float], dict[str, float]]:
    """Token-weighted mean KL (``Σ kl_i t_i / Σ t_i``) and token support per length bucket."""
    kl = kl_per_sample.detach()
    kl = kl.to(work_dtype(kl.dtype))
    if lengths.shape != kl.shape:
        raise ComputeError(
            f"kl_by_length_bucket: lengths: expected shape {tuple(kl.shape)}, got "
            f"{tuple(lengths.shape)}"
        )
    return _bucket_dicts(_bucket_sums(kl, lengths.to(kl.device)).tolist())


def _region(log_ratio: torch.Tensor, eps_low: float, eps_high: float) -> list[torch.Tensor]:
    low = (log_ratio < math.log1p(-eps_low)).to(log_ratio.dtype)
    high = (log_ratio > math.log1p(eps_high)).to(log_ratio.dtype)
    if log_ratio.numel() == 0:
        zero = log_ratio.new_zeros(())
        return [zero, zero, zero, zero, zero]
    return [low.mean(), low.min(), high.mean(), high.max(), (low + high).mean()]


@dataclass(frozen=True)
class _Drift:
    """What the diagnostics of one batch are computed from, in either case (§3.10)."""

    kl_value: torch.Tensor  # the batch's KL, scalar
    kl_per_sample: torch.Tensor  # kl_i [N]
    lengths: torch.Tensor  # t_i [N], the token support of kl_i
    log_ratio: torch.Tensor  # log π_θ - log π_ref, per token or per sequence


@torch.no_grad()
def batch_diagnostics(
    *,
    cur_logp_sum: torch.Tensor | None = None,
    token_counts: Any = None,
    ref_logp_mean: Any = None,
    token_logp: Any = None,
    ref_token_logp: Any = None,
    token_mask: torch.Tensor | None = None,
    ref_token_mask: torch.Tensor | None = None,
    loss_type: LossType = "bnpo",
    max_completion_len: int | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> BatchDiagnostics:
    """Diagnostics of one batch (§3.10); see the module docstring for the two cases.

    Per-token inputs are ``Ragged`` rows or padded tensors with their masks. ``eps_low`` /
    ``eps_high`` set the region ``[ln(1 - ε_low), ln(1 + ε_high)]``.
    """
    where = "batch_diagnostics"
    if not (0 <= eps_low < 1) or not (eps_high >= 0) or not math.isfinite(eps_high):
        raise ComputeError(
            f"{where}: expected 0 <= eps_low < 1 and finite eps_high >= 0, got {eps_low}, "
            f"{eps_high}"
        )
    if token_logp is not None and ref_token_logp is not None:
        rows = token_rows(token_logp, token_mask, where=f"{where}: token_logp")
        ref = token_rows(ref_token_logp, ref_token_mask, where=f"{where}: ref_token_logp")
        drift = _token_drift(rows, ref, loss_type, max_completion_len, where)
    elif ref_logp_mean is not None:
        drift = _sequence_drift(cur_logp_sum, token_counts, ref_logp_mean, where)
    else:
        return BatchDiagnostics(
            kl_value=0.0,
            clip_ratio=0.0,
            clip_ratio_low_mean=0.0,
            clip_ratio_low_min=0.0,
            clip_ratio_high_mean=0.0,
            clip_ratio_high_max=0.0,
            clip_ratio_region_mean=0.0,
            kl_per_token_by_len_bucket={},
            kl_token_count_by_len_bucket={},
        )
    return _diagnostics(drift, eps_low, eps_high)


def _token_drift(
    rows: Ragged,
    ref: Ragged,
    loss_type: LossType,
    max_completion_len: int | None,
    where: str,
) -> _Drift:
    """Per-token case: the KL aggregated like the loss, ``kl_i = Σ_t k3 / max(L_i, 1)`` with
    ``t_i = L_i`` tokens, and one log-ratio per token."""
    check_same_rows(rows, ref, f"{where}: ref_token_logp")
    if len(rows) == 0:
        raise ComputeError(f"{where}: token_logp: expected at least one sample, got 0")
    seg = Segments.of(rows, where=f"{where}: token_logp", allow_empty=True)
    dtype = work_dtype(rows.values.dtype)
    logp, ref_values = rows.values.to(dtype), ref.values.to(dtype)
    kl_value = token_kl(
        rows.with_values(logp),
        ref.with_values(ref_values),
        loss_type=loss_type,
        max_completion_len=max_completion_len,
    )
    lengths = seg.lengths.to(dtype)
    kl_i = seg.sum(k3(ref_values - logp)) / lengths.clamp(min=1.0)
    return _Drift(kl_value.to(dtype), kl_i, lengths, logp - ref_values)


def _sequence_drift(
    cur_logp_sum: torch.Tensor | None, token_counts: Any, ref_logp_mean: Any, where: str
) -> _Drift:
    """Per-sequence case: ``δ_i = ρ̄_i - S_i / max(T_i, 1)``, ``kl_i = k3(δ_i)``, the
    *unweighted* mean as the batch KL, ``t_i = T_i``, one log-ratio ``-δ_i`` per sequence."""
    if cur_logp_sum is None or token_counts is None:
        raise ComputeError(
            f"{where}: the sequence case needs cur_logp_sum, token_counts and ref_logp_mean"
        )
    s = cur_logp_sum.detach()
    n, device = int(s.shape[0]), s.device
    if n == 0:
        raise ComputeError(f"{where}: cur_logp_sum: expected at least one sample, got 0")
    dtype = work_dtype(s.dtype)
    s = s.to(dtype)
    lengths = as_sample_vector(token_counts, n=n, where=f"{where}: token_counts", device=device).to(
        dtype
    )
    rho = as_sample_vector(ref_logp_mean, n=n, where=f"{where}: ref_logp_mean", device=device)
    delta = rho.to(dtype) - s / lengths.clamp(min=1.0)
    kl_i = k3(delta)
    return _Drift(kl_i.mean(), kl_i, lengths, -delta)


def _diagnostics(drift: _Drift, eps_low: float, eps_high: float) -> BatchDiagnostics:
    """The record, with one host sync for every number in it."""
    fractions = _region(drift.log_ratio, eps_low, eps_high)
    buckets = _bucket_sums(drift.kl_per_sample, drift.lengths)
    dtype = drift.kl_per_sample.dtype
    flat = torch.cat([torch.stack([drift.kl_value.to(dtype), *fractions]), buckets.reshape(-1)])
    values = flat.tolist()
    kl, low_mean, low_min, high_mean, high_max, region = values[:6]
    width = len(_LABELS)
    per_token, counts = _bucket_dicts([values[6 : 6 + width], values[6 + width :]])
    return BatchDiagnostics(
        kl_value=kl,
        clip_ratio=region,
        clip_ratio_low_mean=low_mean,
        clip_ratio_low_min=low_min,
        clip_ratio_high_mean=high_mean,
        clip_ratio_high_max=high_max,
        clip_ratio_region_mean=region,
        kl_per_token_by_len_bucket=per_token,
        kl_token_count_by_len_bucket=counts,
    )
