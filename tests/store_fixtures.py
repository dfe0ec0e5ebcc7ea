"""Seeded seed-object factories for the batch and store tests (also imported by the crash and
concurrency subprocesses, so it depends on nothing but maxent_arrow and numpy/torch).

Derived values (advantages, q, weights) are computed here with plain numpy from the formulas of
semantics §3.2, §3.4 and §3.6, independently of ``maxent_arrow.compute.group_math``.
"""

from __future__ import annotations

import numpy as np
import torch

from maxent_arrow import (
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
    RolloutBatch,
    RolloutStore,
    ScoreBatch,
    SequenceScores,
)
from maxent_arrow.store.storage.names import unit_name, unit_of

CONFIG = {
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


def _softmax_groups(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for lo, hi in zip(offsets[:-1], offsets[1:]):  # tiny fixtures only
        z = x[lo:hi] - x[lo:hi].max()
        e = np.exp(z)
        out[lo:hi] = e / e.sum()
    return out


def derived(utils, ref_mean, offsets, config=CONFIG):
    """Advantages, q and weights by the semantics formulas (numpy, float64)."""
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


def make_parts(
    *,
    seed: int = 0,
    groups: int = 3,
    k: tuple[int, int] = (2, 4),
    max_tokens: int = 12,
    reward_names: tuple[str, ...] = ("accuracy", "format"),
    config: dict | None = None,
) -> dict:
    """Keyword arguments for ``RolloutBatch.from_parts`` (all seed objects), seeded."""
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
    utils = sum(weights_cfg.get(name, 1.0) * v for name, v in per_reward.items())
    token_logp = np.where(mask, -rng.random((n, width)).astype(np.float32) * 3, 0).astype(
        np.float32
    )
    ref_raw = token_logp.sum(axis=1, dtype=np.float64).astype(np.float32)
    counts = lengths.astype(np.float32)
    ref_mean = ref_raw / np.maximum(counts, 1)
    adv, q, w = derived(utils, ref_mean.astype(np.float64), offsets, config)
    grouped = lambda v: [v[lo:hi].tolist() for lo, hi in zip(offsets[:-1], offsets[1:])]  # noqa: E731
    flat_prompts = [prompts[g] for g in range(groups) for _ in range(sizes[g])]
    rewards = RewardComputation(
        total_utils=utils.tolist(),
        per_reward_values={k: v.tolist() for k, v in per_reward.items()},
        advantage=AdvantageStats(grouped(adv), adv.tolist()),
        pairs=PromptCompletionBatch(flat_prompts, texts),
        q_distribution=QDistribution(grouped(q), q.tolist()),
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


def make_batch(step: int, *, rank: int = 0, kind: str = "train", seed: int | None = None, **kw):
    """A full RolloutBatch for ``step`` (seeded by step and rank unless ``seed`` is given)."""
    parts = make_parts(seed=step * 1000 + rank if seed is None else seed, **kw)
    return RolloutBatch.from_parts(step, rank=rank, kind=kind, **parts)


def unit_path(store, table: str, step: int, *, rank: int = 0, kind: str = "train"):
    """The committed file of ``table`` (``"groups"``/``"steps"``) that holds the unit
    (step, rank, kind) alone: in a store with a commit log its name is the unit's and a token
    of its commit (``names.unit_of`` takes the token off)."""
    want = unit_name(step, rank, kind)
    (path,) = [p for p in store.committed_files(table) if unit_of(p.name) == want]
    return path


# A query over every committed group file (the advantages of each step, summed).
ADVANTAGE_SUMS = (
    "SELECT step, sum(list_sum(advantages)) AS s FROM groups GROUP BY step ORDER BY step"
)


def loose_store(root, steps: int = 3):
    """A writable store at ``root`` of ``steps`` one-step files (no merging)."""
    store = RolloutStore.create(root, compact_every=None)
    for step in range(steps):
        store.append(make_batch(step))
    return store


def compacted_run(root, *, steps: int, eval_every: int, merged: int, segment: int):
    """A writable store at ``root``: train steps ``0..steps-1`` (seeded by step), an eval step
    at every ``eval_every``-th (seeded ``100 + step``), the first ``merged`` train steps
    compacted into segments of ``segment`` steps and the others loose."""
    store = RolloutStore.create(root, compact_every=None)
    for step in range(steps):
        store.append(make_batch(step, seed=step))
        if step % eval_every == 0:
            store.append(make_batch(step, kind="eval", seed=100 + step))
    store.compact(kind="train", steps=range(merged), max_steps=segment)
    return store
