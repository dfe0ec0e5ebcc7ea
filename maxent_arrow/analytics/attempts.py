"""The attempts of a run (each writer session: a launch, a resume, a re-run): what became of
each (``running``, ``finished``, ``crashed`` or ``superseded``, from what the store knows),
and the roles their records belong to.

The commit log records when an attempt began (its ``attempt`` entry: role, mode, resume
point, host, pid, start time), what it committed (its units and records), and, since the
``attempt_ends`` record table, when its writer ended it (the store's ``checkpoint()`` at the
run's end, or a ``with`` block left without an exception). From these, in this order:

``superseded``
    a later attempt of its role resumed below one of its stored steps (or re-ran): some of
    what it wrote is no longer the run's history (``detail`` names the steps and by whom);
``finished``
    its writer recorded its end, and committed nothing after it;
``running``
    it did not end, and the process that began it is alive: same host, a process of that pid
    started no later than the attempt (a pid reused by a later process is not it);
``crashed``
    it did not end and that process is gone (killed, out of memory, preempted, an exception);
``unfinished``
    it did not end and began on another host: whether it still runs cannot be told from here.

**Roles.** A store may hold the records of several roles: the trainer that wrote the
rollouts (``trainer``) and, say, a replay sampler that trained another policy from them
(``sampler``, the demo's offline policy). What the run's trainer did with its groups is the
trainer's ``lifecycle`` records: :func:`role_lifecycle` gives one role's (the trainer's by
default), so that another role's consumption never reads as the trainer's (a group the
sampler dropped was not dropped by the trainer; a group it trained on 30 steps later is not
30 steps stale). Every reader of the lifecycle here goes through it.

The attempt's ``if_exists`` mode (``error``, ``resume``, ``new_attempt``) says how it began,
never how it ended: it is shown beside the status, not as it. No torch, no SQL: the log's state.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import text_values
from maxent_arrow.errors import ArgumentError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.store.storage.names import parse_name

__all__ = [
    "STATUSES",
    "TRAINER",
    "attempt_statuses",
    "lifecycle_roles",
    "process_alive",
    "role_lifecycle",
    "status_text",
]

TRAINER = "trainer"  # the role whose lifecycle records say what the run trained on

STATUSES = ("running", "finished", "crashed", "superseded", "unfinished")
# A process started this long after its attempt's recorded start is another process of the
# same pid (/proc's start time is in clock ticks since a boot time of one-second resolution).
_START_SLACK = 2.0


def process_alive(pid: int, host: str, started_at: str) -> bool | None:
    """Whether the process that began an attempt (``pid`` on ``host``, which began it at
    ``started_at``, ISO 8601) still runs: ``None`` on another host (not knowable here)."""
    if host != socket.gethostname():
        return None
    if not isinstance(pid, int) or pid <= 0:
        return False
    began = _epoch(started_at)
    start = _process_start(pid)
    if start is not None:
        return began is None or start <= began + _START_SLACK
    try:  # no /proc (not Linux): whether the pid exists at all
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _epoch(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, from ``/proc``): ``None``
    without ``/proc``, infinity for a pid no process has (later than any attempt)."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return float("inf")  # gone (or unreadable): started after anything
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _superseded_by(state: Any, attempt: Any) -> tuple[list[int], list[str]]:
    """The stored steps of ``attempt`` no longer in the history, and the later attempts of
    its role that resumed at or below the last of them."""
    later = [
        a
        for a in state.attempts
        if a.version > attempt.version and a.role == attempt.role and a.resume_from is not None
    ]
    if not later:
        return [], []  # nothing resumed after it: no commit record is read
    lowest = min(min([a.resume_from, *a.resume_kinds.values()]) for a in later)
    steps: set[int] = set()
    for rel, entry in state.units.items():
        named = parse_name(rel.rpartition("/")[2])
        if entry.attempt != attempt.id or (named is not None and named.last_step < lowest):
            continue  # (a file's name says its last step: below every resume point, kept)
        rows = entry.record.get("rows", {})
        for step, kept in zip(rows.get("step") or [], state.effective_units(entry)):
            if not kept:
                steps.add(int(step))
    if not steps:
        return [], []
    by = [a.id for a in later if min([a.resume_from, *a.resume_kinds.values()]) <= max(steps)]
    return sorted(steps), by


def _last_commits(state: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Per attempt: the version of its last commit (units and records), and of its last
    ``attempt_ends`` record."""
    last: dict[str, int] = {}
    ended: dict[str, int] = {}
    for entry in state.units.values():
        last[entry.attempt] = max(last.get(entry.attempt, 0), int(entry.version))
    for name, items in state.records.items():
        for item in items:
            who, version = str(item["attempt"]), int(item["version"])
            target = ended if name == R.ATTEMPT_ENDS else last
            target[who] = max(target.get(who, 0), version)
    return last, ended


def attempt_statuses(store: ReadOnlyStore) -> list[dict[str, Any]]:
    """The run's attempts in the order they began, each as :meth:`ReadOnlyStore.attempts`
    gives it (id, role, mode, resume point, start, host, pid, config, log version) with
    ``status`` (one of :data:`STATUSES`, see the module) and ``detail`` (a phrase: which steps
    were superseded and by whom, when it ended, why a status is unknown). A store without a
    commit log has no attempts (``[]``)."""
    attempts = store.attempts()
    if not attempts:
        return []
    state = store.catalog.state()
    by_id = {a.id: a for a in state.attempts}
    last, ended = _last_commits(state)
    out = []
    for info in attempts:
        attempt = by_id[info["id"]]
        steps, by = _superseded_by(state, attempt)
        if steps:
            shown = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
            status, detail = "superseded", f"steps {shown} by {', '.join(by) or 'a later attempt'}"
        elif attempt.id in ended and ended[attempt.id] >= last.get(attempt.id, 0):
            status, detail = "finished", "its writer recorded its end"
        else:
            alive = process_alive(attempt.pid, attempt.host, attempt.started_at)
            if alive is None:
                status, detail = "unfinished", f"no end recorded; began on host {attempt.host}"
            elif alive:
                status, detail = "running", f"process {attempt.pid} is alive"
            else:
                status, detail = "crashed", f"no end recorded; process {attempt.pid} is gone"
        out.append({**info, "status": status, "detail": detail})
    return out


def status_text(attempt: dict[str, Any]) -> str:
    """An attempt's status as ``inspect`` and the explorer print it: ``"finished"``,
    ``"superseded (steps 3..4 by b)"``."""
    status = attempt.get("status") or "-"
    if status in ("superseded", "unfinished"):
        return f"{status} ({attempt.get('detail')})"
    return status


def lifecycle_roles(store: ReadOnlyStore) -> list[str]:
    """The roles whose attempts wrote ``lifecycle`` records (the trainer's first)."""
    if R.LIFECYCLE not in store.record_names():
        return []
    role_of = {a["id"]: a["role"] for a in store.attempts()}
    written = store.lifecycle().column("attempt").to_pylist()
    found = {role_of.get(a, TRAINER) for a in set(written)}
    return sorted(found, key=lambda r: (r != TRAINER, r))


def role_lifecycle(store: ReadOnlyStore, role: str | None = TRAINER) -> pa.Table | None:
    """The ``lifecycle`` records (the history the store reads) of ``role``'s attempts: the
    trainer's by default; ``None`` every role's. ``None`` back when the store has no
    lifecycle records. A role no attempt of the store has is an
    :class:`~maxent_arrow.errors.ArgumentError` naming the roles there are (a store without
    a commit log has one role, the trainer's)."""
    if R.LIFECYCLE not in store.record_names():
        if role is not None and role != TRAINER:
            _check_role(store, role)
        return None
    records = store.lifecycle()
    if role is None:
        return records
    _check_role(store, role)
    mine = [a["id"] for a in store.attempts() if a["role"] == role]
    return records.filter(pc.is_in(records.column("attempt"), value_set=text_values(mine)))


def _check_role(store: ReadOnlyStore, role: object) -> None:
    roles = sorted({a["role"] for a in store.attempts()} | {TRAINER})
    if not isinstance(role, str) or role not in roles:
        raise ArgumentError(
            f"role: expected one of the store's roles ({', '.join(roles)}), got {role!r}"
        )
