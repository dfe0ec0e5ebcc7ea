"""Group math throughput: utilities + advantages + q + MaxEnt weights + moments.

Three figures from the same run, on the same data (float64, 2 reward columns, a reference
per-token mean, prompt-major groups):

- ours: :mod:`maxent_arrow.compute` on (values, offsets), segment ops, no Python loop;
- baseline: the original pipeline's shape, a Python loop over groups building small torch
  tensors per group (``_group_softmax`` per group, lists in between). It is timed on a subset
  of groups and extrapolated linearly to the full batch (the output says so);
- floor: one numpy pass over the same input bytes (a copy of every input array);
- for context (uniform K only): the same math as dense numpy on a ``[P, K]`` reshape, i.e.
  what the arithmetic (two exps, a log, six group reductions) costs in vectorised
  single-threaded code. On CPU it alone is far above 5x the copy floor, so that target needs
  fused kernels (a GPU, or a compiled kernel), which eager torch does not give.

Targets: ours >= 50x faster than the baseline, and <= 5x the floor.

Run ``python benchmarks/bench_compute.py`` (1M samples, K=16 and ragged K; about a minute on
2 cores) or ``--quick`` for a small smoke run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_arrow import Ragged  # noqa: E402
from maxent_arrow import compute as C  # noqa: E402

TAU, BETA, T_Q, EPS = 0.5, 0.1, 2.0, 1e-6
TARGET_VS_LOOP, TARGET_VS_FLOOR = 50.0, 5.0


def make_data(n: int, k: int | None, seed: int = 0):
    rng = np.random.default_rng(seed)
    if k is None:  # ragged: sizes 1..31, mean 16
        sizes = rng.integers(1, 32, size=n // 16 + 64)
        sizes = sizes[: np.searchsorted(np.cumsum(sizes), n) + 1]
    else:
        sizes = np.full(n // k, k)
    total = int(sizes.sum())
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    acc = (rng.random(total) < 0.4).astype(np.float64)
    fmt = rng.random(total)
    rho = rng.uniform(-2.0, -0.05, total)
    return offsets, acc, fmt, rho


def ours(offsets, acc, fmt, rho, device="cpu"):
    off = torch.from_numpy(offsets).to(device)
    a = Ragged(torch.from_numpy(acc).to(device), off, validate=False)
    f = torch.from_numpy(fmt).to(device)
    r = torch.from_numpy(rho).to(device)

    def run():
        utils = C.total_utils({"acc": a, "fmt": f}, [1.0, 0.2])
        adv = C.group_advantages(utils)
        q = C.q_distribution(utils, temperature=T_Q, epsilon=EPS)
        w = C.maxent_weights(q, r, tau=TAU, beta=BETA)
        moments = C.reward_moments(utils)
        return adv, q, w, moments

    return run


def seed_style_loop(offsets, acc, fmt, rho, groups: int):
    """The original's shape: lists, one small torch computation per group."""
    bounds = offsets[: groups + 1].tolist()
    acc_l, fmt_l, rho_l = (x[: bounds[-1]].tolist() for x in (acc, fmt, rho))

    def run():
        stacked = torch.tensor([acc_l, fmt_l], dtype=torch.float32).T
        utils = torch.nansum(stacked * torch.tensor([1.0, 0.2]), dim=1).tolist()
        adv, qs, ws = [], [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            g = torch.tensor(utils[lo:hi], dtype=torch.float32)
            mu = g.mean()
            sd = g.std(unbiased=True) if hi - lo > 1 else torch.tensor(0.0)
            adv.append(((g - mu) / (sd + 1e-4)).tolist())
            k = hi - lo
            soft = torch.softmax(g / T_Q, dim=0)
            q = soft * (1 - k * EPS) + EPS
            q = q / q.sum()
            qs.append(q.tolist())
            ref = torch.tensor(rho_l[lo:hi], dtype=torch.float32)
            logw = (torch.log(q.clamp(min=1e-12)) + BETA * ref) / TAU
            ws.append(torch.softmax(logw, dim=0).tolist())
        u = torch.tensor(utils)
        return adv, qs, ws, (float(u.mean()), float(u.std(unbiased=False)))

    return run


def floor(offsets, acc, fmt, rho):
    arrays = [offsets, acc, fmt, rho]
    dst = [np.empty_like(x) for x in arrays]

    def run():
        for s, d in zip(arrays, dst):
            np.copyto(d, s)

    return run


def numpy_same_math(offsets, acc, fmt, rho):
    """The same math as dense numpy on a [P, K] reshape (uniform K only): what the arithmetic
    itself costs in single-threaded vectorised code, for context beside the copy floor."""
    k = int(offsets[1] - offsets[0])
    p = offsets.size - 1

    def run():
        u = np.nan_to_num(acc * 1.0, nan=0.0) + np.nan_to_num(fmt * 0.2, nan=0.0)
        g = u.reshape(p, k)
        centred = g - g.mean(axis=1, keepdims=True)
        adv = centred / (np.sqrt((centred**2).sum(axis=1, keepdims=True) / (k - 1)) + 1e-4)
        z = g / T_Q
        e = np.exp(z - z.max(axis=1, keepdims=True))
        q = e * ((1 - k * EPS) / e.sum(axis=1, keepdims=True)) + EPS
        logits = (np.log(np.maximum(q, 1e-12)) + BETA * rho.reshape(p, k)) / TAU
        ew = np.exp(logits - logits.max(axis=1, keepdims=True))
        w = ew / ew.sum(axis=1, keepdims=True)
        return adv, q, w, (u.mean(), u.std())

    return run


def best_of(fn, reps: int, sync=None) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return min(times)


def check_agreement(offsets, acc, fmt, rho, groups: int) -> float:
    """Max |w_ours - w_loop| on the first groups (the loop runs in float32)."""
    _, _, w_loop, _ = seed_style_loop(offsets, acc, fmt, rho, groups)()
    _, _, w, _ = ours(offsets, acc, fmt, rho)()
    end = int(offsets[groups])
    flat = np.array([x for g in w_loop for x in g])
    return float(np.abs(w.values[:end].numpy() - flat).max())


def run_case(name: str, n: int, k: int | None, reps: int, loop_groups: int) -> dict:
    offsets, acc, fmt, rho = make_data(n, k)
    groups, total = offsets.size - 1, int(offsets[-1])
    t_ours = best_of(ours(offsets, acc, fmt, rho), reps)
    sub = min(loop_groups, groups)
    t_sub = best_of(seed_style_loop(offsets, acc, fmt, rho, sub), 1)
    t_loop = t_sub * groups / sub
    t_floor = best_of(floor(offsets, acc, fmt, rho), reps)
    nbytes = sum(x.nbytes for x in (offsets, acc, fmt, rho))
    err = check_agreement(offsets, acc, fmt, rho, min(200, groups))
    t_numpy = best_of(numpy_same_math(offsets, acc, fmt, rho), reps) if k else None
    row = {
        "case": name,
        "samples": total,
        "groups": groups,
        "ours_ms": t_ours * 1e3,
        "loop_ms": t_loop * 1e3,
        "floor_ms": t_floor * 1e3,
        "vs_loop": t_loop / t_ours,
        "vs_floor": t_ours / t_floor,
        "loop_note": f"loop timed on {sub} of {groups} groups, extrapolated x{groups / sub:.1f}",
        "bytes": nbytes,
        "max_abs_diff_vs_loop": err,
        "numpy_math_ms": None if t_numpy is None else t_numpy * 1e3,
    }
    if torch.cuda.is_available():
        run = ours(offsets, acc, fmt, rho, device="cuda")
        row["gpu_ms"] = best_of(run, reps, sync=torch.cuda.synchronize) * 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the loop and the numpy floor are single-threaded "
        "too, and on a shared machine OpenMP threads that wait on busy cores run 10-20x slower)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(args.threads, 1))
    n = args.samples or (1 << 16 if args.quick else 1 << 20)
    reps = 2 if args.quick else 5
    loop_groups = 300 if args.quick else 2000
    print(
        f"group math: utilities + advantages + q + weights + moments, float64, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"targets: >= {TARGET_VS_LOOP:.0f}x faster than the per-group loop, "
        f"<= {TARGET_VS_FLOOR:.0f}x the numpy floor"
    )
    ok = True
    for name, k in (("K=16", 16), ("ragged K (1..31)", None)):
        row = run_case(name, n, k, reps, loop_groups)
        met_loop = row["vs_loop"] >= TARGET_VS_LOOP
        met_floor = row["vs_floor"] <= TARGET_VS_FLOOR
        ok &= met_loop
        print(
            f"\n[{row['case']}] {row['samples']:,} samples in {row['groups']:,} groups, "
            f"{row['bytes'] / 2**20:.1f} MiB of input"
        )
        print(f"  ours           {row['ours_ms']:10.2f} ms")
        print(f"  baseline loop  {row['loop_ms']:10.2f} ms   ({row['loop_note']})")
        print(f"  floor (numpy)  {row['floor_ms']:10.2f} ms   (one copy of every input array)")
        if row["numpy_math_ms"] is not None:
            print(
                f"  numpy same math {row['numpy_math_ms']:9.2f} ms   (dense [P, K] numpy, the "
                f"arithmetic alone: {row['numpy_math_ms'] / row['floor_ms']:.1f}x the floor; "
                f"ours is {row['ours_ms'] / row['numpy_math_ms']:.2f}x it)"
            )
        print(
            f"  speed-up vs loop   {row['vs_loop']:8.1f}x   target >= {TARGET_VS_LOOP:.0f}x  "
            f"{'MET' if met_loop else 'MISSED'}"
        )
        print(
            f"  ours / floor       {row['vs_floor']:8.1f}x   target <= {TARGET_VS_FLOOR:.0f}x  "
            f"{'MET' if met_floor else 'MISSED'}"
        )
        print(
            f"  max |w_ours - w_loop| on 200 groups: {row['max_abs_diff_vs_loop']:.2e} "
            "(loop in float32)"
        )
        if "gpu_ms" in row:
            print(
                f"  ours on CUDA   {row['gpu_ms']:10.2f} ms   "
                f"({row['gpu_ms'] / row['floor_ms']:.1f}x the CPU floor)"
            )
        if not math.isfinite(row["ours_ms"]):
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
