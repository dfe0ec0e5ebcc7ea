"""One schema per run: optional columns a batch lacks are written as nulls, and read back as
absent.

Every group file (and step file) of a run carries every column of the current layout, in the
layout's order, then the batch's own extra columns; an optional column the batch did not
carry is written as nulls. Plain readers that take the first file's schema (DuckDB, pyarrow
datasets) or refuse a file whose schema differs (Polars, Hugging Face ``datasets``) then read
all files of a run alike (``docs/arrow-layout.md``). Replay gives each step back as it was
appended: an optional column that is null in every row of the step reads as absent, so code
that asks "does this batch carry weights?" gets the answer it got before the append.
"""

from __future__ import annotations

import pyarrow as pa

from maxent_arrow.arrow import registry as R

__all__ = ["pad_to_layout", "strip_padding"]


_REGISTERED = frozenset(R.names(R.GROUP)) | frozenset(R.names(R.STEP))


def pad_to_layout(table: pa.Table, layout: pa.Schema) -> pa.Table:
    """``table`` with every column of ``layout`` (absent ones as nulls), in the layout's
    order, then its own extra columns; the table's schema metadata is kept. A registered
    column outside ``layout`` (another family's) that holds only nulls is padding of another
    layout and is dropped."""
    names = [
        n
        for n in table.column_names
        if n in layout.names or n not in _REGISTERED or table.column(n).null_count < table.num_rows
    ]
    fields, arrays = [], []
    for field in layout:
        if field.name in names:
            fields.append(table.schema.field(field.name))
            arrays.append(table.column(field.name))
        else:
            fields.append(pa.field(field.name, field.type, nullable=True))
            arrays.append(pa.nulls(table.num_rows, field.type))
    for name in names:
        if name not in layout.names:
            fields.append(table.schema.field(name))
            arrays.append(table.column(name))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=table.schema.metadata))


# The optional columns of each table's layout (every registered column): what reads as
# absent when it is null in every row.
_OPTIONAL = {
    table: frozenset(c.name for c in R.columns(table) if c.field.nullable)
    for table in (R.GROUP, R.STEP)
}


def strip_padding(data: pa.RecordBatch | pa.Table, table: str) -> pa.RecordBatch | pa.Table:
    """``data`` (rows of the ``table`` table: ``R.GROUP`` or ``R.STEP``) without the optional
    columns of its layout that are null in every row (the padding :func:`pad_to_layout`
    wrote). Columns the layout requires, and columns outside it, stay."""
    if data.num_rows == 0:
        return data
    optional = _OPTIONAL[table]
    rows = data.num_rows
    drop = {
        i
        for i, name in enumerate(data.schema.names)
        if name in optional and data.column(i).null_count == rows
    }
    if not drop:
        return data
    return data.select([i for i in range(data.num_columns) if i not in drop])
