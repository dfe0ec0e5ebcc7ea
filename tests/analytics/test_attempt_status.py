"""Attempt status: how each writer session of a run ended (running, finished, crashed,
superseded), told from what the store knows, by real writer processes: one that checkpoints
at its end, one killed, one still running, one resumed over; and ``inspect`` prints the
status where it printed the ``if_exists`` mode (``error`` for a successful run)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from maxent_arrow.analytics import attempt_statuses, describe_run
from maxent_arrow.analytics.attempts import process_alive
from maxent_arrow.store import ReadOnlyStore, RolloutStore
from maxent_arrow.testing import make_batch

WRITER = textwrap.dedent(
    """
    import os, sys
    from maxent_arrow.store import RolloutStore
    from maxent_arrow.testing import make_batch
    root, how, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    keywords = {"resume_from": first} if how.startswith("resume") else {"if_exists": "error"}
    store = RolloutStore(root, compact_every=None, **keywords)
    for step in range(first, last):
        store.append(make_batch(step))
    if how.endswith("end"):
        store.checkpoint()          # the run's end
        sys.exit(0)
    if how.endswith("kill"):
        os.kill(os.getpid(), 9)     # killed: no end recorded
    print("appended", flush=True)   # running: waits for its stdin to close
    sys.stdin.read()
    """
)


def _writer(root: Path, how: str, first: int, last: int, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), how, str(first), str(last)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw,
    )  # fmt: skip


def _statuses(root: Path) -> list[tuple[str, str]]:
    return [(a["id"], a["status"]) for a in attempt_statuses(ReadOnlyStore(root))]


@pytest.fixture
def root(tmp_path):
    RolloutStore.create(tmp_path / "store", if_exists="error")
    return tmp_path / "store"


def test_a_writer_that_ends_is_finished_and_one_killed_crashed(root):
    done = _writer(root, "end", 0, 2)
    assert done.wait(timeout=120) == 0
    (first, status), = _statuses(root)  # fmt: skip
    assert status == "finished"
    killed = _writer(root, "resume-kill", 2, 3)
    assert killed.wait(timeout=120) == -signal.SIGKILL
    statuses = dict(_statuses(root))
    assert list(statuses.values()) == ["finished", "crashed"]  # (resumed at 2: nothing over)
    detail = attempt_statuses(ReadOnlyStore(root))[1]["detail"]
    assert "no end recorded" in detail and "is gone" in detail


def test_a_live_writer_is_running_then_crashed_once_gone(root):
    live = _writer(root, "keep", 0, 1)
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "appended"
        assert [s for _, s in _statuses(root)] == ["running"]
    finally:
        live.kill()
        live.wait(timeout=60)
    assert [s for _, s in _statuses(root)] == ["crashed"]


def test_a_resume_supersedes_the_attempt_it_resumed_over(root):
    assert _writer(root, "kill", 0, 4).wait(timeout=120) == -signal.SIGKILL
    assert _writer(root, "resume-end", 2, 5).wait(timeout=120) == 0
    first, second = attempt_statuses(ReadOnlyStore(root))
    assert (first["status"], second["status"]) == ("superseded", "finished")
    assert first["detail"] == f"steps 2..3 by {second['id']}"


def test_an_attempt_that_commits_after_its_end_is_not_finished(root):
    store = RolloutStore(root, compact_every=None)
    store.append(make_batch(0))
    store.checkpoint()
    assert [s for _, s in _statuses(root)] == ["finished"]
    store.append(make_batch(1))  # it goes on: this process is alive
    assert [s for _, s in _statuses(root)] == ["running"]


def test_a_with_block_records_the_end_unless_an_exception_leaves_it(tmp_path):
    for name, fail in (("ok", False), ("failed", True)):
        root = tmp_path / name
        RolloutStore.create(root, if_exists="error")
        try:
            with RolloutStore(root) as store:
                store.append(make_batch(0))
                if fail:
                    raise RuntimeError("the trainer failed")
        except RuntimeError:
            pass
        ends = ReadOnlyStore(root).read_records("attempt_ends")
        assert ends.num_rows == (0 if fail else 1)
        assert [s for _, s in _statuses(root)] == ["running" if fail else "finished"]
    (end,) = ReadOnlyStore(tmp_path / "ok").read_records("attempt_ends").to_pylist()
    assert (end["pid"], end["host"]) == (os.getpid(), socket.gethostname())


def test_process_alive_tells_the_process_from_a_later_one_of_its_pid():
    now = dt.datetime.now(dt.UTC).isoformat()
    host = socket.gethostname()
    assert process_alive(os.getpid(), host, now) is True
    assert process_alive(os.getpid(), "another-host", now) is None
    # A process started after the attempt is another one, whatever its pid.
    later = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert process_alive(later.pid, host, "2001-01-01T00:00:00+00:00") is False
        assert process_alive(later.pid, host, dt.datetime.now(dt.UTC).isoformat()) is True
    finally:
        later.kill()
        later.wait()
    assert process_alive(later.pid, host, now) is False


def test_inspect_and_describe_show_the_status_not_the_mode(root):
    assert _writer(root, "end", 0, 2).wait(timeout=120) == 0
    info = describe_run(ReadOnlyStore(root))
    (attempt,) = info["history"]["attempts"]
    assert (attempt["mode"], attempt["status"]) == ("error", "finished")
    done = subprocess.run(
        [sys.executable, "-m", "maxent_arrow.cli", "inspect", str(root)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(x for x in done.stdout.splitlines() if x.startswith("attempts:"))
    assert line.endswith(f"{attempt['id']} (trainer, finished)"), line
    assert "error" not in line
