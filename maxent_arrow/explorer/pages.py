"""The explorer's HTML: one function per page, from what :mod:`.data` read.

Pages are drawn on the server (plain HTML and inline SVG; every value escaped), so each view
is its URL: a step's filters and sort order, a group, a completion's token series and a
query are all query parameters, and a link pasted in a chat opens the same view. The one
script (``static/explorer.js``) adds the token tooltip; the pages work without it.
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any
from urllib.parse import urlencode

from maxent_arrow.analytics.links import group_path, step_path, tokens_path
from maxent_arrow.explorer.data import GroupRow, StepGroups, dumps

__all__ = [
    "METRICS",
    "PAGE_SIZE",
    "compare_page",
    "error_page",
    "export_page",
    "group_page",
    "overview_page",
    "query_page",
    "step_page",
    "tokens_page",
    "verify_page",
]

PAGE_SIZE = 50
# The step table's sortable and filterable figures: key, header.
METRICS = (
    ("mean_reward", "mean reward"),
    ("reward_std", "reward std"),
    ("advantage_spread", "advantage spread"),
    ("mean_length", "mean length"),
    ("truncated", "truncated"),
)
_NO_ATTEMPTS = "<tr><td colspan=7>– (a store without a commit log)</td></tr>"
_CHAT = "<span class=badge>chat</span> "
_PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")


def fmt(value: Any, digits: int = 4) -> str:
    """A number as the pages print it: NaN as ``NaN``, missing as ``–``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        return f"{value:.{digits}g}"
    return escape(str(value))


def _layout(title: str, body: str, *, uri: str, crumbs: list[tuple[str, str | None]]) -> str:
    trail = " › ".join(
        f'<a href="{escape(href)}">{escape(label)}</a>' if href else escape(label)
        for label, href in crumbs
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)} · maxent-arrow view</title>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        '<link rel=icon href="/static/icon.svg" type="image/svg+xml">'
        '<link rel=stylesheet href="/static/explorer.css">'
        '<script src="/static/explorer.js" defer></script></head><body>'
        '<header><a class=brand href="/"><img src="/static/icon.svg" alt="" width=20 height=20>'
        " maxent-arrow view</a>"
        f'<nav class=crumbs>{trail}</nav><nav class=tools><a href="/query">query</a>'
        f'<a href="/verify">verify</a></nav><span class=run title="{escape(uri)}">'
        f"{escape(uri)}</span></header>"
        f"<main>{body}</main></body></html>"
    )


def error_page(status: int, message: str, *, uri: str) -> str:
    body = (
        f"<h1>{status}</h1><p class=error id=error>{escape(message)}</p>"
        '<p><a href="/">back to the run</a></p>'
    )
    return _layout(f"error {status}", body, uri=uri, crumbs=[("run", "/"), ("error", None)])


# ---------------------------------------------------------------------- overview
def _svg_curve(label: str, series: dict[str, list[tuple[int, float]]]) -> str:
    width, height, pad = 560, 220, 44
    xs = [s for pts in series.values() for s, _ in pts]
    ys = [v for pts in series.values() for _, v in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def px(s: float) -> float:
        return pad + (s - x0) / (x1 - x0) * (width - 2 * pad)

    def y(v: float) -> float:
        return height - pad - (v - y0) / (y1 - y0) * (height - 2 * pad)

    parts = [
        f'<figure class=curve data-curve="{escape(label)}"><figcaption>{escape(label)}</figcaption>'
        f'<svg viewBox="0 0 {width} {height}" width={width} height={height} role=img '
        f'aria-label="{escape(label)} per step">',
        f"<line class=axis x1={pad} y1={height - pad} x2={width - pad} y2={height - pad} />",
        f"<line class=axis x1={pad} y1={pad} x2={pad} y2={height - pad} />",
        f"<text class=tick x={pad - 6} y={y(y1) + 4:.1f} text-anchor=end>{fmt(y1, 3)}</text>",
        f"<text class=tick x={pad - 6} y={y(y0) + 4:.1f} text-anchor=end>{fmt(y0, 3)}</text>",
        *(
            f"<text class=tick x={px(s):.1f} y={height - pad + 16} text-anchor=middle>"
            f"{int(s)}</text>"
            for s in (x0, x1)
        ),
        f"<text class=tick x={width / 2:.0f} y={height - 6} text-anchor=middle>step</text>",
    ]
    for i, (kind, points) in enumerate(sorted(series.items())):
        colour = _PALETTE[i % len(_PALETTE)]
        line = " ".join(f"{px(s):.1f},{y(v):.1f}" for s, v in points)
        parts.append(f'<polyline fill=none stroke="{colour}" stroke-width=1.6 points="{line}" />')
        for s, v in points:
            parts.append(
                f'<a class=point href="{escape(step_path(s, kind))}" data-step={s} '
                f'data-kind="{escape(kind)}"><circle cx={px(s):.1f} cy={y(v):.1f} r=5 '
                f'fill="{colour}"><title>{escape(kind)} step {s}: {fmt(v)}</title></circle></a>'
            )
        parts.append(
            f"<text class=legend x={width - pad} y={pad - 24 + 14 * i} text-anchor=end "
            f'fill="{colour}">{escape(kind)}</text>'
        )
    parts.append("</svg></figure>")
    return "".join(parts)


def overview_page(info: dict[str, Any]) -> str:
    curves = "".join(_svg_curve(label, series) for label, series in info["curves"].items())
    steps = "".join(
        f"<p><b>{escape(kind)}</b>: "
        + " ".join(f'<a class=steplink href="{escape(step_path(s, kind))}">{s}</a>' for s in s_)
        + "</p>"
        for kind, s_ in info["steps"].items()
    )
    attempts = "".join(
        "<tr>"
        + "".join(
            f"<td>{fmt(a.get(k))}</td>"
            for k in ("id", "role", "mode", "resume_from", "started_at", "host", "version")
        )
        + "</tr>"
        for a in info["attempts"]
    )
    superseded = info["superseded_steps"]
    gone = (
        "<p class=note id=superseded>Steps superseded by a later attempt: "
        + " ".join(
            f'<a href="{escape(step_path(s, "train", attempts="all"))}">{s}</a>' for s in superseded
        )
        + " (shown with <code>attempts=all</code> or <code>superseded</code>)</p>"
        if superseded
        else ""
    )
    config = escape(json.dumps(info["config"], indent=2, sort_keys=True, default=str))
    manifest = escape(json.dumps(info["manifest"], indent=2, sort_keys=True, default=str))
    body = (
        f"<h1>Run overview</h1><p class=facts>{info['groups']:,} group rows · "
        + " · ".join(f"{len(v)} {escape(k)} steps" for k, v in info["steps"].items())
        + ' · store health: <a href="/verify" id=verify-link>verify every file</a></p>'
        f"<section class=curves id=curves>{curves or '<p>No step figures recorded.</p>'}</section>"
        f"<h2>Steps</h2>{steps}"
        f"<h2>Attempts</h2><table class=data id=attempts><thead><tr><th>attempt</th><th>role</th>"
        "<th>mode</th><th>resumed from</th><th>started</th><th>host</th><th>log version</th>"
        f"</tr></thead><tbody>{attempts or _NO_ATTEMPTS}"
        f"</tbody></table>{gone}"
        f"<h2>Config</h2><pre class=json id=config>{config}</pre>"
        f"<details><summary>Manifest</summary><pre class=json>{manifest}</pre></details>"
    )
    return _layout("overview", body, uri=info["uri"], crumbs=[("run", None)])


def verify_page(result: dict[str, Any], *, uri: str) -> str:
    if result["ok"]:
        verdict = f"<p class=ok id=verdict>OK: {result['checked']} files checked, no damage.</p>"
    else:
        rows = "".join(
            f"<tr><td>{escape(p)}</td><td>{escape(w)}</td></tr>" for p, w in result["problems"]
        )
        verdict = (
            f"<p class=error id=verdict>{len(result['problems'])} problem(s) in "
            f"{result['checked']} files</p><table class=data><tbody>{rows}</tbody></table>"
        )
    return _layout(
        "verify",
        f"<h1>Store health</h1>{verdict}",
        uri=uri,
        crumbs=[("run", "/"), ("verify", None)],
    )


# ---------------------------------------------------------------------- step
def _number(row: dict[str, Any], key: str, fn: str | None) -> float:
    value = row["rewards"].get(fn) if key == "fn" else row.get(key)
    if value is None:
        return math.nan
    return float(value)


def select_rows(groups: StepGroups, params: dict[str, str]) -> list[dict[str, Any]]:
    """The rows of a step that pass the filters in ``params``, in its sort order."""
    fn = params.get("fn") or None
    rows = groups.rows
    status = params.get("status") or ""
    if status in ("trained", "dropped"):
        rows = [r for r in rows if r["status"] == status]
    elif status == "none":
        rows = [r for r in rows if r["status"] is None]
    if params.get("trunc") == "1":
        rows = [r for r in rows if r["truncated"]]
    if params.get("chat") == "1":
        rows = [r for r in rows if r["chat"]]
    if params.get("unscored") == "1":
        rows = [r for r in rows if r["unscored"]]
    text = (params.get("q") or "").lower()
    if text:
        rows = [r for r in rows if text in (r["prompt"] or "").lower()]
    for key in (*(k for k, _ in METRICS), "fn"):
        for bound, keep in (("min", lambda v, b: v >= b), ("max", lambda v, b: v <= b)):
            raw = params.get(f"{key}_{bound}")
            if raw in (None, ""):
                continue
            limit = float(raw)
            rows = [r for r in rows if not math.isnan(v := _number(r, key, fn)) and keep(v, limit)]
    sort = params.get("sort") or "group_index"
    desc = params.get("desc") == "1"
    if sort in {k for k, _ in METRICS} | {"fn"}:

        def key_(r: dict[str, Any]) -> tuple:
            v = _number(r, sort, fn)
            # NaN last whichever way the column sorts.
            return (
                math.isnan(v),
                -v if desc and not math.isnan(v) else v if not math.isnan(v) else 0,
            )

        rows = sorted(rows, key=key_)
    elif sort in ("rank", "group_index", "status", "attempt", "k"):
        rows = sorted(
            rows,
            key=lambda r: (r[sort] is None, r[sort] or 0, r["rank"], r["group_index"]),
            reverse=desc,
        )
    return rows


def _selected(on: bool) -> str:
    return " selected" if on else ""


def _checkbox(name: str, label: str, params: dict[str, str]) -> str:
    checked = " checked" if params.get(name) == "1" else ""
    return f"<label><input type=checkbox name={name} value=1{checked}> {escape(label)}</label>"


def _href(base: str, params: dict[str, str], **changes: Any) -> str:
    merged = {**params, **{k: str(v) for k, v in changes.items()}}
    merged = {k: v for k, v in merged.items() if v not in ("", "None")}
    return base + ("?" + urlencode(sorted(merged.items())) if merged else "")


def step_page(groups: StepGroups, params: dict[str, str], *, uri: str, export: bool = False) -> str:
    base = f"/step/{groups.step}"
    params = {**params, "kind": groups.kind}
    fn = params.get("fn") or ""
    rows = select_rows(groups, params)
    page = max(0, int(params.get("page") or 0))
    shown = rows[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
    sort, desc = params.get("sort") or "group_index", params.get("desc") == "1"

    def header(key: str, label: str) -> str:
        flip = (
            "0"
            if sort == key and desc
            else "1"
            if sort == key
            else "1"
            if key != "group_index"
            else "0"
        )
        mark = (" ▼" if desc else " ▲") if sort == key else ""
        return (
            f'<th><a class=sort data-sort="{key}" '
            f'href="{escape(_href(base, params, sort=key, desc=flip, page=""))}">'
            f"{escape(label)}{mark}</a></th>"
        )

    heads = (
        header("rank", "rank")
        + header("group_index", "group")
        + "<th>prompt</th>"
        + header("k", "K")
        + "".join(header(k, label) for k, label in METRICS)
        + (header("fn", f"reward: {fn}") if fn else "")
        + header("status", "status")
        + header("attempt", "attempt")
    )
    body_rows = []
    for r in shown:
        href = group_path(
            r["step"], r["rank"], r["group_index"], r["kind"], attempts=groups.history,
            attempt=r["attempt"] if groups.history != "effective" and r["attempt"] else None,
        )  # fmt: skip
        prompt = r["prompt"] or ""
        classes = " ".join(
            c for c, on in (("superseded", r["superseded"]), ("nan", r["unscored"])) if on
        )
        body_rows.append(
            f'<tr class="{classes}" data-rank={r["rank"]} data-group={r["group_index"]}>'
            f"<td>{r['rank']}</td>"
            f'<td><a class=grouplink href="{escape(href)}">{r["group_index"]}</a></td>'
            f'<td class=prompt title="{escape(prompt)}">{_CHAT if r["chat"] else ""}'
            f"{escape(prompt[:90])}{'…' if len(prompt) > 90 else ''}</td>"
            f"<td>{r['k']}</td>"
            + "".join(f'<td class=num data-key="{k}">{fmt(r[k])}</td>' for k, _ in METRICS)
            + (f"<td class=num data-key=fn>{fmt(r['rewards'].get(fn))}</td>" if fn else "")
            + f"<td class=status>{fmt(r['status'])}"
            + (f" ({escape(r['reason'])})" if r["reason"] else "")
            + "</td>"
            f"<td class=attempt>{escape(r['attempt'] or '–')}"
            f"{' <span class=badge>superseded</span>' if r['superseded'] else ''}</td></tr>"
        )

    def field(name: str, label: str, kind: str = "number") -> str:
        return (
            f'<label>{escape(label)} <input type={kind} step=any name="{name}" '
            f'value="{escape(params.get(name, ""))}"></label>'
        )

    options = "".join(
        f'<option value="{escape(v)}"{_selected(params.get("status", "") == v)}>{t}</option>'
        for v, t in (
            ("", "any"),
            ("trained", "trained"),
            ("dropped", "dropped"),
            ("none", "no record"),
        )
    )
    fns = "".join(
        f'<option value="{escape(n)}"{" selected" if fn == n else ""}>{escape(n)}</option>'
        for n in ["", *groups.reward_functions]
    )
    histories = "".join(
        f'<option value="{h}"{" selected" if groups.history == h else ""}>{h}</option>'
        for h in ("effective", "all", "superseded")
    )
    hidden = "".join(
        f'<input type=hidden name="{k}" value="{escape(v)}">'
        for k, v in params.items()
        if k in ("kind", "sort", "desc")
    )
    ranges = "".join(
        f"<fieldset><legend>{escape(label)}</legend>"
        f"{field(k + '_min', 'min')}{field(k + '_max', 'max')}</fieldset>"
        for k, label in (*METRICS[:4], ("fn", "reward function"))
    )
    form = (
        f'<form class=filters id=filters method=get action="{base}">{hidden}'
        f"<label>status <select name=status>{options}</select></label>"
        f"<label>reward function <select name=fn>{fns}</select></label>"
        f"<label>attempts <select name=attempts>{histories}</select></label>"
        f"{_checkbox('trunc', 'truncated', params)}{_checkbox('unscored', 'NaN reward', params)}"
        f"{field('q', 'prompt contains', 'search')}{ranges}"
        "<button type=submit id=apply>apply</button> "
        f'<a href="{base}?kind={escape(groups.kind)}">clear</a></form>'
    )
    pager = ""
    if len(rows) > PAGE_SIZE:
        pages = (len(rows) + PAGE_SIZE - 1) // PAGE_SIZE
        pager = (
            "<p class=pager>"
            + " ".join(
                f'<a href="{escape(_href(base, params, page=p))}">{p + 1}</a>'
                if p != page
                else f"<b>{p + 1}</b>"
                for p in range(pages)
            )
            + "</p>"
        )
    status_note = "" if groups.has_status else " · no lifecycle records (status unknown)"
    if export and rows:
        target = _href(f"/export/step/{groups.step}", params, page="")
        wandb = _href(f"/export/step/{groups.step}", params, page="", to="wandb")
        status_note += (
            f' · export these {len(rows)} groups as a <a id=export href="{escape(target)}">'
            f'Hugging Face dataset folder</a> or a <a id=export-wandb href="{escape(wandb)}">'
            "W&amp;B table (offline run)</a>"
        )
    body = (
        f"<h1>{escape(groups.kind)} step {groups.step}</h1>"
        f"<p class=facts id=count>{len(rows)} of {len(groups.rows)} group rows shown"
        f" ({escape(groups.history)} history){status_note}</p>{form}"
        f'<table class="data groups" id=groups><thead><tr>{heads}</tr></thead>'
        f"<tbody>{''.join(body_rows)}</tbody></table>{pager}"
    )
    return _layout(
        f"step {groups.step}", body, uri=uri,
        crumbs=[("run", "/"), (f"{groups.kind} step {groups.step}", None)],
    )  # fmt: skip


# ---------------------------------------------------------------------- group
def _messages(messages: list[dict[str, Any]] | None) -> str:
    out = []
    for m in messages or []:
        role = m.get("role") or "?"
        out.append(
            f'<div class="msg role-{escape(role)}"><span class=role>{escape(role)}</span>'
            f"<div class=content>{escape(m.get('content') or '')}</div></div>"
        )
    return f"<div class=chat>{''.join(out)}</div>"


def _compare_link(params: dict[str, Any]) -> str:
    href = "/compare?" + urlencode(params)
    return f'<a id=compare href="{escape(href)}">same prompt across steps</a>'


def group_page(group: GroupRow, *, uri: str, history: str) -> str:
    key = group.key
    step, rank, kind, gi = key["step"], key["rank"], key["kind"], key["group_index"]
    pick = group.attempt if history != "effective" and group.attempt else None
    if group.prompt_messages:
        prompt = _messages(group.prompt_messages)
    else:
        prompt = f"<pre class=text>{escape(group.prompt or '')}</pre>"
    compare = ""
    if group.example_id is not None:
        compare = _compare_link({"example_id": group.example_id, "kind": kind})
    elif group.prompt is not None:
        compare = _compare_link({"prompt": group.prompt, "kind": kind})
    cards = []
    for c in group.completions:
        i = c["index"]
        marks = []
        classes = ["card"]
        if i == group.best:
            marks.append("<span class='badge best'>best</span>")
            classes.append("best")
        if i == group.worst:
            marks.append("<span class='badge worst'>worst</span>")
            classes.append("worst")
        figures = [(f"reward: {n}", v) for n, v in c["rewards"].items()] + [
            ("total U", c["total"]),
            ("advantage", c["advantage"]),
            ("q", c["q"]),
            ("MaxEnt weight", c["weight"]),
            ("length", c["length"]),
            ("finish reason", c["finish_reason"]),
        ]
        table = "".join(
            f'<tr><th>{escape(n)}</th><td data-figure="{escape(n)}">{fmt(v)}</td></tr>'
            for n, v in figures
        )
        text = (
            _messages(c["messages"])
            if c["messages"]
            else f"<pre class=text>{escape(c['text'] or '')}</pre>"
        )
        href = tokens_path(step, rank, gi, i, kind, attempts=history, attempt=pick)
        cards.append(
            f'<article class="{" ".join(classes)}" data-index={i}>'
            f"<h3>completion {i} {''.join(marks)}</h3>"
            f"<table class=figures>{table}</table>{text}"
            f'<a class=tokenlink href="{escape(href)}">tokens</a></article>'
        )
    meta = [
        ("rank", rank),
        ("attempt", (group.attempt or "–") + (" (superseded)" if group.superseded else "")),
        ("status", group.status), ("example id", group.example_id), ("answer", group.answer),
    ]  # fmt: skip
    facts = " · ".join(
        f"{escape(n)}: <b>{fmt(v) if not isinstance(v, str) else escape(v)}</b>" for n, v in meta
    )
    body = (
        f"<h1>{escape(kind)} step {step} · group {gi}</h1>"
        f"<p class=facts id=facts>{facts} {compare}</p>"
        f"<h2>Prompt</h2><section id=prompt>{prompt}</section>"
        f"<h2>{len(group.completions)} completions</h2>"
        f"<div class=cards id=cards>{''.join(cards)}</div>"
    )
    return _layout(
        f"step {step} group {gi}", body, uri=uri,
        crumbs=[
            ("run", "/"),
            (f"{kind} step {step}", step_path(step, kind, attempts=history)),
            (f"group {gi}", None),
        ],
    )  # fmt: skip


# ---------------------------------------------------------------------- tokens
def _colour(value: float | None, lo: float, hi: float, diverging: bool) -> str:
    if value is None or math.isnan(value):
        return "#e5e7eb"
    if diverging:
        m = max(abs(lo), abs(hi)) or 1.0
        t = max(-1.0, min(1.0, value / m))
        if t >= 0:
            return f"rgb({int(255 - 120 * t)},{int(255 - 40 * t)},{int(255 - 120 * t)})"
        return f"rgb(255,{int(255 + 130 * t)},{int(255 + 130 * t)})"
    t = 0.5 if hi == lo else (value - lo) / (hi - lo)
    return f"rgb({int(255 - 150 * t)},{int(255 - 90 * t)},255)"


def tokens_page(
    data: dict[str, Any],
    key: dict[str, Any],
    series: str | None,
    *,
    uri: str,
    history: str,
    attempt: str | None = None,
) -> str:
    step, rank, kind, gi, sample = (
        key["step"],
        key["rank"],
        key["kind"],
        key["group_index"],
        key["sample"],
    )
    available = list(data["series"])

    def series_href(name: str) -> str:
        return tokens_path(
            step, rank, gi, sample, kind, attempts=history, attempt=attempt, series=name
        )

    chosen = series if series in data["series"] else (available[0] if available else None)
    values = data["series"].get(chosen, []) if chosen else []
    finite = [v for v in values if v is not None and not math.isnan(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    diverging = chosen in ("token_advantages", "kl") or (lo < 0 < hi)
    chips = []
    for t, token in enumerate(data["ids"]):
        v = values[t] if t < len(values) else None
        info = {"t": t, "id": token}
        for name, vals in data["series"].items():
            info[data["labels"][name]] = vals[t] if t < len(vals) else None
        chips.append(
            f'<span class=tok data-info="{escape(dumps(info))}" '
            f'style="background:{_colour(v, lo, hi, diverging)}">'
            f"{token}</span>"
        )
    links = " ".join(
        f'<a class="series{" chosen" if n == chosen else ""}" data-series="{n}" '
        f'href="{escape(series_href(n))}">'
        f"{escape(data['labels'][n])}</a>"
        for n in available
    )
    body = (
        f"<h1>{escape(kind)} step {step} · group {gi} · completion {sample}</h1>"
        f"<p class=facts>{len(data['ids'])} tokens · colour: "
        f"<b id=chosen>{escape(data['labels'].get(chosen, 'none'))}</b> ({fmt(lo)} … {fmt(hi)})"
        f"</p><p class=series-list>series: {links or '– (no per-token series stored)'}</p>"
        f"<div class=tokens id=tokens>{''.join(chips)}</div><div id=tip class=tip hidden></div>"
        f"<h2>Text</h2><pre class=text>{escape(data['text'] or '')}</pre>"
    )
    return _layout(
        f"tokens {step}/{gi}/{sample}", body, uri=uri,
        crumbs=[("run", "/"), (f"{kind} step {step}", step_path(step, kind, attempts=history)),
                (f"group {gi}", group_path(step, rank, gi, kind, attempts=history,
                                           attempt=attempt)),
                (f"completion {sample}", None)],
    )  # fmt: skip


def export_page(folder: Any, groups: int, card: str, *, uri: str) -> str:
    body = (
        f"<h1>Exported</h1><p class=ok id=exported>{groups} group rows written to "
        f"<code id=folder>{escape(str(folder))}</code></p>"
        f"<h2>Dataset card (README.md)</h2><pre class=text id=card>{escape(card)}</pre>"
    )
    return _layout("export", body, uri=uri, crumbs=[("run", "/"), ("export", None)])


# ---------------------------------------------------------------------- compare, query
def compare_page(sections: list[tuple[str, list[dict]]], what: str, *, uri: str) -> str:
    parts = []
    for title, rows in sections:
        trs = "".join(
            f"<tr><td>{r['step']}</td><td>{r['rank']}</td>"
            + (
                f'<td><a href="{escape(r["href"])}">{r["group_index"]}</a></td>'
                if r["href"]
                else f"<td>{r['group_index']}</td>"  # the other run: not served here
            )
            + f"<td class=num>{fmt(r['mean_reward'])}</td></tr>"
            for r in rows
        )
        parts.append(
            f'<h2>{escape(title)}</h2><table class=data data-run="{escape(title)}"><thead><tr>'
            "<th>step</th><th>rank</th><th>group</th><th>mean reward</th></tr></thead>"
            f"<tbody>{trs or '<tr><td colspan=4>none</td></tr>'}</tbody></table>"
        )
    body = f"<h1>Same prompt across steps</h1><p class=facts>{escape(what)}</p>{''.join(parts)}"
    return _layout("compare", body, uri=uri, crumbs=[("run", "/"), ("compare", None)])


def query_page(sql: str, result: Any, error: str | None, *, uri: str, max_rows: int) -> str:
    out = ""
    if error:
        out = f"<p class=error id=error>{escape(error)}</p>"
    elif result is not None:
        names = result.column_names
        rows = result.slice(0, max_rows).to_pylist()
        head = "".join(f"<th>{escape(n)}</th>" for n in names)
        body_rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{escape(dumps(r[n])) if isinstance(r[n], list | dict) else fmt(r[n])}</td>"
                for n in names
            )
            + "</tr>"
            for r in rows
        )
        more = f" (showing {max_rows})" if result.num_rows > max_rows else ""
        out = (
            f"<p class=facts id=rows>{result.num_rows:,} rows{more} · "
            f'<a id=csv download=query.csv href="/query.csv?{urlencode({"sql": sql})}">'
            "download CSV</a></p><table class=data id=result>"
            f"<thead><tr>{head}</tr></thead><tbody>{body_rows}</tbody></table>"
        )
    body = (
        "<h1>Query</h1><p>DuckDB SQL over the views <code>groups</code>, <code>samples</code>, "
        "<code>steps</code> (and the record tables), read-only and sandboxed as "
        "<code>maxent-arrow query</code>.</p>"
        '<form method=get action="/query" id=queryform>'
        f"<textarea name=sql id=sql rows=6 cols=100>{escape(sql)}</textarea>"
        f"<br><button type=submit id=run>run</button></form>{out}"
    )
    return _layout("query", body, uri=uri, crumbs=[("run", "/"), ("query", None)])
