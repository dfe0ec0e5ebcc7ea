"""``benchmarks/synthetic_store.py`` builds stores that this library's readers, ``verify``
and plain readers (DuckDB over the log checkpoint, pyarrow) accept, with the counts it
states."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import synthetic_store  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.store import ReadOnlyStore  # noqa: E402


@pytest.mark.parametrize("layout", ["compacted", "loose"])
def test_a_small_synthetic_store_is_accepted_by_every_reader(tmp_path, layout):
    steps, ranks, groups, k = 30, 3, 2, 2
    built = synthetic_store.build(
        tmp_path / "run",
        steps=steps,
        ranks=ranks,
        layout=layout,
        groups=groups,
        k=k,
        tokens=8,
        segment_steps=10,
        eval_every=5,
    )
    eval_steps = len(range(0, steps, 5))
    units = (steps + eval_steps) * ranks
    assert built.group_rows == units * groups
    # compacted: a segment per 10 steps and kind (the eval one holds its 2 eval steps)
    expected_files = 3 + 3 if layout == "compacted" else units
    assert built.group_files == expected_files
    assert built.log_entries == expected_files + 1  # and the attempt
    store = ReadOnlyStore(built.path)
    assert len(store.units()) == units
    assert store.steps(kind="eval") == list(range(0, steps, 5))
    report = store.verify()
    assert report.ok, report.problems
    table = store.read(columns=["step", "rank", "kind", "completion_ids"])
    assert table.num_rows == units * groups
    assert all(len(ids) == k for ids in table.column("completion_ids").to_pylist())
    counts = store.sql("SELECT kind, count(*) AS n FROM samples GROUP BY kind ORDER BY kind")
    assert counts.to_pylist() == [
        {"kind": "eval", "n": eval_steps * ranks * groups * k},
        {"kind": "train", "n": steps * ranks * groups * k},
    ]
    steps_view = store.sql("SELECT count(*) AS n, sum(num_groups) AS g FROM steps")
    assert steps_view.to_pylist() == [{"n": units, "g": units * groups}]
    # Plain readers, without this library: DuckDB over the checkpoint's live files.
    root = str(built.path)
    con = duckdb.connect()
    live = con.sql(
        f"SELECT path FROM read_parquet('{root}/log/_checkpoint.parquet') "
        "WHERE kind = 'group_file' AND effective"
    ).fetchall()
    assert len(live) == expected_files
    files = [f"{root}/{p}" for (p,) in live]
    n = con.execute(f"SELECT count(*) FROM read_parquet({files!r})").fetchall()
    assert n == [(units * groups,)]
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in files) == units * groups
    # And the store takes appends on top of it.
    writer = RolloutStore(built.path)
    assert writer.steps(kind="train")[-1] == steps - 1


def test_a_build_shared_among_worker_processes_holds_the_same_data(tmp_path):
    """Two spawned workers commit their shares through the store's lock: the store holds
    the data one process builds (each commit's values come from its own seed), every reader
    accepts it, and its log has one checkpoint, at its end (none every 100 commits)."""
    params = dict(steps=60, ranks=2, groups=2, k=2, tokens=8, eval_every=5, layout="loose")
    one = synthetic_store.build(tmp_path / "one", workers=1, **params)
    two = synthetic_store.build(tmp_path / "two", workers=2, **params)
    units = (60 + 12) * 2
    assert two.cpu_seconds > 0  # the workers' CPU is counted (they are waited for)
    tables = []
    for built in (one, two):
        assert (built.group_files, built.log_entries, built.group_rows) == (
            units,
            units + 1,
            units * 2,
        )
        store = ReadOnlyStore(built.path)
        report = store.verify()
        assert report.ok, report.problems
        keys = ["kind", "step", "rank", "group_index"]
        tables.append(store.read().sort_by([(k, "ascending") for k in keys]))
        checkpoints = sorted(p.name for p in (built.path / "log").glob("checkpoint-*"))
        assert checkpoints == [f"checkpoint-{units + 1:020d}.parquet"]
        # Plain pyarrow reads the checkpoint: every unit's file is in it.
        live = pq.read_table(built.path / "log" / "_checkpoint.parquet").to_pylist()
        assert sum(r["kind"] == "group_file" and r["effective"] for r in live) == units
    assert tables[0].num_rows == units * 2
    assert tables[0].equals(tables[1])
