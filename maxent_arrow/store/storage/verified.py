"""Verified bytes: what this process has checked of each committed file, so each file's
footer and column chunks are CRC-checked once per process rather than once per query.

A file is keyed by its identity and state as the store sees them: its path, its size and its
modification time (from the listing or a ``stat``), and the CRC-32 its commit recorded
(so a rewrite committed under the same name, as ``repair`` does, is a new key). The guarantee
(``docs/commit-protocol.md``, "Every read path checks what it serves"):

- damage present when this process first reads a file is never served: the first read of
  each (file, part) in a process checks it;
- damage that comes later and changes the size or the modification time is caught by the
  next query (a new key);
- damage that comes later with the size and the modification time restored (a deliberate
  ``os.utime``, or a bit flip on the medium under a cached page) is not re-checked in a
  process that checked the file already; ``verify`` (which never consults this cache) and
  every new process find it.

The cache holds keys and names only (no bytes) and is bounded (the process caches'
``verified``, :mod:`~maxent_arrow.store.storage.caches`: the oldest are forgotten first).
"""

from __future__ import annotations

from collections.abc import Iterable

from maxent_arrow.store.storage.caches import CACHES

__all__ = ["FileKey", "add", "checked", "forget"]

# (path, size, mtime_ns, recorded CRC-32) of a file
FileKey = tuple[str, int, int, int | None]


def checked(key: FileKey | None) -> frozenset[str]:
    """The parts (column names, a footer marker) of file ``key`` this process has checked."""
    if key is None:
        return frozenset()
    return CACHES.verified.get(key) or frozenset()


def add(key: FileKey | None, parts: Iterable[str]) -> None:
    """Record that ``parts`` of file ``key`` matched their CRCs in this process."""
    if key is None:
        return
    new = frozenset(parts)
    CACHES.verified.update(key, lambda old: (old or frozenset()) | new)


def forget() -> None:
    """Forget everything (tests; a process that wants every file checked again)."""
    CACHES.verified.clear()
