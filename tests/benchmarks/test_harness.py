"""The benchmark harness: timing, rows and targets, exit status, run_all and the README table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402
import readme_table  # noqa: E402
from harness import Figure, Timing, custom, faster_than, within  # noqa: E402


def bench(**options) -> harness.Bench:
    return harness.Bench("toy", quick=options.pop("quick", False), json=options.pop("json", None))


# ---------------------------------------------------------------------------- timing
def test_measure_runs_round_robin_after_warmup_and_keeps_every_sample():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    t = harness.measure(fns, 3, warmup=2)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert t["a"].repeats == 3 and t["b"].repeats == 3


def test_timing_median_min_and_scaling():
    t = Timing((3.0, 1.0, 2.0, 10.0))
    assert t.median == 2.5 and t.min == 1.0
    assert t.scaled(0.5).samples == (1.5, 0.5, 1.0, 5.0)
    assert Figure(t).number == 2.5 and Figure(4.0).number == 4.0


# ---------------------------------------------------------------------------- rows
def test_row_ratios_are_speed_ups_against_baseline_and_peer_and_overhead_over_floor():
    b = bench()
    row = b.row("x", ours=2.0, baseline=60.0, peer=5.0, floor=1.0)
    assert row.ratio("baseline") == 30.0 and row.ratio("peer") == 2.5
    assert row.ratio("floor") == 2.0
    assert row.met is None  # no targets: context


@pytest.mark.parametrize(
    "target, met",
    [
        (faster_than("baseline", 30), True),
        (faster_than("peer", 3), False),
        (within("floor", 2), True),
        (within("floor", 1.5), False),
        (within("peer", 1.1), True),  # ours / peer = 0.4
        (within("peer", 0.3), False),
        (within("baseline", 0.01), False),
        (custom("flat", 1.2, "<=", 3), True),
        (custom("flat", 4.0, "<=", 3), False),
    ],
)
def test_targets_are_checked_against_the_row(target, met):
    row = bench().row("x", ours=2.0, baseline=60.0, peer=5.0, floor=1.0, targets=[target])
    assert row.met is met
    assert row.as_dict()["targets"][0]["met"] is met


def test_a_target_on_a_missing_figure_is_a_miss():
    row = bench().row("x", ours=1.0, targets=[faster_than("peer", 1)])
    assert row.met is False


def test_bad_target_references_are_refused():
    with pytest.raises(ValueError, match="ref must be one of"):
        faster_than("pier", 2)
    with pytest.raises(ValueError, match="op must be"):
        custom("x", 1.0, "<", 2)


# ---------------------------------------------------------------------------- exit status + JSON
def test_finish_exits_1_on_a_miss_and_writes_every_row(tmp_path, capsys):
    out = tmp_path / "toy.json"
    b = bench(json=str(out))
    b.row("fast", ours=Figure(Timing((1.0, 1.0, 1.0)), "ours"), baseline=Figure(50.0, "loop"),
          targets=[faster_than("baseline", 30)])  # fmt: skip
    b.row("slow", ours=3.0, floor=Figure(1.0, "memcpy"), targets=[within("floor", 2)],
          reason="three passes")  # fmt: skip
    assert b.finish() == 1
    printed = capsys.readouterr().out
    assert "MISSED" in printed and "why: three passes" in printed
    doc = json.loads(out.read_text())
    assert doc["schema"] == harness.SCHEMA and doc["bench"] == "toy" and doc["ok"] is False
    assert [r["met"] for r in doc["rows"]] == [True, False]
    assert doc["rows"][0]["ours"]["repeats"] == 3
    assert doc["rows"][1]["ratios"]["floor"] == 3.0
    assert "cores" in doc["machine"] and doc["quick"] is False


def test_finish_does_not_gate_quick_runs_and_passes_when_all_met(tmp_path):
    quick = bench(quick=True)
    quick.row("slow", ours=3.0, floor=1.0, targets=[within("floor", 2)])
    assert quick.finish() == 0
    full = bench()
    full.row("ok", ours=1.0, floor=1.0, targets=[within("floor", 2)])
    full.row("context", ours=5.0)
    assert full.finish() == 0


TOY_SCRIPT = """
import argparse, sys
sys.path.insert(0, {benchmarks!r})
import harness

parser = argparse.ArgumentParser()
harness.add_arguments(parser)
args = parser.parse_args()
bench = harness.Bench({name!r}, args)
t = harness.measure({{"ours": lambda: None, "floor": lambda: None}}, bench.repeats(3, 2))
bench.row("toy figure", ours=harness.Figure({ours}, "ours"), floor=harness.Figure(1.0, "floor"),
          targets=[harness.within("floor", 2)], reason="by construction")
sys.exit(bench.finish())
"""


def toy_script(directory: Path, name: str, ours: float) -> Path:
    path = directory / f"bench_{name}.py"
    path.write_text(TOY_SCRIPT.format(benchmarks=str(BENCHMARKS), name=name, ours=ours))
    return path


def test_a_bench_script_exits_non_zero_on_a_miss_and_writes_json_to_the_env_path(tmp_path):
    script = toy_script(tmp_path, "miss", ours=5.0)
    out = tmp_path / "out" / "miss.json"
    env = {"PATH": "/usr/bin:/bin", harness.ENV_OUT: str(out)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(out.read_text())["rows"][0]["met"] is False
    quick = subprocess.run([sys.executable, str(script), "--quick"], env=env, capture_output=True)
    assert quick.returncode == 0


def test_run_all_runs_every_script_after_a_failure_and_fails_at_the_end(tmp_path):
    toy_script(tmp_path, "a_miss", ours=5.0)
    toy_script(tmp_path, "b_met", ours=1.5)
    (tmp_path / "bench_c_crash.py").write_text("raise SystemExit(3)\n")
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--scripts-dir", str(tmp_path),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    summary = done.stdout.split("######## summary")[1]
    assert "bench_a_miss.py" in summary and "MISSED toy figure" in summary
    assert "why: by construction" in summary
    assert "bench_b_met.py" in summary and "1 met, 0 missed" in summary
    assert "bench_c_crash.py" in summary and "exit 3" in summary and "no JSON rows" in summary
    doc = json.loads(out.read_text())
    assert [r["rc"] for r in doc["runs"]] == [1, 0, 3]
    assert doc["ok"] is False and doc["kind"] == "run_all"


# ---------------------------------------------------------------------------- README table
def combined(tmp_path: Path) -> Path:
    b = bench()
    b.row("headline", ours=Figure(Timing((0.002,) * 5), "ours"),
          baseline=Figure(0.2, "lists"), peer=Figure(0.004, "numpy"),
          floor=Figure(0.001, "memcpy"),
          targets=[faster_than("baseline", 30), within("floor", 3)])  # fmt: skip
    b.row("a miss", ours=0.01, floor=Figure(0.001, "memcpy"), targets=[within("floor", 5)],
          reason="three float64 passes")  # fmt: skip
    b.row("small size", ours=0.001, detail=True)
    run = b.as_dict() | {"rc": 1, "wall_s": 1.0, "load_during": {"median": 2.1, "max": 3.4}}
    legacy = {"script": "bench_legacy.py", "bench": "legacy", "rows": [], "rc": 0}
    doc = {"schema": harness.SCHEMA, "kind": "run_all", "quick": False, "wall_s": 12.0,
           "started": "2026-01-02T03:04:05+00:00", "machine": harness.machine(),
           "runs": [run, legacy]}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    return path


def test_readme_table_renders_every_row_with_its_ratios_targets_and_misses(tmp_path):
    runs = harness.load_results([combined(tmp_path)])
    table = readme_table.render(runs, json.loads((tmp_path / "results.json").read_text()))
    lines = table.splitlines()
    assert "median of" in lines[0] and "cores" in lines[0] and "load average" in lines[0]
    rows = [line for line in lines if line.startswith("| ") and "benchmark" not in line]
    assert len(rows) == 3  # the detail row stays out; the legacy script gets a line
    headline = rows[0].split(" | ")
    assert headline[1:5] == ["ours 2.00 ms", "lists 200.00 ms", "numpy 4.00 ms", "memcpy 1.00 ms"]
    assert headline[5:9] == ["100x", "2.00x", "2.00x", "5"]
    assert rows[0].endswith("| met |")
    assert "**missed** (<= 5x floor): three float64 passes" in rows[1]
    assert "bench_legacy.py" in rows[2] and "no rows in the harness JSON" in rows[2]


def test_readme_table_replaces_only_the_marked_block_and_checks_it(tmp_path):
    results = combined(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n## Benchmarks\n\nintro\n\n<!-- bench:start -->\nold table\n<!-- bench:end -->\n"
        "\nafter\n"
    )
    script = [sys.executable, str(BENCHMARKS / "readme_table.py"), str(results)]
    check = subprocess.run([*script, "--doc", str(readme), "--check"], capture_output=True)
    assert check.returncode == 1
    subprocess.run([*script, "--doc", str(readme)], check=True, capture_output=True)
    text = readme.read_text()
    assert text.startswith("# x\n\n## Benchmarks\n\nintro\n\n<!-- bench:start -->\n")
    assert text.endswith("<!-- bench:end -->\n\nafter\n")
    assert "old table" not in text and "| headline |" in text
    check = subprocess.run([*script, "--readme", str(readme), "--check"], capture_output=True)
    assert check.returncode == 0  # (--readme: the old name of --doc)


def test_readme_table_refuses_quick_results(tmp_path):
    path = combined(tmp_path)
    doc = json.loads(path.read_text())
    doc["runs"][0]["quick"] = True
    path.write_text(json.dumps(doc))
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "readme_table.py"), str(path)], capture_output=True
    )
    assert done.returncode == 2


def test_the_benchmark_page_has_the_marked_block_and_the_readme_links_it():
    """The table lives in docs/benchmarks.md (it was 60 rows of long cells in the README,
    before the explorer); the README links the page and holds no table of its own."""
    text = (BENCHMARKS.parent / "docs" / "benchmarks.md").read_text()
    assert text.count(readme_table.START) == text.count(readme_table.END) == 1
    table = text.split(readme_table.START, 1)[1].split(readme_table.END, 1)[0]
    assert table.count("\n| ") > 20  # the rows, with their reasons
    readme = (BENCHMARKS.parent / "README.md").read_text()
    assert "(docs/benchmarks.md)" in readme and readme_table.START not in readme
