"""Fault class: bad command-line input. Every command takes a run directory or its store and
refuses what is neither (exit 2, one line saying what was expected);
``query`` runs exactly one read-only statement (anything else is a usage error, exit 2) and
reads no file outside the store's views; Ctrl-C stops a long query (exit 130); no input gives a
traceback. Read commands change nothing on disk.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from fault_harness import env, snapshot

from maxent_arrow import RolloutBatch, RolloutStore, StoreError
from maxent_arrow.cli import EXIT_DATA, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main
from maxent_arrow.testing import make_batch

READ_COMMANDS = [
    ["inspect"],
    ["query", "SELECT 1"],
    ["report", "--out", "OUT"],
    ["verify"],
    ["export", "--to", "ipc", "OUT"],
    ["repair"],
    ["compact"],
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A demo-like run directory: the store one level down, beside other files."""
    base = tmp_path_factory.mktemp("run")
    store = RolloutStore.create(base / "store", config={"max_completion_len": 16})
    for step in range(3):
        store.append(make_batch(step))
    store.append(make_batch(1, kind="eval"))
    (base / "snapshots").mkdir()
    return base


def _call(capsys, argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    return code, out, lines


def _argv(command, root, tmp_path):
    return [command[0], root, *[a.replace("OUT", str(tmp_path / "out")) for a in command[1:]]]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0])
def test_every_command_refuses_what_is_not_a_store(capsys, tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    for root in (empty, tmp_path / "missing", ""):
        code, _, lines = _call(capsys, _argv(command, root, tmp_path))
        assert code in (EXIT_DATA, EXIT_USAGE), lines
        assert len(lines) == 1 and ("not a rollout store" in lines[0] or "store" in lines[0])
    assert list(empty.iterdir()) == []  # nothing created


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0])
def test_every_command_takes_the_run_directory_as_its_store(capsys, tmp_path, run_dir, command):
    """One way to name a run: ``RUN`` and ``RUN/store`` are the same run to every command
    (it was exit 1, "did you mean RUN/store?"); the reads still change nothing."""
    before = snapshot(run_dir)
    code, by_run, lines = _call(capsys, _argv(command, run_dir, tmp_path / "a"))
    assert code == EXIT_OK, lines
    code, by_store, lines = _call(capsys, _argv(command, run_dir / "store", tmp_path / "b"))
    assert code == EXIT_OK, lines
    if command[0] not in ("repair", "compact"):  # (the first compaction leaves none to do)
        assert by_run.replace(str(tmp_path / "a"), "") == by_store.replace(str(tmp_path / "b"), "")
        assert snapshot(run_dir) == before


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["query", "SELECT count(*) FROM samples"],
        ["verify"],
        ["report", "--out", "OUT"],
    ],
    ids=lambda c: c[0],
)
def test_read_commands_change_nothing_in_the_store(capsys, tmp_path, run_dir, command):
    root = run_dir / "store"
    before = snapshot(root)
    code, _, lines = _call(capsys, _argv(command, root, tmp_path))
    assert code == EXIT_OK, lines
    assert snapshot(root) == before


@pytest.mark.parametrize(
    ("sql", "why"),
    [
        ("", "empty"),
        ("   ;  ", "empty"),
        ("SELECT 1; SELECT 2", "exactly one"),
        ("COPY (SELECT 1) TO 'OUT/x.csv'", "COPY"),
        ("COPY (SELECT 1) TO 'STORE/groups/step-0000000000.rank-00000.train.parquet' "
         "(FORMAT parquet, USE_TMP_FILE false)", "COPY"),
        ("ATTACH 'OUT/x.duckdb'", "ATTACH"),
        ("INSTALL httpfs", "only SELECT"),
        ("SET threads = 1", "SET"),
        ("CREATE TABLE t AS SELECT 1", "CREATE"),
        ("EXPLAIN ANALYZE COPY (SELECT 1) TO 'OUT/y.csv'", "EXPLAIN"),
        ("PRAGMA version", "PRAGMA"),
    ],
)  # fmt: skip
def test_query_runs_one_read_only_statement(capsys, tmp_path, run_dir, sql, why):
    root = run_dir / "store"
    (tmp_path / "out").mkdir()
    before = snapshot(root)
    sql = sql.replace("OUT", str(tmp_path / "out")).replace("STORE", str(root))
    code, _, lines = _call(capsys, ["query", root, sql])
    assert code == EXIT_USAGE, lines
    assert len(lines) == 1 and why in lines[0], lines
    assert snapshot(root) == before
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM 'OUT/secret.parquet'",
        "SELECT * FROM read_parquet('STORE/../*.parquet')",
    ],
)
def test_query_reads_no_file_outside_the_views(capsys, tmp_path, run_dir, sql):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "secret.parquet").write_bytes(b"PAR1")
    root = run_dir / "store"
    sql = sql.replace("OUT", str(tmp_path / "out")).replace("STORE", str(root))
    code, _, lines = _call(capsys, ["query", root, sql])
    assert code == EXIT_DATA, lines
    assert len(lines) == 1 and ("Permission" in lines[0] or "disabled" in lines[0]), lines


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "STORE", "--out", "OUT", "--threshold", "nan"],
        ["report", "STORE", "--out", "OUT", "--threshold", "inf"],
        ["report", "STORE", "--out", "OUT", "--bins", "0"],
        ["compact", "STORE", "--max-steps", "0"],
        ["query", "STORE", "SELECT 1", "--on-error", "maybe"],
        ["demo", "--steps", "-1"],
        ["demo", "--k", "zero"],
        ["inspect"],
        ["nosuchcommand"],
    ],
)
def test_bad_arguments_are_usage_errors(capsys, tmp_path, run_dir, argv):
    argv = [a.replace("STORE", str(run_dir / "store")).replace("OUT", str(tmp_path)) for a in argv]
    code = main(argv)
    _, err = capsys.readouterr()
    assert code == EXIT_USAGE, err
    assert "Traceback" not in err and err.strip()


def test_a_foreign_step_file_is_no_commit_and_no_crash(capsys, tmp_path):
    """A file in steps/ that no commit log entry names (a user's, another tool's) commits
    nothing: every command goes on as if it were not there, and verify notes it."""
    store = RolloutStore.create(tmp_path / "s")
    store.append(make_batch(0))
    foreign = tmp_path / "s" / "steps" / "step-0000000005.rank-00000.train.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"step": [5]}), foreign)
    code, out, _ = _call(capsys, ["inspect", tmp_path / "s", "--json"])
    assert code == EXIT_OK and json.loads(out)["kinds"]["train"]["last"] == 0
    code, out, _ = _call(capsys, ["query", tmp_path / "s", "SELECT DISTINCT step FROM groups"])
    assert code == EXIT_OK and "5" not in out
    code, out, _ = _call(capsys, ["verify", tmp_path / "s"])
    assert code == EXIT_OK and f"note {foreign}" in out and "uncommitted" in out


# Hours of work (a range of 4e12 rows): the query is still running whenever the Ctrl-C lands,
# however fast or loaded the machine (4e9 rows took under 3 s on an idle one).
LONG_QUERY = "SELECT count(*) FROM range(4000000000000) a WHERE a.range * 7 % 13 = 5"


def test_ctrl_c_stops_a_long_query_with_exit_130(run_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "maxent_arrow.cli", "query", str(run_dir / "store"), LONG_QUERY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    time.sleep(3.0)  # startup and the query under way
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the query did not stop on Ctrl-C")
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "interrupted" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- what a query may be
@pytest.mark.parametrize(
    ("sql", "code"),
    [
        ("EXPLAIN /**/ ANALYZE SELECT count(*) FROM groups", EXIT_OK),
        ("EXPLAIN -- a comment\n ANALYZE SELECT 1", EXIT_OK),
        ("EXPLAIN /* ) */ ANALYZE COPY (SELECT 1) TO 'OUT/x.csv'", EXIT_USAGE),
        ("EXPLAIN /**/ (FORMAT JSON) INSTALL httpfs", EXIT_USAGE),
    ],
)
def test_explain_with_comments_is_checked_like_any_statement(capsys, tmp_path, run_dir, sql, code):
    (tmp_path / "out").mkdir()
    got, out, lines = _call(capsys, ["query", run_dir / "store", sql.replace("OUT", str(tmp_path))])
    assert got == code, lines
    if code == EXIT_USAGE:
        assert len(lines) == 1 and "EXPLAIN" in lines[0], lines
    assert list((tmp_path / "out").iterdir()) == []


def test_query_prints_every_type_duckdb_returns(capsys, run_dir):
    """An INTERVAL in CSV, NaN and infinities in JSON (which has no such numbers: null)."""
    root = run_dir / "store"
    code, out, lines = _call(capsys, ["query", root, "SELECT INTERVAL 1 DAY AS i, 2 AS n", "--csv"])
    assert code == EXIT_OK and out.splitlines()[0] == '"i","n"' and "days=1" in out, lines
    sql = "SELECT 'nan'::DOUBLE AS x, 'inf'::DOUBLE AS y, 1.5::DOUBLE AS z"
    code, out, lines = _call(capsys, ["query", root, sql, "--json"])

    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    assert code == EXIT_OK, lines
    assert json.loads(out, parse_constant=refuse) == [{"x": None, "y": None, "z": 1.5}]


def test_a_reward_name_with_a_nul_byte_is_reported_and_queried(capsys, tmp_path):
    root = tmp_path / "store"
    store = RolloutStore.create(root)
    batch = make_batch(0, reward_names=("a\x00b", "acc"))
    store.append(batch)
    code, _, lines = _call(capsys, ["report", root, "--out", tmp_path / "report", "--json"])
    assert code == EXIT_OK, lines
    sql = "SELECT count(*) AS n, sum(reward_acc) AS s FROM samples"
    code, out, lines = _call(capsys, ["query", root, sql, "--json"])
    assert code == EXIT_OK, lines
    assert json.loads(out)[0]["n"] == batch.num_samples


def test_export_hf_of_a_kind_with_only_empty_steps(capsys, tmp_path):
    datasets = pytest.importorskip("datasets")
    root = tmp_path / "store"
    store = RolloutStore.create(root)
    store.append(make_batch(0))
    empty = make_batch(1, kind="eval")
    row = {**empty.step_row.to_pylist()[0], "num_groups": 0, "num_samples": 0}
    store.append(
        RolloutBatch(empty.groups.slice(0, 0), pa.Table.from_pylist([row], empty.step_row.schema))
    )
    code, _, lines = _call(capsys, ["export", root, "--to", "hf", tmp_path / "hf"])
    assert code == EXIT_OK, lines
    groups = datasets.load_from_disk(str(tmp_path / "hf" / "groups"))
    assert groups["train"].num_rows == make_batch(0).num_groups and groups["eval"].num_rows == 0


# ---------------------------------------------------------------------------- bounded queries (F13)
def test_every_query_session_has_a_memory_limit_and_threads_from_the_machine(run_dir):
    """DuckDB's own default looks at the host's memory, not a container's limit, and spills
    to ./.tmp: every session here sets both bounds and no spill directory."""
    from maxent_arrow.store.sql.session import (
        MEMORY_SHARE,
        QueryLimits,
        machine_memory,
        machine_threads,
    )

    store = RolloutStore(run_dir / "store")
    with store.sql_views() as views:
        settings = views.con.execute(
            "SELECT current_setting('memory_limit'), current_setting('threads'), "
            "current_setting('temp_directory')"
        ).fetchall()[0]
        limit = views.limits.memory
    assert limit == int(machine_memory() * MEMORY_SHARE) and settings[1] == machine_threads()
    assert settings[2] == ""
    with store.sql_views(limits=QueryLimits(memory=64 << 20)) as views:
        with pytest.raises(StoreError, match="memory limit"):
            views.query("SELECT repeat('x', 1000) AS s FROM range(200000)")  # a 200 MB result


def test_a_query_stops_at_its_timeout(capsys, run_dir):
    start = time.monotonic()
    code, _, lines = _call(capsys, ["query", run_dir / "store", LONG_QUERY, "--timeout", "1"])
    assert code == EXIT_DATA and len(lines) == 1 and "timeout of 1 s" in lines[0], lines
    assert time.monotonic() - start < 30
    store = RolloutStore(run_dir / "store", query_timeout=0.5)
    with pytest.raises(StoreError, match="timeout"):
        store.sql(LONG_QUERY)


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "STORE", "--out", "OUT", "--bins", "1000000000"],
        ["report", "STORE", "--out", "OUT", "--k", "100000000"],
        ["report", "STORE", "--out", "OUT", "--timeout", "0"],
        ["query", "STORE", "SELECT 1", "--timeout", "soon"],
        ["compact", "STORE", "--lock-timeout", "-1"],
    ],
)
def test_report_and_query_bounds_are_usage_errors(capsys, tmp_path, run_dir, argv):
    argv = [a.replace("STORE", str(run_dir / "store")).replace("OUT", str(tmp_path)) for a in argv]
    code, _, lines = _call(capsys, argv)
    assert code == EXIT_USAGE and len(lines) >= 1, lines
