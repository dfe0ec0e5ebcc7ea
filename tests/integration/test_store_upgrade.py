"""One writable format: a store written before the commit log (the golden 1.0 and 2.0 stores)
is read by every reader and written by none, each write refused with one typed error that
names ``maxent-arrow upgrade``; ``upgrade`` gives it a log over its files as they are (nothing
rewritten), after which a resume, a re-run and an append work, and DuckDB and Polars read the
same rows through the checkpoint recipe. ``upgrade`` is idempotent, refuses what is not a
store, a damaged store and a foreign ``log/`` (exit 2, nothing changed), and of two at once
one wins (the SIGKILL at each of its crash points: test_crash_points.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from fault_harness import flip
from plain_readers import duckdb_groups, polars_groups

from maxent_arrow import ReadOnlyFormatError, RolloutStore
from maxent_arrow.cli import EXIT_OK, EXIT_USAGE, main
from maxent_arrow.store import ReadOnlyStore, upgrade
from maxent_arrow.testing import make_batch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
GOLDEN = ["golden_v1", "golden_v2"]


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(DATA / name, root)
    return root


def _served(root: Path) -> dict[str, object]:
    """What the readers serve of a store: its group and step rows, its SQL rows, its replay."""
    store = ReadOnlyStore(root)
    return {
        "groups": store.read().to_pylist(),
        "steps": store.read_steps().to_pylist(),
        # (rounded: DuckDB's sum of floats depends on the order its threads add them in)
        "samples": store.sql(
            "SELECT count(*) AS n, round(sum(total_util), 6) AS u FROM samples"
        ).to_pylist(),
        "units": [(u.step, u.rank, u.kind, u.num_groups) for u in store.units()],
    }


# ---------------------------------------------------------------------------- read-only
def _writes(root: Path):
    """Every way of writing to the store at ``root``."""
    batch = make_batch(7, rank=0)
    return {
        "append": lambda: RolloutStore(root).append(batch),
        "records": lambda: RolloutStore(root).append_records("notes", pa.table({"step": [0]})),
        "lifecycle": lambda: RolloutStore(root).record_lifecycle(
            ReadOnlyStore(root).read(steps=[0]), step=0, event="trained"
        ),
        "compact": lambda: RolloutStore(root).compact(),
        "repair": lambda: RolloutStore(root).repair(),
        "checkpoint": lambda: RolloutStore(root).checkpoint(),
        "begin_attempt": lambda: RolloutStore(root).begin_attempt(),
        "resume": lambda: RolloutStore(root, resume_from=1),
        "if_exists": lambda: RolloutStore(root, if_exists="new_attempt"),
        "create": lambda: RolloutStore.create(root, if_exists="resume"),
    }


@pytest.mark.parametrize("name", GOLDEN)
@pytest.mark.parametrize(
    "how",
    ["append", "records", "lifecycle", "compact", "repair", "checkpoint", "begin_attempt",
     "resume", "if_exists", "create"],  # fmt: skip
)
def test_every_write_to_a_store_without_a_log_is_refused_naming_upgrade(tmp_path, name, how):
    root = _copy(tmp_path, name)
    before = _files(root)
    with pytest.raises(ReadOnlyFormatError, match=rf"maxent-arrow upgrade {root}"):
        _writes(root)[how]()
    assert _files(root) == before, "a refused write changed the store"
    assert ReadOnlyStore(root).verify().ok  # and it reads as before


def test_the_command_line_refuses_a_write_with_the_same_error(tmp_path, capsys):
    root = _copy(tmp_path, "golden_v2")
    for argv in (["compact", str(root)], ["checkpoint", str(root)], ["repair", str(root)]):
        assert main(argv) != EXIT_OK
        _, err = capsys.readouterr()
        assert f"maxent-arrow upgrade {root}" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- upgrade
@pytest.mark.parametrize("name", GOLDEN)
def test_an_upgraded_store_serves_the_same_rows_and_rewrites_no_file(tmp_path, name):
    root = _copy(tmp_path, name)
    served, before = _served(root), _files(root)
    assert main(["upgrade", str(root)]) == EXIT_OK
    after = _files(root)
    # Nothing rewritten: every file is as it was but the manifest; the log is new.
    changed = {k for k in before if before[k] != after.get(k)}
    assert changed == {"manifest.json"}
    assert {k for k in after if k not in before} and all(
        k.startswith("log/") for k in after if k not in before
    )
    assert _served(root) == served
    store = ReadOnlyStore(root)
    assert store.manifest["schema_version"] == "3.0" and store.catalog.version is not None
    assert store.manifest["upgraded"]["from"] == ReadOnlyStore(DATA / name).manifest[
        "schema_version"
    ]
    assert store.verify().ok
    # Idempotent: a second upgrade changes nothing.
    again = _files(root)
    report = upgrade(root)
    assert not report.upgraded and _files(root) == again


def test_after_upgrade_a_resume_a_rerun_and_an_append_work(tmp_path, monkeypatch):
    root = _copy(tmp_path, "golden_v2")
    upgrade(root)
    # The run's steps are the upgraded attempt's: a fresh run into it is refused, a resume
    # supersedes from its step on, a re-run supersedes all.
    monkeypatch.delenv("MAXENT_ARROW_ATTEMPT", raising=False)
    with pytest.raises(Exception, match="fresh run into it is refused"):
        RolloutStore(root, attempt="fresh").append(make_batch(3))
    resumed = RolloutStore(root, attempt="resumed", resume_from=2, compact_every=None)
    resumed.append(make_batch(2, rank=0, seed=42))
    resumed.append(make_batch(3, rank=0))
    store = ReadOnlyStore(root)
    assert sorted({u.step for u in store.units(kind="train")}) == [0, 1, 2, 3]
    assert store.catalog.account()["superseded_steps"] == [2]
    assert ReadOnlyStore(root, attempts="superseded").steps() == [2]
    rerun = RolloutStore(root, attempt="rerun", if_exists="new_attempt", compact_every=None)
    rerun.append(make_batch(0, rank=0, seed=9))
    assert ReadOnlyStore(root).steps() == [0]
    assert [a["id"] for a in ReadOnlyStore(root).attempts()] == [
        "upgraded-from-2.0", "resumed", "rerun"
    ]  # fmt: skip
    RolloutStore(root).checkpoint()
    served = sorted(
        tuple(r.values())
        for r in ReadOnlyStore(root)
        .sql("SELECT step, rank, kind, group_index FROM groups")
        .to_pylist()
    )
    assert served and duckdb_groups(root) == served and polars_groups(root) == served
    assert RolloutStore(root).verify().ok


def test_plain_readers_read_an_upgraded_store_through_its_checkpoint(tmp_path):
    """(A 2.0 store: the group files of a 1.x store have the 1.x layout, which plain readers
    read as it is, ``docs/arrow-layout.md``.)"""
    root = _copy(tmp_path, "golden_v2")
    groups = len(ReadOnlyStore(root).read(columns=["step"]))
    upgrade(root)
    served = sorted(
        tuple(r.values())
        for r in ReadOnlyStore(root)
        .sql("SELECT step, rank, kind, group_index FROM groups")
        .to_pylist()
    )
    assert len(served) == groups
    assert duckdb_groups(root) == served and polars_groups(root) == served


def test_upgrade_refuses_what_it_cannot_upgrade_and_changes_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "empty", tmp_path / "other"):
        assert main(["upgrade", str(path)]) == EXIT_USAGE
        _, err = capsys.readouterr()
        assert any(why in err for why in ("not a rollout store", "no such store", "not a run"))
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]
    # A damaged store: refused, naming the damage; nothing written.
    root = _copy(tmp_path, "golden_v2")
    victim = sorted((root / "groups").glob("*.parquet"))[0]
    flip(victim, victim.stat().st_size // 2)
    before = _files(root)
    assert main(["upgrade", str(root)]) == EXIT_USAGE
    _, err = capsys.readouterr()
    assert "damaged" in err and victim.name in err
    assert _files(root) == before and not (root / "log").exists()


def test_a_log_of_something_else_is_not_taken_for_an_unfinished_upgrade(tmp_path, capsys):
    root = _copy(tmp_path, "golden_v2")
    other = _copy(tmp_path, "golden_v3")
    shutil.copytree(other / "log", root / "log")
    before = _files(root)
    assert main(["upgrade", str(root)]) == EXIT_USAGE
    _, err = capsys.readouterr()
    assert "not this store's upgrade" in err or "more entries" in err
    assert _files(root) == before
    assert ReadOnlyStore(root).manifest["schema_version"] == "2.0"


def test_of_two_upgrades_at_once_one_wins_and_the_other_fails_cleanly(tmp_path):
    """The first upgrade stopped (SIGSTOP) right after its first entry, holding the store
    lock: a second upgrade fails at once (exit 2, naming the holder), changing nothing; the
    first, continued, upgrades the store."""
    root = _copy(tmp_path, "golden_v2")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "MAXENT_ARROW_STOP_AT": "upgrade:begun", "PYTHONPATH": path}
    first = subprocess.Popen(
        [sys.executable, "-m", "maxent_arrow.cli", "upgrade", str(root)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (root / "log" / f"{1:020d}.json").exists():
            assert time.monotonic() < deadline and first.poll() is None, first.stderr
            time.sleep(0.05)
        time.sleep(0.2)  # (stopped right after the entry)
        before = _files(root)
        second = subprocess.run(
            [sys.executable, "-m", "maxent_arrow.cli", "upgrade", str(root)],
            env={k: v for k, v in env.items() if k != "MAXENT_ARROW_STOP_AT"},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == EXIT_USAGE, second.stderr
        assert "store lock" in second.stderr
        assert _files(root) == before
        assert ReadOnlyStore(root).manifest["schema_version"] == "2.0"
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == EXIT_OK, err
    assert ReadOnlyStore(root).manifest["schema_version"] == "3.0"
    assert ReadOnlyStore(root).verify().ok


def test_upgrade_on_object_storage(s3, tmp_path):
    endpoint, fs = s3
    source = DATA / "golden_v2"
    for path in sorted(source.rglob("*")):
        if path.is_file():
            with fs.open_output_stream(f"runs/old/{path.relative_to(source).as_posix()}") as out:
                out.write(path.read_bytes())
    uri = f"s3://runs/old?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    served = ReadOnlyStore(uri).read().to_pylist()
    with pytest.raises(ReadOnlyFormatError, match="maxent-arrow upgrade"):
        RolloutStore(uri).append(make_batch(3))
    report = upgrade(uri)
    assert report.upgraded and report.units == 4
    assert ReadOnlyStore(uri).read().to_pylist() == served
    RolloutStore(uri, if_exists="resume").append(make_batch(3))
    assert ReadOnlyStore(uri).steps() == [0, 1, 2, 3]
