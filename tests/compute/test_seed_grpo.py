"""SEED-GRPO semantic entropy (§3.3) against a per-group reference loop."""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pytest
import torch

from maxent_arrow import ComputeError
from maxent_arrow.compute.seed_grpo import (
    SeedGrpoSettings,
    extract_answers,
    seed_grpo_statistics,
)


def test_extract_answers_takes_the_last_balanced_boxed_then_the_answer_tag():
    texts = [
        r"first \boxed{3} then \boxed{\frac{1}{2}} done",
        "reasoning <answer> 42 </answer>",
        "no answer at all",
        r"\boxed{a{b{c{d}}}}",
        r"\boxed{  }",
        r"<answer>x</answer> and \boxed{y}",
        "<answer>a</answer><answer>b</answer>",
        "multi\nline \\boxed{7\n}",
    ]
    got = extract_answers(texts).to_pylist()
    assert got == ["\\frac{1}{2}", "42", None, "a{b{c{d}}}", None, "y", "b", "7"]
    assert extract_answers(pa.array(texts)).to_pylist() == got


def ref_semantic_entropy(answers, ells):
    """One group: cluster by answer (None: singleton), mass by softmax of ell, entropy."""
    clusters: dict = {}
    for i, (a, ell) in enumerate(zip(answers, ells)):
        key = ("ans", a) if a is not None else ("solo", i)
        clusters.setdefault(key, []).append(ell)
    m = max(ells)
    z = sum(math.exp(e - m) for e in ells)
    h = 0.0
    for members in clusters.values():
        p = sum(math.exp(e - m) for e in members) / z
        h -= p * math.log(p)
    return h


def _batch(seed, n_groups=25, max_k=8):
    rng = random.Random(seed)
    texts, sums, counts, sizes, answers = [], [], [], [], []
    for _ in range(n_groups):
        k = rng.randint(1, max_k)
        sizes.append(k)
        for _ in range(k):
            pick = rng.random()
            if pick < 0.6:
                a = str(rng.randint(0, 3))
                texts.append(f"so the answer is \\boxed{{{a}}}.")
            elif pick < 0.8:
                a = rng.choice(["x", "y"])
                texts.append(f"<answer>{a}</answer>")
            else:
                a = None
                texts.append("I do not know")
            answers.append(a)
            t = rng.randint(1, 50)
            counts.append(t)
            sums.append(rng.uniform(-2.0, -0.01) * t)
    return texts, sums, counts, sizes, answers


@pytest.mark.parametrize("length_normalize", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_semantic_entropy_and_scales_match_reference(length_normalize, normalize):
    texts, sums, counts, sizes, answers = _batch(3)
    offsets = torch.tensor([0] + sizes).cumsum(0)
    settings = SeedGrpoSettings(
        alpha=0.5, normalize_by_max_entropy=normalize, length_normalize=length_normalize
    )
    got = seed_grpo_statistics(
        texts,
        torch.tensor(sums, dtype=torch.float64),
        torch.tensor(counts),
        offsets=offsets,
        settings=settings,
    )
    i = 0
    for g, k in enumerate(sizes):
        ells = [
            s / max(t, 1) if length_normalize else s
            for s, t in zip(sums[i : i + k], counts[i : i + k])
        ]
        h = ref_semantic_entropy(answers[i : i + k], ells)
        alpha = 0.5 / math.log(k) if normalize and k > 1 else 0.5
        assert got.semantic_entropy[g].item() == pytest.approx(h, abs=1e-12)
        assert got.scales[g].item() == pytest.approx(1 / (1 + alpha * h), abs=1e-12)
        assert got.alpha_per_group[g].item() == pytest.approx(alpha)
        # Same answer <=> same cluster within the group.
        local = got.clusters[g].tolist()
        for a in range(k):
            for b in range(k):
                same = answers[i + a] is not None and answers[i + a] == answers[i + b]
                assert (local[a] == local[b]) == (same or a == b)
        i += k
    k_max = max(sizes)
    assert got.max_possible_entropy == pytest.approx(math.log(k_max))
    assert got.alpha_effective == pytest.approx(0.5 / math.log(k_max) if normalize else 0.5)


def test_all_same_answer_gives_zero_entropy_and_no_answers_give_log_k_at_equal_likelihood():
    texts = [r"\boxed{1}"] * 4 + ["none"] * 4
    got = seed_grpo_statistics(
        texts, torch.full((8,), -3.0), torch.full((8,), 3), offsets=torch.tensor([0, 4, 8])
    )
    assert got.semantic_entropy.tolist() == pytest.approx([0.0, math.log(4)])
    alpha = 0.0417 / math.log(4)
    assert got.scales.tolist() == pytest.approx([1.0, 1 / (1 + alpha * math.log(4))])


def test_equal_answers_in_different_groups_are_different_clusters():
    got = seed_grpo_statistics(
        [r"\boxed{5}", r"\boxed{6}", r"\boxed{5}", r"\boxed{5}"],
        torch.zeros(4),
        torch.ones(4),
        offsets=torch.tensor([0, 2, 4]),
    )
    assert got.clusters.tolist() == [[0, 1], [0, 0]]
    assert got.semantic_entropy.tolist() == pytest.approx([math.log(2), 0.0])


def test_missing_log_likelihood_is_refused_naming_the_group():
    with pytest.raises(
        ComputeError,
        match=r"seed_grpo_statistics: logprob_sum: missing or non-finite generation "
        r"log-likelihood \(nan\) at group 1, sample 0",
    ):
        seed_grpo_statistics(
            ["a", "b", "c"],
            torch.tensor([-1.0, -1.0, math.nan]),
            torch.ones(3),
            offsets=torch.tensor([0, 2, 3]),
        )
    with pytest.raises(ComputeError, match=r"completions: expected 3 texts"):
        seed_grpo_statistics(["a"], torch.zeros(3), torch.ones(3), offsets=torch.tensor([0, 3]))
    with pytest.raises(ComputeError, match=r"alpha must be finite and >= 0"):
        seed_grpo_statistics(
            ["a"],
            torch.zeros(1),
            torch.ones(1),
            offsets=torch.tensor([0, 1]),
            settings=SeedGrpoSettings(alpha=-1.0),
        )
