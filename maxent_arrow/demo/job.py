"""The main job end to end: what ``make demo`` (``maxent-arrow demo``) runs.

A seeded tiny GPT-2 is warm-started on the shipped demonstrations, trained with MaxEnt-GRPO
through the rollout store, evaluated on held-out prompts, replayed offline and reported (the
stages: :mod:`.stages`). This module is the command line around them: the arguments, the run
directory, and the closing lines. It imports neither torch nor transformers (the stages do,
when a run starts), so ``maxent-arrow demo --help`` answers at once.

The run directory: without ``--out`` each run gets a fresh ``runs/demo/run-NNN``; an
explicit ``--out`` must be new or empty. The demo never deletes or overwrites anything: a
non-empty ``--out`` (or a store) is refused with one line on stderr and exit code 2, before
anything is written. ``--resume`` continues the run in ``--out`` (a killed or shorter run)
from its last policy snapshot, as a resumed attempt of the run: the stored steps from there on
are superseded, readable as such (``docs/commit-protocol.md``, "Attempts").
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
from maxent_arrow.errors import MaxentArrowError

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

DEFAULT_ROOT = Path("runs") / "demo"
REPLAY_TOLERANCE = 1e-5
EXIT_REPLAY = 1  # the offline replay differs from the logged run
EXIT_USAGE = 2  # a bad argument, an --out that is not empty or is a store


class RunDirectoryError(MaxentArrowError, ValueError):
    """``--out`` names something the demo must not write into (nothing was written)."""


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
        "never deletes or overwrites files.",
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
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _next_numbered(root: Path) -> Path:
    """Create and return ``root/run-NNN`` with the next number no existing entry has."""
    taken = (
        [int(p.name[4:]) for p in root.glob("run-*") if p.name[4:].isdigit()]
        if root.is_dir()
        else []
    )
    number = max(taken, default=0) + 1
    while True:
        candidate = root / f"run-{number:03d}"
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:  # another run took it meanwhile
            number += 1
            continue
        return candidate


def prepare_run_dir(out: Path | None, *, root: Path = DEFAULT_ROOT, resume: bool = False) -> Path:
    """The directory this run writes into, created now.

    Without ``out``: a fresh numbered directory under ``root`` (``run-001``, ``run-002``,
    ...). With ``out``: it must not exist yet or be an empty directory; a file, a rollout
    store or a non-empty directory raises :class:`RunDirectoryError` and nothing is created.
    ``resume``: ``out`` must be a demo run (its store and policy snapshots), which goes on.
    """
    if resume:
        if out is None:
            raise RunDirectoryError("--resume needs --out: the run directory to continue")
        if not (out / "store" / "manifest.json").is_file() or not any(
            (out / "snapshots").glob("step-*.safetensors")
        ):
            raise RunDirectoryError(
                f"--resume: {out} is not a demo run (no store/ with policy snapshots/ beside "
                "it); give the run directory a demo wrote"
            )
        return out
    if out is None:
        try:
            return _next_numbered(root)
        except OSError as exc:
            raise RunDirectoryError(f"cannot create a run directory under {root}: {exc}") from None
    fresh = (
        f"give a new or empty directory, or leave out --out (each run then goes to a fresh "
        f"{root}/run-NNN)"
    )
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(f"--out {out} is a file; {fresh}")
    if (out / "manifest.json").exists():
        raise RunDirectoryError(
            f"--out {out} is a rollout store; the demo writes a whole run (store, snapshots, "
            f"report) and never into an existing one: {fresh}"
        )
    if out.is_dir() and any(out.iterdir()):
        raise RunDirectoryError(
            f"--out {out} is not empty; the demo never overwrites or deletes files: {fresh}"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirectoryError(f"--out {out}: cannot create it ({exc})") from None
    return out


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
    its own): the closing lines suggest ``view`` only when it is one of them.
    """
    args = _parser().parse_args(argv)
    try:
        out = prepare_run_dir(args.out, resume=args.resume)
    except RunDirectoryError as exc:
        sys.stderr.write(f"maxent-arrow demo: error: {exc}\n")
        return EXIT_USAGE
    print(f"run directory: {out}", flush=True)
    result = run(args, out=out)
    for line in closing_lines(args, result, commands=commands or ()):
        print(line)
    replayed = result["replayed"]
    worst = max((r.loss_error for r in replayed), default=0.0)
    worst_weight = max((r.max_weight_error for r in replayed), default=0.0)
    if worst > REPLAY_TOLERANCE or worst_weight > REPLAY_TOLERANCE:
        print(f"error: offline replay differs from the logged run (> {REPLAY_TOLERANCE})")
        return EXIT_REPLAY
    return 0


def _shown(path: Path) -> str:
    """``path`` as a shell word: relative to the working directory when it lies inside it."""
    try:
        path = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        path = path.resolve()
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
    figures, timings, out = result["figures"], result["timings"], result["out"]
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
    worst = max((r.loss_error for r in replayed), default=0.0)
    worst_weight = max((r.max_weight_error for r in replayed), default=0.0)
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
    lines.append("")
    store = out / "store"
    lines.append(
        f"run:      {_shown(out)}  (store {_shown(store)}, snapshots {_shown(out / 'snapshots')})"
    )
    if result["report"] is not None:
        lines.append(f"report:   {_shown(result['report'].html)}")
    exe = _console_script()
    lines.append("")
    lines.append("look further (from this directory):")
    lines.append(f"  {exe} inspect {_shown(store)}")
    query = (
        "SELECT step, avg(reward_accuracy) AS accuracy, avg(reward_format) AS format "
        "FROM samples WHERE kind = 'eval' GROUP BY step ORDER BY step"
    )
    # Double quotes: the SQL holds single quotes and nothing a shell expands in double quotes.
    lines.append(f'  {exe} query {_shown(store)} "{query}"')
    lines.append(f"  {exe} report {_shown(store)} --out {_shown(out / 'report')}")
    if "view" in commands:
        lines.append(f"  {exe} view {_shown(store)}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
