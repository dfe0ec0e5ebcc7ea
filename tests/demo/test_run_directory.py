"""The demo's run directory and its output (issue 39): a piped demo draws no progress bar,
``--quiet`` prints one line, ``runs/demo/latest`` links the newest run, every command it
prints runs and writes to a new path, and a demo that fails before it has anything to resume
removes the directories it created (and only those). Real runs of the console script."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_harness import snapshot

EXE = Path(sys.executable).with_name("maxent-arrow")
CLI = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "maxent_arrow.cli"]
TINY = ["--steps", "2", "--prompts", "4", "--k", "3", "--sft-steps", "3", "--eval-every", "1"]
TINY += ["--eval-prompts", "4", "--offline-steps", "1"]


def _demo(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "demo", *argv], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_a_piped_demo_draws_no_bar_quiet_is_one_line_and_latest_is_the_newest(tmp_path):
    quiet = _demo(tmp_path, *TINY, "--quiet")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    first = Path("runs") / "demo" / "run-001"
    # One summary line (it printed 11 lines and the bars), and nothing on stderr.
    assert quiet.stdout.count("\n") == 1 and quiet.stderr == "", quiet.stdout + quiet.stderr
    line = quiet.stdout.strip()
    assert line.startswith(f"demo: {first}; held-out accuracy ") and "steps replayed" in line
    assert f"report {first / 'report' / 'index.html'}" in line
    latest = tmp_path / "runs" / "demo" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == "run-001"
    # Into a pipe, no bar: no carriage-return redraws (there were 2,213 in a default run).
    # (Bytes: text mode would turn each \r into a newline.)
    loud = subprocess.run([*CLI, "demo", *TINY], cwd=tmp_path, capture_output=True, timeout=600)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert b"\r" not in loud.stdout + loud.stderr
    assert b"step/s" not in loud.stdout + loud.stderr
    assert os.readlink(latest) == "run-002"
    assert f"latest:   {Path('runs') / 'demo' / 'latest'}" in loud.stdout.decode()
    assert (latest / "store" / "manifest.json").is_file()


@pytest.mark.slow
def test_every_printed_command_runs_and_writes_to_a_new_path(tmp_path, fresh_shell):
    """The printed ``report`` command overwrote the demo's report (and dropped its
    online-vs-offline comparison); the others took the store. Now each takes the run
    directory, and the run's own files stay as they were."""
    done = _demo(tmp_path, *TINY, "--out", "run")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    before = snapshot(run)
    assert (run / "report" / "compare.png").is_file()
    commands = fresh_shell(done.stdout, tmp_path)
    for command in commands:
        assert command.returncode == 0, (command.args, command.stderr)
    printed = [c.args[-1].removeprefix("exec ") for c in commands]
    assert [p.split()[1:3] for p in printed] == [["inspect", "run"], ["query", "run"],
                                                 ["report", "run"], ["view", "run"]]  # fmt: skip
    assert printed[2].endswith(" --out run/report-2")
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing overwritten
    assert (run / "report-2" / "index.html").is_file()


def _interrupted(cwd: Path, argv: list[str], *, when: Path | None = None) -> str:
    """A demo sent SIGINT (Ctrl-C) once it says its run directory (or once ``when``
    exists); its stderr."""
    process = subprocess.Popen(
        [*CLI, "demo", *argv], cwd=cwd, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("run directory: ")
        deadline = time.monotonic() + 240
        while when is not None and not when.exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # into the import of torch or the warm start
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err
    return err


SLOW = [*TINY, "--sft-steps", "100000"]  # a warm start to interrupt


@pytest.mark.slow
def test_a_demo_that_fails_removes_what_it_created_and_nothing_else(tmp_path):
    # A new --out (and the directories above it that did not exist): gone.
    _interrupted(tmp_path, ["--out", "a/b/run", *SLOW])
    assert list(tmp_path.iterdir()) == []
    # The numbered default: the run goes, runs/demo/ (with another run in it) stays.
    (tmp_path / "runs" / "demo" / "run-001").mkdir(parents=True)
    _interrupted(tmp_path, SLOW)
    assert [p.name for p in (tmp_path / "runs" / "demo").iterdir()] == ["run-001"]
    # An empty --out that was there before: still there.
    (tmp_path / "mine").mkdir()
    _interrupted(tmp_path, ["--out", "mine", *SLOW])
    assert (tmp_path / "mine").is_dir()


@pytest.mark.slow
def test_a_demo_stopped_after_its_first_snapshot_is_kept_to_resume(tmp_path):
    argv = ["--out", "run", *TINY, "--steps", "400"]
    err = _interrupted(tmp_path, argv, when=tmp_path / "run" / "snapshots")
    assert "the run so far is kept in run; continue it with --out run --resume" in err
    assert (tmp_path / "run" / "store" / "manifest.json").is_file()
