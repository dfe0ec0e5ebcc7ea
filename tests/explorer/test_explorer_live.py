"""The explorer of a run still being written: a new step, and lifecycle records made after a
page was first shown, appear on the next page (the read-only store sees each commit)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.explorer import RunData  # noqa: E402


def test_new_steps_and_lifecycle_records_show_on_the_next_read(tmp_path):
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=2, resume=False, lifecycle=False)
    data = RunData(root)
    assert data.overview()["steps"]["train"] == [0, 1]
    assert {r["status"] for r in data.step_groups(1, "train").rows} == {None}
    writer = RolloutStore(root, if_exists="resume")  # the run goes on
    writer.append(stores.batch(2))
    rows = writer.read(steps=1, kind="train")
    writer.record_lifecycle(rows, step=1, event="trained")
    assert data.overview()["steps"]["train"] == [0, 1, 2]
    assert {r["status"] for r in data.step_groups(1, "train").rows} == {"trained"}
    assert len(data.step_groups(2, "train").rows) == stores.GROUPS


def test_a_compaction_under_the_explorer_keeps_the_overview_and_frees_the_old_files_rows(
    tmp_path,
):
    """The overview's per-file cache holds committed step files only: after a compaction
    merges them, the curves are the same and the merged-away files' rows are gone."""
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=4, resume=False, lifecycle=False)
    data = RunData(root)
    before = data.overview()
    old = {name for name, _ in data._step_cache}
    assert len(old) >= 4  # a step file per unit (the eval step has its own)
    writer = RolloutStore(root, if_exists="resume")
    writer.compact()
    after = data.overview()
    assert after["charts"] == before["charts"] and after["steps"] == before["steps"]
    now = {name for name, _ in data._step_cache}
    assert now == {unit.step_file for unit in data.store().units()}
    assert len(old - now) == 4 and len(now - old) == 1  # the 4 train steps' files, merged
