"""The explorer a researcher reads without asking (issue 39), walked in headless Chromium over
a real ``maxent-arrow view`` of a finished run (``stores.reading_store``: a trainer run with a
dataset column, a ``log_extra`` column, its tokenizer recorded, a negative loss, a length
constant but for rounding, two optimizer steps per stored step in the trainer's log, and a
second policy trained from it by the replay sampler as a role of its own). Each page is
screenshotted under tests/artifacts/ and checked against the store read from outside."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402
from viewing import fingerprint, served  # noqa: E402

from maxent_arrow.analytics import RunAnalytics  # noqa: E402
from maxent_arrow.store import RolloutStore  # noqa: E402

# The SVG's own coordinates of every y tick label, and of the svg: a label drawn left of
# x = 0 (or right of the width) is clipped.
_TICKS = """figure => {
  const svg = figure.querySelector('svg');
  const box = svg.viewBox.baseVal;
  return Array.from(svg.querySelectorAll('text.tick[text-anchor=end]')).map(t => {
    const b = t.getBBox();
    return {text: t.textContent, left: b.x, right: b.x + b.width, width: box.width};
  });
}"""
# Each polyline: its stroke, dash, and its points in the SVG's coordinates; the plot's top and
# bottom (its y axis).
_LINES = """figure => {
  const svg = figure.querySelector('svg');
  const axis = Array.from(svg.querySelectorAll('line.axis')).find(l => l.x1.baseVal.value ===
      l.x2.baseVal.value);
  return {
    top: axis.y1.baseVal.value, bottom: axis.y2.baseVal.value,
    lines: Array.from(svg.querySelectorAll('polyline')).map(p => ({
      series: p.dataset.series, stroke: p.getAttribute('stroke'),
      dashed: p.hasAttribute('stroke-dasharray'),
      points: Array.from(p.points).map(q => [q.x, q.y])})),
    keys: Array.from(svg.querySelectorAll('g.key')).map(g => ({
      series: g.dataset.series, stroke: g.querySelector('line.swatch').getAttribute('stroke'),
      dashed: g.querySelector('line.swatch').hasAttribute('stroke-dasharray'),
      text: g.querySelector('text').textContent})),
  };
}"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("reading") / "store"
    attempts = stores.reading_store(root)
    before = fingerprint(root)
    with served(root) as (url, _proc):
        yield root, url, attempts
    assert fingerprint(root) == before  # nothing the pages did wrote to the store


def _figure(page, title: str):
    return page.query_selector(f"figure.curve[data-curve='{title}']")


def test_axes_show_their_whole_labels_and_a_constant_series_is_flat(browser, run):
    _, url, _ = run
    with browser.open(url + "/") as page:
        browser.screenshot(page, "reading_overview")
        for figure in page.query_selector_all("figure.curve"):
            for tick in figure.evaluate(_TICKS):
                assert tick["left"] >= 0 and tick["right"] <= tick["width"], tick
        losses = [t["text"] for t in _figure(page, "loss").evaluate(_TICKS)]
        assert any(t.startswith("-0.0") for t in losses), losses  # the minus sign kept
        # The loss the step rows hold, read from the plot: between the ticks around it.
        values = sorted(float(t) for t in losses)
        assert values[0] <= stores.loss_at(0) <= values[-1]
        # The length is 3.0 or 3.01: a flat line, not spikes over the whole height.
        drawn = _figure(page, "completion length (tokens)").evaluate(_LINES)
        ys = [y for _, y in drawn["lines"][0]["points"]]
        assert max(ys) - min(ys) < 0.1 * (drawn["bottom"] - drawn["top"]), (ys, drawn)
        shown = [float(t["text"]) for t in
                 _figure(page, "completion length (tokens)").evaluate(_TICKS)]  # fmt: skip
        assert min(shown) < 3.0 and max(shown) > 3.01 and max(shown) - min(shown) >= 0.2


def test_one_chart_per_metric_with_a_key_per_line(browser, run):
    _, url, _ = run
    with browser.open(url + "/") as page:
        captions = page.eval_on_selector_all(
            "figure.curve figcaption", "f => f.map(x => x.textContent)"
        )
        assert captions == ["reward (mean U)", "completion length (tokens)", "KL", "loss"]
        for title in captions:
            drawn = _figure(page, title).evaluate(_LINES)
            keys = [(k["series"], k["stroke"], k["dashed"]) for k in drawn["keys"]]
            lines = [(x["series"], x["stroke"], x["dashed"]) for x in drawn["lines"]]
            assert keys == lines and len(set(s for s, _, _ in keys)) == len(keys), title
            assert [k["text"] for k in drawn["keys"]] == [s for s, _, _ in keys]
        # The trainer logged the KL the step rows hold: one line, not a second chart.
        kl = _figure(page, "KL").evaluate(_LINES)
        assert [x["series"] for x in kl["lines"]] == ["train"]


def test_a_trainers_two_updates_per_stored_step_are_two_explained_series(browser, run):
    root, url, _ = run
    with browser.open(url + "/") as page:
        loss = _figure(page, "loss")
        drawn = loss.evaluate(_LINES)
        names = [x["series"] for x in drawn["lines"]]
        assert names == ["train", *(f"train: update {k} of 2 per round" for k in (1, 2))]
        for line in drawn["lines"]:  # no line goes back or straight up: no zig-zag
            xs = [x for x, _ in line["points"]]
            assert all(b > a for a, b in zip(xs, xs[1:])), line
        # Each update's values are the trainer's log of it, in step order.
        logged = RolloutStore(root).read_records("trainer_metrics").to_pylist()
        for k, line in enumerate(drawn["lines"][1:]):
            want = [r["loss"] for r in sorted(logged, key=lambda r: r["optimizer_step"])][k::2]
            titles = loss.eval_on_selector_all(
                f"a.point circle[fill='{line['stroke']}'] title", "t => t.map(x => x.textContent)"
            )
            got = [float(t.rsplit(": ", 1)[1]) for t in titles]
            assert got == pytest.approx(want, rel=1e-5)
        note = page.inner_text("figure.curve[data-curve='loss'] p.chart-note")
        assert "2 optimizer steps per stored step" in note and "num_iterations = 2" in note


def test_the_config_box_and_the_attempts_say_what_inspect_says(browser, run):
    root, url, attempts = run
    with browser.open(url + "/") as page:
        facts = page.inner_text("#config-facts")
        assert "model: tiny-gpt2" in facts and "ByT5Tokenizer (vocabulary 256)" in facts
        assert "recorded with step 3" in facts
        assert '"tokenizer"' in page.inner_text("#config")
        rows = page.eval_on_selector_all(
            "#attempts tbody tr",
            "t => t.map(r => [r.dataset.attempt, r.querySelector('td.status').textContent])",
        )
        assert rows == [[attempts["trainer"], "finished"], [attempts["sampler"], "finished"]]
        assert "error" not in page.inner_text("#attempts")


def test_tokens_show_their_pieces_and_the_colours_have_a_key(browser, run):
    from transformers import ByT5Tokenizer

    from maxent_arrow.explorer.tokenizer import visible

    root, url, _ = run
    stored = RolloutStore(root).read(steps=1, kind="train").to_pylist()[0]
    ids = stored["completion_ids"][2]
    tokenizer = ByT5Tokenizer()
    with browser.open(url + "/tokens/1/0/0/2?kind=train") as page:
        browser.screenshot(page, "reading_tokens")
        got = page.eval_on_selector_all(
            "#tokens .tok",
            "t => t.map(x => [x.querySelector('.piece').textContent, "
            "x.querySelector('.id').textContent])",
        )
        assert [int(i) for _, i in got] == ids
        assert [p for p, _ in got] == [visible(tokenizer.decode([i])) for i in ids]
        assert "ByT5Tokenizer" in page.inner_text("#pieces")
        # The key: its ends are the colours of the lowest and highest token of the series.
        values = stored["behavior_token_logp"][2]
        colours = page.eval_on_selector_all("#tokens .tok", "t => t.map(x => x.style.background)")
        ramp = page.eval_on_selector_all(
            "#colour-legend .ramp .swatch", "t => t.map(x => x.style.background)"
        )
        assert ramp[0] == colours[values.index(min(values))]
        assert ramp[-1] == colours[values.index(max(values))]
        ends = page.eval_on_selector_all("#colour-legend .end", "t => t.map(x => x.textContent)")
        assert [float(e) for e in ends] == pytest.approx([min(values), max(values)], rel=1e-3)
        page.hover("#tokens .tok:nth-child(2)")
        page.wait_for_selector("#tip:not([hidden])")
        assert f"piece: {got[1][0]}" in page.inner_text("#tip")


def test_without_its_tokenizer_a_run_shows_ids_and_says_why(browser, tmp_path):
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=2, resume=False)  # its config names no tokenizer
    with served(root) as (url, _), browser.open(url + "/tokens/1/0/0/0?kind=train") as page:
        assert page.query_selector("#tokens .tok .piece") is None
        assert page.query_selector_all("#tokens .tok .id")
        assert "recorded no tokenizer: ids only" in page.inner_text("#pieces")


def test_the_query_page_lists_the_views_and_their_columns(browser, run):
    root, url, _ = run
    with RunAnalytics(root) as analytics:
        described = {
            view: [r["column_name"] for r in analytics.sql(f"DESCRIBE {view}").to_pylist()]
            for view in ("groups", "samples", "steps", "lifecycle", "trainer_metrics")
        }
    with browser.open(url + "/query") as page:
        views = page.eval_on_selector_all("#views details.view", "d => d.map(x => x.dataset.view)")
        assert views[:3] == ["groups", "samples", "steps"]
        assert {"lifecycle", "trainer_metrics", "attempt_ends"} <= set(views)
        for view, columns in described.items():
            shown = page.eval_on_selector_all(
                f"#views details[data-view='{view}'] code.col", "c => c.map(x => x.textContent)"
            )
            assert shown == columns, view
        page.click("#views details[data-view='samples'] summary")
        browser.screenshot(page, "reading_query_views")


def test_the_group_page_shows_dataset_columns_and_log_extra_values(browser, run):
    root, url, _ = run
    stored = RolloutStore(root).read(steps=2, kind="train").to_pylist()[3]
    with browser.open(url + "/group/2/0/3?kind=train") as page:
        browser.screenshot(page, "reading_group")
        assert page.inner_text("#dataset td[data-column='source']") == stored["ds_source"]
        assert "verdict" in page.inner_text("#log-extra")
        for i, verdict in enumerate(stored["extra_verdict"]):
            cell = f"article.card[data-index='{i}'] td[data-figure='log_extra: verdict']"
            assert page.inner_text(cell) == verdict


def test_statuses_are_the_trainers_and_another_roles_only_when_asked(browser, run):
    _, url, _ = run
    cells = "t => t.map(x => x.textContent)"
    with browser.open(url + "/step/1?kind=train") as page:
        statuses = page.eval_on_selector_all("#groups td.status", cells)
        assert statuses == ["trained"] * stores.GROUPS  # the sampler's drops are its own
        assert "the trainer's lifecycle records" in page.inner_text("#count")
        page.select_option("#role", "sampler")
        page.click("#apply")
        page.wait_for_url("**role=sampler**")
        row = f"#groups tr[data-group='{stores.DROPPED_GROUP}'] td.status"
        assert page.inner_text(row) == "dropped (zero_std)"
        assert "the sampler's lifecycle records" in page.inner_text("#count")
        browser.screenshot(page, "reading_step_sampler_role")
