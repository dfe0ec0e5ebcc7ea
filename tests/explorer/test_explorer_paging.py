"""A step of more groups than a page holds: pages of the sorted, filtered rows, each its URL."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402
from viewing import served  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.explorer.pages import PAGE_SIZE  # noqa: E402


def test_pages_of_a_sorted_step(browser, tmp_path):
    root = tmp_path / "store"
    RolloutStore.create(root)
    RolloutStore(root).append(stores.batch(0, groups=2 * PAGE_SIZE + 20))
    stored = RolloutStore(root).read(steps=0).to_pylist()
    means = {}
    for r in stored:
        scored = [u for u in r["total_utils"] if u == u]
        means[r["group_index"]] = sum(scored) / len(scored)
    order = sorted(means, key=lambda g: (-means[g], g))
    with served(root) as (url, _proc), browser.open(url + "/step/0?kind=train") as page:
        page.click("a.sort[data-sort='mean_reward']")
        page.wait_for_url("**sort=mean_reward**")
        shown = []
        for number in (1, 2, 3):
            if number > 1:
                page.click(f".pager a:text-is('{number}')")
                page.wait_for_url(f"**page={number - 1}**")
                assert "sort=mean_reward" in page.url and "desc=1" in page.url
            rows = page.eval_on_selector_all(
                "#groups tbody tr", "t => t.map(r => Number(r.dataset.group))"
            )
            assert len(rows) == (PAGE_SIZE if number < 3 else 20)
            shown += rows
        assert page.inner_text("#count").startswith(f"{2 * PAGE_SIZE + 20} of")
    got = [means[g] for g in shown]
    assert got == sorted(got, reverse=True) and sorted(shown) == sorted(order)
