"""The explorer over a run recorded from TRL's ``GRPOTrainer`` (tests/integrations/trl_runs.py:
a tiny seeded GPT-2, chat prompts, β > 0): every page walked in headless Chromium, from the
reward curve to a step, a group (the chat prompt as a conversation, TRL's rewards per
function) and a completion's tokens, whose ids are the ones TRL generated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

from viewing import fingerprint, served  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402


@pytest.mark.slow
def test_a_trl_run_walked_from_curve_to_tokens(browser, tmp_path):
    import trl_runs

    trainer = trl_runs.trainer(
        tmp_path, background=False, chat=True, eval_rows=2, eval_strategy="steps",
        eval_steps=2, per_device_eval_batch_size=4, max_steps=3, num_iterations=1,
    )  # fmt: skip
    trainer.train()
    root = tmp_path / "store"
    before = fingerprint(root)
    stored = RolloutStore(root)
    with served(root) as (url, _proc), browser.open(url + "/") as page:
        captions = page.eval_on_selector_all(
            "figure.curve figcaption", "f => f.map(x => x.textContent)"
        )
        assert "reward (mean U)" in captions
        # TRL's loss is its own log (the step rows hold none): one chart, no "(trainer)" twin.
        assert "loss" in captions and not any("(trainer)" in c for c in captions)
        assert "trl.GRPOTrainer" in page.inner_text("#config")
        cells = "t => t.map(x => x.textContent)"
        statuses = page.eval_on_selector_all("#attempts td.status", cells)
        assert statuses == ["finished"]  # train() ended: the recorder's checkpoint says so
        browser.screenshot(page, "explorer_trl_overview")
        first = stored.steps(kind="train")[0]
        page.click(
            "figure[data-curve='reward (mean U)'] "
            f"a.point[data-step='{first}'][data-kind='train'] circle"
        )
        page.wait_for_url(f"**/step/{first}?kind=train")
        rows = stored.read(steps=first, kind="train").to_pylist()
        assert len(page.query_selector_all("#groups tbody tr")) == len(rows)
        heads = page.eval_on_selector_all("#groups th", "t => t.map(x => x.textContent)")
        assert "rank" in heads and "attempt" in heads
        browser.screenshot(page, "explorer_trl_step")
        page.click("#groups tbody tr:first-child a.grouplink")
        page.wait_for_url("**/group/**")
        gi = int(page.url.split("?")[0].rsplit("/", 1)[1])
        row = next(r for r in rows if r["group_index"] == gi)
        roles = page.eval_on_selector_all("#prompt .msg .role", "r => r.map(x => x.textContent)")
        assert roles == [m["role"] for m in row["prompt_messages"]] and "user" in roles
        assert row["prompt_messages"][-1]["content"] in page.inner_text("#prompt")
        cards = page.query_selector_all("#cards article.card")
        assert len(cards) == len(row["completions"])
        for name in row["reward_names"]:
            assert page.query_selector(f"td[data-figure='reward: {name}']") is not None
        browser.screenshot(page, "explorer_trl_group")
        page.click("article.card[data-index='0'] a.tokenlink")
        page.wait_for_url("**/tokens/**")
        chips = page.eval_on_selector_all("#tokens .tok .id", "t => t.map(x => x.textContent)")
        assert [int(c) for c in chips] == row["completion_ids"][0]
        # Each id's piece, from the tokenizer TRL trained with (ByT5, recorded by the run).
        pieces = page.eval_on_selector_all("#tokens .tok .piece", "t => t.map(x => x.textContent)")
        assert len(pieces) == len(chips) and "ByT5Tokenizer" in page.inner_text("#pieces")
        page.hover("#tokens .tok:first-child")
        page.wait_for_selector("#tip:not([hidden])")
        assert f"id {row['completion_ids'][0][0]}" in page.inner_text("#tip")
        browser.screenshot(page, "explorer_trl_tokens")
    assert fingerprint(root) == before
