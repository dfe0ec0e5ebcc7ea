"""The catalog of a store written before the commit log (store format 1.x and 2.x): its
history derived from a listing of its step files, read-only.

In those stores the appearance of a step file was the commit. The catalog lists ``steps/``,
reads each step file once per process (cached by size and mtime), checks it against the
CRC-32 sealed in it and against its own name and run, upgrades its schema-1.x rows, hides
what a committed compacted segment replaced, and answers every reader from the state that
listing gives (:class:`~maxent_arrow.store.history.state.LogState`, version 0): one history,
no attempts, no record tables, nothing superseded. Every write is refused with
:class:`~maxent_arrow.errors.ReadOnlyFormatError`, which names ``maxent-arrow upgrade``: the
upgrade writes a commit log of exactly this state over the same files.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.upgrade import needs_upgrade, upgrade_steps
from maxent_arrow.errors import ReadOnlyFormatError, StoreError
from maxent_arrow.store.history.catalog import (
    Audit,
    Catalog,
    History,
    StepFile,
    is_missing,
    locate,
    step_rows_json,
    unit_sort_key,
)
from maxent_arrow.store.history.log import CommitLog
from maxent_arrow.store.history.operations import (
    AppendUnit,
    BeginAttempt,
    CompactUnits,
    Operation,
)
from maxent_arrow.store.history.state import Attempt, LogState, UnitEntry
from maxent_arrow.store.storage.backend import (
    Backend,
    FileInfo,
    is_temp_name,
    missing_error,
    temp_final,
)
from maxent_arrow.store.storage.checksums import check_seal
from maxent_arrow.store.storage.names import (
    CACHE,
    GROUPS,
    STEPS,
    STORE_META_KEY,
    UNIT_META_KEY,
    UnitName,
    parse_name,
)
from maxent_arrow.store.storage.parquet import footer_value

__all__ = ["ListingCatalog", "read_only_error", "read_step_file"]


def read_only_error(backend: Backend, what: str, version: str) -> ReadOnlyFormatError:
    """The one error of a write to a store without a commit log."""
    return ReadOnlyFormatError(
        f"{backend.uri}: {what} refused: this store was written before the commit log "
        f"(store format {version}), which every reader still reads and no writer writes; "
        f"run `maxent-arrow upgrade {backend.uri}` to give it a log (its files are kept as "
        "they are), then write to it"
    )


class ListingCatalog(Catalog):
    """The commit record of a store without a commit log: its step files, listed.

    ``manifest``: the store's (its ``schema_version`` is the format, which the refusal of a
    write names; its creation time and config go into :meth:`log_plan`'s attempt)."""

    def __init__(
        self, backend: Backend, run_id: str | None, manifest: Mapping[str, Any],
        history: History = "effective",
    ):  # fmt: skip
        super().__init__(backend, run_id, history)
        self.manifest = manifest
        self.format_version = str(manifest.get("schema_version") or "0")
        self.created_at = str(manifest.get("created_at") or "")
        self.config: Mapping[str, Any] = manifest.get("config") or {}
        # step file name -> ((size, mtime_ns), the StepFile, its size, its CRC-32)
        self._steps: dict[str, tuple[tuple[int, int], StepFile, int, int]] = {}
        # (the listing it was derived from, the state, the damaged step files)
        self._derived: tuple[tuple, LogState, dict[str, StoreError]] | None = None

    # ------------------------------------------------------------------ the state
    def newest(self) -> LogState:
        return self._derive()[0]

    def pinned(self) -> LogState:
        return self._derive()[0]  # (a derived state never changes: a new listing, a new one)

    @property
    def version(self) -> int | None:
        return None

    def with_history(self, history: History) -> ListingCatalog:
        other = ListingCatalog(self.backend, self.run_id, self.manifest, history)
        other._steps = self._steps
        self.share_pin(other)
        return other

    def account(self) -> dict[str, Any] | None:
        return None

    def writable(self, what: str) -> CommitLog:
        raise read_only_error(self.backend, what, self.format_version)

    def require_history(self, what: str) -> None:
        raise self._no_history(what)

    def log_plan(self) -> list[Operation] | None:
        """One attempt (the run as it was written: ``upgraded-from-<format>``, begun when the
        store was created, with its config), then one entry per committed step file in step
        order: an ``append`` per one-step file, a ``compact`` per segment, each with the step
        file's record (its store metadata, its step rows, its schema version), size and
        CRC-32: the state every reader read."""
        state = self.state()
        attempt = Attempt(
            id=f"upgraded-from-{self.format_version}",
            started_at=self.created_at,
            mode="new",
            config=dict(self.config),
        )
        out: list[Operation] = [BeginAttempt(attempt)]
        for name in self.step_names():
            entry = state.units[f"{STEPS}/{name}"]
            parsed = cast(UnitName, parse_name(name))
            kind = CompactUnits if parsed.compacted else AppendUnit
            out.append(kind(entry.step_file, entry.record, entry.step_size, entry.step_crc32))
        return out

    def tail_log(self) -> CommitLog:
        raise self._no_history("tail")

    def _no_history(self, what: str) -> StoreError:
        return StoreError(
            f"{self.backend.uri}: a store without a commit log (store format "
            f"{self.format_version}) has no {what}; `maxent-arrow upgrade` gives it one"
        )

    def admit_step_file(self, name: str, admit: Any) -> bool:
        return True  # its step files are read and checked here (their seal) before any use

    def _derive(self) -> tuple[LogState, dict[str, StoreError]]:
        """The state the listing of ``steps/`` gives (built again when the listing changes):
        every step file a committed compacted segment does not replace is a unit; those it
        replaces are retiring; a damaged step file is no unit (its error is kept)."""
        listing = self.listing(STEPS)
        key = tuple(sorted((n, i.size, i.mtime_ns) for n, i in listing.items()))
        if self._derived is not None and self._derived[0] == key:
            return self._derived[1], self._derived[2]
        named = sorted(
            ((n, p) for n in listing if (p := parse_name(n)) is not None),
            key=lambda x: unit_sort_key(*x),
        )
        read: dict[str, tuple[StepFile, int, int]] = {}
        damaged: dict[str, StoreError] = {}
        for name, _ in named:
            try:
                read[name] = self._step(name)
            except StoreError as exc:
                damaged[name] = exc
        replaced: set[str] = set()
        for name, parsed in named:
            if parsed.compacted and name in read:
                replaced.update(read[name][0].replaces)
        state = LogState(version=0, run=self.run_id)
        for name, _ in named:
            if name in replaced:
                state.retiring[f"{STEPS}/{name}"] = 0
                state.retiring[f"{GROUPS}/{name}"] = 0
            elif name in read:
                step, size, crc = read[name]
                rows = step_rows_json(step.table)
                record = {**step.meta, "rows": rows, "schema_version": step.version}
                if "reward_names" not in record:
                    record["reward_names"] = self._reward_names_of(step)
                rel = f"{STEPS}/{name}"
                state.add_unit(rel, UnitEntry(rel, record, "", 0, size, crc))
        damaged = {n: e for n, e in damaged.items() if n not in replaced}
        self._derived = (key, state, damaged)
        return state, damaged

    def _reward_names_of(self, step: StepFile) -> list[str]:
        """The reward functions of a schema-1.x unit (whose step file does not record them):
        the fields of its group file's ``rewards`` struct, from the footer (``[]``: no such
        column, or a file that cannot be read, which ``verify`` reports)."""
        try:
            with self.backend.open(f"{GROUPS}/{step.group_file}") as source:
                schema = pq.read_schema(source)
        except (StoreError, pa.ArrowException, OSError, ValueError):
            return []
        index = schema.get_field_index("rewards")
        kind = schema.field(index).type if index >= 0 else None
        if kind is None or not pa.types.is_struct(kind):
            return []
        return [kind.field(i).name for i in range(kind.num_fields)]

    def losses(self) -> list[StoreError]:
        return list(self._derive()[1].values())  # each damaged step file

    # ------------------------------------------------------------------ step files
    def step_file(self, name: str) -> StepFile:
        """The step file ``name``, read from the file, checked (seal, readability, version,
        name and run) and cached."""
        return self._step(name)[0]

    def _step(self, name: str) -> tuple[StepFile, int, int]:
        rel = f"{STEPS}/{name}"
        info: FileInfo | None = self.listing(STEPS, fresh=False).get(name)
        found = (rel, info) if info is not None else locate(self.backend, rel)
        if found is None:
            raise missing_error(f"{self.backend.path(rel)}: step file missing")
        where, info = found
        key = (info.size, info.mtime_ns)
        hit = self._steps.get(name)
        if hit is not None and hit[0][0] == key[0] and (hit[0] == key or where != rel):
            return hit[1], hit[2], hit[3]  # (a retired file: the same bytes, retouched)
        try:
            step, size, crc = self._read_step_file(where, name)
        except StoreError as exc:
            # Moved to retired/ by a compaction between the listing and the read.
            moved = locate(self.backend, rel) if is_missing(exc) else None
            if moved is None or moved[0] == where:
                raise
            step, size, crc = self._read_step_file(moved[0], name)
        self._steps[name] = (key, step, size, crc)
        return step, size, crc

    def _read_step_file(self, rel: str, name: str) -> tuple[StepFile, int, int]:
        return read_step_file(self.backend, rel, name, self.run_id)

    # ------------------------------------------------------------------ checking
    def audit(self, live: set[str]) -> Audit:
        """Damaged step files (problems); group files no step file commits, judged by what
        evidence is left (:meth:`_judge`: an append that did not finish, a foreign or
        unreadable file are notes; a suspected lost commit a problem); files a compaction
        replaced and temp files (notes)."""
        problems: list[tuple[str, str]] = []
        notes: list[tuple[str, str]] = []
        state, damaged = self._derive()
        for name, exc in sorted(damaged.items()):
            rel = f"{STEPS}/{name}"
            problems.append((rel, str(exc).removeprefix(f"{self.backend.path(rel)}: ")))
        orphans = set()
        for directory in (GROUPS, STEPS, CACHE):
            for name in self.backend.list(directory):
                rel = f"{directory}/{name}"
                if is_temp_name(name):
                    notes.append((rel, "temp file of an unfinished write"))
                elif rel in state.retiring:
                    notes.append((rel, "replaced by a compaction (invisible to readers)"))
                elif directory == GROUPS and parse_name(name) is not None and rel not in live:
                    orphans.add(name)
        for name, (kind, why) in self._judge(orphans).items():
            (problems if kind == "lost" else notes).append((f"{GROUPS}/{name}", why))
        return Audit(problems, notes)

    def _judge(self, names: set[str]) -> dict[str, tuple[str, str]]:
        """What each group file in ``names`` (listed in ``groups/``, a store file name,
        neither committed nor replaced) is: ``(kind, why)`` with ``kind`` one of

        - ``"unfinished"``: an append or compaction that did not finish: the temp file of its
          step file is still in ``steps/`` (the commit writes it before the group file's
          rename, and only the commit's last step removes it), or the store is on object
          storage, which keeps no such evidence;
        - ``"foreign"``: its footer records another unit or another run;
        - ``"incomplete"``: not a readable Parquet file whose page checksums all match;
        - ``"lost"``: a complete, checksummed group file of this unit and run with no step
          file and no sign of an unfinished write: a *suspected lost commit*.
        """
        backend = self.backend
        pending = {temp_final(n) for n in backend.list(STEPS) if is_temp_name(n)}
        out: dict[str, tuple[str, str]] = {}
        for name in sorted(names):
            if name in pending:
                out[name] = ("unfinished", "uncommitted: an append that did not finish")
            elif not backend.can_lock:
                out[name] = (
                    "unfinished",
                    "uncommitted: an append that did not finish (or a lost commit: object "
                    "storage keeps no evidence to tell them apart)",
                )
            else:
                out[name] = self._examine(name)
        return out

    def _examine(self, name: str) -> tuple[str, str]:
        """A group file without step file and without an unfinished write: lost, or not ours."""
        rel = f"{GROUPS}/{name}"
        try:
            with self.backend.open(rel) as source:
                reader = pq.ParquetFile(source, page_checksum_verification=True)
                raw = (reader.schema_arrow.metadata or {}).get(UNIT_META_KEY)
                identity = json.loads(raw) if raw else {}
                for i in range(reader.num_row_groups):
                    reader.read_row_group(i)
        except (pa.ArrowException, OSError, ValueError) as exc:
            return "incomplete", f"uncommitted and unreadable ({exc})"
        unit, run = identity.get("unit", name), identity.get("run")
        if unit != name or (run is not None and run != self.run_id):
            return "foreign", f"uncommitted: records unit {unit} of run {run}, not this store's"
        return (
            "lost",
            "suspected lost commit: a complete group file (its page checksums match) without "
            "its step file, and no unfinished write left a trace",
        )


def _fast_step_file(data: bytes, name: str, where: str) -> StepFile | None:
    """A sealed step file of the current layout read from the JSON in its footer (the bytes
    are the writer's: the seal is checked), or ``None`` to decode it instead."""
    raw_version = footer_value(data, S.METADATA_KEY)
    raw_meta = footer_value(data, STORE_META_KEY)
    if raw_version is None or raw_meta is None:
        return None
    version = S.check_version(raw_version, where=where)
    if needs_upgrade(version):
        return None
    try:
        meta = json.loads(raw_meta)
    except ValueError:
        return None
    rows = meta.get("rows")
    layout = S.step_schema()
    if (
        "group_file" not in meta
        or not isinstance(rows, dict)
        or not set(S.STEP_REQUIRED) <= set(rows)
        or not set(rows) <= set(layout.names)
    ):
        return None
    return StepFile(name, meta, version)


def read_step_file(
    backend: Backend, rel: str, name: str, run_id: str | None
) -> tuple[StepFile, int, int]:
    """The step file at ``rel`` (whose name is ``name``), read and checked: its seal, its
    readability and version, and that it is this store's commit of its own name (of run
    ``run_id``); with its size and CRC-32. Also what ``repair`` rebuilds a lost log entry
    from."""
    path = backend.path(rel)
    data = backend.read(rel).to_pybytes()
    seal = (len(data), zlib.crc32(data) & 0xFFFFFFFF)
    sealed = check_seal(data)
    if sealed is False:
        raise StoreError(f"{path}: CRC-32 differs from the one sealed in the file (corrupt)")
    step = _fast_step_file(data, name, str(path)) if sealed else None
    if step is None:
        step = _decoded_step_file(data, name, str(path))
    _check_identity(step, backend.path(f"{STEPS}/{name}"), run_id)
    return (step, *seal)


def _decoded_step_file(data: bytes, name: str, path: str) -> StepFile:
    try:
        table = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read()
    except (pa.ArrowException, OSError, ValueError) as exc:  # damaged bytes
        raise StoreError(f"{path}: unreadable step file ({exc})") from None
    raw = (table.schema.metadata or {}).get(S.METADATA_KEY)
    version = S.check_version(raw, where=path)
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
    meta.pop("rows", None)  # the decoded table is the one used
    return StepFile(name, meta, version, table)


def _check_identity(step: StepFile, path: Any, run_id: str | None) -> None:
    """Refuse a step file that is not this store's commit of its own name."""
    recorded = step.meta.get("unit", step.group_file)
    if step.group_file != step.name or recorded != step.name:
        raise StoreError(
            f"{path}: the commit record inside is of {recorded}, not of this file's name "
            "(a copied or renamed step file); not read"
        )
    run = step.meta.get("run")
    if run is not None and run != run_id:
        ours = f"run {run_id}" if run_id else "a store without a run id"
        raise StoreError(
            f"{path}: a step file of another run ({run}; this store is {ours}), copied "
            "or synced in by mistake; not read"
        )
