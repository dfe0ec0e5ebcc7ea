"""``recompute``: advantages, q and MaxEnt weights of a stored step, from its stored facts.

The one recomputation of the group math (``docs/formulas.md`` §3.2-3.6): from the stored
utilities (after any entropy bonus), the stored SEED-GRPO group scales, the stored reference
sums and token counts, and the step's :class:`~maxent_arrow.rollout.RunConfig`. The trainer
computes the reference term the same way (raw sums and counts in float64), so a replayed step
reproduces its weights bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maxent_arrow import compute as C
from maxent_arrow.errors import ComputeError, SchemaError
from maxent_arrow.rollout.config import RunConfig

if TYPE_CHECKING:
    from maxent_arrow.rollout.batch import RolloutBatch

__all__ = ["recompute"]


def recompute(
    batch: RolloutBatch, config: RunConfig | None = None, **overrides: Any
) -> dict[str, Any]:
    """Advantages, q and MaxEnt weights of ``batch`` from its stored facts.

    Parameters
    ----------
    batch:
        A stored step (or part of one: whole groups).
    config:
        The settings to recompute with; default the step's own snapshot (``batch.run_config``).
    **overrides:
        :class:`RunConfig` fields to change, e.g. ``tau=0.1`` (what a colder τ would have
        given). An unknown name is refused.

    Returns
    -------
    dict
        :class:`~maxent_arrow.arrow.Ragged` values keyed ``"advantages"``, ``"q"`` and, when
        ``tau`` and the reference columns are known, ``"weights"``, grouped like the batch.
    """
    import torch  # deferred: this package is importable without torch

    try:
        cfg = (config or batch.run_config).replace(**overrides)
    except SchemaError as exc:
        raise ComputeError(f"recompute: {exc}") from None
    utils = batch.ragged("total_utils")
    if utils is None:
        raise ComputeError(f"recompute: step {batch.step} has no total_utils column")
    utils = utils.with_values(utils.values.to(torch.float64))
    if cfg.scale_rewards == "batch":
        raise ComputeError("recompute: scale_rewards='batch' is not supported by the group math")
    adv = C.group_advantages(
        utils, scale_rewards=cfg.scale_rewards == "group", eps=cfg.advantage_eps
    )
    scales = batch.column("seed_advantage_scale")
    if scales is not None and scales.null_count == 0:
        adv = C.apply_group_scales(adv, torch.from_numpy(scales.to_numpy(zero_copy_only=False)))
    q = C.q_distribution(utils, temperature=cfg.q_temperature, epsilon=cfg.q_epsilon)
    out: dict[str, Any] = {"advantages": adv, "q": q}
    raw, counts = batch.ragged("ref_logp_sum_raw"), batch.ragged("ref_tok_counts")
    if cfg.tau is not None and raw is not None and counts is not None:
        t = counts.values.to(torch.float64)
        # ρ = R / max(T, 1) (the seed's `ref_logp_sum`) or the raw sum R.
        rho = raw.values / t.clamp(min=1) if cfg.len_norm_ref else raw.values
        out["weights"] = C.maxent_weights(
            q,
            rho,
            tau=cfg.tau,
            beta=cfg.beta,
            denominator=cfg.weight_denominator,
            token_counts=t,
            length_reweight=cfg.length_reweight,
        )
    return out
