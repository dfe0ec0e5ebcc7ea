"""Benchmark: ready-made analytics queries (DuckDB) against pandas over a saved run.

The store: ``--steps`` steps x ``--prompts`` prompts x ``--completions`` completions (default
1000 x 64 x 16 = 1,024,000 completions), one rank, written once with pyarrow directly in the
store's layout (``groups/`` + ``steps/`` commit markers) under a cache directory and reused.
Token ids are stored (1-64 tokens per completion); per-token log-prob columns are left out to
keep generation fast (no query here reads token columns either way).

Queries: the reward curve (mean, std, min, quantiles, max per step, for ``total_utils`` and the
reward function) and completion-length stats (min/mean/max, p50/p95, clipped fraction,
terminated stats). Baseline: pandas, the way users write it today: ``read_parquet`` of the
needed columns, ``explode``, ``groupby``. Floor: a memcpy of the decoded bytes the query needs.

Each query is timed three ways: from Parquet (the query alone), from memory (after
``RunAnalytics.materialize()``, as ``maxent-arrow report`` runs its queries), and end to end
(open + materialize + both queries, against pandas doing both once). ``--steps-per-file 100``
writes the layout ``RolloutStore.compact`` leaves (10 file pairs instead of 1000).

Target: >= 10x faster than pandas. Run ``python benchmarks/bench_analytics.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_arrow.analytics.run import RunAnalytics  # noqa: E402
from maxent_arrow.arrow import schema as S  # noqa: E402
from maxent_arrow.arrow.identity import identity_columns  # noqa: E402
from maxent_arrow.rollout import RolloutBatch  # noqa: E402
from maxent_arrow.store import RolloutStore  # noqa: E402

TARGET = 10.0
MAX_LEN = 64
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _cache_dir() -> Path:
    base = os.environ.get("MAXENT_ARROW_BENCH_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "maxent-arrow-bench"


def _lists(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    item = pa.field("item", values.type, nullable=False)  # list children are non-nullable
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=pa.list_(item))


def generate(
    root: Path, *, steps: int, prompts: int, k: int, per_file: int = 1, seed: int = 0
) -> Path:
    """Write the store once through ``RolloutStore.append`` (group rows built vectorised per
    step); reuse it when its marker exists. ``per_file`` > 1 then compacts it into segments of
    that many steps, as ``RolloutStore.compact`` does."""
    done = root.with_name(root.name + ".complete")
    if done.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    store = RolloutStore.create(root, config={"max_completion_len": MAX_LEN})
    rng = np.random.default_rng(seed)
    schema = S.group_schema()
    pool = pa.array([f"completion text number {i} " * 3 for i in range(257)])
    n = prompts * k
    goff = np.arange(0, n + 1, k)
    t0 = time.perf_counter()
    for step in range(steps):
        lens = rng.integers(1, MAX_LEN + 1, n).astype(np.int32)
        toff = np.concatenate([[0], np.cumsum(lens)])
        token_ids = _lists(toff, pa.array(rng.integers(0, 384, toff[-1], dtype=np.int32)))
        acc = (rng.random(n) < 0.2 + 0.6 * step / max(steps, 1)).astype(np.float64)
        utils = acc + rng.normal(0, 0.05, n)
        u = utils.reshape(prompts, k)
        adv = ((u - u.mean(1, keepdims=True)) / (u.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()
        q = np.exp(u - u.max(1, keepdims=True))
        q = (q / q.sum(1, keepdims=True)).ravel()
        info = pa.StructArray.from_arrays(
            [
                pa.array(np.where(lens >= MAX_LEN, "length", "stop")),
                pa.nulls(n, pa.string()),
                pa.array(lens >= MAX_LEN),
                pa.array(lens),
                pa.nulls(n, pa.string()),
            ],
            fields=list(S.COMPLETION_INFO_TYPE),
        )
        cols = {
            "step": pa.array(np.full(prompts, step, np.int64)),
            "rank": pa.array(np.zeros(prompts, np.int32)),
            **identity_columns(step, 0, "train", np.full(prompts, k)),
            "prompt": pa.array([f"prompt {i}" for i in range(prompts)]),
            "answer": pa.array(["42"] * prompts),
            "prompt_ids": _lists(
                np.arange(0, 8 * prompts + 1, 8),
                pa.array(rng.integers(0, 384, 8 * prompts, dtype=np.int32)),
            ),
            "completions": _lists(goff, pool.take(pa.array(lens))),
            "completion_ids": _lists(goff, token_ids),
            "completion_info": _lists(goff, info),
            "total_utils": _lists(goff, pa.array(utils)),
            "reward_names": _lists(np.arange(prompts + 1), pa.array(["accuracy"] * prompts)),
            "reward_values": _lists(goff, _lists(np.arange(n + 1), pa.array(acc))),
            "advantages": _lists(goff, pa.array(adv)),
            "q": _lists(goff, pa.array(q)),
            "weights": _lists(goff, pa.array(q)),
            "ref_logp_sum_raw": _lists(goff, pa.array(-0.7 * lens.astype(np.float64))),
            "ref_tok_counts": _lists(goff, pa.array(lens)),
        }
        fields = [schema.field(name) for name in cols]
        table = pa.Table.from_arrays(
            list(cols.values()), schema=pa.schema(fields, metadata=schema.metadata)
        )
        row = {f.name: None for f in S.step_schema()}
        row.update(
            step=step,
            rank=0,
            kind="train",
            num_groups=prompts,
            num_samples=n,
            config=f'{{"max_completion_len": {MAX_LEN}}}',
        )
        step_row = pa.Table.from_pylist([row], schema=S.step_schema())
        store.append(RolloutBatch(table, step_row))
    if per_file > 1:
        store.compact(max_steps=per_file)
    done.write_text("ok")
    print(f"generated {root} in {time.perf_counter() - t0:.1f} s")
    return root


# ---------------------------------------------------------------------- pandas baseline


def pandas_reward_curve(root: Path):
    import pandas as pd

    df = pd.read_parquet(root / "groups", columns=["step", "total_utils", "reward_values"])
    df["accuracy"] = df["reward_values"].map(lambda r: [v[0] for v in r])
    out = []
    for col in ("total_utils", "accuracy"):
        long = df[["step", col]].explode(col)
        long[col] = long[col].astype("float64")
        g = long.groupby("step")[col]
        stats = g.agg(["count", "mean", "min", "max"])
        stats["std"] = g.std(ddof=0)
        qs = g.quantile(list(QUANTILES)).unstack()
        out.append(stats.join(qs))
    return pd.concat(out, keys=["total_utils", "accuracy"])


def pandas_length_stats(root: Path):
    import pandas as pd

    df = pd.read_parquet(root / "groups", columns=["step", "ref_tok_counts"])
    long = df.explode("ref_tok_counts")
    long["t"] = long["ref_tok_counts"].astype("float64")
    long["clipped"] = long["t"] >= MAX_LEN
    g = long.groupby("step")["t"]
    stats = g.agg(["count", "min", "mean", "max"])
    stats["p50"] = g.quantile(0.5)
    stats["p95"] = g.quantile(0.95)
    stats["clipped_frac"] = long.groupby("step")["clipped"].mean()
    term = long[~long["clipped"]].groupby("step")["t"].agg(["min", "mean", "max"])
    return stats.join(term.add_suffix("_terminated"))


# ---------------------------------------------------------------------- timing


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def floor_memcpy(root: Path, columns: list[str]) -> float:
    """Time to copy the decoded bytes the query needs (values of its list columns + step)."""
    table = pq.read_table(root / "groups", columns=columns)
    buffers = []
    for name in columns:
        col = table.column(name).combine_chunks()
        while pa.types.is_list(col.type) or pa.types.is_struct(col.type):
            col = col.flatten() if pa.types.is_list(col.type) else col.field(0)
        buffers.append(np.asarray(col))
    return best_of(lambda: [b.copy() for b in buffers], 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (50 steps)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--steps-per-file",
        type=int,
        default=1,
        help="1: one file pair per step (as appended); e.g. 100: as after RolloutStore.compact",
    )
    parser.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: all)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeat = 50, 1
    shape = f"{args.steps}x{args.prompts}x{args.completions}"
    root = generate(
        _cache_dir() / f"analytics-{shape}-per{args.steps_per_file}-v2",
        per_file=args.steps_per_file,
        steps=args.steps,
        prompts=args.prompts,
        k=args.completions,
    )
    size = sum(p.stat().st_size for p in (root / "groups").iterdir())
    n_files = len(os.listdir(root / "groups"))
    print(
        f"store {shape} = {args.steps * args.prompts * args.completions:,} completions, "
        f"{size / 2**20:.0f} MiB of group Parquet, {n_files} files"
    )

    t0 = time.perf_counter()
    run = RunAnalytics(root, threads=args.threads)
    t_open = time.perf_counter() - t0
    t0 = time.perf_counter()
    run.sql("SELECT count(*) FROM steps")  # the step rows are read on first use
    t_steps = time.perf_counter() - t0
    # End to end, as `maxent-arrow report` does it: open, materialize, both queries (step
    # rows included), against pandas doing both queries once.
    t0 = time.perf_counter()
    warm = RunAnalytics(root, threads=args.threads)
    warm.materialize()
    t_mat = time.perf_counter() - t0
    warm.reward_curve()
    warm.length_stats()
    t_session = time.perf_counter() - t0

    # Same answers from both (a benchmark that computes something else proves nothing).
    ours = run.reward_curve().to_pandas()
    base = pandas_reward_curve(root)
    got = ours[ours.reward == "total_utils"].set_index("step")["mean"]
    np.testing.assert_allclose(got.to_numpy(), base.loc["total_utils"]["mean"].to_numpy())
    ours_len = run.length_stats().to_pandas().set_index("step")
    base_len = pandas_length_stats(root)
    np.testing.assert_allclose(ours_len["clipped_frac"], base_len["clipped_frac"])
    np.testing.assert_allclose(ours_len["p95_length"], base_len["p95"])

    rows = []
    cases = [
        (
            "reward curve",
            run.reward_curve,
            warm.reward_curve,
            pandas_reward_curve,
            ["step", "total_utils", "reward_values"],
        ),
        (
            "length stats",
            run.length_stats,
            warm.length_stats,
            pandas_length_stats,
            ["step", "ref_tok_counts"],
        ),
    ]
    for name, ours_fn, warm_fn, base_fn, cols in cases:
        t_ours = best_of(ours_fn, args.repeat)
        t_warm = best_of(warm_fn, args.repeat)
        t_base = best_of(lambda fn=base_fn: fn(root), args.repeat)
        t_floor = floor_memcpy(root, cols)
        rows.append((name, t_ours, t_warm, t_base, t_floor))
    run.close()
    warm.close()

    t_pandas_both = rows[0][3] + rows[1][3]
    print(
        f"\nopening the run (footers of {n_files} files, views): {t_open * 1e3:.0f} ms; "
        f"reading the step rows (first query that needs them): {t_steps * 1e3:.0f} ms; "
        f"open + materializing sample_scalars (one scan of the scalar lists): "
        f"{t_mat * 1e3:.0f} ms\n"
        f"end to end, open + materialize + both queries: {t_session * 1e3:.0f} ms vs pandas "
        f"both queries {t_pandas_both * 1e3:.0f} ms = {t_pandas_both / t_session:.1f}x"
    )
    print(
        f"{'query':<14}{'parquet':>9}{'memory':>9}{'pandas':>9}{'floor':>9}"
        f"{'vs pandas':>11}{'(memory)':>10}{'vs floor':>10}   target >= {TARGET:.0f}x"
    )
    ok = True
    for name, t_ours, t_warm, t_base, t_floor in rows:
        ratio, ratio_warm = t_base / t_ours, t_base / t_warm
        ok &= ratio_warm >= TARGET
        print(
            f"{name:<14}{t_ours * 1e3:>7.0f}ms{t_warm * 1e3:>7.0f}ms{t_base * 1e3:>7.0f}ms"
            f"{t_floor * 1e3:>7.1f}ms{ratio:>10.1f}x{ratio_warm:>9.1f}x{t_warm / t_floor:>9.0f}x"
            f"   {'met' if ratio_warm >= TARGET else 'MISSED'} (memory), "
            f"{'met' if ratio >= TARGET else 'missed'} (from parquet)"
        )
    print(
        "parquet: the query alone, reading the Parquet files; memory: after materialize(), "
        "as the report runs it; pandas: read_parquet + explode + groupby; floor: memcpy of "
        "the decoded bytes the query needs"
    )
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    raise SystemExit(main())
