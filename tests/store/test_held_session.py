"""One SQL session per store object: ``ReadOnlyStore.sql`` holds its connection, views and
checks across calls while the store is unchanged (the log at the same version, every file the
views read of the same size and modification time), and rebuilds them after a commit or a
changed file. Checked with real appends, real byte flips and deletions on disk, against
DuckDB reading the same files itself."""

from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fault_harness import flip_chunk
from store_fixtures import ADVANTAGE_SUMS

from maxent_arrow import RolloutStore
from maxent_arrow.errors import QueryError, StoreError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.sql import session as S
from maxent_arrow.store.sql.ledger import ChecksumLedger
from maxent_arrow.store.sql.plan import ViewPlan
from maxent_arrow.store.sql.session import KEPT_FOOTERS_FILES, SqlSession
from maxent_arrow.store.sql.views import collector_paused
from maxent_arrow.store.storage import verified
from maxent_arrow.testing import loose_store, make_batch

QUERY = ADVANTAGE_SUMS


def _store(tmp_path: Path, steps: int = 3) -> RolloutStore:
    return loose_store(tmp_path / "run", steps)


def _duckdb(store: ReadOnlyStore) -> list[tuple]:
    """The same query by DuckDB alone over the committed group files."""
    files = ", ".join(f"'{p}'" for p in store.committed_files("groups"))
    relation = duckdb.sql(QUERY.replace("FROM groups", f"FROM read_parquet([{files}])"))
    assert relation is not None
    return relation.fetchall()


def _held(store: ReadOnlyStore):
    (views,) = store._held.values()
    return views


def test_repeated_queries_share_one_session_and_agree_with_duckdb(tmp_path):
    store = ReadOnlyStore(_store(tmp_path).root)
    first = store.sql(QUERY)
    views = _held(store)
    con = views.con
    for _ in range(3):
        assert store.sql(QUERY) == first
        assert _held(store) is views and views.con is con
    # Planned once for the session: the query's scans are kept.
    assert QUERY in views.scans
    assert [tuple(r.values()) for r in first.to_pylist()] == _duckdb(store)
    store.close()
    assert store._held == {}
    assert store.sql(QUERY) == first  # a new session after close


def test_a_commit_between_queries_rebuilds_the_session(tmp_path):
    store = _store(tmp_path)
    assert store.sql(QUERY).num_rows == 3
    before = _held(store)
    store.append(make_batch(3))
    after = store.sql(QUERY)
    assert after.num_rows == 4 and _held(store) is not before
    assert [tuple(r.values()) for r in after.to_pylist()] == _duckdb(store)
    # A reader object sees another object's commit too (its log moved on).
    reader = ReadOnlyStore(store.root)
    assert reader.sql(QUERY).num_rows == 4
    store.append(make_batch(4))
    assert reader.sql(QUERY).num_rows == 5


def test_a_group_file_deleted_after_a_query_is_an_error_naming_it(tmp_path):
    store = ReadOnlyStore(_store(tmp_path).root)
    store.sql(QUERY)
    victim = Path(store.committed_files("groups")[1])
    victim.unlink()
    with pytest.raises(StoreError, match="missing") as err:
        store.sql(QUERY)
    assert victim.name in str(err.value)
    assert store._held == {}  # a failed session is not kept


def test_a_rewritten_group_file_is_checked_again(tmp_path):
    """Damage written after the first query changes the file's modification time: the held
    session is rebuilt and the chunk's check finds it (the file named)."""
    store = ReadOnlyStore(_store(tmp_path).root)
    store.sql(QUERY)
    victim = Path(store.committed_files("groups")[2])
    flip_chunk(victim, "advantages", keep_mtime=True)
    stat = os.stat(victim)
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(StoreError, match="expected") as err:
        store.sql(QUERY)
    assert victim.name in str(err.value)


def test_a_failed_statement_keeps_the_session(tmp_path):
    store = ReadOnlyStore(_store(tmp_path).root)
    first = store.sql(QUERY)
    views = _held(store)
    with pytest.raises(StoreError, match="nope"):
        store.sql("SELECT nope FROM groups")
    with pytest.raises(QueryError):
        store.sql("DELETE FROM groups")
    assert _held(store) is views
    assert store.sql(QUERY) == first


def test_sessions_are_held_per_settings_and_bounded(tmp_path):
    store = ReadOnlyStore(_store(tmp_path, steps=4).root)
    whole = store.sql(QUERY)
    for first in range(4):
        part = store.sql(QUERY, steps=(first, first))
        assert part.to_pylist() == whole.to_pylist()[first : first + 1]
    assert len(store._held) == 4  # the oldest (the unbounded one) was closed
    assert (("raise", None, None)) not in store._held
    bound: object = [1, 2]  # a list bound, as JSON gives it: the same key as the tuple
    assert store.sql(QUERY, steps=bound).num_rows == 2  # type: ignore[arg-type]
    assert ("raise", None, (1, 2)) in store._held


def test_concurrent_queries_on_one_store_object(tmp_path):
    store = ReadOnlyStore(_store(tmp_path).root)
    expected = store.sql(QUERY)
    results: list[object] = []

    def work() -> None:
        for _ in range(4):
            results.append(store.sql(QUERY))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12 and all(r == expected for r in results)


def test_a_store_with_a_held_session_pickles_without_it(tmp_path):
    store = ReadOnlyStore(_store(tmp_path).root)
    first = store.sql(QUERY)
    copy = pickle.loads(pickle.dumps(store))
    assert copy._held == {}
    assert copy.sql(QUERY) == first


def test_verified_checks_still_run_on_a_fresh_process_cache(tmp_path):
    """A held session checks nothing again, but a new store object in a process that forgot
    what it checked checks every chunk the query reads."""
    store = ReadOnlyStore(_store(tmp_path).root)
    store.sql(QUERY)
    verified.forget()
    other = ReadOnlyStore(store.root)
    other.sql(QUERY)
    views = _held(other)
    for rel, _ in views.files:
        assert {"(footer)", "advantages"} <= verified.checked(views.ledger.keys[rel])


def test_a_query_planned_once_per_process_still_checks_its_chunks(tmp_path, monkeypatch):
    """A new store object over unchanged views takes the query's scanned columns from the
    process's plans (no EXPLAIN), and still checks those chunks: a flipped byte in one is
    a CRC error naming the file."""
    store = ReadOnlyStore(_store(tmp_path).root)
    first = store.sql(QUERY)
    store.close()

    def no_plan(self, query):
        raise AssertionError("planned again")

    monkeypatch.setattr(SqlSession, "plan_json", no_plan)
    verified.forget()
    again = ReadOnlyStore(store.root)
    assert again.sql(QUERY) == first
    views = _held(again)
    for rel, _ in views.files:
        assert {"(footer)", "advantages"} <= verified.checked(views.ledger.keys[rel])
    again.close()
    victim = Path(store.committed_files("groups")[0])
    flip_chunk(victim, "advantages", keep_mtime=True)
    verified.forget()
    with pytest.raises(StoreError, match="expected") as err:
        ReadOnlyStore(store.root).sql(QUERY)
    assert victim.name in str(err.value)
    # A query of another text is planned (and its columns checked) as before.
    monkeypatch.undo()
    with pytest.raises(StoreError, match="expected"):
        ReadOnlyStore(store.root).sql("SELECT sum(list_sum(advantages)) FROM groups")


def test_the_connection_a_query_check_opened_becomes_the_next_sessions(tmp_path):
    """check_query before any session (the command line checks a query before it opens the
    store) parses on a new connection, which the next session takes as its own (one
    in-memory database, not two); a later check opens another, never the sandboxed one."""
    S.check_query("SELECT 1")
    (spare,) = S._spare
    first = S.SqlSession()
    assert first.con is spare and S._spare == []
    first.install(ViewPlan())
    with pytest.raises(QueryError):
        S.check_query("SET threads = 1")
    (other,) = S._spare
    assert other is not first.con
    second = S.SqlSession()  # its settings are its own (the first's are locked)
    assert second.con is other
    assert second.con.execute("SELECT current_setting('lock_configuration')").fetchone() == (False,)
    second.install(ViewPlan())
    with pytest.raises(duckdb.Error):
        first.con.execute("SET threads = 1")
    first.close()
    second.close()


def _collections() -> int:
    return sum(g["collections"] for g in gc.get_stats())


def test_building_the_views_runs_no_collection_and_leaves_the_collector_as_found(
    tmp_path, monkeypatch
):
    """The views are built with Python's cyclic collector off (``store/sql/views.py``): seen from
    inside the build, from its first step (the ledger cleared) to its last (the session's
    views installed), the collector is off and, with its threshold at 1, starts no
    collection between them; after the build it is on or off as it was before, also when
    the build fails."""
    root = _store(tmp_path).root
    seen: list[tuple[str, bool, int]] = []
    for owner, name in ((ChecksumLedger, "clear"), (SqlSession, "install")):
        original = getattr(owner, name)

        def spy(self, *args, __original=original, __name=name):
            seen.append((__name, gc.isenabled(), _collections()))
            return __original(self, *args)

        monkeypatch.setattr(owner, name, spy)
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        ReadOnlyStore(root).sql(QUERY)
        assert gc.isenabled()
        before = _collections()
        [[] for _ in range(1000)]  # the threshold does start collections outside the build
        assert _collections() > before
    finally:
        gc.set_threshold(*thresholds)
    (first, *_, last) = [entry for entry in seen if entry[0] in ("clear", "install")]
    assert first[0] == "clear" and last[0] == "install"
    assert not first[1] and not last[1]  # off inside the build
    assert first[2] == last[2]  # no collection between its first and last step
    gc.disable()
    try:
        ReadOnlyStore(root).sql(QUERY)
        assert not gc.isenabled()  # the caller's choice kept
    finally:
        gc.enable()
    victim = next(iter(ReadOnlyStore(root).committed_files("groups")))
    os.remove(victim)
    with pytest.raises(StoreError, match=os.path.basename(victim)):
        ReadOnlyStore(root).sql(QUERY)
    assert gc.isenabled()  # on again after a build that failed


def test_threads_pausing_the_collector_at_once_share_one_pause():
    """Two threads in the pause at once (their order forced with events): the collector
    stays off until the last one leaves, then is on again; if it was off before the first
    came, it stays off; an exception inside a pause ends it too."""
    inside, leave_first, first_left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with collector_paused():
            inside.set()
            leave_first.wait(10)
        first_left.set()

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    with collector_paused():
        leave_first.set()
        assert first_left.wait(10)
        assert not gc.isenabled()  # the first left, this one is still inside
    thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()


def test_views_built_by_many_threads_at_once_leave_the_collector_on(tmp_path):
    """Many threads building views over one store at once, switching as often as the
    interpreter lets them: the collector is on after every round."""
    root = _store(tmp_path).root
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(10):
            threads = [
                threading.Thread(target=lambda: ReadOnlyStore(root).sql(QUERY)) for _ in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert gc.isenabled()
    finally:
        sys.setswitchinterval(interval)


def test_a_session_keeps_parsed_footers_and_reads_a_rewritten_file_again(tmp_path):
    """A session over at most KEPT_FOOTERS_FILES files keeps each one's parsed footer
    (DuckDB's parquet_metadata_cache: views and queries do not parse it again) and reads a
    file rewritten since (its modification time moved on) with its new footer, never the
    kept one; a session over more files keeps none (DuckDB holds ~190 KB per file).

    DuckDB never trusts a kept footer of a file modified in the last 10 s: the file's times
    are set a minute back, so that the footer is kept and its rewrite is what is seen."""
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    old = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(old, old))
    setting = "SELECT current_setting('parquet_metadata_cache')"
    plan = ViewPlan(views={"t": f"SELECT * FROM read_parquet('{path}')"})
    plan.allowed_paths.append(str(path))
    plan.allowed_paths.extend(str(tmp_path / f"{i}.parquet") for i in range(KEPT_FOOTERS_FILES - 1))
    assert len(plan.allowed_paths) == KEPT_FOOTERS_FILES
    with SqlSession() as session:
        session.install(plan)
        con = session.con
        assert con.execute(setting).fetchone() == (True,)
        query = "SELECT sum(x), count(*) FROM t"
        assert con.execute(query).fetchone() == (6, 3)
        pq.write_table(pa.table({"x": list(range(10))}), path, row_group_size=4)
        os.utime(path, ns=(old + 30 * 10**9, old + 30 * 10**9))
        assert con.execute(query).fetchone() == (45, 10)
    plan.allowed_paths.append(str(tmp_path / "one-more.parquet"))
    with SqlSession() as session:
        session.install(plan)
        assert session.con.execute(setting).fetchone() == (False,)
        assert session.con.execute("SELECT sum(x) FROM t").fetchone() == (45,)
