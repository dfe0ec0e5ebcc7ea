"""Export a saved run to other formats: Arrow IPC files, or a Hugging Face ``datasets``
dataset.

Both read the committed group files one at a time (memory stays about one file), each checked
against its commit record (size and CRC-32), conform each to the run's unified schema (columns
an older file lacks become nulls), and write:

``ipc``
    ``DIR/groups.{kind}.arrow`` (one per kind: ``train``, ``eval``) and ``DIR/steps.arrow``,
    Arrow IPC *file* format, memory-mappable (``pa.memory_map`` + ``pa.ipc.open_file``).
``hf``
    ``DIR/groups`` (a ``DatasetDict``, one split per kind) and ``DIR/steps`` (a ``Dataset``),
    loadable with ``datasets.load_from_disk`` (the layout has no map columns, which
    ``datasets`` cannot hold).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import MissingExtraError, StoreError
from maxent_arrow.store import ReadOnlyStore

__all__ = ["export_hf", "export_ipc"]


def _check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise StoreError(f"{out}: export directory exists and is not empty")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{out}: cannot create the export directory ({exc})") from None


def _progress(items: list, enabled: bool, what: str) -> Any:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"exporting {what}", unit="file")


def export_ipc(
    root: str | os.PathLike[str] | ReadOnlyStore, out: str | Path, *, progress: bool = False
) -> list[Path]:
    """Write the run as Arrow IPC files under ``out`` (must be empty or new); returns them."""
    store = root if isinstance(root, ReadOnlyStore) else ReadOnlyStore(root)
    out = Path(out)
    _check_out(out)
    # Every column nullable, as conform makes them (an older file may lack one).
    schema = S.conform(store.schema("groups").empty_table(), store.schema("groups")).schema
    schema = schema.remove_metadata()
    written: list[Path] = []
    kinds = sorted({u.kind for u in store.units()})
    for kind in kinds:
        target = out / f"groups.{kind}.arrow"
        with pa.ipc.new_file(target, schema) as writer:
            for read in _progress(store.file_reads(kind=kind), progress, kind):
                table = read.read(None, crc=store.check_crc)
                for _, start, count in read.units:
                    writer.write_table(S.conform(table.slice(start, count), schema))
        written.append(target)
    steps = store.read_steps().replace_schema_metadata(None)
    target = out / "steps.arrow"
    with pa.ipc.new_file(target, steps.schema) as writer:
        writer.write_table(steps)
    written.append(target)
    return written


def export_hf(
    root: str | os.PathLike[str] | ReadOnlyStore, out: str | Path, *, progress: bool = False
) -> list[Path]:
    """Write the run as Hugging Face ``datasets`` on disk under ``out``; returns the dataset
    directories (``out/groups``, ``out/steps``). ``progress``: bars over the files read and
    ``datasets``' own saving bars; without it, no bar at all."""
    try:
        import datasets
    except ImportError:
        raise MissingExtraError("datasets", "dev") from None
    store = root if isinstance(root, ReadOnlyStore) else ReadOnlyStore(root)
    out = Path(out)
    _check_out(out)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=out))
    # `datasets` draws its own bars ("Saving the dataset") unless told not to: progress=False
    # means no bar at all; its global setting is put back afterwards.
    bars_were_off = datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        splits: dict[str, Any] = {}
        steps = None
        for path in export_ipc(store, tmp / "ipc", progress=progress):
            table = pa.ipc.open_file(str(path)).read_all()
            if table.num_rows == 0:
                # A kind of only 0-group steps: IPC gives columns without chunks, which
                # `datasets` cannot type; one empty chunk per column carries the type.
                table = table.schema.empty_table()
            if path.name == "steps.arrow":
                steps = datasets.Dataset(table)
            else:
                splits[path.name.split(".")[1]] = datasets.Dataset(table)
        made = []
        if splits:
            # One shard per split even when empty: datasets writes none for an empty split
            # otherwise, and then cannot load what it saved. (A dict subclass; its stubs
            # declare no mapping constructor.)
            shards = {kind: 1 for kind, split in splits.items() if split.num_rows == 0}
            dataset_dict = datasets.DatasetDict(splits)  # pyright: ignore[reportCallIssue, reportArgumentType]
            dataset_dict.save_to_disk(str(out / "groups"), num_shards=shards or None)
            made.append(out / "groups")
        if steps is not None:
            steps.save_to_disk(str(out / "steps"))
            made.append(out / "steps")
        return made
    finally:
        if not progress and not bars_were_off:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)
