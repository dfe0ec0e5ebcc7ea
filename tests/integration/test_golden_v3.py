"""The golden store of format 3.0 in ``data/golden_v3`` (written once by
``data/make_golden_v3.py``: two ranks, a re-run, a compaction, a resume that supersedes half
a segment, an eval step, trainer metrics, dropped groups in the lifecycle, a retire): every
later version reads it through every reader and finds exactly what
``data/golden_v3_expected.json`` records, and the log's encoding is the one written, byte
for byte. A change of the log or checkpoint encoding fails here: it needs a ``golden_v4``
and an upgrade step, never a rewrite of this store."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from plain_readers import duckdb_groups, polars_groups

from maxent_arrow import RolloutStore
from maxent_arrow.analytics import describe_run
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.history.checkpoint import checkpoint_table, state_from_checkpoint
from maxent_arrow.store.history.log import entry_name
from maxent_arrow.store.history.operations import OPERATIONS, decode_entry

DATA = Path(__file__).resolve().parents[2] / "data"
EXPECTED = json.loads((DATA / "golden_v3_expected.json").read_text())


def _digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def _files(root: Path) -> list[tuple[str, bytes]]:
    return sorted(
        (p.relative_to(root).as_posix(), p.read_bytes()) for p in root.rglob("*") if p.is_file()
    )


@pytest.fixture
def golden(tmp_path) -> Path:
    root = tmp_path / "golden_v3"
    shutil.copytree(DATA / "golden_v3", root)
    before = _files(root)
    yield root
    assert _files(root) == before, "reading the golden store changed it"


@pytest.mark.parametrize("history", ["effective", "all", "superseded"])
def test_every_history_reads_as_recorded(golden, history):
    want = EXPECTED["histories"][history]
    store = ReadOnlyStore(golden, attempts=history)
    steps = store.read_steps(columns=["step", "rank", "kind", "reward_mean"])
    assert [list(u) for u in zip(*steps.select(["step", "rank", "kind"]).to_pydict().values())] == (
        want["units"]
    )
    assert steps.column("reward_mean").to_pylist() == want["reward_mean"]
    table = store.read()
    assert table.num_rows == want["groups"]
    for column in ("completion_ids", "q", "reward_values"):
        assert _digest(table.column(column).to_pylist()) == want[f"{column}_sha"], column
    assert store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py() == want["samples"]
    groups = store.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py()
    assert groups == want["sql_groups"]
    assert store.lifecycle().num_rows == want["lifecycle"]
    losses = store.read_records("trainer_metrics").sort_by("step").column("loss").to_pylist()
    assert losses == want["trainer_metrics_loss"]


def test_the_history_replay_tail_and_files_are_as_recorded(golden):
    store = RolloutStore(golden)
    assert store.manifest["schema_version"] == EXPECTED["schema_version"]
    assert store.catalog.version == EXPECTED["log_version"]
    got = [[a["id"], a["role"], a["mode"], a["resume_from"]] for a in store.attempts()]
    assert got == EXPECTED["attempts"]
    account = store.catalog.account()
    assert account is not None and account["superseded_steps"] == EXPECTED["superseded_steps"]
    events = [
        [e.event, e.step, e.rank, e.kind, [dict(s) for s in e.superseded]]
        for e in store.tail(since=0, timeout=0.05)
    ]
    assert events == EXPECTED["tail"]
    assert [[b.step, b.rank] for b in store.replay(source="parquet")] == EXPECTED["replay"]
    live = [[Path(p).relative_to(golden).as_posix(), w] for p, w in store.live_files("groups")]
    assert live == EXPECTED["live_files"]
    info = describe_run(store)
    assert info["history"]["log_version"] == EXPECTED["log_version"]
    assert info["group_rows"] == EXPECTED["histories"]["effective"]["groups"]
    report = store.verify()
    assert report.ok, str(report)


def test_plain_readers_read_the_effective_groups_through_the_checkpoint(golden):
    store = ReadOnlyStore(golden)
    served = sorted(
        tuple(r.values())
        for r in store.sql("SELECT step, rank, kind, group_index FROM groups").to_pylist()
    )
    assert len(served) == EXPECTED["histories"]["effective"]["sql_groups"]
    assert duckdb_groups(golden) == served
    assert polars_groups(golden) == served


def test_the_log_encoding_is_the_one_written(golden):
    """Each entry decodes and encodes back to its own bytes (the same time), every kind of
    operation the run writes is there, and the checkpoint decodes to a state whose table is
    the checkpoint's own."""
    version, seen = 1, set()
    while (golden / entry_name(version)).is_file():
        data = (golden / entry_name(version)).read_bytes()
        entry = decode_entry(data, version, entry_name(version))
        assert entry.encode() == data, f"entry {version} ({entry.op}) encodes differently"
        seen.add(entry.op)
        version += 1
    assert version - 1 == EXPECTED["log_version"]
    assert seen == {"attempt", "append", "compact", "records", "retire"} <= set(OPERATIONS)
    data = (golden / "log" / "_checkpoint.parquet").read_bytes()
    state = state_from_checkpoint(data)
    assert state.version == EXPECTED["log_version"]
    assert checkpoint_table(state).equals(pq.read_table(golden / "log" / "_checkpoint.parquet"))


def test_a_new_attempt_continues_the_golden_run(tmp_path):
    """The frozen store is a writable store of the current format: a resume continues it."""
    root = tmp_path / "continued"
    shutil.copytree(DATA / "golden_v3", root)
    store = RolloutStore(root, attempt="later", resume_from=7, compact_every=None)
    before = len(store.units())
    store.append_records("notes", pa.table({"step": [7], "text": ["x"]}))
    assert len(RolloutStore(root).units()) == before
    assert [a["id"] for a in RolloutStore(root).attempts()][-1] == "later"
    assert RolloutStore(root).verify().ok
