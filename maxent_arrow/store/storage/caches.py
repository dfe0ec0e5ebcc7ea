"""What this process remembers across store objects, in one place: every process-wide cache
of the store, each bounded (least recently used first out), thread-safe, counted and visible.

A cache here only saves work: each holds what a read already checked or parsed, under a key
that changes whenever what it describes could (a file's path with its size, modification
time or recorded CRC-32; a checkpoint's version and CRC-32), so a hit serves exactly what a
new read would. :data:`CACHES` is the one object; ``maxent_arrow.store.process_caches()``
gives it to a user, whose :meth:`ProcessCaches.describe` says what each holds and how well
it serves, and whose :meth:`ProcessCaches.clear` forgets everything (every file is checked
again by the next read).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["CACHES", "Cache", "ProcessCaches", "process_caches"]

K = TypeVar("K")
V = TypeVar("V")


class Cache(Generic[K, V]):
    """A bounded, thread-safe mapping: at most ``limit`` entries, the least recently used
    forgotten first; ``what`` says what it holds (its line in :meth:`ProcessCaches.describe`)."""

    def __init__(self, name: str, limit: int, what: str):
        self.name = name
        self.limit = limit
        self.what = what
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def update(self, key: K, change: Callable[[V | None], V]) -> None:
        """Set ``key`` to ``change(its value or None)``, atomically."""
        with self._lock:
            self._items[key] = change(self._items.pop(key, None))
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def pop(self, key: K) -> None:
        """Forget ``key`` (what it described changed)."""
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)


class ProcessCaches:
    """Every process-wide cache of the store (the module docstring), by name."""

    def __init__(self) -> None:
        self.verified: Cache[Any, frozenset[str]] = Cache(
            "verified", 1 << 18,
            "the parts (footer, column chunks) of each committed file whose CRCs matched, by "
            "path, size, modification time and recorded CRC-32",
        )  # fmt: skip
        self.checkpoints: Cache[Any, Any] = Cache(
            "checkpoints", 8, "the states of the log checkpoints read, by store, version, CRC-32"
        )
        self.records: Cache[Any, Any] = Cache(
            "records", 4096, "the rows of each checked record file, by path, size and CRC-32"
        )
        self.footers: Cache[Any, Any] = Cache(
            "footers", 16, "the parsed Parquet footers of group files read, by path and seal"
        )
        self.labels: Cache[str, list[str]] = Cache(
            "labels", 16, "the row-group labels of segments read, by step file"
        )
        self.takes: Cache[Any, Any] = Cache(
            "takes", 1 << 16,
            "the checked frame of each take file read (its schema and where each group's "
            "batch lies, with its XXH3-64), by store and path",
        )  # fmt: skip
        self.plans: Cache[Any, Any] = Cache(
            "plans", 256, "what each SQL query scans, by the views it ran on and its text"
        )

    def all(self) -> list[Cache[Any, Any]]:
        return [v for v in vars(self).values() if isinstance(v, Cache)]

    def describe(self) -> list[dict[str, Any]]:
        """Each cache: its name, what it holds, its entries, its limit, hits and misses."""
        return [
            {"name": c.name, "what": c.what, "entries": len(c), "limit": c.limit,
             "hits": c.hits, "misses": c.misses}
            for c in self.all()
        ]  # fmt: skip

    def clear(self) -> None:
        """Forget everything: the next read of each file checks it again."""
        for cache in self.all():
            cache.clear()


#: The process's caches.
CACHES = ProcessCaches()


def process_caches() -> ProcessCaches:
    """This process's caches of the store (:class:`ProcessCaches`): ``describe()`` says
    what each holds and how well it serves; ``clear()`` forgets everything."""
    return CACHES
