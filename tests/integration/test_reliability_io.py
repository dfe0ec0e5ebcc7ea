"""Fault class: the file system says no. A full disk (``RLIMIT_FSIZE`` in a subprocess) and a
read-only directory (an unprivileged user) are clear errors naming the file, and leave the store
as it was, byte for byte; opening a read-only store to read works.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from fault_harness import env
from fault_harness import snapshot as _snapshot

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.testing import make_batch

# Their writers are ranks (and relaunches) of one run: one attempt.
pytestmark = pytest.mark.usefixtures("one_launch")

# ---------------------------------------------------------------------------- full disk
FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from maxent_arrow.testing import make_batch
    from maxent_arrow import RolloutStore, StoreError
    store = RolloutStore.create(sys.argv[1])
    batch = make_batch(5, groups=64, max_tokens=512)
    # Writes past the limit fail with EFBIG (the signal would kill us instead).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    try:
        store.append(batch)
        print("APPENDED")
    except StoreError as exc:
        print("ERROR", exc.errno, exc)
    """
)


@pytest.mark.slow
def test_full_disk_is_a_clear_error_and_the_store_is_unchanged(tmp_path):
    store = RolloutStore.create(tmp_path / "store")
    store.append(make_batch(0))
    before = _snapshot(store.root)
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(store.root)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ERROR 27"), done.stdout  # EFBIG
    assert "file size limit" in done.stdout and "step-0000000005" in done.stdout
    assert _snapshot(store.root) == before
    assert RolloutStore(store.root).steps() == [0]


# No write at all succeeds: the first is the lock's holder record of the writer's first commit.
NO_WRITE = FULL_DISK.replace("64 * 1024", "0").replace("groups=64, max_tokens=512", "groups=2")


def test_a_full_disk_at_a_new_writers_first_commit_is_a_store_error(tmp_path, monkeypatch):
    """Fault probe F04: the lock holder record a new writer writes before its first commit
    fails on a full disk with a StoreError in os_error's words (a real limit: RLIMIT_FSIZE
    in a subprocess gives EFBIG; a full disk's ENOSPC, from the same system call, reads
    "the disk is full"), not a raw OSError, and the store is unchanged."""
    store = RolloutStore.create(tmp_path / "store")
    store.append(make_batch(0))
    before = _snapshot(store.root)
    done = subprocess.run(
        [sys.executable, "-c", NO_WRITE, str(store.root)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ERROR 27"), done.stdout  # EFBIG
    assert "lock's holder" in done.stdout and "file size limit" in done.stdout
    assert _snapshot(store.root) == before
    assert RolloutStore(store.root).steps() == [0]

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(StoreError, match=r"lock's holder in .*\.lock: the disk is full"):
        RolloutStore(store.root).append(make_batch(1))
    monkeypatch.undo()
    assert _snapshot(store.root) == before


READ_ONLY = textwrap.dedent(
    """
    import os, sys
    from maxent_arrow.testing import make_batch
    from maxent_arrow import RolloutStore, StoreError
    import maxent_arrow.store.store, maxent_arrow.store.sql.views, maxent_arrow.rollout.batch
    batch = make_batch(1)
    if os.geteuid() == 0:
        # Root ignores permissions: drop to an unprivileged user (after the imports, which
        # live under /root here).
        os.setgid(65534)
        os.setuid(65534)
    store = RolloutStore(sys.argv[1])
    print("STEPS", store.steps())
    try:
        store.append(batch)
        print("APPENDED")
    except StoreError as exc:
        print("ERROR", exc)
    """
)


def test_read_only_directory_is_a_clear_error(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="ro-store-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        store = RolloutStore.create(base / "store")
        store.append(make_batch(0))
        for path in [store.root, *store.root.rglob("*")]:
            os.chmod(path, 0o555 if path.is_dir() else 0o444)
        before = _snapshot(store.root)
        environ = {**env(), "HOME": str(base)}
        done = subprocess.run(
            [sys.executable, "-c", READ_ONLY, str(store.root)],
            capture_output=True,
            text=True,
            env=environ,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "STEPS [0]"
        assert lines[1].startswith("ERROR") and "permission denied" in lines[1], lines
        assert _snapshot(store.root) == before
    finally:
        for path in [base, *base.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        shutil.rmtree(base)


def test_cursor_json_is_plain(tmp_path):
    store = RolloutStore.create(tmp_path / "store")
    store.append(make_batch(0))
    batch = next(store.replay())
    assert json.loads(json.dumps(batch.cursor)) == batch.cursor


def test_creating_a_store_makes_its_directory_entries_durable(tmp_path, monkeypatch):
    """A new store's directory is a new entry in its parent: the parent is fsynced (as each
    new directory's parent is) before the store counts as created, or a power cut could
    lose the whole store after ``create`` returned. Observed with a spy that records which
    directories ``os.fsync`` was called on and calls through."""
    opened: dict[int, str] = {}
    synced: list[str] = []
    real_open, real_fsync = os.open, os.fsync

    def spy_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = os.path.abspath(os.fspath(path))
        return fd

    def spy_fsync(fd):
        synced.append(opened.get(fd, "?"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    root = tmp_path / "runs" / "store"
    RolloutStore.create(root)
    monkeypatch.undo()
    for directory in (tmp_path, tmp_path / "runs", root):
        assert str(directory) in synced, (directory, synced)
