"""Run every ``benchmarks/bench_*.py``, all of them even when one fails; fail at the end.

Each script runs in its own process with ``MAXENT_ARROW_BENCH_OUT`` pointing at a JSON file of
its rows (``benchmarks/harness.py``); this script prints each script's output as it comes,
then a summary of every row (met, missed with the reason, or context) and of every script's
exit status, and writes one combined JSON (``--out``) that ``benchmarks/readme_table.py``
renders into ``docs/benchmarks.md``. The load average is sampled while each script runs (the
machine may be shared) and kept in the JSON. The exit status is 1 when any script exits non-zero (a
missed target, or a crash).

Run ``python benchmarks/run_all.py [--quick] [--only ragged,ingest] [--out PATH]
[--doc docs/benchmarks.md]`` (``make bench`` runs it with ``--doc docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

DEFAULT_OUT = HERE / "results.json"


class LoadSampler:
    """The 1-minute load average, sampled every ``period`` seconds in a thread."""

    def __init__(self, period: float = 5.0):
        self.period = period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            load = harness.load()
            if load is not None:
                self.samples.append(load[0])
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float] | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return {
            "min": ordered[0],
            "median": ordered[len(ordered) // 2],
            "max": ordered[-1],
            "samples": len(ordered),
        }


def scripts(only: list[str] | None, where: Path = HERE) -> list[Path]:
    found = sorted(where.glob("bench_*.py"))
    if only:
        wanted = {name.removeprefix("bench_").removesuffix(".py") for name in only}
        found = [p for p in found if p.stem.removeprefix("bench_") in wanted]
        missing = wanted - {p.stem.removeprefix("bench_") for p in found}
        if missing:
            raise SystemExit(f"run_all: no {where}/bench_{sorted(missing)[0]}.py")
    return found


def run_one(script: Path, out: Path, *, quick: bool, timeout: float) -> dict[str, Any]:
    """Run one script, with the package of its own tree first on the path; its JSON
    document with ``rc``, ``wall_s`` and the load added."""
    env = os.environ | {harness.ENV_OUT: str(out)}
    tree = script.resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, str(script), *(["--quick"] if quick else [])]
    print(f"\n######## {script.name} {'--quick' if quick else ''}", flush=True)
    start = time.perf_counter()
    with LoadSampler() as sampler:
        try:
            rc = subprocess.run(command, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"run_all: {script.name} ran past {timeout:.0f} s; stopped", flush=True)
            rc = 124
    wall = time.perf_counter() - start
    if out.exists():
        doc = json.loads(out.read_text())
    else:  # a crash before finish(), or a script that does not write rows
        doc = {"schema": harness.SCHEMA, "bench": script.stem.removeprefix("bench_"), "rows": []}
        doc["script"] = script.name
        doc["no_json"] = True
    doc |= {"rc": rc, "wall_s": round(wall, 1), "load_during": sampler.summary()}
    return doc


def summary(runs: list[dict[str, Any]]) -> tuple[str, bool]:
    lines, ok = ["", "######## summary"], True
    for run in runs:
        rows = run.get("rows", [])
        met = sum(r["met"] is True for r in rows)
        missed = [r for r in rows if r["met"] is False]
        context = sum(r["met"] is None for r in rows)
        load = run.get("load_during") or {}
        lines.append(
            f"{run['script']:<24} exit {run['rc']:<3} {run['wall_s']:>6.1f} s  "
            f"rows: {met} met, {len(missed)} missed, {context} context"
            f"{'  (load avg ' + str(load.get('median')) + ')' if load else ''}"
        )
        if run.get("no_json"):
            lines.append("    no JSON rows (the script is not on the harness, or it crashed)")
        for row in missed:
            targets = ", ".join(
                f"{t['label']} (got {harness.fmt_ratio(t['value'])})"
                if t["ref"] != "custom"
                else f"{t['label']} (got {t['value']:.3g})"
                for t in row["targets"]
                if not t["met"]
            )
            lines.append(f"    MISSED {row['name']}: {targets}")
            if row.get("reason"):
                lines.append(f"        why: {row['reason']}")
        ok &= run["rc"] == 0
    lines.append("every script exited 0" if ok else "some script exited non-zero (see above)")
    return "\n".join(lines), ok


class Session:
    """One benchmark run: when it started, the load before it, and, at the end, the combined
    JSON document of its scripts' runs (and the page's table regenerated from it)."""

    def __init__(self, *, quick: bool):
        self.quick = quick
        self.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.t0 = time.perf_counter()
        self.load_before = harness.load()

    def write(self, runs: list[dict[str, Any]], out: Path, page: Path | None) -> bool:
        """Print the summary, write ``out`` (and ``page``'s table); whether every script
        exited 0."""
        text, ok = summary(runs)
        print(text)
        doc = {
            "schema": harness.SCHEMA,
            "kind": "run_all",
            "quick": self.quick,
            "started": self.started,
            "wall_s": round(time.perf_counter() - self.t0, 1),
            "machine": next((r["machine"] for r in runs if "machine" in r), harness.machine()),
            "load_before": self.load_before,
            "load_after": harness.load(),
            "ok": ok,
            "runs": runs,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {out} ({doc['wall_s']:.0f} s in all)")
        if page is not None:
            import readme_table

            readme_table.main([str(out), "--doc", str(page)])
        return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every script with --quick")
    parser.add_argument("--only", default=None, help="comma-separated names (ragged,ingest)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    parser.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        type=Path,
        default=None,
        help="regenerate the marked table of this page (docs/benchmarks.md)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    parser.add_argument("--scripts-dir", type=Path, default=HERE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = args.out or (DEFAULT_OUT if not args.quick else HERE / "results-quick.json")
    todo = scripts(args.only.split(",") if args.only else None, args.scripts_dir)
    session = Session(quick=args.quick)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for script in todo:
            runs.append(
                run_one(script, Path(tmp) / f"{script.stem}.json", quick=args.quick,
                        timeout=args.timeout)
            )  # fmt: skip
    return 0 if session.write(runs, out, args.doc) else 1


if __name__ == "__main__":
    raise SystemExit(main())
