"""The crash points of every write, declared in one registry.

A crash point names a moment of a write (``"append:group-published"``: the group file of an
append is in place, its step file and log entry are not). The reliability tests run a real
writer in a subprocess with ``MAXENT_ARROW_CRASH_AT=<point>``, which SIGKILLs it there (no
cleanup), or ``MAXENT_ARROW_STOP_AT=<point>``, which stops it (SIGSTOP, as a debugger or a
paused job would), and check that nothing acknowledged is lost and nothing half-written is
served. :func:`crash_point` refuses a name that is not in :data:`CRASH_POINTS`, and the kill
test enumerates :data:`CRASH_POINTS`, so a new crash point without a kill test fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["CRASH_POINTS", "CrashPoint", "crash_point"]

_CRASH_ENV = "MAXENT_ARROW_CRASH_AT"
_STOP_ENV = "MAXENT_ARROW_STOP_AT"


@dataclass(frozen=True)
class CrashPoint:
    """A moment of a write: ``operation`` is the write it belongs to (``"append"``,
    ``"compact"``...; ``"log"`` for a moment of every commit), ``stage`` the moment, ``what``
    what is durable there."""

    operation: str
    stage: str
    what: str

    @property
    def name(self) -> str:
        return f"{self.operation}:{self.stage}"


def _unit_points(operation: str) -> list[CrashPoint]:
    """The moments of :func:`~maxent_arrow.store.io.commit.commit_unit` for ``operation``."""
    return [
        CrashPoint(operation, "group-written", "the group file, under a temp name"),
        CrashPoint(operation, "step-written", "both files, under temp names"),
        CrashPoint(operation, "locked", "the precondition checked at the commit"),
        CrashPoint(operation, "group-published", "the group file under its final name"),
        CrashPoint(operation, "step-published", "both files under their final names"),
        CrashPoint(operation, "committed", "the log entry: the unit is committed"),
    ]


_POINTS = [
    CrashPoint("log", "entry-written", "an entry encoded, not yet created: any commit"),
    *_unit_points("append"),
    *_unit_points("compact"),
    CrashPoint("compact", "cleaning", "a segment committed, its inputs moving to retired/"),
    CrashPoint("drop", "cleaning", "superseded files dropped, moving to retired/"),
    *_unit_points("restore"),
    CrashPoint("records", "file-written", "a records file, under a temp name"),
    CrashPoint("records", "published", "a records file under its final name, no entry yet"),
    CrashPoint("upgrade", "begun", "an older store's first log entry (its attempt)"),
    CrashPoint("upgrade", "entries-written", "an older store's log entries, no checkpoint"),
    CrashPoint("upgrade", "checkpoint-written", "its log and checkpoint, the old manifest"),
    CrashPoint("upgrade", "upgraded", "the new manifest: the store is upgraded"),
]

#: Every crash point, by name.
CRASH_POINTS: dict[str, CrashPoint] = {p.name: p for p in _POINTS}


def crash_point(name: str) -> None:
    """Die right here (SIGKILL, no cleanup) if ``MAXENT_ARROW_CRASH_AT`` names this point,
    or stop (SIGSTOP, until a SIGCONT) if ``MAXENT_ARROW_STOP_AT`` does. ``name`` must be in
    :data:`CRASH_POINTS` (an undeclared point is a bug: no test would kill there)."""
    if name not in CRASH_POINTS:
        raise AssertionError(f"crash point {name!r} is not declared in CRASH_POINTS")
    if os.environ.get(_CRASH_ENV) == name:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(_STOP_ENV) == name:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)
