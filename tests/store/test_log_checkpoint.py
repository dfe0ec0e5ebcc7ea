"""A checkpoint read lazily (records and step rows parsed when first used) is the same state
as the log's entries replayed one by one, and a checkpoint written from a lazily read state
is the same file content as one written from a fully parsed state."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given
from hypothesis import strategies as st

from maxent_arrow import RolloutStore
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.history.checkpoint import (
    CHECKPOINT_ROW_GROUP,
    LazyRecord,
    checkpoint_bytes,
    checkpoint_table,
    state_from_checkpoint,
)
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import AppendRecords, AppendUnit, BeginAttempt, Entry
from maxent_arrow.store.history.state import (
    Attempt,
    LogState,
    count_runs,
    entry_summaries,
    step_runs,
    unit_summary,
)
from maxent_arrow.testing import make_batch


def _run(tmp_path) -> RolloutStore:
    root = tmp_path / "run"
    store = RolloutStore.create(root, compact_every=None)
    for step in range(6):
        store.append(make_batch(step))
        store.append(make_batch(step, kind="eval"))
    store.compact(kind="train", max_steps=3)
    store.append_records("notes", pa.table({"step": [0, 1], "text": ["a", "b"]}))
    # A resume at step 4 supersedes steps 4 and 5 of the first attempt (in part a segment).
    resumed = RolloutStore(root, resume_from=4, compact_every=None, attempt="second")
    resumed.append(make_batch(4, seed=7))
    resumed.checkpoint()
    return resumed


def _replayed(log: CommitLog, version: int) -> LogState:
    state = LogState(run=log.run)
    for v in range(1, version + 1):
        entry = log.entry(v)
        assert entry is not None
        entry.apply(state)
    return state


def _same(a: LogState, b: LogState) -> None:
    assert a.version == b.version and a.run == b.run
    assert [x.to_json() for x in a.attempts] == [x.to_json() for x in b.attempts]
    assert a.units.keys() == b.units.keys()
    for rel, x in a.units.items():
        y = b.units[rel]
        assert (x.attempt, x.version, x.step_size, x.step_crc32) == (
            y.attempt, y.version, y.step_size, y.step_crc32,
        )  # fmt: skip
        assert dict(x.record) == dict(y.record)
        assert dict(x.record["rows"]) == dict(y.record["rows"])
    assert a.records == b.records
    assert a.retiring == b.retiring
    assert a.effective().keys() == b.effective().keys()
    for e in a.units.values():
        assert a.effective_units(e) == b.effective_units(e)
    assert a.writes == b.writes


def test_a_lazily_read_checkpoint_is_the_replayed_state(tmp_path):
    store = _run(tmp_path)
    reader = ReadOnlyStore(store.root)
    log = reader.catalog.log  # type: ignore[attr-defined]
    lazy = log.state()
    assert lazy.version > 0
    _same(lazy, _replayed(CommitLog(log.backend, log.run), lazy.version))
    # What readers serve is the same, whichever way the state was built.
    assert reader.sql("SELECT count(*) AS n FROM steps").to_pylist() == [{"n": len(store.units())}]


def test_a_checkpoint_written_from_a_lazy_state_equals_one_from_a_parsed_state(tmp_path):
    store = _run(tmp_path)
    log = ReadOnlyStore(store.root).catalog.log  # type: ignore[attr-defined]
    lazy = log.state()  # nothing parsed yet
    parsed = _replayed(CommitLog(log.backend, log.run), lazy.version)
    assert checkpoint_table(lazy).equals(checkpoint_table(parsed))
    # Written, read again and used: the same units and rows.
    log.write_checkpoint(lazy)
    time.sleep(0.01)
    again = CommitLog(log.backend, log.run).state()
    _same(again, parsed)


def test_summaries_of_a_checkpoint_are_those_of_the_entries(tmp_path):
    """Each step file's summary (what ``inspect`` sums) read from a checkpoint is the one the
    log computes from the entries' step rows, and its counts are the step rows'."""
    store = _run(tmp_path)
    log = ReadOnlyStore(store.root).catalog.log  # type: ignore[attr-defined]
    lazy = log.state()
    parsed = _replayed(CommitLog(log.backend, log.run), lazy.version)
    for rel, entry in lazy.units.items():
        assert callable(entry.summary)  # read from the checkpoint when asked for
        [summary] = entry_summaries([entry])
        assert summary == unit_summary(parsed.units[rel].record)
        rows = parsed.units[rel].record["rows"]
        [counts] = summary["kinds"]
        assert counts["kind"] == rows["kind"][0] and counts["rows"] == len(rows["step"])
        assert [a + b * i for a, b, c in counts["steps"] for i in range(c)] == sorted(rows["step"])
        assert counts["groups"] == sum(rows["num_groups"])
        assert counts["ranks"] == sorted(set(rows["rank"]))


@given(st.lists(st.lists(st.integers(0, 60), max_size=25), min_size=1, max_size=6))
def test_step_runs_and_their_count(files):
    """Runs encode a file's distinct steps exactly, and any files' runs count the distinct
    steps of all of them (overlapping files of one step range: ranks apart)."""
    runs = []
    for steps in files:
        distinct = sorted(set(steps))
        mine = step_runs(distinct)
        assert [a + b * i for a, b, c in mine for i in range(c)] == distinct
        runs += mine
    assert count_runs(runs) == len({s for steps in files for s in steps})
    assert count_runs(step_runs(list(range(0, 100_000, 10))) * 8) == 10_000  # one run


def test_a_checkpoint_of_many_units_is_read_one_row_group_at_a_time(tmp_path):
    """Attempts, record files and retiring files come first, in a row group of their own;
    the units follow in row groups of CHECKPOINT_ROW_GROUP rows, and a unit's record is read
    from its row group when first used: the state read back is the state written."""
    state = LogState(run="r")
    Entry(1, BeginAttempt(Attempt("a", started_at="t")), "a").apply(state)
    units = 700  # 1,400 unit rows: two row groups of units
    for step in range(units):
        name = f"steps/step-{step:010d}.rank-00000.train.t{step:012x}.parquet"
        rows = {"step": [step], "rank": [0], "kind": ["train"], "num_groups": [3],
                "num_samples": [9], "config": ['{"tau": 0.5}']}  # fmt: skip
        record = {"group_file": name[6:], "group_size": 100 + step, "rows": rows}
        Entry(step + 2, AppendUnit(name, record, 10, step), "a").apply(state)
    notes = AppendRecords("notes", {"path": "records/notes/x.parquet", "rows": 2})
    Entry(units + 2, notes, "a").apply(state)
    data = checkpoint_bytes(state)
    source = pq.ParquetFile(pa.BufferReader(data))
    sizes = [source.metadata.row_group(i).num_rows for i in range(source.num_row_groups)]
    assert sizes == [2, CHECKPOINT_ROW_GROUP, 2 * units - CHECKPOINT_ROW_GROUP]
    assert set(source.read_row_group(0, ["kind"]).column(0).to_pylist()) == {
        "attempt", "records:notes"
    }  # fmt: skip
    back = state_from_checkpoint(data)
    records = [e.record for e in back.units.values()]
    assert all(isinstance(r, LazyRecord) and not r.parsed for r in records)  # none parsed
    assert [a.id for a in back.attempts] == ["a"] and back.records == state.records
    assert back.units.keys() == state.units.keys()
    for rel, e in back.units.items():
        assert dict(e.record) == dict(state.units[rel].record)
    assert entry_summaries(list(back.units.values())) == [
        unit_summary(e.record) for e in state.units.values()
    ]
    assert checkpoint_table(back).equals(checkpoint_table(state))
