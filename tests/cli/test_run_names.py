"""One way to name a run, counts that match what was written, and readers that only read
(issue 39): every command takes a run directory or its store and refuses anything else with
exit 2; ``compact`` counts the files it wrote; ``tail`` on a finished run says why it prints
nothing more; ``train --from-store`` writes nothing into the run it reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fault_harness import snapshot

from maxent_arrow.cli import COMMANDS, EXIT_OK, EXIT_USAGE, main
from maxent_arrow.store import RolloutStore
from maxent_arrow.testing import CONFIG, make_batch, write_store

EXE = Path(sys.executable).with_name("maxent-arrow")
CLI = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "maxent_arrow.cli"]
# What each command needs besides RUN to get as far as opening it.
REQUIRED = {
    "query": ["SELECT 1"],
    "report": ["--out", "{tmp}/report"],
    "export": ["--to", "ipc", "{tmp}/export"],
}
STORE_COMMANDS = [c.name for c in COMMANDS if c.store]


def _run(capsys, argv: list[str]) -> tuple[int, str, list[str]]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_a_path_that_is_neither_a_run_nor_a_store_is_a_usage_error(capsys, tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file").write_text("not a run")
    extra = [a.format(tmp=tmp_path) for a in REQUIRED.get(command, [])]
    for path, why in (
        (empty, "has neither manifest.json nor store/manifest.json"),
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is a file"),
    ):
        code, _, lines = _run(capsys, [command, str(path), *extra])
        assert code == EXIT_USAGE, lines
        assert len(lines) == 1 and lines[0].startswith(f"maxent-arrow {command}: error: "), lines
        assert f"{path}: not a run: expected a run directory" in lines[0] and why in lines[0]
    assert list(empty.iterdir()) == []  # nothing created
    assert not (tmp_path / "report").exists() and not (tmp_path / "export").exists()


def test_view_names_its_second_run_the_same_way(capsys, tmp_path):
    run = tmp_path / "run"
    write_store(run / "store", steps=range(2), ranks=1)
    # The second run is resolved (and refused) before any server starts.
    code, _, lines = _run(capsys, ["view", str(run), "--compare", str(tmp_path / "nowhere")])
    assert code == EXIT_USAGE and "nowhere: not a run" in lines[0], lines


def test_compact_counts_the_files_it_wrote_and_replaced(capsys, tmp_path):
    """It said "2 compacted files" having written 4 (a group file and a step file per
    segment): the counts are now those of the files on disk."""
    w = write_store(tmp_path / "run" / "store", steps=range(4), ranks=2, eval_steps=(2,))

    def parquet() -> set[Path]:
        return {p for t in ("groups", "steps") for p in (w.root / t).glob("*.parquet")}

    before = parquet()
    code, out, _ = _run(capsys, ["compact", str(w.root)])
    assert code == EXIT_OK
    written, replaced = parquet() - before, before - parquet()
    assert (len(written), len(replaced)) == (4, 20)
    lines = out.splitlines()
    assert lines[0] == "2 segments written (4 files), replacing 20 files"
    assert {Path(line.strip()) for line in lines[1:]} == written


def test_tail_on_a_finished_run_says_why_it_prints_nothing_more(capsys, tmp_path):
    store = RolloutStore.create(tmp_path / "run" / "store", config=CONFIG)
    for step in range(3):
        store.append(make_batch(step))
    store.checkpoint()
    code, out, lines = _run(capsys, ["tail", str(store.root), "--timeout", "0.2"])
    assert code == EXIT_OK and out == ""
    assert len(lines) == 1, lines
    banner = lines[0]
    assert banner.startswith(f"maxent-arrow tail: following {store.uri} (")
    head = store.catalog.account()["log_version"]
    assert f"from log version {head}, its last commit" in banner
    assert "a finished run prints nothing more; --since 0 prints its steps so far" in banner
    # What the banner offers is what the steps so far are.
    code, out, _ = _run(capsys, ["tail", str(store.root), "--since", "0", "--timeout", "0.2"])
    assert [line.split()[2] for line in out.splitlines()] == ["0", "1", "2"]


TINY = ["--steps", "2", "--prompts", "4", "--k", "3", "--sft-steps", "3", "--eval-every", "1"]
TINY += ["--eval-prompts", "4", "--offline-steps", "0", "--no-report"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("source") / "run"
    done = subprocess.run(
        [*CLI, "demo", "--out", str(out), *TINY], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("mode", [["--steps", "2"], ["--exact"]], ids=["offline", "exact"])
def test_train_from_store_writes_nothing_into_the_run_it_reads(demo_run, tmp_path, mode):
    """It added an attempt and a lifecycle row per group to SRC; now SRC's files (its log
    included) are byte for byte what they were, and what it consumed is under --out."""
    before = snapshot(demo_run)
    done = subprocess.run(
        [*CLI, "train", "--from-store", str(demo_run), "--out", str(tmp_path / "dst"),
         "--eval-prompts", "0", "--json", *mode],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert snapshot(demo_run) == before
    steps = json.loads(done.stdout)["steps"]
    records = RolloutStore(tmp_path / "dst" / "store").read_records("source_lifecycle")
    trained = [r for r in records.to_pylist() if r["event"] == "trained"]
    assert {r["step"] for r in trained} == set(range(steps)) and steps == 2
    source = RolloutStore(demo_run / "store")
    stored = {
        (r["step"], r["rank"], r["kind"], r["group_index"])
        for r in source.read(columns=["step", "rank", "kind", "group_index"]).to_pylist()
    }
    keys = {(r["rollout_step"], r["rollout_rank"], r["rollout_kind"], r["group_index"])
            for r in records.to_pylist()}  # fmt: skip
    assert keys <= stored and {r["source"] for r in records.to_pylist()} == {source.uri}
