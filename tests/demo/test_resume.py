"""``maxent-arrow demo --resume``: a demo killed with SIGKILL mid-training goes on from its last
policy snapshot as a resumed attempt of the run (issue 21). The store then says what the model
trained on: each training step once in the effective history, the killed attempt's step from
the resume point on readable as superseded, and the offline replay of every effective step
equal to the logged loss. Nothing of the earlier run is deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxent_arrow.demo.job import RunDirectoryError, prepare_run_dir
from maxent_arrow.store.store import RolloutStore

SMALL = [
    "--steps", "6", "--sft-steps", "10", "--prompts", "6", "--k", "3", "--eval-every", "3",
    "--eval-prompts", "8", "--no-report",
]  # fmt: skip (not --quiet: the closing lines are read)


def _demo(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "maxent_arrow.cli", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
        **kw,
    )


def test_resume_needs_a_demo_run(tmp_path):
    with pytest.raises(RunDirectoryError, match="--resume needs --out"):
        prepare_run_dir(None, resume=True)
    (tmp_path / "x").mkdir()
    with pytest.raises(RunDirectoryError, match="is not a demo run"):
        prepare_run_dir(tmp_path / "x", resume=True)


@pytest.mark.slow
def test_a_killed_demo_resumes_from_its_last_snapshot(tmp_path):
    out = tmp_path / "run"
    first = _demo("--out", str(out), *SMALL)
    store_dir = out / "store"
    deadline = time.monotonic() + 240
    # Kill it once step 3's snapshot is saved (steps 0-2 committed, 3 under way or done).
    while not (out / "snapshots" / "step-0000000003.safetensors").exists():
        assert first.poll() is None, first.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = RolloutStore(store_dir).steps(kind="train")
    assert before[:3] == [0, 1, 2] and len(before) < 6
    snapshots = sorted(p.name for p in (out / "snapshots").iterdir())
    resumed_at = int(snapshots[-1][5:15])
    second = _demo("--out", str(out), "--resume", *SMALL)
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr[-2000:]
    assert f"resumed at step {resumed_at}" in stdout
    assert "recomputed losses equal the logged ones" in stdout
    store = RolloutStore(store_dir)
    assert store.steps(kind="train") == list(range(6))  # each step once, effective
    # The trainer's attempts (the second policy's sampler writes nothing into the run).
    attempts = [a for a in store.attempts() if a["role"] == "trainer"]
    assert attempts == store.attempts()
    assert [a["mode"] for a in attempts] == ["error", "resume"]
    assert attempts[1]["resume_from"] == resumed_at
    superseded = RolloutStore(store_dir, attempts="superseded").steps(kind="train")
    assert superseded == [s for s in before if s >= resumed_at]
    every = RolloutStore(store_dir, attempts="all").read(columns=["step", "kind"])
    assert (
        every.num_rows
        == store.read().num_rows + RolloutStore(store_dir, attempts="superseded").read().num_rows
    )
    assert store.verify().ok
