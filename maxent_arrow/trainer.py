"""A small, complete MaxEnt-GRPO training loop through the rollout store (what the demo runs).

One step (semantics §4.1): sample K completions per prompt with ``model.generate``; score them
with the reward functions (:func:`~maxent_arrow.reward_step.compute_rewards`: utilities,
advantages, q); build the ``ScoreBatch`` from the exact generated token ids; reference log-probs
from a frozen copy of the initial model; MaxEnt weights from q and the reference; policy scores
with gradients; the MaxEnt loss and diagnostics; one optimizer step through ``accelerate``; and
``RolloutStore.append`` of everything, with the config snapshot that makes it replayable.

Before each update the policy weights are saved (safetensors, no pickle) as the step's snapshot,
so an offline replay can re-score the stored tokens with exactly the weights that produced the
logged loss (:mod:`maxent_arrow.offline_replay`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maxent_arrow.arithmetic_rewards import accuracy_reward, format_reward
from maxent_arrow.batch import RolloutBatch
from maxent_arrow.compute import length_stats, maxent_weights
from maxent_arrow.generation import sample_groups
from maxent_arrow.ingest import build_score_batch
from maxent_arrow.loss import ClipSettings, evaluate_losses
from maxent_arrow.prompt_cache import tokenizer_identity
from maxent_arrow.ragged import Ragged
from maxent_arrow.reward_step import compute_rewards
from maxent_arrow.scoring import reference_logprobs, sequence_scores
from maxent_arrow.store import RolloutStore

__all__ = ["TrainConfig", "MaxEntTrainer", "tiny_model", "snapshot_path"]


@dataclass
class TrainConfig:
    """Everything that shapes a step; stored as JSON with every step (the replay contract)."""

    num_generations: int = 8
    prompts_per_step: int = 8
    max_prompt_len: int = 32
    max_completion_len: int = 12
    gen_temperature: float = 1.0
    top_p: float = 1.0
    tau: float = 0.5
    beta: float = 0.05
    q_temperature: float = 0.5
    q_epsilon: float = 1e-6
    weight_denominator: str = "tau"
    len_norm_ref: bool = True
    length_reweight: bool = False  # the [C] post-softmax w ∝ w·T reweighting (sum references)
    scale_rewards: bool = True
    use_clip_objective: bool = False
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_objective_coef: float = 1.0
    learning_rate: float = 3e-3
    reward_names: list[str] = field(default_factory=lambda: ["accuracy", "format"])
    reward_weights: list[float] = field(default_factory=lambda: [1.0, 0.5])
    seed: int = 0

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tiny_model(seed: int = 0, *, vocab_size: int = 384) -> Any:
    """A seeded GPT-2 small enough for 2 CPU cores (no download), dropout off for replay."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "snapshots" / f"step-{step:010d}.safetensors"


class MaxEntTrainer:
    """Policy, frozen reference, optimizer and store of one run.

    Parameters
    ----------
    model, tokenizer:
        A ``transformers`` causal LM and its tokenizer; the reference is a frozen deep copy of
        the model as given.
    store:
        Where every step goes.
    config:
        The step's hyper-parameters (:class:`TrainConfig`).
    reward_funcs:
        ``f(completions, answers) -> list[float]``, one per ``config.reward_names``.
    accelerator:
        An ``accelerate.Accelerator``; it decides the device and runs the backward pass.
    run_dir:
        Where the per-step weight snapshots go (``snapshots/``); None keeps none.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        store: RolloutStore,
        *,
        config: TrainConfig,
        reward_funcs: Sequence[Callable] = (accuracy_reward, format_reward),
        accelerator: Any = None,
        run_dir: Path | None = None,
    ):
        from accelerate import Accelerator

        self.config = config
        self.tokenizer = tokenizer
        self.store = store
        self.reward_funcs = list(reward_funcs)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.reference.to(self.accelerator.device)

    @property
    def policy(self) -> Any:
        """The unwrapped policy model."""
        return self.accelerator.unwrap_model(self.model)

    def run_config(self) -> dict[str, Any]:
        """The JSON config snapshot stored with every step."""
        return {
            **self.config.to_json_dict(),
            "mode": "maxent",
            "tokenizer": tokenizer_identity(self.tokenizer),
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
            "model": type(self.policy).__name__,
        }

    def save_snapshot(self, step: int) -> Path | None:
        if self.run_dir is None:
            return None
        from safetensors.torch import save_model

        path = snapshot_path(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_model(self.policy, str(path))
        return path

    def step(self, step: int, rows: Sequence[dict[str, str]]) -> RolloutBatch:
        """Run one training step on ``rows`` (``{"prompt", "answer"}``) and append it."""
        cfg = self.config
        policy = self.policy
        policy.eval()
        rollouts = sample_groups(
            policy,
            self.tokenizer,
            [r["prompt"] for r in rows],
            [r["answer"] for r in rows],
            k=cfg.num_generations,
            max_new_tokens=cfg.max_completion_len,
            max_prompt_len=cfg.max_prompt_len,
            temperature=cfg.gen_temperature,
            top_p=cfg.top_p,
            generator_seed=cfg.seed * 1_000_003 + step,
        )
        rewards = compute_rewards(
            rollouts.generation,
            self.reward_funcs,
            weights=cfg.reward_weights,
            reward_names=cfg.reward_names,
            scale_rewards=cfg.scale_rewards,
            q_temperature=cfg.q_temperature,
            q_epsilon=cfg.q_epsilon,
            max_completion_len=cfg.max_completion_len,
        )
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
            self.reference, score_batch, temperature=cfg.gen_temperature, return_token_logp=True
        )
        self.save_snapshot(step)
        scores = sequence_scores(
            self.model,
            score_batch,
            reference,
            behavior_token_logp=rollouts.behavior_token_logp,
            return_token_logp=True,
            temperature=cfg.gen_temperature,
        )
        weights = self.weights(rewards, reference)
        loss, diagnostics = evaluate_losses(
            scores,
            reference,
            weights,
            mode="maxent",
            beta=cfg.beta,
            clip=self.clip_settings(),
            max_completion_len=cfg.max_completion_len,
            len_norm_ref=cfg.len_norm_ref,
        )
        self.accelerator.backward(loss.loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lengths = length_stats(reference.ref_tok_counts, max_completion_len=cfg.max_completion_len)
        batch = RolloutBatch.from_parts(
            step,
            generation=rollouts.generation,
            rewards=rewards,
            score_batch=score_batch,
            reference=reference,
            scores=scores,
            length_stats=lengths,
            loss=loss,
            diagnostics=diagnostics,
            weights=weights,
            config=self.run_config(),
            policy_version=step,
            behavior_token_logp=rollouts.behavior_token_logp,
        )
        self.store.append(batch)
        return batch

    def weights(self, rewards, reference) -> Ragged:
        """MaxEnt weights from the step's q and the reference term (§3.6).

        The reference term is computed from the stored facts (raw sums and token counts, in
        float64), exactly as :func:`maxent_arrow.replay.recompute` does, so a replayed step
        reproduces the weights bit for bit.
        """
        cfg = self.config
        q = rewards.q_distribution.grouped.to_ragged()
        raw = reference.ref_logp_sum_raw.detach().cpu().to(torch.float64)
        counts = reference.ref_tok_counts.detach().cpu().to(torch.float64)
        rho = raw / counts.clamp(min=1) if cfg.len_norm_ref else raw
        return maxent_weights(
            q,
            rho,
            tau=cfg.tau,
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
