"""Group math against float64 reference implementations written as plain per-group loops.

The references below follow ``docs/formulas.md`` §3 formula by formula, in Python floats, one group
at a time (the way the original code did it); the library must agree with them on random
ragged groups, K = 1, constant groups, NaN rewards and extreme temperatures.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from maxent_arrow import ComputeError, LayoutError, Ragged, SchemaError
from maxent_arrow import compute as C
from maxent_arrow.compute.segments import shift_mode


# ---------------------------------------------------------------------------- references
def ref_advantages(groups, *, scale=True, eps=1e-4):
    out = []
    for g in groups:
        mu = sum(g) / len(g)
        if not scale:
            out.append([u - mu for u in g])
            continue
        sd = math.sqrt(sum((u - mu) ** 2 for u in g) / (len(g) - 1)) if len(g) > 1 else 0.0
        out.append([(u - mu) / (sd + eps) for u in g])
    return out


def ref_q(groups, *, temperature=1.0, epsilon=1e-6):
    out = []
    t = max(temperature, 1e-8)
    for g in groups:
        k = len(g)
        m = max(u / t for u in g)
        e = [math.exp(u / t - m) for u in g]
        soft = [x / sum(e) for x in e]
        eps = epsilon if k * epsilon < 1 else max(1.0 / k - 1e-8, 0.0)
        mixed = [s * (1 - k * eps) + eps for s in soft]
        out.append([x / sum(mixed) for x in mixed])
    return out


def ref_weights(q_groups, rho_groups, *, tau, beta, denom):
    d = tau + beta if denom == "tau+beta" else tau
    out = []
    for qs, rs in zip(q_groups, rho_groups):
        logits = [(math.log(max(q, 1e-12)) + beta * r) / d for q, r in zip(qs, rs)]
        m = max(logits)
        e = [math.exp(x - m) for x in logits]
        out.append([x / sum(e) for x in e])
    return out


def split(flat, groups):
    out, i = [], 0
    for g in groups:
        out.append(flat[i : i + len(g)])
        i += len(g)
    return out


def random_groups(seed, *, n_groups=40, max_k=9, constant_every=5):
    rng = random.Random(seed)
    groups = []
    for i in range(n_groups):
        k = rng.randint(1, max_k)
        if i % constant_every == 0:
            groups.append([rng.choice([0.0, 1.0, 2.5])] * k)
        else:
            groups.append([rng.gauss(0, 2) for _ in range(k)])
    return groups


def ragged(groups, dtype=torch.float64):
    return Ragged.from_lists(groups, dtype=dtype)


def assert_groups_close(got: Ragged, want, *, rtol=1e-12, atol=1e-12):
    assert got.lengths().tolist() == [len(g) for g in want]
    flat = [x for g in want for x in g]
    torch.testing.assert_close(
        got.values, torch.tensor(flat, dtype=got.values.dtype), rtol=rtol, atol=atol
    )


# ---------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_the_per_group_loop(seed, scale):
    groups = random_groups(seed)
    got = C.group_advantages(ragged(groups), scale_rewards=scale)
    assert_groups_close(got, ref_advantages(groups, scale=scale), rtol=1e-10, atol=1e-12)


def test_single_completion_and_constant_groups_have_zero_advantage():
    groups = [[3.0], [1.0, 1.0, 1.0], [0.0, 1.0]]
    got = C.group_advantages(ragged(groups)).tolist()
    assert got[0] == [0.0] and got[1] == [0.0, 0.0, 0.0]
    # Unbiased std of [0, 1] is sqrt(0.5): A = ±0.5 / (sqrt(0.5) + 1e-4).
    assert got[2][1] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), rel=1e-14)
    zero_eps = C.group_advantages(ragged(groups), eps=0.0).tolist()
    assert zero_eps[1] == [0.0, 0.0, 0.0]


def test_apply_group_scales_multiplies_each_group():
    adv = C.group_advantages(ragged([[0.0, 1.0], [2.0, 4.0, 9.0]]))
    scaled = C.apply_group_scales(adv, torch.tensor([0.5, 2.0], dtype=torch.float64))
    want = [[0.5 * a for a in adv.tolist()[0]], [2.0 * a for a in adv.tolist()[1]]]
    assert_groups_close(scaled, want)


# ---------------------------------------------------------------------------- q
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.05, 1e-9, 0.0, 1e6])
@pytest.mark.parametrize("epsilon", [0.0, 1e-6, 0.01])
def test_q_distribution_matches_the_per_group_loop(temperature, epsilon):
    groups = random_groups(7)
    got = C.q_distribution(ragged(groups), temperature=temperature, epsilon=epsilon)
    assert_groups_close(got, ref_q(groups, temperature=temperature, epsilon=epsilon), atol=1e-12)
    sums = [sum(g) for g in got.tolist()]
    assert sums == pytest.approx([1.0] * len(groups), abs=1e-12)


def test_q_epsilon_is_clamped_when_k_epsilon_reaches_one():
    groups = [[0.0, 5.0, 1.0, 2.0], [1.0]]
    got = C.q_distribution(ragged(groups), epsilon=0.4).tolist()
    assert all(q > 0 for g in got for q in g)
    assert got[1] == [1.0]
    # ε clamps to 1/4 - 1e-8: q is all but uniform.
    assert got[0] == pytest.approx([0.25] * 4, abs=1e-7)
    assert_groups_close(C.q_distribution(ragged(groups), epsilon=0.4), ref_q(groups, epsilon=0.4))


def test_q_at_extreme_temperatures_is_argmax_or_uniform():
    groups = [[0.0, 1.0, 0.5], [3.0, 3.0]]
    cold = C.q_distribution(ragged(groups), temperature=1e-12, epsilon=0.0).tolist()
    assert cold[0] == [0.0, 1.0, 0.0] and cold[1] == [0.5, 0.5]
    hot = C.q_distribution(ragged(groups), temperature=1e12, epsilon=0.0).tolist()
    assert hot[0] == pytest.approx([1 / 3] * 3, abs=1e-11)


def test_q_of_huge_utilities_is_finite():
    got = C.q_distribution(ragged([[1e300, -1e300, 0.0]]), temperature=1e-3)
    assert torch.isfinite(got.values).all()
    assert got.tolist()[0][0] == pytest.approx(1.0 - 2e-6, abs=1e-12)


# ---------------------------------------------------------------------------- weights
@pytest.mark.parametrize("denom", ["tau", "tau+beta"])
@pytest.mark.parametrize("tau,beta", [(0.5, 0.0), (0.4, 0.1), (2.0, 1.5), (1e-3, 0.2)])
def test_maxent_weights_match_the_per_group_loop(denom, tau, beta):
    groups = random_groups(11)
    q = C.q_distribution(ragged(groups), temperature=2.0)
    rng = random.Random(3)
    rho = [rng.uniform(-3.0, -0.1) for _ in range(q.num_values)]
    got = C.maxent_weights(
        q, torch.tensor(rho, dtype=torch.float64), tau=tau, beta=beta, denominator=denom
    )
    want = ref_weights(q.tolist(), split(rho, groups), tau=tau, beta=beta, denom=denom)
    assert_groups_close(got, want, rtol=1e-10, atol=1e-12)


def _objective(w, q, rho, tau, beta, denom):
    entropy = -sum(x * math.log(x) for x in w if x > 0)
    if denom == "tau":
        return sum(x * (math.log(a) + beta * r) for x, a, r in zip(w, q, rho)) + tau * entropy
    z = sum(math.exp(r) for r in rho)
    kl = sum(x * (math.log(x) - (r - math.log(z))) for x, r in zip(w, rho) if x > 0)
    return sum(x * math.log(a) for x, a in zip(w, q)) + tau * entropy - beta * kl


@pytest.mark.parametrize("denom", ["tau", "tau+beta"])
def test_each_convention_maximises_its_own_objective(denom):
    """§3.6: D = τ maximises E_w[ln q + β ρ] + τH(w); D = τ + β maximises
    E_w[ln q] + τH(w) - βKL(w || π_ref). Moving w along the simplex lowers the objective."""
    q = [0.5, 0.3, 0.15, 0.05]
    rho = [-1.0, -2.5, -0.3, -4.0]
    tau, beta = 0.4, 0.3
    w = C.maxent_weights(
        ragged([q]), torch.tensor(rho, dtype=torch.float64), tau=tau, beta=beta, denominator=denom
    ).tolist()[0]
    best = _objective(w, q, rho, tau, beta, denom)
    other = "tau+beta" if denom == "tau" else "tau"
    w_other = C.maxent_weights(
        ragged([q]), torch.tensor(rho, dtype=torch.float64), tau=tau, beta=beta, denominator=other
    ).tolist()[0]
    assert max(abs(a - b) for a, b in zip(w, w_other)) > 1e-3
    assert _objective(w_other, q, rho, tau, beta, denom) < best
    rng = random.Random(0)
    for _ in range(20):
        i, j = rng.sample(range(4), 2)
        step = rng.uniform(-1, 1) * min(w[i], w[j]) * 0.5
        moved = list(w)
        moved[i] += step
        moved[j] -= step
        assert _objective(moved, q, rho, tau, beta, denom) <= best + 1e-15


def test_maxent_weights_sum_reference_with_length_normalisation_and_reweighting():
    groups = [[0.0, 1.0, 2.0], [1.0, 0.5]]
    q = C.q_distribution(ragged(groups))
    sums = [-10.0, -4.0, -30.0, -7.0, -2.0]
    counts = [10, 2, 30, 7, 0]
    mean = [s / max(t, 1) for s, t in zip(sums, counts)]
    got = C.maxent_weights(
        q,
        torch.tensor(sums, dtype=torch.float64),
        tau=0.5,
        beta=0.2,
        token_counts=torch.tensor(counts),
        length_normalize=True,
    )
    want = ref_weights(q.tolist(), split(mean, groups), tau=0.5, beta=0.2, denom="tau")
    assert_groups_close(got, want)
    # [C]: sum reference, then w ∝ w · max(T, 1).
    got = C.maxent_weights(
        q,
        torch.tensor(sums, dtype=torch.float64),
        tau=0.5,
        beta=0.2,
        denominator="tau+beta",
        token_counts=torch.tensor(counts),
        length_reweight=True,
    )
    base = ref_weights(q.tolist(), split(sums, groups), tau=0.5, beta=0.2, denom="tau+beta")
    want = []
    for wg, tg in zip(base, split(counts, groups)):
        scaled = [w * max(t, 1) for w, t in zip(wg, tg)]
        want.append([x / sum(scaled) for x in scaled])
    assert_groups_close(got, want)


def test_weight_entropy_per_group_and_summary():
    w = ragged([[0.5, 0.5], [1.0], [0.25, 0.25, 0.5, 0.0]])
    got = C.weight_entropy(w)
    want = [math.log(2), 0.0, -(0.5 * math.log(0.25) + 0.5 * math.log(0.5))]
    assert got.per_group.tolist() == pytest.approx(want, abs=1e-15)
    assert got.per_group[1].item() == 0.0 and math.copysign(1, got.per_group[1].item()) == 1
    assert (got.mean, got.min, got.max) == pytest.approx((sum(want) / 3, 0.0, max(want)))


# ---------------------------------------------------------------------------- utilities
def test_total_utils_nansum_weights_and_truncation():
    offsets = torch.tensor([0, 2, 5])
    acc = Ragged(torch.tensor([1.0, math.nan, 0.0, 1.0, 1.0], dtype=torch.float64), offsets)
    fmt = torch.tensor([0.5, 0.5, math.nan, 0.0, 0.2], dtype=torch.float64)
    got = C.total_utils(
        {"acc": acc, "fmt": fmt},
        [1.0, 0.5],
        truncated=torch.tensor([False, False, False, False, True]),
    )
    assert isinstance(got, Ragged) and got.offsets.tolist() == [0, 2, 5]
    assert got.values.tolist() == [1.25, 0.25, 0.0, 1.0, 0.0]
    by_name = C.total_utils({"acc": acc, "fmt": fmt}, {"fmt": 0.5, "acc": 1.0})
    assert by_name.values.tolist() == [1.25, 0.25, 0.0, 1.0, 1.1]
    matrix = C.total_utils(torch.stack([acc.values, fmt], 1), [1.0, 0.5])
    assert isinstance(matrix, torch.Tensor) and matrix.tolist() == by_name.values.tolist()


def test_total_utils_zero_weight_times_inf_counts_as_zero_but_inf_is_refused_later():
    vals = {"a": torch.tensor([1.0, math.inf]), "b": torch.tensor([1.0, 1.0])}
    assert C.total_utils(vals, [0.0, 1.0]).tolist() == [1.0, 1.0]
    utils = C.total_utils(vals, [1.0, 1.0], offsets=torch.tensor([0, 1, 2]))
    with pytest.raises(
        ComputeError,
        match=r"group_advantages: utils: expected finite values, "
        r"got inf at group 1, sample 0",
    ):
        C.group_advantages(utils)


def test_dtypes_float64_stays_float64_and_narrow_inputs_compute_in_float32():
    groups = [[0.0, 1.0, 3.0]]
    assert C.group_advantages(ragged(groups, torch.float64)).dtype == torch.float64
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = C.q_distribution(ragged(groups, dtype))
        assert got.dtype == torch.float32
    ints = Ragged.from_lists([[0, 1, 1]], dtype=torch.int64)
    assert C.group_advantages(ints).dtype == torch.float64


# ---------------------------------------------------------------------------- moments, lengths
def test_reward_moments_population_std():
    rng = random.Random(5)
    flat = [rng.gauss(1, 3) for _ in range(57)]
    got = C.reward_moments(ragged([flat[:7], flat[7:]]))
    assert got.mean == pytest.approx(statistics.fmean(flat), rel=1e-13)
    assert got.std == pytest.approx(statistics.pstdev(flat), rel=1e-12)
    one = C.reward_moments(torch.tensor([4.0]))
    assert (one.mean, one.std) == (4.0, 0.0)


def ref_length_stats(counts, cap):
    done = [t for t in counts if t < cap]
    return [
        min(counts),
        sum(counts) / len(counts),
        max(counts),
        sum(t >= cap for t in counts) / len(counts),
        min(done) if done else 0.0,
        sum(done) / len(done) if done else 0.0,
        max(done) if done else 0.0,
    ]


@pytest.mark.parametrize("counts,cap", [([3, 10, 5, 12, 1], 10), ([7, 7], 7), ([2], 100)])
def test_length_stats_matches_reference(counts, cap):
    got = C.length_stats(torch.tensor(counts, dtype=torch.float32), max_completion_len=cap)
    want = ref_length_stats(counts, cap)
    assert [
        getattr(got, f)
        for f in (
            "min_length",
            "mean_length",
            "max_length",
            "clipped_ratio",
            "min_terminated",
            "mean_terminated",
            "max_terminated",
        )
    ] == (pytest.approx(want))


# ---------------------------------------------------------------------------- entropy bonus
def test_entropy_bonus_matches_reference():
    groups = [[1.0, 0.0, 1.0], [0.5], [0.0, 2.0]]
    ent = [4.0, 9.0, 1.0, 3.0, 10.0, 2.0]
    counts = [2, 3, 0, 3, 5, 1]
    got = C.entropy_bonus(ragged(groups), torch.tensor(ent), torch.tensor(counts), coef=0.1)
    flat = [u for g in groups for u in g]
    sigma = statistics.pstdev(flat)
    h = [e / max(t, 1) for e, t in zip(ent, counts)]
    z = []
    for hg in split(h, groups):
        mu = sum(hg) / len(hg)
        sd = math.sqrt(sum((x - mu) ** 2 for x in hg) / len(hg))
        z += [(x - mu) / max(sd, 1e-6) for x in hg]
    assert got.scale == pytest.approx(sigma)
    assert got.per_token.values.tolist() == pytest.approx(h)
    assert got.zscore.values.tolist() == pytest.approx(z, abs=1e-12)
    bonus = [0.1 * sigma * x for x in z]
    assert got.bonus.values.tolist() == pytest.approx(bonus, abs=1e-12)
    assert got.utils.values.tolist() == pytest.approx([u + b for u, b in zip(flat, bonus)])


def test_entropy_bonus_scale_falls_back_to_one_and_nan_z_to_zero():
    got = C.entropy_bonus(
        ragged([[1.0, 1.0]]), torch.tensor([math.nan, 1.0]), torch.tensor([1, 1]), coef=2.0
    )
    assert got.scale == 1.0
    assert got.zscore.values.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------- bad input
def test_errors_name_the_argument_and_group():
    good = ragged([[0.0, 1.0], [2.0]])
    with pytest.raises(
        ComputeError,
        match=r"group_advantages: utils: expected at least one "
        r"group, got an empty batch",
    ):
        C.group_advantages(Ragged(torch.zeros(0), torch.zeros(1, dtype=torch.int64)))
    with pytest.raises(ComputeError, match=r"q_distribution: utils: group 1 is empty \(size 0\)"):
        C.q_distribution(Ragged(torch.zeros(2), torch.tensor([0, 2, 2])))
    with pytest.raises(
        ComputeError,
        match=r"group_advantages: utils: expected finite values, "
        r"got nan at group 1, sample 2 \(value 4\)",
    ):
        C.group_advantages(ragged([[0.0, 1.0], [1.0, 2.0, math.nan]]))
    with pytest.raises(
        ComputeError,
        match=r"q_distribution: temperature: must be finite and "
        r">= 0, got -1.0",
    ):
        C.q_distribution(good, temperature=-1.0)
    with pytest.raises(ComputeError, match=r"q_distribution: epsilon: must be finite and >= 0"):
        C.q_distribution(good, epsilon=-0.1)
    q = C.q_distribution(good)
    for tau in (0.0, -1.0, math.nan):
        with pytest.raises(ComputeError, match=r"maxent_weights: tau: must be finite and > 0"):
            C.maxent_weights(q, torch.zeros(3), tau=tau, beta=0.0)
    with pytest.raises(ComputeError, match=r"maxent_weights: beta: must be finite and >= 0"):
        C.maxent_weights(q, torch.zeros(3), tau=1.0, beta=-0.1)
    with pytest.raises(
        ComputeError,
        match=r"maxent_weights: ref_logp: expected 3 values \(one "
        r"per sample\), got shape \(2,\)",
    ):
        C.maxent_weights(q, torch.zeros(2), tau=1.0, beta=0.1)
    with pytest.raises(
        ComputeError,
        match=r"maxent_weights: ref_logp: group 0 has 1 values, "
        r"expected 2",
    ):
        C.maxent_weights(q, ragged([[0.0], [1.0, 2.0]]), tau=1.0, beta=0.1)
    with pytest.raises(
        ComputeError,
        match=r"maxent_weights: ref_logp: expected finite values, "
        r"got nan at group 1, sample 0",
    ):
        C.maxent_weights(q, torch.tensor([0.0, 0.0, math.nan]), tau=1.0, beta=0.1)
    with pytest.raises(ComputeError, match=r"denominator must be 'tau' or 'tau\+beta', got 'd'"):
        C.maxent_weights(q, torch.zeros(3), tau=1.0, beta=0.1, denominator="d")
    with pytest.raises(ComputeError, match=r"token_counts: required by length_normalize"):
        C.maxent_weights(q, torch.zeros(3), tau=1.0, beta=0.1, length_normalize=True)
    bad = Ragged(torch.zeros(3), torch.tensor([0, 2, 1, 3]), validate=False)
    with pytest.raises(
        LayoutError,
        match=r"group_advantages: utils: offsets must be "
        r"non-decreasing, got 2 then 1 at group 1",
    ):
        C.group_advantages(bad)
    with pytest.raises(
        ComputeError,
        match=r"reward_moments: utils: expected at least one "
        r"sample, got an empty batch",
    ):
        C.reward_moments(torch.zeros(0))
    with pytest.raises(
        ComputeError, match=r"length_stats: max_completion_len: expected an int >= 1, got 0"
    ):
        C.length_stats(torch.tensor([1.0]), max_completion_len=0)
    with pytest.raises(
        ComputeError,
        match=r"length_stats: token_counts: expected counts >= 0, "
        r"got -1.0 at sample 1",
    ):
        C.length_stats(torch.tensor([1.0, -1.0]), max_completion_len=4)
    with pytest.raises(ComputeError, match=r"total_utils: weights: expected 2 weights"):
        C.total_utils({"a": torch.zeros(2), "b": torch.zeros(2)}, [1.0])
    with pytest.raises(
        ComputeError,
        match=r"total_utils: per_reward_values\['b'\]: expected 2 "
        r"values",
    ):
        C.total_utils({"a": torch.zeros(2), "b": torch.zeros(3)}, [1.0, 1.0])
    with pytest.raises(ComputeError, match=r"apply_group_scales: scales: expected 2 values"):
        C.apply_group_scales(good, torch.ones(3))


def test_grouped_views_and_arrow_lists_are_accepted():
    from maxent_arrow import QDistribution

    groups = [[0.0, 1.0], [2.0, 2.0, 5.0]]
    rec = QDistribution(grouped=groups, samples=[x for g in groups for x in g])
    via_view = C.group_advantages(rec.grouped)
    via_arrow = C.group_advantages(rec.column("grouped"))
    assert_groups_close(via_view, ref_advantages(groups))
    assert via_arrow.equal(via_view)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["ragged", "uniform"])
def test_cpu_and_gpu_agree(layout):
    if layout == "ragged":
        groups = random_groups(21, n_groups=300, max_k=17)
    else:  # the dense [P, K] path
        groups = uniform_groups(21, n_groups=300, k=16)
    cpu = ragged(groups)
    gpu = cpu.to("cuda")
    rho = torch.linspace(-3, -0.1, cpu.num_values, dtype=torch.float64)
    for fn in (
        lambda r: C.group_advantages(r),
        lambda r: C.q_distribution(r, temperature=0.7),
        lambda r: C.maxent_weights(
            C.q_distribution(r), rho.to(r.device), tau=0.4, beta=0.1, denominator="tau+beta"
        ),
    ):
        a, b = fn(cpu), fn(gpu)
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.values.cpu(), a.values, rtol=1e-12, atol=1e-12)
    assert C.reward_moments(gpu) == pytest.approx(C.reward_moments(cpu))
    assert C.weight_entropy(gpu).mean == pytest.approx(C.weight_entropy(cpu).mean)


def test_total_utils_promotes_mixed_column_dtypes_to_float64():
    got = C.total_utils(
        {
            "a": torch.tensor([0.1, 0.2], dtype=torch.float32),
            "b": torch.tensor([1e-9, 2.0], dtype=torch.float64),
            "c": torch.tensor([1, 0]),
        },
        [1.0, 1.0, 0.5],
    )
    assert got.dtype == torch.float64
    assert got.tolist() == [float(torch.tensor(0.1)) + 1e-9 + 0.5, float(torch.tensor(0.2)) + 2.0]


@pytest.mark.slow
def test_benchmark_quick_run(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compute.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert "speed-up vs loop" in done.stdout and "ours / floor" in done.stdout, done.stderr
    assert done.stdout.count("max |w_ours - w_loop|") == 2
    diffs = [
        float(line.split(":")[1].split()[0])
        for line in done.stdout.splitlines()
        if "max |w_ours - w_loop|" in line
    ]
    assert all(d < 1e-5 for d in diffs)  # the loop runs in float32


def test_segments_uniform_and_ragged_paths_agree_and_check_offsets():
    from maxent_arrow.compute.segments import Segments

    values = torch.arange(12, dtype=torch.float64)
    uniform = Segments(torch.tensor([0, 4, 8, 12]), num_values=12, where="t")
    ragged_seg = Segments(
        torch.tensor([0, 4, 8, 12, 12]), num_values=12, where="t", allow_empty=True
    )
    assert uniform.width == 4 and ragged_seg.width is None
    per_group = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    a = uniform.apply(torch.mul, values, per_group)
    b = ragged_seg.apply(torch.mul, values, torch.cat([per_group, per_group[:1]]))
    assert a.tolist() == b.tolist() == [v * per_group[v // 4].item() for v in range(12)]
    assert uniform.sum(values).tolist() == [6.0, 22.0, 38.0]
    assert ragged_seg.sum(values).tolist() == [6.0, 22.0, 38.0, 0.0]
    assert uniform.max(values).tolist() == [3.0, 7.0, 11.0]
    assert uniform.locate(9) == (2, 1) and ragged_seg.locate(11) == (2, 3)
    with pytest.raises(LayoutError, match=r"t: offsets end at 12 but there are 13 values"):
        Segments(torch.tensor([0, 12]), num_values=13, where="t")
    with pytest.raises(LayoutError, match=r"t: offsets must start at 0, got 1"):
        Segments(torch.tensor([1, 12]), num_values=12, where="t")
    with pytest.raises(LayoutError, match=r"t: expected int64 offsets"):
        Segments(torch.tensor([0, 12], dtype=torch.int32), num_values=12, where="t")


# ---------------------------------------------------------------------------- fast paths
def uniform_groups(seed, *, n_groups=50, k=8, scale=2.0, shift=0.0):
    rng = random.Random(seed)
    return [[shift + rng.gauss(0, scale) for _ in range(k)] for _ in range(n_groups)]


def test_segments_dense_path_matches_per_group_loops_on_strided_values():
    from maxent_arrow.compute.segments import Segments

    groups = uniform_groups(3, n_groups=7, k=5)
    flat = torch.tensor([x for g in groups for x in g], dtype=torch.float64)
    # Every other value of a longer tensor: the dense view must follow the stride.
    strided = torch.stack([flat, torch.full_like(flat, 1e9)], 1)[:, 0]
    assert not strided.is_contiguous()
    seg = Segments(torch.arange(0, 36, 5), num_values=35, where="t")
    assert seg.width == 5 and seg.max_length == 5 and not seg.has_empty
    assert seg.sum(strided).tolist() == pytest.approx([sum(g) for g in groups], rel=1e-15)
    assert seg.max(strided).tolist() == [max(g) for g in groups]
    assert seg.min(strided).tolist() == [min(g) for g in groups]
    assert seg.mean(strided).tolist() == pytest.approx([sum(g) / 5 for g in groups], rel=1e-15)
    norms = [math.sqrt(sum(x * x for x in g)) for g in groups]
    assert seg.norm(strided).tolist() == pytest.approx(norms, rel=1e-15)
    per_group = torch.arange(7, dtype=torch.float64)
    assert seg.expand(per_group).tolist() == [float(g) for g in range(7) for _ in range(5)]
    assert seg.apply(torch.sub, strided, per_group).tolist() == pytest.approx(
        [x - g for g, grp in enumerate(groups) for x in grp], rel=1e-15
    )
    assert seg.float_lengths(torch.float32) is seg.float_lengths(torch.float32)


def test_segments_ragged_norm_and_apply_match_loops():
    from maxent_arrow.compute.segments import Segments

    groups = [[3.0, 4.0], [1.0], [], [2.0, 2.0, 1.0]]
    values = torch.tensor([x for g in groups for x in g], dtype=torch.float64)
    seg = Segments(torch.tensor([0, 2, 3, 3, 6]), num_values=6, where="t", allow_empty=True)
    assert seg.width is None and seg.has_empty and seg.max_length == 3
    assert seg.norm(values).tolist() == [5.0, 1.0, 0.0, 3.0]
    got = seg.apply(torch.mul, values, torch.tensor([1.0, 10.0, 100.0, -1.0], dtype=torch.float64))
    assert got.tolist() == [3.0, 4.0, 10.0, -2.0, -2.0, -1.0]
    assert values.tolist() == [3.0, 4.0, 1.0, 2.0, 2.0, 1.0]  # the input is left alone


def test_segments_of_reuses_checked_offsets_until_they_change():
    from maxent_arrow.compute.segments import Segments

    offsets = torch.tensor([0, 2, 5])
    values = torch.arange(5, dtype=torch.float64)
    first = Segments.of(Ragged(values, offsets, validate=False), where="t")
    again = Segments.of(Ragged(values * 2, offsets, validate=False), where="t")
    assert again.row_ids is first.row_ids  # derived once, shared
    assert again.lengths.tolist() == [2, 3]
    # Another tensor with equal values is checked on its own (identity, not equality, hits).
    other = Segments.of(Ragged(values, offsets.clone(), validate=False), where="t")
    assert other.row_ids is not first.row_ids and other.row_ids.tolist() == [0, 0, 1, 1, 1]
    # An in-place change of the offsets invalidates the entry: checked again, named again.
    offsets[1] = 3
    assert Segments.of(Ragged(values, offsets, validate=False), where="t").lengths.tolist() == [
        3,
        2,
    ]
    offsets[1] = 6
    with pytest.raises(LayoutError, match=r"u: offsets must be non-decreasing, got 6 then 5"):
        Segments.of(Ragged(values, offsets, validate=False), where="u")
    # A different number of values is a different key: the last offset is checked against it.
    offsets[1] = 2
    with pytest.raises(LayoutError, match=r"v: offsets end at 5 but there are 4 values"):
        Segments.of(Ragged(values[:4], offsets, validate=False), where="v")
    # The cache holds the derived state, not the offsets: it goes when they do, and the
    # caller's tensor carries nothing extra (pickling or copying it is unaffected).
    import gc
    import pickle

    from maxent_arrow.compute import segments as S

    loose = torch.tensor([0, 1, 5])
    Segments.of(Ragged(values, loose, validate=False), where="t")
    assert id(loose) in S._CACHE
    assert not getattr(loose, "__dict__", None)
    assert pickle.loads(pickle.dumps(loose)).tolist() == [0, 1, 5]
    key = id(loose)
    del loose
    gc.collect()
    assert key not in S._CACHE
    # Allowing empty groups once does not allow them for a caller that refuses them.
    holes = torch.tensor([0, 2, 2, 5])
    assert Segments.of(Ragged(values, holes), where="t", allow_empty=True).has_empty
    with pytest.raises(ComputeError, match=r"w: group 1 is empty \(size 0\)"):
        Segments.of(Ragged(values, holes), where="w")


def test_pipeline_on_uniform_groups_matches_the_reference_loops():
    groups = uniform_groups(11, n_groups=60, k=16, scale=1.5)
    r = ragged(groups)
    assert_groups_close(C.group_advantages(r), ref_advantages(groups), rtol=1e-10)
    assert_groups_close(
        C.group_advantages(r, scale_rewards=False), ref_advantages(groups, scale=False)
    )
    q = C.q_distribution(r, temperature=0.7, epsilon=1e-3)
    assert_groups_close(q, ref_q(groups, temperature=0.7, epsilon=1e-3))
    rho = torch.linspace(-4.0, -0.1, r.num_values, dtype=torch.float64)
    for denom in ("tau", "tau+beta"):
        got = C.maxent_weights(q, rho, tau=0.3, beta=0.2, denominator=denom)
        want = ref_weights(q.tolist(), split(rho.tolist(), groups), tau=0.3, beta=0.2, denom=denom)
        assert_groups_close(got, want, rtol=1e-10)


@pytest.mark.parametrize(
    "shift,scale,temperature,mode",
    [
        (0.0, 2.0, 1.0, "none"),  # |U / T| small: exp without any shift
        (5000.0, 20.0, 1.0, "global"),  # far from 0 but a narrow span: one batch-wide shift
        (0.0, 400.0, 0.5, "group"),  # a span beyond the exponent range: per-group maxima
    ],
)
@pytest.mark.parametrize("uniform", [True, False])
def test_q_softmax_shift_modes_all_match_the_reference(shift, scale, temperature, mode, uniform):
    if uniform:
        groups = uniform_groups(7, n_groups=30, k=6, scale=scale, shift=shift)
    else:
        groups = [[shift + x * scale / 2 for x in g] for g in random_groups(7, n_groups=30)]
    flat = [x for g in groups for x in g]
    bottom, top = min(flat) / temperature, max(flat) / temperature
    assert shift_mode(bottom, top, torch.float64) == mode
    got = C.q_distribution(ragged(groups), temperature=temperature, epsilon=1e-6)
    assert_groups_close(got, ref_q(groups, temperature=temperature, epsilon=1e-6))
    # float32 computes in float32: compare with the reference on the float32-rounded inputs.
    narrow = C.q_distribution(ragged(groups, torch.float32), temperature=temperature)
    rounded = [torch.tensor(g, dtype=torch.float32).tolist() for g in groups]
    want = torch.tensor([x for g in ref_q(rounded, temperature=temperature) for x in g])
    torch.testing.assert_close(narrow.values, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rho_scale,beta,mode", [(1.0, 0.3, "none"), (4000.0, 2.0, "group")])
def test_maxent_weights_shift_modes_match_the_reference(rho_scale, beta, mode):
    groups = random_groups(9, n_groups=25)
    q = C.q_distribution(ragged(groups), temperature=1.5)
    rng = random.Random(4)
    rho = [-rho_scale * rng.random() for _ in range(q.num_values)]
    qs = q.values.tolist()
    top = (math.log(max(qs)) + beta * max(rho)) / 0.5
    bottom = (math.log(min(qs)) + beta * min(rho)) / 0.5
    assert shift_mode(bottom, top, torch.float64) == mode
    got = C.maxent_weights(q, torch.tensor(rho, dtype=torch.float64), tau=0.5, beta=beta)
    want = ref_weights(q.tolist(), split(rho, groups), tau=0.5, beta=beta, denom="tau")
    assert_groups_close(got, want, rtol=1e-10)
    # A batch-wide shift: every logit far below 0 (tiny q floored at 1e-12), a narrow span.
    floor_q = Ragged(torch.full((4,), 1e-300, dtype=torch.float64), torch.tensor([0, 2, 4]))
    flat = C.maxent_weights(floor_q, torch.tensor([0.0, -1.0, -2.0, 0.0]), tau=0.01, beta=0.01)
    assert shift_mode(math.log(1e-12) / 0.01 - 2, math.log(1e-12) / 0.01, torch.float64) == (
        "global"
    )
    e = [math.exp(0.0), math.exp(-1.0), math.exp(-2.0), math.exp(0.0)]
    want_flat = [
        e[0] / (e[0] + e[1]),
        e[1] / (e[0] + e[1]),
        e[2] / (e[2] + e[3]),
        e[3] / (e[2] + e[3]),
    ]
    assert flat.values.tolist() == pytest.approx(want_flat, rel=1e-12)


def test_total_utils_clean_and_nan_columns_follow_nansum():
    rng = random.Random(2)
    n = 40
    clean = [rng.random() for _ in range(n)]
    holes = [math.nan if i % 7 == 0 else rng.random() for i in range(n)]
    offsets = torch.tensor([0, 10, 25, 40])
    for columns, lam in (
        ({"clean": clean, "holes": holes}, [0.3, 2.0]),
        ({"holes": holes, "clean": clean}, [2.0, 0.3]),
        ({"clean": clean}, [0.7]),
        ({"holes": holes}, [1.5]),
    ):
        tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in columns.items()}
        got = C.total_utils(tensors, lam, offsets=offsets)
        want = [
            sum(
                0.0 if math.isnan(w * col[i]) else w * col[i]
                for w, col in zip(lam, columns.values())
            )
            for i in range(n)
        ]
        assert got.values.tolist() == pytest.approx(want, rel=1e-15, abs=0)
        assert got.offsets is offsets
    # Inputs are never written to, even the one a clean first column could alias.
    assert tensors["holes"].isnan().sum().item() == 6


def test_reward_moments_and_finite_range_name_the_bad_value():
    from maxent_arrow.compute.segments import Segments, finite_range

    with pytest.raises(
        ComputeError, match=r"reward_moments: utils: expected finite values, got inf at sample 2"
    ):
        C.reward_moments(torch.tensor([1.0, 2.0, math.inf, 3.0]))
    seg = Segments(torch.tensor([0, 2, 4]), num_values=4, where="t")
    values = torch.tensor([1.0, -5.0, 2.0, 7.0], dtype=torch.float64)
    assert finite_range(values, seg, "t") == (-5.0, 7.0)
    with pytest.raises(
        ComputeError, match=r"x: expected finite values, got nan at group 1, sample 1 \(value 3\)"
    ):
        finite_range(torch.tensor([1.0, -5.0, 2.0, math.nan]), seg, "x")
    with pytest.raises(
        ComputeError, match=r"q_distribution: utils: expected finite values, got -inf"
    ):
        C.q_distribution(ragged([[0.0, -math.inf]]))


@pytest.mark.parametrize("uniform", [True, False])
def test_out_buffers_receive_the_same_results(uniform):
    groups = uniform_groups(5, k=8) if uniform else random_groups(5)
    r = ragged(groups)
    n = r.num_values
    rho = torch.linspace(-3.0, -0.2, n, dtype=torch.float64)
    q = C.q_distribution(r, temperature=0.8)
    calls = [
        lambda out: C.group_advantages(r, out=out),
        lambda out: C.group_advantages(r, scale_rewards=False, out=out),
        lambda out: C.q_distribution(r, temperature=0.8, out=out),
        lambda out: C.q_distribution(r, temperature=1e-3, epsilon=0.0, out=out),  # a shift
        lambda out: C.maxent_weights(q, rho, tau=0.3, beta=0.4, out=out),
        lambda out: C.maxent_weights(
            q,
            rho,
            tau=0.3,
            beta=0.4,
            token_counts=torch.arange(n) % 5,
            length_reweight=True,
            out=out,
        ),
    ]
    for call in calls:
        buffer = torch.full((n,), math.nan, dtype=torch.float64)
        got = call(buffer)
        assert got.values.data_ptr() == buffer.data_ptr()
        assert torch.equal(got.values, call(None).values)
        assert got.offsets.tolist() == r.offsets.tolist()


def test_out_buffers_are_checked():
    r = ragged([[0.0, 1.0], [2.0]])
    q = C.q_distribution(r)
    rho = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(
        ComputeError,
        match=r"group_advantages: out: expected a contiguous torch.float64 tensor of shape "
        r"\(3,\) on cpu, got torch.float32 \(3,\) on cpu",
    ):
        C.group_advantages(r, out=torch.zeros(3))
    with pytest.raises(ComputeError, match=r"q_distribution: out: expected a contiguous"):
        C.q_distribution(r, out=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ComputeError, match=r"q_distribution: out: expected a contiguous"):
        C.q_distribution(r, out=torch.zeros(6, dtype=torch.float64)[::2])
    with pytest.raises(ComputeError, match=r"group_advantages: out: shares memory with utils"):
        C.group_advantages(r, out=r.values)
    with pytest.raises(ComputeError, match=r"maxent_weights: out: shares memory with ref_logp"):
        C.maxent_weights(q, rho, tau=1.0, beta=0.1, out=rho)
    with pytest.raises(ComputeError, match=r"maxent_weights: out: shares memory with q"):
        C.maxent_weights(q, rho, tau=1.0, beta=0.1, out=q.values)
    with pytest.raises(ComputeError, match=r"maxent_weights: out: must not require grad"):
        C.maxent_weights(
            q, rho, tau=1.0, beta=0.1, out=torch.zeros(3, dtype=torch.float64, requires_grad=True)
        )
    with pytest.raises(SchemaError, match=r"q_distribution: out: expected a tensor, got list"):
        C.q_distribution(r, out=[0.0, 0.0, 0.0])
    assert rho.tolist() == [0.0, 0.0, 0.0] and r.values.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log2_helper_matches_torch_with_and_without_out(dtype):
    from maxent_arrow.compute.segments import log2

    x = torch.rand(1000, dtype=dtype) + 1e-3
    expected = torch.log2(x)
    assert torch.allclose(log2(x), expected, rtol=4 * torch.finfo(dtype).eps, atol=0)
    out = torch.empty_like(x)
    assert log2(x, out=out) is out
    assert torch.allclose(out, expected, rtol=4 * torch.finfo(dtype).eps, atol=0)
    strided = x[::2]
    assert torch.allclose(log2(strided), torch.log2(strided), rtol=4 * torch.finfo(dtype).eps)


def test_log2_helper_keeps_gradients_through_torch():
    from maxent_arrow.compute.segments import log2

    x = (torch.rand(5, dtype=torch.float64) + 0.5).requires_grad_()
    log2(x).sum().backward()
    assert torch.allclose(x.grad, 1 / (x.detach() * math.log(2)))
