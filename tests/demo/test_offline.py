"""The demo's second policy, trained from the stored rollouts, and ``maxent-arrow train
--from-store``: real runs of the tiny model, real subprocesses of the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maxent_arrow.demo import OfflineOptions, main, train_offline
from maxent_arrow.errors import ArgumentError
from maxent_arrow.store import RolloutStore

TINY = ["--steps", "2", "--prompts", "4", "--k", "3", "--sft-steps", "3"]
TINY += ["--eval-every", "1", "--eval-prompts", "4", "--quiet"]
EXE = Path(sys.executable).with_name("maxent-arrow")
CLI = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "maxent_arrow.cli"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("offline-demo") / "run"
    code = main(["--out", str(out), *TINY, "--offline-steps", "2"])
    assert code == 0
    return out


def test_the_demo_trains_a_second_policy_from_its_store(demo_run, capsys):
    source = RolloutStore(demo_run / "store")
    offline = RolloutStore(demo_run / "offline" / "store")
    # Evaluated like the run (before each step and at the end), on the same held-out prompts.
    assert offline.steps(kind="eval") == source.steps(kind="eval") == [0, 1, 2]
    run_prompts = source.read(kind="eval", steps=[0], columns=["prompt"]).column("prompt")
    off_prompts = offline.read(kind="eval", steps=[0], columns=["prompt"]).column("prompt")
    assert run_prompts.to_pylist() == off_prompts.to_pylist()
    # It started from the run's starting checkpoint: the same greedy answers at step 0.
    first = "SELECT completion FROM samples WHERE kind = 'eval' AND step = 0 ORDER BY prompt"
    assert source.sql(first).to_pylist() == offline.sql(first).to_pylist()
    # Offline: no rollout of its own; its updates are trainer_metrics records.
    assert offline.steps(kind="train") == []
    assert len(offline.read_records("trainer_metrics")) == 2
    # What it consumed and dropped is in its own store's source_lifecycle (the run it read
    # has no lifecycle record of it), each group once per step, naming the source store.
    assert source.lifecycle().num_rows == 0
    events = offline.read_records("source_lifecycle").to_pylist()
    trained = [(e["step"], e["rollout_step"], e["group_index"]) for e in events
               if e["event"] == "trained"]  # fmt: skip
    assert trained and len(trained) == len(set(trained))
    assert {e["reason"] for e in events if e["event"] == "dropped"} <= {"zero_std"}
    assert len(trained) + sum(e["event"] == "dropped" for e in events) >= 2 * 4 - 4
    assert {e["source"] for e in events} == {source.uri}
    # The report compares the two runs' eval curves.
    assert (demo_run / "report" / "compare.png").stat().st_size > 10_000
    assert "compare.png" in (demo_run / "report" / "index.html").read_text()


def test_train_exact_replays_the_runs_losses(demo_run, tmp_path):
    done = subprocess.run(
        [*CLI, "train", "--from-store", str(demo_run / "store"), "--out", str(tmp_path / "x"),
         "--exact", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    logged = {
        r["step"]: r["total_loss"]
        for r in RolloutStore(demo_run / "store")
        .read_steps(kind="train", columns=["step", "total_loss"])
        .to_pylist()
    }
    assert [(s, lg) for s, _, lg in result["losses"]] == sorted(logged.items())
    assert result["max_loss_error"] <= 1e-6


def test_train_mixed_with_fresh_generation(demo_run, tmp_path):
    done = subprocess.run(
        [*CLI, "train", "--from-store", str(demo_run), "--out", str(tmp_path / "m"),
         "--replay-ratio", "0.5", "--eval-prompts", "0", "--steps", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "trained 2 steps from the store" in done.stdout
    mixed = RolloutStore(tmp_path / "m" / "store")
    # Half of each update's 4 groups generated fresh (and stored), half replayed.
    assert mixed.steps(kind="train") == [0, 1]
    counts = mixed.sql(
        "SELECT step, count(*) AS n FROM groups WHERE kind = 'train' GROUP BY step ORDER BY step"
    ).to_pylist()
    assert counts == [{"step": 0, "n": 2}, {"step": 1, "n": 2}]


def test_train_refuses_what_is_not_a_demo_run(tmp_path):
    done = subprocess.run(
        [*CLI, "train", "--from-store", str(tmp_path), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Neither a run directory nor a store: a usage error.
    assert done.returncode == 2
    assert done.stderr.startswith("maxent-arrow train: error: ")
    assert "not a run" in done.stderr
    assert not (tmp_path / "o").exists()
    # A store without the demo's policy snapshots beside it: not a demo run (a data error).
    RolloutStore.create(tmp_path / "plain" / "store", config={})
    done = subprocess.run(
        [*CLI, "train", "--from-store", str(tmp_path / "plain"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "not a demo run directory" in done.stderr
    assert not (tmp_path / "o").exists()


def test_train_help_imports_no_torch():
    code = (
        "import sys\n"
        "from maxent_arrow.cli import main\n"
        "assert main(['train', '--help']) == 0\n"
        "assert 'torch' not in sys.modules and 'pandas' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: maxent-arrow train")
    assert "--from-store RUN" in done.stdout and "--replay-ratio" in done.stdout


def test_offline_options_come_as_one_object_or_as_keywords(tmp_path):
    with pytest.raises(ArgumentError, match=r"--replay-ratio must be in \(0, 1\], got 0"):
        OfflineOptions(replay_ratio=0)
    with pytest.raises(ArgumentError, match="--exact replays the stored steps alone"):
        OfflineOptions(exact=True, replay_ratio=0.5)
    with pytest.raises(ArgumentError, match="an OfflineOptions or keywords, not both"):
        train_offline(tmp_path, tmp_path / "out", OfflineOptions(), steps=2)
    with pytest.raises(TypeError, match="stepz"):
        train_offline(tmp_path, tmp_path / "out", stepz=2)
