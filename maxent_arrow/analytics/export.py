"""Export a saved run to other formats: Arrow IPC files, or a HuggingFace ``datasets`` dataset.

Both read the committed Parquet files one at a time (memory stays about one file), conform
each to the run's unified schema (columns an older file lacks become nulls), and write:

``ipc``
    ``DIR/groups.{kind}.arrow`` (one per kind: ``train``, ``eval``) and ``DIR/steps.arrow``,
    Arrow IPC *file* format, memory-mappable (``pa.memory_map`` + ``pa.ipc.open_file``).
``hf``
    ``DIR/groups`` (a ``DatasetDict``, one split per kind) and ``DIR/steps`` (a
    ``Dataset``), loadable with ``datasets.load_from_disk``. Map columns of the step table
    (the KL bucket maps) become ``list<struct<key, value>>``: ``datasets`` has no map
    feature, and that is a map's physical layout anyway.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.analytics.views import committed_files, file_kind, read_schemas
from maxent_arrow.arrow import schema as _schema
from maxent_arrow.errors import MissingExtraError, StoreError

__all__ = ["export_ipc", "export_hf"]


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            column = table.column(f.name)
            arrays.append(column if column.type == f.type else column.cast(f.type))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _tables(
    files: list[Path], schema: pa.Schema, *, progress: bool, what: str
) -> Iterator[tuple[Path, pa.Table]]:
    iterator: Iterable[Path] = files
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(files, desc=f"exporting {what}", unit="file")
    for path in iterator:
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise StoreError(f"{path}: not a readable Parquet file ({exc})") from None
        yield path, _conform(table.replace_schema_metadata(None), schema)


def _unified(files: list[Path], default: pa.Schema, what: str) -> pa.Schema:
    if not files:
        return default.remove_metadata()
    schemas = read_schemas(files, progress=False, what=what)
    return _schema.unify_schemas(schemas, where=what).remove_metadata()


def _check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise StoreError(f"{out}: export directory exists and is not empty")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{out}: cannot create the export directory ({exc})") from None


def export_ipc(root: str | Path, out: str | Path, *, progress: bool = False) -> list[Path]:
    """Write the run as Arrow IPC files under ``out`` (must be empty or new); returns them."""
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise StoreError(f"{root}: no such store directory")
    _check_out(out)
    written: list[Path] = []
    for table_name, default in (
        ("groups", _schema.group_schema()),
        ("steps", _schema.step_schema()),
    ):
        files = committed_files(root, table_name)
        schema = _unified(files, default, f"{root}/{table_name}")
        writers: dict[str, Any] = {}
        try:
            for path, table in _tables(files, schema, progress=progress, what=table_name):
                key = file_kind(path) if table_name == "groups" else ""
                if key not in writers:
                    name = f"groups.{key}.arrow" if key else "steps.arrow"
                    target = out / name
                    writers[key] = pa.ipc.new_file(target, schema)
                    written.append(target)
                writers[key].write_table(table)
        finally:
            for writer in writers.values():
                writer.close()
    return written


def _hf_safe(table: pa.Table) -> pa.Table:
    """Map columns as ``list<struct<key, value>>`` (``datasets`` has no map feature)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_map(field.type):
            chunks = []
            for chunk in table.column(i).chunks:
                entries = pa.StructArray.from_arrays(
                    [chunk.keys, chunk.items], names=["key", "value"]
                )
                chunks.append(
                    pa.ListArray.from_arrays(chunk.offsets, entries, mask=chunk.is_null())
                )
            table = table.set_column(i, field.name, pa.chunked_array(chunks))
    return table


def export_hf(root: str | Path, out: str | Path, *, progress: bool = False) -> list[Path]:
    """Write the run as HuggingFace ``datasets`` on disk under ``out``; returns the dataset
    directories (``out/groups``, ``out/steps``)."""
    try:
        import datasets
    except ImportError:
        raise MissingExtraError("datasets", "dev") from None
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise StoreError(f"{root}: no such store directory")
    _check_out(out)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=out))
    try:
        splits: dict[str, Any] = {}
        steps = None
        for path in export_ipc(root, tmp / "ipc", progress=progress):
            table = _hf_safe(pa.ipc.open_file(str(path)).read_all())
            if path.name == "steps.arrow":
                steps = datasets.Dataset(table)
            else:
                splits[path.name.split(".")[1]] = datasets.Dataset(table)
        made = []
        if splits:
            datasets.DatasetDict(splits).save_to_disk(str(out / "groups"))
            made.append(out / "groups")
        if steps is not None:
            steps.save_to_disk(str(out / "steps"))
            made.append(out / "steps")
        return made
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
