"""Seeded, complete rollout batches: every seed object of one step of one rank, from a seed.

The derived values (advantages, q, MaxEnt weights) are computed here with plain numpy from the
formulas of semantics §3.2, §3.4 and §3.6 (:func:`expected_group_math`), independently of
:mod:`maxent_arrow.compute`, so a test can check the package's group math against them.

The data a seed gives is frozen: the golden stores of ``data/`` were written from it, and
tests compare exact values, so a change here changes them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.types import (
    AdvantageStats,
    BatchDiagnostics,
    GenerationBatch,
    LengthStats,
    LossScalarBundle,
    PromptCacheEntry,
    PromptCompletionBatch,
    QDistribution,
    ReferenceLogprobs,
    RewardComputation,
    RewardMoments,
    ScoreBatch,
    SequenceScores,
)

CONFIG: dict[str, Any] = {
    "tau": 0.5,
    "beta": 0.04,
    "q_temperature": 0.8,
    "q_epsilon": 1e-6,
    "weight_denominator": "tau",
    "len_norm_ref": True,
    "scale_rewards": True,
    "pad_token_id": 0,
    "max_completion_len": 16,
    "max_prompt_len": 8,
    "tokenizer": "ByT5Tokenizer",
    "reward_weights": {"accuracy": 1.0, "format": 0.5},
}
"""The run config of the factories' batches (stored in each step row): the settings their
derived values were computed with. Read it; pass a changed copy (``{**CONFIG, "tau": 0.2}``)
rather than changing it."""


def _softmax_groups(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for lo, hi in zip(offsets[:-1], offsets[1:]):  # tiny fixtures only
        z = x[lo:hi] - x[lo:hi].max()
        e = np.exp(z)
        out[lo:hi] = e / e.sum()
    return out


def expected_group_math(
    utils: np.ndarray,
    ref_mean: np.ndarray,
    offsets: np.ndarray,
    config: Mapping[str, Any] = CONFIG,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Advantages, q and MaxEnt weights by the semantics formulas, in plain numpy (float64).

    Parameters
    ----------
    utils:
        ``[N]`` total utilities of the samples, in group order.
    ref_mean:
        ``[N]`` length-normalised reference log-probabilities.
    offsets:
        ``[G + 1]`` group offsets into the samples (``offsets[g]:offsets[g + 1]`` is group
        ``g``).
    config:
        The run config: ``q_temperature``, ``q_epsilon``, ``beta`` and ``tau`` are read.

    Returns
    -------
    tuple of numpy.ndarray
        ``(advantages, q, weights)``, each ``[N]``: the group-standardised advantages
        (sample std, ``+ 1e-4``), q (a softmax of ``utils / q_temperature`` per group,
        smoothed by ``q_epsilon``) and the weights (a softmax of
        ``(log q + beta * ref_mean) / tau`` per group).
    """
    adv = np.empty_like(utils)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        u = utils[lo:hi]
        centred = u - u.mean()
        std = np.sqrt((centred**2).sum() / max(hi - lo - 1, 1)) if hi - lo > 1 else 0.0
        adv[lo:hi] = centred / (std + 1e-4)
    soft = _softmax_groups(utils / config["q_temperature"], offsets)
    k = np.repeat(np.diff(offsets), np.diff(offsets)).astype(np.float64)
    eps = config["q_epsilon"]
    q = soft * (1 - k * eps) + eps
    q = q / np.repeat(np.add.reduceat(q, offsets[:-1]), np.diff(offsets))
    logits = (np.log(np.maximum(q, 1e-12)) + config["beta"] * ref_mean) / config["tau"]
    return adv, q, _softmax_groups(logits, offsets)


def _grouped(values: np.ndarray, offsets: np.ndarray) -> list[list[Any]]:
    return [values[lo:hi].tolist() for lo, hi in zip(offsets[:-1], offsets[1:])]


def make_parts(
    *,
    seed: int = 0,
    groups: int = 3,
    k: tuple[int, int] = (2, 4),
    max_tokens: int = 12,
    reward_names: Sequence[str] = ("accuracy", "format"),
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of :meth:`RolloutBatch.from_parts` (every seed object), seeded.

    Parameters
    ----------
    seed:
        The seed of all the data (``numpy.random.default_rng(seed)``): the same seed and
        arguments give the same values.
    groups:
        The number of prompts (groups).
    k:
        The smallest and largest group size (completions per prompt), both included; each
        group's size is drawn in that range.
    max_tokens:
        The largest completion length; a completion of that length is truncated
        (``finish_reason="length"``).
    reward_names:
        The reward functions; each scores every completion in ``[0, 1)``.
    config:
        The run config (default :data:`CONFIG`); its ``reward_weights`` weigh the rewards into
        the total utility, and the derived values follow its settings. It is copied.

    Returns
    -------
    dict
        ``generation``, ``rewards``, ``score_batch``, ``reference``, ``scores``,
        ``length_stats``, ``loss``, ``diagnostics``, ``weights`` and ``config``, with
        advantages, q and weights computed by :func:`expected_group_math`.
    """
    config = dict(CONFIG if config is None else config)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(k[0], k[1] + 1, size=groups)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(offsets[-1])
    prompts = [f"prompt {seed}-{g}: {int(rng.integers(100))} + 1 =" for g in range(groups)]
    answers = [str(g) for g in range(groups)]
    lengths = rng.integers(1, max_tokens + 1, size=n)
    width = int(lengths.max())
    ids = np.zeros((n, width), dtype=np.int64)
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids[mask] = rng.integers(3, 300, size=int(lengths.sum()))
    texts = [bytes(int(t) % 90 + 32 for t in row[:ln]).decode() for row, ln in zip(ids, lengths)]
    grouped_texts = [texts[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]
    truncated = lengths >= max_tokens
    info = [
        [
            {
                "finish_reason": "length" if truncated[i] else "stop",
                "truncated": bool(truncated[i]),
                "token_count": int(lengths[i]),
                "seed": seed,
            }
            for i in range(lo, hi)
        ]
        for lo, hi in zip(offsets[:-1], offsets[1:])
    ]
    ref_meta = [
        [{"logprob_sum": float(-lengths[i])} for i in range(lo, hi)]
        for lo, hi in zip(offsets[:-1], offsets[1:])
    ]
    generation = GenerationBatch(prompts, answers, grouped_texts, ref_meta, info)

    per_reward = {name: rng.random(n).round(3) for name in reward_names}
    weights_cfg = config.get("reward_weights", {})
    utils = np.asarray(sum(weights_cfg.get(name, 1.0) * v for name, v in per_reward.items()))
    token_logp = np.where(mask, -rng.random((n, width)).astype(np.float32) * 3, 0).astype(
        np.float32
    )
    ref_raw = token_logp.sum(axis=1, dtype=np.float64).astype(np.float32)
    counts = lengths.astype(np.float32)
    ref_mean = ref_raw / np.maximum(counts, 1)
    adv, q, w = expected_group_math(utils, ref_mean.astype(np.float64), offsets, config)
    flat_prompts = [prompts[g] for g in range(groups) for _ in range(sizes[g])]
    rewards = RewardComputation(
        total_utils=utils.tolist(),
        per_reward_values={name: v.tolist() for name, v in per_reward.items()},
        advantage=AdvantageStats(_grouped(adv, offsets), adv.tolist()),
        pairs=PromptCompletionBatch(flat_prompts, texts),
        q_distribution=QDistribution(_grouped(q, offsets), q.tolist()),
        moments=RewardMoments(float(utils.mean()), float(utils.std())),
        entropy_bonus_scale=None,
    )
    prompt_tokens = [
        list(rng.integers(3, 300, size=int(rng.integers(2, 6)))) for _ in range(groups)
    ]
    entries = [
        PromptCacheEntry(prompt_tokens[g], [1] * len(prompt_tokens[g]))
        for g in range(groups)
        for _ in range(sizes[g])
    ]
    score_batch = ScoreBatch(
        prompt_entries=entries,
        completion_ids=torch.from_numpy(ids),
        completion_attention_mask=torch.from_numpy(mask.astype(np.int64)),
        pad_token_id=0,
        max_prompt_len=8,
        slice_size=4,
        total_sequences=n,
    )
    reference = ReferenceLogprobs(
        ref_logp_sum=torch.from_numpy(ref_mean),
        ref_tok_counts=torch.from_numpy(counts),
        ref_logp_sum_raw=torch.from_numpy(ref_raw),
        ref_logp_mean=float(ref_raw.mean()),
        avg_completion_tokens=float(counts.mean()),
        ref_token_logp=torch.from_numpy(token_logp),
        ref_token_mask=torch.from_numpy(mask.astype(np.int64)),
    )
    behav = (token_logp + 0.01).astype(np.float32) * mask
    scores = SequenceScores(
        cur_logp_sum=torch.from_numpy(behav.sum(1)),
        behavior_logp_sum=torch.from_numpy(behav.sum(1)),
        log_ratio_train=torch.zeros(n),
        denom_tok_tensor=torch.from_numpy(counts),
        policy_entropy_sum=torch.from_numpy(rng.random(n).astype(np.float32)),
        token_logp=torch.from_numpy(behav),
        token_mask=torch.from_numpy(mask.astype(np.int64)),
        old_token_logp=torch.from_numpy(behav),
    )
    lstats = LengthStats(
        float(lengths.min()),
        float(lengths.mean()),
        float(lengths.max()),
        float(truncated.mean()),
        1.0,
        2.0,
        3.0,
    )
    loss = LossScalarBundle(1.5, 1.0, None, 0.25, 0.01)
    diag = BatchDiagnostics(
        0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, {"0-32": 0.1}, {"0-32": float(lengths.sum())}
    )
    return dict(
        generation=generation,
        rewards=rewards,
        score_batch=score_batch,
        reference=reference,
        scores=scores,
        length_stats=lstats,
        loss=loss,
        diagnostics=diag,
        weights=torch.from_numpy(w),
        config=config,
    )


def make_batch(
    step: int,
    *,
    rank: int = 0,
    kind: str = "train",
    seed: int | None = None,
    policy_version: int | None = None,
    **shape: Any,
) -> RolloutBatch:
    """A complete :class:`~maxent_arrow.rollout.RolloutBatch` of ``step``, from
    :func:`make_parts`.

    Parameters
    ----------
    step, rank, kind:
        Where the batch belongs.
    seed:
        The data's seed; by default ``step * 1000 + rank``, so each step and rank of a run
        differs (the ``kind`` does not change the default: pass a seed for an eval step
        that should differ from its train step).
    policy_version:
        The policy version that generated the batch (none by default).
    shape:
        Any of :func:`make_parts`'s ``groups``, ``k``, ``max_tokens``, ``reward_names`` and
        ``config``.

    Returns
    -------
    RolloutBatch
        A batch that validates, with every column family of the seed objects.
    """
    parts = make_parts(seed=step * 1000 + rank if seed is None else seed, **shape)
    return RolloutBatch.from_parts(
        step, rank=rank, kind=kind, policy_version=policy_version, **parts
    )
