"""Attempts: every writer session of a run, recorded in the commit log.

A run is written by one or more *attempts*: a launch of the trainer (all its ranks), a resume
after a crash or a preemption, a re-run into the same directory. Each begins with an
``attempt`` entry in the log: its id, role, start time, the step it resumed from, its mode
and config, and the units of earlier attempts it supersedes (the tombstones of a resume).

**Effective history.** Resuming at step ``s`` supersedes every stored step ``>= s`` written by
an earlier attempt of the same role: a stored step is *effective* when its attempt is the
latest attempt of its role whose resume point is at or below that step. Readers see the
effective history by default (``docs/commit-protocol.md``, "Attempts").

**Identity.** All ranks of one launch share one attempt id: ``MAXENT_ARROW_ATTEMPT`` when
set; else torchrun's (``accelerate launch`` runs torchrun) ``TORCHELASTIC_RUN_ID`` when it is
a real id; else, under torchrun without one, the launcher process (host, parent pid and its
start time: the ranks of one node); else this process (host, pid, start time). A process
that opens a store several times is one attempt. A trainer that runs several times in one
process (a second ``train()``, a relaunch in a notebook) takes a new id per run
(:func:`next_attempt_id`).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import itertools
import os
import socket
from collections.abc import Mapping
from typing import Any, Literal, cast

from maxent_arrow.errors import ArgumentError, StoreError
from maxent_arrow.store.history.operations import BeginAttempt
from maxent_arrow.store.history.state import Attempt, LogState

__all__ = [
    "IfExists",
    "AttemptSpec",
    "attempt_entry",
    "default_attempt_id",
    "next_attempt_id",
    "IF_EXISTS",
]

IfExists = Literal["error", "resume", "new_attempt"]
IF_EXISTS = ("error", "resume", "new_attempt")


def _start_time(pid: int) -> str:
    """A process's start time (clock ticks since boot, from ``/proc``): with the pid, an id
    no other process on this host has had."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return "0"


@functools.cache
def _process_attempt(pid: int) -> str:
    host = socket.gethostname()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    # An elastic restart (--max-restarts) runs new workers under the same run id and agent:
    # a new attempt of the run, which resumes (not the same one continued).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    again = f".restart-{restart}" if restart not in ("", "0") else ""
    if run_id and run_id != "none":
        return f"torchrun-{run_id}{again}"
    if run_id is not None:  # torchrun without a run id: the ranks of one node share a parent
        parent = os.getppid()
        seed = f"{host}:{parent}:{_start_time(parent)}{again}"
    else:
        seed = f"{host}:{pid}:{_start_time(pid)}"
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def default_attempt_id() -> str:
    """This process's attempt id (see the module docstring)."""
    explicit = os.environ.get("MAXENT_ARROW_ATTEMPT")
    if explicit:
        return explicit
    return _process_attempt(os.getpid())


# The trainer runs begun in this process (next_attempt_id).
_RUNS = itertools.count(1)


def next_attempt_id(base: str | None = None) -> str:
    """The attempt id of the next trainer run of this process: ``base`` (default
    :func:`default_attempt_id`) for its first, ``{base}.2``, ``{base}.3``... for later ones.
    Every rank of a launch runs the same trainer runs in the same order, so the ranks share
    each id; and a trainer run again in one process is an attempt of its own (a resume
    supersedes, a fresh run is refused), not the same attempt continued."""
    base = base or default_attempt_id()
    n = next(_RUNS)
    return base if n == 1 else f"{base}.{n}"


class AttemptSpec:
    """How a writer begins its attempt.

    Parameters
    ----------
    if_exists:
        When the store already holds steps of other attempts of this role: ``"error"`` (the
        default: refuse, naming the choices), ``"resume"`` (resume the run: at
        ``resume_from`` when given, superseding the stored steps from there on; else
        continue after them, superseding nothing) or ``"new_attempt"`` (a re-run: the new
        attempt supersedes every stored step of the role).
    resume_from:
        The step the run resumes at (a checkpoint's ``global_step``); implies ``"resume"``.
    resume_kinds:
        Kinds whose resume point differs from ``resume_from``, e.g. ``{"eval": g + 1}`` for a
        trainer that evaluated at step ``g`` before saving its checkpoint there (TRL) and
        will not evaluate at ``g`` again: that evaluation stays in the history.
    attempt:
        An explicit attempt id (default :func:`default_attempt_id`).
    role:
        What this writer writes (``"trainer"``); an asynchronous generator and trainer
        writing one store are two roles, each with its own attempts.
    config:
        The run config (JSON) recorded with the attempt.
    """

    def __init__(
        self,
        *,
        if_exists: IfExists | None = None,
        resume_from: int | None = None,
        attempt: str | None = None,
        role: str = "trainer",
        config: Mapping[str, Any] | None = None,
        resume_kinds: Mapping[str, int] | None = None,
    ):
        kinds = dict(resume_kinds or {})
        if kinds and resume_from is None:
            raise ArgumentError("resume_kinds: a resume point per kind needs resume_from")
        for kind, point in kinds.items():
            if isinstance(point, bool) or not isinstance(point, int) or point < 0:
                raise ArgumentError(f"resume_kinds[{kind!r}]: expected a step >= 0, got {point!r}")
        if resume_from is not None:
            if isinstance(resume_from, bool) or not isinstance(resume_from, int) or resume_from < 0:
                raise ArgumentError(f"resume_from: expected a step >= 0, got {resume_from!r}")
            if if_exists not in (None, "resume"):
                raise ArgumentError(
                    f"resume_from={resume_from} resumes the run; it cannot go with "
                    f"if_exists={if_exists!r}"
                )
            if_exists = "resume"
        if if_exists is not None and if_exists not in IF_EXISTS:
            raise ArgumentError(f"if_exists: expected one of {IF_EXISTS}, got {if_exists!r}")
        if not isinstance(role, str) or not role:
            raise ArgumentError(f"role: expected a name, got {role!r}")
        self.if_exists: IfExists = if_exists or "error"
        self.resume_from = 0 if self.if_exists == "new_attempt" else resume_from
        self._id = attempt
        self.role = role
        self.config = dict(config or {})
        self.resume_kinds = kinds

    @property
    def id(self) -> str:
        """The attempt id: the explicit one, else :func:`default_attempt_id` (worked out when
        first asked: only a writer needs it), with the role for any role but ``"trainer"``
        (one process writing as a generator and as a trainer is two attempts)."""
        if self._id is None:
            base = default_attempt_id()
            self._id = base if self.role == "trainer" else f"{base}.{self.role}"
        return self._id

    def attempt(self) -> Attempt:
        return Attempt(
            id=self.id,
            role=self.role,
            resume_from=self.resume_from,
            started_at=dt.datetime.now(dt.UTC).isoformat(),
            mode=self.if_exists,
            host=socket.gethostname(),
            pid=os.getpid(),
            config=self.config,
            resume_kinds=self.resume_kinds,
        )


def attempt_entry(spec: AttemptSpec, state: LogState, uri: str) -> BeginAttempt | None:
    """The operation that begins ``spec``'s attempt given the log's ``state``, or
    ``None`` when it has begun already (another rank of the launch, or this process before).
    A fresh run into a store that holds steps of another attempt of its role is refused."""
    begun = state.attempt(spec.id)
    if begun is not None:
        # Another rank of the launch began it, or this process before: the same attempt,
        # unless this writer asks for another resume point or a re-run (never ignored).
        other_point = spec.resume_from is not None and spec.resume_from != begun.resume_from
        rerun = spec.if_exists == "new_attempt" and begun.mode != "new_attempt"
        if other_point or rerun:
            raise StoreError(
                f"{uri}: attempt {spec.id} began already (as {begun.mode!r}"
                + (f" at step {begun.resume_from}" if begun.resume_from is not None else "")
                + f"); this writer asks for {spec.if_exists!r}"
                + (f" at step {spec.resume_from}" if spec.resume_from is not None else "")
                + ". A resume or a re-run is an attempt of its own: store.next_attempt("
                "resume_from=...), or attempt=<a new id> (MAXENT_ARROW_ATTEMPT)"
            )
        return None
    others = [
        e
        for e in state.units.values()
        if e.attempt != spec.id
        and (a := state.attempt(e.attempt)) is not None
        and a.role == spec.role
    ]
    if others and spec.if_exists == "error":
        steps = sorted(
            {
                s
                for e in others
                for s, effective in zip(
                    e.record.get("rows", {}).get("step", []), state.effective_units(e)
                )
                if effective
            }
        )
        shown = f"{steps[0]}..{steps[-1]}" if steps else "none"
        raise StoreError(
            f"{uri}: this store already holds {len(steps)} steps ({shown}) of an earlier run "
            f"(attempt {others[-1].attempt}); a fresh run into it is refused. Resume it "
            "(resume_from=<the checkpoint's step>, or if_exists='resume' to continue after "
            "its last step; the CLI's --resume), or write to a new run directory; "
            "if_exists='new_attempt' records this run as a new attempt that supersedes it"
        )
    attempt = spec.attempt()
    # The tombstones: each earlier attempt of the role whose steps from the resume point on
    # this attempt supersedes (readers compute the same from the attempts; this says it).
    superseded = []
    if attempt.resume_from is not None:
        for a in state.attempts:
            if a.role != spec.role:
                continue
            steps = [
                s
                for e in state.units.values()
                if e.attempt == a.id
                for s, k in zip(e.record["rows"]["step"], e.record["rows"]["kind"])
                if s >= cast(int, attempt.resumes_at(k)) and state.is_effective(s, a.id, k)
            ]
            if steps:
                superseded.append({"attempt": a.id, "steps": sorted(set(steps))})
    return BeginAttempt(attempt, tuple(superseded))
