"""The commit log's entries and its reading (``store/history/operations.py``,
``store/history/log.py``), on real log directories: every kind of operation committed,
read back from its file and applied; each way an entry file can be wrong (refused, naming
why); a log with a gap (an entry deleted, damaged, a checkpoint past the entries) found from
its evidence; states at a version, from the checkpoint at or below it; the commit's refusals
and its checkpoint every :data:`CHECKPOINT_EVERY` versions.

Written for the mutation run of issue 37 (``make mutate``, ``docs/mutation.md``): each test
names the behaviour the survivors of that run showed untested."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from maxent_arrow.errors import LostEntryError, StoreError
from maxent_arrow.store.history import log as L
from maxent_arrow.store.history import operations as O
from maxent_arrow.store.history.log import CommitLog, LostEntry
from maxent_arrow.store.history.state import Attempt, LogState
from maxent_arrow.store.storage.backend import LocalBackend
from maxent_arrow.store.storage.caches import CACHES


def _log(tmp_path: Path, run: str | None = "run-1") -> CommitLog:
    (tmp_path / "store" / "log").mkdir(parents=True, exist_ok=True)
    return CommitLog(LocalBackend(tmp_path / "store"), run=run)


def _unit(step: int, rank: int = 0, op: type[O.UnitOperation] = O.AppendUnit, **kw):
    name = f"step-{step:010d}.rank-{rank:05d}.train.t{step:012x}.parquet"
    record = {"group_file": name, "rows": {"step": [step], "rank": [rank], "kind": ["train"]}}
    return op(f"steps/{name}", record, 100 + step, 1000 + step, **kw)


def _entry_path(log: CommitLog, version: int) -> Path:
    return log.backend.path(L.entry_name(version))


def _read(log: CommitLog, version: int) -> dict:
    return json.loads(_entry_path(log, version).read_text())


def _fresh(log: CommitLog) -> CommitLog:
    return CommitLog(log.backend, run=log.run)


def _noops(log: CommitLog, count: int) -> None:
    """Entries 1..count (noops saying their index), written as files the way a writer writes
    them (without a commit's fsyncs each: hundreds of them in a fraction of a second), and
    the head naming the last."""
    for v in range(1, count + 1):
        data = O.Entry(v, O.Noop(str(v - 1)), "", log.run, time="t").encode()
        log.backend.path(L.entry_name(v)).write_bytes(data)
    log.backend.path(L.HEAD).write_text(json.dumps({"version": count}))


def _noops_from(log: CommitLog, first: int, last: int) -> None:
    for v in range(first, last + 1):
        data = O.Entry(v, O.Noop(str(v - 1)), "", log.run, time="t").encode()
        log.backend.path(L.entry_name(v)).write_bytes(data)
    log.backend.path(L.HEAD).write_text(json.dumps({"version": last}))


# ---------------------------------------------------------------------------- names
def test_entry_and_checkpoint_names_sort_by_version():
    assert L.entry_name(7) == "log/00000000000000000007.json"
    assert L.checkpoint_name(300) == "log/checkpoint-00000000000000000300.parquet"
    assert L.HEAD == "log/_head.json"
    assert L.CHECKPOINT_EVERY == 100


# ---------------------------------------------------------------------------- operations
def test_every_operation_is_registered_under_its_op():
    assert {op: cls.__name__ for op, cls in O.OPERATIONS.items()} == {
        "attempt": "BeginAttempt",
        "append": "AppendUnit",
        "compact": "CompactUnits",
        "restore": "RestoreUnit",
        "step_file": "RewriteStepFile",
        "drop": "DropUnits",
        "records": "AppendRecords",
        "retire": "RetireFiles",
        "noop": "Noop",
    }
    assert "" not in O.OPERATIONS  # the bases (Operation, UnitOperation) are no op


def test_each_operation_committed_is_what_a_reader_of_its_file_applies(tmp_path):
    """One of each operation, committed through the log: its file holds the envelope and its
    fields; a fresh reader decodes each file back to the operation committed and builds the
    same state the writer holds, step by step."""
    log = _log(tmp_path)
    attempt = Attempt("att-1", started_at="t0", host="h", pid=5, config={"lr": 1})
    first, second, third = _unit(0), _unit(1), _unit(2)
    ops = [
        O.BeginAttempt(attempt, ({"attempt": "old", "steps": [3]},)),
        first,
        second,
        O.CompactUnits(
            "steps/seg.parquet",
            {"group_file": "seg.parquet", "rows": {}},
            9,
            8,
            (first.step_file, second.step_file),
        ),  # fmt: skip
        third,
        O.RewriteStepFile(third.step_file, 555, 666),
        O.RewriteStepFile("steps/not-committed.parquet", 1, 2),
        O.DropUnits((third.step_file,), why="superseded"),
        O.AppendRecords("notes", {"path": "records/notes/a.parquet", "size": 3, "rows": 2}),
        O.AppendRecords("notes", {"path": "records/notes/b.parquet", "size": 4, "rows": 1}),
        O.RetireFiles((first.step_file, "groups/" + first.record["group_file"])),
        O.Noop("lost: nothing survived"),
        O.Noop(),
        O.RestoreUnit("steps/again.parquet", {"group_file": "again.parquet", "rows": {}}),
    ]
    for version, op in enumerate(ops, 1):
        assert log.commit(op, attempt="att-1") == version
    reader = _fresh(log)
    state = reader.state()
    assert state.version == len(ops) and state.run == "run-1"
    for version, op in enumerate(ops, 1):
        entry = reader.entry(version)
        assert entry is not None
        assert entry.version == version and entry.op == op.OP and entry.run == "run-1"
        assert entry.operation == op
        assert entry.attempt == "att-1"
        raw = _read(log, version)
        assert raw["op"] == op.OP and raw["format"] == 1 and raw["version"] == version
        assert raw["time"] and raw["run"] == "run-1"
        assert {k: raw[k] for k in op.fields()} == json.loads(json.dumps(op.fields()))
    assert reader.entry(len(ops) + 1) is None

    # what each operation did to the state
    (began,) = state.attempts
    assert began.id == "att-1" and began.version == 1 and began.config == {"lr": 1}
    assert set(state.units) == {"steps/seg.parquet", "steps/again.parquet"}
    seg = state.units["steps/seg.parquet"]
    assert (seg.version, seg.step_size, seg.step_crc32, seg.attempt) == (4, 9, 8, "att-1")
    assert state.units["steps/again.parquet"].step_size is None
    assert set(state.replaced) == {second.step_file, third.step_file}
    rewritten = state.replaced[third.step_file]
    assert (rewritten.step_size, rewritten.step_crc32) == (555, 666)
    assert state.retiring == {
        second.step_file: 4,
        "groups/" + second.record["group_file"]: 4,
        third.step_file: 8,
        "groups/" + third.record["group_file"]: 8,
    }
    assert state.records == {
        "notes": [
            {"path": "records/notes/a.parquet", "size": 3, "rows": 2, "attempt": "att-1",
             "version": 9},
            {"path": "records/notes/b.parquet", "size": 4, "rows": 1, "attempt": "att-1",
             "version": 10},
        ]
    }  # fmt: skip
    assert state.notes == {12: "lost: nothing survived"}
    # the writer's own state is the reader's
    mine = log.state()
    assert mine.units.keys() == state.units.keys() and mine.records == state.records
    assert mine.retiring == state.retiring and mine.notes == state.notes


def test_the_fields_of_each_operation_are_its_frozen_encoding():
    attempt = Attempt("a", resume_from=4)
    begin = O.BeginAttempt(attempt, ({"attempt": "x", "steps": [4, 5]},))
    assert begin.fields() == {
        "attempt": attempt.to_json(),
        "superseded": [{"attempt": "x", "steps": [4, 5]}],
    }
    unit = O.AppendUnit("steps/a", {"group_file": "a"}, 10, 11, ("steps/b",))
    assert unit.fields() == {
        "step_file": "steps/a", "step_size": 10, "step_crc32": 11,
        "record": {"group_file": "a"}, "replaces": ["steps/b"],
    }  # fmt: skip
    assert O.DropUnits(("steps/a",)).fields() == {"replaces": ["steps/a"], "why": "superseded"}
    assert O.RewriteStepFile("steps/a", 1, 2).fields() == {
        "step_file": "steps/a", "step_size": 1, "step_crc32": 2,
    }  # fmt: skip
    assert O.AppendRecords("t", {"path": "p"}).fields() == {"name": "t", "file": {"path": "p"}}
    assert O.RetireFiles(("a", "b")).fields() == {"files": ["a", "b"]}
    assert O.Noop().fields() == {}
    assert O.Noop("why").fields() == {"why": "why"}


def test_operations_decode_from_the_fields_they_may_lack():
    """Older entries lack optional fields: each decodes to its default."""
    unit = O.UnitOperation.decode({"step_file": "steps/a", "record": {"x": 1}})
    assert unit == O.UnitOperation("steps/a", {"x": 1}, None, None, ())
    full = O.AppendUnit.decode(
        {"step_file": "s", "record": {}, "step_size": 3, "step_crc32": 4, "replaces": ["r"]}
    )
    assert full == O.AppendUnit("s", {}, 3, 4, ("r",)) and type(full) is O.AppendUnit
    assert O.CompactUnits.decode({"step_file": "s", "record": {}, "replaces": None}).replaces == ()
    begin = O.BeginAttempt.decode({"attempt": {"id": "a", "pid": 3}})
    assert begin == O.BeginAttempt(Attempt("a", pid=3), ())
    assert O.BeginAttempt.decode({"attempt": {"id": "a"}, "superseded": None}).superseded == ()
    assert O.BeginAttempt.decode(
        {"attempt": {"id": "a"}, "superseded": [{"attempt": "b", "steps": [1]}]}
    ).superseded == ({"attempt": "b", "steps": [1]},)
    assert O.DropUnits.decode({}) == O.DropUnits((), "")
    assert O.DropUnits.decode({"replaces": ["a"], "why": None}) == O.DropUnits(("a",), "")
    assert O.DropUnits.decode({"replaces": ["a"], "why": "old"}) == O.DropUnits(("a",), "old")
    assert O.RewriteStepFile.decode({"step_file": "s"}) == O.RewriteStepFile("s", None, None)
    assert O.RewriteStepFile.decode(
        {"step_file": "s", "step_size": 1, "step_crc32": 2}
    ) == O.RewriteStepFile("s", 1, 2)
    assert O.RetireFiles.decode({}) == O.RetireFiles(())
    assert O.RetireFiles.decode({"files": ["a"]}) == O.RetireFiles(("a",))
    assert O.AppendRecords.decode({"name": "t", "file": {"p": 1}}) == O.AppendRecords("t", {"p": 1})
    assert O.Noop.decode({}) == O.Noop("") and O.Noop.decode({"why": None}) == O.Noop("")
    assert O.Noop.decode({"why": "w"}) == O.Noop("w")


def test_an_attempt_entry_begins_the_attempt_at_its_version_and_clears_cutoffs():
    state = LogState(version=4)
    state.cutoffs[("x", None)] = 3
    O.BeginAttempt(Attempt("b")).apply(state, 5, "ignored")
    assert [(a.id, a.version) for a in state.attempts] == [("b", 5)]
    assert state.cutoffs == {}


def test_entries_apply_in_order_and_keep_the_run_they_found():
    state = LogState()
    O.Entry(1, O.Noop("a"), "x", "run-a").apply(state)
    assert (state.version, state.run, state.notes) == (1, "run-a", {1: "a"})
    O.Entry(2, O.Noop(), "x", "run-b").apply(state)
    assert (state.version, state.run) == (2, "run-a")
    with pytest.raises(StoreError, match=r"^commit log: entry 4 applied after version 2$"):
        O.Entry(4, O.Noop()).apply(state)
    with pytest.raises(StoreError, match="entry 2 applied after version 2"):
        O.Entry(2, O.Noop()).apply(state)
    assert state.version == 2
    assert O.Entry(3, O.Noop()).op == "noop"


# ---------------------------------------------------------------------------- entry files
def test_an_entry_file_is_sorted_json_sealed_with_the_crc_of_its_canonical_form():
    entry = O.Entry(3, O.Noop("n"), "att", "run", time="2024-01-01T00:00:00+00:00")
    data = entry.encode()
    raw = json.loads(data)
    assert list(raw) == sorted(raw)
    assert data == json.dumps(raw, sort_keys=True).encode()  # the default separators
    body = {k: v for k, v in raw.items() if k != "crc32"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert raw["crc32"] == zlib.crc32(canonical) & 0xFFFFFFFF == O.crc32(canonical)
    assert raw == {**body, "crc32": raw["crc32"]}
    assert body == {"format": 1, "version": 3, "time": "2024-01-01T00:00:00+00:00",
                    "run": "run", "attempt": "att", "op": "noop", "why": "n"}  # fmt: skip
    decoded = O.decode_entry(data, 3, "where")
    assert decoded == entry
    # an entry made without a time is stamped when encoded
    stamped = json.loads(O.Entry(1, O.Noop()).encode())
    assert stamped["time"].endswith("+00:00") and stamped["run"] is None
    # NaN in a record is written as Python's json writes it, and read back
    nan = O.Entry(1, O.AppendRecords("t", {"value": float("nan")})).encode()
    assert b"NaN" in nan
    assert O.decode_entry(nan, 1, "w").operation.file["value"] != 0


def test_an_attempt_entry_names_its_attempts_id():
    data = O.Entry(1, O.BeginAttempt(Attempt("the-id")), "").encode()
    assert json.loads(data)["attempt"]["id"] == "the-id"
    assert O.decode_entry(data, 1, "w").attempt == "the-id"
    other = O.decode_entry(O.Entry(1, O.Noop(), attempt="").encode(), 1, "w")
    assert other.attempt == "" and other.run is None


def _resealed(raw: dict) -> bytes:
    body = {k: v for k, v in raw.items() if k != "crc32"}
    body["crc32"] = O.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(body).encode()


def test_each_kind_of_bad_entry_file_is_refused_naming_why():
    good = json.loads(O.Entry(5, _unit(1), "a", "r", time="t").encode())
    where = "/s/log/00000000000000000005.json"

    def refused(data: bytes, version: int = 5) -> str:
        with pytest.raises(StoreError) as caught:
            O.decode_entry(data, version, where)
        return str(caught.value)

    assert refused(b"{not json").startswith(f"{where}: unreadable commit log entry (")
    for data in (b"[1, 2]", b"7", _resealed({**good, "format": 2}), _resealed(
        {k: v for k, v in good.items() if k != "format"}
    )):  # fmt: skip
        assert refused(data) == f"{where}: not a commit log entry of format 1"
    flipped = json.dumps({**good, "attempt": "b"}).encode()
    assert refused(flipped) == f"{where}: CRC-32 differs from the one in the entry (corrupt)"
    no_crc = json.dumps({k: v for k, v in good.items() if k != "crc32"}).encode()
    assert "CRC-32 differs" in refused(no_crc)
    assert refused(json.dumps(good).encode(), 6) == (
        f"{where}: entry says version 5, its name says 6"
    )
    assert refused(_resealed({**good, "op": "merge"})) == (
        f"{where}: commit log entry 5 has an unknown op 'merge'"
    )
    assert refused(_resealed({k: v for k, v in good.items() if k != "op"})) == (
        f"{where}: commit log entry 5 has an unknown op None"
    )
    lacking = {k: v for k, v in good.items() if k != "step_file"}
    assert refused(_resealed(lacking)) == f"{where}: commit log entry 5 (append) lacks 'step_file'"
    bad_attempt = json.loads(O.Entry(5, O.BeginAttempt(Attempt("a"))).encode())
    bad_attempt["attempt"] = {"id": "a", "unknown_field": 1, "pid": "x"}
    O.decode_entry(_resealed(bad_attempt), 5, where)  # unknown fields of an attempt: ignored
    bad_attempt["attempt"] = {"pid": 3}  # no id
    assert "(attempt) lacks" in refused(_resealed(bad_attempt))
    assert O.decode_entry(json.dumps(good).encode(), 5, where).operation == _unit(1)


# ---------------------------------------------------------------------------- reading
def test_a_reader_follows_the_entries_committed_after_it_last_read(tmp_path):
    log = _log(tmp_path)
    reader = _fresh(log)
    assert reader.state().version == 0 and reader.state().run == "run-1"
    log.commit(_unit(0))
    log.commit(_unit(1))
    assert reader.state(fresh=False).version == 0
    assert reader.state().version == 2
    log.commit(_unit(2))
    held = reader.state(fresh=False)
    assert held.version == 2 and len(held.units) == 2
    assert reader.state().version == 3 and len(reader.state().units) == 3
    assert reader.lost is None


def test_a_pinned_state_is_never_changed_by_later_entries(tmp_path):
    log = _log(tmp_path)
    log.commit(_unit(0))
    pinned = log.pin()
    assert pinned.version == 1
    log.commit(_unit(1))
    log.commit(_unit(2))
    assert pinned.version == 1 and len(pinned.units) == 1
    newest = log.state()
    assert newest.version == 3 and len(newest.units) == 3 and newest is not pinned
    # unpinned, the state is changed in place (no copy per entry)
    log.commit(_unit(3))
    assert log.state() is newest and newest.version == 4
    reader = _fresh(log)
    first = reader.pin()
    log.commit(_unit(4))
    assert reader.state().version == 5 and first.version == 4


def test_a_deleted_entry_below_the_head_is_a_lost_entry_naming_the_steps_it_hides(tmp_path):
    log = _log(tmp_path)
    for step in range(5):
        log.commit(_unit(step))
    _entry_path(log, 2).unlink()
    reader = _fresh(log)
    state = reader.state()
    assert state.version == 1
    assert reader.lost == LostEntry(2, 5, str(log.backend.uri))
    error = reader.lost_error()
    assert isinstance(error, LostEntryError) and error.version == 2
    assert str(error) == (
        f"{log.backend.uri}: commit log entry 2 is missing, but the log says versions up to 5 "
        "were committed: the commits from version 2 on (the later commits hold steps 2..4) are "
        "hidden rather than served as a shorter history; `maxent-arrow repair` rebuilds the "
        "lost entry from what survives (`maxent-arrow verify` names it)"
    )
    assert [e.version for e in reader.surviving_after(2, 5)] == [3, 4, 5]
    assert [e.version for e in reader.surviving_after(3, 4)] == [4]
    assert reader.evidence(2) == 5
    with pytest.raises(LostEntryError, match="entry 2 is missing") as caught:
        _fresh(log).commit(_unit(9))
    assert "the later commits hold" not in str(caught.value)
    assert not _entry_path(log, 6).exists()
    # a reader that finds the log whole again (the entry back) has no gap
    log.backend.path(L.entry_name(2)).write_bytes(
        O.Entry(2, _unit(1), "", "run-1", time="t").encode()
    )
    again = _fresh(log)
    assert again.state().version == 5 and again.lost is None and again.lost_error() is None


def test_the_end_of_the_log_is_no_gap(tmp_path):
    log = _log(tmp_path)
    for step in range(3):
        log.commit(_unit(step))
    reader = _fresh(log)
    assert reader.state().version == 3 and reader.lost is None
    assert reader.evidence(4) == 3
    assert reader.lost_error() is None


def test_a_lost_entry_whose_later_commits_hold_no_steps_names_none(tmp_path):
    log = _log(tmp_path)
    for why in "abcd":
        log.commit(O.Noop(why))
    _entry_path(log, 3).unlink()
    reader = _fresh(log)
    reader.state()
    message = str(reader.lost_error())
    assert "commits from version 3 on are hidden" in message and "hold steps" not in message


def test_a_store_written_before_heads_has_the_next_entry_for_evidence(tmp_path):
    log = _log(tmp_path)
    for step in range(4):
        log.commit(_unit(step))
    log.backend.path(L.HEAD).unlink()
    assert _fresh(log).evidence(5) == 0
    _entry_path(log, 2).unlink()
    reader = _fresh(log)
    assert reader.evidence(2) == 3
    assert reader.state().version == 1 and reader.lost == LostEntry(2, 3, log.backend.uri)
    # the newest entry deleted, no head: nothing says it was committed
    _entry_path(log, 4).unlink()
    _entry_path(log, 3).unlink()
    tail = _fresh(log)
    assert tail.state().version == 1 and tail.lost is None


def test_a_damaged_entry_with_commits_after_it_is_lost_and_the_newest_damaged_is_refused(
    tmp_path,
):
    log = _log(tmp_path)
    for step in range(4):
        log.commit(_unit(step))
    path = _entry_path(log, 2)
    path.write_bytes(path.read_bytes().replace(b'"attempt": ""', b'"attempt": "x"'))
    reader = _fresh(log)
    assert reader.state().version == 1
    lost = reader.lost
    assert lost is not None and (lost.version, lost.evidence) == (2, 4)
    where = log.backend.path(L.entry_name(2))
    assert lost.damage == f"{where}: CRC-32 differs from the one in the entry (corrupt)"
    assert "commit log entry 2 is damaged (" in str(reader.lost_error())
    # the newest entry damaged: the damage itself is the error
    newest = _entry_path(log, 4)
    newest.write_bytes(b"{")
    path.write_bytes(O.Entry(2, _unit(1), "", "run-1", time="t").encode())
    with pytest.raises(StoreError, match=r"00000000000000000004.json: unreadable commit log entry"):
        _fresh(log).state()


def test_a_checkpoint_past_the_entries_is_evidence_of_a_gap(tmp_path):
    log = _log(tmp_path)
    for step in range(3):
        log.commit(_unit(step))
    log.write_checkpoint()
    log.commit(_unit(3))
    log.commit(_unit(4))
    # the checkpoint (of version 3) unreadable, and entry 2 gone: the pointer says 3
    log.backend.path(L.checkpoint_name(3)).write_bytes(b"PAR1 damaged PAR1")
    _entry_path(log, 2).unlink()
    log.backend.path(L.HEAD).unlink()
    _entry_path(log, 5).unlink()
    _entry_path(log, 4).unlink()
    CACHES.checkpoints.clear()
    reader = _fresh(log)
    with pytest.warns(UserWarning, match="checkpoint not used"):
        state = reader.state()
    assert state.version == 1 and reader.pointed == 3
    assert reader.lost == LostEntry(2, 3, log.backend.uri)
    # entries up to 3 back, the pointer's version reached: whole again (4 and 5 are gone,
    # with nothing left that says they were committed)
    log.backend.path(L.entry_name(2)).write_bytes(O.Entry(2, _unit(1), "", "run-1").encode())
    with pytest.warns(UserWarning):
        whole = _fresh(log)
        assert whole.state().version == 3
    assert whole.lost is None
    # entries to 2 only, the pointer at 3: the checkpoint's version is the evidence
    _entry_path(log, 3).unlink()
    with pytest.warns(UserWarning):
        short = _fresh(log)
        assert short.state().version == 2
    assert short.lost == LostEntry(3, 3, log.backend.uri)


# ---------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_is_written_every_hundred_versions_under_both_names(tmp_path):
    log = _log(tmp_path)
    _noops(log, 98)
    log.commit(O.Noop("98"))
    assert not log.backend.path(L.checkpoint_name(99)).exists()
    assert not log.backend.path("log/_checkpoint.parquet").exists()
    log.commit(O.Noop("100"))
    data = log.backend.path(L.checkpoint_name(100)).read_bytes()
    assert log.backend.path("log/_checkpoint.parquet").read_bytes() == data
    hint = json.loads(log.backend.path("log/_last_checkpoint.json").read_text())
    assert hint == {"version": 100, "crc32": zlib.crc32(data), "size": len(data)}
    log.commit(O.Noop("101"))
    assert not log.backend.path(L.checkpoint_name(101)).exists()
    CACHES.checkpoints.clear()
    reader = _fresh(log)
    state = reader.state()
    assert state.version == 101 and reader.pointed == 100
    assert state.notes[100] == "100" and state.notes[101] == "101" and len(state.notes) == 101
    # read from the checkpoint: entries 1..100 need not be there
    for v in range(1, 101):
        _entry_path(log, v).unlink()
    CACHES.checkpoints.clear()
    assert _fresh(log).state().notes[1] == "0"


def test_write_checkpoint_of_a_given_state_returns_its_version(tmp_path):
    log = _log(tmp_path)
    log.commit(O.Noop("a"))
    at_one = log.state().copy()
    log.commit(O.Noop("b"))
    assert log.write_checkpoint(at_one) == 1
    assert log.backend.path(L.checkpoint_name(1)).exists()
    assert json.loads(log.backend.path("log/_last_checkpoint.json").read_text())["version"] == 1
    assert log.write_checkpoint() == 2
    assert json.loads(log.backend.path("log/_last_checkpoint.json").read_text())["version"] == 2


def test_a_checkpoint_whose_crc_differs_from_its_pointer_is_not_used(tmp_path):
    log = _log(tmp_path)
    for step in range(3):
        log.commit(_unit(step))
    log.write_checkpoint()
    pointer = log.backend.path("log/_last_checkpoint.json")
    hint = json.loads(pointer.read_text())
    pointer.write_text(json.dumps({**hint, "crc32": hint["crc32"] ^ 1}))
    CACHES.checkpoints.clear()
    reader = _fresh(log)
    with pytest.warns(UserWarning, match="checkpoint CRC-32 differs from the one recorded"):
        state = reader.state()
    assert state.version == 3 and len(state.units) == 3  # from the entries
    pointer.write_text("{not json")
    with pytest.warns(UserWarning, match=r"_last_checkpoint.json: checkpoint not used"):
        assert _fresh(log).state().version == 3


def test_a_checkpoint_read_once_is_shared_and_never_changed_by_a_reader(tmp_path):
    log = _log(tmp_path)
    for step in range(3):
        log.commit(_unit(step))
    log.write_checkpoint()
    CACHES.checkpoints.clear()
    one, two = _fresh(log), _fresh(log)
    a = one.state()
    log.commit(_unit(3))
    b = two.state()
    assert a.version == 3 and b.version == 4
    assert one.state(fresh=False) is a and len(a.units) == 3


def test_the_state_at_a_version_is_replayed_from_the_checkpoint_at_or_below_it(tmp_path):
    log = _log(tmp_path)
    for step in range(6):
        log.commit(_unit(step))
    log.write_checkpoint(log.state_at(4))
    assert json.loads(log.backend.path("log/_last_checkpoint.json").read_text())["version"] == 4
    for v in (1, 2, 3):  # below the checkpoint: the entries, from the start
        state = _fresh(log).state_at(v)
        assert state.version == v and len(state.units) == v
    for v in (4, 5, 6):
        state = _fresh(log).state_at(v)
        assert state.version == v and len(state.units) == v
    assert _fresh(log).state_at(0).version == 0
    # from the checkpoint: the entries below it need not be there
    for v in (1, 2, 3, 4):
        _entry_path(log, v).unlink()
    state = _fresh(log).state_at(5)
    assert state.version == 5 and len(state.units) == 5
    with pytest.raises(StoreError, match=r"commit log: no version -1 \(versions start at 1; 0"):
        _fresh(log).state_at(-1)
    with pytest.raises(StoreError) as caught:
        _fresh(log).state_at(9)
    assert str(caught.value) == (
        f"{log.backend.uri}: the commit log ends at version 6, before version 9 (a cursor of "
        "another store?)"
    )
    assert not isinstance(caught.value, LostEntryError)


def test_the_state_at_a_version_names_a_lost_entry_on_the_way(tmp_path):
    log = _log(tmp_path)
    for step in range(5):
        log.commit(_unit(step))
    _entry_path(log, 3).unlink()
    reader = _fresh(log)
    assert reader.state_at(2).version == 2
    with pytest.raises(LostEntryError, match="entry 3 is missing.*hold steps 3..4") as caught:
        reader.state_at(4)
    assert caught.value.version == 3
    assert reader.lost == LostEntry(3, 5, log.backend.uri)


def test_the_checkpoint_at_or_below_a_version_is_the_pointers_or_one_at_a_multiple(tmp_path):
    """Without a pointer at or below the version, the checkpoints at each multiple of
    :data:`CHECKPOINT_EVERY` below it are tried, newest first; a damaged one is skipped
    with a warning."""
    log = _log(tmp_path)
    _noops(log, 99)
    log.commit(O.Noop("99"))
    _noops_from(log, 101, 199)
    log.commit(O.Noop("199"))
    _noops_from(log, 201, 250)
    # checkpoints 100 and 200 were written by the commits; the pointer names 200
    assert json.loads(log.backend.path("log/_last_checkpoint.json").read_text())["version"] == 200
    for v in range(1, 201):
        if v not in (100,):
            _entry_path(log, v).unlink()
    # 150: the pointer (200) is past it; the checkpoint at 100, then entries 101..150?
    # those are gone: the state at 150 cannot be built, at 250 it can (from 200)
    state = _fresh(log).state_at(250)
    assert state.version == 250 and state.notes[1] == "0"
    at_200 = _fresh(log).state_at(200)
    assert at_200.version == 200
    log.backend.path(L.checkpoint_name(200)).write_bytes(b"damaged")
    with pytest.warns(
        UserWarning, match=r"checkpoint-00000000000000000200.parquet: checkpoint not"
    ):
        with pytest.raises(StoreError):
            _fresh(log).state_at(201)  # 100, then entry 101 (gone)
    # the pointer's checkpoint at or below the version is used first
    log2 = _log(tmp_path / "two")
    _noops(log2, 120)
    log2.write_checkpoint()  # 120, pointed at
    for v in range(1, 121):
        _entry_path(log2, v).unlink()
    assert _fresh(log2).state_at(120).version == 120
    log2.commit(O.Noop("x"))
    assert _fresh(log2).state_at(121).notes[121] == "x"
    pointer = log2.backend.path("log/_last_checkpoint.json")
    hint = json.loads(pointer.read_text())
    pointer.write_text(json.dumps({**hint, "crc32": hint["crc32"] + 1}))
    with pytest.warns(UserWarning, match="checkpoint CRC-32 differs"):
        with pytest.raises(StoreError):
            _fresh(log2).state_at(120)  # the pointer's is refused; 100 then 101 (gone)
    pointer.write_text("[]")
    with pytest.raises(StoreError):
        _fresh(log2).state_at(120)


# ---------------------------------------------------------------------------- committing
def test_a_builder_commits_what_it_makes_from_the_newest_state_or_nothing(tmp_path):
    log = _log(tmp_path)
    log.commit(_unit(0))
    seen: list[int] = []

    def build(state: LogState):
        seen.append(state.version)
        return None if state.version >= 2 else O.Noop(f"at {state.version}")

    assert log.commit(build) == 2
    assert log.commit(build) is None
    assert seen == [1, 2]
    assert not _entry_path(log, 3).exists() and log.state().version == 2
    assert log.state().notes == {2: "at 1"}


def test_a_check_that_refuses_writes_no_entry(tmp_path):
    log = _log(tmp_path)
    log.commit(_unit(0))

    def refuse(state: LogState) -> None:
        assert state.version == 1
        raise StoreError("duplicate step")

    with pytest.raises(StoreError, match="duplicate step"):
        log.commit(_unit(0), check=refuse)
    assert not _entry_path(log, 2).exists()
    assert json.loads(log.backend.path(L.HEAD).read_text()) == {"version": 1}
    assert log.commit(_unit(1), check=lambda state: None) == 2


def test_a_commit_writes_the_head_and_the_run_and_attempt_of_its_entry(tmp_path):
    log = _log(tmp_path, run=None)
    assert log.commit(O.Noop(), attempt="w1") == 1
    assert json.loads(log.backend.path(L.HEAD).read_text()) == {"version": 1}
    raw = _read(log, 1)
    assert raw["run"] is None and raw["attempt"] == "w1"
    state = log.state()
    state.run = "adopted"
    log.commit(O.Noop())
    assert _read(log, 2)["run"] == "adopted"


def test_a_writer_that_loses_the_race_for_a_version_takes_the_next(tmp_path):
    """Two writers without a lock (an object store's case, ``locked=True`` here): the one
    whose state is behind finds its version taken, reads the winner's entry and commits
    after it."""
    log = _log(tmp_path)
    log.commit(_unit(0))
    behind = CommitLog(LocalBackend(log.backend.root), run=log.run)  # a backend of its own
    assert behind.state().version == 1
    winner = _fresh(log)
    winner.commit(_unit(1), locked=True)
    taken: list[str] = []
    put = behind.backend.put_if_absent

    def racing_put(rel, data, *, hint=None):
        taken.append(rel)
        if len(taken) == 1:  # the third writer takes version 3 first
            _fresh(log).commit(_unit(2), locked=True)
        return put(rel, data, hint=hint)

    behind.backend.put_if_absent = racing_put  # type: ignore[method-assign]
    try:
        assert behind.commit(_unit(3), locked=True) == 4
    finally:
        del behind.backend.put_if_absent
    assert taken == [L.entry_name(3), L.entry_name(4)]
    state = _fresh(log).state()
    assert state.version == 4 and len(state.units) == 4
    assert behind.state().version == 4


def test_a_writer_that_loses_every_race_gives_up_naming_it(tmp_path, monkeypatch):
    log = _log(tmp_path)
    monkeypatch.setattr(L, "_RACES", 3)
    calls = []

    def never(rel, data, *, hint=None):
        calls.append(rel)
        return False

    monkeypatch.setattr(log.backend, "put_if_absent", never)
    with pytest.raises(StoreError) as caught:
        log.commit(O.Noop())
    assert str(caught.value) == (
        f"{log.backend.uri}: lost the race for a commit log version 3 times"
    )
    assert calls == [L.entry_name(1)] * 3


# ---------------------------------------------------------------------------- checkpoint choice
POINTER = "log/_last_checkpoint.json"


def _checkpointed(tmp_path: Path) -> CommitLog:
    """Entries 1..120, checkpoints of versions 100 and 120 (the pointer names 120), and the
    entries up to 100 gone: a state at 100..120 comes from a checkpoint or not at all."""
    log = _log(tmp_path)
    _noops(log, 120)
    log.write_checkpoint(log.state_at(100))
    log.write_checkpoint(log.state_at(120))
    for v in range(1, 101):
        _entry_path(log, v).unlink()
    CACHES.checkpoints.clear()
    return log


def test_the_pointers_checkpoint_at_the_version_itself_is_used(tmp_path):
    log = _checkpointed(tmp_path)
    for v in range(101, 121):
        _entry_path(log, v).unlink()  # only the checkpoint of 120 holds the state at 120
    state = _fresh(log).state_at(120)
    assert state.version == 120 and state.notes[120] == "119" and state.notes[1] == "0"
    with pytest.raises(LostEntryError):
        _fresh(log).state_at(119)  # below the pointer: the checkpoint of 100, then 101


@pytest.mark.parametrize(
    "pointer",
    ["{not json", "[]", '{"crc32": 1}', '{"version": "x", "crc32": 1}', '{"version": 120}',
     '{"version": null, "crc32": 1}'],
    ids=["not-json", "a-list", "no-version", "not-a-number", "no-crc", "null-version"],
)  # fmt: skip
def test_a_pointer_that_cannot_be_read_leaves_the_checkpoints_at_each_multiple(tmp_path, pointer):
    log = _checkpointed(tmp_path)
    log.backend.path(POINTER).write_text(pointer)
    state = _fresh(log).state_at(120)
    assert state.version == 120 and state.notes[1] == "0" and state.notes[120] == "119"


def test_a_pointer_removed_between_its_stat_and_its_read_is_no_error(tmp_path, monkeypatch):
    """A concurrent checkpoint replaces the pointer (here: removes it) between the reader's
    stat and its read: the read's StoreError is no error, the multiples are tried."""
    log = _checkpointed(tmp_path)
    stat = log.backend.stat

    def racing_stat(rel):
        info = stat(rel)
        if rel == POINTER and info is not None:
            log.backend.path(POINTER).unlink()
        return info

    monkeypatch.setattr(log.backend, "stat", racing_stat)
    assert _fresh(log).state_at(120).version == 120


def test_a_missing_checkpoint_is_passed_over_for_the_next_candidate(tmp_path):
    log = _checkpointed(tmp_path)
    log.backend.path(L.checkpoint_name(120)).unlink()  # the pointer's is gone: the multiple
    state = _fresh(log).state_at(120)
    assert state.version == 120 and state.notes[1] == "0"


def test_a_checkpoint_refused_is_named_in_a_warning_and_the_next_candidate_used(tmp_path):
    log = _checkpointed(tmp_path)
    pointer = log.backend.path(POINTER)
    hint = json.loads(pointer.read_text())
    pointer.write_text(json.dumps({**hint, "crc32": hint["crc32"] ^ 0x10}))
    with pytest.warns(UserWarning) as caught:
        state = _fresh(log).state_at(120)
    assert state.version == 120 and state.notes[1] == "0"
    assert [str(w.message) for w in caught] == [
        f"{log.backend.path(L.checkpoint_name(120))}: checkpoint not used (checkpoint CRC-32 "
        "differs from the one recorded)"
    ]
    # a checkpoint file that is not one: the reading error named
    log.backend.path(L.checkpoint_name(100)).write_bytes(b"PAR1 not a checkpoint PAR1")
    with pytest.warns(UserWarning) as caught:
        with pytest.raises(LostEntryError):
            _fresh(log).state_at(110)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{log.backend.path(L.checkpoint_name(100))}: checkpoint not used (")
    assert message != f"{log.backend.path(L.checkpoint_name(100))}: checkpoint not used ()"


def test_a_checkpoint_of_another_version_than_its_name_is_not_used(tmp_path):
    log = _checkpointed(tmp_path)
    # the checkpoint named 100 holds the state at 120
    log.backend.path(L.checkpoint_name(100)).write_bytes(
        log.backend.path(L.checkpoint_name(120)).read_bytes()
    )
    log.backend.path(POINTER).unlink()
    with pytest.raises(LostEntryError):
        _fresh(log).state_at(110)


def test_the_state_at_the_start_is_empty_and_of_the_logs_run(tmp_path):
    log = _log(tmp_path)
    assert _fresh(log).state_at(0).run == "run-1"
    log.commit(O.Noop())
    state = _fresh(log).state_at(0)
    assert state.version == 0 and state.run == "run-1" and state.notes == {}


def test_the_newest_entry_lost_below_the_head_is_lost_not_the_end(tmp_path):
    log = _log(tmp_path)
    for step in range(3):
        log.commit(_unit(step))
    _entry_path(log, 3).unlink()  # the head still says 3
    with pytest.raises(LostEntryError, match="entry 3 is missing, but the log says versions up"):
        _fresh(log).state_at(3)
    reader = _fresh(log)
    assert reader.state().version == 2
    assert reader.lost == LostEntry(3, 3, log.backend.uri)


def test_a_store_before_heads_names_a_lost_entry_from_the_entry_after_it(tmp_path):
    log = _log(tmp_path)
    for step in range(5):
        log.commit(_unit(step))
    log.backend.path(L.HEAD).unlink()
    _entry_path(log, 3).unlink()
    reader = _fresh(log)
    with pytest.raises(LostEntryError, match="entry 3 is missing") as caught:
        reader.state_at(4)
    assert caught.value.version == 3
    assert reader.lost == LostEntry(3, 4, log.backend.uri)


def test_a_writer_refused_by_a_lost_entry_is_told_so_without_the_steps(tmp_path):
    log = _log(tmp_path)
    for step in range(3):
        log.commit(_unit(step))
    _entry_path(log, 2).unlink()
    with pytest.raises(LostEntryError) as caught:
        _fresh(log).commit(O.Noop())
    assert str(caught.value) == (
        f"{log.backend.uri}: commit log entry 2 is missing, but the log says versions up to 3 "
        "were committed: the commits from version 2 on are hidden rather than served as a "
        "shorter history; `maxent-arrow repair` rebuilds the lost entry from what survives "
        "(`maxent-arrow verify` names it)"
    )
    assert caught.value.version == 2
