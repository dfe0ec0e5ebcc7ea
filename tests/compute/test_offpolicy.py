"""Off-policy corrections on offsets (``maxent_arrow.compute.offpolicy``).

verl's modes and diagnostics are checked against verl's own ``rollout_corr_helper`` functions
(verl 0.9.1), called on the same inputs padded as verl wants them (``[B, L]`` plus a response
mask, garbage on the padding). TRL's modes are checked against values derived by hand from
TRL's published formula (TRL computes them inline, so there is no function to call).
"""

from __future__ import annotations

import math

import pytest
import torch

from maxent_arrow import ComputeError, Ragged
from maxent_arrow.compute import (
    RS_MODES,
    offpolicy_metrics,
    rollout_correction,
    rollout_is_weights,
    rollout_rejection_mask,
    trl_importance_metrics,
    trl_importance_ratio,
)

F64 = torch.float64
TOL = 1e-6


# ---------------------------------------------------------------------------- fixtures
def _batch(dtype=F64, seed=0, device="cpu"):
    """Ragged completions (one empty, one wholly masked), masked tokens, and log-ratios that
    land on both sides of every threshold used below."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 0, 7, 3, 4, 6, 2, 9])
    n = int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    beh = -torch.rand(n, generator=g, dtype=F64) * 3.0 - 0.05
    delta = torch.randn(n, generator=g, dtype=F64) * 0.6
    delta[3] = 2.5  # a ratio of e^2.5 ≈ 12
    delta[12] = -3.0
    cur = beh + delta
    mask = torch.rand(n, generator=g) > 0.2
    mask[offsets[5] : offsets[6]] = False  # completion 5: every token masked
    mask[0] = True
    t = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    return t(cur), t(beh), offsets.to(device), mask.to(device)


def _padded(flat, offsets, mask, *, pad=7.5):
    """verl's layout: [B, L] values with garbage padding, and a float response mask."""
    values, present = Ragged(flat, offsets).to_padded(pad_value=pad)
    m, _ = Ragged(mask.to(flat.dtype), offsets).to_padded(pad_value=0.0)
    return values, m * present.to(flat.dtype)


def _flat(padded, offsets):
    """Our flat [N] from a padded [B, L] (left-aligned rows)."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    return torch.cat([padded[i, :k] for i, k in enumerate(lengths)])


def _assert_metrics(ours: dict, theirs: dict, tol=TOL):
    assert sorted(ours) == sorted(theirs)
    bad = {
        k: (ours[k], float(theirs[k]))
        for k in theirs
        if not math.isclose(ours[k], float(theirs[k]), rel_tol=tol, abs_tol=tol)
    }
    assert bad == {}


@pytest.fixture(scope="module")
def verl():
    return pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")


# ---------------------------------------------------------------------------- verl: IS
IS_CASES = [
    ("token", 2.0, False),
    ("token", 1.5, True),
    ("token", "0.5_2.0", False),
    ("token", "0.8_1.25", True),
    ("sequence", 2.0, False),
    ("sequence", 3.0, True),
    ("sequence", "0.5_2.0", False),
    ("sequence", "0.1_5.0", True),
]


@pytest.mark.parametrize(("level", "threshold", "normalize"), IS_CASES)
def test_is_weights_equal_verls_compute_rollout_correction_weights(
    verl, level, threshold, normalize
):
    cur, beh, offsets, mask = _batch()
    ours = rollout_is_weights(
        cur,
        beh,
        offsets=offsets,
        mask=mask,
        level=level,
        threshold=threshold,
        batch_normalize=normalize,
    )
    pc, m = _padded(cur, offsets, mask)
    pb, _ = _padded(beh, offsets, mask, pad=-3.0)
    weights, metrics = verl.compute_rollout_correction_weights(
        pc - pb, m, rollout_is=level, rollout_is_threshold=threshold,
        rollout_is_batch_normalize=normalize,
    )  # fmt: skip
    expected = _flat(weights, offsets)
    torch.testing.assert_close(ours.weights, expected, rtol=TOL, atol=TOL)
    _assert_metrics(ours.metrics, metrics)
    # Weights of uncounted tokens are 0; some weights were truncated or zeroed, some not.
    assert bool((ours.weights[~mask] == 0).all())
    assert 0 < metrics["rollout_is_ratio_fraction_high"] < 1


def test_is_thresholds_as_a_pair_equal_the_string_form():
    cur, beh, offsets, mask = _batch()
    a = rollout_is_weights(cur, beh, offsets=offsets, mask=mask, threshold="0.5_2.0")
    b = rollout_is_weights(cur, beh, offsets=offsets, mask=mask, threshold=(0.5, 2.0))
    assert torch.equal(a.weights, b.weights) and a.metrics == b.metrics


# ---------------------------------------------------------------------------- verl: RS
RS_CASES = [(mode, "0.6_1.5" if mode.endswith("k1") else 0.1) for mode in RS_MODES] + [
    ("seq_sum_k1", 3.0),  # a lone U means (1/U, U) for k1
    ("seq_max_k3", 1.0),
    ("token_k1,seq_mean_k3,seq_max_k2", "0.4_2.5,0.05,1.0"),
    ("token_k2,token_k2,seq_sum_k2", 0.5),  # a repeated mode counts once
]


@pytest.mark.parametrize(("modes", "thresholds"), RS_CASES)
def test_rejection_mask_equals_verls_compute_rollout_rejection_mask(verl, modes, thresholds):
    cur, beh, offsets, mask = _batch()
    ours = rollout_rejection_mask(
        cur, beh, offsets=offsets, mask=mask, modes=modes, thresholds=thresholds
    )
    pc, m = _padded(cur, offsets, mask)
    pb, _ = _padded(beh, offsets, mask, pad=-3.0)
    keep, metrics = verl.compute_rollout_rejection_mask(
        pc - pb, m, rollout_rs=modes, rollout_rs_threshold=thresholds
    )
    assert torch.equal(ours.keep, _flat(keep, offsets) > 0.5)
    _assert_metrics(ours.metrics, metrics)
    # The fixture rejects something and keeps something under every mode.
    assert 0 < metrics["rollout_rs_masked_fraction"] < 1


def test_rejection_modes_as_a_sequence_equal_the_comma_string():
    cur, beh, offsets, mask = _batch()
    a = rollout_rejection_mask(
        cur, beh, offsets=offsets, mask=mask, modes="token_k1,seq_max_k2", thresholds="0.4_2.5,1"
    )
    b = rollout_rejection_mask(
        cur,
        beh,
        offsets=offsets,
        mask=mask,
        modes=["token_k1", "seq_max_k2"],
        thresholds=[(0.4, 2.5), 1.0],
    )
    assert torch.equal(a.keep, b.keep) and a.metrics == b.metrics


# ---------------------------------------------------------------------------- verl: metrics
@pytest.mark.parametrize("seed", [0, 1])
def test_offpolicy_metrics_equal_verls_compute_offpolicy_metrics(verl, seed):
    cur, beh, offsets, mask = _batch(seed=seed)
    ours = offpolicy_metrics(cur, beh, offsets=offsets, mask=mask)
    pc, m = _padded(cur, offsets, mask)
    pb, _ = _padded(beh, offsets, mask, pad=-3.0)
    theirs = verl.compute_offpolicy_metrics(old_log_prob=pc, rollout_log_prob=pb, response_mask=m)
    _assert_metrics(ours, theirs)


@pytest.mark.parametrize(
    ("level", "threshold", "rs", "rs_threshold"),
    [
        ("token", 2.0, None, None),
        ("sequence", "0.5_2.0", "seq_mean_k3", 0.05),
        (None, 2.0, "token_k1,seq_max_k2", "0.4_2.5,1.0"),
        ("token", "0.5_2.0", "token_k3", 0.2),
    ],
)
def test_rollout_correction_equals_verls_composition(verl, level, threshold, rs, rs_threshold):
    cur, beh, offsets, mask = _batch()
    ours = rollout_correction(
        Ragged(cur, offsets),
        Ragged(beh, offsets),
        mask=mask,
        level=level,
        threshold=threshold,
        rs_modes=rs,
        rs_thresholds=rs_threshold,
    )
    pc, m = _padded(cur, offsets, mask)
    pb, _ = _padded(beh, offsets, mask, pad=-3.0)
    proto, keep, metrics = verl.compute_rollout_correction_and_rejection_mask(
        old_log_prob=pc, rollout_log_prob=pb, response_mask=m, rollout_is=level,
        rollout_is_threshold=threshold, rollout_rs=rs, rollout_rs_threshold=rs_threshold,
    )  # fmt: skip
    assert torch.equal(ours.keep, _flat(keep, offsets) > 0.5)
    if level is None:
        assert proto is None and ours.weights is None
    else:
        assert ours.weights is not None
        expected = _flat(proto.batch["rollout_is_weights"], offsets)
        torch.testing.assert_close(ours.weights, expected, rtol=TOL, atol=TOL)
    _assert_metrics(ours.metrics, metrics)


def test_float32_inputs_match_verl_in_float32(verl):
    cur, beh, offsets, mask = _batch(dtype=torch.float32)
    ours = rollout_is_weights(cur, beh, offsets=offsets, mask=mask, level="sequence")
    assert ours.weights.dtype == torch.float32
    pc, m = _padded(cur, offsets, mask)
    pb, _ = _padded(beh, offsets, mask, pad=-3.0)
    weights, metrics = verl.compute_rollout_correction_weights(pc - pb, m, rollout_is="sequence")
    torch.testing.assert_close(ours.weights, _flat(weights, offsets), rtol=1e-5, atol=1e-5)
    _assert_metrics(ours.metrics, metrics, tol=1e-5)


# ---------------------------------------------------------------------------- TRL
# Per completion, the ratios r_t = π/μ of its tokens; log π = log μ + log r exactly.
TRL_RATIOS = [
    [2.0, 0.25, 5.0],  # sequence ratio 2.5
    [2.0, 2.0],  # sequence ratio 4: above clip_max
    [3.5, 1.25],  # the first token is masked: sequence ratio 1.25
    [float("nan"), 0.8],  # vLLM could not score the first token: sequence ratio 0.8
    [],  # empty: sequence ratio 1
]
TRL_MASK = [True, True, True, True, True, False, True, True, True]


def _trl_fixture():
    rows = [r for r in TRL_RATIOS]
    lengths = torch.tensor([len(r) for r in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ratio = torch.tensor([x for r in rows for x in r], dtype=F64)
    cur = torch.linspace(-2.0, -0.1, int(lengths.sum()), dtype=F64)
    beh = cur - ratio.log()  # NaN where the ratio is NaN
    return cur, beh, offsets, torch.tensor(TRL_MASK)


TRL_EXPECTED = {
    # token modes: a masked token and a NaN behaviour log-prob give r = 1 before clipping.
    ("token_truncate", 3.0, None): [2.0, 0.25, 3.0, 2.0, 2.0, 1.0, 1.25, 1.0, 0.8],
    ("token_truncate", 3.0, 0.5): [2.0, 0.5, 3.0, 2.0, 2.0, 1.0, 1.25, 1.0, 0.8],
    ("token_mask", 3.0, None): [2.0, 0.25, 0.0, 2.0, 2.0, 1.0, 1.25, 1.0, 0.8],
    ("token_mask", 3.0, 0.5): [2.0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.25, 1.0, 0.8],
    ("token_mask", None, 0.9): [2.0, 0.0, 5.0, 2.0, 2.0, 1.0, 1.25, 1.0, 0.0],
    # sequence modes: r_i = exp(Σ_t log r_t) over counted, scorable tokens.
    ("sequence_truncate", 3.0, None): [2.5, 3.0, 1.25, 0.8, 1.0],
    ("sequence_truncate", 2.0, 1.0): [2.0, 2.0, 1.25, 1.0, 1.0],
    ("sequence_mask", 3.0, None): [2.5, 0.0, 1.25, 0.8, 1.0],
    ("sequence_mask", 3.0, 1.0): [2.5, 0.0, 1.25, 0.0, 1.0],
}


@pytest.mark.parametrize(("mode", "clip_max", "clip_min"), list(TRL_EXPECTED))
def test_trl_modes_equal_hand_derived_values(mode, clip_max, clip_min):
    """TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` L2660-2707
    (``_generate_and_score_completions``):

    - ``diff = nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0)``
      with ``mask = completion_mask * tool_mask`` (L2661-2664);
    - sequence modes sum ``diff`` over the completion (L2667-2670), ``ratio = exp(diff)``
      (L2674), not clamped before ``exp``;
    - ``*_truncate``: ``clamp(ratio, clip_min, clip_max)`` (L2680-2685); ``*_mask``: ratios
      outside ``[clip_min, clip_max]`` (None: unbounded) set to 0 (L2686-2702).

    The bounds are ``vllm_importance_sampling_clip_max`` (3.0) and ``..._clip_min`` (None),
    ``trl/trainer/grpo_config.py`` L327-345. The expected values are worked out by hand from
    the per-token ratios of ``TRL_RATIOS`` (products for the sequence modes).
    """
    cur, beh, offsets, mask = _trl_fixture()
    ratio = trl_importance_ratio(
        cur, beh, offsets=offsets, mask=mask, mode=mode, clip_max=clip_max, clip_min=clip_min
    )
    expected = torch.tensor(TRL_EXPECTED[(mode, clip_max, clip_min)], dtype=F64)
    torch.testing.assert_close(ratio, expected, rtol=TOL, atol=TOL)


def test_trl_metrics_equal_hand_derived_values():
    """TRL 1.16.0 ``grpo_trainer.py`` L2860-2893: ``|old - sampling|`` over counted tokens
    that are not NaN (mean, max), and the ratio's min/mean/max over counted tokens (token
    modes) or over every completion (sequence modes)."""
    cur, beh, offsets, mask = _trl_fixture()
    logs = [math.log(x) for x in (2.0, 0.25, 5.0, 2.0, 2.0, 1.25, 0.8)]  # masked, NaN: out
    token = trl_importance_ratio(cur, beh, offsets=offsets, mask=mask, mode="token_truncate")
    got = trl_importance_metrics(cur, beh, token, offsets=offsets, mask=mask)
    counted = [2.0, 0.25, 3.0, 2.0, 2.0, 1.25, 1.0, 0.8]  # the masked 6th token dropped
    expected = {
        "sampling/sampling_logp_difference/mean": sum(abs(x) for x in logs) / len(logs),
        "sampling/sampling_logp_difference/max": math.log(5.0),
        "sampling/importance_sampling_ratio/min": 0.25,
        "sampling/importance_sampling_ratio/mean": sum(counted) / len(counted),
        "sampling/importance_sampling_ratio/max": 3.0,
    }
    _assert_metrics(got, expected)
    seq = trl_importance_ratio(cur, beh, offsets=offsets, mask=mask, mode="sequence_mask")
    got = trl_importance_metrics(cur, beh, seq, offsets=offsets, mask=mask)
    assert got["sampling/importance_sampling_ratio/mean"] == pytest.approx(
        (2.5 + 1.25 + 0.8 + 1) / 5
    )
    assert got["sampling/importance_sampling_ratio/min"] == 0.0


def test_trl_ratio_takes_ragged_rows_like_flat_tensors():
    cur, beh, offsets, mask = _trl_fixture()
    a = trl_importance_ratio(Ragged(cur, offsets), Ragged(beh, offsets), mask=mask)
    b = trl_importance_ratio(cur, beh, offsets=offsets, mask=mask)
    torch.testing.assert_close(a, b, equal_nan=True)


# ---------------------------------------------------------------------------- errors
def test_bad_arguments_raise_compute_errors_naming_the_argument():
    cur, beh, offsets, mask = _batch()
    with pytest.raises(ComputeError, match="mode must be one of"):
        trl_importance_ratio(cur, beh, offsets=offsets, mode="token")  # type: ignore[arg-type]
    with pytest.raises(ComputeError, match="needs clip_max or clip_min"):
        trl_importance_ratio(cur, beh, offsets=offsets, mode="token_truncate", clip_max=None)
    with pytest.raises(ComputeError, match="needs offsets="):
        rollout_is_weights(cur, beh)
    with pytest.raises(ComputeError, match="behaviour_logp: expected"):
        rollout_is_weights(cur, beh[:-1], offsets=offsets)
    with pytest.raises(ComputeError, match="sample 0 has"):
        rollout_is_weights(
            Ragged(cur, offsets), Ragged.from_lengths(beh, [6, 0, 0, 7, 3, 4, 6, 2, 9])
        )
    with pytest.raises(ComputeError, match="lower <= upper"):
        rollout_is_weights(cur, beh, offsets=offsets, threshold="2.0_0.5")
    with pytest.raises(ComputeError, match="unknown rejection mode 'seq_max_k1'"):
        rollout_rejection_mask(cur, beh, offsets=offsets, modes="seq_max_k1", thresholds=2.0)
    with pytest.raises(ComputeError, match="thresholds are required"):
        rollout_rejection_mask(cur, beh, offsets=offsets)
    with pytest.raises(ComputeError, match="expected 1 or 2"):
        rollout_rejection_mask(
            cur, beh, offsets=offsets, modes="token_k2,token_k3", thresholds="1,2,3"
        )
    with pytest.raises(ComputeError, match="one upper bound"):
        rollout_rejection_mask(cur, beh, offsets=offsets, modes="token_k2", thresholds="0.5_2")
    with pytest.raises(ComputeError, match="at least one counted token"):
        offpolicy_metrics(cur, beh, offsets=offsets, mask=torch.zeros_like(mask))


# ---------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_results_equal_cpu_results():
    cur, beh, offsets, mask = _batch()
    kwargs = dict(level="sequence", threshold="0.5_2.0", rs_modes="token_k1,seq_max_k2",
                  rs_thresholds="0.4_2.5,1.0")  # fmt: skip
    cpu = rollout_correction(cur, beh, offsets=offsets, mask=mask, **kwargs)
    gpu = rollout_correction(
        cur.cuda(), beh.cuda(), offsets=offsets.cuda(), mask=mask.cuda(), **kwargs
    )
    assert gpu.weights is not None and cpu.weights is not None
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights, rtol=1e-12, atol=1e-12)
    assert torch.equal(gpu.keep.cpu(), cpu.keep)
    _assert_metrics(gpu.metrics, cpu.metrics, tol=1e-10)
    for mode in ("token_mask", "sequence_truncate"):
        a = trl_importance_ratio(cur, beh, offsets=offsets, mask=mask, mode=mode)
        b = trl_importance_ratio(
            cur.cuda(), beh.cuda(), offsets=offsets.cuda(), mask=mask.cuda(), mode=mode
        )
        torch.testing.assert_close(b.cpu(), a, rtol=1e-12, atol=1e-12)
