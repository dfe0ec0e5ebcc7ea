"""The README's first-hour figures, measured on a fresh clone: the first ``make demo`` (with the
part of it that builds ``.venv``), a rerun, and ``make test``.

The script clones the repository (``--repo``, default: the one it lies in; ``--ref``, default
``HEAD``: commit what you want measured) into a temporary directory, so nothing of the working
tree (its ``.venv``, caches, built files) helps, and there runs, each timed by the wall clock:

1. ``make venv``: the bootstrap the first ``make demo`` does (Python packages from the registry;
   the CPU wheel of torch as the Makefile pins it);
2. ``make demo``: the demo itself, on the fresh venv (1 + 2 is the first ``make demo``);
3. ``make demo`` again: a rerun (the venv exists; the demo writes a fresh run);
4. ``make test``: the whole suite, as the README says to run it.

The machine (CPU, cores, memory) and its 1-minute load average (sampled every 5 s) are
recorded beside the figures: other jobs on the machine inflate them, so the README reads them
as upper bounds when the load exceeded the cores. A step that fails stops the measurement
(exit 1) and nothing is written to the README.

``--readme README.md`` rewrites the README's block between ``<!-- first-hour:start -->`` and
``<!-- first-hour:end -->`` from the measurement; ``--json PATH`` keeps the figures (default
``benchmarks/readme-timings.json``). The full run takes 30 minutes or more on 2 cores.

``--quick`` is a smoke run of the machinery (clone, timing, load sampling, the rendering)
that takes about a minute: the clone uses an existing virtual environment (``--venv``, default
this repository's ``.venv``, with the clone first on ``PYTHONPATH``) instead of building one,
runs a tiny demo twice instead of ``make demo`` and one test file instead of ``make test``. Its
figures are not the README's: it writes ``benchmarks/readme-timings-quick.json`` and prints the
block it would write, and refuses ``--readme``.

Run ``python benchmarks/readme_timings.py --readme README.md`` (full) or
``python benchmarks/readme_timings.py --quick`` (smoke).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from readme_table import replace_between_markers  # noqa: E402
from run_all import LoadSampler  # noqa: E402

START, END = "<!-- first-hour:start -->", "<!-- first-hour:end -->"
DEFAULT_JSON = HERE / "readme-timings.json"
QUICK_JSON = HERE / "readme-timings-quick.json"
# A step's wall-clock limit: a hang is a failure, not a figure.
STEP_TIMEOUT = 3 * 3600
# The tiny demo and the test file of --quick.
QUICK_DEMO = ["--steps", "2", "--prompts", "2", "--k", "4", "--eval-every", "2",
              "--eval-prompts", "2", "--quiet", "--no-report"]  # fmt: skip
QUICK_TESTS = ["tests/cli/test_cli.py", "-m", "not slow"]


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def clone(repo: Path, ref: str, into: Path) -> str:
    """A fresh clone of ``repo`` at ``ref`` in ``into``; its commit."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}", cwd=repo)
    subprocess.run(
        ["git", "clone", "--quiet", "--no-hardlinks", "--no-checkout", str(repo), str(into)],
        check=True,
    )
    _git("checkout", "--quiet", "--detach", commit, cwd=into)
    return commit


def timed(name: str, cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> float:
    """Run ``cmd`` in ``cwd`` with its output in ``log``; its wall-clock seconds. A failure
    raises, naming the step and the log."""
    print(f"readme_timings: {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with log.open("wb") as out:
        done = subprocess.run(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=STEP_TIMEOUT
        )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(
            f"readme_timings: {name} failed (exit {done.returncode}) after {seconds:.0f} s; "
            f"its log: {log}\n{tail}"
        )
    print(f"readme_timings: {name}: {seconds:.1f} s", flush=True)
    return seconds


def steps(work: Path, *, quick: bool, venv: Path | None) -> list[tuple[str, list[str]]]:
    """The measured steps: (name, command), run in the clone in this order."""
    if not quick:
        return [
            ("venv", ["make", "venv"]),
            ("demo", ["make", "demo"]),
            ("demo_rerun", ["make", "demo"]),
            ("test", ["make", "test"]),
        ]
    assert venv is not None
    exe, python = str(venv / "bin" / "maxent-arrow"), str(venv / "bin" / "python")
    # A rerun is a new run, as `make demo` twice gives two runs/demo/run-NNN: the demo never
    # writes into a run directory that holds one.
    first, again = str(work / "quick-demo"), str(work / "quick-demo-rerun")
    return [
        ("venv", [python, "-c", "import maxent_arrow"]),
        ("demo", [exe, "demo", "--out", first, *QUICK_DEMO]),
        ("demo_rerun", [exe, "demo", "--out", again, *QUICK_DEMO]),
        ("test", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *QUICK_TESTS]),
    ]


def measure(repo: Path, ref: str, *, quick: bool, venv: Path | None, keep: bool) -> dict[str, Any]:
    """Clone, run the steps, and return the figures with the machine and the load."""
    work = Path(tempfile.mkdtemp(prefix="readme-timings-"))
    try:
        checkout = work / "clone"
        commit = clone(repo, ref, checkout)
        env = dict(os.environ)
        env.pop("VIRTUAL_ENV", None)
        if quick:
            # The clone's code first, the existing venv's packages behind it.
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(checkout), env.get("PYTHONPATH")) if p
            )
        seconds: dict[str, float] = {}
        started = dt.datetime.now(dt.UTC)
        with LoadSampler(period=5.0) as sampler:
            for name, cmd in steps(work, quick=quick, venv=venv):
                seconds[name] = timed(name, cmd, cwd=checkout, env=env, log=work / f"{name}.log")
        return {
            "quick": quick,
            "date": started.date().isoformat(),
            "commit": commit,
            "seconds": {k: round(v, 1) for k, v in seconds.items()},
            "first_demo": round(seconds["venv"] + seconds["demo"], 1),
            "machine": harness.machine(),
            "load": sampler.summary(),
            "work": str(work) if keep else None,
        }
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def render(doc: dict[str, Any]) -> str:
    """The README block: the two commands with their measured times, and how they were
    measured."""
    s, m, load = doc["seconds"], doc["machine"], doc.get("load") or {}
    cores = m.get("cores") or 0
    loaded = bool(load) and cores and load["median"] >= 0.75 * cores
    lines = [
        "```bash",
        f"make demo   # bootstraps .venv if needed, then trains, replays, evaluates and reports "
        f"(first run {_minutes(doc['first_demo'])}, then {_minutes(s['demo_rerun'])})",
        f"make test   # bootstraps .venv if needed, then runs the whole test suite "
        f"({_minutes(s['test'])} on {cores} cores)",
        "```",
        "",
        f"Measured on a fresh clone by `benchmarks/readme_timings.py` on {doc['date']} (commit "
        f"`{doc['commit'][:10]}`; {m.get('cpu', '?')}, {cores} cores, "
        f"{m.get('memory_gib', '?')} GiB, Python {m.get('python', '?')}): the first "
        f"`make demo` took {_minutes(doc['first_demo'])}, {_minutes(s['venv'])} of it building "
        f"`.venv` from the package registry; a rerun {_minutes(s['demo_rerun'])}; `make test` "
        f"{_minutes(s['test'])}.",
    ]
    if load:
        lines[-1] += (
            f" The 1-minute load average meanwhile: median {load['median']:.2f}, peak "
            f"{load['max']:.2f}"
            + (
                f" on {cores} cores: other jobs shared the machine, so read these as upper bounds."
                if loaded
                else "."
            )
        )
    if doc.get("quick"):
        lines.insert(
            0, "(--quick smoke run: a tiny demo and one test file, not the README's figures)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE.parent, help="repository to clone")
    parser.add_argument("--ref", default="HEAD", help="commit to measure (default HEAD)")
    parser.add_argument("--readme", type=Path, help="rewrite this README's first-hour block")
    parser.add_argument("--json", type=Path, help="where to keep the figures")
    parser.add_argument("--quick", action="store_true", help="a smoke run of the machinery")
    parser.add_argument(
        "--venv", type=Path, default=HERE.parent / ".venv", help="the venv --quick uses"
    )
    parser.add_argument("--keep", action="store_true", help="keep the clone and the logs")
    args = parser.parse_args(argv)
    if args.quick and args.readme:
        parser.error("--quick figures are not the README's: drop --readme")
    if args.quick and not (args.venv / "bin" / "python").exists():
        parser.error(f"--quick needs a virtual environment: {args.venv} has none (make venv)")
    doc = measure(
        args.repo.resolve(), args.ref, quick=args.quick, venv=args.venv.resolve(), keep=args.keep
    )
    block = render(doc)
    out = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    out.write_text(json.dumps({**doc, "block": block}, indent=2) + "\n")
    print(block)
    print(f"readme_timings: figures in {out}")
    if args.readme:
        text = args.readme.read_text()
        args.readme.write_text(replace_between_markers(text, block, start=START, end=END))
        print(f"readme_timings: rewrote the block in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
