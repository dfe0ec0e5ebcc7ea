"""The command line's first-hour snags (issue 20, part 3), each pinned by a test: SQL mistakes
said in full with one exit code, hints for a mistyped command and unquoted SQL, every error
with its message, ``inspect``'s recorded tokenizer, model and rank count, progress bars that
obey ``--no-progress`` and show totals and rates, damaged footers named and skipped by any
query, ``--max-rows``, and a ``--help`` that loads no heavy package (how fast it answers is
``benchmarks/bench_scale.py``'s measure)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxent_arrow.analytics.run import RunAnalytics
from maxent_arrow.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, main
from maxent_arrow.errors import QueryError, StoreError
from maxent_arrow.testing import write_store

TOKENIZER = {"class": "ByT5Tokenizer", "name_or_path": "google/byt5-small", "vocab_size": 384}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(
        tmp_path_factory.mktemp("snags") / "store",
        eval_steps=(1,),
        seed=7,
        config={"model": "sshleifer/tiny-gpt2", "tokenizer": TOKENIZER, "trainer": "maxent-arrow"},
    )


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str, command: str | None) -> str:
    """The one line an error is said in (argparse's usage line aside)."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")]
    assert len(lines) == 1, err
    where = f"maxent-arrow {command}" if command else "maxent-arrow"
    assert lines[0].startswith(f"{where}: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------- SQL mistakes


@pytest.mark.parametrize(
    ("sql", "kind", "hint"),
    [
        ("SELECT * FROM sample", "Catalog Error", 'Did you mean "samples"'),
        ("SELECT stpe FROM samples", "Binder Error", "Candidate bindings"),
        ("SELECT step FROM samples WHERE kind = train", "Binder Error", "quoted in SQL: 'train'"),
        ("SELECT step FROM samples WHERE", "Parser Error", 'syntax error at or near "WHERE"'),
        ("SELECT avg_of(total_util) FROM samples", "Catalog Error", "Did you mean"),
        # The user's own EXPLAIN ANALYZE: planned again without running it, place kept.
        ("EXPLAIN ANALYZE SELECT stpe FROM samples", "Binder Error", 'column 24: "stpe"'),
    ],
)
def test_a_sql_mistake_is_said_in_full_with_the_usage_exit_code(capsys, store, sql, kind, hint):
    """Parser, binder and catalog errors: the user's mistake (exit 2), DuckDB's hints kept
    ("Did you mean", "Candidate bindings"), the place in the query, on one line."""
    code, _, err = run(capsys, "query", store.root, sql)
    line = error_line(err, "query")
    assert code == EXIT_USAGE, line
    assert kind in line and hint in line, line
    assert "(at line 1" in line  # where in the query
    # The library says the same, as a QueryError.
    with RunAnalytics(store.root) as analytics, pytest.raises(QueryError) as caught:
        analytics.sql(sql)
    assert hint in str(caught.value)


def test_an_error_while_the_query_runs_is_a_data_error(capsys, store):
    """The one rule's other side: a statement that binds but fails on the data (a value
    that does not convert) is exit 1, with DuckDB's message."""
    code, _, err = run(capsys, "query", store.root, "SELECT prompt::INTEGER AS n FROM groups")
    line = error_line(err, "query")
    assert code == EXIT_DATA and "Conversion Error" in line, line
    with RunAnalytics(store.root) as analytics, pytest.raises(StoreError):
        analytics.sql("SELECT prompt::INTEGER AS n FROM groups")


def test_the_readme_states_the_exit_code_rule():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("Exit codes") :][:2500]
    assert re.search(r"[Pp]arser.*[Bb]inder.*[Cc]atalog", section, re.S), section


# ---------------------------------------------------------------------- hints


def test_unquoted_sql_gets_a_hint_to_quote_it(capsys, store):
    # The shell split the query into words: argparse sees extra arguments.
    code, _, err = run(capsys, "query", store.root, "SELECT", "step", "FROM", "samples")
    assert code == EXIT_USAGE
    assert "quote it" in error_line(err, None)
    # Only the first word reached the query (the rest went elsewhere, e.g. a pipe).
    code, _, err = run(capsys, "query", store.root, "SELECT")
    assert code == EXIT_USAGE
    assert "quote the whole SQL as one argument" in error_line(err, "query")


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["inspct", "x"], "did you mean 'inspect'?"),
        (["qurey", "x", "SELECT 1"], "did you mean 'query'?"),
        (["export", "x", "--to", "hff", "y"], "did you mean 'hf'?"),
    ],
)
def test_a_mistyped_command_or_choice_gets_did_you_mean(capsys, argv, suggestion):
    code, _, err = run(capsys, *argv)
    assert code == EXIT_USAGE
    assert suggestion in err


def test_a_name_close_to_nothing_gets_no_suggestion(capsys):
    code, _, err = run(capsys, "zzzzzz")
    assert code == EXIT_USAGE and "did you mean" not in err


# ---------------------------------------------------------------------- errors said


def test_the_demo_refusing_its_out_directory_says_why(capsys, tmp_path):
    """A non-empty directory that is not a demo run: refused with its message (it was exit 2
    with nothing printed)."""
    (tmp_path / "mine.txt").write_text("not a demo")
    code, _, err = run(capsys, "demo", "--out", tmp_path, "--steps", 1)
    assert code == EXIT_USAGE
    assert str(tmp_path) in error_line(err, "demo")
    assert (tmp_path / "mine.txt").read_text() == "not a demo"


# ---------------------------------------------------------------------- inspect


def test_inspect_shows_the_recorded_tokenizer_model_and_rank_count(capsys, store, tmp_path):
    code, out, _ = run(capsys, "inspect", store.root)
    assert code == EXIT_OK
    lines = dict(line.split(":", 1) for line in out.splitlines() if re.match(r"^\w[\w ]*:", line))
    assert lines["tokenizer"].strip() == "ByT5Tokenizer google/byt5-small (vocabulary 384)"
    assert lines["model"].strip() == "sshleifer/tiny-gpt2"
    assert lines["ranks"].strip() == "2 (ranks 0, 1)"
    code, out, _ = run(capsys, "inspect", store.root, "--json")
    recorded = json.loads(out)["run_config"]
    assert recorded["config"]["tokenizer"] == TOKENIZER and recorded["step"] == 3
    one = write_store(tmp_path / "one", steps=range(2), ranks=1)
    code, out, _ = run(capsys, "inspect", one.root)
    assert "ranks:           1 (rank 0)" in out
    assert "tokenizer:       -" in out  # not recorded: said so, not "{}"


# ---------------------------------------------------------------------- progress


def test_export_no_progress_draws_no_bar(capfd, store, tmp_path):
    """``datasets`` draws its own "Saving the dataset" bars unless told not to."""
    pytest.importorskip("datasets")
    assert (
        main(["export", str(store.root), "--to", "hf", str(tmp_path / "hf"), "--no-progress"]) == 0
    )
    out, err = capfd.readouterr()
    assert err == "", err
    assert out.count("wrote ") == 2


@pytest.mark.parametrize("command", ["verify", "compact"])
def test_verify_and_compact_bars_show_the_total_and_a_rate(capsys, tmp_path, command):
    w = write_store(tmp_path / "s", steps=range(4), ranks=2, eval_steps=(2,))
    files = len(list((w.root / "steps").glob("*.parquet")))
    code, _, err = run(capsys, command, w.root, "--progress")
    assert code == EXIT_OK
    final = err.replace("\r", "\n").strip().splitlines()
    last = [line for line in final if f"{files}/{files}" in line]
    assert last, err
    assert re.search(r"\d(\.\d+)? ?(file/s|s/file)", last[-1]), last[-1]
    code, _, err = run(capsys, command, w.root, "--no-progress")
    assert code == EXIT_OK and err == ""


# ---------------------------------------------------------------------- damage and rows


def _damage_footer(root: Path) -> Path:
    victim = sorted((root / "groups").glob("*.parquet"))[1]
    data = bytearray(victim.read_bytes())
    data[-64] ^= 0xFF  # in the Thrift footer
    victim.write_bytes(bytes(data))
    return victim


def _undamaged(victim: Path) -> bytes:
    data = bytearray(victim.read_bytes())
    data[-64] ^= 0xFF
    return bytes(data)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count(*) AS n FROM groups",  # scans no column: the footer is still parsed
        "SELECT count(*) AS n FROM samples",
        "SELECT avg(total_util) AS n FROM samples",
    ],
)
def test_a_damaged_footer_is_named_by_any_query_and_skipped_on_request(capsys, tmp_path, sql):
    w = write_store(tmp_path / "s", steps=range(3), ranks=1)
    total = sum(pq.read_metadata(p).num_rows for p in (w.root / "groups").glob("*.parquet"))
    victim = _damage_footer(w.root)
    lost = pq.read_metadata(pa.BufferReader(_undamaged(victim))).num_rows
    code, _, err = run(capsys, "query", w.root, sql, "--json")
    assert code == EXIT_DATA
    line = error_line(err, "query")
    assert victim.name in line and "TProtocolException" not in line
    code, out, err = run(capsys, "query", w.root, sql, "--json", "--on-error", "skip")
    assert code == EXIT_OK
    assert f"warning: skipping damaged file: {victim}" in err
    if "count(*)" in sql and "groups" in sql:
        assert json.loads(out) == [{"n": total - lost}]


@pytest.mark.parametrize("max_rows", [1, 20, 21, 40])
def test_max_rows_is_honoured(capsys, store, max_rows):
    rows = sum(len(g.utils) for g in store.groups)
    assert rows > 40
    code, out, _ = run(
        capsys, "query", store.root, "SELECT step, total_util FROM samples", "--max-rows", max_rows
    )
    assert code == EXIT_OK
    shown = [line for line in out.splitlines() if re.match(r"^│\s+\d", line)]
    assert len(shown) == max_rows
    assert f"({rows:,} rows, showing {max_rows};" in out


# ---------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command", [[], ["inspect"], ["query"], ["report"], ["verify"], ["repair"], ["compact"],
                ["export"], ["tail"]],
)  # fmt: skip
def test_help_answers_loading_no_heavy_package(command):
    """``--help`` loads no torch, pyarrow, numpy, DuckDB or pandas (what made a help slow: a
    count of the work, not a time; ``benchmarks/bench_scale.py`` times it, about 0.05 s), in
    a fresh process running the console script's ``main``."""
    done = subprocess.run(
        [sys.executable, "-c", _HELP_IMPORTS, *command, "--help"], capture_output=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith(b"usage: maxent-arrow"), done.stderr
    assert done.stderr.decode().splitlines()[-1] == "heavy: []", done.stderr


# What the console script runs, saying at exit which heavy packages it imported.
_HELP_IMPORTS = (
    "import atexit, sys\n"
    "heavy = ('torch', 'pyarrow', 'numpy', 'duckdb', 'pandas')\n"
    "atexit.register(lambda: print('heavy:', [m for m in heavy if m in sys.modules], "
    "file=sys.stderr))\n"
    "from maxent_arrow.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)
