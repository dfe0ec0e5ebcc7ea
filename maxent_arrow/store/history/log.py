"""The commit log: the ordered, append-only record of every commit of a store.

::

    root/log/{version:020d}.json          one entry per commit, created exclusively: the commit
    root/log/checkpoint-{version}.parquet the state at that version (every CHECKPOINT_EVERY;
                                          the newest few and every KEEP_EVERY-th kept)
    root/log/_checkpoint.parquet          the newest checkpoint, under a stable name (a copy)
    root/log/_last_checkpoint.json        which checkpoint is newest (a hint; readers check it)

A commit is the exclusive creation of the next entry: on a local disk a hard link under the
store lock (``link`` refuses an existing name), on S3 a conditional PUT (``If-None-Match: *``,
through boto3: ``pyarrow.fs`` has no conditional create). Two writers racing for a version
never both win: the loser reads the winner's entry, checks its own commit still makes sense
(its unit not committed meanwhile) and takes the next version. Files an entry names are
written and made durable before it, so an entry never names a file that is not there; a file
no entry names is a leftover of a crashed write, invisible to every reader.

A reader reads the newest checkpoint, then the entries after it, in order, until a version is
missing: never a listing of the store's files, so opening costs O(entries since the last
checkpoint), not O(commits). A reader pins the version it read: what it serves is the state
at that version, whatever commits after it (``docs/commit-protocol.md``).

What an entry holds is its operation's (:mod:`~maxent_arrow.store.history.operations`: one
typed value per kind of commit); what the state is, :mod:`~maxent_arrow.store.history.state`;
how a checkpoint encodes it, :mod:`~maxent_arrow.store.history.checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
import warnings
from collections.abc import Callable
from typing import Any, cast

import pyarrow as pa

from maxent_arrow.errors import LostEntryError, StoreError
from maxent_arrow.store.history.checkpoint import checkpoint_bytes, state_from_checkpoint
from maxent_arrow.store.history.operations import Entry, Operation, crc32, decode_entry
from maxent_arrow.store.history.state import LogState
from maxent_arrow.store.storage.caches import CACHES
from maxent_arrow.store.storage.crashpoints import crash_point
from maxent_arrow.store.storage.names import LOG

__all__ = [
    "CHECKPOINT_EVERY",
    "KEEP_EVERY",
    "KEEP_NEWEST",
    "CommitLog",
    "HoldsLock",
    "checkpoint_name",
    "entry_name",
]

# A checkpoint every this many versions: a reader replays at most this many entries.
CHECKPOINT_EVERY = 100
# Which checkpoints a store keeps (each holds the whole state, so keeping them all would be
# O(commits^2) bytes: 30 GB of log at 62,500 steps): the newest (the pointer's), the one before
# it, the newest KEEP_NEWEST multiples of CHECKPOINT_EVERY (a reader falls back to them when
# the newest is damaged; a consumer's cursor a little behind starts at one), and every
# multiple of KEEP_EVERY (a cursor or a version asked for long ago replays at most that many
# entries).
KEEP_NEWEST = 3
KEEP_EVERY = 10_000
CHECKPOINT = "_checkpoint.parquet"
LAST_CHECKPOINT = "_last_checkpoint.json"
# The log's head: ``{"version": v}``, the newest version committed, replaced after each
# entry is created (not made durable: a crash may leave it older, never newer). Evidence
# that versions up to it were taken: a reader that finds an entry missing below it reports a
# lost entry instead of serving a shorter history.
HEAD = f"{LOG}/_head.json"


@dataclasses.dataclass(frozen=True)
class LostEntry:
    """A gap in the log: the entry of ``version`` is missing (or damaged: ``damage`` says
    how) although the evidence says versions up to ``evidence`` were committed (the log's
    head, a later entry, a checkpoint); ``where`` is the store."""

    version: int
    evidence: int
    where: str
    damage: str = ""

    def error(self, hidden: str = "") -> LostEntryError:
        """The error readers raise (``hidden``: what the commits after it hold, in words)."""
        what = f"damaged ({self.damage})" if self.damage else "missing"
        return LostEntryError(
            f"{self.where}: commit log entry {self.version} is {what}, but the log says "
            f"versions up to {self.evidence} were committed: the commits from version "
            f"{self.version} on{hidden} are hidden rather than served as a shorter history; "
            "`maxent-arrow repair` rebuilds the lost entry from what survives "
            "(`maxent-arrow verify` names it)",
            self.version,
        )


def entry_name(version: int) -> str:
    """``log/{version:020d}.json``: sortable, one per version."""
    return f"{LOG}/{version:020d}.json"


def checkpoint_name(version: int) -> str:
    return f"{LOG}/checkpoint-{version:020d}.parquet"


# What a commit asks the log to write: an operation, or a builder that makes it from the
# newest state under the lock (``None``: nothing to commit, e.g. an attempt begun already).
Builder = Callable[[LogState], Operation | None]


# ---------------------------------------------------------------------------- the log itself
class HoldsLock:
    """An object whose ``_lock`` (a re-entrant lock: one commit at a time, a sampler's
    lifecycle thread beside the trainer's) stays in its process: a copy pickled elsewhere
    gets a lock of its own."""

    _lock: threading.RLock

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()


class CommitLog(HoldsLock):
    """The commit log of one store: its state at the newest version this object has read,
    kept up to date incrementally, and the one way to commit."""

    def __init__(self, backend: Any, run: str | None = None):
        self.backend = backend
        self.run = run
        self._state: LogState | None = None
        # The gap found by the last fresh read (``None``: the log is whole as far as the
        # evidence goes) and the version of the newest checkpoint the pointer names.
        self.lost: LostEntry | None = None
        self.pointed = 0
        # Whether a reader holds :attr:`_state` pinned (:meth:`pin`): the next entry is then
        # applied to a copy (copy on write: pinning costs nothing while nothing commits).
        self._pinned = False
        # One thread at a time reads entries into the state or commits (a sampler's
        # lifecycle records commit from a thread of their own; re-entrant: a commit reads).
        self._lock = threading.RLock()

    def pin(self) -> LogState:
        """The state at the newest version, which later entries never change (a reader's
        pinned version). Costs no copy unless this object applies an entry while it is
        held."""
        with self._lock:
            state = self.state()
            self._pinned = True
            return state

    def _own(self, state: LogState) -> LogState:
        """``state`` made this object's own to change (a copy when a reader pinned it)."""
        if self._pinned:
            state = state.copy()
            self._state = state
            self._pinned = False
        return state

    # ------------------------------------------------------------------ reading
    def state(self, *, fresh: bool = True) -> LogState:
        """The state at the newest version (``fresh``: read the entries committed since the
        last call; else the state as last read, a pinned version)."""
        with self._lock:
            state = self._state
            if state is None:
                state = self._from_checkpoint() or LogState(run=self.run)
                self._state = state  # (a state shared with other readers is copied on write)
            elif not fresh:
                return state
            self.lost = None
            for version in itertools.count(state.version + 1):
                data = self._read_entry(version)
                if data is None:
                    # The end of the log, or a lost entry: what the head (or, before heads, the
                    # entry after it) says was committed decides.
                    evidence = self.evidence(version)
                    if evidence < version:
                        break
                    data = self._read_entry(version)  # (committed since the first read?)
                    if data is None:
                        self.lost = LostEntry(version, evidence, str(self.backend.uri))
                        break
                try:
                    entry = decode_entry(data, version, str(self.backend.path(entry_name(version))))
                except StoreError as exc:
                    # A damaged entry with anything committed after it is a lost entry too.
                    evidence = self.evidence(version)
                    if evidence <= version:
                        raise  # the newest entry, damaged: a damaged commit, named
                    self.lost = LostEntry(version, evidence, str(self.backend.uri), str(exc))
                    break
                if state is self._state:
                    state = self._own(state)
                entry.apply(state)
            if self.lost is None and self.pointed > state.version:
                # A checkpoint of a later version exists (it could not be read) and the entries
                # stop before it.
                self.lost = LostEntry(state.version + 1, self.pointed, str(self.backend.uri))
            self._state = state
            return state

    def entry(self, version: int) -> Entry | None:
        """The entry of ``version``, checked and decoded (``None``: not committed yet). One
        read, no listing (:mod:`~maxent_arrow.store.history.tail` polls this)."""
        data = self._read_entry(version)
        if data is None:
            return None
        return decode_entry(data, version, str(self.backend.path(entry_name(version))))

    def state_at(self, version: int) -> LogState:
        """The state at ``version`` exactly (a consumer's cursor), not the newest: the newest
        checkpoint at or below it (the pointer's, else the one at each multiple of
        :data:`CHECKPOINT_EVERY` below it, one stat each), then the entries up to it. A
        version past the log's end is a :class:`StoreError`."""
        if version < 0:
            raise StoreError(f"commit log: no version {version} (versions start at 1; 0: empty)")
        state = self._checkpoint_at_or_below(version) or LogState(run=self.run)
        while state.version < version:
            nxt = state.version + 1
            entry = self.entry(nxt)
            if entry is None and self.evidence(nxt) >= nxt:
                self.lost = LostEntry(nxt, self.evidence(nxt), str(self.backend.uri))
                raise cast(LostEntryError, self.lost_error())
            if entry is None:
                raise StoreError(
                    f"{self.backend.uri}: the commit log ends at version {state.version}, "
                    f"before version {version} (a cursor of another store?)"
                )
            entry.apply(state)
        return state

    def _checkpoint_at_or_below(self, version: int) -> LogState | None:
        pointer = f"{LOG}/{LAST_CHECKPOINT}"
        candidates: list[tuple[int, int | None]] = []
        if self.backend.stat(pointer) is not None:
            with contextlib.suppress(StoreError, ValueError, KeyError, TypeError):
                hint = json.loads(self.backend.read(pointer).to_pybytes())
                if int(hint["version"]) <= version:
                    candidates.append((int(hint["version"]), int(hint["crc32"])))
        # The newest multiples of CHECKPOINT_EVERY (kept), then those of KEEP_EVERY (kept),
        # then the others (a store written before checkpoints were retired has them all).
        below = range(version // CHECKPOINT_EVERY * CHECKPOINT_EVERY, 0, -CHECKPOINT_EVERY)
        candidates += [(v, None) for v in below[:KEEP_NEWEST]]
        candidates += [(v, None) for v in below[KEEP_NEWEST:] if v % KEEP_EVERY == 0]
        candidates += [(v, None) for v in below[KEEP_NEWEST:] if v % KEEP_EVERY != 0]
        for at, crc in candidates:
            name = checkpoint_name(at)
            if self.backend.stat(name) is None:
                continue
            try:
                data = self.backend.read(name).to_pybytes()
                if crc is not None and crc32(data) != crc:
                    raise StoreError("checkpoint CRC-32 differs from the one recorded")
                state = state_from_checkpoint(data)
            except (StoreError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
                where = self.backend.path(name)
                warnings.warn(f"{where}: checkpoint not used ({exc})", stacklevel=3)
                continue
            if state.version == at:
                return state
        return None

    def lost_error(self) -> LostEntryError | None:
        """The error of the gap the last read found, naming the steps of the commits it hides
        (read from the entries after it that survive); ``None``: no gap."""
        lost = self.lost
        if lost is None:
            return None
        steps: set[int] = set()
        for entry in self.surviving_after(lost.version, lost.evidence):
            record = getattr(entry.operation, "record", None)
            if record is not None:
                steps.update(record.get("rows", {}).get("step", ()))
        shown = sorted(steps)
        hidden = f" (the later commits hold steps {shown[0]}..{shown[-1]})" if shown else ""
        return lost.error(hidden)

    def surviving_after(self, version: int, last: int) -> list[Entry]:
        """The entries of versions ``version + 1 .. last`` that can be read (those after a
        gap: what ``verify`` and ``repair`` must not take for leftovers)."""
        out = []
        for v in range(version + 1, last + 1):
            with contextlib.suppress(StoreError):
                entry = self.entry(v)
                if entry is not None:
                    out.append(entry)
        return out

    def evidence(self, version: int) -> int:
        """The newest version the log's evidence says was committed, looking from a read
        that found ``version`` missing or damaged: its head, the checkpoint its pointer
        names, and (a store written before heads) the entry after ``version``."""
        raw = self.backend.read_if_present(HEAD)
        found = json.loads(raw.to_pybytes()).get("version", 0) if raw is not None else 0
        if raw is None and self._read_entry(version + 1) is not None:
            found = version + 1
        return max(found, self.pointed)

    def _read_entry(self, version: int) -> bytes | None:
        """The entry of ``version`` (``None``: not committed yet). One read, no listing: on
        an object store one GET per poll."""
        data = self.backend.read_if_present(entry_name(version))
        return None if data is None else data.to_pybytes()

    def _from_checkpoint(self) -> LogState | None:
        """The state of the newest readable checkpoint (``None``: none yet)."""
        pointer = f"{LOG}/{LAST_CHECKPOINT}"
        if self.backend.stat(pointer) is None:
            return None
        try:
            hint = json.loads(self.backend.read(pointer).to_pybytes())
            self.pointed = int(hint["version"])
            key = (self.backend.uri, int(hint["version"]), int(hint["crc32"]))
            state = CACHES.checkpoints.get(key)
            if state is None:
                data = self.backend.read(checkpoint_name(int(hint["version"]))).to_pybytes()
                if crc32(data) != hint["crc32"]:
                    raise StoreError("checkpoint CRC-32 differs from the one recorded")
                state = state_from_checkpoint(data)
                CACHES.checkpoints.put(key, state)
            # Shared with every reader of this checkpoint in the process: pinned, so this
            # log applies its next entry to a copy (and the records parsed by one reader
            # are parsed for all).
            self._pinned = True
            return state
        except (StoreError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            # A damaged checkpoint costs time, not correctness: replay the entries instead.
            where = self.backend.path(pointer)
            warnings.warn(f"{where}: checkpoint not used ({exc})", stacklevel=3)
            return None

    # ------------------------------------------------------------------ committing
    def commit(
        self,
        operation: Operation | Builder,
        *,
        attempt: str = "",
        check: Callable[[LogState], None] | None = None,
        lock_timeout: float | None = None,
        locked: bool = False,
    ) -> int | None:
        """Commit ``operation`` as the next entry, written by ``attempt``, and return its
        version.

        Under the store lock where the backend has one, ``check(state)`` runs on the newest
        state and raises when the commit must not happen; an ``operation`` given as a builder
        is made from that state (``None``: nothing to commit; ``None`` is returned). Then the
        next entry is created exclusively. A writer that loses a race for a version (object
        stores: no lock) reads the winner's entry, checks again and takes the next version.
        ``locked``: the caller holds the store lock already (``repair``). A log with a lost
        entry takes no commit (it would reuse a version the evidence says was taken): a
        :class:`~maxent_arrow.errors.LostEntryError` names it."""
        for _ in range(_RACES):
            with contextlib.nullcontext() if locked else self.backend.lock(lock_timeout):
                # (this object's lock inside the store's: a reader of this object never
                # waits for a commit that waits for another writer)
                with self._lock:
                    state = self.state()
                    if self.lost is not None:
                        raise self.lost.error()  # (a writer: fast, the steps are not named)
                    if check is not None:
                        check(state)
                    made = operation if isinstance(operation, Operation) else operation(state)
                    if made is None:
                        return None
                    version = state.version + 1
                    entry = Entry(version, made, attempt, state.run or self.run)
                    data = entry.encode()
                    crash_point("log:entry-written")
                    head = (HEAD, b'{"version": %d}' % version)
                    if self.backend.put_if_absent(entry_name(version), data, hint=head):
                        state = self._own(state)
                        # The state is what the entry's bytes say (JSON: keys in one order, the
                        # same state a reader replaying the log builds).
                        decode_entry(data, version, entry_name(version)).apply(state)
                        if version % CHECKPOINT_EVERY == 0:
                            with contextlib.suppress(OSError, StoreError):
                                self.write_checkpoint(state)  # a speed-up: failing it loses nothing
                        return version
        raise StoreError(
            f"{self.backend.uri}: lost the race for a commit log version {_RACES} times"
        )

    def write_checkpoint(self, state: LogState | None = None) -> int:
        """Write a checkpoint of ``state`` (default: the newest) and point readers at it, also
        under the stable name ``log/_checkpoint.parquet`` (what plain readers read). Returns
        its version. A crash leaves the older checkpoint in use."""
        state = state or self.state()
        data = checkpoint_bytes(state)
        old = self._pointer()
        self.backend.write_file(checkpoint_name(state.version), data)
        self.backend.write_file(f"{LOG}/{CHECKPOINT}", data)
        hint: dict[str, Any] = {"version": state.version, "crc32": crc32(data), "size": len(data)}
        before = None if old is None else int(old["version"])
        if before is not None and before != state.version:
            hint["previous"] = before
        self.backend.write_file(f"{LOG}/{LAST_CHECKPOINT}", json.dumps(hint).encode())
        self._retire_checkpoints(state.version, before, old)
        return state.version

    def _pointer(self) -> dict[str, Any] | None:
        """The pointer's hint as written (``None``: none, or not readable)."""
        with contextlib.suppress(StoreError, ValueError, KeyError, TypeError):
            raw = self.backend.read_if_present(f"{LOG}/{LAST_CHECKPOINT}")
            if raw is not None:
                hint = json.loads(raw.to_pybytes())
                int(hint["version"])
                return hint
        return None

    def _retire_checkpoints(
        self, version: int, before: int | None, old: dict[str, Any] | None
    ) -> None:
        """Delete the checkpoints that writing the one of ``version`` leaves unkept
        (:data:`KEEP_NEWEST`, :data:`KEEP_EVERY`): the one before the previous pointer's
        (``old``'s ``previous``) and the multiple of :data:`CHECKPOINT_EVERY` that left the
        newest few, no listing. A deletion that fails, or one a crash skipped, leaves a file
        no reader needs (nothing reads it but a reader that falls back past the kept ones)."""
        newest = version // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        window = range(newest, newest - KEEP_NEWEST * CHECKPOINT_EVERY, -CHECKPOINT_EVERY)
        kept = {version, *([] if before is None else [before]), *window}
        candidates = {newest - KEEP_NEWEST * CHECKPOINT_EVERY}
        if old is not None and isinstance(old.get("previous"), int):
            candidates.add(old["previous"])
        for v in sorted(candidates):
            if v > 0 and v not in kept and v % KEEP_EVERY != 0:
                with contextlib.suppress(StoreError, OSError):
                    self.backend.remove(checkpoint_name(v))


_RACES = 1000
