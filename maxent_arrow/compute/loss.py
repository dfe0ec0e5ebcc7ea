"""MaxEnt and GRPO losses -> ``LossOutputs`` (``docs/formulas.md`` §3.9), on ragged inputs.

- :func:`maxent_loss`: the weighted, length-normalised sequence NLL
  ``(1/G) Σ_i -w_i S_i / T_i``, plus the optional sequence-level clip objective and ``β·KL``
  with the sequence-level k3 KL.
- :func:`grpo_loss`: the per-token PPO loss with ``bnpo`` / ``dr_grpo`` / ``grpo``
  aggregation, plus ``β·KL`` with the per-token k3 KL (or the sequence-level fallbacks when no
  token log-probs are given).
- :func:`evaluate_losses`: both, from the seed's ``SequenceScores`` / ``ReferenceLogprobs``
  (padded tensor + mask), returning ``(LossOutputs, BatchDiagnostics)`` as the original did.

Per-token values are a :class:`~maxent_arrow.Ragged` with one row per sample (preferred), or
a padded ``[N, L]`` tensor with its mask. Every sum is a plain or weighted total over the flat
token values (the per-sample denominators are expanded to the tokens first), so there is no
loop and the returned ``loss`` carries gradients to the policy log-probs.

The clip objective uses the standard PPO ``min`` for both signs of the advantage. The
original's custom loop took ``max`` for negative advantages, swapping the clip regions
(``docs/seed-bugs.md`` §9); that variant exists only behind
``ClipSettings(sign_dependent=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.compute.diagnostics import batch_diagnostics
from maxent_arrow.compute.kl import (
    LOG_RATIO_CLAMP,
    LossType,
    check_same_rows,
    k3,
    sequence_kl,
    token_rows,
    token_weights,
)
from maxent_arrow.compute.segments import Segments, as_ragged, as_sample_vector, work_dtype
from maxent_arrow.errors import ComputeError
from maxent_arrow.types import (
    BatchDiagnostics,
    LossOutputs,
    LossScalarBundle,
    ReferenceLogprobs,
    SequenceScores,
)

__all__ = ["ClipSettings", "evaluate_losses", "grpo_loss", "maxent_loss"]


@dataclass(frozen=True)
class ClipSettings:
    """The clip objective's knobs (``clip_range_low/high``, ``clip_delta``, ...).

    Parameters
    ----------
    eps_low, eps_high:
        The ratio is clipped to ``[1 - eps_low, 1 + eps_high]``.
    delta:
        Optional upper cap on the raw ratio (dual-clip style ``r <= δ``).
    coef:
        ``clip_objective_coef``: the clip term is added to the policy loss times this.
    adv_baseline:
        MaxEnt mode: the baseline ``b`` in ``Â = w - b`` (default ``1/K`` of the group).
    sign_dependent:
        Reproduce the original custom loop's non-standard ``max`` for ``Â < 0``.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float | None = None
    coef: float = 1.0
    adv_baseline: float | None = None
    sign_dependent: bool = False

    def __post_init__(self) -> None:
        for name in ("eps_low", "eps_high"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "eps_low" and value >= 1):
                raise ComputeError(f"ClipSettings.{name}: expected 0 <= value (< 1), got {value}")
        if self.delta is not None and not (math.isfinite(self.delta) and self.delta > 0):
            raise ComputeError(f"ClipSettings.delta: expected a finite value > 0, got {self.delta}")


# ---------------------------------------------------------------------------- inputs
def _scalars(**values: torch.Tensor | float | None) -> dict[str, Any]:
    """Detach every scalar with one host sync (tensors become floats; the rest as given)."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    got = torch.stack([v.detach().to(torch.float64).cpu() for v in tensors.values()]).tolist()
    out: dict[str, Any] = dict(values)
    out.update(zip(tensors, got))
    return out


def _outputs(
    loss: torch.Tensor,
    policy: torch.Tensor,
    clip: torch.Tensor | None,
    kl: torch.Tensor,
    beta: float,
    log_ratio_train: torch.Tensor,
    denom: torch.Tensor,
) -> LossOutputs:
    s = _scalars(total=loss, policy=policy, clip=clip, kl=kl)
    return LossOutputs(
        loss=loss,
        scalars=LossScalarBundle(
            total_loss=s["total"],
            policy_loss=s["policy"],
            clip_loss=s["clip"],
            kl_loss=s["kl"],
            weighted_kl_loss=beta * s["kl"],
        ),
        log_ratio_train=log_ratio_train,
        denom_tok_tensor=denom,
    )


def _check_beta(beta: float, where: str) -> float:
    if not math.isfinite(beta) or beta < 0:
        raise ComputeError(f"{where}: beta must be finite and >= 0, got {beta}")
    return float(beta)


def _sequence_ratio(
    s: torch.Tensor, behavior_logp_sum: Any, *, n: int, where: str, device: Any
) -> torch.Tensor:
    """``exp(S - S_beh)`` per sequence, the log-ratio clamped to ±60; without stored behaviour
    sums the behaviour policy is the detached current one (ratio 1, gradient of S)."""
    beh = (
        s.detach()
        if behavior_logp_sum is None
        else as_sample_vector(
            behavior_logp_sum, n=n, where=f"{where}: behavior_logp_sum", device=device
        ).to(s.dtype)
    )
    return torch.exp((s - beh).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipSettings) -> torch.Tensor:
    """``min(r Â, clamp(r) Â)`` (or the original's max for ``Â < 0``), per element."""
    if clip.delta is not None:
        ratio = ratio.clamp(max=clip.delta)
    clipped = ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    raw, cut = ratio * adv, clipped * adv
    if clip.sign_dependent:
        return torch.where(adv >= 0, torch.minimum(raw, cut), torch.maximum(raw, cut))
    return torch.minimum(raw, cut)


def _reference_means(
    ref_logp_mean: Any, *, n: int, where: str, device: Any, dtype: torch.dtype
) -> torch.Tensor | None:
    """The reference per-token means ``ρ̄`` ``[N]`` in ``dtype``, or None without them."""
    if ref_logp_mean is None:
        return None
    rho = as_sample_vector(ref_logp_mean, n=n, where=f"{where}: ref_logp_mean", device=device)
    return rho.to(dtype)


def _sequence_kl_or_zero(
    rho: torch.Tensor | None, s: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The sequence-level k3 KL of ``S`` against ``ρ̄``; 0 without reference means."""
    if rho is None:
        return torch.zeros((), dtype=s.dtype, device=s.device)
    return sequence_kl(rho, s, t)


# ---------------------------------------------------------------------------- MaxEnt
def maxent_loss(
    weights: Any,
    cur_logp_sum: torch.Tensor,
    token_counts: Any,
    *,
    ref_logp_mean: Any = None,
    behavior_logp_sum: torch.Tensor | None = None,
    beta: float = 0.0,
    clip: ClipSettings | None = None,
    log_ratio_train: torch.Tensor | None = None,
) -> LossOutputs:
    """MaxEnt loss ``L = (1/G) Σ_i -w_i S_i / T_i [+ c L_clip] + β KL`` (§3.9).

    Parameters
    ----------
    weights:
        ``w`` grouped by prompt (a ``Ragged``; G is its number of groups). Fixed targets:
        no gradient flows into them.
    cur_logp_sum:
        ``S_i``, the policy's sequence log-prob sums ``[N]`` (with gradient).
    token_counts:
        ``T_i`` (clamped to >= 1), ``[N]``.
    ref_logp_mean:
        Reference per-token means ``ρ̄_i`` for the sequence-level KL; without them KL = 0.
    behavior_logp_sum:
        ``S^beh`` for the clip ratio ``exp(S - S^beh)`` (default ``S.detach()``: ratio 1).
    clip:
        Enables the clip objective with ``Â = w - b_g``.
    log_ratio_train:
        Passed through to ``LossOutputs`` (default ``S - T·ρ̄`` detached, or zeros).
    """
    where = "maxent_loss"
    beta = _check_beta(beta, where)
    w_rows = as_ragged(weights, f"{where}: weights")
    if len(w_rows) == 0:
        raise ComputeError(f"{where}: weights: expected at least one group, got an empty batch")
    device = cur_logp_sum.device
    seg = Segments.of(w_rows.to(device), where=f"{where}: weights")
    n = seg.num_values
    s = as_sample_vector(cur_logp_sum, n=n, where=f"{where}: cur_logp_sum", device=device)
    dtype = work_dtype(s.dtype)
    s = s.to(dtype)
    w = w_rows.values.to(device=device, dtype=dtype).detach()
    t = as_sample_vector(token_counts, n=n, where=f"{where}: token_counts", device=device)
    t = t.to(dtype).clamp(min=1.0)
    policy = -(w * s / t).sum() / float(len(seg))
    clip_value = None
    if clip is not None:
        clip_value = _maxent_clip(s, w, seg, behavior_logp_sum, clip, where)
        policy = policy + clip.coef * clip_value
    rho = _reference_means(ref_logp_mean, n=n, where=where, device=device, dtype=dtype)
    kl = _sequence_kl_or_zero(rho, s, t)
    if log_ratio_train is None:
        log_ratio_train = (s - rho * t).detach() if rho is not None else torch.zeros_like(s)
    return _outputs(policy + beta * kl, policy, clip_value, kl, beta, log_ratio_train, t)


def _maxent_clip(
    s: torch.Tensor,
    w: torch.Tensor,
    seg: Segments,
    behavior_logp_sum: Any,
    clip: ClipSettings,
    where: str,
) -> torch.Tensor:
    """``L_clip = -(1/G) Σ_i o(r_i, Â_i)``, ``r = exp(S - S^beh)``, ``Â = w - b_g`` (§3.9)."""
    ratio = _sequence_ratio(s, behavior_logp_sum, n=seg.num_values, where=where, device=s.device)
    if clip.adv_baseline is not None:
        baseline = torch.full_like(w, float(clip.adv_baseline))
    else:
        baseline = seg.expand(1.0 / seg.lengths.to(s.dtype))
    return -_clipped_objective(ratio, w - baseline, clip).sum() / float(len(seg))


# ---------------------------------------------------------------------------- GRPO
@dataclass(frozen=True)
class _PolicyTokens:
    """The policy's per-token log-probs of a GRPO batch, one row per sample, with the
    per-token coefficients ``c_{i,t}`` of its ``loss_type`` aggregation (§3.9)."""

    rows: Ragged
    seg: Segments
    coef: torch.Tensor
    logp: torch.Tensor  # the rows' values in the working dtype (with gradient)

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per sample ``[N]``, in the working dtype."""
        return self.seg.lengths.to(self.coef.dtype)

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        """``Σ_{i,t} x_{i,t} c_{i,t}``: the loss's aggregation of a per-token quantity."""
        return (per_token * self.coef).sum()


def _policy_tokens(
    token_logp: Any,
    token_mask: torch.Tensor | None,
    loss_type: LossType,
    max_completion_len: int | None,
    where: str,
) -> _PolicyTokens:
    rows = token_rows(token_logp, token_mask, where=f"{where}: token_logp")
    if len(rows) == 0:
        raise ComputeError(f"{where}: token_logp: expected at least one sample, got 0")
    seg = Segments.of(rows, where=f"{where}: token_logp", allow_empty=True)
    coef = token_weights(rows, seg, loss_type, max_completion_len, where)
    return _PolicyTokens(rows, seg, coef, rows.values.to(coef.dtype))


def _old_token_logp(
    tokens: _PolicyTokens, old_token_logp: Any, token_mask: torch.Tensor | None, where: str
) -> torch.Tensor:
    """``log π_old`` per token, row for row like the policy's; the detached policy without
    stored behaviour values (ratio 1)."""
    if old_token_logp is None:
        return tokens.logp.detach()
    old_rows = token_rows(old_token_logp, token_mask, where=f"{where}: old_token_logp")
    check_same_rows(tokens.rows, old_rows, f"{where}: old_token_logp")
    return old_rows.values.to(tokens.logp.dtype)


def _grpo_kl(
    tokens: _PolicyTokens,
    ref_token_logp: Any,
    ref_token_mask: torch.Tensor | None,
    ref_logp_mean: Any,
    where: str,
) -> torch.Tensor:
    """The per-token k3 KL aggregated like the loss; without reference per-token values the
    sequence form over the rows' sums and lengths; 0 without any reference (§3.9)."""
    logp = tokens.logp
    if ref_token_logp is not None:
        ref = token_rows(ref_token_logp, ref_token_mask, where=f"{where}: ref_token_logp")
        check_same_rows(tokens.rows, ref, f"{where}: ref_token_logp")
        return tokens.aggregate(k3(ref.values.to(logp.dtype) - logp))
    rho = _reference_means(
        ref_logp_mean, n=len(tokens.rows), where=where, device=logp.device, dtype=logp.dtype
    )
    return _sequence_kl_or_zero(rho, tokens.seg.sum(logp), tokens.lengths)


def grpo_loss(
    advantages: Any,
    token_logp: Any = None,
    old_token_logp: Any = None,
    *,
    token_mask: torch.Tensor | None = None,
    ref_token_logp: Any = None,
    ref_token_mask: torch.Tensor | None = None,
    cur_logp_sum: torch.Tensor | None = None,
    behavior_logp_sum: torch.Tensor | None = None,
    token_counts: Any = None,
    ref_logp_mean: Any = None,
    beta: float = 0.0,
    loss_type: LossType = "bnpo",
    max_completion_len: int | None = None,
    clip: ClipSettings | None = None,
    log_ratio_train: torch.Tensor | None = None,
) -> LossOutputs:
    """GRPO loss: per-token PPO with ``bnpo`` / ``dr_grpo`` / ``grpo`` aggregation (§3.9).

    ``ℓ_{i,t} = -min(ρ A_i, clamp(ρ) A_i)`` with ``ρ = exp(log π_θ - log π_old)`` (``-ρ A``
    without ``clip``); the aggregated loss is multiplied by ``clip.coef`` when clipping is on.
    ``bnpo``: ``Σ ℓ / Σ m``; ``dr_grpo``: ``Σ ℓ / (N · max_completion_len)``; ``grpo``:
    ``mean_i(Σ_t ℓ / T_i)``. The KL is the per-token k3 aggregated the same way when
    ``ref_token_logp`` is given, else the sequence form from ``ref_logp_mean``.

    Without ``token_logp`` it falls back to the sequence level: ``ρ_i = exp(S_i - S^beh_i)``
    and the sum over sequences divided by N (needs ``cur_logp_sum``).

    ``advantages`` is ``[N]`` (tensor or ``Ragged``); per-token inputs are ``Ragged`` rows or
    padded tensors with ``token_mask`` / ``ref_token_mask``.
    """
    where = "grpo_loss"
    beta = _check_beta(beta, where)
    if token_logp is None:
        return _grpo_sequence(
            advantages,
            cur_logp_sum,
            behavior_logp_sum,
            token_counts,
            ref_logp_mean,
            beta=beta,
            clip=clip,
            log_ratio_train=log_ratio_train,
        )
    tokens = _policy_tokens(token_logp, token_mask, loss_type, max_completion_len, where)
    n, logp = len(tokens.rows), tokens.logp
    adv = as_sample_vector(advantages, n=n, where=f"{where}: advantages", device=logp.device)
    old = _old_token_logp(tokens, old_token_logp, token_mask, where)
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    a_tok = tokens.seg.expand(adv.to(logp.dtype).detach())
    per_token = -_clipped_objective(ratio, a_tok, clip) if clip is not None else -ratio * a_tok
    ppo = tokens.aggregate(per_token)
    policy = ppo * clip.coef if clip is not None else ppo
    kl = _grpo_kl(tokens, ref_token_logp, ref_token_mask, ref_logp_mean, where)
    if log_ratio_train is None:
        log_ratio_train = torch.zeros(n, dtype=logp.dtype, device=logp.device)
    return _outputs(
        policy + beta * kl,
        policy,
        ppo if clip is not None else None,
        kl,
        beta,
        log_ratio_train,
        tokens.lengths.clamp(min=1.0),
    )


def _grpo_sequence(
    advantages: Any,
    cur_logp_sum: torch.Tensor | None,
    behavior_logp_sum: torch.Tensor | None,
    token_counts: Any,
    ref_logp_mean: Any,
    *,
    beta: float,
    clip: ClipSettings | None,
    log_ratio_train: torch.Tensor | None,
) -> LossOutputs:
    where = "grpo_loss"
    if cur_logp_sum is None:
        raise ComputeError(f"{where}: needs token_logp, or cur_logp_sum for the sequence form")
    n, device = int(cur_logp_sum.shape[0]), cur_logp_sum.device
    if n == 0:
        raise ComputeError(f"{where}: cur_logp_sum: expected at least one sample, got 0")
    dtype = work_dtype(cur_logp_sum.dtype)
    s = cur_logp_sum.to(dtype)
    adv = as_sample_vector(advantages, n=n, where=f"{where}: advantages", device=device)
    adv = adv.to(dtype).detach()
    ratio = _sequence_ratio(s, behavior_logp_sum, n=n, where=where, device=device)
    per_seq = -_clipped_objective(ratio, adv, clip) if clip is not None else -ratio * adv
    ppo = per_seq.sum() / n
    policy = ppo * clip.coef if clip is not None else ppo
    t = torch.ones_like(s)
    if token_counts is not None:
        t = as_sample_vector(token_counts, n=n, where=f"{where}: token_counts", device=device)
        t = t.to(dtype).clamp(min=1.0)
    rho = _reference_means(ref_logp_mean, n=n, where=where, device=device, dtype=dtype)
    kl = _sequence_kl_or_zero(rho, s, t)
    if log_ratio_train is None:
        log_ratio_train = torch.zeros_like(s)
    return _outputs(
        policy + beta * kl,
        policy,
        ppo if clip is not None else None,
        kl,
        beta,
        log_ratio_train,
        t,
    )


# ---------------------------------------------------------------------------- seed records
def evaluate_losses(
    scores: SequenceScores,
    reference: ReferenceLogprobs | None,
    weights: Any,
    *,
    mode: Literal["maxent", "grpo"] = "maxent",
    beta: float = 0.0,
    clip: ClipSettings | None = None,
    loss_type: LossType = "bnpo",
    max_completion_len: int | None = None,
    len_norm_ref: bool = True,
    diagnostic_eps_low: float = 0.2,
    diagnostic_eps_high: float = 0.2,
) -> tuple[LossOutputs, BatchDiagnostics]:
    """The original's ``evaluate_losses``: loss and diagnostics from the seed records.

    ``weights`` are the MaxEnt weights (``mode="maxent"``) or the advantages (``"grpo"``),
    grouped as a ``Ragged``. The reference per-token mean is ``ref_logp_sum`` with
    ``len_norm_ref`` (the default), else ``ref_logp_sum_raw / max(ref_tok_counts, 1)``. In
    GRPO mode the per-token path is taken when ``scores.token_logp`` exists, with the
    per-token KL when ``reference.ref_token_logp`` exists too.
    """
    rho = _reference_token_means(reference, len_norm_ref)
    tokens = old = ref_tokens = None
    if mode == "grpo" and scores.token_logp is not None:
        tokens, old, ref_tokens = _record_token_rows(scores, reference)
    if mode == "maxent":
        outputs = maxent_loss(
            weights,
            scores.cur_logp_sum,
            scores.denom_tok_tensor,
            ref_logp_mean=rho,
            behavior_logp_sum=scores.behavior_logp_sum,
            beta=beta,
            clip=clip,
            log_ratio_train=scores.log_ratio_train,
        )
    elif mode == "grpo":
        outputs = grpo_loss(
            weights,
            tokens,
            old,
            ref_token_logp=ref_tokens,
            cur_logp_sum=scores.cur_logp_sum,
            behavior_logp_sum=scores.behavior_logp_sum,
            token_counts=scores.denom_tok_tensor,
            ref_logp_mean=rho,
            beta=beta,
            loss_type=loss_type,
            max_completion_len=max_completion_len,
            clip=clip,
            log_ratio_train=scores.log_ratio_train,
        )
    else:
        raise ComputeError(f"evaluate_losses: mode must be 'maxent' or 'grpo', got {mode!r}")
    if tokens is not None:
        # The per-token loss normalises by the mask count; keep the seed's T as denominator.
        outputs.denom_tok_tensor = scores.denom_tok_tensor
    diagnostics = batch_diagnostics(
        cur_logp_sum=scores.cur_logp_sum,
        token_counts=scores.denom_tok_tensor,
        ref_logp_mean=rho,
        token_logp=tokens if ref_tokens is not None else None,
        ref_token_logp=ref_tokens,
        loss_type=loss_type,
        max_completion_len=max_completion_len,
        eps_low=diagnostic_eps_low,
        eps_high=diagnostic_eps_high,
    )
    return outputs, diagnostics


def _reference_token_means(
    reference: ReferenceLogprobs | None, len_norm_ref: bool
) -> torch.Tensor | None:
    """``ρ̄``: the record's ``ref_logp_sum`` (already R / max(T, 1)) with ``len_norm_ref``,
    else the per-token mean recomputed from the raw sums and counts."""
    if reference is None:
        return None
    if len_norm_ref:
        return reference.ref_logp_sum
    counts = reference.ref_tok_counts.to(reference.ref_logp_sum_raw.dtype)
    return reference.ref_logp_sum_raw / counts.clamp(min=1.0)


def _record_token_rows(
    scores: SequenceScores, reference: ReferenceLogprobs | None
) -> tuple[Ragged, Ragged | None, Ragged | None]:
    """The records' padded per-token tensors as rows: the policy's, the behaviour's (when
    stored) and the reference's (when it has them); each needs its mask."""
    if scores.token_mask is None:
        raise ComputeError("evaluate_losses: scores.token_logp needs scores.token_mask")
    tokens = token_rows(scores.token_logp, scores.token_mask, where="scores.token_logp")
    old = None
    if scores.old_token_logp is not None:
        old = token_rows(scores.old_token_logp, scores.token_mask, where="old_token_logp")
    ref_tokens = None
    if reference is not None and reference.ref_token_logp is not None:
        if reference.ref_token_mask is None:
            raise ComputeError(
                "evaluate_losses: reference.ref_token_logp needs reference.ref_token_mask"
            )
        ref_tokens = token_rows(
            reference.ref_token_logp,
            reference.ref_token_mask,
            where="reference.ref_token_logp",
        )
    return tokens, old, ref_tokens
