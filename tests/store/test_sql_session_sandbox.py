"""The sandboxed DuckDB session (``store/sql/session.py``) on real DuckDB connections and real
Parquet files: which statements the query check lets through and what it says of the others,
the limits of a session as DuckDB itself reports them, the sandbox set by ``install`` (views
first, then only the plan's paths readable, external access off, configuration locked), and a
query's result, its timeout, its result budget and its errors.

Written for the mutation run of issue 37 (``make mutate``, ``docs/mutation.md``): each test
names the behaviour the survivors of that run showed untested."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxent_arrow.errors import ArgumentError, MissingExtraError, QueryError, StoreError
from maxent_arrow.store.sql import session as S
from maxent_arrow.store.sql.plan import ViewPlan
from maxent_arrow.store.sql.session import QueryLimits, SqlSession, check_query


def _setting(con, name: str):
    ((value,),) = con.execute(f"SELECT current_setting('{name}')").fetchall()
    return value


def _duckdb_spelling(memory: int) -> str:
    reference = duckdb.connect()
    reference.execute(f"SET memory_limit = '{memory}B'")
    return _setting(reference, "memory_limit")


# ---------------------------------------------------------------------------- the check
@pytest.mark.parametrize(
    "query",
    [
        "SELECT 1",
        "select 1;",
        "  WITH a AS (SELECT 1 AS x) SELECT * FROM a",
        "DESCRIBE SELECT 1",
        "FROM range(3)",
        "EXPLAIN SELECT 1",
        "explain analyze select 1",
        "EXPLAIN\t(FORMAT JSON)\nSELECT 1",
        "EXPLAIN /* a */ ANALYZE /* b */ SELECT 1",
        "EXPLAIN -- a\nANALYZE -- b\nSELECT 1",
        "EXPLAIN /* two\nlines */ SELECT 1",
        "/* first */ EXPLAIN SELECT 1",
        "EXPLAIN -- c\n(FORMAT JSON) SELECT 1",
        "EXPLAIN (FORMAT JSON) /* c */ SELECT 1",
    ],
)
def test_one_select_or_an_explain_of_one_passes_the_check_unchanged(query):
    assert check_query(query) == query
    assert check_query(query, duckdb.connect()) == query


@pytest.mark.parametrize(
    "query, message",
    [
        ("", "query: expected one SQL statement, got an empty query"),
        ("   ", "query: expected one SQL statement, got an empty query"),
        (";", "query: expected one SQL statement, got an empty query"),
        (" ; ", "query: expected one SQL statement, got an empty query"),
        (";;", "query: expected one SQL statement, got an empty query"),
        ("SELECT 1; SELECT 2", "query: expected exactly one SQL statement, got 2"),
        ("SELECT 1; SELECT 2; SELECT 3", "query: expected exactly one SQL statement, got 3"),
        ('SELEC 1', 'query: Parser Error: syntax error at or near "SELEC"'),
        ("PRAGMA version",
         "query: only SELECT (or EXPLAIN/DESCRIBE of one) may run; got a PRAGMA statement"),
        ("COPY (SELECT 1) TO 'x.csv'",
         "query: only SELECT (or EXPLAIN/DESCRIBE of one) may run; got a COPY statement"),
        ("ATTACH 'x.db'",
         "query: only SELECT (or EXPLAIN/DESCRIBE of one) may run; got a ATTACH statement"),
        ("EXPLAIN COPY (SELECT 1) TO 'x.csv'", "query: EXPLAIN is allowed of a SELECT only"),
        ("EXPLAIN ANALYZE INSERT INTO t VALUES (1)", "query: EXPLAIN is allowed of a SELECT only"),
        ("EXPLAIN /* ) */ ANALYZE COPY (SELECT 1) TO 'x'",
         "query: EXPLAIN is allowed of a SELECT only"),
        ("EXPLAIN (SELECT 1) UNION (SELECT 2)", "query: EXPLAIN is allowed of a SELECT only"),
        ("EXPLAIN ANALYZE(SELECT 1)", "query: EXPLAIN is allowed of a SELECT only"),
    ],
)  # fmt: skip
def test_anything_else_is_refused_saying_why(query, message):
    with pytest.raises(QueryError) as caught:
        check_query(query)
    assert str(caught.value) == message


def test_a_query_that_is_not_text_is_refused():
    for query in (None, 7, b"SELECT 1"):
        with pytest.raises(QueryError, match="^query: expected one SQL statement, got an empty"):
            check_query(query)  # type: ignore[arg-type]


def test_a_check_without_a_session_parses_on_a_spare_the_next_session_takes(monkeypatch):
    monkeypatch.setattr(S, "_spare", [])
    check_query("SELECT 1")
    (spare,) = S._spare
    check_query("SELECT 2")
    assert S._spare == [spare]  # one spare, reused
    session = SqlSession(threads=1)
    assert session.con is spare and S._spare == []
    assert S._take_spare() is None
    other = SqlSession(threads=1)
    assert other.con is not spare
    session.close()
    other.close()


def test_without_duckdb_the_error_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "duckdb", None)
    with pytest.raises(MissingExtraError) as caught:
        S.duckdb_module()
    assert caught.value.package == "duckdb" and caught.value.extra == "analytics"
    assert "pip install 'maxent-arrow[analytics]'" in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_duckdb_module_is_duckdb():
    assert S.duckdb_module() is duckdb


# ---------------------------------------------------------------------------- the limits
def _cgroup_limits(memory_max: str | None, v1_limit: str | None):
    return {"/sys/fs/cgroup/memory.max": memory_max,
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": v1_limit}  # fmt: skip


@pytest.mark.parametrize(
    "memory_max, v1_limit, expect",
    [
        (None, None, "machine"),
        ("max\n", None, "machine"),
        (str(3 << 30) + "\n", None, 3 << 30),
        (None, str(2 << 30), 2 << 30),
        (str(3 << 30), str(2 << 30), 2 << 30),
        (str(2 << 30), str(3 << 30), 2 << 30),
        (str(1 << 62), None, "machine"),
        ("garbage", str(1 << 30), 1 << 30),
    ],
)
def test_the_memory_a_process_may_use_is_its_cgroups_limit_when_lower(
    monkeypatch, tmp_path, memory_max, v1_limit, expect
):
    """The two cgroup files (v2, v1) as real files of a temporary directory, opened in their
    place: the lower of the machine's memory and each limit that is a number."""
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    files = {}
    for i, (path, text) in enumerate(_cgroup_limits(memory_max, v1_limit).items()):
        if text is not None:
            files[path] = tmp_path / f"limit{i}"
            files[path].write_text(text)
    real_open = open

    def cgroup_open(path, *args, **kwargs):
        if path in files:
            return real_open(files[path], *args, **kwargs)
        if str(path).startswith("/sys/fs/cgroup/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(S, "open", cgroup_open, raising=False)
    got = S.machine_memory()
    assert got == (machine if expect == "machine" else min(machine, expect))
    assert S.default_memory() == max(int(got * S.MEMORY_SHARE), 1 << 26)


def test_the_machine_as_this_process_sees_it():
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < S.machine_memory() <= machine
    assert S.machine_threads() == len(os.sched_getaffinity(0))
    assert S.MEMORY_SHARE == 0.4
    assert S.default_memory() == max(int(S.machine_memory() * 0.4), 1 << 26)


def test_the_default_memory_is_a_share_of_the_machine_and_at_least_64_mib(monkeypatch):
    monkeypatch.setattr(S, "machine_memory", lambda: 100 << 20)
    assert S.default_memory() == 64 << 20
    monkeypatch.setattr(S, "machine_memory", lambda: 10 << 30)
    assert S.default_memory() == int((10 << 30) * 0.4)
    assert QueryLimits().memory == int((10 << 30) * 0.4)


def test_threads_fall_back_to_the_cpu_count_without_affinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    assert S.machine_threads() == (os.cpu_count() or 1)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert S.machine_threads() == 1


def test_a_timeout_is_none_or_a_positive_finite_number_of_seconds():
    assert S.check_timeout(None) is None
    assert S.check_timeout(2) == 2.0 and isinstance(S.check_timeout(2), float)
    assert S.check_timeout(0.25) == 0.25
    assert S.check_timeout(1e-9) == 1e-9
    for bad in (0, 0.0, -1, float("inf"), float("nan"), True, False, "1", [1]):
        with pytest.raises(ArgumentError) as caught:
            S.check_timeout(bad)
        assert str(caught.value) == (f"timeout: expected a positive number of seconds, got {bad!r}")


def test_query_limits_default_from_the_machine_and_refuse_what_is_not_a_limit():
    limits = QueryLimits()
    assert limits.memory == S.default_memory() and limits.threads == S.machine_threads()
    assert limits.timeout is None
    assert QueryLimits(memory=1 << 20, threads=1, timeout=3).timeout == 3
    for kwargs, message in (
        ({"memory": (1 << 20) - 1}, f"memory must be an int >= {1 << 20}, got {(1 << 20) - 1}"),
        ({"memory": True}, f"memory must be an int >= {1 << 20}, got True"),
        ({"memory": float(1 << 30)}, f"memory must be an int >= {1 << 20}, got {float(1 << 30)}"),
        ({"threads": 0}, "threads must be an int >= 1, got 0"),
        ({"threads": True}, "threads must be an int >= 1, got True"),
        ({"threads": "2"}, "threads must be an int >= 1, got '2'"),
    ):
        with pytest.raises(ArgumentError) as caught:
            QueryLimits(**kwargs)
        assert str(caught.value) == f"query limits: {message}"
    with pytest.raises(ArgumentError, match="^timeout: expected a positive number"):
        QueryLimits(timeout=0)


def test_a_session_has_its_limits_as_duckdb_settings_and_no_spill_or_progress_bar():
    limits = QueryLimits(memory=200 << 20, threads=2, timeout=9.0)
    with SqlSession(limits=limits) as session:
        assert session.limits == limits and not session.sandboxed
        assert _setting(session.con, "threads") == 2
        assert _setting(session.con, "memory_limit") == _duckdb_spelling(200 << 20)
        assert _setting(session.con, "temp_directory") == ""
        assert _setting(session.con, "enable_progress_bar") is False
    with SqlSession(threads=1, limits=limits) as session:
        assert session.limits == QueryLimits(memory=200 << 20, threads=1, timeout=9.0)
        assert _setting(session.con, "threads") == 1
    with SqlSession() as session:
        assert session.limits == QueryLimits()
        assert _setting(session.con, "threads") == S.machine_threads()


# ---------------------------------------------------------------------------- the sandbox
@pytest.fixture
def files(tmp_path):
    inside = tmp_path / "store" / "a.parquet"
    inside.parent.mkdir()
    pq.write_table(pa.table({"x": [1, 2, 3]}), inside)
    outside = tmp_path / "outside.parquet"
    pq.write_table(pa.table({"x": [9]}), outside)
    return inside, outside


def _plan(inside, extra_paths=()) -> ViewPlan:
    return ViewPlan(
        views={"files": f"SELECT x FROM read_parquet('{inside}')", "pairs": "SELECT * FROM t"},
        tables={"t": pa.table({"y": ["a", "b"]})},
        allowed_paths=[str(inside), *extra_paths],
    )


def test_install_creates_the_views_then_allows_only_the_plans_paths(files, tmp_path):
    inside, outside = files
    session = SqlSession(threads=1)
    session.install(_plan(inside))
    assert session.sandboxed
    assert session.run("SELECT sum(x) AS s FROM files").to_pylist() == [{"s": 6}]
    assert session.run("SELECT * FROM pairs").to_pylist() == [{"y": "a"}, {"y": "b"}]
    assert session.run(f"SELECT count(*) AS n FROM '{inside}'").to_pylist() == [{"n": 3}]
    with pytest.raises(StoreError, match="query failed: Permission Error"):
        session.run(f"SELECT * FROM '{outside}'")
    with pytest.raises(StoreError, match="query failed"):
        session.run(f"COPY (SELECT 1) TO '{tmp_path / 'written.csv'}'")
    assert not (tmp_path / "written.csv").exists()
    assert _setting(session.con, "enable_external_access") is False
    assert _setting(session.con, "lock_configuration") is True
    assert _setting(session.con, "parquet_metadata_cache") is True
    with pytest.raises(StoreError, match="query failed"):
        session.run("SET threads = 3")
    with pytest.raises(StoreError, match="^SqlSession.install: the session is sandboxed already$"):
        session.install(_plan(inside))
    session.close()


def test_a_session_over_many_files_parses_each_footer_where_it_reads_it(files):
    inside, _ = files
    many = [f"{inside.parent}/other-{i}.parquet" for i in range(S.KEPT_FOOTERS_FILES)]
    with SqlSession(threads=1) as session:
        session.install(_plan(inside, many))  # 513 paths
        assert _setting(session.con, "parquet_metadata_cache") is False
        assert session.run("SELECT count(*) AS n FROM files").to_pylist() == [{"n": 3}]
    with SqlSession(threads=1) as session:
        session.install(_plan(inside, many[:-1]))  # 512 paths: kept
        assert _setting(session.con, "parquet_metadata_cache") is True
    assert S.KEPT_FOOTERS_FILES == 512


def test_a_plan_without_paths_leaves_no_file_readable(files):
    inside, _ = files
    with SqlSession(threads=1) as session:
        session.install(ViewPlan(views={"v": "SELECT 42 AS answer"}))
        assert session.run("SELECT * FROM v").to_pylist() == [{"answer": 42}]
        with pytest.raises(StoreError, match="query failed: Permission Error"):
            session.run(f"SELECT * FROM '{inside}'")


def test_the_librarys_own_tables_and_views_are_queryable(files):
    with SqlSession(threads=1) as session:
        session.register("numbers", pa.table({"n": [1, 2, 3, 4]}))
        session.execute("CREATE VIEW evens AS SELECT n FROM numbers WHERE n % 2 = 0")
        assert session.run("SELECT * FROM evens ORDER BY n").to_pylist() == [{"n": 2}, {"n": 4}]
        assert session.run("SELECT $1 + n AS m FROM numbers WHERE n = 1", [10]).to_pylist() == [
            {"m": 11}
        ]


# ---------------------------------------------------------------------------- running
def test_a_result_over_the_memory_limit_stops_the_query_naming_the_limit():
    with SqlSession(limits=QueryLimits(memory=1 << 20, threads=1)) as session:
        small = session.run("SELECT range AS i FROM range(1000)")
        assert small.num_rows == 1000 and small.schema.names == ["i"]
        with pytest.raises(StoreError) as caught:
            session.run("SELECT range AS i, range * 2 AS j FROM range(500000)")
        assert str(caught.value) == (
            "query failed: its result exceeds the memory limit of 1 MiB; aggregate, or add a LIMIT"
        )
        assert caught.value.__cause__ is None
        # the session still serves
        assert session.run("SELECT 1 AS one").to_pylist() == [{"one": 1}]


def test_a_result_is_whole_in_batches_of_the_same_schema():
    rows = 3 * S._RESULT_BATCH_ROWS + 5
    with SqlSession(threads=1) as session:
        table = session.run(f"SELECT range AS i FROM range({rows})")
        assert table.num_rows == rows
        assert table.column("i").to_pylist()[-1] == rows - 1
        empty = session.run("SELECT 1 AS one WHERE false")
        assert empty.num_rows == 0 and empty.schema.names == ["one"]


def test_a_query_past_its_timeout_is_interrupted_and_the_session_serves_again():
    slow = "SELECT count(*) FROM range(100000000000) a"
    with SqlSession(limits=QueryLimits(threads=1, timeout=0.3)) as session:
        start = time.monotonic()
        with pytest.raises(StoreError) as caught:
            session.run(slow)
        assert str(caught.value) == (
            "query stopped after its timeout of 0.3 s (timeout=, --timeout)"
        )
        assert time.monotonic() - start < 10
        with pytest.raises(StoreError, match=r"timeout of 0.2 s"):
            session.run(slow, timeout=0.2)
        assert session.run("SELECT 2 AS two", timeout=30).to_pylist() == [{"two": 2}]
        assert threading.active_count() < 20


def test_a_duckdb_error_is_a_store_error_of_its_first_line():
    with SqlSession(threads=1) as session:
        with pytest.raises(StoreError) as caught:
            session.run("SELECT * FROM no_such_table")
        message = str(caught.value)
        assert message.startswith("query failed: Catalog Error: Table with name no_such_table")
        assert "\n" not in message and caught.value.__cause__ is None


def test_an_error_that_is_not_duckdbs_is_raised_as_it_is():
    with SqlSession(threads=1) as session:
        with pytest.raises(TypeError):
            session.run("SELECT $1", params=object())


def test_explain_and_the_json_plan_are_duckdbs_own(files):
    inside, _ = files
    with SqlSession(threads=1) as session:
        session.install(_plan(inside))
        text = session.explain("SELECT sum(x) FROM files")
        assert "PARQUET_SCAN" in text.upper().replace(" ", "_") or "READ_PARQUET" in text.upper()
        assert "\n" in text
        plan = session.plan_json("SELECT sum(x) FROM files")
        assert plan is not None
        parsed = json.loads(plan)
        assert isinstance(parsed, list) and parsed
        assert session.plan_json("SELECT nope FROM files") is None
        assert session.plan_json("not sql at all") is None


def test_render_draws_the_first_rows_as_duckdbs_box():
    table = pa.table({"step": list(range(10)), "name": [f"n{i}" for i in range(10)]})
    with SqlSession(threads=1) as session:
        text = session.render(table, max_rows=3)
        assert "step" in text and "name" in text and "│" in text
        assert "n0" in text and "n2" in text and "n3" not in text and "n9" not in text
        one = session.render(table, max_rows=1)
        assert "n0" in one and "n1" not in one and "n9" not in one
        none = session.render(table, max_rows=0)
        assert "step" in none and "n0" not in none


def test_spell_types_gives_duckdbs_name_of_each_arrow_type():
    with SqlSession(threads=1) as session:
        spelled = session.spell([pa.int64(), pa.list_(pa.float32()), pa.string(), pa.int64()])
        assert spelled == {pa.int64(): "BIGINT", pa.list_(pa.float32()): "FLOAT[]",
                           pa.string(): "VARCHAR"}  # fmt: skip
        assert session.spell([]) == {}
        assert S.spell_types(session.con, [pa.bool_()]) == {pa.bool_(): "BOOLEAN"}
        with pytest.raises(duckdb.Error):
            session.con.execute("SELECT * FROM _maxent_types")  # unregistered again


def test_close_closes_the_connection_once():
    session = SqlSession(threads=1)
    con = session.con
    session.close()
    assert session.con is None
    with pytest.raises(duckdb.Error):
        con.execute("SELECT 1")
    session.close()  # again: nothing to do
    with SqlSession(threads=1) as other:
        pass
    assert other.con is None


def test_close_retries_a_connection_still_busy():
    class Busy:
        def __init__(self):
            self.closes = 0
            self.interrupts = 0

        def close(self):
            self.closes += 1
            if self.closes < 3:
                raise duckdb.ConnectionException("connection is busy")

        def interrupt(self):
            self.interrupts += 1

    session = SqlSession(threads=1)
    real = session.con
    busy = Busy()
    session.con = busy
    session.close()
    assert (busy.closes, busy.interrupts) == (3, 2)
    real.close()
    forever = Busy()
    forever.close = lambda: (_ for _ in ()).throw(duckdb.ConnectionException("busy"))  # type: ignore[method-assign]
    other = SqlSession(threads=1)
    other.con.close()
    other.con = forever
    start = time.monotonic()
    other.close()  # gives up after its retries, raising nothing
    assert forever.interrupts == 50 and time.monotonic() - start < 5
