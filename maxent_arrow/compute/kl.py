"""KL between the policy and the reference: the k3 estimator, per token and per sequence
(``docs/formulas.md`` §3.9), and the per-token rows both the loss and the diagnostics read.

Per-token values are a :class:`~maxent_arrow.arrow.Ragged` with one row per sample, or a
padded ``[N, L]`` tensor with its mask (:func:`token_rows` turns it into rows).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.compute.segments import Segments, as_ragged, work_dtype
from maxent_arrow.errors import ComputeError

__all__ = [
    "LOG_RATIO_CLAMP",
    "LossType",
    "check_same_rows",
    "k3",
    "sequence_kl",
    "token_kl",
    "token_rows",
    "token_weights",
]

LossType = Literal["bnpo", "dr_grpo", "grpo"]
# Log-ratios are clamped to this before exponentiating (exp(60) is finite in float32).
LOG_RATIO_CLAMP = 60.0


def k3(delta: torch.Tensor) -> torch.Tensor:
    """The k3 KL estimator ``e^δ - δ - 1`` with ``δ = log π_ref - log π`` clamped to ±60."""
    d = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


def token_rows(value: Any, mask: torch.Tensor | None = None, *, where: str) -> Ragged:
    """Per-token values as one ``Ragged`` row per sample.

    A ``Ragged`` passes through; a padded ``[N, L]`` tensor needs its mask (True/1 on real
    tokens) and keeps the masked entries of each row in order (left-aligned or not).
    """
    if isinstance(value, Ragged):
        if mask is not None:
            raise ComputeError(f"{where}: a Ragged carries its own lengths; pass no mask")
        return as_ragged(value, where)
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ComputeError(
            f"{where}: expected a Ragged or a padded [N, L] tensor with a mask, got "
            f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
        )
    if mask is None:
        raise ComputeError(f"{where}: a padded tensor needs its mask")
    if tuple(mask.shape) != tuple(value.shape):
        raise ComputeError(
            f"{where}: mask shape {tuple(mask.shape)} differs from values {tuple(value.shape)}"
        )
    keep = mask.to(value.device) != 0
    return Ragged.from_lengths(value[keep], keep.sum(dim=1))


def check_same_rows(a: Ragged, b: Ragged, where: str) -> None:
    if len(a) != len(b) or not torch.equal(a.offsets, b.offsets.to(a.offsets.device)):
        la, lb = a.lengths(), b.lengths().to(a.offsets.device)
        if la.numel() != lb.numel():
            raise ComputeError(f"{where}: expected {la.numel()} samples, got {lb.numel()}")
        i = int(torch.nonzero(la != lb)[0, 0])
        raise ComputeError(
            f"{where}: sample {i} has {int(lb[i])} tokens, expected {int(la[i])} (as token_logp)"
        )


def sequence_kl(
    ref_logp_mean: torch.Tensor, cur_logp_sum: torch.Tensor, token_counts: torch.Tensor
) -> torch.Tensor:
    """Sequence-level KL: ``Σ_i k3(ρ̄_i - S_i/T_i) T_i / Σ_i T_i`` with ``T_i >= 1`` (§3.9).

    ``ρ̄`` is the reference per-token mean (``ReferenceLogprobs.ref_logp_sum``). This applies
    k3 to the mean per-token log-ratio, as the original did; it is not the mean per-token k3.
    """
    t = token_counts.to(cur_logp_sum.dtype).clamp(min=1.0)
    delta = ref_logp_mean.to(cur_logp_sum.dtype) - cur_logp_sum / t
    return (k3(delta) * t).sum() / t.sum()


def token_weights(
    rows: Ragged, seg: Segments, loss_type: str, max_completion_len: int | None, where: str
) -> torch.Tensor:
    """Per-token coefficients ``c_t`` so that the aggregated loss is ``Σ_t ℓ_t c_t``."""
    dtype = work_dtype(rows.values.dtype)
    n = max(len(rows), 1)
    lengths = seg.lengths.to(dtype)
    if loss_type == "bnpo":
        per_sample = torch.full_like(lengths, 1.0) / lengths.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_len is None or max_completion_len <= 0:
            raise ComputeError(
                f"{where}: loss_type 'dr_grpo' needs max_completion_len > 0, got "
                f"{max_completion_len!r}"
            )
        per_sample = torch.full_like(lengths, 1.0 / (n * max_completion_len))
    elif loss_type == "grpo":
        per_sample = 1.0 / (n * lengths.clamp(min=1.0))
    else:
        raise ComputeError(
            f"{where}: loss_type must be 'bnpo', 'dr_grpo' or 'grpo', got {loss_type!r}"
        )
    return seg.expand(per_sample)


def token_kl(
    token_logp: Ragged,
    ref_token_logp: Ragged,
    *,
    loss_type: LossType = "bnpo",
    max_completion_len: int | None = None,
) -> torch.Tensor:
    """Per-token k3 KL with ``δ = log π_ref - log π_θ``, aggregated like the loss (§3.9)."""
    where = "token_kl"
    rows = as_ragged(token_logp, f"{where}: token_logp")
    ref = as_ragged(ref_token_logp, f"{where}: ref_token_logp")
    check_same_rows(rows, ref, f"{where}: ref_token_logp")
    seg = Segments.of(rows, where=f"{where}: token_logp", allow_empty=True)
    c = token_weights(rows, seg, loss_type, max_completion_len, where)
    dtype = c.dtype
    delta = ref.values.to(dtype) - rows.values.to(dtype)
    return (k3(delta) * c).sum()
