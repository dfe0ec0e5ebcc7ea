"""The ``maxent-arrow`` command line, called in process (``main(argv)``) and, for the exit
code contract, as the installed console script in a subprocess."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from maxent_arrow.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, main
from maxent_arrow.errors import ArgumentError
from maxent_arrow.testing import write_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("cli") / "store", eval_steps=(1,), seed=5)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"maxent-arrow {command}: error: ")
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------- commands


def test_inspect_json(capsys, store):
    code, out, _ = run(capsys, "inspect", store.root, "--json")
    assert code == EXIT_OK
    info = json.loads(out)
    assert info["schema_version"] == "2.2" and info["store_version"] == "3.0"
    assert info["ranks"] == [0, 1]
    assert info["kinds"]["train"]["steps"] == 4 and info["kinds"]["eval"]["steps"] == 1
    assert info["kinds"]["train"]["samples"] == sum(len(g.utils) for g in store.train())
    assert info["group_rows"] == len(store.groups)
    assert info["config"]["max_completion_len"] == 24
    assert info["bytes"]["groups"] == sum(
        p.stat().st_size for p in (store.root / "groups").glob("*")
    )


def test_inspect_readable(capsys, store):
    code, out, _ = run(capsys, "inspect", store.root)
    assert code == EXIT_OK
    assert "train steps:" in out and "(steps 0..3" in out and "accuracy" in out


def test_query_json_matches_numpy(capsys, store):
    code, out, _ = run(
        capsys,
        "query",
        store.root,
        "SELECT step, avg(total_util) AS m, count(*) AS n FROM samples WHERE kind = 'train' "
        "GROUP BY step ORDER BY step",
        "--json",
    )
    assert code == EXIT_OK
    rows = json.loads(out)
    for row, (step, groups) in zip(rows, store.by_step().items(), strict=True):
        values = np.concatenate([g.utils for g in groups])
        assert row["step"] == step and row["n"] == values.size
        assert row["m"] == pytest.approx(values.mean())


def test_query_csv_and_table(capsys, store):
    sql = "SELECT step, rank, group_index, total_utils FROM groups WHERE step = 2 ORDER BY ALL"
    code, out, _ = run(capsys, "query", store.root, sql, "--csv")
    assert code == EXIT_OK
    rows = list(csv.DictReader(io.StringIO(out)))
    expected = sorted((g for g in store.groups if g.step == 2), key=lambda g: (g.rank, g.index))
    assert len(rows) == len(expected)
    for row, g in zip(rows, expected):
        assert json.loads(row["total_utils"]) == pytest.approx(g.utils.tolist())
    code, out, _ = run(capsys, "query", store.root, sql, "--max-rows", "2")
    assert code == EXIT_OK
    assert "total_utils" in out and "showing 2" in out


def test_query_errors(capsys, store, tmp_path):
    code, _, err = run(capsys, "query", store.root, "SELECT nope FROM groups")
    assert code == EXIT_USAGE  # a column the views lack: the user's mistake
    assert "nope" in one_line_error(err, "query")
    code, _, err = run(capsys, "query", tmp_path / "missing", "SELECT 1")
    assert code == EXIT_USAGE  # neither a run directory nor a store: the user's mistake
    assert "missing: not a run" in one_line_error(err, "query")
    code, _, err = run(capsys, "query", store.root, "SELECT 1", "--json", "--csv")
    assert code == EXIT_USAGE and "not allowed with" in err


def test_report_json(capsys, store, tmp_path):
    code, out, err = run(
        capsys, "report", store.root, "--out", tmp_path / "r", "--json", "--k", 2, "--progress"
    )
    assert code == EXIT_OK
    assert "report" in err and "9/9" in err  # the tqdm bar over the report's parts
    result = json.loads(out)
    assert Path(result["html"]).is_file() and Path(result["markdown"]).is_file()
    # The fixture records no losses: every other plot is drawn, and the losses said absent.
    assert len(result["plots"]) == 8 and set(result["skipped"]) == {"losses"}
    assert all(Path(p).stat().st_size > 1000 for p in result["plots"].values())
    assert "pass_at_2" in result["summary"]["trends"]
    code, _, err = run(capsys, "report", store.root, "--out", tmp_path / "x", "--bins", 0)
    assert code == EXIT_USAGE
    one_line_error(err, "report")


def test_report_out_in_the_store_is_refused_and_writes_nothing(capsys, store, tmp_path):
    """Fault probe F06: ``report RUN --out RUN`` (or a directory inside the store, or a
    link to one) would write its plots and pages among the store's files: a usage error
    naming the store, and nothing is written."""

    def files():
        return sorted(p.relative_to(store.root) for p in store.root.rglob("*"))

    before = files()
    (tmp_path / "link").symlink_to(store.root)
    for out in (store.root, store.root / "report", store.root / "log" / "r", tmp_path / "link"):
        code, _, err = run(capsys, "report", store.root, "--out", out)
        assert code == EXIT_USAGE, (out, err)
        line = one_line_error(err, "report")
        assert str(store.root) in line and "outside the store" in line
    assert files() == before


def test_unknown_kinds_steps_and_record_tables_are_usage_errors(capsys, store):
    """Fault probe F07: a kind, a step or a record table the store has none of is a usage
    error naming it and what there is, never exit 0 with an empty answer; a registered
    record table with no rows stays an empty answer."""
    for argv, named in (
        (("offpolicy", store.root, "--kind", "nope"), "'nope': the store has no steps of it"),
        (("offpolicy", store.root, "--steps", 999, 2), "steps [999]"),
        (("files", store.root, "--table", "records:nope"), "record table 'nope'"),
    ):
        code, out, err = run(capsys, *argv)
        assert code == EXIT_USAGE and out == "", (argv, out, err)
        line = one_line_error(err, argv[0])
        assert named in line, line
    assert "its kinds: eval, train" in run(capsys, "offpolicy", store.root, "--kind", "x")[2]
    assert "its 4 train steps: 0..3" in run(capsys, "offpolicy", store.root, "--steps", 9)[2]
    _, _, err = run(capsys, "files", store.root, "--table", "records:x")
    assert "its record tables: attempt_ends, lifecycle, trainer_metrics" in err
    code, out, _ = run(capsys, "files", store.root, "--table", "records:lifecycle")
    assert (code, out) == (EXIT_OK, "")  # registered, no rows
    code, out, _ = run(capsys, "offpolicy", store.root, "--steps", 2, "--json")
    assert code == EXIT_OK and [r["step"] for r in json.loads(out)] == [2]


@pytest.mark.parametrize("port", ["-1", "70000", "http"])
def test_view_port_out_of_range_is_a_usage_error(capsys, store, port):
    """Fault probe F03: ``view --port -1`` (or 70000) was exit 4, "unexpected
    OverflowError"; it is argparse's usage error naming the option, before the store is
    opened, and the Viewer refuses it too (an ArgumentError naming the port)."""
    code, _, err = run(capsys, "view", store.root, f"--port={port}")
    assert code == EXIT_USAGE
    assert "argument --port: expected a port" in err and "OverflowError" not in err
    if port != "http":
        pytest.importorskip("starlette")
        from maxent_arrow.explorer.server import Viewer

        with pytest.raises(
            ArgumentError, match=f"view: port: expected an int in 0..65535, got {port}"
        ):
            Viewer(store.root, port=int(port))


def test_verify_ok_then_damaged(capsys, tmp_path):
    w = write_store(tmp_path / "s", steps=range(3), ranks=1)
    code, out, _ = run(capsys, "verify", w.root, "--json")
    assert code == EXIT_OK and json.loads(out)["ok"] is True
    victim = sorted((w.root / "groups").glob("*.parquet"))[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", w.root, "--json")
    assert code == EXIT_DATA
    report = json.loads(out)
    assert report["ok"] is False
    assert any(victim.name in p["path"] for p in report["problems"])


def test_verify_refuses_a_directory_that_is_not_a_store(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "verify", tmp_path / "empty")
    assert code == EXIT_USAGE
    line = one_line_error(err, "verify")
    assert "not a run: expected a run directory (its store in store/) or a store" in line
    assert not (tmp_path / "empty" / "manifest.json").exists()  # nothing created


def test_compact_keeps_every_answer(capsys, tmp_path):
    w = write_store(tmp_path / "s", steps=range(5), ranks=2, eval_steps=(2,))
    sql = (
        "SELECT kind, step, rank, group_index, total_utils FROM groups "
        "ORDER BY kind, step, rank, group_index"
    )
    _, before, _ = run(capsys, "query", w.root, sql, "--json")
    files_before = len(list((w.root / "groups").glob("*.parquet")))
    code, out, err = run(capsys, "compact", w.root, "--json", "--progress")
    assert code == EXIT_OK and json.loads(out)["compacted"]
    assert "compacting" in err  # the bar went to stderr, stdout stayed pure JSON
    assert len(list((w.root / "groups").glob("*.parquet"))) < files_before
    _, after, _ = run(capsys, "query", w.root, sql, "--json")
    assert json.loads(after) == json.loads(before)
    # The command line takes what the library takes (max_steps >= 1) and reports the
    # library's refusal of the rest as a usage error.
    code, out, _ = run(capsys, "compact", w.root, "--max-steps", 1, "--json")
    assert code == EXIT_OK
    assert json.loads(out) == {"compacted": [], "written": [], "replaced": 0}
    code, _, err = run(capsys, "compact", w.root, "--max-steps", 0)
    assert code == EXIT_USAGE and "max_steps: expected None or an int >= 1" in err


def test_export_ipc(capsys, store, tmp_path):
    code, out, _ = run(capsys, "export", store.root, "--to", "ipc", tmp_path / "ipc", "--json")
    assert code == EXIT_OK
    written = {Path(p).name: Path(p) for p in json.loads(out)["written"]}
    assert set(written) == {"groups.train.arrow", "groups.eval.arrow", "steps.arrow"}
    with pa.memory_map(str(written["groups.train.arrow"])) as source:
        table = pa.ipc.open_file(source).read_all()
    assert table.num_rows == len(store.train())
    got = sorted(
        zip(
            table.column("step").to_pylist(),
            table.column("rank").to_pylist(),
            table.column("group_index").to_pylist(),
            table.column("total_utils").to_pylist(),
        )
    )
    want = sorted((g.step, g.rank, g.index, g.utils.tolist()) for g in store.train())
    assert got == want
    # A non-empty target is refused, and nothing is written into it.
    code, _, err = run(capsys, "export", store.root, "--to", "ipc", tmp_path / "ipc")
    assert code == EXIT_DATA and "not empty" in one_line_error(err, "export")


def test_export_hf(capsys, store, tmp_path):
    datasets = pytest.importorskip("datasets")
    code, out, _ = run(capsys, "export", store.root, "--to", "hf", tmp_path / "hf")
    assert code == EXIT_OK
    groups = datasets.load_from_disk(str(tmp_path / "hf" / "groups"))
    steps = datasets.load_from_disk(str(tmp_path / "hf" / "steps"))
    assert groups["train"].num_rows == len(store.train())
    assert groups["eval"].num_rows == len(store.groups) - len(store.train())
    assert steps.num_rows == len(store.step_rows)
    row = groups["train"][0]
    match = next(
        g
        for g in store.train()
        if (g.step, g.rank, g.index) == (row["step"], row["rank"], row["group_index"])
    )
    assert row["total_utils"] == pytest.approx(match.utils.tolist())
    assert not [p for p in (tmp_path / "hf").iterdir() if p.name.startswith(".tmp")]


# ---------------------------------------------------------------------- usage and help
# Each command's --help, and the commands --help lists: tests/cli/test_commands.py.


def test_top_level_help_and_usage_errors(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == EXIT_OK and "Exit codes" in out
    assert run(capsys, "frobnicate")[0] == EXIT_USAGE
    assert run(capsys)[0] == EXIT_USAGE
    assert run(capsys, "export", "x", "--to", "zip", "y")[0] == EXIT_USAGE


def test_demo_is_delegated(capsys):
    code, out, _ = run(capsys, "demo", "--help")
    assert code == EXIT_OK
    assert out.startswith("usage:")


@pytest.mark.slow
def test_console_script_exit_codes(store, tmp_path):
    exe = Path(sys.executable).with_name("maxent-arrow")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "maxent_arrow.cli"]
    ok = subprocess.run(
        [*cmd, "inspect", str(store.root), "--json"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ranks"] == [0, 1]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{")  # a store whose manifest is damaged
    bad = subprocess.run(
        [*cmd, "verify", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    nope = subprocess.run(
        [*cmd, "verify", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert nope.returncode == 2 and "not a run" in nope.stderr
    usage = subprocess.run([*cmd, "query"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2
