"""Fault class: an untrusted store (downloaded, shared, written by someone else). Symbolic
links inside it that lead out of it are never followed to create, move or lock anything
(nothing appears or changes outside the store), reading through them is refused by name,
and ``verify`` reports each such link and goes on checking everything else.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fault_harness import snapshot

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.testing import loose_store, make_batch, unit_path


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    return loose_store(tmp_path / "store", cache=True)


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "precious.txt").write_text("not the store's")
    return path


def _link_dir(store: RolloutStore, name: str, target: Path) -> None:
    path = store.root / name
    if path.exists():
        shutil.rmtree(path)
    path.symlink_to(target, target_is_directory=True)


def test_a_lock_file_linked_out_of_the_store_is_refused(store, outside):
    target = outside / "elsewhere.lock"
    (store.root / ".lock").unlink(missing_ok=True)
    (store.root / ".lock").symlink_to(target)
    before = snapshot(outside)
    with pytest.raises(StoreError, match="symbolic link"):
        store.append(make_batch(3))
    assert not target.exists() and snapshot(outside) == before
    assert store.steps() == [0, 1, 2]


@pytest.mark.parametrize("directory", ["quarantine", "cache", "retired"])
def test_nothing_is_created_or_moved_through_a_directory_linked_out(store, outside, directory):
    _link_dir(store, directory, outside)
    before = snapshot(outside)
    # A crashed writer's temp file (its process is gone), for repair to move.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64]
    leftover = store.root / "groups" / f".x.parquet.tmp-{host}.{gone.stdout.strip()}.abcdef"
    leftover.write_bytes(b"partial")
    if directory == "quarantine":
        with pytest.raises(StoreError, match="outside the store"):
            store.repair()
        assert leftover.exists()
    elif directory == "cache":
        with pytest.warns(UserWarning, match="outside the store"):
            store.append(make_batch(3))  # committed; its IPC copy is not written out there
        assert store.steps() == [0, 1, 2, 3]
    else:
        with pytest.raises(StoreError, match="outside the store"):
            store.compact()  # committed; its inputs are not moved out there
        assert store.read().num_rows == sum(make_batch(s).num_groups for s in range(3))
    assert snapshot(outside) == before


def test_verify_reports_a_link_out_and_checks_everything_else(store, outside):
    victim = unit_path(store, "groups", 1)
    shutil.move(victim, outside / victim.name)
    victim.symlink_to(outside / victim.name)
    cache = store.root / "cache" / "step-0000000002.rank-00000.train.arrow"
    shutil.move(cache, outside / cache.name)
    cache.symlink_to(outside / cache.name)
    report = store.verify()
    problems = {p.path: p.problem for p in report.problems}
    assert "outside the store" in problems[victim] and "outside the store" in problems[cache]
    assert report.checked >= 6  # every step file and every other group file still checked
    with pytest.raises(StoreError, match="outside the store"):
        store.read()
    with pytest.warns(UserWarning, match=victim.name):
        assert sorted(set(store.read(on_error="skip").column("step").to_pylist())) == [0, 2]
