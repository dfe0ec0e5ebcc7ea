"""A small, complete MaxEnt-GRPO training loop through the rollout store (what the demo runs).

One step (``docs/formulas.md`` §4.1): sample K completions per prompt with ``model.generate``;
score them with the reward functions (:func:`~maxent_arrow.compute.compute_rewards`: utilities,
advantages, q); build the ``ScoreBatch`` from the exact generated token ids; reference log-probs
from a frozen copy of the initial model; MaxEnt weights from q and the reference; policy scores
with gradients (and the policy's entropy summed over each completion's tokens, stored as
``policy_entropy_sum``); the MaxEnt loss and diagnostics; one optimizer step through
``accelerate``; and ``RolloutStore.append`` of everything, with the config snapshot that makes
it replayable, and the step's ``trainer_metrics`` record (loss, KL, grad norm, learning rate).

Before each update the policy weights are saved (safetensors, no pickle) as the step's snapshot,
so an offline replay can re-score the stored tokens with exactly the weights that produced the
logged loss (:mod:`maxent_arrow.train.offline`).

A trainer is an attempt of the run (:mod:`maxent_arrow.store.history.attempts`), begun in the store
when it is built, before any step: ``resume_from=s`` resumes the run at step ``s`` (the stored
steps from ``s`` on, of earlier attempts, are superseded: the resumed run writes them again),
and a fresh trainer on a store that holds an earlier run's steps is refused unless
``if_exists`` says ``"new_attempt"`` or ``"resume"``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack, cast

import torch

from maxent_arrow.arrow import Ragged
from maxent_arrow.arrow import registry as R
from maxent_arrow.compute import (
    ClipSettings,
    compute_rewards,
    evaluate_losses,
    length_stats,
    maxent_weights,
)
from maxent_arrow.errors import StoreError
from maxent_arrow.ingest import build_score_batch, tokenizer_identity
from maxent_arrow.rollout import METRICS_KEY, RolloutBatch, RunConfig, trainer_metrics_table
from maxent_arrow.store import RolloutStore, SampledBatch
from maxent_arrow.store.history.attempts import IfExists
from maxent_arrow.train.generation import Rollouts, SamplingOptions, sample_groups
from maxent_arrow.train.scoring import ScoringOptions, reference_logprobs, sequence_scores
from maxent_arrow.train.snapshots import snapshot_path
from maxent_arrow.types import (
    BatchDiagnostics,
    GenerationBatch,
    LossOutputs,
    ReferenceLogprobs,
    RewardComputation,
    SequenceScores,
)

__all__ = ["MaxEntTrainer", "TrainerOptions"]


class TrainerOptions(TypedDict, total=False):
    """The optional keywords of :class:`MaxEntTrainer` (each ``None`` when not given; its
    docstring says what each does)."""

    accelerator: Any
    run_dir: Path | None
    resume_from: int | None
    if_exists: IfExists | None
    reference: Any


class MaxEntTrainer:
    """Policy, frozen reference, optimizer and store of one run.

    Parameters
    ----------
    model, tokenizer:
        A ``transformers`` causal LM and its tokenizer; the reference is a frozen deep copy of
        the model as given (or of ``reference``).
    store:
        Where every step goes. The trainer writes through a store object of its own attempt
        (:meth:`~maxent_arrow.store.RolloutStore.next_attempt`), ``self.store``; the given
        object's ``resume_from`` / ``if_exists`` apply unless these arguments say otherwise.
    config:
        The run's settings (:class:`~maxent_arrow.rollout.RunConfig`); stored with every
        step, completed with the tokenizer's identity and ids, as the replay contract.
    reward_funcs:
        ``f(completions, answers) -> list[float]``, one per ``config.reward_names``.
    options:
        The optional keywords (:class:`TrainerOptions`), below.
    accelerator:
        An ``accelerate.Accelerator``; it decides the device and runs the backward pass.
    run_dir:
        Where the per-step weight snapshots go (``snapshots/``); None keeps none.
    resume_from:
        The step this run resumes at (the first step it will run; the policy given is the one
        to resume with, e.g. the snapshot of that step): the stored steps ``>= resume_from``
        of earlier attempts are superseded.
    reference:
        The reference model, when it is not the model given (a resumed run: the policy is a
        later snapshot, the reference the run's first); frozen, copied.
    if_exists:
        What a fresh run (no ``resume_from``) does when the store holds steps of an earlier
        run: ``"error"`` (refused here, with a :class:`~maxent_arrow.errors.StoreError`
        naming the choices), ``"new_attempt"`` (a re-run that supersedes it) or ``"resume"``
        (continue after its last step).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        store: RolloutStore,
        *,
        config: RunConfig,
        reward_funcs: Sequence[Callable],
        **options: Unpack[TrainerOptions],
    ):
        from accelerate import Accelerator

        unknown = sorted(options.keys() - TrainerOptions.__optional_keys__)
        if unknown:  # as Python refuses an unknown keyword
            raise TypeError(f"MaxEntTrainer() got an unexpected keyword argument {unknown[0]!r}")
        self.config = config
        self.tokenizer = tokenizer
        # A trainer is a run of its own: the store object of its attempt.
        self.store = store.next_attempt(
            resume_from=options.get("resume_from"), if_exists=options.get("if_exists")
        )
        self.reward_funcs = list(reward_funcs)
        run_dir = options.get("run_dir")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        accelerator = options.get("accelerator")
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        # Policy and reference are scored alike: the sampler's temperature.
        self.scoring = ScoringOptions(temperature=config.gen_temperature)
        reference = options.get("reference")
        base = model if reference is None else reference
        self.reference = copy.deepcopy(base).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.reference.to(self.accelerator.device)
        self.last_grad_norm: float | None = None  # of the last update, before the step
        self.metrics_records: list[dict[str, Any]] = []  # trainer_metrics rows, one per step
        # The run's attempt, begun now: a fresh run into an earlier run's store is refused
        # before any step (None: a store without a commit log, which keeps no records).
        self.attempt = self.store.begin_attempt(config=self.run_config().to_dict())

    @property
    def policy(self) -> Any:
        """The unwrapped policy model."""
        return self.accelerator.unwrap_model(self.model)

    def run_config(self) -> RunConfig:
        """The config snapshot stored with every step: the settings, with the tokenizer's
        identity and ids and the model's class."""
        return self.config.replace(
            mode="maxent",
            tokenizer=tokenizer_identity(self.tokenizer),
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            model=type(self.policy).__name__,
        )

    def save_snapshot(self, step: int) -> Path | None:
        if self.run_dir is None:
            return None
        from safetensors.torch import save_model

        path = snapshot_path(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_model(self.policy, str(path))
        return path

    def step(
        self, step: int, rows: Sequence[dict[str, str]], *, replayed: SampledBatch | None = None
    ) -> RolloutBatch:
        """Run one training step on ``rows`` (``{"prompt", "answer"}``) and append it.

        The stages of ``docs/formulas.md`` §4.1: generate, rewards, score batch, reference,
        snapshot, policy scores, weights, loss and update, append.

        ``replayed``: stored groups (from the replay sampler) mixed into this update: the
        optimised loss is the group-weighted mean of the fresh groups' loss and their
        :meth:`replay_loss`, one backward pass. The appended step holds the fresh groups and
        their own loss; the ``trainer_metrics`` record has the mixed loss.
        """
        cfg = self.config
        rollouts = self.generate(step, rows)
        rewards = self.rewards(rollouts.generation)
        score_batch = build_score_batch(
            rollouts.generation,
            pad_token_id=self.tokenizer.pad_token_id,
            max_prompt_len=cfg.max_prompt_len,
            slice_size=0,
            tokenizer=self.tokenizer,
            max_completion_len=cfg.max_completion_len,
            accelerator=self.accelerator,
        )
        reference = reference_logprobs(
            self.reference, score_batch, options=self.scoring, return_token_logp=True
        )
        # The weights this step's loss is computed with, saved before they change.
        self.save_snapshot(step)
        scores = sequence_scores(
            self.model,
            score_batch,
            reference,
            behavior_token_logp=rollouts.behavior_token_logp,
            return_token_logp=True,
            # The logits are there anyway; their entropy fills the policy_entropy_sum column.
            return_entropy=True,
            options=self.scoring,
        )
        weights = self.weights(rewards, reference)
        loss, diagnostics = self.losses(scores, reference, weights)
        optimised, total = loss.loss, None
        if replayed is not None and replayed.num_groups:
            fresh = len(rows)
            replay_loss, _ = self.replay_loss(replayed)
            optimised = (fresh * loss.loss + replayed.num_groups * replay_loss.loss) / (
                fresh + replayed.num_groups
            )
            total = float(optimised.detach())
        self.apply(optimised)
        batch = RolloutBatch.from_parts(
            step,
            generation=rollouts.generation,
            rewards=rewards,
            score_batch=score_batch,
            reference=reference,
            scores=scores,
            length_stats=length_stats(
                reference.ref_tok_counts, max_completion_len=cfg.max_completion_len
            ),
            loss=loss,
            diagnostics=diagnostics,
            weights=weights,
            config=self.run_config().to_dict(),
            policy_version=step,
            behavior_token_logp=rollouts.behavior_token_logp,
            sampling=self.sampling(),
        )
        self.store.append(batch)
        self.record_metrics(step, loss, diagnostics, total=total)
        return batch

    def replay_loss(self, sampled: SampledBatch) -> tuple[LossOutputs, BatchDiagnostics]:
        """The MaxEnt loss of stored groups (a :class:`~maxent_arrow.store.SampledBatch` of the
        replay sampler) under the current policy, with gradients: the stored token ids
        re-scored, the stored reference log-probs and MaxEnt weights (they depend on the
        rewards and the reference only, not on the policy that sampled), the stored behaviour
        log-probs as the old ones. At staleness 0 with the step's weights it is the loss the
        online step logged."""
        cfg = self.config
        batch = sampled.rollout_batch()
        reference = batch.reference_logprobs
        weights = batch.ragged("weights")
        if reference is None or weights is None:
            raise StoreError(
                f"replay_loss: the stored groups of step {sampled.step} have no reference "
                "log-probs or MaxEnt weights (not a MaxEnt run's store?)"
            )
        score_batch = build_score_batch(
            batch,
            pad_token_id=self.tokenizer.pad_token_id,
            max_prompt_len=cfg.max_prompt_len,
            slice_size=0,
            eos_token_id=self.tokenizer.eos_token_id,
            max_completion_len=cfg.max_completion_len,
            accelerator=self.accelerator,
        )
        scores = sequence_scores(
            self.model,
            score_batch,
            reference,
            behavior_token_logp=batch.ragged("behavior_token_logp"),
            options=self.scoring,
        )
        return self.losses(scores, reference, weights)

    def step_from_store(
        self, step: int, sampled: SampledBatch
    ) -> tuple[LossOutputs, BatchDiagnostics]:
        """One update on stored groups alone (offline training): the snapshot of the weights
        it starts from, :meth:`replay_loss`, one optimizer step, the ``trainer_metrics``
        record. Nothing is appended to the rollout tables (the groups are stored already)."""
        self.save_snapshot(step)
        loss, diagnostics = self.replay_loss(sampled)
        self.apply(loss.loss)
        self.record_metrics(step, loss, diagnostics)
        return loss, diagnostics

    def record_metrics(
        self,
        step: int,
        loss: LossOutputs,
        diagnostics: BatchDiagnostics,
        *,
        total: float | None = None,
    ) -> None:
        """The step's ``trainer_metrics`` record (``docs/arrow-layout.md``), as TRL's recorder
        writes one from TRL's log: optimizer step ``step + 1`` (the update just made), trained
        on the rollout step ``step``, one step and one batch averaged; the loss terms and the
        seed diagnostics (whose ``clip_ratio*`` measure the policy-vs-reference log-ratio, not
        PPO clipping: they go under ``diagnostics/``, not in the clip columns) by name. Kept in
        ``metrics_records``; appended to the store's ``trainer_metrics`` records (a store with a
        commit log)."""
        figures = {
            name: getattr(loss.scalars, name) for name in R.feeding("LossScalarBundle", R.STEP)
        }
        seed = {
            f"diagnostics/{f.name}": getattr(diagnostics, f.name)
            for f in dataclasses.fields(diagnostics)
            if isinstance(getattr(diagnostics, f.name), int | float)
        }
        row = {
            "optimizer_step": step + 1,
            "kind": "train",
            "step": step,
            "first_step": step,
            "averaged_steps": 1,
            "loss_batches": 1,
            "rounds": 1,
            "loss": float(loss.scalars.total_loss) if total is None else total,
            "grad_norm": self.last_grad_norm,
            "learning_rate": float(self.optimizer.param_groups[0]["lr"]),
            "kl": diagnostics.kl_value,
            METRICS_KEY: {**figures, **seed},
        }
        self.metrics_records.append(row)
        if self.attempt is not None:
            self.store.append_records(R.TRAINER_METRICS, trainer_metrics_table([row]))

    def sampling(self) -> dict[str, float | int]:
        """The sampling parameters :meth:`generate` draws with, stored per completion: the
        temperature and top-p of the config, no top-k or min-p cut. The behaviour log-probs
        stored beside them are the policy's tempered log-softmax over the whole vocabulary
        (what the loss's ratio compares with), so their semantics are not recorded: they are
        neither the raw (temperature 1) nor the sampler's processed distribution (which a
        top-p cut, and at the first token the ban on an immediate EOS, renormalise)."""
        cfg = self.config
        return {"temperature": cfg.gen_temperature, "top_p": cfg.top_p, "top_k": 0, "min_p": 0.0}

    def generate(self, step: int, rows: Sequence[dict[str, str]]) -> Rollouts:
        """K sampled completions per prompt from the policy (in eval mode: no dropout), seeded
        per step so a run is reproducible."""
        cfg = self.config
        policy = self.policy
        policy.eval()
        return sample_groups(
            policy,
            self.tokenizer,
            [r["prompt"] for r in rows],
            [r["answer"] for r in rows],
            options=SamplingOptions(
                k=cfg.num_generations,
                max_new_tokens=cfg.max_completion_len,
                max_prompt_len=cfg.max_prompt_len,
                temperature=cfg.gen_temperature,
                top_p=cfg.top_p,
                generator_seed=cfg.seed * 1_000_003 + step,
            ),
        )

    def rewards(self, generation: GenerationBatch) -> RewardComputation:
        """Utilities, moments, advantages and q of the sampled completions (§3.1-3.4)."""
        cfg = self.config
        return compute_rewards(
            generation,
            self.reward_funcs,
            weights=list(cfg.reward_weights),
            reward_names=list(cfg.reward_names),
            scale_rewards=cfg.scale_rewards == "group",
            q_temperature=cfg.q_temperature,
            q_epsilon=cfg.q_epsilon,
            max_completion_len=cfg.max_completion_len,
        )

    def update(
        self, scores: SequenceScores, reference: ReferenceLogprobs, weights: Ragged
    ) -> tuple[LossOutputs, BatchDiagnostics]:
        """The MaxEnt loss and diagnostics (§3.9-3.10), then one optimizer step."""
        loss, diagnostics = self.losses(scores, reference, weights)
        self.apply(loss.loss)
        return loss, diagnostics

    def losses(
        self, scores: SequenceScores, reference: ReferenceLogprobs, weights: Ragged
    ) -> tuple[LossOutputs, BatchDiagnostics]:
        """The MaxEnt loss and diagnostics (§3.9-3.10) of scored samples, no update."""
        cfg = self.config
        return evaluate_losses(
            scores,
            reference,
            weights,
            mode="maxent",
            beta=cfg.beta,
            clip=self.clip_settings(),
            max_completion_len=cfg.max_completion_len,
            len_norm_ref=cfg.len_norm_ref,
        )

    def apply(self, loss: torch.Tensor) -> None:
        """Backward pass of ``loss`` and one optimizer step (the gradient norm kept)."""
        self.accelerator.backward(loss)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.last_grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def weights(self, rewards: RewardComputation, reference: ReferenceLogprobs) -> Ragged:
        """MaxEnt weights from the step's q and the reference term (§3.6).

        The reference term is computed from the stored facts (raw sums and token counts, in
        float64), exactly as :func:`maxent_arrow.rollout.recompute` does, so a replayed step
        reproduces the weights bit for bit.
        """
        cfg = self.config
        q = rewards.q_distribution.ragged("grouped")
        raw = reference.ref_logp_sum_raw.detach().cpu().to(torch.float64)
        counts = reference.ref_tok_counts.detach().cpu().to(torch.float64)
        rho = raw / counts.clamp(min=1) if cfg.len_norm_ref else raw
        return maxent_weights(
            q,
            rho,
            tau=cast(float, cfg.tau),  # None is refused there, with a ComputeError naming tau
            beta=cfg.beta,
            denominator=cfg.weight_denominator,
            token_counts=counts,
            length_reweight=cfg.length_reweight,
        )

    def clip_settings(self) -> ClipSettings | None:
        cfg = self.config
        if not cfg.use_clip_objective:
            return None
        return ClipSettings(
            eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high, coef=cfg.clip_objective_coef
        )
