"""The report's files: PNGs that are real, full-width, non-blank images; a summary whose
numbers agree with the data written in the test (numpy, not SQL: the browser test checks the
page against SQL); the parts a run lacks said absent; damaged files left out said so."""

from __future__ import annotations

import html
import json
import re
import warnings

import numpy as np
import pyarrow as pa
import pytest
from matplotlib.image import imread
from test_analytics import write_store

from maxent_arrow import RolloutBatch, RolloutStore
from maxent_arrow.analytics.report import build_report
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.testing import CONFIG, make_batch

EXPECTED_PLOTS = {
    "reward curve": "reward_curve.png",
    "eval": "eval.png",
    "success": "success.png",
    "losses": "losses.png",
    "exploration": "exploration.png",
    "group entropy": "group_entropy.png",
    "kl": "kl.png",
    "lengths": "lengths.png",
    "advantages": "advantages.png",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    written = write_store(
        root / "store",
        steps=range(6),
        eval_steps=(2, 5),
        seed=3,
        losses=True,
        collapse_at=lambda step: step == 5,
    )
    report = build_report(written.root, root / "out", progress=False)
    return written, report


def _image(path):
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n", path
    return imread(path)


def test_every_plot_is_a_full_width_non_blank_png(built):
    _, report = built
    assert {name: p.name for name, p in report.plots.items()} == EXPECTED_PLOTS
    assert report.skipped == {} and report.left_out == []
    for path in report.plots.values():
        pixels = _image(path)
        assert pixels.ndim == 3 and pixels.shape[1] == 1200 and pixels.shape[0] > 300
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


def test_summary_start_peak_end_match_the_written_data(built):
    written, report = built
    summary = report.run_summary
    steps = written.by_step()
    means = {s: np.concatenate([g.utils for g in gs]).mean() for s, gs in steps.items()}
    reward = summary.trend("reward.total_utils")
    assert (reward.start_step, reward.end_step) == (0, 5)
    assert reward.start == pytest.approx(means[0]) and reward.end == pytest.approx(means[5])
    peak_step = max(means, key=lambda s: (means[s], -s))
    assert reward.peak == pytest.approx(means[peak_step]) and reward.peak_step == peak_step
    accuracy = summary.trend("reward.accuracy")
    acc5 = np.concatenate([g.rewards["accuracy"] for g in steps[5]]).mean()
    assert accuracy.end == pytest.approx(acc5)
    evals = written.by_step("eval")
    eval_acc = summary.trend("eval.accuracy")
    assert (eval_acc.start_step, eval_acc.end_step) == (2, 5)
    assert eval_acc.end == pytest.approx(
        np.concatenate([g.rewards["accuracy"] for g in evals[5]]).mean()
    )
    lens5 = np.concatenate([g.lens for g in steps[5]])
    assert summary.trend("mean_length").end == pytest.approx(lens5.mean())
    assert summary.trend("clipped_frac").end == pytest.approx((lens5 >= 24).mean())
    utils5 = np.concatenate([g.utils for g in steps[5]])
    assert summary.trend("success_rate").end == pytest.approx((utils5 > 0.5).mean())
    # Step 5 collapsed: each group one distinct text, d/K = 1/K; every earlier group is
    # all distinct.
    distinct = summary.trend("distinct_completions")
    assert distinct.start == 1.0
    assert distinct.end == pytest.approx(np.mean([1 / len(g.utils) for g in steps[5]]))
    # Losses are the step rows' values, averaged over the ranks of a step.
    rows = [r for r in written.step_rows if r["kind"] == "train"]
    total = {s: np.mean([r["total_loss"] for r in rows if r["step"] == s]) for s in steps}
    assert summary.trend("loss.total_loss").end == pytest.approx(total[5])
    assert summary.trend("kl_value").start == pytest.approx(
        np.mean([r["kl_value"] for r in rows if r["step"] == 0])
    )
    # Policy entropy per token: Σ H / Σ T (the fixture stores H = 0.1 T).
    assert summary.trend("policy_entropy").end == pytest.approx(0.1)
    facts = {f.key: f.value for f in summary.facts}
    assert facts["ranks"] == 2 and facts["train_steps"] == 6 and facts["eval_steps"] == 2
    assert facts["train_completions"] == sum(len(g.utils) for g in written.train())
    assert facts["bytes"] == sum(
        p.stat().st_size for d in ("groups", "steps") for p in (written.root / d).glob("*")
    )
    on_disk = json.loads((report.out / "summary.json").read_text())
    assert on_disk["trends"]["reward.total_utils"]["end"] == pytest.approx(reward.end)
    assert on_disk == report.summary


def test_pages_show_labels_units_and_the_sections(built):
    _, report = built
    page = report.html.read_text()
    assert page.startswith("<!doctype html>")
    for png in EXPECTED_PLOTS.values():
        assert f'src="{png}"' in page
        assert f"({png})" in report.markdown.read_text()
    labels = (
        "Completions trained on",
        "Completion length, mean",
        "Loss: total",
        "Policy entropy, per token",
        "KL to the reference, per token",
        "of the MaxEnt weights within a group",
        "Eval completions against their gold answers",
        "Best and worst prompt groups of the run",
    )
    for label in labels:
        assert label in page, label
    assert "bytes_on_disk" not in page and "last_reward_mean" not in page  # no raw keys
    md = report.markdown.read_text()
    assert md.startswith("# Run report") and "| Completions trained on |" in md


def _table_rows(page: str, table_id: str) -> list[list[str]]:
    body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', page, re.S)
    assert body, table_id
    return [
        [
            html.unescape(re.sub(r"<[^>]+>", "", cell))
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        ]
        for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S)
    ]


def test_best_and_worst_groups_span_the_run_with_their_gold_answers(built):
    written, report = built
    groups = written.train()
    key = {id(g): (g.step, f"{g.step}.{g.rank}.{g.index}") for g in groups}
    # Best: highest mean U, ties to the later step, then by group id; worst the other way,
    # among the rest. Over every train step, not the last one only.
    best = sorted(groups, key=lambda g: (-g.utils.mean(), -g.step, key[id(g)][1]))[:3]
    rest = [g for g in groups if all(g is not b for b in best)]
    worst = sorted(rest, key=lambda g: (g.utils.mean(), -g.step, key[id(g)][1]))[:3]
    rows = _table_rows(report.html.read_text(), "extremes-table")
    assert len(rows) == 6
    for row, (which, g) in zip(rows, [("best", g) for g in best] + [("worst", g) for g in worst]):
        label, step, prompt, answer, mean, scored, best_text, best_u, worst_text, worst_u = row
        assert label.startswith(which) and int(step) == g.step
        assert prompt == g.prompt and answer == "42"  # the gold answer
        assert float(mean) == pytest.approx(g.utils.mean(), rel=1e-3, abs=1e-4)
        assert scored == f"{len(g.utils)} / {len(g.utils)}"
        assert best_text == g.completions[int(np.argmax(g.utils))][:300]
        assert float(best_u) == pytest.approx(g.utils.max(), rel=1e-3, abs=1e-4)
        assert float(worst_u) == pytest.approx(g.utils.min(), rel=1e-3, abs=1e-4)
    assert len({int(r[1]) for r in rows}) > 1  # from several steps


def test_eval_completions_are_shown_beside_their_gold_answers(built):
    written, report = built
    page = report.html.read_text()
    last = written.by_step("eval")[5]
    for g in last:
        for text in g.completions:
            assert text in page
    assert "Eval completions against their gold answers (step 5)" in page


def test_missing_parts_are_said_absent_not_fatal(tmp_path):
    written = write_store(
        tmp_path / "s", steps=range(3), ranks=1, drop_at=lambda s: ("q", "weights", "advantages")
    )
    report = build_report(written.root, tmp_path / "out", progress=False)
    assert {"group entropy", "advantages", "eval", "losses"} <= set(report.skipped)
    assert set(report.plots) == {
        "reward curve", "success", "exploration", "kl", "lengths",
    }  # fmt: skip
    absent = report.run_summary.absent
    assert "q and MaxEnt weights" in absent and "loss components" in absent
    page = report.html.read_text()
    assert 'id="absent"' in page and "Not recorded by this run" in page
    for path in report.plots.values():
        assert _image(path)[..., :3].std() > 0.05


def test_a_report_with_skipped_damage_says_what_was_left_out(tmp_path):
    written = write_store(tmp_path / "s", steps=range(4), ranks=1)
    victim = sorted((written.root / "groups").glob("*.parquet"))[1]
    data = bytearray(victim.read_bytes())
    data[-64] ^= 0xFF  # the footer
    victim.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = build_report(
            ReadOnlyStore(written.root, on_error="skip"), tmp_path / "out", progress=False
        )
    assert any(victim.name in str(w.message) for w in caught)  # still warned to the caller
    assert len(report.left_out) == 1 and victim.name in report.left_out[0]
    assert report.summary["left_out"] == report.left_out
    page = report.html.read_text()
    assert 'id="left-out"' in page and "Data left out" in page and victim.name in page
    assert "Data left out" in report.markdown.read_text()
    # Nothing was left out of an undamaged store's report: no banner.
    clean = write_store(tmp_path / "c", steps=range(2), ranks=1)
    assert (
        'id="left-out"'
        not in build_report(clean.root, tmp_path / "o2", progress=False).html.read_text()
    )


_HOSTILE = "<img src=x onerror=alert(1)>|`x`\nnext [a](javascript:b) \\|"


def _hostile_batch(step: int, kind: str = "train") -> RolloutBatch:
    """A step whose prompts, answers, completions, a reward name and the config hold HTML
    and Markdown table syntax."""
    config = {**CONFIG, "note": _HOSTILE, "<b>key|</b>": 1}
    batch = make_batch(step, kind=kind, reward_names=("accuracy", "<img src=y onerror=z>|r"),
                       config=config)  # fmt: skip
    groups = batch.groups
    for name in ("prompt", "answer"):
        groups = groups.set_column(
            groups.schema.get_field_index(name), name, pa.array([_HOSTILE] * groups.num_rows)
        )
    completions = groups.column("completions")
    texts = pa.array([_HOSTILE] * len(completions.flatten()))
    groups = groups.set_column(
        groups.schema.get_field_index("completions"),
        "completions",
        pa.ListArray.from_arrays(completions.offsets, texts),
    )
    return RolloutBatch(groups, batch.step_row)


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells (a ``|`` after a backslash is the cell's text)."""
    return re.split(r"(?<!\\)\|", re.sub(r"\\\\", "", line.strip()))[1:-1]


def test_summary_md_escapes_stored_html_and_markdown(tmp_path):
    """Fault probe F08: values of the store (prompts, completions, answers, a reward name,
    config keys and values) are text in ``summary.md``: no raw HTML a renderer would run,
    and every table row keeps its columns."""
    store = RolloutStore.create(tmp_path / "run", config={"note": _HOSTILE}, compact_every=None)
    for step in range(3):
        store.append(_hostile_batch(step))
    store.append(_hostile_batch(2, "eval"))
    report = build_report(store.root, tmp_path / "out", progress=False)
    md = report.markdown.read_text(encoding="utf-8")
    assert "<img" not in md and "<b>" not in md and "\\](javascript" in md
    assert "&lt;img src=x onerror=alert(1)&gt;\\|\\`x\\` next" in md
    widths: list[int] = []
    for line in md.splitlines():
        if line.startswith("|"):
            widths.append(len(_cells(line)))
        elif widths:
            assert len(set(widths)) == 1, widths  # every row of a table: its header's columns
            widths = []
    markdown_it = pytest.importorskip("markdown_it")
    page = markdown_it.MarkdownIt("commonmark").enable("table").render(md)  # HTML allowed
    assert "<img src=x" not in page and "<img src=y" not in page and "<b>" not in page
    assert not any("javascript" in href for href in re.findall(r'href="([^"]*)"', page))
    separators = [line for line in md.splitlines() if line.startswith("|---")]
    assert page.count("<table>") == len(separators) >= 4
