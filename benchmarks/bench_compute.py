"""Group math throughput: utilities + advantages + q + MaxEnt weights + moments.

Figures from the same run, on the same data (float64, 2 reward columns, a reference per-token
mean, prompt-major groups):

- ours: :mod:`maxent_arrow.compute.group_math` on (values, offsets), no Python loop. Every run
  wraps the numpy inputs in fresh tensors (zero-copy), so the offsets are checked and their derived
  state (lengths, row ids) built once per run, as for a new batch; nothing carries over
  between runs. Uniform K takes the dense ``[P, K]`` path, ragged K the segment path;
- baseline: the original pipeline's shape, a Python loop over groups building small torch
  tensors per group (``_group_softmax`` per group, lists in between). It is timed on a subset
  of groups and extrapolated linearly to the full batch (the output says so);
- best peer: the same math as vectorised numpy (a ``[P, K]`` reshape for uniform K,
  ``reduceat``/``repeat`` for ragged K), what a numpy user writes: the arithmetic (two exps,
  a log, six group reductions) in plain single-threaded vectorised code;
- floor: one numpy pass over the same input bytes (a copy of every input array);
- for context: ours again with ``out=`` buffers for advantages, q and weights kept across
  runs (as a training loop can), the three float64 transcendental passes alone, and, last
  (it changes the process's allocator), ours with glibc told to keep freed pages
  (``mallopt``, what ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` do): fresh
  results then page-fault no more.

Why the 5x-floor target is out of reach on CPU: the three float64 transcendental passes alone
(``exp2``, ``log2``, ``exp2``: ~0.4 + 0.65 + 0.4 ms per 1M values on 1 thread, the log in
numpy, whose SIMD log is 3x faster than torch's) cost about 1.5x the copy floor, and the math
needs ~20 other elementwise and reduction passes (~0.15-0.3 ms each); ragged K adds
``segment_reduce`` (~1.2-1.6 ms each) and ``index_select`` passes. On this shared VM a fresh
8 MB result also costs up to ~4 ms in page faults when the C heap has returned its pages to
the kernel (the output prints the average count per run). A fused kernel (a GPU, or a
compiled one) is what the target needs; the row keeps the miss with these figures.

Where ours spends its time (1M float64 samples, 1 thread): the three transcendental passes are
~4 ms of ~13 ms at K=16. The dense ``[P, K]`` reductions of uniform K (``view(P, K).sum(1)``
0.25 ms, ``.amax(1)`` 0.4 ms) beat ``segment_reduce`` (1.1-1.8 ms), and
``torch.std_mean(dim=1)`` (12 ms) and ``torch.softmax(dim=1)`` (9.5 ms) are far slower still
for K=16, their inner loops running along the short K axis; so ``compute.segments`` reduces
uniform groups with plain ``sum`` / ``amax`` along ``dim=1`` and ragged ones with
``segment_reduce``.

Timing: the median of N interleaved runs (``benchmarks/harness.py``). By default torch runs
on 1 thread (``--threads N`` to change it) and each figure is the calling thread's CPU time
(``time.thread_time``), which on a shared machine is far less noisy than wall time (waiting
for a busy core is not counted); median wall times are printed beside it, and with
``--threads`` > 1 the ratios use wall time (thread CPU time would miss the other threads'
work). Ratios compare figures of the same run and the same clock.

Targets: ours >= 50x faster than the baseline, >= 1x the numpy peer, and <= 5x the floor.

Run ``python benchmarks/bench_compute.py [--json PATH]`` (1M samples, K=16 and ragged K;
10-30 s on 2 cores) or ``--quick`` for a small smoke run; exits 1 on a miss (not ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import Figure, faster_than, within  # noqa: E402

from maxent_arrow import Ragged  # noqa: E402
from maxent_arrow import compute as C  # noqa: E402
from maxent_arrow.compute.segments import log2  # noqa: E402

TAU, BETA, T_Q, EPS = 0.5, 0.1, 2.0, 1e-6
TARGET_VS_LOOP, TARGET_VS_FLOOR, TARGET_VS_PEER = 50.0, 5.0, 1.0


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


def ours(offsets, acc, fmt, rho, device="cpu", *, reuse: bool = False):
    """The pipeline over a fresh batch each run; with ``reuse``, advantages, q and weights are
    written into ``out=`` buffers kept across runs (as a training loop can), so those results
    take no fresh pages."""
    if device == "cpu":

        def inputs():  # fresh zero-copy tensors: a new batch, no state from the last run
            return tuple(torch.from_numpy(x) for x in (offsets, acc, fmt, rho))
    else:
        moved = tuple(torch.from_numpy(x).to(device) for x in (offsets, acc, fmt, rho))

        def inputs():  # fresh tensor objects over the device copies
            return tuple(x.view(x.shape) for x in moved)

    buffers = [None] * 3
    if reuse:
        buffers = [torch.empty(acc.size, dtype=torch.float64, device=device) for _ in range(3)]

    def run():
        off, acc_t, f, r = inputs()
        a = Ragged(acc_t, off, validate=False)
        utils = C.total_utils({"acc": a, "fmt": f}, [1.0, 0.2])
        adv = C.group_advantages(utils, out=buffers[0])
        q = C.q_distribution(utils, temperature=T_Q, epsilon=EPS, out=buffers[1])
        w = C.maxent_weights(q, r, tau=TAU, beta=BETA, out=buffers[2])
        moments = C.reward_moments(utils)
        return adv, q, w, moments

    return run


def ours_stages(offsets, acc, fmt, rho) -> dict[str, Callable[[], object]]:
    """Each step alone, over one batch whose offsets were already checked (the steady state
    inside :func:`ours` after its first step)."""
    a = Ragged(torch.from_numpy(acc), torch.from_numpy(offsets), validate=False)
    f, r = torch.from_numpy(fmt), torch.from_numpy(rho)
    utils = C.total_utils({"acc": a, "fmt": f}, [1.0, 0.2])
    q = C.q_distribution(utils, temperature=T_Q, epsilon=EPS)
    return {
        "total_utils": lambda: C.total_utils({"acc": a, "fmt": f}, [1.0, 0.2]),
        "group_advantages": lambda: C.group_advantages(utils),
        "q_distribution": lambda: C.q_distribution(utils, temperature=T_Q, epsilon=EPS),
        "maxent_weights": lambda: C.maxent_weights(q, r, tau=TAU, beta=BETA),
        "reward_moments": lambda: C.reward_moments(utils),
    }


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
    """The same math as vectorised numpy: what the arithmetic itself costs in single-threaded
    vectorised code, for context beside the copy floor. Uniform K: a dense [P, K] reshape;
    ragged K: ``reduceat`` over the offsets and ``repeat`` back to the samples."""
    sizes = np.diff(offsets)
    k = int(sizes[0])
    p = offsets.size - 1
    if not (sizes == k).all():
        return _numpy_ragged_math(offsets, acc, fmt, rho)

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


def _numpy_ragged_math(offsets, acc, fmt, rho):
    starts = offsets[:-1]
    sizes = np.diff(offsets)
    k = sizes.astype(np.float64)

    def per_sample(x):
        return np.repeat(x, sizes)

    def run():
        u = np.nan_to_num(acc * 1.0, nan=0.0) + np.nan_to_num(fmt * 0.2, nan=0.0)
        centred = u - per_sample(np.add.reduceat(u, starts) / k)
        sd = np.sqrt(np.add.reduceat(centred**2, starts) / np.maximum(k - 1, 1))
        sd = np.where(k > 1, sd, 0.0)
        adv = centred / per_sample(sd + 1e-4)
        z = u / T_Q
        e = np.exp(z - per_sample(np.maximum.reduceat(z, starts)))
        eps = np.clip(np.minimum(1.0 / k - 1e-8, EPS), 0.0, None)
        q = e * per_sample((1 - k * eps) / np.add.reduceat(e, starts)) + per_sample(eps)
        logits = (np.log(np.maximum(q, 1e-12)) + BETA * rho) / TAU
        ew = np.exp(logits - per_sample(np.maximum.reduceat(logits, starts)))
        w = ew / per_sample(np.add.reduceat(ew, starts))
        return adv, q, w, (u.mean(), u.std())

    return run


def page_faults(fn, reps: int) -> float | None:
    """Average minor page faults per run (None where ``resource`` is unavailable)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    fn()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(reps):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / reps


def transcendentals(n: int):
    """The three float64 transcendental passes of the math alone (exp2, log2, exp2), in place
    on an ``[n]`` buffer: what no pass-fusing can remove without a fused kernel."""
    x = torch.rand(n, dtype=torch.float64) + 0.5
    y = torch.empty_like(x)

    def run():  # the same inputs every run (in place on x, values would grow to inf)
        torch.exp2(x, out=y)
        log2(y, out=y)
        torch.exp2(y, out=y)

    return run


def check_agreement(offsets, acc, fmt, rho, groups: int) -> float:
    """Max |w_ours - w_loop| on the first groups (the loop runs in float32)."""
    _, _, w_loop, _ = seed_style_loop(offsets, acc, fmt, rho, groups)()
    _, _, w, _ = ours(offsets, acc, fmt, rho)()
    end = int(offsets[groups])
    flat = np.array([x for g in w_loop for x in g])
    return float(np.abs(w.values[:end].numpy() - flat).max())


def run_case(name: str, n: int, k: int | None, reps: int, loop_groups: int, *, cpu: bool) -> dict:
    """Time every figure of one case (medians of interleaved runs); ``cpu`` picks the clock
    the ratios use (thread CPU time, else wall time)."""
    offsets, acc, fmt, rho = make_data(n, k)
    groups, total = offsets.size - 1, int(offsets[-1])
    clock = time.thread_time if cpu else time.perf_counter
    fns = {
        "ours": ours(offsets, acc, fmt, rho),
        "floor": floor(offsets, acc, fmt, rho),
        "reuse": ours(offsets, acc, fmt, rho, reuse=True),
        "numpy": numpy_same_math(offsets, acc, fmt, rho),
        "transcendentals": transcendentals(total),
    }
    # Ours beside the floor; the others each in their own loop: interleaved with the numpy
    # peer's temporaries, the C heap returns its pages between runs and every fresh result
    # page faults again (~8,000 per run instead of ~400), which would bill ours for the peer.
    t = harness.measure({key: fns[key] for key in ("ours", "floor")}, reps, clock=clock)
    for key in ("reuse", "numpy", "transcendentals"):
        t |= harness.measure({key: fns[key]}, reps, clock=clock)
    wall = harness.measure(
        {key: fns[key] for key in ("ours", "reuse", "floor", "numpy")}, max(2, reps // 4)
    )
    faults = page_faults(fns["ours"], reps)
    stages = {
        stage: timing.median
        for stage, timing in harness.measure(
            ours_stages(offsets, acc, fmt, rho), reps, clock=clock
        ).items()
    }
    sub = min(loop_groups, groups)
    t_loop = harness.measure(
        {"loop": seed_style_loop(offsets, acc, fmt, rho, sub)}, max(2, reps // 6), clock=clock
    )["loop"].scaled(groups / sub)
    nbytes = sum(x.nbytes for x in (offsets, acc, fmt, rho))
    err = check_agreement(offsets, acc, fmt, rho, min(200, groups))
    ms = {key: timing.median * 1e3 for key, timing in t.items()}
    row = {
        "case": name,
        "samples": total,
        "groups": groups,
        "timings": t | {"loop": t_loop},
        "ours_ms": ms["ours"],
        "ours_wall_ms": wall["ours"].median * 1e3,
        "faults": faults,
        "reuse_ms": ms["reuse"],
        "reuse_wall_ms": wall["reuse"].median * 1e3,
        "stages_ms": {stage: x * 1e3 for stage, x in stages.items()},
        "loop_ms": t_loop.median * 1e3,
        "loop_wall_ms": t_loop.median * 1e3,
        "floor_ms": ms["floor"],
        "floor_wall_ms": wall["floor"].median * 1e3,
        "numpy_math_ms": ms["numpy"],
        "numpy_math_wall_ms": wall["numpy"].median * 1e3,
        "transcendentals_ms": ms["transcendentals"],
        "vs_loop": t_loop.median / t["ours"].median,
        "vs_floor": t["ours"].median / t["floor"].median,
        "loop_note": f"loop timed on {sub} of {groups} groups, extrapolated x{groups / sub:.1f}",
        "bytes": nbytes,
        "max_abs_diff_vs_loop": err,
    }
    if torch.cuda.is_available():
        run = ours(offsets, acc, fmt, rho, device="cuda")
        gpu = harness.measure({"gpu": run}, reps, sync=torch.cuda.synchronize)["gpu"]
        row["gpu_ms"] = gpu.median * 1e3
    return row


def keep_freed_pages() -> bool:
    """Tell glibc's malloc to keep freed memory (no trim, no mmap for big blocks), as
    ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` would: fresh results then reuse
    mapped pages instead of page-faulting. Process-wide, so run last. False off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_trim_threshold, 2**30) and libc.mallopt(m_mmap_threshold, 2**30))
    except (OSError, AttributeError):
        return False


def kept_pages_case(n: int, k: int | None, reps: int, *, cpu: bool) -> dict[str, harness.Timing]:
    offsets, acc, fmt, rho = make_data(n, k)
    clock = time.thread_time if cpu else time.perf_counter
    return harness.measure(
        {"ours": ours(offsets, acc, fmt, rho), "floor": floor(offsets, acc, fmt, rho)},
        reps,
        clock=clock,
    )


def add_rows(bench: harness.Bench, row: dict, clock: str) -> None:
    t = row["timings"]
    label = f"group math, {row['samples']:,} samples, {row['case']} ({clock})"
    reuse = row["reuse_ms"] / row["floor_ms"]
    transcendental = row["transcendentals_ms"] / row["floor_ms"]
    reason = (
        f"{row['faults']:,.0f} page faults per run on fresh results (glibc returns freed "
        f"pages): into reused `out=` buffers {reuse:.1f}x; the three float64 transcendental "
        f"passes alone are {transcendental:.1f}x the floor, and the other ~20 elementwise and "
        "reduction passes need a fused kernel"
    )
    bench.row(
        label,
        ours=Figure(t["ours"], "`compute` on (values, offsets), fresh batch"),
        baseline=Figure(t["loop"], "per-group Python loop (extrapolated)"),
        peer=Figure(t["numpy"], "the same math in vectorised numpy"),
        floor=Figure(t["floor"], "numpy copy of the inputs"),
        targets=[
            faster_than("baseline", TARGET_VS_LOOP),
            faster_than("peer", TARGET_VS_PEER),
            within("floor", TARGET_VS_FLOOR),
        ],
        reason=reason,
        note=f"advantages + q + weights + moments, float64; {row['faults']:,.0f} page faults "
        "per run"
        if row["faults"] is not None
        else "",
    )
    bench.row(
        f"same, {row['case']}, `out=` buffers reused",
        ours=Figure(t["reuse"], "advantages, q, weights into buffers kept across runs"),
        floor=Figure(t["floor"], "numpy copy of the inputs"),
        note="context",
        detail=True,
    )


def print_case(row: dict, clock: str) -> tuple[bool, bool]:
    """Print one case; returns whether each target was met."""
    met_loop = row["vs_loop"] >= TARGET_VS_LOOP
    met_floor = row["vs_floor"] <= TARGET_VS_FLOOR

    def line(label: str, key: str, note: str = "") -> None:
        print(
            f"  {label:<17}{row[key]:10.2f} ms  (wall {row[key.replace('_ms', '_wall_ms')]:8.2f})"
            f"{'   ' + note if note else ''}"
        )

    print(
        f"\n[{row['case']}] {row['samples']:,} samples in {row['groups']:,} groups, "
        f"{row['bytes'] / 2**20:.1f} MiB of input; {clock}"
    )
    line("ours", "ours_ms", "(fresh batch tensors every run)")
    if row["faults"] is not None:
        print(
            f"    {row['faults']:,.0f} minor page faults per run on average (fresh result pages "
            "the kernel zeroes; how many varies run to run with the C heap's state)"
        )
    for stage, ms in row["stages_ms"].items():
        print(f"    {stage:<19}{ms:8.2f} ms")
    line(
        "ours, out= reused",
        "reuse_ms",
        f"(context: advantages, q, weights into buffers kept across runs, "
        f"{row['reuse_ms'] / row['floor_ms']:.1f}x the floor)",
    )
    line("baseline loop", "loop_ms", f"({row['loop_note']})")
    line("floor (numpy)", "floor_ms", "(one copy of every input array)")
    line(
        "numpy same math",
        "numpy_math_ms",
        f"(the best peer: vectorised numpy, {row['numpy_math_ms'] / row['floor_ms']:.1f}x "
        f"the floor; ours is {row['ours_ms'] / row['numpy_math_ms']:.2f}x it)",
    )
    print(
        f"  transcendentals   {row['transcendentals_ms']:8.2f} ms   (exp2, log2, exp2 alone: "
        f"{row['transcendentals_ms'] / row['floor_ms']:.1f}x the floor)"
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
            f"  ours on CUDA   {row['gpu_ms']:10.2f} ms wall  "
            f"({row['gpu_ms'] / row['floor_wall_ms']:.1f}x the CPU floor's wall time)"
        )
    return met_loop, met_floor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_arguments(parser)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None, help="runs per figure (median)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the loop and the numpy floor are single-threaded "
        "too, and on a shared machine OpenMP threads that wait on busy cores run 10-20x slower)",
    )
    args = parser.parse_args(argv)
    bench = harness.Bench("compute", args)
    torch.set_num_threads(max(args.threads, 1))
    threads = torch.get_num_threads()
    n = args.samples or (1 << 16 if args.quick else 1 << 20)
    reps = args.reps or bench.repeats(21, 3)
    loop_groups = 300 if args.quick else 2000
    cpu = threads == 1
    clock = (
        f"median of {reps}, thread CPU time (wall beside)"
        if cpu
        else f"median of {reps}, wall time (several threads)"
    )
    print(
        f"group math: utilities + advantages + q + weights + moments, float64, "
        f"torch {torch.__version__}, {threads} thread{'s' if threads > 1 else ''}"
        f"{' (the default; --threads N to change)' if threads == 1 else ''}"
    )
    print(
        f"targets: >= {TARGET_VS_LOOP:.0f}x faster than the per-group loop, "
        f">= {TARGET_VS_PEER:.0f}x the numpy peer, "
        f"<= {TARGET_VS_FLOOR:.0f}x the numpy floor (one copy of the input bytes)"
    )
    for name, k in (("K=16", 16), ("ragged K (1..31)", None)):
        row = run_case(name, n, k, reps, loop_groups, cpu=cpu)
        print_case(row, clock)
        if not math.isfinite(row["ours_ms"]):
            raise SystemExit(f"{name}: no finite figure for ours")
        add_rows(bench, row, "1 thread, CPU time" if cpu else f"{threads} threads, wall time")
    if keep_freed_pages():  # last: it changes the allocator of the whole process
        for name, k in (("K=16", 16), ("ragged K (1..31)", None)):
            t = kept_pages_case(n, k, reps, cpu=cpu)
            print(
                f"[{name}] with glibc keeping freed pages: ours {t['ours'].median * 1e3:.2f} ms, "
                f"{t['ours'].median / t['floor'].median:.1f}x the floor"
            )
            bench.row(
                f"same, {name}, glibc keeping freed pages (`mallopt`, as "
                "`MALLOC_TRIM_THRESHOLD_` does)",
                ours=Figure(t["ours"], "`compute`, fresh batch, no page faults"),
                floor=Figure(t["floor"], "numpy copy of the inputs"),
                note="context: what the allocator setting buys",
                detail=True,
            )
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
