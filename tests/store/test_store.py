"""RolloutStore: layout, append/read/replay/sql, schema evolution, refusals, other readers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from maxent_arrow import (
    ArgumentError,
    RolloutBatch,
    RolloutStore,
    SchemaError,
    SchemaVersionError,
    StoreError,
)
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.history.manifest import STORE_VERSION
from maxent_arrow.store.storage.names import unit_of
from maxent_arrow.testing import make_batch, make_parts
from maxent_arrow.types import records_equal


@pytest.fixture
def store(tmp_path):
    s = RolloutStore.create(tmp_path / "store", config={"run": "test"})
    for step in range(3):
        s.append(make_batch(step))
    s.append(make_batch(1, rank=1))
    return s


def test_layout_on_disk(store):
    root = store.root
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format"] == "maxent-arrow-rollouts"
    assert manifest["schema_version"] == STORE_VERSION == "3.0"
    assert manifest["table_schema_version"] == S.SCHEMA_VERSION == "2.2"
    assert manifest["log"] == {"format": 1} and manifest["config"] == {"run": "test"}
    names = sorted(p.name for p in (root / "groups").iterdir())
    # Every commit writes files of a name of its own: the unit's name and a token.
    assert [unit_of(n) for n in names] == [
        "step-0000000000.rank-00000.train.parquet",
        "step-0000000001.rank-00000.train.parquet",
        "step-0000000001.rank-00001.train.parquet",
        "step-0000000002.rank-00000.train.parquet",
    ]
    assert all(
        re.fullmatch(r"step-\d{10}\.rank-\d{5}\.train\.t[0-9a-f]{12}\.parquet", n) for n in names
    )
    assert sorted(p.name for p in (root / "steps").iterdir()) == names
    assert store.committed_files("groups") == [root / "groups" / n for n in names]
    assert store.committed_files("steps") == [root / "steps" / n for n in names]
    # One log entry per commit: the attempt, then the four appends.
    entries = sorted(p.name for p in (root / "log").glob("0*.json"))
    assert entries == [f"{v:020d}.json" for v in range(1, 6)]
    ops = [json.loads((root / "log" / e).read_text())["op"] for e in entries]
    assert ops == ["attempt", "append", "append", "append", "append"]
    # and the log's head: the newest version committed (the evidence of a lost entry)
    assert json.loads((root / "log" / "_head.json").read_text()) == {"version": 5}


def test_parquet_file_properties(store):
    path = store.committed_files()[0]
    meta = pq.ParquetFile(path).metadata
    rg = meta.row_group(0)
    for i in range(rg.num_columns):
        col = rg.column(i)
        top = col.path_in_schema.split(".")[0]
        assert col.compression == "ZSTD"
        assert col.is_stats_set == (top in ("step", "rank", "kind", "group_index")), top
        if not R.column(top).dictionary:  # token ids, log-probs, numbers: plain
            assert "RLE_DICTIONARY" not in col.encodings and "PLAIN_DICTIONARY" not in col.encodings
    kv = meta.metadata
    assert kv[b"maxent_arrow.schema_version"] == S.SCHEMA_VERSION.encode()
    assert json.loads(kv[b"maxent_arrow.config"])["tau"] == 0.5


def test_read_and_steps(store):
    assert store.steps() == [0, 1, 2]
    table = store.read()
    assert table.num_rows == 12
    assert table.column("step").to_pylist() == [0] * 3 + [1] * 6 + [2] * 3
    some = store.read(steps=[1], columns=["step", "rank", "q"])
    assert some.column_names == ["step", "rank", "q"]
    assert sorted(set(some.column("rank").to_pylist())) == [0, 1]
    filtered = store.read(
        columns=["q"], filter=(pc.field("step") == 2) & (pc.field("group_index") > 0)
    )
    assert filtered.column_names == ["q"] and filtered.num_rows == 2
    assert filtered.column("q").to_pylist() == make_batch(2).column("q").to_pylist()[1:]
    steps = store.read_steps(columns=["step", "rank", "num_groups"])
    assert steps.to_pylist() == [
        {"step": 0, "rank": 0, "num_groups": 3},
        {"step": 1, "rank": 0, "num_groups": 3},
        {"step": 1, "rank": 1, "num_groups": 3},
        {"step": 2, "rank": 0, "num_groups": 3},
    ]
    with pytest.raises(SchemaError, match="nope"):
        store.read(columns=["nope"])


def test_replay_gives_back_the_appended_batches(store):
    for batch in store.replay():
        original = make_batch(batch.step, rank=batch.rank)
        assert batch.groups.equals(original.groups)
        assert batch.generation_batch == original.generation_batch
        assert records_equal(batch.reference_logprobs, original.reference_logprobs)


@pytest.mark.parametrize("source", ["parquet", "cache"])
def test_a_batch_without_optional_columns_replays_without_them(tmp_path, source):
    """The files carry every layout column (absent ones as nulls, one schema per run, as a
    plain reader sees); replay gives the batch back as appended, from either source."""
    s = RolloutStore.create(tmp_path / "store", cache=True)
    full = make_batch(0)
    lean = make_batch(1)
    lean = RolloutBatch(lean.groups.drop_columns(["weights", "q"]), lean.step_row)
    s.append(full)
    s.append(lean)
    files = sorted((tmp_path / "store" / "groups").glob("*.parquet"))
    schemas = [pq.read_schema(f) for f in files]
    assert schemas[0].names == schemas[1].names
    on_disk = pq.read_table(files[1])
    assert on_disk.column("weights").null_count == on_disk.num_rows
    got = {b.step: b for b in s.replay(source=source)}
    assert "weights" not in got[1].groups.schema.names
    assert "q" not in got[1].groups.schema.names
    assert got[1].groups.equals(lean.groups)
    assert got[0].groups.equals(full.groups)


def test_replay_resumes_from_a_cursor(store):
    full = [
        b.groups.column("q").to_pylist() for b in store.replay(batch_groups=2, shuffle=True, seed=3)
    ]
    stream = store.replay(batch_groups=2, shuffle=True, seed=3)
    head = [next(stream) for _ in range(3)]
    cursor = json.loads(json.dumps(head[-1].cursor))  # survives a JSON checkpoint
    rest = [
        b.groups.column("q").to_pylist()
        for b in store.replay(batch_groups=2, shuffle=True, seed=3, start=cursor)
    ]
    assert [b.groups.column("q").to_pylist() for b in head] + rest == full
    with pytest.raises(StoreError, match="different replay"):
        store.replay(batch_groups=2, shuffle=True, seed=4, start=cursor)


def test_replay_shards_are_disjoint_and_complete(store):
    seen = []
    for rank in range(3):
        for b in store.replay(batch_groups=1, shuffle=True, shard=(rank, 3)):
            seen += [(b.step, b.rank, g) for g in b.groups.column("group_index").to_pylist()]
            assert b.num_samples == len(b.column("completions").flatten())
    assert len(seen) == len(set(seen)) == 12


def test_replay_rank_and_world_size_are_a_deprecated_spelling_of_shard(store):
    """The consumer's share is ``shard=(index, count)``; the old ``rank=``/``world_size=``
    (a word the store also uses for the writer's rank) still gives the same stream, with a
    DeprecationWarning, and a bad shard is an ArgumentError naming it."""
    new = [(b.step, b.rank) for b in store.replay(batch_groups=1, shard=(1, 3))]
    with pytest.warns(DeprecationWarning, match="shard="):
        old = [(b.step, b.rank) for b in store.replay(batch_groups=1, rank=1, world_size=3)]
    assert old == new and new
    for bad in [(3, 3), (-1, 2), (0, 0), (True, 2), "01", (0, 1, 2)]:
        with pytest.raises(ArgumentError, match="shard"):
            store.replay(shard=bad)
    with pytest.raises(ArgumentError, match="not also rank"):
        store.replay(shard=(0, 2), rank=0, world_size=2)


def test_ipc_cache_replay_is_zero_copy(tmp_path):
    """A cache copy is memory-mapped: nothing is decoded or copied, checked (the default: the
    CRC32C of the frame and of each column served, read from the mapping) or not
    (``check_crc=False``)."""
    store = RolloutStore.create(tmp_path / "s", cache=True)
    big = make_batch(0, groups=64, k=(8, 8), max_tokens=256)
    store.append(big)
    assert (store.root / "cache" / "step-0000000000.rank-00000.train.arrow").exists()
    before = pa.total_allocated_bytes()
    (checked,) = store.replay(source="cache")
    assert pa.total_allocated_bytes() - before < big.groups.nbytes / 100
    assert checked.groups.equals(big.groups)
    store = RolloutStore(store.root, check_crc=False)
    before = pa.total_allocated_bytes()
    (batch,) = store.replay(source="cache")
    tokens = batch.ragged("ref_token_logp")  # a torch view of the mapped bytes
    allocated = pa.total_allocated_bytes() - before
    # Only the small step row is decoded; the group data stay in the mapping (no copy).
    assert allocated < big.groups.nbytes / 100, (allocated, big.groups.nbytes)
    assert batch.groups.equals(big.groups)
    assert tokens.values.numel() == big.ragged("ref_token_logp").values.numel()
    before = pa.total_allocated_bytes()
    (decoded,) = store.replay(source="parquet")
    assert pa.total_allocated_bytes() - before > tokens.values.numel() * 4


def test_ipc_cache_copies_stay_served_after_compaction(tmp_path):
    """A segment records the CRC of the group file each unit was appended in, so the copies
    tied to it are still served after ``compact``; verify checks them."""
    store = RolloutStore.create(tmp_path / "s", cache=True)
    batches = [make_batch(s, groups=16, k=(8, 8), max_tokens=64) for s in range(3)]
    for b in batches:
        store.append(b)
    (segment,) = store.compact()
    assert [p.name for p in store.committed_files()] == [segment.name]
    before = pa.total_allocated_bytes()
    got = list(store.replay(source="cache"))
    assert pa.total_allocated_bytes() - before < sum(b.groups.nbytes for b in batches) / 50
    assert [b.groups.equals(o.groups) for b, o in zip(got, batches)] == [True] * 3
    report = store.verify()
    # step file, group file, 3 cache copies, 3 take files and the segment's
    assert report.ok and report.checked == 1 + 1 + 3 + 3 + 1, str(report)
    # A copy that is not of the committed rows is refused by verify and never served.
    cache = store.root / "cache" / "step-0000000001.rank-00000.train.arrow"
    other = RolloutStore.create(tmp_path / "other", cache=True)
    other.append(make_batch(1, seed=99, groups=16, k=(8, 8), max_tokens=64))
    cache.write_bytes((other.root / "cache" / cache.name).read_bytes())
    assert [b.step for b in store.replay(source="auto")] == [0, 1, 2]
    assert next(b for b in store.replay(source="auto") if b.step == 1).groups.equals(
        batches[1].groups
    )
    notes = {n.path: n.problem for n in store.verify().notes}
    assert "not served" in notes[cache]


def test_build_cache_and_source_choice(store):
    with pytest.raises(StoreError, match="no IPC cache"):
        list(store.replay(source="cache"))
    assert store.build_cache() == 4
    assert [b.step for b in store.replay(source="cache")] == [0, 1, 1, 2]


def test_sql_views(store):
    counts = store.sql("SELECT step, count(*) AS n FROM groups GROUP BY step ORDER BY step")
    assert counts.column("n").to_pylist() == [3, 6, 3]
    samples = store.sql(
        "SELECT step, rank, group_index, sample_index, completion, advantage, reward_accuracy "
        "FROM samples ORDER BY step, rank, group_index, sample_index"
    )
    b = make_batch(2)
    mine = samples.filter(pc.field("step") == 2)
    assert mine.column("completion").to_pylist() == b.column("completions").flatten().to_pylist()
    assert mine.column("advantage").to_pylist() == b.column("advantages").flatten().to_pylist()
    accuracy = list(b.reward_computation.per_reward_values["accuracy"])
    assert mine.column("reward_accuracy").to_pylist() == accuracy
    assert store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py() == sum(
        make_batch(s, rank=r).num_samples for s, r in [(0, 0), (1, 0), (1, 1), (2, 0)]
    )
    assert store.sql("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == 4
    kinds = store.sql("SELECT DISTINCT kind FROM samples").column("kind").to_pylist()
    assert kinds == ["train"]
    with pytest.raises(StoreError, match="nosuchtable"):
        store.sql("SELECT * FROM nosuchtable")


def test_empty_store(tmp_path):
    store = RolloutStore.create(tmp_path / "empty")
    assert store.steps() == [] and store.committed_files() == []
    assert store.read().num_rows == 0
    assert list(store.replay()) == []
    assert store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py() == 0
    assert store.verify().ok


def test_reward_added_mid_run_changes_no_schema_and_reads_as_nulls(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0, reward_names=("accuracy",)))
    schema = store.schema()
    store.append(make_batch(1, reward_names=("accuracy", "format")))
    assert store.schema().equals(schema)
    assert pq.read_schema(store.committed_files()[0]).equals(
        pq.read_schema(store.committed_files()[1]), check_metadata=False
    )
    table = store.read(columns=["step", "reward_names"])
    names = table.filter(pc.field("step") == 0).column("reward_names").to_pylist()
    assert all(n == ["accuracy"] for n in names)
    got = store.sql(
        "SELECT step, count(reward_format) AS n FROM samples GROUP BY step ORDER BY step"
    )
    assert got.column("n").to_pylist() == [0, make_batch(1).num_samples]


def test_conflicting_column_type_is_refused_and_store_unchanged(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    before = sorted(p.name for p in store.root.rglob("*"))
    b = make_batch(1)
    groups = b.groups.append_column("extra", pa.array([1] * b.num_groups))
    store.append(RolloutBatch(groups, b.step_row))
    c = make_batch(2)
    bad = c.groups.append_column("extra", pa.array(["x"] * c.num_groups))
    before = sorted(p.name for p in store.root.rglob("*"))
    with pytest.raises(SchemaError, match="extra.*int64.*string"):
        store.append(RolloutBatch(bad, c.step_row))
    # A type that pyarrow would silently promote (int64 -> double) is refused as well.
    widened = c.groups.append_column("extra", pa.array([1.5] * c.num_groups))
    with pytest.raises(SchemaError, match="'extra' changed type from int64 to double"):
        store.append(RolloutBatch(widened, c.step_row))
    assert sorted(p.name for p in store.root.rglob("*")) == before
    assert store.steps() == [0, 1]


def test_duplicate_append_is_refused(store):
    with pytest.raises(StoreError, match="already in the store"):
        store.append(make_batch(1))
    assert store.read(steps=[1]).num_rows == 6


def test_newer_schema_major_is_refused(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    manifest = store.root / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "schema_version": "4.0"}))
    with pytest.raises(SchemaVersionError, match="4.0"):
        RolloutStore(store.root)
    manifest.write_text(json.dumps(data))
    # A file written by a newer major: readers refuse it by name.
    path = store.committed_files()[0]
    table = pq.read_table(path)
    meta = {**table.schema.metadata, b"maxent_arrow.schema_version": b"3.1"}
    newer = tmp_path / "newer.parquet"
    pq.write_table(table.replace_schema_metadata(meta), newer)
    os.replace(newer, path)
    with pytest.raises(SchemaVersionError, match=path.name):
        RolloutStore(store.root).schema()


def test_paths_that_escape_the_store_are_refused(tmp_path):
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(b"not yours")
    with pytest.raises(StoreError, match="not a directory"):
        RolloutStore(outside)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(StoreError, match="not a rollout store"):
        RolloutStore.create(tmp_path / "junk")
    with pytest.raises(StoreError, match="file system root"):
        RolloutStore("/")
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    # A committed group file swapped for a symlink out of the store is refused by name.
    path = store.committed_files()[0]
    target = tmp_path / "elsewhere.parquet"
    os.replace(path, target)
    path.symlink_to(target)
    with pytest.raises(StoreError, match="outside the store"):
        store.read()
    with pytest.raises(SchemaError, match="kind"):
        RolloutBatch.from_parts(0, kind="../../etc", **make_parts())


def test_compact_merges_atomically(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    for step in range(5):
        store.append(make_batch(step))
    store.append(make_batch(0, kind="eval"))
    before = store.read()
    made = store.compact(kind="train", max_steps=3)
    names = [p.name for p in made]
    assert len(names) == 2
    assert names[0].startswith("compact-0000000000-0000000002.train.r00000-00000.")
    assert names[1].startswith("compact-0000000003-0000000004.train.r00000-00000.")
    assert store.read().equals(before)
    assert [b.step for b in store.replay()] == [0, 1, 2, 3, 4]
    assert len(store.committed_files()) == 3
    with pytest.raises(StoreError, match="already in the store"):
        store.append(make_batch(1))
    store.append(make_batch(5))
    assert store.steps(kind="train") == [0, 1, 2, 3, 4, 5]
    assert store.verify().ok


def test_compact_crash_before_cleanup_shows_no_duplicates(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    for step in range(3):
        store.append(make_batch(step))
    before = store.read()
    originals = {p: p.read_bytes() for p in store.root.glob("*/step-*.parquet")}
    store.compact()
    for path, data in originals.items():  # as if the process died before deleting them
        path.write_bytes(data)
    assert store.read().equals(before)  # hidden by the compacted file's `replaces`
    RolloutStore(store.root)  # opening only reads: the leftovers stay until repair
    assert all(p.exists() for p in originals)
    report = store.repair()
    assert len(report.moved) == len(originals)
    assert not any(p.exists() for p in originals)
    assert store.read().equals(before) and store.verify().ok
    # Retired, as the compaction would have done: readers pinned before it still find them.
    assert len(list((store.root / "retired").rglob("*.parquet"))) == len(originals)


READER_SCRIPT = textwrap.dedent(
    """
    import sys, json
    root = sys.argv[1]
    import glob
    # The layout's rule: a group file is committed when its step file exists.
    names = [p.rsplit("/", 1)[1] for p in glob.glob(root + "/steps/step-*.parquet")]
    groups = sorted(root + "/groups/" + n for n in names)
    import duckdb
    n = duckdb.sql(
        "SELECT count(*) FROM read_parquet(" + repr(groups) + ", union_by_name=true)"
    ).fetchall()[0][0]
    import pyarrow.dataset as ds
    d = ds.dataset(groups, format="parquet")
    tokens = d.to_table(columns=["completion_ids"]).column("completion_ids").to_pylist()
    import datasets
    hf = datasets.load_dataset("parquet", data_files=groups, split="train")
    out = {
        "duckdb": n,
        "pyarrow": d.count_rows(),
        "hf": len(hf),
        "hf_q": hf[0]["q"],
        "tokens0": tokens[0],
        "maxent_loaded": "maxent_arrow" in sys.modules,
    }
    print(json.dumps(out))
    """
)


def test_other_tools_read_the_store_without_maxent_arrow(store, tmp_path):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", READER_SCRIPT, str(store.root)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["duckdb"] == out["pyarrow"] == out["hf"] == 12
    first = make_batch(0)
    assert out["hf_q"] == first.column("q")[0].as_py()
    assert out["tokens0"] == first.column("completion_ids")[0].as_py()
    assert out["maxent_loaded"] is False


def test_temp_files_are_ignored_and_only_repair_moves_them(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    # A temp file of a writer that died (this host, a pid that does not exist).
    dead = store.root / "steps" / ".step-0000000001.rank-00000.train.parquet.tmp-x.999999.abc"
    dead.write_bytes(b"partial")
    assert not dead.name.endswith(".parquet")  # invisible to plain *.parquet globs
    assert store.steps() == [0]
    assert any("temp file" in str(n) for n in store.verify().notes)
    RolloutStore(store.root)
    assert dead.exists()  # opening removes nothing
    old = os.stat(dead).st_mtime - 2 * 86400
    os.utime(dead, (old, old))
    report = store.repair()
    assert not dead.exists() and [p.path for p in report.moved] == [dead]
    assert store.steps() == [0]


def test_append_refuses_non_batches(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    with pytest.raises(SchemaError, match="RolloutBatch"):
        store.append({"step": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("root", [None, 5, b"/tmp/s"])
def test_a_root_that_is_not_a_path_is_an_argument_error(tmp_path, root):
    """Fault probe F05: ``RolloutStore(None)`` and ``RolloutStore(5)`` were a raw TypeError
    of ``os.fspath``; they are an ArgumentError naming the argument (creating one too)."""
    for open_store in (RolloutStore, RolloutStore.create, ReadOnlyStore):
        with pytest.raises(ArgumentError, match=rf"root: expected a store's path .*got {root!r}"):
            open_store(root)  # type: ignore[arg-type]


def test_replay_with_a_negative_seed_is_an_argument_error(tmp_path):
    """Fault probe F05: ``replay(shuffle=True, seed=-1)`` was numpy's ValueError at the
    first batch; it is an ArgumentError naming the seed when the options are made."""
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    with pytest.raises(ArgumentError, match="replay: seed: expected an int >= 0, got -1"):
        store.replay(shuffle=True, seed=-1)
    assert len(list(store.replay(shuffle=True, seed=2**70))) == 1  # any int >= 0


def test_store_root_path_types(tmp_path):
    a = RolloutStore.create(str(tmp_path / "s"))
    a.append(make_batch(0))
    b = RolloutStore(Path(tmp_path / "s"))
    assert b.steps() == [0]
    assert b.config == {}


@pytest.mark.slow
def test_benchmark_quick_runs(tmp_path):
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_store.py"
    out = tmp_path / "store.json"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["name"].split(" (")[0]: r for r in json.loads(out.read_text())["rows"]}
    append = rows["append one step, durable"]
    assert append["baseline"]["label"].startswith("torch.save of padded")
    assert append["peer"]["label"].startswith("torch.save of the ragged")
    assert append["floor"]["label"].startswith("write + fsync")
    assert {t["label"] for t in append["targets"]} == {">= 2x baseline", "<= 2x floor"}
    for name in (
        "replay one step from Parquet, token values used",
        "replay one step from the IPC cache, token values used",
    ):
        assert rows[name]["peer"]["value"] > 0 and len(rows[name]["targets"]) == 1


def test_compression_option(tmp_path):
    fast = RolloutStore.create(tmp_path / "fast", compression="none")
    fast.append(make_batch(0))
    meta = pq.ParquetFile(fast.committed_files()[0]).metadata
    assert meta.row_group(0).column(0).compression == "UNCOMPRESSED"
    default = RolloutStore.create(tmp_path / "zstd")
    default.append(make_batch(0))
    assert fast.read().equals(default.read())
    assert fast.committed_files()[0].stat().st_size > default.committed_files()[0].stat().st_size
    with pytest.raises(StoreError, match="compression"):
        RolloutStore.create(tmp_path / "bad", compression="zip")


def test_schema_is_unified_incrementally(tmp_path):
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0, reward_names=("accuracy",)))
    first = store.schema()
    b = make_batch(1, reward_names=("accuracy", "format"))
    store.append(
        RolloutBatch(b.groups.append_column("extra", pa.array([1] * b.num_groups)), b.step_row)
    )
    assert store.schema().names == [*first.names, "extra"]
    store.compact()
    assert store.schema().equals(RolloutStore(store.root).schema())


def test_writer_merges_small_files_by_policy(tmp_path):
    """``compact_every``: once a rank has that many one-step files of a kind, the append that
    made it so merges them into one segment; other ranks and kinds keep theirs, segments are
    never merged again, and every batch reads back as appended."""
    store = RolloutStore.create(tmp_path / "s", compact_every=3, cache=True)
    appended = [make_batch(s) for s in range(7)] + [make_batch(0, rank=1), make_batch(1, rank=1)]
    appended.append(make_batch(7, kind="eval"))
    for batch in appended:
        store.append(batch)
    names = sorted(p.name for p in store.committed_files("steps"))
    segments = [n for n in names if n.startswith("compact-")]
    assert len(segments) == 2 and len(names) == 2 + 1 + 2 + 1, names
    assert sorted(os.listdir(store.root / "groups")) == sorted(
        p.name for p in store.committed_files()
    )
    got = {(b.step, b.rank, b.kind): b for b in store.replay(kind=None, source="parquet")}
    assert len(got) == len(appended)
    for batch in appended:
        assert got[(batch.step, batch.rank, batch.kind)].groups.equals(batch.groups)
    assert store.verify().ok
    # Three more loose files: one more segment; the two earlier ones are left as they are.
    for s in range(7, 10):
        store.append(make_batch(s))
    again = sorted(p.name for p in store.committed_files("steps"))
    assert set(segments) <= set(again) and len([n for n in again if n.startswith("compact-")]) == 3
    off = RolloutStore.create(tmp_path / "off", compact_every=None)
    for batch in appended[:7]:
        off.append(batch)
    assert len(off.committed_files()) == 7
    with pytest.raises(StoreError, match="compact_every"):
        RolloutStore(tmp_path / "off", compact_every=1)


def test_a_failed_merge_warns_and_keeps_the_append(tmp_path):
    store = RolloutStore.create(tmp_path / "s", compact_every=2)
    store.append(make_batch(0))
    damaged = store.committed_files()[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="the append is committed, but merging the 2 one-step"):
        store.append(make_batch(1))
    assert store.steps() == [0, 1]
    assert [p.name for p in store.committed_files()][1].startswith("step-0000000001")
    assert [p.path for p in store.verify().problems] == [damaged]


def _split_by_rank(batch: RolloutBatch, ranks: int = 2) -> list[RolloutBatch]:
    """The parts of ``batch``'s groups that ``ranks`` processes would hold (completion i of
    each group on rank i % ranks), as TRL's sampler spreads them."""
    from maxent_arrow.arrow import schema as S

    rows = batch.groups.to_pylist()
    per_completion = [c for c in S.PER_COMPLETION_COLUMNS if c in batch.groups.column_names]
    out = []
    for rank in range(ranks):
        part = []
        for row in rows:
            keep = [i for i in range(row["num_completions"]) if i % ranks == rank]
            new = dict(row, rank=rank, num_completions=len(keep), completion_index=keep)
            for column in per_completion:
                if column != "completion_index" and row[column] is not None:
                    new[column] = [row[column][i] for i in keep]
            part.append(new)
        groups = pa.Table.from_pylist(part, schema=batch.groups.schema)
        step_row = batch.step_row.to_pylist()[0]
        step_row.update(rank=rank, num_samples=sum(len(p["completions"]) for p in part))
        out.append(
            RolloutBatch(groups, pa.Table.from_pylist([step_row], schema=batch.step_row.schema))
        )
    return out


@pytest.mark.parametrize("source", ["parquet", "cache"])
def test_replay_whole_groups_merges_what_ranks_stored_of_each_group(tmp_path, source):
    store = RolloutStore.create(tmp_path / "s", cache=True)
    whole = {s: make_batch(s, groups=4, k=(3, 5)) for s in range(3)}
    for batch in whole.values():
        for part in _split_by_rank(batch):
            store.append(part)
    plain = list(store.replay(source=source))
    assert [(b.step, b.rank) for b in plain] == [(s, r) for s in range(3) for r in (0, 1)]
    merged = list(store.replay(source=source, whole_groups=True))
    assert [b.step for b in merged] == [0, 1, 2]
    for batch in merged:
        expected = whole[batch.step]
        for name in ("group_id", "completions", "completion_ids", "advantages", "q"):
            assert batch.groups.column(name).to_pylist() == expected.column(name).to_pylist()
        assert batch.step_row.column("num_groups")[0].as_py() == expected.groups.num_rows
    # Resumable and shardable like any replay; shuffling keeps each group whole.
    first = list(store.replay(source=source, whole_groups=True, start=merged[0].cursor))
    assert [b.step for b in first] == [1, 2]
    shards = [[b.step for b in store.replay(whole_groups=True, shard=(r, 2))] for r in (0, 1)]
    assert sorted(shards[0] + shards[1]) == [0, 1, 2] and not set(shards[0]) & set(shards[1])
    shuffled = list(store.replay(whole_groups=True, shuffle=True, seed=3))
    for batch in shuffled:
        got = dict(
            zip(batch.column("group_id").to_pylist(), batch.column("completions").to_pylist())
        )
        want = dict(
            zip(
                whole[batch.step].column("group_id").to_pylist(),
                whole[batch.step].column("completions").to_pylist(),
            )
        )
        assert got == want
    with pytest.raises(ArgumentError, match="batch_groups"):
        store.replay(whole_groups=True, batch_groups=2)
    # The SQL views count a group once, whichever ranks hold its parts.
    n = store.sql("SELECT count(DISTINCT group_id) AS n FROM samples WHERE step = 0")
    assert n.column("n")[0].as_py() == 4
    from maxent_arrow.analytics.run import RunAnalytics

    with RunAnalytics(store) as run:
        for table in (run.success_rate(), run.zero_variance_groups()):
            assert table.column("num_groups").to_pylist() == [4, 4, 4]
        run.materialize()  # the in-memory path groups the same way
        assert run.zero_variance_groups().column("num_groups").to_pylist() == [4, 4, 4]
