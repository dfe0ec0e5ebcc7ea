"""What the report's summary must say, computed with plain SQL over the store's views, and
the parsing of what the page shows: every number of a report's summary is checked against a
query here (``check_page``), for whichever store the report was built from.

The SQL is written from ``docs/formulas.md`` §5 directly against ``samples``, ``groups`` and
``steps`` (unscored values are NULL there), not through the ready-made queries the report
uses; pass@k takes per-group counts from SQL and applies the estimator in Python.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from maxent_arrow.analytics.run import RunAnalytics

# Reads everything the page shows that the checks compare, in one call.
PAGE_SCRIPT = """() => {
  const text = (el) => (el ? el.textContent.trim() : null);
  const facts = {}, trends = {}, config = {};
  document.querySelectorAll('#facts tr[data-key]').forEach(r => {
    facts[r.dataset.key] = text(r.querySelector('td.v'));
  });
  document.querySelectorAll('#trends tr[data-key]').forEach(r => {
    trends[r.dataset.key] = Array.from(r.querySelectorAll('td.num')).map(
      c => [text(c.querySelector('.v')), text(c.querySelector('.at'))]);
  });
  document.querySelectorAll('#config-table [data-key]').forEach(d => {
    config[d.dataset.key] = text(d.querySelector('.cv'));
  });
  const images = Array.from(document.images).map(i => ({
    src: i.getAttribute('src'), width: i.getBoundingClientRect().width,
    natural: i.naturalWidth}));
  const wide = Array.from(document.querySelectorAll('main *')).filter(
    e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1
  ).map(e => e.tagName + '#' + e.id + '.' + e.className);
  return {facts, trends, config, images, wide,
          scrollWidth: document.documentElement.scrollWidth,
          clientWidth: document.documentElement.clientWidth,
          banner: text(document.querySelector('#left-out')),
          absent: text(document.querySelector('#absent')),
          evalRows: document.querySelectorAll('#eval-table tbody tr').length,
          extremeRows: document.querySelectorAll('#extremes-table tbody tr').length,
          bodyText: document.body.innerText};
}"""


def rows(run: RunAnalytics, sql: str) -> list[dict[str, Any]]:
    return run.sql(sql).to_pylist()


def series(run: RunAnalytics, sql: str) -> list[tuple[int, float]]:
    """(step, value) of a query returning ``step, v``; NULL and NaN left out."""
    return [
        (r["step"], float(r["v"]))
        for r in rows(run, sql)
        if r["v"] is not None and math.isfinite(r["v"])
    ]


def _pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def expected_trends(
    run: RunAnalytics, *, threshold: float = 0.5, ks: tuple[int, ...] = (1, 4)
) -> dict[str, list[tuple[int, float]]]:
    """Every per-step figure of the summary, by its key, as (step, value) pairs."""
    out: dict[str, list[tuple[int, float]]] = {}
    names = [r["n"] for r in rows(run, "SELECT DISTINCT unnest(reward_names) AS n FROM groups")]
    for kind, prefix in (("train", "reward"), ("eval", "eval")):
        where = f"WHERE kind = '{kind}'"
        out[f"{prefix}.total_utils"] = series(
            run, f"SELECT step, avg(total_util) AS v FROM samples {where} GROUP BY step ORDER BY 1"
        )
        for name in names:
            out[f"{prefix}.{name}"] = series(
                run,
                f'SELECT step, avg("reward_{name}") AS v FROM samples {where} '
                "GROUP BY step ORDER BY 1",
            )
    train = "FROM samples WHERE kind = 'train'"
    out["success_rate"] = series(
        run,
        f"SELECT step, count(*) FILTER (WHERE total_util > {threshold}) / count(total_util) AS v "
        f"{train} GROUP BY step HAVING count(total_util) > 0 ORDER BY 1",
    )
    groups = rows(
        run,
        f"SELECT step, group_id, count(total_util) AS n, "
        f"count(*) FILTER (WHERE total_util > {threshold}) AS c, "
        f"max(total_util) - min(total_util) AS spread {train} GROUP BY step, group_id",
    )
    by_step: dict[int, list[dict[str, Any]]] = {}
    for g in groups:
        if g["n"] > 0:
            by_step.setdefault(g["step"], []).append(g)
    steps = sorted(by_step)
    out["group_success_rate"] = [
        (s, sum(g["c"] > 0 for g in by_step[s]) / len(by_step[s])) for s in steps
    ]
    for k in ks:
        out[f"pass_at_{k}"] = [
            (s, sum(_pass_at_k(g["n"], g["c"], k) for g in eligible) / len(eligible))
            for s in steps
            if (eligible := [g for g in by_step[s] if g["n"] >= k])
        ]
    out["zero_variance"] = [
        (s, sum(g["spread"] <= 1e-8 for g in by_step[s]) / len(by_step[s])) for s in steps
    ]
    cap = rows(
        run,
        "SELECT max(json_extract(config, '$.max_completion_len')::BIGINT) AS c FROM steps "
        "WHERE kind = 'train'",
    )[0]["c"]
    length = "coalesce(ref_tok_count, token_count)"
    out["mean_length"] = series(
        run, f"SELECT step, avg({length}) AS v {train} GROUP BY step ORDER BY 1"
    )
    clipped = f"{length} >= {cap}" if cap is not None else "truncated"
    out["clipped_frac"] = series(
        run, f"SELECT step, avg(({clipped})::DOUBLE) AS v {train} GROUP BY step ORDER BY 1"
    )
    step_columns = {r["column_name"] for r in rows(run, "DESCRIBE steps")}
    for column in ("total_loss", "policy_loss", "clip_loss", "kl_loss", "weighted_kl_loss"):
        if column in step_columns:
            out[f"loss.{column}"] = series(
                run,
                f"SELECT step, avg({column}) AS v FROM steps WHERE kind = 'train' "
                "GROUP BY step ORDER BY 1",
            )
    if "kl_value" in step_columns:
        out["kl_value"] = series(
            run,
            "SELECT step, avg(kl_value) AS v FROM steps WHERE kind = 'train' GROUP BY step "
            "ORDER BY 1",
        )
    views = {r["table_name"] for r in rows(run, "SELECT table_name FROM information_schema.tables")}
    if "trainer_metrics" in views:  # the trainer's log, where the step rows hold no value
        for column, key, own in (("loss", "loss.trainer", "loss."), ("kl", "kl.trainer", "kl_")):
            if not any(k.startswith(own) and v for k, v in out.items()):
                out[key] = series(
                    run,
                    f"SELECT step, avg({column}) AS v FROM trainer_metrics WHERE kind = 'train' "
                    f"AND {column} IS NOT NULL GROUP BY step ORDER BY 1",
                )
    sample_columns = {r["column_name"] for r in rows(run, "DESCRIBE samples")}
    if "policy_entropy_sum" in sample_columns:
        out["policy_entropy"] = series(
            run,
            f"SELECT step, sum(policy_entropy_sum) FILTER (WHERE {length} IS NOT NULL) / "
            f"sum({length}) FILTER (WHERE policy_entropy_sum IS NOT NULL) AS v {train} "
            "GROUP BY step ORDER BY 1",
        )
    out["distinct_completions"] = series(
        run,
        "SELECT step, avg(d / k) AS v FROM (SELECT step, group_id, "
        f"count(DISTINCT completion) AS d, count(*) AS k {train} GROUP BY step, group_id) "
        "GROUP BY step ORDER BY 1",
    )
    for column, key in (("q", "q_entropy"), ("weight", "weight_entropy")):
        if column in sample_columns:
            out[key] = series(
                run,
                f"SELECT step, avg(h) AS v FROM (SELECT step, group_id, CASE WHEN min({column}) "
                f"< 0 THEN NULL ELSE -sum({column} * ln({column})) FILTER (WHERE {column} > 0) "
                f"END AS h {train} GROUP BY step, group_id) GROUP BY step ORDER BY 1",
            )
    return {k: v for k, v in out.items() if v}


def expected_facts(run: RunAnalytics, root: Path) -> dict[str, Any]:
    """The summary's facts, from SQL (sizes from the files)."""

    def one(sql: str) -> Any:
        return next(iter(rows(run, sql)[0].values()))

    config = json.loads(
        one("SELECT config FROM steps WHERE kind = 'train' ORDER BY step DESC LIMIT 1") or "{}"
    )
    size = sum(p.stat().st_size for d in ("groups", "steps") for p in (root / d).glob("*.parquet"))
    return {
        "ranks": one("SELECT count(DISTINCT rank) FROM steps"),
        "train_steps": one("SELECT count(DISTINCT step) FROM steps WHERE kind = 'train'"),
        "eval_steps": one("SELECT count(DISTINCT step) FROM steps WHERE kind = 'eval'"),
        "train_groups": one("SELECT count(*) FROM groups WHERE kind = 'train'"),
        "train_completions": one("SELECT count(*) FROM samples WHERE kind = 'train'"),
        "unscored": one("SELECT count(*) - count(total_util) FROM samples WHERE kind = 'train'"),
        "bytes": size,
        "model": config.get("model") or "not recorded",
        "trainer": config.get("trainer") or "not recorded",
        "config": config,
        "reward_names": [
            r["n"] for r in rows(run, "SELECT DISTINCT unnest(reward_names) AS n FROM groups")
        ],
    }


def shown(text: str) -> tuple[float, float]:
    """A number as the page shows it and half a unit of its last digit (how far the true
    value may be from it): ``0.05312``, ``25.0 %``, ``1,234``, ``346.9 kB``, ``1.5e+04``."""
    t = text.strip().replace(",", "")
    scale = 1.0
    for unit, factor in (("%", 0.01), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if t.endswith(unit):
            t, scale = t[: -len(unit)].strip(), factor
    mantissa, _, exponent = t.partition("e")
    decimals = len(mantissa.partition(".")[2])
    half = 0.5 * 10.0 ** (-decimals) * 10.0 ** (int(exponent) if exponent else 0)
    return float(t) * scale, half * scale


def assert_shown(text: str, value: float, what: str) -> None:
    got, half = shown(text)
    assert abs(got - value) <= half * (1 + 1e-9) + 1e-12, f"{what}: shows {text}, SQL says {value}"


def _step(text: str) -> int:
    match = re.fullmatch(r"step (-?\d+)", text)
    assert match, text
    return int(match.group(1))


def check_page(page_data: dict[str, Any], run: RunAnalytics, root: Path, **options: Any) -> int:
    """Every number of the summary the page shows equals what SQL says; the number of
    figures checked. The size on disk counts every committed file, a damaged one skipped
    under ``on_error="skip"`` included (it is on disk)."""
    checked = 0
    facts = expected_facts(run, root)
    shown_facts = page_data["facts"]
    for key in ("ranks", "train_steps", "eval_steps", "train_groups", "train_completions",
                "unscored", "bytes"):  # fmt: skip
        assert_shown(shown_facts[key], facts[key], key)
        checked += 1
    assert shown_facts["model"] == facts["model"] and shown_facts["trainer"] == facts["trainer"]
    tokenizer = facts["config"].get("tokenizer")
    if isinstance(tokenizer, dict) and tokenizer.get("class"):
        assert tokenizer["class"] in shown_facts["tokenizer"]
        if tokenizer.get("vocab_size"):
            assert f"vocabulary {tokenizer['vocab_size']:,}" in shown_facts["tokenizer"]
    else:
        assert shown_facts["tokenizer"] == "not recorded"
    for name in facts["reward_names"]:
        assert name in shown_facts["reward_functions"], (name, shown_facts["reward_functions"])
    trends = expected_trends(run, **options)
    assert set(page_data["trends"]) == set(trends), sorted(set(page_data["trends"]) ^ set(trends))
    for key, points in trends.items():
        (start, start_at), (peak, peak_at), (end, end_at) = page_data["trends"][key]
        steps = [s for s, _ in points]
        values = [v for _, v in points]
        top = max(values)
        assert_shown(start, values[0], f"{key} start")
        assert_shown(peak, top, f"{key} peak")
        assert_shown(end, values[-1], f"{key} end")
        assert _step(start_at) == steps[0] and _step(end_at) == steps[-1], key
        # The first step at the peak: within a relative 1e-9 of the highest value (a level
        # figure differs in its last bits from step to step, and between SQL and the report).
        at, scale = _step(peak_at), max(1.0, abs(top))
        assert at in steps and values[steps.index(at)] >= top - 2e-9 * scale, key
        assert all(v < top - 0.5e-9 * scale for v in values[: steps.index(at)]), key
        checked += 3
    for key, text in page_data["config"].items():
        value: Any = facts["config"]
        for part in key.split("."):
            value = value[part]
        assert text == (value if isinstance(value, str) else json.dumps(value, sort_keys=True)), key
    return checked
