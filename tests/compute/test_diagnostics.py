"""``BatchDiagnostics`` (§3.10) against per-sample reference loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from maxent_arrow import BatchDiagnostics, ComputeError, Ragged
from maxent_arrow.compute.diagnostics import batch_diagnostics, kl_by_length_bucket

F64 = torch.float64


def rk3(d):
    d = max(-60.0, min(60.0, d))
    return math.exp(d) - d - 1


def bucket_of(t):
    t = max(t, 1)
    for label, upper in (("0-32", 32), ("33-64", 64), ("65-128", 128), ("129-256", 256)):
        if t <= upper:
            return label
    return "257+"


def ref_buckets(kl, lengths):
    num, den = {}, {}
    for k, t in zip(kl, lengths):
        b = bucket_of(t)
        t = max(t, 1)
        num[b] = num.get(b, 0.0) + k * t
        den[b] = den.get(b, 0.0) + t
    return {b: num[b] / den[b] for b in num}, den


def test_bucket_boundaries_follow_the_labels():
    lengths = torch.tensor([0, 1, 32, 33, 64, 65, 128, 129, 256, 257, 4000])
    kl = torch.arange(1.0, 12.0, dtype=F64)
    per_token, counts = kl_by_length_bucket(kl, lengths)
    want_pt, want_counts = ref_buckets(kl.tolist(), lengths.tolist())
    assert counts == want_counts
    assert per_token == pytest.approx(want_pt)
    assert counts["0-32"] == 1 + 1 + 32 and counts["257+"] == 257 + 4000
    only_short, _ = kl_by_length_bucket(torch.ones(2), torch.tensor([3, 4]))
    assert list(only_short) == ["0-32"]  # empty buckets are omitted


def test_sequence_case_matches_reference():
    rng = random.Random(0)
    n = 50
    T = [rng.choice([0, 5, 40, 100, 200, 300]) for _ in range(n)]
    S = [rng.uniform(-2.5, -0.05) * max(t, 1) for t in T]
    rho = [rng.uniform(-2.0, -0.1) for _ in range(n)]
    got = batch_diagnostics(
        cur_logp_sum=torch.tensor(S, dtype=F64),
        token_counts=torch.tensor(T),
        ref_logp_mean=torch.tensor(rho, dtype=F64),
        eps_low=0.2,
        eps_high=0.28,
    )
    delta = [r - s / max(t, 1) for r, s, t in zip(rho, S, T)]
    kl = [rk3(d) for d in delta]
    lr = [-d for d in delta]
    low = [x < math.log(0.8) for x in lr]
    high = [x > math.log(1.28) for x in lr]
    assert isinstance(got, BatchDiagnostics)
    assert got.kl_value == pytest.approx(sum(kl) / n)  # unweighted mean
    assert got.clip_ratio_low_mean == pytest.approx(sum(low) / n)
    assert got.clip_ratio_high_mean == pytest.approx(sum(high) / n)
    assert got.clip_ratio == got.clip_ratio_region_mean == pytest.approx((sum(low) + sum(high)) / n)
    assert got.clip_ratio_low_min == float(all(low))
    assert got.clip_ratio_high_max == float(any(high))
    want_pt, want_counts = ref_buckets(kl, T)
    assert got.kl_per_token_by_len_bucket == pytest.approx(want_pt)
    assert got.kl_token_count_by_len_bucket == want_counts


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "grpo"])
def test_token_case_matches_reference(loss_type):
    rng = random.Random(1)
    lengths = [rng.choice([0, 3, 40, 70]) for _ in range(12)]
    logp = [[rng.uniform(-3, -0.01) for _ in range(t)] for t in lengths]
    ref = [[x + rng.uniform(-0.6, 0.6) for x in row] for row in logp]
    got = batch_diagnostics(
        token_logp=Ragged.from_lists(logp, dtype=F64),
        ref_token_logp=Ragged.from_lists(ref, dtype=F64),
        loss_type=loss_type,
        max_completion_len=80,
    )
    k_rows = [[rk3(y - x) for x, y in zip(a, b)] for a, b in zip(logp, ref)]
    total = sum(sum(r) for r in k_rows)
    if loss_type == "bnpo":
        want = total / sum(lengths)
    elif loss_type == "dr_grpo":
        want = total / (len(lengths) * 80)
    else:
        want = sum(sum(r) / max(len(r), 1) for r in k_rows) / len(lengths)
    assert got.kl_value == pytest.approx(want)
    ratios = [x - y for a, b in zip(logp, ref) for x, y in zip(a, b)]
    low = sum(r < math.log(0.8) for r in ratios) / len(ratios)
    high = sum(r > math.log(1.2) for r in ratios) / len(ratios)
    assert (got.clip_ratio_low_mean, got.clip_ratio_high_mean) == pytest.approx((low, high))
    per_seq = [sum(r) / max(len(r), 1) for r in k_rows]
    want_pt, want_counts = ref_buckets(per_seq, lengths)
    assert got.kl_per_token_by_len_bucket == pytest.approx(want_pt)
    assert got.kl_token_count_by_len_bucket == want_counts


def test_no_reference_gives_zeros_and_empty_buckets():
    got = batch_diagnostics(cur_logp_sum=torch.zeros(3), token_counts=torch.ones(3))
    assert got.kl_value == 0.0 and got.clip_ratio == 0.0
    assert got.kl_per_token_by_len_bucket == {} and got.kl_token_count_by_len_bucket == {}


def test_padded_tokens_with_masks_and_errors():
    rows = Ragged.from_lists([[-1.0, -2.0], [-0.5]], dtype=F64)
    ref = rows.with_values(rows.values + 0.5)
    p, m = rows.to_padded(0.0)
    rp, rm = ref.to_padded(0.0, max_len=4)
    a = batch_diagnostics(token_logp=rows, ref_token_logp=ref)
    b = batch_diagnostics(token_logp=p, token_mask=m, ref_token_logp=rp, ref_token_mask=rm)
    assert a == b
    assert a.clip_ratio_low_min == 1.0  # every token below ln 0.8
    with pytest.raises(ComputeError, match=r"ref_token_logp: sample 1 has 2 tokens, expected 1"):
        batch_diagnostics(
            token_logp=rows, ref_token_logp=Ragged.from_lists([[-1.0, -1.0], [0.0, 0.0]])
        )
    with pytest.raises(ComputeError, match=r"the sequence case needs cur_logp_sum"):
        batch_diagnostics(ref_logp_mean=torch.zeros(2))
    with pytest.raises(ComputeError, match=r"expected 0 <= eps_low < 1"):
        batch_diagnostics(eps_low=1.5)
