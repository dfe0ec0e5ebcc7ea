"""The commit record of a store: its step files, read, checked and cached; which units are
committed; and the policy for damaged files.

Every reader of the store (``read``, ``replay``, SQL, ``verify``, the Ray reader) asks the
catalog which group files are committed, so the commit rule of :mod:`.layout` is applied in
one place. Step files are small; each is read once per process (cached by size and mtime),
checked against the CRC-32 sealed in it, and its schema-1.x rows are upgraded.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_steps
from maxent_arrow.errors import StoreError
from maxent_arrow.store.backend import Backend, FileInfo
from maxent_arrow.store.checksums import check_seal
from maxent_arrow.store.layout import GROUPS, STEPS, STORE_META_KEY, UnitName, parse_name

__all__ = ["Catalog", "OnError", "StepFile", "Unit", "check_on_error", "fail"]

OnError = Literal["raise", "skip"]


def check_on_error(value: str) -> OnError:
    if value not in ("raise", "skip"):
        raise StoreError(f"on_error must be 'raise' or 'skip', got {value!r}")
    return value  # type: ignore[return-value]


def fail(on_error: OnError, exc: StoreError) -> None:
    """Raise ``exc`` (``"raise"``) or warn that the damaged file it names is skipped."""
    if on_error == "raise":
        raise exc
    warnings.warn(f"skipping damaged file: {exc}", stacklevel=3)


@dataclass(frozen=True)
class StepFile:
    """A committed step file: its step rows (current layout) and its store metadata."""

    name: str
    table: pa.Table
    meta: dict[str, Any]
    version: str

    @property
    def group_file(self) -> str:
        return self.meta["group_file"]

    @property
    def starts(self) -> list[int]:
        """The first group row of each step row (one per unit) in the group file."""
        return list(self.meta.get("group_rows") or [0])

    @property
    def replaces(self) -> list[str]:
        return list(self.meta.get("replaces") or [])


@dataclass(frozen=True)
class Unit:
    """One committed (step, rank, kind): where its step row and its group rows are."""

    step: int
    rank: int
    kind: str
    step_file: str
    group_file: str
    row: int  # its row in the step file
    start: int  # its first row in the group file
    num_groups: int

    @property
    def name(self) -> str:
        """The unit's own file name (also for a unit inside a compacted segment)."""
        return f"step-{self.step:010d}.rank-{self.rank:05d}.{self.kind}.parquet"


def _sort_key(name: str, parsed: UnitName) -> tuple:
    return (parsed.first_step, parsed.kind, parsed.first_rank, not parsed.compacted, name)


class Catalog:
    """The step files of one store and what they commit."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._steps: dict[str, tuple[tuple[int, int], StepFile]] = {}
        self._listing: dict[str, dict[str, FileInfo]] = {}

    # ------------------------------------------------------------------ listing
    def listing(self, directory: str, *, fresh: bool = True) -> dict[str, FileInfo]:
        """The files of ``groups/`` or ``steps/`` (one LIST on object stores)."""
        if fresh or directory not in self._listing:
            self._listing[directory] = self.backend.list(directory)
        return self._listing[directory]

    def step_names(self) -> list[str]:
        """Names in ``steps/`` that are store file names, in (step, kind, rank) order."""
        named = [(n, parse_name(n)) for n in self.listing(STEPS)]
        return [n for n, p in sorted((x for x in named if x[1]), key=lambda x: _sort_key(*x))]

    # ------------------------------------------------------------------ step files
    def step_file(self, name: str) -> StepFile:
        """The step file ``name``, checked (seal, readability, version) and cached."""
        rel = f"{STEPS}/{name}"
        info = self.listing(STEPS, fresh=False).get(name) or self.backend.stat(rel)
        if info is None:
            raise StoreError(f"{self.backend.path(rel)}: step file missing")
        key = (info.size, info.mtime_ns)
        hit = self._steps.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        step = self._read_step_file(rel, name)
        self._steps[name] = (key, step)
        return step

    def _read_step_file(self, rel: str, name: str) -> StepFile:
        path = self.backend.path(rel)
        data = self.backend.read(rel).to_pybytes()
        if check_seal(data) is False:
            raise StoreError(f"{path}: CRC-32 differs from the one sealed in the file (corrupt)")
        try:
            table = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read()
        except (pa.ArrowException, OSError) as exc:
            raise StoreError(f"{path}: unreadable step file ({exc})") from None
        raw = (table.schema.metadata or {}).get(S.METADATA_KEY)
        version = S.check_version(raw, where=str(path))
        meta_text = (table.schema.metadata or {}).get(STORE_META_KEY)
        try:
            meta = json.loads(meta_text) if meta_text else {}
        except ValueError:
            meta = {}
        if "group_file" not in meta:
            raise StoreError(f"{path}: step file without store metadata (not written by append?)")
        for column in S.STEP_REQUIRED:
            if column not in table.column_names:
                raise StoreError(f"{path}: step file without the {column!r} column")
        if needs_upgrade(version):
            table = upgrade_steps(table)
        return StepFile(name, table, meta, version)

    # ------------------------------------------------------------------ the commit rule
    def hidden(self, names: Iterable[str], on_error: OnError) -> set[str]:
        """Step/group file names a committed compacted segment replaces (transitively: a
        segment lists everything its inputs replaced)."""
        out: set[str] = set()
        for name in names:
            parsed = parse_name(name)
            if parsed is not None and parsed.compacted:
                try:
                    out.update(self.step_file(name).replaces)
                except StoreError as exc:
                    # A damaged segment: its inputs, if still there, stay visible in its place.
                    fail(on_error, exc)
        return out

    def committed(self, on_error: OnError = "raise") -> list[str]:
        """Names of the committed step files (each commits the group file of its name)."""
        names = self.step_names()
        replaced = self.hidden(names, on_error)
        return [n for n in names if n not in replaced]

    def committed_steps(self, on_error: OnError = "raise") -> Iterator[StepFile]:
        """The committed step files, read and checked; a damaged one is raised or skipped."""
        for name in self.committed(on_error):
            try:
                yield self.step_file(name)
            except StoreError as exc:
                fail(on_error, exc)

    def units(
        self,
        *,
        kind: str | None = None,
        steps: Iterable[int] | int | None = None,
        ranks: Iterable[int] | None = None,
        on_error: OnError = "raise",
    ) -> list[Unit]:
        """The committed units, in (step, kind, rank) order, planned from step files alone."""
        wanted = None if steps is None else step_set(steps)
        wanted_ranks = None if ranks is None else {int(r) for r in ranks}
        units = []
        for name in self.committed(on_error):
            parsed = parse_name(name)
            if kind is not None and parsed.kind != kind:
                continue
            if wanted is not None and not any(
                parsed.first_step <= s <= parsed.last_step for s in wanted
            ):
                continue
            try:
                step_file = self.step_file(name)
            except StoreError as exc:
                fail(on_error, exc)
                continue
            rows = step_file.table.select(["step", "rank", "kind", "num_groups"]).to_pydict()
            starts = step_file.starts
            for i, (step, rank, knd, count) in enumerate(
                zip(rows["step"], rows["rank"], rows["kind"], rows["num_groups"])
            ):
                if wanted is not None and step not in wanted:
                    continue
                if wanted_ranks is not None and rank not in wanted_ranks:
                    continue
                units.append(Unit(step, rank, knd, name, step_file.group_file, i, starts[i], count))
        return sorted(units, key=lambda u: (u.step, u.kind, u.rank))

    def committed_files(self, table: str, on_error: OnError = "raise") -> list[str]:
        """Relative paths of the committed files of ``table`` (``"groups"``/``"steps"``)."""
        if table not in (GROUPS, STEPS):
            raise StoreError(f"committed_files: table must be 'groups' or 'steps', got {table!r}")
        names = self.committed(on_error)
        if table == STEPS:
            return [f"{STEPS}/{n}" for n in names]
        present = self.listing(GROUPS)
        out = []
        for name in names:
            if name in present:
                out.append(f"{GROUPS}/{name}")
            else:
                path = self.backend.path(f"{GROUPS}/{name}")
                fail(
                    on_error, StoreError(f"{path}: group file missing (its step file is committed)")
                )
        return out


def step_set(steps: Iterable[int] | int) -> set[int]:
    if isinstance(steps, int):
        return {steps}
    return {int(s) for s in steps}
