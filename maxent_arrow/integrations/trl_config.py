"""TRL's settings as the store records them: the run's
:class:`~maxent_arrow.rollout.RunConfig`, the replay contract (:func:`trl_run_config`: β, ε /
ε_high, ``loss_type``, ``scale_rewards``, ``reward_weights``, ``multi_objective_aggregation``,
temperature, ``num_generations``, lengths, the tokenizer's name and vocabulary size; the rest
of TRL's settings under ``extra["trl"]``), so that :func:`~maxent_arrow.rollout.recompute`
reproduces TRL's advantages from a stored step; and each round's part of the off-policy
contract (:func:`trl_offpolicy`). What they read of the trainer and its ``GRPOConfig`` is
declared in :mod:`.trl_contract`.
"""

from __future__ import annotations

import json
from typing import Any

from maxent_arrow.errors import MissingExtraError
from maxent_arrow.rollout import RunConfig

try:
    import trl
except ImportError:  # pragma: no cover - the extra is installed where this module is used
    raise MissingExtraError("trl", "trl") from None

__all__ = ["trl_offpolicy", "trl_run_config"]


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=True)
        return value
    except (TypeError, ValueError):
        return repr(value)


def trl_run_config(trainer: Any) -> RunConfig:
    """TRL's settings as the replay contract (:class:`~maxent_arrow.rollout.RunConfig`).

    ``max_prompt_len``: TRL 1.16 does not truncate prompts, so the model's context length
    (``max_position_embeddings``) is recorded as the bound.
    """
    args = trainer.args
    tok = trainer._tokenizer  # TRL's own attribute: the processor's tokenizer
    model_config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    context = getattr(model_config, "max_position_embeddings", None) or 0
    world = trainer.accelerator.num_processes
    names = list(trainer.reward_func_names)
    trl_extra = {
        "version": trl.__version__,
        "num_generations_eval": trainer.num_generations_eval,
        "num_iterations": trainer.num_iterations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "per_device_eval_batch_size": args.per_device_eval_batch_size,
        "generation_batch_size": args.generation_batch_size,
        "world_size": world,
        "importance_sampling_level": args.importance_sampling_level,
        "delta": args.delta,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "mask_truncated_completions": args.mask_truncated_completions,
        "use_bias_correction_kl": args.use_bias_correction_kl,
        "top_entropy_quantile": args.top_entropy_quantile,
        "off_policy_mask_threshold": args.off_policy_mask_threshold,
        "use_vllm": args.use_vllm,
        "vllm_importance_sampling_correction": args.vllm_importance_sampling_correction,
        "vllm_importance_sampling_mode": args.vllm_importance_sampling_mode,
        "vllm_importance_sampling_clip_max": args.vllm_importance_sampling_clip_max,
        "vllm_importance_sampling_clip_min": args.vllm_importance_sampling_clip_min,
        "generation_kwargs": _json_safe(args.generation_kwargs),
        "chat_template_kwargs": _json_safe(args.chat_template_kwargs),
        "eos_token_ids": list(trainer.eos_token_ids),
    }
    return RunConfig(
        reward_names=tuple(names),
        reward_weights=tuple(float(w) for w in trainer.reward_weights.tolist()),
        scale_rewards=trainer.scale_rewards,
        multi_objective_aggregation=trainer.multi_objective_aggregation,
        unscorable="exclude",
        advantage_eps=1e-4,
        beta=float(trainer.beta),
        mode="grpo",
        loss_type=trainer.loss_type,
        use_clip_objective=True,
        clip_eps_low=float(trainer.epsilon_low),
        clip_eps_high=float(trainer.epsilon_high),
        num_generations=int(trainer.num_generations),
        max_prompt_len=int(context),
        max_completion_len=int(trainer.max_completion_length),
        gen_temperature=float(trainer.temperature),
        top_p=float(args.top_p),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        tokenizer={
            "name": tok.name_or_path or type(tok).__name__,
            "class": type(tok).__name__,
            "vocab_size": tok.vocab_size,
            "len": len(tok),
        },
        model=getattr(model_config, "_name_or_path", None) or None,
        prompts_per_step=int(args.generation_batch_size // trainer.num_generations),
        learning_rate=float(args.learning_rate),
        seed=int(args.seed),
        trainer=f"trl.GRPOTrainer {trl.__version__}",
        extra={"trl": trl_extra},
    )


def trl_offpolicy(trainer: Any, *, step: int) -> dict[str, Any]:
    """What TRL shows of the off-policy contract for a round generated at ``step``: the
    policy version (``global_step``), the sampling parameters of ``GRPOConfig`` (``top_k``
    None or 0 stored as 0: off; ``min_p`` None as 0.0), and the log-prob semantics:
    ``processed`` under vLLM (TRL asks vLLM for ``processed_logprobs``, and refuses a server
    that gives others), and without vLLM when nothing cuts the distribution (no top-p, top-k or
    min-p: TRL's ``old_per_token_logps`` at the sampling temperature are then the sampled
    distribution's); otherwise unknown (not stored)."""
    args = trainer.args
    top_p = float(args.top_p) if args.top_p is not None else 1.0
    top_k = int(args.top_k or 0)
    min_p = float(args.min_p or 0.0)
    uncut = top_p >= 1.0 and top_k == 0 and min_p == 0.0
    return {
        "policy_version": int(step),
        "temperature": float(trainer.temperature),
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "logp_semantics": "processed" if (args.use_vllm or uncut) else None,
    }
