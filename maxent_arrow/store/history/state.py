"""The state of a store's history at one version of its commit log: the attempts, the
committed units (step files and their records), the record tables' files, and what left the
history and is not retired yet; and the rules read off it (which writes are *effective*, the
counts ``inspect`` prints of each unit).

A state is built by applying entries in order (:meth:`Entry.apply
<maxent_arrow.store.history.operations.Entry.apply>`), from an empty state or from a checkpoint
(:mod:`~maxent_arrow.store.history.checkpoint`); a store written before the commit log gets the
same state derived from its listing (:mod:`~maxent_arrow.store.history.listing`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from maxent_arrow.arrow import registry as R
from maxent_arrow.store.storage.names import GROUPS, parse_name

__all__ = [
    "TRAINER",
    "Attempt",
    "LogState",
    "UnitEntry",
    "count_runs",
    "entry_summaries",
    "step_runs",
    "summary_text",
    "unit_from_item",
    "unit_item",
    "unit_kind",
    "unit_summary",
]

TRAINER = "trainer"  # the role of a writer that trains (TRL, verl, ours): its drops shape `groups`


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One writer session of a run (every rank of one launch shares it).

    ``resume_from``: the step it resumed at (every stored step at or after it, written by an
    earlier attempt of the same ``role``, is superseded), ``None`` for a session that
    continues where the store ends (supersedes nothing); ``role``: what it writes
    (``"trainer"``: a trainer that generates and trains, as TRL and ours; an asynchronous
    generator and trainer are two roles). ``version``: the log version that began it."""

    id: str
    role: str = TRAINER
    resume_from: int | None = None
    started_at: str = ""
    mode: str = "new"
    host: str = ""
    pid: int = 0
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    version: int = 0
    # Kinds whose resume point is not ``resume_from`` (``{"eval": g + 1}``: a trainer that
    # evaluated at its checkpoint's step before saving it does not evaluate there again).
    resume_kinds: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def resumes_at(self, kind: str | None = None) -> int | None:
        """The step this attempt resumed ``kind`` at (``None``: it supersedes nothing)."""
        if self.resume_from is None:
            return None
        return self.resume_from if kind is None else self.resume_kinds.get(kind, self.resume_from)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = dict(self.config)
        out["resume_kinds"] = dict(self.resume_kinds)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Attempt:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclasses.dataclass(frozen=True)
class UnitEntry:
    """A committed step file: its relative path, its commit record (the step file's store
    metadata), the attempt that wrote it, the version that committed it, and the step file's
    size and CRC-32 (what ``verify`` checks it against)."""

    step_file: str
    record: Mapping[str, Any]
    attempt: str
    version: int
    step_size: int | None = None
    step_crc32: int | None = None
    # The counts of its units (:func:`unit_summary`), as a checkpoint holds them: JSON text,
    # or how to read it (the checkpoint's ``summary`` column is read when first asked for);
    # ``None``: not recorded (an entry, an older checkpoint), computed from the record.
    summary: str | Callable[[], str | None] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )


@dataclasses.dataclass
class LogState:
    """The store's state at :attr:`version`, built by applying entries in order."""

    version: int = 0
    run: str | None = None
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    # step file (relative path) -> its entry, for every step file not replaced by a compaction
    units: dict[str, UnitEntry] = dataclasses.field(default_factory=dict)
    # record table name -> [(relative path, size, crc32, rows, attempt, version)]
    records: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # files replaced or superseded and not yet retired: relative path -> version it left
    retiring: dict[str, int] = dataclasses.field(default_factory=dict)
    # the entries of replaced step files not yet retired (readers that planned before the
    # replacement still read them, from retired/)
    replaced: dict[str, UnitEntry] = dataclasses.field(default_factory=dict)
    # the same, as a checkpoint holds them, parsed when first asked for (a long run's
    # checkpoint holds a compaction's every input, which readers rarely ask for):
    # relative path -> (item JSON, attempt, version)
    replaced_raw: dict[str, tuple[str, str, int]] = dataclasses.field(default_factory=dict)
    # (step, rank, kind) -> the step files that hold a write of it (an index of `units`,
    # built when first asked for: a reader never asks, a writer once per process)
    indexed: dict[tuple[int, int, str], list[str]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )
    # (attempt, kind) -> its cutoff, until the next attempt begins (readers ask per unit)
    cutoffs: dict[tuple[str, str | None], int | None] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # version -> :meth:`effective` at it (a state at one version never changes)
    effective_at: dict[int, dict[str, UnitEntry]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # version -> what a noop entry stands for (``repair``'s mark of a lost version nothing
    # survived to rebuild: ``verify`` names each)
    notes: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def writes(self) -> dict[tuple[int, int, str], list[str]]:
        """(step, rank, kind) -> the step files that hold a write of it."""
        if self.indexed is None:
            self.indexed = {}
            for rel, entry in self.units.items():
                self._index(rel, entry)
        return self.indexed

    def _index(self, rel: str, entry: UnitEntry) -> None:
        assert self.indexed is not None
        rows = entry.record.get("rows", {})
        for key in zip(rows.get("step", ()), rows.get("rank", ()), rows.get("kind", ())):
            self.indexed.setdefault(key, []).append(rel)

    def effective_write(self, step: int, rank: int, kind: str) -> UnitEntry | None:
        """The committed write of one unit that is in the run's history (of its writes,
        several when attempts rewrote it, the one not superseded), or ``None``."""
        for rel in self.writes.get((step, rank, kind), ()):
            entry = self.units[rel]
            if self.is_effective(step, entry.attempt, kind):
                return entry
        return None

    def add_unit(self, rel: str, entry: UnitEntry) -> None:
        self.units[rel] = entry
        if self.indexed is not None:
            self._index(rel, entry)

    def drop_unit(self, rel: str) -> UnitEntry | None:
        entry = self.units.pop(rel, None)
        if entry is not None and self.indexed is not None:
            rows = entry.record.get("rows", {})
            for key in zip(rows.get("step", ()), rows.get("rank", ()), rows.get("kind", ())):
                held = self.indexed.get(key)
                if held and rel in held:
                    held.remove(rel)
        return entry

    @property
    def resumed(self) -> bool:
        """Whether any attempt after the first resumed (else nothing is superseded: every
        cutoff is ``None``, and no unit's rows need reading to know it is effective)."""
        return any(a.resume_from is not None for a in self.attempts[1:])

    def copy(self) -> LogState:
        """A copy that later entries do not change (a reader's pinned version)."""
        return LogState(
            version=self.version,
            run=self.run,
            attempts=list(self.attempts),
            units=dict(self.units),
            records={k: list(v) for k, v in self.records.items()},
            retiring=dict(self.retiring),
            replaced=dict(self.replaced),
            replaced_raw=dict(self.replaced_raw),
            indexed=None if self.indexed is None else {k: list(v) for k, v in self.indexed.items()},
            notes=dict(self.notes),
        )

    def leave(self, rels: Any, version: int) -> None:
        """Step files ``rels`` leave the units at ``version`` (replaced by a compaction,
        dropped): kept as replaced, with their group files retiring, until retired."""
        for rel in rels or ():
            gone = self.drop_unit(rel)
            if gone is not None:
                self.replaced[rel] = gone
                self.retiring[rel] = version
                self.retiring[f"{GROUPS}/{gone.record['group_file']}"] = version

    def retire(self, rels: Any) -> None:
        """Files ``rels`` are gone for good (past the grace period)."""
        for rel in rels or ():
            self.retiring.pop(rel, None)
            self.replaced.pop(rel, None)
            self.replaced_raw.pop(rel, None)

    def replaced_entry(self, rel: str) -> UnitEntry | None:
        """The entry of step file ``rel`` that a compaction (or a drop) replaced, until it is
        retired (``None``: not one)."""
        entry = self.replaced.get(rel)
        if entry is None and rel in self.replaced_raw:
            text, attempt, version = self.replaced_raw.pop(rel)
            entry = unit_from_item(json.loads(text), {"attempt": attempt, "version": version})
            self.replaced[rel] = entry
        return entry

    # ------------------------------------------------------------------ the history
    def attempt(self, attempt_id: str) -> Attempt | None:
        for a in self.attempts:
            if a.id == attempt_id:
                return a
        return None

    def cutoff(self, attempt_id: str, kind: str | None = None) -> int | None:
        """The first step of ``attempt_id``'s writes (of ``kind``) that later attempts
        supersede: the lowest resume point of a later attempt of its role (``None``: nothing
        superseded). A step is *effective* when it is below its attempt's cutoff."""
        key = (attempt_id, kind)
        if key in self.cutoffs:
            return self.cutoffs[key]
        if not self.resumed:
            return None
        mine = self.attempt(attempt_id)
        points = [
            point
            for a in self.attempts
            if mine is not None
            and a.version > mine.version
            and a.role == mine.role
            and (point := a.resumes_at(kind)) is not None
        ]
        self.cutoffs[key] = cut = min(points) if points else None
        return cut

    def is_effective(self, step: int, attempt_id: str, kind: str | None = None) -> bool:
        """Whether ``attempt_id``'s write of ``step`` (of ``kind``) is the run's history."""
        cut = self.cutoff(attempt_id, kind)
        return cut is None or step < cut

    def effective_units(self, e: UnitEntry) -> list[bool]:
        """For each unit of step file ``e`` (its step rows, in order): effective or not."""
        rows = e.record.get("rows", {})
        steps = rows.get("step") or []
        kinds = rows.get("kind") or [None] * len(steps)
        return [self.is_effective(s, e.attempt, k) for s, k in zip(steps, kinds)]

    def superseded_steps(self) -> list[int]:
        """The steps of which some committed write was superseded by a later attempt, in
        order. Only the step files that reach their attempt's cutoff have their step rows
        read (a file name says its kind and its last step): none in a run never resumed."""
        out: set[int] = set()
        if not self.resumed:
            return []
        for rel, e in self.units.items():
            parsed = parse_name(rel.rpartition("/")[2])
            cut = self.cutoff(e.attempt, parsed.kind if parsed is not None else unit_kind(e))
            if cut is None or (parsed is not None and parsed.last_step < cut):
                continue  # every unit of the file is below its cutoff: effective
            steps = e.record["rows"]["step"]
            out.update(s for s, kept in zip(steps, self.effective_units(e)) if not kept)
        return sorted(out)

    def effective(self) -> dict[str, UnitEntry]:
        """The committed step files with at least one effective unit (a compacted segment
        may be superseded in part: readers filter its rows by :meth:`cutoff`)."""
        hit = self.effective_at.get(self.version)
        if hit is None:
            if not self.resumed:
                hit = dict(self.units)  # nothing superseded
            else:
                hit = {rel: e for rel, e in self.units.items() if any(self.effective_units(e))}
            self.effective_at.clear()
            self.effective_at[self.version] = hit
        return hit

    # ------------------------------------------------------------------ checkpoints


def unit_kind(e: UnitEntry) -> str | None:
    """The kind of step file ``e``'s units (a file holds one kind)."""
    kinds = e.record.get("rows", {}).get("kind") or [None]
    return kinds[0]


def step_runs(steps: list[int]) -> list[list[int]]:
    """Sorted distinct ``steps`` as runs ``[first, stride, count]`` (arithmetic progressions:
    a segment of 100 train steps is one run, its eval steps every 10th another)."""
    runs: list[list[int]] = []
    for step in steps:
        if runs:
            first, stride, count = runs[-1]
            if count == 1:
                runs[-1] = [first, step - first, 2]
                continue
            if step == first + stride * count:
                runs[-1][2] = count + 1
                continue
        runs.append([step, 1, 1])
    return runs


def count_runs(runs: list[list[int]]) -> int:
    """The number of distinct steps in ``runs`` (:func:`step_runs`' runs, of any number of
    files, overlapping or not): merged as intervals where they share a stride and an offset
    (files of one kind do), else counted as a set."""
    classes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for first, stride, count in {(r[0], r[1] if r[2] > 1 else 1, r[2]) for r in runs}:
        classes.setdefault((stride, first % stride), []).append((first, first + stride * count))
    if len(classes) > 1:
        seen: set[int] = set()
        for (stride, _), spans in classes.items():
            for lo, hi in spans:
                seen.update(range(lo, hi, stride))
        return len(seen)
    total = 0
    for (stride, _), spans in classes.items():
        end = None
        for lo, hi in sorted(spans):
            if end is not None and lo < end:
                lo = end
            if hi > lo:
                total += (hi - lo) // stride
                end = hi
    return total


def unit_summary(
    record: Mapping[str, Any], keep: Callable[[int, str | None], bool] | None = None
) -> dict[str, Any]:
    """What a description of the run (``maxent-arrow inspect``) needs of one step file, from
    its commit record, so that it is read without the file's step rows: per kind of its
    step rows (those ``keep(step, kind)`` keeps; default every one) the steps
    (:func:`step_runs`), the rows, the sums of ``num_groups`` and ``num_samples`` (``None``
    where every value is null, as SQL sums), the ranks, and each distinct ``config`` with
    its last step; and the file's reward names, schema version and group file size."""
    rows = record.get("rows") or {}
    size = len(rows.get("step") or ())

    def column(name: str) -> list[Any]:
        values = rows.get(name)
        return list(values) if values is not None else [None] * size

    per: dict[str | None, dict[str, Any]] = {}
    for step, rank, kind, groups, samples, config in zip(*map(column, R.UNIT_COUNTS)):
        if keep is not None and not keep(step, kind):
            continue
        k = per.get(kind)
        if k is None:
            k = per[kind] = {
                "steps": set(), "rows": 0, "groups": None, "samples": None, "ranks": set(),
                "configs": {},
            }  # fmt: skip
        k["steps"].add(step)
        k["rows"] += 1
        if groups is not None:
            k["groups"] = (k["groups"] or 0) + groups
        if samples is not None:
            k["samples"] = (k["samples"] or 0) + samples
        if rank is not None:
            k["ranks"].add(rank)
        if config is not None:
            k["configs"][config] = max(step, k["configs"].get(config, step))
    return {
        "kinds": [
            {
                "kind": kind,
                "steps": step_runs(sorted(k["steps"])),
                "rows": k["rows"],
                "groups": k["groups"],
                "samples": k["samples"],
                "ranks": sorted(k["ranks"]),
                "configs": [[config, last] for config, last in k["configs"].items()],
            }
            for kind, k in per.items()
        ],
        "reward_names": list(record.get("reward_names") or []),
        "schema_version": record.get("schema_version"),
        "group_size": record.get("group_size"),
    }


def entry_summaries(entries: list[UnitEntry]) -> list[dict[str, Any]]:
    """:func:`unit_summary` of each step file of ``entries``: the one the log keeps (parsed
    in one pass for all), else computed from its record (a checkpoint written before
    summaries)."""
    texts = [e.summary() if callable(e.summary) else e.summary for e in entries]
    parsed = iter(json.loads("[" + ",".join(t for t in texts if t is not None) + "]"))
    return [unit_summary(e.record) if t is None else next(parsed) for e, t in zip(entries, texts)]


def summary_text(e: UnitEntry) -> str:
    text = e.summary() if callable(e.summary) else e.summary
    return json.dumps(unit_summary(e.record)) if text is None else text


def unit_item(e: UnitEntry) -> dict[str, Any]:
    """A unit entry as a checkpoint's ``item`` JSON (its attempt and version are columns)."""
    return {
        "step_file": e.step_file,
        "record": e.record,
        "step_size": e.step_size,
        "step_crc32": e.step_crc32,
        "unit_version": e.version,
    }


def unit_from_item(item: Mapping[str, Any], row: Mapping[str, Any]) -> UnitEntry:
    """A unit entry from a checkpoint's ``item`` JSON and its row (attempt, version)."""
    return UnitEntry(
        item["step_file"],
        item["record"],
        row["attempt"],
        int(item.get("unit_version", row["version"])),
        item.get("step_size"),
        item.get("step_crc32"),
    )
