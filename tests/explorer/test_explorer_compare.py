"""The same prompt across steps, and across two runs (``--compare RUN2``), found by the
context columns' example id: exact, whatever the prompt's text."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402
from viewing import served  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402


def test_the_same_example_across_steps_and_two_runs(browser, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    stores.demo_like_store(first, steps=3, resume=False)
    stores.demo_like_store(second, steps=2, resume=False, lifecycle=False)
    with served(first, "--compare", str(second)) as (url, _proc):
        with browser.open(url + "/group/1/0/3?kind=train") as page:
            page.click("#compare")
            page.wait_for_url("**/compare?example_id=3**")
            tables = page.query_selector_all("table.data")
            assert [t.get_attribute("data-run") for t in tables] == [
                f"this run: {RolloutStore(first).uri}",
                f"the other run: {RolloutStore(second).uri}",
            ]
            steps = [
                t.eval_on_selector_all("tbody td:first-child", "c => c.map(x => x.textContent)")
                for t in tables
            ]
            assert steps == [["0", "1", "2"], ["0", "1"]]
            # The prompts differ from step to step (random numbers); the example id is the
            # same: each row is example 3's group.
            for step in (0, 1, 2):
                row = RolloutStore(first).read(steps=step, kind="train").to_pylist()[3]
                assert row["example_id"] == "3"
            # The other run's rows are listed, not linked (it is not served here).
            assert tables[1].query_selector("a") is None
            browser.screenshot(page, "explorer_compare_two_runs")
            # A row of this run opens its group.
            page.click("table.data >> nth=0 >> tbody tr:nth-child(3) a")
            page.wait_for_url("**/group/2/0/3?kind=train")
