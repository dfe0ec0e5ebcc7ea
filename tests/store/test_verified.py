"""The verified-bytes cache (``store/storage/verified.py``): each group file's footer and chunks are
CRC-checked once per process, and the guarantee the docs state holds with real byte flips on
disk: damage present when a process first reads a file is never served; later damage that
changes the modification time is caught by the next query; later damage with the size and
modification time restored is not re-checked in that process, and ``verify`` (and every new
process) finds it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fault_harness import flip_chunk
from store_fixtures import ADVANTAGE_SUMS

from maxent_arrow import RolloutStore
from maxent_arrow.errors import StoreError
from maxent_arrow.store.storage import verified
from maxent_arrow.testing import loose_store

# A chunk checksum mismatch, whichever algorithm the file recorded (CRC32C; CRC-32 in older stores).
CHECKSUM = re.compile(r"CRC(?:-32|32C) [0-9a-f]+, expected")
QUERY = ADVANTAGE_SUMS


def _store(tmp_path: Path, steps: int = 3) -> RolloutStore:
    return loose_store(tmp_path / "run", steps)


def _fresh_query(root: Path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        f"""
        from maxent_arrow import RolloutStore
        print(RolloutStore({str(root)!r}).sql({QUERY!r}).to_pylist())
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def _group_files(store: RolloutStore) -> list[Path]:
    return [Path(p) for p in store.committed_files("groups")]


def test_damage_present_at_a_process_first_read_is_never_served(tmp_path):
    store = _store(tmp_path)
    victim = _group_files(store)[1]
    flip_chunk(victim, "advantages", keep_mtime=True)
    out = _fresh_query(store.root)
    assert out.returncode != 0
    assert CHECKSUM.search(out.stderr) and victim.name in out.stderr
    # In this process too (a process that never read the file before).
    verified.forget()
    with pytest.raises(StoreError, match=CHECKSUM) as err:
        RolloutStore(store.root).sql(QUERY)
    assert victim.name in str(err.value)


def test_each_file_is_checked_once_per_process(tmp_path):
    store = _store(tmp_path)
    verified.forget()
    first = RolloutStore(store.root).sql(QUERY)
    # Another store object, another session: what was checked stays checked.
    views = RolloutStore(store.root).sql_views()
    try:
        assert views.query(QUERY) == first
        files = [rel for rel, _ in views.files]
        assert len(files) == 3
        for rel in files:
            assert {"(footer)", "advantages"} <= verified.checked(views.ledger.keys[rel])
    finally:
        views.close()


def test_later_damage_that_changes_the_mtime_is_caught_by_the_next_query(tmp_path):
    store = _store(tmp_path)
    verified.forget()
    reader = RolloutStore(store.root)
    before = reader.sql(QUERY)
    assert before.num_rows == 3
    victim = _group_files(store)[2]
    flip_chunk(victim, "advantages", keep_mtime=False)
    os.utime(victim, ns=(os.stat(victim).st_atime_ns, os.stat(victim).st_mtime_ns + 10**9))
    with pytest.raises(StoreError, match=CHECKSUM) as err:
        reader.sql(QUERY)
    assert victim.name in str(err.value)


def test_later_damage_with_size_and_mtime_restored_is_found_by_verify(tmp_path):
    store = _store(tmp_path)
    verified.forget()
    reader = RolloutStore(store.root)
    reader.sql(QUERY)
    victim = _group_files(store)[0]
    flip_chunk(victim, "advantages", keep_mtime=True)
    # This process checked the file already and its key is unchanged: not checked again (the
    # stated limit). DuckDB may still fail to decode the flipped page, but our check does not
    # run: no CRC error is raised for it.
    try:
        reader.sql(QUERY)
    except StoreError as exc:
        assert not CHECKSUM.search(str(exc)), exc
    # verify reads every byte, whatever this process checked before.
    report = reader.verify()
    assert not report.ok
    assert any(victim.name in str(p) for p in report.problems)
    # And a new process never serves it.
    out = _fresh_query(store.root)
    assert out.returncode != 0 and CHECKSUM.search(out.stderr) and victim.name in out.stderr
