"""A live tail of a store: each step unit as its commit lands, with a resumable cursor.

An asynchronous trainer (or a monitor) learns of new steps from the commit log
(:mod:`.log`), never from a listing: the tail reads the entry of the next version, and when
it is not there yet, waits for it. Locally it waits on inotify (``root/log/``: the commit's
``link`` wakes it within a millisecond or so) where the ``inotify_simple`` package is there
(Linux; a dependency there), and polls otherwise; on object stores it polls. Polling costs
one read of the next entry's name per ``poll`` seconds (one stat-like ``open`` locally, one
GET on S3), never a listing; with inotify the same read runs at each wake-up and every
``poll`` seconds as a safety net (a network file system that sends no events).

**Events** (:class:`TailEvent`), in log order:

``"step"``
    a unit (step, rank, kind) was committed and is in the run's effective history: its log
    version, attempt and role, the step rows' key figures, and where it is
    (:attr:`TailEvent.selection` is what ``store.read(**selection)`` takes to fetch exactly
    its rows). A unit written by an attempt that a later attempt had already superseded
    when it was committed (a writer of an old launch still running after a resume) is not
    a step of the history and is not delivered.
``"superseded"``
    an attempt began that supersedes steps delivered before (a resume at ``resume_from``, a
    re-run): it names every unit (step, rank, kind, the attempt that wrote it) that was
    effective before that entry and is not after it, so a consumer that buffered or trained
    on them can react. Re-delivered steps of the new attempt follow as ``"step"`` events.

Compactions, restores, record tables, drops and retirements change no unit of the history
and give no event (a unit's rows are the same whichever file holds them: ``store.read`` finds
them).

**The cursor** is the log version of an event (:attr:`TailEvent.version`); ``since=v``
resumes after version ``v`` (``since=0``: from the first commit; ``None``: from now). Each
log entry gives at most one event, so a version names one event. Delivery is **at least
once**: a consumer that processes an event and then saves its version sees, after a crash
between the two, that event again. A consumer that saves the cursor **with** its own
checkpoint (atomically: the same file, or the same transaction) sees each event exactly
once: what its checkpoint holds was processed up to the cursor, and the tail resumes after
it (the exactly-once condition of ``docs/commit-protocol.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store.history.log import CommitLog, LostEntry
from maxent_arrow.store.history.operations import AppendUnit, BeginAttempt, Entry
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.storage.backend import Backend
from maxent_arrow.store.storage.names import GROUPS, LOG, unit_name

__all__ = ["DEFAULT_POLL", "FIGURES", "TailEvent", "check_since", "tail", "watches"]

# Seconds between two reads of the next entry when no inotify event comes.
DEFAULT_POLL = 0.25
# The step rows' figures an event carries: every scalar number of the step layout (the
# registry's), but the unit's key and group count (fields of their own).
FIGURES = tuple(n for n in R.numbers(R.STEP, level="step") if n not in (*R.UNIT_KEY, "num_groups"))
# How long a newest entry that does not parse may be a write still in progress (stores on
# file systems without an atomic create: a check, then a write) before it is an error.
_TORN_GRACE = 2.0


@dataclasses.dataclass(frozen=True)
class TailEvent:
    """One item of :func:`tail`: a committed step unit, or steps superseded by a new attempt.

    ``version`` is the cursor (the log version of the entry; ``since=version`` resumes after
    it). ``time`` is the entry's commit time (ISO 8601, UTC). ``attempt`` and ``role``: the
    attempt that wrote the unit, or (``"superseded"``) the attempt that supersedes.
    ``superseded`` (``"superseded"`` only): the units no longer in the history, each a
    mapping ``{"step", "rank", "kind", "attempt"}``, in (step, kind, rank) order.
    """

    event: Literal["step", "superseded"]
    version: int
    time: str
    attempt: str
    role: str
    step: int | None = None
    rank: int | None = None
    kind: str | None = None
    num_groups: int | None = None
    unit: str | None = None
    step_file: str | None = None
    group_file: str | None = None
    figures: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resume_from: int | None = None
    superseded: tuple[Mapping[str, Any], ...] = ()

    @property
    def selection(self) -> dict[str, Any]:
        """``store.read(**event.selection)``: the rows of this unit (``"step"`` events),
        wherever a compaction moved them; ``store.replay(steps=..., kind=...)`` takes the
        same ``steps`` and ``kind``. For ``"superseded"``: the superseded steps."""
        if self.event == "step":
            return {"steps": [self.step], "kind": self.kind, "ranks": [self.rank]}
        return {"steps": sorted({int(u["step"]) for u in self.superseded})}

    def to_json(self) -> dict[str, Any]:
        """The event as a JSON object (``maxent-arrow tail --json`` prints one per line)."""
        out = dataclasses.asdict(self)
        out["figures"] = dict(self.figures)
        out["superseded"] = [dict(u) for u in self.superseded]
        # Each kind of event with its own fields: the common ones, then a step's or a
        # superseded event's.
        common = [f.name for f in dataclasses.fields(self)][:5]
        own = ["resume_from", "superseded"]
        if self.event == "step":
            return {k: v for k, v in out.items() if k not in own}
        return {k: out[k] for k in (*common, *own)}


def check_since(since: object) -> int | None:
    if since is None:
        return None
    if isinstance(since, bool) or not isinstance(since, int) or since < 0:
        raise ArgumentError(f"since: expected a log version >= 0 (a cursor), got {since!r}")
    return since


def check_seconds(value: object, what: str, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ArgumentError(f"{what}: expected seconds >= 0, got {value!r}")
    return float(value)


def tail(
    log: CommitLog,
    *,
    kind: str | None = None,
    since: int | None = None,
    poll: float = DEFAULT_POLL,
    timeout: float | None = None,
    inotify: bool = True,
) -> Iterator[TailEvent]:
    """The events of ``log`` after version ``since`` (``None``: from its newest version on),
    as they are committed (see the module docstring). ``kind``: only units of this kind.
    ``poll``: seconds between two reads of the next entry when nothing wakes the tail.
    ``timeout``: stop when no event came for this many seconds (``None``: never; a
    generator the caller closes). ``inotify``: wait on inotify where it is available (local
    stores on Linux); ``False`` polls (for comparison)."""
    since = check_since(since)
    poll = check_seconds(poll, "poll", allow_none=False) or 0.0
    timeout = check_seconds(timeout, "timeout", allow_none=True)
    if kind is not None and not isinstance(kind, str):
        raise ArgumentError(f"kind: expected a kind name (train, eval), got {kind!r}")
    # Read now, so that a bad cursor is an error of the call, not of the first next(). The
    # tail's own copy of the state: the store's catalog keeps reading its own.
    state = log.state().copy() if since is None else log.state_at(since)
    return _follow(log, state, kind, poll, timeout, inotify)


def _follow(
    log: CommitLog,
    state: LogState,
    kind: str | None,
    poll: float,
    timeout: float | None,
    inotify: bool,
) -> Iterator[TailEvent]:
    waiter = _waiter(log.backend, inotify)
    try:
        idle = time.monotonic()
        torn = None
        while True:
            try:
                entry = log.entry(state.version + 1)
            except StoreError as exc:
                # A newest entry being written by a check-then-write backend: read it again.
                if exc.errno is not None or log.backend.exclusive_create:
                    raise
                torn = torn or time.monotonic()
                if time.monotonic() - torn > _TORN_GRACE:
                    raise
                entry = None
            if entry is None and log.evidence(state.version + 1) > state.version:
                # The head (or a later entry) says it was committed: read once more (it may
                # have landed between the two reads), else the tail stops at a lost entry,
                # naming it, rather than wait at it in silence.
                entry = log.entry(state.version + 1)
                if entry is None:
                    evidence = log.evidence(state.version + 1)
                    log.lost = LostEntry(state.version + 1, evidence, str(log.backend.uri))
                    error = log.lost_error()
                    assert error is not None
                    raise error
            if entry is None:
                left = None if timeout is None else timeout - (time.monotonic() - idle)
                if left is not None and left <= 0:
                    return
                waiter.wait(poll if left is None else min(poll, left))
                continue
            torn = None
            event = _apply(state, entry, kind)
            if event is not None:
                yield event
                idle = time.monotonic()
    finally:
        waiter.close()


# ---------------------------------------------------------------------------- events
def _apply(state: LogState, entry: Entry, kind: str | None) -> TailEvent | None:
    """Apply ``entry`` to ``state``; the event it gives, if any."""
    operation = entry.operation
    if isinstance(operation, BeginAttempt):
        before = state.copy()
        entry.apply(state)
        attempt = state.attempts[-1]
        gone = _superseded(before, state, kind)
        if not gone:
            return None
        return TailEvent(
            "superseded",
            attempt.version,
            entry.time,
            attempt.id,
            attempt.role,
            resume_from=attempt.resume_from,
            superseded=tuple(gone),
        )
    entry.apply(state)
    if not isinstance(operation, AppendUnit):
        return None  # compact, restore, step_file, records, drop, retire: no new unit
    rel = operation.step_file
    unit = state.units[rel]
    rows = unit.record.get("rows", {})
    steps = rows.get("step") or []
    if len(steps) != 1:  # an append commits one step of one rank
        raise StoreError(f"commit log: append entry {unit.version} holds {len(steps)} step rows")
    step, rank, knd = int(steps[0]), int(rows["rank"][0]), str(rows["kind"][0])
    if (kind is not None and knd != kind) or not state.is_effective(step, unit.attempt, knd):
        return None
    attempt = state.attempt(unit.attempt)
    return TailEvent(
        "step",
        unit.version,
        entry.time,
        unit.attempt,
        "" if attempt is None else attempt.role,
        step=step,
        rank=rank,
        kind=knd,
        num_groups=int(rows["num_groups"][0]) if "num_groups" in rows else None,
        unit=unit_name(step, rank, knd),
        step_file=rel,
        group_file=f"{GROUPS}/{unit.record['group_file']}",
        figures={f: rows[f][0] for f in FIGURES if rows.get(f, [None])[0] is not None},
    )


def _superseded(before: LogState, after: LogState, kind: str | None) -> list[dict[str, Any]]:
    """The units effective in ``before`` and not in ``after`` (the state once a new attempt
    began): what the attempt took out of the history (each was delivered, or would have
    been)."""
    gone: set[tuple[int, str, int, str]] = set()
    for e in after.units.values():
        rows = e.record.get("rows", {})
        was, now = before.effective_units(e), after.effective_units(e)
        for step, rank, knd, old, new in zip(
            rows.get("step", ()), rows.get("rank", ()), rows.get("kind", ()), was, now
        ):
            if (kind is None or knd == kind) and old and not new:
                gone.add((int(step), str(knd), int(rank), e.attempt))
    return [{"step": s, "rank": r, "kind": k, "attempt": a} for s, k, r, a in sorted(gone)]


# ---------------------------------------------------------------------------- waiting
class _Poll:
    """Sleep: the next read is ``poll`` seconds later."""

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        pass


class _Inotify:
    """Wait for a name to appear in ``root/log/`` (a commit's link, or anything else: the
    tail then reads the next entry, which may still be missing) or ``seconds``."""

    def __init__(self, directory: str):
        import inotify_simple

        self._flags = inotify_simple.flags
        self._fd = inotify_simple.INotify()
        try:
            self._fd.add_watch(directory, self._flags.CREATE | self._flags.MOVED_TO)
        except BaseException:
            self._fd.close()
            raise

    def wait(self, seconds: float) -> None:
        # Events queued since the watch began are kept, so a commit between the read that
        # found nothing and this wait still wakes it at once.
        self._fd.read(timeout=max(0, int(seconds * 1000)))

    def close(self) -> None:
        self._fd.close()


def _waiter(backend: Backend, inotify: bool) -> _Poll | _Inotify:
    if inotify and backend.can_watch:
        with contextlib.suppress(ImportError, OSError):
            return _Inotify(backend.fs_path(LOG))
    return _Poll()


def watches(backend: Backend, *, inotify: bool = True) -> str:
    """How :func:`tail` waits on ``backend``: ``"inotify"`` or ``"poll"``."""
    waiter = _waiter(backend, inotify)
    waiter.close()
    return "inotify" if isinstance(waiter, _Inotify) else "poll"
