"""``upgrade``: give a store written before the commit log (format 1.x or 2.x) a commit log,
over its files as they are, so that it can be written again.

What the log says is exactly what the store's listing says
(:class:`~maxent_arrow.store.history.listing.ListingCatalog`): one attempt (the run as it
was written, ``upgraded-from-<format>``), then one entry per committed step file, in step
order (an ``append`` per one-step file, a ``compact`` per segment), each with the step file's
record, size and CRC-32. No data file is rewritten. The steps:

1. refuse a store that is damaged (anything ``verify`` reports as a problem): the log would
   say a damaged file was committed; nothing is written;
2. the entries, each created exclusively (``upgrade:begun`` after the first,
   ``upgrade:entries-written`` after the last); entries left by an upgrade that did not
   finish are kept when they are the ones this upgrade would write, and refused otherwise;
3. a checkpoint of the log (``upgrade:checkpoint-written``);
4. the manifest, replaced atomically by one of the current format that names the log: the
   commit point (``upgrade:upgraded``).

Until step 4 every reader reads the store as before (a store of the old format ignores
``log/``); after it, through the log, which serves the same rows. A SIGKILL anywhere leaves
one or the other, and ``upgrade`` again finishes the job. It is idempotent: a store of the
current format is left as it is. On a local disk it holds the store lock without waiting: of
two upgrades at once one wins and the other fails, changing nothing. On object storage the
entries' exclusive creation and their fixed content make two upgrades write the same log.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from maxent_arrow.errors import StoreError
from maxent_arrow.store.history import manifest as manifests
from maxent_arrow.store.history.formats import format_of, open_catalog
from maxent_arrow.store.history.log import CommitLog, entry_name
from maxent_arrow.store.history.operations import (
    BeginAttempt,
    Entry,
    Operation,
    decode_entry,
)
from maxent_arrow.store.storage.backend import Backend, open_backend
from maxent_arrow.store.storage.crashpoints import crash_point
from maxent_arrow.store.storage.names import LOG, MANIFEST
from maxent_arrow.store.upkeep.verify import verify

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = ["UpgradeReport", "upgrade"]


@dataclasses.dataclass(frozen=True)
class UpgradeReport:
    """What :func:`upgrade` did: the format it found and the one it left, the units its log
    commits and the log version it ends at (``upgraded=False``: the store had a commit log
    already, and nothing was written)."""

    uri: str
    from_format: str
    to_format: str
    units: int
    log_version: int
    upgraded: bool

    def __str__(self) -> str:
        if not self.upgraded:
            return f"{self.uri}: store format {self.from_format}, already with a commit log"
        return (
            f"{self.uri}: upgraded from store format {self.from_format} to {self.to_format}: "
            f"a commit log of {self.units} committed step files (log version "
            f"{self.log_version}); no data file rewritten"
        )


def upgrade(
    root: str | os.PathLike[str] | Backend,
    *,
    filesystem: pafs.FileSystem | None = None,
    lock_timeout: float | None = 0,
) -> UpgradeReport:
    """Give the store at ``root`` (a path, a ``pyarrow.fs`` URI, or a path on
    ``filesystem``) a commit log (the module docstring). Raises :class:`StoreError` (nothing
    changed) for a path that is not a store, a damaged store, a ``log/`` that holds entries of
    something else, or a store whose lock another process holds for more than
    ``lock_timeout`` seconds (default: none; ``None``: wait)."""
    backend = open_backend(root, filesystem)
    if open_catalog(backend, manifests.read(backend)).log_plan() is None:
        return _already(backend, manifests.read(backend))
    with backend.lock(lock_timeout):
        manifest = manifests.read(backend)  # (another upgrade may have finished meanwhile)
        catalog = open_catalog(backend, manifest)
        planned = catalog.log_plan()
        if planned is None:
            return _already(backend, manifest)
        old = format_of(manifest)
        run = _run_id(manifest)
        report = verify(catalog)
        if not report.ok:
            shown = "; ".join(str(p) for p in report.problems[:3])
            more = len(report.problems) - 3
            raise StoreError(
                f"{backend.uri}: not upgraded: the store is damaged ({shown}"
                + (f"; and {more} more" if more > 0 else "")
                + "); nothing was written (`maxent-arrow verify` lists every problem)"
            )
        _write_entries(backend, run, planned)
        crash_point("upgrade:entries-written")
        log = CommitLog(backend, run)
        version = log.write_checkpoint()
        crash_point("upgrade:checkpoint-written")
        upgraded = {
            **manifest,
            "schema_version": manifests.STORE_VERSION,
            "log": {"format": 1},
            "run_id": run,
            "upgraded": {
                "from": old,
                "at": dt.datetime.now(dt.UTC).isoformat(),
                "log_version": version,
            },
        }
        backend.write_file(MANIFEST, json.dumps(upgraded, indent=2).encode())
        crash_point("upgrade:upgraded")
    return UpgradeReport(
        backend.uri, old, manifests.STORE_VERSION, len(planned) - 1, version, upgraded=True
    )


def _already(backend: Backend, manifest: Mapping[str, Any]) -> UpgradeReport:
    version = CommitLog(backend, manifests.run_id(dict(manifest))).state().version
    fmt = format_of(manifest)
    return UpgradeReport(backend.uri, fmt, fmt, 0, version, upgraded=False)


def _run_id(manifest: Mapping[str, Any]) -> str:
    """The store's run identity: its manifest's, else (stores created before run ids) one
    made from the manifest, so that an upgrade run again after a crash makes the same one."""
    found = manifests.run_id(dict(manifest))
    if found is not None:
        return found
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]


def _write_entries(backend: Backend, run: str, planned: list[Operation]) -> None:
    """Create each planned entry (version ``i + 1``), exclusively; an entry already there
    (an upgrade that did not finish, or one running beside this on object storage) must be
    the planned one."""
    attempt = cast(BeginAttempt, planned[0]).attempt.id
    backend.makedirs(LOG)
    later = backend.stat(entry_name(len(planned) + 1))
    if later is not None:
        raise StoreError(
            f"{backend.uri}: not upgraded: log/ holds more entries than this store's upgrade "
            "writes (a log of something else?); nothing was written. Move log/ aside and run "
            "`maxent-arrow upgrade` again"
        )
    for version, operation in enumerate(planned, start=1):
        data = Entry(version, operation, attempt, run).encode()
        if not backend.put_if_absent(entry_name(version), data):
            where = str(backend.path(entry_name(version)))
            found = decode_entry(backend.read(entry_name(version)).to_pybytes(), version, where)
            if _canonical(found.operation) != _canonical(operation) or found.run != run:
                raise StoreError(
                    f"{where}: not upgraded: an entry that is not this store's upgrade (a log "
                    "of something else?); nothing was written. Move log/ aside and run "
                    "`maxent-arrow upgrade` again"
                )
        if version == 1:
            crash_point("upgrade:begun")


def _canonical(operation: Operation) -> str:
    return json.dumps([operation.OP, operation.fields()], sort_keys=True, allow_nan=True)
