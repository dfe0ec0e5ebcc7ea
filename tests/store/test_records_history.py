"""Record tables across attempts: a trainer resume supersedes the lifecycle events of the
steps from its resume point on, and the three histories split the rows between them."""

from __future__ import annotations

import pyarrow as pa

from maxent_arrow import RolloutStore
from maxent_arrow.testing import streamed_batch


def _steps(table: pa.Table) -> list[tuple[int, str]]:
    return sorted(zip(table.column("step").to_pylist(), table.column("attempt").to_pylist()))


def test_superseded_records_are_only_those_a_later_attempt_superseded(tmp_path):
    root = tmp_path / "store"
    RolloutStore.create(root, if_exists="error")
    generator = RolloutStore(root, role="generator", if_exists="resume", attempt="g")
    generator.append(streamed_batch(0, 0, 6))
    first = RolloutStore(root, role="trainer", resume_from=0, attempt="t1")
    groups = first.frontier().in_flight
    for t in range(3):  # steps 0 and 1 checkpointed; step 2 died before its checkpoint
        first.record_lifecycle(groups.slice(2 * t, 2), step=t, event="trained")
    second = RolloutStore(root, role="trainer", resume_from=2, attempt="t2")
    second.begin_attempt()
    store = RolloutStore(root)
    assert _steps(store.lifecycle()) == [(0, "t1"), (0, "t1"), (1, "t1"), (1, "t1")]
    superseded = [(2, "t1"), (2, "t1")]
    assert _steps(store.lifecycle(attempts="superseded")) == superseded
    assert store.lifecycle(attempts="all").num_rows == 6
    assert store.frontier().position == 4
    # The resumed attempt redoes step 2: its rows are effective, not superseded.
    second.record_lifecycle(store.frontier().in_flight, step=2, event="trained")
    store = RolloutStore(root)
    assert _steps(store.lifecycle(attempts="superseded")) == superseded
    effective = store.lifecycle()
    assert _steps(effective)[-2:] == [(2, "t2"), (2, "t2")]
    assert store.lifecycle(attempts="all").num_rows == effective.num_rows + len(superseded)
    assert store.sql("SELECT count(*) AS n FROM lifecycle").column("n")[0].as_py() == 6
    frontier = store.frontier()
    assert (frontier.position, frontier.gaps, frontier.double) == (6, [], [])


def test_the_groups_view_leaves_out_only_what_a_trainer_dropped(tmp_path):
    """A drop recorded by the run's trainer leaves the group out of ``groups``; a drop by a
    replay consumer of another role (the sampler training a second policy from the store) is
    in ``lifecycle`` and leaves the run's ``groups`` as its trainer trained them."""
    RolloutStore.create(tmp_path / "run")
    trainer = RolloutStore(tmp_path / "run", attempt="run")
    trainer.append(streamed_batch(0, 0, 3))
    sampler = RolloutStore(tmp_path / "run", role="sampler", attempt="replay")
    sampler.record_lifecycle(sampler.read(steps=[0]).slice(0, 2), step=7, event="dropped",
                             reason="zero_std")  # fmt: skip
    query = "SELECT group_index FROM groups ORDER BY 1"
    assert [r["group_index"] for r in trainer.sql(query).to_pylist()] == [0, 1, 2]
    lifecycle = trainer.sql("SELECT attempt, group_index, event FROM lifecycle ORDER BY 2")
    assert lifecycle.to_pylist() == [
        {"attempt": "replay", "group_index": g, "event": "dropped"} for g in (0, 1)
    ]
    trainer.record_lifecycle(trainer.read(steps=[0]).slice(1, 1), step=0, event="dropped",
                             reason="stale")  # fmt: skip
    assert [r["group_index"] for r in trainer.sql(query).to_pylist()] == [0, 2]
    every = "SELECT group_index FROM groups_all ORDER BY 1"
    assert [r["group_index"] for r in trainer.sql(every).to_pylist()] == [0, 1, 2]
