"""Offline replay of a run: re-score saved steps and recompute their losses.

A saved step holds everything a loss needs except the policy forward pass (``docs/formulas.md``
§4.2): the exact prompt and completion token ids, the reference log-probs, q, the weights, the
behaviour log-probs and the config. ``replay_losses`` streams the steps back from the store,
recomputes advantages, q and weights from the stored utilities, reference sums and config
(:func:`maxent_arrow.rollout.recompute`; they must equal the stored columns), re-scores the
stored tokens with the policy snapshot of that step, recomputes the loss, and reports it beside
the logged one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from maxent_arrow.compute import ClipSettings, evaluate_losses
from maxent_arrow.errors import StoreError
from maxent_arrow.ingest import build_score_batch
from maxent_arrow.rollout import RolloutBatch, RunConfig, recompute
from maxent_arrow.store import RolloutStore
from maxent_arrow.train.scoring import sequence_scores

__all__ = ["ReplayedStep", "replay_losses", "recompute_errors"]


@dataclass(frozen=True)
class ReplayedStep:
    """One step's logged and recomputed figures."""

    step: int
    logged_loss: float
    replayed_loss: float
    recompute_errors: dict[str, float]
    num_samples: int

    @property
    def max_weight_error(self) -> float:
        """Largest difference of the recomputed advantages, q or weights to the stored ones."""
        return max(self.recompute_errors.values(), default=0.0)

    @property
    def loss_error(self) -> float:
        """Relative difference of the recomputed loss to the logged one."""
        return abs(self.replayed_loss - self.logged_loss) / max(abs(self.logged_loss), 1e-12)


def recompute_errors(batch: RolloutBatch) -> dict[str, float]:
    """Largest absolute difference between each stored derived column (advantages, q, weights)
    and its recomputation from the step's stored facts and config."""
    errors = {}
    for name, ragged in recompute(batch).items():
        stored = batch.ragged(name)
        if stored is None:
            raise StoreError(f"step {batch.step}: no stored {name!r} to compare with")
        diff = (ragged.values - stored.values.to(torch.float64)).abs()
        errors[name] = float(diff.max()) if diff.numel() else 0.0
    return errors


def _clip(cfg: RunConfig) -> ClipSettings | None:
    if not cfg.use_clip_objective:
        return None
    return ClipSettings(
        eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high, coef=cfg.clip_objective_coef
    )


def replay_losses(
    store: RolloutStore,
    load_policy: Callable[[int], Any],
    *,
    steps: list[int] | None = None,
) -> Iterator[ReplayedStep]:
    """Yield, per saved training step, the logged loss and the loss recomputed offline.

    Parameters
    ----------
    store:
        The run's store.
    load_policy:
        ``load_policy(step)`` returns the policy model with the weights it had when that step's
        loss was computed (the trainer saves them as snapshots).
    steps:
        Which steps (default: every training step).
    """
    for batch in store.replay(steps=steps, kind="train"):
        cfg = batch.run_config
        stored = batch.ragged("weights")
        errors = recompute_errors(batch)
        model = load_policy(batch.step)
        score_batch = build_score_batch(
            batch,
            pad_token_id=cfg.pad_token_id,
            max_prompt_len=cfg.max_prompt_len,
            slice_size=0,
            eos_token_id=cfg.eos_token_id,
            max_completion_len=cfg.max_completion_len,
        )
        reference = batch.reference_logprobs
        assert reference is not None  # sequence_scores reads it (a step stores its reference)
        with torch.no_grad():
            scores = sequence_scores(
                model,
                score_batch,
                reference,
                behavior_token_logp=batch.ragged("behavior_token_logp"),
                temperature=cfg.gen_temperature,
            )
            loss, _ = evaluate_losses(
                scores,
                reference,
                stored,
                mode=cfg.mode,
                beta=cfg.beta,
                clip=_clip(cfg),
                max_completion_len=cfg.max_completion_len,
                len_norm_ref=cfg.len_norm_ref,
            )
        logged = batch.loss_scalars
        yield ReplayedStep(
            step=batch.step,
            logged_loss=math.nan if logged is None else logged.total_loss,
            replayed_loss=float(loss.loss),
            recompute_errors=errors,
            num_samples=batch.num_samples,
        )
