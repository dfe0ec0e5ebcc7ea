"""The store formats, and the one place a reader's catalog is chosen by them.

A store's format is its manifest's ``schema_version`` (:data:`~maxent_arrow.store.history.
manifest.STORE_VERSION` for new stores). Format 3 and later commit through a commit log and
are the format every writer writes; 1.x and 2.x stores (a directory of committed step files)
are read by every reader and written by none until ``maxent-arrow upgrade`` gives them a log
(:mod:`~maxent_arrow.store.upkeep.upgrade`). Nothing else branches on the format: the
catalog :func:`open_catalog` returns answers for itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from maxent_arrow.store.history.catalog import Catalog, History
from maxent_arrow.store.history.listing import ListingCatalog
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.logged import LogCatalog
from maxent_arrow.store.storage.backend import Backend

__all__ = ["format_of", "has_log", "open_catalog"]


def format_of(manifest: Mapping[str, Any]) -> str:
    """The store format of ``manifest`` (``"0"``: none recorded)."""
    return str(manifest.get("schema_version") or "0")


def has_log(manifest: Mapping[str, Any]) -> bool:
    """Whether the store of ``manifest`` commits through a commit log (format 3 and later)."""
    return int(format_of(manifest).split(".")[0]) >= 3


def open_catalog(
    backend: Backend, manifest: Mapping[str, Any], *, history: History = "effective"
) -> Catalog:
    """The catalog of the store of ``manifest``: its commit log's, else (a store written
    before the log) the one its listing gives, read-only."""
    run = manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None
    if has_log(manifest):
        return LogCatalog(backend, run, CommitLog(backend, run), history)
    return ListingCatalog(backend, run, manifest, history)
