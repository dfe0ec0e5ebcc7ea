"""``maxent-arrow demo`` as a command: where a run goes, what it refuses (and never deletes),
and a ``--help`` that answers loading no torch (how fast: ``benchmarks/bench_scale.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from maxent_arrow.cli import EXIT_USAGE, main
from maxent_arrow.demo.job import RunDirectoryError, prepare_run_dir
from maxent_arrow.store.store import RolloutStore

EXE = Path(sys.executable).with_name("maxent-arrow")
CLI = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "maxent_arrow.cli"]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _earlier_run(out: Path) -> None:
    """What an earlier demo run leaves: a store, a snapshot, a report."""
    RolloutStore.create(out / "store", config={})
    (out / "snapshots").mkdir()
    (out / "snapshots" / "step-0000000000.safetensors").write_bytes(b"weights")
    (out / "report").mkdir()
    (out / "report" / "index.html").write_text("<html>earlier</html>")


def _user_files(out: Path) -> None:
    out.mkdir()
    (out / "thesis.tex").write_text("three years of work")


def _a_store(out: Path) -> None:
    RolloutStore.create(out, config={})


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (_user_files, "is not empty"),
        (_earlier_run, "is not empty"),
        (_a_store, "is a rollout store"),
    ],
    ids=["user files", "an earlier demo run", "a store"],
)
def test_an_out_with_anything_in_it_is_refused_in_one_line_and_kept(
    capsys, tmp_path, make, expected
):
    out = tmp_path / "out"
    make(out)
    before = _tree(out)
    code = main(["demo", "--out", str(out), "--steps", "1", "--quiet"])
    printed, err = capsys.readouterr()
    assert code == EXIT_USAGE
    assert printed == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"maxent-arrow demo: error: --out {out} {expected}"), err
    assert "never overwrites or deletes" in err or "never into an existing one" in err
    assert _tree(out) == before  # nothing deleted, nothing written


def test_an_out_that_is_a_file_is_refused_and_kept(capsys, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert main(["demo", "--out", str(out), "--quiet"]) == EXIT_USAGE
    _, err = capsys.readouterr()
    assert err == f"maxent-arrow demo: error: --out {out} is a file; " + err.split("; ", 1)[1]
    assert err.count("\n") == 1 and out.read_text() == "keep me"


def test_a_new_or_empty_out_is_taken_as_it_is(tmp_path):
    new = tmp_path / "a" / "b"
    assert prepare_run_dir(new) == new and new.is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_run_dir(empty) == empty


def test_without_out_each_run_gets_the_next_numbered_directory(tmp_path):
    root = tmp_path / "runs" / "demo"
    first = prepare_run_dir(None, root=root)
    second = prepare_run_dir(None, root=root)
    assert [first.name, second.name] == ["run-001", "run-002"]
    (first / "kept.txt").write_text("mine")
    (root / "run-007").mkdir()  # a gap, and a number taken by hand
    (root / "run-notes").mkdir()  # not a number: ignored
    assert prepare_run_dir(None, root=root).name == "run-008"
    assert (first / "kept.txt").read_text() == "mine"


def test_a_root_that_cannot_be_created_is_a_run_directory_error(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs directory would go")
    with pytest.raises(RunDirectoryError, match="cannot create a run directory under"):
        prepare_run_dir(None, root=blocker / "demo")
    assert blocker.read_text() == "a file where the runs directory would go"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]], ids=" ".join)
def test_help_answers_from_the_console_script(argv):
    # The demo's parser loads neither torch nor transformers (the next test); the time it
    # takes (about 0.1 s) is benchmarks/bench_scale.py's measure, not a unit test's.
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: maxent-arrow")


def test_demo_help_imports_no_torch():
    code = (
        "import sys\n"
        "from maxent_arrow.cli import main\n"
        "assert main(['demo', '--help']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--sft-steps" in done.stdout and "never overwrites" in " ".join(done.stdout.split())
