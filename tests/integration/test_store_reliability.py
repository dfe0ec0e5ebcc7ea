"""The store under crashes, concurrent writers, damaged files, a full disk and a read-only
directory, with real subprocesses (SIGKILL, RLIMIT_FSIZE, an unprivileged user)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from store_fixtures import make_batch

from maxent_arrow import RolloutStore, StoreError

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}

WRITER = textwrap.dedent(
    """
    import sys
    from store_fixtures import make_batch
    from maxent_arrow import RolloutStore
    root, rank, last, ahead = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    groups = int(sys.argv[5])
    store = RolloutStore.create(root, cache=True)
    done = set(store.steps(rank=rank))
    todo = [s for s in range(last) if s not in done][:ahead]
    batches = [make_batch(s, rank=rank, groups=groups, k=(4, 8), max_tokens=128) for s in todo]
    print("READY", flush=True)
    for batch in batches:
        print("BEGIN", batch.step, flush=True)
        store.append(batch)
        print("ACK", batch.step, flush=True)
    print("DONE", flush=True)
    """
)


def _expected(step: int, rank: int = 0, groups: int = 24):
    return make_batch(step, rank=rank, groups=groups, k=(4, 8), max_tokens=128)


def _check_store(root: Path, acked: set[int], *, contents: set[int]) -> list[int]:
    """Open the store (cleaning up), check nothing acknowledged is lost, nothing is visible
    twice or half-written, and that the steps in ``contents`` hold exactly what was appended."""
    store = RolloutStore(root)
    steps = store.read_steps(columns=["step"]).column("step").to_pylist()
    assert len(steps) == len(set(steps)), f"a step is visible twice: {sorted(steps)}"
    assert acked <= set(steps), f"acknowledged steps lost: {sorted(acked - set(steps))}"
    report = store.verify()
    assert report.ok, str(report)
    for source in ("parquet", "auto"):
        for batch in store.replay(steps=sorted(contents & set(steps)), source=source):
            assert batch.groups.equals(_expected(batch.step).groups)
    return sorted(steps)


@pytest.mark.slow
def test_sigkill_while_appending_loses_nothing_acknowledged(tmp_path):
    root = tmp_path / "store"
    rng = random.Random(1234)
    acked: set[int] = set()
    kills = 0
    visible: list[int] = []
    midway = 0
    while kills < 20:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), "0", "1000", "6", "24"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        # Kill inside the n-th append: right after the writer says it begins one, at a random
        # point of its first few milliseconds (an append encodes, writes, fsyncs and renames
        # two files: tens of ms), whatever the machine's speed.
        target, seen, early = rng.randint(1, 4), 0, []
        while seen < target:
            line = proc.stdout.readline()
            if not line:
                break
            early.append(line)
            seen += line.startswith("BEGIN")
        time.sleep(rng.uniform(0.0, 0.005))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        out = "".join(early) + out
        assert proc.returncode == -signal.SIGKILL, out
        acked |= {int(line.split()[1]) for line in out.splitlines() if line.startswith("ACK")}
        kills += 1
        # Evidence the kill landed inside an append: a temp file or an uncommitted group file.
        steps_done = {p.name for p in (root / "steps").glob("step-*")}
        orphans = [p for p in (root / "groups").glob("step-*") if p.name not in steps_done]
        midway += bool(orphans or list(root.rglob(".tmp-*")))
        new = _check_store(root, acked, contents=set(range(1000)) - set(visible))
        acked |= set(new)  # once visible, a step must stay visible
        visible = new
    assert len(acked) >= 10  # the writer made progress between kills
    print(f"{kills} kills, {midway} inside an append, {len(acked)} steps acknowledged")
    assert midway >= 3, midway  # and several kills interrupted an append half-way
    # Leftovers of the killed writers are cleaned at open and never visible.
    RolloutStore(root)
    leftovers = [p for p in root.rglob(".tmp-*")]
    assert leftovers == []


@pytest.mark.slow
def test_concurrent_ranks_append_without_collision(tmp_path):
    root = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(rank), "6", "6", "6"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for rank in range(4)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.strip().endswith("DONE")
    store = RolloutStore(root)
    units = store.read_steps(columns=["step", "rank"]).to_pylist()
    assert sorted((u["step"], u["rank"]) for u in units) == [
        (s, r) for s in range(6) for r in range(4)
    ]
    assert store.verify().ok
    for batch in store.replay(source="cache"):
        expected = make_batch(batch.step, rank=batch.rank, groups=6, k=(4, 8), max_tokens=128)
        assert batch.groups.equals(expected.groups)


RACE = textwrap.dedent(
    """
    import sys
    from store_fixtures import make_batch
    from maxent_arrow import RolloutStore, StoreError
    store = RolloutStore.create(sys.argv[1])
    batch = make_batch(7, seed=int(sys.argv[2]), groups=40, max_tokens=64)
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        store.append(batch)
        print("WON", sys.argv[2], flush=True)
    except StoreError as exc:
        print("LOST", exc, flush=True)
    """
)


@pytest.mark.slow
def test_two_writers_of_the_same_step_one_wins(tmp_path):
    root = tmp_path / "store"
    RolloutStore(root)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(root), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for seed in (1, 2)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "READY"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    won = [o for o in outs if o.startswith("WON")]
    assert len(won) == 1 and sum(o.startswith("LOST") for o in outs) == 1, outs
    assert "already in the store" in next(o for o in outs if o.startswith("LOST"))
    seed = int(won[0].split()[1])
    store = RolloutStore(root)
    (batch,) = store.replay()
    assert batch.groups.equals(make_batch(7, seed=seed, groups=40, max_tokens=64).groups)
    assert store.verify().ok


# ---------------------------------------------------------------------------- damage
@pytest.fixture
def damaged(tmp_path):
    store = RolloutStore.create(tmp_path / "store", cache=True)
    for step in range(4):
        store.append(make_batch(step))
    return store


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", [_truncate, _flip, lambda p: _flip(p, 0.05), lambda p: _flip(p, 0.97)]
)
def test_damaged_group_file_is_named(damaged, damage):
    path = damaged.committed_files()[1]
    damage(path)
    report = damaged.verify()
    assert [p.path for p in report.problems] == [path]
    with pytest.raises(StoreError, match=path.name):
        damaged.read()
    with pytest.raises(StoreError, match=path.name):
        list(damaged.replay(source="parquet"))
    with pytest.raises(StoreError, match=path.name):
        damaged.sql("SELECT count(*) FROM groups") if damage is _truncate else damaged.read(
            columns=["q"]
        )
    with pytest.warns(UserWarning, match=path.name):
        table = damaged.read(on_error="skip")
    assert sorted(set(table.column("step").to_pylist())) == [0, 2, 3]
    with pytest.warns(UserWarning, match=path.name):
        assert [b.step for b in damaged.replay(source="parquet", on_error="skip")] == [0, 2, 3]


@pytest.mark.parametrize("damage", [_truncate, _flip])
def test_damaged_step_file_is_named(damaged, damage):
    path = damaged.committed_files("steps")[2]
    damage(path)
    report = damaged.verify()
    assert path in [p.path for p in report.problems]
    with pytest.raises(StoreError, match=path.name):
        damaged.read()
    with pytest.warns(UserWarning, match=path.name):
        table = damaged.read(on_error="skip")
    with pytest.warns(UserWarning, match=path.name):
        assert damaged.steps(on_error="skip") == [0, 1, 3]
    assert sorted(set(table.column("step").to_pylist())) == [0, 1, 3]


def test_missing_group_file_and_damaged_cache_are_named(damaged):
    missing = damaged.committed_files()[0]
    cache = damaged.root / "cache" / "step-0000000003.rank-00000.train.arrow"
    missing.unlink()
    _truncate(cache)
    problems = {p.path: p.problem for p in damaged.verify().problems}
    assert set(problems) == {damaged.root / "groups" / missing.name, cache}
    assert "missing" in problems[damaged.root / "groups" / missing.name]
    with pytest.raises(StoreError, match=cache.name):
        list(damaged.replay(steps=[3], source="cache"))
    # "auto" falls back to the archive when a cache copy is unreadable.
    (batch,) = damaged.replay(steps=[3], source="auto")
    assert batch.groups.equals(make_batch(3).groups)


def test_bit_flip_in_cache_is_found_by_verify(damaged):
    cache = damaged.root / "cache" / "step-0000000001.rank-00000.train.arrow"
    _flip(cache, 0.5)
    assert [p.path for p in damaged.verify().problems] == [cache]


# ---------------------------------------------------------------------------- full disk
FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from store_fixtures import make_batch
    from maxent_arrow import RolloutStore, StoreError
    store = RolloutStore.create(sys.argv[1])
    batch = make_batch(5, groups=64, max_tokens=512)
    # Writes past the limit fail with EFBIG (the signal would kill us instead).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    try:
        store.append(batch)
        print("APPENDED")
    except StoreError as exc:
        print("ERROR", exc.errno, exc)
    """
)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_full_disk_is_a_clear_error_and_the_store_is_unchanged(tmp_path):
    store = RolloutStore.create(tmp_path / "store")
    store.append(make_batch(0))
    before = _snapshot(store.root)
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(store.root)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ERROR 27"), done.stdout  # EFBIG
    assert "file size limit" in done.stdout and "step-0000000005" in done.stdout
    assert _snapshot(store.root) == before
    assert RolloutStore(store.root).steps() == [0]


READ_ONLY = textwrap.dedent(
    """
    import os, sys
    from store_fixtures import make_batch
    from maxent_arrow import RolloutStore, StoreError
    import maxent_arrow.store.read, maxent_arrow.store.admin, maxent_arrow.store.replay
    batch = make_batch(1)
    if os.geteuid() == 0:
        # Root ignores permissions: drop to an unprivileged user (after the imports, which
        # live under /root here).
        os.setgid(65534)
        os.setuid(65534)
    store = RolloutStore.create(sys.argv[1])
    print("STEPS", store.steps())
    try:
        store.append(batch)
        print("APPENDED")
    except StoreError as exc:
        print("ERROR", exc)
    """
)


def test_read_only_directory_is_a_clear_error(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="ro-store-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        store = RolloutStore(base / "store")
        store.append(make_batch(0))
        for path in [store.root, *store.root.rglob("*")]:
            os.chmod(path, 0o555 if path.is_dir() else 0o444)
        before = _snapshot(store.root)
        env = {**ENV, "HOME": str(base)}
        done = subprocess.run(
            [sys.executable, "-c", READ_ONLY, str(store.root)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "STEPS [0]"
        assert lines[1].startswith("ERROR") and "permission denied" in lines[1], lines
        assert _snapshot(store.root) == before
    finally:
        for path in [base, *base.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        shutil.rmtree(base)


def test_cursor_json_is_plain(damaged):
    batch = next(damaged.replay())
    assert json.loads(json.dumps(batch.cursor)) == batch.cursor


def test_group_file_of_a_crashed_commit_is_removed_for_plain_file_readers(tmp_path):
    """A crash between the group rename and the step rename leaves a group file without its
    commit marker: invisible to the store, and removed at the next open so that DuckDB over
    ``groups/*.parquet`` never counts it. A fresh one (a commit in flight) is left alone."""
    import duckdb

    root = tmp_path / "store"
    store = RolloutStore(root)
    store.append(make_batch(0))
    store.append(make_batch(1))
    committed = root / "groups" / "step-0000000001.rank-00000.train.parquet"
    crashed = root / "groups" / "step-0000000002.rank-00000.train.parquet"
    in_flight = root / "groups" / "step-0000000003.rank-00000.train.parquet"
    shutil.copy(committed, crashed)
    shutil.copy(committed, in_flight)
    old = time.time() - 3600
    os.utime(crashed, (old, old))
    assert RolloutStore(root).steps() == [0, 1]
    assert not crashed.exists() and in_flight.exists()
    glob = str(root / "groups" / "step-000000000[012]*.parquet")
    rows = duckdb.sql(f"SELECT count(*) FROM read_parquet('{glob}')").fetchall()[0][0]
    assert rows == make_batch(0).num_groups + make_batch(1).num_groups
