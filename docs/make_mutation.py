"""Write ``docs/mutation.md`` from the results of a mutation run (``make mutate``: mutmut's
``mutants/`` directory) and the reasons kept by hand in ``docs/mutation_survivors.toml``::

    python docs/make_mutation.py --wall 2712     # after `mutmut run` (its wall time, seconds)

The report names the date, mutmut's version, the modules ([tool.mutmut] ``only_mutate`` in
pyproject.toml) and the tests (its test selection), the mutants killed, timed out, crashed,
survived and untested, per module and in all, the score, and each survivor with the reason it
survives (an equivalent mutant: why no test can tell it from the original). A survivor without
a reason is listed as unexplained and the script exits 1, with the stanza to add to
``docs/mutation_survivors.toml`` printed for each: a new survivor is either a test to write or
a reason to give.

A reason is matched to a survivor by the function it mutates and the lines it changes (not by
mutmut's number of the mutant, which moves when the function changes): edit the function's
lines and the reason no longer applies.

Two more modes keep the history of the survivors that tests were written for (the section
"Killed since the first run")::

    python docs/make_mutation.py --save-baseline /tmp/first.json   # a run's survivors
    python docs/make_mutation.py --attribute /tmp/first.json       # after a run with new tests

``--attribute`` runs, for each survivor of the saved run that the newest run kills, the tests
added for them (:data:`ADDED_TESTS`) against that mutant (in ``mutants/``, one forked pytest
per mutant, as mutmut runs them) and records the first test that fails in
``docs/mutation_killed.json``.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import fnmatch
import importlib.metadata
import json
import os
import platform
import re
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPORT = HERE / "mutation.md"
REASONS = HERE / "mutation_survivors.toml"
KILLED = HERE / "mutation_killed.json"
MUTANTS = ROOT / "mutants"

# The test files written for the survivors of the first run (each names the behaviour).
ADDED_TESTS = (
    "tests/store/test_checksum_records.py",
    "tests/store/test_commit_log_entries.py",
    "tests/store/test_unit_commit.py",
    "tests/store/test_sql_session_sandbox.py",
)

# mutmut's exit codes of a mutant's test run (mutmut.stats.status_by_exit_code), in groups:
# detected (a test failed, the run timed out or crashed), survived, untested, skipped.
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout",
          255: "timeout", -11: "crashed", -9: "crashed", 37: "caught by type check",
          2: "interrupted", None: "not checked"}  # fmt: skip
DETECTED = ("killed", "timeout", "crashed", "caught by type check")
COLUMNS = ("killed", "timeout", "crashed", "survived", "no tests", "not checked")


def status(code: int | None) -> str:
    return STATUS.get(code, "suspicious")


def config() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mutmut"]


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def function_of(mutant: str) -> str:
    """``pkg.mod.x_func__mutmut_3`` -> ``pkg.mod.x_func`` (methods: ``pkg.mod.xǁCǁm``)."""
    return mutant.rsplit("__mutmut_", 1)[0]


def readable(function: str) -> str:
    """mutmut's name of a function as Python spells it (``checksums.seal``,
    ``log.CommitLog.state``)."""
    module, _, name = function.rpartition(".")
    name = name.removeprefix("x_") if name.startswith("x_") else name[2:].replace("ǁ", ".")
    return f"{module.rsplit('.', 1)[-1]}.{name}"


# ---------------------------------------------------------------------------- results
def results() -> dict[str, dict[str, int | None]]:
    """Per module path: mutant name -> exit code, as mutmut's meta files hold them."""
    out = {}
    for path in config()["only_mutate"]:
        meta = MUTANTS / f"{path}.meta"
        if not meta.exists():
            raise SystemExit(f"{meta}: no results (run `make mutate`, or `mutmut run`, first)")
        out[path] = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    return out


def change_of(mutant: str, path: str) -> list[str]:
    """The lines a mutant changes: ``-`` the original's, ``+`` the mutant's, stripped."""
    os.chdir(ROOT)
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(mutant, path=path)
    return [
        f"{line[0]} {line[1:].strip()}"
        for line in diff.splitlines()
        if line[:1] in "-+" and not line.startswith(("---", "+++"))
    ]


def survivors(
    found: dict[str, dict[str, int | None]], kinds: tuple[str, ...] = ("survived",)
) -> list[dict[str, Any]]:
    return [
        {
            "mutant": m,
            "function": function_of(m),
            "path": path,
            "change": change_of(m, path),
            "status": status(code),
        }  # fmt: skip
        for path, codes in found.items()
        for m, code in sorted(codes.items(), key=lambda kv: _order(kv[0]))
        if status(code) in kinds
    ]


def _order(mutant: str) -> tuple[str, int]:
    function, _, number = mutant.rpartition("__mutmut_")
    return function, int(number) if number.isdigit() else 0


# ---------------------------------------------------------------------------- reasons
def reasons() -> list[dict[str, Any]]:
    if not REASONS.exists():
        return []
    return tomllib.loads(REASONS.read_text(encoding="utf-8")).get("equivalent", [])


def _same_change(entry: dict[str, Any], change: list[str]) -> bool:
    wanted = entry["change"]
    options = wanted if wanted and isinstance(wanted[0], list) else [wanted]
    return any(_norm(o) == _norm(change) for o in options)


def _norm(lines: list[str]) -> list[str]:
    return [re.sub(r"\s+", " ", line.strip()) for line in lines]


def reason_for(survivor: dict[str, Any], known: list[dict[str, Any]]) -> str | None:
    for entry in known:
        if fnmatch.fnmatchcase(survivor["function"], entry["function"]) and _same_change(
            entry, survivor["change"]
        ):
            return entry["reason"].strip()
    return None


def stanza(survivor: dict[str, Any]) -> str:
    change = ", ".join(json.dumps(line, ensure_ascii=False) for line in survivor["change"])
    return (
        f"[[equivalent]]  # {survivor['mutant']}\n"
        f"function = {json.dumps(survivor['function'], ensure_ascii=False)}\n"
        f"change = [{change}]\n"
        'reason = """..."""\n'
    )


# ---------------------------------------------------------------------------- the report
def _counts(codes: dict[str, int | None]) -> collections.Counter[str]:
    return collections.Counter(status(code) for code in codes.values())


def score(counts: collections.Counter[str]) -> float:
    """Detected (killed, timed out, crashed) over every mutant tested or left untested (a
    mutant no selected test reaches counts against the score; skipped ones do not)."""
    tested = sum(counts.values()) - counts["skipped"] - counts["not checked"]
    detected = sum(counts[s] for s in DETECTED)
    return 100.0 * detected / tested if tested else 0.0


def _table(found: dict[str, dict[str, int | None]]) -> list[str]:
    head = ["module", "mutants", *COLUMNS, "score"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total: collections.Counter[str] = collections.Counter()
    for path, codes in found.items():
        counts = _counts(codes)
        total += counts
        row = [f"`{path}`", str(len(codes)), *(str(counts[c]) for c in COLUMNS)]
        lines.append("| " + " | ".join(row + [f"{score(counts):.1f}%"]) + " |")
    row = ["**all**", str(sum(total.values())), *(str(total[c]) for c in COLUMNS)]
    lines.append("| " + " | ".join(row + [f"**{score(total):.1f}%**"]) + " |")
    return lines


def _tests(selection: list[str]) -> list[str]:
    out, skip = [], False
    for arg in selection:
        if skip:
            out[-1] += f" `{arg}`"
            skip = False
        elif arg.startswith("-"):
            out.append(f"`{arg}`")
            skip = True
        else:
            out.append(f"`{arg}`" + (" (added for the survivors)" if arg in ADDED_TESTS else ""))
    return out


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min {seconds % 60:02.0f} s ({seconds:.0f} s)"


def report(wall: float | None, previous: str) -> tuple[str, list[dict[str, Any]]]:
    found = results()
    cfg = config()
    total: collections.Counter[str] = collections.Counter()
    for codes in found.values():
        total += _counts(codes)
    alive = survivors(found)
    known = reasons()
    unexplained = []
    if wall is None:  # a report written again from the same results keeps their run's time
        match = re.search(r"^- wall time of `make mutate`: (.*)$", previous, re.MULTILINE)
        wall_text = match.group(1) if match else "not measured"
    else:
        wall_text = f"{_minutes(wall)}, on {os.cpu_count()} cores"
    stamp = dt.datetime.fromtimestamp(
        max((MUTANTS / f"{p}.meta").stat().st_mtime for p in found), dt.UTC
    )
    out = [
        "# Mutation testing",
        "",
        "<!-- Written by docs/make_mutation.py from the results of `make mutate`; the reasons "
        "are docs/mutation_survivors.toml's. -->",
        "",
        "`make mutate` runs [mutmut](https://github.com/boxed/mutmut) over the commit "
        "(`store/io/commit.py`), the commit log (`store/history/log.py`, "
        "`store/history/operations.py`), the checksums (`store/storage/checksums.py`) and the "
        "sandboxed SQL session (`store/sql/session.py`): each mutant (one small change of one "
        "function: an operator, a constant, an argument dropped, a string, a return value) runs "
        "against the tests that reach the function, and a mutant no test fails survives. It "
        "starts from scratch each time (`mutants/`, git-ignored), is configured in "
        "`[tool.mutmut]` of `pyproject.toml`, and is not part of `make test`.",
        "",
        "The score is the share of mutants detected (a test failed, or the run timed out or "
        "crashed) among all mutants, those that no selected test reaches included. Each "
        "survivor is listed below with the reason it survives: an equivalent mutant (no "
        "observable behaviour tells it from the original), said why. A survivor that is not "
        "equivalent gets a test instead (the section after it).",
        "",
        "## The last run",
        "",
        f"- date: {stamp:%Y-%m-%d %H:%M} UTC",
        f"- tool: mutmut {importlib.metadata.version('mutmut')}, Python "
        f'{platform.python_version()}, `process_isolation = "{cfg.get("process_isolation")}"`',
        f"- wall time of `make mutate`: {wall_text}",
        f"- score: **{score(total):.1f}%** ({sum(total[s] for s in DETECTED)} of "
        f"{sum(total.values()) - total['skipped'] - total['not checked']} mutants detected; "
        f"{total['survived']} survived, all explained below)"
        if not [s for s in alive if reason_for(s, known) is None]
        else f"- score: **{score(total):.1f}%**",
        "- modules: " + ", ".join(f"`{p}`" for p in cfg["only_mutate"]),
        "- tests: " + ", ".join(_tests(cfg["pytest_add_cli_args_test_selection"])),
        "",
        *_table(found),
        "",
        "## Survivors and why each survives",
        "",
    ]
    by_function: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for s in alive:
        by_function[s["function"]].append(s)
    if not alive:
        out += ["None.", ""]
    for function, group in by_function.items():
        out += [f"### `{readable(function)}`", ""]
        for s in group:
            reason = reason_for(s, known)
            if reason is None:
                unexplained.append(s)
                reason = "**UNEXPLAINED** (a test to write, or a reason to give)"
            number = s["mutant"].rpartition("__mutmut_")[2]
            out += [f"- mutant {number}:", "", "  ```diff"]
            out += [f"  {line}" for line in s["change"]]
            out += ["  ```", "", "  " + reason.replace("\n", "\n  "), ""]
    out += _killed_section()
    return "\n".join(out).rstrip() + "\n", unexplained


def _killed_section() -> list[str]:
    if not KILLED.exists():
        return []
    data = json.loads(KILLED.read_text(encoding="utf-8"))
    out = [
        "## Killed since the first run",
        "",
        f"The first run ({data['baseline']['date']}, the selection without the tests added "
        f"for its survivors: {data['baseline']['score']}) left {data['baseline']['survived']} "
        f"mutants alive that are not equivalent ({data['baseline']['untested']} of them in "
        "functions no test of that selection reached). Each is detected now; the first added "
        "test that fails on it (a dash: detected by a timeout, or by one of the selection's "
        "other tests only):",
        "",
        "| function | mutants | killed by |",
        "|---|---|---|",
    ]
    rows: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for k in data["killed"]:
        rows[(readable(k["function"]), k["test"] or "-")].append(
            k["mutant"].rpartition("__mutmut_")[2]
        )
    for (function, test), numbers in sorted(rows.items()):
        numbers.sort(key=int)
        shown = f"`{test}`" if test != "-" else test
        out.append(f"| `{function}` | {', '.join(numbers)} | {shown} |")
    return out + [""]


# ---------------------------------------------------------------------------- baseline
def save_baseline(target: Path) -> None:
    found = results()
    total: collections.Counter[str] = collections.Counter()
    for codes in found.values():
        total += _counts(codes)
    data = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "score": f"{score(total):.1f}%",
        "selection": config()["pytest_add_cli_args_test_selection"],
        # (a mutant no test reaches survives too)
        "survivors": survivors(found, ("survived", "no tests")),
    }
    target.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(data['survivors'])} survivors ({data['score']}) saved in {target}")


def attribute(baseline_file: Path, timeout: int = 120) -> None:
    """For each survivor of the baseline that the newest results mark detected, the first
    test of :data:`ADDED_TESTS` that fails on it: those of them that reach its function
    (mutmut's stats of the newest run), run in ``mutants/`` as mutmut runs them."""
    baseline = json.loads(baseline_file.read_text(encoding="utf-8"))
    found = results()
    codes = {m: c for per in found.values() for m, c in per.items()}
    stats = json.loads((MUTANTS / "mutmut-stats.json").read_text(encoding="utf-8"))
    reaching = stats["tests_by_mangled_function_name"]
    known = reasons()
    todo = []
    for s in baseline["survivors"]:
        if reason_for(s, known) is not None:
            continue  # an equivalent mutant, explained
        now = [m for m in codes if function_of(m) == s["function"]]
        same = [m for m in now if change_of(m, s["path"]) == s["change"]]
        if same and status(codes[same[0]]) in DETECTED:
            tests = sorted(
                t for t in reaching.get(s["function"], ()) if t.split("::")[0] in ADDED_TESTS
            )
            todo.append({**s, "mutant": same[0], "tests": tests})
    for test in ADDED_TESTS:  # run as they are now (mutmut copied tests/ when it began)
        (MUTANTS / test).write_bytes((ROOT / test).read_bytes())
    os.chdir(MUTANTS)
    sys.path[:] = [str(MUTANTS)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
    import pytest

    options = ["-x", "-q", "-p", "no:cacheprovider", "--tb=no", "--no-header"]
    with open(os.devnull, "w") as quiet:
        saved = os.dup(1)
        os.dup2(quiet.fileno(), 1)
        pytest.main(["--collect-only", *options, *ADDED_TESTS])
        os.dup2(saved, 1)
    killed = []
    for i, s in enumerate(todo):
        failed = (
            _first_failure(pytest, s["mutant"], options + s["tests"], timeout) if s["tests"] else ""
        )
        killed.append({k: s[k] for k in ("mutant", "function", "change")} | {"test": failed})
        print(f"{i + 1}/{len(todo)} {s['mutant']}: {failed or '(no added test fails)'}")
    data = {
        "baseline": {
            "date": baseline["date"],
            "score": baseline["score"],
            "survived": len(baseline["survivors"])
            - sum(reason_for(s, known) is not None for s in baseline["survivors"]),
            "untested": sum(s["status"] == "no tests" for s in baseline["survivors"]),
        },
        "killed": killed,
    }
    KILLED.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {KILLED}")


def _first_failure(pytest: Any, mutant: str, args: list[str], timeout: int) -> str:
    """The first test of ``args`` that fails with ``mutant`` active (a forked pytest)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run the tests against this mutant
        os.close(read)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        signal.alarm(timeout)
        os.environ["MUTANT_UNDER_TEST"] = mutant

        class First:
            def pytest_runtest_logreport(self, report):
                if report.failed:
                    os.write(write, report.nodeid.encode() + b"\n")

        os._exit(pytest.main(args, plugins=[First()]))
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        failed = pipe.read().decode().split("\n")[0]
    _, code = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(code) not in (0, 1, -signal.SIGALRM):
        raise SystemExit(f"{mutant}: pytest exited {code} (the tests did not run)")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wall", type=float, help="the run's wall time in seconds")
    parser.add_argument("--save-baseline", type=Path, metavar="FILE")
    parser.add_argument("--attribute", type=Path, metavar="BASELINE")
    args = parser.parse_args()
    if args.save_baseline:
        save_baseline(args.save_baseline)
        return 0
    if args.attribute:
        attribute(args.attribute)
        return 0
    previous = REPORT.read_text(encoding="utf-8") if REPORT.exists() else ""
    text, unexplained = report(args.wall, previous)
    os.chdir(ROOT)
    REPORT.write_text(text, encoding="utf-8")
    print(f"wrote {REPORT}")
    if unexplained:
        print(f"\n{len(unexplained)} survivors without a reason; for {REASONS.name}:\n")
        print("\n".join(stanza(s) for s in unexplained))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
