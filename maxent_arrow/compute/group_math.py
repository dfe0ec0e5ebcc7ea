"""Group math on (values, offsets): utilities, advantages, q, MaxEnt weights, moments, lengths.

Every function takes per-sample values grouped by prompt as a :class:`~maxent_arrow.Ragged` (or
an Arrow list array / grouped view, viewed without copying), runs segment reductions over the
offsets (:mod:`maxent_arrow.compute.segments`), and returns a ``Ragged`` with the same offsets
on the same device, unless noted. There is no Python loop over groups or samples, and the same
code runs on CPU and CUDA. Float64 inputs are computed in float64; anything narrower in float32,
never below.

What keeps the passes few: the group structure is checked and derived once per offsets
tensor (:meth:`Segments.of` caches it), uniform K runs dense ``[P, K]`` kernels, the
finiteness checks double as the bounds that let a softmax skip its per-group max, softmaxes
exponentiate in base 2 (``exp2`` is cheaper than ``exp`` in float64), normalisations multiply
by per-group reciprocals, and each function allocates one ``[N]`` result and works in place on
it. Where the time goes is measured by ``benchmarks/bench_compute.py``.

The formulas are those of ``docs/formulas.md``; the section numbers in the docstrings (§3.2)
are its sections.
Bad input raises :class:`~maxent_arrow.errors.ComputeError` (or ``LayoutError`` for broken
offsets) naming the function, the argument and the group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from maxent_arrow.arguments import is_int
from maxent_arrow.arrow import Ragged
from maxent_arrow.arrow import registry as R
from maxent_arrow.compute.segments import (
    LOG2E,
    Segments,
    as_sample_vector,
    check_finite,
    check_out,
    check_scalar,
    finite_range,
    flat_values,
    grouped_input,
    log2,
    shift_,
    shift_mode,
    work_dtype,
)
from maxent_arrow.errors import ComputeError, SchemaError
from maxent_arrow.types import LengthStats, RewardMoments

__all__ = [
    "AGGREGATIONS",
    "SCALE_REWARDS",
    "Aggregation",
    "EntropyBonus",
    "LENGTH_FIELDS",
    "Missing",
    "ScoredMoments",
    "ScaleRewards",
    "WeightEntropy",
    "apply_group_scales",
    "check_scale_rewards",
    "clipped_flags",
    "entropy_bonus",
    "group_advantages",
    "group_entropy",
    "multi_objective_advantages",
    "length_stats",
    "length_summary",
    "maxent_weights",
    "merge_step_rows",
    "q_distribution",
    "reward_moments",
    "scored_moments",
    "total_utils",
    "weight_entropy",
]

Denominator = Literal["tau", "tau+beta"]

# Floors (docs/formulas.md §3.4, §3.6): the q temperature is floored at 1e-8 and q at 1e-12
# before the log; epsilon is clamped to 1/K - 1e-8 when K * epsilon >= 1 (the original's
# custom loop had no clamp and produced negative q: docs/seed-bugs.md §12).
_MIN_TEMPERATURE = 1e-8
_MIN_Q = 1e-12
_EPS_MARGIN = 1e-8
_Z_STD_FLOOR = 1e-6


# ---------------------------------------------------------------------------- §3.1 utilities
@overload
def total_utils(
    per_reward_values: Mapping[str, Any] | torch.Tensor,
    weights: Sequence[float] | Mapping[str, float] | torch.Tensor,
    *,
    truncated: Any = None,
    offsets: torch.Tensor,
) -> Ragged: ...
@overload
def total_utils(
    per_reward_values: Mapping[str, Any] | torch.Tensor,
    weights: Sequence[float] | Mapping[str, float] | torch.Tensor,
    *,
    truncated: Any = None,
    offsets: None = None,
) -> Ragged | torch.Tensor: ...
def total_utils(
    per_reward_values: Mapping[str, Any] | torch.Tensor,
    weights: Sequence[float] | Mapping[str, float] | torch.Tensor,
    *,
    truncated: Any = None,
    offsets: torch.Tensor | None = None,
) -> Ragged | torch.Tensor:
    """Weighted utility ``U_i = nansum_j(λ_j r_ij)``, zero where ``truncated`` (§3.1).

    Parameters
    ----------
    per_reward_values:
        Raw (unweighted) rewards: a dict ``name -> [N]`` (tensors, ``Ragged`` with the same
        offsets, views or lists), or one ``[N, R]`` tensor.
    weights:
        ``λ_j``: one per reward function, in the dict's order (or a dict by name).
    truncated:
        Optional boolean ``[N]``: utilities of truncated completions are set to 0.
    offsets:
        Group offsets for the result when no input is a ``Ragged``.

    Returns
    -------
    A ``Ragged`` when the group offsets are known (a ``Ragged`` input or ``offsets``), else a
    ``[N]`` tensor. NaN terms (a reward function's NaN, or ``0 * inf``) count as 0; an
    infinite term stays infinite, and the group math after refuses it, naming the group.
    """
    where = "total_utils"
    names, columns = _reward_columns(per_reward_values, where)
    lam = _reward_weights(weights, names, where)
    if offsets is None:
        # The first grouped column gives the groups; the others are checked against them.
        offsets = next((c.offsets for c in columns if isinstance(c, Ragged)), None)
    probe = flat_values(columns[0], f"{where}: per_reward_values[{names[0]!r}]")
    device, n = probe.device, int(probe.shape[0])
    segments = None
    if offsets is not None:
        segments = Segments.cached(offsets, num_values=n, device=device, where=f"{where}: offsets")
    tensors = [
        as_sample_vector(
            c,
            n=n,
            where=f"{where}: per_reward_values[{name!r}]",
            device=device,
            segments=segments,
        )
        for name, c in zip(names, columns)
    ]
    utils = _weighted_nansum(tensors, lam)
    if truncated is not None:
        mask = as_sample_vector(
            truncated, n=n, where=f"{where}: truncated", device=device, segments=segments
        )
        utils.masked_fill_(mask.bool(), 0.0)
    if segments is None:
        return utils
    return Ragged(utils, segments.offsets, validate=False)


def _reward_columns(per_reward_values: Any, where: str) -> tuple[list[str], list[Any]]:
    """Names and columns of the raw rewards: a dict's items, or an ``[N, R]`` tensor's columns
    named ``reward_0``, ``reward_1``, ... (the seed's positional names)."""
    if isinstance(per_reward_values, torch.Tensor):
        if per_reward_values.dim() != 2:
            raise ComputeError(
                f"{where}: per_reward_values: expected an [N, R] tensor, got shape "
                f"{tuple(per_reward_values.shape)}"
            )
        names = [f"reward_{j}" for j in range(per_reward_values.shape[1])]
        columns = list(per_reward_values.unbind(1))
    elif isinstance(per_reward_values, Mapping):
        names = list(per_reward_values)
        columns = list(per_reward_values.values())
    else:
        raise SchemaError(
            f"{where}: per_reward_values: expected a dict of columns or an [N, R] tensor, got "
            f"{type(per_reward_values).__name__}"
        )
    if not columns:
        raise ComputeError(f"{where}: per_reward_values: expected at least one reward column")
    return names, columns


def _weighted_nansum(columns: list[torch.Tensor], lam: list[float]) -> torch.Tensor:
    """``Σ_j λ_j r_j`` per sample in the working dtype, NaN terms counted as 0 (a fresh tensor)."""
    dtype = work_dtype(functools.reduce(torch.promote_types, (t.dtype for t in columns)))
    # One read pass per column and one host sync: a column whose sum is finite has no NaN and
    # no inf, so its terms need no NaN handling and accumulate in one fused pass each.
    sums = torch.stack([t.sum(dtype=torch.float64) for t in columns]).tolist()
    utils: torch.Tensor | None = None
    for lam_j, column, total in zip(lam, columns, sums):
        column = column.to(dtype)
        if total - total == 0.0:
            if utils is None:
                utils = torch.mul(column, lam_j)
            else:
                utils.add_(column, alpha=lam_j)
            continue
        # nansum semantics: a NaN term (NaN reward, or 0 * inf) counts as 0; inf stays inf.
        term = torch.mul(column, lam_j).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
        utils = term if utils is None else utils.add_(term)
    assert utils is not None  # there is at least one column (_reward_columns)
    return utils


def _reward_weights(weights: Any, names: list[str], where: str) -> list[float]:
    if isinstance(weights, Mapping):
        missing = [n for n in names if n not in weights]
        if missing:
            raise ComputeError(f"{where}: weights: no weight for reward {missing[0]!r}")
        weights = [weights[n] for n in names]
    elif isinstance(weights, torch.Tensor):
        weights = weights.tolist()
    weights = list(weights)
    if len(weights) != len(names):
        raise ComputeError(
            f"{where}: weights: expected {len(names)} weights (one per reward), got {len(weights)}"
        )
    out = []
    for name, w in zip(names, weights):
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise ComputeError(
                f"{where}: weights: expected a finite number for {name!r}, got {w!r}"
            )
        out.append(float(w))
    return out


# ---------------------------------------------------------------------------- §3.2 advantages
# How advantages are scaled after the group mean is subtracted: by the group's std ("group",
# the GRPO paper and our default), by the std of the whole batch ("batch", one of TRL's
# options), or not at all ("none", Dr. GRPO). ``True``/``False`` are the older spellings of
# "group"/"none".
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS = ("group", "batch", "none")
# What a missing utility (NaN: every reward function returned None, TRL's "unscorable"
# completion) does: "raise" refuses it, naming the group; "exclude" leaves it out of its
# group's mean and std (and the batch std) and gives it advantage 0, as TRL does.
Missing = Literal["raise", "exclude"]
# TRL's two ways to combine several reward functions (``multi_objective_aggregation``).
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def check_scale_rewards(scale_rewards: Any, where: str) -> ScaleRewards:
    """``scale_rewards`` as one of :data:`SCALE_REWARDS` (a bool is the older spelling)."""
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ComputeError(
            f"{where}: scale_rewards: expected one of {SCALE_REWARDS}, got {scale_rewards!r}"
        )
    return scale_rewards


def group_advantages(
    utils: Any,
    *,
    scale_rewards: ScaleRewards | bool = "group",
    eps: float = 1e-4,
    missing: Missing = "raise",
    out: torch.Tensor | None = None,
) -> Ragged:
    """Group-normalised advantages ``A_i = (U_i - μ_g) / (σ + eps)`` (§3.2).

    Parameters
    ----------
    utils:
        Per-sample utilities grouped by prompt.
    scale_rewards:
        ``"group"`` (default): ``σ = σ_g``, the unbiased std of the group (divide by
        ``K - 1``), defined as 0 for ``K = 1``, so a single-completion group and a constant
        group get ``A = 0``. ``"batch"``: ``σ`` is the unbiased std of all utilities of the
        batch about their global mean (TRL's ``scale_rewards="batch"``; the mean is still the
        group's). ``"none"`` (Dr. GRPO): ``A_i = U_i - μ_g``. ``True``/``False`` mean
        ``"group"``/``"none"``. The baseline is the plain group mean (no leave-one-out).
    eps:
        Added to ``σ`` (TRL and the seed: 1e-4).
    missing:
        ``"raise"`` (default) refuses a NaN utility, naming its group. ``"exclude"`` (TRL's
        convention for a completion every reward function returned ``None`` for) leaves NaN
        utilities out of the means and stds (NaN-aware, Bessel-corrected over the values
        present) and gives them ``A = 0``; an infinite utility is still refused.
    out:
        An optional ``[N]`` buffer (working dtype, contiguous, sharing no memory with
        ``utils``) that receives the advantages, e.g. one reused across training steps so
        the step allocates no fresh ``[N]`` pages (on CPU, the kernel zeroing fresh pages
        costs about as much as a pass over them).
    """
    where = "group_advantages: utils"
    scale = check_scale_rewards(scale_rewards, "group_advantages")
    if missing not in ("raise", "exclude"):
        raise ComputeError(
            f"group_advantages: missing: expected 'raise' or 'exclude', got {missing!r}"
        )
    ragged, seg, u = grouped_input(utils, where)
    eps = check_scalar(eps, "group_advantages: eps", low=0.0, strict=False)
    out = check_out(out, like=u, n=seg.num_values, where="group_advantages", inputs=[("utils", u)])
    if missing == "exclude":
        check_finite(u.masked_fill(u.isnan(), 0.0), seg, where)  # NaN is allowed, inf is not
        absent = torch.isnan(u)
        if bool(absent.any()):
            return Ragged(
                _advantages_without(u, absent, seg, scale, eps, out), ragged.offsets, validate=False
            )
    check_finite(u, seg, where)
    centred = seg.apply(torch.sub, u, seg.mean(u), out=out)
    if scale == "none":
        return Ragged(centred, ragged.offsets, validate=False)
    if scale == "batch":
        n = seg.num_values
        # The batch std is about the global mean, not the group means (TRL's nanstd(rewards)).
        std = float(torch.linalg.vector_norm(u - u.mean())) / math.sqrt(n - 1) if n > 1 else 0.0
        factor = 1.0 / (std + eps) if std + eps > 0 else 1.0  # eps = 0: constant batch, all 0
        return Ragged(centred.mul_(factor), ragged.offsets, validate=False)
    k = seg.float_lengths(u.dtype)
    # sqrt(Σ c²) / sqrt(K - 1): the norm reads the centred values once, with no [N] squares.
    std = seg.norm(centred).div_((k - 1.0).clamp_(min=1.0).sqrt_())
    std = torch.where(k > 1.0, std, 0.0)
    denom = std + eps
    # eps = 0 with a constant group would be 0/0; its centred values are exactly 0. One
    # reciprocal per group, then a multiply per sample (a divide costs 3x the multiply).
    scale_g = torch.where(denom > 0, denom, 1.0).reciprocal_()
    adv = seg.apply(torch.mul, centred, scale_g, out=centred)
    return Ragged(adv, ragged.offsets, validate=False)


def _advantages_without(
    u: torch.Tensor,
    absent: torch.Tensor,
    seg: Segments,
    scale: str,
    eps: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The advantages with the NaN utilities left out (``missing="exclude"``): means and
    Bessel-corrected stds over the values present, ``A = 0`` where the utility is missing or
    the std is undefined (fewer than two values), as TRL's ``nanmean``/``nanstd`` then
    ``nan_to_num`` give."""
    present = (~absent).to(u.dtype)
    filled = u.masked_fill(absent, 0.0)
    count = seg.sum(present)
    mean = seg.sum(filled) / count.clamp(min=1.0)
    centred = seg.apply(torch.sub, filled, mean, out=out).mul_(present)
    if scale == "none":
        return centred
    if scale == "batch":
        n = float(present.sum())
        total_mean = filled.sum() / max(n, 1.0)
        spread = torch.linalg.vector_norm((filled - total_mean) * present)
        denom = float(spread) / math.sqrt(n - 1.0) + eps if n >= 2 else 0.0
        # TRL: nanstd of fewer than two values is NaN, so every advantage is 0; a zero
        # denominator (eps = 0, a constant batch) has all-zero centred values.
        return centred.zero_() if n < 2 else centred.mul_(1.0 / denom if denom > 0 else 1.0)
    std = torch.sqrt(seg.sum(centred * centred) / (count - 1.0).clamp(min=1.0))
    denom = std + eps
    # Fewer than two values present: TRL's std is NaN and the advantage 0 (nan_to_num).
    factor = torch.where(count > 1.0, torch.where(denom > 0, denom, 1.0).reciprocal(), 0.0)
    return seg.apply(torch.mul, centred, factor, out=centred)


def multi_objective_advantages(
    per_reward_values: Mapping[str, Any] | torch.Tensor,
    weights: Sequence[float] | Mapping[str, float] | torch.Tensor,
    *,
    offsets: torch.Tensor,
    aggregation: Aggregation = "sum_then_normalize",
    scale_rewards: ScaleRewards | bool = "group",
    eps: float = 1e-4,
) -> Ragged:
    """TRL's advantages from several raw reward columns (its ``multi_objective_aggregation``).

    A completion for which every reward function gave NaN (``None``) is unscorable: it is left
    out of every mean and std and gets ``A = 0``. A NaN from some functions only counts as 0
    in the weighted sum (``nansum``).

    ``"sum_then_normalize"`` (TRL's default): ``U_i = nansum_j(λ_j r_ij)`` (NaN when
    unscorable), then :func:`group_advantages` with ``scale_rewards`` and
    ``missing="exclude"``. ``"normalize_then_sum"`` (GDPO): each function's rewards are
    normalised within their group first (``(r - μ_g) / (σ_g + eps)``, NaN-aware), summed with
    the weights, and the sums normalised over the whole batch (``scale_rewards`` is not used,
    as in TRL).

    Parameters
    ----------
    per_reward_values:
        Raw rewards, a dict ``name -> [N]`` or an ``[N, R]`` tensor, NaN where missing.
    weights:
        ``λ_j``, one per reward function (or a dict by name).
    offsets:
        The group offsets ``[P + 1]`` of the ``N`` samples.
    """
    where = "multi_objective_advantages"
    if aggregation not in AGGREGATIONS:
        raise ComputeError(
            f"{where}: aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}"
        )
    scale = check_scale_rewards(scale_rewards, where)
    names, columns = _reward_columns(per_reward_values, where)
    lam = _reward_weights(weights, names, where)
    probe = flat_values(columns[0], f"{where}: per_reward_values[{names[0]!r}]")
    device, n = probe.device, int(probe.shape[0])
    segments = Segments.cached(offsets, num_values=n, device=device, where=f"{where}: offsets")
    tensors = [
        as_sample_vector(
            c, n=n, where=f"{where}: per_reward_values[{name!r}]", device=device, segments=segments
        ).to(work_dtype(probe.dtype))
        for name, c in zip(names, columns)
    ]
    unscorable = functools.reduce(torch.logical_and, [torch.isnan(t) for t in tensors])
    offsets = segments.offsets
    if aggregation == "normalize_then_sum":
        tensors = [
            group_advantages(Ragged(t, offsets, validate=False), eps=eps, missing="exclude").values
            for t in tensors
        ]
    utils = _weighted_nansum(tensors, lam).masked_fill_(unscorable, math.nan)
    if aggregation == "normalize_then_sum":
        whole = torch.tensor([0, n], dtype=offsets.dtype, device=device)
        adv = group_advantages(Ragged(utils, whole, validate=False), eps=eps, missing="exclude")
        return Ragged(adv.values, offsets, validate=False)
    return group_advantages(
        Ragged(utils, offsets, validate=False), scale_rewards=scale, eps=eps, missing="exclude"
    )


def apply_group_scales(advantages: Any, scales: Any) -> Ragged:
    """``A_i <- s_g A_i`` for a per-group scale ``s`` ``[P]`` (the SEED-GRPO step of §3.3)."""
    ragged, seg, a = grouped_input(advantages, "apply_group_scales: advantages")
    s = torch.as_tensor(scales, device=a.device)
    if s.dim() != 1 or s.shape[0] != len(seg):
        raise ComputeError(
            f"apply_group_scales: scales: expected {len(seg)} values (one per group), got "
            f"shape {tuple(s.shape)}"
        )
    return Ragged(seg.apply(torch.mul, a, s.to(a.dtype)), ragged.offsets, validate=False)


# ---------------------------------------------------------------------------- §3.4 q
def q_distribution(
    utils: Any,
    *,
    temperature: float = 1.0,
    epsilon: float = 1e-6,
    out: torch.Tensor | None = None,
) -> Ragged:
    """Listwise target ``q = renorm(softmax_g(U / T_q) (1 - K ε) + ε)`` (§3.4).

    The softmax is max-subtracted per group, so any finite utilities at any temperature give
    finite q. ``temperature`` is floored at 1e-8 (0 means a hard argmax mixed with ε); a
    negative one is refused. When ``K ε >= 1`` the group's ε is clamped to ``1/K - 1e-8`` (the
    [F] guard; without it q would go negative). Each group sums to 1 and every q >= ε_g.
    ``out`` is an optional result buffer, as for :func:`group_advantages`.
    """
    where = "q_distribution: utils"
    ragged, seg, u = grouped_input(utils, where)
    t = check_scalar(temperature, "q_distribution: temperature", low=0.0, strict=False)
    epsilon = check_scalar(epsilon, "q_distribution: epsilon", low=0.0, strict=False)
    out = check_out(out, like=u, n=seg.num_values, where="q_distribution", inputs=[("utils", u)])
    low, high = finite_range(u, seg, where)
    t = max(t, _MIN_TEMPERATURE)
    # Division is monotone, so max(u / t) is high / t exactly (the same IEEE division).
    bottom, top = low / t, high / t
    mode = shift_mode(bottom, top, u.dtype)
    if mode == "none":
        z = torch.mul(u, LOG2E / t, out=out)
    else:
        z = torch.div(u, t, out=out)  # as the reference: its rounding is what the shift keeps
        shift_(z, seg, mode, top)
        z.mul_(LOG2E)
    e = z.exp2_()
    k = seg.float_lengths(u.dtype)
    eps_g = torch.clamp(1.0 / k - _EPS_MARGIN, max=epsilon).clamp(min=0.0)
    # q = softmax (1 - K ε) + ε in two passes. The original renormalised once more; that sum
    # is (1 - K ε) + K ε = 1 analytically, so the extra pass is skipped.
    seg.apply(torch.mul, e, (1.0 - k * eps_g) / seg.sum(e), out=e)
    if epsilon <= 1.0 / seg.max_length - _EPS_MARGIN:
        q = e.add_(epsilon)  # no group is clamped: ε_g = ε everywhere, a scalar add
    else:
        q = seg.apply(torch.add, e, eps_g, out=e)
    return Ragged(q, ragged.offsets, validate=False)


# ---------------------------------------------------------------------------- §3.6 weights
def maxent_weights(
    q: Any,
    ref_logp: Any,
    *,
    tau: float,
    beta: float,
    denominator: Denominator = "tau",
    token_counts: Any = None,
    length_normalize: bool = False,
    length_reweight: bool = False,
    out: torch.Tensor | None = None,
) -> Ragged:
    """MaxEnt weights ``w = softmax_g((ln max(q, 1e-12) + β ρ) / D)`` (§3.6).

    Parameters
    ----------
    q:
        The listwise target (:func:`q_distribution`).
    ref_logp:
        The reference term per sample: either the per-token mean (``ReferenceLogprobs.
        ref_logp_sum``, the default ``len_norm_ref`` convention) or the sequence sum
        (``ref_logp_sum_raw``). ``[N]`` tensor or a ``Ragged`` grouped like ``q``.
    tau, beta:
        Temperature ``τ > 0`` and reference strength ``β >= 0``.
    denominator:
        ``"tau"``: ``D = τ`` (the [F] convention, after 2026-03-11), the maximiser of
        ``E_w[ln q + β ln π_ref] + τ H(w)``. ``"tau+beta"``: ``D = τ + β`` (the [C]
        convention), the maximiser of ``E_w[ln q] + τ H(w) - β KL(w || π_ref)``. Record which
        one produced stored weights: they differ whenever ``β > 0``.
    token_counts:
        ``T_i``, needed by ``length_normalize`` and ``length_reweight``.
    length_normalize:
        Divide ``ref_logp`` (then a sum) by ``max(T_i, 1)`` to get the per-token mean.
    length_reweight:
        The [C] post-softmax reweighting used with sum references: ``w ∝ w · max(T_i, 1)``.
    out:
        An optional result buffer, as for :func:`group_advantages` (sharing no memory with
        ``q``, ``ref_logp`` or ``token_counts``).
    """
    where = "maxent_weights"
    ragged, seg, qv = grouped_input(q, f"{where}: q")
    tau = check_scalar(tau, f"{where}: tau", low=0.0, strict=True)
    beta = check_scalar(beta, f"{where}: beta", low=0.0, strict=False)
    if denominator not in ("tau", "tau+beta"):
        raise ComputeError(f"{where}: denominator must be 'tau' or 'tau+beta', got {denominator!r}")
    rho, counts, given = _reference_term(
        ref_logp,
        token_counts,
        seg,
        qv,
        use_counts=length_normalize or length_reweight,
        length_normalize=length_normalize,
        where=where,
    )
    out = check_out(out, like=qv, n=seg.num_values, where=where, inputs=[("q", qv), *given])
    q_low, q_high = finite_range(qv, seg, f"{where}: q")
    r_low, r_high = finite_range(rho, seg, f"{where}: ref_logp")
    d = tau + beta if denominator == "tau+beta" else tau
    # The logits in base 2: (log2 max(q, 1e-12) + β log2(e) ρ) / D, for exp2 below. The clamp
    # pass runs only when some q is below the floor.
    logits = log2(qv.clamp(min=_MIN_Q) if q_low < _MIN_Q else qv, out=out)
    if beta != 0.0:
        logits.add_(rho, alpha=beta * LOG2E)
    logits.mul_(1.0 / d)
    # Bounds of the (natural) logits from those of q and ρ, with no extra pass: ln is monotone.
    top = (math.log(max(q_high, _MIN_Q)) + beta * r_high) / d
    bottom = (math.log(max(q_low, _MIN_Q)) + beta * r_low) / d
    shift_(logits, seg, shift_mode(bottom, top, logits.dtype), top * LOG2E)
    e = logits.exp2_()
    if length_reweight:
        assert counts is not None  # use_counts above
        e.mul_(counts)
    w = seg.apply(torch.mul, e, seg.sum(e).reciprocal_(), out=e)
    return Ragged(w, ragged.offsets, validate=False)


def _reference_term(
    ref_logp: Any,
    token_counts: Any,
    seg: Segments,
    q: torch.Tensor,
    *,
    use_counts: bool,
    length_normalize: bool,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[str, torch.Tensor]]]:
    """``ρ`` in ``q``'s dtype (divided by ``max(T, 1)`` with ``length_normalize``), the clamped
    counts ``max(T, 1)`` when ``use_counts`` (else None), and the inputs as given (named, for
    the ``out`` aliasing check)."""
    n, device = seg.num_values, q.device
    rho = as_sample_vector(
        ref_logp, n=n, where=f"{where}: ref_logp", device=device, segments=seg
    ).to(q.dtype)
    given = [("ref_logp", rho)]
    if not use_counts:
        return rho, None, given
    if token_counts is None:
        raise ComputeError(f"{where}: token_counts: required by length_normalize/reweight")
    raw_counts = as_sample_vector(
        token_counts, n=n, where=f"{where}: token_counts", device=device, segments=seg
    )
    given.append(("token_counts", raw_counts))
    counts = raw_counts.to(q.dtype).clamp(min=1.0)
    if length_normalize:
        rho = rho / counts
    return rho, counts, given


def group_entropy(dist: Any) -> torch.Tensor:
    """Entropy ``H_g = -Σ p ln p`` of each group's distribution ``[P]`` (``0 ln 0 = 0``)."""
    _, seg, p = grouped_input(dist, "group_entropy: dist")
    # `+ 0.0` turns the -0.0 of a one-hot group into 0.0.
    return -seg.sum(torch.special.xlogy(p, p)) + 0.0


@dataclass(frozen=True)
class WeightEntropy:
    """Per-group entropies of the weights and their mean / min / max (``WeightStats``)."""

    per_group: torch.Tensor
    mean: float
    min: float
    max: float


def weight_entropy(weights: Any) -> WeightEntropy:
    """``H(w_g)`` per group and its summary (``weight_entropy`` = mean over groups, §3.6)."""
    h = group_entropy(weights)
    mean, low, high = torch.stack([h.mean(), h.min(), h.max()]).tolist()
    return WeightEntropy(per_group=h, mean=mean, min=low, max=high)


# ---------------------------------------------------------------------------- §2.6, §2.13
# The step statistics, one definition each (``docs/formulas.md`` §2.6, §2.13, "Step
# statistics"): the seed records (RewardMoments, LengthStats), the stored step rows of every
# writer (this library's trainer, the TRL and verl recorders) and, held to these by a property
# test, the SQL of the analytics. An empty set gives ``None`` (NULL when stored); the seed's
# records keep the original's 0.0 instead.


@dataclass(frozen=True)
class ScoredMoments:
    """The moments of the *scored* values of a step: a NaN is an unscored completion (TRL
    turns a reward function's ``None`` into NaN; none of the functions scored it), left out of
    ``mean`` and the **population** ``std`` (divide by n; 0 for one value) and counted in
    ``unscored``. ``mean``/``std`` are ``None`` when nothing was scored."""

    scored: int
    unscored: int
    mean: float | None
    std: float | None


def scored_moments(values: Any) -> ScoredMoments:
    """:class:`ScoredMoments` of a flat vector (or ``Ragged``) of values.

    Ranks merge exactly (:func:`merge_step_rows`): the mean weighted by ``scored``, the std
    pooled from each rank's (scored, mean, std).
    """
    v = flat_values(values, "scored_moments: values").to(torch.float64)
    scored = ~torch.isnan(v)
    n = int(scored.sum())
    if n == 0:
        return ScoredMoments(0, int(v.numel()), None, None)
    # All scored: the two reductions over the values themselves, no masked copy
    # (torch.var_mean's Welford loop is ~6x slower than both together).
    kept = v if n == v.numel() else v[scored]
    mean, std = torch.stack([kept.mean(), torch.std(kept, correction=0)]).tolist()
    return ScoredMoments(n, int(v.numel()) - n, float(mean), float(std))


def reward_moments(utils: Any) -> RewardMoments:
    """Mean and **population** std (divide by N; 0 when N = 1) of the utilities (§2.6).

    The seed's record: every value must be finite (a NaN or inf is a
    :class:`~maxent_arrow.errors.ComputeError` naming the sample). The stored step statistic
    of a batch with unscored (NaN) completions is :func:`scored_moments`.
    """
    u = flat_values(utils, "reward_moments: utils")
    # Separate reductions: torch.var_mean's Welford loop is ~6x slower than both together. The
    # full-tensor std is a two-pass reduction with no [N] temporary (a fresh 8 MB temporary
    # can cost more in page faults than the pass itself). A NaN or inf makes the mean
    # non-finite, which is the finiteness check.
    mean = u.mean()
    std = torch.std(u, correction=0)
    m, s = torch.stack([mean, std]).tolist()
    if not math.isfinite(m):
        check_finite(u, None, "reward_moments: utils", fast=False)
    return RewardMoments(mean=m, std=s)


def clipped_flags(
    token_counts: Any, *, max_completion_len: int | None = None, truncated: Any = None
) -> torch.Tensor:
    """Which completions were cut at the length cap: ``T_i >= max_completion_len`` when the
    cap is known (the seed's ``LengthStats`` rule), else the generator's ``truncated`` flags
    (``completion_info.truncated``). A bool ``[N]`` tensor on the counts' device."""
    t = flat_values(token_counts, "clipped_flags: token_counts")
    if max_completion_len is not None:
        return t >= int(max_completion_len)
    if truncated is None:
        raise ComputeError("clipped_flags: expected max_completion_len or truncated flags")
    flags = flat_values(truncated, "clipped_flags: truncated").to(torch.bool)
    if flags.shape != t.shape:
        raise ComputeError(
            f"clipped_flags: truncated: expected {t.numel()} flags (one per completion), got "
            f"{flags.numel()}"
        )
    return flags.to(t.device)


# The stored length statistics, in LengthStats's field order (the column registry's).
LENGTH_FIELDS = R.feeding("LengthStats", R.STEP)


def length_summary(token_counts: Any, clipped: Any) -> dict[str, float | None]:
    """The length statistics of a step (§2.13): min/mean/max of ``T_i``, the fraction
    ``clipped``, and min/mean/max of the completions that terminated (not clipped). A set
    that is empty gives ``None``: the terminated fields when every completion was clipped,
    every field when there is no completion. (The seed's ``LengthStats`` gives 0.0 there:
    :func:`length_stats`.)

    Ranks merge exactly (:func:`merge_step_rows`): mins and maxes of mins and maxes, the
    means and the clipped fraction weighted by the completions (terminated ones for the
    terminated mean)."""
    t = flat_values(token_counts, "length_summary: token_counts").to(torch.float64)
    c = flat_values(clipped, "length_summary: clipped").to(device=t.device, dtype=torch.bool)
    if c.shape != t.shape:
        raise ComputeError(
            f"length_summary: clipped: expected {t.numel()} flags (one per completion), got "
            f"{c.numel()}"
        )
    if t.numel() == 0:
        return dict.fromkeys(LENGTH_FIELDS)
    done = ~c
    n_done = done.sum()
    inf = torch.tensor(math.inf, dtype=t.dtype, device=t.device)
    stats = torch.stack(
        [
            t.min(),
            t.mean(),
            t.max(),
            c.to(t.dtype).mean(),
            torch.where(done, t, inf).min(),
            torch.where(done, t, 0.0).sum() / n_done.clamp(min=1),
            torch.where(done, t, -inf).max(),
            n_done.to(t.dtype),
        ]
    ).tolist()
    out: dict[str, float | None] = dict(zip(LENGTH_FIELDS, stats[:7]))
    if stats[7] == 0:
        for name in LENGTH_FIELDS[4:]:
            out[name] = None
    return out


def length_stats(token_counts: Any, *, max_completion_len: int) -> LengthStats:
    """Length summary of ``T_i`` (§2.13): min/mean/max, the fraction that hit the cap
    (``T_i >= max_completion_len``), and min/mean/max of those that terminated (0 if none, as
    the original; the stored step statistic is ``NULL`` there: :func:`length_summary`)."""
    where = "length_stats: token_counts"
    t = flat_values(token_counts, where).to(torch.float64)
    if not is_int(max_completion_len) or int(max_completion_len) < 1:
        raise ComputeError(
            f"length_stats: max_completion_len: expected an int >= 1, got {max_completion_len!r}"
        )
    max_completion_len = int(max_completion_len)
    check_finite(t, None, where)
    if bool((t < 0).any()):
        i = int(torch.nonzero(t < 0)[0, 0])
        raise ComputeError(f"{where}: expected counts >= 0, got {float(t[i])} at sample {i}")
    summary = length_summary(t, clipped_flags(t, max_completion_len=max_completion_len))
    return LengthStats(*(float(summary[f] or 0.0) for f in LENGTH_FIELDS))


def merge_step_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One step's statistics from its ranks' step rows (mappings of step-table values): for
    each column whose registry row declares a ``merge`` rule, what the step row of every
    rank's completions at once holds. A ``None`` (an empty set) takes no part, and a merge of
    nothing is ``None``."""
    weights = {
        "num_samples": [float(r.get("num_samples") or 0) for r in rows],
        "num_scored": [float(r.get("num_scored") or 0) for r in rows],
        # The terminated completions of a rank: its samples that were not clipped.
        "num_terminated": [
            float(r.get("num_samples") or 0) * (1.0 - float(r.get("clipped_ratio") or 0.0))
            for r in rows
        ],
    }
    out: dict[str, Any] = {}
    for column in R.columns(R.STEP, where=lambda c: c.merge is not None):
        rule, _, by = str(column.merge).partition(":")
        name = column.name
        w = weights[by] if by else [1.0] * len(rows)
        kept = [(r, wi) for r, wi in zip(rows, w) if r.get(name) is not None and wi > 0]
        values = [r[name] for r, _ in kept]
        if rule == "sum":
            out[name] = sum(r.get(name) or 0 for r in rows)
        elif not kept:
            out[name] = None
        elif rule == "min":
            out[name] = min(values)
        elif rule == "max":
            out[name] = max(values)
        elif rule == "mean":
            out[name] = sum(v * wi for v, (_, wi) in zip(values, kept)) / sum(wi for _, wi in kept)
        elif rule == "pooled_std":  # E[x^2] - E[x]^2 over the union of the ranks' values
            total = sum(wi for _, wi in kept)
            mean = sum(r["reward_mean"] * wi for r, wi in kept) / total
            second = sum((r[name] ** 2 + r["reward_mean"] ** 2) * wi for r, wi in kept) / total
            out[name] = math.sqrt(max(second - mean * mean, 0.0))
        else:  # pragma: no cover - a registry rule this function does not know
            raise ComputeError(f"merge_step_rows: {name}: unknown merge rule {column.merge!r}")
    return out


# ---------------------------------------------------------------------------- §3.5 bonus
@dataclass(frozen=True)
class EntropyBonus:
    """The policy-entropy bonus of §3.5, all per sample with the groups' offsets.

    ``per_token`` is ``h_i``, ``zscore`` ``z_i``, ``bonus`` ``b_i = c σ_R z_i``, ``utils`` the
    new ``U_i + b_i``, and ``scale`` ``σ_R`` (``RewardComputation.entropy_bonus_scale``).
    """

    per_token: Ragged
    zscore: Ragged
    bonus: Ragged
    utils: Ragged
    scale: float


def entropy_bonus(
    utils: Any,
    policy_entropy_sum: Any,
    token_counts: Any,
    *,
    coef: float,
    reward_std: float | None = None,
) -> EntropyBonus:
    """Add ``b_i = c σ_R z_i`` to the utilities (§3.5).

    ``h_i = entropy_sum_i / max(T_i, 1)`` is z-scored within its group (population std,
    floored at 1e-6; a non-finite z becomes 0), ``σ_R`` is ``reward_std`` or the population
    std of ``utils`` before the bonus (1.0 when it is not positive or not finite).
    """
    where = "entropy_bonus"
    ragged, seg, u = grouped_input(utils, f"{where}: utils")
    coef = check_scalar(coef, f"{where}: coef", low=-math.inf, strict=False)
    n, device = seg.num_values, u.device
    ent = as_sample_vector(
        policy_entropy_sum,
        n=n,
        where=f"{where}: policy_entropy_sum",
        device=device,
        segments=seg,
    ).to(u.dtype)
    counts = as_sample_vector(
        token_counts, n=n, where=f"{where}: token_counts", device=device, segments=seg
    ).to(u.dtype)
    h = ent / counts.clamp(min=1.0)
    centred = h - seg.expand(seg.mean(h))
    std = torch.sqrt(seg.sum(centred * centred) / seg.lengths.to(u.dtype))
    z = centred / seg.expand(std.clamp(min=_Z_STD_FLOOR))
    z = torch.where(torch.isfinite(z), z, 0.0)
    sigma = reward_moments(u).std if reward_std is None else float(reward_std)
    if not math.isfinite(sigma) or sigma <= 0:
        sigma = 1.0
    b = coef * sigma * z
    offsets = ragged.offsets

    def wrap(values: torch.Tensor) -> Ragged:
        return Ragged(values, offsets, validate=False)

    return EntropyBonus(
        per_token=wrap(h), zscore=wrap(z), bonus=wrap(b), utils=wrap(u + b), scale=sigma
    )
