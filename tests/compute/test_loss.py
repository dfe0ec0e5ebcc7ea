"""Losses against float64 per-sample / per-token reference loops (§3.9), plus gradcheck."""

from __future__ import annotations

import math
import random

import pytest
import torch

from maxent_arrow import ComputeError, Ragged, ReferenceLogprobs, SequenceScores
from maxent_arrow.compute import (
    ClipSettings,
    evaluate_losses,
    grpo_loss,
    k3,
    maxent_loss,
    sequence_kl,
    token_kl,
    token_rows,
)

F64 = torch.float64


def rk3(d):
    d = max(-60.0, min(60.0, d))
    return math.exp(d) - d - 1


def clip_obj(r, a, clip):
    if clip.delta is not None:
        r = min(r, clip.delta)
    rc = min(max(r, 1 - clip.eps_low), 1 + clip.eps_high)
    if clip.sign_dependent and a < 0:
        return max(r * a, rc * a)
    return min(r * a, rc * a)


def ref_maxent(w_groups, S, T, rho=None, beh=None, beta=0.0, clip=None):
    G = len(w_groups)
    policy, clip_sum, i = 0.0, 0.0, 0
    for g in w_groups:
        for w in g:
            t = max(T[i], 1)
            policy -= w * S[i] / t
            if clip is not None:
                r = math.exp(max(-60, min(60, S[i] - (beh[i] if beh else S[i]))))
                b = clip.adv_baseline if clip.adv_baseline is not None else 1 / len(g)
                clip_sum -= clip_obj(r, w - b, clip)
            i += 1
    policy /= G
    clip_val = clip_sum / G if clip is not None else None
    if clip is not None:
        policy += clip.coef * clip_val
    kl = 0.0
    if rho is not None:
        ts = [max(t, 1) for t in T]
        kl = sum(rk3(r - s / t) * t for r, s, t in zip(rho, S, ts)) / sum(ts)
    return policy + beta * kl, policy, clip_val, kl


def ref_aggregate(per_token_rows, loss_type, max_len):
    n = len(per_token_rows)
    if loss_type == "bnpo":
        return sum(sum(r) for r in per_token_rows) / max(sum(len(r) for r in per_token_rows), 1)
    if loss_type == "dr_grpo":
        return sum(sum(r) for r in per_token_rows) / (n * max_len)
    return sum(sum(r) / max(len(r), 1) for r in per_token_rows) / n


def ref_grpo(adv, logp, old, ref, loss_type, max_len, clip, beta):
    rows, kl_rows = [], []
    for a, lp, od, rf in zip(adv, logp, old, ref):
        row, krow = [], []
        for x, o, y in zip(lp, od, rf):
            r = math.exp(x - o)
            row.append(-clip_obj(r, a, clip) if clip else -r * a)
            krow.append(rk3(y - x))
        rows.append(row)
        kl_rows.append(krow)
    ppo = ref_aggregate(rows, loss_type, max_len)
    kl = ref_aggregate(kl_rows, loss_type, max_len)
    policy = ppo * clip.coef if clip else ppo
    return policy + beta * kl, policy, kl


def _maxent_inputs(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(12)]
    w_groups = []
    for k in sizes:
        raw = [rng.random() + 0.05 for _ in range(k)]
        w_groups.append([x / sum(raw) for x in raw])
    n = sum(sizes)
    S = [rng.uniform(-40, -1) for _ in range(n)]
    T = [rng.randint(0, 40) for _ in range(n)]
    rho = [rng.uniform(-2, -0.1) for _ in range(n)]
    beh = [s + rng.uniform(-0.5, 0.5) for s in S]
    return w_groups, S, T, rho, beh


@pytest.mark.parametrize(
    "clip",
    [
        None,
        ClipSettings(),
        ClipSettings(eps_low=0.1, eps_high=0.3, delta=1.2, coef=0.5),
        ClipSettings(adv_baseline=0.2, sign_dependent=True),
    ],
)
def test_maxent_loss_matches_reference(clip):
    w_groups, S, T, rho, beh = _maxent_inputs(1)
    out = maxent_loss(
        Ragged.from_lists(w_groups, dtype=F64),
        torch.tensor(S, dtype=F64),
        torch.tensor(T),
        ref_logp_mean=torch.tensor(rho, dtype=F64),
        behavior_logp_sum=torch.tensor(beh, dtype=F64),
        beta=0.07,
        clip=clip,
    )
    total, policy, clip_val, kl = ref_maxent(w_groups, S, T, rho, beh, 0.07, clip)
    assert out.loss.item() == pytest.approx(total, rel=1e-12)
    assert out.scalars.policy_loss == pytest.approx(policy, rel=1e-12)
    assert out.scalars.kl_loss == pytest.approx(kl, rel=1e-12)
    assert out.scalars.weighted_kl_loss == pytest.approx(0.07 * kl, rel=1e-12)
    if clip is None:
        assert out.scalars.clip_loss is None
    else:
        assert out.scalars.clip_loss == pytest.approx(clip_val, rel=1e-12, abs=1e-15)
    assert out.denom_tok_tensor.tolist() == [max(t, 1) for t in T]
    assert out.total_loss_scalar == pytest.approx(out.loss.item())


def test_standard_and_sign_dependent_clip_differ_only_for_negative_advantages():
    w = Ragged.from_lists([[0.1, 0.9]], dtype=F64)  # Â = -0.4, +0.4 with b = 1/2
    S = torch.tensor([-1.0, -1.0], dtype=F64)
    beh = torch.tensor([-1.5, -1.5], dtype=F64)  # ratio e^0.5 ≈ 1.65, clipped to 1.2
    std = maxent_loss(w, S, torch.ones(2), behavior_logp_sum=beh, clip=ClipSettings())
    odd = maxent_loss(
        w, S, torch.ones(2), behavior_logp_sum=beh, clip=ClipSettings(sign_dependent=True)
    )
    r = math.exp(0.5)
    # Standard: min(r Â, 1.2 Â) = r·(-0.4) for Â < 0 and 1.2·0.4 for Â > 0.
    assert std.scalars.clip_loss == pytest.approx(-(r * -0.4 + 1.2 * 0.4))
    assert odd.scalars.clip_loss == pytest.approx(-(1.2 * -0.4 + 1.2 * 0.4))


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "grpo"])
@pytest.mark.parametrize("clip", [None, ClipSettings(eps_low=0.1, eps_high=0.15, coef=0.8)])
def test_grpo_loss_matches_reference(loss_type, clip):
    rng = random.Random(2)
    lengths = [rng.randint(0, 9) for _ in range(10)]
    logp = [[rng.uniform(-4, -0.01) for _ in range(t)] for t in lengths]
    old = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in logp]
    ref = [[x + rng.uniform(-0.5, 0.5) for x in row] for row in logp]
    adv = [rng.gauss(0, 1) for _ in lengths]
    out = grpo_loss(
        torch.tensor(adv, dtype=F64),
        Ragged.from_lists(logp, dtype=F64),
        Ragged.from_lists(old, dtype=F64),
        ref_token_logp=Ragged.from_lists(ref, dtype=F64),
        beta=0.04,
        loss_type=loss_type,
        max_completion_len=12,
        clip=clip,
    )
    total, policy, kl = ref_grpo(adv, logp, old, ref, loss_type, 12, clip, 0.04)
    assert out.loss.item() == pytest.approx(total, rel=1e-12)
    assert out.scalars.policy_loss == pytest.approx(policy, rel=1e-12)
    assert out.scalars.kl_loss == pytest.approx(kl, rel=1e-12)
    assert (out.scalars.clip_loss is None) == (clip is None)
    got_kl = token_kl(
        Ragged.from_lists(logp, dtype=F64),
        Ragged.from_lists(ref, dtype=F64),
        loss_type=loss_type,
        max_completion_len=12,
    )
    assert got_kl.item() == pytest.approx(kl, rel=1e-12)


def test_grpo_sequence_fallback_without_token_logprobs():
    adv = [1.0, -0.5, 0.25]
    S = [-3.0, -5.0, -1.0]
    beh = [-3.2, -4.7, -1.0]
    clip = ClipSettings()
    out = grpo_loss(
        torch.tensor(adv, dtype=F64),
        cur_logp_sum=torch.tensor(S, dtype=F64),
        behavior_logp_sum=torch.tensor(beh, dtype=F64),
        clip=clip,
    )
    want = -sum(clip_obj(math.exp(s - b), a, clip) for a, s, b in zip(adv, S, beh)) / 3
    assert out.loss.item() == pytest.approx(want)
    assert out.scalars.kl_loss == 0.0


def test_padded_input_with_mask_equals_ragged_input():
    rows = [[-1.0, -2.0, -0.5], [-0.1], [], [-3.0, -0.2]]
    flat = Ragged.from_lists(rows, dtype=F64)
    padded, mask = flat.to_padded(0.0, max_len=5)
    ref_flat = flat.with_values(flat.values - 0.3)
    ref_padded, ref_mask = ref_flat.to_padded(0.0, max_len=7)  # a wider reference block
    adv = torch.tensor([0.5, -1.0, 2.0, 0.1], dtype=F64)
    a = grpo_loss(adv, flat, ref_token_logp=ref_flat, beta=0.1)
    b = grpo_loss(
        adv, padded, token_mask=mask, ref_token_logp=ref_padded, ref_token_mask=ref_mask, beta=0.1
    )
    assert a.loss.item() == b.loss.item()
    assert token_rows(padded, mask, where="t").equal(flat)


def test_k3_and_sequence_kl():
    d = torch.tensor([-100.0, -1.0, 0.0, 0.5, 100.0], dtype=F64)
    assert k3(d).tolist() == pytest.approx([rk3(x) for x in d.tolist()], rel=1e-14)
    assert k3(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]
    got = sequence_kl(
        torch.tensor([-1.0, -2.0], dtype=F64),
        torch.tensor([-4.0, -2.0], dtype=F64),
        torch.tensor([2, 0]),
    )
    want = (rk3(-1.0 - (-2.0)) * 2 + rk3(-2.0 - (-2.0)) * 1) / 3
    assert got.item() == pytest.approx(want)


# ---------------------------------------------------------------------------- gradients
def test_maxent_loss_gradcheck():
    w_groups, S, T, rho, beh = _maxent_inputs(5)
    weights = Ragged.from_lists(w_groups, dtype=F64)
    s = torch.tensor(S, dtype=F64, requires_grad=True)

    def f(scores):
        return maxent_loss(
            weights,
            scores,
            torch.tensor(T),
            ref_logp_mean=torch.tensor(rho, dtype=F64),
            behavior_logp_sum=torch.tensor(beh, dtype=F64),
            beta=0.3,
            clip=ClipSettings(eps_low=0.15, eps_high=0.25, coef=0.7),
        ).loss

    assert torch.autograd.gradcheck(f, (s,), eps=1e-6, atol=1e-8)
    f(s).backward()
    assert s.grad is not None and torch.count_nonzero(s.grad) == len(S)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "grpo"])
def test_grpo_loss_gradcheck(loss_type):
    rng = random.Random(9)
    lengths = [3, 0, 5, 2]
    offsets = torch.tensor([0, 3, 3, 8, 10])
    values = torch.tensor([rng.uniform(-3, -0.1) for _ in range(10)], dtype=F64)
    old = values.detach() + torch.tensor([rng.uniform(-0.05, 0.05) for _ in range(10)], dtype=F64)
    ref = values.detach() + 0.2
    adv = torch.tensor([0.7, -0.2, -1.1, 0.4], dtype=F64)
    assert sum(lengths) == 10

    def f(v):
        return grpo_loss(
            adv,
            Ragged(v, offsets),
            Ragged(old, offsets),
            ref_token_logp=Ragged(ref, offsets),
            beta=0.2,
            loss_type=loss_type,
            max_completion_len=6,
            clip=ClipSettings(),
        ).loss

    assert torch.autograd.gradcheck(f, (values.clone().requires_grad_(),), eps=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------- seed records
def test_evaluate_losses_from_seed_records():
    rng = random.Random(4)
    rows = [[rng.uniform(-2, -0.1) for _ in range(t)] for t in (3, 1, 4, 2)]
    flat = Ragged.from_lists(rows, dtype=torch.float32)
    token_logp, mask = flat.to_padded(0.0)
    ref_flat = flat.with_values(flat.values - 0.25)
    ref_tok, ref_mask = ref_flat.to_padded(0.0, max_len=6)
    S = flat.to_padded(0.0)[0].sum(1)
    counts = flat.lengths().to(torch.float32)
    ref_sum = ref_tok.sum(1)
    scores = SequenceScores(
        cur_logp_sum=S.clone().requires_grad_(),
        behavior_logp_sum=S,
        log_ratio_train=S - ref_sum,
        denom_tok_tensor=counts,
        token_logp=token_logp,
        token_mask=mask.float(),
        old_token_logp=token_logp,
    )
    ref = ReferenceLogprobs(
        ref_logp_sum=ref_sum / counts,
        ref_tok_counts=counts,
        ref_logp_sum_raw=ref_sum,
        ref_logp_mean=float(ref_sum.mean()),
        avg_completion_tokens=float(counts.mean()),
        ref_token_logp=ref_tok,
        ref_token_mask=ref_mask.long(),
    )
    weights = Ragged.from_lists([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float32)
    out, diag = evaluate_losses(scores, ref, weights, mode="maxent", beta=0.1)
    direct = maxent_loss(weights, S, counts, ref_logp_mean=ref_sum / counts, beta=0.1)
    assert out.loss.item() == pytest.approx(direct.loss.item(), rel=1e-6)
    assert out.log_ratio_train is scores.log_ratio_train
    assert diag.kl_value == pytest.approx(k3(torch.full((4,), -0.25)).mean().item(), rel=1e-5)
    out.loss.backward()
    assert scores.cur_logp_sum.grad is not None
    adv = Ragged.from_lists([[1.0, -1.0], [0.5, -0.5]], dtype=torch.float32)
    g_out, g_diag = evaluate_losses(scores, ref, adv, mode="grpo", beta=0.1, loss_type="grpo")
    want = grpo_loss(adv, flat, ref_token_logp=ref_flat, beta=0.1, loss_type="grpo").loss.item()
    assert g_out.loss.item() == pytest.approx(want, rel=1e-6)
    # Per-token diagnostics: log π - log π_ref = 0.25 everywhere, above ln 1.2.
    assert (g_diag.clip_ratio, g_diag.clip_ratio_high_max, g_diag.clip_ratio_low_mean) == (
        1.0,
        1.0,
        0.0,
    )
    assert g_diag.kl_token_count_by_len_bucket == {"0-32": 10.0}
    # Sum-reference convention gives the same ρ̄ here.
    alt, _ = evaluate_losses(scores, ref, weights, beta=0.1, len_norm_ref=False)
    assert alt.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)


# ---------------------------------------------------------------------------- bad input
def test_loss_errors_are_named():
    w = Ragged.from_lists([[0.5, 0.5]], dtype=F64)
    with pytest.raises(ComputeError, match=r"maxent_loss: cur_logp_sum: expected 2 values"):
        maxent_loss(w, torch.zeros(3, dtype=F64), torch.ones(3))
    with pytest.raises(ComputeError, match=r"maxent_loss: beta must be finite and >= 0"):
        maxent_loss(w, torch.zeros(2, dtype=F64), torch.ones(2), beta=-1.0)
    with pytest.raises(ComputeError, match=r"maxent_loss: weights: expected at least one group"):
        maxent_loss(
            Ragged(torch.zeros(0), torch.zeros(1, dtype=torch.int64)),
            torch.zeros(0),
            torch.zeros(0),
        )
    tok = Ragged.from_lists([[-1.0, -2.0], [-1.0]], dtype=F64)
    with pytest.raises(ComputeError, match=r"loss_type must be 'bnpo', 'dr_grpo' or 'grpo', got"):
        grpo_loss(torch.zeros(2), tok, loss_type="mean")
    with pytest.raises(ComputeError, match=r"'dr_grpo' needs max_completion_len > 0"):
        grpo_loss(torch.zeros(2), tok, loss_type="dr_grpo")
    other = Ragged.from_lists([[-1.0], [-1.0, 0.0]], dtype=F64)
    with pytest.raises(
        ComputeError,
        match=r"grpo_loss: ref_token_logp: sample 0 has 1 tokens, "
        r"expected 2",
    ):
        grpo_loss(torch.zeros(2), tok, ref_token_logp=other)
    with pytest.raises(ComputeError, match=r"grpo_loss: advantages: expected 2 values"):
        grpo_loss(torch.zeros(3), tok)
    with pytest.raises(ComputeError, match=r"a padded tensor needs its mask"):
        grpo_loss(torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ComputeError, match=r"ClipSettings.eps_low"):
        ClipSettings(eps_low=1.0)
    with pytest.raises(ComputeError, match=r"mode must be 'maxent' or 'grpo'"):
        scores = SequenceScores(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2))
        evaluate_losses(scores, None, w, mode="ppo")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_losses_cpu_and_gpu_agree():
    w_groups, S, T, rho, beh = _maxent_inputs(8)
    args = dict(beta=0.1, clip=ClipSettings())
    cpu = maxent_loss(
        Ragged.from_lists(w_groups, dtype=F64),
        torch.tensor(S, dtype=F64),
        torch.tensor(T),
        ref_logp_mean=torch.tensor(rho, dtype=F64),
        **args,
    )
    gpu = maxent_loss(
        Ragged.from_lists(w_groups, dtype=F64).to("cuda"),
        torch.tensor(S, dtype=F64, device="cuda"),
        torch.tensor(T, device="cuda"),
        ref_logp_mean=torch.tensor(rho, dtype=F64, device="cuda"),
        **args,
    )
    assert gpu.loss.device.type == "cuda"
    assert gpu.loss.item() == pytest.approx(cpu.loss.item(), rel=1e-12)
    tok = Ragged.from_lists([[-1.0, -2.0], [], [-0.5, -0.1, -3.0]], dtype=F64)
    ref = tok.with_values(tok.values + 0.1)
    adv = torch.tensor([1.0, 0.0, -1.0], dtype=F64)
    a = grpo_loss(adv, tok, ref_token_logp=ref, beta=0.1, loss_type="grpo")
    b = grpo_loss(
        adv.cuda(), tok.to("cuda"), ref_token_logp=ref.to("cuda"), beta=0.1, loss_type="grpo"
    )
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-12)
