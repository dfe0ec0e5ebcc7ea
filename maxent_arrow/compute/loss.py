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
from maxent_arrow.types.rewards import (
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
def _scalars(**values: torch.Tensor | float | None) -> dict[str, float | None]:
    """Detach every scalar with one host sync."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    got = torch.stack([values[k].detach().to(torch.float64).cpu() for k in names]).tolist()
    out = dict(values)
    out.update(zip(names, got))
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
    groups = float(len(seg))
    policy = -(w * s / t).sum() / groups
    clip_value = None
    if clip is not None:
        ratio = _sequence_ratio(s, behavior_logp_sum, n=n, where=where, device=device)
        if clip.adv_baseline is not None:
            baseline = torch.full_like(w, float(clip.adv_baseline))
        else:
            baseline = seg.expand(1.0 / seg.lengths.to(dtype))
        clip_value = -_clipped_objective(ratio, w - baseline, clip).sum() / groups
        policy = policy + clip.coef * clip_value
    if ref_logp_mean is not None:
        rho = as_sample_vector(ref_logp_mean, n=n, where=f"{where}: ref_logp_mean", device=device)
        kl = sequence_kl(rho.to(dtype), s, t)
    else:
        kl = torch.zeros((), dtype=dtype, device=device)
    loss = policy + beta * kl
    if log_ratio_train is None:
        if ref_logp_mean is not None:
            log_ratio_train = (s - rho.to(dtype) * t).detach()
        else:
            log_ratio_train = torch.zeros_like(s)
    return _outputs(loss, policy, clip_value, kl, beta, log_ratio_train, t)


# ---------------------------------------------------------------------------- GRPO
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
    rows = token_rows(token_logp, token_mask, where=f"{where}: token_logp")
    n = len(rows)
    if n == 0:
        raise ComputeError(f"{where}: token_logp: expected at least one sample, got 0")
    device = rows.values.device
    seg = Segments.of(rows, where=f"{where}: token_logp", allow_empty=True)
    adv = as_sample_vector(advantages, n=n, where=f"{where}: advantages", device=device)
    c = token_weights(rows, seg, loss_type, max_completion_len, where)
    dtype = c.dtype
    logp = rows.values.to(dtype)
    if old_token_logp is None:
        old = logp.detach()
    else:
        old_rows = token_rows(old_token_logp, token_mask, where=f"{where}: old_token_logp")
        check_same_rows(rows, old_rows, f"{where}: old_token_logp")
        old = old_rows.values.to(dtype)
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    a_tok = seg.expand(adv.to(dtype).detach())
    if clip is not None:
        per_token = -_clipped_objective(ratio, a_tok, clip)
    else:
        per_token = -ratio * a_tok
    ppo = (per_token * c).sum()
    policy = ppo * clip.coef if clip is not None else ppo
    lengths = seg.lengths.to(dtype)
    if ref_token_logp is not None:
        ref = token_rows(ref_token_logp, ref_token_mask, where=f"{where}: ref_token_logp")
        check_same_rows(rows, ref, f"{where}: ref_token_logp")
        kl = (k3(ref.values.to(dtype) - logp) * c).sum()
    elif ref_logp_mean is not None:
        rho = as_sample_vector(ref_logp_mean, n=n, where=f"{where}: ref_logp_mean", device=device)
        kl = sequence_kl(rho.to(dtype), seg.sum(logp), lengths)
    else:
        kl = torch.zeros((), dtype=dtype, device=device)
    loss = policy + beta * kl
    if log_ratio_train is None:
        log_ratio_train = torch.zeros(n, dtype=dtype, device=device)
    return _outputs(
        loss,
        policy,
        ppo if clip is not None else None,
        kl,
        beta,
        log_ratio_train,
        lengths.clamp(min=1.0),
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
    if ref_logp_mean is not None:
        rho = as_sample_vector(ref_logp_mean, n=n, where=f"{where}: ref_logp_mean", device=device)
        kl = sequence_kl(rho.to(dtype), s, t)
    else:
        kl = torch.zeros((), dtype=dtype, device=device)
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
    rho = None
    if reference is not None:
        if len_norm_ref:
            rho = reference.ref_logp_sum
        else:
            counts = reference.ref_tok_counts.to(reference.ref_logp_sum_raw.dtype)
            rho = reference.ref_logp_sum_raw / counts.clamp(min=1.0)
    tokens = None
    ref_tokens = None
    if mode == "grpo" and scores.token_logp is not None:
        if scores.token_mask is None:
            raise ComputeError("evaluate_losses: scores.token_logp needs scores.token_mask")
        tokens = token_rows(scores.token_logp, scores.token_mask, where="scores.token_logp")
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
        old = None
        if tokens is not None and scores.old_token_logp is not None:
            old = token_rows(scores.old_token_logp, scores.token_mask, where="old_token_logp")
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
