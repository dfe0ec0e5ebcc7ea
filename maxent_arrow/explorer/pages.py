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

from maxent_arrow.analytics import status_text, tokenizer_text
from maxent_arrow.analytics.attempts import TRAINER
from maxent_arrow.analytics.links import group_path, step_path, tokens_path
from maxent_arrow.explorer.charts import chart_svg
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
# The attempts table: (key, header); ``status`` is how the attempt ended (analytics.attempts).
_ATTEMPT_COLUMNS = (
    ("id", "attempt"), ("role", "role"), ("status", "status"), ("resume_from", "resumed at"),
    ("started_at", "started"), ("host", "host"), ("version", "log version"),
)  # fmt: skip
# What each view of the SQL box is, for the query page's list of views.
_VIEWS = {
    "groups": "one row per prompt group (the run's history: superseded and trainer-dropped "
    "groups left out)",
    "samples": "one row per completion, every per-completion list at its position; "
    "reward_<name> per reward function",
    "steps": "one row per (step, rank, kind): the step table",
    "groups_all": "every group row of every attempt",
    "samples_all": "every completion of every attempt",
    "superseded": "the group rows later attempts superseded",
    "lifecycle": "what became of each stored group (trained, dropped), every role's records, "
    "with the attempt that wrote each",
    "trainer_metrics": "the figures a trainer logged per optimizer step (loss, KL, ...)",
    "attempt_ends": "the attempts whose writer recorded its end",
}


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
def _attempt_cell(attempt: dict[str, Any], key: str) -> str:
    if key == "status":
        status = attempt.get("status") or "-"
        detail = escape(attempt.get("detail") or "")
        return (
            f'<td class="status status-{escape(status)}" title="{detail}">'
            f"{escape(status_text(attempt))}</td>"
        )
    return f"<td>{fmt(attempt.get(key))}</td>"


def _config_box(info: dict[str, Any]) -> str:
    """The run config of the last step (the manifest's when no step recorded one), with
    its model and tokenizer first, as ``inspect`` and the report show them."""
    config = info["config"] or {}
    step = info.get("config_step")
    where = (
        f"recorded with step {step}"
        if step is not None
        else "the manifest's, as the store was created: no step recorded one"
    )
    facts = (
        f"<p class=facts id=config-facts>model: <b>{fmt(config.get('model'))}</b> · tokenizer: "
        f"<b>{fmt(tokenizer_text(config.get('tokenizer')))}</b> · trainer: "
        f"<b>{fmt(config.get('trainer'))}</b> · {escape(where)}"
    )
    changed = info.get("config_changed") or []
    if changed:
        facts += f" · changed during the run: {escape(', '.join(changed))}"
    text = escape(json.dumps(config, indent=2, sort_keys=True, default=str))
    return f"{facts}</p><pre class=json id=config>{text}</pre>"


def overview_page(info: dict[str, Any]) -> str:
    curves = "".join(chart_svg(chart) for chart in info["charts"])
    steps = "".join(
        f"<p><b>{escape(kind)}</b>: "
        + " ".join(f'<a class=steplink href="{escape(step_path(s, kind))}">{s}</a>' for s in s_)
        + "</p>"
        for kind, s_ in info["steps"].items()
    )
    attempts = "".join(
        f'<tr data-attempt="{escape(a["id"])}">'
        + "".join(_attempt_cell(a, k) for k, _ in _ATTEMPT_COLUMNS)
        + "</tr>"
        for a in info["attempts"]
    )
    heads = "".join(f"<th>{escape(h)}</th>" for _, h in _ATTEMPT_COLUMNS)
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
    manifest = escape(json.dumps(info["manifest"], indent=2, sort_keys=True, default=str))
    body = (
        f"<h1>Run overview</h1><p class=facts>{info['groups']:,} group rows · "
        + " · ".join(f"{len(v)} {escape(k)} steps" for k, v in info["steps"].items())
        + ' · store health: <a href="/verify" id=verify-link>verify every file</a></p>'
        f"<section class=curves id=curves>{curves or '<p>No step figures recorded.</p>'}</section>"
        f"<h2>Steps</h2>{steps}"
        f"<h2>Attempts</h2><table class=data id=attempts><thead><tr>{heads}</tr></thead>"
        f"<tbody>{attempts or _NO_ATTEMPTS}</tbody></table>{gone}"
        f"<h2>Config</h2>{_config_box(info)}"
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
    # Whose lifecycle records the statuses are: the trainer's, another role's when asked.
    roles = "".join(
        f'<option value="{escape(r)}"{_selected(groups.role == r)}>{escape(r)}</option>'
        for r in dict.fromkeys([TRAINER, *groups.roles, groups.role])
    )
    role_field = (
        f"<label>statuses of <select name=role id=role>{roles}</select></label>"
        if len(groups.roles) > 1 or groups.role != TRAINER
        else ""
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
        f"<label>attempts <select name=attempts>{histories}</select></label>{role_field}"
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
    status_note = (
        f" · statuses: the {escape(groups.role)}'s lifecycle records"
        if groups.has_status
        else f" · no lifecycle records of the {escape(groups.role)} (status unknown)"
    )
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


def _card(group: GroupRow, c: dict[str, Any], href: str) -> str:
    """One completion's card: its figures (rewards, U, advantage, q, weight, length, finish
    reason, then the ``log_extra`` values its reward functions logged) and its text."""
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
    figures += [(f"log_extra: {n}", v) for n, v in c.get("extra", {}).items()]
    table = "".join(
        f'<tr><th>{escape(n)}</th><td data-figure="{escape(n)}">{fmt(v)}</td></tr>'
        for n, v in figures
    )
    text = (
        _messages(c["messages"])
        if c["messages"]
        else f"<pre class=text>{escape(c['text'] or '')}</pre>"
    )
    return (
        f'<article class="{" ".join(classes)}" data-index={i}>'
        f"<h3>completion {i} {''.join(marks)}</h3>"
        f"<table class=figures>{table}</table>{text}"
        f'<a class=tokenlink href="{escape(href)}">tokens</a></article>'
    )


def _dataset(group: GroupRow) -> str:
    """The dataset columns the recorder kept for this group (``ds_<name>``), and the names
    of the ``log_extra`` columns its completions carry."""
    if not group.dataset and not group.extra_names:
        return ""
    rows = "".join(
        f'<tr><th>{escape(n)}</th><td data-column="{escape(n)}">'
        f"{escape(dumps(v)) if isinstance(v, list | dict) else fmt(v)}</td></tr>"
        for n, v in group.dataset.items()
    )
    table = f"<table class=data id=dataset><tbody>{rows}</tbody></table>" if rows else ""
    extra = (
        "<p class=facts id=log-extra>log_extra columns (per completion, in each card): "
        + ", ".join(f"<code>{escape(n)}</code>" for n in group.extra_names)
        + "</p>"
        if group.extra_names
        else ""
    )
    return f"<h2>Dataset columns</h2>{table or '<p>none kept</p>'}{extra}"


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
    cards = [
        _card(group, c, tokens_path(step, rank, gi, c["index"], kind, attempts=history,
                                    attempt=pick))
        for c in group.completions
    ]  # fmt: skip
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
        f"<h2>Prompt</h2><section id=prompt>{prompt}</section>{_dataset(group)}"
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


def _colour_legend(lo: float, hi: float, diverging: bool) -> str:
    """The key of the token colours: swatches from the low end to the high end of the chosen
    series (from -m through 0 to m, m = max |value|, for a series of both signs), each
    coloured as a token of that value is, and the grey of a token without one."""
    if diverging:
        m = max(abs(lo), abs(hi)) or 1.0
        a, b = -m, m
    else:
        a, b = lo, hi
    stops = [a + k * (b - a) / 6 for k in range(7)] if b != a else [a]
    swatches = "".join(
        f'<span class=swatch data-value="{v!r}" title="{fmt(v)}" '
        f'style="background:{_colour(v, lo, hi, diverging)}"></span>'
        for v in stops
    )
    middle = " <span class=mid>(white: 0)</span>" if diverging else ""
    return (
        f"<div class=colour-legend id=colour-legend><span class=end>{fmt(a)}</span>"
        f"<span class=ramp>{swatches}</span>{middle}<span class=end>{fmt(b)}</span>"
        '<span class="swatch none" style="background:#e5e7eb"></span> no value</div>'
    )


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
    pieces = data.get("pieces")
    chips = []
    for t, token in enumerate(data["ids"]):
        v = values[t] if t < len(values) else None
        info: dict[str, Any] = {"t": t, "id": token}
        piece = ""
        if pieces is not None and t < len(pieces):
            info["piece"] = pieces[t]
            piece = f"<span class=piece>{escape(pieces[t])}</span>"
        for name, vals in data["series"].items():
            info[data["labels"][name]] = vals[t] if t < len(vals) else None
        chips.append(
            f'<span class=tok data-info="{escape(dumps(info))}" '
            f'style="background:{_colour(v, lo, hi, diverging)}">'
            f"{piece}<span class=id>{token}</span></span>"
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
        f"{_colour_legend(lo, hi, diverging) if chosen else ''}"
        f"<p class=facts id=pieces>{escape(data.get('tokenizer') or '')}: each token shows "
        f"{'its decoded piece above its id' if pieces is not None else 'its id'}</p>"
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


def _views_list(views: dict[str, list[tuple[str, str]]]) -> str:
    """Each view the SQL box can name, what it is, and its columns with their types (each a
    ``details`` element: the list stays short until opened)."""
    items = []
    for name, columns in views.items():
        cols = ", ".join(
            f"<code class=col>{escape(c)}</code> <span class=type>{escape(t)}</span>"
            for c, t in columns
        )
        about = _VIEWS.get(name, "a record table")
        items.append(
            f'<details class=view data-view="{escape(name)}"><summary><code>{escape(name)}'
            f"</code>: {escape(about)} ({len(columns)} columns)</summary>"
            f"<p class=columns>{cols}</p></details>"
        )
    return f"<section id=views><h2>Views and their columns</h2>{''.join(items)}</section>"


def query_page(
    sql: str,
    result: Any,
    error: str | None,
    *,
    uri: str,
    max_rows: int,
    views: dict[str, list[tuple[str, str]]] | None = None,
) -> str:
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
        f"{_views_list(views) if views else ''}"
    )
    return _layout("query", body, uri=uri, crumbs=[("run", "/"), ("query", None)])
