"""``repair``: move leftovers of crashed writes aside, into ``quarantine/``; never delete.

It takes the store lock (so no commit is in flight) and moves temp files of writers that are
gone, group files no step file commits (an append that did not finish, an unreadable or
foreign file; never a suspected lost commit, which it keeps and names), and files a
committed compaction replaced. Temp files
of writers still running stay. It moves other writers' files, so it needs a backend that can
lock and rename atomically (local stores).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from maxent_arrow.store.backend import is_temp_name, writer_alive
from maxent_arrow.store.catalog import Catalog
from maxent_arrow.store.names import CACHE, GROUPS, QUARANTINE, STEPS, parse_name
from maxent_arrow.store.verify import StoreProblem, classify_uncommitted

__all__ = ["RepairReport", "repair"]


@dataclass
class RepairReport:
    """What :meth:`RolloutStore.repair` did: each file moved to ``quarantine/`` and why,
    and what it left alone (temp files of writers still running)."""

    moved: list[StoreProblem] = field(default_factory=list)
    kept: list[StoreProblem] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.moved)} files moved to quarantine/"]
        lines += [f"  moved {p}" for p in self.moved]
        lines += [f"  kept {p}" for p in self.kept]
        return "\n".join(lines)


def repair(catalog: Catalog, *, lock_timeout: float | None = None) -> RepairReport:
    """Move leftovers of crashed writes into ``quarantine/`` (never delete): temp files of
    writers that are gone, group files no step file commits, and files a committed compaction
    replaced. Runs under the store lock, so no commit is in flight."""
    backend = catalog.backend
    backend.require("can_rewrite", "repair")
    report = RepairReport()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    with backend.lock(lock_timeout):
        names = catalog.step_names()
        replaced = catalog.hidden(names, "skip")
        committed = {n for n in names if n not in replaced}

        def move(directory: str, name: str, why: str) -> None:
            dest = f"{QUARANTINE}/{stamp}/{directory}/{name.lstrip('.')}"
            backend.move(f"{directory}/{name}", dest)
            report.moved.append(StoreProblem(backend.path(f"{directory}/{name}"), why))

        listings = {d: backend.list(d) for d in (GROUPS, STEPS, CACHE)}
        # Uncommitted group files are judged before anything moves: the temp file of an
        # unfinished append's step file is the evidence (verify.classify_uncommitted).
        orphans = {
            n
            for n in listings[GROUPS]
            if not is_temp_name(n)
            and n not in replaced
            and parse_name(n) is not None
            and n not in committed
        }
        judged = classify_uncommitted(catalog, orphans)
        for directory, listing in listings.items():
            for name, info in listing.items():
                if is_temp_name(name):
                    if writer_alive(name, info.mtime_ns):
                        report.kept.append(
                            StoreProblem(
                                backend.path(f"{directory}/{name}"), "temp file of a running writer"
                            )
                        )
                    else:
                        move(directory, name, "temp file of a writer that is gone")
                elif name in replaced and directory != CACHE:
                    move(directory, name, "replaced by a committed compaction")
        for name, (kind, why) in judged.items():
            if kind == "lost":
                # Committed data whose step file is gone: never moved (verify reports it).
                report.kept.append(StoreProblem(backend.path(f"{GROUPS}/{name}"), why))
            else:
                move(GROUPS, name, f"group file no step file commits: {why}")
        for directory in (GROUPS, STEPS):
            with contextlib.suppress(OSError):
                backend.sync(directory)
    return report
