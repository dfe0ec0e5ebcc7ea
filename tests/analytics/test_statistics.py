"""Each step statistic has one definition (``maxent_arrow.compute``: ``scored_moments``,
``length_summary``, ``clipped_flags``, ``merge_step_rows``); the recorders' step rows, the seed
records' step rows and the analytics' SQL are held to it on random runs: unscored (NaN)
utilities, completions all clipped (no terminated one), one completion, ranks of one step."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from maxent_arrow import RolloutBatch, RolloutStore, RunAnalytics
from maxent_arrow.arrow import schema as S
from maxent_arrow.compute import clipped_flags, length_summary, merge_step_rows, scored_moments
from maxent_arrow.integrations.steps import step_row
from maxent_arrow.rollout import declare_families

CAP = 6


def _groups(step: int, rank: int, rows: list[list[tuple[int, bool, float]]]) -> pa.Table:
    """A group table of ``rows`` (per group, per completion: tokens, truncated, utility)."""
    k = [len(g) for g in rows]
    info = [
        [
            {
                "finish_reason": "length" if t else "stop",
                "stop_reason": None,
                "truncated": t,
                "token_count": n,
                "extra": None,
            }
            for n, t, _ in g
        ]
        for g in rows
    ]
    columns = {
        "step": [step] * len(rows),
        "rank": [rank] * len(rows),
        "kind": ["train"] * len(rows),
        "group_index": list(range(len(rows))),
        "group_id": [f"{step}.{i}" for i in range(len(rows))],
        "group_size": k,
        "num_completions": k,
        "completions": [["x" * n for n, _, _ in g] for g in rows],
        "completion_index": [list(range(len(g))) for g in rows],
        "completion_ids": [[[7] * n for n, _, _ in g] for g in rows],
        "completion_info": info,
        "total_utils": [[u for _, _, u in g] for g in rows],
    }
    layout = S.group_schema()
    schema = pa.schema([layout.field(n) for n in columns])
    return pa.table(columns, schema=schema)


completion = st.tuples(
    st.integers(0, CAP),
    st.booleans(),
    st.one_of(st.just(math.nan), st.floats(-3, 3, allow_nan=False)),
)
group = st.lists(completion, min_size=1, max_size=4)
rank_rows = st.lists(group, min_size=1, max_size=3)
run = st.lists(st.lists(rank_rows, min_size=1, max_size=2), min_size=1, max_size=3)


def _as_list(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=run, cap=st.sampled_from([2, CAP]))
def test_recorders_step_rows_and_sql_agree_with_the_one_definition(run, cap):
    """Per step: the stored step rows (per rank) merged by the declared rules, the SQL of
    ``reward_curve`` and ``length_stats`` over all ranks, and the definition applied to the
    step's completions give the same figures, edge cases included."""
    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore.create(Path(tmp) / "s")
        config = {"max_completion_len": cap}
        expected = {}
        for step, ranks in enumerate(run):
            rows = []
            for rank, groups in enumerate(ranks):
                table = declare_families(_groups(step, rank, groups), ("core",))
                row = step_row(
                    table, step=step, rank=rank, kind="train", config=config
                )  # fmt: skip
                store.append(RolloutBatch(table, row))
                rows.append({k: v[0] for k, v in row.to_pydict().items()})
            flat = [c for groups in ranks for g in groups for c in g]
            t = torch.tensor([c[0] for c in flat], dtype=torch.float64)
            truncated = torch.tensor([c[1] for c in flat])
            clipped = clipped_flags(t, max_completion_len=cap, truncated=truncated)
            want = length_summary(t, clipped)
            moments = scored_moments(torch.tensor([c[2] for c in flat], dtype=torch.float64))
            want |= {"reward_mean": moments.mean, "reward_std": moments.std}
            want["num_scored"] = moments.scored
            merged = merge_step_rows(rows)
            for name, value in want.items():
                got = merged[name]
                assert (got is None) == (value is None), (name, got, value)
                if value is not None:
                    assert got == pytest.approx(value, abs=1e-9), name
            expected[step] = (want, moments)
        with RunAnalytics(store) as analytics:
            lengths = {r["step"]: r for r in analytics.length_stats().to_pylist()}
            curve = {
                r["step"]: r
                for r in analytics.reward_curve(quantiles=()).to_pylist()
                if r["reward"] == "total_utils"
            }
        for step, (want, moments) in expected.items():
            row = lengths[step]
            for name in ("min_length", "mean_length", "max_length", "min_terminated",
                         "mean_terminated", "max_terminated"):  # fmt: skip
                got, value = _as_list(row[name]), want[name]
                assert (got is None) == (value is None), (step, name, got, value)
                if value is not None:
                    assert got == pytest.approx(value, abs=1e-9), (step, name)
            assert row["clipped_frac"] == pytest.approx(want["clipped_ratio"], abs=1e-12)
            r = curve.get(step)
            if moments.scored == 0:
                assert r is not None and r["n"] == 0 and r["mean"] is None
            else:
                assert r["n"] == moments.scored and r["unscored"] == moments.unscored
                assert r["mean"] == pytest.approx(moments.mean, abs=1e-9)
                assert r["std"] == pytest.approx(moments.std, abs=1e-9)


def test_the_seed_record_keeps_zero_where_the_stored_statistic_is_null(tmp_path):
    """Every completion clipped: ``LengthStats`` (the seed's) says 0.0 for the terminated
    figures, the stored step row NULL, and the batch read back gives the seed record its 0.0."""
    from maxent_arrow.compute import length_stats
    from maxent_arrow.testing import make_parts

    counts = torch.tensor([8.0, 8.0, 9.0])
    seed = length_stats(counts, max_completion_len=8)
    assert (seed.min_terminated, seed.mean_terminated, seed.max_terminated) == (0.0, 0.0, 0.0)
    summary = length_summary(counts, clipped_flags(counts, max_completion_len=8))
    assert summary["mean_terminated"] is None and summary["clipped_ratio"] == 1.0
    parts = make_parts(seed=3, groups=1, k=(3, 3), max_tokens=8)
    parts["length_stats"] = seed
    batch = RolloutBatch.from_parts(0, **parts)
    assert batch.step_row.column("mean_terminated")[0].as_py() is None
    store = RolloutStore.create(tmp_path / "s")
    store.append(batch)
    (back,) = store.replay()
    assert back.length_stats == seed
    assert store.sql("SELECT mean_terminated FROM steps").to_pylist() == [{"mean_terminated": None}]
    assert np.isnan(np.float64(np.nan))  # the module's NaN literal is a float NaN
