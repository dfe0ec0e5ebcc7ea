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
