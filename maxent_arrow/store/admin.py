"""Maintenance of a rollout store: ``verify`` (find damaged files) and ``compact`` (merge the
per-append files atomically)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import StoreError
from maxent_arrow.store.files import (
    COMPACT_RE,
    TEMP_PREFIX,
    UNIT_RE,
    compact_name,
    crc32_of,
    fsync_dir,
    store_lock,
    write_atomic,
)

if TYPE_CHECKING:
    from maxent_arrow.store.store import RolloutStore

__all__ = ["verify", "compact", "remove_replaced", "StoreProblem", "VerifyReport"]


@dataclass(frozen=True)
class StoreProblem:
    path: Path
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass
class VerifyReport:
    """What :meth:`RolloutStore.verify` found: ``problems`` (damage) and ``notes`` (harmless
    leftovers such as uncommitted group files of a crashed append)."""

    checked: int = 0
    problems: list[StoreProblem] = field(default_factory=list)
    notes: list[StoreProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        lines = [f"{self.checked} files checked, {len(self.problems)} problems"]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        lines += [f"  note {p}" for p in self.notes]
        return "\n".join(lines)


def verify(store: RolloutStore) -> VerifyReport:
    report = VerifyReport()

    def problem(path: Path, text: str) -> None:
        report.problems.append(StoreProblem(path, text))

    manifest = store.root / "manifest.json"
    try:
        data = json.loads(manifest.read_text())
        S.check_version(data.get("schema_version"), where=str(manifest))
    except (OSError, ValueError, StoreError) as exc:
        problem(manifest, f"unreadable manifest ({exc})")
    step_names = [
        n for n in store._names(store._steps_dir) if UNIT_RE.match(n) or COMPACT_RE.match(n)
    ]
    replaced = store._replaced(step_names)
    committed: set[str] = set()
    for name in step_names:
        if name in replaced:
            report.notes.append(
                StoreProblem(store._steps_dir / name, "replaced by compact; to delete")
            )
            continue
        path = store._steps_dir / name
        report.checked += 1
        try:
            table, meta = store._step_table(name)
        except StoreError as exc:
            problem(path, str(exc).removeprefix(f"{path}: "))
            continue
        committed.add(meta["group_file"])
        match = UNIT_RE.match(name)
        rows = table.select(["step", "rank", "kind", "num_groups"]).to_pydict()
        if match and (
            table.num_rows != 1
            or rows["step"][0] != int(match.group(1))
            or rows["rank"][0] != int(match.group(2))
            or rows["kind"][0] != match.group(3)
        ):
            problem(path, f"step row {rows} does not match the file name")
        group_path = store._groups_dir / meta["group_file"]
        report.checked += 1
        try:
            groups = _read_all(group_path, meta)
        except StoreError as exc:
            problem(group_path, str(exc).removeprefix(f"{group_path}: "))
            continue
        if groups.num_rows != sum(rows["num_groups"]):
            problem(
                group_path,
                f"{groups.num_rows} group rows, the step rows say {sum(rows['num_groups'])}",
            )
        if match and groups.num_rows:
            steps = set(groups.column("step").unique().to_pylist())
            if steps != {int(match.group(1))}:
                problem(group_path, f"holds steps {sorted(steps)}, expected {int(match.group(1))}")
        cache = store._cache_dir / (name.removesuffix(".parquet") + ".arrow")
        if match and cache.exists():
            report.checked += 1
            try:
                cached = ipc.open_file(pa.memory_map(str(cache), "r")).read_all()
                if not cached.equals(groups):
                    problem(cache, "IPC cache differs from the Parquet archive")
            except (pa.ArrowException, OSError) as exc:
                problem(cache, f"unreadable IPC cache file ({exc})")
    for name in store._names(store._groups_dir):
        if (
            (UNIT_RE.match(name) or COMPACT_RE.match(name))
            and name not in committed
            and name not in replaced
        ):
            report.notes.append(
                StoreProblem(
                    store._groups_dir / name, "uncommitted (an append that did not finish)"
                )
            )
    for directory in (store._groups_dir, store._steps_dir, store._cache_dir):
        with contextlib.suppress(OSError):
            for path in directory.iterdir():
                if path.name.startswith(TEMP_PREFIX):
                    report.notes.append(StoreProblem(path, "temp file of an unfinished write"))
    return report


def _read_all(path: Path, meta: dict) -> pa.Table:
    from maxent_arrow.store.read import read_checked

    return read_checked(path, meta, None, crc=True)


def compact(store: RolloutStore, *, kind: str | None, steps, max_steps: int | None) -> list[Path]:
    from maxent_arrow.store.files import parquet_bytes
    from maxent_arrow.store.read import conform
    from maxent_arrow.store.store import STORE_META_KEY

    if max_steps is not None and max_steps < 1:
        raise StoreError(f"compact: max_steps must be >= 1, got {max_steps}")
    made: list[Path] = []
    plain = [u for u in store._units(kind=kind, steps=steps) if UNIT_RE.match(u.step_file)]
    by_kind: dict[str, list] = {}
    for unit in plain:
        by_kind.setdefault(unit.kind, []).append(unit)
    for knd, units in sorted(by_kind.items()):
        distinct = sorted({u.step for u in units})
        size = max_steps or len(distinct)
        for at in range(0, len(distinct), size):
            chosen = set(distinct[at : at + size])
            chunk = [u for u in units if u.step in chosen]
            if len(chunk) < 2:
                continue  # one file is already as compact as it gets
            made.append(_compact_chunk(store, knd, chunk, STORE_META_KEY, parquet_bytes, conform))
    return made


def _compact_chunk(store, kind, units, store_meta_key, parquet_bytes, conform) -> Path:
    group_schema = store.schema("groups")
    step_schema = store.schema("steps")
    groups, steps, starts, at = [], [], [], 0
    for unit in units:
        batch = store._load_unit(unit)
        groups.append(conform(pa.Table.from_batches([batch.groups]), group_schema))
        steps.append(conform(pa.Table.from_batches([batch.step_row]), step_schema))
        starts.append(at)
        at += unit.num_groups
    name = compact_name(units[0].step, units[-1].step, kind)
    group_table = pa.concat_tables(groups)
    group_bytes = parquet_bytes(
        group_table,
        {S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
        statistics=["step", "rank", "group_index"],
        dictionary=["prompt", "answer"],
    )
    meta = {
        "group_file": name,
        "group_size": group_bytes.size,
        "group_crc32": crc32_of(group_bytes),
        "group_rows": starts,
        "replaces": [u.step_file for u in units],
    }
    step_table = pa.concat_tables(steps)
    step_bytes = parquet_bytes(
        step_table,
        {store_meta_key: json.dumps(meta).encode(), S.METADATA_KEY: S.SCHEMA_VERSION.encode()},
        statistics=["step", "rank"],
        sealed=True,
    )
    step_path = store._path(store._steps_dir, name)
    with store_lock(store.root):
        write_atomic(store._path(store._groups_dir, name), group_bytes, overwrite=True)
        write_atomic(step_path, step_bytes, overwrite=False)
    # Committed: the originals are now hidden by `replaces`; deleting them is only cleanup.
    for unit in units:
        for directory in (store._steps_dir, store._groups_dir):
            with contextlib.suppress(OSError):
                (directory / unit.step_file).unlink()
    with contextlib.suppress(OSError):
        fsync_dir(store._steps_dir)
        fsync_dir(store._groups_dir)
    return step_path


_ = pq


# A group file is renamed into place just before its step file, both under the store lock; one
# without its step file is a commit that died in between. Writers that take no lock (an
# ObjectStore pointed at a local file system) finish their two writes within milliseconds, so
# only leftovers older than this are removed.
ORPHAN_AGE_SECONDS = 60.0


def remove_orphans(store: RolloutStore) -> list[Path]:
    """Delete group files whose step file (the commit marker) does not exist: leftovers of a
    crash between the two renames of a commit. This library never reads them, but plain-file
    readers (DuckDB, Polars, HF ``datasets`` over ``groups/*.parquet``) would."""
    removed: list[Path] = []
    now = time.time()
    with store_lock(store.root):
        committed = set(store._names(store._steps_dir))
        for name in store._names(store._groups_dir):
            if not name.endswith(".parquet") or name in committed:
                continue
            path = store._groups_dir / name
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > ORPHAN_AGE_SECONDS:
                    path.unlink()
                    removed.append(path)
    if removed:
        with contextlib.suppress(OSError):
            fsync_dir(store._groups_dir)
    return removed


def remove_replaced(store: RolloutStore) -> None:
    """Delete per-append files that a committed compacted pair replaces (cleanup after a
    compaction that stopped before deleting them; readers already ignore them)."""
    names = store._names(store._steps_dir)
    replaced = store._replaced(names)
    for name in sorted(replaced):
        for directory in (store._steps_dir, store._groups_dir):
            with contextlib.suppress(OSError):
                (directory / name).unlink()
    if replaced:
        with contextlib.suppress(OSError):
            fsync_dir(store._steps_dir)
            fsync_dir(store._groups_dir)
