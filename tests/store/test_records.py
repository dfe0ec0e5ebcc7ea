"""Record tables, the group lifecycle and the prompt-stream frontier (issue 21, part 3).

Records are appended through the commit log; a resume supersedes the records of its steps as
it does the rollouts; the ``groups`` view leaves out the dropped groups and ``groups_all``
keeps them; plain readers (DuckDB on the files ``live_files`` lists) agree.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from maxent_arrow import RolloutBatch, RolloutStore
from maxent_arrow.errors import ArgumentError, SchemaError, ShapeError, StoreError
from maxent_arrow.store.history.records import lifecycle_rows
from maxent_arrow.testing import make_batch

KEY = ["step", "rank", "kind", "group_index"]


def _numbered(step: int, first: int, **kw) -> RolloutBatch:
    """A batch whose groups carry consecutive stream positions from ``first``."""
    batch = make_batch(step, **kw)
    n = batch.num_groups
    groups = batch.groups.append_column(
        "stream_index", pa.array(np.arange(first, first + n), pa.int64())
    )
    return RolloutBatch(groups, batch.step_row)


def _rows(store, step):
    g = store.read(columns=[*KEY, "stream_index"])
    return g.filter(pc.equal(g.column("step"), step))


def test_records_round_trip_and_refuse_bad_rows_naming_them(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    version = store.append_records("judge", pa.table({"step": [0, 0], "score": [0.5, 1.0]}))
    assert isinstance(version, int) and version > 0
    store.append_records("judge", pa.table({"step": [1], "score": [0.25]}))
    got = RolloutStore(tmp_path / "s").read_records("judge")
    assert got.column("score").to_pylist() == [0.5, 1.0, 0.25]
    assert set(got.column("attempt").to_pylist()) == {store.begin_attempt()}
    before = sorted(p.name for p in (tmp_path / "s" / "log").iterdir())
    with pytest.raises(SchemaError, match="column 'score': string now, double in earlier"):
        store.append_records("judge", pa.table({"step": [2], "score": ["x"]}))
    with pytest.raises(SchemaError, match="a view of the store has that name"):
        store.append_records("groups", pa.table({"x": [1]}))
    with pytest.raises(SchemaError, match="lowercase identifier"):
        store.append_records("Bad Name", pa.table({"x": [1]}))
    with pytest.raises(SchemaError, match="row 1: step is null"):
        store.append_records("judge", pa.table({"step": [1, None], "score": [0.1, 0.2]}))
    with pytest.raises(SchemaError, match="lifecycle', row 0: event 'kept'"):
        store.append_records(
            "lifecycle",
            pa.table(
                {
                    "step": [0], "event": ["kept"], "rollout_step": [0], "rollout_rank": [0],
                    "rollout_kind": ["train"], "group_index": [0],
                }
            ),
        )  # fmt: skip
    with pytest.raises(SchemaError, match="row 0: reason 'bored' with event 'dropped'"):
        store.record_lifecycle(_rows(store, 0).slice(0, 1), step=0, event="dropped", reason="bored")
    # Nothing of the refused appends was committed or left behind.
    assert sorted(p.name for p in (tmp_path / "s" / "log").iterdir()) == before
    assert len(list((tmp_path / "s" / "records" / "judge").glob("*.parquet"))) == 2
    # A plain reader of the files the log lists sees the same rows.
    files = [str(p) for p, _ in store.live_files("records:judge")]
    plain = duckdb.sql(f"SELECT score FROM read_parquet({files!r}) ORDER BY score").fetchall()
    assert [r[0] for r in plain] == sorted(got.column("score").to_pylist())


def test_a_damaged_records_file_is_named(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append_records("judge", pa.table({"step": [0], "score": [0.5]}))
    (path,) = (tmp_path / "s" / "records" / "judge").glob("*.parquet")
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=rf"{path.name}: damaged"):
        RolloutStore(tmp_path / "s").read_records("judge")
    (problem,) = RolloutStore(tmp_path / "s").verify().problems
    assert problem.path == path and "damaged: a file of records 'judge'" in problem.problem
    path.unlink()
    with pytest.raises(
        StoreError, match=rf"{path.name}: a committed records file of 'judge' is lost"
    ):
        RolloutStore(tmp_path / "s").read_records("judge")


def test_lifecycle_views_and_frontier(tmp_path):
    root = tmp_path / "s"
    gen = RolloutStore.create(root, role="generator", attempt="gen-1")
    first = 0
    for step in range(3):
        batch = _numbered(step, first)
        gen.append(batch)
        first += batch.num_groups
    trainer = RolloutStore(root, role="trainer", attempt="train-1")
    s0, s1 = _rows(trainer, 0), _rows(trainer, 1)
    trainer.record_lifecycle(s0, step=0, event="trained")
    trainer.record_lifecycle(s1.slice(0, 1), step=1, event="dropped", reason="zero_std")
    trainer.record_lifecycle(s1.slice(1), step=1, event="trained")
    reader = RolloutStore(root)
    life = reader.lifecycle()
    assert life.num_rows == s0.num_rows + s1.num_rows
    dropped = life.filter(pc.equal(life.column("event"), "dropped"))
    assert dropped.column("reason").to_pylist() == ["zero_std"]
    # The groups view leaves the dropped group out; groups_all keeps it; SQL and Arrow agree.
    n_all = reader.read().num_rows
    assert reader.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py() == n_all - 1
    assert reader.sql("SELECT count(*) AS n FROM groups_all").column("n")[0].as_py() == n_all
    gone = reader.sql(
        "SELECT step, group_index FROM groups_all EXCEPT SELECT step, group_index FROM groups"
    ).to_pylist()
    assert gone == [{"step": 1, "group_index": s1.column("group_index")[0].as_py()}]
    assert (
        reader.sql("SELECT count(*) AS n FROM lifecycle WHERE event = 'trained'")
        .column("n")[0]
        .as_py()
        == s0.num_rows + s1.num_rows - 1
    )
    frontier = reader.frontier()
    consumed = s0.num_rows + s1.num_rows
    assert (frontier.position, frontier.consumed) == (consumed, consumed)
    assert frontier.gaps == [] and frontier.double == []
    assert frontier.in_flight.column("stream_index").to_pylist() == list(range(consumed, first))
    # The trainer resumes at its step 1: the decisions of step 1 are superseded, the prompts
    # of step 1 are in flight again, and nothing of the generator's is superseded.
    resumed = RolloutStore(root, role="trainer", resume_from=1, attempt="train-2")
    resumed.begin_attempt()
    after = RolloutStore(root)
    assert after.frontier().position == s0.num_rows
    assert after.lifecycle().num_rows == s0.num_rows
    assert after.lifecycle(attempts="all").num_rows == consumed
    assert after.lifecycle(attempts="superseded").num_rows == s1.num_rows
    assert after.read().num_rows == n_all  # the rollouts are the generator's
    assert after.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py() == n_all
    resumed.record_lifecycle(_rows(after, 1), step=1, event="trained")
    final = RolloutStore(root).frontier()
    assert (final.position, final.double, final.gaps) == (consumed, [], [])


def test_frontier_names_gaps_and_double_consumption(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(_numbered(0, 0, groups=4))
    rows = _rows(store, 0)
    store.record_lifecycle(rows.slice(0, 1), step=0, event="trained")
    store.record_lifecycle(rows.slice(2, 1), step=0, event="trained")
    store.record_lifecycle(rows.slice(2, 1), step=1, event="trained")
    f = store.frontier()
    assert (f.position, f.gaps, f.double) == (1, [1], [2])
    assert f.in_flight.column("stream_index").to_pylist() == [1, 3]


def test_superseded_view_and_plain_readers_of_the_checkpoint(tmp_path):
    root = tmp_path / "s"
    with RolloutStore.create(root, attempt="a") as first:
        for step in range(4):
            first.append(make_batch(step))
    with RolloutStore(root, resume_from=2, attempt="b") as second:
        second.append(make_batch(2))
        rows = second.read(columns=KEY)
        second.record_lifecycle(
            rows.filter(pc.equal(rows.column("step"), 2)).slice(0, 1),
            step=2,
            event="dropped",
            reason="filtered",
        )
    store = RolloutStore(root)
    per = make_batch(0).num_groups
    count = lambda view: store.sql(f"SELECT count(*) AS n FROM {view}").column("n")[0].as_py()  # noqa: E731
    assert count("superseded") == 2 * per
    assert count("groups_all") == 5 * per
    assert count("groups") == 3 * per - 1
    assert store.read().num_rows == 3 * per
    assert RolloutStore(root, attempts="all").read().num_rows == 5 * per
    # The documented plain-reader recipe (docs/commit-protocol.md, "Plain readers"), run by a
    # process that does not import maxent_arrow, from the checkpoint the writer left at close.
    script = PLAIN.replace("ROOT", json.dumps(str(root)))
    environ = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)  # the readers must not even find maxent_arrow
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("maxent") is False
    mine = store.sql("SELECT step, group_index FROM groups ORDER BY ALL").to_pylist()
    assert set(out) == {"duckdb", "polars", "pyarrow", "pandas", "hf"}
    for reader, rows in out.items():
        assert rows == [[r["step"], r["group_index"]] for r in mine], reader
    assert pq.read_table(root / "log" / "_checkpoint.parquet").schema.names[:3] == [
        "kind", "path", "effective"
    ]  # fmt: skip


PLAIN = """
import json, sys
root = ROOT
ckpt = f"{root}/log/_checkpoint.parquet"
out = {}
KEY = ["step", "rank", "kind", "group_index"]
DROP = {"rollout_step": "step", "rollout_rank": "rank", "rollout_kind": "kind",
        "group_index": "group_index"}

# The recipe: the checkpoint lists the live files; a group file of the effective history is
# read with `step < cutoff` where a cutoff is given (a resumed attempt superseded the rest),
# and so are the lifecycle records; the groups they drop are left out.
import duckdb
con = duckdb.connect()
def union(kind):
    rows = con.sql(f"SELECT path, cutoff FROM read_parquet('{ckpt}') "
                   f"WHERE kind = '{kind}' AND effective").fetchall()
    return " UNION ALL BY NAME ".join(
        f"SELECT * FROM read_parquet('{root}/{p}')" + ("" if c is None else f" WHERE step < {c}")
        for p, c in rows)
con.sql("CREATE VIEW g AS " + union("group_file"))
con.sql("CREATE VIEW d AS SELECT * FROM (" + union("records:lifecycle")
        + ") WHERE event = 'dropped'")
out["duckdb"] = con.sql(
    "SELECT step, group_index FROM g WHERE NOT EXISTS (SELECT 1 FROM d WHERE "
    "d.rollout_step = g.step AND d.rollout_rank = g.rank AND d.rollout_kind = g.kind AND "
    "d.group_index = g.group_index) ORDER BY ALL").fetchall()

import polars as pl
ck = pl.read_parquet(ckpt).filter(pl.col("effective"))
def scan(kind):
    parts = []
    for p, c in ck.filter(pl.col("kind") == kind).select("path", "cutoff").iter_rows():
        frame = pl.scan_parquet(f"{root}/{p}")
        parts.append(frame if c is None else frame.filter(pl.col("step") < c))
    return pl.concat(parts, how="diagonal_relaxed")
d = scan("records:lifecycle").filter(pl.col("event") == "dropped").select(list(DROP)).rename(DROP)
g = scan("group_file").join(d, on=KEY, how="anti")
out["polars"] = sorted(g.select("step", "group_index").collect().rows())

import pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
table = pq.read_table(ckpt)
def read(kind):
    live = table.filter(pc.and_(pc.equal(table["kind"], kind), table["effective"])).to_pylist()
    parts = [pq.read_table(f"{root}/{r['path']}",
                           filters=None if r["cutoff"] is None else [("step", "<", r["cutoff"])])
             for r in live]
    return pa.concat_tables(parts, promote_options="permissive")
d = read("records:lifecycle")
d = d.filter(pc.equal(d["event"], "dropped")).select(list(DROP)).rename_columns(KEY)
g = read("group_file").select(KEY).join(d, keys=KEY, join_type="left anti")
out["pyarrow"] = sorted(zip(g["step"].to_pylist(), g["group_index"].to_pylist()))

import pandas as pd
ck = pd.read_parquet(ckpt)
def frame(kind):
    parts = []
    for r in ck[(ck["kind"] == kind) & ck["effective"]].itertuples():
        f = pd.read_parquet(f"{root}/{r.path}")
        parts.append(f if pd.isna(r.cutoff) else f[f["step"] < r.cutoff])
    return pd.concat(parts, ignore_index=True)
d = frame("records:lifecycle")
d = d[d["event"] == "dropped"][list(DROP)].rename(columns=DROP)
g = frame("group_file").merge(d, on=KEY, how="left", indicator=True)
g = g[g["_merge"] == "left_only"]
out["pandas"] = sorted(zip(g["step"].tolist(), g["group_index"].tolist()))

import datasets
datasets.disable_progress_bars()
def load(kind):
    parts = []
    for r in ck[(ck["kind"] == kind) & ck["effective"]].itertuples():
        ds = datasets.load_dataset("parquet", data_files=f"{root}/{r.path}", split="train")
        if not pd.isna(r.cutoff):
            ds = ds.filter(lambda row, c=r.cutoff: row["step"] < c)
        parts.append(ds)
    return datasets.concatenate_datasets(parts)
d = load("records:lifecycle").filter(lambda r: r["event"] == "dropped")
gone = {(r["rollout_step"], r["rollout_rank"], r["rollout_kind"], r["group_index"]) for r in d}
g = load("group_file").filter(
    lambda r: (r["step"], r["rank"], r["kind"], r["group_index"]) not in gone)
out["hf"] = sorted(zip(g["step"], g["group_index"]))

out = {k: [list(r) for r in v] for k, v in out.items()}
out["maxent"] = "maxent_arrow" in sys.modules
print(json.dumps(out))
"""


def test_repair_moves_record_files_no_entry_names_and_the_log_temp_files(tmp_path):
    root = tmp_path / "s"
    store = RolloutStore.create(root)
    store.append_records("judge", pa.table({"step": [0], "score": [0.5]}))
    (kept,) = (root / "records" / "judge").glob("*.parquet")
    stray = root / "records" / "judge" / "judge.tdeadbeef0000.parquet"
    stray.write_bytes(kept.read_bytes())  # a write whose entry never came
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    host = socket.gethostname()
    temp = root / "log" / f".00000000000000000009.json.tmp-{host}.{dead}.abc123"
    temp.write_bytes(b"{}")  # the entry of a writer that died before linking it
    assert RolloutStore(root).read_records("judge").num_rows == 1  # never read
    moved = {p.path.name for p in RolloutStore(root).repair().moved}
    assert moved == {stray.name, temp.name}
    assert not stray.exists() and not temp.exists() and kept.exists()
    assert RolloutStore(root).read_records("judge").num_rows == 1
    assert RolloutStore(root).verify().ok


def test_a_kind_resumed_at_its_own_point_keeps_its_records_and_plain_filters(tmp_path):
    """A record table with a ``kind`` column (``trainer_metrics``) follows the per-kind
    resume points (``resume_kinds``) as the rollouts do; ``live_files`` gives plain readers
    the same filter, and DuckDB with it reads the same rows."""
    root = tmp_path / "s"
    first = RolloutStore.create(root, attempt="a")
    for step in range(4):
        first.append(make_batch(step))
    first.append_records(
        "judge", pa.table({"step": [1, 2, 2, 3], "kind": ["train", "train", "eval", "eval"]})
    )
    second = RolloutStore(root, resume_from=2, resume_kinds={"eval": 3}, attempt="b")
    second.begin_attempt()
    got = RolloutStore(root).read_records("judge")
    assert sorted(zip(got["step"].to_pylist(), got["kind"].to_pylist())) == [
        (1, "train"), (2, "eval")
    ]  # fmt: skip
    gone = RolloutStore(root).read_records("judge", attempts="superseded")
    assert sorted(zip(gone["step"].to_pylist(), gone["kind"].to_pylist())) == [
        (2, "train"), (3, "eval")
    ]  # fmt: skip
    for history, table in (("effective", got), ("superseded", gone)):
        ((path, where),) = RolloutStore(root, attempts=history).live_files("records:judge")
        rows = duckdb.sql(f"SELECT step, kind FROM read_parquet('{path}') WHERE {where}")
        assert sorted(rows.fetchall()) == sorted(
            zip(table["step"].to_pylist(), table["kind"].to_pylist())
        )
    # The next attempt of this object keeps its own resume points.
    again = second.next_attempt()
    assert again.attempt_spec.resume_kinds == {"eval": 3}


def test_verify_names_a_lost_log_entry_and_live_files_checks_its_table(tmp_path):
    root = tmp_path / "s"
    store = RolloutStore.create(root)
    for step in range(3):
        store.append(make_batch(step))
    with pytest.raises(StoreError, match="table must be"):
        store.live_files("group")
    entries = sorted((root / "log").glob("0*.json"))
    entries[1].unlink()  # readers stop before it: every later commit hidden
    problems = RolloutStore(root).verify().problems
    assert problems[0].path.name == entries[1].name
    assert f"{len(entries) - 2} later entries" in problems[0].problem
    # The files of the later commits are committed, hidden by it (never leftovers).
    assert all("hidden from readers by the lost entry 2" in p.problem for p in problems[1:])


def test_a_lifecycle_record_addresses_exactly_one_stored_group(tmp_path):
    """Fault probe F02 and F07: a lifecycle record whose key (step, rank, kind,
    group_index) matches no stored group, or several (a store written before group_index
    was checked unique: here a batch built without validation), is refused naming its row
    and key, and nothing is written; a drop of one of two groups that share a key would
    have left both out of ``groups``."""
    store = RolloutStore.create(tmp_path / "s", compact_every=None)
    batch = make_batch(0)
    where = batch.groups.schema.get_field_index("group_index")
    shared = pa.array([0, 0, 2], pa.int32())
    groups = batch.groups.set_column(where, "group_index", shared)
    store.append(RolloutBatch(groups, batch.step_row, validate=False))
    store.append(make_batch(1))
    rows = store.read(columns=KEY)
    log = sorted(p.name for p in (tmp_path / "s" / "log").iterdir())
    with pytest.raises(ShapeError, match=r"row 0: .*step 0, rank 0, kind 'train', group_index 0"
                       r"\) matches 2 stored groups"):  # fmt: skip
        store.record_lifecycle(rows.slice(0, 1), step=0, event="dropped", reason="zero_std")
    never = rows.slice(3, 2).set_column(3, "group_index", pa.array([1, 7], pa.int32()))
    with pytest.raises(ShapeError, match=r"row 1: .*step 1, .*group_index 7\) matches no stored"):
        store.record_lifecycle(never, step=0, event="trained")
    later = rows.slice(3, 1).set_column(0, "step", pa.array([9], pa.int64()))
    with pytest.raises(ShapeError, match="step 9, .* matches no stored group"):
        store.append_records("lifecycle", lifecycle_rows(later, step=0, event="trained"))
    assert sorted(p.name for p in (tmp_path / "s" / "log").iterdir()) == log
    assert store.lifecycle().num_rows == 0
    store.record_lifecycle(rows.slice(2, 2), step=0, event="dropped", reason="zero_std")
    assert store.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py() == 4


def test_read_records_of_a_name_never_appended_is_refused_naming_the_tables(tmp_path):
    """Fault probe F07: ``read_records('nope')`` and ``live_files('records:nope')`` (a name
    never appended, that the registry does not declare) are an ArgumentError naming the
    store's record tables; a registered table with no rows is an empty answer, and a kind
    that is not a name is refused too."""
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    store.append_records("judge", pa.table({"step": [0], "score": [0.5]}))
    for read in (lambda: store.read_records("nope"), lambda: store.live_files("records:nope")):
        with pytest.raises(ArgumentError, match=r"'nope'.*judge, lifecycle, trainer_metrics"):
            read()
    assert store.read_records("lifecycle").num_rows == 0  # registered, no rows
    assert store.read_records("trainer_metrics").num_rows == 0
    assert store.live_files("records:lifecycle") == []
    assert store.read_records("judge").num_rows == 1
    with pytest.raises(ArgumentError, match="kind: expected a kind name"):
        store.read(kind=5)


def test_lifecycle_records_read_each_units_keys_once_per_store_object(tmp_path, monkeypatch):
    """The check that a record addresses one stored group reads a unit's keys once per store
    object (a committed unit's rows never change): a consumer that records every batch (the
    replay sampler) does not read the group files again for each batch."""
    import maxent_arrow.store.store as facade

    store = RolloutStore.create(tmp_path / "s", compact_every=None)
    for step in range(3):
        store.append(make_batch(step))
    rows = store.read(columns=KEY)
    reads = []
    original = facade.read_table
    monkeypatch.setattr(
        facade, "read_table", lambda *a, **k: reads.append(a[3]) or original(*a, **k)
    )
    store.record_lifecycle(rows.slice(0, 4), step=0, event="trained")  # steps 0 and 1
    store.record_lifecycle(rows.slice(4, 2), step=1, event="trained")  # step 1: known
    store.record_lifecycle(rows.slice(6, 3), step=2, event="trained")  # step 2: new
    assert [sorted(s.steps) for s in reads] == [[0, 1], [2]]
    assert store.lifecycle().num_rows == 9
