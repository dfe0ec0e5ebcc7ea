"""Evaluation through the seed's ``ValidationContext``: held-out prompts, greedy completions,
rewards, stored in the run as ``kind="eval"`` steps.

``evaluate(ctx, step=...)`` follows the seed's contract: ``ctx.generator(prompts, 1)`` returns
the grouped completion texts and their per-completion metadata (``token_ids``,
``finish_reason``, ...); ``ctx.eval_reward`` (or ``ctx.reward``) scores them; the step goes to
``ctx.logging.store`` and its means to ``ctx.logging.log_metrics``.
"""

from __future__ import annotations

from typing import Any

from maxent_arrow.compute import compute_rewards, length_stats
from maxent_arrow.errors import LayoutError
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.train.generation import SamplingOptions, sample_groups
from maxent_arrow.types import GenerationBatch, RewardComputation, ValidationContext

__all__ = ["evaluate", "should_evaluate", "greedy_generator"]


def should_evaluate(ctx: ValidationContext, step: int) -> bool:
    """True when evaluation is on and ``step`` is a multiple of ``every_n_steps``."""
    settings = ctx.evaluation
    every = settings.every_n_steps
    return bool(settings.enabled and settings.rows and every and step % every == 0)


def greedy_generator(model: Any, tokenizer: Any, *, max_new_tokens: int, max_prompt_len: int):
    """A seed ``GenerationFn``: greedy completions of a ``transformers`` model, with metadata."""

    def generate(prompts: list[str], num_samples: int, *_, **__) -> tuple[list, list | None]:
        rollouts = sample_groups(
            model,
            tokenizer,
            list(prompts),
            [""] * len(prompts),
            options=SamplingOptions(
                k=num_samples,
                max_new_tokens=max_new_tokens,
                max_prompt_len=max_prompt_len,
                greedy=True,
            ),
        )
        gen = rollouts.generation
        return gen.grouped_completions, gen.grouped_completion_info

    return generate


def evaluate(ctx: ValidationContext, *, step: int) -> RolloutBatch | None:
    """Evaluate on ``ctx.evaluation.rows`` and store the result as step ``step``, kind "eval".

    Returns the stored batch, or None when evaluation is disabled or has no rows.
    """
    settings = ctx.evaluation
    if not settings.enabled or not settings.rows:
        return None
    prompts = [row["prompt"] for row in settings.rows]
    answers = [row["answer"] for row in settings.rows]
    generation, infos = _generate(ctx, prompts, answers)
    spec = ctx.eval_reward or ctx.reward
    names = spec.reward_names or [
        getattr(f, "__name__", f"reward_{j}") for j, f in enumerate(spec.reward_funcs)
    ]
    rewards = compute_rewards(
        generation, spec.reward_funcs, weights=spec.reward_weights, reward_names=names
    )
    counts = [info.get("token_count", 0) for group in infos for info in group]
    max_len = ctx.generation.max_completion_len if ctx.generation is not None else max(counts)
    lengths = length_stats(counts, max_completion_len=max(int(max_len), 1))
    batch = RolloutBatch.from_parts(
        step,
        generation=generation,
        rewards=rewards,
        length_stats=lengths,
        kind="eval",
        config={"reward_names": names, "reward_weights": list(spec.reward_weights)},
    )
    store = getattr(ctx.logging, "store", None)
    if store is not None:
        store.append(batch)
    if ctx.logging.log_metrics is not None:
        ctx.logging.log_metrics(_metrics(rewards), step)
    return batch


def _generate(
    ctx: ValidationContext, prompts: list[str], answers: list[str]
) -> tuple[GenerationBatch, list[list[dict]]]:
    """One completion per prompt from ``ctx.generator``, in batches of
    ``ctx.evaluation.batch_size``, with the model in eval mode (restored afterwards); the
    batch and the generator's per-completion metadata."""
    size = max(int(ctx.evaluation.batch_size or len(prompts)), 1)
    was_training = getattr(ctx.model, "training", False)
    ctx.model.eval()
    texts: list[list[str]] = []
    infos: list[list[dict]] = []
    try:
        for start in range(0, len(prompts), size):
            chunk_texts, chunk_meta = ctx.generator(prompts[start : start + size], 1)
            texts.extend(chunk_texts)
            infos.extend(chunk_meta)
    finally:
        if was_training:
            ctx.model.train()
    if len(texts) != len(prompts):
        raise LayoutError(
            f"evaluate: the generator returned {len(texts)} groups for {len(prompts)} prompts"
        )
    generation = GenerationBatch(
        prompts=prompts,
        answers=answers,
        grouped_completions=texts,
        grouped_ref_meta=None,
        grouped_completion_info=infos,
    )
    return generation, infos


def _metrics(rewards: RewardComputation) -> dict[str, float]:
    """``eval/reward_mean``, ``eval/reward_std`` and the mean of each reward function."""
    metrics = {"eval/reward_mean": rewards.moments.mean, "eval/reward_std": rewards.moments.std}
    for name, values in rewards.per_reward_values.items():
        metrics[f"eval/{name}"] = float(sum(values) / len(values)) if len(values) else 0.0
    return metrics
