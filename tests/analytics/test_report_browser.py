"""The report as a researcher sees it: opened in headless Chromium at 1280 px, screenshotted
(full page, kept in ``tests/artifacts/``: the path is printed), and every number of its
summary read back from the page and checked against a SQL query over the same store
(``report_sql.check_page``). Three kinds of store: the analytics fixture (every part
recorded), a MaxEnt demo run, and a run recorded from TRL (no q, weights or losses)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from report_sql import PAGE_SCRIPT, assert_shown, check_page

from maxent_arrow.analytics.report import build_report
from maxent_arrow.analytics.run import RunAnalytics
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.testing import write_store

FIXTURE_PLOTS = {
    "reward_curve.png", "eval.png", "success.png", "losses.png", "exploration.png",
    "group_entropy.png", "kl.png", "lengths.png", "advantages.png",
}  # fmt: skip


def _look(browser, report, name: str) -> dict:
    """Open the report at 1280 x 900, save a full-page screenshot, read the page."""
    with browser.open(report.html, width=1280, height=900) as page:
        shot = browser.screenshot(page, name)
        data = page.evaluate(PAGE_SCRIPT)
    print(f"\nscreenshot of the report: {shot}")
    assert shot.stat().st_size > 50_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def _readable_at_1280(data: dict, plots: set[str]) -> None:
    # Nothing wider than the window: no horizontal scrolling at 1280 px.
    assert data["scrollWidth"] <= data["clientWidth"] == 1280, data["wide"][:5]
    assert data["wide"] == []
    # Each plot is drawn full width (1200 px) and shown nearly 1:1, so its legend and labels
    # keep the size they were drawn at.
    assert {i["src"] for i in data["images"]} == plots
    for image in data["images"]:
        assert image["natural"] == 1200, image
        assert image["width"] >= 0.9 * image["natural"], image


def test_the_report_reads_in_a_browser_and_every_summary_number_is_sql(browser, tmp_path):
    written = write_store(
        tmp_path / "store",
        steps=range(8),
        eval_steps=(3, 7),
        seed=4,
        losses=True,
        collapse_at=lambda step: step >= 6,
        config={"model": "tiny-gpt2", "trainer": "maxent-arrow",
                "tokenizer": {"class": "ByT5Tokenizer", "vocab_size": 256}},
    )  # fmt: skip
    report = build_report(written.root, tmp_path / "report", progress=False)
    data = _look(browser, report, "report_fixture_1280")
    _readable_at_1280(data, FIXTURE_PLOTS)
    with RunAnalytics(written.root) as run:
        checked = check_page(data, run, written.root)
    assert checked > 60
    assert data["banner"] is None and data["absent"] is None  # nothing left out or missing
    assert data["facts"]["tokenizer"] == "ByT5Tokenizer (vocabulary 256)"
    assert data["evalRows"] > 0 and data["extremeRows"] == 6
    # The collapse shows: at the last step every group drew one text K times (numpy on the
    # written data, not SQL).
    end, at = data["trends"]["distinct_completions"][2]
    assert at == "step 7"
    assert_shown(end, float(np.mean([1 / len(g.utils) for g in written.by_step()[7]])), "end")


def test_a_report_with_damaged_files_skipped_names_them_in_a_banner(browser, tmp_path):
    """Read with on_error="skip": the banner names the damaged file, and every number of the
    summary is what SQL says over the same store read the same way (the file left out)."""
    written = write_store(tmp_path / "store", steps=range(5), eval_steps=(4,), seed=6)
    victim = sorted((written.root / "groups").glob("*.train.*parquet"))[2]
    data = bytearray(victim.read_bytes())
    data[-64] ^= 0xFF  # the footer
    victim.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the store warns for each skip; the page says it
        report = build_report(
            ReadOnlyStore(written.root, on_error="skip"), tmp_path / "report", progress=False
        )
        page = _look(browser, report, "report_left_out_1280")
        with RunAnalytics(ReadOnlyStore(written.root, on_error="skip")) as run:
            check_page(page, run, written.root)
    assert page["banner"] is not None and victim.name in page["banner"]
    assert "Data left out: 1 damaged file(s) were skipped" in page["banner"]
    _readable_at_1280(page, {p.name for p in report.plots.values()})


@pytest.mark.slow
def test_the_report_of_a_demo_run(browser, tmp_path):
    from maxent_arrow import demo

    out = tmp_path / "demo"
    demo.main(["--out", str(out), "--steps", "3", "--prompts", "2", "--k", "4",
               "--eval-every", "2", "--eval-prompts", "2", "--quiet", "--no-report"])  # fmt: skip
    root = out / "store"
    report = build_report(root, tmp_path / "report", progress=False)
    data = _look(browser, report, "report_demo_1280")
    with RunAnalytics(root) as run:
        check_page(data, run, root)
        has_entropy = (
            run.sql("SELECT count(policy_entropy_sum) AS n FROM samples").column("n")[0].as_py()
        )
    # A MaxEnt run: losses, KL, q and weights, eval steps, all plotted.
    assert {"losses", "kl", "group entropy", "eval", "exploration"} <= set(report.plots)
    assert "loss.total_loss" in data["trends"] and "eval.total_utils" in data["trends"]
    # The policy's own entropy is shown when the run recorded it, and said missing if not.
    assert ("policy_entropy" in data["trends"]) == bool(has_entropy)
    assert ("policy entropy" in (data["absent"] or "")) == (not has_entropy)
    assert data["evalRows"] > 0 and data["extremeRows"] > 0
    _readable_at_1280(data, {p.name for p in report.plots.values()})


@pytest.mark.slow
def test_the_report_of_a_trl_run_plots_what_exists_and_says_what_is_absent(browser, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
    import trl_runs

    trainer = trl_runs.trainer(
        tmp_path, background=False, chat=True, eval_rows=2, eval_strategy="steps",
        eval_steps=2, per_device_eval_batch_size=4, max_steps=3, num_iterations=1,
    )  # fmt: skip
    trainer.train()
    root = tmp_path / "store"
    report = build_report(root, tmp_path / "report", progress=False)
    data = _look(browser, report, "report_trl_1280")
    with RunAnalytics(root) as run:
        check_page(data, run, root)
    # TRL's recorder stores no q or MaxEnt weights: that part is said absent, the rest is
    # plotted; its losses are TRL's own log (trainer_metrics), plotted, not said absent.
    assert {"reward curve", "eval", "success", "exploration", "lengths"} <= set(report.plots)
    assert "losses" in report.plots and "group entropy" in report.skipped
    assert "loss.trainer" in data["trends"]
    for missing in ("q and MaxEnt weights", "policy entropy"):
        assert missing in data["absent"]
    assert "loss components" not in data["absent"]
    assert data["facts"]["trainer"].startswith("trl.GRPOTrainer")
    # Chat prompts are shown by their text, beside the gold answer.
    assert "9+9=" in data["bodyText"] and "18" in data["bodyText"]
    _readable_at_1280(data, {p.name for p in report.plots.values()})
