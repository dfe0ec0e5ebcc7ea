"""The explorer as a researcher uses it: ``maxent-arrow view`` started for real, walked in
headless Chromium (tests/browser.py), each page screenshotted under tests/artifacts/ and
what it shows checked against the store read from outside (DuckDB over the files the store
lists, or pyarrow): from a curve to a step, to a group, to a completion's tokens; sorting,
filtering, a shared link, the SQL box and its CSV; a chat prompt, a NaN reward and a
superseded attempt."""

from __future__ import annotations

import csv
import io
import math
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import duckdb
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402
from viewing import fingerprint, served  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402

SHOT_MIN = 20_000


def _shot(browser, page, name: str) -> None:
    path = browser.screenshot(page, name)
    print(f"\nscreenshot: {path}")
    assert path.stat().st_size > SHOT_MIN and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cells(page, key: str) -> list[str]:
    return page.eval_on_selector_all(
        f"#groups tbody td[data-key='{key}']", "tds => tds.map(t => t.textContent)"
    )


def _groups_shown(page) -> list[int]:
    return [int(v) for v in page.eval_on_selector_all(
        "#groups tbody tr", "trs => trs.map(t => t.dataset.group)")]  # fmt: skip


def _outside(root: Path, sql: str) -> list[tuple]:
    """DuckDB straight over the live group files the store lists (no library code)."""
    files = [str(p) for p, where in RolloutStore(root).live_files("groups") if where is None]
    con = duckdb.connect()
    con.execute(f"CREATE VIEW g AS SELECT * FROM read_parquet({files!r}, union_by_name=true)")
    return con.execute(sql).fetchall()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("explorer") / "store"
    attempts = stores.demo_like_store(root)
    before = fingerprint(root)
    with served(root) as (url, _proc):
        yield root, url, attempts
    # No page, query or click of the module wrote to the store.
    assert fingerprint(root) == before


def test_overview_curves_click_to_step_then_sort_and_filter(browser, run):
    root, url, attempts = run
    with browser.open(url + "/") as page:
        captions = page.eval_on_selector_all(
            "figure.curve figcaption", "f => f.map(x => x.textContent)"
        )
        assert {"reward (mean U)", "completion length (tokens)", "KL", "loss"} <= set(captions)
        text = page.inner_text("#attempts")
        assert attempts["first"] in text and attempts["resumed"] in text
        assert "tiny-gpt2" in page.inner_text("#config")
        assert page.inner_text("#superseded").split(":")[1].split()[:2] == ["3", "4"]
        _shot(browser, page, "explorer_overview")
        # Click the reward curve's point of train step 2: the step page opens.
        page.click(
            "figure[data-curve='reward (mean U)'] a.point[data-step='2'][data-kind='train'] circle"
        )
        page.wait_for_url("**/step/2?kind=train")
        assert page.inner_text("h1") == "train step 2"
        assert len(_groups_shown(page)) == stores.GROUPS
        statuses = page.eval_on_selector_all("#groups td.status", "t => t.map(x => x.textContent)")
        assert statuses.count("trained") == stores.GROUPS - 1
        assert statuses.count("dropped (zero_std)") == 1
        # Mean reward per group, from outside: NaN completions left out of the mean.
        truth = dict(_outside(root, """
            SELECT group_index, list_avg(list_filter(total_utils, lambda x: NOT isnan(x)))
            FROM g WHERE step = 2 AND kind = 'train'"""))  # fmt: skip
        page.click("a.sort[data-sort='mean_reward']")  # descending first
        page.wait_for_url("**sort=mean_reward**")
        shown = _groups_shown(page)
        assert [truth[g] for g in shown] == sorted(truth.values(), reverse=True)
        for g, cell in zip(shown, _cells(page, "mean_reward")):
            assert float(cell) == pytest.approx(truth[g], rel=1e-3)
        cut = dict(_outside(root, """
            SELECT group_index, len(list_filter(completion_info, lambda c: c.truncated))
            FROM g WHERE step = 2 AND kind = 'train'"""))  # fmt: skip
        assert [int(c) for c in _cells(page, "truncated")] == [cut[g] for g in shown]
        assert sum(cut.values()) > 0
        page.click("a.sort[data-sort='mean_reward']")  # then ascending
        page.wait_for_url("**desc=0**")
        assert [truth[g] for g in _groups_shown(page)] == sorted(truth.values())
        _shot(browser, page, "explorer_step_sorted")
        # Filter by status, then by a reward function's mean.
        page.select_option("select[name=status]", "dropped")
        page.click("#apply")
        page.wait_for_url("**status=dropped**")
        assert _groups_shown(page) == [stores.DROPPED_GROUP]
        page.select_option("select[name=status]", "")
        page.select_option("select[name=fn]", "accuracy")
        page.fill("input[name=fn_min]", "0.5")
        page.click("#apply")
        page.wait_for_url("**fn_min=0.5**")
        accuracy = dict(_outside(root, """
            SELECT group_index, list_avg(list_filter(list_transform(reward_values, lambda v: v[1]),
                                                     lambda x: NOT isnan(x)))
            FROM g WHERE step = 2 AND kind = 'train'"""))  # fmt: skip
        want = sorted(g for g, v in accuracy.items() if v >= 0.5)
        assert sorted(_groups_shown(page)) == want and 0 < len(want) < stores.GROUPS
        assert page.inner_text("#count").startswith(f"{len(want)} of {stores.GROUPS}")
        shared = page.url
        _shot(browser, page, "explorer_step_filtered")
    # The same link in a new browser context shows the same view.
    with browser.open(shared) as again:
        assert sorted(_groups_shown(again)) == want
        assert again.input_value("input[name=fn_min]") == "0.5"
        assert parse_qs(urlparse(shared).query)["fn"] == ["accuracy"]


def test_group_with_chat_prompt_and_tokens(browser, run):
    root, url, _ = run
    with browser.open(url + "/step/1?kind=train") as page:
        row = f"#groups tr[data-group='{stores.CHAT_GROUP}']"
        assert page.inner_text(f"{row} td.prompt .badge") == "chat"
        page.click(f"{row} a.grouplink")
        page.wait_for_url(f"**/group/1/0/{stores.CHAT_GROUP}?kind=train")
        # The chat prompt as a conversation: a system and a user message.
        roles = page.eval_on_selector_all("#prompt .msg .role", "r => r.map(x => x.textContent)")
        assert roles == ["system", "user"]
        assert "What is" in page.inner_text("#prompt .msg.role-user")
        cards = page.query_selector_all("#cards article.card")
        assert len(cards) == stores.K
        stored = RolloutStore(root).read(steps=1, kind="train").to_pylist()[stores.CHAT_GROUP]
        totals = stored["total_utils"]
        best = page.get_attribute("article.card.best", "data-index")
        worst = page.get_attribute("article.card.worst", "data-index")
        assert int(best) == max(range(stores.K), key=lambda i: (totals[i], -i))
        assert int(worst) == min(range(stores.K), key=lambda i: totals[i])
        for i, card in enumerate(cards):

            def figure(n: str, card=card) -> str:
                return card.query_selector(f"td[data-figure='{n}']").inner_text()

            assert float(figure("total U")) == pytest.approx(totals[i], rel=1e-3)
            assert float(figure("advantage")) == pytest.approx(stored["advantages"][i], abs=1e-3)
            assert float(figure("MaxEnt weight")) == pytest.approx(stored["weights"][i])
            assert float(figure("q")) == pytest.approx(0.25)
            assert int(figure("length")) == len(stored["completion_ids"][i])
            assert figure("finish reason") in ("stop", "length")
            assert float(figure("reward: accuracy")) == stored["reward_values"][i][0]
        _shot(browser, page, "explorer_group_chat")
        # To completion 2's tokens.
        page.click("article.card[data-index='2'] a.tokenlink")
        page.wait_for_url(f"**/tokens/1/0/{stores.CHAT_GROUP}/2?kind=train")
        ids = stored["completion_ids"][2]
        chips = page.eval_on_selector_all("#tokens .tok", "t => t.map(x => x.textContent)")
        assert [int(c) for c in chips] == ids
        page.hover("#tokens .tok:nth-child(3)")
        page.wait_for_selector("#tip:not([hidden])")
        tip = page.inner_text("#tip")
        assert f"id {ids[2]}" in tip and "behaviour log-prob" in tip and "KL" in tip
        behaviour = stored["behavior_token_logp"][2][2]
        line = next(x for x in tip.splitlines() if x.startswith("behaviour log-prob"))
        assert float(line.split(":")[1]) == pytest.approx(behaviour, abs=1e-4)
        assert page.inner_text("#chosen") == "behaviour log-prob"
        colours = page.eval_on_selector_all("#tokens .tok", "t => t.map(x => x.style.background)")
        page.click("a.series[data-series='ref_token_logp']")
        page.wait_for_url("**series=ref_token_logp**")
        assert page.inner_text("#chosen") == "reference log-prob"
        after = page.eval_on_selector_all("#tokens .tok", "t => t.map(x => x.style.background)")
        assert after != colours and len(set(after)) > 1
        _shot(browser, page, "explorer_tokens")


def test_nan_reward_superseded_attempt_and_compare(browser, run):
    root, url, attempts = run
    with browser.open(url + f"/group/2/0/{stores.NAN_GROUP}?kind=train") as page:
        nan_card = "article.card[data-index='1']"
        assert page.inner_text(f"{nan_card} td[data-figure='total U']") == "NaN"
        assert page.inner_text(f"{nan_card} td[data-figure='reward: accuracy']") == "NaN"
        assert page.get_attribute(nan_card, "class") == "card"  # neither best nor worst
        _shot(browser, page, "explorer_group_nan")
        page.click("#compare")
        page.wait_for_url("**/compare?example_id=2**")
        rows = page.eval_on_selector_all(
            "table.data tbody tr td:first-child", "t => t.map(x => x.textContent)"
        )
        assert rows == ["0", "1", "2", "3"]  # the effective history's steps
        _shot(browser, page, "explorer_compare")
    with browser.open(url + "/step/2?kind=train&unscored=1") as page:
        assert _groups_shown(page) == [stores.NAN_GROUP]
    # Step 3 was written by both attempts: the effective history shows the resumed one's...
    with browser.open(url + "/step/3?kind=train") as page:
        assert set(
            page.eval_on_selector_all("#groups td.attempt", "t => t.map(x => x.textContent)")
        ) == {attempts["resumed"]}
    # ... every attempt's rows side by side, the superseded marked ...
    with browser.open(url + "/step/3?kind=train&attempts=all") as page:
        cells = page.eval_on_selector_all("#groups td.attempt", "t => t.map(x => x.textContent)")
        assert sorted(cells) == sorted(
            [attempts["first"] + " superseded"] * stores.GROUPS
            + [attempts["resumed"]] * stores.GROUPS
        )
        assert len(page.query_selector_all("#groups tr.superseded")) == stores.GROUPS
        _shot(browser, page, "explorer_step_superseded")
        page.click("#groups tr.superseded a.grouplink >> nth=0")
        page.wait_for_url("**attempts=all**")
        assert "(superseded)" in page.inner_text("#facts")
    # ... and step 4 only in the superseded history.
    with browser.open(url + "/step/4?kind=train&attempts=superseded") as page:
        assert len(_groups_shown(page)) == stores.GROUPS
    with browser.open(url + "/step/4?kind=train") as page:
        assert "no train step 4" in page.inner_text("#error")


def test_sql_box_table_and_csv(browser, run):
    root, url, _ = run
    sql = (
        "SELECT step, count(*) AS n, avg(total_util) AS u FROM samples WHERE kind = 'train' "
        "GROUP BY step ORDER BY step"
    )
    with browser.open(url + "/query") as page:
        page.fill("#sql", sql)
        page.click("#run")
        page.wait_for_selector("#result")
        heads = page.eval_on_selector_all("#result th", "t => t.map(x => x.textContent)")
        assert heads == ["step", "n", "u"]
        rows = page.eval_on_selector_all(
            "#result tbody tr", "t => t.map(r => Array.from(r.cells).map(c => c.textContent))"
        )
        # What `maxent-arrow query` prints for the same SQL (a subprocess of the command).
        cli = subprocess.run(
            [sys.executable, "-m", "maxent_arrow.cli", "query", str(root), sql, "--csv"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        truth = [(int(r["step"]), int(r["n"])) for r in csv.DictReader(io.StringIO(cli.stdout))]
        assert [(int(r[0]), int(r[1])) for r in rows] == truth
        # The dropped groups are out of the effective `samples`, as the files say: every
        # completion of each step but those of the groups the lifecycle records dropped.
        stored = _outside(root, "SELECT step, sum(len(total_utils)) FROM g WHERE kind = 'train' "
                                "GROUP BY step ORDER BY step")  # fmt: skip
        events = RolloutStore(root).lifecycle().to_pylist()
        gone = [e["rollout_step"] for e in events if e["event"] == "dropped"]
        assert truth == [(s, int(n) - stores.K * gone.count(s)) for s, n in stored]
        _shot(browser, page, "explorer_query")
        href = page.get_attribute("#csv", "href")
        response = page.request.get(url + href)
        assert response.ok and response.headers["content-type"].startswith("text/csv")
        parsed = list(csv.DictReader(io.StringIO(response.text())))
        assert [(int(r["step"]), int(r["n"])) for r in parsed] == truth
        assert parsed == list(csv.DictReader(io.StringIO(cli.stdout)))
        assert all(math.isfinite(float(r["u"])) or r["u"] == "nan" for r in parsed)
        # A write is refused with the query command's own message, on the page.
        page.fill("#sql", "CREATE TABLE x AS SELECT 1")
        page.click("#run")
        page.wait_for_selector("#error")
        assert "only SELECT" in page.inner_text("#error")
        _shot(browser, page, "explorer_query_refused")


def test_the_report_links_into_the_explorer(browser, run, tmp_path):
    from maxent_arrow.analytics import DEFAULT_VIEW_URL, build_report

    root, url, _ = run
    report = build_report(root, tmp_path / "report", progress=False)
    with browser.open(report.html) as page:
        links = page.eval_on_selector_all(
            "a.view", "a => a.map(x => [x.getAttribute('href'), x.closest('tr').textContent])"
        )
    assert len(links) >= 4 and all(h.startswith(DEFAULT_VIEW_URL + "/") for h, _ in links)
    with browser.open(url + "/") as page:
        for href, row in links:
            response = page.goto(url + href.removeprefix(DEFAULT_VIEW_URL))
            assert response is not None and response.ok, href
            title = page.inner_text("h1")
            assert title.startswith("train step") and title.split()[2] in row
            if "/group-id/" in href:  # the group the report's row names
                assert "/group/" in page.url and "completion 0" in page.inner_text("#cards")


def test_store_health_on_demand(browser, run):
    root, url, _ = run
    with browser.open(url + "/") as page:
        page.click("#verify-link")
        page.wait_for_selector("#verdict")
        verdict = page.inner_text("#verdict")
        report = RolloutStore(root).verify()
        assert report.ok and verdict == f"OK: {report.checked} files checked, no damage."
        _shot(browser, page, "explorer_verify")


def test_a_damaged_file_is_named_on_the_pages_that_read_it(browser, tmp_path):
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=3, resume=False)
    victim = next(
        p for p, _ in RolloutStore(root).live_files("groups") if "step-0000000001" in p.name
    )
    data = bytearray(victim.read_bytes())
    data[-64] ^= 0xFF  # the footer
    victim.write_bytes(bytes(data))
    with served(root) as (url, _proc):
        with browser.open(url + "/verify") as page:
            assert victim.name in page.inner_text("body")
            assert "problem" in page.inner_text("#verdict")
        with browser.open(url + "/step/1?kind=train") as page:
            assert victim.name in page.inner_text("#error")
        with browser.open(url + "/step/2?kind=train") as page:  # other steps still open
            assert len(_groups_shown(page)) == stores.GROUPS
