"""A plotted report of a saved run: PNG plots, an HTML page and a Markdown summary.

``build_report(root, out)`` runs the ready-made queries of :class:`RunAnalytics` (after one
materializing scan) and writes into ``out``:

* ``reward_curve.png``: mean per step with the p05-p95 band, one line per reward function;
* ``success.png``: success rate, group success rate, pass@k, fraction of zero-variance groups;
* ``lengths.png``: completion length (mean, p50, p95, max) and the clipped fraction;
* ``entropy.png``: q entropy and weight entropy (mean with the min-max band);
* ``kl_buckets.png``: per-token KL per completion-length bucket over steps;
* ``advantages.png``: histogram of advantages over all train steps;
* ``eval.png``: eval reward curve (when the run has eval rows);
* ``index.html`` (the plots, a summary table, best and worst completions of the last step),
  ``summary.md`` and ``summary.json``.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it runs
headless and leaves a caller's matplotlib state alone.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.analytics.run import RunAnalytics
from maxent_arrow.errors import (
    ArgumentError,
    LayoutError,
    MissingExtraError,
    SchemaError,
    StoreError,
)

__all__ = ["Report", "build_report"]


@dataclass
class Report:
    """What :func:`build_report` wrote: the plot files, the pages and the summary numbers."""

    out: Path
    plots: dict[str, Path] = field(default_factory=dict)
    html: Path | None = None
    markdown: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _figure(title: str) -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise MissingExtraError("matplotlib", "analytics") from None
    fig = Figure(figsize=(7.5, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _np(table: pa.Table, name: str) -> np.ndarray:
    """A column as float64 with nulls as NaN (matplotlib leaves gaps there)."""
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)


def _plot_rewards(run: RunAnalytics, out: Path, kind: str, name: str) -> Path | None:
    curve = run.reward_curve(kind=kind)
    if curve.num_rows == 0:
        return None
    title = "Reward per step" if kind == "train" else "Eval reward per step"
    fig, ax = _figure(title)
    rewards = list(dict.fromkeys(curve.column("reward").to_pylist()))
    for reward in rewards:
        part = curve.filter(pc.equal(curve.column("reward"), reward))
        steps = _np(part, "step")
        (line,) = ax.plot(
            steps,
            _np(part, "mean"),
            marker="." if len(steps) < 50 else None,
            label=f"{reward} (mean)",
        )
        ax.fill_between(
            steps,
            _np(part, "p05"),
            _np(part, "p95"),
            alpha=0.15,
            color=line.get_color(),
            label=f"{reward} p05-p95",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    return _save(fig, out / name)


def _plot_success(
    run: RunAnalytics, out: Path, threshold: float, ks: tuple[int, ...]
) -> Path | None:
    succ = run.success_rate(threshold=threshold, k=ks)
    zero = run.zero_variance_groups()
    if succ.num_rows == 0:
        return None
    fig, ax = _figure(f"Success (reward > {threshold:g}) per step")
    steps = _np(succ, "step")
    ax.plot(steps, _np(succ, "success_rate"), label="completion success rate")
    ax.plot(steps, _np(succ, "group_success_rate"), label="groups with a success")
    for k in ks:
        ax.plot(steps, _np(succ, f"pass_at_{k}"), linestyle="--", label=f"pass@{k}")
    ax.plot(
        _np(zero, "step"),
        _np(zero, "frac_zero_variance"),
        color="gray",
        linestyle=":",
        label="zero-variance groups",
    )
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    return _save(fig, out / "success.png")


def _plot_lengths(run: RunAnalytics, out: Path) -> Path | None:
    stats = run.length_stats()
    if stats.num_rows == 0:
        return None
    fig, ax = _figure("Completion length per step (tokens)")
    steps = _np(stats, "step")
    for col, style in (
        ("mean_length", "-"),
        ("p50_length", "--"),
        ("p95_length", "-."),
        ("max_length", ":"),
    ):
        ax.plot(steps, _np(stats, col), linestyle=style, label=col.replace("_length", ""))
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    twin = ax.twinx()
    twin.plot(steps, _np(stats, "clipped_frac"), color="red", alpha=0.6, label="clipped frac")
    twin.set_ylabel("clipped fraction")
    twin.set_ylim(-0.02, 1.02)
    handles = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8)
    return _save(fig, out / "lengths.png")


def _plot_entropy(run: RunAnalytics, out: Path) -> Path | None:
    try:
        ent = run.entropy_curve()
    except (SchemaError, StoreError):  # the run stored no such column
        return None
    if ent.num_rows == 0:
        return None
    fig, ax = _figure("Entropy per step (nats, over groups)")
    steps = _np(ent, "step")
    for prefix in ("q_entropy", "weight_entropy"):
        if f"{prefix}_mean" not in ent.column_names:
            continue
        mean = _np(ent, f"{prefix}_mean")
        if np.all(np.isnan(mean)):
            continue
        (line,) = ax.plot(steps, mean, label=f"{prefix} mean")
        ax.fill_between(
            steps,
            _np(ent, f"{prefix}_min"),
            _np(ent, f"{prefix}_max"),
            alpha=0.15,
            color=line.get_color(),
            label=f"{prefix} min-max",
        )
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    return _save(fig, out / "entropy.png")


def _plot_kl(run: RunAnalytics, out: Path) -> Path | None:
    kl = run.kl_by_length_bucket()
    if kl.num_rows == 0:
        return None
    fig, ax = _figure("Per-token KL by completion-length bucket")
    buckets = sorted(
        set(zip(kl.column("bucket_order").to_pylist(), kl.column("bucket").to_pylist()))
    )
    for _, bucket in buckets:
        part = kl.filter(pc.equal(kl.column("bucket"), bucket))
        ax.plot(_np(part, "step"), _np(part, "kl_per_token"), marker=".", label=bucket)
    ax.set_xlabel("step")
    ax.set_ylabel("KL per token")
    ax.legend(fontsize=8, title="length")
    return _save(fig, out / "kl_buckets.png")


def _plot_advantages(run: RunAnalytics, out: Path, bins: int) -> Path | None:
    try:
        hist = run.advantage_histogram(bins=bins)
    except (SchemaError, StoreError):  # the run stored no such column
        return None
    counts = hist.column("count").to_numpy()
    if counts.sum() == 0:
        return None
    fig, ax = _figure("Advantage distribution (all train steps)")
    left, right = hist.column("bin_left").to_numpy(), hist.column("bin_right").to_numpy()
    ax.bar(left, counts, width=right - left, align="edge", edgecolor="black", linewidth=0.3)
    ax.set_xlabel("advantage")
    ax.set_ylabel("completions")
    return _save(fig, out / "advantages.png")


def _first(table: pa.Table, column: str) -> Any:
    if table.num_rows == 0 or column not in table.column_names:
        return None
    return table.column(column)[0].as_py()


def _last(table: pa.Table, column: str) -> Any:
    if table.num_rows == 0 or column not in table.column_names:
        return None
    return table.column(column)[-1].as_py()


def _or_empty(query: Callable[[], pa.Table], empty: pa.Table) -> pa.Table:
    try:
        return query()
    except (SchemaError, LayoutError):  # the run lacks the columns; the summary says "-"
        return empty


def _summary(run: RunAnalytics, threshold: float, ks: tuple[int, ...]) -> dict[str, Any]:
    info = run.describe()
    train = info["kinds"].get("train", {})
    empty = pa.table({"step": pa.array([], pa.int64()), "reward": pa.array([], pa.string())})
    curve = _or_empty(run.reward_curve, empty)
    total = curve.filter(pc.equal(curve.column("reward"), "total_utils"))
    succ = _or_empty(lambda: run.success_rate(threshold=threshold, k=ks), empty)
    lengths = _or_empty(run.length_stats, empty)
    zero = _or_empty(run.zero_variance_groups, empty)
    summary = {
        "run": info["root"],
        "schema_version": info["schema_version"],
        "train_steps": train.get("steps", 0),
        "first_step": train.get("first"),
        "last_step": train.get("last"),
        "eval_steps": info["kinds"].get("eval", {}).get("steps", 0),
        "ranks": len(info["ranks"]),
        "completions": train.get("samples", 0),
        "reward_functions": ", ".join(info["reward_functions"]) or "-",
        "first_reward_mean": _first(total, "mean"),
        "last_reward_mean": _last(total, "mean"),
        "last_success_rate": _last(succ, "success_rate"),
        "last_zero_variance_groups": _last(zero, "frac_zero_variance"),
        "last_mean_length": _last(lengths, "mean_length"),
        "last_clipped_frac": _last(lengths, "clipped_frac"),
        "bytes_on_disk": sum(info["bytes"].values()),
    }
    for k in ks:
        summary[f"last_pass_at_{k}"] = _last(succ, f"pass_at_{k}")
    return summary


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _extremes_html(table: pa.Table) -> str:
    if table.num_rows == 0:
        return "<p>No completions.</p>"
    rows = []
    for r in table.to_pylist():
        text = (r["completion"] or "")[:400]
        rows.append(
            f"<tr><td>{r['which']} #{r['position']}</td><td>{_fmt(r['score'])}</td>"
            f"<td>{r['rank']}/{r['group_index']}/{r['sample_index']}</td>"
            f"<td>{html.escape(r.get('prompt') or '')[:200]}</td>"
            f"<td><pre>{html.escape(text)}</pre></td></tr>"
        )
    return (
        "<table><tr><th></th><th>score</th><th>rank/group/sample</th><th>prompt</th>"
        "<th>completion</th></tr>" + "".join(rows) + "</table>"
    )


def _write_pages(report: Report, extremes: pa.Table | None) -> None:
    s = report.summary
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in s.items()
    )
    images = "".join(
        f'<figure><img src="{p.name}" alt="{html.escape(name)}"><figcaption>'
        f"{html.escape(name)}</figcaption></figure>"
        for name, p in report.plots.items()
    )
    last = s.get("last_step")
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>maxent-arrow report</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:left;vertical-align:top}pre{white-space:pre-wrap;margin:0}"
        "figure{display:inline-block;margin:6px}img{max-width:520px}</style></head><body>"
        f"<h1>Run report: {html.escape(str(s.get('run')))}</h1>"
        f"<h2>Summary</h2><table>{rows}</table><h2>Curves</h2>{images}"
        + (
            f"<h2>Best and worst completions of step {last}</h2>{_extremes_html(extremes)}"
            if extremes is not None
            else ""
        )
        + "</body></html>"
    )
    report.html = report.out / "index.html"
    report.html.write_text(page, encoding="utf-8")
    md = ["# Run report", "", "| metric | value |", "|---|---|"]
    md += [f"| {k} | {_fmt(v).replace('|', '/')} |" for k, v in s.items()]
    md += [""] + [f"![{name}]({p.name})" for name, p in report.plots.items()]
    if report.skipped:
        md += ["", "Not plotted: " + ", ".join(f"{k} ({v})" for k, v in report.skipped.items())]
    report.markdown = report.out / "summary.md"
    report.markdown.write_text("\n".join(md) + "\n", encoding="utf-8")
    (report.out / "summary.json").write_text(json.dumps(s, indent=2, default=str) + "\n")


# Bounds of the report's options: a histogram of more bins than this draws nothing more a
# reader can see and costs memory in proportion; pass@k past this many samples is not a
# question the stored groups (K completions each) can answer.
MAX_BINS = 10_000
MAX_K = 1024


def check_report_options(*, threshold: float, k: Sequence[int], bins: int) -> tuple[int, ...]:
    """The report's options checked (an :class:`ArgumentError` naming the bad one); the
    pass@k values as ints."""
    if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= MAX_BINS:
        raise ArgumentError(f"report: bins must be an int in [1, {MAX_BINS}], got {bins!r}")
    ks = tuple(k)
    if not ks or any(
        isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_K for x in ks
    ):
        raise ArgumentError(f"report: k must be ints in [1, {MAX_K}], got {list(ks)!r}")
    if not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise ArgumentError(f"report: threshold must be a finite number, got {threshold!r}")
    return ks


def build_report(
    root: str | Path,
    out: str | Path,
    *,
    threshold: float = 0.5,
    k: tuple[int, ...] = (1, 4),
    bins: int = 50,
    progress: bool = True,
) -> Report:
    """Write the plots, ``index.html``, ``summary.md`` and ``summary.json`` into ``out``.

    Parameters
    ----------
    root
        The store directory.
    out
        Output directory (created).
    threshold, k
        Success is ``total_utils > threshold``; pass@k for each k.
    bins
        Bins of the advantage histogram.
    progress
        A tqdm bar over the reading and plotting tasks.
    """
    ks = check_report_options(threshold=threshold, k=k, bins=bins)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{out}: cannot create the report directory ({exc})") from None
    report = Report(out=out)
    with RunAnalytics(root, progress=progress) as run:
        tasks: list[tuple[str, Callable[[], Any]]] = [
            ("reading scalars", run.materialize),
            ("reward curve", lambda: _plot_rewards(run, out, "train", "reward_curve.png")),
            ("success", lambda: _plot_success(run, out, threshold, ks)),
            ("lengths", lambda: _plot_lengths(run, out)),
            ("entropy", lambda: _plot_entropy(run, out)),
            ("kl buckets", lambda: _plot_kl(run, out)),
            ("advantages", lambda: _plot_advantages(run, out, bins)),
            ("eval", lambda: _plot_rewards(run, out, "eval", "eval.png")),
            ("summary", lambda: _summary(run, threshold, ks)),
        ]
        iterator: Any = tasks
        if progress:
            from tqdm.auto import tqdm

            iterator = tqdm(tasks, desc="report", unit="part")
        extremes = None
        for name, task in iterator:
            if progress:
                iterator.set_postfix_str(name)
            try:
                result = task()
            except (SchemaError, LayoutError) as exc:  # the run lacks what this part needs
                report.skipped[name] = str(exc)
                continue
            if name == "summary":
                report.summary = result
            elif name != "reading scalars":
                if result is None:
                    report.skipped[name] = "no data"
                else:
                    report.plots[name] = result
        last = report.summary.get("last_step")
        if last is not None:
            extremes = run.extreme_completions(int(last), n=3)
    _write_pages(report, extremes)
    return report
