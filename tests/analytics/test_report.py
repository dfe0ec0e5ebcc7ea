"""The plotted report: PNGs that are real, non-blank images; HTML and Markdown pages whose
numbers agree with the data written in the test."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.image import imread
from test_analytics import write_store

from maxent_arrow.analytics.report import build_report

EXPECTED_PLOTS = {
    "reward curve": "reward_curve.png",
    "success": "success.png",
    "lengths": "lengths.png",
    "entropy": "entropy.png",
    "kl buckets": "kl_buckets.png",
    "advantages": "advantages.png",
    "eval": "eval.png",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    written = write_store(root / "store", steps=range(6), eval_steps=(2, 5), seed=3)
    report = build_report(written.root, root / "out", progress=False)
    return written, report


def _image(path):
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n", path
    return imread(path)


def test_every_plot_is_a_valid_non_blank_png(built):
    _, report = built
    assert {name: p.name for name, p in report.plots.items()} == EXPECTED_PLOTS
    assert report.skipped == {}
    for path in report.plots.values():
        pixels = _image(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300
        rgb = pixels[..., :3]
        assert rgb.std() > 0.05, f"{path.name} looks blank"
        # Coloured ink (the data lines), not only the black frame and text on white.
        saturation = rgb.max(axis=2) - rgb.min(axis=2)
        assert (saturation > 0.3).mean() > 0.001, f"{path.name} has no coloured marks"


def test_plots_change_with_the_data(tmp_path, built):
    _, report = built
    other = write_store(tmp_path / "other", steps=range(6), eval_steps=(2, 5), seed=11)
    second = build_report(other.root, tmp_path / "out", progress=False)
    a = _image(report.plots["reward curve"])
    b = _image(second.plots["reward curve"])
    assert a.shape == b.shape and not np.array_equal(a, b)


def test_summary_numbers_match_the_written_data(built):
    written, report = built
    steps = written.by_step()
    last = max(steps)
    utils_last = np.concatenate([g.utils for g in steps[last]])
    utils_first = np.concatenate([g.utils for g in steps[min(steps)]])
    lens_last = np.concatenate([g.lens for g in steps[last]])
    s = report.summary
    assert s["train_steps"] == len(steps) and s["last_step"] == last
    assert s["eval_steps"] == 2 and s["ranks"] == 2
    assert s["completions"] == sum(len(g.utils) for g in written.train())
    assert s["last_reward_mean"] == pytest.approx(utils_last.mean())
    assert s["first_reward_mean"] == pytest.approx(utils_first.mean())
    assert s["last_success_rate"] == pytest.approx((utils_last > 0.5).mean())
    assert s["last_mean_length"] == pytest.approx(lens_last.mean())
    assert s["last_clipped_frac"] == pytest.approx((lens_last >= 24).mean())
    on_disk = json.loads((report.out / "summary.json").read_text())
    assert on_disk["last_reward_mean"] == pytest.approx(s["last_reward_mean"])


def test_html_and_markdown_pages(built):
    written, report = built
    page = report.html.read_text()
    assert page.startswith("<!doctype html>")
    for png in EXPECTED_PLOTS.values():
        assert f'src="{png}"' in page
        assert f"({png})" in report.markdown.read_text()
    assert f"{report.summary['last_reward_mean']:.4g}" in page
    # Best and worst completions of the last step are shown (text of the written data).
    last = max(written.by_step())
    texts = {c for g in written.by_step()[last] for c in g.completions}
    assert sum(t in page for t in texts) >= 3
    md = report.markdown.read_text()
    assert md.startswith("# Run report") and "| last_reward_mean |" in md


def test_missing_parts_are_skipped_not_fatal(tmp_path):
    written = write_store(
        tmp_path / "s", steps=range(3), ranks=1, drop_at=lambda s: ("q", "weights", "advantages")
    )
    report = build_report(written.root, tmp_path / "out", progress=False)
    assert "entropy" in report.skipped and "advantages" in report.skipped
    assert "eval" in report.skipped  # no eval rows in this run
    assert set(report.plots) == {"reward curve", "success", "lengths", "kl buckets"}
    for path in report.plots.values():
        assert _image(path)[..., :3].std() > 0.05
