"""Compare this tree's benchmarks with another checkout's (the main a change started from),
script by script, the two runs of each script alternated so that both see the same machine.

For every ``bench_*.py`` of both trees, it runs the other tree's script (with that tree's
package on the path), then this tree's, and so on, each as ``run_all.py`` runs it (the rows
of ``benchmarks/harness.py``). A row is a **regression** when it met its target in the other
tree and misses it here, or when one of its ratios is more than ``--tolerance`` (default 10%)
worse here. It prints every row side by side, writes the comparison as JSON (``--out``) and
exits 1 on a regression.

    python benchmarks/compare_trees.py --base /tmp/base [--quick] [--only store,analytics]

(``git worktree add /tmp/base <commit>`` makes the other checkout; the two trees share the
virtual environment: the packages are the same.)

Scripts only this tree has run too (after the pairs, their rows marked new). With
``--results PATH`` (and ``--doc docs/benchmarks.md``) this tree's runs are also written as
``run_all.py`` writes them, so that one alternated run gives both the comparison and the
page's table (``make bench`` figures, each script run once, interleaved with the base's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_all  # noqa: E402


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in doc.get("rows", []) if not row.get("detail")}


def compare_rows(
    base: dict[str, Any], new: dict[str, Any], tolerance: float
) -> list[dict[str, Any]]:
    """Each row of ``new`` beside ``base``'s of the same name: its ratios in both, whether
    it met its targets in both, and what makes it a regression (``None``: none)."""
    out = []
    before = _rows(base)
    for name, row in _rows(new).items():
        old = before.get(name)
        if old is None:
            out.append({"name": name, "new": True, "regression": None})
            continue
        why = None
        if old.get("met") is True and row.get("met") is False:
            why = "met its target in the base tree, misses it here"
        for target in row.get("targets", []):
            was = next((t for t in old.get("targets", []) if t["label"] == target["label"]), None)
            if was is None or target["ref"] == "custom" or target["op"] != "<=":
                continue
            if target["value"] > was["value"] * (1 + tolerance):
                why = why or (
                    f"{target['label']}: {target['value']:.3g} here, {was['value']:.3g} in the "
                    f"base tree (more than {tolerance:.0%} worse)"
                )
        out.append(
            {
                "name": name,
                "met": [old.get("met"), row.get("met")],
                "ratios": [old.get("ratios"), row.get("ratios")],
                "regression": why,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=HERE / "compare.json")
    parser.add_argument("--results", type=Path, default=None, help="this tree's run_all JSON")
    parser.add_argument("--doc", type=Path, default=None, help="and the page's table from it")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    mine = {p.name: p for p in run_all.scripts(only)}
    theirs = {p.name: p for p in run_all.scripts(only, args.base / "benchmarks")}
    report: list[dict[str, Any]] = []
    regressions = 0
    session = run_all.Session(quick=args.quick)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(mine):
            docs = []
            pair = (("base", theirs[name]),) if name in theirs else ()
            for tree, script in (*pair, ("new", mine[name])):
                out = Path(tmp) / f"{tree}-{script.stem}.json"
                docs.append(run_all.run_one(script, out, quick=args.quick, timeout=args.timeout))
            runs.append(docs[-1])
            if not pair:
                rows = [{"name": n, "new": True, "regression": None} for n in _rows(docs[0])]
                report.append({"script": name, "rc": [None, docs[0]["rc"]], "rows": rows})
                continue
            rows = compare_rows(docs[0], docs[1], args.tolerance)
            regressions += sum(r["regression"] is not None for r in rows)
            report.append(
                {
                    "script": name,
                    "rc": [docs[0]["rc"], docs[1]["rc"]],
                    "rows": rows,
                    "load": [docs[0].get("load_during"), docs[1].get("load_during")],
                }
            )
    for script in report:
        print(f"\n## {script['script']} (exit {script['rc'][0]} base, {script['rc'][1]} here)")
        for row in script["rows"]:
            mark = "REGRESSION " if row["regression"] else ""
            print(f"  {mark}{row['name']}: met {row.get('met')}" +
                  (f" -- {row['regression']}" if row["regression"] else ""))  # fmt: skip
    args.out.write_text(json.dumps({"tolerance": args.tolerance, "scripts": report}, indent=1))
    if args.results is not None:
        session.write(runs, args.results, args.doc)
    print(f"\n{regressions} regressions; comparison: {args.out}")
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
