"""The store's process-wide caches are one visible object: each bounded, least recently used
first out, counted; a real read fills them and a second read hits them; ``clear`` makes the
next read check every file again; and no other module-level cache hides in the store."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from fault_harness import flip_chunk

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.store import ReadOnlyStore, process_caches
from maxent_arrow.store.storage.caches import Cache
from maxent_arrow.testing import make_batch

STORE = Path(__file__).resolve().parents[2] / "maxent_arrow" / "store"


def test_a_cache_is_bounded_and_forgets_the_least_recently_used():
    cache: Cache[int, str] = Cache("t", 3, "a test")
    for i in range(3):
        cache.put(i, str(i))
    assert cache.get(0) == "0"  # 0 is now the most recent
    cache.put(3, "3")
    assert len(cache) == 3 and 1 not in cache and 0 in cache
    assert cache.get(1) is None and (cache.hits, cache.misses) == (1, 1)
    cache.update(0, lambda old: (old or "") + "!")
    assert cache.get(0) == "0!"
    cache.clear()
    assert len(cache) == 0 and (cache.hits, cache.misses) == (0, 0)


def test_reads_fill_the_caches_and_a_second_read_hits_them(tmp_path):
    store = RolloutStore.create(tmp_path / "s", compact_every=None)
    for step in range(3):
        store.append(make_batch(step))
    store.checkpoint()
    caches = process_caches()
    caches.clear()
    reader = ReadOnlyStore(store.root)
    reader.sql("SELECT count(*) FROM groups")
    described = {c["name"]: c for c in caches.describe()}
    assert set(described) == {
        "verified", "checkpoints", "records", "footers", "labels", "takes", "plans"
    }
    assert described["verified"]["entries"] >= 3 and described["checkpoints"]["entries"] == 1
    before = caches.verified.hits
    ReadOnlyStore(store.root).sql("SELECT count(*) FROM groups")  # a new object, a new session
    assert caches.verified.hits > before and caches.checkpoints.hits >= 1
    assert all(c["entries"] <= c["limit"] for c in caches.describe())


def test_clear_makes_the_next_read_check_each_file_again(tmp_path):
    """A byte flipped under a checked file with its size and mtime restored is not seen by a
    process that checked it (the documented limit); after ``clear`` the next query is."""
    store = RolloutStore.create(tmp_path / "s", compact_every=None)
    store.append(make_batch(0))
    query = "SELECT sum(list_sum(advantages)) FROM groups"
    ReadOnlyStore(store.root).sql(query)
    (path,) = store.committed_files()
    stat = path.stat()
    flip_chunk(path, "advantages", keep_mtime=True)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    ReadOnlyStore(store.root).sql(query)  # checked before: served from the cache's word
    process_caches().clear()
    with pytest.raises(StoreError, match=path.name):
        ReadOnlyStore(store.root).sql(query)


def test_no_other_module_level_cache_in_the_store():
    """A private or lower-case module-level mapping made empty (``_X = {}``,
    ``OrderedDict()``) in the store would be a cache nobody sees: they all live in
    storage/caches.py. (Public registries filled at import, ``OPERATIONS``, are constants.)"""
    found = []
    for path in sorted(STORE.rglob("*.py")):
        if path.name == "caches.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            made = isinstance(value, ast.Dict) and not value.keys
            made |= isinstance(value, ast.Call) and getattr(value.func, "id", "") in (
                "dict", "OrderedDict"
            )  # fmt: skip
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", 0)]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if made and any(n.startswith("_") or not n.isupper() for n in names):
                found.append(f"{path.relative_to(STORE)}:{node.lineno}")
    assert found == []
