"""Which checkpoints a store keeps (``store/history/log.py``: KEEP_NEWEST, KEEP_EVERY): each
checkpoint holds the whole state, so keeping every one would grow the log as the square of the
commits (30 GB of checkpoints at 62,500 steps). Real commits into a real log; the intervals
scaled down (a checkpoint every 10 versions, every 100th kept) so the test runs in a second."""

from __future__ import annotations

import json

import pytest

from maxent_arrow.store.history import log as L
from maxent_arrow.store.history import operations as O
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.storage.backend import LocalBackend
from maxent_arrow.store.storage.caches import CACHES


@pytest.fixture
def log(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "CHECKPOINT_EVERY", 10)
    monkeypatch.setattr(L, "KEEP_EVERY", 100)
    (tmp_path / "store" / "log").mkdir(parents=True)
    return CommitLog(LocalBackend(tmp_path / "store"), run="run-1")


def _commit(log: CommitLog, upto: int) -> None:
    while log.state().version < upto:
        log.commit(O.Noop(str(log.state().version + 1)))


def _kept(log: CommitLog) -> list[int]:
    names = sorted(p.name for p in (log.backend.root / "log").glob("checkpoint-*.parquet"))
    return [int(n.removeprefix("checkpoint-").removesuffix(".parquet")) for n in names]


def _fresh_state_at(log: CommitLog, version: int):
    CACHES.checkpoints.clear()
    return CommitLog(log.backend, run=log.run).state_at(version)


def test_the_newest_few_and_every_keep_every_th_checkpoint_are_kept(log):
    _commit(log, 250)
    assert _kept(log) == [100, 200, 230, 240, 250]
    # A checkpoint at close (not a multiple): kept while it is the newest or the one before.
    _commit(log, 255)
    log.write_checkpoint()
    _commit(log, 260)
    assert _kept(log) == [100, 200, 240, 250, 255, 260]
    hint = json.loads((log.backend.root / "log" / "_last_checkpoint.json").read_text())
    assert hint["version"] == 260 and hint["previous"] == 255
    _commit(log, 270)
    assert _kept(log) == [100, 200, 250, 260, 270]
    # Every version still reads as it was: from the kept checkpoint at or below it.
    for version in (5, 150, 199, 245, 257, 270):
        state = _fresh_state_at(log, version)
        assert state.version == version and sorted(state.notes) == list(range(1, version + 1))


def test_a_damaged_newest_checkpoint_falls_back_to_a_kept_one(log):
    _commit(log, 340)
    (log.backend.root / "log" / "checkpoint-00000000000000000340.parquet").write_bytes(b"torn")
    CACHES.checkpoints.clear()
    with pytest.warns(UserWarning, match="checkpoint not used"):
        state = CommitLog(log.backend, run=log.run).state_at(340)
    assert state.version == 340 and len(state.notes) == 340


def test_a_pointer_without_previous_retires_by_the_multiples_alone(log):
    # A pointer written before retention has no "previous": the writer deletes only the
    # multiple that left the newest few.
    _commit(log, 40)
    for v in (10, 20, 30):
        path = log.backend.root / "log" / L.checkpoint_name(v).removeprefix("log/")
        assert path.exists() == (v >= 20)
    hint_path = log.backend.root / "log" / "_last_checkpoint.json"
    hint = json.loads(hint_path.read_text())
    hint.pop("previous")
    hint_path.write_text(json.dumps(hint))
    _commit(log, 50)
    assert _kept(log) == [30, 40, 50]
