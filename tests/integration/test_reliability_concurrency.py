"""Fault class: concurrency. Several writer processes at once: ranks creating one store
together, ranks appending at once (local disk and the S3-compatible server), two writers racing
for the same (step, rank, kind), and a compaction running while other ranks append. Nothing is
lost or doubled, and exactly one writer wins a race.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from fault_harness import COMPACTOR, WRITER, assert_sound, env, expected, run_script

from maxent_arrow import RolloutStore, RunAnalytics, StoreError
from maxent_arrow.cli import EXIT_DATA, main
from maxent_arrow.testing import make_batch

# Their writers are ranks (and relaunches) of one run: one attempt.
pytestmark = pytest.mark.usefixtures("one_launch")


def _spawn(script: str, *args, stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(out)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_ranks_create_one_store_and_append_at_once(tmp_path, request, where):
    if where == "s3":
        endpoint, _ = request.getfixturevalue("s3")
        root = f"s3://runs/concurrent?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    else:
        root = tmp_path / "store"  # does not exist: every rank creates it
    outs = _finish([_spawn(WRITER, root, rank, 0, 4, 4) for rank in range(4)])
    assert all(out.strip().endswith("DONE") for out in outs)
    want = {(s, r): expected(s, r, groups=4) for s in range(4) for r in range(4)}
    assert_sound(RolloutStore(root), want)


RACE = textwrap.dedent(
    """
    import sys
    from maxent_arrow.testing import make_batch
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
    RolloutStore.create(root)
    procs = [_spawn(RACE, root, seed, stdin=True) for seed in (1, 2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [o.strip() for o in _finish(procs)]
    won = [o for o in outs if o.startswith("WON")]
    assert len(won) == 1 and sum(o.startswith("LOST") for o in outs) == 1, outs
    assert "already in the store" in next(o for o in outs if o.startswith("LOST"))
    seed = int(won[0].split()[1])
    store = RolloutStore(root)
    (batch,) = store.replay()
    assert batch.groups.equals(make_batch(7, seed=seed, groups=40, max_tokens=64).groups)
    assert store.verify().ok


@pytest.mark.slow
def test_compaction_while_other_ranks_append(tmp_path):
    root = tmp_path / "store"
    assert run_script(WRITER, root, 0, 0, 4, 4).returncode == 0
    # Rank 0's files are compacted while ranks 1 and 2 append their own steps.
    writers = [_spawn(WRITER, root, rank, 0, 4, 4) for rank in (1, 2)]
    compactor = _spawn(COMPACTOR, root, "[0]")
    _finish([*writers, compactor])
    want = {(s, r): expected(s, r, groups=4) for s in range(4) for r in range(3)}
    store = RolloutStore(root)
    assert_sound(store, want)
    assert any(u.step_file.startswith("compact-") for u in store.units(ranks=[0]))


# ---------------------------------------------------------------- readers and compaction (F12)
COUNT = "SELECT count(*) AS n FROM groups"
SUMS = "SELECT step, sum(q) AS q FROM samples GROUP BY step ORDER BY step"


def _readers(root) -> dict:
    """One of each reader, started (each has read something) before a compaction."""
    streams = {
        "replay parquet": RolloutStore(root).replay(source="parquet"),
        "replay auto (IPC cache)": RolloutStore(root).replay(source="auto"),
        "replay cache": RolloutStore(root).replay(source="cache"),
        "replay skip": RolloutStore(root).replay(source="parquet", on_error="skip"),
        "replay columns": RolloutStore(root).replay(columns=["step", "q"], source="parquet"),
    }
    first = {name: next(stream) for name, stream in streams.items()}
    views = RolloutStore(root).sql_views()
    sql = (views, views.query(SUMS))
    runs = {}
    for materialize in (False, True):
        run = RunAnalytics(RolloutStore(root), materialize=materialize)
        runs[materialize] = (run, run.reward_curve())
    return {"streams": streams, "first": first, "sql": sql, "runs": runs}


def _assert_nothing_dropped(readers: dict, want: dict) -> None:
    for name, stream in readers["streams"].items():
        got = [readers["first"][name], *stream]
        assert [b.step for b in got] == sorted(want), name
        for batch in got:
            expected = want[batch.step].groups
            if name == "replay columns":
                expected = expected.select(["step", "q"])
            assert batch.groups.equals(expected), (name, batch.step)
    views, sums = readers["sql"]
    assert views.query(SUMS).equals(sums)
    assert views.query(COUNT).column("n").to_pylist() == [sum(b.num_groups for b in want.values())]
    views.close()
    for run, curve in readers["runs"].values():
        assert run.reward_curve().equals(curve)
        run.close()


@pytest.fixture
def six(tmp_path):
    root = tmp_path / "store"
    store = RolloutStore.create(root, cache=True, compact_every=None)
    want = {step: make_batch(step) for step in range(6)}
    for batch in want.values():
        store.append(batch)
    return root, want


def test_compaction_under_running_readers_drops_nothing(six):
    """Replay (archive, IPC cache, skip, projections), SQL views and the analytics, each
    started before a compaction in another process, go on after it as if nothing happened:
    the compaction's inputs wait in retired/ for them; nothing is dropped or called
    damaged (no warning)."""
    root, want = six
    readers = _readers(root)
    done = run_script(COMPACTOR, root, "null")
    assert done.returncode == 0, done.stderr
    assert len(list((root / "groups").iterdir())) == 1  # one segment replaced the six files
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_nothing_dropped(readers, want)


def test_readers_older_than_the_grace_period_re_plan_or_ask_for_a_refresh(six):
    """Once the retired copies are gone (older than the grace period), replay finds each
    unit where the commit record has it now; SQL views say to refresh, and refreshed they
    answer as before."""
    from maxent_arrow.store.upkeep.compaction import expire_retired

    root, want = six
    store = RolloutStore(root)
    stream = store.replay(source="parquet")
    first = next(stream)
    views = store.sql_views()
    before = views.query(SUMS)
    store.compact()
    assert expire_retired(store.backend, 0.0)  # as a compaction an hour later would
    assert [first.step, *(b.step for b in stream)] == sorted(want)
    with pytest.raises(StoreError, match="refresh"):
        views.query(SUMS)
    views.refresh()
    assert views.query(SUMS).equals(before)
    views.close()


READER = textwrap.dedent(
    """
    import sys, pathlib
    from maxent_arrow import RolloutStore
    from fault_harness import expected
    root, stop = sys.argv[1], pathlib.Path(sys.argv[2])
    passes, seen = 0, 0
    while not stop.exists() or passes == 0:
        store = RolloutStore(root)
        batches = list(store.replay(source="auto"))
        steps = [b.step for b in batches]
        assert steps == sorted(set(steps)), steps
        assert len(steps) >= seen, (steps, seen)  # a unit once visible stays visible
        seen = len(steps)
        for b in batches:
            assert b.groups.equals(expected(b.step, 0, groups=4).groups), b.step
        n = store.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py()
        assert n >= 4 * seen, (n, seen)
        passes += 1
    print("PASSES", passes, "UNITS", seen, flush=True)
    """
)


@pytest.mark.slow
def test_readers_in_other_processes_while_the_writer_compacts(tmp_path):
    """A writer whose small-file policy compacts every 3 appends, and two reader processes
    replaying and querying in a loop meanwhile: no reader ever fails, loses or doubles a
    unit."""
    root = tmp_path / "store"
    RolloutStore.create(root)
    writer = textwrap.dedent(
        """
        import sys
        from maxent_arrow import RolloutStore
        from fault_harness import expected
        store = RolloutStore(sys.argv[1], compact_every=3)
        for step in range(12):
            store.append(expected(step, 0, groups=4))
        print("DONE", flush=True)
        """
    )
    store = RolloutStore(root)
    store.append(expected(0, 0, groups=4))  # something to read from the start
    stop = tmp_path / "stop"
    readers = [_spawn(READER, root, stop) for _ in range(2)]
    done = run_script(writer.replace("range(12)", "range(1, 12)"), root)
    stop.touch()
    outs = _finish(readers)
    assert done.returncode == 0, done.stderr
    assert all(o.startswith("PASSES") for o in outs), outs
    assert_sound(RolloutStore(root), {(s, 0): expected(s, 0, groups=4) for s in range(12)})


# ---------------------------------------------------------------------------- the lock (F20)
APPEND = textwrap.dedent(
    """
    import sys
    from maxent_arrow.testing import make_batch
    from maxent_arrow import RolloutStore, StoreError
    root, step, rank, seed = sys.argv[1], *map(int, sys.argv[2:5])
    timeout = float(sys.argv[5]) if len(sys.argv) > 5 else None
    store = RolloutStore(root, lock_timeout=timeout, compact_every=None)
    batch = make_batch(step, rank=rank, seed=seed, groups=4)
    print("READY", flush=True)
    try:
        store.append(batch)
        print("ACK", flush=True)
    except StoreError as exc:
        print("LOST", exc, flush=True)
    """
)


def _spawn_stopped(point: str, *args) -> subprocess.Popen:
    """A writer that stops itself (SIGSTOP) at the named point of its commit; returned once
    it is stopped there."""
    proc = subprocess.Popen(
        [sys.executable, "-c", APPEND, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env(), "MAXENT_ARROW_STOP_AT": point},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return proc
        if proc.poll() is not None:
            raise AssertionError(f"the writer ended instead of stopping: {proc.stderr.read()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the writer never stopped at {point}")


@pytest.mark.slow
def test_a_stopped_lock_holder_is_named_and_the_wait_can_time_out(tmp_path, capsys):
    """A writer stopped (SIGSTOP) while it holds the store lock holds it until continued:
    others say whom they wait for (pid and host, recorded in the lock) instead of waiting
    silently, and ``lock_timeout`` / ``--lock-timeout`` end the wait with an error naming
    the holder. Continued, every writer finishes."""
    root = tmp_path / "store"
    RolloutStore.create(root).append(make_batch(0, groups=4))
    holder = _spawn_stopped("append:locked", root, 1, 0, 1)
    try:
        timed = run_script(APPEND, root, 1, 1, 1, 2.0, timeout=60)
        assert timed.returncode == 0, timed.stderr
        assert timed.stdout.splitlines()[-1].startswith("LOST")
        assert f"pid {holder.pid} on host {socket.gethostname()}" in timed.stdout
        start = time.monotonic()
        code = main(["repair", str(root), "--lock-timeout", "1"])
        _, err = capsys.readouterr()
        assert code == EXIT_DATA and f"pid {holder.pid}" in err and time.monotonic() - start < 30
        waiting = _spawn(APPEND, root, 1, 2, 1)
        line = ""
        deadline = time.monotonic() + 60
        while "waiting for the store lock" not in line and time.monotonic() < deadline:
            line = waiting.stderr.readline()
        assert f"pid {holder.pid}" in line, line
    finally:
        holder.send_signal(signal.SIGCONT)
    out, err = holder.communicate(timeout=120)
    assert out.splitlines()[-1] == "ACK", err
    out, err = waiting.communicate(timeout=120)
    assert out.splitlines()[-1] == "ACK", err
    store = RolloutStore(root)
    assert [store.steps(rank=r) for r in range(3)] == [[0, 1], [], [1]]  # rank 1 gave up
    assert (root / ".lock").read_bytes() == b""  # the holder's record is cleared on release


# ---------------------------------------------------------------- one rank, two writers on S3 (F19)
def _s3_root(endpoint: str, name: str) -> str:
    return f"s3://runs/{name}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


@pytest.mark.slow
def test_a_refused_writer_on_s3_leaves_the_other_writers_group_object(s3):
    """Two writers of one rank on object storage (outside the protocol): the one whose step
    object is refused does not delete the group object, which is the other's commit."""
    endpoint, _ = s3
    root = _s3_root(endpoint, "two-writers-refused")
    RolloutStore.create(root)
    first = _spawn_stopped("append:group-published", root, 5, 0, 1)
    second = run_script(APPEND, root, 5, 0, 2)
    assert second.stdout.splitlines()[-1] == "ACK", second.stderr
    first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert out.splitlines()[-1].startswith("LOST"), (out, err)
    store = RolloutStore(root)
    (batch,) = store.replay()
    assert batch.groups.equals(make_batch(5, seed=2, groups=4).groups)
    assert store.verify().ok


@pytest.mark.slow
def test_two_writers_of_one_rank_on_s3_never_damage_an_acknowledged_step(s3):
    """Two writers of one rank on S3, no lock: each writes objects of a name of its own and
    commits by a conditional PUT of the next log entry, so the one that passed its check
    first and committed second finds the step taken and leaves the other's objects alone."""
    endpoint, _ = s3
    root = _s3_root(endpoint, "two-writers-overwrite")
    RolloutStore.create(root)
    first = _spawn_stopped("append:locked", root, 5, 0, 1)  # checked, not yet written
    second = run_script(APPEND, root, 5, 0, 2)
    assert second.stdout.splitlines()[-1] == "ACK", second.stderr
    first.send_signal(signal.SIGCONT)
    first.communicate(timeout=120)
    (batch,) = RolloutStore(root).replay()  # the acknowledged step, as acknowledged
    assert batch.groups.equals(make_batch(5, seed=2, groups=4).groups)


HOLDER_DIES = textwrap.dedent(
    """
    import os, sys, time
    from maxent_arrow.store.storage.backend import LocalBackend
    with LocalBackend(sys.argv[1]).lock():
        child = os.fork()
        if child == 0:  # keeps the inherited descriptor, and with it the lock
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # and lets the test read its parent's output to the end
            os.dup2(null, 2)
            time.sleep(60)
            os._exit(0)
        print("CHILD", child, "HOLDER", os.getpid(), flush=True)
        os._exit(0)  # the recorded holder dies without unlocking
    """
)


def test_a_lock_whose_recorded_holder_is_dead_is_named_as_such(tmp_path):
    """The kernel releases a dead process's ``flock``; a lock still held after its recorded
    holder died is held by a process that inherited the descriptor (a fork), and the error
    says so instead of naming the dead pid as if it were alive."""
    root = tmp_path / "store"
    RolloutStore.create(root)
    done = run_script(HOLDER_DIES, root)
    _, child, _, holder = done.stdout.split()
    try:
        with pytest.raises(StoreError, match=f"inherited it from pid {holder}.*gone"):
            RolloutStore(root, lock_timeout=0.5).repair()
    finally:
        os.kill(int(child), signal.SIGKILL)
