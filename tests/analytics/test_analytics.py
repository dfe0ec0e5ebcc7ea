"""Analytics over a saved run: DuckDB views and the ready-made queries.

Stores are written in the test (Parquet files in the agreed layout, built from
``schema.group_schema``), and every query result is checked against values computed
independently with numpy from the data the test generated.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxent_arrow.analytics.run import RunAnalytics
from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import LayoutError, QueryError, StoreError
from maxent_arrow.store.storage.names import unit_name, unit_of
from maxent_arrow.store.store import RolloutStore
from maxent_arrow.testing import Written, unit_path, write_store

BUCKETS = list(S.KL_LENGTH_BUCKETS)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Written:
    return write_store(tmp_path_factory.mktemp("run") / "store", eval_steps=(1, 3))


@pytest.fixture(scope="module")
def run(store):
    with RunAnalytics(store.root, threads=1) as analytics:
        yield analytics


def _pop_std(x):
    return float(np.std(x)) if len(x) else None


# ---------------------------------------------------------------------- views and files


def test_uncommitted_and_temporary_files_are_invisible(tmp_path):
    w = write_store(tmp_path / "s", steps=range(2), ranks=1)
    # An in-flight write and a group file whose commit marker (step file) is missing.
    src = unit_path(RolloutStore(w.root), "groups", 0)
    (tmp_path / "s" / "groups" / ".tmp-abc.parquet").write_bytes(src.read_bytes())
    temp = f".{unit_name(2, 0, 'train')}.tmp-host.1.abc"
    (tmp_path / "s" / "groups" / temp).write_bytes(src.read_bytes())
    (tmp_path / "s" / "groups" / unit_name(7, 0, "train")).write_bytes(src.read_bytes())
    (tmp_path / "s" / "steps" / ".tmp-x.parquet").write_bytes(b"garbage")
    files = RolloutStore(w.root).committed_files("groups")
    assert [unit_of(f.name) for f in files] == [unit_name(0, 0, "train"), unit_name(1, 0, "train")]
    with RunAnalytics(w.root) as run:
        got = run.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py()
        assert got == len(w.groups)


def test_samples_view_one_row_per_completion_aligned(run, store):
    t = run.sql(
        "SELECT step, rank, kind, group_index, sample_index, completion, total_util, advantage, "
        "weight, ref_tok_count, token_count, truncated, completion_ids, "
        "reward_values[list_position(reward_names, 'accuracy')] AS acc, reward_accuracy "
        "FROM samples ORDER BY kind, step, rank, group_index, sample_index"
    ).to_pylist()
    expected = sorted(store.groups, key=lambda g: (g.kind, g.step, g.rank, g.index))
    flat = [(g, i) for g in expected for i in range(len(g.utils))]
    assert len(t) == len(flat)
    for row, (g, i) in zip(t, flat):
        assert (row["step"], row["rank"], row["kind"], row["group_index"]) == (
            g.step,
            g.rank,
            g.kind,
            g.index,
        )
        assert row["sample_index"] == i
        assert row["completion"] == g.completions[i]
        assert row["total_util"] == g.utils[i]
        assert row["advantage"] == g.adv[i]
        assert row["weight"] == g.w[i]
        assert row["ref_tok_count"] == row["token_count"] == g.lens[i]
        assert len(row["completion_ids"]) == g.lens[i]
        assert row["truncated"] == bool(g.truncated[i])
        assert row["acc"] == row["reward_accuracy"] == g.rewards["accuracy"][i]


def test_scalar_queries_never_read_token_columns(run):
    queries = [
        "SELECT step, avg(total_util) FROM samples GROUP BY step",
        "SELECT step, avg(ref_tok_count) FROM samples GROUP BY step",
    ]
    for q in queries:
        plan = run.explain(q)
        assert "READ_PARQUET" in plan.upper()
        for col in S.PER_TOKEN_COLUMNS:
            assert col not in plan, (q, col)
    # The positive control: a query that does use a token column shows it in the plan.
    assert "completion_ids" in run.explain("SELECT len(completion_ids) FROM samples")


def test_ready_made_queries_read_only_their_columns(run, monkeypatch):
    seen = []
    original = run.rel.sql

    def spy(query, params=None):
        seen.append(run.explain(query))
        return original(query, params)

    monkeypatch.setattr(run.rel, "sql", spy)
    run.reward_curve()
    run.length_stats()
    run.success_rate(k=(1, 2))
    run.zero_variance_groups()
    run.entropy_curve()
    run.advantage_histogram()
    run.extreme_completions(0)
    assert seen
    for plan in seen:
        for col in S.PER_TOKEN_COLUMNS:
            assert col not in plan


# ---------------------------------------------------------------------- queries vs numpy


def test_reward_curve_matches_numpy(run, store):
    t = run.reward_curve().to_pylist()
    by = {(r["step"], r["reward"]): r for r in t}
    for step, groups in store.by_step().items():
        for name, values in [
            ("total_utils", np.concatenate([g.utils for g in groups])),
            ("accuracy", np.concatenate([g.rewards["accuracy"] for g in groups])),
        ]:
            r = by[(step, name)]
            assert r["n"] == values.size
            assert r["mean"] == pytest.approx(values.mean(), rel=1e-12)
            assert r["std"] == pytest.approx(values.std(), rel=1e-9, abs=1e-12)
            assert r["min"] == values.min() and r["max"] == values.max()
            for q, col in [(0.05, "p05"), (0.25, "p25"), (0.5, "p50"), (0.95, "p95")]:
                assert r[col] == pytest.approx(np.quantile(values, q), rel=1e-12, abs=1e-12)
    assert len(t) == 2 * len(store.by_step())
    # The total-reward mean agrees with the moments the writer stored in the step rows.
    steps = run.sql(
        "SELECT step, sum(reward_mean * num_samples) / sum(num_samples) AS m FROM steps "
        "WHERE kind = 'train' GROUP BY step"
    ).to_pylist()
    for row in steps:
        assert by[(row["step"], "total_utils")]["mean"] == pytest.approx(row["m"])


def test_reward_curve_eval_kind(run, store):
    t = run.reward_curve(kind="eval")
    assert sorted(set(t.column("step").to_pylist())) == [1, 3]
    got = {r["step"]: r["mean"] for r in t.to_pylist() if r["reward"] == "total_utils"}
    for step, groups in store.by_step("eval").items():
        assert got[step] == pytest.approx(np.concatenate([g.utils for g in groups]).mean())


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_success_rate_and_unbiased_pass_at_k(run, store):
    t = {
        r["step"]: r
        for r in run.success_rate(threshold=0.5, k=(1, 2, 4), reward="accuracy").to_pylist()
    }
    for step, groups in store.by_step().items():
        r = t[step]
        succ = [g.rewards["accuracy"] > 0.5 for g in groups]
        assert r["num_groups"] == len(groups)
        assert r["num_samples"] == sum(len(s) for s in succ)
        assert r["success_rate"] == pytest.approx(np.concatenate(succ).mean())
        assert r["group_success_rate"] == pytest.approx(np.mean([s.any() for s in succ]))
        for k in (1, 2, 4):
            vals = [_pass_at_k(len(s), int(s.sum()), k) for s in succ if len(s) >= k]
            if vals:
                assert r[f"pass_at_{k}"] == pytest.approx(np.mean(vals), rel=1e-9)
            else:
                assert r[f"pass_at_{k}"] is None
    # pass@1 is the mean per-group success rate.
    for step, groups in store.by_step().items():
        per_group = [(g.rewards["accuracy"] > 0.5).mean() for g in groups]
        assert t[step]["pass_at_1"] == pytest.approx(np.mean(per_group))


def test_zero_variance_groups(run, store):
    t = {r["step"]: r for r in run.zero_variance_groups().to_pylist()}
    for step, groups in store.by_step().items():
        zero = [np.ptp(g.utils) <= 1e-8 for g in groups]
        assert t[step]["num_groups"] == len(groups)
        assert t[step]["zero_variance_groups"] == sum(zero)
        assert t[step]["frac_zero_variance"] == pytest.approx(np.mean(zero))
        assert sum(zero) >= len({g.rank for g in groups})  # the writer made one per rank


@pytest.mark.parametrize("cap", [None, 20])
def test_length_stats(run, store, cap):
    t = {r["step"]: r for r in run.length_stats(max_completion_len=cap).to_pylist()}
    limit = cap if cap is not None else 24  # from the step rows' config
    for step, groups in store.by_step().items():
        lens = np.concatenate([g.lens for g in groups]).astype(float)
        term = lens[lens < limit]
        r = t[step]
        assert r["n"] == lens.size
        assert (r["min_length"], r["max_length"]) == (lens.min(), lens.max())
        assert r["mean_length"] == pytest.approx(lens.mean())
        assert r["p50_length"] == pytest.approx(np.quantile(lens, 0.5))
        assert r["p95_length"] == pytest.approx(np.quantile(lens, 0.95))
        assert r["clipped_frac"] == pytest.approx((lens >= limit).mean())
        assert r["mean_terminated"] == pytest.approx(term.mean() if term.size else None)
        assert r["max_terminated"] == (term.max() if term.size else None)


def test_entropy_curve(run, store):
    t = {r["step"]: r for r in run.entropy_curve().to_pylist()}
    for step, groups in store.by_step().items():
        hq = np.array([-(g.q[g.q > 0] * np.log(g.q[g.q > 0])).sum() for g in groups])
        hw = np.array([-(g.w[g.w > 0] * np.log(g.w[g.w > 0])).sum() for g in groups])
        r = t[step]
        assert r["q_entropy_mean"] == pytest.approx(hq.mean(), abs=1e-12)
        assert r["q_entropy_std"] == pytest.approx(hq.std(), abs=1e-9)
        assert r["q_entropy_max"] == pytest.approx(hq.max(), abs=1e-12)
        assert r["weight_entropy_mean"] == pytest.approx(hw.mean(), abs=1e-12)
        assert r["weight_entropy_min"] == pytest.approx(hw.min(), abs=1e-12)


def test_kl_by_length_bucket(run, store):
    t = run.kl_by_length_bucket().to_pylist()
    expected = {}
    for step in sorted({r["step"] for r in store.step_rows if r["kind"] == "train"}):
        rows = [r for r in store.step_rows if r["step"] == step and r["kind"] == "train"]
        for b in BUCKETS:
            pairs = []
            for r in rows:
                labels = r["kl_length_buckets"]
                kl = dict(zip(labels, r["kl_per_token_by_len_bucket"]))
                cnt = dict(zip(labels, r["kl_token_count_by_len_bucket"] or []))
                if b in kl:
                    pairs.append((kl[b], cnt.get(b)))
            if not pairs:
                continue
            counts = np.array([c or 0.0 for _, c in pairs])
            values = np.array([v for v, _ in pairs])
            kl_b = (values * counts).sum() / counts.sum() if counts.sum() > 0 else values.mean()
            expected[(step, b)] = (
                kl_b,
                counts.sum() if any(c is not None for _, c in pairs) else None,
            )
    assert [(r["step"], r["bucket"]) for r in t] == list(expected)
    for r in t:
        kl_b, tokens = expected[(r["step"], r["bucket"])]
        assert r["kl_per_token"] == pytest.approx(kl_b)
        assert r["tokens"] == (pytest.approx(tokens) if tokens is not None else None)
        assert r["bucket_order"] == BUCKETS.index(r["bucket"])


@pytest.mark.parametrize("steps", [None, [0, 2]])
def test_advantage_histogram_matches_numpy(run, store, steps):
    t = run.advantage_histogram(bins=7, steps=steps)
    adv = np.concatenate([g.adv for g in store.train() if steps is None or g.step in steps])
    counts, edges = np.histogram(adv, bins=7)
    assert t.column("count").to_pylist() == counts.tolist()
    np.testing.assert_allclose(t.column("bin_left").to_numpy(), edges[:-1])
    np.testing.assert_allclose(t.column("bin_right").to_numpy(), edges[1:])


def test_extreme_completions(run, store):
    step = 2
    t = run.extreme_completions(step, n=3).to_pylist()
    flat = [
        (g.utils[i], g.rank, g.index, i, g.completions[i])
        for g in store.by_step()[step]
        for i in range(len(g.utils))
    ]
    best = sorted(flat, key=lambda x: (-x[0], x[1], x[2], x[3]))[:3]
    worst = sorted(flat, key=lambda x: (x[0], x[1], x[2], x[3]))[:3]
    got_best = [r for r in t if r["which"] == "best"]
    got_worst = [r for r in t if r["which"] == "worst"]
    assert [
        (r["score"], r["rank"], r["group_index"], r["sample_index"], r["completion"])
        for r in got_best
    ] == best
    assert [
        (r["score"], r["rank"], r["group_index"], r["sample_index"], r["completion"])
        for r in got_worst
    ] == worst
    assert [r["position"] for r in got_best] == [1, 2, 3]
    assert all(r["step"] == step for r in t)


def test_eval_rows(run, store):
    t = run.eval_rows()
    expected = sorted((r["step"], r["rank"]) for r in store.step_rows if r["kind"] == "eval")
    assert list(zip(t.column("step").to_pylist(), t.column("rank").to_pylist())) == expected
    assert set(t.column("kind").to_pylist()) == {"eval"}


def test_describe(run, store):
    d = run.describe()
    assert d["schema_version"] == S.SCHEMA_VERSION
    assert d["ranks"] == [0, 1]
    assert d["kinds"]["train"]["steps"] == 4
    assert d["kinds"]["eval"]["steps"] == 2
    assert d["group_rows"] == len(store.groups)
    assert d["kinds"]["train"]["samples"] == sum(len(g.utils) for g in store.train())
    assert d["bytes"]["groups"] == sum(p.stat().st_size for p in (store.root / "groups").iterdir())
    assert d["config"]["max_completion_len"] == 24


# ---------------------------------------------------------------------- schema evolution


@pytest.mark.parametrize("materialize", [False, True])
def test_two_schema_versions_queried_as_one(tmp_path, materialize):
    # A reward function added at step 2; steps 0-1 were written by an older writer without
    # the `weights` and `policy_entropy_sum` columns.
    w = write_store(
        tmp_path / "s",
        rewards_at=lambda s: ["accuracy"] if s < 2 else ["accuracy", "format"],
        drop_at=lambda s: ("weights", "policy_entropy_sum") if s < 2 else (),
    )
    with RunAnalytics(w.root, materialize=materialize) as run:
        assert run.reward_names == ["accuracy", "format"]
        curve = run.reward_curve().to_pylist()
        fmt_steps = sorted(r["step"] for r in curve if r["reward"] == "format")
        assert fmt_steps == [2, 3]
        for r in curve:
            if r["reward"] == "format":
                vals = np.concatenate([g.rewards["format"] for g in w.by_step()[r["step"]]])
                assert r["mean"] == pytest.approx(vals.mean())
        ent = {r["step"]: r for r in run.entropy_curve().to_pylist()}
        assert ent[0]["weight_entropy_mean"] is None and ent[3]["weight_entropy_mean"] > 0
        assert ent[0]["q_entropy_mean"] > 0
        s = run.sql(
            "SELECT step, count(*) AS n, count(weight) AS w, count(reward_format) AS f "
            "FROM samples GROUP BY step ORDER BY step"
        ).to_pylist()
        for row in s:
            n = sum(len(g.utils) for g in w.groups if g.step == row["step"])
            assert row["n"] == n
            assert row["w"] == (0 if row["step"] < 2 else n)
            assert row["f"] == (0 if row["step"] < 2 else n)


def test_a_file_changed_after_its_commit_is_refused_by_name(tmp_path):
    w = write_store(tmp_path / "s", steps=range(2), ranks=1)
    path = unit_path(RolloutStore(w.root), "groups", 1)
    t = pq.read_table(path)
    t = t.set_column(
        t.column_names.index("group_index"),
        "group_index",
        t.column("group_index").cast(pa.string()),
    )
    pq.write_table(t, path)
    with pytest.raises(StoreError, match=path.name):
        RunAnalytics(w.root)


def test_empty_store_has_typed_views(tmp_path):
    RolloutStore.create(tmp_path / "e")
    with RunAnalytics(tmp_path / "e") as run:
        assert run.reward_curve().num_rows == 0
        assert run.length_stats().num_rows == 0
        assert run.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py() == 0
        assert run.advantage_histogram(bins=3).column("count").to_pylist() == [0, 0, 0]


def test_bad_arguments_are_typed_errors(run, tmp_path):
    with pytest.raises(LayoutError, match="kind"):
        run.reward_curve(kind="train'; DROP TABLE x; --")
    assert run.reward_curve(kind="rollout").num_rows == 0  # a valid kind this run lacks
    with pytest.raises(LayoutError, match="nope"):
        run.extreme_completions(0, by="nope")
    with pytest.raises(LayoutError, match="k"):
        run.success_rate(k=(0,))
    # A column the views lack is the user's mistake (a binder error), said in full.
    with pytest.raises(QueryError, match="no_such_column.*Candidate bindings"):
        run.sql("SELECT no_such_column FROM groups")
    with pytest.raises(StoreError, match="no such store"):
        RunAnalytics(tmp_path / "missing")


def test_materialized_answers_equal_parquet_answers(store):
    with RunAnalytics(store.root) as cold, RunAnalytics(store.root, materialize=True) as warm:
        assert warm.materialized and not cold.materialized
        n = warm.sql("SELECT count(*) AS n FROM sample_scalars").column("n")[0].as_py()
        assert n == sum(len(g.utils) for g in store.groups)
        # The materialized path is really taken (the plan scans the table, not Parquet).
        assert (
            "READ_PARQUET"
            not in warm.explain(
                f"SELECT * FROM {warm.rel.flat(['total_util'], kind='train')}"
            ).upper()
        )
        for name, kwargs in [
            ("reward_curve", {}),
            ("success_rate", {"threshold": 0.5, "k": (1, 3)}),
            ("zero_variance_groups", {}),
            ("length_stats", {}),
            ("length_stats", {"max_completion_len": 10}),
            ("entropy_curve", {}),
            ("advantage_histogram", {"bins": 5}),
            ("reward_curve", {"kind": "eval"}),
        ]:
            a = getattr(cold, name)(**kwargs)
            b = getattr(warm, name)(**kwargs)
            assert a.column_names == b.column_names, name
            for col in a.column_names:
                x, y = a.column(col).to_pylist(), b.column(col).to_pylist()
                assert (
                    x == pytest.approx(y, rel=1e-12, abs=1e-12)
                    if isinstance(x[0], float)
                    else x == y
                ), (name, col)


def test_a_directory_without_a_manifest_is_not_a_store(tmp_path, store):
    # The same files copied without manifest.json are refused, not read as some store, and the
    # error points at the store one level down when there is one.
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(store.root / "groups", bare / "groups")
    shutil.copytree(store.root / "steps", bare / "steps")
    with pytest.raises(StoreError, match="not a rollout store"):
        RunAnalytics(bare)
    with pytest.raises(StoreError, match="did you mean"):
        RunAnalytics(store.root.parent)
    with pytest.raises(StoreError, match="no such store"):
        RunAnalytics(tmp_path / "missing")
    assert sorted(p.name for p in bare.iterdir()) == ["groups", "steps"]  # nothing created


@pytest.mark.slow
def test_benchmark_quick_runs(tmp_path):
    import os
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_analytics.py"
    env = {**os.environ, "MAXENT_ARROW_BENCH_CACHE": str(tmp_path)}
    out = tmp_path / "analytics.json"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    names = [r["name"] for r in rows]
    for store in ("40 files", "100 files", "100 steps, writer policy (compact_every=100)"):
        for kind in ("sql() over samples", "reward_curve + length_stats from files"):
            row = next(r for r in rows if kind in r["name"] and r["name"].endswith(store))
            assert "DuckDB" in row["peer"]["label"] and row["targets"][0]["label"] == "<= 1.1x peer"
    # (maxent-arrow query end to end moved to bench_scale.py, with inspect)
    assert not any("maxent-arrow query, end to end" in n for n in names)
    assert sum("cost of verifying on read" in n for n in names) == 6


def test_reward_names_that_need_quoting(tmp_path):
    names = ['acc "strict"', "format ok"]
    w = write_store(tmp_path / "s", steps=range(2), ranks=1, rewards_at=lambda s: names)
    with RunAnalytics(w.root, materialize=True) as run:
        assert run.reward_names == names
        curve = {(r["step"], r["reward"]): r for r in run.reward_curve().to_pylist()}
        for step, groups in w.by_step().items():
            for name in names:
                values = np.concatenate([g.rewards[name] for g in groups])
                assert curve[(step, name)]["mean"] == pytest.approx(values.mean())
        succ = run.success_rate(reward='acc "strict"', threshold=0.5).to_pylist()
        for row, (step, groups) in zip(succ, w.by_step().items(), strict=True):
            assert row["step"] == step
            values = np.concatenate([g.rewards['acc "strict"'] for g in groups])
            assert row["success_rate"] == pytest.approx((values > 0.5).mean())
        got = run.sql('SELECT count("reward_format ok") AS n FROM samples').column("n")
        assert got[0].as_py() == sum(len(g.utils) for g in w.groups)


def test_length_stats_fall_back_to_truncated_flags(tmp_path):
    # No cap in any step's config: the generator's `truncated` flags decide what is clipped.
    w = write_store(tmp_path / "s", steps=range(3), ranks=2, max_len=16, cap_in_config=False)
    with RunAnalytics(w.root) as run:
        t = {r["step"]: r for r in run.length_stats().to_pylist()}
    for step, groups in w.by_step().items():
        lens = np.concatenate([g.lens for g in groups]).astype(float)
        trunc = np.concatenate([g.truncated for g in groups])
        assert t[step]["clipped_frac"] == pytest.approx(trunc.mean())
        if (~trunc).any():
            assert t[step]["mean_terminated"] == pytest.approx(lens[~trunc].mean())
            assert t[step]["max_terminated"] == lens[~trunc].max()
        assert t[step]["p95_length"] == pytest.approx(np.quantile(lens, 0.95))


@pytest.mark.parametrize("seed", range(5))
def test_length_quantiles_from_histogram_equal_numpy(seed):
    # The histogram path on its own, with ties, one-sample steps and unclipped-only steps.
    from maxent_arrow.analytics.queries import _length_stats_from_histogram

    rng = np.random.default_rng(seed)
    steps, cap = [], 9
    for step in range(int(rng.integers(1, 30))):
        steps.append((step, rng.integers(0, 12, int(rng.integers(1, 40)))))
    rows = []
    for step, lens in steps:
        values, counts = np.unique(lens, return_counts=True)
        rows += [(step, int(v), bool(v >= cap), int(c)) for v, c in zip(values, counts)]
    hist = pa.table({k: [r[i] for r in rows] for i, k in enumerate(["step", "t", "clipped", "c"])})
    got = _length_stats_from_histogram(hist).to_pylist()
    assert [r["step"] for r in got] == [s for s, _ in steps]
    for row, (_, lens) in zip(got, steps):
        x = lens.astype(float)
        term = x[x < cap]
        assert row["n"] == x.size
        assert row["p50_length"] == pytest.approx(np.quantile(x, 0.5))
        assert row["p95_length"] == pytest.approx(np.quantile(x, 0.95))
        assert row["mean_length"] == pytest.approx(x.mean())
        assert (row["min_length"], row["max_length"]) == (x.min(), x.max())
        assert row["clipped_frac"] == pytest.approx((x >= cap).mean())
        assert row["max_terminated"] == (term.max() if term.size else None)
        assert row["mean_terminated"] == (pytest.approx(term.mean()) if term.size else None)


def test_golden_v1_store_reads_as_recorded(tmp_path):
    # The shipped golden store (per-append pairs, a compacted pair, an eval step, a reward
    # function added mid-run) against the numbers recorded when it was written.
    import shutil

    golden = Path(__file__).resolve().parents[2] / "data" / "golden_v1"
    expected_path = golden.with_name("golden_v1_expected.json")
    if not golden.is_dir() or not expected_path.is_file():
        pytest.skip("no golden store in data/")
    expected = json.loads(expected_path.read_text())
    root = tmp_path / "golden"
    shutil.copytree(golden, root)
    with RunAnalytics(root) as run:
        assert run.reward_names == expected["reward_fields"]
        means = run.sql(
            "SELECT step, rank, kind, avg(total_util) AS m FROM samples "
            "GROUP BY ALL ORDER BY step, rank, kind"
        ).to_pylist()
        assert [[r["step"], r["rank"], r["kind"]] for r in means] == expected["units"]
        assert [r["m"] for r in means] == pytest.approx(expected["reward_mean"])
        n = run.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py()
        assert n == expected["samples"]
        nulls = (
            run.sql(  # group rows written before the `format` reward existed
                "SELECT count(*) AS n FROM groups "
                "WHERE NOT list_contains(reward_names, 'format') AND step < 2"
            )
            .column("n")[0]
            .as_py()
        )
        assert nulls == expected["format_nulls_before_step_2"]
        assert run.describe()["group_rows"] == expected["groups"]


def test_reward_curve_in_memory_histogram_path_matches_numpy(tmp_path):
    # Discrete rewards (0/1) and a discrete U take the histogram path once materialized.
    w = write_store(tmp_path / "s", steps=range(5), ranks=2, prompts=6, seed=9)
    with RunAnalytics(w.root, materialize=True) as run:
        flat = run.rel.flat(["total_util", "reward_accuracy"], kind="train")
        assert "reward_accuracy" in run._discrete_sources(["reward_accuracy"], flat)
        curve = {(r["step"], r["reward"]): r for r in run.reward_curve().to_pylist()}
    for step, groups in w.by_step().items():
        for name, values in [
            ("accuracy", np.concatenate([g.rewards["accuracy"] for g in groups])),
            ("total_utils", np.concatenate([g.utils for g in groups])),
        ]:
            r = curve[(step, name)]
            assert r["n"] == values.size
            assert r["mean"] == pytest.approx(values.mean(), rel=1e-12)
            assert r["std"] == pytest.approx(values.std(), rel=1e-9, abs=1e-12)
            assert (r["min"], r["max"]) == (values.min(), values.max())
            for q, col in [
                (0.05, "p05"),
                (0.25, "p25"),
                (0.5, "p50"),
                (0.75, "p75"),
                (0.95, "p95"),
            ]:
                assert r[col] == pytest.approx(np.quantile(values, q), rel=1e-12, abs=1e-12)


def test_step_rows_come_from_the_checked_commit_log(store, tmp_path):
    """In a store with a commit log the step rows are the log's (each entry sealed by its
    CRC-32): DuckDB reads a step file itself only when its size and CRC-32 are the ones the
    log recorded (no Python per row), else the log's rows are handed to it as Arrow. A
    damaged step file changes nothing a reader serves (verify names it), a damaged log entry
    stops the open, naming it."""
    with RunAnalytics(store.root) as run:
        plan = run.explain("SELECT * FROM steps").upper()
        assert "PARQUET" in plan and "ARROW_SCAN" not in plan
        expected = run.sql("SELECT * FROM steps ORDER BY step, kind, rank")
        assert expected.num_rows == len(store.step_rows)
    copy = tmp_path / "copy"
    shutil.copytree(store.root, copy)
    victim = sorted((copy / "steps").glob("*.parquet"))[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with RunAnalytics(copy) as run:
        assert "ARROW_SCAN" in run.explain("SELECT * FROM steps").upper()  # the log's rows
        assert run.sql("SELECT * FROM steps ORDER BY step, kind, rank").equals(expected)
    assert victim in [p.path for p in RolloutStore(copy).verify().problems]
    entry = sorted((copy / "log").glob("*.json"))[2]
    entry.write_text(entry.read_text().replace('"num_groups": [', '"num_groups": [1'))
    with pytest.raises(StoreError, match=f"{entry.name}.*CRC-32"):
        RunAnalytics(copy).sql("SELECT count(*) FROM steps")
