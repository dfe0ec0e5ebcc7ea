"""The report of a saved run: what a researcher reads without writing SQL.

``build_report(root, out)`` runs the ready-made queries of :class:`RunAnalytics` (after one
materializing scan) and writes into ``out``:

* ``index.html``: a banner when damaged files were left out (``on_error="skip"``), what the
  run did not record, the summary (facts with units, the run config, and the start, peak and
  end of each per-step figure: reward per function, train and eval, success, lengths, losses,
  KL, policy entropy, distinct completions), the curves, the eval completions beside their
  gold answers, and the best and worst prompt groups of the whole run with their gold answers;
* one full-width PNG per curve (:mod:`~maxent_arrow.analytics.figures`): ``reward_curve``,
  ``eval`` (eval reward beside the train reward), ``success``, ``losses``, ``exploration``
  (policy entropy and distinct completions), ``group_entropy`` (q and MaxEnt weights within a
  group, against ln K), ``kl``, ``lengths``, ``advantages``;
* ``summary.md`` (the same, as Markdown) and ``summary.json``
  (:meth:`~maxent_arrow.analytics.summary.Summary.to_json`).

A part the run did not record (TRL's recorder stores no q, weights or losses) is left out
and said so; it never fails the report.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa

from maxent_arrow.analytics import figures as F
from maxent_arrow.analytics.offpolicy import offpolicy_html, offpolicy_markdown, offpolicy_steps
from maxent_arrow.analytics.page import render_html, render_markdown
from maxent_arrow.analytics.run import RunAnalytics
from maxent_arrow.analytics.summary import Summary, summarize
from maxent_arrow.arguments import check_int
from maxent_arrow.errors import ArgumentError, ComputeError, LayoutError, SchemaError, StoreError
from maxent_arrow.store import ReadOnlyStore

__all__ = ["Report", "build_report"]

# The prefix of the store's warning for a damaged file it skipped (``on_error="skip"``).
_SKIPPED = "skipping damaged file: "
# Rows of the eval completions table, and best and worst groups shown of each.
EVAL_ROWS = 24
EXTREME_GROUPS = 3


@dataclass
class Report:
    """What :func:`build_report` wrote: the plot files, the pages and the summary.

    ``summary`` is the JSON form of ``run_summary`` (what ``summary.json`` holds);
    ``skipped`` names each plot not drawn and why; ``left_out`` the damaged files skipped.
    """

    out: Path
    plots: dict[str, Path] = field(default_factory=dict)
    html: Path | None = None
    markdown: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    run_summary: Summary = field(default_factory=Summary)
    skipped: dict[str, str] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    offpolicy: list[dict[str, Any]] = field(default_factory=list)


CAPTIONS = {
    "compare": "The eval reward of this run beside the runs it is compared with (e.g. a policy "
    "trained offline from this run's stored rollouts), step by step.",
    "reward curve": "Mean reward per train step of each reward function and of the weighted "
    "total U, with a band: for a reward of many values the 5-95 % of the step's completions; "
    "for one of few values (0/1 correctness) the 95 % interval of the step's mean, as its "
    "quantiles are its values and would jump between them.",
    "eval": "Mean reward of each function on the eval steps (solid) beside the same function "
    "on the train steps (dashed): the gap is what training did not generalise.",
    "success": "Share of completions that succeed, of groups with at least one success, "
    "pass@k, and the share of groups whose completions all scored the same (no signal).",
    "losses": "The loss components logged per train step (mean over ranks); for a trainer "
    "whose step rows hold none (TRL), the loss it logged (trainer_metrics), one line per "
    "update when a round of rollouts served several optimizer steps.",
    "exploration": "Is the policy still exploring? Its entropy per token, and the share of "
    "distinct completions in a group (1: all K differ; 1/K: all the same). Both fall when "
    "the policy collapses.",
    "group entropy": "Entropy of the q-distribution and of the MaxEnt weights within a group, "
    "against ln K (uniform): how evenly each group's weight is spread. It stays near ln K by "
    "construction and says nothing about the policy's own entropy (see Exploration).",
    "kl": "KL divergence to the reference model per token: over all completions (black) and "
    "per completion-length bucket.",
    "lengths": "Completion length in tokens (mean, median, 95th percentile, max) and the "
    "share of completions cut at the length cap (right axis).",
    "advantages": "Histogram of the advantages of every train completion.",
}

# Bounds of the report's options: a histogram of more bins than this draws nothing more a
# reader can see and costs memory in proportion; pass@k past this many samples is not a
# question the stored groups (K completions each) can answer.
MAX_BINS = 10_000
MAX_K = 1024
# A reward that takes at most this many values over the run is drawn with the interval of
# its mean, not its quantiles (figures.reward_band).
DISCRETE_VALUES = 10


def check_report_options(*, threshold: float, k: Sequence[int], bins: int) -> tuple[int, ...]:
    """The report's options checked (an :class:`ArgumentError` naming the bad one); the
    pass@k values as ints."""
    check_int(bins, "report: bins", low=1, high=MAX_BINS)
    ks = tuple(check_int(x, "report: k", low=1, high=MAX_K) for x in k)
    if not ks:
        raise ArgumentError(f"report: k: expected at least one int in 1..{MAX_K}, got none")
    if not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise ArgumentError(f"report: threshold must be a finite number, got {threshold!r}")
    return ks


def build_report(
    root: str | Path | Any,
    out: str | Path,
    *,
    threshold: float = 0.5,
    k: tuple[int, ...] = (1, 4),
    bins: int = 50,
    progress: bool = True,
    compare: dict[str, Any] | None = None,
) -> Report:
    """Write the plots, ``index.html``, ``summary.md`` and ``summary.json`` into ``out``.

    Parameters
    ----------
    root
        The store: a directory or URI, or an open ``ReadOnlyStore`` (whose ``on_error``
        applies: under ``"skip"`` a damaged file is left out, and the page says which).
    out
        Output directory (created).
    threshold, k
        Success is ``total_utils > threshold``; pass@k for each k.
    bins
        Bins of the advantage histogram.
    progress
        A tqdm bar over the reading and plotting tasks.
    compare
        Other runs (label -> store) whose eval reward curves are plotted beside this run's.

    Raises
    ------
    ArgumentError
        ``out`` is a store's directory or inside one (this run's or a compared run's), and
        nothing is written.
    """
    ks = check_report_options(threshold=threshold, k=k, bins=bins)
    out = Path(out)
    root = root if isinstance(root, ReadOnlyStore) else ReadOnlyStore(root)
    for store in (root, *(compare or {}).values()):
        _check_out(out, store)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{out}: cannot create the report directory ({exc})") from None
    report = Report(out=out)
    tables: dict[str, pa.Table] = {}
    caught: list[warnings.WarningMessage] | None = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with RunAnalytics(root, progress=progress) as run:
                tables = _build(
                    run, report, threshold=threshold, ks=ks, bins=bins, progress=progress
                )
                # The "Off-policy" section (analytics/offpolicy.py; torch only for runs that
                # stored sampler log-probs or kept sets).
                try:
                    report.offpolicy = offpolicy_steps(run.store)
                except (SchemaError, LayoutError, ComputeError, ArgumentError) as exc:
                    # (ArgumentError: a run without train steps)
                    report.run_summary.absent["off-policy"] = str(exc)
    finally:
        # Shown to the caller as they would have been without the report's recording (out
        # of the recording context, else they would be recorded again).
        for item in caught or []:
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    report.left_out = list(
        dict.fromkeys(
            str(w.message).removeprefix(_SKIPPED)
            for w in caught or []
            if str(w.message).startswith(_SKIPPED)
        )
    )
    report.run_summary.left_out = report.left_out
    if compare:
        curves = {"this run": tables.get("eval_reward", pa.table({}))}
        for label, other in compare.items():
            with RunAnalytics(other, progress=False) as run:
                curves[label] = run.reward_curve(kind="eval")
        if all("reward" in c.column_names for c in curves.values()):
            result = F.plot_compare(curves, out)
            if isinstance(result, Path):
                report.plots["compare"] = result
            else:
                report.skipped["compare"] = result
    _write_pages(report, tables)
    return report


def _check_out(out: Path, store: Any) -> None:
    """Refuse an ``out`` that is the directory of ``store`` (a store or where one is) or
    inside it: a store holds only what its commits write, and its readers write nothing
    there (``docs/commit-protocol.md``)."""
    root = (store if isinstance(store, ReadOnlyStore) else ReadOnlyStore(store)).root
    if not isinstance(root, Path):
        return  # a store on an object store: ``out`` is a local directory
    where, inside = out.resolve(), root.resolve()
    if where == inside or inside in where.parents:
        what = "the store's directory" if where == inside else "inside the store"
        raise ArgumentError(
            f"report: out {str(out)!r} is {what} {str(root)!r}; a report writes its plots and "
            "pages there, among the files only the store's commits write: choose a directory "
            "outside the store"
        )


@dataclass
class _Read:
    """What the report read: the tables by name, the parts the run did not record (part ->
    why), the tables missing (name -> why), and the facts (``info``, ``config``, the
    ``discrete`` reward sources)."""

    tables: dict[str, pa.Table] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    found: dict[str, Any] = field(default_factory=dict)


def _build(
    run: RunAnalytics,
    report: Report,
    *,
    threshold: float,
    ks: tuple[int, ...],
    bins: int,
    progress: bool,
) -> dict[str, pa.Table]:
    """Run the queries, draw the plots and summarise; returns the tables (by name)."""
    read = _read(run, threshold=threshold, ks=ks, bins=bins, progress=progress)
    _draw(report, read, threshold=threshold, ks=ks, progress=progress)
    found = read.found
    report.run_summary = summarize(
        found["info"], found["config"], read.tables, threshold=threshold, ks=ks,
        absent=read.absent,
    )  # fmt: skip
    return read.tables


def _read(
    run: RunAnalytics, *, threshold: float, ks: tuple[int, ...], bins: int, progress: bool
) -> _Read:
    """Every query of the report, after one materializing scan."""
    read = _Read()
    tables, found = read.tables, read.found

    def describe() -> None:
        found["info"] = run.describe()
        found["config"] = run.run_config()

    # Table name -> (the part of the run it shows, the query).
    queries: dict[str, tuple[str, Callable[[], pa.Table]]] = {
        "reward": ("rewards", run.reward_curve),
        "eval_reward": ("eval rewards", lambda: run.reward_curve(kind="eval")),
        "success": ("success", lambda: run.success_rate(threshold=threshold, k=ks)),
        "zero_variance": ("reward spread", run.zero_variance_groups),
        "unscored": ("unscored completions", run.unscored),
        "counts": ("group counts", run.group_counts),
        "lengths": ("lengths", run.length_stats),
        "losses": ("loss components", run.loss_curve),
        "policy_entropy": ("policy entropy", run.policy_entropy_curve),
        "distinct": ("distinct completions", run.distinct_completions),
        "group_entropy": ("q and MaxEnt weights", run.entropy_curve),
        "kl_buckets": ("KL by length", run.kl_by_length_bucket),
        "advantages": ("advantages", lambda: run.advantage_histogram(bins=bins)),
        "evals": ("eval completions", lambda: run.eval_completions(limit=EVAL_ROWS)),
        "extremes": ("best and worst groups", lambda: run.group_extremes(n=EXTREME_GROUPS)),
    }

    def run_query(name: str) -> None:
        what, call = queries[name]
        try:
            tables[name] = call()
        except (SchemaError, LayoutError) as exc:  # the run did not record this
            read.absent[what] = read.missing[name] = str(exc).split(": ", 1)[-1]

    def trainer_log() -> None:  # (a run without one is no part missing: the step rows say)
        try:
            tables["trainer"] = run.trainer_curve()
        except (SchemaError, LayoutError):
            pass
        found["discrete"] = {
            name for name, n in run.distinct_rewards().items() if n <= DISCRETE_VALUES
        }

    tasks = [run.materialize, describe, trainer_log,
             *(partial(run_query, name) for name in queries)]  # fmt: skip
    for task in _bar(tasks, "report: reading", "query", progress):
        task()
    if _no_losses(tables.get("losses"), tables.get("trainer")):
        read.absent["loss components"] = "the step rows hold no loss values, the trainer none"
    return read


def _no_losses(losses: pa.Table | None, trainer: pa.Table | None) -> bool:
    """Whether the run recorded no loss at all: none in its step rows (TRL's hold none), none
    in the trainer's log."""
    if trainer is not None and trainer.column("loss").null_count < trainer.num_rows:
        return False
    return losses is not None and all(
        losses.column(c).null_count == losses.num_rows
        for c in losses.column_names
        if c not in ("step", "num_ranks")
    )


def _draw(
    report: Report, read: _Read, *, threshold: float, ks: tuple[int, ...], progress: bool
) -> None:
    """Each plot the tables allow (its PNG in ``report.plots``), else why not."""
    out, t = report.out, read.tables
    discrete = read.found["discrete"]
    # Plot name -> (the tables it draws, how).
    plots: dict[str, tuple[tuple[str, ...], Callable[[], Path | str]]] = {
        "reward curve": (("reward",), lambda: F.plot_rewards(t["reward"], out, discrete=discrete)),
        "eval": (
            ("eval_reward", "reward"),
            lambda: F.plot_eval(t["eval_reward"], t["reward"], out),
        ),
        "success": (
            ("success", "zero_variance"),
            lambda: F.plot_success(
                t["success"], t["zero_variance"], out, threshold=threshold, ks=ks
            ),
        ),
        "losses": (("losses",), lambda: F.plot_losses(t["losses"], out, t.get("trainer"))),
        "exploration": (
            ("distinct",),
            lambda: F.plot_exploration(t.get("policy_entropy"), t["distinct"], out),
        ),
        "group entropy": (
            ("group_entropy",),
            lambda: F.plot_group_entropy(t["group_entropy"], out),
        ),
        "kl": (
            ("losses", "kl_buckets"),
            lambda: F.plot_kl(t["losses"], t["kl_buckets"], out, t.get("trainer")),
        ),
        "lengths": (("lengths",), lambda: F.plot_lengths(t["lengths"], out)),
        "advantages": (("advantages",), lambda: F.plot_advantages(t["advantages"], out)),
    }
    for name in _bar(list(plots), "report: plotting", "plot", progress):
        needs, plot = plots[name]
        lacking = [read.missing[n] for n in needs if n not in t]
        result = lacking[0] if lacking else plot()
        if isinstance(result, Path):
            report.plots[name] = result
        else:
            report.skipped[name] = result


def _bar(items: Sequence[Any], desc: str, unit: str, progress: bool) -> Any:
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit=unit)


def _write_pages(report: Report, tables: dict[str, pa.Table]) -> None:
    summary = report.run_summary
    report.summary = summary.to_json()
    captions = {name: CAPTIONS[name] for name in report.plots}
    parts = dict(evals=tables.get("evals"), extremes=tables.get("extremes"))
    page = render_html(summary, report.plots, captions, report.skipped, **parts)
    end = "</main></body></html>"
    page = page.replace(end, offpolicy_html(report.offpolicy) + "\n" + end, 1)
    report.html = report.out / "index.html"
    report.html.write_text(page, encoding="utf-8")
    report.markdown = report.out / "summary.md"
    markdown = render_markdown(summary, report.plots, captions, report.skipped, **parts)
    extra = offpolicy_markdown(report.offpolicy)
    report.markdown.write_text(markdown + ("\n" + extra if extra else ""), encoding="utf-8")
    if extra:
        report.summary["offpolicy"] = report.offpolicy
    (report.out / "summary.json").write_text(
        json.dumps(report.summary, indent=2, default=str, allow_nan=False) + "\n", encoding="utf-8"
    )
