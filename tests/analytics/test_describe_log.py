"""``RunAnalytics.describe`` (what ``maxent-arrow inspect`` prints) agrees with DuckDB over
the files a plain reader reads (``live_files``: the commit log's list), on a resumed run with
compacted segments superseded in part: the counts per kind, the ranks, the group rows and
bytes, and the steps a later attempt superseded. Described from the commit log's summaries
(``describe_run``), it gives the answers of the scan of the step rows it replaced, for every
history, from a checkpoint written before summaries, and for stores without a log."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fault_harness import flip, truncate

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.analytics import RunAnalytics, describe_run
from maxent_arrow.store import ReadOnlyStore, process_caches
from maxent_arrow.store.history.catalog import History
from maxent_arrow.testing import CONFIG, compacted_run, make_batch, resume_run, unit_path


def _run(tmp_path):
    root = tmp_path / "run"
    compacted_run(root, steps=24, eval_every=4, merged=20, segment=8)
    # A resume at step 13 supersedes train steps 13-23 of the first attempt (in part the
    # segment of steps 8-15) and eval steps 16 and 20.
    resume_run(root, resume_from=13, steps=(13, 14), seed=300)
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


# ------------------------------------------------------------------ described from the log


def _resumed_run(root):
    """Two ranks, eval steps every 3rd, a config changed at step 6, a compaction
    (checkpointed), then a resume at step 7 whose eval steps resume at 8 (their own point),
    a record table, and entries after the checkpoint."""
    store = RolloutStore.create(root, compact_every=None)
    for step in range(12):
        config = dict(CONFIG, tau=0.5 if step < 6 else 0.7)
        for rank in (0, 1):
            store.append(make_batch(step, rank=rank, seed=10 * step + rank, config=config))
        if step % 3 == 0:
            store.append(make_batch(step, kind="eval", seed=500 + step))
    store.compact(kind="train", steps=range(10), max_steps=4)
    store.checkpoint()
    resumed = RolloutStore(
        root, resume_from=7, resume_kinds={"eval": 8}, compact_every=None, attempt="second"
    )
    for step in (7, 8):
        for rank in (0, 1):
            resumed.append(make_batch(step, rank=rank, seed=900 + 10 * step + rank))
    resumed.append(make_batch(9, kind="eval", seed=990))
    resumed.append_records("notes", pa.table({"step": [0, 8], "text": ["a", "b"]}))
    return root


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    return _resumed_run(tmp_path_factory.mktemp("resumed") / "run")


def _scan(root, attempts: History = "effective"):
    """``describe`` as it was computed before the log recorded summaries: from the views."""
    with RunAnalytics(ReadOnlyStore(root, attempts=attempts)) as run:
        return run.describe_from_views()


@pytest.mark.parametrize("attempts", ["effective", "all", "superseded"])
def test_describe_from_the_log_equals_the_scan_of_the_step_rows(resumed_run, attempts: History):
    root = resumed_run
    info = describe_run(ReadOnlyStore(root, attempts=attempts))
    assert info == _scan(root, attempts)
    with RunAnalytics(ReadOnlyStore(root, attempts=attempts)) as run:
        assert run.describe() == info  # the analytics' describe is the same answer
    if attempts == "effective":
        # train: 0-6 of the first attempt (the segment of 4-7 in part), 7-8 of the second
        assert info["kinds"]["train"]["steps"] == 9 and info["kinds"]["train"]["last"] == 8
        assert info["kinds"]["train"]["step_rows"] == 18
        # eval: 0, 3, 6 of the first attempt (below their own resume point 8), 9 again
        assert (info["kinds"]["eval"]["steps"], info["kinds"]["eval"]["last"]) == (4, 9)
        assert info["history"]["superseded_steps"] == [7, 8, 9, 10, 11]
        assert info["ranks"] == [0, 1]
        assert info["run_config"]["changed"] == ["tau"]
        # (the first attempt's checkpoint recorded its end: an attempt_ends row)
        assert info["history"]["records"] == {"attempt_ends": 1, "notes": 2}


def test_a_checkpoint_without_summaries_is_described_the_same(resumed_run, tmp_path):
    """A checkpoint written before summaries existed (no ``summary`` column): each file's
    counts are computed from its step rows, with the same answer; the next checkpoint
    writes them."""
    root = tmp_path / "run"
    shutil.copytree(resumed_run, root)
    store = RolloutStore(root, compact_every=None, if_exists="resume")
    version = store.checkpoint()
    expected = describe_run(ReadOnlyStore(root))
    name = root / "log" / f"checkpoint-{version:020d}.parquet"
    older = pq.read_table(name)
    assert "summary" in older.column_names
    older = older.drop_columns(["summary"])
    pq.write_table(older, name, compression="zstd")
    data = name.read_bytes()
    (root / "log" / "_checkpoint.parquet").write_bytes(data)
    hint = {"version": version, "crc32": zlib.crc32(data) & 0xFFFFFFFF, "size": len(data)}
    (root / "log" / "_last_checkpoint.json").write_text(json.dumps(hint))
    assert describe_run(ReadOnlyStore(root)) == expected == _scan(root)
    store = RolloutStore(root, compact_every=None, if_exists="resume")
    store.checkpoint()  # written by this version: the summaries again
    assert "summary" in pq.read_table(root / "log" / "_checkpoint.parquet").column_names
    assert describe_run(ReadOnlyStore(root)) == expected


def test_describe_reads_no_step_rows_and_no_commit_record(tmp_path):
    """The cost does not grow with the step rows: a checkpointed run is described from the
    checkpoint's summaries, and no unit's record or step rows is parsed."""
    root = tmp_path / "run"
    store = RolloutStore.create(root, compact_every=None)
    for step in range(12):
        for rank in (0, 1):
            store.append(make_batch(step, rank=rank))
    store.compact(kind="train", max_steps=4)
    store.checkpoint()
    process_caches().checkpoints.clear()  # as a new process reads it
    reader = ReadOnlyStore(root)
    info = describe_run(reader)
    units = reader.catalog.state().units.values()  # type: ignore[attr-defined]
    assert units and not any(e.record.parsed for e in units)  # never parsed
    assert info == _scan(root)
    assert info["kinds"]["train"] == {
        "steps": 12, "first": 0, "last": 11, "step_rows": 24,
        "groups": sum(make_batch(s, rank=r).num_groups for s in range(12) for r in (0, 1)),
        "samples": sum(make_batch(s, rank=r).num_samples for s in range(12) for r in (0, 1)),
    }  # fmt: skip


@pytest.mark.parametrize("how", ["truncated", "deleted", "footer"])
def test_what_describe_checks(tmp_path, how):
    """inspect checks that each committed group file is there with its recorded size (a
    listing): a truncated or deleted one is named (skipped with a warning naming it under
    ``on_error="skip"``). A flipped byte is not looked for (that would read every file):
    ``verify`` names it."""
    root = tmp_path / "run"
    store = RolloutStore.create(root, compact_every=None)
    for step in range(3):
        store.append(make_batch(step))
    path = unit_path(store, "groups", 1)
    if how == "truncated":
        truncate(path)
    elif how == "deleted":
        path.unlink()
    else:
        flip(path, path.stat().st_size - 64)
    if how == "footer":
        assert describe_run(ReadOnlyStore(root))["kinds"]["train"]["steps"] == 3
        assert [p.path for p in ReadOnlyStore(root).verify().problems] == [path]
        return
    with pytest.raises(StoreError, match=path.name):
        describe_run(ReadOnlyStore(root))
    with pytest.warns(UserWarning, match=path.name):
        info = describe_run(ReadOnlyStore(root, on_error="skip"))
    assert info["kinds"]["train"]["steps"] == 3  # the step rows are the log's
    assert info["bytes"]["groups"] == sum(p.stat().st_size for p in (root / "groups").iterdir())


GOLDEN = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize("name", ["golden_v1", "golden_v2"])
def test_a_store_without_a_log_is_described_as_its_views_say(tmp_path, name):
    """Stores created before the commit log are described from their catalog, as every
    store is (the counts of each step file; "no history"), and the description is the one
    the views' scan of the step rows gives. A flipped footer byte is named by ``verify`` and
    by the query that reads the file."""
    root = tmp_path / name
    shutil.copytree(GOLDEN / name, root)
    expected = json.loads((GOLDEN / f"{name}_expected.json").read_text())
    info = describe_run(ReadOnlyStore(root))
    assert info["history"] is None
    assert info == _scan(root)
    assert info["group_rows"] == expected["groups"]
    victim = sorted((root / "groups").glob("*.parquet"))[0]
    flip(victim, victim.stat().st_size - 64)
    assert victim in [p.path for p in ReadOnlyStore(root).verify().problems]
    with pytest.raises(StoreError, match=victim.name):
        ReadOnlyStore(root).sql("SELECT count(*) FROM groups")
