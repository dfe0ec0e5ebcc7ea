"""F01: a lost commit log entry never hides a commit. An entry deleted (a sync tool, an ``rm``,
a bucket lifecycle rule) or damaged while later evidence says it was committed (a later
entry, the log's head, a checkpoint) is a :class:`LostEntryError` naming the version from
every reader, a warning naming it and the steps it hides with ``on_error="skip"``, a lost
entry (never "a write that did not finish") to ``verify``; no writer commits past it; and
``repair`` rebuilds it from what survives without moving a file an acknowledged commit
names. Each scenario of the fault probe: in the middle, the newest, right after a
checkpoint, with a damaged checkpoint, before heads existed, on S3, under ``tail``."""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from pathlib import Path

import pyarrow as pa
import pytest
from fault_harness import WRITER, flip, run_script, snapshot

from maxent_arrow import LostEntryError, RolloutStore
from maxent_arrow.cli import EXIT_DATA, EXIT_OK, main
from maxent_arrow.store import ReadOnlyStore, ReplaySampler, process_caches
from maxent_arrow.store.history import log as log_module
from maxent_arrow.testing import make_batch

DATA = Path(__file__).resolve().parents[2] / "data"
STEPS = 5


def _store(root: Path, steps: int = STEPS) -> RolloutStore:
    store = RolloutStore.create(root, compact_every=None)
    for step in range(steps):
        store.append(make_batch(step, groups=3))
    return store


def _entry(root: Path, version: int) -> Path:
    return root / log_module.entry_name(version)


def _rows(root: Path) -> list:
    return ReadOnlyStore(root).read().sort_by([("step", "ascending")]).to_pylist()


def _readers(root: Path):
    store = ReadOnlyStore(root)
    return {
        "read": lambda: store.read(),
        "steps": lambda: store.steps(),
        "sql": lambda: store.sql("SELECT count(*) FROM groups"),
        "replay": lambda: list(RolloutStore(root).replay(source="parquet")),
        "sampler": lambda: ReplaySampler(store, batch_groups=2, record=False).sample(),
        "tail": lambda: list(store.tail(since=0, timeout=0.05)),
    }


@pytest.fixture
def lost(tmp_path) -> tuple[Path, list]:
    """A 5-step store (entry 1 its attempt, 2..6 its steps) whose entry 4 (step 2) is gone."""
    root = tmp_path / "store"
    _store(root)
    rows = _rows(root)
    _entry(root, 4).unlink()
    return root, rows


@pytest.mark.parametrize("reader", ["read", "steps", "sql", "replay", "sampler", "tail"])
def test_F01_every_reader_names_the_lost_entry(lost, reader):
    root, _ = lost
    with pytest.raises(LostEntryError, match="commit log entry 4 is missing") as caught:
        _readers(root)[reader]()
    assert caught.value.version == 4


def test_F01_skipping_warns_naming_the_entry_and_the_steps_it_hides(lost):
    root, _ = lost
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ReadOnlyStore(root, on_error="skip").steps() == [0, 1]
    (message,) = {str(w.message) for w in seen if "entry 4" in str(w.message)}
    assert "steps 3..4" in message


def test_F01_the_command_line_names_it(lost, capsys):
    root, _ = lost
    assert main(["inspect", str(root)]) == EXIT_DATA
    assert "commit log entry 4" in capsys.readouterr().err
    assert main(["verify", str(root)]) == EXIT_DATA
    out = capsys.readouterr().out
    assert "lost: commit log entry 4" in out and "uncommitted:" not in out


def test_F01_verify_calls_it_a_lost_entry_and_the_hidden_commits_committed(lost):
    root, _ = lost
    report = ReadOnlyStore(root).verify()
    problems = {p.path.name: p.problem for p in report.problems}
    assert problems[_entry(root, 4).name].startswith("lost: commit log entry 4")
    hidden = [p for p in report.problems if "hidden from readers by the lost entry" in p.problem]
    assert len(hidden) == 4  # steps 3 and 4: their group and step files
    assert not [n for n in report.notes if n.problem.startswith("uncommitted")]
    steps = [n for n in report.notes if n.path.parent.name == "steps"]
    (lost,) = [n for n in steps if "0000002" in n.path.name]
    assert "a file of the lost entry 4" in lost.problem


def test_F01_no_writer_reuses_the_lost_version(lost):
    root, _ = lost
    before = snapshot(root)
    with pytest.raises(LostEntryError, match="entry 4"):
        RolloutStore(root, if_exists="resume").append(make_batch(STEPS))
    with pytest.raises(LostEntryError):
        RolloutStore(root, if_exists="resume").append_records("notes", pa.table({"step": [0]}))
    assert snapshot(root) == before


def test_F01_repair_rebuilds_the_entry_and_moves_nothing_committed(lost):
    root, rows = lost
    report = RolloutStore(root).repair()
    assert [p.path.name for p in report.rebuilt] == [_entry(root, 4).name]
    assert "from its files" in report.rebuilt[0].problem
    assert report.moved == []
    assert _rows(root) == rows
    assert ReadOnlyStore(root).verify().ok
    RolloutStore(root, if_exists="resume").append(make_batch(STEPS))
    assert ReadOnlyStore(root).steps() == list(range(STEPS + 1))


def test_F01_the_newest_entry_lost_is_named_by_the_head(tmp_path):
    root = tmp_path / "store"
    _store(root)
    rows = _rows(root)
    _entry(root, STEPS + 1).unlink()  # no later entry: only the head says it was committed
    with pytest.raises(LostEntryError, match="entry 6 is missing"):
        ReadOnlyStore(root).steps()
    report = RolloutStore(root).repair()
    assert len(report.rebuilt) == 1 and _rows(root) == rows


def test_F01_a_lost_entry_right_after_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(log_module, "CHECKPOINT_EVERY", 4)
    root = tmp_path / "store"
    _store(root, steps=6)  # versions 1..7, a checkpoint at 4
    rows = _rows(root)
    assert (root / "log" / "checkpoint-00000000000000000004.parquet").is_file()
    _entry(root, 5).unlink()
    with pytest.raises(LostEntryError, match="entry 5"):
        ReadOnlyStore(root).read()
    RolloutStore(root).repair()
    assert _rows(root) == rows


def test_F01_a_lost_entry_with_a_damaged_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(log_module, "CHECKPOINT_EVERY", 4)
    root = tmp_path / "store"
    _store(root, steps=6)
    rows = _rows(root)
    checkpoint = root / "log" / "checkpoint-00000000000000000004.parquet"
    flip(checkpoint, checkpoint.stat().st_size // 2)
    process_caches().clear()  # (a new process: this one read the checkpoint before)
    _entry(root, 3).unlink()  # before the checkpoint: readers replay the entries
    with pytest.warns(UserWarning, match="checkpoint not used"):
        with pytest.raises(LostEntryError, match="entry 3"):
            ReadOnlyStore(root).read()
    with pytest.warns(UserWarning, match="checkpoint not used"):
        RolloutStore(root).repair()
    with pytest.warns(UserWarning, match="checkpoint not used"):
        assert _rows(root) == rows


def test_F01_an_entry_rebuilt_from_a_later_checkpoint_when_its_files_say_nothing(
    tmp_path, monkeypatch
):
    """Entry 2 (step 0) gone and no file no entry names: a reader from the checkpoint serves
    everything; a tail from the start names the loss; repair rebuilds the entry from the
    checkpoint, which holds the unit it committed."""
    monkeypatch.setattr(log_module, "CHECKPOINT_EVERY", 4)
    root = tmp_path / "store"
    _store(root, steps=5)
    _entry(root, 2).unlink()
    assert ReadOnlyStore(root).steps() == list(range(5))  # (from checkpoint 4 on)
    with pytest.raises(LostEntryError, match="entry 2"):
        list(ReadOnlyStore(root).tail(since=0, timeout=0.05))
    report = RolloutStore(root).repair()
    assert "from a later checkpoint" in report.rebuilt[0].problem
    events = [e.step for e in ReadOnlyStore(root).tail(since=0, timeout=0.05)]
    assert events == list(range(5))


def test_F01_a_log_written_before_heads_is_checked_by_the_entry_after(tmp_path):
    """The golden 3.0 store has no head: an entry missing before the next one is still a
    lost entry (a tail from the start replays every entry)."""
    root = tmp_path / "golden_v3"
    shutil.copytree(DATA / "golden_v3", root)
    assert not (root / "log" / "_head.json").exists()
    _entry(root, 10).unlink()
    with pytest.raises(LostEntryError, match="entry 10"):
        list(ReadOnlyStore(root).tail(since=0, timeout=0.05))


def test_F01_a_damaged_entry_with_later_ones_is_a_lost_entry(tmp_path):
    root = tmp_path / "store"
    _store(root)
    rows = _rows(root)
    flip(_entry(root, 3), 20)
    with pytest.raises(LostEntryError, match="entry 3 is damaged"):
        ReadOnlyStore(root).read()
    RolloutStore(root).repair()
    assert _rows(root) == rows and ReadOnlyStore(root).verify().ok
    assert [p.name for p in (root / "log").glob(".damaged-*")]  # the bytes kept aside


def test_F01_a_tail_waiting_at_the_log_end_names_an_entry_lost_under_it(tmp_path):
    root = tmp_path / "store"
    store = _store(root, steps=2)
    tail = ReadOnlyStore(root).tail(since=0, timeout=5)
    assert next(tail).step == 0 and next(tail).step == 1
    store.append(make_batch(2, groups=3))
    store.append(make_batch(3, groups=3))
    _entry(root, 4).unlink()  # step 2's entry, under the waiting tail
    with pytest.raises(LostEntryError, match="entry 4"):
        next(tail)


def test_F01_on_s3_the_readers_name_the_lost_entry(s3, tmp_path):
    endpoint, fs = s3
    uri = f"s3://runs/lost?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    _store(uri, steps=4)  # type: ignore[arg-type]
    fs.delete_file(f"runs/lost/{log_module.entry_name(3)}")
    with pytest.raises(LostEntryError, match="entry 3"):
        ReadOnlyStore(uri).read()
    with pytest.raises(LostEntryError, match="entry 3"):
        RolloutStore(uri, if_exists="resume").append(make_batch(4))
    problems = [p.problem for p in ReadOnlyStore(uri).verify().problems]
    assert any(p.startswith("lost: commit log entry 3") for p in problems)


def test_F01_nothing_to_rebuild_from_is_a_noop_that_verify_keeps_naming(tmp_path):
    """Entry 4 and its unit's files all gone: repair fills the version with a noop that
    says so (the rest is served), and verify names the loss from then on."""
    root = tmp_path / "store"
    _store(root)
    for table in ("groups", "steps"):
        (victim,) = (root / table).glob("step-0000000002.*")
        victim.unlink()
    _entry(root, 4).unlink()
    report = RolloutStore(root).repair()
    assert "nothing survived" in report.rebuilt[0].problem
    assert ReadOnlyStore(root).steps() == [0, 1, 3, 4]
    problems = [p.problem for p in ReadOnlyStore(root).verify().problems]
    assert any("lost, and not rebuilt" in p for p in problems)
    assert main(["verify", str(root)]) == EXIT_DATA


def test_F01_two_candidate_files_are_not_guessed_at(tmp_path):
    """A second file no entry names beside the lost entry's (an append killed after
    publishing its files, written at the same time): repair does not guess which one the
    entry committed, moves nothing, and says so."""
    root = tmp_path / "store"
    _store(root)
    crashed = run_script(WRITER, root, 0, STEPS, STEPS + 1, 3, crash_at="append:step-published")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    _entry(root, 4).unlink()
    (lost,) = (root / "steps").glob("step-0000000002.*")
    stamp = lost.stat()
    for table in ("groups", "steps"):
        for path in (root / table).glob(f"step-{STEPS:010d}.*"):
            os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    before = {k: v for k, v in snapshot(root).items() if k != ".lock"}
    report = RolloutStore(root).repair()
    assert report.rebuilt == [] and report.moved == []
    assert any("not guessed at" in p.problem for p in report.kept)
    assert {k: v for k, v in snapshot(root).items() if k != ".lock"} == before
    assert main(["repair", str(root)]) == EXIT_OK
