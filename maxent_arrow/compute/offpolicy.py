"""Off-policy corrections on flat per-token log-probs and completion offsets
(``docs/formulas.md`` §3.11).

The current (training) policy's log-probs ``log π`` and the behaviour (rollout, sampling)
policy's ``log μ`` arrive as flat ``[N]`` token tensors, one row per completion described by
int64 ``offsets`` (or as :class:`~maxent_arrow.Ragged` rows), with an optional flat ``mask``
(True on tokens that count: tool output or truncated spans are False). Everything is a
segment reduction over the offsets (:class:`~maxent_arrow.compute.Segments`), the same code
on CPU and GPU, with one host sync for the scalar metrics; no Python loop over completions.

- :func:`trl_importance_ratio`, :func:`trl_importance_metrics`: TRL's four
  ``vllm_importance_sampling_mode``\\ s (``token_truncate``, ``token_mask``,
  ``sequence_truncate``, ``sequence_mask``), which TRL computes inline in
  ``GRPOTrainer._generate_and_score_completions``;
- :func:`rollout_is_weights`, :func:`rollout_rejection_mask`, :func:`offpolicy_metrics` and
  their composition :func:`rollout_correction`: verl's rollout correction
  (``verl/trainer/ppo/rollout_corr_helper.py``): truncated (TIS) or IcePop importance weights
  at token or sequence level, the eleven ``rollout_rs`` rejection criteria, and the
  diagnostics verl logs (KL, k3, χ² per token and per sequence, ESS, perplexities), with
  verl's metric names;
- :func:`kept_set_log_mass`, :func:`kept_set_ratio` and :func:`kept_mass_audit`: the kept-set
  renormalisation that removes the top-p / top-k bias of an importance ratio when the
  sampler's kept sets are stored (``kept_token_ids``), and the audit of the kept mass
  ``E[log S]`` (trl#6789, trl#7269).

A completion whose tokens are all masked (or that has none) follows verl's padded semantics:
its sums are 0, its means are 0, and it still counts in the batch means verl takes over rows
(the perplexities, ``chi2_seq``, ``log_ppl_diff``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.compute.kl import check_same_rows, k3
from maxent_arrow.compute.segments import Segments, as_ragged, work_dtype
from maxent_arrow.errors import ComputeError

__all__ = [
    "IS_SAFETY_BOUND",
    "KeptMass",
    "kept_mass_audit",
    "kept_set_log_mass",
    "kept_set_ratio",
    "RS_MODES",
    "TRL_IS_MODES",
    "ImportanceWeights",
    "RejectionMask",
    "RolloutCorrection",
    "offpolicy_metrics",
    "rollout_correction",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "trl_importance_metrics",
    "trl_importance_ratio",
]

TrlIsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
TRL_IS_MODES: tuple[str, ...] = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)
# verl's rejection criteria: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r per token,
# then per token, or per sequence as a sum, mean or max (verl's SUPPORTED_ROLLOUT_RS_OPTIONS).
RS_MODES: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
# verl clamps log-ratios to ±20 before exponentiating (its SAFETY_BOUND): exp(20) ≈ 4.9e8.
IS_SAFETY_BOUND = 20.0
# verl's masked means divide by (count + 1e-8) and its ESS by (mean + 1e-8); the second is kept
# (it decides the result when IcePop zeroes nearly every weight), the first is a relative 1e-8.
_ESS_EPS = 1e-8
_NORMALIZE_FLOOR = 1e-8


# ---------------------------------------------------------------------------- inputs
class _Tokens:
    """The checked token rows of one call: current and behaviour log-probs in the working
    dtype, their segments, the mask (``None``: every token counts) and derived counts."""

    __slots__ = ("cur", "beh", "seg", "mask", "dtype", "_counts", "_valid_rows")

    def __init__(
        self, cur: torch.Tensor, beh: torch.Tensor, seg: Segments, mask: torch.Tensor | None
    ):
        self.cur = cur
        self.beh = beh
        self.seg = seg
        self.mask = mask
        self.dtype = cur.dtype
        self._counts: torch.Tensor | None = None
        self._valid_rows: torch.Tensor | None = None

    def masked(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``values`` with every uncounted token replaced by ``fill`` (NaNs there included)."""
        if self.mask is None:
            return values
        return torch.where(self.mask, values, torch.full((), fill, dtype=values.dtype))

    @property
    def counts(self) -> torch.Tensor:
        """Counted tokens per completion ``[B]`` (working dtype)."""
        if self._counts is None:
            if self.mask is None:
                self._counts = self.seg.float_lengths(self.dtype)
            else:
                self._counts = self.seg.sum(self.mask.to(self.dtype))
        return self._counts

    @property
    def valid_rows(self) -> torch.Tensor:
        """Completions with at least one counted token ``[B]`` bool."""
        if self._valid_rows is None:
            self._valid_rows = self.counts > 0
        return self._valid_rows

    def total(self) -> torch.Tensor:
        return self.counts.sum()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over every counted token of the batch (a 0-dim tensor)."""
        return self.masked(values).sum() / self.total()

    def row_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.seg.sum(self.masked(values))

    def row_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-completion means over counted tokens ``[B]``, 0 where none counts (as verl)."""
        return self.row_sum(values) / self.counts.clamp(min=1.0)

    def row_max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-completion maxima over counted tokens ``[B]``, 0 where none counts (as verl)."""
        top = self.seg.max(self.masked(values, -math.inf))
        return torch.where(torch.isneginf(top), torch.zeros_like(top), top)

    def token_max(self, values: torch.Tensor) -> torch.Tensor:
        return self.masked(values, -math.inf).amax()

    def token_min(self, values: torch.Tensor) -> torch.Tensor:
        return self.masked(values, math.inf).amin()

    def expand(self, per_row: torch.Tensor) -> torch.Tensor:
        return self.seg.expand(per_row)


def _rows(
    value: Any, offsets: torch.Tensor | None, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and offsets from a ``Ragged`` (no ``offsets``) or a flat tensor plus
    ``offsets``."""
    if isinstance(value, Ragged):
        if offsets is not None and not torch.equal(offsets.to(value.offsets.device), value.offsets):
            raise ComputeError(
                f"{where}: a Ragged carries its own offsets; they differ from offsets="
            )
        ragged = as_ragged(value, where)
        return ragged.values, ragged.offsets
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise ComputeError(
            f"{where}: expected a Ragged or a flat [N] tensor with offsets=, got "
            f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
        )
    if offsets is None:
        raise ComputeError(f"{where}: a flat tensor needs offsets= (one row per completion)")
    return value, offsets


def _tokens(
    logp: Any,
    behaviour_logp: Any,
    offsets: torch.Tensor | None,
    mask: Any,
    where: str,
    *,
    need_token: bool = True,
) -> _Tokens:
    cur, off = _rows(logp, offsets, f"{where}: logp")
    if not cur.is_floating_point():
        raise ComputeError(f"{where}: logp: expected floating log-probs, got {cur.dtype}")
    seg = Segments.cached(
        off,
        num_values=int(cur.shape[0]),
        device=cur.device,
        where=f"{where}: offsets",
        allow_empty=True,
    )
    if isinstance(behaviour_logp, Ragged):
        check_same_rows(
            Ragged(cur, seg.offsets, validate=False), behaviour_logp, f"{where}: behaviour_logp"
        )
        beh = behaviour_logp.values
    else:
        beh = behaviour_logp
    if not isinstance(beh, torch.Tensor) or beh.shape != cur.shape:
        raise ComputeError(
            f"{where}: behaviour_logp: expected {cur.shape[0]} token values (as logp), got "
            f"{type(beh).__name__} {tuple(getattr(beh, 'shape', ()))}"
        )
    if len(seg) == 0:
        raise ComputeError(f"{where}: expected at least one completion, got an empty batch")
    dtype = work_dtype(cur.dtype)
    m = None
    if mask is not None:
        if isinstance(mask, Ragged):
            mask = mask.values
        if not isinstance(mask, torch.Tensor) or mask.shape != cur.shape:
            raise ComputeError(
                f"{where}: mask: expected a flat [{cur.shape[0]}] tensor (one flag per token), "
                f"got {type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}"
            )
        m = mask.to(cur.device) != 0
    tokens = _Tokens(cur.to(dtype), beh.to(device=cur.device, dtype=dtype), seg, m)
    if need_token and not bool(tokens.total() > 0):
        raise ComputeError(f"{where}: mask: expected at least one counted token, got none")
    return tokens


def _floats(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Scalar metrics as Python floats with one host sync."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if tensors:
        got = torch.stack(
            [v.detach().to(torch.float64).reshape(()).cpu() for v in tensors.values()]
        )
        out.update(zip(tensors, got.tolist()))
    return {k: out[k] for k in values}


def _when_several(t: _Tokens, std: torch.Tensor) -> torch.Tensor:
    """verl reports a token std only over more than one counted token, else 0 (no sync)."""
    return torch.where(t.total() > 1, std, torch.zeros_like(std))


def _unbiased_std(values: torch.Tensor) -> torch.Tensor | float:
    return values.std() if values.numel() > 1 else 0.0


# ---------------------------------------------------------------------------- TRL
def trl_importance_ratio(
    logp: Any,
    behaviour_logp: Any,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
    mode: TrlIsMode = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (``GRPOConfig.vllm_importance_sampling_mode``).

    Parameters
    ----------
    logp, behaviour_logp:
        Per-token log-probs of the current policy (TRL's ``old_per_token_logps``) and of the
        sampler (``sampling_per_token_logps``): ``Ragged`` rows, or flat ``[N]`` tensors with
        ``offsets``. A NaN behaviour log-prob (a token vLLM could not score) gives a log-ratio
        of 0, as in TRL.
    offsets:
        int64 completion boundaries ``[B + 1]`` from 0, when the log-probs are flat tensors.
    mask:
        Flat ``[N]`` flags of the tokens that count (TRL's ``completion_mask * tool_mask``);
        an uncounted token has log-ratio 0.
    mode:
        ``token_truncate`` / ``token_mask``: per-token ratios ``r_t = exp(log π_t - log μ_t)``;
        ``sequence_truncate`` / ``sequence_mask``: one ratio per completion, ``exp(Σ_t ...)``.
        ``*_truncate`` clamps to ``[clip_min, clip_max]``; ``*_mask`` sets ratios outside it
        to 0.
    clip_max, clip_min:
        TRL's ``vllm_importance_sampling_clip_max`` (3.0; formerly ``..._cap``) and
        ``..._clip_min`` (None); ``None`` is no bound on that side.

    Returns
    -------
    torch.Tensor
        ``[N]`` per-token ratios for the token modes, ``[B]`` per-completion ratios for the
        sequence modes (TRL's ``(B, T)`` and ``(B, 1)``), in the working dtype. Not clamped
        before ``exp``, as in TRL (an overflow to ``inf`` is truncated or masked like any
        ratio above ``clip_max``).
    """
    where = "trl_importance_ratio"
    if mode not in TRL_IS_MODES:
        raise ComputeError(f"{where}: mode must be one of {list(TRL_IS_MODES)}, got {mode!r}")
    truncate = mode.endswith("_truncate")
    if truncate and clip_max is None and clip_min is None:
        raise ComputeError(f"{where}: mode {mode!r} needs clip_max or clip_min (both are None)")
    t = _tokens(logp, behaviour_logp, offsets, mask, where, need_token=False)
    diff = torch.nan_to_num(t.masked(t.cur - t.beh), nan=0.0)
    ratio = torch.exp(t.seg.sum(diff) if mode.startswith("sequence") else diff)
    if truncate:
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_importance_metrics(
    logp: Any,
    behaviour_logp: Any,
    ratio: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
) -> dict[str, float]:
    """What TRL logs for its IS correction on one process (``sampling/...`` keys).

    ``sampling_logp_difference/{mean,max}`` of ``|log π - log μ|`` over counted tokens whose
    behaviour log-prob is not NaN; ``importance_sampling_ratio/{min,mean,max}`` of ``ratio``
    (from :func:`trl_importance_ratio`) over counted tokens (token modes, ``[N]``) or over
    every completion (sequence modes, ``[B]``); 0 when there is nothing to reduce.
    """
    where = "trl_importance_metrics"
    t = _tokens(logp, behaviour_logp, offsets, mask, where, need_token=False)
    delta = (t.cur - t.beh).abs()
    keep = ~torch.isnan(delta)
    if t.mask is not None:
        keep &= t.mask
    delta = delta[keep]
    if ratio.shape == t.cur.shape:
        flat = ratio if t.mask is None else ratio[t.mask]
    elif ratio.shape == (len(t.seg),):
        flat = ratio
    else:
        raise ComputeError(
            f"{where}: ratio: expected {t.cur.shape[0]} (token) or {len(t.seg)} (sequence) "
            f"values, got shape {tuple(ratio.shape)}"
        )

    def reduce(x: torch.Tensor, op: str) -> torch.Tensor | float:
        return getattr(x.to(t.dtype), op)() if x.numel() else 0.0

    return _floats(
        {
            "sampling/sampling_logp_difference/mean": reduce(delta, "mean"),
            "sampling/sampling_logp_difference/max": reduce(delta, "max"),
            "sampling/importance_sampling_ratio/min": reduce(flat, "min"),
            "sampling/importance_sampling_ratio/mean": reduce(flat, "mean"),
            "sampling/importance_sampling_ratio/max": reduce(flat, "max"),
        }
    )


# ---------------------------------------------------------------------------- verl: IS
@dataclass(frozen=True)
class ImportanceWeights:
    """verl's rollout IS weights: ``weights`` ``[N]`` per token (0 on uncounted tokens;
    a sequence weight repeated over its tokens), and verl's ``rollout_is_*`` metrics."""

    weights: torch.Tensor
    metrics: dict[str, float]


def _is_threshold(spec: Any, where: str) -> tuple[float, float | None]:
    """``(upper, lower)``: a number or ``"upper"`` is TIS (``lower`` None), ``"lower_upper"``
    or ``(lower, upper)`` is IcePop (verl's ``_parse_rollout_is_threshold``)."""
    if isinstance(spec, bool):
        raise ComputeError(f"{where}: threshold: expected a number or 'lower_upper', got {spec!r}")
    lower: float | None
    try:
        if isinstance(spec, int | float):
            upper, lower = float(spec), None
        elif isinstance(spec, str) and "_" in spec:
            low_s, up_s = spec.strip().split("_", 1)
            upper, lower = float(up_s), float(low_s)
        elif isinstance(spec, str):
            upper, lower = float(spec), None
        elif isinstance(spec, Sequence) and len(spec) == 2:
            upper, lower = float(spec[1]), float(spec[0])
        else:
            raise ValueError
    except ValueError:
        raise ComputeError(
            f"{where}: threshold: expected a number, 'lower_upper' or (lower, upper), got {spec!r}"
        ) from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ComputeError(f"{where}: threshold: expected 0 < lower <= upper, got {spec!r}")
    return upper, lower


def rollout_is_weights(
    logp: Any,
    behaviour_logp: Any,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
    level: Literal["token", "sequence"] = "token",
    threshold: float | str | tuple[float, float] = 2.0,
    batch_normalize: bool = False,
) -> ImportanceWeights:
    """verl's ``rollout_is`` weights (``compute_rollout_correction_weights``), on offsets.

    Parameters
    ----------
    logp, behaviour_logp:
        Per-token log-probs of the training policy (verl's ``old_log_probs``, or the current
        ones) and of the rollout (``rollout_log_probs``); ``Ragged`` rows or flat ``[N]``
        tensors with ``offsets``.
    mask:
        Flat ``[N]`` flags of the tokens that count (verl's ``response_mask``).
    level:
        ``"token"``: ``w_t = exp(clamp(log r_t, ±20))``; ``"sequence"``:
        ``w_i = exp(clamp(Σ_t log r_t, ±20))`` on every token of completion i.
    threshold:
        A number ``U`` (or ``"U"``): TIS, ``min(w, U)``. ``"L_U"`` or ``(L, U)``: IcePop,
        ``w`` where ``L <= w <= U``, else 0.
    batch_normalize:
        Divide by the batch mean weight (tokens, or completions with a counted token at the
        sequence level) when it exceeds 1e-8, as verl does on one process.

    Returns
    -------
    ImportanceWeights
        Detached weights and verl's metrics (``rollout_is_mean``, ``_max``, ``_min``,
        ``_std``, ``_eff_sample_size``, ``_ratio_fraction_high/low``, ``_seq_*``,
        ``_oob_ratio`` with IcePop, ``_batch_norm_factor`` when normalising), before
        normalisation as in verl.
    """
    where = "rollout_is_weights"
    if level not in ("token", "sequence"):
        raise ComputeError(f"{where}: level must be 'token' or 'sequence', got {level!r}")
    upper, lower = _is_threshold(threshold, where)
    with torch.no_grad():
        t = _tokens(logp, behaviour_logp, offsets, mask, where)
        log_ratio = t.cur - t.beh
        bound = IS_SAFETY_BOUND
        counted = None if t.mask is None else t.mask.to(t.dtype)
        if level == "token":
            raw = torch.exp(log_ratio.clamp(-bound, bound))
            seq_log = None
        else:
            seq_log = t.row_sum(log_ratio)
            raw = t.expand(torch.exp(seq_log.clamp(-bound, bound)))
        if counted is not None:
            raw = raw * counted
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        metrics = _is_metrics(t, weights, raw, seq_log, upper, lower)
        if batch_normalize:
            if level == "token":
                mean = t.mean(weights)
            else:
                valid = t.valid_rows.to(t.dtype)
                mean = (t.row_mean(weights) * valid).sum() / valid.sum().clamp(min=1e-8)
            scale = float(mean)
            if scale > _NORMALIZE_FLOOR:
                weights = weights / mean
                metrics["rollout_is_batch_norm_factor"] = scale
            else:
                metrics["rollout_is_batch_norm_factor"] = 1.0
    return ImportanceWeights(weights, metrics)


def _is_metrics(
    t: _Tokens,
    weights: torch.Tensor,
    raw: torch.Tensor,
    seq_log: torch.Tensor | None,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (and the IcePop ``oob_ratio``)."""
    low = 1.0 / upper if lower is None else lower
    m: dict[str, torch.Tensor | float] = {}
    if seq_log is not None:
        # verl compares in log space against float32 logs of the thresholds.
        log_up = math.log(upper)
        log_low = math.log(low)
        m["rollout_is_max"] = torch.exp(seq_log.amax().clamp(max=IS_SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(seq_log.amin())
        m["rollout_is_mean"] = t.mean(weights)
        m["rollout_is_ratio_fraction_high"] = (seq_log > log_up).to(t.dtype).mean()
        m["rollout_is_ratio_fraction_low"] = (seq_log < log_low).to(t.dtype).mean()
    else:
        m["rollout_is_mean"] = t.mean(weights)
        m["rollout_is_ratio_fraction_high"] = t.mean((raw > upper).to(t.dtype))
        m["rollout_is_ratio_fraction_low"] = t.mean((raw < low).to(t.dtype))
        m["rollout_is_max"] = t.token_max(weights)
        m["rollout_is_min"] = t.token_min(weights)
    clipped = weights.clamp(min=0.0, max=upper)
    mean_c = t.mean(clipped)
    var = t.mean(clipped.square()) - mean_c.square()
    m["rollout_is_std"] = _when_several(t, var.clamp(min=0.0).sqrt())
    m["rollout_is_eff_sample_size"] = 1.0 / t.mean((clipped / (mean_c + _ESS_EPS)).square())
    seq_mean = t.row_mean(weights)
    m["rollout_is_seq_mean"] = seq_mean.mean()
    m["rollout_is_seq_std"] = _unbiased_std(seq_mean)
    m["rollout_is_seq_max"] = seq_mean.amax()
    m["rollout_is_seq_min"] = seq_mean.amin()
    m["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().amax()
    raw_seq_mean = t.row_mean(raw)
    m["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).to(t.dtype).mean()
    m["rollout_is_seq_fraction_low"] = (raw_seq_mean < low).to(t.dtype).mean()
    if lower is not None:
        m["rollout_is_oob_ratio"] = t.mean(((raw < lower) | (raw > upper)).to(t.dtype))
    return _floats(m)


# ---------------------------------------------------------------------------- verl: RS
@dataclass(frozen=True)
class RejectionMask:
    """verl's rollout rejection: ``keep`` ``[N]`` bool (the mask with rejected tokens and
    sequences removed; uncounted tokens stay False) and verl's ``rollout_rs_*`` metrics."""

    keep: torch.Tensor
    metrics: dict[str, float]


def _rs_options(modes: str | Sequence[str], where: str) -> list[str]:
    names = modes.split(",") if isinstance(modes, str) else list(modes)
    options: list[str] = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        if name not in RS_MODES:
            raise ComputeError(
                f"{where}: unknown rejection mode {name!r}; expected one of {list(RS_MODES)}"
            )
        if name not in options:
            options.append(name)
    if not options:
        raise ComputeError(f"{where}: expected at least one rejection mode, got {modes!r}")
    return options


def _rs_thresholds(options: list[str], spec: Any, where: str) -> list[tuple[float | None, float]]:
    """``(lower, upper)`` per option (verl's ``_parse_rollout_rs_thresholds``): one threshold
    for all options, or one each (a comma string or a sequence). k1 options take ``"L_U"`` or
    ``(L, U)`` ratio bounds, a lone ``U`` meaning ``(1/U, U)``; the others one upper bound."""
    if spec is None:
        raise ComputeError(f"{where}: thresholds are required")
    if isinstance(spec, str):
        parts: list[Any] = [p.strip() for p in spec.split(",") if p.strip()]
    elif isinstance(spec, int | float) and not isinstance(spec, bool):
        parts = [spec]
    elif isinstance(spec, Sequence):
        parts = list(spec)
    else:
        raise ComputeError(
            f"{where}: thresholds: expected a number, string or sequence, got {spec!r}"
        )
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ComputeError(
            f"{where}: thresholds: expected 1 or {len(options)} (one per mode), got {len(parts)}"
        )
    out: list[tuple[float | None, float]] = []
    for option, part in zip(options, parts):
        try:
            if isinstance(part, str) and "_" in part:
                lo_s, up_s = part.split("_", 1)
                pair: tuple[float | None, float] = (float(lo_s), float(up_s))
            elif isinstance(part, Sequence) and not isinstance(part, str):
                pair = (float(part[0]), float(part[1]))
            else:
                pair = (None, float(part))
        except (TypeError, ValueError, IndexError):
            raise ComputeError(
                f"{where}: threshold for {option!r}: not a number: {part!r}"
            ) from None
        lo, up = pair
        if option.endswith("k1"):
            lo = 1.0 / up if lo is None else lo
            if not (0 < lo <= up):
                raise ComputeError(
                    f"{where}: threshold for {option!r}: expected 0 < L <= U, got {part!r}"
                )
        elif lo is not None or not up > 0:
            raise ComputeError(
                f"{where}: threshold for {option!r}: expected one upper bound > 0, got {part!r}"
            )
        out.append((lo, up))
    return out


def rollout_rejection_mask(
    logp: Any,
    behaviour_logp: Any,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
    modes: str | Sequence[str] = "token_k1",
    thresholds: Any = None,
) -> RejectionMask:
    """verl's ``rollout_rs`` rejection (``compute_rollout_rejection_mask``), on offsets.

    With ``ℓ_t = clamp(log π_t - log μ_t, ±20)``, per token ``k1 = -ℓ``, ``k2 = ℓ²/2``,
    ``k3 = e^ℓ - 1 - ℓ``. ``token_kX`` rejects a token, ``seq_{sum,mean,max}_kX`` a whole
    completion, by the statistic reduced over its counted tokens. A k1 statistic is kept within
    ``[log L, log U]``; k2 and k3 are kept at ``<= U``. Several modes (a comma string or a
    sequence) must all pass.

    Returns
    -------
    RejectionMask
        ``keep`` ``[N]`` bool and verl's metrics: per mode ``rollout_rs_<mode>_{mean, max,
        min, std, fraction_high, fraction_low, seq_mean, seq_std, seq_max, seq_min,
        seq_max_deviation, seq_fraction_high, seq_fraction_low (k1), masked_fraction,
        seq_masked_fraction}``, and ``rollout_rs_masked_fraction``,
        ``rollout_rs_seq_masked_fraction`` of the combined mask.
    """
    where = "rollout_rejection_mask"
    options = _rs_options(modes, where)
    bounds = _rs_thresholds(options, thresholds, where)
    with torch.no_grad():
        t = _tokens(logp, behaviour_logp, offsets, mask, where)
        ell = (t.cur - t.beh).clamp(-IS_SAFETY_BOUND, IS_SAFETY_BOUND)
        token_stats = {"k1": -ell, "k2": 0.5 * ell.square(), "k3": torch.expm1(ell) - ell}
        counted = t.mask if t.mask is not None else torch.ones_like(ell, dtype=torch.bool)
        valid = t.valid_rows
        keep_all = counted.clone()
        metrics: dict[str, torch.Tensor | float] = {}
        for option, (lo, up) in zip(options, bounds):
            k1 = option.endswith("k1")
            up_t = math.log(up) if k1 else up
            lo_t = math.log(lo) if k1 and lo is not None else 0.0
            stat = token_stats[option[-2:]]
            if option.startswith("token"):
                per_row = None
                kept = (stat >= lo_t) & (stat <= up_t) if k1 else stat <= up_t
            else:
                reduce = option.split("_")[1]
                per_row = {"sum": t.row_sum, "mean": t.row_mean, "max": t.row_max}[reduce](stat)
                row_kept = (per_row >= lo_t) & (per_row <= up_t) if k1 else per_row <= up_t
                kept = t.expand(row_kept)
                stat = t.expand(per_row)
            keep_all &= kept
            metrics.update(_rs_metrics(t, option, stat, per_row, valid, up_t, lo_t, k1))
            rejected = counted & ~kept
            metrics[f"rollout_rs_{option}_masked_fraction"] = t.mean((~kept).to(t.dtype))
            row_rejected = t.seg.sum(rejected.to(t.dtype)) > 0
            validf = valid.to(t.dtype)
            metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
                row_rejected.to(t.dtype) * validf
            ).sum() / validf.sum()
        metrics["rollout_rs_masked_fraction"] = t.mean((~keep_all).to(t.dtype))
        any_rejected = t.seg.sum((counted & ~keep_all).to(t.dtype)) > 0
        metrics["rollout_rs_seq_masked_fraction"] = any_rejected.to(t.dtype).mean()
    return RejectionMask(keep_all, _floats(metrics))


def _rs_metrics(
    t: _Tokens,
    option: str,
    stat: torch.Tensor,
    per_row: torch.Tensor | None,
    valid: torch.Tensor,
    up_t: float,
    lo_t: float,
    k1: bool,
) -> dict[str, torch.Tensor | float]:
    """verl's ``compute_rs_metrics`` for one option (``stat`` per token, a sequence option's
    per-row value repeated over its tokens)."""
    p = f"rollout_rs_{option}"
    dt = t.dtype
    seq = (per_row if per_row is not None else t.row_mean(stat))[valid]
    m: dict[str, torch.Tensor | float] = {f"{p}_mean": t.mean(stat)}
    if per_row is not None:
        m[f"{p}_max"] = seq.amax()
        m[f"{p}_min"] = seq.amin()
        m[f"{p}_fraction_high"] = (seq > up_t).to(dt).mean()
        m[f"{p}_fraction_low"] = (seq < lo_t).to(dt).mean() if k1 else 0.0
    else:
        m[f"{p}_max"] = t.token_max(stat)
        m[f"{p}_min"] = t.token_min(stat)
        m[f"{p}_fraction_high"] = t.mean((stat > up_t).to(dt))
        m[f"{p}_fraction_low"] = t.mean((stat < lo_t).to(dt)) if k1 else 0.0
    clamped = stat.clamp(min=lo_t, max=up_t)
    mean_c = t.mean(clamped)
    var = t.mean(clamped.square()) - mean_c.square()
    m[f"{p}_std"] = _when_several(t, var.clamp(min=0.0).sqrt())
    m[f"{p}_seq_mean"] = seq.mean()
    m[f"{p}_seq_std"] = _unbiased_std(seq)
    m[f"{p}_seq_max"] = seq.amax()
    m[f"{p}_seq_min"] = seq.amin()
    m[f"{p}_seq_max_deviation"] = seq.abs().amax()
    m[f"{p}_seq_fraction_high"] = (seq > up_t).to(dt).mean()
    if k1:
        m[f"{p}_seq_fraction_low"] = (seq < lo_t).to(dt).mean()
    return m


# ---------------------------------------------------------------------------- verl: metrics
def offpolicy_metrics(
    logp: Any,
    behaviour_logp: Any,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
) -> dict[str, float]:
    """verl's off-policy diagnostics (``compute_offpolicy_metrics``), on offsets.

    With ``ℓ_t = log π_t - log μ_t`` over counted tokens, ``m̄_i`` a completion's mean log-prob
    (0 without counted tokens) and means over completions taken over all B of them:

    - ``kl`` = mean_t(-ℓ_t), an estimate of KL(μ‖π); ``k3_kl`` = mean_t(e^ℓ - 1 - ℓ) (ℓ clamped
      to ±60, :func:`~maxent_arrow.compute.k3`);
    - ``training_ppl`` = mean_i exp(-m̄_i^π), ``training_log_ppl`` = mean_i(-m̄_i^π), and the
      same for ``rollout_ppl``, ``rollout_log_ppl``;
    - ``log_ppl_diff`` = mean_i d_i with d_i = m̄_i^μ - m̄_i^π (``_abs_diff``, ``_max``,
      ``_min``), ``ppl_ratio`` = mean_i exp(d_i);
    - ``chi2_token`` = mean_t exp(2 clamp(ℓ_t, ±20)) - 1, ``chi2_seq`` =
      mean_i exp(2 clamp(Σ_t ℓ_t, ±20)) - 1.
    """
    where = "offpolicy_metrics"
    with torch.no_grad():
        t = _tokens(logp, behaviour_logp, offsets, mask, where)
        log_ratio = t.cur - t.beh
        mean_cur = t.row_mean(t.cur)
        mean_beh = t.row_mean(t.beh)
        diff = mean_beh - mean_cur
        bound = IS_SAFETY_BOUND
        m: dict[str, torch.Tensor | float] = {
            "training_ppl": torch.exp(-mean_cur).mean(),
            "training_log_ppl": (-mean_cur).mean(),
            "kl": t.mean(-log_ratio),
            "k3_kl": t.mean(k3(log_ratio)),
            "rollout_ppl": torch.exp(-mean_beh).mean(),
            "rollout_log_ppl": (-mean_beh).mean(),
            "log_ppl_diff": diff.mean(),
            "log_ppl_abs_diff": diff.abs().mean(),
            "log_ppl_diff_max": diff.amax(),
            "log_ppl_diff_min": diff.amin(),
            "ppl_ratio": torch.exp(diff).mean(),
            "chi2_token": t.mean(torch.exp(2.0 * log_ratio.clamp(-bound, bound))) - 1.0,
            "chi2_seq": torch.exp(2.0 * t.row_sum(log_ratio).clamp(-bound, bound)).mean() - 1.0,
        }
    return _floats(m)


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's whole rollout correction of one batch: IS ``weights`` ``[N]`` (None without
    ``level``), the ``keep`` mask ``[N]`` after rejection, and every metric under verl's
    ``rollout_corr/`` prefix."""

    weights: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, float]


def rollout_correction(
    logp: Any,
    behaviour_logp: Any,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
    level: Literal["token", "sequence"] | None = None,
    threshold: float | str | tuple[float, float] = 2.0,
    batch_normalize: bool = False,
    rs_modes: str | Sequence[str] | None = None,
    rs_thresholds: Any = None,
) -> RolloutCorrection:
    """:func:`rollout_is_weights` (when ``level`` is set), :func:`rollout_rejection_mask`
    (when ``rs_modes`` is) and :func:`offpolicy_metrics`, as verl's
    ``compute_rollout_correction_and_rejection_mask`` composes them (verl's
    ``rollout_is``, ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
    ``rollout_rs_threshold``)."""
    where = "rollout_correction"
    t = _tokens(logp, behaviour_logp, offsets, mask, where)
    cur = Ragged(t.cur, t.seg.offsets, validate=False)
    beh = Ragged(t.beh, t.seg.offsets, validate=False)
    flags = None if t.mask is None else t.mask
    metrics: dict[str, float] = {}
    weights = None
    if level is not None:
        w = rollout_is_weights(
            cur, beh, mask=flags, level=level, threshold=threshold, batch_normalize=batch_normalize
        )
        weights = w.weights
        metrics.update(w.metrics)
    if rs_modes is not None:
        r = rollout_rejection_mask(cur, beh, mask=flags, modes=rs_modes, thresholds=rs_thresholds)
        keep = r.keep
        metrics.update(r.metrics)
    else:
        keep = flags.clone() if flags is not None else torch.ones_like(t.cur, dtype=torch.bool)
    metrics.update(offpolicy_metrics(cur, beh, mask=flags))
    return RolloutCorrection(weights, keep, {f"rollout_corr/{k}": v for k, v in metrics.items()})


# ---------------------------------------------------------------------------- kept sets
def _segment_logsumexp(values: torch.Tensor, seg: Segments) -> torch.Tensor:
    """``log Σ exp`` of each segment ``[P]`` (``-inf`` for an empty one), stable."""
    top = seg.max(values)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = seg.sum(torch.exp(values - seg.expand(safe)))
    return torch.log(total) + safe


def kept_set_log_mass(
    policy_logp: torch.Tensor,
    kept_ids: Any,
    *,
    set_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log S_t = log Σ_{v ∈ S_t} π_t(v)``: each token's policy mass of its kept set.

    Parameters
    ----------
    policy_logp:
        ``[T, V]`` log-probs of the policy over the vocabulary at each of ``T`` tokens (at
        the sampling temperature: ``log_softmax(logits / temperature)``); or, with the
        kept ids given as the log-probs themselves, the ``[M]`` flat policy log-probs of the
        kept ids (``kept_ids=None``), e.g. a stored top-k covering the set.
    kept_ids:
        Each token's kept ids: a ``Ragged`` with one row per token, or a flat ``[M]`` id
        tensor with ``set_offsets`` (``[T + 1]``, int64 from 0); ``None`` when
        ``policy_logp`` is already the flat ``[M]`` kept log-probs (``set_offsets`` then
        required).

    Returns
    -------
    torch.Tensor
        ``[T]`` ``log S_t`` (≤ 0; ``-inf`` for an empty set), in the working dtype. One
        gather and one segment log-sum-exp: no loop over tokens, CPU or GPU.
    """
    where = "kept_set_log_mass"
    if kept_ids is None:
        if set_offsets is None or policy_logp.dim() != 1:
            raise ComputeError(
                f"{where}: flat kept log-probs need set_offsets= (one set per token)"
            )
        values, offsets = policy_logp, set_offsets
    else:
        ids, offsets = _rows(kept_ids, set_offsets, f"{where}: kept_ids")
        if policy_logp.dim() != 2:
            raise ComputeError(
                f"{where}: policy_logp: expected [T, V] log-probs over the vocabulary, got "
                f"shape {tuple(policy_logp.shape)}"
            )
        seg_ids = Segments.cached(
            offsets, num_values=int(ids.shape[0]), device=policy_logp.device,
            where=f"{where}: set_offsets", allow_empty=True,
        )  # fmt: skip
        if len(seg_ids) != policy_logp.shape[0]:
            raise ComputeError(
                f"{where}: expected one kept set per token ({policy_logp.shape[0]}), got "
                f"{len(seg_ids)}"
            )
        ids = ids.to(policy_logp.device, torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= policy_logp.shape[1]):
            raise ComputeError(
                f"{where}: kept_ids: an id outside the vocabulary [0, {policy_logp.shape[1]})"
            )
        values = policy_logp[seg_ids.row_ids, ids]
    if not values.is_floating_point():
        raise ComputeError(f"{where}: expected floating log-probs, got {values.dtype}")
    seg = Segments.cached(
        offsets, num_values=int(values.shape[0]), device=values.device,
        where=f"{where}: set_offsets", allow_empty=True,
    )  # fmt: skip
    return _segment_logsumexp(values.to(work_dtype(values.dtype)), seg)


def kept_set_ratio(
    logp: Any,
    behaviour_logp: Any,
    log_mass: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    mask: Any = None,
    level: Literal["token", "sequence"] = "token",
    behaviour_log_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """The importance ratio against the policy renormalised over the kept sets.

    ``r_t = exp((log π_t(y_t) - log S_t) - log μ_t(y_t))`` per token, or its product over a
    completion's counted tokens (``level="sequence"``). The sampler drew ``y_t`` from μ
    restricted to ``S_t`` and renormalised (``processed`` log-probs); against the full π the
    ratio's mean under μ is ``E[S]`` (about 0.9 at ``top_p=0.8``, trl#7269), against π
    renormalised over the same set it is 1.

    Parameters
    ----------
    logp, behaviour_logp, offsets, mask:
        As :func:`trl_importance_ratio`: the policy's and the sampler's per-token log-probs of
        the sampled tokens (``Ragged`` rows, or flat ``[N]`` with ``offsets``) and the counted
        tokens (an uncounted token has log-ratio 0).
    log_mass:
        ``[N]`` ``log S_t`` of the policy (:func:`kept_set_log_mass`).
    behaviour_log_mass:
        When the behaviour log-probs are ``raw`` (the sampler's full distribution, not the
        renormalised one), its own ``log S_t`` over the same sets: ``log μ`` becomes
        ``log μ - log S^μ``.
    """
    where = "kept_set_ratio"
    t = _tokens(logp, behaviour_logp, offsets, mask, where, need_token=False)
    if log_mass.shape != t.cur.shape:
        raise ComputeError(
            f"{where}: log_mass: expected {t.cur.shape[0]} values (one per token), got "
            f"{tuple(log_mass.shape)}"
        )
    beh = t.beh
    if behaviour_log_mass is not None:
        if behaviour_log_mass.shape != t.cur.shape:
            raise ComputeError(
                f"{where}: behaviour_log_mass: expected {t.cur.shape[0]} values, got "
                f"{tuple(behaviour_log_mass.shape)}"
            )
        beh = beh - behaviour_log_mass.to(beh.device, t.dtype)
    diff = t.masked(t.cur - log_mass.to(t.cur.device, t.dtype) - beh)
    if level == "sequence":
        return torch.exp(t.seg.sum(diff))
    if level != "token":
        raise ComputeError(f"{where}: level must be 'token' or 'sequence', got {level!r}")
    return torch.exp(diff)


@dataclass(frozen=True)
class KeptMass:
    """The kept-mass audit of a batch (:func:`kept_mass_audit`): ``mean_log`` = E[log S]
    over counted tokens, ``mean`` = E[S] (the mean of the unrenormalised on-policy ratio),
    ``min`` = the least S, ``seq_mean_log`` = the mean over completions of Σ_t log S_t (the
    log of the sequence ratio's bias factor), ``tokens`` counted."""

    mean_log: float
    mean: float
    min: float
    seq_mean_log: float
    tokens: int

    def metrics(self, prefix: str = "kept_mass/") -> dict[str, float]:
        return {
            f"{prefix}mean_log": self.mean_log,
            f"{prefix}mean": self.mean,
            f"{prefix}min": self.min,
            f"{prefix}seq_mean_log": self.seq_mean_log,
        }


def kept_mass_audit(
    log_mass: Any, *, offsets: torch.Tensor | None = None, mask: Any = None
) -> KeptMass:
    """``E[log S]`` and friends of per-token ``log S_t`` (:func:`kept_set_log_mass`), rows as
    ``Ragged`` or flat ``[N]`` with completion ``offsets``; ``mask`` the counted tokens."""
    where = "kept_mass_audit"
    t = _tokens(log_mass, log_mass, offsets, mask, where)
    values = t.cur
    got = _floats(
        {
            "mean_log": t.mean(values),
            "mean": t.mean(torch.exp(values)),
            "min": torch.exp(t.token_min(values)),
            "seq_mean_log": t.row_sum(values).mean(),
            "tokens": t.total(),
        }
    )
    return KeptMass(got["mean_log"], got["mean"], got["min"], got["seq_mean_log"],
                    int(got["tokens"]))  # fmt: skip
