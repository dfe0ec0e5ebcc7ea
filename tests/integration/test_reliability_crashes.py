"""Fault class: crashes. A writer process is killed with SIGKILL at every named point of an
append and of a compaction (``MAXENT_ARROW_CRASH_AT``), with ranks lagging each other, on local
disk and on the S3-compatible server; and at random moments while appending. After every crash:
nothing acknowledged is lost, nothing is visible twice, nothing half-written is served, a
reader changes nothing, and ``repair`` leaves what plain ``*.parquet`` readers see equal to
what the store sees.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import duckdb
import pytest
from fault_harness import (
    APPEND_POINTS,
    COMPACT_POINTS,
    COMPACTOR,
    WRITER,
    acked,
    assert_sound,
    env,
    expected,
    run_script,
    snapshot,
)

from maxent_arrow import RolloutStore

# Their writers are ranks (and relaunches) of one run: one attempt.
pytestmark = pytest.mark.usefixtures("one_launch")

KILLED = -signal.SIGKILL


def _plain_rows(root) -> int:
    """Group rows a plain DuckDB glob over ``groups/*.parquet`` counts (no maxent_arrow)."""
    glob = str(root / "groups" / "*.parquet")
    return duckdb.sql(f"SELECT count(*) FROM read_parquet('{glob}')").fetchall()[0][0]


@pytest.mark.parametrize("point", APPEND_POINTS)
def test_crash_at_each_point_of_an_append(tmp_path, point):
    root = tmp_path / "store"
    # Rank 0 is ahead (steps 0-3 committed), rank 1 lags (steps 0-1); rank 1 dies in step 2.
    for rank, last in ((0, 4), (1, 2)):
        done = run_script(WRITER, root, rank, 0, last, 6)
        assert done.returncode == 0, done.stderr
    crashed = run_script(WRITER, root, 1, 2, 4, 6, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    assert acked(crashed.stdout) == set()  # it died inside its first append
    store = RolloutStore(root)
    want = {(s, 0): expected(s, 0) for s in range(4)} | {(s, 1): expected(s, 1) for s in range(2)}
    if point == "append:committed":
        want[(2, 1)] = expected(2, 1)  # the commit landed before the kill
    before = snapshot(root)
    assert_sound(store, want)
    assert snapshot(root) == before, "reading changed the store"
    # Plain readers: a crash after the group file is published and before the entry leaves
    # a file they would count.
    orphan = point in ("append:group-published", "append:step-published")
    plain = _plain_rows(root)
    assert plain == sum(b.num_groups for b in want.values()) + (
        expected(2, 1).num_groups if orphan else 0
    )
    report = store.repair()
    assert bool(report.moved) == (point != "append:committed")
    assert _plain_rows(root) == sum(b.num_groups for b in want.values())
    # The rank resumes where it stopped; the crashed step is appended once.
    again = run_script(WRITER, root, 1, 2, 4, 6)
    assert again.returncode == 0, again.stderr
    want |= {(s, 1): expected(s, 1) for s in range(2, 4)}
    assert_sound(RolloutStore(root), want)


@pytest.mark.parametrize("point", COMPACT_POINTS)
def test_crash_at_each_point_of_a_compaction(tmp_path, point):
    root = tmp_path / "store"
    for rank, last in ((0, 4), (1, 2)):
        done = run_script(WRITER, root, rank, 0, last, 6)
        assert done.returncode == 0, done.stderr
    want = {(s, 0): expected(s, 0) for s in range(4)} | {(s, 1): expected(s, 1) for s in range(2)}
    crashed = run_script(COMPACTOR, root, "null", 2, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    store = RolloutStore(root)
    assert_sound(store, want)  # the old files or the new segment, never both, never neither
    segments = [n for n in (u.step_file for u in store.units()) if n.startswith("compact-")]
    assert bool(segments) == (point in ("compact:committed", "compact:cleaning"))
    store.repair()
    assert _plain_rows(root) == sum(b.num_groups for b in want.values())
    # Compacting again finishes the job without a name collision, and appends go on.
    done = run_script(COMPACTOR, root, "null", 2)
    assert done.returncode == 0, done.stderr
    assert run_script(WRITER, root, 1, 2, 3, 6).returncode == 0
    want[(2, 1)] = expected(2, 1)
    assert_sound(RolloutStore(root), want)


@pytest.mark.parametrize("point", ["compact:group-published", "compact:step-published"])
def test_compaction_retried_without_repair_after_a_crash_between_publish_and_commit(
    tmp_path, point
):
    """A compaction killed after publishing its files, before its log entry, leaves them as
    leftovers; compacting the same inputs again (no repair between) commits at once: the
    segment's files have a name of their own, never the leftovers'."""
    root = tmp_path / "store"
    assert run_script(WRITER, root, 0, 0, 4, 6).returncode == 0
    crashed = run_script(COMPACTOR, root, "null", crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    done = run_script(COMPACTOR, root, "null")
    assert done.returncode == 0, done.stderr
    store = RolloutStore(root)
    assert [u.step_file.startswith("compact-") for u in store.units()] == [True] * 4
    assert_sound(store, {(s, 0): expected(s, 0) for s in range(4)})


def test_lagging_rank_compacted_later_loses_nothing(tmp_path):
    """Rank 0's steps 0-1 compacted, then a lagging rank 1 appends the same steps and is
    compacted later: two segments with different names, every row once."""
    root = tmp_path / "store"
    assert run_script(WRITER, root, 0, 0, 2, 6).returncode == 0
    first = RolloutStore(root).compact(ranks=[0])
    assert run_script(WRITER, root, 1, 0, 2, 6).returncode == 0
    second = RolloutStore(root).compact(ranks=[1])
    assert len(first) == len(second) == 1 and first[0].name != second[0].name
    want = {(s, r): expected(s, r) for s in range(2) for r in range(2)}
    store = RolloutStore(root)
    assert_sound(store, want)
    # Compacting the two segments together, then everything again, keeps every row once.
    store.compact()
    assert_sound(RolloutStore(root), want)
    assert _plain_rows(root) == sum(b.num_groups for b in want.values())


@pytest.mark.parametrize("point", ["append:group-written", "append:group-published"])
def test_crash_of_an_append_on_s3(s3, tmp_path, point):
    endpoint, _ = s3
    uri = f"s3://runs/crash-{point.split(':')[1]}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    assert run_script(WRITER, uri, 0, 0, 2, 4).returncode == 0
    crashed = run_script(WRITER, uri, 0, 2, 3, 4, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    store = RolloutStore(uri)
    want = {(s, 0): expected(s, 0, groups=4) for s in range(2)}
    assert_sound(store, want)
    again = run_script(WRITER, uri, 0, 2, 3, 4)
    assert again.returncode == 0, again.stderr
    want[(2, 0)] = expected(2, 0, groups=4)
    assert_sound(RolloutStore(uri), want)


@pytest.mark.slow
def test_sigkill_at_random_moments_while_appending_loses_nothing_acknowledged(tmp_path):
    root = tmp_path / "store"
    rng = random.Random(1234)
    acknowledged: set[int] = set()
    midway, leftovers = 0, set()
    for _ in range(20):
        # Enough steps for the kill below (it lands within the first four appends).
        last = max(acknowledged, default=-1) + 8
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), "0", "0", str(last), "24"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        # Kill inside the n-th append: right after the writer says it begins one, at a random
        # point of its first few milliseconds, whatever the machine's speed.
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
        assert proc.returncode == KILLED
        acknowledged |= acked("".join(early) + out)
        # Evidence the kill landed inside an append: a temp or an uncommitted group file.
        store = RolloutStore(root)
        steps = set(store.steps())
        assert acknowledged <= steps, f"lost {sorted(acknowledged - steps)}"
        report = store.verify()
        assert report.ok, str(report)
        notes = {str(n.path) for n in report.notes}
        midway += bool(notes - leftovers)  # this kill left something behind
        leftovers |= notes
        acknowledged |= steps  # once visible, a step must stay visible
        for batch in store.replay():
            assert batch.groups.equals(expected(batch.step, groups=24).groups)
    assert len(acknowledged) >= 10
    assert midway >= 3, midway
    # A leftover group file of a step that a later writer appended again is that step's
    # committed file now (the rename replaced it): what is left over is what verify still
    # notes, every one of them left by a kill.
    final = {str(n.path) for n in RolloutStore(root).verify().notes}
    assert final <= leftovers
    moved = RolloutStore(root).repair().moved
    assert {str(p.path) for p in moved} == final  # every leftover to quarantine
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name and "quarantine" not in str(p)]
    assert json.loads(json.dumps(sorted(acknowledged))) == sorted(RolloutStore(root).steps())
