"""The reward step ``GenerationBatch -> RewardComputation`` against a per-sample reference."""

from __future__ import annotations

import json
import math
import random
import statistics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from maxent_arrow import ComputeError, GenerationBatch, RewardComputation, SchemaError
from maxent_arrow.compute import apply_entropy_bonus, compute_rewards
from maxent_arrow.compute.reward_step import behavior_logprobs_from_meta
from maxent_arrow.compute.seed_grpo import SeedGrpoSettings


def accuracy(completions, answers):
    return [1.0 if f"\\boxed{{{a}}}" in c else 0.0 for c, a in zip(completions, answers)]


def brevity(completions, answers):
    return [1.0 / (1 + len(c)) for c in completions]


def sometimes_none(completions, answers):
    return [None if "?" in c else 0.5 for c in completions]


def _batch(seed=0, n_groups=6):
    rng = random.Random(seed)
    prompts, answers, grouped, meta, info = [], [], [], [], []
    for g in range(n_groups):
        k = rng.randint(1, 5)
        answer = str(rng.randint(0, 2))
        prompts.append(f"prompt {g}")
        answers.append(answer)
        texts, metas, infos = [], [], []
        for _ in range(k):
            guess = str(rng.randint(0, 2))
            text = rng.choice([f"think \\boxed{{{guess}}}", f"hmm? \\boxed{{{guess}}}", "lost"])
            count = rng.randint(1, 12)
            texts.append(text)
            metas.append({"logprob_sum": -0.3 * count, "token_count": count})
            infos.append({"finish_reason": rng.choice(["stop", "length"]), "token_count": count})
        grouped.append(texts)
        meta.append(metas)
        info.append(infos)
    return GenerationBatch(prompts, answers, grouped, meta, info)


def _reference(gb, funcs, weights, *, truncate=False, max_len=None):
    flat = [c for g in gb.grouped_completions for c in g]
    answers = [a for a, g in zip(gb.answers, gb.grouped_completions) for _ in range(len(g))]
    info = [i for g in gb.grouped_completion_info for i in g]
    raw = [f(flat, answers) for f in funcs]
    utils = []
    for i in range(len(flat)):
        terms = [w * (math.nan if r[i] is None else r[i]) for w, r in zip(weights, raw)]
        u = sum(t for t in terms if not math.isnan(t))
        hit = info[i].get("finish_reason") == "length" or (
            max_len is not None and info[i]["token_count"] >= max_len
        )
        utils.append(0.0 if truncate and hit else u)
    return flat, answers, raw, utils


def test_compute_rewards_matches_the_per_sample_reference():
    gb = _batch(1)
    funcs = [accuracy, brevity, sometimes_none]
    rc = compute_rewards(gb, funcs, weights=[1.0, 0.5, 2.0], q_temperature=0.5)
    flat, answers, raw, utils = _reference(gb, funcs, [1.0, 0.5, 2.0])
    assert isinstance(rc, RewardComputation)
    assert rc.total_utils == pytest.approx(utils, abs=1e-15)
    assert list(rc.per_reward_values) == ["reward_0", "reward_1", "reward_2"]
    assert rc.per_reward_values["reward_1"] == raw[1]
    nan_or = [math.nan if v is None else v for v in raw[2]]
    got = rc.per_reward_values["reward_2"]
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, nan_or))
    assert rc.pairs.completions == flat
    sizes = [len(g) for g in gb.grouped_completions]
    assert rc.pairs.prompts == [p for p, k in zip(gb.prompts, sizes) for _ in range(k)]
    assert rc.moments.mean == pytest.approx(statistics.fmean(utils))
    assert rc.moments.std == pytest.approx(statistics.pstdev(utils))
    i = 0
    for g, k in enumerate(sizes):
        u = utils[i : i + k]
        mu = sum(u) / k
        sd = statistics.stdev(u) if k > 1 else 0.0
        assert rc.advantage.grouped[g] == pytest.approx(
            [(x - mu) / (sd + 1e-4) for x in u], abs=1e-9
        )
        e = [math.exp((x - max(u)) / 0.5) for x in u]
        soft = [x / sum(e) for x in e]
        q = [s * (1 - k * 1e-6) + 1e-6 for s in soft]
        assert rc.q_grouped[g] == pytest.approx([x / sum(q) for x in q], abs=1e-12)
        i += k
    assert rc.advantage_samples == [x for g in rc.advantage.grouped for x in g]
    assert rc.ref_logprob_meta[0] == gb.grouped_ref_meta[0][0]
    assert rc.completion_metadata is rc.pairs.metadata
    assert rc.seed_semantic_entropies is None and rc.entropy_bonus_scale is None


def test_truncated_completions_get_zero_utility_and_custom_names(tmp_path):
    gb = _batch(2)
    rc = compute_rewards(
        gb,
        [accuracy, brevity],
        weights=[1.0, 1.0],
        reward_names=["acc", "short"],
        zero_truncated_completion_rewards=True,
        max_completion_len=10,
    )
    _, _, _, utils = _reference(gb, [accuracy, brevity], [1.0, 1.0], truncate=True, max_len=10)
    assert rc.total_utils == pytest.approx(utils)
    assert list(rc.per_reward_values) == ["acc", "short"]
    # The record survives a Parquet round trip.
    pq.write_table(pa.Table.from_batches([rc.to_arrow()]), tmp_path / "rc.parquet")
    back = RewardComputation.from_arrow(pq.read_table(tmp_path / "rc.parquet"))
    assert back == rc


def test_seed_grpo_scales_the_advantages():
    gb = _batch(3)
    plain = compute_rewards(gb, [accuracy], weights=[1.0])
    seeded = compute_rewards(gb, [accuracy], weights=[1.0], seed_grpo=SeedGrpoSettings(alpha=1.0))
    scales = seeded.seed_advantage_scales
    assert len(scales) == len(gb.prompts)
    for g, s in enumerate(scales):
        want = [s * a for a in plain.advantage.grouped[g]]
        assert seeded.advantage.grouped[g] == pytest.approx(want, abs=1e-12)
    k_max = max(len(g) for g in gb.grouped_completions)
    assert seeded.seed_max_possible_entropy == pytest.approx(math.log(k_max))
    assert seeded.seed_alpha_effective == pytest.approx(1.0 / math.log(k_max))
    assert all(0 < s <= 1 for s in scales)


def test_apply_entropy_bonus_recomputes_utils_advantages_and_q():
    gb = _batch(4)
    rc = compute_rewards(gb, [accuracy, brevity], weights=[1.0, 1.0])
    n = len(rc.total_utils)
    ent = torch.linspace(1.0, 30.0, n, dtype=torch.float64)
    counts = torch.arange(1, n + 1)
    out = apply_entropy_bonus(rc, ent, counts, coef=0.3)
    sigma = rc.moments.std
    assert out.entropy_bonus_scale == pytest.approx(sigma)
    bonus = out.per_reward_values["entropy_bonus"]
    new = [u + b for u, b in zip(rc.total_utils, bonus)]
    assert out.total_utils == pytest.approx(new)
    assert out.moments.std == pytest.approx(statistics.pstdev(new))
    z = out.per_reward_values["policy_entropy_group_zscore"]
    assert bonus == pytest.approx([0.3 * sigma * x for x in z])
    assert out.pairs is rc.pairs
    assert apply_entropy_bonus(rc, ent, counts, coef=0.0) is rc


def test_behavior_logprobs_from_meta_reads_every_alias_in_one_parse():
    meta = pa.array(
        [
            json.dumps({"logprob_sum": -3.5, "token_count": 7, "raw_output": {"a": [1]}}),
            json.dumps({"cumulative_logprob": -1.0, "num_tokens": 2}),
            json.dumps({"token_logprobs": [-0.25, -0.5, -0.25]}),
            "null",
            None,
            json.dumps({"logprob": -2.0, "token_count": 4}),
        ]
    )
    total, count = behavior_logprobs_from_meta(meta)
    assert total.tolist()[:3] == [-3.5, -1.0, -1.0] and total.tolist()[5] == -2.0
    assert math.isnan(total[3]) and math.isnan(total[4])
    assert count.tolist()[:3] == [7.0, 2.0, 3.0] and math.isnan(count[3])


def test_reward_function_errors_name_the_function_and_sample():
    gb = _batch(5)
    n = sum(len(g) for g in gb.grouped_completions)

    def short(completions, answers):
        return [0.0] * (len(completions) - 1)

    def stringy(completions, answers):
        return [0.0] + ["bad"] * (len(completions) - 1)

    with pytest.raises(
        ComputeError,
        match=rf"reward function 1 \(short\) returned {n - 1} "
        rf"values, expected {n}",
    ):
        compute_rewards(gb, [accuracy, short], weights=[1.0, 1.0])
    with pytest.raises(
        SchemaError,
        match=r"reward function 0 \(stringy\) returned 'bad' at "
        r"sample 1, expected a float",
    ):
        compute_rewards(gb, [stringy], weights=[1.0])
    with pytest.raises(ComputeError, match=r"weights: expected 2 \(one per reward function\)"):
        compute_rewards(gb, [accuracy, brevity], weights=[1.0])
    empty = GenerationBatch([], [], [], None)
    with pytest.raises(ComputeError, match=r"expected at least one group, got 0"):
        compute_rewards(empty, [accuracy], weights=[1.0])
    hollow = GenerationBatch(["p", "q"], ["1", "2"], [["a"], []], None)
    with pytest.raises(ComputeError, match=r"grouped_completions: group 1 is empty"):
        compute_rewards(hollow, [accuracy], weights=[1.0])
    no_meta = GenerationBatch(["p"], ["1"], [["a", "b"]], None)
    with pytest.raises(ComputeError, match=r"seed_grpo needs generation_batch.grouped_ref_meta"):
        compute_rewards(no_meta, [accuracy], weights=[1.0], seed_grpo=SeedGrpoSettings())
