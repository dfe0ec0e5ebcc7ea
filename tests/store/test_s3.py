"""One RolloutStore on object storage, against a real S3-compatible server: moto in server mode
on 127.0.0.1, started by these tests on a free port, spoken to over HTTP by pyarrow's S3 file
system (the same client code as for AWS). Every remote result is compared with a local store
holding the same batches. The first tests use the object-store backend on pyarrow's local file
system and need no ``s3`` extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from fault_harness import env  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.analytics import RunAnalytics, describe_run  # noqa: E402
from maxent_arrow.errors import StoreError  # noqa: E402
from maxent_arrow.store.storage.backend import ArrowFsBackend, LocalBackend  # noqa: E402
from maxent_arrow.store.storage.names import unit_of  # noqa: E402
from maxent_arrow.testing import CONFIG, make_batch, unit_path  # noqa: E402


def test_object_store_backend_files_are_local_store_files(tmp_path: Path) -> None:
    """The object-store backend (one PUT per file) on pyarrow's local file system writes what
    the local backend (temp files, renames, fsync) reads and checks, and the reverse."""
    root = tmp_path / "store"
    remote = RolloutStore.create(
        ArrowFsBackend(pafs.LocalFileSystem(), str(root), str(root)), config=CONFIG
    )
    assert not remote.backend.can_rewrite and not remote.backend.can_mmap
    batches = [make_batch(step, rank=rank) for step in range(2) for rank in range(2)]
    for batch in batches:
        remote.append(batch)
    local = RolloutStore(root)
    assert isinstance(local.backend, LocalBackend)
    assert local.verify().ok  # sealed step files, sizes, CRC-32s as recorded
    assert local.read().equals(remote.read())
    local.append(make_batch(2))
    assert remote.steps() == [0, 1, 2]
    assert remote.read(steps=[2]).equals(local.read(steps=[2]))


def _uri(endpoint: str, prefix: str) -> str:
    return f"s3://runs/{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


@pytest.fixture(scope="module")
def pair(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[RolloutStore, RolloutStore]:
    """The same appends to an S3 store (created by URI) and to a local store."""
    endpoint, _ = s3
    remote = RolloutStore.create(_uri(endpoint, "run-1"), config=CONFIG)
    local = RolloutStore.create(tmp_path_factory.mktemp("local") / "store", config=CONFIG)
    batches = [make_batch(step, rank=rank) for step in range(3) for rank in range(2)]
    batches.append(make_batch(1, rank=1, kind="eval", groups=2))
    for batch in batches:
        remote.append(batch)
        local.append(batch)
    return remote, local


def test_appends_and_reads_equal_a_local_store(pair) -> None:
    remote, local = pair
    assert remote.steps() == local.steps() == [0, 1, 2]
    assert len(remote) == len(local) == 7
    assert remote.config == local.config == CONFIG
    assert remote.read().equals(local.read())
    assert remote.read_steps().equals(local.read_steps())
    assert remote.schema("groups").equals(local.schema("groups"))
    subset = dict(steps=[1], columns=["step", "rank", "weights"], kind="train")
    assert remote.read(**subset).equals(local.read(**subset))
    # The same units, each under a name of its own commit (the unit's name and a token).
    assert [unit_of(p.name) for p in remote.committed_files("groups")] == [
        unit_of(p.name) for p in local.committed_files("groups")
    ]


def test_replay_sharded_by_rank_reads_each_group_once(pair) -> None:
    remote, local = pair

    def keys(batches) -> list[tuple[int, int, int]]:
        out = []
        for b in batches:
            ids = b.groups.column("group_index").to_pylist()
            out += [(b.step, b.rank, g) for g in ids]
        return out

    shards = [keys(remote.replay(shard=(r, 2), batch_groups=2)) for r in range(2)]
    assert not set(shards[0]) & set(shards[1])
    everything = local.read(kind="train", columns=["step", "rank", "group_index"]).to_pydict()
    expected = set(zip(everything["step"], everything["rank"], everything["group_index"]))
    assert set(shards[0]) | set(shards[1]) == expected
    assert len(shards[0]) + len(shards[1]) == len(expected)
    # The same plan as the local store's replay, batch by batch.
    for r in range(2):
        ours = list(remote.replay(shard=(r, 2), batch_groups=2, shuffle=True, seed=3))
        theirs = list(local.replay(shard=(r, 2), batch_groups=2, shuffle=True, seed=3))
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert a.groups.equals(b.groups) and a.step_row.equals(b.step_row)
    with pytest.raises(StoreError, match="no IPC cache"):
        list(remote.replay(source="cache"))


def test_duckdb_queries_equal_local(pair) -> None:
    remote, local = pair
    queries = [
        "SELECT step, rank, count(*) AS n, avg(weight) AS w FROM samples "
        "GROUP BY step, rank ORDER BY step, rank",
        "SELECT step, rank, kind, num_samples, reward_mean FROM steps ORDER BY step, rank, kind",
        "SELECT group_index, len(completions) AS k FROM groups WHERE step = 2 ORDER BY rank, 1",
    ]
    for query in queries:
        got, expected = remote.sql(query), local.sql(query)
        assert got.num_rows > 0
        assert got.schema.equals(expected.schema)
        for name in got.column_names:
            a, b = got.column(name).to_pylist(), expected.column(name).to_pylist()
            # Parallel aggregation may sum floats in another order.
            assert a == (
                pytest.approx(b, rel=1e-12)
                if pa.types.is_floating(got.schema.field(name).type)
                else b
            )
    with pytest.raises(StoreError, match="query failed.*nope"):
        remote.sql("SELECT nope FROM groups")


def test_files_are_interchangeable_with_a_local_store(pair, s3, tmp_path: Path) -> None:
    remote, local = pair
    _, fs = s3
    # Download the S3 store: RolloutStore reads it, checksums and all.
    pafs.copy_files(
        "runs/run-1", str(tmp_path / "down"), source_filesystem=fs,
        destination_filesystem=pafs.LocalFileSystem(),
    )  # fmt: skip
    down = RolloutStore(tmp_path / "down")
    assert down.read().equals(local.read())
    assert down.verify().ok
    # Upload the local store: the same class reads it from S3.
    pafs.copy_files(
        str(local.root), "runs/uploaded", source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=fs,
    )  # fmt: skip
    up = RolloutStore("s3://runs/uploaded", filesystem=fs)
    assert up.read().equals(local.read())


def test_commit_rule_refusals_and_damage(s3) -> None:
    endpoint, fs = s3
    store = RolloutStore.create("runs/run-2", filesystem=fs, config=CONFIG)
    first = make_batch(0)
    store.append(first)
    # A crashed append: its group object exists, no commit log entry names it.
    with fs.open_output_stream("runs/run-2/groups/step-0000000005.rank-00000.train.parquet") as f:
        f.write(b"PAR1 partial")
    assert store.steps() == [0]
    before = store.read()
    assert before.num_rows == first.num_groups
    assert before.column("prompt").to_pylist() == first.groups.column("prompt").to_pylist()
    with pytest.raises(StoreError, match="already in the store"):
        store.append(make_batch(0, seed=99))
    assert store.read().equals(before)
    # Damage a committed group object: the read names it.
    name = unit_path(store, "groups", 0).name
    path = f"runs/run-2/groups/{name}"
    with fs.open_input_stream(path) as f:
        data = bytearray(f.read())
    data[64] ^= 0xFF
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))
    with pytest.raises(StoreError, match=rf"{name}: column chunk .*: CRC32C"):
        store.read()
    assert RolloutStore("runs/run-2", filesystem=fs, check_crc=False).steps() == [0]
    # Step objects: copies of the log's records (readers read the log); verify checks them.
    step = f"runs/run-2/steps/{name}"
    with fs.open_input_stream(step) as f:
        data = bytearray(f.read())
    data[40] ^= 0x01
    with fs.open_output_stream(step) as f:
        f.write(bytes(data))
    assert RolloutStore("runs/run-2", filesystem=fs).steps() == [0]
    problems = {str(p.path) for p in RolloutStore("runs/run-2", filesystem=fs).verify().problems}
    assert any(p.endswith(f"steps/{name}") for p in problems), problems
    # A prefix holding other data is not taken for a store.
    with fs.open_output_stream("runs/other/data.csv") as f:
        f.write(b"a,b\n")
    with pytest.raises(StoreError, match="not a rollout store"):
        RolloutStore(_uri(endpoint, "other"))
    with pytest.raises(StoreError, match="not a rollout store"):
        RolloutStore.create(_uri(endpoint, "other"))
    with pytest.raises(StoreError, match="bucket or file system root"):
        RolloutStore("s3://", filesystem=fs)
    # Repair moves other writers' files aside under a lock: local stores only.
    with pytest.raises(StoreError, match="needs a store on a local file system"):
        store.repair()


def test_compaction_on_s3_through_the_commit_log(s3) -> None:
    """Object storage has no rename and no lock, but a store with a commit log compacts
    there: the segment is new objects and one log entry (a conditional create) replacing
    the inputs, which readers that planned before it still read from retired/."""
    endpoint, _ = s3
    store = RolloutStore.create(_uri(endpoint, "compact"))
    for step in range(4):
        store.append(make_batch(step))
    before = store.read()
    stream = store.replay(source="parquet")
    first = next(stream)
    (segment,) = store.compact()
    assert [p.name for p in store.committed_files("groups")] == [segment.name]
    assert RolloutStore(_uri(endpoint, "compact")).read().equals(before)
    assert [first.step, *(b.step for b in stream)] == [0, 1, 2, 3]
    assert RolloutStore(_uri(endpoint, "compact")).verify().ok


def test_one_class_dispatches_on_the_uri(s3, tmp_path: Path) -> None:
    endpoint, _ = s3
    assert isinstance(RolloutStore.create(tmp_path / "a").backend, LocalBackend)
    assert isinstance(RolloutStore.create(f"file://{tmp_path / 'b'}").backend, LocalBackend)
    remote = RolloutStore.create(_uri(endpoint, "run-3"))
    assert isinstance(remote.backend, ArrowFsBackend) and type(remote) is RolloutStore
    assert RolloutStore(remote.backend).steps() == []


def test_replay_dataset_keeps_an_s3_uri(pair) -> None:
    """``ReplayDataset("s3://…")`` opens the S3 store in each worker: the root stays a URI
    (a ``Path`` would make it the local path ``s3:/…``)."""
    from maxent_arrow.store import ReplayDataset

    remote, local = pair
    dataset = ReplayDataset(remote.uri, shard=(0, 1))
    assert dataset.root == remote.uri
    got = [(b.step, b.rank, b.groups) for b in dataset]
    want = [(b.step, b.rank, b.groups) for b in local.replay()]
    assert [g[:2] for g in got] == [w[:2] for w in want] and got
    assert all(a[2].equals(b[2]) for a, b in zip(got, want))


def test_a_lost_step_object_is_reported_by_verify(s3) -> None:
    """Object storage keeps no trace of an unfinished append, but the commit log says what
    was committed: a lost step object is a problem naming its step, and an object no entry
    names (an append that did not finish) is a note."""
    endpoint, fs = s3
    store = RolloutStore.create(_uri(endpoint, "lost-step"))
    for step in range(3):
        store.append(make_batch(step))
    name = unit_path(store, "steps", 1).name
    fs.delete_file(f"runs/lost-step/steps/{name}")
    with fs.open_output_stream(
        "runs/lost-step/groups/step-0000000007.rank-00000.train.parquet"
    ) as f:
        f.write(b"PAR1 partial")
    report = RolloutStore(_uri(endpoint, "lost-step")).verify()
    (problem,) = report.problems
    assert str(problem.path).endswith(name) and "lost: the step file of step 1" in problem.problem
    assert any("step-0000000007" in str(n.path) for n in report.notes)


def test_a_commit_to_s3_without_boto3_is_refused_naming_the_extra(s3) -> None:
    """Without boto3 there is no conditional create on S3, and ranks commit at the same
    instant: the writer refuses (exit 3's MissingExtraError) instead of racing for a log
    version. Run where boto3 cannot be imported, as on an install without the extra."""
    endpoint, _ = s3
    script = (
        "import sys; sys.modules['boto3'] = None\n"
        "from maxent_arrow.testing import make_batch\n"
        "from maxent_arrow import RolloutStore\n"
        "from maxent_arrow.errors import MissingExtraError\n"
        f"store = RolloutStore.create({_uri(endpoint, 'no-boto3')!r})\n"
        "try:\n"
        "    store.append(make_batch(0))\n"
        "except MissingExtraError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env(), timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout and "pip install 'maxent-arrow[s3]'" in done.stdout
    # Nothing was committed: a reader with boto3 sees an empty store.
    assert RolloutStore(_uri(endpoint, "no-boto3")).steps() == []


def test_inspect_from_the_log_equals_local(pair) -> None:
    """``maxent-arrow inspect`` (``describe_run``) of a store on S3: the log's summaries and
    one LIST of groups/; the counts are the local store's, and the scan of the step rows'."""
    remote, local = pair
    got, expected = describe_run(remote), describe_run(local)
    keys = ("kinds", "ranks", "group_rows", "reward_functions", "files", "run_config")
    assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}
    assert got["kinds"]["train"]["step_rows"] == 6 and got["ranks"] == [0, 1]
    with RunAnalytics(remote) as run:
        assert run.describe_from_views() == got


def test_an_object_overwritten_while_it_is_read_is_read_whole(s3) -> None:
    """The log's head (and the checkpoint pointer) is overwritten by every commit while other
    ranks read it: a read must give one whole version of it, never the new bytes cut at the
    old size (pyarrow's S3 stream asks for the size first, then GETs that many bytes: a
    rank's `{"version": 10` once failed a four-rank commit race)."""
    import threading

    import boto3

    endpoint, fs = s3
    backend = ArrowFsBackend(fs, "runs/overwritten", "s3://runs/overwritten")
    versions = [b'{"version": 9}', b'{"version": 10}', b'{"version": 100}']
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}")
    client.put_object(Bucket="runs", Key="overwritten/head.json", Body=versions[0])
    stop = threading.Event()

    def overwrite() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            client.put_object(
                Bucket="runs", Key="overwritten/head.json", Body=versions[n % len(versions)]
            )

    writer = threading.Thread(target=overwrite)
    writer.start()
    try:
        seen = {backend.read("head.json").to_pybytes() for _ in range(400)}
    finally:
        stop.set()
        writer.join()
    assert seen <= set(versions), sorted(seen - set(versions))
    assert len(seen) > 1  # the reads did overlap the overwrites
