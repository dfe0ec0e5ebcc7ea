"""Reading a rollout store: checked file reads, unified tables, and DuckDB views."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import MissingExtraError, SchemaError, StoreError
from maxent_arrow.store.files import crc32_file

if TYPE_CHECKING:
    from maxent_arrow.store.store import OnError, RolloutStore

__all__ = ["conform", "query_arrow", "read_checked", "read_table", "run_sql"]


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: cast where types widened (new struct
    fields), nulls where a column is missing (a file written before the column existed)."""
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            column = table.column(f.name)
            arrays.append(column if column.type == f.type else column.cast(f.type))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    fields = [pa.field(f.name, f.type, nullable=True) for f in schema]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))


def read_checked(
    path: Path, meta: dict[str, Any], columns: list[str] | None, *, crc: bool
) -> pa.Table:
    """Read a group file after checking its size (always) and CRC-32 (when ``crc``) against
    what its step file recorded; any damage is a :class:`StoreError` naming the file."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(f"{path}: group file missing (its step file is committed)") from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot stat ({exc})") from None
    expected = meta.get("group_size")
    if expected is not None and size != expected:
        raise StoreError(f"{path}: size {size} bytes, expected {expected} (truncated or changed)")
    try:
        if crc and meta.get("group_crc32") is not None:
            # Streamed in chunks, so checking never holds a second copy of the file.
            got = crc32_file(path)
            if got != meta["group_crc32"]:
                raise StoreError(
                    f"{path}: CRC-32 {got:08x}, expected {meta['group_crc32']:08x} (corrupt)"
                )
        reader = pq.ParquetFile(path, page_checksum_verification=True)
        if columns is not None:
            present = set(reader.schema_arrow.names)
            columns = [c for c in columns if c in present]
        table = reader.read(columns=columns)
    except StoreError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable group file ({exc})") from None
    S.check_version((table.schema.metadata or {}).get(S.METADATA_KEY), where=str(path))
    return table


def _flat_columns(schema: pa.Schema) -> list[str]:
    return [f.name for f in schema if not (pa.types.is_list(f.type) or pa.types.is_struct(f.type))]


def read_table(
    store: RolloutStore,
    table: str,
    *,
    steps,
    columns: list[str] | None,
    filter: pc.Expression | None,
    kind: str | None,
    ranks,
    on_error: OnError,
) -> pa.Table:
    unified = store.schema(table, on_error=on_error)
    if columns is not None:
        unknown = [c for c in columns if c not in unified.names]
        if unknown:
            raise SchemaError(
                f"RolloutStore.read: unknown column(s) {unknown} in {table}; the store has "
                f"{unified.names}"
            )
    wanted = unified.names if columns is None else list(columns)
    # A filter may use the flat columns, so read them too (token columns only when asked).
    needed = wanted if filter is None else list(dict.fromkeys(wanted + _flat_columns(unified)))
    target = pa.schema([unified.field(n) for n in needed], metadata=unified.metadata)
    units = store._units(kind=kind, steps=steps, ranks=ranks, on_error=on_error)
    parts: list[pa.Table] = []
    by_file: dict[str, list] = {}
    for unit in units:
        by_file.setdefault(unit.step_file, []).append(unit)
    for step_file, members in by_file.items():
        try:
            step_table, meta = store._step_table(step_file)
            if table == "steps":
                data = step_table
                rows = [u.row for u in members]
            else:
                data = store._read_group_file(meta["group_file"], meta, needed)
                rows = None
        except StoreError as exc:
            store._fail(on_error, exc)
            continue
        if rows is not None:
            if len(rows) != data.num_rows:
                data = data.take(pa.array(rows))
        else:
            total = sum(u.num_groups for u in members)
            if total != data.num_rows:
                keep = pa.array(
                    [i for u in members for i in range(u.start, u.start + u.num_groups)]
                )
                data = data.take(keep)
        parts.append(conform(data, target))
    if not parts:
        result = target.empty_table()
    else:
        result = pa.concat_tables(parts)
    if filter is not None:
        result = result.filter(filter)
        result = result.select(wanted)
    return result.replace_schema_metadata(unified.metadata)


# ---------------------------------------------------------------------------- SQL


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _usable_files(store: RolloutStore, table: str, on_error: OnError) -> list[Path]:
    """Committed files whose recorded size matches (a cheap guard before DuckDB reads them)."""
    files = store.committed_files(table)
    if table == "steps":
        return files
    usable = []
    for path in files:
        try:
            _, meta = store._step_table(path.name)
            if path.stat().st_size != meta.get("group_size"):
                raise StoreError(f"{path}: size differs from the recorded size (truncated?)")
        except StoreError as exc:
            store._fail(on_error, exc)
            continue
        usable.append(path)
    return usable


def samples_sql(schema: pa.Schema, *, with_kind: bool = False) -> str:
    """The shared ``samples`` view (:func:`maxent_arrow.run_views.samples_view_sql`)."""
    from maxent_arrow.analytics.views import samples_view_sql

    rewards = schema.field("rewards").type if "rewards" in schema.names else []
    names = [*schema.names, "kind"] if with_kind else schema.names
    return samples_view_sql(names, [f.name for f in rewards])


def run_sql(store: RolloutStore, query: str, *, on_error: OnError) -> pa.Table:
    try:
        import duckdb
    except ImportError:
        raise MissingExtraError("duckdb", "analytics") from None
    con = duckdb.connect()
    try:
        for table in ("groups", "steps"):
            files = _usable_files(store, table, on_error)
            schema = store.schema(table, on_error=on_error)
            if files:
                listing = ", ".join("'" + str(p).replace("'", "''") + "'" for p in files)
                # Group rows carry their kind in the file name, as the analytics views do.
                kind = (
                    r", regexp_extract(filename, '\.([a-z][a-z0-9_]*)\.parquet$', 1) AS kind"
                    if table == "groups"
                    else ""
                )
                con.execute(
                    f"CREATE VIEW {table} AS SELECT * EXCLUDE (filename){kind} FROM "
                    f"read_parquet([{listing}], union_by_name = true, filename = true)"
                )
            else:
                empty = schema.empty_table()
                con.register(f"_{table}_empty", empty)
                kind = ", NULL::VARCHAR AS kind" if table == "groups" else ""
                con.execute(f"CREATE VIEW {table} AS SELECT *{kind} FROM _{table}_empty")
            if table == "groups":
                con.execute(f"CREATE VIEW samples AS {samples_sql(schema, with_kind=True)}")
        return query_arrow(con, query, owner="RolloutStore.sql")
    finally:
        con.close()


def query_arrow(con: Any, query: str, *, owner: str) -> pa.Table:
    """Run ``query`` on a DuckDB connection and return its result as one Arrow table (an empty
    table for statements without a result); DuckDB errors become :class:`StoreError`."""
    import duckdb

    try:
        result = con.sql(query)
    except duckdb.Error as exc:
        raise StoreError(f"{owner}: {exc}") from None
    if result is None:
        return pa.table({})
    out = result.arrow()
    return out.read_all() if isinstance(out, pa.RecordBatchReader) else out
