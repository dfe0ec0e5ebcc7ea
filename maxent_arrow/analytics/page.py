"""The report's pages: ``index.html`` (read in a browser at 1280 px and up) and
``summary.md``, from a :class:`~maxent_arrow.analytics.summary.Summary`, the plots and the
completion tables.

Numbers are shown with their unit: fractions as percentages, reward, loss and entropy with
four significant digits, counts with thousands separators, sizes in kB/MB. The HTML marks
each figure's parts (``data-key`` on a row, ``class="v"`` on a value, ``class="at"`` on its
step) so that a test, or a script, reads back exactly what a reader sees.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from maxent_arrow.analytics.links import DEFAULT_VIEW_URL, group_id_path, group_path, step_path
from maxent_arrow.analytics.summary import Summary, Trend

__all__ = ["config_items", "format_value", "render_html", "render_markdown"]

# Completions and prompts are cut to this many characters in the tables.
_TEXT_CHARS = 300

_STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f}
main{max-width:1200px;margin:0 auto;padding:12px 24px 40px}
h1{font-size:26px;margin:12px 0 2px}h2{font-size:21px;margin:28px 0 8px;border-bottom:1px solid
#ddd;padding-bottom:4px}h3{font-size:17px;margin:18px 0 6px}
.path{color:#555;margin:0 0 12px;font-family:ui-monospace,monospace;word-break:break-all}
table{border-collapse:collapse;width:100%;margin:4px 0 8px}
td,th{border:1px solid #d0d0d0;padding:4px 8px;text-align:left;vertical-align:top}
thead th{background:#f3f4f6}tbody th{font-weight:500}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.at{color:#666;font-size:13px}
.text{font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap;
word-break:break-word}
table.facts{width:auto;min-width:640px}table.facts th{width:300px}
.config{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:2px 18px;
border:1px solid #d0d0d0;padding:8px 10px}
.kv{font-size:14px;word-break:break-word}.kv .k{color:#555}.kv .cv{font-family:ui-monospace,
monospace;font-size:13px}.kv.changed{background:#fff7e0}
.empty{color:#999;font-style:italic}
figure{margin:14px 0 22px}figure img{width:100%;height:auto;display:block;border:1px solid
#e5e5e5}figcaption{color:#444;font-size:14px;margin-top:4px}
.banner{background:#fff3cd;border-left:6px solid #d39e00;padding:10px 14px;margin:12px 0}
.note{background:#eef4fb;border-left:6px solid #5b8ac7;padding:10px 14px;margin:12px 0}
.banner ul,.note ul{margin:6px 0 0;padding-left:22px}
"""


def format_value(value: Any, unit: str = "") -> str:
    """``value`` as the report shows it (see the module's docstring); ``"–"`` for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if unit == "%":
        return f"{100 * float(value) + 0.0:.1f} %".replace("-0.0 %", "0.0 %")
    if unit == "bytes":
        size = float(value)
        for name, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if size >= scale:
                return f"{size / scale:.1f} {name}"
        return f"{int(size)} B"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value + 0.0:.4g}" if value != 0 else "0"  # never "-0"
    return json.dumps(value, sort_keys=True, default=str)


def _unit_text(unit: str) -> str:
    return "" if unit in ("%", "bytes") else unit


def _cut(text: Any) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= _TEXT_CHARS else text[: _TEXT_CHARS - 1] + "…"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _trend_cell(value: float, step: int, unit: str) -> str:
    return (
        f'<td class="num"><span class="v">{_e(format_value(value, unit))}</span> '
        f'<span class="at">step {step}</span></td>'
    )


def _trend_rows(trends: Sequence[Trend]) -> str:
    rows = []
    for t in trends:
        rows.append(
            f'<tr data-key="{_e(t.key)}"><th>{_e(t.label)}</th><td>{_e(_unit_text(t.unit))}</td>'
            + _trend_cell(t.start, t.start_step, t.unit)
            + _trend_cell(t.peak, t.peak_step, t.unit)
            + _trend_cell(t.end, t.end_step, t.unit)
            + "</tr>"
        )
    return "".join(rows)


def config_items(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """The run config as (dotted key, value) pairs, nested mappings spread out (TRL's
    ``extra.trl.*``), in key order."""
    items: list[tuple[str, Any]] = []
    for key in sorted(config):
        value = config[key]
        if isinstance(value, Mapping) and value and key != "tokenizer":
            items += config_items(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _config_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _config_items(summary: Summary) -> str:
    items = []
    for key, value in config_items(summary.config):
        changed = key.split(".")[0] in summary.config_changed
        items.append(
            f'<div class="kv{" changed" if changed else ""}" data-key="{_e(key)}">'
            f'<span class="k">{_e(key)}</span> <span class="cv">{_e(_config_text(value))}</span>'
            f"{' <em>(changed during the run)</em>' if changed else ''}</div>"
        )
    return "".join(items)


def _table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]], *, id_: str
) -> str:
    """An HTML table of ``rows``: ``columns`` are (key, header, kind), kind ``text`` (a
    completion or prompt: monospace, cut), ``num`` (a number) or ``plain``."""
    head = "".join(f"<th>{_e(h)}</th>" for _, h, _ in columns)
    body = []
    for row in rows:
        cells = []
        for key, _, kind in columns:
            value = row.get(key)
            if kind == "num":
                cells.append(f'<td class="num">{_e(format_value(value))}</td>')
            elif kind == "text" and value == "":
                cells.append('<td class="text"><span class="empty">(empty)</span></td>')
            elif kind == "text":
                cells.append(f'<td class="text">{_e(_cut(value))}</td>')
            elif key in row.get("links", {}):  # a page of `maxent-arrow view`
                href = DEFAULT_VIEW_URL + row["links"][key]
                cells.append(f'<td><a class="view" href="{_e(href)}">{_e(value)}</a></td>')
            else:
                cells.append(f"<td>{_e('–' if value is None else value)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table id="{id_}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _reward_columns(table: pa.Table) -> list[tuple[str, str, str]]:
    return [
        (c, "U (total)" if c == "total_util" else c.removeprefix("reward_"), "num")
        for c in table.column_names
        if c == "total_util" or c.startswith("reward_")
    ]


def _eval_section(evals: pa.Table | None) -> tuple[str, list[str]]:
    if evals is None or evals.num_rows == 0:
        return "", []
    step = evals.column("step")[0].as_py()
    columns = [
        ("group_index", "group", "plain"),
        ("prompt", "prompt", "text"),
        ("answer", "gold answer", "text"),
        ("completion", "completion", "text"),
        *_reward_columns(evals),
    ]
    rows = evals.to_pylist()
    for row in rows:
        row["links"] = {"group_index": group_path(step, row["rank"], row["group_index"], "eval")}
    html_part = (
        f'<h2 id="eval-completions">Eval completions against their gold answers (step {step})'
        f"</h2>{_table(rows, columns, id_='eval-table')}"
    )
    md = [f"## Eval completions against their gold answers (step {step})", ""]
    md += _md_table(evals.to_pylist(), columns)
    return html_part, md


_EXTREME_COLUMNS = [
    ("which", "", "plain"),
    ("step", "step", "plain"),
    ("prompt", "prompt", "text"),
    ("answer", "gold answer", "text"),
    ("mean", "mean U", "num"),
    ("n_scored", "scored / K", "plain"),
    ("best_completion", "its best completion", "text"),
    ("best_score", "U", "num"),
    ("worst_completion", "its worst completion", "text"),
    ("worst_score", "U", "num"),
]


def _extremes_rows(extremes: pa.Table) -> list[dict[str, Any]]:
    rows = extremes.to_pylist()
    for row in rows:
        row["which"] = f"{row['which']} #{row['position']}"
        row["n_scored"] = f"{row['n_scored']} / {row['k']}"
        row["links"] = {
            "step": step_path(row["step"], row["kind"]),
            "which": group_id_path(row["step"], row["kind"], row["group_id"]),
        }
    return rows


# What a Markdown renderer would read as markup in a stored value, beside HTML: a backslash
# (it escapes what follows), a table's column separator, a code span and a link's brackets.
_MD_ESCAPES = str.maketrans({"\\": "\\\\", "|": "\\|", "`": "\\`", "[": "\\[", "]": "\\]"})


def _md(value: Any) -> str:
    """``value`` as one line of Markdown text that shows as written: HTML-escaped (a stored
    ``<img onerror=...>`` would run where a renderer allows HTML; the HTML page escapes it
    too), every run of whitespace (newlines included) one space, and ``\\``, ``|``, a
    backtick and ``[ ]`` escaped, so a value never ends its table cell or opens markup."""
    text = " ".join(str(value).split())
    return html.escape(text, quote=False).translate(_MD_ESCAPES)


def _md_cell(value: Any, kind: str) -> str:
    text = format_value(value) if kind == "num" else ("–" if value is None else _cut(value))
    return _md(text)


def _md_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]
) -> list[str]:
    out = ["| " + " | ".join(_md(h) for _, h, _ in columns) + " |"]
    out.append("|" + "---|" * len(columns))
    for row in rows:
        out.append("| " + " | ".join(_md_cell(row.get(k), kind) for k, _, kind in columns) + " |")
    return out + [""]


def render_html(
    summary: Summary,
    plots: Mapping[str, Path],
    captions: Mapping[str, str],
    not_plotted: Mapping[str, str],
    *,
    evals: pa.Table | None,
    extremes: pa.Table | None,
) -> str:
    """The report page."""
    run = summary.fact("run").value
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>Run report: {_e(run)}</title><style>{_STYLE}</style></head><body><main>",
        f"<h1>Run report</h1><p class='path'>{_e(run)}</p>",
    ]
    if summary.left_out:
        items = "".join(f"<li>{_e(m)}</li>" for m in summary.left_out)
        parts.append(
            '<div class="banner" id="left-out" role="alert"><strong>Data left out: '
            f"{len(summary.left_out)} damaged file(s) were skipped</strong> (read with "
            "on_error='skip'); every figure below is computed without them.<ul>"
            f"{items}</ul></div>"
        )
    if summary.absent:
        items = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in summary.absent.items())
        parts.append(
            '<div class="note" id="absent"><strong>Not recorded by this run</strong> (so not '
            f"shown):<ul>{items}</ul></div>"
        )
    facts = "".join(
        f'<tr data-key="{_e(f.key)}"><th>{_e(f.label)}</th><td class="v">'
        f"{_e(format_value(f.value, f.unit))}</td></tr>"
        for f in summary.facts
        if f.key != "run"
    )
    parts.append(f'<h2 id="summary">Summary</h2><table class="facts" id="facts">{facts}</table>')
    if summary.trends:
        parts.append(
            "<h3>Over training: start, peak (highest value) and end</h3>"
            '<table id="trends"><thead><tr><th>figure</th><th>unit</th><th>start</th>'
            f"<th>peak</th><th>end</th></tr></thead><tbody>{_trend_rows(summary.trends)}"
            "</tbody></table>"
        )
    if summary.config:
        at = (
            f" (recorded with step {summary.config_step})"
            if summary.config_step is not None
            else ""
        )
        parts.append(
            f'<h3 id="config">Run config{_e(at)}</h3>'
            f'<div class="config" id="config-table">{_config_items(summary)}</div>'
        )
    parts.append('<h2 id="curves">Curves</h2>')
    for name, path in plots.items():
        parts.append(
            f'<figure id="plot-{_e(name)}"><img src="{_e(path.name)}" alt="{_e(captions[name])}">'
            f"<figcaption>{_e(captions[name])}</figcaption></figure>"
        )
    if not_plotted:
        items = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in not_plotted.items())
        parts.append(f'<div class="note" id="not-plotted">Not plotted:<ul>{items}</ul></div>')
    eval_html, _ = _eval_section(evals)
    parts.append(eval_html)
    if extremes is not None and extremes.num_rows:
        parts.append(
            '<h2 id="extremes">Best and worst prompt groups of the run (by mean U)</h2>'
            f'<p class="note">Steps and groups link to <code>maxent-arrow view RUN</code> '
            f"({DEFAULT_VIEW_URL}).</p>"
            + _table(_extremes_rows(extremes), _EXTREME_COLUMNS, id_="extremes-table")
        )
    parts.append("</main></body></html>")
    return "\n".join(p for p in parts if p)


def render_markdown(
    summary: Summary,
    plots: Mapping[str, Path],
    captions: Mapping[str, str],
    not_plotted: Mapping[str, str],
    *,
    evals: pa.Table | None,
    extremes: pa.Table | None,
) -> str:
    """``summary.md``: the same sections as the page, as Markdown."""
    md = [f"# Run report: {_md(summary.fact('run').value)}", ""]
    if summary.left_out:
        md += [f"> **Data left out: {len(summary.left_out)} damaged file(s) were skipped** "
               "(on_error='skip'); every figure is computed without them:", ">"]  # fmt: skip
        md += [f"> - {_md(m)}" for m in summary.left_out] + [""]
    if summary.absent:
        absent = "; ".join(f"{_md(k)} ({_md(v)})" for k, v in summary.absent.items())
        md += [f"**Not recorded by this run:** {absent}", ""]
    md += ["## Summary", "", "| | |", "|---|---|"]
    md += [
        f"| {_md(f.label)} | {_md_cell(format_value(f.value, f.unit), 'plain')} |"
        for f in summary.facts
        if f.key != "run"
    ]
    if summary.trends:
        md += ["", "| figure | unit | start | peak | end |", "|---|---|---|---|---|"]
        for t in summary.trends:
            cells = [
                _md(f"{format_value(v, t.unit)} (step {s})")
                for v, s in ((t.start, t.start_step), (t.peak, t.peak_step), (t.end, t.end_step))
            ]
            head = f"| {_md(t.label)} | {_md(_unit_text(t.unit))} | "
            md.append(head + " | ".join(cells) + " |")
    if summary.config:
        md += ["", "## Run config", "", "| key | value |", "|---|---|"]
        for key, value in config_items(summary.config):
            md.append(f"| {_md(key)} | {_md_cell(_config_text(value), 'plain')} |")
    md += ["", "## Curves", ""]
    md += [f"![{_md(captions[name])}]({path.name})" for name, path in plots.items()]
    if not_plotted:
        items = "; ".join(f"{_md(k)} ({_md(v)})" for k, v in not_plotted.items())
        md += ["", f"Not plotted: {items}"]
    _, eval_md = _eval_section(evals)
    if eval_md:
        md += [""] + eval_md
    if extremes is not None and extremes.num_rows:
        md += ["", "## Best and worst prompt groups of the run (by mean U)", ""]
        md += _md_table(_extremes_rows(extremes), _EXTREME_COLUMNS)
    return "\n".join(md) + "\n"
