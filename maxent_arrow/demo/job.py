"""The main job end to end: what ``make demo`` (``maxent-arrow demo``) runs.

A seeded tiny GPT-2 is warm-started on the shipped demonstrations, trained with MaxEnt-GRPO
through the rollout store, evaluated on held-out prompts, replayed offline and reported (the
stages: :mod:`.stages`). This module is the command line around them: the arguments, the run
directory, and the closing lines. It imports neither torch nor transformers (the stages do,
when a run starts), so ``maxent-arrow demo --help`` answers at once.

The run directory (:mod:`.runs`): without ``--out`` each run gets a fresh
``runs/demo/run-NNN``, linked as ``runs/demo/latest`` once it has run; an explicit ``--out``
must be new or empty. The demo never overwrites anything, and deletes only what a failed run
of its own created (its run directory, unless it can be resumed): a non-empty ``--out`` (or
a store) is refused with one line on stderr and exit code 2, before anything is written.
``--resume`` continues the run in ``--out`` (a killed or shorter run) from its last policy
snapshot, as a resumed attempt of the run: the stored steps from there on are superseded,
readable as such (``docs/commit-protocol.md``, "Attempts").
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from maxent_arrow.demo.prompts import load_prompts
from maxent_arrow.demo.runs import (
    DEFAULT_ROOT,
    RunDirectoryError,
    create_run_dir,
    link_latest,
    prepare_run_dir,
    removed_on_failure,
)

__all__ = [
    "DEFAULT_ROOT",
    "EXIT_REPLAY",
    "EXIT_USAGE",
    "RunDirectoryError",
    "load_prompts",
    "main",
    "prepare_run_dir",
    "run",
]

REPLAY_TOLERANCE = 1e-5
EXIT_REPLAY = 1  # the offline replay differs from the logged run
EXIT_USAGE = 2  # a bad argument, an --out that is not empty or is a store


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maxent-arrow demo",
        description="Warm-start a tiny model on demonstrations, train it with MaxEnt-GRPO "
        "through the store, evaluate on held-out prompts, replay offline and report.",
        epilog="Exit codes: 0 ok; 1 the offline replay differs from the logged run, or a "
        "data error; 2 usage error, including an --out that is not empty or is a store "
        "(nothing is written); 3, 4 and 130 as for every maxent-arrow command. The demo "
        "never overwrites files; a run that fails removes the directory it created.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"run directory, new or empty (default: a fresh {DEFAULT_ROOT}/run-NNN)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last policy snapshot (after a kill, or with "
        "more --steps): a resumed attempt of the run; the stored steps from there on are "
        "superseded, and the optimizer starts fresh (the demo keeps weights only)",
    )
    parser.add_argument("--steps", type=_count(1), default=80, help="training steps")
    parser.add_argument("--prompts", type=_count(1), default=48, help="prompt groups per step")
    parser.add_argument("--k", type=_count(1), default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=_count(1), default=4, help="completion token cap")
    parser.add_argument(
        "--sft-steps", type=_count(0), default=1200, help="supervised warm-start steps (0: none)"
    )
    parser.add_argument("--eval-every", type=_count(1), default=10, help="evaluate every N steps")
    parser.add_argument("--eval-prompts", type=_count(0), default=128, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=_count(1),
        default=1,
        help="torch CPU threads (default 1: a model this small gains little from more, and "
        "on a busy machine more threads wait on each other)",
    )
    parser.add_argument(
        "--offline-steps",
        type=_count(0),
        default=None,
        help="after the run, train a second policy from its stored rollouts for this many "
        "steps (default: half of --steps; 0: none), compared with the run in the report",
    )
    parser.add_argument(
        "--replay-ratio",
        type=_ratio,
        default=1.0,
        help="the replayed share of the second policy's groups (1: offline, from the stored "
        "rollouts alone; 0.5: half replayed, half generated fresh)",
    )
    parser.add_argument("--no-report", action="store_true", help="skip the plotted report")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print one summary line at the end, nothing else (progress bars are drawn only "
        "on a terminal in any case)",
    )
    return parser


def run(args: argparse.Namespace, *, out: Path | None = None) -> dict[str, Any]:
    """Run the stages into ``out`` (default: :func:`prepare_run_dir` of ``args.out``);
    returns what the closing lines print, with ``out``."""
    if out is None:
        out = prepare_run_dir(args.out, resume=args.resume)
    # torch and transformers load here, not when the arguments are parsed.
    from maxent_arrow.demo.stages import run_stages

    result = run_stages(args, out)
    result["out"] = out
    return result


def main(argv: list[str] | None = None, *, commands: Collection[str] | None = None) -> int:
    """``maxent-arrow demo``: parse ``argv``, run, print the closing lines; the exit code.

    ``commands`` are the ``maxent-arrow`` subcommands this installation has (the CLI passes
    its own): the closing lines suggest ``view`` only when it is one of them. A run that
    raises (Ctrl-C included) before its first policy snapshot removes the directories it
    created (:func:`.runs.removed_on_failure`; a later one is kept for ``--resume``); a
    numbered run that ran is linked as ``runs/demo/latest``. ``--quiet``: one summary line.
    """
    args = _parser().parse_args(argv)
    try:
        new = create_run_dir(args.out, resume=args.resume)
    except RunDirectoryError as exc:
        sys.stderr.write(f"maxent-arrow demo: error: {exc}\n")
        return EXIT_USAGE
    if not args.quiet:
        print(f"run directory: {new.path}", flush=True)
    with removed_on_failure(new, keep=True):
        result = run(args, out=new.path)
    result["latest"] = link_latest(new.path)
    if args.quiet:
        print(summary_line(result))
    else:
        for line in closing_lines(args, result, commands=commands or ()):
            print(line)
    if max(_replay_errors(result)) > REPLAY_TOLERANCE:
        print(f"error: offline replay differs from the logged run (> {REPLAY_TOLERANCE})")
        return EXIT_REPLAY
    return 0


def _replay_errors(result: dict[str, Any]) -> tuple[float, float]:
    """The offline replay's largest relative loss error and weight error."""
    replayed = result["replayed"]
    return (
        max((r.loss_error for r in replayed), default=0.0),
        max((r.max_weight_error for r in replayed), default=0.0),
    )


def summary_line(result: dict[str, Any]) -> str:
    """What ``--quiet`` prints: the run, its held-out accuracy from the warm start to the end,
    the replay check and the report, on one line."""
    figures, out = result["figures"], result["out"]
    parts = [f"demo: {_shown(out)}"]
    if figures.eval:
        first, last = figures.eval[0][1], figures.eval[-1][1]
        parts.append(
            f"held-out accuracy {first:.3f} -> {last:.3f} ({100 * (last - first):+.1f} points)"
        )
    loss_error, _ = _replay_errors(result)
    parts.append(f"{len(result['replayed'])} steps replayed (max loss error {loss_error:.1e})")
    if result["report"] is not None:
        parts.append(f"report {_shown(result['report'].html)}")
    return "; ".join(parts)


def _shown(path: Path) -> str:
    """``path`` as a shell word: relative to the working directory when it lies inside it
    (symbolic links kept as they are: ``runs/demo/latest`` is shown as itself)."""
    path = Path(os.path.abspath(path))
    try:
        path = path.relative_to(os.path.abspath(Path.cwd()))
    except ValueError:
        pass
    return shlex.quote(str(path))


def _console_script() -> str:
    """How a fresh shell (no activated venv) runs ``maxent-arrow``: the script beside this
    interpreter (``.venv/bin/maxent-arrow`` from the repository), else ``python -m``."""
    script = Path(sys.executable).parent / "maxent-arrow"
    if script.exists() and os.access(script, os.X_OK):
        return _shown(script)
    return f"{shlex.quote(sys.executable)} -m maxent_arrow.cli"


def closing_lines(
    args: argparse.Namespace, result: dict[str, Any], *, commands: Collection[str] = ()
) -> list[str]:
    """The demo's closing lines: warm start and end accuracy, the peak, the split of the
    held-out answers, the training diagnostics, the replay check, and commands to look
    further."""
    figures, timings = result["figures"], result["timings"]
    lines = [""]
    sft, config = result["warm_start"], result["config"]
    if result.get("resumed_at") is not None:
        lines.append(
            f"resumed at step {result['resumed_at']} from its policy snapshot (a new attempt of "
            "the run; the stored steps from there on are superseded, see `inspect`)"
        )
    elif args.sft_steps:
        lines.append(
            f"warm start: {args.sft_steps} supervised steps on {sft['demonstrations']} "
            f"demonstrations in {timings['warm start']:.1f}s ({sft['wrong']} of them wrong: "
            "the teacher forgets carries)"
        )
    else:
        lines.append("warm start: none (--sft-steps 0): RL starts from the random model")
    lines.append(
        f"trained {args.steps} steps x {args.prompts} prompts x {args.k} completions in "
        f"{timings['train']:.1f}s (MaxEnt-GRPO, tau {config.tau}, beta {config.beta})"
    )
    if figures.eval:
        lines.append(f"held-out accuracy (greedy, {args.eval_prompts} prompts never trained on):")
        for step, accuracy, fmt, *_ in figures.eval:
            where = " (warm start)" if step == 0 else " (end)" if step == args.steps else ""
            lines.append(f"  step {step:3d}  accuracy {accuracy:.3f}  format {fmt:.3f}{where}")
        first, last = figures.eval[0], figures.eval[-1]
        peak = max(figures.eval, key=lambda row: row[1])
        lines.append(
            f"accuracy {first[1]:.3f} at the warm start -> {last[1]:.3f} at the end "
            f"({100 * (last[1] - first[1]):+.1f} points); peak {peak[1]:.3f} at step {peak[0]}"
        )
        lines.append(
            f"held-out answers, correct / well-formed but wrong / malformed: {last[3]} / "
            f"{last[4]} / {last[5]} at the end, {first[3]} / {first[4]} / {first[5]} at the "
            f"warm start; {figures.greedy_distinct} distinct answers at the end"
        )
    if figures.train:
        first, last = figures.train[0], figures.train[-1]
        kl_peak = max(row[4] for row in figures.train)
        lines.append(
            f"sampled training completions: accuracy {first[1]:.2f} -> {last[1]:.2f}; distinct "
            f"per step {first[2]} -> {last[2]} (of {last[3]}); KL per token {first[4]:.3f} -> "
            f"{last[4]:.3f} (max {kl_peak:.3f})"
        )
    replayed = result["replayed"]
    worst, worst_weight = _replay_errors(result)
    lines.append(
        f"replayed {len(replayed)} steps offline in {timings['replay']:.1f}s: recomputed losses "
        f"equal the logged ones (max relative error {worst:.2e}; advantages, q and weights "
        f"recomputed within {worst_weight:.1e})"
    )
    offline = result.get("offline")
    if offline is not None and offline.accuracy:
        (_, a0), (_, a1) = offline.accuracy[0], offline.accuracy[-1]
        ratio = getattr(args, "replay_ratio", 1.0)
        what = (
            "offline from the stored rollouts"
            if ratio >= 1
            else f"with {100 * ratio:.0f}% replayed groups"
        )
        dropped = sum(sum(s.dropped.values()) for s in offline.steps)
        lines.append(
            f"a second policy trained {len(offline.steps)} steps {what} in "
            f"{offline.seconds:.1f}s (replay sampler; {dropped} groups with no reward spread "
            f"dropped): held-out accuracy {a0:.3f} -> {a1:.3f} ({100 * (a1 - a0):+.1f} points)"
        )
    return [*lines, "", *where_to_look(result, commands=commands)]


def _fresh(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... : the first that does not exist (a printed
    command that writes must not overwrite what the run wrote)."""
    n, candidate = 1, path
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def where_to_look(result: dict[str, Any], *, commands: Collection[str] = ()) -> list[str]:
    """The closing lines' paths (the run, its store, its report, ``runs/demo/latest``) and
    commands to look further, runnable as printed from this directory: each takes the run
    directory, and the one that writes (``report``) writes to a new directory."""
    out = result["out"]
    lines = [
        f"run:      {_shown(out)}  (store {_shown(out / 'store')}, snapshots "
        f"{_shown(out / 'snapshots')})"
    ]
    if result.get("latest") is not None:
        lines.append(f"latest:   {_shown(result['latest'])} (a link to the newest run)")
    if result["report"] is not None:
        lines.append(f"report:   {_shown(result['report'].html)}")
    exe, run = _console_script(), _shown(out)
    lines.append("")
    lines.append("look further (from this directory):")
    lines.append(f"  {exe} inspect {run}")
    query = (
        "SELECT step, avg(reward_accuracy) AS accuracy, avg(reward_format) AS format "
        "FROM samples WHERE kind = 'eval' GROUP BY step ORDER BY step"
    )
    # Double quotes: the SQL holds single quotes and nothing a shell expands in double quotes.
    lines.append(f'  {exe} query {run} "{query}"')
    lines.append(f"  {exe} report {run} --out {_shown(_fresh(out / 'report'))}")
    if "view" in commands:
        lines.append(f"  {exe} view {run}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
