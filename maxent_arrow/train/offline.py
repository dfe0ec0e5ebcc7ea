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
from maxent_arrow.store import ReplaySampler, RolloutStore, SampledBatch
from maxent_arrow.train.scoring import ScoringOptions, sequence_scores
from maxent_arrow.train.trainer import MaxEntTrainer

__all__ = ["ReplayedStep", "StoreStep", "recompute_errors", "replay_losses", "train_from_store"]


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
                options=ScoringOptions(temperature=cfg.gen_temperature),
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


@dataclass(frozen=True)
class StoreStep:
    """One update of a trainer fed from the store: the loss it optimised, the loss the run
    logged for the same groups (when the batch is one whole stored step, else NaN), and what
    the sampler gave and dropped."""

    step: int
    loss: float
    logged_loss: float
    stored_steps: tuple[int, ...]
    num_groups: int
    num_samples: int
    staleness: float  # mean of current version minus the groups' versions
    dropped: dict[str, int]

    @property
    def loss_error(self) -> float:
        """Relative difference of the optimised loss to the logged one (NaN: none logged)."""
        return abs(self.loss - self.logged_loss) / max(abs(self.logged_loss), 1e-12)


def train_from_store(
    trainer: MaxEntTrainer,
    sampler: ReplaySampler,
    *,
    steps: int | None = None,
    start: int = 0,
    load_policy: Callable[[Any, int], None] | None = None,
    on_step: Callable[[StoreStep], None] | None = None,
    on_batch: Callable[[int, SampledBatch], None] | None = None,
) -> list[StoreStep]:
    """Train ``trainer`` offline on the batches of ``sampler`` (``maxent-arrow train
    --from-store``): one :meth:`~MaxEntTrainer.step_from_store` per batch, trainer steps
    ``start, start + 1, ...``, each batch asked for at policy version = the trainer step (the
    sampler's staleness window counts from it), until ``steps`` updates or the sampler ends.

    ``load_policy(model, stored_step)``: before each update, load into the policy the weights
    that produced the batch's stored step (the run's snapshots): the exact replay of the run,
    where each update's loss is the loss the run logged (staleness 0, whole-step batches).
    ``on_batch(step, batch)``: each batch the sampler gave, before the update at trainer step
    ``step`` (also one whose groups were all dropped): to record what was consumed where the
    caller keeps it (a sampler with ``record=False`` writes nothing into the sampled store).
    """
    done: list[StoreStep] = []
    step = start
    while steps is None or step < start + steps:
        sampled = sampler.sample(current_version=step, step=step)
        if sampled is None:
            break
        if on_batch is not None:
            on_batch(step, sampled)
        if sampled.num_groups == 0:  # every group of this draw was dropped
            continue
        stored = sampled.stored_steps
        if load_policy is not None:
            if len(stored) != 1:
                raise StoreError(
                    "train_from_store: load_policy needs whole-step batches (batch_groups=None)"
                )
            load_policy(trainer.policy, stored[0])
        loss, _ = trainer.step_from_store(step, sampled)
        logged = math.nan
        scalars = sampled.rollout_batch().loss_scalars
        whole = len(stored) == 1 and sampled.num_groups == _stored_groups(sampler, stored[0])
        if whole and scalars is not None:
            logged = float(scalars.total_loss)
        record = StoreStep(
            step=step,
            loss=float(loss.loss.detach()),
            logged_loss=logged,
            stored_steps=stored,
            num_groups=sampled.num_groups,
            num_samples=sampled.num_samples,
            staleness=sampled.staleness(step),
            dropped=dict(sampled.dropped),
        )
        done.append(record)
        if on_step is not None:
            on_step(record)
        step += 1
    return done


def _stored_groups(sampler: ReplaySampler, step: int) -> int:
    return int((sampler.index.step == step).sum())
