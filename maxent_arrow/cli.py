"""``maxent-arrow``: the command line. Each subcommand is a thin call into the library.

Commands, one row each of the table :data:`COMMANDS` (from which the parser, ``--help`` and
this list are written; ``maxent-arrow COMMAND --help`` says more; ``[writes]``: it changes the
store, under the store's lock)::

    demo [...]                        the end-to-end demo (maxent_arrow.demo.job)
    train --from-store RUN --out OUT  train a policy from a demo run's stored rollouts
    inspect RUN                       schema version, steps, ranks, rows, sizes, config
    query RUN SQL                     DuckDB SQL over the views groups, samples, steps
    report RUN --out DIR              PNG plots, index.html, summary.md
    offpolicy RUN                     per step: staleness, IS diagnostics, kept mass
    verify RUN                        check every file (sizes, checksums, rows)
    repair RUN                        move crash leftovers into RUN/quarantine/ [writes]
    compact RUN                       merge per-append files atomically [writes]
    checkpoint RUN                    write a checkpoint of the commit log [writes]
    upgrade RUN                       give a store of an older format a commit log [writes]
    files RUN                         the live files of a table, for a plain reader
    tail RUN                          each step as its commit lands (--since resumes)
    export RUN --to ipc|hf DIR        Arrow IPC files or a HF datasets dataset
    view RUN                          a local read-only web explorer (127.0.0.1)

Exit codes (scripts can rely on them):

* 0: success;
* 1: a problem with the data: ``verify`` found damage, a store or file that cannot be read, a
  schema conflict, a query that failed while it ran (a value that does not convert, the
  timeout, the memory limit);
* 2: usage error (unknown command or option, bad argument; a query that DuckDB cannot parse or
  bind: its Parser, Binder and Catalog errors, :mod:`maxent_arrow.analytics.sqlerrors`; a
  query that is empty, several statements, or not a read);
* 3: an optional dependency is missing (the message names the ``pip install`` to run);
* 4: an unexpected internal error (a bug; the message says so);
* 130: interrupted (Ctrl-C).

Errors are one line on stderr (``maxent-arrow <command>: error: ...``), never a traceback;
set ``MAXENT_ARROW_DEBUG=1`` to get the traceback as well.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import logging
import math
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from maxent_arrow import analytics, demo, explorer, store
from maxent_arrow.errors import ArgumentError, MaxentArrowError, MissingExtraError, QueryError

__all__ = [
    "COMMANDS",
    "EXIT_DATA",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_EXTRA",
    "EXIT_OK",
    "EXIT_USAGE",
    "Command",
    "command_list",
    "main",
]

EXIT_OK = 0
EXIT_DATA = 1
EXIT_USAGE = 2
EXIT_MISSING_EXTRA = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130
EXACT_TOLERANCE = 1e-6  # train --exact: relative error of each replayed loss


def _progress(args: argparse.Namespace) -> bool:
    # tqdm bars on an interactive terminal by default; --progress/--no-progress force it.
    return sys.stderr.isatty() if args.progress is None else bool(args.progress)


@contextlib.contextmanager
def _files_bar(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A tqdm bar on stderr with the total and the rate (files/s), fed by the library's
    ``progress(done, total)`` callback (``verify``, ``compact``); ``None`` when disabled."""
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    bars: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc=description, unit="file"))
        bar = bars[0]
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()


def _print_json(value: Any) -> None:
    text = json.dumps(analytics.finite(value), indent=2, default=str, allow_nan=False)
    sys.stdout.write(text + "\n")


def _store(
    args: argparse.Namespace, *, attempts: Literal["effective", "all", "superseded"] = "effective"
) -> Any:
    """An existing rollout store, opened for reading (nothing of the write side loads)."""
    timeout = getattr(args, "timeout", None)
    return store.ReadOnlyStore(
        args.run, on_error=args.on_error, query_timeout=timeout, attempts=attempts
    )


def _writable_store(args: argparse.Namespace) -> Any:
    """An existing rollout store, opened to tidy (``compact``, ``repair``); never created."""
    return store.RolloutStore(args.run, on_error=args.on_error, lock_timeout=args.lock_timeout)


# ---------------------------------------------------------------------- commands


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = analytics.describe_run(_store(args))
    if args.json:
        _print_json(info)
        return EXIT_OK
    recorded = info["run_config"]
    config = recorded["config"] or info["config"] or {}
    ranks = info["ranks"]  # the rank ids; the count is their number
    out = [
        f"run:             {info['root']}",
        f"format:          {info['format'] or '-'} (schema {info['schema_version'] or '-'}; "
        f"files: {', '.join(info['file_schema_versions']) or '-'})",
        f"created:         {info['created_at'] or '-'}",
        *_history_lines(info.get("history")),
        f"trainer:         {config.get('trainer') or '-'}",
        f"model:           {config.get('model') or '-'}",
        f"tokenizer:       {analytics.tokenizer_text(config.get('tokenizer')) or '-'}",
        f"ranks:           {len(ranks)}"
        + (f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else ""),
        f"reward funcs:    {', '.join(info['reward_functions']) or '-'}",
        f"group rows:      {info['group_rows']:,}",
        f"files:           {info['files']['groups']} group, {info['files']['steps']} step",
        f"bytes:           {info['bytes']['groups']:,} groups, {info['bytes']['steps']:,} steps",
    ]
    for kind, k in info["kinds"].items():
        out.append(
            f"{kind + ' steps:':<17}{k['steps']} (steps {k['first']}..{k['last']}, "
            f"{k['groups']:,} groups, {k['samples']:,} completions)"
        )
    where = (
        f" (recorded with step {recorded['step']})"
        if recorded["step"] is not None
        else " (the manifest's: no step row records one)"
    )
    out.append(f"config{where}:")
    out.append("  " + json.dumps(config, sort_keys=True, default=str))
    if recorded["changed"]:
        out.append(f"  changed during the run: {', '.join(recorded['changed'])}")
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


def _history_lines(history: dict[str, Any] | None) -> list[str]:
    """``inspect``'s account of the commit log: store version, attempts, superseded steps and
    record tables."""
    if history is None:
        return ["history:         - (a store without a commit log)"]
    attempts = history["attempts"]
    # Each attempt's status (how it ended: analytics.attempts), not the mode it began with.
    shown = "; ".join(
        f"{a['id']} ({a['role']}, {analytics.status_text(a)}"
        + (f", resumed at step {a['resume_from']}" if a["resume_from"] else "")
        + ")"
        for a in attempts[-3:]
    )
    more = f"{len(attempts) - 3} more; " if len(attempts) > 3 else ""
    gone = history["superseded_steps"]
    out = [
        f"commit log:      version {history['log_version']}",
        f"attempts:        {len(attempts)}: {more}{shown or '-'}",
        f"superseded:      {len(gone)} steps"
        + (f" ({gone[0]}..{gone[-1]}; the superseded view)" if gone else ""),
    ]
    if history["records"]:
        tables = ", ".join(f"{n} ({rows:,} rows)" for n, rows in sorted(history["records"].items()))
        out.append(f"record tables:   {tables}")
    return out


def _jsonable_rows(table: Any) -> list[dict[str, Any]]:
    return table.to_pylist()


def _csv(table: Any) -> str:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    # CSV has no nested types: lists, structs and maps are written as JSON text; a type the
    # CSV writer cannot print (an interval) as its Python text.
    columns = []
    for field in table.schema:
        column = table.column(field.name)
        if pa.types.is_nested(field.type):
            column = pa.array(
                [None if v is None else json.dumps(v, default=str) for v in column.to_pylist()],
                pa.string(),
            )
        elif pa.types.is_interval(field.type):
            column = pa.array(
                [None if v is None else str(v) for v in column.to_pylist()], pa.string()
            )
        columns.append(column)
    flat = pa.table(columns, names=table.column_names)
    sink = io.BytesIO()
    pacsv.write_csv(flat, sink)
    return sink.getvalue().decode()


def _readable(run: Any, table: Any, max_rows: int) -> str:
    text = run.views.render(table, max_rows=max_rows)
    if table.num_rows > max_rows:
        text += f"({table.num_rows:,} rows, showing {max_rows}; --json or --csv give all)\n"
    return text


def _cmd_query(args: argparse.Namespace) -> int:
    analytics.check_sql(args.sql)  # a usage error, before the store is opened
    with analytics.RunAnalytics(_store(args), materialize=args.materialize) as run:
        table = run.sql(args.sql)
        if args.json:
            _print_json(_jsonable_rows(table))
        elif args.csv:
            sys.stdout.write(_csv(table))
        else:
            sys.stdout.write(_readable(run, table, args.max_rows))
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    report = analytics.build_report(
        _store(args),
        args.out,
        threshold=args.threshold,
        k=tuple(args.k),
        bins=args.bins,
        progress=_progress(args),
    )
    result = {
        "out": str(report.out),
        "html": str(report.html),
        "markdown": str(report.markdown),
        "plots": {name: str(p) for name, p in report.plots.items()},
        "skipped": report.skipped,
        "left_out": report.left_out,
        "summary": report.summary,
    }
    if args.json:
        _print_json(result)
    else:
        sys.stdout.write(
            f"wrote {len(report.plots)} plots, {report.html} and {report.markdown}\n"
            + "".join(f"  not plotted: {k} ({v})\n" for k, v in report.skipped.items())
            + (
                f"  data left out: {len(report.left_out)} damaged file(s) skipped; the report "
                "says which\n"
                if report.left_out
                else ""
            )
        )
    return EXIT_OK


def _cmd_offpolicy(args: argparse.Namespace) -> int:
    # Loads torch only when the run stored what needs it (sampler log-probs, kept sets).
    role = None if args.role == "all" else args.role
    reports = analytics.offpolicy_steps(_store(args), kind=args.kind, steps=args.steps, role=role)
    if args.json:
        _print_json(reports)
    else:
        sys.stdout.write(analytics.offpolicy_text(reports))
    return EXIT_OK


def _cmd_train(args: argparse.Namespace) -> int:
    """``train --from-store RUN``: a policy trained from a demo run's stored rollouts
    (:func:`maxent_arrow.demo.train_offline`; torch loads here, when it runs). It reads RUN
    and writes only under ``--out`` (what it consumed: its store's ``source_lifecycle``)."""
    source = demo.run_directory(args.from_store)
    new = demo.create_run_dir(args.out)
    with demo.removed_on_failure(new):  # a failed run leaves no directory of its own behind
        result = demo.train_offline(
            source,
            new.path,
            steps=args.steps,
            replay_ratio=args.replay_ratio,
            seed=args.seed,
            eval_prompts=args.eval_prompts,
            eval_every=args.eval_every,
            exact=args.exact,
            threads=args.threads,
        )
    errors = [s.loss_error for s in result.steps if s.logged_loss == s.logged_loss]
    summary = {
        "out": str(args.out),
        "steps": len(result.steps),
        "seconds": result.seconds,
        "dropped": sum(sum(s.dropped.values()) for s in result.steps),
        "accuracy": [[step, accuracy] for step, accuracy in result.accuracy],
        "max_loss_error": max(errors) if errors else None,
        "losses": [[s.step, s.loss, analytics.finite(s.logged_loss)] for s in result.steps],
    }
    if args.json:
        _print_json(summary)
    else:
        lines = [f"trained {summary['steps']} steps from the store in {result.seconds:.1f}s"]
        if result.accuracy:
            (s0, a0), (s1, a1) = result.accuracy[0], result.accuracy[-1]
            lines.append(f"held-out accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})")
        if errors:
            lines.append(f"losses vs the logged ones: max relative error {max(errors):.2e}")
        sys.stdout.write("".join(line + "\n" for line in lines))
    if args.exact and (not errors or max(errors) > EXACT_TOLERANCE):
        _error(
            "train",
            f"--exact: the replayed losses differ from the logged ones by up to "
            f"{max(errors):.2e} (tolerance {EXACT_TOLERANCE:g})"
            if errors
            else "--exact: the run logged no loss to compare with",
        )
        return EXIT_DATA
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    with _files_bar("verifying", _progress(args)) as progress:
        report = _store(args).verify(progress=progress)
    if args.json:
        _print_json(
            {
                "ok": report.ok,
                "checked": report.checked,
                "problems": [{"path": str(p.path), "problem": p.problem} for p in report.problems],
                "notes": [{"path": str(p.path), "problem": p.problem} for p in report.notes],
            }
        )
    else:
        sys.stdout.write(str(report) + "\n")
    return EXIT_OK if report.ok else EXIT_DATA


def _live_files(run: Any) -> set[str]:
    """The committed group and step files of ``run`` (what a compaction replaces and writes)."""
    return {str(p) for table in ("groups", "steps") for p in run.committed_files(table)}


def _cmd_compact(args: argparse.Namespace) -> int:
    """Merge; then say what it wrote and what that replaced, counted from the committed
    files before and after (a segment is a group file and a step file)."""
    run = _writable_store(args)
    before = _live_files(run)
    with _files_bar("compacting", _progress(args)) as progress:
        made = run.compact(
            kind=args.kind,
            max_steps=args.max_steps,
            drop_superseded=args.drop_superseded,
            progress=progress,
        )
    after = _live_files(run)
    written, replaced = sorted(after - before), sorted(before - after)
    if args.json:
        _print_json(
            {
                "compacted": [str(p) for p in made],
                "written": written,
                "replaced": len(replaced),
            }
        )
    else:
        sys.stdout.write(
            f"{len(made)} segment{'s' * (len(made) != 1)} written ({len(written)} "
            f"file{'s' * (len(written) != 1)}), replacing {len(replaced)} "
            f"file{'s' * (len(replaced) != 1)}\n" + "".join(f"  {p}\n" for p in written)
        )
    return EXIT_OK


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    version = _writable_store(args).checkpoint()
    where = f"{args.run.rstrip('/')}/log/_checkpoint.parquet"
    if args.json:
        _print_json({"version": version, "checkpoint": where})
    else:
        sys.stdout.write(f"checkpoint of log version {version}: {where}\n")
    return EXIT_OK


def _cmd_upgrade(args: argparse.Namespace) -> int:
    """A store written before the commit log given one (nothing rewritten); a path that is
    not a store, a damaged store or a store another process holds: exit 2, nothing changed."""
    try:
        report = store.upgrade(args.run, lock_timeout=args.lock_timeout or 0)
    except (MaxentArrowError, OSError) as exc:
        _error("upgrade", _message(exc))
        return EXIT_USAGE
    if args.json:
        _print_json(
            {
                "uri": report.uri,
                "upgraded": report.upgraded,
                "from_format": report.from_format,
                "to_format": report.to_format,
                "units": report.units,
                "log_version": report.log_version,
            }
        )
    else:
        sys.stdout.write(str(report) + "\n")
    return EXIT_OK


def _cmd_files(args: argparse.Namespace) -> int:
    live = _store(args, attempts=args.attempts).live_files(args.table)
    if args.json:
        _print_json([{"path": str(p), "where": w} for p, w in live])
    else:
        sys.stdout.write("".join(f"{p}\t{w}\n" if w else f"{p}\n" for p, w in live))
    return EXIT_OK


def _cmd_repair(args: argparse.Namespace) -> int:
    report = _writable_store(args).repair()
    if args.json:
        _print_json(
            {
                "moved": [{"path": str(p.path), "why": p.problem} for p in report.moved],
                "kept": [{"path": str(p.path), "why": p.problem} for p in report.kept],
            }
        )
    else:
        sys.stdout.write(str(report) + "\n")
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    fn = analytics.export_ipc if args.to == "ipc" else analytics.export_hf
    made = fn(_store(args), args.dir, progress=_progress(args))
    if args.json:
        _print_json({"format": args.to, "written": [str(p) for p in made]})
    else:
        sys.stdout.write("".join(f"wrote {p}\n" for p in made))
    return EXIT_OK


def _tail_line(event: Any) -> str:
    """One readable line per tail event (``--json`` prints the event's JSON instead)."""
    if event.event == "superseded":
        units = event.superseded
        steps = sorted({u["step"] for u in units})
        shown = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
        point = "" if event.resume_from is None else f" (resumed at step {event.resume_from})"
        return (
            f"v{event.version}  superseded  {len(units)} unit(s), steps {shown}, by attempt "
            f"{event.attempt}{point}"
        )
    # A few figures; --json carries every scalar of the step rows.
    shown = [(k, event.figures.get(k)) for k in ("num_samples", "reward_mean", "total_loss")]
    figures = "  ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown if v is not None
    )
    return (
        f"v{event.version}  step {event.step}  rank {event.rank}  {event.kind}  "
        f"groups {event.num_groups}  {figures}  attempt {event.attempt}  {event.unit}"
    )


def _tail_banner(run: Any, args: argparse.Namespace) -> str:
    """What ``tail`` says first, on stderr: what it follows and from where. Without
    ``--since`` it prints only what is committed from now on, which on a finished run is
    nothing: the banner says so, and how to see the steps already there."""
    how = store.watches(run.backend)
    start = f"following {run.uri} ({how})"
    account = run.catalog.account() if args.since is None else None
    if account is not None:
        start += (
            f" from log version {account['log_version']}, its last commit: only what is "
            "committed from now on is printed (a finished run prints nothing more; --since 0 "
            "prints its steps so far)"
        )
    return f"maxent-arrow tail: {start}; resume with --since VERSION\n"


def _cmd_tail(args: argparse.Namespace) -> int:
    run = _store(args)
    events = run.tail(kind=args.kind, since=args.since, poll=args.poll, timeout=args.timeout)
    sys.stderr.write(_tail_banner(run, args))
    sys.stderr.flush()
    try:
        for event in events:
            line = json.dumps(analytics.finite(event.to_json()), default=str) if args.json else None
            sys.stdout.write((line or _tail_line(event)) + "\n")
            sys.stdout.flush()  # a pipe's reader gets each event as it lands
    finally:
        events.close()
    return EXIT_OK


def _cmd_view(args: argparse.Namespace) -> int:
    explorer.serve(
        args.run,
        host=args.host,
        port=args.port,
        other=args.compare,
        on_error=args.on_error,
        export_dir=args.export_dir,
    )
    return EXIT_OK


# ---------------------------------------------------------------------- arguments


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _log_version(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a log version, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a log version >= 0, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def _json_option(p: argparse.ArgumentParser, help_text: str = "print JSON") -> None:
    p.add_argument("--json", action="store_true", help=help_text)


def _timeout_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="stop a query that runs longer (exit 1); memory and threads are bounded "
        "by the machine's size in any case",
    )


def _lock_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lock-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="give up waiting for the store lock after this long (exit 1, naming the "
        "pid and host that hold it); default: wait, saying whom for after 2 s",
    )


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from-store",
        required=True,
        metavar="RUN",
        help="the demo run directory (its store/ and snapshots/), or its store",
    )
    p.add_argument("--out", required=True, type=Path, help="a new or empty directory")
    p.add_argument("--steps", type=int, default=None, help="updates (default: the run's)")
    p.add_argument(
        "--replay-ratio",
        type=float,
        default=1.0,
        help="replayed share of each update's groups (1: offline; the rest generated fresh)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts (0: none)")
    p.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps")
    p.add_argument(
        "--exact",
        action="store_true",
        help="replay the run's updates exactly (stored steps in order, staleness 0, weights "
        "from its snapshots): exit 1 unless each loss equals the logged one",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    _json_option(p)


def _query_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sql", metavar="SQL", help="the query")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    fmt.add_argument("--csv", action="store_true", help="print CSV (nested values as JSON)")
    p.add_argument("--max-rows", type=int, default=40, help="rows in the readable table")
    p.add_argument(
        "--materialize",
        action="store_true",
        help="also build the in-memory sample_scalars table (one scan) before the query",
    )
    _timeout_option(p)


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--threshold", type=float, default=0.5, help="success: reward > this")
    p.add_argument("--k", type=int, nargs="+", default=[1, 4], help="pass@k for these k")
    p.add_argument("--bins", type=int, default=50, help="advantage histogram bins")
    _json_option(p, "print what was written as JSON")
    _timeout_option(p)


def _offpolicy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default="train", help="the steps of this kind (default train)")
    p.add_argument("--steps", type=int, nargs="+", default=None, help="only these steps")
    p.add_argument(
        "--role",
        default="trainer",
        help="whose lifecycle records say when a group was trained (default trainer: the run's "
        "own; e.g. sampler, a policy trained from the store; all: every role's)",
    )
    _json_option(p)


def _tidy_arguments(p: argparse.ArgumentParser) -> None:
    """``--json`` and the store lock's ``--lock-timeout``: the last options of the commands
    that tidy the store (``repair``, ``compact``, ``checkpoint``)."""
    _json_option(p)
    _lock_option(p)


def _compact_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default=None, help="only this kind (train/eval)")
    p.add_argument("--max-steps", type=int, default=None, help="steps per merged file")
    p.add_argument(
        "--drop-superseded",
        action="store_true",
        help="also retire the steps later attempts superseded (a resume, a re-run): they "
        "leave the history through the commit log",
    )
    _tidy_arguments(p)


def _upgrade_arguments(p: argparse.ArgumentParser) -> None:
    _json_option(p)
    p.add_argument(
        "--lock-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="wait this long for another process's store lock (default: do not wait)",
    )


def _files_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", default="groups", help="groups (default), steps or records:NAME")
    p.add_argument(
        "--attempts",
        choices=["effective", "all", "superseded"],
        default="effective",
        help="which history (default: effective, what the model trained on)",
    )
    _json_option(p)


def _tail_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default=None, help="only this kind (train/eval)")
    p.add_argument(
        "--since",
        type=_log_version,
        default=None,
        metavar="VERSION",
        help="resume after this log version (0: from the first commit; default: from now)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="stop (exit 0) when no step came for this long; default: run until Ctrl-C",
    )
    p.add_argument(
        "--poll",
        type=_seconds,
        default=0.25,
        metavar="SECONDS",
        help="read the log's next entry this often when nothing wakes the tail (object "
        "stores, no inotify; with inotify a safety net); default 0.25",
    )
    _json_option(p, "one JSON object per line")


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", required=True, choices=["ipc", "hf"], help="target format")
    p.add_argument("dir", metavar="DIR", help="output directory (new or empty)")
    _json_option(p)


def _view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; another one is reachable by others, "
        "with a warning)",
    )
    p.add_argument(
        "--port", type=_port, default=analytics.DEFAULT_VIEW_PORT, help="port (0: any free one)"
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="RUN2",
        help="a second run (its directory or its store) for the compare page",
    )
    p.add_argument(
        "--export-dir",
        default=None,
        metavar="DIR",
        help="let a step's selection be exported here as a Hugging Face dataset folder "
        "(outside the store; default: export is off)",
    )


def _common_arguments(p: argparse.ArgumentParser, *, store: bool) -> None:
    """What every command but ``demo`` takes: the store (``RUN``, ``--on-error``) where it
    reads one, and ``--progress``."""
    if store:
        p.add_argument(
            "run",
            metavar="RUN",
            help="the run directory or its store (RUN/store; a directory or a URI)",
        )
        p.add_argument(
            "--on-error",
            choices=["raise", "skip"],
            default="raise",
            help="a damaged or missing file: fail (default) or skip it with a warning",
        )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tqdm progress bars on stderr (default: when stderr is a terminal)",
    )


# ---------------------------------------------------------------------- the command table


@dataclass(frozen=True)
class Command:
    """One ``maxent-arrow`` command, a row of :data:`COMMANDS`.

    Attributes
    ----------
    name
        The command word.
    summary
        One line, for the lists of commands (this module's docstring, ``docs/architecture.md``).
    help
        Its line in ``maxent-arrow --help`` and the description of its own ``--help``.
    arguments
        Adds its own arguments to its parser (after :func:`_common_arguments`); ``None`` for a
        command that reads its arguments with a parser of its own (``demo``).
    handler
        Runs it: the parsed arguments (for ``demo``: ``argv``, what follows the command word)
        to an exit code.
    writes
        It changes the store, under the store's lock (so it takes ``--lock-timeout``).
    store
        It takes the store as ``RUN`` (and ``--on-error``).
    """

    name: str
    summary: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None] | None
    handler: Callable[[argparse.Namespace], int]
    writes: bool = False
    store: bool = True

    def synopsis(self) -> str:
        """The command word and what it must be given: ``export RUN --to ipc|hf DIR``."""
        if self.arguments is None:
            return f"{self.name} [...]"
        parser = argparse.ArgumentParser(add_help=False)
        _common_arguments(parser, store=self.store)
        self.arguments(parser)
        words = [self.name]
        for action in parser._actions:
            if action.option_strings and not action.required:
                continue
            value = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            if action.choices is not None:
                value = "|".join(map(str, action.choices))
            words.append(f"{action.option_strings[0]} {value}" if action.option_strings else value)
        return " ".join(words)


def _cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: its arguments (``args.argv``) go to the job's own parser, which needs torch."""
    try:
        main_ = demo.main
    except ImportError as exc:
        _error("demo", f"the demo cannot be loaded ({exc})")
        return EXIT_MISSING_EXTRA
    try:
        # What exists, for the demo's closing lines (they suggest only commands that exist).
        return int(main_(args.argv, commands=tuple(c.name for c in COMMANDS)) or 0)
    except SystemExit as exc:  # the demo's own argparse (--help, a usage error)
        if isinstance(exc.code, int | None):
            return int(exc.code or 0)
        # SystemExit("message"): Python would print it; say it as every error is said.
        _error("demo", str(exc.code).removeprefix("error: "))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("demo", "interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # one line with its message, as every other command
        return _exit_code("demo", exc)


COMMANDS: tuple[Command, ...] = (
    Command(
        "demo",
        "the end-to-end demo (maxent_arrow.demo.job)",
        "run the end-to-end demo (see `maxent-arrow demo --help`)",
        None,
        _cmd_demo,
        store=False,
    ),
    Command(
        "train",
        "train a policy from a demo run's stored rollouts",
        "Train a policy from a demo run's stored rollouts through the replay sampler: offline "
        "(default) or mixed with fresh generation (--replay-ratio), from the run's starting "
        "checkpoint; --exact replays the run's own updates from its snapshots instead.",
        _train_arguments,
        _cmd_train,
        store=False,
    ),
    Command(
        "inspect",
        "schema version, steps, ranks, rows, sizes, config",
        "Schema version, steps, ranks, rows, sizes and config of a run, from its commit log "
        "(the counts it keeps of each committed file: the cost does not grow with the step "
        "rows). Checks that every committed group file is there with the size its commit "
        "recorded; the bytes are checked by `verify` and by every query that reads them.",
        _json_option,
        _cmd_inspect,
    ),
    Command(
        "query",
        "DuckDB SQL over the views groups, samples, steps",
        "Run DuckDB SQL over the views groups (one row per prompt group, + kind), samples "
        "(one row per completion) and steps (one row per step and rank).",
        _query_arguments,
        _cmd_query,
    ),
    Command(
        "report",
        "PNG plots, index.html, summary.md",
        "Plots (PNG), an HTML page and a Markdown summary of a run.",
        _report_arguments,
        _cmd_report,
    ),
    Command(
        "offpolicy",
        "per step: staleness, IS diagnostics, kept mass",
        "Per step: the staleness histogram, verl's off-policy diagnostics (KL, k3, chi2, ESS, "
        "perplexity ratio), the kept-mass bias E[log S], and what each TRL and verl correction "
        "mode would clip or mask.",
        _offpolicy_arguments,
        _cmd_offpolicy,
    ),
    Command(
        "verify",
        "check every file (sizes, checksums, rows)",
        "Check every file of a store; exit 1 if any is damaged.",
        _json_option,
        _cmd_verify,
    ),
    Command(
        "repair",
        "move crash leftovers into RUN/quarantine/",
        "Move leftovers of crashed writes (temp files, uncommitted or replaced files) into "
        "RUN/quarantine/; prints what it moved. Nothing is deleted.",
        _tidy_arguments,
        _cmd_repair,
        writes=True,
    ),
    Command(
        "compact",
        "merge per-append files atomically",
        "Merge the per-append files of a store (atomic).",
        _compact_arguments,
        _cmd_compact,
        writes=True,
    ),
    Command(
        "checkpoint",
        "write a checkpoint of the commit log",
        "Write a checkpoint of the commit log (RUN/log/_checkpoint.parquet: the live files, "
        "what plain readers read).",
        _tidy_arguments,
        _cmd_checkpoint,
        writes=True,
    ),
    Command(
        "upgrade",
        "give a store of an older format a commit log",
        "Give a store written before the commit log (store format 1.x or 2.x, which every "
        "reader reads and no writer writes) a commit log over its files as they are; then it "
        "can be written again. A store that has one is left as it is.",
        _upgrade_arguments,
        _cmd_upgrade,
        writes=True,
    ),
    Command(
        "files",
        "the live files of a table, for a plain reader",
        "List the live files of a table for a plain reader, one per line (a tab and a row "
        "filter where a file is read in part).",
        _files_arguments,
        _cmd_files,
    ),
    Command(
        "tail",
        "each step as its commit lands (--since resumes)",
        "Print each step unit as its commit lands (one line, or JSON with --json), and the "
        "steps a resumed attempt supersedes; each line starts with its log version, the "
        "cursor to resume after (--since). Runs until Ctrl-C or --timeout.",
        _tail_arguments,
        _cmd_tail,
    ),
    Command(
        "export",
        "Arrow IPC files or a HF datasets dataset",
        "Export a run as Arrow IPC files or a HuggingFace dataset.",
        _export_arguments,
        _cmd_export,
    ),
    Command(
        "view",
        "a local read-only web explorer (127.0.0.1)",
        "Serve a local, read-only web explorer of the run (curves, steps, groups, tokens, "
        "SQL) on 127.0.0.1 and print its URL; runs until Ctrl-C.",
        _view_arguments,
        _cmd_view,
    ),
)
_COMMAND = {c.name: c for c in COMMANDS}


def command_list() -> str:
    """The list of commands in this module's docstring, one line each: the synopsis, the
    summary and ``[writes]`` for a command that changes the store (a test checks that the
    docstring holds exactly this)."""
    synopses = [c.synopsis() for c in COMMANDS]
    width = max(map(len, synopses))
    return "".join(
        f"    {s:<{width}}  {c.summary}{' [writes]' if c.writes else ''}\n"
        for s, c in zip(synopses, COMMANDS)
    )


# ---------------------------------------------------------------------- parser

_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")
QUOTE_SQL_HINT = (
    "the SQL must be one argument: quote it, e.g. "
    'maxent-arrow query RUN "SELECT step, count(*) FROM samples GROUP BY step"'
)


class _Parser(argparse.ArgumentParser):
    """argparse, with a hint after a usage error: the closest name to a mistyped command or
    choice ("did you mean"), and quoting for SQL the shell split into words."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.argv: list[str] = []  # set by _run: what the error concerns

    def error(self, message: str) -> NoReturn:
        choice = _CHOICE.search(message)
        if choice:
            listed = choice.group(2)
            # Python < 3.12.8 quotes each choice; later versions list them bare.
            choices = re.findall(r"'([^']*)'", listed) or [c.strip() for c in listed.split(",")]
            close = difflib.get_close_matches(choice.group(1), choices, n=1, cutoff=0.5)
            if close:
                message += f"; did you mean '{close[0]}'?"
        elif message.startswith("unrecognized arguments") and self.argv[:1] == ["query"]:
            message += f"; {QUOTE_SQL_HINT}"
        super().error(message)


def _parser() -> _Parser:
    """The parser of :data:`COMMANDS`, one subparser each, in the table's order."""
    parser = _Parser(
        prog="maxent-arrow",
        description="Arrow columnar rollout store for GRPO-style RL: inspect, query, report.",
        epilog="Exit codes: 0 ok, 1 data problem, 2 usage error, 3 missing optional "
        "dependency, 4 internal error, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        if command.arguments is None:  # its own parser reads what follows (see _run)
            sub.add_parser(command.name, help=command.help)
            continue
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        _common_arguments(p, store=command.store)
        command.arguments(p)
    return parser


def _message(exc: BaseException) -> str:
    """What an error says: its message, or its type when the message is empty."""
    return str(exc).strip() or type(exc).__name__


def _error(command: str | None, message: str) -> None:
    where = f"maxent-arrow {command}" if command else "maxent-arrow"
    text = " ".join(str(message).split())  # one line, whatever the message held
    sys.stderr.write(f"{where}: error: {text}\n")
    if os.environ.get("MAXENT_ARROW_DEBUG"):
        traceback.print_exc()


def _warn(command: str, caught: list[warnings.WarningMessage]) -> None:
    """Our warnings (a damaged file skipped under ``--on-error skip``) as one line each on
    stderr; other libraries' warnings are left to their own filters."""
    for item in caught:
        if issubclass(item.category, UserWarning) and "maxent_arrow" in item.filename:
            text = " ".join(str(item.message).split())
            sys.stderr.write(f"maxent-arrow {command}: warning: {text}\n")


@contextlib.contextmanager
def _log_lines(command: str) -> Iterator[None]:
    """The library's log warnings (a wait for the store lock, naming its holder) as one line
    each on stderr while the command runs, when they happen (a recorded warning would only
    be shown once the command is done)."""
    logger = logging.getLogger("maxent_arrow")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"maxent-arrow {command}: warning: %(message)s"))
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv``; returns the exit code.

    With ``argv=None`` (the ``maxent-arrow`` console script) the arguments come from
    ``sys.argv`` and the process ends right after the command, with its exit code, skipping
    the interpreter's teardown: native thread pools of the libraries loaded (pyarrow, torch)
    occasionally abort the process there ("terminate called without an active exception",
    exit 134, seen after ``verify``), which would turn a success into a failure for scripts.
    """
    if argv is None:
        code = _run(sys.argv[1:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return _run(list(argv))


def _run(argv: list[str]) -> int:
    forwarded = _COMMAND.get(argv[0]) if argv else None
    if forwarded is not None and forwarded.arguments is None:  # demo: its own parser
        return forwarded.handler(argparse.Namespace(command=forwarded.name, argv=argv[1:]))
    parser = _parser()
    parser.argv = argv
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return int(exc.code or 0) if isinstance(exc.code, int | None) else EXIT_USAGE
    try:
        with warnings.catch_warnings(record=True) as caught, _log_lines(args.command):
            warnings.simplefilter("always")
            try:
                _name_the_run(args)
                return _COMMAND[args.command].handler(args)
            finally:
                _warn(args.command, caught)
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        return _exit_code(args.command, exc)


def _name_the_run(args: argparse.Namespace) -> None:
    """``RUN`` (and ``view --compare RUN2``) as the store: a run directory or its store
    (:func:`maxent_arrow.demo.store_of`; anything else is a usage error, exit 2)."""
    for name in ("run", "compare"):
        if getattr(args, name, None) is not None:
            setattr(args, name, demo.store_of(getattr(args, name)))


def _exit_code(command: str, exc: Exception) -> int:
    """Report ``exc`` as one line; its exit code."""
    if _interrupted(exc):  # Ctrl-C that a library turned into its own error (e.g. mid-import)
        _error(command, "interrupted")
        return EXIT_INTERRUPTED
    try:
        raise exc
    except (QueryError, ArgumentError):
        _error(command, _message(exc))
        return EXIT_USAGE
    except MissingExtraError:
        _error(command, _message(exc))
        return EXIT_MISSING_EXTRA
    except (MaxentArrowError, OSError, ValueError):
        _error(command, _message(exc))
        return EXIT_DATA
    except Exception:  # a bug: still one line (the traceback with MAXENT_ARROW_DEBUG=1)
        _error(command, f"unexpected {type(exc).__name__}: {_message(exc)} (please report)")
        return EXIT_INTERNAL


def _interrupted(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


if __name__ == "__main__":  # pragma: no cover
    main()
