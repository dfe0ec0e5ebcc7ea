"""Guarantees that no other test held (the mutation audit of issue 37 found each survive),
checked from the outside: the fsyncs of a real writer process as the kernel sees them, a
sibling directory named like the store, DuckDB's own reading of the sandbox's memory limit,
and an exclusive create that refuses an existing name without any lock."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.store.sql.session import QueryLimits
from maxent_arrow.store.storage.backend import LocalBackend
from maxent_arrow.testing import make_batch

ROOT = Path(__file__).resolve().parents[2]

# A writer that records, in order, every fsync (the path its descriptor names), hard link
# and rename the library makes during one append (its store and attempt made before).
TRACED = textwrap.dedent(
    """
    import json, os, sys
    from maxent_arrow import RolloutStore
    from maxent_arrow.testing import make_batch
    store = RolloutStore.create(sys.argv[1], compact_every=None)
    store.append(make_batch(0))
    events = []
    fsync, link, replace = os.fsync, os.link, os.replace
    def traced_fsync(fd):
        events.append(["fsync", os.readlink(f"/proc/self/fd/{fd}")])
        return fsync(fd)
    def traced_link(src, dst, *a, **k):
        events.append(["link", os.fspath(src), os.fspath(dst)])
        return link(src, dst, *a, **k)
    def traced_replace(src, dst, *a, **k):
        events.append(["replace", os.fspath(src), os.fspath(dst)])
        return replace(src, dst, *a, **k)
    os.fsync, os.link, os.replace = traced_fsync, traced_link, traced_replace
    store.append(make_batch(1))
    os.fsync, os.link, os.replace = fsync, link, replace
    print(json.dumps(events))
    """
)


def test_every_new_file_and_its_directory_are_durable_before_the_entry_that_names_them(
    tmp_path,
):
    """In a real writer process: the group file, the step file and the log entry are each
    fsynced (as their temp file) before they are linked into place, and their directories
    fsynced after the link, and the entry is linked only after both data files and their
    directories are durable. (Removing the fsync of a new file, or of its directory, in
    the backend fails this test.)"""
    root = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-c", TRACED, str(root)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    events = json.loads(done.stdout.strip().splitlines()[-1])
    links = [(i, e[1], e[2]) for i, e in enumerate(events) if e[0] == "link"]
    entry = next(i for i, _, dst in links if "/log/" in dst and dst.endswith(".json"))
    published = {Path(dst).parent.name: (i, src, dst) for i, src, dst in links if i < entry}
    assert set(published) >= {"groups", "steps"}
    fsyncs = [(i, e[1]) for i, e in enumerate(events) if e[0] == "fsync"]
    for directory in ("groups", "steps"):
        at, temp, final = published[directory]
        assert any(path == temp and i < at for i, path in fsyncs), (directory, "file")
        synced = [i for i, path in fsyncs if path == str(Path(final).parent)]
        assert any(at < i < entry for i in synced), (directory, "directory")
    temp_entry = links[[i for i, _, _ in links].index(entry)][1]
    assert any(path == temp_entry and i < entry for i, path in fsyncs), "the entry itself"
    assert any(path == str(root / "log") and i > entry for i, path in fsyncs), "the log dir"


def test_a_sibling_directory_named_like_the_store_is_outside_it(tmp_path):
    """``store-evil/`` has the store's path as a prefix: a directory of the store that links
    there is a link out of the store, refused, and nothing is written there."""
    root = tmp_path / "store"
    store = RolloutStore.create(root, compact_every=None)
    store.append(make_batch(0))
    evil = tmp_path / "store-evil"
    (evil / "groups").mkdir(parents=True)
    moved = root / "groups-real"
    (root / "groups").rename(moved)
    (root / "groups").symlink_to(evil / "groups")
    with pytest.raises(StoreError, match="outside the store"):
        RolloutStore(root, if_exists="resume").append(make_batch(1))
    # Each way of writing a file, taken alone (the write path's own check, not the readers'):
    backend = LocalBackend(root)
    with pytest.raises(StoreError, match="outside the store"):
        backend.write_temp("groups/x.parquet", b"bytes")
    with pytest.raises(StoreError, match="outside the store"):
        backend.makedirs("groups/sub")
    assert list((evil / "groups").iterdir()) == []


def test_duckdb_reads_back_the_sandboxs_memory_limit(tmp_path):
    """The limit is DuckDB's own setting (a result budget of this library alone would not
    bound a query's working memory): read back from the session as DuckDB spells it."""
    store = RolloutStore.create(tmp_path / "store", compact_every=None)
    store.append(make_batch(0))
    limit = 96 << 20
    with store.sql_views(limits=QueryLimits(memory=limit)) as views:
        (got,) = views.con.execute("SELECT current_setting('memory_limit')").fetchone()
    reference = duckdb.connect()
    reference.execute(f"SET memory_limit = '{limit}B'")
    (want,) = reference.execute("SELECT current_setting('memory_limit')").fetchone()
    assert got == want and got != duckdb.connect().execute(
        "SELECT current_setting('memory_limit')"
    ).fetchone()[0]


def test_a_local_exclusive_create_refuses_an_existing_name_without_the_lock(tmp_path):
    """Two backends of one store, no lock held: the second exclusive publish of a name (and
    the second put_if_absent) is refused, and the first file's bytes stay."""
    RolloutStore.create(tmp_path / "store")
    first, second = LocalBackend(tmp_path / "store"), LocalBackend(tmp_path / "store")
    a, b = first.write_temp("steps/x.parquet", b"first"), second.write_temp("steps/x.parquet", b"2")
    first.publish(a, exclusive=True)
    with pytest.raises(StoreError, match="already exists"):
        second.publish(b, exclusive=True)
    second.discard(b)
    assert (tmp_path / "store" / "steps" / "x.parquet").read_bytes() == b"first"
    assert first.put_if_absent("log/y.json", b"one") is True
    assert second.put_if_absent("log/y.json", b"two") is False
    assert (tmp_path / "store" / "log" / "y.json").read_bytes() == b"one"
