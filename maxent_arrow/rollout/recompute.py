"""``recompute``: advantages, q and MaxEnt weights of a stored step, from its stored facts.

The one recomputation of the group math (``docs/formulas.md`` §3.2-3.6): from the stored
utilities (after any entropy bonus), the stored SEED-GRPO group scales, the stored reference
sums and token counts, and the step's :class:`~maxent_arrow.rollout.RunConfig`. The trainer
computes the reference term the same way (raw sums and counts in float64), so a replayed step
reproduces its weights bit for bit.

A step recorded from TRL (:mod:`maxent_arrow.integrations.trl`) carries TRL's conventions in
its config (``scale_rewards`` "group" / "batch" / "none", ``reward_weights``,
``multi_objective_aggregation``, ``unscorable="exclude"``): :func:`recompute` reproduces TRL's
advantages from it, given the whole step (every rank's groups, reassembled by
:func:`~maxent_arrow.rollout.reassemble`: TRL normalises over groups that span ranks, and
``"batch"`` over the whole generation batch). :func:`recompute_kl` gives the k3 KL of the
stored behaviour and reference log-probs.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow import arrow as A
from maxent_arrow import compute as C
from maxent_arrow.errors import ComputeError, SchemaError
from maxent_arrow.rollout.batch import RolloutBatch
from maxent_arrow.rollout.checks import rewards_by_name
from maxent_arrow.rollout.config import RunConfig

if TYPE_CHECKING:
    import torch

    from maxent_arrow.arrow import Ragged

__all__ = ["recompute", "recompute_kl"]


def recompute(
    batch: RolloutBatch | pa.Table | pa.RecordBatch,
    config: RunConfig | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Advantages, q and MaxEnt weights of ``batch`` from its stored facts.

    Parameters
    ----------
    batch:
        A stored step (or part of one: whole groups), or a group table such as
        ``reassemble(store.read(steps=[s]))`` (every rank of a step, parts of a group merged),
        which then needs ``config``.
    config:
        The settings to recompute with; default the step's own snapshot (``batch.run_config``).
    **overrides:
        :class:`RunConfig` fields to change, e.g. ``tau=0.1`` (what a colder τ would have
        given) or ``scale_rewards="batch"``. An unknown name is refused.

    Returns
    -------
    dict
        :class:`~maxent_arrow.arrow.Ragged` values keyed ``"advantages"``, ``"q"`` (omitted
        when a utility is missing: NaN, a completion no reward function scored) and, when
        ``tau`` and the reference columns are known, ``"weights"``, grouped like the batch.

    Notes
    -----
    The utilities are the stored ``total_utils`` (after any entropy bonus), except that they
    are rebuilt from the raw ``reward_values`` weighted by ``reward_weights`` (by name; 1 for
    a name without a weight, TRL's default) when the config says
    ``multi_objective_aggregation="normalize_then_sum"`` (each function is normalised per
    group before the sum), when ``reward_weights`` is among the overrides, or when the step
    has no ``total_utils``. ``unscorable="exclude"`` (TRL) leaves a completion with no reward
    value at all out of its group's mean and std and gives it advantage 0; ``"zero"`` (ours)
    counts its utility as 0.
    """
    batch = _as_batch(batch, config)
    try:
        cfg = (config or batch.run_config).replace(**overrides)
    except SchemaError as exc:
        raise ComputeError(f"recompute: {exc}") from None
    rounds = _rounds(batch)
    if len(rounds) > 1:
        # Several generation rounds in one step: each is normalised on its own (TRL's batch
        # of a round is what `scale_rewards="batch"` and normalize_then_sum see).
        parts = [(rows, _recompute(_take_rows(batch, rows), cfg, overrides)) for rows in rounds]
        return _in_row_order(batch, parts)
    return _recompute(batch, cfg, overrides)


def _recompute(batch: RolloutBatch, cfg: RunConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """:func:`recompute` of one generation round."""
    import torch  # deferred: this package is importable without torch

    offsets = torch.from_numpy(batch.group_offsets.astype(np.int64))
    utils = batch.ragged("total_utils")
    from_rewards = (
        cfg.multi_objective_aggregation == "normalize_then_sum"
        or "reward_weights" in overrides
        or utils is None
    )
    if from_rewards:
        rewards, weights = _raw_rewards(batch, cfg)
        if cfg.unscorable == "exclude" or cfg.multi_objective_aggregation != "sum_then_normalize":
            adv = C.multi_objective_advantages(
                rewards,
                weights,
                offsets=offsets,
                aggregation=cfg.multi_objective_aggregation,
                scale_rewards=cfg.scale_rewards,
                eps=cfg.advantage_eps,
            )
            utils = _weighted_sum(rewards, weights, offsets, exclude=True)
        else:
            utils = C.total_utils(rewards, weights, offsets=offsets)
            adv = C.group_advantages(utils, scale_rewards=cfg.scale_rewards, eps=cfg.advantage_eps)
    else:
        assert utils is not None  # from_rewards otherwise
        utils = utils.with_values(utils.values.to(torch.float64))
        adv = C.group_advantages(
            utils,
            scale_rewards=cfg.scale_rewards,
            eps=cfg.advantage_eps,
            missing="exclude" if cfg.unscorable == "exclude" else "raise",
        )
    scales = batch.column("seed_advantage_scale")
    if scales is not None and scales.null_count == 0:
        adv = C.apply_group_scales(adv, torch.from_numpy(scales.to_numpy(zero_copy_only=False)))
    out: dict[str, Any] = {"advantages": adv}
    if bool(torch.isnan(utils.values).any()):
        return out  # q over a group with a missing utility is undefined
    q = C.q_distribution(utils, temperature=cfg.q_temperature, epsilon=cfg.q_epsilon)
    out["q"] = q
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


def _rounds(batch: RolloutBatch) -> list[np.ndarray]:
    """The group rows of each generation round of ``batch`` (by its ``round`` column; one
    round when it has none), rounds in ascending order."""
    column = batch.column("round")
    if column is None:
        return [np.arange(batch.num_groups)]
    values = np.asarray(pc.fill_null(column, 0).to_numpy(zero_copy_only=False))
    return [np.flatnonzero(values == r) for r in np.unique(values)]


def _take_rows(batch: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
    """The batch of group rows ``rows`` (whole groups), with the batch's step row."""
    return RolloutBatch(batch.groups.take(pa.array(rows)), batch.step_row, validate=False)


def _in_row_order(
    batch: RolloutBatch, parts: list[tuple[np.ndarray, dict[str, Any]]]
) -> dict[str, Any]:
    """Per-round results put back in the batch's group-row order (a key only some rounds
    have, such as ``q``, is kept only when every round has it)."""
    import torch  # deferred: this package is importable without torch

    offsets = batch.group_offsets.astype(np.int64)
    sizes = np.diff(offsets)
    rows = np.concatenate([r for r, _ in parts])
    # Position of each original completion in the rounds' concatenated values.
    part_sizes = sizes[rows]
    part_starts = np.concatenate([[0], np.cumsum(part_sizes)[:-1]])
    start_of_row = np.empty(len(rows), np.int64)
    start_of_row[rows] = part_starts
    owner = np.repeat(np.arange(len(sizes)), sizes)
    within = np.arange(int(offsets[-1])) - offsets[:-1][owner]
    take = torch.from_numpy(start_of_row[owner] + within)
    keys = set.intersection(*(set(out) for _, out in parts))
    merged: dict[str, Any] = {}
    for key in [k for k in parts[0][1] if k in keys]:
        values = torch.cat([out[key].values for _, out in parts])
        merged[key] = A.Ragged(values[take], torch.from_numpy(offsets), validate=False)
    return merged


def recompute_kl(batch: RolloutBatch | pa.Table | pa.RecordBatch) -> Ragged:
    """The k3 KL per token, ``e^δ - δ - 1`` with ``δ = ref_token_logp - behavior_token_logp``
    (float64), one row per completion.

    This is TRL's ``per_token_kl`` at the first optimisation pass over a generation round
    (there the policy's log-probs are the stored old ones, and the importance ratio that
    ``use_bias_correction_kl`` multiplies by is 1).
    """
    import torch  # deferred: this package is importable without torch

    batch = _as_batch(batch, RunConfig())
    ref, behavior = batch.ragged("ref_token_logp"), batch.ragged("behavior_token_logp")
    if ref is None or behavior is None:
        missing = "ref_token_logp" if ref is None else "behavior_token_logp"
        raise ComputeError(f"recompute_kl: the step has no {missing!r} column")
    if not torch.equal(ref.offsets, behavior.offsets):
        raise ComputeError(
            "recompute_kl: ref_token_logp and behavior_token_logp have different token counts"
        )
    delta = ref.values.to(torch.float64) - behavior.values.to(torch.float64)
    return A.Ragged(C.k3(delta), ref.offsets, validate=False)


def _as_batch(batch: Any, config: RunConfig | None) -> RolloutBatch:
    """A group table (e.g. reassembled from every rank of a step) as an unchecked batch."""
    if isinstance(batch, RolloutBatch):
        return batch
    if not isinstance(batch, pa.Table | pa.RecordBatch):
        raise SchemaError(
            f"recompute: expected a RolloutBatch or a group table, got {type(batch).__name__}"
        )
    if config is None:
        raise ComputeError("recompute: a group table has no step row; pass its config")
    first = {n: batch.column(n)[0].as_py() if batch.num_rows else 0 for n in ("step", "rank")}
    row = pa.RecordBatch.from_pydict(
        {
            "step": pa.array([first["step"]], pa.int64()),
            "rank": pa.array([first["rank"]], pa.int32()),
            "config": [json.dumps(config.to_dict(), allow_nan=True)],
        }
    )
    return RolloutBatch(batch, row, validate=False)


def _raw_rewards(batch: RolloutBatch, cfg: RunConfig) -> tuple[dict[str, Any], list[float]]:
    """The stored raw rewards (float64, by name) and the weight of each."""
    import torch  # deferred: this package is importable without torch

    raw = rewards_by_name(batch.groups)
    if not raw:
        raise ComputeError(
            f"recompute: step {batch.step} has neither total_utils nor reward_values"
        )
    weights = cfg.weights_by_name
    unknown = [n for n in weights if n not in raw]
    if unknown:
        raise ComputeError(
            f"recompute: reward_weights name {unknown[0]!r}, which step {batch.step} has no "
            f"rewards for (it has {sorted(raw)})"
        )
    columns = {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in raw.items()}
    return columns, [weights.get(name, 1.0) for name in columns]


def _weighted_sum(
    rewards: dict[str, Any], weights: list[float], offsets: torch.Tensor, *, exclude: bool
) -> Ragged:
    """``nansum_j(λ_j r_ij)``, NaN where every reward is missing when ``exclude``."""
    import torch  # deferred: this package is importable without torch

    utils = C.total_utils(rewards, weights, offsets=offsets)
    if exclude:
        stacked = torch.stack(list(rewards.values()))
        utils.values.masked_fill_(torch.isnan(stacked).all(dim=0), float("nan"))
    return utils
