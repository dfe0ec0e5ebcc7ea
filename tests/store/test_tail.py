"""The live tail (``store.tail``, :mod:`maxent_arrow.store.history.tail`): each unit as its commit
lands, superseded steps as events, a resumable cursor. Real files, real processes: writers
append in subprocesses while the tail runs here, and consumers in subprocesses are killed
with SIGKILL and resumed from their cursor."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from maxent_arrow import RolloutStore
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.tail import TailEvent, watches
from maxent_arrow.store.storage.backend import LocalBackend
from maxent_arrow.testing import CONFIG, make_batch

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

# Appends steps 0..n-1 (rank 0, train), an eval unit after every `eval_every`, sleeping
# `gap` seconds between commits.
WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from maxent_arrow.testing import make_batch
    from maxent_arrow import RolloutStore
    store = RolloutStore({root!r})
    time.sleep({delay})
    for step in range({n}):
        store.append(make_batch(step))
        if {eval_every} and step % {eval_every} == 0:
            store.append(make_batch(step, kind="eval", groups=2))
        time.sleep({gap})
    """
)


def _env() -> dict[str, str]:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _writer(root: Path, n: int, *, gap: float = 0.05, delay: float = 0.0, eval_every: int = 0):
    script = WRITER.format(
        tests=str(TESTS), root=str(root), n=n, gap=gap, delay=delay, eval_every=eval_every
    )
    return subprocess.Popen([sys.executable, "-c", script], env=_env())


def _store(tmp_path: Path, name: str = "store", **kwargs) -> RolloutStore:
    return RolloutStore.create(tmp_path / name, config=CONFIG, **kwargs)


# ---------------------------------------------------------------------------- live delivery
def test_tail_delivers_each_unit_a_writer_process_commits_as_it_lands(tmp_path, monkeypatch):
    store = _store(tmp_path)
    reader = ReadOnlyStore(store.root)
    assert watches(reader.backend) == ("inotify" if sys.platform == "linux" else "poll")
    writer = _writer(store.root, 8, eval_every=3)
    # The tail never lists a directory: it reads the next entry by its name.
    listing = []
    original = LocalBackend.list
    monkeypatch.setattr(
        LocalBackend, "list", lambda self, d: listing.append(d) or original(self, d)
    )
    events = []
    try:
        for event in reader.tail(since=0, timeout=30):
            events.append(event)
            if len(events) == 8 + 3:
                break
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert listing == []
    assert [(e.event, e.step, e.kind) for e in events] == [
        ("step", s, k) for s in range(8) for k in ("train", "eval") if k == "train" or s % 3 == 0
    ]
    versions = [e.version for e in events]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert {e.role for e in events} == {"trainer"} and len({e.attempt for e in events}) == 1
    for event in events:
        # What a consumer needs to read the unit: its rows, wherever they are.
        rows = reader.read(**event.selection)
        assert rows.num_rows == event.num_groups
        assert set(rows.column("step").to_pylist()) == {event.step}
        assert event.unit == f"step-{event.step:010d}.rank-00000.{event.kind}.parquet"
        assert (store.root / event.step_file).is_file()
        assert (store.root / event.group_file).is_file()
        assert set(event.figures) >= {"num_samples", "reward_mean", "total_loss"}
    # How fast (commit to delivery, against polling and a bare inotify watcher) is
    # benchmarks/bench_tail.py's measure, not a unit test's.


def test_polling_delivers_what_inotify_delivers(tmp_path):
    store = _store(tmp_path)
    for step in range(3):
        store.append(make_batch(step))
    reader = ReadOnlyStore(store.root)
    got: dict[bool, list[TailEvent]] = {}

    def follow(inotify: bool) -> None:
        got[inotify] = []
        for event in reader.tail(since=0, timeout=30, poll=0.05, inotify=inotify):
            got[inotify].append(event)
            if len(got[inotify]) == 6:
                return

    threads = [threading.Thread(target=follow, args=(flag,)) for flag in (True, False)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    for step in range(3, 6):
        store.append(make_batch(step))
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=30)
    assert [e.step for e in got[True]] == [e.step for e in got[False]] == list(range(6))
    assert got[True] == got[False]


def test_since_none_starts_at_the_newest_version(tmp_path):
    store = _store(tmp_path)
    store.append(make_batch(0))
    events = store.tail(timeout=30)  # the state is read now: step 0 is behind the cursor

    def later() -> None:
        time.sleep(0.2)
        store.append(make_batch(1))

    thread = threading.Thread(target=later)
    thread.start()
    got = next(events)
    thread.join()
    assert (got.step, got.version) == (1, 3)
    events.close()


# ---------------------------------------------------------------------------- history
def test_a_resume_is_a_superseded_event_naming_the_steps_it_takes_out(tmp_path):
    first = _store(tmp_path, attempt="A")
    for step in range(4):
        first.append(make_batch(step))
    first.append(make_batch(2, kind="eval", groups=2))
    seen = list(first.tail(since=0, timeout=0.2))
    cursor = seen[-1].version
    resumed = RolloutStore(first.root, attempt="B", resume_from=2)
    resumed.append(make_batch(2))
    resumed.append(make_batch(3))
    events = list(ReadOnlyStore(first.root).tail(since=cursor, timeout=0.2))
    gone, *again = events
    assert gone.event == "superseded" and gone.attempt == "B" and gone.resume_from == 2
    assert [dict(u) for u in gone.superseded] == [
        {"step": 2, "rank": 0, "kind": "eval", "attempt": "A"},
        {"step": 2, "rank": 0, "kind": "train", "attempt": "A"},
        {"step": 3, "rank": 0, "kind": "train", "attempt": "A"},
    ]
    assert gone.selection == {"steps": [2, 3]}
    assert [(e.event, e.step, e.attempt) for e in again] == [("step", 2, "B"), ("step", 3, "B")]
    # The whole history from the first commit, and one kind of it.
    assert [(e.event, e.step) for e in first.tail(since=0, timeout=0.1)] == [
        *[("step", s) for s in range(4)],
        ("step", 2),
        ("superseded", None),
        ("step", 2),
        ("step", 3),
    ]
    evals = list(first.tail(since=0, kind="eval", timeout=0.1))
    assert [(e.event, e.kind) for e in evals] == [("step", "eval"), ("superseded", None)]
    assert [u["kind"] for u in evals[1].superseded] == ["eval"]
    # JSON: the figures of a step, the units of a superseded event.
    assert "figures" in again[0].to_json() and "superseded" not in again[0].to_json()
    assert json.loads(json.dumps(gone.to_json()))["superseded"][0]["attempt"] == "A"


def test_a_unit_committed_already_superseded_is_not_delivered(tmp_path):
    """A writer of the old launch still appending after the resume writes steps that are not
    the run's history: the tail leaves them out, as every reader does."""
    old = _store(tmp_path, attempt="A")
    for step in range(3):
        old.append(make_batch(step))
    RolloutStore(old.root, attempt="B", resume_from=1).append(make_batch(1))
    old.append(make_batch(3))  # attempt A, step 3 >= B's resume point: superseded at once
    events = list(old.tail(since=0, timeout=0.1))
    assert [(e.event, e.step, e.attempt) for e in events] == [
        ("step", 0, "A"),
        ("step", 1, "A"),
        ("step", 2, "A"),
        ("superseded", None, "B"),
        ("step", 1, "B"),
    ]
    assert 3 not in ReadOnlyStore(old.root).steps()


# ---------------------------------------------------------------------------- the cursor
def test_since_resumes_after_any_cursor_also_past_a_checkpoint(tmp_path):
    store = _store(tmp_path)
    for step in range(4):
        store.append(make_batch(step))
    checkpointed = store.checkpoint()
    for step in range(4, 7):
        store.append(make_batch(step))
    every = list(store.tail(since=0, timeout=0.05))
    assert [e.step for e in every] == list(range(7))
    last = CommitLog(store.backend).state().version
    for cursor in range(last + 1):
        after = [e for e in every if e.version > cursor]
        assert list(store.tail(since=cursor, timeout=0.05)) == after, cursor
    # The state at a cursor past the checkpoint starts from it; before it, from the entries.
    fresh = CommitLog(store.backend)
    for cursor in (checkpointed - 1, checkpointed, checkpointed + 2, last):
        at = fresh.state_at(cursor)
        assert at.version == cursor
        replayed = CommitLog(store.backend).state_at(0)
        for version in range(1, cursor + 1):
            entry = fresh.entry(version)
            assert entry is not None
            entry.apply(replayed)
        assert sorted(at.units) == sorted(replayed.units)
        assert [a.id for a in at.attempts] == [a.id for a in replayed.attempts]


def test_bad_cursors_and_options_are_refused_at_the_call(tmp_path):
    store = _store(tmp_path)
    store.append(make_batch(0))
    with pytest.raises(StoreError, match="ends at version 2, before version 9"):
        store.tail(since=9)
    for bad in (-1, "3", 1.5, True):
        with pytest.raises(ArgumentError, match="since"):
            store.tail(since=bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="poll"):
        store.tail(poll=-1)
    with pytest.raises(ArgumentError, match="timeout"):
        store.tail(timeout="1")  # type: ignore[arg-type]


def test_a_store_without_a_commit_log_has_no_tail():
    with pytest.raises(StoreError, match="no tail"):
        ReadOnlyStore(ROOT / "data" / "golden_v1").tail()


# ---------------------------------------------------------------------------- consumers killed
# A consumer in its own process: tail from the saved cursor, process each event, save. In
# "at_least_once" it appends what it processed to a log and then saves the cursor (two
# writes: a kill between them repeats one event); in "exactly_once" it saves the cursor
# with what it processed in one atomic write (its checkpoint).
CONSUMER = textwrap.dedent(
    """
    import json, os, sys
    from maxent_arrow.store import ReadOnlyStore
    root, state_dir, mode, timeout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    ckpt = os.path.join(state_dir, "checkpoint.json")
    seen_log = os.path.join(state_dir, "processed.log")

    def save(path, data):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    state = {"cursor": 0, "seen": []}
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            state = json.load(f)
    timeout = float(timeout) if timeout != "none" else None
    for event in ReadOnlyStore(root).tail(since=state["cursor"], timeout=timeout, poll=0.05):
        item = [event.event, event.step, event.version]
        if mode == "at_least_once":
            with open(seen_log, "a") as f:
                f.write(json.dumps(item) + "\\n")
                f.flush()
                os.fsync(f.fileno())
            save(ckpt, json.dumps({"cursor": event.version, "seen": []}))
        else:
            state = {"cursor": event.version, "seen": state["seen"] + [item]}
            save(ckpt, json.dumps(state))
        print(json.dumps(item), flush=True)
    """
)


def _processed(state_dir: Path, mode: str) -> list[list]:
    if mode == "exactly_once":
        path = state_dir / "checkpoint.json"
        return json.loads(path.read_text())["seen"] if path.exists() else []
    path = state_dir / "processed.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_consumer_killed_with_sigkill_resumes_from_its_cursor(tmp_path, mode):
    store = _store(tmp_path)
    n = 20
    writer = _writer(store.root, n, gap=0.2)
    state_dir = tmp_path / "consumer"
    state_dir.mkdir()
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    rng = random.Random(7)
    kills = 0
    try:
        while writer.poll() is None and kills < 6:
            before = len(_processed(state_dir, mode))
            consumer = subprocess.Popen(
                [sys.executable, str(script), str(store.root), str(state_dir), mode, "none"],
                env=_env(),
                stdout=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 20
            while len(_processed(state_dir, mode)) == before and time.monotonic() < deadline:
                if writer.poll() is not None:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))  # mid-stream, wherever that is
            consumer.send_signal(signal.SIGKILL)
            consumer.wait(timeout=10)
            kills += 1
    finally:
        assert writer.wait(timeout=120) == 0
    # A last run drains what is left and stops when nothing more comes.
    done = subprocess.run(
        [sys.executable, str(script), str(store.root), str(state_dir), mode, "1.0"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    processed = _processed(state_dir, mode)
    steps = [step for _, step, _ in processed]
    assert kills >= 2
    assert sorted(set(steps)) == list(range(n))  # nothing lost
    if mode == "exactly_once":
        assert steps == list(range(n))  # nothing repeated, in order
    else:
        # At least once: an event is repeated only when the consumer died between processing
        # it and saving its cursor: at most once per kill, and always the next in line.
        repeats = len(steps) - n
        assert 0 <= repeats <= kills
        versions = [v for _, _, v in processed]
        assert all(b >= a for a, b in zip(versions, versions[1:]))  # a repeat is adjacent
        assert len(set(versions)) == n


# ---------------------------------------------------------------------------- object stores
def test_tail_on_s3_polls_the_log(s3):
    endpoint, _ = s3
    uri = f"s3://runs/tail-1?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    store = RolloutStore.create(uri, config=CONFIG)
    store.append(make_batch(0))
    reader = ReadOnlyStore(uri)
    assert watches(reader.backend) == "poll"
    events = reader.tail(since=0, poll=0.05, timeout=10)

    def later() -> None:
        time.sleep(0.3)
        for step in (1, 2):
            store.append(make_batch(step))

    thread = threading.Thread(target=later)
    thread.start()
    got = []
    for event in events:
        got.append(event)
        if len(got) == 3:
            break
    thread.join()
    assert [e.step for e in got] == [0, 1, 2]
    assert reader.read(**got[-1].selection).num_rows == got[-1].num_groups
