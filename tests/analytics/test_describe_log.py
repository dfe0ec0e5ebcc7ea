"""``RunAnalytics.describe`` (what ``maxent-arrow inspect`` prints) agrees with DuckDB over
the files a plain reader reads (``live_files``: the commit log's list), on a resumed run with
compacted segments superseded in part: the counts per kind, the ranks, the group rows and
bytes, and the steps a later attempt superseded."""

from __future__ import annotations

import duckdb
from store_fixtures import make_batch

from maxent_arrow import RolloutStore
from maxent_arrow.analytics import RunAnalytics
from maxent_arrow.store import ReadOnlyStore


def _run(tmp_path):
    root = tmp_path / "run"
    store = RolloutStore.create(root, compact_every=None)
    for step in range(24):
        store.append(make_batch(step, seed=step))
        if step % 4 == 0:
            store.append(make_batch(step, kind="eval", seed=100 + step))
    store.compact(kind="train", steps=range(20), max_steps=8)
    # A resume at step 13 supersedes train steps 13-23 of the first attempt (in part the
    # segment of steps 8-15) and eval steps 16 and 20.
    resumed = RolloutStore(root, resume_from=13, compact_every=None, attempt="second")
    for step in (13, 14):
        resumed.append(make_batch(step, seed=300 + step))
    return root


def _select(files, query: str) -> list[tuple]:
    """``query`` over the union of ``files`` (path, row filter) as the table ``t``."""
    parts = [f"SELECT * FROM read_parquet('{p}')" + (f" WHERE {w}" if w else "") for p, w in files]
    union = " UNION ALL BY NAME ".join(parts)
    return duckdb.connect().execute(query.replace("{t}", f"({union})")).fetchall()


def test_describe_agrees_with_duckdb_over_the_live_files(tmp_path):
    root = _run(tmp_path)
    store = ReadOnlyStore(root)
    with RunAnalytics(store) as run:
        info = run.describe()
        # (describe's one scan of the step rows gives the run config's own query's answer)
        assert info["run_config"] == run.run_config()
        for kind in ("train", "eval", None):
            assert run._config_of(
                sorted(
                    run.sql("SELECT kind, config, max(step) AS last FROM steps "
                            "WHERE config IS NOT NULL GROUP BY ALL").to_pylist(),
                    key=lambda r: r["last"],
                ),
                kind,
            ) == run.run_config(kind=kind)  # fmt: skip
    steps = store.live_files("steps")
    groups = store.live_files("groups")
    kinds = _select(
        steps,
        "SELECT kind, count(DISTINCT step), min(step), max(step), count(*), sum(num_groups), "
        "sum(num_samples) FROM {t} GROUP BY kind ORDER BY kind",
    )
    assert {
        k: (v["steps"], v["first"], v["last"], v["step_rows"], v["groups"], v["samples"])
        for k, v in info["kinds"].items()
    } == {row[0]: tuple(row[1:]) for row in kinds}
    assert info["ranks"] == [
        r for (r,) in _select(steps, "SELECT DISTINCT rank FROM {t} ORDER BY 1")
    ]
    assert [(info["group_rows"],)] == _select(groups, "SELECT count(*) FROM {t}")
    assert info["files"] == {"groups": len(groups), "steps": len(steps)}
    assert info["bytes"]["groups"] == sum(p.stat().st_size for p, _ in groups)
    # Superseded: the steps of the superseded history's files (rows past their cutoffs).
    superseded = ReadOnlyStore(root, attempts="superseded").live_files("steps")
    expected = [s for (s,) in _select(superseded, "SELECT DISTINCT step FROM {t} ORDER BY 1")]
    assert info["history"]["superseded_steps"] == expected
    assert expected == list(range(13, 24))  # train 13-23, eval 16 and 20


def test_a_run_never_resumed_supersedes_nothing(tmp_path):
    root = tmp_path / "run"
    store = RolloutStore.create(root, compact_every=None)
    for step in range(6):
        store.append(make_batch(step, seed=step))
    store.compact(kind="train", max_steps=4)
    with RunAnalytics(root) as run:
        info = run.describe()
    assert info["history"]["superseded_steps"] == []
    assert info["kinds"]["train"]["steps"] == 6 and info["ranks"] == [0]
